//! The routing decision: candidates from the model's pool → core scoring (KV overlap from the index,
//! router-side load from `ActiveSequences`) → the configured core `Policy`. Also the dispatch guard
//! that holds a request's load on its worker until the request ends, whatever the path.
//!
//! The index sits behind a `parking_lot::RwLock` (queries share it; writes are short); the policy is
//! swapped whole on reload. Scratch buffers live in a thread-local so a decision does not allocate.
//!
//! The latency model (`kvgate_core::LatencyModel`, each worker's learned speed) is read into the
//! candidates of every decision, whatever the policy, so every pick carries a TTFT prediction
//! (with the overlap only for policies that read the index). Decisions read its lock-free
//! published copy (`speeds.rs`); the dispatch guard takes the model's lock to learn, twice per
//! request: the observed TTFT at the first token, and the mean ITL, output and service time
//! together when it drops.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use arc_swap::ArcSwap;
use kvgate_cluster::Cluster;
use kvgate_core::{
    all_busy, score_candidates, select_kv_bounded, select_latency_bounded, ActiveSequences,
    BusyThresholds, Candidate, Decision, HotPrefix, IndexMode, KvIndex, LatencyConfig,
    LatencyModel, LearnConfig, LoadGuard, OverlapScores, Policy, PolicyConfig, RemoteLoads,
    RouteRequest, Speed, TimingCurve, TtftEstimate, WorkerId,
};
use parking_lot::{Mutex, RwLock};

use crate::config::{PdConfig, RoutingConfig, SloConfig};
use crate::registry::{Pool, Worker};
use crate::route::admission::Admission;
use crate::route::speeds::SpeedBoard;
use kvgate_fleet::WorkerKind;

/// The policy and the gateway-level busy bound, swapped together on reload.
pub struct RoutePolicy {
    pub policy: Box<dyn Policy>,
    /// The decode leg of a disaggregated request (`pd.decode_policy`, see there); unset: `policy`.
    pub decode_policy: Option<Box<dyn Policy>>,
    pub busy: BusyThresholds,
    /// A worker with this many requests in flight from us is busy (0 = no bound).
    pub max_inflight: u32,
    /// How TTFT is estimated (every policy's picks carry a prediction).
    pub latency: LatencyConfig,
    /// How the latency model learns (`routing.latency_relax_after`).
    pub learn: LearnConfig,
    /// `routing.session_affinity_blocks`: the session term of the cost (0 = off).
    pub session_blocks: u32,
    /// `routing.session_ttl_s` / `session_max_entries`.
    pub session_ttl: std::time::Duration,
    pub session_max: usize,
    /// `routing.session_headers`, lower-cased: the front ends read a request's session from them.
    pub session_headers: Arc<[String]>,
}

/// The speed a worker kind starts from before it has been observed (1 = the Dynamo/sim curve).
/// llama.cpp and Ollama prefill about 10× slower than the GPU engines the curve was fitted on
/// (docs/bench.md's prefill-bound fleet) and decode somewhat slower.
pub fn kind_seed(kind: WorkerKind) -> Speed {
    match kind {
        WorkerKind::Llamacpp | WorkerKind::Ollama => Speed {
            prefill: 10.0,
            decode: 2.0,
        },
        _ => Speed::default(),
    }
}

/// A `[routing]` weight that must be a finite number >= 0 (`key` names it in the error).
fn non_negative(key: &str, v: f64) -> anyhow::Result<f64> {
    anyhow::ensure!(
        v.is_finite() && v >= 0.0,
        "routing.{key} must be a finite number >= 0, got {v}"
    );
    Ok(v)
}

