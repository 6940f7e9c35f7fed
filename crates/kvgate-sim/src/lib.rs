//! kvgate-sim: a simulated vLLM worker (and fleet) that behaves like the real thing where routing
//! matters — prefix caching with LRU eviction, continuous batching that slows under load, vLLM's
//! HTTP API, metric names and ZMQ KV-event wire format. See docs/sim.md for the fidelity note.
//!
//! Layout: `config.rs` (every knob), `engine.rs` + `engine/` (pure engine: block pool, requests,
//! scheduler; no tokio), `worker.rs` (the one scheduler task per worker), `kv_events.rs` (msgpack
//! payloads) + `publisher.rs` (ZMQ PUB + replay ROUTER), `http.rs` + `http/` (endpoints),
//! `metrics.rs` (vLLM `/metrics`), `dcgm.rs` (emulated dcgm-exporter), `tokenizer.rs`, `server.rs` (spawn/handle), `fleet.rs` (N workers),
//! `cli.rs` (`kvgate sim`).
#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod dcgm;
pub mod engine;
pub mod fleet;
mod http;
pub mod kv_events;
pub mod metrics;
mod publisher;
mod server;
pub mod tokenizer;
mod worker;

pub use config::{
    CrashMode, EventEncoding, Faults, LoadFailurePolicy, PdConfig, PdProtocol, Role, SimConfig,
    Slowdown, TimingModel,
};
pub use engine::CacheEntry;
pub use fleet::{FleetPorts, SimFleet};
pub use publisher::END_SEQ;
pub use server::{replay_addr_for, SimHandle, SimWorker};

/// Request header honoured with `--assume-cached-header` (`SimConfig::assume_cached_header`): a
/// non-negative integer N of prompt tokens; the first N / block_size full blocks of the prompt
/// count as cached on the worker that serves it (see docs/sim.md).
pub const CACHED_TOKENS_HEADER: &str = "x-kvgate-sim-cached-tokens";
