//! One ext_proc stream = one HTTP request through the gateway (Envoy): the picker's side of the
//! conversation, message by message (docs/epp.md has the sequence).
//!
//! Request side. FULL_DUPLEX_STREAMED: the request headers are held; body chunks are collected
//! until `end_of_stream`; then the request is authenticated, its model rewritten
//! (`rewrite.rs`), and prepared by the front door's own `proxy::prepare_read` (its client API by
//! `:path`, the prompt rendered and hashed, stored-response pins, session, flow-control key),
//! routed by the decision core (the same `Decider::reserve` as the front door: index, load,
//! latency model, flow control's admission queue), and answered: the headers response carries
//! `traceparent` for the worker and `x-gateway-destination-endpoint`
//! (the pick and up to `epp.fallback_endpoints − 1` fallbacks, in order) and the same value under
//! dynamic metadata `envoy.lb`, then the body goes back as `streamed_response` chunks of at most
//! 62,000 bytes. BUFFERED: the headers are answered at once (control headers stripped), the
//! whole body arrives in one message and its answer carries the destination. A bodiless request
//! is picked by load as soon as its headers arrive.
//!
//! Response side. The reservation (the load on the worker) lives until the response body ends:
//! response chunks feed an `Observation` (TTFT, ITL, usage, cached tokens, the latency model, the
//! request log) and are echoed. `envoy.lb/x-gateway-destination-endpoint-served` moves the
//! accounting to the endpoint that actually served when Envoy fell back. A stream that ends early
//! (Envoy cancelled it, the connection broke) drops the conversation, which releases everything.
//!
//! This file is the message sequence and the response side; `conversation/pick.rs` decides.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};

mod pick;

use pick::Picked;

use super::grpc::{Code, Status};
use super::pb::{self, BodySendMode, ProcessingRequest, ProcessingResponse, Request};
use super::{rewrite, Epp};
use crate::client_api::{Endpoint, ErrorShape};
use crate::ctx::{Outcome, RequestCtx};
use crate::error::{ErrorKind, GatewayError};
use crate::observer::Observation;
use crate::registry::{Pool, Worker};
use crate::route::router::DispatchGuard;
use crate::route::RouteInput;

