//! What the gateway measures per streamed chunk, found by byte search.
//!
//! A key found by searching for `"name"` cannot be a false hit inside a JSON string: there, quotes
//! are escaped, so the closing quote of the needle would be preceded by a backslash instead.

use memchr::memmem;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::error::{normalize_worker_error, OpenAiError};

/// Token counts from a `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    /// `prompt_tokens_details.cached_tokens` (vLLM fills it only with
    /// `--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`).
    pub cached_tokens: Option<u64>,
}

/// The facts about one SSE `data` payload (or a whole non-streamed JSON response).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChunkInfo<'a> {
    /// `data: [DONE]`.
    pub done: bool,
    /// A non-empty `content` / `text` / `reasoning_content` / `reasoning` / tool-call `arguments`
    /// delta: the chunk carries at least one generated token.
    pub has_token: bool,
    /// The first non-null `finish_reason`.
    pub finish_reason: Option<&'a str>,
    pub usage: Option<Usage>,
    /// `"choices":[]` plus `usage`: the extra chunk `include_usage` adds at the end.
    pub usage_only: bool,
    /// An `error` object or string in the chunk (a worker failing mid-stream).
    pub error: Option<OpenAiError>,
}

const TOKEN_KEYS: [&[u8]; 5] = [
    b"\"content\"",
    b"\"text\"",
    b"\"reasoning_content\"",
    b"\"reasoning\"",
    b"\"arguments\"",
];

impl<'a> ChunkInfo<'a> {
    /// Scans one event's `data`.
    pub fn scan(data: &'a [u8]) -> Self {
        let mut info = ChunkInfo::default();
        if data.trim_ascii() == b"[DONE]" {
            info.done = true;
            return info;
        }
        info.has_token = TOKEN_KEYS
            .iter()
            .any(|k| memmem::find_iter(data, k).any(|at| non_empty_string_at(data, at + k.len())));
        info.finish_reason = memmem::find_iter(data, b"\"finish_reason\"")
            .find_map(|at| string_value_at(data, at + b"\"finish_reason\"".len()));

        let usage_obj = memmem::find_iter(data, b"\"usage\"")
            .any(|at| value_start(data, at + b"\"usage\"".len()) == Some(b'{'));
        if usage_obj {
            if let Ok(c) = serde_json::from_slice::<UsageChunk<'_>>(data) {
                if let Some(u) = c.usage {
                    info.usage = Some(Usage {
                        prompt_tokens: u.prompt_tokens.unwrap_or(0),
                        completion_tokens: u.completion_tokens.unwrap_or(0),
                        total_tokens: u.total_tokens.unwrap_or(0),
                        cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
                    });
                    info.usage_only = c.choices.is_some_and(|ch| ch.get().trim() == "[]");
                }
            }
        }
        let error = memmem::find_iter(data, b"\"error\"").any(|at| {
            matches!(
                value_start(data, at + b"\"error\"".len()),
                Some(b'{' | b'"')
            )
        });
        if error {
            info.error = Some(normalize_worker_error(200, data));
        }
        info
    }
}

/// The first byte of the value after a key ending at `i` (skips `\s*:\s*`).
fn value_start(data: &[u8], i: usize) -> Option<u8> {
    let rest = data.get(i..)?;
    let rest = rest.trim_ascii_start().strip_prefix(b":")?;
    rest.trim_ascii_start().first().copied()
}

fn non_empty_string_at(data: &[u8], i: usize) -> bool {
    let Some(rest) = data.get(i..) else {
        return false;
    };
    let Some(rest) = rest.trim_ascii_start().strip_prefix(b":") else {
        return false;
    };
    let rest = rest.trim_ascii_start();
    rest.len() >= 2 && rest[0] == b'"' && rest[1] != b'"'
}

/// A plain string value (no escapes) after a key ending at `i`; finish reasons are short words.
fn string_value_at(data: &[u8], i: usize) -> Option<&str> {
    let rest = data.get(i..)?.trim_ascii_start().strip_prefix(b":")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
    let end = memchr::memchr2(b'"', b'\\', rest)?;
    if rest[end] != b'"' || end == 0 {
        return None;
    }
    std::str::from_utf8(&rest[..end]).ok()
}

#[derive(Deserialize)]
struct UsageChunk<'a> {
    #[serde(borrow, default)]
    choices: Option<&'a RawValue>,
    #[serde(default)]
    usage: Option<UsageJson>,
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    total_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}
