//! `cache_aware`: SGLang router's cache-aware policy, kept for comparison with `kv`.
//!
//! If the load is imbalanced (max − min in-flight > `balance_abs` and max > `balance_rel` × min),
//! go to the least loaded worker. Otherwise go to the worker with the longest prefix match if its
//! match ratio (overlap blocks / request blocks) exceeds `match_threshold`, else to the least loaded.

use super::{min_by_key_random_tie, Policy};
use crate::select::{BusyThresholds, Candidate, Decision, Eligibility, RouteRequest};

/// Settings of `cache_aware` (SGLang's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// Absolute in-flight imbalance that, together with the relative one, switches to balancing (64).
    pub balance_abs: u32,
    /// Relative imbalance (max > rel × min), default 1.5.
    pub balance_rel: f64,
    /// Minimum match ratio to follow the cache (0.3).
    pub match_threshold: f64,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            balance_abs: 64,
            balance_rel: 1.5,
            match_threshold: 0.3,
        }
    }
}

/// SGLang-style cache-aware routing.
#[derive(Debug, Default)]
pub struct CacheAware {
    cfg: CacheAwareConfig,
    busy: BusyThresholds,
}

impl CacheAware {
    /// With these settings.
    pub fn new(cfg: CacheAwareConfig, busy: BusyThresholds) -> Self {
        Self { cfg, busy }
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn uses_overlap(&self) -> bool {
        true
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let el = Eligibility::new(candidates, &self.busy);
        let (mut lo, mut hi) = (u32::MAX, 0u32);
        for c in candidates.iter().filter(|c| el.ok(c)) {
            lo = lo.min(c.inflight);
            hi = hi.max(c.inflight);
        }
        if lo == u32::MAX {
            return None;
        }
        let least = |rng: &mut fastrand::Rng| {
            min_by_key_random_tie(candidates, |c| el.ok(c), |c| c.inflight, rng)
        };
        let imbalanced =
            hi - lo > self.cfg.balance_abs && f64::from(hi) > self.cfg.balance_rel * f64::from(lo);
        let c = if imbalanced || req.hashes.is_empty() {
            least(rng)?
        } else {
            // Longest match; among equal matches the less loaded, then random.
            let best = min_by_key_random_tie(
                candidates,
                |c| el.ok(c),
                |c| (std::cmp::Reverse(c.effective_overlap()), c.inflight),
                rng,
            )?;
            let ratio = f64::from(best.effective_overlap()) / req.hashes.len() as f64;
            if ratio > self.cfg.match_threshold {
                best
            } else {
                least(rng)?
            }
        };
        Some(Decision::for_candidate(req, c, f64::from(c.inflight)))
    }
}
