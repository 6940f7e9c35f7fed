//! The HTTP/1.1 server loop against raw sockets and hyper's client, port 0 on loopback.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::*;

/// A whole body (sent with a content-length) or a stream of chunks from a channel (chunked).
enum TBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Result<Bytes, std::io::Error>>),
}

impl Body for TBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            TBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(http_body::Frame::data(b)))),
            TBody::Stream(rx) => rx
                .poll_recv(cx)
                .map(|o| o.map(|r| r.map(http_body::Frame::data))),
        }
    }
    fn is_end_stream(&self) -> bool {
        matches!(self, TBody::Full(None))
    }
    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            TBody::Full(b) => {
                http_body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            TBody::Stream(_) => http_body::SizeHint::default(),
        }
    }
}

#[derive(Default)]
struct Shared {
    /// The sender of the latest `/stream` response (closed once the body is dropped).
    stream: parking_lot::Mutex<Option<mpsc::Sender<Result<Bytes, std::io::Error>>>>,
    handler_dropped: AtomicBool,
    handler_started: AtomicBool,
    rejected: AtomicUsize,
}

struct DropFlag<'a>(&'a AtomicBool);

impl Drop for DropFlag<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

async fn handle(s: Arc<Shared>, req: Request<RequestBody>) -> Response<TBody> {
    let (parts, body) = req.into_parts();
    let full = |status: StatusCode, b: String| {
        let mut r = Response::new(TBody::Full(Some(Bytes::from(b))));
        *r.status_mut() = status;
        r
    };
    let body = match body {
        RequestBody::Full(b) => b.unwrap_or_default(),
        RequestBody::TooLarge => return full(StatusCode::PAYLOAD_TOO_LARGE, "too large".into()),
    };
    match parts.uri.path() {
        "/stream" => {
            let (tx, rx) = mpsc::channel(8);
            *s.stream.lock() = Some(tx);
            Response::new(TBody::Stream(rx))
        }
        "/slow" => {
            let _flag = DropFlag(&s.handler_dropped);
            s.handler_started.store(true, Ordering::SeqCst);
            std::future::pending::<()>().await;
            unreachable!()
        }
        "/204" => {
            let mut r = Response::new(TBody::Full(None));
            *r.status_mut() = StatusCode::NO_CONTENT;
            r
        }
        "/short" => {
            // Declares more than it has.
            let mut r = full(StatusCode::OK, "12345".into());
            r.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from_static("10"));
            r
        }
        path => full(
            StatusCode::OK,
            format!("{} {path} {}", parts.method, String::from_utf8_lossy(&body)),
        ),
    }
}

fn limits(s: &Arc<Shared>) -> Limits {
    let s = s.clone();
    Limits {
        max_head: 1024,
        max_body: 64,
        read_timeout: Duration::from_millis(400),
        body_timeout: Duration::from_millis(1500),
        reject: Arc::new(move |r: &Reject| {
            s.rejected.fetch_add(1, Ordering::SeqCst);
            let v = serde_json::json!({"error": {"message": r.message, "type": "invalid_request_error"}});
            Bytes::from(v.to_string())
        }),
    }
}

struct Server {
    addr: std::net::SocketAddr,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    /// How each served connection ended: `true` for an HTTP/2 hand-over, with the bytes read.
    ended: mpsc::UnboundedReceiver<Option<Bytes>>,
}

async fn server() -> Server {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let shared = Arc::new(Shared::default());
    let shutdown = CancellationToken::new();
    let (tx, ended) = mpsc::unbounded_channel();
    let (s, sd) = (shared.clone(), shutdown.clone());
    tokio::spawn(async move {
        let limits = Arc::new(limits(&s));
        loop {
            let (io, _) = l.accept().await.unwrap();
            let (s, sd, limits, tx) = (s.clone(), sd.clone(), limits.clone(), tx.clone());
            tokio::spawn(async move {
                let h = move |req| handle(s.clone(), req);
                let e = match serve(io, &h, &limits, &sd).await {
                    Ended::Closed => None,
                    Ended::H2(_, read) => Some(read),
                };
                let _ = tx.send(e);
            });
        }
    });
    Server {
        addr,
        shared,
        shutdown,
        ended,
    }
}

/// Send `wire`, then read until the server closes (bounded wait).
async fn raw(addr: std::net::SocketAddr, wire: &[u8]) -> String {
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(wire).await.unwrap();
    read_all(&mut c).await
}

