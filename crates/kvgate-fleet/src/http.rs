//! Scrapes, probes and event polls: whole-body requests over kvgate-http's client's
//! keep-alive pool. Every call carries its own deadline: a stalled worker costs one timeout, never
//! a stuck task.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use http_body_util::{BodyExt, Limited};
use std::time::Duration;

use kvgate_http::client as h1;

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
    settings: h1::Settings,
    /// Its keep-alive connections (clones of a client share them).
    pool: h1::Pool,
    /// `authorization` sent with every call (the worker's API key).
    auth: Option<HeaderValue>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    pub fn new() -> Self {
        HttpClient {
            pool: h1::Pool::default(),
            settings: h1::Settings {
                connect_timeout: Duration::from_secs(2),
                idle_timeout: Duration::from_secs(30),
                max_idle_per_host: 2,
                on_connect: None,
                on_stray: None,
                tls: None,
            },
            auth: None,
        }
    }

    /// Send this `authorization` value with every call (workers that guard every route).
    pub fn with_auth(mut self, auth: Option<HeaderValue>) -> Self {
        self.auth = auth;
        self
    }

    /// Trust these certificates for `https://` workers.
    pub fn with_tls(mut self, tls: Option<h1::Tls>) -> Self {
        self.settings.tls = tls;
        self
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
        let (Some(authority), Some(scheme @ ("http" | "https"))) =
            (uri.authority(), uri.scheme_str())
        else {
            return Err(HttpError::Url(url));
        };
        let mut headers = HeaderMap::new();
        let accept = HeaderValue::from_str(accept).map_err(|_| HttpError::Url(url.clone()))?;
        headers.insert(header::ACCEPT, accept);
        if method == Method::POST {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        let req = h1::Outgoing {
            https: scheme == "https",
            method: &method,
            authority,
            path_prefix: "",
            path_and_query: uri.path_and_query().map_or("/", |p| p.as_str()),
            headers: &headers,
            strip_client_auth: false,
            worker_auth: self.auth.as_ref(),
            traceparent: None,
            body: &body,
        };
        let fut = async {
            let resp = h1::send(&req, &self.settings, &self.pool)
                .await
                .map_err(|e| HttpError::Request(e.to_string()))?;
            let body = Limited::new(resp.body, MAX_BODY)
                .collect()
                .await
                .map_err(|e| HttpError::Body(e.to_string()))?
                .to_bytes();
            Ok(Fetched {
                status: resp.status,
                body,
            })
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

    #[tokio::test]
    async fn calls_carry_the_worker_key() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", l.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "request head incomplete");
                head.extend_from_slice(&buf[..n]);
            }
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
            String::from_utf8(head).unwrap()
        });
        let c = HttpClient::new().with_auth(Some(HeaderValue::from_static("Bearer wk")));
        let r = c
            .get(&base, "/health", "*/*", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(r.status, StatusCode::OK);
        let head = server.await.unwrap();
        assert!(head.starts_with("GET /health HTTP/1.1\r\n"), "{head}");
        assert!(head.contains("\r\nauthorization: Bearer wk\r\n"), "{head}");
        assert!(
            !head.contains("content-length"),
            "no body, no length: {head}"
        );
    }
}
