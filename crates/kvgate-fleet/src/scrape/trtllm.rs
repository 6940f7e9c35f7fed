//! TensorRT-LLM: `/prometheus/metrics` (`trtllm_*`, with `return_perf_metrics`) or the JSON iteration
//! stats of `/metrics`.
//!
//! The JSON array is drained by each read, so its per-iteration figures (tokens run, speculative
//! drafts) come back from [`parse_json`] as this read's **increments**; the scraper adds them up
//! into the monotonic counters the sink sees ([`Totals`]).

use kvgate_protocol::prom_text::Exposition;
use kvgate_protocol::trtllm::parse_iteration_stats;

use super::ParseError;
use crate::sink::{ScrapedLoad, SumCount};

pub fn parse_prom(e: &Exposition<'_>) -> Result<ScrapedLoad, ParseError> {
    let any = |_: &_| true;
    let running = e
        .sum("trtllm_num_requests_running", any)
        .ok_or(ParseError::Missing("trtllm_num_requests_running"))?;
    let waiting = e.sum("trtllm_num_requests_waiting", any).unwrap_or(0.0);
    Ok(ScrapedLoad {
        running: Some(super::count(running)),
        waiting: Some(super::count(waiting)),
        kv_usage: e.value("trtllm_kv_cache_utilization"),
        queue_time: SumCount::read(e, "trtllm_request_queue_time_seconds"),
        process_start_time: e.value("process_start_time_seconds"),
        ..ScrapedLoad::default()
    })
}

/// The JSON stats queue is drained by every read: an empty array means no iteration ran since the
/// last scrape, i.e. nothing is running or queued.
pub fn parse_json(body: &[u8]) -> Result<ScrapedLoad, ParseError> {
    let load = parse_iteration_stats(body).map_err(|e| ParseError::Json(e.to_string()))?;
    let Some(l) = load else {
        return Ok(ScrapedLoad {
            running: Some(0),
            waiting: Some(0),
            ..ScrapedLoad::default()
        });
    };
    Ok(ScrapedLoad {
        running: Some(super::count(l.num_active_requests as f64)),
        waiting: Some(super::count(l.num_queued_requests as f64)),
        kv_usage: l.kv_usage(),
        block_size: l.tokens_per_block,
        num_gpu_blocks: l.max_num_blocks,
        paused: l.num_paused_requests.map(|p| super::count(p as f64)),
        max_num_batched_tokens: l.max_num_tokens,
        max_num_seqs: l.max_batch_size,
        iteration_tokens: Some(SumCount {
            sum: l.batch_tokens as f64,
            count: l.iterations as f64,
        }),
        spec_drafts: Some(l.spec_drafts as f64),
        spec_draft_tokens: Some(l.spec_draft_tokens as f64),
        spec_accepted_tokens: Some(l.spec_accepted_tokens as f64),
        ..ScrapedLoad::default()
    })
}

/// Running totals of the JSON stats' per-read increments (see the module documentation).
#[derive(Debug, Clone, Default)]
pub struct Totals {
    tokens: SumCount,
    drafts: f64,
    draft_tokens: f64,
    accepted: f64,
    /// Speculative figures appear once an iteration carried `specDecodingStats`.
    spec_seen: bool,
}

impl Totals {
    /// Adds this read's increments and puts the totals in their place.
    pub fn accumulate(&mut self, l: &mut ScrapedLoad) {
        if let Some(t) = l.iteration_tokens {
            self.tokens.sum += t.sum;
            self.tokens.count += t.count;
        }
        l.iteration_tokens = Some(self.tokens);
        let d = l.spec_draft_tokens.unwrap_or(0.0);
        self.spec_seen |= d > 0.0;
        self.drafts += l.spec_drafts.unwrap_or(0.0);
        self.draft_tokens += d;
        self.accepted += l.spec_accepted_tokens.unwrap_or(0.0);
        let seen = self.spec_seen;
        l.spec_drafts = seen.then_some(self.drafts);
        l.spec_draft_tokens = seen.then_some(self.draft_tokens);
        l.spec_accepted_tokens = seen.then_some(self.accepted);
    }
}
