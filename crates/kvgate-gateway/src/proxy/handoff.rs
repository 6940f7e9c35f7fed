//! The prefill/decode handoff (vLLM NixlConnector), run by the proxy before its decode-leg loop;
//! the steps are described in `pd.rs`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use kvgate_core::WorkerId;
use kvgate_http::client;
use kvgate_protocol::usage::Usage;
use serde_json::Value;

use super::{attempt, Prepared, Proxy};
use crate::config::Handoff;
use crate::ctx::RequestCtx;
use crate::error::GatewayError;
use crate::metrics::{KindLabel, PdDecisionLabels};
use crate::pd::{
    bootstrap_room, decode_body, prefill_body, trtllm_context_body, trtllm_context_outcome,
    trtllm_generation_body, ContextOutcome, Prefilled,
};
use crate::route::router::NoPick;
use crate::route::{PdPlan, PdRoute, Reservation};

/// Largest prefill-leg answer read (it is one token and the params).
const MAX_PREFILL_ANSWER: usize = 4 << 20;
/// Prefill workers tried per request before falling back to the decode worker.
const MAX_PREFILL_ATTEMPTS: usize = 2;

pub(super) fn decision(
    app: &Proxy,
    ctx: &mut RequestCtx,
    path: &'static str,
    reason: &'static str,
) {
    ctx.trace.pd_decision(path, reason);
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

pub(super) fn failure(app: &Proxy, kind: &'static str) {
    app.metrics
        .pd
        .handoff_failures
        .get_or_create(&KindLabel { kind })
        .inc();
}

/// A decode leg failed before its first byte (the proxy then tries another decode worker or
/// answers with the error).
pub(crate) fn decode_failed(app: &Proxy, ctx: &RequestCtx) {
    if ctx.pd.is_some() {
        failure(app, "decode_error");
    }
}

/// What one prefill leg came back with.
enum LegResult {
    Params(Value, Option<Usage>),
    NoParams,
    Failed,
    /// TensorRT-LLM: the context leg finished the request (EOS or stop on its first token).
    Finished(Bytes),
}

/// Runs the prefill leg when it pays off and points `p` at the decode leg (see the module
/// documentation); with `[pd] protocol = "sglang"` runs both legs at once and returns the decode
/// worker's answer (`Some`). Errors when the pool has no decode-capable worker, or (SGLang) when
/// a leg failed.
pub(crate) async fn prepare_handoff(
    app: &Arc<Proxy>,
    conns: &client::Pool,
    ctx: &mut RequestCtx,
    p: &mut Prepared<'_>,
    auth_enabled: bool,
) -> Result<Option<super::Routed>, GatewayError> {
    let settings = app.decider.pd();
    let PdRoute { decode, plan } = app.decider.plan_pd(&p.pool, &p.ri, crate::clock::now())?;
    let local_body = p.spliced.as_ref().unwrap_or(&p.bytes).clone();
    p.pool = decode;
    let (prefill, protocol, mut first_prefill) = match plan {
        PdPlan::Local(reason) => {
            decision(app, ctx, "local", reason);
            return Ok(None);
        }
        PdPlan::Split {
            prefill,
            protocol,
            first_prefill,
        } => (prefill, protocol, first_prefill),
    };
    if protocol == Handoff::Sglang {
        return super::bootstrap::dual_dispatch(
            app,
            conns,
            ctx,
            p,
            &prefill,
            &local_body,
            auth_enabled,
        )
        .await
        .map(|f| f.map(super::Routed::Worker));
    }
    let trtllm = protocol == Handoff::Trtllm;
    let body = if trtllm {
        trtllm_context_body(&local_body, bootstrap_room())
    } else {
        prefill_body(&local_body)
            .and_then(|o| serde_json::to_vec(&o).ok())
            .map(Bytes::from)
    };
    let Some(body) = body else {
        decision(app, ctx, "local", "single_sequence_only");
        return Ok(None);
    };
    let timeout = Duration::from_secs(settings.prefill_timeout_s);
    let mut tried: Vec<WorkerId> = Vec::with_capacity(MAX_PREFILL_ATTEMPTS);
    let mut failed = false;
    while tried.len() < MAX_PREFILL_ATTEMPTS {
        let now = crate::clock::now();
        // The prefill worker's load lasts until it answers (the handoff).
        let reserved = match first_prefill.take() {
            Some(pick) => Ok(app.decider.place(pick, &prefill, &p.ri, now)),
            None => app.decider.try_reserve(&prefill, &p.ri, &tried, now),
        };
        let Reservation { pick, guard, .. } = match reserved {
            Ok(r) => r,
            Err(NoPick::AllBusy) => {
                decision(app, ctx, "local", "prefill_busy");
                return Ok(None);
            }
            Err(NoPick::NoWorker) => break,
        };
        tried.push(pick.worker.id);
        if ctx.trace.records_steps() {
            ctx.trace.decided(super::trace_decision(
                app,
                &pick,
                "prefill",
                now,
                crate::clock::now(),
                Duration::ZERO,
                None,
                false,
            ));
        }
        let traced = ctx.trace.attempt_start(&pick.worker.name, "prefill");
        let started = crate::clock::now();
        let result = prefill_leg(
            app,
            conns,
            p,
            &pick.worker,
            &body,
            auth_enabled,
            timeout,
            trtllm,
            traced.as_ref().map(crate::trace::Attempt::traceparent),
        )
        .await;
        ctx.trace.attempt_end(
            traced,
            match &result {
                LegResult::Failed => crate::trace::Ended::Error(
                    "prefill_error",
                    "the prefill leg failed or timed out",
                ),
                _ => crate::trace::Ended::Status(200),
            },
        );
        if matches!(result, LegResult::Params(..)) {
            // The prefill worker's answer (its one token) is its time to first token: it teaches
            // that worker's prefill speed, and its prediction error is the worker's.
            guard.prefill_done();
            if let Some((predicted, observed)) = guard.observe_first_token(crate::clock::now()) {
                app.metrics
                    .ttft_prediction_error
                    .observe((predicted - observed).abs() / observed.max(1e-3));
            }
        }
        // Releasing the prefill worker's load wakes the queue.
        drop(guard);
        match result {
            LegResult::Params(params, usage) => {
                let d = if trtllm {
                    trtllm_generation_body(&local_body, &params)
                } else {
                    decode_body(&local_body, &params)
                };
                let Some(d) = d else {
                    decision(app, ctx, "local", "single_sequence_only");
                    return Ok(None);
                };
                let answered = crate::clock::now();
                app.metrics
                    .pd
                    .prefill_duration
                    .observe(answered.duration_since(started).as_secs_f64());
                p.bytes = d;
                p.spliced = None;
                // The prompt's cache is where its prefill ran (the decode leg's pick does not
                // read overlap under its default policy).
                app.metrics
                    .predicted_overlap
                    .observe(pick.decision.predicted_hit_ratio);
                ctx.overlap_blocks = pick.decision.overlap_blocks;
                ctx.pd = Some(Prefilled { answered, usage });
                decision(app, ctx, "disaggregated", "prefilled");
                return Ok(None);
            }
            LegResult::NoParams => {
                failure(app, "no_params");
                decision(app, ctx, "local", "no_params");
                return Ok(None);
            }
            LegResult::Failed => {
                failure(app, "prefill_error");
                failed = true;
            }
            LegResult::Finished(answer) if !ctx.stream => {
                // TensorRT-LLM's server returns the context answer; so does the gateway.
                decision(app, ctx, "disaggregated", "context_finished");
                ctx.worker = Some(pick.worker.clone());
                return Ok(Some(super::Routed::Whole(strip_disaggregated_params(
                    answer,
                ))));
            }
            LegResult::Finished(_) => {
                // A streaming client cannot take the context's JSON answer: the generation
                // worker runs the original request whole (rare: the first token ended it).
                decision(app, ctx, "local", "context_finished");
                return Ok(None);
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
    Ok(None)
}

/// The context answer without `choices[].disaggregated_params` (opaque transceiver state the
/// client has no use for); unchanged if it is not such a document.
fn strip_disaggregated_params(answer: Bytes) -> Bytes {
    let Ok(mut v) = serde_json::from_slice::<Value>(&answer) else {
        return answer;
    };
    if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
        for c in choices {
            if let Some(o) = c.as_object_mut() {
                o.remove("disaggregated_params");
            }
        }
    }
    serde_json::to_vec(&v).map(Bytes::from).unwrap_or(answer)
}

/// One prefill leg on `worker`: send, read the whole answer, take its `kv_transfer_params`
/// (TensorRT-LLM: its `choices[0].disaggregated_params`).
#[allow(clippy::too_many_arguments)]
async fn prefill_leg(
    app: &Proxy,
    conns: &client::Pool,
    p: &Prepared<'_>,
    worker: &crate::registry::Worker,
    body: &Bytes,
    auth_enabled: bool,
    timeout: Duration,
    trtllm: bool,
    traceparent: Option<&[u8]>,
) -> LegResult {
    let mut out = super::outgoing(p.parts, worker, body, auth_enabled);
    out.traceparent = traceparent;
    let read = async {
        let fwd = attempt(app, conns, false, &worker.name, &out).await.ok()?;
        let ok = fwd.resp.status.is_success();
        worker
            .state
            .record_outcome(!fwd.resp.status.is_server_error(), crate::clock::now());
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
            worker.state.record_outcome(false, crate::clock::now());
            return LegResult::Failed;
        }
    };
    let Ok(v) = serde_json::from_slice::<Value>(&bytes) else {
        return LegResult::Failed;
    };
    let usage = kvgate_protocol::usage::find_usage(&bytes);
    if trtllm {
        return match trtllm_context_outcome(&v) {
            ContextOutcome::Generate(params) => LegResult::Params(params, usage),
            ContextOutcome::Finished => LegResult::Finished(bytes),
            ContextOutcome::Invalid => LegResult::NoParams,
        };
    }
    match v.get("kv_transfer_params") {
        Some(Value::Object(m)) if !m.is_empty() => {
            LegResult::Params(Value::Object(m.clone()), usage)
        }
        _ => LegResult::NoParams,
    }
}
