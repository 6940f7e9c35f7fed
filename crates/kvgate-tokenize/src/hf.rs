//! HF `tokenizer.json` backend. Byte-level BPE files (GPT-2 / SmolLM shape) encode on our own
//! path (`hf/native.rs`: ids straight into a `Vec<u32>`, per-word cache); any other file goes
//! through the `tokenizers` crate (default features off, `fancy-regex` instead of the C `onig`
//! library, so no C build), with the GPT-2 split swapped for `hf/pretok.rs` where possible.

mod native;
mod pretok;

use std::path::Path;

use tokenizers::{
    DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, TokenizerBuilder,
    TokenizerImpl,
};

use crate::{TokenizeError, Tokenizer};
use native::Native;
use pretok::FastPre;

/// The loaded tokenizer with the regex pre-tokenizer swapped for [`FastPre`].
type FastImpl =
    TokenizerImpl<ModelWrapper, NormalizerWrapper, FastPre, PostProcessorWrapper, DecoderWrapper>;

/// A `tokenizer.json` (BPE, WordPiece, WordLevel or Unigram model; any pre-tokenizer the
/// pure-Rust regex engine handles, which covers GPT-2, Llama-3, Qwen, SmolLM and Mistral files).
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// Used for encoding when the pre-tokenizer has a regex `ByteLevel` we can replace (same ids,
    /// see `hf/pretok.rs`); `None` means encode with `inner`.
    fast: Option<FastImpl>,
    /// Our own encoder, when the file is a shape it implements exactly; else why not.
    native: Result<Native, String>,
    name: String,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("name", &self.name)
            .finish()
    }
}

impl HfTokenizer {
    /// Loads a `tokenizer.json`. Errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| TokenizeError::File {
            path: path.to_owned(),
            what: format!("cannot read tokenizer.json: {e}"),
        })?;
        Self::from_bytes(&bytes).map_err(|e| match e {
            TokenizeError::Backend(what) => TokenizeError::File {
                path: path.to_owned(),
                what: format!("not a usable tokenizer.json: {what}"),
            },
            other => other,
        })
    }

    /// Loads a `tokenizer.json` held in memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TokenizeError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| TokenizeError::Backend(e.to_string()))?;
        let fast = fast_impl(&inner)?;
        let native = Native::from_tokenizer(&inner);
        Ok(Self {
            inner,
            fast,
            native,
            name: "hf".to_owned(),
        })
    }

    /// The id of a token string (e.g. a special token such as `<|im_start|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The underlying `tokenizers` object, for anything not wrapped here.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn encode_ids(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        if self.native.is_err() {
            return self.encode_tokenizers(text, special);
        }
        let mut out = Vec::new();
        self.encode_ids_into(text, special, &mut out)?;
        Ok(out)
    }

    /// [`HfTokenizer::encode_ids`], appending to `out`.
    fn encode_ids_into(
        &self,
        text: &str,
        special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        if let Ok(native) = &self.native {
            // ~4 bytes per token in prose; one allocation in the common case.
            out.reserve(text.len() / 3 + 4);
            native.encode_into(text, special, out);
            return Ok(());
        }
        out.extend_from_slice(&self.encode_tokenizers(text, special)?);
        Ok(())
    }

    /// Ids through the `tokenizers` pipeline (with the regex-free split where it applies): the
    /// path used when the native encoder does not support the file. Public for benchmarks.
    pub fn encode_tokenizers(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        // `encode_fast` skips char-offset bookkeeping we never read.
        let enc = match &self.fast {
            Some(fast) => fast.encode_fast(text, special),
            None => self.inner.encode_fast(text, special),
        }
        .map_err(|e| TokenizeError::Backend(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }
}

/// The same pipeline as `inner` with [`FastPre`], when any regex `ByteLevel` was replaced.
fn fast_impl(inner: &tokenizers::Tokenizer) -> Result<Option<FastImpl>, TokenizeError> {
    let Some(pre) = inner.get_pre_tokenizer() else {
        return Ok(None);
    };
    let (fast_pre, replaced) = FastPre::from_wrapper(pre);
    if !replaced {
        return Ok(None);
    }
    let built = TokenizerBuilder::new()
        .with_model(inner.get_model().clone())
        .with_normalizer(inner.get_normalizer().cloned())
        .with_pre_tokenizer(Some(fast_pre))
        .with_post_processor(inner.get_post_processor().cloned())
        .with_decoder(inner.get_decoder().cloned())
        .with_added_vocabulary(inner.get_added_vocabulary().clone())
        .with_truncation(inner.get_truncation().cloned())
        .with_padding(inner.get_padding().cloned())
        .build()
        .map_err(|e| TokenizeError::Backend(e.to_string()))?;
    Ok(Some(built))
}

impl HfTokenizer {
    /// Whether the `tokenizers` path uses the regex-free pre-tokenizer (see `hf/pretok.rs`).
    pub fn uses_fast_pretokenizer(&self) -> bool {
        self.fast.is_some()
    }

    /// Whether encoding uses our own byte-level BPE encoder (see `hf/native.rs`).
    pub fn uses_native_encoder(&self) -> bool {
        self.native.is_ok()
    }

    /// Why the native encoder does not handle this file (`None` when it does), for logs.
    pub fn native_unsupported_reason(&self) -> Option<&str> {
        self.native.as_ref().err().map(String::as_str)
    }

    /// Ids through the stock `tokenizers` pipeline (regex pre-tokenizer), for equality checks.
    pub fn encode_reference(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        let enc = self
            .inner
            .encode_fast(text, special)
            .map_err(|e| TokenizeError::Backend(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }
}

impl Tokenizer for HfTokenizer {
    fn cache_stats(&self) -> crate::CacheStats {
        self.native
            .as_ref()
            .map(Native::cache_stats)
            .unwrap_or_default()
    }

    fn set_segment_cache_budget(&self, bytes: usize) {
        if let Ok(n) = &self.native {
            n.set_segment_budget(bytes);
        }
    }

    /// Special-token *strings* in `text` (e.g. `<|im_start|>` from a template) still map to their
    /// ids, as in the engines; only post-processor additions (BOS) are left out.
    fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_ids(text, false).unwrap_or_default()
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn try_encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_ids(text, false)
    }

    fn try_encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        self.encode_ids_into(text, false, out)
    }

    fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_ids(text, true)
    }
}
