//! The OpenAI Responses API as vLLM 0.32 serves it (`vllm/entrypoints/openai/responses/`):
//! `POST /v1/responses` (stream or not, `background`), `GET /v1/responses/{id}` (with
//! `?stream=true&starting_after=N` to resume a background stream), `POST /v1/responses/{id}/cancel`,
//! and `DELETE /v1/responses/{id}` (OpenAI's; vLLM has no DELETE route, see docs/sim.md).
//!
//! The body becomes chat messages with kvgate-protocol's `agent::responses` (the conversion the
//! gateway routes on), so the prompt tokens, and the KV blocks, are those of the equivalent chat
//! request. Stored responses live in this worker only (`store.rs`), switched on by
//! `VLLM_ENABLE_RESPONSES_API_STORE=1` as in vLLM; an id from another worker is a 404.
//! Layout: `run.rs` (the generation → response object and event stream), `store.rs`.

mod run;
pub mod store;

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use kvgate_protocol::agent::{self, Message};
use serde_json::{json, Value};

use super::stream::{sse_response, EventStream, Frames};
use super::{error, json as json_resp, Body};
use crate::server::Shared;
use run::{Echo, Run};

type Bad = Box<Response<Body>>;

/// vLLM's `create_error_response` with an explicit type (`invalid_request_error` in this module).
fn typed_error(status: StatusCode, kind: &str, message: impl Into<String>, param: &str) -> Bad {
    Box::new(json_resp(
        status,
        &json!({"error": {"message": message.into(), "type": kind, "param": param,
                          "code": status.as_u16()}}),
    ))
}

/// vLLM's `_make_not_found_error`.
pub fn not_found(id: &str) -> Response<Body> {
    *typed_error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("Response with id '{id}' not found."),
        "response_id",
    )
}

fn bad(msg: impl Into<String>, param: &str) -> Bad {
    Box::new(error(StatusCode::BAD_REQUEST, msg, Some(param)))
}

/// `POST /v1/responses`.
pub async fn create(sh: Arc<Shared>, body: Bytes) -> Response<Body> {
    match prepare(&sh, &body).await {
        Ok(r) => r,
        Err(b) => *b,
    }
}

fn field(v: &Value, key: &str) -> Value {
    v.get(key).cloned().unwrap_or(Value::Null)
}

/// The conversation vLLM renders: the request's instructions, the stored history of
/// `previous_response_id` (its input messages without system ones, then its output texts as
/// assistant messages), then the new input (`construct_input_messages`).
fn conversation(
    sh: &Shared,
    v: &Value,
    mut current: Vec<Message>,
    prev: Option<(&str, &Value)>,
) -> Vec<Message> {
    let Some((prev_id, prev)) = prev else {
        return current;
    };
    let has_instructions = v["instructions"].as_str().is_some_and(|s| !s.is_empty());
    let rest = current.split_off(usize::from(has_instructions && !current.is_empty()));
    let mut out = current;
    if let Some(history) = sh.responses.messages(prev_id) {
        out.extend(history.into_iter().filter(|m| m.role != "system"));
    }
    for item in prev["output"].as_array().into_iter().flatten() {
        if item["type"] != "message" {
            continue; // vLLM skips reasoning (and drops function calls, vllm#43244)
        }
        for part in item["content"].as_array().into_iter().flatten() {
            let text = part["text"].as_str().unwrap_or_default();
            out.push(Message::text("assistant", text));
        }
    }
    out.extend(rest);
    out
}

