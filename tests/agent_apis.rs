//! The agent-client APIs through `kvgate serve` (issue 30), against scripted workers that answer
//! `/v1/responses` and `/v1/messages` the way vLLM does, including its per-process response store
//! (a `previous_response_id` or `GET /v1/responses/{id}` reaching another worker gets 404):
//! routing (prefix, session, pinning), each API's error shape, shedding (429 / 529), header
//! forwarding and API keys over `x-api-key`.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvgate_system_tests::{exchange_raw, Gateway, RawResponse};
use serde_json::{json, Value};

const MODEL: &str = "agent-model";

/// What one scripted worker saw: (method, path, headers lower-cased, body).
type Seen = Arc<Mutex<Vec<(String, String, Vec<(String, String)>, Vec<u8>)>>>;

struct AgentWorker {
    addr: SocketAddr,
    seen: Seen,
    dead: Arc<AtomicBool>,
    /// Bodies containing `SLOW` are answered 6 s late; counted here when they arrive.
    slow_started: Arc<AtomicUsize>,
}

impl AgentWorker {
    fn spawn(n: usize) -> AgentWorker {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().unwrap();
        let seen: Seen = Default::default();
        let dead = Arc::new(AtomicBool::new(false));
        let slow_started = Arc::new(AtomicUsize::new(0));
        let store: Arc<Mutex<HashSet<String>>> = Default::default();
        let counter = Arc::new(AtomicUsize::new(0));
        let (s2, d2, sl2) = (seen.clone(), dead.clone(), slow_started.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if d2.load(Ordering::SeqCst) {
                    // Killed: stop accepting (the listener closes, connects are refused).
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (seen, store, counter, sl, dead) = (
                    s2.clone(),
                    store.clone(),
                    counter.clone(),
                    sl2.clone(),
                    d2.clone(),
                );
                std::thread::spawn(move || serve_conn(n, conn, seen, store, counter, sl, dead));
            }
        });
        AgentWorker {
            addr,
            seen,
            dead,
            slow_started,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stop accepting connections (the listener goes away with the accept thread).
    fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag and drops the listener.
        let _ = TcpStream::connect(self.addr);
    }

    fn served(&self, path_prefix: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p, _, _)| p.starts_with(path_prefix))
            .count()
    }
}

