//! deploy/ is consistent and checked: `deploy/check.sh` (promtool config/rules/unit tests, the
//! dashboard's shape, the Helm chart rendered by Helm's engine against deploy/k8s/), the configs the
//! chart and the image ship parse with the gateway's own config loader (so a renamed key breaks
//! this test, not a production rollout), the Dockerfile's HEALTHCHECK command really probes a
//! running gateway, and what the Dockerfile's builder stage copies is a workspace cargo can load.
//! The image itself is built and run by tests/container_image.rs (.ci/docker.sh builds it in CI).

use std::process::Command;

use kvgate_gateway::config::Config;
use kvgate_system_tests::harness::*;

#[test]
fn deploy_check_script_passes() {
    let root = repo_root();
    let out = Command::new("bash")
        .arg(root.join("deploy/check.sh"))
        .output()
        .expect("run deploy/check.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    match out.status.code() {
        Some(0) => assert!(text.contains("all checks passed"), "{text}"),
        Some(77) => {
            let why = text
                .lines()
                .find(|l| l.starts_with("skipped:"))
                .unwrap_or("a tool is missing")
                .to_string();
            tool_missing(&format!("deploy/check.sh: {why}\n{text}"));
        }
        code => panic!("deploy/check.sh failed ({code:?}):\n{text}"),
    }
}

/// The TOML inside a YAML literal block `key: |` (the lines indented deeper than the key).
fn yaml_block(yaml: &str, key: &str) -> String {
    let lines: Vec<&str> = yaml.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.trim_start() == format!("{key}: |"))
        .unwrap_or_else(|| panic!("no `{key}: |` block"));
    let key_indent = lines[at].len() - lines[at].trim_start().len();
    let body: Vec<&str> = lines[at + 1..]
        .iter()
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > key_indent)
        .copied()
        .collect();
    let indent = body
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    body.iter()
        .map(|l| l.get(indent..).unwrap_or("").trim_end())
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_string()
        + "\n"
}

#[test]
fn shipped_configs_parse_with_the_gateway_config_loader() {
    let root = repo_root();
    let values = std::fs::read_to_string(root.join("deploy/helm/kvgate/values.yaml")).unwrap();
    let rendered = std::fs::read_to_string(root.join("deploy/k8s/configmap.yaml")).unwrap();
    let from_values = yaml_block(&values, "config");
    let from_manifest = yaml_block(&rendered, "kvgate.toml");
    assert_eq!(
        from_values, from_manifest,
        "deploy/k8s/configmap.yaml does not carry values.yaml's config"
    );
    let cfg = Config::from_toml(&from_manifest)
        .unwrap_or_else(|e| panic!("chart config: {e:#}\n{from_manifest}"));
    assert_eq!(cfg.workers.len(), 2);
    assert!(cfg.workers.iter().all(|w| w.kv_events.is_some()));

    let image_cfg = std::fs::read_to_string(root.join("deploy/docker/kvgate.toml")).unwrap();
    let cfg = Config::from_toml(&image_cfg).unwrap_or_else(|e| panic!("image config: {e:#}"));
    assert!(
        cfg.workers.is_empty(),
        "the image config names no workers (KVGATE_WORKERS does)"
    );

    // The rendered Deployment wires the probes to the endpoints kvgate serves and the port it listens on.
    let dep = std::fs::read_to_string(root.join("deploy/k8s/deployment.yaml")).unwrap();
    for needle in [
        "path: /health",
        "path: /ready",
        "value: \"0.0.0.0:8080\"",
        "containerPort: 8080",
        "runAsNonRoot: true",
        "checksum/config:",
    ] {
        assert!(dep.contains(needle), "deployment.yaml lacks {needle:?}");
    }
}

