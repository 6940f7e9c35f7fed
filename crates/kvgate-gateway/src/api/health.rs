//! `GET /health` (the process is alive) and `GET /ready` (at least one routable worker that serves
//! a known model, and not draining for shutdown).

use http::{header, HeaderValue, Response, StatusCode};

use crate::body::GwBody;
use crate::state::AppState;

pub fn live() -> Response<GwBody> {
    json(StatusCode::OK, r#"{"status":"ok"}"#)
}

/// Whether a request can be routed now (`/ready` answers 200; the endpoint picker's health
/// services `readiness` and ext_proc answer SERVING).
pub fn is_ready(app: &AppState) -> bool {
    if app.shutdown.is_cancelled() || app.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return false;
    }
    let fleet = app.fleet.registry.snapshot();
    let now = crate::clock::now();
    fleet
        .workers
        .iter()
        .any(|w| !w.models.is_empty() && w.state.routable(now))
}

pub fn ready(app: &AppState) -> Response<GwBody> {
    // SIGTERM with `server.drain_delay_s`: not ready, while requests are still served.
    if app.draining.load(std::sync::atomic::Ordering::Relaxed) && !app.shutdown.is_cancelled() {
        return json(StatusCode::SERVICE_UNAVAILABLE, r#"{"status":"draining"}"#);
    }
    if app.shutdown.is_cancelled() {
        return json(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"status":"shutting_down"}"#,
        );
    }
    // Ready means a request can be routed: a routable worker that serves at least one model
    // (configured, or already discovered from its /v1/models). Before discovery finishes, every
    // request would get 404 model_not_found, so a load balancer must not send traffic yet.
    let fleet = app.fleet.registry.snapshot();
    let now = crate::clock::now();
    if fleet
        .workers
        .iter()
        .any(|w| !w.models.is_empty() && w.state.routable(now))
    {
        json(StatusCode::OK, r#"{"status":"ready"}"#)
    } else {
        json(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"status":"no_routable_worker"}"#,
        )
    }
}

fn json(status: StatusCode, body: &'static str) -> Response<GwBody> {
    let mut r = Response::new(GwBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}
