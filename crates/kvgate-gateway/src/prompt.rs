//! From a parsed request to what the router needs: prompt token ids → chained block hashes, the
//! prompt length, and the affinity key. Token-id prompts are used as given; text goes through the
//! model pool's tokenizer (chat through its chat template) from kvgate-tokenize. Without a
//! configured tokenizer that is kvgate-tokenize's approximate tokenizer with the ChatML template:
//! not the worker's exact tokens, but deterministic and prefix-preserving, which is what prefix
//! routing needs (`kvgate_realised_cached_ratio` vs `kvgate_predicted_overlap_ratio` shows how well).
//!
//! A tokenizer *backend* failure does not fail the request: it is routed on load alone (no hashes).
//!
//! Bodies above [`OFFLOAD_BODY_BYTES`] are tokenized on tokio's blocking pool
//! ([`route_input_offloaded`]): a 100k-token prompt takes milliseconds to tens of milliseconds to
//! tokenize, and on an io thread that would stall every other request on it.

use std::cell::RefCell;
use std::sync::Arc;

use bytes::Bytes;
use kvgate_core::{hash_seed, next_hash, BlockHash};
use kvgate_protocol::openai::{RequestError, RequestView};
use kvgate_tokenize::{ModelTokenizer, Scratch, TokenizeError};

use crate::client_api::{Endpoint, PromptField};

pub use crate::route::RouteInput;

/// Request bodies larger than this are tokenized off the io threads.
pub const OFFLOAD_BODY_BYTES: usize = 16 << 10;

/// [`route_input`], on the blocking pool when `body` is larger than [`OFFLOAD_BODY_BYTES`]
/// (`view` must have been parsed from `body`; the blocking task parses it again, which costs
/// little next to tokenizing it).
pub async fn route_input_offloaded(
    body: &Bytes,
    view: &RequestView<'_>,
    endpoint: Endpoint,
    block_size: u32,
    tokenizer: &Arc<ModelTokenizer>,
) -> Result<RouteInput, TokenizeError> {
    if body.len() <= OFFLOAD_BODY_BYTES || endpoint.api().prompt == PromptField::None {
        return route_input(view, endpoint, block_size, tokenizer);
    }
    let (body, tokenizer) = (body.clone(), tokenizer.clone());
    let task = tokio::task::spawn_blocking(move || {
        let view = parse_view(&body, endpoint)?;
        route_input(&view, endpoint, block_size, &tokenizer)
    });
    match task.await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "tokenizer task failed; routing on load only");
            Ok(RouteInput::default())
        }
    }
}

/// The request view of a body sent to `endpoint`: chat messages are parsed with it; completions
/// and embeddings skip them (a stray `messages` field there means nothing).
pub fn parse_view(body: &[u8], endpoint: Endpoint) -> Result<RequestView<'_>, RequestError> {
    endpoint.parse(body)
}

thread_local! {
    /// A request's block-hash buffer, given back when its request is sent ([`recycle_hashes`]):
    /// the next request's hashes go there instead of a new allocation.
    static HASHES: std::cell::Cell<Vec<kvgate_core::BlockHash>> =
        const { std::cell::Cell::new(Vec::new()) };
}

/// Block hashes no longer needed: their buffer is kept for the next request on this thread
/// (unless it is large).
pub fn recycle_hashes(mut h: Vec<kvgate_core::BlockHash>) {
    if h.capacity() > 0 && h.capacity() <= 4096 {
        h.clear();
        let _ = HASHES.try_with(|c| c.set(h));
    }
}

/// The last prompt's full blocks and their hashes, kept per thread: the next prompt's leading
/// blocks equal to them (a shared system prompt, the earlier turns of a conversation) take their
/// hashes instead of being hashed again. A block's chained hash depends only on the tokens up to
/// its end and on the seed, so with the same seed and block size these are the hashes
/// [`kvgate_core::block_hashes_into`] gives.
#[derive(Debug, Default)]
struct HashMemo {
    seed: u64,
    block_size: usize,
    /// The remembered blocks' tokens (`hashes.len()` whole blocks).
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
}

/// Tokens a [`HashMemo`] keeps at most (64 KiB per thread); blocks past them are hashed each time.
const MEMO_TOKENS: usize = 16 << 10;

