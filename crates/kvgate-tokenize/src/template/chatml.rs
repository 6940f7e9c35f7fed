//! The ChatML fallback, rendered without Jinja: it is the hot path for every model that has no
//! template configured.

use kvgate_protocol::agent::messages::strip_billing_line;
use kvgate_protocol::openai::{parse_messages, ChatMessage, MessageContent};
use serde_json::value::RawValue;

use crate::TokenizeError;

pub(super) fn render(
    messages_json: &str,
    add_generation_prompt: bool,
) -> Result<String, TokenizeError> {
    let raw: &RawValue = serde_json::from_str(messages_json)
        .map_err(|e| TokenizeError::Template(format!("messages: {e}")))?;
    let messages = parse_messages(raw)?;
    Ok(render_messages(&messages, add_generation_prompt))
}

/// Bytes of a content's text (its parts joined by `\n`), without joining them.
fn content_len(c: &MessageContent<'_>) -> usize {
    match c {
        MessageContent::Text(t) => t.len(),
        MessageContent::Parts(p) => p
            .iter()
            .map(|p| p.text.as_ref().map_or(0, |t| t.len() + 1))
            .sum(),
    }
}

/// A system message's text as vLLM renders it: each text part (a string content is one) without
/// Claude Code's billing line ([`strip_billing_line`]), the parts left joined by `\n`.
fn push_system_text(c: &MessageContent<'_>, out: &mut String) {
    match c {
        MessageContent::Text(t) => out.push_str(strip_billing_line(t).unwrap_or("")),
        MessageContent::Parts(parts) => {
            let mut first = true;
            for t in parts
                .iter()
                .filter_map(|p| p.text.as_deref())
                .filter_map(strip_billing_line)
            {
                if !first {
                    out.push('\n');
                }
                out.push_str(t);
                first = false;
            }
        }
    }
}

/// `<|im_start|>{role}\n{text}<|im_end|>\n` per message, then `<|im_start|>assistant\n`.
pub(crate) fn render_messages(messages: &[ChatMessage<'_>], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    render_messages_into(messages, add_generation_prompt, &mut out);
    out
}

/// [`render_messages`], appending to `out`.
pub(crate) fn render_messages_into(
    messages: &[ChatMessage<'_>],
    add_generation_prompt: bool,
    out: &mut String,
) {
    out.reserve(
        messages
            .iter()
            .map(|m| m.role.len() + m.content.as_ref().map_or(0, content_len) + 24)
            .sum::<usize>()
            + 24,
    );
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        match &m.content {
            // vLLM drops Claude Code's per-request billing line from system text (chat path).
            Some(c) if m.role == "system" => push_system_text(c, out),
            Some(c) => out.push_str(&c.text()),
            None => {}
        }
        out.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
}
