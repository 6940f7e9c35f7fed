//! [`KvIndex`]: which worker holds which KV block, from two sources behind one interface.
//!
//! - **Exact** workers are fed by the engine's KV events ([`KvIndex::apply_stored`],
//!   [`KvIndex::apply_removed`], [`KvIndex::clear_worker`]). The engine's block hash is opaque: we keep a
//!   per-worker map engine hash → router hash, and recompute router hashes from the event's token ids,
//!   chained from the parent's router hash. [`KvIndex::record_predicted`] also inserts the blocks of
//!   a request routed there as *predicted*: they count for queries for a short TTL
//!   ([`KvIndex::set_predicted_ttl`]) until a `BlockStored` event confirms them (then they are ordinary
//!   exact entries), so requests that arrive during the first prefill already see the prefix.
//! - **Approximate** workers publish no events; [`KvIndex::record_routed`] inserts the blocks of every
//!   request we route there, alive for a TTL after last use and bounded by an LRU capacity.
//!
//! Storage is one flat map router hash → [`WorkerSet`] (chained hashes identify the whole prefix, so
//! no tree is needed), laid out in arrival order so a prompt's blocks are mostly adjacent
//! ([`store`]), plus the per-worker state above. A query walks the request's hashes once and
//! extends each worker's run only if it is still unbroken: O(blocks + matching (block, worker) pairs),
//! stopping at the first block no unbroken worker holds.
//!
//! Not internally synchronised: writes take `&mut self`, queries `&self`. Wrap it in an `RwLock` (or
//! shard it) in the caller.

mod approx;
mod overlap;
mod query;
mod store;
pub(crate) mod worker_set;

pub use overlap::OverlapScores;

use crate::hash::next_hash;
use crate::nohash::{table_bytes, HashKeyed, MixKeyed};
use crate::{BlockHash, WorkerId};
use approx::ApproxWorker;
use std::time::{Duration, Instant};
use store::BlockStore;

/// Settings of an approximate worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxConfig {
    /// Lifetime of a block after its last routed use (default 120 s, as Dynamo's `--router-ttl-secs`).
    pub ttl: Duration,
    /// Most blocks remembered for the worker; least recently used go first (default 2^18). Set it to
    /// the worker's `num_gpu_blocks` when known ([`KvIndex::set_capacity`]).
    pub capacity_blocks: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            capacity_blocks: 1 << 18,
        }
    }
}

/// How a worker's blocks are learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IndexMode {
    /// From the engine's KV events.
    #[default]
    Exact,
    /// From our own routing decisions.
    Approximate(ApproxConfig),
}

/// Why an event could not be applied. Nothing is applied when an error is returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexError {
    /// The event's parent block is not known for this worker (missed event, or evicted): the caller
    /// should count it and may re-sync the worker.
    UnknownParent {
        /// The worker.
        worker: WorkerId,
        /// The engine's parent hash.
        parent: u64,
    },
    /// `token_ids.len() != engine_hashes.len() * block_size` (block-size mismatch, or partial block).
    TokenCount {
        /// The worker.
        worker: WorkerId,
        /// Blocks in the event.
        blocks: usize,
        /// Tokens in the event.
        tokens: usize,
        /// The block size the router expects.
        block_size: usize,
    },
    /// Block size 0.
    ZeroBlockSize,
    /// Events for a worker configured as approximate (call [`KvIndex::set_mode`] first).
    NotExact {
        /// The worker.
        worker: WorkerId,
    },
}

impl std::fmt::Display for IndexError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IndexError::UnknownParent { worker, parent } => {
                write!(f, "worker {worker}: stored event's parent block {parent} is unknown")
            }
            IndexError::TokenCount {
                worker,
                blocks,
                tokens,
                block_size,
            } => write!(
                f,
                "worker {worker}: {blocks} blocks with {tokens} tokens do not match block size {block_size}"
            ),
            IndexError::ZeroBlockSize => write!(f, "block size must be at least 1"),
            IndexError::NotExact { worker } => {
                write!(f, "worker {worker} is in approximate mode; KV events are not applied")
            }
        }
    }
}

impl std::error::Error for IndexError {}

