//! The agent-client APIs (Responses, Messages) and the pass-through utility endpoints, driven over
//! real sockets on 127.0.0.1:0.

mod support;

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvgate_sim::{SimConfig, SimHandle, SimWorker};
use serde_json::{json, Value};
use support::*;

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn fast() -> SimConfig {
    SimConfig::default().speedup(0.0).num_gpu_blocks(1024usize)
}

async fn spawn(store: bool) -> SimHandle {
    SimWorker::spawn(fast().responses_store(store), local(), None)
        .await
        .unwrap()
}

async fn call(c: &HttpClient, method: &str, url: &str, body: Option<&Value>) -> (u16, String) {
    let b = body
        .map(|b| serde_json::to_vec(b).unwrap())
        .unwrap_or_default();
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(b)))
        .unwrap();
    let resp = c.request(req).await.expect("request failed");
    let st = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (st, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn json_call(c: &HttpClient, method: &str, url: &str, body: Option<&Value>) -> (u16, Value) {
    let (st, text) = call(c, method, url, body).await;
    (st, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// `(event name, data)` of every SSE event; asserts each has an `event:` line naming its type.
fn named_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut lines = e.lines();
            let name = lines
                .next()
                .and_then(|l| l.strip_prefix("event: "))
                .unwrap_or_else(|| panic!("event without an `event:` line: {e:?}"))
                .to_owned();
            let data = lines
                .next()
                .and_then(|l| l.strip_prefix("data: "))
                .unwrap_or_else(|| panic!("event without data: {e:?}"));
            let v: Value = serde_json::from_str(data).unwrap();
            assert_eq!(v["type"], name.as_str(), "event line names the data's type");
            (name, v)
        })
        .collect()
}

fn names(ev: &[(String, Value)]) -> Vec<&str> {
    ev.iter().map(|(n, _)| n.as_str()).collect()
}

/// A long system text shared by the requests of a test (many full KV blocks).
fn long_text() -> String {
    words("ctx", 120)
}

