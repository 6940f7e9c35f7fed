//! Distributed tracing end to end (docs/tracing.md): `kvgate serve` with `[tracing]` in front of a
//! `kvgate sim --otlp-traces-endpoint`, both exporting to a test collector that decodes OTLP with
//! the OpenTelemetry project's own protobuf definitions (`tests/support/otlp_collector.py`, PyPI
//! `opentelemetry-proto` + `grpcio`, from $KVGATE_PYTHON). Asserts the span tree (parents, kinds,
//! attributes), that the engine's span and the `traceparent` the sim received belong to the
//! router's trace under the attempt's span, OTLP/HTTP and OTLP/gRPC, parent-based and
//! error sampling, and that a collector that is down costs requests nothing (spans counted as
//! failed or dropped). Skipped locally without the Python packages; a failure in CI.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use kvgate_system_tests::harness::{
    http, repo_root, sample, serving_addr, start_sim_with, tool_missing, try_http_with, Proc,
};
use kvgate_testkit::poll::poll_for_blocking;
use serde_json::Value;

const MODEL: &str = "trace-model";
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn python() -> Option<String> {
    let py = std::env::var("KVGATE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args([
            "-c",
            "import grpc, opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    tool_missing(&format!(
        "{py} cannot import grpc and opentelemetry.proto (pip install opentelemetry-proto grpcio; set KVGATE_PYTHON)"
    ));
    None
}

/// The collector process and its ports (`tls`: also OTLP/HTTP and OTLP/gRPC over TLS).
struct Collector {
    _proc: Proc,
    http: SocketAddr,
    grpc: SocketAddr,
    tls: Option<(SocketAddr, SocketAddr)>,
}

/// A CA certificate that signed nothing the tests serve (a self-signed EC certificate, CN
/// `kvgate-test-other-ca`): trusting only it, the collector's certificate must be refused.
const OTHER_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBljCCATugAwIBAgIUPP+SuuGD6bSQy0AlLUVAU3WWv/8wCgYIKoZIzj0EAwIw
HzEdMBsGA1UEAwwUa3ZnYXRlLXRlc3Qtb3RoZXItY2EwIBcNMjYxMTI3MTIxOTQw
WhgPMjEyNjExMDMxMjE5NDBaMB8xHTAbBgNVBAMMFGt2Z2F0ZS10ZXN0LW90aGVy
LWNhMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEZuy5YO14xtJlh8WtEiIQ4VNU
2zbvmNsoEcKjEjpqMnORjrum9piNnD7HL759L5vvSiTqbfOxSmBlufEADO4tVqNT
MFEwHQYDVR0OBBYEFMDTpzKqY7TBLsnHWqfzqc73krA6MB8GA1UdIwQYMBaAFMDT
pzKqY7TBLsnHWqfzqc73krA6MA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwID
SQAwRgIhAMqyuoj38Im6/LCsI8HTDu4kKgaflBgr0wZxQWOTqx9SAiEA6GvXTG1O
pHn8AblxBJ+KtXMsR0PQe0L4Pd4gs/h49kI=
-----END CERTIFICATE-----
";

/// The self-signed certificate (CN and SAN `localhost`, `127.0.0.1`) and key the gateway's TLS
/// tests use.
fn cert_fixture(name: &str) -> std::path::PathBuf {
    repo_root()
        .join("crates/kvgate-gateway/tests/fixtures")
        .join(name)
}

impl Collector {
    fn start(py: &str) -> Collector {
        Self::spawn(py, false)
    }

    /// With TLS listeners too, serving the certificate fixture.
    fn start_tls(py: &str) -> Collector {
        Self::spawn(py, true)
    }

    fn spawn(py: &str, tls: bool) -> Collector {
        let mut cmd = Command::new(py);
        cmd.arg(repo_root().join("tests/support/otlp_collector.py"));
        if tls {
            cmd.arg("--tls")
                .arg(cert_fixture("cert.pem"))
                .arg(cert_fixture("key.pem"));
        }
        let mut p = Proc::spawn("otlp collector", cmd);
        let ports = p.wait_for(Duration::from_secs(30), |l| {
            let port = |key: &str| {
                let i = l.find(key)? + key.len();
                l[i..].split_whitespace().next()?.parse::<u16>().ok()
            };
            let secure = if tls {
                Some((port("https=")?, port("grpcs=")?))
            } else {
                None
            };
            Some((port("http=")?, port("grpc=")?, secure))
        });
        let at = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        Collector {
            _proc: p,
            http: at(ports.0),
            grpc: at(ports.1),
            tls: ports.2.map(|(h, g)| (at(h), at(g))),
        }
    }

