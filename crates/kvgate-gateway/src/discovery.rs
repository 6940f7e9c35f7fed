//! Model discovery: workers configured without a `models` list are asked `GET /v1/models`
//! periodically (by `fleet::WorkerFleet`); a change rebuilds the fleet snapshot (new pools
//! appear, gone ones 404).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};

use crate::forward::Upstream;
use crate::metrics::Lbl;
use crate::registry::{Rebuilt, Registry, Worker};
use kvgate_http::client;

/// One discovery round over every worker without configured models, all asked at once. `None`
/// when no worker's list changed, else the registry's rebuild for the caller to apply.
pub async fn refresh_once(
    registry: &Registry,
    upstream: &Arc<Upstream>,
) -> Option<anyhow::Result<Rebuilt>> {
    let fleet = registry.load_full();
    let mut tasks = Vec::new();
    for w in fleet.workers.iter().filter(|w| w.cfg.models.is_empty()) {
        let upstream = upstream.clone();
        let w = w.clone();
        tasks.push(tokio::spawn(async move {
            let models = fetch_models(&upstream, &w).await;
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
    changed.then(|| registry.refresh())
}

async fn fetch_models(upstream: &Upstream, w: &Worker) -> anyhow::Result<Vec<Lbl>> {
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
        traceparent: None,
        body: &empty,
    };
    let fetch = async {
        let resp = client::send(&req, &upstream.client, &upstream.control_pool).await?;
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
