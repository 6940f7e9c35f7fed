//! kvgate's HTTP/1.1 client to workers, built for the gateway's proxy hop and used for the fleet's
//! probes, scrapes and polls too.
//!
//! A request is forwarded by the task serving the client's connection itself: it checks a
//! keep-alive connection out of the pool it is given (or connects), writes the request head and the
//! client's body bytes with one `writev`, reads the response head, and hands back a body that
//! reads the worker's socket when the client side polls it. When the body has been read to its
//! end, the connection goes back to the pool; a body dropped before its end (the client went away)
//! closes the connection, which is how the worker learns to cancel the request.
//!
//! Why not hyper's client: it runs every connection as its own task and passes requests, responses
//! and body chunks between that task and the request's task over channels — several task wake-ups
//! and allocations per proxied request, the largest part of the gateway's own CPU per request
//! after the kernel's (benches/overhead-results.md). Workers speak plain HTTP/1.1 with
//! content-length or chunked bodies; this is the small subset of HTTP a proxy hop needs.
//!
//! A pooled connection is state shared between users: one whose response left bytes unread, or
//! that turned readable while idle (a stray response, the rest of a body its content-length
//! undercounted, a close), is closed, never handed to the next request, which would otherwise read
//! another request's answer. Every checkout probes the socket for that.
//!
//! Reuse races: a worker may close an idle keep-alive connection (uvicorn does after 5 s) just as
//! a request is written to it. A request that fails on a *reused* connection before a single byte
//! of response arrived is sent again once on a new connection, as nginx does; every other failure
//! goes to the request path, which may try another worker.
//!
//! `https://` workers are reached over TLS (rustls) with the certificates of [`Tls`]: the system's
//! bundle or `upstream.ca_file`.
//!
//! The pool ([`Pool`], `client/pool.rs`) is a handle the caller passes in: the gateway gives each
//! io thread (each serving its connections with its own runtime) its own; it is keyed by worker
//! address, last in first out (a few hot connections rather than many lukewarm ones), and bounded
//! by `upstream.pool_max_idle_per_host` and `upstream.pool_idle_timeout_s`.

use std::future::poll_fn;
use std::io::{self, IoSlice};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};

mod pool;

use pool::Key;
pub use pool::{Pool, Within};

use crate::chunked::{Chunk, ChunkError, Decode, Step};
use crate::head::{
    header_name, is_hop_by_hop, push_decimal, push_field, FieldKind, FieldSpans, FramingFields,
    MAX_HEADERS,
};
use http::header::{self, HeaderMap, HeaderValue};
use http::uri::Authority;
use http::{Method, StatusCode};
use http_body::{Body, Frame, SizeHint};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// Largest response head accepted from a worker.
const MAX_HEAD: usize = 64 << 10;
/// Read buffer growth step.
const READ_CHUNK: usize = 8 << 10;
/// A pooled connection keeps its read buffer unless the buffer grew past this (then it is freed).
const KEEP_BUF: usize = 4 * READ_CHUNK;

/// Called with the time each new connection took to open (the gateway's
/// `kvgate_upstream_connect_seconds`).
pub type ConnectHook = Arc<dyn Fn(Duration) + Send + Sync>;

/// Called with the worker's address when it wrote bytes after a finished response.
pub type StrayHook = Arc<dyn Fn(&Authority) + Send + Sync>;

/// How long a worker caught writing after its response gets a new connection for every request.
///
/// A stray response that arrives while its connection is idle is caught by the probe at
/// checkout; one that arrives after the next request was written cannot be told from that
/// request's answer (HTTP/1.1 has no request ids) and would shift every later answer on the
/// connection by one. So once a worker is caught once, its connections are not reused for a
/// while: a fresh connection carries nothing from an earlier request.
pub const STRAY_QUARANTINE: Duration = Duration::from_secs(60);

