//! Command-line arguments and entry point (filled in by the gateway work).

#[derive(clap::Args, Debug)]
pub struct ServeArgs {}

pub async fn run(_args: ServeArgs) -> anyhow::Result<()> {
    anyhow::bail!("kvgate serve: not built yet")
}
