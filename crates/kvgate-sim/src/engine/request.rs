//! One request as the engine sees it: its tokens, its blocks and how far it has been computed.

use super::block_pool::{chain_hash, EngineHash};

pub type RequestId = u64;

/// Why a request stopped (OpenAI `finish_reason` and vLLM's `request_success_total` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// A request's part in a prefill/decode handoff (vLLM `kv_transfer_params`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvTransfer {
    #[default]
    None,
    /// Prefill leg (`do_remote_decode`): if it ends length-capped, its blocks stay pinned for a
    /// decode worker to read.
    RemoteDecode,
    /// Decode leg (`do_remote_prefill`) whose KV was pulled: every prompt token but the last counts
    /// as computed (and reported as cached); the last one is recomputed for logits.
    RemotePrefill,
    /// Decode leg of SGLang's bootstrap handoff whose KV arrived: computed like `RemotePrefill`,
    /// but only this worker's own prefix hits are reported as cached (the transferred tokens are
    /// not: SGLang's decode side writes them into freshly allocated slots, not its prefix cache).
    Bootstrapped,
}

/// What the caller submits.
#[derive(Clone, Debug)]
pub struct NewRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub kv: KvTransfer,
    /// vLLM's `priority` (lower first; only with the priority scheduling policy).
    pub priority: i64,
    /// Prompt tokens the client says this worker already holds (the sim's
    /// `x-kvgate-sim-cached-tokens` header with `--assume-cached-header`; 0 = none): the first
    /// `assumed_cached_tokens / block_size` full blocks are cached on admission.
    pub assumed_cached_tokens: usize,
}

#[derive(Debug)]
pub(crate) struct Request {
    pub id: RequestId,
    pub prompt_len: usize,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    /// Output length at which the simulated model emits EOS (`None` with `ignore_eos`).
    pub natural_len: Option<usize>,
    pub computed: usize,
    pub blocks: Vec<usize>,
    /// Chained hashes of the full blocks of `tokens` (grows as tokens are generated).
    pub hashes: Vec<EngineHash>,
    /// Leading blocks already registered in the prefix cache (or taken from it).
    pub cached_blocks: usize,
    /// Prompt tokens served from the prefix cache at first scheduling (`cached_tokens`).
    pub num_cached_tokens: Option<usize>,
    /// See [`NewRequest::assumed_cached_tokens`].
    pub assumed_cached_tokens: usize,
    /// Key for the deterministic output stream.
    pub out_key: u64,
    pub kv: KvTransfer,
    pub priority: i64,
}

impl Request {
    /// Scheduling order under the priority policy: (priority, arrival), lower first.
    pub fn order(&self) -> (i64, RequestId) {
        (self.priority, self.id)
    }
}

impl Request {
    pub fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Extends `hashes` over every full block of `tokens`.
    pub fn update_hashes(&mut self, block_size: usize, none: EngineHash, seed: u64) {
        let full = self.tokens.len() / block_size;
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = if i == 0 { none } else { self.hashes[i - 1] };
            let h = chain_hash(
                parent,
                &self.tokens[i * block_size..(i + 1) * block_size],
                seed,
            );
            self.hashes.push(h);
        }
    }
}
