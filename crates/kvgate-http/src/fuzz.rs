//! Entry points for the fuzz targets (`fuzz/`) and the corpus replay test
//! (`tests/fuzz_corpus.rs`): each runs one parser over arbitrary bytes and panics if one of its
//! invariants breaks. Not an API: the parsers stay private, this module only reaches them.
//!
//! Invariants, beyond "no panic":
//! - request head: a parsed head is no longer than the input nor the limit; the framing it
//!   chose agrees with its fields (one `transfer-encoding: chunked` and no `content-length`, or
//!   lengths that all equal the one chosen); an HTTP/1.1 request has exactly one `host`;
//!   `expect: 100-continue` is only honoured with a body; every proper prefix of a parsed head
//!   is incomplete, never an error or another head.
//! - response head: interim responses are skipped, the final head is no longer than the input;
//!   no hop-by-hop field reaches the caller; the body framing agrees with `content-length`; a
//!   close-delimited body never keeps the connection.
//! - chunked decoder: the data out is no longer than the bytes in, and decoding the input in
//!   one piece or a byte at a time gives the same data, the same end and the same leftover.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, Method, StatusCode};

use crate::chunked::{Decode, Step};
use crate::client::{parse_head as parse_response, Parsed};
use crate::head::parse_len;
use crate::server::{parse_head as parse_request, Framing, Limits};

/// The server's head limit in these targets (small, so the fuzzer reaches it).
const MAX_HEAD: usize = 8 << 10;

fn limits() -> Limits {
    Limits {
        max_head: MAX_HEAD,
        max_body: 1 << 20,
        read_timeout: Duration::from_secs(1),
        body_timeout: Duration::from_secs(1),
        reject: Arc::new(|_| Bytes::new()),
    }
}

/// The request head parser of the server loop.
pub fn request_head(data: &[u8]) {
    let limits = limits();
    let mut buf = BytesMut::from(data);
    let head = match parse_request(&mut buf, &limits) {
        Ok(Some(h)) => h,
        Ok(None) => {
            assert_eq!(buf.len(), data.len(), "an incomplete head consumed bytes");
            assert!(data.len() < MAX_HEAD, "incomplete head past the limit");
            return;
        }
        Err(r) => {
            assert!(
                r.status == StatusCode::BAD_REQUEST
                    || r.status == StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "{r:?}"
            );
            return;
        }
    };
    let used = data.len() - buf.len();
    assert!(used <= MAX_HEAD, "head of {used} bytes over the limit");
    assert_eq!(&buf[..], &data[used..], "bytes after the head changed");
    let h = &head.parts.headers;
    let te: Vec<_> = h.get_all(header::TRANSFER_ENCODING).iter().collect();
    let cl: Vec<_> = h.get_all(header::CONTENT_LENGTH).iter().collect();
    match head.framing {
        Framing::Chunked => {
            assert!(
                te.len() == 1
                    && te[0]
                        .as_bytes()
                        .trim_ascii()
                        .eq_ignore_ascii_case(b"chunked")
            );
            assert!(cl.is_empty(), "chunked with a content-length");
        }
        Framing::Length(n) => {
            assert!(te.is_empty() && n > 0);
            assert!(cl.iter().all(|v| parse_len(v.as_bytes()) == Some(n)));
        }
        Framing::None => {
            assert!(te.is_empty());
            assert!(cl.iter().all(|v| parse_len(v.as_bytes()) == Some(0)));
        }
    }
    if head.parts.version == http::Version::HTTP_11 {
        assert_eq!(
            h.get_all(header::HOST).iter().count(),
            1,
            "HTTP/1.1 needs one host"
        );
    }
    assert!(!head.expect_continue || head.framing != Framing::None);
    assert!(
        !head.keep_alive
            || head.parts.version == http::Version::HTTP_11
            || h.contains_key(header::CONNECTION)
    );
    // A proper prefix of a head is only ever "more bytes needed".
    for cut in [used - 1, used / 2] {
        let mut p = BytesMut::from(&data[..cut]);
        assert!(
            matches!(parse_request(&mut p, &limits), Ok(None)),
            "a prefix of {cut} bytes of a {used}-byte head did not ask for more"
        );
    }
}

