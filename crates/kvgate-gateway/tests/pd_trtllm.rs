//! TensorRT-LLM's context-first handoff (`[pd] protocol = "trtllm"`) in-process: a scripted
//! context worker answers with `choices[0].disaggregated_params`, a mock generation worker
//! records what it got. The leg bodies themselves are unit-tested in `src/pd.rs`.

#[path = "helpers/support.rs"]
mod support;

use std::net::SocketAddr;

use kvgate_gateway::config::{Config, Handoff, PdProtocol, WorkerConfig, WorkerRole};
use kvgate_gateway::mock::{MockHandle, MockWorker};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

/// A context worker whose chat answers end with `finish_reason`.
async fn context_worker(finish_reason: &'static str, stop: CancellationToken) -> SocketAddr {
    raw_worker(stop, move |head, mut s| async move {
        let body = if head.starts_with("POST /v1/chat/completions") {
            serde_json::json!({"id": "ctx", "object": "chat.completion", "model": "mock-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                    "finish_reason": finish_reason,
                    "disaggregated_params": {"request_type": "context_only", "ctx_request_id": 5,
                        "disagg_request_id": 77, "first_gen_tokens": [11],
                        "encoded_opaque_state": "AAE="}}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21,
                    "prompt_tokens_details": {"cached_tokens": 16}}})
            .to_string()
        } else {
            "{}".to_string()
        };
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = s.write_all(resp.as_bytes()).await;
    })
    .await
}

fn config(ctx: SocketAddr, gen: &MockHandle) -> Config {
    let mut cfg = config_for(&[gen], "kv");
    cfg.workers[0].role = WorkerRole::Decode.into();
    cfg.workers[0].models = vec!["mock-model".into()];
    let mut c = WorkerConfig::from_url(&format!("http://{ctx}"));
    c.role = WorkerRole::Prefill.into();
    c.models = vec!["mock-model".into()];
    cfg.workers.push(c);
    cfg.pd.protocol = PdProtocol::Fixed(Handoff::Trtllm);
    cfg.pd.min_uncached_tokens = 0;
    cfg
}

#[tokio::test]
async fn the_generation_leg_gets_the_context_params() {
    let stop = CancellationToken::new();
    let ctx = context_worker("length", stop.clone()).await;
    let gen = MockWorker::builder()
        .tokens(4)
        .record(true)
        .spawn()
        .await
        .unwrap();
    let gw = gateway(config(ctx, &gen)).await;
    let r = post(
        &client(),
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    // Prompt and cached tokens from the context leg (the vLLM usage rule).
    assert_eq!(v["usage"]["prompt_tokens"], 20, "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 16,
        "{v}"
    );
    let got = gen.received();
    assert_eq!(got.len(), 1);
    let b: serde_json::Value = serde_json::from_slice(&got[0].body).unwrap();
    let p = &b["disaggregated_params"];
    assert_eq!(p["request_type"], "generation_only", "{b}");
    assert_eq!(p["ctx_request_id"], 5);
    assert_eq!(p["first_gen_tokens"], serde_json::json!([11]));
    assert_eq!(p["encoded_opaque_state"], "AAE=");
    assert_eq!(b["stream"], false);
    gw.shutdown().await;
    stop.cancel();
}

#[tokio::test]
async fn a_context_leg_that_finished_is_the_answer() {
    let stop = CancellationToken::new();
    let ctx = context_worker("stop", stop.clone()).await;
    let gen = MockWorker::builder()
        .tokens(4)
        .record(true)
        .spawn()
        .await
        .unwrap();
    let gw = gateway(config(ctx, &gen)).await;
    let r = post(
        &client(),
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["id"], "ctx", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["choices"][0].get("disaggregated_params").is_none(), "{v}");
    assert_eq!(gen.received().len(), 0, "no generation leg");

    // A streaming client cannot take that JSON: the generation worker runs it whole.
    let r = post(
        &client(),
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "u", true),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("[DONE]"), "{}", r.text());
    let got = gen.received();
    assert_eq!(got.len(), 1);
    let b: serde_json::Value = serde_json::from_slice(&got[0].body).unwrap();
    assert!(b.get("disaggregated_params").is_none(), "{b}");
    let m = get(&client(), &format!("{}/metrics", gw.url()))
        .await
        .text();
    assert!(
        m.contains("path=\"disaggregated\",reason=\"context_finished\"")
            || m.contains("reason=\"context_finished\",path=\"disaggregated\""),
        "{m}"
    );
    // The answer the context leg finished is counted by its finish reason like any other.
    assert!(
        m.lines()
            .any(|l| l.starts_with("kvgate_finish_reasons_total{")
                && l.contains("finish_reason=\"stop\"")
                && l.ends_with(" 1")),
        "{m}"
    );
    gw.shutdown().await;
    stop.cancel();
}

/// `[pd] decode_policy`: the generation (decode) leg has its own policy, by default
/// `least_loaded` under `kv`. Four requests with one prompt, each dispatched while the earlier
/// ones still generate, get a generation worker each (`kv` counts the shared prompt's blocks once
/// per worker and stacked them), while the context legs still go by `kv`.
#[tokio::test]
async fn decode_policy_chooses_the_generation_worker() {
    let stop = CancellationToken::new();
    let ctx = context_worker("length", stop.clone()).await;
    let mut gens = Vec::new();
    for _ in 0..4 {
        gens.push(
            MockWorker::builder()
                .tokens(2)
                .ttft(std::time::Duration::from_secs(3))
                .record(true)
                .spawn()
                .await
                .unwrap(),
        );
    }
    let mut cfg = config(ctx, &gens[0]);
    for g in &gens[1..] {
        let mut c = WorkerConfig::from_url(&g.url());
        c.role = WorkerRole::Decode.into();
        c.models = vec!["mock-model".into()];
        cfg.workers.push(c);
    }
    assert_eq!(cfg.pd.decode_policy, None);
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let received =
        |gens: &[MockHandle]| gens.iter().map(|g| g.received().len()).collect::<Vec<_>>();
    let mut clients = Vec::new();
    for i in 0..4 {
        let url = url.clone();
        clients.push(tokio::spawn(async move {
            post(
                &client(),
                &url,
                chat_body("shared system prompt", "same question", false),
            )
            .await
        }));
        // The next request is routed only once this one's generation leg is in flight.
        let arrived = eventually(PATIENCE, || received(&gens).iter().sum::<usize>() == i + 1).await;
        assert!(arrived, "request {i} never reached a generation worker");
    }
    assert_eq!(received(&gens), vec![1, 1, 1, 1]);
    for c in clients {
        let r = c.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    gw.shutdown().await;
    stop.cancel();
}

#[tokio::test]
async fn an_unknown_decode_policy_is_a_config_error() {
    let gen = MockWorker::builder().spawn().await.unwrap();
    let mut cfg = config_for(&[&gen], "kv");
    cfg.pd.decode_policy = Some("fastest".into());
    let err = kvgate_gateway::Gateway::start(cfg)
        .await
        .err()
        .expect("refused");
    assert!(format!("{err:#}").contains("pd.decode_policy"), "{err:#}");
}
