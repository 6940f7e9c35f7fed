use super::*;

fn samples() -> Vec<Message> {
    vec![
        Message::Route {
            model: "m".into(),
            worker: "w-é".into(),
            request: 7,
            prefill_tokens: 1000,
            blocks: 63,
            hashes: vec![1, 2, u64::MAX],
        },
        Message::PrefillDone { request: 9 },
        Message::Free { request: 10 },
        Message::Health {
            worker: "w1".into(),
            open: true,
        },
        Message::Heartbeat { inflight: 3 },
        Message::RateUsage {
            keys: vec![(42, 5), (43, 1)],
        },
        Message::Pin {
            id: "resp_0123abcd".into(),
            worker: "w3".into(),
        },
        Message::Session {
            key: u64::MAX - 1,
            worker: "w-é".into(),
        },
        Message::Flow(FlowReport {
            clocks: vec![("batch".into(), 1234.5), ("interactive".into(), 0.0)],
            heads: vec![
                FlowHead {
                    pool: 99,
                    priority: -3,
                    tag: 17.25,
                },
                FlowHead {
                    pool: u64::MAX,
                    priority: 10,
                    tag: f64::INFINITY,
                },
            ],
            usage: vec![FlowUsage {
                class: "batch".into(),
                tenant: "team-é".into(),
                tokens: 4096,
            }],
        }),
        Message::Snapshot(Snapshot {
            part: 0,
            approx: vec![("w1".into(), vec![5, 6]), ("w2".into(), vec![])],
            inflight: vec![InflightEntry {
                worker: "w2".into(),
                request: 3,
                prefill_tokens: 17,
                blocks: 2,
            }],
        }),
        Message::Snapshot(Snapshot {
            part: 3,
            approx: vec![("w1".into(), vec![7])],
            inflight: Vec::new(),
        }),
    ]
}

fn env(msg: Message) -> Envelope {
    Envelope {
        replica: "replica-a".into(),
        sent_unix_us: 1_700_000_000_000_000,
        msg,
    }
}

#[test]
fn every_kind_round_trips() {
    for m in samples() {
        let e = env(m);
        let b = encode(&e, 1 << 20).expect("encodes");
        assert_eq!(decode(&b, 1 << 20).expect("decodes"), e);
    }
}

#[test]
fn every_truncation_and_extension_is_rejected_whole() {
    for m in samples() {
        let kind = m.kind();
        let b = encode(&env(m), 1 << 20).expect("encodes");
        for cut in 0..b.len() {
            let e = decode(&b[..cut], 1 << 20).expect_err("truncated must not decode");
            assert_eq!(e.reason, DropReason::Malformed, "cut {cut} of {kind:?}");
        }
        let mut longer = b.to_vec();
        longer.push(0);
        let e = decode(&longer, 1 << 20).expect_err("trailing byte");
        assert_eq!(e.reason, DropReason::Malformed);
        assert_eq!(e.kind, Some(kind));
    }
}

#[test]
fn foreign_version_unknown_kind_and_oversized_are_dropped_with_their_reason() {
    let b = encode(&env(Message::Heartbeat { inflight: 1 }), 1024).expect("encodes");
    let mut v = b.to_vec();
    v[0] = WIRE_VERSION + 1;
    assert_eq!(decode(&v, 1024).unwrap_err().reason, DropReason::Version);
    let mut k = b.to_vec();
    k[1] = 200;
    assert_eq!(
        decode(&k, 1024).unwrap_err().reason,
        DropReason::UnknownKind
    );
    assert_eq!(
        decode(&b, b.len() - 1).unwrap_err().reason,
        DropReason::Oversized
    );
    let big = env(Message::Route {
        model: "m".into(),
        worker: "w".into(),
        request: 1,
        prefill_tokens: 1,
        blocks: 1,
        hashes: vec![0; 1000],
    });
    assert_eq!(encode(&big, 1024), Err(DropReason::Oversized));
}

#[test]
fn an_impossible_count_is_malformed_not_an_allocation() {
    let b = encode(&env(Message::RateUsage { keys: vec![] }), 1024).expect("encodes");
    let mut v = b.to_vec();
    let n = v.len();
    v[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode(&v, 1024).unwrap_err().reason, DropReason::Malformed);
}

#[test]
fn bad_utf8_and_bad_bool_are_malformed() {
    let b = encode(
        &env(Message::Health {
            worker: "ab".into(),
            open: false,
        }),
        1024,
    )
    .expect("encodes");
    let mut v = b.to_vec();
    let n = v.len();
    v[n - 1] = 2;
    assert_eq!(decode(&v, 1024).unwrap_err().reason, DropReason::Malformed);
    let mut u = b.to_vec();
    u[n - 2] = 0xff;
    assert_eq!(decode(&u, 1024).unwrap_err().reason, DropReason::Malformed);
}

