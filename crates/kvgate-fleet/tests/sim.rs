//! End to end against `kvgate_sim` workers in-process (vLLM-compatible engine, paged KV cache with
//! LRU eviction, ZMQ KV events in both encodings, garbage injection): after traffic, the exact index
//! holds exactly the sim's cached blocks, with router hashes recomputed from tokens; a restarted
//! worker is cleared and rebuilt.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_core::{hash_seed, next_hash, KvIndex, WorkerId};
use kvgate_fleet::http::HttpClient;
use kvgate_fleet::{
    IndexSink, KvEventsSource, MonitorConfig, ResetReason, WorkerKind, WorkerMonitor,
};
use kvgate_sim::{EventEncoding, Faults, SimConfig, SimHandle, SimWorker};
use kvgate_testkit::{free_port_pair, poll_until, PATIENCE};
use parking_lot::RwLock;

const BS: usize = 16;

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn sim(encoding: EventEncoding, seed: u64) -> SimHandle {
    let cfg = SimConfig::default()
        .block_size(BS)
        .num_gpu_blocks(40usize) // small: the workload below evicts
        .speedup(200.0)
        .mean_output_tokens(2u32)
        .seed(seed)
        .kv_events_encoding(encoding)
        .faults(Faults {
            garbage_events: 0.05,
            ..Faults::default()
        });
    SimWorker::spawn(cfg, any_port(), Some(any_port()))
        .await
        .unwrap()
}

/// Shared-prefix prompts as token arrays (3 system prefixes × several users).
fn prompts(round: u32) -> Vec<Vec<u32>> {
    (0..12u32)
        .map(|i| {
            let prefix = (i % 3) * 10_000;
            let mut p: Vec<u32> = (prefix..prefix + 64).collect();
            p.extend((0..40).map(|t| 50_000 + round * 1000 + i * 50 + t));
            p
        })
        .collect()
}

async fn drive(client: &HttpClient, base: &str, round: u32) {
    for p in prompts(round) {
        let body = serde_json::json!({"model": "kvgate-sim", "prompt": p, "max_tokens": 2});
        let r = client
            .post_json(
                base,
                "/v1/completions",
                Bytes::from(body.to_string()),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        assert!(r.status.is_success(), "{:?}", r.body);
    }
}

/// The sim's cache as (engine hashes, router hashes rebuilt by chaining tokens through parents).
async fn sim_view(h: &SimHandle) -> (BTreeSet<u64>, BTreeSet<u64>) {
    let snap = h.cache_snapshot().await;
    let by_hash: std::collections::HashMap<u64, _> = snap.iter().map(|e| (e.hash, e)).collect();
    let seed = hash_seed(None, None);
    let mut router = BTreeSet::new();
    for e in &snap {
        // Walk up to the root, then hash down; a block whose ancestor is gone cannot be rebuilt.
        let mut chain = vec![e];
        let mut ok = true;
        while let Some(p) = chain.last().unwrap().parent_hash {
            match by_hash.get(&p) {
                Some(pe) => chain.push(*pe),
                None => {
                    ok = false;
                    break;
                }
            }
        }
        if ok {
            let mut h = None;
            for b in chain.iter().rev() {
                h = Some(next_hash(h, &b.token_ids, seed));
            }
            router.insert(h.unwrap());
        }
    }
    (snap.iter().map(|e| e.hash).collect(), router)
}

async fn agrees(sink: &IndexSink, w: WorkerId, h: &SimHandle) -> bool {
    let (engine, router) = sim_view(h).await;
    let idx = sink.index.read();
    let got_engine: BTreeSet<u64> = idx.engine_hashes(w).into_iter().collect();
    let got_router: BTreeSet<u64> = idx.router_hashes(w).into_iter().collect();
    !engine.is_empty() && got_engine == engine && router.is_subset(&got_router)
}

/// Wait until the monitor's KV-event subscriber is connected to `h`: send throwaway requests, each
/// with a new full block so it publishes a batch (their blocks are part of the cache the index
/// must match later), until `batches` counts one.
async fn until_subscribed(client: &HttpClient, h: &SimHandle, batches: impl Fn() -> u64) {
    let sent = std::sync::atomic::AtomicU32::new(0);
    poll_until(
        PATIENCE,
        "the KV-event subscriber's first batch",
        || async {
            let n = sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let prompt: Vec<u32> = (0..20).map(|t| 90_000 + n * 20 + t).collect();
            let body =
                serde_json::json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 1});
            let r = client
                .post_json(
                    &h.base_url(),
                    "/v1/completions",
                    Bytes::from(body.to_string()),
                    Duration::from_secs(10),
                )
                .await
                .unwrap();
            assert!(r.status.is_success(), "{:?}", r.body);
            batches() > 0
        },
    )
    .await
}

