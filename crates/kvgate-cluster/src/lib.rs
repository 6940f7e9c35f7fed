//! Replica sync over NATS: N kvgate gateways behind one load balancer route as one by sharing
//! what only each of them knows — routing decisions (approximate index inserts, the exact index's
//! predicted inserts), active-load deltas keyed by replica, breaker verdicts, API-key usage — and
//! by answering a joining replica's snapshot request. Fail-open: the request path only ever
//! queues a message without waiting (full queue → dropped and counted).
//!
//! - `wire.rs`: the versioned, size-limited binary format (all-or-nothing decoding).
//! - `node.rs`: the NATS connection, its tasks, and the [`Sink`] the gateway implements.
//! - `metrics.rs`: the `kvgate_cluster_*` families.
#![forbid(unsafe_code)]

pub mod metrics;
pub mod node;
pub mod wire;

pub use metrics::ClusterMetrics;
pub use node::{unix_us, Cluster, ClusterConfig, Sink};
pub use wire::{
    DropReason, Envelope, FlowHead, FlowReport, FlowUsage, InflightEntry, Kind, Message, Snapshot,
    WIRE_VERSION,
};
