//! [`ActiveSequences`]: router-side load per worker, counted from the moment of dispatch (before the
//! worker's own metrics can show it, which is what stops herding):
//! - unique active blocks (refcounted, so a prefix shared by several in-flight requests counts once);
//! - pending prefill tokens (ISL − cached) until the request's first output token;
//! - in-flight requests.
//!
//! [`ActiveSequences::add`] returns a [`LoadGuard`]; dropping the guard frees the request's load, so
//! every exit path (completion, cancel, error, panic unwind) releases it. A safety net,
//! [`ActiveSequences::expire_stale`], drops entries older than a bound (guards of expired entries then
//! free nothing).
//!
//! Beside each worker's refcounted blocks, an inverse map block → set of workers where it is active
//! lets [`ActiveSequences::fill_loads`] score every candidate in one walk over the prompt instead of
//! one search per worker.
//!
//! A block whose count drops to zero keeps its map entries (count 0, empty worker set) until idle
//! entries outnumber live ones ([`SWEEP_MIN`] at least): a prefix every request shares (a system
//! prompt) goes 0 → 1 → 0 on each request at low concurrency, and re-inserting and removing its
//! entries each time was most of the bookkeeping.
//!
//! Thread-safe: one `std::sync::Mutex` inside an `Arc`, held only for short, allocation-free sections.

use crate::index::worker_set::{bits, WorkerSet};
use crate::nohash::HashKeyed;
use crate::select::Candidate;
use crate::{BlockHash, WorkerId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A worker's router-side load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerLoad {
    /// Unique blocks of in-flight requests.
    pub active_blocks: u32,
    /// Prompt tokens not yet prefilled (ISL − cached of requests without a first token yet).
    pub pending_prefill_tokens: u64,
    /// Requests in flight.
    pub inflight: u32,
}

#[derive(Debug)]
struct Entry {
    request_id: u64,
    hashes: Vec<BlockHash>,
    /// Still-pending prefill tokens (0 once the first token arrived).
    prefill: u64,
    started: Instant,
}

/// Idle entries (count 0, or an empty worker set) are dropped once there are more of them than
/// live ones and at least this many.
const SWEEP_MIN: usize = 4096;

#[derive(Debug, Default)]
struct WorkerState {
    /// Router hash → number of in-flight requests on this worker that include it (0: idle entry).
    blocks: HashKeyed<u32>,
    /// Entries of `blocks` with a count above 0.
    active_blocks: u32,
    pending_prefill_tokens: u64,
    requests: HashMap<u64, Entry, std::hash::BuildHasherDefault<crate::nohash::MixHasher>>,
}

impl WorkerState {
    fn load(&self) -> WorkerLoad {
        WorkerLoad {
            active_blocks: self.active_blocks,
            pending_prefill_tokens: self.pending_prefill_tokens,
            inflight: self.requests.len() as u32,
        }
    }

    /// Blocks of a chained-hash sequence not active here. Active blocks are unions of whole chained
    /// prefixes, so the active part of a request is itself a prefix: gallop, then binary search, for
    /// O(log n) lookups instead of n.
    fn new_blocks(&self, hashes: &[BlockHash]) -> u32 {
        let active = |i: usize| self.blocks.get(&hashes[i]).is_some_and(|&n| n > 0);
        let n = hashes.len();
        if n == 0 || !active(0) {
            return n as u32;
        }
        (n - prefix_end(0, n, active)) as u32
    }

    /// Frees request `key` of worker `w` (this state), keeping the inverse map `active` in step.
    fn free(&mut self, w: WorkerId, key: u64, pool: &mut Vec<Vec<BlockHash>>, active: &mut Active) {
        let Some(mut e) = self.requests.remove(&key) else {
            return;
        };
        self.pending_prefill_tokens -= e.prefill;
        for h in &e.hashes {
            if let Some(n) = self.blocks.get_mut(h) {
                if *n == 0 {
                    continue; // a duplicate hash in the request, already freed
                }
                *n -= 1;
                if *n == 0 {
                    self.active_blocks -= 1;
                    active.unlink(*h, w);
                }
            }
        }
        if pool.len() < POOL_MAX {
            e.hashes.clear();
            pool.push(e.hashes);
        }
        if self.blocks.len() > SWEEP_MIN.max(2 * self.active_blocks as usize) {
            self.blocks.retain(|_, n| *n > 0);
        }
    }
}

