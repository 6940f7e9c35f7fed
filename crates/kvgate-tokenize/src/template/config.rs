//! Reading `tokenizer_config.json`: the chat template(s) and the special-token strings.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::TokenizeError;

/// Special-token strings passed to the template (`bos_token` etc.).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

pub(super) struct Loaded {
    /// `(name, source)`; a plain-string `chat_template` is named "default".
    pub templates: Vec<(String, String)>,
    pub special: SpecialTokens,
}

#[derive(Deserialize)]
struct ConfigJson {
    #[serde(default)]
    chat_template: Option<Value>,
    #[serde(default)]
    bos_token: Option<Value>,
    #[serde(default)]
    eos_token: Option<Value>,
    #[serde(default)]
    unk_token: Option<Value>,
    #[serde(default)]
    pad_token: Option<Value>,
}

pub(super) fn load(path: &Path) -> Result<Loaded, TokenizeError> {
    let err = |what: String| TokenizeError::File {
        path: path.to_owned(),
        what,
    };
    let bytes =
        std::fs::read(path).map_err(|e| err(format!("cannot read tokenizer_config.json: {e}")))?;
    let cfg: ConfigJson = serde_json::from_slice(&bytes)
        .map_err(|e| err(format!("not a tokenizer_config.json object: {e}")))?;
    let special = SpecialTokens {
        bos_token: token_string(cfg.bos_token.as_ref())
            .map_err(|w| err(format!("bos_token: {w}")))?,
        eos_token: token_string(cfg.eos_token.as_ref())
            .map_err(|w| err(format!("eos_token: {w}")))?,
        unk_token: token_string(cfg.unk_token.as_ref())
            .map_err(|w| err(format!("unk_token: {w}")))?,
        pad_token: token_string(cfg.pad_token.as_ref())
            .map_err(|w| err(format!("pad_token: {w}")))?,
    };
    let templates =
        match cfg.chat_template {
            Some(Value::String(s)) => vec![("default".to_owned(), s)],
            Some(Value::Array(items)) => {
                let mut v = Vec::with_capacity(items.len());
                for (i, item) in items.into_iter().enumerate() {
                    let name = item.get("name").and_then(Value::as_str);
                    let tmpl = item.get("template").and_then(Value::as_str);
                    match (name, tmpl) {
                        (Some(n), Some(t)) => v.push((n.to_owned(), t.to_owned())),
                        _ => {
                            return Err(err(format!(
                            "chat_template[{i}] must be an object with string 'name' and 'template'"
                        )))
                        }
                    }
                }
                v
            }
            None | Some(Value::Null) => {
                // Newer HF repos keep the template in its own file beside the config.
                let sibling = path.with_file_name("chat_template.jinja");
                match std::fs::read_to_string(&sibling) {
                    Ok(s) => vec![("default".to_owned(), s)],
                    Err(_) => return Err(err(
                        "has no 'chat_template' (and there is no chat_template.jinja beside it)"
                            .into(),
                    )),
                }
            }
            Some(_) => {
                return Err(err(
                    "'chat_template' must be a string or a list of {name, template}".into(),
                ))
            }
        };
    Ok(Loaded { templates, special })
}

/// A special token given as a string or as an AddedToken object `{"content": ...}`.
fn token_string(v: Option<&Value>) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err("an AddedToken object needs a string 'content'".into()),
        },
        Some(_) => Err("expected a string or an AddedToken object".into()),
    }
}
