//! kvgate-cluster against a real `nats-server` on a loopback port: propagation, own messages,
//! subject prefixes, bad payloads, snapshots for a late replica, and NATS restarted mid-run.
//! Skips (prints `skipped: …`) when `nats-server` is missing, unless `CI` is set.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_cluster::metrics::{DropLabel, KindLabel};
use kvgate_cluster::wire::{encode, Envelope};
use kvgate_cluster::{
    Cluster, ClusterConfig, ClusterMetrics, DropReason, Message, Sink, WIRE_VERSION,
};
use kvgate_testkit::{free_port, PATIENCE};
use parking_lot::Mutex;

struct Nats {
    child: Child,
}

impl Nats {
    fn start(port: u16) -> Option<Nats> {
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let nats = Nats { child };
        kvgate_testkit::net::wait_listening_blocking(([127, 0, 0, 1], port).into(), PATIENCE);
        Some(nats)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}

fn have_nats() -> bool {
    let ok = Command::new("nats-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "nats-server not found (CI must install it: .ci/run)"
        );
        println!("skipped: nats-server not found");
    }
    ok
}

#[derive(Default)]
struct Recorder {
    got: Mutex<Vec<(String, Message)>>,
    approx: Vec<(String, Vec<u64>)>,
}

impl Sink for Recorder {
    fn apply(&self, from: &str, msg: &Message, _now: Instant) -> Result<(), DropReason> {
        if let Message::Route { worker, .. } = msg {
            if worker == "unknown" {
                return Err(DropReason::UnknownWorker);
            }
        }
        self.got.lock().push((from.to_owned(), msg.clone()));
        Ok(())
    }
    fn approx_entries(&self) -> Vec<(String, Vec<u64>)> {
        self.approx.clone()
    }
    fn expire(&self, _now: Instant, _timeout: Duration) {}
    fn take_rate_usage(&self) -> Vec<(u64, u32)> {
        Vec::new()
    }
}

impl Recorder {
    fn has(&self, f: impl Fn(&str, &Message) -> bool) -> bool {
        self.got.lock().iter().any(|(r, m)| f(r, m))
    }
}

fn config(port: u16, id: &str, prefix: &str) -> ClusterConfig {
    ClusterConfig {
        nats_url: format!("nats://127.0.0.1:{port}"),
        replica_id: id.into(),
        subject_prefix: prefix.into(),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_millis(1000),
        max_message_bytes: 65536,
        queue_capacity: 1024,
        snapshot_wait: Duration::from_millis(300),
    }
}

fn node(port: u16, id: &str, prefix: &str, sink: Arc<Recorder>) -> (Arc<Cluster>, ClusterMetrics) {
    let m = ClusterMetrics::register(&mut prometheus_client::registry::Registry::default());
    let c = Cluster::start(config(port, id, prefix), sink, m.clone()).expect("start");
    (c, m)
}

async fn until(what: &str, f: impl Fn() -> bool) {
    kvgate_testkit::until(PATIENCE, what, f).await
}

