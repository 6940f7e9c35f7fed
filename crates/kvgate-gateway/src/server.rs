//! Listeners: accept loop (HTTP/1.1 + h2 via hyper-util's auto builder, optional TLS), the route
//! table of the data-path listener, and graceful shutdown that drains in-flight streams.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api;
use crate::body::GwBody;
use crate::config::ServerConfig;
use crate::ctx::Endpoint;
use crate::error::{ErrorKind, GatewayError};
use crate::proxy;
use crate::state::AppState;

/// Route table of the data-path listener.
pub async fn route(app: Arc<AppState>, req: Request<Incoming>) -> Response<GwBody> {
    let start = Instant::now();
    let endpoint = match req.uri().path() {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/embeddings" => Some(Endpoint::Embeddings),
        _ => None,
    };
    if let Some(ep) = endpoint {
        if req.method() != Method::POST {
            return method_not_allowed(&app, "POST");
        }
        return proxy::handle(app, req, ep, start).await;
    }
    let get = req.method() == Method::GET || req.method() == Method::HEAD;
    match req.uri().path() {
        "/v1/models" if get => api::models::list(&app, &req),
        "/health" if get => api::health::live(),
        "/ready" if get => api::health::ready(&app),
        "/metrics" if get => api::metrics::render(&app),
        "/v1/models" | "/health" | "/ready" | "/metrics" => method_not_allowed(&app, "GET"),
        path => {
            app.metrics.error("not_found");
            GatewayError::new(
                ErrorKind::NotFound,
                format!("no route for {} {path}", req.method()),
            )
            .into_response()
        }
    }
}

fn method_not_allowed(app: &AppState, allow: &'static str) -> Response<GwBody> {
    app.metrics.error("method_not_allowed");
    let mut r = GatewayError::new(
        ErrorKind::MethodNotAllowed,
        format!("method not allowed; use {allow}"),
    )
    .into_response();
    r.headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    r
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

/// Serve `listener` until `shutdown` fires, then let open connections finish their in-flight
/// requests for up to `grace`.
pub async fn serve<F, Fut>(
    listener: TcpListener,
    builder: Arc<auto::Builder<TokioExecutor>>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    handler: F,
    shutdown: CancellationToken,
    grace: Duration,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<GwBody>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
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
        let _ = stream.set_nodelay(true);
        let h = handler.clone();
        let svc = service_fn(move |req| {
            let fut = h(req);
            async move { Ok::<_, Infallible>(fut.await) }
        });
        let builder = builder.clone();
        let watcher = graceful.watcher();
        match tls.clone() {
            None => {
                tokio::spawn(async move {
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    if let Err(e) = watcher.watch(conn.into_owned()).await {
                        tracing::debug!(%peer, error = %e, "connection ended with error");
                    }
                });
            }
            Some(acc) => {
                tokio::spawn(async move {
                    let tls =
                        match tokio::time::timeout(Duration::from_secs(10), acc.accept(stream))
                            .await
                        {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return;
                            }
                            Err(_) => return,
                        };
                    let conn = builder.serve_connection(TokioIo::new(tls), svc);
                    if let Err(e) = watcher.watch(conn.into_owned()).await {
                        tracing::debug!(%peer, error = %e, "connection ended with error");
                    }
                });
            }
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!("shutdown grace period over; closing remaining connections");
        }
    }
}
