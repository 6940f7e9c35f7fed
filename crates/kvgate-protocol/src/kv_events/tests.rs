//! Decoding against fixtures written by an independent encoder (Python msgspec, see
//! `tests/fixtures/gen_fixtures.py`), plus hostile-input properties.

use super::*;
use proptest::prelude::*;
use serde_json::{json, Value as Json};

/// Splits a `.frames` fixture into multipart messages.
pub(crate) fn read_frames(mut d: &[u8]) -> Vec<Vec<Vec<u8>>> {
    fn u32be(d: &mut &[u8]) -> usize {
        let (h, t) = d.split_at(4);
        *d = t;
        u32::from_be_bytes(h.try_into().unwrap()) as usize
    }
    let mut msgs = Vec::new();
    while !d.is_empty() {
        let n = u32be(&mut d);
        let mut frames = Vec::new();
        for _ in 0..n {
            let len = u32be(&mut d);
            let (f, t) = d.split_at(len);
            frames.push(f.to_vec());
            d = t;
        }
        msgs.push(frames);
    }
    msgs
}

fn event_json(e: &KvEvent) -> Json {
    match e {
        KvEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            medium,
            group_idx,
        } => json!({"type": "stored", "block_hashes": block_hashes, "parent": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": lora_id,
            "lora_name": lora_name, "medium": medium.as_str(), "group_idx": group_idx}),
        KvEvent::Removed {
            block_hashes,
            medium,
            group_idx,
        } => json!({"type": "removed",
            "block_hashes": block_hashes, "medium": medium.as_str(), "group_idx": group_idx}),
        KvEvent::AllCleared => json!({"type": "cleared"}),
    }
}

fn batch_json(b: &KvEventBatch) -> Json {
    json!({"seq": b.seq, "ts": b.ts, "dp_rank": b.dp_rank,
        "events": b.events.iter().map(event_json).collect::<Vec<_>>()})
}

fn expected(s: &str) -> Vec<Json> {
    serde_json::from_str(s).unwrap()
}

fn check_live(frames: &[u8], exp: &str) {
    let msgs = read_frames(frames);
    let exp = expected(exp);
    assert_eq!(msgs.len(), exp.len());
    for (m, e) in msgs.iter().zip(&exp) {
        let b = decode_multipart(m).unwrap();
        assert_eq!(&batch_json(&b), e);
    }
}

#[test]
fn vllm_array_encoding_matches_msgspec() {
    check_live(
        include_bytes!("../../tests/fixtures/vllm_array.frames"),
        include_str!("../../tests/fixtures/vllm_array.expected.json"),
    );
}

#[test]
fn vllm_array_keeps_u64_hashes_above_i64_max() {
    let msgs = read_frames(include_bytes!("../../tests/fixtures/vllm_array.frames"));
    let b = decode_multipart(&msgs[0]).unwrap();
    let KvEvent::Stored {
        block_hashes,
        parent,
        ..
    } = &b.events[0]
    else {
        panic!()
    };
    assert!(block_hashes.iter().all(|&h| h > i64::MAX as u64));
    assert_eq!(*parent, None);
    // [ts, events] from builds before the rank was published
    assert_eq!(decode_multipart(&msgs[3]).unwrap().dp_rank, None);
}

#[test]
fn vllm_map_encoding_matches_msgspec() {
    check_live(
        include_bytes!("../../tests/fixtures/vllm_map.frames"),
        include_str!("../../tests/fixtures/vllm_map.expected.json"),
    );
}

#[test]
fn offload_tier_events_are_tier_only() {
    let msgs = read_frames(include_bytes!("../../tests/fixtures/vllm_map.frames"));
    let b = decode_multipart(&msgs[1]).unwrap();
    assert!(b.events[0].is_tier_only());
    assert!(matches!(
        b.events[0],
        KvEvent::Stored {
            medium: Medium::Cpu,
            ..
        }
    ));
    assert!(matches!(
        b.events[1],
        KvEvent::Stored {
            medium: Medium::Disk,
            ..
        }
    ));
    let first = decode_multipart(&msgs[0]).unwrap();
    assert!(!first.events[0].is_tier_only());
}

#[test]
fn sglang_per_page_events_match() {
    check_live(
        include_bytes!("../../tests/fixtures/sglang.frames"),
        include_str!("../../tests/fixtures/sglang.expected.json"),
    );
    let msgs = read_frames(include_bytes!("../../tests/fixtures/sglang.frames"));
    let b = decode_multipart(&msgs[0]).unwrap();
    // the trailing page is short; the decoder reports it as is (the index decides to skip it)
    let KvEvent::Stored {
        token_ids,
        block_size,
        ..
    } = &b.events[3]
    else {
        panic!()
    };
    assert!(token_ids.len() < *block_size as usize);
}

