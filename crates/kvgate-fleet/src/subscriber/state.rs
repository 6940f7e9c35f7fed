//! The subscriber's bookkeeping for one publisher: which batches are applied, the history still to
//! fetch, and what a reconnect means. No sockets here except the replay exchanges.

use std::sync::Arc;

use kvgate_core::WorkerId;
use kvgate_protocol::kv_events::{KvEvent, KvEventBatch};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{replay, ReplayError, SubscriberSettings};
use crate::reset::ResetBus;
use crate::seq::{SeqTracker, SeqVerdict};
use crate::sink::{FleetSink, ResetReason};
use crate::stats::{inc, FleetStats};

/// Failed history replays before giving up on the history (the live stream is applied anyway).
const HISTORY_ATTEMPTS: u32 = 5;
/// Live batches held while the history is fetched; beyond this the history is given up.
const MAX_HELD: usize = 10_000;

/// History (replay from seq 0) still to fetch. Live batches wait in `held`, in arrival order:
/// applying them first and the older history after would replay removals over newer stores.
pub(super) struct Pending {
    held: Vec<KvEventBatch>,
    attempts: u32,
    pub next_try: Instant,
}

pub(super) struct State {
    pub worker: WorkerId,
    pub name: Arc<str>,
    pub s: SubscriberSettings,
    pub sink: Arc<dyn FleetSink>,
    pub stats: Arc<FleetStats>,
    pub bus: Arc<ResetBus>,
    pub epochs: watch::Receiver<u64>,
    pub seq: SeqTracker,
    /// `ts` of the last applied batch: with its seq it identifies the publisher process, so a
    /// reconnect can tell "same process, resume" from "restarted".
    last_ts: Option<f64>,
    reported_bs: Option<u32>,
    pub pending: Option<Pending>,
    /// The history of the current stream could not be fetched: stop trying until the next clear.
    history_abandoned: bool,
}

impl State {
    pub fn new(
        worker: WorkerId,
        name: Arc<str>,
        s: SubscriberSettings,
        sink: Arc<dyn FleetSink>,
        stats: Arc<FleetStats>,
        bus: Arc<ResetBus>,
    ) -> Self {
        let mut epochs = bus.epochs();
        epochs.borrow_and_update();
        State {
            worker,
            name,
            s,
            sink,
            stats,
            bus,
            epochs,
            seq: SeqTracker::new(),
            last_ts: None,
            reported_bs: None,
            pending: None,
            history_abandoned: false,
        }
    }

    /// Forgets everything applied (the index entries are gone) and schedules the history fetch.
    pub fn forget(&mut self) {
        self.seq.reset();
        self.last_ts = None;
        self.history_abandoned = false;
        self.pending = None;
        self.want_history(None);
    }

    /// Clears the worker's entries (every subscriber of the worker hears of it), then rebuilds.
    fn clear(&mut self, reason: ResetReason) {
        tracing::warn!(worker = %self.name, reason = reason.as_str(), "clearing the worker's KV index entries");
        self.bus.clear(reason);
        // Our own clear: rebuild here, not again when the epoch watch fires.
        self.epochs.borrow_and_update();
        self.forget();
    }

    /// Someone else (the health checker, another DP rank) cleared the worker.
    pub fn cleared_elsewhere(&mut self) {
        tracing::info!(worker = %self.name, "worker's KV index entries were cleared: rebuilding from replay");
        self.forget();
    }

    /// Schedules a replay of the whole buffer (when there is a replay endpoint), holding `first`.
    fn want_history(&mut self, first: Option<KvEventBatch>) {
        if self.s.source.replay_endpoint.is_none() || self.history_abandoned {
            if let Some(b) = first {
                self.apply(&b);
            }
            return;
        }
        let p = self.pending.get_or_insert_with(|| Pending {
            held: Vec::new(),
            attempts: 0,
            next_try: Instant::now(),
        });
        p.held.extend(first);
    }

