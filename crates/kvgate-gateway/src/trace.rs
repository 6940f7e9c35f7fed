//! Distributed tracing (`[tracing]`, docs/tracing.md): W3C trace context in and out, one span per
//! request with a child per step, exported over OTLP off the request path.
//!
//! The request's [`Trace`] travels in its ctx (`RequestCtx::trace`); every hook is a method on it
//! that costs one branch when tracing is off. When it is on, each request records its spans as plain
//! structs (`kvgate_protocol::otlp::SpanRecord`) in its [`RequestTrace`], sampled or not, so that
//! a request that ends in error can still be exported; at the end they go to the exporter's
//! bounded queue in one push (or are dropped with the trace when the request is neither sampled
//! nor failed). Encoding and sending happen on the exporter's task (`kvgate_http::otlp`). This
//! module knows nothing of the gateway's types (the hooks take plain values), so every part of the
//! request path may call it.
//!
//! The worker receives `traceparent` with the span id of the attempt that calls it, on every leg
//! (retries, both PD legs), so an engine started with an OTLP endpoint (vLLM's
//! `--otlp-traces-endpoint`, `kvgate sim --otlp-traces-endpoint`) joins the same trace;
//! `tracestate` and `baggage` pass through unchanged.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};
use kvgate_http::otlp::{Exporter, Hooks};
use kvgate_protocol::otlp::{Attrs, EventRecord, Kind, SpanRecord, Value};
use kvgate_protocol::trace_context::{format_traceparent, put_hex, TraceParent, FLAG_SAMPLED};

use crate::config::TracingConfig;

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The gateway's tracer: the sampling settings (reloadable) and the exporter's queue.
pub struct Tracer {
    exporter: Exporter,
    /// `sample_ratio` as f64 bits.
    ratio: AtomicU64,
    parent_based: AtomicBool,
    errors: AtomicBool,
    /// `route_candidates`: top candidates a sampled request's route span lists (restart to
    /// change).
    route_candidates: u8,
}

/// Sampling as configured (`[tracing]`), read once per request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub ratio: f64,
    pub parent_based: bool,
    pub errors: bool,
}

impl Sampling {
    /// The head decision: the caller's sampled flag when parent-based and a valid parent came
    /// with the request, else a coin (uniform in [0, 1)) below `ratio`.
    pub fn decide(&self, parent: Option<&TraceParent>, coin: f64) -> bool {
        match parent {
            Some(p) if self.parent_based => p.sampled(),
            _ => coin < self.ratio,
        }
    }
}