fn check_replay(frames: &[u8], exp: &str) {
    let msgs = read_frames(frames);
    let exp = expected(exp);
    assert_eq!(msgs.len(), exp.len());
    for (m, e) in msgs.iter().zip(&exp) {
        match decode_replay(m).unwrap() {
            ReplayFrame::Batch(b) => assert_eq!(&batch_json(&b), e),
            ReplayFrame::End => assert_eq!(e, "end"),
        }
    }
}

#[test]
fn replay_both_framings() {
    check_replay(
        include_bytes!("../../tests/fixtures/vllm_replay_v025.frames"),
        include_str!("../../tests/fixtures/vllm_replay_v025.expected.json"),
    );
    check_replay(
        include_bytes!("../../tests/fixtures/vllm_replay_v026.frames"),
        include_str!("../../tests/fixtures/vllm_replay_v026.expected.json"),
    );
    // a DEALER sees an empty delimiter in front of the ≥0.26 framing
    let mut msgs = read_frames(include_bytes!(
        "../../tests/fixtures/vllm_replay_v026.frames"
    ));
    msgs[0].insert(0, Vec::new());
    assert!(matches!(decode_replay(&msgs[0]).unwrap(), ReplayFrame::Batch(b) if b.seq == 10));
}

#[test]
fn bytes_hash_keeps_low_64_bits_big_endian() {
    let mut d = [0u8; 32];
    d[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    d[0] = 0xff;
    assert_eq!(bytes_hash(&d), 0x0102_0304_0506_0708);
    assert_eq!(bytes_hash(&[1, 2]), 0x0102);
    assert_eq!(bytes_hash(&[]), 0);
}

#[test]
fn framing_errors_are_typed() {
    let msgs = read_frames(include_bytes!("../../tests/fixtures/vllm_array.frames"));
    let m = &msgs[0];
    assert_eq!(
        decode_multipart(&m[..2]).unwrap_err(),
        KvEventError::FrameCount {
            expected: "3",
            got: 2
        }
    );
    let bad_seq = [m[0].clone(), vec![1, 2, 3], m[2].clone()];
    assert_eq!(
        decode_multipart(&bad_seq).unwrap_err(),
        KvEventError::SeqLen(3)
    );
    let mut trunc = m.clone();
    let n = trunc[2].len() - 3;
    trunc[2].truncate(n);
    assert!(matches!(
        decode_multipart(&trunc),
        Err(KvEventError::Truncated { .. })
    ));
    let mut trailing = m.clone();
    trailing[2].push(0xc0);
    assert_eq!(
        decode_multipart(&trailing).unwrap_err(),
        KvEventError::Trailing(1)
    );
}

#[test]
fn unknown_event_type_is_an_error() {
    // [1.0, [["BlockExploded", []]], 0]
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.extend_from_slice(&[0x91, 0x92, 0xad]);
    p.extend_from_slice(b"BlockExploded");
    p.extend_from_slice(&[0x90, 0x00]);
    assert_eq!(
        decode_payload(0, &p).unwrap_err(),
        KvEventError::UnknownEvent("BlockExploded".into())
    );
}

#[test]
fn huge_claimed_lengths_do_not_allocate() {
    // [1.0, array32(0xffffffff) …] : claims 4 billion events, holds none
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.extend_from_slice(&[0xdd, 0x00, 0x0f, 0xff, 0xff]);
    assert!(decode_payload(0, &p).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_payload(1, &bytes);
        let _ = decode_multipart(&[b"t".as_slice(), &[0u8; 8], &bytes]);
        let _ = decode_replay(&[bytes.as_slice()]);
    }

    #[test]
    fn mutated_fixtures_never_panic(idx in 0usize..1200, byte in any::<u8>(), cut in 0usize..1300) {
        for f in [include_bytes!("../../tests/fixtures/vllm_map.frames").as_slice(),
                  include_bytes!("../../tests/fixtures/vllm_array.frames").as_slice(),
                  include_bytes!("../../tests/fixtures/sglang.frames").as_slice()] {
            for m in read_frames(f) {
                let mut p = m[2].clone();
                if !p.is_empty() {
                    let i = idx % p.len();
                    p[i] = byte;
                }
                p.truncate(cut.max(1));
                let _ = decode_payload(0, &p);
            }
        }
    }
}
