//! A regex-free replacement for the `ByteLevel` pre-tokenizer's GPT-2 split
//! (`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`).
//!
//! Why: `tokenizers` without `onig` runs that pattern on the pure-Rust `fancy-regex` engine
//! (backtracking VM for the lookahead), which dominated encode time. The scanner below gives the
//! same matches: at each position the alternatives are tried in the regex's order, each greedy;
//! `\s+(?!\S)` is a whitespace run minus its last char when a non-space follows. The character
//! classes are taken from `regex-syntax` (the tables the regex engine itself uses), so Unicode
//! membership is identical. Equality with the regex path is property-tested in `pretok/tests.rs`.

use std::sync::LazyLock;

use tokenizers::tokenizer::pattern::Pattern;
use tokenizers::{
    Offsets, PreTokenizedString, PreTokenizer, PreTokenizerWrapper, SplitDelimiterBehavior,
};

/// Sorted, non-overlapping inclusive code point ranges of one regex class.
struct Class(Vec<(u32, u32)>);

impl Class {
    fn parse(pattern: &str) -> Self {
        use regex_syntax::hir::{Class as HirClass, HirKind};
        let hir = regex_syntax::parse(pattern).expect("static class pattern");
        let HirKind::Class(HirClass::Unicode(c)) = hir.kind() else {
            unreachable!("{pattern} is a unicode class")
        };
        Self(
            c.ranges()
                .iter()
                .map(|r| (r.start() as u32, r.end() as u32))
                .collect(),
        )
    }

    fn contains(&self, c: char) -> bool {
        let c = c as u32;
        self.0
            .binary_search_by(|&(lo, hi)| {
                if hi < c {
                    std::cmp::Ordering::Less
                } else if lo > c {
                    std::cmp::Ordering::Greater
                } else {
                    std::cmp::Ordering::Equal
                }
            })
            .is_ok()
    }
}

struct Classes {
    letter: Class,
    number: Class,
    space: Class,
}

static CLASSES: LazyLock<Classes> = LazyLock::new(|| Classes {
    letter: Class::parse(r"\p{L}"),
    number: Class::parse(r"\p{N}"),
    space: Class::parse(r"\s"),
});

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Letter,
    Number,
    Space,
    Other,
}

fn kind(c: char) -> Kind {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Kind::Letter,
            '0'..='9' => Kind::Number,
            // \s in ASCII: \t \n \v \f \r and space.
            '\t' | '\n' | '\x0B' | '\x0C' | '\r' | ' ' => Kind::Space,
            _ => Kind::Other,
        };
    }
    let cl = &*CLASSES;
    if cl.letter.contains(c) {
        Kind::Letter
    } else if cl.number.contains(c) {
        Kind::Number
    } else if cl.space.contains(c) {
        Kind::Space
    } else {
        Kind::Other
    }
}

/// Whether `c` is in the regex class `\s` (Unicode `White_Space`).
pub(crate) fn is_space(c: char) -> bool {
    kind(c) == Kind::Space
}

/// Byte end of the next GPT-2 piece starting at byte `i` of `s` (`i < s.len()`).
pub(crate) fn piece_end(s: &str, i: usize) -> usize {
    let rest = &s[i..];
    let b = rest.as_bytes();
    if b[0] == b'\'' && b.len() >= 2 {
        match b[1] {
            b's' | b't' | b'm' | b'd' => return i + 2,
            b'r' | b'v' | b'l' if b.len() >= 3 => {
                if matches!((b[1], b[2]), (b'r', b'e') | (b'v', b'e') | (b'l', b'l')) {
                    return i + 3;
                }
            }
            _ => {}
        }
    }
    let mut chars = rest.char_indices();
    let (_, c0) = chars.next().expect("non-empty");
    let k0 = kind(c0);
    // ` ?X+` for X in letters, numbers, other: a leading ' ' joins a following run.
    let (run_kind, run_start) = if c0 == ' ' {
        match rest[1..].chars().next().map(kind) {
            Some(k) if k != Kind::Space => (k, 1),
            _ => (Kind::Space, 0),
        }
    } else {
        (k0, 0)
    };
    if run_kind != Kind::Space {
        let end = rest[run_start..]
            .char_indices()
            .find(|&(_, c)| kind(c) != run_kind)
            .map_or(rest.len(), |(j, _)| run_start + j);
        return i + end;
    }
    // Whitespace run: `\s+(?!\S)` keeps all of it at the end of input, else all but its last
    // char (which then starts the next piece); a single space before a non-space is `\s+`.
    let mut end = rest.len();
    let mut last = 0;
    for (j, c) in rest.char_indices() {
        if kind(c) != Kind::Space {
            end = j;
            break;
        }
        last = j;
    }
    if end == rest.len() || last == 0 {
        i + end
    } else {
        i + last
    }
}

