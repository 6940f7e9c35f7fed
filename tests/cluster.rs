//! Cluster mode through the real binary (issue 18): a real `nats-server` on a loopback port,
//! `kvgate sim` workers without KV events (approximate index), and `kvgate serve` replicas sharing
//! routing state. Checked: replica B routes a prefix first seen by A to A's worker; a replica started
//! late gets the snapshot; NATS killed and restarted mid-run fails no request and re-syncs; a killed
//! replica drops out of its peers within the heartbeat timeout; malformed, oversized and
//! foreign-version messages are counted and dropped; a per-key rate limit holds across two
//! replicas (and is twice as loose with the cluster off); a route message counts only the blocks
//! past the worker's cached prefix (read off NATS and decoded).
//! Prints `skipped: nats-server not found` when it is missing, unless `CI` is set (then it fails).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};

use kvgate_system_tests::{Gateway, Proc, Sims};
use kvgate_testkit::net::wait_listening_blocking;
use kvgate_testkit::{free_port, poll_until_blocking, PATIENCE};
use std::time::{Duration, Instant};

fn nats(port: u16) -> Proc {
    let p = Proc(
        Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts"),
    );
    wait_listening_blocking(SocketAddr::from(([127, 0, 0, 1], port)), PATIENCE);
    p
}

/// One HTTP/1.1 exchange with `Connection: close`: (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    http_with(addr, method, path, "", body)
}

/// As [`http`] with extra header lines (each ending in `\r\n`).
fn http_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    kvgate_system_tests::harness::try_http_with(addr, method, path, headers, Some(body))
}

