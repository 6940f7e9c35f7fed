//! Per-worker circuit breaker, fed by health probes and by request outcomes: the gateway shares one
//! `Arc<Breaker>` per worker between its request path and the worker's monitor
//! ([`crate::WorkerMonitor::spawn_with_breaker`]), so both kinds of failure count in one run.
//!
//! Closed → (N consecutive failures) → Open → (after `open_for`) → HalfOpen: one probe (a health check
//! or one request) is let through; its success closes the breaker, its failure re-opens it. Time is
//! passed in (`Instant`), so the state machine is tested without sleeping.

use parking_lot::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker.
    pub failure_threshold: u32,
    /// How long an open breaker refuses traffic before a half-open probe.
    pub open_for: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            open_for: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    failures: u32,
    opened_at: Option<Instant>,
    probe_in_flight: bool,
    /// Times the breaker opened (for a counter).
    opens: u64,
}

/// Thread-safe breaker; cheap to consult on the hot path (one uncontended mutex).
#[derive(Debug)]
pub struct Breaker {
    cfg: BreakerConfig,
    inner: Mutex<Inner>,
}

impl Breaker {
    pub fn new(cfg: BreakerConfig) -> Self {
        let inner = Inner {
            state: BreakerState::Closed,
            failures: 0,
            opened_at: None,
            probe_in_flight: false,
            opens: 0,
        };
        Breaker {
            cfg,
            inner: Mutex::new(inner),
        }
    }

    pub fn state(&self) -> BreakerState {
        self.inner.lock().state
    }

    /// The state as routing sees it at `now`: an open breaker whose cool-down has passed reports
    /// `HalfOpen` (traffic may probe it), even before a probe took the slot.
    pub fn state_at(&self, now: Instant) -> BreakerState {
        let g = self.inner.lock();
        match g.state {
            BreakerState::Open if g.opened_at.is_some_and(|t| now >= t + self.cfg.open_for) => {
                BreakerState::HalfOpen
            }
            s => s,
        }
    }

    pub fn config(&self) -> BreakerConfig {
        self.cfg
    }

    /// Times the breaker has opened.
    pub fn opens(&self) -> u64 {
        self.inner.lock().opens
    }

    /// Whether routing may consider this worker now (without taking the probe slot).
    pub fn is_available(&self, now: Instant) -> bool {
        let g = self.inner.lock();
        match g.state {
            BreakerState::Closed => true,
            BreakerState::Open => g.opened_at.is_some_and(|t| now >= t + self.cfg.open_for),
            BreakerState::HalfOpen => !g.probe_in_flight,
        }
    }

    /// Asks to send one request or probe. Closed: yes. Open past `open_for`: becomes half-open and
    /// grants the single probe slot. Half-open with the probe out, or open: no.
    pub fn try_acquire(&self, now: Instant) -> bool {
        let mut g = self.inner.lock();
        match g.state {
            BreakerState::Closed => true,
            BreakerState::Open => {
                if g.opened_at.is_some_and(|t| now >= t + self.cfg.open_for) {
                    g.state = BreakerState::HalfOpen;
                    g.probe_in_flight = true;
                    true
                } else {
                    false
                }
            }
            BreakerState::HalfOpen => {
                if g.probe_in_flight {
                    false
                } else {
                    g.probe_in_flight = true;
                    true
                }
            }
        }
    }

    /// A request or probe succeeded: the breaker closes and the failure run resets.
    /// Returns true if this closed a non-closed breaker.
    pub fn record_success(&self) -> bool {
        let mut g = self.inner.lock();
        let was = g.state;
        g.state = BreakerState::Closed;
        g.failures = 0;
        g.opened_at = None;
        g.probe_in_flight = false;
        was != BreakerState::Closed
    }

    /// A request or probe failed. Returns true if this opened the breaker.
    pub fn record_failure(&self, now: Instant) -> bool {
        let mut g = self.inner.lock();
        g.failures = g.failures.saturating_add(1);
        g.probe_in_flight = false;
        let open = match g.state {
            BreakerState::Closed => g.failures >= self.cfg.failure_threshold.max(1),
            BreakerState::HalfOpen => true,
            // Still open: restart the cool-down so a flapping worker stays out.
            BreakerState::Open => {
                g.opened_at = Some(now);
                false
            }
        };
        if open {
            g.state = BreakerState::Open;
            g.opened_at = Some(now);
            g.opens += 1;
        }
        open
    }

    /// A granted probe was abandoned (cancelled before an outcome): free the slot.
    pub fn release_probe(&self) {
        self.inner.lock().probe_in_flight = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b() -> Breaker {
        Breaker::new(BreakerConfig {
            failure_threshold: 3,
            open_for: Duration::from_secs(5),
        })
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = b();
        let t = Instant::now();
        assert!(!b.record_failure(t));
        assert!(!b.record_failure(t));
        b.record_success(); // the run is broken
        assert!(!b.record_failure(t));
        assert!(!b.record_failure(t));
        assert!(b.record_failure(t));
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.try_acquire(t + Duration::from_secs(1)));
        assert!(!b.is_available(t + Duration::from_secs(4)));
        assert_eq!(b.opens(), 1);
    }

    #[test]
    fn half_open_allows_one_probe_and_its_outcome_decides() {
        let b = b();
        let t = Instant::now();
        (0..3).for_each(|_| {
            b.record_failure(t);
        });
        let later = t + Duration::from_secs(5);
        assert!(b.is_available(later));
        assert!(b.try_acquire(later));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(!b.try_acquire(later), "only one probe at a time");
        assert!(b.record_failure(later), "a failed probe re-opens");
        assert!(!b.try_acquire(later + Duration::from_secs(4)));
        assert!(b.try_acquire(later + Duration::from_secs(5)));
        assert!(b.record_success());
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.try_acquire(later));
    }

    #[test]
    fn state_at_reports_half_open_once_the_cool_down_passed() {
        let b = b();
        let t = Instant::now();
        (0..3).for_each(|_| {
            b.record_failure(t);
        });
        assert_eq!(b.state_at(t + Duration::from_secs(4)), BreakerState::Open);
        assert_eq!(
            b.state_at(t + Duration::from_secs(5)),
            BreakerState::HalfOpen
        );
        assert_eq!(b.state(), BreakerState::Open, "no probe slot taken");
    }

    #[test]
    fn abandoned_probe_frees_the_slot() {
        let b = b();
        let t = Instant::now();
        (0..3).for_each(|_| {
            b.record_failure(t);
        });
        let later = t + Duration::from_secs(6);
        assert!(b.try_acquire(later));
        b.release_probe();
        assert!(b.try_acquire(later));
    }
}
