//! Candidates, decisions, the busy filter, the kv cost model and the temperature pick.
//!
//! Cost of sending a request to a worker, in KV blocks (Dynamo 1.6.1's default selector without the
//! host/disk tiers):
//! ```text
//! prefill_blocks = max(0, (pending_weight · pending_prefill_tokens + isl_tokens) / block_size
//!                          − overlap_blocks)
//! decode_blocks  = active_blocks + new_blocks          (potential decode blocks)
//! cost           = prefill_weight · prefill_blocks + decode_blocks + request_weight · inflight
//! ```
//! With [`KvCostConfig::queue_time`] the prefill term also counts the predicted wait for a slot or
//! KV memory as the prompt blocks prefilled in that time.
//! Temperature 0 picks the minimum cost; exact ties go to the tied worker ranked highest by
//! rendezvous hashing on the request's first block none of them holds (uniformly at random when the
//! prompt has no such block), so every replica, and every request that opens the same new prefix,
//! breaks the tie the same way ([`pick_for_request`]). Temperature T > 0 picks worker i with
//! probability ∝ exp(−(c_i − min) / ((max − min) · T)), uniform when all are equal.

pub mod bounded;
pub use bounded::{select_kv_bounded, select_latency_bounded, SpeedBounds};

use crate::index::{KvIndex, OverlapScores};
use crate::load::ActiveSequences;
use crate::{BlockHash, WorkerId};
use std::time::Instant;

/// Load a worker reported itself (scraped metrics). Pass `None` when the scrape is stale.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ScrapedLoad {
    /// KV cache usage, 0.0..=1.0.
    pub kv_usage: f32,
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// Requests running in the engine.
    pub running: u32,
}

/// One worker as seen by a policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerId,
    /// Blocks of the request's prefix the worker holds (from [`KvIndex::find_matches`]).
    pub overlap_blocks: u32,
    /// Unique blocks of requests in flight there.
    pub active_blocks: u32,
    /// Blocks of this request not already active there.
    pub new_blocks: u32,
    /// Prompt tokens dispatched there and not yet prefilled.
    pub pending_prefill_tokens: u64,
    /// Requests in flight there.
    pub inflight: u32,
    /// Fresh scraped load, or `None` (never scraped, or stale: then it is ignored).
    pub scraped: Option<ScrapedLoad>,
    /// Whether the worker caches prefixes at all; when false its overlap is taken as 0.
    pub kv_scoring: bool,
    /// The worker's learned speed (see [`crate::latency`]); 1 = the reference timing curve.
    pub speed: crate::latency::Speed,
    /// The engine's learned concurrency limit and request service time (see
    /// [`crate::latency::EngineSlots`]); unknown until the worker was seen saturated.
    pub slots: crate::latency::EngineSlots,
    /// The worker's KV-cache capacity in the pool's blocks, as it reports it; 0 = not known.
    pub kv_capacity_blocks: u32,
    /// The worker's identity as every replica knows it (the gateway: a hash of its name; default
    /// the worker id). Ranks workers in rendezvous hashing: `consistent_hash` and the cost
    /// policies' tie-break ([`pick_for_request`]).
    pub stable_id: u64,
}

impl Candidate {
    /// An idle candidate with no overlap, `kv_scoring` on and no scraped load.
    pub fn new(worker: WorkerId) -> Self {
        Self {
            worker,
            overlap_blocks: 0,
            active_blocks: 0,
            new_blocks: 0,
            pending_prefill_tokens: 0,
            inflight: 0,
            scraped: None,
            kv_scoring: true,
            speed: crate::latency::Speed {
                prefill: 1.0,
                decode: 1.0,
            },
            slots: crate::latency::EngineSlots::UNKNOWN,
            kv_capacity_blocks: 0,
            stable_id: u64::from(worker.0),
        }
    }

    /// Overlap the policies may use (0 when `kv_scoring` is off).
    #[inline]
    pub fn effective_overlap(&self) -> u32 {
        if self.kv_scoring {
            self.overlap_blocks
        } else {
            0
        }
    }
}

/// What a policy sees of the request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// Chained block hashes of the prompt (full blocks only).
    pub hashes: &'a [BlockHash],
    /// Prompt length in tokens (including the partial last block).
    pub isl_tokens: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Session affinity key (session header / `prompt_cache_key` hash) for `consistent_hash`.
    pub affinity_key: Option<u64>,
    /// The prompt's leading blocks requests in flight hold right now
    /// ([`crate::ActiveSequences::hot_prefix`]); read by the `kv` cost's replication term
    /// ([`KvCostConfig::replicate`]). `HotPrefix::default()` (none) when that term is off.
    pub hot: HotPrefix,
}

