//! vLLM / SGLang KV-cache events: ZMQ multipart framing and msgpack payloads.
//!
//! Wire facts (see `shared/reference/interfaces.md` §2–3):
//! - live PUB messages are `[topic, seq u64 BE, payload]`;
//! - replay replies are `[seq, payload]` (vLLM ≤ 0.25) or `[topic, seq, payload]` (≥ 0.26), ending with
//!   an `END_SEQ` (8 × 0xff) frame and an empty payload;
//! - the payload is `[ts, events, dp_rank?]`; each event is a tagged positional array (vLLM ≤ 0.23,
//!   trailing defaults omitted) or a map with a `"type"` key (vLLM ≥ 0.24, SGLang; unknown keys ignored);
//! - block hashes arrive as uint64, int64 or bytes and are normalised to `u64`.
//!
//! Layout: this file holds the model, the errors and the framing; `reader` is the msgpack cursor and
//! `payload` decodes batches and events. Every malformed input yields a [`KvEventError`], never a panic.

mod payload;
mod reader;
#[cfg(test)]
mod tests;

pub use reader::bytes_hash;

/// The seq value that ends a replay stream.
pub const END_SEQ: u64 = u64::MAX;

/// Where the blocks of an event live. GPU is the tier a router scores; the others are offload tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Medium {
    /// Device memory (vLLM `GPU`; also assumed when the field is absent or nil).
    #[default]
    Gpu,
    /// Host memory (vLLM `CPU`, SGLang `CPU_PINNED`).
    Cpu,
    /// vLLM `STORAGE`, SGLang `DISK`.
    Disk,
    /// SGLang `EXTERNAL` (a remote KV store).
    External,
    /// A tier name this version does not know.
    Other,
}

impl Medium {
    pub fn parse(s: &str) -> Medium {
        match s {
            "GPU" | "gpu" | "cuda" => Medium::Gpu,
            "CPU" | "CPU_PINNED" | "cpu" => Medium::Cpu,
            "STORAGE" | "DISK" | "disk" => Medium::Disk,
            "EXTERNAL" => Medium::External,
            _ => Medium::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Cpu => "cpu",
            Medium::Disk => "disk",
            Medium::External => "external",
            Medium::Other => "other",
        }
    }
}

/// One KV-cache event, normalised across vLLM (both encodings), SGLang and TRT-LLM.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks became cached. `token_ids.len() == block_hashes.len() * block_size` for device
    /// events; offload-tier events carry only hashes (`token_ids` empty, `block_size` 0): see
    /// [`KvEvent::is_tier_only`].
    Stored {
        block_hashes: Vec<u64>,
        /// The engine hash of the block before the run; `None` at the start of a prompt.
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        lora_name: Option<String>,
        medium: Medium,
        /// KV-cache group (hybrid models); 0 when absent.
        group_idx: u32,
    },
    /// Blocks were evicted from `medium`.
    Removed {
        block_hashes: Vec<u64>,
        medium: Medium,
        group_idx: u32,
    },
    /// The whole cache was reset (`AllBlocksCleared`).
    AllCleared,
}

impl KvEvent {
    /// A `Stored` event with hashes but no tokens: tier information only, nothing to index.
    pub fn is_tier_only(&self) -> bool {
        matches!(self, KvEvent::Stored { token_ids, .. } if token_ids.is_empty())
    }
}

/// One published batch (one scheduler step).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    pub seq: u64,
    /// Publisher wall clock (`time.time()`), seconds.
    pub ts: f64,
    /// Data-parallel rank, when the publisher sent it (builds before mid-2025 did not).
    pub dp_rank: Option<u32>,
    pub events: Vec<KvEvent>,
}

/// A frame of a replay reply.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayFrame {
    Batch(KvEventBatch),
    /// The `END_SEQ` terminator: every buffered batch has been sent.
    End,
}

/// Why a message was rejected. Offsets are byte positions inside the payload frame.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvEventError {
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: &'static str, got: usize },
    #[error("sequence frame must be 8 bytes, got {0}")]
    SeqLen(usize),
    #[error("payload truncated at byte {offset}")]
    Truncated { offset: usize },
    #[error("at byte {offset}: expected {expected}, found {found}")]
    Unexpected {
        offset: usize,
        expected: &'static str,
        found: &'static str,
    },
    #[error("invalid UTF-8 string at byte {offset}")]
    BadUtf8 { offset: usize },
    #[error("value nested too deep at byte {offset}")]
    TooDeep { offset: usize },
    #[error("unknown event type {0:?}")]
    UnknownEvent(String),
    #[error("event {event} is missing field {field}")]
    MissingField {
        event: &'static str,
        field: &'static str,
    },
    #[error("{0} trailing bytes after the payload")]
    Trailing(usize),
    #[error("{0}")]
    Invalid(&'static str),
}

fn seq_of(frame: &[u8]) -> Result<u64, KvEventError> {
    let a: [u8; 8] = frame
        .try_into()
        .map_err(|_| KvEventError::SeqLen(frame.len()))?;
    Ok(u64::from_be_bytes(a))
}

/// Decodes a live PUB message `[topic, seq, payload]`.
pub fn decode_multipart<F: AsRef<[u8]>>(frames: &[F]) -> Result<KvEventBatch, KvEventError> {
    match frames {
        [_topic, seq, payload] => decode_payload(seq_of(seq.as_ref())?, payload.as_ref()),
        _ => Err(KvEventError::FrameCount {
            expected: "3",
            got: frames.len(),
        }),
    }
}

/// Decodes one replay reply in either framing: `[seq, payload]` (≤ 0.25) or `[topic, seq, payload]`
/// (≥ 0.26), tolerating the empty delimiter frame a DEALER socket sees in front (`[b"", …]`).
pub fn decode_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayFrame, KvEventError> {
    let frames = match frames {
        [first, rest @ ..] if rest.len() == 3 && first.as_ref().is_empty() => rest,
        f => f,
    };
    let (seq, payload) = match frames {
        [seq, payload] | [_, seq, payload] => (seq_of(seq.as_ref())?, payload.as_ref()),
        _ => {
            return Err(KvEventError::FrameCount {
                expected: "2 or 3",
                got: frames.len(),
            })
        }
    };
    if seq == END_SEQ {
        return Ok(ReplayFrame::End);
    }
    decode_payload(seq, payload).map(ReplayFrame::Batch)
}

/// Decodes a msgpack `EventBatch` payload (`[ts, events, dp_rank?]`) tagged with `seq`.
pub fn decode_payload(seq: u64, payload: &[u8]) -> Result<KvEventBatch, KvEventError> {
    payload::decode_batch(seq, payload)
}

/// The 8-byte big-endian frame for a replay request starting at `seq`.
pub fn replay_request(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}
