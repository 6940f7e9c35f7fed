//! `ObservedBody`: the worker's response body passed through to the client byte for byte, while
//! watching it: time to first token, inter-token gaps, `usage`, mid-stream errors and the end.
//!
//! Ending is handled in one place whatever the cause: the worker finished (`Complete`), the worker
//! failed or went silent after the first byte (the stream ends with an SSE `data: {"error":…}`
//! event, never a hang — `StreamError`), or the client went away and hyper dropped the body
//! (`Cancelled`). Dropping the inner body drops the upstream connection, which cancels the request
//! on the worker; finishing the request context releases its load guard at once.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use memchr::memmem;

/// A searcher for `needle` built once per call site: setting one up costs more than searching
/// a short event or response with it, and these searches run on every streamed event.
macro_rules! finder {
    ($kind:ident, $needle:expr) => {{
        static F: std::sync::LazyLock<memmem::$kind<'static>> =
            std::sync::LazyLock::new(|| memmem::$kind::new($needle));
        &*F
    }};
}

use crate::body::BodyError;
use crate::ctx::{Outcome, PromptDetails, RequestCtx, Usage};
use crate::error::sse_error_event;
use kvgate_http::client::ResponseBody;

/// Non-stream bodies: bytes kept from the end of the body to find `usage` in.
const TAIL_KEEP: usize = 8 << 10;
/// A partial SSE line longer than this is not an OpenAI event; stop buffering it.
const MAX_LINE: usize = 1 << 20;

pub struct ObservedBody {
    inner: ResponseBody,
    ctx: RequestCtx,
    /// Streams only: fires when the worker sends nothing for this long.
    idle: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
    scan: Scan,
    /// SSE error event still to deliver before the end.
    pending: Option<Bytes>,
    done: bool,
}

enum Scan {
    /// `text/event-stream`: incomplete last line carried over between chunks.
    Sse {
        partial: Vec<u8>,
        saw_done: bool,
        strip: Option<Strip>,
    },
    /// JSON document: the last `TAIL_KEEP` bytes.
    Json { tail: Vec<u8> },
}

/// Removes the usage-only event that the gateway itself asked for (`include_usage` spliced into the
/// request) from the client's stream. Works on whole lines, so a line split across worker chunks is
/// held until it is complete; every other byte is delivered unchanged and in order.
#[derive(Default)]
struct Strip {
    /// Bytes of the current worker chunk to deliver.
    out: Vec<u8>,
    /// A usage-only `data:` line was dropped: drop the blank line ending its event too.
    skip_blank: bool,
    /// The current line outgrew `MAX_LINE`: pass it through unexamined up to its newline.
    raw: bool,
}

impl Strip {
    fn line(&mut self, line: &[u8], usage_only: bool) {
        if usage_only {
            self.skip_blank = true;
            return;
        }
        let blank = line.strip_suffix(b"\r").unwrap_or(line).is_empty();
        if std::mem::take(&mut self.skip_blank) && blank {
            return;
        }
        // With `include_usage`, OpenAI-style servers add `"usage":null` to every other chunk;
        // a client that did not ask for usage never sees that field.
        match line
            .starts_with(b"data:")
            .then(|| null_usage(line))
            .flatten()
        {
            Some((from, to)) => {
                self.out.extend_from_slice(&line[..from]);
                self.out.extend_from_slice(&line[to..]);
            }
            None => self.out.extend_from_slice(line),
        }
        self.out.push(b'\n');
    }
}