async fn prepare(sh: &Arc<Shared>, body: &Bytes) -> Result<Response<Body>, Bad> {
    let cfg = &sh.cfg;
    let mut v: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}"), "body"))?;
    if !v.is_object() {
        return Err(bad("request body must be a JSON object", "body"));
    }
    match v.get("model") {
        None | Some(Value::Null) => v["model"] = Value::from(cfg.model.clone()),
        Some(Value::String(m)) if *m == cfg.model => {}
        Some(m) => {
            return Err(Box::new(error(
                StatusCode::NOT_FOUND,
                format!("The model `{}` does not exist.", m.as_str().unwrap_or("?")),
                Some("model"),
            )))
        }
    }
    let bytes = serde_json::to_vec(&v).map_err(|e| bad(e.to_string(), "body"))?;
    let req = agent::responses::parse(&bytes)
        .map_err(|e| Box::new(super::invalid(e.to_string(), e.param().unwrap_or("input"))))?;
    if let Some(msg) = &req.vllm_rejects {
        return Err(bad(msg.clone(), "input"));
    }
    let mut store = req.store.unwrap_or(true);
    if req.background && !store {
        return Err(bad(
            "background can only be used when `store` is true",
            "background",
        ));
    }
    if store && !sh.responses.enabled {
        if req.background {
            return Err(typed_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "This vLLM engine does not support `store=True` and therefore does not support \
                 the background mode. To enable these features, set the environment variable \
                 `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                "background",
            ));
        }
        store = false; // vLLM silently ignores `store` when its store is off
    }
    let prev = match &req.previous_response_id {
        Some(id) => match sh.responses.get(id) {
            Some(r) => Some((id.as_str(), r)),
            None => return Err(Box::new(not_found(id))),
        },
        None => None,
    };
    let messages = conversation(
        sh,
        &v,
        req.messages.clone(),
        prev.as_ref().map(|(i, r)| (*i, r)),
    );
    let mut rendered = req.clone();
    rendered.messages = messages.clone();
    let chat: Value = serde_json::from_str(&rendered.chat_body())
        .map_err(|e| bad(format!("rendering the conversation: {e}"), "input"))?;
    let prompt = crate::tokenizer::encode_body(&sh.tokenizer, &chat)
        .map_err(|e| bad(e.message, e.param.unwrap_or("input")))?;
    let prompt = prompt.into_iter().next().unwrap_or_default();
    let max_len = cfg.effective_max_model_len();
    if prompt.len() >= max_len {
        return Err(typed_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!(
                "The engine prompt length {} exceeds the max_model_len {max_len}. Please reduce prompt.",
                prompt.len()
            ),
            "input",
        ));
    }
    let room = max_len - prompt.len();
    let max_tokens = match req.max_output_tokens {
        Some(0) => {
            return Err(bad(
                "max_tokens must be at least 1, got 0.",
                "max_output_tokens",
            ))
        }
        Some(n) => (n as usize).min(room),
        None => room,
    };
    let ignore_eos = v["ignore_eos"].as_bool().unwrap_or(false);

    let id = match v.get("request_id").and_then(Value::as_str) {
        Some(id) => id.to_owned(),
        None => format!("resp_{}", super::generate::uid(sh)),
    };
    let has_tools = v["tools"].as_array().is_some_and(|t| !t.is_empty());
    let tool_choice = match v.get("tool_choice") {
        None | Some(Value::Null) if !has_tools => Value::from("none"),
        Some(Value::String(s)) if !has_tools && (s == "auto" || s == "none") => Value::from("none"),
        None | Some(Value::Null) => Value::from("auto"),
        Some(c) => c.clone(),
    };
    let or = |key: &str, d: Value| match v.get(key) {
        None | Some(Value::Null) => d,
        Some(x) => x.clone(),
    };
    let echo = Arc::new(Echo {
        id: id.clone(),
        created_at: super::generate::unix_now(),
        model: cfg.model.clone(),
        instructions: field(&v, "instructions"),
        metadata: field(&v, "metadata"),
        parallel_tool_calls: or("parallel_tool_calls", Value::from(true)),
        temperature: or("temperature", json!(1.0)),
        tool_choice,
        tools: or("tools", json!([])),
        top_p: or("top_p", json!(1.0)),
        background: req.background,
        max_output_tokens: max_tokens,
        max_tool_calls: field(&v, "max_tool_calls"),
        previous_response_id: field(&v, "previous_response_id"),
        reasoning: field(&v, "reasoning"),
        service_tier: or("service_tier", Value::from("auto")),
        text: field(&v, "text"),
        top_logprobs: Value::Null,
        truncation: or("truncation", Value::from("disabled")),
        user: field(&v, "user"),
        presence_penalty: or("presence_penalty", json!(0.0)),
        frequency_penalty: or("frequency_penalty", json!(0.0)),
    });

    let prompt_len = prompt.len();
    let rx = super::generate::submit(sh, prompt, max_tokens, ignore_eos)
        .await
        .map_err(|r| Box::new(error(r.status, r.message, None)))?;
    if store {
        sh.responses.put_messages(&id, messages);
    }
    let run = Run::new(sh.clone(), echo.clone(), prompt_len, store);

    if req.background {
        let queued = echo.response("queued", json!([]), Value::Null);
        sh.responses.put(&id, queued.clone());
        if req.stream {
            let log = sh.responses.add_log(&id);
            let task = tokio::spawn(run::background_stream(run, rx, log.clone()));
            sh.responses.add_task(&id, task.abort_handle());
            return Ok(sse_response(log.follow(0)));
        }
        let task = tokio::spawn(run::background_collect(run, rx));
        sh.responses.add_task(&id, task.abort_handle());
        return Ok(json_resp(StatusCode::OK, &queued));
    }
    if req.stream {
        let mut run = run;
        let mut first = Frames::default();
        run.opening(&mut first);
        return Ok(EventStream::response(run, rx, first));
    }
    collect(run, rx).await
}

