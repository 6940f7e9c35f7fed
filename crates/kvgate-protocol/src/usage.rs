//! The OpenAI `usage` object: token counts a worker reports at the end of a response (the last
//! chunk of a stream with `stream_options.include_usage`, or the end of a JSON response).
//!
//! [`find_usage`] finds the last `"usage": {…}` member in a buffer and reads it in one pass
//! (`usage_fast`) for the shapes workers send; anything else goes to serde (`usage_serde`), the
//! plain twin a property test holds the fast path equal to.

use serde::Deserialize;

mod pd_merge;
pub use pd_merge::{merge_pd_usage, merge_pd_usage_event};

/// Token counts from a `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// `prompt_tokens_details.cached_tokens` (vLLM fills it only with
    /// `--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`).
    pub cached_tokens: Option<u64>,
}

/// A searcher for `needle` built once per call site: setting one up costs more than searching
/// a short event with it, and these searches run on every streamed event.
macro_rules! finder {
    ($kind:ident, $needle:expr) => {{
        static F: std::sync::LazyLock<memchr::memmem::$kind<'static>> =
            std::sync::LazyLock::new(|| memchr::memmem::$kind::new($needle));
        &*F
    }};
}
pub(crate) use finder;

/// The first byte of the value after a key ending at `i` (skips `\s*:\s*`); `None` when no colon
/// follows, i.e. the match was a string value rather than a key.
pub(crate) fn value_start(data: &[u8], i: usize) -> Option<(usize, u8)> {
    let rest = data.get(i..)?;
    let after_ws = rest.len() - rest.trim_ascii_start().len();
    let rest = rest[after_ws..].strip_prefix(b":")?;
    let value = rest.trim_ascii_start();
    let at = data.len() - value.len();
    value.first().map(|&b| (at, b))
}

/// The last `"usage"` member of `buf`, read as [`Usage`] when its value is an object. A raw
/// `"usage"` cannot occur inside a JSON string (quotes are escaped there), so a match followed by
/// a colon is a key; the last one is the document's own (a non-stream body ends with it, and a
/// chunk's `"usage": null` says there is none).
pub fn find_usage(buf: &[u8]) -> Option<Usage> {
    let (at, first) = last_usage_key(buf)?;
    if first != b'{' {
        return None;
    }
    let obj = &buf[at..];
    usage_fast(obj).or_else(|| usage_serde(obj))
}

/// Where the value of the last `"usage"` key of `buf` starts, and its first byte. The document's
/// own `usage` is at its end, so the search runs forward (memchr's vectorised search; its reverse
/// searcher has no such prefilter and cost ~4x more per response) over windows taken from the end
/// backwards, stopping at the first window that has a key. Consecutive windows overlap by
/// `KEY.len() - 1` bytes, so a key across a boundary is found once.
fn last_usage_key(buf: &[u8]) -> Option<(usize, u8)> {
    const KEY: &[u8] = b"\"usage\"";
    const WINDOW: usize = 1024;
    let f = finder!(Finder, KEY);
    let mut end = buf.len();
    loop {
        let start = end.saturating_sub(WINDOW);
        let found = f
            .find_iter(&buf[start..end])
            .filter_map(|at| value_start(buf, start + at + KEY.len()))
            .last();
        if found.is_some() || start == 0 {
            return found;
        }
        end = start + KEY.len() - 1;
    }
}

/// Every backend's names for the counts: OpenAI chat (`prompt_tokens`, `completion_tokens`,
/// `prompt_tokens_details.cached_tokens`), OpenAI Responses (`input_tokens`, `output_tokens`,
/// `input_tokens_details.cached_tokens`) and Anthropic (`input_tokens` *not* counting
/// `cache_read_input_tokens` / `cache_creation_input_tokens`: the total input is their sum).
#[derive(Deserialize)]
struct UsageJson {
    #[serde(default, deserialize_with = "count")]
    prompt_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<DetailsJson>,
    #[serde(default, deserialize_with = "count")]
    input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    output_tokens: Option<u64>,
    #[serde(default)]
    input_tokens_details: Option<DetailsJson>,
    #[serde(default, deserialize_with = "count")]
    cache_read_input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    cache_creation_input_tokens: Option<u64>,
}

