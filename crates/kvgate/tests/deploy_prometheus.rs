//! A real Prometheus (Debian's `prometheus` package) scrapes a running `kvgate serve` and its
//! `kvgate sim` worker on loopback at a 1 s interval with deploy/prometheus/alerts.yml loaded; the
//! query `kvgate_requests_total` must return data, the worker's `vllm:*` gauges must arrive, and
//! every alert rule must evaluate without error against the real series. Bounded to ~30 s of
//! waiting; every process is killed on exit (also on failure: `Proc` kills on drop).

#[path = "deploy_support/harness.rs"]
mod harness;

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::{Duration, Instant};

use harness::*;

const PROMETHEUS: &str = "/usr/bin/prometheus";

fn prometheus_bin() -> Option<String> {
    if Path::new(PROMETHEUS).exists() {
        return Some(PROMETHEUS.into());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("prometheus"))
        .find(|p| p.exists())
        .map(|p| p.display().to_string())
}

/// Prometheus cannot report an ephemeral port it bound, so pick a free one first.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Prom {
    _proc: Proc,
    _dir: tempfile::TempDir,
    addr: SocketAddr,
}

fn start_prometheus(bin: &str, gateway: SocketAddr, worker: SocketAddr) -> Prom {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        repo_root().join("deploy/prometheus/alerts.yml"),
        dir.path().join("alerts.yml"),
    )
    .unwrap();
    let cfg = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\nrule_files: [alerts.yml]\n\
         scrape_configs:\n  - job_name: kvgate\n    static_configs: [{{targets: ['{gateway}']}}]\n\
         \x20 - job_name: llm-workers\n    static_configs: [{{targets: ['{worker}'], labels: {{engine: vllm}}}}]\n"
    );
    std::fs::write(dir.path().join("prometheus.yml"), cfg).unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut cmd = std::process::Command::new(bin);
    cmd.current_dir(dir.path()).args([
        format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ),
        format!("--storage.tsdb.path={}", dir.path().join("data").display()),
        format!("--web.listen-address={addr}"),
        "--log.level=warn".to_string(),
    ]);
    let proc = Proc::spawn("prometheus", cmd);
    Prom {
        _proc: proc,
        _dir: dir,
        addr,
    }
}

fn query(prom: SocketAddr, q: &str) -> Option<serde_json::Value> {
    let enc: String = q
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'_' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let (status, body) = http_maybe(prom, "GET", &format!("/api/v1/query?query={enc}"))?;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    (v["status"] == "success").then(|| v["data"]["result"].clone())
}

fn wait_until<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < end,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn real_prometheus_scrapes_kvgate_and_evaluates_the_alert_rules() {
    let Some(bin) = prometheus_bin() else {
        tool_missing("prometheus binary not found (Debian package prometheus)");
        return;
    };
    let (_sim, worker) = start_sim("kvgate-sim");
    let (_gw, gw) = start_gateway(worker, "kvgate-sim");
    let body = r#"{"model":"kvgate-sim","messages":[{"role":"user","content":"count the stars"}],"max_tokens":4,"stream":true}"#;
    for _ in 0..3 {
        let (s, b) = http(gw, "POST", "/v1/chat/completions", Some(body));
        assert_eq!(s, 200, "{b}");
        assert!(b.contains("data: [DONE]"), "{b}");
    }

    let prom = start_prometheus(&bin, gw, worker);
    let series = wait_until(
        Duration::from_secs(30),
        "kvgate_requests_total in Prometheus",
        || {
            query(prom.addr, "kvgate_requests_total")
                .filter(|r| r.as_array().is_some_and(|a| !a.is_empty()))
        },
    );
    let ok = series
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["metric"]["status"] == "200")
        .unwrap_or_else(|| panic!("no status=200 series in {series}"));
    assert_eq!(ok["metric"]["model"], "kvgate-sim");
    assert_eq!(ok["metric"]["job"], "kvgate");
    assert_eq!(ok["value"][1], "3", "three requests were counted: {ok}");

    // The worker's own gauges (used by the dashboard's per-worker panels) arrive under their names.
    wait_until(Duration::from_secs(10), "vllm:kv_cache_usage_perc", || {
        query(prom.addr, "vllm:kv_cache_usage_perc")
            .filter(|r| r.as_array().is_some_and(|a| !a.is_empty()))
    });

    // Every rule of alerts.yml has been evaluated against these series without an error.
    let rules = wait_until(
        Duration::from_secs(15),
        "every alert rule evaluated",
        || {
            let (s, b) = http_maybe(prom.addr, "GET", "/api/v1/rules")?;
            let v: serde_json::Value = serde_json::from_str(&b).ok()?;
            let rules: Vec<serde_json::Value> = v["data"]["groups"]
                .as_array()?
                .iter()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect();
            (s == 200 && !rules.is_empty() && rules.iter().all(|r| r["health"] != "unknown"))
                .then_some(rules)
        },
    );
    let bad: Vec<String> = rules
        .iter()
        .filter(|r| r["health"] != "ok")
        .map(|r| format!("{}: {} {}", r["name"], r["health"], r["lastError"]))
        .collect();
    assert!(bad.is_empty(), "rules failing to evaluate: {bad:?}");
    assert!(rules.len() >= 10, "{} rules loaded", rules.len());
}