/// Client settings (the gateway's come from `[upstream]`).
#[derive(Clone)]
pub struct Settings {
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_idle_per_host: usize,
    pub on_connect: Option<ConnectHook>,
    /// Called when a worker is caught writing after its response (its connections are then not
    /// reused for [`STRAY_QUARANTINE`]).
    pub on_stray: Option<StrayHook>,
    /// Certificates trusted for `https://` workers; `None`: https requests fail to connect.
    pub tls: Option<Tls>,
}

/// TLS client configuration for `https://` workers (rustls, ring; ALPN `http/1.1`).
#[derive(Clone)]
pub struct Tls {
    connector: TlsConnector,
    /// Identifies this trust configuration in the pool: a connection made under one is never
    /// handed to a request made under another.
    id: u64,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

/// Where CA bundles usually are (Debian/Ubuntu/Alpine, RHEL/Fedora, openSUSE, macOS/BSD).
const SYSTEM_CA_FILES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

impl Tls {
    /// Trust the PEM certificates in `ca_file`; without one, the system's bundle (`SSL_CERT_FILE`,
    /// else the first of the usual paths that exists).
    pub fn load(ca_file: Option<&std::path::Path>) -> Result<Tls, String> {
        let cc = client_config(ca_file, "upstream.ca_file", b"http/1.1")?;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Tls {
            connector: TlsConnector::from(Arc::new(cc)),
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }
}

/// A rustls (ring) client configuration trusting the PEM certificates in `ca_file`, else the
/// system's bundle (`SSL_CERT_FILE`, else the first of the usual paths that exists), offering
/// `alpn`. `key` names the setting in errors (`upstream.ca_file`, `tracing.ca_file`).
pub fn client_config(
    ca_file: Option<&std::path::Path>,
    key: &str,
    alpn: &[u8],
) -> Result<rustls::ClientConfig, String> {
    let path = match ca_file {
        Some(p) => p.to_path_buf(),
        None => std::env::var_os("SSL_CERT_FILE")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                SYSTEM_CA_FILES
                    .iter()
                    .map(std::path::PathBuf::from)
                    .find(|p| p.is_file())
            })
            .ok_or_else(|| format!("no system CA bundle found; set {key} to a PEM file"))?,
    };
    let pem =
        std::fs::read(&path).map_err(|e| format!("reading CA file {}: {e}", path.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut &pem[..]) {
        let cert = cert.map_err(|e| format!("reading CA file {}: {e}", path.display()))?;
        // A bundle may hold certificates rustls cannot use; the others still count.
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err(format!(
            "CA file {} holds no usable certificate",
            path.display()
        ));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cc = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cc.alpn_protocols = vec![alpn.to_vec()];
    Ok(cc)
}

/// Why a worker exchange failed.
#[derive(Debug)]
pub enum Error {
    /// No connection could be opened (refused, unreachable, unresolvable, timed out).
    Connect(String),
    /// The connection failed, or the worker broke the protocol, after the request was written.
    Io(String),
}

impl Error {
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Connect(_))
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Connect(m) | Error::Io(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

impl From<ChunkError> for Error {
    fn from(e: ChunkError) -> Error {
        Error::Io(e.to_string())
    }
}

/// Whether the `Connection` header values in `h` name `name` (those fields are hop-by-hop too).
fn named_in_connection(h: &HeaderMap, name: &str) -> bool {
    h.get_all(header::CONNECTION).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(name)))
    })
}

/// What to send: everything but the connection.
pub struct Outgoing<'a> {
    /// `https://` worker: TLS.
    pub https: bool,
    pub method: &'a Method,
    pub authority: &'a Authority,
    /// Worker base path without trailing slash (usually empty), put before `path_and_query`.
    pub path_prefix: &'a str,
    pub path_and_query: &'a str,
    /// The client's headers; hop-by-hop ones, `host`, `content-length` and `expect` are not
    /// forwarded, nor `authorization` when `strip_client_auth` or `worker_auth` is set.
    pub headers: &'a HeaderMap,
    pub strip_client_auth: bool,
    pub worker_auth: Option<&'a HeaderValue>,
    /// A `traceparent` to send in place of the client's (tracing: the attempt's own span), written
    /// straight into the head (no header map insert per request).
    pub traceparent: Option<&'a [u8]>,
    pub body: &'a Bytes,
}

