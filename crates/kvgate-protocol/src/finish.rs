//! `finish_reason`: why a worker stopped generating a choice, reduced to a fixed set so it can be
//! a metric label. Read from a streamed chunk (`sse::ChunkInfo::finish_reason`) or from the end of
//! a JSON response ([`find_finish_reason`]) by byte search, like `usage`.

use memchr::memmem::Finder;

use crate::usage::{finder, value_start};

/// The bounded `finish_reason` values (`kvgate_finish_reasons_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// `stop` (also TGI's `eos_token` / `stop_sequence`).
    Stop,
    /// `length`: `max_tokens` or the context ran out.
    Length,
    /// `tool_calls` (and the legacy `function_call`).
    ToolCalls,
    ContentFilter,
    /// Anything else a worker sends (vLLM `abort`/`error`/`repetition`, unknown values).
    Other,
}

impl FinishReason {
    pub const ALL: [FinishReason; 5] = [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::ToolCalls,
        FinishReason::ContentFilter,
        FinishReason::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::Other => "other",
        }
    }

    /// Position in [`FinishReason::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The class of a wire value (the string's bytes, without quotes).
    pub fn from_wire(v: &[u8]) -> Self {
        match v {
            b"stop" | b"eos_token" | b"stop_sequence" => FinishReason::Stop,
            b"length" => FinishReason::Length,
            b"tool_calls" | b"function_call" => FinishReason::ToolCalls,
            b"content_filter" => FinishReason::ContentFilter,
            _ => FinishReason::Other,
        }
    }
}

/// The first `"finish_reason"` member of `buf` whose value is a string (`null` is skipped: a
/// chunk that has not finished). As with `usage`, a raw `"finish_reason"` followed by a colon
/// cannot be inside a JSON string, so it is a key.
pub fn find_finish_reason(buf: &[u8]) -> Option<FinishReason> {
    const KEY: &[u8] = b"\"finish_reason\"";
    let f: &Finder<'static> = finder!(Finder, KEY);
    let mut from = 0;
    while let Some(at) = buf.get(from..).and_then(|b| f.find(b)) {
        let end = from + at + KEY.len();
        from = end;
        if let Some((v, b'"')) = value_start(buf, end) {
            let s = &buf[v + 1..];
            // Finish reasons are plain words: an escape means a value we do not know.
            let close = memchr::memchr2(b'"', b'\\', s)?;
            return Some(if s[close] == b'"' {
                FinishReason::from_wire(&s[..close])
            } else {
                FinishReason::Other
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_first_string_finish_reason() {
        let f = |b: &[u8]| find_finish_reason(b);
        assert_eq!(
            f(br#"{"choices":[{"delta":{},"finish_reason":null}]}"#),
            None
        );
        assert_eq!(
            f(br#"{"choices":[{"delta":{},"finish_reason" : "stop"}]}"#),
            Some(FinishReason::Stop)
        );
        assert_eq!(
            f(br#"{"choices":[{"index":0,"finish_reason":null},{"index":1,"finish_reason":"length"}]}"#),
            Some(FinishReason::Length)
        );
        // vLLM non-streamed chat: message, then finish_reason, then usage.
        let doc = br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"say \"finish_reason\": \"stop\"","tool_calls":[]},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
        assert_eq!(f(doc), Some(FinishReason::ToolCalls));
        assert_eq!(
            f(br#"{"finish_reason":"content_filter"}"#),
            Some(FinishReason::ContentFilter)
        );
        assert_eq!(
            f(br#"{"finish_reason":"abort"}"#),
            Some(FinishReason::Other)
        );
        assert_eq!(
            f(br#"{"finish_reason":"eos_token"}"#),
            Some(FinishReason::Stop)
        );
        assert_eq!(f(br#"{"finish_reason":"a\"b"}"#), Some(FinishReason::Other));
        assert_eq!(f(br#"{"finish_reason":"unterminated"#), None);
        assert_eq!(f(b""), None);
        for (i, r) in FinishReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}
