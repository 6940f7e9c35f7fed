//! `/v1/chat/completions` and `/v1/completions`: parse the OpenAI request (unknown fields ignored),
//! tokenize, check it fits, apply faults, submit one engine request per choice, then stream (SSE,
//! `sse.rs`) or collect the answer.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::bootstrap::{self, BootLeg};
use super::pd::{self, Leg};
use super::{error, json as json_resp, sse::SseBody, Body};
use crate::config::PdProtocol;
use crate::engine::{FinishReason, KvTransfer, NewRequest};
use crate::server::Shared;
use crate::tokenizer::encode_body;
use crate::worker::{Command, ReqEvent};

/// What both the streaming and the collected answer need to know.
pub struct Meta {
    pub chat: bool,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Prompt length per prompt.
    pub prompt_lens: Vec<usize>,
    pub n: usize,
    pub include_usage: bool,
    pub tokenizer: Arc<dyn kvgate_tokenize::Tokenizer>,
}

impl Meta {
    pub fn choices(&self) -> usize {
        self.prompt_lens.len() * self.n
    }

    pub fn usage(&self, completion: usize, cached: usize) -> Value {
        let prompt: usize = self.prompt_lens.iter().sum();
        json!({
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }
}

type Bad = Box<Response<Body>>;

fn bad(msg: impl Into<String>, param: &str) -> Bad {
    Box::new(error(StatusCode::BAD_REQUEST, msg, Some(param)))
}

fn opt_u64(v: &Value, key: &str) -> Result<Option<u64>, Bad> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(format!("`{key}` must be a non-negative integer"), key)),
    }
}

pub async fn handle(
    sh: Arc<Shared>,
    body: Bytes,
    chat: bool,
    assumed_cached_tokens: usize,
) -> Result<Response<Body>, std::io::Error> {
    match prepare(&sh, &body, chat, assumed_cached_tokens).await {
        Ok(r) => r,
        Err(resp) => Ok(*resp),
    }
}

