//! KV-event subscriber: one ZMQ SUB socket per publisher (DP rank), sequence checks, replay of gaps
//! over the publisher's ROUTER socket (`subscriber/replay.rs`), reconnect with backoff.
//!
//! Every decoded batch goes to [`FleetSink::on_kv_events`] in sequence order. A malformed message is
//! counted and dropped; a sequence regression resets the worker's index entries; a gap the replay
//! buffer no longer covers does too (the state is unknown), and so does a gap with no replay endpoint.
//! A publisher that disconnected and came back is treated as restarted (a fast restart can outrun
//! the old sequence number, so a regression alone would miss it); the first batch after any reset
//! replays the buffer from 0 to recover what was published while we were not listening.

mod replay;

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::WorkerId;
use kvgate_protocol::kv_events::{decode_multipart, KvEvent, KvEventBatch};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv};

use crate::discover::KvSource;
use crate::seq::{SeqTracker, SeqVerdict};
use crate::sink::{FleetSink, ResetReason};
use crate::stats::{inc, FleetStats};

pub use replay::{replay, ReplayError};

/// Settings of one subscriber.
#[derive(Debug, Clone)]
pub struct SubscriberSettings {
    pub source: KvSource,
    /// The pool's block size (for the mismatch check); `None` skips the check.
    pub block_size: Option<u32>,
    pub connect_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Bound on one whole replay exchange.
    pub replay_timeout: Duration,
}

impl SubscriberSettings {
    pub fn new(source: KvSource) -> Self {
        SubscriberSettings {
            source,
            block_size: None,
            connect_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            replay_timeout: Duration::from_secs(5),
        }
    }
}

struct State {
    worker: WorkerId,
    name: Arc<str>,
    s: SubscriberSettings,
    sink: Arc<dyn FleetSink>,
    stats: Arc<FleetStats>,
    seq: SeqTracker,
    reported_bs: Option<u32>,
}

impl State {
    fn reset(&mut self, reason: ResetReason) {
        inc(&self.stats.kv_resets);
        tracing::warn!(worker = %self.name, reason = reason.as_str(), "clearing the worker's KV index entries");
        self.sink.on_kv_reset(self.worker, reason);
        self.seq.reset();
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
    }

    fn check_block_size(&mut self, bs: u32, blocks: usize, tokens: usize) {
        let Some(cfg) = self.s.block_size else { return };
        // Only full blocks say anything about the block size (SGLang's last page may be short).
        if bs == cfg || bs == 0 || tokens != blocks * bs as usize || self.reported_bs == Some(bs) {
            return;
        }
        self.reported_bs = Some(bs);
        tracing::error!(worker = %self.name, engine_block_size = bs, configured = cfg,
            "KV events use another block size: worker excluded from KV scoring");
        self.sink.on_block_size(self.worker, bs, cfg);
    }

    /// Replays `[from, ..]` and applies what is newer than the last applied batch. Returns false
    /// when the gap could not be filled; with `partial_ok` whatever the buffer still holds is applied
    /// anyway (history after joining late: nothing is lost by taking part of it).
    async fn fill(&mut self, from: u64, partial_ok: bool, cancel: &CancellationToken) -> bool {
        let Some(ep) = self.s.source.replay_endpoint.clone() else {
            return false;
        };
        let r = tokio::select! {
            _ = cancel.cancelled() => return false,
            r = replay(&ep, from, self.s.replay_timeout) => r,
        };
        match r {
            Ok(batches) if partial_ok || batches.first().is_some_and(|b| b.seq <= from) => {
                inc(&self.stats.kv_replays_ok);
                self.seq
                    .replayed_from(batches.first().map_or(from, |b| b.seq.max(from)));
                for b in &batches {
                    if b.seq >= from && self.seq.last().is_none_or(|l| b.seq > l) {
                        self.apply(b);
                    }
                }
                true
            }
            Ok(batches) => {
                inc(&self.stats.kv_replays_failed);
                tracing::warn!(worker = %self.name, from, first = ?batches.first().map(|b| b.seq),
                    "replay no longer covers the gap");
                false
            }
            Err(e) => {
                inc(&self.stats.kv_replays_failed);
                tracing::warn!(worker = %self.name, from, error = %e, "replay failed");
                false
            }
        }
    }

