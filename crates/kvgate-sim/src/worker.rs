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
    /// A prefill leg ended length-capped: engine request `id` left `blocks` pinned (sent just
    /// before its `Done`).
    Pinned {
        idx: u32,
        id: RequestId,
        blocks: Vec<usize>,
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
        /// When the HTTP handler sent it: the scheduler takes commands between steps, so the time
        /// until it does is the wait for the step in progress (`kvgate_sim_step_wait_seconds`).
        sent: Instant,
    },
    ResetPrefixCache(oneshot::Sender<()>),
    Snapshot(oneshot::Sender<Vec<CacheEntry>>),
    /// A decode worker read (or gave up on) a pinned prefill leg: free its blocks. Answers the
    /// number of blocks freed, `None` when nothing was pinned under that id (never was, already
    /// read, or the lease expired).
    ReleasePinned {
        id: RequestId,
        tx: oneshot::Sender<Option<usize>>,
    },
    /// How many leading prompt tokens the prefix cache holds (what a decode leg need not pull).
    LocalHit {
        prompt: Vec<u32>,
        tx: oneshot::Sender<usize>,
    },
}

struct Track {
    idx: u32,
    tx: ReqSender,
    arrival: Instant,
    /// First scheduled (end of the queue phase, start of prefill).
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
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
    /// When the `--slowdown` began (the `--slowdown-after`-th request arrived).
    slow_since: Option<Instant>,
    /// Lease deadline of every pinned prefill leg.
    leases: HashMap<RequestId, Instant>,
    /// When the last step was due to end, on the timing model's own timeline (see `step_deadline`).
    step_end: Option<Instant>,
}

/// A step that starts within this of the previous one's scheduled end continues the timeline.
const TIMELINE_SLACK: std::time::Duration = std::time::Duration::from_millis(2);