/// The value of the first sample of `metrics` whose line starts with `prefix` (0 when absent).
fn sample(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Requests served per worker, from `kvgate_requests_total`.
fn served(addr: SocketAddr) -> Vec<(String, f64)> {
    let (_, m) = http(addr, "GET", "/metrics", "").expect("metrics");
    m.lines()
        .filter(|l| l.starts_with("kvgate_requests_total{") && l.contains("status=\"200\""))
        .filter_map(|l| {
            let w = l.split("worker=\"").nth(1)?.split('"').next()?.to_string();
            Some((w, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// The replicas' heartbeat (and rate-limit usage report) period.
const HEARTBEAT_MS: u64 = 200;

fn replica(id: &str, nats_port: u16, workers: &[String]) -> Gateway {
    replica_with(id, Some(nats_port), workers, "")
}

/// A replica in the cluster on `nats_port` (or, with `None`, on its own), with `extra` TOML
/// tables in its config; ready when this returns.
fn replica_with(id: &str, nats_port: Option<u16>, workers: &[String], extra: &str) -> Gateway {
    let mut toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n\
         [routing]\npolicy = \"kv\"\n\
         [upstream]\nmonitor = false\n{extra}\n"
    );
    if let Some(nats_port) = nats_port {
        toml.push_str(&format!(
            "[cluster]\nnats_url = \"nats://127.0.0.1:{nats_port}\"\nreplica_id = \"{id}\"\n\
             subject_prefix = \"systest\"\nheartbeat_interval_ms = {HEARTBEAT_MS}\n\
             heartbeat_timeout_ms = 1500\nmax_message_bytes = 65536\nsnapshot_wait_ms = 300\n"
        ));
    }
    for (i, w) in workers.iter().enumerate() {
        toml.push_str(&format!(
            "[[workers]]\nname = \"w{i}\"\nurl = \"{w}\"\nmodels = [\"sim-model\"]\n"
        ));
    }
    let gw = Gateway::from_config(&toml);
    poll_until_blocking(PATIENCE, "the gateway to become ready", || {
        http(gw.addr, "GET", "/ready", "").map(|r| r.0).ok() == Some(200)
    });
    gw
}

fn metrics(addr: SocketAddr) -> String {
    http(addr, "GET", "/metrics", "").expect("metrics").1
}

fn until(what: &str, f: impl FnMut() -> bool) {
    poll_until_blocking(PATIENCE, what, f)
}

/// A prompt whose first ~300 words are unique to `group` (many full blocks) plus a `tail`.
fn prompt(group: u32, tail: u32) -> String {
    let words: Vec<String> = (0..300)
        .map(|i| format!("g{group}w{}", (i * 7919 + group * 31) % 1000))
        .collect();
    format!(
        r#"{{"model":"sim-model","messages":[{{"role":"user","content":"{} tail {tail}"}}],"max_tokens":2}}"#,
        words.join(" ")
    )
}

/// Send `body` to `addr`; the worker that served it (from the counters' delta).
fn route_once(addr: SocketAddr, body: &str) -> String {
    let before = served(addr);
    let (status, resp) = http(addr, "POST", "/v1/chat/completions", body).expect("request");
    assert_eq!(status, 200, "{resp}");
    let after = served(addr);
    after
        .into_iter()
        .find(|(w, n)| {
            before
                .iter()
                .find(|(b, _)| b == w)
                .map_or(*n > 0.0, |(_, m)| n > m)
        })
        .map(|(w, _)| w)
        .expect("a worker's counter grew")
}

/// Publish raw payloads on `subject` with the NATS text protocol (no client library needed).
fn nats_publish(port: u16, subject: &str, payloads: &[Vec<u8>]) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("nats");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    let mut info = String::new();
    r.read_line(&mut info).expect("INFO");
    assert!(info.starts_with("INFO"), "{info}");
    s.write_all(b"CONNECT {\"verbose\":false}\r\n")
        .expect("connect");
    for p in payloads {
        write!(s, "PUB {subject} {}\r\n", p.len()).expect("pub");
        s.write_all(p).expect("payload");
        s.write_all(b"\r\n").expect("crlf");
    }
    s.write_all(b"PING\r\n").expect("ping");
    let mut pong = String::new();
    while !pong.starts_with("PONG") {
        pong.clear();
        r.read_line(&mut pong).expect("PONG");
    }
}

/// True (after printing `skipped: ...`) when nats-server is missing locally; fails under CI.
fn nats_missing() -> bool {
    if Command::new("nats-server")
        .arg("--version")
        .output()
        .is_ok()
    {
        return false;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "nats-server not found (.ci/run installs it)"
    );
    println!("skipped: nats-server not found");
    true
}

#[test]
fn replicas_route_as_one_over_nats() {
    if nats_missing() {
        return;
    }
    let sims = Sims::start(4, "sim-model", &[]);
    let workers = sims.urls.clone();

    let port = free_port();
    let mut nats_proc = Some(nats(port));
    let a = replica("a", port, &workers);
    let b = replica("b", port, &workers);
    for r in [&a, &b] {
        until("peers see each other", || {
            sample(&metrics(r.addr), "kvgate_cluster_peers ") >= 1.0
        });
    }

    // A prefix first routed by A is routed by B to the same worker (its approximate index learnt
    // A's decision). With 4 idle workers a random agreement over 4 groups has odds 1/256. The
    // worker monitors are off: their scraped signals alone made two unsynced replicas agree.
    let mut first = Vec::new();
    for g in 0..4 {
        let wa = route_once(a.addr, &prompt(g, 0));
        until("A's decision applied at B", || {
            sample(
                &metrics(b.addr),
                "kvgate_cluster_messages_received_total{kind=\"route\"}",
            ) >= f64::from(g + 1)
        });
        let wb = route_once(b.addr, &prompt(g, 1));
        assert_eq!(wa, wb, "group {g}: B did not follow A's prefix");
        first.push(wa);
    }

    // A late replica gets the snapshot and routes the known prefixes there too.
    let c = replica("c", port, &workers);
    until("snapshot at C", || {
        sample(
            &metrics(c.addr),
            "kvgate_cluster_messages_received_total{kind=\"snapshot\"}",
        ) >= 1.0
    });
    for (g, w) in first.iter().enumerate() {
        assert_eq!(&route_once(c.addr, &prompt(g as u32, 2)), w, "C, group {g}");
    }
    drop(c);

    // NATS killed and restarted mid-run: no request fails, and the replicas re-sync.
    let mut failed = 0;
    for i in 0..40u32 {
        if i == 10 {
            nats_proc = None;
        }
        if i == 30 {
            nats_proc = Some(nats(port));
        }
        let r = if i % 2 == 0 { &a } else { &b };
        match http(
            r.addr,
            "POST",
            "/v1/chat/completions",
            &prompt(100 + i % 5, i),
        ) {
            Ok((200, _)) => {}
            _ => failed += 1,
        }
    }
    assert_eq!(failed, 0, "requests failed while NATS was down");
    for r in [&a, &b] {
        until("reconnected and re-synced", || {
            let m = metrics(r.addr);
            sample(&m, "kvgate_cluster_nats_connected ") == 1.0
                && sample(&m, "kvgate_cluster_nats_connects_total ") >= 2.0
        });
    }

    // Bad messages are counted and dropped.
    let mut foreign = vec![2u8, 5];
    foreign.extend_from_slice(&[0; 12]);
    nats_publish(
        port,
        "systest.msg",
        &[
            foreign,
            vec![1, 250, 0, 0],
            vec![1, 5, 0],
            vec![1u8; 70_000],
        ],
    );
    until("bad messages counted at B", || {
        let m = metrics(b.addr);
        sample(
            &m,
            "kvgate_cluster_messages_dropped_total{kind=\"unknown\",reason=\"version\"}",
        ) >= 1.0
            && sample(
                &m,
                "kvgate_cluster_messages_dropped_total{kind=\"unknown\",reason=\"unknown_kind\"}",
            ) >= 1.0
            && sample(
                &m,
                "kvgate_cluster_messages_dropped_total{kind=\"heartbeat\",reason=\"malformed\"}",
            ) >= 1.0
            && sample(
                &m,
                "kvgate_cluster_messages_dropped_total{kind=\"unknown\",reason=\"oversized\"}",
            ) >= 1.0
    });

    // Load is shared, and a killed replica's share expires within the heartbeat timeout: a long
    // stream through A counts at B until A dies.
    let stream_addr = a.addr;
    std::thread::spawn(move || {
        let body = r#"{"model":"sim-model","messages":[{"role":"user","content":"long"}],"max_tokens":100000,"ignore_eos":true,"stream":true}"#;
        let _ = http(stream_addr, "POST", "/v1/chat/completions", body);
    });
    until("A's stream counted at B", || {
        sample(&metrics(b.addr), "kvgate_cluster_remote_inflight_requests ") >= 1.0
    });
    let killed = Instant::now();
    drop(a);
    until("A expired at B", || {
        let m = metrics(b.addr);
        sample(&m, "kvgate_cluster_peers ") == 0.0
            && sample(&m, "kvgate_cluster_remote_inflight_requests ") == 0.0
    });
    // Generous: the 1.5 s timeout, one heartbeat, and a loaded machine's scheduling.
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "expiry took {:?}",
        killed.elapsed()
    );
    drop(nats_proc);
}

/// Sends the same key's requests alternately to `replicas` from 4 threads, 10 req/s each, for
/// `secs` seconds. Returns (accepted, rejected with 429, seconds from the first to the last send).
fn hammer(replicas: &[SocketAddr], key: &str, secs: f64) -> (u32, u32, f64) {
    let start = Instant::now();
    let threads: Vec<_> = (0..4u32)
        .map(|k| {
            let replicas = replicas.to_vec();
            let header = format!("authorization: Bearer {key}\r\n");
            std::thread::spawn(move || {
                let (mut ok, mut limited, mut last) = (0u32, 0u32, Duration::ZERO);
                let body = r#"{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
                for j in 0u32.. {
                    // Thread k's j-th send is due at k×25 ms + j×100 ms.
                    let due = Duration::from_millis(u64::from(k) * 25 + u64::from(j) * 100);
                    if due.as_secs_f64() >= secs {
                        break;
                    }
                    if let Some(wait) = due.checked_sub(start.elapsed()) {
                        std::thread::sleep(wait);
                    }
                    last = last.max(start.elapsed());
                    let to = replicas[((k + j) as usize) % replicas.len()];
                    match http_with(to, "POST", "/v1/chat/completions", &header, body) {
                        Ok((200, _)) => ok += 1,
                        Ok((429, _)) => limited += 1,
                        other => panic!("unexpected answer from {to}: {other:?}"),
                    }
                }
                (ok, limited, last)
            })
        })
        .collect();
    let mut total = (0, 0, Duration::ZERO);
    for t in threads {
        let (ok, limited, last) = t.join().expect("sender thread");
        total = (total.0 + ok, total.1 + limited, total.2.max(last));
    }
    (total.0, total.1, total.2.as_secs_f64())
}

/// Issue 18: a key limited to R req/s gets about R req/s in total through two replicas that
/// share their usage over NATS, not 2R as through two replicas on their own.
#[test]
fn per_key_rate_limit_holds_across_replicas() {
    if nats_missing() {
        return;
    }
    const RATE: f64 = 5.0;
    const BURST: f64 = 2.0;
    const SECS: f64 = 4.0;
    let auth = format!(
        "[auth]\nkeys = [{{ key = \"k-limited\", rate_per_s = {RATE:.1}, burst = {BURST:.1} }}]\n"
    );
    let sims = Sims::start(2, "sim-model", &[]);
    let workers = sims.urls.clone();
    let port = free_port();
    let _nats = nats(port);

    // Cluster on: every bucket is charged with the peer's admissions each heartbeat.
    let a = replica_with("a", Some(port), &workers, &auth);
    let b = replica_with("b", Some(port), &workers, &auth);
    for r in [&a, &b] {
        until("peers see each other", || {
            sample(&metrics(r.addr), "kvgate_cluster_peers ") >= 1.0
        });
    }
    let (shared_ok, shared_429, elapsed) = hammer(&[a.addr, b.addr], "k-limited", SECS);
    drop((a, b));

    // Cluster off: the same two replicas, each with its own bucket.
    let a = replica_with("a", None, &workers, &auth);
    let b = replica_with("b", None, &workers, &auth);
    let (alone_ok, alone_429, elapsed_alone) = hammer(&[a.addr, b.addr], "k-limited", SECS);
    println!(
        "cluster: {shared_ok} accepted, {shared_429} limited in {elapsed:.2} s; \
         no cluster: {alone_ok} accepted, {alone_429} limited in {elapsed_alone:.2} s"
    );

    // One bucket's worth: R × duration + the burst, plus the documented slack (docs/cluster.md):
    // the other replica's own starting burst, and up to (replicas − 1) × R × heartbeat interval
    // admitted before a usage report lands. One more request for timer granularity.
    let one = RATE * elapsed + BURST;
    let slack = BURST + RATE * HEARTBEAT_MS as f64 / 1e3 + 1.0;
    let shared = f64::from(shared_ok);
    assert!(
        shared <= one + slack,
        "cluster: {shared_ok} accepted, more than {one:.1} + slack {slack:.1}"
    );
    assert!(
        shared >= 0.8 * RATE * elapsed,
        "cluster: only {shared_ok} accepted"
    );
    // The load offered (40 req/s, 20 per replica) is 4x the rate: without the cluster each
    // replica admits its own R × duration + burst.
    let alone = f64::from(alone_ok);
    assert!(
        alone >= 1.7 * RATE * elapsed_alone,
        "no cluster: {alone_ok} accepted; expected about twice the rate"
    );
    assert!(
        alone >= 1.5 * shared,
        "no cluster ({alone_ok}) should admit clearly more than the cluster ({shared_ok})"
    );
}

/// Subscribe to `subject` with the NATS text protocol; returns the connection once the server
/// has registered the subscription.
fn nats_subscribe(port: u16, subject: &str) -> BufReader<TcpStream> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("nats");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    let mut line = String::new();
    r.read_line(&mut line).expect("INFO");
    write!(
        s,
        "CONNECT {{\"verbose\":false}}\r\nSUB {subject} 1\r\nPING\r\n"
    )
    .expect("sub");
    while !line.starts_with("PONG") {
        line.clear();
        r.read_line(&mut line).expect("PONG");
    }
    r
}

/// The next `route` message on a subscription (other kinds skipped, server PINGs answered).
fn next_route(r: &mut BufReader<TcpStream>) -> kvgate_cluster::Message {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < end, "no route message within 30 s");
        let mut line = String::new();
        assert!(r.read_line(&mut line).expect("read") > 0, "NATS closed");
        if line.starts_with("PING") {
            r.get_mut().write_all(b"PONG\r\n").expect("pong");
            continue;
        }
        let Some(n) = line
            .strip_prefix("MSG ")
            .and_then(|h| h.split_whitespace().last())
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        let mut payload = vec![0; n + 2];
        r.read_exact(&mut payload).expect("payload");
        let env = kvgate_cluster::wire::decode(&payload[..n], 1 << 20).expect("a valid message");
        if let m @ kvgate_cluster::Message::Route { .. } = env.msg {
            return m;
        }
    }
}

