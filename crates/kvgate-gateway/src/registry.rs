//! The worker registry: an immutable [`Fleet`] snapshot behind `ArcSwap`, rebuilt whenever the
//! config is reloaded, the admin API changes the worker set, or model discovery finds a change.
//!
//! Request handlers `load()` the snapshot once and never lock. Everything that changes per request
//! or per health probe lives in [`WorkerState`] (atomics and short non-async locks), which is shared
//! by successive snapshots as long as the worker's URL stays in the fleet, so a reload never resets
//! load accounting of in-flight requests.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::uri::{Authority, Scheme};
use parking_lot::Mutex;

use crate::config::{
    worker_name, Config, RoleSetting, WorkerConfig, WorkerRole, DEFAULT_BOOTSTRAP_PORT,
};
use crate::metrics::Lbl;

/// Dense worker id, shared with kvgate-core (an index into its per-worker tables; a fleet whose ids
/// are all below 64 takes the index's one-word fast path). Ids of removed workers are reused, the
/// lowest first, once nothing refers to the old worker any more: the fleet has forgotten it
/// (index, load, latency model: [`Registry::forgotten`]) and no snapshot, in-flight request or
/// monitor holds its state. So a DNS pool that churns keeps its ids as small as the pool.
pub use kvgate_core::WorkerId;

/// Worker-reported load older than this is ignored (routing falls back to router-side load).
pub const SCRAPE_STALE: Duration = Duration::from_secs(10);

/// The worker's circuit breaker: one `kvgate_fleet::Breaker` shared by the request path (outcomes
/// recorded in `proxy.rs`) and the worker's monitor (health probes), so consecutive failures of
/// either kind open it and a half-open probe closes it. Defaults: 5 failures, open for 10 s.
pub use kvgate_fleet::{Breaker, BreakerConfig, BreakerState};

/// A worker's role as its `/server_info` announced it (`role = "auto"`, kvgate-fleet's probe).
pub use kvgate_fleet::DetectedRole;

/// `kvgate_worker_breaker_state`'s value: 0 closed, 1 half-open, 2 open.
pub fn breaker_gauge(s: BreakerState) -> i64 {
    match s {
        BreakerState::Closed => 0,
        BreakerState::HalfOpen => 1,
        BreakerState::Open => 2,
    }
}

/// Mutable per-worker state. Fed by the request path (in-flight, breaker outcomes) and by the
/// fleet monitors (health, discovered models, scraped load).
#[derive(Debug)]
pub struct WorkerState {
    pub id: WorkerId,
    pub inflight: AtomicU32,
    /// Flow control: requests let past the busy bound here still before their first token
    /// (lower classes keep off the worker meanwhile: `route::router::Lane`).
    pub priority_prefills: AtomicU32,
    /// Set by health checks (kvgate-fleet); workers start healthy (fail open).
    pub healthy: AtomicBool,
    /// Draining workers get no new requests; in-flight ones finish.
    pub draining: AtomicBool,
    /// False after a block-size mismatch: the worker's overlap is ignored (load-balanced only).
    pub kv_scoring: AtomicBool,
    /// Shared with the worker's monitor (see [`Breaker`]); kept across monitor restarts.
    pub breaker: Arc<Breaker>,
    /// Models from the worker's `/v1/models` (used when the config lists none).
    pub discovered_models: Mutex<Vec<Lbl>>,
    /// Requests dispatched to this worker (for admin state).
    pub dispatched: AtomicU64,
    /// When the worker joined the fleet, and up to when its cost has been accrued (ms since added).
    pub added: Instant,
    /// Set by the first successful health probe (`kvgate_worker_time_to_routable_seconds`).
    pub first_healthy: AtomicBool,
    pub cost_accrued_ms: AtomicU64,
    /// Latest worker-reported load and when it was read (fed by kvgate-fleet's scraper).
    pub scraped: Mutex<Option<(Instant, kvgate_core::ScrapedLoad)>>,
    /// KV-cache capacity in the pool's blocks, from the last scrape that reported it; 0 = unknown.
    pub kv_capacity_blocks: AtomicU32,
    /// The worker's config says `role = "auto"` (set by every rebuild).
    role_auto: AtomicBool,
    /// What its `/server_info` announced, packed by [`pack_role`]; 0 until known. Kept across
    /// reloads and monitor restarts, like the rest of this state.
    detected_role: AtomicU32,
    /// Running sums of `inflight` over the worker sets this worker is in (each PD pool's decode
    /// workers: [`RoleSplit::decode_inflight`]), moved with every change of `inflight`
    /// ([`WorkerState::add_inflight`]). The lock is taken for reading by each change (they do not
    /// exclude each other) and for writing when the worker joins or leaves a set, so a set's sum
    /// always equals its workers' `inflight` summed.
    sums: parking_lot::RwLock<Vec<Arc<AtomicU64>>>,
}