async fn collect(
    mut run: Run,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<crate::worker::ReqEvent>,
) -> Result<Response<Body>, Bad> {
    while let Some(ev) = rx.recv().await {
        match run.collect(ev) {
            Ok(true) => break,
            Ok(false) => {}
            // `--crash-after` on a collected answer: an error instead of a cut connection.
            Err(e) => {
                return Err(Box::new(error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    e.to_string(),
                    None,
                )))
            }
        }
    }
    match run.done.take() {
        Some(r) => Ok(json_resp(StatusCode::OK, &r)),
        None => Err(Box::new(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "worker stopped before the request finished",
            None,
        ))),
    }
}

/// The query of `GET /v1/responses/{id}`: `stream` (FastAPI's booleans) and `starting_after`.
fn query(q: Option<&str>) -> Result<(bool, Option<u64>), Bad> {
    let mut stream = false;
    let mut after = None;
    for pair in q.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (k, val) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "stream" => {
                stream = match val.to_ascii_lowercase().as_str() {
                    "true" | "1" | "yes" | "on" | "t" | "y" => true,
                    "false" | "0" | "no" | "off" | "f" | "n" => false,
                    _ => {
                        return Err(Box::new(super::invalid(
                            "Input should be a valid boolean, unable to interpret input",
                            "stream",
                        )))
                    }
                }
            }
            "starting_after" => {
                after = Some(val.parse::<u64>().map_err(|_| {
                    Box::new(super::invalid(
                        "Input should be a valid integer, unable to parse string as an integer",
                        "starting_after",
                    ))
                })?)
            }
            _ => {}
        }
    }
    Ok((stream, after))
}

/// `GET /v1/responses/{id}`.
pub fn retrieve(sh: &Shared, id: &str, q: Option<&str>) -> Response<Body> {
    let (stream, after) = match query(q) {
        Ok(x) => x,
        Err(b) => return *b,
    };
    let Some(resp) = sh.responses.get(id) else {
        return not_found(id);
    };
    if !stream {
        return json_resp(StatusCode::OK, &resp);
    }
    match sh.responses.log(id) {
        Some(log) => {
            let from = after.map_or(0, |n| n as usize + 1);
            sse_response(log.follow(from))
        }
        // vLLM's resume generator raises "Unknown response_id" after the 200 went out, and the
        // client gets an empty event stream (checked on the real engine).
        None => sse_response(super::full("")),
    }
}

/// `POST /v1/responses/{id}/cancel`.
pub fn cancel(sh: &Shared, id: &str) -> Response<Body> {
    match sh.responses.cancel(id) {
        Ok(r) => json_resp(StatusCode::OK, &r),
        Err(None) => not_found(id),
        Err(Some(_)) => *typed_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "Cannot cancel a synchronous response.",
            "response_id",
        ),
    }
}

/// `DELETE /v1/responses/{id}` in OpenAI's shape (vLLM 0.32 has no such route).
pub fn delete(sh: &Shared, id: &str) -> Response<Body> {
    if sh.responses.delete(id) {
        json_resp(
            StatusCode::OK,
            &json!({"id": id, "object": "response", "deleted": true}),
        )
    } else {
        not_found(id)
    }
}
