use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;
use crate::chunked::tests::{CHUNKED, CHUNKED_DATA};

fn head_of(wire: &[u8], method: &Method) -> Result<Option<Parsed>, Error> {
    let mut buf = BytesMut::from(wire);
    parse_head(&mut buf, method)
}

#[test]
fn response_heads_lose_hop_by_hop_fields_and_pick_the_framing() {
    let wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: keep-alive, x-hop\r\nx-hop: 1\r\nkeep-alive: timeout=5\r\ntransfer-encoding: chunked\r\nx-request-id: abc\r\n\r\n";
    let Some(Parsed::Head(status, h, decode, keep)) = head_of(wire, &Method::POST).unwrap() else {
        panic!("complete head");
    };
    assert_eq!(status, StatusCode::OK);
    assert_eq!(decode, Decode::Chunked(Chunk::Size));
    assert!(keep);
    let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
    assert_eq!(names, ["content-type", "x-request-id"]);

    // Both framings at once, or a coding other than a single `chunked`: refused, as requests
    // are (the same rules: `head.rs`).
    for wire in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\n\r\n",
        b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
    ] {
        assert!(
            head_of(wire, &Method::POST).is_err(),
            "{}",
            String::from_utf8_lossy(wire)
        );
    }

    // HTTP/1.0 and `connection: close` are not reused; no length means read to the end.
    let Some(Parsed::Head(_, _, decode, keep)) =
        head_of(b"HTTP/1.0 200 OK\r\n\r\n", &Method::POST).unwrap()
    else {
        panic!()
    };
    assert_eq!((decode, keep), (Decode::Eof, false));
    let Some(Parsed::Head(_, h, decode, keep)) = head_of(
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi",
        &Method::POST,
    )
    .unwrap() else {
        panic!()
    };
    assert_eq!((decode, keep), (Decode::Length(2), false));
    assert_eq!(h[header::CONTENT_LENGTH], "2");

    // No body for 204, nor for HEAD.
    let Some(Parsed::Head(_, _, decode, _)) =
        head_of(b"HTTP/1.1 204 No Content\r\n\r\n", &Method::POST).unwrap()
    else {
        panic!()
    };
    assert_eq!(decode, Decode::Done);
    let Some(Parsed::Head(_, _, decode, _)) = head_of(
        b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n",
        &Method::HEAD,
    )
    .unwrap() else {
        panic!()
    };
    assert_eq!(decode, Decode::Done);
}

/// A head over the limit is refused whether it arrives in pieces or whole in one read (a 100 KB
/// head once passed because the limit was only checked while the head was incomplete).
#[test]
fn response_heads_over_the_limit_are_refused_however_they_arrive() {
    let mut wire = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n".to_vec();
    wire.extend_from_slice(format!("x-big: {}\r\n\r\n", "a".repeat(100 << 10)).as_bytes());
    let e = head_of(&wire, &Method::POST).err().expect("refused whole");
    assert!(e.to_string().contains("larger than"), "{e}");
    let e = head_of(&wire[..MAX_HEAD + 10], &Method::POST)
        .err()
        .expect("refused in pieces");
    assert!(e.to_string().contains("larger than"), "{e}");
    let many: String = (0..=MAX_HEADERS)
        .map(|i| format!("x-h{i}: v\r\n"))
        .collect();
    let wire = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
    assert!(head_of(wire.as_bytes(), &Method::POST).is_err());
}

