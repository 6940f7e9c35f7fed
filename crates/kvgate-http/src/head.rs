//! What both sides of the proxy share about a message head: the framing rules (one set, for
//! requests from clients and responses from workers alike), header-name lookup, field writing and
//! the hop-by-hop list.
//!
//! The rules (RFC 9112 §6.1-6.3, strict where the RFC allows a choice, because a gateway that
//! reads framing differently from its peer is how requests get smuggled and responses split):
//! - `content-length`: decimal digits, or a comma list of one repeated value (`5, 5`); several
//!   fields must agree; anything else is malformed.
//! - `transfer-encoding`: exactly `chunked` (case-insensitive), in one field. Any other coding
//!   (`gzip, chunked`, `identity, chunked`, `chunked, chunked`) is refused: a proxy that strips the
//!   field and re-frames the body would pass on a coding nobody can undo.
//! - both at once: refused (RFC 9112 §6.3 allows it as "transfer-encoding wins", and calls it
//!   what a smuggling attempt looks like).
//! - at most [`MAX_HEADERS`] fields and `max_head` bytes, whether the head arrives in one read or
//!   trickles in.

use http::header::{self, HeaderName};

/// Most header fields in a head, requests and responses alike (hyper's default for requests).
pub const MAX_HEADERS: usize = 100;

/// Header maps kept per thread for the next head ([`header_map`], [`recycle`]): a map costs two
/// allocations (its index and its entries), and a proxied request builds two (the client's
/// request, the worker's response) that die before the next request's.
const MAPS_KEPT: usize = 8;
/// A map that grew past this many fields is not kept.
const MAP_KEEP_CAPACITY: usize = 64;

thread_local! {
    static MAPS: std::cell::RefCell<Vec<header::HeaderMap>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// An empty header map with room for `n` fields: one given back on this thread ([`recycle`]) if
/// any, else a new one.
pub fn header_map(n: usize) -> header::HeaderMap {
    match MAPS.try_with(|m| m.borrow_mut().pop()).ok().flatten() {
        Some(mut h) => {
            h.reserve(n);
            h
        }
        None => header::HeaderMap::with_capacity(n),
    }
}

/// Gives a header map that is no longer needed back for [`header_map`] on this thread (emptied;
/// its allocations kept). Too large a map, or one past the few kept, is dropped.
pub fn recycle(mut h: header::HeaderMap) {
    if h.capacity() == 0 || h.capacity() > MAP_KEEP_CAPACITY {
        return;
    }
    h.clear();
    let _ = MAPS.try_with(|m| {
        if let Ok(mut m) = m.try_borrow_mut() {
            if m.len() < MAPS_KEPT {
                m.push(h);
            }
        }
    });
}

/// Where one field lies in its head's buffer: name start and end, value start and end.
pub(crate) type Span = (u32, u32, u32, u32);

/// Fields kept on the stack by [`FieldSpans`]; more go to the heap.
const INLINE_SPANS: usize = 16;

/// The spans of a head's fields, noted while it is parsed and used once it is split off. The
/// first [`INLINE_SPANS`] live on the stack (a head has a handful): an array with room for
/// [`MAX_HEADERS`] was zeroed on every head (~100 instructions each).
pub(crate) struct FieldSpans {
    inline: [Span; INLINE_SPANS],
    len: usize,
    more: Vec<Span>,
}

impl Default for FieldSpans {
    fn default() -> Self {
        FieldSpans {
            inline: [(0, 0, 0, 0); INLINE_SPANS],
            len: 0,
            more: Vec::new(),
        }
    }
}

impl FieldSpans {
    pub(crate) fn push(&mut self, s: Span) {
        match self.inline.get_mut(self.len) {
            Some(slot) => *slot = s,
            None => self.more.push(s),
        }
        self.len += 1;
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The spans in the order they were pushed.
    pub(crate) fn iter(&self) -> impl Iterator<Item = Span> + '_ {
        self.inline[..self.len.min(INLINE_SPANS)]
            .iter()
            .chain(&self.more)
            .copied()
    }
}

/// The framing-relevant fields of one head, folded in one field at a time.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FramingFields {
    /// `content-length`, if the head has one.
    pub length: Option<u64>,
    /// `transfer-encoding: chunked`.
    pub chunked: bool,
    /// `connection: close`.
    pub close: bool,
    /// `connection: keep-alive`.
    pub keep_alive: bool,
    /// How many `host` fields.
    pub hosts: u32,
    /// `expect: 100-continue`.
    pub expect_continue: bool,
}

/// What kind of field [`FramingFields::field`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// `content-length` or `transfer-encoding`.
    Framing,
    /// `connection`: its other tokens name hop-by-hop fields.
    Connection,
    Other,
}

/// A rule a head broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FramingError(pub &'static str);

