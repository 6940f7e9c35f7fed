//! [`select_kv_bounded`]: the `kv` decision at a cost set by the request, not by the fleet.
//!
//! The exhaustive path ([`crate::score_candidates`] then [`crate::Policy::select`]) scores every
//! worker of the pool. But a worker that holds none of the prompt's blocks (not in the index, not
//! in flight there) has overlap 0 and `new_blocks` = the whole prompt, so its `kv` cost is
//! ```text
//! cost = prefill_weight · (isl / block_size − replicated) + blocks(prompt)   (the same for every
//!                                                                       such worker)
//!      + prefill_weight · pending_weight / block_size · pending_prefill_tokens
//!      + active_blocks + request_weight · inflight                    (its load key)
//! ```
//! [`crate::ActiveSequences`] keeps the known workers sorted by that key as load comes and goes
//! (O(log workers) per change, [`crate::load::order`]). So the decision visits
//! 1. the *holders*: every worker with the prompt's first block in the index or in flight (only
//!    they can have overlap or a shorter decode footprint), and
//! 2. the other workers in ascending key order, stopping at the first whose cost lower bound
//!    (the constant + its key) exceeds the best eligible cost found. Workers whose bound equals
//!    it are visited too: every worker tied at the minimum is a candidate, as in the exhaustive
//!    scan.
//!
//! Extra load the caller adds per candidate (cluster mode's peers' load) and the busy filter only
//! raise a cost or skip a worker, so the bound stays a lower bound and the minimum cost is always
//! the exhaustive scan's, over the same set of tied workers: rendezvous tie-breaking
//! ([`crate::pick_for_request`]) therefore spreads new prefixes over every idle worker of a large
//! fleet as the exhaustive scan does (an earlier cap of 8 visited ties sent every new prefix of an
//! idle fleet to its 8 lowest-id workers). The price: an idle fleet, where every worker ties,
//! costs a visit per worker, as the exhaustive scan does; a loaded one stops early. Only a random
//! tie-break (a prompt every tied worker holds whole) may pick another tied worker, since the
//! candidates come in another order. The property test `bounded_matches_exhaustive` holds this:
//! always the same cost, the same worker whenever the minimum is unique. Temperature > 0 (every
//! worker has a probability) and weights without a lower bound visit every known worker.
//!
//! **`latency`** ([`select_latency_bounded`]): a non-holder's latency cost
//! ([`crate::LatencyConfig::estimate`] plus `decode_weight` × the decode slowdown it inflicts on
//! the `n` requests running there) is at least
//! ```text
//! ½·s + max(P, s) + decode_weight · n · max(P0 − s, 0)        (slot and KV waits ≥ 0 left out)
//! P  = speed.prefill · prefill_ms(pending_weight · pending + isl)   ≥ floor · prefill_ms(…)
//! P0 = speed.prefill · prefill_ms(isl)                               ≥ floor · prefill_ms(isl)
//! s  = speed.decode · decode_ms(KV usage)  (0 when n = 0)            ≤ ceiling · max decode_ms
//! ```
//! with the caller's [`SpeedBounds`] (the fastest prefill and the slowest decode factor of the
//! fleet, maintained by the caller). Taking the least over every `s` the ceiling allows gives a
//! bound that rises with both the pending prefill tokens and the running requests (see
//! `LatencyBound`). The non-holders are walked in two maintained orders at once, by pending
//! prefill tokens and by in-flight requests, each step taking the worker whose own bound is the
//! lower; every worker not reached yet has at least the next pending count of the first order
//! and the next in-flight count of the second, so the bound at those two keys bounds them all and
//! the walk stops once it passes the best cost found (ties visited, as for `kv`). Valid while the
//! timing curve's prefill time does not decrease with more tokens from `isl` on (checked per
//! request; otherwise every known worker is visited). With an SLO set, or a temperature, the
//! policy's rule is not "lowest cost" and every known worker is visited. The property tests
//! `latency_bounded_matches_exhaustive` (same cost, same worker when unique) and
//! `latency_bound_is_a_tight_lower_bound` (below every cost, reached at the bounds) hold this.
//!
//! Contract: a worker is seen as a non-holder only once [`crate::ActiveSequences`] knows it
//! ([`crate::ActiveSequences::add_worker`] when it joins, or its first request).

use super::{is_busy, Candidate, Decision, RouteRequest};
use crate::index::{KvIndex, OverlapScores};
use crate::load::{ActiveSequences, OrderWeights};
use crate::policy::{KvPolicy, LatencyPolicy, Policy};
use std::time::Instant;

