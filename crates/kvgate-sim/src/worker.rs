//! The scheduler loop: ONE task per worker owns the [`Engine`]. HTTP handlers submit requests
//! through a channel and receive their tokens on a per-request channel; the loop schedules a step,
//! sleeps for the timing model's step time (real tokio clock, so a paused clock in tests works too),
//! applies it, publishes the step's KV events and updates the metrics.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{CrashMode, SimConfig};
use crate::engine::{CacheEntry, Engine, EngineConfig, FinishReason, NewRequest, RequestId};
use crate::kv_events::KvEvent;
use crate::metrics::Metrics;

/// What a request's handler hears. `idx` is the choice index within the HTTP request.
#[derive(Debug, Clone, PartialEq)]
pub enum ReqEvent {
    /// First scheduled; `cached_tokens` came from the prefix cache.
    Started {
        idx: u32,
        cached_tokens: usize,
    },
    Token {
        idx: u32,
        token: u32,
    },
    Done {
        idx: u32,
        reason: FinishReason,
    },
    /// `--crash-after` fired: the handler must cut the response off.
    Crash,
}

pub type ReqSender = mpsc::UnboundedSender<ReqEvent>;

pub enum Command {
    Submit {
        req: NewRequest,
        idx: u32,
        tx: ReqSender,
    },
    ResetPrefixCache(oneshot::Sender<()>),
    Snapshot(oneshot::Sender<Vec<CacheEntry>>),
}

struct Track {
    idx: u32,
    tx: ReqSender,
    arrival: Instant,
    last_token: Option<Instant>,
    tokens: u32,
}

pub struct Scheduler {
    cfg: SimConfig,
    engine: Engine,
    tracks: HashMap<RequestId, Track>,
    metrics: Arc<Mutex<Metrics>>,
    events_tx: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
    /// Completion requests received (for `--slowdown-after`).
    received: u64,
}

impl Scheduler {
    pub fn new(
        cfg: SimConfig,
        metrics: Arc<Mutex<Metrics>>,
        events_tx: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
    ) -> Self {
        let engine = Engine::new(EngineConfig {
            block_size: cfg.block_size,
            num_gpu_blocks: cfg.num_gpu_blocks,
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            enable_prefix_caching: cfg.enable_prefix_caching,
            seed: cfg.seed,
            mean_output_tokens: cfg.mean_output_tokens,
        });
        Self {
            cfg,
            engine,
            tracks: HashMap::new(),
            metrics,
            events_tx,
            received: 0,
        }
    }

    /// The `--slowdown` factor in effect now (1 before it starts or without one).
    fn slowdown(&self) -> f64 {
        match self.cfg.faults.slowdown {
            Some(s) if self.received >= s.after_requests => s.factor,
            _ => 1.0,
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { req, idx, tx } => {
                self.received += 1;
                let now = Instant::now();
                self.tracks.insert(
                    req.id,
                    Track {
                        idx,
                        tx,
                        arrival: now,
                        last_token: None,
                        tokens: 0,
                    },
                );
                self.engine.add_request(req);
            }
            Command::ResetPrefixCache(done) => {
                self.engine.reset_prefix_cache();
                self.publish();
                let _ = done.send(());
            }
            Command::Snapshot(tx) => {
                let _ = tx.send(self.engine.cache_snapshot());
            }
        }
    }

    fn abort(&mut self, id: RequestId) {
        if self.engine.abort(id) {
            self.metrics.lock().finished(Some(FinishReason::Abort));
        }
        self.tracks.remove(&id);
    }

    fn publish(&mut self) {
        let events = self.engine.take_events();
        if let (false, Some(tx)) = (events.is_empty(), &self.events_tx) {
            let _ = tx.send(events);
        }
    }

    fn update_gauges(&self) {
        let mut m = self.metrics.lock();
        m.running = self.engine.num_running();
        m.waiting = self.engine.num_waiting();
        m.kv_usage = self.engine.kv_usage();
        m.engine = self.engine.counters.clone();
    }

    /// Runs until `cancel` fires or every command sender is gone.
    pub async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Command>,
        cancel: CancellationToken,
    ) {
        loop {
            if !self.engine.has_work() {
                self.update_gauges();
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    cmd = rx.recv() => match cmd {
                        Some(c) => self.handle(c),
                        None => break,
                    },
                }
            }
            while let Ok(c) = rx.try_recv() {
                self.handle(c);
            }
            // Clients that went away (disconnect, dropped handler) free their blocks now.
            let gone: Vec<RequestId> = self
                .tracks
                .iter()
                .filter(|(_, t)| t.tx.is_closed())
                .map(|(id, _)| *id)
                .collect();
            for id in gone {
                self.abort(id);
            }
            if !self.engine.has_work() {
                continue;
            }
            let step = self.engine.schedule();
            self.update_gauges();
            if step.is_empty() {
                // Cannot happen with admission checks; never spin if it does.
                tracing::error!("scheduler found work but scheduled nothing");
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                continue;
            }
            let ms = self
                .cfg
                .timing
                .step_ms(step.prefill_tokens, step.decode_seqs, step.kv_usage)
                * self.slowdown();
            let started_at = Instant::now();
            for (id, cached) in &step.started {
                if let Some(t) = self.tracks.get(id) {
                    let _ = t.tx.send(ReqEvent::Started {
                        idx: t.idx,
                        cached_tokens: *cached,
                    });
                    let q = started_at.duration_since(t.arrival).as_secs_f64();
                    self.metrics.lock().queue.observe(q);
                }
            }
            match self.cfg.scaled(ms) {
                Some(d) => tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(d) => {}
                },
                None => tokio::task::yield_now().await,
            }
            let outputs = self.engine.complete(&step);
            self.publish();
            let now = Instant::now();
            for out in outputs {
                self.deliver(out.id, out.token, out.finished, now);
            }
            self.update_gauges();
        }
        // Shutdown: dropping the trackers ends every open response.
        self.tracks.clear();
    }

    fn deliver(&mut self, id: RequestId, token: u32, finished: Option<FinishReason>, now: Instant) {
        let Some(t) = self.tracks.get_mut(&id) else {
            return;
        };
        {
            let mut m = self.metrics.lock();
            match t.last_token {
                None => m.ttft.observe(now.duration_since(t.arrival).as_secs_f64()),
                Some(prev) => m.itl.observe(now.duration_since(prev).as_secs_f64()),
            }
        }
        t.last_token = Some(now);
        t.tokens += 1;
        let _ = t.tx.send(ReqEvent::Token { idx: t.idx, token });
        if let Some(reason) = finished {
            let _ = t.tx.send(ReqEvent::Done { idx: t.idx, reason });
            let mut m = self.metrics.lock();
            m.e2e.observe(now.duration_since(t.arrival).as_secs_f64());
            m.finished(Some(reason));
            drop(m);
            self.tracks.remove(&id);
            return;
        }
        if self.cfg.faults.crash_after.is_some_and(|n| t.tokens >= n) {
            match self.cfg.faults.crash_mode {
                CrashMode::Exit => {
                    tracing::error!("--crash-after reached: exiting the process");
                    std::process::exit(101);
                }
                CrashMode::Stream => {
                    let _ = t.tx.send(ReqEvent::Crash);
                    self.engine.abort(id);
                    self.tracks.remove(&id);
                    self.metrics.lock().finished(None);
                }
            }
        }
    }
}
