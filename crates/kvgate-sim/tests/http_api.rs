//! The sim's HTTP surface, driven over real sockets on 127.0.0.1:0.

mod support;

use std::net::SocketAddr;

use kvgate_sim::{SimConfig, SimWorker};
use serde_json::{json, Value};
use support::*;

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn fast() -> SimConfig {
    SimConfig::default().speedup(0.0).num_gpu_blocks(512usize)
}

#[tokio::test]
async fn same_long_prompt_twice_reports_cached_tokens() {
    let w = SimWorker::spawn(fast(), local(), None).await.unwrap();
    let c = client();
    let url = format!("{}/v1/completions", w.base_url());
    let prompt = ids(1, 200); // 12 full blocks of 16 + 8
    let body =
        json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 3, "ignore_eos": true});
    let (st, a) = post(&c, &url, &body).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["usage"]["prompt_tokens"], 200);
    assert_eq!(a["usage"]["completion_tokens"], 3);
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    let (_, b) = post(&c, &url, &body).await;
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= (200 / 16 - 1) * 16, "cached {cached}");
    assert_eq!(cached, 192);
    assert_eq!(
        a["choices"][0]["text"], b["choices"][0]["text"],
        "deterministic output"
    );
    let m = w.metrics();
    assert_eq!(m.engine.prefix_cache_hits, 192);
    assert_eq!(m.success[1], 2);
    w.shutdown().await;
}

#[tokio::test]
async fn chat_stream_with_usage_has_openai_shape() {
    let w = SimWorker::spawn(fast(), local(), None).await.unwrap();
    let c = client();
    let body = json!({
        "model": "kvgate-sim", "messages": [{"role": "user", "content": words("q", 40)}],
        "stream": true, "stream_options": {"include_usage": true}, "max_completion_tokens": 5,
        "ignore_eos": true, "some_router_field": {"x": 1}
    });
    let (st, b) = post_raw(&c, &format!("{}/v1/chat/completions", w.base_url()), &body).await;
    assert_eq!(st, 200);
    let ev = sse_events(b).await;
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: Vec<&Value> = chunks
        .iter()
        .filter(|c| {
            c["choices"].as_array().is_some_and(|a| !a.is_empty())
                && c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
        })
        .collect();
    assert_eq!(content.len(), 5);
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(c["usage"].is_null(), "usage must be null on content chunks");
    }
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap() > 40);
    w.shutdown().await;
}

