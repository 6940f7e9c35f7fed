//! The event streams of the agent APIs, read with their event names: OpenAI Responses
//! (`response.*` events) and Anthropic Messages (`message_start` … `message_stop`).
//!
//! - A token (TTFT, inter-token gaps): Responses — any `response.*.delta` event with a non-empty
//!   `delta` (`output_text`, `reasoning_text`, `reasoning_summary_text`, `function_call_arguments`,
//!   `refusal`, …), never `response.created` / `response.in_progress`; Messages — a
//!   `content_block_delta` whose delta is a non-empty `text_delta`, `thinking_delta` or
//!   `input_json_delta` (not `signature_delta`), never `message_start`, `ping` or
//!   `content_block_start`.
//! - Usage: Responses — the `response` object of `response.completed` / `.incomplete` / `.failed`;
//!   Messages — `message_start.message.usage` merged with the last `message_delta.usage` (counts
//!   present in the later event win; Anthropic's disjoint input counts are summed).
//! - The end: `response.completed` / `response.incomplete`; `message_stop` (or `[DONE]`).
//! - Errors: an `error` event (both), `response.failed`.
//! - Responses: the response id, from `response.created` (to pin later uses of it).
//!
//! The event type is the `event:` field, else the data's `type`.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::chunk::ChunkInfo;
use crate::finish::FinishReason;
use crate::usage::Usage;

/// Which API's stream this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    /// OpenAI chat/completions chunks (`ChunkInfo::scan`).
    #[default]
    OpenAi,
    Responses,
    Messages,
}

/// What a stream taught so far that one event cannot hold.
#[derive(Debug, Default)]
pub(crate) struct AgentState {
    /// Messages: the usage counts seen so far, each as last reported.
    input: Option<u64>,
    output: Option<u64>,
    cache_read: Option<u64>,
    cache_creation: Option<u64>,
    /// Responses: the id of `response.created`, until taken.
    pub(crate) response_id: Option<String>,
}

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    delta: Option<&'a RawValue>,
    #[serde(borrow)]
    response: Option<&'a RawValue>,
    #[serde(borrow)]
    message: Option<&'a RawValue>,
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Head {
    id: Option<String>,
}

#[derive(Deserialize)]
struct AnthropicUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct MessageHead<'a> {
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow)]
    partial_json: Option<Cow<'a, str>>,
    #[serde(borrow)]
    stop_reason: Option<Cow<'a, str>>,
}

/// The facts of one event of `dialect` (not [`Dialect::OpenAi`]).
pub(crate) fn scan(dialect: Dialect, name: &[u8], data: &[u8], st: &mut AgentState) -> ChunkInfo {
    let mut info = ChunkInfo::default();
    if data.trim_ascii() == b"[DONE]" {
        info.done = true;
        return info;
    }
    let Ok(ev) = serde_json::from_slice::<Event<'_>>(data) else {
        return info;
    };
    let kind: &[u8] = if name.is_empty() || name == b"message" {
        ev.kind.as_deref().unwrap_or("").as_bytes()
    } else {
        name
    };
    match dialect {
        Dialect::Responses => responses(kind, &ev, st, &mut info),
        Dialect::Messages => messages(kind, &ev, st, &mut info),
        Dialect::OpenAi => unreachable!("OpenAI chunks are scanned by ChunkInfo::scan"),
    }
    info
}

fn responses(kind: &[u8], ev: &Event<'_>, st: &mut AgentState, info: &mut ChunkInfo) {
    match kind {
        b"response.created" => {
            st.response_id = ev
                .response
                .and_then(|r| serde_json::from_str::<Head>(r.get()).ok())
                .and_then(|h| h.id);
        }
        b"response.completed" | b"response.incomplete" | b"response.failed" => {
            info.usage = ev
                .response
                .and_then(|r| crate::usage::find_usage(r.get().as_bytes()));
            match kind {
                b"response.completed" => {
                    info.done = true;
                    info.finish_reason = Some(FinishReason::Stop);
                }
                b"response.incomplete" => {
                    info.done = true;
                    info.finish_reason = Some(
                        if ev
                            .response
                            .is_some_and(|r| r.get().contains("\"max_output_tokens\""))
                        {
                            FinishReason::Length
                        } else {
                            FinishReason::Other
                        },
                    );
                }
                _ => info.error = true,
            }
        }
        b"error" => info.error = true,
        k if k.starts_with(b"response.") && k.ends_with(b".delta") => {
            // A string delta that is not empty (`"delta":""` is 2 bytes of JSON).
            info.has_token = ev
                .delta
                .is_some_and(|d| d.get().starts_with('"') && d.get().len() > 2);
        }
        _ => {}
    }
}

