//! vLLM KV-event payloads and their msgpack encoding (interfaces.md §2): the batch
//! `[ts, [events…], dp_rank]`, events as `{"type": …}` maps (vLLM ≥ 0.24) or tagged positional arrays
//! (≤ 0.23). Hashes are msgpack uints (they can exceed i64). The ZMQ side lives in `publisher.rs`.

use crate::config::EventEncoding;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
    },
    AllBlocksCleared,
}

const MEDIUM: &str = "GPU";

// Writes into a Vec<u8> cannot fail; rmp's error type only matters for fixed buffers.
fn put<T, E>(r: Result<T, E>) {
    let _ = r;
}

fn write_u64s(buf: &mut Vec<u8>, xs: &[u64]) {
    put(rmp::encode::write_array_len(buf, xs.len() as u32));
    for &x in xs {
        put(rmp::encode::write_uint(buf, x));
    }
}

fn write_opt_u64(buf: &mut Vec<u8>, x: Option<u64>) {
    match x {
        Some(v) => put(rmp::encode::write_uint(buf, v)),
        None => put(rmp::encode::write_nil(buf)),
    }
}

fn write_tokens(buf: &mut Vec<u8>, xs: &[u32]) {
    put(rmp::encode::write_array_len(buf, xs.len() as u32));
    for &x in xs {
        put(rmp::encode::write_uint(buf, u64::from(x)));
    }
}

/// `v032`: vLLM 0.32's fields (`extra_keys`, `group_idx`, `kv_cache_spec_kind`), measured on a
/// real 0.32 engine (tests/real_vllm.rs); otherwise 0.24's.
fn write_event_map(buf: &mut Vec<u8>, ev: &KvEvent, v032: bool) {
    let key = |buf: &mut Vec<u8>, k: &str| put(rmp::encode::write_str(buf, k));
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            // Field order and presence as msgspec emits them (omit_defaults; lora_id, medium and
            // lora_name have no default so they are always present).
            put(rmp::encode::write_map_len(buf, if v032 { 11 } else { 8 }));
            key(buf, "type");
            key(buf, "BlockStored");
            key(buf, "block_hashes");
            write_u64s(buf, block_hashes);
            key(buf, "parent_block_hash");
            write_opt_u64(buf, *parent_block_hash);
            key(buf, "token_ids");
            write_tokens(buf, token_ids);
            key(buf, "block_size");
            put(rmp::encode::write_uint(buf, *block_size as u64));
            key(buf, "lora_id");
            put(rmp::encode::write_nil(buf));
            key(buf, "medium");
            key(buf, MEDIUM);
            key(buf, "lora_name");
            put(rmp::encode::write_nil(buf));
            if v032 {
                // One entry per block: nil without multimodal inputs, LoRA or cache_salt.
                key(buf, "extra_keys");
                put(rmp::encode::write_array_len(buf, block_hashes.len() as u32));
                for _ in block_hashes {
                    put(rmp::encode::write_nil(buf));
                }
                key(buf, "group_idx");
                put(rmp::encode::write_uint(buf, 0));
                key(buf, "kv_cache_spec_kind");
                key(buf, "full_attention");
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            put(rmp::encode::write_map_len(buf, if v032 { 4 } else { 3 }));
            key(buf, "type");
            key(buf, "BlockRemoved");
            key(buf, "block_hashes");
            write_u64s(buf, block_hashes);
            key(buf, "medium");
            key(buf, MEDIUM);
            if v032 {
                key(buf, "group_idx");
                put(rmp::encode::write_uint(buf, 0));
            }
        }
        KvEvent::AllBlocksCleared => {
            put(rmp::encode::write_map_len(buf, 1));
            key(buf, "type");
            key(buf, "AllBlocksCleared");
        }
    }
}