impl Tracer {
    /// Start the exporter when `[tracing] otlp_endpoint` is set; `None` = tracing off. `hooks`
    /// count dropped, exported and failed spans.
    pub fn start(
        cfg: &TracingConfig,
        hooks: Hooks,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<Option<Arc<Tracer>>> {
        if cfg.otlp_endpoint.is_empty() {
            return Ok(None);
        }
        let target = kvgate_http::otlp::Target::parse(&cfg.otlp_endpoint)
            .map_err(|e| anyhow::anyhow!("tracing.otlp_endpoint: {e}"))?;
        let exporter = Exporter::start(
            kvgate_http::otlp::Config {
                target,
                ca_file: cfg.ca_file.clone(),
                queue: cfg.queue_size,
                max_batch: cfg.max_batch_spans,
                delay: Duration::from_millis(cfg.batch_delay_ms),
                timeout: Duration::from_millis(cfg.export_timeout_ms),
                resource: vec![
                    ("service.name", Value::from(cfg.service_name.clone())),
                    ("service.version", Value::from(env!("CARGO_PKG_VERSION"))),
                ],
                scope: "kvgate",
                version: env!("CARGO_PKG_VERSION"),
            },
            hooks,
            shutdown,
        )
        .map_err(|e| anyhow::anyhow!("tracing: {e}"))?;
        let t = Tracer {
            exporter,
            ratio: AtomicU64::new(0),
            parent_based: AtomicBool::new(true),
            errors: AtomicBool::new(true),
            route_candidates: cfg.route_candidates,
        };
        t.set_sampling(cfg);
        Ok(Some(Arc::new(t)))
    }

    /// Apply a reloaded `[tracing]`'s sampling (the endpoint and queue need a restart).
    pub fn set_sampling(&self, cfg: &TracingConfig) {
        self.ratio.store(
            cfg.sample_ratio.clamp(0.0, 1.0).to_bits(),
            Ordering::Relaxed,
        );
        self.parent_based.store(cfg.parent_based, Ordering::Relaxed);
        self.errors.store(cfg.always_errors, Ordering::Relaxed);
    }

    pub fn sampling(&self) -> Sampling {
        Sampling {
            ratio: f64::from_bits(self.ratio.load(Ordering::Relaxed)),
            parent_based: self.parent_based.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }

    /// Start a request's trace from its headers (a valid `traceparent` continues the caller's
    /// trace); `start` is when the request arrived.
    pub fn begin(self: &Arc<Self>, headers: &HeaderMap, start: Instant) -> Trace {
        let sampling = self.sampling();
        let parent = headers
            .get(TRACEPARENT)
            .and_then(|v| TraceParent::parse(v.as_bytes()).ok());
        let sampled = sampling.decide(parent.as_ref(), fastrand::f64());
        let state = parent
            .and_then(|_| {
                kvgate_protocol::trace_context::tracestate(
                    headers
                        .get_all(TRACESTATE)
                        .iter()
                        .map(HeaderValue::as_bytes),
                )
            })
            .map(Arc::from);
        let mut t = Box::new(RequestTrace {
            tracer: self.clone(),
            trace_id: parent.map_or_else(nonzero_id, |p| p.trace_id),
            span_id: nonzero_id(),
            remote_parent: parent.map(|p| p.parent_id),
            state,
            sampled,
            errors: sampling.errors,
            anchor: start,
            anchor_ns: 0,
            request_id: headers.get(X_REQUEST_ID).cloned(),
            attrs: Vec::new(),
            // An unsampled request records no spans unless an attempt fails.
            spans: if sampled {
                Vec::with_capacity(6)
            } else {
                Vec::new()
            },
            answered: None,
            pd_local: None,
        });
        if sampled {
            t.set_anchor();
        }
        Trace(Some(t))
    }
}

/// One request's trace: its ids, the head sampling decision, and its spans so far.
pub struct RequestTrace {
    tracer: Arc<Tracer>,
    trace_id: [u8; 16],
    /// The request's (root, server) span.
    span_id: [u8; 8],
    /// The caller's span, from `traceparent`.
    remote_parent: Option<[u8; 8]>,
    state: Option<Arc<str>>,
    sampled: bool,
    errors: bool,
    /// The request's arrival, on the gateway's clock and in Unix nanoseconds (0 until a span is
    /// recorded: an unsampled request reads the wall clock only if it is exported).
    anchor: Instant,
    anchor_ns: u64,
    request_id: Option<HeaderValue>,
    attrs: Attrs,
    spans: Vec<SpanRecord>,
    /// Unsampled: the last attempt that got an answer (below 500, not 429), kept without a span
    /// record; it becomes one only if the request is exported for failing later (a stream error).
    answered: Option<Answered>,
    /// The request runs whole on a decode worker of a prefill/decode pool, for this reason.
    pd_local: Option<&'static str>,
}

/// An unsampled request's answered attempt (see `RequestTrace::answered`).
struct Answered {
    span_id: [u8; 8],
    start: Instant,
    end: Instant,
    worker: Arc<str>,
    leg: &'static str,
    status: u16,
}

fn nonzero_id<const N: usize>() -> [u8; N] {
    loop {
        let mut id = [0u8; N];
        fastrand::fill(&mut id);
        if id != [0; N] {
            return id;
        }
    }
}

impl RequestTrace {
    /// Anchor the request's arrival in Unix time (once).
    fn set_anchor(&mut self) {
        if self.anchor_ns != 0 {
            return;
        }
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let now = crate::clock::now();
        self.anchor_ns = wall
            .saturating_sub(now.saturating_duration_since(self.anchor).as_nanos() as u64)
            .max(1);
    }

    /// An upstream attempt's span (`kvgate.upstream`, a client span under the request's).
    #[allow(clippy::too_many_arguments)]
    fn upstream_span(
        &mut self,
        span_id: [u8; 8],
        start: Instant,
        end: Instant,
        worker: Arc<str>,
        leg: &'static str,
        ended: Ended<'_>,
    ) -> SpanRecord {
        self.set_anchor();
        let mut s = self.child("kvgate.upstream", Kind::Client, self.span_id);
        s.span_id = span_id;
        s.start_ns = self.ns(start);
        s.end_ns = self.ns(end);
        s.attrs = vec![
            ("kvgate.upstream.worker", Value::from(worker)),
            ("kvgate.upstream.leg", Value::from(leg)),
        ];
        match ended {
            Ended::Status(code) => {
                s.attrs
                    .push(("http.response.status_code", Value::from(u32::from(code))));
                if code >= 500 || code == 429 {
                    s.error = Some(Cow::Owned(format!("worker answered {code}")));
                }
            }
            Ended::Error(kind, message) => {
                s.attrs.push(("error.type", Value::from(kind)));
                s.error = Some(Cow::Owned(message.to_owned()));
            }
        }
        s
    }

    fn ns(&self, t: Instant) -> u64 {
        match t.checked_duration_since(self.anchor) {
            Some(d) => self.anchor_ns + d.as_nanos() as u64,
            None => self
                .anchor_ns
                .saturating_sub(self.anchor.duration_since(t).as_nanos() as u64),
        }
    }

    fn flags(&self) -> u8 {
        if self.sampled {
            FLAG_SAMPLED
        } else {
            0
        }
    }

    fn child(&self, name: &'static str, kind: Kind, parent: [u8; 8]) -> SpanRecord {
        SpanRecord {
            trace_id: self.trace_id,
            span_id: nonzero_id(),
            parent_id: Some(parent),
            remote_parent: false,
            trace_state: self.state.clone(),
            flags: self.flags(),
            name,
            kind,
            start_ns: 0,
            end_ns: 0,
            attrs: Vec::new(),
            events: Vec::new(),
            error: None,
        }
    }
}

/// An upstream attempt in flight: its span id (the worker's parent), the `traceparent` the
/// worker gets, and when it started.
pub struct Attempt {
    span_id: [u8; 8],
    traceparent: [u8; 55],
    start: Instant,
    worker: Arc<str>,
    leg: &'static str,
}

impl Attempt {
    /// The `traceparent` to send the worker (`kvgate_http::client::Outgoing::traceparent`).
    pub fn traceparent(&self) -> &[u8] {
        &self.traceparent
    }
}

/// What the routing decision's span says.
pub struct Decided<'a> {
    pub policy: &'static str,
    /// `whole`, `prefill` or `decode`.
    pub leg: &'static str,
    pub worker: &'a Arc<str>,
    pub overlap_blocks: u32,
    pub predicted_hit_ratio: f64,
    pub cost: f64,
    pub predicted_ttft_ms: f64,
    /// Why this worker: `overlap`, `latency`, `session`, `load`, `pinned`, or the policy's
    /// name (`round_robin`, `random`, `consistent_hash`).
    pub reason: &'static str,
    /// The top candidates, the chosen one first (one `kvgate.candidate` event each), and how
    /// many the policy saw.
    pub candidates: Vec<RouteCandidate<'a>>,
    pub seen: u32,
    /// Decision start and end; `queued` of it in the admission queue.
    pub start: Instant,
    pub end: Instant,
    pub queued: Duration,
    /// Where the request stood in the admission queue (when it queued).
    pub queue: Option<QueuePlace<'a>>,
}

/// One of a decision's top candidates.
pub struct RouteCandidate<'a> {
    pub worker: &'a Arc<str>,
    pub chosen: bool,
    pub overlap_blocks: u32,
    pub inflight: u32,
    pub active_blocks: u32,
    pub pending_prefill_tokens: u64,
    pub predicted_ttft_ms: f64,
    /// The policy's cost, for policies that rank by one.
    pub cost: Option<f64>,
}

