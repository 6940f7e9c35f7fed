//! `kvgate sim`: one worker (`--port`) or a fleet (`--workers N --base-port P`) in one process.
//! Prints one machine-parsable line per worker, then serves until Ctrl-C / SIGTERM.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::config::{
    CrashMode, EventEncoding, Faults, LoadFailurePolicy, PdConfig, PdProtocol, Role,
    SchedulingPolicy, SimConfig, Slowdown, TimingModel,
};
use crate::fleet::{describe, FleetPorts, SimFleet};

fn coeffs(s: &str) -> Result<[f64; 3], String> {
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>().map_err(|e| format!("{x:?}: {e}")))
        .collect::<Result<_, _>>()?;
    <[f64; 3]>::try_from(v).map_err(|_| "expected three comma-separated numbers a,b,c".to_string())
}

fn seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
    Duration::try_from_secs_f64(v).map_err(|_| format!("{s:?}: expected seconds >= 0"))
}

#[derive(clap::Args, Debug)]
pub struct SimArgs {
    /// Address to bind (HTTP and ZMQ).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// HTTP port of a single worker (0 = ephemeral).
    #[arg(long, default_value_t = 8000, conflicts_with = "base_port")]
    pub port: u16,
    /// KV-event PUB port of a single worker (default: HTTP port + 1000; replay socket = this + 100).
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// Run N workers in this process (worker i on --base-port + i).
    #[arg(long)]
    pub workers: Option<usize>,
    /// First HTTP port of a fleet (events on base + 1000 + i, replay on base + 1100 + i).
    #[arg(long)]
    pub base_port: Option<u16>,
    /// First KV-event port of a fleet (overrides base + 1000).
    #[arg(long)]
    pub kv_events_base_port: Option<u16>,
    /// Do not publish KV events.
    #[arg(long)]
    pub no_kv_events: bool,
    /// KV-event encoding: map (vLLM 0.32's maps), map-0.24 (the maps of vLLM 0.24..0.31, without
    /// extra_keys/group_idx/kv_cache_spec_kind) or array (vLLM <= 0.23).
    #[arg(long, default_value = "map")]
    pub kv_events_encoding: EventEncoding,
    /// KV-event topic (first frame).
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Served model name.
    #[arg(long, default_value = "kvgate-sim")]
    pub model: String,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long, default_value_t = 16_384)]
    pub num_gpu_blocks: usize,
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// vLLM's --scheduling-policy: fcfs, or priority (waiting queue by the body's `priority`,
    /// lower first; a running request short of KV blocks preempts the lowest-priority one).
    #[arg(long, default_value = "fcfs")]
    pub scheduling_policy: SchedulingPolicy,
    /// Longest prompt + output (default: what the KV cache holds).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Honour the request header `x-kvgate-sim-cached-tokens: N`: the prompt's first N / block_size
    /// full blocks count as cached on this worker (allocated and reported stored if not held, no
    /// prefill time for them), as `kvgate bench compare --loaded-floor` needs. Off: ignored.
    #[arg(long, conflicts_with = "no_prefix_caching")]
    pub assume_cached_header: bool,
    /// Divide every step time by this (0 = no delay).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Prefill fit a,b,c: ms = a·T² + b·T + c (default: the Dynamo mocker fit).
    #[arg(long, value_parser = coeffs)]
    pub prefill_coeffs: Option<[f64; 3]>,
    /// Decode fit a,b,c: ms = a·p² + b·p + c for KV usage p.
    #[arg(long, value_parser = coeffs)]
    pub decode_coeffs: Option<[f64; 3]>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Mean output length when a request does not set ignore_eos.
    #[arg(long, default_value_t = 128)]
    pub mean_output_tokens: u32,
    /// HuggingFace tokenizer.json (default: a cheap deterministic approximation). Chats are
    /// rendered with the chat template of the tokenizer_config.json beside it, as vLLM does.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Render chats with ChatML even when the tokenizer has a chat template (the sim before it
    /// followed vLLM 0.32).
    #[arg(long, requires = "tokenizer")]
    pub tokenizer_chatml: bool,
    /// Fault: probability of answering a completion with 500/503.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Fault: crash after N generated tokens of a request (see --crash-mode).
    #[arg(long)]
    pub crash_after: Option<u32>,
    /// stream = cut that response off; exit = exit the process.
    #[arg(long, default_value = "stream")]
    pub crash_mode: CrashMode,
    /// Fault: delay every completion request by this many ms before it is admitted.
    #[arg(long, default_value_t = 0)]
    pub stall_ms: u64,
    /// Serve an emulated dcgm-exporter at /dcgm/metrics whose figures follow the simulated load.
    #[arg(long)]
    pub dcgm: bool,
    /// Export an engine span per request to this OTLP collector (`http://host:port` base for
    /// OTLP/HTTP, `grpc://host:port` for OTLP/gRPC), as vLLM's `--otlp-traces-endpoint`; the span's
    /// parent is the request's `traceparent`.
    #[arg(long)]
    pub otlp_traces_endpoint: Option<String>,
    /// Report speculative decoding with N draft tokens per decode step (`vllm:spec_decode_*`
    /// counters, a fixed pattern of acceptances; timing unchanged). 0 = off, as in vLLM.
    #[arg(long, default_value_t = 0)]
    pub spec_tokens: u32,
    /// Fault: delay /metrics by this many ms.
    #[arg(long, default_value_t = 0)]
    pub metrics_delay_ms: u64,
    /// Fault: probability of a malformed KV-event message before each real batch.
    #[arg(long, default_value_t = 0.0)]
    pub garbage_events: f64,
    /// Fault: multiply every step time by F (a slower GPU) once --slowdown-after requests arrived.
    #[arg(long)]
    pub slowdown: Option<f64>,
    /// Fault: the slowdown starts with the worker's N-th completion request (0 = from the start).
    #[arg(long, default_value_t = 0, requires = "slowdown")]
    pub slowdown_after: u64,
    /// Fault: in a fleet, only worker I slows down (default: every worker).
    #[arg(long, requires = "slowdown")]
    pub slowdown_worker: Option<usize>,
    /// Fault: the slowdown ends this many seconds after it began (a noisy neighbour leaving;
    /// default: it never ends).
    #[arg(long, requires = "slowdown", value_parser = seconds)]
    pub slowdown_for: Option<Duration>,
    /// Prefill/decode role: prefill refuses decode legs, decode refuses prefill legs, both serves
    /// everything (vLLM NIXL semantics; see docs/sim.md "PD").
    #[arg(long, default_value = "both")]
    pub role: Role,
    /// In a fleet (--workers N): workers 0..P get role prefill, the rest role decode.
    #[arg(long, requires = "workers", conflicts_with = "role")]
    pub prefill_workers: Option<usize>,
    /// How long a finished prefill leg's blocks stay pinned for a decode worker (vLLM
    /// kv_lease_duration; real milliseconds, not divided by --speedup).
    #[arg(long, default_value_t = 30_000)]
    pub kv_lease_ms: u64,
    /// KV bytes per token = layers x 2 x kv_heads x head_dim x dtype bytes (default Llama-3.1-8B bf16).
    #[arg(long, default_value_t = 131_072)]
    pub kv_bytes_per_token: u64,
    /// KV transfer bandwidth in GB/s (a low value = the slow-transfer fault).
    #[arg(long, default_value_t = 64.0)]
    pub kv_transfer_gbps: f64,
    /// Fixed cost of one KV transfer in ms.
    #[arg(long, default_value_t = 1.0)]
    pub kv_transfer_fixed_ms: f64,
    /// What a decode worker does when it cannot read the remote KV: fail (500) or recompute.
    #[arg(long, default_value = "fail")]
    pub kv_load_failure_policy: LoadFailurePolicy,
    /// Fault: probability that a prefill leg (do_remote_decode) is answered with a 500.
    #[arg(long, default_value_t = 0.0)]
    pub pd_prefill_fail_rate: f64,
    /// Fault: probability that a prefill leg returns kv_transfer_params: null.
    #[arg(long, default_value_t = 0.0)]
    pub pd_no_params_rate: f64,
    /// Handoff a prefill/decode worker speaks: vllm (NixlConnector, kv_transfer_params) or sglang
    /// (both legs at once with bootstrap_host/bootstrap_port/bootstrap_room).
    #[arg(long, default_value = "vllm")]
    pub pd_protocol: PdProtocol,
    /// SGLang: how long a leg waits for its partner leg (same bootstrap_room) before failing, in
    /// real milliseconds (SGLang's bootstrap timeout, 300 s).
    #[arg(long, default_value_t = 300_000)]
    pub bootstrap_timeout_ms: u64,
    /// SGLang: the bootstrap port a decode leg uses when the router sent `bootstrap_port: null`
    /// (SGLang's --disaggregation-bootstrap-port). The sim serves the rendezvous on the prefill
    /// worker's HTTP port, so give that port (one prefill worker per host, as with SGLang's
    /// shared default); unset, a null bootstrap_port is refused with 400.
    #[arg(long)]
    pub disaggregation_bootstrap_port: Option<u16>,
}

