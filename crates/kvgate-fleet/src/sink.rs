//! What the background tasks report, and the trait the gateway implements to receive it.

use std::time::Instant;

use kvgate_core::WorkerId;
use kvgate_protocol::kv_events::KvEventBatch;

/// One successful scrape of a worker's own load figures.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ScrapedLoad {
    /// Requests in the engine's running batch (summed over DP engines). `None` when the kind has no
    /// such figure (Ollama).
    pub running: Option<u32>,
    /// Requests queued in the engine.
    pub waiting: Option<u32>,
    /// KV-cache usage fraction 0..=1 (vLLM: active blocks, evictable cache counts as free).
    pub kv_usage: Option<f64>,
    /// KV block (page) size the engine reports.
    pub block_size: Option<u32>,
    /// KV capacity in blocks (summed over DP engines).
    pub num_gpu_blocks: Option<u64>,
    /// KV capacity in tokens: blocks × block size, or llama.cpp's Σ slot `n_ctx` (one cached
    /// prompt per slot). Sizes the approximate index in the pool's own blocks.
    pub kv_capacity_tokens: Option<u64>,
    /// Prefix-cache counters in tokens (monotonic): queries and hits.
    pub prefix_cache_queries: Option<f64>,
    pub prefix_cache_hits: Option<f64>,
    /// Requests the engine preempted (monotonic; vLLM `num_preemptions_total`, SGLang
    /// `num_retracted_requests_total`).
    pub preemptions: Option<f64>,
    /// Requests paused in the engine's newest iteration (TRT-LLM `numPausedRequests`, a gauge).
    pub paused: Option<u32>,
    /// Engine-side phase timings, each a histogram's sum (seconds) and count (requests), monotonic:
    /// queue (vLLM `request_queue_time_seconds`, SGLang `queue_time_seconds`, TRT-LLM
    /// `request_queue_time_seconds`), prefill and decode (vLLM).
    pub queue_time: Option<SumCount>,
    pub prefill_time: Option<SumCount>,
    pub decode_time: Option<SumCount>,
    /// Tokens per engine step: sum = tokens, count = steps (vLLM `iteration_tokens_total`; TRT-LLM
    /// context tokens + generation requests of each iteration, accumulated by the scraper).
    pub iteration_tokens: Option<SumCount>,
    /// The engine's own limits when it reports them (TRT-LLM `maxNumTokensRuntime`,
    /// `maxBatchSizeRuntime`).
    pub max_num_batched_tokens: Option<u64>,
    pub max_num_seqs: Option<u64>,
    /// Speculative decoding (monotonic): drafts, draft tokens proposed, draft tokens accepted.
    pub spec_drafts: Option<f64>,
    pub spec_draft_tokens: Option<f64>,
    pub spec_accepted_tokens: Option<f64>,
    /// The engine process's start time (`process_start_time_seconds`, Unix seconds): a change
    /// means the worker restarted.
    pub process_start_time: Option<f64>,
    /// llama.cpp `/slots`: total slots and slots busy.
    pub slots_total: Option<u32>,
    pub slots_busy: Option<u32>,
    /// Ollama `/api/ps`: models resident in memory.
    pub loaded_models: Vec<String>,
    pub scraped_at: Option<Instant>,
}

/// A histogram's `_sum` and `_count` (both monotonic), summed over the engine's series.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SumCount {
    pub sum: f64,
    pub count: f64,
}

impl SumCount {
    /// `<name>_sum` and `<name>_count` of an exposition, summed over label sets (DP engines);
    /// `None` unless both are present.
    pub fn read(e: &kvgate_protocol::prom_text::Exposition<'_>, name: &str) -> Option<SumCount> {
        let any = |_: &_| true;
        let mut key = String::with_capacity(name.len() + 6);
        key.push_str(name);
        key.push_str("_sum");
        let sum = e.sum(&key, any)?;
        key.truncate(name.len());
        key.push_str("_count");
        let count = e.sum(&key, any)?;
        Some(SumCount { sum, count })
    }
}

impl ScrapedLoad {
    /// The routing core's view, when the worker reported running and waiting.
    pub fn core(&self) -> Option<kvgate_core::ScrapedLoad> {
        Some(kvgate_core::ScrapedLoad {
            kv_usage: self.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0) as f32,
            waiting: self.waiting?,
            running: self.running?,
        })
    }
}

/// Why a worker's KV index entries must be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetReason {
    /// The event sequence went backwards: the publisher restarted.
    SeqRegression,
    /// The engine reported `AllBlocksCleared` (or TRT-LLM `created`).
    AllBlocksCleared,
    /// The health check saw the worker come back after being down.
    Restart,
    /// Events were missed and replay could not fill the gap: state is unknown.
    GapUnrecoverable,
}

impl ResetReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ResetReason::SeqRegression => "seq_regression",
            ResetReason::AllBlocksCleared => "all_blocks_cleared",
            ResetReason::Restart => "restart",
            ResetReason::GapUnrecoverable => "gap_unrecoverable",
        }
    }
}

/// Receiver of everything the monitor learns about one worker. Called from background tasks: keep
/// each call short and never block on I/O (take a lock, update, release).
pub trait FleetSink: Send + Sync + 'static {
    /// A fresh scrape.
    fn on_load(&self, worker: WorkerId, load: &ScrapedLoad);
    /// No successful scrape within `stale_after`: ignore scraped load for this worker (fail open).
    /// Called once per stale period.
    fn on_load_stale(&self, worker: WorkerId);
    /// The engine's block size differs from the configured one: exclude the worker from KV scoring
    /// (it is still load-balanced). Called once per distinct value seen.
    fn on_block_size(&self, worker: WorkerId, engine_block_size: u32, configured: u32);
    /// After a mismatch, the engine reports the configured block size again (it was restarted with
    /// the right setting, or the pool's block size changed): include it in KV scoring again.
    fn on_block_size_agrees(&self, _worker: WorkerId) {}
    /// A decoded batch of KV events, in sequence order, gaps already replayed where possible.
    fn on_kv_events(&self, worker: WorkerId, batch: &KvEventBatch);
    /// Drop every index entry of the worker.
    fn on_kv_reset(&self, worker: WorkerId, reason: ResetReason);
    /// Health transitions (also the first result).
    fn on_health(&self, worker: WorkerId, up: bool);
    /// A worker that was up, then down, answers again `down_for` after its first failed probe
    /// (called just before `on_health(worker, true)`).
    fn on_recovered(&self, _worker: WorkerId, _down_for: std::time::Duration) {}
    /// Auto-detected kind (only for `kind = auto`).
    fn on_kind(&self, _worker: WorkerId, _kind: crate::WorkerKind) {}
    /// The worker's prefill/decode role from its `/server_info` (only with
    /// [`MonitorConfig::detect_role`](crate::MonitorConfig::detect_role)); called once per monitor.
    fn on_role(&self, _worker: WorkerId, _role: &crate::DetectedRole) {}
}
