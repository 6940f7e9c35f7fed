//! The decision of a conversation: a client API's request prepared and reserved as at the front
//! door (`route_api`, `plan_pd` for prefill/decode pools), other requests by load
//! (`route_by_load`), the candidates the gateway allows (`excluded`: subset hint, `ip:port`), and
//! the fallback list (`with_fallbacks`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvgate_core::WorkerId;

use super::{Conversation, Held, Routed, MODEL_HEADER, SUBSET_KEY, SUBSET_NAMESPACE};
use crate::client_api::Endpoint;
use crate::ctx::RequestCtx;
use crate::epp::pb::{self, BodySendMode};
use crate::epp::rewrite;
use crate::error::{ErrorKind, GatewayError};
use crate::registry::{Pool, Worker};
use crate::route::router::{DispatchGuard, Leg};
use crate::route::{Reservation, RouteInput};

/// A pick as the request's answer: the destination value, the body the worker gets when it
/// is not the client's, and the other request-header changes.
#[derive(Default)]
pub(super) struct Picked {
    pub(super) value: String,
    pub(super) body: Option<Bytes>,
    pub(super) set: Vec<pb::HeaderValueOption>,
    pub(super) remove: Vec<String>,
}

impl Conversation {
    /// A client API's request, prepared by the front door's own function
    /// (`proxy::prepare_read`: the API's parse (400), the pool (404; a stored response's origin
    /// worker alone), the prompt rendered, tokenized and hashed, the session, the flow-control
    /// key), after the front door's authentication and this picker's model rewrite; then
    /// decided as at the front door (PD plan, `Decider::reserve` with flow control's admission).
    pub(super) async fn route_api(
        &mut self,
        ep: Endpoint,
        body: Bytes,
    ) -> Result<Picked, GatewayError> {
        let epp = self.epp.clone();
        let proxy = &epp.proxy;
        let api = ep.api();
        self.shape = api.errors;
        let mut ctx = RequestCtx::new(epp.telemetry.clone(), ep, self.start);
        let parts = request_parts(&self.headers);
        if let Some(t) = &ctx.telemetry.tracer {
            ctx.trace = t.begin(&parts.headers, ctx.start);
        }
        let auth = proxy.auth.load();
        let caller = match auth.check(&parts.headers, ctx.start) {
            Ok(c) => c,
            Err(e) => return Err(self.reject(ctx, e)),
        };
        let forced = [rewrite::FORCE, rewrite::FORCE_LEGACY]
            .iter()
            .find_map(|h| parts.headers.get(*h))
            .map(|v| v.to_str().unwrap_or_default().trim().to_owned());
        let (body, rewritten) = match epp
            .rewrites
            .apply(&body, forced.as_deref(), fastrand::f64())
        {
            Ok(Some((b, r))) => (b, Some(r)),
            Ok(None) => (body, None),
            Err(e) => return Err(self.reject(ctx, e)),
        };
        let mut p = match crate::proxy::prepare_read(proxy, &mut ctx, &parts, body, caller.as_ref())
            .await
        {
            Ok(p) => p,
            Err(e) => return Err(self.reject(ctx, e)),
        };
        if let Some(r) = &rewritten {
            proxy
                .metrics
                .epp
                .model_rewrites
                .get_or_create(&crate::metrics::ModelLabel {
                    model: ctx.model.clone(),
                })
                .inc();
            tracing::debug!(from = %r.from, to = %r.to, "epp: model rewritten");
        }
        // As the front door: a stream that did not ask for usage gets it asked for (counted),
        // and the extra usage event is stripped from the client's stream. Only when both bodies
        // stream through us (we rewrite the request and the response).
        if !(self.streams_request && self.response_mode == BodySendMode::FullDuplexStreamed) {
            p.spliced = None;
            ctx.strip_usage = false;
        }
        if !api.splits && api.generates && crate::pd::applies(&p.pool) {
            // As the front door: Responses and Messages run whole on a decode-capable worker.
            p.pool = Arc::new(crate::pd::sub_pool(
                &p.pool,
                crate::config::WorkerRole::can_decode,
            ));
        }
        let t_decide = p.t_decide;
        let (pool, leg) = if api.splits && crate::pd::applies(&p.pool) {
            match self.plan_pd(&ctx, &p.pool, &p.ri, t_decide) {
                Ok(x) => x,
                Err(e) => return Err(self.reject(ctx, e)),
            }
        } else {
            (p.pool.clone(), Leg::Whole)
        };
        let exclude = match self.excluded(&pool) {
            Ok(x) => x,
            Err(e) => return Err(self.reject(ctx, e)),
        };
        let r = proxy
            .decider
            .reserve(&pool, &p.ri, &exclude, t_decide, leg, &mut ctx.queue_wait)
            .await;
        let res = match r {
            Ok(r) => r,
            Err(refusal) => {
                let e = crate::proxy::refused(refusal, p.pinned);
                return Err(self.reject(ctx, e));
            }
        };
        ctx.decision_time = res
            .at
            .saturating_duration_since(t_decide)
            .saturating_sub(ctx.queue_wait);
        let m = &proxy.metrics;
        m.decision.observe(ctx.decision_time.as_secs_f64());
        m.queue_wait.observe(ctx.queue_wait.as_secs_f64());
        m.predicted_overlap
            .observe(res.pick.decision.predicted_hit_ratio);
        ctx.overlap_blocks = res.pick.decision.overlap_blocks;
        ctx.attempts = 1;
        let leg_name = if leg == Leg::Decode {
            "decode"
        } else {
            "whole"
        };
        if ctx.trace.records_steps() {
            ctx.trace.decided(crate::proxy::trace_decision(
                proxy,
                &res.pick,
                leg_name,
                t_decide,
                res.at,
                ctx.queue_wait,
                res.queued.as_ref(),
                p.pinned,
            ));
        }
        // A stored response lives on its origin worker only: no fallbacks.
        let k = if p.pinned {
            1
        } else {
            epp.settings.fallback_endpoints
        };
        let (value, guard, endpoints) = self.with_fallbacks(&pool, &exclude, res, k);
        let worker = guard.worker.clone();
        let mut set = Vec::new();
        let mut remove = Vec::new();
        // The worker's spans join the request's trace: `traceparent` with the attempt's span id.
        self.attempt = ctx.trace.attempt_start(&worker.name, leg_name);
        if let Some(a) = &self.attempt {
            set.push(pb::set_header(
                crate::trace::TRACEPARENT.as_str(),
                a.traceparent(),
            ));
        }
        // As the front door's upstream hop: client credentials never reach the worker when
        // kvgate authenticates clients, and a worker with its own key gets it.
        if auth.enabled() {
            remove.extend(
                crate::proxy::CLIENT_CREDENTIALS
                    .iter()
                    .map(|h| h.as_str().to_owned()),
            );
            remove.push(http::header::AUTHORIZATION.as_str().to_owned());
        }
        if let Some(a) = &worker.auth_header {
            remove.retain(|h| h != http::header::AUTHORIZATION.as_str());
            set.push(pb::set_header(
                http::header::AUTHORIZATION.as_str(),
                a.as_bytes(),
            ));
        }
        // The body the worker gets: with the engine's priority (flow control), the usage
        // request, or the rewritten model; `None` when it is the client's.
        let changed = crate::proxy::prioritized(proxy, &p, &worker)
            .or_else(|| p.spliced.clone())
            .or_else(|| rewritten.is_some().then(|| p.bytes.clone()));
        self.forget = crate::proxy::deleted_pin(&p).map(str::to_owned);
        self.rewritten = rewritten;
        ctx.worker = Some(worker);
        ctx.guard = Some(guard);
        ctx.prefilled_elsewhere = self.prefill.is_some();
        self.held = Held::Api {
            ctx: Some(ctx),
            obs: None,
        };
        self.routed = Some(Routed {
            pool,
            input: p.ri,
            endpoints,
        });
        m.epp.picks.get_or_create(&kind("api")).inc();
        Ok(Picked {
            value,
            body: changed,
            set,
            remove,
        })
    }