/// Default lifetime of a predicted block on an exact worker (see [`KvIndex::set_predicted_ttl`]).
pub const DEFAULT_PREDICTED_TTL: Duration = Duration::from_secs(5);

/// Most predicted (unconfirmed) blocks kept per exact worker; least recently routed go first.
const PREDICTED_CAPACITY: usize = 1 << 16;

#[derive(Debug)]
struct ExactWorker {
    engine_to_router: MixKeyed<BlockHash>,
    /// Router hashes held through more than one engine hash: extra references beyond the first.
    /// Empty in practice (engines hash content too), but it keeps removal correct if they differ.
    extra_refs: HashKeyed<u32>,
    /// Predicted blocks not (yet) confirmed by an event. Disjoint from the confirmed set: a block
    /// the worker holds in `blocks` is confirmed exactly when it is not in here.
    predicted: ApproxWorker,
}

impl Default for ExactWorker {
    fn default() -> Self {
        Self {
            engine_to_router: MixKeyed::default(),
            extra_refs: HashKeyed::default(),
            predicted: ApproxWorker::new(0, PREDICTED_CAPACITY),
        }
    }
}

impl ExactWorker {
    fn distinct(&self) -> usize {
        self.engine_to_router.len() - self.extra_refs.values().map(|&n| n as usize).sum::<usize>()
    }
}

#[derive(Debug)]
enum WorkerIndex {
    Exact(ExactWorker),
    Approx(ApproxWorker),
}

/// The KV block index. See the module docs.
#[derive(Debug)]
pub struct KvIndex {
    blocks: BlockStore,
    workers: Vec<Option<WorkerIndex>>,
    /// (block, worker) pairs, predicted ones included.
    entries: usize,
    /// Predicted (unconfirmed) (block, worker) pairs of exact workers, expired ones not yet dropped
    /// included; when 0, queries skip the predicted-TTL check.
    predicted_entries: usize,
    /// Lifetime of a predicted block; 0 = predictions off.
    predicted_ttl_ns: u64,
    /// Time origin for approximate timestamps (set by the first approximate insert).
    epoch: Option<Instant>,
    /// Approximate workers; when 0, queries skip the per-match TTL check.
    approx_workers: usize,
    /// Each worker that holds blocks with a TTL (approximate, or predicted on an exact worker),
    /// by the time its oldest may expire: a query finds the workers to check by a range, not a
    /// pass over the fleet ([`KvIndex::ttl_check_mask`]).
    due: std::collections::BTreeSet<(u64, u32)>,
    /// Each worker's entry in `due` (by worker id).
    due_of: Vec<Option<u64>>,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self {
            blocks: BlockStore::default(),
            workers: Vec::new(),
            entries: 0,
            predicted_entries: 0,
            predicted_ttl_ns: duration_ns(DEFAULT_PREDICTED_TTL),
            epoch: None,
            approx_workers: 0,
            due: Default::default(),
            due_of: Vec::new(),
        }
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    fn slot(&self, w: WorkerId) -> Option<&WorkerIndex> {
        self.workers.get(w.index()).and_then(|s| s.as_ref())
    }

    fn ns(&self, now: Instant) -> u64 {
        self.epoch.map_or(0, |e| {
            now.saturating_duration_since(e)
                .as_nanos()
                .min(u64::MAX as u128) as u64
        })
    }

    /// Sets a worker's mode (registering it). Changing between exact and approximate drops the
    /// worker's blocks; changing only the approximate settings keeps them (evicting down to the new
    /// capacity).
    pub fn set_mode(&mut self, worker: WorkerId, mode: IndexMode) {
        let i = worker.index();
        if i >= self.workers.len() {
            self.workers.resize_with(i + 1, || None);
        }
        match (&mut self.workers[i], mode) {
            (Some(WorkerIndex::Exact(_)), IndexMode::Exact) => {}
            (Some(WorkerIndex::Approx(a)), IndexMode::Approximate(cfg)) => {
                a.ttl_ns = duration_ns(cfg.ttl);
                a.capacity = cfg.capacity_blocks;
                let blocks = &mut self.blocks;
                let n = a.enforce_capacity(|h| {
                    blocks.unlink(h, worker);
                });
                self.entries -= n;
            }
            _ => {
                self.remove_worker(worker);
                self.workers[i] = Some(match mode {
                    IndexMode::Exact => WorkerIndex::Exact(ExactWorker::default()),
                    IndexMode::Approximate(cfg) => WorkerIndex::Approx(ApproxWorker::new(
                        duration_ns(cfg.ttl),
                        cfg.capacity_blocks,
                    )),
                });
                self.count_approx();
            }
        }
        self.refresh_due(worker);
    }

