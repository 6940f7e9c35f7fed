//! A raw-socket client corpus against the real `kvgate serve`: each case is a byte string sent on
//! a fresh connection, with the statuses the gateway must answer (RFC 9112 framing, strict where
//! the RFC allows a choice) and what a recording worker behind it saw: how many requests, and
//! which bodies. A request the gateway refuses must never reach the worker, and nothing hidden in
//! a body may reach it as a request of its own.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvgate_system_tests::{exchange_raw, read_until_close, Gateway, RawResponse};

const MODEL: &str = "fr-model";

/// Short timeouts so the slow-client cases end quickly.
const CONFIG: &str = r#"
[server]
header_read_timeout_ms = 600
body_read_timeout_s = 1
[upstream]
monitor = false
"#;

/// Long enough for any answer on a loaded machine; cases that expect a close get it well before.
const WAIT: Duration = Duration::from_secs(15);

/// A worker that records every request body it gets and answers it with the body's prompt.
struct Recorder {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    fn spawn() -> Recorder {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind worker");
        let addr = l.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        thread::spawn(move || {
            for c in l.incoming().flatten() {
                let seen = seen2.clone();
                thread::spawn(move || serve(c, &seen));
            }
        });
        Recorder { addr, seen }
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.seen.lock().expect("lock"))
    }
}

fn serve(mut c: TcpStream, seen: &Mutex<Vec<String>>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            match c.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if buf.len() < end + 4 + len {
            match c.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        }
        let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).into_owned();
        buf.drain(..end + 4 + len);
        let prompt = body
            .split("\"prompt\":\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("")
            .to_string();
        seen.lock().expect("lock").push(body);
        let answer = format!(
            r#"{{"id":"c","object":"text_completion","model":"{MODEL}","choices":[{{"index":0,"text":"echo {prompt}","finish_reason":"stop"}}],"usage":{{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}}}"#
        );
        let out = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if c.write_all(out.as_bytes()).is_err() {
            return;
        }
    }
}

fn body(prompt: &str) -> String {
    format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":1}}"#)
}

/// A completions request with `fields` (each `name: value\r\n`) before the body.
fn post(fields: &str, body: &str) -> String {
    format!("POST /v1/completions HTTP/1.1\r\n{fields}\r\n{body}")
}

fn cl(body: &str) -> String {
    format!("host: gw\r\ncontent-length: {}\r\n", body.len())
}

fn chunked(body: &str) -> String {
    format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len())
}

/// What a case expects.
struct Case {
    name: &'static str,
    wire: Vec<u8>,
    /// The statuses, in order (an empty list: the connection closes without an answer).
    statuses: Vec<u16>,
    /// The bodies the worker must have seen, in order.
    seen: Vec<String>,
}

fn case(name: &'static str, wire: String, statuses: &[u16], seen: &[&str]) -> Case {
    Case {
        name,
        wire: wire.into_bytes(),
        statuses: statuses.to_vec(),
        seen: seen.iter().map(|s| s.to_string()).collect(),
    }
}

fn check_error_shape(name: &str, r: &RawResponse) {
    if r.status != 200 {
        assert!(
            r.is_openai_error(),
            "{name}: {} {}",
            r.status,
            r.body_text()
        );
    }
}

