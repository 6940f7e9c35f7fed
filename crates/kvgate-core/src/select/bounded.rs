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
//! Contract: a worker is seen as a non-holder only once [`crate::ActiveSequences`] knows it
//! ([`crate::ActiveSequences::add_worker`] when it joins, or its first request).

use super::{is_busy, Candidate, Decision, RouteRequest};
use crate::index::{KvIndex, OverlapScores};
use crate::load::{ActiveSequences, OrderWeights};
use crate::policy::{KvPolicy, Policy};
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
    mut prepare: impl FnMut(&mut Candidate) -> bool,
    rng: &mut fastrand::Rng,
) -> Option<Decision> {
    let cfg = policy.config();
    let busy = policy.busy();
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
        if busy.is_off() || !is_busy(c, busy) {
            let cost = cfg.cost(req, c);
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
    // Every non-holder's cost is this plus its load key (module docs).
    let base =
        cfg.prefill_weight * (req.isl_tokens as f64 / f64::from(req.block_size.max(1))) + n as f64;
    let exhaustive = cfg.temperature > 0.0;
    let weights = OrderWeights::for_kv(cfg, req.block_size);
    let walked = g.walk_order(weights, |key, w, load| {
        if !exhaustive && best.is_finite() {
            let bound = base + key;
            let slack = 1e-9 * best.abs().max(1.0);
            if bound > best + slack {
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
    });
    debug_assert!(walked || !weights.valid());
    if !walked {
        // No order to walk (weights without a lower bound): every known worker.
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
    drop(g);
    policy.select(req, candidates, rng)
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