    fn spans(&self) -> Vec<Value> {
        let (status, body) = http(self.http, "GET", "/spans", None);
        assert_eq!(status, 200);
        let v: Value = serde_json::from_str(&body).expect("collector JSON");
        v["spans"].as_array().cloned().unwrap_or_default()
    }

    /// The spans of `trace_id` once `want` of them have arrived.
    fn trace(&self, trace_id: &str, want: usize) -> Vec<Value> {
        poll_for_blocking(
            Duration::from_secs(20),
            format!("{want} spans of trace {trace_id}"),
            || {
                let s: Vec<Value> = self
                    .spans()
                    .into_iter()
                    .filter(|s| s["trace_id"] == trace_id)
                    .collect();
                (s.len() >= want).then_some(s)
            },
        )
    }
}

fn gateway(worker: SocketAddr, tracing: &str) -> (Proc, SocketAddr, tempfile::TempDir) {
    let url = format!("http://{worker}");
    gateway_with(&format!("[tracing]\n{tracing}\n"), &["--worker", &url])
}

fn gateway_with(config: &str, workers: &[&str]) -> (Proc, SocketAddr, tempfile::TempDir) {
    gateway_policy(config, "round_robin", workers)
}

fn gateway_policy(
    config: &str,
    policy: &str,
    workers: &[&str],
) -> (Proc, SocketAddr, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("kvgate.toml");
    std::fs::write(&cfg, config).expect("config");
    let cfg = cfg.to_string_lossy().into_owned();
    let mut args = vec![
        "serve",
        "--config",
        &cfg,
        "--listen",
        "127.0.0.1:0",
        "--model",
        MODEL,
        "--policy",
        policy,
        "--log",
        "info",
    ];
    args.extend_from_slice(workers);
    let mut gw = Proc::kvgate("kvgate serve", &args);
    let addr = gw.wait_for(Duration::from_secs(20), serving_addr);
    (gw, addr, dir)
}

fn chat(gw: SocketAddr, headers: &str, stream: bool) -> (u16, String) {
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"tell me about tracing please"}}],"max_tokens":6,"stream":{stream}}}"#
    );
    try_http_with(gw, "POST", "/v1/chat/completions", headers, Some(&body)).expect("chat")
}

fn by_name<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

fn one<'a>(spans: &'a [Value], name: &str) -> &'a Value {
    let v = by_name(spans, name);
    assert_eq!(v.len(), 1, "one {name} span in {spans:#?}");
    v[0]
}

