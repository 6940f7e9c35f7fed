//! Per-request state: one struct that travels with the request from accept to the last byte
//! (decision, timings, token counts), and `finish`, which records metrics and the request log line
//! exactly once, whether the request succeeded, failed, or the client went away.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_protocol::finish::FinishReason;
use kvgate_protocol::usage::Usage;
use serde::Serialize;

use arc_swap::ArcSwap;

use crate::config::SloConfig;
use crate::metrics::{Lbl, Metrics, RequestHandles};
use crate::registry::Worker;
use crate::route::router::DispatchGuard;

/// What a finished request is recorded into: the metrics, the SLO it is judged by (`[slo]`,
/// reloadable), the request log switch (`server.request_log`) and the fleet's token count (tokens
/// per dollar). Shared by every request's [`RequestCtx`]; the only part of the gateway's state the
/// request accounting sees.
pub struct Telemetry {
    pub metrics: Arc<Metrics>,
    /// Read through `thread_cache::slo` on the request path.
    pub slo: Arc<ArcSwap<SloConfig>>,
    pub request_log: bool,
    pub tokens_served: std::sync::atomic::AtomicU64,
    /// `[tracing]`: `None` when off (each request then costs one branch per hook).
    pub tracer: Option<Arc<crate::trace::Tracer>>,
    unknown_model: Lbl,
    no_worker: Lbl,
}

crate::thread_cache::cached_load!(
    /// The SLO requests are judged by now (`[slo]`, reloadable).
    fn cached_slo(SloConfig)
);

impl Telemetry {
    pub fn new(metrics: Arc<Metrics>, slo: &SloConfig, request_log: bool) -> Telemetry {
        Telemetry {
            metrics,
            slo: Arc::new(ArcSwap::from_pointee(slo.clone())),
            request_log,
            tokens_served: std::sync::atomic::AtomicU64::new(0),
            tracer: None,
            unknown_model: Lbl::from("unknown"),
            no_worker: Lbl::from("none"),
        }
    }

    /// With the tracer of `[tracing]` (`None`: tracing off).
    pub fn with_tracer(mut self, tracer: Option<Arc<crate::trace::Tracer>>) -> Telemetry {
        self.tracer = tracer;
        self
    }
}

pub use crate::client_api::Endpoint;

/// How a request ended, for metrics and the log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The worker's response was delivered completely (any status).
    Complete,
    /// The client went away before the end.
    Cancelled,
    /// The worker failed after the first byte (stream ended with an SSE error event).
    StreamError,
    /// The gateway answered with an error itself (see `error`).
    Rejected,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Complete => "complete",
            Outcome::Cancelled => "cancelled",
            Outcome::StreamError => "stream_error",
            Outcome::Rejected => "rejected",
        }
    }
}

pub struct RequestCtx {
    pub telemetry: Arc<Telemetry>,
    pub start: Instant,
    pub endpoint: Endpoint,
    /// Canonical model name (label); "unknown" until the pool is found.
    pub model: Lbl,
    pub stream: bool,
    /// The gateway added `stream_options.include_usage` for its own counting: the usage-only
    /// chunk is not the client's and is stripped from its stream.
    pub strip_usage: bool,
    pub worker: Option<Arc<Worker>>,
    pub attempts: u32,
    pub queue_wait: Duration,
    pub decision_time: Duration,
    pub prompt_tokens_est: u32,
    pub overlap_blocks: u32,
    pub prompt_blocks: u32,
    pub status: u16,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    pub token_events: u32,
    itl_sum: f64,
    itl_sumsq: f64,
    itl_n: u32,
    pub usage: Option<Usage>,
    /// The worker's `finish_reason` (a stream's last one, a JSON body's first choice).
    pub finish_reason: Option<FinishReason>,
    pub error: Option<crate::metrics::ErrorLabel>,
    /// Load held on the worker; released in `finish`.
    pub guard: Option<DispatchGuard>,
    /// This request's (model, worker) metric series, resolved once (see `Metrics::handles`).
    handles: Option<Arc<RequestHandles>>,
    finished: bool,
    /// Set when a prefill worker ran this request's prefill (the decode worker serves the rest).
    pub pd: Option<crate::pd::Prefilled>,
    /// SGLang: the prefill leg still draining beside the decode worker's answer.
    pub pd_partner: Option<crate::pd::Partner>,
    /// Another worker ran the prefill outside the gateway's sight (the endpoint picker named a
    /// prefill worker to the decode worker's P/D sidecar): the first token says nothing of this
    /// worker's prefill speed.
    pub prefilled_elsewhere: bool,
    /// Responses: where the response id of the reply is recorded, pinned to `worker`.
    pub pins: Option<Arc<crate::pins::ResponsePins>>,
    /// The request's trace and spans so far (`None` when tracing is off): `crate::trace`.
    pub trace: crate::trace::Trace,
}

