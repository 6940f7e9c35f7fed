//! The prefix-cache side of the engine: registering full blocks (→ `BlockStored`), the cache reset
//! (→ `AllBlocksCleared`) and the `/sim/cache` snapshot.

use super::block_pool::{wire_hash, CachedBlock};
use super::request::Request;
use super::Engine;
use crate::kv_events::KvEvent;

/// A block of the cache as `/sim/cache` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CacheEntry {
    pub block_id: usize,
    /// Wire (64-bit) engine hash, as in `BlockStored.block_hashes`.
    pub hash: u64,
    pub parent_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    /// Referenced by a running request (not evictable).
    pub in_use: bool,
}

impl Engine {
    /// Registers the computed full blocks of request `idx` and reports each new run as one event.
    pub(super) fn cache_full_blocks(&mut self, idx: usize) {
        let bs = self.cfg.block_size;
        let seed = self.cfg.seed;
        let none = self.none;
        let r = &mut self.running[idx];
        r.update_hashes(bs, none, seed);
        let full = (r.computed / bs).min(r.hashes.len()).min(r.blocks.len());
        let mut run: Option<KvEvent> = None;
        for b in r.cached_blocks..full {
            let parent = (b > 0).then(|| r.hashes[b - 1]);
            let block = CachedBlock {
                hash: r.hashes[b],
                parent,
                tokens: r.tokens[b * bs..(b + 1) * bs].to_vec(),
            };
            if self.pool.cache_block(r.blocks[b], block) {
                match &mut run {
                    Some(KvEvent::BlockStored {
                        block_hashes,
                        token_ids,
                        ..
                    }) => {
                        block_hashes.push(wire_hash(r.hashes[b]));
                        token_ids.extend_from_slice(&r.tokens[b * bs..(b + 1) * bs]);
                    }
                    _ => {
                        run = Some(KvEvent::BlockStored {
                            block_hashes: vec![wire_hash(r.hashes[b])],
                            parent_block_hash: parent.map(wire_hash),
                            token_ids: r.tokens[b * bs..(b + 1) * bs].to_vec(),
                            block_size: bs,
                        });
                    }
                }
            } else if let Some(ev) = run.take() {
                self.events.push(ev);
            }
        }
        r.cached_blocks = r.cached_blocks.max(full);
        if let Some(ev) = run {
            self.events.push(ev);
        }
    }

    /// `--assume-cached-header`: registers the blocks at positions `fresh` (ascending) of an
    /// admitted request's prompt, just allocated for its assumed-cached prefix, as cached blocks
    /// an earlier request computed: each run of consecutive positions is one `BlockStored`, so a
    /// router's index sees what this worker now holds.
    pub(super) fn store_assumed(&mut self, r: &Request, fresh: &[usize]) {
        let bs = self.cfg.block_size;
        let mut run: Option<(usize, KvEvent)> = None;
        for &b in fresh {
            let parent = (b > 0).then(|| r.hashes[b - 1]);
            let tokens = &r.tokens[b * bs..(b + 1) * bs];
            let stored = self.pool.cache_block(
                r.blocks[b],
                CachedBlock {
                    hash: r.hashes[b],
                    parent,
                    tokens: tokens.to_vec(),
                },
            );
            debug_assert!(stored, "an assumed block is allocated only when not cached");
            match &mut run {
                Some((
                    last,
                    KvEvent::BlockStored {
                        block_hashes,
                        token_ids,
                        ..
                    },
                )) if *last + 1 == b => {
                    block_hashes.push(wire_hash(r.hashes[b]));
                    token_ids.extend_from_slice(tokens);
                    *last = b;
                }
                _ => {
                    if let Some((_, ev)) = run.take() {
                        self.events.push(ev);
                    }
                    run = Some((
                        b,
                        KvEvent::BlockStored {
                            block_hashes: vec![wire_hash(r.hashes[b])],
                            parent_block_hash: parent.map(wire_hash),
                            token_ids: tokens.to_vec(),
                            block_size: bs,
                        },
                    ));
                }
            }
        }
        if let Some((_, ev)) = run {
            self.events.push(ev);
        }
    }

    /// `/reset_prefix_cache`: forget every cached block.
    pub fn reset_prefix_cache(&mut self) {
        self.pool.clear_cache();
        for r in self.running.iter_mut().chain(self.waiting.iter_mut()) {
            // Blocks they hold are anonymous now; do not re-register them under old hashes.
            r.cached_blocks = r.cached_blocks.max(r.computed / self.cfg.block_size);
        }
        self.events.push(KvEvent::AllBlocksCleared);
    }

    pub fn cache_snapshot(&self) -> Vec<CacheEntry> {
        self.pool
            .cached_blocks()
            .into_iter()
            .map(|(id, c, in_use)| CacheEntry {
                block_id: id,
                hash: wire_hash(c.hash),
                parent_hash: c.parent.map(wire_hash),
                token_ids: c.tokens.clone(),
                in_use,
            })
            .collect()
    }
}