/// A queued request's class, tenant and place in line when it joined the queue.
pub struct QueuePlace<'a> {
    pub class: &'a Arc<str>,
    pub tenant: &'a Arc<str>,
    pub position: u32,
    pub flow_control: bool,
}

/// How an upstream attempt ended.
pub enum Ended<'a> {
    /// The worker answered with this status.
    Status(u16),
    /// No answer: the error's kind and message.
    Error(&'static str, &'a str),
}

/// What the request's span says at the end (from `RequestCtx::finish`).
pub struct Summary<'a> {
    pub start: Instant,
    pub end: Instant,
    pub api: &'static str,
    /// `gen_ai.operation.name`: chat, text_completion, embeddings.
    pub operation: &'static str,
    pub generates: bool,
    pub model: &'a Arc<str>,
    pub stream: bool,
    pub status: u16,
    pub outcome: &'static str,
    /// Failed (5xx, 429, stream error): exported even unsampled when `always_errors`.
    pub failed: bool,
    pub error: Option<&'static str>,
    pub worker: Option<&'a Arc<str>>,
    pub attempts: u32,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: Option<u64>,
    pub finish_reason: Option<&'static str>,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    pub token_events: u32,
}

/// A request's trace as carried in its ctx: `None` inside when tracing is off, and then every
/// method is one branch.
#[derive(Default)]
pub struct Trace(Option<Box<RequestTrace>>);

