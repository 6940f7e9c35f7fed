//! A one-pass reader of a request body's routing fields for the shapes clients send, tried before
//! serde ([`super::RequestView::parse`]).
//!
//! serde_json finds the end of a string eight bytes at a time; message contents are most of a
//! chat body, and here they are scanned with `memchr` (vectorised), the body checked for control
//! bytes once (its strings one by one only when it has some). Everything this reader does not
//! handle, or finds wrong, makes it give up (`None`) and serde parses the body as before: errors,
//! their messages and anything unusual (lone surrogate escapes, numbers where strings belong, deep
//! nesting) stay serde's. When it does answer, the answer is serde's (a property test holds the
//! two to each other).

use std::borrow::Cow;

use serde_json::value::RawValue;

use super::messages::{ChatMessage, ContentPart, MessageContent};
use super::request::Fields;

/// Nesting budget; serde's own limit is 128, deeper bodies are left to it.
const MAX_DEPTH: u32 = 100;

/// The fields of `body` (checked UTF-8 already), or `None`: ask serde.
pub(super) fn fields(body: &str, with_messages: bool) -> Option<Fields<'_>> {
    // A body without any control byte (compact JSON, what SDKs send) has none inside its
    // strings either: one vectorised pass instead of a check per string.
    let mut r = Reader {
        s: body,
        i: 0,
        controls: has_control(body.as_bytes()),
    };
    let mut out = Fields::default();
    // stream_options, prompt, tools, chat_template_kwargs: where their values lie.
    let mut raw: [Option<(usize, usize)>; 4] = [None; 4];
    let depth = MAX_DEPTH - 1;
    r.object(|r, key| {
        match &*key {
            "model" => out.model = r.opt_string()?,
            "stream" => out.stream = r.opt_bool()?,
            "stream_options" => raw[0] = r.raw(depth)?,
            "max_tokens" => out.max_tokens = r.opt_uint()?,
            "max_completion_tokens" => out.max_completion_tokens = r.opt_uint()?,
            "cache_salt" => out.cache_salt = r.opt_string()?,
            "prompt_cache_key" => out.prompt_cache_key = r.opt_string()?,
            "messages" if with_messages => out.messages = r.messages(depth)?,
            "prompt" => raw[1] = r.raw(depth)?,
            "tools" => raw[2] = r.raw(depth)?,
            "add_generation_prompt" => out.add_generation_prompt = r.opt_bool()?,
            "chat_template_kwargs" => raw[3] = r.raw(depth)?,
            _ => r.skip(depth)?,
        }
        Some(())
    })?;
    r.ws();
    if r.i != body.len() {
        return None;
    }
    let [so, prompt, tools, kwargs] = raw.map(|span| match span {
        None => Some(None),
        Some((a, b)) => serde_json::from_str::<&RawValue>(&body[a..b])
            .ok()
            .map(Some),
    });
    out.stream_options = so?;
    out.prompt = prompt?;
    out.tools = tools?;
    out.chat_template_kwargs = kwargs?;
    Some(out)
}

struct Reader<'a> {
    s: &'a str,
    i: usize,
    /// The body has control bytes somewhere: strings must be checked for them.
    controls: bool,
}

/// Any byte below 0x20 (not allowed raw in a JSON string). The body's least byte, taken over
/// fixed-size blocks without an early exit inside so that the compiler vectorises them (a
/// byte-wise minimum per 16 bytes): 256-byte blocks, each tested once; then the rest 16 bytes at a
/// time into one running minimum, the last 16 bytes of the body (overlapping what was read
/// already) covering the tail, tested once at the end. 279 instructions for the 1.1 KB bench
/// body, against 528 with a test per 64-byte block and per 16-byte chunk (callgrind, standalone).
#[inline]
fn has_control(b: &[u8]) -> bool {
    let least = |block: &[u8]| block.iter().fold(u8::MAX, |m, &c| m.min(c));
    let mut blocks = b.chunks_exact(256);
    for block in &mut blocks {
        if least(block) < 0x20 {
            return true;
        }
    }
    if b.len() < 16 {
        return b.iter().any(|&c| c < 0x20);
    }
    let mut acc = [u8::MAX; 16];
    let mut fold = |chunk: &[u8]| {
        for (a, &c) in acc.iter_mut().zip(chunk) {
            *a = (*a).min(c);
        }
    };
    let mut small = blocks.remainder().chunks_exact(16);
    for chunk in &mut small {
        fold(chunk);
    }
    fold(&b[b.len() - 16..]);
    least(&acc) < 0x20
}