/// The byte range of a `"usage": null` member in `line` with the comma that separates it from
/// its neighbour, if there is one. A raw `"usage"` cannot occur inside a JSON string (its quotes
/// would be escaped), so a match is a member of some object, in practice the chunk itself.
fn null_usage(line: &[u8]) -> Option<(usize, usize)> {
    const KEY: &[u8] = b"\"usage\"";
    let ws = |b: &u8| matches!(b, b' ' | b'\t');
    let k = finder!(Finder, KEY).find(line)?;
    let mut e = k + KEY.len();
    e += line[e..].iter().take_while(|b| ws(b)).count();
    if line.get(e) != Some(&b':') {
        return None;
    }
    e += 1;
    e += line[e..].iter().take_while(|b| ws(b)).count();
    if !line[e..].starts_with(b"null") {
        return None;
    }
    e += 4;
    if !matches!(line.get(e), Some(b' ' | b'\t' | b',' | b'}')) {
        return None;
    }
    // `, "usage": null` after a member, or `"usage": null, ` before one.
    let before = line[..k].iter().rev().take_while(|b| ws(b)).count();
    if k > before && line[k - before - 1] == b',' {
        return Some((k - before - 1, e));
    }
    let after = line[e..].iter().take_while(|b| ws(b)).count();
    if line.get(e + after) == Some(&b',') {
        let next = line[e + after + 1..].iter().take_while(|b| ws(b)).count();
        return Some((k, e + after + 1 + next));
    }
    Some((k, e))
}

impl ObservedBody {
    /// With `ctx.strip_usage` (the gateway asked for usage, the client did not), a stream's
    /// usage-only event is removed on the way to the client.
    pub fn new(
        inner: ResponseBody,
        ctx: RequestCtx,
        sse: bool,
        idle_timeout: Option<Duration>,
    ) -> Self {
        // Both kinds of body: a JSON body that stalls mid-way would otherwise hold the client
        // (and the worker's load) forever, since `response_timeout_s` ends at the head.
        let idle = idle_timeout.map(|d| (Box::pin(tokio::time::sleep(d)), d));
        let strip = ctx.strip_usage.then(Strip::default);
        ObservedBody {
            inner,
            ctx,
            idle,
            scan: if sse {
                Scan::Sse {
                    partial: Vec::new(),
                    saw_done: false,
                    strip,
                }
            } else {
                Scan::Json { tail: Vec::new() }
            },
            pending: None,
            done: false,
        }
    }

    fn observe(&mut self, data: &[u8]) {
        match &mut self.scan {
            Scan::Json { tail } => {
                if data.len() >= TAIL_KEEP {
                    tail.clear();
                    tail.extend_from_slice(&data[data.len() - TAIL_KEEP..]);
                } else {
                    let excess = (tail.len() + data.len()).saturating_sub(TAIL_KEEP);
                    tail.drain(..excess);
                    tail.extend_from_slice(data);
                }
            }
            Scan::Sse {
                partial,
                saw_done,
                strip,
            } => {
                let now = Instant::now();
                let mut rest = data;
                if let Some(st) = strip.as_mut().filter(|st| st.raw) {
                    match memchr::memchr(b'\n', rest) {
                        Some(i) => {
                            st.out.extend_from_slice(&rest[..=i]);
                            st.raw = false;
                            rest = &rest[i + 1..];
                        }
                        None => {
                            st.out.extend_from_slice(rest);
                            return;
                        }
                    }
                }
                // Complete the carried-over line first.
                if !partial.is_empty() {
                    match memchr::memchr(b'\n', rest) {
                        Some(i) => {
                            partial.extend_from_slice(&rest[..i]);
                            let usage_only = sse_line(partial, &mut self.ctx, saw_done, now);
                            if let Some(st) = strip {
                                st.line(partial, usage_only);
                            }
                            partial.clear();
                            rest = &rest[i + 1..];
                        }
                        None => {
                            if partial.len() + rest.len() <= MAX_LINE {
                                partial.extend_from_slice(rest);
                            } else if let Some(st) = strip {
                                st.out.extend_from_slice(partial);
                                st.out.extend_from_slice(rest);
                                partial.clear();
                                st.raw = true;
                            }
                            return;
                        }
                    }
                }
                while let Some(i) = memchr::memchr(b'\n', rest) {
                    let usage_only = sse_line(&rest[..i], &mut self.ctx, saw_done, now);
                    if let Some(st) = strip {
                        st.line(&rest[..i], usage_only);
                    }
                    rest = &rest[i + 1..];
                }
                if !rest.is_empty() {
                    if rest.len() <= MAX_LINE {
                        partial.extend_from_slice(rest);
                    } else if let Some(st) = strip {
                        st.out.extend_from_slice(rest);
                        st.raw = true;
                    }
                }
            }
        }
    }