/// The prompt's leading blocks that requests in flight hold right now, on any worker: a prefix in
/// use (a system prompt every new session shares), as opposed to a session's own history, which no
/// other request holds between its turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HotPrefix {
    /// How many leading blocks of the prompt are active somewhere.
    pub blocks: u32,
    /// How many requests in flight hold the last of them (over every worker).
    pub holders: u32,
    /// On how many workers they are in flight (the prefix's replicas in use).
    pub workers: u32,
    /// Requests in flight over the whole fleet (this gateway's, every pool). With
    /// `fleet_workers`, the fleet's mean load per worker: the share a replica may carry before
    /// the prefix counts as crowded.
    pub fleet_requests: u32,
    /// Workers known to the load tracker (0 with `fleet_requests` 0 reads as a mean of one).
    pub fleet_workers: u32,
}

impl HotPrefix {
    /// The share of a hot block's prefill the replication term waives on a worker without it,
    /// before `replicate`: `max(0, holders − workers · fair) / (holders + 1)`, where `fair` is
    /// the fleet's mean in-flight requests per worker, at least 1. So 0 while the prefix's
    /// replicas carry no more than their share of the fleet's requests (one request on one
    /// worker, or a prefix as busy as every other worker: nothing to relieve), rising towards 1
    /// as its users outnumber what its replicas would carry at the fleet's mean (five requests on
    /// one worker of an otherwise idle fleet: ⅔; on two: ½; five on one where every worker
    /// carries three: ⅓).
    #[inline]
    pub fn waiver(&self) -> f64 {
        let k = f64::from(self.holders);
        let fair = if self.fleet_workers == 0 {
            1.0
        } else {
            (f64::from(self.fleet_requests) / f64::from(self.fleet_workers)).max(1.0)
        };
        (k - f64::from(self.workers) * fair).max(0.0) / (k + 1.0)
    }
}

/// A policy's pick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The chosen worker.
    pub worker: WorkerId,
    /// The policy's score of the chosen worker (kv: cost in blocks; others: their load measure).
    pub cost: f64,
    /// The chosen worker's overlap in blocks.
    pub overlap_blocks: u32,
    /// Predicted fraction of prompt tokens served from cache: overlap·block_size / isl, ≤ 1.
    pub predicted_hit_ratio: f64,
    /// Probability that a router deciding from the same view picks this worker too: 1 / the
    /// number of equally cheap workers for an argmin, the pick's probability at temperature > 0,
    /// 1 where the policy does not say. Cluster mode counts our decision that many times per peer
    /// until the peers' own decisions arrive (`RemoteLoads::routed_here`).
    pub share: f64,
}

impl Decision {
    /// A decision for candidate `c` with score `cost`.
    pub fn for_candidate(req: &RouteRequest<'_>, c: &Candidate, cost: f64) -> Self {
        let overlap = c.effective_overlap();
        let ratio = if req.isl_tokens == 0 {
            0.0
        } else {
            (f64::from(overlap) * f64::from(req.block_size) / req.isl_tokens as f64).min(1.0)
        };
        Decision {
            worker: c.worker,
            cost,
            overlap_blocks: overlap,
            predicted_hit_ratio: ratio,
            share: 1.0,
        }
    }

    /// With [`Decision::share`] set.
    pub fn with_share(mut self, share: f64) -> Self {
        self.share = share;
        self
    }
}

/// Busy thresholds: a worker over any set threshold is busy. Busy workers are skipped unless every
/// candidate is busy (then the gateway may queue: see [`all_busy`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BusyThresholds {
    /// Router-side unique active blocks.
    pub active_blocks: Option<u32>,
    /// Router-side pending prefill tokens.
    pub pending_prefill_tokens: Option<u64>,
    /// Scraped KV cache usage (0..=1); ignored without fresh scraped load.
    pub kv_usage: Option<f32>,
    /// Scraped waiting-queue length; ignored without fresh scraped load.
    pub waiting: Option<u32>,
}

impl BusyThresholds {
    /// True when no threshold is set (the filter is a no-op).
    pub fn is_off(&self) -> bool {
        *self == Self::default()
    }
}

