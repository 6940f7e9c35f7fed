//! The Grafana dashboard and the alert rules only query metrics that really exist: a live
//! `kvgate serve` (config file, round robin) in front of two live `kvgate sim` workers — one
//! healthy, one answering every completion with an error so retries happen — is driven with a few
//! requests and one config reload, both kinds of process are scraped, and every metric name in the
//! dashboard's and alerts.yml's PromQL must be exported by one of them (`kvgate_*` by the gateway,
//! `vllm:*` by the vLLM-compatible worker; `up` is Prometheus'). Labelled families appear in the
//! exposition only once they have a child, hence the traffic mix.

use std::collections::BTreeSet;
use std::time::Duration;

use kvgate_system_tests::harness::*;
use kvgate_testkit::{poll_until_blocking, PATIENCE};

const MODEL: &str = "kvgate-sim";

fn dashboard_exprs() -> (Vec<String>, Vec<String>) {
    let path = repo_root().join("deploy/grafana/kvgate-dashboard.json");
    let d: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("dashboard JSON");
    let mut exprs = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push(t["expr"].as_str().expect("target expr").to_string());
        }
    }
    // Template variables: `label_values(metric, label)` names one metric.
    let mut templated = Vec::new();
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(q) = v["query"]["query"].as_str().or(v["query"].as_str()) {
            if let Some(inner) = q
                .strip_prefix("label_values(")
                .and_then(|r| r.split(',').next())
            {
                templated.push(inner.trim().to_string());
            }
        }
    }
    (exprs, templated)
}

