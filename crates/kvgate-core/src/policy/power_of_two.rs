//! `power_of_two`: two distinct random eligible candidates, the less loaded (in-flight requests, then
//! active blocks) wins. Near least-loaded balance without herding on stale load.

use super::Policy;
use crate::select::{BusyThresholds, Candidate, Decision, Eligibility, RouteRequest};

/// Power of two random choices.
#[derive(Debug, Default)]
pub struct PowerOfTwo {
    busy: BusyThresholds,
}

impl PowerOfTwo {
    /// With these busy thresholds.
    pub fn new(busy: BusyThresholds) -> Self {
        Self { busy }
    }
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
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
        let a = rng.usize(0..n);
        let c = if n == 1 {
            el.nth(candidates, a)?
        } else {
            // A second index distinct from the first, uniformly.
            let mut b = rng.usize(0..n - 1);
            if b >= a {
                b += 1;
            }
            let (ca, cb) = (el.nth(candidates, a)?, el.nth(candidates, b)?);
            if (cb.inflight, cb.active_blocks) < (ca.inflight, ca.active_blocks) {
                cb
            } else {
                ca
            }
        };
        Some(Decision::for_candidate(req, c, f64::from(c.inflight)))
    }
}