/// Where the first `"` or `\\` of `s` is. Most strings of a request (its keys, roles, model
/// names) end within 16 bytes: those are read as two 8-byte words (a zero-byte test per word on
/// `s` xor each byte, whose lowest flagged byte is exact), without memchr2's setup per call;
/// anything longer is memchr2's from there.
#[inline]
fn quote_or_backslash(s: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
    let mut at = 0;
    while at < 16 && at + 8 <= s.len() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&s[at..at + 8]);
        let w = u64::from_le_bytes(w);
        let hit = zero(w ^ (ONES * u64::from(b'"'))) | zero(w ^ (ONES * u64::from(b'\\')));
        if hit != 0 {
            return Some(at + (hit.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    memchr::memchr2(b'"', b'\\', &s[at..]).map(|k| at + k)
}

fn hex(c: u8) -> Option<u32> {
    (c as char).to_digit(16)
}

impl<'a> Reader<'a> {
    #[inline]
    fn bytes(&self) -> &'a [u8] {
        self.s.as_bytes()
    }

    #[inline]
    fn ws(&mut self) {
        let b = self.bytes();
        while matches!(b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    #[inline]
    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.bytes().get(self.i).copied()
    }

    #[inline]
    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        self.i += usize::from(hit);
        hit
    }

    /// `word` at the cursor (whitespace skipped already).
    fn lit(&mut self, word: &[u8]) -> Option<()> {
        self.bytes()[self.i..].starts_with(word).then(|| {
            self.i += word.len();
        })
    }

    fn hex4(&mut self) -> Option<u32> {
        let d = self.bytes().get(self.i..self.i + 4)?;
        let v = d.iter().try_fold(0u32, |v, &c| Some(v << 4 | hex(c)?))?;
        self.i += 4;
        Some(v)
    }

    /// A string, borrowed from the body unless it has escapes. Lone surrogate escapes give up.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        if !self.eat(b'"') {
            return None;
        }
        // Most strings have no escape: borrowed in one search, without the escape machinery
        // (out of line, so this path saves and restores few registers).
        let b = self.bytes();
        let k = quote_or_backslash(&b[self.i..])?;
        if b[self.i + k] != b'"' {
            return self.escaped_string();
        }
        if self.controls && has_control(&b[self.i..self.i + k]) {
            return None;
        }
        // Quotes are ASCII: the cut is on a char boundary.
        let text = &self.s[self.i..self.i + k];
        self.i += k + 1;
        Some(Cow::Borrowed(text))
    }

    /// The rest of [`Self::string`] (the cursor just past the opening quote) for a string with
    /// an escape: unescaped into an owned string.
    #[cold]
    #[inline(never)]
    fn escaped_string(&mut self) -> Option<Cow<'a, str>> {
        let b = self.bytes();
        let mut seg = self.i;
        let mut owned: Option<String> = None;
        loop {
            let k = memchr::memchr2(b'"', b'\\', &b[self.i..])?;
            if self.controls && has_control(&b[self.i..self.i + k]) {
                return None;
            }
            self.i += k;
            // Quotes and backslashes are ASCII: every cut below is on a char boundary.
            let text = &self.s[seg..self.i];
            if b[self.i] == b'"' {
                self.i += 1;
                return Some(match owned {
                    None => Cow::Borrowed(text),
                    Some(mut o) => {
                        o.push_str(text);
                        Cow::Owned(o)
                    }
                });
            }
            let o = owned.get_or_insert_with(|| String::with_capacity(k + 16));
            o.push_str(text);
            let esc = *b.get(self.i + 1)?;
            self.i += 2;
            o.push(match esc {
                b'"' => '"',
                b'\\' => '\\',
                b'/' => '/',
                b'b' => '\u{8}',
                b'f' => '\u{c}',
                b'n' => '\n',
                b'r' => '\r',
                b't' => '\t',
                b'u' => {
                    let hi = self.hex4()?;
                    match hi {
                        0xD800..=0xDBFF => {
                            self.lit(b"\\u")?;
                            let lo = self.hex4()?;
                            if !(0xDC00..=0xDFFF).contains(&lo) {
                                return None;
                            }
                            char::from_u32(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00))?
                        }
                        _ => char::from_u32(hi)?,
                    }
                }
                _ => return None,
            });
            seg = self.i;
        }
    }

    /// Past a string without reading it (escapes are checked as serde's `IgnoredAny` does).
    fn skip_string(&mut self) -> Option<()> {
        if !self.eat(b'"') {
            return None;
        }
        let b = self.bytes();
        loop {
            let k = quote_or_backslash(&b[self.i..])?;
            if self.controls && has_control(&b[self.i..self.i + k]) {
                return None;
            }
            self.i += k + 1;
            if b[self.i - 1] == b'"' {
                return Some(());
            }
            match *b.get(self.i)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i += 1,
                b'u' => {
                    self.i += 1;
                    self.hex4()?;
                }
                _ => return None,
            }
        }
    }

    fn digits(&mut self) -> usize {
        let b = self.bytes();
        let start = self.i;
        while b.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        self.i - start
    }

    /// Past a number (JSON's grammar; the value is not computed, as serde's `IgnoredAny`).
    fn skip_number(&mut self) -> Option<()> {
        let b = self.bytes();
        if b.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match b.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return None,
        }
        if b.get(self.i) == Some(&b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return None;
            }
        }
        if matches!(b.get(self.i), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(())
    }

    /// Past any value.
    fn skip(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => self.skip_string(),
            b'{' => {
                let depth = depth.checked_sub(1)?;
                self.i += 1;
                if self.eat(b'}') {
                    return Some(());
                }
                loop {
                    self.skip_string()?;
                    if !self.eat(b':') {
                        return None;
                    }
                    self.skip(depth)?;
                    if self.eat(b'}') {
                        return Some(());
                    }
                    if !self.eat(b',') {
                        return None;
                    }
                }
            }
            b'[' => {
                let depth = depth.checked_sub(1)?;
                self.i += 1;
                if self.eat(b']') {
                    return Some(());
                }
                loop {
                    self.skip(depth)?;
                    if self.eat(b']') {
                        return Some(());
                    }
                    if !self.eat(b',') {
                        return None;
                    }
                }
            }
            b't' => self.lit(b"true"),
            b'f' => self.lit(b"false"),
            b'n' => self.lit(b"null"),
            _ => self.skip_number(),
        }
    }

    /// `null` (as absent), or a value whose text is kept: where it lies in the body.
    fn raw(&mut self, depth: u32) -> Option<Option<(usize, usize)>> {
        if self.peek()? == b'n' {
            return self.lit(b"null").map(|()| None);
        }
        let start = self.i;
        self.skip(depth)?;
        Some(Some((start, self.i)))
    }

    /// `null` (as absent) or a string.
    fn opt_string(&mut self) -> Option<Option<Cow<'a, str>>> {
        match self.peek()? {
            b'n' => self.lit(b"null").map(|()| None),
            _ => self.string().map(Some),
        }
    }

    /// `null` (as absent) or a boolean.
    fn opt_bool(&mut self) -> Option<Option<bool>> {
        match self.peek()? {
            b'n' => self.lit(b"null").map(|()| None),
            b't' => self.lit(b"true").map(|()| Some(true)),
            b'f' => self.lit(b"false").map(|()| Some(false)),
            _ => None,
        }
    }

    /// `null` (as absent) or an unsigned integer that fits u64 (a sign, fraction or exponent is
    /// serde's to judge).
    fn opt_uint(&mut self) -> Option<Option<u64>> {
        if self.peek()? == b'n' {
            return self.lit(b"null").map(|()| None);
        }
        let b = self.bytes();
        let start = self.i;
        let mut n = 0u64;
        while let Some(&c) = b.get(self.i).filter(|c| c.is_ascii_digit()) {
            n = n.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
            self.i += 1;
        }
        let len = self.i - start;
        if len == 0 || (len > 1 && b[start] == b'0') {
            return None;
        }
        if matches!(b.get(self.i), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        Some(Some(n))
    }

    /// `messages`: `null` (as absent) or an array of message objects.
    fn messages(&mut self, depth: u32) -> Option<Option<Vec<ChatMessage<'a>>>> {
        match self.peek()? {
            b'n' => return self.lit(b"null").map(|()| None),
            b'[' => self.i += 1,
            _ => return None,
        }
        let depth = depth.checked_sub(1)?;
        let mut out = Vec::with_capacity(4);
        if self.eat(b']') {
            return Some(Some(out));
        }
        loop {
            out.push(self.message(depth)?);
            if self.eat(b']') {
                return Some(Some(out));
            }
            if !self.eat(b',') {
                return None;
            }
        }
    }

    /// `{ "key": value, … }`, calling `member` after each key's colon to read the value.
    fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, Cow<'a, str>) -> Option<()>,
    ) -> Option<()> {
        if !self.eat(b'{') {
            return None;
        }
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            let key = self.string()?;
            if !self.eat(b':') {
                return None;
            }
            member(self, key)?;
            if self.eat(b'}') {
                return Some(());
            }
            if !self.eat(b',') {
                return None;
            }
        }
    }

    fn message(&mut self, depth: u32) -> Option<ChatMessage<'a>> {
        let depth = depth.checked_sub(1)?;
        let (mut role, mut content) = (None, None);
        self.object(|r, key| {
            match &*key {
                "role" => role = Some(r.string()?),
                "content" => content = r.content(depth)?,
                _ => r.skip(depth)?,
            }
            Some(())
        })?;
        Some(ChatMessage {
            role: role?,
            content,
        })
    }

    /// `content`: `null`, a string, or an array of parts.
    fn content(&mut self, depth: u32) -> Option<Option<MessageContent<'a>>> {
        match self.peek()? {
            b'n' => return self.lit(b"null").map(|()| None),
            b'"' => return self.string().map(|t| Some(MessageContent::Text(t))),
            b'[' => self.i += 1,
            _ => return None,
        }
        let depth = depth.checked_sub(1)?;
        let mut parts = Vec::with_capacity(2);
        if !self.eat(b']') {
            loop {
                parts.push(self.part(depth)?);
                if self.eat(b']') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
            }
        }
        Some(Some(MessageContent::Parts(parts)))
    }

    fn part(&mut self, depth: u32) -> Option<ContentPart<'a>> {
        let depth = depth.checked_sub(1)?;
        let (mut kind, mut text) = (None, None);
        self.object(|r, key| {
            match &*key {
                "type" => kind = Some(r.string()?),
                "text" => text = Some(r.string()?),
                _ => r.skip(depth)?,
            }
            Some(())
        })?;
        let kind = kind?;
        if kind == "text" && text.is_none() {
            return None;
        }
        Some(ContentPart { kind, text })
    }
}

#[cfg(test)]
mod tests;
