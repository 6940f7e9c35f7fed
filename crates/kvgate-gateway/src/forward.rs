//! The hyper-util client for the gateway's own calls to workers (model discovery; the data path
//! uses [`crate::upstream`]), with a connector that times TCP connects, and the retry budget.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prometheus_client::metrics::histogram::Histogram;
use tower::Service;

use crate::body::UpstreamBody;
use crate::config::UpstreamConfig;

pub type UpstreamClient = Client<TimedConnector, UpstreamBody>;

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
