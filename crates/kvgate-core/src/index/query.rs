//! [`KvIndex::find_matches`]: each worker's longest prefix run, a 64-worker word at a time.
//!
//! The walk keeps the set of workers whose run is still unbroken as a bitset (`alive`, one `u64` per
//! 64 worker ids). At block `i` it intersects `alive` with the block's [`WorkerSet`] word by word;
//! workers that drop out get run `i`, and the walk stops when no word is left. Only the range of
//! words holding survivors is visited, and a block every survivor holds is passed by one
//! branch-free pass over that range ([`WorkerSet::covers`]) or, when it shares the bitset the
//! survivors are already known to be within (chained blocks with the same holders share one,
//! [`WorkerSet::share_if_equal`]), by a pointer comparison without reading it. So a block costs
//! one slot read plus at most O(survivors' words) — not O(workers holding it), not O(fleet) — and
//! a long prefix held by the same workers costs one bitset read. Only workers that may hold an entry
//! past its TTL (an approximate worker or an unconfirmed prediction whose oldest entry is due, not
//! yet swept by [`KvIndex::expire`]) have their (block, worker) pairs checked one by one; with none
//! such and ≤ 64 workers, a one-word fast path does `set & alive` and nothing else per block.
//!
//! Finding block `i + 1` is mostly a sequential read: blocks are stored in arrival order
//! ([`super::store`]), so it is first looked for in the slot right after block `i`'s (read straight
//! from the slab chunk by [`super::store::BlockStore::walk`]), and only otherwise through the hash table (a cache and TLB miss: the index is far larger than the caches,
//! and one miss per block used to dominate the query).

use super::worker_set::{bits, WorkerSet};
use super::{KvIndex, OverlapScores, WorkerIndex};
use crate::BlockHash;
use std::time::Instant;

impl KvIndex {
    /// For the request's chained hashes, each worker's longest consecutive run of held blocks from
    /// block 0, written to `out` (cleared first). Approximate blocks and unconfirmed predicted blocks
    /// past their TTL at `now` do not count even before [`KvIndex::expire`] runs.
    pub fn find_matches(&self, hashes: &[BlockHash], now: Instant, out: &mut OverlapScores) {
        out.clear();
        let words = self.workers.len().div_ceil(64);
        if words == 0 {
            return;
        }
        // A miss on the first block (the common case for new prompts) needs no setup at all.
        let Some(first) = hashes.first().and_then(|&h| self.blocks.find(h)) else {
            return;
        };
        let now_ns = self.ns(now);
        let mut check = std::mem::take(&mut out.check);
        self.ttl_check_mask(now_ns, words, &mut check);
        if words == 1 && check[0] == 0 {
            // Up to 64 workers, none holding anything that may have expired: one word, no
            // per-block TTL checks.
            out.check = check;
            let mut alive = u64::MAX;
            let walked = self.blocks.walk(first, hashes, |i, set| {
                let m = set.word(0) & alive;
                if m != alive && i > 0 {
                    for w in bits(0, alive & !m) {
                        out.set(w, i as u32);
                    }
                }
                alive = m;
                m != 0
            });
            // The request ended, or its next block is held by nobody: the survivors' runs are
            // complete (none survive when the walk stopped because nobody was left).
            for w in bits(0, alive) {
                out.set(w, walked as u32);
            }
            return;
        }
        let mut alive = std::mem::take(&mut out.alive);
        alive.clear();
        // Before block 0 every worker's run is unbroken (empty).
        alive.resize(words, u64::MAX);
        // Words `lo..hi` hold every still-matching worker (the rest of `alive` is zero), so a
        // block costs the words of the workers still matching, not the fleet's.
        let (mut lo, mut hi) = (0, words);
        let checking = check.iter().any(|&c| c != 0);
        // Identity of the last shared bitset the still-matching workers are known to be within.
        let mut within = 0;
        let walked = self.blocks.walk(first, hashes, |i, set| {
            // The common case along a shared prefix: every worker still matching holds the block
            // too, so nobody drops out. A block sharing the previous block's bitset (same holders)
            // is known to without reading it; otherwise one pass over the words in range, no
            // per-worker work. Workers whose entries may have expired are asked one by one in
            // `step`.
            let bits_id = set.same_bits();
            if !checking && (bits_id != 0 && bits_id == within || set.covers(&alive, lo, hi)) {
                within = bits_id;
                return true;
            }
            // After the step every worker still matching holds the block.
            within = bits_id;
            let any = self.step(
                set,
                hashes[i],
                i,
                now_ns,
                &check,
                &mut alive[lo..hi],
                lo,
                out,
            );
            while lo < hi && alive[lo] == 0 {
                lo += 1;
            }
            while hi > lo && alive[hi - 1] == 0 {
                hi -= 1;
            }
            any
        });
        for (k, &a) in alive.iter().enumerate().take(hi).skip(lo) {
            for w in bits(k, a) {
                out.set(w, walked as u32);
            }
        }
        out.alive = alive;
        out.check = check;
    }

