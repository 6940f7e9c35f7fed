//! The admin API, on its own listener (off unless `admin.listen` is set) and protected by the
//! admin bearer key:
//!
//! - `GET /admin/state`: per worker health, breaker, load, active blocks, index size; queue depth.
//! - `GET /admin/workers`, `POST /admin/workers` (JSON like a `[[workers]]` entry),
//!   `DELETE /admin/workers/{name}`, `POST /admin/workers/{name}/drain` / `.../undrain`.
//! - `POST /admin/reload`: re-read the config file now.
//!
//! Workers added or removed here survive config reloads (they are overlays on the file).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde_json::json;

use crate::auth::key_matches;
use crate::body::{GwBody, ReqBody};
use crate::config::WorkerConfig;
use crate::reload::{self, Overrides};
use crate::state::AppState;

pub struct AdminCtx {
    pub app: Arc<AppState>,
    pub key: String,
    pub config_path: Option<std::path::PathBuf>,
    pub overrides: Overrides,
}

pub async fn route(ctx: Arc<AdminCtx>, req: Request<ReqBody>) -> Response<GwBody> {
    if !key_matches(req.headers(), &ctx.key) {
        return err(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or invalid admin key",
        );
    }
    let app = &ctx.app;
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (&method, segs.as_slice()) {
        (&Method::GET, ["admin", "state"]) => ok(state_json(app)),
        (&Method::GET, ["admin", "workers"]) => ok(state_json(app)["workers"].clone()),
        (&Method::POST, ["admin", "workers"]) => {
            let body = match Limited::new(req.into_body(), 64 << 10).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return err(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        &format!("reading body: {e}"),
                    )
                }
            };
            let w: WorkerConfig = match serde_json::from_slice(&body) {
                Ok(w) => w,
                Err(e) => {
                    return err(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        &format!("invalid worker: {e}"),
                    )
                }
            };
            let mut probe = (*app.fleet.registry.config()).clone();
            probe.workers.push(w.clone());
            if let Err(e) = probe.validate() {
                return err(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    &format!("{e:#}"),
                );
            }
            match app.fleet.registry.add_worker(w) {
                Ok(r) => {
                    app.fleet.apply_rebuild(&r);
                    app.fleet.discover().await;
                    ok(json!({"added": r.added.iter().map(|(_, n)| &**n).collect::<Vec<_>>()}))
                }
                Err(e) => err(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    &format!("{e:#}"),
                ),
            }
        }
        (&Method::DELETE, ["admin", "workers", name]) => {
            if app
                .fleet
                .registry
                .snapshot()
                .workers
                .iter()
                .all(|w| &*w.name != *name)
            {
                return err(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "no such worker",
                );
            }
            match app.fleet.registry.remove_worker(name) {
                Ok(r) => {
                    app.fleet.apply_rebuild(&r);
                    ok(json!({"removed": name}))
                }
                Err(e) => err(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    &format!("{e:#}"),
                ),
            }
        }
        (&Method::POST, ["admin", "workers", name, action @ ("drain" | "undrain")]) => {
            let fleet = app.fleet.registry.snapshot();
            let Some(w) = fleet.workers.iter().find(|w| &*w.name == *name) else {
                return err(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "no such worker",
                );
            };
            w.state
                .draining
                .store(*action == "drain", Ordering::Relaxed);
            ok(
                json!({"worker": name, "draining": *action == "drain", "inflight": w.state.inflight.load(Ordering::Relaxed)}),
            )
        }
        (&Method::POST, ["admin", "reload"]) => match &ctx.config_path {
            None => err(
                StatusCode::CONFLICT,
                "invalid_request_error",
                "started without --config; nothing to reload",
            ),
            Some(p) => match reload::reload(app, p, &ctx.overrides) {
                Ok(()) => ok(json!({"reloaded": true})),
                Err(e) => err(StatusCode::BAD_REQUEST, "invalid_request_error", &e),
            },
        },
        _ => err(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no such admin route",
        ),
    }
}

