//! `GET /metrics`: Prometheus text format 0.0.4.

use http::{header, HeaderValue, Response};

use crate::body::GwBody;
use crate::state::AppState;

pub fn render(app: &AppState) -> Response<GwBody> {
    app.refresh_gauges();
    app.fleet.export_monitors();
    let mut r = Response::new(GwBody::full(app.metrics.render()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}
