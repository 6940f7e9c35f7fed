//! Batch and event decoding for both msgspec encodings.
//!
//! Positional (`array_like`) events list fields in declaration order and omit trailing defaults, so a
//! shorter array is an older build, not an error. Map events may hold keys in any order and keys from
//! newer builds (`locality`, `ownership`, `session_id`, …), which are skipped.

use super::reader::{Reader, Value};
use super::{KvEvent, KvEventBatch, KvEventError, Medium};

/// Upper bound on events in one batch; a claim beyond it is garbage, not a scheduler step.
const MAX_EVENTS: u32 = 1 << 20;

pub(super) fn decode_batch(seq: u64, payload: &[u8]) -> Result<KvEventBatch, KvEventError> {
    let mut r = Reader::new(payload);
    let n = r.array_len()?;
    if !(2..=16).contains(&n) {
        return Err(KvEventError::Invalid(
            "event batch must be [ts, events, dp_rank?]",
        ));
    }
    let ts = r.f64()?;
    let count = r.array_len()?;
    if count > MAX_EVENTS {
        return Err(KvEventError::Invalid("too many events in one batch"));
    }
    let mut events = Vec::with_capacity(r.cap(count));
    for _ in 0..count {
        events.push(decode_event(&mut r)?);
    }
    let dp_rank = if n >= 3 {
        r.opt_int()?.and_then(|d| u32::try_from(d).ok())
    } else {
        None
    };
    for _ in 3..n {
        r.skip()?; // fields a future EventBatch may add
    }
    if !r.is_empty() {
        return Err(KvEventError::Trailing(r.remaining()));
    }
    Ok(KvEventBatch {
        seq,
        ts,
        dp_rank,
        events,
    })
}

fn decode_event(r: &mut Reader<'_>) -> Result<KvEvent, KvEventError> {
    match r.next()? {
        Value::Array(n) => decode_tagged_array(r, n),
        Value::Map(n) => decode_map(r, n),
        v => Err(KvEventError::Unexpected {
            offset: r.pos(),
            expected: "event array or map",
            found: v.kind(),
        }),
    }
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<u64>, KvEventError> {
    let n = r.array_len()?;
    let mut v = Vec::with_capacity(r.cap(n));
    for _ in 0..n {
        v.push(r.hash()?);
    }
    Ok(v)
}

fn tokens(r: &mut Reader<'_>) -> Result<Vec<u32>, KvEventError> {
    // nil is accepted as "no tokens" (offload tiers of some builds).
    let Some(n) = r.opt_array_len()? else {
        return Ok(Vec::new());
    };
    let mut v = Vec::with_capacity(r.cap(n));
    for _ in 0..n {
        v.push(r.u32()?);
    }
    Ok(v)
}

fn medium(r: &mut Reader<'_>) -> Result<Medium, KvEventError> {
    Ok(r.opt_str()?.map(Medium::parse).unwrap_or_default())
}

fn group(r: &mut Reader<'_>) -> Result<u32, KvEventError> {
    Ok(r.opt_int()?
        .and_then(|g| u32::try_from(g).ok())
        .unwrap_or(0))
}

fn block_size(r: &mut Reader<'_>) -> Result<u32, KvEventError> {
    Ok(r.opt_int()?
        .and_then(|b| u32::try_from(b).ok())
        .unwrap_or(0))
}

/// `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
///   extra_keys, group_idx, …]`, `["BlockRemoved", block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`.
fn decode_tagged_array(r: &mut Reader<'_>, n: u32) -> Result<KvEvent, KvEventError> {
    if n == 0 {
        return Err(KvEventError::Invalid("empty event array"));
    }
    let tag = r.str()?;
    let fields = n - 1;
    let ev = match tag {
        "BlockStored" => {
            if fields < 4 {
                return Err(KvEventError::MissingField {
                    event: "BlockStored",
                    field: "block_size",
                });
            }
            let block_hashes = hashes(r)?;
            let parent = r.opt_hash()?;
            let token_ids = tokens(r)?;
            let block_size = block_size(r)?;
            let lora_id = if fields > 4 { r.opt_int()? } else { None };
            let medium = if fields > 5 { medium(r)? } else { Medium::Gpu };
            let lora_name = if fields > 6 {
                r.opt_str()?.map(str::to_owned)
            } else {
                None
            };
            if fields > 7 {
                r.skip()?; // extra_keys: untagged and without the LoRA path, so not usable for hashing
            }
            let group_idx = if fields > 8 { group(r)? } else { 0 };
            for _ in 9..fields {
                r.skip()?;
            }
            KvEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                medium,
                group_idx,
            }
        }
        "BlockRemoved" => {
            if fields < 1 {
                return Err(KvEventError::MissingField {
                    event: "BlockRemoved",
                    field: "block_hashes",
                });
            }
            let block_hashes = hashes(r)?;
            let medium = if fields > 1 { medium(r)? } else { Medium::Gpu };
            let group_idx = if fields > 2 { group(r)? } else { 0 };
            for _ in 3..fields {
                r.skip()?;
            }
            KvEvent::Removed {
                block_hashes,
                medium,
                group_idx,
            }
        }
        "AllBlocksCleared" => {
            for _ in 0..fields {
                r.skip()?;
            }
            KvEvent::AllCleared
        }
        other => return Err(KvEventError::UnknownEvent(truncate(other))),
    };
    Ok(ev)
}

fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

#[derive(Default)]
struct MapFields {
    tag: Option<String>,
    block_hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<i64>,
    lora_name: Option<String>,
    medium: Medium,
    group_idx: u32,
}

/// `{"type": "BlockStored", "block_hashes": […], …}` with keys in any order.
fn decode_map(r: &mut Reader<'_>, n: u32) -> Result<KvEvent, KvEventError> {
    let mut f = MapFields::default();
    for _ in 0..n {
        let key = match r.next()? {
            Value::Str(s) => s,
            _ => {
                // Non-string keys never come from msgspec; skip the value and move on.
                r.skip()?;
                continue;
            }
        };
        match key {
            "type" => f.tag = Some(truncate(r.str()?)),
            "block_hashes" => f.block_hashes = Some(hashes(r)?),
            "parent_block_hash" => f.parent = r.opt_hash()?,
            "token_ids" => f.token_ids = tokens(r)?,
            "block_size" => f.block_size = block_size(r)?,
            "lora_id" => f.lora_id = r.opt_int()?,
            "lora_name" => f.lora_name = r.opt_str()?.map(str::to_owned),
            "medium" => f.medium = medium(r)?,
            "group_idx" => f.group_idx = group(r)?,
            _ => r.skip()?,
        }
    }
    let tag = f.tag.ok_or(KvEventError::MissingField {
        event: "event map",
        field: "type",
    })?;
    Ok(match tag.as_str() {
        "BlockStored" => KvEvent::Stored {
            block_hashes: f.block_hashes.ok_or(KvEventError::MissingField {
                event: "BlockStored",
                field: "block_hashes",
            })?,
            parent: f.parent,
            token_ids: f.token_ids,
            block_size: f.block_size,
            lora_id: f.lora_id,
            lora_name: f.lora_name,
            medium: f.medium,
            group_idx: f.group_idx,
        },
        "BlockRemoved" => KvEvent::Removed {
            block_hashes: f.block_hashes.ok_or(KvEventError::MissingField {
                event: "BlockRemoved",
                field: "block_hashes",
            })?,
            medium: f.medium,
            group_idx: f.group_idx,
        },
        "AllBlocksCleared" => KvEvent::AllCleared,
        _ => return Err(KvEventError::UnknownEvent(tag)),
    })
}
