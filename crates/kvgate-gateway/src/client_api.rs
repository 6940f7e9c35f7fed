//! The client APIs the gateway serves, behind one interface: each API is a [`ClientApi`] value
//! (its route, its `endpoint` label, what it generates, how its body is parsed into the routing
//! view and which prompt field it must carry, how its responses are read, how its errors look),
//! so the route table, the metrics, the request log, the tokenizer's input and the observer read
//! the API as data instead of matching on a fixed list. A new API is one more module here and
//! one more entry in [`APIS`].
//!
//! - `openai.rs`: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.
//! - `agent.rs`: OpenAI Responses (`/v1/responses`, and `/v1/responses/{id}…` pinned to the
//!   worker that stored the id) and Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`).
//! - `passthrough.rs`: the pooling and tokenizer endpoints vLLM and SGLang serve (rerank, score,
//!   classify, pooling, tokenize, detokenize): routed by model and load, bodies passed unread.

mod agent;
mod openai;
mod passthrough;

use kvgate_protocol::agent::AgentRequest;
use kvgate_protocol::openai::{RequestError, RequestView};

pub use agent::{stored_response_id, COUNT_TOKENS, MESSAGES, RESPONSES, STORED_RESPONSE};
pub use openai::{CHAT, COMPLETIONS, EMBEDDINGS};
pub use passthrough::{CLASSIFY, DETOKENIZE, POOLING, RERANK, SCORE, TOKENIZE};

/// How a body sent to an API is read for routing.
#[derive(Clone, Copy)]
pub enum Front {
    /// OpenAI chat / completions / embeddings: the borrowed [`RequestView`].
    OpenAi(for<'a> fn(&'a [u8]) -> Result<RequestView<'a>, RequestError>),
    /// Responses / Messages: the conversation vLLM renders ([`AgentRequest`]), rendered through
    /// the chat path. `prefix`: route on its prompt (false: count_tokens, by model and load).
    Agent {
        parse: fn(&[u8]) -> Result<AgentRequest, RequestError>,
        prefix: bool,
    },
    /// Only `model` is read (optional when one model is served); routed by load.
    Passthrough,
    /// `/v1/responses/{id}[/cancel|/input_items]`: pinned to the worker that stored the id.
    StoredResponse,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Front::OpenAi(_) => "OpenAi",
            Front::Agent { .. } => "Agent",
            Front::Passthrough => "Passthrough",
            Front::StoredResponse => "StoredResponse",
        })
    }
}

/// Which field of the routing view holds the prompt the worker will cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptField {
    /// Chat `messages`, rendered through the model's chat template.
    Messages,
    /// A completions `prompt` (text, texts, token ids, batches).
    Prompt,
    /// No prefix cache to hit (embeddings): load-balanced only.
    None,
}

/// How a worker's response to this API is read (first generated token, usage, finish reason,
/// errors) by the observer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseShape {
    /// OpenAI chat/completions: `data: {...}` chunks, `[DONE]`, usage in the last chunk; a
    /// non-streamed JSON body with `usage` and `choices[].finish_reason`.
    OpenAi,
    /// OpenAI Responses: `event: response.*` events (first `response.*.delta` is the first
    /// token, usage in `response.completed`); a JSON `response` object. Its id is pinned.
    Responses,
    /// Anthropic Messages: `message_start` … `message_stop` (first `content_block_delta`, usage
    /// merged from `message_start` and `message_delta`); a JSON `message` object.
    Messages,
}

/// How the gateway's own errors are rendered for this API's clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": {"message", "type", "param", "code"}}`; mid-stream, a `data:` event of it.
    OpenAi,
    /// OpenAI Responses: the same JSON; mid-stream, an `event: error` with `{"type":"error",…}`.
    Responses,
    /// Anthropic: `{"type":"error","error":{"type","message"}}` (shed requests: 529
    /// `overloaded_error`); mid-stream, an `event: error` of it.
    Anthropic,
}