fn messages(kind: &[u8], ev: &Event<'_>, st: &mut AgentState, info: &mut ChunkInfo) {
    let mut merge = |raw: Option<&RawValue>, info: &mut ChunkInfo| {
        let Some(u) = raw.and_then(|u| serde_json::from_str::<AnthropicUsage>(u.get()).ok()) else {
            return;
        };
        st.input = u.input_tokens.or(st.input);
        st.output = u.output_tokens.or(st.output);
        st.cache_read = u.cache_read_input_tokens.or(st.cache_read);
        st.cache_creation = u.cache_creation_input_tokens.or(st.cache_creation);
        info.usage = Some(Usage {
            prompt_tokens: st.input.unwrap_or(0)
                + st.cache_read.unwrap_or(0)
                + st.cache_creation.unwrap_or(0),
            completion_tokens: st.output.unwrap_or(0),
            cached_tokens: st.cache_read,
        });
    };
    match kind {
        b"message_start" => {
            let usage = ev
                .message
                .and_then(|m| serde_json::from_str::<MessageHead<'_>>(m.get()).ok())
                .and_then(|m| m.usage);
            merge(usage, info);
        }
        b"content_block_delta" => {
            if let Some(d) = ev
                .delta
                .and_then(|d| serde_json::from_str::<Delta<'_>>(d.get()).ok())
            {
                let text = match d.kind.as_deref() {
                    Some("text_delta") => d.text,
                    Some("thinking_delta") => d.thinking,
                    Some("input_json_delta") => d.partial_json,
                    _ => None,
                };
                info.has_token = text.is_some_and(|t| !t.is_empty());
            }
        }
        b"message_delta" => {
            merge(ev.usage, info);
            if let Some(r) = ev
                .delta
                .and_then(|d| serde_json::from_str::<Delta<'_>>(d.get()).ok())
                .and_then(|d| d.stop_reason)
            {
                info.finish_reason = Some(stop_reason(r.as_bytes()));
            }
        }
        b"message_stop" => info.done = true,
        b"error" => info.error = true,
        _ => {}
    }
}

/// An Anthropic `stop_reason` as a finish reason.
pub fn stop_reason(v: &[u8]) -> FinishReason {
    match v {
        b"end_turn" | b"stop_sequence" => FinishReason::Stop,
        b"max_tokens" | b"model_context_window_exceeded" => FinishReason::Length,
        b"tool_use" => FinishReason::ToolCalls,
        b"refusal" => FinishReason::ContentFilter,
        _ => FinishReason::Other,
    }
}

/// Non-streamed bodies: the facts of a whole Responses / Messages JSON document — its `id`, its
/// usage (any backend's fields) and its finish reason (`status` / `incomplete_details`,
/// `stop_reason`).
pub fn whole_body(
    dialect: Dialect,
    body: &[u8],
) -> (Option<String>, Option<Usage>, Option<FinishReason>) {
    #[derive(Deserialize)]
    struct Doc<'a> {
        id: Option<String>,
        #[serde(borrow)]
        usage: Option<&'a RawValue>,
        #[serde(borrow)]
        status: Option<Cow<'a, str>>,
        #[serde(borrow)]
        incomplete_details: Option<&'a RawValue>,
        #[serde(borrow)]
        stop_reason: Option<Cow<'a, str>>,
    }
    let Ok(doc) = serde_json::from_slice::<Doc<'_>>(body) else {
        return (None, None, None);
    };
    let usage = doc
        .usage
        .and_then(|u| crate::usage::usage_of_object(u.get().as_bytes()));
    let finish = match dialect {
        Dialect::Messages => doc.stop_reason.map(|r| stop_reason(r.as_bytes())),
        _ => match doc.status.as_deref() {
            Some("completed") => Some(FinishReason::Stop),
            Some("incomplete") => Some(
                if doc
                    .incomplete_details
                    .is_some_and(|d| d.get().contains("max_output_tokens"))
                {
                    FinishReason::Length
                } else {
                    FinishReason::Other
                },
            ),
            Some(_) => Some(FinishReason::Other),
            None => None,
        },
    };
    (doc.id, usage, finish)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::Relay;

    fn run(dialect: Dialect, stream: &str) -> (Vec<ChunkInfo>, Option<String>) {
        let mut r = Relay::new(false, 1 << 20).with_dialect(dialect);
        let mut out = Vec::new();
        for piece in stream.as_bytes().chunks(7) {
            r.feed(piece, |i| out.push(*i));
        }
        (out, r.take_response_id())
    }

    #[test]
    fn responses_streams_time_the_first_delta_and_read_the_final_usage() {
        let s = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_abc\",\"status\":\"in_progress\",\"output\":[]}}\n\n",
            "event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"response\":{\"id\":\"resp_abc\"}}\n\n",
            "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"message\",\"content\":[]}}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"\"}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n",
            "event: response.reasoning_text.delta\ndata: {\"type\":\"response.reasoning_text.delta\",\"delta\":\"x\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_abc\",\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi\"}]}],\"usage\":{\"input_tokens\":30,\"input_tokens_details\":{\"cached_tokens\":16},\"output_tokens\":2,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":32}}}\n\n",
        );
        let (evs, id) = run(Dialect::Responses, s);
        assert_eq!(id.as_deref(), Some("resp_abc"));
        let tokens: Vec<bool> = evs.iter().map(|e| e.has_token).collect();
        assert_eq!(tokens, [false, false, false, false, true, true, false]);
        let last = evs.last().unwrap();
        assert!(last.done);
        assert_eq!(last.finish_reason, Some(FinishReason::Stop));
        let u = last.usage.unwrap();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (30, 2, Some(16))
        );
    }

    #[test]
    fn messages_streams_time_content_deltas_and_merge_usage() {
        let s = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":10,\"output_tokens\":1,\"cache_read_input_tokens\":32}}}\n\n",
            "event: ping\ndata: {\"type\":\"ping\"}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"abc\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\"\"}}\n\n",
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":7}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let (evs, _) = run(Dialect::Messages, s);
        let tokens: Vec<bool> = evs.iter().map(|e| e.has_token).collect();
        assert_eq!(
            tokens,
            [false, false, false, true, false, true, false, false, false]
        );
        let u = evs[7].usage.unwrap();
        // Disjoint Anthropic counts: 10 uncached + 32 cached read.
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (42, 7, Some(32))
        );
        assert_eq!(evs[7].finish_reason, Some(FinishReason::ToolCalls));
        assert!(evs[8].done);
        let err = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        assert!(run(Dialect::Messages, err).0[0].error);
    }

    #[test]
    fn whole_bodies_give_id_usage_and_finish() {
        let r = br#"{"id":"resp_1","object":"response","output":[{"type":"message","status":"completed"}],"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":5,"output_tokens":3,"input_tokens_details":{"cached_tokens":0}}}"#;
        let (id, u, f) = whole_body(Dialect::Responses, r);
        assert_eq!(id.as_deref(), Some("resp_1"));
        assert_eq!(
            u.map(|u| (u.prompt_tokens, u.completion_tokens, u.cached_tokens)),
            Some((5, 3, Some(0)))
        );
        assert_eq!(f, Some(FinishReason::Length));
        let m = br#"{"id":"msg_1","type":"message","content":[],"stop_reason":"end_turn","usage":{"input_tokens":4,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":16}}"#;
        let (_, u, f) = whole_body(Dialect::Messages, m);
        assert_eq!(
            u.map(|u| (u.prompt_tokens, u.cached_tokens)),
            Some((20, Some(16)))
        );
        assert_eq!(f, Some(FinishReason::Stop));
        // vLLM before PR 40912: no cache fields, input_tokens is the whole prompt.
        let (_, u, _) = whole_body(
            Dialect::Messages,
            br#"{"usage":{"input_tokens":9,"output_tokens":1}}"#,
        );
        assert_eq!(
            u.map(|u| (u.prompt_tokens, u.cached_tokens)),
            Some((9, None))
        );
    }
}
