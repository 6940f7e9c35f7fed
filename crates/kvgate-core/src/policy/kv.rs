//! `kv`: the KV-aware cost model of [`crate::select`] — prefill work not covered by the worker's
//! cache plus the decode blocks it would hold — picked by temperature; `kv_time` (the gateway's
//! default): the same with the latency model's predicted wait for a sequence slot or KV memory
//! charged as the prompt blocks prefilled in that time ([`KvCostConfig::queue_time`]).
//!
//! With [`KvCostConfig::cold_latency`] on, the policy keeps a moving average of each decision's
//! best cached share of the prompt (the fleet's recent reuse); while it is below
//! [`KvCostConfig::cold_reuse`], a request no candidate holds more than `cold_latency` of is
//! picked by the `latency` policy instead ([`KvPolicy::placed_by_latency`]).

use super::{LatencyPolicy, LatencyPolicyConfig, Policy};
use crate::select::{
    pick_for_request, BusyThresholds, Candidate, Decision, Eligibility, KvCostConfig, RouteRequest,
};
use std::sync::atomic::{AtomicU64, Ordering};

/// Weight of the newest decision in the recent reuse (about the last 50 decisions count).
const REUSE_WEIGHT: f64 = 0.02;

/// Cost-based KV-aware routing.
#[derive(Debug)]
pub struct KvPolicy {
    cfg: KvCostConfig,
    busy: BusyThresholds,
    name: &'static str,
    /// The `latency` policy cold prompts go to ([`KvCostConfig::cold_latency`]); `None` = off.
    cold: Option<LatencyPolicy>,
    /// The recent reuse (f64 bits): a moving average of each decision's best cached share of its
    /// prompt, starting at 1 (a new policy places by blocks until it has seen little reuse).
    reuse: AtomicU64,
}

impl Default for KvPolicy {
    fn default() -> Self {
        Self::new(KvCostConfig::default(), BusyThresholds::default())
    }
}

impl KvPolicy {
    /// `kv`: with this cost model and busy thresholds.
    pub fn new(cfg: KvCostConfig, busy: BusyThresholds) -> Self {
        Self::named(cfg, busy, "kv")
    }

    fn named(cfg: KvCostConfig, busy: BusyThresholds, name: &'static str) -> Self {
        let cold = cfg
            .queue_time
            .filter(|_| cfg.cold_latency > 0.0)
            .map(|model| {
                LatencyPolicy::new(
                    LatencyPolicyConfig {
                        model,
                        decode_weight: cfg.cold_decode_weight,
                        slo_ttft_ms: 0.0,
                        slo_itl_ms: 0.0,
                        temperature: cfg.temperature,
                    },
                    busy,
                )
            });
        Self {
            cfg,
            busy,
            name,
            cold,
            reuse: AtomicU64::new(1f64.to_bits()),
        }
    }

    /// `kv_time`: the same cost with queueing seen as time always on
    /// ([`KvCostConfig::queue_time`] = `latency`, whatever `cfg` says).
    pub fn time(
        cfg: KvCostConfig,
        latency: crate::latency::LatencyConfig,
        busy: BusyThresholds,
    ) -> Self {
        Self::named(
            KvCostConfig {
                queue_time: Some(latency),
                ..cfg
            },
            busy,
            "kv_time",
        )
    }

    /// The cost model.
    pub fn config(&self) -> &KvCostConfig {
        &self.cfg
    }

    /// The busy thresholds.
    pub fn busy(&self) -> &BusyThresholds {
        &self.busy
    }

    /// The fleet's recent reuse: the moving average of each decision's best cached share of its
    /// prompt (1 until decisions are made; only kept with [`KvCostConfig::cold_latency`] on).
    pub fn recent_reuse(&self) -> f64 {
        f64::from_bits(self.reuse.load(Ordering::Relaxed))
    }

    /// Once per decision, over every candidate the decision may consider (busy ones included):
    /// notes the request's best cached share in the recent reuse and returns the `latency`
    /// policy when the request is to be placed by it ([`KvCostConfig::cold_latency`]: on, the
    /// recent reuse before this request below [`KvCostConfig::cold_reuse`], and no candidate
    /// holding more than `cold_latency` of the prompt's blocks). A bounded walk's candidates
    /// (every holder of the prompt's first block) give the same answer as every worker's.
    pub fn placed_by_latency(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
    ) -> Option<&LatencyPolicy> {
        let cold = self.cold.as_ref()?;
        let blocks = (req.isl_tokens as f64 / f64::from(req.block_size.max(1))).max(1.0);
        let best = candidates
            .iter()
            .map(Candidate::effective_overlap)
            .max()
            .unwrap_or(0);
        let best = f64::from(best);
        let reuse = self.recent_reuse();
        let share = (best / blocks).min(1.0);
        // Relaxed load then store: a concurrent decision's update may be lost, which only
        // shortens the average's memory by one request.
        self.reuse.store(
            ((1.0 - REUSE_WEIGHT) * reuse + REUSE_WEIGHT * share).to_bits(),
            Ordering::Relaxed,
        );
        (reuse < self.cfg.cold_reuse && best <= self.cfg.cold_latency * blocks).then_some(cold)
    }

    /// The block cost's pick among `candidates` (never the cold rule's: see
    /// [`KvPolicy::placed_by_latency`]).
    pub fn select_blocks(
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
        match self.placed_by_latency(req, candidates) {
            Some(cold) => cold.select(req, candidates, rng),
            None => self.select_blocks(req, candidates, rng),
        }
    }
}
