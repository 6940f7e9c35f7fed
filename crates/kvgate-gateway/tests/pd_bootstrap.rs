//! SGLang's bootstrap handoff (`[pd] protocol = "sglang"`) in-process, with mock workers standing
//! in for the prefill and decode engines (they ignore the bootstrap fields): both legs get the
//! same body at once, and what happens once both heads are in — the prefill answer failing while
//! the client streams the decode answer, and the client leaving.

#[path = "helpers/support.rs"]
mod support;

use std::time::Duration;

use http_body_util::BodyExt;
use kvgate_gateway::config::{Handoff, PdProtocol, WorkerRole};
use kvgate_gateway::mock::{MockHandle, MockWorker};
use support::*;

async fn metrics(gw: &kvgate_gateway::Gateway) -> String {
    get(&client(), &format!("{}/metrics", gw.url()))
        .await
        .text()
}

/// Polls the gateway's metrics until they contain `needle`.
async fn metrics_reach(gw: &kvgate_gateway::Gateway, needle: &str) {
    let end = tokio::time::Instant::now() + PATIENCE;
    loop {
        let m = metrics(gw).await;
        if m.contains(needle) {
            return;
        }
        assert!(tokio::time::Instant::now() < end, "no `{needle}` in:\n{m}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn pd_config(p: &MockHandle, d: &MockHandle) -> kvgate_gateway::config::Config {
    let mut cfg = config_for(&[p, d], "kv");
    cfg.workers[0].role = WorkerRole::Prefill.into();
    cfg.workers[1].role = WorkerRole::Decode.into();
    cfg.pd.protocol = PdProtocol::Fixed(Handoff::Sglang);
    cfg.pd.min_uncached_tokens = 0;
    cfg
}

#[tokio::test]
async fn both_legs_get_the_same_body_with_the_bootstrap_fields() {
    let p = MockWorker::builder()
        .tokens(1)
        .record(true)
        .spawn()
        .await
        .unwrap();
    let d = MockWorker::builder()
        .tokens(4)
        .record(true)
        .spawn()
        .await
        .unwrap();
    let gw = gateway(pd_config(&p, &d)).await;
    let r = post(
        &client(),
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 4, "decode's answer");
    let (pr, dr) = (p.received(), d.received());
    assert_eq!((pr.len(), dr.len()), (1, 1));
    assert_eq!(pr[0].body, dr[0].body, "one body for both legs");
    let v: serde_json::Value = serde_json::from_slice(&pr[0].body).unwrap();
    assert_eq!(v["bootstrap_host"], "127.0.0.1");
    assert_eq!(v["bootstrap_port"], 8998);
    assert!(v["bootstrap_room"]
        .as_u64()
        .is_some_and(|r| r <= i64::MAX as u64));
    assert_eq!(v["stream"], false);
    metrics_reach(&gw, "kvgate_pd_prefill_duration_seconds_count 1").await;
    gw.shutdown().await;
}

#[tokio::test]
async fn a_prefill_answer_failing_mid_way_ends_the_stream_with_one_error_event() {
    // The prefill answer's head and first event arrive, then its connection dies; the decode
    // stream would run for seconds.
    let p = MockWorker::builder()
        .tokens(10)
        .itl(Duration::from_millis(20))
        .die_after(1)
        .spawn()
        .await
        .unwrap();
    let d = MockWorker::builder()
        .tokens(200)
        .itl(Duration::from_millis(20))
        .spawn()
        .await
        .unwrap();
    let gw = gateway(pd_config(&p, &d)).await;
    let r = post(
        &client(),
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", true),
    )
    .await;
    assert_eq!(r.status, 200);
    let t = r.text();
    assert!(t.matches("\"chat.completion.chunk\"").count() < 200, "{t}");
    let last = t.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("data: {\"error\":"), "{t}");
    assert!(last.contains("prefill leg"), "{t}");
    assert_eq!(t.matches("\"error\"").count(), 1, "{t}");
    // The decode worker's stream was cancelled with it.
    assert!(eventually(PATIENCE, || d.active_streams() == 0).await);
    metrics_reach(
        &gw,
        "kvgate_pd_handoff_failures_total{kind=\"prefill_error\"} 1",
    )
    .await;
    gw.shutdown().await;
}

#[tokio::test]
async fn a_client_that_leaves_cancels_both_legs() {
    let slow = || {
        MockWorker::builder()
            .tokens(500)
            .itl(Duration::from_millis(20))
    };
    let p = slow().spawn().await.unwrap();
    let d = slow().spawn().await.unwrap();
    let gw = gateway(pd_config(&p, &d)).await;
    let req = http::Request::post(format!("{}/v1/chat/completions", gw.url()))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(chat_body(
            "s", "u", true,
        ))))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("head in time")
        .expect("request ok");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body.frame().await.expect("a first frame").expect("ok");
    assert!(first.is_data());
    assert!(
        eventually(PATIENCE, || {
            p.active_streams() == 1 && d.active_streams() == 1
        })
        .await
    );
    drop(body);
    assert!(
        eventually(PATIENCE, || {
            p.active_streams() == 0 && d.active_streams() == 0
        })
        .await,
        "prefill {} decode {}",
        p.active_streams(),
        d.active_streams()
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_failing_leg_is_a_502_and_the_other_is_dropped() {
    let p = MockWorker::builder().status(500).spawn().await.unwrap();
    let d = MockWorker::builder()
        .tokens(500)
        .itl(Duration::from_millis(20))
        .spawn()
        .await
        .unwrap();
    let gw = gateway(pd_config(&p, &d)).await;
    let r = post(
        &client(),
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", true),
    )
    .await;
    let e = assert_openai_error(&r, 502);
    assert!(
        e["message"].as_str().unwrap().contains("prefill leg"),
        "{e}"
    );
    assert!(eventually(PATIENCE, || d.active_streams() == 0).await);
    gw.shutdown().await;
}
