//! The request path of the proxy front end, top to bottom in one place:
//!
//! auth → body (bounded, 413) → the client API's parse (400) → model pool (404) → tokens + block
//! hashes → (prefill/decode pools: the decision's PD plan, and the prefill leg in
//! `handoff.rs` / both legs in `bootstrap.rs`) → reserve a worker (`route::Decider`: pick, queue /
//! 429 / 503, load guard) → forward the original body bytes → retry another worker on connect
//! error / 429 / 5xx / timeout before the first byte → stream the response back through the
//! observer body.
//!
//! Every failure is a `GatewayError`, turned into a response in `GatewayError::into_response`.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{header, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use kvgate_core::WorkerId;
use kvgate_protocol::openai::splice_include_usage;

use crate::body::{GwBody, ReqBody};
use crate::client_api::{session_key, Front, ResponseShape};
use crate::ctx::{Outcome, RequestCtx};
use crate::error::{ErrorKind, GatewayError};
use crate::observer::ObservedBody;
use crate::prompt::{route_input_offloaded, RouteInput};
use crate::route::router::Leg;
use crate::route::Reservation;
use kvgate_http::client;

mod bootstrap;
mod handoff;

/// What the proxy hop and the PD legs see of the gateway: the decision component, the hop's
/// settings, the fleet's pools, the keys, the metrics. Built once with `AppState`, which holds
/// it; the proxy never sees the rest.
pub struct Proxy {
    pub decider: Arc<crate::route::Decider>,
    pub fleet: Arc<crate::fleet::WorkerFleet>,
    pub upstream: Arc<crate::forward::Upstream>,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub auth: Arc<arc_swap::ArcSwap<crate::auth::Auth>>,
    /// Responses ids → the worker that stored them (`pins.rs`).
    pub pins: Arc<crate::pins::ResponsePins>,
    /// `server.max_body_bytes`.
    pub max_body: usize,
    pub shutdown: tokio_util::sync::CancellationToken,
}

/// Most attempts per request whatever the config says (bounds the tried-workers list).
const MAX_ATTEMPTS: usize = 8;

/// Client credentials a worker never needs when the gateway authenticates clients itself
/// (`authorization` is dropped by the upstream client, which adds the worker's own key).
pub(crate) const CLIENT_CREDENTIALS: [http::HeaderName; 3] = [
    http::HeaderName::from_static("x-api-key"),
    http::HeaderName::from_static("api-key"),
    header::COOKIE,
];

/// The worker's answer as the client will get it: its head, the first body bytes already read
/// (streams: read before the client's head is sent, so a silent worker can still be retried)
/// with their arrival time, and when a non-streamed body must have ended.
pub(crate) struct Forwarded {
    pub resp: client::Response,
    pub first: Option<(Bytes, Instant)>,
    pub body_deadline: Option<tokio::time::Instant>,
    /// When the response head (a stream: and its first bytes) arrived: one clock read for the
    /// worker's outcome, the first bytes' instant and the body's idle timer.
    pub answered: Instant,
}

/// What the request path hands back: a worker's response to stream through, or (TensorRT-LLM: a
/// context leg that finished the request) a whole answer already read.
// Not boxed: `Worker` is every request's path, and a box would cost an allocation per request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Routed {
    Worker(Forwarded),
    Whole(Bytes),
}

/// What [`route_and_forward`] hands back: the worker's response was put in the caller's slot
/// (written there once by the attempt instead of moved out through every future level, ~400
/// bytes copied per level), or a whole answer already read.
pub(crate) enum Answered {
    /// In the slot passed to [`route_and_forward`].
    Slot,
    Whole(Bytes),
}

/// Answer with a gateway error, recording it.
pub fn reject(mut ctx: Box<RequestCtx>, e: GatewayError) -> Response<GwBody> {
    ctx.error = Some(e.label());
    // In the request's API's own error shape (and status: Anthropic's 529 for shed requests).
    let resp = e.into_response_for(ctx.endpoint.api().errors);
    ctx.status = resp.status().as_u16();
    ctx.finish(Outcome::Rejected);
    resp
}