fn serve_conn(
    n: usize,
    conn: TcpStream,
    seen: Seen,
    store: Arc<Mutex<HashSet<String>>>,
    counter: Arc<AtomicUsize>,
    slow: Arc<AtomicUsize>,
    dead: Arc<AtomicBool>,
) {
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let mut w = conn;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, target) = (
            parts.next().unwrap_or("").to_owned(),
            parts.next().unwrap_or("").to_owned(),
        );
        let mut headers = Vec::new();
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_owned());
                if k == "content-length" {
                    len = v.parse().unwrap_or(0);
                }
                headers.push((k, v));
            }
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        if dead.load(Ordering::SeqCst) {
            // A killed process: open connections die with it, unanswered.
            return;
        }
        let path = target.split('?').next().unwrap_or("").to_owned();
        seen.lock().unwrap().push((
            method.clone(),
            target.clone(),
            headers.clone(),
            body.clone(),
        ));
        let j: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if String::from_utf8_lossy(&body).contains("SLOW") {
            slow.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_secs(6));
        }
        let version = headers
            .iter()
            .find(|(k, _)| k == "anthropic-version")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let (status, ctype, out): (u16, &str, String) = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => (200, "application/json", "{}".into()),
            ("GET", "/v1/models") => (
                200,
                "application/json",
                json!({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).to_string(),
            ),
            ("POST", "/v1/responses") => {
                let prev = j["previous_response_id"].as_str();
                if prev.is_some_and(|p| !store.lock().unwrap().contains(p)) {
                    not_found(prev.unwrap())
                } else {
                    let id = format!("resp_w{n}_{}", counter.fetch_add(1, Ordering::SeqCst));
                    if j["store"].as_bool() != Some(false) {
                        store.lock().unwrap().insert(id.clone());
                    }
                    let usage = json!({"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32},
                        "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 42});
                    if j["stream"].as_bool() == Some(true) {
                        let mut s = String::new();
                        let ev = |s: &mut String, name: &str, data: Value| {
                            s.push_str(&format!("event: {name}\ndata: {data}\n\n"))
                        };
                        ev(
                            &mut s,
                            "response.created",
                            json!({"type": "response.created", "sequence_number": 0,
                            "response": {"id": id, "object": "response", "status": "in_progress", "output": []}}),
                        );
                        ev(
                            &mut s,
                            "response.output_text.delta",
                            json!({"type": "response.output_text.delta", "sequence_number": 1, "delta": "Hi"}),
                        );
                        ev(
                            &mut s,
                            "response.output_text.delta",
                            json!({"type": "response.output_text.delta", "sequence_number": 2, "delta": "!"}),
                        );
                        ev(
                            &mut s,
                            "response.completed",
                            json!({"type": "response.completed", "sequence_number": 3,
                            "response": {"id": id, "object": "response", "status": "completed",
                                "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]}],
                                "usage": usage}}),
                        );
                        (200, "text/event-stream", s)
                    } else {
                        (200, "application/json", json!({"id": id, "object": "response", "status": "completed",
                            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]}],
                            "usage": usage}).to_string())
                    }
                }
            }
            (m, p) if p.starts_with("/v1/responses/") => {
                let id = p["/v1/responses/".len()..]
                    .split('/')
                    .next()
                    .unwrap_or("")
                    .to_owned();
                let known = store.lock().unwrap().contains(&id);
                match (m, known) {
                    (_, false) => not_found(&id),
                    ("DELETE", true) => {
                        store.lock().unwrap().remove(&id);
                        (
                            200,
                            "application/json",
                            json!({"id": id, "object": "response", "deleted": true}).to_string(),
                        )
                    }
                    _ => (
                        200,
                        "application/json",
                        json!({"id": id, "object": "response", "status": "completed"}).to_string(),
                    ),
                }
            }
            ("POST", "/v1/messages") => {
                let usage = json!({"input_tokens": 8, "output_tokens": 2, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0});
                if j["stream"].as_bool() == Some(true) {
                    let mut s = String::new();
                    let ev = |s: &mut String, name: &str, data: Value| {
                        s.push_str(&format!("event: {name}\ndata: {data}\n\n"))
                    };
                    ev(
                        &mut s,
                        "message_start",
                        json!({"type": "message_start", "message": {"id": format!("msg_w{n}"),
                        "type": "message", "role": "assistant", "model": MODEL, "content": [], "stop_reason": null,
                        "usage": {"input_tokens": 8, "output_tokens": 1}}}),
                    );
                    ev(
                        &mut s,
                        "content_block_start",
                        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                    );
                    ev(
                        &mut s,
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
                    );
                    ev(
                        &mut s,
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": 0}),
                    );
                    ev(
                        &mut s,
                        "message_delta",
                        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                        "usage": {"output_tokens": 2, "cache_read_input_tokens": 32}}),
                    );
                    ev(&mut s, "message_stop", json!({"type": "message_stop"}));
                    (200, "text/event-stream", s)
                } else {
                    (200, "application/json", json!({"id": format!("msg_w{n}"), "type": "message", "role": "assistant",
                        "model": MODEL, "content": [{"type": "text", "text": "Hello"}], "stop_reason": "end_turn",
                        "stop_sequence": null, "usage": usage}).to_string())
                }
            }
            ("POST", "/v1/messages/count_tokens") => (
                200,
                "application/json",
                json!({"input_tokens": 7}).to_string(),
            ),
            ("POST", p) => (
                200,
                "application/json",
                json!({"worker": n, "path": p}).to_string(),
            ),
            _ => (
                404,
                "application/json",
                json!({"error": {"message": "no route", "type": "NotFound"}}).to_string(),
            ),
        };
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nx-worker: {n}\r\nx-seen-anthropic-version: {version}\r\n\r\n",
            out.len()
        );
        if w.write_all(head.as_bytes())
            .and_then(|_| w.write_all(out.as_bytes()))
            .is_err()
        {
            return;
        }
    }
}

