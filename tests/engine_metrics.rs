//! Issue 21's last families end to end: `kvgate serve` in front of `kvgate sim` (vLLM's metric
//! names) re-exports the engine's phase timings, tokens per step, step limit and speculative
//! decoding as `kvgate_worker_*`, counts requests by endpoint/stream and finish reasons, observes
//! the worker's time to routable; then the worker is killed and a new one started on its port:
//! the outage lands in `kvgate_worker_recovery_seconds` (MTTR) and the new process is counted
//! once in `kvgate_worker_restarts_total`. Every wait polls with a deadline.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvgate_system_tests::harness::*;

const MODEL: &str = "kvgate-sim";

/// Polls the gateway's `/metrics` until `ok` holds; panics with the last text after `limit`.
fn metrics_until(gw: SocketAddr, limit: Duration, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let mut last = String::new();
    let got = kvgate_testkit::eventually_blocking(limit, || {
        last = http_maybe(gw, "GET", "/metrics")
            .map(|(_, b)| b)
            .unwrap_or_default();
        ok(&last)
    });
    assert!(got, "timed out after {limit:?} waiting for {what}:\n{last}");
    last
}

fn sim_on(port: &str) -> (Proc, SocketAddr) {
    let mut sim = Proc::kvgate(
        "kvgate sim",
        &[
            "sim",
            "--port",
            port,
            "--no-kv-events",
            "--speedup",
            "0",
            "--model",
            MODEL,
            "--spec-tokens",
            "2",
        ],
    );
    let addr = sim.wait_for(Duration::from_secs(20), |l| addr_after(l, "http="));
    sim.wait_for(Duration::from_secs(20), |l| {
        (l.trim() == "ready").then_some(())
    });
    (sim, addr)
}

