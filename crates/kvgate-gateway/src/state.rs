//! `AppState`: everything the request path shares, built once at start and updated in place on
//! reload (each reloadable part is an `ArcSwap` or atomics).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use crate::admission::Admission;
use crate::auth::Auth;
use crate::config::{Config, SloConfig};
use crate::forward::RetryBudget;
use crate::metrics::{Lbl, Metrics, WorkerLabel};
use crate::registry::{Rebuilt, Registry};
use crate::router::{RoutePolicy, Router};

pub struct AppState {
    pub registry: Registry,
    pub metrics: Metrics,
    pub router: Router,
    pub admission: Arc<Admission>,
    /// Settings of the client to workers (requests, model discovery).
    pub upstream: kvgate_http::client::Settings,
    /// Connections of the control plane's requests to workers (model discovery), on the main
    /// runtime; the data path uses its io thread's pool.
    pub control_pool: kvgate_http::client::Pool,
    pub auth: ArcSwap<Auth>,
    pub retry: RetryBudget,
    pub max_attempts: AtomicU32,
    pub slo: ArcSwap<SloConfig>,
    pub request_log: bool,
    pub max_body: usize,
    /// Time to the worker's response head, any request (`upstream.response_timeout_s`).
    pub response_timeout: Duration,
    /// Non-streaming: the whole response (`upstream.request_timeout_s`).
    pub request_timeout: Duration,
    /// Streaming: head and first body byte (`upstream.stream_first_byte_timeout_s`).
    pub first_byte_timeout: Duration,
    /// Set on SIGTERM before the listener closes: `/ready` answers 503 while requests are still
    /// served (`server.drain_delay_s`).
    pub draining: std::sync::atomic::AtomicBool,
    pub stream_idle_timeout: Option<Duration>,
    pub unknown_model: Lbl,
    pub no_worker: Lbl,
    pub tokens_served: AtomicU64,
    pub started: Instant,
    pub shutdown: CancellationToken,
    /// kvgate-fleet monitors (scrape, KV events, health) per worker; off with `upstream.monitor = false`.
    pub monitors: crate::fleet::Monitors,
    monitor_workers: bool,
    me: Weak<AppState>,
}

/// Certificates for `https://` workers: `upstream.ca_file` (must load), else the system bundle
/// (must load only if an https worker is configured; workers added later by a reload find out at
/// connect time, with the reason in the error).
fn worker_tls(config: &Config) -> anyhow::Result<Option<kvgate_http::client::Tls>> {
    let ca_file = config.upstream.ca_file.as_deref();
    match kvgate_http::client::Tls::load(ca_file) {
        Ok(t) => Ok(Some(t)),
        Err(e) if ca_file.is_some() => Err(anyhow::anyhow!("upstream.ca_file: {e}")),
        Err(e)
            if config.workers.iter().any(|w| {
                w.url
                    .parse::<http::Uri>()
                    .is_ok_and(|u| u.scheme() == Some(&http::uri::Scheme::HTTPS))
            }) =>
        {
            Err(anyhow::anyhow!("https workers: {e}"))
        }
        Err(e) => {
            tracing::debug!(error = %e, "no CA certificates for https workers");
            Ok(None)
        }
    }
}