/// vLLM's answer for an id it does not hold.
fn not_found(id: &str) -> (u16, &'static str, String) {
    (
        404,
        "application/json",
        json!({"error": {"message": format!("Response with id '{id}' not found."),
            "type": "invalid_request_error", "param": null, "code": null}})
        .to_string(),
    )
}

/// A shed request as each SDK reports it.
const SHED_SCRIPT: &str = r#"
import json, sys, openai, anthropic
base, M = sys.argv[1], sys.argv[2]
print("ready", flush=True)
sys.stdin.readline()
out = {}
an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
try:
    an.messages.create(model=M, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    out["anthropic"] = "no error"
except anthropic.APIStatusError as e:
    out["anthropic"] = {"status": e.status_code, "type": e.body["error"]["type"], "class": type(e).__name__}
oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
try:
    oa.responses.create(model=M, input="hi")
    out["openai"] = "no error"
except openai.APIStatusError as e:
    out["openai"] = {"status": e.status_code, "class": type(e).__name__}
print(json.dumps(out))
"#;

fn workers(n: usize) -> Vec<AgentWorker> {
    (0..n).map(AgentWorker::spawn).collect()
}

/// `kvgate serve` in front of the three workers; `routing`: extra `[routing]` keys; `extra`:
/// more tables.
fn gateway(ws: &[AgentWorker], routing: &str, extra: &str) -> Gateway {
    let urls: Vec<String> = ws.iter().map(|w| format!("\"{}\"", w.url())).collect();
    let config = format!(
        r#"
[server]
listen = "127.0.0.1:0"
request_log = false
[routing]
policy = "kv"
{routing}
[upstream]
health_interval_ms = 200
monitor = false
{extra}
[[workers]]
url = {}
models = ["{MODEL}"]
[[workers]]
url = {}
models = ["{MODEL}"]
[[workers]]
url = {}
models = ["{MODEL}"]
"#,
        urls[0], urls[1], urls[2]
    );
    Gateway::from_config(&config)
}

fn send(
    gw: &Gateway,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> RawResponse {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    let (mut rs, _) = exchange_raw(gw.addr, req.as_bytes(), Duration::from_secs(20));
    assert!(!rs.is_empty(), "no response to {method} {path}");
    rs.remove(0)
}

fn worker_of(r: &RawResponse) -> String {
    r.header("x-worker").unwrap_or("?").to_owned()
}

fn json_of(r: &RawResponse) -> Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body_text()))
}

/// The id of a Responses reply, streamed or not.
fn response_id(r: &RawResponse) -> String {
    if r.header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        let text = r.body_text();
        let line = text
            .lines()
            .find(|l| l.starts_with("data: ") && l.contains("response.created"))
            .expect("response.created");
        let v: Value = serde_json::from_str(&line[6..]).unwrap();
        v["response"]["id"].as_str().unwrap().to_owned()
    } else {
        json_of(r)["id"].as_str().unwrap().to_owned()
    }
}