/// Router hash → workers where it is active (refcount > 0 in their `blocks`); the union of the
/// workers' block maps, inverted. Sets that became empty stay until swept.
#[derive(Debug, Default)]
struct Active {
    sets: HashKeyed<WorkerSet>,
    /// Entries of `sets` that are empty.
    empty: usize,
}

impl Active {
    fn get(&self, h: &BlockHash) -> Option<&WorkerSet> {
        self.sets.get(h).filter(|s| !s.is_empty())
    }

    /// Adds `w` to the workers where `h` is active.
    fn link(&mut self, h: BlockHash, w: WorkerId) {
        use std::collections::hash_map::Entry;
        match self.sets.entry(h) {
            Entry::Occupied(e) => {
                let set = e.into_mut();
                if set.is_empty() {
                    self.empty -= 1;
                }
                set.insert(w);
            }
            Entry::Vacant(e) => {
                e.insert(WorkerSet::default()).insert(w);
            }
        }
    }

    /// Removes `w` from the workers where `h` is active.
    fn unlink(&mut self, h: BlockHash, w: WorkerId) {
        if let Some(set) = self.sets.get_mut(&h) {
            if set.remove(w) && set.is_empty() {
                self.empty += 1;
            }
        }
    }

    fn maybe_sweep(&mut self) {
        if self.empty > SWEEP_MIN.max(self.sets.len() - self.empty) {
            self.sets.retain(|_, s| !s.is_empty());
            self.empty = 0;
        }
    }
}

/// Recycled hash buffers, so steady-state `add` does not allocate.
const POOL_MAX: usize = 256;

#[derive(Debug, Default)]
struct Inner {
    workers: Vec<Option<WorkerState>>,
    /// Block → workers where it is active.
    active: Active,
    /// Scratch of [`ActiveSequences::fill_loads`], sized with `workers`: per worker, how many leading
    /// prompt blocks are active there, and the 64-worker words still matching.
    depth: Vec<u32>,
    alive: Vec<u64>,
    next_key: u64,
    pool: Vec<Vec<BlockHash>>,
}

impl Inner {
    /// Sets `depth[w]` to the length of the prompt's longest prefix active on worker `w`, for every
    /// known worker, from the inverse map. Active blocks are unions of whole chained prefixes, so the
    /// workers where block `i` is active only shrink as `i` grows, and a worker's depth is where it
    /// leaves that set (as in [`WorkerState::new_blocks`], the prefix is then exactly the worker's
    /// active part of the prompt). Each run of blocks with the same still-matching workers is
    /// skipped by galloping then bisecting, so a prompt costs O(log n) lookups per distinct depth
    /// (one lookup for a run of length 1) instead of a search in each worker's own map.
    fn active_prefix_depths(&mut self, hashes: &[BlockHash]) {
        let Inner {
            active,
            depth,
            alive,
            ..
        } = self;
        depth.fill(0);
        let n = hashes.len();
        let Some(first) = hashes.first().and_then(|h| active.get(h)) else {
            return;
        };
        for (k, a) in alive.iter_mut().enumerate() {
            *a = first.word(k);
        }
        // Whether every worker still in `alive` has block `i` active.
        let covers = |alive: &[u64], i: usize| match active.get(&hashes[i]) {
            Some(s) => alive.iter().enumerate().all(|(k, &a)| s.word(k) & a == a),
            None => false,
        };
        // Invariant: `alive` is non-empty and has blocks 0..=lo active.
        let mut lo = 0usize;
        loop {
            let hi = prefix_end(lo, n, |i| covers(alive, i));
            // Block `hi` is the first one some alive worker lacks: those stop at depth `hi`.
            let set = hashes.get(hi).and_then(|h| active.get(h));
            let mut any = false;
            for (k, a) in alive.iter_mut().enumerate() {
                let still = set.map_or(0, |s| s.word(k)) & *a;
                for w in bits(k, *a & !still) {
                    depth[w.index()] = hi as u32;
                }
                *a = still;
                any |= still != 0;
            }
            if !any {
                return;
            }
            lo = hi;
        }
    }

    fn worker(&self, w: WorkerId) -> Option<&WorkerState> {
        self.workers.get(w.index()).and_then(|s| s.as_ref())
    }
    fn worker_mut(&mut self, w: WorkerId) -> Option<&mut WorkerState> {
        self.workers.get_mut(w.index()).and_then(|s| s.as_mut())
    }
}

