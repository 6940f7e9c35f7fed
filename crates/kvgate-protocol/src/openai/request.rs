//! [`RequestView`]: one pass over the body, routing fields only.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::Deserializer as _;
use serde_json::value::RawValue;

use super::cow::{CowStr, OptCowStr};
use super::messages::{ChatMessage, OptMessagesSeed};
use super::prompt::{parse_prompt, PromptInput};
use super::RequestError;

/// The routing fields of a `/v1/chat/completions` or `/v1/completions` body, borrowed from it.
///
/// Unknown fields are skipped, never rejected. A field given twice keeps the last value, as the
/// Python servers behind us do. `null` counts as absent.
#[derive(Debug, Clone)]
pub struct RequestView<'a> {
    /// `model` (required). Borrowed unless the JSON string has escapes.
    pub model: Cow<'a, str>,
    /// `stream` (default false).
    pub stream: bool,
    /// `stream_options.include_usage` (default false).
    pub include_usage: bool,
    /// The raw `stream_options` value, if present (kept for [`super::splice_include_usage`]).
    pub stream_options: Option<&'a RawValue>,
    /// `max_tokens` (deprecated in chat, the only one in completions).
    pub max_tokens: Option<u64>,
    /// `max_completion_tokens` (chat).
    pub max_completion_tokens: Option<u64>,
    /// vLLM's `cache_salt`: changes the worker's block hashes, so it seeds ours.
    pub cache_salt: Option<Cow<'a, str>>,
    /// OpenAI's `prompt_cache_key`: a client-supplied cache-affinity hint.
    pub prompt_cache_key: Option<Cow<'a, str>>,
    /// `messages` (chat), parsed in the same pass as the rest (every message string is scanned
    /// once); absent when the field is, or when parsed with [`RequestView::parse_without_messages`].
    pub messages: Option<Vec<ChatMessage<'a>>>,
    /// `prompt` as raw JSON (completions).
    pub prompt: Option<&'a RawValue>,
    /// `tools` as raw JSON (chat templates render them).
    pub tools: Option<&'a RawValue>,
    /// vLLM's `add_generation_prompt` (default true when absent).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's `chat_template_kwargs` as raw JSON (extra template variables, e.g. `enable_thinking`).
    pub chat_template_kwargs: Option<&'a RawValue>,
    /// The whole body, for [`RequestView::messages_raw`].
    body: &'a str,
}

impl<'a> RequestView<'a> {
    /// Parses the routing fields of `body`, `messages` included. Malformed messages are an error
    /// here (`param: "messages"`), and so is an empty array.
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        Self::parse_inner(body, true)
    }

    /// Like [`RequestView::parse`] with `messages` skipped unread: for bodies where they mean
    /// nothing (completions, embeddings), so that a stray `messages` field neither costs a parse
    /// nor fails the request.
    pub fn parse_without_messages(body: &'a [u8]) -> Result<Self, RequestError> {
        Self::parse_inner(body, false)
    }

    fn parse_inner(body: &'a [u8], with_messages: bool) -> Result<Self, RequestError> {
        let first = body.iter().find(|b| !b.is_ascii_whitespace()).copied();
        if first != Some(b'{') {
            // Tell "valid JSON, wrong shape" apart from "not JSON"; off the hot path.
            return Err(match serde_json::from_slice::<IgnoredAny>(body) {
                Ok(_) => RequestError::NotObject,
                Err(e) => RequestError::Json(e.to_string()),
            });
        }
        // The whole body checked as UTF-8 once (JSON text is UTF-8, and the workers refuse
        // anything else too); then no string needs its own check as it is borrowed.
        let body = std::str::from_utf8(body).map_err(|e| {
            RequestError::Json(format!("invalid UTF-8 at byte {}", e.valid_up_to()))
        })?;
        // The usual shapes in one fast pass; anything else (errors included) through serde.
        let fields = match super::fast::fields(body, with_messages) {
            Some(f) => f,
            None => serde_fields(body, with_messages)?,
        };
        let model = fields.model.ok_or(RequestError::Missing("model"))?;
        if fields.messages.as_ref().is_some_and(Vec::is_empty) {
            return Err(RequestError::invalid(
                "messages",
                "must contain at least one message",
            ));
        }
        let include_usage = match fields.stream_options {
            Some(raw) => parse_include_usage(raw)?,
            None => false,
        };
        Ok(RequestView {
            model,
            stream: fields.stream.unwrap_or(false),
            include_usage,
            stream_options: fields.stream_options,
            max_tokens: fields.max_tokens,
            max_completion_tokens: fields.max_completion_tokens,
            cache_salt: fields.cache_salt,
            prompt_cache_key: fields.prompt_cache_key,
            messages: fields.messages,
            prompt: fields.prompt,
            tools: fields.tools,
            add_generation_prompt: fields.add_generation_prompt,
            chat_template_kwargs: fields.chat_template_kwargs,
            body,
        })
    }

    /// The output-length cap the client asked for: `max_completion_tokens`, else `max_tokens`.
    pub fn max_output_tokens(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// `prompt` (completions) as typed input. Missing → `Missing("prompt")`.
    pub fn prompt_input(&self) -> Result<PromptInput<'a>, RequestError> {
        parse_prompt(self.prompt.ok_or(RequestError::Missing("prompt"))?)
    }

    /// `messages` (chat). Missing → `Missing("messages")`.
    pub fn messages(&self) -> Result<&[ChatMessage<'a>], RequestError> {
        self.messages
            .as_deref()
            .ok_or(RequestError::Missing("messages"))
    }

    /// `messages` as raw JSON, for chat templates that read more than role and text (tool
    /// calls, names, image parts). Found by walking the body again: only template rendering
    /// needs it, and that costs far more than the walk. Missing → `Missing("messages")`.
    pub fn messages_raw(&self) -> Result<&'a RawValue, RequestError> {
        struct Raw;
        impl<'de> Visitor<'de> for Raw {
            type Value = Option<&'de RawValue>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut out = None;
                while let Some(key) = map.next_key::<CowStr<'de>>()? {
                    if key.0 == "messages" {
                        out = non_null(map.next_value()?);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(out)
            }
        }
        serde_json::Deserializer::from_str(self.body)
            .deserialize_map(Raw)
            .map_err(|e| RequestError::Json(e.to_string()))?
            .ok_or(RequestError::Missing("messages"))
    }
}