/// A request read, parsed and tokenized: everything the attempts need.
pub(crate) struct Prepared<'a> {
    /// The client's request head, borrowed from the caller (moving it into each future level and
    /// back out cost a copy of its ~250 bytes per level).
    pub(crate) parts: &'a http::request::Parts,
    /// The client's body bytes, forwarded unchanged...
    pub(crate) bytes: Bytes,
    /// ...unless `stream_options.include_usage` was spliced in (then these go instead).
    pub(crate) spliced: Option<Bytes>,
    pub(crate) pool: Arc<crate::registry::Pool>,
    pub(crate) ri: crate::prompt::RouteInput,
    /// When the routing decision started (after the body was read).
    pub(crate) t_decide: Instant,
    /// The request uses a stored response: `pool` is its origin worker alone, and a failure there
    /// is the answer (another worker does not have the response).
    pub(crate) pinned: bool,
}

crate::thread_cache::cached_load!(
    /// The auth settings now (`[auth]`, reloadable).
    fn cached_auth(crate::auth::Auth)
);

/// Everything from auth to the worker's response head, which is put in `slot`; the caller owns
/// `ctx` and turns the result into the client's response ([`respond`] or [`reject`]). Called straight from the route table:
/// one async layer fewer, whose future (2.4 KB) was copied into place on every request.
///
/// The retry loop: pick a worker (queueing if all are busy), dispatch, one [`attempt`], and on a
/// retry-safe failure another worker, within `retry.max_attempts` and the retry budget.
pub(crate) async fn route_and_forward(
    app: &Arc<Proxy>,
    conns: &client::Pool,
    ctx: &mut RequestCtx,
    parts: &mut http::request::Parts,
    body: ReqBody,
    slot: &mut Option<Forwarded>,
) -> Result<Answered, GatewayError> {
    if let Some(t) = &ctx.telemetry.tracer {
        ctx.trace = t.begin(&parts.headers, ctx.start);
    }
    let auth = cached_auth(&app.auth);
    let caller = auth.check(&parts.headers, ctx.start)?;
    // Read the body (client credentials dropped when auth is on), then what the picker shares:
    // parse, pool, tokens and hashes. Written out here rather than in a helper: one future
    // level and one copy of the prepared request fewer per request. The head stays with the
    // caller (borrowed, not moved into this future).
    if auth.enabled() {
        for h in &CLIENT_CREDENTIALS {
            parts.headers.remove(h);
        }
    }
    let bytes = read_body(
        body,
        parts.headers.get(header::CONTENT_LENGTH),
        app.max_body,
    )
    .await?;
    let mut p = prepare_read(app, ctx, parts, bytes, caller.as_ref()).await?;
    app.upstream.retry.on_request(ctx.start);
    let api = ctx.endpoint.api();
    if !api.splits && api.generates && crate::pd::applies(&p.pool) {
        // The handoff bodies are chat/completions ones: other generating APIs (Responses,
        // Messages) run whole on a decode-capable worker of a disaggregated pool.
        p.pool = crate::pd::roles(&p.pool).decode.clone();
    }
    if api.splits && crate::pd::applies(&p.pool) {
        // Prefill/decode pool: the prefill leg runs there; this loop then serves the decode leg.
        match handoff::prepare_handoff(app, conns, ctx, &mut p, auth.enabled()).await? {
            // SGLang: both legs ran at once (the decode worker's answer); TensorRT-LLM: the
            // context leg finished the request.
            Some(Routed::Worker(f)) => {
                *slot = Some(f);
                return Ok(Answered::Slot);
            }
            Some(Routed::Whole(b)) => return Ok(Answered::Whole(b)),
            None => {}
        }
    }
    let max_attempts = if p.pinned {
        1
    } else {
        (app.upstream
            .max_attempts
            .load(std::sync::atomic::Ordering::Relaxed) as usize)
            .clamp(1, MAX_ATTEMPTS)
    };
    let mut tried = [WorkerId(0); MAX_ATTEMPTS];
    let mut n_tried = 0usize;
    let mut prio_body: Option<Bytes> = None;
    loop {
        // The first choice is made as of the decision's start; later ones (retries, waits in the
        // queue) read the clock again.
        let at = if n_tried == 0 {
            p.t_decide
        } else {
            crate::clock::now()
        };
        // After a prefill leg (`ctx.pd`), this loop chooses the decode worker.
        let leg = if ctx.pd.is_some() {
            Leg::Decode
        } else {
            Leg::Whole
        };
        let queued_before = ctx.queue_wait;
        let Reservation {
            pick,
            guard,
            at: now,
            queued: queue_place,
        } = app
            .decider
            .reserve(
                &p.pool,
                &p.ri,
                &tried[..n_tried],
                at,
                leg,
                &mut ctx.queue_wait,
            )
            .await
            .map_err(|r| refused(r, p.pinned))?;
        if n_tried == 0 {
            ctx.decision_time = now
                .saturating_duration_since(p.t_decide)
                .saturating_sub(ctx.queue_wait);
            app.metrics
                .decision
                .observe(ctx.decision_time.as_secs_f64());
            app.metrics.queue_wait.observe(ctx.queue_wait.as_secs_f64());
            // A disaggregated request's cache is where its prefill ran: the handoff recorded
            // that pick's overlap.
            if leg == Leg::Whole {
                app.metrics
                    .predicted_overlap
                    .observe(pick.decision.predicted_hit_ratio);
                ctx.overlap_blocks = pick.decision.overlap_blocks;
            }
        }
        if ctx.trace.records_steps() {
            ctx.trace.decided(trace_decision(
                app,
                &pick,
                if leg == Leg::Decode {
                    "decode"
                } else {
                    "whole"
                },
                at,
                now,
                ctx.queue_wait.saturating_sub(queued_before),
                queue_place.as_ref(),
                p.pinned,
            ));
        }
        tried[n_tried] = pick.worker.id;
        n_tried += 1;
        ctx.attempts += 1;
        let worker = pick.worker;
        let traced = ctx.trace.attempt_start(
            &worker.name,
            if leg == Leg::Decode {
                "decode"
            } else {
                "whole"
            },
        );
        // Flow control: the class's priority in the body of engines that schedule by it.
        let body = match prioritized(app, &p, &worker) {
            Some(b) => &*prio_body.insert(b),
            None => p.spliced.as_ref().unwrap_or(&p.bytes),
        };
        let mut out = outgoing(p.parts, &worker, body, auth.enabled());
        out.traceparent = traced.as_ref().map(crate::trace::Attempt::traceparent);
        let sent_at = tokio::time::Instant::from_std(now);
        // The response goes straight into the caller's slot; only its status and arrival come
        // back here.
        let result = attempt_at(app, conns, ctx.stream, &worker.name, &out, sent_at, |f| {
            let f = slot.insert(f);
            (f.resp.status, f.answered)
        })
        .await;
        ctx.trace.attempt_end(
            traced,
            match &result {
                Ok((s, _)) => crate::trace::Ended::Status(s.as_u16()),
                Err(e) => ended_err(e),
            },
        );
        let can_retry = |now: Instant| {
            n_tried < max_attempts
                && p.pool
                    .workers
                    .iter()
                    .any(|w| !tried[..n_tried].contains(&w.id) && w.state.routable(now))
                && app.upstream.retry.try_retry(now)
        };
        let now = match &result {
            Ok((_, answered)) => *answered,
            Err(_) => crate::clock::now(),
        };
        match result {
            Ok((s, _)) => {
                let retryable = s == StatusCode::TOO_MANY_REQUESTS || s.is_server_error();
                // A worker shedding load (429) is alive; 5xx counts against its breaker.
                worker.state.record_outcome(!s.is_server_error(), now);
                if retryable {
                    handoff::decode_failed(app, ctx);
                }
                if retryable && can_retry(now) {
                    // This worker's response is dropped here, as before the next try.
                    *slot = None;
                    ctx.trace.retried(status_reason(s));
                    app.metrics
                        .retries
                        .get_or_create(&crate::metrics::ReasonLabel {
                            reason: status_reason(s),
                        })
                        .inc();
                    continue;
                }
                // Success, or nowhere else to go: the worker's own response goes to the client.
                if let (true, Some(id)) = (s.is_success(), deleted_pin(&p)) {
                    app.pins.forget(id);
                }
                ctx.worker = Some(worker);
                ctx.guard = Some(guard);
                // Sent: the client's header map and the hashes' buffer are reused for the next
                // request on this thread.
                crate::prompt::recycle_hashes(std::mem::take(&mut p.ri.hashes));
                kvgate_http::head::recycle(std::mem::take(&mut parts.headers));
                return Ok(Answered::Slot);
            }
            Err(e) => {
                worker.state.record_outcome(false, now);
                handoff::decode_failed(app, ctx);
                if p.pinned && matches!(e.kind, ErrorKind::UpstreamConnect | ErrorKind::UpstreamIo)
                {
                    // The worker that stored the response is gone (refuses connections, or
                    // drops them unanswered), and the response with it.
                    ctx.worker = Some(worker);
                    return Err(GatewayError::new(
                        ErrorKind::ResponseNotFound { param: None },
                        format!(
                            "the worker that stored this response is gone: {}",
                            e.message
                        ),
                    ));
                }
                if e.retry_safe() && can_retry(now) {
                    ctx.trace.retried(e.label().as_str());
                    app.metrics
                        .retries
                        .get_or_create(&crate::metrics::ReasonLabel {
                            reason: e.label().as_str(),
                        })
                        .inc();
                    continue;
                }
                ctx.worker = Some(worker);
                return Err(e);
            }
        }
    }
}