impl Outgoing<'_> {
    /// The request line and header block.
    #[cfg(test)]
    fn head(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.head_into(&mut out);
        out
    }

    /// The request line and header block, written into `out` (emptied first).
    fn head_into(&self, out: &mut Vec<u8>) {
        out.clear();
        out.reserve(256 + self.headers.len() * 48);
        out.extend_from_slice(self.method.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.path_prefix.as_bytes());
        out.extend_from_slice(self.path_and_query.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        out.extend_from_slice(self.authority.as_str().as_bytes());
        out.extend_from_slice(b"\r\n");
        let has_connection = self.headers.contains_key(header::CONNECTION);
        for (name, value) in self.headers {
            let skip = is_hop_by_hop(name)
                || name == header::HOST
                || name == header::CONTENT_LENGTH
                || name == header::EXPECT
                || (name == header::AUTHORIZATION
                    && (self.strip_client_auth || self.worker_auth.is_some()))
                || (has_connection && named_in_connection(self.headers, name.as_str()))
                || (self.traceparent.is_some() && name.as_str() == "traceparent");
            if skip {
                continue;
            }
            push_field(out, name.as_str().as_bytes(), value.as_bytes());
        }
        if let Some(a) = self.worker_auth {
            push_field(out, b"authorization", a.as_bytes());
        }
        if let Some(tp) = self.traceparent {
            push_field(out, b"traceparent", tp);
        }
        if self.body.is_empty() && matches!(*self.method, Method::GET | Method::HEAD) {
            out.extend_from_slice(b"\r\n");
        } else {
            out.extend_from_slice(b"content-length: ");
            push_decimal(out, self.body.len() as u64);
            out.extend_from_slice(b"\r\n\r\n");
        }
    }
}

/// A worker's response head, hop-by-hop fields removed, and its body.
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: ResponseBody,
}

/// Send `req` to its worker over a connection from `pool` (or a new one) and read the response
/// head. The connection goes back to `pool` when the body has been read to its end.
pub async fn send(req: &Outgoing<'_>, s: &Settings, pool: &Pool) -> Result<Response, Error> {
    let tls = match (req.https, &s.tls) {
        (false, _) => None,
        (true, Some(t)) => Some(t),
        (true, None) => {
            return Err(Error::Connect(format!(
                "https worker {}: no CA certificates loaded (upstream.ca_file)",
                req.authority
            )))
        }
    };
    let mut hb = HeadBuf::take();
    req.head_into(&mut hb.0);
    let head = &hb.0[..];
    let key = Key {
        tls: tls.map_or(0, |t| t.id),
        authority: req.authority.clone(),
    };
    let mut fresh_only = false;
    loop {
        let (io, buf, reused) = match (!fresh_only)
            .then(|| pool.checkout(&key, Instant::now(), &s.on_stray))
            .flatten()
        {
            Some((io, buf)) => (io, buf, true),
            // Boxed: the connect future (TCP and TLS handshakes) is 1.5 KB, and inline it would
            // grow every request's future (copied whole at each level as it is built) for a
            // step that pooled connections skip.
            None => (
                Box::pin(connect(&key.authority, tls, s)).await?,
                BytesMut::new(),
                false,
            ),
        };
        match exchange(io, buf, head, &key, pool, req, s).await {
            Err(Failure::Stale(e)) if reused => {
                tracing::debug!(worker = %req.authority, error = %e, "reused connection was closed; sending again on a new one");
                fresh_only = true;
            }
            Err(Failure::Stale(e)) | Err(Failure::Other(e)) => return Err(e),
            Ok(r) => return Ok(r),
        }
    }
}

/// The request head's buffer, kept per thread between requests (one allocation fewer per
/// request): taken for a send, given back when the send ends. Concurrent sends on one thread
/// beyond the first start with an empty one.
struct HeadBuf(Vec<u8>);