/// Whether a candidate is over any busy threshold (strictly greater than the threshold).
#[inline]
pub fn is_busy(c: &Candidate, t: &BusyThresholds) -> bool {
    let over = |v: u64, lim: Option<u64>| lim.is_some_and(|l| v > l);
    over(u64::from(c.active_blocks), t.active_blocks.map(u64::from))
        || over(c.pending_prefill_tokens, t.pending_prefill_tokens)
        || c.scraped.is_some_and(|s| {
            t.kv_usage.is_some_and(|l| s.kv_usage > l) || t.waiting.is_some_and(|l| s.waiting > l)
        })
}

/// True when every candidate is busy (or there are none): the gateway may queue the request.
pub fn all_busy(candidates: &[Candidate], t: &BusyThresholds) -> bool {
    candidates.iter().all(|c| is_busy(c, t))
}

/// Which candidates a policy may choose from: the non-busy ones, or all when every one is busy.
#[derive(Debug, Clone, Copy)]
pub struct Eligibility<'a> {
    filter: bool,
    t: &'a BusyThresholds,
}

impl<'a> Eligibility<'a> {
    /// Decides, once per request, whether the busy filter applies.
    pub fn new(candidates: &[Candidate], t: &'a BusyThresholds) -> Self {
        Self {
            filter: !t.is_off() && !all_busy(candidates, t),
            t,
        }
    }

    /// Whether `c` may be chosen.
    #[inline]
    pub fn ok(&self, c: &Candidate) -> bool {
        !self.filter || !is_busy(c, self.t)
    }

    /// Number of choosable candidates.
    pub fn count(&self, candidates: &[Candidate]) -> usize {
        candidates.iter().filter(|c| self.ok(c)).count()
    }

    /// The `k`-th choosable candidate.
    pub fn nth<'c>(&self, candidates: &'c [Candidate], k: usize) -> Option<&'c Candidate> {
        candidates.iter().filter(|c| self.ok(c)).nth(k)
    }
}

/// Settings of the kv cost model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCostConfig {
    /// Weight of the prefill term (Dynamo's `prefill_load_scale` / overlap score weight), default 4.
    /// Higher favours cache hits and short queues of prompt work; 0 routes on decode load only.
    pub prefill_weight: f64,
    /// Softmax temperature, default 0 (deterministic argmin with random ties).
    pub temperature: f64,
    /// Weight of in-flight requests, default 0 (Dynamo's `decode_active_request_weight`).
    pub request_weight: f64,
    /// Share of the worker's in-flight prefill tokens charged in the prefill term, default 1
    /// (Dynamo). Below 1 a long cached prefix outweighs a short-lived burst of prompt work on its
    /// worker: `prefill_weight` cannot do that, since it scales both sides (docs/bench.md, Mooncake).
    pub pending_weight: f64,
    /// Queueing seen as time (`routing.kv_queue_time`; default off): the latency model's predicted
    /// wait before the worker's engine can start the request — for a sequence slot and for KV
    /// memory ([`crate::latency::LatencyConfig::start_wait_ms`]), which the block counts above do
    /// not see — is charged as the prompt blocks that take as long to prefill on that worker
    /// (the curve's cost of one more block at its learned prefill speed), times `prefill_weight`.
    /// So a worker whose cached prefix sits behind a full KV cache costs what it would cost to
    /// recompute that prefix elsewhere once the wait exceeds it. `None` = off.
    pub queue_time: Option<crate::latency::LatencyConfig>,
    /// With `queue_time`: the step in progress and a decode step longer than the prompt's own
    /// step count as waits too ([`crate::latency::LatencyConfig::unseen_wait_ms`]): everything
    /// the latency estimate adds to the prefill, so an idle worker is preferred to a busy holder
    /// of a short cached prefix (`routing.kv_step_wait`; default off).
    pub step_wait: bool,
    /// Replication of a prefix in use (`routing.kv_replicate`, ≥ 0; 0 = off, this type's
    /// default; the gateway's `kv_time` uses 2 unless configured): on a
    /// worker without them, the prompt's hot blocks ([`RouteRequest::hot`]: held by requests in
    /// flight right now) are charged `1 − min(1, replicate · HotPrefix::waiver())` of their
    /// prefill, the waiver growing as the prefix's concurrent users outnumber what its replicas
    /// carry at the fleet's mean load.
    /// Opening another holder of a prefix that concurrent requests share costs one miss and serves
    /// the next ones, so the requests that only share that prefix (new sessions over a common
    /// system prompt) spread by load instead of queueing behind its holder; a session's own
    /// history is held by no other request between its turns and keeps its full charge, so
    /// sessions stay where their history is.
    pub replicate: f64,
    /// A cold prompt placed by predicted time in a fleet whose traffic reuses little
    /// (`routing.kv_cold_latency`, a share of the prompt's blocks in `[0, 1]`; 0 = off, this
    /// type's default; the gateway's `kv_time` uses 0.9 unless configured). Needs `queue_time`
    /// (the latency model). While the fleet's recent reuse ([`KvPolicy`](crate::KvPolicy)'s
    /// moving average of the best cached share of each prompt) is below `cold_reuse`, a request
    /// no candidate holds more than this share of is picked by the `latency` policy's cost
    /// ([`crate::LatencyPolicyConfig::cost`], with `cold_decode_weight`) instead of the block
    /// cost: where caches are seldom reused, keeping a partly cached prompt's worker buys little
    /// and its queue costs time.
    pub cold_latency: f64,
    /// With `cold_latency`: the recent reuse below which it applies (`routing.kv_cold_reuse`,
    /// in `[0, 1]`, default 0.5).
    pub cold_reuse: f64,
    /// With `cold_latency`: the `latency` policy's `decode_weight` for those picks
    /// (`routing.latency_decode_weight`, default 0.25).
    pub cold_decode_weight: f64,
}

