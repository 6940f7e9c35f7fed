//! Prefill/decode disaggregation (docs/routing.md, "Prefill/decode disaggregation"): which pools
//! split, the vLLM NixlConnector legs' bodies, and what the prefill leg leaves for the rest of the
//! request ([`Prefilled`]: the transfer-wait metric and the usage merge). The handoff itself runs
//! in `proxy/handoff.rs`, called by the proxy once per request to a pool with `role = "prefill"`
//! workers; it runs the prefill leg and hands the proxy's ordinary pick → dispatch → forward →
//! retry loop a decode-only pool and the decode leg's body, so the decode leg is chosen, retried
//! on another decode worker before its first byte, streamed and observed like any request.
//!
//! 1. Estimate the decode worker's pick (the pool's policy: decode load and overlap, since vLLM
//!    decode workers cache too) and its uncached prompt. Below `pd.min_uncached_tokens` the
//!    decode worker runs it all (`local`, `short_prompt`).
//! 2. Choose a prefill worker by the same policy (KV overlap + prefill queue + active load) without
//!    queueing: every prefill worker busy → `local` (`prefill_busy`).
//! 3. Prefill leg: the client's body with `max_tokens: 1` (and `max_completion_tokens: 1` if
//!    present), `stream: false`, `stream_options`/`min_tokens`/`min_completion_tokens` removed and
//!    `kv_transfer_params: {do_remote_decode: true, ...}`. Its load on the prefill worker ends when
//!    it answers (the handoff), not at the end of the client's stream.
//! 4. It failed → the next prefill worker, then `local` (`prefill_failed`, counted); it answered
//!    without params → `local` (`no_params`, counted: the decode worker computes it all).
//! 5. Decode leg: the original body plus the returned `kv_transfer_params`.
//!
//! Usage: the decode worker reports pulled tokens as cached (a cold request looks like a 100%
//! hit), so the client's usage and the recorded tokens take prompt and cached tokens from the
//! prefill leg and completion tokens from the decode leg ([`Prefilled::on_finish`],
//! `kvgate_protocol::usage::merge_pd_usage`).

use std::time::Instant;

use bytes::Bytes;
use kvgate_protocol::usage::Usage;
use serde_json::{Map, Value};

use crate::config::WorkerRole;
use crate::metrics::Metrics;
use crate::registry::Pool;

/// What the prefill leg left for the rest of the request.
#[derive(Debug, Clone)]
pub struct Prefilled {
    /// When the prefill worker's answer had been read.
    pub answered: Instant,
    /// The prefill worker's usage: its prompt tokens and its own prefix hits.
    pub usage: Option<Usage>,
}

impl Prefilled {
    /// At the request's end: the transfer wait (streams), and usage with prompt and cached tokens
    /// from the prefill leg, completion tokens from the decode leg (vllm-project/router's
    /// usage merge does the same).
    pub fn on_finish(
        &self,
        m: &Metrics,
        stream: bool,
        first_token: Option<Instant>,
        usage: &mut Option<Usage>,
    ) {
        if let (true, Some(t)) = (stream, first_token) {
            m.pd.transfer_wait
                .observe(t.saturating_duration_since(self.answered).as_secs_f64());
        }
        if let (Some(u), Some(p)) = (usage.as_mut(), self.usage) {
            u.prompt_tokens = p.prompt_tokens;
            u.cached_tokens = p.cached_tokens;
        }
    }
}

/// Whether requests to `pool` are split: it has a dedicated prefill worker.
pub fn applies(pool: &Pool) -> bool {
    pool.workers
        .iter()
        .any(|w| w.cfg.role == WorkerRole::Prefill)
}

/// The workers of `pool` that `keep` accepts, as a pool of their own.
pub fn sub_pool(pool: &Pool, keep: impl Fn(WorkerRole) -> bool) -> Pool {
    Pool {
        model: pool.model.clone(),
        workers: pool
            .workers
            .iter()
            .filter(|w| keep(w.cfg.role))
            .cloned()
            .collect(),
        block_size: pool.block_size,
        tokenizer: pool.tokenizer.clone(),
    }
}

