//! SGLang `/metrics` (`--enable-metrics`) and `/server_info` (page size, KV-event publisher, the
//! worker's part in a prefill/decode split).

use kvgate_protocol::pd::Role;
use kvgate_protocol::prom_text::Exposition;
use serde::Deserialize;

use super::ParseError;
use crate::sink::{ScrapedLoad, SumCount};

pub fn parse(e: &Exposition<'_>) -> Result<ScrapedLoad, ParseError> {
    let any = |_: &_| true;
    let running = e
        .sum("sglang:num_running_reqs", any)
        .ok_or(ParseError::Missing("sglang:num_running_reqs"))?;
    let waiting = e
        .sum("sglang:num_queue_reqs", any)
        .ok_or(ParseError::Missing("sglang:num_queue_reqs"))?;
    let usages: Vec<f64> = e
        .samples_named("sglang:token_usage")
        .map(|s| s.value)
        .filter(|v| v.is_finite())
        .collect();
    let kv_usage = (!usages.is_empty()).then(|| usages.iter().sum::<f64>() / usages.len() as f64);
    Ok(ScrapedLoad {
        running: Some(super::count(running)),
        waiting: Some(super::count(waiting)),
        kv_usage,
        prefix_cache_queries: e.sum("sglang:prompt_tokens_total", any),
        prefix_cache_hits: e.sum("sglang:cached_tokens_total", |s| {
            s.label("cache_source") != Some("host")
        }),
        // Retractions are SGLang's preemptions (a running request sent back to the queue when the
        // KV cache runs out). `sglang:num_retracted_reqs` is the last batch's gauge: not this.
        preemptions: e.sum("sglang:num_retracted_requests_total", any),
        queue_time: SumCount::read(e, "sglang:queue_time_seconds"),
        process_start_time: e.value("process_start_time_seconds"),
        ..ScrapedLoad::default()
    })
}

/// The parts of `/server_info` a router uses.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServerInfo {
    pub page_size: Option<u32>,
    pub max_total_num_tokens: Option<u64>,
    /// ZMQ endpoints of the KV-event publisher, one per DP rank, `*` replaced by the worker host.
    pub kv_event_endpoints: Vec<String>,
    pub kv_topic: String,
}

#[derive(Deserialize)]
struct Raw {
    page_size: Option<u32>,
    max_total_num_tokens: Option<u64>,
    kv_events: Option<RawKv>,
}

#[derive(Deserialize)]
struct RawKv {
    publisher: Option<String>,
    endpoint_host: Option<String>,
    endpoint_port_base: Option<u16>,
    #[serde(default)]
    topic: Option<String>,
    block_size: Option<u32>,
    dp_size: Option<u16>,
}

pub fn parse_server_info(body: &[u8], worker_host: &str) -> Result<ServerInfo, ParseError> {
    let raw: Raw = serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    let mut info = ServerInfo {
        page_size: raw.page_size,
        max_total_num_tokens: raw.max_total_num_tokens,
        ..ServerInfo::default()
    };
    if let Some(kv) = raw.kv_events {
        if kv.publisher.as_deref().unwrap_or("zmq") == "zmq" {
            if let Some(port) = kv.endpoint_port_base {
                let host = match kv.endpoint_host.as_deref() {
                    None | Some("*" | "0.0.0.0" | "" | "::") => worker_host.to_owned(),
                    Some(h) => h.to_owned(),
                };
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host
                };
                for r in 0..kv.dp_size.unwrap_or(1).max(1) {
                    info.kv_event_endpoints
                        .push(format!("tcp://{host}:{}", port.saturating_add(r)));
                }
            }
        }
        info.kv_topic = kv.topic.unwrap_or_default();
        info.page_size = info.page_size.or(kv.block_size);
    }
    Ok(info)
}

/// What `/server_info` says about the worker's part in a prefill/decode split
/// (`--disaggregation-mode`, `--disaggregation-bootstrap-port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disaggregation {
    /// `disaggregation_mode`: `"prefill"`, `"decode"`, or `"null"` (whole requests, [`Role::Both`]).
    /// `None` when the answer has no such field (JSON null counts as absent), or a mode a router
    /// has no use for: the engine announces nothing, so it serves whole requests.
    pub mode: Option<Role>,
    /// `disaggregation_bootstrap_port`: where a prefill worker's bootstrap server listens.
    pub bootstrap_port: Option<u16>,
}

impl Disaggregation {
    /// The worker's role: the announced mode, else [`Role::Both`].
    pub fn role(&self) -> Role {
        self.mode.unwrap_or(Role::Both)
    }
}

/// Only the two fields, so that another field of an unexpected shape cannot hide them.
#[derive(Deserialize)]
struct RawDisaggregation {
    disaggregation_mode: Option<serde_json::Value>,
    disaggregation_bootstrap_port: Option<serde_json::Value>,
}

/// Reads `disaggregation_mode` and `disaggregation_bootstrap_port` from a `/server_info` (or
/// legacy `/get_server_info`) answer. An error only when the body is not a JSON object.
pub fn parse_disaggregation(body: &[u8]) -> Result<Disaggregation, ParseError> {
    let raw: RawDisaggregation =
        serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    let mode = match raw.disaggregation_mode.as_ref().and_then(|v| v.as_str()) {
        Some("null") => Some(Role::Both),
        Some("prefill") => Some(Role::Prefill),
        Some("decode") => Some(Role::Decode),
        _ => None,
    };
    let bootstrap_port = raw
        .disaggregation_bootstrap_port
        .and_then(|v| v.as_u64())
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0);
    Ok(Disaggregation {
        mode,
        bootstrap_port,
    })
}