thread_local! {
    static HEAD_BUF: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A head buffer larger than this is not kept.
const HEAD_BUF_KEEP: usize = 16 << 10;

impl HeadBuf {
    fn take() -> HeadBuf {
        HeadBuf(HEAD_BUF.try_with(|b| b.take()).unwrap_or_default())
    }
}

impl Drop for HeadBuf {
    fn drop(&mut self) {
        if self.0.capacity() <= HEAD_BUF_KEEP {
            let b = std::mem::take(&mut self.0);
            let _ = HEAD_BUF.try_with(|c| c.set(b));
        }
    }
}

enum Failure {
    /// Failed before any byte of response arrived: safe to send again on a new connection if the
    /// connection was reused (the worker closed it while it was idle).
    Stale(Error),
    Other(Error),
}

async fn exchange(
    mut io: Conn,
    mut buf: BytesMut,
    head: &[u8],
    key: &Key,
    pool: &Pool,
    req: &Outgoing<'_>,
    s: &Settings,
) -> Result<Response, Failure> {
    let mut bufs = [IoSlice::new(head), IoSlice::new(req.body)];
    let mut slices = &mut bufs[..];
    while !slices.is_empty() {
        let written = match &mut io {
            Conn::Plain(t) => t.write_vectored(slices).await,
            Conn::Tls(t) => t.write_vectored(slices).await,
        };
        match written {
            Ok(0) => {
                return Err(Failure::Stale(Error::Io(
                    "worker connection closed while sending the request".into(),
                )))
            }
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) => {
                return Err(Failure::Stale(Error::Io(format!(
                    "sending the request: {e}"
                ))))
            }
        }
    }
    if let Conn::Tls(t) = &mut io {
        // rustls may hold the last record back until flushed.
        if let Err(e) = t.flush().await {
            return Err(Failure::Stale(Error::Io(format!(
                "sending the request: {e}"
            ))));
        }
    }
    // A pooled connection's buffer comes back with it: once the last response's chunks are gone
    // (sent to the client), this takes its memory back instead of allocating anew.
    buf.reserve(READ_CHUNK);
    // Whether any response byte arrived (an interim 1xx response counts).
    let mut answered = false;
    let mut grown = false;
    loop {
        let n = poll_fn(|cx| io.poll_read(&mut buf, cx)).await;
        grown |= buf.capacity() > KEEP_BUF;
        match n {
            Ok(0) if !answered => {
                return Err(Failure::Stale(Error::Io(
                    "worker closed the connection without a response".into(),
                )))
            }
            Ok(0) => {
                return Err(Failure::Other(Error::Io(
                    "worker closed the connection in the middle of the response head".into(),
                )))
            }
            Ok(_) => answered = true,
            Err(e) if !answered => {
                return Err(Failure::Stale(Error::Io(format!(
                    "reading the response: {e}"
                ))))
            }
            Err(e) => {
                return Err(Failure::Other(Error::Io(format!(
                    "reading the response: {e}"
                ))))
            }
        }
        loop {
            match parse_head(&mut buf, req.method).map_err(Failure::Other)? {
                // Skipped; the final head may be buffered already.
                Some(Parsed::Interim) => continue,
                Some(Parsed::Head(status, headers, framing, keep_alive)) => {
                    let mut body = ResponseBody {
                        io: Some(io),
                        buf,
                        grown,
                        decode: framing,
                        keep_alive,
                        key: key.clone(),
                        pool: pool.clone(),
                        on_stray: s.on_stray.clone(),
                        idle_timeout: s.idle_timeout,
                        max_idle: s.max_idle_per_host,
                    };
                    // An empty body (content-length 0, or only the last chunk buffered): hand
                    // the connection back now, so `is_end_stream` is true from the start.
                    body.advance_non_data().map_err(Failure::Other)?;
                    return Ok(Response {
                        status,
                        headers,
                        body,
                    });
                }
                None => break,
            }
        }
    }
}

pub(crate) enum Parsed {
    /// A 1xx response was skipped; parse again.
    Interim,
    Head(StatusCode, HeaderMap, Decode, bool),
}

