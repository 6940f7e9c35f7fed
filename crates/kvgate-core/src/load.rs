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
//! One map holds every active block: the set of workers where it is active, and per worker how
//! many in-flight requests hold it (one hash lookup per block when a request starts; a request
//! keeps its blocks' places in that map, so ending it looks nothing up). The sets let [`ActiveSequences::fill_loads`] score every candidate in one walk over the prompt
//! instead of one search per worker.
//!
//! A block no request holds any more keeps its entry (an empty worker set) until idle entries
//! outnumber live ones ([`SWEEP_MIN`] at least): a prefix every request shares (a system prompt)
//! goes 0 → 1 → 0 on each request at low concurrency, and re-inserting and removing its entry each
//! time was most of the bookkeeping.
//!
//! Thread-safe: one `std::sync::Mutex` inside an `Arc`, held only for short, allocation-free sections.

use crate::index::worker_set::{bits, WorkerSet};
use crate::nohash::HashKeyed;
use crate::select::{Candidate, HotPrefix};
use crate::{BlockHash, WorkerId};
pub use order::OrderWeights;
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
    /// Its blocks' places in [`Active::blocks`] (held there until this entry is freed).
    blocks: Vec<u32>,
    /// Still-pending prefill tokens (0 once the first token arrived).
    prefill: u64,
    started: Instant,
}

/// Idle entries (an empty worker set) are dropped once there are more of them than live ones and
/// at least this many.
const SWEEP_MIN: usize = 4096;

#[derive(Debug, Default)]
struct WorkerState {
    /// Blocks active on this worker (held by at least one of its in-flight requests).
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

    /// Frees request `key` of worker `w` (this state), releasing its blocks in `active`.
    /// Returns whether the request was there.
    fn free(
        &mut self,
        w: WorkerId,
        key: u64,
        pool: &mut Vec<Vec<u32>>,
        active: &mut Active,
    ) -> bool {
        let Some(mut e) = self.requests.remove(&key) else {
            return false;
        };
        self.pending_prefill_tokens -= e.prefill;
        for &s in &e.blocks {
            if active.release(s, w) {
                self.active_blocks -= 1;
            }
        }
        if pool.len() < POOL_MAX {
            e.blocks.clear();
            pool.push(e.blocks);
        }
        true
    }
}

/// One block of the active map.
#[derive(Debug, Default)]
struct Block {
    /// Its router hash.
    hash: BlockHash,
    /// Workers where the block is active.
    set: WorkerSet,
    /// `(worker, n)`: `n` more in-flight requests than the first hold the block on `worker` (only
    /// for workers in `set`; most blocks are held once per worker and this stays empty).
    extra: Vec<(u32, u32)>,
}

/// Router hash → where it is active and how many requests hold it there. Entries whose set became
/// empty stay until swept.
///
/// The blocks live in a slab (`blocks`) and the map holds their places: a request keeps the places
/// of its blocks ([`Entry::blocks`]) and releases them without a lookup. A place is reused only
/// after its block was swept, and a block is swept only once its set is empty, so no request in
/// flight holds it then.
#[derive(Debug, Default)]
struct Active {
    /// Router hash → the block's place in `blocks`.
    places: HashKeyed<u32>,
    blocks: Vec<Block>,
    /// Places of swept blocks, free for new ones.
    vacant: Vec<u32>,
    /// Entries of `places` whose block has an empty set.
    empty: usize,
}

impl Active {
    fn block(&self, h: &BlockHash) -> Option<&Block> {
        self.places.get(h).map(|&s| &self.blocks[s as usize])
    }

    fn get(&self, h: &BlockHash) -> Option<&WorkerSet> {
        self.block(h).map(|b| &b.set).filter(|s| !s.is_empty())
    }

    /// How many in-flight requests hold `h` (over every worker), and on how many workers.
    fn holders(&self, h: &BlockHash) -> (u32, u32) {
        self.block(h).map_or((0, 0), |b| {
            let workers = b.set.len() as u32;
            (
                workers + b.extra.iter().map(|&(_, n)| n).sum::<u32>(),
                workers,
            )
        })
    }

    fn is_active_on(&self, h: &BlockHash, w: WorkerId) -> bool {
        self.block(h).is_some_and(|b| b.set.contains(w))
    }