impl Default for KvCostConfig {
    fn default() -> Self {
        Self {
            prefill_weight: 4.0,
            temperature: 0.0,
            request_weight: 0.0,
            pending_weight: 1.0,
            queue_time: None,
            step_wait: false,
            replicate: 0.0,
            cold_latency: 0.0,
            cold_reuse: 0.5,
            cold_decode_weight: 0.25,
        }
    }
}

impl KvCostConfig {
    /// The cost of sending `req` to `c` (see the module docs).
    #[inline]
    pub fn cost(&self, req: &RouteRequest<'_>, c: &Candidate) -> f64 {
        let bs = f64::from(req.block_size.max(1));
        let pending = self.pending_weight * c.pending_prefill_tokens as f64;
        let raw = (pending + req.isl_tokens as f64) / bs;
        let overlap = c.effective_overlap();
        let prefill = (raw - f64::from(overlap) - self.replicated(req, overlap)).max(0.0);
        let decode = f64::from(c.active_blocks) + f64::from(c.new_blocks);
        let queued = self
            .queue_time
            .map_or(0.0, |l| l.wait_blocks(req, c, self.step_wait));
        self.prefill_weight * (prefill + queued)
            + decode
            + self.request_weight * f64::from(c.inflight)
    }
}

impl KvCostConfig {
    /// The blocks of `req`'s hot prefix a worker with `overlap` cached blocks is not charged for
    /// ([`KvCostConfig::replicate`]).
    #[inline]
    pub fn replicated(&self, req: &RouteRequest<'_>, overlap: u32) -> f64 {
        if self.replicate <= 0.0 || req.hot.blocks <= overlap {
            return 0.0;
        }
        (self.replicate * req.hot.waiver()).min(1.0) * f64::from(req.hot.blocks - overlap)
    }
}

/// Picks an index into `costs` by temperature (see the module docs). `None` when empty; NaN costs
/// are treated as +∞.
pub fn pick_by_cost(costs: &[f64], temperature: f64, rng: &mut fastrand::Rng) -> Option<usize> {
    pick_with(costs.len(), |i| Some(costs[i]), temperature, rng)
}

/// [`pick_by_cost`] over `0..n` without a cost buffer: `cost(i)` is evaluated up to three times and
/// `None` excludes `i`.
pub fn pick_with(
    n: usize,
    cost: impl Fn(usize) -> Option<f64>,
    temperature: f64,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    pick_with_share(n, cost, temperature, rng).map(|(i, _)| i)
}

