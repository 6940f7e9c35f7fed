//! The real `kvgate serve` in front of a raw-socket worker that misbehaves on purpose (stray
//! responses, wrong content-lengths, bad chunking, 1xx floods, huge heads, early closes, a slow
//! drip, forbidden framings, and randomly mutated responses).
//!
//! Every request carries a unique id in its prompt and a correct answer echoes it. For every
//! misbehaviour, with several concurrent clients sharing the gateway's keep-alive pool, each
//! client must get its own answer (its id, no other) or an OpenAI-shaped error (502/504), never
//! another request's id; nothing may hang; the gateway must serve a clean request afterwards.
//! The worker is told how to misbehave by the prompt itself (`mode=NAME`), so one worker and one
//! gateway serve every case.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvgate_system_tests::{exchange_raw, Gateway, RawResponse};

const MODEL: &str = "adv-model";

/// Strays the worker wrote in `stray_later` mode (the test waits for each before the next request).
static STRAYS_WRITTEN: AtomicUsize = AtomicUsize::new(0);

/// `cl_under` answers whose rest is not written yet.
static LATE_PENDING: AtomicUsize = AtomicUsize::new(0);

/// Low timeouts so that the cases that can only end in a timeout end quickly; `monitor = false`:
/// the worker speaks only the completions endpoint.
const CONFIG: &str = r#"
[server]
header_read_timeout_ms = 2000
[upstream]
response_timeout_s = 2
stream_idle_timeout_s = 2
monitor = false
[retry]
max_attempts = 1
"#;

/// The longest any request may take before the suite calls it a hang.
const HANG: Duration = Duration::from_secs(20);

/// A misbehaving worker on 127.0.0.1:0, one std thread per connection; stops on drop.
struct Worker {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Worker {
    /// `obey`: misbehave as each request's `mode=` says; else always answer cleanly.
    fn spawn(obey: bool) -> Worker {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind worker");
        let addr = listener.local_addr().expect("worker addr");
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(c) = conn {
                    let stop = stop2.clone();
                    thread::spawn(move || serve_conn(c, &stop, obey));
                }
            }
        });
        Worker { addr, stop }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

/// Read one request (head + content-length body) from `c`; `None` at EOF or on error.
fn read_request(c: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                let body = buf[end + 4..end + 4 + len].to_vec();
                buf.drain(..end + 4 + len);
                return Some(body);
            }
        }
        match c.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// `key=VALUE` from a request body (VALUE up to the next space or quote).
fn field<'a>(body: &'a str, key: &str) -> &'a str {
    body.split(key)
        .nth(1)
        .and_then(|r| r.split([' ', '"']).next())
        .unwrap_or("")
}

/// A correct completions answer echoing `id`.
fn answer_body(id: &str) -> String {
    format!(
        r#"{{"id":"cmpl-1","object":"text_completion","created":1,"model":"{MODEL}","choices":[{{"index":0,"text":"answer {id} end","finish_reason":"stop"}}],"usage":{{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}}}"#
    )
}

