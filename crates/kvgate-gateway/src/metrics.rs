//! The gateway's Prometheus metrics (`prometheus-client`), exposed at `/metrics` in the classic
//! text format 0.0.4 so `promtool check metrics` and every Prometheus version accept it.
//!
//! Labels are bounded: `worker` is a configured worker name, `model` a configured/discovered model
//! name (requests for unknown models are labelled `model="unknown"`), `kind`/`reason`/`status` are
//! fixed sets. Label values are `Arc<str>` so recording never allocates on the hot path.
//! docs/metrics.md lists every family with the KPI it serves.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub mod hist;
pub mod process;

pub use hist::Histogram;

/// `kvgate_retries_total{reason}` values (proxy.rs), created at 0 so `rate()` works from the start.
pub const RETRY_REASONS: [&str; 6] = [
    "status_503",
    "status_429",
    "status_5xx",
    "upstream_connect",
    "upstream_io",
    "upstream_timeout",
];
/// `kvgate_config_reloads_total{reason}` values (reload.rs).
pub const RELOAD_RESULTS: [&str; 2] = ["ok", "error"];
/// `kvgate_errors_total{kind}`: every way a request can fail, the gateway's own refusals
/// (`GatewayError::label`) and the observer's stream failures alike; the label set is this enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorLabel {
    Unauthorized,
    RateLimited,
    NotFound,
    MethodNotAllowed,
    PayloadTooLarge,
    HeadersTooLarge,
    RequestTimeout,
    BadRequest,
    ModelNotFound,
    NoWorker,
    QueueFull,
    QueueTimeout,
    /// Flow control: a sheddable request (or a lower class's waiter) shed while saturated.
    Shed,
    /// Flow control: a TTFT objective that cannot be met, in a class that rejects misses.
    ObjectiveUnreachable,
    UpstreamConnect,
    /// Reserved: a worker's own error status (counted by `kvgate_retries_total` today).
    UpstreamStatus,
    UpstreamIo,
    UpstreamTimeout,
    /// The worker's stream ended with an error (SSE error event, or a body error mid-stream).
    UpstreamStream,
    /// The worker's body failed after its head (connection lost, bad framing).
    UpstreamBody,
    /// The worker reported running out of memory mid-stream.
    UpstreamOom,
    ShuttingDown,
    TooManyConnections,
    /// A Responses id kvgate has not pinned, or whose worker is gone (404, not retried).
    ResponseNotFound,
}

impl ErrorLabel {
    pub const ALL: [ErrorLabel; 24] = [
        ErrorLabel::Unauthorized,
        ErrorLabel::RateLimited,
        ErrorLabel::NotFound,
        ErrorLabel::MethodNotAllowed,
        ErrorLabel::PayloadTooLarge,
        ErrorLabel::HeadersTooLarge,
        ErrorLabel::RequestTimeout,
        ErrorLabel::BadRequest,
        ErrorLabel::ModelNotFound,
        ErrorLabel::NoWorker,
        ErrorLabel::QueueFull,
        ErrorLabel::QueueTimeout,
        ErrorLabel::Shed,
        ErrorLabel::ObjectiveUnreachable,
        ErrorLabel::UpstreamConnect,
        ErrorLabel::UpstreamStatus,
        ErrorLabel::UpstreamIo,
        ErrorLabel::UpstreamTimeout,
        ErrorLabel::UpstreamStream,
        ErrorLabel::UpstreamBody,
        ErrorLabel::UpstreamOom,
        ErrorLabel::ShuttingDown,
        ErrorLabel::TooManyConnections,
        ErrorLabel::ResponseNotFound,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorLabel::Unauthorized => "unauthorized",
            ErrorLabel::RateLimited => "rate_limited",
            ErrorLabel::NotFound => "not_found",
            ErrorLabel::MethodNotAllowed => "method_not_allowed",
            ErrorLabel::PayloadTooLarge => "payload_too_large",
            ErrorLabel::HeadersTooLarge => "headers_too_large",
            ErrorLabel::RequestTimeout => "request_timeout",
            ErrorLabel::BadRequest => "bad_request",
            ErrorLabel::ModelNotFound => "model_not_found",
            ErrorLabel::NoWorker => "no_worker",
            ErrorLabel::QueueFull => "queue_full",
            ErrorLabel::QueueTimeout => "queue_timeout",
            ErrorLabel::Shed => "shed",
            ErrorLabel::ObjectiveUnreachable => "objective_unreachable",
            ErrorLabel::UpstreamConnect => "upstream_connect",
            ErrorLabel::UpstreamStatus => "upstream_status",
            ErrorLabel::UpstreamIo => "upstream_io",
            ErrorLabel::UpstreamTimeout => "upstream_timeout",
            ErrorLabel::UpstreamStream => "upstream_stream",
            ErrorLabel::UpstreamBody => "upstream_body",
            ErrorLabel::UpstreamOom => "upstream_oom",
            ErrorLabel::ShuttingDown => "shutting_down",
            ErrorLabel::TooManyConnections => "too_many_connections",
            ErrorLabel::ResponseNotFound => "response_not_found",
        }
    }
}

/// The `kind` label values, in [`ErrorLabel::ALL`] order.
pub const ERROR_KINDS: [&str; ErrorLabel::ALL.len()] = {
    let mut out = [""; ErrorLabel::ALL.len()];
    let mut i = 0;
    while i < out.len() {
        out[i] = ErrorLabel::ALL[i].as_str();
        i += 1;
    }
    out
};

/// `kvgate_requests_by_endpoint_total{endpoint}` values: the client APIs' labels, in
/// `client_api::APIS` order.
pub fn endpoints() -> impl Iterator<Item = &'static str> {
    crate::client_api::APIS.iter().map(|a| a.label)
}
/// `kvgate_worker_restarts_total{reason}` values: how a worker restart was detected.
pub const RESTART_REASONS: [&str; 4] = [
    "kv_sequence_reset",
    "kv_cache_cleared",
    "counters_reset",
    "start_time_changed",
];

pub type Lbl = Arc<str>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub model: Lbl,
    pub worker: Lbl,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelWorker {
    pub model: Lbl,
    pub worker: Lbl,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: Lbl,
}

/// The exemplar of a traced request's latency: its trace id (32 hex digits), shown only in the
/// OpenMetrics exposition (`Accept: application/openmetrics-text`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TraceLabel {
    pub trace_id: String,
}

/// A latency histogram whose buckets keep the last sampled request's trace id.
pub type XHistogram = HistogramWithExemplars<TraceLabel>;
type XFamily<L> = Family<L, XHistogram, fn() -> XHistogram>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    pub worker: Lbl,
}

/// A worker-reported count by outcome (`result` is a fixed set: `ok`/`failed`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerResult {
    pub worker: Lbl,
    pub result: &'static str,
}

/// `kvgate_worker_info` labels: what the worker is, from config, discovery and DCGM.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerInfo {
    pub worker: Lbl,
    pub model: Lbl,
    /// The configured kind (`vllm`, `sglang`, ...).
    pub kind: String,
    /// DCGM's `modelName` (empty without `dcgm_url`).
    pub gpu_type: String,
    /// Configured `gpus`.
    pub gpus: u32,
    /// Configured role (`prefill`, `decode`, `both`).
    pub role: &'static str,
    /// Configured `tensor_parallelism` (empty when unset).
    pub tensor_parallelism: String,
    /// Configured `model_version` (empty when unset).
    pub model_version: String,
}

/// A client API's `endpoint` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    pub endpoint: &'static str,
}

/// A request's endpoint (`chat`, `completions`, `embeddings`) and whether it streamed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointStream {
    pub endpoint: &'static str,
    pub stream: &'static str,
}

/// A finished choice's `finish_reason`, reduced to kvgate-protocol's fixed set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelFinish {
    pub model: Lbl,
    pub finish_reason: &'static str,
}

/// An engine-side request phase (`queue`, `prefill`, `decode`) of a worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerPhase {
    pub worker: Lbl,
    pub phase: &'static str,
}

