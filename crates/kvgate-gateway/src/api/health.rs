//! `GET /health` (the process is alive) and `GET /ready` (at least one routable worker).

use http::{header, HeaderValue, Response, StatusCode};

use crate::body::GwBody;
use crate::state::AppState;

pub fn live() -> Response<GwBody> {
    json(StatusCode::OK, r#"{"status":"ok"}"#)
}

pub fn ready(app: &AppState) -> Response<GwBody> {
    if app.shutdown.is_cancelled() {
        return json(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"status":"shutting_down"}"#,
        );
    }
    if app.registry.snapshot().any_routable() {
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