#[test]
fn engine_figures_request_breakdowns_mttr_and_restarts() {
    let (sim, worker) = sim_on("0");
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("kvgate.toml");
    std::fs::write(
        &cfg_path,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n\
             [upstream]\nhealth_interval_ms = 200\nhealth_recovery_interval_ms = 100\n\
             [[workers]]\nurl = \"http://{worker}\"\nname = \"w\"\nmodels = [\"{MODEL}\"]\n\
             max_num_batched_tokens = 4096\nmax_num_seqs = 64\n"
        ),
    )
    .unwrap();
    let mut gw_proc = Proc::kvgate(
        "kvgate serve",
        &["serve", "--config", cfg_path.to_str().unwrap()],
    );
    let gw = gw_proc.wait_for(Duration::from_secs(20), serving_addr);

    let chat = |stream: bool| {
        format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"count the stars"}}],"max_tokens":4,"stream":{stream}}}"#
        )
    };
    let plain = format!(r#"{{"model":"{MODEL}","prompt":"count the stars","max_tokens":3}}"#);
    for (path, body) in [
        ("/v1/chat/completions", chat(true)),
        ("/v1/chat/completions", chat(true)),
        ("/v1/chat/completions", chat(false)),
        ("/v1/completions", plain.clone()),
        ("/v1/completions", plain.clone()),
    ] {
        let (s, b) = http(gw, "POST", path, Some(&body));
        assert_eq!(s, 200, "{b}");
    }

    let w = r#"worker="w""#;
    let phase = |p: &str, what: &str| {
        format!("kvgate_worker_engine_phase_{what}_total{{{w},phase=\"{p}\"}}")
    };
    let text = metrics_until(
        gw,
        Duration::from_secs(20),
        "engine figures after 5 requests",
        |t| {
            ["queue", "prefill", "decode"]
                .iter()
                .all(|p| sample(t, &phase(p, "requests")).is_some_and(|n| n >= 5.0))
                && sample(t, &format!("kvgate_worker_spec_decode_drafts_total{{{w}}}"))
                    .is_some_and(|n| n > 0.0)
                && sample(t, "kvgate_worker_time_to_routable_seconds_count") == Some(1.0)
        },
    );
    let v = |series: &str| sample(&text, series).unwrap_or_else(|| panic!("{series}:\n{text}"));
    for p in ["queue", "prefill", "decode"] {
        let secs = v(&phase(p, "seconds"));
        assert!(secs.is_finite() && secs >= 0.0, "{p}: {secs}");
    }
    // Each step runs at least one token; 3 or 4 output tokens each and a prompt over 5 requests.
    let (tokens, steps) = (
        v(&format!("kvgate_worker_iteration_tokens_total{{{w}}}")),
        v(&format!("kvgate_worker_iterations_total{{{w}}}")),
    );
    assert!(
        steps >= 4.0 && tokens >= steps,
        "tokens {tokens} steps {steps}"
    );
    assert_eq!(
        v(&format!("kvgate_worker_max_num_batched_tokens{{{w}}}")),
        4096.0
    );
    assert_eq!(v(&format!("kvgate_worker_max_num_seqs{{{w}}}")), 64.0);
    // `--spec-tokens 2`: two draft tokens per draft, at most all of them accepted.
    let drafts = v(&format!("kvgate_worker_spec_decode_drafts_total{{{w}}}"));
    let proposed = v(&format!(
        "kvgate_worker_spec_decode_draft_tokens_total{{{w}}}"
    ));
    let accepted = v(&format!(
        "kvgate_worker_spec_decode_accepted_tokens_total{{{w}}}"
    ));
    assert_eq!(proposed, 2.0 * drafts);
    assert!(
        accepted > 0.0 && accepted <= proposed,
        "{accepted} of {proposed}"
    );
    // Gateway-side breakdowns of the same five requests.
    let ep = |e: &str, s: &str| {
        v(&format!(
            "kvgate_requests_by_endpoint_total{{endpoint=\"{e}\",stream=\"{s}\"}}"
        ))
    };
    assert_eq!(
        (
            ep("chat", "true"),
            ep("chat", "false"),
            ep("completions", "false")
        ),
        (2.0, 1.0, 2.0)
    );
    assert_eq!(
        (ep("completions", "true"), ep("embeddings", "false")),
        (0.0, 0.0)
    );
    let finish: f64 = ["stop", "length", "tool_calls", "content_filter", "other"]
        .iter()
        .filter_map(|r| {
            sample(
                &text,
                &format!("kvgate_finish_reasons_total{{model=\"{MODEL}\",finish_reason=\"{r}\"}}"),
            )
        })
        .sum();
    assert_eq!(finish, 5.0, "every response had a finish_reason:\n{text}");
    assert!(
        v(&format!(
            "kvgate_finish_reasons_total{{model=\"{MODEL}\",finish_reason=\"length\"}}"
        )) >= 1.0
    );
    assert!(
        text.contains("role=\"both\""),
        "kvgate_worker_info role:\n{text}"
    );
    assert_eq!(
        v(&format!("kvgate_worker_recovery_seconds_count{{{w}}}")),
        0.0
    );
    let restarts = |t: &str| -> f64 {
        [
            "kv_sequence_reset",
            "kv_cache_cleared",
            "counters_reset",
            "start_time_changed",
        ]
        .iter()
        .map(|r| {
            sample(
                t,
                &format!("kvgate_worker_restarts_total{{{w},reason=\"{r}\"}}"),
            )
            .unwrap_or_else(|| panic!("restarts {r} missing:\n{t}"))
        })
        .sum()
    };
    assert_eq!(restarts(&text), 0.0);

    // The worker dies: unroutable once the health checks see it (2 failed probes).
    let port = worker.port().to_string();
    drop(sim);
    let down_at = Instant::now();
    metrics_until(
        gw,
        Duration::from_secs(20),
        "the dead worker unroutable",
        |t| sample(t, &format!("kvgate_worker_routable{{{w}}}")) == Some(0.0),
    );
    // A new process on the same port: healthy again, one outage observed, one restart counted
    // (its start time and its counters both changed: one restart, not two).
    let (_sim2, worker2) = sim_on(&port);
    assert_eq!(worker2, worker);
    let text = metrics_until(gw, Duration::from_secs(30), "recovery and restart", |t| {
        sample(t, &format!("kvgate_worker_recovery_seconds_count{{{w}}}")) == Some(1.0)
            && sample(t, &format!("kvgate_worker_routable{{{w}}}")) == Some(1.0)
            && restarts(t) >= 1.0
    });
    let outage = down_at.elapsed().as_secs_f64();
    let mttr = v_of(&text, &format!("kvgate_worker_recovery_seconds_sum{{{w}}}"));
    assert!(
        mttr > 0.0 && mttr <= outage + 1.0,
        "MTTR {mttr} s, outage at most {outage} s"
    );
    assert_eq!(restarts(&text), 1.0, "{text}");
    eprintln!("measured: MTTR {mttr:.3} s (outage seen for {outage:.3} s), 1 restart counted");
    let by_start = sample(
        &text,
        &format!("kvgate_worker_restarts_total{{{w},reason=\"start_time_changed\"}}"),
    );
    let by_counters = sample(
        &text,
        &format!("kvgate_worker_restarts_total{{{w},reason=\"counters_reset\"}}"),
    );
    assert_eq!(
        by_start.unwrap_or(0.0) + by_counters.unwrap_or(0.0),
        1.0,
        "{text}"
    );
    // Added once: the recovery is not a second time-to-routable.
    assert_eq!(
        v_of(&text, "kvgate_worker_time_to_routable_seconds_count"),
        1.0
    );
}

