//! The approximate tokenizer used when a model has no tokenizer configured.
//!
//! It imitates the shape of common byte-level BPEs (GPT / Llama-3 pre-tokenization) without a
//! vocabulary: text is cut into pieces — a letter run with at most one leading space, digit runs
//! in groups of three, a punctuation run with at most one leading space, whitespace runs (the last
//! space of a run joins the following word) — and each piece becomes one token id, hashed from its
//! bytes. Pieces longer than [`WHOLE_PIECE_MAX`] bytes are cut into 4-byte tokens. English prose
//! comes out near 4 characters per token, like cl100k.
//!
//! It runs on every request, so most text takes a fast path: a piece that is ASCII and not
//! followed by a multi-byte char is scanned a byte at a time with a 256-entry class table and
//! hashed during the scan. A piece touching a multi-byte char goes to the general, char-by-char
//! path ([`piece_end`]). Both apply the same rules, and the tests hold `encode` to a char-by-char
//! reference and to the previous implementation: the ids do not depend on which path ran.
//!
//! Guarantees the router relies on: deterministic across runs and machines (FNV-1a, no random
//! seed), and prefix-stable: a piece's boundaries depend only on the bytes before its end and the
//! one character after it (two after a whitespace run: a space followed by a word is not its
//! own), so a text and any extension of it share every token except those of the last piece.
//! Ids never match the worker's, so this only makes routing consistent *between requests*
//! (prefix sharing is still detected); the worker's real cache is keyed on real ids.
//!
//! Whole ChatML messages are cached ([`crate::segments`]): the text is cut before every
//! `<|` that starts a line, which is always a piece boundary (a newline is a piece of its own
//! class and ends at the first char of another class, and the piece after it starts afresh), so
//! each segment's ids depend on its text only and the concatenated ids are those of the whole
//! text. The system prompt and earlier turns of a conversation are then hashed once, not on
//! every request.

use std::sync::Mutex;

use crate::segments::{self, SegCache};
use crate::Tokenizer;

/// Pieces up to this many bytes (leading space included) are one token.
const WHOLE_PIECE_MAX: usize = 8;
/// Longer pieces are cut into tokens of this many bytes (at char boundaries).
const LONG_PIECE_CHUNK: usize = 4;
const DEFAULT_VOCAB: u32 = 100_000;

/// Text is cut into cached segments before each occurrence of this after a newline.
const SEGMENT_START: &[u8] = b"<|";

/// Deterministic, vocabulary-free, ~4 chars/token. See the module docs.
pub struct ApproxTokenizer {
    vocab: u32,
    /// Ids of whole segments (ChatML messages), shared by every encode.
    segments: Mutex<SegCache>,
}

impl std::fmt::Debug for ApproxTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApproxTokenizer")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl Clone for ApproxTokenizer {
    /// The same ids; the clone starts with an empty segment cache of its own.
    fn clone(&self) -> Self {
        Self::with_vocab(self.vocab)
    }
}

impl Default for ApproxTokenizer {
    fn default() -> Self {
        Self::with_vocab(DEFAULT_VOCAB)
    }
}

impl ApproxTokenizer {
    /// Ids are drawn from `0..vocab` (at least 1000, to keep collisions rare).
    pub fn with_vocab(vocab: u32) -> Self {
        Self {
            vocab: vocab.max(1000),
            segments: Mutex::new(SegCache::new(segments::DEFAULT_BUDGET_BYTES)),
        }
    }

    pub fn vocab_size(&self) -> u32 {
        self.vocab
    }

    fn id(&self, piece: &[u8]) -> u32 {
        self.finish(piece.iter().fold(FNV_OFFSET, |h, &b| fnv_step(h, b)))
    }