impl AppState {
    pub fn new(config: Arc<Config>, shutdown: CancellationToken) -> anyhow::Result<Arc<Self>> {
        let metrics = Metrics::new();
        let router = Router::new(RoutePolicy::from_config(&config.routing, &config.slo)?);
        let (registry, rebuilt) = Registry::new(config.clone())?;
        let tls = worker_tls(&config)?;
        let app = Arc::new_cyclic(|me| AppState {
            registry,
            router,
            admission: Arc::new(Admission::new(
                config.admission.queue_size,
                Duration::from_millis(config.admission.queue_timeout_ms),
            )),
            control_pool: kvgate_http::client::Pool::default(),
            upstream: kvgate_http::client::Settings {
                connect_timeout: Duration::from_millis(config.upstream.connect_timeout_ms),
                idle_timeout: Duration::from_secs(config.upstream.pool_idle_timeout_s),
                max_idle_per_host: config.upstream.pool_max_idle_per_host,
                on_connect: Some({
                    let h = metrics.upstream_connect.clone();
                    Arc::new(move |d: Duration| h.observe(d.as_secs_f64()))
                }),
                on_stray: Some({
                    let c = metrics.upstream_stray.clone();
                    Arc::new(move |_: &http::uri::Authority| {
                        c.inc();
                    })
                }),
                tls,
            },
            auth: ArcSwap::from_pointee(Auth::from_config(&config.auth)),
            retry: RetryBudget::new(
                config.retry.budget_ratio,
                config.retry.budget_min_per_window,
            ),
            max_attempts: AtomicU32::new(config.retry.max_attempts),
            slo: ArcSwap::from_pointee(config.slo.clone()),
            request_log: config.server.request_log,
            max_body: config.server.max_body_bytes,
            response_timeout: Duration::from_secs(config.upstream.response_timeout_s),
            request_timeout: Duration::from_secs(config.upstream.request_timeout_s),
            first_byte_timeout: Duration::from_secs(config.upstream.stream_first_byte_timeout_s),
            draining: std::sync::atomic::AtomicBool::new(false),
            stream_idle_timeout: (config.upstream.stream_idle_timeout_s > 0)
                .then(|| Duration::from_secs(config.upstream.stream_idle_timeout_s)),
            unknown_model: Lbl::from("unknown"),
            no_worker: Lbl::from("none"),
            tokens_served: AtomicU64::new(0),
            started: Instant::now(),
            shutdown,
            metrics,
            monitors: Default::default(),
            monitor_workers: config.upstream.monitor,
            me: me.clone(),
        });
        app.apply_rebuild(&rebuilt);
        Ok(app)
    }

