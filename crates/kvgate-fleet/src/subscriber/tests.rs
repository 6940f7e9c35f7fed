//! The subscriber against a real (in-process) `kvgate sim` publisher.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_core::{KvIndex, WorkerId};
use kvgate_sim::{SimConfig, SimHandle, SimWorker};
use parking_lot::RwLock;
use tokio_util::sync::CancellationToken;

use super::{run, SubscriberSettings};
use crate::discover::KvSource;
use crate::http::HttpClient;
use crate::reset::ResetBus;
use crate::{FleetStats, IndexSink, ResetReason};

const BS: usize = 16;

async fn sim() -> SimHandle {
    let cfg = SimConfig::default()
        .block_size(BS)
        .num_gpu_blocks(64usize)
        .speedup(200.0)
        .mean_output_tokens(2u32)
        .seed(9u64);
    let any = "127.0.0.1:0".parse().unwrap();
    SimWorker::spawn(cfg, any, Some(any)).await.unwrap()
}

async fn drive(h: &SimHandle) {
    let client = HttpClient::new();
    for i in 0..6u32 {
        let p: Vec<u32> = (0..48).chain((0..24).map(|t| 1000 + i * 100 + t)).collect();
        let body = serde_json::json!({"model": "kvgate-sim", "prompt": p, "max_tokens": 2});
        let r = client
            .post_json(
                &h.base_url(),
                "/v1/completions",
                Bytes::from(body.to_string()),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        assert!(r.status.is_success());
    }
}

async fn wait_agrees(sink: &IndexSink, w: WorkerId, h: &SimHandle) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let engine: BTreeSet<u64> = h.cache_snapshot().await.iter().map(|e| e.hash).collect();
        let got: BTreeSet<u64> = sink.index.read().engine_hashes(w).into_iter().collect();
        if !engine.is_empty() && got == engine {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "index {} blocks, sim {} blocks",
            got.len(),
            engine.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The flake behind `restarted_sim_worker_is_cleared_and_rebuilt`: the health checker's "came
/// back" clear landed after the subscriber had rebuilt from replay; the subscriber did not know,
/// and with no new traffic the index stayed empty. Now every clear reaches the subscriber, which
/// rebuilds from the replay buffer on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clear_from_elsewhere_is_rebuilt_from_replay_without_new_traffic() {
    let h = sim().await;
    let w = WorkerId(3);
    let sink = Arc::new(IndexSink::new(
        Arc::new(RwLock::new(KvIndex::new())),
        BS as u32,
    ));
    let stats = Arc::new(FleetStats::default());
    let bus = Arc::new(ResetBus::new(w, sink.clone(), stats.clone()));
    let mut s = SubscriberSettings::new(KvSource {
        endpoint: format!("tcp://{}", h.kv_events_addr().unwrap()),
        replay_endpoint: Some(format!("tcp://{}", h.replay_addr().unwrap())),
        topic: String::new(),
    });
    s.block_size = Some(BS as u32);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run(
        w,
        "sim".into(),
        s,
        sink.clone(),
        stats.clone(),
        bus.clone(),
        cancel.clone(),
    ));
    drive(&h).await;
    wait_agrees(&sink, w, &h).await;
    // Joining after the traffic works too: the history replay found it all.
    bus.restarted();
    assert_eq!(sink.view(w).resets, [ResetReason::Restart]);
    wait_agrees(&sink, w, &h).await;
    assert!(stats.snapshot().kv_replays_ok >= 2);
    cancel.cancel();
    task.await.unwrap();
    h.shutdown().await;
}