impl RequestCtx {
    /// Boxed: the context travels from the route table into the response body (and its
    /// observation) by value; a pointer moves for free where the ~0.5 KB struct was copied
    /// five times per request.
    pub fn new(telemetry: Arc<Telemetry>, endpoint: Endpoint, start: Instant) -> Box<Self> {
        let unknown = telemetry.unknown_model.clone();
        Box::new(RequestCtx {
            telemetry,
            start,
            endpoint,
            model: unknown,
            stream: false,
            strip_usage: false,
            worker: None,
            attempts: 0,
            queue_wait: Duration::ZERO,
            decision_time: Duration::ZERO,
            prompt_tokens_est: 0,
            overlap_blocks: 0,
            prompt_blocks: 0,
            status: 0,
            first_token: None,
            last_token: None,
            token_events: 0,
            itl_sum: 0.0,
            itl_sumsq: 0.0,
            itl_n: 0,
            usage: None,
            finish_reason: None,
            error: None,
            guard: None,
            handles: None,
            finished: false,
            pd: None,
            pd_partner: None,
            prefilled_elsewhere: false,
            pins: None,
            trace: crate::trace::Trace::default(),
        })
    }

    /// The worker's reply named its response `id` (Responses): later uses of the id go there.
    pub fn learn_response_id(&mut self, id: &str) {
        if let (Some(pins), Some(w), true) =
            (&self.pins, &self.worker, (200..300).contains(&self.status))
        {
            pins.learn(id, &w.name, crate::clock::now());
        }
    }

    /// A generated-token event arrived (stream; `sse::ChunkInfo::has_token` in kvgate-protocol is
    /// the definition) or the whole response did (non-stream).
    pub fn on_token(&mut self, now: Instant) {
        if self.first_token.is_none() {
            self.first_token = Some(now);
            if let Some(g) = &self.guard {
                g.prefill_done();
                // A non-streamed response's "first token" is its end: not a TTFT to learn from.
                // Nor is a disaggregated request's: its first token follows another worker's
                // prefill and the KV transfer, which say nothing of this (decode) worker's
                // prefill speed (the prefill leg teaches its own worker: proxy/handoff.rs).
                if self.stream
                    && self.pd.is_none()
                    && self.pd_partner.is_none()
                    && !self.prefilled_elsewhere
                {
                    if let Some((predicted, observed)) = g.observe_first_token(now) {
                        self.telemetry
                            .metrics
                            .ttft_prediction_error
                            .observe((predicted - observed).abs() / observed.max(1e-3));
                    }
                }
            }
        } else if let Some(prev) = self.last_token {
            let gap = now.duration_since(prev).as_secs_f64();
            self.itl_sum += gap;
            self.itl_sumsq += gap * gap;
            self.itl_n += 1;
            let h = self.handles();
            h.itl(&self.telemetry.metrics).observe(gap);
        }
        self.last_token = Some(now);
        self.token_events += 1;
    }

    /// The metric handles for the current model and worker ("none" before one is chosen); looked
    /// up again only if either changed (a retry on another worker).
    fn handles(&mut self) -> Arc<RequestHandles> {
        let worker = match &self.worker {
            Some(w) => &w.name,
            None => &self.telemetry.no_worker,
        };
        match &self.handles {
            Some(h) if h.is_for(&self.model, worker) => h.clone(),
            _ => {
                let h = self.telemetry.metrics.handles(&self.model, worker);
                self.handles = Some(h.clone());
                h
            }
        }
    }

    /// Record metrics and the log line. Idempotent; also called from the observer's `Drop`.
    pub fn finish(&mut self, outcome: Outcome) {
        if !self.finished {
            self.finish_at(outcome, crate::clock::now());
        }
    }

