//! Model discovery: workers configured without a `models` list are asked `GET /v1/models`
//! periodically; a change rebuilds the fleet snapshot (new pools appear, gone ones 404).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;

use crate::metrics::Lbl;
use crate::registry::Worker;
use crate::state::AppState;

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
    let uri = format!("{}://{}{}/v1/models", w.scheme, w.authority, w.path_prefix);
    let mut req = Request::get(uri).body(http_body_util::Full::new(Bytes::new()))?;
    if let Some(a) = &w.auth_header {
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, a.clone());
    }
    let resp = tokio::time::timeout(Duration::from_secs(5), app.client.request(req)).await??;
    if !resp.status().is_success() {
        anyhow::bail!("GET /v1/models answered {}", resp.status());
    }
    let body = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
        .await??
        .to_bytes();
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
