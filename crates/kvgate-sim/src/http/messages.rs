//! The Anthropic Messages API as vLLM 0.32 serves it (`vllm/entrypoints/anthropic/`):
//! `POST /v1/messages` (stream or not) and `POST /v1/messages/count_tokens`.
//!
//! The body becomes chat messages with kvgate-protocol's `agent::messages` (vLLM's conversion,
//! including dropping Claude Code's `x-anthropic-billing-header` system block), so the prompt
//! tokens are those of the equivalent chat request. Usage is what vLLM reports with
//! `--enable-prompt-tokens-details` (the sim's chat always reports cached tokens too):
//! `input_tokens` = prompt − cached − written, `cache_read_input_tokens` = cached,
//! `cache_creation_input_tokens` = the prompt's full blocks this request wrote into the cache. In a
//! stream, `message_start` carries `{input_tokens: prompt, output_tokens: 0}` and the cache numbers
//! come on the final `message_delta`; there is no `ping` (vLLM sends none). Errors use the
//! Anthropic envelope with vLLM's type names (`BadRequestError`, `NotFoundError`, …); a body that
//! fails request validation gets vLLM's OpenAI-shaped 400, as on a real engine.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use kvgate_protocol::agent::{self, AgentRequest};
use serde_json::{json, Value};

use super::generate;
use super::stream::{EventStream, Frames, Translate};
use super::{json as json_resp, Body};
use crate::engine::FinishReason;
use crate::server::Shared;
use crate::worker::ReqEvent;

type Bad = Box<Response<Body>>;

/// vLLM's `translate_error_response`: the Anthropic envelope, vLLM's error type names.
fn anthropic_error(status: StatusCode, message: impl Into<String>) -> Bad {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    Box::new(json_resp(
        status,
        &json!({"type": "error", "error": {"type": kind, "message": message.into()}}),
    ))
}

/// Parses the body (model checked, defaulted when absent) and renders its prompt tokens.
fn render(
    sh: &Shared,
    body: &[u8],
    parse: fn(&[u8]) -> Result<AgentRequest, kvgate_protocol::openai::RequestError>,
) -> Result<(Value, AgentRequest, Vec<u32>), Bad> {
    let mut v: Value = serde_json::from_slice(body).map_err(|e| {
        Box::new(super::error(
            StatusCode::BAD_REQUEST,
            format!("invalid JSON body: {e}"),
            Some("body"),
        ))
    })?;
    if !v.is_object() {
        return Err(Box::new(super::invalid(
            "Input should be a valid dictionary or object to extract fields from",
            "body",
        )));
    }
    match v.get("model") {
        Some(Value::String(m)) if *m == sh.cfg.model => {}
        Some(Value::String(m)) => {
            return Err(anthropic_error(
                StatusCode::NOT_FOUND,
                format!("The model `{m}` does not exist."),
            ))
        }
        // Anthropic's `model` is required; vLLM's request validation says so.
        _ => return Err(Box::new(super::invalid("Field required", "model"))),
    }
    let req = parse(body).map_err(|e| {
        Box::new(super::invalid(
            e.to_string(),
            e.param().unwrap_or("messages"),
        ))
    })?;
    if let Some(msg) = &req.vllm_rejects {
        return Err(anthropic_error(StatusCode::BAD_REQUEST, msg.clone()));
    }
    let chat: Value = serde_json::from_str(&req.chat_body())
        .map_err(|e| anthropic_error(StatusCode::BAD_REQUEST, e.to_string()))?;
    let prompt = crate::tokenizer::encode_body(&sh.tokenizer, &chat)
        .map_err(|e| anthropic_error(StatusCode::BAD_REQUEST, e.message))?
        .into_iter()
        .next()
        .unwrap_or_default();
    v.as_object_mut().map(|o| o.remove("messages"));
    Ok((v, req, prompt))
}

/// `POST /v1/messages/count_tokens`: the rendered prompt's length, no engine work.
pub fn count_tokens(sh: &Shared, body: &[u8]) -> Response<Body> {
    match render(sh, body, agent::messages::parse_count_tokens) {
        Ok((_, _, prompt)) => json_resp(
            StatusCode::OK,
            &json!({"input_tokens": prompt.len(),
                    "context_management": {"original_input_tokens": prompt.len()}}),
        ),
        Err(b) => *b,
    }
}

/// `POST /v1/messages`.
pub async fn create(sh: Arc<Shared>, body: Bytes) -> Response<Body> {
    match prepare(&sh, &body).await {
        Ok(r) => r,
        Err(b) => *b,
    }
}

