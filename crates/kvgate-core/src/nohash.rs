//! Hashers for maps whose keys are already hashes.
//!
//! Router block hashes are xxh3 outputs (uniform 64-bit), so hashing them again (SipHash costs ~15 ns)
//! is pure overhead: [`IdentityHasher`] passes them through. Engine block hashes are opaque and come
//! from whatever the engine uses (vLLM: truncated sha256, but a simulator or another engine may use
//! small sequential ids), so they get [`MixHasher`], one folded multiply, which still spreads
//! sequential keys over hashbrown's high control bits.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Identity hasher for `u64` keys that are already uniformly distributed.
#[derive(Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys; fold bytes so it still works (never used on hot paths).
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// One folded 64×64→128 multiply: cheap, and good enough for arbitrary (even sequential) u64 keys.
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline]
    fn finish(&self) -> u64 {
        let m = u128::from(self.0 ^ 0x243f_6a88_85a3_08d3) * 0x9e37_79b9_7f4a_7c15u128;
        (m as u64) ^ ((m >> 64) as u64)
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// For small maps whose keys come from configuration or discovery (model names, label
/// addresses), looked up once or more per request: xxh3 over bytes, one folded multiply per
/// integer, against SipHash's ~200 instructions for a short string. Not seeded per process, so
/// never for a map into which clients choose what is inserted.
#[derive(Default, Clone, Copy)]
pub struct FastHasher(u64);

#[inline]
fn fold(x: u64) -> u64 {
    let m = u128::from(x ^ 0x243f_6a88_85a3_08d3) * 0x9e37_79b9_7f4a_7c15u128;
    (m as u64) ^ ((m >> 64) as u64)
}

impl Hasher for FastHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }
    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = fold(self.0 ^ n);
    }
    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// Build hasher of [`FastHasher`].
pub type FastBuild = BuildHasherDefault<FastHasher>;

/// Map keyed by router block hashes.
pub type HashKeyed<V> = HashMap<u64, V, BuildHasherDefault<IdentityHasher>>;
/// Map keyed by opaque engine hashes.
pub type MixKeyed<V> = HashMap<u64, V, BuildHasherDefault<MixHasher>>;
/// Set of router block hashes.
#[allow(dead_code)]
pub type HashKeySet = HashSet<u64, BuildHasherDefault<IdentityHasher>>;

/// Approximate heap bytes of a hashbrown table with `capacity` usable slots of `slot` bytes each
/// (buckets are a power of two holding 7/8 usable; one control byte per bucket plus one group).
pub fn table_bytes(capacity: usize, slot: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (slot + 1) + 16
}

#[cfg(test)]
mod fast_tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn fast_hasher_separates_orders_strings_and_prefixes() {
        let b = FastBuild::default();
        assert_ne!(
            b.hash_one((1u64, 2usize, 3usize)),
            b.hash_one((1u64, 3usize, 2usize))
        );
        assert_ne!(
            b.hash_one((0u64, 0usize, 1usize)),
            b.hash_one((0u64, 1usize, 0usize))
        );
        assert_eq!(b.hash_one("model-a"), b.hash_one(String::from("model-a")));
        assert_ne!(b.hash_one("model-a"), b.hash_one("model-b"));
        // `str` hashing appends a terminator: ("ab", "c") and ("a", "bc") differ.
        assert_ne!(b.hash_one(("ab", "c")), b.hash_one(("a", "bc")));
        let m: HashMap<&str, u32, FastBuild> = [("x", 1), ("y", 2)].into_iter().collect();
        assert_eq!(m.get("y"), Some(&2));
    }
}