/// The destination header and metadata key (GAIE protocol).
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The endpoint that served, reported by the gateway in metadata `envoy.lb`.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the destination and the served endpoint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The subset hint: `filter_metadata[SUBSET_NAMESPACE][SUBSET_KEY]`.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Body chunks sent back to Envoy are at most this long (GAIE/llm-d's split, under 64 KiB).
pub const CHUNK: usize = 62_000;
/// Request headers a client must not set: they steer the gateway or claim what served. Removed
/// from the request before it goes upstream (ours overwrites the destination).
pub const CONTROL_HEADERS: [&str; 3] = [
    SERVED,
    "x-gateway-destination-endpoint-fallback",
    "x-gateway-destination-endpoint-subset",
];
/// llm-d's P/D sidecar convention: the prefill worker of a disaggregated request.
pub const PREFILLER: &str = "x-prefiller-host-port";
/// The model header Body-Based Routing sets: the pool of a bodiless request.
pub const MODEL_HEADER: &str = "x-gateway-model-name";

/// Where the conversation is.
enum Phase {
    /// Nothing yet.
    Start,
    /// Request headers received; collecting the body.
    Body,
    /// Routed; waiting for the response headers.
    Routed,
    /// The response body is being observed.
    Response,
    /// Answered for good (response ended, or an immediate response was sent): anything further
    /// is ignored.
    Done,
}

/// What a picked request holds until its response ends.
// Not boxed: one per stream, set twice in its life.
#[allow(clippy::large_enum_variant)]
enum Held {
    None,
    /// A request of a client API: its context (load guard, timings) before the response, its
    /// observation after.
    Api {
        ctx: Option<Box<RequestCtx>>,
        obs: Option<Observation>,
    },
    /// Any other request (bodiless, another path): the load only (held for its drop).
    Load(#[allow(dead_code)] DispatchGuard),
}

/// The routing facts kept for the served-endpoint correction.
struct Routed {
    pool: Arc<Pool>,
    input: RouteInput,
    /// The endpoints sent to the gateway, in order.
    endpoints: Vec<(Arc<Worker>, SocketAddr)>,
}

pub struct Conversation {
    epp: Arc<Epp>,
    start: Instant,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    phase: Phase,
    headers: pb::HeaderMap,
    metadata: Option<pb::Metadata>,
    body: BytesMut,
    held: Held,
    routed: Option<Routed>,
    /// The request's body went back in pieces ending with `end_of_stream` (FULL_DUPLEX).
    streams_request: bool,
    /// A disaggregated request's prefill worker (`x-prefiller-host-port`) and its load.
    prefill: Option<(SocketAddr, DispatchGuard)>,
    /// How local replies look (the request's API's error shape: Anthropic's for Messages).
    shape: ErrorShape,
    /// The trace's upstream span, open until the response headers arrive.
    attempt: Option<crate::trace::Attempt>,
    /// `DELETE /v1/responses/{id}`: the id whose pin goes when the worker answers 2xx.
    forget: Option<String>,
    /// The model rewrite applied to the request (the response gets the client's name back).
    rewritten: Option<rewrite::Rewritten>,
}

type Answer = Result<Vec<ProcessingResponse>, Status>;

impl Conversation {
    pub fn new(epp: Arc<Epp>) -> Conversation {
        Conversation {
            epp,
            start: crate::clock::now(),
            // Until protocol_config says otherwise: what GAIE gateways configure.
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            phase: Phase::Start,
            headers: pb::HeaderMap::default(),
            metadata: None,
            body: BytesMut::new(),
            held: Held::None,
            routed: None,
            streams_request: true,
            prefill: None,
            shape: ErrorShape::OpenAi,
            attempt: None,
            forget: None,
            rewritten: None,
        }
    }

    /// The client API of the request's `:path`, if any.
    fn endpoint(&self) -> Option<Endpoint> {
        let path = self.headers.get(":path")?;
        let path = std::str::from_utf8(path).ok()?;
        Endpoint::by_path(path.split('?').next().unwrap_or(""))
    }

    /// Whether the conversation is over (the response ended or a local reply was sent).
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// One message from the gateway; the answers to send, in order, or the gRPC error that ends
    /// the stream (a message out of order or malformed).
    pub async fn handle(&mut self, msg: ProcessingRequest) -> Answer {
        if let Some(pc) = msg.protocol_config {
            if !matches!(self.phase, Phase::Start) {
                return Err(invalid("protocol_config after the first message"));
            }
            self.request_mode = mode(pc.request_body_mode, "request_body_mode")?;
            self.response_mode = mode(pc.response_body_mode, "response_body_mode")?;
        }
        if let Some(md) = msg.metadata_context {
            self.metadata = Some(md);
        }
        if self.is_done() {
            // After an immediate response Envoy may still deliver what it had in flight.
            return Ok(Vec::new());
        }
        let Some(req) = msg.request else {
            return Err(invalid("a ProcessingRequest without a request"));
        };
        match req {
            Request::RequestHeaders(h) => self.request_headers(h).await,
            Request::RequestBody(b) => self.request_body(b).await,
            Request::RequestTrailers(_) => self.request_trailers().await,
            Request::ResponseHeaders(h) => self.response_headers(h),
            Request::ResponseBody(b) => self.response_body(b),
            Request::ResponseTrailers(_) => self.response_trailers(),
        }
    }

    async fn request_headers(&mut self, h: pb::HttpHeaders) -> Answer {
        if !matches!(self.phase, Phase::Start) {
            return Err(invalid("request_headers twice"));
        }
        self.start = crate::clock::now();
        self.headers = h.headers.unwrap_or_default();
        self.phase = Phase::Body;
        // Local replies from here on (a body over the limit) take the API's error shape.
        if let Some(ep) = self.endpoint() {
            self.shape = ep.api().errors;
        }
        if h.end_of_stream || self.request_mode == BodySendMode::None {
            // No body will come: pick now, by load.
            self.streams_request = false;
            return Ok(self.route(None).await);
        }
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => Ok(Vec::new()),
            BodySendMode::Buffered => {
                // Envoy waits for this answer before it sends the body.
                self.streams_request = false;
                Ok(vec![headers_response(strip_only(), None)])
            }
            other => Err(Status::new(
                Code::FailedPrecondition,
                format!(
                    "request_body_mode {other:?} is not supported: configure FULL_DUPLEX_STREAMED (or BUFFERED)"
                ),
            )),
        }
    }

    async fn request_body(&mut self, b: pb::HttpBody) -> Answer {
        if !matches!(self.phase, Phase::Body) {
            return Err(invalid("request_body outside the request body phase"));
        }
        if self.body.len() + b.body.len() > self.epp.proxy.max_body {
            let e = GatewayError::new(
                ErrorKind::PayloadTooLarge {
                    limit: self.epp.proxy.max_body,
                },
                format!(
                    "request body exceeds the limit of {} bytes",
                    self.epp.proxy.max_body
                ),
            );
            return Ok(vec![self.immediate(e)]);
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            if self.request_mode == BodySendMode::Buffered {
                return Err(Status::new(
                    Code::FailedPrecondition,
                    "BUFFERED request body without end_of_stream (BUFFERED_PARTIAL is not supported)",
                ));
            }
            return Ok(Vec::new());
        }
        let body = std::mem::take(&mut self.body).freeze();
        Ok(self.route(Some(body)).await)
    }

    async fn request_trailers(&mut self) -> Answer {
        match self.phase {
            // Trailers end a FULL_DUPLEX body that had no end_of_stream chunk.
            Phase::Body if self.streams_request => {
                let body = std::mem::take(&mut self.body).freeze();
                let mut out = self.route_with(Some(body), false).await;
                if !self.is_done() {
                    out.push(ProcessingResponse {
                        response: Some(pb::Response::RequestTrailers(Default::default())),
                        dynamic_metadata: None,
                    });
                }
                Ok(out)
            }
            _ => Ok(vec![ProcessingResponse {
                response: Some(pb::Response::RequestTrailers(Default::default())),
                dynamic_metadata: None,
            }]),
        }
    }

    async fn route(&mut self, body: Option<Bytes>) -> Vec<ProcessingResponse> {
        self.route_with(body, true).await
    }

    /// Decide and answer. `body_ends`: the echoed body's last chunk carries `end_of_stream`.
    async fn route_with(
        &mut self,
        body: Option<Bytes>,
        body_ends: bool,
    ) -> Vec<ProcessingResponse> {
        let result = match (self.endpoint(), &body) {
            (Some(ep), Some(b)) if !b.is_empty() => self.route_api(ep, b.clone()).await,
            // GET / DELETE of a stored response: its origin worker, as at the front door.
            (Some(ep), _) if ep == Endpoint::STORED_RESPONSE => {
                self.route_api(ep, Bytes::new()).await
            }
            _ => self.route_by_load().await.map(|value| Picked {
                value,
                ..Picked::default()
            }),
        };
        let picked = match result {
            Ok(x) => x,
            Err(e) => return vec![self.immediate(e)],
        };
        self.phase = Phase::Routed;
        let Picked {
            value,
            body: changed,
            mut set,
            mut remove,
        } = picked;
        set.push(pb::set_header(DESTINATION, value.clone()));
        remove.extend(CONTROL_HEADERS.iter().map(|h| h.to_string()));
        match &self.prefill {
            Some((addr, _)) => set.push(pb::set_header(PREFILLER, addr.to_string())),
            None => remove.push(PREFILLER.into()),
        }
        if let Some(b) = changed
            .as_ref()
            .or(body.as_ref().filter(|_| self.streams_request))
        {
            set.push(pb::set_header("content-length", b.len().to_string()));
        }
        let mutation = pb::HeaderMutation {
            set_headers: set,
            remove_headers: remove,
        };
        let metadata = Some(destination_metadata(&value));
        let mut out = Vec::new();
        if !self.streams_request && body.is_some() {
            // BUFFERED: the body message's answer carries the destination (the headers were
            // answered already), and the new body when it changed.
            out.push(ProcessingResponse {
                response: Some(pb::Response::RequestBody(pb::BodyResponse {
                    response: Some(pb::CommonResponse {
                        header_mutation: Some(mutation),
                        clear_route_cache: true,
                        body_mutation: changed.map(|b| pb::BodyMutation {
                            mutation: Some(pb::Mutation::Body(b)),
                        }),
                        ..Default::default()
                    }),
                })),
                dynamic_metadata: metadata,
            });
            return out;
        }
        out.push(headers_response(mutation, metadata));
        if let (true, Some(b)) = (self.streams_request, changed.or(body)) {
            push_chunks(&mut out, &b, body_ends, true);
        }
        out
    }

    fn response_headers(&mut self, h: pb::HttpHeaders) -> Answer {
        if !matches!(self.phase, Phase::Routed) {
            return Err(invalid("response_headers before the request was answered"));
        }
        let headers = h.headers.unwrap_or_default();
        let status = headers
            .get(":status")
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        // The prefill ran before the decode worker answered.
        self.prefill = None;
        self.correct_served(status);
        let sse = headers
            .get("content-type")
            .is_some_and(|v| v.starts_with(b"text/event-stream"));
        let duplex = self.response_mode == BodySendMode::FullDuplexStreamed;
        // We may strip the usage event we asked for, or give the response its model name back:
        // the length would be wrong.
        let resized = (sse
            && matches!(&self.held, Held::Api { ctx: Some(c), .. } if c.strip_usage))
            || (duplex && self.rewritten.is_some());
        if (200..300).contains(&status) {
            if let Some(id) = self.forget.take() {
                self.epp.proxy.pins.forget(&id);
            }
        }
        let out = vec![ProcessingResponse {
            response: Some(pb::Response::ResponseHeaders(pb::HeadersResponse {
                response: Some(pb::CommonResponse {
                    header_mutation: resized.then(|| pb::HeaderMutation {
                        set_headers: Vec::new(),
                        remove_headers: vec!["content-length".into()],
                    }),
                    ..Default::default()
                }),
            })),
            dynamic_metadata: None,
        }];
        if let Held::Api { ctx, obs } = &mut self.held {
            if let Some(mut c) = ctx.take() {
                c.trace
                    .attempt_end(self.attempt.take(), crate::trace::Ended::Status(status));
                c.status = status;
                *obs = Some(Observation::new(c, sse));
            }
        }
        self.phase = Phase::Response;
        if h.end_of_stream || self.response_mode == BodySendMode::None {
            // No body to watch: the response ends here (with body mode NONE Envoy closes the
            // stream now, so this is the last we learn of it).
            self.finish_ok();
        }
        Ok(out)
    }

    /// The served endpoint (Envoy's `selected_host_key`), when it is not the pick: the load
    /// moves there, and the endpoints tried before it count as failures for their breakers.
    fn correct_served(&mut self, status: u16) {
        let now = crate::clock::now();
        let served = self
            .metadata
            .as_ref()
            .and_then(|m| m.field(LB_NAMESPACE, SERVED))
            .and_then(|v| match &v.kind {
                Some(pb::Kind::StringValue(s)) => s.trim().parse::<SocketAddr>().ok(),
                _ => None,
            });
        let Some(routed) = &self.routed else { return };
        let picked = routed.endpoints.first().map(|(_, a)| *a);
        let server_error = (500..600).contains(&status);
        let serving = match served {
            Some(s) if Some(s) != picked => {
                self.epp.proxy.metrics.epp.served_elsewhere.inc();
                let pos = routed.endpoints.iter().position(|(_, a)| *a == s);
                for (w, _) in &routed.endpoints[..pos.unwrap_or(routed.endpoints.len())] {
                    w.state.record_outcome(false, now);
                }
                let worker = routed
                    .pool
                    .workers
                    .iter()
                    .find(|w| super::endpoint_of(w) == Some(s))
                    .cloned();
                let moved = worker.as_ref().map(|w| {
                    self.epp
                        .proxy
                        .decider
                        .reserve_on(&routed.pool, &routed.input, w, now)
                        .guard
                });
                match &mut self.held {
                    Held::Api { ctx: Some(c), .. } => {
                        c.attempts = pos.map_or(c.attempts + 1, |p| p as u32 + 1);
                        // The old load goes first (a queued request may be waiting for it).
                        c.guard = None;
                        c.guard = moved;
                        c.worker = worker.clone();
                    }
                    Held::Load(_) | Held::None => {
                        self.held = match moved {
                            Some(g) => Held::Load(g),
                            None => Held::None,
                        };
                    }
                    Held::Api { ctx: None, .. } => {}
                }
                worker
            }
            _ => routed.endpoints.first().map(|(w, _)| w.clone()),
        };
        if let Some(w) = serving {
            // A worker shedding load (429) is alive; 5xx counts against its breaker.
            w.state.record_outcome(!server_error, now);
        }
    }

    fn response_body(&mut self, b: pb::HttpBody) -> Answer {
        if !matches!(self.phase, Phase::Response) {
            return Err(invalid("response_body before response_headers"));
        }
        let duplex = self.response_mode == BodySendMode::FullDuplexStreamed;
        let mut out_bytes = b.body.clone();
        if let Held::Api { obs: Some(o), .. } = &mut self.held {
            o.observe(&b.body, Some(crate::clock::now()));
            if let Some(x) = o.take_out() {
                out_bytes = x;
            }
            if b.end_of_stream {
                if let Some(held) = o.take_held() {
                    let mut all = BytesMut::from(&out_bytes[..]);
                    all.extend_from_slice(&held);
                    out_bytes = all.freeze();
                }
            }
        }
        if let (true, Some(r)) = (duplex, &self.rewritten) {
            if let Some(x) = rewrite::restore(&out_bytes, r) {
                out_bytes = x;
            }
        }
        if b.end_of_stream {
            self.finish_ok();
        }
        let mut out = Vec::new();
        if duplex {
            if !out_bytes.is_empty() || b.end_of_stream {
                push_chunks(&mut out, &out_bytes, b.end_of_stream, false);
            }
        } else {
            // STREAMED / BUFFERED: one answer per message, the body left as it is.
            out.push(ProcessingResponse {
                response: Some(pb::Response::ResponseBody(pb::BodyResponse {
                    response: Some(pb::CommonResponse::default()),
                })),
                dynamic_metadata: None,
            });
        }
        Ok(out)
    }

    fn response_trailers(&mut self) -> Answer {
        if !matches!(self.phase, Phase::Response) {
            return Err(invalid("response_trailers before response_headers"));
        }
        self.finish_ok();
        Ok(vec![ProcessingResponse {
            response: Some(pb::Response::ResponseTrailers(Default::default())),
            dynamic_metadata: None,
        }])
    }

    /// The response ended: record it and release the load.
    fn finish_ok(&mut self) {
        match std::mem::replace(&mut self.held, Held::None) {
            Held::Api {
                obs: Some(mut o), ..
            } => o.finish_ok(),
            Held::Api {
                ctx: Some(mut c), ..
            } => c.finish(Outcome::Complete),
            _ => {}
        }
        self.phase = Phase::Done;
    }

    /// A rejected client-API request: recorded (as the front door's `proxy::reject`, with the
    /// status its API's clients get) and returned.
    fn reject(&self, mut ctx: Box<RequestCtx>, e: GatewayError) -> GatewayError {
        ctx.status = e.status_for(self.shape).as_u16();
        ctx.error = Some(e.label());
        ctx.finish(Outcome::Rejected);
        e
    }

    /// A local reply for `e` (the one mapping of gateway errors to HTTP), ending the request.
    fn immediate(&mut self, e: GatewayError) -> ProcessingResponse {
        self.phase = Phase::Done;
        self.held = Held::None;
        self.prefill = None;
        // The rest of the stream is ignored: do not keep a refused body for its lifetime.
        self.body = BytesMut::new();
        // The front door's one mapping, in the request's API's shape (Anthropic: 529 for sheds).
        let body = e.json_for(self.shape);
        let details = format!("kvgate_{}", e.label().as_str());
        let resp = e.into_response_for(self.shape);
        let status = resp.status().as_u16();
        let m = &self.epp.proxy.metrics;
        m.epp
            .immediate
            .get_or_create(&super::StatusLabel { status })
            .inc();
        let set = resp
            .headers()
            .iter()
            .map(|(k, v)| pb::set_header(k.as_str(), v.as_bytes()))
            .collect();
        ProcessingResponse {
            response: Some(pb::Response::ImmediateResponse(pb::ImmediateResponse {
                status: Some(pb::HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(pb::HeaderMutation {
                    set_headers: set,
                    remove_headers: Vec::new(),
                }),
                body,
                details,
            })),
            dynamic_metadata: None,
        }
    }
}

impl Drop for Conversation {
    fn drop(&mut self) {
        // The stream ended before the response did (Envoy cancelled it, or it broke): a stream
        // that had delivered its `[DONE]` completed, anything else was cancelled. Either way the
        // load is released here.
        match &mut self.held {
            Held::Api { obs: Some(o), .. } => o.dropped(),
            Held::Api { ctx: Some(c), .. } => c.trace.attempt_end(
                self.attempt.take(),
                crate::trace::Ended::Error("cancelled", "the stream ended before the response"),
            ),
            _ => {}
        }
    }
}

fn invalid(what: &str) -> Status {
    Status::new(Code::InvalidArgument, format!("ext_proc: {what}"))
}

fn mode(m: i32, field: &str) -> Result<BodySendMode, Status> {
    BodySendMode::try_from(m).map_err(|_| invalid(&format!("unknown {field} {m}")))
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": value}}`.
fn destination_metadata(value: &str) -> pb::Struct {
    let mut lb = pb::Struct::default();
    lb.fields
        .insert(DESTINATION.into(), pb::Value::string(value));
    let mut md = pb::Struct::default();
    md.fields.insert(
        LB_NAMESPACE.into(),
        pb::Value {
            kind: Some(pb::Kind::StructValue(lb)),
        },
    );
    md
}

/// The control headers removed, nothing set.
fn strip_only() -> pb::HeaderMutation {
    pb::HeaderMutation {
        set_headers: Vec::new(),
        // BUFFERED: the destination is set later, by the body's answer.
        remove_headers: CONTROL_HEADERS
            .iter()
            .chain([&DESTINATION, &PREFILLER])
            .map(|h| h.to_string())
            .collect(),
    }
}

fn headers_response(
    mutation: pb::HeaderMutation,
    metadata: Option<pb::Struct>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(pb::Response::RequestHeaders(pb::HeadersResponse {
            response: Some(pb::CommonResponse {
                header_mutation: Some(mutation),
                clear_route_cache: metadata.is_some(),
                ..Default::default()
            }),
        })),
        dynamic_metadata: metadata,
    }
}

/// `body` as `streamed_response` chunks of at most [`CHUNK`] bytes (one empty chunk for an
/// empty body), the last with `end_of_stream = ends`.
fn push_chunks(out: &mut Vec<ProcessingResponse>, body: &Bytes, ends: bool, request: bool) {
    let n = body.len().div_ceil(CHUNK).max(1);
    for i in 0..n {
        let part = body.slice((i * CHUNK).min(body.len())..((i + 1) * CHUNK).min(body.len()));
        let br = pb::BodyResponse {
            response: Some(pb::CommonResponse {
                body_mutation: Some(pb::BodyMutation {
                    mutation: Some(pb::Mutation::StreamedResponse(pb::StreamedBodyResponse {
                        body: part,
                        end_of_stream: ends && i + 1 == n,
                    })),
                }),
                ..Default::default()
            }),
        };
        out.push(ProcessingResponse {
            response: Some(if request {
                pb::Response::RequestBody(br)
            } else {
                pb::Response::ResponseBody(br)
            }),
            dynamic_metadata: None,
        });
    }
}
