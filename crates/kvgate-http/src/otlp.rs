//! The OTLP trace exporter: finished spans go into a bounded queue (`submit` never waits: a full
//! queue drops the batch and counts it), and one task batches them (by size or after a delay) and
//! sends each batch to the collector:
//! - `http://host:port[/base]`: OTLP/HTTP, protobuf `POST {base}/v1/traces`;
//! - `grpc://host:port`: OTLP/gRPC over HTTP/2 (cleartext), the length-prefixed message `POST`ed
//!   to `/opentelemetry.proto.collector.trace.v1.TraceService/Export`, `grpc-status` read from the
//!   trailers (or the head of a trailers-only answer);
//! - `https://…` and `grpcs://…`: the same over TLS (rustls, as `https://` workers; ALPN
//!   `http/1.1` and `h2`), trusting `Config::ca_file` or the system's bundle.
//!
//! One connection at a time, made again after any error. A collector that is down or slow costs
//! the spans (counted as failed, or dropped when the queue fills), never a request.

use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::uri::Authority;
use http::{header, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvgate_protocol::otlp::{encode_request, rejected_spans, SpanRecord, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const GRPC_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";
/// Largest collector answer read (an export response is a few bytes).
const MAX_ANSWER: usize = 64 << 10;

/// Where spans go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// OTLP/HTTP: `POST http(s)://{authority}{path}` (path ends in `/v1/traces`).
    Http {
        authority: Authority,
        path: String,
        tls: bool,
    },
    /// OTLP/gRPC over HTTP/2, cleartext or TLS.
    Grpc { authority: Authority, tls: bool },
}

impl Target {
    /// Whether the collector is reached over TLS (`https://`, `grpcs://`).
    pub fn tls(&self) -> bool {
        match self {
            Target::Http { tls, .. } | Target::Grpc { tls, .. } => *tls,
        }
    }

    fn authority(&self) -> &Authority {
        match self {
            Target::Http { authority, .. } | Target::Grpc { authority, .. } => authority,
        }
    }

    /// `http://host:port[/base]` or `grpc://host:port`; `https://` and `grpcs://` for TLS.
    pub fn parse(s: &str) -> Result<Target, String> {
        let uri: http::Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("{s:?} has no host:port"))?;
        if authority.port_u16().is_none() {
            return Err(format!("{s:?} has no port"));
        }
        match uri.scheme_str() {
            Some(scheme @ ("http" | "https")) => {
                if uri.query().is_some() {
                    return Err(format!("{s:?}: a query is not allowed"));
                }
                let base = uri.path().trim_end_matches('/');
                Ok(Target::Http {
                    authority,
                    path: format!("{base}/v1/traces"),
                    tls: scheme == "https",
                })
            }
            Some(scheme @ ("grpc" | "grpcs")) => {
                if !matches!(uri.path(), "" | "/") {
                    return Err(format!("{s:?}: a {scheme}:// endpoint has no path"));
                }
                Ok(Target::Grpc {
                    authority,
                    tls: scheme == "grpcs",
                })
            }
            _ => Err(format!(
                "{s:?}: the scheme must be http:// or https:// (OTLP/HTTP), grpc:// or grpcs:// (OTLP/gRPC)"
            )),
        }
    }
}

/// The exporter's settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub target: Target,
    /// PEM certificates trusted for a TLS target; `None`: the system's bundle.
    pub ca_file: Option<std::path::PathBuf>,
    /// Span batches (one per finished request) waiting to be sent; beyond it they are dropped.
    pub queue: usize,
    /// Most spans in one export request.
    pub max_batch: usize,
    /// Longest a span waits for its batch to fill.
    pub delay: Duration,
    /// Connect + send + answer, per export request.
    pub timeout: Duration,
    /// Resource attributes (`service.name`, ...).
    pub resource: Vec<(&'static str, Value)>,
    /// Instrumentation scope name and version.
    pub scope: &'static str,
    pub version: &'static str,
}

