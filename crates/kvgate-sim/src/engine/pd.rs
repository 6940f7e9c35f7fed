//! The engine's side of prefill/decode disaggregation (vLLM NixlConnector semantics): a prefill
//! leg's blocks stay pinned after it finished until a decode worker read them or the lease ran out
//! (the worker loop keeps the lease clock; the engine holds no time), and a decode worker asks how
//! much of a prompt it already holds so it pulls only the rest.

use super::request::Request;
use super::{Engine, RequestId};

impl Engine {
    /// Keeps a finished prefill leg's blocks referenced (not evictable) and returns their ids.
    pub(super) fn pin(&mut self, mut r: Request) -> Vec<usize> {
        let blocks = std::mem::take(&mut r.blocks);
        self.pinned.insert(r.id, blocks.clone());
        blocks
    }

    /// Releases a pinned request's blocks (a decode worker read them, the lease expired, or the
    /// router gave up). Returns how many blocks it held, `None` if nothing was pinned under `id`.
    pub fn release_pinned(&mut self, id: RequestId) -> Option<usize> {
        let blocks = self.pinned.remove(&id)?;
        let n = blocks.len();
        self.pool.release(blocks.into_iter().rev());
        Some(n)
    }

    pub fn num_pinned_blocks(&self) -> usize {
        self.pinned.values().map(Vec::len).sum()
    }

    pub fn num_pinned_requests(&self) -> usize {
        self.pinned.len()
    }

    /// Prompt tokens this worker's prefix cache already holds (leading full blocks, at least one
    /// token left to compute): what a decode leg does not need to pull.
    pub fn local_hit_tokens(&self, prompt: &[u32]) -> usize {
        if !self.cfg.enable_prefix_caching || prompt.is_empty() {
            return 0;
        }
        let bs = self.cfg.block_size;
        let max_hit = (prompt.len() - 1) / bs;
        let mut parent = self.none;
        let mut hit = 0;
        for i in 0..max_hit {
            let h =
                super::block_pool::chain_hash(parent, &prompt[i * bs..(i + 1) * bs], self.cfg.seed);
            if self.pool.lookup(&h).is_none() {
                break;
            }
            hit += 1;
            parent = h;
        }
        hit * bs
    }
}
