//! [`ResetBus`]: the one place a worker's KV index entries are cleared, so every task that mirrors
//! part of that index learns about it.
//!
//! Clearing is worker-wide (`FleetSink::on_kv_reset`), but the mirror is built by several tasks: one
//! subscriber per DP rank, each with its own sequence state, and the health checker can decide the
//! worker restarted. A clear that a subscriber does not hear about leaves it believing its history is
//! applied while the index is empty — it then applies only new events on top of nothing, forever
//! (this was the `restarted_sim_worker_is_cleared_and_rebuilt` flake: the health checker's "came
//! back" clear landed after the subscriber had already rebuilt from replay). So every clear goes
//! through here and bumps an epoch; each subscriber watches it and, on a bump it did not cause,
//! forgets its sequence state and rebuilds its part from the replay buffer.

use std::sync::Arc;

use kvgate_core::WorkerId;
use tokio::sync::{watch, Notify};

use crate::sink::{FleetSink, ResetReason};
use crate::stats::{inc, FleetStats};

pub(crate) struct ResetBus {
    worker: WorkerId,
    sink: Arc<dyn FleetSink>,
    stats: Arc<FleetStats>,
    /// Bumped by every clear.
    epoch: watch::Sender<u64>,
    /// Bumped when the health checker saw the worker come back (it may be on new event ports).
    restarts: watch::Sender<u64>,
    /// A subscriber keeps failing to connect: its endpoint may be stale.
    rediscover: Notify,
}

impl ResetBus {
    pub fn new(worker: WorkerId, sink: Arc<dyn FleetSink>, stats: Arc<FleetStats>) -> Self {
        ResetBus {
            worker,
            sink,
            stats,
            epoch: watch::Sender::new(0),
            restarts: watch::Sender::new(0),
            rediscover: Notify::new(),
        }
    }

    /// Drops every index entry of the worker and tells all subscribers. Returns the new epoch (the
    /// caller, if a subscriber, takes it as seen: it rebuilds on its own terms).
    pub fn clear(&self, reason: ResetReason) -> u64 {
        inc(&self.stats.kv_resets);
        self.sink.on_kv_reset(self.worker, reason);
        let mut now = 0;
        self.epoch.send_modify(|e| {
            *e += 1;
            now = *e;
        });
        now
    }

    /// The health checker saw the worker come back: clear, and let the KV feed re-discover.
    pub fn restarted(&self) {
        self.clear(ResetReason::Restart);
        self.restarts.send_modify(|e| *e += 1);
    }

    pub fn epochs(&self) -> watch::Receiver<u64> {
        self.epoch.subscribe()
    }

    pub fn restarts(&self) -> watch::Receiver<u64> {
        self.restarts.subscribe()
    }

    pub fn ask_rediscover(&self) {
        self.rediscover.notify_one();
    }

    pub async fn rediscover_asked(&self) {
        self.rediscover.notified().await
    }
}
