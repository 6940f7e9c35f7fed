//! kvgate-protocol: wire formats without I/O.
//!
//! - `agent`: OpenAI Responses and Anthropic Messages bodies → the chat conversation vLLM renders.
//! - `openai`: borrowed views of the routing fields of OpenAI requests (the body is never re-serialized).
//! - `sse`: incremental scanner for `text/event-stream` responses (token timing, usage, errors) and
//!   the one definition of "a token arrived".
//! - `usage`: the OpenAI `usage` object (token counts), found and read without a full parse.
//! - `finish`: `finish_reason` as a fixed set, found the same way.
//! - `error`: the OpenAI error JSON shape.
//! - `kv_events`: vLLM / SGLang KV-event decoding (ZMQ multipart + msgpack, both encodings).
//! - `pd`: the prefill/decode handoff protocols by name.
//! - `trtllm`: TensorRT-LLM `/kv_cache_events` JSON and iteration stats.
//! - `prom_text`: a tolerant Prometheus text-format parser for scraping workers.
//! - `trace_context`: W3C `traceparent` / `tracestate` parsing and generation.
//! - `otlp`: the OTLP trace messages kvgate exports (protobuf via prost derive), and plain span
//!   records turned into them off the request path.
#![forbid(unsafe_code)]

pub mod agent;
pub mod error;
pub mod finish;
/// Fuzz-target entry points (`fuzz/`); not an API.
#[doc(hidden)]
pub mod fuzz {
    pub use crate::openai::fuzz::request_body;
}
pub mod kv_events;
pub mod openai;
pub mod otlp;
pub mod pd;
pub mod prom_text;
pub mod sse;
pub mod trace_context;
pub mod trtllm;
pub mod usage;
