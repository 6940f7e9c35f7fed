//! Drives a workload against a target: open loop (Poisson arrivals at a rate, or the trace's own
//! timestamps) or closed loop (a fixed number of requests in flight). Every request runs in a task
//! owned by a `JoinSet`, so dropping the run (Ctrl-C, error) cancels them all.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::client::Target;
use crate::stats::Outcome;
use crate::workload::{Request, Workload};

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Open loop, exponential inter-arrival times with mean 1/rate (seeded).
    Poisson { rate: f64, seed: u64 },
    /// Open loop at the workload's own timestamps.
    Trace,
    /// Closed loop: `concurrency` requests in flight, the next sent as soon as one finishes.
    Closed { concurrency: usize },
}

#[derive(Debug, Clone)]
pub struct RunConfig {
    pub arrival: Arrival,
    /// Send at most this many requests (the workload's first N).
    pub max_requests: Option<usize>,
    /// Stop sending new requests after this long; requests in flight still finish.
    pub duration: Option<Duration>,
    pub progress: bool,
}

/// Outcomes in completion order and the run's wall time (first send to last completion).
pub struct RunResult {
    pub outcomes: Vec<Outcome>,
    pub duration: Duration,
}

/// Arrival offsets of a Poisson process with the given rate (requests/s).
pub fn poisson_offsets(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x0A77_1BA1);
    let mut t = 0.0f64;
    (0..n)
        .map(|_| {
            let at = t;
            // 1 - U is in (0, 1], so ln is finite.
            t += -(1.0 - rng.f64()).ln() / rate;
            Duration::from_secs_f64(at)
        })
        .collect()
}

/// True when a progress bar makes sense (an interactive terminal, not CI).
pub fn interactive() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("CI").is_none()
}

pub async fn run(target: &Target, wl: &Workload, cfg: &RunConfig) -> anyhow::Result<RunResult> {
    let n = cfg
        .max_requests
        .unwrap_or(usize::MAX)
        .min(wl.requests.len());
    anyhow::ensure!(n > 0, "the workload has no requests to send");
    let reqs: Arc<[Request]> = wl.requests[..n].to_vec().into();
    let pb = if cfg.progress {
        let pb = ProgressBar::new(n as u64);
        if let Ok(style) =
            ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} {per_sec} {msg}")
        {
            pb.set_style(style);
        }
        pb
    } else {
        ProgressBar::hidden()
    };
    let start = Instant::now();
    let mut set: JoinSet<Outcome> = JoinSet::new();
    let mut outcomes = Vec::with_capacity(n);
    let spawn = |set: &mut JoinSet<Outcome>, i: usize| {
        let (t, reqs, pb) = (target.clone(), reqs.clone(), pb.clone());
        set.spawn(async move {
            let o = t.send(&reqs[i], start.elapsed()).await;
            pb.inc(1);
            o
        });
    };
    match cfg.arrival {
        Arrival::Closed { concurrency } => {
            anyhow::ensure!(concurrency > 0, "--concurrency must be > 0");
            let next = Arc::new(AtomicUsize::new(0));
            let mut workers: JoinSet<Vec<Outcome>> = JoinSet::new();
            for _ in 0..concurrency.min(n) {
                let (t, reqs, pb, next) = (target.clone(), reqs.clone(), pb.clone(), next.clone());
                let deadline = cfg.duration.map(|d| start + d);
                workers.spawn(async move {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= reqs.len() || deadline.is_some_and(|d| Instant::now() >= d) {
                            return mine;
                        }
                        mine.push(t.send(&reqs[i], start.elapsed()).await);
                        pb.inc(1);
                    }
                });
            }
            while let Some(res) = workers.join_next().await {
                outcomes.extend(res?);
            }
        }
        Arrival::Poisson { .. } | Arrival::Trace => {
            let offsets: Vec<Duration> = match cfg.arrival {
                Arrival::Poisson { rate, seed } => {
                    anyhow::ensure!(rate > 0.0 && rate.is_finite(), "--rate must be > 0");
                    poisson_offsets(n, rate, seed)
                }
                _ => {
                    let first = reqs[0].at.unwrap_or_default();
                    reqs.iter()
                        .map(|r| r.at.unwrap_or_default().saturating_sub(first))
                        .collect()
                }
            };
            for (i, &at) in offsets.iter().enumerate() {
                if cfg.duration.is_some_and(|d| at >= d) {
                    break;
                }
                let due = start + at;
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep_until(due) => break,
                        Some(res) = set.join_next(), if !set.is_empty() => outcomes.push(res?),
                    }
                }
                spawn(&mut set, i);
            }
            while let Some(res) = set.join_next().await {
                outcomes.push(res?);
            }
        }
    }
    pb.finish_and_clear();
    let duration = outcomes
        .iter()
        .map(|o| o.sent_at + o.e2e)
        .max()
        .unwrap_or_default();
    Ok(RunResult { outcomes, duration })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_offsets_are_seeded_and_have_the_right_mean_rate() {
        let a = poisson_offsets(20_000, 50.0, 7);
        assert_eq!(a, poisson_offsets(20_000, 50.0, 7));
        assert_ne!(a, poisson_offsets(20_000, 50.0, 8));
        assert_eq!(a[0], Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        // 20k exponential gaps with mean 20 ms: the total is within a few percent of 400 s.
        let total = a.last().unwrap().as_secs_f64();
        assert!((total / 400.0 - 1.0).abs() < 0.05, "{total}");
    }
}
