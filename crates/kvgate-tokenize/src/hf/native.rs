//! Our own encode path for the `tokenizer.json` shape most chat models ship: a byte-level BPE
//! model (GPT-2, SmolLM, StarCoder, …). Chosen at load time only when the file matches what is
//! implemented here exactly; anything else keeps the `tokenizers` pipeline (same ids, slower).
//!
//! Why: `tokenizers` builds a full `Encoding` (per-byte offset alignments, one `String` per
//! token) that the router never reads; this path writes ids straight into one `Vec<u32>`.
//!
//! Supported (else [`Native::from_tokenizer`] says why not and the caller falls back):
//! - no normalizer, no truncation/padding, `encode_special_tokens` off;
//! - pre-tokenizer `ByteLevel` (any `add_prefix_space`, `use_regex`), optionally after `Digits`
//!   steps in a `Sequence` (SmolLM2: `Digits(individual)` + `ByteLevel`);
//! - BPE without dropout, `continuing_subword_prefix` or `end_of_word_suffix`; `ignore_merges`,
//!   `byte_fallback`, `unk_token`/`fuse_unk` (for byte symbols missing from the vocabulary) as in
//!   `tokenizers`;
//! - added tokens with `lstrip`/`rstrip`/`normalized`/`special` (not `single_word`);
//! - any post-processor that only wraps the sequence in fixed ids (probed at load).
//!
//! Equality with `tokenizers` is property-tested in `native/tests.rs` and checked on the real
//! SmolLM2 file by an ignored test in tests/backends.rs.

mod added;
mod merge;

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, TryLockError};

use tokenizers::{ModelWrapper, PreTokenizerWrapper, Token};

use super::pretok::{piece_end, BYTE_CHARS};
use crate::segments::{self, SegCache};
use added::{AddedSet, Seg};
use merge::{pair_key, Bpe, PairMap, Scratch, WordCache};

/// Independent caches; an encode takes the first free one (no waiting), so concurrent requests
/// on the runtime's worker threads each get one.
const CACHE_SLOTS: usize = 4;

#[derive(Default)]
struct Slot {
    cache: WordCache,
    scratch: Scratch,
}

pub(crate) struct Native {
    bpe: Bpe,
    /// Added tokens matched on the raw text, then those matched on the normalized text.
    raw_added: AddedSet,
    norm_added: AddedSet,
    /// `Digits` pre-tokenizer steps before `ByteLevel`: `individual_digits` of each.
    digits: Vec<bool>,
    add_prefix_space: bool,
    use_regex: bool,
    /// What the post-processor puts around the ids when special tokens are added.
    special_prefix: Vec<u32>,
    special_suffix: Vec<u32>,
    slots: Vec<Mutex<Slot>>,
    /// Ids of whole segments between added tokens, shared by every encode.
    segments: Mutex<SegCache>,
}

impl Native {
    /// The native encoder for `t`, or why its `tokenizer.json` is not supported here.
    pub(crate) fn from_tokenizer(t: &tokenizers::Tokenizer) -> Result<Self, String> {
        if t.get_normalizer().is_some() {
            return Err("has a normalizer".into());
        }
        if t.get_truncation().is_some() || t.get_padding().is_some() {
            return Err("truncation or padding configured".into());
        }
        if t.get_encode_special_tokens() {
            return Err("encode_special_tokens is set".into());
        }
        let (digits, add_prefix_space, use_regex) = pre_steps(t.get_pre_tokenizer())?;
        let ModelWrapper::BPE(bpe) = t.get_model() else {
            return Err("model is not BPE".into());
        };
        let bpe = load_bpe(&serde_json::to_value(bpe).map_err(|e| e.to_string())?)?;
        let mut raw = Vec::new();
        let mut norm = Vec::new();
        for tok in t.get_added_tokens_decoder().values() {
            if tok.single_word {
                return Err(format!("added token {:?} sets single_word", tok.content));
            }
            let Some(id) = t.token_to_id(&tok.content) else {
                continue;
            };
            let entry = (tok.content.clone(), id, tok.lstrip, tok.rstrip);
            if tok.normalized {
                norm.push(entry);
            } else {
                raw.push(entry);
            }
        }
        let (special_prefix, special_suffix) = probe_post_processor(t)?;
        Ok(Self {
            bpe,
            raw_added: AddedSet::new(raw),
            norm_added: AddedSet::new(norm),
            digits,
            add_prefix_space,
            use_regex,
            special_prefix,
            special_suffix,
            slots: (0..CACHE_SLOTS).map(|_| Mutex::default()).collect(),
            segments: Mutex::new(SegCache::new(segments::DEFAULT_BUDGET_BYTES)),
        })
    }

