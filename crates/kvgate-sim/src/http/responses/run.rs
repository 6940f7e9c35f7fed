//! One Responses generation turned into vLLM 0.32's answer: the response object
//! (`ResponsesResponse.from_request`), its output message and usage, and the stream of events of
//! `responses_stream_generator` for a model without reasoning or tool parser:
//!
//! ```text
//! response.created (0) · response.in_progress (1)
//! response.output_item.added · response.content_part.added      (with the first non-empty delta)
//! response.output_text.delta …
//! response.output_text.done · response.content_part.done · response.output_item.done
//! response.completed     (always this type; `response.status` says completed / incomplete)
//! ```
//! every one `event: <type>\ndata: <json>\n\n` with an increasing `sequence_number`.

use std::sync::Arc;

use serde_json::{json, Value};

use super::store::EventLog;
use crate::engine::FinishReason;
use crate::http::generate;
use crate::http::stream::{Frames, Translate};
use crate::server::Shared;
use crate::worker::ReqEvent;

/// The request fields the response object echoes (vLLM's `from_request`).
pub struct Echo {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub instructions: Value,
    pub metadata: Value,
    pub parallel_tool_calls: Value,
    pub temperature: Value,
    pub tool_choice: Value,
    pub tools: Value,
    pub top_p: Value,
    pub background: bool,
    /// The sampling `max_tokens` (the request's `max_output_tokens` or what the context leaves).
    pub max_output_tokens: usize,
    pub max_tool_calls: Value,
    pub previous_response_id: Value,
    pub reasoning: Value,
    pub service_tier: Value,
    pub text: Value,
    pub top_logprobs: Value,
    pub truncation: Value,
    pub user: Value,
    pub presence_penalty: Value,
    pub frequency_penalty: Value,
}

impl Echo {
    /// The response object with `status`, `output` and `usage`.
    pub fn response(&self, status: &str, output: Value, usage: Value) -> Value {
        let incomplete = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        json!({
            "id": self.id, "created_at": self.created_at, "incomplete_details": incomplete,
            "instructions": self.instructions, "metadata": self.metadata, "model": self.model,
            "object": "response", "output": output,
            "parallel_tool_calls": self.parallel_tool_calls, "temperature": self.temperature,
            "tool_choice": self.tool_choice, "tools": self.tools, "top_p": self.top_p,
            "background": self.background, "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "previous_response_id": self.previous_response_id, "prompt": null,
            "reasoning": self.reasoning, "service_tier": self.service_tier, "status": status,
            "text": self.text, "top_logprobs": self.top_logprobs, "truncation": self.truncation,
            "usage": usage, "user": self.user, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "kv_transfer_params": null,
            "ec_transfer_params": null, "input_messages": null, "output_messages": null,
        })
    }
}

/// vLLM's `ResponseUsage` for one turn (no tools run by the server, no reasoning parser). The
/// `*_per_turn` arrays are empty: vLLM 0.32 fills them only for its multi-turn contexts (checked
/// on the real engine).
pub fn usage(prompt: usize, cached: usize, created: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached, "cache_write_tokens": created,
            "input_tokens_per_turn": [], "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0,
            "output_tokens_per_turn": [], "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    })
}

fn output_text(text: &str) -> Value {
    json!({"annotations": [], "text": text, "type": "output_text", "logprobs": null})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if text.is_empty() || status == "in_progress" {
        json!([])
    } else {
        json!([output_text(text)])
    };
    json!({"id": id, "content": content, "role": "assistant", "status": status,
           "type": "message", "phase": null})
}

/// The state of one generation, shared by the streamed, collected and background answers.
pub struct Run {
    sh: Arc<Shared>,
    echo: Arc<Echo>,
    prompt_len: usize,
    /// Store the final response (`store` after vLLM's downgrade).
    store: bool,
    cached: usize,
    tokens: usize,
    text: String,
    /// The open output message's id (after the first non-empty delta).
    item: Option<String>,
    seq: u64,
    /// The finished response object.
    pub done: Option<Value>,
}

impl Run {
    pub fn new(sh: Arc<Shared>, echo: Arc<Echo>, prompt_len: usize, store: bool) -> Self {
        Run {
            sh,
            echo,
            prompt_len,
            store,
            cached: 0,
            tokens: 0,
            text: String::new(),
            item: None,
            seq: 0,
            done: None,
        }
    }

    fn event(&mut self, out: &mut Frames, kind: &str, mut data: Value) {
        data["type"] = Value::from(kind);
        data["sequence_number"] = Value::from(self.seq);
        self.seq += 1;
        out.event(kind, &data);
    }

    /// `response.created` and `response.in_progress`, sent before the engine produces anything.
    pub fn opening(&mut self, out: &mut Frames) {
        let initial = self.echo.response("in_progress", json!([]), Value::Null);
        self.event(out, "response.created", json!({ "response": initial }));
        self.event(out, "response.in_progress", json!({ "response": initial }));
    }