fn route(request: u64, hashes: Vec<u64>) -> Message {
    Message::Route {
        model: "m".into(),
        worker: "w1".into(),
        request,
        prefill_tokens: 100,
        blocks: hashes.len() as u32,
        hashes,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_state_over_a_real_nats() {
    if !have_nats() {
        return;
    }
    let port = free_port();
    let mut nats = Nats::start(port).expect("nats-server starts");

    let sa = Arc::new(Recorder::default());
    let sb = Arc::new(Recorder {
        approx: vec![("w2".into(), vec![11, 12])],
        ..Default::default()
    });
    let so = Arc::new(Recorder::default());
    let (a, ma) = node(port, "a", "fleet1", sa.clone());
    let (b, mb) = node(port, "b", "fleet1", sb.clone());
    let (other, _) = node(port, "o", "fleet2", so.clone());
    until("connections", || {
        ma.connected.get() == 1 && mb.connected.get() == 1
    })
    .await;

    // A decision at A reaches B (retry: B's subscription may still be registering).
    let mut n = 0;
    let deadline = Instant::now() + PATIENCE;
    while !sb.has(|r, m| r == "a" && matches!(m, Message::Route { .. })) {
        assert!(Instant::now() < deadline, "route never reached b");
        n += 1;
        a.route("m", "w1", n, 100, 2, &[1, 2]);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.prefill_done(1);
    until("prefill done at b", || {
        sb.has(|_, m| *m == Message::PrefillDone { request: 1 })
    })
    .await;
    // Own messages are not applied; another prefix hears nothing.
    assert!(!sa.has(|_, m| matches!(m, Message::Route { .. })));
    assert!(!so.has(|_, m| matches!(m, Message::Route { .. })));
    assert!(
        mb.messages_in
            .get_or_create(&KindLabel { kind: "route" })
            .get()
            >= 1
    );

    // Bad payloads are counted and dropped, never applied.
    let raw = async_nats::connect(format!("nats://127.0.0.1:{port}"))
        .await
        .expect("raw client");
    let env = |msg| Envelope {
        replica: "x".into(),
        sent_unix_us: 0,
        msg,
    };
    let good = encode(&env(route(99, vec![5])), 1 << 20).expect("encode");
    let mut foreign = good.to_vec();
    foreign[0] = WIRE_VERSION + 1;
    let mut unknown_kind = good.to_vec();
    unknown_kind[1] = 250;
    let truncated = good[..good.len() - 3].to_vec();
    let oversized = encode(&env(route(98, vec![7; 9000])), 1 << 20).expect("encode");
    let unknown_worker = encode(
        &env(Message::Route {
            model: "m".into(),
            worker: "unknown".into(),
            request: 1,
            prefill_tokens: 0,
            blocks: 0,
            hashes: vec![],
        }),
        1 << 20,
    )
    .expect("encode");
    for p in [
        foreign,
        unknown_kind,
        truncated,
        oversized.to_vec(),
        unknown_worker.to_vec(),
    ] {
        raw.publish("fleet1.msg", p.into()).await.expect("publish");
    }
    raw.flush().await.expect("flush");
    let dropped = |kind: &'static str, reason: DropReason| {
        mb.dropped
            .get_or_create(&DropLabel {
                kind,
                reason: reason.as_str(),
            })
            .get()
    };
    until("bad payloads counted", || {
        dropped("unknown", DropReason::Version) == 1
            && dropped("unknown", DropReason::UnknownKind) == 1
            && dropped("route", DropReason::Malformed) == 1
            && dropped("unknown", DropReason::Oversized) == 1
            && dropped("route", DropReason::UnknownWorker) == 1
    })
    .await;
    assert!(!sb.has(|r, _| r == "x"), "nothing of a bad payload applied");

    // Oversized outbound: dropped at the sender.
    a.publish(route(500, vec![3; 9000]));
    until("oversized outbound counted", || {
        ma.dropped
            .get_or_create(&DropLabel {
                kind: "route",
                reason: "oversized",
            })
            .get()
            == 1
    })
    .await;

    // A late replica gets the others' snapshots: A's in-flight requests, B's approximate index.
    let sc = Arc::new(Recorder::default());
    let (c, _mc) = node(port, "c", "fleet1", sc.clone());
    until("snapshots at c", || {
        sc.has(|r, m| {
            r == "a"
                && matches!(m, Message::Snapshot(s) if s.inflight.iter().any(|e| e.request == 1))
        }) && sc.has(|r, m| {
            r == "b" && matches!(m, Message::Snapshot(s) if s.approx == vec![("w2".to_string(), vec![11, 12])])
        })
    })
    .await;

    // NATS lost: publishing never blocks; after it returns A re-announces its in-flight requests.
    nats.stop();
    until("disconnect seen", || ma.connected.get() == 0).await;
    let t = Instant::now();
    for i in 0..2000 {
        a.route("m", "w1", 10_000 + i, 1, 1, &[9]);
    }
    assert!(t.elapsed() < Duration::from_secs(2), "publishing blocked");
    a.free(10_000);
    let _nats2 = Nats::start(port).expect("nats-server restarts");
    until("reconnect", || {
        ma.connected.get() == 1 && mb.connected.get() == 1
    })
    .await;
    until("re-sync at b", || {
        sb.has(|r, m| {
            r == "a"
                && matches!(m, Message::Snapshot(s) if s.inflight.iter().any(|e| e.request == 10_001)
                    && !s.inflight.iter().any(|e| e.request == 10_000))
        })
    })
    .await;
    assert!(ma.connects.get() >= 2);
    assert!(
        ma.messages_out
            .get_or_create(&KindLabel { kind: "route" })
            .get()
            >= 1
    );
    for n in [&a, &b, &c, &other] {
        n.shutdown();
    }
}

/// A snapshot larger than `max_message_bytes` (1,024 approximate workers x 128 blocks and 4,096
/// requests in flight: 1.3 MB against 1 MiB) reaches a joining replica whole, in parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_over_the_message_limit_arrives_whole_in_parts() {
    if !have_nats() {
        return;
    }
    let port = free_port();
    let _nats = Nats::start(port).expect("nats-server starts");
    let name = |w: u32| format!("worker-{w:04}.pool-a.example:8000");
    let approx: Vec<(String, Vec<u64>)> = (0..1024u32)
        .map(|w| {
            (
                name(w),
                (0..128u64).map(|b| u64::from(w) << 32 | b).collect(),
            )
        })
        .collect();
    let big_sink = Arc::new(Recorder {
        approx: approx.clone(),
        ..Recorder::default()
    });
    let start = |id: &str, sink: Arc<Recorder>| {
        let m = ClusterMetrics::register(&mut prometheus_client::registry::Registry::default());
        let cfg = ClusterConfig {
            max_message_bytes: 1 << 20,
            snapshot_wait: Duration::from_secs(2),
            ..config(port, id, "fleetbig")
        };
        (Cluster::start(cfg, sink, m.clone()).expect("start"), m)
    };
    let (big, mbig) = start("big", big_sink);
    until("big connected", || mbig.connected.get() == 1).await;
    for r in 0..4096u32 {
        big.route("m", &name(r % 1024), u64::from(r), 4096, 256, &[]);
    }
    let sj = Arc::new(Recorder::default());
    let (joiner, mj) = start("joiner", sj.clone());
    let parts = |sink: &Recorder| -> Vec<kvgate_cluster::Snapshot> {
        sink.got
            .lock()
            .iter()
            .filter_map(|(r, m)| match m {
                Message::Snapshot(s) if r == "big" => Some(s.clone()),
                _ => None,
            })
            .collect()
    };
    until("the whole snapshot at the joiner", || {
        let p = parts(&sj);
        let inflight: usize = p.iter().map(|s| s.inflight.len()).sum();
        let hashes: usize = p.iter().flat_map(|s| &s.approx).map(|(_, h)| h.len()).sum();
        inflight == 4096 && hashes == 1024 * 128
    })
    .await;
    let p = parts(&sj);
    assert!(p.len() >= 2, "{} parts", p.len());
    for (i, s) in p.iter().enumerate() {
        assert_eq!(s.part, i as u32, "parts in order, the first replacing");
    }
    let mut joined: Vec<(String, Vec<u64>)> = Vec::new();
    for (w, h) in p.iter().flat_map(|s| &s.approx) {
        match joined.last_mut() {
            Some((lw, lh)) if lw == w => lh.extend_from_slice(h),
            _ => joined.push((w.clone(), h.clone())),
        }
    }
    assert_eq!(joined, approx);
    let mut requests: Vec<u64> = p
        .iter()
        .flat_map(|s| &s.inflight)
        .map(|e| e.request)
        .collect();
    requests.sort_unstable();
    assert_eq!(requests, (0..4096).collect::<Vec<u64>>());
    assert_eq!(
        mj.messages_in
            .get_or_create(&KindLabel {
                kind: "snapshot_part"
            })
            .get(),
        p.len() as u64 - 1
    );
    assert_eq!(
        mbig.dropped
            .get_or_create(&DropLabel {
                kind: "snapshot",
                reason: "oversized",
            })
            .get(),
        0
    );
    big.shutdown();
    joiner.shutdown();
}