/// A replay endpoint that refuses: the history is given up after a bounded number of attempts and
/// the held live batches are applied (the index follows the live stream), instead of waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_replay_endpoint_is_given_up_and_live_batches_applied() {
    let h = sim().await;
    let w = WorkerId(4);
    let sink = Arc::new(IndexSink::new(
        Arc::new(RwLock::new(KvIndex::new())),
        BS as u32,
    ));
    let stats = Arc::new(FleetStats::default());
    let bus = Arc::new(ResetBus::new(w, sink.clone(), stats.clone()));
    // A port nothing listens on (bound, then released).
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut s = SubscriberSettings::new(KvSource {
        endpoint: format!("tcp://{}", h.kv_events_addr().unwrap()),
        replay_endpoint: Some(format!("tcp://{dead}")),
        topic: String::new(),
    });
    // Given up ~1.5 s after connecting (0.1 + 0.2 + 0.4 + 0.8 s): the traffic below arrives while
    // the history is pending, is held, and applied in order once it is given up.
    s.history_retry = Duration::from_millis(50);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run(
        w,
        "sim".into(),
        s,
        sink.clone(),
        stats.clone(),
        bus,
        cancel.clone(),
    ));
    // Subscribed before the traffic, so the live stream alone describes the whole cache.
    tokio::time::sleep(Duration::from_millis(300)).await;
    drive(&h).await;
    wait_agrees(&sink, w, &h).await;
    assert!(stats.snapshot().kv_replays_failed >= 5);
    assert_eq!(stats.snapshot().kv_replays_ok, 0);
    cancel.cancel();
    task.await.unwrap();
    h.shutdown().await;
}

/// A TCP relay to `target` on a fixed port that can be taken down (connections cut, port closed)
/// and brought back on the same port: the same publisher process, unreachable for a while.
struct Relay {
    addr: std::net::SocketAddr,
    up: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(target: std::net::SocketAddr) -> Relay {
        let first = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = first.local_addr().unwrap();
        let (up, mut rx) = tokio::sync::watch::channel(true);
        let task = tokio::spawn(async move {
            let mut listener = Some(first);
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Some(l) = listener.as_ref() else {
                    // Down: wait to come back, then rebind the same port.
                    if rx.changed().await.is_err() {
                        return;
                    }
                    if *rx.borrow_and_update() {
                        listener = tokio::net::TcpListener::bind(addr).await.ok();
                    }
                    continue;
                };
                tokio::select! {
                    r = rx.changed() => {
                        if r.is_err() {
                            return;
                        }
                        if !*rx.borrow_and_update() {
                            listener = None;
                            conns.abort_all();
                        }
                    }
                    a = l.accept() => {
                        let Ok((mut c, _)) = a else { continue };
                        conns.spawn(async move {
                            if let Ok(mut s) = tokio::net::TcpStream::connect(target).await {
                                let _ = tokio::io::copy_bidirectional(&mut c, &mut s).await;
                            }
                        });
                    }
                }
            }
        });
        Relay { addr, up, task }
    }
}

/// A clear made while the subscriber is disconnected from a publisher that then comes back (same
/// process): the reconnect must rebuild from the history, not resume from its last seq on top of
/// an emptied index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clear_while_disconnected_is_rebuilt_on_reconnect() {
    let h = sim().await;
    let relay = Relay::start(h.kv_events_addr().unwrap()).await;
    let w = WorkerId(5);
    let sink = Arc::new(IndexSink::new(
        Arc::new(RwLock::new(KvIndex::new())),
        BS as u32,
    ));
    let stats = Arc::new(FleetStats::default());
    let bus = Arc::new(ResetBus::new(w, sink.clone(), stats.clone()));
    let mut s = SubscriberSettings::new(KvSource {
        endpoint: format!("tcp://{}", relay.addr),
        replay_endpoint: Some(format!("tcp://{}", h.replay_addr().unwrap())),
        topic: String::new(),
    });
    s.backoff_min = Duration::from_millis(200);
    s.backoff_max = Duration::from_millis(400);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run(
        w,
        "sim".into(),
        s,
        sink.clone(),
        stats.clone(),
        bus.clone(),
        cancel.clone(),
    ));
    drive(&h).await;
    wait_agrees(&sink, w, &h).await;
    relay.up.send_replace(false);
    // Wait until the subscriber noticed and is retrying against the closed port.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stats.snapshot().kv_reconnects < 2 {
        assert!(tokio::time::Instant::now() < deadline, "never reconnected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bus.restarted(); // e.g. the health checker saw a flap
    assert_eq!(sink.index.read().engine_hashes(w).len(), 0);
    relay.up.send_replace(true);
    wait_agrees(&sink, w, &h).await;
    cancel.cancel();
    task.await.unwrap();
    relay.task.abort();
    h.shutdown().await;
}
