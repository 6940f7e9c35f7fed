//! Approximate per-worker block set: blocks the router itself sent to the worker, each alive for a
//! TTL after its last use, and at most `capacity` of them (least recently used evicted first).
//!
//! TTL is the same for every block of a worker, so "earliest expiry" and "least recently used" are
//! the same order: one FIFO of (hash, stamp) serves both. Refreshing a block pushes a new entry and
//! leaves the old one behind as stale (detected because its stamp no longer matches the map's; a
//! per-touch counter, not the time, so two touches in the same instant are still ordered); the queue
//! is compacted when stale entries outnumber live ones.
//!
//! A block used again within 1/[`REFRESH_DIVISOR`] of the TTL of its recorded last use is not
//! refreshed: a hot prefix (a system prompt on every request) would otherwise push a queue entry
//! per block per request and keep the compaction busy. Its recorded use, and so its expiry and
//! its LRU position, may then lag the true ones by less than TTL/64 (under 2 s of the default
//! 120 s): an approximate index's approximation, which the LRU model test accounts for.
//!
//! Exact workers use the same structure for their *predicted* blocks (inserted on route, alive for
//! the predicted TTL unless a KV event confirms them first).

use crate::nohash::{table_bytes, HashKeyed};
use crate::BlockHash;
use std::collections::VecDeque;

#[derive(Debug)]
pub(crate) struct ApproxWorker {
    /// hash → (last use in ns since the index epoch, stamp of its live queue entry).
    last_use: HashKeyed<(u64, u64)>,
    queue: VecDeque<(BlockHash, u64)>,
    next_stamp: u64,
    pub(crate) ttl_ns: u64,
    pub(crate) capacity: usize,
    /// Latest time seen; earlier times are clamped up so the queue stays ordered.
    clock: u64,
    /// Last use of the queue's front entry, which is always live ([`NO_FRONT`] when empty): every
    /// other block was used at or after it, so until `front_time + ttl` nothing has expired and
    /// a query needs no per-block TTL check ([`ApproxWorker::may_have_expired`]).
    front_time: u64,
}

const NO_FRONT: u64 = u64::MAX;

/// Refresh granularity: a known block's use is recorded again only once its recorded last use
/// is at least TTL / this old.
pub(crate) const REFRESH_DIVISOR: u64 = 64;

impl ApproxWorker {
    pub(crate) fn new(ttl_ns: u64, capacity: usize) -> Self {
        Self {
            last_use: HashKeyed::default(),
            queue: VecDeque::new(),
            next_stamp: 0,
            ttl_ns,
            capacity,
            clock: 0,
            front_time: NO_FRONT,
        }
    }

    /// False when every block held is certainly live at `now_ns` (then [`Self::is_live`] is true
    /// for each of them and need not be asked).
    #[inline]
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub(crate) fn may_have_expired(&self, now_ns: u64) -> bool {
        self.front_time != NO_FRONT && self.front_time.saturating_add(self.ttl_ns) <= now_ns
    }

    /// The earliest time a block held may have expired ([`Self::may_have_expired`] from then on),
    /// `None` when empty.
    #[inline]
    pub(crate) fn due_ns(&self) -> Option<u64> {
        (self.front_time != NO_FRONT).then(|| self.front_time.saturating_add(self.ttl_ns))
    }

    /// Drops stale entries from the queue's front and records the live front's time.
    fn trim_front(&mut self) {
        while let Some(&(h, stamp)) = self.queue.front() {
            if let Some(&(t, live)) = self.last_use.get(&h) {
                if live == stamp {
                    self.front_time = t;
                    return;
                }
            }
            self.queue.pop_front();
        }
        self.front_time = NO_FRONT;
    }

    /// Whether `h` is the hash of the queue's front entry (the only one whose change moves the
    /// front).
    #[inline]
    fn at_front(&self, h: BlockHash) -> bool {
        self.queue.front().is_some_and(|&(f, _)| f == h)
    }

    pub(crate) fn len(&self) -> usize {
        self.last_use.len()
    }

    #[inline]
    pub(crate) fn is_live(&self, h: BlockHash, now_ns: u64) -> bool {
        self.last_use
            .get(&h)
            .is_some_and(|&(t, _)| t.saturating_add(self.ttl_ns) > now_ns)
    }

    #[inline]
    pub(crate) fn contains(&self, h: BlockHash) -> bool {
        self.last_use.contains_key(&h)
    }

    /// True when `h` is present but its TTL has passed at `now_ns` (absent → false).
    #[inline]
    pub(crate) fn is_expired(&self, h: BlockHash, now_ns: u64) -> bool {
        self.last_use
            .get(&h)
            .is_some_and(|&(t, _)| t.saturating_add(self.ttl_ns) <= now_ns)
    }

