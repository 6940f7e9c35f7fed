//! [`BlockStore`]: router hash → [`WorkerSet`], laid out so a prompt's walk is mostly sequential.
//!
//! Entries live in a slab of slots (hash + set, 24 bytes) allocated in the order blocks arrive, and
//! a `hashbrown::HashTable<u32>` maps a hash to its slot (4 bytes + 1 control byte per bucket). The
//! blocks of one sequence arrive in chain order (a `BlockStored` event lists consecutive blocks;
//! routed / predicted requests give the whole prompt), so they get consecutive slots, and a query
//! that resolved block `i` at slot `s` finds block `i + 1` by checking slot `s + 1` (one sequential
//! read, no table probe: the index is far larger than the caches, and a table probe is a cache and
//! TLB miss) — [`BlockStore::next`]. The table is the fallback.
//!
//! Invariants: a slot is *live* iff its set is non-empty; every live slot's hash is in the table,
//! pointing to it, and a hash has at most one live slot. So a live slot whose stored hash equals the
//! wanted one *is* that hash's entry, wherever the table would have led. A slot freed by removal
//! keeps its stale hash but an empty set, so the fast path must (and does) check liveness too.
//!
//! Freed slots go on a free list that is allowed to hold stale entries (slots taken since directly):
//! an insert chained after slot `p` takes slot `p + 1` when it is free, so a re-stored chain refills
//! a freed run in order; a popped slot first slides down over free neighbours, so a run freed
//! head-to-tail is refilled from its head too.

use super::worker_set::WorkerSet;
use crate::nohash::table_bytes;
use crate::{BlockHash, WorkerId};
use hashbrown::HashTable;

/// Slots per slab chunk: the slab grows a chunk at a time (no doubling, so at most one partly used
/// chunk is wasted), and a chunk is large enough that a walk rarely crosses one.
const CHUNK_BITS: u32 = 12;
const CHUNK: usize = 1 << CHUNK_BITS;
/// How far a popped free slot slides down over free neighbours.
const SLIDE: usize = 64;

#[derive(Debug, Default, Clone)]
struct Slot {
    hash: BlockHash,
    set: WorkerSet,
}

#[derive(Debug, Default)]
pub(crate) struct BlockStore {
    table: HashTable<u32>,
    chunks: Vec<Vec<Slot>>,
    /// Slots ever allocated (live or free).
    slots: usize,
    /// Freed slots; may also hold slots taken since (skipped when popped) and duplicates.
    free: Vec<u32>,
}

impl BlockStore {
    #[inline]
    fn slot(&self, s: u32) -> &Slot {
        &self.chunks[(s >> CHUNK_BITS) as usize][s as usize & (CHUNK - 1)]
    }

    #[inline]
    fn slot_mut(&mut self, s: u32) -> &mut Slot {
        &mut self.chunks[(s >> CHUNK_BITS) as usize][s as usize & (CHUNK - 1)]
    }

    #[inline]
    fn is_free(&self, s: u32) -> bool {
        (s as usize) < self.slots && self.slot(s).set.is_empty()
    }

    /// Distinct blocks held by anyone.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// The slot of `h`, if anyone holds it (a table probe).
    #[inline]
    pub(crate) fn find(&self, h: BlockHash) -> Option<u32> {
        let chunks = &self.chunks;
        self.table
            .find(h, |&s| {
                chunks[(s >> CHUNK_BITS) as usize][s as usize & (CHUNK - 1)].hash == h
            })
            .copied()
    }

    /// The slot of `h` when it is the live slot right after `prev` (no table probe), else `None`
    /// (which says nothing about whether `h` is held elsewhere).
    #[inline]
    pub(crate) fn next(&self, prev: u32, h: BlockHash) -> Option<u32> {
        let s = prev.checked_add(1)?;
        if (s as usize) >= self.slots {
            return None;
        }
        let slot = self.slot(s);
        (slot.hash == h && !slot.set.is_empty()).then_some(s)
    }

    /// The slot of `h`: first right after `prev` (when given), else through the table.
    #[inline]
    pub(crate) fn find_after(&self, prev: Option<u32>, h: BlockHash) -> Option<u32> {
        prev.and_then(|p| self.next(p, h)).or_else(|| self.find(h))
    }

    /// Walks a request's chain: calls `f(i, holders of block i)` for `i = 0, 1, …` while block `i`
    /// is held by anyone (block 0 is at slot `first`) and `f` returns true. Returns how many
    /// blocks `f` accepted. Consecutive slots are read straight from the chunk (no table probe,
    /// no per-block chunk lookup); the table is asked only when the chain leaves its run.
    #[inline]
    pub(crate) fn walk(
        &self,
        first: u32,
        hashes: &[BlockHash],
        mut f: impl FnMut(usize, &WorkerSet) -> bool,
    ) -> usize {
        let mut s = first;
        let mut i = 0;
        loop {
            let chunk = &self.chunks[(s >> CHUNK_BITS) as usize];
            let mut idx = s as usize & (CHUNK - 1);
            loop {
                if !f(i, &chunk[idx].set) {
                    return i;
                }
                i += 1;
                let Some(&h) = hashes.get(i) else {
                    return i;
                };
                idx += 1;
                match chunk.get(idx) {
                    // A live slot holding `h` is `h`'s entry (see the invariants above).
                    Some(slot) if slot.hash == h && !slot.set.is_empty() => {}
                    _ => match self.find(h) {
                        Some(n) => {
                            s = n;
                            break;
                        }
                        None => return i,
                    },
                }
            }
        }
    }

