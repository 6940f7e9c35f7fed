//! The set of workers holding one block, always 16 bytes:
//! - up to three ids inline (the common case: a prefix lives on one or a few workers);
//! - a 64-bit mask once more share it and every id is below 64 (a fleet of ≤ 64 workers never
//!   allocates, however widely a block is shared);
//! - a heap bitset beyond, reference-counted: blocks with exactly the same holders (the blocks of
//!   a prefix that the same workers hold, the common case along a chain) may share one bitset
//!   ([`WorkerSet::share_if_equal`], copy on write), so a walk recognises a block held by the same
//!   workers as the block before it by pointer ([`WorkerSet::same_bits`]) without reading it, and
//!   a wide prefix costs one bitset, not one per block.
//!
//! Queries read it one 64-worker word at a time ([`WorkerSet::word`]), so the prefix walk intersects
//! whole words instead of visiting each (block, worker) pair.

use crate::WorkerId;
use std::sync::Arc;

const INLINE: usize = 3;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WorkerSet {
    Inline {
        len: u8,
        ids: [u32; INLINE],
    },
    Mask(u64),
    /// Behind a thin pointer so the enum stays 16 bytes (a bare `Vec` would make every entry 32);
    /// shared between blocks with the same holders, copied on write.
    #[allow(clippy::rc_buffer)]
    Bits(Arc<Vec<u64>>),
}

impl Default for WorkerSet {
    fn default() -> Self {
        WorkerSet::Inline {
            len: 0,
            ids: [0; INLINE],
        }
    }
}

/// Bit of worker `w` within its word, and the word's index.
#[inline]
fn split(w: u32) -> (usize, u64) {
    ((w >> 6) as usize, 1u64 << (w & 63))
}

/// The ids of the set bits of `word` number `k`, ascending.
#[inline]
pub(crate) fn bits(k: usize, mut word: u64) -> impl Iterator<Item = WorkerId> {
    std::iter::from_fn(move || {
        if word == 0 {
            return None;
        }
        let b = word.trailing_zeros();
        word &= word - 1;
        Some(WorkerId((k as u32) << 6 | b))
    })
}

impl WorkerSet {
    /// The set of `w` alone.
    #[inline]
    pub(crate) fn one(w: WorkerId) -> Self {
        WorkerSet::Inline {
            len: 1,
            ids: [w.0, 0, 0],
        }
    }

    /// Workers `64k..64k+63` of the set as a bit mask.
    #[inline]
    pub(crate) fn word(&self, k: usize) -> u64 {
        match self {
            WorkerSet::Inline { len, ids } => {
                let mut m = 0;
                for &w in &ids[..*len as usize] {
                    let (kw, b) = split(w);
                    if kw == k {
                        m |= b;
                    }
                }
                m
            }
            WorkerSet::Mask(m) => {
                if k == 0 {
                    *m
                } else {
                    0
                }
            }
            WorkerSet::Bits(v) => v.get(k).copied().unwrap_or(0),
        }
    }

    /// Whether the set is `{w}`.
    #[inline]
    pub(crate) fn is_only(&self, w: WorkerId) -> bool {
        matches!(self, WorkerSet::Inline { len: 1, ids } if ids[0] == w.0)
    }

    /// Whether the set holds every worker of `alive` (64 per word), given that `alive` is zero
    /// outside words `lo..hi`: the walks' common case (a prompt block held by every worker still
    /// matching) in one pass over the words in range, without visiting workers.
    #[inline]
    pub(crate) fn covers(&self, alive: &[u64], lo: usize, hi: usize) -> bool {
        let alive = &alive[lo..hi];
        match self {
            WorkerSet::Bits(v) => {
                let v = v.get(lo..).unwrap_or(&[]);
                let n = alive.len().min(v.len());
                // Branch-free over the words (vectorises): the bits of `alive` missing from `v`.
                let missing = alive[..n]
                    .iter()
                    .zip(&v[..n])
                    .fold(0, |acc, (&a, &b)| acc | (a & !b));
                missing == 0 && alive[n..].iter().all(|&a| a == 0)
            }
            _ => alive
                .iter()
                .enumerate()
                .all(|(k, &a)| a & !self.word(lo + k) == 0),
        }
    }

