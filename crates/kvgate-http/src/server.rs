//! kvgate's own HTTP/1.1 server loop for client connections (`server.http1 = "kvgate"`, the
//! default), plain or TLS. HTTP/2 stays on hyper: TLS connections that negotiate `h2` go to hyper
//! at once, and a connection that opens with the HTTP/2 preface is handed over to hyper with the
//! bytes already read.
//!
//! Why: after the kernel's share, hyper's HTTP/1 server was the largest part of the gateway's own
//! CPU per proxied request (benches/overhead-results.md): its dispatcher state machine, a request
//! body channel, a header-read timer armed per request, the service future moved through several
//! layers. This loop serves a connection's requests one after the other in the connection's own
//! task: parse the head with `httparse` straight into the request (header values and the path
//! share the read buffer), read the whole body (bounded by `server.max_body_bytes`; it is read
//! whole by the handlers anyway), await the handler while watching the socket (a client that goes
//! away cancels the request at once), write the response head and the first body bytes with one
//! `writev`, and stream the rest.
//!
//! What it serves, and how it answers what it does not:
//! - request bodies with `content-length` or `transfer-encoding: chunked` (trailers dropped);
//!   `expect: 100-continue` answered before the body is read; both framings at once, several
//!   different lengths, or another transfer coding: 400 and close (request smuggling);
//! - keep-alive (HTTP/1.1 by default, HTTP/1.0 with `connection: keep-alive`) and pipelining
//!   (responses in request order); `connection: close` honoured;
//! - a head larger than `server.max_header_bytes` or with more than 100 fields: 431; a malformed
//!   head: 400; both in the OpenAI error shape, then the connection closes;
//! - a head (or a body read) that does not complete within `server.header_read_timeout_ms`, or an
//!   idle keep-alive connection past it: closed;
//! - responses: `content-length` when the body's length is known, else chunked (HTTP/1.1) or
//!   close-delimited (HTTP/1.0); no body for HEAD, 1xx, 204, 304; a `date` field;
//! - shutdown: idle connections close at once, a request in flight finishes (its response says
//!   `connection: close`).

use std::future::{poll_fn, Future};
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

use crate::chunked::{chunk_prefix, Decode, Step};
use crate::head::{
    decimal, header_name, parse_len, push_field, FieldSpans, FramingFields, MAX_HEADERS,
};
/// What a connection opening with HTTP/2 (prior knowledge) sends first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Read buffer growth step.
const READ_CHUNK: usize = 8 << 10;
/// After a response that leaves request bytes unread (a body over the limit), the connection
/// reads and drops what the client still sends for this long before closing, so that the client
/// reads the response instead of a reset.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1 << 20;

/// Bounds of a connection, from `[server]`, and how refused requests are answered.
#[derive(Clone)]
pub struct Limits {
    pub max_head: usize,
    pub max_body: usize,
    /// Longest wait for the next bytes of a head or body, and for an idle keep-alive
    /// connection's next request.
    pub read_timeout: Duration,
    /// Longest time a request body may take to arrive whole, from the end of its head (a client
    /// that dribbles one byte per `read_timeout` is cut off here): 408, then close.
    pub body_timeout: Duration,
    /// Renders (and counts) each request the server refuses itself: the JSON body of the answer.
    pub reject: RejectHook,
}

/// See [`Limits::reject`].
pub type RejectHook = Arc<dyn Fn(&Reject) -> Bytes + Send + Sync>;

/// A request this server refuses before any handler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// 400 (malformed head or body), 408 (body too slow), 431 (head too large).
    pub status: StatusCode,
    pub message: String,
}

