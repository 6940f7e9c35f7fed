//! The [`Policy`] trait and the policies, one per file, selectable by name for A/B comparison:
//! `round_robin`, `random`, `least_loaded`, `power_of_two`, `consistent_hash`, `cache_aware`, and
//! `kv` (the cost model of [`crate::select`], the default), and `latency` (predicted TTFT from each
//! worker's learned speed, [`crate::latency`]).
//!
//! Every policy applies the same busy filter first ([`PolicyConfig::busy`]: busy workers are skipped
//! unless all are busy) and returns `None` only when there are no candidates. Policies take `&self`
//! and keep any mutable state in atomics, so one instance serves all requests.

mod cache_aware;
mod consistent_hash;
mod kv;
mod latency;
mod least_loaded;
mod power_of_two;
mod random;
mod round_robin;

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use consistent_hash::{ConsistentHash, ConsistentHashConfig};
pub use kv::KvPolicy;
pub use latency::{LatencyPolicy, LatencyPolicyConfig};
pub use least_loaded::LeastLoaded;
pub use power_of_two::PowerOfTwo;
pub use random::Random;
pub use round_robin::RoundRobin;

use crate::select::{BusyThresholds, Candidate, Decision, KvCostConfig, RouteRequest};

/// Picks a worker for a request.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// The policy's name as accepted by [`policy_by_name`] (a bounded metric label).
    fn name(&self) -> &'static str;

    /// Chooses among `candidates` (pass them in a stable order, e.g. by worker id). `None` only when
    /// `candidates` is empty.
    fn select(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision>;

    /// Whether the policy reads `overlap_blocks` (others can skip the index query; the gateway may
    /// still query it for hit-rate metrics).
    fn uses_overlap(&self) -> bool {
        false
    }

    /// The cost this policy charges `c` for `req` (lower wins), for policies that rank by one:
    /// `kv` (its cost model) and `latency` (predicted ms). A trace lists it per candidate.
    fn candidate_cost(&self, _req: &RouteRequest<'_>, _c: &Candidate) -> Option<f64> {
        None
    }

    /// The `kv` policy behind this one, for callers that take the bounded path for large fleets
    /// ([`crate::select_kv_bounded`]); `None` for every other policy.
    fn as_kv(&self) -> Option<&KvPolicy> {
        None
    }

    /// The `latency` policy behind this one, for callers that take the bounded path for large
    /// fleets ([`crate::select_latency_bounded`]); `None` for every other policy.
    fn as_latency(&self) -> Option<&LatencyPolicy> {
        None
    }
}

/// Settings for every policy (each policy reads its own part).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PolicyConfig {
    /// Busy thresholds, applied by all policies.
    pub busy: BusyThresholds,
    /// The `kv` policy's cost model.
    pub kv: KvCostConfig,
    /// The `cache_aware` policy.
    pub cache_aware: CacheAwareConfig,
    /// The `consistent_hash` policy.
    pub consistent_hash: ConsistentHashConfig,
    /// The `latency` policy.
    pub latency: LatencyPolicyConfig,
}

/// Every policy name [`policy_by_name`] accepts, default first.
pub const POLICY_NAMES: [&str; 9] = [
    "kv_time",
    "kv",
    "latency",
    "round_robin",
    "random",
    "least_loaded",
    "power_of_two",
    "consistent_hash",
    "cache_aware",
];

/// A policy name that is not in [`POLICY_NAMES`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPolicy(pub String);

impl std::fmt::Display for UnknownPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "unknown routing policy {:?}; expected one of: {}",
            self.0,
            POLICY_NAMES.join(", ")
        )
    }
}

impl std::error::Error for UnknownPolicy {}

/// Builds a policy by name (`-` and `_` are interchangeable, case-insensitive).
pub fn policy_by_name(name: &str, cfg: &PolicyConfig) -> Result<Box<dyn Policy>, UnknownPolicy> {
    let norm = name.trim().to_ascii_lowercase().replace('-', "_");
    Ok(match norm.as_str() {
        "kv" => Box::new(KvPolicy::new(cfg.kv, cfg.busy)),
        "kv_time" => Box::new(KvPolicy::time(cfg.kv, cfg.latency.model, cfg.busy)),
        "latency" => Box::new(LatencyPolicy::new(cfg.latency, cfg.busy)),
        "round_robin" => Box::new(RoundRobin::new(cfg.busy)),
        "random" => Box::new(Random::new(cfg.busy)),
        "least_loaded" => Box::new(LeastLoaded::new(cfg.busy)),
        "power_of_two" => Box::new(PowerOfTwo::new(cfg.busy)),
        "consistent_hash" => Box::new(ConsistentHash::new(cfg.consistent_hash, cfg.busy)),
        "cache_aware" => Box::new(CacheAware::new(cfg.cache_aware, cfg.busy)),
        _ => return Err(UnknownPolicy(name.to_string())),
    })
}

/// Uniform pick among the eligible candidates minimising `key`; `None` when none is eligible.
pub(crate) fn min_by_key_random_tie<'a, K: Ord + Copy>(
    candidates: &'a [Candidate],
    ok: impl Fn(&Candidate) -> bool,
    key: impl Fn(&Candidate) -> K,
    rng: &mut fastrand::Rng,
) -> Option<&'a Candidate> {
    let mut best: Option<(&'a Candidate, K)> = None;
    let mut ties = 0u32;
    for c in candidates.iter().filter(|c| ok(c)) {
        let k = key(c);
        match best {
            Some((_, bk)) if k > bk => {}
            Some((_, bk)) if k == bk => {
                ties += 1;
                if rng.u32(0..ties) == 0 {
                    best = Some((c, k));
                }
            }
            _ => {
                best = Some((c, k));
                ties = 1;
            }
        }
    }
    best.map(|(c, _)| c)
}

#[cfg(test)]
mod tests;