/// Counts the exporter reports: spans dropped at a full queue, exported, failed to export.
#[derive(Clone)]
pub struct Hooks {
    pub dropped: Arc<dyn Fn(u64) + Send + Sync>,
    pub exported: Arc<dyn Fn(u64) + Send + Sync>,
    pub failed: Arc<dyn Fn(u64) + Send + Sync>,
}

impl Hooks {
    /// Hooks that count nothing.
    pub fn none() -> Hooks {
        let f: Arc<dyn Fn(u64) + Send + Sync> = Arc::new(|_| {});
        Hooks {
            dropped: f.clone(),
            exported: f.clone(),
            failed: f,
        }
    }
}

/// The handle requests submit their spans to. Cheap to clone.
#[derive(Clone)]
pub struct Exporter {
    tx: mpsc::Sender<Vec<SpanRecord>>,
    dropped: Arc<dyn Fn(u64) + Send + Sync>,
}

impl Exporter {
    /// Start the export task on the current runtime; it stops (after one last flush, within the
    /// timeout) when `cancel` fires. `Err`: a TLS target whose CA certificates cannot be loaded.
    pub fn start(cfg: Config, hooks: Hooks, cancel: CancellationToken) -> Result<Exporter, String> {
        let tls = if cfg.target.tls() {
            let alpn: &[u8] = match cfg.target {
                Target::Http { .. } => b"http/1.1",
                Target::Grpc { .. } => b"h2",
            };
            let cc = crate::client::client_config(cfg.ca_file.as_deref(), "tracing.ca_file", alpn)?;
            Some(tokio_rustls::TlsConnector::from(Arc::new(cc)))
        } else {
            None
        };
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        let dropped = hooks.dropped.clone();
        tokio::spawn(run(cfg, tls, hooks, rx, cancel));
        Ok(Exporter { tx, dropped })
    }

    /// Queue a request's spans; never waits. A full queue (collector slow or down) drops them.
    pub fn submit(&self, spans: Vec<SpanRecord>) {
        if spans.is_empty() {
            return;
        }
        if let Err(e) = self.tx.try_send(spans) {
            let n = match e {
                mpsc::error::TrySendError::Full(s) | mpsc::error::TrySendError::Closed(s) => {
                    s.len()
                }
            };
            (self.dropped)(n as u64);
        }
    }
}

async fn run(
    cfg: Config,
    tls: Option<tokio_rustls::TlsConnector>,
    hooks: Hooks,
    mut rx: mpsc::Receiver<Vec<SpanRecord>>,
    cancel: CancellationToken,
) {
    let mut sender = Sender::new(cfg.target.clone(), tls, cfg.timeout);
    let mut buf: Vec<SpanRecord> = Vec::new();
    let mut due = tokio::time::Instant::now();
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => {
                while let Ok(s) = rx.try_recv() {
                    buf.extend(s);
                }
                flush(&cfg, &hooks, &mut sender, &mut buf, true).await;
                return;
            }
            got = rx.recv() => match got {
                None => {
                    flush(&cfg, &hooks, &mut sender, &mut buf, true).await;
                    return;
                }
                Some(spans) => {
                    if buf.is_empty() {
                        due = tokio::time::Instant::now() + cfg.delay;
                    }
                    buf.extend(spans);
                    if buf.len() >= cfg.max_batch {
                        flush(&cfg, &hooks, &mut sender, &mut buf, false).await;
                        due = tokio::time::Instant::now() + cfg.delay;
                    }
                }
            },
            _ = tokio::time::sleep_until(due), if !buf.is_empty() => {
                flush(&cfg, &hooks, &mut sender, &mut buf, true).await;
            }
        }
    }
}

