//! Worker configuration: every knob of the simulated engine, its timing model and its faults.

use std::time::Duration;

/// How KV events are encoded on the wire (vLLM changed the shape in 0.24).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EventEncoding {
    /// `{"type": "BlockStored", ...}` maps as vLLM 0.32 sends them (the default): `BlockStored`
    /// also carries `extra_keys`, `group_idx` and `kv_cache_spec_kind`, `BlockRemoved` `group_idx`.
    #[default]
    Map,
    /// The maps of vLLM 0.24 (before those fields): `BlockStored` ends at `lora_name`,
    /// `BlockRemoved` at `medium`.
    MapV024,
    /// Tagged positional arrays `["BlockStored", ...]` (vLLM <= 0.23).
    Array,
}

impl EventEncoding {
    pub fn name(self) -> &'static str {
        match self {
            Self::Map => "map",
            Self::MapV024 => "map-0.24",
            Self::Array => "array",
        }
    }
}

/// vLLM's `--scheduling-policy`: the order of the waiting queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// First come, first served (vLLM's default); a request with `priority` != 0 is refused.
    #[default]
    Fcfs,
    /// Waiting requests by (`priority`, arrival), lower value first; a running request short of
    /// KV blocks preempts the lowest-priority running request (recomputed later). A waiting
    /// request preempts nobody, whatever its priority (vLLM 0.32's v1 scheduler).
    Priority,
}

impl std::str::FromStr for SchedulingPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fcfs" => Ok(Self::Fcfs),
            "priority" => Ok(Self::Priority),
            other => Err(format!(
                "unknown scheduling policy {other:?} (expected fcfs|priority)"
            )),
        }
    }
}

impl std::str::FromStr for EventEncoding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "map" => Ok(Self::Map),
            "map-0.24" => Ok(Self::MapV024),
            "array" => Ok(Self::Array),
            other => Err(format!(
                "unknown KV event encoding {other:?} (expected map|map-0.24|array)"
            )),
        }
    }
}

/// Per-step latency model. Times are milliseconds before the speed-up is applied.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimingModel {
    /// prefill ms = a·T² + b·T + c for T new prompt tokens in the step.
    pub prefill: [f64; 3],
    /// decode ms = a·p² + b·p + c for KV usage fraction p (floored at `decode_min_ms`).
    pub decode: [f64; 3],
    pub decode_min_ms: f64,
}

impl Default for TimingModel {
    /// The public Dynamo mocker fit (see docs/sim.md).
    fn default() -> Self {
        Self {
            prefill: [4.209989e-7, 0.01518344, 16.50142],
            decode: [-25.74, 54.01, 5.74],
            decode_min_ms: 1.0,
        }
    }
}

impl TimingModel {
    pub fn prefill_ms(&self, new_tokens: usize) -> f64 {
        let t = new_tokens as f64;
        let [a, b, c] = self.prefill;
        (a * t * t + b * t + c).max(0.0)
    }

    pub fn decode_ms(&self, kv_usage: f64) -> f64 {
        let p = kv_usage.clamp(0.0, 1.0);
        let [a, b, c] = self.decode;
        (a * p * p + b * p + c).max(self.decode_min_ms)
    }

    /// Wall time of one scheduler step. A step that carries prompt tokens costs the prefill
    /// fit (decode tokens ride along in the same forward pass), but never less than a decode step.
    pub fn step_ms(&self, prefill_tokens: usize, decode_seqs: usize, kv_usage: f64) -> f64 {
        let decode = if decode_seqs > 0 || prefill_tokens > 0 {
            self.decode_ms(kv_usage)
        } else {
            0.0
        };
        if prefill_tokens > 0 {
            self.prefill_ms(prefill_tokens).max(decode)
        } else {
            decode
        }
    }
}

/// What `--crash-after N` does once a request has produced N tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CrashMode {
    /// Abort that response stream mid-way (connection closed without `[DONE]`).
    #[default]
    Stream,
    /// Exit the whole process (status 101), like a worker dying under load.
    Exit,
}

impl std::str::FromStr for CrashMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stream" => Ok(Self::Stream),
            "exit" | "process" => Ok(Self::Exit),
            other => Err(format!(
                "unknown crash mode {other:?} (expected stream|exit)"
            )),
        }
    }
}

