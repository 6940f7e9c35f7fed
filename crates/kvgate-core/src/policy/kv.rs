//! `kv`: the KV-aware cost model of [`crate::select`] — prefill work not covered by the worker's
//! cache plus the decode blocks it would hold — picked by temperature; `kv_time` (the gateway's
//! default): the same with the latency model's predicted wait for a sequence slot or KV memory
//! charged as the prompt blocks prefilled in that time ([`KvCostConfig::queue_time`]).

use super::Policy;
use crate::select::{
    pick_for_request, BusyThresholds, Candidate, Decision, Eligibility, KvCostConfig, RouteRequest,
};

/// Cost-based KV-aware routing.
#[derive(Debug)]
pub struct KvPolicy {
    cfg: KvCostConfig,
    busy: BusyThresholds,
    name: &'static str,
}

impl Default for KvPolicy {
    fn default() -> Self {
        Self::new(KvCostConfig::default(), BusyThresholds::default())
    }
}

impl KvPolicy {
    /// `kv`: with this cost model and busy thresholds.
    pub fn new(cfg: KvCostConfig, busy: BusyThresholds) -> Self {
        Self {
            cfg,
            busy,
            name: "kv",
        }
    }

    /// `kv_time`: the same cost with queueing seen as time always on
    /// ([`KvCostConfig::queue_time`] = `latency`, whatever `cfg` says).
    pub fn time(
        cfg: KvCostConfig,
        latency: crate::latency::LatencyConfig,
        busy: BusyThresholds,
    ) -> Self {
        Self {
            cfg: KvCostConfig {
                queue_time: Some(latency),
                ..cfg
            },
            busy,
            name: "kv_time",
        }
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
        self.name
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