#[test]
fn chained_responses_stay_on_their_origin_and_a_dead_origin_is_a_final_404() {
    let ws = workers(3);
    let gw = gateway(&ws, "", "");
    // 12 conversations of 4 turns, streamed and not: no follow-up may reach a worker without
    // the previous response (those answer 404).
    let mut last_ids = Vec::new();
    for conv in 0..12 {
        let mut prev: Option<String> = None;
        for turn in 0..4 {
            let stream = (conv + turn) % 2 == 0;
            let mut body = json!({"model": MODEL, "input": format!("conversation {conv} turn {turn}"),
                "stream": stream, "store": true});
            if let Some(p) = &prev {
                body["previous_response_id"] = json!(p);
            }
            let r = send(&gw, "POST", "/v1/responses", &[], &body.to_string());
            assert_eq!(r.status, 200, "conv {conv} turn {turn}: {}", r.body_text());
            if stream {
                let text = r.body_text();
                // Relayed byte for byte: the event lines are there.
                assert!(text.contains("event: response.created\n"), "{text}");
                assert!(text.contains("event: response.completed\n"), "{text}");
            }
            let id = response_id(&r);
            if let Some(p) = &prev {
                // The origin answered: its ids carry its number.
                assert_eq!(id.split('_').nth(1), p.split('_').nth(1), "{p} -> {id}");
            }
            prev = Some(id);
        }
        last_ids.push(prev.unwrap());
    }
    // Retrieve and delete go to the origin too.
    let id = &last_ids[0];
    let r = send(&gw, "GET", &format!("/v1/responses/{id}"), &[], "");
    assert_eq!(r.status, 200, "{}", r.body_text());
    let r = send(
        &gw,
        "GET",
        &format!("/v1/responses/{id}?stream=true&starting_after=1"),
        &[],
        "",
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let r = send(&gw, "DELETE", &format!("/v1/responses/{id}"), &[], "");
    assert_eq!(r.status, 200, "{}", r.body_text());
    // An id kvgate never saw: the backend's 404, final.
    let r = send(&gw, "GET", "/v1/responses/resp_unknown", &[], "");
    assert_eq!(r.status, 404);
    assert_eq!(r.header("x-should-retry"), Some("false"));
    assert!(r.is_openai_error(), "{}", r.body_text());
    let r = send(
        &gw,
        "POST",
        "/v1/responses",
        &[],
        &json!({"model": MODEL, "input": "x", "previous_response_id": "resp_unknown"}).to_string(),
    );
    assert_eq!(r.status, 404);
    assert_eq!(json_of(&r)["error"]["param"], "previous_response_id");

    // Kill the origin of one conversation: its ids answer 404 (not retried on another worker),
    // the other workers' ids still work.
    let victim_id = last_ids[1].clone();
    let victim: usize = victim_id.split('_').nth(1).unwrap()[1..].parse().unwrap();
    // (last_ids[0] was deleted above.)
    let other_id = last_ids[1..]
        .iter()
        .find(|i| !i.starts_with(&format!("resp_w{victim}_")))
        .expect("conversations on more than one worker")
        .clone();
    let before: Vec<usize> = ws.iter().map(|w| w.served("/v1/responses")).collect();
    ws[victim].kill();
    let r = send(
        &gw,
        "POST",
        "/v1/responses",
        &[],
        &json!({"model": MODEL, "input": "next", "previous_response_id": victim_id}).to_string(),
    );
    assert_eq!(r.status, 404, "{}", r.body_text());
    assert_eq!(r.header("x-should-retry"), Some("false"));
    let after: Vec<usize> = ws.iter().map(|w| w.served("/v1/responses")).collect();
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        if i != victim {
            assert_eq!(b, a, "worker {i} got the dead origin's follow-up");
        }
    }
    let r = send(
        &gw,
        "POST",
        "/v1/responses",
        &[],
        &json!({"model": MODEL, "input": "next", "previous_response_id": other_id}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
}

#[test]
fn messages_route_by_prefix_without_the_billing_header_and_keep_their_contract() {
    let ws = workers(3);
    let gw = gateway(&ws, "", "[[auth.keys]]\nkey = \"sk-test\"\n");
    let system = "You are a careful coding agent. ".repeat(60);
    let mut served = HashSet::new();
    for i in 0..6 {
        let body = json!({"model": MODEL, "max_tokens": 16, "stream": i % 2 == 0,
            "system": [
                {"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.1.90; cc_entrypoint=cli; cch={i:05x};")},
                {"type": "text", "text": system}
            ],
            "messages": [{"role": "user", "content": format!("question number {i}")}]});
        let r = send(
            &gw,
            "POST",
            "/v1/messages?beta=true",
            &[
                ("x-api-key", "sk-test"),
                ("anthropic-version", "2023-06-01"),
                ("anthropic-beta", "tools-2024"),
            ],
            &body.to_string(),
        );
        assert_eq!(r.status, 200, "{}", r.body_text());
        assert_eq!(r.header("x-seen-anthropic-version"), Some("2023-06-01"));
        if i % 2 == 0 {
            let text = r.body_text();
            assert!(text.starts_with("event: message_start\n"), "{text}");
            assert!(text.contains("event: content_block_delta\n"), "{text}");
        }
        served.insert(worker_of(&r));
    }
    // One shared prefix: one worker, whatever the per-request billing hash.
    assert_eq!(served.len(), 1, "{served:?}");
    // The beta header went through unchanged; the client's key did not.
    let seen = ws
        .iter()
        .flat_map(|w| w.seen.lock().unwrap().clone())
        .collect::<Vec<_>>();
    let msg = seen
        .iter()
        .find(|(_, p, _, _)| p.starts_with("/v1/messages"))
        .unwrap();
    assert!(msg
        .2
        .iter()
        .any(|(k, v)| k == "anthropic-beta" && v == "tools-2024"));
    assert!(!msg.2.iter().any(|(k, _)| k == "x-api-key"));
    assert_eq!(msg.1, "/v1/messages?beta=true");

    // Bearer works as well; no key is Anthropic's 401.
    let ok =
        json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    assert_eq!(
        send(
            &gw,
            "POST",
            "/v1/messages",
            &[("authorization", "Bearer sk-test")],
            &ok
        )
        .status,
        200
    );
    let r = send(&gw, "POST", "/v1/messages", &[], &ok);
    assert_eq!(r.status, 401);
    assert_eq!(json_of(&r)["error"]["type"], "authentication_error");

    // Bad bodies: 400 in each API's own shape.
    let r = send(
        &gw,
        "POST",
        "/v1/messages",
        &[("x-api-key", "sk-test")],
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "no max_tokens"}]})
            .to_string(),
    );
    assert_eq!(r.status, 400);
    let j = json_of(&r);
    assert_eq!(
        (j["type"].as_str(), j["error"]["type"].as_str()),
        (Some("error"), Some("invalid_request_error")),
        "{j}"
    );
    let r = send(
        &gw,
        "POST",
        "/v1/responses",
        &[("x-api-key", "sk-test")],
        &json!({"model": MODEL}).to_string(),
    );
    assert_eq!(r.status, 400);
    assert!(r.is_openai_error(), "{}", r.body_text());
    assert_eq!(json_of(&r)["error"]["param"], "input");

    // count_tokens and the pass-through endpoints are routed by model.
    let r = send(
        &gw,
        "POST",
        "/v1/messages/count_tokens",
        &[("x-api-key", "sk-test")],
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}).to_string(),
    );
    assert_eq!(json_of(&r)["input_tokens"], 7, "{}", r.body_text());
    for path in [
        "/v1/rerank",
        "/v2/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/classify",
        "/v1/classify",
        "/pooling",
        "/tokenize",
        "/detokenize",
        "/v1/tokenize",
        "/v1/detokenize",
    ] {
        let r = send(
            &gw,
            "POST",
            path,
            &[("x-api-key", "sk-test")],
            &json!({"model": MODEL, "query": "q", "documents": ["a"]}).to_string(),
        );
        assert_eq!(r.status, 200, "{path}: {}", r.body_text());
        assert_eq!(json_of(&r)["path"], path);
    }
    // `model` may be left out when one model is served (vLLM's /tokenize).
    let r = send(
        &gw,
        "POST",
        "/tokenize",
        &[("x-api-key", "sk-test")],
        r#"{"prompt":"hi"}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
}

