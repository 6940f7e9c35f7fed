//! TensorRT-LLM: `/prometheus/metrics` (`trtllm_*`, with `return_perf_metrics`) or the JSON iteration
//! stats of `/metrics`.

use kvgate_protocol::prom_text::Exposition;
use kvgate_protocol::trtllm::parse_iteration_stats;

use super::ParseError;
use crate::sink::ScrapedLoad;

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
        ..ScrapedLoad::default()
    })
}