impl Reject {
    fn bad(message: impl Into<String>) -> Reject {
        Reject {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }
}

/// A request body as the handler gets it: read whole, bounded by `Limits::max_body`.
#[derive(Debug)]
pub enum RequestBody {
    Full(Option<Bytes>),
    /// The body is larger than `Limits::max_body`; it was not read (the connection closes after
    /// the response).
    TooLarge,
}

/// How a connection ended.
pub enum Ended<S> {
    Closed,
    /// The client speaks HTTP/2: the stream, and the bytes already read from it.
    H2(S, Bytes),
}

/// Serve the requests of one client connection until it closes, fails, or shutdown.
///
/// The handler gets the body as its own type `RB` (made from [`RequestBody`]): the request is
/// built once, with that body, instead of being taken apart and rebuilt by the caller.
pub async fn serve<S, F, Fut, B, RB>(
    io: S,
    handler: &F,
    limits: &Limits,
    shutdown: &CancellationToken,
) -> Ended<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
    RB: From<RequestBody>,
    F: Fn(Request<RB>) -> Fut,
    Fut: Future<Output = Response<B>>,
    B: Body<Data = Bytes> + Unpin,
{
    let mut c = Conn {
        io,
        buf: BytesMut::with_capacity(READ_CHUNK),
        wbuf: Vec::with_capacity(512),
        limits,
    };
    let mut timer = pin!(tokio::time::sleep(limits.read_timeout));
    let mut first = true;
    // Each request's head is parsed into this slot and taken out once, instead of being moved
    // out through `read_head`'s future and its result (~250 bytes copied per level).
    let mut slot = None;
    loop {
        match c
            .read_head(timer.as_mut(), shutdown, first, &mut slot)
            .await
        {
            Ok(HeadRead::Head) => {}
            Ok(HeadRead::H2) => return Ended::H2(c.io, c.buf.freeze()),
            Ok(HeadRead::Closed) => return Ended::Closed,
            Err(e) => {
                c.reject(e).await;
                return Ended::Closed;
            }
        };
        first = false;
        // `read_head` fills the slot whenever it answers `Head`.
        let Some(Head {
            parts,
            framing,
            mut keep_alive,
            expect_continue,
        }) = slot.take()
        else {
            debug_assert!(false, "HeadRead::Head with an empty slot");
            return Ended::Closed;
        };
        let body = match c.read_body(framing, expect_continue, timer.as_mut()).await {
            Ok(b) => b,
            Err(BodyFail::Closed) => return Ended::Closed,
            Err(BodyFail::Bad(e)) => {
                c.reject(e).await;
                return Ended::Closed;
            }
        };
        let unread = matches!(body, RequestBody::TooLarge);
        keep_alive &= !unread;
        let version = parts.version;
        let head_only = parts.method == Method::HEAD;
        let req = Request::from_parts(parts, RB::from(body));
        // Pinned where it is made: the handler's future is kilobytes, not worth moving.
        let fut = pin!(handler(req));
        let Some(resp) = c.watch(fut).await else {
            return Ended::Closed;
        };
        keep_alive &= !shutdown.is_cancelled();
        match c.respond(resp, version, head_only, keep_alive).await {
            Ok(true) => {}
            Ok(false) => {
                if unread {
                    c.linger().await;
                }
                return Ended::Closed;
            }
            Err(_) => return Ended::Closed,
        }
    }
}

struct Conn<'a, S> {
    io: S,
    /// Bytes read from the client and not yet used.
    buf: BytesMut,
    /// The response head being written.
    wbuf: Vec<u8>,
    limits: &'a Limits,
}

enum HeadRead {
    /// In the slot passed to [`Conn::read_head`].
    Head,
    H2,
    Closed,
}

/// A parsed request head.
pub(crate) struct Head {
    pub(crate) parts: http::request::Parts,
    pub(crate) framing: Framing,
    pub(crate) keep_alive: bool,
    pub(crate) expect_continue: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    None,
    Length(u64),
    Chunked,
}

enum BodyFail {
    /// The client went away, or stalled past the timeout.
    Closed,
    Bad(Reject),
}

/// What woke a read.
enum Fill {
    Data,
    Eof,
    Timeout,
    Shutdown,
}

