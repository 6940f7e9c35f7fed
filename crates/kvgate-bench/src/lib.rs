//! kvgate-bench: the load generator, trace replay, policy A/B comparison and demo behind
//! `kvgate bench` and `kvgate demo`.
//!
//! Layout: `workload` (+ `workload/`: shared_prefix, multi_turn, mooncake, azure) builds
//! deterministic token-id requests; `oracle` gives the best achievable prefix hit rate;
//! `client` sends one streaming OpenAI request and times it (`sse` splits the stream); `runner`
//! drives open/closed loops; `stats` turns outcomes into percentiles, throughput and goodput;
//! `report` renders text/markdown; `compare` (+ `compare/`) runs a sim fleet and one gateway per
//! policy as child processes; `plot` draws the SVGs; `demo` is the one-command tour; `cli` holds
//! the clap arguments and entry points.
#![forbid(unsafe_code)]

pub mod cli;
pub mod client;
pub mod compare;
pub mod demo;
pub mod flow;
mod hashing;
pub mod oracle;
pub mod plot;
pub mod report;
pub mod runner;
pub mod sse;
pub mod stats;
pub mod workload;
