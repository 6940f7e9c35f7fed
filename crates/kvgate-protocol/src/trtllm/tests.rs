use super::*;
use serde_json::{json, Value as Json};

fn kv_json(e: &KvEvent) -> Json {
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
        } => {
            json!({"type": "stored", "block_hashes": block_hashes, "parent": parent, "token_ids": token_ids,
                "block_size": block_size, "lora_id": lora_id, "lora_name": lora_name,
                "medium": medium.as_str(), "group_idx": group_idx})
        }
        KvEvent::Removed {
            block_hashes,
            medium,
            group_idx,
        } => json!({"type": "removed",
            "block_hashes": block_hashes, "medium": medium.as_str(), "group_idx": group_idx}),
        KvEvent::AllCleared => json!({"type": "cleared"}),
    }
}

fn event_json(e: &TrtllmEvent) -> Json {
    let kind = match &e.kind {
        TrtllmEventKind::Created {
            num_blocks_per_cache_level,
        } => json!({"created": num_blocks_per_cache_level}),
        TrtllmEventKind::Kv(evs) => json!({"kv": evs.iter().map(kv_json).collect::<Vec<_>>()}),
        TrtllmEventKind::Updated {
            block_hash,
            cache_level,
        } => {
            json!({"updated": {"block_hash": block_hash, "cache_level": cache_level.map(|(o, n)| [o, n])}})
        }
    };
    json!({"event_id": e.event_id, "dp_rank": e.dp_rank, "window_size": e.window_size, "kind": kind})
}

#[test]
fn kv_cache_events_fixture_matches() {
    let evs = parse_kv_cache_events(include_bytes!("../../tests/fixtures/trtllm_kv_events.json"))
        .unwrap();
    let exp: Vec<Json> = serde_json::from_str(include_str!(
        "../../tests/fixtures/trtllm_kv_events.expected.json"
    ))
    .unwrap();
    let got: Vec<Json> = evs.iter().map(event_json).collect();
    assert_eq!(got, exp);
}

#[test]
fn kv_cache_events_errors_are_typed() {
    assert!(parse_kv_cache_events(b"[]").unwrap().is_empty());
    assert!(parse_kv_cache_events(b"{").is_err());
    assert!(parse_kv_cache_events(br#"[{"event_id":1,"data":{"type":"exploded"}}]"#).is_err());
    assert!(parse_kv_cache_events(
        br#"[{"event_id":1,"data":{"type":"removed","block_hashes":["x"]}}]"#
    )
    .is_err());
    // an empty stored run is nothing to index
    let e = parse_kv_cache_events(
        br#"[{"event_id":1,"data":{"type":"stored","parent_hash":null,"blocks":[]}}]"#,
    )
    .unwrap();
    assert_eq!(e[0].kind, TrtllmEventKind::Kv(vec![]));
}

#[test]
fn iteration_stats_take_the_newest() {
    let l = parse_iteration_stats(include_bytes!(
        "../../tests/fixtures/metrics_trtllm_iteration_stats.json"
    ))
    .unwrap()
    .unwrap();
    assert_eq!(l.iter, 1202);
    assert_eq!((l.num_active_requests, l.num_queued_requests), (4, 2));
    assert_eq!(l.tokens_per_block, Some(32));
    assert_eq!(l.kv_usage(), Some(384.0 / 4096.0));
    assert_eq!(parse_iteration_stats(b"[]").unwrap(), None);
    assert!(parse_iteration_stats(b"not json").is_err());
}
