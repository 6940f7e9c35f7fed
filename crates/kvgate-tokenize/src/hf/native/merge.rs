//! The BPE merge loop for one pre-tokenized word, and the bounded per-word result cache.
//!
//! Semantics are `tokenizers`' `Word::merge_all` without dropout: repeatedly merge the adjacent
//! pair with the lowest merge rank, leftmost first, until no adjacent pair has a merge. Short
//! words (almost all of them) use a flat array scan; long ones a heap with a linked list, so a
//! megabyte-long "word" stays O(n log n) rather than O(n²).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for pair keys (`left << 32 | right`). The keys stored come from the vocabulary, not
/// from requests, so a multiplicative hash is safe here; input-keyed maps use SipHash.
#[derive(Default)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, k: u64) {
        let h = (self.0 ^ k).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        // hashbrown takes the bucket from the low bits: fold the well-mixed high bits down.
        self.0 = h ^ (h >> 32);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// `(left id, right id)` -> `(rank, merged id)`.
pub(crate) type PairMap = HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>;

pub(crate) fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

const NO_MERGE: u32 = u32::MAX;
/// Words up to this many bytes use the flat scan.
const SMALL_WORD: usize = 48;
/// Words longer than this are not cached (as in `tokenizers`).
const MAX_CACHED_WORD: usize = 256;
/// Cache bounds: entries and total cached ids; when either is reached the cache starts over.
const CACHE_ENTRIES: usize = 64 * 1024;
const CACHE_IDS: usize = 1 << 20;

/// `byte_ids` entry of a byte whose ByteLevel symbol is not in the vocabulary.
pub(crate) const MISSING: u32 = u32::MAX;

/// The BPE tables: byte symbol ids, merges, and (with `ignore_merges`) whole-word ids.
pub(crate) struct Bpe {
    /// The id of each byte's ByteLevel symbol (GPT-2 byte -> char map), or [`MISSING`] (real
    /// files lack some: SmolLM2 has no symbol for 0x04, 0xC0, 0xF5..=0xFF, …).
    pub(crate) byte_ids: [u32; 256],
    /// For a missing byte with `byte_fallback`: the `<0xNN>` ids of its symbol's UTF-8 bytes
    /// (what `tokenizers` emits), when all exist.
    pub(crate) fallback: Vec<Option<Vec<u32>>>,
    /// For a missing byte otherwise: `(unk id, fuse_unk)`; `None` drops the byte (as
    /// `tokenizers` does without an `unk_token`).
    pub(crate) unk: Option<(u32, bool)>,
    pub(crate) merges: PairMap,
    /// `ignore_merges`: a word that is itself a vocabulary entry is that one token. Keyed by the
    /// word's raw bytes (the ByteLevel map is a bijection, so this equals the mapped-string key).
    pub(crate) whole_words: Option<HashMap<Box<[u8]>, u32, ahash::RandomState>>,
}

/// Reusable buffers of one encode call.
#[derive(Default)]
pub(crate) struct Scratch {
    ids: Vec<u32>,
    /// `cand[i]` = merge of `(ids[i], ids[i + 1])` as `(rank, new id)`, `NO_MERGE` rank if none.
    cand: Vec<(u32, u32)>,
    syms: Vec<Sym>,
    heap: BinaryHeap<Reverse<(u32, u32)>>,
}

#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: u32,
    next: u32,
    dead: bool,
}

const NIL: u32 = u32::MAX;

/// Word -> ids, bounded (see `CACHE_ENTRIES`, `CACHE_IDS`). The ids live in one arena so an
/// entry costs one key allocation.
#[derive(Default)]
pub(crate) struct WordCache {
    /// Keys are request text: a randomly seeded hasher (fast, unlike std's SipHash).
    map: HashMap<Box<[u8]>, (u32, u32), ahash::RandomState>,
    arena: Vec<u32>,
    /// Sum of the keys' lengths (for [`WordCache::size`]).
    key_bytes: usize,
}

impl WordCache {
    fn get(&self, word: &[u8]) -> Option<&[u32]> {
        let &(start, len) = self.map.get(word)?;
        self.arena.get(start as usize..(start + len) as usize)
    }

    fn insert(&mut self, word: &[u8], ids: &[u32]) {
        if self.map.len() >= CACHE_ENTRIES || self.arena.len() + ids.len() > CACHE_IDS {
            self.map.clear();
            self.arena.clear();
            self.key_bytes = 0;
        }
        self.key_bytes += word.len();
        let start = self.arena.len() as u32;
        self.arena.extend_from_slice(ids);
        self.map.insert(word.into(), (start, ids.len() as u32));
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Entries, and bytes held: keys, ids and a per-entry estimate of the map's slot and headers.
    pub(crate) fn size(&self) -> (usize, usize) {
        let n = self.map.len();
        (n, self.key_bytes + 4 * self.arena.len() + 40 * n)
    }
}

impl Bpe {
    fn merge_of(&self, left: u32, right: u32) -> (u32, u32) {
        self.merges
            .get(&pair_key(left, right))
            .copied()
            .unwrap_or((NO_MERGE, 0))
    }