/// A refused reservation as the client's error: for a stored response's request, its worker
/// leaving the routable set means the response is gone (404, not 503).
pub(crate) fn refused(r: crate::route::Refusal, pinned: bool) -> GatewayError {
    match r {
        crate::route::Refusal::NoWorker(why) if pinned => GatewayError::new(
            ErrorKind::ResponseNotFound { param: None },
            format!("the worker that stored this response is not available: {why}"),
        ),
        other => other.into(),
    }
}

/// The stored response a request deletes (`DELETE /v1/responses/{id}`): its pin goes when the
/// worker answers 2xx.
pub(crate) fn deleted_pin<'a>(p: &Prepared<'a>) -> Option<&'a str> {
    (p.pinned && p.parts.method == http::Method::DELETE)
        .then(|| crate::client_api::stored_response_id(p.parts.uri.path()))
        .flatten()
}

/// The body with the engine's `priority` for `worker` (`flow_control.forward_priority`), or
/// `None` to send the prepared body as it is.
pub(crate) fn prioritized(
    app: &Proxy,
    p: &Prepared,
    worker: &crate::registry::Worker,
) -> Option<Bytes> {
    if !app.decider.router().admission().forwards() {
        return None;
    }
    let policy = app.decider.router().admission().policy();
    let class = policy.class(p.ri.flow.priority).priority;
    let prio = crate::flow::engine_priority(&policy, worker.kind, class)?;
    crate::flow::splice_priority(p.spliced.as_ref().unwrap_or(&p.bytes), prio).map(Bytes::from)
}

