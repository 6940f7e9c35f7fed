//! `POST /v1/responses` as vLLM 0.32 builds its chat conversation (`construct_input_messages`):
//!
//! - `instructions` (when non-empty) → the first message, `{"role":"system"}`;
//! - a string `input` → one user message;
//! - `message` items (typed or "easy" `{role, content}`): user / system / developer content kept
//!   (`input_text` / `output_text` parts → text parts, `input_image` → `image_url`); an assistant
//!   message with a content array → its first part's text;
//! - `function_call` → an assistant message with one `tool_calls` entry (`call_id` as id); an
//!   `mcp_`-prefixed call right after a reasoning message joins that message instead;
//! - `function_call_output` → `{"role":"tool","content":output,"tool_call_id":call_id}`;
//! - `reasoning` → `{"role":"assistant","reasoning": summary[0].text or content[0].text}` (vLLM
//!   answers 400 to a non-empty `encrypted_content`);
//! - tools: flat function tools → `{"type":"function","function":{name, parameters, strict, type,
//!   description}}` (pydantic's `model_dump` order); none at all with `tool_choice: "none"`;
//! - `reasoning.effort` → the `reasoning_effort` template variable.
//!
//! Approximated (the request is still routed): `input_file` / `input_audio` parts, images by
//! `file_id`, item types vLLM has no chat form for (`item_reference`, `custom_tool_call`, MCP and
//! shell items, …), non-function tools, and any `previous_response_id` (the history is stored on
//! the worker, so only the new turn is known here).

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{
    raw_owned, typed, AgentApi, AgentRequest, Content, Fields, ImageUrl, Message, Part, ToolCall,
};
use crate::openai::RequestError;

/// vLLM's prefix for MCP tool-call ids.
const MCP_PREFIX: &str = "mcp_";

/// Parses a `/v1/responses` body. `model` and `input` are required.
pub fn parse(body: &[u8]) -> Result<AgentRequest, RequestError> {
    let f = Fields::parse(body)?;
    let model = f.string("model")?.ok_or(RequestError::Missing("model"))?;
    let mut req = AgentRequest::new(AgentApi::Responses, model);
    req.stream = f.get("stream")?.unwrap_or(false);
    req.max_output_tokens = f.get("max_output_tokens")?;
    req.prompt_cache_key = f.string("prompt_cache_key")?;
    req.previous_response_id = f.string("previous_response_id")?;
    req.store = f.get("store")?;
    req.background = f.get("background")?.unwrap_or(false);
    req.cache_salt = f.string("cache_salt")?;
    req.user_id = f.metadata_user_id()?;
    if req.previous_response_id.is_some() {
        req.approximate("previous_response_id");
    }

    if let Some(instructions) = f.string("instructions")? {
        if !instructions.is_empty() {
            req.messages.push(Message::text("system", instructions));
        }
    }
    let input = f.raw("input").ok_or(RequestError::Missing("input"))?;
    if input.get().starts_with('"') {
        let text: String = typed(input, "input")?;
        req.messages.push(Message::text("user", text));
    } else {
        let items: Vec<&RawValue> = typed(input, "input")?;
        for item in items {
            push_item(&mut req, item)?;
        }
    }

    let tool_choice: Option<Value> = f.get("tool_choice")?;
    if let Some(tools) = f.get::<Vec<&RawValue>>("tools")? {
        if tool_choice.as_ref().and_then(Value::as_str) != Some("none") {
            let mut out = Vec::with_capacity(tools.len());
            for t in tools {
                out.push(chat_tool(&mut req, t)?);
            }
            req.tools = Some(out);
        }
    }
    req.tool_choice = tool_choice.and_then(chat_tool_choice);

    let mut kwargs: Option<Map<String, Value>> = f.get("chat_template_kwargs")?;
    if let Some(effort) = f
        .get::<Map<String, Value>>("reasoning")?
        .and_then(|r| r.get("effort").and_then(Value::as_str).map(str::to_owned))
    {
        kwargs
            .get_or_insert_with(Map::new)
            .entry("reasoning_effort")
            .or_insert(Value::String(effort));
    }
    req.chat_template_kwargs = kwargs;
    Ok(req)
}

/// One `input` item, as far as vLLM reads it.
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(rename = "type")]
    kind: Option<String>,
    role: Option<String>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
    id: Option<String>,
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<String>,
    #[serde(borrow)]
    output: Option<&'a RawValue>,
    summary: Option<Vec<TextPart>>,
    encrypted_content: Option<String>,
}

#[derive(Deserialize)]
struct TextPart {
    text: Option<String>,
}

/// A content part of a message item.
#[derive(Deserialize)]
struct InPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    image_url: Option<String>,
}

