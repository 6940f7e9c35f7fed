//! Added (special) tokens: split the text on them before any pre-tokenization, like
//! `tokenizers`' `AddedVocabulary::find_matches` — leftmost-longest matches, non-overlapping,
//! scanned left to right, with the `lstrip` / `rstrip` whitespace absorption. `single_word` is
//! not implemented (the loader falls back to `tokenizers` when a token sets it).

use super::super::pretok::is_space;

struct Pat {
    bytes: Box<[u8]>,
    /// The first (up to) 8 bytes as a little-endian word, and the mask of those present: a
    /// candidate is compared whole only when the text's next 8 bytes agree (a model with a
    /// dozen `<|…|>` tokens would otherwise call `memcmp` a dozen times at every `<`).
    head: u64,
    head_mask: u64,
    id: u32,
    lstrip: bool,
    rstrip: bool,
}

/// One matching set (`tokenizers` keeps two: tokens matched on the raw text and tokens matched
/// on the normalized text; with no normalizer both see the same text, but the two passes still
/// run in order, so a raw-set match wins over an overlapping normalized-set one).
#[derive(Default)]
pub(crate) struct AddedSet {
    /// Sorted by first byte, then longest first, so the first hit at a position is the longest.
    pats: Vec<Pat>,
    /// `first[b]` = range of `pats` starting with byte `b`.
    first: Vec<(u32, u32)>,
    /// Distinct first bytes, for a memchr scan when there are at most three.
    firsts: Vec<u8>,
}

/// A piece of the input: text to pre-tokenize, or an added token's id.
pub(crate) enum Seg<'a> {
    Text(&'a str),
    Token(u32),
}

impl AddedSet {
    /// `(content, id, lstrip, rstrip)`; empty contents are ignored (as in `tokenizers`).
    pub(crate) fn new(tokens: impl IntoIterator<Item = (String, u32, bool, bool)>) -> Self {
        let mut pats: Vec<Pat> = tokens
            .into_iter()
            .filter(|(c, ..)| !c.is_empty())
            .map(|(c, id, lstrip, rstrip)| Pat {
                head: word8(c.as_bytes()),
                head_mask: u64::MAX >> (8 * (8 - c.len().min(8))),
                bytes: c.into_bytes().into_boxed_slice(),
                id,
                lstrip,
                rstrip,
            })
            .collect();
        pats.sort_by(|a, b| {
            (a.bytes[0], std::cmp::Reverse(a.bytes.len()))
                .cmp(&(b.bytes[0], std::cmp::Reverse(b.bytes.len())))
        });
        let mut first = vec![(0u32, 0u32); 256];
        let mut firsts = Vec::new();
        for (i, p) in pats.iter().enumerate() {
            let slot = &mut first[usize::from(p.bytes[0])];
            if slot.1 == 0 {
                *slot = (i as u32, i as u32 + 1);
                firsts.push(p.bytes[0]);
            } else {
                slot.1 = i as u32 + 1;
            }
        }
        Self {
            pats,
            first,
            firsts,
        }
    }

    /// The longest pattern matching at byte `i`.
    fn longest_at(&self, s: &[u8], i: usize) -> Option<&Pat> {
        let (a, b) = self.first[usize::from(s[i])];
        let rest = &s[i..];
        let word = word8(rest);
        self.pats[a as usize..b as usize]
            .iter()
            .find(|p| word & p.head_mask == p.head && rest.starts_with(&p.bytes))
    }

    /// The leftmost match at or after `from`.
    fn next_match(&self, s: &[u8], mut from: usize) -> Option<(usize, &Pat)> {
        while from < s.len() {
            let hay = &s[from..];
            let cand = match self.firsts.as_slice() {
                [a] => memchr::memchr(*a, hay),
                [a, b] => memchr::memchr2(*a, *b, hay),
                [a, b, c] => memchr::memchr3(*a, *b, *c, hay),
                _ => hay.iter().position(|&x| self.first[usize::from(x)].1 != 0),
            }?;
            let i = from + cand;
            if let Some(p) = self.longest_at(s, i) {
                return Some((i, p));
            }
            from = i + 1;
        }
        None
    }

    /// Calls `f` with the text and token pieces of `s`, in order.
    pub(crate) fn split<'a>(&self, s: &'a str, mut f: impl FnMut(Seg<'a>)) {
        if self.pats.is_empty() {
            if !s.is_empty() {
                f(Seg::Text(s));
            }
            return;
        }
        let bytes = s.as_bytes();
        let mut start_offset = 0;
        let mut search = 0;
        while let Some((m_start, pat)) = self.next_match(bytes, search) {
            let m_end = m_start + pat.bytes.len();
            search = m_end;
            let mut start = m_start;
            let mut stop = m_end;
            if pat.lstrip {
                // The previous match may already have absorbed these spaces.
                start = leftmost_space_at_end(&s[..start]).max(start_offset);
            }
            if pat.rstrip {
                stop += space_run_at_start(&s[stop..]);
            }
            if start_offset < start {
                f(Seg::Text(&s[start_offset..start]));
            }
            f(Seg::Token(pat.id));
            start_offset = stop;
        }
        if start_offset < s.len() {
            f(Seg::Text(&s[start_offset..]));
        }
    }
}

/// The first (up to) 8 bytes of `s` as a little-endian word, zero-padded.
fn word8(s: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = s.len().min(8);
    b[..n].copy_from_slice(&s[..n]);
    u64::from_le_bytes(b)
}

/// Start of the whitespace run ending `s` (`s.len()` if none).
fn leftmost_space_at_end(s: &str) -> usize {
    s.char_indices()
        .rev()
        .take_while(|&(_, c)| is_space(c))
        .last()
        .map_or(s.len(), |(i, _)| i)
}

/// Byte length of the whitespace run starting `s`.
fn space_run_at_start(s: &str) -> usize {
    s.char_indices()
        .find(|&(_, c)| !is_space(c))
        .map_or(s.len(), |(i, _)| i)
}
