//! `kvgate serve` without the rest of the `kvgate` binary (sim, bench): a faster release build for
//! the overhead benchmark. Same flags as `kvgate serve`.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: kvgate_gateway::cli::ServeArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let threads: usize = std::env::var("KVGATE_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        b.worker_threads(threads);
    }
    b.enable_all()
        .build()?
        .block_on(kvgate_gateway::cli::run(cli.serve))
}
