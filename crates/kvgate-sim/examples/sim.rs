//! `kvgate sim` without the rest of the binary: `cargo run -p kvgate-sim --example sim -- --workers 2 --base-port 18001`.
use clap::Parser;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    sim: kvgate_sim::cli::SimArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvgate_sim::cli::run(Args::parse().sim).await
}
