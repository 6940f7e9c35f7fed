//! What every system suite needs: where the repository and the `kvgate` binary are.
//!
//! Suites (one file each, see README.md "Test"): `serve_sdk` (the OpenAI SDK end to end through
//! `kvgate sim` + `kvgate serve`), `bench_e2e` (`kvgate bench`/`demo`), `docs_match_code` (every
//! flag, key and metric is documented), `deploy_*` (container, Helm, Prometheus rules, Grafana
//! dashboard against a live gateway).
#![forbid(unsafe_code)]

use std::path::PathBuf;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

/// The `kvgate` binary: `$KVGATE_BIN`, else the one built beside this test executable
/// (`target/<profile>/deps/<test>` → `target/<profile>/kvgate`).
pub fn kvgate_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVGATE_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executable under target/<profile>/deps");
    let bin = profile_dir.join(format!("kvgate{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} not found: build it first (`cargo build -p kvgate`, or run the suites with \
         `cargo nextest run --workspace`, which builds it), or set KVGATE_BIN",
        bin.display()
    );
    bin
}
