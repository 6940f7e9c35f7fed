//! `text/event-stream` responses from workers: the one SSE reader of the workspace.
//!
//! The gateway forwards each body chunk and, on the side, needs to know per event: did a token
//! arrive (TTFT / inter-token latency), the final `usage`, an error event, `[DONE]`; the load
//! generator needs the same to time its requests. [`SseScanner`] (`scanner.rs`) splits the byte
//! stream into events incrementally, whatever the chunking, with reused buffers (no allocation
//! per event once warm). [`ChunkInfo::scan`] (`chunk.rs`) answers the questions with byte
//! searches (no JSON parse unless a `usage` object is present) and holds the one definition of
//! "a token arrived". [`Relay`] (`relay.rs`) is both on the gateway's forwarding path, with the
//! removal of the usage the gateway asked for on the client's behalf. `agent.rs` reads the
//! Responses and Messages streams (their own token, usage and end events) for a [`Relay`] built
//! `with_dialect`.

pub mod agent;
mod chunk;
mod relay;
mod scanner;

pub use agent::Dialect;
pub use chunk::ChunkInfo;
pub use relay::Relay;
pub use scanner::{SseEvent, SseScanner, DEFAULT_MAX_EVENT_BYTES};

#[cfg(test)]
mod tests;
