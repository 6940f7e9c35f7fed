//! What the gateway and the load generator learn from one streamed event, found by byte search.
//!
//! A key found by searching for `"name"` cannot be a false hit inside a JSON string: there, quotes
//! are escaped, so the closing quote of the needle would be preceded by a backslash instead. Only
//! a `usage` object is parsed (`usage::find_usage`'s one-pass reader). A typical chunk costs one
//! pass for `"error"`, the tail for `"usage"` and the head up to its `"content"`/`"text"`.
//!
//! **The one definition of "a token arrived"** (TTFT, inter-token latency; docs/metrics.md): an
//! event whose JSON carries generated content — a non-empty string under `content`, `text`,
//! `reasoning_content`, `reasoning`, `refusal` or a tool call's (or legacy function call's)
//! `arguments`, or a non-empty `tool_calls` array. A role-only first chunk (`{"role":"assistant",
//! "content":""}`), an empty delta that only carries `finish_reason`, the usage-only chunk and
//! error events are not tokens: a worker may send the role chunk when the request is scheduled,
//! before prefill ends. `plain_facts` (tests) is the same definition over parsed JSON, held equal
//! by a property test.

use memchr::memmem::Finder;

use crate::finish::{find_finish_reason, FinishReason};
use crate::usage::{find_usage, finder, value_start, Usage};

/// The facts about one SSE `data` payload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkInfo {
    /// `data: [DONE]`.
    pub done: bool,
    /// The event carries at least one generated token (see the module documentation).
    pub has_token: bool,
    pub usage: Option<Usage>,
    /// `"choices": []` plus `usage`: the extra chunk `include_usage` adds at the end.
    pub usage_only: bool,
    /// An `error` object or string (OpenAI, llama.cpp, TGI), or vLLM/SGLang's flat
    /// `"object": "error"` shape: a worker failing mid-stream. Such an event has no other facts.
    pub error: bool,
    /// The first choice's `finish_reason` when it is a string (the chunk that ends a choice).
    pub finish_reason: Option<FinishReason>,
}

impl ChunkInfo {
    /// Scans one event's `data`.
    pub fn scan(data: &[u8]) -> Self {
        let mut info = ChunkInfo::default();
        if data.trim_ascii() == b"[DONE]" {
            info.done = true;
            return info;
        }
        if is_error(data) {
            info.error = true;
            return info;
        }
        info.has_token = has_token(data);
        info.finish_reason = find_finish_reason(data);
        info.usage = find_usage(data);
        if info.usage.is_some() {
            info.usage_only = hits(finder!(Finder, b"\"choices\""), data).any(|end| {
                matches!(value_start(data, end), Some((v, b'['))
                    if data[v + 1..].trim_ascii_start().first() == Some(&b']'))
            });
        }
        info
    }
}

/// Where each occurrence of `f`'s needle ends in `data`, first to last. (A loop of `find` rather
/// than `find_iter`: most searches stop at the first hit, and this one sets up nothing else.)
fn hits<'a>(f: &'a Finder<'static>, data: &'a [u8]) -> impl Iterator<Item = usize> + 'a {
    let n = f.needle().len();
    let mut from = 0;
    std::iter::from_fn(move || {
        let end = from + f.find(data.get(from..)?)? + n;
        from = end;
        Some(end)
    })
}

/// `"error": {…}` / `"error": "text"` (not `"error": null`), or `"object": "error"`.
fn is_error(data: &[u8]) -> bool {
    hits(finder!(Finder, b"\"error\""), data).any(|end| {
        match value_start(data, end) {
            Some((_, first)) => matches!(first, b'{' | b'"'),
            // A string value: is it the value of `"object"`?
            None => data[..end - 7]
                .trim_ascii_end()
                .strip_suffix(b":")
                .is_some_and(|k| k.trim_ascii_end().ends_with(b"\"object\"")),
        }
    })
}

/// The token definition by key search (most likely keys first: chat content, completion text).
fn has_token(data: &[u8]) -> bool {
    let non_empty_string = [
        finder!(Finder, b"\"content\""),
        finder!(Finder, b"\"text\""),
        finder!(Finder, b"\"reasoning_content\""),
        finder!(Finder, b"\"reasoning\""),
        finder!(Finder, b"\"refusal\""),
        finder!(Finder, b"\"arguments\""),
    ]
    .into_iter()
    .any(|f| {
        hits(f, data).any(|end| {
            matches!(value_start(data, end), Some((v, b'"')) if data.get(v + 1) != Some(&b'"'))
        })
    });
    non_empty_string
        || hits(finder!(Finder, b"\"tool_calls\""), data).any(|end| {
            matches!(value_start(data, end), Some((v, b'['))
                if !matches!(data[v + 1..].trim_ascii_start().first(), Some(b']') | None))
        })
}

/// The same facts over parsed JSON, the plain twin of [`ChunkInfo::scan`] for JSON objects:
/// `error` for a top-level `error` object or string or `"object": "error"`; a token for any
/// choice whose `text`, or whose `delta`/`message` `content`, `reasoning_content`, `reasoning`,
/// `refusal` or `function_call.arguments` is a non-empty string, or whose `tool_calls` is a
/// non-empty array; `usage_only` for a readable `usage` object with `"choices": []`.
/// `None`: not JSON.
#[cfg(test)]
pub(crate) fn plain_facts(data: &[u8]) -> Option<ChunkInfo> {
    use serde_json::Value;
    let v: Value = serde_json::from_slice(data).ok()?;
    let error = matches!(v.get("error"), Some(Value::Object(_) | Value::String(_)))
        || v.get("object").and_then(Value::as_str) == Some("error");
    if error {
        return Some(ChunkInfo {
            error: true,
            ..ChunkInfo::default()
        });
    }
    let non_empty = |x: &Value| x.as_str().is_some_and(|s| !s.is_empty());
    let choices = v.get("choices").and_then(|c| c.as_array());
    let has_token = choices.is_some_and(|cs| {
        cs.iter().any(|c| {
            let part = |d: &Value| {
                ["content", "reasoning_content", "reasoning", "refusal"]
                    .iter()
                    .any(|k| non_empty(&d[*k]))
                    || non_empty(&d["function_call"]["arguments"])
                    || d["tool_calls"].as_array().is_some_and(|a| !a.is_empty())
            };
            non_empty(&c["text"]) || part(&c["delta"]) || part(&c["message"])
        })
    });
    let usage = match v.get("usage") {
        Some(u @ Value::Object(_)) => {
            crate::usage::find_usage(format!(r#"{{"usage":{u}}}"#).as_bytes())
        }
        _ => None,
    };
    let finish_reason = choices.and_then(|cs| {
        cs.iter().find_map(|c| {
            c["finish_reason"]
                .as_str()
                .map(|s| FinishReason::from_wire(s.as_bytes()))
        })
    });
    Some(ChunkInfo {
        done: false,
        has_token,
        usage,
        usage_only: usage.is_some() && choices.is_some_and(|c| c.is_empty()),
        error: false,
        finish_reason,
    })
}
