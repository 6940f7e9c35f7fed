//! Workloads: a deterministic list of requests (token-id prompts, output lengths, optional arrival
//! times) built from a spec string such as `shared-prefix`, `multi-turn`, `agentic`, `mooncake:FILE` or
//! `azure:FILE`. Prompts are token ids so the oracle and the router hash exactly the same blocks.

pub mod agentic;
pub mod azure;
pub mod mooncake;
pub mod multi_turn;
pub mod shared_prefix;

use std::time::Duration;

/// Token ids we generate stay in this range: clear of the special tokens at the bottom of real
/// vocabularies and inside every vocabulary a simulated or small real model might use.
pub const TOKEN_LO: u32 = 1000;
pub const TOKEN_HI: u32 = 30000;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Offset from the start of the run (trace workloads); `None` when the rate or the closed loop
    /// decides the arrival.
    pub at: Option<Duration>,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// Agent workloads: the session and the message structure of the prompt (what the chat,
    /// Responses and Messages clients render as messages); `None`: one user message.
    pub turn: Option<Turn>,
    /// `bench compare --loaded-floor`: prompt tokens the serving sim must treat as cached, sent as
    /// its `x-kvgate-sim-cached-tokens` header (`kvgate sim --assume-cached-header`).
    pub sim_cached_tokens: Option<usize>,
}

/// Where a request sits in an agent session, and how its prompt splits into messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub session: u64,
    /// 0 for the session's first request.
    pub index: usize,
    /// The prompt's parts in order; their lengths add up to the prompt's.
    pub parts: Vec<Part>,
    /// How many of `parts` the session's previous request sent (0 on the first turn): the parts
    /// after those are the previous answer and what this turn adds.
    pub prev_parts: usize,
}

/// One message of an agent prompt: `len` tokens of the prompt, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub role: Role,
    pub len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    /// The (synthetic) answer of the previous turn.
    Assistant,
    /// A tool's output, answering a call the previous answer made.
    ToolResult,
}

/// A named, ordered list of requests.
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: String,
    pub requests: Vec<Request>,
}

impl Workload {
    /// True when every request carries its own arrival time (the trace can drive an open loop).
    pub fn has_timestamps(&self) -> bool {
        !self.requests.is_empty() && self.requests.iter().all(|r| r.at.is_some())
    }

    /// Total prompt tokens.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.prompt.len() as u64).sum()
    }

    /// The first `n` requests: what a run capped at `n` (or stopped after `n`) sent. The oracle
    /// must see only these, or a slice of a long trace is measured against the whole trace's reuse.
    pub fn head(&self, n: usize) -> Workload {
        Workload {
            name: self.name.clone(),
            requests: self.requests[..n.min(self.requests.len())].to_vec(),
        }
    }
}

/// Knobs shared by all workload kinds (the CLI fills it).
#[derive(Debug, Clone)]
pub struct WorkloadOptions {
    pub seed: u64,
    /// Tokens per Mooncake `hash_id` block (the trace uses 512; scale down for small fleets).
    pub trace_block_tokens: usize,
    /// Multiplies trace timestamps (0.5 replays twice as fast).
    pub time_scale: f64,
    /// Caps every request's output length.
    pub max_output_tokens: Option<u32>,
    pub shared_prefix: shared_prefix::SharedPrefix,
    pub multi_turn: multi_turn::MultiTurn,
    pub agentic: agentic::Agentic,
    /// Output length for synthetic workloads.
    pub output_len: u32,
}

impl Default for WorkloadOptions {
    fn default() -> Self {
        Self {
            seed: 42,
            trace_block_tokens: 512,
            time_scale: 1.0,
            max_output_tokens: None,
            shared_prefix: shared_prefix::SharedPrefix::default(),
            multi_turn: multi_turn::MultiTurn::default(),
            agentic: agentic::Agentic::default(),
            output_len: 64,
        }
    }
}

