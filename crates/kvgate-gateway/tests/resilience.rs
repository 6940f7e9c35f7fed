//! Outages and misbehaving workers, end to end on loopback (issue 16): every worker down and back
//! on the same ports (time to the first 200 after the workers answer their health check again),
//! one worker flapping, a worker that stalls (504 and retry, load released), and client
//! credentials kept from workers when the gateway authenticates clients.

#[path = "helpers/support.rs"]
mod support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use kvgate_gateway::config::{ApiKeyConfig, Config, WorkerConfig};
use kvgate_gateway::mock::{MockHandle, MockWorker};
use kvgate_gateway::registry::BreakerState;
use kvgate_gateway::Gateway;
use support::*;

async fn mock_at(addr: SocketAddr) -> MockHandle {
    // The port was just closed by the previous mock on it; binding again may race the close.
    poll_for(PATIENCE, format!("{addr} free to bind again"), || async {
        MockWorker::builder()
            .addr(addr)
            .record(false)
            .spawn()
            .await
            .ok()
    })
    .await
}

fn chat() -> String {
    chat_body("sys", "hello", false)
}

/// A worker's `/health` answers 200 (the instant it is routable again as far as it knows).
async fn healthy(c: &TestClient, addr: SocketAddr) -> bool {
    let req = Request::get(format!("http://{addr}/health"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    matches!(
        tokio::time::timeout(Duration::from_secs(1), c.request(req)).await,
        Ok(Ok(r)) if r.status().is_success()
    )
}

/// Like `support::post`, without panicking on a failed or slow exchange (`None`).
async fn try_post(c: &TestClient, url: &str, body: String) -> Option<u16> {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(5), c.request(req)).await {
        Ok(Ok(r)) => Some(r.status().as_u16()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_outage_then_first_200_soon_after_workers_answer_health_again() {
    let a = MockWorker::builder().record(false).spawn().await.unwrap();
    let b = MockWorker::builder().record(false).spawn().await.unwrap();
    let addrs = [a.addr, b.addr];
    let mut cfg = config_for(&[&a, &b], "round_robin");
    cfg.server.io_threads = 1;
    let gw = gateway(cfg).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    poll_until(PATIENCE, "the fleet serves before the outage", || async {
        try_post(&c, &url, chat()).await == Some(200)
    })
    .await;

    // Every worker down. Clients keep calling (failures open the breakers) and the health checker
    // keeps failing its probes (a breaker's 10 s default cool-down would make this test slow:
    // what matters is that probes failed many times). Wait for that to be so, not for a time:
    // both breakers open and at least 6 failed probes per worker, what 3 s at the 500 ms
    // cadence of a worker that is out gives on an idle machine.
    a.stop().await;
    b.stop().await;
    let mc = client();
    let metrics_url = format!("{}/metrics", gw.url());
    poll_until(
        PATIENCE,
        "both breakers open after 6 failed probes per worker",
        || async {
            assert_ne!(try_post(&c, &url, chat()).await, Some(200));
            let now = Instant::now();
            let open = gw
                .app
                .fleet
                .registry
                .snapshot()
                .workers
                .iter()
                .all(|w| w.state.breaker_state(now) == BreakerState::Open);
            let m = get(&mc, &metrics_url).await.text();
            let failed: Vec<f64> = m
                .lines()
                .filter(|l| l.starts_with("kvgate_worker_health_checks_total{"))
                .filter(|l| l.contains("result=\"failed\""))
                .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
                .collect();
            open && failed.len() == 2 && failed.iter().all(|n| *n >= 6.0)
        },
    )
    .await;

    // Back on the same ports.
    let _a = mock_at(addrs[0]).await;
    let _b = mock_at(addrs[1]).await;
    let hc = client();
    poll_until(PATIENCE, "the restarted workers answer /health", || async {
        healthy(&hc, addrs[0]).await && healthy(&hc, addrs[1]).await
    })
    .await;
    let up_at = Instant::now();
    let mut first_200 = None;
    while up_at.elapsed() < Duration::from_secs(20) {
        if try_post(&c, &url, chat()).await == Some(200) {
            first_200 = Some(up_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = first_200.expect("a 200 within 20 s of the workers' return");
    eprintln!("measured: first 200 {took:?} after both workers answered /health again");
    // Target 2 s (issue 16); probes run every 500 ms while a worker is out, so this holds with a
    // wide margin even on a loaded box.
    assert!(
        took <= Duration::from_secs(2),
        "first 200 came {took:?} after the workers were back"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_flapping_worker_costs_no_request() {
    let steady1 = MockWorker::builder().record(false).spawn().await.unwrap();
    let steady2 = MockWorker::builder().record(false).spawn().await.unwrap();
    let flap = MockWorker::builder().record(false).spawn().await.unwrap();
    let flap_addr = flap.addr;
    let mut cfg = config_for(&[&steady1, &steady2, &flap], "round_robin");
    cfg.server.io_threads = 1;
    let gw = gateway(cfg).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    poll_until(PATIENCE, "the fleet serves", || async {
        try_post(&c, &url, chat()).await == Some(200)
    })
    .await;

    let stop = tokio_util::sync::CancellationToken::new();
    let flapper = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut w = Some(flap);
            let mut cycles = 0;
            while !stop.is_cancelled() {
                if let Some(m) = w.take() {
                    m.stop().await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                w = Some(mock_at(flap_addr).await);
                tokio::time::sleep(Duration::from_millis(400)).await;
                cycles += 1;
            }
            cycles
        })
    };
    let mut statuses = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        statuses.push(try_post(&c, &url, chat()).await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    let cycles = flapper.await.unwrap();
    assert!(cycles >= 3, "the worker flapped ({cycles} cycles)");
    let failed: Vec<_> = statuses.iter().filter(|s| **s != Some(200)).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed while one worker flapped: {failed:?}",
        failed.len(),
        statuses.len()
    );
    // The flapping was felt: attempts on the down worker failed and were retried elsewhere.
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    let retries: f64 = m
        .lines()
        .filter(|l| l.starts_with("kvgate_retries_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    eprintln!(
        "measured: {} requests, {retries} retried, {cycles} flaps",
        statuses.len()
    );
    assert!(retries >= 1.0, "no attempt hit the flapping worker:\n{m}");
    gw.shutdown().await;
}

/// A gateway in front of one worker that never answers and one that does.
async fn stall_fleet() -> (MockHandle, MockHandle, Gateway, String) {
    let stalled = MockWorker::builder()
        .ttft(Duration::from_secs(3600))
        .spawn()
        .await
        .unwrap();
    let good = MockWorker::builder().spawn().await.unwrap();
    let mut cfg = config_for(&[&stalled], "round_robin");
    cfg.upstream.request_timeout_s = 1;
    cfg.upstream.stream_first_byte_timeout_s = 1;
    cfg.workers.push(WorkerConfig::from_url(&good.url()));
    for w in &mut cfg.workers {
        w.models = vec!["mock-model".into()];
    }
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    (stalled, good, gw, url)
}

fn inflight(gw: &Gateway) -> Vec<u32> {
    gw.app
        .fleet
        .registry
        .snapshot()
        .workers
        .iter()
        .map(|w| w.state.inflight.load(Ordering::Relaxed))
        .collect()
}

async fn stalled_worker_is_retried(stream: bool) {
    let (stalled, good, gw, url) = stall_fleet().await;
    let c = client();
    // Round robin: at least one of the requests goes to the stalled worker first, times out, and
    // is retried on the good one; all succeed.
    for _ in 0..3 {
        let r = post(&c, &url, chat_body("sys", "hi", stream)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        if stream {
            assert!(r.text().contains("data: [DONE]"), "{}", r.text());
        }
    }
    let stalled_attempts = stalled.received().len();
    assert!(
        stalled_attempts >= 1,
        "round robin tried the stalled worker"
    );
    assert_eq!(good.received().len(), 3);
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    assert!(
        m.contains(&format!(
            "kvgate_retries_total{{reason=\"upstream_timeout\"}} {stalled_attempts}"
        )),
        "{m}"
    );
    assert!(
        eventually(PATIENCE, || inflight(&gw) == [0, 0]).await,
        "load released: {:?}",
        inflight(&gw)
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn stalled_worker_non_streaming_times_out_and_is_retried() {
    stalled_worker_is_retried(false).await;
}

#[tokio::test]
async fn stalled_worker_streaming_first_byte_times_out_and_is_retried() {
    stalled_worker_is_retried(true).await;
}

#[tokio::test]
async fn stalled_only_worker_gives_an_openai_504() {
    for stream in [false, true] {
        let stalled = MockWorker::builder()
            .ttft(Duration::from_secs(3600))
            .spawn()
            .await
            .unwrap();
        let mut cfg = config_for(&[&stalled], "round_robin");
        cfg.upstream.request_timeout_s = 1;
        cfg.upstream.stream_first_byte_timeout_s = 1;
        cfg.workers[0].models = vec!["mock-model".into()];
        let gw = gateway(cfg).await;
        let c = client();
        let url = format!("{}/v1/chat/completions", gw.url());
        let t0 = Instant::now();
        let r = post(&c, &url, chat_body("sys", "hi", stream)).await;
        let e = assert_openai_error(&r, 504);
        assert_eq!(e["code"], "upstream_timeout", "{e}");
        assert!(
            e["message"].as_str().unwrap().contains(if stream {
                "no first byte within 1s"
            } else {
                "no response within 1s"
            }),
            "{e}"
        );
        // No retry: no other worker. The timeout applied, not the 600 s default.
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(eventually(PATIENCE, || inflight(&gw) == [0]).await);
        gw.shutdown().await;
    }
}

fn auth_fleet(worker: &MockHandle, worker_key: Option<&str>, client_key: Option<&str>) -> Config {
    let mut cfg = config_for(&[worker], "round_robin");
    cfg.workers[0].models = vec!["mock-model".into()];
    cfg.workers[0].api_key = worker_key.map(str::to_string);
    if let Some(k) = client_key {
        cfg.auth.keys.push(ApiKeyConfig {
            key: k.into(),
            name: None,
            rate_per_s: None,
            burst: None,
            priority: None,
            tenant: None,
        });
    }
    cfg
}

async fn post_with_credentials(gw: &Gateway) -> Resp {
    let req = Request::post(format!("{}/v1/chat/completions", gw.url()))
        .header("content-type", "application/json")
        .header("authorization", "Bearer client-key")
        .header("x-api-key", "client-key")
        .header("api-key", "client-key")
        .header("cookie", "session=secret")
        .header("x-trace-id", "keep-me")
        .body(Full::new(Bytes::from(chat())))
        .unwrap();
    send(&client(), req).await
}

#[tokio::test]
async fn client_credentials_stay_at_the_gateway_when_auth_is_on() {
    // Auth on, the worker has its own key: it gets that key and nothing of the client's.
    let w = MockWorker::builder().spawn().await.unwrap();
    let gw = gateway(auth_fleet(&w, Some("worker-key"), Some("client-key"))).await;
    let r = post_with_credentials(&gw).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let got = &w.received()[0].headers;
    assert_eq!(got["authorization"], "Bearer worker-key");
    for h in ["x-api-key", "api-key", "cookie"] {
        assert!(got.get(h).is_none(), "{h} forwarded: {got:?}");
    }
    assert_eq!(got["x-trace-id"], "keep-me", "other headers pass");
    gw.shutdown().await;

    // Auth on, no worker key: no credential at all reaches the worker.
    let w = MockWorker::builder().spawn().await.unwrap();
    let gw = gateway(auth_fleet(&w, None, Some("client-key"))).await;
    assert_eq!(post_with_credentials(&gw).await.status, 200);
    let got = &w.received()[0].headers;
    for h in ["authorization", "x-api-key", "api-key", "cookie"] {
        assert!(got.get(h).is_none(), "{h} forwarded: {got:?}");
    }
    gw.shutdown().await;

    // Auth off: the gateway is transparent (the worker may authenticate clients itself).
    let w = MockWorker::builder().spawn().await.unwrap();
    let gw = gateway(auth_fleet(&w, None, None)).await;
    assert_eq!(post_with_credentials(&gw).await.status, 200);
    let got = &w.received()[0].headers;
    assert_eq!(got["authorization"], "Bearer client-key");
    assert_eq!(got["x-api-key"], "client-key");
    assert_eq!(got["cookie"], "session=secret");
    gw.shutdown().await;
}

/// A worker that sends a non-streamed answer's head and the first bytes of its body, then stalls.
async fn half_answer_worker() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{\"id\":\"cmpl-1\",",
                    )
                    .await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
            });
        }
    });
    (addr, task)
}

#[tokio::test]
async fn a_body_that_stalls_after_the_head_is_cut_at_the_request_timeout() {
    let (addr, task) = half_answer_worker().await;
    let mut cfg = Config::default();
    cfg.server.listen = "127.0.0.1:0".parse().unwrap();
    cfg.server.request_log = false;
    cfg.upstream.monitor = false;
    cfg.upstream.request_timeout_s = 1;
    let mut w = WorkerConfig::from_url(&format!("http://{addr}"));
    w.models = vec!["mock-model".into()];
    cfg.workers.push(w);
    let gw = gateway(cfg).await;
    let req = Request::post(format!("{}/v1/chat/completions", gw.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat())))
        .unwrap();
    let t0 = Instant::now();
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("head in time")
        .expect("head");
    assert_eq!(resp.status(), 200, "the head went out before the stall");
    // The client sees the body end in an error (a reset, the honest signal for a truncated JSON
    // document), at the deadline rather than never.
    let body = tokio::time::timeout(
        Duration::from_secs(10),
        http_body_util::BodyExt::collect(resp.into_body()),
    )
    .await
    .expect("the body ends within the request timeout, not never");
    assert!(body.is_err(), "a truncated body must not look complete");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(eventually(PATIENCE, || inflight(&gw) == [0]).await);
    let m = get(&client(), &format!("{}/metrics", gw.url()))
        .await
        .text();
    assert!(
        m.contains("kvgate_errors_total{kind=\"upstream_timeout\"} 1"),
        "{m}"
    );
    gw.shutdown().await;
    task.abort();
}
