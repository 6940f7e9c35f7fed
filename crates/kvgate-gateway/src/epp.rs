//! The Envoy ext_proc endpoint picker (`kvgate epp`, docs/epp.md): a Gateway API Inference
//! Extension EPP. A gateway (Envoy, Envoy Gateway, kgateway, Istio, ...) calls
//! `envoy.service.ext_proc.v3.ExternalProcessor/Process` once per HTTP request; kvgate picks the
//! worker with the same decision core, load accounting, latency model and metrics as the front
//! door, and the gateway proxies.
//!
//! - `grpc.rs`: gRPC framing over hyper's HTTP/2 server (no tonic, no protoc).
//! - `pb.rs`: the protobuf messages (hand-written prost structs, the subset used).
//! - `conversation.rs`: one stream's conversation (request → pick → response accounting).
//! - `health.rs`: `grpc.health.v1.Health/Check` (`liveness`, `readiness`, the ext_proc service).
//! - `rewrite.rs`: model rewrites (`[[epp.model_rewrites]]`, llm-d's `InferenceModelRewrite`).

pub mod conversation;
pub mod grpc;
mod health;
pub mod pb;
pub mod rewrite;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::EppConfig;
use crate::ctx::Telemetry;
use crate::metrics::EndLabel;
use crate::proxy::Proxy;
use crate::registry::Worker;
use conversation::Conversation;
use grpc::{CallBody, Code, Decoder, Out, Status};
pub use rewrite::ModelRewrites;

pub use crate::metrics::{KindLabel, StatusLabel};

/// The ext_proc method's HTTP/2 path.
pub const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";
/// The health check method's path.
pub const HEALTH_PATH: &str = "/grpc.health.v1.Health/Check";
/// The ext_proc service name (also a health service).
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// What the endpoint picker sees of the gateway: the decision component, the fleet, the request
/// accounting, its settings, and whether the gateway is ready (health `readiness`).
pub struct Epp {
    /// The front door's slice (decision core, fleet, auth, response pins, metrics, the body
    /// limit): the picker prepares and decides with the front door's own functions.
    pub proxy: Arc<Proxy>,
    pub telemetry: Arc<Telemetry>,
    pub settings: EppConfig,
    /// `epp.model_rewrites`, compiled.
    pub rewrites: ModelRewrites,
    pub ready: Box<dyn Fn() -> bool + Send + Sync>,
}

/// The `ip:port` Envoy connects to for `w` (IPv6 as `[addr]:port`); `None` when the worker's
/// address is a host name (Envoy's destination must be an address: list such workers by IP).
pub fn endpoint_of(w: &Worker) -> Option<SocketAddr> {
    w.authority.as_str().parse().ok()
}

/// Serve ext_proc on `listener` until `shutdown`, then let open streams finish for up to
/// `grace`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    epp: Arc<Epp>,
    shutdown: CancellationToken,
    grace: Duration,
) {
    for w in epp.proxy.fleet.registry.snapshot().workers.iter() {
        if endpoint_of(w).is_none() {
            tracing::warn!(
                worker = %w.name,
                "worker has no ip:port address: the endpoint picker cannot send Envoy there"
            );
        }
    }
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .max_concurrent_streams(4096)
        // Long-lived connections from the gateway: notice a dead peer.
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20));
    let h2 = Arc::new(h2);
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "epp: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (epp, h2, tls) = (epp.clone(), h2.clone(), tls.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let epp = epp.clone();
                async move { Ok::<_, std::convert::Infallible>(call(epp, req)) }
            });
            let result = match tls {
                Some(acceptor) => {
                    let s = match tokio::time::timeout(
                        Duration::from_secs(10),
                        acceptor.accept(stream),
                    )
                    .await
                    {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "epp: TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    };
                    watcher
                        .watch(h2.serve_connection(TokioIo::new(s), svc))
                        .await
                }
                None => {
                    watcher
                        .watch(h2.serve_connection(TokioIo::new(stream), svc))
                        .await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "epp: connection ended");
            }
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(grace) => {}
    }
}