#[test]
fn sessions_stick_to_their_worker_and_shed_requests_get_each_apis_status() {
    let ws = workers(3);
    let gw = gateway(&ws, "", "");
    // Different prompts of one session (header), spread by content otherwise: one worker.
    let mut served = HashSet::new();
    for i in 0..8 {
        let text = format!("{i} unrelated prompt text {} ", i * 7919).repeat(12);
        let r = send(
            &gw,
            "POST",
            "/v1/responses",
            &[("x-claude-code-session-id", "sess-1")],
            &json!({"model": MODEL, "input": text, "store": false}).to_string(),
        );
        assert_eq!(r.status, 200, "{}", r.body_text());
        served.insert(worker_of(&r));
    }
    assert_eq!(served.len(), 1, "{served:?}");
    drop(gw);

    // Shedding: every worker takes one request at a time and the queue holds none.
    let gw = gateway(
        &ws,
        "max_inflight_per_worker = 1",
        "[admission]\nqueue_size = 0\n",
    );
    let gw_addr = gw.addr;
    // The SDK script starts first (importing the SDKs takes seconds here) and waits for a line.
    let sdk = kvgate_system_tests::python_with("openai, anthropic").map(|py| {
        let mut child = std::process::Command::new(&py)
            .args(["-c", SHED_SCRIPT, &format!("http://{gw_addr}"), MODEL])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python runs");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut ready = String::new();
        out.read_line(&mut ready).unwrap();
        assert_eq!(ready.trim(), "ready", "the SDK script starts");
        (kvgate_testkit::ChildGuard(child), out)
    });
    let slow = || {
        ws.iter()
            .map(|w| w.slow_started.load(Ordering::SeqCst))
            .sum::<usize>()
    };
    let mut holders = Vec::new();
    for i in 0..3 {
        let before = slow();
        holders.push(std::thread::spawn(move || {
            let body = json!({"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": format!("SLOW {i}")}]}).to_string();
            let req = format!("POST /v1/messages HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
            exchange_raw(gw_addr, req.as_bytes(), Duration::from_secs(20)).0
        }));
        kvgate_testkit::poll_until_blocking(
            Duration::from_secs(10),
            "a slow request reaches a worker",
            || slow() > before,
        );
    }
    let ok =
        json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    let r = send(&gw, "POST", "/v1/messages", &[], &ok);
    assert_eq!(r.status, 529, "{}", r.body_text());
    assert!(r.header("retry-after").is_some());
    assert_eq!(json_of(&r)["error"]["type"], "overloaded_error");
    let r = send(
        &gw,
        "POST",
        "/v1/responses",
        &[],
        &json!({"model": MODEL, "input": "hi"}).to_string(),
    );
    assert_eq!(r.status, 429, "{}", r.body_text());
    assert!(r.is_openai_error());
    // As the official SDKs see it (no retries: a retry would wait for the slow requests).
    if let Some((mut child, mut out)) = sdk {
        use std::io::Write as _;
        child.0.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let status = child.0.wait().unwrap();
        assert!(status.success(), "shed script failed: {line}");
        let j: Value = serde_json::from_str(&line).expect("json from script");
        assert_eq!(j["anthropic"]["status"], 529, "{j}");
        assert_eq!(j["anthropic"]["type"], "overloaded_error", "{j}");
        assert_eq!(j["openai"]["status"], 429, "{j}");
        assert_eq!(j["openai"]["class"], "RateLimitError", "{j}");
    }
    for h in holders {
        let rs = h.join().unwrap();
        assert_eq!(rs.first().map(|r| r.status), Some(200));
    }
}