fn v_of(text: &str, series: &str) -> f64 {
    sample(text, series).unwrap_or_else(|| panic!("{series}:\n{text}"))
}

/// vLLM's and SGLang's `AllBlocksCleared` over ZMQ (a restart, or an operator's
/// `POST /reset_prefix_cache`) after the worker had stored blocks is one `kv_cache_cleared`
/// restart, as TRT-LLM's `created` is (found against a real vLLM 0.32: the ZMQ path dropped the
/// index but counted nothing).
#[test]
fn a_cache_reset_after_stored_blocks_counts_as_kv_cache_cleared() {
    let mut sim = Proc::kvgate(
        "kvgate sim",
        &["sim", "--port", "0", "--speedup", "0", "--model", MODEL],
    );
    let (worker, kv, replay) = sim.wait_for(Duration::from_secs(20), |l| {
        let field = |key: &str| {
            l.split_whitespace()
                .find_map(|t| t.strip_prefix(key))
                .map(str::to_owned)
        };
        Some((
            addr_after(l, "http=")?,
            field("kv_events=")?,
            field("replay=")?,
        ))
    });
    sim.wait_for(Duration::from_secs(20), |l| {
        (l.trim() == "ready").then_some(())
    });
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("kvgate.toml");
    std::fs::write(
        &cfg_path,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n\
             [[workers]]\nurl = \"http://{worker}\"\nname = \"w\"\nmodels = [\"{MODEL}\"]\n\
             kv_events = \"{kv}\"\nkv_replay = \"{replay}\"\n"
        ),
    )
    .unwrap();
    let mut gw_proc = Proc::kvgate(
        "kvgate serve",
        &["serve", "--config", cfg_path.to_str().unwrap()],
    );
    let gw = gw_proc.wait_for(Duration::from_secs(20), serving_addr);
    let cleared = r#"kvgate_worker_restarts_total{worker="w",reason="kv_cache_cleared"}"#;
    let stored = r#"kvgate_worker_kv_blocks_stored_total{worker="w"}"#;
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"{}","max_tokens":2}}"#,
        "the same long prompt ".repeat(40)
    );
    // Blocks stored (events seen by the gateway), and nothing counted yet.
    let text = metrics_until(gw, Duration::from_secs(30), "stored blocks", |t| {
        let (s, _) = http(gw, "POST", "/v1/completions", Some(&body));
        s == 200 && sample(t, stored).is_some_and(|n| n > 0.0)
    });
    assert_eq!(sample(&text, cleared), Some(0.0), "{text}");
    let (s, b) = http(worker, "POST", "/reset_prefix_cache", None);
    assert_eq!(s, 200, "{b}");
    metrics_until(gw, Duration::from_secs(30), "kv_cache_cleared", |t| {
        sample(t, cleared) == Some(1.0)
    });
    drop(gw_proc);
    drop(sim);
}
