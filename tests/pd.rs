//! Prefill/decode disaggregation through the real binary: `kvgate sim --role prefill|decode`
//! processes behind `kvgate serve --prefill-worker URL --decode-worker URL` (issue 20). Checks the
//! handoff (streamed and not), the recorded usage, conditional disaggregation, every failure mode,
//! and that no KV block stays pinned on the prefill worker after failures and disconnects (the
//! sim's `kvgate_sim_pd_pinned_blocks`; leases are set far longer than the tests run, so only
//! the handoff itself can have freed them).

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvgate_system_tests::exchange_raw;
use kvgate_system_tests::harness::{addr_after, serving_addr, Proc};

const MODEL: &str = "pd-model";

/// One `kvgate sim` worker on an ephemeral port with `args`; its HTTP address.
fn sim(args: &[&str]) -> (Proc, SocketAddr) {
    sim_at("100", args)
}

/// As [`sim`], its step times divided by `speedup`.
fn sim_at(speedup: &str, args: &[&str]) -> (Proc, SocketAddr) {
    let mut all = vec!["sim", "--port", "0", "--no-kv-events", "--model", MODEL];
    all.extend(["--speedup", speedup, "--kv-lease-ms", "600000"]);
    all.extend_from_slice(args);
    let mut p = Proc::kvgate("kvgate sim", &all);
    let addr = p.wait_for(Duration::from_secs(20), |l| addr_after(l, "worker 0 http="));
    (p, addr)
}

/// `kvgate serve` with `prefill` and `decode` workers and `config` (TOML, kept on disk while the
/// gateway runs); its address.
fn gateway(
    config: &str,
    prefill: &[SocketAddr],
    decode: &[SocketAddr],
) -> ((Proc, tempfile::NamedTempFile), SocketAddr) {
    let file = tempfile::NamedTempFile::new().expect("temp config");
    std::fs::write(file.path(), config).expect("config");
    let urls = |a: &[SocketAddr]| {
        a.iter()
            .map(|a| format!("http://{a}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let (path, prefill, decode) = (file.path().to_string_lossy(), urls(prefill), urls(decode));
    let mut p = Proc::kvgate(
        "kvgate serve",
        &[
            "serve",
            "--config",
            &path,
            "--listen",
            "127.0.0.1:0",
            "--no-request-log",
            "--model",
            MODEL,
            "--log",
            "warn",
            "--prefill-worker",
            &prefill,
            "--decode-worker",
            &decode,
        ],
    );
    let addr = p.wait_for(Duration::from_secs(20), serving_addr);
    ((p, file), addr)
}

/// One HTTP/1.1 exchange with `Connection: close`: (status, body with chunked framing removed).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let (resps, _) = exchange_raw(addr, req.as_bytes(), Duration::from_secs(30));
    let r = resps.into_iter().next().expect("a response");
    assert!(r.complete, "response cut short: {}", r.body_text());
    (r.status, r.body_text())
}

/// The value of the first series of `name` whose labels contain every `labels` pair.
fn metric(addr: SocketAddr, name: &str, labels: &[&str]) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", "");
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| labels.iter().all(|p| l.contains(p)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Polls `f` until it holds (generous deadline; no fixed sleep decides anything).
fn eventually(what: &str, f: impl FnMut() -> bool) {
    kvgate_testkit::poll_until_blocking(kvgate_testkit::PATIENCE, what, f)
}

fn pinned(sim: SocketAddr) -> f64 {
    metric(sim, "kvgate_sim_pd_pinned_blocks", &[])
}

/// A prompt of `n` distinct words (the sim's tokenizer: about one token per word).
fn prompt(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn chat(p: &str, stream: bool, max_tokens: u32) -> String {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": p}],
        "stream": stream, "max_tokens": max_tokens, "ignore_eos": true,
        "stream_options": {"include_usage": true}})
    .to_string()
}

const ALWAYS: &str = "[pd]\nmin_uncached_tokens = 0\n";

#[test]
fn handoff_streamed_and_not_records_prefill_usage_and_frees_blocks() {
    let (_p, pa) = sim(&["--role", "prefill"]);
    let (_d, da) = sim(&["--role", "decode"]);
    let (_g, ga) = gateway(ALWAYS, &[pa], &[da]);

    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("a", 300), false, 5),
    );
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON answer");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // The client's usage: prompt and cached tokens from the prefill leg (cold: 0 cached), not the
    // decode worker's pulled-as-cached count; completion tokens from the decode leg.
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(prompt_tokens >= 300, "{body}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{body}"
    );
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 5);
    assert!(v["kv_transfer_params"].is_null(), "{body}");
    assert_eq!(
        metric(ga, "kvgate_pd_decisions_total", &["path=\"disaggregated\""]),
        1.0
    );
    // The decode worker pulled the prompt; the prefill worker's blocks were read and freed.
    assert_eq!(metric(da, "vllm:nixl_xfer_time_seconds_count", &[]), 1.0);
    assert_eq!(pinned(pa), 0.0);
    // Recorded cached tokens come from the prefill leg (cold: 0), not the decode's pulled ones.
    eventually("request recorded", || {
        metric(ga, "kvgate_requests_total", &["status=\"200\""]) >= 1.0
    });
    assert_eq!(metric(ga, "kvgate_cached_tokens_total", &[]), 0.0);

    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("b", 300), true, 4),
    );
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("[DONE]"), "{body}");
    assert!(!body.contains("\"error\""), "{body}");
    assert!(body.contains("\"cached_tokens\":0"), "{body}");

    // The same prompt again: the prefill worker's own prefix hit is what the client sees.
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("a", 300), false, 2),
    );
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON answer");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= 256 && cached < prompt_tokens - 1,
        "prefill hit {cached}: {body}"
    );
    assert_eq!(pinned(pa), 0.0);
    eventually("transfer wait observed", || {
        metric(ga, "kvgate_pd_transfer_wait_seconds_count", &[]) >= 1.0
    });
    assert_eq!(
        metric(ga, "kvgate_pd_prefill_duration_seconds_count", &[]),
        3.0
    );
    assert_eq!(
        metric(ga, "kvgate_pd_decisions_total", &["path=\"disaggregated\""]),
        3.0
    );
    assert_eq!(pinned(pa), 0.0);
    // The predicted overlap is the prefill pick's (where the prompt's cache is): the third
    // request's prompt was predicted cached there, so the three predictions sum to more than 0.5
    // (the decode leg's least_loaded pick reads no overlap and would have said 0 each time).
    assert_eq!(metric(ga, "kvgate_predicted_overlap_ratio_count", &[]), 3.0);
    let predicted = metric(ga, "kvgate_predicted_overlap_ratio_sum", &[]);
    assert!(predicted > 0.5, "predicted overlap sum {predicted}");
    assert_eq!(metric(ga, "kvgate_worker_role", &["role=\"prefill\""]), 1.0);
    assert_eq!(metric(ga, "kvgate_worker_role", &["role=\"decode\""]), 1.0);
}