fn metric(gw: SocketAddr, name: &str) -> f64 {
    let (_, text) = http(gw, "GET", "/metrics", None);
    sample(&text, name).unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

fn sim_traceparents(sim: SocketAddr) -> Vec<String> {
    let (status, body) = http(sim, "GET", "/sim/traceparents", None);
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("json");
    v["traceparents"]
        .as_array()
        .expect("list")
        .iter()
        .map(|t| t.as_str().expect("string").to_owned())
        .collect()
}

#[test]
fn one_trace_from_client_through_router_to_engine_over_otlp_http_and_grpc() {
    let Some(py) = python() else { return };
    let col = Collector::start(&py);
    let endpoint = format!("http://{}", col.http);
    let (_sim, sim) = start_sim_with(MODEL, &["--otlp-traces-endpoint", &endpoint]);
    let (_gw, gw, dir) = gateway(
        sim,
        &format!("otlp_endpoint = \"{endpoint}\"\nbatch_delay_ms = 50\nsample_ratio = 0.0"),
    );

    // A sampled client trace, with tracestate and baggage to pass on.
    let tp = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let headers = format!(
        "traceparent: {tp}\r\ntracestate: vendor=opaque\r\nbaggage: user=alice\r\nx-request-id: req-42\r\n"
    );
    let (status, body) = chat(gw, &headers, true);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("[DONE]"), "{body}");

    // Router: request (server) ← tokenize, route, upstream (client); engine: llm_request under
    // the upstream attempt.
    let spans = col.trace(CLIENT_TRACE, 5);
    let root = one(&spans, "kvgate.request");
    assert_eq!(
        root["parent_span_id"], CLIENT_SPAN,
        "continues the client's span"
    );
    assert_eq!(root["kind"], 2);
    assert_eq!(root["service"], "kvgate");
    assert_eq!(root["trace_state"], "vendor=opaque");
    let a = &root["attributes"];
    assert_eq!(a["gen_ai.request.model"], MODEL);
    assert_eq!(a["gen_ai.operation.name"], "chat");
    assert_eq!(a["kvgate.request_id"], "req-42");
    assert_eq!(a["http.response.status_code"], 200);
    assert!(a["gen_ai.usage.input_tokens"].as_i64().unwrap() > 0, "{a}");
    assert_eq!(a["gen_ai.usage.output_tokens"], 6);
    assert!(a["kvgate.usage.cached_tokens"].is_i64(), "{a}");
    assert_eq!(a["kvgate.worker"], sim.to_string());
    let events: Vec<&str> = root["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["first_token", "stream_end"]);
    let root_id = root["span_id"].as_str().unwrap();
    for name in ["kvgate.tokenize", "kvgate.route", "kvgate.upstream"] {
        let s = one(&spans, name);
        assert_eq!(
            s["parent_span_id"], root_id,
            "{name} is a child of the request"
        );
        assert!(s["start"].as_u64() <= s["end"].as_u64(), "{s}");
        assert!(s["start"].as_u64() >= root["start"].as_u64(), "{s}");
    }
    let route = one(&spans, "kvgate.route");
    assert_eq!(route["attributes"]["kvgate.route.policy"], "round_robin");
    assert_eq!(route["attributes"]["kvgate.route.worker"], sim.to_string());
    assert!(
        one(&spans, "kvgate.tokenize")["attributes"]["kvgate.prompt.tokens"].as_i64() > Some(0)
    );
    let upstream = one(&spans, "kvgate.upstream");
    assert_eq!(upstream["kind"], 3);
    assert_eq!(upstream["attributes"]["http.response.status_code"], 200);
    let engine = one(&spans, "llm_request");
    assert_eq!(engine["service"], "kvgate-sim");
    assert_eq!(
        engine["parent_span_id"], upstream["span_id"],
        "the engine's span hangs under the router's attempt"
    );
    // The traceparent the worker got: the client's trace, the attempt's span, sampled.
    let want = format!(
        "00-{CLIENT_TRACE}-{}-01",
        upstream["span_id"].as_str().unwrap()
    );
    assert!(sim_traceparents(sim).contains(&want), "{want}");

    // Parent-based: an unsampled client trace exports nothing, and the worker is told so.
    let quiet = "11111111111111111111111111111111";
    let (status, _) = chat(
        gw,
        &format!("traceparent: 00-{quiet}-{CLIENT_SPAN}-00\r\n"),
        false,
    );
    assert_eq!(status, 200);
    let seen = sim_traceparents(sim);
    let last = seen.last().expect("a traceparent");
    assert!(
        last.starts_with(&format!("00-{quiet}-")) && last.ends_with("-00"),
        "{last}"
    );
    // ...and sample_ratio = 0 samples no new trace either: only the first trace's spans (and
    // its engine span) are in the collector once a later sampled request's spans arrive.
    let (status, _) = chat(gw, "", false);
    assert_eq!(status, 200);
    let marker = "22222222222222222222222222222222";
    chat(
        gw,
        &format!("traceparent: 00-{marker}-{CLIENT_SPAN}-01\r\n"),
        false,
    );
    col.trace(marker, 5);
    let traces: std::collections::BTreeSet<String> = col
        .spans()
        .iter()
        .map(|s| s["trace_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        traces,
        [CLIENT_TRACE.to_owned(), marker.to_owned()].into(),
        "unsampled requests exported nothing"
    );
    assert!(metric(gw, "kvgate_tracing_spans_exported_total") >= 8.0);
    assert_eq!(metric(gw, "kvgate_tracing_spans_dropped_total"), 0.0);

    // Sampling reloads with the file: at ratio 1 a request without a parent is exported.
    std::fs::write(
        dir.path().join("kvgate.toml"),
        format!(
            "[tracing]\notlp_endpoint = \"{endpoint}\"\nbatch_delay_ms = 50\nsample_ratio = 1.0\n"
        ),
    )
    .expect("rewrite config");
    poll_for_blocking(Duration::from_secs(20), "the config reload", || {
        (metric(gw, "kvgate_config_reloads_total{reason=\"ok\"}") >= 1.0).then_some(())
    });
    let (status, _) = chat(gw, "x-request-id: after-reload\r\n", false);
    assert_eq!(status, 200);
    poll_for_blocking(
        Duration::from_secs(20),
        "the span sampled after the reload",
        || {
            col.spans()
                .into_iter()
                .find(|s| s["attributes"]["kvgate.request_id"] == "after-reload")
        },
    );

    // OTLP/gRPC: a second gateway exporting to the collector's gRPC port, sampling everything.
    let (_gw2, gw2, _dir2) = gateway(
        sim,
        &format!(
            "otlp_endpoint = \"grpc://{}\"\nbatch_delay_ms = 50",
            col.grpc
        ),
    );
    let (status, _) = chat(gw2, "x-request-id: over-grpc\r\n", false);
    assert_eq!(status, 200);
    let root = poll_for_blocking(Duration::from_secs(20), "a span over gRPC", || {
        col.spans()
            .into_iter()
            .find(|s| s["attributes"]["kvgate.request_id"] == "over-grpc")
    });
    assert_eq!(root["protocol"], "grpc");
    let spans = col.trace(root["trace_id"].as_str().unwrap(), 5);
    let protocols: BTreeMap<&str, &str> = spans
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["protocol"].as_str().unwrap()))
        .collect();
    assert_eq!(protocols["kvgate.upstream"], "grpc");
    assert_eq!(
        protocols["llm_request"], "http",
        "the sim exports over HTTP"
    );
}