/// Parse a response head at the start of `buf` and consume it; `None` if it is incomplete.
pub(crate) fn parse_head(buf: &mut BytesMut, method: &Method) -> Result<Option<Parsed>, Error> {
    // Where each kept field's name and value lie in the head: the header map is built after the
    // head is split off, its values sharing that buffer instead of a copy each.
    let mut spans = FieldSpans::default();
    let (len, status, http11);
    let mut framing = FramingFields::default();
    // Fields the worker's `Connection` header names (hop-by-hop too), beyond close/keep-alive.
    let mut connection_named: Vec<String> = Vec::new();
    {
        let mut fields =
            [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut r = httparse::Response::new(&mut []);
        len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut r,
            buf,
            &mut fields,
        ) {
            // The limit holds however the head arrived: in pieces or in one read.
            Ok(httparse::Status::Complete(n)) if n > MAX_HEAD => return Err(head_too_large()),
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => return Err(head_too_large()),
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(Error::Io(format!(
                    "worker response head has more than {MAX_HEADERS} fields"
                )))
            }
            Err(e) => {
                return Err(Error::Io(format!(
                    "malformed response head from worker: {e}"
                )))
            }
        };
        let code = r.code.unwrap_or(0);
        status = StatusCode::from_u16(code)
            .map_err(|_| Error::Io(format!("worker sent an invalid status code {code}")))?;
        if status.is_informational() {
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(Error::Io("worker switched protocols unasked".into()));
            }
            buf.advance(len);
            return Ok(Some(Parsed::Interim));
        }
        http11 = r.version == Some(1);
        let base = buf.as_ptr() as usize;
        let at = |s: &[u8]| (s.as_ptr() as usize - base) as u32;
        for f in r.headers.iter() {
            let name = f.name.as_bytes();
            let kind = framing
                .field(name, f.value)
                .map_err(|e| Error::Io(format!("worker response: {e}")))?;
            match kind {
                FieldKind::Connection => {
                    for t in String::from_utf8_lossy(f.value).split(',') {
                        let t = t.trim();
                        if !t.is_empty()
                            && !t.eq_ignore_ascii_case("close")
                            && !t.eq_ignore_ascii_case("keep-alive")
                        {
                            connection_named.push(t.to_ascii_lowercase());
                        }
                    }
                    continue;
                }
                FieldKind::Framing if name.len() == 17 => continue, // transfer-encoding
                _ => {}
            }
            spans.push((
                at(name),
                at(name) + name.len() as u32,
                at(f.value),
                at(f.value) + f.value.len() as u32,
            ));
        }
        framing
            .finish()
            .map_err(|e| Error::Io(format!("worker response: {e}")))?;
        if framing.chunked && !http11 {
            return Err(Error::Io(
                "worker response: transfer-encoding in an HTTP/1.0 response".into(),
            ));
        }
    }
    let head = buf.split_to(len).freeze();
    let mut headers = crate::head::header_map(spans.len());
    for (ns, ne, vs, ve) in spans.iter() {
        let raw = &head[ns as usize..ne as usize];
        let name = header_name(raw).map_err(|_| {
            Error::Io(format!(
                "worker sent an invalid header name {:?}",
                String::from_utf8_lossy(raw)
            ))
        })?;
        if is_hop_by_hop(&name) {
            continue;
        }
        let value = HeaderValue::from_maybe_shared(head.slice(vs as usize..ve as usize))
            .map_err(|_| Error::Io(format!("worker sent an invalid value for header {name}")))?;
        headers.append(name, value);
    }
    for n in &connection_named {
        headers.remove(n.as_str());
    }
    // HTTP/1.1 stays open unless the worker says close; HTTP/1.0 only if it says keep-alive.
    let mut close = framing.close || (!http11 && !framing.keep_alive);
    let no_body = method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let decode = if no_body {
        Decode::Done
    } else if framing.chunked {
        Decode::Chunked(Chunk::Size)
    } else if let Some(n) = framing.length {
        if n == 0 {
            Decode::Done
        } else {
            Decode::Length(n)
        }
    } else {
        close = true;
        Decode::Eof
    };
    Ok(Some(Parsed::Head(status, headers, decode, !close)))
}

