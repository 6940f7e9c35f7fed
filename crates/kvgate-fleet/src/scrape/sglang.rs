//! SGLang `/metrics` (`--enable-metrics`) and `/server_info` (page size, KV-event publisher).

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