impl HashMemo {
    /// [`kvgate_core::block_hashes_into`]: the chained hashes of every full block of `tokens` into
    /// `out` (cleared first); the leading blocks equal to the last call's are not hashed again.
    fn block_hashes_into(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        seed: u64,
        out: &mut Vec<BlockHash>,
    ) {
        out.clear();
        if block_size == 0 {
            return;
        }
        let full = tokens.len() / block_size;
        let same = if seed == self.seed && block_size == self.block_size {
            tokens
                .chunks_exact(block_size)
                .zip(self.tokens.chunks_exact(block_size))
                .take_while(|(a, b)| a == b)
                .count()
        } else {
            0
        };
        out.reserve(full);
        out.extend_from_slice(&self.hashes[..same]);
        let mut parent = out.last().copied();
        for block in tokens[same * block_size..full * block_size].chunks_exact(block_size) {
            let h = next_hash(parent, block, seed);
            out.push(h);
            parent = Some(h);
        }
        // This prompt's blocks, up to the bound: the shared ones are there already.
        let keep = full.min(MEMO_TOKENS / block_size);
        let kept = same.min(keep);
        self.seed = seed;
        self.block_size = block_size;
        self.tokens.truncate(kept * block_size);
        self.tokens
            .extend_from_slice(&tokens[kept * block_size..keep * block_size]);
        self.hashes.truncate(kept);
        self.hashes.extend_from_slice(&out[kept..keep]);
    }
}