/// The request once its body is read: what the front door ([`route_and_forward`]) and the
/// endpoint picker (`epp/conversation.rs`) share. The client API's parse (400), the pool (404; a
/// stored response's origin worker alone), the prompt's tokens and hashes (agent APIs rendered
/// through the chat template), the session affinity and the flow-control key (400 on a malformed
/// flow header).
pub(crate) async fn prepare_read<'a>(
    app: &Arc<Proxy>,
    ctx: &mut RequestCtx,
    parts: &'a http::request::Parts,
    bytes: Bytes,
    caller: Option<&crate::auth::Caller>,
) -> Result<Prepared<'a>, GatewayError> {
    let t_decide = crate::clock::now();
    let bad = |e: kvgate_protocol::openai::RequestError| {
        let param = e.param();
        GatewayError::new(ErrorKind::BadRequest { param }, e.to_string())
    };
    let fleet = app.fleet.registry.load_full();
    // The routing policy's session headers, read where used (no guard held across an await).
    let policy = || app.decider.router().policy();
    let mut pinned = false;
    // The session key is the request headers' alone (OpenAI, pass-through): found below with
    // the flow key, under one load of the routing policy.
    let mut header_key = false;
    let (pool, mut ri, spliced, max_tokens) = match ctx.endpoint.api().front {
        Front::OpenAi(_) => {
            header_key = true;
            prepare_openai(app, ctx, &bytes, &fleet).await?
        }
        Front::Agent { parse, prefix } => {
            let agent = parse(&bytes).map_err(bad)?;
            ctx.stream = agent.stream;
            if ctx.endpoint.api().response == ResponseShape::Responses {
                ctx.pins = Some(app.pins.clone());
            }
            let pool = match agent.previous_response_id.as_deref() {
                Some(prev) => {
                    pinned = true;
                    pinned_pool(app, &fleet, prev, "previous_response_id").await?
                }
                None => model_pool(&fleet, &agent.model)?,
            };
            ctx.model = pool.model.clone();
            let mut ri = if prefix && !pinned {
                agent_route_input(app, ctx, &agent, &pool).await
            } else {
                RouteInput::default()
            };
            ri.affinity = session_key(
                &parts.headers,
                &policy().session_headers,
                agent.prompt_cache_key.as_deref(),
                agent.user_id.as_deref(),
            );
            (pool, ri, None, agent.max_output_tokens)
        }
        Front::Passthrough => {
            let pool = passthrough_pool(&fleet, &bytes).map_err(bad)?;
            ctx.model = pool.model.clone();
            header_key = true;
            (pool, RouteInput::default(), None, None)
        }
        Front::StoredResponse => {
            let id = crate::client_api::stored_response_id(parts.uri.path()).unwrap_or_default();
            // `GET …?stream=true&starting_after=N` resumes a background stream.
            ctx.stream = parts
                .uri
                .query()
                .is_some_and(|q| q.split('&').any(|kv| kv == "stream=true"));
            pinned = true;
            let pool = pinned_pool(app, &fleet, id, "response_id").await?;
            ctx.model = pool.model.clone();
            (pool, RouteInput::default(), None, None)
        }
    };
    ctx.strip_usage = spliced.is_some();
    let rp = policy();
    if header_key {
        ri.affinity = session_key(&parts.headers, &rp.session_headers, None, None).or(ri.affinity);
    }
    ri.flow = crate::flow::key(
        &app.decider.router().admission().policy(),
        &parts.headers,
        caller,
        &rp.session_headers,
        &pool.model,
        ri.isl,
        max_tokens,
    )?;
    ri.explain = ctx.trace.explain();
    if ctx.trace.records_steps() {
        // Only a traced request reads the clock for its tokenize span.
        ctx.trace.tokenized(
            t_decide,
            crate::clock::now(),
            ri.isl.min(u32::MAX as u64) as u32,
            ri.hashes.len() as u32,
        );
    }
    ctx.prompt_tokens_est = ri.isl.min(u32::MAX as u64) as u32;
    ctx.prompt_blocks = ri.hashes.len() as u32;
    Ok(Prepared {
        parts,
        bytes,
        spliced,
        pool,
        ri,
        t_decide,
        pinned,
    })
}

