//! `finish_reason` read through kvgate-protocol on both response paths, as the bounded
//! `kvgate_finish_reasons_total{model,finish_reason}`: a JSON body (first choice, read from its
//! tail) and a stream (the chunk that ends the choice), unknown values as `other`; and every
//! request in `kvgate_requests_by_endpoint_total{endpoint,stream}`.

#[path = "helpers/support.rs"]
mod support;

use kvgate_gateway::config::{Config, WorkerConfig};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

/// A long answer, so the JSON path must find `finish_reason` in the body's tail.
fn json_body(reason: &str) -> String {
    let content = "x".repeat(20_000);
    format!(
        r#"{{"id":"c","object":"chat.completion","model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":"{content}","tool_calls":[]}},"logprobs":null,"finish_reason":"{reason}","stop_reason":null}}],"usage":{{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}}}"#
    )
}

const SSE: &str = "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n\
data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"content_filter\"}]}\n\n\
data: [DONE]\n\n";

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_reasons_and_endpoints_are_counted() {
    let stop = CancellationToken::new();
    let worker = raw_worker(stop.clone(), |head, mut s| async move {
        let path = head.split(' ').nth(1).unwrap_or("").to_string();
        let (ctype, body) = match path.as_str() {
            "/v1/chat/completions" => ("application/json", json_body("tool_calls")),
            "/v1/completions" => ("text/event-stream", SSE.to_string()),
            "/v1/models" => (
                "application/json",
                r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#.into(),
            ),
            _ => ("text/plain", String::new()),
        };
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = s.write_all(resp.as_bytes()).await;
    })
    .await;
    let mut cfg = Config::default();
    cfg.server.listen = "127.0.0.1:0".parse().unwrap();
    cfg.server.request_log = false;
    // No health probes: on a busy machine a late answer to one can take the only worker out,
    // and nothing here is about health.
    cfg.upstream.monitor = false;
    let mut w = WorkerConfig::from_url(&format!("http://{worker}"));
    w.models = vec!["m".into()];
    w.kind = "openai".into();
    cfg.workers.push(w);
    let gw = gateway(cfg).await;
    let c = client();

    for _ in 0..2 {
        let r = post(
            &c,
            &format!("{}/v1/chat/completions", gw.url()),
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = post(
        &c,
        &format!("{}/v1/completions", gw.url()),
        r#"{"model":"m","prompt":"hi","stream":true}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("content_filter"));
    // Unknown model: counted by endpoint, no finish reason.
    let r = post(
        &c,
        &format!("{}/v1/completions", gw.url()),
        r#"{"model":"nope","prompt":"hi"}"#,
    )
    .await;
    assert_eq!(r.status, 404);

    let text = get(&c, &format!("{}/metrics", gw.url())).await.text();
    let fr = |r: &str| {
        sample(
            &text,
            &format!("kvgate_finish_reasons_total{{model=\"m\",finish_reason=\"{r}\"}}"),
        )
    };
    assert_eq!(fr("tool_calls"), Some(2.0), "{text}");
    assert_eq!(fr("content_filter"), Some(1.0), "{text}");
    assert_eq!(fr("stop"), None);
    assert!(!text.contains("finish_reason=\"other\""), "{text}");
    let ep = |e: &str, s: &str| {
        sample(
            &text,
            &format!("kvgate_requests_by_endpoint_total{{endpoint=\"{e}\",stream=\"{s}\"}}"),
        )
    };
    assert_eq!(ep("chat", "false"), Some(2.0));
    assert_eq!(ep("completions", "true"), Some(1.0));
    assert_eq!(ep("completions", "false"), Some(1.0));
    assert_eq!(ep("embeddings", "false"), Some(0.0));
    promtool_check(&text);
    stop.cancel();
}
