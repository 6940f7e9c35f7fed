//! The client APIs the gateway serves, behind one interface: each API is a [`ClientApi`] value
//! (its route, its `endpoint` label, what it generates, how its body is parsed into the routing
//! view and which prompt field it must carry, how its responses are read, how its errors look),
//! so the route table, the metrics, the request log, the tokenizer's input and the observer read
//! the API as data instead of matching on a fixed list. A new API is one more module here and
//! one more entry in [`APIS`].
//!
//! - `openai.rs`: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.

mod openai;

use kvgate_protocol::openai::{RequestError, RequestView};

pub use openai::{CHAT, COMPLETIONS, EMBEDDINGS};

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
}

/// How the gateway's own errors are rendered for this API's clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": {"message", "type", "param", "code"}}`; mid-stream, a `data:` event of it.
    OpenAi,
}

/// One client API.
#[derive(Debug)]
pub struct ClientApi {
    /// The `endpoint` label (`kvgate_requests_by_endpoint_total`, the request log).
    pub label: &'static str,
    /// Its route (`POST`).
    pub path: &'static str,
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
    /// The field a request must carry to be routed.
    pub prompt: PromptField,
    /// Parse a body into the routing view.
    pub parse: for<'a> fn(&'a [u8]) -> Result<RequestView<'a>, RequestError>,
    pub response: ResponseShape,
    pub errors: ErrorShape,
}

/// Every API the data path serves, by [`ClientApi::id`].
pub static APIS: [&ClientApi; 3] = [&CHAT, &COMPLETIONS, &EMBEDDINGS];

/// A request's API: a copyable handle on its [`ClientApi`].
#[derive(Clone, Copy)]
pub struct Endpoint(&'static ClientApi);

impl Endpoint {
    pub const CHAT: Endpoint = Endpoint(&CHAT);
    pub const COMPLETIONS: Endpoint = Endpoint(&COMPLETIONS);
    pub const EMBEDDINGS: Endpoint = Endpoint(&EMBEDDINGS);

    /// The API served at `path`, if any.
    pub fn by_path(path: &str) -> Option<Endpoint> {
        APIS.iter().find(|a| a.path == path).map(|a| Endpoint(a))
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

    /// Parse `body` into the routing view ([`ClientApi::parse`]).
    pub fn parse(self, body: &[u8]) -> Result<RequestView<'_>, RequestError> {
        (self.0.parse)(body)
    }
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
            let e = Endpoint::by_path(api.path).unwrap();
            assert_eq!(e.label(), api.label);
        }
        assert!(Endpoint::by_path("/v1/nope").is_none());
        let labels: std::collections::HashSet<_> = APIS.iter().map(|a| a.label).collect();
        assert_eq!(labels.len(), APIS.len(), "labels are distinct");
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
