//! Load scraping: one pure parser per worker kind (`scrape/<kind>.rs`) and the periodic task that
//! fetches, parses, reports, and marks the worker stale when no scrape succeeded within the bound.
//!
//! A stalled or broken `/metrics` costs at most `scrape_timeout` per tick and never blocks anything
//! else: after `stale_after` without success the sink hears `on_load_stale` once (fail open: the cost
//! model then ignores scraped load for that worker) and a warning is logged once.

pub mod llamacpp;
pub mod ollama;
pub mod sglang;
#[cfg(test)]
mod tests;
pub mod trtllm;
pub mod vllm;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use kvgate_core::WorkerId;
use kvgate_protocol::prom_text;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::http::{HttpClient, HttpError, ACCEPT_PROM};
use crate::sink::{FleetSink, ScrapedLoad};
use crate::stats::{inc, FleetStats};
use crate::WorkerKind;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParseError {
    #[error("metric {0} is missing (is the metrics endpoint enabled?)")]
    Missing(&'static str),
    #[error("invalid JSON: {0}")]
    Json(String),
}

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("{path} answered HTTP {status}")]
    Status {
        path: &'static str,
        status: StatusCode,
    },
    #[error("{path}: {err}")]
    Parse { path: &'static str, err: ParseError },
    #[error("response is not UTF-8")]
    Utf8,
    #[error("kind {0} has no load endpoint")]
    NoEndpoint(WorkerKind),
}

/// A gauge value as a request count (negative or NaN → 0).
pub(crate) fn count(v: f64) -> u32 {
    if v.is_finite() && v > 0.0 {
        v.round().min(u32::MAX as f64) as u32
    } else {
        0
    }
}

/// Fetches and parses one worker's load. Keeps what it learned about the endpoints across calls.
pub struct Scraper {
    client: HttpClient,
    base: String,
    kind: WorkerKind,
    timeout: Duration,
    /// TRT-LLM: `/prometheus/metrics` was 404, use the JSON `/metrics` instead.
    trtllm_json: bool,
    /// SGLang page size from `/server_info` (fetched until known).
    sglang_page: Option<(u32, Option<u64>)>,
    /// TRT-LLM JSON stats: running totals of the drained iterations.
    trtllm_totals: trtllm::Totals,
}

impl Scraper {
    pub fn new(
        client: HttpClient,
        base: impl Into<String>,
        kind: WorkerKind,
        timeout: Duration,
    ) -> Self {
        Scraper {
            client,
            base: base.into(),
            kind,
            timeout,
            trtllm_json: false,
            sglang_page: None,
            trtllm_totals: trtllm::Totals::default(),
        }
    }

    async fn fetch(&self, path: &'static str, accept: &str) -> Result<bytes::Bytes, ScrapeError> {
        let r = self
            .client
            .get(&self.base, path, accept, self.timeout)
            .await?;
        if !r.status.is_success() {
            return Err(ScrapeError::Status {
                path,
                status: r.status,
            });
        }
        Ok(r.body)
    }

    async fn fetch_prom(&self, path: &'static str) -> Result<String, ScrapeError> {
        let body = self.fetch(path, ACCEPT_PROM).await?;
        String::from_utf8(body.into()).map_err(|_| ScrapeError::Utf8)
    }

