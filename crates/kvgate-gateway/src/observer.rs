//! `ObservedBody`: the worker's response body passed through to the client byte for byte, while
//! watching it: time to first token, inter-token gaps, `usage`, mid-stream errors and the end.
//!
//! Ending is handled in one place whatever the cause: the worker finished (`Complete`), the worker
//! failed or went silent after the first byte (the stream ends with an SSE `data: {"error":…}`
//! event, never a hang — `StreamError`), or the client went away and hyper dropped the body
//! (`Cancelled`). Dropping the inner body drops the upstream connection, which cancels the request
//! on the worker; finishing the request context releases its load guard at once.
//!
//! What a streamed event means (a token — the one TTFT definition —, usage, an error, the end) is
//! read by kvgate-protocol's `sse::Relay`; this file times it and ends the request.

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use kvgate_protocol::error::{types, OpenAiError};
use kvgate_protocol::finish::find_finish_reason;
use kvgate_protocol::sse::{Dialect, Relay};
use kvgate_protocol::usage::{find_usage, merge_pd_usage, Usage};

use crate::client_api::{ErrorShape, ResponseShape};
use crate::metrics::ErrorLabel;

use crate::ctx::{Outcome, RequestCtx};
use kvgate_http::client::ResponseBody;

/// A non-streamed worker body failing mid-way (`body::BodyError` is this type).
type BodyError = kvgate_http::client::Error;

/// Non-stream bodies: bytes kept from the end of the body to find `usage` in.
const TAIL_KEEP: usize = 8 << 10;
/// An SSE event larger than this is not an OpenAI chunk: it is passed on without being examined.
const MAX_EVENT: usize = 1 << 20;

/// What the gateway learns from a worker's response, pushed to it chunk by chunk
/// ([`Observation::observe`]) by whoever carries the body: the proxy's [`ObservedBody`], or a
/// front end that receives the body from elsewhere (an ext_proc stream). It owns the request's
/// context and ends it exactly once.
pub struct Observation {
    pub(crate) ctx: Box<RequestCtx>,
    scan: Scan,
}

pub struct ObservedBody {
    inner: ResponseBody,
    obs: Observation,
    /// Fires when the worker sends nothing for this long (`upstream.stream_idle_timeout_s`).
    idle: Option<Duration>,
    /// When the last data arrived (or the body was handed over), for `idle`.
    last_data: tokio::time::Instant,
    /// `idle`'s timer, armed only once the body has to be waited for. It is not moved at each
    /// chunk (a timer reset per token costs more than the chunk's bookkeeping): when it fires, it
    /// is moved to `last_data + idle` unless that has passed.
    idle_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// SSE error event still to deliver before the end.
    pending: Option<Bytes>,
    done: bool,
    /// Bytes the request path read before the client's head (a stream's first chunk), and when.
    first: Option<(Bytes, Instant)>,
    /// Non-streamed bodies: when the whole response must have arrived (`upstream.request_timeout_s`),
    /// and its timer, armed only once the body has to be waited for.
    deadline: Option<tokio::time::Instant>,
    deadline_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// SGLang: the prefill leg draining beside this (decode) body (`crate::pd::Partner`).
    partner: Option<crate::pd::Partner>,
}

enum Scan {
    /// `text/event-stream`: kvgate-protocol's relay (event facts, and the usage the gateway asked
    /// for removed from the client's stream when `ctx.strip_usage`).
    Sse(Relay),
    /// JSON document: the last `TAIL_KEEP` bytes.
    Json { tail: Vec<u8> },
    /// A disaggregated request's JSON document: held whole and delivered at its end with the
    /// prefill leg's prompt and cached tokens merged into `usage` (`crate::pd`).
    JsonPd { doc: Vec<u8>, prefill: Usage },
    /// A Responses / Messages JSON document, kept (up to `AGENT_DOC_MAX`) to read its id, usage
    /// and finish reason at its end; passed on chunk by chunk as it arrives.
    JsonAgent {
        doc: Vec<u8>,
        dialect: Dialect,
        /// The document outgrew the bound: only its tail is kept (usage still found there).
        tail_only: bool,
    },
}