#[test]
fn dockerfile_is_multi_stage_non_root_with_health_probe() {
    let df = std::fs::read_to_string(repo_root().join("deploy/Dockerfile")).unwrap();
    let instr: Vec<&str> = df
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    let from: Vec<&&str> = instr.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(from.len(), 2, "{from:?}");
    // Base images are build arguments (CI builds with local stand-ins) whose defaults are the
    // public images.
    assert_eq!(from[0].trim(), "FROM ${RUST_IMAGE} AS builder");
    assert_eq!(from[1].trim(), "FROM ${RUNTIME_IMAGE} AS runtime");
    for arg in [
        "ARG RUST_IMAGE=rust:1.95-slim-bookworm",
        "ARG RUNTIME_IMAGE=debian:bookworm-slim",
        "ARG CARGO_PROFILE=release",
    ] {
        assert!(instr.iter().any(|l| l.trim() == arg), "no `{arg}`");
    }
    // No `# syntax=` directive: it would make BuildKit pull a frontend image from a registry.
    assert!(!df.lines().any(|l| l.trim_start().starts_with("# syntax=")));
    assert!(instr.iter().any(|l| l.trim() == "USER 10001:10001"));
    assert!(!instr
        .iter()
        .any(|l| l.trim() == "USER root" || l.trim() == "USER 0"));
    assert!(instr.iter().any(|l| l.trim() == "EXPOSE 8080"));
    assert!(instr
        .iter()
        .any(|l| l.contains(r#"ENTRYPOINT ["/usr/local/bin/kvgate"]"#)));
    assert!(instr
        .iter()
        .any(|l| l.contains(r#"CMD ["serve", "--config", "/etc/kvgate/kvgate.toml"]"#)));
    assert!(df.contains("COPY deploy/docker/kvgate.toml /etc/kvgate/kvgate.toml"));
    // https:// workers are verified against the system bundle unless upstream.ca_file is set.
    assert!(df.contains("install -y --no-install-recommends ca-certificates"));
}

/// The exec-form command of the Dockerfile's HEALTHCHECK (continuation lines joined).
fn healthcheck_cmd() -> Vec<String> {
    let df = std::fs::read_to_string(repo_root().join("deploy/Dockerfile")).unwrap();
    let joined = df.replace("\\\n", " ");
    let line = joined
        .lines()
        .find(|l| l.starts_with("HEALTHCHECK"))
        .expect("HEALTHCHECK");
    let json = &line[line.find("CMD").expect("CMD") + 3..];
    serde_json::from_str(json.trim()).expect("HEALTHCHECK CMD is a JSON array")
}

#[test]
fn image_config_and_healthcheck_work_against_a_running_gateway() {
    let (_sim, worker) = start_sim("kvgate-sim");
    // As the image runs it: its config file, workers and listen address from the environment.
    let image_cfg = repo_root().join("deploy/docker/kvgate.toml");
    let mut gw = Proc::kvgate_env(
        "kvgate serve (image config)",
        &["serve", "--config", image_cfg.to_str().unwrap()],
        &[
            ("KVGATE_WORKERS", &format!("http://{worker}")),
            ("KVGATE_MODELS", "kvgate-sim"),
            ("KVGATE_LISTEN", "127.0.0.1:0"),
        ],
    );
    let addr = gw.wait_for(std::time::Duration::from_secs(20), serving_addr);
    assert_eq!(http(addr, "GET", "/health", None).0, 200);

    let cmd = healthcheck_cmd();
    let run = |listen: String| {
        Command::new(&cmd[0])
            .args(&cmd[1..])
            .env("KVGATE_LISTEN", listen)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("run healthcheck")
            .success()
    };
    assert!(
        run(format!("0.0.0.0:{}", addr.port())),
        "healthcheck failed against a healthy gateway"
    );
    drop(gw);
    assert!(
        !run(format!("0.0.0.0:{}", addr.port())),
        "healthcheck passed with the gateway stopped"
    );
}

#[test]
fn every_alert_has_a_runbook_section_in_operations_md() {
    let root = repo_root();
    let rules = std::fs::read_to_string(root.join("deploy/prometheus/alerts.yml")).unwrap();
    let ops = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    // GitHub's anchor for a heading: lower-cased, spaces to dashes, other punctuation dropped.
    let anchors: Vec<String> = ops
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| {
            h.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let mut alerts = 0;
    for line in rules.lines() {
        if let Some(name) = line.trim().strip_prefix("- alert: ") {
            alerts += 1;
            let want = format!("runbook: docs/operations.md#{}", name.to_lowercase());
            assert!(rules.contains(&want), "{name}: no `{want}` annotation");
            assert!(
                anchors.contains(&name.to_lowercase()),
                "{name}: no section in docs/operations.md"
            );
        }
    }
    assert!(alerts >= 10, "{alerts} alerts");
}

/// The sources the builder stage copies (`COPY SRC... DEST` before the second `FROM`, relative to
/// its `WORKDIR /src`) as (source, destination) pairs.
fn builder_copies(df: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut froms = 0;
    for line in df.replace("\\\n", " ").lines() {
        let l = line.trim();
        if l.starts_with("FROM ") {
            froms += 1;
        }
        if froms != 1 {
            continue;
        }
        if let Some(rest) = l.strip_prefix("COPY ") {
            assert!(
                !rest.starts_with("--"),
                "unexpected COPY flags in the builder: {l}"
            );
            let parts: Vec<&str> = rest.split_whitespace().collect();
            let (dest, srcs) = parts.split_last().expect("COPY SRC DEST");
            let dest = dest.trim_start_matches("./");
            for src in srcs {
                let target = if srcs.len() > 1 || dest.is_empty() || dest.ends_with('/') {
                    let name = std::path::Path::new(src).file_name().unwrap();
                    format!(
                        "{dest}{}{}",
                        if dest.is_empty() || dest.ends_with('/') {
                            ""
                        } else {
                            "/"
                        },
                        name.to_string_lossy()
                    )
                } else {
                    dest.to_string()
                };
                out.push((src.to_string(), target));
            }
        }
    }
    out
}

/// The issue-37 regression without a docker engine: a directory holding exactly what the builder
/// stage copies must be a workspace cargo loads (the workspace's `tests` member once made the
/// image build stop at `failed to load manifest for workspace member`).
#[test]
fn what_the_builder_stage_copies_is_a_loadable_workspace() {
    let root = repo_root();
    let df = std::fs::read_to_string(root.join("deploy/Dockerfile")).unwrap();
    let copies = builder_copies(&df);
    assert!(
        copies.iter().any(|(s, _)| s == "Cargo.lock"),
        "the builder does not copy Cargo.lock: {copies:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    for (src, dest) in &copies {
        let to = dir.path().join(dest);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        let ok = Command::new("cp")
            .arg("-r")
            .arg(root.join(src))
            .arg(&to)
            .status()
            .expect("cp")
            .success();
        assert!(ok, "copy {src} -> {dest}");
    }
    // --no-deps: cargo loads every workspace member's manifest (what failed) without resolving
    // the registry graph, so nothing is downloaded (a full resolve would want the crates of every
    // platform). The image build in CI resolves it, against Cargo.lock (--locked).
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "metadata",
            "--no-deps",
            "--locked",
            "--offline",
            "--format-version",
            "1",
        ])
        .current_dir(dir.path())
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata in a copy of what deploy/Dockerfile's builder copies ({copies:?}):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages: Vec<&str> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(packages.contains(&"kvgate"), "{packages:?}");
}
