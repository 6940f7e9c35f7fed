//! Per-worker circuit breaker, fed by health probes and by request outcomes: the gateway shares one
//! `Arc<Breaker>` per worker between its request path and the worker's monitor
//! ([`crate::WorkerMonitor::spawn_with_breaker`]), so both kinds of failure count in one run.
//!
//! Closed → (N consecutive failures) → Open → (after `open_for`) → HalfOpen: one probe (a health check
//! or one request) is let through; its success closes the breaker, its failure re-opens it. Time is
//! passed in (`Instant`), so the state machine is tested without sleeping.
//!
//! Health probes and requests are told apart once the breaker is open (issue 16: after a full
//! outage the workers were back in ~1 s but stayed unroutable for ~9 s, because every failed probe
//! during the outage restarted the cool-down and the first good probe then had to wait it out):
//! - a failed health probe marks the worker *down* without restarting the cool-down; while it is
//!   down, no request is let through even after the cool-down (the health checker is the probe,
//!   so traffic never flaps onto a worker that is still unreachable);
//! - a successful health probe of a down worker closes the breaker at once: the outage it saw is
//!   over. A breaker opened by failing *requests* while `/health` kept answering is not closed by
//!   a good `/health` before its cool-down (it says nothing about the failing requests);
//! - a failed request on an open breaker restarts the cool-down (a flapping worker stays out).

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
    /// The last health probe failed (cleared by a good probe or a successful request).
    down: bool,
    /// Times the breaker opened (for a counter).
    opens: u64,
    /// Opened by another gateway replica's verdict (cluster mode), not by our own outcomes.
    by_peer: bool,
}

