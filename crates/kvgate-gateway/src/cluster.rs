//! Cluster mode (`[cluster]`): this replica's side of kvgate-cluster. Peers' messages are applied
//! here — routing decisions to the KV index, load deltas to the router's per-replica
//! [`kvgate_core::RemoteLoads`] (never to our own accounting), breaker verdicts to the workers'
//! breakers, API-key usage to the rate-limit buckets, flow-control reports (queue heads, class
//! clocks, tenants' usage) to the admission queue, response pins and session → worker
//! bindings to their tables — and our breaker transitions are published
//! from a watcher on the heartbeat period. The router publishes its own decisions and load deltas
//! (`router.rs`); nothing here is on the request path.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvgate_cluster::{Cluster, ClusterConfig, DropReason, Message, Sink};
use kvgate_core::{IndexMode, WorkerId};
use kvgate_fleet::BreakerState;

use crate::auth::Auth;
use crate::config::ClusterSection;
use crate::fleet::WorkerFleet;
use crate::route::router::note_routed;

/// The gateway's [`Sink`]: what peers' messages change here.
pub struct GatewayPeers {
    fleet: Arc<WorkerFleet>,
    auth: Arc<ArcSwap<Auth>>,
    pins: Arc<crate::pins::ResponsePins>,
    metrics: kvgate_cluster::ClusterMetrics,
}

impl GatewayPeers {
    /// The worker called `name` here, with its pool's block size (16 when it serves no model).
    fn worker(&self, name: &str) -> Option<(WorkerId, u32)> {
        let fleet = self.fleet.registry.snapshot();
        let w = fleet.named(name)?;
        let block_size = w
            .models
            .first()
            .and_then(|m| fleet.pool(m))
            .map_or(16, |p| p.block_size);
        Some((w.id, block_size))
    }
}

impl Sink for GatewayPeers {
    fn apply(&self, from: &str, msg: &Message, now: Instant) -> Result<(), DropReason> {
        let router = &self.fleet.router;
        match msg {
            Message::Route {
                worker,
                request,
                prefill_tokens,
                blocks,
                hashes,
                ..
            } => {
                let (id, block_size) = self.worker(worker).ok_or(DropReason::UnknownWorker)?;
                if hashes.is_empty() {
                    router.with_remote(|r| {
                        r.dispatch(from, *request, id, *prefill_tokens, *blocks, now)
                    });
                    return Ok(());
                }
                let prefill = router.with_index_mut(|index| {
                    // The peer counted the prompt tokens beyond the prefix it thought the worker
                    // held. We may know more of it (our own or another peer's decision of the
                    // same instant put it there): then the request's prefill is what one replica
                    // routing both would have counted for it.
                    let held = index.held_prefix(id, hashes) as u32;
                    let assumed = (hashes.len() as u32).saturating_sub(*blocks);
                    let extra = held.saturating_sub(assumed);
                    note_routed(index, id, hashes, now);
                    prefill_tokens.saturating_sub(u64::from(extra) * u64::from(block_size))
                });
                // Its blocks join the active set of that worker with ours and every other
                // peer's, so a prefix several replicas sent there at the same instant counts
                // once (`RemoteLoads`, module docs).
                let guard = router
                    .active()
                    .add_at(id, *request, hashes, prefill, 0, now);
                router.with_remote(|r| r.dispatch_tracked(from, *request, guard, now));
            }
            Message::PrefillDone { request } => {
                router.with_remote(|r| r.prefill_done(from, *request, now))
            }
            Message::Free { request } => {
                router.with_remote(|r| r.free(from, *request, now));
                // A peer's slot freed: in cluster mode the busy bound counts it, so our queue
                // may now use it (flow control: and may be the one it was left to).
                router.admission().release();
            }
            Message::Flow(report) => {
                router.admission().apply_peer(from, report, now);
                router.with_remote(|r| r.heard(from, now));
            }
            Message::Health { worker, open } => {
                let fleet = self.fleet.registry.snapshot();
                let w = fleet.named(worker).ok_or(DropReason::UnknownWorker)?;
                if *open {
                    if w.state.breaker.open_by_peer(now) {
                        tracing::warn!(worker = %w.name, peer = from, "breaker opened by a peer's verdict");
                    }
                } else if w.state.breaker.close_by_peer() {
                    tracing::info!(worker = %w.name, peer = from, "breaker closed by a peer's verdict");
                }
                router.with_remote(|r| r.heard(from, now));
            }
            Message::Heartbeat { .. } => router.with_remote(|r| r.heard(from, now)),
            Message::Pin { id, worker } => {
                let fleet = self.fleet.registry.snapshot();
                let w = fleet.named(worker).ok_or(DropReason::UnknownWorker)?;
                self.pins.learn_from_peer(id, &w.name, now);
            }
            Message::Session { key, worker } => {
                let fleet = self.fleet.registry.snapshot();
                let w = fleet.named(worker).ok_or(DropReason::UnknownWorker)?;
                router.peer_session(*key, w.stable_id, now);
            }
            Message::RateUsage { keys } => {
                let auth = self.auth.load();
                for (key, n) in keys {
                    auth.charge_peer(*key, *n, now);
                }
                router.with_remote(|r| r.heard(from, now));
            }
            Message::Snapshot(s) => {
                let fleet = self.fleet.registry.snapshot();
                let id_of = |name: &str| fleet.named(name).map(|w| w.id);
                router.with_index_mut(|index| {
                    for (worker, hashes) in &s.approx {
                        if let Some(id) = id_of(worker) {
                            if matches!(index.mode(id), Some(IndexMode::Approximate(_))) {
                                index.record_routed(id, hashes, now);
                            }
                        }
                    }
                });
                let entries: Vec<_> = s
                    .inflight
                    .iter()
                    .filter_map(|e| {
                        id_of(&e.worker).map(|id| (e.request, id, e.prefill_tokens, e.blocks))
                    })
                    .collect();
                // The first part of a snapshot replaces what we hold of `from`; a continuation
                // adds to it.
                if s.part == 0 {
                    router.with_remote(|r| r.replace(from, entries, now));
                } else {
                    router.with_remote(|r| r.extend(from, entries, now));
                }
                router.admission().release();
            }
        }
        Ok(())
    }

