//! kvgate-core: the pure routing engine of kvgate. No I/O, no tokio, no hyper: everything here is
//! synchronous, allocation-conscious and driven by injected `Instant`s, so the gateway, the simulator
//! and the bench can all share it and it can be property-tested in isolation.
//!
//! Layout (one concern per file):
//! - [`hash`]: block hashing (xxh3-64, seed 1337, chained, Dynamo-compatible) and the seed derivation
//!   for LoRA adapters and `cache_salt`.
//! - [`index`]: [`KvIndex`], which worker holds which block. Per worker either *exact* (fed by the
//!   engine's KV events, engine hash → router hash map) or *approximate* (fed by our own routing
//!   decisions, TTL + LRU capacity). `index/worker_set.rs` is the inline worker set, `index/approx.rs`
//!   the TTL/LRU queue, `index/overlap.rs` the query output buffer.
//! - [`load`]: [`ActiveSequences`], router-side load (active blocks, pending prefill tokens, in-flight
//!   requests) with a drop guard ([`LoadGuard`]) so no path can leak load; `load/order.rs` keeps
//!   the workers sorted by load for the bounded selection.
//! - [`select`]: the candidate/decision types, the busy filter, the kv cost model and the
//!   temperature-based pick; [`score_candidates`] fills candidates from index + load in one call.
//!   `select/bounded.rs`: [`select_kv_bounded`] and [`select_latency_bounded`], the same `kv` /
//!   `latency` decision visiting only the workers holding the prompt and the least loaded others
//!   (large fleets).
//! - [`latency`]: [`LatencyModel`], each worker's speed learned online from observed TTFT and ITL,
//!   and the TTFT/ITL estimate of a request on a candidate (used by the `latency` policy).
//! - [`policy`]: the [`Policy`] trait and one file per policy, selectable by name with
//!   [`policy_by_name`].
//! - `nohash.rs`: hashers for maps keyed by values that are already hashes.
//!
//! Typical hot path (gateway):
//! ```
//! use kvgate_core::*;
//! use std::time::Instant;
//! let seed = hash_seed(None, None);
//! let mut hashes = Vec::new();
//! block_hashes_into(&(1..=40).collect::<Vec<u32>>(), 16, seed, &mut hashes);
//! let index = KvIndex::new();
//! let active = ActiveSequences::new();
//! let policy = policy_by_name("kv", &PolicyConfig::default()).unwrap();
//! let mut scores = OverlapScores::new();
//! let mut candidates = vec![Candidate::new(WorkerId(0)), Candidate::new(WorkerId(1))];
//! score_candidates(&index, &active, &hashes, Instant::now(), &mut scores, &mut candidates);
//! let req = RouteRequest { hashes: &hashes, isl_tokens: 40, block_size: 16, affinity_key: None, hot: Default::default() };
//! let mut rng = fastrand::Rng::with_seed(7);
//! let decision = policy.select(&req, &candidates, &mut rng).unwrap();
//! let guard = active.add(decision.worker, 1, &hashes, 40, 0);
//! guard.mark_prefill_done(); // at the first output token
//! drop(guard); // on completion, cancel or error: load is released
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod hash;
pub mod index;
pub mod latency;
pub mod load;
mod nohash;
pub mod policy;
pub mod select;

pub use hash::next_hash;
pub use hash::{
    block_hashes, block_hashes_into, chain_hash, hash_seed, local_block_hash, BASE_SEED,
};
pub use index::{
    ApproxConfig, IndexError, IndexMode, KvIndex, OverlapScores, DEFAULT_PREDICTED_TTL,
};
pub use latency::{
    EngineSlots, LatencyConfig, LatencyModel, LearnConfig, Speed, TimingCurve, TtftEstimate,
    WorkerFit,
};
pub use load::remote::RemoteLoads;
pub use load::{ActiveSequences, LoadGuard, OrderWeights, WorkerLoad};
pub use nohash::{FastBuild, FastHasher};
pub use policy::{
    policy_by_name, CacheAwareConfig, ConsistentHashConfig, LatencyPolicyConfig, Policy,
    PolicyConfig, UnknownPolicy, POLICY_NAMES,
};
pub use select::{
    all_busy, is_busy, pick_by_cost, pick_for_request, pick_with, pick_with_share,
    score_candidates, select_kv_bounded, select_latency_bounded, BusyThresholds, Candidate,
    Decision, Eligibility, HotPrefix, KvCostConfig, RouteRequest, ScrapedLoad, SpeedBounds,
};

/// A chained KV block hash as computed by the router (see [`hash`]). Also used for the engine's
/// opaque block hashes, which are 64-bit on the wire.
pub type BlockHash = u64;

/// A worker's dense, small id, assigned by the gateway (index into per-worker tables here, so keep
/// ids small and reuse freed ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct WorkerId(pub u32);

impl WorkerId {
    /// The id as a table index.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