#[tokio::test]
async fn completions_accept_string_arrays_and_default_to_16_tokens() {
    let w = SimWorker::spawn(fast(), local(), None).await.unwrap();
    let c = client();
    let url = format!("{}/v1/completions", w.base_url());
    let (st, v) = post(
        &c,
        &url,
        &json!({"prompt": ["one two three", "four five"], "ignore_eos": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let ch = v["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 2);
    assert_eq!(
        (ch[0]["index"].clone(), ch[1]["index"].clone()),
        (json!(0), json!(1))
    );
    assert_eq!(v["usage"]["completion_tokens"], 32);
    let (st, v) = post(
        &c,
        &url,
        &json!({"prompt": "hello", "max_tokens": 4, "n": 2, "ignore_eos": true, "stream": false}),
    )
    .await;
    assert_eq!((st, v["choices"].as_array().unwrap().len()), (200, 2));
    let (st, v) = post(
        &c,
        &url,
        &json!({"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 1}),
    )
    .await;
    assert_eq!((st, v["choices"].as_array().unwrap().len()), (200, 2));
    w.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let cfg = fast().num_gpu_blocks(9usize); // 8 usable blocks = 128 tokens
    let w = SimWorker::spawn(cfg, local(), None).await.unwrap();
    let c = client();
    let url = format!("{}/v1/completions", w.base_url());
    let cases = [
        (
            json!({"prompt": ids(1, 120), "max_tokens": 20}),
            400,
            "maximum context length is 128",
        ),
        (
            json!({"prompt": ids(1, 300)}),
            400,
            "maximum context length",
        ),
        (json!({"prompt": 5}), 400, "'prompt'"),
        (json!({"prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
        (json!({"prompt": "x", "max_tokens": 0}), 400, "at least 1"),
        (
            json!({"prompt": "x", "model": "other"}),
            404,
            "does not exist",
        ),
        (json!([1, 2]), 400, "JSON object"),
        (json!({"prompt": ""}), 400, "empty"),
    ];
    for (body, status, needle) in cases {
        let (st, v) = post(&c, &url, &body).await;
        assert_eq!(st, status, "{body} → {v}");
        let e = &v["error"];
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{body} → {v}"
        );
        assert!(
            e["type"].is_string() && e.get("param").is_some() && e["code"] == status,
            "{v}"
        );
    }
    let (st, v) = post(
        &c,
        &format!("{}/v1/chat/completions", w.base_url()),
        &json!({"messages": "hi"}),
    )
    .await;
    // vLLM 0.32's request-validation shape (measured on the real engine, tests/real_vllm.rs).
    assert_eq!(
        (
            st,
            v["error"]["param"].as_str(),
            v["error"]["type"].as_str()
        ),
        (400, Some("body.messages"), Some("Bad Request"))
    );
    let (st, _, _) = get_text(&c, &format!("{}/nope", w.base_url())).await;
    assert_eq!(st, 404);
    // The worker still serves after all that.
    let (st, _) = post(
        &c,
        &url,
        &json!({"prompt": ids(2, 100), "max_tokens": 28, "ignore_eos": true}),
    )
    .await;
    assert_eq!(st, 200);
    w.shutdown().await;
}

#[tokio::test]
async fn models_tokenize_health_and_kv_event_sources() {
    let w = SimWorker::spawn(fast().model("m1"), local(), Some(local()))
        .await
        .unwrap();
    let c = client();
    let base = w.base_url();
    let (st, body, _) = get_text(&c, &format!("{base}/v1/models")).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (st, v["object"].as_str(), v["data"][0]["id"].as_str()),
        (200, Some("list"), Some("m1"))
    );
    let (st, v) = post(
        &c,
        &format!("{base}/tokenize"),
        &json!({"model": "m1", "prompt": "a b c"}),
    )
    .await;
    assert_eq!((st, v["count"].as_u64()), (200, Some(3)));
    assert_eq!(v["tokens"].as_array().unwrap().len(), 3);
    assert!(v["max_model_len"].as_u64().unwrap() > 0);
    let (_, v2) = post(
        &c,
        &format!("{base}/tokenize"),
        &json!({"messages": [{"role": "user", "content": "a b c"}]}),
    )
    .await;
    assert!(
        v2["count"].as_u64().unwrap() > 3,
        "chat template adds tokens"
    );
    let (st, body, _) = get_text(&c, &format!("{base}/health")).await;
    assert_eq!((st, body.as_str()), (200, ""));
    w.set_draining(true);
    assert_eq!(get_text(&c, &format!("{base}/health")).await.0, 503);
    w.set_draining(false);
    let (_, body, _) = get_text(&c, &format!("{base}/kv_event_sources")).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["0"]["endpoint"],
        format!("tcp://{}", w.kv_events_addr().unwrap())
    );
    assert_eq!(
        v["0"]["replay_endpoint"],
        format!("tcp://{}", w.replay_addr().unwrap())
    );
    assert_ne!(w.kv_events_addr().unwrap().port(), 0);
    w.shutdown().await;
}

#[tokio::test]
async fn metrics_use_vllm_names_and_pass_promtool() {
    let w = SimWorker::spawn(fast().model("m1"), local(), None)
        .await
        .unwrap();
    let c = client();
    let body = json!({"prompt": ids(3, 64), "max_tokens": 4, "ignore_eos": true});
    post(&c, &format!("{}/v1/completions", w.base_url()), &body).await;
    post(&c, &format!("{}/v1/completions", w.base_url()), &body).await;
    let (st, text, ct) = get_text(&c, &format!("{}/metrics", w.base_url())).await;
    assert_eq!(st, 200);
    assert_eq!(
        ct.as_deref(),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:cache_config_info",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "missing {name}");
    }
    assert!(
        text.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m1\"} 48.0"),
        "{text}"
    );
    assert!(text.contains("vllm:generation_tokens_total{engine=\"0\",model_name=\"m1\"} 8.0"));
    assert!(text.contains(
        "vllm:request_success_total{engine=\"0\",model_name=\"m1\",finished_reason=\"length\"} 2.0"
    ));
    assert!(
        text.contains("vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m1\"} 2.0")
    );
    assert!(text.contains("block_size=\"16\""));
    promtool_check(&text);
    w.shutdown().await;
}

/// promtool must parse the text (exit 0 or 3 = lint only; vLLM names fail the ':' lint by design).
fn promtool_check(text: &str) {
    use std::io::Write;
    let child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: promtool not available ({e})");
            return;
        }
        Err(e) => panic!("promtool is required in CI: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let code = out.status.code();
    let msg =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(code, Some(0) | Some(3)),
        "promtool parse error ({code:?}): {msg}"
    );
    for line in msg.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            line.contains("metric names should not contain ':'")
                || line.contains("vllm:") && line.contains("_total"),
            "unexpected promtool finding: {line}"
        );
    }
}

#[tokio::test]
async fn client_disconnect_aborts_and_frees_blocks() {
    // Slow enough that the request is still running when we drop it.
    let w = SimWorker::spawn(
        SimConfig::default().speedup(1.0).num_gpu_blocks(64usize),
        local(),
        None,
    )
    .await
    .unwrap();
    let c = client();
    let body =
        json!({"prompt": ids(4, 100), "max_tokens": 500, "ignore_eos": true, "stream": true});
    let (st, b) = post_raw(&c, &format!("{}/v1/completions", w.base_url()), &body).await;
    assert_eq!(st, 200);
    drop(b);
    drop(c);
    let freed = eventually(PATIENCE, || {
        let m = w.metrics();
        m.running == 0 && m.kv_usage == 0.0 && m.success[2] == 1
    })
    .await;
    assert!(freed, "request not aborted: {:?}", w.metrics().success);
    w.shutdown().await;
}

#[tokio::test]
async fn reset_prefix_cache_empties_the_cache() {
    let w = SimWorker::spawn(fast(), local(), None).await.unwrap();
    let c = client();
    post(
        &c,
        &format!("{}/v1/completions", w.base_url()),
        &json!({"prompt": ids(5, 64), "max_tokens": 1}),
    )
    .await;
    let (_, body, _) = get_text(&c, &format!("{}/sim/cache", w.base_url())).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["blocks"].as_array().unwrap().len(), 4);
    assert_eq!(v["blocks"][0]["token_ids"], json!(ids(5, 16)));
    assert_eq!(w.cache_snapshot().await.len(), 4);
    let (st, _) = post(
        &c,
        &format!("{}/reset_prefix_cache", w.base_url()),
        &json!({}),
    )
    .await;
    assert_eq!(st, 200);
    assert!(w.cache_snapshot().await.is_empty());
    w.shutdown().await;
}

#[tokio::test]
async fn faults_fail_rate_and_crash_after() {
    let mut cfg = fast();
    cfg.faults.fail_rate = 1.0;
    let w = SimWorker::spawn(cfg, local(), None).await.unwrap();
    let c = client();
    let (st, v) = post(
        &c,
        &format!("{}/v1/completions", w.base_url()),
        &json!({"prompt": "a"}),
    )
    .await;
    assert!(st == 500 || st == 503, "{st}");
    assert!(v["error"]["message"].as_str().unwrap().contains("injected"));
    w.shutdown().await;

    let mut cfg = fast();
    cfg.faults.crash_after = Some(3);
    let w = SimWorker::spawn(cfg, local(), None).await.unwrap();
    let (st, b) = post_raw(
        &c,
        &format!("{}/v1/completions", w.base_url()),
        &json!({"prompt": "a b", "max_tokens": 10, "stream": true, "ignore_eos": true}),
    )
    .await;
    assert_eq!(st, 200);
    use http_body_util::BodyExt;
    let r = b.collect().await;
    assert!(r.is_err(), "stream must be cut off, not completed");
    let req = http::Request::post(format!("{}/v1/completions", w.base_url()))
        .body(http_body_util::Full::new(bytes::Bytes::from(
            r#"{"prompt":"a b","max_tokens":10,"ignore_eos":true}"#,
        )))
        .unwrap();
    assert!(
        c.request(req).await.is_err(),
        "non-stream: connection dropped"
    );
    w.shutdown().await;
}

#[tokio::test]
async fn preemption_under_block_pressure_completes_every_request() {
    // 19 usable blocks (304 tokens); 8 requests that each grow to 100 tokens (7 blocks).
    let cfg = SimConfig::default().speedup(0.0).num_gpu_blocks(20usize);
    let w = SimWorker::spawn(cfg, local(), None).await.unwrap();
    let c = client();
    let url = format!("{}/v1/completions", w.base_url());
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let body = json!({"prompt": ids(100 + i, 40), "max_tokens": 60, "ignore_eos": true});
            post(&c, &url, &body).await
        }));
    }
    let done = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
    .await
    .expect("deadlock: requests did not finish");
    for (st, v) in done {
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 60);
    }
    let m = w.metrics();
    assert!(m.engine.preemptions > 0, "expected preemptions");
    assert_eq!((m.running, m.waiting, m.kv_usage), (0, 0, 0.0));
    let (_, text, _) = get_text(&c, &format!("{}/metrics", w.base_url())).await;
    assert!(
        !text.contains("vllm:num_preemptions_total{engine=\"0\",model_name=\"kvgate-sim\"} 0.0")
    );
    w.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn stall_and_metrics_delay_faults_delay_the_answer() {
    let mut cfg = fast();
    cfg.faults.stall = std::time::Duration::from_millis(700);
    cfg.faults.metrics_delay = std::time::Duration::from_millis(300);
    let w = SimWorker::spawn(cfg, local(), None).await.unwrap();
    let c = client();
    let t = tokio::time::Instant::now();
    let (st, _) = post(
        &c,
        &format!("{}/v1/completions", w.base_url()),
        &json!({"prompt": "a", "max_tokens": 1}),
    )
    .await;
    assert_eq!(st, 200);
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    let t = tokio::time::Instant::now();
    assert_eq!(
        get_text(&c, &format!("{}/metrics", w.base_url())).await.0,
        200
    );
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    w.shutdown().await;
}

