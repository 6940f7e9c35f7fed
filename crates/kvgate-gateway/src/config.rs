//! Gateway configuration: the TOML file, merged with CLI flags and `KVGATE_*` environment variables.
//!
//! Every table rejects unknown keys (`deny_unknown_fields`), so a typo fails loudly with the key's
//! name. Durations are written in milliseconds (`*_ms`) or seconds (`*_s`) so the unit is in the key.
//! Reloadable: `[[workers]]`, `[[worker_pools]]`, `[routing]`, `[admission]`, `[retry]`, `[slo]`,
//! `[auth]`, `[models]`, `[cache]`, `[pd]`, `[flow_control]`, and `[tracing]`'s sampling.
//! Restart needed: `[server]` (listen address, TLS, limits), `[admin]`, `[upstream]` and
//! `[cluster]`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
pub use kvgate_protocol::pd::Handoff;
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: AdminConfig,
    pub auth: AuthConfig,
    pub routing: RoutingConfig,
    pub admission: AdmissionConfig,
    pub retry: RetryConfig,
    pub upstream: UpstreamConfig,
    pub cache: CacheConfig,
    pub slo: SloConfig,
    pub flow_control: FlowControlConfig,
    /// Prefill/decode disaggregation (pools with `role = "prefill"` workers).
    pub pd: PdConfig,
    /// Per-model settings keyed by the model name clients send.
    pub models: BTreeMap<String, ModelConfig>,
    pub workers: Vec<WorkerConfig>,
    /// Worker pools given as a DNS name (e.g. a headless Service), re-resolved periodically.
    pub worker_pools: Vec<WorkerPoolConfig>,
    /// Replica sync over NATS (off without `nats_url`). Restart needed.
    pub cluster: ClusterSection,
    /// Responses API: response id → origin worker. Restart needed.
    pub response_pins: ResponsePinsConfig,
    /// `kvgate epp`: the Envoy ext_proc endpoint picker's listener (docs/epp.md). Restart needed.
    pub epp: EppConfig,
    /// Distributed tracing: W3C trace context and OTLP export (off without `otlp_endpoint`).
    pub tracing: TracingConfig,
}

/// `[epp]`: the endpoint picker (`kvgate epp`). `kvgate serve` ignores it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EppConfig {
    /// The ext_proc gRPC listener (HTTP/2: h2c, or TLS with `tls`).
    pub listen: SocketAddr,
    /// Serve TLS (ALPN h2) on `listen` instead of plaintext h2c.
    pub tls: Option<TlsConfig>,
    /// Endpoints in `x-gateway-destination-endpoint`: the pick, then fallbacks in order (>= 1).
    pub fallback_endpoints: usize,
    /// Largest gRPC message accepted from the gateway (a BUFFERED body arrives in one message).
    pub max_message_bytes: usize,
    /// `[[epp.model_rewrites]]`: llm-d's `InferenceModelRewrite` rules (`epp/rewrite.rs`).
    pub model_rewrites: Vec<ModelRewriteConfig>,
}

/// One `[[epp.model_rewrites]]` rule: requests for one of `models` (none listed: any model) go
/// to one of `targets`, picked at random by weight.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRewriteConfig {
    /// Client-facing model names this rule matches exactly; empty = every model.
    #[serde(default)]
    pub models: Vec<String>,
    pub targets: Vec<RewriteTargetConfig>,
}

/// A rewrite target: the model name the worker gets, and its share of the rule's requests.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewriteTargetConfig {
    pub model: String,
    /// 1..=1,000,000 (as `InferenceModelRewrite`).
    #[serde(default = "one")]
    pub weight: u32,
}

fn one() -> u32 {
    1
}

impl Default for EppConfig {
    fn default() -> Self {
        EppConfig {
            listen: "127.0.0.1:9002".parse().expect("static addr"),
            tls: None,
            fallback_endpoints: 3,
            max_message_bytes: (8 << 20) + (64 << 10),
            model_rewrites: Vec::new(),
        }
    }
}

/// `[tracing]`: spans of every request to an OpenTelemetry collector (docs/tracing.md). The
/// sampling keys are reloadable; the endpoint, service name and queue bounds need a restart.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// `http://host:port[/base]` (OTLP/HTTP protobuf to `{base}/v1/traces`) or `grpc://host:port`
    /// (OTLP/gRPC); `https://` and `grpcs://` for the same over TLS; empty = tracing off.
    pub otlp_endpoint: String,
    /// PEM certificates trusted for a TLS collector (`https://`, `grpcs://`); unset: the
    /// system's bundle.
    pub ca_file: Option<std::path::PathBuf>,
    /// Top candidates a sampled request's route span lists (the chosen worker and the best
    /// others), 0 to 32; 0 lists none.
    pub route_candidates: u8,
    /// Share of requests without a sampled parent whose trace is exported, 0 to 1.
    pub sample_ratio: f64,
    /// A request with a valid `traceparent` follows its caller's sampled flag.
    pub parent_based: bool,
    /// Export the spans of a request that failed (5xx, 429, stream error) even when unsampled.
    pub always_errors: bool,
    /// The resource's `service.name`.
    pub service_name: String,
    /// Finished requests' span batches waiting for export; beyond it they are dropped (counted).
    pub queue_size: usize,
    /// Most spans per export request.
    pub max_batch_spans: usize,
    /// Longest a span waits for its batch to fill before it is sent.
    pub batch_delay_ms: u64,
    /// Time limit of one export request (connect, send, answer).
    pub export_timeout_ms: u64,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: String::new(),
            ca_file: None,
            route_candidates: 4,
            sample_ratio: 1.0,
            parent_based: true,
            always_errors: true,
            service_name: "kvgate".into(),
            queue_size: 2048,
            max_batch_spans: 512,
            batch_delay_ms: 1000,
            export_timeout_ms: 5000,
        }
    }
}

/// `[cluster]`: N gateway replicas share routing state over NATS (docs/cluster.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// `nats://host:4222`; empty = cluster mode off (one replica, exactly as without the section).
    pub nats_url: String,
    /// This replica's id (default: the hostname, e.g. the pod name).
    pub replica_id: Option<String>,
    /// Subjects are `<prefix>.msg` and `<prefix>.snapshot`: one prefix per fleet sharing a NATS.
    pub subject_prefix: String,
    pub heartbeat_interval_ms: u64,
    /// A replica silent this long is gone: its share of the workers' load expires.
    pub heartbeat_timeout_ms: u64,
    /// Larger messages are dropped (sent or received) and counted.
    pub max_message_bytes: usize,
    /// Outbound messages queued while NATS is slow or down; past it they are dropped and counted.
    pub queue_capacity: usize,
    /// How long a (re)connecting replica collects peers' snapshot replies.
    pub snapshot_wait_ms: u64,
    /// How long (at least) each of our routing decisions also counts once per live peer, standing
    /// for the peers' concurrent decisions until theirs arrive; the recent sync lag stretches it
    /// when longer (0 = off).
    pub provisional_window_ms: u64,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            nats_url: String::new(),
            replica_id: None,
            subject_prefix: "kvgate".into(),
            heartbeat_interval_ms: 1000,
            heartbeat_timeout_ms: 5000,
            max_message_bytes: 1 << 20,
            queue_capacity: 8192,
            snapshot_wait_ms: 500,
            provisional_window_ms: 10,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    /// HTTP/1 read buffer bound; request heads larger than this are rejected.
    pub max_header_bytes: usize,
    pub header_read_timeout_ms: u64,
    /// Longest time a request body may take to arrive whole (kvgate's HTTP/1.1 server): a client
    /// that dribbles its body gets 408 and the connection closes.
    pub body_read_timeout_s: u64,
    /// Most client connections open at once on the data-path listener (0 = no cap); past it a
    /// new connection gets 503 and is closed.
    pub max_connections: usize,
    /// Max concurrent HTTP/2 streams per connection.
    pub h2_max_streams: u32,
    /// How long shutdown waits for in-flight streams before closing them.
    pub shutdown_grace_s: u64,
    /// On SIGTERM: seconds `/ready` answers 503 while the listener still accepts and serves, so
    /// load balancers stop sending before the port closes (0 = close at once).
    pub drain_delay_s: u64,
    /// Config file poll interval for hot reload (0 = only SIGHUP).
    pub reload_poll_ms: u64,
    /// One JSON log line per request on stdout (target `kvgate::request`).
    pub request_log: bool,
    /// Threads serving client connections, each with its own single-threaded runtime and worker
    /// connection pool (0 = one per CPU core).
    pub io_threads: usize,
    /// Who serves HTTP/1.1 connections (plain and TLS): kvgate's own loop or hyper.
    pub http1: Http1Server,
    pub tls: Option<TlsConfig>,
}