/// The first index in `lo + 1..n` where `holds` is false, or `n`, given that `holds` is true on
/// `0..=lo` and, once false, stays false: gallop forward, then bisect (O(log n) calls).
fn prefix_end(mut lo: usize, n: usize, mut holds: impl FnMut(usize) -> bool) -> usize {
    let (mut step, mut hi) = (1usize, n);
    while lo + step < n {
        if holds(lo + step) {
            lo += step;
            step *= 2;
        } else {
            hi = lo + step;
            break;
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if holds(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

/// Router-side active load of every worker. Cheap to clone (shared state).
#[derive(Debug, Clone, Default)]
pub struct ActiveSequences {
    inner: Arc<Mutex<Inner>>,
}

impl ActiveSequences {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave counters half-updated in a way that matters
        // more than refusing all routing would, so recover from poisoning.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a request dispatched to `worker` now; see [`ActiveSequences::add_at`].
    pub fn add(
        &self,
        worker: WorkerId,
        request_id: u64,
        hashes: &[BlockHash],
        isl_tokens: u64,
        cached_tokens: u64,
    ) -> LoadGuard {
        self.add_at(
            worker,
            request_id,
            hashes,
            isl_tokens,
            cached_tokens,
            Instant::now(),
        )
    }

    /// Registers a request dispatched to `worker` at `now`: its blocks become active there and
    /// `isl_tokens − cached_tokens` become pending prefill until [`LoadGuard::mark_prefill_done`].
    /// `request_id` is informational (duplicates are fine: each call gets its own entry).
    pub fn add_at(
        &self,
        worker: WorkerId,
        request_id: u64,
        hashes: &[BlockHash],
        isl_tokens: u64,
        cached_tokens: u64,
        now: Instant,
    ) -> LoadGuard {
        let prefill = isl_tokens.saturating_sub(cached_tokens);
        let mut g = self.lock();
        let inner = &mut *g;
        let key = inner.next_key;
        inner.next_key += 1;
        let i = worker.index();
        if i >= inner.workers.len() {
            inner.workers.resize_with(i + 1, || None);
            inner.depth.resize(i + 1, 0);
            inner.alive.resize(i / 64 + 1, 0);
        }
        let mut buf = inner.pool.pop().unwrap_or_default();
        buf.extend_from_slice(hashes);
        let ws = inner.workers[i].get_or_insert_with(WorkerState::default);
        for &h in hashes {
            let n = ws.blocks.entry(h).or_insert(0);
            *n += 1;
            if *n == 1 {
                ws.active_blocks += 1;
                inner.active.link(h, worker);
            }
        }
        ws.pending_prefill_tokens += prefill;
        ws.requests.insert(
            key,
            Entry {
                request_id,
                hashes: buf,
                prefill,
                started: now,
            },
        );
        drop(g);
        LoadGuard {
            seqs: self.clone(),
            worker,
            key,
            request_id,
        }
    }

    /// The worker's current load (zero for unknown workers).
    pub fn snapshot(&self, worker: WorkerId) -> WorkerLoad {
        self.lock()
            .worker(worker)
            .map(WorkerState::load)
            .unwrap_or_default()
    }

    /// How many of the request's blocks are not already active on the worker (the decode blocks the
    /// request would add there). Assumes chained hashes (see [`crate::hash`]).
    pub fn new_blocks_for(&self, worker: WorkerId, hashes: &[BlockHash]) -> u32 {
        match self.lock().worker(worker) {
            Some(ws) => ws.new_blocks(hashes),
            None => hashes.len() as u32,
        }
    }

    /// Fills `active_blocks`, `new_blocks`, `pending_prefill_tokens` and `inflight` of every candidate
    /// under one lock acquisition (the gateway's hot path).
    pub fn fill_loads(&self, hashes: &[BlockHash], candidates: &mut [Candidate]) {
        let mut g = self.lock();
        let n = hashes.len() as u32;
        g.active_prefix_depths(hashes);
        for c in candidates {
            match g.worker(c.worker) {
                Some(ws) => {
                    let l = ws.load();
                    c.active_blocks = l.active_blocks;
                    c.pending_prefill_tokens = l.pending_prefill_tokens;
                    c.inflight = l.inflight;
                    c.new_blocks = n - g.depth[c.worker.index()];
                }
                None => {
                    c.active_blocks = 0;
                    c.pending_prefill_tokens = 0;
                    c.inflight = 0;
                    c.new_blocks = hashes.len() as u32;
                }
            }
        }
    }

    /// Drops requests started more than `max_age` before `now` (lost completions; Dynamo uses 1 h).
    /// Returns their request ids.
    pub fn expire_stale(&self, now: Instant, max_age: Duration) -> Vec<u64> {
        let mut g = self.lock();
        let inner = &mut *g;
        let mut expired = Vec::new();
        for (i, ws) in inner.workers.iter_mut().enumerate() {
            let Some(ws) = ws else { continue };
            let old: Vec<u64> = ws
                .requests
                .iter()
                .filter(|(_, e)| now.saturating_duration_since(e.started) > max_age)
                .map(|(&k, _)| k)
                .collect();
            for k in old {
                expired.push(ws.requests[&k].request_id);
                ws.free(WorkerId(i as u32), k, &mut inner.pool, &mut inner.active);
            }
        }
        inner.active.maybe_sweep();
        expired
    }

    /// Forgets a worker and all its requests (their guards then free nothing).
    pub fn remove_worker(&self, worker: WorkerId) {
        let mut g = self.lock();
        let inner = &mut *g;
        if let Some(slot) = inner.workers.get_mut(worker.index()) {
            if let Some(ws) = slot.take() {
                for (&h, &n) in &ws.blocks {
                    if n > 0 {
                        inner.active.unlink(h, worker);
                    }
                }
                inner.active.maybe_sweep();
            }
        }
    }

    /// Loads of all known workers.
    pub fn all(&self) -> Vec<(WorkerId, WorkerLoad)> {
        let g = self.lock();
        g.workers
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|ws| (WorkerId(i as u32), ws.load())))
            .collect()
    }

    fn mark_prefill_done(&self, worker: WorkerId, key: u64) {
        let mut g = self.lock();
        if let Some(ws) = g.worker_mut(worker) {
            if let Some(e) = ws.requests.get_mut(&key) {
                ws.pending_prefill_tokens -= e.prefill;
                e.prefill = 0;
            }
        }
    }

    fn free(&self, worker: WorkerId, key: u64) {
        let mut g = self.lock();
        let inner = &mut *g;
        if let Some(Some(ws)) = inner.workers.get_mut(worker.index()) {
            ws.free(worker, key, &mut inner.pool, &mut inner.active);
            inner.active.maybe_sweep();
        }
    }

    /// The inverse map (block → workers where it is active), for tests to compare with the
    /// per-worker maps.
    #[cfg(test)]
    fn inverse(&self) -> std::collections::BTreeMap<BlockHash, std::collections::BTreeSet<u32>> {
        self.lock()
            .active
            .sets
            .iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(&h, s)| (h, s.iter().map(|w| w.0).collect()))
            .collect()
    }

    /// The inverse map recomputed naively from the per-worker maps.
    #[cfg(test)]
    fn inverse_naive(
        &self,
    ) -> std::collections::BTreeMap<BlockHash, std::collections::BTreeSet<u32>> {
        let g = self.lock();
        let mut m = std::collections::BTreeMap::<_, std::collections::BTreeSet<u32>>::new();
        for (i, ws) in g.workers.iter().enumerate() {
            for (&h, _) in ws.iter().flat_map(|ws| &ws.blocks).filter(|(_, &n)| n > 0) {
                m.entry(h).or_default().insert(i as u32);
            }
        }
        m
    }
}

/// The load of one dispatched request. Dropping it frees the load (idempotent with expiry and
/// worker removal).
#[derive(Debug)]
#[must_use = "dropping the guard frees the request's load immediately"]
pub struct LoadGuard {
    seqs: ActiveSequences,
    worker: WorkerId,
    key: u64,
    request_id: u64,
}

impl LoadGuard {
    /// The first output token arrived: the request's prefill is no longer pending. Idempotent.
    pub fn mark_prefill_done(&self) {
        self.seqs.mark_prefill_done(self.worker, self.key);
    }

    /// The worker the request was dispatched to.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// The caller's request id.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Frees the load now (same as dropping).
    pub fn free(self) {}
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.seqs.free(self.worker, self.key);
    }
}

#[cfg(test)]
mod tests;