    /// Appends the ids of `text` to `out`; `special` adds the post-processor's tokens (BOS, …).
    pub(crate) fn encode_into(&self, text: &str, special: bool, out: &mut Vec<u32>) {
        let mut guard = self.free_slot();
        let mut own = None;
        // A pooled slot is worth caching into; a throwaway one (all slots busy) is not.
        let (slot, cached) = match guard.as_deref_mut() {
            Some(s) => (s, true),
            None => (own.insert(Slot::default()), false),
        };
        if special {
            out.extend_from_slice(&self.special_prefix);
        }
        let mut w = Work {
            cache: cached.then_some(&mut slot.cache),
            scratch: &mut slot.scratch,
            out,
            buf: String::new(),
        };
        self.raw_added.split(text, |seg| match seg {
            Seg::Token(id) => w.out.push(id),
            Seg::Text(s) => self.segment(s, &mut w),
        });
        if special {
            w.out.extend_from_slice(&self.special_suffix);
        }
    }

    /// One segment between raw-matched added tokens: from the segment cache when it is long
    /// enough to be worth it, else (and then stored) encoded.
    fn segment(&self, s: &str, w: &mut Work<'_>) {
        let cacheable = s.len() >= segments::MIN_SEGMENT_BYTES;
        if cacheable && self.seg_cache().get_into(s, w.out) {
            return;
        }
        let start = w.out.len();
        self.norm_added.split(s, |seg| match seg {
            Seg::Token(id) => w.out.push(id),
            Seg::Text(s) => self.pre_tokenize(s, 0, w),
        });
        if cacheable {
            self.seg_cache().insert(s, &w.out[start..]);
        }
    }

    /// Cache sizes. Word caches held by an encode right now are skipped (never waits).
    pub(crate) fn cache_stats(&self) -> crate::CacheStats {
        let (segment_entries, segment_bytes) = self.seg_cache().size();
        let mut s = crate::CacheStats {
            segment_entries,
            segment_bytes,
            ..Default::default()
        };
        for m in &self.slots {
            if let Ok(g) = m.try_lock() {
                let (n, bytes) = g.cache.size();
                s.word_entries += n;
                s.word_bytes += bytes;
            }
        }
        s
    }

    pub(crate) fn set_segment_budget(&self, bytes: usize) {
        self.seg_cache().set_budget(bytes);
    }