/// `server.http1`: the HTTP/1.1 server of client connections, plain and TLS (HTTP/2 is always
/// hyper's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Http1Server {
    /// kvgate's own loop (`h1server`): less CPU per request.
    #[default]
    Kvgate,
    /// hyper's HTTP/1 server.
    Hyper,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:8080".parse().expect("static addr"),
            max_body_bytes: 8 << 20,
            max_header_bytes: 64 << 10,
            header_read_timeout_ms: 30_000,
            body_read_timeout_s: 60,
            max_connections: 16384,
            h2_max_streams: 1024,
            shutdown_grace_s: 30,
            drain_delay_s: 5,
            reload_poll_ms: 2000,
            request_log: true,
            io_threads: 0,
            http1: Http1Server::Kvgate,
            tls: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Admin listener address; absent = admin API off.
    pub listen: Option<SocketAddr>,
    /// Bearer key for the admin API (required when `listen` is set).
    pub key: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Client API keys. Empty = no authentication on the data path.
    pub keys: Vec<ApiKeyConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    pub key: String,
    /// Name for logs (never the key itself).
    #[serde(default)]
    pub name: Option<String>,
    /// Sustained requests per second; absent = unlimited.
    #[serde(default)]
    pub rate_per_s: Option<f64>,
    /// Burst size of the token bucket (default: max(1, rate_per_s)).
    #[serde(default)]
    pub burst: Option<f64>,
    /// Flow control: the priority of this key's requests when they send no priority header.
    #[serde(default)]
    pub priority: Option<i32>,
    /// Flow control: the tenant (fairness key) of this key's requests; default: the key's `name`.
    #[serde(default)]
    pub tenant: Option<String>,
}

/// `routing.session_headers` by default: the agent clients' own (Claude Code, Codex, OpenCode)
/// and the generic one.
pub const DEFAULT_SESSION_HEADERS: [&str; 5] = [
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-session-affinity",
    "x-session-id",
];

/// `[response_pins]`: OpenAI Responses ids learned from the replies kvgate relays, each pinned
/// to the worker that stored it (vLLM and SGLang keep stored responses in that process only).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsePinsConfig {
    /// How long a learned id stays pinned after it was learned.
    pub ttl_s: u64,
    /// Most ids remembered (the oldest are forgotten first).
    pub max_entries: usize,
}

impl Default for ResponsePinsConfig {
    fn default() -> Self {
        ResponsePinsConfig {
            ttl_s: 24 * 3600,
            max_entries: 1_000_000,
        }
    }
}

/// `routing.kv_replicate` when the key is absent and the policy is `kv_time` (the default
/// policy); `kv` keeps 0 (docs/routing.md §4, docs/bench.md "Replicating a prefix in use").
pub const KV_TIME_REPLICATE: f64 = 2.0;

/// `routing.kv_cold_latency` when the key is absent and the policy is `kv_time`; `kv` keeps 0
/// (docs/routing.md §4, docs/bench.md "Cold prompts placed by time where reuse is low").
pub const KV_TIME_COLD_LATENCY: f64 = 0.9;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `kv` (KV-overlap + load cost), `round_robin`, `least_load`, `random`, ... (see kvgate-core).
    pub policy: String,
    /// KV block size in tokens; must equal the workers' block size.
    pub block_size: u32,
    /// Weight of prefill (uncached prompt) blocks against decode blocks in the `kv` cost.
    pub prefill_weight: f64,
    /// Share of a worker's in-flight prefill tokens charged in the `kv` cost (1 = Dynamo; below 1
    /// keeps long cached prefixes through bursts of prompt work on their worker).
    pub pending_prefill_weight: f64,
    /// `kv` policy: each request in flight on a worker costs this many blocks (Dynamo's
    /// per-request decode weight; 0 = KV blocks only).
    pub request_weight: f64,
    /// Softmax temperature over normalised cost; 0 = argmin with random tie-break.
    pub temperature: f64,
    /// A worker is busy once it has this many in-flight requests through this gateway (0 = never).
    pub max_inflight_per_worker: u32,
    /// Busy once router-side active KV blocks on the worker reach this (absent = no bound).
    pub busy_active_blocks: Option<u32>,
    /// Busy once router-side pending prefill tokens reach this.
    pub busy_pending_prefill_tokens: Option<u64>,
    /// Busy once the worker's scraped KV usage (0..1) reaches this.
    pub busy_kv_usage: Option<f32>,
    /// Busy once the worker's scraped waiting queue reaches this.
    pub busy_waiting: Option<u32>,
    /// Approximate-index entry lifetime for workers without KV events.
    pub approx_ttl_s: u64,
    /// Approximate-index capacity per worker, in blocks.
    pub approx_capacity_blocks: usize,
    /// Exact-index workers: seconds a routed request's blocks count as held before the worker's KV
    /// events confirm them (predicted insertion); 0 = off.
    pub predicted_ttl_s: u64,
    /// Tokenizer of pools without `[models."name"] tokenizer` (default: approximate + ChatML).
    pub tokenizer: Option<kvgate_tokenize::TokenizerSpec>,
    /// `latency` policy: weight of the decode slowdown a request inflicts on the requests already
    /// on a worker (request·ms per ms of its own TTFT); 0 = its own TTFT only.
    pub latency_decode_weight: f64,
    /// Latency model's prefill step curve `[a, b, c]`: ms = a·T² + b·T + c for T new tokens at
    /// speed 1 (default: the Dynamo mocker fit, also `kvgate sim`'s).
    pub latency_prefill_coeffs: Option<[f64; 3]>,
    /// Latency model's decode step curve `[a, b, c]`: ms = a·p² + b·p + c at KV usage p.
    pub latency_decode_coeffs: Option<[f64; 3]>,
    /// `latency` policy: predict the wait for an engine slot on a worker running as many
    /// requests as it was seen running while others waited (its `max_num_seqs`).
    pub latency_slot_wait: bool,
    /// `latency` policy: predict the wait for KV memory on a worker whose in-flight requests'
    /// blocks plus this request's exceed its reported capacity.
    pub latency_kv_wait: bool,
    /// `kv` policy: also charge the latency model's predicted wait before a worker's engine can
    /// start the request (a sequence slot, KV memory; per `latency_slot_wait` / `latency_kv_wait`)
    /// as the prompt blocks that take as long to prefill there (queueing seen as time).
    pub kv_queue_time: bool,
    /// `kv` policy with `kv_queue_time`: the wait for the step in progress and a decode step
    /// longer than the request's own prefill step count too (all the latency estimate adds to
    /// the prefill), so an idle worker is preferred to a busy holder of a short cached prefix.
    pub kv_step_wait: bool,
    /// `kv` / `kv_time`: replication of a prefix in use, a number >= 0 (0 = off; absent:
    /// [`KV_TIME_REPLICATE`] for `kv_time`, 0 for `kv`): on a worker that lacks them, the
    /// prompt's leading blocks held by requests in flight right now are charged
    /// `1 − min(1, kv_replicate · max(0, k − h · fair) / (k + 1))` of their prefill (`k`
    /// requests hold them on `h` workers, `fair` = the fleet's mean in-flight requests per
    /// worker, at least 1), so new sessions over a shared system prompt spread by load instead
    /// of queueing behind its holder (docs/routing.md §4).
    pub kv_replicate: Option<f64>,
    /// `kv_time` (or `kv` with `kv_queue_time`): while the fleet's recent reuse (a moving
    /// average, over about the last 50 decisions, of the best cached share of each prompt) is
    /// below `kv_cold_reuse`, a request no worker holds more than this share of (of its
    /// prompt's blocks, in `[0, 1]`; 0 = off; absent: [`KV_TIME_COLD_LATENCY`] for `kv_time`,
    /// 0 for `kv`) is placed by the `latency` policy's cost instead of the block cost.
    pub kv_cold_latency: Option<f64>,
    /// With `kv_cold_latency`: the recent reuse below which it applies (a share in `[0, 1]`).
    pub kv_cold_reuse: f64,
    /// Latency model: the learned speed of a worker that none of the fleet's last `N × workers`
    /// first tokens came from (it gets no traffic) relaxes towards the fleet's, half the distance
    /// per further `N × workers`, so a worker avoided for being slow is tried again and seen
    /// recovering; 0 = never.
    pub latency_relax_after: u64,
    /// `latency` policy: among workers predicted to meet `[slo] ttft_ms` / `itl_ms`, prefer the
    /// longest cached prefix (otherwise the fastest).
    pub slo_routing: bool,
    /// Request headers naming a session, first present wins (then the body's `prompt_cache_key`,
    /// then the session in Anthropic `metadata.user_id`): the request's affinity key.
    pub session_headers: Vec<String>,
    /// A session's later requests prefer the worker of its last one for this long after it.
    pub session_ttl_s: u64,
    /// The session term of the `kv` cost: the session's last worker counts this many extra
    /// prompt blocks as cached (capped at the prompt's length; 0 = off). Soft: load still wins.
    pub session_affinity_blocks: u32,
    /// Most sessions remembered (the oldest are forgotten first).
    pub session_max_entries: usize,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            policy: "kv_time".into(),
            block_size: 16,
            prefill_weight: 4.0,
            // Dynamo charges all of it (1); 0.25 measured better on every workload we ran
            // (docs/bench.md, "pending_prefill_weight default").
            pending_prefill_weight: 0.25,
            request_weight: 0.0,
            temperature: 0.0,
            max_inflight_per_worker: 0,
            busy_active_blocks: None,
            busy_pending_prefill_tokens: None,
            busy_kv_usage: None,
            busy_waiting: None,
            approx_ttl_s: 120,
            approx_capacity_blocks: 1 << 16,
            predicted_ttl_s: 5,
            tokenizer: None,
            latency_decode_weight: 0.25,
            latency_prefill_coeffs: None,
            latency_slot_wait: true,
            latency_kv_wait: true,
            kv_queue_time: false,
            kv_step_wait: false,
            kv_replicate: None,
            kv_cold_latency: None,
            kv_cold_reuse: 0.5,
            latency_relax_after: 8,
            latency_decode_coeffs: None,
            slo_routing: false,
            session_headers: DEFAULT_SESSION_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            session_ttl_s: 1800,
            session_affinity_blocks: 32,
            session_max_entries: 100_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Requests allowed to wait when every worker is busy; beyond this → 429.
    pub queue_size: usize,
    /// Max wait in the queue; then → 503 with Retry-After.
    pub queue_timeout_ms: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            queue_size: 1024,
            queue_timeout_ms: 30_000,
        }
    }
}