pub fn state_json(app: &AppState) -> serde_json::Value {
    let now = crate::clock::now();
    let fleet = app.fleet.registry.snapshot();
    let router = &app.fleet.router;
    let loads = router.active().all();
    let latency = router.latency_snapshot();
    router.with_index(|index| state_with_index(app, &fleet, index, &loads, &latency, now))
}

fn state_with_index(
    app: &AppState,
    fleet: &crate::registry::Fleet,
    index: &kvgate_core::KvIndex,
    loads: &[(kvgate_core::WorkerId, kvgate_core::WorkerLoad)],
    latency: &kvgate_core::LatencyModel,
    now: Instant,
) -> serde_json::Value {
    let workers: Vec<_> = fleet
        .workers
        .iter()
        .map(|w| {
            let s = &w.state;
            let load = loads.iter().find(|(id, _)| *id == w.id).map(|(_, l)| *l).unwrap_or_default();
            let scraped = s.fresh_scraped(now);
            json!({
                "id": w.id.0,
                "name": &*w.name,
                "url": w.cfg.url,
                "kind": w.kind.as_str(),
                "models": w.models.iter().map(|m| &**m).collect::<Vec<_>>(),
                "healthy": s.healthy.load(Ordering::Relaxed),
                "draining": s.draining.load(Ordering::Relaxed),
                "routable": s.routable(now),
                "breaker": format!("{:?}", s.breaker_state(now)).to_lowercase(),
                "inflight": s.inflight.load(Ordering::Relaxed),
                "dispatched": s.dispatched.load(Ordering::Relaxed),
                "active_blocks": load.active_blocks,
                "pending_prefill_tokens": load.pending_prefill_tokens,
                "index_blocks": index.blocks_for(w.id),
                "index_predicted_blocks": index.predicted_blocks_for(w.id),
                "index_mode": match index.mode(w.id) {
                    Some(kvgate_core::IndexMode::Exact) => "exact",
                    Some(kvgate_core::IndexMode::Approximate(_)) => "approximate",
                    None => "none",
                },
                // The approximate index's per-worker bound (from the worker's scraped capacity
                // when it reports one); null for exact workers.
                "index_capacity_blocks": match index.mode(w.id) {
                    Some(kvgate_core::IndexMode::Approximate(c)) => Some(c.capacity_blocks),
                    _ => None,
                },
                "scraped": scraped.map(|l| json!({"kv_usage": l.kv_usage, "waiting": l.waiting, "running": l.running})),
                "cost_per_hour": w.cfg.cost_per_hour,
                // The latency model's view: speed factors (1 = the timing curve), the learned
                // engine slots (limit 0 = never seen saturated) and mean output tokens (how much a
                // running request's KV grows; 0 = not known).
                "latency": latency.fit(w.id).map(|f| {
                    let (speed, slots) = (f.speed(), f.slots());
                    json!({"prefill_factor": speed.prefill, "decode_factor": speed.decode,
                           "slot_limit": slots.limit, "request_ms": slots.service_ms,
                           "output_tokens": slots.output_tokens})
                }),
            })
        })
        .collect();
    json!({
        "generation": fleet.generation,
        "policy": app.fleet.router.policy().policy.name(),
        "queue_depth": app.admission.len(),
        "index_entries": index.total_entries(),
        "index_predicted_entries": index.predicted_entries(),
        "index_distinct_blocks": index.distinct_blocks(),
        "workers": workers,
    })
}

fn ok(v: serde_json::Value) -> Response<GwBody> {
    let mut r = Response::new(GwBody::full(serde_json::to_vec(&v).unwrap_or_default()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn err(status: StatusCode, typ: &'static str, msg: &str) -> Response<GwBody> {
    let e = kvgate_protocol::error::OpenAiError::new(status.as_u16(), typ, msg.to_owned());
    let mut r = Response::new(GwBody::full(e.to_json()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}
