//! `text/event-stream` responses from workers.
//!
//! The gateway forwards each body chunk as is and, on the side, needs to know per event: did a
//! token arrive (TTFT / inter-token latency), the final `usage`, `finish_reason`, an error event,
//! `[DONE]`. [`SseScanner`] (`scanner.rs`) splits the byte stream into events incrementally,
//! whatever the chunking, with reused buffers (no allocation per event once warm).
//! [`ChunkInfo::scan`] (`chunk.rs`) answers the questions with byte searches and parses JSON only
//! when a `"usage":{` or `"error"` key is present.

mod chunk;
mod scanner;

pub use chunk::{ChunkInfo, Usage};
pub use scanner::{write_data_event, SseError, SseEvent, SseScanner, DEFAULT_MAX_EVENT_BYTES};

#[cfg(test)]
mod tests;
