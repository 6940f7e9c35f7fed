//! `kvgate serve` (and `kvgate epp`) following a Kubernetes InferencePool: a scripted API server
//! (`kvgate_gateway::mock::kube::MockKube`, in this test's process) lists and watches the pool and
//! its pods; the pods are `kvgate sim` workers on 127.0.0.1, 127.0.0.2 and 127.0.0.3, all on the
//! pool's one target port (as pods share a container port), each publishing KV events on the
//! pool's `kv_events_port`. Pods turning Ready or unready move the real binary's traffic.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Duration;

use kvgate_gateway::mock::kube::MockKube;
use kvgate_system_tests::harness::{http, sample};
use kvgate_system_tests::{kvgate_bin, Gateway, Proc};
use kvgate_testkit::{eventually_blocking, free_port};

const MODEL: &str = "kvgate-sim";

/// One `kvgate sim` on `ip:port`, or `None` if it could not bind.
fn sim_on(ip: &str, port: u16) -> Option<Proc> {
    let mut child = Command::new(kvgate_bin())
        .args(["sim", "--host", ip, "--port", &port.to_string()])
        .args(["--model", MODEL, "--speedup", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvgate sim starts");
    let out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let child = Proc(child);
    let mut lines = out.lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.trim() == "ready" => break,
            Some(Ok(_)) => {}
            _ => return None,
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Some(child)
}

/// Three sims on one port of 127.0.0.1..3.
fn pods() -> (u16, Vec<Proc>) {
    'again: for _ in 0..20 {
        let port = free_port();
        if port > 64000 {
            continue;
        }
        let mut sims = Vec::new();
        for ip in ["127.0.0.1", "127.0.0.2", "127.0.0.3"] {
            match sim_on(ip, port) {
                Some(s) => sims.push(s),
                None => continue 'again,
            }
        }
        return (port, sims);
    }
    panic!("no port free on three loopback addresses");
}

/// `kvgate epp --config` with `config` (and an ext_proc listener on port 0): its HTTP listener.
fn start_epp(config: &str) -> (Proc, std::net::SocketAddr, tempfile::NamedTempFile) {
    use std::io::Write;
    let mut file = tempfile::NamedTempFile::new().unwrap();
    write!(file, "{config}\n[epp]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let mut child = Command::new(kvgate_bin())
        .args(["epp", "--config"])
        .arg(file.path())
        .args(["--log", "warn"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate epp starts");
    let err = std::io::BufReader::new(child.stderr.take().unwrap());
    let proc = Proc(child);
    let mut lines = err.lines();
    let addr = loop {
        let Some(Ok(l)) = lines.next() else {
            panic!("kvgate epp exited before listening")
        };
        if let Some(a) = l.trim().strip_prefix("kvgate serve: listening on http://") {
            break a.parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (proc, addr, file)
}

fn chat(addr: std::net::SocketAddr, i: usize) {
    // Long enough for several full KV blocks (the sims publish BlockStored for full blocks only).
    let words = "the pods of an inference pool come and go ".repeat(20);
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{i} {words}"}}],"max_tokens":4}}"#
    );
    let (status, text) = http(addr, "POST", "/v1/chat/completions", Some(&body));
    assert_eq!(status, 200, "{text}");
}

/// Requests kvgate sent to one pod (`kvgate_requests_total` summed over its series).
fn served(metrics: &str, worker: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("kvgate_requests_total{") && l.contains(&format!("worker=\"{worker}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn serve_follows_the_inference_pool_pods() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = rt
        .block_on(MockKube::start("inference.networking.k8s.io", "v1", "ml"))
        .unwrap();
    let (port, _sims) = pods();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "system-test-token\n").unwrap();
    let app = [("app", "sim")];
    api.set_pool(MockKube::pool_v1("llama", &app, &[port]));
    api.put_pod(MockKube::pod("sim-0", &app, "127.0.0.1", true));
    api.put_pod(MockKube::pod("sim-1", &app, "127.0.0.2", true));
    api.put_pod(MockKube::pod("sim-2", &app, "127.0.0.3", false));

    let config = format!(
        r#"[server]
listen = "127.0.0.1:0"
request_log = false

[routing]
policy = "round_robin"

[[worker_pools]]
inference_pool = "llama"
namespace = "ml"
api_server = "{api}"
token_file = "{token}"
models = ["{MODEL}"]
kv_events_port = {kv}
"#,
        api = api.url(),
        token = token.display(),
        kv = port + 1000,
    );
    let gw = Gateway::from_config(&config);
    // The endpoint picker follows the same pool with the same code (checked by its members).
    let (_epp, epp_http, _epp_config) = start_epp(&config);
    let metrics = || http(gw.addr, "GET", "/metrics", None).1;
    let members_of = |addr, n: f64| {
        eventually_blocking(Duration::from_secs(30), || {
            sample(
                &http(addr, "GET", "/metrics", None).1,
                "kvgate_pool_members{pool=\"llama\"}",
            ) == Some(n)
        })
    };
    let members = |n: f64| members_of(gw.addr, n);
    let w = |ip: &str| format!("llama-{ip}:{port}");

    assert!(members(2.0), "{}", metrics());
    assert!(members_of(epp_http, 2.0));
    for i in 0..6 {
        chat(gw.addr, i);
    }
    let m = metrics();
    assert!(
        served(&m, &w("127.0.0.1")) > 0.0 && served(&m, &w("127.0.0.2")) > 0.0,
        "{m}"
    );
    assert_eq!(served(&m, &w("127.0.0.3")), 0.0);
    // The sims' KV events reach the exact index through the pool's kv_events_port.
    assert!(
        eventually_blocking(Duration::from_secs(30), || {
            sample(
                &metrics(),
                &format!(
                    "kvgate_worker_kv_events_total{{worker=\"{}\"}}",
                    w("127.0.0.1")
                ),
            )
            .is_some_and(|v| v > 0.0)
        }),
        "{}",
        metrics()
    );
    assert!(api
        .requests()
        .iter()
        .all(|(_, auth)| auth.as_deref() == Some("Bearer system-test-token")));

    // sim-0 turns unready, sim-2 Ready: two member sets applied, and the traffic moves.
    let updates = || {
        sample(
            &metrics(),
            "kvgate_pool_membership_updates_total{pool=\"llama\"}",
        )
    };
    let u0 = updates().expect("updates counted");
    api.put_pod(MockKube::pod("sim-0", &app, "127.0.0.1", false));
    api.put_pod(MockKube::pod("sim-2", &app, "127.0.0.3", true));
    assert!(
        eventually_blocking(Duration::from_secs(30), || updates() >= Some(u0 + 2.0)),
        "{}",
        metrics()
    );
    assert!(members(2.0));
    let before = served(&metrics(), &w("127.0.0.1"));
    for i in 0..6 {
        chat(gw.addr, 100 + i);
    }
    let m = metrics();
    assert_eq!(served(&m, &w("127.0.0.1")), before, "{m}");
    assert!(served(&m, &w("127.0.0.3")) > 0.0, "{m}");

    // The pool deleted: no members; requests get the front door's 404/503 (the sims still run).
    api.delete_pool("llama");
    assert!(members(0.0), "{}", metrics());
    assert!(members_of(epp_http, 0.0));
    let (status, text) = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        Some(&format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"x"}}]}}"#
        )),
    );
    assert!(status == 404 || status == 503, "{status} {text}");

    drop(gw);
    rt.block_on(api.stop());
}