/// `[flow_control]`: priorities, tenant fair shares and latency objectives in the admission queue
/// (docs/flow-control.md). Off: one queue in arrival order, request headers ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlowControlConfig {
    pub enabled: bool,
    /// Priority of a request that names none (header, objective, API key or model default).
    pub default_priority: i32,
    /// The output tokens a request is charged for in the fair share (its `max_tokens` when
    /// smaller): shares are of prompt + expected output tokens.
    pub expected_output_tokens: u64,
    /// Weight of a tenant not listed in `tenants`.
    pub default_weight: f64,
    /// Fairness weights per tenant (API key `tenant`/`name`, `x-kvgate-tenant`,
    /// `x-llm-d-inference-fairness-id`). Listed tenants are also the `tenant` metric labels.
    pub tenants: BTreeMap<String, f64>,
    /// Priority classes (bands): a request joins the class with the highest `priority` not above
    /// its own (the lowest class when below all). Empty: `default` (0) and `sheddable` (-1).
    pub classes: Vec<FlowClassConfig>,
    /// `x-llm-d-inference-objective` names → priority (and TTFT objective).
    pub objectives: BTreeMap<String, FlowObjectiveConfig>,
    /// Priority per model (canonical name), below the request's header and its API key's.
    pub models: BTreeMap<String, i32>,
    /// Worker kinds (`vllm`, `sglang`) whose request bodies get the class priority as `priority`
    /// (the engine must run with `--scheduling-policy priority`). Empty: off.
    pub forward_priority: Vec<String>,
    /// With `forward_priority`: a request of a class at or above this priority may pass the busy
    /// bound (`routing.busy_*`, `max_inflight_per_worker`) of a worker that schedules by
    /// priority: the engine serves it ahead of the lower classes it holds. Unset: never.
    pub bypass_busy_priority: Option<i32>,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        FlowControlConfig {
            enabled: false,
            default_priority: 0,
            expected_output_tokens: 256,
            default_weight: 1.0,
            tenants: BTreeMap::new(),
            classes: Vec::new(),
            objectives: BTreeMap::new(),
            models: BTreeMap::new(),
            forward_priority: Vec::new(),
            bypass_busy_priority: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowClassConfig {
    /// The `class` metric label.
    pub name: String,
    /// Lower bound of the class's band; negative = sheddable.
    pub priority: i32,
    /// Waiters allowed in this class (also bounded by `admission.queue_size`); default:
    /// unbounded for classes >= 0, 0 for sheddable ones (shed at once when the fleet is full).
    #[serde(default)]
    pub queue_size: Option<usize>,
    /// Longest wait in this class (also bounded by `admission.queue_timeout_ms`).
    #[serde(default)]
    pub max_wait_ms: Option<u64>,
    /// TTFT objective of the class's requests (`x-kvgate-slo-ttft-ms` overrides).
    #[serde(default)]
    pub ttft_ms: Option<u64>,
    /// A request whose objective cannot be met: `reject` (429 at once) or `best_effort`.
    #[serde(default)]
    pub on_miss: OnMiss,
    /// Order inside the class: `fair` (weighted fair shares of tokens between tenants) or
    /// `deadline` (earliest deadline first).
    #[serde(default)]
    pub order: ClassOrder,
}

#[derive(Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnMiss {
    #[default]
    BestEffort,
    Reject,
}

#[derive(Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ClassOrder {
    #[default]
    Fair,
    Deadline,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowObjectiveConfig {
    pub priority: i32,
    /// TTFT objective of the objective's requests (ms).
    #[serde(default)]
    pub ttft_ms: Option<u64>,
}