#[test]
fn bad_or_partial_response_heads() {
    assert!(matches!(
        head_of(b"HTTP/1.1 200 OK\r\ncontent-le", &Method::POST),
        Ok(None)
    ));
    assert!(matches!(
        head_of(b"HTTP/1.1 100 Continue\r\n\r\n", &Method::POST),
        Ok(Some(Parsed::Interim))
    ));
    for bad in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"SSH-2.0-OpenSSH\r\n\r\n",
    ] {
        assert!(
            head_of(bad, &Method::POST).is_err(),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn request_heads_keep_end_to_end_fields_only() {
    let mut h = HeaderMap::new();
    h.insert(header::HOST, "gateway:8080".parse().unwrap());
    h.insert(
        header::CONNECTION,
        "keep-alive, x-secret-hop".parse().unwrap(),
    );
    h.insert("x-secret-hop", "1".parse().unwrap());
    h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
    h.insert(header::CONTENT_LENGTH, "999".parse().unwrap());
    h.insert(header::EXPECT, "100-continue".parse().unwrap());
    h.insert(header::AUTHORIZATION, "Bearer client-key".parse().unwrap());
    h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    h.append("x-custom", "one".parse().unwrap());
    h.append("x-custom", "two".parse().unwrap());
    let authority: Authority = "10.0.0.7:8000".parse().unwrap();
    let body = Bytes::from_static(b"{\"model\":\"m\"}");
    let worker_auth = HeaderValue::from_static("Bearer worker-key");
    let mut out = Outgoing {
        https: false,
        method: &Method::POST,
        authority: &authority,
        path_prefix: "/base",
        path_and_query: "/v1/chat/completions?x=1",
        headers: &h,
        strip_client_auth: false,
        worker_auth: None,
        traceparent: None,
        body: &body,
    };
    let text = String::from_utf8(out.head()).unwrap();
    assert_eq!(
        text,
        "POST /base/v1/chat/completions?x=1 HTTP/1.1\r\nhost: 10.0.0.7:8000\r\n\
         authorization: Bearer client-key\r\ncontent-type: application/json\r\n\
         x-custom: one\r\nx-custom: two\r\ncontent-length: 13\r\n\r\n"
    );
    out.strip_client_auth = true;
    assert!(!String::from_utf8(out.head())
        .unwrap()
        .contains("authorization"));
    out.worker_auth = Some(&worker_auth);
    let text = String::from_utf8(out.head()).unwrap();
    assert!(text.contains("authorization: Bearer worker-key\r\n"));
    assert!(!text.contains("client-key"));
    // Tracing: the attempt's traceparent replaces the client's, once.
    let mut h2 = h.clone();
    h2.insert("traceparent", "00-client".parse().unwrap());
    out.headers = &h2;
    out.traceparent = Some(b"00-attempt");
    let text = String::from_utf8(out.head()).unwrap();
    assert_eq!(text.matches("traceparent").count(), 1, "{text}");
    assert!(text.contains("traceparent: 00-attempt\r\n"), "{text}");
}

thread_local! {
    /// Each test's pool (a test runs on one thread).
    static POOL: Pool = Pool::default();
}

fn pool() -> Pool {
    POOL.with(Pool::clone)
}

fn idle_count(a: &Authority) -> usize {
    pool().idle_count(a)
}

fn evict_idle(now: Instant) {
    pool().evict_idle(now)
}

fn settings() -> Settings {
    Settings {
        connect_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(60),
        max_idle_per_host: 4,
        on_connect: None,
        on_stray: None,
        tls: None,
    }
}

/// A worker that answers each request on a connection with `answer(n)` (n counts requests over
/// all connections) and closes the connection after it if `close_after` says so. Returns its
/// address and the number of connections it accepted.
async fn fake_worker(
    answer: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static,
    close_after: impl Fn(usize) -> bool + Send + Sync + 'static,
) -> (Authority, Arc<AtomicUsize>) {
    misbehaving_worker(answer, close_after, |_| None).await
}

/// [`fake_worker`] that, after answering request n, waits and writes `later(n)` (bytes that belong
/// to no request: a stray response, the rest of an undercounted body) on the same connection.
async fn misbehaving_worker(
    answer: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static,
    close_after: impl Fn(usize) -> bool + Send + Sync + 'static,
    later: impl Fn(usize) -> Option<(Duration, Vec<u8>)> + Send + Sync + 'static,
) -> (Authority, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let (answer, close_after, later) = (Arc::new(answer), Arc::new(close_after), Arc::new(later));
    let c = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let (answer, close_after, later, requests) = (
                answer.clone(),
                close_after.clone(),
                later.clone(),
                requests.clone(),
            );
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // Read one request: head, then content-length bytes.
                    let mut tmp = [0u8; 4096];
                    let (head_end, len) = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
                            let len = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length: "))
                                .and_then(|v| v.trim().parse::<usize>().ok())
                                .unwrap_or(0);
                            break (i + 4, len);
                        }
                        match s.read(&mut tmp).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    };
                    while buf.len() < head_end + len {
                        match s.read(&mut tmp).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    }
                    buf.drain(..head_end + len);
                    let n = requests.fetch_add(1, Ordering::SeqCst);
                    if s.write_all(&answer(n)).await.is_err() {
                        return;
                    }
                    if let Some((wait, bytes)) = later(n) {
                        tokio::time::sleep(wait).await;
                        if s.write_all(&bytes).await.is_err() {
                            return;
                        }
                    }
                    if close_after(n) {
                        return;
                    }
                }
            });
        }
    });
    (addr.to_string().parse().unwrap(), conns)
}