impl SimArgs {
    pub fn config(&self) -> SimConfig {
        let d = TimingModel::default();
        SimConfig {
            model: self.model.clone(),
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            scheduling_policy: self.scheduling_policy,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_prefix_caching,
            assume_cached_header: self.assume_cached_header,
            speedup: self.speedup,
            timing: TimingModel {
                prefill: self.prefill_coeffs.unwrap_or(d.prefill),
                decode: self.decode_coeffs.unwrap_or(d.decode),
                ..d
            },
            seed: self.seed,
            mean_output_tokens: self.mean_output_tokens,
            kv_events: !self.no_kv_events,
            kv_events_encoding: self.kv_events_encoding,
            kv_events_topic: self.kv_events_topic.clone(),
            tokenizer: self.tokenizer.clone(),
            tokenizer_chatml: self.tokenizer_chatml,
            dcgm: self.dcgm,
            otlp_traces_endpoint: self.otlp_traces_endpoint.clone(),
            spec_tokens: self.spec_tokens,
            faults: Faults {
                fail_rate: self.fail_rate,
                crash_after: self.crash_after,
                crash_mode: self.crash_mode,
                stall: Duration::from_millis(self.stall_ms),
                metrics_delay: Duration::from_millis(self.metrics_delay_ms),
                garbage_events: self.garbage_events,
                slowdown: self.slowdown.map(|factor| Slowdown {
                    factor,
                    after_requests: self.slowdown_after,
                    worker: self.slowdown_worker,
                    lasts: self.slowdown_for,
                }),
            },
            pd: PdConfig {
                role: self.role,
                protocol: self.pd_protocol,
                bootstrap_timeout: Duration::from_millis(self.bootstrap_timeout_ms),
                bootstrap_port: self.disaggregation_bootstrap_port,
                kv_lease: Duration::from_millis(self.kv_lease_ms),
                kv_bytes_per_token: self.kv_bytes_per_token,
                kv_transfer_gbps: self.kv_transfer_gbps,
                kv_transfer_fixed_ms: self.kv_transfer_fixed_ms,
                load_failure_policy: self.kv_load_failure_policy,
                prefill_fail_rate: self.pd_prefill_fail_rate,
                no_params_rate: self.pd_no_params_rate,
            },
            ..SimConfig::default()
        }
    }
}

