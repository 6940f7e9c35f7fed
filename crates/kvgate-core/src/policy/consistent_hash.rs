//! `consistent_hash`: session affinity with bounded load.
//!
//! The key is the request's affinity key (session header or `prompt_cache_key`, hashed by the
//! caller), else its first prefix block hash; requests without either go to a random eligible
//! worker. Workers are ranked by rendezvous (highest-random-weight) hashing of (key, worker), which
//! has the consistent-hashing property (removing a worker only moves that worker's keys) without
//! building a ring per candidate set. Bounded load (Mirrokni et al., "Consistent Hashing with
//! Bounded Loads"): a worker is skipped while its in-flight count has reached
//! `ceil(load_factor · (total in-flight + 1) / n)`; the highest-ranked worker under the bound wins.

use super::Policy;
use crate::select::{rendezvous, BusyThresholds, Candidate, Decision, Eligibility, RouteRequest};

/// Settings of `consistent_hash`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConsistentHashConfig {
    /// Load bound factor c ≥ 1 (default 1.25): no worker takes more than c × the average.
    pub load_factor: f64,
}

impl Default for ConsistentHashConfig {
    fn default() -> Self {
        Self { load_factor: 1.25 }
    }
}

/// Rendezvous hashing with bounded load.
#[derive(Debug, Default)]
pub struct ConsistentHash {
    cfg: ConsistentHashConfig,
    busy: BusyThresholds,
}

impl ConsistentHash {
    /// With these settings.
    pub fn new(cfg: ConsistentHashConfig, busy: BusyThresholds) -> Self {
        Self { cfg, busy }
    }
}

impl Policy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let el = Eligibility::new(candidates, &self.busy);
        let n = el.count(candidates);
        if n == 0 {
            return None;
        }
        let Some(key) = req.affinity_key.or_else(|| req.hashes.first().copied()) else {
            let c = el.nth(candidates, rng.usize(0..n))?;
            return Some(Decision::for_candidate(req, c, 0.0));
        };
        let total: u64 = candidates
            .iter()
            .filter(|c| el.ok(c))
            .map(|c| u64::from(c.inflight))
            .sum();
        let factor = self.cfg.load_factor.max(1.0);
        let cap = (factor * (total + 1) as f64 / n as f64).ceil() as u64;
        // Someone is always under the bound (the least loaded has ≤ average < cap), but fall back to
        // the unbounded winner anyway rather than return None.
        let best = |bounded: bool| {
            candidates
                .iter()
                .filter(|c| el.ok(c) && (!bounded || u64::from(c.inflight) < cap))
                .max_by_key(|c| rendezvous(key, c.stable_id))
        };
        let c = best(true).or_else(|| best(false))?;
        Some(Decision::for_candidate(req, c, f64::from(c.inflight)))
    }
}
