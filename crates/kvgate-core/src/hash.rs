//! Block hashing, compatible with NVIDIA Dynamo 1.6.1 (`compute_block_hash_for_seq`) so fleets can mix
//! routers:
//! - local hash of a full block = xxh3-64 over its token ids as little-endian `u32`, with the seed;
//! - chained (sequence) hash: `h_0 = local_0`, `h_i = xxh3_64(LE64(h_{i-1}) ‖ LE64(local_i), seed)`;
//! - only full blocks are hashed (a trailing partial block has no hash);
//! - the seed is `1337 + xxh3_64(lora, 0) + xxh3_64(salt, 1)` (wrapping; empty strings count as none).
//!
//! Because the chained hash of block `i` identifies the whole prefix `0..=i`, a flat map from hash to
//! workers is enough for prefix matching (no radix tree needed).

use crate::BlockHash;
use xxhash_rust::xxh3::xxh3_64_with_seed;
#[cfg(not(target_endian = "little"))]
use xxhash_rust::xxh3::Xxh3;

/// The base seed (Dynamo's `XXH3_SEED`).
pub const BASE_SEED: u64 = 1337;

/// The hashing seed for a request: [`BASE_SEED`] plus the LoRA adapter name and `cache_salt`
/// contributions. `None` and `Some("")` are equivalent.
pub fn hash_seed(lora: Option<&str>, salt: Option<&str>) -> u64 {
    let mut seed = BASE_SEED;
    if let Some(l) = lora.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(l.as_bytes(), 0));
    }
    if let Some(s) = salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(s.as_bytes(), 1));
    }
    seed
}

/// The local (unchained) hash of one block: xxh3-64 over the tokens as little-endian `u32`.
///
/// On little-endian targets the tokens' own memory is those bytes: hashed in place, no copy.
#[cfg(target_endian = "little")]
#[inline]
pub fn local_block_hash(tokens: &[u32], seed: u64) -> u64 {
    use zerocopy::IntoBytes;
    xxh3_64_with_seed(tokens.as_bytes(), seed)
}

/// The local (unchained) hash of one block: xxh3-64 over the tokens as little-endian `u32`.
#[cfg(not(target_endian = "little"))]
pub fn local_block_hash(tokens: &[u32], seed: u64) -> u64 {
    // Big-endian: the bytes are built in a stack buffer (streamed for long blocks).
    const STACK_TOKENS: usize = 256;
    let mut buf = [0u8; STACK_TOKENS * 4];
    let mut h = Xxh3::with_seed(seed);
    for chunk in tokens.chunks(STACK_TOKENS) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    h.digest()
}

/// The chained hash of a block given its parent's chained hash and its own local hash.
#[inline]
pub fn chain_hash(parent: BlockHash, local: u64, seed: u64) -> BlockHash {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, seed)
}

/// The chained hash of the block that follows `parent` (or the first block when `parent` is `None`).
/// Always inlined: out of line it cost ~34 instructions more per block in [`block_hashes_into`]
/// (call, prologue, epilogue and the moves around them; measured by callgrind), and the request
/// path hashes every block of the prompt.
#[inline(always)]
pub fn next_hash(parent: Option<BlockHash>, block_tokens: &[u32], seed: u64) -> BlockHash {
    let local = local_block_hash(block_tokens, seed);
    match parent {
        Some(p) => chain_hash(p, local, seed),
        None => local,
    }
}

/// Chained hashes of every full block of `tokens`. `block_size == 0` yields no hashes.
pub fn block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<BlockHash> {
    let mut out = Vec::new();
    block_hashes_into(tokens, block_size, seed, &mut out);
    out
}

/// Like [`block_hashes`] but writes into `out` (cleared first), so the hot path can reuse a buffer.
pub fn block_hashes_into(tokens: &[u32], block_size: usize, seed: u64, out: &mut Vec<BlockHash>) {
    out.clear();
    if block_size == 0 {
        return;
    }
    out.reserve(tokens.len() / block_size);
    let mut parent = None;
    for block in tokens.chunks_exact(block_size) {
        let h = next_hash(parent, block, seed);
        out.push(h);
        parent = Some(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(n: u32) -> Vec<u32> {
        (1..=n).collect()
    }

    #[test]
    fn issue_vectors() {
        let s = hash_seed(None, None);
        assert_eq!(
            block_hashes(&range(40), 16, s),
            [16863443419780771464, 12466389667045779788]
        );
        assert_eq!(
            block_hashes(&range(10), 4, s),
            [14643705804678351452, 4945711292740353085]
        );
        assert_eq!(
            block_hashes(&range(40), 16, hash_seed(Some("my-lora"), None)),
            [4148081000444450790, 3696725074943397842]
        );
        assert_eq!(
            block_hashes(&range(40), 16, hash_seed(None, Some("salt-1"))),
            [1299989514926239719, 511481658413746111]
        );
    }

    #[test]
    fn empty_strings_are_none_and_order_matters() {
        assert_eq!(hash_seed(Some(""), Some("")), BASE_SEED);
        assert_ne!(hash_seed(Some("a"), None), hash_seed(None, Some("a")));
    }

    #[test]
    fn partial_blocks_and_zero_block_size() {
        assert!(block_hashes(&range(15), 16, BASE_SEED).is_empty());
        assert!(block_hashes(&range(40), 0, BASE_SEED).is_empty());
        assert_eq!(block_hashes(&range(47), 16, BASE_SEED).len(), 2);
    }

    #[test]
    fn every_block_length_matches_the_le_bytes() {
        // Short, medium and long blocks (xxh3's size classes; the big-endian build streams past 256).
        let all: Vec<u32> = (0..1000u32).map(|t| t.wrapping_mul(2654435761)).collect();
        for n in [0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000] {
            let tokens = &all[..n];
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            assert_eq!(
                local_block_hash(tokens, 99),
                xxh3_64_with_seed(&bytes, 99),
                "{n}"
            );
        }
    }

    #[test]
    fn prefix_shares_hashes() {
        let a = block_hashes(&range(64), 16, BASE_SEED);
        let mut t = range(64);
        t[40] = 7;
        let b = block_hashes(&t, 16, BASE_SEED);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(a[3], b[3]);
    }
}
