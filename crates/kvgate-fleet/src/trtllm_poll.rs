//! TensorRT-LLM KV events: poll `POST /kv_cache_events` (the call drains the queue, so kvgate must be
//! the only consumer) and feed the same sink as the ZMQ subscriber.
//!
//! Event ids increase by one; a jump means the worker's event buffer overflowed (state unknown) and
//! a decrease means it restarted: both reset the worker. `created` (cache manager (re)built) resets
//! too. A block moved from level 0 to a lower tier is removed from the GPU view.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_core::WorkerId;
use kvgate_protocol::kv_events::{KvEvent, KvEventBatch, Medium};
use kvgate_protocol::trtllm::{parse_kv_cache_events, TrtllmEventKind};
use tokio_util::sync::CancellationToken;

use crate::http::HttpClient;
use crate::seq::{SeqTracker, SeqVerdict};
use crate::sink::{FleetSink, ResetReason};
use crate::stats::{inc, FleetStats};

pub(crate) struct PollSettings {
    pub base: String,
    pub interval: Duration,
    pub timeout: Duration,
}

/// Turns one poll response into sink calls. Pure apart from the sink; returns the batches applied.
pub(crate) fn deliver(
    body: &[u8],
    worker: WorkerId,
    seq: &mut SeqTracker,
    sink: &dyn FleetSink,
    stats: &FleetStats,
) -> usize {
    let events = match parse_kv_cache_events(body) {
        Ok(e) => e,
        Err(e) => {
            inc(&stats.kv_malformed);
            tracing::debug!(%worker, error = %e, "malformed /kv_cache_events response dropped");
            return 0;
        }
    };
    let mut applied = 0;
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for ev in events {
        let reset = |reason, seq: &mut SeqTracker| {
            inc(&stats.kv_resets);
            sink.on_kv_reset(worker, reason);
            seq.reset();
        };
        match seq.check(ev.event_id) {
            SeqVerdict::First { .. } | SeqVerdict::InOrder => {}
            SeqVerdict::Duplicate => continue,
            SeqVerdict::Gap { .. } => {
                inc(&stats.kv_gaps);
                reset(ResetReason::GapUnrecoverable, seq);
            }
            SeqVerdict::Regression { .. } => reset(ResetReason::SeqRegression, seq),
        }
        let events = match ev.kind {
            TrtllmEventKind::Created { .. } => {
                reset(ResetReason::AllBlocksCleared, seq);
                Vec::new()
            }
            TrtllmEventKind::Kv(evs) => evs,
            TrtllmEventKind::Updated {
                block_hash,
                cache_level: Some((0, new)),
            } if new != 0 => {
                vec![KvEvent::Removed {
                    block_hashes: vec![block_hash],
                    medium: Medium::Gpu,
                    group_idx: 0,
                }]
            }
            TrtllmEventKind::Updated { .. } => Vec::new(),
        };
        if !events.is_empty() {
            inc(&stats.kv_batches);
            stats
                .kv_events
                .fetch_add(events.len() as u64, std::sync::atomic::Ordering::Relaxed);
            let batch = KvEventBatch {
                seq: ev.event_id,
                ts,
                dp_rank: ev.dp_rank,
                events,
            };
            sink.on_kv_events(worker, &batch);
            applied += 1;
        }
        seq.applied(ev.event_id);
    }
    applied
}

pub(crate) async fn run(
    worker: WorkerId,
    client: HttpClient,
    s: PollSettings,
    sink: Arc<dyn FleetSink>,
    stats: Arc<FleetStats>,
    cancel: CancellationToken,
) {
    let mut seq = SeqTracker::new();
    loop {
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = client.post_json(&s.base, "/kv_cache_events", Bytes::new(), s.timeout) => r,
        };
        match r {
            Ok(f) if f.status.is_success() => {
                deliver(&f.body, worker, &mut seq, &*sink, &stats);
            }
            Ok(f) => tracing::debug!(%worker, status = %f.status, "/kv_cache_events failed"),
            Err(e) => tracing::debug!(%worker, error = %e, "/kv_cache_events failed"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(s.interval) => {}
        }
    }
}
