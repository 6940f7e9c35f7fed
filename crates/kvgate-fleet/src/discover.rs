//! Finding out what a worker is (`kind = auto`), what it does in a prefill/decode split
//! (`role = auto`) and where its KV events are published.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use kvgate_core::WorkerId;
use kvgate_protocol::pd::Role;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::http::{host_of, HttpClient, ACCEPT_PROM};
use crate::scrape::sglang::{parse_disaggregation, parse_server_info};
use crate::sink::FleetSink;
use crate::WorkerKind;

/// One KV-event publisher (a DP rank of a worker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSource {
    /// `tcp://host:port` of the PUB socket.
    pub endpoint: String,
    /// `tcp://host:port` of the replay ROUTER socket, if the worker has one.
    pub replay_endpoint: Option<String>,
    /// Subscription prefix.
    pub topic: String,
}

/// Replaces a wildcard bind host (`*`, `0.0.0.0`, `::`) in `tcp://H:P` with the worker's host.
pub fn resolve_endpoint(endpoint: &str, worker_host: &str) -> String {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return endpoint.to_owned();
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return endpoint.to_owned();
    };
    match host {
        "*" | "0.0.0.0" | "[::]" | "::" | "" => {
            let h = if worker_host.contains(':') {
                format!("[{worker_host}]")
            } else {
                worker_host.to_owned()
            };
            format!("tcp://{h}:{port}")
        }
        _ => endpoint.to_owned(),
    }
}

#[derive(Deserialize)]
struct VllmSource {
    endpoint: Option<String>,
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    publisher: Option<String>,
    #[serde(default)]
    enable_kv_cache_events: Option<bool>,
}

/// Parses vLLM's `GET /kv_event_sources` (`{dp_rank: KVEventsConfig}`), in DP-rank order.
pub fn parse_vllm_sources(
    body: &[u8],
    worker_host: &str,
) -> Result<Vec<KvSource>, serde_json::Error> {
    let map: std::collections::BTreeMap<String, VllmSource> = serde_json::from_slice(body)?;
    let mut ranks: Vec<(u32, VllmSource)> = map
        .into_iter()
        .map(|(k, v)| (k.parse().unwrap_or(u32::MAX), v))
        .collect();
    ranks.sort_by_key(|(r, _)| *r);
    Ok(ranks
        .into_iter()
        .filter(|(_, v)| {
            v.enable_kv_cache_events != Some(false)
                && v.publisher.as_deref().is_none_or(|p| p == "zmq")
        })
        .filter_map(|(_, v)| {
            Some(KvSource {
                endpoint: resolve_endpoint(v.endpoint.as_deref()?, worker_host),
                replay_endpoint: v.replay_endpoint.map(|r| resolve_endpoint(&r, worker_host)),
                topic: v.topic.unwrap_or_default(),
            })
        })
        .collect())
}

/// Asks the worker where its KV events are (vLLM `/kv_event_sources`, SGLang `/server_info`).
/// `Ok(empty)` means the worker answered and publishes none.
pub async fn discover_kv_sources(
    client: &HttpClient,
    base: &str,
    kind: WorkerKind,
    timeout: Duration,
) -> Result<Vec<KvSource>, String> {
    let host = host_of(base).ok_or_else(|| format!("no host in {base}"))?;
    let path = match kind {
        WorkerKind::Vllm => "/kv_event_sources",
        WorkerKind::Sglang => "/server_info",
        _ => return Ok(Vec::new()),
    };
    let r = client
        .get(base, path, "application/json", timeout)
        .await
        .map_err(|e| e.to_string())?;
    if !r.status.is_success() {
        return Err(format!("{path} answered HTTP {}", r.status));
    }
    match kind {
        WorkerKind::Vllm => parse_vllm_sources(&r.body, &host).map_err(|e| e.to_string()),
        _ => {
            let info = parse_server_info(&r.body, &host).map_err(|e| e.to_string())?;
            Ok(info
                .kv_event_endpoints
                .into_iter()
                .map(|endpoint| KvSource {
                    endpoint,
                    replay_endpoint: None,
                    topic: info.kv_topic.clone(),
                })
                .collect())
        }
    }
}

/// Probes a worker's endpoints to tell its kind: `/metrics` name prefixes first, then TRT-LLM's
/// `/prometheus/metrics`, then Ollama's `/api/ps`. `None` when the worker did not answer at all
/// (try again later); `Some(Openai)` when it answered but nothing matched.
pub async fn probe_kind(client: &HttpClient, base: &str, timeout: Duration) -> Option<WorkerKind> {
    let mut answered = false;
    if let Ok(r) = client.get(base, "/metrics", ACCEPT_PROM, timeout).await {
        answered = true;
        let t = String::from_utf8_lossy(&r.body);
        if r.status.is_success() {
            for (prefix, kind) in [
                ("vllm:", WorkerKind::Vllm),
                ("sglang:", WorkerKind::Sglang),
                ("llamacpp:", WorkerKind::Llamacpp),
            ] {
                if t.contains(prefix) {
                    return Some(kind);
                }
            }
            if t.trim_start().starts_with('[') && t.contains("iter") || t.trim() == "[]" {
                return Some(WorkerKind::Trtllm);
            }
        }
    }
    if let Ok(r) = client
        .get(base, "/prometheus/metrics", ACCEPT_PROM, timeout)
        .await
    {
        answered = true;
        if r.status.is_success() && String::from_utf8_lossy(&r.body).contains("trtllm_") {
            return Some(WorkerKind::Trtllm);
        }
    }
    if let Ok(r) = client
        .get(base, "/slots", "application/json", timeout)
        .await
    {
        answered = true;
        if r.status.is_success() && String::from_utf8_lossy(&r.body).contains("n_ctx") {
            return Some(WorkerKind::Llamacpp);
        }
    }
    if let Ok(r) = client
        .get(base, "/api/ps", "application/json", timeout)
        .await
    {
        answered = true;
        if r.status.is_success() && String::from_utf8_lossy(&r.body).contains("\"models\"") {
            return Some(WorkerKind::Ollama);
        }
    }
    answered.then_some(WorkerKind::Openai)
}

