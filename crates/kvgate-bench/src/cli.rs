//! Command-line arguments and entry points for `kvgate bench` (`run`, `compare`) and `kvgate demo`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};

use crate::client::{Api, Target};
use crate::runner::{Arrival, RunConfig};
use crate::stats::Slo;
use crate::workload::{self, multi_turn::MultiTurn, shared_prefix::SharedPrefix, WorkloadOptions};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Drive one OpenAI-compatible endpoint with a workload and report latency, throughput,
    /// goodput and cache reuse.
    Run(Box<RunArgs>),
    /// Start a simulated fleet and one gateway per policy, replay the same workload against each
    /// (plus any --external router), and write a table, JSON and SVG plots.
    Compare(Box<crate::compare::CompareArgs>),
    /// Flow control on vs off on one simulated fleet: interactive TTFT under a batch flood,
    /// objective attainment, tenant shares with weights 2:1:1 (docs/flow-control.md).
    Flow(Box<crate::flow::FlowArgs>),
}

/// What to send.
#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// shared-prefix | multi-turn | agentic | mooncake:FILE | azure:FILE
    #[arg(long, default_value = "shared-prefix")]
    pub workload: String,
    /// Seed for every random choice (content, shuffles, Poisson arrivals).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Tokens per Mooncake hash_id block (the trace's own is 512; lengths scale with it).
    #[arg(long, default_value_t = 512)]
    pub trace_block_tokens: usize,
    /// Multiplies trace timestamps (0.5 = replay twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Caps every request's output tokens.
    #[arg(long)]
    pub max_output_tokens: Option<u32>,
    /// Output tokens per request for the synthetic workloads.
    #[arg(long, default_value_t = 64)]
    pub output_len: u32,
    /// shared-prefix: number of groups (distinct system prompts).
    #[arg(long, default_value_t = 32)]
    pub groups: usize,
    /// shared-prefix: prompts per group.
    #[arg(long, default_value_t = 16)]
    pub prompts_per_group: usize,
    /// shared-prefix / multi-turn: system prompt tokens.
    #[arg(long, default_value_t = 1024)]
    pub system_tokens: usize,
    /// shared-prefix: question tokens (unique per prompt).
    #[arg(long, default_value_t = 128)]
    pub question_tokens: usize,
    /// multi-turn / agentic: sessions.
    #[arg(long, default_value_t = 32)]
    pub sessions: usize,
    /// multi-turn: turns per session; agentic: mean turns per session.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// multi-turn / agentic: tokens per user message.
    #[arg(long, default_value_t = 128)]
    pub user_tokens: usize,
    /// agentic: distinct system prompts the sessions share.
    #[arg(long, default_value_t = 4)]
    pub system_prompts: usize,
    /// agentic: mean tool-result tokens appended per tool turn.
    #[arg(long, default_value_t = 384)]
    pub tool_tokens: usize,
    /// agentic: session starts per second (Poisson).
    #[arg(long, default_value_t = 1.0)]
    pub session_rate: f64,
    /// agentic: mean think time between a session's turns, ms (exponential).
    #[arg(long, default_value_t = 2000.0)]
    pub think_ms: f64,
}

impl WorkloadArgs {
    pub fn options(&self) -> WorkloadOptions {
        WorkloadOptions {
            seed: self.seed,
            trace_block_tokens: self.trace_block_tokens,
            time_scale: self.time_scale,
            max_output_tokens: self.max_output_tokens,
            shared_prefix: SharedPrefix {
                groups: self.groups,
                prompts_per_group: self.prompts_per_group,
                system_tokens: self.system_tokens,
                question_tokens: self.question_tokens,
            },
            multi_turn: MultiTurn {
                sessions: self.sessions,
                turns: self.turns,
                system_tokens: self.system_tokens,
                user_tokens: self.user_tokens,
            },
            agentic: workload::agentic::Agentic {
                sessions: self.sessions,
                turns: self.turns,
                system_prompts: self.system_prompts,
                system_tokens: self.system_tokens,
                user_tokens: self.user_tokens,
                tool_tokens: self.tool_tokens,
                session_rate: self.session_rate,
                think_ms: self.think_ms,
                ..Default::default()
            },
            output_len: self.output_len,
        }
    }

    pub fn load(&self) -> anyhow::Result<workload::Workload> {
        workload::load(&self.workload, &self.options())
    }
}

