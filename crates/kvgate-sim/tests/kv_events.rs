//! KV events over real ZMQ sockets: the LRU victim's hashes come out as `BlockRemoved`, sequence
//! numbers are gap-free, and the independent Python decoder (msgpack + pyzmq) accepts both encodings.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use kvgate_sim::{EventEncoding, SimConfig, SimHandle, SimWorker};
use kvgate_testkit::PATIENCE;
use rmpv::Value as Mp;
use serde_json::json;
use support::*;
use zeromq::{Socket, SocketRecv};

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn field<'a>(ev: &'a Mp, key: &str) -> Option<&'a Mp> {
    ev.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Connect a subscriber to `w`'s events and wait until it is live: ZMQ drops what a publisher
/// sends before a subscription has reached it, so ask the sim for `AllBlocksCleared` batches
/// (`POST /reset_prefix_cache`, harmless on a cache the test has not filled yet) until one
/// arrives. Returns the subscriber and the seq of that batch.
async fn live_subscriber(w: &SimHandle) -> (zeromq::SubSocket, u64) {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://{}", w.kv_events_addr().unwrap()))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    let c = client();
    let reset = format!("{}/reset_prefix_cache", w.base_url());
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        assert_eq!(post(&c, &reset, &json!({})).await.0, 200);
        if let Ok(Ok(msg)) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            let frames = msg.into_vec();
            if let Some(seq) = frames.get(1).and_then(|f| f.as_ref().try_into().ok()) {
                return (sub, u64::from_be_bytes(seq));
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscriber never received a batch"
        );
    }
}

/// One batch: (seq, events); asserts the frame and batch layout.
fn batch(msg: zeromq::ZmqMessage) -> (u64, Vec<Mp>) {
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3);
    let seq = u64::from_be_bytes(frames[1].as_ref().try_into().unwrap());
    let batch = rmpv::decode::read_value(&mut frames[2].as_ref()).unwrap();
    let parts = batch.as_array().unwrap();
    assert_eq!(parts.len(), 3, "[ts, events, dp_rank]");
    assert!(parts[0].as_f64().is_some());
    (seq, parts[1].as_array().unwrap().clone())
}

/// The hashes of every event of type `kind` in `batches`.
fn hashes_of(batches: &[(u64, Vec<Mp>)], kind: &str) -> Vec<u64> {
    batches
        .iter()
        .flat_map(|(_, evs)| evs.iter())
        .filter(|e| field(e, "type").and_then(|t| t.as_str()) == Some(kind))
        .flat_map(|e| {
            field(e, "block_hashes")
                .unwrap()
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
        })
        .collect()
}

/// Receive batches after `after` until `done` holds for them (earlier ones, left from
/// [`live_subscriber`]'s requests, are skipped).
async fn receive_until(
    sub: &mut zeromq::SubSocket,
    after: u64,
    mut done: impl FnMut(&[(u64, Vec<Mp>)]) -> bool,
) -> Vec<(u64, Vec<Mp>)> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done(&out) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let msg = tokio::time::timeout(left, sub.recv())
            .await
            .unwrap_or_else(|_| panic!("batches stopped short: {out:?}"))
            .unwrap();
        let b = batch(msg);
        if b.0 > after {
            out.push(b);
        }
    }
    out
}

#[tokio::test]
async fn filling_the_cache_evicts_lru_and_emits_block_removed() {
    // 17 usable blocks; each prompt takes 8 full blocks (+1 partial).
    let cfg = SimConfig::default().speedup(0.0).num_gpu_blocks(18usize);
    let w = SimWorker::spawn(cfg, local(), Some(local())).await.unwrap();
    let (mut sub, live) = live_subscriber(&w).await;

    let c = client();
    let url = format!("{}/v1/completions", w.base_url());
    let send = |p: Vec<u32>| {
        let body = json!({"prompt": p, "max_tokens": 1, "ignore_eos": true});
        let (c, url) = (c.clone(), url.clone());
        async move { assert_eq!(post(&c, &url, &body).await.0, 200) }
    };
    send(ids(1, 130)).await;
    let first: Vec<u64> = w.cache_snapshot().await.iter().map(|b| b.hash).collect();
    assert_eq!(first.len(), 8);
    send(ids(2, 130)).await; // fits beside the first: no eviction yet
    send(ids(3, 130)).await; // needs 9 blocks, 1 free + evictions from the LRU (request 1's tail)
                             // Everything up to the last request's blocks being stored: events of one publisher arrive
                             // in order, so the evictions that made room for them came before.
    let now: Vec<u64> = w.cache_snapshot().await.iter().map(|b| b.hash).collect();
    let batches = receive_until(&mut sub, live, |b| {
        let stored = hashes_of(b, "BlockStored");
        now.iter().all(|h| stored.contains(h))
    })
    .await;
    let seqs: Vec<u64> = batches.iter().map(|b| b.0).collect();
    assert_eq!(
        seqs,
        (live + 1..live + 1 + seqs.len() as u64).collect::<Vec<_>>(),
        "gap-free"
    );
    let removed = hashes_of(&batches, "BlockRemoved");
    assert!(!removed.is_empty(), "no BlockRemoved");
    assert!(
        removed.iter().all(|h| first.contains(h)),
        "only the least recently used request's blocks go"
    );
    assert_eq!(removed[0], *first.last().unwrap(), "tail block first");
    assert!(removed.iter().all(|h| !now.contains(h)));
    w.shutdown().await;
}

