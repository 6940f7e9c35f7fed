//! Applying decoded KV events to [`kvgate_core::KvIndex`], and [`IndexSink`], a ready-made
//! [`FleetSink`] that keeps an index (used by tests and usable by the gateway).
//!
//! Router hashes are recomputed from `token_ids` chained through the engine's parent hash (the core
//! keeps the engine → router map), so the engine's hash function never matters. Events are skipped,
//! not applied, when they cannot be mapped: offload-tier events (no tokens), short/partial pages
//! (SGLang's trailing page), non-zero KV groups of hybrid models, and block sizes other than the
//! pool's (reported separately through `on_block_size`).

use parking_lot::RwLock;
use std::sync::Arc;

use kvgate_core::{hash_seed, IndexError, KvIndex, WorkerId};
use kvgate_protocol::kv_events::{KvEvent, KvEventBatch, Medium};

use crate::sink::{FleetSink, ResetReason, ScrapedLoad};

/// What happened to the events of one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    pub stored_blocks: usize,
    pub removed_blocks: usize,
    pub cleared: bool,
    /// Hashes-only events of an offload tier.
    pub tier_only: usize,
    /// Events of another medium or group, or partial pages: nothing the router scores.
    pub skipped: usize,
    /// Events whose block size differs from the pool's.
    pub block_size_mismatch: Option<u32>,
    /// Stored events whose parent was unknown (missed history).
    pub unknown_parent: usize,
}

/// Applies one batch for `worker` at the pool's `block_size`.
pub fn apply_batch(
    index: &mut KvIndex,
    worker: WorkerId,
    batch: &KvEventBatch,
    block_size: u32,
) -> ApplyOutcome {
    let mut out = ApplyOutcome::default();
    for ev in &batch.events {
        match ev {
            KvEvent::AllCleared => {
                index.clear_worker(worker);
                out.cleared = true;
            }
            KvEvent::Stored { .. } if ev.is_tier_only() => out.tier_only += 1,
            KvEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size: bs,
                lora_name,
                medium,
                group_idx,
                ..
            } => {
                if *medium != Medium::Gpu || *group_idx != 0 {
                    out.skipped += 1;
                    continue;
                }
                if *bs != block_size {
                    // SGLang's trailing page is shorter than its page size: not a mismatch.
                    if token_ids.len() < *bs as usize || *bs == 0 {
                        out.skipped += 1;
                    } else {
                        out.block_size_mismatch = Some(*bs);
                    }
                    continue;
                }
                let seed = hash_seed(lora_name.as_deref(), None);
                match index.apply_stored(
                    worker,
                    *parent,
                    block_hashes,
                    token_ids,
                    block_size as usize,
                    seed,
                ) {
                    Ok(n) => out.stored_blocks += n,
                    Err(IndexError::UnknownParent { .. }) => out.unknown_parent += 1,
                    Err(IndexError::TokenCount { .. }) => out.skipped += 1,
                    Err(IndexError::ZeroBlockSize | IndexError::NotExact { .. }) => {
                        out.skipped += 1
                    }
                }
            }
            KvEvent::Removed {
                block_hashes,
                medium,
                group_idx,
            } => {
                if *medium != Medium::Gpu || *group_idx != 0 {
                    out.skipped += 1;
                    continue;
                }
                out.removed_blocks += index.apply_removed(worker, block_hashes);
            }
        }
    }
    out
}

/// A [`FleetSink`] that applies events to a shared [`KvIndex`] and remembers the last load.
/// Holds the write lock only for the duration of one batch.
pub struct IndexSink {
    pub index: Arc<RwLock<KvIndex>>,
    pub block_size: u32,
    state: RwLock<Vec<WorkerView>>,
}

/// What [`IndexSink`] knows about one worker.
#[derive(Debug, Clone, Default)]
pub struct WorkerView {
    pub load: Option<ScrapedLoad>,
    pub stale: bool,
    pub up: Option<bool>,
    pub block_size_mismatch: Option<u32>,
    pub resets: Vec<ResetReason>,
    pub last: ApplyOutcome,
    pub unknown_parents: usize,
    /// Seq of the last batch delivered.
    pub last_seq: Option<u64>,
    /// Batches delivered.
    pub batches: u64,
    /// Blocks added and removed over the worker's lifetime.
    pub stored_total: usize,
    pub removed_total: usize,
    pub kind: Option<crate::WorkerKind>,
    pub role: Option<crate::DetectedRole>,
}

impl IndexSink {
    pub fn new(index: Arc<RwLock<KvIndex>>, block_size: u32) -> Self {
        IndexSink {
            index,
            block_size,
            state: RwLock::new(Vec::new()),
        }
    }

