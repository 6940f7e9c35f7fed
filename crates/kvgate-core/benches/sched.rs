//! Shared by the benches: per-call timing that can tell a descheduled call, and percentiles.

use std::time::{Duration, Instant};

/// This thread's scheduler stats (`/proc/thread-self/schedstat`: on-CPU ns, wait ns, timeslices).
/// The machine running the benches is shared; a call during which the timeslice count changed was
/// descheduled, and its wall time says nothing about our code.
pub struct Sched(Option<std::fs::File>);

impl Default for Sched {
    fn default() -> Self {
        Self::new()
    }
}

impl Sched {
    pub fn new() -> Self {
        Sched(std::fs::File::open("/proc/thread-self/schedstat").ok())
    }
    pub fn read(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 128];
        let n = self.0.as_ref()?.read_at(&mut buf, 0).ok()?;
        let s = std::str::from_utf8(&buf[..n]).ok()?;
        let f: Vec<u64> = s
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        Some((f.first().copied()?, f.get(2).copied()?))
    }

    /// Runs `f`, returning its result, its wall time, and whether the thread kept the CPU the
    /// whole time (no timeslice change).
    pub fn time<R>(&self, f: impl FnOnce() -> R) -> (R, Duration, bool) {
        let s0 = self.read();
        let t = Instant::now();
        let r = f();
        let el = t.elapsed();
        let kept = matches!((s0, self.read()), (Some(a), Some(b)) if a.1 == b.1);
        (r, el, kept)
    }

    /// Wall times of `calls` runs of `f(i)` during which the thread kept the CPU.
    #[allow(dead_code)]
    pub fn undisturbed(&self, calls: usize, mut f: impl FnMut(usize)) -> Vec<Duration> {
        (0..calls)
            .filter_map(|i| {
                let ((), el, kept) = self.time(|| f(i));
                kept.then_some(el)
            })
            .collect()
    }
}

/// p50, p90, p99, p99.9 and max of `v`.
pub fn percentiles(mut v: Vec<Duration>) -> String {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q) as usize];
    format!(
        "p50 {:>7.2?}  p90 {:>7.2?}  p99 {:>7.2?}  p99.9 {:>7.2?}  max {:>7.2?}",
        p(0.5),
        p(0.9),
        p(0.99),
        p(0.999),
        v[v.len() - 1]
    )
}
