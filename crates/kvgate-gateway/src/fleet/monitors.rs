//! One kvgate-fleet `WorkerMonitor` per worker (scraper, KV-event
//! subscriber, health checks), reporting through [`GatewaySink`] into the worker's registry state
//! and the router's KV index. Monitors start and stop with the fleet snapshot (config reload,
//! admin add/remove). The latest worker-reported figures and the monitors' counters are
//! re-exported as `kvgate_worker_*` metrics at scrape time ([`Monitors::export`]), so recording
//! costs nothing per event.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use kvgate_core::{IndexMode, WorkerId};
use kvgate_fleet::{
    FleetSink, KvEventsSource, KvSource, MonitorConfig, MonitorHandle, ResetReason, ScrapedLoad,
    WorkerKind,
};
use kvgate_protocol::kv_events::KvEventBatch;
use parking_lot::Mutex;

use super::WorkerFleet;
use crate::config::Config;
use crate::metrics::{Lbl, Metrics, ModelWorker, WorkerLabel, WorkerResult};
use crate::registry::{Fleet, Worker};

/// Running monitors by worker.
#[derive(Default)]
pub struct Monitors {
    running: Mutex<HashMap<WorkerId, Running>>,
    /// Serialises [`Monitors::export`]: it clears and re-adds series, so two concurrent scrapes
    /// must not interleave (counters would be added twice).
    export: Mutex<()>,
}

struct Running {
    handle: MonitorHandle,
    signals: Arc<Signals>,
    /// The pool block size the monitor checks and hashes events with.
    block_size: u32,
}

/// Running, waiting and KV usage as scraped (each `None` when the kind lacks it).
#[derive(Clone, Copy)]
struct LastLoad {
    running: Option<u32>,
    waiting: Option<u32>,
    kv_usage: Option<f64>,
    capacity_blocks: Option<u64>,
    prefix_cache_queries: Option<f64>,
    prefix_cache_hits: Option<f64>,
    preemptions: Option<f64>,
}

/// What the worker last reported, kept for the metrics scrape.
#[derive(Default)]
struct Signals {
    /// Figures of the last successful scrape; `None` before the first one.
    load: Mutex<Option<LastLoad>>,
    /// True after `on_load_stale` until the next successful scrape.
    stale: AtomicBool,
    block_size_mismatch: AtomicBool,
    /// Blocks the worker's KV events stored / removed (evicted) in the exact index.
    kv_blocks_stored: AtomicU64,
    kv_blocks_removed: AtomicU64,
}

impl Monitors {
    /// Starts (or restarts) the worker's monitor, with its pool's block size.
    pub fn start(&self, app: &Arc<WorkerFleet>, w: &Worker, cfg: &Config) {
        let block_size = pool_block_size(cfg, w);
        if let Some(other) = model_block_sizes(cfg, w).find(|b| *b != block_size) {
            tracing::warn!(worker = %w.name, block_size, other,
                "the worker's models set different block sizes; using the first");
        }
        let kind: WorkerKind = w.cfg.kind.parse().unwrap_or_default();
        let base = format!("{}://{}{}", w.scheme, w.authority, w.path_prefix);
        let mut mc = MonitorConfig::new(w.id, base, kind);
        mc.name = w.name.to_string();
        mc.block_size = Some(block_size);
        mc.health_interval = std::time::Duration::from_millis(cfg.upstream.health_interval_ms);
        mc.health_recovery_interval =
            std::time::Duration::from_millis(cfg.upstream.health_recovery_interval_ms);
        mc.tls = app.upstream.client.tls.clone();
        mc.auth = w.auth_header.clone();
        mc.dcgm_url = w.cfg.dcgm_url.clone();
        if let Some(ep) = &w.cfg.kv_events {
            mc.kv_events = KvEventsSource::Endpoints(vec![KvSource {
                endpoint: ep.clone(),
                replay_endpoint: w.cfg.kv_replay.clone(),
                topic: String::new(),
            }]);
        }
        let signals = Arc::new(Signals::default());
        let sink = Arc::new(GatewaySink {
            app: Arc::downgrade(app),
            block_size,
            signals: signals.clone(),
        });
        // A fresh monitor checks the block size again; until it finds a mismatch, score KV.
        w.state.kv_scoring.store(true, Ordering::Relaxed);
        // One breaker per worker: the monitor's probes and the request path feed the same one.
        let handle =
            kvgate_fleet::WorkerMonitor::spawn_with_breaker(mc, sink, w.state.breaker.clone());
        self.running.lock().insert(
            w.id,
            Running {
                handle,
                signals,
                block_size,
            },
        );
    }

