//! The simulated vLLM engine core, free of tokio and HTTP: a paged KV cache with prefix caching
//! (`block_pool.rs`), requests (`request.rs`) and a v1-style scheduler (this file). The worker loop
//! calls [`Engine::schedule`], waits the step time the timing model gives, then [`Engine::complete`].

pub mod block_pool;
mod pd;
mod prefix_cache;
pub mod request;

use std::collections::VecDeque;

use block_pool::{none_hash, BlockPool, EngineHash};
pub use prefix_cache::CacheEntry;
use request::Request;
pub use request::{FinishReason, KvTransfer, NewRequest, RequestId};

use crate::kv_events::KvEvent;

/// The scheduler's limits (a slice of `SimConfig`).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// vLLM `--scheduling-policy priority`: waiting by (priority, arrival); a running request
    /// short of blocks preempts the lowest-priority running request (never one for a waiting
    /// request: vLLM 0.32's v1 scheduler).
    pub priority_scheduling: bool,
    pub enable_prefix_caching: bool,
    /// `--assume-cached-header`: honour [`NewRequest::assumed_cached_tokens`] (off: ignored).
    pub assume_cached: bool,
    pub seed: u64,
    pub mean_output_tokens: u32,
}

/// One scheduled step, produced by `schedule` and consumed by `complete`.
#[derive(Debug, Default)]
pub struct Step {
    pub scheduled: Vec<(RequestId, usize)>,
    /// New prompt (or recomputed) tokens in the step: the prefill term of the timing model.
    pub prefill_tokens: usize,
    /// Sequences producing one decode token in the step.
    pub decode_seqs: usize,
    /// KV usage fraction while the step runs.
    pub kv_usage: f64,
    /// Requests scheduled for the first time in this step, with their cached prompt tokens.
    pub started: Vec<(RequestId, usize)>,
    pub preempted: usize,
}

impl Step {
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }
}

/// Something a request's client must hear about after a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub id: RequestId,
    pub token: u32,
    pub finished: Option<FinishReason>,
    /// A prefill leg that ended length-capped: the block ids it left pinned for a decode worker.
    pub pinned: Option<Vec<usize>>,
}

/// Counters behind vLLM's `/metrics` (monotonic since start).
#[derive(Debug, Default, Clone)]
pub struct EngineCounters {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// Prompt tokens taken from a remote prefill instead of computed (decode legs).
    pub remote_prefill_tokens: u64,
}

pub struct Engine {
    cfg: EngineConfig,
    pool: BlockPool,
    none: EngineHash,
    waiting: VecDeque<Request>,
    running: Vec<Request>,
    events: Vec<KvEvent>,
    /// Finished prefill legs whose blocks wait for a decode worker's read (or their lease).
    pinned: std::collections::HashMap<RequestId, Vec<usize>>,
    pub counters: EngineCounters,
}

