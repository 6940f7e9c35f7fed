use proptest::prelude::*;

use super::*;

const PROSE: &str = "The router keeps a radix index of the KV blocks each worker holds. When a \
request arrives, it tokenizes the prompt, hashes it in blocks of 16 tokens, and asks every \
worker how much of that prefix it already caches; the cost function then weighs overlap \
against queue depth. Workers report their load every 250 ms, and 3 of 4 requests in our \
traces share a system prompt longer than 1,000 tokens.";

fn pieces(text: &str) -> Vec<&str> {
    let mut v = Vec::new();
    for_each_piece(text, |p| v.push(p));
    v
}

/// The piece rules written char by char, straight from the module docs, with [`class`] for
/// every char (no tables, no byte loops: slow, but plainly the rules): the reference the
/// splitters are tested against. `encode`'s is the byte-level [`ascii_piece`] with the
/// char-level [`piece_end`] behind it, as [`for_each_piece`] runs them. With the previous
/// encoder's hashing this gives [`reference_encode`], the ids `encode` must produce.
fn reference_pieces(text: &str) -> Vec<&str> {
    let mut v = Vec::new();
    let mut f = |p| v.push(p);
    let mut chars = text.char_indices().peekable();
    while let Some((start, c)) = chars.next() {
        let mut cls = class(c);
        // One plain space joins a following letter or punctuation run, as in GPT-style BPEs.
        if c == ' ' {
            if let Some(&(_, n)) = chars.peek() {
                let nc = class(n);
                if nc == Class::Letter || nc == Class::Other {
                    chars.next();
                    cls = nc;
                }
            }
        }
        let mut end = text.len();
        let mut digits = usize::from(cls == Class::Digit);
        while let Some(&(i, n)) = chars.peek() {
            let nc = class(n);
            let same = match cls {
                Class::Digit => nc == Class::Digit && digits < 3,
                // The last space of a run is left for the word after it.
                Class::Space => {
                    nc == Class::Space
                        && !(n == ' '
                            && text[i + n.len_utf8()..]
                                .chars()
                                .next()
                                .is_some_and(|c| matches!(class(c), Class::Letter | Class::Other)))
                }
                _ => nc == cls,
            };
            if !same {
                end = i;
                break;
            }
            digits += usize::from(cls == Class::Digit);
            chars.next();
        }
        f(&text[start..end]);
    }
    v
}

/// `encode` as it was before the byte-level fast path (kept verbatim apart from names): the ids
/// the new one must reproduce exactly, and the "before" of [`encode_timing_vs_previous`].
/// It walks char by char through an `Option`-returning `char_at`, then hashes each piece in a
/// second pass.
mod previous {
    use super::super::{class, ApproxTokenizer, Class, ASCII_CLASS};

    const WHOLE_PIECE_MAX: usize = 8;
    const LONG_PIECE_CHUNK: usize = 4;

    pub fn encode(t: &ApproxTokenizer, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        for_each_piece(text, |p| push_piece(t.vocab, p, &mut out));
        out
    }

