//! One kvgate-fleet `WorkerMonitor` per worker (scraper, KV-event
//! subscriber, health checks), reporting through [`GatewaySink`] into the worker's registry state
//! and the router's KV index. Monitors start and stop with the fleet snapshot (config reload,
//! admin add/remove). The latest worker-reported figures and the monitors' counters are
//! re-exported as `kvgate_worker_*` metrics at scrape time ([`Monitors::export`]), so recording
//! costs nothing per event.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kvgate_core::{IndexMode, WorkerId};
use kvgate_fleet::{
    DetectedRole, FleetSink, KvEventsSource, KvSource, MonitorConfig, MonitorHandle, ResetReason,
    ScrapedLoad, WorkerKind,
};
use kvgate_protocol::kv_events::KvEventBatch;
use parking_lot::Mutex;

use super::WorkerFleet;
use crate::config::{Config, RoleSetting};
use crate::metrics::{
    Lbl, Metrics, ModelWorker, WorkerLabel, WorkerPhase, WorkerReason, WorkerResult,
    RESTART_REASONS,
};
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
    /// It asks the worker's `/server_info` for its role (`role = "auto"`).
    detect_role: bool,
}

/// Two restart detections closer than this are one restart (a vLLM restart shows as a sequence
/// regression and, a scrape later, as counters going backwards).
const RESTART_DEDUP: Duration = Duration::from_secs(30);

/// What the worker last reported, kept for the metrics scrape.
#[derive(Default)]
struct Signals {
    /// Figures of the last successful scrape; `None` before the first one.
    load: Mutex<Option<ScrapedLoad>>,
    /// Restarts detected, by `metrics::RESTART_REASONS` index, and when the last one counted.
    restarts: [AtomicU64; RESTART_REASONS.len()],
    last_restart: Mutex<Option<Instant>>,
    /// True after `on_load_stale` until the next successful scrape.
    stale: AtomicBool,
    block_size_mismatch: AtomicBool,
    /// Blocks the worker's KV events stored / removed (evicted) in the exact index.
    kv_blocks_stored: AtomicU64,
    kv_blocks_removed: AtomicU64,
}

