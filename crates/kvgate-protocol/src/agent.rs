//! The agent-client APIs (OpenAI Responses, Anthropic Messages) as vLLM 0.32 renders them.
//!
//! How to use it: [`responses::parse`] (a `/v1/responses` body), [`messages::parse`] (a
//! `/v1/messages` body) or [`messages::parse_count_tokens`] give an [`AgentRequest`]: the routing
//! fields (`model`, `stream`, `max_output_tokens`, `prompt_cache_key`, `metadata.user_id`,
//! `previous_response_id`, `store`, …) and the OpenAI chat conversation vLLM builds from the body
//! before its chat template runs ([`AgentRequest::messages`], [`AgentRequest::tools`], …).
//! [`AgentRequest::chat_body`] serializes that conversation as a `/v1/chat/completions` body, which
//! `openai::RequestView::parse` and kvgate-tokenize's chat-template path take as they are: render
//! it like a chat request and the tokens are the ones vLLM computes for the original body.
//! [`AgentRequest::exact`] is false when some shape had to be approximated (listed in
//! [`AgentRequest::approximations`]): route on it anyway, never fail the request for it.
//! A body vLLM itself refuses after parsing (e.g. encrypted reasoning) has [`AgentRequest::vllm_rejects`].
//!
//! Layout: `responses.rs` (input items, instructions, flat tools), `messages.rs` (system blocks,
//! content blocks, tool_use / tool_result, thinking, the Claude Code billing header), `pyjson.rs`
//! (CPython's `json.dumps`, which vLLM uses for tool-call arguments).

pub mod messages;
mod pyjson;
pub mod responses;

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::openai::RequestError;

pub use pyjson::dumps as python_json_dumps;

/// Which API a body came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentApi {
    Responses,
    Messages,
}

/// A parsed Responses or Messages body: its routing fields and the chat conversation vLLM renders.
#[derive(Debug, Clone)]
pub struct AgentRequest {
    pub api: AgentApi,
    /// `model` (required).
    pub model: String,
    /// `stream` (default false).
    pub stream: bool,
    /// Responses `max_output_tokens`; Messages `max_tokens`.
    pub max_output_tokens: Option<u64>,
    /// Responses `prompt_cache_key` (an affinity key; vLLM ignores it).
    pub prompt_cache_key: Option<String>,
    /// `metadata.user_id` (Claude Code puts its session in it; see [`messages::session_of_user_id`]).
    pub user_id: Option<String>,
    /// Responses `previous_response_id`: the history lives on the worker that stored it.
    pub previous_response_id: Option<String>,
    /// Responses `store`.
    pub store: Option<bool>,
    /// Responses `background`.
    pub background: bool,
    /// vLLM's `cache_salt` (Responses): seeds the block hashes.
    pub cache_salt: Option<String>,
    /// The chat messages vLLM renders, in order.
    pub messages: Vec<Message>,
    /// The tools in chat form (`{"type":"function","function":{…}}`), as vLLM hands them to the
    /// template; `None` when there are none (or Responses `tool_choice: "none"`).
    pub tools: Option<Vec<Box<RawValue>>>,
    /// `tool_choice` in chat form (`"auto"`, `"required"`, `"none"`, `{"type":"function",…}`).
    pub tool_choice: Option<Value>,
    /// Extra chat-template variables (Responses `chat_template_kwargs`, `reasoning.effort` as
    /// `reasoning_effort`).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Whether the conversation is exactly what vLLM renders.
    pub exact: bool,
    /// What was approximated (fixed names, e.g. `"input_file"`, `"previous_response_id"`).
    pub approximations: Vec<&'static str>,
    /// The error message vLLM answers this body with (HTTP 400) although it parses.
    pub vllm_rejects: Option<String>,
}