fn head_too_large() -> Error {
    Error::Io(format!(
        "worker response head is larger than {MAX_HEAD} bytes"
    ))
}

/// A connection to a worker.
enum Conn {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Conn {
    /// Read once into `buf` (growing it by `READ_CHUNK`); `Ok(0)` at end of stream.
    fn poll_read(&mut self, buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if buf.capacity() - buf.len() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        match self {
            // Straight into the buffer's spare capacity, no intermediate copy or zeroing. Through
            // `AsyncRead` rather than `try_read_buf`: a read that fills less than the space offered
            // has drained the socket, and tokio then forgets the socket's readiness, so the probe
            // at the next checkout makes no system call (a `try_read` keeps the readiness until a
            // read fails with `WouldBlock`: one more `recvfrom` per reused connection).
            Conn::Plain(io) => tokio_util::io::poll_read_buf(Pin::new(io), cx, buf),
            Conn::Tls(io) => tokio_util::io::poll_read_buf(Pin::new(io), cx, buf),
        }
    }

    /// An idle connection is usable if reading it would block: no end of stream, no stray bytes.
    /// Bytes that arrived while it sat idle belong to no request: the worker wrote after its
    /// response.
    /// (On a plain connection `try_read` makes no system call unless the reactor saw the socket
    /// become readable since the last read drained it: see [`Conn::poll_read`].)
    fn probe(&mut self) -> IdleState {
        let mut probe = [0u8; 1];
        let read = match self {
            Conn::Plain(io) => match io.try_read(&mut probe) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return IdleState::Alive,
                r => r,
            },
            Conn::Tls(io) => {
                let mut rb = ReadBuf::new(&mut probe);
                let mut cx = Context::from_waker(std::task::Waker::noop());
                match Pin::new(io).poll_read(&mut cx, &mut rb) {
                    Poll::Pending => return IdleState::Alive,
                    Poll::Ready(r) => r.map(|()| rb.filled().len()),
                }
            }
        };
        match read {
            Ok(n) if n > 0 => IdleState::Stray,
            _ => IdleState::Closed,
        }
    }
}

/// What a probe of an idle connection found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdleState {
    Alive,
    /// The worker closed it (or it failed): normal for an idle connection.
    Closed,
    /// Bytes arrived while it was idle: the worker wrote something after its response.
    Stray,
}

/// A worker's response body, read from its connection as the client side polls it.
pub struct ResponseBody {
    /// `None` once the body ended (the connection went back to the pool, or was closed).
    io: Option<Conn>,
    buf: BytesMut,
    /// The buffer grew past [`KEEP_BUF`] (a large head, a long chunk-size line): not pooled.
    /// Its `capacity()` at the end cannot tell: that counts only what lies past the split-off
    /// data, not the allocation.
    grown: bool,
    decode: Decode,
    keep_alive: bool,
    key: Key,
    /// Where the connection goes back to.
    pool: Pool,
    on_stray: Option<StrayHook>,
    idle_timeout: Duration,
    max_idle: usize,
}

impl ResponseBody {
    /// Consume buffered framing that carries no data (a chunk's CRLF, the last chunk, trailers);
    /// at the end, release the connection.
    fn advance_non_data(&mut self) -> Result<(), Error> {
        self.decode.skip_framing(&mut self.buf)?;
        if self.decode == Decode::Done {
            self.release();
        }
        Ok(())
    }

