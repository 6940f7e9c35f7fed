//! The `kvgate` binary: command-line wiring only. Each subcommand's arguments and behaviour live in
//! the crate that owns it (`kvgate-gateway` for `serve`, `kvgate-sim` for `sim`, `kvgate-bench` for
//! `bench` and `demo`); `hash` is small enough to live here (`hash_cmd.rs`).
#![forbid(unsafe_code)]

mod hash_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "kvgate",
    version,
    about = "KV-cache-aware router and gateway for LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the gateway: an OpenAI-compatible endpoint that routes to a fleet of workers.
    Serve(kvgate_gateway::cli::ServeArgs),
    /// Run the gateway as an Envoy ext_proc endpoint picker (Gateway API Inference Extension
    /// EPP): Envoy proxies, kvgate picks the worker. Same config and flags as `serve`, plus [epp].
    Epp(kvgate_gateway::cli::EppArgs),
    /// Run one simulated vLLM worker, or a whole simulated fleet (`--workers N`).
    Sim(kvgate_sim::cli::SimArgs),
    /// Load generator and policy A/B comparison.
    Bench(kvgate_bench::cli::BenchArgs),
    /// One-command demo: a simulated fleet, three policies, one table.
    Demo(kvgate_bench::cli::DemoArgs),
    /// Print the chained KV block hashes of a JSON array of token ids read from stdin.
    Hash(hash_cmd::HashArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Hash(args) => hash_cmd::run(args),
        command => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                match command {
                    Command::Serve(args) => kvgate_gateway::cli::run(args).await,
                    Command::Epp(args) => kvgate_gateway::cli::run_epp(args).await,
                    Command::Sim(args) => kvgate_sim::cli::run(args).await,
                    Command::Bench(args) => kvgate_bench::cli::run_bench(args).await,
                    Command::Demo(args) => kvgate_bench::cli::run_demo(args).await,
                    Command::Hash(_) => unreachable!("handled above"),
                }
            })
        }
    }
}