/// Fault injection for reliability tests. Everything is off by default.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Faults {
    /// Probability (0..1) that a completion request is answered with a 500 or 503.
    pub fail_rate: f64,
    /// After this many generated tokens of one request, crash per `crash_mode`.
    pub crash_after: Option<u32>,
    pub crash_mode: CrashMode,
    /// Delay before a completion request is admitted (a stalled worker).
    pub stall: Duration,
    /// Delay before `/metrics` answers.
    pub metrics_delay: Duration,
    /// Probability (0..1) that a malformed KV-event message is published before each real batch.
    pub garbage_events: f64,
    /// Step times multiplied by a factor once the worker has received a number of requests (a
    /// slower GPU, a noisy neighbour arriving mid-run).
    pub slowdown: Option<Slowdown>,
}

/// `--slowdown F --slowdown-after N [--slowdown-worker I] [--slowdown-for SECS]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slowdown {
    /// Every step takes this many times longer (2 = half speed).
    pub factor: f64,
    /// ... from the worker's N-th completion request on (0 = from the start).
    pub after_requests: u64,
    /// In a fleet, only worker I slows down (`None` = every worker).
    pub worker: Option<usize>,
    /// ... and recovers this long after the slowdown began (`None` = never).
    pub lasts: Option<Duration>,
}

/// Which leg of a prefill/decode split this worker serves (`--role`). vLLM's own `kv_role` is a
/// placeholder (every NIXL worker is `kv_both`; the proxy decides), so the sim's role is a guard that
/// catches a router sending a leg to the wrong pool: a `prefill` worker refuses
/// `do_remote_prefill`, a `decode` worker refuses `do_remote_decode` (400). Plain requests are
/// served by every role (conditional disaggregation runs them on decode workers).
pub use kvgate_protocol::pd::Role;

/// What a decode worker does when it cannot read the prompt's KV from the prefill worker
/// (vLLM's `kv_load_failure_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LoadFailurePolicy {
    /// Fail the request (500), as vLLM's documented examples configure.
    #[default]
    Fail,
    /// Recompute the whole prompt locally.
    Recompute,
}

impl std::str::FromStr for LoadFailurePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fail" => Ok(Self::Fail),
            "recompute" => Ok(Self::Recompute),
            other => Err(format!(
                "unknown kv load failure policy {other:?} (expected fail|recompute)"
            )),
        }
    }
}

/// Which engine's handoff a `prefill`/`decode` worker speaks (`--pd-protocol`).
pub use kvgate_protocol::pd::Handoff as PdProtocol;

/// Prefill/decode disaggregation: vLLM NixlConnector semantics by default, SGLang's bootstrap
/// rendezvous with `protocol = Sglang` (docs/sim.md, "PD").
#[derive(Clone, Debug, PartialEq)]
pub struct PdConfig {
    pub role: Role,
    pub protocol: PdProtocol,
    /// SGLang: how long a leg waits for its partner leg with the same `bootstrap_room` before it
    /// fails (SGLang's `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, default 300 s). Real time.
    pub bootstrap_timeout: Duration,
    /// SGLang: the bootstrap port a decode leg uses when the router sent `bootstrap_port: null`
    /// (SGLang substitutes its own `--disaggregation-bootstrap-port`, default 8998). The sim serves
    /// the rendezvous on each worker's HTTP port, so this names the prefill worker's HTTP port;
    /// `None`: a null port is refused with 400.
    pub bootstrap_port: Option<u16>,
    /// How long a prefill worker keeps a finished `do_remote_decode` request's blocks pinned for a
    /// decode worker to read (vLLM `kv_lease_duration`, default 30 s). Real time, not scaled.
    pub kv_lease: Duration,
    /// KV bytes per token: layers × 2 × kv_heads × head_dim × dtype bytes (default Llama-3.1-8B
    /// bf16: 32 × 2 × 8 × 128 × 2 = 131072).
    pub kv_bytes_per_token: u64,
    /// Transfer bandwidth in GB/s (10^9 bytes/s; Dynamo mocker default 64, inter-node IB).
    pub kv_transfer_gbps: f64,
    /// Fixed cost per transfer in ms (setup, RDMA post; reference §7: 0.5–2 ms over RDMA).
    pub kv_transfer_fixed_ms: f64,
    pub load_failure_policy: LoadFailurePolicy,
    /// Fault: probability that a `do_remote_decode` (prefill leg) request is answered with a 500.
    pub prefill_fail_rate: f64,
    /// Fault: probability that a prefill leg returns `kv_transfer_params: null` (as when the one
    /// token was EOS); its blocks are freed at once.
    pub no_params_rate: f64,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            role: Role::Both,
            protocol: PdProtocol::Vllm,
            bootstrap_timeout: Duration::from_secs(300),
            bootstrap_port: None,
            kv_lease: Duration::from_secs(30),
            kv_bytes_per_token: 32 * 2 * 8 * 128 * 2,
            kv_transfer_gbps: 64.0,
            kv_transfer_fixed_ms: 1.0,
            load_failure_policy: LoadFailurePolicy::Fail,
            prefill_fail_rate: 0.0,
            no_params_rate: 0.0,
        }
    }
}

