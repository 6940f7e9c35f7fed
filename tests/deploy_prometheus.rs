//! A real Prometheus (Debian's `prometheus` package) runs the shipped deploy/prometheus/prometheus.yml
//! and alerts.yml against a running `kvgate serve` and its `kvgate sim` worker on loopback. The
//! config is adapted in three documented ways only (see `adapt_config`): DNS discovery is replaced
//! by static loopback targets (Prometheus' DNS SD asks the DNS server, not /etc/hosts), intervals
//! shrink to 1 s, and the Prometheus-3-only keys are dropped when the binary is 2.x. The query
//! `kvgate_requests_total` must return data, the worker job must be up with its `engine` label and
//! its `vllm:*` gauges, and every alert rule must evaluate without error against the real series.
//! Bounded to ~30 s of waiting; every process is killed on exit (also on failure: `Proc` kills on
//! drop).

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use kvgate_system_tests::harness::*;

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

// Prometheus cannot report an ephemeral port it bound, so pick a free one first.
use kvgate_testkit::free_port;

struct Prom {
    _proc: Proc,
    _dir: tempfile::TempDir,
    addr: SocketAddr,
}

/// The shipped prometheus.yml with each job's `dns_sd_configs` block replaced by a static target
/// (`targets` maps job name → address), every interval and timeout shortened, and (for a 2.x
/// binary) `scrape_protocols` / `fallback_scrape_protocol` removed. Everything else — job names,
/// relabelling, rule_files — is exactly what operators deploy.
fn adapt_config(shipped: &str, targets: &[(&str, SocketAddr)], prometheus_3: bool) -> String {
    let mut out = String::new();
    let mut job: Option<&str> = None;
    let mut skip_indent: Option<usize> = None;
    for line in shipped.lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim_start();
        if let Some(si) = skip_indent {
            if t.is_empty() || t.starts_with('#') || indent > si {
                continue;
            }
            skip_indent = None;
        }
        if let Some(name) = t.strip_prefix("- job_name:") {
            job = targets.iter().map(|(j, _)| *j).find(|j| *j == name.trim());
            assert!(job.is_some(), "unexpected job {name} in prometheus.yml");
        }
        if t.starts_with("dns_sd_configs:") {
            let addr = targets
                .iter()
                .find(|(j, _)| Some(*j) == job)
                .map(|(_, a)| *a)
                .expect("job before dns_sd_configs");
            out.push_str(&format!(
                "{}static_configs: [{{targets: ['{addr}']}}]\n",
                " ".repeat(indent)
            ));
            skip_indent = Some(indent);
            continue;
        }
        if !prometheus_3
            && (t.starts_with("scrape_protocols:") || t.starts_with("fallback_scrape_protocol:"))
        {
            continue;
        }
        let key = t.split(':').next().unwrap_or("");
        let line = match key {
            "scrape_interval" | "evaluation_interval" => format!("{}{key}: 1s", " ".repeat(indent)),
            "scrape_timeout" => format!("{}{key}: 900ms", " ".repeat(indent)),
            _ => line.to_string(),
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
}

fn is_prometheus_3(bin: &str) -> bool {
    let out = std::process::Command::new(bin)
        .arg("--version")
        .output()
        .expect("prometheus --version");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let major = text
        .split("version ")
        .nth(1)
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.parse::<u32>().ok());
    major.unwrap_or(0) >= 3
}