    /// The first batch after joining (or after a reset): fetch the history the replay buffer still
    /// holds (best effort; nothing to clear), then apply.
    async fn first(&mut self, b: KvEventBatch, missed_history: bool, cancel: &CancellationToken) {
        if missed_history && self.s.source.replay_endpoint.is_some() {
            self.fill(0, true, cancel).await;
        }
        if self.seq.last().is_none_or(|l| b.seq > l) {
            self.apply(&b);
        }
    }

    async fn on_batch(&mut self, b: KvEventBatch, cancel: &CancellationToken) {
        match self.seq.check(b.seq) {
            SeqVerdict::InOrder => self.apply(&b),
            SeqVerdict::Duplicate => {}
            SeqVerdict::First { missed_history } => self.first(b, missed_history, cancel).await,
            SeqVerdict::Gap { expected, got } => {
                inc(&self.stats.kv_gaps);
                tracing::info!(worker = %self.name, expected, got, "KV event gap");
                if !self.fill(expected, false, cancel).await {
                    self.reset(ResetReason::GapUnrecoverable);
                }
                if self.seq.last().is_none_or(|l| b.seq > l) {
                    self.apply(&b);
                }
            }
            SeqVerdict::Regression { last, got } => {
                tracing::info!(worker = %self.name, last, got, "KV event sequence went back: publisher restarted");
                self.reset(ResetReason::SeqRegression);
                // The new process's first batches may have been missed while reconnecting.
                self.first(b, got > 0, cancel).await;
            }
        }
    }
}

/// Runs until `cancel` fires.
pub(crate) async fn run(
    worker: WorkerId,
    name: Arc<str>,
    s: SubscriberSettings,
    sink: Arc<dyn FleetSink>,
    stats: Arc<FleetStats>,
    cancel: CancellationToken,
) {
    let mut st = State {
        worker,
        name,
        s,
        sink,
        stats,
        seq: SeqTracker::new(),
        reported_bs: None,
    };
    let mut backoff = st.s.backoff_min;
    let mut first = true;
    loop {
        if !first {
            inc(&st.stats.kv_reconnects);
            let wait = crate::scrape::jittered(backoff, 0.2);
            backoff = (backoff * 2).min(st.s.backoff_max);
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        first = false;
        let mut sock = zeromq::SubSocket::new();
        // zeromq reconnects a lost peer by itself; the monitor tells us it happened.
        let mut monitor = sock.monitor();
        let ep = st.s.source.endpoint.clone();
        let connected = tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(st.s.connect_timeout, sock.connect(&ep)) => r,
        };
        match connected {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!(worker = %st.name, endpoint = %ep, error = %e, "KV event connect failed");
                continue;
            }
            Err(_) => {
                tracing::debug!(worker = %st.name, endpoint = %ep, "KV event connect timed out");
                continue;
            }
        }
        if let Err(e) = sock.subscribe(&st.s.source.topic).await {
            tracing::debug!(worker = %st.name, error = %e, "KV event subscribe failed");
            continue;
        }
        tracing::info!(worker = %st.name, endpoint = %ep, "subscribed to KV events");
        loop {
            let msg = tokio::select! {
                _ = cancel.cancelled() => return,
                m = sock.recv() => m,
            };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    tracing::info!(worker = %st.name, error = %e, "KV event socket lost; reconnecting");
                    break;
                }
            };
            backoff = st.s.backoff_min;
            let mut reconnected = false;
            while let Ok(ev) = monitor.try_recv() {
                reconnected |= matches!(ev, zeromq::SocketEvent::Disconnected(_));
            }
            if reconnected && st.seq.last().is_some() {
                // vLLM's PUB socket closes only when the process exits: the cache we mirrored is
                // gone. (After a mere network blip this under-reports until replay refills it.)
                tracing::info!(worker = %st.name, "KV event publisher reconnected: treating it as a restart");
                st.reset(ResetReason::Restart);
            }
            let frames = msg.into_vec();
            match decode_multipart(&frames) {
                Ok(b) => st.on_batch(b, &cancel).await,
                Err(e) => {
                    inc(&st.stats.kv_malformed);
                    tracing::debug!(worker = %st.name, error = %e, "malformed KV event message dropped");
                }
            }
        }
    }
}
