//! Worker-reported signals re-exported on the gateway's `/metrics`: a vLLM-like worker's running,
//! waiting and KV usage appear as `kvgate_worker_*` gauges (with its block-size mismatch), and a
//! worker whose `/metrics` stalls shows `kvgate_worker_load_stale 1` without blocking the scrape.
//! Uses the monitors' production timing (scrape 1 s, stale after 5 s): the test takes ~6 s.

#[path = "helpers/support.rs"]
mod support;

use std::net::SocketAddr;

use kvgate_gateway::config::{Config, WorkerConfig};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

/// vLLM 0.x text: two DP engines (sums: running 5, waiting 1), block size 32 (the pool uses 16).
const VLLM_METRICS: &str = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0
";

const LLAMACPP_SLOTS: &str =
    include_str!("../../kvgate-protocol/tests/fixtures/llamacpp_slots_real.json");
const LLAMACPP_METRICS: &str =
    include_str!("../../kvgate-protocol/tests/fixtures/metrics_llamacpp_real.prom");

/// A one-request-per-connection HTTP/1.1 worker on 127.0.0.1:0: `/health` and `/v1/models` answer,
/// `/metrics` serves `metrics` or, when `None`, never answers. Stops when `stop` fires.
async fn worker(metrics: Option<&'static str>, stop: CancellationToken) -> SocketAddr {
    let stalled = stop.clone();
    raw_worker(stop, move |head, mut s| {
        let stalled = stalled.clone();
        async move {
            let path = head.split(' ').nth(1).unwrap_or("").to_string();
            let (status, body) = match path.as_str() {
                "/metrics" => match metrics {
                    Some(m) => (200, m.to_string()),
                    None => {
                        stalled.cancelled().await;
                        return;
                    }
                },
                "/health" => (200, String::new()),
                // Recorded from a real llama-server (2 slots × n_ctx 2048).
                "/slots" => (200, LLAMACPP_SLOTS.to_string()),
                "/v1/models" => (
                    200,
                    r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#.into(),
                ),
                _ => (404, "not found".into()),
            };
            let resp = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        }
    })
    .await
}

