//! Command-line arguments and entry point (filled in by the sim work).

#[derive(clap::Args, Debug)]
pub struct SimArgs {}

pub async fn run(_args: SimArgs) -> anyhow::Result<()> {
    anyhow::bail!("kvgate sim: not built yet")
}