impl PdConfig {
    /// Model milliseconds to move `tokens` tokens of KV: fixed + bytes / bandwidth (reference §7).
    pub fn transfer_ms(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let bytes = tokens as f64 * self.kv_bytes_per_token as f64;
        self.kv_transfer_fixed_ms + bytes / (self.kv_transfer_gbps * 1e9) * 1000.0
    }
}

/// Everything one simulated worker needs. `Default` mirrors vLLM's defaults where they exist.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Served model name (`/v1/models`, metric label `model_name`).
    pub model: String,
    pub block_size: usize,
    /// KV-cache capacity in blocks (block 0 is reserved as vLLM's null block).
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// vLLM `--scheduling-policy` (fcfs or priority).
    pub scheduling_policy: SchedulingPolicy,
    /// Prompt + output tokens allowed per request; `None` = everything the cache can hold.
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    /// Timing divisor: 1 = the fitted GPU speed, 100 = a hundred times faster, 0 = no delay at all.
    pub speedup: f64,
    pub timing: TimingModel,
    /// Seeds the engine's block hash and the generated tokens (same seed → same outputs).
    pub seed: u64,
    /// Mean output length when the request does not set `ignore_eos` (the "natural" stop).
    pub mean_output_tokens: u32,
    /// Publish KV events over ZMQ (needs an events address at spawn time).
    pub kv_events: bool,
    pub kv_events_encoding: EventEncoding,
    pub kv_events_topic: String,
    /// Batches kept for replay (vLLM `buffer_steps`).
    pub kv_events_buffer_steps: usize,
    /// `data_parallel_rank` in event batches and the `engine` metric label.
    pub dp_rank: u32,
    /// Path of a HuggingFace `tokenizer.json`; `None` = the cheap deterministic tokenizer.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Render chats with ChatML even when the tokenizer's directory has a chat template (the
    /// sim's behaviour before it followed vLLM 0.32, which uses the model's template).
    pub tokenizer_chatml: bool,
    /// Serve an emulated dcgm-exporter at `/dcgm/metrics` (figures follow the simulated load).
    pub dcgm: bool,
    /// OTLP collector for engine spans (`--otlp-traces-endpoint`); `None` = no export (the
    /// `traceparent`s received are still recorded at `/sim/traceparents`).
    pub otlp_traces_endpoint: Option<String>,
    /// Speculative tokens per decode step (vLLM `num_speculative_tokens`); > 0 adds the
    /// `vllm:spec_decode_*` counters. Counters only: the timing model is unchanged.
    pub spec_tokens: u32,
    pub faults: Faults,
    /// Prefill/decode disaggregation (role, lease, transfer model, PD faults).
    pub pd: PdConfig,
    /// Keep Responses-API responses for `previous_response_id`, GET, cancel and background mode
    /// (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`; off by default as in vLLM, and then `store`
    /// is silently ignored).
    pub responses_store: bool,
    /// `--assume-cached-header`: honour the request header `x-kvgate-sim-cached-tokens: N` (the
    /// first N / block_size full prompt blocks count as cached on this worker; see docs/sim.md).
    /// Off: the header is ignored.
    pub assume_cached_header: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "kvgate-sim".into(),
            block_size: 16,
            num_gpu_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: None,
            scheduling_policy: SchedulingPolicy::Fcfs,
            enable_prefix_caching: true,
            speedup: 1.0,
            timing: TimingModel::default(),
            seed: 0,
            mean_output_tokens: 128,
            kv_events: true,
            kv_events_encoding: EventEncoding::Map,
            kv_events_topic: String::new(),
            kv_events_buffer_steps: 10_000,
            dp_rank: 0,
            tokenizer: None,
            tokenizer_chatml: false,
            dcgm: false,
            otlp_traces_endpoint: None,
            spec_tokens: 0,
            faults: Faults::default(),
            pd: PdConfig::default(),
            responses_store: false,
            assume_cached_header: false,
        }
    }
}

