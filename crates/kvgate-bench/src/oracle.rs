//! The best any router could do on a workload: the prefix hit rate of one cache holding every
//! block ever seen (infinite), and of one LRU cache as large as the whole fleet (all workers'
//! blocks pooled). Both use the router's own block hashes at the fleet's block size, and vLLM's
//! rule that the last prompt token is always computed (at most `(len-1)/bs` blocks can hit), so
//! they compare directly with the `cached_tokens` the workers report.
//!
//! On a fleet of `kvgate sim` workers the bench started, also the TTFT floor: each request's
//! prompt beyond the infinite cache's hit, prefilled alone on an idle worker at the sims' timing.

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
    /// Present when the fleet's timing is known (sims started by the bench, unified).
    pub ttft_floor: Option<TtftFloor>,
}

/// TTFT no router can beat on a workload, in ms: every request hits the infinite cache's prefix
/// and finds its worker idle (no queue, no decode batch), so its TTFT is the prefill of the rest
/// of its prompt (in steps of at most `max_num_batched_tokens`, each at least a decode step).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TtftFloor {
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// The mean, to set beside the engines' per-request means (`compare/engine.rs`).
    pub mean_ms: f64,
}

/// The router's chained block hashes of a prompt (full blocks only).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    crate::hashing::block_hashes(tokens, block_size)
}

/// Each request's tokens a cache holding every block seen before would serve, in request order.
fn infinite_hits(wl: &Workload, block_size: usize) -> Vec<usize> {
    let mut seen: HashSet<u64> = HashSet::new();
    wl.requests
        .iter()
        .map(|r| {
            let hashes = block_hashes(&r.prompt, block_size);
            let max_hit = r.prompt.len().saturating_sub(1) / block_size;
            let run = hashes.iter().take_while(|h| seen.contains(h)).count();
            seen.extend(hashes.iter().copied());
            run.min(max_hit) * block_size
        })
        .collect()
}

/// `wl` with every request carrying the infinite cache's hit as `sim_cached_tokens` (what
/// `bench compare --loaded-floor` sends as the sim's assumed-cache header).
pub fn with_infinite_hits(wl: &Workload, block_size: usize) -> Workload {
    let mut out = wl.clone();
    for (r, hit) in out.requests.iter_mut().zip(infinite_hits(wl, block_size)) {
        r.sim_cached_tokens = Some(hit);
    }
    out
}

/// The TTFT floor ([`TtftFloor`]) of `wl` on sims with this timing and speed-up.
pub fn ttft_floor(
    wl: &Workload,
    block_size: usize,
    timing: &kvgate_sim::TimingModel,
    speedup: f64,
    max_num_batched_tokens: usize,
) -> TtftFloor {
    let chunk = max_num_batched_tokens.max(1);
    let mut ms: Vec<f64> = wl
        .requests
        .iter()
        .zip(infinite_hits(wl, block_size))
        .map(|(r, hit)| {
            let mut left = r.prompt.len().saturating_sub(hit).max(1);
            let mut t = 0.0;
            while left > 0 {
                let n = left.min(chunk);
                t += timing.step_ms(n, 0, 0.0);
                left -= n;
            }
            if speedup > 0.0 {
                t / speedup
            } else {
                0.0
            }
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        ms.get(((ms.len() as f64 * q).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0)
    };
    TtftFloor {
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        mean_ms: if ms.is_empty() {
            0.0
        } else {
            ms.iter().sum::<f64>() / ms.len() as f64
        },
    }
}

/// Computes both oracles in one pass over the workload in request order.
pub fn compute(wl: &Workload, block_size: usize, capacity_blocks: Option<usize>) -> Oracle {
    assert!(block_size > 0, "block size must be > 0");
    let mut lru = capacity_blocks.map(Lru::new);
    let (mut total, mut lru_hit) = (0u64, 0u64);
    let inf_hit: u64 = infinite_hits(wl, block_size)
        .iter()
        .map(|&h| h as u64)
        .sum();
    for r in &wl.requests {
        let hashes = block_hashes(&r.prompt, block_size);
        let max_hit = r.prompt.len().saturating_sub(1) / block_size;
        total += r.prompt.len() as u64;
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
        ttft_floor: None,
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
                    turn: None,
                    sim_cached_tokens: None,
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

    #[test]
    fn ttft_floor_prefills_what_the_infinite_cache_misses_alone_at_the_sims_speed() {
        let timing = kvgate_sim::TimingModel::default();
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b.extend(100..132);
        // Request 1 misses all 64 tokens; request 2 hits 4 blocks (64 tokens) and prefills 32.
        let f = ttft_floor(&wl(&[&a, &b]), 16, &timing, 2.0, 8192);
        assert_eq!(f.p50_ms, timing.step_ms(32, 0, 0.0) / 2.0);
        assert_eq!(f.p99_ms, timing.step_ms(64, 0, 0.0) / 2.0);
        assert_eq!(
            f.mean_ms,
            (timing.step_ms(32, 0, 0.0) + timing.step_ms(64, 0, 0.0)) / 4.0
        );
        // Chunked prefill: 64 tokens in steps of 16 cost four steps.
        let f = ttft_floor(&wl(&[&a]), 16, &timing, 1.0, 16);
        assert_eq!(f.p50_ms, 4.0 * timing.step_ms(16, 0, 0.0));
        // A fully repeated prompt still computes its last token (one block recomputed, as vLLM).
        let f = ttft_floor(&wl(&[&a, &a]), 16, &timing, 1.0, 8192);
        assert_eq!(f.p50_ms, timing.step_ms(16, 0, 0.0));
        // Speed-up 0: no delays at all.
        assert_eq!(ttft_floor(&wl(&[&a]), 16, &timing, 0.0, 8192).p99_ms, 0.0);
    }
}
