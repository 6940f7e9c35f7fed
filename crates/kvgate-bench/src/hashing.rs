//! The router's block hashes (kvgate-core: xxh3-64 chained, seed 1337, full blocks only), so the
//! oracle counts exactly the blocks the gateway's index can match.

pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    kvgate_core::block_hashes(tokens, block_size, kvgate_core::hash_seed(None, None))
}
