//! A small pooled HTTP/1 client for scrapes, probes and event polls (hyper-util legacy client).
//! Every call carries its own deadline: a stalled worker costs one timeout, never a stuck task.

use bytes::Bytes;
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// Scrape bodies larger than this are refused (a vLLM `/metrics` with many LoRAs is ~200 KB).
const MAX_BODY: usize = 8 << 20;

/// The Accept header for Prometheus text: prometheus_client rewrites `vllm:` to `vllm_` in
/// OpenMetrics mode, so ask for the classic format explicitly.
pub const ACCEPT_PROM: &str = "text/plain;version=0.0.4";

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("invalid URL {0:?}")]
    Url(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("request failed: {0}")]
    Request(String),
    #[error("body exceeds {MAX_BODY} bytes or broke off: {0}")]
    Body(String),
}

/// A response, fully read.
#[derive(Debug, Clone)]
pub struct Fetched {
    pub status: StatusCode,
    pub body: Bytes,
}

#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    pub fn new() -> Self {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(Duration::from_secs(2)));
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(2)
            .build(conn);
        HttpClient { inner }
    }

    /// `GET base + path` with `accept`, within `timeout` (connect, headers and body together).
    pub async fn get(
        &self,
        base: &str,
        path: &str,
        accept: &str,
        timeout: Duration,
    ) -> Result<Fetched, HttpError> {
        self.send(Method::GET, base, path, accept, Bytes::new(), timeout)
            .await
    }

    /// `POST base + path` with a JSON body.
    pub async fn post_json(
        &self,
        base: &str,
        path: &str,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Fetched, HttpError> {
        self.send(Method::POST, base, path, "application/json", body, timeout)
            .await
    }

    async fn send(
        &self,
        method: Method,
        base: &str,
        path: &str,
        accept: &str,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Fetched, HttpError> {
        let url = join(base, path);
        let uri: Uri = url.parse().map_err(|_| HttpError::Url(url.clone()))?;
        let mut req = Request::builder()
            .method(method.clone())
            .uri(uri)
            .header(header::ACCEPT, accept);
        if method == Method::POST {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| HttpError::Url(e.to_string()))?;
        let fut = async {
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| HttpError::Request(e.to_string()))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| HttpError::Body(e.to_string()))?
                .to_bytes();
            Ok(Fetched { status, body })
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| HttpError::Timeout(timeout))?
    }
}

/// `http://h:p` + `/metrics`, tolerating a trailing slash or a `/v1` suffix on the base.
pub fn join(base: &str, path: &str) -> String {
    let b = base.trim_end_matches('/');
    let b = b.strip_suffix("/v1").unwrap_or(b);
    format!("{b}{path}")
}

/// The host part of a base URL (`http://10.0.0.7:8000/v1` → `10.0.0.7`), for substituting `*` in
/// advertised ZMQ endpoints.
pub fn host_of(base: &str) -> Option<String> {
    let uri: Uri = base.parse().ok()?;
    uri.host()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_and_extracts_hosts() {
        assert_eq!(join("http://a:1/", "/metrics"), "http://a:1/metrics");
        assert_eq!(join("http://a:1/v1", "/health"), "http://a:1/health");
        assert_eq!(
            host_of("http://10.0.0.7:8000/v1").as_deref(),
            Some("10.0.0.7")
        );
        assert_eq!(host_of("http://[::1]:8000").as_deref(), Some("::1"));
        assert_eq!(host_of("not a url"), None);
    }
}