/// The prefill leg's body (vLLM toy proxy / NIXL semantics); `None` when the client's body is not
/// a JSON object or asks for several choices (one handoff serves one sequence: decode-only).
pub fn prefill_body(body: &[u8]) -> Option<Map<String, Value>> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    if o.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return None;
    }
    let mut params = Map::new();
    params.insert("do_remote_decode".into(), Value::Bool(true));
    params.insert("do_remote_prefill".into(), Value::Bool(false));
    for k in [
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
    ] {
        params.insert(k.into(), Value::Null);
    }
    o.insert("kv_transfer_params".into(), Value::Object(params));
    o.insert("stream".into(), Value::Bool(false));
    o.insert("max_tokens".into(), Value::from(1));
    if o.contains_key("max_completion_tokens") {
        o.insert("max_completion_tokens".into(), Value::from(1));
    }
    for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
        o.remove(k);
    }
    Some(o)
}

/// The decode leg's body: the client's body (as forwarded) with the prefill's params.
pub fn decode_body(body: &[u8], params: &Value) -> Option<Bytes> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    o.insert("kv_transfer_params".into(), params.clone());
    serde_json::to_vec(&o).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_body_is_capped_unstreamed_and_tagged() {
        let b =
            br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},
            "max_tokens":50,"max_completion_tokens":50,"min_tokens":5,"min_completion_tokens":5}"#;
        let o = prefill_body(b).unwrap();
        assert_eq!(o["max_tokens"], 1);
        assert_eq!(o["max_completion_tokens"], 1);
        assert_eq!(o["stream"], false);
        for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
            assert!(!o.contains_key(k), "{k}");
        }
        assert_eq!(o["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(o["kv_transfer_params"]["do_remote_prefill"], false);
        assert_eq!(o["kv_transfer_params"]["remote_block_ids"], Value::Null);
        // No max_completion_tokens added when the client did not send it.
        let o = prefill_body(br#"{"model":"m","prompt":"x"}"#).unwrap();
        assert!(!o.contains_key("max_completion_tokens"));
        assert_eq!(o["max_tokens"], 1);
    }

    #[test]
    fn several_choices_or_non_objects_are_not_split() {
        assert!(prefill_body(br#"{"model":"m","prompt":"x","n":2}"#).is_none());
        assert!(prefill_body(br#"[1,2]"#).is_none());
        assert!(prefill_body(b"not json").is_none());
        assert!(prefill_body(br#"{"model":"m","prompt":"x","n":1}"#).is_some());
    }

    #[test]
    fn decode_body_keeps_the_original_and_adds_params() {
        let params = serde_json::json!({"do_remote_prefill": true, "remote_block_ids": [1, 2]});
        let b = decode_body(
            br#"{"model":"m","stream":true,"max_tokens":9,"min_tokens":2}"#,
            &params,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(v["min_tokens"], 2);
        assert_eq!(v["kv_transfer_params"], params);
    }

    #[test]
    fn usage_comes_from_prefill_for_prompt_and_cache() {
        let m = Metrics::new();
        let pre = Prefilled {
            answered: Instant::now(),
            usage: Some(Usage {
                prompt_tokens: 200,
                completion_tokens: 1,
                cached_tokens: Some(32),
            }),
        };
        let mut u = Some(Usage {
            prompt_tokens: 200,
            completion_tokens: 7,
            cached_tokens: Some(199),
        });
        pre.on_finish(&m, true, Some(Instant::now()), &mut u);
        assert_eq!(
            u,
            Some(Usage {
                prompt_tokens: 200,
                completion_tokens: 7,
                cached_tokens: Some(32),
            })
        );
        assert!(
            m.render()
                .contains("kvgate_pd_transfer_wait_seconds_count 1"),
            "{}",
            m.render()
        );
    }
}