impl RoutePolicy {
    pub fn from_config(
        cfg: &RoutingConfig,
        slo: &SloConfig,
        pd: &PdConfig,
    ) -> anyhow::Result<Self> {
        let mut pc = PolicyConfig::default();
        let curve = TimingCurve {
            prefill: cfg
                .latency_prefill_coeffs
                .unwrap_or(TimingCurve::default().prefill),
            decode: cfg
                .latency_decode_coeffs
                .unwrap_or(TimingCurve::default().decode),
        };
        anyhow::ensure!(
            curve
                .prefill
                .iter()
                .chain(&curve.decode)
                .all(|x| x.is_finite()),
            "routing.latency_prefill_coeffs / latency_decode_coeffs must be finite numbers"
        );
        anyhow::ensure!(
            cfg.latency_decode_weight.is_finite() && cfg.latency_decode_weight >= 0.0,
            "routing.latency_decode_weight must be a finite number >= 0, got {}",
            cfg.latency_decode_weight
        );
        let latency = LatencyConfig {
            curve,
            pending_weight: 1.0,
            slot_wait: cfg.latency_slot_wait,
            kv_wait: cfg.latency_kv_wait,
        };
        pc.latency.model = latency;
        pc.latency.decode_weight = cfg.latency_decode_weight;
        pc.latency.temperature = cfg.temperature;
        if cfg.slo_routing {
            anyhow::ensure!(
                slo.ttft_ms > 0.0 || slo.itl_ms > 0.0,
                "routing.slo_routing needs [slo] ttft_ms or itl_ms > 0"
            );
            pc.latency.slo_ttft_ms = slo.ttft_ms.max(0.0);
            pc.latency.slo_itl_ms = slo.itl_ms.max(0.0);
        }
        pc.kv.prefill_weight = cfg.prefill_weight;
        pc.kv.pending_weight = non_negative("pending_prefill_weight", cfg.pending_prefill_weight)?;
        pc.kv.request_weight = non_negative("request_weight", cfg.request_weight)?;
        pc.kv.queue_time = cfg.kv_queue_time.then_some(latency);
        let policy_name = cfg.policy.trim().to_ascii_lowercase().replace('-', "_");
        anyhow::ensure!(
            !cfg.kv_step_wait || cfg.kv_queue_time || policy_name == "kv_time",
            "routing.kv_step_wait needs routing.kv_queue_time = true or policy kv_time (it adds \
             to the queue term)"
        );
        pc.kv.step_wait = cfg.kv_step_wait;
        pc.kv.replicate = match cfg.kv_replicate {
            Some(v) => non_negative("kv_replicate", v)?,
            None if policy_name == "kv_time" => crate::config::KV_TIME_REPLICATE,
            None => 0.0,
        };
        let cold = match cfg.kv_cold_latency {
            Some(v) => {
                anyhow::ensure!(
                    (0.0..=1.0).contains(&v),
                    "routing.kv_cold_latency must be a share of the prompt in [0, 1], got {v}"
                );
                anyhow::ensure!(
                    v == 0.0 || cfg.kv_queue_time || policy_name == "kv_time",
                    "routing.kv_cold_latency needs routing.kv_queue_time = true or policy kv_time \
                     (the latency model places the cold prompts)"
                );
                v
            }
            None if policy_name == "kv_time" => crate::config::KV_TIME_COLD_LATENCY,
            None => 0.0,
        };
        anyhow::ensure!(
            (0.0..=1.0).contains(&cfg.kv_cold_reuse),
            "routing.kv_cold_reuse must be a share in [0, 1], got {}",
            cfg.kv_cold_reuse
        );
        pc.kv.cold_latency = cold;
        pc.kv.cold_reuse = cfg.kv_cold_reuse;
        pc.kv.cold_decode_weight = cfg.latency_decode_weight;
        pc.kv.temperature = cfg.temperature;
        pc.busy = BusyThresholds {
            active_blocks: cfg.busy_active_blocks,
            pending_prefill_tokens: cfg.busy_pending_prefill_tokens,
            kv_usage: cfg.busy_kv_usage,
            waiting: cfg.busy_waiting,
        };
        let policy = kvgate_core::policy_by_name(&cfg.policy, &pc)
            .map_err(|e| anyhow::anyhow!("routing.policy: {e}"))?;
        let decode_name = match pd.decode_policy.as_deref() {
            Some(name) => Some(name),
            None if policy.uses_overlap() => Some("least_loaded"),
            None => None,
        };
        let decode_policy = decode_name
            .map(|name| kvgate_core::policy_by_name(name, &pc))
            .transpose()
            .map_err(|e| anyhow::anyhow!("pd.decode_policy: {e}"))?;
        Ok(RoutePolicy {
            policy,
            decode_policy,
            busy: pc.busy,
            max_inflight: cfg.max_inflight_per_worker,
            latency,
            learn: LearnConfig {
                relax_after: cfg.latency_relax_after,
                ..LearnConfig::default()
            },
            session_blocks: cfg.session_affinity_blocks,
            session_ttl: std::time::Duration::from_secs(cfg.session_ttl_s),
            session_max: cfg.session_max_entries,
            session_headers: cfg
                .session_headers
                .iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .collect(),
        })
    }
}

/// The routing state and its locks, owned here: other modules go through the methods (the index
/// and the peers' loads through short closures that cannot keep a lock past their call).
pub struct Router {
    /// Read through [`Router::policy`] (each thread keeps the last policy it read).
    policy: Arc<ArcSwap<RoutePolicy>>,
    index: RwLock<KvIndex>,
    active: ActiveSequences,
    /// Each worker's learned speed (taken to learn only); shared with the dispatch guards that
    /// feed it. Decisions read `speeds`, its published copy.
    latency: Arc<Mutex<LatencyModel>>,
    speeds: Arc<SpeedBoard>,
    next_request: AtomicU64,
    /// Cluster mode: peers' in-flight load per replica, added to our own as a separate term.
    remote: Mutex<RemoteLoads>,
    /// Cluster mode: where our decisions and load deltas are published (unset = off).
    cluster: OnceLock<Arc<Cluster>>,
    /// The busy-fleet queue every released load wakes.
    admission: Arc<Admission>,
    /// Session affinity: a request's affinity key → the `stable_id` of the worker its session's
    /// last request went to (docs/routing.md, "Sessions").
    sessions: crate::ttl_map::TtlMap<u64, u64>,
    /// When a [`Lane::Priority`] request was last routed (ms since `epoch`; 0 = never).
    last_priority_ms: AtomicU64,
    epoch: Instant,
}

/// [`Lane::Below`] keeps out of the priority class's way while it routed a request within this
/// long; otherwise lower classes use every worker.
const PRIORITY_ACTIVE_MS: u64 = 10_000;

fn ms_since(epoch: Instant, now: Instant) -> u64 {
    now.saturating_duration_since(epoch).as_millis() as u64
}

/// Which part of a request a worker is chosen for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    /// The whole request (no disaggregation), or a prefill leg.
    Whole,
    /// The decode leg of a disaggregated request.
    Decode,
}

/// How flow control lets a request past the busy bound and keeps lower classes out of its way
/// (`flow_control.bypass_busy_priority`, docs/flow-control.md "Priority to the engine").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Every request alike.
    Any,
    /// A class past the busy bound and `max_inflight_per_worker` (its engines schedule by
    /// priority). It goes to a worker with the least prefill pending there (router-side, ours
    /// and peers'): a prefill step the engine is running must finish before its own can start,
    /// and a batch prefill step is several decode steps long.
    Priority,
    /// A lower class in a pool where a class passes the busy bound: it keeps out of that class's
    /// way. Not to a worker where such a request waits for its first token (its prefill step
    /// would grow), and not to the last worker free of pending prefill (one stays free for it).
    Below,
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
    /// The request's predicted TTFT/ITL on the chosen worker.
    pub estimate: TtftEstimate,
    /// The decision's top candidates and reason, when the request asked for them
    /// (`RouteInput::explain`: a sampled trace); `None` otherwise, at no cost.
    pub explain: Option<Box<Explain>>,
}

