//! End-to-end tests of the data path: real sockets on 127.0.0.1 port 0, the gateway in-process in
//! front of in-process mock workers.

#[path = "helpers/support.rs"]
mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvgate_gateway::mock::MockWorker;
use support::*;

#[tokio::test]
async fn chat_and_completions_stream_and_non_stream() {
    let w = MockWorker::builder()
        .tokens(5)
        .cached_tokens(3)
        .spawn()
        .await
        .unwrap();
    let gw = gateway(config_for(&[&w], "round_robin")).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());

    let r = post(&c, &url, chat_body("sys", "hi", false)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["usage"]["completion_tokens"], 5);

    let r = post(&c, &url, chat_body("sys", "hi", true)).await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let t = r.text();
    assert_eq!(t.matches("data: {").count(), 5, "{t}");
    assert!(t.ends_with("data: [DONE]\n\n"), "{t}");

    let body = r#"{"model":"mock-model","prompt":"once upon a time","stream":true,"stream_options":{"include_usage":true}}"#;
    let r = post(&c, &format!("{}/v1/completions", gw.url()), body).await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("\"usage\":{"), "{}", r.text());

    let r = post(
        &c,
        &format!("{}/v1/completions", gw.url()),
        r#"{"model":"mock-model","prompt":[1,2,3]}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["object"], "text_completion");

    let r = post(
        &c,
        &format!("{}/v1/embeddings", gw.url()),
        r#"{"model":"mock-model","input":"x"}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["object"], "list");

    // Metrics saw the usage the worker reported.
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    // Non-stream bodies of known length complete as 200, not as a client cancel (499).
    assert!(
        !m.contains("status=\"499\""),
        "no request was cancelled: {m}"
    );
    assert!(
        m.contains("kvgate_requests_total{model=\"mock-model\",worker=\""),
        "{m}"
    );
    assert!(
        m.contains("kvgate_completion_tokens_total{model=\"mock-model\""),
        "{m}"
    );
    assert!(
        m.contains("kvgate_cached_tokens_total{model=\"mock-model\""),
        "{m}"
    );
    // Two streams feed TTFT; the two non-streamed responses have their own series.
    for want in [
        "kvgate_time_to_first_token_seconds_count{model=\"mock-model\"} 2",
        "kvgate_non_stream_response_seconds_count{model=\"mock-model\"} 2",
        "kvgate_request_prompt_tokens_count{model=\"mock-model\"} 5",
        "kvgate_request_completion_tokens_count{model=\"mock-model\"} 4",
    ] {
        assert!(m.contains(want), "{want} missing in {m}");
    }
    let per_worker = |family: &str| {
        m.lines()
            .filter(|l| l.starts_with(family) && l.contains("worker=\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(
        per_worker("kvgate_worker_time_to_first_token_seconds_count{"),
        2.0,
        "{m}"
    );
    assert_eq!(
        per_worker("kvgate_worker_request_duration_seconds_count{"),
        5.0,
        "{m}"
    );
    gw.shutdown().await;
}

/// Completions ignore a stray `messages` field (the worker does too); chat checks it.
#[tokio::test]
async fn a_stray_messages_field_does_not_fail_a_completion() {
    let w = MockWorker::builder().spawn().await.unwrap();
    let gw = gateway(config_for(&[&w], "kv")).await;
    let c = client();
    let body = r#"{"model":"mock-model","prompt":"hello there","messages":5}"#;
    let r = post(&c, &format!("{}/v1/completions", gw.url()), body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(w.received().last().unwrap().body, body.as_bytes());
    let r = post(&c, &format!("{}/v1/chat/completions", gw.url()), body).await;
    let e = assert_openai_error(&r, 400);
    assert_eq!(e["param"], "messages");
    gw.shutdown().await;
}

/// The benchmark's mock keeps no requests (its list grew until the process ran out of memory);
/// it still answers and counts them.
#[tokio::test]
async fn a_mock_without_recording_answers_and_keeps_nothing() {
    let w = MockWorker::builder().record(false).spawn().await.unwrap();
    let c = client();
    for _ in 0..3 {
        let r = post(
            &c,
            &format!("{}/v1/chat/completions", w.url()),
            chat_body("sys", "hi", false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(w.completions(), 3);
    assert!(w.received().is_empty());
}

#[tokio::test]
async fn body_bytes_and_unknown_fields_reach_the_worker_unchanged() {
    let w = MockWorker::builder().spawn().await.unwrap();
    let gw = gateway(config_for(&[&w], "kv")).await;
    let c = client();
    // Odd spacing, key order, unknown and vendor fields, unicode escapes: all must survive.
    let body = "{ \"messages\":[{\"role\":\"user\",\"content\":\"h\\u00e9llo\"}], \"model\" : \"mock-model\",\n \"guided_json\":{\"type\":\"object\"},\"return_token_ids\":true,\"kv_transfer_params\":null,\"user\":\"u1\",\"max_tokens\":7}";
    let req = http::Request::post(format!("{}/v1/chat/completions", gw.url()))
        .header("content-type", "application/json")
        .header("x-request-id", "abc")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "must-not-pass")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let r = send(&c, req).await;
    assert_eq!(r.status, 200);
    let got = w.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body, body.as_bytes(), "body forwarded byte-exact");
    assert_eq!(got[0].headers["x-request-id"], "abc");
    assert!(
        got[0].headers.get("x-hop").is_none(),
        "headers named in Connection are hop-by-hop"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn error_statuses_and_shapes() {
    let w = MockWorker::builder().spawn().await.unwrap();
    let mut cfg = config_for(&[&w], "kv");
    cfg.server.max_body_bytes = 1024;
    let gw = gateway(cfg).await;
    let c = client();
    let chat = format!("{}/v1/chat/completions", gw.url());

    assert_openai_error(&post(&c, &chat, "{not json").await, 400);
    let e = assert_openai_error(&post(&c, &chat, r#"{"messages":[]}"#).await, 400);
    assert_eq!(e["param"], "model");
    let e = assert_openai_error(&post(&c, &chat, r#"{"model":"mock-model"}"#).await, 400);
    assert_eq!(e["param"], "messages");
    let e = assert_openai_error(
        &post(
            &c,
            &chat,
            chat_body("s", "u", false).replace("mock-model", "nope"),
        )
        .await,
        404,
    );
    assert_eq!(e["code"], "model_not_found");
    assert_openai_error(
        &post(
            &c,
            &chat,
            format!(r#"{{"model":"mock-model","x":"{}"}}"#, "a".repeat(2000)),
        )
        .await,
        413,
    );
    let r = get(&c, &chat).await;
    assert_openai_error(&r, 405);
    assert_eq!(r.headers["allow"], "POST");
    assert_openai_error(&get(&c, &format!("{}/v2/nothing", gw.url())).await, 404);
    assert_eq!(w.completions(), 0, "no bad request reached the worker");

    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    assert!(
        m.contains("kvgate_errors_total{kind=\"bad_request\"} 3"),
        "{m}"
    );
    assert!(
        m.contains("kvgate_errors_total{kind=\"payload_too_large\"} 1"),
        "{m}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn no_routable_worker_is_503_with_retry_after() {
    // A worker that is down (nothing listens): connect fails, no other worker → 502; after the
    // breaker opens (5 failures) the pool has no routable worker → 503 + Retry-After.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let mut cfg = config_for(&[], "round_robin");
    // Without health checks, so the request path's own breaker is what takes the worker out.
    cfg.upstream.monitor = false;
    let mut wc = kvgate_gateway::config::WorkerConfig::from_url(&dead);
    wc.models = vec!["mock-model".into()];
    cfg.workers.push(wc);
    let gw = gateway(cfg).await;
    let c = client();
    let chat = format!("{}/v1/chat/completions", gw.url());
    for _ in 0..5 {
        assert_openai_error(&post(&c, &chat, chat_body("s", "u", false)).await, 502);
    }
    let r = post(&c, &chat, chat_body("s", "u", false)).await;
    let e = assert_openai_error(&r, 503);
    assert_eq!(e["code"], "no_worker_available");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(get(&c, &format!("{}/ready", gw.url())).await.status, 503);
    gw.shutdown().await;
}

#[tokio::test]
async fn worker_503_is_retried_on_another_worker() {
    let bad = MockWorker::builder().status(503).spawn().await.unwrap();
    let good = MockWorker::builder().spawn().await.unwrap();
    let gw = gateway(config_for(&[&bad, &good], "round_robin")).await;
    let c = client();
    for i in 0..6 {
        let r = post(
            &c,
            &format!("{}/v1/chat/completions", gw.url()),
            chat_body("s", &format!("u{i}"), i % 2 == 0),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(good.completions(), 6);
    assert!(bad.completions() >= 1, "round robin tried the bad worker");
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    assert!(
        m.contains(&format!(
            "kvgate_retries_total{{reason=\"status_503\"}} {}",
            bad.completions()
        )),
        "{m}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_worker_running_out_of_memory_is_counted_as_upstream_oom() {
    let oom = MockWorker::builder()
        .status(500)
        .error_message("CUDA out of memory. Tried to allocate 2.00 GiB")
        .spawn()
        .await
        .unwrap();
    let other = MockWorker::builder().status(500).spawn().await.unwrap();
    let mut cfg = config_for(&[&oom], "round_robin");
    cfg.retry.max_attempts = 1;
    let gw = gateway(cfg).await;
    let c = client();
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", false),
    )
    .await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(r.text().contains("out of memory"), "{}", r.text());
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    assert!(
        m.contains("kvgate_errors_total{kind=\"upstream_oom\"} 1\n"),
        "{m}"
    );
    gw.shutdown().await;
    // A 500 that does not say so is not an OOM.
    let mut cfg = config_for(&[&other], "round_robin");
    cfg.retry.max_attempts = 1;
    let gw = gateway(cfg).await;
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", false),
    )
    .await;
    assert_eq!(r.status, 500);
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    assert!(
        m.contains("kvgate_errors_total{kind=\"upstream_oom\"} 0\n"),
        "{m}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn worker_dying_mid_stream_yields_an_sse_error_event() {
    let w = MockWorker::builder()
        .tokens(10)
        .die_after(3)
        .spawn()
        .await
        .unwrap();
    let gw = gateway(config_for(&[&w], "kv")).await;
    let c = client();
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", true),
    )
    .await;
    assert_eq!(r.status, 200);
    let t = r.text();
    assert_eq!(t.matches("\"chat.completion.chunk\"").count(), 3, "{t}");
    let last = t.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("data: {\"error\":"), "{t}");
    let ev: serde_json::Value = serde_json::from_str(last.trim_start_matches("data: ")).unwrap();
    assert!(ev["error"]["message"]
        .as_str()
        .unwrap()
        .contains("mid-stream"));
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    assert!(m.contains("kvgate_stream_errors_total 1"), "{m}");
    assert!(gw
        .app
        .fleet
        .router
        .active()
        .all()
        .iter()
        .all(|(_, l)| l.inflight == 0));
    gw.shutdown().await;
}

#[tokio::test]
async fn client_disconnect_frees_load_at_once_and_cancels_upstream() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // A stream that would run for 1000 s: load freed and the upstream cancelled within the poll
    // deadline (30 s) can only be the disconnect's doing, however busy the machine.
    let w = MockWorker::builder()
        .tokens(100_000)
        .itl(Duration::from_millis(10))
        .spawn()
        .await
        .unwrap();
    let gw = gateway(config_for(&[&w], "kv")).await;
    let body = chat_body(&"a long shared system prompt ".repeat(20), "u", true);
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}",
        body.len(),
        body
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: {") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let app = gw.app.clone();
    let busy = |app: &kvgate_gateway::AppState| {
        app.fleet
            .router
            .active()
            .all()
            .iter()
            .any(|(_, l)| l.inflight > 0 || l.active_blocks > 0)
            || app
                .fleet
                .registry
                .snapshot()
                .workers
                .iter()
                .any(|w| w.state.inflight.load(Ordering::Relaxed) > 0)
    };
    assert!(busy(&app), "the stream holds load while it runs");
    drop(s);
    assert!(
        eventually(PATIENCE, || !busy(&app)).await,
        "load freed once the client left"
    );
    assert!(
        eventually(PATIENCE, || w.active_streams() == 0).await,
        "upstream request cancelled"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn shared_prefix_sticks_to_one_worker_and_distinct_prefixes_spread() {
    let ws = [
        MockWorker::builder().spawn().await.unwrap(),
        MockWorker::builder().spawn().await.unwrap(),
        MockWorker::builder().spawn().await.unwrap(),
    ];
    let gw = gateway(config_for(&[&ws[0], &ws[1], &ws[2]], "kv")).await;
    let c = client();
    let chat = format!("{}/v1/chat/completions", gw.url());
    let shared = "You are the shared assistant of team alpha. ".repeat(30);
    for i in 0..8 {
        assert_eq!(
            post(
                &c,
                &chat,
                chat_body(&shared, &format!("question {i}"), false)
            )
            .await
            .status,
            200
        );
    }
    let counts: Vec<usize> = ws.iter().map(|w| w.completions()).collect();
    assert_eq!(
        counts.iter().filter(|&&n| n == 8).count(),
        1,
        "shared prefix on one worker: {counts:?}"
    );
    // Idle fleet + no overlap = exact cost ties, broken uniformly at random: with 30 requests the
    // chance that one of 3 workers gets none is 3·(2/3)^30 ≈ 1.5e-5 (with 9 it was ~8%).
    for i in 0..30 {
        let distinct = format!("Distinct system prompt number {i} with its own text. ").repeat(30);
        assert_eq!(
            post(&c, &chat, chat_body(&distinct, "q", false))
                .await
                .status,
            200
        );
    }
    let after: Vec<usize> = ws
        .iter()
        .zip(&counts)
        .map(|(w, c)| w.completions() - c)
        .collect();
    assert!(
        after.iter().all(|&n| n >= 1),
        "distinct prefixes spread over all workers: {after:?}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn busy_fleet_queues_then_sheds_with_429() {
    let w = MockWorker::builder()
        .tokens(2)
        .ttft(Duration::from_millis(300))
        .spawn()
        .await
        .unwrap();
    let mut cfg = config_for(&[&w], "round_robin");
    cfg.routing.max_inflight_per_worker = 1;
    cfg.admission.queue_size = 1;
    cfg.admission.queue_timeout_ms = 5000;
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let c = client();
    let (c1, c2, u1, u2) = (c.clone(), c.clone(), url.clone(), url.clone());
    let first = tokio::spawn(async move { post(&c1, &u1, chat_body("s", "1", false)).await });
    assert!(eventually(PATIENCE, || w.completions() == 1).await);
    let second = tokio::spawn(async move { post(&c2, &u2, chat_body("s", "2", false)).await });
    assert!(
        eventually(PATIENCE, || gw.app.admission.len() == 1).await,
        "second request queued"
    );
    let r = post(&c, &url, chat_body("s", "3", false)).await;
    let e = assert_openai_error(&r, 429);
    assert_eq!(e["code"], "gateway_overloaded");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(
        second.await.unwrap().status,
        200,
        "queued request served when capacity freed"
    );
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    assert!(m.contains("kvgate_queue_wait_seconds_count 2"), "{m}");
    gw.shutdown().await;
}

#[tokio::test]
async fn queued_requests_get_503_shutting_down_when_the_gateway_stops() {
    let w = MockWorker::builder()
        .tokens(2)
        .ttft(Duration::from_millis(1500))
        .spawn()
        .await
        .unwrap();
    let mut cfg = config_for(&[&w], "round_robin");
    cfg.routing.max_inflight_per_worker = 1;
    cfg.admission.queue_size = 4;
    cfg.admission.queue_timeout_ms = 60_000;
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let c = client();
    let (c1, c2, u1, u2) = (c.clone(), c.clone(), url.clone(), url.clone());
    let first = tokio::spawn(async move { post(&c1, &u1, chat_body("s", "1", false)).await });
    assert!(eventually(PATIENCE, || w.completions() == 1).await);
    let second = tokio::spawn(async move { post(&c2, &u2, chat_body("s", "2", false)).await });
    assert!(
        eventually(PATIENCE, || gw.app.admission.len() == 1).await,
        "second request queued"
    );
    let t0 = std::time::Instant::now();
    gw.shutdown_token().cancel();
    let queued = second.await.unwrap();
    let e = assert_openai_error(&queued, 503);
    assert_eq!(e["code"], "shutting_down");
    assert!(queued.headers.contains_key("retry-after"));
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "answered at shutdown, not at the queue timeout"
    );
    assert_eq!(
        first.await.unwrap().status,
        200,
        "in-flight request drained"
    );
    gw.wait().await;
}

#[tokio::test]
async fn models_health_ready() {
    let a = MockWorker::builder()
        .models(&["m-a", "shared"])
        .spawn()
        .await
        .unwrap();
    let b = MockWorker::builder()
        .models(&["m-b", "shared"])
        .spawn()
        .await
        .unwrap();
    let mut cfg = config_for(&[&a, &b], "kv");
    cfg.models.insert(
        "shared".into(),
        kvgate_gateway::config::ModelConfig {
            aliases: vec!["alias-1".into()],
            ..Default::default()
        },
    );
    let gw = gateway(cfg).await;
    let c = client();
    let j = get(&c, &format!("{}/v1/models", gw.url())).await.json();
    assert_eq!(j["object"], "list");
    let ids: Vec<&str> = j["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alias-1", "m-a", "m-b", "shared"]);
    assert_eq!(get(&c, &format!("{}/health", gw.url())).await.status, 200);
    assert_eq!(get(&c, &format!("{}/ready", gw.url())).await.status, 200);
    let body = r#"{"model":"m-b","messages":[{"role":"user","content":"x"}]}"#;
    assert_eq!(
        post(&c, &format!("{}/v1/chat/completions", gw.url()), body)
            .await
            .status,
        200
    );
    assert_eq!(
        (a.completions(), b.completions()),
        (0, 1),
        "m-b only on worker b"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn metrics_pass_promtool() {
    let w = MockWorker::builder().spawn().await.unwrap();
    let mut cfg = config_for(&[&w], "kv");
    cfg.workers[0].cost_per_hour = 2.0;
    let gw = gateway(cfg).await;
    let c = client();
    post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", true),
    )
    .await;
    post(&c, &format!("{}/v1/chat/completions", gw.url()), "bad").await;
    let r = get(&c, &format!("{}/metrics", gw.url())).await;
    assert_eq!(
        r.headers["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = r.text();
    assert!(text.contains("kvgate_cost_dollars_total{worker="), "{text}");
    assert!(
        text.contains("kvgate_router_decision_seconds_bucket{le=\"0.000001\"}"),
        "{text}"
    );
    gw.shutdown().await;

    support::promtool_check(&text);
}

/// `stream` without the usage-only event of `{"choices":[],"usage":{…}}` (with the blank line
/// that ends it) and without the `"usage":null` member of the other chunks.
fn without_usage_event(stream: &str) -> String {
    let mut out = String::new();
    for ev in stream.split_inclusive("\n\n") {
        if !(ev.contains("\"choices\":[]") && ev.contains("\"usage\":{")) {
            out.push_str(&ev.replace(",\"usage\":null", ""));
        }
    }
    out
}

#[tokio::test]
async fn include_usage_is_added_for_counting_and_stripped_for_the_client() {
    // Events cut in 7-byte pieces: the usage line and its blank line arrive split across chunks.
    let w = MockWorker::builder()
        .tokens(3)
        .cached_tokens(2)
        .chunk_bytes(7)
        .spawn()
        .await
        .unwrap();
    let gw = gateway(config_for(&[&w], "round_robin")).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());

    // 1. The client did not ask for usage: the worker is asked, the client does not see it.
    let body = r#"{"model":"mock-model","stream":true,"x_vendor":{"keep":[1,2]},"messages":[{"role":"user","content":"hi"}]}"#;
    let r = post(&c, &url, body).await;
    assert_eq!(r.status, 200);
    let got = w.received();
    let sent = std::str::from_utf8(&got[0].body).unwrap();
    assert_eq!(
        sent,
        r#"{"stream_options":{"include_usage":true},"model":"mock-model","stream":true,"x_vendor":{"keep":[1,2]},"messages":[{"role":"user","content":"hi"}]}"#,
        "include_usage spliced in, every other byte as sent"
    );
    let t = r.text();
    assert!(
        !t.contains("\"choices\":[]"),
        "usage-only event stripped: {t}"
    );
    assert!(!t.contains("\"usage\":{"), "{t}");
    assert!(!t.contains("\"usage\""), "no usage member at all: {t}");
    assert_eq!(t.matches("data: {").count(), 3, "{t}");
    assert!(t.ends_with("data: [DONE]\n\n"), "{t}");
    // Byte for byte what the worker sent, minus its usage-only event.
    let direct = post(
        &c,
        &format!("{}/v1/chat/completions", w.url()),
        sent.to_owned(),
    )
    .await;
    assert!(direct.text().contains("\"choices\":[]"));
    assert_eq!(t, without_usage_event(&direct.text()));
    // ... and the gateway counted the worker's usage (cached tokens come only from usage).
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    assert!(
        m.lines().any(
            |l| l.starts_with("kvgate_cached_tokens_total{model=\"mock-model\"")
                && l.ends_with(" 2")
        ),
        "{m}"
    );
    assert!(
        m.lines().any(
            |l| l.starts_with("kvgate_completion_tokens_total{model=\"mock-model\"")
                && l.ends_with(" 3")
        ),
        "{m}"
    );

    // 2. The client asked for usage: body forwarded as is, stream delivered as the worker sent it.
    let body = r#"{"model":"mock-model","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#;
    let r = post(&c, &url, body).await;
    assert_eq!(r.status, 200);
    let got = w.received();
    assert_eq!(got.last().unwrap().body, body.as_bytes());
    let direct = post(&c, &format!("{}/v1/chat/completions", w.url()), body).await;
    assert_eq!(r.text(), direct.text(), "usage event delivered unchanged");
    assert!(r.text().contains("\"choices\":[],\"usage\":{"));

    // 3. Non-stream requests are never rewritten.
    let body =
        r#"{"model":"mock-model","stream":false,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(post(&c, &url, body).await.status, 200);
    assert_eq!(w.received().last().unwrap().body, body.as_bytes());
    gw.shutdown().await;
}

/// Plain-TCP clients speaking HTTP/2 (prior knowledge) are handed from kvgate's HTTP/1.1 loop to
/// hyper; and `server.http1 = "hyper"` serves HTTP/1.1 as well as the default loop does.
#[tokio::test]
async fn h2_prior_knowledge_and_either_http1_server() {
    let w = MockWorker::builder().tokens(3).spawn().await.unwrap();
    for http1 in [
        kvgate_gateway::config::Http1Server::Kvgate,
        kvgate_gateway::config::Http1Server::Hyper,
    ] {
        let mut cfg = config_for(&[&w], "kv");
        cfg.server.http1 = http1;
        let gw = gateway(cfg).await;
        let url = format!("{}/v1/chat/completions", gw.url());
        let h2: TestClient =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .http2_only(true)
                .build_http();
        for c in [client(), h2] {
            for stream in [false, true] {
                let r = post(&c, &url, chat_body("sys", "hello", stream)).await;
                assert_eq!(r.status, 200, "{http1:?} stream={stream}: {}", r.text());
                if stream {
                    assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
                } else {
                    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
                }
            }
            let r = get(&c, &format!("{}/v1/models", gw.url())).await;
            assert_eq!(r.status, 200);
        }
        gw.shutdown().await;
    }
}

/// `server.max_connections`: past the cap a new connection gets a 503 in the OpenAI error shape
/// and is closed (counted); connections that close give their place back.
#[tokio::test]
async fn connections_past_the_cap_get_503_and_places_come_back() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let w = MockWorker::builder().tokens(2).spawn().await.unwrap();
    let mut cfg = config_for(&[&w], "round_robin");
    cfg.server.max_connections = 2;
    let gw = gateway(cfg).await;
    let addr = gw.url().trim_start_matches("http://").to_string();
    let metric = |text: &str, name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(-1.0)
    };
    let held_a = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let held_b = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // The third is over the cap: answered and closed without a request being read.
    let mut third = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut out))
        .await
        .expect("closed in time")
        .unwrap();
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 503 "), "{out}");
    assert!(out.contains("retry-after: 1\r\n"), "{out}");
    let body = &out[out.find("\r\n\r\n").unwrap() + 4..];
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.max_connections"),
        "{body}"
    );
    drop((held_a, held_b));
    // Places come back once the held connections close: a request goes through and the gauge
    // returns to the one connection it uses.
    let c = client();
    let deadline = std::time::Instant::now() + PATIENCE;
    let text = loop {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
        let text = String::from_utf8_lossy(&buf).into_owned();
        if text.starts_with("HTTP/1.1 200") && metric(&text, "kvgate_client_connections") == 1.0 {
            break text;
        }
        assert!(std::time::Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The third connection, and any poll above that came before the server saw the held ones
    // close.
    assert!(
        metric(&text, "kvgate_client_connections_refused_total") >= 1.0,
        "{text}"
    );
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("sys", "hello", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    gw.shutdown().await;
}

#[tokio::test]
async fn json_body_stalled_mid_way_is_cut_after_the_idle_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // A worker that sends a head and half a JSON body, then nothing, keeping the connection.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let worker = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 8192];
        let _ = s.read(&mut buf).await.unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"id\":\"half")
            .await
            .unwrap();
        // Hold the connection open until the gateway gives up on it.
        let _ = s.read(&mut buf).await;
    });
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false;
    cfg.upstream.stream_idle_timeout_s = 1;
    let mut wc = kvgate_gateway::config::WorkerConfig::from_url(&url);
    wc.models = vec!["mock-model".into()];
    cfg.workers.push(wc);
    let gw = gateway(cfg).await;
    let body = chat_body("s", "u", false);
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}",
        body.len(),
        body
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // Before the fix this waited forever: only streams had an idle timeout.
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the stalled body was never cut");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.ends_with("{\"id\":\"half"), "{text}");
    let app = gw.app.clone();
    let deadline = std::time::Instant::now() + PATIENCE;
    while !app
        .fleet
        .router
        .active()
        .all()
        .iter()
        .all(|(_, l)| l.inflight == 0)
    {
        assert!(std::time::Instant::now() < deadline, "load never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gw.shutdown().await;
    worker.abort();
}

/// A worker that answers one streamed request with `chunks` SSE events `gap` apart, then ends the
/// stream (`done`) or goes silent with the connection open (`!done`). The cell holds when it sent
/// its last chunk.
async fn sse_worker(
    chunks: usize,
    gap: Duration,
    done: bool,
) -> (
    String,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let last_sent = std::sync::Arc::new(std::sync::Mutex::new(None));
    let last = last_sent.clone();
    let task = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 8192];
        let _ = s.read(&mut buf).await.unwrap();
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        s.write_all(head.as_bytes()).await.unwrap();
        for i in 0..chunks {
            if i > 0 {
                tokio::time::sleep(gap).await;
            }
            let ev = format!(
                "data: {{\"id\":\"t\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}},\"finish_reason\":null}}]}}\n\n"
            );
            s.write_all(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes())
                .await
                .unwrap();
            *last.lock().unwrap() = Some(std::time::Instant::now());
        }
        if done {
            tokio::time::sleep(gap).await;
            let end = "data: [DONE]\n\n";
            s.write_all(format!("{:x}\r\n{end}\r\n0\r\n\r\n", end.len()).as_bytes())
                .await
                .unwrap();
        }
        let _ = s.read(&mut buf).await;
    });
    (url, task, last_sent)
}

/// The streamed answer through a gateway with `stream_idle_timeout_s = idle_s` (the whole
/// exchange, as the client reads it until the gateway ends it).
async fn stream_through_idle_gateway(url: &str, idle_s: u64) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false;
    cfg.upstream.stream_idle_timeout_s = idle_s;
    let mut wc = kvgate_gateway::config::WorkerConfig::from_url(url);
    wc.models = vec!["mock-model".into()];
    cfg.workers.push(wc);
    let gw = gateway(cfg).await;
    let body = chat_body("s", "u", true);
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}",
        body.len(),
        body
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the stream never ended");
    gw.shutdown().await;
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn a_stream_that_keeps_sending_outlives_its_idle_timeout() {
    // 36 chunks 100 ms apart (3.5 s and more) under a 3 s idle timeout: the stream outlives the
    // timeout because the timer follows the data. Each gap has 2.9 s to spare, so a loaded
    // machine that delays a chunk does not cut the stream.
    let (url, worker, _) = sse_worker(36, Duration::from_millis(100), true).await;
    let t0 = std::time::Instant::now();
    let text = stream_through_idle_gateway(&url, 3).await;
    assert!(text.contains("tok35 "), "{text}");
    assert!(text.contains("[DONE]"), "{text}");
    assert!(!text.contains("upstream_stream_error"), "{text}");
    // Sleeps only last longer on a busy machine: the stream did last longer than the timeout.
    assert!(t0.elapsed() > Duration::from_secs(3), "{:?}", t0.elapsed());
    worker.abort();
}

#[tokio::test]
async fn a_stream_gone_silent_gets_an_error_event_after_the_idle_timeout() {
    // 3 chunks 300 ms apart, then silence, under a 2 s idle timeout.
    let (url, worker, last_sent) = sse_worker(3, Duration::from_millis(300), false).await;
    let text = stream_through_idle_gateway(&url, 2).await;
    let ended = std::time::Instant::now();
    assert!(text.contains("tok2 "), "{text}");
    assert!(text.contains("upstream_stream_error"), "{text}");
    assert!(text.contains("sent nothing for 2 s"), "{text}");
    // The error comes one idle timeout after the last chunk (which left 600 ms or more after the
    // first), not after the first chunk or the stream's start.
    let last = last_sent
        .lock()
        .unwrap()
        .expect("the worker sent its chunks");
    assert!(
        ended.duration_since(last) >= Duration::from_secs(2),
        "error {:?} after the last chunk",
        ended.duration_since(last)
    );
    worker.abort();
}
