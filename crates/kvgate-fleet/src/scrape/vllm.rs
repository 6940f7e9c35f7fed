//! vLLM `/metrics` (0.9+ names, with the pre-0.9 names as fallbacks). Figures are summed over DP
//! engines (`engine` label); KV usage is the mean over engines. Histograms (phase timings, tokens
//! per step) are read as their `_sum` and `_count`; `spec_decode_*` only exist with a speculative
//! config; `process_start_time_seconds` comes from prometheus_client's process collector.

use kvgate_protocol::prom_text::{Exposition, VllmCacheConfig};

use super::ParseError;
use crate::sink::{ScrapedLoad, SumCount};

pub fn parse(e: &Exposition<'_>) -> Result<ScrapedLoad, ParseError> {
    let any = |_: &_| true;
    let running = e
        .sum("vllm:num_requests_running", any)
        .ok_or(ParseError::Missing("vllm:num_requests_running"))?;
    let waiting = e
        .sum("vllm:num_requests_waiting", any)
        .ok_or(ParseError::Missing("vllm:num_requests_waiting"))?;
    let usage_name = if e.value("vllm:kv_cache_usage_perc").is_some() {
        "vllm:kv_cache_usage_perc"
    } else {
        "vllm:gpu_cache_usage_perc"
    };
    let usages: Vec<f64> = e
        .samples_named(usage_name)
        .map(|s| s.value)
        .filter(|v| v.is_finite())
        .collect();
    let kv_usage = (!usages.is_empty()).then(|| usages.iter().sum::<f64>() / usages.len() as f64);
    let cache = VllmCacheConfig::read(e);
    let counter = |new: &str, old: &str| e.sum(new, any).or_else(|| e.sum(old, any));
    Ok(ScrapedLoad {
        running: Some(super::count(running)),
        waiting: Some(super::count(waiting)),
        kv_usage,
        block_size: cache.block_size,
        num_gpu_blocks: cache.num_gpu_blocks,
        prefix_cache_queries: counter(
            "vllm:prefix_cache_queries_total",
            "vllm:gpu_prefix_cache_queries_total",
        ),
        prefix_cache_hits: counter(
            "vllm:prefix_cache_hits_total",
            "vllm:gpu_prefix_cache_hits_total",
        ),
        preemptions: counter("vllm:num_preemptions_total", "vllm:num_preemptions"),
        queue_time: SumCount::read(e, "vllm:request_queue_time_seconds"),
        prefill_time: SumCount::read(e, "vllm:request_prefill_time_seconds"),
        decode_time: SumCount::read(e, "vllm:request_decode_time_seconds"),
        iteration_tokens: SumCount::read(e, "vllm:iteration_tokens_total"),
        spec_drafts: e.sum("vllm:spec_decode_num_drafts_total", any),
        spec_draft_tokens: e.sum("vllm:spec_decode_num_draft_tokens_total", any),
        spec_accepted_tokens: e.sum("vllm:spec_decode_num_accepted_tokens_total", any),
        process_start_time: e.value("process_start_time_seconds"),
        ..ScrapedLoad::default()
    })
}