fn response(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn chunked_response(te: &str, chunks: &str) -> Vec<u8> {
    format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: {te}\r\n\r\n{chunks}")
        .into_bytes()
}

fn serve_conn(mut c: TcpStream, stop: &AtomicBool, obey: bool) {
    let _ = c.set_nodelay(true);
    let mut buf = Vec::new();
    while let Some(body) = read_request(&mut c, &mut buf) {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let body = String::from_utf8_lossy(&body).into_owned();
        let id = field(&body, "id=").to_string();
        let mode = if obey { field(&body, "mode=") } else { "clean" }.to_string();
        if !behave(&mut c, &mode, &id) {
            return;
        }
    }
}

/// Answer one request as `mode` says; `false`: the connection is done.
fn behave(c: &mut TcpStream, mode: &str, id: &str) -> bool {
    let good = answer_body(id);
    let ok = |r: std::io::Result<()>| r.is_ok();
    match mode {
        "clean" => ok(c.write_all(&response(&good))),
        // A second, complete copy of the answer in the same write, then one a few ms later: if
        // either reached the next request on this connection, that client would read this id.
        "stray_now" => {
            let mut out = response(&good);
            out.extend_from_slice(&response(&good));
            ok(c.write_all(&out))
        }
        "stray_later" => {
            if c.write_all(&response(&good)).is_err() {
                return false;
            }
            thread::sleep(Duration::from_millis(3));
            let r = ok(c.write_all(&response(&good)));
            STRAYS_WRITTEN.fetch_add(1, Ordering::SeqCst);
            r
        }
        // content-length 10 short; the rest (the end of the JSON) written later.
        "cl_under" => {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                good.len() - 10
            );
            let (a, b) = good.split_at(good.len() - 10);
            LATE_PENDING.fetch_add(1, Ordering::SeqCst);
            let r = c.write_all(format!("{head}{a}").as_bytes()).is_ok() && {
                thread::sleep(Duration::from_millis(3));
                ok(c.write_all(b.as_bytes()))
            };
            LATE_PENDING.fetch_sub(1, Ordering::SeqCst);
            r
        }
        // content-length 100 too long, then close.
        "cl_over" => {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                good.len() + 100
            );
            let _ = c.write_all(format!("{head}{good}").as_bytes());
            false
        }
        "bad_chunk_size" => {
            let _ = c.write_all(&chunked_response("chunked", "zz\r\nhello\r\n0\r\n\r\n"));
            false
        }
        "chunk_too_long" => {
            let _ = c.write_all(&chunked_response(
                "chunked",
                &format!("5\r\n{good}\r\n0\r\n\r\n"),
            ));
            false
        }
        "continue_bounded" => {
            let mut out = b"HTTP/1.1 100 Continue\r\n\r\n".repeat(200);
            out.extend_from_slice(&response(&good));
            ok(c.write_all(&out))
        }
        // 100 Continue every 5 ms until the gateway gives up (closes) or 30 s.
        "continue_unbounded" => {
            let end = Instant::now() + Duration::from_secs(30);
            while Instant::now() < end {
                if c.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err() {
                    break;
                }
                thread::sleep(Duration::from_millis(5));
            }
            false
        }
        "huge_head" => {
            let mut out = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
            out.extend(std::iter::repeat_n(b'a', 70 << 10));
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(&response(&good)[17..]);
            let _ = c.write_all(&out);
            false
        }
        "close_now" => false,
        "close_mid_head" => {
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: appl");
            false
        }
        // A valid answer, 4 bytes every 2 ms (about 0.3 s in all).
        "slow_drip" => {
            for piece in response(&good).chunks(4) {
                if c.write_all(piece).is_err() {
                    return false;
                }
                thread::sleep(Duration::from_millis(2));
            }
            true
        }
        "cl_and_te" => {
            let chunks = format!("{:x}\r\n{good}\r\n0\r\n\r\n", good.len());
            let _ = c.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ntransfer-encoding: chunked\r\n\r\n{chunks}",
                    good.len()
                )
                .as_bytes(),
            );
            false
        }
        "gzip_chunked" => {
            let chunks = format!("{:x}\r\n{good}\r\n0\r\n\r\n", good.len());
            let _ = c.write_all(&chunked_response("gzip, chunked", &chunks));
            false
        }
        m if m.starts_with("mutate") => mutate(c, m, id),
        other => panic!("unknown mode {other:?}"),
    }
}

/// `mutate-SEED`: 15% of answers (chosen by the seed) damaged one of several ways; the id's own
/// bytes are never touched (a damaged id could spell another request's).
fn mutate(c: &mut TcpStream, mode: &str, id: &str) -> bool {
    let seed: u64 = mode[7..].parse().unwrap_or(0);
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = if rng.u8(..) % 2 == 0 {
        response(&answer_body(id))
    } else {
        let good = answer_body(id);
        let mid = good.len() / 2;
        chunked_response(
            "chunked",
            &format!(
                "{:x}\r\n{}\r\n{:x}\r\n{}\r\n0\r\n\r\n",
                mid,
                &good[..mid],
                good.len() - mid,
                &good[mid..]
            ),
        )
    };
    if rng.u32(0..100) >= 15 {
        return c.write_all(&out).is_ok();
    }
    let id_at = out
        .windows(id.len())
        .position(|w| w == id.as_bytes())
        .unwrap_or(out.len());
    // A position outside the id.
    let mut pos = || loop {
        let p = rng.usize(0..out.len());
        if p + 1 < id_at || p > id_at + id.len() {
            break p;
        }
    };
    let kind = pos() % 6;
    let p = pos();
    match kind {
        0 => out[p] ^= 1 << (p % 8),
        1 => out.insert(p, b"\r\n:0 xZ"[p % 7]),
        2 => {
            out.remove(p);
        }
        3 => {
            out.truncate(p);
            let _ = c.write_all(&out);
            return false;
        }
        4 => {
            let dup = out.clone();
            out.extend_from_slice(&dup);
        }
        _ => out.extend_from_slice(b"HTTP/1.1 200 OK\r\ngarbage\r\n\r\n"),
    }
    c.write_all(&out).is_ok()
}