/// One client API.
#[derive(Debug)]
pub struct ClientApi {
    /// The `endpoint` label (`kvgate_requests_by_endpoint_total`, the request log).
    pub label: &'static str,
    /// Its route (`POST`; [`Front::StoredResponse`]: the prefix of its routes).
    pub path: &'static str,
    /// Other paths of the same API (vLLM and SGLang name some endpoints more than one way).
    pub aliases: &'static [&'static str],
    /// Its position in [`APIS`] (per-API metric series are resolved once into a table).
    pub id: usize,
    /// Whether it generates tokens: TTFT, ITL, completion tokens, finish reasons and the SLO are
    /// measured for it (not for embeddings).
    pub generates: bool,
    /// Whether a prefill/decode pool may split it (the handoff bodies know its shape).
    pub splits: bool,
    /// Whether a stream that did not ask for usage gets it requested (and the extra usage event
    /// stripped from the client's stream).
    pub splices_usage: bool,
    /// The field a request must carry to be routed (OpenAI APIs).
    pub prompt: PromptField,
    /// How its body is read.
    pub front: Front,
    pub response: ResponseShape,
    pub errors: ErrorShape,
}

/// Every API the data path serves, by [`ClientApi::id`].
pub static APIS: [&ClientApi; 13] = [
    &CHAT,
    &COMPLETIONS,
    &EMBEDDINGS,
    &RESPONSES,
    &MESSAGES,
    &COUNT_TOKENS,
    &STORED_RESPONSE,
    &RERANK,
    &SCORE,
    &CLASSIFY,
    &POOLING,
    &TOKENIZE,
    &DETOKENIZE,
];

/// A request's API: a copyable handle on its [`ClientApi`].
#[derive(Clone, Copy)]
pub struct Endpoint(&'static ClientApi);

impl Endpoint {
    pub const CHAT: Endpoint = Endpoint(&CHAT);
    pub const COMPLETIONS: Endpoint = Endpoint(&COMPLETIONS);
    pub const EMBEDDINGS: Endpoint = Endpoint(&EMBEDDINGS);
    pub const RESPONSES: Endpoint = Endpoint(&RESPONSES);
    pub const MESSAGES: Endpoint = Endpoint(&MESSAGES);
    pub const COUNT_TOKENS: Endpoint = Endpoint(&COUNT_TOKENS);
    pub const STORED_RESPONSE: Endpoint = Endpoint(&STORED_RESPONSE);

    /// The API served at `path`, if any (`/v1/responses/{id}…`: [`Endpoint::STORED_RESPONSE`]).
    pub fn by_path(path: &str) -> Option<Endpoint> {
        if let Some(api) = APIS.iter().find(|a| {
            !matches!(a.front, Front::StoredResponse)
                && (a.path == path || a.aliases.contains(&path))
        }) {
            return Some(Endpoint(api));
        }
        agent::stored_response_id(path).map(|_| Endpoint::STORED_RESPONSE)
    }

    pub fn api(self) -> &'static ClientApi {
        self.0
    }

    pub fn label(self) -> &'static str {
        self.0.label
    }

    pub fn path(self) -> &'static str {
        self.0.path
    }

    pub fn id(self) -> usize {
        self.0.id
    }

    pub fn generates(self) -> bool {
        self.0.generates
    }

    /// Parse `body` into the routing view: the API's own for the OpenAI APIs, the fields
    /// without `messages` for the others.
    pub fn parse(self, body: &[u8]) -> Result<RequestView<'_>, RequestError> {
        match self.0.front {
            Front::OpenAi(parse) => parse(body),
            _ => RequestView::parse_without_messages(body),
        }
    }
}

/// A request's session, hashed (its `RouteInput::affinity`): the first of `headers` (names, in
/// order) the request carries, else the body's `prompt_cache_key`, else the session inside
/// Anthropic `metadata.user_id` (Claude Code's; any other user id as it is).
pub fn session_key(
    req_headers: &http::HeaderMap,
    headers: &[String],
    prompt_cache_key: Option<&str>,
    user_id: Option<&str>,
) -> Option<u64> {
    // One pass over the request's header names (a handful) rather than a lookup per configured
    // name (each would parse and hash it); the configured order decides between two present.
    // `iter()` yields each name's values together, first value first: only a name's first value
    // counts (as `HeaderMap::get` would answer), without hashing the name again to look it up.
    // The configured names' lengths as a bit set: most of a request's headers (host,
    // content-type, content-length, ...) are ruled out by their length alone.
    let bit = |n: usize| 1u64 << n.min(63);
    let lens = headers.iter().fold(0u64, |m, h| m | bit(h.len()));
    let mut best: Option<(usize, &[u8])> = None;
    let mut last: Option<&http::HeaderName> = None;
    for (name, value) in req_headers.iter() {
        if last == Some(name) {
            continue;
        }
        last = Some(name);
        let name = name.as_str();
        if lens & bit(name.len()) == 0 {
            continue;
        }
        let Some(i) = headers.iter().position(|h| h == name) else {
            continue;
        };
        if best.is_some_and(|(j, _)| j < i) {
            continue;
        }
        let v = value.as_bytes();
        if !v.is_empty() {
            best = Some((i, v));
        }
    }
    let from_header = best.map(|(_, v)| v);
    let hash = |b: &[u8]| xxhash_rust::xxh3::xxh3_64(b);
    if let Some(v) = from_header {
        return Some(hash(v));
    }
    if let Some(k) = prompt_cache_key.filter(|k| !k.is_empty()) {
        return Some(hash(k.as_bytes()));
    }
    let user = user_id.filter(|u| !u.is_empty())?;
    Some(
        match kvgate_protocol::agent::messages::session_of_user_id(user) {
            Some(s) => hash(s.as_bytes()),
            None => hash(user.as_bytes()),
        },
    )
}