    /// A prefill/decode pool (docs/epp.md, "Prefill/decode pools"): the decision core's plan.
    /// Split: the destination is the decode worker and the prefill worker goes in
    /// `x-prefiller-host-port` (llm-d's P/D sidecar convention: the sidecar beside the decode
    /// engine runs the prefill leg there); its load is held until the response starts. Local, or
    /// no prefill worker free: the decode worker runs it whole.
    pub(super) fn plan_pd(
        &mut self,
        ctx: &RequestCtx,
        pool: &Arc<Pool>,
        input: &RouteInput,
        now: Instant,
    ) -> Result<(Arc<Pool>, Leg), GatewayError> {
        let epp = self.epp.clone();
        let crate::route::PdRoute { decode, plan } = epp.proxy.decider.plan_pd(pool, input, now)?;
        let decision = |path, reason| {
            epp.proxy
                .metrics
                .pd
                .decisions
                .get_or_create(&crate::metrics::PdDecisionLabels {
                    model: ctx.model.clone(),
                    path,
                    reason,
                })
                .inc();
        };
        let (prefill, first) = match plan {
            crate::route::PdPlan::Local(reason) => {
                decision("local", reason);
                return Ok((decode, Leg::Whole));
            }
            crate::route::PdPlan::Split {
                prefill,
                first_prefill,
                ..
            } => (prefill, first_prefill),
        };
        let skip = self.excluded(&prefill).unwrap_or_default();
        let res = match first {
            Some(p) if !skip.contains(&p.worker.id) => {
                Some(epp.proxy.decider.place(p, &prefill, input, now))
            }
            _ => epp
                .proxy
                .decider
                .try_reserve(&prefill, input, &skip, now)
                .ok(),
        };
        match res.and_then(|r| crate::epp::endpoint_of(&r.pick.worker).map(|a| (a, r.guard))) {
            Some((addr, guard)) => {
                decision("disaggregated", "epp_sidecar");
                self.prefill = Some((addr, guard));
                Ok((decode, Leg::Decode))
            }
            None => {
                decision("local", "prefill_busy");
                Ok((decode, Leg::Whole))
            }
        }
    }