#[test]
fn short_prompts_run_on_the_decode_worker_alone() {
    let (_p, pa) = sim(&["--role", "prefill"]);
    let (_d, da) = sim(&["--role", "decode"]);
    // (The idle decode worker would run the long one whole too: that rule has its own test.)
    let (_g, ga) = gateway(
        "[pd]\nmin_uncached_tokens = 256\nlocal_on_idle_decode = false\n",
        &[pa],
        &[da],
    );
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("s", 20), false, 3),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_decisions_total",
            &["path=\"local\"", "reason=\"short_prompt\""]
        ),
        1.0
    );
    assert_eq!(
        metric(pa, "vllm:prompt_tokens_total", &[]),
        0.0,
        "the prefill worker saw nothing"
    );
    // A long one is disaggregated.
    let (st, _) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("l", 400), false, 3),
    );
    assert_eq!(st, 200);
    assert_eq!(
        metric(ga, "kvgate_pd_decisions_total", &["path=\"disaggregated\""]),
        1.0
    );
}

#[test]
fn short_prompts_do_not_pile_onto_a_crowded_decode_worker() {
    let (_p, pa) = sim(&["--role", "prefill"]);
    // Slow decode workers, so streams stay in flight while the test looks.
    let (_d0, d0) = sim(&["--role", "decode", "--slowdown", "500"]);
    let (_d1, d1) = sim(&["--role", "decode", "--slowdown", "500"]);
    // Replication off: with it (kv_time's default), the fourth request's pick itself would
    // leave the crowded worker, and this test is about the plan's own check.
    let (_g, ga) = gateway(
        "[routing]\nkv_replicate = 0\n[pd]\nlocal_on_idle_decode = false\n",
        &[pa],
        &[d0, d1],
    );
    let decisions = |path: &str, reason: &str| {
        metric(
            ga,
            "kvgate_pd_decisions_total",
            &[&format!("path=\"{path}\""), &format!("reason=\"{reason}\"")],
        )
    };
    let p = prompt("c", 700);
    // Nothing cached on a decode worker yet: disaggregated; its decode worker keeps the prompt.
    let (st, body) = http(ga, "POST", "/v1/chat/completions", &chat(&p, false, 1));
    assert_eq!(st, 200, "{body}");
    assert_eq!(decisions("disaggregated", "prefilled"), 1.0);
    // The same prompt again, three times at once with long streams: each runs on that worker
    // alone (0, 1, 2 requests in flight there against an average of 0, 0.5, 1).
    let streams: Vec<_> = (0..3)
        .map(|_| {
            let body = chat(&p, true, 40);
            std::thread::spawn(move || http(ga, "POST", "/v1/chat/completions", &body))
        })
        .collect();
    eventually("three local streams in flight", || {
        decisions("local", "short_prompt") == 3.0 && total_inflight(ga) == 3.0
    });
    // A fourth would make it 4 there against an average of 1.5: disaggregated instead.
    let (st, body) = http(ga, "POST", "/v1/chat/completions", &chat(&p, false, 1));
    assert_eq!(st, 200, "{body}");
    assert_eq!(metric(ga, "kvgate_pd_local_declined_total", &[]), 1.0);
    assert_eq!(decisions("local", "short_prompt"), 3.0);
    assert_eq!(decisions("disaggregated", "prefilled"), 2.0);
    for s in streams {
        let (st, body) = s.join().expect("stream thread");
        assert_eq!(st, 200);
        assert!(body.contains("[DONE]"), "{body}");
    }
}