/// Send full batches (and, with `all`, the rest).
async fn flush(
    cfg: &Config,
    hooks: &Hooks,
    sender: &mut Sender,
    buf: &mut Vec<SpanRecord>,
    all: bool,
) {
    let max = cfg.max_batch.max(1);
    while buf.len() >= max || (all && !buf.is_empty()) {
        let rest = buf.split_off(buf.len().min(max));
        let batch = std::mem::replace(buf, rest);
        let n = batch.len() as u64;
        let body = encode_request(&cfg.resource, cfg.scope, cfg.version, batch);
        match tokio::time::timeout(cfg.timeout, sender.send(body)).await {
            Ok(Ok(rejected)) => {
                let rejected = rejected.min(n);
                (hooks.exported)(n - rejected);
                if rejected > 0 {
                    (hooks.failed)(rejected);
                }
                sender.ok();
            }
            Ok(Err(why)) => {
                sender.failed(&why);
                (hooks.failed)(n);
            }
            Err(_) => {
                sender.failed("timed out");
                (hooks.failed)(n);
            }
        }
    }
}

enum Conn {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Conn {
    fn is_closed(&self) -> bool {
        match self {
            Conn::H1(s) => s.is_closed(),
            Conn::H2(s) => s.is_closed(),
        }
    }
}

/// One connection to the collector, made again after any error.
struct Sender {
    target: Target,
    tls: Option<tokio_rustls::TlsConnector>,
    timeout: Duration,
    conn: Option<Conn>,
    /// Logged once per failure streak, not once per batch.
    failing: bool,
}

impl Sender {
    fn new(target: Target, tls: Option<tokio_rustls::TlsConnector>, timeout: Duration) -> Sender {
        Sender {
            target,
            tls,
            timeout,
            conn: None,
            failing: false,
        }
    }

    fn ok(&mut self) {
        if self.failing {
            tracing::info!("trace export recovered");
            self.failing = false;
        }
    }

    fn failed(&mut self, why: &str) {
        self.conn = None;
        if !self.failing {
            tracing::warn!(error = %why, "trace export failed; spans are dropped until the collector answers");
            self.failing = true;
        }
    }

    async fn connect(&self) -> Result<Conn, String> {
        let authority = self.target.authority();
        let tcp = tokio::time::timeout(
            self.timeout,
            tokio::net::TcpStream::connect(authority.as_str()),
        )
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| format!("connect {authority}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return self.handshake(tcp).await;
        };
        let host = authority.host();
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let name = rustls::pki_types::ServerName::try_from(bare.to_owned())
            .map_err(|e| format!("TLS server name {bare:?}: {e}"))?;
        let stream = tokio::time::timeout(self.timeout, tls.connect(name, tcp))
            .await
            .map_err(|_| "TLS handshake timed out".to_string())?
            .map_err(|e| format!("TLS handshake with {authority}: {e}"))?;
        self.handshake(stream).await
    }

    /// The HTTP/1.1 or HTTP/2 handshake on an open connection (TCP or TLS).
    async fn handshake<I>(&self, io: I) -> Result<Conn, String>
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let io = TokioIo::new(io);
        match self.target {
            Target::Http { .. } => {
                let (send, conn) = hyper::client::conn::http1::handshake(io)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                Ok(Conn::H1(send))
            }
            Target::Grpc { .. } => {
                let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                Ok(Conn::H2(send))
            }
        }
    }

    /// Send one encoded export request; the collector's count of rejected spans on success. A
    /// kept connection the collector has closed meanwhile (an HTTP/1.0 server closes after every
    /// answer; an idle timeout) is replaced, and a failure on a reused one is tried once more on
    /// a new connection.
    async fn send(&mut self, body: Vec<u8>) -> Result<u64, String> {
        let body = Bytes::from(body);
        let reused = self.conn.as_ref().is_some_and(|c| !c.is_closed());
        if !reused {
            self.conn = Some(self.connect().await?);
        }
        match self.send_once(body.clone()).await {
            Err(_) if reused => {
                self.conn = Some(self.connect().await?);
                self.send_once(body).await
            }
            r => r,
        }
    }