/// Sizes at 1,024 workers (issue 36): a `route` message is set by the prompt, not the fleet
/// (8 bytes per prompt block plus the names); a snapshot's in-flight part is set by the
/// replica's own requests in flight (here four per worker, ~45 bytes each with a 20-byte worker
/// name) and fits the default `max_message_bytes` (1 MiB) with room to spare; its approximate
/// part is 8 bytes per (block, approximate worker) entry and is what can outgrow it.
#[test]
fn sizes_at_a_thousand_workers() {
    let name = |w: u32| format!("http://10.0.{}.{}:8000", w / 256, w % 256);
    let route = |blocks: u64| {
        encode(
            &env(Message::Route {
                model: "meta-llama/Llama-3.1-8B-Instruct".into(),
                worker: name(1023),
                request: u64::MAX,
                prefill_tokens: 4096,
                blocks: 256,
                hashes: (0..blocks).collect(),
            }),
            usize::MAX,
        )
        .unwrap()
        .len()
    };
    // 8 bytes per block beyond a fixed part.
    assert_eq!(route(256) - route(0), 256 * 8);
    assert!(route(0) < 128, "{}", route(0));
    let inflight: Vec<InflightEntry> = (0..4096u32)
        .map(|i| InflightEntry {
            worker: name(i % 1024),
            request: u64::from(i) << 20,
            prefill_tokens: 4096,
            blocks: 256,
        })
        .collect();
    let snap = |approx: Vec<(String, Vec<u64>)>| {
        encode(
            &env(Message::Snapshot(Snapshot {
                part: 0,
                approx,
                inflight: inflight.clone(),
            })),
            usize::MAX,
        )
        .unwrap()
        .len()
    };
    let exact = snap(Vec::new());
    println!(
        "route: {} B + 8 B per block; snapshot of 4,096 in flight: {exact} B",
        route(0)
    );
    assert!(exact < 1 << 20 && exact / 4096 <= 48, "{exact}");
    // 1,024 approximate workers with 128 blocks each: 8 B per entry more.
    let approx = snap((0..1024).map(|w| (name(w), (0..128).collect())).collect());
    println!("with 1,024 approximate workers x 128 blocks: {approx} B");
    assert!(approx - exact >= 1024 * 128 * 8);
}

/// Whole-snapshot view of parts: each worker's hashes concatenated in order, and the in-flight
/// entries in order.
fn joined(parts: &[Snapshot]) -> (Vec<(String, Vec<u64>)>, Vec<InflightEntry>) {
    let mut approx: Vec<(String, Vec<u64>)> = Vec::new();
    let mut inflight = Vec::new();
    for p in parts {
        for (w, hs) in &p.approx {
            match approx.last_mut() {
                Some((lw, lhs)) if lw == w => lhs.extend_from_slice(hs),
                _ => approx.push((w.clone(), hs.clone())),
            }
        }
        inflight.extend(p.inflight.iter().cloned());
    }
    (approx, inflight)
}

/// Split at `max`, check every part encodes within `max`, decodes to itself with the kinds in
/// order (first `snapshot`, then `snapshot_part` 1, 2, ...), and that together they are `snap`.
fn split_checked(snap: &Snapshot, max: usize) -> Vec<Snapshot> {
    let parts = snap.clone().split("replica-a", max).expect("splits");
    assert!(!parts.is_empty());
    for (i, p) in parts.iter().enumerate() {
        assert_eq!(p.part, i as u32);
        let e = env(Message::Snapshot(p.clone()));
        let want = if i == 0 {
            Kind::Snapshot
        } else {
            Kind::SnapshotPart
        };
        assert_eq!(e.msg.kind(), want);
        let b = encode(&e, max).unwrap_or_else(|r| panic!("part {i} of {}: {r:?}", parts.len()));
        assert!(b.len() <= max);
        assert_eq!(decode(&b, max).expect("decodes"), e);
        // Parts after the first are never empty (an empty snapshot is one empty part).
        assert!(i == 0 || !(p.approx.is_empty() && p.inflight.is_empty()));
    }
    let (approx, inflight) = joined(&parts);
    let want: Vec<_> = snap
        .approx
        .iter()
        .filter(|(_, h)| !h.is_empty())
        .cloned()
        .collect();
    let got: Vec<_> = approx.into_iter().filter(|(_, h)| !h.is_empty()).collect();
    assert_eq!(got, want);
    assert_eq!(inflight, snap.inflight);
    parts
}