    /// Forgets `h` (its queue entry becomes stale); true when it was present.
    pub(crate) fn remove(&mut self, h: BlockHash) -> bool {
        let removed = self.last_use.remove(&h).is_some();
        if removed {
            self.maybe_compact();
            if self.at_front(h) {
                self.trim_front();
            }
        }
        removed
    }

    /// Inserts or refreshes `h` (not when it was recorded less than TTL / [`REFRESH_DIVISOR`]
    /// ago); true when it is new.
    pub(crate) fn touch(&mut self, h: BlockHash, now_ns: u64) -> bool {
        let mut new = false;
        self.touch_each(std::slice::from_ref(&h), now_ns, |_, n| new = n);
        new
    }

    /// [`Self::touch`] of each of `hashes` in order, calling `f(i, new)` right after block `i`'s
    /// (a request's blocks: one call, the clock and the refresh interval read once, and a block
    /// used again recently costs one probe and a compare).
    #[inline]
    pub(crate) fn touch_each(
        &mut self,
        hashes: &[BlockHash],
        now_ns: u64,
        mut f: impl FnMut(usize, bool),
    ) {
        use std::collections::hash_map::Entry;
        self.clock = self.clock.max(now_ns);
        let clock = self.clock;
        let fresh = self.ttl_ns / REFRESH_DIVISOR;
        for (i, &h) in hashes.iter().enumerate() {
            let stamp = self.next_stamp;
            let new = match self.last_use.entry(h) {
                Entry::Occupied(mut e) => {
                    if clock - e.get().0 < fresh {
                        f(i, false);
                        continue;
                    }
                    e.insert((clock, stamp));
                    false
                }
                Entry::Vacant(e) => {
                    e.insert((clock, stamp));
                    true
                }
            };
            self.next_stamp += 1;
            self.queue.push_back((h, stamp));
            if self.queue.len() == 1 || self.at_front(h) {
                self.trim_front(); // first entry, or the front was this block's older entry
            }
            f(i, new);
        }
        self.debug_check_front();
    }

    /// Removes blocks whose TTL has passed, reporting each to `gone`.
    pub(crate) fn expire(&mut self, now_ns: u64, mut gone: impl FnMut(BlockHash)) -> usize {
        let mut n = 0;
        while let Some(&(h, stamp)) = self.queue.front() {
            match self.last_use.get(&h) {
                Some(&(t, live)) if live == stamp => {
                    if t.saturating_add(self.ttl_ns) > now_ns {
                        // A live front: what `trim_front` would find, without asking again.
                        self.front_time = t;
                        self.debug_check_front();
                        return n;
                    }
                    self.last_use.remove(&h);
                    gone(h);
                    n += 1;
                }
                _ => {} // stale entry of a refreshed or removed block
            }
            self.queue.pop_front();
        }
        self.front_time = NO_FRONT;
        n
    }

    /// Evicts least recently used blocks until within capacity.
    pub(crate) fn enforce_capacity(&mut self, mut gone: impl FnMut(BlockHash)) -> usize {
        let mut n = 0;
        let mut popped = false;
        while self.last_use.len() > self.capacity {
            let Some((h, stamp)) = self.queue.pop_front() else {
                break;
            };
            popped = true;
            if self
                .last_use
                .get(&h)
                .is_some_and(|&(_, live)| live == stamp)
            {
                self.last_use.remove(&h);
                gone(h);
                n += 1;
            }
        }
        self.maybe_compact();
        if popped {
            self.trim_front();
        } else {
            // Nothing left the queue: its front, and so `front_time`, is as every method leaves
            // it (the front entry live and its time recorded).
            self.debug_check_front();
        }
        n
    }

    /// Debug builds: the invariant every method keeps, checked (the front entry is live and
    /// `front_time` is its last use; `NO_FRONT` when the queue is empty).
    #[inline]
    fn debug_check_front(&self) {
        #[cfg(debug_assertions)]
        {
            let want = match self.queue.front() {
                None => NO_FRONT,
                Some((h, stamp)) => match self.last_use.get(h) {
                    Some(&(t, live)) if live == *stamp => t,
                    other => panic!("queue front {h:#x}/{stamp} is stale: {other:?}"),
                },
            };
            assert_eq!(self.front_time, want, "front_time out of date");
        }
    }

    fn maybe_compact(&mut self) {
        if self.queue.len() > 2 * self.last_use.len() + 64 {
            let live = &self.last_use;
            self.queue
                .retain(|(h, stamp)| live.get(h).is_some_and(|(_, l)| l == stamp));
            self.trim_front();
        }
    }

    /// Drops every block, reporting each to `gone`.
    pub(crate) fn drain(&mut self, mut gone: impl FnMut(BlockHash)) {
        for (h, _) in self.last_use.drain() {
            gone(h);
        }
        self.queue.clear();
        self.front_time = NO_FRONT;
    }

    pub(crate) fn hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.last_use.keys().copied()
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        table_bytes(self.last_use.capacity(), 24) + self.queue.capacity() * 16
    }
}
