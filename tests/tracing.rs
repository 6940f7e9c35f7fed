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

/// The collector process and its two ports.
struct Collector {
    _proc: Proc,
    http: SocketAddr,
    grpc: SocketAddr,
}

impl Collector {
    fn start(py: &str) -> Collector {
        let mut cmd = Command::new(py);
        cmd.arg(repo_root().join("tests/support/otlp_collector.py"));
        let mut p = Proc::spawn("otlp collector", cmd);
        let (h, g) = p.wait_for(Duration::from_secs(30), |l| {
            let port = |key: &str| {
                let i = l.find(key)? + key.len();
                l[i..].split_whitespace().next()?.parse::<u16>().ok()
            };
            Some((port("http=")?, port("grpc=")?))
        });
        Collector {
            _proc: p,
            http: SocketAddr::from(([127, 0, 0, 1], h)),
            grpc: SocketAddr::from(([127, 0, 0, 1], g)),
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
        "round_robin",
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
