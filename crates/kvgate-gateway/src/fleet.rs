//! The worker fleet as one component: the registry (config + discovered workers → snapshot), the
//! router (policy, KV index, active load, latency model) and the kvgate-fleet monitors
//! (`fleet/monitors.rs`) that feed both. Every change to the set of workers (config reload, model
//! discovery, discovered pools, the admin API) goes through [`WorkerFleet::apply_rebuild`], so the index,
//! the monitors and the per-worker metric series follow the snapshot in one place.

mod gpu;
mod monitors;

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use monitors::{pool_block_size, GatewaySink, Monitors};

use crate::config::Config;
use crate::forward::Upstream;
use crate::metrics::{Metrics, WorkerLabel};
use crate::registry::{Rebuilt, Registry};
use crate::route::admission::Admission;
use crate::route::router::{RoutePolicy, Router};

pub struct WorkerFleet {
    pub registry: Registry,
    pub router: Arc<Router>,
    /// kvgate-fleet monitors (scrape, KV events, health) per worker; off with `upstream.monitor = false`.
    pub monitors: Monitors,
    /// The client to workers (model discovery, the monitors' TLS).
    upstream: Arc<Upstream>,
    /// Per-worker series are removed with their worker.
    metrics: Arc<Metrics>,
    pub shutdown: CancellationToken,
    monitor_workers: bool,
    me: Weak<WorkerFleet>,
}

impl WorkerFleet {
    pub fn new(
        config: Arc<Config>,
        upstream: Arc<Upstream>,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Arc<WorkerFleet>> {
        let admission = Arc::new(
            Admission::new(
                config.admission.queue_size,
                Duration::from_millis(config.admission.queue_timeout_ms),
            )
            .with_counters(
                metrics.flow.cluster_deferrals.clone(),
                metrics.flow.cluster_fallback.clone(),
            ),
        );
        let router = Arc::new(Router::new(
            RoutePolicy::from_config(&config.routing, &config.slo, &config.pd)?,
            admission,
        ));
        let (registry, rebuilt) = Registry::new(config.clone())?;
        let fleet = Arc::new_cyclic(|me| WorkerFleet {
            registry,
            router,
            monitors: Monitors::default(),
            upstream,
            metrics,
            shutdown,
            monitor_workers: config.upstream.monitor,
            me: me.clone(),
        });
        fleet.apply_rebuild(&rebuilt);
        Ok(fleet)
    }

    /// A reloaded config: workers and the routing policy.
    pub fn apply_config(&self, config: Arc<Config>) -> anyhow::Result<()> {
        let policy = RoutePolicy::from_config(&config.routing, &config.slo, &config.pd)?;
        let rebuilt = self.registry.set_config(config)?;
        self.apply_rebuild(&rebuilt);
        self.router.set_policy(policy);
        Ok(())
    }

    /// Register new workers with the index and start their monitors; forget removed ones.
    pub fn apply_rebuild(&self, r: &Rebuilt) {
        let fleet = self.registry.snapshot();
        let cfg = self.registry.config();
        let me = self.me.upgrade();
        for (id, _) in &r.added {
            let exact = fleet.worker(*id).is_some_and(|w| w.cfg.kv_events.is_some());
            let kind = fleet.worker(*id).map_or(Default::default(), |w| w.kind);
            self.router.add_worker(*id, exact, kind, &cfg.routing);
            if let (true, Some(me), Some(w)) = (self.monitor_workers, &me, fleet.worker(*id)) {
                self.monitors.start(me, w, &cfg);
            }
        }
        if let (true, Some(me)) = (self.monitor_workers, &me) {
            self.monitors.resync(me, &fleet, &cfg);
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
                    me.discover().await;
                });
            }
        }
        for (id, name) in &r.removed {
            self.monitors.stop(*id);
            self.router.remove_worker(*id);
            self.registry.forgotten(*id);
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
            m.worker_recovery.remove(&l);
            crate::cost::forget(m, &l);
            for role in crate::metrics::ROLE_LABELS {
                m.pd.worker_role.remove(&crate::metrics::WorkerRoleLabels {
                    worker: name.clone(),
                    role,
                });
            }
        }
    }

    /// One model discovery round (`GET /v1/models` of every worker without a configured list);
    /// a change rebuilds the snapshot. Returns whether anything changed.
    pub async fn discover(&self) -> bool {
        let Some(rebuild) = crate::discovery::refresh_once(&self.registry, &self.upstream).await
        else {
            return false;
        };
        match rebuild {
            Ok(r) => self.apply_rebuild(&r),
            Err(e) => tracing::warn!(error = %e, "fleet rebuild after discovery failed"),
        }
        true
    }

    /// Re-run discovery every `every` until shutdown.
    pub async fn run_discovery(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every.max(Duration::from_secs(1)));
        tick.tick().await;
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tick.tick() => { self.discover().await; }
            }
        }
    }

    /// The metrics registry (discovered pools count their members and failures in it).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Set the `kvgate_worker_*` families from the monitors (called by `GET /metrics`).
    pub fn export_monitors(&self) {
        self.monitors.export(self, &self.metrics);
    }
}
