//! Command-line arguments and entry points for `kvgate bench` and `kvgate demo`.

#[derive(clap::Args, Debug)]
pub struct BenchArgs {}

#[derive(clap::Args, Debug)]
pub struct DemoArgs {}

pub async fn run_bench(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("kvgate bench: not built yet")
}

pub async fn run_demo(_args: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("kvgate demo: not built yet")
}
