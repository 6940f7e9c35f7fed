//! Prefill/decode disaggregation, vLLM NixlConnector handoff (docs/routing.md, "Prefill/decode
//! disaggregation"). The proxy calls [`prepare_handoff`] once per request to a pool that has
//! `role = "prefill"` workers; it runs the prefill leg here and hands the proxy's ordinary
//! pick → dispatch → forward → retry loop a decode-only pool and the decode leg's body. So the
//! decode leg is chosen, retried on another decode worker before its first byte, streamed and
//! observed exactly like any request.
//!
//! 1. Choose the decode worker's likely pick (the pool's policy: decode load and overlap, since
//!    vLLM decode workers cache too) and its uncached prompt. Below `pd.min_uncached_tokens` the
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
//! hit), so the request's recorded prompt and cached tokens come from the prefill leg
//! ([`Prefilled::on_finish`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use kvgate_core::WorkerId;
use kvgate_http::client;
use kvgate_protocol::usage::Usage;
use serde_json::{Map, Value};

use crate::config::WorkerRole;
use crate::ctx::{Endpoint, RequestCtx};
use crate::error::GatewayError;
use crate::metrics::{KindLabel, Metrics, PdDecisionLabels};
use crate::proxy::{attempt, Prepared};
use crate::registry::Pool;
use crate::router::NoPick;
use crate::state::AppState;

/// Largest prefill-leg answer read (it is one token and the params).
const MAX_PREFILL_ANSWER: usize = 4 << 20;
/// Prefill workers tried per request before falling back to the decode worker.
const MAX_PREFILL_ATTEMPTS: usize = 2;

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

/// Whether requests to `pool` go through [`prepare_handoff`]: it has a dedicated prefill worker.
pub fn applies(pool: &Pool, endpoint: Endpoint) -> bool {
    endpoint != Endpoint::Embeddings
        && pool
            .workers
            .iter()
            .any(|w| w.cfg.role == WorkerRole::Prefill)
}