#[test]
fn a_snapshot_of_a_thousand_approximate_workers_is_sent_in_bounded_parts() {
    let name = |i: u32| format!("worker-{i:04}.pool-a.example:8000");
    let snap = Snapshot {
        part: 0,
        approx: (0..1024u32)
            .map(|w| (name(w), (0..128u64).map(|b| mix(w, b)).collect()))
            .collect(),
        inflight: (0..4096u32)
            .map(|i| InflightEntry {
                worker: name(i % 1024),
                request: u64::from(i) << 20,
                prefill_tokens: 4096,
                blocks: 256,
            })
            .collect(),
    };
    let max = 1 << 20;
    // One message would not do.
    assert_eq!(
        encode(&env(Message::Snapshot(snap.clone())), max),
        Err(DropReason::Oversized)
    );
    let parts = split_checked(&snap, max);
    let total: usize = parts
        .iter()
        .map(|p| {
            encode(&env(Message::Snapshot(p.clone())), max)
                .unwrap()
                .len()
        })
        .sum();
    println!(
        "1,024 approximate workers x 128 blocks + 4,096 in flight: {} parts, {total} B",
        parts.len()
    );
    assert_eq!(parts.len(), 2, "greedy packing: 1.4 MB in 1 MiB parts");
    // A small limit cuts workers' hash lists across parts too.
    let parts = split_checked(&snap, 4096);
    assert!(parts.len() > 300, "{}", parts.len());
}

fn mix(w: u32, b: u64) -> u64 {
    (u64::from(w) << 32 | b).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

#[test]
fn snapshot_split_edge_cases() {
    // Empty: one empty part.
    let parts = split_checked(&Snapshot::default(), 64);
    assert_eq!(parts.len(), 1);
    // A limit below one entry: refused, never an endless loop or an empty part.
    let one = Snapshot {
        part: 0,
        approx: vec![("w".into(), vec![1, 2, 3])],
        inflight: Vec::new(),
    };
    assert_eq!(
        one.clone().split("replica-a", 20),
        Err(DropReason::Oversized)
    );
    // Exactly one hash per part.
    let fixed = 1 + 1 + 8 + 1 + "replica-a".len() + 12;
    let parts = split_checked(&one, fixed + 2 + 1 + 4 + 8);
    assert_eq!(parts.len(), 3);
    let e = Snapshot {
        part: 0,
        approx: Vec::new(),
        inflight: vec![InflightEntry {
            worker: "w".into(),
            request: 1,
            prefill_tokens: 2,
            blocks: 3,
        }],
    };
    assert_eq!(
        e.clone().split("replica-a", fixed + 23),
        Ok(vec![e.clone()])
    );
    assert_eq!(e.split("replica-a", fixed + 22), Err(DropReason::Oversized));
    // A continuation numbered 0 on the wire is malformed.
    let mut b = encode(
        &env(Message::Snapshot(Snapshot {
            part: 1,
            ..Snapshot::default()
        })),
        1 << 20,
    )
    .unwrap()
    .to_vec();
    let at = 1 + 1 + 8 + 1 + "replica-a".len();
    b[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
    assert_eq!(
        decode(&b, 1 << 20).unwrap_err().reason,
        DropReason::Malformed
    );
}

/// Random snapshots (seeded, 3,000 cases) at random limits: every part fits and decodes, the
/// parts rejoin to the snapshot, and a refusal happens only when one entry cannot fit.
#[test]
fn snapshot_parts_fit_and_rejoin() {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for _ in 0..3000 {
        let workers = next(12);
        let snap = Snapshot {
            part: 0,
            approx: (0..workers)
                .map(|i| {
                    let name = format!("w{i}-{}", "x".repeat(next(40) as usize));
                    (name, (0..next(60)).collect())
                })
                .collect(),
            inflight: (0..next(40))
                .map(|r| InflightEntry {
                    worker: format!("w{r}"),
                    request: r,
                    prefill_tokens: r * 3,
                    blocks: r as u32,
                })
                .collect(),
        };
        let max = 60 + next(2000) as usize;
        match snap.clone().split("replica-a", max) {
            Ok(_) => {
                split_checked(&snap, max);
            }
            Err(r) => {
                assert_eq!(r, DropReason::Oversized);
                let fixed = 1 + 1 + 8 + 1 + "replica-a".len() + 12;
                let worst = snap
                    .approx
                    .iter()
                    .map(|(w, h)| 2 + w.len() + 4 + if h.is_empty() { 0 } else { 8 })
                    .chain(snap.inflight.iter().map(|e| 2 + e.worker.len() + 20))
                    .max()
                    .unwrap_or(0);
                assert!(fixed + worst > max, "refused at {max} with room");
            }
        }
    }
}
