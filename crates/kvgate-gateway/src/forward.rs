//! The retry budget of the request path.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

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
    use std::time::Duration;

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
