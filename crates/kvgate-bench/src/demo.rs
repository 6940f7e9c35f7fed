//! `kvgate demo`: a simulated fleet, a shared-prefix workload, three policies, one table
//! (`--replicas N`: plus `kv` as N replicas without and with cluster mode).

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
    let (workers, rate, speedup) = (
        d.workers.to_string(),
        d.rate.to_string(),
        d.speedup.to_string(),
    );
    let requests = d.requests.map(|n| n.to_string());
    let n = d.replicas;
    let policies = if n > 1 {
        format!(
            "round_robin,least_loaded,kv,kv_x{n}_no_cluster=kv:replicas={n}:cluster=false,\
             kv_x{n}_cluster=kv:replicas={n}"
        )
    } else {
        "round_robin,least_loaded,kv".to_owned()
    };
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
        "400",
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
    P::parse_from(argv).c
}

pub async fn run(d: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(d.workers > 0, "--workers must be > 0");
    anyhow::ensure!(d.requests != Some(0), "--requests must be > 0");
    anyhow::ensure!(d.replicas > 0, "--replicas must be > 0");
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
    let args = demo_args(&d, out.clone());
    eprintln!(
        "kvgate demo: {} simulated workers, shared-prefix workload ({} groups x {} prompts), policies {}",
        args.fleet.workers,
        args.workload.groups,
        args.workload.prompts_per_group,
        args.policies.join(", ")
    );
    crate::compare::run(args).await?;
    println!(
        "plots: {}/ttft_cdf.svg and {}/worker_load.svg",
        out.display(),
        out.display()
    );
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
    }
}