/// A present count must be an unsigned integer: a `null` count makes the usage unreadable, not
/// zero (an absent one is `None`).
fn count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    u64::deserialize(d).map(Some)
}

impl UsageJson {
    fn usage(&self) -> Usage {
        let anthropic =
            self.cache_read_input_tokens.is_some() || self.cache_creation_input_tokens.is_some();
        let input = match (self.input_tokens, anthropic) {
            (Some(i), true) => Some(
                i + self.cache_read_input_tokens.unwrap_or(0)
                    + self.cache_creation_input_tokens.unwrap_or(0),
            ),
            (i, _) => i,
        };
        Usage {
            prompt_tokens: self.prompt_tokens.or(input).unwrap_or(0),
            completion_tokens: self.completion_tokens.or(self.output_tokens).unwrap_or(0),
            cached_tokens: self
                .prompt_tokens_details
                .as_ref()
                .and_then(|d| d.cached_tokens)
                .or_else(|| {
                    self.input_tokens_details
                        .as_ref()
                        .and_then(|d| d.cached_tokens)
                })
                .or(self.cache_read_input_tokens),
        }
    }
}

/// The counts of a `usage` object's text (any backend's field names; see [`UsageJson`]).
pub(crate) fn usage_of_object(obj: &[u8]) -> Option<Usage> {
    usage_serde(obj)
}

#[derive(Deserialize)]
struct DetailsJson {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// The `usage` object starting at `obj[0] == b'{'`, parsed by serde (any JSON shape; fields that
/// are not unsigned integers make the whole object unreadable, as for any strict client).
fn usage_serde(obj: &[u8]) -> Option<Usage> {
    let mut it = serde_json::Deserializer::from_slice(obj).into_iter::<UsageJson>();
    let u = it.next()?.ok()?;
    Some(u.usage())
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
            // Responses / Anthropic names: serde reads those.
            b"input_tokens"
            | b"output_tokens"
            | b"input_tokens_details"
            | b"cache_read_input_tokens"
            | b"cache_creation_input_tokens" => return None,
            // Every worker sends it; a known plain name needs no escape check.
            b"total_tokens" => return s.skip_scalar(),
            _ => {
                plain(key)?;
                return s.skip_scalar();
            }
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
                        plain(key)?;
                        return s.skip_scalar();
                    }
                    if cached.is_some() {
                        return None;
                    }
                    cached = Some(if s.null() { None } else { Some(s.uint()?) });
                    Some(())
                })?;
                u.cached_tokens = cached.flatten();
            }
        }
        Some(())
    })?;
    Some(u)
}

/// `Some` when `key` (the raw bytes between a key's quotes) has no escape and no control
/// character, i.e. is the key's own text; otherwise the key is serde's business. Only asked of
/// keys that are not one of the plain names matched above (those have neither).
fn plain(key: &[u8]) -> Option<()> {
    // Branch-free: keys are short.
    let odd = key
        .iter()
        .fold(false, |odd, &c| odd | (c == b'\\') | (c < 0x20));
    (!odd).then_some(())
}

/// A forward-only reader for [`usage_fast`]: `None` for anything it does not handle.
struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    #[inline]
    fn ws(&mut self) {
        // Compact JSON has none: one compare for a byte that is not whitespace.
        while let Some(&c) = self.b.get(self.i) {
            if c > b' ' || !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                break;
            }
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

    /// `{ "key": value, … }`, calling `member` after each key's colon with the key's raw bytes
    /// (up to the first quote: a key with an escaped quote or any other escape is never a plain
    /// name, and [`plain`] refuses it).
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
            // The raw bytes go to `member`, which matches them against plain names or checks
            // them with [`plain`]. (memchr: a byte loop measured slower even on these keys.)
            let end = memchr::memchr(b'"', rest)?;
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

#[cfg(test)]
mod tests;