/// The OpenAI APIs: the borrowed view (400 on a bad body), the model's pool, the prompt's tokens
/// and hashes, and the body with `stream_options.include_usage` spliced in when the gateway asks
/// for usage on the client's behalf.
async fn prepare_openai(
    _app: &Arc<Proxy>,
    ctx: &mut RequestCtx,
    bytes: &Bytes,
    fleet: &crate::registry::Fleet,
) -> Result<
    (
        Arc<crate::registry::Pool>,
        RouteInput,
        Option<Bytes>,
        Option<u64>,
    ),
    GatewayError,
> {
    let view = crate::prompt::parse_view(bytes, ctx.endpoint).map_err(|e| {
        let param = e.param();
        GatewayError::new(ErrorKind::BadRequest { param }, e.to_string())
    })?;
    ctx.stream = view.stream;
    // A stream whose client did not ask for usage: ask the worker anyway, so tokens and cached
    // tokens are counted, and strip the extra usage-only event from the client's stream.
    let spliced = (view.stream && ctx.endpoint.api().splices_usage)
        .then(|| splice_include_usage(bytes, &view))
        .flatten()
        .map(Bytes::from);
    let pool = model_pool(fleet, &view.model)?;
    ctx.model = pool.model.clone();
    let ri = route_input_offloaded(bytes, &view, ctx.endpoint, pool.block_size, &pool.tokenizer)
        .await
        .map_err(|e| {
            let param = match &e {
                kvgate_tokenize::TokenizeError::Request(r) => r.param(),
                _ => Some("messages"),
            };
            GatewayError::new(ErrorKind::BadRequest { param }, e.to_string())
        })?;
    let max_tokens = view.max_completion_tokens.or(view.max_tokens);
    drop(view);
    Ok((pool, ri, spliced, max_tokens))
}