#[test]
fn long_prompts_run_whole_on_an_idle_decode_worker_only() {
    let (_p, pa) = sim(&["--role", "prefill"]);
    // A slow decode worker, so a stream stays in flight while the test looks.
    let (_d, da) = sim(&["--role", "decode", "--slowdown", "500"]);
    let (_g, ga) = gateway("", &[pa], &[da]);
    let decisions = |path: &str, reason: &str| {
        metric(
            ga,
            "kvgate_pd_decisions_total",
            &[&format!("path=\"{path}\""), &format!("reason=\"{reason}\"")],
        )
    };
    // 700 uncached tokens (above the default 512) on an idle decode worker: run there whole.
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("a", 700), false, 1),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(decisions("local", "decode_idle"), 1.0);
    assert_eq!(metric(pa, "vllm:prompt_tokens_total", &[]), 0.0);
    // A long stream keeps the decode worker busy: the next long prompt is disaggregated, so no
    // prefill holds up that stream.
    let stream = {
        let body = chat(&prompt("b", 700), true, 40);
        std::thread::spawn(move || http(ga, "POST", "/v1/chat/completions", &body))
    };
    eventually("the stream in flight", || total_inflight(ga) == 1.0);
    assert_eq!(decisions("local", "decode_idle"), 2.0);
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("c", 700), false, 1),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(decisions("disaggregated", "prefilled"), 1.0);
    assert!(metric(pa, "vllm:prompt_tokens_total", &[]) >= 700.0);
    let (st, body) = stream.join().expect("stream thread");
    assert_eq!(st, 200);
    assert!(body.contains("[DONE]"), "{body}");
    assert_eq!(decisions("local", "decode_idle"), 2.0);
}