/// The `kv` decision of `policy` for `req` over the workers `active` knows, visiting only the
/// holders of the prompt's first block and the least loaded others (see the module docs).
///
/// `prepare` completes each visited candidate, whose `worker`, overlap and router-side load are
/// set: the caller sets `scraped`, `kv_scoring`, `stable_id`, … and may add load (never remove
/// it), and returns false to leave the worker out (unhealthy, excluded, over a limit).
/// `candidates` receives the visited candidates (holders by worker id, then the others by load);
/// `scores` is the index query's scratch. `None` when no candidate is left.
#[allow(clippy::too_many_arguments)]
pub fn select_kv_bounded(
    policy: &KvPolicy,
    index: &KvIndex,
    active: &ActiveSequences,
    req: &RouteRequest<'_>,
    now: Instant,
    scores: &mut OverlapScores,
    candidates: &mut Vec<Candidate>,
    prepare: impl FnMut(&mut Candidate) -> bool,
    rng: &mut fastrand::Rng,
) -> Option<Decision> {
    let cfg = policy.config();
    let busy = policy.busy();
    // Every non-holder's cost is this plus its load key (module docs).
    // (With replication on, a non-holder is waived the same share of the hot prefix: overlap 0.)
    let base = cfg.prefill_weight
        * (req.isl_tokens as f64 / f64::from(req.block_size.max(1)) - cfg.replicated(req, 0))
        + req.hashes.len() as f64;
    // Temperature > 0: every known worker has a probability, so the walk visits them all.
    let early_stop = cfg.temperature <= 0.0;
    let walk = Some(Walk::One(OrderWeights::for_kv(cfg, req.block_size)));
    visit_bounded(
        index,
        active,
        req,
        now,
        scores,
        candidates,
        prepare,
        walk,
        early_stop,
        |key, _| base + key,
        |c| (busy.is_off() || !is_busy(c, busy)).then(|| cfg.cost(req, c)),
    );
    // The block cost's pick; the cold rule ([`KvPolicy::placed_by_latency`]) is the caller's,
    // which then takes the bounded `latency` walk.
    policy.select_blocks(req, candidates, rng)
}

/// Bounds of the speed factors every worker may have, for [`select_latency_bounded`]: no worker's
/// prefill factor (`Candidate::speed.prefill`) is below `prefill_floor` and no worker's decode
/// factor (`Candidate::speed.decode`) above `decode_ceiling`, e.g. the fastest and the slowest
/// known worker's (with the default of unknown workers). A floor that is not finite and positive,
/// or a ceiling that is NaN or negative (no bound known): every known worker is visited; a
/// ceiling of +∞ (none): the decode step is bounded by the request's own prefill instead (looser,
/// still a lower bound).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedBounds {
    /// No prefill factor is below it.
    pub prefill_floor: f64,
    /// No decode factor is above it.
    pub decode_ceiling: f64,
}

impl SpeedBounds {
    /// Every worker at exactly `speed` (a floor and ceiling that hold with equality).
    pub fn exactly(speed: crate::Speed) -> Self {
        SpeedBounds {
            prefill_floor: speed.prefill,
            decode_ceiling: speed.decode,
        }
    }
}

/// The two load orders the bounded `latency` walk takes the non-holders in, at once: by pending
/// prefill tokens and by in-flight requests ([`crate::load::Inner::walk_two`]).
const BY_PENDING: OrderWeights = OrderWeights {
    pending: 1.0,
    active: 0.0,
    inflight: 0.0,
};
const BY_INFLIGHT: OrderWeights = OrderWeights {
    pending: 0.0,
    active: 0.0,
    inflight: 1.0,
};

/// The lower bound of a non-holder's `latency` cost from its pending prefill tokens and in-flight
/// requests, for one request (module docs): with `n` requests in flight, `P` = floor ·
/// prefill_ms(pending_weight · pending + isl) and `P0` = floor · prefill_ms(isl) (the request's own
/// prefill, at most `P`), and `s` ∈ [0, `s_max`] the worker's decode step (decode factor ×
/// decode_ms(KV usage) ≤ ceiling × the curve's highest decode step), the cost is at least
/// `½·s + max(P, s) + decode_weight · n · max(P0 − s, 0)`. That is convex and piecewise linear
/// in `s`, least at `s` = 0 or `s` = m = min(P0, s_max):
/// `P + decode_weight·(P0 − m)·n + m·min(decode_weight·n, ½)`, rising with both loads.
#[derive(Debug, Clone, Copy)]
struct LatencyBound {
    floor: f64,
    pending_weight: f64,
    uncached: f64,
    curve: crate::TimingCurve,
    /// decode_weight · (P0 − m).
    per_request: f64,
    /// m.
    m: f64,
    decode_weight: f64,
}