/// One gRPC call: its response head at once, its messages and trailers from the call's task.
fn call(epp: Arc<Epp>, req: Request<Incoming>) -> Response<CallBody> {
    let (tx, rx) = mpsc::channel(32);
    let grpc = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let path = req.uri().path().to_owned();
    if !grpc || req.method() != http::Method::POST {
        let _ = tx.try_send(Out::End(Some(Status::new(
            Code::InvalidArgument,
            "not a gRPC request (POST with content-type application/grpc)",
        ))));
    } else {
        match path.as_str() {
            PROCESS_PATH => {
                tokio::spawn(process(epp, req.into_body(), tx));
            }
            HEALTH_PATH => {
                tokio::spawn(health::check(epp, req.into_body(), tx));
            }
            _ => {
                let _ = tx.try_send(Out::End(Some(Status::new(
                    Code::Unimplemented,
                    format!("unknown method {path}"),
                ))));
            }
        }
    }
    let mut r = Response::new(CallBody::new(rx));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    r
}

/// Reads a call's messages in order, at most `max` bytes each.
pub(crate) struct Messages {
    body: Incoming,
    dec: Decoder,
}

/// Why a call's messages stopped.
pub(crate) enum Stop {
    /// The peer half-closed the stream after a whole message: the call ends OK.
    End,
    /// The peer reset the stream (or the connection broke): nobody is listening.
    Reset,
    /// A protocol error: the call ends with this status.
    Error(Status),
}

impl Messages {
    pub(crate) fn new(body: Incoming, max: usize) -> Messages {
        Messages {
            body,
            dec: Decoder::new(max),
        }
    }

    pub(crate) async fn next<M: Message + Default>(&mut self) -> Result<M, Stop> {
        loop {
            match self.dec.next_message() {
                Ok(Some(bytes)) => {
                    return M::decode(bytes).map_err(|e| {
                        Stop::Error(Status::new(
                            Code::InvalidArgument,
                            format!("malformed protobuf message: {e}"),
                        ))
                    })
                }
                Ok(None) => {}
                Err(s) => return Err(Stop::Error(s)),
            }
            match self.body.frame().await {
                None if self.dec.pending() > 0 => {
                    return Err(Stop::Error(Status::new(
                        Code::InvalidArgument,
                        format!(
                            "the stream ended inside a message ({} bytes of it)",
                            self.dec.pending()
                        ),
                    )))
                }
                None => return Err(Stop::End),
                Some(Err(_)) => return Err(Stop::Reset),
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.dec.push(&data);
                    }
                }
            }
        }
    }
}

/// The `Process` call: one conversation.
async fn process(epp: Arc<Epp>, body: Incoming, tx: mpsc::Sender<Out>) {
    let m = epp.proxy.metrics.clone();
    m.epp.streams_open.inc();
    let _open = scopeguard(move || {
        m.epp.streams_open.dec();
    });
    let mut conv = Conversation::new(epp.clone());
    let mut msgs = Messages::new(body, epp.settings.max_message_bytes);
    let stop = loop {
        let msg: pb::ProcessingRequest = match msgs.next().await {
            Ok(m) => m,
            Err(stop) => break stop,
        };
        let answers = tokio::select! {
            a = conv.handle(msg) => a,
            // Envoy reset the stream while we were queueing for a worker.
            _ = tx.closed() => break Stop::Reset,
        };
        let answers = match answers {
            Ok(a) => a,
            Err(s) => break Stop::Error(s),
        };
        let mut sent = true;
        for a in answers {
            if tx.send(Out::Message(grpc::encode(&a))).await.is_err() {
                sent = false;
                break;
            }
        }
        if !sent {
            break Stop::Reset;
        }
    };
    // Release the request's load before answering the stream's end.
    drop(conv);
    let (end, status) = match stop {
        Stop::Reset => ("cancelled", None),
        Stop::End => ("ok", None),
        Stop::Error(s) => (s.label(), Some(s)),
    };
    epp.proxy
        .metrics
        .epp
        .streams
        .get_or_create(&EndLabel { end })
        .inc();
    if end != "cancelled" {
        if let Some(s) = &status {
            tracing::debug!(status = %s, "epp: stream ended with an error");
        }
        let _ = tx.send(Out::End(status)).await;
    }
}

/// Runs `f` when dropped.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct G<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for G<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f()
            }
        }
    }
    G(Some(f))
}