/// A worker and a reason from a fixed set ([`RESTART_REASONS`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerReason {
    pub worker: Lbl,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

/// One of the gateway's bounded caches (a fixed set: `tokenizer_segments`, `tokenizer_words`,
/// `kv_index`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheLabel {
    pub cache: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// A prefill/decode routing decision: `path` is `disaggregated` or `local`, `reason` a fixed set
/// (docs/metrics.md).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PdDecisionLabels {
    pub model: Lbl,
    pub path: &'static str,
    pub reason: &'static str,
}

/// A worker's role (`prefill`, `decode`, `both`: configured, or detected for `role = "auto"`;
/// `unknown` while an `auto` worker has not told it).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerRoleLabels {
    pub worker: Lbl,
    pub role: &'static str,
}

/// Every value of [`WorkerRoleLabels::role`].
pub const ROLE_LABELS: [&str; 4] = ["both", "prefill", "decode", "unknown"];

/// The trace exporter (`kvgate_tracing_*`).
pub struct TracingMetrics {
    pub dropped: Counter,
    pub exported: Counter,
    pub failed: Counter,
}

/// Prefill/decode disaggregation (`kvgate_pd_*`).
pub struct PdMetrics {
    pub decisions: Family<PdDecisionLabels, Counter>,
    pub prefill_duration: Histogram,
    pub transfer_wait: Histogram,
    pub handoff_failures: Family<KindLabel, Counter>,
    pub local_declined: Counter,
    pub worker_role: Family<WorkerRoleLabels, Gauge>,
}

/// `kvgate_epp_*`: the endpoint picker (`kvgate epp`); registered in every mode, zero unless the
/// ext_proc listener runs.
pub struct EppMetrics {
    /// ext_proc streams ended, by how (`end`: ok, cancelled, or the gRPC error code's name).
    pub streams: Family<EndLabel, Counter>,
    /// ext_proc streams open now.
    pub streams_open: Gauge,
    /// Requests picked, by `kind`: api (parsed, routed on the prompt) or load (bodiless or
    /// another path: least loaded).
    pub picks: Family<KindLabel, Counter>,
    /// Local replies sent instead of a pick, by HTTP status.
    pub immediate: Family<StatusLabel, Counter>,
    /// Responses the gateway reported as served by another endpoint than the pick (fallback).
    pub served_elsewhere: Counter,
    /// gRPC health checks answered, by service and result.
    pub health_checks: Family<HealthLabel, Counter>,
    /// Requests whose model `[[epp.model_rewrites]]` (or the rewrite header) changed, by the
    /// model they went to.
    pub model_rewrites: Family<ModelLabel, Counter>,
}

/// `kvgate_pool_*`: discovered worker pools (`[[worker_pools]]`: DNS, endpoints file,
/// InferencePool), by pool name (the configured prefix: a bounded set).
pub struct PoolMetrics {
    /// Members the pool's source gives now.
    pub members: Family<PoolLabel, Gauge>,
    /// Member sets applied (every DNS change, file change or pod change).
    pub updates: Family<PoolLabel, Counter>,
    /// Source failures that kept the last good set, by kind.
    pub errors: Family<PoolKindLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    pub pool: Lbl,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolKindLabel {
    pub pool: Lbl,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndLabel {
    pub end: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthLabel {
    pub service: &'static str,
    pub result: &'static str,
}

type HFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// A flow-control class and tenant: both bounded (classes are configured; tenants are those
/// listed in `flow_control.tenants`, the rest `other`, or `none`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassTenant {
    pub class: Lbl,
    pub tenant: Lbl,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassOutcome {
    pub class: Lbl,
    pub outcome: &'static str,
}

/// `kvgate_flow_requests_total{outcome}` values.
pub const FLOW_OUTCOMES: [&str; 8] = [
    "admitted",
    "admitted_best_effort",
    "shed",
    "queue_full",
    "queue_timeout",
    "objective_rejected",
    "no_worker",
    "shutting_down",
];

pub struct FlowMetrics {
    pub requests: Family<ClassOutcome, Counter>,
    pub queue_wait: HFamily<ClassTenant>,
    pub queue_length: Family<ClassTenant, Gauge>,
    pub tokens: Family<ClassTenant, Counter>,
    /// Cluster mode: free capacity left to a better-ranked waiter of a peer replica.
    pub cluster_deferrals: Counter,
    /// Cluster mode: requests admitted on this replica's own view (NATS down).
    pub cluster_fallback: Counter,
}

impl FlowMetrics {
    /// One reservation's end: its outcome, its wait in the queue, and (admitted) its tokens.
    pub fn record(
        &self,
        class: &Lbl,
        tenant: &Lbl,
        outcome: &'static str,
        waited: std::time::Duration,
        admitted_tokens: Option<u64>,
    ) {
        self.requests
            .get_or_create(&ClassOutcome {
                class: class.clone(),
                outcome,
            })
            .inc();
        let ct = ClassTenant {
            class: class.clone(),
            tenant: tenant.clone(),
        };
        self.queue_wait
            .get_or_create(&ct)
            .observe(waited.as_secs_f64());
        if let Some(t) = admitted_tokens {
            self.tokens.get_or_create(&ct).inc_by(t);
        }
    }

    /// The queue lengths now: every series seen before is reset, then set from `queued`.
    pub fn set_queued(&self, queued: &[(Lbl, Lbl, usize)]) {
        self.queue_length.clear();
        for (class, tenant, n) in queued {
            self.queue_length
                .get_or_create(&ClassTenant {
                    class: class.clone(),
                    tenant: tenant.clone(),
                })
                .set(*n as i64);
        }
    }
}
type FGauge = Gauge<f64, std::sync::atomic::AtomicU64>;
type FCounter = Counter<f64, std::sync::atomic::AtomicU64>;

// 1 ms .. ~2 min: request duration and TTFT span prefill of long prompts.
const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
fn latency_buckets() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}
fn latency_buckets_x() -> XHistogram {
    XHistogram::new(LATENCY_BUCKETS.into_iter())
}
fn itl_buckets() -> Histogram {
    // Inter-token gaps: 0.5 ms .. 2 s.
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0,
    ])
}
fn sub_ms_buckets() -> Histogram {
    // Router decision and upstream connect: 1 µs .. 100 ms.
    Histogram::new([
        0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001,
        0.0025, 0.01, 0.1,
    ])
}
fn token_count_buckets() -> Histogram {
    // Prompt and completion sizes: 1 .. 128k tokens, powers of 4 (plus 2k/8k/32k context sizes).
    Histogram::new([
        1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0,
        131072.0,
    ])
}
fn error_ratio_buckets() -> Histogram {
    Histogram::new([0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0])
}
fn recovery_buckets() -> Histogram {
    // Worker outages and start-ups: 100 ms .. 1 h.
    Histogram::new([
        0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    ])
}
fn ratio_buckets() -> Histogram {
    Histogram::new([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0])
}

