//! Periodic health probe: feeds the worker's [`Breaker`], reports up/down transitions, and treats
//! "down, then up again" as a restart (the worker's KV cache is gone: its index entries are cleared
//! through the [`ResetBus`], so its KV-event subscribers rebuild and its endpoints are re-discovered).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_core::WorkerId;
use tokio_util::sync::CancellationToken;

use crate::breaker::{Breaker, BreakerState};
use crate::http::HttpClient;
use crate::reset::ResetBus;
use crate::sink::FleetSink;
use crate::stats::{inc, FleetStats};

pub(crate) struct HealthSettings {
    pub base: String,
    pub path: &'static str,
    pub interval: Duration,
    /// Probe period while the worker is down or its breaker is not closed: how soon a worker
    /// that answers again becomes routable.
    pub recovery_interval: Duration,
    pub timeout: Duration,
    /// Consecutive failed probes before the worker is reported down (one timeout is not an outage).
    pub down_after: u32,
    pub breaker: Arc<Breaker>,
    pub bus: Arc<ResetBus>,
}

/// The up/down state machine, separate from I/O so it can be tested directly.
#[derive(Debug, Default)]
pub(crate) struct HealthState {
    up: Option<bool>,
    failures: u32,
    was_up: bool,
    /// The first failed probe of the current run of failures: where an outage starts.
    failing_since: Option<Instant>,
}

/// What a probe result means.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Transition {
    pub report: Option<bool>,
    pub restarted: bool,
    /// A worker that had been up, then reported down, answers again: the time from the first
    /// failed probe of the outage to this probe (what MTTR averages).
    pub recovered_after: Option<Duration>,
}

impl HealthState {
    pub fn observe(&mut self, ok: bool, down_after: u32, now: Instant) -> Transition {
        let mut t = Transition {
            report: None,
            restarted: false,
            recovered_after: None,
        };
        if ok {
            self.failures = 0;
            let since = self.failing_since.take();
            if self.up != Some(true) {
                t.restarted = self.was_up && self.up == Some(false);
                if t.restarted {
                    t.recovered_after = since.map(|s| now.saturating_duration_since(s));
                }
                self.up = Some(true);
                self.was_up = true;
                t.report = Some(true);
            }
        } else {
            self.failures += 1;
            self.failing_since.get_or_insert(now);
            let down = self.failures >= down_after.max(1) || self.up.is_none();
            if down && self.up != Some(false) {
                self.up = Some(false);
                t.report = Some(false);
            }
        }
        t
    }
}

pub(crate) async fn run(
    worker: WorkerId,
    name: Arc<str>,
    client: HttpClient,
    s: HealthSettings,
    sink: Arc<dyn FleetSink>,
    stats: Arc<FleetStats>,
    cancel: CancellationToken,
) {
    let mut state = HealthState::default();
    let breaker = s.breaker.clone();
    loop {
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = client.get(&s.base, s.path, "*/*", s.timeout) => r,
        };
        let ok = matches!(&r, Ok(f) if f.status.is_success());
        let now = Instant::now();
        if ok {
            inc(&stats.health_ok);
            // See `breaker.rs`: closes a breaker whose worker was unreachable at once, one opened
            // by failing requests only after its cool-down; a closed one is left alone.
            if breaker.record_probe_success(now) {
                tracing::info!(worker = %name, "breaker closed by a successful health probe");
            }
        } else {
            inc(&stats.health_failed);
            if breaker.record_probe_failure(now) {
                tracing::warn!(worker = %name, "breaker opened by failed health probes");
            }
        }
        let t = state.observe(ok, s.down_after, now);
        if let Some(d) = t.recovered_after {
            sink.on_recovered(worker, d);
        }
        if t.restarted {
            tracing::info!(worker = %name, "worker came back: treating it as restarted");
            s.bus.restarted();
        }
        if let Some(up) = t.report {
            match &r {
                Ok(f) if !up => {
                    tracing::warn!(worker = %name, status = %f.status, "worker unhealthy")
                }
                Err(e) => tracing::warn!(worker = %name, error = %e, "worker unhealthy"),
                _ => tracing::info!(worker = %name, "worker healthy"),
            }
            sink.on_health(worker, up);
        }
        // Probe a worker that is out of rotation more often, so one that answers again is
        // routable within `recovery_interval` (plus one probe), not a full `interval`.
        let out = !ok || breaker.state() != BreakerState::Closed;
        let pause = if out {
            s.recovery_interval.min(s.interval)
        } else {
            s.interval
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flaps_and_restarts() {
        let t0 = Instant::now();
        let mut h = HealthState::default();
        assert_eq!(
            h.observe(true, 2, t0),
            Transition {
                report: Some(true),
                restarted: false,
                recovered_after: None
            }
        );
        assert_eq!(
            h.observe(true, 2, t0),
            Transition {
                report: None,
                restarted: false,
                recovered_after: None
            }
        );
        assert_eq!(
            h.observe(false, 2, t0),
            Transition {
                report: None,
                restarted: false,
                recovered_after: None
            }
        );
        assert_eq!(
            h.observe(false, 2, t0),
            Transition {
                report: Some(false),
                restarted: false,
                recovered_after: None
            }
        );
        assert_eq!(
            h.observe(true, 2, t0),
            Transition {
                report: Some(true),
                restarted: true,
                recovered_after: Some(Duration::ZERO)
            }
        );
        // a worker that starts down reports it at once, and its first "up" is not a restart
        let mut h = HealthState::default();
        assert_eq!(
            h.observe(false, 3, t0),
            Transition {
                report: Some(false),
                restarted: false,
                recovered_after: None
            }
        );
        assert_eq!(
            h.observe(true, 3, t0),
            Transition {
                report: Some(true),
                restarted: false,
                recovered_after: None
            }
        );
    }

    #[test]
    fn recovery_time_runs_from_the_first_failed_probe() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut h = HealthState::default();
        assert_eq!(h.observe(true, 2, at(0)).recovered_after, None);
        // one failure then success: never down, no recovery
        h.observe(false, 2, at(100));
        assert_eq!(h.observe(true, 2, at(200)).recovered_after, None);
        // down at the second failure, back 1.4 s after the first one
        h.observe(false, 2, at(1000));
        assert_eq!(h.observe(false, 2, at(1500)).report, Some(false));
        h.observe(false, 2, at(2000));
        let t = h.observe(true, 2, at(2400));
        assert_eq!((t.report, t.restarted), (Some(true), true));
        assert_eq!(t.recovered_after, Some(Duration::from_millis(1400)));
        // a worker that starts down and comes up has not recovered from anything
        let mut h = HealthState::default();
        h.observe(false, 2, at(0));
        assert_eq!(h.observe(true, 2, at(900)).recovered_after, None);
    }
}