async fn read_all(c: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut out))
        .await
        .expect("the server closes the connection")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// Read until `needle` has arrived (bounded wait).
async fn read_until(c: &mut TcpStream, needle: &str) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 4096];
    while !String::from_utf8_lossy(&out).contains(needle) {
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut b))
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} in {:?}", String::from_utf8_lossy(&out)))
            .unwrap();
        assert!(
            n > 0,
            "closed before {needle:?}: {:?}",
            String::from_utf8_lossy(&out)
        );
        out.extend_from_slice(&b[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn hyper_client(
    addr: std::net::SocketAddr,
) -> hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>> {
    let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
    let (send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
    tokio::spawn(conn);
    send
}

fn get(path: &str) -> Request<http_body_util::Full<Bytes>> {
    Request::get(path)
        .header("host", "x")
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap()
}

async fn wait_for(flag: &AtomicBool, what: &str) {
    for _ in 0..500 {
        if flag.load(Ordering::SeqCst) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what} did not happen within 5 s");
}

#[tokio::test]
async fn keep_alive_requests_share_one_connection() {
    let s = server().await;
    let mut c = hyper_client(s.addr).await;
    for i in 0..3 {
        let req = Request::post(format!("/echo/{i}"))
            .header("host", "x")
            .body(http_body_util::Full::new(Bytes::from(format!("body {i}"))))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let want = format!("POST /echo/{i} body {i}");
        assert_eq!(
            resp.headers()[header::CONTENT_LENGTH],
            want.len().to_string().as_str()
        );
        assert!(resp.headers().contains_key(header::DATE));
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, want);
    }
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let s = server().await;
    let out = raw(
        s.addr,
        b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\none\
          GET /b HTTP/1.1\r\nhost: x\r\n\r\n\
          POST /c HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 5\r\n\r\nthree",
    )
    .await;
    let a = out.find("POST /a one").expect(&out);
    let b = out.find("GET /b ").expect(&out);
    let c = out.find("POST /c three").expect(&out);
    assert!(a < b && b < c, "{out}");
    assert_eq!(out.matches("HTTP/1.1 200 OK\r\n").count(), 3, "{out}");
    assert!(out.contains("connection: close\r\n"), "{out}");
}

#[tokio::test]
async fn chunked_request_bodies_are_joined_even_byte_by_byte() {
    let s = server().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.set_nodelay(true).unwrap();
    let wire: &[u8] =
        b"POST /up HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
        3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\nx-trailer: t\r\n\r\n";
    for b in wire {
        c.write_all(&[*b]).await.unwrap();
    }
    let out = read_all(&mut c).await;
    assert!(out.contains("POST /up abcdefg"), "{out}");
}

#[tokio::test]
async fn expect_100_continue_is_answered_before_the_body() {
    let s = server().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(
        b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 5\r\nconnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let first = read_until(&mut c, "\r\n\r\n").await;
    assert_eq!(first, "HTTP/1.1 100 Continue\r\n\r\n");
    c.write_all(b"hello").await.unwrap();
    let out = read_all(&mut c).await;
    assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
    assert!(out.ends_with("POST /e hello"), "{out}");
}

#[tokio::test]
async fn oversize_bodies_reach_the_handler_as_too_large_and_close() {
    let s = server().await;
    // Declared too large: not read; the client still gets the answer, then the close.
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
        .await
        .unwrap();
    c.write_all(&[b'a'; 500]).await.unwrap();
    let out = read_all(&mut c).await;
    assert!(
        out.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
        "{out}"
    );
    assert!(out.contains("connection: close\r\n"), "{out}");
    // Chunked past the limit.
    let mut wire = b"POST /big HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..3 {
        wire.extend_from_slice(b"20\r\n");
        wire.extend_from_slice(&[b'b'; 32]);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    let out = raw(s.addr, &wire).await;
    assert!(out.starts_with("HTTP/1.1 413 "), "{out}");
    // At the limit exactly: read.
    let mut wire =
        b"POST /ok HTTP/1.1\r\nhost: x\r\ncontent-length: 64\r\nconnection: close\r\n\r\n".to_vec();
    wire.extend_from_slice(&[b'c'; 64]);
    let out = raw(s.addr, &wire).await;
    assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
}

#[tokio::test]
async fn bad_heads_get_openai_errors_and_a_close() {
    let s = server().await;
    let many: String = (0..101).map(|i| format!("x-h{i}: v\r\n")).collect();
    let long = format!(
        "GET / HTTP/1.1\r\nhost: t\r\nx-long: {}\r\n\r\n",
        "a".repeat(1100)
    );
    let cases: Vec<(Vec<u8>, &str, &str)> = vec![
        (
            b"hello there\r\n\r\n".to_vec(),
            "400 Bad Request",
            "malformed request head",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n".to_vec(),
            "400 Bad Request",
            "both transfer-encoding and content-length",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: gzip\r\n\r\n".to_vec(),
            "400 Bad Request",
            "unsupported transfer-encoding",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 1x\r\n\r\n".to_vec(),
            "400 Bad Request",
            "invalid content-length",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n".to_vec(),
            "400 Bad Request",
            "conflicting content-length",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".to_vec(),
            "400 Bad Request",
            "bad chunk size",
        ),
        (
            format!("GET / HTTP/1.1\r\nhost: t\r\n{many}\r\n").into_bytes(),
            "431 Request Header Fields Too Large",
            "or 100 fields",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: identity, chunked\r\n\r\n0\r\n\r\n"
                .to_vec(),
            "400 Bad Request",
            "unsupported transfer-encoding",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
                .to_vec(),
            "400 Bad Request",
            "unsupported transfer-encoding",
        ),
        (
            b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                .to_vec(),
            "400 Bad Request",
            "unsupported transfer-encoding",
        ),
        (
            b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            "400 Bad Request",
            "transfer-encoding in an HTTP/1.0 request",
        ),
        (
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            "400 Bad Request",
            "missing Host header",
        ),
        (
            b"GET / HTTP/1.1\r\nhost: a\r\nHost: b\r\n\r\n".to_vec(),
            "400 Bad Request",
            "more than one Host header",
        ),
        (
            b"GET / HTTP/1.0\r\nhost: a\r\nhost: a\r\n\r\n".to_vec(),
            "400 Bad Request",
            "more than one Host header",
        ),
        (
            long.into_bytes(),
            "431 Request Header Fields Too Large",
            "request head exceeds the limit of 1024 bytes",
        ),
    ];
    let n = cases.len();
    for (wire, status, msg) in cases {
        let out = raw(s.addr, &wire).await;
        assert!(out.starts_with(&format!("HTTP/1.1 {status}\r\n")), "{out}");
        assert!(out.contains("connection: close\r\n"), "{out}");
        assert!(out.contains("content-type: application/json"), "{out}");
        let body = &out[out.find("\r\n\r\n").unwrap() + 4..];
        let v: serde_json::Value = serde_json::from_str(body).expect(body);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
        assert!(body.contains(msg), "{msg:?} in {body}");
    }
    assert_eq!(s.shared.rejected.load(Ordering::SeqCst), n);
}

/// A body that dribbles in (a byte per read timeout, so no single read times out) is cut off at
/// the body deadline with a 408, and the handler never sees it.
#[tokio::test]
async fn a_dribbled_body_gets_408_at_the_body_deadline() {
    let s = server().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /slowbody HTTP/1.1\r\nhost: t\r\ncontent-length: 60\r\n\r\n")
        .await
        .unwrap();
    // 50 ms per byte: far under the 400 ms read timeout even on a busy machine (a late wake-up
    // costs margin, not the outcome), past the 1.5 s body deadline by byte 31 of 60.
    let mut answer = Vec::new();
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if c.write_all(b"x").await.is_err() {
            break;
        }
        let mut tmp = [0u8; 1024];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(1), c.read(&mut tmp)).await {
            answer.extend_from_slice(&tmp[..n]);
            if n == 0 || !answer.is_empty() {
                break;
            }
        }
    }
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), c.read_to_end(&mut rest)).await;
    answer.extend_from_slice(&rest);
    let out = String::from_utf8_lossy(&answer);
    assert!(out.starts_with("HTTP/1.1 408 Request Timeout\r\n"), "{out}");
    assert!(
        out.contains("request body not received within 1.5 s"),
        "{out}"
    );
    assert!(out.contains("connection: close\r\n"), "{out}");
    assert_eq!(s.shared.rejected.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn http10_closes_unless_asked_to_keep_alive() {
    let s = server().await;
    let out = raw(s.addr, b"GET /a HTTP/1.0\r\n\r\n").await;
    assert!(out.contains("connection: close\r\n"), "{out}");
    assert!(out.ends_with("GET /a "), "{out}");

    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"GET /b HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        .await
        .unwrap();
    let out = read_until(&mut c, "GET /b ").await;
    assert!(out.contains("connection: keep-alive\r\n"), "{out}");
    // Still open: a second request on it, and an unknown-length body is close-delimited.
    c.write_all(b"GET /stream HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        .await
        .unwrap();
    let tx = loop {
        if let Some(tx) = s.shared.stream.lock().take() {
            break tx;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    tx.send(Ok(Bytes::from_static(b"part1 "))).await.unwrap();
    tx.send(Ok(Bytes::from_static(b"part2"))).await.unwrap();
    drop(tx);
    let out = read_all(&mut c).await;
    assert!(!out.contains("transfer-encoding"), "{out}");
    assert!(out.contains("connection: close\r\n"), "{out}");
    assert!(out.ends_with("\r\n\r\npart1 part2"), "{out}");
}

#[tokio::test]
async fn streams_are_chunked_and_each_frame_is_sent_at_once() {
    let s = server().await;
    let mut c = hyper_client(s.addr).await;
    let resp = c.send_request(get("/stream")).await.unwrap();
    assert_eq!(resp.headers()[header::TRANSFER_ENCODING], "chunked");
    let tx = s.shared.stream.lock().take().unwrap();
    let mut body = resp.into_body();
    for part in ["data: 1\n\n", "data: 2\n\n"] {
        tx.send(Ok(Bytes::from_static(part.as_bytes())))
            .await
            .unwrap();
        // Arrives before the next one is even produced.
        let f = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(f.into_data().unwrap(), part);
    }
    drop(tx);
    assert!(body.frame().await.is_none());
    // The connection is still good for the next request.
    let resp = c.send_request(get("/after")).await.unwrap();
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(b, "GET /after ");
}

#[tokio::test]
async fn a_client_gone_mid_stream_drops_the_body() {
    let s = server().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let _ = read_until(&mut c, "\r\n\r\n").await;
    let tx = s.shared.stream.lock().take().unwrap();
    tx.send(Ok(Bytes::from_static(b"first"))).await.unwrap();
    let _ = read_until(&mut c, "first").await;
    assert!(!tx.is_closed());
    drop(c);
    // No write is needed to notice: the body (and with it the worker's request) goes at once.
    tokio::time::timeout(Duration::from_secs(5), tx.closed())
        .await
        .expect("the body is dropped");
}

#[tokio::test]
async fn a_client_gone_while_the_handler_runs_cancels_it() {
    let s = server().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    wait_for(&s.shared.handler_started, "the handler starting").await;
    drop(c);
    wait_for(&s.shared.handler_dropped, "dropping the handler").await;
}

#[tokio::test]
async fn head_204_and_short_bodies() {
    let s = server().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"HEAD /h HTTP/1.1\r\nhost: x\r\n\r\nGET /204 HTTP/1.1\r\nhost: x\r\n\r\nGET /short HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let out = read_all(&mut c).await;
    let parts: Vec<&str> = out.split("HTTP/1.1 ").skip(1).collect();
    assert_eq!(parts.len(), 3, "{out}");
    // HEAD: the length of what GET would send, no body.
    assert!(parts[0].contains("content-length: 8\r\n"), "{out}");
    assert!(parts[0].ends_with("\r\n\r\n"), "{out}");
    // 204: neither length nor body.
    assert!(parts[1].starts_with("204 No Content\r\n"), "{out}");
    assert!(!parts[1].contains("content-length"), "{out}");
    assert!(parts[1].ends_with("\r\n\r\n"), "{out}");
    // Shorter than declared: what there is, then the close.
    assert!(parts[2].contains("content-length: 10\r\n"), "{out}");
    assert!(parts[2].ends_with("\r\n\r\n12345"), "{out}");
}

#[tokio::test]
async fn idle_and_slow_connections_are_closed_after_the_read_timeout() {
    let s = server().await;
    // Nothing sent.
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    assert_eq!(read_all(&mut c).await, "");
    // Half a head.
    let out = raw(s.addr, b"GET / HTTP/1.1\r\nhost: t\r\nhost").await;
    assert_eq!(out, "");
    // Half a body.
    let out = raw(
        s.addr,
        b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\nabc",
    )
    .await;
    assert_eq!(out, "");
    assert_eq!(s.shared.rejected.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn shutdown_closes_idle_connections_and_lets_streams_finish() {
    let mut s = server().await;
    let mut idle = TcpStream::connect(s.addr).await.unwrap();
    idle.write_all(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let _ = read_until(&mut idle, "GET /x ").await;
    let mut busy = TcpStream::connect(s.addr).await.unwrap();
    busy.write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let _ = read_until(&mut busy, "\r\n\r\n").await;
    let tx = s.shared.stream.lock().take().unwrap();
    s.shutdown.cancel();
    assert_eq!(read_all(&mut idle).await, "", "the idle connection closes");
    assert_eq!(s.ended.recv().await, Some(None));
    // The stream goes on to its end, then its connection closes.
    tx.send(Ok(Bytes::from_static(b"still here")))
        .await
        .unwrap();
    drop(tx);
    let out = read_all(&mut busy).await;
    assert!(out.contains("still here"), "{out}");
    assert!(out.ends_with("0\r\n\r\n"), "{out}");
    assert_eq!(s.ended.recv().await, Some(None));
}

#[tokio::test]
async fn the_http2_preface_is_handed_over_with_what_was_read() {
    let mut s = server().await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    // In two pieces: the first does not decide it.
    c.write_all(&H2_PREFACE[..5]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    c.write_all(&H2_PREFACE[5..]).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), s.ended.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.as_deref(), Some(H2_PREFACE));
    // A method that merely starts like the preface is HTTP/1.
    let out = raw(
        s.addr,
        b"PRIX / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(out.ends_with("PRIX / "), "{out}");
}

#[test]
fn small_helpers() {
    assert_eq!(chunk_prefix(0, &mut [0; 18]), b"0\r\n");
    assert_eq!(chunk_prefix(0x1a2b, &mut [0; 18]), b"1a2b\r\n");
    assert_eq!(
        chunk_prefix(usize::MAX, &mut [0; 18]),
        b"ffffffffffffffff\r\n"
    );
    assert_eq!(decimal(0, &mut [0; 20]), b"0");
    assert_eq!(decimal(u64::MAX, &mut [0; 20]), b"18446744073709551615");
    assert_eq!(parse_len(b"42"), Some(42));
    assert_eq!(parse_len(b"7, 7"), Some(7));
    assert_eq!(parse_len(b"7, 8"), None);
    assert_eq!(parse_len(b"+7"), None);
    assert_eq!(parse_len(b""), None);
    assert!(has_token(b"Keep-Alive, Upgrade", b"keep-alive"));
    let head = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n";
    for from in 0..head.len() {
        // The end of the head is found wherever the scan resumes, as long as it is not past it.
        assert!(head_ends_after(head, from), "from {from}");
    }
    assert!(!head_ends_after(b"GET / HTTP/1.1\r\nhost: x\r\n", 0));
    assert!(head_ends_after(b"GET / HTTP/1.0\n\n", 14));
    assert!(!has_token(b"closed", b"close"));
}

/// The read timeout counts from each request's wait, not the first: the timer is left armed at
/// an earlier request's deadline and moved only when that fires (paused time, in-memory pipe).
#[tokio::test(start_paused = true)]
async fn the_read_timeout_counts_from_the_last_request() {
    let shared = Arc::new(Shared::default());
    let lim = limits(&shared);
    let timeout = lim.read_timeout;
    let (client, io) = tokio::io::duplex(1 << 16);
    let sd = CancellationToken::new();
    let server = tokio::spawn(async move {
        let h = move |req| handle(shared.clone(), req);
        let _ = serve(io, &h, &lim, &sd).await;
        tokio::time::Instant::now()
    });
    let (mut r, mut w) = tokio::io::split(client);
    let mut got = Vec::new();
    ask(&mut r, &mut w, &mut got, "/a").await;
    // Each wait is under the timeout, together they pass the first request's deadline.
    tokio::time::sleep(timeout * 3 / 4).await;
    ask(&mut r, &mut w, &mut got, "/b").await;
    tokio::time::sleep(timeout * 3 / 4).await;
    ask(&mut r, &mut w, &mut got, "/c").await;
    let last = tokio::time::Instant::now();
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).await.unwrap();
    let closed = server.await.unwrap();
    assert_eq!(
        closed - last,
        timeout,
        "closed one timeout after the last request"
    );
}

/// Sends `GET path` on the pipe and reads until its answer arrived.
async fn ask<R, W>(r: &mut R, w: &mut W, got: &mut Vec<u8>, path: &str)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    w.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let want = format!("GET {path} ");
    let mut b = [0u8; 1024];
    while !String::from_utf8_lossy(got).contains(&want) {
        let n = r.read(&mut b).await.unwrap();
        assert!(n > 0, "closed before the answer to {path}");
        got.extend_from_slice(&b[..n]);
    }
}