/// vLLM's `priority`: refused under the default `fcfs` policy, accepted (any integer) under
/// `--scheduling-policy priority`; not an integer is a 400 either way.
#[tokio::test]
async fn priority_needs_the_priority_scheduling_policy() {
    let c = client();
    let body = |p: Value| json!({"model": "kvgate-sim", "prompt": ids(1, 20), "max_tokens": 2, "priority": p});
    let fcfs = SimWorker::spawn(fast(), local(), None).await.unwrap();
    let url = format!("{}/v1/completions", fcfs.base_url());
    let (st, e) = post(&c, &url, &body(json!(-3))).await;
    assert_eq!(st, 400, "{e}");
    assert!(
        e.to_string().contains("Priority scheduling is not enabled"),
        "{e}"
    );
    assert_eq!(post(&c, &url, &body(json!(0))).await.0, 200);
    fcfs.shutdown().await;
    let cfg = fast().scheduling_policy(kvgate_sim::config::SchedulingPolicy::Priority);
    let prio = SimWorker::spawn(cfg, local(), None).await.unwrap();
    let url = format!("{}/v1/completions", prio.base_url());
    assert_eq!(post(&c, &url, &body(json!(-3))).await.0, 200);
    let (st, e) = post(&c, &url, &body(json!("high"))).await;
    assert_eq!(st, 400, "{e}");
    prio.shutdown().await;
}

