//! Usage of a disaggregated request: the decode worker reports the prompt tokens it pulled from the
//! prefill worker as cached (a cold request looks like a 100% hit), so the client's `usage` takes
//! `prompt_tokens` and `prompt_tokens_details` from the prefill leg and `completion_tokens` from the
//! decode leg, and `total_tokens` is recomputed (vllm-project/router's usage merge does the same;
//! when the prefill leg reported no details, the decode leg's are removed).

use serde_json::{json, Value};

use super::Usage;

/// Rewrites the `usage` object of one JSON document (a response body or one SSE event's data);
/// `None` when it has no `usage` object or is not JSON (then it goes out unchanged).
pub fn merge_pd_usage(doc: &[u8], prefill: &Usage) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(doc).ok()?;
    let u = v.get_mut("usage")?.as_object_mut()?;
    let completion = u
        .get("completion_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    u.insert("prompt_tokens".into(), json!(prefill.prompt_tokens));
    u.insert(
        "total_tokens".into(),
        json!(prefill.prompt_tokens + completion),
    );
    match prefill.cached_tokens {
        Some(c) => {
            let d = u
                .entry("prompt_tokens_details")
                .or_insert_with(|| json!({}));
            if !d.is_object() {
                *d = json!({});
            }
            d["cached_tokens"] = json!(c);
        }
        None => {
            u.remove("prompt_tokens_details");
        }
    }
    serde_json::to_vec(&v).ok()
}

/// The same for one complete SSE event (`data: {...}` lines and the blank line that ends it):
/// the rewritten event, `None` to deliver it unchanged.
pub fn merge_pd_usage_event(event: &[u8], prefill: &Usage) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(event).ok()?;
    let body_end = text.trim_end_matches(['\r', '\n']).len();
    let (body, end) = text.split_at(body_end);
    let data = body.strip_prefix("data:")?;
    // One `data:` line only: a multi-line event is passed on unchanged.
    if data.contains('\n') {
        return None;
    }
    let merged = merge_pd_usage(data.trim_start().as_bytes(), prefill)?;
    let mut out = Vec::with_capacity(merged.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&merged);
    out.extend_from_slice(end.as_bytes());
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pre(cached: Option<u64>) -> Usage {
        Usage {
            prompt_tokens: 300,
            completion_tokens: 1,
            cached_tokens: cached,
        }
    }

    #[test]
    fn json_takes_prompt_and_cache_from_prefill() {
        let d = br#"{"id":"x","usage":{"prompt_tokens":300,"completion_tokens":7,"total_tokens":307,"prompt_tokens_details":{"cached_tokens":299}}}"#;
        let out = merge_pd_usage(d, &pre(Some(16))).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], 300);
        assert_eq!(v["usage"]["completion_tokens"], 7);
        assert_eq!(v["usage"]["total_tokens"], 307);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
        assert_eq!(v["id"], "x");
        // Prefill reported no details: the decode leg's go.
        let out = merge_pd_usage(d, &pre(None)).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert!(v["usage"].get("prompt_tokens_details").is_none());
        // Prefill counted the prompt differently: its count wins and the total follows.
        let p = Usage {
            prompt_tokens: 280,
            ..pre(Some(0))
        };
        let v: Value = serde_json::from_slice(&merge_pd_usage(d, &p).unwrap()).unwrap();
        assert_eq!(v["usage"]["total_tokens"], 287);
    }

    #[test]
    fn documents_without_usage_are_left_alone() {
        assert!(merge_pd_usage(br#"{"usage":null}"#, &pre(None)).is_none());
        assert!(merge_pd_usage(br#"{"id":1}"#, &pre(None)).is_none());
        assert!(merge_pd_usage(b"[DONE]", &pre(None)).is_none());
    }

    #[test]
    fn sse_event_keeps_its_framing() {
        let ev = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":300,\"completion_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":299}}}\r\n\r\n";
        let out = merge_pd_usage_event(ev, &pre(Some(0))).unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(s.starts_with("data: {"));
        assert!(s.ends_with("}\r\n\r\n"));
        assert!(s.contains("\"cached_tokens\":0"), "{s}");
        assert!(s.contains("\"total_tokens\":304"), "{s}");
        assert!(merge_pd_usage_event(b"data: [DONE]\n\n", &pre(None)).is_none());
        assert!(merge_pd_usage_event(b": keep-alive\n\n", &pre(None)).is_none());
    }
}