#[test]
fn dashboard_and_alert_metrics_are_exported_by_a_live_gateway_and_worker() {
    // The healthy worker also emulates a dcgm-exporter, so the GPU row has data.
    let (_sim, worker) = start_sim_with(MODEL, &["--dcgm"]);
    let (_bad, bad) = start_sim_with(MODEL, &["--fail-rate", "1.0"]);
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("kvgate.toml");
    let cfg = |temperature: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nreload_poll_ms = 100\nrequest_log = false\n\
             [routing]\npolicy = \"round_robin\"\ntemperature = {temperature}\n\
             [retry]\nmax_attempts = 3\n\
             [[workers]]\nurl = \"http://{worker}\"\nname = \"good\"\nmodels = [\"{MODEL}\"]\ncost_per_hour = 2.0\n\
             dcgm_url = \"http://{worker}/dcgm/metrics\"\nmax_num_batched_tokens = 8192\n\
             [[workers]]\nurl = \"http://{bad}\"\nname = \"failing\"\nmodels = [\"{MODEL}\"]\ncost_per_hour = 1.0\n"
        )
    };
    std::fs::write(&cfg_path, cfg("0.0")).unwrap();
    let mut gw_proc = Proc::kvgate(
        "kvgate serve",
        &["serve", "--config", cfg_path.to_str().unwrap()],
    );
    let gw = gw_proc.wait_for(Duration::from_secs(20), serving_addr);

    let chat = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"You are a helpful assistant. Tell me about KV caches."}}],"max_tokens":8,"stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let plain = format!(
        r#"{{"model":"{MODEL}","prompt":"The quick brown fox jumps over the lazy dog again and again","max_tokens":4}}"#
    );
    for _ in 0..3 {
        let (s, body) = http(gw, "POST", "/v1/chat/completions", Some(&chat));
        assert_eq!(s, 200, "{body}");
        assert!(body.contains("data: [DONE]"), "{body}");
        let (s, body) = http(gw, "POST", "/v1/completions", Some(&plain));
        assert_eq!(s, 200, "{body}");
    }
    let (s, _) = http(
        gw,
        "POST",
        "/v1/chat/completions",
        Some(r#"{"model":"no-such-model","messages":[]}"#),
    );
    assert!(s >= 400, "unknown model must fail, got {s}");

    // A config change is picked up by the file poll (counted in kvgate_config_reloads_total).
    std::thread::sleep(Duration::from_millis(20)); // a distinct mtime on coarse-grained filesystems
    std::fs::write(&cfg_path, cfg("0.5")).unwrap();
    // The families exist at 0 from the start: wait for a non-zero count.
    let reloads = |text: &str| counter_sum(text, "kvgate_config_reloads_total{");
    poll_until_blocking(PATIENCE, "the config reload", || {
        reloads(&http(gw, "GET", "/metrics", None).1) >= 1.0
    });

    // The first DCGM scrape lands within a second of the monitor's start.
    poll_until_blocking(PATIENCE, "GPU figures from the sim's dcgm-exporter", || {
        http(gw, "GET", "/metrics", None)
            .1
            .contains("kvgate_worker_gpu_utilization_ratio{")
    });
    let (s, gw_text) = http(gw, "GET", "/metrics", None);
    assert_eq!(s, 200);
    let (s, sim_text) = http(worker, "GET", "/metrics", None);
    assert_eq!(s, 200);
    let gw_names = exported_names(&gw_text);
    let sim_names = exported_names(&sim_text);
    // The traffic above is visible, so the scrape is of a gateway that served it.
    assert!(
        gw_text
            .lines()
            .any(|l| l.starts_with("kvgate_requests_total{") && l.contains("status=\"200\"")),
        "no successful requests counted:\n{gw_text}"
    );
    assert!(
        counter_sum(&gw_text, "kvgate_retries_total{") >= 1.0,
        "round robin over a failing worker retried nothing:\n{gw_text}"
    );

    let (dash, templated) = dashboard_exprs();
    assert!(dash.len() >= 30, "dashboard queries: {}", dash.len());
    let rules = std::fs::read_to_string(repo_root().join("deploy/prometheus/alerts.yml")).unwrap();
    let alert_exprs = rule_exprs(&rules);
    assert!(
        alert_exprs.len() >= 10,
        "alert expressions: {}",
        alert_exprs.len()
    );

    let mut used: BTreeSet<String> = templated.into_iter().collect();
    let mut missing = Vec::new();
    for (src, e) in dash
        .iter()
        .map(|e| ("dashboard", e))
        .chain(alert_exprs.iter().map(|e| ("alerts.yml", e)))
    {
        let names = promql_metric_names(e);
        assert!(!names.is_empty(), "{src}: no metric in {e}");
        used.extend(names);
    }
    for name in &used {
        let ok = match name.as_str() {
            "up" => true,
            n if n.starts_with("kvgate_") => {
                gw_names.contains(n) || (needs_pd_or_cluster(n) && registered_family(n))
            }
            n => sim_names.contains(n),
        };
        if !ok {
            missing.push(name.clone());
        }
    }
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}\n(kvgate exports: {gw_names:?})"
    );

    // The dashboard covers what operators asked for (issue 7): one metric per area at least.
    for must in [
        "kvgate_requests_total",
        "kvgate_prompt_tokens_total",
        "kvgate_completion_tokens_total",
        "kvgate_time_to_first_token_seconds_bucket",
        "kvgate_inter_token_latency_seconds_bucket",
        "kvgate_request_duration_seconds_bucket",
        "kvgate_queue_wait_seconds_bucket",
        "kvgate_router_decision_seconds_bucket",
        "kvgate_predicted_overlap_ratio_sum",
        "kvgate_realised_cached_ratio_sum",
        "kvgate_index_blocks",
        "kvgate_inflight_requests",
        "kvgate_worker_active_blocks",
        // Engine figures through kvgate's engine-neutral copies (issue 21), not `vllm:*`.
        "kvgate_worker_kv_usage_ratio",
        "kvgate_worker_waiting_requests",
        "kvgate_worker_prefix_cache_hits_total",
        "kvgate_worker_kv_blocks_removed_total",
        "kvgate_worker_preemptions_total",
        "kvgate_worker_gpu_utilization_ratio",
        "kvgate_worker_gpu_energy_joules_total",
        "kvgate_worker_gpu_seconds_total",
        "kvgate_worker_idle_cost_dollars_total",
        "kvgate_errors_total",
        "kvgate_retries_total",
        "kvgate_worker_breaker_state",
        "kvgate_goodput_requests_total",
        "kvgate_cost_dollars_total",
        // Prefill/decode (issue 20) and the replicas' cluster (issue 18).
        "kvgate_pd_decisions_total",
        "kvgate_pd_transfer_wait_seconds_bucket",
        "kvgate_cluster_sync_lag_seconds_bucket",
        "kvgate_cluster_messages_dropped_total",
    ] {
        assert!(
            dash.iter()
                .any(|e| promql_metric_names(e).iter().any(|n| n == must)),
            "dashboard lacks {must}"
        );
    }
    // Every panel works for every engine kind: none reads an engine's own names directly.
    let direct: Vec<&String> = dash
        .iter()
        .filter(|e| promql_metric_names(e).iter().any(|n| n.contains(':')))
        .collect();
    assert!(
        direct.is_empty(),
        "panels reading engine metrics directly: {direct:?}"
    );
}

