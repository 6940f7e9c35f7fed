//! Listeners: accept loop, the route table of the data-path listener, and graceful shutdown that
//! drains in-flight streams. HTTP/1.1 connections (plain, or TLS without ALPN h2) are served by
//! kvgate's own loop ([`kvgate_http::server`], unless `server.http1 = "hyper"`); HTTP/2 by
//! hyper-util's auto builder.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api;
use crate::body::{GwBody, ReqBody};
use crate::config::ServerConfig;
use crate::ctx::{Endpoint, RequestCtx};
use crate::error::{ErrorKind, GatewayError};
use crate::metrics::ErrorLabel;
use crate::proxy;
use crate::state::AppState;
use kvgate_http::client;
use kvgate_http::server as h1server;

/// Route table of the data-path listener.
pub async fn route(
    app: Arc<AppState>,
    conns: client::Pool,
    req: Request<ReqBody>,
) -> Response<GwBody> {
    let start = crate::clock::now();
    let endpoint = Endpoint::by_path(req.uri().path());
    if let Some(ep) = endpoint {
        if ep == Endpoint::STORED_RESPONSE {
            // GET (retrieve, resume a stream, input items) and DELETE on the id; POST …/cancel.
            let cancel = req.uri().path().ends_with("/cancel");
            let allowed = match *req.method() {
                Method::POST => cancel,
                Method::GET | Method::DELETE => !cancel,
                _ => false,
            };
            if !allowed {
                return method_not_allowed(&app, if cancel { "POST" } else { "GET, DELETE" });
            }
        } else if req.method() != Method::POST {
            return method_not_allowed(&app, "POST");
        }
        let mut ctx = RequestCtx::new(app.telemetry.clone(), ep, start);
        let (mut parts, body) = req.into_parts();
        // The worker's response is written here once, not moved out through each future level.
        let mut slot = None;
        return match proxy::route_and_forward(
            &app.proxy, &conns, &mut ctx, &mut parts, body, &mut slot,
        )
        .await
        {
            Ok(answered) => proxy::respond(&app.proxy, ctx, answered, &mut slot),
            Err(e) => proxy::reject(ctx, e),
        };
    }
    let get = req.method() == Method::GET || req.method() == Method::HEAD;
    match req.uri().path() {
        "/v1/models" if get => api::models::list(&app, &req),
        "/health" if get => api::health::live(),
        "/ready" if get => api::health::ready(&app),
        "/metrics" if get => api::metrics::render(&app, req.headers()),
        "/v1/models" | "/health" | "/ready" | "/metrics" => method_not_allowed(&app, "GET"),
        path => {
            app.metrics.error(ErrorLabel::NotFound);
            GatewayError::new(
                ErrorKind::NotFound,
                format!("no route for {} {path}", req.method()),
            )
            .into_response()
        }
    }
}

fn method_not_allowed(app: &AppState, allow: &'static str) -> Response<GwBody> {
    app.metrics.error(ErrorLabel::MethodNotAllowed);
    let mut r = GatewayError::new(
        ErrorKind::MethodNotAllowed,
        format!("method not allowed; use {allow}"),
    )
    .into_response();
    r.headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    r
}

/// Hears of every request the HTTP/1.1 loop refuses itself (to count it by kind).
pub type RefusalCounter = Arc<dyn Fn(&GatewayError) + Send + Sync>;

/// The HTTP/1.1 server loop's limits from `[server]`; `count` hears of every request the loop
/// refuses itself (malformed, oversize or too slow), which is answered in the OpenAI error shape.
pub fn h1_limits(cfg: &ServerConfig, count: Option<RefusalCounter>) -> h1server::Limits {
    h1server::Limits {
        max_head: cfg.max_header_bytes,
        max_body: cfg.max_body_bytes,
        read_timeout: Duration::from_millis(cfg.header_read_timeout_ms),
        body_timeout: Duration::from_secs(cfg.body_read_timeout_s),
        reject: Arc::new(move |r: &h1server::Reject| {
            let kind = match r.status {
                http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => ErrorKind::HeadersTooLarge,
                http::StatusCode::REQUEST_TIMEOUT => ErrorKind::RequestTimeout,
                _ => ErrorKind::BadRequest { param: None },
            };
            let e = GatewayError::new(kind, r.message.clone());
            if let Some(count) = &count {
                count(&e);
            }
            e.json()
        }),
    }
}

pub fn conn_builder(cfg: &ServerConfig) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(cfg.header_read_timeout_ms))
        .max_buf_size(cfg.max_header_bytes.max(8192))
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(cfg.h2_max_streams)
        .max_header_list_size(cfg.max_header_bytes as u32);
    b
}

/// How accepted connections are served.
#[derive(Clone, Default)]
pub struct ServeOpts {
    /// 0: on the calling runtime. N: on N dedicated threads, each a single-threaded runtime;
    /// connections are handed to them round-robin. A request then stays on one thread from the
    /// client's socket to the worker's and back: no cross-thread wake-ups (futex, context switches)
    /// per request, which was most of the gateway's CPU cost per request on a multi-thread runtime.
    pub io_threads: usize,
    /// Serve HTTP/1.1 connections with kvgate's own loop (`None`: hyper serves all).
    pub h1: Option<Arc<h1server::Limits>>,
    /// `server.max_connections` (`None`: no cap).
    pub conn_limit: Option<Arc<ConnLimit>>,
}