impl FlowControlConfig {
    fn validate(&self) -> anyhow::Result<()> {
        let weight_ok = |w: f64| w.is_finite() && w > 0.0;
        if !weight_ok(self.default_weight) {
            bail!("flow_control.default_weight must be a number > 0");
        }
        for (t, w) in &self.tenants {
            if !weight_ok(*w) {
                bail!("flow_control.tenants.{t:?}: weight must be a number > 0, got {w}");
            }
        }
        let mut names = std::collections::BTreeSet::new();
        let mut prios = std::collections::BTreeSet::new();
        for c in &self.classes {
            if c.name.is_empty() || !names.insert(c.name.as_str()) {
                bail!("flow_control.classes: empty or duplicate name {:?}", c.name);
            }
            if !prios.insert(c.priority) {
                bail!(
                    "flow_control.classes: two classes with priority {}",
                    c.priority
                );
            }
            if c.ttft_ms == Some(0) || c.max_wait_ms == Some(0) {
                bail!(
                    "flow_control.classes ({}): ttft_ms and max_wait_ms must be >= 1",
                    c.name
                );
            }
        }
        for (name, o) in &self.objectives {
            if o.ttft_ms == Some(0) {
                bail!("flow_control.objectives.{name:?}.ttft_ms must be >= 1");
            }
        }
        for k in &self.forward_priority {
            let kind = k
                .parse::<kvgate_fleet::WorkerKind>()
                .map_err(|e| anyhow::anyhow!("flow_control.forward_priority: {e}"))?;
            if !matches!(
                kind,
                kvgate_fleet::WorkerKind::Vllm | kvgate_fleet::WorkerKind::Sglang
            ) {
                bail!("flow_control.forward_priority: {k:?} has no request priority (vllm, sglang do)");
            }
        }
        if self.bypass_busy_priority.is_some() && self.forward_priority.is_empty() {
            bail!("flow_control.bypass_busy_priority needs forward_priority (engines that schedule by priority)");
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Total attempts per request (1 = no retry).
    pub max_attempts: u32,
    /// Retries may add at most this fraction of the request rate (over a 10 s window) ...
    pub budget_ratio: f64,
    /// ... but at least this many retries per 10 s window are always allowed.
    pub budget_min_per_window: u32,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 3,
            budget_ratio: 0.2,
            budget_min_per_window: 20,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    pub connect_timeout_ms: u64,
    /// Upper bound on the time to the worker's response headers, any request (the two below are
    /// tighter, per kind).
    pub response_timeout_s: u64,
    /// Non-streaming requests: the worker's whole response (head and body) within this, else 504
    /// (retried on another worker while nothing reached the client).
    pub request_timeout_s: u64,
    /// Streaming requests: the worker's head and first body byte within this, else 504 (retried
    /// like a failed connect); gaps after the first byte are `stream_idle_timeout_s`'s.
    pub stream_first_byte_timeout_s: u64,
    /// Health probe period of each worker.
    pub health_interval_ms: u64,
    /// Health probe period while a worker is down or its breaker open: a worker that answers again
    /// is routable within about this.
    pub health_recovery_interval_ms: u64,
    pub pool_idle_timeout_s: u64,
    pub pool_max_idle_per_host: usize,
    /// How often worker `/v1/models` is re-read for workers without a configured model list.
    pub models_refresh_s: u64,
    /// A stream whose worker sends nothing for this long is ended with an SSE error (0 = never).
    pub stream_idle_timeout_s: u64,
    /// Run kvgate-fleet monitors per worker: load scraping, KV events, health checks.
    pub monitor: bool,
    /// PEM file of the CA certificates trusted for `https://` workers; default: the system bundle.
    pub ca_file: Option<PathBuf>,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            connect_timeout_ms: 2000,
            response_timeout_s: 600,
            request_timeout_s: 300,
            stream_first_byte_timeout_s: 60,
            health_interval_ms: 2000,
            health_recovery_interval_ms: 500,
            pool_idle_timeout_s: 90,
            pool_max_idle_per_host: 256,
            models_refresh_s: 30,
            stream_idle_timeout_s: 300,
            monitor: true,
            ca_file: None,
        }
    }
}

/// Bounds of the gateway's own caches (the KV index's are `routing.approx_*`); every cache's size
/// is exported as `kvgate_cache_entries{cache}` / `kvgate_cache_bytes{cache}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Per model tokenizer: bytes of the segment cache (ids of whole chat messages seen before;
    /// least recently used half dropped when full; 0 = off).
    pub tokenizer_segment_bytes: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            tokenizer_segment_bytes: 32 << 20,
        }
    }
}

/// What a worker does in a prefill/decode split (docs/routing.md, "Prefill/decode disaggregation").
pub use kvgate_protocol::pd::Role as WorkerRole;

/// `workers[].role` (and `worker_pools[].role`): a role given in config, or `auto`, the one the
/// worker's `/server_info` announces (SGLang's `disaggregation_mode`; no such endpoint → `both`).
/// An `auto` worker gets no traffic until it has answered.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum RoleSetting {
    Fixed(WorkerRole),
    Auto,
}

impl Default for RoleSetting {
    fn default() -> Self {
        RoleSetting::Fixed(WorkerRole::Both)
    }
}

impl From<WorkerRole> for RoleSetting {
    fn from(r: WorkerRole) -> Self {
        RoleSetting::Fixed(r)
    }
}

impl RoleSetting {
    /// The name in configs and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            RoleSetting::Fixed(r) => r.as_str(),
            RoleSetting::Auto => "auto",
        }
    }
}

impl std::str::FromStr for RoleSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(RoleSetting::Auto),
            s => s.parse().map(RoleSetting::Fixed).map_err(|_| {
                format!("unknown worker role {s:?} (expected prefill|decode|both|auto)")
            }),
        }
    }
}

impl TryFrom<String> for RoleSetting {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// `[pd] protocol`: one handoff for every pool with prefill workers, or `auto` (docs/routing.md §9).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub enum PdProtocol {
    /// This handoff everywhere.
    Fixed(Handoff),
    /// Per pool, from its prefill workers: SGLang when one announced its `disaggregation_mode`
    /// in `/server_info` (`role = "auto"`), else by `kind`: `sglang` → SGLang, `trtllm` →
    /// TensorRT-LLM, anything else → vLLM.
    Auto,
}

impl Default for PdProtocol {
    fn default() -> Self {
        PdProtocol::Fixed(Handoff::Vllm)
    }
}

impl PdProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            PdProtocol::Fixed(h) => h.as_str(),
            PdProtocol::Auto => "auto",
        }
    }
}

impl std::str::FromStr for PdProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(PdProtocol::Auto),
            s => s.parse().map(PdProtocol::Fixed).map_err(|_| {
                format!("unknown PD protocol {s:?} (expected vllm|sglang|trtllm|auto)")
            }),
        }
    }
}