#[test]
fn promql_names_skip_functions_labels_and_ranges() {
    let e = r#"histogram_quantile(0.99, sum by (le, model) (rate(kvgate_ttft_bucket{model=~"$model",le!="x"}[$__rate_interval]))) > 2 and on (model) sum(rate(a_total[5m])) / 1e6 + up"#;
    assert_eq!(
        promql_metric_names(e),
        vec!["kvgate_ttft_bucket", "a_total", "up"]
    );
    assert_eq!(
        promql_metric_names("max by (instance) (vllm:num_requests_waiting) > 32"),
        vec!["vllm:num_requests_waiting"]
    );
}

#[test]
fn rule_exprs_reads_block_and_inline_scalars() {
    let y = "groups:\n  - rules:\n      - alert: A\n        expr: |\n          sum(x)\n            / sum(y)\n        for: 5m\n      - alert: B\n        expr: up == 0\n";
    assert_eq!(
        rule_exprs(y),
        vec!["sum(x)\n/ sum(y)\n".to_string(), "up == 0".to_string()]
    );
}

#[test]
fn exported_names_expand_histograms_and_empty_families() {
    let t = "# HELP h x\n# TYPE h histogram\n# TYPE c_total counter\nc_total{a=\"1\"} 2\n# TYPE e_total counter\n# TYPE om counter\n";
    let n = exported_names(t);
    for want in [
        "h_bucket", "h_sum", "h_count", "c_total", "e_total", "om_total",
    ] {
        assert!(n.contains(want), "{want}");
    }
    assert!(registered_family("kvgate_pd_decisions_total"));
    assert!(registered_family("kvgate_cluster_sync_lag_seconds_bucket"));
    assert!(!registered_family("kvgate_pd_decisionz_total"));
    assert!(!n.contains("h_total"));
}

/// Labelled families of prefill/decode pools and of the cluster have no series (so no lines at
/// all) on this test's plain gateway.
fn needs_pd_or_cluster(name: &str) -> bool {
    name.starts_with("kvgate_pd_") || name.starts_with("kvgate_cluster_")
}

/// Whether the gateway's metrics sources register the family a sample `name` belongs to
/// (`_total`, `_bucket`, `_sum`, `_count` stripped).
fn registered_family(name: &str) -> bool {
    let family = ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    [
        "crates/kvgate-gateway/src/metrics.rs",
        "crates/kvgate-cluster/src/metrics.rs",
    ]
    .iter()
    .any(|f| {
        std::fs::read_to_string(repo_root().join(f))
            .unwrap()
            .contains(&format!("\"{family}\""))
    })
}

/// Sum of the samples whose line starts with `prefix` (a family's series).
fn counter_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