    /// The body ended: pool the connection if it can carry another request, else close it.
    fn release(&mut self) {
        if let Some(io) = self.io.take() {
            if !self.buf.is_empty() {
                // Bytes after the end of the response, in the same read: the worker wrote more
                // than its response. Closed, and the worker's connections are not reused for a
                // while (`Pool::stray`).
                self.pool.stray(&self.key, Instant::now(), &self.on_stray);
                return;
            }
            if self.keep_alive {
                // The buffer stays with the connection unless a large response grew it.
                let buf = if self.grown {
                    BytesMut::new()
                } else {
                    std::mem::take(&mut self.buf)
                };
                self.pool.checkin(
                    self.key.clone(),
                    io,
                    buf,
                    Instant::now(),
                    self.idle_timeout,
                    self.max_idle,
                );
            }
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self.get_mut();
        loop {
            match this.decode.step(&mut this.buf) {
                Err(e) => {
                    this.decode = Decode::Done;
                    this.io = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
                Ok(Step::Done) => {
                    this.release();
                    return Poll::Ready(None);
                }
                Ok(Step::Data(d)) => {
                    // Consume framing that follows the data, so the end is known at once.
                    if let Err(e) = this.advance_non_data() {
                        this.decode = Decode::Done;
                        this.io = None;
                        return Poll::Ready(Some(Err(e)));
                    }
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                Ok(Step::NeedMore) => {}
            }
            let Some(io) = &mut this.io else {
                return Poll::Ready(None);
            };
            let read = ready!(io.poll_read(&mut this.buf, cx));
            this.grown |= this.buf.capacity() > KEEP_BUF;
            match read {
                Ok(0) => {
                    this.io = None;
                    if this.decode == Decode::Eof {
                        this.decode = Decode::Done;
                        return Poll::Ready(None);
                    }
                    this.decode = Decode::Done;
                    return Poll::Ready(Some(Err(Error::Io(
                        "worker closed the connection before the end of the body".into(),
                    ))));
                }
                Ok(_) => {}
                Err(e) => {
                    this.io = None;
                    this.decode = Decode::Done;
                    return Poll::Ready(Some(Err(Error::Io(format!(
                        "reading the response body: {e}"
                    )))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.decode == Decode::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.decode {
            Decode::Length(n) => SizeHint::with_exact(n),
            Decode::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// Open a connection to a worker (each resolved address in turn, then the TLS handshake for
/// https, all within the connect timeout).
async fn connect(authority: &Authority, tls: Option<&Tls>, s: &Settings) -> Result<Conn, Error> {
    let start = Instant::now();
    let port = authority
        .port_u16()
        .unwrap_or(if tls.is_some() { 443 } else { 80 });
    let host = authority.host();
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let literal = bare.parse::<IpAddr>().ok();
    let tls = match tls {
        None => None,
        Some(t) => {
            let name = ServerName::try_from(bare.to_owned())
                .map_err(|e| Error::Connect(format!("TLS server name {bare:?}: {e}")))?;
            Some((t.connector.clone(), name))
        }
    };
    let attempt = async {
        let addrs: Vec<SocketAddr> = match literal {
            Some(ip) => vec![SocketAddr::new(ip, port)],
            None => tokio::net::lookup_host((host, port))
                .await
                .map_err(|e| format!("resolving {host}: {e}"))?
                .collect(),
        };
        let mut last = format!("{host} resolved to no address");
        let mut tcp = None;
        for a in addrs {
            match TcpStream::connect(a).await {
                Ok(io) => {
                    tcp = Some(io);
                    break;
                }
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        let tcp = tcp.ok_or(last)?;
        let _ = tcp.set_nodelay(true);
        match tls {
            None => Ok(Conn::Plain(tcp)),
            Some((connector, name)) => connector
                .connect(name, tcp)
                .await
                .map(|t| Conn::Tls(Box::new(t)))
                .map_err(|e| format!("TLS handshake with {authority}: {e}")),
        }
    };
    let io = match tokio::time::timeout(s.connect_timeout, attempt).await {
        Ok(Ok(io)) => io,
        Ok(Err(e)) => return Err(Error::Connect(e)),
        Err(_) => {
            return Err(Error::Connect(format!(
                "connect to {authority} timed out after {:?}",
                s.connect_timeout
            )))
        }
    };
    if let Some(hook) = &s.on_connect {
        hook(start.elapsed());
    }
    Ok(io)
}

#[cfg(test)]
mod tests;