async fn python_check(encoding: EventEncoding, flag: &str) {
    let python = match std::env::var("KVGATE_PYTHON") {
        Ok(p) if !p.is_empty() => p,
        _ if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: KVGATE_PYTHON not set");
            return;
        }
        _ => panic!("KVGATE_PYTHON must be set in CI"),
    };
    let mut cfg = SimConfig::default()
        .speedup(0.0)
        .num_gpu_blocks(40usize)
        .kv_events_encoding(encoding);
    cfg.kv_events_topic = "kv@sim".into();
    let w = SimWorker::spawn(cfg, local(), Some(local())).await.unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/check_kv_events.py");
    let out = tokio::process::Command::new(&python)
        .args([
            script,
            "--http",
            &w.base_url(),
            "--encoding",
            flag,
            "--topic",
            "kv@sim",
        ])
        .args([
            "--endpoint",
            &format!("tcp://{}", w.kv_events_addr().unwrap()),
        ])
        .args(["--replay", &format!("tcp://{}", w.replay_addr().unwrap())])
        .kill_on_drop(true)
        .output()
        .await
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success()
        && stderr.contains("ModuleNotFoundError")
        && std::env::var_os("CI").is_none()
    {
        eprintln!("skipped: {python} lacks msgpack/pyzmq: {stderr}");
        w.shutdown().await;
        return;
    }
    assert!(
        out.status.success(),
        "python decoder failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("\"ok\": true"), "{stdout}");
    eprintln!("{stdout}");
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decoder_accepts_map_encoding() {
    python_check(EventEncoding::Map, "map").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decoder_accepts_map_v024_encoding() {
    python_check(EventEncoding::MapV024, "map-0.24").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decoder_accepts_array_encoding() {
    python_check(EventEncoding::Array, "array").await;
}

#[tokio::test]
async fn garbage_events_are_interleaved_without_breaking_the_sequence() {
    let mut cfg = SimConfig::default().speedup(0.0).num_gpu_blocks(64usize);
    cfg.faults.garbage_events = 1.0;
    let w = SimWorker::spawn(cfg, local(), Some(local())).await.unwrap();
    let (mut sub, live) = live_subscriber(&w).await;
    let c = client();
    for i in 0..3 {
        let body = json!({"prompt": ids(i, 40), "max_tokens": 1});
        post(&c, &format!("{}/v1/completions", w.base_url()), &body).await;
    }
    // Until the third request's batch: every request stores blocks (one batch each at least),
    // and each batch has a garbage message beside it.
    let (mut good, mut bad, mut seqs) = (0, 0, Vec::new());
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while good < 3 || bad < 3 {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Ok(msg) = tokio::time::timeout(left, sub.recv()).await else {
            panic!("stopped short: good {good} bad {bad}");
        };
        let f = msg.unwrap().into_vec();
        let valid = f.len() == 3
            && f[1].len() == 8
            && rmpv::decode::read_value(&mut f[2].as_ref())
                .ok()
                .and_then(|v| v.as_array().map(|a| a.len() == 3))
                == Some(true);
        if !valid {
            bad += 1;
            continue;
        }
        let seq = u64::from_be_bytes(f[1].as_ref().try_into().unwrap());
        // Batches (and their garbage) from the subscription check are not counted.
        if seq > live {
            good += 1;
            seqs.push(seq);
        }
    }
    assert!(good >= 3 && bad >= 3, "good {good} bad {bad}");
    assert_eq!(
        seqs,
        (seqs[0]..seqs[0] + seqs.len() as u64).collect::<Vec<_>>()
    );
    w.shutdown().await;
}
