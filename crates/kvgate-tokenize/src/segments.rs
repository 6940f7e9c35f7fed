//! Segment cache: the ids of whole text segments, for tokenizers whose input splits into pieces
//! that are encoded independently, so a segment's ids depend on its text only. For the HF
//! backend a segment is the text between two added (special) tokens (`hf/native.rs`); for the
//! approximate tokenizer, a ChatML message (`approx.rs`). A rendered chat is mostly segments
//! seen before: `<|im_start|>` / `<|im_end|>` (or the template's equivalents) cut it into one
//! segment per message, and the system prompt and every earlier turn of a conversation come back
//! verbatim on the next request. Looking a segment up costs one hash and
//! one compare of its bytes (~0.2 µs per KB) against ~20–30 µs per KB to encode it with the HF
//! encoder (a few µs with the approximate one), so with the cache a request pays for its new
//! text only.
//!
//! Entries are keyed by a seeded 64-bit xxh3 of the text (SIMD-fast on long segments, where a
//! general-purpose hasher costs about a cycle per byte) and hold the text: a hit compares it
//! whole, so a hash collision is only a miss.
//!
//! A segment found again (the same system prompt on every request) skips even the hash: a small
//! direct-mapped memo remembers, under a fingerprint of the text (its length and three 8-byte
//! samples), the key it was found under. The memo only proposes a key: the entry there is a hit
//! only if its text is the segment's, compared whole, so the answer is the one the full lookup
//! gives (an entry holds the text it was keyed by); otherwise the lookup runs as usual.
//!
//! Bounded by bytes (text + ids + a fixed per-entry overhead); when full, the least recently
//! used half is dropped. Only segments of at least [`MIN_SEGMENT_BYTES`] are cached (shorter ones
//! encode faster than they hash).

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

/// Segments shorter than this are encoded every time.
pub(crate) const MIN_SEGMENT_BYTES: usize = 64;
/// Default bound of one tokenizer's segment cache.
pub(crate) const DEFAULT_BUDGET_BYTES: usize = 32 << 20;
/// Per-entry bookkeeping counted against the budget (map slot, key and ids headers).
const ENTRY_OVERHEAD: usize = 64;
/// Slots of the memo of recently found segments (a power of two).
const MEMO_SLOTS: usize = 16;
/// Texts shorter than this are not memoised (the fingerprint reads three 8-byte samples).
const MEMO_MIN_BYTES: usize = 16;

/// Locks a shared cache. A panic while it was held cannot leave it inconsistent (entries are
/// inserted whole), so a poisoned lock is taken over.
pub(crate) fn lock(cache: &Mutex<SegCache>) -> MutexGuard<'_, SegCache> {
    cache.lock().unwrap_or_else(|p| p.into_inner())
}

struct Entry {
    text: Box<str>,
    ids: Box<[u32]>,
    last_used: u64,
}

/// The map's keys are already hashes: used as they are.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, k: u64) {
        self.0 = k;
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) struct SegCache {
    map: HashMap<u64, Entry, BuildHasherDefault<KeyHasher>>,
    /// Recently found or stored segments: `(fingerprint, key)` in the slot of the fingerprint.
    memo: [(u64, u64); MEMO_SLOTS],
    /// Per-cache seed of the key hash, so colliding texts cannot be prepared in advance.
    seed: u64,
    bytes: usize,
    budget: usize,
    tick: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
}

