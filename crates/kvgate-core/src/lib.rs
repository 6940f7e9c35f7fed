//! kvgate-core: the pure routing engine (block hashing, KV index, active load, cost, policies).
//! No I/O, no tokio, no hyper.
#![forbid(unsafe_code)]
