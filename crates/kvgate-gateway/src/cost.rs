//! Worker cost, accrued continuously (every housekeeping tick and at each `/metrics` read, not
//! only when `/metrics` is read): dollars from `cost_per_hour`, GPU-seconds from `gpus`, and the
//! share of the cost accrued while the worker ran nothing (idle cost).
//!
//! With N gateway replicas each one accrues every worker's full cost (a replica cannot know the
//! others' share without the cluster bus), so every replica exports the same figure per worker and
//! the fleet's cost is `sum(max by (worker) (rate(kvgate_cost_dollars_total[5m])))`, never a plain
//! `sum` (docs/metrics.md, "Cost with several replicas"). `kvgate_worker_cost_per_hour` carries the
//! rate itself for the same `max by (worker)` arithmetic.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::metrics::{Metrics, WorkerLabel};
use crate::registry::{Fleet, Worker};

/// Whether the worker runs nothing: its own scraped figures when fresh (the same on every
/// replica), else nothing in flight through this gateway.
fn idle(w: &Worker, now: Instant) -> bool {
    match w.state.fresh_scraped(now) {
        Some(l) => l.running == 0 && l.waiting == 0,
        None => w.state.inflight.load(Ordering::Relaxed) == 0,
    }
}

/// Add what accrued since the last call to each worker's cost counters. Returns the fleet's
/// accrued dollars as seen by this replica (for `kvgate_tokens_per_dollar`).
pub fn accrue(fleet: &Fleet, m: &Metrics, now: Instant) -> f64 {
    let mut dollars_total = 0.0;
    for w in &fleet.workers {
        let l = WorkerLabel {
            worker: w.name.clone(),
        };
        let alive_ms = now.saturating_duration_since(w.state.added).as_millis() as u64;
        let prev = w
            .state
            .cost_accrued_ms
            .fetch_max(alive_ms, Ordering::Relaxed);
        let cost = m.cost_dollars.get_or_create(&l);
        let gpu_s = m.gpu_seconds.get_or_create(&l);
        let idle_cost = m.idle_cost_dollars.get_or_create(&l);
        m.cost_per_hour.get_or_create(&l).set(w.cfg.cost_per_hour);
        m.gpus.get_or_create(&l).set(i64::from(w.cfg.gpus));
        if alive_ms > prev {
            let hours = (alive_ms - prev) as f64 / 3_600_000.0;
            let dollars = w.cfg.cost_per_hour * hours;
            cost.inc_by(dollars);
            gpu_s.inc_by(f64::from(w.cfg.gpus) * hours * 3600.0);
            if idle(w, now) {
                idle_cost.inc_by(dollars);
            }
        }
        dollars_total += cost.get();
    }
    dollars_total
}

/// Drop a removed worker's gauges (its counters keep what it accrued).
pub fn forget(m: &Metrics, l: &WorkerLabel) {
    m.cost_per_hour.remove(l);
    m.gpus.remove(l);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, WorkerConfig};
    use crate::registry::Registry;
    use std::sync::Arc;
    use std::time::Duration;

    fn sample(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{series} missing in {text}"))
    }

    #[test]
    fn cost_gpu_seconds_and_idle_cost_accrue_with_time() {
        let mut c = Config::default();
        for (url, rate, gpus) in [("http://a:1", 2.0, 4), ("http://b:1", 0.0, 1)] {
            let mut w = WorkerConfig::from_url(url);
            w.models = vec!["m".into()];
            w.cost_per_hour = rate;
            w.gpus = gpus;
            c.workers.push(w);
        }
        let (reg, _) = Registry::new(Arc::new(c)).expect("registry");
        let fleet = reg.snapshot();
        let m = Metrics::new();
        let t0 = fleet.workers[0].state.added;
        // Half an hour idle, then half an hour with a request in flight (no scraped load).
        assert_eq!(accrue(&fleet, &m, t0 + Duration::from_secs(1800)), 1.0);
        fleet.workers[0].state.inflight.store(1, Ordering::Relaxed);
        let total = accrue(&fleet, &m, t0 + Duration::from_secs(3600));
        assert!((total - 2.0).abs() < 1e-9, "{total}");
        // A second call at the same instant (a /metrics read right after a tick) adds nothing.
        assert!((accrue(&fleet, &m, t0 + Duration::from_secs(3600)) - 2.0).abs() < 1e-9);
        let text = m.render();
        let w = "{worker=\"a:1\"}";
        assert!((sample(&text, &format!("kvgate_cost_dollars_total{w}")) - 2.0).abs() < 1e-9);
        assert!(
            (sample(&text, &format!("kvgate_worker_idle_cost_dollars_total{w}")) - 1.0).abs()
                < 1e-9
        );
        assert!(
            (sample(&text, &format!("kvgate_worker_gpu_seconds_total{w}")) - 4.0 * 3600.0).abs()
                < 1e-6
        );
        assert_eq!(
            sample(&text, &format!("kvgate_worker_cost_per_hour{w}")),
            2.0
        );
        assert_eq!(sample(&text, &format!("kvgate_worker_gpus{w}")), 4.0);
        assert_eq!(
            sample(&text, "kvgate_cost_dollars_total{worker=\"b:1\"}"),
            0.0
        );
        forget(
            &m,
            &WorkerLabel {
                worker: fleet.workers[0].name.clone(),
            },
        );
        assert!(!m.render().contains(&format!("kvgate_worker_gpus{w}")));
    }

    #[test]
    fn engine_reported_load_decides_idle_when_fresh() {
        let mut c = Config::default();
        let mut w = WorkerConfig::from_url("http://a:1");
        w.models = vec!["m".into()];
        w.cost_per_hour = 1.0;
        c.workers.push(w);
        let (reg, _) = Registry::new(Arc::new(c)).expect("registry");
        let fleet = reg.snapshot();
        let m = Metrics::new();
        let st = &fleet.workers[0].state;
        let now = st.added + Duration::from_secs(3600);
        // Busy by the engine's own count although nothing is in flight through this replica.
        *st.scraped.lock() = Some((
            now,
            kvgate_core::ScrapedLoad {
                kv_usage: 0.1,
                waiting: 0,
                running: 2,
            },
        ));
        accrue(&fleet, &m, now);
        let text = m.render();
        assert_eq!(
            sample(
                &text,
                "kvgate_worker_idle_cost_dollars_total{worker=\"a:1\"}"
            ),
            0.0
        );
        assert_eq!(
            sample(&text, "kvgate_cost_dollars_total{worker=\"a:1\"}"),
            1.0
        );
    }
}