    /// Appends the ids of one word (raw bytes, non-empty pieces of the pre-tokenizer).
    pub(crate) fn word(
        &self,
        word: &[u8],
        cache: Option<&mut WordCache>,
        s: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        match word {
            [] => return,
            [b] if self.byte_ids[usize::from(*b)] != MISSING => {
                return out.push(self.byte_ids[usize::from(*b)]);
            }
            _ => {}
        }
        if let Some(id) = self.whole_words.as_ref().and_then(|w| w.get(word)) {
            return out.push(*id);
        }
        // Merging a word of up to 3 bytes costs less than hashing it for the cache.
        let cache = cache.filter(|_| (4..=MAX_CACHED_WORD).contains(&word.len()));
        if let Some(ids) = cache.as_ref().and_then(|c| c.get(word)) {
            return out.extend_from_slice(ids);
        }
        self.symbols(word, &mut s.ids);
        let ids = if s.ids.len() <= SMALL_WORD {
            self.merge_small(s)
        } else {
            self.merge_long(s)
        };
        out.extend_from_slice(ids);
        if let Some(c) = cache {
            c.insert(word, ids);
        }
    }

    /// The word's initial symbols, as `tokenizers`' `BPE::merge_word` builds them.
    fn symbols(&self, word: &[u8], ids: &mut Vec<u32>) {
        ids.clear();
        ids.extend(word.iter().map(|&b| self.byte_ids[usize::from(b)]));
        if !ids.contains(&MISSING) {
            return;
        }
        ids.clear();
        // A pending unk is emitted before the next known symbol (or at the end); fallback bytes
        // do not flush it, matching `merge_word`'s order.
        let mut unk = None;
        for &b in word {
            let id = self.byte_ids[usize::from(b)];
            if id != MISSING {
                ids.extend(unk.take());
                ids.push(id);
            } else if let Some(fb) = &self.fallback[usize::from(b)] {
                ids.extend_from_slice(fb);
            } else if let Some((u, fuse)) = self.unk {
                if !(fuse && unk.is_some()) {
                    ids.extend(unk.replace(u));
                }
            }
        }
        ids.extend(unk);
    }

    /// Flat scan: the lowest (rank, position) candidate is merged, its neighbours re-looked-up.
    fn merge_small<'s>(&self, s: &'s mut Scratch) -> &'s [u32] {
        let ids = &mut s.ids;
        let cand = &mut s.cand;
        cand.clear();
        cand.extend(ids.windows(2).map(|w| self.merge_of(w[0], w[1])));
        loop {
            let mut best = NO_MERGE;
            let mut at = 0;
            for (i, &(rank, _)) in cand.iter().enumerate() {
                if rank < best {
                    best = rank;
                    at = i;
                }
            }
            if best == NO_MERGE {
                break;
            }
            ids[at] = cand[at].1;
            ids.remove(at + 1);
            cand.remove(at);
            if at > 0 {
                cand[at - 1] = self.merge_of(ids[at - 1], ids[at]);
            }
            if at + 1 < ids.len() {
                cand[at] = self.merge_of(ids[at], ids[at + 1]);
            }
        }
        ids
    }

    /// Heap of (rank, position) over a linked list of symbols; stale entries are skipped when
    /// the pair at their position no longer has that rank.
    fn merge_long<'s>(&self, s: &'s mut Scratch) -> &'s [u32] {
        let n = s.ids.len() as u32;
        s.syms.clear();
        s.syms.extend(s.ids.iter().enumerate().map(|(i, &id)| Sym {
            id,
            prev: if i == 0 { NIL } else { i as u32 - 1 },
            next: if i as u32 + 1 == n { NIL } else { i as u32 + 1 },
            dead: false,
        }));
        s.heap.clear();
        for i in 0..n - 1 {
            let (rank, _) = self.merge_of(s.syms[i as usize].id, s.syms[i as usize + 1].id);
            if rank != NO_MERGE {
                s.heap.push(Reverse((rank, i)));
            }
        }
        while let Some(Reverse((rank, pos))) = s.heap.pop() {
            let p = pos as usize;
            let sym = s.syms[p];
            if sym.dead || sym.next == NIL {
                continue;
            }
            let right = s.syms[sym.next as usize];
            let (now, new_id) = self.merge_of(sym.id, right.id);
            if now != rank {
                continue;
            }
            s.syms[sym.next as usize].dead = true;
            s.syms[p].id = new_id;
            s.syms[p].next = right.next;
            if right.next != NIL {
                s.syms[right.next as usize].prev = pos;
                let (r, _) = self.merge_of(new_id, s.syms[right.next as usize].id);
                if r != NO_MERGE {
                    s.heap.push(Reverse((r, pos)));
                }
            }
            if sym.prev != NIL {
                let (r, _) = self.merge_of(s.syms[sym.prev as usize].id, new_id);
                if r != NO_MERGE {
                    s.heap.push(Reverse((r, sym.prev)));
                }
            }
        }
        s.ids.clear();
        let mut i = 0;
        while i != NIL {
            s.ids.push(s.syms[i as usize].id);
            i = s.syms[i as usize].next;
        }
        &s.ids
    }
}