    /// Re-files worker `w` in `due` after a change to its TTL-bound blocks.
    fn refresh_due(&mut self, w: WorkerId) {
        let due = match self.slot(w) {
            Some(WorkerIndex::Approx(a)) => a.due_ns(),
            Some(WorkerIndex::Exact(ex)) => ex.predicted.due_ns(),
            None => None,
        };
        let i = w.index();
        if i >= self.due_of.len() {
            self.due_of.resize(i + 1, None);
        }
        if self.due_of[i] == due {
            return;
        }
        if let Some(old) = self.due_of[i] {
            self.due.remove(&(old, w.0));
        }
        if let Some(new) = due {
            self.due.insert((new, w.0));
        }
        self.due_of[i] = due;
    }

    fn count_approx(&mut self) {
        self.approx_workers = self
            .workers
            .iter()
            .filter(|s| matches!(s, Some(WorkerIndex::Approx(_))))
            .count();
    }

    /// The worker's mode, `None` if unknown.
    pub fn mode(&self, worker: WorkerId) -> Option<IndexMode> {
        self.slot(worker).map(|s| match s {
            WorkerIndex::Exact(_) => IndexMode::Exact,
            WorkerIndex::Approx(a) => IndexMode::Approximate(ApproxConfig {
                ttl: Duration::from_nanos(a.ttl_ns),
                capacity_blocks: a.capacity,
            }),
        })
    }

    /// Applies a `BlockStored` event: `engine_hashes[i]` holds tokens
    /// `token_ids[i*block_size..(i+1)*block_size]`, chained after `parent_engine_hash` (`None` = the
    /// sequence's first block). Router hashes are recomputed from the tokens with `seed` (see
    /// [`crate::hash_seed`]). Idempotent. An unknown worker is registered as exact. Returns the number
    /// of (block, worker) entries newly confirmed (new, or predicted until now).
    pub fn apply_stored(
        &mut self,
        worker: WorkerId,
        parent_engine_hash: Option<u64>,
        engine_hashes: &[u64],
        token_ids: &[u32],
        block_size: usize,
        seed: u64,
    ) -> Result<usize, IndexError> {
        if block_size == 0 {
            return Err(IndexError::ZeroBlockSize);
        }
        if token_ids.len() != engine_hashes.len().saturating_mul(block_size) {
            return Err(IndexError::TokenCount {
                worker,
                blocks: engine_hashes.len(),
                tokens: token_ids.len(),
                block_size,
            });
        }
        if self.slot(worker).is_none() {
            self.set_mode(worker, IndexMode::Exact);
        }
        let Some(WorkerIndex::Exact(ex)) = self.workers[worker.index()].as_mut() else {
            return Err(IndexError::NotExact { worker });
        };
        let blocks = &mut self.blocks;
        let mut parent = match parent_engine_hash {
            None => None,
            Some(p) => match ex.engine_to_router.get(&p) {
                Some(&r) => Some(r),
                None => return Err(IndexError::UnknownParent { worker, parent: p }),
            },
        };
        // Slot of the previous block: new blocks go right after it when that slot is free.
        let mut prev = parent.and_then(|p| blocks.find(p));
        let mut added = 0;
        let mut confirmed = 0;
        for (&e, block) in engine_hashes.iter().zip(token_ids.chunks_exact(block_size)) {
            let r = next_hash(parent, block, seed);
            parent = Some(r);
            match ex.engine_to_router.insert(e, r) {
                Some(old) if old == r => {
                    prev = blocks.find_after(prev, r);
                    continue;
                }
                // The engine reused a hash for other content: forget the old mapping first.
                Some(old) if release(ex, blocks, old, worker) => self.entries -= 1,
                _ => {}
            }
            let (slot, new) = blocks.link(r, worker, prev);
            prev = Some(slot);
            if new {
                added += 1;
            } else if ex.predicted.remove(r) {
                // A prediction came true: same entry, now confirmed (and no longer subject to TTL).
                confirmed += 1;
            } else {
                *ex.extra_refs.entry(r).or_insert(0) += 1;
            }
        }
        self.entries += added;
        self.predicted_entries -= confirmed;
        if confirmed > 0 {
            self.refresh_due(worker);
        }
        Ok(added + confirmed)
    }