impl Trace {
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Whether the internal steps (tokenize, route, queue) are recorded: sampled requests only.
    /// An unsampled one keeps just its attempts, for the case it fails (`always_errors`).
    pub fn records_steps(&self) -> bool {
        self.0.as_deref().is_some_and(|t| t.sampled)
    }

    /// The trace id (32 hex digits) when tracing is on.
    pub fn trace_id(&self) -> Option<String> {
        self.0
            .as_deref()
            .map(|t| kvgate_protocol::trace_context::trace_id_hex(&t.trace_id))
    }

    /// The trace id of a sampled request (exemplars).
    pub fn sampled_trace_id(&self) -> Option<String> {
        self.0
            .as_deref()
            .filter(|t| t.sampled)
            .map(|t| kvgate_protocol::trace_context::trace_id_hex(&t.trace_id))
    }

    /// A finished internal step under the request's span.
    pub fn step(&mut self, name: &'static str, start: Instant, end: Instant, attrs: Attrs) {
        let Some(t) = self.0.as_deref_mut().filter(|t| t.sampled) else {
            return;
        };
        let mut s = t.child(name, Kind::Internal, t.span_id);
        s.start_ns = t.ns(start);
        s.end_ns = t.ns(end);
        s.attrs = attrs;
        t.spans.push(s);
    }

    /// Parse, tokenization and block hashing: `kvgate.tokenize` with the prompt's size.
    pub fn tokenized(&mut self, start: Instant, end: Instant, tokens: u32, blocks: u32) {
        if self.records_steps() {
            let attrs = vec![
                ("kvgate.prompt.tokens", Value::from(tokens)),
                ("kvgate.prompt.blocks", Value::from(blocks)),
            ];
            self.step("kvgate.tokenize", start, end, attrs);
        }
    }