fn blocks_for(tokens: usize, bs: usize) -> usize {
    tokens.div_ceil(bs)
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Self {
        Self {
            pool: BlockPool::new(cfg.num_gpu_blocks),
            none: none_hash(cfg.seed),
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            events: Vec::new(),
            pinned: std::collections::HashMap::new(),
            counters: EngineCounters::default(),
        }
    }

    /// Longest prompt + output one request may need; larger ones must be rejected up front or they
    /// could never be scheduled.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.usable() * self.cfg.block_size
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    pub fn add_request(&mut self, r: NewRequest) {
        let key = xxhash_rust::xxh3::xxh3_64_with_seed(
            &r.prompt
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
            self.cfg.seed,
        );
        let natural_len = (!r.ignore_eos).then(|| {
            let span = u64::from(self.cfg.mean_output_tokens.max(1)) * 2;
            1 + (key.rotate_left(17) % span) as usize
        });
        self.enqueue(Request {
            priority: r.priority,
            id: r.id,
            prompt_len: r.prompt.len(),
            tokens: r.prompt,
            max_tokens: r.max_tokens,
            natural_len,
            computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            cached_blocks: 0,
            num_cached_tokens: None,
            assumed_cached_tokens: r.assumed_cached_tokens,
            out_key: key,
            kv: r.kv,
        });
    }

    /// A new request joins the waiting queue: at the back (FCFS), or in (priority, arrival)
    /// order.
    fn enqueue(&mut self, r: Request) {
        if self.cfg.priority_scheduling {
            let at = self.waiting.partition_point(|w| w.order() < r.order());
            self.waiting.insert(at, r);
        } else {
            self.waiting.push_back(r);
        }
    }

    /// Removes a request wherever it is and frees its blocks. Returns whether it existed.
    pub fn abort(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            let r = self.running.remove(i);
            self.free(r);
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            if let Some(r) = self.waiting.remove(i) {
                self.free(r);
            }
            return true;
        }
        false
    }

    fn free(&mut self, mut r: Request) {
        let blocks = std::mem::take(&mut r.blocks);
        self.pool.release(blocks.into_iter().rev());
    }

    /// Preemption by recompute: drop all blocks (cached ones stay evictable, so the recompute can
    /// hit them) and put the request back at the head of the queue (priority policy: at its
    /// place by priority and arrival).
    fn preempt(&mut self, mut r: Request) {
        let blocks = std::mem::take(&mut r.blocks);
        self.pool.release(blocks.into_iter().rev());
        r.computed = 0;
        r.cached_blocks = 0;
        self.counters.preemptions += 1;
        if self.cfg.priority_scheduling {
            self.enqueue(r);
        } else {
            self.waiting.push_front(r);
        }
    }

    /// The running request to preempt: the newest (FCFS), or the one last in (priority,
    /// arrival) order (vLLM: `max(running, key=(priority, arrival_time))`).
    fn victim(&self) -> usize {
        if self.cfg.priority_scheduling {
            (0..self.running.len())
                .max_by_key(|&j| self.running[j].order())
                .expect("running is non-empty here")
        } else {
            self.running.len() - 1
        }
    }

    /// Picks the next batch (vLLM v1 order: running requests first, then FCFS admission).
    pub fn schedule(&mut self) -> Step {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut step = Step::default();

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (computed, total, have) = {
                let r = &self.running[i];
                (r.computed, r.tokens.len(), r.blocks.len())
            };
            let n = (total - computed).min(budget);
            let need = blocks_for(computed + n, bs).saturating_sub(have);
            let mut scheduled_self = true;
            while self.pool.num_free() < need {
                // Out of blocks: preempt the newest running request (priority policy: the
                // lowest-priority one, possibly already scheduled in this step: it leaves the
                // step and its tokens go back to the budget, as in vLLM), possibly this one.
                let j = self.victim();
                let victim = self.running.remove(j);
                if j < i {
                    i -= 1;
                    if let Some(k) = step.scheduled.iter().position(|(id, _)| *id == victim.id) {
                        let (_, n) = step.scheduled.remove(k);
                        budget += n;
                        let prefill = victim.tokens.len() - victim.computed > 1
                            || victim.computed < victim.prompt_len;
                        if prefill {
                            step.prefill_tokens = step.prefill_tokens.saturating_sub(n);
                        } else {
                            step.decode_seqs = step.decode_seqs.saturating_sub(1);
                        }
                    }
                }
                step.preempted += 1;
                self.preempt(victim);
                if j == i {
                    scheduled_self = false;
                    break;
                }
            }
            if !scheduled_self {
                break;
            }
            let new = self
                .pool
                .allocate(need, &mut self.events)
                .expect("checked free count");
            let r = &mut self.running[i];
            r.blocks.extend(new);
            if total - computed > 1 || computed < r.prompt_len {
                step.prefill_tokens += n;
            } else {
                step.decode_seqs += 1;
            }
            step.scheduled.push((r.id, n));
            budget -= n;
            i += 1;
        }

        if step.preempted == 0 {
            self.admit_waiting(&mut budget, &mut step);
        }
        step.kv_usage = self.pool.usage();
        step
    }

    fn admit_waiting(&mut self, budget: &mut usize, step: &mut Step) {
        let bs = self.cfg.block_size;
        // vLLM 0.32 (v1 scheduler), both policies: a full batch admits nobody, and a waiting
        // request that cannot get its blocks stops admission; neither preempts a running
        // request for a waiting one, whatever its priority (only a running request short of
        // blocks for its next tokens preempts, in `schedule`).
        while *budget > 0 {
            if self.waiting.is_empty() || self.running.len() >= self.cfg.max_num_seqs {
                break;
            }
            let Some(r) = self.waiting.front_mut() else {
                break;
            };
            r.update_hashes(bs, self.none, self.cfg.seed);
            let total = r.tokens.len();
            // Prefix hit: leading cached full blocks, leaving at least one token to compute.
            let mut hit: Vec<usize> = Vec::new();
            if self.cfg.enable_prefix_caching {
                let max_hit = (total - 1) / bs;
                for h in r.hashes.iter().take(max_hit) {
                    match self.pool.lookup(h) {
                        Some(id) => hit.push(id),
                        None => break,
                    }
                }
            }
            // `--assume-cached-header`: the request's first `assumed` full blocks count as cached
            // on this worker whether it holds them or not; a missing one is taken from the free
            // queue and registered below as if an earlier request had computed it.
            let assumed = if self.cfg.assume_cached && self.cfg.enable_prefix_caching {
                (r.assumed_cached_tokens / bs).min((total - 1) / bs)
            } else {
                0
            };
            // Block ids of the cached prefix in order; `None` = assumed but not held.
            let mut prefix: Vec<Option<usize>> = hit.iter().copied().map(Some).collect();
            for h in r.hashes.iter().take(assumed).skip(hit.len()) {
                prefix.push(self.pool.lookup(h));
            }
            let held: Vec<usize> = prefix.iter().flatten().copied().collect();
            let hit_tokens = prefix.len() * bs;
            // A decode leg whose KV was pulled: only the last prompt token is computed here.
            let remote = matches!(r.kv, KvTransfer::RemotePrefill | KvTransfer::Bootstrapped);
            let pulled_as_cached = r.kv == KvTransfer::RemotePrefill;
            let pulled = if remote && r.num_cached_tokens.is_none() {
                (total - 1).saturating_sub(hit_tokens)
            } else {
                0
            };
            let n = (total - hit_tokens - pulled).min(*budget);
            let need = blocks_for(hit_tokens + pulled + n, bs) - held.len();
            let idle_hits = held
                .iter()
                .filter(|&&id| self.pool.is_unreferenced(id))
                .count();
            if self.pool.num_free() < need + idle_hits {
                break; // Nobody overtakes the head of the queue.
            }
            let mut r = self.waiting.pop_front().expect("front exists");
            for &id in &held {
                self.pool.touch(id);
            }
            r.computed = hit_tokens + pulled;
            if remote {
                // A preempted decode leg recomputes like any request (its pulled blocks are cached).
                r.kv = KvTransfer::None;
            }
            let mut new = self
                .pool
                .allocate(need, &mut self.events)
                .expect("checked free count")
                .into_iter();
            let mut blocks = Vec::with_capacity(need + held.len());
            let mut fresh = Vec::new();
            for (b, id) in prefix.iter().enumerate() {
                let id = id.unwrap_or_else(|| {
                    let id = new.next().expect("need counts the assumed blocks");
                    fresh.push(b);
                    id
                });
                blocks.push(id);
            }
            blocks.extend(new);
            r.blocks = blocks;
            self.store_assumed(&r, &fresh);
            r.cached_blocks = prefix.len();
            if r.num_cached_tokens.is_none() {
                // vLLM reports pulled tokens as cached (local + external); SGLang does not.
                let reported = if pulled_as_cached { pulled } else { 0 };
                let cached = (hit_tokens + reported).min(r.prompt_len);
                r.num_cached_tokens = Some(cached);
                self.counters.prefix_cache_queries += r.prompt_len as u64;
                self.counters.prefix_cache_hits += hit_tokens.min(r.prompt_len) as u64;
                self.counters.remote_prefill_tokens += pulled as u64;
                self.counters.prompt_tokens += r.prompt_len as u64;
                step.started.push((r.id, cached));
            }
            if pulled > 0 && n == 1 {
                // A decode leg recomputing the last prompt token over pulled KV: one token
                // attending over its context, the work of a decode step, not a prefill step's
                // fixed cost.
                step.decode_seqs += 1;
            } else {
                step.prefill_tokens += n;
            }
            step.scheduled.push((r.id, n));
            *budget -= n;
            self.running.push(r);
        }
    }

    /// Applies a finished step: advances computed tokens, samples one token for every request that
    /// caught up, caches newly full blocks (→ `BlockStored`) and retires finished requests.
    pub fn complete(&mut self, step: &Step) -> Vec<Output> {
        let mut outputs = Vec::new();
        let mut finished = Vec::new();
        self.counters.steps += 1;
        for &(id, n) in &step.scheduled {
            // Aborted (or preempted later in the same step, which cannot happen) requests vanish.
            let Some(idx) = self.running.iter().position(|r| r.id == id) else {
                continue;
            };
            let r = &mut self.running[idx];
            r.computed += n;
            if r.computed >= r.tokens.len() {
                let k = r.output_len();
                let token = sample(r.out_key, k, &r.tokens[..r.prompt_len]);
                r.tokens.push(token);
                self.counters.generation_tokens += 1;
                let out_len = k + 1;
                let reason =
                    if r.natural_len.is_some_and(|l| out_len >= l) && out_len < r.max_tokens {
                        Some(FinishReason::Stop)
                    } else if out_len >= r.max_tokens {
                        Some(FinishReason::Length)
                    } else {
                        None
                    };
                outputs.push(Output {
                    id,
                    token,
                    finished: reason,
                    pinned: None,
                });
                if reason.is_some() {
                    finished.push(id);
                }
            }
            if self.cfg.enable_prefix_caching {
                self.cache_full_blocks(idx);
            }
        }
        for id in finished {
            if let Some(i) = self.running.iter().position(|r| r.id == id) {
                let r = self.running.remove(i);
                let length_capped = outputs
                    .iter()
                    .any(|o| o.id == id && o.finished == Some(FinishReason::Length));
                if r.kv == KvTransfer::RemoteDecode && length_capped {
                    let blocks = self.pin(r);
                    if let Some(o) = outputs.iter_mut().find(|o| o.id == id) {
                        o.pinned = Some(blocks);
                    }
                } else {
                    self.free(r);
                }
            }
        }
        outputs
    }

    /// KV events produced since the last call (one batch per step, as vLLM publishes).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }
}

/// Deterministic output token k of a request: one of its own prompt tokens, so the id is valid for
/// whatever tokenizer produced the prompt.
fn sample(key: u64, k: usize, prompt: &[u32]) -> u32 {
    let x = xxhash_rust::xxh3::xxh3_64_with_seed(&(k as u64).to_le_bytes(), key);
    prompt[(x % prompt.len() as u64) as usize]
}

#[cfg(test)]
mod tests;
