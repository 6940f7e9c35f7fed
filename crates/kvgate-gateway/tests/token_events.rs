//! The one definition of "a token arrived" (kvgate-protocol `sse::ChunkInfo`, docs/metrics.md) as
//! the gateway's metrics see it, against a scripted worker whose stream opens with a role-only
//! chunk long before its first generated content (a tool call). The gateway's old reader counted
//! every `data:` event: TTFT ended at the role chunk, the finish chunk was an inter-token gap, and
//! `"error": null` marked a healthy stream as failed.

#[path = "helpers/support.rs"]
mod support;

use std::net::SocketAddr;
use std::time::Duration;

use kvgate_gateway::config::{Config, WorkerConfig};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

/// Prefill time of the scripted worker: between its role chunk and its first tool-call delta.
const PREFILL: Duration = Duration::from_millis(300);

/// The events the worker sends, each after the given pause.
fn script() -> Vec<(Duration, &'static str)> {
    vec![
        (
            Duration::ZERO,
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
        ),
        (
            PREFILL,
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]},"finish_reason":null}]}"#,
        ),
        (
            Duration::from_millis(5),
            r#"{"id":"c","error":null,"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":null}]}"#,
        ),
        (
            Duration::from_millis(5),
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
        ),
        (Duration::ZERO, "[DONE]"),
    ]
}

fn event(data: &str) -> String {
    format!("data: {data}\n\n")
}

/// A worker that answers `POST /v1/chat/completions` with [`script`] as a chunked event stream,
/// anything else 404.
async fn worker(stop: CancellationToken) -> SocketAddr {
    raw_worker(stop, |head, mut s| async move {
        if !head.starts_with("POST /v1/chat/completions ") {
            let _ = s
                .write_all(b"HTTP/1.1 404 X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .await;
            return;
        }
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            .await;
        for (pause, data) in script() {
            tokio::time::sleep(pause).await;
            let ev = event(data);
            let framed = format!("{:x}\r\n{ev}\r\n", ev.len());
            if s.write_all(framed.as_bytes()).await.is_err() {
                return;
            }
        }
        let _ = s.write_all(b"0\r\n\r\n").await;
    })
    .await
}

/// The value of the sample line starting with `series` (`name{labels}`), if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn ttft_and_itl_count_generated_content_only() {
    let stop = CancellationToken::new();
    let addr = worker(stop.clone()).await;
    let mut cfg = Config::default();
    cfg.server.listen = "127.0.0.1:0".parse().unwrap();
    cfg.server.request_log = false;
    cfg.upstream.monitor = false;
    let mut w = WorkerConfig::from_url(&format!("http://{addr}"));
    w.models = vec!["m".into()];
    cfg.workers.push(w);
    let gw = gateway(cfg).await;
    let c = client();

    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"weather?"}]}"#;
    let r = post(&c, &format!("{}/v1/chat/completions", gw.url()), body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let sent: String = script().into_iter().map(|(_, d)| event(d)).collect();
    assert_eq!(r.text(), sent, "the stream passes byte for byte");

    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    let ttft = sample(&m, "kvgate_time_to_first_token_seconds_sum{model=\"m\"}");
    let count = sample(&m, "kvgate_time_to_first_token_seconds_count{model=\"m\"}");
    assert_eq!(count, Some(1.0), "{m}");
    // The role chunk came at once; the first token (the tool call) only after the prefill.
    assert!(
        ttft.is_some_and(|t| t >= PREFILL.as_secs_f64()),
        "TTFT {ttft:?} must end at the tool call, not the role chunk"
    );
    // Two token events (the tool-call deltas): one gap; the finish chunk is not a token.
    let itl = sample(&m, "kvgate_inter_token_latency_seconds_count{model=\"m\"}");
    assert_eq!(itl, Some(1.0), "{m}");
    // No usage from this worker: completion tokens fall back to the token events.
    let completion = m
        .lines()
        .find(|l| l.starts_with("kvgate_completion_tokens_total{model=\"m\""))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(completion, Some(2.0), "{m}");
    // `"error": null` is not an error event.
    assert!(
        m.contains("kvgate_errors_total{kind=\"upstream_stream\"} 0\n"),
        "no stream error recorded: {m}"
    );
    assert!(m.contains("kvgate_requests_total{model=\"m\""), "{m}");

    gw.shutdown().await;
    stop.cancel();
}