#[test]
fn the_prefill_leg_teaches_the_prefill_worker_and_the_decode_leg_does_not() {
    // The sims run 5x slower than the reference curve the model is seeded with, so what the
    // prefill worker teaches points the same way as a busy machine's delays (slower), and the
    // test does not need the machine to be fast to see it.
    let (_p, pa) = sim_at("0.2", &["--role", "prefill"]);
    let (_d, da) = sim_at("0.2", &["--role", "decode"]);
    let (_g, ga) = gateway(ALWAYS, &[pa], &[da]);
    let fitted = |a: SocketAddr| {
        metric(
            ga,
            "kvgate_worker_prefill_tokens_per_second",
            &[&format!("worker=\"{a}\"")],
        )
    };
    let (seed_p, seed_d) = (fitted(pa), fitted(da));
    assert!(seed_p > 0.0 && seed_d > 0.0, "fitted throughput exported");
    for i in 0..6 {
        let (st, body) = http(
            ga,
            "POST",
            "/v1/chat/completions",
            &chat(&prompt(&format!("t{i}x"), 600), true, 4),
        );
        assert_eq!(st, 200, "{body}");
        assert!(body.contains("[DONE]"), "{body}");
    }
    // The prefill worker's answers teach the model its (slower) speed; the decode worker's first
    // tokens (the transfer and one step, after another worker's prefill) must not teach its
    // prefill speed anything.
    let (p, d) = (fitted(pa), fitted(da));
    eprintln!("measured: prefill worker {seed_p} -> {p} tok/s, decode worker {seed_d} -> {d}");
    assert!(
        p < seed_p / 2.0,
        "prefill worker fitted {p} tok/s, seeded {seed_p}: not learned"
    );
    assert!(
        (d / seed_d - 1.0).abs() < 0.01,
        "decode worker fitted {d} tok/s, seeded {seed_d}: its decode legs taught its prefill speed"
    );
}

/// Requests in flight through the gateway, over every worker.
fn total_inflight(addr: SocketAddr) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", "");
    text.lines()
        .filter(|l| l.starts_with("kvgate_inflight_requests{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn prefill_failure_falls_back_to_decode_only() {
    let (_p, pa) = sim(&["--role", "prefill", "--pd-prefill-fail-rate", "1"]);
    let (_d, da) = sim(&["--role", "decode"]);
    let (_g, ga) = gateway(ALWAYS, &[pa], &[da]);
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("f", 300), false, 3),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_handoff_failures_total",
            &["kind=\"prefill_error\""]
        ),
        1.0
    );
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_decisions_total",
            &["path=\"local\"", "reason=\"prefill_failed\""]
        ),
        1.0
    );
    assert_eq!(metric(da, "vllm:nixl_xfer_time_seconds_count", &[]), 0.0);
}

#[test]
fn no_params_means_decode_computes_it_all() {
    let (_p, pa) = sim(&["--role", "prefill", "--pd-no-params-rate", "1"]);
    let (_d, da) = sim(&["--role", "decode"]);
    let (_g, ga) = gateway(ALWAYS, &[pa], &[da]);
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("n", 300), true, 3),
    );
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("[DONE]"));
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_handoff_failures_total",
            &["kind=\"no_params\""]
        ),
        1.0
    );
    assert_eq!(
        metric(ga, "kvgate_pd_decisions_total", &["reason=\"no_params\""]),
        1.0
    );
    assert_eq!(pinned(pa), 0.0);
}

#[test]
fn decode_failure_is_an_openai_error_and_frees_prefill_blocks() {
    let (_p, pa) = sim(&["--role", "prefill"]);
    let (_d, da) = sim(&["--role", "decode", "--fail-rate", "1"]);
    let (_g, ga) = gateway(ALWAYS, &[pa], &[da]);
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("x", 300), false, 3),
    );
    assert!(st >= 500, "{st} {body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON error");
    assert!(v["error"]["message"].is_string(), "{body}");
    assert!(
        metric(
            ga,
            "kvgate_pd_handoff_failures_total",
            &["kind=\"decode_error\""]
        ) >= 1.0
    );
    // The decode worker refused the leg and told the prefill worker (no lease needed).
    eventually("prefill blocks freed", || pinned(pa) == 0.0);
    let _ = da;
}

#[test]
fn client_disconnect_mid_transfer_frees_prefill_blocks() {
    let (_p, pa) = sim(&["--role", "prefill"]);
    // A transfer that would take minutes: the client leaves while the decode worker pulls.
    let (_d, da) = sim(&["--role", "decode", "--kv-transfer-gbps", "0.000001"]);
    // The gateway reaches the decode worker through a relay that shows when the decode leg
    // (the body with `kv_transfer_params`) has been handed to it: leaving before that would test
    // a disconnect between the legs, which only the lease frees.
    let relay = Relay::start(da, "\"kv_transfer_params\"");
    let (_g, ga) = gateway(ALWAYS, &[pa], &[relay.addr]);
    let body = chat(&prompt("c", 300), true, 20);
    let mut s = TcpStream::connect(ga).expect("connect");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {ga}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    eventually("prefill leg done, blocks pinned", || pinned(pa) > 0.0);
    eventually("the decode leg handed to the decode worker", || {
        relay.seen.load(std::sync::atomic::Ordering::SeqCst)
    });
    drop(s);
    eventually("prefill blocks freed after the disconnect", || {
        pinned(pa) == 0.0
    });
    assert_eq!(
        metric(pa, "vllm:nixl_num_kv_expired_reqs", &[]),
        0.0,
        "not by the lease"
    );
}

