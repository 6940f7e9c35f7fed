//! `POST /v1/messages` (and `/v1/messages/count_tokens`) as vLLM 0.32 converts it to a chat
//! request (`AnthropicServingMessages`):
//!
//! - `system`: a string as it is; text blocks concatenated with no separator, **dropping blocks
//!   that start with `x-anthropic-billing-header`** (Claude Code's per-request attribution, which
//!   would change the first block's hash on every request); `role: "system"` messages leading
//!   `messages` are appended (blank-line separated); the result, when non-empty, is the first
//!   message;
//! - string content → the message's content; blocks: `text` → text parts (one text part becomes a
//!   plain string), `image` → `image_url` (base64 → a `data:` URI), `thinking` → the assistant's
//!   `reasoning` (concatenated), `redacted_thinking` skipped, `tool_use` → `tool_calls` with
//!   `arguments = json.dumps(input)` (CPython separators, ASCII escapes);
//! - a user `tool_result` → a `{"role":"tool","tool_call_id","content"}` message placed before
//!   the user's own message (text blocks joined by `\n`; its images follow as a user message);
//!   an assistant `tool_result` → the text part `"Tool result: …"`;
//! - a message left with no content, tool calls or reasoning is dropped;
//! - tools → `{"type":"function","function":{"name","description","parameters":input_schema}}`;
//!   `tool_choice` auto→auto, any→required, none→none, tool→named, absent with tools → auto.
//!
//! Approximated: `role: "system"` messages after the first non-system one (vLLM keeps or folds
//! them depending on what its chat template does with them; kept in place here, moved out of a
//! tool_use → tool_result run), content blocks other than the above (documents, server tools:
//! their text, if any, is kept), a `tool_use` without an id (vLLM makes one from the clock),
//! images in `system`, and tools without an `input_schema`.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::pyjson::dumps;
use super::{
    raw_owned, typed, AgentApi, AgentRequest, Content, Fields, ImageUrl, Message, Part, ToolCall,
};
use crate::openai::RequestError;

/// The prefix of Claude Code's attribution block in `system`.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// vLLM 0.32's chat path (`_strip_claude_code_billing_header`, applied to `system` messages'
/// text parts; a string content is one part): a part that starts with [`BILLING_HEADER`] loses
/// its first line, and is dropped (`None`) when nothing follows it. Other text is returned as is.
/// (The header's `cch` changes on every request: kept, it would end the prefix cache there.)
pub fn strip_billing_line(text: &str) -> Option<&str> {
    if !text.starts_with(BILLING_HEADER) {
        return Some(text);
    }
    match text.split_once('\n') {
        Some((_, rest)) if !rest.is_empty() => Some(rest),
        _ => None,
    }
}

/// Parses a `/v1/messages` body: `model`, `messages` and `max_tokens` are required.
pub fn parse(body: &[u8]) -> Result<AgentRequest, RequestError> {
    let f = Fields::parse(body)?;
    let req = parse_fields(&f)?;
    if req.max_output_tokens.is_none() {
        return Err(RequestError::Missing("max_tokens"));
    }
    Ok(req)
}

/// Parses a `/v1/messages/count_tokens` body (no `max_tokens`).
pub fn parse_count_tokens(body: &[u8]) -> Result<AgentRequest, RequestError> {
    parse_fields(&Fields::parse(body)?)
}

/// The session id inside Claude Code's `metadata.user_id`: the JSON form's `session_id`
/// (≥ 2.1.78), or what follows `_session_` in the legacy `user_…_account_…_session_<uuid>`.
pub fn session_of_user_id(user_id: &str) -> Option<String> {
    if user_id.starts_with('{') {
        let v: Value = serde_json::from_str(user_id).ok()?;
        return v.get("session_id")?.as_str().map(str::to_owned);
    }
    let (_, s) = user_id.rsplit_once("_session_")?;
    (!s.is_empty()).then(|| s.to_owned())
}

