//! llama.cpp `llama-server`: `/metrics` (`--metrics`) and `/slots` (on by default).

use kvgate_protocol::prom_text::Exposition;
use serde::Deserialize;

use super::ParseError;
use crate::sink::{ScrapedLoad, SumCount};

pub fn parse_metrics(e: &Exposition<'_>) -> Result<ScrapedLoad, ParseError> {
    let running = e
        .value("llamacpp:requests_processing")
        .ok_or(ParseError::Missing("llamacpp:requests_processing"))?;
    let waiting = e.value("llamacpp:requests_deferred").unwrap_or(0.0);
    // `prompt_tokens_total` excludes cached tokens (observed on a real server): the prompt tokens
    // queried are the processed plus the cached ones. Builds without the cached counter report none.
    let cached = e.value("llamacpp:prompt_tokens_cached_total");
    let processed = e.value("llamacpp:prompt_tokens_total");
    // Tokens per batch: the tokens it ran (prompt tokens processed + tokens predicted) over its
    // `llama_decode` calls. `n_tokens_max` is a high-water mark, not the batch limit: not used.
    let iteration_tokens = match (e.value("llamacpp:n_decode_total"), processed) {
        (Some(n), Some(p)) => Some(SumCount {
            sum: p + e.value("llamacpp:tokens_predicted_total").unwrap_or(0.0),
            count: n,
        }),
        _ => None,
    };
    Ok(ScrapedLoad {
        running: Some(super::count(running)),
        waiting: Some(super::count(waiting)),
        prefix_cache_queries: cached.and_then(|c| Some(c + processed?)),
        prefix_cache_hits: cached,
        iteration_tokens,
        // Recent builds count speculative decoding under vLLM's names.
        spec_drafts: e.value("llamacpp:spec_decode_num_drafts_total"),
        spec_draft_tokens: e.value("llamacpp:spec_decode_num_draft_tokens_total"),
        spec_accepted_tokens: e.value("llamacpp:spec_decode_num_accepted_tokens_total"),
        ..ScrapedLoad::default()
    })
}

#[derive(Deserialize)]
struct Slot {
    #[serde(default)]
    is_processing: bool,
    /// The slot's context (tokens): `--ctx-size` ÷ `--parallel`.
    #[serde(default)]
    n_ctx: u64,
}

/// What `/slots` says about capacity and use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slots {
    pub total: u32,
    pub busy: u32,
    /// Σ `n_ctx`: the most tokens the server's KV cache can hold. llama.cpp keeps one prompt per
    /// slot (the last one it served), so this bounds what a router may believe it has cached.
    pub ctx_tokens: u64,
}

pub fn parse_slots(body: &[u8]) -> Result<Slots, ParseError> {
    let slots: Vec<Slot> =
        serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    Ok(Slots {
        total: slots.len() as u32,
        busy: slots.iter().filter(|s| s.is_processing).count() as u32,
        ctx_tokens: slots.iter().map(|s| s.n_ctx).sum(),
    })
}