thread_local! {
    /// A JSON body's tail buffer, kept from one response to the next on this thread (one
    /// allocation fewer per response).
    static TAIL: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// An empty tail buffer: the one kept on this thread if any.
fn take_tail() -> Vec<u8> {
    TAIL.try_with(|t| t.take()).unwrap_or_default()
}

impl Drop for Scan {
    fn drop(&mut self) {
        if let Scan::Json { tail } = self {
            if tail.capacity() <= TAIL_KEEP {
                let mut t = std::mem::take(tail);
                t.clear();
                let _ = TAIL.try_with(|c| c.set(t));
            }
        }
    }
}

/// Responses / Messages JSON bodies larger than this are read from their tail only.
const AGENT_DOC_MAX: usize = 4 << 20;

impl Observation {
    /// With `ctx.strip_usage` (the gateway asked for usage, the client did not), a stream's
    /// usage-only event is removed on the way to the client; a disaggregated request's usage
    /// takes the prefill leg's prompt and cached tokens.
    pub fn new(ctx: Box<RequestCtx>, sse: bool) -> Observation {
        let pd_usage = ctx.pd.as_ref().and_then(|p| p.usage);
        let dialect = match ctx.endpoint.api().response {
            ResponseShape::OpenAi => Dialect::OpenAi,
            ResponseShape::Responses => Dialect::Responses,
            ResponseShape::Messages => Dialect::Messages,
        };
        let scan = match (sse, pd_usage) {
            (true, None) => Scan::Sse(Relay::new(ctx.strip_usage, MAX_EVENT).with_dialect(dialect)),
            (true, Some(u)) => Scan::Sse(Relay::new(ctx.strip_usage, MAX_EVENT).with_pd_usage(u)),
            (false, _) if dialect != Dialect::OpenAi => Scan::JsonAgent {
                doc: Vec::new(),
                dialect,
                tail_only: false,
            },
            (false, None) => Scan::Json { tail: take_tail() },
            (false, Some(prefill)) => Scan::JsonPd {
                doc: Vec::new(),
                prefill,
            },
        };
        Observation { ctx, scan }
    }

    /// Whether the body is an event stream (it can end with an error event of ours).
    pub fn is_stream(&self) -> bool {
        matches!(self.scan, Scan::Sse(_))
    }

    /// A chunk of the worker's body arrived at `at` (now when `None`).
    pub fn observe(&mut self, data: &[u8], at: Option<Instant>) {
        match &mut self.scan {
            Scan::Json { tail } => {
                if data.len() >= TAIL_KEEP {
                    tail.clear();
                    tail.extend_from_slice(&data[data.len() - TAIL_KEEP..]);
                } else {
                    let excess = (tail.len() + data.len()).saturating_sub(TAIL_KEEP);
                    tail.drain(..excess);
                    tail.extend_from_slice(data);
                }
            }
            Scan::JsonPd { doc, .. } => doc.extend_from_slice(data),
            Scan::JsonAgent { doc, tail_only, .. } => {
                doc.extend_from_slice(data);
                if doc.len() > AGENT_DOC_MAX {
                    *tail_only = true;
                    let excess = doc.len() - TAIL_KEEP;
                    doc.drain(..excess);
                }
            }
            Scan::Sse(relay) => {
                let now = at.unwrap_or_else(Instant::now);
                let ctx = &mut self.ctx;
                relay.feed(data, |ev| {
                    if ev.error {
                        ctx.error = Some(ErrorLabel::UpstreamStream);
                    }
                    if ev.usage.is_some() {
                        ctx.usage = ev.usage;
                    }
                    if ev.finish_reason.is_some() {
                        ctx.finish_reason = ev.finish_reason;
                    }
                    if ev.has_token {
                        ctx.on_token(now);
                    }
                });
                if let Some(id) = relay.take_response_id() {
                    ctx.learn_response_id(&id);
                }
            }
        }
    }

    /// Stripping: what to deliver of the chunk just observed (`None`: deliver the chunk as is).
    pub fn take_out(&mut self) -> Option<Bytes> {
        match &mut self.scan {
            Scan::Sse(relay) => relay.take_out().map(Bytes::from),
            Scan::Json { .. } | Scan::JsonAgent { .. } => None,
            Scan::JsonPd { .. } => Some(Bytes::new()),
        }
    }

    /// Stripping: an unfinished event, held back, goes out when the stream ends.
    pub fn take_held(&mut self) -> Option<Bytes> {
        match &mut self.scan {
            Scan::Sse(relay) => relay.take_held().map(Bytes::from),
            Scan::Json { .. } | Scan::JsonAgent { .. } => None,
            Scan::JsonPd { doc, prefill } => (!doc.is_empty())
                .then(|| Bytes::from(merge_pd_usage(doc, prefill).unwrap_or_else(|| doc.clone()))),
        }
    }

    /// The worker's body ended normally.
    pub fn finish_ok(&mut self) {
        self.finish_ok_at(crate::clock::now());
    }

    /// [`finish_ok`](Self::finish_ok) with the instant the last bytes arrived.
    pub fn finish_ok_at(&mut self, now: Instant) {
        if let Scan::JsonAgent {
            doc,
            dialect,
            tail_only,
        } = &self.scan
        {
            let (id, usage, finish) = if *tail_only {
                (None, find_usage(doc), None)
            } else {
                kvgate_protocol::sse::agent::whole_body(*dialect, doc)
            };
            if usage.is_some() {
                self.ctx.usage = usage;
            }
            if finish.is_some() {
                self.ctx.finish_reason = finish;
            }
            if let (Some(id), Dialect::Responses) = (id, dialect) {
                self.ctx.learn_response_id(&id);
            }
            self.ctx.on_token(now);
        }
        if let Scan::Json { tail } | Scan::JsonPd { doc: tail, .. } = &self.scan {
            if let Some(u) = find_usage(tail) {
                self.ctx.usage = Some(u);
            }
            // `finish_reason` follows a choice's message and logprobs, so even a long answer
            // has it in the last `TAIL_KEEP` bytes.
            if let Some(f) = find_finish_reason(tail) {
                self.ctx.finish_reason = Some(f);
            }
            // A worker's 5xx saying it ran out of memory (vLLM/SGLang/TRT-LLM pass the CUDA or
            // allocator message on) is its own error kind: it calls for capacity, not a restart.
            if self.ctx.status >= 500 && self.ctx.error.is_none() && says_out_of_memory(tail) {
                self.ctx.error = Some(ErrorLabel::UpstreamOom);
            }
            // Non-stream: the whole response is the "first token" (prefill and decode done).
            self.ctx.on_token(now);
        }
        self.ctx.finish_at(Outcome::Complete, now);
    }

    /// The worker failed after the first byte of a stream: the request ends as a stream error
    /// and the client gets this error event as the stream's last.
    pub fn fail_stream(&mut self, why: &str) -> Bytes {
        self.ctx.error = Some(ErrorLabel::UpstreamStream);
        self.ctx.finish(Outcome::StreamError);
        match self.ctx.endpoint.api().errors {
            ErrorShape::OpenAi => OpenAiError::new(502, types::SERVER, why.to_owned())
                .with_code("upstream_stream_error")
                .to_sse_event(),
            // The Responses stream's own error event.
            ErrorShape::Responses => {
                let ev = serde_json::json!({
                    "type": "error",
                    "code": "upstream_stream_error",
                    "message": why,
                    "param": null,
                });
                Bytes::from(format!("event: error\ndata: {ev}\n\n"))
            }
            // Anthropic's mid-stream error (clients dispatch on the `event:` line).
            ErrorShape::Anthropic => {
                let body = kvgate_protocol::error::anthropic_error_json("api_error", why);
                let mut out = b"event: error\ndata: ".to_vec();
                out.extend_from_slice(&body);
                out.extend_from_slice(b"\n\n");
                Bytes::from(out)
            }
        }
    }

    /// A JSON body failed mid-way (`kind`): the request ends as a stream error (the client sees
    /// a cut connection).
    pub fn fail_body(&mut self, kind: ErrorLabel) {
        self.ctx.error = Some(kind);
        self.ctx.finish(Outcome::StreamError);
    }

    /// The body was dropped before its end (the client went away): a stream that had delivered
    /// its `[DONE]` completed; anything else was cancelled.
    pub fn dropped(&mut self) {
        if matches!(&self.scan, Scan::Sse(relay) if relay.saw_done()) {
            self.finish_ok();
        } else {
            self.ctx.finish(Outcome::Cancelled);
        }
    }
}

impl ObservedBody {
    /// With `ctx.strip_usage` (the gateway asked for usage, the client did not), a stream's
    /// usage-only event is removed on the way to the client. `answered`: when the worker's
    /// response (a stream: its first bytes) arrived, where the idle timer starts.
    pub fn new(
        inner: ResponseBody,
        mut ctx: Box<RequestCtx>,
        sse: bool,
        idle_timeout: Option<Duration>,
        answered: Instant,
    ) -> Self {
        // Both kinds of body: a JSON body that stalls mid-way would otherwise hold the client
        // (and the worker's load) forever, since `response_timeout_s` ends at the head.
        let partner = ctx.pd_partner.take();
        ObservedBody {
            partner,
            inner,
            obs: Observation::new(ctx, sse),
            idle: idle_timeout,
            last_data: tokio::time::Instant::from_std(answered),
            idle_timer: None,
            pending: None,
            done: false,
            first: None,
            deadline: None,
            deadline_timer: None,
        }
    }

    /// Bytes already read from `inner` (delivered first, observed as arrived at their instant),
    /// and the non-stream body's deadline.
    pub fn prefetched(
        &mut self,
        first: Option<(Bytes, Instant)>,
        deadline: Option<tokio::time::Instant>,
    ) {
        self.first = first;
        self.deadline = deadline.filter(|_| !self.obs.is_stream());
    }

    /// Polls the idle timer: `Some(why)` once nothing has arrived for `idle`; otherwise the timer
    /// is armed (or moved to `last_data + idle`) with `cx`'s waker.
    fn idle_expired(&mut self, idle: Duration, cx: &mut Context<'_>) -> Option<String> {
        let due = self.last_data + idle;
        let timer = self
            .idle_timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        loop {
            if timer.as_mut().poll(cx).is_pending() {
                return None;
            }
            // The timer was set for an earlier `last_data`: data came since.
            let due = self.last_data + idle;
            if tokio::time::Instant::now() >= due {
                let secs = idle.as_secs_f64();
                return Some(format!("worker sent nothing for {secs:.0} s mid-stream"));
            }
            timer.as_mut().reset(due);
        }
    }

    fn fail_stream(&mut self, why: &str) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.done = true;
        Poll::Ready(Some(Ok(Frame::data(self.obs.fail_stream(why)))))
    }
}