    /// Restarts the monitors whose pool block size changed (a reload changed `[models.x]
    /// block_size`, or model discovery put the worker in another pool): the mismatch check and the
    /// router hashes rebuilt from its events must use the size requests are hashed with.
    pub fn resync_block_sizes(&self, app: &Arc<WorkerFleet>, fleet: &Fleet, cfg: &Config) {
        let changed: Vec<&Arc<Worker>> = {
            let running = self.running.lock();
            fleet
                .workers
                .iter()
                .filter(|w| {
                    running
                        .get(&w.id)
                        .is_some_and(|r| r.block_size != pool_block_size(cfg, w))
                })
                .collect()
        };
        for w in changed {
            tracing::info!(worker = %w.name, block_size = pool_block_size(cfg, w),
                "pool block size changed: restarting the worker's monitor");
            // Entries hashed with the old size can never match a request again.
            app.router.index.write().clear_worker(w.id);
            self.start(app, w, cfg);
        }
    }

    /// Set the `kvgate_worker_*` families from every running monitor (called by `GET /metrics`).
    /// Series of workers no longer monitored disappear.
    pub fn export(&self, app: &WorkerFleet, m: &Metrics) {
        let _serial = self.export.lock();
        let ws = &m.worker;
        ws.clear();
        let fleet = app.registry.snapshot();
        let running = self.running.lock();
        for w in &fleet.workers {
            let Some(r) = running.get(&w.id) else {
                continue;
            };
            let worker = WorkerLabel {
                worker: w.name.clone(),
            };
            let stale = r.signals.stale.load(Ordering::Relaxed);
            let load = *r.signals.load.lock();
            // The monitor's own verdict (no successful scrape within its bound), not "never scraped":
            // kinds without a load endpoint must not look stale forever.
            ws.load_stale.get_or_create(&worker).set(i64::from(stale));
            ws.block_size_mismatch.get_or_create(&worker).set(i64::from(
                r.signals.block_size_mismatch.load(Ordering::Relaxed),
            ));
            if let (Some(l), false) = (load, stale) {
                let mw = ModelWorker {
                    model: primary_model(w),
                    worker: w.name.clone(),
                };
                if let Some(v) = l.running {
                    ws.running.get_or_create(&mw).set(f64::from(v));
                }
                if let Some(v) = l.waiting {
                    ws.waiting.get_or_create(&mw).set(f64::from(v));
                }
                if let Some(v) = l.kv_usage {
                    ws.kv_usage.get_or_create(&mw).set(v.clamp(0.0, 1.0));
                }
                if let Some(v) = l.capacity_blocks {
                    ws.kv_capacity_blocks
                        .get_or_create(&worker)
                        .set(i64::try_from(v).unwrap_or(i64::MAX));
                }
                for (family, v) in [
                    (&ws.prefix_cache_queries, l.prefix_cache_queries),
                    (&ws.prefix_cache_hits, l.prefix_cache_hits),
                    (&ws.preemptions, l.preemptions),
                ] {
                    if let Some(v) = v.filter(|v| v.is_finite() && *v >= 0.0) {
                        family.get_or_create(&worker).inc_by(v);
                    }
                }
            }
            ws.kv_blocks_stored
                .get_or_create(&worker)
                .inc_by(r.signals.kv_blocks_stored.load(Ordering::Relaxed));
            ws.kv_blocks_removed
                .get_or_create(&worker)
                .inc_by(r.signals.kv_blocks_removed.load(Ordering::Relaxed));
            let s = r.handle.stats().snapshot();
            let by = |result| WorkerResult {
                worker: w.name.clone(),
                result,
            };
            ws.scrapes.get_or_create(&by("ok")).inc_by(s.scrapes_ok);
            ws.scrapes
                .get_or_create(&by("failed"))
                .inc_by(s.scrapes_failed);
            ws.health_checks
                .get_or_create(&by("ok"))
                .inc_by(s.health_ok);
            ws.health_checks
                .get_or_create(&by("failed"))
                .inc_by(s.health_failed);
            ws.kv_replays
                .get_or_create(&by("ok"))
                .inc_by(s.kv_replays_ok);
            ws.kv_replays
                .get_or_create(&by("failed"))
                .inc_by(s.kv_replays_failed);
            ws.kv_events.get_or_create(&worker).inc_by(s.kv_events);
            ws.kv_malformed
                .get_or_create(&worker)
                .inc_by(s.kv_malformed);
            ws.kv_tier_only
                .get_or_create(&worker)
                .inc_by(s.kv_tier_only);
            ws.kv_gaps.get_or_create(&worker).inc_by(s.kv_gaps);
            ws.kv_resets.get_or_create(&worker).inc_by(s.kv_resets);
            ws.kv_reconnects
                .get_or_create(&worker)
                .inc_by(s.kv_reconnects);
            if w.cfg.dcgm_url.is_some() {
                crate::fleet::gpu::export(ws, &worker, r.handle.stats());
            }
            let gpu_type = r
                .handle
                .stats()
                .gpu
                .lock()
                .as_ref()
                .and_then(|g| g.model_name.clone())
                .unwrap_or_default();
            ws.info
                .get_or_create(&crate::metrics::WorkerInfo {
                    worker: w.name.clone(),
                    model: primary_model(w),
                    kind: w.cfg.kind.clone(),
                    gpu_type,
                    gpus: w.cfg.gpus,
                })
                .set(1);
        }
    }

