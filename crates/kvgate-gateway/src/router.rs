//! The routing decision: candidates from the model's pool → core scoring (KV overlap from the index,
//! router-side load from `ActiveSequences`) → the configured core `Policy`. Also the dispatch guard
//! that holds a request's load on its worker until the request ends, whatever the path.
//!
//! The index sits behind a `parking_lot::RwLock` (queries share it; writes are short); the policy is
//! swapped whole on reload. Scratch buffers live in a thread-local so a decision does not allocate.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use kvgate_core::{
    all_busy, score_candidates, ActiveSequences, BusyThresholds, Candidate, Decision, IndexMode,
    KvIndex, LoadGuard, OverlapScores, Policy, PolicyConfig, RouteRequest, WorkerId,
};
use parking_lot::RwLock;

use crate::config::RoutingConfig;
use crate::registry::{Pool, Worker};

/// The policy and the gateway-level busy bound, swapped together on reload.
pub struct RoutePolicy {
    pub policy: Box<dyn Policy>,
    pub busy: BusyThresholds,
    /// A worker with this many requests in flight from us is busy (0 = no bound).
    pub max_inflight: u32,
}

impl RoutePolicy {
    pub fn from_config(cfg: &RoutingConfig) -> anyhow::Result<Self> {
        let mut pc = PolicyConfig::default();
        pc.kv.prefill_weight = cfg.prefill_weight;
        anyhow::ensure!(
            cfg.pending_prefill_weight.is_finite() && cfg.pending_prefill_weight >= 0.0,
            "routing.pending_prefill_weight must be a finite number >= 0, got {}",
            cfg.pending_prefill_weight
        );
        pc.kv.pending_weight = cfg.pending_prefill_weight;
        pc.kv.temperature = cfg.temperature;
        pc.busy = BusyThresholds {
            active_blocks: cfg.busy_active_blocks,
            pending_prefill_tokens: cfg.busy_pending_prefill_tokens,
            kv_usage: cfg.busy_kv_usage,
            waiting: cfg.busy_waiting,
        };
        let policy = kvgate_core::policy_by_name(&cfg.policy, &pc)
            .map_err(|e| anyhow::anyhow!("routing.policy: {e}"))?;
        Ok(RoutePolicy {
            policy,
            busy: pc.busy,
            max_inflight: cfg.max_inflight_per_worker,
        })
    }
}

pub struct Router {
    pub policy: ArcSwap<RoutePolicy>,
    pub index: RwLock<KvIndex>,
    pub active: ActiveSequences,
    next_request: AtomicU64,
}

/// Why no worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPick {
    /// No routable worker (all unhealthy, draining, breaker open, or already tried).
    NoWorker,
    /// Routable workers exist but all are busy: wait in the admission queue.
    AllBusy,
}

pub struct Pick {
    pub worker: Arc<Worker>,
    pub decision: Decision,
}