    /// A routing decision: `kvgate.route` with the policy, the chosen worker and why, and
    /// `kvgate.queue` under it when the request waited for a worker.
    pub fn decided(&mut self, d: Decided<'_>) {
        let Some(t) = self.0.as_deref_mut().filter(|t| t.sampled) else {
            return;
        };
        let mut s = t.child("kvgate.route", Kind::Internal, t.span_id);
        s.start_ns = t.ns(d.start);
        s.end_ns = t.ns(d.end);
        s.attrs = vec![
            ("kvgate.route.policy", Value::from(d.policy)),
            ("kvgate.route.leg", Value::from(d.leg)),
            ("kvgate.route.worker", Value::from(d.worker.clone())),
            ("kvgate.route.overlap_blocks", Value::from(d.overlap_blocks)),
            (
                "kvgate.route.predicted_hit_ratio",
                Value::from(d.predicted_hit_ratio),
            ),
            ("kvgate.route.cost", Value::from(d.cost)),
            (
                "kvgate.route.predicted_ttft_ms",
                Value::from(d.predicted_ttft_ms),
            ),
            ("kvgate.route.reason", Value::from(d.reason)),
            ("kvgate.route.candidates_seen", Value::from(d.seen)),
        ];
        match (d.leg, t.pd_local) {
            ("prefill" | "decode", _) => s
                .attrs
                .push(("kvgate.route.pd", Value::from("disaggregated"))),
            (_, Some(why)) => s.attrs.extend([
                ("kvgate.route.pd", Value::from("local")),
                ("kvgate.route.pd_reason", Value::from(why)),
            ]),
            _ => {}
        }
        let at = s.end_ns;
        s.events = d
            .candidates
            .iter()
            .enumerate()
            .map(|(rank, c)| {
                let mut attrs = vec![
                    ("kvgate.candidate.rank", Value::from(rank as u32)),
                    ("kvgate.candidate.worker", Value::from(c.worker.clone())),
                    ("kvgate.candidate.chosen", Value::from(c.chosen)),
                    (
                        "kvgate.candidate.overlap_blocks",
                        Value::from(c.overlap_blocks),
                    ),
                    ("kvgate.candidate.inflight", Value::from(c.inflight)),
                    (
                        "kvgate.candidate.active_blocks",
                        Value::from(c.active_blocks),
                    ),
                    (
                        "kvgate.candidate.pending_prefill_tokens",
                        Value::from(c.pending_prefill_tokens),
                    ),
                    (
                        "kvgate.candidate.predicted_ttft_ms",
                        Value::from(c.predicted_ttft_ms),
                    ),
                ];
                if let Some(cost) = c.cost {
                    attrs.push(("kvgate.candidate.cost", Value::from(cost)));
                }
                EventRecord {
                    name: "kvgate.candidate",
                    time_ns: at,
                    attrs,
                }
            })
            .collect();
        let parent = s.span_id;
        t.spans.push(s);
        if !d.queued.is_zero() {
            let mut q = t.child("kvgate.queue", Kind::Internal, parent);
            q.start_ns = t.ns(d.start);
            q.end_ns = t.ns(d.start + d.queued);
            q.attrs = vec![(
                "kvgate.queue.wait_ms",
                Value::from(d.queued.as_secs_f64() * 1000.0),
            )];
            if let Some(p) = &d.queue {
                q.attrs.extend([
                    ("kvgate.queue.position", Value::from(p.position)),
                    ("kvgate.queue.flow_control", Value::from(p.flow_control)),
                ]);
                if p.flow_control {
                    q.attrs.extend([
                        ("kvgate.flow.class", Value::from(p.class.clone())),
                        ("kvgate.flow.tenant", Value::from(p.tenant.clone())),
                    ]);
                }
            }
            t.spans.push(q);
        }
    }

