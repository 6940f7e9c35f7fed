//! `least_loaded`: fewest in-flight requests (router-side, so fresh at dispatch), then fewest active
//! blocks; remaining ties uniformly at random.

use super::{min_by_key_random_tie, Policy};
use crate::select::{BusyThresholds, Candidate, Decision, Eligibility, RouteRequest};

/// Least in-flight requests.
#[derive(Debug, Default)]
pub struct LeastLoaded {
    busy: BusyThresholds,
}

impl LeastLoaded {
    /// With these busy thresholds.
    pub fn new(busy: BusyThresholds) -> Self {
        Self { busy }
    }
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let el = Eligibility::new(candidates, &self.busy);
        let c = min_by_key_random_tie(
            candidates,
            |c| el.ok(c),
            |c| (c.inflight, c.active_blocks),
            rng,
        )?;
        Some(Decision::for_candidate(req, c, f64::from(c.inflight)))
    }
}