    async fn send_once(&mut self, body: Bytes) -> Result<u64, String> {
        let conn = self.conn.as_mut().expect("connected by send");
        match (conn, &self.target) {
            (
                Conn::H1(s),
                Target::Http {
                    authority, path, ..
                },
            ) => {
                s.ready().await.map_err(|e| e.to_string())?;
                let req = Request::post(path.as_str())
                    .header(header::HOST, authority.as_str())
                    .header(header::CONTENT_TYPE, "application/x-protobuf")
                    .body(Full::new(body))
                    .map_err(|e| e.to_string())?;
                let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status();
                let answer = Limited::new(resp.into_body(), MAX_ANSWER)
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                if !status.is_success() {
                    return Err(format!("collector answered {status}"));
                }
                Ok(rejected_spans(&answer) as u64)
            }
            (Conn::H2(s), Target::Grpc { authority, tls }) => {
                s.ready().await.map_err(|e| e.to_string())?;
                let mut framed = BytesMut::with_capacity(5 + body.len());
                framed.put_u8(0);
                framed.put_u32(body.len() as u32);
                framed.put_slice(&body);
                let scheme = if *tls { "https" } else { "http" };
                let req = Request::post(format!("{scheme}://{authority}{GRPC_PATH}"))
                    .header(header::CONTENT_TYPE, "application/grpc")
                    .header(header::TE, "trailers")
                    .body(Full::new(framed.freeze()))
                    .map_err(|e| e.to_string())?;
                let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status();
                let head_status = resp.headers().get("grpc-status").cloned();
                let collected = Limited::new(resp.into_body(), MAX_ANSWER)
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?;
                let trailers = collected.trailers().cloned();
                let answer = collected.to_bytes();
                if status != StatusCode::OK {
                    return Err(format!("collector answered HTTP {status}"));
                }
                let grpc = trailers
                    .as_ref()
                    .and_then(|t| t.get("grpc-status").cloned())
                    .or(head_status);
                if grpc.as_ref().map(HeaderValue::as_bytes) != Some(b"0") {
                    let msg = trailers
                        .as_ref()
                        .and_then(|t| t.get("grpc-message"))
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    return Err(format!(
                        "collector answered grpc-status {:?} {msg}",
                        grpc.as_ref()
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("none")
                    ));
                }
                // The answer is one length-prefixed message (uncompressed).
                let msg = if answer.len() >= 5 && answer[0] == 0 {
                    &answer[5..]
                } else {
                    &[][..]
                };
                Ok(rejected_spans(msg) as u64)
            }
            _ => unreachable!("a connection is made for its target's protocol"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_bad_ones_say_why() {
        assert_eq!(
            Target::parse("http://127.0.0.1:4318").unwrap(),
            Target::Http {
                authority: "127.0.0.1:4318".parse().unwrap(),
                path: "/v1/traces".into(),
                tls: false
            }
        );
        assert_eq!(
            Target::parse("http://c:4318/otlp/").unwrap(),
            Target::Http {
                authority: "c:4318".parse().unwrap(),
                path: "/otlp/v1/traces".into(),
                tls: false
            }
        );
        assert_eq!(
            Target::parse("grpc://c:4317").unwrap(),
            Target::Grpc {
                authority: "c:4317".parse().unwrap(),
                tls: false
            }
        );
        assert_eq!(
            Target::parse("https://c:4318/otlp").unwrap(),
            Target::Http {
                authority: "c:4318".parse().unwrap(),
                path: "/otlp/v1/traces".into(),
                tls: true
            }
        );
        let grpcs = Target::parse("grpcs://c:4317").unwrap();
        assert!(grpcs.tls());
        assert!(matches!(grpcs, Target::Grpc { .. }));
        for (bad, why) in [
            ("ftp://c:4318", "scheme"),
            ("grpcs://c:4317/x", "no path"),
            ("c:4318", "scheme"),
            ("http://c", "no port"),
            ("grpc://c:4317/x", "no path"),
            ("http://c:1/?a=b", "query"),
        ] {
            let e = Target::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
