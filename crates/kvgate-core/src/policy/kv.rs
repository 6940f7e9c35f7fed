//! `kv` (default): the KV-aware cost model of [`crate::select`] — prefill work not covered by the
//! worker's cache plus the decode blocks it would hold — picked by temperature.

use super::Policy;
use crate::select::{
    pick_for_request, BusyThresholds, Candidate, Decision, Eligibility, KvCostConfig, RouteRequest,
};

/// Cost-based KV-aware routing.
#[derive(Debug, Default)]
pub struct KvPolicy {
    cfg: KvCostConfig,
    busy: BusyThresholds,
}

impl KvPolicy {
    /// With this cost model and busy thresholds.
    pub fn new(cfg: KvCostConfig, busy: BusyThresholds) -> Self {
        Self { cfg, busy }
    }

    /// The cost model.
    pub fn config(&self) -> &KvCostConfig {
        &self.cfg
    }

    /// The busy thresholds.
    pub fn busy(&self) -> &BusyThresholds {
        &self.busy
    }
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn uses_overlap(&self) -> bool {
        true
    }

    fn as_kv(&self) -> Option<&KvPolicy> {
        Some(self)
    }

    fn candidate_cost(&self, req: &RouteRequest<'_>, c: &Candidate) -> Option<f64> {
        Some(self.cfg.cost(req, c))
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let el = Eligibility::new(candidates, &self.busy);
        let cost = |i: usize| {
            let c = &candidates[i];
            el.ok(c).then(|| self.cfg.cost(req, c))
        };
        let (i, share) = pick_for_request(req, candidates, cost, self.cfg.temperature, rng)?;
        let c = &candidates[i];
        Some(Decision::for_candidate(req, c, self.cfg.cost(req, c)).with_share(share))
    }
}