impl LatencyBound {
    fn new(cfg: &crate::policy::LatencyPolicyConfig, uncached: f64, speeds: SpeedBounds) -> Self {
        let curve = cfg.model.curve;
        let floor = speeds.prefill_floor;
        let p0 = floor * curve.prefill_ms(uncached);
        // The curve's highest decode step over KV usage 0..=1 (at an end or at the vertex).
        let [da, db, _] = curve.decode;
        let mut top = curve.decode_ms(0.0).max(curve.decode_ms(1.0));
        if da < 0.0 {
            top = top.max(curve.decode_ms(-db / (2.0 * da)));
        }
        let s_max = speeds.decode_ceiling * top;
        // No usable ceiling: the step may be as long as the own prefill (m = P0).
        let m = if s_max.is_finite() && s_max >= 0.0 {
            p0.min(s_max)
        } else {
            p0
        };
        LatencyBound {
            floor,
            pending_weight: cfg.model.pending_weight,
            uncached,
            curve,
            per_request: cfg.decode_weight * (p0 - m),
            m,
            decode_weight: cfg.decode_weight,
        }
    }

    /// The bound for a worker with at least `pending` prefill tokens and `inflight` requests.
    #[inline]
    fn at(&self, pending: f64, inflight: f64) -> f64 {
        self.floor
            * self
                .curve
                .prefill_ms(self.pending_weight * pending + self.uncached)
            + self.per_request * inflight
            + self.m * (self.decode_weight * inflight).min(0.5)
    }
}

/// The `latency` decision of `policy` for `req` over the workers `active` knows, visiting only
/// the holders of the prompt's first block and the others in order of pending prefill tokens and
/// of in-flight requests until their cost's lower bound passes the best cost found (module docs).
///
/// `speeds`: bounds of every worker's speed factors (which `prepare` fills, see [`SpeedBounds`]).
/// `prepare`, `candidates`, `scores`: as for [`select_kv_bounded`]; the caller must fill the
/// latency fit (speed, slots) in `prepare`.
#[allow(clippy::too_many_arguments)]
pub fn select_latency_bounded(
    policy: &LatencyPolicy,
    index: &KvIndex,
    active: &ActiveSequences,
    req: &RouteRequest<'_>,
    now: Instant,
    speeds: SpeedBounds,
    scores: &mut OverlapScores,
    candidates: &mut Vec<Candidate>,
    prepare: impl FnMut(&mut Candidate) -> bool,
    rng: &mut fastrand::Rng,
) -> Option<Decision> {
    let cfg = policy.config();
    let busy = policy.busy();
    let model = &cfg.model;
    // A non-holder's prompt is all uncached, as `LatencyConfig::uncached_tokens` counts it.
    let uncached = (req.isl_tokens as f64).max(1.0);
    let [a, b, _] = model.curve.prefill;
    // The bound needs `prefill_ms` not to decrease from `uncached` tokens on (more pending tokens
    // never lower it), every other term ≥ 0 and the policy's rule to be the lowest cost.
    let monotone = a >= 0.0 && 2.0 * a * uncached + b >= 0.0;
    let floor = speeds.prefill_floor;
    let bounded = monotone
        && !cfg.slo_on()
        && cfg.temperature <= 0.0
        && cfg.decode_weight >= 0.0
        && cfg.decode_weight.is_finite()
        && model.pending_weight >= 0.0
        && model.pending_weight.is_finite()
        && floor.is_finite()
        && floor > 0.0
        && speeds.decode_ceiling >= 0.0;
    let lb = LatencyBound::new(cfg, uncached, speeds);
    let walk = bounded.then_some(Walk::Two(BY_PENDING, BY_INFLIGHT));
    visit_bounded(
        index,
        active,
        req,
        now,
        scores,
        candidates,
        prepare,
        walk,
        true,
        |pending, inflight| lb.at(pending, inflight),
        |c| (busy.is_off() || !is_busy(c, busy)).then(|| cfg.cost(req, c).0),
    );
    policy.select(req, candidates, rng)
}

