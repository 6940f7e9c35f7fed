//! [`TokenizerSpec`]: which tokenizer a model pool uses, as written in config, and its loader.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::{ChatTemplate, HfTokenizer, ModelTokenizer, TiktokenTokenizer, TokenizeError};

/// A model pool's tokenizer, as configured (TOML: `tokenizer = { kind = "hf", tokenizer_json =
/// "…/tokenizer.json" }`, `{ kind = "tiktoken", encoding = "o200k_base" }`, `{ kind = "approx" }`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TokenizerSpec {
    /// HF files. `tokenizer_config` defaults to `tokenizer_config.json` beside `tokenizer_json`;
    /// when that file does not exist the ChatML template is used.
    Hf {
        tokenizer_json: PathBuf,
        #[serde(default)]
        tokenizer_config: Option<PathBuf>,
    },
    /// A tiktoken encoding (`cl100k_base`, `o200k_base`) with the ChatML template.
    Tiktoken { encoding: String },
    /// The approximate tokenizer with the ChatML template (the default).
    #[default]
    Approx,
}

impl TokenizerSpec {
    /// Loads the files. Errors name the file and what was wrong with it.
    pub fn load(&self) -> Result<ModelTokenizer, TokenizeError> {
        match self {
            TokenizerSpec::Approx => Ok(ModelTokenizer::default()),
            TokenizerSpec::Tiktoken { encoding } => Ok(ModelTokenizer::new(
                Arc::new(TiktokenTokenizer::new(encoding)?),
                ChatTemplate::chatml(),
            )),
            TokenizerSpec::Hf {
                tokenizer_json,
                tokenizer_config,
            } => {
                let tokenizer = HfTokenizer::from_file(tokenizer_json)?;
                let template = match tokenizer_config {
                    Some(p) => ChatTemplate::from_tokenizer_config(p)?,
                    None => {
                        let sibling = sibling_config(tokenizer_json);
                        if sibling.exists() {
                            ChatTemplate::from_tokenizer_config(&sibling)?
                        } else {
                            ChatTemplate::chatml()
                        }
                    }
                };
                Ok(ModelTokenizer::new(Arc::new(tokenizer), template))
            }
        }
    }
}

fn sibling_config(tokenizer_json: &Path) -> PathBuf {
    tokenizer_json.with_file_name("tokenizer_config.json")
}
