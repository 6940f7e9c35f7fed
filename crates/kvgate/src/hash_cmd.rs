//! `kvgate hash`: reads a JSON array of token ids on stdin, prints one chained block hash per line
//! (decimal u64), exactly as the router computes them (see `kvgate_core::hash`). Operators use it to
//! compare the router's view of a prompt with a worker's KV events when hits are unexpectedly low.

use anyhow::{bail, Context};
use std::io::{Read, Write};

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

pub fn run(args: HashArgs) -> anyhow::Result<()> {
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("kvgate hash: reading stdin")?;
    let out = render(&args, &input)?;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.hashes.as_bytes())
        .and_then(|_| stdout.flush())
    {
        // `kvgate hash | head -1` is fine.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r.context("kvgate hash: writing stdout")?,
    }
    if let Some(note) = out.note {
        eprintln!("{note}");
    }
    Ok(())
}

#[derive(Debug)]
struct Rendered {
    hashes: String,
    note: Option<String>,
}

fn render(args: &HashArgs, input: &str) -> anyhow::Result<Rendered> {
    if args.block_size == 0 {
        bail!("kvgate hash: --block-size must be at least 1");
    }
    let tokens: Vec<u32> = serde_json::from_str(input).with_context(|| {
        format!(
            "kvgate hash: stdin must be a JSON array of token ids (integers 0..={}), e.g. [1, 2, 3]",
            u32::MAX
        )
    })?;
    let seed = kvgate_core::hash_seed(args.lora.as_deref(), args.salt.as_deref());
    let hashes = kvgate_core::block_hashes(&tokens, args.block_size, seed);
    let mut text = String::with_capacity(hashes.len() * 21);
    for h in &hashes {
        text.push_str(&h.to_string());
        text.push('\n');
    }
    let tail = tokens.len() % args.block_size;
    let note = (tail > 0).then(|| {
        format!(
            "note: {} token(s) at the end do not fill a block of {} and have no hash",
            tail, args.block_size
        )
    });
    Ok(Rendered { hashes: text, note })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(bs: usize) -> HashArgs {
        HashArgs {
            block_size: bs,
            lora: None,
            salt: None,
        }
    }

    #[test]
    fn renders_issue_vector_and_notes_partial_tail() {
        let r = render(&args(4), "[1,2,3,4,5,6,7,8,9,10]").unwrap();
        assert_eq!(r.hashes, "14643705804678351452\n4945711292740353085\n");
        assert!(r.note.unwrap().contains("2 token(s)"));
    }

    #[test]
    fn rejects_bad_input() {
        for bad in ["", "[1,-2]", "[1.5]", "{\"a\":1}", "[4294967296]", "[1,2"] {
            let e = render(&args(4), bad).unwrap_err();
            assert!(
                format!("{e:#}").contains("JSON array of token ids"),
                "{bad}: {e:#}"
            );
        }
        assert!(render(&args(0), "[1]")
            .unwrap_err()
            .to_string()
            .contains("--block-size"));
    }
}