/// [`pick_with`], also returning the probability with which the pick was made (its
/// [`Decision::share`]): 1 / the number of exact ties at temperature 0, its softmax weight over
/// the total otherwise.
pub fn pick_with_share(
    n: usize,
    cost: impl Fn(usize) -> Option<f64>,
    temperature: f64,
    rng: &mut fastrand::Rng,
) -> Option<(usize, f64)> {
    let cost = |i: usize| cost(i).map(|c| if c.is_nan() { f64::INFINITY } else { c });
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    let mut any = false;
    for c in (0..n).filter_map(cost) {
        any = true;
        min = min.min(c);
        max = max.max(c);
    }
    if !any {
        return None;
    }
    if temperature > 0.0 && max > min && max.is_finite() {
        let scale = (max - min) * temperature;
        let weight = |c: f64| (-(c - min) / scale).exp();
        let total: f64 = (0..n).filter_map(cost).map(weight).sum();
        let mut r = rng.f64() * total;
        let mut last = None;
        for i in 0..n {
            let Some(c) = cost(i) else { continue };
            let w = weight(c);
            if w > 0.0 {
                last = Some(i);
            }
            r -= w;
            if r < 0.0 {
                return Some((i, w / total));
            }
        }
        // Rounding left r ≥ 0: the last candidate with non-zero weight.
        return last.and_then(|i| cost(i).map(|c| (i, weight(c) / total)));
    }
    // Argmin with reservoir sampling over exact ties: uniform without a second pass.
    let mut best = None;
    let mut ties = 0u32;
    for i in 0..n {
        if cost(i) == Some(min) {
            ties += 1;
            if rng.u32(0..ties) == 0 {
                best = Some(i);
            }
        }
    }
    best.map(|i| (i, 1.0 / f64::from(ties.max(1))))
}

/// SplitMix64 finaliser: a bijective, well-mixed 64-bit hash.
#[inline]
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Rank of the worker with [`Candidate::stable_id`] `stable` for `key` (higher wins).
#[inline]
pub(crate) fn rendezvous(key: u64, stable: u64) -> u64 {
    mix(key ^ mix(stable))
}

/// A cost policy's pick for `req` among `candidates` ([`pick_with_share`] over `cost`), with exact
/// ties at temperature 0 broken by the request instead of at random: among the tied workers, the
/// one ranked highest by rendezvous hashing on the prompt's first block that none of them holds
/// (the block after their longest overlap). Replicas that see the same fleet then send the first
/// requests of a new prefix to the same worker without talking to each other (a burst spread over
/// four replicas opens one worker, not four). Requests that differ after a prefix every tied worker
/// holds (a shared system prompt) still spread, since the key is their own first unshared block;
/// so the share stays 1 / ties: a peer's request with another prompt lands on any tied worker,
/// and one with ours lands on ours but adds only its own suffix there. No such block (the prompt
/// is held whole, or shorter than a block): uniformly at random.
pub fn pick_for_request(
    req: &RouteRequest<'_>,
    candidates: &[Candidate],
    cost: impl Fn(usize) -> Option<f64>,
    temperature: f64,
    rng: &mut fastrand::Rng,
) -> Option<(usize, f64)> {
    if temperature > 0.0 {
        return pick_with_share(candidates.len(), cost, temperature, rng);
    }
    let cost = |i: usize| cost(i).map(|c| if c.is_nan() { f64::INFINITY } else { c });
    let (mut first, mut min) = (None, f64::INFINITY);
    for i in 0..candidates.len() {
        if let Some(c) = cost(i) {
            if first.is_none() || c < min {
                first = Some(i);
                min = c;
            }
        }
    }
    let first = first?;
    let (mut ties, mut deepest) = (0u32, 0u32);
    for (i, c) in candidates.iter().enumerate() {
        if cost(i) == Some(min) {
            ties += 1;
            deepest = deepest.max(c.effective_overlap());
        }
    }
    if ties <= 1 {
        return Some((first, 1.0));
    }
    match req.hashes.get(deepest as usize) {
        Some(&key) => (0..candidates.len())
            .filter(|&i| cost(i) == Some(min))
            .max_by_key(|&i| rendezvous(key, candidates[i].stable_id))
            .map(|i| (i, 1.0 / f64::from(ties))),
        None => pick_with_share(candidates.len(), cost, 0.0, rng),
    }
}

/// Fills overlap (from the index) and router-side load (from `active`) for every candidate, whose
/// `worker`, `scraped` and `kv_scoring` the caller has set. `scores` is scratch, reused across calls.
pub fn score_candidates(
    index: &KvIndex,
    active: &ActiveSequences,
    hashes: &[BlockHash],
    now: Instant,
    scores: &mut OverlapScores,
    candidates: &mut [Candidate],
) {
    index.find_matches(hashes, now, scores);
    for c in candidates.iter_mut() {
        c.overlap_blocks = scores.get(c.worker);
    }
    active.fill_loads(hashes, candidates);
}

#[cfg(test)]
mod tests;