/// A Responses / Messages request's prompt, rendered as vLLM renders it (its chat conversation
/// through the model's chat template), tokenized and hashed like chat. A shape that cannot be
/// rendered exactly, or a conversation the template refuses, routes on the approximate text and
/// counts in `kvgate_agent_render_approximate_total`; it never fails the request.
async fn agent_route_input(
    app: &Arc<Proxy>,
    ctx: &RequestCtx,
    agent: &kvgate_protocol::agent::AgentRequest,
    pool: &crate::registry::Pool,
) -> RouteInput {
    let approximate = || {
        app.metrics
            .agent_approximate
            .get_or_create(&crate::metrics::EndpointLabel {
                endpoint: ctx.endpoint.label(),
            })
            .inc()
    };
    if !agent.exact {
        approximate();
    }
    let chat = Bytes::from(agent.chat_body());
    let rendered = match kvgate_protocol::openai::RequestView::parse(&chat) {
        Ok(view) => route_input_offloaded(
            &chat,
            &view,
            crate::ctx::Endpoint::CHAT,
            pool.block_size,
            &pool.tokenizer,
        )
        .await
        .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match rendered {
        Ok(ri) => ri,
        Err(why) => {
            if agent.exact {
                approximate();
            }
            tracing::debug!(error = %why, "agent prompt not rendered; routing on its text");
            let text = agent.flat_text();
            let tokens = pool.tokenizer.tokenizer().encode(&text);
            let mut hashes = Vec::new();
            let seed = kvgate_core::hash_seed(None, agent.cache_salt.as_deref());
            kvgate_core::block_hashes_into(&tokens, pool.block_size as usize, seed, &mut hashes);
            RouteInput {
                hashes,
                isl: tokens.len() as u64,
                ..RouteInput::default()
            }
        }
    }
}

fn model_pool(
    fleet: &crate::registry::Fleet,
    model: &str,
) -> Result<Arc<crate::registry::Pool>, GatewayError> {
    fleet.pool(model).cloned().ok_or_else(|| {
        GatewayError::new(
            ErrorKind::ModelNotFound,
            format!("The model `{model}` does not exist or no worker serves it."),
        )
    })
}

/// A pass-through body's pool: its `model`, or the only model served when it names none (vLLM's
/// `/tokenize` and `/score` make `model` optional).
fn passthrough_pool(
    fleet: &crate::registry::Fleet,
    body: &[u8],
) -> Result<Arc<crate::registry::Pool>, kvgate_protocol::openai::RequestError> {
    use kvgate_protocol::openai::RequestError;
    #[derive(serde::Deserialize)]
    struct Model {
        model: Option<String>,
    }
    let m: Model = serde_json::from_slice(body).map_err(|e| RequestError::Json(e.to_string()))?;
    match m.model {
        Some(name) => model_pool(fleet, &name).map_err(|_| RequestError::Invalid {
            param: "model",
            message: format!("The model `{name}` does not exist or no worker serves it."),
        }),
        None => {
            let mut pools = fleet.pools.values();
            match (pools.next(), pools.next()) {
                (Some(p), None) => Ok(p.clone()),
                _ => Err(RequestError::Missing("model")),
            }
        }
    }
}

/// The worker that stored response `id`, alone in a pool: 404 (`x-should-retry: false`) when the
/// id was never seen here, or its worker is gone or not routable. Never another worker: it would
/// not have the response either.
async fn pinned_pool(
    app: &Proxy,
    fleet: &crate::registry::Fleet,
    id: &str,
    param: &'static str,
) -> Result<Arc<crate::registry::Pool>, GatewayError> {
    let not_found = || {
        GatewayError::new(
            ErrorKind::ResponseNotFound { param: Some(param) },
            format!("Response with id '{id}' not found."),
        )
    };
    let origin = app.pins.origin_or_wait(id).await.ok_or_else(not_found)?;
    let now = crate::clock::now();
    for pool in fleet.pools.values() {
        if let Some(w) = pool.workers.iter().find(|w| w.name == origin) {
            if !w.state.routable(now) {
                return Err(not_found());
            }
            return Ok(Arc::new(crate::registry::Pool::new(
                pool.model.clone(),
                vec![w.clone()],
                pool.block_size,
                pool.tokenizer.clone(),
            )));
        }
    }
    Err(not_found())
}

/// The client's request as sent to `worker`: its method, path and headers (client credentials
/// stripped when `strip_client_auth`), the worker's own credentials, and `body`.
pub(crate) fn outgoing<'a>(
    parts: &'a http::request::Parts,
    worker: &'a crate::registry::Worker,
    body: &'a Bytes,
    strip_client_auth: bool,
) -> client::Outgoing<'a> {
    client::Outgoing {
        https: worker.scheme == http::uri::Scheme::HTTPS,
        method: &parts.method,
        authority: &worker.authority,
        path_prefix: &worker.path_prefix,
        path_and_query: parts.uri.path_and_query().map_or("/", |q| q.as_str()),
        headers: &parts.headers,
        strip_client_auth,
        worker_auth: worker.auth_header.as_ref(),
        traceparent: None,
        body,
    }
}

/// One try on one worker: send, and wait for the response head (streams: and the first body
/// bytes) within the timeouts. Streams: head and first byte within `first_byte_timeout`; others:
/// the whole response within `request_timeout`; either way the head within `response_timeout`.
pub(crate) async fn attempt(
    app: &Proxy,
    conns: &client::Pool,
    stream: bool,
    worker: &str,
    out: &client::Outgoing<'_>,
) -> Result<Forwarded, GatewayError> {
    attempt_at(
        app,
        conns,
        stream,
        worker,
        out,
        tokio::time::Instant::now(),
        |f| f,
    )
    .await
}