    /// Stop a removed worker's monitor (dropping the handle cancels its tasks).
    pub fn stop(&self, id: WorkerId) {
        self.running.lock().remove(&id);
    }

    pub fn stop_all(&self) {
        self.running.lock().clear();
    }
}

/// The block size of the worker's pool: the first of its models with a `[models.x] block_size`,
/// else `routing.block_size` (the same rule the registry uses for `Pool::block_size`). A worker
/// serving models whose pools disagree gets the first one's (one engine has one block size).
pub fn pool_block_size(cfg: &Config, w: &Worker) -> u32 {
    model_block_sizes(cfg, w)
        .next()
        .unwrap_or(cfg.routing.block_size)
}

fn model_block_sizes<'a>(cfg: &'a Config, w: &'a Worker) -> impl Iterator<Item = u32> + 'a {
    w.models
        .iter()
        .filter_map(|m| cfg.models.get(&**m).and_then(|mc| mc.block_size))
}

/// The `model` label of a worker's load: its first configured model, else the first discovered one.
/// One series per worker, so `sum by (model)` does not count a multi-model worker twice.
fn primary_model(w: &Worker) -> Lbl {
    if let Some(m) = w.models.first() {
        return m.clone();
    }
    w.state
        .discovered_models
        .lock()
        .first()
        .cloned()
        .unwrap_or_else(|| Lbl::from("unknown"))
}

/// Feeds monitor reports into the gateway. Holds the state weakly: the monitors are owned by it.
pub struct GatewaySink {
    app: Weak<WorkerFleet>,
    block_size: u32,
    signals: Arc<Signals>,
}

impl GatewaySink {
    fn with(&self, id: WorkerId, f: impl FnOnce(&WorkerFleet, &Worker)) {
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
        *self.signals.load.lock() = Some(LastLoad {
            running: load.running,
            waiting: load.waiting,
            kv_usage: load.kv_usage,
            capacity_blocks: load.num_gpu_blocks,
            prefix_cache_queries: load.prefix_cache_queries,
            prefix_cache_hits: load.prefix_cache_hits,
            preemptions: load.preemptions,
        });
        self.signals.stale.store(false, Ordering::Relaxed);
        self.with(worker, |app, w| {
            *w.state.scraped.lock() = load
                .core()
                .map(|l| (load.scraped_at.unwrap_or_else(Instant::now), l));
            // Running while others wait: the engine's concurrency limit, for the latency model.
            if let (Some(running), Some(waiting)) = (load.running, load.waiting) {
                app.router
                    .latency
                    .lock()
                    .observe_engine(worker, running, waiting);
            }
            // Size the approximate index like the worker's real cache, in the pool's blocks
            // (llama.cpp: Σ slot n_ctx, one cached prompt per slot; vLLM/SGLang/TRT-LLM: blocks ×
            // block size), so it never credits more cached blocks than the worker can hold.
            let blocks = load
                .kv_capacity_tokens
                .map(|t| t / u64::from(self.block_size.max(1)))
                .or(load.num_gpu_blocks);
            if let Some(n) = blocks {
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                let mut index = app.router.index.write();
                if matches!(index.mode(worker), Some(IndexMode::Approximate(c)) if c.capacity_blocks != n)
                {
                    index.set_capacity(worker, n);
                }
            }
        });
    }

    fn on_load_stale(&self, worker: WorkerId) {
        self.signals.stale.store(true, Ordering::Relaxed);
        self.with(worker, |_, w| *w.state.scraped.lock() = None);
    }

    fn on_block_size(&self, worker: WorkerId, engine: u32, configured: u32) {
        self.signals
            .block_size_mismatch
            .store(true, Ordering::Relaxed);
        self.with(worker, |_, w| {
            tracing::error!(worker = %w.name, engine, configured, "KV block size mismatch: worker excluded from KV scoring (still load-balanced)");
            w.state.kv_scoring.store(false, Ordering::Relaxed);
        });
    }

    fn on_block_size_agrees(&self, worker: WorkerId) {
        self.signals
            .block_size_mismatch
            .store(false, Ordering::Relaxed);
        self.with(worker, |_, w| {
            tracing::info!(worker = %w.name, "KV block size agrees with the pool again: worker back in KV scoring");
            w.state.kv_scoring.store(true, Ordering::Relaxed);
        });
    }

    fn on_kv_events(&self, worker: WorkerId, batch: &KvEventBatch) {
        self.with(worker, |app, _| {
            let mut index = app.router.index.write();
            // Events prove the worker publishes: switch it from the approximate to the exact index.
            if !matches!(index.mode(worker), Some(IndexMode::Exact)) {
                index.set_mode(worker, IndexMode::Exact);
            }
            let out = kvgate_fleet::apply_batch(&mut index, worker, batch, self.block_size);
            let s = &self.signals;
            s.kv_blocks_stored
                .fetch_add(out.stored_blocks as u64, Ordering::Relaxed);
            s.kv_blocks_removed
                .fetch_add(out.removed_blocks as u64, Ordering::Relaxed);
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
