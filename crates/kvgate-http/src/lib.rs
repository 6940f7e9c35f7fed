//! kvgate-http: the one HTTP/1.1 codec of the proxy hop, both sides of it.
//!
//! - `head.rs`: what requests and responses share: one set of framing rules (content-length,
//!   transfer-encoding, their conflicts, header limits), header-name lookup, the hop-by-hop list.
//! - `chunked.rs`: the body decoder (content-length, chunked, close-delimited) and the chunk
//!   prefix the server writes.
//! - `client.rs`: the pooled client to workers (the gateway's proxy hop, the fleet's probes and
//!   scrapes): one connection pool per io thread, a probe at every checkout.
//! - `server.rs`: the server loop for client connections (HTTP/2 goes to hyper).
//! - `otlp.rs`: the trace exporter: span batches to an OpenTelemetry collector over OTLP/HTTP
//!   (protobuf) or OTLP/gRPC, from a bounded queue (full = dropped and counted).
//!
//! Everything a peer sends is checked against the same rules, whichever side it is on: a proxy
//! that reads framing differently from the machines around it is how requests get smuggled and
//! responses get handed to the wrong client.
#![forbid(unsafe_code)]

pub mod chunked;
pub mod client;
#[doc(hidden)]
pub mod fuzz;
pub mod head;
pub mod otlp;
pub mod server;

pub use client::{Error, Outgoing, Response, ResponseBody, Settings, Tls};
