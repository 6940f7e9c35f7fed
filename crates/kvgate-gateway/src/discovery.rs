//! Model discovery: workers configured without a `models` list are asked `GET /v1/models`
//! periodically; a change rebuilds the fleet snapshot (new pools appear, gone ones 404).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};

use crate::metrics::Lbl;
use crate::registry::Worker;
use crate::state::AppState;
use kvgate_http::client;

/// One discovery round over every worker without configured models. Returns whether any changed.
pub async fn refresh_once(app: &Arc<AppState>) -> bool {
    let fleet = app.registry.load_full();
    let mut tasks = Vec::new();
    for w in fleet.workers.iter().filter(|w| w.cfg.models.is_empty()) {
        let app = app.clone();
        let w = w.clone();
        tasks.push(tokio::spawn(async move {
            let models = fetch_models(&app, &w).await;
            (w, models)
        }));
    }
    let mut changed = false;
    for t in tasks {
        let Ok((w, models)) = t.await else { continue };
        match models {
            Ok(models) => {
                let mut cur = w.state.discovered_models.lock();
                if *cur != models {
                    tracing::info!(worker = %w.name, ?models, "discovered models");
                    *cur = models;
                    changed = true;
                }
            }
            Err(e) => tracing::warn!(worker = %w.name, error = %e, "model discovery failed"),
        }
    }
    if changed {
        match app.registry.refresh() {
            Ok(r) => app.apply_rebuild(&r),
            Err(e) => tracing::warn!(error = %e, "fleet rebuild after discovery failed"),
        }
    }
    changed
}

async fn fetch_models(app: &AppState, w: &Worker) -> anyhow::Result<Vec<Lbl>> {
    /// A models list larger than this is not one.
    const MAX_BODY: usize = 4 << 20;
    let headers = http::HeaderMap::new();
    let empty = Bytes::new();
    let path = format!("{}/v1/models", w.path_prefix);
    let req = client::Outgoing {
        https: w.scheme == http::uri::Scheme::HTTPS,
        method: &http::Method::GET,
        authority: &w.authority,
        path_prefix: "",
        path_and_query: &path,
        headers: &headers,
        strip_client_auth: false,
        worker_auth: w.auth_header.as_ref(),
        body: &empty,
    };
    let fetch = async {
        let resp = client::send(&req, &app.upstream, &app.control_pool).await?;
        if !resp.status.is_success() {
            anyhow::bail!("GET /v1/models answered {}", resp.status);
        }
        let body = Limited::new(resp.body, MAX_BODY)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading the models list: {e}"))?;
        Ok(body.to_bytes())
    };
    let body = tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .map_err(|_| anyhow::anyhow!("GET /v1/models: no answer within 5 s"))??;
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Item>,
    }
    #[derive(serde::Deserialize)]
    struct Item {
        id: String,
    }
    let list: List = serde_json::from_slice(&body)?;
    let mut ids: Vec<Lbl> = list.data.into_iter().map(|i| Lbl::from(i.id)).collect();
    ids.sort();
    ids.dedup();
    Ok(ids)
}

/// Re-run discovery every `every` until shutdown.
pub async fn run(app: Arc<AppState>, every: Duration) {
    let mut tick = tokio::time::interval(every.max(Duration::from_secs(1)));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = app.shutdown.cancelled() => return,
            _ = tick.tick() => { refresh_once(&app).await; }
        }
    }
}