    /// The id for a piece's FNV-1a state.
    #[inline(always)]
    fn finish(&self, h: u64) -> u32 {
        // Multiply-shift instead of `%` (no division) reads the high bits, which FNV leaves
        // poorly mixed for short pieces (" 1", " 2", … would share ids): fold and mix first.
        let h = (h ^ (h >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        ((u128::from(h) * u128::from(self.vocab)) >> 64) as u32
    }

    /// Ids of a long ASCII piece: every char is one byte, so the chunks are plain slices.
    #[inline(never)]
    fn push_ascii_chunks(&self, piece: &[u8], out: &mut Vec<u32>) {
        let mut chunks = piece.chunks_exact(LONG_PIECE_CHUNK);
        for chunk in &mut chunks {
            // A fixed-size array: the hash loop unrolls.
            let chunk: [u8; LONG_PIECE_CHUNK] = chunk.try_into().expect("an exact chunk");
            out.push(self.id(&chunk));
        }
        if !chunks.remainder().is_empty() {
            out.push(self.id(chunks.remainder()));
        }
    }

    /// The general path for the piece at `start`: split char by char ([`piece_end`]), a long
    /// piece cut into chunks at char boundaries. Returns the piece's end.
    #[inline(never)]
    fn encode_general(&self, text: &str, start: usize, out: &mut Vec<u32>) -> usize {
        let end = piece_end(text, start);
        let piece = &text[start..end];
        if piece.len() <= WHOLE_PIECE_MAX {
            out.push(self.id(piece.as_bytes()));
            return end;
        }
        let mut from = 0;
        while from < piece.len() {
            let mut to = (from + LONG_PIECE_CHUNK).min(piece.len());
            while !piece.is_char_boundary(to) {
                to += 1; // a char wider than the chunk stays whole
            }
            out.push(self.id(&piece.as_bytes()[from..to]));
            from = to;
        }
        end
    }
}

// FNV-1a 64: tiny, stable, good enough spread for a hashed vocabulary.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

#[inline(always)]
fn fnv_step(h: u64, b: u8) -> u64 {
    (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
}

// The fast path's common classes first: testing for them is then one range check.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Letter,
    Other,
    Newline,
    Digit,
    Space,
    /// Not a char class: what [`BYTE_CLASS`] says for bytes of multi-byte chars, whose class
    /// needs the char decoded. [`class`] never returns it.
    NonAscii,
}

fn class(c: char) -> Class {
    if c == '\n' || c == '\r' {
        Class::Newline
    } else if c.is_whitespace() {
        Class::Space
    } else if c.is_numeric() {
        Class::Digit
    } else if c.is_alphabetic() || c == '_' {
        Class::Letter
    } else {
        Class::Other
    }
}

/// [`class`] of each ASCII char, looked up instead of computed (most prompt text is ASCII).
const ASCII_CLASS: [Class; 128] = {
    let mut t = [Class::Other; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        t[b] = if c == b'\n' || c == b'\r' {
            Class::Newline
        } else if c == b' ' || (c >= 0x09 && c <= 0x0c) {
            Class::Space
        } else if c.is_ascii_digit() {
            Class::Digit
        } else if c.is_ascii_alphabetic() || c == b'_' {
            Class::Letter
        } else {
            Class::Other
        };
        b += 1;
    }
    t
};

/// [`ASCII_CLASS`] for any byte, [`Class::NonAscii`] from 0x80 up: one lookup both classifies
/// a byte and rejects it from the fast path. (A plain enum, not an `Option<Class>`: comparing
/// those takes two branches.)
const BYTE_CLASS: [Class; 256] = {
    let mut t = [Class::NonAscii; 256];
    let mut b = 0;
    while b < 128 {
        t[b] = ASCII_CLASS[b];
        b += 1;
    }
    t
};

/// Whether a plain space before a char of this class joins its piece.
#[inline(always)]
fn joins_space(c: Class) -> bool {
    matches!(c, Class::Letter | Class::Other)
}

/// The fast path: the piece starting at byte `start` (< `bytes.len()`), if it and the byte
/// after it are ASCII. Gives its end and the FNV-1a state of its bytes, hashed during the scan
/// (no second pass over the piece).
///
/// `None` hands the piece to the general path ([`piece_end`]), from `start` again: a
/// multi-byte char's class needs the char decoded. The rules are [`piece_end`]'s, on bytes;
/// any byte >= 0x80 they look at (in the piece, right after it, or after a space) gives `None`,
/// so every piece this returns was decided on ASCII alone.
///
/// Always inlined: it is the body of `encode`'s loop.
#[inline(always)]
fn ascii_piece(bytes: &[u8], start: usize) -> Option<(usize, u64)> {
    let b = bytes[start];
    // One plain space joins a following letter or punctuation run, as in GPT-style BPEs: then
    // the run's loop below starts at that char. (Past the end, `Newline` joins nothing.)
    let next = bytes
        .get(start + 1)
        .map_or(Class::Newline, |&n| BYTE_CLASS[usize::from(n)]);
    let cls = if b == b' ' && joins_space(next) {
        next
    } else {
        BYTE_CLASS[usize::from(b)]
    };
    let mut h = fnv_step(FNV_OFFSET, b);
    let mut end = start + 1;
    // (An `if` chain, not a `match`: that one compiles to a jump table, an indirect branch.)
    if matches!(cls, Class::Letter | Class::Other | Class::Newline) {
        // Letters, punctuation, newlines: a plain run. Most are short, so the first 8 bytes are
        // a fixed window (the loop unrolls, with no bounds checks); only a run that fills it
        // (a piece cut into chunks anyway) goes on byte by byte.
        let mut full = true;
        if let Some(window) = bytes.get(end..end + WHOLE_PIECE_MAX) {
            for &b in window {
                if BYTE_CLASS[usize::from(b)] != cls {
                    full = false;
                    break;
                }
                h = fnv_step(h, b);
                end += 1;
            }
        }
        if full {
            while end < bytes.len() && BYTE_CLASS[usize::from(bytes[end])] == cls {
                h = fnv_step(h, bytes[end]);
                end += 1;
            }
        }
    } else if cls == Class::Digit {
        // Digits go in groups of three (a digit piece starts with its first digit).
        while end - start < 3 && end < bytes.len() && bytes[end].is_ascii_digit() {
            h = fnv_step(h, bytes[end]);
            end += 1;
        }
    } else if cls == Class::Space {
        // The last plain space of a run is left for the word after it. (A multi-byte char after
        // a space ends the loop on the next byte, and the check below gives up on the piece.)
        while end < bytes.len() && BYTE_CLASS[usize::from(bytes[end])] == Class::Space {
            if bytes[end] == b' '
                && end + 1 < bytes.len()
                && joins_space(BYTE_CLASS[usize::from(bytes[end + 1])])
            {
                break;
            }
            h = fnv_step(h, bytes[end]);
            end += 1;
        }
    } else {
        return None; // a multi-byte char
    }
    // A multi-byte char right after the piece might be of its class ("caf|é"): not ours to say.
    if end < bytes.len() && bytes[end] >= 0x80 {
        return None;
    }
    Some((end, h))
}

/// The char starting at byte `i` of `text` (a char boundary), its class and its length.
#[inline]
fn char_at(text: &str, i: usize) -> Option<(char, Class, usize)> {
    let b = *text.as_bytes().get(i)?;
    if b < 0x80 {
        return Some((char::from(b), ASCII_CLASS[usize::from(b)], 1));
    }
    let c = text[i..].chars().next()?;
    Some((c, class(c), c.len_utf8()))
}

/// The general path, char by char: where the piece starting at byte `start` (a char boundary
/// before the end of `text`) ends. These are the piece rules of the module docs.
fn piece_end(text: &str, start: usize) -> usize {
    let (c, mut cls, len) = char_at(text, start).expect("a char starts at `start`");
    let mut end = start + len;
    // One plain space joins a following letter or punctuation run, as in GPT-style BPEs.
    if c == ' ' {
        if let Some((_, nc, nlen)) = char_at(text, end) {
            if joins_space(nc) {
                end += nlen;
                cls = nc;
            }
        }
    }
    let mut digits = usize::from(cls == Class::Digit);
    while let Some((n, nc, nlen)) = char_at(text, end) {
        let same = match cls {
            Class::Digit => nc == Class::Digit && digits < 3,
            // The last space of a run is left for the word after it.
            Class::Space => nc == Class::Space && !(n == ' ' && next_joins(text, end + nlen)),
            _ => nc == cls,
        };
        if !same {
            break;
        }
        digits += usize::from(cls == Class::Digit);
        end += nlen;
    }
    end
}

/// Whether a space followed by the text at `at` would join that text's piece.
fn next_joins(text: &str, at: usize) -> bool {
    char_at(text, at).is_some_and(|(_, c, _)| joins_space(c))
}

/// Calls `f` with each piece of `text`, in order, split exactly as `encode` splits them; the
/// pieces concatenate to `text`.
#[cfg(test)]
fn for_each_piece<'t>(text: &'t str, mut f: impl FnMut(&'t str)) {
    let mut start = 0;
    while start < text.len() {
        let end = match ascii_piece(text.as_bytes(), start) {
            Some((end, _)) => end,
            None => piece_end(text, start),
        };
        f(&text[start..end]);
        start = end;
    }
}

impl ApproxTokenizer {
    /// Appends the ids of one segment: from the cache when it is long enough to be worth it, else
    /// (and then stored) encoded.
    fn segment(&self, s: &str, out: &mut Vec<u32>) {
        let cacheable = s.len() >= segments::MIN_SEGMENT_BYTES;
        if cacheable && segments::lock(&self.segments).get_into(s, out) {
            return;
        }
        let from = out.len();
        self.encode_into(s, out);
        if cacheable {
            segments::lock(&self.segments).insert(s, &out[from..]);
        }
    }

    /// The ids of `text`, piece by piece (no cache).
    fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let bytes = text.as_bytes();
        let mut start = 0;
        while start < bytes.len() {
            start = match ascii_piece(bytes, start) {
                // The common case: a short ASCII piece, already hashed.
                Some((end, h)) if end - start <= WHOLE_PIECE_MAX => {
                    out.push(self.finish(h));
                    end
                }
                Some((end, _)) => {
                    self.push_ascii_chunks(&bytes[start..end], out);
                    end
                }
                None => self.encode_general(text, start, out),
            };
        }
    }

    /// Segment cache `(hits, misses, entries)`.
    #[cfg(test)]
    fn segment_stats(&self) -> (u64, u64, usize) {
        let c = segments::lock(&self.segments);
        (c.hits, c.misses, c.len())
    }
}

impl ApproxTokenizer {
    /// [`Tokenizer::encode`], appending to `out`.
    fn encode_appending(&self, text: &str, out: &mut Vec<u32>) {
        let bytes = text.as_bytes();
        // Prose is ~4 bytes a token, chat markup and code a little less: one allocation.
        out.reserve(bytes.len() / 3 + 1);
        let mut start = 0;
        for nl in memchr::memchr_iter(b'\n', bytes) {
            if bytes[nl + 1..].starts_with(SEGMENT_START) {
                self.segment(&text[start..=nl], out);
                start = nl + 1;
            }
        }
        self.segment(&text[start..], out);
    }
}

impl Tokenizer for ApproxTokenizer {
    fn cache_stats(&self) -> crate::CacheStats {
        let (segment_entries, segment_bytes) = segments::lock(&self.segments).size();
        crate::CacheStats {
            segment_entries,
            segment_bytes,
            ..Default::default()
        }
    }

