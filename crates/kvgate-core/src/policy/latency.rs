//! `latency`: route on predicted latency instead of KV blocks. Each candidate's cost is the
//! request's predicted TTFT there ([`LatencyConfig::estimate`]: the prefill queue ahead of it plus
//! its own uncached tokens, at the worker's learned speed, plus the decode step it waits for) plus
//! `decode_weight` × the decode slowdown it inflicts on the requests already there
//! ([`LatencyConfig::inflicted_ms`]). The cache enters through the uncached tokens only: there is
//! no weight to tune between hits and load.
//!
//! With an SLO (`slo_ttft_ms` and/or `slo_itl_ms` > 0): among the candidates predicted to meet it,
//! the one with the longest cached prefix (keeps a session's locality for its later turns), ties
//! by cost; when none is predicted to meet it, the lowest cost.

use super::Policy;
use crate::latency::LatencyConfig;
use crate::select::{
    pick_for_request, BusyThresholds, Candidate, Decision, Eligibility, RouteRequest,
};

/// Settings of the `latency` policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyPolicyConfig {
    /// The TTFT/ITL estimate (timing curve, share of in-flight prefill counted as queued).
    pub model: LatencyConfig,
    /// Weight of the decode slowdown inflicted on requests in flight (request·ms per ms of this
    /// request's TTFT). 0 = this request's TTFT only.
    pub decode_weight: f64,
    /// TTFT SLO in ms; 0 = none.
    pub slo_ttft_ms: f64,
    /// Mean ITL SLO in ms; 0 = none.
    pub slo_itl_ms: f64,
    /// Softmax temperature over normalised cost (as `kv`); 0 = argmin.
    pub temperature: f64,
}

impl Default for LatencyPolicyConfig {
    fn default() -> Self {
        Self {
            model: LatencyConfig::default(),
            decode_weight: 0.25,
            slo_ttft_ms: 0.0,
            slo_itl_ms: 0.0,
            temperature: 0.0,
        }
    }
}

impl LatencyPolicyConfig {
    /// Cost of `req` on `c` (ms) and whether it is predicted to meet the SLO.
    #[inline]
    pub fn cost(&self, req: &RouteRequest<'_>, c: &Candidate) -> (f64, bool) {
        let e = self.model.estimate(req, c);
        let cost = e.predicted_ms + self.decode_weight * self.model.inflicted_ms(&e, c);
        let meets = (self.slo_ttft_ms <= 0.0 || e.predicted_ms <= self.slo_ttft_ms)
            && (self.slo_itl_ms <= 0.0 || e.predicted_itl_ms <= self.slo_itl_ms);
        (cost, meets)
    }

    /// Whether an SLO is set (the pick is then by overlap among the workers meeting it).
    pub fn slo_on(&self) -> bool {
        self.slo_ttft_ms > 0.0 || self.slo_itl_ms > 0.0
    }
}

/// Predicted-latency routing.
#[derive(Debug, Default)]
pub struct LatencyPolicy {
    cfg: LatencyPolicyConfig,
    busy: BusyThresholds,
}

impl LatencyPolicy {
    /// With these settings and busy thresholds.
    pub fn new(cfg: LatencyPolicyConfig, busy: BusyThresholds) -> Self {
        Self { cfg, busy }
    }
}

impl LatencyPolicy {
    /// Its settings.
    pub fn config(&self) -> &LatencyPolicyConfig {
        &self.cfg
    }

    /// Its busy thresholds.
    pub fn busy(&self) -> &BusyThresholds {
        &self.busy
    }
}

impl Policy for LatencyPolicy {
    fn name(&self) -> &'static str {
        "latency"
    }

    fn uses_overlap(&self) -> bool {
        true
    }

    fn as_latency(&self) -> Option<&LatencyPolicy> {
        Some(self)
    }

    fn candidate_cost(&self, req: &RouteRequest<'_>, c: &Candidate) -> Option<f64> {
        Some(self.cfg.cost(req, c).0)
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let el = Eligibility::new(candidates, &self.busy);
        if self.cfg.slo_on() {
            // Longest cached prefix among those meeting the SLO, then lowest cost, then random.
            let mut best: Option<(usize, u32, f64)> = None;
            let mut ties = 0u32;
            for (i, c) in candidates.iter().enumerate() {
                if !el.ok(c) {
                    continue;
                }
                let (cost, meets) = self.cfg.cost(req, c);
                if !meets {
                    continue;
                }
                let ov = c.effective_overlap();
                let better = match best {
                    None => true,
                    Some((_, bo, bc)) => ov > bo || (ov == bo && cost < bc),
                };
                if better {
                    best = Some((i, ov, cost));
                    ties = 1;
                } else if let Some((_, bo, bc)) = best {
                    if ov == bo && cost == bc {
                        ties += 1;
                        if rng.u32(0..ties) == 0 {
                            best = Some((i, ov, cost));
                        }
                    }
                }
            }
            if let Some((i, _, cost)) = best {
                let share = 1.0 / f64::from(ties.max(1));
                return Some(Decision::for_candidate(req, &candidates[i], cost).with_share(share));
            }
        }
        let cost = |i: usize| {
            let c = &candidates[i];
            el.ok(c).then(|| self.cfg.cost(req, c).0)
        };
        let (i, share) = pick_for_request(req, candidates, cost, self.cfg.temperature, rng)?;
        let c = &candidates[i];
        Some(Decision::for_candidate(req, c, self.cfg.cost(req, c).0).with_share(share))
    }
}