    fn with<R>(&self, w: WorkerId, f: impl FnOnce(&mut WorkerView) -> R) -> R {
        let mut s = self.state.write();
        if s.len() <= w.index() {
            s.resize_with(w.index() + 1, WorkerView::default);
        }
        f(&mut s[w.index()])
    }

    /// A copy of what is known about `worker`.
    pub fn view(&self, worker: WorkerId) -> WorkerView {
        self.with(worker, |v| v.clone())
    }
}

impl FleetSink for IndexSink {
    fn on_load(&self, worker: WorkerId, load: &ScrapedLoad) {
        self.with(worker, |v| {
            v.load = Some(load.clone());
            v.stale = false;
        });
    }
    fn on_load_stale(&self, worker: WorkerId) {
        self.with(worker, |v| v.stale = true);
    }
    fn on_block_size(&self, worker: WorkerId, engine_block_size: u32, _configured: u32) {
        self.with(worker, |v| v.block_size_mismatch = Some(engine_block_size));
    }
    fn on_block_size_agrees(&self, worker: WorkerId) {
        self.with(worker, |v| v.block_size_mismatch = None);
    }
    fn on_kv_events(&self, worker: WorkerId, batch: &KvEventBatch) {
        let out = apply_batch(&mut self.index.write(), worker, batch, self.block_size);
        self.with(worker, |v| {
            v.unknown_parents += out.unknown_parent;
            v.last = out;
            v.last_seq = Some(batch.seq);
            v.batches += 1;
            v.stored_total += out.stored_blocks;
            v.removed_total += out.removed_blocks;
        });
    }
    fn on_kv_reset(&self, worker: WorkerId, reason: ResetReason) {
        self.index.write().clear_worker(worker);
        self.with(worker, |v| v.resets.push(reason));
    }
    fn on_health(&self, worker: WorkerId, up: bool) {
        self.with(worker, |v| v.up = Some(up));
    }
    fn on_kind(&self, worker: WorkerId, kind: crate::WorkerKind) {
        self.with(worker, |v| v.kind = Some(kind));
    }
    fn on_role(&self, worker: WorkerId, role: &crate::DetectedRole) {
        self.with(worker, |v| v.role = Some(*role));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::block_hashes;

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: Vec<u32>,
        bs: u32,
        medium: Medium,
    ) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens,
            block_size: bs,
            lora_id: None,
            lora_name: None,
            medium,
            group_idx: 0,
        }
    }

    fn batch(events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch {
            seq: 0,
            ts: 0.0,
            dp_rank: Some(0),
            events,
        }
    }

    #[test]
    fn stored_chains_match_router_hashes_and_removal_resolves() {
        let mut idx = KvIndex::new();
        let w = WorkerId(1);
        let toks: Vec<u32> = (0..48).collect();
        let b = batch(vec![
            stored(&[900, 901], None, toks[..32].to_vec(), 16, Medium::Gpu),
            stored(&[902], Some(901), toks[32..].to_vec(), 16, Medium::Gpu),
            stored(&[903], None, vec![], 0, Medium::Cpu),
            stored(&[904], Some(902), (0..7).collect(), 32, Medium::Gpu), // short trailing page
            stored(&[905], Some(777), (0..16).collect(), 16, Medium::Gpu),
        ]);
        let out = apply_batch(&mut idx, w, &b, 16);
        assert_eq!(out.stored_blocks, 3);
        assert_eq!((out.tier_only, out.skipped, out.unknown_parent), (1, 1, 1));
        assert_eq!(out.block_size_mismatch, None);
        let expect = block_hashes(&toks, 16, hash_seed(None, None));
        assert!(expect.iter().all(|&h| idx.contains(w, h)));
        let out = apply_batch(
            &mut idx,
            w,
            &batch(vec![KvEvent::Removed {
                block_hashes: vec![902, 999],
                medium: Medium::Gpu,
                group_idx: 0,
            }]),
            16,
        );
        assert_eq!(out.removed_blocks, 1);
        assert!(!idx.contains(w, expect[2]));
        assert!(idx.contains(w, expect[1]));
        let out = apply_batch(&mut idx, w, &batch(vec![KvEvent::AllCleared]), 16);
        assert!(out.cleared);
        assert_eq!(idx.blocks_for(w), 0);
    }

    #[test]
    fn full_blocks_of_another_size_are_a_mismatch() {
        let mut idx = KvIndex::new();
        let out = apply_batch(
            &mut idx,
            WorkerId(0),
            &batch(vec![stored(
                &[1, 2],
                None,
                (0..64).collect(),
                32,
                Medium::Gpu,
            )]),
            16,
        );
        assert_eq!(out.block_size_mismatch, Some(32));
        assert_eq!(idx.blocks_for(WorkerId(0)), 0);
    }
}
