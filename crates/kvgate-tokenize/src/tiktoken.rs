//! tiktoken encodings (OpenAI models) via `tiktoken-rs`; the BPE ranks ship inside the crate, so
//! loading needs no network.

use tiktoken_rs::CoreBPE;

use crate::{TokenizeError, Tokenizer};

/// `cl100k_base` or `o200k_base`.
pub struct TiktokenTokenizer {
    bpe: &'static CoreBPE,
    name: &'static str,
}

impl std::fmt::Debug for TiktokenTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TiktokenTokenizer")
            .field("name", &self.name)
            .finish()
    }
}

impl TiktokenTokenizer {
    /// The first call per encoding parses its rank table (~0.1–0.3 s); later calls share it.
    pub fn new(encoding: &str) -> Result<Self, TokenizeError> {
        let (bpe, name) = match encoding {
            "cl100k_base" => (tiktoken_rs::cl100k_base_singleton(), "tiktoken:cl100k_base"),
            "o200k_base" => (tiktoken_rs::o200k_base_singleton(), "tiktoken:o200k_base"),
            other => return Err(TokenizeError::UnknownEncoding(other.to_owned())),
        };
        Ok(Self { bpe, name })
    }
}

impl Tokenizer for TiktokenTokenizer {
    /// Special-token strings are encoded as plain text, as OpenAI's API does for user content.
    fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    fn decode(&self, ids: &[u32]) -> String {
        match self.bpe.decode_bytes(ids) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            // Unknown ids: decode the known ones only.
            Err(_) => {
                let known: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|&id| self.bpe.decode_bytes(&[id]).is_ok())
                    .collect();
                String::from_utf8_lossy(&self.bpe.decode_bytes(&known).unwrap_or_default())
                    .into_owned()
            }
        }
    }

    fn name(&self) -> &str {
        self.name
    }
}
