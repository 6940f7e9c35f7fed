//! The integration point with kvgate-fleet: one `WorkerMonitor` per worker (scraper, KV-event
//! subscriber, health checks), reporting through [`GatewaySink`] into the worker's registry state
//! and the router's KV index. Monitors start and stop with the fleet snapshot (config reload,
//! admin add/remove).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use kvgate_core::{IndexMode, WorkerId};
use kvgate_fleet::{
    FleetSink, KvEventsSource, KvSource, MonitorConfig, MonitorHandle, ResetReason, ScrapedLoad,
    WorkerKind,
};
use kvgate_protocol::kv_events::KvEventBatch;
use parking_lot::Mutex;

use crate::registry::Worker;
use crate::state::AppState;

/// Running monitors by worker.
#[derive(Default)]
pub struct Monitors {
    running: Mutex<HashMap<WorkerId, MonitorHandle>>,
}

impl Monitors {
    pub fn start(&self, app: &Arc<AppState>, w: &Worker, block_size: u32) {
        let kind: WorkerKind = w.cfg.kind.parse().unwrap_or_default();
        let base = format!("{}://{}{}", w.scheme, w.authority, w.path_prefix);
        let mut mc = MonitorConfig::new(w.id, base, kind);
        mc.name = w.name.to_string();
        mc.block_size = Some(block_size);
        if let Some(ep) = &w.cfg.kv_events {
            mc.kv_events = KvEventsSource::Endpoints(vec![KvSource {
                endpoint: ep.clone(),
                replay_endpoint: None,
                topic: String::new(),
            }]);
        }
        let sink = Arc::new(GatewaySink {
            app: Arc::downgrade(app),
            block_size,
        });
        let h = kvgate_fleet::WorkerMonitor::spawn(mc, sink);
        self.running.lock().insert(w.id, h);
    }

    /// Stop a removed worker's monitor (dropping the handle cancels its tasks).
    pub fn stop(&self, id: WorkerId) {
        self.running.lock().remove(&id);
    }

    pub fn stop_all(&self) {
        self.running.lock().clear();
    }
}

/// Feeds monitor reports into the gateway. Holds the state weakly: the monitors are owned by it.
pub struct GatewaySink {
    app: Weak<AppState>,
    block_size: u32,
}

impl GatewaySink {
    fn with(&self, id: WorkerId, f: impl FnOnce(&AppState, &Worker)) {
        if let Some(app) = self.app.upgrade() {
            let fleet = app.registry.snapshot();
            if let Some(w) = fleet.worker(id) {
                f(&app, w);
            }
        }
    }
}

impl FleetSink for GatewaySink {
    fn on_load(&self, worker: WorkerId, load: &ScrapedLoad) {
        self.with(worker, |app, w| {
            *w.state.scraped.lock() = load
                .core()
                .map(|l| (load.scraped_at.unwrap_or_else(Instant::now), l));
            // Size the approximate index like the worker's real cache.
            if let Some(n) = load.num_gpu_blocks {
                let mut index = app.router.index.write();
                if matches!(index.mode(worker), Some(IndexMode::Approximate(_))) {
                    index.set_capacity(worker, n as usize);
                }
            }
        });
    }

    fn on_load_stale(&self, worker: WorkerId) {
        self.with(worker, |_, w| *w.state.scraped.lock() = None);
    }

    fn on_block_size(&self, worker: WorkerId, engine: u32, configured: u32) {
        self.with(worker, |_, w| {
            tracing::error!(worker = %w.name, engine, configured, "KV block size mismatch: worker excluded from KV scoring (still load-balanced)");
            w.state.kv_scoring.store(false, Ordering::Relaxed);
        });
    }

    fn on_kv_events(&self, worker: WorkerId, batch: &KvEventBatch) {
        self.with(worker, |app, _| {
            let mut index = app.router.index.write();
            // Events prove the worker publishes: switch it from the approximate to the exact index.
            if !matches!(index.mode(worker), Some(IndexMode::Exact)) {
                index.set_mode(worker, IndexMode::Exact);
            }
            kvgate_fleet::apply_batch(&mut index, worker, batch, self.block_size);
        });
    }

    fn on_kv_reset(&self, worker: WorkerId, reason: ResetReason) {
        self.with(worker, |app, w| {
            tracing::warn!(worker = %w.name, reason = reason.as_str(), "KV index entries of worker dropped");
            app.router.index.write().clear_worker(worker);
        });
    }

    fn on_health(&self, worker: WorkerId, up: bool) {
        self.with(worker, |_, w| {
            if w.state.healthy.swap(up, Ordering::Relaxed) != up {
                tracing::warn!(worker = %w.name, up, "worker health changed");
            }
        });
    }
}