async fn prepare(
    sh: &Arc<Shared>,
    body: &Bytes,
    chat: bool,
    assumed_cached_tokens: usize,
) -> Result<Result<Response<Body>, std::io::Error>, Bad> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}"), "body"))?;
    if !v.is_object() {
        return Err(bad("request body must be a JSON object", "body"));
    }
    let cfg = &sh.cfg;
    match v.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if *m == cfg.model => {}
        Some(m) => {
            return Err(Box::new(error(
                StatusCode::NOT_FOUND,
                format!("The model `{}` does not exist.", m.as_str().unwrap_or("?")),
                Some("model"),
            )))
        }
    }
    let prompts = encode_body(&sh.tokenizer, &v).map_err(|e| {
        let param = e.param.unwrap_or(if chat { "messages" } else { "prompt" });
        if e.schema {
            Box::new(crate::http::invalid(e.message, param))
        } else {
            bad(e.message, param)
        }
    })?;
    let n = opt_u64(&v, "n")?.unwrap_or(1);
    if !(1..=128).contains(&n) {
        return Err(bad("`n` must be between 1 and 128", "n"));
    }
    let stream = v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
    let include_usage = stream
        && v.get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(|b| b.as_bool())
            .unwrap_or(false);
    let ignore_eos = v
        .get("ignore_eos")
        .and_then(|b| b.as_bool())
        .unwrap_or(false);
    // vLLM: `priority` (an integer, lower first) needs `--scheduling-policy priority`.
    let priority = match v.get("priority") {
        None | Some(Value::Null) => 0,
        Some(x) => x
            .as_i64()
            .ok_or_else(|| bad("`priority` must be an integer", "priority"))?,
    };
    if priority != 0 && cfg.scheduling_policy != crate::config::SchedulingPolicy::Priority {
        return Err(bad(
            format!("Got priority {priority} but Priority scheduling is not enabled."),
            "priority",
        ));
    }
    let max_len = cfg.effective_max_model_len();
    let requested = match (
        opt_u64(&v, "max_completion_tokens")?,
        opt_u64(&v, "max_tokens")?,
    ) {
        (Some(x), _) | (None, Some(x)) => Some(x as usize),
        (None, None) => (!chat).then_some(16),
    };
    if requested == Some(0) {
        return Err(bad("max_tokens must be at least 1, got 0.", "max_tokens"));
    }
    for p in &prompts {
        if p.is_empty() {
            return Err(bad(
                "the prompt is empty after tokenization",
                if chat { "messages" } else { "prompt" },
            ));
        }
        let want = p.len() + requested.unwrap_or(1);
        if p.len() >= max_len || want > max_len {
            return Err(bad(
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you requested {want} tokens ({} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
                    p.len(),
                    want - p.len()
                ),
                if chat { "messages" } else { "prompt" },
            ));
        }
    }

    let (leg, boot) = match cfg.pd.protocol {
        PdProtocol::Vllm => (pd::parse(&v, cfg.pd.role)?, None),
        PdProtocol::Sglang => (
            Leg::Plain,
            bootstrap::parse(&v, cfg.pd.role, cfg.pd.bootstrap_port)?,
        ),
        PdProtocol::Trtllm => (super::trtllm::parse(&v, cfg.pd.role)?, None),
    };
    let trtllm = cfg.pd.protocol == PdProtocol::Trtllm;
    // TensorRT-LLM echoes the router's id in the context answer.
    let disagg_id = if trtllm && leg == Leg::Prefill {
        v["disaggregated_params"]["disagg_request_id"].clone()
    } else {
        Value::Null
    };
    if (leg != Leg::Plain || boot.is_some()) && prompts.len() * n as usize != 1 {
        let param = if boot.is_some() {
            "bootstrap_room"
        } else if cfg.pd.protocol == PdProtocol::Trtllm {
            "disaggregated_params"
        } else {
            "kv_transfer_params"
        };
        return Err(bad(
            format!("`{param}` serves exactly one choice (one prompt, n = 1)"),
            param,
        ));
    }
    let boot_prefill = matches!(boot, Some(BootLeg::Prefill { .. }));
    if (leg == Leg::Prefill || boot_prefill) && cfg.pd.prefill_fail_rate > 0.0 {
        let fail = sh.rng.lock().f64() < cfg.pd.prefill_fail_rate;
        if fail {
            sh.metrics.lock().finished(None);
            return Err(Box::new(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "injected fault: prefill failed",
                None,
            )));
        }
    }

    let f = &cfg.faults;
    if f.fail_rate > 0.0 {
        let (fail, unavailable) = {
            let mut rng = sh.rng.lock();
            (rng.f64() < f.fail_rate, rng.bool())
        };
        if fail {
            let (code, msg) = if unavailable {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "injected fault: worker unavailable",
                )
            } else {
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "injected fault: internal error",
                )
            };
            sh.metrics.lock().finished(None);
            if let Leg::Decode(remote) = &leg {
                pd::abandon(remote);
            }
            return Err(Box::new(error(code, msg, None)));
        }
    }
    if !f.stall.is_zero() {
        tokio::time::sleep(f.stall).await;
    }

    // SGLang prefill leg: held until the prompt is computed (then the decode leg takes the KV).
    let mut seat = None;
    let kv = match (&leg, &boot) {
        (_, Some(BootLeg::Prefill { room })) => {
            seat = Some(bootstrap::prefill_arrives(sh, *room).await?);
            KvTransfer::None
        }
        (_, Some(BootLeg::Decode { host, port, room })) => {
            bootstrap::decode_joins(sh, host, *port, *room, &prompts[0]).await?
        }
        (Leg::Plain, None) => KvTransfer::None,
        (Leg::Prefill, None) => {
            let no_params =
                cfg.pd.no_params_rate > 0.0 && sh.rng.lock().f64() < cfg.pd.no_params_rate;
            if no_params {
                KvTransfer::None
            } else {
                KvTransfer::RemoteDecode
            }
        }
        (Leg::Decode(remote), None) => pd::pull(sh, remote.clone(), &prompts[0]).await?,
    };

    let (tx, rx) = mpsc::unbounded_channel();
    let first_id = sh.next_id();
    let prompt_lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    for (p, prompt) in prompts.into_iter().enumerate() {
        for j in 0..n as usize {
            let id = if p == 0 && j == 0 {
                first_id
            } else {
                sh.next_id()
            };
            // SGLang's prefill leg and TensorRT-LLM's context leg compute the prompt and sample one
            // token.
            let max_tokens = if seat.is_some() || (trtllm && leg == Leg::Prefill) {
                1
            } else {
                requested.unwrap_or(max_len - prompt.len())
            };
            let req = NewRequest {
                id,
                prompt: prompt.clone(),
                max_tokens,
                ignore_eos,
                kv,
                priority,
                assumed_cached_tokens,
            };
            let idx = (p * n as usize + j) as u32;
            if sh
                .cmd
                .send(Command::Submit {
                    req,
                    idx,
                    tx: tx.clone(),
                    sent: tokio::time::Instant::now(),
                })
                .is_err()
            {
                return Err(Box::new(error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "worker is shutting down",
                    None,
                )));
            }
        }
    }
    drop(tx);
    let meta = Meta {
        chat,
        id: format!(
            "{}-{:016x}{:08x}",
            if chat { "chatcmpl" } else { "cmpl" },
            sh.created,
            first_id
        ),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: cfg.model.clone(),
        prompt_lens,
        n: n as usize,
        include_usage,
        tokenizer: sh.tokenizer.tokenizer().clone(),
    };
    if let Some(seat) = seat {
        // The prefill leg answers once the prompt is computed and handed over; one JSON answer
        // whatever `stream` says (the router drains it).
        let prompt_len = meta.prompt_lens[0];
        let resp = collect(meta, rx, None).await;
        if matches!(&resp, Ok(r) if r.status().is_success()) {
            seat.prefilled(prompt_len)?;
        }
        return Ok(resp);
    }
    if stream {
        return Ok(Ok(SseBody::response(meta, rx)));
    }
    let reply = (leg != Leg::Plain).then_some((sh.as_ref(), disagg_id));
    Ok(collect(meta, rx, reply).await)
}

