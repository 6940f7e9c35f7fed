//! A classic Prometheus histogram without a lock: what the request path observes 8 times per
//! request.
//!
//! `prometheus_client`'s `Histogram` takes a mutex per observation and walks its bucket list
//! linearly (and, since 0.25, checks for a scheduled native-histogram reset): ~100 instructions
//! per observation, ~800 per request. This one is atomics only: a binary search of the bounds, one
//! `fetch_add` on the bucket and a compare-and-swap loop on the sum (uncontended: one iteration).
//! It encodes exactly as the crate's classic histogram does (same `_bucket`/`_sum`/`_count`
//! series, `+Inf` bucket appended, non-finite bounds dropped), so `/metrics` is unchanged.
//!
//! A scrape reads the buckets, the count and the sum without stopping observers, so one taken
//! during an observation may show it in some of the three and not yet in the others (the usual
//! guarantee of lock-free client libraries); the next scrape is whole again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// A classic histogram with fixed bucket bounds; cloning shares it (like the crate's).
#[derive(Clone, Debug)]
pub struct Histogram {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Finite upper bounds, ascending as given (the `+Inf` bucket is `counts`' last entry).
    bounds: Box<[f64]>,
    /// Observations per bucket (not cumulative), `bounds.len() + 1` of them.
    counts: Box<[AtomicU64]>,
    /// Observations, NaN included (the crate counts them too).
    count: AtomicU64,
    /// Sum of the observed values, as `f64` bits.
    sum: AtomicU64,
}

impl Histogram {
    /// A histogram with these upper bounds (non-finite ones are dropped; `+Inf` is always last).
    pub fn new(buckets: impl IntoIterator<Item = f64>) -> Self {
        let bounds: Box<[f64]> = buckets.into_iter().filter(|b| b.is_finite()).collect();
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Histogram {
            inner: Arc::new(Inner {
                bounds,
                counts,
                count: AtomicU64::new(0),
                sum: AtomicU64::new(0f64.to_bits()),
            }),
        }
    }

    /// Records `v` in the first bucket whose bound is ≥ `v` (`+Inf` for larger values and NaN,
    /// as the crate's histogram does).
    pub fn observe(&self, v: f64) {
        let i = &*self.inner;
        // Bounds are ascending when given so (every caller passes a sorted constant); an
        // unsorted list still puts `v` in *a* bucket whose bound is ≥ `v`, or `+Inf`. A NaN
        // compares false with every bound: `+Inf`, as the crate does.
        let at = if v.is_nan() {
            i.bounds.len()
        } else {
            i.bounds.partition_point(|b| *b < v)
        };
        i.counts[at].fetch_add(1, Ordering::Relaxed);
        i.count.fetch_add(1, Ordering::Relaxed);
        let mut cur = i.sum.load(Ordering::Relaxed);
        loop {
            let next = (f64::from_bits(cur) + v).to_bits();
            match i
                .sum
                .compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
    }

    /// `(sum, count)`: what `_sum` and `_count` would show now.
    pub fn totals(&self) -> (f64, u64) {
        let i = &*self.inner;
        (
            f64::from_bits(i.sum.load(Ordering::Relaxed)),
            i.count.load(Ordering::Relaxed),
        )
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let i = &*self.inner;
        let buckets: Vec<(f64, u64)> = i
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(i.counts.iter().map(|c| c.load(Ordering::Relaxed)))
            .collect();
        let count = i.count.load(Ordering::Relaxed);
        let sum = f64::from_bits(i.sum.load(Ordering::Relaxed));
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::histogram::Histogram as CrateHistogram;
    use prometheus_client::registry::Registry;

    fn text(r: &Registry) -> String {
        let mut s = String::new();
        encode(&mut s, r).unwrap();
        s
    }

    /// The same observations give the same exposition as the crate's classic histogram: bounds
    /// (including a duplicate and a non-finite one), values on a bound, below the first, above the
    /// last, negative, zero and NaN.
    #[test]
    fn encodes_exactly_as_the_crate_histogram() {
        let bounds = [0.001, 0.01, 0.01, 0.1, 1.0, f64::INFINITY, 10.0];
        let values = [
            0.0005,
            0.001,
            0.0011,
            0.01,
            0.05,
            1.0,
            9.99,
            10.0,
            10.5,
            1e9,
            -3.0,
            0.0,
            f64::NAN,
            0.3,
        ];
        let ours = Histogram::new(bounds);
        let theirs = CrateHistogram::new(bounds);
        for v in values {
            ours.observe(v);
            theirs.observe(v);
        }
        let mut a = Registry::default();
        a.register("kvgate_x_seconds", "Help.", ours.clone());
        let mut b = Registry::default();
        b.register("kvgate_x_seconds", "Help.", theirs);
        // NaN makes both sums NaN: compare the buckets and count exactly, the sum as text.
        assert_eq!(text(&a), text(&b));
        let (sum, count) = ours.totals();
        assert!(sum.is_nan());
        assert_eq!(count, values.len() as u64);
    }

    #[test]
    fn sums_and_counts_concurrent_observations() {
        let h = Histogram::new([1.0, 2.0, 4.0]);
        std::thread::scope(|s| {
            for t in 0..4 {
                let h = h.clone();
                s.spawn(move || {
                    for k in 0..10_000u32 {
                        h.observe(f64::from((k + t) % 6));
                    }
                });
            }
        });
        let (sum, count) = h.totals();
        assert_eq!(count, 40_000);
        // Small integers: every partial sum is exact in f64, whatever the interleaving.
        let expected: u64 = (0..4u64)
            .flat_map(|t| (0..10_000u64).map(move |k| (k + t) % 6))
            .sum();
        assert_eq!(sum, expected as f64);
    }
}
