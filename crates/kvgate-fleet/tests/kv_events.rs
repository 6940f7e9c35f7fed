//! The KV-event subscriber against a ZMQ PUB + replay ROUTER in the test: late join and gaps are
//! filled by replay, garbage is counted and dropped, a sequence regression resets the worker, and the
//! resulting index equals applying the same batches directly.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_core::{KvIndex, WorkerId};
use kvgate_fleet::{
    apply_batch, IndexSink, KvEventsSource, KvSource, MonitorConfig, ResetReason, WorkerKind,
    WorkerMonitor,
};
use kvgate_protocol::kv_events::decode_payload;
use kvgate_testkit::{until, PATIENCE};
use parking_lot::{Mutex, RwLock};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const TOPIC: &str = "kv-events";

/// Published batches kept for replay: (seq, payload).
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// Splits a `.frames` fixture (u32-BE frame count, then u32-BE length + bytes per frame).
fn payloads(mut d: &[u8]) -> Vec<Vec<u8>> {
    fn u32be(d: &mut &[u8]) -> usize {
        let (h, t) = d.split_at(4);
        *d = t;
        u32::from_be_bytes(h.try_into().unwrap()) as usize
    }
    let mut out = Vec::new();
    while !d.is_empty() {
        let n = u32be(&mut d);
        let mut frames = Vec::new();
        for _ in 0..n {
            let len = u32be(&mut d);
            frames.push(d[..len].to_vec());
            d = &d[len..];
        }
        out.push(frames.pop().unwrap());
    }
    out
}

/// `[ts, [], 0]`: an empty scheduler step.
fn heartbeat() -> Vec<u8> {
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.extend_from_slice(&[0x90, 0x00]);
    p
}

fn msg(frames: Vec<Vec<u8>>) -> ZmqMessage {
    ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>()).unwrap()
}

struct Publisher {
    sock: zeromq::PubSocket,
    buffer: Buffer,
}

impl Publisher {
    /// Buffers for replay, and publishes unless `live` is false (a batch the subscriber misses).
    async fn send(&mut self, seq: u64, payload: Vec<u8>, live: bool) {
        self.buffer.lock().push((seq, payload.clone()));
        if live {
            let m = msg(vec![TOPIC.into(), seq.to_be_bytes().to_vec(), payload]);
            self.sock.send(m).await.unwrap();
        }
    }
}

/// A ROUTER answering `[b"", start]` like vLLM ≥ 0.26.
async fn replay_server(mut r: zeromq::RouterSocket, buffer: Buffer) {
    while let Ok(m) = r.recv().await {
        let f = m.into_vec();
        let (id, start) = (f[0].clone(), f.last().unwrap().clone());
        let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
        let batches: Vec<_> = buffer
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        for (seq, p) in batches {
            let frames = vec![
                id.to_vec(),
                vec![],
                TOPIC.into(),
                seq.to_be_bytes().to_vec(),
                p,
            ];
            r.send(msg(frames)).await.unwrap();
        }
        r.send(msg(vec![
            id.to_vec(),
            vec![],
            vec![],
            vec![0xff; 8],
            vec![],
        ]))
        .await
        .unwrap();
    }
}

fn reference(batches: &[Vec<u8>]) -> Vec<u64> {
    let mut idx = KvIndex::new();
    for (i, p) in batches.iter().enumerate() {
        apply_batch(
            &mut idx,
            WorkerId(0),
            &decode_payload(i as u64, p).unwrap(),
            16,
        );
    }
    idx.router_hashes(WorkerId(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_replays_gaps_drops_garbage_and_resets_on_regression() {
    let arr = payloads(include_bytes!(
        "../../kvgate-protocol/tests/fixtures/vllm_array.frames"
    ));
    let map = payloads(include_bytes!(
        "../../kvgate-protocol/tests/fixtures/vllm_map.frames"
    ));
    let content = vec![
        arr[0].clone(),
        arr[1].clone(),
        arr[2].clone(),
        map[0].clone(),
    ];

    let mut sock = zeromq::PubSocket::new();
    let ep = sock.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut router = zeromq::RouterSocket::new();
    let rep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let buffer = Arc::new(Mutex::new(Vec::new()));
    let replay_task = tokio::spawn(replay_server(router, buffer.clone()));
    let mut publisher = Publisher { sock, buffer };

    let sink = Arc::new(IndexSink::new(Arc::new(RwLock::new(KvIndex::new())), 16));
    let w = WorkerId(0);
    let mut cfg = MonitorConfig::new(w, "http://127.0.0.1:9", WorkerKind::Openai);
    cfg.health_interval = Duration::from_secs(60);
    cfg.kv_events = KvEventsSource::Endpoints(vec![KvSource {
        endpoint: ep,
        replay_endpoint: Some(rep),
        topic: TOPIC.into(),
    }]);
    cfg.block_size = Some(16);
    let handle = WorkerMonitor::spawn(cfg, sink.clone());

    // seq 2 is never sent live: the subscriber must replay it (or replay all if it joined late).
    for (seq, p) in content.iter().enumerate() {
        publisher.send(seq as u64, p.clone(), seq != 2).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut seq = content.len() as u64;
    // Heartbeats until the subscriber has caught up.
    while sink.view(w).last_seq.is_none_or(|s| s < 4) {
        publisher.send(seq, heartbeat(), true).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(seq < 500, "subscriber never caught up");
    }
    let idx_hashes = sink.index.read().router_hashes(w);
    assert_eq!(idx_hashes, reference(&content));
    assert!(!idx_hashes.is_empty());
    assert!(handle.stats().snapshot().kv_replays_ok >= 1);

    // Garbage (bad payload, wrong frame count) is counted and dropped; the stream goes on.
    publisher
        .sock
        .send(msg(vec![
            TOPIC.into(),
            seq.to_be_bytes().to_vec(),
            vec![0xc1, 0xff, 0x00],
        ]))
        .await
        .unwrap();
    publisher
        .sock
        .send(msg(vec![TOPIC.into(), vec![1, 2]]))
        .await
        .unwrap();
    let target = seq + 2;
    while sink.view(w).last_seq.is_none_or(|s| s < target) {
        publisher.send(seq, heartbeat(), true).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(handle.stats().snapshot().kv_malformed, 2);
    assert_eq!(sink.index.read().router_hashes(w), reference(&content));

    // The publisher restarts: seq goes back to 0 → the worker's entries are cleared.
    publisher.buffer.lock().clear();
    publisher.send(0, arr[0].clone(), true).await;
    until(PATIENCE, "regression reset", || {
        sink.view(w).resets.contains(&ResetReason::SeqRegression)
    })
    .await;
    until(PATIENCE, "new batch applied", || {
        sink.view(w).last_seq == Some(0)
    })
    .await;
    assert_eq!(sink.index.read().router_hashes(w), reference(&arr[..1]));

    handle.shutdown().await;
    replay_task.abort();
}