/// The workers of `pool` that `keep` accepts, as a pool of their own.
fn sub_pool(pool: &Pool, keep: impl Fn(WorkerRole) -> bool) -> Pool {
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

fn decision(app: &AppState, ctx: &RequestCtx, path: &'static str, reason: &'static str) {
    app.metrics
        .pd
        .decisions
        .get_or_create(&PdDecisionLabels {
            model: ctx.model.clone(),
            path,
            reason,
        })
        .inc();
}

fn failure(app: &AppState, kind: &'static str) {
    app.metrics
        .pd
        .handoff_failures
        .get_or_create(&KindLabel { kind })
        .inc();
}

/// A decode leg failed before its first byte (the proxy then tries another decode worker or
/// answers with the error).
pub fn decode_failed(app: &AppState, ctx: &RequestCtx) {
    if ctx.pd.is_some() {
        failure(app, "decode_error");
    }
}

/// The prefill leg's body (vLLM toy proxy / NIXL semantics); `None` when the client's body is not
/// a JSON object or asks for several choices (one handoff serves one sequence: decode-only).
fn prefill_body(body: &[u8]) -> Option<Map<String, Value>> {
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
fn decode_body(body: &[u8], params: &Value) -> Option<Bytes> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    o.insert("kv_transfer_params".into(), params.clone());
    serde_json::to_vec(&o).ok().map(Bytes::from)
}

/// What one prefill leg came back with.
enum LegResult {
    Params(Value, Option<Usage>),
    NoParams,
    Failed,
}

/// Runs the prefill leg when it pays off and points `p` at the decode leg (see the module
/// documentation). Errors only when the pool has no decode-capable worker.
pub(crate) async fn prepare_handoff(
    app: &Arc<AppState>,
    conns: &client::Pool,
    ctx: &mut RequestCtx,
    p: &mut Prepared,
    auth_enabled: bool,
) -> Result<(), GatewayError> {
    let settings = app.pd.load_full();
    let decode = sub_pool(&p.pool, WorkerRole::can_decode);
    if decode.workers.is_empty() {
        return Err(GatewayError::new(
            crate::error::ErrorKind::NoWorker,
            format!("no decode worker for model `{}`", p.pool.model),
        ));
    }
    let prefill = sub_pool(&p.pool, WorkerRole::can_prefill);
    let router = &app.fleet.router;
    let now = Instant::now();
    let bs = u64::from(p.pool.block_size);
    let uncached = match router.select(&decode, &p.ri.hashes, p.ri.isl, p.ri.affinity, &[], now) {
        Ok(pick) => {
            p.ri.isl
                .saturating_sub(u64::from(pick.decision.overlap_blocks) * bs)
        }
        Err(_) => p.ri.isl,
    };
    let local_body = p.spliced.as_ref().unwrap_or(&p.bytes).clone();
    p.pool = Arc::new(decode);
    if settings.min_uncached_tokens > 0 && uncached < settings.min_uncached_tokens {
        decision(app, ctx, "local", "short_prompt");
        return Ok(());
    }
    let Some(body) = prefill_body(&local_body) else {
        decision(app, ctx, "local", "single_sequence_only");
        return Ok(());
    };
    let Ok(body) = serde_json::to_vec(&body).map(Bytes::from) else {
        decision(app, ctx, "local", "single_sequence_only");
        return Ok(());
    };
    let timeout = Duration::from_secs(settings.prefill_timeout_s);
    let mut tried: Vec<WorkerId> = Vec::with_capacity(MAX_PREFILL_ATTEMPTS);
    let mut failed = false;
    while tried.len() < MAX_PREFILL_ATTEMPTS {
        let now = Instant::now();
        let pick = match router.select(&prefill, &p.ri.hashes, p.ri.isl, p.ri.affinity, &tried, now)
        {
            Ok(pick) => pick,
            Err(NoPick::AllBusy) => {
                decision(app, ctx, "local", "prefill_busy");
                return Ok(());
            }
            Err(NoPick::NoWorker) => break,
        };
        tried.push(pick.worker.id);
        let started = Instant::now();
        // The prefill worker's load lasts until it answers (the handoff).
        let guard = router.dispatch(&pick, &p.ri.hashes, p.ri.isl, p.pool.block_size, now);
        let result = prefill_leg(app, conns, p, &pick.worker, &body, auth_enabled, timeout).await;
        drop(guard);
        app.admission.wake_one();
        match result {
            LegResult::Params(params, usage) => {
                let Some(d) = decode_body(&local_body, &params) else {
                    decision(app, ctx, "local", "single_sequence_only");
                    return Ok(());
                };
                let answered = Instant::now();
                app.metrics
                    .pd
                    .prefill_duration
                    .observe(answered.duration_since(started).as_secs_f64());
                p.bytes = d;
                p.spliced = None;
                ctx.pd = Some(Prefilled { answered, usage });
                decision(app, ctx, "disaggregated", "prefilled");
                return Ok(());
            }
            LegResult::NoParams => {
                failure(app, "no_params");
                decision(app, ctx, "local", "no_params");
                return Ok(());
            }
            LegResult::Failed => {
                failure(app, "prefill_error");
                failed = true;
            }
        }
    }
    decision(
        app,
        ctx,
        "local",
        if failed {
            "prefill_failed"
        } else {
            "no_prefill_worker"
        },
    );
    Ok(())
}

/// One prefill leg on `worker`: send, read the whole answer, take its `kv_transfer_params`.
async fn prefill_leg(
    app: &AppState,
    conns: &client::Pool,
    p: &Prepared,
    worker: &crate::registry::Worker,
    body: &Bytes,
    auth_enabled: bool,
    timeout: Duration,
) -> LegResult {
    let out = client::Outgoing {
        https: worker.scheme == http::uri::Scheme::HTTPS,
        method: &p.parts.method,
        authority: &worker.authority,
        path_prefix: &worker.path_prefix,
        path_and_query: p.parts.uri.path_and_query().map_or("/", |q| q.as_str()),
        headers: &p.parts.headers,
        strip_client_auth: auth_enabled,
        worker_auth: worker.auth_header.as_ref(),
        body,
    };
    let read = async {
        let fwd = attempt(app, conns, false, &worker.name, &out).await.ok()?;
        let ok = fwd.resp.status.is_success();
        worker
            .state
            .record_outcome(!fwd.resp.status.is_server_error(), Instant::now());
        let bytes = Limited::new(fwd.resp.body, MAX_PREFILL_ANSWER)
            .collect()
            .await
            .ok()?
            .to_bytes();
        ok.then_some(bytes)
    };
    let bytes = match tokio::time::timeout(timeout, read).await {
        Ok(Some(b)) => b,
        Ok(None) | Err(_) => {
            worker.state.record_outcome(false, Instant::now());
            return LegResult::Failed;
        }
    };
    let Ok(v) = serde_json::from_slice::<Value>(&bytes) else {
        return LegResult::Failed;
    };
    let usage = kvgate_protocol::usage::find_usage(&bytes);
    match v.get("kv_transfer_params") {
        Some(Value::Object(m)) if !m.is_empty() => {
            LegResult::Params(Value::Object(m.clone()), usage)
        }
        _ => LegResult::NoParams,
    }
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