/// The routing fields of a JSON object text, by serde: every shape, and the errors.
pub(super) fn serde_fields(body: &str, with_messages: bool) -> Result<Fields<'_>, RequestError> {
    let field = Cell::new(None);
    let mut de = serde_json::Deserializer::from_str(body);
    let visitor = ViewVisitor {
        field: &field,
        with_messages,
    };
    let fields = match de.deserialize_map(visitor) {
        Ok(f) => f,
        Err(e) => {
            return Err(match (field.get(), e.classify()) {
                (Some(param), serde_json::error::Category::Data) => {
                    RequestError::invalid(param, strip_position(&e))
                }
                _ => RequestError::Json(e.to_string()),
            })
        }
    };
    de.end().map_err(|e| RequestError::Json(e.to_string()))?;
    Ok(fields)
}

fn parse_include_usage(raw: &RawValue) -> Result<bool, RequestError> {
    #[derive(serde::Deserialize)]
    struct StreamOptions {
        include_usage: Option<bool>,
    }
    if !raw.get().starts_with('{') {
        return Err(RequestError::invalid(
            "stream_options",
            "expected an object",
        ));
    }
    let so: StreamOptions = serde_json::from_str(raw.get())
        .map_err(|e| RequestError::invalid("stream_options", strip_position(&e)))?;
    Ok(so.include_usage.unwrap_or(false))
}

/// serde_json messages end in " at line 1 column 57"; useful for syntax errors, noise for type ones.
pub(crate) fn strip_position(e: &impl std::fmt::Display) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}

/// The fields as read (before the checks that need all of them).
#[derive(Debug, Default)]
pub(super) struct Fields<'a> {
    pub(super) model: Option<Cow<'a, str>>,
    pub(super) stream: Option<bool>,
    pub(super) stream_options: Option<&'a RawValue>,
    pub(super) max_tokens: Option<u64>,
    pub(super) max_completion_tokens: Option<u64>,
    pub(super) cache_salt: Option<Cow<'a, str>>,
    pub(super) prompt_cache_key: Option<Cow<'a, str>>,
    pub(super) messages: Option<Vec<ChatMessage<'a>>>,
    pub(super) prompt: Option<&'a RawValue>,
    pub(super) tools: Option<&'a RawValue>,
    pub(super) add_generation_prompt: Option<bool>,
    pub(super) chat_template_kwargs: Option<&'a RawValue>,
}

/// Records which known field is being read so a type error can name it as `param`.
struct ViewVisitor<'c> {
    field: &'c Cell<Option<&'static str>>,
    with_messages: bool,
}

impl<'de, 'c> Visitor<'de> for ViewVisitor<'c> {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
        let mut out = Fields::default();
        while let Some(key) = map.next_key::<CowStr<'de>>()? {
            let name: &'static str = match &*key.0 {
                "model" => "model",
                "stream" => "stream",
                "stream_options" => "stream_options",
                "max_tokens" => "max_tokens",
                "max_completion_tokens" => "max_completion_tokens",
                "cache_salt" => "cache_salt",
                "prompt_cache_key" => "prompt_cache_key",
                "messages" if self.with_messages => "messages",
                "prompt" => "prompt",
                "tools" => "tools",
                "add_generation_prompt" => "add_generation_prompt",
                "chat_template_kwargs" => "chat_template_kwargs",
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            self.field.set(Some(name));
            match name {
                "model" => out.model = map.next_value::<OptCowStr<'de>>()?.0,
                "stream" => out.stream = map.next_value()?,
                "stream_options" => out.stream_options = non_null(map.next_value()?),
                "max_tokens" => out.max_tokens = map.next_value()?,
                "max_completion_tokens" => out.max_completion_tokens = map.next_value()?,
                "cache_salt" => out.cache_salt = map.next_value::<OptCowStr<'de>>()?.0,
                "prompt_cache_key" => out.prompt_cache_key = map.next_value::<OptCowStr<'de>>()?.0,
                "messages" => out.messages = map.next_value_seed(OptMessagesSeed)?,
                "prompt" => out.prompt = non_null(map.next_value()?),
                "tools" => out.tools = non_null(map.next_value()?),
                "add_generation_prompt" => out.add_generation_prompt = map.next_value()?,
                _ => out.chat_template_kwargs = non_null(map.next_value()?),
            }
            self.field.set(None);
        }
        Ok(out)
    }
}

fn non_null(raw: &RawValue) -> Option<&RawValue> {
    (raw.get() != "null").then_some(raw)
}
