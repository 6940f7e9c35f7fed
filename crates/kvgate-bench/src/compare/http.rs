//! Tiny one-shot HTTP helpers for control calls (health, /metrics, /reset_prefix_cache).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

async fn call(method: http::Method, url: &str) -> anyhow::Result<(http::StatusCode, Bytes)> {
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header(http::header::ACCEPT, "text/plain;version=0.0.4")
        .body(Full::new(Bytes::new()))?;
    let fut = async {
        let resp = client.request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        anyhow::Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .map_err(|_| anyhow::anyhow!("{url}: timed out"))?
}

pub async fn get(url: &str) -> anyhow::Result<(http::StatusCode, Bytes)> {
    call(http::Method::GET, url).await
}

pub async fn post(url: &str) -> anyhow::Result<(http::StatusCode, Bytes)> {
    call(http::Method::POST, url).await
}
