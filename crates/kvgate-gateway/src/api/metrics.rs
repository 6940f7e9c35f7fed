//! `GET /metrics`: Prometheus text format 0.0.4, or OpenMetrics 1.0.0 (with the latency
//! histograms' exemplars: trace ids) when the scraper accepts `application/openmetrics-text`.

use http::{header, HeaderValue, Response};

use crate::body::GwBody;
use crate::state::AppState;

pub fn render(app: &AppState, headers: &http::HeaderMap) -> Response<GwBody> {
    app.refresh_gauges();
    app.fleet.export_monitors();
    let (body, content_type) = if wants_openmetrics(headers) {
        (
            app.metrics.render_openmetrics(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
    } else {
        (
            app.metrics.render(),
            "text/plain; version=0.0.4; charset=utf-8",
        )
    };
    let mut r = Response::new(GwBody::full(body));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// The scraper lists `application/openmetrics-text` in `Accept` (Prometheus does, first, when
/// exemplar storage is on or by default in its negotiation) and has not refused it with `q=0`.
fn wants_openmetrics(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let mut parts = item.split(';').map(str::trim);
            let is_om = parts
                .next()
                .is_some_and(|t| t.eq_ignore_ascii_case("application/openmetrics-text"));
            let refused = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f64>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            is_om && !refused
        })
}

#[cfg(test)]
mod tests {
    use super::wants_openmetrics;

    #[test]
    fn openmetrics_only_when_accepted() {
        let h = |v: &str| {
            let mut m = http::HeaderMap::new();
            m.insert(http::header::ACCEPT, v.parse().unwrap());
            m
        };
        assert!(wants_openmetrics(&h(
            "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
        )));
        assert!(!wants_openmetrics(&h("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(&h("application/openmetrics-text;q=0")));
        assert!(!wants_openmetrics(&http::HeaderMap::new()));
    }
}