async fn prepare(sh: &Arc<Shared>, body: &Bytes) -> Result<Response<Body>, Bad> {
    let (v, req, prompt) = render(sh, body, agent::messages::parse)?;
    let Some(max_tokens) = req.max_output_tokens else {
        return Err(Box::new(super::invalid("Field required", "max_tokens")));
    };
    let max_len = sh.cfg.effective_max_model_len();
    let want = prompt.len() + max_tokens as usize;
    if prompt.is_empty() || prompt.len() >= max_len || want > max_len {
        return Err(anthropic_error(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {max_len} tokens. However, you requested {want} tokens ({} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
                prompt.len()
            ),
        ));
    }
    if max_tokens == 0 {
        return Err(anthropic_error(
            StatusCode::BAD_REQUEST,
            "max_tokens must be at least 1, got 0.",
        ));
    }
    let ignore_eos = v["ignore_eos"].as_bool().unwrap_or(false);
    let prompt_len = prompt.len();
    let rx = generate::submit(sh, prompt, max_tokens as usize, ignore_eos)
        .await
        .map_err(|r| anthropic_error(r.status, r.message))?;
    let mut m = Msg {
        sh: sh.clone(),
        id: format!("chatcmpl-{}", generate::uid(sh)),
        prompt_len,
        cached: 0,
        tokens: 0,
        text: String::new(),
        open: false,
    };
    if req.stream {
        return Ok(EventStream::response(m, rx, Frames::default()));
    }
    let mut rx = rx;
    while let Some(ev) = rx.recv().await {
        match ev {
            ReqEvent::Started { cached_tokens, .. } => m.cached = cached_tokens,
            ReqEvent::Token { token, .. } => {
                m.tokens += 1;
                m.text.push_str(&sh.tokenizer.tokenizer().decode(&[token]));
            }
            ReqEvent::Done { reason, .. } => {
                return Ok(json_resp(
                    StatusCode::OK,
                    &json!({
                        "id": m.id, "type": "message", "role": "assistant",
                        "content": [{"type": "text", "text": m.text}],
                        "model": sh.cfg.model, "stop_reason": stop_reason(reason),
                        "usage": m.usage(),
                    }),
                ));
            }
            ReqEvent::Pinned { .. } => {}
            ReqEvent::Crash => {
                return Err(anthropic_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "injected fault: crash after N tokens",
                ))
            }
        }
    }
    Err(anthropic_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "worker stopped before the request finished",
    ))
}

fn stop_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "max_tokens",
        _ => "end_turn",
    }
}

/// One Messages answer being streamed (vLLM's `message_stream_converter` over the chat stream).
struct Msg {
    sh: Arc<Shared>,
    id: String,
    prompt_len: usize,
    cached: usize,
    tokens: usize,
    text: String,
    /// A text block is open (index 0).
    open: bool,
}

impl Msg {
    /// Anthropic's disjoint totals: input + cache read + cache creation = the prompt.
    fn usage(&self) -> Value {
        let created = generate::cache_creation(&self.sh, self.prompt_len, self.cached);
        json!({
            "input_tokens": self.prompt_len.saturating_sub(self.cached + created),
            "output_tokens": self.tokens,
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": self.cached,
        })
    }
}

impl Translate for Msg {
    fn on_event(&mut self, ev: ReqEvent, out: &mut Frames) -> std::io::Result<bool> {
        match ev {
            ReqEvent::Started { cached_tokens, .. } => {
                self.cached = cached_tokens;
                out.event(
                    "message_start",
                    &json!({"type": "message_start", "message": {
                        "id": self.id, "type": "message", "role": "assistant", "content": [],
                        "model": self.sh.cfg.model, "stop_reason": null, "stop_sequence": null,
                        "usage": {"input_tokens": self.prompt_len, "output_tokens": 0},
                    }}),
                );
            }
            ReqEvent::Token { token, .. } => {
                self.tokens += 1;
                let piece = self.sh.tokenizer.tokenizer().decode(&[token]);
                if piece.is_empty() {
                    return Ok(false);
                }
                if !self.open {
                    self.open = true;
                    out.event(
                        "content_block_start",
                        &json!({"type": "content_block_start", "index": 0,
                                "content_block": {"type": "text", "text": ""}}),
                    );
                }
                self.text.push_str(&piece);
                out.event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": piece}}),
                );
            }
            ReqEvent::Done { reason, .. } => {
                if self.open {
                    out.event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": 0}),
                    );
                }
                out.event(
                    "message_delta",
                    &json!({"type": "message_delta",
                            "delta": {"stop_reason": stop_reason(reason), "stop_sequence": null},
                            "usage": self.usage()}),
                );
                out.event("message_stop", &json!({"type": "message_stop"}));
                return Ok(true);
            }
            ReqEvent::Pinned { .. } => {}
            ReqEvent::Crash => {
                return Err(std::io::Error::other(
                    "injected fault: crash after N tokens",
                ))
            }
        }
        Ok(false)
    }

    fn on_closed(&mut self, out: &mut Frames) {
        out.event(
            "error",
            &json!({"type": "error", "error": {"type": "internal_error",
                    "message": "worker stopped before the request finished"}}),
        );
    }
}
