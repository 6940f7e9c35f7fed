//! The proxy hop's settings: the client to workers, its time limits, the retry budget.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_http::client;

use crate::config::{RetryConfig, UpstreamConfig};
use crate::metrics::Metrics;

/// The proxy hop, from `[upstream]` and `[retry]`: how the gateway talks to workers.
pub struct Upstream {
    /// Settings of the client to workers (requests, model discovery, monitors' TLS).
    pub client: client::Settings,
    /// Connections of the control plane's requests to workers (model discovery), on the main
    /// runtime; the data path uses its io thread's pool.
    pub control_pool: client::Pool,
    /// Time to the worker's response head, any request (`upstream.response_timeout_s`).
    pub response_timeout: Duration,
    /// Non-streaming: the whole response (`upstream.request_timeout_s`).
    pub request_timeout: Duration,
    /// Streaming: head and first body byte (`upstream.stream_first_byte_timeout_s`).
    pub first_byte_timeout: Duration,
    /// Longest silence inside a response body (`upstream.stream_idle_timeout_s`, 0 = none).
    pub stream_idle_timeout: Option<Duration>,
    pub retry: RetryBudget,
    /// `retry.max_attempts` (reloadable).
    pub max_attempts: AtomicU32,
}

impl Upstream {
    pub fn new(
        cfg: &UpstreamConfig,
        retry: &RetryConfig,
        tls: Option<client::Tls>,
        metrics: &Metrics,
    ) -> Upstream {
        Upstream {
            client: client::Settings {
                connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
                idle_timeout: Duration::from_secs(cfg.pool_idle_timeout_s),
                max_idle_per_host: cfg.pool_max_idle_per_host,
                on_connect: Some({
                    let h = metrics.upstream_connect.clone();
                    Arc::new(move |d: Duration| h.observe(d.as_secs_f64()))
                }),
                on_stray: Some({
                    let c = metrics.upstream_stray.clone();
                    Arc::new(move |_: &http::uri::Authority| {
                        c.inc();
                    })
                }),
                tls,
            },
            control_pool: client::Pool::default(),
            response_timeout: Duration::from_secs(cfg.response_timeout_s),
            request_timeout: Duration::from_secs(cfg.request_timeout_s),
            first_byte_timeout: Duration::from_secs(cfg.stream_first_byte_timeout_s),
            stream_idle_timeout: (cfg.stream_idle_timeout_s > 0)
                .then(|| Duration::from_secs(cfg.stream_idle_timeout_s)),
            retry: RetryBudget::new(retry.budget_ratio, retry.budget_min_per_window),
            max_attempts: AtomicU32::new(retry.max_attempts),
        }
    }

    /// Apply a reloaded `[retry]` (the client settings and time limits need a restart).
    pub fn apply_retry(&self, retry: &RetryConfig) {
        self.retry
            .ratio_milli
            .store((retry.budget_ratio * 1000.0) as u32, Ordering::Relaxed);
        self.retry
            .min
            .store(retry.budget_min_per_window, Ordering::Relaxed);
        self.max_attempts
            .store(retry.max_attempts, Ordering::Relaxed);
    }
}

/// Retries may add at most `ratio` × requests (plus `min` per window) over a 10 s window, so a
/// failing fleet is not hit by a retry storm on top of the load.
pub struct RetryBudget {
    /// When the current window ends: an `Instant` compared with the request's (no subtraction
    /// per request); the lock is held for the comparison and, at a window's end, the reset.
    window_end: parking_lot::Mutex<Instant>,
    requests: AtomicU32,
    retries: AtomicU32,
    pub ratio_milli: AtomicU32,
    pub min: AtomicU32,
}

const WINDOW: Duration = Duration::from_secs(10);

impl RetryBudget {
    pub fn new(ratio: f64, min: u32) -> Self {
        RetryBudget {
            window_end: parking_lot::Mutex::new(crate::clock::now() + WINDOW),
            requests: AtomicU32::new(0),
            retries: AtomicU32::new(0),
            ratio_milli: AtomicU32::new((ratio * 1000.0) as u32),
            min: AtomicU32::new(min),
        }
    }

    /// A new window starts at `now` once the current one is over.
    fn roll(&self, now: Instant) {
        let mut end = self.window_end.lock();
        if now >= *end {
            *end = now + WINDOW;
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
    use std::time::Duration;

    #[test]
    fn retry_budget_bounds_retries() {
        let b = RetryBudget::new(0.5, 1);
        let t = crate::clock::now();
        for _ in 0..4 {
            b.on_request(t);
        }
        assert!(b.try_retry(t));
        assert!(b.try_retry(t));
        assert!(b.try_retry(t));
        assert!(!b.try_retry(t), "4 requests × 0.5 + 1 = 3 retries");
        assert!(b.try_retry(t + WINDOW + Duration::from_millis(1)));
    }
}