/// A loopback TCP relay to `target` that sets `seen` once a connection has carried `needle`
/// towards it (threads end with their connections; the listener's thread with the test binary).
struct Relay {
    addr: SocketAddr,
    seen: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    fn start(target: SocketAddr, needle: &'static str) -> Relay {
        use std::io::Read;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind relay");
        let addr = l.local_addr().expect("relay address");
        let seen = Arc::new(AtomicBool::new(false));
        let flag = seen.clone();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut from) = conn else { continue };
                let Ok(mut to) = TcpStream::connect(target) else {
                    continue;
                };
                let (Ok(mut back_from), Ok(mut back_to)) = (to.try_clone(), from.try_clone())
                else {
                    continue;
                };
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut back_from, &mut back_to);
                    let _ = back_to.shutdown(std::net::Shutdown::Write);
                });
                let flag = flag.clone();
                std::thread::spawn(move || {
                    let mut carried = Vec::new();
                    let mut buf = [0u8; 16 << 10];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        if !flag.load(Ordering::SeqCst) {
                            carried.extend_from_slice(&buf[..n]);
                            if carried
                                .windows(needle.len())
                                .any(|w| w == needle.as_bytes())
                            {
                                flag.store(true, Ordering::SeqCst);
                            }
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        Relay { addr, seen }
    }
}

#[test]
fn the_helm_pd_values_config_loads() {
    // The `config: |` block of deploy/helm/pd-values.yaml, de-indented.
    let yaml = std::fs::read_to_string(
        kvgate_system_tests::repo_root().join("deploy/helm/pd-values.yaml"),
    )
    .expect("pd-values.yaml");
    let toml: String = yaml
        .lines()
        .skip_while(|l| !l.starts_with("config: |"))
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("  "))
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    let cfg = kvgate_gateway::config::Config::from_toml(&toml).expect("pd-values config loads");
    assert_eq!(cfg.pd.min_uncached_tokens, 512);
    let roles: Vec<_> = cfg.worker_pools.iter().map(|p| p.role.as_str()).collect();
    assert_eq!(roles, ["prefill", "decode"]);
    // Every address a pool resolves to becomes a worker with the pool's role.
    let w = cfg.worker_pools[0].worker_for("10.0.0.7:8000".parse().unwrap());
    assert_eq!(w.role.as_str(), "prefill");
    assert_eq!(w.url, "http://10.0.0.7:8000");
}

// ---- SGLang bootstrap handoff (`[pd] protocol = "sglang"`, `kvgate sim --pd-protocol sglang`) ----

/// `kvgate serve` with SGLang prefill and decode sims listed in `[[workers]]` (each prefill
/// worker's `bootstrap_port` is its HTTP port: the sim serves its bootstrap route there).
fn sglang_gateway(
    prefill: &[SocketAddr],
    decode: &[SocketAddr],
) -> ((Proc, tempfile::NamedTempFile), SocketAddr) {
    let mut config = String::from("[pd]\nprotocol = \"sglang\"\nmin_uncached_tokens = 0\n");
    for a in prefill {
        config += &format!(
            "\n[[workers]]\nurl = \"http://{a}\"\nrole = \"prefill\"\nbootstrap_port = {}\nmodels = [\"{MODEL}\"]\n",
            a.port()
        );
    }
    for a in decode {
        config += &format!(
            "\n[[workers]]\nurl = \"http://{a}\"\nrole = \"decode\"\nmodels = [\"{MODEL}\"]\n"
        );
    }
    serve(&config)
}