#[test]
fn failed_requests_are_exported_unsampled_and_a_dead_collector_costs_requests_nothing() {
    let Some(py) = python() else { return };
    let col = Collector::start(&py);

    // Errors: sampling off, a worker that always fails: its 500s are exported anyway.
    let (_sim, sim) = start_sim_with(MODEL, &["--fail-rate", "1.0"]);
    let (_gw, gw, _dir) = gateway(
        sim,
        &format!(
            "otlp_endpoint = \"http://{}\"\nbatch_delay_ms = 50\nsample_ratio = 0.0",
            col.http
        ),
    );
    let (status, _) = chat(gw, "x-request-id: failing\r\n", false);
    assert!(status >= 500, "{status}");
    let root = poll_for_blocking(Duration::from_secs(20), "the failed request's span", || {
        col.spans()
            .into_iter()
            .find(|s| s["attributes"]["kvgate.request_id"] == "failing")
    });
    assert_eq!(root["status_code"], 2, "error status: {root}");
    // Unsampled: the request span and its attempts (the internal steps are sampled requests' only).
    let spans = col.trace(root["trace_id"].as_str().unwrap(), 2);
    assert!(by_name(&spans, "kvgate.route").is_empty(), "{spans:#?}");
    let up = by_name(&spans, "kvgate.upstream");
    assert!(
        !up.is_empty() && up.iter().all(|s| s["status_code"] == 2),
        "{spans:#?}"
    );

    // Collector down: a port nothing listens on, a tiny queue. Every request still succeeds;
    // the spans are counted as failed (sent, refused) or dropped (queue full), none exported.
    let (_ok_sim, ok_sim) = start_sim_with(MODEL, &[]);
    let dead = kvgate_testkit::net::free_port();
    let (_gw2, gw2, _dir2) = gateway(
        ok_sim,
        &format!("otlp_endpoint = \"http://127.0.0.1:{dead}\"\nqueue_size = 1\nbatch_delay_ms = 10\nmax_batch_spans = 4"),
    );
    for _ in 0..20 {
        let (status, body) = chat(gw2, "", false);
        assert_eq!(status, 200, "{body}");
    }
    poll_for_blocking(Duration::from_secs(20), "spans counted as lost", || {
        let lost = metric(gw2, "kvgate_tracing_spans_failed_total")
            + metric(gw2, "kvgate_tracing_spans_dropped_total");
        // 20 requests × 4 spans (request, tokenize, route, upstream).
        (lost >= 80.0).then_some(())
    });
    assert_eq!(metric(gw2, "kvgate_tracing_spans_exported_total"), 0.0);
}