/// [`attempt`] sent at `sent_at` (the front door's: the instant its reservation was made, read
/// once for both), its response handed to `put` (the front door's puts it in place in its slot
/// and keeps what it decides on).
pub(crate) async fn attempt_at<T>(
    app: &Proxy,
    conns: &client::Pool,
    stream: bool,
    worker: &str,
    out: &client::Outgoing<'_>,
    sent_at: tokio::time::Instant,
    put: impl FnOnce(Forwarded) -> T,
) -> Result<T, GatewayError> {
    let within = if stream {
        app.upstream.first_byte_timeout
    } else {
        app.upstream.request_timeout
    };
    let deadline = sent_at + within;
    let head_by = deadline.min(sent_at + app.upstream.response_timeout);
    let sent = std::pin::pin!(client::send(out, &app.upstream.client, conns));
    // The pool's timer, kept armed between requests (no timer registered and removed per try).
    let mut resp = match conns.within(head_by, sent).await {
        None => {
            return Err(GatewayError::new(
                ErrorKind::UpstreamTimeout,
                format!(
                    "worker {worker} sent no response within {:?}",
                    head_by - sent_at
                ),
            ))
        }
        Some(Err(e)) if e.is_connect() => {
            return Err(GatewayError::new(
                ErrorKind::UpstreamConnect,
                format!("cannot connect to worker {worker}: {e}"),
            ))
        }
        Some(Err(e)) => {
            return Err(GatewayError::new(
                ErrorKind::UpstreamIo,
                format!("worker {worker} failed before responding: {e}"),
            ))
        }
        Some(Ok(resp)) => resp,
    };
    // The response stays where it is: read into, not moved through another future.
    let first = if stream && resp.status.is_success() {
        first_bytes(conns, &mut resp, deadline, within, worker).await?
    } else {
        None
    };
    let answered = match &first {
        Some((_, at)) => *at,
        None => crate::clock::now(),
    };
    Ok(put(Forwarded {
        resp,
        first,
        body_deadline: (!stream).then_some(deadline),
        answered,
    }))
}

/// A stream's first body bytes, read before anything goes to the client: a worker that sent its
/// head but stays silent past `deadline` is a 504 that may be retried elsewhere (dropping the
/// response closes its connection, which cancels the request on the worker).
async fn first_bytes(
    conns: &client::Pool,
    resp: &mut client::Response,
    deadline: tokio::time::Instant,
    within: std::time::Duration,
    worker: &str,
) -> Result<Option<(Bytes, Instant)>, GatewayError> {
    loop {
        match conns
            .within(deadline, std::pin::pin!(resp.body.frame()))
            .await
        {
            None => {
                return Err(GatewayError::new(
                    ErrorKind::UpstreamTimeout,
                    format!("worker {worker} sent no first byte within {within:?}"),
                ))
            }
            Some(None) => return Ok(None),
            Some(Some(Err(e))) => {
                return Err(GatewayError::new(
                    ErrorKind::UpstreamIo,
                    format!("worker {worker} failed before its first byte: {e}"),
                ))
            }
            Some(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) if d.is_empty() => continue,
                Ok(d) => return Ok(Some((d, crate::clock::now()))),
                // Trailers before any data: nothing for an SSE client; the body has ended.
                Err(_) => return Ok(None),
            },
        }
    }
}

/// How a failed attempt ended, for its span.
fn ended_err(e: &GatewayError) -> crate::trace::Ended<'_> {
    crate::trace::Ended::Error(e.label().as_str(), &e.message)
}