impl Signals {
    /// Count a detected restart (`reason`: a `RESTART_REASONS` index) unless one was counted
    /// within `RESTART_DEDUP`.
    fn restart(&self, reason: usize, now: Instant) {
        let mut last = self.last_restart.lock();
        if last.is_some_and(|t| now.saturating_duration_since(t) < RESTART_DEDUP) {
            return;
        }
        *last = Some(now);
        if let Some(c) = self.restarts.get(reason) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How a new scrape says the engine restarted since the previous one, if it does: its process
/// start time changed, or one of its monotonic counters went backwards (`RESTART_REASONS` index).
fn restart_between(prev: &ScrapedLoad, now: &ScrapedLoad) -> Option<usize> {
    if let (Some(a), Some(b)) = (prev.process_start_time, now.process_start_time) {
        // The same process reports the same float every time; allow for text round-trips.
        if (a - b).abs() > 1e-3 {
            return Some(3);
        }
    }
    let count = |l: &ScrapedLoad| {
        [
            l.prefix_cache_queries,
            l.prefix_cache_hits,
            l.preemptions,
            l.queue_time.map(|t| t.count),
            l.prefill_time.map(|t| t.count),
            l.decode_time.map(|t| t.count),
            l.iteration_tokens.map(|t| t.count),
            l.spec_drafts,
        ]
    };
    let went_back = count(prev)
        .into_iter()
        .zip(count(now))
        .any(|(a, b)| matches!((a, b), (Some(a), Some(b)) if b < a));
    went_back.then_some(2)
}

impl Monitors {
    /// Starts (or restarts) the worker's monitor, with its pool's block size.
    pub fn start(&self, app: &Arc<WorkerFleet>, w: &Worker, cfg: &Config) {
        let block_size = pool_block_size(cfg, w);
        if let Some(other) = model_block_sizes(cfg, w).find(|b| *b != block_size) {
            tracing::warn!(worker = %w.name, block_size, other,
                "the worker's models set different block sizes; using the first");
        }
        let kind: WorkerKind = w.kind;
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
        mc.detect_role = w.cfg.role == RoleSetting::Auto;
        if let Some(ep) = &w.cfg.kv_events {
            mc.kv_events = KvEventsSource::Endpoints(vec![KvSource {
                endpoint: ep.clone(),
                replay_endpoint: w.cfg.kv_replay.clone(),
                topic: String::new(),
            }]);
        }
        let signals = Arc::new(Signals::default());
        // The recovery histogram exists from the start (an empty one, not none, until an outage).
        let _ = app.metrics.worker_recovery.get_or_create(&WorkerLabel {
            worker: w.name.clone(),
        });
        let sink = Arc::new(GatewaySink {
            app: Arc::downgrade(app),
            state: Arc::downgrade(&w.state),
            block_size,
            signals: signals.clone(),
        });
        // A fresh monitor checks the block size again; until it finds a mismatch, score KV.
        w.state.kv_scoring.store(true, Ordering::Relaxed);
        // One breaker per worker: the monitor's probes and the request path feed the same one.
        let detect_role = mc.detect_role;
        let handle =
            kvgate_fleet::WorkerMonitor::spawn_with_breaker(mc, sink, w.state.breaker.clone());
        self.running.lock().insert(
            w.id,
            Running {
                handle,
                signals,
                block_size,
                detect_role,
            },
        );
    }

    /// Restarts the monitors whose pool block size changed (a reload changed `[models.x]
    /// block_size`, or model discovery put the worker in another pool): the mismatch check and the
    /// router hashes rebuilt from its events must use the size requests are hashed with. Also
    /// those of workers a reload switched to `role = "auto"` whose role is not known: only a
    /// monitor started with role detection asks for it.
    pub fn resync(&self, app: &Arc<WorkerFleet>, fleet: &Fleet, cfg: &Config) {
        let changed: Vec<(&Arc<Worker>, bool)> = {
            let running = self.running.lock();
            fleet
                .workers
                .iter()
                .filter_map(|w| {
                    let r = running.get(&w.id)?;
                    let block_size = r.block_size != pool_block_size(cfg, w);
                    let role = !r.detect_role && w.state.role_unknown();
                    (block_size || role).then_some((w, block_size))
                })
                .collect()
        };
        for (w, block_size) in changed {
            if block_size {
                tracing::info!(worker = %w.name, block_size = pool_block_size(cfg, w),
                    "pool block size changed: restarting the worker's monitor");
                // Entries hashed with the old size can never match a request again.
                app.router.with_index_mut(|i| i.clear_worker(w.id));
            } else {
                tracing::info!(worker = %w.name,
                    "role = auto: restarting the worker's monitor to ask its /server_info");
            }
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
            let load = r.signals.load.lock().clone();
            // The monitor's own verdict (no successful scrape within its bound), not "never scraped":
            // kinds without a load endpoint must not look stale forever.
            ws.load_stale.get_or_create(&worker).set(i64::from(stale));
            ws.block_size_mismatch.get_or_create(&worker).set(i64::from(
                r.signals.block_size_mismatch.load(Ordering::Relaxed),
            ));
            // The engine's own limits win over configured ones (TRT-LLM reports them).
            let engine_limits = load.as_ref().filter(|_| !stale);
            for (family, v) in [
                (
                    &ws.max_num_batched_tokens,
                    engine_limits
                        .and_then(|l| l.max_num_batched_tokens)
                        .or(w.cfg.max_num_batched_tokens),
                ),
                (
                    &ws.max_num_seqs,
                    engine_limits
                        .and_then(|l| l.max_num_seqs)
                        .or(w.cfg.max_num_seqs),
                ),
            ] {
                if let Some(v) = v {
                    family
                        .get_or_create(&worker)
                        .set(i64::try_from(v).unwrap_or(i64::MAX));
                }
            }
            for (i, reason) in RESTART_REASONS.into_iter().enumerate() {
                ws.restarts
                    .get_or_create(&WorkerReason {
                        worker: w.name.clone(),
                        reason,
                    })
                    .inc_by(r.signals.restarts[i].load(Ordering::Relaxed));
            }
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
                if let Some(v) = l.num_gpu_blocks {
                    ws.kv_capacity_blocks
                        .get_or_create(&worker)
                        .set(i64::try_from(v).unwrap_or(i64::MAX));
                }
                let valid = |v: &f64| v.is_finite() && *v >= 0.0;
                for (family, v) in [
                    (&ws.prefix_cache_queries, l.prefix_cache_queries),
                    (&ws.prefix_cache_hits, l.prefix_cache_hits),
                    (&ws.preemptions, l.preemptions),
                    (&ws.iteration_tokens, l.iteration_tokens.map(|t| t.sum)),
                    (&ws.iterations, l.iteration_tokens.map(|t| t.count)),
                    (&ws.spec_drafts, l.spec_drafts),
                    (&ws.spec_draft_tokens, l.spec_draft_tokens),
                    (&ws.spec_accepted_tokens, l.spec_accepted_tokens),
                ] {
                    if let Some(v) = v.filter(valid) {
                        family.get_or_create(&worker).inc_by(v);
                    }
                }
                for (phase, t) in [
                    ("queue", l.queue_time),
                    ("prefill", l.prefill_time),
                    ("decode", l.decode_time),
                ] {
                    let Some(t) = t.filter(|t| valid(&t.sum) && valid(&t.count)) else {
                        continue;
                    };
                    let wp = WorkerPhase {
                        worker: w.name.clone(),
                        phase,
                    };
                    ws.engine_phase_seconds.get_or_create(&wp).inc_by(t.sum);
                    ws.engine_phase_requests.get_or_create(&wp).inc_by(t.count);
                }
                if let Some(p) = l.paused {
                    ws.paused_requests.get_or_create(&worker).set(i64::from(p));
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
                    kind: w.kind.as_str().into(),
                    gpu_type,
                    gpus: w.cfg.gpus,
                    role: w.role_label(),
                    tensor_parallelism: w
                        .cfg
                        .tensor_parallelism
                        .map(|t| t.to_string())
                        .unwrap_or_default(),
                    model_version: w.cfg.model_version.clone().unwrap_or_default(),
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
    /// The worker this monitor was started for: a late event of a stopped monitor must not
    /// reach a new worker that reuses its id.
    state: Weak<crate::registry::WorkerState>,
    block_size: u32,
    signals: Arc<Signals>,
}

impl GatewaySink {
    fn with(&self, id: WorkerId, f: impl FnOnce(&WorkerFleet, &Worker)) {
        if let Some(app) = self.app.upgrade() {
            let fleet = app.registry.snapshot();
            if let Some(w) = fleet
                .worker(id)
                .filter(|w| std::ptr::eq(Arc::as_ptr(&w.state), self.state.as_ptr()))
            {
                f(&app, w);
            }
        }
    }
}

impl FleetSink for GatewaySink {
    fn on_load(&self, worker: WorkerId, load: &ScrapedLoad) {
        let prev = self.signals.load.lock().replace(load.clone());
        if let Some(reason) = prev.and_then(|p| restart_between(&p, load)) {
            self.with(worker, |_, w| {
                tracing::warn!(worker = %w.name, reason = RESTART_REASONS[reason],
                    "worker restart detected from its metrics");
            });
            self.signals.restart(reason, crate::clock::now());
        }
        self.signals.stale.store(false, Ordering::Relaxed);
        self.with(worker, |app, w| {
            *w.state.scraped.lock() = load
                .core()
                .map(|l| (load.scraped_at.unwrap_or_else(Instant::now), l));
            // Running while others wait: the engine's concurrency limit, for the latency model.
            if let (Some(running), Some(waiting)) = (load.running, load.waiting) {
                app.router.observe_engine(worker, running, waiting);
            }
            // Size the approximate index like the worker's real cache, in the pool's blocks
            // (llama.cpp: Σ slot n_ctx, one cached prompt per slot; vLLM/SGLang/TRT-LLM: blocks ×
            // block size), so it never credits more cached blocks than the worker can hold.
            let blocks = load
                .kv_capacity_tokens
                .map(|t| t / u64::from(self.block_size.max(1)))
                .or(load.num_gpu_blocks);
            if let Some(n) = blocks {
                w.state
                    .kv_capacity_blocks
                    .store(u32::try_from(n).unwrap_or(u32::MAX), Ordering::Relaxed);
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                app.router.with_index_mut(|index| {
                    if matches!(index.mode(worker), Some(IndexMode::Approximate(c)) if c.capacity_blocks != n)
                    {
                        index.set_capacity(worker, n);
                    }
                });
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
            let out = app.router.with_index_mut(|index| {
                // Events prove the worker publishes: switch it from the approximate to the exact
                // index.
                if !matches!(index.mode(worker), Some(IndexMode::Exact)) {
                    index.set_mode(worker, IndexMode::Exact);
                }
                kvgate_fleet::apply_batch(index, worker, batch, self.block_size)
            });
            let s = &self.signals;
            let stored_before = s
                .kv_blocks_stored
                .fetch_add(out.stored_blocks as u64, Ordering::Relaxed);
            s.kv_blocks_removed
                .fetch_add(out.removed_blocks as u64, Ordering::Relaxed);
            // vLLM's and SGLang's AllBlocksCleared (a restart, or an operator's
            // `/reset_prefix_cache`) after the worker had stored blocks: counted like TRT-LLM's
            // (`on_kv_reset`), `kv_cache_cleared`. A clear before any stored block is the start.
            if out.cleared && stored_before + out.stored_blocks as u64 > 0 {
                s.restart(1, crate::clock::now());
            }
        });
    }

    fn on_kv_reset(&self, worker: WorkerId, reason: ResetReason) {
        match reason {
            ResetReason::SeqRegression => self.signals.restart(0, crate::clock::now()),
            // TRT-LLM sends `created` when its cache manager starts: a clear before any block
            // was stored is the worker's start, not a restart.
            ResetReason::AllBlocksCleared
                if self.signals.kv_blocks_stored.load(Ordering::Relaxed) > 0 =>
            {
                self.signals.restart(1, crate::clock::now())
            }
            ResetReason::AllBlocksCleared => {}
            // A health flap is an outage (`kvgate_worker_recovery_seconds`), not proof of a
            // restart; a lost gap is not one either.
            ResetReason::Restart | ResetReason::GapUnrecoverable => {}
        }
        self.with(worker, |app, w| {
            tracing::warn!(worker = %w.name, reason = reason.as_str(), "KV index entries of worker dropped");
            app.router.with_index_mut(|i| i.clear_worker(worker));
        });
    }

    fn on_health(&self, worker: WorkerId, up: bool) {
        self.with(worker, |app, w| {
            if w.state.healthy.swap(up, Ordering::Relaxed) != up {
                tracing::warn!(worker = %w.name, up, "worker health changed");
            }
            if up && !w.state.first_healthy.swap(true, Ordering::Relaxed) {
                app.metrics
                    .time_to_routable
                    .observe(crate::clock::since(w.state.added).as_secs_f64());
            }
        });
    }

    fn on_role(&self, worker: WorkerId, role: &DetectedRole) {
        self.with(worker, |_, w| {
            // The monitor logged the answer; routing starts with the next pick.
            w.state.set_detected_role(role);
        });
    }

    fn on_recovered(&self, worker: WorkerId, down_for: Duration) {
        self.with(worker, |app, w| {
            tracing::info!(worker = %w.name, down_s = down_for.as_secs_f64(), "worker recovered");
            app.metrics
                .worker_recovery
                .get_or_create(&WorkerLabel {
                    worker: w.name.clone(),
                })
                .observe(down_for.as_secs_f64());
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_fleet::SumCount;

    fn load(start: Option<f64>, hits: f64, steps: f64) -> ScrapedLoad {
        ScrapedLoad {
            process_start_time: start,
            prefix_cache_hits: Some(hits),
            iteration_tokens: Some(SumCount {
                sum: steps * 10.0,
                count: steps,
            }),
            ..ScrapedLoad::default()
        }
    }

    #[test]
    fn restarts_are_seen_in_start_time_or_counters_going_back() {
        let a = load(Some(1.7e9), 100.0, 50.0);
        assert_eq!(restart_between(&a, &load(Some(1.7e9), 120.0, 60.0)), None);
        // the start time wins when both say so
        assert_eq!(
            restart_between(&a, &load(Some(1.7e9 + 30.0), 0.0, 0.0)),
            Some(3)
        );
        assert_eq!(RESTART_REASONS[3], "start_time_changed");
        // no start time (SGLang multiprocess, llama.cpp): a counter that went back
        assert_eq!(
            restart_between(&load(None, 100.0, 50.0), &load(None, 100.0, 3.0)),
            Some(2)
        );
        assert_eq!(RESTART_REASONS[2], "counters_reset");
        // a figure that appears or disappears is not a restart
        let none = ScrapedLoad::default();
        assert_eq!(restart_between(&a, &none), None);
        assert_eq!(restart_between(&none, &a), None);
    }

    #[test]
    fn a_cache_cleared_before_any_stored_block_is_the_start_not_a_restart() {
        let signals = Arc::new(Signals::default());
        let sink = GatewaySink {
            app: Weak::new(),
            state: Weak::new(),
            block_size: 16,
            signals: signals.clone(),
        };
        let w = WorkerId(1);
        sink.on_kv_reset(w, ResetReason::AllBlocksCleared);
        sink.on_kv_reset(w, ResetReason::Restart);
        sink.on_kv_reset(w, ResetReason::GapUnrecoverable);
        assert!(signals
            .restarts
            .iter()
            .all(|c| c.load(Ordering::Relaxed) == 0));
        signals.kv_blocks_stored.store(5, Ordering::Relaxed);
        sink.on_kv_reset(w, ResetReason::AllBlocksCleared);
        sink.on_kv_reset(w, ResetReason::SeqRegression); // the same restart, seen twice
        let counts: Vec<u64> = signals
            .restarts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        assert_eq!(counts, vec![0, 1, 0, 0]);
    }

    #[test]
    fn detections_close_together_are_one_restart() {
        let s = Signals::default();
        let t0 = crate::clock::now();
        s.restart(0, t0);
        s.restart(2, t0 + Duration::from_secs(1));
        s.restart(3, t0 + Duration::from_secs(29));
        assert_eq!(s.restarts[0].load(Ordering::Relaxed), 1);
        assert_eq!(s.restarts[2].load(Ordering::Relaxed), 0);
        s.restart(2, t0 + Duration::from_secs(61));
        assert_eq!(s.restarts[2].load(Ordering::Relaxed), 1);
        assert_eq!(s.restarts[3].load(Ordering::Relaxed), 0);
    }
}