impl WorkerState {
    fn new(id: WorkerId) -> Self {
        WorkerState {
            id,
            inflight: AtomicU32::new(0),
            priority_prefills: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            kv_scoring: AtomicBool::new(true),
            breaker: Arc::new(Breaker::new(BreakerConfig::default())),
            discovered_models: Mutex::new(Vec::new()),
            dispatched: AtomicU64::new(0),
            added: crate::clock::now(),
            first_healthy: AtomicBool::new(false),
            cost_accrued_ms: AtomicU64::new(0),
            scraped: Mutex::new(None),
            kv_capacity_blocks: AtomicU32::new(0),
            role_auto: AtomicBool::new(false),
            detected_role: AtomicU32::new(0),
            sums: parking_lot::RwLock::new(Vec::new()),
        }
    }

    /// One more request in flight here (counted in every sum this worker is in).
    pub fn add_inflight(&self) {
        let sums = self.sums.read();
        self.inflight.fetch_add(1, Ordering::Relaxed);
        for s in sums.iter() {
            s.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One request fewer in flight here (see [`WorkerState::add_inflight`]).
    pub fn sub_inflight(&self) {
        let sums = self.sums.read();
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        for s in sums.iter() {
            s.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Counts this worker's in-flight requests in `sum` from now on (its current ones added).
    pub(crate) fn join_sum(&self, sum: &Arc<AtomicU64>) {
        let mut sums = self.sums.write();
        if sums.iter().any(|s| Arc::ptr_eq(s, sum)) {
            return;
        }
        sum.fetch_add(
            u64::from(self.inflight.load(Ordering::Relaxed)),
            Ordering::Relaxed,
        );
        sums.push(sum.clone());
    }

    /// Stops counting this worker in `sum` (its current in-flight requests taken out).
    pub(crate) fn leave_sum(&self, sum: &Arc<AtomicU64>) {
        let mut sums = self.sums.write();
        if let Some(i) = sums.iter().position(|s| Arc::ptr_eq(s, sum)) {
            sums.swap_remove(i);
            sum.fetch_sub(
                u64::from(self.inflight.load(Ordering::Relaxed)),
                Ordering::Relaxed,
            );
        }
    }

    /// Records the role the worker's `/server_info` announced (`role = "auto"`).
    pub fn set_detected_role(&self, d: &DetectedRole) {
        let packed = pack_role(d);
        if self.detected_role.swap(packed, Ordering::AcqRel) != packed {
            ROLE_GENERATION.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The role the worker's `/server_info` announced, once it answered.
    pub fn detected_role(&self) -> Option<DetectedRole> {
        unpack_role(self.detected_role.load(Ordering::Acquire))
    }

    /// `role = "auto"` and the worker has not told its role yet: it gets no traffic (a SGLang
    /// prefill server sent a whole request would wait for a bootstrap partner that never comes).
    pub fn role_unknown(&self) -> bool {
        self.role_auto.load(Ordering::Relaxed) && self.detected_role.load(Ordering::Acquire) == 0
    }

    /// The scraped load if it is recent enough to trust.
    pub fn fresh_scraped(&self, now: Instant) -> Option<kvgate_core::ScrapedLoad> {
        match *self.scraped.lock() {
            Some((at, l)) if now.saturating_duration_since(at) < SCRAPE_STALE => Some(l),
            _ => None,
        }
    }

    pub fn breaker_state(&self, now: Instant) -> BreakerState {
        self.breaker.state_at(now)
    }

    /// Record a request outcome. A success closes the breaker; consecutive failures (requests or
    /// health probes) open it; a failure after the cool-down re-opens it for another one.
    pub fn record_outcome(&self, ok: bool, now: Instant) {
        if ok {
            if self.breaker.record_success() {
                tracing::info!(worker = self.id.0, "breaker closed by a successful request");
            }
        } else if self.breaker.record_failure(now) {
            tracing::warn!(worker = self.id.0, "breaker opened by failed requests");
        }
    }

    /// Healthy, not draining, breaker not open (half-open lets traffic probe the worker), and its
    /// role known.
    pub fn routable(&self, now: Instant) -> bool {
        self.healthy.load(Ordering::Relaxed)
            && !self.draining.load(Ordering::Relaxed)
            && self.breaker.is_available(now)
            && !self.role_unknown()
    }
}

/// A detected role in one word, so readers never see half of an update: bits 0–1 the role
/// (1 both, 2 prefill, 3 decode; 0 = not known), bit 2 `announced`, bits 16–31 the bootstrap port.
fn pack_role(d: &DetectedRole) -> u32 {
    let role = match d.role {
        WorkerRole::Both => 1,
        WorkerRole::Prefill => 2,
        WorkerRole::Decode => 3,
    };
    role | u32::from(d.announced) << 2 | u32::from(d.bootstrap_port.unwrap_or(0)) << 16
}

fn unpack_role(v: u32) -> Option<DetectedRole> {
    let role = match v & 3 {
        1 => WorkerRole::Both,
        2 => WorkerRole::Prefill,
        3 => WorkerRole::Decode,
        _ => return None,
    };
    Some(DetectedRole {
        role,
        announced: v & 4 != 0,
        bootstrap_port: Some((v >> 16) as u16).filter(|p| *p != 0),
    })
}

/// One worker in a snapshot.
#[derive(Debug)]
pub struct Worker {
    pub id: WorkerId,
    pub name: Lbl,
    /// A hash of `name`: the worker's identity in rendezvous hashing ([`Candidate::stable_id`]),
    /// the same on every replica with the same config whatever ids they assigned.
    ///
    /// [`Candidate::stable_id`]: kvgate_core::Candidate::stable_id
    pub stable_id: u64,
    pub scheme: Scheme,
    pub authority: Authority,
    /// Path prefix of the base URL without trailing slash (usually empty).
    pub path_prefix: String,
    pub cfg: WorkerConfig,
    /// `cfg.kind`, parsed (`auto` until a monitor detects the engine).
    pub kind: kvgate_fleet::WorkerKind,
    /// Bearer header value sent to the worker, prepared once.
    pub auth_header: Option<http::HeaderValue>,
    pub models: Vec<Lbl>,
    pub state: Arc<WorkerState>,
}

impl Worker {
    /// The worker's part in a prefill/decode split: its configured role, or with `role = "auto"`
    /// the one its `/server_info` announced (`None` until then: the worker is not routable).
    pub fn role(&self) -> Option<WorkerRole> {
        match self.cfg.role {
            RoleSetting::Fixed(r) => Some(r),
            RoleSetting::Auto => self.state.detected_role().map(|d| d.role),
        }
    }

    /// The `role` metric label: the role in use, `unknown` while an `auto` worker has not told.
    pub fn role_label(&self) -> &'static str {
        self.role().map_or("unknown", WorkerRole::as_str)
    }

    /// The engine announced its disaggregation mode (`role = "auto"` on an SGLang server): its
    /// handoff is SGLang's (`[pd] protocol = "auto"`).
    pub fn role_announced(&self) -> bool {
        self.cfg.role == RoleSetting::Auto
            && self.state.detected_role().is_some_and(|d| d.announced)
    }

    /// The `bootstrap_port` sent with SGLang legs naming this (prefill) worker: configured, else
    /// announced by its `/server_info`, else 8998 (0 = send null).
    pub fn bootstrap_port(&self) -> u16 {
        self.cfg
            .bootstrap_port
            .or_else(|| self.state.detected_role().and_then(|d| d.bootstrap_port))
            .unwrap_or(DEFAULT_BOOTSTRAP_PORT)
    }
}

/// Bumped whenever a worker's detected role changes: pools' cached role splits
/// ([`RoleSplit`], computed by `pd::roles`) are then recomputed.
static ROLE_GENERATION: AtomicU64 = AtomicU64::new(0);

/// The current role generation (see [`ROLE_GENERATION`]).
pub fn role_generation() -> u64 {
    ROLE_GENERATION.load(Ordering::Acquire)
}

/// A pool's workers by role, computed once per pool and role change instead of per request
/// (a pass over a fleet of thousands of workers, twice per disaggregated decision, and once for
/// every request to any pool for `pd::applies`). The pool holds it; `pd::roles` computes it.
#[derive(Debug)]
pub struct RoleSplit {
    /// [`role_generation`] when it was computed.
    pub(crate) generation: u64,
    /// The pool has a dedicated prefill worker.
    pub applies: bool,
    /// Its decode-capable workers (`pd::sub_pool` with `WorkerRole::can_decode`).
    pub decode: Arc<Pool>,
    /// Its prefill-capable workers.
    pub prefill: Arc<Pool>,
    /// `inflight` summed over `decode`'s workers, kept by them as requests come and go
    /// ([`WorkerState::add_inflight`]): `pd::crowded` reads it instead of a pass over the pool.
    pub(crate) decode_inflight: Arc<AtomicU64>,
}

impl RoleSplit {
    /// The split of a pool into `decode` and `prefill` workers; its decode workers count their
    /// in-flight requests in [`RoleSplit::decode_inflight`] from now on, until it is dropped.
    pub fn new(generation: u64, applies: bool, decode: Arc<Pool>, prefill: Arc<Pool>) -> Self {
        let decode_inflight = Arc::new(AtomicU64::new(0));
        for w in &decode.workers {
            w.state.join_sum(&decode_inflight);
        }
        RoleSplit {
            generation,
            applies,
            decode,
            prefill,
            decode_inflight,
        }
    }

    /// Requests in flight on the decode workers, summed (no pass over them).
    pub fn decode_inflight(&self) -> u64 {
        self.decode_inflight.load(Ordering::Relaxed)
    }
}

impl Drop for RoleSplit {
    fn drop(&mut self) {
        for w in &self.decode.workers {
            w.state.leave_sum(&self.decode_inflight);
        }
    }
}

/// The workers serving one model name.
#[derive(Debug)]
pub struct Pool {
    /// The canonical model name (metric label).
    pub model: Lbl,
    pub workers: Vec<Arc<Worker>>,
    pub block_size: u32,
    /// Tokenizer + chat template of this model.
    pub tokenizer: Arc<kvgate_tokenize::ModelTokenizer>,
    /// Position in `workers` by worker id (`u32::MAX`: not in this pool), built with the pool:
    /// O(1) membership and id → worker for the bounded selection, which walks the load order of
    /// every pool's workers. Ids are dense (reused after removal), so this stays fleet-sized.
    slots: Vec<u32>,
    /// Its workers by role, cached (`pd::roles` computes it).
    pub(crate) roles: arc_swap::ArcSwapOption<RoleSplit>,
    /// `roles`' `applies` with its role generation, as `generation << 1 | applies`
    /// ([`u64::MAX`]: none yet): what `pd::applies` reads on every request, one atomic load.
    pub(crate) applies_at: AtomicU64,
}

impl Pool {
    pub fn new(
        model: Lbl,
        workers: Vec<Arc<Worker>>,
        block_size: u32,
        tokenizer: Arc<kvgate_tokenize::ModelTokenizer>,
    ) -> Self {
        let mut slots = Vec::new();
        for (i, w) in workers.iter().enumerate() {
            let at = w.id.index();
            if slots.len() <= at {
                slots.resize(at + 1, u32::MAX);
            }
            slots[at] = i as u32;
        }
        Pool {
            model,
            workers,
            block_size,
            tokenizer,
            slots,
            roles: Default::default(),
            applies_at: AtomicU64::new(u64::MAX),
        }
    }

    /// The pool's worker with this id (O(1)).
    pub fn worker(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        let i = *self.slots.get(id.index())?;
        self.workers.get(i as usize).filter(|w| w.id == id)
    }
}

/// An immutable view of the fleet.
#[derive(Debug, Default)]
pub struct Fleet {
    pub workers: Vec<Arc<Worker>>,
    /// Model name or alias → pool (looked up per request: a fast hasher, the keys are config).
    pub pools: HashMap<Lbl, Arc<Pool>, kvgate_core::FastBuild>,
    pub generation: u64,
    /// Position in `workers` by worker name, built with the snapshot: a peer's message names its
    /// worker, and a fleet of thousands must not be searched per message ([`Fleet::named`]).
    by_name: HashMap<Lbl, u32, kvgate_core::FastBuild>,
}

impl Fleet {
    /// A snapshot of `workers` and `pools`.
    pub fn new(workers: Vec<Arc<Worker>>, pools: HashMap<Lbl, Arc<Pool>>, generation: u64) -> Self {
        let by_name = workers
            .iter()
            .enumerate()
            .map(|(i, w)| (w.name.clone(), i as u32))
            .collect();
        Fleet {
            workers,
            pools: pools.into_iter().collect(),
            generation,
            by_name,
        }
    }

    pub fn pool(&self, model: &str) -> Option<&Arc<Pool>> {
        self.pools.get(model)
    }

    pub fn worker(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        self.workers.iter().find(|w| w.id == id)
    }

    /// The worker called `name` (O(1); a linear search only for a fleet assembled by hand).
    pub fn named(&self, name: &str) -> Option<&Arc<Worker>> {
        match self.by_name.get(name) {
            Some(&i) => self.workers.get(i as usize).filter(|w| &*w.name == name),
            None if self.by_name.len() == self.workers.len() => None,
            None => self.workers.iter().find(|w| &*w.name == name),
        }
    }

    /// At least one worker can take traffic (for `/ready`).
    pub fn any_routable(&self) -> bool {
        let now = crate::clock::now();
        self.workers.iter().any(|w| w.state.routable(now))
    }
}

/// Owner of the snapshot and of the worker-set overlays the admin API applies on top of config.
pub struct Registry {
    fleet: ArcSwap<Fleet>,
    inner: Mutex<RegistryInner>,
}

struct RegistryInner {
    states: HashMap<String, Arc<WorkerState>>,
    next_id: u32,
    /// Removed workers' states by id, and whether the fleet has forgotten the id (see
    /// [`Registry::forgotten`]); reusable once that is so and nothing else holds the state.
    retired: HashMap<WorkerId, (Arc<WorkerState>, bool)>,
    generation: u64,
    config: Arc<Config>,
    admin_added: Vec<WorkerConfig>,
    admin_removed: HashSet<String>,
    /// Workers discovered for `[[worker_pools]]` (DNS, endpoints file, InferencePool), by pool
    /// name prefix (see `worker_pools.rs`).
    discovered: HashMap<String, Vec<WorkerConfig>>,
    /// Loaded tokenizers by spec (loading an HF tokenizer takes a while; reloads reuse it).
    tokenizers: HashMap<String, Arc<kvgate_tokenize::ModelTokenizer>>,
}

impl RegistryInner {
    /// The lowest reusable id of a removed worker, else a new one.
    fn allocate_id(&mut self) -> WorkerId {
        let reusable = self
            .retired
            .iter()
            .filter(|(_, (state, forgotten))| *forgotten && Arc::strong_count(state) == 1)
            .map(|(id, _)| *id)
            .min();
        match reusable {
            Some(id) => {
                self.retired.remove(&id);
                id
            }
            None => {
                let id = WorkerId(self.next_id);
                self.next_id += 1;
                id
            }
        }
    }
}

/// What changed in a rebuild (so the caller can clear index entries of removed workers).
#[derive(Debug, Default)]
pub struct Rebuilt {
    pub added: Vec<(WorkerId, Lbl)>,
    pub removed: Vec<(WorkerId, Lbl)>,
}

impl Registry {
    pub fn new(config: Arc<Config>) -> anyhow::Result<(Self, Rebuilt)> {
        let reg = Registry {
            fleet: ArcSwap::from_pointee(Fleet::default()),
            inner: Mutex::new(RegistryInner {
                states: HashMap::new(),
                next_id: 0,
                retired: HashMap::new(),
                generation: 0,
                config,
                admin_added: Vec::new(),
                admin_removed: HashSet::new(),
                discovered: HashMap::new(),
                tokenizers: HashMap::new(),
            }),
        };
        let r = reg.rebuild_with(|_| Ok(()))?;
        Ok((reg, r))
    }

    pub fn snapshot(&self) -> arc_swap::Guard<Arc<Fleet>> {
        self.fleet.load()
    }

    pub fn load_full(&self) -> Arc<Fleet> {
        self.fleet.load_full()
    }

    pub fn config(&self) -> Arc<Config> {
        self.inner.lock().config.clone()
    }

    /// Replace the config (hot reload) and rebuild.
    pub fn set_config(&self, config: Arc<Config>) -> anyhow::Result<Rebuilt> {
        self.rebuild_with(|inner| {
            // A pool dropped from the config takes its workers with it at once.
            inner
                .discovered
                .retain(|k, _| config.worker_pools.iter().any(|p| p.prefix() == k));
            inner.config = config;
            Ok(())
        })
    }

    /// The fleet has dropped every entry of removed worker `id` (index, load, latency model,
    /// monitor): the id may be given to a new worker once nothing holds the old one's state.
    pub fn forgotten(&self, id: WorkerId) {
        if let Some((_, f)) = self.inner.lock().retired.get_mut(&id) {
            *f = true;
        }
    }

    /// Pool discovery (DNS, endpoints file, InferencePool): the workers pool `pool` (its name
    /// prefix) has now. Workers that are new get fresh state, gone ones are removed; a pool no
    /// longer in the config is ignored (a late answer from a stopped watcher must not bring its
    /// workers back).
    pub fn set_pool_members(
        &self,
        pool: &str,
        workers: Vec<WorkerConfig>,
    ) -> anyhow::Result<Rebuilt> {
        self.rebuild_with(|inner| {
            let configured = inner.config.worker_pools.iter().any(|p| p.prefix() == pool);
            if !configured || workers.is_empty() {
                inner.discovered.remove(pool);
            } else {
                inner.discovered.insert(pool.to_string(), workers);
            }
            Ok(())
        })
    }

    /// Admin: add a worker (kept across config reloads).
    pub fn add_worker(&self, w: WorkerConfig) -> anyhow::Result<Rebuilt> {
        self.rebuild_with(|inner| {
            let name = worker_name(&w);
            inner.admin_removed.remove(&name);
            inner.admin_added.retain(|x| worker_name(x) != name);
            inner.admin_added.push(w);
            Ok(())
        })
    }

    /// Admin: remove a worker by name (kept removed across config reloads).
    pub fn remove_worker(&self, name: &str) -> anyhow::Result<Rebuilt> {
        self.rebuild_with(|inner| {
            inner.admin_added.retain(|x| worker_name(x) != name);
            inner.admin_removed.insert(name.to_string());
            Ok(())
        })
    }

    /// Rebuild the snapshot, e.g. after model discovery changed a worker's model list.
    pub fn refresh(&self) -> anyhow::Result<Rebuilt> {
        self.rebuild_with(|_| Ok(()))
    }

    fn rebuild_with(
        &self,
        change: impl FnOnce(&mut RegistryInner) -> anyhow::Result<()>,
    ) -> anyhow::Result<Rebuilt> {
        let mut inner = self.inner.lock();
        let mut next = RegistryInner {
            states: inner.states.clone(),
            next_id: inner.next_id,
            // Moved, not cloned: a reusable state is one only the retired list holds.
            retired: std::mem::take(&mut inner.retired),
            generation: inner.generation,
            config: inner.config.clone(),
            admin_added: inner.admin_added.clone(),
            admin_removed: inner.admin_removed.clone(),
            discovered: inner.discovered.clone(),
            tokenizers: inner.tokenizers.clone(),
        };
        let built = change(&mut next).and_then(|()| {
            let prev = self.fleet.load_full();
            build_fleet(&mut next, &prev)
        });
        let (fleet, rebuilt) = match built {
            Ok(b) => b,
            Err(e) => {
                inner.retired = next.retired;
                return Err(e);
            }
        };
        *inner = next;
        self.fleet.store(Arc::new(fleet));
        Ok(rebuilt)
    }
}

fn build_fleet(inner: &mut RegistryInner, prev: &Fleet) -> anyhow::Result<(Fleet, Rebuilt)> {
    let cfg = inner.config.clone();
    let mut seen = HashSet::new();
    let mut wanted: Vec<WorkerConfig> = Vec::new();
    // Discovered pools in config order (so names and ids are assigned deterministically).
    let dns: Vec<&WorkerConfig> = cfg
        .worker_pools
        .iter()
        .filter_map(|p| inner.discovered.get(p.prefix()))
        .flatten()
        .collect();
    for w in cfg
        .workers
        .iter()
        .chain(inner.admin_added.iter())
        .chain(dns)
    {
        let name = worker_name(w);
        if inner.admin_removed.contains(&name) || !seen.insert(name) {
            continue;
        }
        wanted.push(w.clone());
    }
    let mut rebuilt = Rebuilt::default();
    let mut states = HashMap::new();
    let mut workers = Vec::with_capacity(wanted.len());
    for w in wanted {
        let uri: http::Uri = w.url.parse()?;
        let parts = uri.into_parts();
        let scheme = parts.scheme.unwrap_or(Scheme::HTTP);
        let authority = parts
            .authority
            .ok_or_else(|| anyhow::anyhow!("worker url {} has no host", w.url))?;
        let path_prefix = parts
            .path_and_query
            .map(|p| p.path().trim_end_matches('/').to_string())
            .unwrap_or_default();
        let name: Lbl = worker_name(&w).into();
        let state = match inner.states.get(&w.url) {
            Some(s) => s.clone(),
            None => {
                let id = inner.allocate_id();
                rebuilt.added.push((id, name.clone()));
                Arc::new(WorkerState::new(id))
            }
        };
        states.insert(w.url.clone(), state.clone());
        state
            .role_auto
            .store(w.role == RoleSetting::Auto, Ordering::Relaxed);
        let models: Vec<Lbl> = if w.models.is_empty() {
            state.discovered_models.lock().clone()
        } else {
            w.models.iter().map(|m| Lbl::from(m.as_str())).collect()
        };
        let auth_header =
            match &w.api_key {
                Some(k) => Some(http::HeaderValue::from_str(&format!("Bearer {k}")).map_err(
                    |_| anyhow::anyhow!("worker {name}: api_key has invalid characters"),
                )?),
                None => None,
            };
        workers.push(Arc::new(Worker {
            id: state.id,
            stable_id: xxhash_rust::xxh3::xxh3_64(name.as_bytes()),
            kind: w
                .kind
                .parse()
                .map_err(|e| anyhow::anyhow!("worker {name}: kind: {e}"))?,
            name,
            scheme,
            authority,
            path_prefix,
            cfg: w,
            auth_header,
            models,
            state,
        }));
    }
    for (url, s) in &inner.states {
        if !states.contains_key(url) {
            // The name it had in the previous snapshot (its config entry may be gone by now),
            // so the caller can drop the right metric series.
            let name = prev
                .workers
                .iter()
                .find(|w| &w.cfg.url == url)
                .map(|w| w.name.clone())
                .unwrap_or_else(|| Lbl::from(url.as_str()));
            rebuilt.removed.push((s.id, name));
            inner.retired.insert(s.id, (s.clone(), false));
        }
    }
    inner.states = states;

    let mut pools: HashMap<Lbl, Arc<Pool>> = HashMap::new();
    let mut by_model: HashMap<Lbl, Vec<Arc<Worker>>> = HashMap::new();
    for w in &workers {
        for m in &w.models {
            by_model.entry(m.clone()).or_default().push(w.clone());
        }
    }
    let mut tokenizers = HashMap::new();
    for (model, ws) in by_model {
        let mcfg = cfg.models.get(&*model);
        let spec = mcfg
            .and_then(|m| m.tokenizer.clone())
            .or_else(|| cfg.routing.tokenizer.clone())
            .unwrap_or_default();
        let key = format!("{spec:?}");
        let tokenizer = match inner.tokenizers.get(&key) {
            Some(t) => t.clone(),
            None => Arc::new(
                spec.load()
                    .map_err(|e| anyhow::anyhow!("tokenizer of model {model}: {e}"))?,
            ),
        };
        // `[cache]` is reloadable: an unchanged bound is a no-op, a smaller one evicts now.
        tokenizer
            .tokenizer()
            .set_segment_cache_budget(cfg.cache.tokenizer_segment_bytes);
        tokenizers.insert(key, tokenizer.clone());
        let pool = Arc::new(Pool::new(
            model.clone(),
            ws,
            mcfg.and_then(|m| m.block_size)
                .unwrap_or(cfg.routing.block_size),
            tokenizer,
        ));
        if let Some(mc) = mcfg {
            for alias in &mc.aliases {
                pools
                    .entry(Lbl::from(alias.as_str()))
                    .or_insert_with(|| pool.clone());
            }
        }
        pools.insert(model, pool);
    }
    inner.tokenizers = tokenizers;
    inner.generation += 1;
    Ok((Fleet::new(workers, pools, inner.generation), rebuilt))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(workers: &[(&str, &[&str])]) -> Arc<Config> {
        let mut c = Config::default();
        for (url, models) in workers {
            let mut w = WorkerConfig::from_url(url);
            w.models = models.iter().map(|s| s.to_string()).collect();
            c.workers.push(w);
        }
        Arc::new(c)
    }

    /// Workers are found by name in O(1) in every snapshot; unknown names are not.
    #[test]
    fn snapshot_finds_workers_by_name() {
        let (reg, _) =
            Registry::new(cfg(&[("http://a:1", &["m"]), ("http://b:1", &["m", "n"])])).unwrap();
        let fleet = reg.snapshot();
        for w in &fleet.workers {
            assert!(Arc::ptr_eq(fleet.named(&w.name).unwrap(), w));
        }
        assert!(fleet.named("http://c:1").is_none());
        // Assembled by hand (no name table): still found, by a search.
        let by_hand = Fleet {
            workers: fleet.workers.clone(),
            ..Fleet::default()
        };
        assert_eq!(
            by_hand.named(&fleet.workers[1].name).unwrap().id,
            fleet.workers[1].id
        );
    }

    #[test]
    fn reload_keeps_state_of_surviving_workers() {
        let (reg, r) =
            Registry::new(cfg(&[("http://a:1", &["m"]), ("http://b:1", &["m", "n"])])).unwrap();
        assert_eq!(r.added.len(), 2);
        let a = reg.snapshot().workers[0].state.clone();
        a.inflight.store(3, Ordering::Relaxed);
        let r = reg
            .set_config(cfg(&[("http://a:1", &["m"]), ("http://c:1", &["n"])]))
            .unwrap();
        assert_eq!(r.removed.len(), 1);
        assert_eq!(r.added.len(), 1);
        let f = reg.snapshot();
        assert!(Arc::ptr_eq(&f.workers[0].state, &a));
        assert_eq!(f.pool("n").unwrap().workers.len(), 1);
        assert_eq!(
            f.workers[1].id,
            WorkerId(2),
            "b's id is not reused while the fleet has not forgotten it"
        );
        reg.remove_worker("a:1").unwrap();
        assert!(reg.snapshot().pool("m").is_none());
    }

    #[test]
    fn a_churning_dns_pool_reuses_the_ids_of_forgotten_workers() {
        let mut c = (*cfg(&[])).clone();
        c.worker_pools =
            Config::from_toml("[[worker_pools]]\ndns = \"svc:80\"\nmodels = [\"m\"]\n")
                .unwrap()
                .worker_pools;
        let (reg, _) = Registry::new(Arc::new(c.clone())).unwrap();
        let p = c.worker_pools[0].clone();
        let at = |i: u32| p.worker_for(format!("10.0.{}.{}:80", i / 250, i % 250).parse().unwrap());
        // 4 pods, replaced one by one 200 times (a rolling restart that never ends): 204
        // distinct workers over time, never more than 4 at once.
        let mut pods: Vec<u32> = (0..4).collect();
        let mut held = Vec::new();
        for round in 0..200u32 {
            if round == 100 {
                // In-flight requests still hold the workers of this moment: the one removed
                // next keeps its id until they end.
                held = reg.snapshot().workers.clone();
            }
            let r = reg
                .set_pool_members("svc", pods.iter().map(|&i| at(i)).collect())
                .unwrap();
            for (id, _) in &r.removed {
                reg.forgotten(*id);
            }
            pods[(round % 4) as usize] = 4 + round;
        }
        let f = reg.snapshot();
        assert_eq!(f.workers.len(), 4);
        let ids: Vec<u32> = f.workers.iter().map(|w| w.id.0).collect();
        // 4 live workers, the 4 still held, and one removed in the last round that the fleet had
        // not forgotten when its successor came: 9 ids at most (without reuse: 204).
        assert!(
            ids.iter().all(|&i| i < 9),
            "ids stay as small as the pool: {ids:?}"
        );
        let gone: Vec<&Arc<Worker>> = held
            .iter()
            .filter(|h| !f.workers.iter().any(|w| Arc::ptr_eq(&w.state, &h.state)))
            .collect();
        assert!(!gone.is_empty());
        for h in gone {
            assert!(
                !ids.contains(&h.id.0),
                "{} is still held: its id is not reused",
                h.id
            );
        }
    }

    #[test]
    fn a_removed_worker_still_in_use_keeps_its_id() {
        let (reg, _) =
            Registry::new(cfg(&[("http://a:1", &["m"]), ("http://b:1", &["m"])])).unwrap();
        let b = reg.snapshot().workers[1].clone();
        assert_eq!(b.id, WorkerId(1));
        let r = reg.set_config(cfg(&[("http://a:1", &["m"])])).unwrap();
        assert_eq!(r.removed[0].0, WorkerId(1));
        reg.forgotten(WorkerId(1));
        // `b` (an in-flight request's worker) is alive: the new worker gets a new id.
        let r = reg
            .set_config(cfg(&[("http://a:1", &["m"]), ("http://c:1", &["m"])]))
            .unwrap();
        assert_eq!(r.added[0].0, WorkerId(2));
        drop(b);
        let r = reg
            .set_config(cfg(&[
                ("http://a:1", &["m"]),
                ("http://c:1", &["m"]),
                ("http://d:1", &["m"]),
            ]))
            .unwrap();
        assert_eq!(
            r.added[0].0,
            WorkerId(1),
            "the lowest free id, once nothing holds it"
        );
    }

    #[test]
    fn dns_pool_adds_and_removes_workers_keeping_survivors_state() {
        let mut c = (*cfg(&[("http://static:1", &["m"])])).clone();
        c.worker_pools =
            Config::from_toml("[[worker_pools]]\ndns = \"svc:80\"\nmodels = [\"m\"]\n")
                .unwrap()
                .worker_pools;
        let (reg, _) = Registry::new(Arc::new(c.clone())).unwrap();
        let p = c.worker_pools[0].clone();
        let at = |a: &str| p.worker_for(a.parse().unwrap());
        let r = reg
            .set_pool_members("svc", vec![at("10.0.0.1:80"), at("10.0.0.2:80")])
            .unwrap();
        assert_eq!(r.added.len(), 2);
        assert_eq!(reg.snapshot().pool("m").unwrap().workers.len(), 3);
        let kept = reg.snapshot().workers[1].state.clone();
        assert_eq!(&*reg.snapshot().workers[1].name, "svc-10.0.0.1:80");
        kept.inflight.store(2, Ordering::Relaxed);
        let r = reg
            .set_pool_members("svc", vec![at("10.0.0.1:80"), at("10.0.0.3:80")])
            .unwrap();
        assert_eq!(
            r.added.iter().map(|(_, n)| &**n).collect::<Vec<_>>(),
            ["svc-10.0.0.3:80"]
        );
        assert_eq!(
            r.removed.iter().map(|(_, n)| &**n).collect::<Vec<_>>(),
            ["svc-10.0.0.2:80"]
        );
        assert!(Arc::ptr_eq(&reg.snapshot().workers[1].state, &kept));
        // A pool that is not (or no longer) configured cannot add workers.
        assert!(reg
            .set_pool_members("other", vec![at("10.0.0.9:80")])
            .unwrap()
            .added
            .is_empty());
        let mut c2 = c.clone();
        c2.worker_pools.clear();
        let r = reg.set_config(Arc::new(c2)).unwrap();
        assert_eq!(r.removed.len(), 2);
        assert!(reg
            .set_pool_members("svc", vec![at("10.0.0.1:80")])
            .unwrap()
            .added
            .is_empty());
        assert_eq!(reg.snapshot().workers.len(), 1);
    }

    #[test]
    fn breaker_opens_and_half_opens() {
        let s = WorkerState::new(WorkerId(0));
        let cfg = s.breaker.config();
        let t0 = crate::clock::now();
        for _ in 0..cfg.failure_threshold {
            assert!(s.routable(t0));
            s.record_outcome(false, t0);
        }
        assert_eq!(s.breaker_state(t0), BreakerState::Open);
        assert!(!s.routable(t0));
        let later = t0 + cfg.open_for;
        assert_eq!(s.breaker_state(later), BreakerState::HalfOpen);
        assert!(s.routable(later), "half-open lets traffic probe the worker");
        s.record_outcome(false, later);
        assert_eq!(s.breaker_state(later), BreakerState::Open);
        s.record_outcome(true, later);
        assert_eq!(s.breaker_state(later), BreakerState::Closed);
    }

    #[test]
    fn request_and_probe_failures_share_one_run() {
        let s = WorkerState::new(WorkerId(0));
        let t0 = crate::clock::now();
        let n = s.breaker.config().failure_threshold;
        for _ in 0..n - 1 {
            s.record_outcome(false, t0);
        }
        // The monitor's health checker feeds the same breaker: one failed probe completes the run.
        assert!(s.breaker.record_failure(t0));
        assert!(!s.routable(t0));
    }
}