    /// The holders of live slot `s`.
    #[inline]
    pub(crate) fn set(&self, s: u32) -> &WorkerSet {
        &self.slot(s).set
    }

    /// The holders of `h`.
    pub(crate) fn get(&self, h: BlockHash) -> Option<&WorkerSet> {
        self.find(h).map(|s| self.set(s))
    }

    /// Adds `w` to the holders of `h`, which is chained after the block at slot `prev` (a hint for
    /// where to put a new block). Returns `h`'s slot and whether `w` is new there.
    pub(crate) fn link(&mut self, h: BlockHash, w: WorkerId, prev: Option<u32>) -> (u32, bool) {
        let s = match self.find_after(prev, h) {
            Some(s) => s,
            None => {
                let s = self.alloc(prev);
                *self.slot_mut(s) = Slot {
                    hash: h,
                    set: WorkerSet::default(),
                };
                let chunks = &self.chunks;
                self.table.insert_unique(h, s, |&t| {
                    chunks[(t >> CHUNK_BITS) as usize][t as usize & (CHUNK - 1)].hash
                });
                s
            }
        };
        let added = self.slot_mut(s).set.insert(w);
        // A block held by the same workers as the block before it in the chain shares its bitset
        // (the common case along a shared prefix): one bitset per run of such blocks, and walks
        // recognise the run by pointer (`WorkerSet::same_bits`).
        if added && self.slot(s).set.same_bits() != 0 {
            if let Some(p) =
                prev.filter(|&p| p != s && (p as usize) < self.slots && !self.is_free(p))
            {
                let before = self.slot(p).set.clone();
                self.slot_mut(s).set.share_if_equal(&before);
            }
        }
        (s, added)
    }

    /// Removes `w` from the holders of `h` (freeing the slot once nobody holds it); false if `w`
    /// did not hold it.
    pub(crate) fn unlink(&mut self, h: BlockHash, w: WorkerId) -> bool {
        let Some(s) = self.find(h) else {
            return false;
        };
        let set = &mut self.slot_mut(s).set;
        let removed = set.remove(w);
        if set.is_empty() {
            if let Ok(e) = self.table.find_entry(h, |&t| t == s) {
                e.remove();
            }
            self.free.push(s);
            self.maybe_compact_free();
        }
        removed
    }