/// Builds the workload named by `spec`.
pub fn load(spec: &str, opts: &WorkloadOptions) -> anyhow::Result<Workload> {
    let mut wl = match spec.split_once(':') {
        Some(("mooncake", path)) => {
            let text = read(path)?;
            let records = mooncake::parse(&text).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
            mooncake::build(&records, opts.trace_block_tokens, opts.time_scale, opts.seed)
                .map_err(|e| anyhow::anyhow!("{path}: {e}"))?
        }
        Some(("azure", path)) => {
            let text = read(path)?;
            let rows = azure::parse(&text).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
            azure::build(&rows, opts.time_scale, opts.seed)
        }
        None if spec == "shared-prefix" => opts.shared_prefix.build(opts.output_len, opts.seed),
        None if spec == "multi-turn" => opts.multi_turn.build(opts.output_len, opts.seed),
        None if spec == "agentic" => {
            let mut wl = opts.agentic.build(opts.output_len, opts.seed)?;
            anyhow::ensure!(
                opts.time_scale.is_finite() && opts.time_scale > 0.0,
                "--time-scale must be > 0"
            );
            for r in &mut wl.requests {
                r.at = r.at.map(|t| t.mul_f64(opts.time_scale));
            }
            wl
        }
        _ => anyhow::bail!(
            "unknown workload {spec:?}: expected shared-prefix, multi-turn, agentic, mooncake:FILE or azure:FILE"
        ),
    };
    if let Some(cap) = opts.max_output_tokens {
        for r in &mut wl.requests {
            r.max_tokens = r.max_tokens.min(cap).max(1);
        }
    }
    Ok(wl)
}

fn read(path: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read workload file {path}: {e}"))
}

/// Appends `n` pseudo-random token ids drawn from `rng`.
pub(crate) fn push_random(rng: &mut fastrand::Rng, n: usize, out: &mut Vec<u32>) {
    out.extend((0..n).map(|_| rng.u32(TOKEN_LO..TOKEN_HI)));
}

/// A block of `n` tokens that depends only on `(seed, key)`: equal keys give equal blocks.
pub(crate) fn keyed_block(seed: u64, key: u64, n: usize, out: &mut Vec<u32>) {
    // splitmix-style mixing so nearby keys give unrelated streams.
    let mut z = seed ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let mut rng = fastrand::Rng::with_seed(z ^ (z >> 31));
    push_random(&mut rng, n, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_blocks_depend_only_on_seed_and_key() {
        let (mut a, mut b, mut c) = (vec![], vec![], vec![]);
        keyed_block(1, 7, 32, &mut a);
        keyed_block(1, 7, 32, &mut b);
        keyed_block(1, 8, 32, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|t| (TOKEN_LO..TOKEN_HI).contains(t)));
    }

    #[test]
    fn head_is_what_was_sent_and_the_oracle_sees_only_it() {
        let req = |key: u64| {
            let mut prompt = Vec::new();
            keyed_block(3, key, 64, &mut prompt);
            Request {
                at: None,
                prompt,
                max_tokens: 1,
                turn: None,
                sim_cached_tokens: None,
            }
        };
        // The third request repeats the first: reuse exists only past the first two.
        let wl = Workload {
            name: "t".into(),
            requests: vec![req(1), req(2), req(1)],
        };
        let two = wl.head(2);
        assert_eq!(two.requests.len(), 2);
        assert_eq!(two.requests[1].prompt, wl.requests[1].prompt);
        assert_eq!(
            crate::oracle::compute(&two, 16, None).infinite_hit_rate,
            0.0
        );
        // Whole: the repeat hits (64 - 1) / 16 = 3 blocks = 48 of 192 prompt tokens.
        assert_eq!(
            crate::oracle::compute(&wl, 16, None).infinite_hit_rate,
            0.25
        );
        assert_eq!(wl.head(10).requests.len(), 3);
        assert!(wl.head(0).requests.is_empty());
    }

    #[test]
    fn unknown_spec_is_a_clear_error() {
        let err = load("nope", &WorkloadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown workload"), "{err}");
        let err = load("mooncake:/nonexistent/x.jsonl", &WorkloadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot read"), "{err}");
    }

    #[test]
    fn output_cap_applies() {
        let opts = WorkloadOptions {
            max_output_tokens: Some(5),
            ..Default::default()
        };
        let wl = load("shared-prefix", &opts).unwrap();
        assert!(wl.requests.iter().all(|r| r.max_tokens == 5));
    }
}