    /// Workers (64 per word) that may hold a block whose TTL has passed at `now_ns` but which
    /// [`KvIndex::expire`] has not dropped yet: approximate workers and unconfirmed predictions
    /// whose oldest entry is past its TTL. Only their (block, worker) pairs are checked one by
    /// one; with the housekeeping sweep running, that is rarely anyone. Debug builds check the
    /// maintained deadline order against a pass over every worker.
    fn ttl_check_mask(&self, now_ns: u64, words: usize, mask: &mut Vec<u64>) {
        mask.clear();
        mask.resize(words, 0);
        if self.approx_workers == 0 && self.predicted_entries == 0 {
            return;
        }
        // Workers whose oldest TTL-bound block is due, from the maintained deadline order: as
        // many set lookups as workers due, not a pass over the fleet.
        for &(_, w) in self.due.range(..=(now_ns, u32::MAX)) {
            let i = w as usize;
            if i / 64 < words {
                mask[i / 64] |= 1 << (i % 64);
            }
        }
        #[cfg(debug_assertions)]
        {
            // The plain twin: ask every worker.
            let mut naive = vec![0u64; words];
            for (i, s) in self.workers.iter().enumerate() {
                let may = match s {
                    Some(WorkerIndex::Approx(a)) => a.may_have_expired(now_ns),
                    Some(WorkerIndex::Exact(ex)) => ex.predicted.may_have_expired(now_ns),
                    None => false,
                };
                if may {
                    naive[i / 64] |= 1 << (i % 64);
                }
            }
            debug_assert_eq!(*mask, naive, "due order out of date");
        }
    }

    /// Block `i` (hash `h`, holders `set`): keeps in `alive` (words `first_word..` of the
    /// still-matching set) the workers that hold it, records run `i` for those that drop out.
    /// False when nobody is left. Holders in `check` are asked whether the block is still live
    /// for them (approximate TTL, unconfirmed prediction TTL).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn step(
        &self,
        set: &WorkerSet,
        h: BlockHash,
        i: usize,
        now_ns: u64,
        check: &[u64],
        alive: &mut [u64],
        first_word: usize,
        out: &mut OverlapScores,
    ) -> bool {
        let mut any = false;
        for (j, a) in alive.iter_mut().enumerate() {
            let k = first_word + j;
            if *a == 0 {
                continue;
            }
            let mut m = set.word(k) & *a;
            for w in bits(k, check[k] & m) {
                let counts = match self.slot(w) {
                    Some(WorkerIndex::Approx(ap)) => ap.is_live(h, now_ns),
                    // Confirmed blocks are never among the predictions: not expired.
                    Some(WorkerIndex::Exact(ex)) => !ex.predicted.is_expired(h, now_ns),
                    None => false,
                };
                if !counts {
                    m &= !(1u64 << (w.0 & 63));
                }
            }
            if i > 0 {
                for w in bits(k, *a & !m) {
                    out.set(w, i as u32);
                }
            }
            *a = m;
            any |= m != 0;
        }
        any
    }
}

#[cfg(test)]
mod tests {
    use crate::hash::{block_hashes, BASE_SEED};
    use crate::{ApproxConfig, IndexMode, KvIndex, OverlapScores, WorkerId};
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::time::{Duration, Instant};

    /// Ids on both sides of word boundaries.
    const IDS: [u32; 8] = [0, 1, 2, 63, 64, 65, 130, 200];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// Workers in several words, each exact (events; optionally predictions too) or approximate,
        /// holding arbitrary (not only prefix-shaped) subsets of a 6-block chain: the word-wise walk
        /// gives every worker exactly its naive longest run, for any request length and query time.
        #[test]
        fn word_walk_equals_naive_runs(
            workers in prop::collection::vec((0..4u8, prop::collection::vec(any::<bool>(), 6), prop::collection::vec(any::<bool>(), 6)), 8),
            len in 0..7usize,
            probe in 0..4u64,
        ) {
            const TTL: u64 = 2;
            let t: Vec<u32> = (1..=12).collect();
            let h = block_hashes(&t, 2, BASE_SEED);
            let engine: Vec<u64> = (100..106).collect();
            let t0 = Instant::now();
            let mut ix = KvIndex::new();
            ix.set_predicted_ttl(Duration::from_secs(TTL));
            let mut want = BTreeMap::new();
            for (&id, (kind, a, b)) in IDS.iter().zip(&workers) {
                let w = WorkerId(id);
                let pick = |m: &[bool]| -> Vec<u64> { (0..6).filter(|&i| m[i]).map(|i| h[i]).collect() };
                let live = probe < TTL;
                let held: Vec<bool> = match kind {
                    0 => continue, // unknown worker
                    1 => {
                        ix.set_mode(w, IndexMode::Approximate(ApproxConfig { ttl: Duration::from_secs(TTL), capacity_blocks: 100 }));
                        ix.record_routed(w, &pick(a), t0);
                        a.iter().map(|&x| x && live).collect()
                    }
                    _ => {
                        ix.apply_stored(w, None, &engine, &t, 2, BASE_SEED).unwrap();
                        let gone: Vec<u64> = (0..6).filter(|&i| !a[i]).map(|i| engine[i]).collect();
                        ix.apply_removed(w, &gone);
                        if *kind == 3 {
                            ix.record_predicted(w, &pick(b), t0);
                            a.iter().zip(b).map(|(&x, &y)| x || (y && live)).collect()
                        } else {
                            a.clone()
                        }
                    }
                };
                let run = held[..len].iter().take_while(|&&x| x).count() as u32;
                if run > 0 {
                    want.insert(id, run);
                }
            }
            let mut out = OverlapScores::new();
            // Twice with the same buffer: scratch state must not leak between queries.
            for _ in 0..2 {
                ix.find_matches(&h[..len], t0 + Duration::from_secs(probe), &mut out);
                let got: BTreeMap<u32, u32> = out.iter().map(|(w, r)| (w.0, r)).collect();
                prop_assert_eq!(&got, &want);
            }
        }
    }
}
