//! The approximate tokenizer used when a model has no tokenizer configured.
//!
//! It imitates the shape of common byte-level BPEs (GPT / Llama-3 pre-tokenization) without a
//! vocabulary: text is cut into pieces — a letter run with at most one leading space, digit runs
//! in groups of three, a punctuation run with at most one leading space, whitespace runs (the last
//! space of a run joins the following word) — and each piece becomes one token id, hashed from its
//! bytes. Pieces longer than [`WHOLE_PIECE_MAX`] bytes are cut into 4-byte tokens. English prose
//! comes out near 4 characters per token, like cl100k.
//!
//! Guarantees the router relies on: deterministic across runs and machines (FNV-1a, no random
//! seed), and prefix-stable: a piece's boundaries depend only on the bytes before its end and the
//! one character after it, so a text and any extension of it share every token except those of the
//! last piece. Ids never match the worker's, so this only makes routing consistent *between
//! requests* (prefix sharing is still detected); the worker's real cache is keyed on real ids.

use crate::Tokenizer;

/// Pieces up to this many bytes (leading space included) are one token.
const WHOLE_PIECE_MAX: usize = 8;
/// Longer pieces are cut into tokens of this many bytes (at char boundaries).
const LONG_PIECE_CHUNK: usize = 4;
const DEFAULT_VOCAB: u32 = 100_000;

/// Deterministic, vocabulary-free, ~4 chars/token. See the module docs.
#[derive(Debug, Clone)]
pub struct ApproxTokenizer {
    vocab: u32,
}

impl Default for ApproxTokenizer {
    fn default() -> Self {
        Self {
            vocab: DEFAULT_VOCAB,
        }
    }
}

impl ApproxTokenizer {
    /// Ids are drawn from `0..vocab` (at least 1000, to keep collisions rare).
    pub fn with_vocab(vocab: u32) -> Self {
        Self {
            vocab: vocab.max(1000),
        }
    }

    pub fn vocab_size(&self) -> u32 {
        self.vocab
    }

    fn id(&self, piece: &[u8]) -> u32 {
        // FNV-1a 64: tiny, stable, good enough spread for a hashed vocabulary.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in piece {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Multiply-shift instead of `%` (no division) reads the high bits, which FNV leaves
        // poorly mixed for short pieces (" 1", " 2", … would share ids): fold and mix first.
        let h = (h ^ (h >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        ((u128::from(h) * u128::from(self.vocab)) >> 64) as u32
    }

    fn push_piece(&self, piece: &str, out: &mut Vec<u32>) {
        if piece.len() <= WHOLE_PIECE_MAX {
            out.push(self.id(piece.as_bytes()));
            return;
        }
        let mut start = 0;
        while start < piece.len() {
            let mut end = (start + LONG_PIECE_CHUNK).min(piece.len());
            while !piece.is_char_boundary(end) {
                end += 1; // a char wider than the chunk stays whole
            }
            out.push(self.id(&piece.as_bytes()[start..end]));
            start = end;
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Letter,
    Digit,
    Space,
    Newline,
    Other,
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

/// Calls `f` with each piece of `text`, in order; the pieces concatenate to `text`.
fn for_each_piece<'t>(text: &'t str, mut f: impl FnMut(&'t str)) {
    let mut start = 0;
    while let Some((c, mut cls, len)) = char_at(text, start) {
        let mut end = start + len;
        // One plain space joins a following letter or punctuation run, as in GPT-style BPEs.
        if c == ' ' {
            if let Some((_, nc, nlen)) = char_at(text, end) {
                if nc == Class::Letter || nc == Class::Other {
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
        f(&text[start..end]);
        start = end;
    }
}

/// Whether a space followed by the text at `at` would join that text's piece.
fn next_joins(text: &str, at: usize) -> bool {
    char_at(text, at).is_some_and(|(_, c, _)| matches!(c, Class::Letter | Class::Other))
}

impl Tokenizer for ApproxTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        for_each_piece(text, |p| self.push_piece(p, &mut out));
        out
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