/// How the response body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    Length(u64),
    Chunked,
    /// Until the connection closes (HTTP/1.0 client, unknown length).
    Eof,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<'_, S> {
    /// Read from the client into `buf` until data arrives, EOF, `due` passes or (when `idle`)
    /// shutdown starts.
    ///
    /// `timer` is moved only when it is armed later than `due`: a timer armed earlier (the last
    /// request's deadline) is left where it is, and when it fires before `due` it is moved to
    /// `due` then. Moving it for every request (take it out of the timer wheel, put it back)
    /// cost more than the read.
    async fn fill(
        &mut self,
        mut timer: Pin<&mut Sleep>,
        due: tokio::time::Instant,
        shutdown: Option<&CancellationToken>,
    ) -> io::Result<Fill> {
        if self.buf.capacity() - self.buf.len() < 1024 {
            self.buf.reserve(READ_CHUNK);
        }
        if timer.deadline() > due {
            timer.as_mut().reset(due);
        }
        let mut cancelled = pin!(async {
            match shutdown {
                Some(s) => s.cancelled().await,
                None => std::future::pending().await,
            }
        });
        loop {
            tokio::select! {
                biased;
                r = self.io.read_buf(&mut self.buf) => {
                    return Ok(if r? == 0 { Fill::Eof } else { Fill::Data })
                }
                _ = timer.as_mut() => {
                    if timer.deadline() >= due {
                        return Ok(Fill::Timeout);
                    }
                    // Armed for an earlier request: not this one's deadline yet.
                    timer.as_mut().reset(due);
                }
                _ = cancelled.as_mut() => return Ok(Fill::Shutdown),
            }
        }
    }

    async fn read_head(
        &mut self,
        mut timer: Pin<&mut Sleep>,
        shutdown: &CancellationToken,
        first: bool,
        slot: &mut Option<Head>,
    ) -> Result<HeadRead, Reject> {
        let mut due = None;
        // Bytes known to hold no end of the head: a head trickled in byte by byte is parsed once
        // it is complete, not once per byte (which would cost its length squared).
        let mut scanned = 0;
        loop {
            if !self.buf.is_empty() {
                let n = self.buf.len().min(H2_PREFACE.len());
                if first && H2_PREFACE.starts_with(&self.buf[..n]) {
                    // "PRI" is no method of ours: wait for the whole preface, then hand over.
                    if n == H2_PREFACE.len() {
                        return Ok(HeadRead::H2);
                    }
                } else if scanned == 0
                    || self.buf.len() >= self.limits.max_head
                    || head_ends_after(&self.buf, scanned)
                {
                    // The first bytes are parsed at once: garbage is answered without waiting.
                    match parse_head(&mut self.buf, self.limits)? {
                        Some(h) => {
                            *slot = Some(h);
                            return Ok(HeadRead::Head);
                        }
                        None => scanned = self.buf.len(),
                    }
                }
            }
            let due =
                *due.get_or_insert_with(|| tokio::time::Instant::now() + self.limits.read_timeout);
            // Shutdown closes a connection between requests, not one in the middle of a head.
            let idle = self.buf.is_empty();
            match self
                .fill(timer.as_mut(), due, idle.then_some(shutdown))
                .await
            {
                Ok(Fill::Data) => {}
                Ok(Fill::Eof | Fill::Timeout | Fill::Shutdown) | Err(_) => {
                    return Ok(HeadRead::Closed)
                }
            }
        }
    }

    async fn read_body(
        &mut self,
        framing: Framing,
        expect_continue: bool,
        mut timer: Pin<&mut Sleep>,
    ) -> Result<RequestBody, BodyFail> {
        let max = self.limits.max_body;
        let n = match framing {
            Framing::None => return Ok(RequestBody::Full(None)),
            Framing::Length(n) if n > max as u64 => return Ok(RequestBody::TooLarge),
            Framing::Length(n) => n as usize,
            Framing::Chunked => return self.read_chunked(expect_continue, timer).await,
        };
        if self.buf.len() < n {
            if expect_continue {
                self.continue_100().await?;
            }
            let deadline = tokio::time::Instant::now() + self.limits.body_timeout;
            self.buf.reserve(n - self.buf.len());
            while self.buf.len() < n {
                self.more_body(timer.as_mut(), deadline).await?;
            }
        }
        Ok(RequestBody::Full(Some(self.buf.split_to(n).freeze())))
    }

    async fn read_chunked(
        &mut self,
        expect_continue: bool,
        mut timer: Pin<&mut Sleep>,
    ) -> Result<RequestBody, BodyFail> {
        if expect_continue && self.buf.is_empty() {
            self.continue_100().await?;
        }
        let deadline = tokio::time::Instant::now() + self.limits.body_timeout;
        let mut decode = Decode::CHUNKED;
        let mut body = BytesMut::new();
        loop {
            match decode.step(&mut self.buf) {
                Ok(Step::Data(d)) => {
                    if body.len() + d.len() > self.limits.max_body {
                        return Ok(RequestBody::TooLarge);
                    }
                    body.extend_from_slice(&d);
                }
                Ok(Step::Done) => return Ok(RequestBody::Full(Some(body.freeze()))),
                Ok(Step::NeedMore) => self.more_body(timer.as_mut(), deadline).await?,
                Err(e) => return Err(BodyFail::Bad(Reject::bad(format!("request body: {e}")))),
            }
        }
    }

    /// Read more of a request body: within `read_timeout` of the last bytes, and before the
    /// body's `deadline` (past it: 408).
    async fn more_body(
        &mut self,
        timer: Pin<&mut Sleep>,
        deadline: tokio::time::Instant,
    ) -> Result<(), BodyFail> {
        let now = tokio::time::Instant::now();
        let due = (now + self.limits.read_timeout).min(deadline);
        match self.fill(timer, due, None).await {
            Ok(Fill::Data) => Ok(()),
            Ok(Fill::Timeout) if tokio::time::Instant::now() >= deadline => {
                Err(BodyFail::Bad(Reject {
                    status: StatusCode::REQUEST_TIMEOUT,
                    message: format!(
                        "request body not received within {} s",
                        self.limits.body_timeout.as_secs_f64()
                    ),
                }))
            }
            _ => Err(BodyFail::Closed),
        }
    }

    async fn continue_100(&mut self) -> Result<(), BodyFail> {
        let r = async {
            self.io.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
            self.io.flush().await
        };
        r.await.map_err(|_| BodyFail::Closed)
    }

    /// Poll `fut` to completion unless the client goes away first (`None`; `fut` is dropped,
    /// which cancels the request). Bytes the client sends meanwhile (a pipelined request) are
    /// kept, up to `max_head`; past that the socket is not read until the response is out.
    async fn watch<T>(&mut self, mut fut: Pin<&mut impl Future<Output = T>>) -> Option<T> {
        poll_fn(|cx| {
            if let Poll::Ready(v) = fut.as_mut().poll(cx) {
                return Poll::Ready(Some(v));
            }
            match self.poll_client(cx) {
                Poll::Ready(()) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }

    /// Ready when the client has closed its side or the connection failed.
    fn poll_client(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        while self.buf.len() < self.limits.max_head {
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(READ_CHUNK);
            }
            match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Ready(Ok(_)) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Pending
    }

    /// Answer a request the server itself refuses (malformed or oversize head), then close.
    async fn reject(&mut self, e: Reject) {
        let body = (self.limits.reject)(&e);
        let mut resp = Response::new(http_body_util::Full::new(body));
        *resp.status_mut() = e.status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if self
            .respond(resp, Version::HTTP_11, false, false)
            .await
            .is_ok()
        {
            self.linger().await;
        }
    }

    /// Write `resp`. `Ok(true)`: the connection stays open for the next request.
    async fn respond<B>(
        &mut self,
        resp: Response<B>,
        version: Version,
        head_only: bool,
        mut keep_alive: bool,
    ) -> io::Result<bool>
    where
        B: Body<Data = Bytes> + Unpin,
    {
        let (parts, mut body) = resp.into_parts();
        let status = parts.status;
        let bodyless_status = status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        let no_body = head_only || bodyless_status;
        if parts
            .headers
            .get(header::CONNECTION)
            .is_some_and(|v| has_token(v.as_bytes(), b"close"))
        {
            keep_alive = false;
        }
        let w = &mut self.wbuf;
        w.clear();
        w.extend_from_slice(b"HTTP/1.1 ");
        w.extend_from_slice(status.as_str().as_bytes());
        w.push(b' ');
        w.extend_from_slice(status.canonical_reason().unwrap_or("Unknown").as_bytes());
        w.extend_from_slice(b"\r\n");
        let mut declared = None;
        for (name, value) in &parts.headers {
            if name == header::CONNECTION || name == header::TRANSFER_ENCODING {
                continue;
            }
            if name == header::CONTENT_LENGTH {
                declared = declared.or_else(|| parse_len(value.as_bytes()));
            }
            push_field(w, name.as_str().as_bytes(), value.as_bytes());
        }
        if !parts.headers.contains_key(header::DATE) {
            DATE.with(|d| push_field(w, b"date", d.get().as_bytes()));
        }
        let out = match (declared, body.size_hint().exact()) {
            (Some(n), _) => Out::Length(n),
            (None, Some(n)) => {
                if !bodyless_status {
                    push_field(w, b"content-length", decimal(n, &mut [0; 20]));
                }
                Out::Length(n)
            }
            (None, None) if no_body => Out::Length(0),
            (None, None) if version == Version::HTTP_11 => {
                push_field(w, b"transfer-encoding", b"chunked");
                Out::Chunked
            }
            (None, None) => {
                keep_alive = false;
                Out::Eof
            }
        };
        if !keep_alive {
            push_field(w, b"connection", b"close");
        } else if version == Version::HTTP_10 {
            push_field(w, b"connection", b"keep-alive");
        }
        w.extend_from_slice(b"\r\n");
        // Written: the map's allocations go to the next head parsed on this thread.
        crate::head::recycle(parts.headers);

        if no_body {
            write_all(&mut self.io, &mut [IoSlice::new(&self.wbuf)]).await?;
            self.io.flush().await?;
            return Ok(keep_alive && !matches!(out, Out::Eof));
        }
        let mut head_sent = false;
        let mut left = match out {
            Out::Length(n) => n,
            _ => u64::MAX,
        };
        // The head goes out with the first body bytes when they are ready, and on its own when
        // they are not (a stream before its first event).
        let mut ready = None;
        match poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await {
            Poll::Ready(f) => ready = Some(f),
            Poll::Pending => {
                write_all(&mut self.io, &mut [IoSlice::new(&self.wbuf)]).await?;
                self.io.flush().await?;
                head_sent = true;
            }
        }
        loop {
            let frame = match ready.take() {
                Some(f) => f,
                None => match self.next_frame(&mut body).await {
                    Some(f) => f,
                    // The client went away: dropping the body cancels the worker's request.
                    None => return Ok(false),
                },
            };
            let mut data = match frame {
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) if d.is_empty() => continue,
                    Ok(d) => d,
                    Err(_) => continue, // trailers: not forwarded
                },
                Some(Err(_)) => {
                    // The body failed mid-way: the client sees a truncated response and a close.
                    if !head_sent {
                        write_all(&mut self.io, &mut [IoSlice::new(&self.wbuf)]).await?;
                    }
                    self.io.flush().await?;
                    return Ok(false);
                }
                None => {
                    let tail: &[u8] = if out == Out::Chunked {
                        b"0\r\n\r\n"
                    } else {
                        b""
                    };
                    let head: &[u8] = if head_sent { b"" } else { &self.wbuf };
                    write_all(&mut self.io, &mut [IoSlice::new(head), IoSlice::new(tail)]).await?;
                    self.io.flush().await?;
                    return Ok(keep_alive && complete(out, left));
                }
            };
            // More than the declared length: cut it there and close.
            let overrun = matches!(out, Out::Length(_)) && data.len() as u64 > left;
            if let Out::Length(_) = out {
                data.truncate(left.min(data.len() as u64) as usize);
                left -= data.len() as u64;
            }
            let end = overrun || body.is_end_stream();
            let mut size = [0u8; 18];
            let (pre, post, tail): (&[u8], &[u8], &[u8]) = match out {
                Out::Chunked => (
                    chunk_prefix(data.len(), &mut size),
                    b"\r\n",
                    if end { b"0\r\n\r\n" } else { b"" },
                ),
                _ => (b"", b"", b""),
            };
            let head: &[u8] = if head_sent { b"" } else { &self.wbuf };
            write_all(
                &mut self.io,
                &mut [
                    IoSlice::new(head),
                    IoSlice::new(pre),
                    IoSlice::new(&data),
                    IoSlice::new(post),
                    IoSlice::new(tail),
                ],
            )
            .await?;
            self.io.flush().await?;
            head_sent = true;
            if overrun {
                return Ok(false);
            }
            if end {
                return Ok(keep_alive && complete(out, left));
            }
        }
    }

    /// The next frame of `body`, or `None` when the client went away first.
    async fn next_frame<B>(
        &mut self,
        body: &mut B,
    ) -> Option<Option<Result<http_body::Frame<Bytes>, B::Error>>>
    where
        B: Body<Data = Bytes> + Unpin,
    {
        poll_fn(|cx| {
            if let Poll::Ready(f) = Pin::new(&mut *body).poll_frame(cx) {
                return Poll::Ready(Some(f));
            }
            match self.poll_client(cx) {
                Poll::Ready(()) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }

    /// Before closing a connection whose request body was not read: stop writing, and read and
    /// drop what the client still sends for a while, so that it reads our response rather than
    /// a reset.
    async fn linger(&mut self) {
        let _ = self.io.shutdown().await;
        let mut sink = [0u8; 8192];
        let mut total = 0usize;
        let _ = tokio::time::timeout(LINGER, async {
            while total < LINGER_BYTES {
                match self.io.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n,
                }
            }
        })
        .await;
    }
}

/// Whether a response body that ended was complete on the wire: a body shorter than its
/// declared length, or a close-delimited one, ends the connection.
fn complete(out: Out, left: u64) -> bool {
    match out {
        Out::Chunked => true,
        Out::Length(_) => left == 0,
        Out::Eof => false,
    }
}

async fn write_all<S: AsyncWrite + Unpin>(io: &mut S, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    let mut bufs = bufs;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = io.write_vectored(bufs).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Whether `buf` holds an empty line (the end of a head) ending past `from`.
fn head_ends_after(buf: &[u8], from: usize) -> bool {
    let tail = &buf[from.saturating_sub(3)..];
    memchr::memmem::find(tail, b"\n\r\n").is_some() || memchr::memmem::find(tail, b"\n\n").is_some()
}

/// Whether a comma-separated field value holds `token` (case-insensitive).
fn has_token(v: &[u8], token: &[u8]) -> bool {
    v.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// Parse a complete request head at the front of `buf` (consumed), or `None` if more bytes are
/// needed.
pub(crate) fn parse_head(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Head>, Reject> {
    let too_large = || Reject {
        status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        message: format!(
            "request head exceeds the limit of {} bytes or {MAX_HEADERS} fields",
            limits.max_head
        ),
    };
    // Where each piece lies in `buf`: the parsed head borrows it, the request shares it.
    let mut spans = FieldSpans::default();
    let (len, n_fields, method, path, minor, framing, keep_alive, expect_continue);
    {
        let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut []);
        len = match req.parse_with_uninit_headers(buf, &mut fields) {
            Ok(httparse::Status::Complete(n)) if n > limits.max_head => return Err(too_large()),
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) if buf.len() >= limits.max_head => {
                return Err(too_large())
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => return Err(too_large()),
            Err(e) => return Err(Reject::bad(format!("malformed request head: {e}"))),
        };
        let base = buf.as_ptr() as usize;
        let at = |s: &[u8]| (s.as_ptr() as usize - base) as u32;
        let span = |s: &[u8]| (at(s), at(s) + s.len() as u32);
        let m = req.method.unwrap_or("").as_bytes();
        let p = req.path.unwrap_or("").as_bytes();
        method = span(m);
        path = span(p);
        minor = req.version.unwrap_or(1);
        let mut f = FramingFields::default();
        n_fields = req.headers.len();
        for h in req.headers.iter() {
            let name = h.name.as_bytes();
            let (ns, ne) = span(name);
            let (vs, ve) = span(h.value);
            spans.push((ns, ne, vs, ve));
            f.field(name, h.value).map_err(|e| Reject::bad(e.0))?;
        }
        f.finish().map_err(|e| Reject::bad(e.0))?;
        if f.chunked && minor == 0 {
            return Err(Reject::bad("transfer-encoding in an HTTP/1.0 request"));
        }
        // RFC 9112 §3.2: an HTTP/1.1 request has exactly one Host field; none or several: 400.
        if f.hosts > 1 || (minor == 1 && f.hosts == 0) {
            return Err(Reject::bad(if f.hosts == 0 {
                "missing Host header"
            } else {
                "more than one Host header"
            }));
        }
        keep_alive = !f.close && (minor == 1 || f.keep_alive);
        framing = match (f.chunked, f.length) {
            (true, _) => Framing::Chunked,
            (false, Some(0) | None) => Framing::None,
            (false, Some(n)) => Framing::Length(n),
        };
        expect_continue = f.expect_continue && minor == 1 && framing != Framing::None;
    }
    let head = buf.split_to(len).freeze();
    let slice = |(a, b): (u32, u32)| head.slice(a as usize..b as usize);
    let method = Method::from_bytes(&slice(method)).map_err(|_| Reject::bad("invalid method"))?;
    let uri =
        Uri::from_maybe_shared(slice(path)).map_err(|_| Reject::bad("invalid request target"))?;
    let mut headers = crate::head::header_map(n_fields);
    for (ns, ne, vs, ve) in spans.iter() {
        let name = header_name(&head[ns as usize..ne as usize])
            .map_err(|_| Reject::bad("invalid header field name"))?;
        let value = HeaderValue::from_maybe_shared(slice((vs, ve)))
            .map_err(|_| Reject::bad("invalid header field value"))?;
        headers.append(name, value);
    }
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.method = method;
    parts.uri = uri;
    parts.version = if minor == 0 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    parts.headers = headers;
    Ok(Some(Head {
        parts,
        framing,
        keep_alive,
        expect_continue,
    }))
}

/// The `date` field value, formatted once a second per thread.
struct DateCache {
    secs: std::cell::Cell<u64>,
    text: std::cell::RefCell<String>,
}

impl DateCache {
    fn get(&self) -> std::cell::Ref<'_, String> {
        let now = SystemTime::now();
        let secs = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if secs != self.secs.get() {
            self.secs.set(secs);
            *self.text.borrow_mut() = httpdate::fmt_http_date(now);
        }
        self.text.borrow()
    }
}

thread_local! {
    static DATE: DateCache = const {
        DateCache { secs: std::cell::Cell::new(u64::MAX), text: std::cell::RefCell::new(String::new()) }
    };
}

/// A stream whose first bytes were already read: they are served again before the stream's own
/// (the HTTP/2 hand-over to hyper).
pub struct Prefixed<S> {
    pre: Bytes,
    io: S,
}

impl<S> Prefixed<S> {
    pub fn new(pre: Bytes, io: S) -> Self {
        Prefixed { pre, io }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.pre.is_empty() {
            let n = this.pre.len().min(out.remaining());
            out.put_slice(&this.pre.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, out)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, b)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        b: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, b)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