/// `kvgate serve --config` with `config` (TOML, kept on disk while the gateway runs); its address.
fn serve(config: &str) -> ((Proc, tempfile::NamedTempFile), SocketAddr) {
    let file = tempfile::NamedTempFile::new().expect("temp config");
    std::fs::write(file.path(), config).expect("config");
    let path = file.path().to_string_lossy().into_owned();
    let mut p = Proc::kvgate(
        "kvgate serve",
        &[
            "serve",
            "--config",
            &path,
            "--listen",
            "127.0.0.1:0",
            "--no-request-log",
            "--log",
            "warn",
        ],
    );
    let addr = p.wait_for(Duration::from_secs(20), serving_addr);
    ((p, file), addr)
}

fn sglang_sim(role: &str, extra: &[&str]) -> (Proc, SocketAddr) {
    let mut args = vec!["--role", role, "--pd-protocol", "sglang"];
    args.extend_from_slice(extra);
    sim(&args)
}

/// No bootstrap room open on `p` and no leg waiting on `p` or `d`.
fn no_rooms(p: SocketAddr, d: SocketAddr) -> bool {
    metric(p, "kvgate_sim_pd_bootstrap_rooms", &[]) == 0.0
        && metric(p, "kvgate_sim_pd_bootstrap_waiting", &[]) == 0.0
        && metric(d, "kvgate_sim_pd_bootstrap_waiting", &[]) == 0.0
}

#[test]
fn sglang_handoff_streamed_and_not() {
    let (_p, pa) = sglang_sim("prefill", &[]);
    let (_d, da) = sglang_sim("decode", &[]);
    let (_g, ga) = sglang_gateway(&[pa], &[da]);

    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("a", 300), false, 5),
    );
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON answer");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{body}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(prompt_tokens >= 300, "{body}");
    // The decode worker's usage, unchanged: it does not count the transferred tokens as cached.
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{body}"
    );
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_decisions_total",
            &["path=\"disaggregated\"", "reason=\"bootstrap\""]
        ),
        1.0
    );
    // The prefill worker computed the prompt, the decode worker took it over.
    assert!(metric(pa, "vllm:prompt_tokens_total", &[]) >= 300.0);
    assert_eq!(metric(da, "vllm:nixl_xfer_time_seconds_count", &[]), 1.0);

    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("b", 300), true, 4),
    );
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("[DONE]"), "{body}");
    assert!(!body.contains("\"error\""), "{body}");
    assert_eq!(metric(da, "vllm:nixl_xfer_time_seconds_count", &[]), 2.0);
    eventually("both prefill answers drained", || {
        metric(ga, "kvgate_pd_prefill_duration_seconds_count", &[]) == 2.0
    });
    eventually("no room left", || no_rooms(pa, da));
    assert_eq!(
        metric(pa, "kvgate_sim_pd_bootstrap_timeouts_total", &[]),
        0.0
    );
}

#[test]
fn sglang_prefill_failure_is_a_502_and_cancels_the_decode_leg() {
    let (_p, pa) = sglang_sim("prefill", &["--pd-prefill-fail-rate", "1"]);
    // Default bootstrap timeout (300 s): only the gateway's cancel can end the decode leg's wait.
    let (_d, da) = sglang_sim("decode", &[]);
    let (_g, ga) = sglang_gateway(&[pa], &[da]);
    for stream in [false, true] {
        let (st, body) = http(
            ga,
            "POST",
            "/v1/chat/completions",
            &chat(&prompt("f", 300), stream, 3),
        );
        assert_eq!(st, 502, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON error");
        let msg = v["error"]["message"].as_str().expect("OpenAI error");
        assert!(msg.contains("prefill leg"), "{body}");
    }
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_handoff_failures_total",
            &["kind=\"prefill_error\""]
        ),
        2.0
    );
    eventually("the decode legs were cancelled, no room left", || {
        no_rooms(pa, da)
    });
    assert_eq!(
        metric(da, "kvgate_sim_pd_bootstrap_timeouts_total", &[]),
        0.0
    );
}

