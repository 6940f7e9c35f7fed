//! `messages` of `/v1/chat/completions`.
//!
//! Only `role` and the text of `content` are typed; everything else a chat template may need
//! (`tool_calls`, `name`, `tool_call_id`, image parts, …) stays reachable through the raw JSON.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::cow::CowStr;
use super::request::strip_position;
use super::RequestError;

/// One chat message.
#[derive(Debug, Clone)]
pub struct ChatMessage<'a> {
    pub role: Cow<'a, str>,
    /// `None` when `content` is absent or `null` (e.g. an assistant turn with only `tool_calls`).
    pub content: Option<MessageContent<'a>>,
    /// The whole message object, for templates.
    pub raw: &'a RawValue,
}

/// `content`: a string or an array of typed parts.
#[derive(Debug, Clone)]
pub enum MessageContent<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<ContentPart<'a>>),
}

/// One element of an array `content`.
#[derive(Debug, Clone)]
pub struct ContentPart<'a> {
    /// `type`, e.g. `text`, `image_url`, `input_audio`.
    pub kind: Cow<'a, str>,
    /// `text` for text parts.
    pub text: Option<Cow<'a, str>>,
    pub raw: &'a RawValue,
}

impl MessageContent<'_> {
    /// The text of the content: the string itself, or the text parts joined by `\n` (what vLLM does
    /// for templates that expect string content). Non-text parts are skipped.
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            MessageContent::Text(t) => Cow::Borrowed(t),
            MessageContent::Parts(parts) => {
                let mut texts = parts.iter().filter_map(|p| p.text.as_deref());
                match (texts.next(), texts.next()) {
                    (None, _) => Cow::Borrowed(""),
                    (Some(one), None) => Cow::Borrowed(one),
                    (Some(a), Some(b)) => {
                        let mut s = String::with_capacity(a.len() + b.len() + 1);
                        s.push_str(a);
                        s.push('\n');
                        s.push_str(b);
                        for t in texts {
                            s.push('\n');
                            s.push_str(t);
                        }
                        Cow::Owned(s)
                    }
                }
            }
        }
    }
}

#[derive(Deserialize)]
struct RawMessage<'a> {
    #[serde(borrow, default)]
    role: Option<CowStr<'a>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct RawPart<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<CowStr<'a>>,
    #[serde(borrow, default)]
    text: Option<CowStr<'a>>,
}

/// Parses a raw `messages` array (what [`super::RequestView::messages`] does).
pub fn parse_messages<'a>(raw: &'a RawValue) -> Result<Vec<ChatMessage<'a>>, RequestError> {
    let bad = |m: String| RequestError::invalid("messages", m);
    let items: Vec<&'a RawValue> = serde_json::from_str(raw.get())
        .map_err(|_| bad("expected an array of message objects".into()))?;
    if items.is_empty() {
        return Err(bad("must contain at least one message".into()));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        if !item.get().starts_with('{') {
            return Err(bad(format!("messages[{i}] must be an object")));
        }
        let m: RawMessage<'a> = serde_json::from_str(item.get())
            .map_err(|e| bad(format!("messages[{i}]: {}", strip_position(&e))))?;
        let role = m
            .role
            .ok_or_else(|| bad(format!("messages[{i}].role is required")))?
            .0;
        let content = match m.content {
            None => None,
            Some(c) if c.get() == "null" => None,
            Some(c) => {
                Some(parse_content(c).map_err(|e| bad(format!("messages[{i}].content: {e}")))?)
            }
        };
        out.push(ChatMessage {
            role,
            content,
            raw: item,
        });
    }
    Ok(out)
}

fn parse_content<'a>(raw: &'a RawValue) -> Result<MessageContent<'a>, String> {
    let s = raw.get();
    if s.starts_with('"') {
        let t: CowStr<'a> = serde_json::from_str(s).map_err(|e| strip_position(&e))?;
        return Ok(MessageContent::Text(t.0));
    }
    if !s.starts_with('[') {
        return Err("expected a string or an array of content parts".into());
    }
    let items: Vec<&'a RawValue> = serde_json::from_str(s).map_err(|e| strip_position(&e))?;
    let mut parts = Vec::with_capacity(items.len());
    for (j, item) in items.into_iter().enumerate() {
        if !item.get().starts_with('{') {
            return Err(format!("part {j} must be an object"));
        }
        let p: RawPart<'a> = serde_json::from_str(item.get())
            .map_err(|e| format!("part {j}: {}", strip_position(&e)))?;
        let kind = p
            .kind
            .ok_or_else(|| format!("part {j}: 'type' is required"))?
            .0;
        let text = p.text.map(|t| t.0);
        if kind == "text" && text.is_none() {
            return Err(format!("part {j}: text parts need 'text'"));
        }
        parts.push(ContentPart {
            kind,
            text,
            raw: item,
        });
    }
    Ok(MessageContent::Parts(parts))
}