/// One OpenAI chat message. Serialized with only the fields set, in vLLM's key order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message with string content.
    pub fn text(role: &str, text: impl Into<String>) -> Self {
        Message {
            role: role.to_owned(),
            content: Some(Content::Text(text.into())),
            reasoning: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }

    fn bare(role: &str) -> Self {
        Message {
            role: role.to_owned(),
            content: None,
            reasoning: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// `content`: a string or typed parts.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

impl Content {
    /// The text parts joined by `\n` (what vLLM's "string" content format does).
    pub fn text(&self) -> String {
        match self {
            Content::Text(t) => t.clone(),
            Content::Parts(p) => p
                .iter()
                .filter_map(|p| match p {
                    Part::Text { text } => Some(text.as_str()),
                    Part::ImageUrl { .. } => None,
                })
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// One content part.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ImageUrl {
    pub url: String,
}

/// An assistant tool call: `{"id", "type": "function", "function": {"name", "arguments"}}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

impl ToolCall {
    pub fn function(id: String, name: String, arguments: String) -> Self {
        ToolCall {
            id,
            kind: "function",
            function: FunctionCall { name, arguments },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text (a string, as in OpenAI chat).
    pub arguments: String,
}

impl AgentRequest {
    fn new(api: AgentApi, model: String) -> Self {
        AgentRequest {
            api,
            model,
            stream: false,
            max_output_tokens: None,
            prompt_cache_key: None,
            user_id: None,
            previous_response_id: None,
            store: None,
            background: false,
            cache_salt: None,
            messages: Vec::new(),
            tools: None,
            tool_choice: None,
            chat_template_kwargs: None,
            exact: true,
            approximations: Vec::new(),
            vllm_rejects: None,
        }
    }

    /// Records that `what` could not be rendered exactly.
    fn approximate(&mut self, what: &'static str) {
        self.exact = false;
        if !self.approximations.contains(&what) {
            self.approximations.push(what);
        }
    }

    /// The conversation as a `/v1/chat/completions` body: `model`, `messages`, and when set
    /// `tools`, `tool_choice`, `chat_template_kwargs`, `cache_salt` and `max_completion_tokens`
    /// (never `stream`). Rendering it as chat gives the prompt vLLM renders for the original body.
    pub fn chat_body(&self) -> String {
        #[derive(Serialize)]
        struct ChatBody<'r> {
            model: &'r str,
            messages: &'r [Message],
            #[serde(skip_serializing_if = "Option::is_none")]
            tools: Option<&'r [Box<RawValue>]>,
            #[serde(skip_serializing_if = "Option::is_none")]
            tool_choice: Option<&'r Value>,
            #[serde(skip_serializing_if = "Option::is_none")]
            chat_template_kwargs: Option<&'r Map<String, Value>>,
            #[serde(skip_serializing_if = "Option::is_none")]
            cache_salt: Option<&'r str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            max_completion_tokens: Option<u64>,
        }
        serde_json::to_string(&ChatBody {
            model: &self.model,
            messages: &self.messages,
            tools: self.tools.as_deref(),
            tool_choice: self.tool_choice.as_ref(),
            chat_template_kwargs: self.chat_template_kwargs.as_ref(),
            cache_salt: self.cache_salt.as_deref(),
            max_completion_tokens: self.max_output_tokens,
        })
        .expect("plain data serializes")
    }

    /// The text of the whole conversation (every message's text, reasoning and tool-call
    /// arguments, in order): a cheap stand-in for the rendered prompt where no template is wanted.
    pub fn flat_text(&self) -> String {
        let mut out = String::new();
        for m in &self.messages {
            for s in [m.content.as_ref().map(Content::text), m.reasoning.clone()]
                .into_iter()
                .flatten()
            {
                out.push_str(&s);
                out.push('\n');
            }
            for c in m.tool_calls.iter().flatten() {
                out.push_str(&c.function.arguments);
                out.push('\n');
            }
        }
        out
    }
}

/// The top-level fields of a JSON object body, values kept raw (order inside them preserved).
/// A key given twice keeps the last value, as the Python servers do; `null` counts as absent.
pub(crate) struct Fields<'a>(BTreeMap<String, &'a RawValue>);

impl<'a> Fields<'a> {
    pub(crate) fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        let text = std::str::from_utf8(body).map_err(|e| {
            RequestError::Json(format!("invalid UTF-8 at byte {}", e.valid_up_to()))
        })?;
        if !text.trim_start().starts_with('{') {
            return Err(match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                Ok(_) => RequestError::NotObject,
                Err(e) => RequestError::Json(e.to_string()),
            });
        }
        let map: BTreeMap<String, &'a RawValue> =
            serde_json::from_str(text).map_err(|e| RequestError::Json(e.to_string()))?;
        Ok(Fields(
            map.into_iter().filter(|(_, v)| v.get() != "null").collect(),
        ))
    }

    pub(crate) fn raw(&self, key: &str) -> Option<&'a RawValue> {
        self.0.get(key).copied()
    }

    pub(crate) fn get<T: serde::Deserialize<'a>>(
        &self,
        key: &'static str,
    ) -> Result<Option<T>, RequestError> {
        self.raw(key).map(|r| typed(r, key)).transpose()
    }

    pub(crate) fn string(&self, key: &'static str) -> Result<Option<String>, RequestError> {
        self.get::<String>(key)
    }

    /// `metadata.user_id` when `metadata` is an object holding a string there.
    pub(crate) fn metadata_user_id(&self) -> Result<Option<String>, RequestError> {
        let Some(raw) = self.raw("metadata") else {
            return Ok(None);
        };
        let meta: BTreeMap<String, Value> = typed(raw, "metadata")?;
        Ok(meta
            .get("user_id")
            .and_then(Value::as_str)
            .map(str::to_owned))
    }
}

/// A raw value as `T`, or `Invalid { param }` with serde's message (without its position).
pub(crate) fn typed<'a, T: serde::Deserialize<'a>>(
    raw: &'a RawValue,
    param: &'static str,
) -> Result<T, RequestError> {
    serde_json::from_str(raw.get()).map_err(|e| {
        let msg = e.to_string();
        let msg = match msg.rfind(" at line ") {
            Some(i) => msg[..i].to_owned(),
            None => msg,
        };
        RequestError::Invalid {
            param,
            message: msg,
        }
    })
}

/// A JSON text owned as a raw value (for tools built from parts).
pub(crate) fn raw_owned(json: String) -> Box<RawValue> {
    RawValue::from_string(json).expect("built from valid JSON")
}
