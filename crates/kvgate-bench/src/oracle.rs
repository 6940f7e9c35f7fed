//! The best any router could do on a workload: the prefix hit rate of one cache holding every
//! block ever seen (infinite), and of one LRU cache as large as the whole fleet (all workers'
//! blocks pooled). Both use the router's own block hashes at the fleet's block size, and vLLM's
//! rule that the last prompt token is always computed (at most `(len-1)/bs` blocks can hit), so
//! they compare directly with the `cached_tokens` the workers report.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use crate::workload::Workload;

/// Hit rates are cached prompt tokens / prompt tokens.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Oracle {
    pub block_size: usize,
    pub prompt_tokens: u64,
    pub infinite_hit_rate: f64,
    /// Present when a fleet capacity was given.
    pub capacity_blocks: Option<usize>,
    pub capacity_hit_rate: Option<f64>,
}

/// The router's chained block hashes of a prompt (full blocks only).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    crate::hashing::block_hashes(tokens, block_size)
}

/// Computes both oracles in one pass over the workload in request order.
pub fn compute(wl: &Workload, block_size: usize, capacity_blocks: Option<usize>) -> Oracle {
    assert!(block_size > 0, "block size must be > 0");
    let mut seen: HashSet<u64> = HashSet::new();
    let mut lru = capacity_blocks.map(Lru::new);
    let (mut total, mut inf_hit, mut lru_hit) = (0u64, 0u64, 0u64);
    for r in &wl.requests {
        let hashes = block_hashes(&r.prompt, block_size);
        let max_hit = r.prompt.len().saturating_sub(1) / block_size;
        total += r.prompt.len() as u64;
        let run = hashes.iter().take_while(|h| seen.contains(h)).count();
        inf_hit += (run.min(max_hit) * block_size) as u64;
        seen.extend(hashes.iter().copied());
        if let Some(lru) = lru.as_mut() {
            let run = hashes.iter().take_while(|h| lru.contains(**h)).count();
            lru_hit += (run.min(max_hit) * block_size) as u64;
            for &h in &hashes {
                lru.touch(h);
            }
        }
    }
    let rate = |hit: u64| {
        if total == 0 {
            0.0
        } else {
            hit as f64 / total as f64
        }
    };
    Oracle {
        block_size,
        prompt_tokens: total,
        infinite_hit_rate: rate(inf_hit),
        capacity_blocks,
        capacity_hit_rate: lru.map(|_| rate(lru_hit)),
    }
}

/// A plain LRU set of block hashes: last-use tick per hash, hashes ordered by tick.
struct Lru {
    cap: usize,
    tick: u64,
    last: HashMap<u64, u64>,
    by_tick: BTreeMap<u64, u64>,
}

impl Lru {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            tick: 0,
            last: HashMap::new(),
            by_tick: BTreeMap::new(),
        }
    }

    fn contains(&self, h: u64) -> bool {
        self.last.contains_key(&h)
    }

    fn touch(&mut self, h: u64) {
        if self.cap == 0 {
            return;
        }
        self.tick += 1;
        if let Some(old) = self.last.insert(h, self.tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(self.tick, h);
        while self.last.len() > self.cap {
            if let Some((_, victim)) = self.by_tick.pop_first() {
                self.last.remove(&victim);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Request;

    fn wl(prompts: &[&[u32]]) -> Workload {
        Workload {
            name: "t".into(),
            requests: prompts
                .iter()
                .map(|p| Request {
                    at: None,
                    prompt: p.to_vec(),
                    max_tokens: 1,
                })
                .collect(),
        }
    }

    #[test]
    fn hand_checked_case() {
        // Block size 2. Blocks: A=[1,2], B=A+[3,4], C=A+[7,8].
        // r1 [1,2,3,4,5]: nothing cached                                  -> 0
        // r2 [1,2,3,4,9]: A,B hit (cap (5-1)/2 = 2 blocks)                -> 4
        // r3 [1,2,7,8,9]: A hits, C is new                                -> 2
        // r4 [1,2,3,4,0]: infinite: A,B -> 4; LRU(2): after r3 the cache
        //     is {A,C} (B, least recently used, was evicted) -> A only    -> 2
        // r5 [1,2,3,4]: only (4-1)/2 = 1 block may hit (last token is computed) -> 2
        let w = wl(&[
            &[1, 2, 3, 4, 5],
            &[1, 2, 3, 4, 9],
            &[1, 2, 7, 8, 9],
            &[1, 2, 3, 4, 0],
            &[1, 2, 3, 4],
        ]);
        let o = compute(&w, 2, Some(2));
        assert_eq!(o.prompt_tokens, 24);
        assert_eq!(o.infinite_hit_rate, 12.0 / 24.0);
        assert_eq!(o.capacity_hit_rate, Some(10.0 / 24.0));
        let o = compute(&w, 2, None);
        assert_eq!(o.capacity_hit_rate, None);
        assert_eq!(o.infinite_hit_rate, 0.5);
    }

    #[test]
    fn shared_prefix_oracle_matches_its_shape() {
        // G groups × P prompts, S system tokens (multiple of bs), Q question tokens: every prompt
        // but the first of each group hits exactly its system prompt.
        let sp = crate::workload::shared_prefix::SharedPrefix {
            groups: 4,
            prompts_per_group: 5,
            system_tokens: 64,
            question_tokens: 20,
        };
        let w = sp.build(1, 1);
        let o = compute(&w, 16, None);
        let expect = (4.0 * 4.0 * 64.0) / (20.0 * 84.0);
        assert!((o.infinite_hit_rate - expect).abs() < 1e-12, "{o:?}");
        // A pooled cache too small for one group's prefix never hits.
        assert_eq!(compute(&w, 16, Some(0)).capacity_hit_rate, Some(0.0));
    }
}