#[test]
fn both_pd_legs_carry_their_own_attempt_span_to_their_engine() {
    let Some(py) = python() else { return };
    let col = Collector::start(&py);
    let endpoint = format!("http://{}", col.http);
    let pd_sim = |role: &str| {
        start_sim_with(
            MODEL,
            &[
                "--role",
                role,
                "--kv-lease-ms",
                "600000",
                "--otlp-traces-endpoint",
                &endpoint,
            ],
        )
    };
    let (_p, prefill) = pd_sim("prefill");
    let (_d, decode) = pd_sim("decode");
    let (_gw, gw, _dir) = gateway_with(
        &format!(
            "[pd]\nmin_uncached_tokens = 0\n[tracing]\notlp_endpoint = \"{endpoint}\"\nbatch_delay_ms = 50\n"
        ),
        &[
            "--prefill-worker",
            &format!("http://{prefill}"),
            "--decode-worker",
            &format!("http://{decode}"),
        ],
    );
    let trace = "33333333333333333333333333333333";
    let (status, body) = chat(
        gw,
        &format!("traceparent: 00-{trace}-{CLIENT_SPAN}-01\r\n"),
        true,
    );
    assert_eq!(status, 200, "{body}");
    // request, tokenize, a route and an upstream span per leg, and one engine span per leg.
    let spans = col.trace(trace, 8);
    let root = one(&spans, "kvgate.request");
    assert_eq!(
        root["attributes"]["kvgate.pd.path"], "disaggregated",
        "{root}"
    );
    let upstream = by_name(&spans, "kvgate.upstream");
    assert_eq!(upstream.len(), 2, "{spans:#?}");
    let engines = by_name(&spans, "llm_request");
    assert_eq!(engines.len(), 2, "{spans:#?}");
    for (leg, sim) in [("prefill", prefill), ("decode", decode)] {
        let up = upstream
            .iter()
            .find(|s| s["attributes"]["kvgate.upstream.leg"] == leg)
            .unwrap_or_else(|| panic!("no {leg} attempt in {upstream:#?}"));
        assert_eq!(up["attributes"]["kvgate.upstream.worker"], sim.to_string());
        assert_eq!(up["parent_span_id"], root["span_id"]);
        let id = up["span_id"].as_str().unwrap();
        assert!(
            engines.iter().any(|e| e["parent_span_id"] == id),
            "the {leg} engine's span is under the {leg} attempt"
        );
        let want = format!("00-{trace}-{id}-01");
        assert!(
            sim_traceparents(sim).contains(&want),
            "{leg} worker got {want}"
        );
    }
    let legs: Vec<&str> = by_name(&spans, "kvgate.route")
        .iter()
        .map(|s| s["attributes"]["kvgate.route.leg"].as_str().unwrap())
        .collect();
    assert!(
        legs.contains(&"prefill") && legs.contains(&"decode"),
        "{legs:?}"
    );
}

/// A chat request with `content` as its prompt.
fn chat_prompt(gw: SocketAddr, headers: &str, content: &str) -> (u16, String) {
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{content}"}}],"max_tokens":4}}"#
    );
    try_http_with(gw, "POST", "/v1/chat/completions", headers, Some(&body)).expect("chat")
}

fn events<'a>(span: &'a Value, name: &str) -> Vec<&'a Value> {
    span["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["name"] == name)
        .collect()
}