/// The response head parser of the worker client. The first byte picks the request method
/// (odd: HEAD, whose response has no body).
pub fn response_head(data: &[u8]) {
    let Some((&m, rest)) = data.split_first() else {
        return;
    };
    let method = if m % 2 == 1 {
        Method::HEAD
    } else {
        Method::POST
    };
    let mut buf = BytesMut::from(rest);
    loop {
        let before = buf.len();
        match parse_response(&mut buf, &method) {
            Ok(Some(Parsed::Interim)) => assert!(buf.len() < before, "an interim head of 0 bytes"),
            Ok(Some(Parsed::Head(status, headers, decode, keep_alive))) => {
                assert!(buf.len() < before);
                assert!(!status.is_informational());
                for name in [
                    header::TRANSFER_ENCODING,
                    header::CONNECTION,
                    header::TE,
                    header::UPGRADE,
                ] {
                    assert!(!headers.contains_key(&name), "hop-by-hop {name} passed on");
                }
                let cl = headers
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| parse_len(v.as_bytes()));
                let bodiless = method == Method::HEAD
                    || status == StatusCode::NO_CONTENT
                    || status == StatusCode::NOT_MODIFIED;
                match decode {
                    Decode::Length(n) => assert!(cl == Some(n) && n > 0 && !bodiless),
                    Decode::Chunked(_) => assert!(cl.is_none() && !bodiless),
                    Decode::Eof => assert!(!keep_alive && cl.is_none() && !bodiless),
                    Decode::Done => assert!(bodiless || cl == Some(0)),
                }
                return;
            }
            Ok(None) => {
                assert_eq!(buf.len(), before, "an incomplete head consumed bytes");
                return;
            }
            Err(_) => return,
        }
    }
}

/// The chunked body decoder. The first byte picks where the body's framing starts: a chunked
/// body (even) or a content-length of that byte's value (odd).
pub fn chunked(data: &[u8]) {
    let Some((&m, wire)) = data.split_first() else {
        return;
    };
    let start = if m % 2 == 0 {
        Decode::CHUNKED
    } else {
        Decode::Length(u64::from(m / 2) + 1)
    };
    let whole = decode(start, wire, wire.len().max(1));
    let bytewise = decode(start, wire, 1);
    match (&whole, &bytewise) {
        (Ok((a, ea, ra)), Ok((b, eb, rb))) => {
            assert!(a.len() <= wire.len());
            assert_eq!(a, b, "data differs by how the bytes arrived");
            assert_eq!(ea, eb, "end differs by how the bytes arrived");
            assert_eq!(ra, rb, "leftover differs by how the bytes arrived");
        }
        (Err(_), Err(_)) => {}
        _ => panic!("one piece: {whole:?}, a byte at a time: {bytewise:?}"),
    }
}

/// Feed `wire` to `d` in pieces of `step` bytes: the data, whether it ended, the leftover.
fn decode(
    mut d: Decode,
    wire: &[u8],
    step: usize,
) -> Result<(Vec<u8>, bool, Vec<u8>), crate::chunked::ChunkError> {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for piece in wire.chunks(step) {
        buf.extend_from_slice(piece);
        loop {
            match d.step(&mut buf)? {
                Step::Data(b) => out.extend_from_slice(&b),
                Step::NeedMore => break,
                Step::Done => {
                    // What follows the body stays unread, whatever else arrives.
                    let consumed = wire.len() - remaining(wire, piece, &buf);
                    return Ok((out, true, wire[consumed..].to_vec()));
                }
            }
        }
    }
    Ok((out, false, buf.to_vec()))
}

/// Bytes of `wire` not yet consumed when `buf` holds the unconsumed part of what was fed, the
/// last piece fed being `piece` (a subslice of `wire`).
fn remaining(wire: &[u8], piece: &[u8], buf: &BytesMut) -> usize {
    let fed_end = piece.as_ptr() as usize - wire.as_ptr() as usize + piece.len();
    wire.len() - fed_end + buf.len()
}
