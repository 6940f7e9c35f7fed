//! `GET /v1/models`: the models (and aliases) served by at least one worker, in OpenAI list shape.

use std::time::UNIX_EPOCH;

use http::{header, HeaderValue, Request, Response};

use crate::body::GwBody;
use crate::state::AppState;

pub fn list<B>(app: &AppState, req: &Request<B>) -> Response<GwBody> {
    if let Err(e) = app.auth.load().check(req.headers(), crate::clock::now()) {
        app.metrics.error(e.label());
        return e.into_response();
    }
    let fleet = app.fleet.registry.snapshot();
    let created = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut names: Vec<&str> = fleet.pools.keys().map(|k| &**k).collect();
    names.sort_unstable();
    let data: Vec<serde_json::Value> = names
        .into_iter()
        .map(|id| {
            let pool = &fleet.pools[id];
            serde_json::json!({
                "id": id,
                "object": "model",
                "created": created,
                "owned_by": "kvgate",
                "root": &*pool.model,
                "workers": pool.workers.len(),
            })
        })
        .collect();
    let body = serde_json::to_vec(&serde_json::json!({ "object": "list", "data": data }))
        .unwrap_or_default();
    let mut r = Response::new(GwBody::full(body));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}