/// A small POST to `authority`, up to the response head.
async fn send_post(authority: &Authority, s: &Settings) -> Result<Response, Error> {
    let h = HeaderMap::new();
    let body = Bytes::from_static(b"{}");
    let req = Outgoing {
        https: false,
        method: &Method::POST,
        authority,
        path_prefix: "",
        path_and_query: "/v1/completions",
        headers: &h,
        strip_client_auth: false,
        worker_auth: None,
        traceparent: None,
        body: &body,
    };
    send(&req, s, &pool()).await
}

async fn post(authority: &Authority, s: &Settings) -> Result<(StatusCode, Vec<u8>), Error> {
    let r = send_post(authority, s).await?;
    let data = r.body.collect().await?.to_bytes();
    Ok((r.status, data.to_vec()))
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

#[tokio::test(flavor = "current_thread")]
async fn connections_are_reused_and_stale_ones_replaced() {
    let s = settings();
    // Keep-alive: three requests, one connection.
    let (a, conns) = fake_worker(|_| OK.to_vec(), |_| false).await;
    for _ in 0..3 {
        assert_eq!(
            post(&a, &s).await.unwrap(),
            (StatusCode::OK, b"ok".to_vec())
        );
        assert_eq!(idle_count(&a), 1);
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1);

    // The worker closes each connection after answering: the pooled connection is found dead
    // (or fails on use) and the request goes out again on a new one, without an error.
    let (b, conns) = fake_worker(|_| OK.to_vec(), |_| true).await;
    for i in 0..3 {
        assert_eq!(post(&b, &s).await.unwrap().1, b"ok", "request {i}");
        tokio::task::yield_now().await;
    }
    assert_eq!(conns.load(Ordering::SeqCst), 3);

    // The worker reads the second request on a kept-alive connection and closes it unanswered
    // (what an idle-timeout close racing the request looks like): sent again on a new one.
    let (r, conns) = fake_worker(
        |n| if n == 1 { Vec::new() } else { OK.to_vec() },
        |n| n == 1,
    )
    .await;
    for _ in 0..3 {
        assert_eq!(post(&r, &s).await.unwrap().1, b"ok");
    }
    assert_eq!(conns.load(Ordering::SeqCst), 2);

    // `connection: close` from the worker: not pooled.
    let (c, _) = fake_worker(
        |_| b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok".to_vec(),
        |_| true,
    )
    .await;
    post(&c, &s).await.unwrap();
    assert_eq!(idle_count(&c), 0);

    // Idle connections past their time are closed by the sweep.
    evict_idle(Instant::now() + s.idle_timeout);
    assert_eq!(idle_count(&a), 0);
}

/// A worker that writes bytes after a finished response (a second, stray response; the rest of a
/// body its content-length undercounted) must never have them read as the next request's answer,
/// however soon after the last use the connection is checked out again: the pooled connection is
/// found readable at checkout and closed, and the next request gets its own answer on a new one.
#[tokio::test(flavor = "current_thread")]
async fn bytes_written_after_a_response_never_answer_the_next_request() {
    let s = settings();
    let numbered = |n: usize| {
        let body = format!("answer-{n}");
        format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    // What the worker writes 5 ms after each answer: a stray response, or the rest of a body
    // whose length it undercounted.
    let stray = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray".to_vec();
    let undercount = b"-rest-of-the-body".to_vec();
    for (case, bytes) in [stray, undercount].into_iter().enumerate() {
        let later = Some((Duration::from_millis(5), bytes));
        let (a, conns) = misbehaving_worker(numbered, |_| false, move |_| later.clone()).await;
        for i in 0..4 {
            let (status, body) = post(&a, &s).await.unwrap();
            assert_eq!(
                (status, String::from_utf8(body).unwrap()),
                (StatusCode::OK, format!("answer-{i}")),
                "case {case}, request {i}"
            );
            // The stray bytes arrive well within what used to be the no-probe window.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        assert_eq!(
            conns.load(Ordering::SeqCst),
            4,
            "case {case}: every connection that turned readable while idle was closed"
        );
    }
    // Stray bytes that arrive together with the response are caught at the end of the body.
    let (b, conns) = fake_worker(
        move |n| {
            let mut w = numbered(n);
            w.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray");
            w
        },
        |_| false,
    )
    .await;
    for i in 0..3 {
        assert_eq!(
            post(&b, &s).await.unwrap().1,
            format!("answer-{i}").into_bytes()
        );
    }
    assert_eq!(conns.load(Ordering::SeqCst), 3);
}

/// A worker caught writing after its response (here: a duplicate of every answer, 5 ms late, the
/// pattern that shifts every later answer on a connection by one when the next request is written
/// before the duplicate arrives) gets a fresh connection for every request from then on: no
/// answer can be another request's, whatever the timing.
#[tokio::test(flavor = "current_thread")]
async fn a_worker_caught_writing_after_its_response_gets_no_reused_connections() {
    let strays = Arc::new(AtomicUsize::new(0));
    let seen = strays.clone();
    let s = Settings {
        on_stray: Some(Arc::new(move |_: &Authority| {
            seen.fetch_add(1, Ordering::SeqCst);
        })),
        ..settings()
    };
    let numbered = |n: usize| {
        let body = format!("answer-{n}");
        format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    let (a, conns) = misbehaving_worker(
        numbered,
        |_| false,
        move |n| Some((Duration::from_millis(5), numbered(n))),
    )
    .await;
    // The first answer, then a pause: its duplicate is caught at the next checkout.
    assert_eq!(post(&a, &s).await.unwrap().1, b"answer-0");
    tokio::time::sleep(Duration::from_millis(40)).await;
    // From here on, requests follow each other at once (the duplicate would arrive after the
    // next request was written): each gets its own answer on its own connection.
    for i in 1..6 {
        let (status, body) = post(&a, &s).await.unwrap();
        assert_eq!(
            (status, String::from_utf8(body).unwrap()),
            (StatusCode::OK, format!("answer-{i}"))
        );
        assert_eq!(idle_count(&a), 0, "nothing pooled for a quarantined worker");
    }
    assert_eq!(strays.load(Ordering::SeqCst), 1);
    assert_eq!(
        conns.load(Ordering::SeqCst),
        6,
        "a new connection per request"
    );
    // The quarantine ends with the sweep after its time.
    evict_idle(Instant::now() + STRAY_QUARANTINE + Duration::from_secs(1));
}

/// A pooled connection keeps its read buffer for the next response: a response body still held
/// by its reader when the next one arrives on the same connection is left as it was; a buffer a
/// large response grew is not kept; every answer arrives whole.
#[tokio::test(flavor = "current_thread")]
async fn pooled_read_buffers_never_overwrite_a_held_body() {
    let s = settings();
    // Response n's body: small ones numbered, every third one large.
    let want = |n: usize| match n % 3 {
        1 => vec![b'x'; 3 * KEEP_BUF],
        0 => format!("first-{n:04}").into_bytes(),
        _ => format!("second-{n:04}").into_bytes(),
    };
    let (a, conns) = fake_worker(
        move |n| {
            let body = want(n);
            let mut r =
                format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
            r.extend_from_slice(&body);
            r
        },
        |_| false,
    )
    .await;
    let mut held = Vec::new();
    for n in 0..9usize {
        let r = send_post(&a, &s).await.unwrap();
        // The chunks themselves (slices of the read buffer), not copies, are kept.
        let mut chunks = Vec::new();
        let mut b = r.body;
        while let Some(f) = b.frame().await {
            if let Ok(d) = f.unwrap().into_data() {
                chunks.push(d);
            }
        }
        held.push((n, chunks));
        assert_eq!(idle_count(&a), 1);
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1);
    for (n, chunks) in &held {
        let got: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        assert!(
            got == want(*n),
            "response {n} changed after later responses"
        );
    }
    // Without held bodies, the buffer is kept between requests (and dropped by the sweep).
    drop(held);
    for _ in 0..3 {
        assert_eq!(post(&a, &s).await.unwrap().0, StatusCode::OK);
    }
    let kept = |a: &Authority| {
        let key = Key {
            tls: 0,
            authority: a.clone(),
        };
        let (empty, cap) = pool().newest_buf(&key).expect("an idle connection");
        assert!(empty);
        cap
    };
    let cap = kept(&a);
    assert!(cap > 0 && cap <= KEEP_BUF, "{cap}");
    // A response head larger than KEEP_BUF grows the buffer: the connection is pooled without it.
    let (b, _) = fake_worker(
        |_| {
            format!(
                "HTTP/1.1 200 OK\r\nx-big: {}\r\ncontent-length: 2\r\n\r\nok",
                "v".repeat(KEEP_BUF + 1024)
            )
            .into_bytes()
        },
        |_| false,
    )
    .await;
    assert_eq!(post(&b, &s).await.unwrap().1, b"ok");
    assert_eq!(kept(&b), 0);
    evict_idle(Instant::now() + s.idle_timeout);
}

#[tokio::test(flavor = "current_thread")]
async fn streamed_and_close_delimited_bodies_arrive_whole() {
    let s = settings();
    let chunked = [
        &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"[..],
        CHUNKED,
    ]
    .concat();
    let (a, conns) = fake_worker(move |_| chunked.clone(), |_| false).await;
    for _ in 0..2 {
        assert_eq!(post(&a, &s).await.unwrap().1, CHUNKED_DATA);
    }
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "chunked bodies keep the connection"
    );

    let (b, _) = fake_worker(
        |_| b"HTTP/1.1 200 OK\r\n\r\nuntil the end".to_vec(),
        |_| true,
    )
    .await;
    assert_eq!(post(&b, &s).await.unwrap().1, b"until the end");
    assert_eq!(idle_count(&b), 0);
}

#[tokio::test(flavor = "current_thread")]
async fn failures_are_reported_not_hung() {
    let s = settings();
    // Nothing listens: a connect error.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
    drop(l);
    assert!(post(&dead, &s).await.unwrap_err().is_connect());

    // The worker closes without answering, on a fresh connection: an io error (no resend).
    let (a, conns) = fake_worker(|_| Vec::new(), |_| true).await;
    let e = post(&a, &s).await.unwrap_err();
    assert!(!e.is_connect(), "{e}");
    assert_eq!(conns.load(Ordering::SeqCst), 1);

    // The worker dies mid-body: the body ends with an error, and the connection is not pooled.
    let (b, _) = fake_worker(
        |_| b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial".to_vec(),
        |_| true,
    )
    .await;
    let e = post(&b, &s).await.unwrap_err();
    assert!(e.to_string().contains("before the end of the body"), "{e}");
    assert_eq!(idle_count(&b), 0);

    // An interim 100 Continue in the same packet as the real answer.
    let (d, _) = fake_worker(
        |_| [&b"HTTP/1.1 100 Continue\r\n\r\n"[..], OK].concat(),
        |_| false,
    )
    .await;
    assert_eq!(post(&d, &s).await.unwrap().1, b"ok");

    // Garbage instead of HTTP.
    let (c, _) = fake_worker(|_| b"SSH-2.0-nope\r\n\r\n".to_vec(), |_| true).await;
    assert!(post(&c, &s)
        .await
        .unwrap_err()
        .to_string()
        .contains("malformed"));
}

#[tokio::test(flavor = "current_thread")]
async fn a_body_dropped_midway_closes_its_connection() {
    let s = settings();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf).await.unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            .await
            .unwrap();
        // The client's next read sees end of stream once the gateway drops the body.
        let n = s.read(&mut buf).await.unwrap_or(0);
        tx.send(n).unwrap();
    });
    let h = HeaderMap::new();
    let body = Bytes::from_static(b"{}");
    let req = Outgoing {
        https: false,
        method: &Method::POST,
        authority: &a,
        path_prefix: "",
        path_and_query: "/",
        headers: &h,
        strip_client_auth: false,
        worker_auth: None,
        traceparent: None,
        body: &body,
    };
    let mut r = send(&req, &s, &pool()).await.unwrap();
    let first = r.body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], b"first");
    assert!(!r.body.is_end_stream());
    drop(r);
    let n = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap();
    assert_eq!(n, Some(0), "the worker saw the connection close");
    assert_eq!(idle_count(&a), 0);
}

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../kvgate-gateway/tests/fixtures")
        .join(name)
}