#[test]
fn sglang_decode_failure_is_a_502_and_cancels_the_prefill_leg() {
    let (_p, pa) = sglang_sim("prefill", &[]);
    let (_d, da) = sglang_sim("decode", &["--fail-rate", "1"]);
    let (_g, ga) = sglang_gateway(&[pa], &[da]);
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("x", 300), false, 3),
    );
    assert_eq!(st, 502, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON error");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("decode leg")),
        "{body}"
    );
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_handoff_failures_total",
            &["kind=\"decode_error\""]
        ),
        1.0
    );
    // The prefill leg waited for a decode leg that never joins: the gateway dropped it.
    eventually("the prefill leg was cancelled, no room left", || {
        no_rooms(pa, da)
    });
    assert_eq!(
        metric(pa, "kvgate_sim_pd_bootstrap_timeouts_total", &[]),
        0.0
    );
}

#[test]
fn sglang_client_disconnect_cancels_both_legs() {
    // The prefill leg stalls a minute before it reaches its room: the decode leg waits there.
    let (_p, pa) = sglang_sim("prefill", &["--stall-ms", "60000"]);
    let (_d, da) = sglang_sim("decode", &[]);
    let (_g, ga) = sglang_gateway(&[pa], &[da]);
    let body = chat(&prompt("c", 300), true, 20);
    let mut s = TcpStream::connect(ga).expect("connect");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {ga}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    eventually("the decode leg waits in its room", || {
        metric(da, "kvgate_sim_pd_bootstrap_waiting", &[]) == 1.0
            && metric(pa, "kvgate_sim_pd_bootstrap_rooms", &[]) == 1.0
    });
    drop(s);
    eventually("both legs cancelled, no room left", || no_rooms(pa, da));
    assert_eq!(
        metric(da, "kvgate_sim_pd_bootstrap_timeouts_total", &[]),
        0.0
    );
    eventually("the gateway recorded the cancel", || {
        metric(ga, "kvgate_requests_total", &[]) >= 1.0
    });
}

// ---- Roles detected from `/server_info` (`role = "auto"`) ----

/// `[[workers]]` entries with `role = "auto"` and no `bootstrap_port`, one per address.
fn auto_workers(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(|a| {
            format!(
                "\n[[workers]]\nurl = \"http://{a}\"\nrole = \"auto\"\nmodels = [\"{MODEL}\"]\n"
            )
        })
        .collect()
}

#[test]
fn sglang_roles_protocol_and_bootstrap_port_are_detected_from_server_info() {
    let (_p, pa) = sglang_sim("prefill", &[]);
    let (_d1, d1) = sglang_sim("decode", &[]);
    let (_d2, d2) = sglang_sim("decode", &[]);
    // Nothing says which worker is which, which handoff to run, or where the prefill worker's
    // bootstrap server is (the default 8998 would be wrong: the sim serves it on its HTTP port).
    let config = "[pd]\nprotocol = \"auto\"\nmin_uncached_tokens = 0\n".to_string()
        + &auto_workers(&[d1, pa, d2]);
    let (_g, ga) = serve(&config);
    eventually("every role detected", || {
        metric(ga, "kvgate_worker_role", &["role=\"prefill\""]) == 1.0
            && metric(ga, "kvgate_worker_role", &["role=\"decode\""]) == 1.0
            && !metric_text(ga).contains("role=\"unknown\"")
    });
    for (i, stream) in [false, true, false, true].into_iter().enumerate() {
        let (st, body) = http(
            ga,
            "POST",
            "/v1/chat/completions",
            &chat(&prompt(&format!("r{i}x"), 300), stream, 3),
        );
        assert_eq!(st, 200, "{body}");
        assert!(!body.contains("\"error\""), "{body}");
    }
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_decisions_total",
            &["path=\"disaggregated\"", "reason=\"bootstrap\""]
        ),
        4.0
    );
    // The prefill sim computed every prompt; the decode sims took them over and nothing else.
    assert!(metric(pa, "vllm:prompt_tokens_total", &[]) >= 4.0 * 300.0);
    let pulled = |d| metric(d, "vllm:nixl_xfer_time_seconds_count", &[]);
    assert_eq!(pulled(d1) + pulled(d2), 4.0);
    assert_eq!(metric(pa, "vllm:nixl_xfer_time_seconds_count", &[]), 0.0);
    eventually("no room left", || no_rooms(pa, d1) && no_rooms(pa, d2));
}

/// The whole `/metrics` text of `addr`.
fn metric_text(addr: SocketAddr) -> String {
    http(addr, "GET", "/metrics", "").1
}

