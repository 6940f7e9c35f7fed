//! Agent sessions as the agent clients send them: the request bodies of chat, Responses (Codex's
//! shape: `instructions`, input items, `function_call` / `function_call_output`, `session-id`
//! header and `prompt_cache_key`, `store: false` with the full input each turn, or a
//! `previous_response_id` chain with `store: true`) and Messages (Claude Code's shape: a per-request
//! `x-anthropic-billing-header` system block before the system prompt, `tool_use` / `tool_result`
//! blocks, the `x-claude-code-session-id` header). A workload request without a [`Turn`] is one
//! user message.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;

use super::{words, Api};
use crate::workload::{Request, Role, Turn};

/// The tool every synthetic tool result answers.
const TOOL: &str = "run";

fn call_id(t: &Turn, part: usize) -> String {
    format!("call_{}_{part}", t.session)
}

/// The session id the headers carry (UUID-shaped, as Claude Code and Codex send).
pub fn session_id(session: u64) -> String {
    let h = session.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        h & 0xfff,
        (h >> 20) & 0xfff,
        session & 0xffff_ffff_ffff
    )
}

/// The text of each part of `r`'s prompt (one word per token).
fn texts(r: &Request, t: &Turn) -> Vec<String> {
    let mut at = 0;
    t.parts
        .iter()
        .map(|p| {
            let s = words(&r.prompt[at..at + p.len]);
            at += p.len;
            s
        })
        .collect()
}

/// Whether part `i` (an answer) is followed by a tool result, i.e. made a tool call.
fn calls_tool(t: &Turn, i: usize) -> bool {
    t.parts
        .get(i + 1)
        .is_some_and(|p| p.role == Role::ToolResult)
}

/// Chat messages of a session turn.
pub fn chat_messages(r: &Request, t: &Turn) -> Value {
    let texts = texts(r, t);
    let mut out = Vec::new();
    for (i, (p, text)) in t.parts.iter().zip(texts).enumerate() {
        out.push(match p.role {
            Role::System => json!({"role": "system", "content": text}),
            Role::User => json!({"role": "user", "content": text}),
            Role::Assistant if calls_tool(t, i) => json!({"role": "assistant", "content": text,
                "tool_calls": [{"id": call_id(t, i + 1), "type": "function",
                                "function": {"name": TOOL, "arguments": "{}"}}]}),
            Role::Assistant => json!({"role": "assistant", "content": text}),
            Role::ToolResult => {
                json!({"role": "tool", "tool_call_id": call_id(t, i), "content": text})
            }
        });
    }
    Value::Array(out)
}

