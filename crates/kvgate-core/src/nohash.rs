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
