//! `AppState`: the gateway's components side by side, built once at start from their config
//! slices and updated in place on reload (each reloadable part is an `ArcSwap` or atomics).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use crate::auth::Auth;
use crate::config::Config;
use crate::ctx::Telemetry;
use crate::fleet::WorkerFleet;
use crate::forward::Upstream;
use crate::metrics::{Metrics, WorkerLabel, ROLE_LABELS};
use crate::route::admission::Admission;
use crate::route::Decider;

/// The gateway's components, each built from its own config slice. The request path and the
/// control plane take the component they need (the proxy its `proxy::Proxy` slice, the decision
/// component its router); only the route table (`server.rs`, `api/`), the admin API and the
/// config reload see them all.
pub struct AppState {
    /// Workers, router, monitors (`[[workers]]`, `[[worker_pools]]`, `[models]`, `[routing]`).
    pub fleet: Arc<WorkerFleet>,
    /// The proxy hop: client, time limits, retries (`[upstream]`, `[retry]`).
    pub upstream: Arc<Upstream>,
    /// What requests are recorded into (`[slo]`, `server.request_log`).
    pub telemetry: Arc<Telemetry>,
    pub metrics: Arc<Metrics>,
    /// The busy-fleet queue (`[admission]`).
    pub admission: Arc<Admission>,
    /// API keys and rate limits (`[auth]`).
    pub auth: Arc<ArcSwap<Auth>>,
    /// Cluster mode (`[cluster]`): the NATS membership; `None` when off.
    pub cluster: Option<Arc<kvgate_cluster::Cluster>>,
    /// `server.max_body_bytes`.
    pub max_body: usize,
    /// Set on SIGTERM before the listener closes: `/ready` answers 503 while requests are still
    /// served (`server.drain_delay_s`).
    pub draining: AtomicBool,
    pub shutdown: CancellationToken,
    /// The decision component (router, admission, `[pd]` plans) every front end asks.
    pub decider: Arc<Decider>,
    /// The proxy front end's slice of the above (the OpenAI endpoints' request path).
    pub proxy: Arc<crate::proxy::Proxy>,
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
        let metrics = Arc::new(Metrics::new());
        let upstream = Arc::new(Upstream::new(
            &config.upstream,
            &config.retry,
            worker_tls(&config)?,
            &metrics,
        ));
        let fleet = WorkerFleet::new(
            config.clone(),
            upstream.clone(),
            metrics.clone(),
            shutdown.clone(),
        )?;
        let auth = Arc::new(ArcSwap::from_pointee(Auth::from_config(&config.auth)));
        let pins = Arc::new(crate::pins::ResponsePins::new(
            &config.response_pins,
            metrics.response_pins.clone(),
        ));
        let cluster = match crate::cluster::config(&config.cluster)? {
            Some(c) => Some(crate::cluster::start(
                c,
                std::time::Duration::from_millis(config.cluster.provisional_window_ms),
                fleet.clone(),
                auth.clone(),
                pins.clone(),
                metrics.cluster.clone(),
            )?),
            None => None,
        };
        let decider = Arc::new(Decider::new(
            fleet.router.clone(),
            &config.pd,
            metrics.clone(),
            shutdown.clone(),
        ));
        let proxy = Arc::new(crate::proxy::Proxy {
            decider: decider.clone(),
            fleet: fleet.clone(),
            upstream: upstream.clone(),
            metrics: metrics.clone(),
            auth: auth.clone(),
            pins,
            max_body: config.server.max_body_bytes,
            shutdown: shutdown.clone(),
        });
        Ok(Arc::new(AppState {
            proxy,
            cluster,
            admission: fleet.router.admission().clone(),
            fleet,
            upstream,
            telemetry: Arc::new(Telemetry::new(
                metrics.clone(),
                &config.slo,
                config.server.request_log,
            )),
            auth,
            max_body: config.server.max_body_bytes,
            draining: AtomicBool::new(false),
            shutdown,
            metrics,
            decider,
        }))
    }

    /// Apply a reloaded config: workers, policy, admission, retries, SLOs, keys. Listener, TLS,
    /// limits and the admin listener need a restart.
    pub fn apply_config(&self, config: Arc<Config>) -> anyhow::Result<()> {
        self.fleet.apply_config(config.clone())?;
        self.admission.configure(
            config.admission.queue_size,
            std::time::Duration::from_millis(config.admission.queue_timeout_ms),
        );
        self.upstream.apply_retry(&config.retry);
        self.telemetry.slo.store(Arc::new(config.slo.clone()));
        self.decider.set_pd(&config.pd);
        self.auth.store(Arc::new(Auth::from_config(&config.auth)));
        Ok(())
    }

    /// Bring scrape-time gauges up to date (called by `/metrics`).
    pub fn refresh_gauges(&self) {
        let m = &self.metrics;
        let now = crate::clock::now();
        let router = &self.fleet.router;
        let fleet = self.fleet.registry.snapshot();
        let loads = router.active().all();
        let latency = router.latency_snapshot();
        let curve = router.policy().latency.curve;
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
            // One series per worker: an `auto` worker's `unknown` gives way to its detected role.
            let role = w.role_label();
            for other in ROLE_LABELS.into_iter().filter(|r| *r != role) {
                m.pd.worker_role.remove(&crate::metrics::WorkerRoleLabels {
                    worker: w.name.clone(),
                    role: other,
                });
            }
            m.pd.worker_role
                .get_or_create(&crate::metrics::WorkerRoleLabels {
                    worker: w.name.clone(),
                    role,
                })
                .set(1);
            m.worker_breaker
                .get_or_create(&l)
                .set(crate::registry::breaker_gauge(w.state.breaker_state(now)));
        }
        let dollars_total = crate::cost::accrue(&fleet, m, now);
        let tokens = self.telemetry.tokens_served.load(Ordering::Relaxed) as f64;
        m.tokens_per_dollar.set(if dollars_total > 0.0 {
            tokens / dollars_total
        } else {
            0.0
        });
        let index_entries = router.with_index(|index| {
            m.index_blocks.set(index.total_entries() as i64);
            m.index_predicted_blocks
                .set(index.predicted_entries() as i64);
            index.total_entries()
        });
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