    /// Bodiless requests and other paths: the least loaded worker of the request's pool (the
    /// `x-gateway-model-name` header's model, else the only pool, else every worker).
    pub(super) async fn route_by_load(&mut self) -> Result<String, GatewayError> {
        let epp = self.epp.clone();
        let fleet = epp.proxy.fleet.registry.load_full();
        let named = self
            .headers
            .get(MODEL_HEADER)
            .and_then(|m| std::str::from_utf8(m).ok())
            .and_then(|m| fleet.pool(m).cloned());
        let pool = match named {
            Some(p) => p,
            None => {
                let mut distinct: Vec<&Arc<Pool>> = Vec::new();
                for p in fleet.pools.values() {
                    if !distinct.iter().any(|d| Arc::ptr_eq(d, p)) {
                        distinct.push(p);
                    }
                }
                match distinct.as_slice() {
                    [one] => (*one).clone(),
                    _ => Arc::new(Pool::new(
                        "any".into(),
                        fleet.workers.clone(),
                        1,
                        Default::default(),
                    )),
                }
            }
        };
        let exclude = self.excluded(&pool)?;
        let input = RouteInput::default();
        let mut waited = std::time::Duration::ZERO;
        let res = epp
            .proxy
            .decider
            .reserve(
                &pool,
                &input,
                &exclude,
                crate::clock::now(),
                Leg::Whole,
                &mut waited,
            )
            .await
            .map_err(|refusal| {
                let e: GatewayError = refusal.into();
                epp.proxy.metrics.error(e.label());
                e
            })?;
        let k = epp.settings.fallback_endpoints;
        let (value, guard, endpoints) = self.with_fallbacks(&pool, &exclude, res, k);
        self.held = Held::Load(guard);
        self.routed = Some(Routed {
            pool,
            input,
            endpoints,
        });
        epp.proxy
            .metrics
            .epp
            .picks
            .get_or_create(&kind("load"))
            .inc();
        Ok(value)
    }

