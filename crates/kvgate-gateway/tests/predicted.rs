//! Predicted insertion as an operator sees it: a worker with KV events gets the routed prompt's
//! blocks credited before any event confirms them, visible as `kvgate_index_predicted_blocks` and
//! in `/admin/state`, and they lapse after `routing.predicted_ttl_s`. Real sockets, port 0.

#[path = "helpers/support.rs"]
mod support;

use bytes::Bytes;
use http_body_util::Full;
use kvgate_gateway::mock::MockWorker;
use support::*;

fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in scrape:\n{text}"))
}

#[tokio::test]
async fn routed_prompt_is_predicted_on_an_event_worker_then_lapses() {
    let w = MockWorker::builder().spawn().await.unwrap();
    // A publisher nobody listens on: the worker is in exact mode, but no event will confirm.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let events = format!("tcp://{}", dead.local_addr().unwrap());
    drop(dead);
    let mut cfg = config_for(&[&w], "kv");
    cfg.workers[0].kv_events = Some(events);
    cfg.workers[0].models = vec!["mock-model".into()];
    cfg.routing.predicted_ttl_s = 1;
    cfg.admin.listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.admin.key = Some("adm".into());
    let gw = gateway(cfg).await;
    let c = client();
    let metrics = format!("{}/metrics", gw.url());
    assert_eq!(
        gauge(
            &get(&c, &metrics).await.text(),
            "kvgate_index_predicted_blocks"
        ),
        0.0
    );

    // ~200 words of system prompt: several 16-token blocks whatever the tokenizer.
    let system = "You are a careful assistant for a fleet operator. ".repeat(20);
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body(&system, "hello", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());

    let scrape = get(&c, &metrics).await.text();
    let predicted = gauge(&scrape, "kvgate_index_predicted_blocks");
    assert!(predicted >= 4.0, "predicted {predicted}");
    assert!(gauge(&scrape, "kvgate_index_blocks") >= predicted);
    promtool_check(&scrape);

    let state = send(
        &c,
        http::Request::get(format!("http://{}/admin/state", gw.admin_addr.unwrap()))
            .header("authorization", "Bearer adm")
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await
    .json();
    assert_eq!(state["index_predicted_entries"].as_f64(), Some(predicted));
    assert_eq!(
        state["workers"][0]["index_predicted_blocks"].as_f64(),
        Some(predicted)
    );
    // Confirmed blocks (from events) are reported apart: none arrived.
    assert_eq!(state["workers"][0]["index_blocks"], 0);

    // Nothing confirms them: after the TTL they no longer count.
    poll_until(
        PATIENCE,
        "predicted blocks to lapse after predicted_ttl_s = 1",
        || async {
            gauge(
                &get(&c, &metrics).await.text(),
                "kvgate_index_predicted_blocks",
            ) == 0.0
        },
    )
    .await;
    gw.shutdown().await;
    w.stop().await;
}
