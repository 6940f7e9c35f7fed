//! `kvgate_cluster_*` metric families, registered into the gateway's registry. Labels are the
//! fixed [`Kind`] and [`DropReason`] sets (`kind="unknown"` when a message failed before its kind).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::wire::{DropReason, Kind};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabel {
    pub kind: &'static str,
    pub reason: &'static str,
}

/// The cluster's metric handles (cheap clones of the registered families).
#[derive(Clone)]
pub struct ClusterMetrics {
    pub peers: Gauge,
    pub remote_inflight: Gauge,
    pub connected: Gauge,
    pub connects: Counter,
    pub messages_in: Family<KindLabel, Counter>,
    pub messages_out: Family<KindLabel, Counter>,
    pub dropped: Family<DropLabel, Counter>,
    pub sync_lag: Histogram,
    pub snapshot_seconds: Histogram,
    pub snapshot_bytes: Histogram,
}

impl ClusterMetrics {
    /// Create the families and register them in `r`.
    pub fn register(r: &mut Registry) -> Self {
        let m = ClusterMetrics {
            peers: Gauge::default(),
            remote_inflight: Gauge::default(),
            connected: Gauge::default(),
            connects: Counter::default(),
            messages_in: Family::default(),
            messages_out: Family::default(),
            dropped: Family::default(),
            sync_lag: Histogram::new([
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0,
            ]),
            snapshot_seconds: Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]),
            snapshot_bytes: Histogram::new([1e3, 1e4, 1e5, 2.5e5, 5e5, 1e6, 4e6, 1.6e7, 6.4e7]),
        };
        r.register(
            "kvgate_cluster_peers",
            "Other gateway replicas heard from within the heartbeat timeout",
            m.peers.clone(),
        );
        r.register("kvgate_cluster_remote_inflight_requests", "Peers' in-flight requests on our workers, as counted into routing (updated every heartbeat)", m.remote_inflight.clone());
        r.register("kvgate_cluster_nats_connected", "1 while this replica is connected to NATS (0 when cluster mode is off or NATS is lost)", m.connected.clone());
        r.register(
            "kvgate_cluster_nats_connects",
            "Connections (first and re-connections) to NATS; each one triggers a snapshot request",
            m.connects.clone(),
        );
        r.register(
            "kvgate_cluster_messages_received",
            "Peer messages applied here, by kind",
            m.messages_in.clone(),
        );
        r.register(
            "kvgate_cluster_messages_sent",
            "Messages published to NATS, by kind",
            m.messages_out.clone(),
        );
        r.register("kvgate_cluster_messages_dropped", "Cluster messages dropped whole (never half applied), by kind and reason: oversized, version, unknown_kind, malformed, unknown_worker (inbound); queue_full, publish_failed, oversized (outbound)", m.dropped.clone());
        r.register(
            "kvgate_cluster_sync_lag_seconds",
            "From a peer's routing decision (its wall clock) to its application here",
            m.sync_lag.clone(),
        );
        r.register(
            "kvgate_cluster_snapshot_seconds",
            "From a snapshot request to the application of each peer's reply",
            m.snapshot_seconds.clone(),
        );
        r.register(
            "kvgate_cluster_snapshot_bytes",
            "Size of each snapshot reply received",
            m.snapshot_bytes.clone(),
        );
        m
    }

    pub fn dropped(&self, kind: Option<Kind>, reason: DropReason) {
        self.dropped
            .get_or_create(&DropLabel {
                kind: kind.map_or("unknown", Kind::as_str),
                reason: reason.as_str(),
            })
            .inc();
    }

    pub fn received(&self, kind: Kind) {
        self.messages_in
            .get_or_create(&KindLabel {
                kind: kind.as_str(),
            })
            .inc();
    }

    pub fn sent(&self, kind: Kind) {
        self.messages_out
            .get_or_create(&KindLabel {
                kind: kind.as_str(),
            })
            .inc();
    }
}