impl PartialEq for Endpoint {
    fn eq(&self, other: &Self) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for Endpoint {}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.label)
    }
}

impl serde::Serialize for Endpoint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.label)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_is_found_by_its_path_and_knows_its_place() {
        for (i, api) in APIS.iter().enumerate() {
            assert_eq!(api.id, i, "{}", api.label);
            let path = match api.front {
                Front::StoredResponse => format!("{}resp_1", api.path),
                _ => api.path.to_owned(),
            };
            let e = Endpoint::by_path(&path).unwrap();
            assert_eq!(e.label(), api.label);
            for alias in api.aliases {
                assert_eq!(Endpoint::by_path(alias).unwrap().label(), api.label);
            }
        }
        assert!(Endpoint::by_path("/v1/nope").is_none());
        for (path, label) in [
            ("/v2/rerank", "rerank"),
            ("/score", "score"),
            ("/v1/tokenize", "tokenize"),
            ("/v1/responses/resp_1", "responses_stored"),
            ("/v1/responses/resp_1/cancel", "responses_stored"),
            ("/v1/messages/count_tokens", "messages_count_tokens"),
        ] {
            assert_eq!(
                Endpoint::by_path(path).map(Endpoint::label),
                Some(label),
                "{path}"
            );
        }
        assert!(Endpoint::by_path("/v1/responses/").is_none());
        let labels: std::collections::HashSet<_> = APIS.iter().map(|a| a.label).collect();
        assert_eq!(labels.len(), APIS.len(), "labels are distinct");
    }

    #[test]
    fn sessions_come_from_headers_then_the_body() {
        let names: Vec<String> = ["x-claude-code-session-id", "session-id"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut h = http::HeaderMap::new();
        let body_only = session_key(&h, &names, Some("pck"), None);
        assert_eq!(body_only, Some(xxhash_rust::xxh3::xxh3_64(b"pck")));
        h.insert("session-id", "s1".parse().unwrap());
        let codex = session_key(&h, &names, Some("pck"), None);
        assert_eq!(codex, Some(xxhash_rust::xxh3::xxh3_64(b"s1")));
        h.insert("x-claude-code-session-id", "cc".parse().unwrap());
        assert_eq!(
            session_key(&h, &names, None, None),
            Some(xxhash_rust::xxh3::xxh3_64(b"cc")),
            "earlier names win"
        );
        // Claude Code's user id: two requests of one session share the key.
        let e = http::HeaderMap::new();
        let a = session_key(
            &e,
            &names,
            None,
            Some(r#"{"device_id":"d","session_id":"S"}"#),
        );
        let b = session_key(&e, &names, None, Some("user_x_account_y_session_S"));
        assert_eq!(a, b);
        assert_eq!(session_key(&e, &names, None, None), None);
    }

    #[test]
    fn each_api_parses_what_it_routes_on() {
        let chat = Endpoint::CHAT
            .parse(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#)
            .unwrap();
        assert!(chat.messages.is_some());
        // Completions and embeddings do not read `messages`.
        let c = Endpoint::COMPLETIONS
            .parse(br#"{"model":"m","prompt":"hi","messages":7}"#)
            .unwrap();
        assert!(c.messages.is_none() && c.prompt.is_some());
        assert!(Endpoint::EMBEDDINGS
            .parse(br#"{"model":"m","input":"x"}"#)
            .is_ok());
        assert!(!Endpoint::EMBEDDINGS.generates());
        assert_eq!(serde_json::to_string(&Endpoint::CHAT).unwrap(), "\"chat\"");
    }
}