impl Inner {
    fn cooled(&self, now: Instant, open_for: Duration) -> bool {
        self.opened_at.is_some_and(|t| now >= t + open_for)
    }
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
            down: false,
            opens: 0,
            by_peer: false,
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
    /// `HalfOpen` (traffic may probe it), even before a probe took the slot, unless its last
    /// health probe failed (then it stays `Open` until a probe succeeds).
    pub fn state_at(&self, now: Instant) -> BreakerState {
        let g = self.inner.lock();
        match g.state {
            BreakerState::Open if !g.down && g.cooled(now, self.cfg.open_for) => {
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
            BreakerState::Open => !g.down && g.cooled(now, self.cfg.open_for),
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
                if !g.down && g.cooled(now, self.cfg.open_for) {
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
        g.down = false;
        g.by_peer = false;
        was != BreakerState::Closed
    }

    /// A health probe succeeded. Closed: nothing changes (a good `/health` says nothing about
    /// failing requests, so it must not break their run). Open or half-open: closes if the last
    /// probe had failed (the worker was unreachable and answers again) or the cool-down passed.
    /// Returns true if this closed the breaker.
    pub fn record_probe_success(&self, now: Instant) -> bool {
        let mut g = self.inner.lock();
        let close = match g.state {
            BreakerState::Closed => false,
            BreakerState::Open | BreakerState::HalfOpen => {
                g.down || g.cooled(now, self.cfg.open_for)
            }
        };
        g.down = false;
        if close {
            g.state = BreakerState::Closed;
            g.failures = 0;
            g.opened_at = None;
            g.probe_in_flight = false;
        }
        close
    }

    /// A health probe failed: it counts in the run of failures like a failed request, marks the
    /// worker down (no request probes it until a health probe succeeds), and — unlike a failed
    /// request — leaves an open breaker's cool-down where it is. Returns true if this opened it.
    pub fn record_probe_failure(&self, now: Instant) -> bool {
        let mut g = self.inner.lock();
        g.down = true;
        match g.state {
            BreakerState::Open => {
                g.failures = g.failures.saturating_add(1);
                false
            }
            BreakerState::Closed | BreakerState::HalfOpen => {
                drop(g);
                self.record_failure(now)
            }
        }
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
            g.by_peer = false;
        }
        open
    }

    /// Another replica opened its breaker for this worker (cluster mode): open ours too, with our
    /// own cool-down (then a half-open probe decides here as usual). Returns true if this opened it.
    pub fn open_by_peer(&self, now: Instant) -> bool {
        let mut g = self.inner.lock();
        if g.state != BreakerState::Closed {
            return false;
        }
        g.state = BreakerState::Open;
        g.opened_at = Some(now);
        g.opens += 1;
        g.by_peer = true;
        true
    }

    /// Another replica closed its breaker: close ours if it is open on a peer's word only, or open
    /// without a failed health probe here. Returns true if this closed it.
    pub fn close_by_peer(&self) -> bool {
        let mut g = self.inner.lock();
        if g.state == BreakerState::Closed || g.down {
            return false;
        }
        g.state = BreakerState::Closed;
        g.failures = 0;
        g.opened_at = None;
        g.probe_in_flight = false;
        g.by_peer = false;
        true
    }

    /// Whether the breaker is open on a peer's verdict (not re-published as our own).
    pub fn opened_by_peer(&self) -> bool {
        self.inner.lock().by_peer
    }

    /// A granted probe was abandoned (cancelled before an outcome): free the slot.
    pub fn release_probe(&self) {
        self.inner.lock().probe_in_flight = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_verdict_opens_and_closes_but_not_over_a_failed_probe() {
        let t = Instant::now();
        let br = b();
        assert!(br.open_by_peer(t));
        assert!(br.opened_by_peer());
        assert_eq!(br.state_at(t), BreakerState::Open);
        assert!(!br.open_by_peer(t), "already open");
        // Our own cool-down applies: half-open after open_for, like a breaker we opened.
        assert_eq!(
            br.state_at(t + Duration::from_secs(6)),
            BreakerState::HalfOpen
        );
        assert!(br.close_by_peer());
        assert_eq!(br.state(), BreakerState::Closed);
        assert!(!br.opened_by_peer());
        // Opened by our own failures: not "by peer"; a failed health probe here outweighs a
        // peer's "closed".
        for _ in 0..3 {
            br.record_failure(t);
        }
        assert!(!br.opened_by_peer());
        br.record_probe_failure(t);
        assert!(!br.close_by_peer());
        assert_eq!(br.state(), BreakerState::Open);
    }

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

    /// Issue 16: every worker down for a while, then back. Failed probes during the outage must
    /// not push the re-open out, nor let traffic in early; the first good probe closes at once.
    #[test]
    fn outage_probes_keep_traffic_out_and_the_first_good_probe_closes() {
        let b = b();
        let t = Instant::now();
        let s = |x: u64| t + Duration::from_millis(x);
        // Requests fail (connection refused) and open it; probes fail all through the outage.
        (0..3).for_each(|_| {
            b.record_failure(t);
        });
        for ms in (500..30_000).step_by(500) {
            assert!(!b.record_probe_failure(s(ms)), "already open");
            assert!(!b.is_available(s(ms)), "still down at {ms} ms: no traffic");
            assert_eq!(b.state_at(s(ms)), BreakerState::Open);
            assert!(!b.try_acquire(s(ms)), "no request probe while down");
        }
        // The worker answers again, long after the cool-down and 0.5 s after the last failed probe.
        assert!(b.record_probe_success(s(30_000)));
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.is_available(s(30_000)));
        // A second success is no news.
        assert!(!b.record_probe_success(s(30_500)));
    }

    #[test]
    fn a_good_probe_soon_after_the_outage_began_closes_too() {
        let b = b();
        let t = Instant::now();
        (0..3).for_each(|_| {
            b.record_failure(t);
        });
        b.record_probe_failure(t + Duration::from_millis(100));
        // Well inside the cool-down: the worker was unreachable and answers now.
        assert!(b.record_probe_success(t + Duration::from_millis(600)));
        assert!(b.is_available(t + Duration::from_millis(600)));
    }

    #[test]
    fn failing_requests_with_a_healthy_endpoint_wait_out_the_cool_down() {
        let b = b();
        let t = Instant::now();
        (0..3).for_each(|_| {
            b.record_failure(t);
        });
        // `/health` answers but requests failed: no early close.
        assert!(!b.record_probe_success(t + Duration::from_secs(1)));
        assert!(!b.is_available(t + Duration::from_secs(1)));
        assert_eq!(b.state(), BreakerState::Open);
        // After the cool-down a good probe closes it, as before.
        assert!(b.record_probe_success(t + Duration::from_secs(5)));
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn probe_failures_count_in_the_run_and_a_good_probe_does_not_reset_it() {
        let b = b();
        let t = Instant::now();
        assert!(!b.record_failure(t));
        assert!(!b.record_probe_success(t), "closed: nothing to close");
        assert!(!b.record_probe_failure(t));
        assert!(
            b.record_failure(t),
            "1 request + 1 probe + 1 request = 3 in a row"
        );
        // Opened with the last probe failed: down, so no request probe after the cool-down either.
        assert!(!b.is_available(t + Duration::from_secs(60)));
        assert!(b.record_probe_success(t + Duration::from_secs(60)));
    }

    #[test]
    fn a_request_failure_on_an_open_breaker_restarts_the_cool_down_a_probe_failure_does_not() {
        let b = b();
        let t = Instant::now();
        (0..3).for_each(|_| {
            b.record_failure(t);
        });
        // Routed after the cool-down (half-open as routing sees it), and failed again.
        let later = t + Duration::from_secs(5);
        assert!(b.is_available(later));
        b.record_failure(later);
        assert!(!b.is_available(later + Duration::from_secs(4)));
        assert!(b.is_available(later + Duration::from_secs(5)));
        // A request success clears everything, including a down mark.
        b.record_probe_failure(later + Duration::from_secs(5));
        assert!(!b.is_available(later + Duration::from_secs(20)));
        assert!(b.record_success());
        assert!(b.is_available(later + Duration::from_secs(20)));
    }
}
