//! `kvgate demo`: a simulated fleet, a shared-prefix workload, three policies, one table.

use std::path::PathBuf;

use clap::Parser;

use crate::compare::CompareArgs;

/// The demo is `kvgate bench compare` with fixed, small settings (tuned to finish well within two
/// minutes on two cores).
pub fn demo_args(out_dir: PathBuf) -> CompareArgs {
    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        c: CompareArgs,
    }
    let out = out_dir.to_string_lossy().into_owned();
    let argv = [
        "demo",
        "--workload",
        "shared-prefix",
        "--groups",
        "16",
        "--prompts-per-group",
        "12",
        "--system-tokens",
        "1536",
        "--question-tokens",
        "64",
        "--output-len",
        "32",
        "--workers",
        "6",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "400",
        "--speedup",
        "1",
        "--rate",
        "30",
        "--policies",
        "round_robin,least_loaded,kv",
        "--quiet",
        "--out-dir",
        &out,
    ];
    P::parse_from(argv).c
}

pub async fn run() -> anyhow::Result<()> {
    let out = std::env::temp_dir().join("kvgate-demo");
    let args = demo_args(out.clone());
    eprintln!(
        "kvgate demo: {} simulated workers, shared-prefix workload ({} groups x {} prompts), policies {}",
        args.fleet.workers,
        args.workload.groups,
        args.workload.prompts_per_group,
        args.policies.join(", ")
    );
    crate::compare::run(args).await?;
    println!(
        "plots: {}/ttft_cdf.svg and {}/worker_load.svg",
        out.display(),
        out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn demo_arguments_parse() {
        let a = super::demo_args("/tmp/x".into());
        assert_eq!(a.policies, vec!["round_robin", "least_loaded", "kv"]);
        assert_eq!(a.fleet.workers, 6);
        assert_eq!(a.traffic.rate, Some(30.0));
    }
}