    /// Applies a `BlockRemoved` event. Unknown hashes are ignored (already removed, or never seen).
    /// Returns the number of engine hashes that were known.
    pub fn apply_removed(&mut self, worker: WorkerId, engine_hashes: &[u64]) -> usize {
        let Some(Some(WorkerIndex::Exact(ex))) = self.workers.get_mut(worker.index()) else {
            return 0;
        };
        let mut known = 0;
        for e in engine_hashes {
            if let Some(r) = ex.engine_to_router.remove(e) {
                known += 1;
                if release(ex, &mut self.blocks, r, worker) {
                    self.entries -= 1;
                }
            }
        }
        known
    }

    /// Drops every block of the worker (`AllBlocksCleared`, engine restart) but keeps its mode.
    pub fn clear_worker(&mut self, worker: WorkerId) {
        let Some(Some(slot)) = self.workers.get_mut(worker.index()) else {
            return;
        };
        let blocks = &mut self.blocks;
        let mut n = 0;
        match slot {
            WorkerIndex::Exact(ex) => {
                for (_, r) in ex.engine_to_router.drain() {
                    if blocks.unlink(r, worker) {
                        n += 1;
                    }
                }
                ex.extra_refs.clear();
                let mut p = 0;
                ex.predicted.drain(|h| {
                    if blocks.unlink(h, worker) {
                        p += 1;
                    }
                });
                n += p;
                self.predicted_entries -= p;
            }
            WorkerIndex::Approx(a) => a.drain(|h| {
                if blocks.unlink(h, worker) {
                    n += 1;
                }
            }),
        }
        self.entries -= n;
        self.refresh_due(worker);
    }

