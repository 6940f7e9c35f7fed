//! The small endpoints: `/v1/models`, `/health`, `/tokenize`, `/metrics`, `/kv_event_sources`,
//! `/server_info` (`--pd-protocol sglang`), `/reset_prefix_cache` and the sim-only `/sim/cache`.

use std::sync::atomic::Ordering;

use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use super::{error, full, json as json_resp, Body};
use crate::config::Role;
use crate::metrics::{render, Labels};
use crate::server::Shared;
use crate::tokenizer::encode_body;
use crate::worker::Command;

pub fn models(sh: &Shared) -> Response<Body> {
    let m = &sh.cfg.model;
    json_resp(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": m, "object": "model", "created": sh.created, "owned_by": "vllm", "root": m,
            "parent": null, "max_model_len": sh.cfg.effective_max_model_len(), "permission": []
        }]}),
    )
}

pub fn health(sh: &Shared) -> Response<Body> {
    let mut r = Response::new(full(""));
    if sh.draining.load(Ordering::Relaxed) {
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    }
    r
}

/// vLLM's `/tokenize`: `{prompt}` or `{messages}` → `{count, max_model_len, tokens, token_strs}`.
pub fn tokenize(sh: &Shared, body: &[u8]) -> Response<Body> {
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid JSON body: {e}"),
                Some("body"),
            )
        }
    };
    if v.get("prompt").is_none() && v.get("messages").is_none() {
        return error(
            StatusCode::BAD_REQUEST,
            "either `prompt` or `messages` is required",
            None,
        );
    }
    let tokens = match encode_body(&sh.tokenizer, &v) {
        Ok(mut t) if t.len() == 1 => t.remove(0),
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "`prompt` must be a single prompt",
                Some("prompt"),
            )
        }
        Err(e) => return error(StatusCode::BAD_REQUEST, e.message, e.param),
    };
    json_resp(
        StatusCode::OK,
        &json!({"count": tokens.len(), "max_model_len": sh.cfg.effective_max_model_len(),
                "tokens": tokens, "token_strs": null}),
    )
}

/// The emulated dcgm-exporter (`--dcgm`).
pub fn dcgm(sh: &Shared) -> Response<Body> {
    let snapshot = sh.metrics.lock().clone();
    let f = crate::dcgm::figures(&snapshot, &mut sh.energy.lock(), std::time::Instant::now());
    let mut r = Response::new(full(crate::dcgm::render(&f, "localhost")));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

pub async fn metrics(sh: &Shared) -> Response<Body> {
    let delay = sh.cfg.faults.metrics_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let snapshot = sh.metrics.lock().clone();
    let labels = Labels {
        model: &sh.cfg.model,
        engine: sh.cfg.dp_rank,
        block_size: sh.cfg.block_size,
        num_gpu_blocks: sh.cfg.num_gpu_blocks,
        enable_prefix_caching: sh.cfg.enable_prefix_caching,
        start_time: sh.started,
        spec_decode: sh.cfg.spec_tokens > 0,
    };
    let mut r = Response::new(full(render(&snapshot, &labels)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

/// `{dp_rank: KVEventsConfig}` with the resolved endpoints.
pub fn kv_event_sources(sh: &Shared) -> Response<Body> {
    let c = &sh.cfg;
    let entry = match &sh.kv {
        Some(eps) => json!({
            "enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": format!("tcp://{}", eps.publish),
            "replay_endpoint": format!("tcp://{}", eps.replay),
            "buffer_steps": c.kv_events_buffer_steps, "hwm": 100_000, "max_queue_size": 100_000,
            "topic": c.kv_events_topic,
        }),
        None => json!({"enable_kv_cache_events": false, "publisher": "null"}),
    };
    json_resp(StatusCode::OK, &json!({ c.dp_rank.to_string(): entry }))
}

/// SGLang's `GET /server_info` (and legacy `/get_server_info`): a few of the server args a router
/// reads. `disaggregation_mode` is the role (`null` for `both`); a prefill worker's bootstrap
/// server is its own HTTP port (`/sim/bootstrap`), so that is its `disaggregation_bootstrap_port`.
pub fn server_info(sh: &Shared) -> Response<Body> {
    let c = &sh.cfg;
    let mode = match c.pd.role {
        Role::Both => "null",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    let bootstrap_port = match c.pd.role {
        Role::Prefill => sh.http_addr.port(),
        _ => c.pd.bootstrap_port.unwrap_or(8998),
    };
    json_resp(
        StatusCode::OK,
        &json!({
            "model_path": c.model, "served_model_name": c.model, "tokenizer_path": c.model,
            "host": sh.http_addr.ip().to_string(), "port": sh.http_addr.port(),
            "page_size": c.block_size,
            "max_total_num_tokens": c.usable_blocks() * c.block_size,
            "max_running_requests": c.max_num_seqs,
            "chunked_prefill_size": c.max_num_batched_tokens,
            "context_length": c.effective_max_model_len(),
            "tp_size": 1, "dp_size": 1,
            "disaggregation_mode": mode,
            "disaggregation_bootstrap_port": bootstrap_port,
            "disaggregation_transfer_backend": "fake",
            "version": concat!("kvgate-sim ", env!("CARGO_PKG_VERSION")),
        }),
    )
}

pub async fn reset_prefix_cache(sh: &Shared) -> Response<Body> {
    let (tx, rx) = oneshot::channel();
    if sh.cmd.send(Command::ResetPrefixCache(tx)).is_err() || rx.await.is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "worker is shutting down",
            None,
        );
    }
    Response::new(full(""))
}

/// Sim-only: the engine's cached blocks (wire hash, parent, token ids) for exact comparisons.
pub async fn cache(sh: &Shared) -> Response<Body> {
    let (tx, rx) = oneshot::channel();
    if sh.cmd.send(Command::Snapshot(tx)).is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "worker is shutting down",
            None,
        );
    }
    match rx.await {
        Ok(blocks) => json_resp(
            StatusCode::OK,
            &json!({"block_size": sh.cfg.block_size, "num_gpu_blocks": sh.cfg.num_gpu_blocks, "blocks": blocks}),
        ),
        Err(_) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "worker is shutting down",
            None,
        ),
    }
}