/// Why a worker was chosen, as a trace's route span tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct Explain {
    /// The chosen worker first, then the best of the others by the policy's cost (else by
    /// predicted TTFT), at most the number asked for.
    pub candidates: Vec<Considered>,
    /// How many candidates the policy saw.
    pub seen: u32,
    /// `overlap` (the chosen worker holds part of the prompt), `latency` (the latency policy),
    /// `session` (the session's last worker, or `consistent_hash` on the affinity key), `load`
    /// (least cost or load with no cache hit), or the policy's name (`round_robin`, `random`,
    /// `consistent_hash` without a key).
    pub reason: &'static str,
}

/// One candidate of a decision as the policy saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Considered {
    pub worker: Arc<str>,
    pub chosen: bool,
    pub overlap_blocks: u32,
    pub inflight: u32,
    pub active_blocks: u32,
    pub pending_prefill_tokens: u64,
    /// The latency model's TTFT prediction there.
    pub predicted_ttft_ms: f64,
    /// The policy's cost there (`kv`, `latency`); `None` for policies that rank by none.
    pub cost: Option<f64>,
}

#[derive(Default)]
struct Scratch {
    candidates: Vec<Candidate>,
    scores: OverlapScores,
    rng: Option<fastrand::Rng>,
}

/// Each candidate's overlap and load as the policy saw them, for the `kvgate::route` debug log
/// (formatted only when that log is on).
struct CandidateLoads<'a>(&'a [Candidate]);

impl std::fmt::Debug for CandidateLoads<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, c) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(
                f,
                "{sep}{}:overlap={},active={},new={},pending={},inflight={},capacity={}",
                c.worker,
                c.overlap_blocks,
                c.active_blocks,
                c.new_blocks,
                c.pending_prefill_tokens,
                c.inflight,
                c.kv_capacity_blocks
            )?;
        }
        Ok(())
    }
}

/// The worker-side facts of a candidate: its stable id, fresh scraped load, KV capacity and
/// whether its engine scores KV (both selection paths).
fn complete(c: &mut Candidate, w: &Worker, now: Instant) {
    c.stable_id = w.stable_id;
    c.scraped = w.state.fresh_scraped(now);
    c.kv_capacity_blocks = w.state.kv_capacity_blocks.load(Ordering::Relaxed);
    c.kv_scoring = w.state.kv_scoring.load(Ordering::Relaxed);
}

/// What a decision's explanation needs besides the candidates: the policy that chose, the
/// session's worker (its `stable_id`) when the cost had a session term, and how many candidates
/// to list (0: none, nothing is computed).
struct Why<'a> {
    policy: &'a dyn Policy,
    preferred: Option<u64>,
    explain: u8,
}

/// The top candidates of a decision and its reason (only for requests that asked: a sampled
/// trace's route span).
fn explain(
    pool: &Pool,
    rp: &RoutePolicy,
    req: &RouteRequest,
    decision: &Decision,
    chosen: &Worker,
    candidates: &[Candidate],
    why: &Why<'_>,
) -> Explain {
    let mut all: Vec<Considered> = candidates
        .iter()
        .filter_map(|c| {
            let w = pool.worker(c.worker)?;
            Some(Considered {
                worker: w.name.clone(),
                chosen: c.worker == decision.worker,
                overlap_blocks: c.overlap_blocks,
                inflight: c.inflight,
                active_blocks: c.active_blocks,
                pending_prefill_tokens: c.pending_prefill_tokens,
                predicted_ttft_ms: rp.latency.estimate(req, c).predicted_ms,
                cost: why.policy.candidate_cost(req, c),
            })
        })
        .collect();
    let seen = all.len() as u32;
    // The chosen one first, then by cost (or predicted TTFT), then by name (stable).
    let key = |c: &Considered| c.cost.unwrap_or(c.predicted_ttft_ms);
    all.sort_by(|a, b| {
        b.chosen
            .cmp(&a.chosen)
            .then(key(a).total_cmp(&key(b)))
            .then(a.worker.cmp(&b.worker))
    });
    all.truncate(usize::from(why.explain));
    let overlap = all
        .first()
        .filter(|c| c.chosen)
        .map_or(decision.overlap_blocks, |c| c.overlap_blocks);
    let reason = match why.policy.name() {
        "latency" => "latency",
        "consistent_hash" if req.affinity_key.is_some() => "session",
        n @ ("round_robin" | "random" | "consistent_hash") => n,
        _ if why.preferred == Some(chosen.stable_id) => "session",
        _ if overlap > 0 && why.policy.uses_overlap() => "overlap",
        _ => "load",
    };
    Explain {
        candidates: all,
        seen,
        reason,
    }
}

/// Pools of at least this many workers route `kv` (temperature 0) on the bounded path; smaller
/// ones score every worker, which costs less there than the bounded path's index walk and the
/// load order it keeps (built on first use, then moved at every load change): measured with
/// `benches/callgrind.sh` at one worker, the bounded path cost ~1,800 more instructions per
/// request, and at 64 workers `fleet_bench` has it 2.6x faster than the scan (docs/routing.md §8b).
const BOUNDED_FROM_WORKERS: usize = 32;

/// Pools of at least this many workers route `latency` (temperature 0, no SLO) on the bounded
/// path. Its lower bound counts the running requests' decode slowdown (with the decode speed
/// ceiling) and the walk takes the non-holders by pending prefill and by in-flight requests at
/// once; `fleet_bench` (one run, p99 exhaustive → bounded) has it faster than the scan from 128
/// workers (12.0 → 8.6 µs; 1,024: 48.6 → 13.4 µs; 4,096: 263.6 → 44.8 µs) but not at 64 (5.0 →
/// 6.5 µs: the workers' own speeds are in no order, so it still visits 37 of them)
/// (docs/routing.md §8b).
const LATENCY_BOUNDED_FROM_WORKERS: usize = 128;