    fn approx_entries(&self) -> Vec<(String, Vec<u64>)> {
        let fleet = self.fleet.registry.snapshot();
        self.fleet.router.with_index(|index| {
            fleet
                .workers
                .iter()
                .filter(|w| matches!(index.mode(w.id), Some(IndexMode::Approximate(_))))
                .map(|w| (w.name.to_string(), index.router_hashes(w.id)))
                .filter(|(_, h)| !h.is_empty())
                .collect()
        })
    }

    fn expire(&self, now: Instant, timeout: Duration) {
        let (gone, inflight) = {
            self.fleet.router.with_remote(|remote| {
                let gone = remote.expire(now, timeout);
                (gone, remote.total_inflight())
            })
        };
        self.metrics.remote_inflight.set(inflight as i64);
        self.fleet.router.admission().expire_peers(now, timeout);
        if !gone.is_empty() {
            // Their load no longer counts: capacity may have freed.
            self.fleet.router.admission().release();
        }
        for r in gone {
            tracing::warn!(peer = %r, "cluster: peer silent past the heartbeat timeout; its load share expired");
        }
    }

    fn take_rate_usage(&self) -> Vec<(u64, u32)> {
        self.auth.load().take_usage()
    }

    fn flow_report(&self) -> Option<kvgate_cluster::FlowReport> {
        self.fleet.router.admission().report()
    }

    fn route_lag(&self, lag: Duration, now: Instant) {
        self.fleet.router.with_remote(|r| r.observe_lag(lag, now));
    }
}

/// The cluster config slice from `[cluster]`, or `None` when cluster mode is off.
pub fn config(c: &ClusterSection) -> anyhow::Result<Option<ClusterConfig>> {
    if c.nats_url.is_empty() {
        return Ok(None);
    }
    anyhow::ensure!(
        c.heartbeat_interval_ms > 0 && c.heartbeat_timeout_ms > c.heartbeat_interval_ms,
        "cluster.heartbeat_timeout_ms must exceed cluster.heartbeat_interval_ms (> 0)"
    );
    anyhow::ensure!(
        c.max_message_bytes >= 1024,
        "cluster.max_message_bytes must be at least 1024"
    );
    let replica_id = match &c.replica_id {
        Some(r) if !r.is_empty() => r.clone(),
        _ => hostname(),
    };
    Ok(Some(ClusterConfig {
        nats_url: c.nats_url.clone(),
        replica_id,
        subject_prefix: c.subject_prefix.clone(),
        heartbeat_interval: Duration::from_millis(c.heartbeat_interval_ms),
        heartbeat_timeout: Duration::from_millis(c.heartbeat_timeout_ms),
        max_message_bytes: c.max_message_bytes,
        queue_capacity: c.queue_capacity,
        snapshot_wait: Duration::from_millis(c.snapshot_wait_ms),
    }))
}

/// `HOSTNAME` (set in containers), else /etc/hostname, else a random id.
fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| format!("kvgate-{:016x}", fastrand::u64(..)))
}

/// Start cluster mode: the NATS tasks, the router's publishing (with our decisions' provisional
/// load, `provisional_window`), and the breaker watcher.
pub fn start(
    cfg: ClusterConfig,
    provisional_window: Duration,
    fleet: Arc<WorkerFleet>,
    auth: Arc<ArcSwap<Auth>>,
    pins: Arc<crate::pins::ResponsePins>,
    metrics: kvgate_cluster::ClusterMetrics,
) -> anyhow::Result<Arc<Cluster>> {
    let sink = Arc::new(GatewayPeers {
        fleet: fleet.clone(),
        auth: auth.clone(),
        pins: pins.clone(),
        metrics: metrics.clone(),
    });
    let interval = cfg.heartbeat_interval;
    let cluster = Cluster::start(cfg, sink, metrics).map_err(|e| anyhow::anyhow!(e))?;
    fleet
        .router
        .with_remote(|r| r.set_provisional_window(provisional_window));
    fleet.router.set_cluster(cluster.clone());
    pins.set_cluster(cluster.clone());
    tracing::info!(replica = cluster.replica_id(), "cluster mode on");
    let c = cluster.clone();
    let shutdown = fleet.shutdown.clone();
    tokio::spawn(async move {
        let mut last: HashMap<Arc<str>, bool> = HashMap::new();
        let mut tick = tokio::time::interval(interval.min(Duration::from_millis(250)));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.cancelled() => { c.shutdown(); return; }
            }
            let snap = fleet.registry.snapshot();
            for w in &snap.workers {
                // Open or half-open (not yet proven good) on our own outcomes; a breaker opened on
                // a peer's word is not echoed back.
                let open = w.state.breaker.state() != BreakerState::Closed
                    && !w.state.breaker.opened_by_peer();
                let was = last.insert(w.name.clone(), open).unwrap_or(false);
                if open != was {
                    c.health(&w.name, open);
                }
            }
        }
    });
    Ok(cluster)
}