    fn apply(&mut self, b: &KvEventBatch) {
        inc(&self.stats.kv_batches);
        self.stats
            .kv_events
            .fetch_add(b.events.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for ev in &b.events {
            match ev {
                KvEvent::AllCleared => inc(&self.stats.kv_resets),
                e if e.is_tier_only() => inc(&self.stats.kv_tier_only),
                KvEvent::Stored {
                    block_hashes,
                    token_ids,
                    block_size,
                    ..
                } => self.check_block_size(*block_size, block_hashes.len(), token_ids.len()),
                _ => {}
            }
        }
        self.sink.on_kv_events(self.worker, b);
        self.seq.applied(b.seq);
        self.last_ts = Some(b.ts);
    }

    fn check_block_size(&mut self, bs: u32, blocks: usize, tokens: usize) {
        let Some(cfg) = self.s.block_size else { return };
        // Only full blocks say anything about the block size (SGLang's last page may be short).
        if bs == 0 || tokens != blocks * bs as usize || self.reported_bs == Some(bs) {
            return;
        }
        if bs == cfg {
            if self.reported_bs.take().is_some() {
                tracing::info!(worker = %self.name, block_size = bs,
                    "KV events use the configured block size again: worker back in KV scoring");
                self.sink.on_block_size_agrees(self.worker);
            }
            return;
        }
        self.reported_bs = Some(bs);
        tracing::error!(worker = %self.name, engine_block_size = bs, configured = cfg,
            "KV events use another block size: worker excluded from KV scoring");
        self.sink.on_block_size(self.worker, bs, cfg);
    }

    async fn replay_from(
        &self,
        from: u64,
        cancel: &CancellationToken,
    ) -> Option<Result<Vec<KvEventBatch>, ReplayError>> {
        let ep = self.s.source.replay_endpoint.as_deref()?;
        tokio::select! {
            _ = cancel.cancelled() => None,
            r = replay(ep, from, self.s.replay_timeout) => Some(r),
        }
    }

    /// Applies replayed batches newer than the last applied one; `floor` marks the live overlap.
    fn apply_replayed(&mut self, batches: &[KvEventBatch], floor: u64) {
        inc(&self.stats.kv_replays_ok);
        self.seq.replayed_from(floor);
        for b in batches {
            if b.seq >= floor && self.seq.last().is_none_or(|l| b.seq > l) {
                self.apply(b);
            }
        }
    }

    /// Replays `[from, ..]` to fill a gap. False when the buffer no longer covers it.
    async fn fill(&mut self, from: u64, cancel: &CancellationToken) -> bool {
        match self.replay_from(from, cancel).await {
            None => false,
            Some(Ok(batches)) if batches.first().is_some_and(|b| b.seq <= from) => {
                self.apply_replayed(&batches, from);
                true
            }
            Some(Ok(batches)) => {
                inc(&self.stats.kv_replays_failed);
                tracing::warn!(worker = %self.name, from, first = ?batches.first().map(|b| b.seq),
                    "replay no longer covers the gap");
                false
            }
            Some(Err(e)) => {
                inc(&self.stats.kv_replays_failed);
                tracing::warn!(worker = %self.name, from, error = %e, "replay failed");
                false
            }
        }
    }

    /// Fetches the history (what the replay buffer holds from seq 0), then the held live batches.
    /// A failure is retried with backoff; after [`HISTORY_ATTEMPTS`] the history is given up.
    pub async fn fetch_history(&mut self, cancel: &CancellationToken) {
        match &self.pending {
            None => return,
            Some(p) if p.attempts >= HISTORY_ATTEMPTS => return self.abandon_history(cancel).await,
            Some(_) => {}
        }
        let r = self.replay_from(0, cancel).await;
        if cancel.is_cancelled() {
            return;
        }
        let Some(p) = self.pending.as_mut() else {
            return;
        };
        match r {
            Some(Ok(batches)) => {
                let held = std::mem::take(&mut p.held);
                self.pending = None;
                let floor = batches.first().map_or(0, |b| b.seq);
                self.apply_replayed(&batches, floor);
                tracing::info!(worker = %self.name, batches = batches.len(), "KV event history replayed");
                self.release(held, cancel).await;
            }
            Some(Err(e)) => {
                inc(&self.stats.kv_replays_failed);
                p.attempts += 1;
                let wait = self.s.history_retry * 2u32.pow(p.attempts.min(5));
                p.next_try = Instant::now() + wait;
                tracing::warn!(worker = %self.name, error = %e, attempt = p.attempts,
                    "history replay failed; retrying");
                if p.attempts >= HISTORY_ATTEMPTS {
                    self.abandon_history(cancel).await;
                }
            }
            None => {}
        }
    }

    async fn abandon_history(&mut self, cancel: &CancellationToken) {
        tracing::warn!(worker = %self.name, "giving up on the KV event history: blocks published \
            before now are not indexed until the engine stores them again");
        self.history_abandoned = true;
        let held = self.pending.take().map(|p| p.held).unwrap_or_default();
        self.release(held, cancel).await;
    }

    async fn release(&mut self, held: Vec<KvEventBatch>, cancel: &CancellationToken) {
        for b in held {
            self.on_batch(b, cancel).await;
        }
    }

    /// A live batch.
    pub async fn on_batch(&mut self, b: KvEventBatch, cancel: &CancellationToken) {
        if let Some(p) = self.pending.as_mut() {
            p.held.push(b);
            if p.held.len() > MAX_HELD {
                // Waited too long: the loop gives up on the history at once.
                p.attempts = HISTORY_ATTEMPTS;
                p.next_try = Instant::now();
            }
            return;
        }
        match self.seq.check(b.seq) {
            SeqVerdict::InOrder => self.apply(&b),
            SeqVerdict::Duplicate => {}
            SeqVerdict::First { missed_history } => {
                if missed_history {
                    self.want_history(Some(b));
                } else {
                    self.apply(&b);
                }
            }
            SeqVerdict::Gap { expected, got } => {
                inc(&self.stats.kv_gaps);
                tracing::info!(worker = %self.name, expected, got, "KV event gap");
                if !self.fill(expected, cancel).await {
                    // The state is unknown: start over from what the buffer still holds.
                    self.clear(ResetReason::GapUnrecoverable);
                    self.want_history(Some(b));
                } else if self.seq.last().is_none_or(|l| b.seq > l) {
                    self.apply(&b);
                }
            }
            SeqVerdict::Regression { last, got } => {
                tracing::info!(worker = %self.name, last, got, "KV event sequence went back: publisher restarted");
                self.clear(ResetReason::SeqRegression);
                self.want_history(Some(b));
            }
        }
    }

    /// Anti-entropy while the stream is quiet: replays from the next expected seq. Batches the
    /// live socket never delivered (published before the publisher registered our subscription, or
    /// dropped at its high-water mark) would otherwise stay missing until a later batch revealed
    /// the gap — forever, if none comes. Same connection, so the same process. Returns whether
    /// anything was missing.
    pub async fn catch_up(&mut self, cancel: &CancellationToken) -> bool {
        if self.pending.is_some() {
            return false;
        }
        let from = self.seq.last().map_or(0, |l| l + 1);
        let batches = match self.replay_from(from, cancel).await {
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                tracing::debug!(worker = %self.name, error = %e, "idle catch-up replay failed");
                return false;
            }
            None => return false,
        };
        let Some(first) = batches.first() else {
            return false;
        };
        inc(&self.stats.kv_gaps);
        if self.seq.last().is_some() && first.seq > from {
            tracing::warn!(worker = %self.name, from, first = first.seq,
                "missed KV events no longer buffered");
            self.clear(ResetReason::GapUnrecoverable);
            return true;
        }
        tracing::info!(worker = %self.name, from, batches = batches.len(),
            "KV events the live stream missed were caught up by replay");
        self.apply_replayed(&batches, first.seq.max(from));
        true
    }

