//! `random`: a uniformly random eligible candidate.

use super::Policy;
use crate::select::{BusyThresholds, Candidate, Decision, Eligibility, RouteRequest};

/// Uniform random choice.
#[derive(Debug, Default)]
pub struct Random {
    busy: BusyThresholds,
}

impl Random {
    /// With these busy thresholds.
    pub fn new(busy: BusyThresholds) -> Self {
        Self { busy }
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
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
        let c = el.nth(candidates, rng.usize(0..n))?;
        Some(Decision::for_candidate(req, c, 0.0))
    }
}