    fn set_segment_cache_budget(&self, bytes: usize) {
        segments::lock(&self.segments).set_budget(bytes);
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_appending(text, &mut out);
        out
    }

    fn try_encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), crate::TokenizeError> {
        self.encode_appending(text, out);
        Ok(())
    }

    /// Ids are hashes, so the original text cannot come back. Each id becomes a pronounceable
    /// pseudo-word (a leading space and one or two syllables, ~4 chars), deterministic per id: good
    /// enough for simulated output text, whose length in tokens survives a re-encode roughly.
    fn decode(&self, ids: &[u32]) -> String {
        const ONSET: &[u8] = b"bcdfghklmnprstvwz";
        const VOWEL: &[u8] = b"aeiou";
        let mut s = String::with_capacity(ids.len() * 5);
        for &id in ids {
            s.push(' ');
            let mut x = id;
            let syllables = 1 + (x % 2);
            x /= 2;
            for _ in 0..syllables {
                s.push(ONSET[(x % ONSET.len() as u32) as usize] as char);
                x /= ONSET.len() as u32;
                s.push(VOWEL[(x % VOWEL.len() as u32) as usize] as char);
                x /= VOWEL.len() as u32;
            }
        }
        s
    }

    fn name(&self) -> &str {
        "approx"
    }
}

#[cfg(test)]
mod tests;