fn write_event_array(buf: &mut Vec<u8>, ev: &KvEvent) {
    let s = |buf: &mut Vec<u8>, v: &str| put(rmp::encode::write_str(buf, v));
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            put(rmp::encode::write_array_len(buf, 8));
            s(buf, "BlockStored");
            write_u64s(buf, block_hashes);
            write_opt_u64(buf, *parent_block_hash);
            write_tokens(buf, token_ids);
            put(rmp::encode::write_uint(buf, *block_size as u64));
            put(rmp::encode::write_nil(buf)); // lora_id
            s(buf, MEDIUM);
            put(rmp::encode::write_nil(buf)); // lora_name
        }
        KvEvent::BlockRemoved { block_hashes } => {
            put(rmp::encode::write_array_len(buf, 3));
            s(buf, "BlockRemoved");
            write_u64s(buf, block_hashes);
            s(buf, MEDIUM);
        }
        KvEvent::AllBlocksCleared => {
            put(rmp::encode::write_array_len(buf, 1));
            s(buf, "AllBlocksCleared");
        }
    }
}

/// Encodes one `KVEventBatch` payload.
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32, enc: EventEncoding) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 64);
    put(rmp::encode::write_array_len(&mut buf, 3));
    put(rmp::encode::write_f64(&mut buf, ts));
    put(rmp::encode::write_array_len(&mut buf, events.len() as u32));
    for ev in events {
        match enc {
            EventEncoding::Map => write_event_map(&mut buf, ev, true),
            EventEncoding::MapV024 => write_event_map(&mut buf, ev, false),
            EventEncoding::Array => write_event_array(&mut buf, ev),
        }
    }
    put(rmp::encode::write_uint(&mut buf, u64::from(dp_rank)));
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_encoding_bytes_for_block_removed() {
        let removed = [KvEvent::BlockRemoved {
            block_hashes: vec![u64::MAX],
        }];
        // vLLM 0.24's map: three fields.
        let b = encode_batch(0.0, &removed, 2, EventEncoding::MapV024);
        let mut want = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x83];
        want.extend_from_slice(b"\xa4type\xacBlockRemoved\xacblock_hashes\x91\xcf");
        want.extend_from_slice(&[0xff; 8]);
        want.extend_from_slice(b"\xa6medium\xa3GPU\x02");
        assert_eq!(b, want);
        // vLLM 0.32's (the default) adds group_idx.
        let b = encode_batch(0.0, &removed, 2, EventEncoding::Map);
        let mut want = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x84];
        want.extend_from_slice(b"\xa4type\xacBlockRemoved\xacblock_hashes\x91\xcf");
        want.extend_from_slice(&[0xff; 8]);
        want.extend_from_slice(b"\xa6medium\xa3GPU\xa9group_idx\x00\x02");
        assert_eq!(b, want);
    }

    #[test]
    fn map_encoding_of_block_stored_has_vllm_032_fields() {
        let ev = KvEvent::BlockStored {
            block_hashes: vec![5, 6],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
        };
        let b = encode_batch(0.0, &[ev], 0, EventEncoding::Map);
        let v = rmpv::decode::read_value(&mut &b[..]).unwrap();
        let ev = &v[1][0];
        let keys: Vec<&str> = ev
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap())
            .collect();
        assert_eq!(
            keys,
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx",
                "kv_cache_spec_kind"
            ]
        );
        let field = |k: &str| {
            ev.as_map()
                .unwrap()
                .iter()
                .find(|(n, _)| n.as_str() == Some(k))
                .unwrap()
                .1
                .clone()
        };
        assert_eq!(
            field("extra_keys"),
            rmpv::Value::Array(vec![rmpv::Value::Nil; 2])
        );
        assert_eq!(field("group_idx"), rmpv::Value::from(0));
        assert_eq!(
            field("kv_cache_spec_kind"),
            rmpv::Value::from("full_attention")
        );
    }

    #[test]
    fn array_encoding_is_tagged_and_positional() {
        let ev = KvEvent::BlockStored {
            block_hashes: vec![5],
            parent_block_hash: None,
            token_ids: vec![1, 2],
            block_size: 2,
        };
        let b = encode_batch(
            1.5,
            &[ev, KvEvent::AllBlocksCleared],
            0,
            EventEncoding::Array,
        );
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.extend_from_slice(
            b"\x92\x98\xabBlockStored\x91\x05\xc0\x92\x01\x02\x02\xc0\xa3GPU\xc0",
        );
        want.extend_from_slice(b"\x91\xb0AllBlocksCleared\x00");
        assert_eq!(b, want);
    }
}
