//! SGLang's bootstrap handoff (docs/routing.md §9, "Handoff (SGLang)"): the same body, with
//! `bootstrap_host/port/room`, goes to the prefill and the decode worker at once; both response
//! heads are awaited together (a transport error, timeout or non-2xx on either leg drops the other,
//! which closes its connection, and the client gets a 502 — a plain join would leave the survivor
//! waiting for a partner that never comes, smg #831); then the client gets the decode worker's
//! answer while the prefill worker's is drained beside it (`crate::pd::Partner`).

use std::sync::Arc;

use http_body_util::BodyExt;
use tokio_util::sync::CancellationToken;

use super::{attempt, outgoing, Forwarded, Prepared, Proxy};
use crate::ctx::RequestCtx;
use crate::error::{ErrorKind, GatewayError};
use crate::pd::{bootstrap_addr, bootstrap_room, sglang_body, Partner};
use crate::registry::{Pool, Worker};
use crate::route::router::{Leg, NoPick};
use crate::route::Reservation;
use kvgate_http::client;

use super::handoff::{decision, failure};

/// One leg's response head, or why the leg failed (as the client's 502).
async fn leg(
    app: &Proxy,
    conns: &client::Pool,
    stream: bool,
    which: &str,
    worker: &Worker,
    out: &client::Outgoing<'_>,
) -> Result<Forwarded, GatewayError> {
    let fwd = match attempt(app, conns, stream, &worker.name, out).await {
        Ok(f) => f,
        Err(e) => {
            worker.state.record_outcome(false, crate::clock::now());
            return Err(GatewayError::new(
                ErrorKind::UpstreamIo,
                format!("{which} leg failed: {}", e.message),
            ));
        }
    };
    let s = fwd.resp.status;
    worker
        .state
        .record_outcome(!s.is_server_error(), crate::clock::now());
    if s.is_success() {
        return Ok(fwd);
    }
    // The worker's own error message, when it sent one promptly.
    let detail = tokio::time::timeout(
        std::time::Duration::from_secs(1),
        http_body_util::Limited::new(fwd.resp.body, 64 << 10).collect(),
    )
    .await
    .ok()
    .and_then(|r| r.ok())
    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b.to_bytes()).ok())
    .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
    .unwrap_or_default();
    Err(GatewayError::new(
        ErrorKind::UpstreamIo,
        format!(
            "{which} leg: worker {} answered {}{}{detail}",
            worker.name,
            s.as_u16(),
            if detail.is_empty() { "" } else { ": " }
        ),
    ))
}