/// Build the routing input. Embeddings are load-balanced only (no prefix cache to hit).
/// Client errors (bad `messages`/`prompt`, a template that rejects the conversation) are returned.
pub fn route_input(
    view: &RequestView<'_>,
    endpoint: Endpoint,
    block_size: u32,
    tokenizer: &ModelTokenizer,
) -> Result<RouteInput, TokenizeError> {
    thread_local! {
        /// The rendered prompt and its ids: buffers kept from request to request.
        static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
        static MEMO: RefCell<HashMemo> = RefCell::new(HashMemo::default());
    }
    let mut hashes = HASHES.try_with(|h| h.take()).unwrap_or_default();
    let mut isl = 0;
    match endpoint.api().prompt {
        PromptField::None => {}
        PromptField::Messages if view.messages.is_none() => {
            return Err(RequestError::Missing("messages").into())
        }
        PromptField::Prompt if view.prompt.is_none() => {
            return Err(RequestError::Missing("prompt").into())
        }
        PromptField::Messages | PromptField::Prompt => SCRATCH.with_borrow_mut(|scratch| {
            // A batch goes to one worker as a whole: route on its first prompt.
            let tokens = match tokenizer.routing_tokens(view, scratch) {
                Ok(t) => t,
                Err(e) if e.is_client_error() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "tokenizer failed; routing on load only");
                    &[]
                }
            };
            // LoRA adapters are requested by model name, so the model name is not folded in:
            // pools are per model name already. cache_salt changes the worker's hashes, so it
            // changes ours.
            let seed = hash_seed(None, view.cache_salt.as_deref());
            MEMO.with_borrow_mut(|m| {
                m.block_hashes_into(tokens, block_size as usize, seed, &mut hashes)
            });
            isl = tokens.len() as u64;
            scratch.trim();
            Ok(())
        })?,
    }
    let affinity = view
        .prompt_cache_key
        .as_deref()
        .map(|k| xxhash_rust::xxh3::xxh3_64(k.as_bytes()));
    Ok(RouteInput {
        hashes,
        isl,
        affinity,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The memo gives `block_hashes`' hashes over any sequence of prompts: prefixes of one
        /// text changed at one place and extended, with the seed and the block size changing
        /// between calls.
        #[test]
        fn hash_memo_gives_block_hashes(
            calls in proptest::collection::vec(
                (0usize..300, 0usize..320, 0u32..3, proptest::collection::vec(0u32..5, 0..40), 0usize..3, proptest::bool::ANY),
                1..10,
            )
        ) {
            let base: Vec<u32> = (0..300u32).map(|t| t.wrapping_mul(2_654_435_761) % 1000).collect();
            let mut memo = HashMemo::default();
            let mut out = vec![9];
            for (len, at, v, tail, bs, salted) in calls {
                let mut t = base[..len].to_vec();
                if at < t.len() {
                    t[at] = 1000 + v;
                }
                t.extend(tail);
                let bs = [1, 4, 16][bs];
                let seed = if salted { 7 } else { kvgate_core::BASE_SEED };
                memo.block_hashes_into(&t, bs, seed, &mut out);
                proptest::prop_assert_eq!(&out, &kvgate_core::block_hashes(&t, bs, seed));
                proptest::prop_assert_eq!(memo.tokens.len(), memo.hashes.len() * bs);
            }
        }
    }

    /// A prompt longer than the memo's bound: its blocks past the bound are hashed each time (and a
    /// change there is seen), and the memo keeps the bound. Block size 0 gives no hashes.
    #[test]
    fn hash_memo_keeps_its_bound() {
        let mut t: Vec<u32> = (0..MEMO_TOKENS as u32 + 100).collect();
        let mut memo = HashMemo::default();
        let mut out = Vec::new();
        memo.block_hashes_into(&t, 16, 5, &mut out);
        assert_eq!(out, kvgate_core::block_hashes(&t, 16, 5));
        assert_eq!(memo.tokens.len(), MEMO_TOKENS);
        t[MEMO_TOKENS + 20] = 0;
        memo.block_hashes_into(&t, 16, 5, &mut out);
        assert_eq!(out, kvgate_core::block_hashes(&t, 16, 5));
        t[3] = 1;
        memo.block_hashes_into(&t, 16, 5, &mut out);
        assert_eq!(out, kvgate_core::block_hashes(&t, 16, 5));
        memo.block_hashes_into(&t, 0, 5, &mut out);
        assert!(out.is_empty());
    }

    /// A long prompt is tokenized on the blocking pool: on a single-threaded runtime, a small
    /// request started after it finishes first. Deterministic: the small task is queued before the
    /// big one can be woken again, and inline tokenization would finish the big one in its first
    /// poll (this test then fails).
    #[test]
    fn long_prompts_do_not_block_the_io_thread() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let big = Bytes::from(format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "lorem ipsum dolor sit amet ".repeat(20_000)
        ));
        let small =
            Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        let t = Arc::new(ModelTokenizer::default());
        let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
        rt.block_on(async {
            let mut tasks = Vec::new();
            for (name, body) in [("big", big), ("small", small)] {
                let (t, order) = (t.clone(), order.clone());
                tasks.push(tokio::spawn(async move {
                    let view = RequestView::parse(&body).unwrap();
                    let ri = route_input_offloaded(&body, &view, Endpoint::CHAT, 16, &t)
                        .await
                        .unwrap();
                    order.lock().push(name);
                    ri
                }));
            }
            let mut res = Vec::new();
            for task in tasks {
                res.push(task.await.unwrap());
            }
            assert!(res[0].isl > 50_000, "big prompt tokenized: {}", res[0].isl);
            assert!(res[1].isl > 0 && res[1].isl < 50);
        });
        assert_eq!(*order.lock(), ["small", "big"]);
    }

    #[tokio::test]
    async fn offloaded_and_inline_agree() {
        let body = Bytes::from(format!(
            r#"{{"model":"m","cache_salt":"s","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "abc def ".repeat(4000)
        ));
        assert!(body.len() > OFFLOAD_BODY_BYTES);
        let t = Arc::new(ModelTokenizer::default());
        let view = RequestView::parse(&body).unwrap();
        let a = route_input_offloaded(&body, &view, Endpoint::CHAT, 16, &t)
            .await
            .unwrap();
        let b = route_input(&view, Endpoint::CHAT, 16, &t).unwrap();
        assert_eq!((a.hashes, a.isl), (b.hashes, b.isl));
    }

    #[test]
    fn shared_chat_prefix_shares_blocks() {
        let sys = "You are a helpful assistant. ".repeat(20);
        let a = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"a"}}]}}"#
        );
        let b = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"b"}}]}}"#
        );
        let t = ModelTokenizer::default();
        let ra = route_input(
            &RequestView::parse(a.as_bytes()).unwrap(),
            Endpoint::CHAT,
            16,
            &t,
        )
        .unwrap();
        let rb = route_input(
            &RequestView::parse(b.as_bytes()).unwrap(),
            Endpoint::CHAT,
            16,
            &t,
        )
        .unwrap();
        assert!(ra.hashes.len() >= 8);
        assert_eq!(ra.hashes[..8], rb.hashes[..8]);
    }

    #[test]
    fn token_prompts_are_used_as_is() {
        let body = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#;
        let t = ModelTokenizer::default();
        let r = route_input(
            &RequestView::parse(body).unwrap(),
            Endpoint::COMPLETIONS,
            4,
            &t,
        )
        .unwrap();
        let t = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(
            r.hashes,
            kvgate_core::block_hashes(&t, 4, kvgate_core::BASE_SEED)
        );
        assert_eq!(r.isl, 8);
    }
}