/// The value of the sample line starting with `series` (`name{labels}`), if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_load_is_exported_and_a_stalled_worker_shows_stale() {
    let stop = CancellationToken::new();
    let fresh = worker(Some(VLLM_METRICS), stop.clone()).await;
    let stalled = worker(None, stop.clone()).await;

    let mut cfg = Config::default();
    cfg.server.listen = "127.0.0.1:0".parse().unwrap();
    cfg.server.request_log = false;
    for (name, addr) in [("fresh", fresh), ("stalled", stalled)] {
        let mut w = WorkerConfig::from_url(&format!("http://{addr}"));
        w.name = Some(name.into());
        w.models = vec!["m".into()];
        w.kind = "vllm".into();
        cfg.workers.push(w);
    }
    let gw = gateway(cfg).await;
    let c = client();
    let url = format!("{}/metrics", gw.url());

    // Not stale before the 5 s bound: staleness below comes from the stall, not from startup.
    let first = get(&c, &url).await.text();
    assert_ne!(
        sample(&first, r#"kvgate_worker_load_stale{worker="stalled"}"#),
        Some(1.0),
        "{first}"
    );

    let mut text = String::new();
    let got = eventually(PATIENCE, || {
        // `eventually` polls a sync closure; block_in_place lets it await the scrape.
        let (c, url) = (c.clone(), url.clone());
        text = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async move { get(&c, &url).await.text() })
        });
        sample(&text, r#"kvgate_worker_load_stale{worker="stalled"}"#) == Some(1.0)
            && sample(
                &text,
                r#"kvgate_worker_running_requests{model="m",worker="fresh"}"#,
            )
            .is_some()
    })
    .await;
    assert!(
        got,
        "stalled worker never went stale / fresh never scraped:\n{text}"
    );

    // Every family is typed (and documented in docs/metrics.md under these names).
    for family in [
        "kvgate_worker_running_requests gauge",
        "kvgate_worker_waiting_requests gauge",
        "kvgate_worker_kv_usage_ratio gauge",
        "kvgate_worker_load_stale gauge",
        "kvgate_worker_block_size_mismatch gauge",
        "kvgate_worker_kv_events_total counter",
        "kvgate_worker_kv_event_gaps_total counter",
        "kvgate_worker_kv_index_resets_total counter",
        "kvgate_worker_scrapes_total counter",
    ] {
        assert!(
            text.contains(&format!("# TYPE {family}")),
            "{family}\n{text}"
        );
    }

    let fresh_mw = r#"{model="m",worker="fresh"}"#;
    let v = |name: &str, series: &str| sample(&text, &format!("{name}{series}"));
    assert_eq!(v("kvgate_worker_running_requests", fresh_mw), Some(5.0));
    assert_eq!(v("kvgate_worker_waiting_requests", fresh_mw), Some(1.0));
    assert_eq!(v("kvgate_worker_kv_usage_ratio", fresh_mw), Some(0.25));
    assert_eq!(
        v("kvgate_worker_load_stale", r#"{worker="fresh"}"#),
        Some(0.0)
    );
    assert_eq!(
        v("kvgate_worker_block_size_mismatch", r#"{worker="fresh"}"#),
        Some(1.0),
        "engine block size 32 vs pool 16"
    );
    assert_eq!(
        v("kvgate_worker_block_size_mismatch", r#"{worker="stalled"}"#),
        Some(0.0)
    );
    // A stalled worker reports no load figures at all (fail open), only its staleness.
    assert_eq!(
        v(
            "kvgate_worker_running_requests",
            r#"{model="m",worker="stalled"}"#
        ),
        None
    );
    assert!(
        v(
            "kvgate_worker_scrapes_total",
            r#"{worker="fresh",result="ok"}"#
        )
        .unwrap()
            >= 1.0,
        "{text}"
    );
    assert!(
        v(
            "kvgate_worker_scrapes_total",
            r#"{worker="stalled",result="failed"}"#
        )
        .unwrap()
            >= 1.0,
        "{text}"
    );
    assert!(
        v(
            "kvgate_worker_health_checks_total",
            r#"{worker="stalled",result="ok"}"#
        )
        .unwrap()
            >= 1.0,
        "a stalled /metrics is not a dead worker: {text}"
    );
    assert_eq!(
        v("kvgate_worker_kv_event_gaps_total", r#"{worker="fresh"}"#),
        Some(0.0)
    );
    // Counters are read, not re-added: a second scrape does not double them.
    let again = get(&c, &url).await.text();
    let resets = |t: &str| sample(t, r#"kvgate_worker_kv_index_resets_total{worker="fresh"}"#);
    assert_eq!(resets(&again), Some(0.0), "{again}");
    let ok_before = v(
        "kvgate_worker_scrapes_total",
        r#"{worker="fresh",result="ok"}"#,
    )
    .unwrap();
    let ok_after = sample(
        &again,
        r#"kvgate_worker_scrapes_total{worker="fresh",result="ok"}"#,
    )
    .unwrap();
    assert!(
        ok_after >= ok_before && ok_after < ok_before + 3.0,
        "{ok_before} -> {ok_after}"
    );

    gw.shutdown().await;
    stop.cancel();
    support::promtool_check(&again);
}

/// The monitor checks a worker against its own pool's block size (`[models.x] block_size`), not
/// `routing.block_size`: the same engine block size (32) agrees in the overriding pool and is a
/// mismatch in the default one (16).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_size_mismatch_uses_the_pools_override() {
    let stop = CancellationToken::new();
    let over = worker(Some(VLLM_METRICS), stop.clone()).await;
    let plain = worker(Some(VLLM_METRICS), stop.clone()).await;
    let cfg = Config::from_toml(&format!(
        r#"
[server]
listen = "127.0.0.1:0"
request_log = false
[routing]
block_size = 16
[models.big]
block_size = 32
[[workers]]
url = "http://{over}"
name = "over"
models = ["big"]
kind = "vllm"
[[workers]]
url = "http://{plain}"
name = "plain"
models = ["m"]
kind = "vllm"
"#
    ))
    .unwrap();
    let gw = gateway(cfg).await;
    let c = client();
    let url = format!("{}/metrics", gw.url());
    let mut text = String::new();
    let got = eventually(PATIENCE, || {
        let (c, url) = (c.clone(), url.clone());
        text = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async move { get(&c, &url).await.text() })
        });
        sample(
            &text,
            r#"kvgate_worker_block_size_mismatch{worker="plain"}"#,
        ) == Some(1.0)
            && sample(
                &text,
                r#"kvgate_worker_running_requests{model="big",worker="over"}"#,
            )
            .is_some()
    })
    .await;
    assert!(got, "plain never flagged / over never scraped:\n{text}");
    assert_eq!(
        sample(&text, r#"kvgate_worker_block_size_mismatch{worker="over"}"#),
        Some(0.0),
        "32 agrees with the big pool's override:\n{text}"
    );
    gw.shutdown().await;
    stop.cancel();
}

/// llama.cpp keeps one cached prompt per slot: the approximate index of a `llamacpp` worker is
/// bounded by Σ slot `n_ctx` from `/slots` (recorded fixture: 2 × 2048 tokens) in the pool's blocks
/// (16 here, 32 in the overriding pool), not by the configured default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llamacpp_capacity_from_slots_bounds_the_approximate_index() {
    let stop = CancellationToken::new();
    let a = worker(Some(LLAMACPP_METRICS), stop.clone()).await;
    let b = worker(Some(LLAMACPP_METRICS), stop.clone()).await;
    let cfg = Config::from_toml(&format!(
        r#"
[server]
listen = "127.0.0.1:0"
request_log = false
[admin]
listen = "127.0.0.1:0"
key = "adm"
[routing]
block_size = 16
[models.big]
block_size = 32
[[workers]]
url = "http://{a}"
name = "a"
models = ["m"]
kind = "llamacpp"
[[workers]]
url = "http://{b}"
name = "b"
models = ["big"]
kind = "llamacpp"
"#
    ))
    .unwrap();
    let default_cap = cfg.routing.approx_capacity_blocks;
    let gw = gateway(cfg).await;
    let c = client();
    let url = format!("http://{}/admin/state", gw.admin_addr.unwrap());
    let mut state = serde_json::Value::Null;
    let got = eventually(PATIENCE, || {
        let (c, url) = (c.clone(), url.clone());
        state = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async move {
                let req = http::Request::get(&url)
                    .header("authorization", "Bearer adm")
                    .body(http_body_util::Full::new(bytes::Bytes::new()))
                    .unwrap();
                send(&c, req).await.json()
            })
        });
        let cap = |i: usize| state["workers"][i]["index_capacity_blocks"].as_u64();
        cap(0) == Some(4096 / 16) && cap(1) == Some(4096 / 32)
    })
    .await;
    assert!(got, "capacity never taken from /slots:\n{state:#}");
    assert_ne!(default_cap, 4096 / 16, "the test must tell the two apart");
    assert_eq!(state["workers"][0]["index_mode"], "approximate");
    gw.shutdown().await;
    stop.cancel();
}