/// What a client got.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// 200 with its own id and no other.
    Own,
    /// An OpenAI-shaped error: 502, 504, or 503 once the worker's breaker opened.
    Error,
    /// A 200 whose body ended early (the worker closed mid-body after the head was relayed), with
    /// no foreign id in what arrived.
    Truncated,
    /// Mutation run only: the worker's damaged answer as it sent it, no foreign id in it.
    Damaged,
}

/// Every `id=`-style token in `text`: what the worker echoes (`req-…`).
fn ids_in(text: &str) -> Vec<&str> {
    text.match_indices("req-")
        .map(|(i, _)| {
            let rest = &text[i..];
            let end = rest
                .find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '-' || ch == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

/// One completions request with `id` and `mode` on its own connection; panics on a mixed
/// response, a non-OpenAI error or a hang.
fn request(gw: SocketAddr, id: &str, mode: &str) -> Outcome {
    let body =
        format!(r#"{{"model":"{MODEL}","prompt":"id={id} mode={mode} please","max_tokens":3}}"#);
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let start = Instant::now();
    let (rs, closed) = exchange_raw(gw, req.as_bytes(), HANG);
    assert!(
        closed || rs.first().is_some_and(|r| r.complete),
        "{mode} {id}: no answer within {HANG:?}"
    );
    assert!(start.elapsed() < HANG, "{mode} {id}: hung");
    let r: &RawResponse = rs
        .first()
        .unwrap_or_else(|| panic!("{mode} {id}: connection closed without a response"));
    let text = r.body_text();
    let foreign: Vec<&str> = ids_in(&text).into_iter().filter(|i| *i != id).collect();
    assert!(
        foreign.is_empty(),
        "MIXED: {mode} {id} got {foreign:?}: {} {text}",
        r.status
    );
    match r.status {
        200 if r.complete && ids_in(&text) == [id] => Outcome::Own,
        200 if !r.complete => Outcome::Truncated,
        502..=504 if r.is_openai_error() => Outcome::Error,
        // A mutated answer passed on as the worker sent it (a flipped status digit, a shorter
        // content-length): damaged, but the client's own and nobody else's.
        _ if mode.starts_with("mutate") => Outcome::Damaged,
        s => panic!("{mode} {id}: neither its answer nor an OpenAI error: {s} {text:?}"),
    }
}

/// `clients` threads × `each` requests of `mode`; the outcomes.
fn run(gw: SocketAddr, mode: &'static str, clients: usize, each: usize) -> Vec<Outcome> {
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            thread::spawn(move || {
                (0..each)
                    .map(|i| {
                        let m = if mode == "mutate" {
                            format!("mutate-{}", c * 100_000 + i)
                        } else {
                            mode.to_string()
                        };
                        request(gw, &format!("req-{}-{c}-{i}", mode.replace('_', "")), &m)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    handles
        .into_iter()
        .flat_map(|h| h.join().expect("client thread"))
        .collect()
}

fn count(outs: &[Outcome], o: Outcome) -> usize {
    outs.iter().filter(|x| **x == o).count()
}

/// Each case on a fresh gateway (breakers closed) in front of a misbehaving worker and a clean
/// one, round robin: the misbehaving one gets half the requests, and once its breaker opens the
/// clean one serves the rest, so "the gateway serves a clean request afterwards" is checked
/// without waiting out the breaker.
#[test]
fn misbehaving_worker_never_mixes_responses() {
    // (mode, clients, requests each, whether every answer must be the client's own)
    let cases: &[(&'static str, usize, usize, bool)] = &[
        ("stray_now", 6, 15, true),
        ("cl_under", 6, 15, false),
        ("cl_over", 4, 3, false),
        ("bad_chunk_size", 4, 3, false),
        ("chunk_too_long", 4, 3, false),
        ("continue_bounded", 4, 5, true),
        ("continue_unbounded", 4, 1, false),
        ("huge_head", 4, 3, false),
        ("close_now", 4, 3, false),
        ("close_mid_head", 4, 3, false),
        ("slow_drip", 4, 2, true),
        ("cl_and_te", 4, 3, false),
        ("gzip_chunked", 4, 3, false),
    ];
    for &(mode, clients, each, all_own) in cases {
        let bad = Worker::spawn(true);
        let clean = Worker::spawn(false);
        let gw = Gateway::start(CONFIG, &[bad.url(), clean.url()], MODEL);
        let outs = run(gw.addr, mode, clients, each);
        let (own, err, trunc) = (
            count(&outs, Outcome::Own),
            count(&outs, Outcome::Error),
            count(&outs, Outcome::Truncated),
        );
        eprintln!("{mode}: own {own} error {err} truncated {trunc}");
        if all_own {
            assert_eq!(own, outs.len(), "{mode}: {outs:?}");
        } else if mode != "cl_under" {
            // The misbehaving worker got some of them, and the gateway noticed. (A short
            // content-length is well-framed; its rest is dropped by the probe when it arrives
            // before the next checkout, else it fails that next request: either may happen.)
            assert!(
                err + trunc > 0,
                "{mode}: the misbehaviour went unnoticed: {outs:?}"
            );
        }
        // The gateway is fine afterwards, once the worker has written everything it meant to
        // (a late rest that arrives after the next request was sent fails that request: see
        // `stray_response_while_pooled_is_never_handed_on`).
        let end = Instant::now() + HANG;
        while LATE_PENDING.load(Ordering::SeqCst) > 0 {
            assert!(
                Instant::now() < end,
                "the worker never finished its late writes"
            );
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            request(
                gw.addr,
                &format!("req-after-{}", mode.replace('_', "")),
                "clean"
            ),
            Outcome::Own,
            "after {mode}"
        );
    }
}

/// A stray copy written a few ms after the answer, while the connection sits idle in the pool:
/// the probe at checkout finds it, so the next request (whoever sends it) gets its own answer.
/// One client, which waits for each stray to be written before its next request: a stray that
/// arrives after the next request was written on that connection is indistinguishable from its
/// answer in HTTP/1.1 (no request ids on the wire), so that window is not one a gateway can close.
#[test]
fn stray_response_while_pooled_is_never_handed_on() {
    let worker = Worker::spawn(true);
    let gw = Gateway::start(CONFIG, &[worker.url()], MODEL);
    for i in 0..30 {
        let id = format!("req-straylater-{i}");
        assert_eq!(request(gw.addr, &id, "stray_later"), Outcome::Own);
        let end = Instant::now() + HANG;
        while STRAYS_WRITTEN.load(Ordering::SeqCst) <= i {
            assert!(Instant::now() < end, "the worker never wrote stray {i}");
            thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!(request(gw.addr, "req-after-strays", "clean"), Outcome::Own);
}

#[test]
fn randomly_mutated_worker_responses_never_mix() {
    let (a, b) = (Worker::spawn(true), Worker::spawn(true));
    let gw = Gateway::start(CONFIG, &[a.url(), b.url()], MODEL);
    let outs = run(gw.addr, "mutate", 8, 50);
    let (own, err, trunc, damaged) = (
        count(&outs, Outcome::Own),
        count(&outs, Outcome::Error),
        count(&outs, Outcome::Truncated),
        count(&outs, Outcome::Damaged),
    );
    eprintln!(
        "mutation run: {} requests, 15% mutated: own answer {own}, OpenAI error {err}, truncated {trunc}, damaged own {damaged}, mixed 0",
        outs.len()
    );
    assert_eq!(outs.len(), 400);
    // Most answers are untouched; each mutated one costs at most itself and the next request
    // on its connection.
    assert!(own >= 400 * 6 / 10, "too few clean answers: {own}");
    assert_eq!(
        request(gw.addr, "req-after-mutation", "clean"),
        Outcome::Own
    );
}