    fn seg_cache(&self) -> MutexGuard<'_, SegCache> {
        segments::lock(&self.segments)
    }

    /// The first slot nobody holds (never waits).
    fn free_slot(&self) -> Option<MutexGuard<'_, Slot>> {
        for m in &self.slots {
            match m.try_lock() {
                Ok(g) => return Some(g),
                // A panic mid-encode cannot leave a half-written cache entry (ids are stored
                // before the key), but start that slot afresh anyway.
                Err(TryLockError::Poisoned(p)) => {
                    let mut g = p.into_inner();
                    *g = Slot::default();
                    m.clear_poison();
                    return Some(g);
                }
                Err(TryLockError::WouldBlock) => {}
            }
        }
        None
    }

    /// Runs `Digits` step `step` (and the later ones) over `s`, then `ByteLevel` on each piece.
    fn pre_tokenize(&self, s: &str, step: usize, w: &mut Work<'_>) {
        let Some(&individual) = self.digits.get(step) else {
            return self.byte_level(s, w);
        };
        let mut start = 0;
        let mut chars = s.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            if !c.is_numeric() {
                continue;
            }
            if start < i {
                self.pre_tokenize(&s[start..i], step + 1, w);
            }
            let mut end = i + c.len_utf8();
            if !individual {
                while let Some(&(j, c)) = chars.peek().filter(|(_, c)| c.is_numeric()) {
                    end = j + c.len_utf8();
                    chars.next();
                }
            }
            self.pre_tokenize(&s[i..end], step + 1, w);
            start = end;
        }
        if start < s.len() {
            self.pre_tokenize(&s[start..], step + 1, w);
        }
    }

    fn byte_level(&self, s: &str, w: &mut Work<'_>) {
        if self.add_prefix_space && !s.starts_with(' ') {
            let mut buf = std::mem::take(&mut w.buf);
            buf.clear();
            buf.push(' ');
            buf.push_str(s);
            self.words(&buf, w);
            w.buf = buf;
        } else {
            self.words(s, w);
        }
    }

    fn words(&self, s: &str, w: &mut Work<'_>) {
        if !self.use_regex {
            return self
                .bpe
                .word(s.as_bytes(), w.cache.as_deref_mut(), w.scratch, w.out);
        }
        let mut i = 0;
        while i < s.len() {
            let e = piece_end(s, i);
            self.bpe.word(
                &s.as_bytes()[i..e],
                w.cache.as_deref_mut(),
                w.scratch,
                w.out,
            );
            i = e;
        }
    }

    /// Segment cache `(hits, misses, entries)`.
    #[cfg(test)]
    fn segment_stats(&self) -> (u64, u64, usize) {
        let c = self.seg_cache();
        (c.hits, c.misses, c.len())
    }

    #[cfg(test)]
    fn cached_words(&self) -> usize {
        self.slots
            .iter()
            .map(|m| m.lock().map_or(0, |s| s.cache.len()))
            .sum()
    }
}

struct Work<'a> {
    cache: Option<&'a mut WordCache>,
    scratch: &'a mut Scratch,
    out: &'a mut Vec<u32>,
    /// For `add_prefix_space`.
    buf: String,
}

/// `(Digits steps, add_prefix_space, use_regex)` of a supported pre-tokenizer.
fn pre_steps(pre: Option<&PreTokenizerWrapper>) -> Result<(Vec<bool>, bool, bool), String> {
    let parts: &[PreTokenizerWrapper] = match pre {
        Some(PreTokenizerWrapper::Sequence(seq)) => seq.as_ref(),
        Some(p) => std::slice::from_ref(p),
        None => return Err("no pre-tokenizer (not byte-level)".into()),
    };
    let mut digits = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        match p {
            PreTokenizerWrapper::Digits(d) => digits.push(d.individual_digits),
            PreTokenizerWrapper::ByteLevel(b) if i + 1 == parts.len() => {
                return Ok((digits, b.add_prefix_space, b.use_regex));
            }
            _ => return Err("pre-tokenizer is not [Digits…] + ByteLevel".into()),
        }
    }
    Err("pre-tokenizer does not end with ByteLevel".into())
}

