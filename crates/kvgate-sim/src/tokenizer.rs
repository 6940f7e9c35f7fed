//! Tokenizer selection for the sim: a real `tokenizer.json` through the shared `kvgate-tokenize`
//! crate, or a cheap deterministic word-piece approximation. Also the chat template (ChatML).

use std::sync::Arc;

use kvgate_tokenize::Tokenizer;

/// Deterministic stand-in when no tokenizer.json is given: every whitespace-separated word becomes
/// one token per 4 bytes, ids from a hash so equal text gives equal ids. Roughly the token counts
/// of a BPE model on English text, which is all the cache model needs.
#[derive(Debug, Default)]
pub struct WordPieceTokenizer;

const VOCAB: u64 = 32_000;
const FIRST_ID: u64 = 256;

impl Tokenizer for WordPieceTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        for word in text.split_whitespace() {
            for piece in word.as_bytes().chunks(4) {
                let h = xxhash_rust::xxh3::xxh3_64(piece);
                out.push((FIRST_ID + h % (VOCAB - FIRST_ID)) as u32);
            }
        }
        out
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut s = String::with_capacity(ids.len() * 6);
        for id in ids {
            s.push_str(" t");
            s.push_str(&id.to_string());
        }
        s
    }

    fn name(&self) -> &str {
        "approx"
    }
}

/// The tokenizer a worker uses: `path` = a HuggingFace tokenizer.json.
pub fn load(path: Option<&std::path::Path>) -> anyhow::Result<Arc<dyn Tokenizer>> {
    match path {
        None => Ok(Arc::new(WordPieceTokenizer)),
        Some(p) => hf::load(p),
    }
}

mod hf {
    use super::*;

    pub fn load(p: &std::path::Path) -> anyhow::Result<Arc<dyn Tokenizer>> {
        anyhow::bail!(
            "--tokenizer {}: tokenizer.json support needs kvgate-tokenize's HfTokenizer",
            p.display()
        )
    }
}

/// One chat message's text: a string, or the text parts of a content array.
pub fn message_text(content: &serde_json::Value) -> Option<String> {
    match content {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Null => Some(String::new()),
        serde_json::Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                if let Some(t) = p.get("text").and_then(|t| t.as_str()) {
                    s.push_str(t);
                }
            }
            Some(s)
        }
        _ => None,
    }
}

/// ChatML rendering (`<|im_start|>role\ncontent<|im_end|>\n`, then the assistant header).
pub fn render_chat(messages: &[(String, String)], add_generation_prompt: bool) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str("<|im_start|>");
        s.push_str(role);
        s.push('\n');
        s.push_str(content);
        s.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        s.push_str("<|im_start|>assistant\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn approx_is_deterministic_and_prefix_stable() {
        let t = WordPieceTokenizer;
        let a = t.encode("hello wonderful world");
        assert_eq!(
            a.len(),
            2 + 3 + 2,
            "one token per 4-byte piece of each word"
        );
        assert_eq!(t.encode("hello wonderful world again")[..7], a[..]);
        assert!(t.decode(&a).starts_with(" t"));
    }
}