#[tokio::test]
async fn responses_answer_in_vllms_shape_with_cached_tokens_on_a_repeat() {
    let w = spawn(false).await;
    let c = client();
    let url = format!("{}/v1/responses", w.base_url());
    let body = json!({"model": "kvgate-sim", "instructions": long_text(), "input": "hello",
                      "max_output_tokens": 4, "ignore_eos": true});
    let (st, a) = json_call(&c, "POST", &url, Some(&body)).await;
    assert_eq!(st, 200, "{a}");
    assert!(a["id"].as_str().unwrap().starts_with("resp_"), "{a}");
    assert_eq!(a["object"], "response");
    assert_eq!(
        a["status"], "incomplete",
        "length-capped: vLLM says incomplete"
    );
    assert_eq!(a["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(
        a["store"],
        Value::Null,
        "vLLM's response object has no store field"
    );
    assert_eq!(a["output"][0]["type"], "message");
    assert_eq!(a["output"][0]["role"], "assistant");
    assert!(!a["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .is_empty());
    let u = &a["usage"];
    assert_eq!(u["output_tokens"], 4);
    let input = u["input_tokens"].as_u64().unwrap();
    assert_eq!(u["total_tokens"].as_u64().unwrap(), input + 4);
    assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        u["input_tokens_details"]["cache_write_tokens"]
            .as_u64()
            .unwrap(),
        input / 16 * 16,
        "the first request writes every full block"
    );
    let (_, b) = json_call(&c, "POST", &url, Some(&body)).await;
    assert_eq!(
        b["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        input / 16 * 16,
        "a repeat finds every full block cached"
    );
    assert_eq!(b["usage"]["input_tokens_details"]["cache_write_tokens"], 0);
    // vLLM 0.32 leaves the per-turn arrays empty for a single-turn context (real engine).
    assert_eq!(
        u["input_tokens_details"]["input_tokens_per_turn"],
        json!([])
    );
    assert_eq!(
        u["output_tokens_details"]["output_tokens_per_turn"],
        json!([])
    );
    assert_ne!(a["id"], b["id"]);
    w.shutdown().await;
}

#[tokio::test]
async fn responses_stream_events_in_vllms_order_with_sequence_numbers() {
    let w = spawn(false).await;
    let c = client();
    let body = json!({"model": "kvgate-sim", "input": [{"role": "user", "content": long_text()}],
                      "stream": true, "max_output_tokens": 5, "ignore_eos": true});
    let (st, text) = call(
        &c,
        "POST",
        &format!("{}/v1/responses", w.base_url()),
        Some(&body),
    )
    .await;
    assert_eq!(st, 200, "{text}");
    assert!(!text.contains("[DONE]"), "Responses streams have no [DONE]");
    let ev = named_events(&text);
    let n = names(&ev);
    assert_eq!(
        n[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    let deltas = n
        .iter()
        .filter(|x| **x == "response.output_text.delta")
        .count();
    assert_eq!(deltas, 5);
    assert_eq!(
        n[4 + deltas..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (_, v)) in ev.iter().enumerate() {
        assert_eq!(
            v["sequence_number"], i as u64,
            "sequence numbers count up from 0"
        );
    }
    let id = &ev[0].1["response"]["id"];
    assert_eq!(ev[0].1["response"]["status"], "in_progress");
    let done = &ev.last().unwrap().1["response"];
    assert_eq!(&done["id"], id, "one response id throughout");
    assert_eq!(done["status"], "incomplete");
    assert_eq!(done["usage"]["output_tokens"], 5);
    let text_done = ev[4 + deltas].1["text"].as_str().unwrap();
    let joined: String = ev
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text_done, joined);
    assert_eq!(done["output"][0]["content"][0]["text"], joined.as_str());
    w.shutdown().await;
}

#[tokio::test]
async fn without_the_store_env_store_is_ignored_and_chains_are_404() {
    let w = spawn(false).await;
    let c = client();
    let base = w.base_url();
    let (st, a) = json_call(
        &c,
        "POST",
        &format!("{base}/v1/responses"),
        Some(&json!({"model": "kvgate-sim", "input": "hi", "store": true, "max_output_tokens": 2})),
    )
    .await;
    assert_eq!(st, 200, "store: true is silently downgraded");
    let id = a["id"].as_str().unwrap();
    let (st, e) = json_call(&c, "GET", &format!("{base}/v1/responses/{id}"), None).await;
    assert_eq!(st, 404);
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert_eq!(
        e["error"]["message"],
        format!("Response with id '{id}' not found.")
    );
    assert_eq!(e["error"]["param"], "response_id");
    assert_eq!(e["error"]["code"], 404);
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{base}/v1/responses"),
        Some(&json!({"model": "kvgate-sim", "input": "more", "previous_response_id": id})),
    )
    .await;
    assert_eq!(st, 404, "{e}");
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{base}/v1/responses"),
        Some(&json!({"model": "kvgate-sim", "input": "x", "background": true})),
    )
    .await;
    assert_eq!(st, 400);
    assert_eq!(e["error"]["param"], "background");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("VLLM_ENABLE_RESPONSES_API_STORE=1"));
    w.shutdown().await;
}

#[tokio::test]
async fn stored_responses_live_in_their_worker_and_chains_prepend_the_history() {
    let (a, b) = (spawn(true).await, spawn(true).await);
    let c = client();
    let first = json!({"model": "kvgate-sim", "instructions": "be brief",
                       "input": long_text(), "max_output_tokens": 3, "ignore_eos": true});
    let (st, r1) = json_call(
        &c,
        "POST",
        &format!("{}/v1/responses", a.base_url()),
        Some(&first),
    )
    .await;
    assert_eq!(st, 200, "{r1}");
    let id = r1["id"].as_str().unwrap();
    let (st, got) = json_call(
        &c,
        "GET",
        &format!("{}/v1/responses/{id}", a.base_url()),
        None,
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(got, r1, "GET answers the stored response");
    let (st, e) = json_call(
        &c,
        "GET",
        &format!("{}/v1/responses/{id}", b.base_url()),
        None,
    )
    .await;
    assert_eq!(st, 404, "another worker does not know the id");
    assert_eq!(
        e["error"]["message"],
        format!("Response with id '{id}' not found.")
    );

    let next = json!({"model": "kvgate-sim", "input": "and then?", "previous_response_id": id,
                      "max_output_tokens": 3, "ignore_eos": true});
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{}/v1/responses", b.base_url()),
        Some(&next),
    )
    .await;
    assert_eq!(st, 404, "a chain landing elsewhere is a 404: {e}");
    let (st, r2) = json_call(
        &c,
        "POST",
        &format!("{}/v1/responses", a.base_url()),
        Some(&next),
    )
    .await;
    assert_eq!(st, 200, "{r2}");
    assert_eq!(r2["previous_response_id"], id);
    let p1 = r1["usage"]["input_tokens"].as_u64().unwrap();
    let p2 = r2["usage"]["input_tokens"].as_u64().unwrap();
    assert!(p2 > p1, "the history is prepended ({p2} vs {p1})");
    // Without instructions on the second turn, the history's system message is dropped (vLLM does
    // not carry instructions over), so the prefix differs from the first turn's from token 0 on;
    // the same chain sent with the same instructions shares the first turn's blocks.
    let with_instr = json!({"model": "kvgate-sim", "instructions": "be brief", "input": "and then?",
                            "previous_response_id": id, "max_output_tokens": 3, "ignore_eos": true});
    let (_, r3) = json_call(
        &c,
        "POST",
        &format!("{}/v1/responses", a.base_url()),
        Some(&with_instr),
    )
    .await;
    let cached = r3["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= p1 / 16 * 16 - 16,
        "turn 1's blocks are reused: {cached} of {p1}"
    );

    // Streaming a response that is not a background stream: 200 and an empty event stream.
    let (st, text) = call(
        &c,
        "GET",
        &format!("{}/v1/responses/{id}?stream=true", a.base_url()),
        None,
    )
    .await;
    assert_eq!((st, text.as_str()), (200, ""));
    // Another method on the path: Starlette's 405, as vLLM answers it.
    let (st, e) = json_call(
        &c,
        "PUT",
        &format!("{}/v1/responses/{id}", a.base_url()),
        None,
    )
    .await;
    assert_eq!((st, e), (405, json!({"detail": "Method Not Allowed"})));

    // Cancel: a finished response cannot be; DELETE removes it.
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{}/v1/responses/{id}/cancel", a.base_url()),
        None,
    )
    .await;
    assert_eq!(st, 400);
    assert_eq!(
        e["error"]["message"],
        "Cannot cancel a synchronous response."
    );
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{}/v1/responses/{id}/cancel", b.base_url()),
        None,
    )
    .await;
    assert_eq!(st, 404, "{e}");
    let (st, d) = json_call(
        &c,
        "DELETE",
        &format!("{}/v1/responses/{id}", a.base_url()),
        None,
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(d, json!({"id": id, "object": "response", "deleted": true}));
    let (st, _) = json_call(
        &c,
        "GET",
        &format!("{}/v1/responses/{id}", a.base_url()),
        None,
    )
    .await;
    assert_eq!(st, 404);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn background_streams_resume_after_a_sequence_number_and_cancel() {
    let w = spawn(true).await;
    let c = client();
    let base = w.base_url();
    let body = json!({"model": "kvgate-sim", "input": "go", "background": true, "stream": true,
                      "max_output_tokens": 6, "ignore_eos": true});
    let (st, text) = call(&c, "POST", &format!("{base}/v1/responses"), Some(&body)).await;
    assert_eq!(st, 200);
    let all = named_events(&text);
    assert_eq!(all.last().unwrap().0, "response.completed");
    let id = all[0].1["response"]["id"].as_str().unwrap().to_owned();
    let (st, text) = call(
        &c,
        "GET",
        &format!("{base}/v1/responses/{id}?stream=true&starting_after=3"),
        None,
    )
    .await;
    assert_eq!(st, 200);
    let tail = named_events(&text);
    assert_eq!(tail.len(), all.len() - 4);
    assert_eq!(tail[0].1["sequence_number"], 4);
    assert_eq!(tail.last().unwrap().1, all.last().unwrap().1);
    let (_, got) = json_call(&c, "GET", &format!("{base}/v1/responses/{id}"), None).await;
    assert_eq!(
        got["status"], "incomplete",
        "length-capped, stored when the stream ended"
    );
    assert_eq!(got["usage"]["output_tokens"], 6);

    // A background (non-streamed) request long enough to cancel while it runs.
    let slow = SimWorker::spawn(fast().responses_store(true).speedup(1.0), local(), None)
        .await
        .unwrap();
    let body = json!({"model": "kvgate-sim", "input": "long", "background": true,
                      "max_output_tokens": 2000, "ignore_eos": true});
    let (st, q) = json_call(
        &c,
        "POST",
        &format!("{}/v1/responses", slow.base_url()),
        Some(&body),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(q["status"], "queued");
    assert_eq!(q["background"], true);
    let id = q["id"].as_str().unwrap();
    let (st, r) = json_call(
        &c,
        "POST",
        &format!("{}/v1/responses/{id}/cancel", slow.base_url()),
        None,
    )
    .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["status"], "cancelled");
    assert!(
        eventually(PATIENCE, || slow.metrics().running == 0).await,
        "the cancelled request leaves the engine"
    );
    let (_, got) = json_call(
        &c,
        "GET",
        &format!("{}/v1/responses/{id}", slow.base_url()),
        None,
    )
    .await;
    assert_eq!(
        got["status"], "cancelled",
        "a cancelled response stays cancelled"
    );
    slow.shutdown().await;
    w.shutdown().await;
}

#[tokio::test]
async fn messages_answer_and_stream_in_vllms_shape_with_disjoint_usage() {
    let w = spawn(false).await;
    let c = client();
    let url = format!("{}/v1/messages", w.base_url());
    let body = json!({"model": "kvgate-sim", "max_tokens": 4, "ignore_eos": true,
                      "system": long_text(), "messages": [{"role": "user", "content": "hi"}]});
    let (st, a) = json_call(&c, "POST", &url, Some(&body)).await;
    assert_eq!(st, 200, "{a}");
    assert!(
        a["id"].as_str().unwrap().starts_with("chatcmpl-"),
        "vLLM reuses the chat id"
    );
    assert_eq!(a["type"], "message");
    assert_eq!(a["role"], "assistant");
    assert_eq!(a["content"][0]["type"], "text");
    assert_eq!(a["stop_reason"], "max_tokens");
    assert!(
        a.get("stop_sequence").is_none(),
        "vLLM drops null fields: {a}"
    );
    let u = &a["usage"];
    let total = u["input_tokens"].as_u64().unwrap()
        + u["cache_read_input_tokens"].as_u64().unwrap()
        + u["cache_creation_input_tokens"].as_u64().unwrap();
    assert_eq!(u["cache_read_input_tokens"], 0);
    assert_eq!(u["output_tokens"], 4);

    let mut s = body.clone();
    s["stream"] = json!(true);
    let (st, text) = call(&c, "POST", &url, Some(&s)).await;
    assert_eq!(st, 200);
    let ev = named_events(&text);
    let n = names(&ev);
    assert_eq!(n[..2], ["message_start", "content_block_start"]);
    assert!(!n.contains(&"ping"), "vLLM sends no ping");
    assert_eq!(n.iter().filter(|x| **x == "content_block_delta").count(), 4);
    assert_eq!(
        n[n.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let start = &ev[0].1["message"];
    assert_eq!(
        start["usage"],
        json!({"input_tokens": total, "output_tokens": 0})
    );
    assert_eq!(start["content"], json!([]));
    let delta = &ev[ev.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    let du = &delta["usage"];
    assert_eq!(du["output_tokens"], 4);
    assert_eq!(
        du["cache_read_input_tokens"].as_u64().unwrap(),
        total / 16 * 16,
        "the repeat reads every full block"
    );
    assert_eq!(du["cache_creation_input_tokens"], 0);
    assert_eq!(
        du["input_tokens"].as_u64().unwrap(),
        total - total / 16 * 16,
        "input_tokens excludes the cached span"
    );
    for (_, v) in &ev[2..ev.len() - 3] {
        assert_eq!(v["delta"]["type"], "text_delta");
        assert_eq!(v["index"], 0);
    }
    w.shutdown().await;
}

#[tokio::test]
async fn messages_errors_use_the_anthropic_envelope_and_count_tokens_counts() {
    let w = spawn(false).await;
    let c = client();
    let base = w.base_url();
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{base}/v1/messages"),
        Some(&json!({"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})),
    )
    .await;
    assert_eq!(st, 404);
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "NotFoundError");
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{base}/v1/messages"),
        Some(&json!({"model": "kvgate-sim", "messages": [{"role": "user", "content": "x"}]})),
    )
    .await;
    assert_eq!(st, 400, "max_tokens is required: {e}");
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{base}/v1/messages"),
        Some(&json!({"model": "kvgate-sim", "max_tokens": 100000000,
                     "messages": [{"role": "user", "content": "x"}]})),
    )
    .await;
    assert_eq!(st, 400);
    assert_eq!(e["error"]["type"], "BadRequestError");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));

    let body = json!({"model": "kvgate-sim", "system": "sys",
                      "messages": [{"role": "user", "content": long_text()}]});
    let (st, n) = json_call(
        &c,
        "POST",
        &format!("{base}/v1/messages/count_tokens"),
        Some(&body),
    )
    .await;
    assert_eq!(st, 200, "{n}");
    let count = n["input_tokens"].as_u64().unwrap();
    assert_eq!(n["context_management"]["original_input_tokens"], count);
    let (_, t) = json_call(
        &c,
        "POST",
        &format!("{base}/tokenize"),
        Some(&json!({"messages": [{"role": "system", "content": "sys"},
                                  {"role": "user", "content": long_text()}]})),
    )
    .await;
    assert_eq!(
        t["count"], count,
        "count_tokens is the chat render's length"
    );
    w.shutdown().await;
}

/// The agent APIs render to the tokens of the equivalent chat request, so they share its KV
/// blocks: a chat request after a Responses / Messages one finds every full block cached.
#[tokio::test]
async fn agent_prompts_are_the_equivalent_chat_prompt_token_for_token() {
    let w = spawn(false).await;
    let c = client();
    let base = w.base_url();
    let sys = long_text();
    let user = words("question", 30);
    let chat = json!({"model": "kvgate-sim", "max_tokens": 2, "ignore_eos": true,
                      "messages": [{"role": "system", "content": sys}, {"role": "user", "content": user}]});
    let chat_url = format!("{base}/v1/chat/completions");

    let (st, r) = json_call(
        &c,
        "POST",
        &format!("{base}/v1/responses"),
        Some(
            &json!({"model": "kvgate-sim", "instructions": sys, "max_output_tokens": 2,
                     "ignore_eos": true,
                     "input": [{"type": "message", "role": "user",
                                "content": [{"type": "input_text", "text": user}]}]}),
        ),
    )
    .await;
    assert_eq!(st, 200, "{r}");
    let p = r["usage"]["input_tokens"].as_u64().unwrap();
    let (_, ch) = json_call(&c, "POST", &chat_url, Some(&chat)).await;
    assert_eq!(
        ch["usage"]["prompt_tokens"], p,
        "same prompt length as chat"
    );
    assert_eq!(
        ch["usage"]["prompt_tokens_details"]["cached_tokens"],
        p / 16 * 16,
        "chat finds all the blocks the Responses request wrote"
    );

    // Messages, with Claude Code's per-request billing header (vLLM drops it): a fresh worker so
    // the blocks come from the Messages request alone.
    let w2 = spawn(false).await;
    let base2 = w2.base_url();
    let msg = |cch: &str| {
        json!({"model": "kvgate-sim", "max_tokens": 2, "ignore_eos": true,
               "system": [{"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.1.90; cc_entrypoint=cli; cch={cch};")},
                          {"type": "text", "text": sys}],
               "messages": [{"role": "user", "content": [{"type": "text", "text": user}]}]})
    };
    let (st, m1) = json_call(
        &c,
        "POST",
        &format!("{base2}/v1/messages"),
        Some(&msg("a1b2c")),
    )
    .await;
    assert_eq!(st, 200, "{m1}");
    let u = &m1["usage"];
    let p1 = u["input_tokens"].as_u64().unwrap()
        + u["cache_read_input_tokens"].as_u64().unwrap()
        + u["cache_creation_input_tokens"].as_u64().unwrap();
    assert_eq!(p1, p, "the billing header is not rendered");
    let (_, m2) = json_call(
        &c,
        "POST",
        &format!("{base2}/v1/messages"),
        Some(&msg("ffff0")),
    )
    .await;
    assert_eq!(
        m2["usage"]["cache_read_input_tokens"],
        p / 16 * 16,
        "another billing header still hits every block"
    );
    let (_, ch) = json_call(
        &c,
        "POST",
        &format!("{base2}/v1/chat/completions"),
        Some(&chat),
    )
    .await;
    assert_eq!(
        ch["usage"]["prompt_tokens_details"]["cached_tokens"],
        p / 16 * 16
    );
    w.shutdown().await;
    w2.shutdown().await;
}

#[tokio::test]
async fn utility_and_pooling_endpoints_answer_in_vllms_shapes() {
    let w = spawn(false).await;
    let c = client();
    let base = w.base_url();
    // The default tokenizer is a hash (not invertible): detokenize answers its decode of the ids,
    // the same on both paths; a HuggingFace tokenizer (--tokenizer) round-trips.
    let mut seen = Vec::new();
    for path in ["/tokenize", "/v1/tokenize"] {
        let (st, t) = json_call(
            &c,
            "POST",
            &format!("{base}{path}"),
            Some(&json!({"prompt": "hello world"})),
        )
        .await;
        assert_eq!(st, 200);
        assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
        let (st, d) = json_call(
            &c,
            "POST",
            &format!("{base}{}", path.replace("tokenize", "detokenize")),
            Some(&json!({"tokens": t["tokens"]})),
        )
        .await;
        assert_eq!(st, 200, "{d}");
        assert_eq!(d.as_object().unwrap().len(), 1, "{d}");
        assert!(!d["prompt"].as_str().unwrap().is_empty());
        seen.push(d);
    }
    assert_eq!(seen[0], seen[1]);
    let (st, _) = json_call(
        &c,
        "POST",
        &format!("{base}/detokenize"),
        Some(&json!({"tokens": [-1]})),
    )
    .await;
    assert_eq!(st, 400);

    let rerank = json!({"model": "kvgate-sim", "query": "red apple pie",
                        "documents": ["blue sky", "red apple pie recipe", "apple"], "top_n": 2});
    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let (st, r) = json_call(&c, "POST", &format!("{base}{path}"), Some(&rerank)).await;
        assert_eq!(st, 200, "{r}");
        let res = r["results"].as_array().unwrap();
        assert_eq!(res.len(), 2, "top_n");
        assert_eq!(res[0]["index"], 1, "the closest document first");
        assert_eq!(res[0]["document"]["text"], "red apple pie recipe");
        assert!(res[0]["relevance_score"].as_f64() >= res[1]["relevance_score"].as_f64());
        assert!(r["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    }
    for path in ["/score", "/v1/score"] {
        let (st, s) = json_call(
            &c,
            "POST",
            &format!("{base}{path}"),
            Some(&json!({"queries": "a b c", "documents": ["a b c", "x y z"]})),
        )
        .await;
        assert_eq!(st, 200, "{s}");
        assert_eq!(s["object"], "list");
        assert_eq!(s["data"][0]["object"], "score");
        assert_eq!(s["data"][0]["score"], 1.0);
        assert_eq!(s["data"][1]["score"], 0.0);
    }
    let (st, e) = json_call(
        &c,
        "POST",
        &format!("{base}/score"),
        Some(&json!({"queries": ["a", "b"], "documents": ["a", "b", "c"]})),
    )
    .await;
    assert_eq!(st, 400, "{e}");
    for path in ["/classify", "/v1/classify"] {
        let (st, r) = json_call(
            &c,
            "POST",
            &format!("{base}{path}"),
            Some(&json!({"input": ["one", "two"]})),
        )
        .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["data"].as_array().unwrap().len(), 2);
        let probs = r["data"][0]["probs"].as_array().unwrap();
        let sum: f64 = probs.iter().map(|p| p.as_f64().unwrap()).sum();
        assert!((sum - 1.0).abs() < 1e-9);
        assert_eq!(r["data"][0]["num_classes"], 2);
    }
    let (st, p) = json_call(
        &c,
        "POST",
        &format!("{base}/pooling"),
        Some(&json!({"input": "hello"})),
    )
    .await;
    assert_eq!(st, 200, "{p}");
    assert_eq!(p["data"][0]["object"], "pooling");
    assert_eq!(p["data"][0]["data"].as_array().unwrap().len(), 8);
    let (_, p2) = json_call(
        &c,
        "POST",
        &format!("{base}/pooling"),
        Some(&json!({"input": "hello"})),
    )
    .await;
    assert_eq!(p["data"], p2["data"], "deterministic");
    w.shutdown().await;
}

#[test]
fn the_store_env_var_reads_like_vllm() {
    use kvgate_sim::cli::responses_store_from_env as env;
    assert!(!env(None).unwrap());
    assert!(!env(Some("0")).unwrap());
    assert!(env(Some("1")).unwrap());
    assert!(env(Some("true")).is_err(), "vLLM's int() refuses it too");
}