#[derive(Default)]
struct Scratch {
    candidates: Vec<Candidate>,
    scores: OverlapScores,
    rng: Option<fastrand::Rng>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Router {
    pub fn new(policy: RoutePolicy) -> Self {
        Router {
            policy: ArcSwap::from_pointee(policy),
            index: RwLock::new(KvIndex::new()),
            active: ActiveSequences::new(),
            next_request: AtomicU64::new(1),
        }
    }

    /// Register a worker with the index: exact when it publishes KV events, else approximate.
    pub fn add_worker(&self, id: WorkerId, exact: bool, routing: &RoutingConfig) {
        let mode = if exact {
            IndexMode::Exact
        } else {
            IndexMode::Approximate(kvgate_core::ApproxConfig {
                ttl: std::time::Duration::from_secs(routing.approx_ttl_s),
                capacity_blocks: routing.approx_capacity_blocks,
            })
        };
        let mut index = self.index.write();
        index.set_predicted_ttl(std::time::Duration::from_secs(routing.predicted_ttl_s));
        index.set_mode(id, mode);
    }

    pub fn remove_worker(&self, id: WorkerId) {
        self.index.write().remove_worker(id);
        self.active.remove_worker(id);
    }

    /// Choose a worker of `pool` for a request with block `hashes` and `isl` prompt tokens,
    /// skipping workers in `exclude` (already tried).
    pub fn select(
        &self,
        pool: &Pool,
        hashes: &[u64],
        isl: u64,
        affinity_key: Option<u64>,
        exclude: &[WorkerId],
        now: Instant,
    ) -> Result<Pick, NoPick> {
        let rp = self.policy.load();
        SCRATCH.with(|s| {
            let s = &mut *s.borrow_mut();
            let Scratch {
                candidates,
                scores,
                rng,
            } = s;
            let rng = rng.get_or_insert_with(fastrand::Rng::new);
            candidates.clear();
            for w in &pool.workers {
                if exclude.contains(&w.id) || !w.state.routable(now) {
                    continue;
                }
                if rp.max_inflight > 0
                    && w.state.inflight.load(Ordering::Relaxed) >= rp.max_inflight
                {
                    continue;
                }
                let mut c = Candidate::new(w.id);
                c.scraped = w.state.fresh_scraped(now);
                c.kv_scoring = w.state.kv_scoring.load(Ordering::Relaxed);
                candidates.push(c);
            }
            if candidates.is_empty() {
                let any = pool
                    .workers
                    .iter()
                    .any(|w| !exclude.contains(&w.id) && w.state.routable(now));
                return Err(if any {
                    NoPick::AllBusy
                } else {
                    NoPick::NoWorker
                });
            }
            if rp.policy.uses_overlap() {
                let index = self.index.read();
                score_candidates(&index, &self.active, hashes, now, scores, candidates);
            } else {
                self.active.fill_loads(hashes, candidates);
            }
            if !rp.busy.is_off() && all_busy(candidates, &rp.busy) {
                return Err(NoPick::AllBusy);
            }
            let req = RouteRequest {
                hashes,
                isl_tokens: isl,
                block_size: pool.block_size,
                affinity_key,
            };
            let decision = rp
                .policy
                .select(&req, candidates, rng)
                .ok_or(NoPick::NoWorker)?;
            let worker = pool
                .workers
                .iter()
                .find(|w| w.id == decision.worker)
                .cloned()
                .ok_or(NoPick::NoWorker)?;
            Ok(Pick { worker, decision })
        })
    }

    /// Count the request's load on its worker until the returned guard is dropped, and teach the
    /// approximate index that the worker now holds the prompt's blocks.
    pub fn dispatch(
        &self,
        pick: &Pick,
        hashes: &[u64],
        isl: u64,
        block_size: u32,
        now: Instant,
    ) -> DispatchGuard {
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        // Predicted cached prefix: only the rest is pending prefill on the worker.
        let cached = u64::from(pick.decision.overlap_blocks) * u64::from(block_size);
        let core = self
            .active
            .add_at(pick.worker.id, id, hashes, isl, cached, now);
        if !hashes.is_empty() {
            // Approximate workers learn only from routing; exact workers get a short-lived
            // prediction so requests arriving before the worker's BlockStored events see the prefix.
            let mut index = self.index.write();
            match index.mode(pick.worker.id) {
                Some(IndexMode::Approximate(_)) => {
                    index.record_routed(pick.worker.id, hashes, now);
                }
                Some(IndexMode::Exact) => {
                    index.record_predicted(pick.worker.id, hashes, now);
                }
                None => {}
            }
        }
        pick.worker.state.inflight.fetch_add(1, Ordering::Relaxed);
        pick.worker.state.dispatched.fetch_add(1, Ordering::Relaxed);
        DispatchGuard {
            core: Some(core),
            worker: pick.worker.clone(),
            on_release: None,
        }
    }
}

/// Load of one dispatched request: in-flight count, active blocks and pending prefill on its
/// worker. Dropping it (completion, error, cancel) releases all of it and wakes a queued request.
pub struct DispatchGuard {
    core: Option<LoadGuard>,
    pub worker: Arc<Worker>,
    pub on_release: Option<Arc<crate::admission::Admission>>,
}

impl DispatchGuard {
    pub fn prefill_done(&self) {
        if let Some(c) = &self.core {
            c.mark_prefill_done();
        }
    }
}

impl Drop for DispatchGuard {
    fn drop(&mut self) {
        // Free everything before waking a queued request, so it sees the released capacity.
        drop(self.core.take());
        self.worker.state.inflight.fetch_sub(1, Ordering::Relaxed);
        if let Some(a) = &self.on_release {
            a.wake_one();
        }
    }
}