impl TryFrom<String> for PdProtocol {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// `[pd]`: how pools with prefill workers run the handoff.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PdConfig {
    /// Handoff protocol of every pool with prefill workers: `vllm` (default), `sglang`, `trtllm`,
    /// or `auto` (per pool, from its prefill workers' announced mode or `kind`).
    pub protocol: PdProtocol,
    /// Conditional disaggregation: a request whose uncached prompt on the chosen decode worker is
    /// below this many tokens runs on the decode worker alone, unless that worker has more
    /// requests in flight than the decode pool's average plus one. 0 = always disaggregate
    /// (whenever a prefill worker can take the request).
    pub min_uncached_tokens: u64,
    /// With `min_uncached_tokens` > 0: a request at or above it still runs on the decode worker
    /// alone when that worker has nothing in flight (a prefill there holds up no stream) and the
    /// request's predicted TTFT there is at most its predicted TTFT on the prefill worker the
    /// handoff would use. Ignored when `min_uncached_tokens` is 0 (always disaggregate).
    pub local_on_idle_decode: bool,
    /// A prefill leg's whole answer must arrive within this many seconds (it is one token).
    pub prefill_timeout_s: u64,
    /// The policy that chooses the decode worker of a disaggregated request (any
    /// `routing.policy` name, with the same `[routing]` settings). Unset: `least_loaded` when
    /// `routing.policy` routes on cache overlap (`kv`, `latency`, `cache_aware`), else
    /// `routing.policy` itself. `kv` counts a shared prompt's blocks once per worker, so decode
    /// legs sharing a prompt would stack where it is cached; the blocks are pulled from the
    /// prefill worker anyway.
    pub decode_policy: Option<String>,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            protocol: PdProtocol::default(),
            min_uncached_tokens: 512,
            local_on_idle_decode: true,
            prefill_timeout_s: 60,
            decode_policy: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SloConfig {
    /// A request counts toward goodput when its TTFT is at most this ...
    pub ttft_ms: f64,
    /// ... and its mean inter-token latency is at most this.
    pub itl_ms: f64,
}

impl Default for SloConfig {
    fn default() -> Self {
        SloConfig {
            ttft_ms: 2000.0,
            itl_ms: 100.0,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// `{ kind = "hf", tokenizer_json = "…" }`, `{ kind = "tiktoken", encoding = "o200k_base" }` or
    /// `{ kind = "approx" }`; default `routing.tokenizer`.
    pub tokenizer: Option<kvgate_tokenize::TokenizerSpec>,
    /// Override of `routing.block_size` for this model's pool.
    pub block_size: Option<u32>,
    /// Other names clients may use for this model (listed by /v1/models, routed to the same pool).
    pub aliases: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Base URL, e.g. `http://10.0.0.5:8000` (paths `/v1/...` are appended).
    pub url: String,
    /// Metric label and admin name; default: host:port of `url`.
    #[serde(default)]
    pub name: Option<String>,
    /// Models served; empty = discovered from the worker's `/v1/models`.
    #[serde(default)]
    pub models: Vec<String>,
    /// `vllm` (default), `sglang`, `trtllm`, `llamacpp`, `ollama`, `openai`: selects metrics/events.
    #[serde(default = "default_kind")]
    pub kind: String,
    /// Dollars per hour this worker costs (for cost and tokens-per-dollar metrics).
    #[serde(default)]
    pub cost_per_hour: f64,
    /// GPUs the worker occupies (for `kvgate_worker_gpu_seconds_total`, GPU-hours).
    #[serde(default = "default_gpus")]
    pub gpus: u32,
    /// Bearer key sent to this worker (client keys are never forwarded when auth is on).
    #[serde(default)]
    pub api_key: Option<String>,
    /// ZMQ endpoint of the worker's KV-event publisher, e.g. `tcp://10.0.0.5:5557`.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// ZMQ ROUTER endpoint of the worker's KV-event replay buffer (vLLM `replay_endpoint`), e.g.
    /// `tcp://10.0.0.5:5558`: gaps and reconnects are filled from it instead of clearing the worker.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// Metrics URL if not `<url>/metrics`.
    #[serde(default)]
    pub metrics_url: Option<String>,
    /// The worker's dcgm-exporter `/metrics` URL, e.g. `http://10.0.0.5:9400/metrics`: GPU figures
    /// re-exported as `kvgate_worker_gpu_*`.
    #[serde(default)]
    pub dcgm_url: Option<String>,
    /// `prefill`, `decode`, `both` (default), or `auto` (from the worker's `/server_info`; no
    /// traffic until it answers): see `[pd]`.
    #[serde(default)]
    pub role: RoleSetting,
    /// The engine's token budget per step (vLLM `--max-num-batched-tokens`), for the batch fill
    /// ratio (`kvgate_worker_max_num_batched_tokens`); engines that report it (TRT-LLM) need none.
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    /// The engine's most sequences per step (vLLM `--max-num-seqs`), `kvgate_worker_max_num_seqs`.
    #[serde(default)]
    pub max_num_seqs: Option<u64>,
    /// GPUs one model replica is split over (`--tensor-parallel-size`, SGLang `--tp`): the
    /// `tensor_parallelism` label of `kvgate_worker_info` (empty when unset).
    #[serde(default)]
    pub tensor_parallelism: Option<u32>,
    /// The served model's version (a checkpoint tag, a revision): the `model_version` label of
    /// `kvgate_worker_info` (empty when unset).
    #[serde(default)]
    pub model_version: Option<String>,
    /// SGLang prefill workers: the port of their bootstrap server
    /// (`--disaggregation-bootstrap-port`), sent as `bootstrap_port`; 0 sends null (the engine then
    /// uses its own). Unset: the port the worker's `/server_info` announced (`role = "auto"`),
    /// else 8998 ([`DEFAULT_BOOTSTRAP_PORT`]).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// A worker pool whose members are discovered: every address `dns` resolves to, every endpoint
/// of an llm-d endpoints `file`, or every Ready pod × target port of a Kubernetes
/// `inference_pool` becomes a worker (`http://addr`, named `{name}-{addr}`), added and removed as
/// the source changes (`worker_pools.rs`). Exactly one of the three sources is set.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerPoolConfig {
    /// `host:port` to resolve, e.g. `vllm-headless.default.svc.cluster.local:8000`.
    #[serde(default)]
    pub dns: String,
    /// An llm-d file-discovery endpoints file (YAML or JSON), re-read when it changes.
    #[serde(default)]
    pub file: Option<std::path::PathBuf>,
    /// The name of a Kubernetes InferencePool whose Ready pods are the members.
    #[serde(default)]
    pub inference_pool: Option<String>,
    /// The InferencePool's API group: `inference.networking.k8s.io` (v1) or
    /// `inference.networking.x-k8s.io` (v1alpha2).
    #[serde(default = "default_inference_pool_group")]
    pub inference_pool_group: String,
    /// The InferencePool's namespace; default: the service account's, else `default`.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The Kubernetes API server's URL; default: in-cluster (`KUBERNETES_SERVICE_HOST`/`_PORT`).
    #[serde(default)]
    pub api_server: Option<String>,
    /// File holding the bearer token for the API server (re-read at every connection); default:
    /// the in-cluster service account's token (none if that file does not exist).
    #[serde(default)]
    pub token_file: Option<std::path::PathBuf>,
    /// PEM CA bundle for an https API server; default: the in-cluster service account's `ca.crt`.
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Prefix of the workers' names; default: the host part of `dns`, the file's stem, or the
    /// InferencePool's name.
    #[serde(default)]
    pub name: Option<String>,
    /// URL scheme of the workers; only `http` (an https certificate names a host, not the
    /// resolved addresses: list https workers in `[[workers]]`).
    #[serde(default = "default_scheme")]
    pub scheme: String,
    /// Worker kind of every address (as `workers[].kind`).
    #[serde(default = "default_kind")]
    pub kind: String,
    /// Port of each address's KV-event publisher (`tcp://addr-ip:port`); absent = no events.
    #[serde(default)]
    pub kv_events_port: Option<u16>,
    /// Port of each address's KV-event replay endpoint (`tcp://addr-ip:port`); needs `kv_events_port`.
    #[serde(default)]
    pub kv_replay_port: Option<u16>,
    /// Seconds between DNS lookups, or between checks of `file` for a change.
    #[serde(default = "default_refresh_s")]
    pub refresh_s: u64,
    /// Models served; empty = discovered from each worker's `/v1/models`.
    #[serde(default)]
    pub models: Vec<String>,
    /// Dollars per hour each worker of the pool costs.
    #[serde(default)]
    pub cost_per_hour: f64,
    /// GPUs each worker of the pool occupies.
    #[serde(default = "default_gpus")]
    pub gpus: u32,
    /// Port of each address's dcgm-exporter (`http://addr-ip:port/metrics`); absent = no GPU figures.
    #[serde(default)]
    pub dcgm_port: Option<u16>,
    /// Role of every address of the pool (as `workers[].role`, `auto` included).
    #[serde(default)]
    pub role: RoleSetting,
    /// As `workers[].max_num_batched_tokens`, for every address.
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    /// As `workers[].max_num_seqs`, for every address.
    #[serde(default)]
    pub max_num_seqs: Option<u64>,
    /// As `workers[].tensor_parallelism`, for every address.
    #[serde(default)]
    pub tensor_parallelism: Option<u32>,
    /// As `workers[].model_version`, for every address.
    #[serde(default)]
    pub model_version: Option<String>,
    /// Bootstrap port of every address of the pool (as `workers[].bootstrap_port`).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// SGLang's `--disaggregation-bootstrap-port` default: a prefill worker's bootstrap port when
/// neither the config nor the worker's `/server_info` names one.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

fn default_gpus() -> u32 {
    1
}

fn default_scheme() -> String {
    "http".into()
}

fn default_refresh_s() -> u64 {
    5
}

/// GAIE's InferencePool v1 group (`inference.networking.x-k8s.io` is v1alpha2).
pub const INFERENCE_POOL_GROUP_V1: &str = "inference.networking.k8s.io";
/// The v1alpha2 InferencePool's group (GAIE before v1.0).
pub const INFERENCE_POOL_GROUP_V1ALPHA2: &str = "inference.networking.x-k8s.io";

fn default_inference_pool_group() -> String {
    INFERENCE_POOL_GROUP_V1.into()
}

/// Where a discovered pool's members come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolSource<'a> {
    Dns(&'a str),
    File(&'a std::path::Path),
    InferencePool(&'a str),
}

impl WorkerPoolConfig {
    /// The members' source (validated: exactly one is set; DNS when none is).
    pub fn source(&self) -> PoolSource<'_> {
        match (&self.file, &self.inference_pool) {
            (Some(f), _) => PoolSource::File(f),
            (None, Some(p)) => PoolSource::InferencePool(p),
            (None, None) => PoolSource::Dns(&self.dns),
        }
    }

    /// The source for error messages: `dns "h:p"`, `file "path"`, `inference_pool "name"`.
    pub fn describe(&self) -> String {
        match self.source() {
            PoolSource::Dns(d) => format!("dns {d:?}"),
            PoolSource::File(f) => format!("file {:?}", f.display().to_string()),
            PoolSource::InferencePool(p) => format!("inference_pool {p:?}"),
        }
    }

    /// The workers' name prefix: `name`, else the host part of `dns`, the file's stem, or the
    /// InferencePool's name.
    pub fn prefix(&self) -> &str {
        if let Some(n) = &self.name {
            return n;
        }
        match self.source() {
            PoolSource::Dns(dns) => dns
                .rsplit_once(':')
                .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
                .unwrap_or(dns),
            PoolSource::File(f) => f.file_stem().and_then(|s| s.to_str()).unwrap_or("file"),
            PoolSource::InferencePool(p) => p,
        }
    }

    /// The worker one resolved address stands for.
    pub fn worker_for(&self, addr: std::net::SocketAddr) -> WorkerConfig {
        self.member(addr, None)
    }

    /// The worker one member address stands for, with the role its source named (llm-d's
    /// `llm-d.ai/role` label) unless the pool's `role` is `auto`.
    pub fn member(&self, addr: std::net::SocketAddr, role: Option<WorkerRole>) -> WorkerConfig {
        let role = match (self.role, role) {
            (RoleSetting::Auto, _) | (_, None) => self.role,
            (_, Some(r)) => RoleSetting::Fixed(r),
        };
        WorkerConfig {
            url: format!("{}://{addr}", self.scheme),
            name: Some(format!("{}-{addr}", self.prefix())),
            models: self.models.clone(),
            kind: self.kind.clone(),
            cost_per_hour: self.cost_per_hour,
            gpus: self.gpus,
            api_key: None,
            kv_events: self
                .kv_events_port
                .map(|p| format!("tcp://{}", std::net::SocketAddr::new(addr.ip(), p))),
            kv_replay: self
                .kv_replay_port
                .map(|p| format!("tcp://{}", std::net::SocketAddr::new(addr.ip(), p))),
            metrics_url: None,
            dcgm_url: self
                .dcgm_port
                .map(|p| format!("http://{}/metrics", std::net::SocketAddr::new(addr.ip(), p))),
            role,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            tensor_parallelism: self.tensor_parallelism,
            model_version: self.model_version.clone(),
            bootstrap_port: self.bootstrap_port,
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        let sources = usize::from(!self.dns.is_empty())
            + usize::from(self.file.is_some())
            + usize::from(self.inference_pool.is_some());
        if sources != 1 {
            bail!(
                "a [[worker_pools]] entry needs exactly one of dns, file, inference_pool (found {sources})"
            );
        }
        match self.source() {
            PoolSource::Dns(dns) => {
                let Some((host, port)) = dns.rsplit_once(':') else {
                    bail!("worker_pools.dns {dns:?} must be host:port");
                };
                if host.is_empty() || port.parse::<u16>().is_err() {
                    bail!("worker_pools.dns {dns:?} must be host:port");
                }
            }
            PoolSource::File(f) => {
                if f.as_os_str().is_empty() {
                    bail!("worker_pools.file must not be empty");
                }
            }
            PoolSource::InferencePool(p) => {
                if !is_dns_label(p, 253) {
                    bail!("worker_pools.inference_pool {p:?} is not a Kubernetes object name");
                }
                if let Some(ns) = &self.namespace {
                    if !is_dns_label(ns, 63) || ns.contains('.') {
                        bail!("worker_pools.namespace {ns:?} is not a Kubernetes namespace name");
                    }
                }
                if ![INFERENCE_POOL_GROUP_V1, INFERENCE_POOL_GROUP_V1ALPHA2]
                    .contains(&self.inference_pool_group.as_str())
                {
                    bail!(
                        "worker_pools.inference_pool_group {:?}: expected {INFERENCE_POOL_GROUP_V1:?} (v1) or {INFERENCE_POOL_GROUP_V1ALPHA2:?} (v1alpha2)",
                        self.inference_pool_group
                    );
                }
                if let Some(url) = &self.api_server {
                    let ok = url
                        .parse::<http::Uri>()
                        .ok()
                        .filter(|u| matches!(u.scheme_str(), Some("http" | "https")))
                        .is_some_and(|u| u.authority().is_some());
                    if !ok {
                        bail!("worker_pools.api_server {url:?} must be an http:// or https:// URL");
                    }
                }
            }
        }
        let k8s_only = self.namespace.is_some()
            || self.api_server.is_some()
            || self.token_file.is_some()
            || self.ca_file.is_some()
            || self.inference_pool_group != INFERENCE_POOL_GROUP_V1;
        if k8s_only && self.inference_pool.is_none() {
            bail!(
                "worker_pools: namespace, api_server, token_file, ca_file and inference_pool_group apply to inference_pool pools only ({})",
                self.describe()
            );
        }
        self.kind
            .parse::<kvgate_fleet::WorkerKind>()
            .map_err(|e| anyhow::anyhow!("worker_pools.kind (pool {}): {e}", self.describe()))?;
        if self.scheme != "http" {
            bail!(
                "worker_pools.scheme {:?} (pool {}): only http is supported (list https workers in [[workers]])",
                self.scheme,
                self.describe()
            );
        }
        if !(self.cost_per_hour.is_finite() && self.cost_per_hour >= 0.0) {
            bail!(
                "worker_pools.cost_per_hour {} must be a number >= 0 (pool {})",
                self.cost_per_hour,
                self.describe()
            );
        }
        if self.refresh_s == 0 {
            bail!(
                "worker_pools.refresh_s must be >= 1 (pool {})",
                self.describe()
            );
        }
        if self.kv_replay_port.is_some() && self.kv_events_port.is_none() {
            bail!(
                "worker_pools.kv_replay_port needs kv_events_port (pool {})",
                self.describe()
            );
        }
        Ok(())
    }
}

fn default_kind() -> String {
    "vllm".into()
}

/// A Kubernetes object name (RFC 1123 subdomain: lower-case alphanumerics, `-` and `.`, starting
/// and ending alphanumeric) of at most `max` characters.
fn is_dns_label(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
}

impl WorkerConfig {
    pub fn from_url(url: &str) -> Self {
        WorkerConfig {
            url: url.to_string(),
            name: None,
            models: Vec::new(),
            kind: default_kind(),
            cost_per_hour: 0.0,
            gpus: default_gpus(),
            api_key: None,
            kv_events: None,
            kv_replay: None,
            metrics_url: None,
            dcgm_url: None,
            role: RoleSetting::default(),
            max_num_batched_tokens: None,
            max_num_seqs: None,
            tensor_parallelism: None,
            model_version: None,
            bootstrap_port: None,
        }
    }
}

impl Config {
    /// Parse TOML text; errors name the offending key.
    pub fn from_toml(text: &str) -> anyhow::Result<Config> {
        let cfg: Config = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn from_file(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        Config::from_toml(&text).with_context(|| format!("in config {}", path.display()))
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.epp.fallback_endpoints == 0 || self.epp.fallback_endpoints > 64 {
            bail!(
                "epp.fallback_endpoints must be between 1 and 64, got {}",
                self.epp.fallback_endpoints
            );
        }
        if self.epp.max_message_bytes < 64 << 10 {
            bail!(
                "epp.max_message_bytes must be >= 65536 (Envoy sends body chunks of up to 64 KiB), got {}",
                self.epp.max_message_bytes
            );
        }
        for (i, r) in self.epp.model_rewrites.iter().enumerate() {
            if r.targets.is_empty() {
                bail!("epp.model_rewrites[{i}] has no targets");
            }
            for t in &r.targets {
                if t.model.is_empty() {
                    bail!("epp.model_rewrites[{i}]: a target's model is empty");
                }
                if !(1..=1_000_000).contains(&t.weight) {
                    bail!(
                        "epp.model_rewrites[{i}]: weight of `{}` must be between 1 and 1000000, got {}",
                        t.model,
                        t.weight
                    );
                }
            }
            if r.models.iter().any(String::is_empty) {
                bail!("epp.model_rewrites[{i}]: an empty name in models");
            }
        }
        if self.pd.prefill_timeout_s == 0 {
            bail!("pd.prefill_timeout_s must be >= 1");
        }
        if self.routing.block_size == 0 {
            bail!("routing.block_size must be > 0");
        }
        if self.retry.max_attempts == 0 {
            bail!("retry.max_attempts must be >= 1");
        }
        for (key, v) in [
            (
                "upstream.response_timeout_s",
                self.upstream.response_timeout_s,
            ),
            (
                "upstream.request_timeout_s",
                self.upstream.request_timeout_s,
            ),
            (
                "upstream.stream_first_byte_timeout_s",
                self.upstream.stream_first_byte_timeout_s,
            ),
            (
                "upstream.health_interval_ms",
                self.upstream.health_interval_ms,
            ),
            (
                "upstream.health_recovery_interval_ms",
                self.upstream.health_recovery_interval_ms,
            ),
        ] {
            if v == 0 {
                bail!("{key} must be > 0");
            }
        }
        if self.admin.listen.is_some() && self.admin.key.as_deref().unwrap_or("").is_empty() {
            bail!("admin.listen is set but admin.key is empty: the admin API must be protected");
        }
        let mut names = std::collections::HashSet::new();
        for w in &self.workers {
            let uri: http::Uri = w
                .url
                .parse()
                .with_context(|| format!("worker url {:?}", w.url))?;
            w.kind
                .parse::<kvgate_fleet::WorkerKind>()
                .map_err(|e| anyhow::anyhow!("worker {:?}: kind: {e}", w.url))?;
            match uri.scheme_str() {
                Some("http" | "https") => {}
                _ => bail!("worker url {:?}: scheme must be http:// or https://", w.url),
            }
            if uri.authority().is_none() {
                bail!("worker url {:?} has no host", w.url);
            }
            for (key, ep) in [("kv_events", &w.kv_events), ("kv_replay", &w.kv_replay)] {
                if let Some(ep) = ep {
                    if !ep.starts_with("tcp://") {
                        bail!("worker {:?}: {key} {ep:?} must be tcp://host:port", w.url);
                    }
                }
            }
            if let Some(u) = &w.dcgm_url {
                let ok = u.parse::<http::Uri>().is_ok_and(|u| {
                    matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some()
                });
                if !ok {
                    bail!(
                        "worker {:?}: dcgm_url {u:?} must be an http(s)://host:port/path URL",
                        w.url
                    );
                }
            }
            if w.kv_replay.is_some() && w.kv_events.is_none() {
                bail!(
                    "worker {:?}: kv_replay is set without kv_events (replay fills gaps in a live event stream)",
                    w.url
                );
            }
            if !(w.cost_per_hour.is_finite() && w.cost_per_hour >= 0.0) {
                bail!(
                    "worker {:?}: cost_per_hour {} must be a number >= 0",
                    w.url,
                    w.cost_per_hour
                );
            }
            if !names.insert(worker_name(w)) {
                bail!("duplicate worker name {:?}", worker_name(w));
            }
        }
        // The monitor asks an `auto` worker for its role; without one it would never be routed.
        let auto = self
            .workers
            .iter()
            .find(|w| w.role == RoleSetting::Auto)
            .map(|w| w.url.as_str());
        let auto = auto.or(self
            .worker_pools
            .iter()
            .find(|p| p.role == RoleSetting::Auto)
            .map(|p| p.prefix()));
        if let (Some(at), false) = (auto, self.upstream.monitor) {
            bail!("{at:?} has role = \"auto\", which needs upstream.monitor = true (the monitor asks the worker's /server_info)");
        }
        let mut prefixes = std::collections::HashSet::new();
        for p in &self.worker_pools {
            p.validate()?;
            if !prefixes.insert(p.prefix()) {
                bail!(
                    "duplicate worker_pools name {:?} (set `name` to tell pools apart)",
                    p.prefix()
                );
            }
        }
        self.flow_control.validate()?;
        let t = &self.tracing;
        if !(t.sample_ratio.is_finite() && (0.0..=1.0).contains(&t.sample_ratio)) {
            bail!(
                "tracing.sample_ratio {} must be between 0 and 1",
                t.sample_ratio
            );
        }
        if !t.otlp_endpoint.is_empty() {
            let target = kvgate_http::otlp::Target::parse(&t.otlp_endpoint)
                .map_err(|e| anyhow::anyhow!("tracing.otlp_endpoint: {e}"))?;
            if t.ca_file.is_some() && !target.tls() {
                bail!(
                    "tracing.ca_file is set but tracing.otlp_endpoint {:?} is not https:// or grpcs://",
                    t.otlp_endpoint
                );
            }
        }
        if t.route_candidates > 32 {
            bail!(
                "tracing.route_candidates {} must be at most 32",
                t.route_candidates
            );
        }
        for (key, v) in [
            ("tracing.queue_size", t.queue_size as u64),
            ("tracing.max_batch_spans", t.max_batch_spans as u64),
            ("tracing.batch_delay_ms", t.batch_delay_ms),
            ("tracing.export_timeout_ms", t.export_timeout_ms),
        ] {
            if v == 0 {
                bail!("{key} must be > 0");
            }
        }
        if t.service_name.is_empty() {
            bail!("tracing.service_name must not be empty");
        }
        for k in &self.auth.keys {
            if k.key.is_empty() {
                bail!("auth.keys: empty key");
            }
            if matches!(k.rate_per_s, Some(r) if r <= 0.0 || !r.is_finite()) {
                bail!("auth.keys.rate_per_s must be > 0");
            }
        }
        Ok(())
    }
}

/// The label a worker is known by: its configured name, else `host:port`.
pub fn worker_name(w: &WorkerConfig) -> String {
    if let Some(n) = &w.name {
        return n.clone();
    }
    w.url
        .parse::<http::Uri>()
        .ok()
        .and_then(|u| u.authority().map(|a| a.to_string()))
        .unwrap_or_else(|| w.url.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracing_tls_settings_are_checked() {
        let ok = Config::from_toml(
            "[tracing]\notlp_endpoint = \"grpcs://c:4317\"\nca_file = \"/etc/ca.pem\"\nroute_candidates = 0\n",
        )
        .unwrap();
        assert_eq!(ok.tracing.route_candidates, 0);
        assert_eq!(Config::default().tracing.route_candidates, 4);
        let err = Config::from_toml(
            "[tracing]\notlp_endpoint = \"http://c:4318\"\nca_file = \"/etc/ca.pem\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("tracing.ca_file") && err.contains("https://"),
            "{err}"
        );
        let err = Config::from_toml("[tracing]\nroute_candidates = 33\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tracing.route_candidates 33"), "{err}");
    }

    #[test]
    fn an_unknown_worker_kind_is_refused_with_the_known_ones() {
        let err = Config::from_toml("[[workers]]\nurl = \"http://a:1\"\nkind = \"vlm\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"vlm\"") && err.contains("sglang"), "{err}");
        let err = Config::from_toml(
            "[[worker_pools]]\ndns = \"svc:80\"\nkind = \"llama\"\nmodels = [\"m\"]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("worker_pools.kind") && err.contains("llamacpp"),
            "{err}"
        );
        Config::from_toml("[[workers]]\nurl = \"http://a:1\"\nkind = \"llama.cpp\"\n").unwrap();
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml("[routing]\npolicy = \"kv\"\nblok_size = 16\n").unwrap_err();
        assert!(format!("{err:#}").contains("blok_size"), "{err:#}");
        let err = Config::from_toml("[[workers]]\nurl = \"http://a:1\"\ncost_per_hour = -1\n")
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("cost_per_hour -1 must be"),
            "{err:#}"
        );
        let cfg = Config::from_toml("[[workers]]\nurl = \"http://a:1\"\ngpus = 8\n").unwrap();
        assert_eq!(cfg.workers[0].gpus, 8);
        assert_eq!(
            Config::from_toml("[[workers]]\nurl = \"http://a:1\"\n")
                .unwrap()
                .workers[0]
                .gpus,
            1
        );
        let err = Config::from_toml("[[workers]]\nurl = \"http://a:1\"\ncost = 2\n").unwrap_err();
        assert!(format!("{err:#}").contains("cost"), "{err:#}");
    }

    #[test]
    fn pd_protocol_and_decode_policy_parse() {
        let pd = |toml: &str| Config::from_toml(toml).map(|c| c.pd);
        assert_eq!(pd("").unwrap().protocol, PdProtocol::Fixed(Handoff::Vllm));
        assert_eq!(pd("").unwrap().decode_policy, None);
        for h in Handoff::ALL {
            let p = pd(&format!("[pd]\nprotocol = \"{}\"\n", h.as_str())).unwrap();
            assert_eq!(p.protocol, PdProtocol::Fixed(h));
        }
        assert_eq!(
            pd("[pd]\nprotocol = \"auto\"\n").unwrap().protocol,
            PdProtocol::Auto
        );
        let err = pd("[pd]\nprotocol = \"nixl\"\n").unwrap_err();
        assert!(
            format!("{err:#}").contains("vllm|sglang|trtllm|auto"),
            "{err:#}"
        );
        let p = pd("[pd]\ndecode_policy = \"round_robin\"\n").unwrap();
        assert_eq!(p.decode_policy.as_deref(), Some("round_robin"));
    }

    #[test]
    fn worker_roles_parse_auto_included() {
        let w = |extra: &str| {
            Config::from_toml(&format!(
                "[[workers]]\nurl = \"http://10.0.0.1:8000\"\n{extra}\n"
            ))
            .map(|c| c.workers[0].clone())
        };
        let plain = w("").unwrap();
        assert_eq!(plain.role, RoleSetting::Fixed(WorkerRole::Both));
        assert_eq!(plain.bootstrap_port, None, "unset: announced, else 8998");
        for r in ["prefill", "decode", "both"] {
            let c = w(&format!("role = \"{r}\"")).unwrap();
            assert_eq!(c.role, RoleSetting::Fixed(r.parse().unwrap()));
            assert_eq!(c.role.as_str(), r);
        }
        let auto = w("role = \"auto\"\nbootstrap_port = 9000").unwrap();
        assert_eq!(auto.role, RoleSetting::Auto);
        assert_eq!(auto.bootstrap_port, Some(9000));
        let no_monitor = Config::from_toml(
            "[upstream]\nmonitor = false\n[[workers]]\nurl = \"http://a:1\"\nrole = \"auto\"\n",
        );
        assert!(format!("{:#}", no_monitor.unwrap_err()).contains("upstream.monitor"));
        let err = format!("{:#}", w("role = \"encode\"").unwrap_err());
        assert!(err.contains("prefill|decode|both|auto"), "{err}");
        let pool = Config::from_toml("[[worker_pools]]\ndns = \"sglang:30000\"\nrole = \"auto\"\n")
            .unwrap();
        let a = pool.worker_pools[0].worker_for("10.0.0.7:30000".parse().unwrap());
        assert_eq!((a.role, a.bootstrap_port), (RoleSetting::Auto, None));
    }

    #[test]
    fn defaults_and_workers() {
        let cfg = Config::from_toml(
            "[[workers]]\nurl = \"http://10.0.0.1:8000\"\nmodels = [\"m\"]\ncost_per_hour = 2.5\n",
        )
        .unwrap();
        assert_eq!(cfg.routing.policy, "kv_time");
        assert_eq!(cfg.workers.len(), 1);
        assert_eq!(worker_name(&cfg.workers[0]), "10.0.0.1:8000");
        assert!(Config::from_toml("[[workers]]\nurl = \"ftp://x\"\n").is_err());
        assert!(Config::from_toml("[routing]\nbusy_kv_usage = 0.9\n").is_ok());
        assert!(Config::from_toml("[admin]\nlisten = \"127.0.0.1:1\"\n").is_err());
    }

    #[test]
    fn worker_pools_parse_and_validate() {
        let cfg = Config::from_toml(
            "[[worker_pools]]\ndns = \"vllm.default.svc:8000\"\nkv_events_port = 5557\n",
        )
        .unwrap();
        let p = &cfg.worker_pools[0];
        assert_eq!(
            (p.refresh_s, p.scheme.as_str(), p.kind.as_str()),
            (5, "http", "vllm")
        );
        assert_eq!(p.prefix(), "vllm.default.svc");
        let w = p.worker_for("10.0.0.7:8000".parse().unwrap());
        assert_eq!(w.url, "http://10.0.0.7:8000");
        assert_eq!(w.name.as_deref(), Some("vllm.default.svc-10.0.0.7:8000"));
        assert_eq!(w.kv_events.as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(w.kv_replay, None);
        let w6 = p.worker_for("[::1]:8000".parse().unwrap());
        assert_eq!(w6.url, "http://[::1]:8000");
        assert!(w6.url.parse::<http::Uri>().is_ok());
        for bad in [
            "dns = \"nohost\"",
            "dns = \"h:notaport\"",
            "dns = \"h:1\"\nscheme = \"https\"",
            "dns = \"h:1\"\nrefresh_s = 0",
            "dns = \"h:1\"\nrefesh_s = 3",
        ] {
            let err = Config::from_toml(&format!("[[worker_pools]]\n{bad}\n"));
            assert!(err.is_err(), "{bad}");
        }
        let dup = "[[worker_pools]]\ndns = \"h:1\"\n[[worker_pools]]\ndns = \"h:2\"\n";
        assert!(format!("{:#}", Config::from_toml(dup).unwrap_err()).contains("duplicate"));
    }

    #[test]
    fn file_and_inference_pool_sources_parse_and_validate() {
        let cfg = Config::from_toml(
            "[[worker_pools]]\nfile = \"/etc/epp/endpoints.yaml\"\nrole = \"decode\"\n\
             [[worker_pools]]\ninference_pool = \"vllm-llama\"\nnamespace = \"ml\"\n\
             inference_pool_group = \"inference.networking.x-k8s.io\"\n\
             api_server = \"http://127.0.0.1:6443\"\n",
        )
        .unwrap();
        let (f, k) = (&cfg.worker_pools[0], &cfg.worker_pools[1]);
        assert_eq!(
            f.source(),
            PoolSource::File(Path::new("/etc/epp/endpoints.yaml"))
        );
        assert_eq!(f.prefix(), "endpoints");
        assert_eq!(k.source(), PoolSource::InferencePool("vllm-llama"));
        assert_eq!(k.prefix(), "vllm-llama");
        // A role label of the source wins over the pool's fixed role, never over `auto`.
        let a: std::net::SocketAddr = "10.0.0.1:8000".parse().unwrap();
        assert_eq!(
            f.member(a, Some(WorkerRole::Prefill)).role,
            RoleSetting::Fixed(WorkerRole::Prefill)
        );
        assert_eq!(
            f.member(a, None).role,
            RoleSetting::Fixed(WorkerRole::Decode)
        );
        for (bad, says) in [
            ("file = \"a.yaml\"\ndns = \"h:1\"", "exactly one"),
            ("models = [\"m\"]", "exactly one"),
            ("file = \"\"", "must not be empty"),
            (
                "inference_pool = \"Bad_Name\"",
                "not a Kubernetes object name",
            ),
            ("inference_pool = \"p\"\nnamespace = \"a.b\"", "namespace"),
            (
                "inference_pool = \"p\"\ninference_pool_group = \"x.io\"",
                "inference_pool_group",
            ),
            (
                "inference_pool = \"p\"\napi_server = \"ftp://h\"",
                "api_server",
            ),
            (
                "file = \"a.yaml\"\nnamespace = \"ml\"",
                "inference_pool pools only",
            ),
        ] {
            let err = format!(
                "{:#}",
                Config::from_toml(&format!("[[worker_pools]]\n{bad}\n")).unwrap_err()
            );
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn example_configs_parse() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config");
        for f in ["kvgate.toml", "demo.toml", "pd.toml"] {
            let p = root.join(f);
            if p.exists() {
                Config::from_file(&p).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            }
        }
    }

    #[test]
    fn kv_replay_endpoints() {
        let cfg = Config::from_toml(
            "[[workers]]\nurl = \"http://127.0.0.1:8001\"\nkv_events = \"tcp://127.0.0.1:5557\"\nkv_replay = \"tcp://127.0.0.1:5558\"\n",
        )
        .unwrap();
        assert_eq!(
            cfg.workers[0].kv_replay.as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        let err = Config::from_toml(
            "[[workers]]\nurl = \"http://127.0.0.1:8001\"\nkv_replay = \"tcp://127.0.0.1:5558\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("kv_replay is set without kv_events"), "{err}");
        let err = Config::from_toml(
            "[[workers]]\nurl = \"http://127.0.0.1:8001\"\nkv_events = \"127.0.0.1:5557\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("must be tcp://host:port"), "{err}");
        let cfg = Config::from_toml(
            "[[worker_pools]]\ndns = \"vllm.default.svc:8000\"\nkv_events_port = 5557\nkv_replay_port = 5558\n",
        )
        .unwrap();
        let w = cfg.worker_pools[0].worker_for("10.0.0.7:8000".parse().unwrap());
        assert_eq!(w.kv_replay.as_deref(), Some("tcp://10.0.0.7:5558"));
        let err = Config::from_toml(
            "[[worker_pools]]\ndns = \"vllm.default.svc:8000\"\nkv_replay_port = 5558\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("kv_replay_port needs kv_events_port"), "{err}");
    }
}