/// Runs both legs on `prefill` and the decode pool in `p.pool`. `Ok(None)`: not split after all
/// (no prefill worker free: the decode worker runs it all through the proxy's loop).
pub(crate) async fn dual_dispatch(
    app: &Arc<Proxy>,
    conns: &client::Pool,
    ctx: &mut RequestCtx,
    p: &Prepared<'_>,
    prefill: &Pool,
    body: &bytes::Bytes,
    auth_enabled: bool,
) -> Result<Option<Forwarded>, GatewayError> {
    let now = crate::clock::now();
    let ppick = match app.decider.select(prefill, &p.ri, &[], now) {
        Ok(pick) => pick,
        Err(NoPick::AllBusy) => {
            decision(app, ctx, "local", "prefill_busy");
            return Ok(None);
        }
        Err(NoPick::NoWorker) => {
            decision(app, ctx, "local", "no_prefill_worker");
            return Ok(None);
        }
    };
    let Some((host, port)) = bootstrap_addr(&ppick.worker.cfg.url, ppick.worker.bootstrap_port())
    else {
        decision(app, ctx, "local", "no_bootstrap_host");
        return Ok(None);
    };
    let Some(both) = sglang_body(body, &host, port, bootstrap_room()) else {
        decision(app, ctx, "local", "single_sequence_only");
        return Ok(None);
    };
    // The decode worker: queued like any request when every one is busy.
    let Reservation {
        pick: dpick,
        guard: dguard,
        at: now,
        queued: queue_place,
    } = app
        .decider
        .reserve(
            &p.pool,
            &p.ri,
            &[],
            p.t_decide,
            Leg::Decode,
            &mut ctx.queue_wait,
        )
        .await?;
    ctx.decision_time = now
        .saturating_duration_since(p.t_decide)
        .saturating_sub(ctx.queue_wait);
    if ctx.trace.records_steps() {
        let (start, queued) = (p.t_decide, ctx.queue_wait);
        let prefill_span =
            super::trace_decision(app, &ppick, "prefill", start, now, queued, None, false);
        ctx.trace.decided(prefill_span);
        let decode_span = super::trace_decision(
            app,
            &dpick,
            "decode",
            start,
            now,
            queued,
            queue_place.as_ref(),
            false,
        );
        ctx.trace.decided(decode_span);
    }
    app.metrics
        .decision
        .observe(ctx.decision_time.as_secs_f64());
    // The prompt's cache is where its prefill runs.
    app.metrics
        .predicted_overlap
        .observe(ppick.decision.predicted_hit_ratio);
    ctx.overlap_blocks = ppick.decision.overlap_blocks;
    ctx.attempts += 1;
    // The prefill worker's load lasts until its answer is drained; the decode worker's until the
    // end of the client's stream.
    let pguard = app.decider.place(ppick, prefill, &p.ri, now).guard;
    let (pw, dw) = (pguard.worker.clone(), dpick.worker);
    // Each leg's `traceparent` names its own attempt span: each gets its own copy of the headers.
    let ptraced = ctx.trace.attempt_start(&pw.name, "prefill");
    let dtraced = ctx.trace.attempt_start(&dw.name, "decode");
    let mut pout = outgoing(p.parts, &pw, &both, auth_enabled);
    let mut dout = outgoing(p.parts, &dw, &both, auth_enabled);
    pout.traceparent = ptraced.as_ref().map(crate::trace::Attempt::traceparent);
    dout.traceparent = dtraced.as_ref().map(crate::trace::Attempt::traceparent);
    let started = crate::clock::now();
    let heads = tokio::try_join!(
        leg(app, conns, ctx.stream, "prefill", &pw, &pout),
        leg(app, conns, ctx.stream, "decode", &dw, &dout),
    );
    match &heads {
        Ok((pf, df)) => {
            ctx.trace.attempt_end(
                ptraced,
                crate::trace::Ended::Status(pf.resp.status.as_u16()),
            );
            ctx.trace.attempt_end(
                dtraced,
                crate::trace::Ended::Status(df.resp.status.as_u16()),
            );
        }
        Err(e) => {
            // The leg that failed is named in the message; the other one was dropped with it.
            let (failed, other) = if e.message.starts_with("prefill") {
                (ptraced, dtraced)
            } else {
                (dtraced, ptraced)
            };
            ctx.trace.attempt_end(
                failed,
                crate::trace::Ended::Error(e.label().as_str(), &e.message),
            );
            ctx.trace.attempt_end(
                other,
                crate::trace::Ended::Error("cancelled", "dropped with the other leg"),
            );
        }
    }
    let (pfwd, dfwd) = match heads {
        Ok(h) => h,
        Err(e) => {
            drop(pguard);
            let kind = if e.message.starts_with("prefill") {
                "prefill_error"
            } else {
                "decode_error"
            };
            failure(app, kind);
            decision(app, ctx, "disaggregated", "bootstrap_failed");
            ctx.worker = Some(dw);
            return Err(e);
        }
    };
    decision(app, ctx, "disaggregated", "bootstrap");
    let (tx, rx) = tokio::sync::oneshot::channel();
    let leave = CancellationToken::new();
    ctx.pd_partner = Some(Partner {
        failed: rx,
        leave: leave.clone(),
    });
    ctx.worker = Some(dw);
    ctx.guard = Some(dguard);
    let app2 = app.clone();
    let shutdown = app.shutdown.clone();
    let limit = app.upstream.request_timeout;
    tokio::spawn(async move {
        let Forwarded { resp, first, .. } = pfwd;
        let drain = async {
            drop(first);
            let mut body = resp.body;
            loop {
                match body.frame().await {
                    None => return Ok(()),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(format!("the prefill leg failed: {e}")),
                }
            }
        };
        let result = tokio::select! {
            r = tokio::time::timeout(limit, drain) => Some(r.unwrap_or_else(|_| {
                Err(format!("the prefill leg did not end within {limit:?}"))
            })),
            // The client left (its decode body was dropped) or the gateway stops: dropping the
            // prefill answer closes its connection, which cancels it on the worker.
            _ = leave.cancelled() => None,
            _ = shutdown.cancelled() => None,
        };
        // Releasing the prefill worker's load wakes the queue.
        drop(pguard);
        match result {
            Some(Ok(())) => app2
                .metrics
                .pd
                .prefill_duration
                .observe(crate::clock::since(started).as_secs_f64()),
            Some(Err(why)) => {
                pw.state.record_outcome(false, crate::clock::now());
                failure(&app2, "prefill_error");
                let _ = tx.send(why);
            }
            None => {}
        }
    });
    Ok(Some(dfwd))
}
