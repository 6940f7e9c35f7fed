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
            approx: vec![("w1".into(), vec![5, 6]), ("w2".into(), vec![])],
            inflight: vec![InflightEntry {
                worker: "w2".into(),
                request: 3,
                prefill_tokens: 17,
                blocks: 2,
            }],
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