/// The route span of a sampled request lists its top candidates (the chosen worker first, the
/// best loser next, each with overlap, load, predicted TTFT and the policy's cost) and why it
/// chose: `load` on a cold fleet, `overlap` for the same prompt again. A request that queued has
/// a queue span with its flow-control class, tenant and place in line.
#[test]
fn route_spans_list_the_top_candidates_and_queue_spans_the_place_in_line() {
    let Some(py) = python() else { return };
    let col = Collector::start(&py);
    let endpoint = format!("http://{}", col.http);
    let (_s1, s1) = start_sim_with(MODEL, &[]);
    let (_s2, s2) = start_sim_with(MODEL, &[]);
    let (_gw, gw, _dir) = gateway_policy(
        &format!(
            "[tracing]\notlp_endpoint = \"{endpoint}\"\nbatch_delay_ms = 50\nsample_ratio = 0.0\n"
        ),
        "kv",
        &[
            "--worker",
            &format!("http://{s1}"),
            "--worker",
            &format!("http://{s2}"),
        ],
    );
    let prompt = "the quick brown fox jumps over the lazy dog and keeps on running ".repeat(12);
    let mut chosen = Vec::new();
    for (i, trace) in [
        "44444444444444444444444444444444",
        "55555555555555555555555555555555",
    ]
    .iter()
    .enumerate()
    {
        let (status, body) = chat_prompt(
            gw,
            &format!("traceparent: 00-{trace}-{CLIENT_SPAN}-01\r\n"),
            &prompt,
        );
        assert_eq!(status, 200, "{body}");
        let spans = col.trace(trace, 4);
        let route = one(&spans, "kvgate.route");
        let a = &route["attributes"];
        assert_eq!(a["kvgate.route.policy"], "kv");
        assert_eq!(a["kvgate.route.candidates_seen"], 2, "{route}");
        let c = events(route, "kvgate.candidate");
        assert_eq!(c.len(), 2, "both workers listed: {route:#}");
        let (first, second) = (&c[0]["attributes"], &c[1]["attributes"]);
        assert_eq!(first["kvgate.candidate.rank"], 0);
        assert_eq!(first["kvgate.candidate.chosen"], true);
        assert_eq!(first["kvgate.candidate.worker"], a["kvgate.route.worker"]);
        assert_eq!(second["kvgate.candidate.chosen"], false);
        assert_ne!(second["kvgate.candidate.worker"], a["kvgate.route.worker"]);
        for e in [first, second] {
            assert!(e["kvgate.candidate.cost"].is_f64(), "kv has a cost: {e}");
            assert!(
                e["kvgate.candidate.predicted_ttft_ms"].as_f64() > Some(0.0),
                "{e}"
            );
            assert!(e["kvgate.candidate.inflight"].is_i64(), "{e}");
            assert!(e["kvgate.candidate.active_blocks"].is_i64(), "{e}");
        }
        assert!(
            first["kvgate.candidate.cost"].as_f64() <= second["kvgate.candidate.cost"].as_f64(),
            "the chosen one is the cheapest: {route:#}"
        );
        assert_eq!(
            first["kvgate.candidate.overlap_blocks"], a["kvgate.route.overlap_blocks"],
            "{route:#}"
        );
        if i == 0 {
            assert_eq!(a["kvgate.route.reason"], "load", "a cold fleet: {route:#}");
            assert_eq!(first["kvgate.candidate.overlap_blocks"], 0);
        } else {
            assert_eq!(
                a["kvgate.route.reason"], "overlap",
                "the same prompt again: {route:#}"
            );
            assert!(
                first["kvgate.candidate.overlap_blocks"].as_i64() > Some(0),
                "{route:#}"
            );
            assert_eq!(second["kvgate.candidate.overlap_blocks"], 0, "{route:#}");
        }
        chosen.push(a["kvgate.route.worker"].clone());
    }
    assert_eq!(chosen[0], chosen[1], "the prompt went back to its cache");

    // The queue: one worker taking one request at a time (stalled 1.5 s), flow control on. A
    // request arriving while it is busy queues; its queue span says where.
    let (_s3, s3) = start_sim_with(MODEL, &["--stall-ms", "1500"]);
    let (_gw2, gw2, _dir2) = gateway_policy(
        &format!(
            "[routing]\nmax_inflight_per_worker = 1\n\
             [flow_control]\nenabled = true\n\
             [[flow_control.classes]]\nname = \"interactive\"\npriority = 10\n\
             [[flow_control.classes]]\nname = \"batch\"\npriority = 0\n\
             [flow_control.tenants]\nteam-a = 2.0\n\
             [tracing]\notlp_endpoint = \"{endpoint}\"\nbatch_delay_ms = 50\nsample_ratio = 0.0\n"
        ),
        "kv",
        &["--worker", &format!("http://{s3}")],
    );
    let busy = std::thread::spawn(move || chat(gw2, "", false));
    poll_for_blocking(
        Duration::from_secs(20),
        "the first request in flight",
        || {
            (metric(gw2, &format!("kvgate_inflight_requests{{worker=\"{s3}\"}}")) >= 1.0)
                .then_some(())
        },
    );
    let trace = "66666666666666666666666666666666";
    let (status, body) = chat(
        gw2,
        &format!(
            "traceparent: 00-{trace}-{CLIENT_SPAN}-01\r\nx-kvgate-priority: 10\r\nx-kvgate-tenant: team-a\r\n"
        ),
        false,
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(busy.join().expect("first request").0, 200);
    let spans = col.trace(trace, 5);
    let route = one(&spans, "kvgate.route");
    let queue = one(&spans, "kvgate.queue");
    assert_eq!(queue["parent_span_id"], route["span_id"]);
    let q = &queue["attributes"];
    assert_eq!(q["kvgate.queue.position"], 1, "{queue:#}");
    assert_eq!(q["kvgate.flow.class"], "interactive", "{queue:#}");
    assert_eq!(q["kvgate.flow.tenant"], "team-a", "{queue:#}");
    assert_eq!(q["kvgate.queue.flow_control"], true);
    assert!(
        q["kvgate.queue.wait_ms"].as_f64() > Some(100.0),
        "{queue:#}"
    );
}

/// OTLP/HTTP and OTLP/gRPC over TLS (`https://`, `grpcs://`) to a collector serving a
/// self-signed certificate, trusted through `tracing.ca_file`.
#[test]
fn spans_reach_a_tls_collector_over_https_and_grpcs() {
    let Some(py) = python() else { return };
    let col = Collector::start_tls(&py);
    let (https, grpcs) = col.tls.expect("TLS ports");
    let (_sim, sim) = start_sim_with(MODEL, &[]);
    let ca = cert_fixture("cert.pem");
    for (scheme, addr, protocol) in [("https", https, "https"), ("grpcs", grpcs, "grpcs")] {
        let (_gw, gw, _dir) = gateway(
            sim,
            &format!(
                "otlp_endpoint = \"{scheme}://{addr}\"\nca_file = \"{}\"\nbatch_delay_ms = 50",
                ca.display()
            ),
        );
        let id = format!("over-{scheme}");
        let (status, body) = chat(gw, &format!("x-request-id: {id}\r\n"), false);
        assert_eq!(status, 200, "{body}");
        let root = poll_for_blocking(
            Duration::from_secs(20),
            format!("a span over {scheme}"),
            || {
                col.spans()
                    .into_iter()
                    .find(|s| s["attributes"]["kvgate.request_id"] == id.as_str())
            },
        );
        assert_eq!(root["protocol"], protocol);
        let spans = col.trace(root["trace_id"].as_str().unwrap(), 4);
        assert!(
            spans.iter().all(|s| s["protocol"] == protocol),
            "{spans:#?}"
        );
        assert_eq!(metric(gw, "kvgate_tracing_spans_failed_total"), 0.0);
    }
    // The same collector without the CA file: the handshake fails (the certificate is not
    // trusted), the request is unaffected, the spans are counted as failed.
    let bundle = tempfile::tempdir().expect("tempdir");
    let other_ca = bundle.path().join("other.pem");
    std::fs::write(&other_ca, OTHER_CA).expect("write CA");
    let (_gw, gw, _dir) = gateway(
        sim,
        &format!(
            "otlp_endpoint = \"https://{https}\"\nca_file = \"{}\"\nbatch_delay_ms = 50",
            other_ca.display()
        ),
    );
    let (status, body) = chat(gw, "", false);
    assert_eq!(status, 200, "{body}");
    poll_for_blocking(Duration::from_secs(20), "spans counted failed", || {
        (metric(gw, "kvgate_tracing_spans_failed_total") >= 4.0).then_some(())
    });
    assert_eq!(metric(gw, "kvgate_tracing_spans_exported_total"), 0.0);
}