    /// One scrape.
    pub async fn scrape(&mut self) -> Result<ScrapedLoad, ScrapeError> {
        let p = |path, err| ScrapeError::Parse { path, err };
        let load = match self.kind {
            WorkerKind::Vllm => {
                let t = self.fetch_prom("/metrics").await?;
                vllm::parse(&prom_text::parse(&t)).map_err(|e| p("/metrics", e))?
            }
            WorkerKind::Sglang => {
                let t = self.fetch_prom("/metrics").await?;
                let mut l = sglang::parse(&prom_text::parse(&t)).map_err(|e| p("/metrics", e))?;
                if self.sglang_page.is_none() {
                    let host = crate::http::host_of(&self.base).unwrap_or_default();
                    if let Ok(b) = self.fetch("/server_info", "application/json").await {
                        if let Ok(info) = sglang::parse_server_info(&b, &host) {
                            self.sglang_page =
                                info.page_size.map(|ps| (ps, info.max_total_num_tokens));
                        }
                    }
                }
                if let Some((ps, max_tokens)) = self.sglang_page {
                    l.block_size = Some(ps);
                    l.num_gpu_blocks = max_tokens.map(|t| t / ps.max(1) as u64);
                }
                l
            }
            WorkerKind::Trtllm => {
                if !self.trtllm_json {
                    match self.fetch_prom("/prometheus/metrics").await {
                        Ok(t) => {
                            return Ok(stamp(
                                trtllm::parse_prom(&prom_text::parse(&t))
                                    .map_err(|e| p("/prometheus/metrics", e))?,
                            ))
                        }
                        Err(ScrapeError::Status {
                            status: StatusCode::NOT_FOUND,
                            ..
                        }) => {
                            self.trtllm_json = true;
                        }
                        Err(e) => return Err(e),
                    }
                }
                let b = self.fetch("/metrics", "application/json").await?;
                let mut l = trtllm::parse_json(&b).map_err(|e| p("/metrics", e))?;
                self.trtllm_totals.accumulate(&mut l);
                l
            }
            WorkerKind::Llamacpp => {
                let slots = match self.fetch("/slots", "application/json").await {
                    Ok(b) => Some(llamacpp::parse_slots(&b).map_err(|e| p("/slots", e))?),
                    Err(ScrapeError::Status { .. }) => None, // --no-slots
                    Err(e) => return Err(e),
                };
                let mut l = match self.fetch_prom("/metrics").await {
                    Ok(t) => llamacpp::parse_metrics(&prom_text::parse(&t))
                        .map_err(|e| p("/metrics", e))?,
                    // Without --metrics, the busy slots are the running requests.
                    Err(ScrapeError::Status { .. }) if slots.is_some() => ScrapedLoad {
                        running: slots.map(|s| s.busy),
                        waiting: Some(0),
                        ..ScrapedLoad::default()
                    },
                    Err(e) => return Err(e),
                };
                if let Some(sl) = slots {
                    l.slots_total = Some(sl.total);
                    l.slots_busy = Some(sl.busy);
                    l.kv_capacity_tokens = (sl.ctx_tokens > 0).then_some(sl.ctx_tokens);
                }
                l
            }
            WorkerKind::Ollama => {
                let b = self.fetch("/api/ps", "application/json").await?;
                ollama::parse_ps(&b).map_err(|e| p("/api/ps", e))?
            }
            k @ (WorkerKind::Openai | WorkerKind::Auto) => return Err(ScrapeError::NoEndpoint(k)),
        };
        Ok(stamp(load))
    }
}

fn stamp(mut l: ScrapedLoad) -> ScrapedLoad {
    l.scraped_at = Some(std::time::Instant::now());
    if l.kv_capacity_tokens.is_none() {
        if let (Some(n), Some(bs)) = (l.num_gpu_blocks, l.block_size) {
            l.kv_capacity_tokens = Some(n.saturating_mul(u64::from(bs)));
        }
    }
    l
}

/// Settings of the scrape task.
#[derive(Debug, Clone)]
pub struct ScrapeSettings {
    pub interval: Duration,
    /// ± this fraction of `interval` at random, so a fleet's scrapes do not align.
    pub jitter: f64,
    pub timeout: Duration,
    pub stale_after: Duration,
    /// The pool's block size; a different engine value triggers `on_block_size`.
    pub block_size: Option<u32>,
}

pub(crate) fn jittered(interval: Duration, jitter: f64) -> Duration {
    let j = jitter.clamp(0.0, 0.9);
    interval.mul_f64(1.0 + j * (2.0 * fastrand::f64() - 1.0))
}

/// The periodic scrape loop; returns when `cancel` fires.
pub(crate) async fn run(
    mut scraper: Scraper,
    worker: WorkerId,
    name: Arc<str>,
    s: ScrapeSettings,
    sink: Arc<dyn FleetSink>,
    stats: Arc<FleetStats>,
    cancel: CancellationToken,
) {
    let mut last_ok = Instant::now();
    let mut stale = false;
    let mut reported_bs: Option<u32> = None;
    loop {
        let attempt = tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(s.timeout, scraper.scrape()) => r,
        };
        let result = attempt.unwrap_or(Err(ScrapeError::Http(HttpError::Timeout(s.timeout))));
        match result {
            Ok(load) => {
                inc(&stats.scrapes_ok);
                last_ok = Instant::now();
                if stale {
                    tracing::info!(worker = %name, "worker metrics fresh again");
                }
                stale = false;
                if let (Some(engine), Some(cfg)) = (load.block_size, s.block_size) {
                    if engine != cfg && reported_bs != Some(engine) {
                        tracing::error!(worker = %name, engine_block_size = engine, configured = cfg,
                            "block size mismatch: worker excluded from KV scoring (still load-balanced)");
                        sink.on_block_size(worker, engine, cfg);
                    } else if engine == cfg && reported_bs.is_some_and(|b| b != cfg) {
                        tracing::info!(worker = %name, block_size = engine,
                            "block size agrees again: worker back in KV scoring");
                        sink.on_block_size_agrees(worker);
                    }
                    reported_bs = Some(engine);
                }
                sink.on_load(worker, &load);
            }
            Err(e) => {
                inc(&stats.scrapes_failed);
                tracing::debug!(worker = %name, error = %e, "scrape failed");
                if !stale && last_ok.elapsed() >= s.stale_after {
                    stale = true;
                    inc(&stats.scrapes_stale);
                    tracing::warn!(worker = %name, error = %e, stale_after = ?s.stale_after,
                        "worker metrics stale: routing ignores its scraped load");
                    sink.on_load_stale(worker);
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(jittered(s.interval, s.jitter)) => {}
        }
    }
}