/// `server.max_connections`: open client connections are counted; one accepted past the cap is
/// answered 503 (plain HTTP/1.1; a TLS listener just closes it) and closed, so idle or dribbling
/// clients cannot use up the process's file descriptors.
pub struct ConnLimit {
    pub max: usize,
    /// Open connections (`kvgate_client_connections`).
    pub open: prometheus_client::metrics::gauge::Gauge,
    /// Refused ones (`kvgate_client_connections_refused_total`).
    pub refused: prometheus_client::metrics::counter::Counter,
}

/// One open connection's place under the cap; given back when the connection's task ends.
pub struct ConnPermit(Arc<ConnLimit>);

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.0.open.dec();
    }
}

impl ConnLimit {
    /// A place for a new connection, or `None` past the cap.
    fn admit(self: &Arc<Self>) -> Option<ConnPermit> {
        // Only the accept loop increments: check-then-increment does not race.
        if self.open.get() >= self.max as i64 {
            self.refused.inc();
            return None;
        }
        self.open.inc();
        Some(ConnPermit(self.clone()))
    }
}

/// The answer to a connection over the cap: written once, best effort, then closed.
async fn refuse(mut stream: tokio::net::TcpStream, tls: bool) {
    if tls {
        return;
    }
    let e = GatewayError::new(
        ErrorKind::TooManyConnections,
        "too many open connections (server.max_connections); retry later",
    );
    let body = e.json();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        use tokio::io::AsyncWriteExt;
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(&body).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

type Accepted = (std::net::TcpStream, SocketAddr, Option<ConnPermit>);

/// Serve `listener` until `shutdown` fires, then let open connections finish their in-flight
/// requests for up to `grace`. `make_handler` is called once per runtime that serves
/// connections, with that runtime's pool of worker connections (a connection belongs to the
/// runtime that opened it), and gives the request handler for it.
pub async fn serve<M, F, Fut>(
    listener: TcpListener,
    builder: Arc<auto::Builder<TokioExecutor>>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    make_handler: M,
    shutdown: CancellationToken,
    grace: Duration,
    opts: ServeOpts,
) where
    M: Fn(client::Pool) -> F,
    F: Fn(Request<ReqBody>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<GwBody>> + Send + 'static,
{
    let mut threads = Vec::new();
    let mut senders = Vec::new();
    for i in 0..opts.io_threads {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Accepted>();
        let pool = client::Pool::default();
        let (b, t, h, s, h1) = (
            builder.clone(),
            tls.clone(),
            make_handler(pool.clone()),
            shutdown.clone(),
            opts.h1.clone(),
        );
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let spawned = std::thread::Builder::new()
            .name(format!("kvgate-io-{i}"))
            .spawn(move || {
                // IO and timers only: no signal/process driver to poll on every park.
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .enable_time()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start an io thread");
                        return;
                    }
                };
                let protocols = Protocols {
                    builder: b,
                    tls: t,
                    h1,
                };
                rt.block_on(io_thread(rx, protocols, h, pool, s, grace));
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => {
                senders.push(tx);
                threads.push(done_rx);
            }
            Err(e) => tracing::error!(error = %e, "cannot spawn an io thread"),
        }
    }
    if senders.is_empty() {
        let handler = make_handler(client::Pool::default());
        let graceful = GracefulShutdown::new();
        let limit = opts.conn_limit.clone();
        accept_loop(
            listener,
            &shutdown,
            limit.as_ref(),
            tls.is_some(),
            |stream, peer, permit| {
                let c = Conn {
                    builder: &builder,
                    tls: &tls,
                    h1: &opts.h1,
                    shutdown: &shutdown,
                };
                spawn_conn(c, &handler, stream, peer, permit, &graceful)
            },
        )
        .await;
        drain(graceful, grace).await;
        return;
    }
    let mut next = 0usize;
    let limit = opts.conn_limit.clone();
    accept_loop(
        listener,
        &shutdown,
        limit.as_ref(),
        tls.is_some(),
        |stream, peer, permit| {
            // A connection stays on the thread that got it; hand them out in turn.
            match stream.into_std() {
                Ok(s) => {
                    let _ = senders[next % senders.len()].send((s, peer, permit));
                    next = next.wrapping_add(1);
                }
                Err(e) => tracing::debug!(%peer, error = %e, "cannot hand over connection"),
            }
        },
    )
    .await;
    drop(senders);
    for t in threads {
        let _ = t.await;
    }
}

async fn accept_loop(
    listener: TcpListener,
    shutdown: &CancellationToken,
    limit: Option<&Arc<ConnLimit>>,
    tls: bool,
    mut on_conn: impl FnMut(tokio::net::TcpStream, SocketAddr, Option<ConnPermit>),
) {
    loop {
        let (stream, peer): (tokio::net::TcpStream, SocketAddr) = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let permit = match limit.map(ConnLimit::admit) {
            Some(None) => {
                tracing::debug!(%peer, "connection refused: server.max_connections open");
                tokio::spawn(refuse(stream, tls));
                continue;
            }
            Some(Some(p)) => Some(p),
            None => None,
        };
        let _ = stream.set_nodelay(true);
        on_conn(stream, peer, permit);
    }
    drop(listener);
}

/// How an io thread speaks to its connections: hyper (HTTP/2, and HTTP/1 when `h1` is unset),
/// TLS when configured, kvgate's HTTP/1 loop with its limits otherwise.
struct Protocols {
    builder: Arc<auto::Builder<TokioExecutor>>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    h1: Option<Arc<h1server::Limits>>,
}

/// One io thread: serve the connections handed to it until shutdown, then drain them.
async fn io_thread<F, Fut>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Accepted>,
    protocols: Protocols,
    handler: F,
    pool: client::Pool,
    shutdown: CancellationToken,
    grace: Duration,
) where
    F: Fn(Request<ReqBody>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<GwBody>> + Send + 'static,
{
    // hyper arms a header-read timer (`server.header_read_timeout_ms`) each time a connection
    // waits for its next request. Tokio wakes its own driver (an eventfd write, two per request)
    // whenever a new timer is due before the driver's next planned wake-up; a timer that is
    // always due within a second keeps that wake-up near, so hyper's timers register silently.
    // The same tick closes this thread's worker connections that stayed idle too long.
    let ticker = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            pool.evict_idle(crate::clock::now());
        }
    });
    let graceful = GracefulShutdown::new();
    loop {
        let (s, peer, permit) = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            c = rx.recv() => match c {
                Some(c) => c,
                None => break,
            },
        };
        match tokio::net::TcpStream::from_std(s) {
            Ok(stream) => {
                let c = Conn {
                    builder: &protocols.builder,
                    tls: &protocols.tls,
                    h1: &protocols.h1,
                    shutdown: &shutdown,
                };
                spawn_conn(c, &handler, stream, peer, permit, &graceful)
            }
            Err(e) => tracing::debug!(%peer, error = %e, "cannot adopt connection"),
        }
    }
    drain(graceful, grace).await;
    ticker.abort();
}

