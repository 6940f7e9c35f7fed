//! [`LoadOrder`]: the known workers sorted by a weighted sum of their router-side load, kept up to
//! date as load comes and goes (O(log workers) per change), so a selection can visit the least
//! loaded workers first and stop early instead of scoring the whole fleet
//! ([`crate::select::bounded`]).
//!
//! The weights are the cost model's (see [`OrderWeights::for_kv`]): for a worker that holds none
//! of the prompt's blocks the `kv` cost is a constant of the request plus exactly this key, so the
//! order is the order of those workers' costs.

use super::WorkerLoad;
use crate::WorkerId;
use std::collections::BTreeSet;

/// Weights of a load order: key = `pending` · pending prefill tokens + `active` · active blocks +
/// `inflight` · in-flight requests. All finite and ≥ 0 (else [`OrderWeights::valid`] is false and
/// no order is kept).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OrderWeights {
    /// Per pending prefill token.
    pub pending: f64,
    /// Per active block.
    pub active: f64,
    /// Per in-flight request.
    pub inflight: f64,
}

impl OrderWeights {
    /// The `kv` cost model's load terms for block size `block_size` (see [`crate::KvCostConfig`]).
    pub fn for_kv(cfg: &crate::KvCostConfig, block_size: u32) -> Self {
        OrderWeights {
            pending: cfg.prefill_weight * cfg.pending_weight / f64::from(block_size.max(1)),
            active: 1.0,
            inflight: cfg.request_weight,
        }
    }

    /// Whether the key is a usable lower bound (finite, non-negative weights).
    pub fn valid(&self) -> bool {
        [self.pending, self.active, self.inflight]
            .iter()
            .all(|w| w.is_finite() && *w >= 0.0)
    }

    /// The key of a load.
    #[inline]
    pub fn key(&self, l: &WorkerLoad) -> f64 {
        self.pending * l.pending_prefill_tokens as f64
            + self.active * f64::from(l.active_blocks)
            + self.inflight * f64::from(l.inflight)
    }
}

/// Known workers sorted by [`OrderWeights::key`] of their load, ties by worker id.
#[derive(Debug)]
pub(crate) struct LoadOrder {
    pub(crate) weights: OrderWeights,
    /// (key bits, worker): keys are ≥ 0 and finite, whose IEEE bits sort like the values.
    set: BTreeSet<(u64, u32)>,
    /// Each worker's current entry in `set` (by worker id; `None` = not in the order).
    keys: Vec<Option<u64>>,
}

impl LoadOrder {
    pub(crate) fn new(weights: OrderWeights) -> Self {
        LoadOrder {
            weights,
            set: BTreeSet::new(),
            keys: Vec::new(),
        }
    }

    /// Sets (or inserts) worker `w`'s load.
    pub(crate) fn update(&mut self, w: WorkerId, load: &WorkerLoad) {
        // `+ 0.0` turns a −0.0 into +0.0, whose bits sort first.
        let bits = (self.weights.key(load) + 0.0).to_bits();
        let i = w.index();
        if i >= self.keys.len() {
            self.keys.resize(i + 1, None);
        }
        match self.keys[i] {
            Some(old) if old == bits => return,
            Some(old) => {
                self.set.remove(&(old, w.0));
            }
            None => {}
        }
        self.set.insert((bits, w.0));
        self.keys[i] = Some(bits);
    }

    /// Forgets worker `w`.
    pub(crate) fn remove(&mut self, w: WorkerId) {
        if let Some(old) = self.keys.get_mut(w.index()).and_then(Option::take) {
            self.set.remove(&(old, w.0));
        }
    }

    /// Workers in ascending key order, with their keys.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (f64, WorkerId)> + '_ {
        self.set
            .iter()
            .map(|&(k, w)| (f64::from_bits(k), WorkerId(w)))
    }
}
