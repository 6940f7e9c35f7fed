//! [`select_kv_bounded`]: the `kv` decision at a cost set by the request, not by the fleet.
//!
//! The exhaustive path ([`crate::score_candidates`] then [`crate::Policy::select`]) scores every
//! worker of the pool. But a worker that holds none of the prompt's blocks (not in the index, not
//! in flight there) has overlap 0 and `new_blocks` = the whole prompt, so its `kv` cost is
//! ```text
//! cost = prefill_weight · isl / block_size + blocks(prompt)          (the same for every such worker)
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
//! **`latency`** ([`select_latency_bounded`]): a non-holder's latency cost is at least its
//! predicted prefill, `speed.prefill · prefill_ms(pending_weight · pending + isl)` (the slot wait,
//! the half decode step, the decode step it may wait for instead and the decode slowdown it
//! inflicts are all ≥ 0, see [`crate::LatencyConfig::estimate`]). The caller gives a floor of
//! every worker's prefill speed factor (the fastest known worker's), and the order by pending
//! prefill tokens then bounds every non-holder not yet visited: the same early stop, valid while
//! the timing curve's prefill time does not decrease with more tokens from `isl` on (checked per
//! request; otherwise every known worker is visited). With an SLO set, or a temperature, the
//! policy's rule is not "lowest cost" and every known worker is visited.
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
    let base = cfg.prefill_weight * (req.isl_tokens as f64 / f64::from(req.block_size.max(1)))
        + req.hashes.len() as f64;
    // Temperature > 0: every known worker has a probability, so the walk visits them all.
    let early_stop = cfg.temperature <= 0.0;
    let weights = Some(OrderWeights::for_kv(cfg, req.block_size));
    visit_bounded(
        index,
        active,
        req,
        now,
        scores,
        candidates,
        prepare,
        weights,
        early_stop,
        |key| base + key,
        |c| (busy.is_off() || !is_busy(c, busy)).then(|| cfg.cost(req, c)),
    );
    policy.select(req, candidates, rng)
}

/// The `latency` decision of `policy` for `req` over the workers `active` knows, visiting only
/// the holders of the prompt's first block and the others in order of pending prefill tokens
/// until their cost's lower bound passes the best cost found (module docs).
///
/// `speed_floor`: no worker's prefill speed factor (`Candidate::speed.prefill`, which `prepare`
/// fills) is below it, e.g. the fastest known worker's factor (or the default for unknown
/// workers, whichever is lower). Not finite or not positive: every known worker is visited.
/// `prepare`, `candidates`, `scores`: as for [`select_kv_bounded`]; the caller must fill the
/// latency fit (speed, slots) in `prepare`.
#[allow(clippy::too_many_arguments)]
pub fn select_latency_bounded(
    policy: &LatencyPolicy,
    index: &KvIndex,
    active: &ActiveSequences,
    req: &RouteRequest<'_>,
    now: Instant,
    speed_floor: f64,
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
    let bounded = monotone
        && !cfg.slo_on()
        && cfg.temperature <= 0.0
        && cfg.decode_weight >= 0.0
        && model.pending_weight >= 0.0
        && model.pending_weight.is_finite()
        && speed_floor.is_finite()
        && speed_floor > 0.0;
    let weights = bounded.then_some(OrderWeights {
        pending: 1.0,
        active: 0.0,
        inflight: 0.0,
    });
    let pw = model.pending_weight;
    visit_bounded(
        index,
        active,
        req,
        now,
        scores,
        candidates,
        prepare,
        weights,
        true,
        |pending| speed_floor * model.curve.prefill_ms(pw * pending + uncached),
        |c| (busy.is_off() || !is_busy(c, busy)).then(|| cfg.cost(req, c).0),
    );
    policy.select(req, candidates, rng)
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
    weights: Option<OrderWeights>,
    early_stop: bool,
    bound: impl Fn(f64) -> f64,
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
    let walked = weights.is_some_and(|weights| {
        g.walk_order(weights, |key, w, load| {
            if early_stop && best.is_finite() {
                let slack = 1e-9 * best.abs().max(1.0);
                if bound(key) > best + slack {
                    return false;
                }
            }
            if is_holder(&candidates[..kept], w) {
                return true;
            }
            let mut c = non_holder(w, load, n);
            if prepare(&mut c) {
                note(&c, &mut best);
                candidates.push(c);
            }
            true
        })
    });
    if !walked {
        // No order to walk (no weights, or weights without a lower bound): every known worker.
        g.walk_order(
            OrderWeights {
                pending: 0.0,
                active: 0.0,
                inflight: 0.0,
            },
            |_, w, load| {
                if !is_holder(&candidates[..kept], w) {
                    let mut c = non_holder(w, load, n);
                    if prepare(&mut c) {
                        candidates.push(c);
                    }
                }
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