/// A worker's part in a prefill/decode split, as its `/server_info` tells it (`role = auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetectedRole {
    pub role: Role,
    /// The engine announced its `disaggregation_mode` (an SGLang server): its handoff is SGLang's.
    pub announced: bool,
    /// `disaggregation_bootstrap_port`: where a prefill worker's bootstrap server listens.
    pub bootstrap_port: Option<u16>,
}

/// Asks the worker its disaggregation mode: `GET /server_info`, on 404 (or 405) the legacy
/// `/get_server_info`. Neither there: the engine announces no mode (vLLM, llama.cpp, ...), so it
/// serves whole requests. `Err` when it did not answer, or answered something else than a JSON
/// object or a 404 (try again later).
pub async fn probe_role(
    client: &HttpClient,
    base: &str,
    timeout: Duration,
) -> Result<DetectedRole, String> {
    for path in ["/server_info", "/get_server_info"] {
        let r = client
            .get(base, path, "application/json", timeout)
            .await
            .map_err(|e| format!("{path}: {e}"))?;
        if matches!(
            r.status,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED
        ) {
            continue;
        }
        if !r.status.is_success() {
            return Err(format!("{path} answered HTTP {}", r.status));
        }
        let d = parse_disaggregation(&r.body).map_err(|e| format!("{path}: {e}"))?;
        return Ok(DetectedRole {
            role: d.role(),
            announced: d.mode.is_some(),
            bootstrap_port: d.bootstrap_port,
        });
    }
    Ok(DetectedRole {
        role: Role::Both,
        announced: false,
        bootstrap_port: None,
    })
}

/// Where and how often the `role = auto` task asks.
pub(crate) struct RoleProbe {
    pub base: String,
    pub timeout: Duration,
    /// First retry delay (doubles up to 10 s).
    pub retry: Duration,
    /// Once known, the role is asked again this often (0 = never).
    pub recheck: Duration,
}

/// The `role = auto` task: probes until the worker answers and reports the role through
/// `on_role` (until then the gateway routes nothing to the worker); then asks again every
/// `recheck` and reports a changed answer (a worker restarted into another mode at the same
/// address). A failed re-check keeps the role: whether the worker is up is the health check's
/// business.
pub(crate) async fn detect_role(
    worker: WorkerId,
    name: Arc<str>,
    client: HttpClient,
    probe: RoleProbe,
    sink: Arc<dyn FleetSink>,
    cancel: CancellationToken,
) {
    let mut backoff = probe.retry.max(Duration::from_millis(50));
    let mut failures = 0u32;
    let mut known: Option<DetectedRole> = None;
    loop {
        match (probe_role(&client, &probe.base, probe.timeout).await, known) {
            (Ok(d), Some(was)) if d == was => {}
            (Ok(d), was) => {
                match was {
                    None => tracing::info!(worker = %name, role = d.role.as_str(),
                        announced = d.announced, bootstrap_port = d.bootstrap_port,
                        "detected worker role"),
                    Some(was) => tracing::warn!(worker = %name, was = was.role.as_str(),
                        role = d.role.as_str(), announced = d.announced,
                        bootstrap_port = d.bootstrap_port, "worker role changed"),
                }
                sink.on_role(worker, &d);
                known = Some(d);
            }
            (Err(e), Some(_)) => {
                tracing::debug!(worker = %name, error = %e, "worker role re-check failed");
            }
            (Err(e), None) => {
                failures += 1;
                if failures == 1 {
                    tracing::warn!(worker = %name, error = %e,
                        "worker role unknown (role = auto): not routed until its /server_info answers");
                } else {
                    tracing::debug!(worker = %name, error = %e, failures, "worker role still unknown");
                }
            }
        }
        let wait = match known {
            Some(_) if probe.recheck.is_zero() => return,
            Some(_) => probe.recheck,
            None => {
                let b = backoff;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                b
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_sources_resolve_wildcards_in_rank_order() {
        let body = br#"{"1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5558","replay_endpoint":null,"topic":"kv"},
                        "0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:6000","topic":"kv"},
                        "2":{"enable_kv_cache_events":false,"publisher":"null","endpoint":"tcp://*:5559"}}"#;
        let s = parse_vllm_sources(body, "10.1.2.3").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].endpoint, "tcp://10.1.2.3:5557");
        assert_eq!(s[0].replay_endpoint.as_deref(), Some("tcp://10.1.2.3:6000"));
        assert_eq!(s[1].endpoint, "tcp://10.1.2.3:5558");
        assert_eq!(s[1].topic, "kv");
        let fixture =
            include_bytes!("../../kvgate-protocol/tests/fixtures/vllm_kv_event_sources.json");
        let s = parse_vllm_sources(fixture, "h").unwrap();
        assert_eq!(s[1].endpoint, "tcp://10.0.0.7:41009");
    }

    #[test]
    fn wildcard_hosts_are_replaced() {
        assert_eq!(resolve_endpoint("tcp://0.0.0.0:1", "::1"), "tcp://[::1]:1");
        assert_eq!(
            resolve_endpoint("tcp://10.0.0.1:1", "h"),
            "tcp://10.0.0.1:1"
        );
        assert_eq!(resolve_endpoint("ipc:///tmp/x", "h"), "ipc:///tmp/x");
    }
}
