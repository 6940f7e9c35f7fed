//! kvgate-tokenize: turns a request's prompt into token ids the way the worker will see them.
//! Backends: HF `tokenizer.json`, tiktoken encodings, and a cheap deterministic approximation.
#![forbid(unsafe_code)]

/// A tokenizer backend. Implementations are cheap to share (`Arc<dyn Tokenizer>`).
pub trait Tokenizer: Send + Sync {
    /// Token ids for `text`, with no special tokens added (chat templates add their own).
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Text for `ids` (best effort; used by the simulator to produce output text).
    fn decode(&self, ids: &[u32]) -> String;
    /// A short name for logs and metrics labels (e.g. "hf", "tiktoken:cl100k_base", "approx").
    fn name(&self) -> &str;
}