/// A route message counts the blocks the request adds on its worker, not its whole prompt: peers
/// sum them per request, so a prefix shared by many in-flight requests must not count once each.
#[test]
fn route_messages_count_blocks_beyond_the_cached_prefix() {
    if nats_missing() {
        return;
    }
    let sims = Sims::start(2, "sim-model", &[]);
    let workers = sims.urls.clone();
    let port = free_port();
    let _nats = nats(port);
    let a = replica("a", port, &workers);
    let mut sub = nats_subscribe(port, "systest.msg");
    let blocks_and_hashes = |m: kvgate_cluster::Message| match m {
        kvgate_cluster::Message::Route {
            blocks,
            hashes,
            worker,
            ..
        } => (blocks as usize, hashes, worker),
        _ => unreachable!("next_route returns routes"),
    };

    // A new prefix: every block is new on its worker.
    route_once(a.addr, &prompt(7, 0));
    let (first_blocks, first, w1) = blocks_and_hashes(next_route(&mut sub));
    assert!(first.len() > 10, "a long prompt: {} blocks", first.len());
    assert_eq!(first_blocks, first.len());

    // The same prefix again, on the worker that now holds it: only the blocks past it count.
    route_once(a.addr, &prompt(7, 1));
    let (second_blocks, second, w2) = blocks_and_hashes(next_route(&mut sub));
    assert_eq!(w1, w2, "the prefix holder was chosen");
    let shared = first
        .iter()
        .zip(&second)
        .take_while(|(x, y)| x == y)
        .count();
    assert!(
        shared + 2 >= second.len(),
        "the prompts share all but their tails"
    );
    assert_eq!(second_blocks, second.len() - shared);
}