fn parse_fields(f: &Fields<'_>) -> Result<AgentRequest, RequestError> {
    let model = f.string("model")?.ok_or(RequestError::Missing("model"))?;
    let mut req = AgentRequest::new(AgentApi::Messages, model);
    req.stream = f.get("stream")?.unwrap_or(false);
    req.max_output_tokens = f.get("max_tokens")?;
    req.user_id = f.metadata_user_id()?;

    let mut system = match f.raw("system") {
        None => String::new(),
        Some(s) if s.get().starts_with('"') => typed(s, "system")?,
        Some(s) => {
            let blocks: Vec<Block<'_>> = typed(s, "system")?;
            blocks_text(&mut req, &blocks)
        }
    };

    let raw_msgs: Vec<InMessage<'_>> = f
        .get("messages")?
        .ok_or(RequestError::Missing("messages"))?;
    if raw_msgs.is_empty() {
        return Err(RequestError::invalid(
            "messages",
            "must contain at least one message",
        ));
    }
    for m in &raw_msgs {
        if !matches!(m.role.as_str(), "user" | "assistant" | "system") {
            return Err(RequestError::invalid(
                "messages",
                format!("unknown role '{}'", m.role),
            ));
        }
        if m.content.get() == "[]" {
            return Err(RequestError::invalid(
                "messages",
                "message content must not be empty",
            ));
        }
    }
    let leading = raw_msgs.iter().take_while(|m| m.role == "system").count();
    for m in &raw_msgs[..leading] {
        let text = system_message_text(&mut req, m)?;
        join_into(&mut system, &text);
    }
    if !system.is_empty() {
        req.messages.push(Message::text("system", system));
    }
    for m in out_of_tool_runs(&raw_msgs[leading..])? {
        if m.role == "system" {
            req.approximate("inline system message");
            let text = system_message_text(&mut req, m)?;
            if !text.is_empty() {
                req.messages.push(Message::text("system", text));
            }
            continue;
        }
        push_message(&mut req, m)?;
    }

    if let Some(tools) = f.get::<Vec<Tool<'_>>>("tools")? {
        let mut out = Vec::with_capacity(tools.len());
        for t in tools {
            if t.input_schema.is_none() {
                req.approximate("tool without input_schema");
            }
            out.push(raw_owned(format!(
                r#"{{"type":"function","function":{{"name":{},"description":{},"parameters":{}}}}}"#,
                serde_json::to_string(&t.name).expect("string serializes"),
                serde_json::to_string(&t.description).expect("string serializes"),
                t.input_schema.map_or("null", RawValue::get),
            )));
        }
        req.tools = Some(out);
    }
    req.tool_choice = match f.get::<ToolChoice>("tool_choice")? {
        None if req.tools.is_some() => Some(Value::from("auto")),
        None => None,
        Some(c) => match c.kind.as_str() {
            "auto" => Some(Value::from("auto")),
            "any" => Some(Value::from("required")),
            "none" => Some(Value::from("none")),
            "tool" => {
                let name = c.name.ok_or_else(|| {
                    RequestError::invalid(
                        "tool_choice",
                        "tool_choice.name is required when tool_choice.type is 'tool'",
                    )
                })?;
                Some(serde_json::json!({"type": "function", "function": {"name": name}}))
            }
            other => {
                return Err(RequestError::invalid(
                    "tool_choice",
                    format!("unknown tool_choice type '{other}'"),
                ))
            }
        },
    };
    Ok(req)
}

#[derive(Deserialize)]
struct InMessage<'a> {
    role: String,
    #[serde(borrow)]
    content: &'a RawValue,
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    thinking: Option<String>,
    id: Option<String>,
    name: Option<String>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
    tool_use_id: Option<String>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
    source: Option<Source>,
}

#[derive(Deserialize)]
struct Source {
    #[serde(rename = "type")]
    kind: String,
    media_type: Option<String>,
    data: Option<String>,
    url: Option<String>,
}

#[derive(Deserialize)]
struct Tool<'a> {
    name: String,
    description: Option<String>,
    #[serde(borrow)]
    input_schema: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ToolChoice {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
}

/// vLLM's join of system texts: non-empty ones, blank-line separated.
fn join_into(acc: &mut String, text: &str) {
    if text.is_empty() {
        return;
    }
    if !acc.is_empty() {
        acc.push_str("\n\n");
    }
    acc.push_str(text);
}

/// Text blocks concatenated, the billing header dropped.
fn blocks_text(req: &mut AgentRequest, blocks: &[Block<'_>]) -> String {
    let mut out = String::new();
    for b in blocks {
        match (b.kind.as_str(), b.text.as_deref()) {
            ("text", Some(t)) if !t.starts_with(BILLING_HEADER) => out.push_str(t),
            ("text", _) => {}
            _ => req.approximate("non-text system block"),
        }
    }
    out
}

fn system_message_text(req: &mut AgentRequest, m: &InMessage<'_>) -> Result<String, RequestError> {
    if m.content.get().starts_with('"') {
        let s: String = typed(m.content, "messages")?;
        return Ok(if s.starts_with(BILLING_HEADER) {
            String::new()
        } else {
            s
        });
    }
    let blocks: Vec<Block<'_>> = typed(m.content, "messages")?;
    Ok(blocks_text(req, &blocks))
}

/// System messages between an assistant's `tool_use` and the results answering it move after
/// the results (as vLLM does), so that nothing separates a call from its result.
fn out_of_tool_runs<'m, 'a>(
    msgs: &'m [InMessage<'a>],
) -> Result<Vec<&'m InMessage<'a>>, RequestError> {
    let mut out = Vec::with_capacity(msgs.len());
    let mut held = Vec::new();
    let mut awaiting = false;
    for m in msgs {
        if m.role == "system" {
            if awaiting {
                held.push(m);
            } else {
                out.push(m);
            }
            continue;
        }
        if m.role == "assistant" {
            out.append(&mut held);
        }
        out.push(m);
        if m.role == "user" {
            out.append(&mut held);
        }
        awaiting = m.role == "assistant"
            && !m.content.get().starts_with('"')
            && typed::<Vec<Block<'_>>>(m.content, "messages")?
                .iter()
                .any(|b| b.kind == "tool_use");
    }
    out.append(&mut held);
    Ok(out)
}

