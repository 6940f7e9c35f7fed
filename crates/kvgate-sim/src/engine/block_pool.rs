//! Paged KV cache: a fixed pool of blocks, a prefix cache keyed by the engine's chained hash, and an
//! LRU queue of unreferenced blocks (vLLM's free-block queue). Evicting a cached block emits
//! `BlockRemoved`; caching a full block is reported by the engine as `BlockStored`.

use std::collections::{BTreeMap, HashMap};

use crate::kv_events::KvEvent;

/// Engine block hash: xxh3-128 chained over (parent digest, block tokens), seeded — deliberately a
/// different function from the router's, as with a real vLLM (see docs/sim.md).
pub type EngineHash = u128;

/// What goes on the wire: the low 64 bits, like vLLM's `int.from_bytes(digest, "big") & (2**64-1)`.
pub fn wire_hash(h: EngineHash) -> u64 {
    h as u64
}

pub fn none_hash(seed: u64) -> EngineHash {
    xxhash_rust::xxh3::xxh3_128_with_seed(b"kvgate-sim-none-hash", seed)
}

pub fn chain_hash(parent: EngineHash, tokens: &[u32], seed: u64) -> EngineHash {
    let mut buf = Vec::with_capacity(16 + tokens.len() * 4);
    buf.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_128_with_seed(&buf, seed)
}

#[derive(Debug, Default, Clone)]
struct Block {
    ref_cnt: u32,
    /// Present while the block is in the prefix cache.
    cached: Option<CachedBlock>,
    /// Position in the free (eviction) queue while unreferenced.
    free_stamp: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct CachedBlock {
    pub hash: EngineHash,
    pub parent: Option<EngineHash>,
    pub tokens: Vec<u32>,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Unreferenced blocks, oldest stamp evicted first.
    free: BTreeMap<u64, usize>,
    next_stamp: u64,
    cache: HashMap<EngineHash, usize>,
    usable: usize,
}

impl BlockPool {
    /// `num_blocks` includes block 0, the null block vLLM keeps out of the pool.
    pub fn new(num_blocks: usize) -> Self {
        let mut pool = Self {
            blocks: vec![Block::default(); num_blocks],
            free: BTreeMap::new(),
            next_stamp: 0,
            cache: HashMap::new(),
            usable: num_blocks.saturating_sub(1),
        };
        for id in 1..num_blocks {
            pool.push_free(id);
        }
        pool
    }

    fn push_free(&mut self, id: usize) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.blocks[id].free_stamp = Some(stamp);
        self.free.insert(stamp, id);
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn usable(&self) -> usize {
        self.usable
    }