/// The routing decision's span (only built when the request is traced).
/// The route span of a sampled request: the pick, its top candidates and reason (the pick's
/// [`crate::route::router::Explain`], there when `RouteInput::explain` asked), and where it
/// stood in the queue. `pinned`: the request had to go to the worker that stored its response.
#[allow(clippy::too_many_arguments)]
pub(crate) fn trace_decision<'a>(
    app: &Proxy,
    pick: &'a crate::route::router::Pick,
    leg: &'static str,
    start: Instant,
    end: Instant,
    queued: std::time::Duration,
    queue: Option<&'a crate::route::Queued>,
    pinned: bool,
) -> crate::trace::Decided<'a> {
    let policy = app.decider.router().policy();
    let policy = match (leg, &policy.decode_policy) {
        ("decode", Some(p)) => p.name(),
        _ => policy.policy.name(),
    };
    let explain = pick.explain.as_deref();
    let reason = match explain {
        _ if pinned => "pinned",
        Some(e) => e.reason,
        None if pick.decision.overlap_blocks > 0 => "overlap",
        None => "load",
    };
    let candidates = explain
        .map(|e| {
            e.candidates
                .iter()
                .map(|c| crate::trace::RouteCandidate {
                    worker: &c.worker,
                    chosen: c.chosen,
                    overlap_blocks: c.overlap_blocks,
                    inflight: c.inflight,
                    active_blocks: c.active_blocks,
                    pending_prefill_tokens: c.pending_prefill_tokens,
                    predicted_ttft_ms: c.predicted_ttft_ms,
                    cost: c.cost,
                })
                .collect()
        })
        .unwrap_or_default();
    crate::trace::Decided {
        policy,
        leg,
        worker: &pick.worker.name,
        overlap_blocks: pick.decision.overlap_blocks,
        predicted_hit_ratio: pick.decision.predicted_hit_ratio,
        cost: pick.decision.cost,
        predicted_ttft_ms: pick.estimate.predicted_ms,
        reason,
        candidates,
        seen: explain.map_or(1, |e| e.seen),
        start,
        end,
        queued,
        queue: queue.map(|q| crate::trace::QueuePlace {
            class: &q.class,
            tenant: &q.tenant,
            position: q.position,
            flow_control: q.flow_control,
        }),
    }
}

fn status_reason(s: StatusCode) -> &'static str {
    match s.as_u16() {
        429 => "status_429",
        503 => "status_503",
        _ => "status_5xx",
    }
}

/// Collect the request body up to `max` bytes (413 beyond).
async fn read_body(
    body: ReqBody,
    len: Option<&header::HeaderValue>,
    max: usize,
) -> Result<Bytes, GatewayError> {
    let too_large = || {
        GatewayError::new(
            ErrorKind::PayloadTooLarge { limit: max },
            format!("request body exceeds the limit of {max} bytes"),
        )
    };
    if let Some(n) = len
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
    {
        if n > max as u64 {
            return Err(too_large());
        }
    }
    let body = match body {
        ReqBody::Full(b) if b.as_ref().map_or(0, |b| b.len()) <= max => {
            return Ok(b.unwrap_or_default())
        }
        ReqBody::Full(_) | ReqBody::TooLarge => return Err(too_large()),
        ReqBody::Hyper(b) => b,
    };
    match Limited::new(body, max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_large())
        }
        Err(e) => Err(GatewayError::new(
            ErrorKind::BadRequest { param: None },
            format!("reading request body: {e}"),
        )),
    }
}

/// The client's response: a worker's (from `slot`) through the observer, or a whole answer
/// already read.
pub(crate) fn respond(
    app: &Proxy,
    mut ctx: Box<RequestCtx>,
    answered: Answered,
    slot: &mut Option<Forwarded>,
) -> Response<GwBody> {
    let fwd = match answered {
        Answered::Slot => match slot.take() {
            Some(f) => f,
            // `route_and_forward` fills the slot whenever it answers `Slot`.
            None => {
                debug_assert!(false, "Answered::Slot with an empty slot");
                return reject(
                    ctx,
                    GatewayError::new(ErrorKind::UpstreamIo, "the worker's response was lost"),
                );
            }
        },
        Answered::Whole(body) => {
            ctx.status = 200;
            ctx.usage = kvgate_protocol::usage::find_usage(&body);
            ctx.finish_reason = kvgate_protocol::finish::find_finish_reason(&body);
            ctx.finish(crate::ctx::Outcome::Complete);
            let mut r = Response::new(GwBody::full(body));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            return r;
        }
    };
    respond_forwarded(app, ctx, fwd)
}

/// Pass the worker's response through the observer (its hop-by-hop fields are already gone).
fn respond_forwarded(app: &Proxy, mut ctx: Box<RequestCtx>, fwd: Forwarded) -> Response<GwBody> {
    let Forwarded {
        resp,
        first,
        body_deadline,
        answered,
    } = fwd;
    let client::Response {
        status,
        mut headers,
        body,
    } = resp;
    ctx.status = status.as_u16();
    let sse = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    // We may append an error event, or merge a prefill leg's usage (PD); the length would then
    // be wrong.
    if sse || ctx.pd.as_ref().is_some_and(|p| p.usage.is_some()) {
        headers.remove(header::CONTENT_LENGTH);
    }
    let mut body = ObservedBody::new(body, ctx, sse, app.upstream.stream_idle_timeout, answered);
    body.prefetched(first, body_deadline);
    let mut r = Response::new(GwBody::Observed(Box::new(body)));
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}