/// A TLS worker (the fixture certificate: localhost, 127.0.0.1) answering `OK` to every request
/// of every connection; returns its address and its accepted-connection count.
async fn tls_worker() -> (Authority, Arc<AtomicUsize>) {
    let pem = std::fs::read(fixture("cert.pem")).unwrap();
    let certs = rustls_pemfile::certs(&mut &pem[..])
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key_pem = std::fs::read(fixture("key.pem")).unwrap();
    let key = rustls_pemfile::private_key(&mut &key_pem[..])
        .unwrap()
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let sc = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(sc));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let c = conns.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                loop {
                    while let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..i + 4); // GET requests: no body
                        if s.write_all(OK).await.is_err() || s.flush().await.is_err() {
                            return;
                        }
                    }
                    match s.read(&mut tmp).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&tmp[..n]),
                    }
                }
            });
        }
    });
    (addr.to_string().parse().unwrap(), conns)
}

/// A GET of `/health` over TLS with `tls`'s certificates.
async fn get_https(a: &Authority, tls: Option<Tls>) -> Result<(StatusCode, Vec<u8>), Error> {
    let s = Settings { tls, ..settings() };
    let h = HeaderMap::new();
    let body = Bytes::new();
    let req = Outgoing {
        https: true,
        method: &Method::GET,
        authority: a,
        path_prefix: "",
        path_and_query: "/health",
        headers: &h,
        strip_client_auth: false,
        worker_auth: None,
        traceparent: None,
        body: &body,
    };
    let r = send(&req, &s, &pool()).await?;
    let data = r.body.collect().await?.to_bytes();
    Ok((r.status, data.to_vec()))
}