    /// A free slot for a new block chained after `prev`.
    fn alloc(&mut self, prev: Option<u32>) -> u32 {
        if let Some(s) = prev.and_then(|p| p.checked_add(1)) {
            if self.is_free(s) {
                return s; // its free-list entry turns stale
            }
        }
        while let Some(popped) = self.free.pop() {
            if !self.is_free(popped) {
                continue; // taken directly since it was freed
            }
            let mut s = popped;
            // Start a new chain at the bottom of a free run so it can grow upwards in order.
            for _ in 0..SLIDE {
                match s.checked_sub(1) {
                    Some(d) if self.is_free(d) => s = d,
                    _ => break,
                }
            }
            if s != popped {
                // Every free slot stays on the list (it may be taken directly before it is popped).
                self.free.push(popped);
            }
            return s;
        }
        let s = self.slots;
        assert!(s < u32::MAX as usize, "block store full (2^32 slots)");
        if s % CHUNK == 0 {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        self.chunks
            .last_mut()
            .expect("a chunk with room")
            .push(Slot::default());
        self.slots += 1;
        s as u32
    }

    /// Drops stale free-list entries once they dominate (slots taken directly leave them behind).
    fn maybe_compact_free(&mut self) {
        let free_slots = self.slots - self.table.len();
        if self.free.len() > 2 * free_slots + 1024 {
            let mut free = std::mem::take(&mut self.free);
            free.retain(|&s| self.is_free(s));
            free.sort_unstable_by(|a, b| b.cmp(a));
            free.dedup();
            self.free = free;
        }
    }

    /// Every live set (for memory accounting).
    pub(crate) fn sets(&self) -> impl Iterator<Item = &WorkerSet> {
        self.chunks
            .iter()
            .flatten()
            .map(|s| &s.set)
            .filter(|s| !s.is_empty())
    }

    /// Estimated heap bytes: table, slab chunks, free list and wide sets.
    pub(crate) fn heap_bytes(&self) -> usize {
        table_bytes(self.table.capacity(), std::mem::size_of::<u32>())
            + self.chunks.len() * CHUNK * std::mem::size_of::<Slot>()
            + self.chunks.capacity() * std::mem::size_of::<Vec<Slot>>()
            + self.free.capacity() * 4
            + self.sets().map(WorkerSet::heap_bytes).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// Few distinct hashes, so freed slots are often re-taken by the same or another hash.
    const HASHES: u64 = 12;

    #[derive(Debug, Clone)]
    enum Op {
        /// Link hash to worker, hinting the slot of another hash (or a raw slot number).
        Link(u64, u32, Option<u64>, Option<u32>),
        Unlink(u64, u32),
        /// Link a whole chain in order, each block hinting the previous one's slot.
        Chain(Vec<u64>, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..HASHES, 0..3u32, prop::option::of(0..HASHES), prop::option::of(0..40u32))
                .prop_map(|(h, w, a, s)| Op::Link(h, w, a, s)),
            4 => (0..HASHES, 0..3u32).prop_map(|(h, w)| Op::Unlink(h, w)),
            2 => (prop::collection::vec(0..HASHES, 1..8), 0..3u32).prop_map(|(c, w)| Op::Chain(c, w)),
        ]
    }

    /// Spread the small ids over the whole u64 range (the table hashes by the value itself).
    fn key(h: u64) -> BlockHash {
        h.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Any link/unlink sequence with any placement hints behaves like a map hash → set, and the
        /// fast path (`next` from *every* slot, free ones with stale hashes included) never finds a
        /// slot other than the hash's own.
        #[test]
        fn equals_map_and_fast_path_never_lies(ops in prop::collection::vec(op(), 1..80)) {
            let mut st = BlockStore::default();
            let mut m: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Link(h, w, after, raw) => {
                        let hint = after.and_then(|a| st.find(key(a))).or(raw);
                        let (s, new) = st.link(key(h), WorkerId(w), hint);
                        prop_assert_eq!(new, m.entry(h).or_default().insert(w));
                        prop_assert_eq!(st.find(key(h)), Some(s));
                    }
                    Op::Unlink(h, w) => {
                        let want = m.get_mut(&h).is_some_and(|s| s.remove(&w));
                        if m.get(&h).is_some_and(BTreeSet::is_empty) {
                            m.remove(&h);
                        }
                        prop_assert_eq!(st.unlink(key(h), WorkerId(w)), want);
                    }
                    Op::Chain(c, w) => {
                        let mut prev = None;
                        for h in c {
                            let (s, new) = st.link(key(h), WorkerId(w), prev);
                            prop_assert_eq!(new, m.entry(h).or_default().insert(w));
                            prev = Some(s);
                        }
                    }
                }
                prop_assert_eq!(st.len(), m.len());
                for h in 0..HASHES {
                    let want: Vec<u32> = m.get(&h).map(|s| s.iter().copied().collect()).unwrap_or_default();
                    let found = st.find(key(h));
                    prop_assert_eq!(found.is_some(), !want.is_empty());
                    let got: Vec<u32> = found.map(|s| {
                        let mut v: Vec<u32> = st.set(s).iter().map(|w| w.0).collect();
                        v.sort_unstable();
                        v
                    }).unwrap_or_default();
                    prop_assert_eq!(&got, &want);
                    for prev in 0..st.slots as u32 + 1 {
                        if let Some(s) = st.next(prev, key(h)) {
                            prop_assert_eq!(Some(s), found, "slot {} after {} claims hash {}", s, prev, h);
                        }
                        prop_assert_eq!(st.find_after(Some(prev), key(h)), found);
                    }
                }
                // Every free slot is on the free list (none leak), and live + free = allocated.
                let free: BTreeSet<u32> = (0..st.slots as u32).filter(|&s| st.is_free(s)).collect();
                prop_assert_eq!(free.len() + st.len(), st.slots);
                let listed: BTreeSet<u32> = st.free.iter().copied().collect();
                prop_assert!(free.is_subset(&listed), "free {:?} listed {:?}", free, listed);
            }
        }
    }

    /// A chain linked in order is laid out in consecutive slots, and after it is freed head to
    /// tail, a new chain refills the run from its head (so the fast path works for it too).
    #[test]
    fn chains_are_consecutive_and_refill_in_order() {
        let mut st = BlockStore::default();
        let w = WorkerId(0);
        let link_chain = |st: &mut BlockStore, c: &[u64]| {
            let mut prev = None;
            c.iter()
                .map(|&h| {
                    let s = st.link(key(h), w, prev).0;
                    prev = Some(s);
                    s
                })
                .collect::<Vec<u32>>()
        };
        let a: Vec<u64> = (0..10).collect();
        assert_eq!(link_chain(&mut st, &a), (0..10).collect::<Vec<u32>>());
        let b: Vec<u64> = (100..103).collect();
        assert_eq!(link_chain(&mut st, &b), [10, 11, 12]);
        for &h in &a {
            assert!(st.unlink(key(h), w));
        }
        let c: Vec<u64> = (200..206).collect();
        assert_eq!(link_chain(&mut st, &c), (0..6).collect::<Vec<u32>>());
        assert_eq!(st.slots, 13);
    }
}