/// When a step of duration `d` starting `now` ends, given the previous step's scheduled end: back
/// to back steps run on the model's timeline (each from the previous one's *scheduled* end), so
/// the timer's rounding up to its tick (~1 ms per sleep) does not add up over a stream's steps;
/// after an idle gap the timeline restarts at `now`.
fn step_deadline(prev_end: Option<Instant>, now: Instant, d: std::time::Duration) -> Instant {
    match prev_end {
        Some(end) if end + TIMELINE_SLACK >= now => end + d,
        _ => now + d,
    }
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
            priority_scheduling: cfg.scheduling_policy == crate::config::SchedulingPolicy::Priority,
            enable_prefix_caching: cfg.enable_prefix_caching,
            assume_cached: cfg.assume_cached_header,
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
            slow_since: None,
            leases: HashMap::new(),
            step_end: None,
        }
    }

    /// The `--slowdown` factor in effect now (1 before it starts, after it ended, or without one).
    fn slowdown(&self, now: Instant) -> f64 {
        match (self.cfg.faults.slowdown, self.slow_since) {
            (Some(s), Some(t)) if s.lasts.is_none_or(|d| now.saturating_duration_since(t) < d) => {
                s.factor
            }
            _ => 1.0,
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { req, idx, tx, sent } => {
                self.received += 1;
                let now = Instant::now();
                self.metrics
                    .lock()
                    .step_wait
                    .observe(now.saturating_duration_since(sent).as_secs_f64());
                if let Some(s) = self.cfg.faults.slowdown {
                    if self.slow_since.is_none() && self.received >= s.after_requests {
                        self.slow_since = Some(now);
                    }
                }
                self.tracks.insert(
                    req.id,
                    Track {
                        idx,
                        tx,
                        arrival: now,
                        scheduled: None,
                        first_token: None,
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
            Command::ReleasePinned { id, tx } => {
                self.leases.remove(&id);
                let freed = self.engine.release_pinned(id);
                self.update_gauges();
                let _ = tx.send(freed);
            }
            Command::LocalHit { prompt, tx } => {
                let _ = tx.send(self.engine.local_hit_tokens(&prompt));
            }
        }
    }

    /// Frees pinned prefill legs whose lease ran out (vLLM counts them in
    /// `nixl_num_kv_expired_reqs`).
    fn expire_leases(&mut self, now: Instant) {
        let due: Vec<RequestId> = self
            .leases
            .iter()
            .filter(|(_, t)| **t <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.leases.remove(&id);
            if self.engine.release_pinned(id).is_some() {
                self.metrics.lock().pd.expired_reqs += 1;
            }
        }
    }

    fn next_lease(&self) -> Option<Instant> {
        self.leases.values().min().copied()
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

    /// Per-step figures: tokens in the batch, and (`--spec-tokens k`) one draft of k tokens per
    /// decoding sequence, of which a fixed rotating pattern 0..=k is accepted (mean k/2).
    fn step_metrics(&self, step: &crate::engine::Step) {
        let mut m = self.metrics.lock();
        m.iteration_tokens
            .observe((step.prefill_tokens + step.decode_seqs) as f64);
        let k = u64::from(self.cfg.spec_tokens);
        if k > 0 {
            let seqs = step.decode_seqs as u64;
            let base = m.spec.drafts;
            m.spec.drafts += seqs;
            m.spec.draft_tokens += seqs * k;
            m.spec.accepted_tokens += (0..seqs).map(|i| (base + i) % (k + 1)).sum::<u64>();
        }
    }

    fn update_gauges(&self) {
        let mut m = self.metrics.lock();
        m.running = self.engine.num_running();
        m.waiting = self.engine.num_waiting();
        m.kv_usage = self.engine.kv_usage();
        m.engine = self.engine.counters.clone();
        m.pd.pinned_blocks = self.engine.num_pinned_blocks();
        m.pd.pinned_requests = self.engine.num_pinned_requests();
    }

    /// Runs until `cancel` fires or every command sender is gone.
    pub async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Command>,
        cancel: CancellationToken,
    ) {
        loop {
            if !self.engine.has_work() {
                self.expire_leases(Instant::now());
                self.update_gauges();
                let lease = self.next_lease();
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    cmd = rx.recv() => match cmd {
                        Some(c) => self.handle(c),
                        None => break,
                    },
                    _ = sleep_until_opt(lease) => {
                        continue;
                    }
                }
            }
            self.expire_leases(Instant::now());
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
                * self.slowdown(Instant::now());
            let started_at = Instant::now();
            self.step_metrics(&step);
            for (id, cached) in &step.started {
                if let Some(t) = self.tracks.get_mut(id) {
                    t.scheduled.get_or_insert(started_at);
                    let _ = t.tx.send(ReqEvent::Started {
                        idx: t.idx,
                        cached_tokens: *cached,
                    });
                    let q = started_at.duration_since(t.arrival).as_secs_f64();
                    self.metrics.lock().queue.observe(q);
                }
            }
            match self.cfg.scaled(ms) {
                Some(d) => {
                    let end = step_deadline(self.step_end, started_at, d);
                    self.step_end = Some(end);
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep_until(end) => {}
                    }
                }
                None => tokio::task::yield_now().await,
            }
            let outputs = self.engine.complete(&step);
            self.publish();
            let now = Instant::now();
            for out in outputs {
                if let Some(blocks) = out.pinned {
                    self.leases.insert(out.id, now + self.cfg.pd.kv_lease);
                    if let Some(t) = self.tracks.get(&out.id) {
                        let _ = t.tx.send(ReqEvent::Pinned {
                            idx: t.idx,
                            id: out.id,
                            blocks,
                        });
                    }
                }
                self.deliver(out.id, out.token, out.finished, now);
            }
            self.update_gauges();
        }
        // Shutdown: dropping the trackers ends every open response.
        let pinned: Vec<RequestId> = self.leases.drain().map(|(id, _)| id).collect();
        for id in pinned {
            self.engine.release_pinned(id);
        }
        self.tracks.clear();
    }

    fn deliver(&mut self, id: RequestId, token: u32, finished: Option<FinishReason>, now: Instant) {
        let Some(t) = self.tracks.get_mut(&id) else {
            return;
        };
        {
            let mut m = self.metrics.lock();
            match t.last_token {
                None => {
                    m.ttft.observe(now.duration_since(t.arrival).as_secs_f64());
                    let from = t.scheduled.unwrap_or(t.arrival);
                    m.prefill.observe(now.duration_since(from).as_secs_f64());
                    t.first_token = Some(now);
                }
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
            let decode_from = t.first_token.unwrap_or(now);
            m.decode
                .observe(now.duration_since(decode_from).as_secs_f64());
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

/// Sleeps until `at`, or forever without a deadline.
async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod timeline_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn back_to_back_steps_keep_the_models_timeline_and_idle_restarts_it() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        // The first step starts now.
        let e1 = step_deadline(None, t, ms(17));
        assert_eq!(e1, t + ms(17));
        // The timer woke 0.9 ms late: the next step still ends 17 ms after the first's due end,
        // so 100 steps take 1.7 s, not 1.79 s.
        let e2 = step_deadline(Some(e1), e1 + Duration::from_micros(900), ms(17));
        assert_eq!(e2, t + ms(34));
        // After an idle gap the timeline starts again from now (no burst of catch-up steps).
        let later = e2 + ms(500);
        assert_eq!(step_deadline(Some(e2), later, ms(17)), later + ms(17));
    }
}