/// Responses input items of parts `from..` (the system prompt goes to `instructions`); an answer
/// is skipped when `chained` (the server has its own stored answer) but its tool call is kept.
fn response_items(r: &Request, t: &Turn, from: usize, chained: bool) -> (Option<String>, Value) {
    let texts = texts(r, t);
    let mut instructions = None;
    let mut items = Vec::new();
    for (i, (p, text)) in t.parts.iter().zip(texts).enumerate() {
        if p.role == Role::System {
            instructions = Some(text);
            continue;
        }
        if i < from {
            continue;
        }
        match p.role {
            Role::System => {}
            Role::User => items.push(json!({"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]})),
            Role::Assistant => {
                if !chained {
                    items.push(json!({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": text}]}));
                }
                if calls_tool(t, i) {
                    items.push(
                        json!({"type": "function_call", "call_id": call_id(t, i + 1),
                                      "name": TOOL, "arguments": "{}"}),
                    );
                }
            }
            Role::ToolResult => items.push(json!({"type": "function_call_output",
                "call_id": call_id(t, i), "output": text})),
        }
    }
    (instructions, Value::Array(items))
}

/// Messages `system` and `messages` of a session turn (Claude Code's billing header first).
fn anthropic(r: &Request, t: &Turn) -> (Value, Value) {
    let texts = texts(r, t);
    // Claude Code's `cch` changes on every request; vLLM drops the whole block.
    let cch = (t.session.wrapping_mul(31) ^ t.index as u64).wrapping_mul(0x2545_F491) & 0xfffff;
    let mut system = vec![json!({"type": "text", "text": format!(
        "x-anthropic-billing-header: cc_version=2.1.90.a1b; cc_entrypoint=cli; cch={cch:05x};")})];
    let mut messages: Vec<Value> = Vec::new();
    for (i, (p, text)) in t.parts.iter().zip(texts).enumerate() {
        match p.role {
            Role::System => system.push(json!({"type": "text", "text": text})),
            Role::User => messages.push(json!({"role": "user",
                "content": [{"type": "text", "text": text}]})),
            Role::Assistant => {
                let mut content = vec![json!({"type": "text", "text": text})];
                if calls_tool(t, i) {
                    content.push(json!({"type": "tool_use", "id": call_id(t, i + 1),
                                        "name": TOOL, "input": {}}));
                }
                messages.push(json!({"role": "assistant", "content": content}));
            }
            Role::ToolResult => messages.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id(t, i), "content": text}]})),
        }
    }
    (Value::Array(system), Value::Array(messages))
}

/// What one request sends: its body and its session headers.
pub struct Built {
    pub body: Vec<u8>,
    pub headers: Vec<(&'static str, String)>,
}

/// The request body for `api`; `chain`: a Responses `previous_response_id` to continue from.
pub fn build(api: Api, model: &str, r: &Request, chain: Option<&Chain>) -> Built {
    let mut headers = Vec::new();
    if let Some(n) = r.sim_cached_tokens {
        headers.push((kvgate_sim::CACHED_TOKENS_HEADER, n.to_string()));
    }
    let common = |v: &mut Value| {
        // vLLM extension: produce exactly the requested tokens, so lengths follow the workload.
        v["ignore_eos"] = json!(true);
        v["temperature"] = json!(0);
    };
    let v = match (api, &r.turn) {
        (Api::Completions, _) => {
            let mut v = json!({"model": model, "stream": true, "prompt": r.prompt,
                "stream_options": {"include_usage": true}, "max_tokens": r.max_tokens});
            common(&mut v);
            v
        }
        (Api::Text, _) => {
            let mut v = json!({"model": model, "stream": true, "prompt": words(&r.prompt),
                "stream_options": {"include_usage": true}, "max_tokens": r.max_tokens});
            common(&mut v);
            v
        }
        (Api::Chat, turn) => {
            let messages = match turn {
                Some(t) => chat_messages(r, t),
                None => json!([{"role": "user", "content": words(&r.prompt)}]),
            };
            let mut v = json!({"model": model, "stream": true, "messages": messages,
                "stream_options": {"include_usage": true}, "max_tokens": r.max_tokens});
            common(&mut v);
            v
        }
        (Api::Responses, turn) => {
            let mut v = json!({"model": model, "stream": true, "max_output_tokens": r.max_tokens});
            match turn {
                Some(t) => {
                    let sid = session_id(t.session);
                    let prev = chain.and_then(|c| c.previous.as_deref());
                    let (instructions, input) = match prev {
                        Some(_) => response_items(r, t, t.prev_parts, true),
                        None => response_items(r, t, 0, false),
                    };
                    if let Some(i) = instructions {
                        v["instructions"] = json!(i);
                    }
                    v["input"] = input;
                    v["prompt_cache_key"] = json!(sid);
                    v["store"] = json!(chain.is_some());
                    if let Some(p) = prev {
                        v["previous_response_id"] = json!(p);
                    }
                    headers.push(("session-id", sid));
                }
                None => {
                    v["input"] = json!(words(&r.prompt));
                    v["store"] = json!(false);
                }
            }
            common(&mut v);
            v
        }
        (Api::Messages, turn) => {
            let mut v = json!({"model": model, "stream": true, "max_tokens": r.max_tokens});
            match turn {
                Some(t) => {
                    let (system, messages) = anthropic(r, t);
                    v["system"] = system;
                    v["messages"] = messages;
                    headers.push(("x-claude-code-session-id", session_id(t.session)));
                }
                None => {
                    v["messages"] = json!([{"role": "user", "content": words(&r.prompt)}]);
                }
            }
            headers.push(("anthropic-version", "2023-06-01".into()));
            common(&mut v);
            v
        }
    };
    Built {
        body: serde_json::to_vec(&v).expect("JSON values always serialize"),
        headers,
    }
}

/// A Responses chain's link for one request: the previous turn's response id (`None`: the
/// previous turn gave none, send the whole history).
pub struct Chain {
    pub previous: Option<String>,
}

/// One chained session: (turns finished, the last one's response id).
type Link = watch::Sender<(usize, Option<String>)>;

/// The Responses sessions that chain with `previous_response_id`: a share of the sessions, each
/// turn waiting for its previous turn's response id.
#[derive(Default)]
pub struct ChainBook {
    sessions: Mutex<HashMap<u64, Link>>,
}

impl ChainBook {
    fn slot(&self, session: u64) -> Link {
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(session)
            .or_insert_with(|| watch::channel((0, None)).0)
            .clone()
    }

    /// Waits (at most `patience`) until turn `t.index - 1` finished; its id, if any.
    pub async fn wait(&self, t: &Turn, patience: Duration) -> Chain {
        if t.index == 0 {
            return Chain { previous: None };
        }
        let mut rx = self.slot(t.session).subscribe();
        let ready = tokio::time::timeout(patience, rx.wait_for(|(n, _)| *n >= t.index)).await;
        let previous = match ready {
            Ok(Ok(v)) => v.1.clone(),
            _ => None,
        };
        Chain { previous }
    }

    /// Turn `t` finished with response `id` (`None`: it failed).
    pub fn done(&self, t: &Turn, id: Option<String>) {
        let slot = self.slot(t.session);
        slot.send_modify(|v| {
            if t.index + 1 > v.0 {
                *v = (t.index + 1, id);
            }
        });
    }
}

/// Whether `session` is one of the `share` of sessions that chain (deterministic).
pub fn chains(session: u64, share: f64) -> bool {
    let h = session.wrapping_add(1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    ((h >> 11) as f64 / (1u64 << 53) as f64) < share
}

/// The chain book shared by the clones of a target.
pub type Chains = Arc<ChainBook>;