    /// One more request on `w` holds `h`: returns the block's place and whether `h` was not
    /// active on `w` before.
    fn acquire(&mut self, h: BlockHash, w: WorkerId) -> (u32, bool) {
        use std::collections::hash_map::Entry;
        match self.places.entry(h) {
            Entry::Occupied(e) => {
                let s = *e.get();
                let b = &mut self.blocks[s as usize];
                if b.set.is_empty() {
                    // An idle block (the common case at low concurrency): held once more.
                    self.empty -= 1;
                    b.set = WorkerSet::one(w);
                    return (s, true);
                }
                if b.set.insert(w) {
                    return (s, true);
                }
                match b.extra.iter_mut().find(|(x, _)| *x == w.0) {
                    Some((_, n)) => *n += 1,
                    None => b.extra.push((w.0, 1)),
                }
                (s, false)
            }
            Entry::Vacant(e) => {
                let s = match self.vacant.pop() {
                    Some(s) => {
                        // Swept with an empty set, so with no per-worker counts either.
                        let b = &mut self.blocks[s as usize];
                        debug_assert!(b.set.is_empty() && b.extra.is_empty());
                        b.hash = h;
                        s
                    }
                    None => {
                        self.blocks.push(Block {
                            hash: h,
                            ..Block::default()
                        });
                        (self.blocks.len() - 1) as u32
                    }
                };
                e.insert(s);
                self.blocks[s as usize].set.insert(w);
                (s, true)
            }
        }
    }

    /// One request fewer on `w` holds the block at place `s`; true if it is no longer active on
    /// `w`. Releasing a block not held there (a worker already forgotten) changes nothing.
    fn release(&mut self, s: u32, w: WorkerId) -> bool {
        let b = &mut self.blocks[s as usize];
        if b.extra.is_empty() && b.set.is_only(w) {
            // Held once, by this request (the common case at low concurrency): idle now.
            b.set = WorkerSet::default();
            self.empty += 1;
            return true;
        }
        if let Some(i) = b.extra.iter().position(|(x, _)| *x == w.0) {
            b.extra[i].1 -= 1;
            if b.extra[i].1 == 0 {
                b.extra.swap_remove(i);
            }
            return false;
        }
        if b.set.remove(w) {
            if b.set.is_empty() {
                self.empty += 1;
            }
            return true;
        }
        false
    }

    fn maybe_sweep(&mut self) {
        if self.empty > SWEEP_MIN.max(self.places.len() - self.empty) {
            let Active {
                places,
                blocks,
                vacant,
                ..
            } = self;
            places.retain(|_, &mut s| {
                let live = !blocks[s as usize].set.is_empty();
                if !live {
                    vacant.push(s);
                }
                live
            });
            self.empty = 0;
        }
    }

    /// The blocks in the map (idle ones included), with their hashes.
    #[cfg(test)]
    fn entries(&self) -> impl Iterator<Item = &Block> + '_ {
        self.places.values().map(|&s| &self.blocks[s as usize])
    }
}

/// Recycled hash buffers, so steady-state `add` does not allocate.
const POOL_MAX: usize = 256;

/// Most load orders kept at once (one per distinct set of cost weights in use: per pool block size
/// and policy config); the least recently asked for goes first.
const ORDERS_MAX: usize = 4;