#[tokio::test(flavor = "current_thread")]
async fn https_workers_are_reached_over_tls_and_kept_alive() {
    let (a, conns) = tls_worker().await;
    let trusted = Some(Tls::load(Some(&fixture("cert.pem"))).unwrap());
    for _ in 0..3 {
        let r = get_https(&a, trusted.clone()).await.unwrap();
        assert_eq!(r, (StatusCode::OK, b"ok".to_vec()));
    }
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "one TLS connection, kept alive"
    );
    // Probed before each reuse, also after a while idle: still alive, still one connection.
    tokio::time::sleep(Duration::from_millis(120)).await;
    get_https(&a, trusted).await.unwrap();
    assert_eq!(conns.load(Ordering::SeqCst), 1);

    // No certificates: refused before connecting; the wrong ones: the handshake fails.
    let e = get_https(&a, None).await.unwrap_err();
    assert!(e.to_string().contains("no CA certificates"), "{e}");
    if let Ok(system) = Tls::load(None) {
        let e = get_https(&a, Some(system)).await.unwrap_err();
        assert!(e.to_string().contains("TLS handshake"), "{e}");
    }
    // A file without certificates is refused when loaded.
    assert!(Tls::load(Some(&fixture("key.pem"))).is_err());
    assert!(Tls::load(Some(std::path::Path::new("/nonexistent/ca.pem"))).is_err());
}