async fn until_agrees(sink: &IndexSink, w: WorkerId, h: &SimHandle) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !agrees(sink, w, h).await {
        if tokio::time::Instant::now() > deadline {
            let (engine, _) = sim_view(h).await;
            let got: BTreeSet<u64> = sink.index.read().engine_hashes(w).into_iter().collect();
            let v = sink.view(w);
            panic!(
                "index ({} blocks) never matched the sim cache ({} blocks): {} missing, {} extra; \
                 resets {:?}, last seq {:?}, batches {}, unknown parents {}",
                got.len(),
                engine.len(),
                engine.difference(&got).count(),
                got.difference(&engine).count(),
                v.resets,
                v.last_seq,
                v.batches,
                v.unknown_parents
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn monitor(w: WorkerId, h: &SimHandle) -> MonitorConfig {
    let mut c = MonitorConfig::new(w, h.base_url(), WorkerKind::Vllm);
    c.block_size = Some(BS as u32);
    c.kv_events = KvEventsSource::Discover;
    c.scrape_interval = Duration::from_millis(50);
    c.health_interval = Duration::from_millis(50);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_index_matches_sim_cache_under_eviction_both_encodings() {
    let sink = Arc::new(IndexSink::new(
        Arc::new(RwLock::new(KvIndex::new())),
        BS as u32,
    ));
    let a = sim(EventEncoding::Map, 1).await;
    let b = sim(EventEncoding::Array, 2).await;
    let ha = WorkerMonitor::spawn(monitor(WorkerId(0), &a), sink.clone());
    let hb = WorkerMonitor::spawn(monitor(WorkerId(1), &b), sink.clone());
    let client = HttpClient::new();
    // Wait until both subscribers are connected (discovery + connect): the batches after that
    // arrive live, anything earlier is recovered by replay.
    until_subscribed(&client, &a, || ha.stats().snapshot().kv_batches).await;
    until_subscribed(&client, &b, || hb.stats().snapshot().kv_batches).await;
    for round in 0..3 {
        drive(&client, &a.base_url(), round).await;
        drive(&client, &b.base_url(), round + 10).await;
    }
    until_agrees(&sink, WorkerId(0), &a).await;
    until_agrees(&sink, WorkerId(1), &b).await;
    let sa = ha.stats().snapshot();
    assert!(sa.kv_batches > 0);
    for w in [WorkerId(0), WorkerId(1)] {
        let v = sink.view(w);
        assert!(v.removed_total > 0, "the workload must evict ({w})");
        assert!(v.load.is_some(), "metrics were scraped too");
    }
    assert_eq!(sink.view(WorkerId(0)).block_size_mismatch, None);
    eprintln!("worker a stats: {sa:?}");
    eprintln!("worker b stats: {:?}", hb.stats().snapshot());
    ha.shutdown().await;
    hb.shutdown().await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_sim_worker_is_cleared_and_rebuilt() {
    let sink = Arc::new(IndexSink::new(
        Arc::new(RwLock::new(KvIndex::new())),
        BS as u32,
    ));
    // Fixed event ports (as in a real deployment), so the restarted worker publishes and replays
    // where discovery found the first one (the sim's replay port is the events port + 100).
    let kv = SocketAddr::from(([127, 0, 0, 1], free_port_pair(100)));
    let cfg = SimConfig::default()
        .block_size(BS)
        .num_gpu_blocks(40usize)
        .speedup(200.0)
        .mean_output_tokens(2u32)
        .seed(3u64);
    let a = SimWorker::spawn(cfg, any_port(), Some(kv)).await.unwrap();
    let http = a.http_addr();
    let w = WorkerId(5);
    let h = WorkerMonitor::spawn(monitor(w, &a), sink.clone());
    let client = HttpClient::new();
    until_subscribed(&client, &a, || h.stats().snapshot().kv_batches).await;
    drive(&client, &a.base_url(), 0).await;
    until_agrees(&sink, w, &a).await;
    // Restart on the same addresses: a fresh engine (empty cache, seq from 0).
    a.shutdown().await;
    let cfg = SimConfig::default()
        .block_size(BS)
        .num_gpu_blocks(40usize)
        .speedup(200.0)
        .mean_output_tokens(2u32)
        .seed(4u64);
    // The old sockets may take a moment to release their ports (ZMQ closes asynchronously):
    // retry the bind for a bounded time instead of racing it.
    let bind_deadline = tokio::time::Instant::now() + PATIENCE;
    let a2 = loop {
        match SimWorker::spawn(cfg.clone(), http, Some(kv)).await {
            Ok(a2) => break a2,
            Err(e) if tokio::time::Instant::now() < bind_deadline => {
                eprintln!("restart bind retry: {e:#}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("sim did not restart on its old ports: {e:#}"),
        }
    };
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        drive(&client, &a2.base_url(), 1).await;
        let resets = sink.view(w).resets;
        if resets
            .iter()
            .any(|r| matches!(r, ResetReason::SeqRegression | ResetReason::Restart))
            && agrees(&sink, w, &a2).await
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "index was not rebuilt: {resets:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Nothing of the old engine's cache survives.
    let (engine_now, _) = sim_view(&a2).await;
    let got: BTreeSet<u64> = sink.index.read().engine_hashes(w).into_iter().collect();
    assert_eq!(got, engine_now);
    h.shutdown().await;
    a2.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_restarted_on_new_event_ports_is_rediscovered() {
    let sink = Arc::new(IndexSink::new(
        Arc::new(RwLock::new(KvIndex::new())),
        BS as u32,
    ));
    let cfg = |seed: u64| {
        SimConfig::default()
            .block_size(BS)
            .num_gpu_blocks(40usize)
            .speedup(200.0)
            .mean_output_tokens(2u32)
            .seed(seed)
    };
    let a = SimWorker::spawn(cfg(5), any_port(), Some(any_port()))
        .await
        .unwrap();
    let (http, old_kv) = (a.http_addr(), a.kv_events_addr().unwrap());
    let w = WorkerId(6);
    let h = WorkerMonitor::spawn(monitor(w, &a), sink.clone());
    let client = HttpClient::new();
    drive(&client, &a.base_url(), 0).await;
    until_agrees(&sink, w, &a).await;
    a.shutdown().await;
    // Same HTTP address, new ephemeral event and replay ports: only re-discovery finds them.
    let a2 = loop {
        match SimWorker::spawn(cfg(6), http, Some(any_port())).await {
            Ok(a2) => break a2,
            Err(e) => {
                eprintln!("restart bind retry: {e:#}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_ne!(a2.kv_events_addr().unwrap(), old_kv);
    drive(&client, &a2.base_url(), 1).await;
    until_agrees(&sink, w, &a2).await;
    let (engine_now, _) = sim_view(&a2).await;
    let got: BTreeSet<u64> = sink.index.read().engine_hashes(w).into_iter().collect();
    assert_eq!(got, engine_now, "nothing of the old engine survives");
    h.shutdown().await;
    a2.shutdown().await;
}

/// A TCP relay whose connections can be cut (a network blip between kvgate and the publisher).
async fn relay(
    target: SocketAddr,
) -> (
    SocketAddr,
    tokio::sync::watch::Sender<u64>,
    tokio::task::JoinHandle<()>,
) {
    let l = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let (cut, rx) = tokio::sync::watch::channel(0u64);
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            // A peer that closes before accept (ECONNABORTED) must not end the relay.
            let Ok((mut c, _)) = l.accept().await else {
                continue;
            };
            let mut rx = rx.clone();
            rx.borrow_and_update();
            conns.spawn(async move {
                let Ok(mut s) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut c, &mut s) => {}
                    _ = rx.changed() => {}
                }
            });
        }
    });
    (addr, cut, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_reconnect_after_a_blip_resumes_without_clearing() {
    let sink = Arc::new(IndexSink::new(
        Arc::new(RwLock::new(KvIndex::new())),
        BS as u32,
    ));
    let a = sim(EventEncoding::Map, 7).await;
    let (relay_addr, cut, relay_task) = relay(a.kv_events_addr().unwrap()).await;
    let w = WorkerId(7);
    let mut c = monitor(w, &a);
    c.kv_events = KvEventsSource::Endpoints(vec![kvgate_fleet::KvSource {
        endpoint: format!("tcp://{relay_addr}"),
        replay_endpoint: Some(format!("tcp://{}", a.replay_addr().unwrap())),
        topic: String::new(),
    }]);
    let h = WorkerMonitor::spawn(c, sink.clone());
    let client = HttpClient::new();
    drive(&client, &a.base_url(), 0).await;
    until_agrees(&sink, w, &a).await;
    let replays = h.stats().snapshot().kv_replays_ok;
    cut.send_modify(|e| *e += 1);
    // Published while the subscriber is away or reconnecting: recovered by the resume replay.
    drive(&client, &a.base_url(), 1).await;
    until_agrees(&sink, w, &a).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while h.stats().snapshot().kv_replays_ok == replays {
        assert!(tokio::time::Instant::now() < deadline, "no resume replay");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drive(&client, &a.base_url(), 2).await;
    until_agrees(&sink, w, &a).await;
    assert_eq!(sink.view(w).resets, [], "same process: nothing cleared");
    assert!(h.stats().snapshot().kv_reconnects >= 1);
    h.shutdown().await;
    relay_task.abort();
    a.shutdown().await;
}

/// `role = auto`: the role comes from `/server_info` whatever the configured kind; a worker that
/// announces no mode (a vLLM server: 404 on both paths) serves whole requests; one that does not
/// answer yet is asked again until it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_is_detected_from_server_info_and_retried_until_the_worker_answers() {
    use kvgate_protocol::pd::Role;
    let sink = Arc::new(IndexSink::new(
        Arc::new(RwLock::new(KvIndex::new())),
        BS as u32,
    ));
    let sglang = |role| {
        SimConfig::default().speedup(0.0).pd(kvgate_sim::PdConfig {
            role,
            protocol: kvgate_sim::PdProtocol::Sglang,
            ..kvgate_sim::PdConfig::default()
        })
    };
    let prefill = SimWorker::spawn(sglang(Role::Prefill), any_port(), None)
        .await
        .unwrap();
    let vllm = SimWorker::spawn(SimConfig::default().speedup(0.0), any_port(), None)
        .await
        .unwrap();
    // Nothing listens there yet.
    let late_addr = std::net::TcpListener::bind(any_port())
        .unwrap()
        .local_addr()
        .unwrap();
    let start = |w: WorkerId, base: String| {
        let mut c = MonitorConfig::new(w, base, WorkerKind::Vllm);
        c.kv_events = KvEventsSource::Off;
        c.scrape_interval = Duration::from_millis(50);
        c.health_interval = Duration::from_millis(50);
        c.detect_role = true;
        c.role_recheck = Duration::from_millis(100);
        WorkerMonitor::spawn(c, sink.clone())
    };
    let handles = [
        start(WorkerId(0), prefill.base_url()),
        start(WorkerId(1), vllm.base_url()),
        start(WorkerId(2), format!("http://{late_addr}")),
    ];
    let until_known = |w: WorkerId| {
        let sink = sink.clone();
        async move {
            let deadline = tokio::time::Instant::now() + PATIENCE;
            loop {
                if let Some(r) = sink.view(w).role {
                    return r;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "role of {w} never detected"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let p = until_known(WorkerId(0)).await;
    assert_eq!((p.role, p.announced), (Role::Prefill, true));
    assert_eq!(p.bootstrap_port, Some(prefill.http_addr().port()));
    let v = until_known(WorkerId(1)).await;
    assert_eq!(
        (v.role, v.announced, v.bootstrap_port),
        (Role::Both, false, None)
    );
    assert_eq!(sink.view(WorkerId(2)).role, None, "nobody answered yet");
    let late = SimWorker::spawn(sglang(Role::Decode), late_addr, None)
        .await
        .unwrap();
    let d = until_known(WorkerId(2)).await;
    assert_eq!((d.role, d.announced), (Role::Decode, true));
    // The prefill worker restarts as a decode worker at the same address: the re-check sees it.
    let addr = prefill.http_addr();
    prefill.shutdown().await;
    let restarted = SimWorker::spawn(sglang(Role::Decode), addr, None)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while sink.view(WorkerId(0)).role.map(|r| r.role) != Some(Role::Decode) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "role change never seen: {:?}",
            sink.view(WorkerId(0)).role
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for h in handles {
        h.shutdown().await;
    }
    for s in [restarted, vllm, late] {
        s.shutdown().await;
    }
}