fn push_item(req: &mut AgentRequest, raw: &RawValue) -> Result<(), RequestError> {
    let item: Item<'_> = typed(raw, "input")?;
    let kind = item.kind.as_deref().unwrap_or("message");
    match kind {
        "message" => {
            let role = item
                .role
                .ok_or_else(|| RequestError::invalid("input", "a message item needs a 'role'"))?;
            if !matches!(role.as_str(), "user" | "system" | "developer" | "assistant") {
                return Err(RequestError::invalid(
                    "input",
                    format!("unknown message role '{role}'"),
                ));
            }
            let content = item
                .content
                .ok_or_else(|| RequestError::invalid("input", "a message item needs 'content'"))?;
            let msg = if content.get().starts_with('"') {
                Message::text(&role, typed::<String>(content, "input")?)
            } else {
                let parts: Vec<InPart> = typed(content, "input")?;
                if role == "assistant" {
                    // vLLM keeps the first output part of a stored assistant message only.
                    if parts.len() > 1 {
                        req.approximate("assistant message with several parts");
                    }
                    let text = parts.into_iter().next().and_then(|p| p.text);
                    if text.is_none() {
                        req.approximate("assistant message without text");
                    }
                    Message::text("assistant", text.unwrap_or_default())
                } else {
                    Message {
                        content: Some(Content::Parts(convert_parts(req, parts))),
                        ..Message::bare(&role)
                    }
                }
            };
            req.messages.push(msg);
        }
        "function_call" => {
            let (Some(call_id), Some(name), Some(arguments)) =
                (item.call_id, item.name, item.arguments)
            else {
                return Err(RequestError::invalid(
                    "input",
                    "a function_call item needs 'call_id', 'name' and 'arguments'",
                ));
            };
            let call = ToolCall::function(call_id, name, arguments);
            let mcp = item
                .id
                .as_deref()
                .is_some_and(|id| id.starts_with(MCP_PREFIX));
            match req.messages.last_mut() {
                Some(last) if mcp && last.role == "assistant" && last.reasoning.is_some() => {
                    last.tool_calls = Some(vec![call]);
                }
                _ => req.messages.push(Message {
                    tool_calls: Some(vec![call]),
                    ..Message::bare("assistant")
                }),
            }
        }
        "function_call_output" => {
            let content = match item.output {
                None => {
                    req.approximate("function_call_output without output");
                    Content::Text(String::new())
                }
                Some(o) if o.get().starts_with('"') => Content::Text(typed(o, "input")?),
                Some(o) => Content::Parts(convert_parts(req, typed(o, "input")?)),
            };
            req.messages.push(Message {
                content: Some(content),
                tool_call_id: Some(item.call_id.unwrap_or_default()),
                ..Message::bare("tool")
            });
        }
        "reasoning" => {
            if item
                .encrypted_content
                .as_deref()
                .is_some_and(|c| !c.is_empty())
            {
                req.approximate("reasoning.encrypted_content");
                req.vllm_rejects = Some("Encrypted content is not supported.".into());
            }
            let summary = item.summary.unwrap_or_default();
            let content: Vec<TextPart> = match item.content {
                Some(c) => typed(c, "input")?,
                None => Vec::new(),
            };
            let text = if summary.len() == 1 {
                summary.into_iter().next().and_then(|p| p.text)
            } else if content.len() == 1 {
                content.into_iter().next().and_then(|p| p.text)
            } else {
                None
            };
            req.messages.push(Message {
                reasoning: Some(text.unwrap_or_default()),
                ..Message::bare("assistant")
            });
        }
        _ => req.approximate("input item without a chat form"),
    }
    Ok(())
}

fn convert_parts(req: &mut AgentRequest, parts: Vec<InPart>) -> Vec<Part> {
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        match (p.kind.as_str(), p.text, p.image_url) {
            ("input_text" | "output_text" | "text", Some(text), _) => out.push(Part::Text { text }),
            ("input_image", _, Some(url)) => out.push(Part::ImageUrl {
                image_url: ImageUrl { url },
            }),
            ("input_image", _, None) => req.approximate("input_image by file_id"),
            ("input_file", ..) => req.approximate("input_file"),
            ("input_audio", ..) => req.approximate("input_audio"),
            _ => req.approximate("content part without a chat form"),
        }
    }
    out
}

/// The fields of a flat tool vLLM's `model_dump` writes, in its order.
#[derive(Deserialize)]
struct FlatTool<'a> {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
    #[serde(borrow)]
    parameters: Option<&'a RawValue>,
    strict: Option<bool>,
    description: Option<String>,
}

fn chat_tool(req: &mut AgentRequest, raw: &RawValue) -> Result<Box<RawValue>, RequestError> {
    let t: FlatTool<'_> = typed(raw, "tools")?;
    if t.kind != "function" {
        // vLLM wraps built-in tools the same way; their model_dump is not reproduced here.
        req.approximate("non-function tool");
        return Ok(raw_owned(format!(
            r#"{{"type":"function","function":{}}}"#,
            raw.get()
        )));
    }
    let name = t
        .name
        .ok_or_else(|| RequestError::invalid("tools", "a function tool needs a 'name'"))?;
    let js = |v: &Option<String>| serde_json::to_string(v).expect("string serializes");
    Ok(raw_owned(format!(
        r#"{{"type":"function","function":{{"name":{},"parameters":{},"strict":{},"type":"function","description":{}}}}}"#,
        serde_json::to_string(&name).expect("string serializes"),
        t.parameters.map_or("null", RawValue::get),
        t.strict
            .map_or("null", |s| if s { "true" } else { "false" }),
        js(&t.description),
    )))
}

/// Responses `tool_choice` → chat: strings as they are; `{"type":"function","name"}` → the chat
/// named form; others (built-in tool types) dropped.
fn chat_tool_choice(v: Value) -> Option<Value> {
    match v {
        Value::String(_) => Some(v),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name")?.clone();
            Some(serde_json::json!({"type": "function", "function": {"name": name}}))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests;