/// Issue 30: chained Responses over two replicas and three sims with the store on. Each turn goes
/// to the other replica than the one that produced the previous response: the id's worker is
/// known there only through the `pin` message, and a follow-up on another worker would be 404.
#[test]
fn chained_responses_never_404_across_replicas() {
    if nats_missing() {
        return;
    }
    let port = free_port();
    let _nats = nats(port);
    let sims = Sims::start_with_env(
        3,
        "sim-model",
        &[],
        &[("VLLM_ENABLE_RESPONSES_API_STORE", "1")],
    );
    let a = replica("ra", port, &sims.urls);
    let b = replica("rb", port, &sims.urls);
    until("both replicas see each other", || {
        sample(&metrics(a.addr), "kvgate_cluster_peers ") >= 1.0
            && sample(&metrics(b.addr), "kvgate_cluster_peers ") >= 1.0
    });
    let replicas = [a.addr, b.addr];
    // Under load: 200 conversations of 5 turns, 10 at a time, each turn on the other replica.
    const CONVERSATIONS: usize = 200;
    const PARALLEL: usize = 10;
    let results: Vec<(usize, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..PARALLEL)
            .map(|t| {
                s.spawn(move || {
                    let (mut ok, mut not_found) = (0, 0);
                    for conv in (t..CONVERSATIONS).step_by(PARALLEL) {
                        let mut prev: Option<String> = None;
                        for turn in 0..5 {
                            let mut body = serde_json::json!({"model": "sim-model",
                                "max_output_tokens": 2, "store": true,
                                "input": format!("conversation {conv} turn {turn}")});
                            if let Some(p) = &prev {
                                body["previous_response_id"] = serde_json::json!(p);
                            }
                            let (status, text) = http(
                                replicas[(conv + turn) % 2],
                                "POST",
                                "/v1/responses",
                                &body.to_string(),
                            )
                            .expect("request");
                            match status {
                                200 => ok += 1,
                                404 => not_found += 1,
                                s => panic!("{s}: {text}"),
                            }
                            let v: serde_json::Value = serde_json::from_str(&text).expect("json");
                            prev = v["id"].as_str().map(str::to_owned);
                        }
                    }
                    (ok, not_found)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok: usize = results.iter().map(|r| r.0).sum();
    let not_found: usize = results.iter().map(|r| r.1).sum();
    assert_eq!((ok, not_found), (CONVERSATIONS * 5, 0));
    // Each replica pins what it produced at once and what its peer produced when the peer's
    // `pin` message arrives over the bus (the last turns' may still be on the way).
    let pins = (CONVERSATIONS * 5) as f64;
    until("every response id pinned on both replicas", || {
        sample(&metrics(a.addr), "kvgate_response_pins ") >= pins
            && sample(&metrics(b.addr), "kvgate_response_pins ") >= pins
    });
}

/// A replica with flow control on (tenants a:b:c weighted 2:1:1, one batch class), the busy
/// bound `max_inflight_per_worker = 2` (cluster-wide in cluster mode), in the cluster on
/// `nats_port`.
fn flow_replica(id: &str, nats_port: u16, workers: &[String]) -> Gateway {
    let mut toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n\
         [routing]\npolicy = \"least_loaded\"\nmax_inflight_per_worker = 2\n\
         [upstream]\nmonitor = false\n\
         [admission]\nqueue_size = 1000\nqueue_timeout_ms = 60000\n\
         [flow_control]\nenabled = true\nexpected_output_tokens = 16\n\
         [flow_control.tenants]\na = 2.0\nb = 1.0\nc = 1.0\n\
         [cluster]\nnats_url = \"nats://127.0.0.1:{nats_port}\"\nreplica_id = \"{id}\"\n\
         subject_prefix = \"flowtest\"\nheartbeat_interval_ms = {HEARTBEAT_MS}\n\
         heartbeat_timeout_ms = 1500\nsnapshot_wait_ms = 300\n"
    );
    for (i, w) in workers.iter().enumerate() {
        toml.push_str(&format!(
            "[[workers]]\nname = \"w{i}\"\nurl = \"{w}\"\nmodels = [\"sim-model\"]\n"
        ));
    }
    let gw = Gateway::from_config(&toml);
    poll_until_blocking(PATIENCE, "the gateway to become ready", || {
        http(gw.addr, "GET", "/ready", "").map(|r| r.0).ok() == Some(200)
    });
    gw
}

/// Tokens admitted per tenant (a, b, c) by the replicas together, from
/// `kvgate_flow_admitted_tokens_total`.
fn admitted_tokens(replicas: &[SocketAddr]) -> [f64; 3] {
    let mut out = [0.0; 3];
    for r in replicas {
        let m = metrics(*r);
        for (i, t) in ["a", "b", "c"].iter().enumerate() {
            out[i] += sample(
                &m,
                &format!("kvgate_flow_admitted_tokens_total{{class=\"default\",tenant=\"{t}\"}} "),
            );
        }
    }
    out
}

/// Flow control across replicas (docs/flow-control.md, "Cluster mode"). Three tenants weighted
/// 2:1:1 saturate a fleet of 4 slots through two replicas, unevenly: a only through replica A,
/// b only through B, c through both. Each replica alone would split its own share of the slots
/// between the tenants it sees (a ~33%, b ~25%, c ~42%); sharing queue heads, class clocks and
/// tenants' usage over NATS, the replicas serve tokens 50/25/25 (±15% of each share) cluster-wide. Then NATS
/// dies: both replicas go on serving on their own view (every request 200) and count it.
#[test]
fn flow_control_shares_are_cluster_wide_and_survive_the_bus() {
    if nats_missing() {
        return;
    }
    let sims = kvgate_system_tests::Sims::start_at(2, "sim-model", 2.0, &["--no-kv-events"], &[]);
    let port = free_port();
    let nats_proc = nats(port);
    let a = flow_replica("a", port, &sims.urls);
    let b = flow_replica("b", port, &sims.urls);
    until("the replicas to see each other", || {
        [a.addr, b.addr]
            .iter()
            .all(|r| sample(&metrics(*r), "kvgate_cluster_peers ") == 1.0)
    });

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failures = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let served = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let body = r#"{"model":"sim-model","messages":[{"role":"user","content":"share and share alike"}],"max_tokens":16,"ignore_eos":true}"#;
    let mut threads = Vec::new();
    for (tenant, addr, n) in [
        ("a", a.addr, 4),
        ("b", b.addr, 4),
        ("c", a.addr, 2),
        ("c", b.addr, 2),
    ] {
        for _ in 0..n {
            let (stop, failures, served) = (stop.clone(), failures.clone(), served.clone());
            threads.push(std::thread::spawn(move || {
                let header = format!("x-kvgate-tenant: {tenant}\r\n");
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match http_with(addr, "POST", "/v1/chat/completions", &header, body) {
                        Ok((200, _)) => {
                            served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Ok((s, b)) => failures.lock().unwrap().push(format!("{s}: {b}")),
                        Err(e) => failures.lock().unwrap().push(e.to_string()),
                    }
                }
            }));
        }
    }
    let replicas = [a.addr, b.addr];
    // Warm up (queues full at both replicas), then measure a window of admissions.
    until("both replicas to queue", || {
        replicas
            .iter()
            .all(|r| sample(&metrics(*r), "kvgate_queue_depth ") >= 2.0)
    });
    std::thread::sleep(Duration::from_secs(2));
    let t0 = admitted_tokens(&replicas);
    let start = Instant::now();
    let mut last = t0;
    // At least ~600 requests' worth of tokens in the window (and no longer than a minute).
    while start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(500));
        last = admitted_tokens(&replicas);
        let n: f64 = (0..3).map(|i| last[i] - t0[i]).sum();
        if start.elapsed() >= Duration::from_secs(10) && n >= 600.0 * 21.0 {
            break;
        }
    }
    let d: Vec<f64> = (0..3).map(|i| last[i] - t0[i]).collect();
    let total: f64 = d.iter().sum();
    let shares: Vec<f64> = d.iter().map(|x| x / total).collect();
    let deferrals: f64 = replicas
        .iter()
        .map(|r| sample(&metrics(*r), "kvgate_flow_cluster_deferrals_total "))
        .sum();
    println!(
        "cluster-wide token shares a/b/c: {:.1}% / {:.1}% / {:.1}% of {total} tokens in {:.1} s; \
         deferrals to a peer: {deferrals}",
        shares[0] * 100.0,
        shares[1] * 100.0,
        shares[2] * 100.0,
        start.elapsed().as_secs_f64()
    );
    // ±15 % of each share: replicas that ordered their queues alone would serve a 33 %, b 25 %
    // and c 42 % (a and c split replica a 2:1, b and c split replica b 1:1), outside it for a
    // and c; the peers' usage arrives a heartbeat late, which costs the heaviest tenant a few
    // points on a loaded machine (45-46 % measured with another process on a core).
    for (i, want) in [0.5, 0.25, 0.25].iter().enumerate() {
        assert!(
            (shares[i] - want).abs() <= want * 0.15,
            "tenant {}: {:.1}% (want {:.0}% ± 15%): shares {shares:?}",
            ["a", "b", "c"][i],
            shares[i] * 100.0,
            want * 100.0
        );
    }
    assert!(deferrals > 0.0, "the replicas left capacity to each other");

    // The bus goes down: each replica orders its own queue alone, and every request is served.
    let before = served.load(std::sync::atomic::Ordering::Relaxed);
    drop(nats_proc);
    until("both replicas to admit on their own view", || {
        replicas
            .iter()
            .all(|r| sample(&metrics(*r), "kvgate_flow_cluster_fallback_total ") >= 5.0)
    });
    until("requests to keep being served", || {
        served.load(std::sync::atomic::Ordering::Relaxed) >= before + 50
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let failures = failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "failed requests: {:?}",
        &failures[..failures.len().min(5)]
    );
}