    /// Forgets the worker entirely (blocks and mode).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.clear_worker(worker);
        if let Some(slot) = self.workers.get_mut(worker.index()) {
            *slot = None;
        }
        self.count_approx();
        self.refresh_due(worker);
    }

    /// Approximate mode: records that the request with these chained hashes was routed to `worker`
    /// at `now` (new blocks inserted, known ones refreshed, LRU beyond capacity evicted). An unknown
    /// worker is registered as approximate with [`ApproxConfig::default`]; an exact worker ignores
    /// this (returns 0). Returns the number of new blocks.
    pub fn record_routed(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Instant) -> usize {
        if self.epoch.is_none() {
            self.epoch = Some(now);
        }
        if self.slot(worker).is_none() {
            self.set_mode(worker, IndexMode::Approximate(ApproxConfig::default()));
        }
        let now_ns = self.ns(now);
        let Some(WorkerIndex::Approx(a)) = self.workers[worker.index()].as_mut() else {
            return 0;
        };
        let blocks = &mut self.blocks;
        let mut gone = a.expire(now_ns, |h| {
            blocks.unlink(h, worker);
        });
        let mut added = 0;
        // Slot of the previous block, found only when a new block needs it as a placement hint.
        let mut prev = None;
        a.touch_each(hashes, now_ns, |i, new| {
            if new {
                let after = prev.or_else(|| i.checked_sub(1).and_then(|j| blocks.find(hashes[j])));
                prev = Some(blocks.link(hashes[i], worker, after).0);
                added += 1;
            } else {
                prev = None;
            }
        });
        gone += a.enforce_capacity(|h| {
            blocks.unlink(h, worker);
        });
        self.entries = self.entries + added - gone;
        self.refresh_due(worker);
        added
    }

    /// Drops approximate blocks and unconfirmed predicted blocks whose TTL has passed. Returns how
    /// many (block, worker) entries went.
    pub fn expire(&mut self, now: Instant) -> usize {
        let now_ns = self.ns(now);
        let blocks = &mut self.blocks;
        let mut gone = 0;
        let mut predicted_gone = 0;
        for (i, slot) in self.workers.iter_mut().enumerate() {
            let w = WorkerId(i as u32);
            match slot {
                Some(WorkerIndex::Approx(a)) => {
                    gone += a.expire(now_ns, |h| {
                        blocks.unlink(h, w);
                    });
                }
                Some(WorkerIndex::Exact(ex)) if ex.predicted.len() > 0 => {
                    predicted_gone += ex.predicted.expire(now_ns, |h| {
                        blocks.unlink(h, w);
                    });
                }
                _ => {}
            }
        }
        self.entries -= gone + predicted_gone;
        self.predicted_entries -= predicted_gone;
        for i in 0..self.workers.len() {
            self.refresh_due(WorkerId(i as u32));
        }
        gone + predicted_gone
    }

    /// Sets how long a predicted block of an exact worker counts without an event confirming it
    /// (default [`DEFAULT_PREDICTED_TTL`]; zero turns predictions off). Applies to existing
    /// predictions too: their deadline becomes last prediction + `ttl` (with zero they stop counting
    /// at once and go at the next [`KvIndex::expire`]).
    pub fn set_predicted_ttl(&mut self, ttl: Duration) {
        self.predicted_ttl_ns = duration_ns(ttl);
        for slot in self.workers.iter_mut().flatten() {
            if let WorkerIndex::Exact(ex) = slot {
                ex.predicted.ttl_ns = self.predicted_ttl_ns;
            }
        }
        for i in 0..self.workers.len() {
            self.refresh_due(WorkerId(i as u32));
        }
    }

    /// The predicted-block lifetime (zero = predictions off).
    pub fn predicted_ttl(&self) -> Duration {
        Duration::from_nanos(self.predicted_ttl_ns)
    }

    /// Exact mode: predicts that the request with these chained hashes, just routed to `worker` at
    /// `now`, will make the worker hold its blocks. Blocks the worker does not hold yet count as
    /// held for queries for [`KvIndex::predicted_ttl`] (refreshed when predicted again) unless a
    /// `BlockStored` event confirms them first, or the worker is cleared or removed. Confirmed
    /// blocks are left alone. No effect (returns 0) on approximate or unknown workers, or when
    /// predictions are off. Returns the number of newly predicted blocks.
    pub fn record_predicted(
        &mut self,
        worker: WorkerId,
        hashes: &[BlockHash],
        now: Instant,
    ) -> usize {
        if self.predicted_ttl_ns == 0 || hashes.is_empty() {
            return 0;
        }
        if self.epoch.is_none() {
            self.epoch = Some(now);
        }
        let now_ns = self.ns(now);
        let Some(Some(WorkerIndex::Exact(ex))) = self.workers.get_mut(worker.index()) else {
            return 0;
        };
        let blocks = &mut self.blocks;
        let p = &mut ex.predicted;
        p.ttl_ns = self.predicted_ttl_ns;
        let mut gone = p.expire(now_ns, |h| {
            blocks.unlink(h, worker);
        });
        let mut added = 0;
        // Slot of the previous block, found only when a new block needs it as a placement hint.
        let mut prev = None;
        for (i, &h) in hashes.iter().enumerate() {
            if p.contains(h) {
                p.touch(h, now_ns);
                prev = None;
                continue;
            }
            let after = prev.or_else(|| i.checked_sub(1).and_then(|j| blocks.find(hashes[j])));
            let (slot, new) = blocks.link(h, worker, after);
            prev = Some(slot);
            if new {
                p.touch(h, now_ns);
                added += 1;
            } // else: held and not predicted, i.e. confirmed
        }
        gone += p.enforce_capacity(|h| {
            blocks.unlink(h, worker);
        });
        self.entries = self.entries + added - gone;
        self.predicted_entries = self.predicted_entries + added - gone;
        self.refresh_due(worker);
        added
    }

    /// Distinct blocks the worker holds; for an exact worker only the confirmed ones (see
    /// [`KvIndex::predicted_blocks_for`]).
    pub fn blocks_for(&self, worker: WorkerId) -> usize {
        match self.slot(worker) {
            None => 0,
            Some(WorkerIndex::Exact(ex)) => ex.distinct(),
            Some(WorkerIndex::Approx(a)) => a.len(),
        }
    }

    /// Predicted, not yet confirmed blocks of an exact worker (expired ones that [`KvIndex::expire`]
    /// has not dropped yet included). 0 for other workers.
    pub fn predicted_blocks_for(&self, worker: WorkerId) -> usize {
        match self.slot(worker) {
            Some(WorkerIndex::Exact(ex)) => ex.predicted.len(),
            _ => 0,
        }
    }

    /// (block, worker) pairs over all workers, predicted ones included.
    pub fn total_entries(&self) -> usize {
        self.entries
    }

    /// The predicted (unconfirmed) part of [`KvIndex::total_entries`].
    pub fn predicted_entries(&self) -> usize {
        self.predicted_entries
    }

    /// Distinct blocks over all workers.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Whether `worker` holds the router hash `h` (ignoring TTL).
    pub fn contains(&self, worker: WorkerId, h: BlockHash) -> bool {
        self.blocks.get(h).is_some_and(|s| s.contains(worker))
    }

    /// How many leading blocks of `hashes` the worker holds, predicted ones included (ignoring
    /// TTL: for accounting, not for routing).
    pub fn held_prefix(&self, worker: WorkerId, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|&&h| self.contains(worker, h))
            .count()
    }

    /// The engine hashes the worker holds (exact mode), sorted. For tests and debugging.
    pub fn engine_hashes(&self, worker: WorkerId) -> Vec<u64> {
        let mut v: Vec<u64> = match self.slot(worker) {
            Some(WorkerIndex::Exact(ex)) => ex.engine_to_router.keys().copied().collect(),
            _ => Vec::new(),
        };
        v.sort_unstable();
        v
    }

    /// The router hashes the worker holds, sorted and deduplicated; for an exact worker only the
    /// confirmed ones (what its events said). For tests and debugging.
    pub fn router_hashes(&self, worker: WorkerId) -> Vec<BlockHash> {
        let mut v: Vec<u64> = match self.slot(worker) {
            Some(WorkerIndex::Exact(ex)) => ex.engine_to_router.values().copied().collect(),
            Some(WorkerIndex::Approx(a)) => a.hashes().collect(),
            None => Vec::new(),
        };
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The router hash an engine hash maps to on this worker (exact mode).
    pub fn router_hash_of(&self, worker: WorkerId, engine_hash: u64) -> Option<BlockHash> {
        match self.slot(worker) {
            Some(WorkerIndex::Exact(ex)) => ex.engine_to_router.get(&engine_hash).copied(),
            _ => None,
        }
    }

    /// Sets an approximate worker's capacity (e.g. from its scraped `num_gpu_blocks`), evicting
    /// least recently used blocks beyond it. No effect on exact or unknown workers.
    pub fn set_capacity(&mut self, worker: WorkerId, blocks: usize) {
        if let Some(IndexMode::Approximate(mut cfg)) = self.mode(worker) {
            cfg.capacity_blocks = blocks;
            self.set_mode(worker, IndexMode::Approximate(cfg));
        }
    }

    /// Estimated heap bytes of all index structures (from table capacities), for the memory metric.
    pub fn heap_bytes(&self) -> usize {
        let mut n = self.blocks.heap_bytes();
        n += self.workers.capacity() * std::mem::size_of::<Option<WorkerIndex>>();
        for slot in self.workers.iter().flatten() {
            n += match slot {
                WorkerIndex::Exact(ex) => {
                    table_bytes(ex.engine_to_router.capacity(), 16)
                        + table_bytes(ex.extra_refs.capacity(), 16)
                        + ex.predicted.heap_bytes()
                }
                WorkerIndex::Approx(a) => a.heap_bytes(),
            };
        }
        n
    }
}

/// Drops one reference of `worker` to router hash `r`; true when the worker no longer holds it.
fn release(ex: &mut ExactWorker, blocks: &mut BlockStore, r: BlockHash, worker: WorkerId) -> bool {
    // `extra_refs` is empty in practice: skip even hashing into it.
    if let Some(n) = (!ex.extra_refs.is_empty())
        .then(|| ex.extra_refs.get_mut(&r))
        .flatten()
    {
        *n -= 1;
        if *n == 0 {
            ex.extra_refs.remove(&r);
        }
        return false;
    }
    blocks.unlink(r, worker)
}

fn duration_ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

#[cfg(test)]
mod predicted_tests;
#[cfg(test)]
mod tests;