    fn delta(&mut self, token: u32, out: Option<&mut Frames>) {
        self.tokens += 1;
        let piece = self.sh.tokenizer.tokenizer().decode(&[token]);
        if piece.is_empty() {
            return; // vLLM emits nothing for an empty delta
        }
        self.text.push_str(&piece);
        let Some(out) = out else {
            if self.item.is_none() {
                self.item = Some(format!("msg_{}", generate::uid(&self.sh)));
            }
            return;
        };
        if self.item.is_none() {
            let id = format!("msg_{}", generate::uid(&self.sh));
            self.event(
                out,
                "response.output_item.added",
                json!({"item": message_item(&id, "", "in_progress"), "output_index": 0}),
            );
            self.event(
                out,
                "response.content_part.added",
                json!({"content_index": 0, "item_id": id, "output_index": 0,
                       "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}}),
            );
            self.item = Some(id);
        }
        let id = self.item.clone().unwrap_or_default();
        self.event(
            out,
            "response.output_text.delta",
            json!({"content_index": 0, "delta": piece, "item_id": id, "logprobs": [],
                   "output_index": 0}),
        );
    }

    /// The output items of the finished answer.
    fn output(&self) -> Value {
        match &self.item {
            Some(id) => json!([message_item(id, &self.text, "completed")]),
            // vLLM's non-parser path answers one empty message; the streamed path has no item.
            None => Value::Array(Vec::new()),
        }
    }

    fn finish(&mut self, reason: FinishReason, out: Option<&mut Frames>) {
        let status = match reason {
            FinishReason::Length => "incomplete",
            _ => "completed",
        };
        let created = generate::cache_creation(&self.sh, self.prompt_len, self.cached);
        let usage = usage(self.prompt_len, self.cached, created, self.tokens);
        let output = if out.is_none() && self.item.is_none() {
            // Collected answer without text: vLLM still lists a message with no content.
            json!([message_item(
                &format!("msg_{}", generate::uid(&self.sh)),
                "",
                "completed"
            )])
        } else {
            self.output()
        };
        let response = self.echo.response(status, output, usage);
        if let Some(out) = out {
            if let Some(id) = self.item.clone() {
                let text = self.text.clone();
                self.event(
                    out,
                    "response.output_text.done",
                    json!({"content_index": 0, "item_id": id, "logprobs": [], "output_index": 0,
                           "text": text}),
                );
                self.event(
                    out,
                    "response.content_part.done",
                    json!({"content_index": 0, "item_id": id, "output_index": 0,
                           "part": output_text(&text)}),
                );
                self.event(
                    out,
                    "response.output_item.done",
                    json!({"item": message_item(&id, &text, "completed"), "output_index": 0}),
                );
            }
            self.event(
                out,
                "response.completed",
                json!({ "response": response.clone() }),
            );
        }
        if self.store {
            self.sh.responses.finish(&self.echo.id, response.clone());
        }
        self.done = Some(response);
    }

    /// Feeds one engine event to a collected (non-streamed) answer; `Ok(true)` once finished.
    pub fn collect(&mut self, ev: ReqEvent) -> std::io::Result<bool> {
        match ev {
            ReqEvent::Started { cached_tokens, .. } => self.cached = cached_tokens,
            ReqEvent::Token { token, .. } => self.delta(token, None),
            ReqEvent::Done { reason, .. } => {
                self.finish(reason, None);
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
}

impl Translate for Run {
    fn on_event(&mut self, ev: ReqEvent, out: &mut Frames) -> std::io::Result<bool> {
        match ev {
            ReqEvent::Started { cached_tokens, .. } => self.cached = cached_tokens,
            ReqEvent::Token { token, .. } => self.delta(token, Some(out)),
            ReqEvent::Done { reason, .. } => {
                self.finish(reason, Some(out));
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
        // vLLM's streamed generation error: an `error` event (status 200 already sent).
        self.event(
            out,
            "error",
            json!({"code": "server_error", "message": "worker stopped before the request finished",
                   "param": null}),
        );
    }
}

/// Drives a background streamed run into its event log (resumable with GET `?stream=true`).
pub async fn background_stream(
    mut run: Run,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<ReqEvent>,
    log: Arc<EventLog>,
) {
    let mut frames = Frames::default();
    run.opening(&mut frames);
    while let Some(f) = frames.pop() {
        log.push(f);
    }
    let mut finished = false;
    while let Some(ev) = rx.recv().await {
        let r = run.on_event(ev, &mut frames);
        while let Some(f) = frames.pop() {
            log.push(f);
        }
        match r {
            Ok(true) => {
                finished = true;
                break;
            }
            Ok(false) => {}
            Err(_) => break,
        }
    }
    if !finished {
        run.on_closed(&mut frames);
        while let Some(f) = frames.pop() {
            log.push(f);
        }
        run.sh.responses.fail(&run.echo.id);
    }
    log.close();
}

/// Drives a background collected run; the stored response becomes the finished one.
pub async fn background_collect(
    mut run: Run,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<ReqEvent>,
) {
    while let Some(ev) = rx.recv().await {
        match run.collect(ev) {
            Ok(true) => return,
            Ok(false) => {}
            Err(_) => break,
        }
    }
    run.sh.responses.fail(&run.echo.id);
}
