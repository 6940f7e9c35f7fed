//! Tokenization exactly as the gateway does it: `kvgate-tokenize`'s [`ModelTokenizer`] (by default
//! its deterministic `ApproxTokenizer` with ChatML; a HuggingFace `tokenizer.json` with
//! `--tokenizer`, rendered with the model's own chat template as vLLM does) applied to the same
//! `RequestView`. Identical token ids on both sides are what let a
//! router match its own prefix hashes against the blocks this engine reports.

use std::sync::Arc;

use kvgate_protocol::openai::RequestView;
use kvgate_tokenize::{
    ChatTemplate, HfTokenizer, ModelTokenizer, PromptTokens, TokenizeError, TokenizerSpec,
};
use serde_json::Value;

/// The tokenizer a worker uses: `path` = a HuggingFace tokenizer.json, rendered with the chat
/// template of the `tokenizer_config.json` (or `chat_template.jinja`) beside it, as vLLM renders a
/// model's chats (SmolLM2's template, for one, adds a default system message); ChatML only when the
/// directory has no template. `chatml` forces ChatML (the sim's behaviour before it followed
/// vLLM 0.32 here).
pub fn load(path: Option<&std::path::Path>, chatml: bool) -> anyhow::Result<ModelTokenizer> {
    Ok(match path {
        None => ModelTokenizer::default(),
        Some(p) if chatml => {
            ModelTokenizer::new(Arc::new(HfTokenizer::from_file(p)?), ChatTemplate::chatml())
        }
        Some(p) => TokenizerSpec::Hf {
            tokenizer_json: p.to_path_buf(),
            tokenizer_config: None,
        }
        .load()?,
    })
}

/// A tokenization failure with the request parameter at fault.
#[derive(Debug)]
pub struct PromptError {
    pub message: String,
    pub param: Option<&'static str>,
    /// The body does not have the request's shape (a field of the wrong type): vLLM rejects it in
    /// its request validation, before tokenizing, with another error shape (see `http::invalid`).
    pub schema: bool,
}

/// Token ids of every prompt in a chat (`messages`) or completions (`prompt`) body.
pub fn encode_body(mt: &ModelTokenizer, v: &Value) -> Result<Vec<Vec<u32>>, PromptError> {
    // `model` is optional here (vLLM defaults it) but required by the gateway's request view.
    let bytes = if v.get("model").is_some_and(Value::is_string) {
        serde_json::to_vec(v)
    } else {
        let mut c = v.clone();
        c["model"] = Value::String(String::new());
        serde_json::to_vec(&c)
    }
    .map_err(|e| PromptError {
        message: e.to_string(),
        param: None,
        schema: false,
    })?;
    let view = RequestView::parse(&bytes).map_err(|e| PromptError {
        message: e.to_string(),
        param: e.param(),
        schema: true,
    })?;
    match mt.encode_prompt(&view) {
        Ok(PromptTokens::One(t)) => Ok(vec![t]),
        Ok(PromptTokens::Batch(b)) => Ok(b),
        Err(TokenizeError::Request(e)) => Err(PromptError {
            message: e.to_string(),
            param: e.param(),
            schema: true,
        }),
        Err(e) => Err(PromptError {
            message: e.to_string(),
            param: None,
            schema: false,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_and_completion_bodies_tokenize_like_the_gateway() {
        let mt = ModelTokenizer::default();
        let chat = encode_body(
            &mt,
            &json!({"messages": [{"role": "user", "content": "hello world"}]}),
        )
        .unwrap();
        assert_eq!(chat.len(), 1);
        assert!(chat[0].len() > 2, "ChatML adds its markers");
        let text = encode_body(&mt, &json!({"prompt": ["a b", "c"]})).unwrap();
        assert_eq!(text.len(), 2);
        assert_eq!(
            encode_body(&mt, &json!({"prompt": [7, 8, 9]})).unwrap(),
            vec![vec![7, 8, 9]]
        );
        let e = encode_body(&mt, &json!({"messages": "hi"})).unwrap_err();
        assert_eq!(e.param, Some("messages"));
    }
}
