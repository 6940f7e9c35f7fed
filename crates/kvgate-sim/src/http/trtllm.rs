//! TensorRT-LLM's context-first handoff on the HTTP side (`--pd-protocol trtllm`; docs/sim.md,
//! "PD"): a context leg (`disaggregated_params.request_type: "context_only"`) computes the prompt
//! and one token, pins its blocks as the vLLM prefill leg does, and answers with
//! `choices[0].disaggregated_params`; a generation leg (`"generation_only"`) pulls the blocks from
//! the context worker named in `ctx_info_endpoint` (the sim's HTTP listener) under
//! `ctx_request_id`, with the vLLM mode's transfer model and read notification, then decodes.
//! Real TensorRT-LLM moves the KV through its cache transceiver and `encoded_opaque_state`;
//! routers copy the params opaque, so only this sim reads `ctx_info_endpoint`.

use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::pd::{Leg, Remote};
use super::{error, Body};
use crate::config::Role;
use crate::server::Shared;

fn bad(msg: impl Into<String>) -> Box<Response<Body>> {
    Box::new(error(
        StatusCode::BAD_REQUEST,
        msg,
        Some("disaggregated_params"),
    ))
}

/// Reads `disaggregated_params` (absent or null = a plain request) against the worker's role.
pub fn parse(v: &Value, role: Role) -> Result<Leg, Box<Response<Body>>> {
    let p = match v.get("disaggregated_params") {
        None | Some(Value::Null) => return Ok(Leg::Plain),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("`disaggregated_params` must be an object")),
    };
    let leg = match p.get("request_type").and_then(Value::as_str) {
        Some("context_only") => Leg::Prefill,
        Some("generation_only") => {
            let endpoint = p.get("ctx_info_endpoint").and_then(Value::as_str);
            let addr = endpoint.and_then(|e| {
                let (h, port) = e.rsplit_once(':')?;
                Some((h.to_string(), port.parse::<u16>().ok()?))
            });
            let id = match p.get("ctx_request_id") {
                Some(Value::Number(n)) => n.as_u64().map(|n| n.to_string()),
                Some(Value::String(s)) => Some(s.clone()),
                _ => None,
            };
            match (addr, id) {
                (Some((host, port)), Some(request_id)) => Leg::Decode(Remote {
                    host,
                    port,
                    request_id,
                }),
                _ => {
                    return Err(bad(
                        "a generation_only leg needs `ctx_info_endpoint` (host:port) and `ctx_request_id`",
                    ))
                }
            }
        }
        Some("context_and_generation") | None => Leg::Plain,
        Some(other) => return Err(bad(format!("unknown request_type {other:?}"))),
    };
    match (&leg, role) {
        (Leg::Prefill, Role::Decode) => Err(bad(
            "this worker has role decode: it does not serve context_only legs",
        )),
        (Leg::Decode(_), Role::Prefill) => Err(bad(
            "this worker has role prefill: it does not serve generation_only legs",
        )),
        _ => Ok(leg),
    }
}

/// The context answer's `disaggregated_params` for engine request `id`, which produced `token`.
pub fn params(sh: &Shared, id: u64, token: Option<u32>, disagg_request_id: &Value) -> Value {
    let ip = sh.http_addr.ip();
    let host = if ip.is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        ip.to_string()
    };
    json!({
        "request_type": "context_only",
        "first_gen_tokens": token.map(|t| vec![t]).unwrap_or_default(),
        "ctx_request_id": id,
        "disagg_request_id": disagg_request_id,
        "encoded_opaque_state": null,
        "draft_tokens": null,
        "ctx_dp_rank": 0,
        "ctx_info_endpoint": format!("{host}:{}", sh.http_addr.port()),
    })
}