    /// [`finish`](Self::finish) with the end already read off the clock (`now`: the instant the
    /// worker's last bytes arrived, read once for the last token and the end).
    pub fn finish_at(&mut self, outcome: Outcome, now: Instant) {
        if self.finished {
            return;
        }
        self.finished = true;
        if let (Some(g), true, Outcome::Complete) = (&self.guard, self.itl_n > 0, outcome) {
            g.observe_itl(self.itl_sum / f64::from(self.itl_n) * 1000.0);
        }
        if let (Some(g), Outcome::Complete) = (&self.guard, outcome) {
            // Generated tokens: the usage's, else (a stream without usage) its token events.
            let generated = match self.usage {
                Some(u) => Some(u.completion_tokens),
                None if self.stream => Some(u64::from(self.token_events)),
                None => None,
            };
            if let Some(n) = generated {
                g.observe_output(n);
            }
        }
        // Release the worker's load first: a queued request may be waiting for it. The end is
        // one instant, for the guard (the slot time it teaches) and the request's duration.
        if let Some(g) = self.guard.take() {
            g.release_at(now);
        }
        let h = self.handles();
        let tel = &*self.telemetry;
        let m = &tel.metrics;
        let total = now.duration_since(self.start);
        let status = match outcome {
            // 499 (nginx convention) so cancelled requests are visible in the status breakdown.
            Outcome::Cancelled => 499,
            _ => self.status,
        };
        // A sampled request's trace id rides on its latency samples (OpenMetrics exemplars).
        let exemplar = self
            .trace
            .sampled_trace_id()
            .map(|trace_id| crate::metrics::TraceLabel { trace_id });
        h.request(m, status).inc();
        m.by_endpoint(self.endpoint.id(), self.stream).inc();
        h.duration(m)
            .observe(total.as_secs_f64(), exemplar.clone(), None);
        if self.worker.is_some() {
            h.worker_duration(m).observe(total.as_secs_f64());
        }
        if let Some(kind) = self.error {
            m.error(kind);
        }
        if outcome == Outcome::StreamError {
            m.stream_errors.inc();
        }
        let ttft = self.first_token.map(|t| t.duration_since(self.start));
        let mean_itl = (self.itl_n > 0).then(|| self.itl_sum / self.itl_n as f64);
        // Embeddings have no tokens to wait for: their latency is in the request duration only.
        // A non-streamed response's "first token" is its end: it goes to its own series so the
        // TTFT histograms describe streams only.
        if let (Some(t), false) = (ttft, !self.endpoint.generates()) {
            if self.stream {
                h.ttft(m).observe(t.as_secs_f64(), exemplar, None);
                if self.worker.is_some() {
                    h.worker_ttft(m).observe(t.as_secs_f64());
                }
            } else {
                h.non_stream_response(m).observe(t.as_secs_f64());
            }
        }
        if self.itl_n >= 2 {
            let mean = self.itl_sum / self.itl_n as f64;
            let var = (self.itl_sumsq / self.itl_n as f64 - mean * mean).max(0.0);
            h.jitter(m).observe(var.sqrt());
        }
        if let Some(pd) = &self.pd {
            pd.on_finish(m, self.stream, self.first_token, &mut self.usage);
        }
        let (prompt, completion, cached) = match self.usage {
            Some(u) => (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            None => (
                self.prompt_tokens_est as u64,
                self.token_events as u64,
                None,
            ),
        };
        let ok = outcome == Outcome::Complete && (200..300).contains(&status);
        if self.worker.is_some() && (ok || outcome == Outcome::StreamError) {
            h.prompt_tokens(m).inc_by(prompt);
            if self.endpoint.generates() {
                h.completion_tokens(m).inc_by(completion);
            }
            if ok {
                h.prompt_tokens_hist(m).observe(prompt as f64);
                if self.endpoint.generates() {
                    h.completion_tokens_hist(m).observe(completion as f64);
                }
            }
            if let Some(c) = cached {
                h.cached_tokens(m).inc_by(c);
                if prompt > 0 {
                    m.realised_cached
                        .observe((c as f64 / prompt as f64).min(1.0));
                }
            }
            tel.tokens_served
                .fetch_add(prompt + completion, Ordering::Relaxed);
        }
        if let (true, Some(f)) = (ok && self.endpoint.generates(), self.finish_reason) {
            h.finish_reason(m, f).inc();
        }
        if ok && self.endpoint.generates() {
            h.slo_checked(m).inc();
            let slo = &cached_slo(&tel.slo);
            let ttft_ok = ttft.is_some_and(|t| t.as_secs_f64() * 1000.0 <= slo.ttft_ms);
            let itl_ok = mean_itl.is_none_or(|i| i * 1000.0 <= slo.itl_ms);
            if ttft_ok && itl_ok {
                h.goodput(m).inc();
            }
        }
        if tel.request_log {
            let line = LogLine {
                msg: "request",
                endpoint: self.endpoint,
                model: &self.model,
                worker: self.worker.as_ref().map(|w| &*w.name),
                status,
                outcome,
                error: self.error.map(crate::metrics::ErrorLabel::as_str),
                stream: self.stream,
                attempts: self.attempts,
                overlap_blocks: self.overlap_blocks,
                prompt_blocks: self.prompt_blocks,
                queue_ms: ms(self.queue_wait),
                decision_us: self.decision_time.as_secs_f64() * 1e6,
                ttft_ms: ttft.map(ms),
                mean_itl_ms: mean_itl.map(|s| s * 1000.0),
                prompt_tokens: prompt,
                completion_tokens: completion,
                cached_tokens: cached,
                finish_reason: self.finish_reason.map(FinishReason::as_str),
                prompt_eval_count: prompt,
                prompt_eval_duration: ttft.map(|t| t.as_nanos() as u64),
                eval_count: completion,
                eval_duration: match (self.first_token, self.last_token) {
                    (Some(a), Some(b)) => Some(b.duration_since(a).as_nanos() as u64),
                    _ => None,
                },
                total_duration: total.as_nanos() as u64,
                trace_id: self.trace.trace_id(),
            };
            if let Ok(mut s) = serde_json::to_vec(&line) {
                s.push(b'\n');
                use std::io::Write;
                let _ = std::io::stdout().lock().write_all(&s);
            }
        }
        if self.trace.is_on() {
            let api = self.endpoint.api();
            self.trace.finish(crate::trace::Summary {
                start: self.start,
                end: now,
                api: api.label,
                operation: if !api.generates {
                    "embeddings"
                } else if api.label.contains("completions") && !api.label.contains("chat") {
                    "text_completion"
                } else {
                    "chat"
                },
                generates: api.generates,
                model: &self.model,
                stream: self.stream,
                status,
                outcome: outcome.as_str(),
                failed: outcome == Outcome::StreamError || status >= 500 || status == 429,
                error: self.error.map(crate::metrics::ErrorLabel::as_str),
                worker: self.worker.as_ref().map(|w| &w.name),
                attempts: self.attempts,
                prompt_tokens: prompt,
                completion_tokens: completion,
                cached_tokens: cached,
                finish_reason: self.finish_reason.map(FinishReason::as_str),
                first_token: self.first_token,
                last_token: self.last_token,
                token_events: self.token_events,
            });
        }
    }
}

impl Drop for RequestCtx {
    fn drop(&mut self) {
        // A ctx dropped before `finish` belongs to a request whose future was dropped: the client
        // disconnected while we were queueing or waiting for the worker's headers.
        if !self.finished {
            self.finish(Outcome::Cancelled);
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One structured log line per request. Durations ending in `_duration` are nanoseconds, as in
/// Ollama's API (`prompt_eval_duration` = TTFT, `eval_duration` = first to last token).
#[derive(Serialize)]
struct LogLine<'a> {
    msg: &'static str,
    endpoint: Endpoint,
    model: &'a str,
    worker: Option<&'a str>,
    status: u16,
    outcome: Outcome,
    error: Option<&'static str>,
    stream: bool,
    attempts: u32,
    overlap_blocks: u32,
    prompt_blocks: u32,
    queue_ms: f64,
    decision_us: f64,
    ttft_ms: Option<f64>,
    mean_itl_ms: Option<f64>,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: Option<u64>,
    finish_reason: Option<&'static str>,
    prompt_eval_count: u64,
    prompt_eval_duration: Option<u64>,
    eval_count: u64,
    eval_duration: Option<u64>,
    total_duration: u64,
    /// With `[tracing]` on: the request's trace id (32 hex digits), sampled or not.
    #[serde(skip_serializing_if = "Option::is_none")]
    trace_id: Option<String>,
}
