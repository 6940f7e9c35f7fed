//! Counters of the background tasks, as atomics the gateway re-exports as metrics
//! (`kvgate_worker_kv_events_total{worker,result}` and friends).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Per-worker counters. All monotonic except where noted; read with [`FleetStats::snapshot`].
#[derive(Debug, Default)]
pub struct FleetStats {
    pub scrapes_ok: AtomicU64,
    pub scrapes_failed: AtomicU64,
    /// Times the scraped load went stale (fail open).
    pub scrapes_stale: AtomicU64,
    pub kv_batches: AtomicU64,
    pub kv_events: AtomicU64,
    /// Messages that failed to decode: counted and dropped.
    pub kv_malformed: AtomicU64,
    /// Offload-tier events (hashes only) recorded as tier information.
    pub kv_tier_only: AtomicU64,
    pub kv_gaps: AtomicU64,
    pub kv_replays_ok: AtomicU64,
    pub kv_replays_failed: AtomicU64,
    /// Index resets (sequence regression, `AllBlocksCleared`, restart, unrecoverable gap).
    pub kv_resets: AtomicU64,
    pub kv_reconnects: AtomicU64,
    pub health_ok: AtomicU64,
    pub health_failed: AtomicU64,
    pub dcgm_scrapes_ok: AtomicU64,
    pub dcgm_scrapes_failed: AtomicU64,
    /// The last figures of the worker's dcgm-exporter (`None` without `dcgm_url`, or stale).
    pub gpu: parking_lot::Mutex<Option<crate::dcgm::GpuStats>>,
}

/// A plain copy of [`FleetStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub scrapes_ok: u64,
    pub scrapes_failed: u64,
    pub scrapes_stale: u64,
    pub kv_batches: u64,
    pub kv_events: u64,
    pub kv_malformed: u64,
    pub kv_tier_only: u64,
    pub kv_gaps: u64,
    pub kv_replays_ok: u64,
    pub kv_replays_failed: u64,
    pub kv_resets: u64,
    pub kv_reconnects: u64,
    pub health_ok: u64,
    pub health_failed: u64,
}

pub(crate) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

impl FleetStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |c: &AtomicU64| c.load(Relaxed);
        StatsSnapshot {
            scrapes_ok: g(&self.scrapes_ok),
            scrapes_failed: g(&self.scrapes_failed),
            scrapes_stale: g(&self.scrapes_stale),
            kv_batches: g(&self.kv_batches),
            kv_events: g(&self.kv_events),
            kv_malformed: g(&self.kv_malformed),
            kv_tier_only: g(&self.kv_tier_only),
            kv_gaps: g(&self.kv_gaps),
            kv_replays_ok: g(&self.kv_replays_ok),
            kv_replays_failed: g(&self.kv_replays_failed),
            kv_resets: g(&self.kv_resets),
            kv_reconnects: g(&self.kv_reconnects),
            health_ok: g(&self.health_ok),
            health_failed: g(&self.health_failed),
        }
    }
}