/// The BPE tables from `tokenizers`' own serialization of its loaded model (merges in rank
/// order, after its duplicate handling), so ranks are exactly the ones it uses.
fn load_bpe(model: &serde_json::Value) -> Result<Bpe, String> {
    let field = |k: &str| model.get(k).filter(|v| !v.is_null());
    for k in ["dropout", "continuing_subword_prefix", "end_of_word_suffix"] {
        if field(k).is_some_and(|v| v.as_f64() != Some(0.0)) {
            return Err(format!("BPE {k} is set"));
        }
    }
    let ignore_merges = field("ignore_merges").and_then(|v| v.as_bool()) == Some(true);
    let vocab: HashMap<String, u32> = field("vocab")
        .map(|v| serde_json::from_value(v.clone()))
        .transpose()
        .map_err(|e| format!("BPE vocab: {e}"))?
        .ok_or("BPE without vocab")?;
    let chars = &*BYTE_CHARS;
    let mut byte_ids = [merge::MISSING; 256];
    let mut fallback = vec![None; 256];
    let byte_fallback = field("byte_fallback").and_then(|v| v.as_bool()) == Some(true);
    for (b, id) in byte_ids.iter_mut().enumerate() {
        let sym = chars[b].to_string();
        match vocab.get(&sym) {
            Some(&v) => *id = v,
            // `tokenizers` falls back on the bytes of the (mapped) symbol, not the raw byte.
            None if byte_fallback => {
                fallback[b] = sym
                    .bytes()
                    .map(|x| vocab.get(&format!("<{x:#04X}>")).copied())
                    .collect();
            }
            None => {}
        }
    }
    let unk = match field("unk_token").and_then(|v| v.as_str()) {
        Some(u) => Some((
            *vocab
                .get(u)
                .ok_or(format!("unk_token {u:?} not in the vocabulary"))?,
            field("fuse_unk").and_then(|v| v.as_bool()) == Some(true),
        )),
        None => None,
    };
    let merges = field("merges")
        .and_then(|v| v.as_array())
        .ok_or("BPE without merges")?;
    let mut map = PairMap::default();
    map.reserve(merges.len());
    for (rank, m) in merges.iter().enumerate() {
        let (a, b) = match m {
            serde_json::Value::Array(p) if p.len() == 2 => (p[0].as_str(), p[1].as_str()),
            serde_json::Value::String(s) => match s.split_once(' ') {
                Some((a, b)) => (Some(a), Some(b)),
                None => (None, None),
            },
            _ => (None, None),
        };
        let (Some(a), Some(b)) = (a, b) else {
            return Err(format!("bad merge {m}"));
        };
        let id = |s: &str| {
            vocab
                .get(s)
                .copied()
                .ok_or(format!("merge {m}: {s:?} unknown"))
        };
        let (l, r, n) = (id(a)?, id(b)?, id(&format!("{a}{b}"))?);
        map.insert(pair_key(l, r), (rank as u32, n));
    }
    let whole_words = ignore_merges.then(|| {
        let mut inv = HashMap::with_capacity(256);
        for (b, c) in chars.iter().enumerate() {
            inv.insert(*c, b as u8);
        }
        vocab
            .iter()
            .filter_map(|(tok, &id)| {
                let bytes: Option<Vec<u8>> = tok.chars().map(|c| inv.get(&c).copied()).collect();
                Some((bytes?.into_boxed_slice(), id))
            })
            .collect()
    });
    Ok(Bpe {
        byte_ids,
        fallback,
        unk,
        merges: map,
        whole_words,
    })
}

/// The ids the post-processor puts before and after one sequence, found by running it on
/// sentinel ids; errors when it does anything but wrap (then `tokenizers` keeps the job).
fn probe_post_processor(t: &tokenizers::Tokenizer) -> Result<(Vec<u32>, Vec<u32>), String> {
    const S1: u32 = u32::MAX - 1;
    const S2: u32 = u32::MAX - 2;
    let run = |ids: &[u32], special: bool| -> Result<Vec<u32>, String> {
        let toks = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| Token::new(id, String::new(), (i, i + 1)))
            .collect();
        let enc = tokenizers::Encoding::from_tokens(toks, 0);
        t.post_process(enc, None, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("post-processor: {e}"))
    };
    if run(&[S1, S2], false)? != [S1, S2] {
        return Err("post-processor changes ids without special tokens".into());
    }
    let one = run(&[S1], true)?;
    let at = one
        .iter()
        .position(|&i| i == S1)
        .ok_or("post-processor drops the sequence")?;
    let (prefix, suffix) = (one[..at].to_vec(), one[at + 1..].to_vec());
    let two = run(&[S1, S2], true)?;
    let wrapped: Vec<u32> = prefix
        .iter()
        .chain(&[S1, S2])
        .chain(&suffix)
        .copied()
        .collect();
    if two != wrapped || prefix.iter().chain(&suffix).any(|&i| i >= S2) {
        return Err("post-processor does more than wrap the sequence".into());
    }
    Ok((prefix, suffix))
}

#[cfg(test)]
mod tests;
