//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the `traceparent` header parsed and
//! written, `tracestate` kept as an opaque, bounded string.
//!
//! `traceparent` = `version "-" trace-id "-" parent-id "-" trace-flags`, lowercase hex, 2-32-16-2
//! digits. Version `ff` is invalid; version `00` is exactly 55 characters; a later version may
//! append fields after a `-` (we read the four we know). An all-zero trace id or parent id is
//! invalid. An invalid header is ignored (a new trace starts), as the specification asks.

/// `traceparent`'s sampled flag.
pub const FLAG_SAMPLED: u8 = 0x01;

/// Longest `tracestate` kept (the specification's limit is 32 list members; 512 bytes is what
/// propagators must at least pass on).
pub const MAX_TRACESTATE: usize = 512;

/// A parsed `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    /// The caller's span (our server span's parent).
    pub parent_id: [u8; 8],
    pub flags: u8,
}

/// Why a `traceparent` was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("traceparent has the wrong length or separators")]
    Shape,
    #[error("traceparent has a character that is not lowercase hex")]
    Hex,
    #[error("traceparent version ff is invalid")]
    Version,
    #[error("traceparent trace id is all zeros")]
    ZeroTraceId,
    #[error("traceparent parent id is all zeros")]
    ZeroParentId,
}

impl TraceParent {
    pub fn sampled(&self) -> bool {
        self.flags & FLAG_SAMPLED != 0
    }

    pub fn parse(s: &[u8]) -> Result<TraceParent, ParseError> {
        // Optional whitespace around a header value is the HTTP layer's; tolerate it here too.
        let s = s.trim_ascii();
        if s.len() < 55 {
            return Err(ParseError::Shape);
        }
        let version = hex_byte(&s[0..2])?;
        if version == 0xff {
            return Err(ParseError::Version);
        }
        if s[2] != b'-' || s[35] != b'-' || s[52] != b'-' {
            return Err(ParseError::Shape);
        }
        // Version 00 is exactly 55 characters; a later one may go on after a '-'.
        if (version == 0 && s.len() != 55) || (s.len() > 55 && s[55] != b'-') {
            return Err(ParseError::Shape);
        }
        let mut trace_id = [0u8; 16];
        for (i, b) in trace_id.iter_mut().enumerate() {
            *b = hex_byte(&s[3 + 2 * i..5 + 2 * i])?;
        }
        let mut parent_id = [0u8; 8];
        for (i, b) in parent_id.iter_mut().enumerate() {
            *b = hex_byte(&s[36 + 2 * i..38 + 2 * i])?;
        }
        let flags = hex_byte(&s[53..55])?;
        if trace_id == [0; 16] {
            return Err(ParseError::ZeroTraceId);
        }
        if parent_id == [0; 8] {
            return Err(ParseError::ZeroParentId);
        }
        Ok(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The version-00 header value: 55 bytes.
    pub fn encode(&self) -> [u8; 55] {
        format_traceparent(&self.trace_id, &self.parent_id, self.flags)
    }
}

/// `00-{trace_id}-{span_id}-{flags}` as bytes (always valid header text).
pub fn format_traceparent(trace_id: &[u8; 16], span_id: &[u8; 8], flags: u8) -> [u8; 55] {
    let mut out = [b'-'; 55];
    out[0] = b'0';
    out[1] = b'0';
    put_hex(&mut out[3..35], trace_id);
    put_hex(&mut out[36..52], span_id);
    put_hex(&mut out[53..55], &[flags]);
    out
}

/// Lowercase hex of `bytes` into `out` (`out.len() == 2 * bytes.len()`).
pub fn put_hex(out: &mut [u8], bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 15)];
    }
}

/// A trace id as the 32 lowercase hex digits everyone prints it as.
pub fn trace_id_hex(id: &[u8; 16]) -> String {
    let mut out = [0u8; 32];
    put_hex(&mut out, id);
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_byte(s: &[u8]) -> Result<u8, ParseError> {
    fn digit(c: u8) -> Result<u8, ParseError> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            _ => Err(ParseError::Hex),
        }
    }
    Ok(digit(s[0])? << 4 | digit(s[1])?)
}

/// `tracestate` as passed on in spans: the header's members (several header lines joined with
/// `,` as HTTP combines them), or `None` when absent, empty, not visible ASCII or too long.
pub fn tracestate<'a>(values: impl Iterator<Item = &'a [u8]>) -> Option<String> {
    let mut out = String::new();
    for v in values {
        let v = v.trim_ascii();
        if v.is_empty() {
            continue;
        }
        if !v.iter().all(|c| (0x20..0x7f).contains(c)) {
            return None;
        }
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(std::str::from_utf8(v).ok()?);
    }
    (!out.is_empty() && out.len() <= MAX_TRACESTATE).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_header_round_trips() {
        let tp = TraceParent::parse(GOOD.as_bytes()).unwrap();
        assert!(tp.sampled());
        assert_eq!(
            tp.parent_id,
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert_eq!(&tp.encode()[..], GOOD.as_bytes());
        assert_eq!(
            trace_id_hex(&tp.trace_id),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let unsampled = GOOD.replace("-01", "-00");
        assert!(!TraceParent::parse(unsampled.as_bytes()).unwrap().sampled());
    }

    #[test]
    fn bad_headers_are_refused_with_the_reason() {
        let cases: &[(&str, ParseError)] = &[
            ("", ParseError::Shape),
            (&GOOD[..54], ParseError::Shape),
            (&format!("{GOOD}0"), ParseError::Shape),
            (&GOOD.replace("4bf9", "4BF9"), ParseError::Hex),
            (&GOOD.replace("4bf9", "4bg9"), ParseError::Hex),
            (&GOOD.replacen("00-", "ff-", 1), ParseError::Version),
            (&GOOD.replacen('-', "_", 1), ParseError::Shape),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                ParseError::ZeroTraceId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                ParseError::ZeroParentId,
            ),
            // A later version may add fields, but only after a '-'.
            (
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
                ParseError::Shape,
            ),
        ];
        for (input, want) in cases {
            assert_eq!(
                TraceParent::parse(input.as_bytes()),
                Err(*want),
                "{input:?}"
            );
        }
        // ...and is read when it does.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes";
        assert!(TraceParent::parse(later.as_bytes()).is_ok());
    }

    #[test]
    fn tracestate_joins_lines_and_refuses_junk() {
        let v = [&b"a=1, b=2"[..], b" c=3 "];
        assert_eq!(tracestate(v.into_iter()).as_deref(), Some("a=1, b=2,c=3"));
        assert_eq!(tracestate([&b""[..]].into_iter()), None);
        assert_eq!(tracestate([&b"a=\x01"[..]].into_iter()), None);
        let long = vec![b'a'; MAX_TRACESTATE + 1];
        assert_eq!(tracestate([&long[..]].into_iter()), None);
    }
}