/// Whether an error body reports an out-of-memory condition ("CUDA out of memory", "OutOfMemory",
/// "OOM"), ASCII case-insensitively.
fn says_out_of_memory(body: &[u8]) -> bool {
    let has = |needle: &[u8]| {
        body.windows(needle.len())
            .any(|w| w.eq_ignore_ascii_case(needle))
    };
    has(b"out of memory") || has(b"outofmemory") || has(b"\"oom") || has(b" oom")
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Some(ev) = this.pending.take() {
            return Poll::Ready(Some(Ok(Frame::data(ev))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            let (polled, at) = match this.first.take() {
                Some((data, at)) => (Poll::Ready(Some(Ok(Frame::data(data)))), Some(at)),
                None => (Pin::new(&mut this.inner).poll_frame(cx), None),
            };
            match polled {
                Poll::Ready(Some(Ok(mut frame))) => {
                    if let Some(data) = frame.data_ref() {
                        this.obs.observe(data, at);
                        if let Some(out) = this.obs.take_out() {
                            frame = Frame::data(out);
                        }
                    }
                    // A body of known length ends with its last data frame: hyper stops polling
                    // once it has sent content-length bytes, so waiting for `None` would record a
                    // complete response as cancelled when the body is dropped.
                    let end = this.inner.is_end_stream();
                    // One clock read per frame at most: the idle timer's and the end's.
                    let now = (this.idle.is_some() || end).then(tokio::time::Instant::now);
                    if let (Some(_), Some(now)) = (this.idle, now) {
                        this.last_data = now;
                    }
                    if let (true, Some(now)) = (end, now) {
                        this.done = true;
                        this.pending = this.obs.take_held();
                        this.obs.finish_ok_at(now.into_std());
                    }
                    if frame.data_ref().is_some_and(|d| d.is_empty()) {
                        // Everything in this chunk was held back or stripped.
                        if this.done {
                            return Poll::Ready(this.pending.take().map(|b| Ok(Frame::data(b))));
                        }
                        continue;
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(e))) => {
                    return if this.obs.is_stream() {
                        this.fail_stream(&format!("worker connection failed mid-stream: {e}"))
                    } else {
                        this.done = true;
                        this.obs.fail_body(ErrorLabel::UpstreamBody);
                        Poll::Ready(Some(Err(e)))
                    };
                }
                Poll::Ready(None) => {
                    this.done = true;
                    this.obs.finish_ok();
                    return Poll::Ready(this.obs.take_held().map(|b| Ok(Frame::data(b))));
                }
                Poll::Pending => {
                    if let Some(p) = &mut this.partner {
                        match Pin::new(&mut p.failed).poll(cx) {
                            Poll::Pending => {}
                            // The prefill leg completed.
                            Poll::Ready(Err(_)) => this.partner = None,
                            Poll::Ready(Ok(why)) => {
                                this.partner = None;
                                if this.obs.is_stream() {
                                    return this.fail_stream(&why);
                                }
                                this.done = true;
                                this.obs.fail_body(ErrorLabel::UpstreamBody);
                                return Poll::Ready(Some(Err(kvgate_http::client::Error::Io(why))));
                            }
                        }
                    }
                    if let Some(at) = this.deadline {
                        let timer = this
                            .deadline_timer
                            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                        if timer.as_mut().poll(cx).is_ready() {
                            // Headers are out: the honest signal for a truncated JSON document
                            // is a reset connection (as for a worker failing mid-body).
                            this.done = true;
                            this.obs.fail_body(ErrorLabel::UpstreamTimeout);
                            return Poll::Ready(Some(Err(kvgate_http::client::Error::Io(
                                "worker did not finish its response within upstream.request_timeout_s"
                                    .into(),
                            ))));
                        }
                    }
                    if let Some(d) = this.idle {
                        if let Some(why) = this.idle_expired(d, cx) {
                            if this.obs.is_stream() {
                                return this.fail_stream(&why);
                            }
                            // A JSON body whose head is out: only a cut connection says so.
                            this.done = true;
                            this.obs.fail_body(ErrorLabel::UpstreamBody);
                            return Poll::Ready(Some(Err(kvgate_http::client::Error::Io(why))));
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.pending.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // A stream that may end with an appended error event has no known length.
        if self.obs.is_stream() && self.idle.is_some() {
            return SizeHint::default();
        }
        // The merged document's length is known only at its end.
        if matches!(self.obs.scan, Scan::JsonPd { .. }) {
            return SizeHint::default();
        }
        let inner = self.inner.size_hint();
        match (&self.first, inner.exact()) {
            (None, _) => inner,
            // The bytes read ahead are part of the body too.
            (Some((b, _)), Some(n)) => SizeHint::with_exact(n + b.len() as u64),
            (Some(_), None) => SizeHint::default(),
        }
    }
}

impl Drop for ObservedBody {
    fn drop(&mut self) {
        // Body dropped before its end: the client disconnected. `finish` releases the load guard
        // now; `inner` is dropped right after, closing the worker connection (cancelling it there).
        if !self.done {
            if let Some(p) = &self.partner {
                p.leave.cancel();
            }
            // A client that hangs up right after `data: [DONE]` (before the chunked terminator)
            // received the whole answer: that is a completed request, not a cancel.
            self.done = true;
            self.obs.dropped();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::says_out_of_memory;
    use super::Observation;
    use crate::ctx::{Endpoint, RequestCtx, Telemetry};
    use std::sync::Arc;
    use std::time::Duration;

    fn ctx() -> Box<RequestCtx> {
        let tel = Arc::new(Telemetry::new(
            Arc::new(crate::metrics::Metrics::new()),
            &crate::config::SloConfig::default(),
            false,
        ));
        let mut c = RequestCtx::new(tel, Endpoint::CHAT, crate::clock::now());
        c.stream = true;
        c.status = 200;
        c
    }

    /// Chunks pushed from elsewhere (split anywhere, as an ext_proc stream delivers them) give
    /// the same facts as the proxy's own body: first token, gaps, usage, finish reason.
    #[test]
    fn an_observation_fed_chunk_by_chunk_reads_the_stream() {
        let mut o = Observation::new(ctx(), true);
        let t0 = crate::clock::now();
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n",
            "data: [DONE]\n\n"
        );
        for (i, piece) in stream.as_bytes().chunks(13).enumerate() {
            o.observe(piece, Some(t0 + Duration::from_millis(i as u64)));
        }
        assert!(
            o.ctx.first_token.is_some(),
            "a content delta is the first token"
        );
        assert_eq!(o.ctx.token_events, 2);
        let u = o.ctx.usage.expect("usage read");
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (7, 2, Some(4))
        );
        assert!(o.ctx.finish_reason.is_some());
        o.finish_ok();
    }

    #[test]
    fn a_failed_stream_ends_with_an_error_event() {
        let mut o = Observation::new(ctx(), true);
        o.observe(
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n",
            None,
        );
        let ev = o.fail_stream("worker went away");
        let text = String::from_utf8(ev.to_vec()).unwrap();
        assert!(
            text.starts_with("data: ") && text.contains("worker went away"),
            "{text}"
        );
        assert_eq!(
            o.ctx.error,
            Some(crate::metrics::ErrorLabel::UpstreamStream)
        );
    }

    #[test]
    fn out_of_memory_messages_are_recognised() {
        for yes in [
            &br#"{"error":{"message":"CUDA out of memory. Tried to allocate 2.00 GiB"}}"#[..],
            br#"{"error":{"message":"torch.OutOfMemoryError: ..."}}"#,
            br#"{"object":"error","message":"Engine OOM while scheduling","type":"InternalServerError"}"#,
            br#"{"error":"OOM"}"#,
        ] {
            assert!(says_out_of_memory(yes), "{}", String::from_utf8_lossy(yes));
        }
        for no in [
            &br#"{"error":{"message":"mock status 500"}}"#[..],
            br#"{"error":{"message":"room for improvement: zoom"}}"#,
            b"",
        ] {
            assert!(!says_out_of_memory(no), "{}", String::from_utf8_lossy(no));
        }
    }
}