pub struct Metrics {
    /// `kvgate_cluster_*` (registered whether or not cluster mode is on).
    pub cluster: kvgate_cluster::ClusterMetrics,
    registry: Registry,
    /// Distinguishes registries in the per-thread handle cache (tests run many apps per process).
    id: u64,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: XFamily<ModelLabel>,
    pub decision: Histogram,
    pub queue_wait: Histogram,
    pub queue_depth: Gauge,
    pub client_connections: Gauge,
    pub connections_refused: Counter,
    pub upstream_stray: Counter,
    pub ttft: XFamily<ModelLabel>,
    pub non_stream_response: HFamily<ModelLabel>,
    pub worker_ttft: HFamily<WorkerLabel>,
    pub worker_duration: HFamily<WorkerLabel>,
    pub prompt_tokens_hist: HFamily<ModelLabel>,
    pub completion_tokens_hist: HFamily<ModelLabel>,
    pub itl: HFamily<ModelLabel>,
    pub jitter: HFamily<ModelLabel>,
    pub upstream_connect: Histogram,
    pub prompt_tokens: Family<ModelWorker, Counter>,
    pub completion_tokens: Family<ModelWorker, Counter>,
    pub cached_tokens: Family<ModelWorker, Counter>,
    pub inflight: Family<WorkerLabel, Gauge>,
    pub active_blocks: Family<WorkerLabel, Gauge>,
    pub pending_prefill: Family<WorkerLabel, Gauge>,
    pub predicted_ttft: Family<WorkerLabel, FGauge>,
    pub prefill_throughput: Family<WorkerLabel, FGauge>,
    pub ttft_prediction_error: Histogram,
    pub worker_healthy: Family<WorkerLabel, Gauge>,
    pub worker_breaker: Family<WorkerLabel, Gauge>,
    pub index_blocks: Gauge,
    /// Responses / Messages requests routed on an approximate rendering of their prompt.
    pub agent_approximate: Family<EndpointLabel, Counter>,
    /// Response ids pinned to their origin worker (`pins.rs`).
    pub response_pins: Gauge,
    pub index_predicted_blocks: Gauge,
    pub cache_entries: Family<CacheLabel, Gauge>,
    pub cache_bytes: Family<CacheLabel, Gauge>,
    pub predicted_overlap: Histogram,
    pub realised_cached: Histogram,
    pub retries: Family<ReasonLabel, Counter>,
    pub errors: Family<KindLabel, Counter>,
    pub stream_errors: Counter,
    pub goodput: Family<ModelLabel, Counter>,
    pub slo_checked: Family<ModelLabel, Counter>,
    pub cost_dollars: Family<WorkerLabel, FCounter>,
    pub tokens_per_dollar: FGauge,
    pub cost_per_hour: Family<WorkerLabel, FGauge>,
    pub gpus: Family<WorkerLabel, Gauge>,
    pub gpu_seconds: Family<WorkerLabel, FCounter>,
    pub idle_cost_dollars: Family<WorkerLabel, FCounter>,
    pub config_reloads: Family<ReasonLabel, Counter>,
    pub requests_by_endpoint: Family<EndpointStream, Counter>,
    /// `requests_by_endpoint`'s series, resolved once: `[api id][stream as usize]`.
    by_endpoint: Vec<[Counter; 2]>,
    pub finish_reasons: Family<ModelFinish, Counter>,
    /// MTTR: a worker's first failed health probe of an outage → healthy again.
    pub worker_recovery: HFamily<WorkerLabel>,
    /// A worker added (config, reload, DNS, admin) → its first successful health probe.
    pub time_to_routable: Histogram,
    pub pd: PdMetrics,
    /// Flow control (`[flow_control]`): per class and tenant.
    pub flow: FlowMetrics,
    pub epp: EppMetrics,
    /// Discovered worker pools (`worker_pools.rs`).
    pub pools: PoolMetrics,
    /// The trace exporter (`[tracing]`): spans dropped, exported, failed.
    pub tracing: TracingMetrics,
    /// Worker-reported signals (kvgate-fleet monitors), set at scrape time by `fleet::Monitors::export`.
    pub worker: WorkerSignals,
}

/// Families re-exporting what the fleet monitors read from workers. Series are rebuilt on every
/// scrape from the running monitors, so removed workers disappear.
pub struct WorkerSignals {
    pub running: Family<ModelWorker, FGauge>,
    pub waiting: Family<ModelWorker, FGauge>,
    pub kv_usage: Family<ModelWorker, FGauge>,
    pub load_stale: Family<WorkerLabel, Gauge>,
    pub block_size_mismatch: Family<WorkerLabel, Gauge>,
    pub scrapes: Family<WorkerResult, Counter>,
    pub health_checks: Family<WorkerResult, Counter>,
    pub kv_events: Family<WorkerLabel, Counter>,
    pub kv_malformed: Family<WorkerLabel, Counter>,
    pub kv_tier_only: Family<WorkerLabel, Counter>,
    pub kv_gaps: Family<WorkerLabel, Counter>,
    pub kv_replays: Family<WorkerResult, Counter>,
    pub kv_resets: Family<WorkerLabel, Counter>,
    pub kv_reconnects: Family<WorkerLabel, Counter>,
    pub info: Family<WorkerInfo, Gauge>,
    pub kv_capacity_blocks: Family<WorkerLabel, Gauge>,
    pub kv_blocks_stored: Family<WorkerLabel, Counter>,
    pub kv_blocks_removed: Family<WorkerLabel, Counter>,
    pub prefix_cache_queries: Family<WorkerLabel, FCounter>,
    pub prefix_cache_hits: Family<WorkerLabel, FCounter>,
    pub preemptions: Family<WorkerLabel, FCounter>,
    pub dcgm_scrapes: Family<WorkerResult, Counter>,
    pub gpu_count: Family<WorkerLabel, Gauge>,
    pub gpu_utilization: Family<WorkerLabel, FGauge>,
    pub gpu_sm_active: Family<WorkerLabel, FGauge>,
    pub gpu_memory_used: Family<WorkerLabel, FGauge>,
    pub gpu_memory_free: Family<WorkerLabel, FGauge>,
    pub gpu_power: Family<WorkerLabel, FGauge>,
    pub gpu_temperature: Family<WorkerLabel, FGauge>,
    pub gpu_energy: Family<WorkerLabel, FCounter>,
    pub engine_phase_seconds: Family<WorkerPhase, FCounter>,
    pub engine_phase_requests: Family<WorkerPhase, FCounter>,
    pub iteration_tokens: Family<WorkerLabel, FCounter>,
    pub iterations: Family<WorkerLabel, FCounter>,
    pub max_num_batched_tokens: Family<WorkerLabel, Gauge>,
    pub max_num_seqs: Family<WorkerLabel, Gauge>,
    pub paused_requests: Family<WorkerLabel, Gauge>,
    pub spec_drafts: Family<WorkerLabel, FCounter>,
    pub spec_draft_tokens: Family<WorkerLabel, FCounter>,
    pub spec_accepted_tokens: Family<WorkerLabel, FCounter>,
    pub restarts: Family<WorkerReason, Counter>,
}