macro_rules! setters {
    ($($name:ident: $ty:ty),* $(,)?) => {
        $(
            #[doc = concat!("Sets `", stringify!($name), "`.")]
            pub fn $name(mut self, v: impl Into<$ty>) -> Self {
                self.$name = v.into();
                self
            }
        )*
    };
}

impl SimConfig {
    setters! {
        model: String, block_size: usize, num_gpu_blocks: usize, max_num_seqs: usize,
        max_num_batched_tokens: usize, max_model_len: Option<usize>, enable_prefix_caching: bool,
        speedup: f64, timing: TimingModel, seed: u64, mean_output_tokens: u32, kv_events: bool,
        kv_events_encoding: EventEncoding, kv_events_topic: String, dp_rank: u32, faults: Faults,
        kv_events_buffer_steps: usize, pd: PdConfig, scheduling_policy: SchedulingPolicy,
        responses_store: bool, assume_cached_header: bool,
    }

    /// Usable blocks (vLLM keeps one null block out of the pool).
    pub fn usable_blocks(&self) -> usize {
        self.num_gpu_blocks.saturating_sub(1)
    }

    /// Longest prompt + output a request may ask for.
    pub fn effective_max_model_len(&self) -> usize {
        let cap = self.usable_blocks() * self.block_size;
        self.max_model_len.map_or(cap, |m| m.min(cap))
    }

    /// Rejects configurations the engine cannot run.
    pub fn validate(&self) -> anyhow::Result<()> {
        if let Some(e) = &self.otlp_traces_endpoint {
            kvgate_http::otlp::Target::parse(e)
                .map_err(|why| anyhow::anyhow!("--otlp-traces-endpoint: {why}"))?;
        }
        anyhow::ensure!(self.block_size > 0, "block_size must be > 0");
        anyhow::ensure!(self.num_gpu_blocks >= 2, "num_gpu_blocks must be >= 2");
        anyhow::ensure!(self.max_num_seqs > 0, "max_num_seqs must be > 0");
        anyhow::ensure!(
            self.max_num_batched_tokens > 0,
            "max_num_batched_tokens must be > 0"
        );
        anyhow::ensure!(
            self.speedup >= 0.0 && self.speedup.is_finite(),
            "speedup must be a finite number >= 0"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.faults.fail_rate),
            "fail_rate must be within 0..=1"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.faults.garbage_events),
            "garbage_events must be within 0..=1"
        );
        if let Some(sd) = self.faults.slowdown {
            anyhow::ensure!(
                sd.factor.is_finite() && sd.factor > 0.0,
                "slowdown factor must be a finite number > 0"
            );
        }
        let pd = &self.pd;
        anyhow::ensure!(
            pd.kv_transfer_gbps.is_finite() && pd.kv_transfer_gbps > 0.0,
            "kv_transfer_gbps must be a finite number > 0"
        );
        anyhow::ensure!(
            pd.kv_transfer_fixed_ms.is_finite() && pd.kv_transfer_fixed_ms >= 0.0,
            "kv_transfer_fixed_ms must be a finite number >= 0"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&pd.prefill_fail_rate) && (0.0..=1.0).contains(&pd.no_params_rate),
            "PD fault rates must be within 0..=1"
        );
        anyhow::ensure!(
            self.kv_events_buffer_steps > 0,
            "kv_events_buffer_steps must be > 0"
        );
        Ok(())
    }

    /// Real time of `ms` model milliseconds after the speed-up (`None` = do not wait).
    pub fn scaled(&self, ms: f64) -> Option<Duration> {
        if self.speedup == 0.0 || ms <= 0.0 {
            return None;
        }
        Some(Duration::from_secs_f64(ms / self.speedup / 1000.0))
    }
}