/// Which policies [`Router::select_with`] may route on the bounded path (§8b).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounded {
    pub kv: bool,
    pub latency: bool,
}

impl Bounded {
    /// Both (tests ask for it on small pools).
    #[cfg(test)]
    pub const ALL: Bounded = Bounded {
        kv: true,
        latency: true,
    };
    /// Neither: the exhaustive scan.
    pub const NONE: Bounded = Bounded {
        kv: false,
        latency: false,
    };

    /// By the pool's size.
    fn for_pool(workers: usize) -> Bounded {
        Bounded {
            kv: workers >= BOUNDED_FROM_WORKERS,
            latency: workers >= LATENCY_BOUNDED_FROM_WORKERS,
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

crate::thread_cache::cached_load!(fn cached_policy(RoutePolicy));

impl Router {
    pub fn new(policy: RoutePolicy, admission: Arc<Admission>) -> Self {
        let learn = policy.learn;
        let sessions = crate::ttl_map::TtlMap::new(policy.session_ttl, policy.session_max);
        Router {
            sessions,
            admission,
            policy: Arc::new(ArcSwap::from_pointee(policy)),
            index: RwLock::new(KvIndex::new()),
            active: ActiveSequences::new(),
            latency: Arc::new(Mutex::new(LatencyModel::new(learn))),
            speeds: Arc::new(SpeedBoard::default()),
            // Random start: request ids are also our cluster messages' ids, and a restarted
            // replica (same id) must not collide with the entries peers still hold of it.
            next_request: AtomicU64::new(fastrand::u64(1..u64::MAX / 2)),
            remote: Mutex::new(RemoteLoads::new()),
            cluster: OnceLock::new(),
            last_priority_ms: AtomicU64::new(0),
            epoch: crate::clock::now(),
        }
    }

    /// Register a worker with the index (exact when it publishes KV events, else approximate) and
    /// the latency model (seeded from its kind).
    pub fn add_worker(&self, id: WorkerId, exact: bool, kind: WorkerKind, routing: &RoutingConfig) {
        {
            let mut model = self.latency.lock();
            model.add_worker(id, kind_seed(kind));
            self.speeds.publish(&model, id);
        }
        let mode = if exact {
            IndexMode::Exact
        } else {
            IndexMode::Approximate(kvgate_core::ApproxConfig {
                ttl: std::time::Duration::from_secs(routing.approx_ttl_s),
                capacity_blocks: routing.approx_capacity_blocks,
            })
        };
        // Idle workers are in the load order too (the bounded selection walks it).
        self.active.add_worker(id);
        let mut index = self.index.write();
        index.set_predicted_ttl(std::time::Duration::from_secs(routing.predicted_ttl_s));
        index.set_mode(id, mode);
    }

    pub fn remove_worker(&self, id: WorkerId) {
        self.index.write().remove_worker(id);
        self.active.remove_worker(id);
        self.remote.lock().remove_worker(id);
        let mut model = self.latency.lock();
        model.remove_worker(id);
        self.speeds.publish(&model, id);
    }

    /// The busy-fleet queue this router's released loads wake.
    pub fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    /// The current policy (and its busy bound and latency settings).
    /// Read through this thread's cache: a reload is seen at the next read, as with a load.
    pub fn policy(&self) -> Arc<RoutePolicy> {
        cached_policy(&self.policy)
    }

    /// A reloaded policy; the latency model keeps what it learned, with the new learning settings.
    pub fn set_policy(&self, policy: RoutePolicy) {
        self.latency.lock().set_learn(policy.learn);
        self.sessions
            .set_limits(policy.session_ttl, policy.session_max);
        self.policy.store(Arc::new(policy));
    }

    /// A request of session `key` went to `worker`: the session's next requests prefer it.
    /// In cluster mode the peers hear of it when the session is new, moved, or half its TTL old
    /// (so their entry lives as long as ours).
    pub fn note_session(&self, key: Option<u64>, worker: &Worker, now: Instant) {
        let Some(k) = key else { return };
        let rp = self.policy();
        if rp.session_blocks == 0 {
            return;
        }
        let before = self.sessions.get_with_time(&k, now);
        self.sessions.insert(k, worker.stable_id, now);
        if let Some(c) = self.cluster.get() {
            let fresh = before.is_some_and(|(sid, at)| {
                sid == worker.stable_id && now.saturating_duration_since(at) < rp.session_ttl / 2
            });
            if !fresh {
                c.session(k, &worker.name);
            }
        }
    }

    /// A peer routed session `key` to the worker with `stable_id`.
    pub fn peer_session(&self, key: u64, stable_id: u64, now: Instant) {
        self.sessions.insert(key, stable_id, now);
    }

    /// Sessions remembered (`kvgate_sessions`).
    pub fn sessions_len(&self) -> usize {
        self.sessions.len()
    }

    /// Cluster mode on: our decisions and load deltas are published there from now on.
    pub fn set_cluster(&self, cluster: Arc<Cluster>) {
        self.admission.set_cluster(cluster.clone());
        let _ = self.cluster.set(cluster);
    }

    /// Read the KV index (the lock is held for the call only).
    pub fn with_index<R>(&self, f: impl FnOnce(&KvIndex) -> R) -> R {
        f(&self.index.read())
    }

    /// Change the KV index (workers' events, peers' snapshots; the lock is held for the call only).
    pub fn with_index_mut<R>(&self, f: impl FnOnce(&mut KvIndex) -> R) -> R {
        f(&mut self.index.write())
    }

    /// Cluster mode: the peers' loads (the lock is held for the call only).
    pub fn with_remote<R>(&self, f: impl FnOnce(&mut RemoteLoads) -> R) -> R {
        f(&mut self.remote.lock())
    }

    /// Our own in-flight load set (peers' requests join it: `cluster.rs`).
    pub fn active(&self) -> &ActiveSequences {
        &self.active
    }

    /// A copy of the latency model (gauges, admin state).
    pub fn latency_snapshot(&self) -> LatencyModel {
        self.latency.lock().clone()
    }

    /// A worker's learned speed (from the published copy: no lock).
    pub fn speed(&self, worker: WorkerId) -> Speed {
        let mut c = Candidate::new(worker);
        self.speeds.view().fill(&mut c);
        c.speed
    }

    /// The predicted TTFT (ms) of the last request routed to `worker` (0 before any).
    pub fn last_predicted_ms(&self, worker: WorkerId) -> f64 {
        self.speeds.last_predicted_ms(worker)
    }

    /// A scrape saw `running` requests in the engine while `waiting` waited (its concurrency
    /// limit, for the latency model).
    pub fn observe_engine(&self, worker: WorkerId, running: u32, waiting: u32) {
        let mut model = self.latency.lock();
        model.observe_engine(worker, running, waiting);
        self.speeds.publish(&model, worker);
    }

    /// Periodic upkeep: expire approximate-index entries, and load entries whose guard leaked
    /// (a request's load normally ends with its guard).
    pub fn housekeep(&self, now: Instant) {
        self.index.write().expire(now);
        self.active
            .expire_stale(now, std::time::Duration::from_secs(3600));
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
        self.select_leg(pool, hashes, isl, affinity_key, exclude, now, Leg::Whole)
    }

    /// [`Router::select`] for one leg of a request: a disaggregated request's decode leg is
    /// chosen by `pd.decode_policy` when set.
    #[allow(clippy::too_many_arguments)]
    pub fn select_leg(
        &self,
        pool: &Pool,
        hashes: &[u64],
        isl: u64,
        affinity_key: Option<u64>,
        exclude: &[WorkerId],
        now: Instant,
        leg: Leg,
    ) -> Result<Pick, NoPick> {
        self.select_for(
            pool,
            hashes,
            isl,
            affinity_key,
            exclude,
            now,
            leg,
            Lane::Any,
            0,
        )
    }

    /// [`Router::select_leg`] in a flow-control [`Lane`]: `Lane::Priority` may go past the busy
    /// bound and `max_inflight_per_worker` (a high class on engines that schedule by priority,
    /// which serve it ahead of the lower classes they hold). `explain` > 0: the pick carries that
    /// many top candidates and the reason ([`Pick::explain`]).
    #[allow(clippy::too_many_arguments)]
    pub fn select_for(
        &self,
        pool: &Pool,
        hashes: &[u64],
        isl: u64,
        affinity_key: Option<u64>,
        exclude: &[WorkerId],
        now: Instant,
        leg: Leg,
        lane: Lane,
        explain: u8,
    ) -> Result<Pick, NoPick> {
        self.select_with(
            pool,
            hashes,
            isl,
            affinity_key,
            exclude,
            now,
            leg,
            if lane == Lane::Any {
                Bounded::for_pool(pool.workers.len())
            } else {
                Bounded::NONE
            },
            lane,
            explain,
        )
    }

    /// The decision; `bounded.kv`: a `kv` policy at temperature 0 visits only the holders of the
    /// prompt's first block and the least loaded other workers
    /// ([`kvgate_core::select_kv_bounded`], docs/routing.md §8b) instead of every worker of the
    /// pool; `bounded.latency`: `latency` at temperature 0 without an SLO likewise, the others by pending prefill
    /// with the speed board's prefill floor ([`kvgate_core::select_latency_bounded`]). Same cost as the exhaustive scan, over the same tied workers. When it finds no
    /// non-busy worker, the exhaustive scan decides (it tells `AllBusy` from `NoWorker` over the
    /// whole pool).
    #[allow(clippy::too_many_arguments)]
    fn select_with(
        &self,
        pool: &Pool,
        hashes: &[u64],
        isl: u64,
        affinity_key: Option<u64>,
        exclude: &[WorkerId],
        now: Instant,
        leg: Leg,
        bounded: Bounded,
        lane: Lane,
        explain: u8,
    ) -> Result<Pick, NoPick> {
        let past_busy = lane == Lane::Priority;
        let rp = self.policy();
        let busy_off = past_busy || rp.busy.is_off();
        let policy = match (leg, &rp.decode_policy) {
            (Leg::Decode, Some(p)) => p.as_ref(),
            _ => rp.policy.as_ref(),
        };
        // The prompt's prefix in use right now, for the `kv` cost's replication term.
        let hot = match policy.as_kv() {
            Some(kv) if kv.config().replicate > 0.0 => self.active.hot_prefix(hashes),
            _ => HotPrefix::default(),
        };
        let req = RouteRequest {
            hashes,
            isl_tokens: isl,
            block_size: pool.block_size,
            affinity_key,
            hot,
        };
        SCRATCH.with(|s| {
            let s = &mut *s.borrow_mut();
            let Scratch {
                candidates,
                scores,
                rng,
            } = s;
            let rng = rng.get_or_insert_with(fastrand::Rng::new);
            // The session's last worker (`Router::note_session`), when the cost has a session
            // term: the exhaustive scan below adds it.
            let preferred = affinity_key
                .filter(|_| rp.session_blocks > 0 && policy.uses_overlap())
                .and_then(|k| self.sessions.get(&k, now));
            let kv = policy.as_kv().filter(|kv| {
                let sampling = kv.config().temperature > 0.0;
                bounded.kv && preferred.is_none() && !sampling
            });
            // `latency` at temperature 0 without an SLO picks the lowest cost too, which the
            // bounded walk finds with the speed bounds (docs/routing.md §8b).
            let latency = policy.as_latency().filter(|l| {
                let cfg = l.config();
                bounded.latency && preferred.is_none() && cfg.temperature <= 0.0 && !cfg.slo_on()
            });
            if kv.is_some() || latency.is_some() {
                let decision = {
                    // Lock order as everywhere: index, peers' loads (their guards free into
                    // `active`); `active` is locked inside. Speeds are read without a lock
                    // (the bounds first: a publication loosens them before the factor they cover).
                    let speed_bounds = self.speeds.bounds();
                    let index = self.index.read();
                    let mut remote = self.cluster.get().map(|_| self.remote.lock());
                    let speeds = self.speeds.view();
                    let mut prepare = |c: &mut Candidate| {
                        // The load order spans every pool: other pools' workers are skipped.
                        let Some(w) = pool.worker(c.worker) else {
                            return false;
                        };
                        if !self.eligible(w, exclude, &rp, now, past_busy) {
                            return false;
                        }
                        complete(c, w, now);
                        let one = std::slice::from_mut(c);
                        if let Some(r) = remote.as_mut() {
                            r.add_into(one);
                            if over_cluster_bound(&one[0], &rp, past_busy) {
                                return false;
                            }
                            r.add_provisional_at(one, now);
                        }
                        speeds.fill_all(one);
                        true
                    };
                    // Under `kv` the block walk first; the cold rule (`routing.kv_cold_latency`)
                    // over the holders it visited may hand the pick to the bounded `latency`
                    // walk (docs/routing.md §4), which `latency` itself always takes.
                    let (blocks, by_latency) = match kv {
                        Some(kv) => {
                            let blocks = select_kv_bounded(
                                kv,
                                &index,
                                &self.active,
                                &req,
                                now,
                                scores,
                                candidates,
                                &mut prepare,
                                rng,
                            );
                            let cold = blocks
                                .as_ref()
                                .and_then(|_| kv.placed_by_latency(&req, candidates));
                            (blocks, cold)
                        }
                        None => (None, latency),
                    };
                    match by_latency {
                        Some(l) => select_latency_bounded(
                            l,
                            &index,
                            &self.active,
                            &req,
                            now,
                            speed_bounds,
                            scores,
                            candidates,
                            &mut prepare,
                            rng,
                        ),
                        None => blocks,
                    }
                };
                // No non-busy worker visited: the walk then visited every worker it knows, and the
                // exhaustive scan below gives the same answer with its `AllBusy` / `NoWorker` rule.
                if let Some(decision) = decision {
                    if busy_off || !all_busy(candidates, &rp.busy) {
                        let why = Why {
                            policy,
                            preferred: None,
                            explain,
                        };
                        return self.picked(pool, &rp, &req, decision, candidates, why);
                    }
                }
            }
            candidates.clear();
            for w in &pool.workers {
                if !self.eligible(w, exclude, &rp, now, past_busy) {
                    continue;
                }
                let mut c = Candidate::new(w.id);
                complete(&mut c, w, now);
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
            // The index is read only for policies that route on overlap; for the others the pick's
            // TTFT prediction counts the whole prompt as uncached (an upper bound), and their
            // decision costs no index lock.
            if policy.uses_overlap() {
                let index = self.index.read();
                score_candidates(&index, &self.active, hashes, now, scores, candidates);
                if let Some(sid) = preferred {
                    // Soft: the session's worker counts as holding a few more of the prompt's
                    // blocks (it likely does: its last request carried this prefix); its load
                    // terms still count in full, so a hot worker still loses.
                    let cap = hashes.len() as u32;
                    for c in candidates.iter_mut().filter(|c| c.stable_id == sid) {
                        c.overlap_blocks =
                            c.overlap_blocks.saturating_add(rp.session_blocks).min(cap);
                    }
                }
            } else {
                self.active.fill_loads(hashes, candidates);
            }
            if self.cluster.get().is_some() {
                let mut remote = self.remote.lock();
                remote.add_into(candidates);
                candidates.retain(|c| !over_cluster_bound(c, &rp, past_busy));
                if candidates.is_empty() {
                    return Err(NoPick::AllBusy);
                }
                remote.add_provisional_at(candidates, now);
            }
            if lane != Lane::Any {
                self.keep_lane(pool, lane, exclude, now, candidates);
                if candidates.is_empty() {
                    return Err(NoPick::AllBusy);
                }
            }
            self.speeds.view().fill_all(candidates);
            if !busy_off && all_busy(candidates, &rp.busy) {
                return Err(NoPick::AllBusy);
            }
            let decision = policy
                .select(&req, candidates, rng)
                .ok_or(NoPick::NoWorker)?;
            let why = Why {
                policy,
                preferred,
                explain,
            };
            self.picked(pool, &rp, &req, decision, candidates, why)
        })
    }

    /// The candidates a request of `lane` may take (see [`Lane`]); loads are filled in.
    fn keep_lane(
        &self,
        pool: &Pool,
        lane: Lane,
        exclude: &[WorkerId],
        now: Instant,
        candidates: &mut Vec<Candidate>,
    ) {
        match lane {
            Lane::Any => {}
            Lane::Priority => {
                self.last_priority_ms
                    .store(ms_since(self.epoch, now).max(1), Ordering::Relaxed);
                let least = candidates.iter().map(|c| c.pending_prefill_tokens).min();
                candidates.retain(|c| Some(c.pending_prefill_tokens) == least);
            }
            Lane::Below => {
                // Only while the priority class is about (a request of it routed lately).
                let last = self.last_priority_ms.load(Ordering::Relaxed);
                let ago = ms_since(self.epoch, now).saturating_sub(last);
                if last == 0 || ago > PRIORITY_ACTIVE_MS {
                    return;
                }
                let priority_prefill =
                    |w: &Worker| w.state.priority_prefills.load(Ordering::Relaxed) > 0;
                candidates.retain(|c| pool.worker(c.worker).is_none_or(|w| !priority_prefill(w)));
                // Workers of the pool a priority request could take with no prefill ahead of
                // it, busy or not (it passes the bound). The last of them is kept free.
                let remote = self.cluster.get().map(|_| self.remote.lock());
                let free = pool
                    .workers
                    .iter()
                    .filter(|w| !exclude.contains(&w.id) && w.state.routable(now))
                    .filter(|w| !priority_prefill(w))
                    .filter(|w| {
                        let peers = remote
                            .as_ref()
                            .map_or(0, |r| r.load(w.id).pending_prefill_tokens);
                        self.active.snapshot(w.id).pending_prefill_tokens + peers == 0
                    })
                    .count();
                drop(remote);
                if free <= 1 && pool.workers.len() > 1 {
                    candidates.retain(|c| c.pending_prefill_tokens > 0);
                }
            }
        }
    }

    /// `w` may take this request: not already tried, routable, under `max_inflight_per_worker`
    /// (unless `past_busy`).
    fn eligible(
        &self,
        w: &Worker,
        exclude: &[WorkerId],
        rp: &RoutePolicy,
        now: Instant,
        past_busy: bool,
    ) -> bool {
        !exclude.contains(&w.id)
            && w.state.routable(now)
            && (past_busy
                || rp.max_inflight == 0
                // Cluster mode: the bound counts every replica's requests (`over_cluster_bound`).
                || self.cluster.get().is_some()
                || w.state.inflight.load(Ordering::Relaxed) < rp.max_inflight)
    }

    /// The pick of `decision` among `candidates` (the workers the policy saw, logged; listed in
    /// the pick when `why.explain` asks).
    fn picked(
        &self,
        pool: &Pool,
        rp: &RoutePolicy,
        req: &RouteRequest,
        decision: Decision,
        candidates: &[Candidate],
        why: Why<'_>,
    ) -> Result<Pick, NoPick> {
        let worker = pool
            .worker(decision.worker)
            .cloned()
            .ok_or(NoPick::NoWorker)?;
        tracing::debug!(
            target: "kvgate::route",
            worker = %worker.name,
            cost = decision.cost,
            overlap = decision.overlap_blocks,
            share = decision.share,
            candidates = ?CandidateLoads(candidates),
            "routed"
        );
        let estimate = candidates
            .iter()
            .find(|c| c.worker == decision.worker)
            .map(|c| rp.latency.estimate(req, c))
            .unwrap_or_default();
        let explain = (why.explain > 0)
            .then(|| Box::new(explain(pool, rp, req, &decision, &worker, candidates, &why)));
        Ok(Pick {
            worker,
            decision,
            estimate,
            explain,
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
            note_routed(&mut self.index.write(), pick.worker.id, hashes, now);
        }
        let cluster = self.cluster.get().map(|c| {
            // The blocks this request adds on its worker: its prompt beyond the prefix the worker
            // is predicted to hold. Peers sum these per request (they get counts, not block sets),
            // so the whole prompt would count a shared prefix once per request and steer its group
            // away from the worker holding it (docs/cluster.md, Measured).
            let blocks = (hashes.len() as u32).saturating_sub(pick.decision.overlap_blocks);
            let prefill = isl.saturating_sub(cached);
            c.route(
                pick.worker.models.first().map_or("", |m| m),
                &pick.worker.name,
                id,
                prefill,
                blocks,
                hashes,
            );
            // Until peers' decisions of this same instant arrive, ours stands for theirs.
            self.remote.lock().routed_here(
                pick.worker.id,
                prefill,
                blocks,
                pick.decision.share,
                now,
            );
            (c.clone(), id)
        });
        pick.worker.state.add_inflight();
        pick.worker.state.dispatched.fetch_add(1, Ordering::Relaxed);
        let cell = self
            .speeds
            .record_routed(pick.worker.id, pick.estimate.predicted_ms);
        DispatchGuard {
            core: Some(core),
            worker: pick.worker.clone(),
            admission: self.admission.clone(),
            cluster,
            priority_prefill: std::sync::atomic::AtomicBool::new(false),
            ended: None,
            latency: LatencyFeed {
                model: self.latency.clone(),
                speeds: self.speeds.clone(),
                cell,
                estimate: pick.estimate,
                dispatched: now,
                first_token_seen: std::sync::atomic::AtomicBool::new(false),
                answered: std::sync::atomic::AtomicBool::new(false),
                itl_ms: AtomicU64::new(NONE),
                output_tokens: AtomicU64::new(NONE),
            },
        }
    }
}

/// Cluster mode: `max_inflight_per_worker` counts the requests every replica has in flight on
/// the worker (ours and the peers' as they told us; not the provisional guesses), so the fleet's
/// slots are one budget that flow control orders cluster-wide. With the bus down, peers' requests
/// count until their heartbeat timeout, then only ours.
fn over_cluster_bound(c: &Candidate, rp: &RoutePolicy, past_busy: bool) -> bool {
    !past_busy && rp.max_inflight > 0 && c.inflight >= rp.max_inflight
}

/// A request with block `hashes` was routed to `worker` (by us or a peer): approximate workers
/// learn only from routing; exact workers get a short-lived prediction, so requests arriving
/// before the worker's BlockStored events see the prefix. The one place that rule is written.
pub fn note_routed(index: &mut KvIndex, worker: WorkerId, hashes: &[u64], now: Instant) {
    match index.mode(worker) {
        Some(IndexMode::Approximate(_)) => {
            index.record_routed(worker, hashes, now);
        }
        Some(IndexMode::Exact) => {
            index.record_predicted(worker, hashes, now);
        }
        None => {}
    }
}

/// Load of one dispatched request: in-flight count, active blocks and pending prefill on its
/// worker. Dropping it (completion, error, cancel) releases all of it and wakes a queued request.
pub struct DispatchGuard {
    core: Option<LoadGuard>,
    pub worker: Arc<Worker>,
    /// Woken when this load is released (always: a queued request may be waiting for it).
    admission: Arc<Admission>,
    latency: LatencyFeed,
    /// Cluster mode: the request's id in our published load deltas.
    cluster: Option<(Arc<Cluster>, u64)>,
    /// Counted in the worker's `priority_prefills` until its first token ([`Lane::Priority`]).
    priority_prefill: std::sync::atomic::AtomicBool,
    /// When the request ended, if the owner read the clock already ([`DispatchGuard::release_at`]);
    /// else the drop reads it.
    ended: Option<Instant>,
}

/// "Not observed" in [`LatencyFeed`]'s end-of-request fields.
const NONE: u64 = u64::MAX;

/// What the latency model learns from one dispatched request: the TTFT at the first token (one
/// lock), the rest together when the guard drops (one lock).
struct LatencyFeed {
    model: Arc<Mutex<LatencyModel>>,
    speeds: Arc<SpeedBoard>,
    /// The worker's cell on the speed board, when it had one at dispatch.
    cell: Option<super::speeds::SpeedCell>,
    estimate: TtftEstimate,
    dispatched: Instant,
    first_token_seen: std::sync::atomic::AtomicBool,
    /// The worker answered (first token, or the whole non-streamed response).
    answered: std::sync::atomic::AtomicBool,
    /// Mean inter-token gap (f64 bits, ms), learned at the end ([`NONE`]: not observed).
    itl_ms: AtomicU64,
    /// Generated tokens, learned at the end ([`NONE`]: not observed).
    output_tokens: AtomicU64,
}

impl LatencyFeed {
    /// Learn one observation of worker `w` (the lock held for it only), then publish what changed:
    /// `w`, or every worker when the model relaxed the ones it has not heard from.
    fn learn(&self, w: WorkerId, f: impl FnOnce(&mut LatencyModel)) {
        let mut model = self.model.lock();
        let relaxed = model.relaxations();
        f(&mut model);
        if model.relaxations() != relaxed {
            self.speeds.publish_all(&model);
        } else {
            self.speeds.publish_at(&model, w, self.cell.as_ref());
        }
    }
}

impl DispatchGuard {
    /// A request of [`Lane::Priority`]: lower classes keep off its worker until its first token.
    pub fn hold_priority_prefill(&self) {
        if !self.priority_prefill.swap(true, Ordering::Relaxed) {
            self.worker
                .state
                .priority_prefills
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    fn end_priority_prefill(&self) -> bool {
        let held = self.priority_prefill.swap(false, Ordering::Relaxed);
        if held {
            self.worker
                .state
                .priority_prefills
                .fetch_sub(1, Ordering::Relaxed);
        }
        held
    }

    /// Release the load now, the request having ended at `now` (a clock the caller read anyway):
    /// the same as dropping the guard, one clock read fewer.
    pub fn release_at(mut self, now: Instant) {
        self.ended = Some(now);
    }

    pub fn prefill_done(&self) {
        self.latency.answered.store(true, Ordering::Relaxed);
        if let Some(c) = &self.core {
            c.mark_prefill_done();
        }
        if let Some((c, id)) = &self.cluster {
            c.prefill_done(*id);
        }
        // Its pending prefill is gone: a waiter held off by it (busy bound on pending prefill,
        // a lower class kept out of a priority request's way) may go now.
        self.end_priority_prefill();
        if !self.admission.is_empty() {
            self.admission.release();
        }
    }

    /// The first streamed token arrived at `now`: teaches the latency model this worker's TTFT
    /// (from dispatch, so gateway queueing is not charged to the worker). Returns the predicted and
    /// observed TTFT in ms, once per dispatch.
    pub fn observe_first_token(&self, now: Instant) -> Option<(f64, f64)> {
        let f = &self.latency;
        if f.first_token_seen.swap(true, Ordering::Relaxed) {
            return None;
        }
        let observed = now.saturating_duration_since(f.dispatched).as_secs_f64() * 1000.0;
        f.learn(self.worker.id, |m| {
            m.observe_ttft(self.worker.id, &f.estimate, observed)
        });
        Some((f.estimate.predicted_ms, observed))
    }

    /// The request completed with `tokens` generated: teaches the worker's mean output (how much
    /// a running request's KV grows), when the guard drops.
    pub fn observe_output(&self, tokens: u64) {
        self.latency
            .output_tokens
            .store(tokens.min(NONE - 1), Ordering::Relaxed);
    }

    /// The request streamed with mean inter-token gap `itl_ms`: teaches the worker's decode speed,
    /// when the guard drops.
    pub fn observe_itl(&self, itl_ms: f64) {
        self.latency
            .itl_ms
            .store(itl_ms.to_bits(), Ordering::Relaxed);
    }
}

impl Drop for DispatchGuard {
    fn drop(&mut self) {
        // Free everything before waking a queued request, so it sees the released capacity.
        drop(self.core.take());
        self.end_priority_prefill();
        if let Some((c, id)) = &self.cluster {
            c.free(*id);
        }
        self.worker.state.sub_inflight();
        // What the end of the request teaches, in one lock: its decode speed, its output and how
        // long it held an engine slot there (the slot wait; only requests the engine ran: an early
        // failure says nothing about it).
        let f = &self.latency;
        let itl = f.itl_ms.load(Ordering::Relaxed);
        let output = f.output_tokens.load(Ordering::Relaxed);
        let answered = f.answered.load(Ordering::Relaxed);
        if itl != NONE || output != NONE || answered {
            let w = self.worker.id;
            f.learn(w, |m| {
                if itl != NONE {
                    m.observe_itl(w, &f.estimate, f64::from_bits(itl));
                }
                if output != NONE {
                    m.observe_output(w, output);
                }
                if answered {
                    let end = self.ended.unwrap_or_else(crate::clock::now);
                    let held = end.saturating_duration_since(f.dispatched);
                    m.observe_done(w, held.as_secs_f64() * 1000.0);
                }
            });
        }
        self.admission.release();
    }
}

#[cfg(test)]
#[path = "router_tests.rs"]
mod tests;