/// `pd_reply`: the request carried `kv_transfer_params`, so the answer carries them too (a prefill
/// leg's params naming this worker's pinned blocks, else null), as vLLM's does.
async fn collect(
    meta: Meta,
    mut rx: mpsc::UnboundedReceiver<ReqEvent>,
    pd_reply: Option<(&crate::server::Shared, Value)>,
) -> Result<Response<Body>, std::io::Error> {
    let k = meta.choices();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); k];
    let mut reasons: Vec<Option<FinishReason>> = vec![None; k];
    let mut cached = vec![0usize; k];
    let mut pinned: Option<(u64, Vec<usize>)> = None;
    let mut done = 0;
    while done < k {
        match rx.recv().await {
            Some(ReqEvent::Started { idx, cached_tokens }) => cached[idx as usize] = cached_tokens,
            Some(ReqEvent::Token { idx, token }) => tokens[idx as usize].push(token),
            Some(ReqEvent::Done { idx, reason }) => {
                reasons[idx as usize] = Some(reason);
                done += 1;
            }
            Some(ReqEvent::Pinned { id, blocks, .. }) => pinned = Some((id, blocks)),
            Some(ReqEvent::Crash) => {
                return Err(std::io::Error::other(
                    "injected fault: crash after N tokens",
                ));
            }
            None => {
                return Ok(error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "worker stopped before the request finished",
                    None,
                ));
            }
        }
    }
    let completion: usize = tokens.iter().map(Vec::len).sum();
    let cached_total: usize = cached.iter().step_by(meta.n).sum();
    let choices: Vec<Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let text: String = t.iter().map(|x| meta.tokenizer.decode(&[*x])).collect();
            let reason = reasons[i].map(FinishReason::as_str);
            if meta.chat {
                json!({"index": i, "message": {"role": "assistant", "content": text, "tool_calls": []},
                       "logprobs": null, "finish_reason": reason, "stop_reason": null})
            } else {
                json!({"index": i, "text": text, "logprobs": null, "finish_reason": reason, "stop_reason": null})
            }
        })
        .collect();
    let mut body = json!({
        "id": meta.id,
        "object": if meta.chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": meta.usage(completion, cached_total),
    });
    match pd_reply {
        Some((sh, disagg_id)) if sh.cfg.pd.protocol == PdProtocol::Trtllm => {
            body["choices"][0]["disaggregated_params"] = match &pinned {
                Some((id, _)) => super::trtllm::params(
                    sh,
                    *id,
                    tokens.first().and_then(|t| t.first()).copied(),
                    &disagg_id,
                ),
                None => Value::Null,
            };
        }
        Some((sh, _)) => {
            body["kv_transfer_params"] = match &pinned {
                Some((id, blocks)) => pd::params(sh, *id, blocks, meta.prompt_lens[0]),
                None => Value::Null,
            };
        }
        None => {}
    }
    Ok(json_resp(StatusCode::OK, &body))
}