impl SegCache {
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            map: HashMap::default(),
            memo: [(0, 0); MEMO_SLOTS],
            seed: std::collections::hash_map::RandomState::new().hash_one(0u64),
            bytes: 0,
            budget,
            tick: 0,
            hits: 0,
            misses: 0,
        }
    }

    fn cost(text: &str, ids: usize) -> usize {
        text.len() + 4 * ids + ENTRY_OVERHEAD
    }

    fn key(&self, text: &str) -> u64 {
        xxhash_rust::xxh3::xxh3_64_with_seed(text.as_bytes(), self.seed)
    }

    /// Appends the cached ids of `text` to `out`; false (nothing appended) on a miss.
    pub(crate) fn get_into(&mut self, text: &str, out: &mut Vec<u32>) -> bool {
        self.tick += 1;
        let fp = fingerprint(text);
        // The key the memo proposes, if any: a hit only with the same text there.
        if let Some(fp) = fp {
            let (f, key) = self.memo[memo_slot(fp)];
            if f == fp && self.hit(key, text, out) {
                return true;
            }
        }
        let key = self.key(text);
        if self.hit(key, text, out) {
            if let Some(fp) = fp {
                self.memo[memo_slot(fp)] = (fp, key);
            }
            return true;
        }
        self.misses += 1;
        false
    }

    /// The entry under `key` if it holds `text`: its ids appended to `out`, counted as a hit.
    #[inline]
    fn hit(&mut self, key: u64, text: &str, out: &mut Vec<u32>) -> bool {
        match self.map.get_mut(&key).filter(|e| *e.text == *text) {
            Some(e) => {
                e.last_used = self.tick;
                out.extend_from_slice(&e.ids);
                self.hits += 1;
                true
            }
            None => false,
        }
    }

    pub(crate) fn insert(&mut self, text: &str, ids: &[u32]) {
        let cost = Self::cost(text, ids.len());
        let key = self.key(text);
        // One huge segment must not flush everything else; a colliding text keeps its place.
        if cost > self.budget / 4 || self.map.contains_key(&key) {
            return;
        }
        if self.bytes + cost > self.budget {
            self.evict_older_half();
        }
        self.tick += 1;
        self.bytes += cost;
        if let Some(fp) = fingerprint(text) {
            self.memo[memo_slot(fp)] = (fp, key);
        }
        self.map.insert(
            key,
            Entry {
                text: text.into(),
                ids: ids.into(),
                last_used: self.tick,
            },
        );
    }

    /// Changes the budget; entries over it are dropped now (all of them for 0, which turns the
    /// cache off: `insert` then refuses everything).
    pub(crate) fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        while self.bytes > self.budget && !self.map.is_empty() {
            self.evict_older_half();
        }
        if budget == 0 {
            self.map = HashMap::default();
            self.bytes = 0;
        }
    }

    /// Entries and bytes counted against the budget.
    pub(crate) fn size(&self) -> (usize, usize) {
        (self.map.len(), self.bytes)
    }

    /// Drops the entries used least recently, about half of them (by entry count).
    fn evict_older_half(&mut self) {
        let mut lasts: Vec<u64> = self.map.values().map(|e| e.last_used).collect();
        if lasts.is_empty() {
            return;
        }
        let mid = lasts.len() / 2;
        let (_, &mut cut, _) = lasts.select_nth_unstable(mid);
        let mut bytes = 0;
        self.map.retain(|_, e| {
            let keep = e.last_used > cut;
            if keep {
                bytes += Self::cost(&e.text, e.ids.len());
            }
            keep
        });
        self.bytes = bytes;
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

/// A cheap fingerprint of a segment (`None` below [`MEMO_MIN_BYTES`]): its length and its first,
/// middle and last 8 bytes, mixed. It only picks a memo slot and a candidate key, so texts that
/// share it cost a lookup, never a wrong answer.
#[inline]
fn fingerprint(text: &str) -> Option<u64> {
    let b = text.as_bytes();
    let n = b.len();
    if n < MEMO_MIN_BYTES {
        return None;
    }
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let mix = |h: u64, w: u64| {
        let m = u128::from(h ^ w) * 0x9e37_79b9_7f4a_7c15u128;
        (m as u64) ^ ((m >> 64) as u64)
    };
    Some(mix(
        mix(mix(n as u64, word(0)), word(n / 2 - 4)),
        word(n - 8),
    ))
}

#[inline]
fn memo_slot(fp: u64) -> usize {
    (fp >> (64 - MEMO_SLOTS.trailing_zeros())) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_return_the_stored_ids_and_misses_append_nothing() {
        let mut c = SegCache::new(1 << 20);
        let mut out = vec![9];
        assert!(!c.get_into("system\nYou are a helpful assistant.", &mut out));
        assert_eq!(out, [9]);
        c.insert("system\nYou are a helpful assistant.", &[1, 2, 3]);
        assert!(c.get_into("system\nYou are a helpful assistant.", &mut out));
        assert_eq!(out, [9, 1, 2, 3]);
        assert!(!c.get_into("system\nYou are a helpful assistant!", &mut out));
        assert_eq!((c.hits, c.misses), (1, 2));
    }

    #[test]
    fn a_colliding_key_is_a_miss_not_someone_elses_ids() {
        let mut c = SegCache::new(1 << 20);
        c.insert("the first text", &[1, 2]);
        // Another text under the first one's key, as a hash collision would put it.
        let key = c.key("the first text");
        let other = "another text with the same key";
        c.map.get_mut(&key).unwrap().text = other.into();
        let mut out = Vec::new();
        assert!(!c.get_into("the first text", &mut out));
        assert!(out.is_empty());
        // Inserting the first text again leaves the occupant alone.
        c.insert("the first text", &[3]);
        assert!(!c.get_into("the first text", &mut out));
        assert_eq!(&*c.map[&key].text, other);
    }

    /// The memo proposes keys; the text decides. Two texts with the same fingerprint (same
    /// length and samples) each get their own ids however lookups interleave; a proposal pointing
    /// at another entry, or at one evicted since, is only a lookup; counts are those of the plain
    /// lookup.
    #[test]
    fn the_memo_never_answers_for_another_text() {
        let mut c = SegCache::new(1 << 20);
        let base = "system\nYou are a helpful assistant. ".repeat(4);
        let (mut a, mut b) = (base.clone().into_bytes(), base.clone().into_bytes());
        a[20] = b'X';
        b[20] = b'Y';
        let (a, b) = (String::from_utf8(a).unwrap(), String::from_utf8(b).unwrap());
        assert_eq!(fingerprint(&a), fingerprint(&b));
        c.insert(&a, &[1, 1]);
        c.insert(&b, &[2, 2]);
        for (text, want) in [(&a, [1, 1]), (&b, [2, 2]), (&b, [2, 2]), (&a, [1, 1])] {
            let mut out = Vec::new();
            assert!(c.get_into(text, &mut out));
            assert_eq!(out, want);
        }
        // The slot now proposes `a`'s key for `b`'s fingerprint, and a missing text's.
        let slot = memo_slot(fingerprint(&a).unwrap());
        assert_eq!(c.memo[slot], (fingerprint(&a).unwrap(), c.key(&a)));
        let mut out = Vec::new();
        assert!(c.get_into(&b, &mut out));
        assert_eq!(out, [2, 2]);
        let mut c2 = base.clone().into_bytes();
        c2[20] = b'Z';
        let other = String::from_utf8(c2).unwrap();
        assert!(!c.get_into(&other, &mut out));
        assert_eq!(out, [2, 2]);
        assert_eq!((c.hits, c.misses), (5, 1));
        // Evicted: the memo still holds the key, the lookup misses and appends nothing.
        assert!(c.memo.iter().any(|&(_, k)| k == c.key(&b)));
        c.set_budget(0);
        let mut out = Vec::new();
        assert!(!c.get_into(&a, &mut out) && !c.get_into(&b, &mut out));
        assert!(out.is_empty());
    }

    #[test]
    fn stays_within_its_budget_and_keeps_what_is_in_use() {
        let budget = 64 * 1024;
        let mut c = SegCache::new(budget);
        let hot = "h".repeat(200);
        c.insert(&hot, &[7; 50]);
        for i in 0..5_000 {
            let s = format!("{i:0>200}");
            c.insert(&s, &[1; 50]);
            assert!(c.bytes() <= budget, "{} > {budget}", c.bytes());
            // The hot segment is read between inserts and so survives every eviction.
            let mut out = Vec::new();
            assert!(c.get_into(&hot, &mut out), "hot segment evicted at {i}");
            assert_eq!(out, [7; 50]);
        }
        assert!(c.len() > 10 && c.len() < 5_000);
        // A segment larger than a quarter of the budget is not cached at all.
        let huge = "x".repeat(budget / 2);
        c.insert(&huge, &[1]);
        let mut out = Vec::new();
        assert!(!c.get_into(&huge, &mut out));
    }

    #[test]
    fn a_smaller_budget_evicts_at_once_and_zero_turns_it_off() {
        let mut c = SegCache::new(1 << 20);
        for i in 0..1_000 {
            c.insert(&format!("{i:0>200}"), &[1; 50]);
        }
        let (n, bytes) = c.size();
        assert_eq!(n, 1_000);
        assert!(bytes > 64 * 1024);
        c.set_budget(64 * 1024);
        let (n2, bytes2) = c.size();
        assert!(
            bytes2 <= 64 * 1024 && n2 > 0 && n2 < n,
            "{n2} entries, {bytes2} bytes"
        );
        c.set_budget(0);
        assert_eq!(c.size(), (0, 0));
        c.insert(&"y".repeat(100), &[1]);
        assert_eq!(c.size(), (0, 0), "budget 0: nothing is cached");
    }
}
