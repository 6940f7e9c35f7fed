//! TensorRT-LLM `trtllm-serve`: `POST /kv_cache_events` JSON and the JSON iteration stats of `/metrics`.
//!
//! `/kv_cache_events` drains a queue on every call (one consumer only) and returns
//! `[{event_id, data, window_size, attention_dp_rank?}]` with `data.type` one of
//! `created | stored | removed | updated` (interfaces.md §4). `stored` runs are normalised to the
//! shared [`KvEvent`] model, tokens taken from `tokens[].token_id`.

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::kv_events::{KvEvent, Medium};

#[cfg(test)]
mod tests;

/// One normalised `/kv_cache_events` element.
#[derive(Debug, Clone, PartialEq)]
pub struct TrtllmEvent {
    pub event_id: u64,
    pub window_size: Option<u64>,
    pub dp_rank: Option<u32>,
    pub kind: TrtllmEventKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TrtllmEventKind {
    /// The KV cache manager was (re)created: the worker's previous cache contents are gone.
    Created {
        num_blocks_per_cache_level: Vec<u64>,
    },
    /// Stored/removed, in the shared model (a `stored` run may become several events, see
    /// [`parse_kv_cache_events`]).
    Kv(Vec<KvEvent>),
    /// A block moved between cache levels (`(old, new)`) or changed priority.
    Updated {
        block_hash: u64,
        cache_level: Option<(i64, i64)>,
    },
}

#[derive(Debug, thiserror::Error)]
#[error("invalid TRT-LLM JSON: {0}")]
pub struct TrtllmError(#[from] serde_json::Error);

/// A block hash as TRT-LLM writes it: an unsigned or signed JSON integer, kept as its 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hash64(u64);

impl<'de> Deserialize<'de> for Hash64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Hash64;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a 64-bit integer block hash")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Hash64, E> {
                Ok(Hash64(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Hash64, E> {
                Ok(Hash64(v as u64))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct RawEvent {
    event_id: u64,
    data: RawData,
    #[serde(default)]
    window_size: Option<u64>,
    #[serde(default)]
    attention_dp_rank: Option<u32>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum RawData {
    Created {
        #[serde(default)]
        num_blocks_per_cache_level: Vec<u64>,
    },
    Stored {
        parent_hash: Option<Hash64>,
        blocks: Vec<RawBlock>,
    },
    Removed {
        block_hashes: Vec<Hash64>,
    },
    Updated {
        block_hash: Hash64,
        #[serde(default)]
        cache_level: Option<Diff>,
    },
}

#[derive(Deserialize)]
struct RawBlock {
    block_hash: Hash64,
    tokens: Vec<RawToken>,
    #[serde(default)]
    cache_level: i64,
}

#[derive(Deserialize)]
struct RawToken {
    token_id: u32,
}

#[derive(Deserialize)]
struct Diff {
    old_value: i64,
    new_value: i64,
}

fn medium(level: i64) -> Medium {
    // Level 0 is device memory; TRT-LLM's secondary level is host memory.
    if level == 0 {
        Medium::Gpu
    } else {
        Medium::Cpu
    }
}

/// Parses a `/kv_cache_events` response body.
///
/// A `stored` run whose blocks have equal token counts and one cache level becomes one `Stored`;
/// otherwise each block becomes its own `Stored`, chained through the previous block hash, so a short
/// (partial) block carries its own `block_size` and can be rejected by the index on its own.
pub fn parse_kv_cache_events(body: &[u8]) -> Result<Vec<TrtllmEvent>, TrtllmError> {
    let raw: Vec<RawEvent> = serde_json::from_slice(body)?;
    Ok(raw.into_iter().map(convert).collect())
}

fn convert(e: RawEvent) -> TrtllmEvent {
    let kind = match e.data {
        RawData::Created {
            num_blocks_per_cache_level,
        } => TrtllmEventKind::Created {
            num_blocks_per_cache_level,
        },
        RawData::Removed { block_hashes } => TrtllmEventKind::Kv(vec![KvEvent::Removed {
            block_hashes: block_hashes.into_iter().map(|h| h.0).collect(),
            medium: Medium::Gpu,
            group_idx: 0,
        }]),
        RawData::Updated {
            block_hash,
            cache_level,
        } => TrtllmEventKind::Updated {
            block_hash: block_hash.0,
            cache_level: cache_level.map(|d| (d.old_value, d.new_value)),
        },
        RawData::Stored {
            parent_hash,
            blocks,
        } => TrtllmEventKind::Kv(stored(parent_hash.map(|h| h.0), blocks)),
    };
    TrtllmEvent {
        event_id: e.event_id,
        window_size: e.window_size,
        dp_rank: e.attention_dp_rank,
        kind,
    }
}

fn stored(parent: Option<u64>, blocks: Vec<RawBlock>) -> Vec<KvEvent> {
    let Some(first) = blocks.first() else {
        return Vec::new();
    };
    let (bs, level) = (first.tokens.len(), first.cache_level);
    let uniform = blocks
        .iter()
        .all(|b| b.tokens.len() == bs && b.cache_level == level);
    let one = |hashes: Vec<u64>, parent, token_ids, bs: usize, level| KvEvent::Stored {
        block_hashes: hashes,
        parent,
        token_ids,
        block_size: bs as u32,
        lora_id: None,
        lora_name: None,
        medium: medium(level),
        group_idx: 0,
    };
    if uniform {
        let hashes = blocks.iter().map(|b| b.block_hash.0).collect();
        let tokens = blocks
            .iter()
            .flat_map(|b| b.tokens.iter().map(|t| t.token_id))
            .collect();
        return vec![one(hashes, parent, tokens, bs, level)];
    }
    let mut parent = parent;
    blocks
        .into_iter()
        .map(|b| {
            let h = b.block_hash.0;
            let n = b.tokens.len();
            let ev = one(
                vec![h],
                parent,
                b.tokens.into_iter().map(|t| t.token_id).collect(),
                n,
                b.cache_level,
            );
            parent = Some(h);
            ev
        })
        .collect()
}

/// Load figures from the newest element of the `/metrics` iteration-stats array.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TrtllmLoad {
    pub iter: u64,
    pub num_active_requests: u64,
    pub num_queued_requests: u64,
    pub max_num_blocks: Option<u64>,
    pub free_num_blocks: Option<u64>,
    pub used_num_blocks: Option<u64>,
    pub tokens_per_block: Option<u32>,
    pub reused_blocks: Option<u64>,
    pub missed_blocks: Option<u64>,
    pub cache_hit_rate: Option<f64>,
    /// Newest iteration's `inflightBatchingStats.numPausedRequests` (requests paused for lack of
    /// KV blocks: TRT-LLM's preemption), and its batch limits (`maxNumTokensRuntime`, else
    /// `…Static`; `maxBatchSizeRuntime`, else `…Static`).
    pub num_paused_requests: Option<u64>,
    pub max_num_tokens: Option<u64>,
    pub max_batch_size: Option<u64>,
    /// Totals over **every** element of the array (each read drains the queue, so a reader that
    /// adds these up sees every iteration once): iterations, tokens run (context tokens plus one
    /// per generation request), and `specDecodingStats` drafts / draft tokens / accepted tokens.
    pub iterations: u64,
    pub batch_tokens: u64,
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
}

impl TrtllmLoad {
    /// Used fraction of the KV blocks, when the stats carry the KV section.
    pub fn kv_usage(&self) -> Option<f64> {
        let (max, used) = (self.max_num_blocks?, self.used_num_blocks?);
        (max > 0).then(|| used as f64 / max as f64)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawStats {
    #[serde(default)]
    iter: u64,
    #[serde(default)]
    num_active_requests: u64,
    #[serde(default)]
    num_queued_requests: u64,
    #[serde(default)]
    kv_cache_stats: Option<RawKv>,
    #[serde(default)]
    inflight_batching_stats: Option<RawIfb>,
    #[serde(default)]
    spec_decoding_stats: Option<RawSpec>,
    max_num_tokens_runtime: Option<u64>,
    max_num_tokens_static: Option<u64>,
    max_batch_size_runtime: Option<u64>,
    max_batch_size_static: Option<u64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawIfb {
    #[serde(default)]
    num_ctx_tokens: u64,
    #[serde(default)]
    num_gen_requests: u64,
    num_paused_requests: Option<u64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSpec {
    #[serde(default)]
    num_draft_tokens: u64,
    #[serde(default)]
    num_accepted_tokens: u64,
    #[serde(default)]
    num_requests_with_draft_tokens: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawKv {
    max_num_blocks: Option<u64>,
    free_num_blocks: Option<u64>,
    used_num_blocks: Option<u64>,
    tokens_per_block: Option<u32>,
    reused_blocks: Option<u64>,
    missed_blocks: Option<u64>,
    cache_hit_rate: Option<f64>,
}

/// Parses the iteration-stats array; `Ok(None)` when it is empty (every read drains the queue, so an
/// idle worker — or one without `enable_iter_perf_stats` — returns `[]`).
pub fn parse_iteration_stats(body: &[u8]) -> Result<Option<TrtllmLoad>, TrtllmError> {
    let stats: Vec<RawStats> = serde_json::from_slice(body)?;
    let (mut iterations, mut batch_tokens) = (0u64, 0u64);
    let (mut drafts, mut draft_tokens, mut accepted) = (0u64, 0u64, 0u64);
    for s in &stats {
        iterations += 1;
        if let Some(b) = &s.inflight_batching_stats {
            batch_tokens = batch_tokens
                .saturating_add(b.num_ctx_tokens)
                .saturating_add(b.num_gen_requests);
        }
        if let Some(sp) = &s.spec_decoding_stats {
            drafts = drafts.saturating_add(sp.num_requests_with_draft_tokens);
            draft_tokens = draft_tokens.saturating_add(sp.num_draft_tokens);
            accepted = accepted.saturating_add(sp.num_accepted_tokens);
        }
    }
    let Some(last) = stats.into_iter().max_by_key(|s| s.iter) else {
        return Ok(None);
    };
    let kv = last.kv_cache_stats;
    Ok(Some(TrtllmLoad {
        num_paused_requests: last
            .inflight_batching_stats
            .as_ref()
            .and_then(|b| b.num_paused_requests),
        max_num_tokens: last.max_num_tokens_runtime.or(last.max_num_tokens_static),
        max_batch_size: last.max_batch_size_runtime.or(last.max_batch_size_static),
        iterations,
        batch_tokens,
        spec_drafts: drafts,
        spec_draft_tokens: draft_tokens,
        spec_accepted_tokens: accepted,
        iter: last.iter,
        num_active_requests: last.num_active_requests,
        num_queued_requests: last.num_queued_requests,
        max_num_blocks: kv.as_ref().and_then(|k| k.max_num_blocks),
        free_num_blocks: kv.as_ref().and_then(|k| k.free_num_blocks),
        used_num_blocks: kv.as_ref().and_then(|k| k.used_num_blocks),
        tokens_per_block: kv.as_ref().and_then(|k| k.tokens_per_block),
        reused_blocks: kv.as_ref().and_then(|k| k.reused_blocks),
        missed_blocks: kv.as_ref().and_then(|k| k.missed_blocks),
        cache_hit_rate: kv.as_ref().and_then(|k| k.cache_hit_rate),
    }))
}
