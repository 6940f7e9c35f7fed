//! From a parsed request to what the router needs: prompt token ids → chained block hashes, the
//! prompt length, and the affinity key. Token-id prompts are used as given; text goes through the
//! model pool's tokenizer (chat through its chat template).
//!
//! Until a pool has a configured tokenizer, the *approximate* tokenizer is used: one token per 4
//! bytes of UTF-8, each message prefixed by a role marker token. It is not the worker's tokenization,
//! but it is deterministic and prefix-preserving (a shared text prefix gives shared leading blocks),
//! which is what prefix routing needs; `cached_tokens` vs predicted overlap shows its accuracy.

use kvgate_core::{block_hashes_into, hash_seed};
use kvgate_protocol::openai::{PromptInput, RequestError, RequestView};

use crate::ctx::Endpoint;

/// Routing input of one request.
#[derive(Debug, Default)]
pub struct RouteInput {
    pub hashes: Vec<u64>,
    pub isl: u64,
    pub affinity: Option<u64>,
}

/// Build the routing input. Embeddings are load-balanced only (no prefix cache to hit).
pub fn route_input(
    view: &RequestView<'_>,
    endpoint: Endpoint,
    block_size: u32,
    tokens: &mut Vec<u32>,
) -> Result<RouteInput, RequestError> {
    tokens.clear();
    match endpoint {
        Endpoint::Embeddings => {}
        Endpoint::Chat => {
            for m in view.messages()? {
                tokens.push(role_marker(&m.role));
                if let Some(c) = &m.content {
                    approx_encode(&c.text(), tokens);
                }
            }
        }
        Endpoint::Completions => match view.prompt_input()? {
            PromptInput::Text(t) => approx_encode(&t, tokens),
            // A batch is routed as a whole to one worker: route on its first prompt.
            PromptInput::Texts(v) => approx_encode(v.first().map(|s| &**s).unwrap_or(""), tokens),
            PromptInput::Tokens(t) => tokens.extend_from_slice(&t),
            PromptInput::TokenBatches(v) => {
                tokens.extend_from_slice(v.first().map(|t| &t[..]).unwrap_or(&[]))
            }
        },
    }
    // LoRA adapters are requested by model name, so the model name is not folded in: pools are
    // per model name already. cache_salt changes the worker's hashes, so it changes ours.
    let seed = hash_seed(None, view.cache_salt.as_deref());
    let mut hashes = Vec::new();
    block_hashes_into(tokens, block_size as usize, seed, &mut hashes);
    let affinity = view
        .prompt_cache_key
        .as_deref()
        .map(|k| xxhash_rust::xxh3::xxh3_64(k.as_bytes()));
    Ok(RouteInput {
        hashes,
        isl: tokens.len() as u64,
        affinity,
    })
}

fn role_marker(role: &str) -> u32 {
    // High ids so they never collide with 4-byte text tokens of ASCII text.
    0xF000_0000 | (xxhash_rust::xxh3::xxh3_64(role.as_bytes()) as u32 & 0x0FFF_FFFF)
}

/// One token per 4 bytes (little-endian), last partial chunk zero-padded.
pub fn approx_encode(text: &str, out: &mut Vec<u32>) {
    let b = text.as_bytes();
    out.reserve(b.len().div_ceil(4));
    let mut chunks = b.chunks_exact(4);
    for c in &mut chunks {
        out.push(u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    }
    let r = chunks.remainder();
    if !r.is_empty() {
        let mut buf = [0u8; 4];
        buf[..r.len()].copy_from_slice(r);
        out.push(u32::from_le_bytes(buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_chat_prefix_shares_blocks() {
        let sys = "You are a helpful assistant. ".repeat(20);
        let a = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"a"}}]}}"#
        );
        let b = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"b"}}]}}"#
        );
        let mut t = Vec::new();
        let ra = route_input(
            &RequestView::parse(a.as_bytes()).unwrap(),
            Endpoint::Chat,
            16,
            &mut t,
        )
        .unwrap();
        let rb = route_input(
            &RequestView::parse(b.as_bytes()).unwrap(),
            Endpoint::Chat,
            16,
            &mut t,
        )
        .unwrap();
        assert!(ra.hashes.len() >= 8);
        assert_eq!(ra.hashes[..8], rb.hashes[..8]);
    }

    #[test]
    fn token_prompts_are_used_as_is() {
        let body = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#;
        let mut t = Vec::new();
        let r = route_input(
            &RequestView::parse(body).unwrap(),
            Endpoint::Completions,
            4,
            &mut t,
        )
        .unwrap();
        assert_eq!(t, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            r.hashes,
            kvgate_core::block_hashes(&t, 4, kvgate_core::BASE_SEED)
        );
        assert_eq!(r.isl, 8);
    }
}