/// The order(s) [`visit_bounded`] takes the non-holders in.
#[derive(Debug, Clone, Copy)]
enum Walk {
    /// One load order; the bound is of its key (the second argument 0).
    One(OrderWeights),
    /// Two load orders at once ([`crate::load::Inner::walk_two`]); the bound is of both keys.
    Two(OrderWeights, OrderWeights),
}

/// Fills `candidates` with the holders of the prompt's first block (index or in flight) and the
/// other known workers in ascending key of `weights`, stopping at the first whose `bound(key)`
/// exceeds the best `cost` found (`cost` is `None` for a worker the policy may not pick), or
/// visiting them all without `early_stop`. A worker's cost must never be below `bound` of its
/// key, whatever `prepare` adds. `weights` `None` (or without a valid order): every known worker
/// is visited.
#[allow(clippy::too_many_arguments)]
fn visit_bounded(
    index: &KvIndex,
    active: &ActiveSequences,
    req: &RouteRequest<'_>,
    now: Instant,
    scores: &mut OverlapScores,
    candidates: &mut Vec<Candidate>,
    mut prepare: impl FnMut(&mut Candidate) -> bool,
    walk: Option<Walk>,
    early_stop: bool,
    bound: impl Fn(f64, f64) -> f64,
    cost: impl Fn(&Candidate) -> Option<f64>,
) {
    let n = req.hashes.len();
    candidates.clear();
    index.find_matches(req.hashes, now, scores);
    let mut g = active.locked();
    let in_flight = g.prefix_depths(req.hashes);
    candidates.extend(
        scores
            .iter()
            .map(|(w, _)| w)
            .chain(in_flight.iter().map(|&w| crate::WorkerId(w)))
            .map(Candidate::new),
    );
    candidates.sort_unstable_by_key(|c| c.worker);
    candidates.dedup_by_key(|c| c.worker);
    let holders = candidates.len();
    let mut best = f64::INFINITY;
    let note = |c: &Candidate, best: &mut f64| {
        if let Some(cost) = cost(c) {
            if cost < *best {
                *best = cost;
            }
        }
    };
    let mut kept = 0;
    for i in 0..holders {
        let mut c = candidates[i];
        let load = g.load_of(c.worker).unwrap_or_default();
        c.overlap_blocks = scores.get(c.worker);
        c.active_blocks = load.active_blocks;
        c.pending_prefill_tokens = load.pending_prefill_tokens;
        c.inflight = load.inflight;
        c.new_blocks = g.new_blocks_after_depths(c.worker, n);
        if prepare(&mut c) {
            note(&c, &mut best);
            candidates[kept] = c;
            kept += 1;
        }
    }
    candidates.truncate(kept);
    let is_holder = |held: &[Candidate], w| held.binary_search_by_key(&w, |c| c.worker).is_ok();
    let stop = |best: f64, lower: f64| {
        early_stop && best.is_finite() && lower > best + 1e-9 * best.abs().max(1.0)
    };
    let mut visit = |w, load, best: &mut f64, candidates: &mut Vec<Candidate>| {
        if is_holder(&candidates[..kept], w) {
            return;
        }
        let mut c = non_holder(w, load, n);
        if prepare(&mut c) {
            note(&c, best);
            candidates.push(c);
        }
    };
    let walked = match walk {
        None => false,
        Some(Walk::One(weights)) => g.walk_order(weights, |key, w, load| {
            if stop(best, bound(key, 0.0)) {
                return false;
            }
            visit(w, load, &mut best, candidates);
            true
        }),
        Some(Walk::Two(a, b)) => g.walk_two(a, b, &bound, |(ka, kb), w, load| {
            if stop(best, bound(ka, kb)) {
                return false;
            }
            visit(w, load, &mut best, candidates);
            true
        }),
    };
    if !walked {
        // No order to walk (no weights, or weights without a lower bound): every known worker.
        g.walk_order(
            OrderWeights {
                pending: 0.0,
                active: 0.0,
                inflight: 0.0,
            },
            |_, w, load| {
                visit(w, load, &mut best, candidates);
                true
            },
        );
    }
}

/// A worker holding none of the prompt's `n` blocks, with its router-side load: no overlap, the
/// whole prompt new.
fn non_holder(w: crate::WorkerId, load: crate::WorkerLoad, n: usize) -> Candidate {
    let mut c = Candidate::new(w);
    c.active_blocks = load.active_blocks;
    c.pending_prefill_tokens = load.pending_prefill_tokens;
    c.inflight = load.inflight;
    c.new_blocks = n as u32;
    c
}

#[cfg(test)]
#[path = "bounded_tests.rs"]
mod tests;