/// A request that arrives while a step runs waits for that step's end before the engine takes it
/// in (vLLM's engine core takes new requests between steps): `kvgate_sim_step_wait_seconds`
/// counts that wait, which vLLM's queue phase does not; a request reaching an idle engine waits
/// for nothing.
#[tokio::test]
async fn a_request_arriving_mid_step_waits_for_the_step_in_progress() {
    let timing = kvgate_sim::config::TimingModel {
        // Every prefill step takes 1 s.
        prefill: [0.0, 0.0, 1000.0],
        ..Default::default()
    };
    let cfg = SimConfig::default()
        .num_gpu_blocks(512usize)
        .speedup(1.0)
        .timing(timing);
    let w = SimWorker::spawn(cfg, local(), None).await.unwrap();
    let c = client();
    let url = format!("{}/v1/completions", w.base_url());
    let body = |seed| json!({"prompt": ids(seed, 40), "max_tokens": 1, "ignore_eos": true});
    let first = {
        let (c, url, b) = (c.clone(), url.clone(), body(1));
        tokio::spawn(async move { post(&c, &url, &b).await })
    };
    // The first request's prefill step has started once the engine counts it running.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while w.metrics().running == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never scheduled");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let t = tokio::time::Instant::now();
    assert_eq!(post(&c, &url, &body(2)).await.0, 200);
    assert_eq!(first.await.unwrap().0, 200);
    let m = w.metrics();
    assert_eq!(m.step_wait.count(), 2);
    // The second one waited for (nearly) the rest of the first one's 1 s step; how much of it
    // depends on how soon this task saw the step start, so only a loose lower bound is asserted.
    assert!(m.step_wait.sum() > 0.3, "{}", m.step_wait.sum());
    assert!(
        m.step_wait.sum() <= t.elapsed().as_secs_f64() + 0.05,
        "{} vs {:?}",
        m.step_wait.sum(),
        t.elapsed()
    );
    let (_, text, _) = get_text(&c, &format!("{}/metrics", w.base_url())).await;
    assert!(
        text.contains(
            "kvgate_sim_step_wait_seconds_count{engine=\"0\",model_name=\"kvgate-sim\"} 2.0"
        ),
        "{text}"
    );
    promtool_check(&text);
    w.shutdown().await;
}

