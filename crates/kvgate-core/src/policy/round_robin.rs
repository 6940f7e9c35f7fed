//! `round_robin`: each request goes to the next eligible candidate in order. The baseline.

use super::Policy;
use crate::select::{BusyThresholds, Candidate, Decision, Eligibility, RouteRequest};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Round robin over the eligible candidates.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
    busy: BusyThresholds,
}

impl RoundRobin {
    /// With these busy thresholds.
    pub fn new(busy: BusyThresholds) -> Self {
        Self {
            next: AtomicUsize::new(0),
            busy,
        }
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let el = Eligibility::new(candidates, &self.busy);
        let n = el.count(candidates);
        if n == 0 {
            return None;
        }
        let k = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let c = el.nth(candidates, k)?;
        Some(Decision::for_candidate(req, c, 0.0))
    }
}