    /// How many top candidates a decision should list for this request: `route_candidates` of a
    /// sampled request, else 0 (nothing collected).
    pub fn explain(&self) -> u8 {
        self.0
            .as_deref()
            .filter(|t| t.sampled)
            .map_or(0, |t| t.tracer.route_candidates)
    }

    /// The prefill/decode decision: request attributes `kvgate.pd.path` / `kvgate.pd.reason`,
    /// and for a local run, the route spans after it say so.
    pub fn pd_decision(&mut self, path: &'static str, reason: &'static str) {
        if let Some(t) = self.0.as_deref_mut() {
            t.attrs.push(("kvgate.pd.path", Value::from(path)));
            t.attrs.push(("kvgate.pd.reason", Value::from(reason)));
            if path == "local" {
                t.pd_local = Some(reason);
            }
        }
    }

    /// An attribute on the request's span (the PD path and reason, ...).
    pub fn attr(&mut self, key: &'static str, value: impl Into<Value>) {
        if let Some(t) = self.0.as_deref_mut() {
            t.attrs.push((key, value.into()));
        }
    }

    /// An upstream attempt starts: the worker is to get [`Attempt::traceparent`] (the trace id,
    /// the attempt's span id and the sampled flag) in place of the client's `traceparent`. `None`
    /// when tracing is off (the client's headers go unchanged).
    pub fn attempt_start(&self, worker: &Arc<str>, leg: &'static str) -> Option<Attempt> {
        let t = self.0.as_deref()?;
        let span_id = nonzero_id();
        Some(Attempt {
            span_id,
            traceparent: format_traceparent(&t.trace_id, &span_id, t.flags()),
            start: crate::clock::now(),
            worker: worker.clone(),
            leg,
        })
    }

    /// An upstream attempt ended: `kvgate.upstream` (a client span, the worker's parent). An
    /// unsampled request records it only when it failed (it may be exported for that); an
    /// answered one is kept as plain facts until the request's end.
    pub fn attempt_end(&mut self, a: Option<Attempt>, ended: Ended<'_>) {
        let (Some(t), Some(a)) = (self.0.as_deref_mut(), a) else {
            return;
        };
        let end = crate::clock::now();
        if !t.sampled {
            if let Ended::Status(status) = ended {
                if status < 500 && status != 429 {
                    t.answered = Some(Answered {
                        span_id: a.span_id,
                        start: a.start,
                        end,
                        worker: a.worker,
                        leg: a.leg,
                        status,
                    });
                    return;
                }
            }
        }
        let s = t.upstream_span(a.span_id, a.start, end, a.worker, a.leg, ended);
        t.spans.push(s);
    }

    /// The last attempt is retried on another worker, for `reason`.
    pub fn retried(&mut self, reason: &'static str) {
        if let Some(s) = self.0.as_deref_mut().and_then(|t| {
            t.spans
                .iter_mut()
                .rev()
                .find(|s| s.name == "kvgate.upstream")
        }) {
            s.attrs.push(("kvgate.retry.reason", Value::from(reason)));
        }
    }

