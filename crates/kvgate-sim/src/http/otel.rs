//! Trace context at the engine, as vLLM does it: the `traceparent` of every completion request is
//! recorded (the last [`KEEP`], served at `GET /sim/traceparents` for tests), and with
//! `--otlp-traces-endpoint` the request gets an engine span (`llm_request`, vLLM's name) whose
//! parent is the caller's span: arrival to the response's last byte, with the first body byte as
//! an event. A request without a valid `traceparent` starts its own trace; one whose parent is not
//! sampled exports nothing (parent-based, the OpenTelemetry SDK's default).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use kvgate_http::otlp::{Exporter, Hooks};
use kvgate_protocol::otlp::{EventRecord, Kind, SpanRecord, Value};
use kvgate_protocol::trace_context::TraceParent;
use parking_lot::Mutex;

use super::Body;

/// `traceparent` values kept for `/sim/traceparents`.
pub const KEEP: usize = 1024;

/// The worker's trace state: received headers and the optional exporter.
pub struct Traces {
    seen: Mutex<VecDeque<String>>,
    exporter: Option<Exporter>,
    model: Arc<str>,
}

impl Traces {
    /// With an exporter to `endpoint` (started on the current runtime) when given.
    pub fn new(
        endpoint: Option<&str>,
        model: &str,
        cancel: tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<Traces> {
        let exporter = match endpoint {
            None => None,
            Some(e) => {
                let target = kvgate_http::otlp::Target::parse(e)
                    .map_err(|why| anyhow::anyhow!("--otlp-traces-endpoint: {why}"))?;
                Some(
                    Exporter::start(
                        kvgate_http::otlp::Config {
                            target,
                            ca_file: None,
                            queue: 1024,
                            max_batch: 256,
                            delay: std::time::Duration::from_millis(200),
                            timeout: std::time::Duration::from_secs(5),
                            resource: vec![("service.name", Value::from("kvgate-sim"))],
                            scope: "kvgate-sim",
                            version: env!("CARGO_PKG_VERSION"),
                        },
                        Hooks::none(),
                        cancel,
                    )
                    .map_err(|why| anyhow::anyhow!("--otlp-traces-endpoint: {why}"))?,
                )
            }
        };
        Ok(Traces {
            seen: Mutex::new(VecDeque::new()),
            exporter,
            model: Arc::from(model),
        })
    }

    /// The `traceparent`s received, oldest first.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().iter().cloned().collect()
    }

    /// A completion request arrived: record its `traceparent` and, when exporting, open its span.
    pub fn arrived(&self, headers: &HeaderMap, path: &str) -> Option<Pending> {
        let tp = headers.get("traceparent");
        if let Some(v) = tp {
            let mut seen = self.seen.lock();
            if seen.len() == KEEP {
                seen.pop_front();
            }
            seen.push_back(String::from_utf8_lossy(v.as_bytes()).into_owned());
        }
        let exporter = self.exporter.clone()?;
        let parent = tp.and_then(|v| TraceParent::parse(v.as_bytes()).ok());
        if parent.is_some_and(|p| !p.sampled()) {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        loop {
            fastrand::fill(&mut span_id);
            fastrand::fill(&mut trace_id);
            if span_id != [0; 8] && trace_id != [0; 16] {
                break;
            }
        }
        Some(Pending {
            exporter,
            span: SpanRecord {
                trace_id: parent.map_or(trace_id, |p| p.trace_id),
                span_id,
                parent_id: parent.map(|p| p.parent_id),
                remote_parent: parent.is_some(),
                trace_state: None,
                flags: 1,
                name: "llm_request",
                kind: Kind::Server,
                start_ns: unix_ns(),
                end_ns: 0,
                attrs: vec![
                    ("gen_ai.request.model", Value::from(self.model.clone())),
                    ("gen_ai.system", Value::from("vllm")),
                    ("url.path", Value::from(path.to_owned())),
                ],
                events: Vec::new(),
                error: None,
            },
        })
    }
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// An engine span waiting for its response to end.
pub struct Pending {
    exporter: Exporter,
    span: SpanRecord,
}

impl Pending {
    /// Wrap the response: the span ends with its body (or when the body is dropped early).
    pub fn wrap(mut self, resp: Response<Body>) -> Response<Body> {
        let status = resp.status();
        self.span.attrs.push((
            "http.response.status_code",
            Value::from(u32::from(status.as_u16())),
        ));
        if status.is_server_error() {
            self.span.error = Some(format!("answered {status}").into());
        }
        let (parts, body) = resp.into_parts();
        let traced = TracedBody {
            inner: body,
            pending: Some(self),
            first: false,
        };
        Response::from_parts(parts, traced.boxed_unsync())
    }

    fn end(mut self, complete: bool) {
        self.span.end_ns = unix_ns();
        if !complete && self.span.error.is_none() {
            self.span.error = Some("the response was cut off".into());
        }
        self.exporter.submit(vec![self.span]);
    }
}

struct TracedBody {
    inner: Body,
    pending: Option<Pending>,
    first: bool,
}

impl http_body::Body for TracedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(f))) if !this.first && f.is_data() => {
                this.first = true;
                if let Some(p) = &mut this.pending {
                    p.span.events.push(EventRecord {
                        name: "first_byte",
                        time_ns: unix_ns(),
                        attrs: Vec::new(),
                    });
                }
            }
            Poll::Ready(None) => {
                if let Some(p) = this.pending.take() {
                    p.end(true);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(p) = this.pending.take() {
                    p.end(false);
                }
            }
            _ => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TracedBody {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            // hyper stops polling a body that says it has ended: that is a complete response.
            let complete = self.inner.is_end_stream();
            p.end(complete);
        }
    }
}