    /// Stripping: what to deliver of the chunk just observed (`None`: deliver the chunk as is).
    fn take_out(&mut self) -> Option<Bytes> {
        match &mut self.scan {
            Scan::Sse {
                strip: Some(st), ..
            } => Some(Bytes::from(std::mem::take(&mut st.out))),
            _ => None,
        }
    }

    /// Stripping: a last line without newline, held back, goes out when the stream ends.
    fn take_held(&mut self) -> Option<Bytes> {
        match &mut self.scan {
            Scan::Sse {
                partial,
                strip: Some(_),
                ..
            } if !partial.is_empty() => Some(Bytes::from(std::mem::take(partial))),
            _ => None,
        }
    }

    fn finish_ok(&mut self) {
        if let Scan::Json { tail } = &self.scan {
            if let Some(u) = usage_in(tail) {
                self.ctx.usage = Some(u);
            }
            // Non-stream: the whole response is the "first token" (prefill and decode done).
            self.ctx.on_token(Instant::now());
        }
        self.ctx.finish(Outcome::Complete);
    }

    fn fail_stream(&mut self, why: &str) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.done = true;
        self.ctx.error = Some("upstream_stream");
        self.ctx.finish(Outcome::StreamError);
        Poll::Ready(Some(Ok(Frame::data(sse_error_event(why)))))
    }
}

/// One SSE line: `data: {...}` events are classified; comments and other fields are ignored.
/// Returns true for the usage-only chunk (`"choices":[]` with `usage`) `include_usage` adds.
fn sse_line(line: &[u8], ctx: &mut RequestCtx, saw_done: &mut bool, now: Instant) -> bool {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(payload) = line.strip_prefix(b"data:") else {
        return false;
    };
    let payload = payload.strip_prefix(b" ").unwrap_or(payload);
    if payload == b"[DONE]" {
        *saw_done = true;
        return false;
    }
    if payload.starts_with(b"{\"error\"")
        || finder!(Finder, b"\"object\":\"error\"")
            .find(payload)
            .is_some()
    {
        ctx.error = Some("upstream_stream");
        return false;
    }
    let usage = usage_in(payload);
    let has_usage = usage.is_some();
    if usage.is_some() {
        ctx.usage = usage;
    }
    // The usage-only chunk (`"choices":[]`) is not a token.
    let no_choices = finder!(Finder, b"\"choices\":[]").find(payload).is_some();
    if !no_choices {
        ctx.on_token(now);
    }
    has_usage && no_choices
}