impl WorkerSignals {
    /// Drop every series (before re-setting them from the current monitors).
    pub fn clear(&self) {
        self.running.clear();
        self.waiting.clear();
        self.kv_usage.clear();
        self.load_stale.clear();
        self.block_size_mismatch.clear();
        self.scrapes.clear();
        self.health_checks.clear();
        self.kv_events.clear();
        self.kv_malformed.clear();
        self.kv_tier_only.clear();
        self.kv_gaps.clear();
        self.kv_replays.clear();
        self.kv_resets.clear();
        self.kv_reconnects.clear();
        self.info.clear();
        self.kv_capacity_blocks.clear();
        self.kv_blocks_stored.clear();
        self.kv_blocks_removed.clear();
        self.prefix_cache_queries.clear();
        self.prefix_cache_hits.clear();
        self.preemptions.clear();
        self.dcgm_scrapes.clear();
        self.gpu_count.clear();
        self.gpu_utilization.clear();
        self.gpu_sm_active.clear();
        self.gpu_memory_used.clear();
        self.gpu_memory_free.clear();
        self.gpu_power.clear();
        self.gpu_temperature.clear();
        self.gpu_energy.clear();
        self.engine_phase_seconds.clear();
        self.engine_phase_requests.clear();
        self.iteration_tokens.clear();
        self.iterations.clear();
        self.max_num_batched_tokens.clear();
        self.max_num_seqs.clear();
        self.paused_requests.clear();
        self.spec_drafts.clear();
        self.spec_draft_tokens.clear();
        self.spec_accepted_tokens.clear();
        self.restarts.clear();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        macro_rules! reg {
            ($name:literal, $help:literal, $m:expr) => {{
                let m = $m;
                r.register($name, $help, m.clone());
                m
            }};
        }
        let m = Metrics {
            requests: reg!("kvgate_requests", "Requests finished, by model, worker and HTTP status (worker=\"none\" when none was chosen).", Family::default()),
            request_duration: reg!("kvgate_request_duration_seconds", "Time from request arrival to the last response byte.", XFamily::new_with_constructor(latency_buckets_x)),
            decision: reg!("kvgate_router_decision_seconds", "Time spent tokenizing, hashing and choosing a worker.", sub_ms_buckets()),
            queue_wait: reg!("kvgate_queue_wait_seconds", "Time requests waited in the admission queue (0 when not queued).", latency_buckets()),
            queue_depth: reg!("kvgate_queue_depth", "Requests currently waiting in the admission queue.", Gauge::default()),
            client_connections: reg!("kvgate_client_connections", "Client connections open on the data-path listener.", Gauge::default()),
            upstream_stray: reg!("kvgate_upstream_stray_responses", "Times a worker was caught writing bytes after a finished response (its connections are then not reused for 60 s).", Counter::default()),
            connections_refused: reg!("kvgate_client_connections_refused", "Client connections refused at accept because server.max_connections were open (answered 503 and closed).", Counter::default()),
            ttft: reg!("kvgate_time_to_first_token_seconds", "Time from request arrival to the first generated token of streamed requests (non-streamed ones: kvgate_non_stream_response_seconds).", XFamily::new_with_constructor(latency_buckets_x)),
            non_stream_response: reg!("kvgate_non_stream_response_seconds", "Time from request arrival to the complete response of non-streamed completions and chat requests.", HFamily::new_with_constructor(latency_buckets)),
            worker_ttft: reg!("kvgate_worker_time_to_first_token_seconds", "TTFT of streamed requests, by the worker that served them.", HFamily::new_with_constructor(latency_buckets)),
            worker_duration: reg!("kvgate_worker_request_duration_seconds", "Arrival to last response byte, by the worker that served the request.", HFamily::new_with_constructor(latency_buckets)),
            prompt_tokens_hist: reg!("kvgate_request_prompt_tokens", "Prompt tokens per successful request (worker usage, else the gateway's count).", HFamily::new_with_constructor(token_count_buckets)),
            completion_tokens_hist: reg!("kvgate_request_completion_tokens", "Completion tokens per successful completions/chat request.", HFamily::new_with_constructor(token_count_buckets)),
            itl: reg!("kvgate_inter_token_latency_seconds", "Gaps between consecutive streamed token events.", HFamily::new_with_constructor(itl_buckets)),
            jitter: reg!("kvgate_stream_jitter_seconds", "Per-stream standard deviation of inter-token gaps.", HFamily::new_with_constructor(itl_buckets)),
            upstream_connect: reg!("kvgate_upstream_connect_seconds", "Time to open a connection to a worker (TCP connect, plus the TLS handshake for https; new pooled connections only).", sub_ms_buckets()),
            prompt_tokens: reg!("kvgate_prompt_tokens", "Prompt tokens reported by workers (usage), else estimated by the gateway tokenizer.", Family::default()),
            completion_tokens: reg!("kvgate_completion_tokens", "Completion tokens reported by workers (usage), else counted stream events.", Family::default()),
            cached_tokens: reg!("kvgate_cached_tokens", "Prompt tokens the worker served from its prefix cache (usage.prompt_tokens_details.cached_tokens).", Family::default()),
            inflight: reg!("kvgate_inflight_requests", "Requests in flight to each worker through this gateway.", Family::default()),
            active_blocks: reg!("kvgate_worker_active_blocks", "KV blocks held by the in-flight requests this gateway routes on, per worker (its own; in cluster mode also its peers', each block once).", Family::default()),
            pending_prefill: reg!("kvgate_worker_pending_prefill_tokens", "Prompt tokens sent to each worker whose first token has not arrived yet (in cluster mode including the peers' requests it knows with their blocks).", Family::default()),
            predicted_ttft: reg!("kvgate_worker_predicted_ttft_seconds", "Predicted TTFT (from dispatch) of the last request routed to each worker, by the latency model.", Family::default()),
            prefill_throughput: reg!("kvgate_worker_prefill_tokens_per_second", "Each worker's fitted prefill throughput: a 1024-token prompt on the idle worker at its learned speed.", Family::default()),
            ttft_prediction_error: reg!("kvgate_ttft_prediction_error_ratio", "|predicted - observed| / observed TTFT (from dispatch) of streamed requests, per request; in PD pools per prefill leg (a disaggregated request's decode leg is not counted).", error_ratio_buckets()),
            worker_healthy: reg!("kvgate_worker_routable", "1 when the worker is healthy, not draining, its breaker is not open and its role is known (role = auto).", Family::default()),
            worker_breaker: reg!("kvgate_worker_breaker_state", "Circuit breaker state per worker: 0 closed, 1 half-open, 2 open.", Family::default()),
            agent_approximate: reg!("kvgate_agent_render_approximate", "Responses / Messages requests whose prompt kvgate could not render exactly as vLLM does (a shape without a chat form, a template refusing the conversation): routed on the approximate text instead.", Family::default()),
            response_pins: reg!("kvgate_response_pins", "Responses ids pinned to the worker that stored them (bounded by [response_pins]).", Gauge::default()),
            index_blocks: reg!("kvgate_index_blocks", "Blocks in the router's KV index (all workers), predicted ones included.", Gauge::default()),
            index_predicted_blocks: reg!("kvgate_index_predicted_blocks", "Index entries predicted on route for workers with KV events and not yet confirmed by their events (they lapse after routing.predicted_ttl_s).", Gauge::default()),
            cache_entries: reg!("kvgate_cache_entries", "Entries in each of the gateway's bounded caches (tokenizer_segments, tokenizer_words: summed over the models' tokenizers; kv_index: (block, worker) pairs).", Family::default()),
            cache_bytes: reg!("kvgate_cache_bytes", "Bytes held by each tokenizer cache (as counted against its bound; tokenizer_words estimated).", Family::default()),
            predicted_overlap: reg!("kvgate_predicted_overlap_ratio", "Fraction of the prompt's blocks the router predicted cached on the chosen worker.", ratio_buckets()),
            realised_cached: reg!("kvgate_realised_cached_ratio", "Fraction of the prompt the worker reported as cached (cached_tokens / prompt_tokens).", ratio_buckets()),
            retries: reg!("kvgate_retries", "Attempts on another worker, by reason.", Family::default()),
            errors: reg!("kvgate_errors", "Failed requests by kind (client, upstream and gateway failures).", Family::default()),
            stream_errors: reg!("kvgate_stream_errors", "Streams ended with an SSE error event because the worker failed after the first byte.", Counter::default()),
            goodput: reg!("kvgate_goodput_requests", "Successful requests that met both the TTFT and the inter-token latency SLO.", Family::default()),
            slo_checked: reg!("kvgate_slo_checked_requests", "Successful requests evaluated against the SLOs (goodput denominator).", Family::default()),
            cost_dollars: reg!("kvgate_cost_dollars", "Accrued worker cost from configured cost_per_hour while the worker is in the fleet (every replica accrues the full figure: aggregate with max by (worker)).", Family::default()),
            tokens_per_dollar: reg!("kvgate_tokens_per_dollar", "Prompt+completion tokens served per accrued dollar since start (0 without costs).", FGauge::default()),
            cost_per_hour: reg!("kvgate_worker_cost_per_hour", "Configured dollars per hour of each worker (the same on every gateway replica: aggregate with max by (worker)).", Family::default()),
            gpus: reg!("kvgate_worker_gpus", "Configured GPUs of each worker.", Family::default()),
            gpu_seconds: reg!("kvgate_worker_gpu_seconds", "GPU-seconds accrued (gpus x time in the fleet); every replica accrues the full figure.", Family::default()),
            idle_cost_dollars: reg!("kvgate_worker_idle_cost_dollars", "Part of kvgate_cost_dollars accrued while the worker ran nothing (engine-reported running+waiting = 0, else nothing in flight through this gateway).", Family::default()),
            config_reloads: reg!("kvgate_config_reloads", "Configuration reload attempts by result.", Family::default()),
            requests_by_endpoint: reg!("kvgate_requests_by_endpoint", "Requests finished, by endpoint (chat, completions, embeddings, responses, messages, …) and whether the client asked for a stream.", Family::default()),
            by_endpoint: Default::default(),
            finish_reasons: reg!("kvgate_finish_reasons", "Successful completions/chat responses by model and finish_reason (stop, length, tool_calls, content_filter, other; first choice).", Family::default()),
            worker_recovery: reg!("kvgate_worker_recovery_seconds", "Worker outages (MTTR): its first failed health probe to the probe that found it healthy again.", HFamily::new_with_constructor(recovery_buckets)),
            time_to_routable: reg!("kvgate_worker_time_to_routable_seconds", "Time from a worker being added (config, reload, DNS, admin) to its first successful health probe.", recovery_buckets()),
            pd: PdMetrics {
                decisions: reg!("kvgate_pd_decisions", "Requests to pools with prefill workers, by path (disaggregated: a prefill worker ran the prefill; local: the decode worker ran it all) and reason.", Family::default()),
                prefill_duration: reg!("kvgate_pd_prefill_duration_seconds", "Duration of successful prefill legs (sent to answer read).", latency_buckets()),
                transfer_wait: reg!("kvgate_pd_transfer_wait_seconds", "Disaggregated streams: the decode worker's first token minus the prefill worker's answer (decode queue + KV transfer + one step).", latency_buckets()),
                handoff_failures: reg!("kvgate_pd_handoff_failures", "Prefill/decode handoff failures by kind (prefill_error, no_params, decode_error).", Family::default()),
                local_declined: reg!("kvgate_pd_local_declined", "Short prompts (below pd.min_uncached_tokens) disaggregated anyway because the decode worker that would run them whole had more requests in flight than the decode pool's average plus one.", Counter::default()),
                worker_role: reg!("kvgate_worker_role", "1 for each worker's prefill/decode role: prefill, decode, both (configured, or detected from the worker's /server_info with role = auto), or unknown while an auto worker has not answered (it gets no traffic).", Family::default()),
            },
            flow: FlowMetrics {
                requests: reg!("kvgate_flow_requests", "Flow control: requests by class and outcome (admitted, admitted_best_effort, shed, queue_full, queue_timeout, objective_rejected, no_worker, shutting_down).", Family::default()),
                queue_wait: reg!("kvgate_flow_queue_wait_seconds", "Flow control: time requests waited in the admission queue, by class and tenant (0 when not queued).", HFamily::new_with_constructor(latency_buckets)),
                queue_length: reg!("kvgate_flow_queue_length", "Flow control: requests waiting in the admission queue now, by class and tenant.", Family::default()),
                tokens: reg!("kvgate_flow_admitted_tokens", "Flow control: tokens (prompt + expected output, as charged to the fair share) of admitted requests, by class and tenant.", Family::default()),
                cluster_deferrals: reg!("kvgate_flow_cluster_deferrals", "Flow control in cluster mode: times a request here left free capacity to a better-ranked waiter of a peer replica (a higher class, or a smaller fair-share tag).", Counter::default()),
                cluster_fallback: reg!("kvgate_flow_cluster_fallback", "Flow control in cluster mode: requests admitted on this replica's own queue alone because NATS was down (shares and class order not cluster-wide for them).", Counter::default()),
            },
            epp: EppMetrics {
                streams: reg!("kvgate_epp_streams", "Endpoint picker: ext_proc streams ended, by end (ok, cancelled: the gateway reset it, or the gRPC error's code name).", Family::default()),
                streams_open: reg!("kvgate_epp_streams_open", "Endpoint picker: ext_proc streams open now (one per request the gateway is processing).", Gauge::default()),
                picks: reg!("kvgate_epp_picks", "Endpoint picker: requests given a destination, by kind (api: parsed and routed on its prompt; load: bodiless or not a client API, least loaded).", Family::default()),
                immediate: reg!("kvgate_epp_immediate_responses", "Endpoint picker: local replies sent instead of a destination (ImmediateResponse), by HTTP status (429 shed, 503 no endpoint, 400/404/413 bad request).", Family::default()),
                served_elsewhere: reg!("kvgate_epp_served_elsewhere", "Endpoint picker: responses the gateway reported as served by another endpoint than the first pick (it fell back along the list); the request's load moved there.", Counter::default()),
                health_checks: reg!("kvgate_epp_health_checks", "Endpoint picker: grpc.health.v1 checks answered, by service (liveness, readiness, ext_proc, other) and result (serving, not_serving, unknown).", Family::default()),
                model_rewrites: reg!("kvgate_epp_model_rewrites", "Endpoint picker: requests whose model was rewritten (epp.model_rewrites or x-llm-d-model-name-rewrite), by the model (pool) they went to.", Family::default()),
            },
            pools: PoolMetrics {
                members: reg!("kvgate_pool_members", "Discovered worker pools ([[worker_pools]]: dns, file, inference_pool): members the pool's source gives now, by pool name.", Family::default()),
                updates: reg!("kvgate_pool_membership_updates", "Discovered worker pools: member sets applied (a DNS answer, endpoints file or pod change that reached the registry), by pool name.", Family::default()),
                errors: reg!("kvgate_pool_discovery_errors", "Discovered worker pools: source failures that kept the last good member set, by pool and kind (unreadable, invalid: endpoints file; config, api, gone, invalid_object: Kubernetes).", Family::default()),
            },
            tracing: TracingMetrics {
                dropped: reg!("kvgate_tracing_spans_dropped", "Spans dropped because the trace exporter's queue was full (collector slow or down).", Counter::default()),
                exported: reg!("kvgate_tracing_spans_exported", "Spans the OTLP collector accepted.", Counter::default()),
                failed: reg!("kvgate_tracing_spans_failed", "Spans whose export failed (collector down, refused, timed out, or rejected them).", Counter::default()),
            },
            worker: WorkerSignals {
                running: reg!("kvgate_worker_running_requests", "Requests in the worker's running batch, as the worker reports (last successful scrape)", Family::default()),
                waiting: reg!("kvgate_worker_waiting_requests", "Requests queued inside the worker, as the worker reports (last successful scrape)", Family::default()),
                kv_usage: reg!("kvgate_worker_kv_usage_ratio", "Worker-reported KV-cache usage, 0 to 1 (last successful scrape)", Family::default()),
                load_stale: reg!("kvgate_worker_load_stale", "1 when the worker's scraped load is stale or missing and routing ignores it (fail open)", Family::default()),
                block_size_mismatch: reg!("kvgate_worker_block_size_mismatch", "1 when the worker's KV block size differs from its pool's: excluded from KV scoring", Family::default()),
                scrapes: reg!("kvgate_worker_scrapes", "Load scrapes of the worker's metrics endpoint, by result", Family::default()),
                health_checks: reg!("kvgate_worker_health_checks", "Health probes of the worker, by result", Family::default()),
                kv_events: reg!("kvgate_worker_kv_events", "KV events received from the worker and applied to the index", Family::default()),
                kv_malformed: reg!("kvgate_worker_kv_malformed_messages", "KV-event messages from the worker that failed to decode (dropped)", Family::default()),
                kv_tier_only: reg!("kvgate_worker_kv_tier_only_events", "Offload-tier KV events without tokens (recorded as tier information only)", Family::default()),
                kv_gaps: reg!("kvgate_worker_kv_event_gaps", "Sequence gaps detected in the worker's KV-event stream", Family::default()),
                kv_replays: reg!("kvgate_worker_kv_replays", "Replay requests for missed KV events, by result", Family::default()),
                kv_resets: reg!("kvgate_worker_kv_index_resets", "Times the worker's KV index entries were dropped (restart, sequence regression, AllBlocksCleared, unrecoverable gap)", Family::default()),
                kv_reconnects: reg!("kvgate_worker_kv_reconnects", "Reconnects of the worker's KV-event subscription", Family::default()),
                info: reg!("kvgate_worker_info", "Always 1: the worker's model, kind, GPU type (DCGM modelName), configured GPU count, role, tensor parallelism and model version as labels", Family::default()),
                kv_capacity_blocks: reg!("kvgate_worker_kv_capacity_blocks", "KV-cache capacity in the engine's blocks, as the worker reports (vLLM num_gpu_blocks; last successful scrape)", Family::default()),
                kv_blocks_stored: reg!("kvgate_worker_kv_blocks_stored", "KV blocks the worker's events stored (BlockStored), applied to the exact index", Family::default()),
                kv_blocks_removed: reg!("kvgate_worker_kv_blocks_removed", "KV blocks the worker's events removed (BlockRemoved: evictions), applied to the exact index", Family::default()),
                prefix_cache_queries: reg!("kvgate_worker_prefix_cache_queries", "Prompt tokens the engine looked up in its prefix cache, as the worker reports (its own counter)", Family::default()),
                prefix_cache_hits: reg!("kvgate_worker_prefix_cache_hits", "Prompt tokens the engine found in its prefix cache, as the worker reports (its own counter)", Family::default()),
                preemptions: reg!("kvgate_worker_preemptions", "Requests the engine preempted, as the worker reports (vLLM num_preemptions_total)", Family::default()),
                dcgm_scrapes: reg!("kvgate_worker_dcgm_scrapes", "Scrapes of the worker's dcgm-exporter (dcgm_url), by result", Family::default()),
                gpu_count: reg!("kvgate_worker_gpu_count", "GPUs the worker's dcgm-exporter reports", Family::default()),
                gpu_utilization: reg!("kvgate_worker_gpu_utilization_ratio", "DCGM_FI_DEV_GPU_UTIL / 100, mean over the worker's GPUs", Family::default()),
                gpu_sm_active: reg!("kvgate_worker_gpu_sm_active_ratio", "DCGM_FI_PROF_SM_ACTIVE, mean over the worker's GPUs", Family::default()),
                gpu_memory_used: reg!("kvgate_worker_gpu_memory_used_bytes", "DCGM_FI_DEV_FB_USED in bytes, summed over the worker's GPUs", Family::default()),
                gpu_memory_free: reg!("kvgate_worker_gpu_memory_free_bytes", "DCGM_FI_DEV_FB_FREE in bytes, summed over the worker's GPUs", Family::default()),
                gpu_power: reg!("kvgate_worker_gpu_power_watts", "DCGM_FI_DEV_POWER_USAGE, summed over the worker's GPUs", Family::default()),
                gpu_temperature: reg!("kvgate_worker_gpu_temperature_celsius", "DCGM_FI_DEV_GPU_TEMP of the worker's hottest GPU", Family::default()),
                gpu_energy: reg!("kvgate_worker_gpu_energy_joules", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION in joules (since the GPUs' driver loaded), summed over the worker's GPUs", Family::default()),
                engine_phase_seconds: reg!("kvgate_worker_engine_phase_seconds", "Seconds requests spent in each engine-side phase (queue, prefill, decode), as the worker reports (its histogram's sum)", Family::default()),
                engine_phase_requests: reg!("kvgate_worker_engine_phase_requests", "Requests the engine timed in each phase (its histogram's count): mean = rate(seconds) / rate(requests)", Family::default()),
                iteration_tokens: reg!("kvgate_worker_iteration_tokens", "Tokens the engine ran in its steps (vLLM iteration_tokens_total sum; TRT-LLM context tokens + generation requests per iteration)", Family::default()),
                iterations: reg!("kvgate_worker_iterations", "Engine steps (iterations) behind kvgate_worker_iteration_tokens_total", Family::default()),
                max_num_batched_tokens: reg!("kvgate_worker_max_num_batched_tokens", "The engine's token budget per step (TRT-LLM maxNumTokensRuntime, else the configured max_num_batched_tokens)", Family::default()),
                max_num_seqs: reg!("kvgate_worker_max_num_seqs", "The engine's most sequences per step (TRT-LLM maxBatchSizeRuntime, else the configured max_num_seqs)", Family::default()),
                paused_requests: reg!("kvgate_worker_paused_requests", "Requests paused in the engine's newest iteration (TRT-LLM numPausedRequests)", Family::default()),
                spec_drafts: reg!("kvgate_worker_spec_decode_drafts", "Speculative decoding drafts, as the worker reports", Family::default()),
                spec_draft_tokens: reg!("kvgate_worker_spec_decode_draft_tokens", "Speculative decoding draft tokens proposed, as the worker reports", Family::default()),
                spec_accepted_tokens: reg!("kvgate_worker_spec_decode_accepted_tokens", "Speculative decoding draft tokens accepted, as the worker reports", Family::default()),
                restarts: reg!("kvgate_worker_restarts", "Worker restarts detected, by how (kv_sequence_reset, kv_cache_cleared, counters_reset, start_time_changed); one per 30 s at most", Family::default()),
            },
            cluster: kvgate_cluster::ClusterMetrics::register(&mut r),
            registry: r,
            id: NEXT_METRICS_ID.fetch_add(1, Ordering::Relaxed),
        };
        // Unlabelled-by-worker counters exist at 0 from the start (a family that appears only when
        // first used makes `rate()`/`increase()` return nothing instead of 0).
        for reason in RETRY_REASONS {
            let _ = m.retries.get_or_create(&ReasonLabel { reason });
        }
        for reason in RELOAD_RESULTS {
            let _ = m.config_reloads.get_or_create(&ReasonLabel { reason });
        }
        for kind in ERROR_KINDS {
            let _ = m.errors.get_or_create(&KindLabel { kind });
        }
        let mut m = m;
        for (e, endpoint) in endpoints().enumerate() {
            m.by_endpoint.push(Default::default());
            for (i, stream) in ["false", "true"].into_iter().enumerate() {
                m.by_endpoint[e][i] = m
                    .requests_by_endpoint
                    .get_or_create(&EndpointStream { endpoint, stream })
                    .clone();
            }
        }
        m
    }

    /// `kvgate_requests_by_endpoint_total` of an API ([`crate::client_api::ClientApi::id`]) and
    /// stream flag.
    pub fn by_endpoint(&self, api: usize, stream: bool) -> &Counter {
        &self.by_endpoint[api.min(self.by_endpoint.len() - 1)][usize::from(stream)]
    }

    /// The series a request for `model` served by `worker` records, resolved once per thread and
    /// (model, worker) instead of a `Family` lookup (label hashing + lock) per metric per request.
    /// Keyed by the label `Arc`s' addresses: the entry holds both `Arc`s, so an address cannot be
    /// reused by another label while it is cached.
    pub fn handles(&self, model: &Lbl, worker: &Lbl) -> Arc<RequestHandles> {
        let key = (
            self.id,
            Arc::as_ptr(model) as *const u8 as usize,
            Arc::as_ptr(worker) as *const u8 as usize,
        );
        let new = || Arc::new(RequestHandles::new(model.clone(), worker.clone()));
        // `try_with`: a request finished while its thread's locals are being torn down (a runtime
        // dropped at thread exit) still records, just uncached.
        HANDLES
            .try_with(|c| {
                let mut c = c.borrow_mut();
                if let Some(h) = c.get(&key) {
                    return h.clone();
                }
                // Labels come from config and discovery, so this stays small; a bound keeps a
                // churning DNS fleet from growing it (and its pinned label strings) forever.
                if c.len() >= HANDLE_CACHE_MAX {
                    c.clear();
                }
                let h = new();
                c.insert(key, h.clone());
                h
            })
            .unwrap_or_else(|_| new())
    }

    /// `kvgate_cache_entries` of one cache, and `kvgate_cache_bytes` when its bytes are measured.
    pub fn set_cache(&self, cache: &'static str, entries: usize, bytes: Option<usize>) {
        let l = CacheLabel { cache };
        let n = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.cache_entries.get_or_create(&l).set(n(entries));
        if let Some(b) = bytes {
            self.cache_bytes.get_or_create(&l).set(n(b));
        }
    }

    pub fn error(&self, kind: ErrorLabel) {
        let kind = kind.as_str();
        self.errors.get_or_create(&KindLabel { kind }).inc();
    }

    /// Render the registry in the classic text format (version 0.0.4): no exemplars.
    pub fn render(&self) -> String {
        let mut om = String::with_capacity(16 << 10);
        if prometheus_client::encoding::text::encode_registry(&mut om, &self.registry).is_err() {
            return String::new();
        }
        let mut out = openmetrics_to_classic(&om);
        if let Some(p) = process::read() {
            process::render(&p, &mut out);
        }
        out
    }

    /// Render the registry in the OpenMetrics text format (1.0.0), with the latency histograms'
    /// exemplars (trace ids of sampled requests).
    pub fn render_openmetrics(&self) -> String {
        let mut om = String::with_capacity(16 << 10);
        if prometheus_client::encoding::text::encode_registry(&mut om, &self.registry).is_err() {
            return String::new();
        }
        if let Some(p) = process::read() {
            let mut classic = String::new();
            process::render(&p, &mut classic);
            // OpenMetrics names a counter family without its samples' `_total`.
            om.push_str(
                &classic
                    .replace(
                        "# HELP process_cpu_seconds_total",
                        "# HELP process_cpu_seconds",
                    )
                    .replace(
                        "# TYPE process_cpu_seconds_total",
                        "# TYPE process_cpu_seconds",
                    ),
            );
        }
        om.push_str("# EOF\n");
        om
    }
}

static NEXT_METRICS_ID: AtomicU64 = AtomicU64::new(0);
const HANDLE_CACHE_MAX: usize = 4096;

/// (metrics id, model label address, worker label address) → that pair's handles.
type HandleCache = HashMap<(u64, usize, usize), Arc<RequestHandles>, kvgate_core::FastBuild>;

thread_local! {
    static HANDLES: RefCell<HandleCache> = RefCell::new(HashMap::default());
}

/// Handles to one (model, worker)'s series in the per-request families. Each is resolved on first
/// use (`get_or_create`, then a clone sharing the same atomic cells), so exactly the series that
/// per-request lookups would create exist: none appears at zero before it is first recorded.
/// Safe because the per-request families are never cleared or pruned.
pub struct RequestHandles {
    pub model: Lbl,
    pub worker: Lbl,
    ok: OnceLock<Counter>,
    duration: OnceLock<XHistogram>,
    ttft: OnceLock<XHistogram>,
    non_stream_response: OnceLock<Histogram>,
    worker_ttft: OnceLock<Histogram>,
    worker_duration: OnceLock<Histogram>,
    prompt_tokens_hist: OnceLock<Histogram>,
    completion_tokens_hist: OnceLock<Histogram>,
    itl: OnceLock<Histogram>,
    jitter: OnceLock<Histogram>,
    prompt_tokens: OnceLock<Counter>,
    completion_tokens: OnceLock<Counter>,
    cached_tokens: OnceLock<Counter>,
    slo_checked: OnceLock<Counter>,
    goodput: OnceLock<Counter>,
    finish: [OnceLock<Counter>; 5],
}

impl RequestHandles {
    fn new(model: Lbl, worker: Lbl) -> Self {
        RequestHandles {
            model,
            worker,
            ok: OnceLock::new(),
            duration: OnceLock::new(),
            ttft: OnceLock::new(),
            non_stream_response: OnceLock::new(),
            worker_ttft: OnceLock::new(),
            worker_duration: OnceLock::new(),
            prompt_tokens_hist: OnceLock::new(),
            completion_tokens_hist: OnceLock::new(),
            itl: OnceLock::new(),
            jitter: OnceLock::new(),
            prompt_tokens: OnceLock::new(),
            completion_tokens: OnceLock::new(),
            cached_tokens: OnceLock::new(),
            slo_checked: OnceLock::new(),
            goodput: OnceLock::new(),
            finish: Default::default(),
        }
    }

    /// True when these handles are for exactly these label `Arc`s.
    pub fn is_for(&self, model: &Lbl, worker: &Lbl) -> bool {
        Arc::ptr_eq(&self.model, model) && Arc::ptr_eq(&self.worker, worker)
    }

    fn ml(&self) -> ModelLabel {
        ModelLabel {
            model: self.model.clone(),
        }
    }

    fn mw(&self) -> ModelWorker {
        ModelWorker {
            model: self.model.clone(),
            worker: self.worker.clone(),
        }
    }

    /// `kvgate_requests` with this model, worker and `status` (200 cached, others looked up).
    pub fn request(&self, m: &Metrics, status: u16) -> Counter {
        let lookup = || {
            m.requests
                .get_or_create(&RequestLabels {
                    model: self.model.clone(),
                    worker: self.worker.clone(),
                    status,
                })
                .clone()
        };
        if status == 200 {
            self.ok.get_or_init(lookup).clone()
        } else {
            lookup()
        }
    }
    pub fn duration(&self, m: &Metrics) -> &XHistogram {
        self.duration
            .get_or_init(|| m.request_duration.get_or_create(&self.ml()).clone())
    }
    pub fn ttft(&self, m: &Metrics) -> &XHistogram {
        self.ttft
            .get_or_init(|| m.ttft.get_or_create(&self.ml()).clone())
    }
    pub fn non_stream_response(&self, m: &Metrics) -> &Histogram {
        self.non_stream_response
            .get_or_init(|| m.non_stream_response.get_or_create(&self.ml()).clone())
    }
    fn wl(&self) -> WorkerLabel {
        WorkerLabel {
            worker: self.worker.clone(),
        }
    }
    /// Per-worker TTFT (only record when a worker served the request).
    pub fn worker_ttft(&self, m: &Metrics) -> &Histogram {
        self.worker_ttft
            .get_or_init(|| m.worker_ttft.get_or_create(&self.wl()).clone())
    }
    pub fn worker_duration(&self, m: &Metrics) -> &Histogram {
        self.worker_duration
            .get_or_init(|| m.worker_duration.get_or_create(&self.wl()).clone())
    }
    pub fn prompt_tokens_hist(&self, m: &Metrics) -> &Histogram {
        self.prompt_tokens_hist
            .get_or_init(|| m.prompt_tokens_hist.get_or_create(&self.ml()).clone())
    }
    pub fn completion_tokens_hist(&self, m: &Metrics) -> &Histogram {
        self.completion_tokens_hist
            .get_or_init(|| m.completion_tokens_hist.get_or_create(&self.ml()).clone())
    }
    pub fn itl(&self, m: &Metrics) -> &Histogram {
        self.itl
            .get_or_init(|| m.itl.get_or_create(&self.ml()).clone())
    }
    pub fn jitter(&self, m: &Metrics) -> &Histogram {
        self.jitter
            .get_or_init(|| m.jitter.get_or_create(&self.ml()).clone())
    }
    pub fn prompt_tokens(&self, m: &Metrics) -> &Counter {
        self.prompt_tokens
            .get_or_init(|| m.prompt_tokens.get_or_create(&self.mw()).clone())
    }
    pub fn completion_tokens(&self, m: &Metrics) -> &Counter {
        self.completion_tokens
            .get_or_init(|| m.completion_tokens.get_or_create(&self.mw()).clone())
    }
    pub fn cached_tokens(&self, m: &Metrics) -> &Counter {
        self.cached_tokens
            .get_or_init(|| m.cached_tokens.get_or_create(&self.mw()).clone())
    }
    pub fn slo_checked(&self, m: &Metrics) -> &Counter {
        self.slo_checked
            .get_or_init(|| m.slo_checked.get_or_create(&self.ml()).clone())
    }
    pub fn goodput(&self, m: &Metrics) -> &Counter {
        self.goodput
            .get_or_init(|| m.goodput.get_or_create(&self.ml()).clone())
    }
    /// `kvgate_finish_reasons_total` of this model and `reason`.
    pub fn finish_reason(
        &self,
        m: &Metrics,
        reason: kvgate_protocol::finish::FinishReason,
    ) -> &Counter {
        self.finish[reason.index()].get_or_init(|| {
            m.finish_reasons
                .get_or_create(&ModelFinish {
                    model: self.model.clone(),
                    finish_reason: reason.as_str(),
                })
                .clone()
        })
    }
}

/// prometheus-client writes OpenMetrics, where a counter family is named without `_total`. The
/// classic format (what `promtool check metrics` parses) wants the family named like its samples.
fn openmetrics_to_classic(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len() + counters.len() * 12);
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let rest = line
            .strip_prefix("# HELP ")
            .map(|r| ("# HELP ", r))
            .or(line.strip_prefix("# TYPE ").map(|r| ("# TYPE ", r)));
        if let Some((prefix, r)) = rest {
            let name = r.split(' ').next().unwrap_or("");
            if counters.contains(name) {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total");
                out.push_str(&r[name.len()..]);
                out.push('\n');
                continue;
            }
        }
        // `_created` samples and exemplars are OpenMetrics-only.
        if !line.starts_with('#') {
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            if line[..name_end].ends_with("_created") {
                continue;
            }
            out.push_str(without_exemplar(line));
            out.push('\n');
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// A sample line without its OpenMetrics exemplar (` # {labels} value [timestamp]` after the
/// sample's value); label values are skipped as quoted strings, so a `#` inside one is kept.
fn without_exemplar(line: &str) -> &str {
    let b = line.as_bytes();
    let mut i = line.find(['{', ' ']).unwrap_or(b.len());
    if b.get(i) == Some(&b'{') {
        let mut quoted = false;
        while i < b.len() {
            match b[i] {
                b'\\' if quoted => i += 1,
                b'"' => quoted = !quoted,
                b'}' if !quoted => break,
                _ => {}
            }
            i += 1;
        }
    }
    match line.get(i..).and_then(|rest| rest.find(" # ")) {
        Some(at) => &line[..i + at],
        None => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exemplars_are_openmetrics_only() {
        let m = Metrics::new();
        let h = m.handles(&Lbl::from("m # {x}"), &Lbl::from("w"));
        h.ttft(&m).observe(
            0.003,
            Some(TraceLabel {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            }),
            None,
        );
        h.duration(&m).observe(0.2, None, None);
        let om = m.render_openmetrics();
        assert!(
            om.contains(
                "kvgate_time_to_first_token_seconds_bucket{le=\"0.005\",model=\"m # {x}\"} 1 # {trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\"} 0.003"
            ),
            "{om}"
        );
        assert!(om.ends_with("# EOF\n"), "{om}");
        assert_eq!(om.matches("# EOF").count(), 1);
        let classic = m.render();
        assert!(!classic.contains("trace_id"), "{classic}");
        assert!(
            classic.contains(
                "kvgate_time_to_first_token_seconds_bucket{le=\"0.005\",model=\"m # {x}\"} 1\n"
            ),
            "{classic}"
        );
        assert_eq!(
            without_exemplar("a_bucket{le=\"1\"} 3 # {trace_id=\"ab\"} 0.5 123"),
            "a_bucket{le=\"1\"} 3"
        );
        assert_eq!(without_exemplar("b 1"), "b 1");
    }

    #[test]
    fn counters_are_renamed_for_the_classic_format() {
        let m = Metrics::new();
        m.error(ErrorLabel::BadRequest);
        m.requests
            .get_or_create(&RequestLabels {
                model: "m".into(),
                worker: "w".into(),
                status: 200,
            })
            .inc();
        let text = m.render();
        assert!(
            text.contains("# TYPE kvgate_errors_total counter"),
            "{text}"
        );
        assert!(
            text.contains("kvgate_errors_total{kind=\"bad_request\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvgate_requests_total{model=\"m\",worker=\"w\",status=\"200\"} 1"),
            "{text}"
        );
        assert!(!text.contains("# EOF"));
        assert!(text.contains("# TYPE kvgate_router_decision_seconds histogram"));
    }

    #[test]
    fn counters_exist_at_zero_before_first_use() {
        let text = Metrics::new().render();
        for want in [
            "kvgate_retries_total{reason=\"status_503\"} 0",
            "kvgate_retries_total{reason=\"upstream_timeout\"} 0",
            "kvgate_config_reloads_total{reason=\"ok\"} 0",
            "kvgate_config_reloads_total{reason=\"error\"} 0",
            "kvgate_errors_total{kind=\"upstream_status\"} 0",
            "kvgate_errors_total{kind=\"too_many_connections\"} 0",
            "kvgate_requests_by_endpoint_total{endpoint=\"chat\",stream=\"true\"} 0",
            "kvgate_requests_by_endpoint_total{endpoint=\"embeddings\",stream=\"false\"} 0",
            "kvgate_worker_time_to_routable_seconds_count 0",
        ] {
            assert!(text.contains(want), "{want} missing in {text}");
        }
        if cfg!(target_os = "linux") {
            assert!(text.contains("\nprocess_resident_memory_bytes "), "{text}");
        }
    }

    #[test]
    fn error_kinds_cover_every_gateway_error_label() {
        use crate::error::{ErrorKind::*, GatewayError};
        use std::time::Duration;
        for k in [
            Unauthorized,
            RateLimited {
                retry_after: Duration::ZERO,
            },
            NotFound,
            MethodNotAllowed,
            PayloadTooLarge { limit: 1 },
            HeadersTooLarge,
            RequestTimeout,
            BadRequest { param: None },
            ModelNotFound,
            NoWorker,
            QueueFull,
            QueueTimeout,
            Shed,
            ObjectiveUnreachable,
            UpstreamConnect,
            UpstreamIo,
            UpstreamTimeout,
            ShuttingDown,
            TooManyConnections,
        ] {
            let e = GatewayError::new(k, "x");
            assert!(ERROR_KINDS.contains(&e.label().as_str()), "{e}");
        }
    }

    #[test]
    fn cached_handles_record_into_the_same_series_as_lookups() {
        let (a, b) = (Metrics::new(), Metrics::new());
        let (model, worker): (Lbl, Lbl) = ("m".into(), "w".into());
        let h = a.handles(&model, &worker);
        // Resolving handles creates no series: only what is recorded appears.
        assert!(!a.render().contains("model=\"m\""), "{}", a.render());
        h.request(&a, 200).inc();
        a.handles(&model, &worker).request(&a, 200).inc();
        h.request(&a, 503).inc();
        h.prompt_tokens(&a).inc_by(7);
        h.ttft(&a).observe(0.002, None, None);
        h.finish_reason(&a, kvgate_protocol::finish::FinishReason::Length)
            .inc();
        a.by_endpoint(1, true).inc();
        // A per-request lookup sees the cached handle's counts: one series, shared cells.
        a.requests
            .get_or_create(&RequestLabels {
                model: model.clone(),
                worker: worker.clone(),
                status: 200,
            })
            .inc();
        let text = a.render();
        for want in [
            "kvgate_requests_total{model=\"m\",worker=\"w\",status=\"200\"} 3",
            "kvgate_requests_total{model=\"m\",worker=\"w\",status=\"503\"} 1",
            "kvgate_prompt_tokens_total{model=\"m\",worker=\"w\"} 7",
            "kvgate_time_to_first_token_seconds_count{model=\"m\"} 1",
            "kvgate_finish_reasons_total{model=\"m\",finish_reason=\"length\"} 1",
            "kvgate_requests_by_endpoint_total{endpoint=\"completions\",stream=\"true\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing in {text}");
        }
        assert!(!text.contains("kvgate_completion_tokens_total{"), "{text}");
        // Another registry with the same label Arcs gets its own handles.
        let hb = b.handles(&model, &worker);
        assert!(!Arc::ptr_eq(&h, &hb));
        hb.request(&b, 200).inc();
        assert!(b
            .render()
            .contains("kvgate_requests_total{model=\"m\",worker=\"w\",status=\"200\"} 1"));
        // Same text in a different Arc is a different cache entry, same series.
        let other: Lbl = "w".into();
        let h2 = a.handles(&model, &other);
        assert!(!Arc::ptr_eq(&h, &h2) && h2.is_for(&model, &other) && !h.is_for(&model, &other));
        h2.request(&a, 200).inc();
        assert!(a
            .render()
            .contains("kvgate_requests_total{model=\"m\",worker=\"w\",status=\"200\"} 4"));
    }
}
