//! kvgate-fleet: what kvgate knows about its workers, learned in the background.
//!
//! For each worker the gateway calls [`WorkerMonitor::spawn`] with a [`MonitorConfig`] and a
//! [`FleetSink`] (its registry); the returned [`MonitorHandle`] owns every task and stops them on
//! drop. The tasks report through the sink: scraped load (`on_load`, `on_load_stale`), block-size
//! mismatches, decoded KV-event batches in order (`on_kv_events`, applied to the exact index with
//! [`apply_batch`]), index resets (sequence regression, `AllBlocksCleared`, restart, lost gap) and
//! health transitions, and for `role = auto` the worker's prefill/decode role (`on_role`). Each worker has a [`Breaker`] the gateway also feeds with request outcomes.
//!
//! Layout:
//! - `kind.rs`: [`WorkerKind`] and its config names.
//! - `sink.rs`: [`FleetSink`], [`ScrapedLoad`], [`ResetReason`]; `apply.rs`: events → `KvIndex`,
//!   and [`IndexSink`], a ready-made sink around a shared index.
//! - `monitor.rs`: config, spawn, handle (the supervisor of the tasks below).
//! - `scrape.rs` + `scrape/<kind>.rs`: load scraping (pure parsers per kind + the periodic task).
//! - `kv_feed.rs`: a worker's publishers (configured or discovered, re-discovered after a restart)
//!   and their subscribers; `subscriber.rs` + `subscriber/{state,replay}.rs`: ZMQ KV-event
//!   subscriber with history and gap replay; `seq.rs`: the sequence state machine;
//!   `reset.rs`: the one path that clears a worker's entries (every subscriber hears of it);
//!   `trtllm_poll.rs`: TRT-LLM `POST /kv_cache_events`.
//! - `health.rs`: health probes; `breaker.rs`: the circuit breaker.
//! - `discover.rs`: `kind = auto` probing, `role = auto` detection (`/server_info`) and KV-event
//!   endpoint discovery.
//! - `http.rs`: whole-body requests with per-call deadlines over kvgate-http's pooled client; `stats.rs`: [`FleetStats`].
//! - `dcgm.rs`: GPU figures from a worker's dcgm-exporter (`dcgm_url`), parsed per worker.
//! - `dns.rs`: DNS-based pool discovery (re-resolved `host:port` → address diffs).
#![forbid(unsafe_code)]

mod apply;
pub mod breaker;
pub mod dcgm;
pub mod discover;
pub mod dns;
mod health;
pub mod http;
mod kind;
mod kv_feed;
mod monitor;
mod reset;
pub mod scrape;
mod seq;
mod sink;
mod stats;
pub mod subscriber;
mod trtllm_poll;

pub use apply::{apply_batch, ApplyOutcome, IndexSink, WorkerView};
pub use breaker::{Breaker, BreakerConfig, BreakerState};
pub use discover::{DetectedRole, KvSource};
pub use kind::{UnknownKind, WorkerKind};
pub use monitor::{KvEventsSource, MonitorConfig, MonitorHandle, WorkerMonitor};
pub use seq::{SeqTracker, SeqVerdict};
pub use sink::{FleetSink, ResetReason, ScrapedLoad, SumCount};
pub use stats::{FleetStats, StatsSnapshot};