/// Parse the last `"usage":{...}` object in `buf`. A raw `"usage":` cannot occur inside a JSON
/// string (quotes are escaped there), so the last match is the document's own usage field.
fn usage_in(buf: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\":";
    let at = finder!(FinderRev, KEY).rfind(buf)?;
    let rest = &buf[at + KEY.len()..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    if rest[start] != b'{' {
        return None;
    }
    let obj = &rest[start..];
    usage_fast(obj).or_else(|| usage_serde(obj))
}

/// The `usage` object starting at `obj[0] == b'{'`, parsed by serde (any JSON shape).
fn usage_serde(obj: &[u8]) -> Option<Usage> {
    let mut it = serde_json::Deserializer::from_slice(obj).into_iter::<Usage>();
    it.next()?.ok()
}

/// [`usage_serde`] for the shape workers send (unescaped keys, integer or null values, one level
/// of nesting), in one pass without serde's machinery. `None`: the object has something else (a
/// string, an array, a float, a duplicate key, a syntax error…) and serde decides.
fn usage_fast(obj: &[u8]) -> Option<Usage> {
    let mut s = Scanner { b: obj, i: 0 };
    let (mut u, mut seen) = (Usage::default(), 0u8);
    s.object(|s, key| {
        let bit = match key {
            b"prompt_tokens" => 1,
            b"completion_tokens" => 2,
            b"prompt_tokens_details" => 4,
            _ => return s.skip_scalar(),
        };
        if seen & bit != 0 {
            return None; // a duplicate field: serde refuses the object
        }
        seen |= bit;
        match bit {
            1 => u.prompt_tokens = s.uint()?,
            2 => u.completion_tokens = s.uint()?,
            _ if s.null() => {}
            _ => {
                let mut cached = None::<Option<u64>>;
                s.object(|s, key| {
                    if key != b"cached_tokens" {
                        return s.skip_scalar();
                    }
                    if cached.is_some() {
                        return None;
                    }
                    cached = Some(if s.null() { None } else { Some(s.uint()?) });
                    Some(())
                })?;
                u.prompt_tokens_details = Some(PromptDetails {
                    cached_tokens: cached.flatten(),
                });
            }
        }
        Some(())
    })?;
    Some(u)
}

/// A forward-only reader for [`usage_fast`]: `None` for anything it does not handle.
struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    fn ws(&mut self) {
        while matches!(self.b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        let hit = self.b.get(self.i) == Some(&c);
        self.i += usize::from(hit);
        hit
    }

    fn null(&mut self) -> bool {
        self.ws();
        let hit = self.b[self.i..].starts_with(b"null");
        self.i += if hit { 4 } else { 0 };
        hit
    }

    /// A JSON unsigned integer that fits u64 (no sign, fraction, exponent or leading zero).
    fn uint(&mut self) -> Option<u64> {
        self.ws();
        let start = self.i;
        let mut n = 0u64;
        while let Some(&c) = self.b.get(self.i) {
            if !c.is_ascii_digit() {
                break;
            }
            n = n.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
            self.i += 1;
        }
        let digits = self.i - start;
        if digits == 0 || (digits > 1 && self.b[start] == b'0') {
            return None;
        }
        if matches!(self.b.get(self.i), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        Some(n)
    }

    /// The value of a member we do not read: null or an unsigned integer.
    fn skip_scalar(&mut self) -> Option<()> {
        if !self.null() {
            self.uint()?;
        }
        Some(())
    }

    /// `{ "key": value, … }`, calling `member` after each key's colon to read the value.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        if !self.eat(b'{') {
            return None;
        }
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            if !self.eat(b'"') {
                return None;
            }
            let rest = &self.b[self.i..];
            let end = memchr::memchr(b'"', rest)?;
            // An escape or a control character: serde's business (branch-free, keys are short).
            if rest[..end]
                .iter()
                .fold(false, |odd, &c| odd | (c == b'\\') | (c < 0x20))
            {
                return None;
            }
            self.i += end + 1;
            if !self.eat(b':') {
                return None;
            }
            member(self, &rest[..end])?;
            if self.eat(b'}') {
                return Some(());
            }
            if !self.eat(b',') {
                return None;
            }
        }
    }
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Some(ev) = this.pending.take() {
            return Poll::Ready(Some(Ok(Frame::data(ev))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(mut frame))) => {
                    if let Some(data) = frame.data_ref() {
                        this.observe(data);
                        if let Some(out) = this.take_out() {
                            frame = Frame::data(out);
                        }
                    }
                    if let Some((sleep, d)) = &mut this.idle {
                        sleep.as_mut().reset(tokio::time::Instant::now() + *d);
                    }
                    // A body of known length ends with its last data frame: hyper stops polling
                    // once it has sent content-length bytes, so waiting for `None` would record a
                    // complete response as cancelled when the body is dropped.
                    if this.inner.is_end_stream() {
                        this.done = true;
                        this.pending = this.take_held();
                        this.finish_ok();
                    }
                    if frame.data_ref().is_some_and(|d| d.is_empty()) {
                        // Everything in this chunk was held back or stripped.
                        if this.done {
                            return Poll::Ready(this.pending.take().map(|b| Ok(Frame::data(b))));
                        }
                        continue;
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(e))) => {
                    return if matches!(this.scan, Scan::Sse { .. }) {
                        this.fail_stream(&format!("worker connection failed mid-stream: {e}"))
                    } else {
                        this.done = true;
                        this.ctx.error = Some("upstream_body");
                        this.ctx.finish(Outcome::StreamError);
                        Poll::Ready(Some(Err(e)))
                    };
                }
                Poll::Ready(None) => {
                    this.done = true;
                    this.finish_ok();
                    return Poll::Ready(this.take_held().map(|b| Ok(Frame::data(b))));
                }
                Poll::Pending => {
                    if let Some((sleep, d)) = &mut this.idle {
                        if sleep.as_mut().poll(cx).is_ready() {
                            let secs = d.as_secs_f64();
                            let why = format!("worker sent nothing for {secs:.0} s mid-stream");
                            if matches!(this.scan, Scan::Sse { .. }) {
                                return this.fail_stream(&why);
                            }
                            // A JSON body whose head is out: only a cut connection says so.
                            this.done = true;
                            this.ctx.error = Some("upstream_body");
                            this.ctx.finish(Outcome::StreamError);
                            return Poll::Ready(Some(Err(kvgate_http::client::Error::Io(why))));
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.pending.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if matches!(self.scan, Scan::Sse { .. }) && self.idle.is_some() {
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

impl Drop for ObservedBody {
    fn drop(&mut self) {
        // Body dropped before its end: the client disconnected. `finish` releases the load guard
        // now; `inner` is dropped right after, closing the worker connection (cancelling it there).
        if !self.done {
            // A client that hangs up right after `data: [DONE]` (before the chunked terminator)
            // received the whole answer: that is a completed request, not a cancel.
            if matches!(self.scan, Scan::Sse { saw_done: true, .. }) {
                self.done = true;
                self.finish_ok();
            } else {
                self.ctx.finish(Outcome::Cancelled);
            }
        }
    }
}

use std::future::Future as _;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_usage_members_are_cut_with_their_comma() {
        let cut = |l: &str| {
            let b = l.as_bytes();
            match null_usage(b) {
                Some((f, t)) => format!("{}{}", &l[..f], &l[t..]),
                None => l.to_owned(),
            }
        };
        assert_eq!(
            cut(r#"data: {"id":"x","choices":[{"index":0}],"usage":null}"#),
            r#"data: {"id":"x","choices":[{"index":0}]}"#
        );
        assert_eq!(
            cut(r#"data: {"id": "x", "usage": null, "choices": []}"#),
            r#"data: {"id": "x", "choices": []}"#
        );
        assert_eq!(cut(r#"data: {"usage":null}"#), r#"data: {}"#);
        assert_eq!(
            cut(r#"data: {"usage": null , "a": 1}"#),
            r#"data: {"a": 1}"#
        );
        // Not null, or not a member: untouched.
        for keep in [
            r#"data: {"usage":{"prompt_tokens":1}}"#,
            r#"data: {"usage":nullx}"#,
            r#"data: {"text":"say "usage":null"}"#,
        ] {
            let b = keep.as_bytes();
            if let Some((f, t)) = null_usage(b) {
                panic!("{keep}: would cut {:?}", &keep[f..t]);
            }
        }
    }

    #[test]
    fn usage_is_found_at_the_end() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"say \"usage\": no"}}],"usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#;
        let u = usage_in(body).unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (12, 3));
        assert_eq!(u.prompt_tokens_details.unwrap().cached_tokens, Some(8));
        assert!(usage_in(br#"{"usage":null}"#).is_none());
    }

    fn key(u: Option<Usage>) -> Option<(u64, u64, Option<Option<u64>>)> {
        u.map(|u| {
            let d = u.prompt_tokens_details.map(|d| d.cached_tokens);
            (u.prompt_tokens, u.completion_tokens, d)
        })
    }

    #[test]
    fn worker_usage_shapes_take_the_fast_path() {
        for (obj, want) in [
            // vLLM
            (
                r#"{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,"prompt_tokens_details":null}"#,
                (12, 3, None),
            ),
            (
                r#"{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}"#,
                (12, 3, Some(Some(8))),
            ),
            // SGLang, spaced
            (
                "{ \"prompt_tokens\" : 7 ,\n \"completion_tokens\":0, \"total_tokens\": 7, \"prompt_tokens_details\": { \"cached_tokens\": null } }",
                (7, 0, Some(None)),
            ),
            (r#"{}"#, (0, 0, None)),
            (r#"{"completion_tokens":18446744073709551615}"#, (0, u64::MAX, None)),
        ] {
            let fast = usage_fast(obj.as_bytes());
            assert_eq!(key(fast), Some(want), "{obj}");
            assert_eq!(key(usage_serde(obj.as_bytes())), Some(want), "{obj}");
        }
    }

    #[test]
    fn other_shapes_are_left_to_serde() {
        for obj in [
            r#"{"prompt_tokens":12,"prompt_tokens":13}"#,
            r#"{"prompt_tokens":1.0}"#,
            r#"{"prompt_tokens":-1}"#,
            r#"{"prompt_tokens":01}"#,
            r#"{"prompt_tokens":null}"#,
            r#"{"prompt_tokens":"12"}"#,
            r#"{"completion_tokens":18446744073709551616}"#,
            r#"{"prompt_tokens_details":{"cached_tokens":1,"cached_tokens":2}}"#,
            r#"{"prompt_tokens_details":{"audio_tokens":{"x":1}}}"#,
            r#"{"extra":[1,2],"prompt_tokens":3}"#,
            r#"{"extra":"text","prompt_tokens":3}"#,
            r#"{"pro\u006dpt_tokens":3}"#,
            r#"{"prompt_tokens":3,}"#,
            r#"{"prompt_tokens":3"#,
            r#"{"prompt_tokens" 3}"#,
            r#"{"prompt_tokens":nullx}"#,
        ] {
            assert!(usage_fast(obj.as_bytes()).is_none(), "{obj}");
        }
        // serde still reads what it can.
        let u = usage_in(br#"{"usage":{"extra":"text","prompt_tokens":3}}"#);
        assert_eq!(key(u), Some((3, 0, None)));
        let u = usage_in(br#"{"usage":{"pro\u006dpt_tokens":3}}"#);
        assert_eq!(key(u), Some((3, 0, None)));
    }

    proptest::proptest! {
        /// Whenever the fast path answers, serde answers the same; it answers for every object of
        /// unescaped keys with integer or null values.
        #[test]
        fn fast_usage_agrees_with_serde(
            members in proptest::collection::vec((0usize..6, 0usize..8, proptest::bool::ANY), 0..6),
            inner in proptest::collection::vec((0usize..3, 0usize..8), 0..3),
            ws in 0usize..3,
        ) {
            const KEYS: [&str; 6] = [
                "prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
                "x", "prompt_tokens_details",
            ];
            const VALUES: [&str; 8] = ["0", "7", "123456", "null", "1.5", "\"s\"", "-3", "012"];
            const IN_KEYS: [&str; 3] = ["cached_tokens", "audio_tokens", "cached_tokens"];
            let sp = [" ", "", "\n\t "][ws];
            let nested: Vec<String> = inner
                .iter()
                .map(|&(k, v)| format!("\"{}\"{sp}:{sp}{}", IN_KEYS[k], VALUES[v]))
                .collect();
            let nested = format!("{{{sp}{}{sp}}}", nested.join(","));
            let body: Vec<String> = members
                .iter()
                .map(|&(k, v, obj)| {
                    let v = if KEYS[k] == "prompt_tokens_details" && obj { nested.as_str() } else { VALUES[v] };
                    format!("{sp}\"{}\"{sp}:{v}", KEYS[k])
                })
                .collect();
            let obj = format!("{{{}{sp}}}", body.join(","));
            let serde = key(usage_serde(obj.as_bytes()));
            if let Some(fast) = usage_fast(obj.as_bytes()) {
                proptest::prop_assert_eq!(key(Some(fast)), serde, "{}", obj);
            }
            let simple = ["1.5", "\"s\"", "-3", "012"].iter().all(|v| !obj.contains(v));
            if simple && serde.is_some() {
                proptest::prop_assert!(usage_fast(obj.as_bytes()).is_some(), "{}", obj);
            }
        }
    }
}
