//! Forwarding to workers: the pooled hyper-util client (with a connector that times TCP connects),
//! building the upstream request from the client's (the body bytes are the client's, unchanged),
//! hop-by-hop header stripping, and the retry budget.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;
use prometheus_client::metrics::histogram::Histogram;
use tower::Service;

use crate::body::UpstreamBody;
use crate::config::UpstreamConfig;
use crate::registry::Worker;
use crate::state::AppState;

pub type UpstreamClient = Client<TimedConnector, UpstreamBody>;

thread_local! {
    /// This io thread's own pool, for the gateway it was installed for (`Weak` keeps the address
    /// from being reused by another gateway in the same process, e.g. in tests).
    static THREAD_CLIENT: RefCell<Option<(Weak<AppState>, UpstreamClient)>> =
        const { RefCell::new(None) };
}

/// Give the current (io) thread its own worker connection pool: its connections' tasks then run
/// on this thread's runtime, next to the requests that use them.
pub fn install_thread_client(app: &Arc<AppState>) {
    let cfg = app.registry.config();
    let c = client(&cfg.upstream, app.metrics.upstream_connect.clone());
    THREAD_CLIENT.with(|t| *t.borrow_mut() = Some((Arc::downgrade(app), c)));
}

/// Send `req` through this thread's pool if it has one for `app`, else the shared one.
pub fn send(app: &Arc<AppState>, req: Request<UpstreamBody>) -> ResponseFuture {
    THREAD_CLIENT.with(|t| match &*t.borrow() {
        Some((w, c)) if std::ptr::eq(w.as_ptr(), Arc::as_ptr(app)) => c.request(req),
        _ => app.client.request(req),
    })
}

pub fn client(cfg: &UpstreamConfig, connect_hist: Histogram) -> UpstreamClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_millis(cfg.connect_timeout_ms)));
    http.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(cfg.pool_idle_timeout_s))
        .pool_max_idle_per_host(cfg.pool_max_idle_per_host)
        .pool_timer(hyper_util::rt::TokioTimer::new())
        // A request must never be re-sent to the same worker behind our back: retries are ours.
        .retry_canceled_requests(false)
        .build(TimedConnector {
            inner: http,
            hist: connect_hist,
        })
}

/// `HttpConnector` that records connect time in `kvgate_upstream_connect_seconds`.
#[derive(Clone)]
pub struct TimedConnector {
    inner: HttpConnector,
    hist: Histogram,
}

type ConnResult =
    Result<<HttpConnector as Service<Uri>>::Response, <HttpConnector as Service<Uri>>::Error>;

impl Service<Uri> for TimedConnector {
    type Response = <HttpConnector as Service<Uri>>::Response;
    type Error = <HttpConnector as Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = ConnResult> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let fut = self.inner.call(uri);
        let hist = self.hist.clone();
        // Boxed only per new connection (pooled connections skip the connector).
        Box::pin(async move {
            let t = Instant::now();
            let r = fut.await;
            if r.is_ok() {
                hist.observe(t.elapsed().as_secs_f64());
            }
            r
        })
    }
}

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1), plus `host` (set from the
/// worker URL by the client).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Remove hop-by-hop headers, including any named in `Connection`.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    if let Some(conn) = h.get(header::CONNECTION).cloned() {
        if let Ok(s) = conn.to_str() {
            for name in s.split(',') {
                if let Ok(n) = HeaderName::from_bytes(name.trim().as_bytes()) {
                    h.remove(n);
                }
            }
        }
    }
    for n in &HOP_BY_HOP {
        h.remove(n);
    }
    h.remove("proxy-connection");
}

/// The request to send to `worker`: same method, path and query, the client's headers minus
/// hop-by-hop ones, the worker's own credentials, and the client's body bytes unchanged.
pub fn upstream_request(
    worker: &Worker,
    parts: &http::request::Parts,
    body: &Bytes,
    strip_client_auth: bool,
) -> Result<Request<UpstreamBody>, http::Error> {
    let pq = parts.uri.path_and_query().cloned();
    let pq = if worker.path_prefix.is_empty() {
        pq.unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"))
    } else {
        let tail = pq.as_ref().map(|p| p.as_str()).unwrap_or("/");
        http::uri::PathAndQuery::try_from(format!("{}{}", worker.path_prefix, tail))?
    };
    let uri = Uri::builder()
        .scheme(worker.scheme.clone())
        .authority(worker.authority.clone())
        .path_and_query(pq)
        .build()?;
    let mut headers = parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    if strip_client_auth {
        headers.remove(header::AUTHORIZATION);
    }
    if let Some(a) = &worker.auth_header {
        headers.insert(header::AUTHORIZATION, a.clone());
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    let mut req = Request::new(http_body_util::Full::new(body.clone()));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    Ok(req)
}

/// Retries may add at most `ratio` × requests (plus `min` per window) over a 10 s window, so a
/// failing fleet is not hit by a retry storm on top of the load.
pub struct RetryBudget {
    window_start_ms: AtomicU64,
    requests: AtomicU32,
    retries: AtomicU32,
    epoch: Instant,
    pub ratio_milli: AtomicU32,
    pub min: AtomicU32,
}

const WINDOW_MS: u64 = 10_000;

impl RetryBudget {
    pub fn new(ratio: f64, min: u32) -> Self {
        RetryBudget {
            window_start_ms: AtomicU64::new(0),
            requests: AtomicU32::new(0),
            retries: AtomicU32::new(0),
            epoch: Instant::now(),
            ratio_milli: AtomicU32::new((ratio * 1000.0) as u32),
            min: AtomicU32::new(min),
        }
    }

    fn roll(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.epoch).as_millis() as u64;
        let start = self.window_start_ms.load(Ordering::Relaxed);
        if ms.saturating_sub(start) >= WINDOW_MS
            && self
                .window_start_ms
                .compare_exchange(start, ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.requests.store(0, Ordering::Relaxed);
            self.retries.store(0, Ordering::Relaxed);
        }
    }

    pub fn on_request(&self, now: Instant) {
        self.roll(now);
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Take one retry from the budget if available.
    pub fn try_retry(&self, now: Instant) -> bool {
        self.roll(now);
        let allowed = (self.requests.load(Ordering::Relaxed) as u64
            * self.ratio_milli.load(Ordering::Relaxed) as u64
            / 1000) as u32
            + self.min.load(Ordering::Relaxed);
        let used = self.retries.fetch_add(1, Ordering::Relaxed);
        if used < allowed {
            true
        } else {
            self.retries.fetch_sub(1, Ordering::Relaxed);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, x-secret-hop".parse().unwrap(),
        );
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert("x-custom", "stays".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["x-custom"], "stays");
    }

    #[test]
    fn retry_budget_bounds_retries() {
        let b = RetryBudget::new(0.5, 1);
        let t = Instant::now();
        for _ in 0..4 {
            b.on_request(t);
        }
        assert!(b.try_retry(t));
        assert!(b.try_retry(t));
        assert!(b.try_retry(t));
        assert!(!b.try_retry(t), "4 requests × 0.5 + 1 = 3 retries");
        assert!(b.try_retry(t + Duration::from_millis(WINDOW_MS + 1)));
    }
}
