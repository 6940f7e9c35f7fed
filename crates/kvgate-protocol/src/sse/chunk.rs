//! What the gateway and the load generator learn from one streamed event, found by byte search.
//!
//! A key found by searching for `"name"` cannot be a false hit inside a JSON string: there, quotes
//! are escaped, so the closing quote of the needle would be preceded by a backslash instead.
//!
//! **The one definition of "a token arrived"** (TTFT, inter-token latency; docs/metrics.md): an
//! event whose JSON carries generated content — a non-empty string under `content`, `text`,
//! `reasoning_content`, `reasoning`, `refusal` or a tool call's (or legacy function call's)
//! `arguments`, or a non-empty `tool_calls` array. A role-only first chunk (`{"role":"assistant","content":""}`), an empty
//! delta that only carries `finish_reason`, the usage-only chunk and error events are not tokens:
//! a worker may send the role chunk when the request is scheduled, before prefill ends.
//! [`has_token_plain`] is the same definition over parsed JSON, held equal by a property test.

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
    /// `"object": "error"` shape: a worker failing mid-stream.
    pub error: bool,
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
        info.usage = find_usage(data);
        if info.usage.is_some() {
            const KEY: &[u8] = b"\"choices\"";
            info.usage_only = finder!(Finder, KEY).find_iter(data).any(|at| {
                matches!(value_start(data, at + KEY.len()), Some((v, b'['))
                    if data[v + 1..].trim_ascii_start().first() == Some(&b']'))
            });
        }
        info
    }
}

/// `"error": {…}` / `"error": "text"` (not `"error": null`), or `"object": "error"`.
fn is_error(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"error\"";
    finder!(Finder, KEY).find_iter(data).any(|at| {
        match value_start(data, at + KEY.len()) {
            Some((_, b'{' | b'"')) => true,
            Some(_) => false,
            // A string value: is it the value of `"object"`?
            None => data[..at]
                .trim_ascii_end()
                .strip_suffix(b":")
                .is_some_and(|k| k.trim_ascii_end().ends_with(b"\"object\"")),
        }
    })
}

/// The fast path of the token definition: a key search per field, no parse.
fn has_token(data: &[u8]) -> bool {
    // Most likely first: chat content, completion text.
    let string_keys = [
        finder!(Finder, b"\"content\""),
        finder!(Finder, b"\"text\""),
        finder!(Finder, b"\"reasoning_content\""),
        finder!(Finder, b"\"reasoning\""),
        finder!(Finder, b"\"refusal\""),
        finder!(Finder, b"\"arguments\""),
    ];
    let non_empty_string = string_keys.iter().any(|f| {
        f.find_iter(data).any(|at| {
            let end = at + f.needle().len();
            matches!(value_start(data, end), Some((v, b'"')) if data.get(v + 1) != Some(&b'"'))
        })
    });
    non_empty_string || {
        const KEY: &[u8] = b"\"tool_calls\"";
        finder!(Finder, KEY).find_iter(data).any(|at| {
            matches!(value_start(data, at + KEY.len()), Some((v, b'['))
                if !matches!(data[v + 1..].trim_ascii_start().first(), Some(b']') | None))
        })
    }
}

/// The token definition over parsed JSON, the plain twin of the byte search: any choice whose
/// `text`, or whose `delta`/`message` `content`, `reasoning_content`, `reasoning`, `refusal` or
/// `function_call.arguments` is a non-empty string, or whose `tool_calls` is a non-empty array.
/// `None`: not JSON.
#[cfg(test)]
pub(crate) fn has_token_plain(data: &[u8]) -> Option<bool> {
    let v: serde_json::Value = serde_json::from_slice(data).ok()?;
    let non_empty = |x: &serde_json::Value| x.as_str().is_some_and(|s| !s.is_empty());
    let choices = v.get("choices").and_then(|c| c.as_array());
    Some(choices.is_some_and(|cs| {
        cs.iter().any(|c| {
            let part = |d: &serde_json::Value| {
                ["content", "reasoning_content", "reasoning", "refusal"]
                    .iter()
                    .any(|k| non_empty(&d[*k]))
                    || non_empty(&d["function_call"]["arguments"])
                    || d["tool_calls"].as_array().is_some_and(|a| !a.is_empty())
            };
            non_empty(&c["text"]) || part(&c["delta"]) || part(&c["message"])
        })
    }))
}