/// How to send it.
#[derive(Args, Debug, Clone)]
pub struct TrafficArgs {
    /// Model name sent in every request.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// completions (token-id prompts, exact hashing), text (completions with a string prompt),
    /// chat (prompts as text; the server re-tokenizes, so the oracle is indicative), responses
    /// (OpenAI /v1/responses as Codex sends it: session-id header, prompt_cache_key, tool calls
    /// as function_call items) or messages (Anthropic /v1/messages as Claude Code sends it:
    /// x-claude-code-session-id header, billing-header system block, tool_use / tool_result).
    /// TTFT is the first generated delta of each API (response.*.delta, content_block_delta).
    #[arg(long, value_enum, default_value_t = Api::Completions)]
    pub api: Api,
    /// --api responses with an agent workload: this share (0..=1) of the sessions chain their
    /// turns with previous_response_id and store: true (each turn waits for the previous turn's
    /// response id; the servers must store responses: vLLM and kvgate sim with
    /// VLLM_ENABLE_RESPONSES_API_STORE=1). The other sessions send store: false and the whole
    /// input every turn, as Codex does.
    #[arg(long, default_value_t = 0.25)]
    pub chain_share: f64,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop: this many requests in flight.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Send at most this many requests (the workload's first N).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Stop sending new requests after this many seconds.
    #[arg(long)]
    pub duration: Option<f64>,
    /// TTFT SLO in ms for goodput.
    #[arg(long)]
    pub slo_ttft: Option<f64>,
    /// Mean inter-token latency SLO in ms for goodput.
    #[arg(long)]
    pub slo_itl: Option<f64>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub request_timeout: f64,
    /// No progress bar even on a terminal.
    #[arg(long)]
    pub quiet: bool,
}

fn secs(v: f64, what: &str) -> anyhow::Result<Duration> {
    anyhow::ensure!(v.is_finite() && v >= 0.0, "{what} must be a number >= 0");
    Ok(Duration::from_secs_f64(v))
}

impl TrafficArgs {
    pub fn slo(&self) -> anyhow::Result<Slo> {
        Ok(Slo {
            ttft: self
                .slo_ttft
                .map(|v| secs(v / 1e3, "--slo-ttft"))
                .transpose()?,
            itl: self
                .slo_itl
                .map(|v| secs(v / 1e3, "--slo-itl"))
                .transpose()?,
        })
    }

    pub fn target(&self, url: &str) -> anyhow::Result<Target> {
        self.targets(&[url.to_owned()])
    }

    /// One target over several replicas of a server, taken in turn per request.
    pub fn targets(&self, urls: &[String]) -> anyhow::Result<Target> {
        anyhow::ensure!(self.request_timeout > 0.0, "--request-timeout must be > 0");
        Target::round_robin(
            urls,
            &self.model,
            self.api,
            secs(self.request_timeout, "--request-timeout")?,
        )?
        .with_chain_share(self.chain_share)
    }

    pub fn run_config(&self, wl: &workload::Workload, seed: u64) -> anyhow::Result<RunConfig> {
        let arrival = match (self.rate, self.concurrency) {
            (Some(rate), _) => Arrival::Poisson { rate, seed },
            (None, Some(c)) => Arrival::Closed { concurrency: c },
            (None, None) if wl.has_timestamps() => Arrival::Trace,
            (None, None) => anyhow::bail!(
                "workload {} has no timestamps: give --rate R (open loop) or --concurrency C (closed loop)",
                wl.name
            ),
        };
        Ok(RunConfig {
            arrival,
            max_requests: self.requests,
            duration: self.duration.map(|d| secs(d, "--duration")).transpose()?,
            progress: !self.quiet && crate::runner::interactive(),
        })
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Base URL of the OpenAI-compatible server (http://host:port).
    #[arg(long)]
    pub url: String,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub traffic: TrafficArgs,
    /// Block size for the oracle hit rate (the fleet's KV block size).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Fleet capacity in blocks (all workers) for the capacity-bounded oracle.
    #[arg(long)]
    pub capacity_blocks: Option<usize>,
    /// Write the full report as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub use crate::demo::DemoArgs;

pub async fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        BenchCommand::Run(a) => run_once(*a).await,
        BenchCommand::Compare(a) => crate::compare::run(*a).await,
        BenchCommand::Flow(a) => crate::flow::run_flow(*a).await,
    }
}

async fn run_once(a: RunArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.block_size > 0, "--block-size must be > 0");
    let wl = a.workload.load()?;
    let target = a.traffic.target(&a.url)?;
    let cfg = a.traffic.run_config(&wl, a.workload.seed)?;
    let slo = a.traffic.slo()?;
    let res = tokio::select! {
        r = crate::runner::run(&target, &wl, &cfg) => r?,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted"),
    };
    // One outcome per request sent, and requests are sent from the head in order: the oracle is
    // over exactly those (--requests / --duration cut a long trace).
    let oracle = crate::oracle::compute(
        &wl.head(res.outcomes.len()),
        a.block_size,
        a.capacity_blocks,
    );
    let summary = crate::stats::summarize(&res.outcomes, res.duration, slo);
    print!("{}", crate::report::run_text(&summary, Some(&oracle)));
    if let Some(path) = &a.out {
        let json = serde_json::json!({
            "workload": a.workload.workload,
            "url": a.url,
            "model": a.traffic.model,
            "api": a.traffic.api,
            "oracle": oracle,
            "summary": summary,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        println!("report: {}", path.display());
    }
    Ok(())
}

pub async fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    crate::demo::run(args).await
}