    /// After a reconnect: is it the same publisher process? Replay from the last applied seq: the
    /// same process still buffers that batch with the same timestamp, and the replay fills what
    /// was published while we were away. Anything else (another timestamp, the seq no longer
    /// buffered, no replay endpoint, replay failed) is a restart: clear and rebuild.
    pub async fn resume(&mut self, cancel: &CancellationToken) {
        let (Some(last), Some(ts)) = (self.seq.last(), self.last_ts) else {
            return;
        };
        match self.replay_from(last, cancel).await {
            Some(Ok(batches)) if batches.first().is_some_and(|b| b.seq == last && b.ts == ts) => {
                self.apply_replayed(&batches, last);
                tracing::info!(worker = %self.name, from = last, "KV event publisher reconnected: same process, resumed");
            }
            Some(r) => {
                if let Err(e) = &r {
                    inc(&self.stats.kv_replays_failed);
                    tracing::warn!(worker = %self.name, error = %e, "replay after reconnect failed");
                }
                self.clear(ResetReason::Restart);
            }
            None if cancel.is_cancelled() => {}
            // vLLM's PUB socket closes only when the process exits; without a replay endpoint to
            // prove otherwise, the cache we mirrored is gone.
            None => self.clear(ResetReason::Restart),
        }
    }
}