    /// Workers the pick must skip: those without an `ip:port` Envoy can connect to, and with a
    /// subset hint, those outside it (503 when that leaves none of the pool).
    pub(super) fn excluded(&self, pool: &Pool) -> Result<Vec<WorkerId>, GatewayError> {
        let subset = self
            .metadata
            .as_ref()
            .and_then(|m| m.field(SUBSET_NAMESPACE, SUBSET_KEY))
            .map(subset_addrs);
        let mut out = Vec::new();
        let mut eligible = 0usize;
        for w in &pool.workers {
            let ok = match crate::epp::endpoint_of(w) {
                None => false,
                Some(a) => subset.as_ref().is_none_or(|s| s.contains(&a)),
            };
            if ok {
                eligible += 1;
            } else {
                out.push(w.id);
            }
        }
        if eligible == 0 {
            let why = if subset.is_some() {
                "no worker of the pool is in the gateway's endpoint subset"
            } else {
                "no worker of the pool has an ip:port address"
            };
            return Err(GatewayError::new(
                ErrorKind::NoWorker,
                format!("{why} (model `{}`)", pool.model),
            ));
        }
        Ok(out)
    }

    /// The reservation's worker then up to `fallback_endpoints − 1` more: the least loaded of
    /// the rest (requests in flight, then pool order), no load placed on them (Envoy tries them
    /// only if the first fails). Not the policy's next choices: a stateful policy (round robin)
    /// would advance once per fallback.
    pub(super) fn with_fallbacks(
        &self,
        pool: &Pool,
        exclude: &[WorkerId],
        res: Reservation,
        k: usize,
    ) -> (String, DispatchGuard, Vec<(Arc<Worker>, SocketAddr)>) {
        let first = res.pick.worker.clone();
        let mut endpoints: Vec<(Arc<Worker>, SocketAddr)> = crate::epp::endpoint_of(&first)
            .map(|a| (first.clone(), a))
            .into_iter()
            .collect();
        let now = res.at;
        let mut rest: Vec<(u32, usize, &Arc<Worker>, SocketAddr)> = pool
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.id != first.id && !exclude.contains(&w.id) && w.state.routable(now))
            .filter_map(|(i, w)| {
                let load = w.state.inflight.load(std::sync::atomic::Ordering::Relaxed);
                crate::epp::endpoint_of(w).map(|a| (load, i, w, a))
            })
            .collect();
        rest.sort_unstable_by_key(|(load, i, _, _)| (*load, *i));
        let room = k.saturating_sub(endpoints.len());
        endpoints.extend(
            rest.into_iter()
                .take(room)
                .map(|(_, _, w, a)| (w.clone(), a)),
        );
        let value = endpoints
            .iter()
            .map(|(_, a)| a.to_string())
            .collect::<Vec<_>>()
            .join(",");
        (value, res.guard, endpoints)
    }
}

/// The request as the front door's `proxy::prepare_read` sees it: method, path and headers
/// (Envoy's pseudo-headers `:method` and `:path`; values from `raw_value`, else `value`; a
/// header that is not a valid HTTP field is left out).
fn request_parts(h: &pb::HeaderMap) -> http::request::Parts {
    let method = h
        .get(":method")
        .and_then(|m| http::Method::from_bytes(m).ok())
        .unwrap_or(http::Method::POST);
    let uri = h
        .get(":path")
        .and_then(|p| http::Uri::try_from(p).ok())
        .unwrap_or_else(|| http::Uri::from_static("/"));
    let (mut parts, ()) = http::Request::builder()
        .method(method)
        .uri(uri)
        .body(())
        .expect("method and uri are valid")
        .into_parts();
    for v in &h.headers {
        if v.key.starts_with(':') {
            continue;
        }
        let raw = if v.raw_value.is_empty() {
            v.value.as_bytes()
        } else {
            &v.raw_value[..]
        };
        if let (Ok(k), Ok(val)) = (
            http::HeaderName::from_bytes(v.key.as_bytes()),
            http::HeaderValue::from_bytes(raw),
        ) {
            parts.headers.append(k, val);
        }
    }
    parts
}

fn kind(k: &'static str) -> crate::metrics::KindLabel {
    crate::metrics::KindLabel { kind: k }
}

/// The subset hint's endpoints: a list of `ip:port` strings, or one comma-separated string.
pub(super) fn subset_addrs(v: &pb::Value) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    let mut add = |s: &str| {
        for part in s.split(',') {
            if let Ok(a) = part.trim().parse() {
                out.push(a);
            }
        }
    };
    match &v.kind {
        Some(pb::Kind::StringValue(s)) => add(s),
        Some(pb::Kind::ListValue(l)) => {
            for v in &l.values {
                if let Some(pb::Kind::StringValue(s)) = &v.kind {
                    add(s);
                }
            }
        }
        _ => {}
    }
    out
}