/// The GPT-2 split as a `tokenizers` [`Pattern`]: every piece is a match (the pattern covers all
/// input, so there are no gaps).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Gpt2Split;

impl Pattern for Gpt2Split {
    fn find_matches(&self, inside: &str) -> tokenizers::Result<Vec<(Offsets, bool)>> {
        let mut out = Vec::with_capacity(inside.len() / 4 + 1);
        let mut i = 0;
        while i < inside.len() {
            let e = piece_end(inside, i);
            out.push(((i, e), true));
            i = e;
        }
        Ok(out)
    }
}

/// GPT-2's reversible byte -> printable char map (the ByteLevel alphabet).
pub(crate) static BYTE_CHARS: LazyLock<[char; 256]> = LazyLock::new(|| {
    let mut map = ['\0'; 256];
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut n = 0u32;
    for b in 0..=255u8 {
        map[b as usize] = if printable(b) {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("valid code point")
        };
    }
    map
});

/// `ByteLevel` with the GPT-2 split done by [`Gpt2Split`]; same prefix-space and byte mapping.
#[derive(Debug, Clone)]
pub(crate) struct FastByteLevel {
    add_prefix_space: bool,
}

impl PreTokenizer for FastByteLevel {
    fn pre_tokenize(&self, pretokenized: &mut PreTokenizedString) -> tokenizers::Result<()> {
        pretokenized.split(|_, mut normalized| {
            if self.add_prefix_space && !normalized.get().starts_with(' ') {
                normalized.prepend(" ");
            }
            normalized.split(Gpt2Split, SplitDelimiterBehavior::Isolated)
        })?;
        let map = &*BYTE_CHARS;
        pretokenized.normalize(|normalized| {
            let s = normalized.get();
            let mut transformations: Vec<(char, isize)> = Vec::with_capacity(s.len());
            for (i, c) in s.char_indices() {
                let bytes = &s.as_bytes()[i..i + c.len_utf8()];
                transformations.extend(
                    bytes
                        .iter()
                        .enumerate()
                        .map(|(k, &b)| (map[b as usize], isize::from(k > 0))),
                );
            }
            normalized.transform(transformations, 0);
            Ok(())
        })
    }
}

/// The loaded pre-tokenizer with every regex `ByteLevel` replaced by [`FastByteLevel`].
#[derive(Debug, Clone)]
pub(crate) enum FastPre {
    ByteLevel(FastByteLevel),
    Sequence(Vec<FastPre>),
    Stock(PreTokenizerWrapper),
}

impl FastPre {
    /// The fast equivalent of `pre`, and whether any part was replaced.
    pub(crate) fn from_wrapper(pre: &PreTokenizerWrapper) -> (Self, bool) {
        match pre {
            PreTokenizerWrapper::ByteLevel(b) if b.use_regex => (
                FastPre::ByteLevel(FastByteLevel {
                    add_prefix_space: b.add_prefix_space,
                }),
                true,
            ),
            PreTokenizerWrapper::Sequence(seq) => {
                let mut any = false;
                let parts = AsRef::<[PreTokenizerWrapper]>::as_ref(seq)
                    .iter()
                    .map(|p| {
                        let (f, r) = Self::from_wrapper(p);
                        any |= r;
                        f
                    })
                    .collect();
                (FastPre::Sequence(parts), any)
            }
            other => (FastPre::Stock(other.clone()), false),
        }
    }
}

impl PreTokenizer for FastPre {
    fn pre_tokenize(&self, pretokenized: &mut PreTokenizedString) -> tokenizers::Result<()> {
        match self {
            FastPre::ByteLevel(b) => b.pre_tokenize(pretokenized),
            FastPre::Sequence(parts) => {
                for p in parts {
                    p.pre_tokenize(pretokenized)?;
                }
                Ok(())
            }
            FastPre::Stock(p) => p.pre_tokenize(pretokenized),
        }
    }
}

#[cfg(test)]
mod tests;