fn image_part(req: &mut AgentRequest, source: Option<&Source>) -> Option<Part> {
    let url = match source? {
        Source {
            kind,
            media_type,
            data: Some(data),
            ..
        } if kind == "base64" => format!(
            "data:{};base64,{data}",
            media_type.as_deref().unwrap_or("image/png")
        ),
        Source { url: Some(url), .. } => url.clone(),
        _ => {
            req.approximate("image source without data");
            return None;
        }
    };
    Some(Part::ImageUrl {
        image_url: ImageUrl { url },
    })
}

fn push_message(req: &mut AgentRequest, m: &InMessage<'_>) -> Result<(), RequestError> {
    if m.content.get().starts_with('"') {
        let text: String = typed(m.content, "messages")?;
        req.messages.push(Message::text(&m.role, text));
        return Ok(());
    }
    let blocks: Vec<Block<'_>> = typed(m.content, "messages")?;
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    let mut reasoning: Option<String> = None;
    for b in &blocks {
        match b.kind.as_str() {
            "text" => match b.text.as_deref() {
                Some(t) if !t.is_empty() => parts.push(Part::Text { text: t.to_owned() }),
                _ => {}
            },
            "image" => parts.extend(image_part(req, b.source.as_ref())),
            "thinking" => {
                if let Some(t) = &b.thinking {
                    reasoning.get_or_insert_with(String::new).push_str(t);
                }
            }
            "redacted_thinking" => {}
            "tool_use" => {
                let id = b.id.clone().unwrap_or_else(|| {
                    req.approximate("tool_use without id");
                    String::new()
                });
                let arguments = match b.input {
                    Some(input) if input.get() != "null" => {
                        dumps(input.get()).map_err(|e| RequestError::invalid("messages", e))?
                    }
                    _ => "{}".to_owned(),
                };
                calls.push(ToolCall::function(
                    id,
                    b.name.clone().unwrap_or_default(),
                    arguments,
                ));
            }
            "tool_result" => {
                let (text, images) = tool_result_content(req, b.content)?;
                if m.role == "user" {
                    req.messages.push(Message {
                        content: Some(Content::Text(text)),
                        tool_call_id: Some(b.tool_use_id.clone().unwrap_or_default()),
                        ..Message::bare("tool")
                    });
                    if !images.is_empty() {
                        req.messages.push(Message {
                            content: Some(Content::Parts(images)),
                            ..Message::bare("user")
                        });
                    }
                } else {
                    parts.push(Part::Text {
                        text: format!("Tool result: {text}"),
                    });
                }
            }
            _ => {
                req.approximate("content block without a chat form");
                if let Some(t) = b.text.as_deref().filter(|t| !t.is_empty()) {
                    parts.push(Part::Text { text: t.to_owned() });
                }
            }
        }
    }
    if parts.is_empty() && calls.is_empty() && reasoning.is_none() {
        return Ok(());
    }
    let content = match parts.len() {
        0 => None,
        1 if matches!(parts[0], Part::Text { .. }) => match parts.pop() {
            Some(Part::Text { text }) => Some(Content::Text(text)),
            _ => unreachable!("checked to be a text part"),
        },
        _ => Some(Content::Parts(parts)),
    };
    req.messages.push(Message {
        role: m.role.clone(),
        content,
        reasoning,
        tool_calls: (!calls.is_empty()).then_some(calls),
        tool_call_id: None,
    });
    Ok(())
}

/// A `tool_result`'s content: its text (text blocks joined by `\n`) and its images.
fn tool_result_content(
    req: &mut AgentRequest,
    content: Option<&RawValue>,
) -> Result<(String, Vec<Part>), RequestError> {
    let Some(content) = content.filter(|c| c.get() != "null") else {
        return Ok((String::new(), Vec::new()));
    };
    if content.get().starts_with('"') {
        return Ok((typed(content, "messages")?, Vec::new()));
    }
    let blocks: Vec<Block<'_>> = typed(content, "messages")?;
    let mut texts = Vec::new();
    let mut images = Vec::new();
    for b in &blocks {
        match b.kind.as_str() {
            "text" => texts.push(b.text.clone().unwrap_or_default()),
            "image" => images.extend(image_part(req, b.source.as_ref())),
            _ => req.approximate("tool_result block without a chat form"),
        }
    }
    Ok((texts.join("\n"), images))
}

#[cfg(test)]
mod tests;
