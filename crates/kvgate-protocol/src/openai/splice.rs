//! Adding `"stream_options":{"include_usage":true}` to a streamed request so the gateway can count
//! tokens. Used only when configured; the usage-only chunk it causes is stripped again for clients
//! that did not ask for it (`sse::Relay`).

use super::RequestView;

const FIELD: &[u8] = br#""stream_options":{"include_usage":true}"#;

/// Returns `body` with `stream_options.include_usage` set to true, or `None` when the client already
/// asked for usage. `view` must have been parsed from `body`. Other fields, their order and bytes,
/// are kept; an existing `stream_options` object keeps its other keys.
pub fn splice_include_usage(body: &[u8], view: &RequestView<'_>) -> Option<Vec<u8>> {
    if view.include_usage {
        return None;
    }
    match view.stream_options {
        None => {
            let open = body.iter().position(|&b| b == b'{')?;
            let rest = &body[open + 1..];
            let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
            let mut out = Vec::with_capacity(body.len() + FIELD.len() + 1);
            out.extend_from_slice(&body[..=open]);
            out.extend_from_slice(FIELD);
            if !empty {
                out.push(b',');
            }
            out.extend_from_slice(rest);
            Some(out)
        }
        Some(raw) => {
            // The raw value is a slice of `body`: find it by address (safe pointer arithmetic).
            let start = (raw.get().as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
            let end = start.checked_add(raw.get().len())?;
            if end > body.len() || &body[start..end] != raw.get().as_bytes() {
                return None;
            }
            let mut obj: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(raw.get()).ok()?;
            obj.insert("include_usage".into(), serde_json::Value::Bool(true));
            let new = serde_json::to_vec(&obj).ok()?;
            let mut out = Vec::with_capacity(body.len() + new.len());
            out.extend_from_slice(&body[..start]);
            out.extend_from_slice(&new);
            out.extend_from_slice(&body[end..]);
            Some(out)
        }
    }
}