#[test]
fn framing_corpus_is_refused_or_handled_as_rfc_9112_says() {
    let w = Recorder::spawn();
    let gw = Gateway::start(CONFIG, &[format!("http://{}", w.addr)], MODEL);
    let b = body("p1");
    let chunk_te = |te: &str| {
        post(
            &format!("host: gw\r\ntransfer-encoding: {te}\r\n"),
            &chunked(&b),
        )
    };
    let bad_chunks = |size: &str| {
        post(
            "host: gw\r\ntransfer-encoding: chunked\r\n",
            &format!("{size}\r\n{b}\r\n0\r\n\r\n"),
        )
    };
    let (ba, bb) = (body("pa"), body("pb"));
    let cases = vec![
        case("valid", post(&cl(&b), &b), &[200], &[&b]),
        case("valid chunked", chunk_te("chunked"), &[200], &[&b]),
        case(
            "CL and TE",
            post(
                &format!("{}transfer-encoding: chunked\r\n", cl(&b)),
                &chunked(&b),
            ),
            &[400],
            &[],
        ),
        case(
            "two different CLs",
            post(
                &format!("{}content-length: {}\r\n", cl(&b), b.len() + 1),
                &b,
            ),
            &[400],
            &[],
        ),
        case(
            "CL: n, n",
            post(
                &format!("host: gw\r\ncontent-length: {0}, {0}\r\n", b.len()),
                &b,
            ),
            &[200],
            &[&b],
        ),
        case(
            "TE identity, chunked",
            chunk_te("identity, chunked"),
            &[400],
            &[],
        ),
        case("TE gzip, chunked", chunk_te("gzip, chunked"), &[400], &[]),
        case(
            "TE chunked, chunked",
            chunk_te("chunked, chunked"),
            &[400],
            &[],
        ),
        case(
            "two TE fields",
            post(
                "host: gw\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n",
                &chunked(&b),
            ),
            &[400],
            &[],
        ),
        case(
            "obs-fold",
            post(&format!("{}x-folded: a\r\n  b\r\n", cl(&b)), &b),
            &[400],
            &[],
        ),
        case("chunk size zz", bad_chunks("zz"), &[400], &[]),
        case("chunk size -1", bad_chunks("-1"), &[400], &[]),
        case(
            "chunk size overflow",
            bad_chunks("ffffffffffffffffffff"),
            &[400],
            &[],
        ),
        case(
            "chunk data without its CRLF",
            post(
                "host: gw\r\ntransfer-encoding: chunked\r\n",
                &format!("{:x}\r\n{b}0\r\n\r\n", b.len()),
            ),
            &[400],
            &[],
        ),
        case(
            "HTTP/1.1 without Host",
            format!(
                "POST /v1/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{b}",
                b.len()
            ),
            &[400],
            &[],
        ),
        case(
            "two Hosts",
            post(&format!("host: other\r\n{}", cl(&b)), &b),
            &[400],
            &[],
        ),
        case(
            "pipelined",
            format!("{}{}", post(&cl(&ba), &ba), post(&cl(&bb), &bb)),
            &[200, 200],
            &[&ba, &bb],
        ),
        // CL.TE smuggling: a chunked body that ends early, a request after it; refused whole.
        case(
            "CL.TE smuggling",
            post(
                "host: gw\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n",
                &format!("{}{}", chunked(&b), post(&cl(&ba), &ba)),
            ),
            &[400],
            &[],
        ),
        // A well-framed request followed by bytes that read as a chunk end and a request: the
        // worker sees the first request only, the rest is a malformed request of its own.
        case(
            "smuggling after a body",
            format!("{}0\r\n\r\n{}", post(&cl(&b), &b), post(&cl(&ba), &ba)),
            &[200, 400],
            &[&b],
        ),
    ];
    for c in cases {
        let (rs, closed) = exchange_raw(gw.addr, &c.wire, WAIT);
        let got: Vec<u16> = rs.iter().map(|r| r.status).collect();
        assert_eq!(got, c.statuses, "{}: {rs:?}", c.name);
        for r in &rs {
            check_error_shape(c.name, r);
        }
        if got.last().is_some_and(|&s| s >= 400) {
            assert!(
                closed,
                "{}: the connection stays open after a refusal",
                c.name
            );
        }
        assert_eq!(w.take(), c.seen, "{}: what the worker saw", c.name);
        // Answers go to the request they belong to.
        for (r, body) in rs.iter().zip(&c.seen) {
            let prompt = body
                .split("\"prompt\":\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            assert!(
                r.body_text().contains(&format!("echo {prompt}")),
                "{}",
                c.name
            );
        }
    }

    // Bare CR and bare LF line endings: whatever httparse decides, the answer is consistent
    // (refused, or parsed as the same single request) and nothing extra reaches the worker.
    for (name, sep) in [("bare LF", "\n"), ("bare CR", "\r")] {
        let wire = format!(
            "POST /v1/completions HTTP/1.1{sep}host: gw{sep}content-length: {}{sep}{sep}{b}",
            b.len()
        );
        let (rs, _) = exchange_raw(gw.addr, wire.as_bytes(), WAIT);
        let seen = w.take();
        match rs.iter().map(|r| r.status).collect::<Vec<_>>()[..] {
            [400] => assert!(seen.is_empty(), "{name}: refused yet forwarded"),
            [200] => assert_eq!(seen, std::slice::from_ref(&b), "{name}"),
            ref other => panic!("{name}: {other:?}"),
        }
        eprintln!("{name}: {}", rs[0].status);
    }

    // Expect: 100-continue: the interim answer comes before the body is sent.
    let mut s = TcpStream::connect(gw.addr).expect("connect");
    s.write_all(post(&format!("{}expect: 100-continue\r\n", cl(&b)), "").as_bytes())
        .expect("send head");
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    let end = Instant::now() + WAIT;
    while !got.ends_with(b"\r\n\r\n") {
        assert!(Instant::now() < end, "no 100 Continue");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        assert_eq!(
            s.read(&mut byte).expect("read"),
            1,
            "closed before 100 Continue"
        );
        got.push(byte[0]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 100"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    s.write_all(b.as_bytes()).expect("send body");
    s.write_all(b"GET /health HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
        .expect("send next");
    let (rs, _) = read_until_close(&mut s, WAIT);
    assert_eq!(rs.first().map(|r| r.status), Some(200), "{rs:?}");
    assert_eq!(w.take(), std::slice::from_ref(&b));

    // A body that never finishes (one byte per 200 ms: each pause under header_read_timeout_ms,
    // the whole over body_read_timeout_s): 408, and the worker sees nothing.
    let mut s = TcpStream::connect(gw.addr).expect("connect");
    s.write_all(post(&cl(&b), "").as_bytes())
        .expect("send head");
    let mut w2 = s.try_clone().expect("clone");
    let drip = thread::spawn(move || {
        for _ in 0..40 {
            if w2.write_all(b" ").is_err() {
                break;
            }
            thread::sleep(Duration::from_millis(200));
        }
    });
    let (rs, closed) = read_until_close(&mut s, WAIT);
    assert_eq!(
        rs.iter().map(|r| r.status).collect::<Vec<_>>(),
        [408],
        "{rs:?}"
    );
    assert!(rs[0].is_openai_error() && closed);
    drop(s);
    let _ = drip.join();
    assert!(w.take().is_empty());

    // A head that never finishes: the connection is closed (after header_read_timeout_ms).
    let mut s = TcpStream::connect(gw.addr).expect("connect");
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n")
        .expect("send");
    let (_, closed) = read_until_close(&mut s, WAIT);
    assert!(closed, "an unfinished head kept its connection");
    assert!(w.take().is_empty());

    // Still serving.
    let (rs, _) = exchange_raw(gw.addr, post(&cl(&b), &b).as_bytes(), WAIT);
    assert_eq!(rs.first().map(|r| r.status), Some(200));
}