/// A worker whose `/health` answers but whose `/server_info` never does (the connection is held
/// open): its role stays unknown. Every other path is a 404; completions are counted. Stops on
/// drop.
struct SilentWorker {
    addr: SocketAddr,
    completions: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl SilentWorker {
    fn start() -> SilentWorker {
        use std::io::{BufRead, BufReader};
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let completions = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (o, st) = (completions.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(mut conn) = conn else { continue };
                let (o, st) = (o.clone(), st.clone());
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                    let mut line = String::new();
                    if reader.read_line(&mut line).is_err() {
                        return;
                    }
                    let path = line.split(' ').nth(1).unwrap_or("").to_string();
                    if path.contains("server_info") {
                        // Never answer; hold the connection until the test ends.
                        while !st.load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        return;
                    }
                    if path.starts_with("/v1/chat") || path.starts_with("/v1/completions") {
                        o.fetch_add(1, Ordering::Relaxed);
                    }
                    let status = if path == "/health" {
                        "200 OK"
                    } else {
                        "404 Not Found"
                    };
                    let _ = write!(
                        conn,
                        "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    );
                });
            }
        });
        SilentWorker {
            addr,
            completions,
            stop,
        }
    }

    /// Completion requests it got.
    fn completions(&self) -> usize {
        self.completions.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for SilentWorker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr); // wakes the accept loop
    }
}

#[test]
fn a_worker_without_server_info_is_both_and_one_that_never_answers_gets_no_traffic() {
    // A vLLM-protocol sim: 404 on /server_info and /get_server_info → no mode announced → both.
    let (_v, va) = sim(&[]);
    let silent = SilentWorker::start();
    // Round robin would send every other request to the silent worker if it were routable.
    let config = "[routing]\npolicy = \"round_robin\"\n[retry]\nmax_attempts = 1\n".to_string()
        + &auto_workers(&[va, silent.addr]);
    let (_g, ga) = serve(&config);
    eventually("the vLLM sim's role detected as both", || {
        metric(ga, "kvgate_worker_role", &["role=\"both\""]) == 1.0
    });
    for i in 0..6 {
        let (st, body) = http(
            ga,
            "POST",
            "/v1/chat/completions",
            &chat(&prompt(&format!("n{i}x"), 20), false, 2),
        );
        assert_eq!(st, 200, "{body}");
    }
    assert_eq!(
        silent.completions(),
        0,
        "a worker of unknown role got traffic"
    );
    assert_eq!(
        metric(ga, "kvgate_worker_role", &["role=\"unknown\""]),
        1.0,
        "the silent worker's role stays unknown"
    );
    let routable = format!("kvgate_worker_routable{{worker=\"{}\"}} 0", silent.addr);
    assert!(
        metric_text(ga).contains(&routable),
        "reported not routable: {routable}"
    );
}

// ---- TensorRT-LLM context-first (`[pd] protocol = "trtllm"`, `kvgate sim --pd-protocol trtllm`) ----

#[test]
fn trtllm_context_then_generation_streamed_and_not() {
    let (_p, pa) = sim(&["--role", "prefill", "--pd-protocol", "trtllm"]);
    let (_d, da) = sim(&["--role", "decode", "--pd-protocol", "trtllm"]);
    let (_g, ga) = gateway(
        "[pd]\nprotocol = \"trtllm\"\nmin_uncached_tokens = 0\n",
        &[pa],
        &[da],
    );
    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("t", 300), false, 5),
    );
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON answer");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{body}");
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap() >= 300,
        "{body}"
    );
    // Prompt and cached tokens from the context leg (cold), not the generation worker's pull.
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{body}"
    );
    assert_eq!(
        metric(
            ga,
            "kvgate_pd_decisions_total",
            &["path=\"disaggregated\"", "reason=\"prefilled\""]
        ),
        1.0
    );
    assert_eq!(metric(da, "vllm:nixl_xfer_time_seconds_count", &[]), 1.0);
    assert_eq!(pinned(pa), 0.0);

    let (st, body) = http(
        ga,
        "POST",
        "/v1/chat/completions",
        &chat(&prompt("u", 300), true, 4),
    );
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("[DONE]"), "{body}");
    assert!(!body.contains("\"error\""), "{body}");
    assert_eq!(metric(da, "vllm:nixl_xfer_time_seconds_count", &[]), 2.0);
    assert_eq!(pinned(pa), 0.0);
}