    /// vLLM's `kv_cache_usage_perc`: evictable cached blocks count as free.
    pub fn usage(&self) -> f64 {
        if self.usable == 0 {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.usable as f64
    }

    pub fn lookup(&self, hash: &EngineHash) -> Option<usize> {
        self.cache.get(hash).copied()
    }

    pub fn is_unreferenced(&self, id: usize) -> bool {
        self.blocks[id].ref_cnt == 0
    }

    /// Takes a reference on a cache hit, pulling it out of the eviction queue if it was idle.
    pub fn touch(&mut self, id: usize) {
        let b = &mut self.blocks[id];
        if let Some(stamp) = b.free_stamp.take() {
            self.free.remove(&stamp);
        }
        b.ref_cnt += 1;
    }

    /// Takes `n` blocks from the head of the free queue, evicting cached ones (→ `BlockRemoved`).
    pub fn allocate(&mut self, n: usize, events: &mut Vec<KvEvent>) -> Option<Vec<usize>> {
        if self.free.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        let mut removed = Vec::new();
        for _ in 0..n {
            let (_, id) = self.free.pop_first()?;
            let b = &mut self.blocks[id];
            b.free_stamp = None;
            b.ref_cnt = 1;
            if let Some(c) = b.cached.take() {
                self.cache.remove(&c.hash);
                removed.push(wire_hash(c.hash));
            }
            out.push(id);
        }
        if !removed.is_empty() {
            events.push(KvEvent::BlockRemoved {
                block_hashes: removed,
            });
        }
        Some(out)
    }

    /// Drops one reference per block. Callers pass blocks tail-first so a request's last blocks are
    /// evicted before its shared prefix (vLLM frees in reverse order for the same reason).
    pub fn release(&mut self, ids: impl IntoIterator<Item = usize>) {
        for id in ids {
            let b = &mut self.blocks[id];
            debug_assert!(b.ref_cnt > 0);
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 {
                self.push_free(id);
            }
        }
    }

    /// Registers a full block in the prefix cache. Returns false when an identical block is already
    /// cached (then this copy stays anonymous and nothing is reported).
    pub fn cache_block(&mut self, id: usize, block: CachedBlock) -> bool {
        if self.cache.contains_key(&block.hash) || self.blocks[id].cached.is_some() {
            return false;
        }
        self.cache.insert(block.hash, id);
        self.blocks[id].cached = Some(block);
        true
    }

    /// Forgets every cached hash (blocks in use stay allocated but are no longer shareable).
    pub fn clear_cache(&mut self) {
        for b in &mut self.blocks {
            b.cached = None;
        }
        self.cache.clear();
    }

    /// Every cached block, in block-id order.
    pub fn cached_blocks(&self) -> Vec<(usize, &CachedBlock, bool)> {
        self.blocks
            .iter()
            .enumerate()
            .filter_map(|(id, b)| b.cached.as_ref().map(|c| (id, c, b.ref_cnt > 0)))
            .collect()
    }

    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cb(h: u128) -> CachedBlock {
        CachedBlock {
            hash: h,
            parent: None,
            tokens: vec![1, 2],
        }
    }

    #[test]
    fn evicts_least_recently_freed_first_and_reports_it() {
        let mut pool = BlockPool::new(4); // 3 usable
        let mut ev = Vec::new();
        let a = pool.allocate(3, &mut ev).unwrap();
        assert!(ev.is_empty());
        for (i, id) in a.iter().enumerate() {
            assert!(pool.cache_block(*id, cb(i as u128 + 10)));
        }
        // Free a[1] first, then a[0]: a[1] is the LRU victim.
        pool.release([a[1]]);
        pool.release([a[0]]);
        assert_eq!(pool.usage(), 1.0 - 2.0 / 3.0);
        let got = pool.allocate(1, &mut ev).unwrap();
        assert_eq!(got, vec![a[1]]);
        assert_eq!(
            ev,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![11]
            }]
        );
        assert!(pool.lookup(&11).is_none());
        assert_eq!(pool.lookup(&10), Some(a[0]));
    }

    #[test]
    fn touching_an_idle_cached_block_protects_it_from_eviction() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let a = pool.allocate(2, &mut ev).unwrap();
        pool.cache_block(a[0], cb(1));
        pool.release(a.clone());
        pool.touch(a[0]);
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.allocate(1, &mut ev).unwrap(), vec![a[1]]);
        assert!(
            ev.is_empty(),
            "the untouched, uncached block is reused silently"
        );
        assert!(pool.allocate(1, &mut ev).is_none());
    }

    #[test]
    fn duplicate_hash_is_not_cached_twice() {
        let mut pool = BlockPool::new(3);
        let a = pool.allocate(2, &mut Vec::new()).unwrap();
        assert!(pool.cache_block(a[0], cb(7)));
        assert!(!pool.cache_block(a[1], cb(7)));
        assert_eq!(pool.num_cached(), 1);
    }

    #[test]
    fn chained_hash_depends_on_parent_and_seed() {
        let n = none_hash(0);
        let h1 = chain_hash(n, &[1, 2, 3], 0);
        assert_ne!(h1, chain_hash(n, &[1, 2, 3], 1));
        assert_ne!(chain_hash(h1, &[4], 0), chain_hash(n, &[4], 0));
        assert_eq!(h1, chain_hash(n, &[1, 2, 3], 0));
    }
}
