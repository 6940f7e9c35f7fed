//! `kvgate hash`: reads a JSON array of token ids on stdin, prints one chained block hash per line.

#[derive(clap::Args, Debug)]
pub struct HashArgs {
    /// Tokens per KV block (must match the workers' block size).
    #[arg(long)]
    pub block_size: usize,
    /// LoRA adapter name folded into the hash seed.
    #[arg(long)]
    pub lora: Option<String>,
    /// cache_salt folded into the hash seed.
    #[arg(long)]
    pub salt: Option<String>,
}

pub fn run(_args: HashArgs) -> anyhow::Result<()> {
    anyhow::bail!("kvgate hash: not built yet")
}