async fn drain(graceful: GracefulShutdown, grace: Duration) {
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!("shutdown grace period over; closing remaining connections");
        }
    }
}

/// What a connection is served with.
struct Conn<'a> {
    builder: &'a Arc<auto::Builder<TokioExecutor>>,
    tls: &'a Option<tokio_rustls::TlsAcceptor>,
    h1: &'a Option<Arc<h1server::Limits>>,
    shutdown: &'a CancellationToken,
}

fn spawn_conn<F, Fut>(
    c: Conn<'_>,
    handler: &F,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    permit: Option<ConnPermit>,
    graceful: &GracefulShutdown,
) where
    F: Fn(Request<ReqBody>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<GwBody>> + Send + 'static,
{
    let h = handler.clone();
    // kvgate's loop builds the request with `ReqBody` itself (no `map` per request).
    let h1h = h.clone();
    let svc = {
        let h = h.clone();
        service_fn(move |req: Request<Incoming>| {
            let fut = h(req.map(ReqBody::Hyper));
            async move { Ok::<_, Infallible>(fut.await) }
        })
    };
    let builder = c.builder.clone();
    // Held for the connection's life: shutdown's drain waits for every watcher to go.
    let watcher = graceful.watcher();
    let tls = c.tls.clone();
    let h1 = c.h1.clone();
    let shutdown = c.shutdown.clone();
    tokio::spawn(async move {
        // The connection's place under `server.max_connections`, given back when it ends.
        let _permit = permit;
        // kvgate's HTTP/1.1 loop when configured (`limits`), hyper otherwise; a client that turns
        // out to speak HTTP/2 goes to hyper with the bytes already read.
        macro_rules! serve_io {
            ($io:ident, $limits:expr) => {
                match $limits {
                    Some(limits) => match h1server::serve($io, &h1h, &limits, &shutdown).await {
                        h1server::Ended::Closed => Ok(()),
                        h1server::Ended::H2(io, read) => {
                            let io = TokioIo::new(h1server::Prefixed::new(read, io));
                            watcher
                                .watch(builder.serve_connection(io, svc).into_owned())
                                .await
                        }
                    },
                    None => {
                        let conn = builder.serve_connection(TokioIo::new($io), svc);
                        watcher.watch(conn.into_owned()).await
                    }
                }
            };
        }
        let r = match tls {
            None => serve_io!(stream, h1),
            Some(acc) => {
                let tls =
                    match tokio::time::timeout(Duration::from_secs(10), acc.accept(stream)).await {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    };
                // ALPN h2: hyper's.
                let h1 = h1.filter(|_| tls.get_ref().1.alpn_protocol() != Some(b"h2"));
                serve_io!(tls, h1)
            }
        };
        if let Err(e) = r {
            tracing::debug!(%peer, error = %e, "connection ended with error");
        }
    });
}