/// POST with the sim's assumed-cache header.
async fn post_assuming(c: &HttpClient, url: &str, body: &Value, cached: &str) -> (u16, Value) {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .header(kvgate_sim::CACHED_TOKENS_HEADER, cached)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            serde_json::to_vec(body).unwrap(),
        )))
        .unwrap();
    let resp = c.request(req).await.expect("request failed");
    let st = resp.status().as_u16();
    let b = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    (st, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

#[tokio::test]
async fn assume_cached_header_is_honoured_only_with_the_flag() {
    let body = |seed| json!({"prompt": ids(seed, 200), "max_tokens": 2, "ignore_eos": true});
    // Flag off: the header (even a malformed one) is ignored.
    let off = SimWorker::spawn(fast(), local(), None).await.unwrap();
    let c = client();
    let url = format!("{}/v1/completions", off.base_url());
    let (st, v) = post_assuming(&c, &url, &body(1), "100").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (st, _) = post_assuming(&c, &url, &body(2), "lots").await;
    assert_eq!(st, 200);
    off.shutdown().await;

    let on = SimWorker::spawn(fast().assume_cached_header(true), local(), None)
        .await
        .unwrap();
    let url = format!("{}/v1/completions", on.base_url());
    // 100 tokens = 6 full blocks of 16 on a cold worker.
    let (st, v) = post_assuming(&c, &url, &body(3), "100").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    assert_eq!(on.metrics().engine.prefix_cache_hits, 96);
    let chat = json!({"messages": [{"role": "user", "content": words("a", 60)}], "max_tokens": 1});
    let chat_url = format!("{}/v1/chat/completions", on.base_url());
    let (st, v) = post_assuming(&c, &chat_url, &chat, "32").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    for bad in ["-1", "1.5", "lots", ""] {
        let (st, v) = post_assuming(&c, &url, &body(4), bad).await;
        assert_eq!(st, 400, "{bad:?}: {v}");
        assert_eq!(v["error"]["type"], "BadRequestError", "{v}");
        assert_eq!(v["error"]["param"], kvgate_sim::CACHED_TOKENS_HEADER);
    }
    on.shutdown().await;
}