/// `VLLM_ENABLE_RESPONSES_API_STORE` read as vLLM reads it: `bool(int(value))`, default 0; a
/// value that is not an integer stops the start (vLLM fails the same way).
pub fn responses_store_from_env(value: Option<&str>) -> anyhow::Result<bool> {
    let Some(v) = value else {
        return Ok(false);
    };
    v.trim().parse::<i64>().map(|n| n != 0).map_err(|_| {
        anyhow::anyhow!("VLLM_ENABLE_RESPONSES_API_STORE must be an integer (0 or 1), got {v:?}")
    })
}

pub async fn run(args: SimArgs) -> anyhow::Result<()> {
    let mut cfg = args.config();
    cfg.responses_store = responses_store_from_env(
        std::env::var("VLLM_ENABLE_RESPONSES_API_STORE")
            .ok()
            .as_deref(),
    )?;
    let (n, ports) = match (args.workers, args.base_port) {
        (Some(n), base) => (
            n,
            FleetPorts {
                host: args.host,
                http_base: base.unwrap_or(args.port),
                kv_base: args.kv_events_base_port,
            },
        ),
        (None, Some(base)) => (
            1,
            FleetPorts {
                host: args.host,
                http_base: base,
                kv_base: args.kv_events_base_port,
            },
        ),
        (None, None) => (
            1,
            FleetPorts {
                host: args.host,
                http_base: args.port,
                kv_base: args.kv_events_port.or(args.kv_events_base_port),
            },
        ),
    };
    let fleet = SimFleet::spawn_pd(n, args.prefill_workers, cfg, ports).await?;
    for (i, w) in fleet.workers().iter().enumerate() {
        println!("{}", describe(i, w));
    }
    println!("ready");
    wait_for_signal().await;
    eprintln!("kvgate sim: stopping");
    let t = std::time::Instant::now();
    fleet.shutdown().await;
    eprintln!("kvgate sim: stopped in {} ms", t.elapsed().as_millis());
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