impl std::fmt::Display for FramingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl FramingFields {
    /// Fold in one field (`name` in any case).
    pub fn field(&mut self, name: &[u8], value: &[u8]) -> Result<FieldKind, FramingError> {
        match name.len() {
            14 if eq_lower(name, b"content-length") => {
                let n = parse_len(value).ok_or(FramingError("invalid content-length"))?;
                if self.length.is_some_and(|m| m != n) {
                    return Err(FramingError("conflicting content-length fields"));
                }
                self.length = Some(n);
                Ok(FieldKind::Framing)
            }
            17 if eq_lower(name, b"transfer-encoding") => {
                if self.chunked || !value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                    return Err(FramingError(
                        "unsupported transfer-encoding (only a single `chunked` is accepted)",
                    ));
                }
                self.chunked = true;
                Ok(FieldKind::Framing)
            }
            10 if eq_lower(name, b"connection") => {
                for t in value.split(|&b| b == b',') {
                    let t = t.trim_ascii();
                    if t.eq_ignore_ascii_case(b"close") {
                        self.close = true;
                    } else if t.eq_ignore_ascii_case(b"keep-alive") {
                        self.keep_alive = true;
                    }
                }
                Ok(FieldKind::Connection)
            }
            4 if eq_lower(name, b"host") => {
                self.hosts += 1;
                Ok(FieldKind::Other)
            }
            6 if eq_lower(name, b"expect") => {
                self.expect_continue = value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
                Ok(FieldKind::Other)
            }
            _ => Ok(FieldKind::Other),
        }
    }

    /// Checks that need the whole head.
    pub fn finish(&self) -> Result<(), FramingError> {
        if self.chunked && self.length.is_some() {
            return Err(FramingError("both transfer-encoding and content-length"));
        }
        Ok(())
    }
}

/// A `content-length` value: digits only, or a comma list of equal values.
pub fn parse_len(v: &[u8]) -> Option<u64> {
    // The common case, one plain number: read in one pass (the general path below gives the
    // same for it).
    if !v.is_empty() && v.len() <= 19 && v.iter().all(u8::is_ascii_digit) {
        return Some(v.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')));
    }
    parse_len_list(v)
}

/// [`parse_len`] for any value: a comma list of equal numbers.
fn parse_len_list(v: &[u8]) -> Option<u64> {
    let mut out: Option<u64> = None;
    for part in v.split(|&b| b == b',') {
        let part = part.trim_ascii();
        if part.is_empty() || part.len() > 19 || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = part.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
        match out {
            Some(m) if m != n => return None,
            _ => out = Some(n),
        }
    }
    out
}

/// Headers that describe one hop, never forwarded in either direction (RFC 9110 §7.6.1).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TRANSFER_ENCODING
        || name == header::TE
        || name == header::TRAILER
        || name == header::UPGRADE
        || name == header::PROXY_AUTHENTICATE
        || name == header::PROXY_AUTHORIZATION
        || matches!(name.as_str(), "keep-alive" | "proxy-connection")
}

/// Append `name: value\r\n`.
pub fn push_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// `n` in decimal, written at the end of `buf`: what `write!(_, "{n}")` writes, without the
/// formatting machinery (~300 instructions for a content-length through `io::Write::write_fmt`).
pub fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Append `n` in decimal ([`decimal`]).
pub fn push_decimal(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(decimal(n, &mut [0; 20]));
}

/// `HeaderName::from_bytes`, with the fields nearly every request and response carries looked up
/// by length and a case-insensitive compare first (the general parse costs ~180 instructions a
/// field). Same result either way: a standard name parses to the same constant.
pub fn header_name(b: &[u8]) -> Result<HeaderName, header::InvalidHeaderName> {
    let known = match b.len() {
        4 if eq_lower(b, b"host") => Some(header::HOST),
        4 if eq_lower(b, b"date") => Some(header::DATE),
        6 if eq_lower(b, b"accept") => Some(header::ACCEPT),
        6 if eq_lower(b, b"server") => Some(header::SERVER),
        10 if eq_lower(b, b"user-agent") => Some(header::USER_AGENT),
        10 if eq_lower(b, b"connection") => Some(header::CONNECTION),
        12 if eq_lower(b, b"content-type") => Some(header::CONTENT_TYPE),
        13 if eq_lower(b, b"authorization") => Some(header::AUTHORIZATION),
        14 if eq_lower(b, b"content-length") => Some(header::CONTENT_LENGTH),
        15 if eq_lower(b, b"accept-encoding") => Some(header::ACCEPT_ENCODING),
        _ => None,
    };
    match known {
        Some(n) => Ok(n),
        None => HeaderName::from_bytes(b),
    }
}

/// `b` equals `lower` (lowercase letters and `-` only) ignoring ASCII case: a letter position
/// accepts the byte with bit 5 cleared too (its capital), any other position only itself.
/// Branch-free, eight bytes at a time from 8 bytes on (the last word overlapping the one before
/// it), so a fixed-length name costs a few word compares instead of a lowercasing per byte.
#[inline(always)]
fn eq_lower(b: &[u8], lower: &[u8]) -> bool {
    let n = lower.len();
    if b.len() != n {
        return false;
    }
    if n < 8 {
        return b
            .iter()
            .zip(lower)
            .fold(0u8, |d, (&x, &y)| d | ((x | ((y & 0x40) >> 1)) ^ y))
            == 0;
    }
    let word = |s: &[u8], i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&s[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let diff = |i: usize| {
        let y = word(lower, i);
        (word(b, i) | ((y & 0x4040_4040_4040_4040) >> 1)) ^ y
    };
    let mut d = diff(n - 8);
    let mut i = 0;
    while i + 8 < n {
        d |= diff(i);
        i += 8;
    }
    d == 0
}

#[cfg(test)]
mod tests;