/// `Pool::within` is `timeout_at`: the output when it comes first, `None` at the deadline; and
/// its timer, kept in the pool still armed at an earlier call's deadline, does not end a later
/// call early, nor a later one late (paused time).
#[tokio::test(start_paused = true)]
async fn within_times_out_at_each_calls_own_deadline() {
    use std::future::pending;
    use std::pin::pin;
    use tokio::time::{sleep_until, Instant as TInstant};
    let pool = Pool::default();
    let t0 = TInstant::now();
    let step = Duration::from_millis(400);
    // Ready at once: the timer is never armed.
    assert_eq!(pool.within(t0 + step, pin!(async { 7 })).await, Some(7));
    // Ready before the deadline.
    let late = pin!(sleep_until(t0 + step / 2));
    assert_eq!(pool.within(t0 + step, late).await, Some(()));
    // Pending past the deadline: `None` exactly then (the timer is now armed at t0 + step).
    assert_eq!(pool.within(t0 + step, pin!(pending::<()>())).await, None);
    assert_eq!(TInstant::now(), t0 + step);
    // Later calls with later deadlines: the kept timer (armed at or before t0 + step) is moved,
    // not taken as their deadline.
    let t1 = TInstant::now();
    let slow = pin!(sleep_until(t1 + step * 2));
    assert_eq!(pool.within(t1 + step * 3, slow).await, Some(()));
    assert_eq!(TInstant::now(), t1 + step * 2);
    assert_eq!(
        pool.within(t1 + step * 5, pin!(pending::<()>())).await,
        None
    );
    assert_eq!(TInstant::now(), t1 + step * 5);
    // An earlier deadline than the kept timer's: moved back at once.
    let t2 = TInstant::now();
    let soon = pin!(sleep_until(t2 + step));
    assert_eq!(pool.within(t2 + step * 10, soon).await, Some(()));
    assert_eq!(
        pool.within(t2 + step * 2, pin!(pending::<()>())).await,
        None
    );
    assert_eq!(TInstant::now(), t2 + step * 2);
}