    /// Register new workers with the index, forget removed ones.
    pub fn apply_rebuild(&self, r: &Rebuilt) {
        let fleet = self.registry.snapshot();
        let cfg = self.registry.config();
        let me = self.me.upgrade();
        for (id, _) in &r.added {
            let exact = fleet.worker(*id).is_some_and(|w| w.cfg.kv_events.is_some());
            let kind = fleet.worker(*id).map_or("vllm", |w| w.cfg.kind.as_str());
            self.router.add_worker(*id, exact, kind, &cfg.routing);
            if let (true, Some(me), Some(w)) = (self.monitor_workers, &me, fleet.worker(*id)) {
                self.monitors.start(me, w, &cfg);
            }
        }
        if let (true, Some(me)) = (self.monitor_workers, &me) {
            self.monitors.resync_block_sizes(me, &fleet, &cfg);
        }
        // New workers without a models list: ask them now, not at the next refresh tick.
        let undiscovered = r
            .added
            .iter()
            .any(|(id, _)| fleet.worker(*id).is_some_and(|w| w.cfg.models.is_empty()));
        if let (true, Some(me)) = (undiscovered, &me) {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let me = me.clone();
                rt.spawn(async move {
                    crate::discovery::refresh_once(&me).await;
                });
            }
        }
        for (id, name) in &r.removed {
            self.monitors.stop(*id);
            self.router.remove_worker(*id);
            let l = WorkerLabel {
                worker: name.clone(),
            };
            let m = &self.metrics;
            m.inflight.remove(&l);
            m.active_blocks.remove(&l);
            m.pending_prefill.remove(&l);
            m.predicted_ttft.remove(&l);
            m.prefill_throughput.remove(&l);
            m.worker_healthy.remove(&l);
            m.worker_breaker.remove(&l);
        }
    }

    /// Apply a reloaded config: workers, policy, admission, retries, SLOs, keys. Listener, TLS,
    /// limits and the admin listener need a restart.
    pub fn apply_config(&self, config: Arc<Config>) -> anyhow::Result<()> {
        let policy = RoutePolicy::from_config(&config.routing, &config.slo)?;
        let rebuilt = self.registry.set_config(config.clone())?;
        self.apply_rebuild(&rebuilt);
        self.router.policy.store(Arc::new(policy));
        self.admission
            .max_len
            .store(config.admission.queue_size, Ordering::Relaxed);
        self.admission
            .timeout_ms
            .store(config.admission.queue_timeout_ms, Ordering::Relaxed);
        self.retry.ratio_milli.store(
            (config.retry.budget_ratio * 1000.0) as u32,
            Ordering::Relaxed,
        );
        self.retry
            .min
            .store(config.retry.budget_min_per_window, Ordering::Relaxed);
        self.max_attempts
            .store(config.retry.max_attempts, Ordering::Relaxed);
        self.slo.store(Arc::new(config.slo.clone()));
        self.auth.store(Arc::new(Auth::from_config(&config.auth)));
        Ok(())
    }

    /// Bring scrape-time gauges up to date (called by `/metrics`).
    pub fn refresh_gauges(&self) {
        let m = &self.metrics;
        let now = Instant::now();
        let fleet = self.registry.snapshot();
        let loads = self.router.active.all();
        let latency = self.router.latency.lock().clone();
        let curve = self.router.policy.load().latency.curve;
        let mut dollars_total = 0.0;
        for w in &fleet.workers {
            let l = WorkerLabel {
                worker: w.name.clone(),
            };
            let load = loads
                .iter()
                .find(|(id, _)| *id == w.id)
                .map(|(_, l)| *l)
                .unwrap_or_default();
            m.inflight
                .get_or_create(&l)
                .set(i64::from(w.state.inflight.load(Ordering::Relaxed)));
            m.active_blocks
                .get_or_create(&l)
                .set(i64::from(load.active_blocks));
            m.pending_prefill
                .get_or_create(&l)
                .set(load.pending_prefill_tokens as i64);
            if let Some(fit) = latency.fit(w.id) {
                m.predicted_ttft
                    .get_or_create(&l)
                    .set(fit.last_predicted_ms / 1000.0);
                m.prefill_throughput
                    .get_or_create(&l)
                    .set(latency.prefill_tokens_per_second(&curve, w.id, 1024.0));
            }
            m.worker_healthy
                .get_or_create(&l)
                .set(i64::from(w.state.routable(now)));
            m.worker_breaker
                .get_or_create(&l)
                .set(crate::registry::breaker_gauge(w.state.breaker_state(now)));
            // Cost accrues while the worker is in the fleet; add what accrued since last scrape.
            let alive_ms = now.duration_since(w.state.added).as_millis() as u64;
            let prev = w.state.cost_accrued_ms.swap(alive_ms, Ordering::Relaxed);
            let c = m.cost_dollars.get_or_create(&l);
            if w.cfg.cost_per_hour > 0.0 && alive_ms > prev {
                c.inc_by(w.cfg.cost_per_hour * (alive_ms - prev) as f64 / 3_600_000.0);
            }
            dollars_total += c.get();
        }
        let tokens = self.tokens_served.load(Ordering::Relaxed) as f64;
        m.tokens_per_dollar.set(if dollars_total > 0.0 {
            tokens / dollars_total
        } else {
            0.0
        });
        let index_entries = {
            let index = self.router.index.read();
            m.index_blocks.set(index.total_entries() as i64);
            m.index_predicted_blocks
                .set(index.predicted_entries() as i64);
            index.total_entries()
        };
        // Pools that share a tokenizer spec share one tokenizer (and its caches): count it once.
        let mut seen: Vec<*const kvgate_tokenize::ModelTokenizer> = Vec::new();
        let mut caches = kvgate_tokenize::CacheStats::default();
        for pool in fleet.pools.values() {
            let p = Arc::as_ptr(&pool.tokenizer);
            if seen.contains(&p) {
                continue;
            }
            seen.push(p);
            let s = pool.tokenizer.tokenizer().cache_stats();
            caches.segment_entries += s.segment_entries;
            caches.segment_bytes += s.segment_bytes;
            caches.word_entries += s.word_entries;
            caches.word_bytes += s.word_bytes;
        }
        m.set_cache(
            "tokenizer_segments",
            caches.segment_entries,
            Some(caches.segment_bytes),
        );
        m.set_cache(
            "tokenizer_words",
            caches.word_entries,
            Some(caches.word_bytes),
        );
        m.set_cache("kv_index", index_entries, None);
        m.queue_depth.set(self.admission.len() as i64);
    }
}
