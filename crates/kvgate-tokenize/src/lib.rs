//! kvgate-tokenize: turns a request's prompt into token ids the way the worker will see them.
//!
//! Layout: the [`Tokenizer`] trait is here; backends are one file each — `hf.rs` (HF
//! `tokenizer.json` via `tokenizers`), `tiktoken.rs` (`tiktoken-rs` encodings), `approx.rs` (the
//! cheap deterministic fallback, see docs/tokenization.md). `template.rs` (+ `template/`) renders
//! chat templates from `tokenizer_config.json` with minijinja. `model.rs` ties a tokenizer and a
//! template into [`ModelTokenizer::encode_prompt`], and `spec.rs` loads one from config
//! ([`TokenizerSpec`]).
#![forbid(unsafe_code)]

mod approx;
mod hf;
mod model;
mod segments;
mod spec;
mod template;
mod tiktoken;

pub use approx::ApproxTokenizer;
pub use hf::HfTokenizer;
pub use model::{ModelTokenizer, PromptTokens, Scratch};
pub use spec::TokenizerSpec;
pub use template::{ChatTemplate, SpecialTokens};
pub use tiktoken::TiktokenTokenizer;

use std::path::PathBuf;

/// A tokenizer backend. Implementations are cheap to share (`Arc<dyn Tokenizer>`).
pub trait Tokenizer: Send + Sync {
    /// Token ids for `text`, with no special tokens added (chat templates add their own).
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Text for `ids` (best effort; used by the simulator to produce output text).
    fn decode(&self, ids: &[u32]) -> String;
    /// A short name for logs and metrics labels (e.g. "hf", "tiktoken:cl100k_base", "approx").
    fn name(&self) -> &str;

    /// Like [`Tokenizer::encode`], reporting a backend failure instead of hiding it.
    fn try_encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.encode(text))
    }

    /// Like [`Tokenizer::try_encode`], appending to `out` (the hot path reuses one buffer).
    fn try_encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        out.extend_from_slice(&self.try_encode(text)?);
        Ok(())
    }

    /// Sizes of the tokenizer's caches right now (all zero for a backend without caches).
    fn cache_stats(&self) -> CacheStats {
        CacheStats::default()
    }

    /// Bounds the segment cache ([`CacheStats::segment_bytes`]) to `bytes`; 0 turns it off.
    /// Entries over the new bound are dropped at once. No-op for backends without one.
    fn set_segment_cache_budget(&self, _bytes: usize) {}

    /// Ids for a raw completions prompt, with the special tokens the worker adds to one (e.g. BOS
    /// from a `tokenizer.json` post-processor): vLLM's `add_special_tokens=True` default there.
    fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.try_encode(text)
    }
}

/// A tokenizer's cache sizes, for the gateway's `kvgate_cache_*` metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Segment cache (`segments.rs`): entries and bytes counted against its budget.
    pub segment_entries: usize,
    pub segment_bytes: usize,
    /// Native BPE word caches (`hf/native/merge.rs`, fixed bounds): entries and approximate bytes.
    pub word_entries: usize,
    pub word_bytes: usize,
}

/// Everything that can go wrong loading a tokenizer or encoding a prompt.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file could not be read or parsed; `what` says what was expected of it.
    #[error("{path}: {what}")]
    File { path: PathBuf, what: String },
    /// A tiktoken encoding name we do not ship.
    #[error("unknown tiktoken encoding '{0}' (known: cl100k_base, o200k_base)")]
    UnknownEncoding(String),
    /// The chat template failed to compile or render (includes `raise_exception` messages).
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer backend failed on this input.
    #[error("tokenizer: {0}")]
    Backend(String),
    /// The request's prompt or messages were unusable.
    #[error(transparent)]
    Request(#[from] kvgate_protocol::openai::RequestError),
}

impl TokenizeError {
    /// Whether the client is at fault (HTTP 400) rather than the deployment (HTTP 500): a template
    /// that raises on the given messages (e.g. roles not alternating) is the client's problem.
    pub fn is_client_error(&self) -> bool {
        matches!(self, TokenizeError::Request(_) | TokenizeError::Template(_))
    }
}