    /// The request ended: close its span and, when sampled (or failed, with `always_errors`),
    /// push all its spans to the exporter's queue in one go.
    pub fn finish(&mut self, sum: Summary<'_>) {
        let Some(mut t) = self.0.take() else {
            return;
        };
        if !(t.sampled || (t.errors && sum.failed)) {
            return;
        }
        t.set_anchor();
        if let Some(a) = t.answered.take() {
            let s = t.upstream_span(
                a.span_id,
                a.start,
                a.end,
                a.worker,
                a.leg,
                Ended::Status(a.status),
            );
            t.spans.push(s);
        }
        let mut root = t.child("kvgate.request", Kind::Server, t.span_id);
        root.span_id = t.span_id;
        root.parent_id = t.remote_parent;
        root.remote_parent = t.remote_parent.is_some();
        root.start_ns = t.ns(sum.start);
        root.end_ns = t.ns(sum.end);
        let mut a = std::mem::take(&mut t.attrs);
        let request_id = match &t.request_id {
            Some(v) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
            None => {
                let mut hex = [0u8; 16];
                put_hex(&mut hex, &t.span_id);
                String::from_utf8_lossy(&hex).into_owned()
            }
        };
        a.extend([
            ("kvgate.request_id", Value::from(request_id)),
            ("gen_ai.operation.name", Value::from(sum.operation)),
            ("kvgate.api", Value::from(sum.api)),
            ("gen_ai.request.model", Value::from(sum.model.clone())),
            ("kvgate.stream", Value::from(sum.stream)),
            (
                "http.response.status_code",
                Value::from(u32::from(sum.status)),
            ),
            ("kvgate.outcome", Value::from(sum.outcome)),
            ("kvgate.attempts", Value::from(sum.attempts)),
            ("gen_ai.usage.input_tokens", Value::from(sum.prompt_tokens)),
        ]);
        if sum.generates {
            a.push((
                "gen_ai.usage.output_tokens",
                Value::from(sum.completion_tokens),
            ));
        }
        if let Some(c) = sum.cached_tokens {
            a.push(("kvgate.usage.cached_tokens", Value::from(c)));
        }
        if let Some(w) = sum.worker {
            a.push(("kvgate.worker", Value::from(w.clone())));
        }
        if let Some(f) = sum.finish_reason {
            a.push(("gen_ai.response.finish_reasons", Value::from(f)));
        }
        if let Some(e) = sum.error {
            a.push(("error.type", Value::from(e)));
            root.error = Some(Cow::Borrowed(e));
        } else if sum.failed {
            root.error = Some(Cow::Borrowed(sum.outcome));
        }
        root.attrs = a;
        if let Some(ft) = sum.first_token {
            root.events.push(EventRecord {
                name: "first_token",
                time_ns: t.ns(ft),
                attrs: vec![(
                    "kvgate.ttft_ms",
                    Value::from(ft.saturating_duration_since(sum.start).as_secs_f64() * 1000.0),
                )],
            });
        }
        if sum.stream && sum.outcome == "complete" {
            root.events.push(EventRecord {
                name: "stream_end",
                time_ns: t.ns(sum.last_token.unwrap_or(sum.end)),
                attrs: vec![("kvgate.token_events", Value::from(sum.token_events))],
            });
        }
        let mut spans = std::mem::take(&mut t.spans);
        spans.push(root);
        t.tracer.exporter.submit(spans);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent(sampled: bool) -> TraceParent {
        TraceParent {
            trace_id: [1; 16],
            parent_id: [2; 8],
            flags: u8::from(sampled),
        }
    }

    #[test]
    fn sampling_follows_the_parent_when_asked_else_the_ratio() {
        let s = Sampling {
            ratio: 0.25,
            parent_based: true,
            errors: true,
        };
        assert!(s.decide(Some(&parent(true)), 0.99));
        assert!(!s.decide(Some(&parent(false)), 0.0));
        assert!(s.decide(None, 0.2));
        assert!(!s.decide(None, 0.25));
        let ratio_only = Sampling {
            parent_based: false,
            ..s
        };
        assert!(!ratio_only.decide(Some(&parent(true)), 0.5));
        assert!(ratio_only.decide(Some(&parent(false)), 0.1));
        let never = Sampling { ratio: 0.0, ..s };
        assert!(!never.decide(None, 0.0));
        let always = Sampling { ratio: 1.0, ..s };
        assert!(always.decide(None, 0.999_999));
    }

    #[test]
    fn the_ratio_samples_about_that_share() {
        let s = Sampling {
            ratio: 0.1,
            parent_based: true,
            errors: true,
        };
        let mut rng = fastrand::Rng::with_seed(7);
        let n = (0..100_000).filter(|_| s.decide(None, rng.f64())).count();
        assert!((9_000..11_000).contains(&n), "{n}");
    }
}