#[derive(Debug, Default)]
pub(crate) struct Inner {
    workers: Vec<Option<WorkerState>>,
    /// Known workers sorted by load, one order per weight set in use ([`order::LoadOrder`]).
    orders: Vec<order::LoadOrder>,
    /// Workers whose `depth` entry is non-zero (reset by entry, not by a pass over the fleet).
    depth_touched: Vec<u32>,
    /// Block → workers where it is active.
    active: Active,
    /// Scratch of [`ActiveSequences::fill_loads`], sized with `workers`: per worker, how many leading
    /// prompt blocks are active there, and the 64-worker words still matching.
    depth: Vec<u32>,
    alive: Vec<u64>,
    /// Scratch of [`Inner::walk_two`]: the workers already passed to its callback.
    seen: Vec<u64>,
    next_key: u64,
    pool: Vec<Vec<u32>>,
    /// Requests in flight over every worker, and the workers known (for [`HotPrefix`]).
    inflight: u32,
    known: u32,
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
            depth_touched,
            alive,
            ..
        } = self;
        for w in depth_touched.drain(..) {
            depth[w as usize] = 0;
        }
        let n = hashes.len();
        let Some(first) = hashes.first().and_then(|h| active.get(h)) else {
            return;
        };
        // `alive` is zero outside words `w0..w1` (those of the workers still matching), so each
        // step costs the still-matching workers' words, not the fleet's.
        let (mut w0, mut w1) = (alive.len(), 0);
        for (k, a) in alive.iter_mut().enumerate() {
            *a = first.word(k);
            if *a != 0 {
                w0 = w0.min(k);
                w1 = k + 1;
            }
        }
        // Whether every worker still in `alive` has block `i` active.
        let covers = |alive: &[u64], w0: usize, w1: usize, i: usize| {
            active
                .get(&hashes[i])
                .is_some_and(|s| s.covers(alive, w0, w1))
        };
        // Invariant: `alive` is non-empty and has blocks 0..=lo active.
        let mut lo = 0usize;
        loop {
            let hi = prefix_end(lo, n, |i| covers(alive, w0, w1, i));
            // Block `hi` is the first one some alive worker lacks: those stop at depth `hi`.
            let set = hashes.get(hi).and_then(|h| active.get(h));
            let mut any = false;
            for (k, a) in alive.iter_mut().enumerate().take(w1).skip(w0) {
                let still = set.map_or(0, |s| s.word(k)) & *a;
                for w in bits(k, *a & !still) {
                    depth[w.index()] = hi as u32;
                    depth_touched.push(w.0);
                }
                *a = still;
                any |= still != 0;
            }
            if !any {
                return;
            }
            while alive[w0] == 0 {
                w0 += 1;
            }
            while alive[w1 - 1] == 0 {
                w1 -= 1;
            }
            lo = hi;
        }
    }

    /// Blocks of a chained-hash sequence not active on `w`. Active blocks are unions of whole
    /// chained prefixes, so the active part of a request is itself a prefix: gallop, then binary
    /// search, for O(log n) lookups instead of n.
    fn new_blocks(&self, w: WorkerId, hashes: &[BlockHash]) -> u32 {
        let active = |i: usize| self.active.is_active_on(&hashes[i], w);
        let n = hashes.len();
        if n == 0 || !active(0) {
            return n as u32;
        }
        (n - prefix_end(0, n, active)) as u32
    }

    fn worker(&self, w: WorkerId) -> Option<&WorkerState> {
        self.workers.get(w.index()).and_then(|s| s.as_ref())
    }
    fn worker_mut(&mut self, w: WorkerId) -> Option<&mut WorkerState> {
        self.workers.get_mut(w.index()).and_then(|s| s.as_mut())
    }

    /// Makes room for worker id `w` in the per-worker tables.
    fn grow(&mut self, w: WorkerId) {
        let i = w.index();
        if i >= self.workers.len() {
            self.workers.resize_with(i + 1, || None);
            self.depth.resize(i + 1, 0);
            self.alive.resize(i / 64 + 1, 0);
        }
    }

    /// Worker `w`'s load changed: moves it in every load order (removes it when it is gone).
    fn reorder(&mut self, w: WorkerId) {
        let load = self.worker(w).map(WorkerState::load);
        for o in &mut self.orders {
            match &load {
                Some(l) => o.update(w, l),
                None => o.remove(w),
            }
        }
    }

    /// The load order for `weights`, built on first use (O(workers log workers), once per weight
    /// set) and maintained from then on. `None` when the weights give no lower bound.
    pub(crate) fn order(&mut self, weights: OrderWeights) -> Option<&order::LoadOrder> {
        if !weights.valid() {
            return None;
        }
        let i = match self.orders.iter().position(|o| o.weights == weights) {
            Some(i) => i,
            None => {
                if self.orders.len() == ORDERS_MAX {
                    self.orders.remove(0);
                }
                let mut o = order::LoadOrder::new(weights);
                for (i, ws) in self.workers.iter().enumerate() {
                    if let Some(ws) = ws {
                        o.update(WorkerId(i as u32), &ws.load());
                    }
                }
                self.orders.push(o);
                self.orders.len() - 1
            }
        };
        Some(&self.orders[i])
    }

    /// Visits the known workers in ascending order of `weights`' key (building that order on
    /// first use, O(workers log workers) once per weight set, and maintaining it from then on),
    /// with their key and load, until `f` returns false. False when the weights give no order
    /// (negative or not finite): nothing was visited.
    pub(crate) fn walk_order(
        &mut self,
        weights: OrderWeights,
        mut f: impl FnMut(f64, WorkerId, WorkerLoad) -> bool,
    ) -> bool {
        if self.order(weights).is_none() {
            return false;
        }
        let Inner {
            orders, workers, ..
        } = self;
        let Some(o) = orders.iter().find(|o| o.weights == weights) else {
            return false;
        };
        for (key, w) in o.iter() {
            let load = workers[w.index()].as_ref().map(WorkerState::load);
            if !f(key, w, load.unwrap_or_default()) {
                break;
            }
        }
        true
    }

    /// Visits the known workers in two load orders at once, each worker once: at every step the
    /// next worker of the order whose next worker has the lower `prio(key_a, key_b)` (its own keys
    /// in both orders; ties: order `a`). `f` gets, besides the worker and its load, the keys of the
    /// next workers not yet taken from each order *before* this step: every worker not visited
    /// yet has keys at least those (the threshold of a walk over two sorted lists). It returns
    /// false to stop. Stops too when either order is exhausted (every worker visited). False when
    /// either weight set gives no order (nothing was visited).
    pub(crate) fn walk_two(
        &mut self,
        a: OrderWeights,
        b: OrderWeights,
        prio: impl Fn(f64, f64) -> f64,
        mut f: impl FnMut((f64, f64), WorkerId, WorkerLoad) -> bool,
    ) -> bool {
        if self.order(a).is_none() || self.order(b).is_none() {
            return false;
        }
        let Inner {
            orders,
            workers,
            seen,
            ..
        } = self;
        let (Some(oa), Some(ob)) = (
            orders.iter().find(|o| o.weights == a),
            orders.iter().find(|o| o.weights == b),
        ) else {
            return false;
        };
        seen.clear();
        seen.resize(workers.len().div_ceil(64), 0);
        let load = |w: WorkerId| {
            workers[w.index()]
                .as_ref()
                .map(WorkerState::load)
                .unwrap_or_default()
        };
        let taken = |seen: &[u64], w: WorkerId| seen[w.index() / 64] >> (w.index() % 64) & 1 == 1;
        let (mut ia, mut ib) = (oa.iter().peekable(), ob.iter().peekable());
        // Each order's next worker not taken yet: (key, worker, load, prio), kept until it is
        // taken (by either order).
        type Head = Option<(f64, WorkerId, WorkerLoad, f64)>;
        let (mut ha, mut hb): (Head, Head) = (None, None);
        loop {
            if ha.is_none() {
                while ia.next_if(|&(_, w)| taken(seen, w)).is_some() {}
                let Some(&(k, w)) = ia.peek() else {
                    return true;
                };
                let l = load(w);
                ha = Some((k, w, l, prio(k, b.key(&l))));
            }
            if hb.is_none() {
                while ib.next_if(|&(_, w)| taken(seen, w)).is_some() {}
                let Some(&(k, w)) = ib.peek() else {
                    return true;
                };
                let l = load(w);
                hb = Some((k, w, l, prio(a.key(&l), k)));
            }
            let (Some((ka, wa, la, pa)), Some((kb, wb, lb, pb))) = (ha, hb) else {
                return true;
            };
            let (w, l) = if pa <= pb {
                ia.next();
                (wa, la)
            } else {
                ib.next();
                (wb, lb)
            };
            // The other order's head may be this same worker: taken now, so looked up again.
            if wa == w {
                ha = None;
            }
            if wb == w {
                hb = None;
            }
            seen[w.index() / 64] |= 1 << (w.index() % 64);
            if !f((ka, kb), w, l) {
                return true;
            }
        }
    }

    /// A known worker's load (`None`: not known).
    pub(crate) fn load_of(&self, w: WorkerId) -> Option<WorkerLoad> {
        self.worker(w).map(WorkerState::load)
    }

    /// After [`Inner::prefix_depths`]: blocks of the `n`-block prompt not active on `w`.
    pub(crate) fn new_blocks_after_depths(&self, w: WorkerId, n: usize) -> u32 {
        (n as u32).saturating_sub(self.depth.get(w.index()).copied().unwrap_or(0))
    }

    /// Computes every worker's active prefix of the prompt (read with
    /// [`Inner::new_blocks_after_depths`]) and returns the workers where it is not empty.
    pub(crate) fn prefix_depths(&mut self, hashes: &[BlockHash]) -> &[u32] {
        self.active_prefix_depths(hashes);
        &self.depth_touched
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
        inner.grow(worker);
        let mut buf = inner.pool.pop().unwrap_or_default();
        if inner.workers[i].is_none() {
            inner.known += 1;
        }
        inner.inflight += 1;
        let ws = inner.workers[i].get_or_insert_with(WorkerState::default);
        let active = &mut inner.active;
        // One reservation for the places, no capacity check per block.
        buf.extend(hashes.iter().map(|&h| {
            let (s, new) = active.acquire(h, worker);
            ws.active_blocks += u32::from(new);
            s
        }));
        ws.pending_prefill_tokens += prefill;
        ws.requests.insert(
            key,
            Entry {
                request_id,
                blocks: buf,
                prefill,
                started: now,
            },
        );
        inner.reorder(worker);
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
        self.lock().new_blocks(worker, hashes)
    }

    /// The prompt's leading blocks that requests in flight hold right now on any worker, how many
    /// requests hold the last of them and on how many workers (the `kv` cost's replication term,
    /// this gateway's own requests only, not cluster peers';
    /// [`crate::KvCostConfig::replicate`]). Active blocks are unions of whole chained prefixes, so
    /// the blocks active somewhere are a prefix of the prompt: O(log n) lookups.
    pub fn hot_prefix(&self, hashes: &[BlockHash]) -> HotPrefix {
        let g = self.lock();
        let active = &g.active;
        if hashes.first().and_then(|h| active.get(h)).is_none() {
            return HotPrefix::default();
        }
        let end = prefix_end(0, hashes.len(), |i| active.get(&hashes[i]).is_some());
        let (holders, workers) = active.holders(&hashes[end - 1]);
        HotPrefix {
            blocks: end as u32,
            holders,
            workers,
            fleet_requests: g.inflight,
            fleet_workers: g.known,
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
                if ws.free(WorkerId(i as u32), k, &mut inner.pool, &mut inner.active) {
                    inner.inflight -= 1;
                }
            }
            let load = ws.load();
            for o in &mut inner.orders {
                o.update(WorkerId(i as u32), &load);
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
                inner.known -= 1;
                inner.inflight -= ws.requests.len() as u32;
                for e in ws.requests.values() {
                    for &s in &e.blocks {
                        inner.active.release(s, worker);
                    }
                }
                inner.active.maybe_sweep();
            }
            inner.reorder(worker);
        }
    }

    /// Registers a worker with no load yet, so that load orders (the bounded selection,
    /// [`crate::select::bounded`]) know it before its first request. Idempotent; keeps the load
    /// of a worker already known.
    pub fn add_worker(&self, worker: WorkerId) {
        let mut g = self.lock();
        g.grow(worker);
        if g.workers[worker.index()].is_none() {
            g.known += 1;
            g.workers[worker.index()] = Some(WorkerState::default());
            g.reorder(worker);
        }
    }

    /// The state under the lock, for the bounded selection.
    pub(crate) fn locked(&self) -> MutexGuard<'_, Inner> {
        self.lock()
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
        let Some(ws) = g.worker_mut(worker) else {
            return;
        };
        if let Some(e) = ws.requests.get_mut(&key) {
            let changed = e.prefill != 0;
            ws.pending_prefill_tokens -= e.prefill;
            e.prefill = 0;
            if changed {
                g.reorder(worker);
            }
        }
    }

    fn free(&self, worker: WorkerId, key: u64) {
        let mut g = self.lock();
        let inner = &mut *g;
        if let Some(Some(ws)) = inner.workers.get_mut(worker.index()) {
            if ws.free(worker, key, &mut inner.pool, &mut inner.active) {
                inner.inflight -= 1;
            }
            inner.active.maybe_sweep();
            inner.reorder(worker);
        }
    }

    /// The inverse map (block → workers where it is active), for tests to compare with the
    /// per-worker maps.
    #[cfg(test)]
    fn inverse(&self) -> std::collections::BTreeMap<BlockHash, std::collections::BTreeSet<u32>> {
        self.lock()
            .active
            .entries()
            .filter(|b| !b.set.is_empty())
            .map(|b| (b.hash, b.set.iter().map(|w| w.0).collect()))
            .collect()
    }

    /// The inverse map recomputed naively from the workers' in-flight requests.
    #[cfg(test)]
    fn inverse_naive(
        &self,
    ) -> std::collections::BTreeMap<BlockHash, std::collections::BTreeSet<u32>> {
        let g = self.lock();
        let mut m = std::collections::BTreeMap::<_, std::collections::BTreeSet<u32>>::new();
        for (i, ws) in g.workers.iter().enumerate() {
            for e in ws.iter().flat_map(|ws| ws.requests.values()) {
                for &s in &e.blocks {
                    let h = g.active.blocks[s as usize].hash;
                    m.entry(h).or_default().insert(i as u32);
                }
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

pub mod order;
pub mod remote;

#[cfg(test)]
mod tests;