    /// Every member.
    pub(crate) fn iter(&self) -> impl Iterator<Item = WorkerId> + '_ {
        let (inline, words): (&[u32], &[u64]) = match self {
            WorkerSet::Inline { len, ids } => (&ids[..*len as usize], &[]),
            WorkerSet::Mask(m) => (&[], std::slice::from_ref(m)),
            WorkerSet::Bits(v) => (&[], v),
        };
        inline.iter().map(|&w| WorkerId(w)).chain(
            words
                .iter()
                .enumerate()
                .flat_map(|(k, &word)| bits(k, word)),
        )
    }

    #[inline]
    pub(crate) fn contains(&self, w: WorkerId) -> bool {
        match self {
            WorkerSet::Inline { len, ids } => ids[..*len as usize].contains(&w.0),
            _ => {
                let (k, b) = split(w.0);
                self.word(k) & b != 0
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            WorkerSet::Inline { len, .. } => *len as usize,
            WorkerSet::Mask(m) => m.count_ones() as usize,
            WorkerSet::Bits(v) => v.iter().map(|w| w.count_ones() as usize).sum(),
        }
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            WorkerSet::Inline { len, .. } => *len == 0,
            // Bitsets shrink back to inline below four members, so they are never empty.
            _ => false,
        }
    }

    /// Adds `w`; false if it was already present.
    #[inline]
    pub(crate) fn insert(&mut self, w: WorkerId) -> bool {
        // The common case inline (a block on its first few workers), the rest out of line.
        if let WorkerSet::Inline { len, ids } = self {
            let n = *len as usize;
            if ids[..n].contains(&w.0) {
                return false;
            }
            if n < INLINE {
                ids[n] = w.0;
                *len += 1;
                return true;
            }
        }
        self.insert_slow(w)
    }

    #[inline(never)]
    fn insert_slow(&mut self, w: WorkerId) -> bool {
        if self.contains(w) {
            return false;
        }
        let (k, b) = split(w.0);
        match self {
            WorkerSet::Inline { len, ids } if (*len as usize) < INLINE => {
                ids[*len as usize] = w.0;
                *len += 1;
            }
            WorkerSet::Inline { ids, .. } => {
                let all = [ids[0], ids[1], ids[2], w.0];
                *self = Self::from_ids(&all);
            }
            WorkerSet::Mask(m) if k == 0 => *m |= b,
            WorkerSet::Mask(m) => {
                let mut v = vec![0; k + 1];
                v[0] = *m;
                v[k] = b;
                *self = WorkerSet::Bits(Arc::new(v));
            }
            WorkerSet::Bits(v) => {
                let v = Arc::make_mut(v);
                if v.len() <= k {
                    v.resize(k + 1, 0);
                }
                v[k] |= b;
            }
        }
        true
    }

    /// A bitset holding `ids` (more than [`INLINE`] of them).
    fn from_ids(ids: &[u32]) -> Self {
        let words = ids.iter().map(|&w| split(w).0).max().unwrap_or(0) + 1;
        if words == 1 {
            WorkerSet::Mask(ids.iter().fold(0, |m, &w| m | split(w).1))
        } else {
            let mut v = vec![0u64; words];
            for &w in ids {
                let (k, b) = split(w);
                v[k] |= b;
            }
            WorkerSet::Bits(Arc::new(v))
        }
    }

    /// Removes `w`; false if it was absent.
    #[inline]
    pub(crate) fn remove(&mut self, w: WorkerId) -> bool {
        if let WorkerSet::Inline { len, ids } = self {
            let n = *len as usize;
            let Some(pos) = ids[..n].iter().position(|&x| x == w.0) else {
                return false;
            };
            ids[pos] = ids[n - 1];
            *len -= 1;
            return true;
        }
        self.remove_slow(w)
    }

    #[inline(never)]
    fn remove_slow(&mut self, w: WorkerId) -> bool {
        let (k, b) = split(w.0);
        match self {
            WorkerSet::Inline { .. } => unreachable!("handled by remove"),
            WorkerSet::Mask(m) => {
                if k != 0 || *m & b == 0 {
                    return false;
                }
                *m &= !b;
            }
            WorkerSet::Bits(v) => {
                if v.get(k).is_none_or(|x| x & b == 0) {
                    return false;
                }
                let v = Arc::make_mut(v);
                match v.get_mut(k) {
                    Some(x) if *x & b != 0 => *x &= !b,
                    _ => return false,
                }
                while v.last() == Some(&0) {
                    v.pop();
                }
                if v.len() == 1 {
                    *self = WorkerSet::Mask(v[0]);
                }
            }
        }
        // Back to inline once small enough (keeps the common case allocation-free).
        if self.len() <= INLINE {
            let mut ids = [0; INLINE];
            let mut len = 0;
            for w in self.iter() {
                ids[len] = w.0;
                len += 1;
            }
            *self = WorkerSet::Inline {
                len: len as u8,
                ids,
            };
        }
        true
    }

    /// Heap bytes owned beyond the inline 16 bytes: a shared bitset's share (its size divided by
    /// the sets sharing it), so summing over every set counts each bitset once.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            WorkerSet::Bits(v) => {
                // Arc's two counters, the Vec header, the words.
                (2 * std::mem::size_of::<usize>()
                    + std::mem::size_of::<Vec<u64>>()
                    + v.capacity() * 8)
                    / Arc::strong_count(v)
            }
            _ => 0,
        }
    }

    /// Makes this set share `other`'s bitset when both are bitsets with the same members (they
    /// stay equal as sets: a later change to either copies first). True when they share now.
    pub(crate) fn share_if_equal(&mut self, other: &WorkerSet) -> bool {
        match (&mut *self, other) {
            (WorkerSet::Bits(a), WorkerSet::Bits(b)) => {
                if Arc::ptr_eq(a, b) {
                    return true;
                }
                if a[..] == b[..] {
                    *a = Arc::clone(b);
                    return true;
                }
                false
            }
            _ => false,
        }
    }

    /// The shared bitset's identity (0 for inline sets and masks): two sets with the same
    /// non-zero identity have the same members.
    #[inline]
    pub(crate) fn same_bits(&self) -> usize {
        match self {
            WorkerSet::Bits(v) => Arc::as_ptr(v) as usize,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn sixteen_bytes() {
        assert_eq!(std::mem::size_of::<WorkerSet>(), 16);
    }

    #[test]
    fn inline_mask_and_bits() {
        let mut s = WorkerSet::default();
        for w in 0..10 {
            assert!(s.insert(WorkerId(w)));
            assert!(!s.insert(WorkerId(w)));
        }
        assert!(matches!(s, WorkerSet::Mask(0x3ff)));
        assert!(s.insert(WorkerId(200)));
        assert!(matches!(s, WorkerSet::Bits(_)));
        assert_eq!(s.word(3), 1 << 8);
        assert!(s.remove(WorkerId(200)) && !s.remove(WorkerId(200)));
        assert!(matches!(s, WorkerSet::Mask(0x3ff)));
        for w in 0..8 {
            assert!(s.remove(WorkerId(w)));
            assert!(!s.remove(WorkerId(w)));
        }
        assert!(matches!(s, WorkerSet::Inline { len: 2, .. }));
        assert_eq!(s.iter().map(|w| w.0).collect::<Vec<_>>(), [9, 8]);
        assert!(s.remove(WorkerId(8)) && s.remove(WorkerId(9)) && s.is_empty());
    }

    fn set_of(ids: &BTreeSet<u32>) -> WorkerSet {
        let mut s = WorkerSet::default();
        for &w in ids {
            s.insert(WorkerId(w));
        }
        s
    }

    proptest! {
        /// `covers` (the walks' shortcut) is exactly "every worker of `alive` is a member", for
        /// every representation and any word range that holds all of `alive`.
        #[test]
        fn covers_is_subset(
            set in prop::collection::btree_set(prop_oneof![0..8u32, 0..300u32], 0..12),
            alive in prop::collection::btree_set(prop_oneof![0..8u32, 0..300u32], 0..6),
            from_set in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let s = set_of(&set);
            // Survivors partly drawn from the set itself, so both outcomes are common.
            let members: Vec<u32> = set.iter().copied().collect();
            let mut alive = alive;
            if !members.is_empty() {
                alive.extend(from_set.iter().map(|i| members[i.index(members.len())]));
            }
            let mut words = vec![0u64; 5];
            for &w in &alive {
                words[(w >> 6) as usize] |= 1 << (w & 63);
            }
            let lo = words.iter().position(|&a| a != 0).unwrap_or(0);
            let hi = words.iter().rposition(|&a| a != 0).map_or(lo, |k| k + 1);
            let want = alive.is_subset(&set);
            prop_assert_eq!(s.covers(&words, lo, hi), want);
            prop_assert_eq!(s.covers(&words, 0, words.len()), want);
        }

        /// Sets sharing a bitset stay independent sets: a change to one copies first, and
        /// sharing only happens between equal bitsets.
        #[test]
        fn shared_bitsets_copy_on_write(
            a in prop::collection::btree_set(0..300u32, 0..12),
            b in prop::collection::btree_set(0..300u32, 0..12),
            ops in prop::collection::vec((any::<bool>(), 0..300u32), 0..10),
        ) {
            let (mut sa, mut sb) = (set_of(&a), set_of(&b));
            let shared = sb.share_if_equal(&sa);
            prop_assert_eq!(shared, a == b && sa.same_bits() != 0);
            prop_assert_eq!(shared, sa.same_bits() != 0 && sa.same_bits() == sb.same_bits());
            let (mut ma, mb) = (a.clone(), b.clone());
            for (ins, w) in ops {
                if ins {
                    prop_assert_eq!(sa.insert(WorkerId(w)), ma.insert(w));
                } else {
                    prop_assert_eq!(sa.remove(WorkerId(w)), ma.remove(&w));
                }
                prop_assert_eq!(sa.iter().map(|w| w.0).collect::<BTreeSet<_>>(), ma.clone());
                prop_assert_eq!(sb.iter().map(|w| w.0).collect::<BTreeSet<_>>(), mb.clone());
                if sa.same_bits() != 0 && sa.same_bits() == sb.same_bits() {
                    prop_assert_eq!(&ma, &mb);
                }
            }
            // Shared bytes are counted once over the sets sharing them.
            if shared && sa.same_bits() == sb.same_bits() {
                let one = set_of(&a).heap_bytes();
                prop_assert!(sa.heap_bytes() + sb.heap_bytes() <= one);
            }
        }

        /// Any sequence of inserts and removes behaves like a `BTreeSet`, through every accessor.
        #[test]
        fn equals_btreeset(ops in prop::collection::vec((any::<bool>(), prop_oneof![0..8u32, 0..70u32, 0..300u32]), 0..80)) {
            let mut s = WorkerSet::default();
            let mut m = BTreeSet::new();
            for (ins, w) in ops {
                if ins {
                    prop_assert_eq!(s.insert(WorkerId(w)), m.insert(w));
                } else {
                    prop_assert_eq!(s.remove(WorkerId(w)), m.remove(&w));
                }
                prop_assert_eq!(s.len(), m.len());
                prop_assert_eq!(s.is_empty(), m.is_empty());
                let got: BTreeSet<u32> = s.iter().map(|w| w.0).collect();
                prop_assert_eq!(&got, &m);
                for k in 0..6 {
                    let want = m.iter().filter(|&&w| (w >> 6) as usize == k).fold(0u64, |a, &w| a | 1 << (w & 63));
                    prop_assert_eq!(s.word(k), want);
                }
                for w in [0u32, 5, 63, 64, 129, 299] {
                    prop_assert_eq!(s.contains(WorkerId(w)), m.contains(&w));
                }
                // Small sets never allocate; sets within the first 64 ids never allocate either.
                if m.len() <= 3 || m.iter().all(|&w| w < 64) {
                    prop_assert_eq!(s.heap_bytes(), 0);
                }
            }
        }
    }
}