    pub fn id(vocab: u32, piece: &[u8]) -> u32 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in piece {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let h = (h ^ (h >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        ((u128::from(h) * u128::from(vocab)) >> 64) as u32
    }

    pub fn push_piece(vocab: u32, piece: &str, out: &mut Vec<u32>) {
        if piece.len() <= WHOLE_PIECE_MAX {
            out.push(id(vocab, piece.as_bytes()));
            return;
        }
        let mut start = 0;
        while start < piece.len() {
            let mut end = (start + LONG_PIECE_CHUNK).min(piece.len());
            while !piece.is_char_boundary(end) {
                end += 1;
            }
            out.push(id(vocab, &piece.as_bytes()[start..end]));
            start = end;
        }
    }

    #[inline]
    fn char_at(text: &str, i: usize) -> Option<(char, Class, usize)> {
        let b = *text.as_bytes().get(i)?;
        if b < 0x80 {
            return Some((char::from(b), ASCII_CLASS[usize::from(b)], 1));
        }
        let c = text[i..].chars().next()?;
        Some((c, class(c), c.len_utf8()))
    }

    pub fn for_each_piece<'t>(text: &'t str, mut f: impl FnMut(&'t str)) {
        let mut start = 0;
        while let Some((c, mut cls, len)) = char_at(text, start) {
            let mut end = start + len;
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
                    Class::Space => {
                        nc == Class::Space && !(n == ' ' && next_joins(text, end + nlen))
                    }
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

    fn next_joins(text: &str, at: usize) -> bool {
        char_at(text, at).is_some_and(|(_, c, _)| matches!(c, Class::Letter | Class::Other))
    }
}

/// The ids `encode` must produce: [`reference_pieces`], each hashed by the previous encoder's
/// `push_piece` (FNV-1a 64 of the whole piece up to 8 bytes, else of 4-byte chunks).
fn reference_encode(t: &ApproxTokenizer, text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for p in reference_pieces(text) {
        previous::push_piece(t.vocab, p, &mut out);
    }
    out
}

#[test]
fn ascii_table_agrees_with_the_unicode_classes() {
    for b in 0u8..128 {
        assert_eq!(
            ASCII_CLASS[usize::from(b)],
            class(char::from(b)),
            "byte {b:#04x}"
        );
    }
}

#[test]
fn byte_table_extends_the_ascii_one() {
    for b in 0..=255u8 {
        let expected = if b < 0x80 {
            ASCII_CLASS[usize::from(b)]
        } else {
            Class::NonAscii
        };
        assert_eq!(BYTE_CLASS[usize::from(b)], expected, "byte {b:#04x}");
    }
}

#[test]
fn pieces_look_like_bpe_pretokenization() {
    assert_eq!(
        pieces("Hello, world!  ok\n\n12345"),
        ["Hello", ",", " world", "!", " ", " ok", "\n\n", "123", "45"]
    );
    assert_eq!(pieces("  (x) _a"), [" ", " (", "x", ")", " _a"]);
    assert_eq!(pieces(""), Vec::<&str>::new());
    assert_eq!(pieces("été 東京"), ["été", " 東京"]);
}

#[test]
fn pieces_concatenate_to_text() {
    for t in [PROSE, " a  b   c\t\td\r\n", "x\u{00a0} y", "🙂🙂 🙂"] {
        assert_eq!(pieces(t).concat(), t);
    }
}

#[test]
fn about_four_chars_per_token_on_prose() {
    let t = ApproxTokenizer::default();
    let ratio = PROSE.len() as f64 / t.encode(PROSE).len() as f64;
    assert!((3.5..=5.5).contains(&ratio), "{ratio}");
}

#[test]
fn deterministic_and_in_vocab() {
    let t = ApproxTokenizer::with_vocab(5000);
    let a = t.encode(PROSE);
    assert_eq!(a, ApproxTokenizer::with_vocab(5000).encode(PROSE));
    assert!(a.iter().all(|&id| id < 5000));
    // Fixed values: a change of hash or piece rules must be deliberate (it moves routing).
    assert_eq!(
        ApproxTokenizer::default().encode("Hello world"),
        [56_248, 25_166]
    );
}

#[test]
fn short_pieces_get_distinct_ids() {
    // Numbers, single letters and two-letter words differ in a byte or two: their ids must not
    // collapse (they did when the id read FNV's unmixed high bits).
    let t = ApproxTokenizer::default();
    let mut pieces: Vec<String> = (0..1000).map(|i| format!(" {i}")).collect();
    pieces.extend((b'a'..=b'z').map(|c| format!(" {}", c as char)));
    pieces.extend(
        (b'a'..=b'z')
            .flat_map(|a| (b'a'..=b'z').map(move |b| format!("{}{}", a as char, b as char))),
    );
    let ids: std::collections::BTreeSet<u32> = pieces.iter().map(|p| t.id(p.as_bytes())).collect();
    // 1728 pieces into 100 000 ids: a few birthday collisions at most.
    assert!(
        ids.len() + 40 >= pieces.len(),
        "{} distinct ids for {} pieces",
        ids.len(),
        pieces.len()
    );
}

#[test]
fn long_words_are_cut_in_four_byte_tokens() {
    let t = ApproxTokenizer::default();
    assert_eq!(t.encode(" tokenization").len(), 4); // " tok" "eniz" "atio" "n"
    assert_eq!(t.encode(" token").len(), 1);
    // Wide chars are never split: 3-byte chars go two per token.
    assert_eq!(t.encode("東京東京東京").len(), 3);
}

#[test]
fn decode_is_deterministic_and_roughly_length_preserving() {
    let t = ApproxTokenizer::default();
    let ids: Vec<u32> = (0..200).map(|i| i * 7919 % 100_000).collect();
    let text = t.decode(&ids);
    assert_eq!(text, t.decode(&ids));
    let back = t.encode(&text).len();
    assert!((150..=250).contains(&back), "{back}");
}

/// Every string of up to four chars drawn from one representative of each case the splitter
/// tells apart (ASCII and wide letters, digits and spaces, `\r`, a space before each class…),
/// alone (pieces near the end of the text) and before a tail that gives the fast path's pieces
/// a full 8-byte window.
#[test]
fn encode_matches_reference_on_all_short_strings() {
    const CHARS: [char; 16] = [
        ' ', 'a', '_', '1', '\n', '\r', '\t', '.', 'é', '東', '٣', '²', '\u{a0}', '\u{3000}', '—',
        '🙂',
    ];
    let t = ApproxTokenizer::default();
    let mut texts = vec![String::new()];
    for _ in 0..4 {
        let longer: Vec<String> = texts
            .iter()
            .flat_map(|s| CHARS.iter().map(move |&c| format!("{s}{c}")))
            .collect();
        for short in &longer {
            for text in [short.clone(), format!("{short}x 12 ..\n \tabc")] {
                assert_eq!(t.encode(&text), reference_encode(&t, &text), "{text:?}");
                assert_eq!(pieces(&text), reference_pieces(&text), "{text:?}");
            }
        }
        texts = longer;
    }
}

#[test]
fn encode_matches_reference_on_long_runs_and_chat_text() {
    let t = ApproxTokenizer::default();
    let texts = [
        PROSE,
        "supercalifragilisticexpialidocious antidisestablishmentarianism",
        "          indented\n\t\t\tcode();\r\n\r\n\n\n  x",
        "1234567890123 ١٢٣٤٥٦٧ 12٣4５6",
        "ééééééééé 東京東京東京東京 ————— ...... !!!??? 🙂🙂🙂🙂",
        "a\u{a0}\u{a0} b\u{3000}\u{3000}c \u{2028} d\u{85}e\u{1680}\u{1680} f",
        "snake_case_identifier __init__ x_1 _",
        r#"{"model":"m","messages":[{"role":"user","content":"Hi! How's it going?\n"}]}"#,
    ];
    for text in texts {
        assert_eq!(t.encode(text), reference_encode(&t, text), "{text:?}");
        assert_eq!(t.encode(text), previous::encode(&t, text), "{text:?}");
    }
}

#[test]
fn chat_messages_come_from_the_segment_cache_with_the_same_ids() {
    // ChatML conversations growing turn by turn: every earlier message is met again, at another
    // offset, and must give the reference's ids from the cache.
    let t = ApproxTokenizer::default();
    let chat = |turns: u32| {
        let mut s = format!("<|im_start|>system\n{PROSE}<|im_end|>\n");
        for i in 0..turns {
            s += &format!(
                "<|im_start|>user\nQuestion {i}: tell me about topic {i}, and routers?<|im_end|>\n\
                 <|im_start|>assistant\nAnswer {i}: topic {i} is about routers and workers.<|im_end|>\n"
            );
        }
        s + "<|im_start|>assistant\n"
    };
    for turns in 1..8 {
        let text = chat(turns);
        assert_eq!(
            t.encode(&text),
            reference_encode(&t, &text),
            "{turns} turns"
        );
        assert_eq!(
            t.encode(&text),
            reference_encode(&t, &text),
            "{turns} turns, again"
        );
    }
    let (hits, misses, entries) = t.segment_stats();
    // 1 + 2·turns cacheable segments per chat, each encoded twice: only the first sight misses.
    assert_eq!(misses as usize, entries);
    assert_eq!(entries, 1 + 2 * 7);
    assert_eq!(hits + misses, (1..8).map(|n| 2 * (1 + 2 * n)).sum::<u64>());
    // A cut inside content (a line starting with `<|`), CRLF before it, and multi-byte text on
    // both sides of cuts; a short segment is encoded, not stored.
    for text in [
        format!("{PROSE}\n<|not a marker|> {PROSE}\r\n<|x|>\n\n<|y"),
        format!("é{PROSE}東\n<|東京 {PROSE}\n<|"),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n".to_owned(),
        "\n<|".to_owned(),
    ] {
        assert_eq!(t.encode(&text), reference_encode(&t, &text), "{text:?}");
        assert_eq!(
            t.encode(&text),
            reference_encode(&t, &text),
            "{text:?}, again"
        );
    }
    let (_, _, after) = t.segment_stats();
    assert_eq!(after, entries + 4, "the long segments only");
}

proptest! {
    #[test]
    fn prefix_stable(text in "[a-zA-Z0-9 ,.!\\n\\t_é東-]{0,80}", cut in 0usize..80) {
        let mut cut = cut.min(text.len());
        while !text.is_char_boundary(cut) { cut -= 1; }
        let t = ApproxTokenizer::default();
        let prefix = &text[..cut];
        let full = t.encode(&text);
        let part = t.encode(prefix);
        let last = pieces(prefix).last().map_or(0, |p| t.encode(p).len());
        let stable = part.len() - last;
        prop_assert_eq!(&part[..stable], &full[..stable]);
    }

    #[test]
    fn same_pieces_as_the_reference_splitter(
        text in "([a-zA-Z]{1,6}|[0-9]{1,5}|[ ]{1,4}|[\\t\\n\\r\\x0b\\x0c\\x1c]|[,.!_'-]{1,3}|[é東ü]|\\PC|\\s){0,40}",
    ) {
        prop_assert_eq!(pieces(&text), reference_pieces(&text));
    }

    #[test]
    fn any_text_pieces_concatenate(text in any::<String>()) {
        prop_assert_eq!(pieces(&text).concat(), text.clone());
        let _ = ApproxTokenizer::default().encode(&text);
    }

    #[test]
    fn encode_matches_reference_on_mixed_text(
        text in "([a-zA-Z]{1,6}|[a-z]{7,30}|[0-9]{1,8}|[ ]{1,12}|\r\n|[\t\n\r\x0b\x0c\x1c]{1,3}|[,.!?_'\"(){}:/-]{1,12}|[\u{a0}\u{85}\u{2028}\u{3000}\u{1680}]{1,3}|[é東ü٣²½—🙂]{1,5}|\\PC|\\s|\\p{Nd}|\\p{L}{1,4}){0,40}",
        vocab in any::<u32>(),
    ) {
        let t = ApproxTokenizer::with_vocab(vocab);
        prop_assert_eq!(t.encode(&text), reference_encode(&t, &text));
        prop_assert_eq!(t.encode(&text), previous::encode(&t, &text));
    }

    #[test]
    fn cached_segments_match_the_reference(
        parts in proptest::collection::vec(
            "(<\\|im_start\\|>(user|system)\n|<\\|im_end\\|>\n|\n<\\||\r\n|[a-z é東,.]{0,90}|\n\n)", 0..12),
    ) {
        let t = ApproxTokenizer::default();
        let text = parts.concat();
        let expected = reference_encode(&t, &text);
        prop_assert_eq!(&t.encode(&text), &expected);
        prop_assert_eq!(&t.encode(&text), &expected);
    }

    #[test]
    fn encode_matches_reference_on_any_string(text in any::<String>()) {
        let t = ApproxTokenizer::default();
        prop_assert_eq!(t.encode(&text), reference_encode(&t, &text));
        prop_assert_eq!(t.encode(&text), previous::encode(&t, &text));
    }

    #[test]
    fn encode_matches_reference_on_prose(
        text in "(([ ]{0,2}|\n{1,2}|\t)(the|a|I|KV|router|tokenization|caches|prefix-stable|don't|_id|e\\.g\\.|café|東京|1,024|3\\.14159|2025|x86_64)[,.;:!?)\"]{0,2}){0,60}[ \n]{0,3}",
    ) {
        let t = ApproxTokenizer::default();
        prop_assert_eq!(t.encode(&text), reference_encode(&t, &text));
        prop_assert_eq!(t.encode(&text), previous::encode(&t, &text));
    }
}

/// Manual timing of the previous encoder and this one on the same texts, in one run:
/// `cargo test -p kvgate-tokenize --release --lib encode_timing -- --ignored --nocapture`.
/// The machine may be shared and noisy, so the two alternate in short rounds; this prints the
/// best round of each (µs per call) and the median of the per-round ratios, which noise that
/// lasts longer than a round does not move.
#[test]
#[ignore]
fn encode_timing_vs_previous() {
    use std::hint::black_box;
    use std::time::Instant;

    // The ~1.3 KB chat bodies of tests/timing.rs (chat.lua's), rendered with ChatML.
    let model = crate::ModelTokenizer::default();
    let sys = "You are a helpful assistant. Answer concisely and accurately. ".repeat(13);
    let chat: Vec<String> = (1..=64)
        .map(|i| {
            let user = format!("Question {i}: ") + &format!("tell me about topic {i}. ").repeat(8);
            let body = format!(
                r#"{{"model":"mock-model","max_tokens":16,"messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"{user}"}}]}}"#
            );
            let view = kvgate_protocol::openai::RequestView::parse(body.as_bytes()).unwrap();
            model.render_chat(&view).unwrap()
        })
        .collect();
    let mut prose = String::new();
    let mut turn = 0;
    while prose.len() < 16 * 1024 {
        prose.push_str(PROSE);
        prose.push_str(&format!(" Turn {turn}.\n\n"));
        turn += 1;
    }
    // Prose that does not repeat: words drawn at random (a fixed seed), as in real prompts,
    // where branch predictors cannot learn the text.
    let words: Vec<&str> = PROSE.split(' ').collect();
    let mut varied = String::new();
    let mut x: u64 = 1;
    while varied.len() < 16 * 1024 {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        varied.push_str(words[(x >> 33) as usize % words.len()]);
        varied.push(' ');
    }

    let t = ApproxTokenizer::default();
    let before = |s: &str| previous::encode(&t, s);
    let after = |s: &str| t.encode(s);
    // Mean µs per call over `calls` calls, rotating through `texts`.
    let round = |f: &dyn Fn(&str) -> Vec<u32>, texts: &[String], calls: usize| {
        let t0 = Instant::now();
        for i in 0..calls {
            black_box(f(black_box(&texts[i % texts.len()])));
        }
        t0.elapsed().as_secs_f64() * 1e6 / calls as f64
    };
    for (name, texts, calls) in [
        ("chat (ChatML, 64 bodies)", &chat[..], 128),
        ("prose, repeated paragraph", &[prose][..], 8),
        ("prose, random words", &[varied][..], 8),
    ] {
        for text in texts {
            assert_eq!(t.encode(text), previous::encode(&t, text));
        }
        let (mut b, mut a, mut ratios) = (f64::MAX, f64::MAX, Vec::new());
        for r in 0..201 {
            let rb = round(&before, texts, calls);
            let ra = round(&after, texts, calls);
            if r > 0 {
                // The first pair warms up.
                b = b.min(rb);
                a = a.min(ra);
                ratios.push(rb / ra);
            }
        }
        ratios.sort_by(f64::total_cmp);
        println!(
            "approx encode, {name}, {} bytes, {} tokens: previous {b:7.2} µs, now {a:7.2} µs; \
             median ratio {:.2}x",
            texts[0].len(),
            t.encode(&texts[0]).len(),
            ratios[ratios.len() / 2]
        );
    }
}