fn start_prometheus(bin: &str, gateway: SocketAddr, worker: SocketAddr) -> Prom {
    let dir = tempfile::tempdir().unwrap();
    let shipped = repo_root().join("deploy/prometheus");
    for rules in ["alerts.yml", "recording.yml"] {
        std::fs::copy(shipped.join(rules), dir.path().join(rules)).unwrap();
    }
    let cfg = adapt_config(
        &std::fs::read_to_string(shipped.join("prometheus.yml")).unwrap(),
        &[("kvgate", gateway), ("llm-workers", worker)],
        is_prometheus_3(bin),
    );
    assert!(
        !cfg.lines()
            .any(|l| l.trim_start().starts_with("dns_sd_configs:"))
            && cfg.matches("static_configs: [").count() == 2,
        "{cfg}"
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

fn wait_until<T>(limit: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    kvgate_testkit::poll_for_blocking(limit, what, f)
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

    // The worker job of the shipped config: up, labelled by engine, and its own gauges (used by
    // the dashboard's per-worker panels) under their `vllm:` names.
    let up = wait_until(Duration::from_secs(10), "up of the worker job", || {
        query(prom.addr, "up{job=\"llm-workers\"} == 1")
            .filter(|r| r.as_array().is_some_and(|a| !a.is_empty()))
    });
    assert_eq!(up[0]["metric"]["engine"], "vllm", "{up}");
    wait_until(Duration::from_secs(10), "vllm:kv_cache_usage_perc", || {
        query(prom.addr, "vllm:kv_cache_usage_perc")
            .filter(|r| r.as_array().is_some_and(|a| !a.is_empty()))
    });

    // The measurement contract's names come out of recording.yml from the live series.
    let contract = wait_until(Duration::from_secs(15), "llm_requests_total", || {
        query(prom.addr, "sum(llm_requests_total{status=\"200\"})")
            .filter(|r| r.as_array().is_some_and(|a| !a.is_empty()))
    });
    assert_eq!(contract[0]["value"][1], "3", "{contract}");
    wait_until(Duration::from_secs(15), "llm_latency_bucket", || {
        query(prom.addr, "llm_latency_bucket{le=\"+Inf\"}")
            .filter(|r| r.as_array().is_some_and(|a| !a.is_empty()))
    });

    // Every rule of alerts.yml and recording.yml has been evaluated against these series without
    // an error.
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

#[test]
fn adapt_config_replaces_only_discovery_and_timing() {
    let shipped = "global:\n  scrape_interval: 15s\n  scrape_timeout: 10s\nscrape_configs:\n  - job_name: kvgate\n    fallback_scrape_protocol: PrometheusText0.0.4\n    dns_sd_configs:\n      - names: [a.b]\n        type: A\n        port: 8080\n    # static_configs:\n    #   - targets: [x]\n  - job_name: llm-workers\n    scrape_interval: 5s\n    dns_sd_configs:\n      - names: [c.d]\n    relabel_configs:\n      - target_label: engine\n        replacement: vllm\n";
    let gw: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let w: SocketAddr = "127.0.0.1:2".parse().unwrap();
    let out = adapt_config(shipped, &[("kvgate", gw), ("llm-workers", w)], false);
    assert_eq!(
        out,
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n  - job_name: kvgate\n    static_configs: [{targets: ['127.0.0.1:1']}]\n  - job_name: llm-workers\n    scrape_interval: 1s\n    static_configs: [{targets: ['127.0.0.1:2']}]\n    relabel_configs:\n      - target_label: engine\n        replacement: vllm\n"
    );
    assert!(
        adapt_config(shipped, &[("kvgate", gw), ("llm-workers", w)], true)
            .contains("fallback_scrape_protocol")
    );
}

/// The PromQL of the dashboard's panels and of docs/metrics.md's "Seed KPI → metric or PromQL"
/// table, with Grafana's variables filled in (`$model` = every model, `$__rate_interval` = 10 s at
/// the test's 1 s scrape interval).
fn dashboard_and_kpi_queries() -> Vec<String> {
    let d: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("deploy/grafana/kvgate-dashboard.json")).unwrap(),
    )
    .expect("dashboard JSON");
    let mut out: Vec<String> = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    let docs = std::fs::read_to_string(repo_root().join("docs/metrics.md")).unwrap();
    let table = docs
        .split("## Seed KPI → metric or PromQL")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("the seed KPI table in docs/metrics.md");
    let mut rows = 0;
    for row in table
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| KPI"))
    {
        rows += 1;
        // Rows sent to an exporter or to the engine's own names are not the gateway's to answer.
        if row.contains("*exporter*") || row.contains("*engine*") {
            continue;
        }
        for (i, span) in row.split('`').enumerate() {
            if i % 2 == 1
                && span.contains('(')
                && (span.contains("kvgate_") || span.contains("process_"))
                && !span.contains("...")
            {
                out.push(span.to_string());
            }
        }
    }
    assert!(rows >= 40, "KPI table rows: {rows}");
    out.iter()
        .map(|q| q.replace("$__rate_interval", "10s").replace("$model", ".+"))
        .collect()
}

/// Every dashboard panel and every KPI-table query returns data from a real Prometheus scraping a
/// gateway (cost configured) in front of a sim serving DCGM, under traffic.
#[test]
fn every_dashboard_query_and_kpi_row_returns_data() {
    let Some(bin) = prometheus_bin() else {
        tool_missing("prometheus binary not found (Debian package prometheus)");
        return;
    };
    // `--spec-tokens`: the sim reports speculative decoding, for the acceptance-rate row.
    let (_sim, worker) = start_sim_with("kvgate-sim", &["--dcgm", "--spec-tokens", "3"]);
    // A prefill/decode pool beside it, for the PD row: one prefill sim that answers some legs
    // without KV params (a handoff failure of its own kind), one decode sim.
    let (_p, prefill) = start_sim_with(
        "kvgate-pd",
        &["--role", "prefill", "--pd-no-params-rate", "0.3"],
    );
    let (_d, decode) = start_sim_with("kvgate-pd", &["--role", "decode"]);
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("kvgate.toml");
    std::fs::write(
        &cfg_path,
        format!(
            // One request at a time finds the decode worker idle, which would run it whole
            // (`pd.local_on_idle_decode`): off, so the long prompts are disaggregated as on a
            // busy fleet and the PD panels get handoffs.
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n\
             [pd]\nlocal_on_idle_decode = false\n\
             [[workers]]\nurl = \"http://{worker}\"\nname = \"w1\"\nmodels = [\"kvgate-sim\"]\n\
             cost_per_hour = 3.0\ngpus = 2\ndcgm_url = \"http://{worker}/dcgm/metrics\"\n\
             max_num_batched_tokens = 8192\n\
             [[workers]]\nurl = \"http://{prefill}\"\nname = \"p1\"\nmodels = [\"kvgate-pd\"]\nrole = \"prefill\"\n\
             [[workers]]\nurl = \"http://{decode}\"\nname = \"d1\"\nmodels = [\"kvgate-pd\"]\nrole = \"decode\"\n"
        ),
    )
    .unwrap();
    let mut gw_proc = Proc::kvgate(
        "kvgate serve",
        &["serve", "--config", cfg_path.to_str().unwrap()],
    );
    let gw = gw_proc.wait_for(Duration::from_secs(20), serving_addr);
    let prom = start_prometheus(&bin, gw, worker);
    let queries = dashboard_and_kpi_queries();
    let stream = r#"{"model":"kvgate-sim","messages":[{"role":"user","content":"count the stars"}],"max_tokens":6,"stream":true}"#;
    let plain = r#"{"model":"kvgate-sim","prompt":"count the stars","max_tokens":4}"#;
    // Cluster panels on one replica without a cluster: gauges and histograms are there (0 and
    // empty), but the per-kind message families have no series at all; tests/cluster.rs checks
    // them with live replicas.
    let needs_peers = |q: &str| q.contains("kvgate_cluster_messages_");
    let mut pending: Vec<&String> = queries.iter().filter(|q| !needs_peers(q)).collect();
    let skipped = queries.len() - pending.len();
    assert!(skipped <= 3, "{skipped} queries skipped");
    let end = Instant::now() + Duration::from_secs(90);
    let mut round = 0;
    while !pending.is_empty() {
        // A prompt over pd.min_uncached_tokens (512), new every round: disaggregated, streamed.
        round += 1;
        let words: Vec<String> = (0..600).map(|i| format!("r{round}w{i}")).collect();
        let pd = serde_json::json!({"model": "kvgate-pd", "max_tokens": 3, "stream": true,
            "messages": [{"role": "user", "content": words.join(" ")}]})
        .to_string();
        let (s, b) = http(gw, "POST", "/v1/chat/completions", Some(&pd));
        assert_eq!(s, 200, "{b}");
        // Traffic between scrapes, so rates and histograms have samples to work on.
        for body in [stream, plain] {
            let path = if body.contains("messages") {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            let (s, b) = http(gw, "POST", path, Some(body));
            assert_eq!(s, 200, "{b}");
        }
        pending.retain(|q| {
            query(prom.addr, q)
                .and_then(|r| r.as_array().map(|a| a.is_empty()))
                .unwrap_or(true)
        });
        assert!(
            Instant::now() < end,
            "queries without data after 90 s: {pending:#?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "measured: {} dashboard and KPI queries returned data ({skipped} need peers)",
        queries.len() - skipped
    );
}
