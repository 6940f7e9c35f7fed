//! The native encoder against the stock `tokenizers` pipeline (regex pre-tokenizer) on the tiny
//! fixture and variants of it covering every option the loader accepts.

use std::sync::LazyLock;

use proptest::prelude::*;
use serde_json::{json, Value};

use super::Native;

const FIXTURE: &str = include_str!("../../../tests/fixtures/tiny-bpe/tokenizer.json");

fn fixture() -> Value {
    serde_json::from_str(FIXTURE).unwrap()
}

fn byte_level(add_prefix_space: bool, use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true,
           "use_regex": use_regex})
}

fn added(
    id: u64,
    content: &str,
    special: bool,
    normalized: bool,
    lstrip: bool,
    rstrip: bool,
) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": lstrip, "rstrip": rstrip,
           "normalized": normalized, "special": special})
}

/// Ids stay contiguous (`tokenizers` warns about holes when serializing).
fn next_id(vocab: &serde_json::Map<String, Value>) -> u64 {
    vocab.values().filter_map(Value::as_u64).max().unwrap_or(0) + 1
}

/// Whole words that merges cannot build, so `ignore_merges` changes the ids.
fn add_whole_words(t: &mut Value) {
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    for w in [
        "Ġprompt",
        "Ġarrives",
        "ĠKV",
        "12",
        "keeps",
        "ĠÃ©",
        "Ġrouter!",
    ] {
        let id = next_id(vocab);
        vocab.entry(w).or_insert(json!(id));
    }
    t["model"]["ignore_merges"] = json!(true);
}

/// Merges of a symbol with itself (`l l`, `Ġ Ġ`, …), ranked first, where the leftmost-first
/// tie-break decides the ids (`lll` is `ll l`, not `l ll`).
fn repeat_merges(t: &mut Value) {
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    for w in ["ll", "ĠĠ", "ĠĠĠĠ", "ĊĊ"] {
        let id = next_id(vocab);
        vocab.entry(w).or_insert(json!(id));
    }
    let merges = t["model"]["merges"].as_array_mut().unwrap();
    for (i, m) in ["l l", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ"].into_iter().enumerate() {
        merges.insert(i, json!(m));
    }
}

/// Merges as `[a, b]` pairs instead of `"a b"` strings.
fn pair_merges(t: &mut Value) {
    let pairs: Vec<Value> = t["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let (a, b) = m.as_str().unwrap().split_once(' ').unwrap();
            json!([a, b])
        })
        .collect();
    t["model"]["merges"] = Value::Array(pairs);
}

/// Extra added tokens: lstrip/rstrip, a normalized non-special one, one overlapping a raw one.
fn more_added(t: &mut Value) {
    let list = t["added_tokens"].as_array_mut().unwrap();
    list.push(added(400, "<mask>", true, false, true, true));
    list.push(added(401, "router", false, true, false, false));
    list.push(added(402, "<|im", false, true, false, false));
    list.push(added(403, "[R]", true, false, false, true));
    list.push(added(404, "[L]", true, false, true, false));
}

/// Byte symbols missing from the vocabulary (as in real files): 0x04, 'Ã' (0xC3, lead byte of
/// é/ü/ß…), 'ð' (0xF0, lead byte of emoji), with merges that used them removed; then `mode`:
/// drop them, an unk (fused or not), or `<0xNN>` byte fallback.
fn missing_bytes(t: &mut Value, mode: &str) {
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    for c in ["Ą", "Ã", "ð"] {
        vocab.remove(c);
    }
    let has = |v: &serde_json::Map<String, Value>, s: &str| v.contains_key(s);
    let vocab = vocab.clone();
    t["model"]["merges"].as_array_mut().unwrap().retain(|m| {
        let (a, b) = m.as_str().unwrap().split_once(' ').unwrap();
        has(&vocab, a) && has(&vocab, b) && has(&vocab, &format!("{a}{b}"))
    });
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    match mode {
        "unk" | "fused-unk" => {
            vocab.insert("<unk>".into(), json!(next_id(vocab)));
            t["model"]["unk_token"] = json!("<unk>");
            t["model"]["fuse_unk"] = json!(mode == "fused-unk");
        }
        "byte-fallback" => {
            // Only some bytes exist, so some missing symbols still drop.
            for b in [0xC3u8, 0x83, 0xC4, 0x84, 0x04] {
                vocab.insert(format!("<{b:#04X}>"), json!(next_id(vocab)));
            }
            t["model"]["byte_fallback"] = json!(true);
        }
        _ => {}
    }
}

/// `(name, tokenizer.json)` for each variant.
fn variants() -> Vec<(&'static str, Value)> {
    let mut out = vec![("fixture", fixture())];
    let mut t = fixture();
    t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": true}, byte_level(false, true)]});
    t["post_processor"] = Value::Null;
    repeat_merges(&mut t);
    out.push(("smollm2-shape", t));
    let mut t = fixture();
    t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": false}, byte_level(true, true)]});
    add_whole_words(&mut t);
    repeat_merges(&mut t);
    pair_merges(&mut t);
    more_added(&mut t);
    out.push(("prefix-space+ignore-merges+added", t));
    let mut t = fixture();
    t["pre_tokenizer"] = byte_level(false, false);
    t["post_processor"] = json!({"type": "ByteLevel", "add_prefix_space": true,
        "trim_offsets": true, "use_regex": true});
    more_added(&mut t);
    out.push(("no-regex", t));
    let mut t = fixture();
    add_whole_words(&mut t);
    more_added(&mut t);
    t["post_processor"] = json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [379], "tokens": ["<s>"]},
                           "<|endoftext|>": {"id": "<|endoftext|>", "ids": [376], "tokens": ["<|endoftext|>"]}}});
    out.push(("bos+eos+ignore-merges", t));
    for mode in ["drop", "unk", "fused-unk", "byte-fallback"] {
        let mut t = fixture();
        missing_bytes(&mut t, mode);
        out.push((mode, t));
    }
    out
}

struct Pair {
    name: &'static str,
    stock: tokenizers::Tokenizer,
    native: Native,
}

static PAIRS: LazyLock<Vec<Pair>> = LazyLock::new(|| {
    variants()
        .into_iter()
        .map(|(name, json)| {
            let stock = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let native = Native::from_tokenizer(&stock).unwrap_or_else(|e| panic!("{name}: {e}"));
            Pair {
                name,
                stock,
                native,
            }
        })
        .collect()
});

fn check(text: &str) -> Result<(), TestCaseError> {
    for p in PAIRS.iter() {
        for special in [false, true] {
            let want = p.stock.encode(text, special).unwrap().get_ids().to_vec();
            let mut got = vec![7]; // appends, never clears
            p.native.encode_into(text, special, &mut got);
            prop_assert_eq!(
                &got[1..],
                &want[..],
                "{} special={} text={:?}",
                p.name,
                special,
                text
            );
        }
    }
    Ok(())
}

const CORPUS: &[&str] = &[
    "",
    " ",
    "Hello world! The router hashes the prompt.",
    "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n",
    "I'm sure it's fine; they'll say we've done what you'd expect, 'cause THEY'RE right.",
    "    indented:\n\tfn main() { let x = 1_024 + 3.14159; }\n\n\n   trailing   ",
    "東京は日本の首都です。 서울은 한국의 수도입니다. Москва 🙂👍🏽🚀 é",
    "\u{3000}wide\u{3000}\u{3000}space, nbsp\u{a0}here, Ⅻ ½ ٣ 2026-11-22T03:25:54Z 12 123",
    "a  <mask>  b [R]   x   [L]y <mask><mask> router routers <|im <|im_start|>",
    "the router keeps the worker the router keeps the worker",
    "lll llll lllll     x\n\n\n\n\ny",
    "\u{4}\u{4}x\u{4} éé ü ÿ Ą 🙂🙂 ð é\u{4}é",
];

#[test]
fn corpus_matches_tokenizers_on_every_variant() {
    for s in CORPUS {
        check(s).unwrap();
    }
    let all = CORPUS.concat();
    check(&all).unwrap();
    // The second pass is served from the word cache and must not change anything.
    check(&all).unwrap();
    assert!(PAIRS[0].native.cached_words() > 0);
}

#[test]
fn repeated_segments_are_served_from_the_segment_cache_with_the_same_ids() {
    // Long segments between added tokens, met again in other positions and neighbours: the
    // first encode stores them, later ones must hit and still equal `tokenizers`.
    let system =
        "system\nYou are a helpful assistant. Answer concisely: the router keeps the worker. ";
    let q = |i: u32| {
        format!("user\nQuestion {i}: tell me about topic {i}, and about routers and workers?")
    };
    let chat = |turns: u32| {
        let mut s = format!("<|im_start|>{system}<|im_end|>\n");
        for i in 0..turns {
            s += &format!("<|im_start|>{}<|im_end|>\n<|im_start|>assistant\n", q(i));
        }
        s
    };
    let (h0, _, _) = PAIRS[0].native.segment_stats();
    for turns in 1..6 {
        check(&chat(turns)).unwrap();
    }
    // The same segment text with no added token before it (start of input) or after it.
    check(&format!("{system}<mask>{}", q(3))).unwrap();
    check(&format!("<s>{}", q(4))).unwrap();
    let (h1, _, entries) = PAIRS[0].native.segment_stats();
    assert!(h1 - h0 >= 10, "segment cache hits: {}", h1 - h0);
    assert!(entries >= 5);
    // Segments shorter than the threshold are never stored.
    let (_, m0, e0) = PAIRS[0].native.segment_stats();
    check("<|im_start|>user\nhi<|im_end|>").unwrap();
    let (_, m1, e1) = PAIRS[0].native.segment_stats();
    assert_eq!((m1, e1), (m0, e0));
}

#[test]
fn long_words_use_the_heap_path_with_the_same_result() {
    let long = "therouterkeepstheworker".repeat(40);
    check(&long).unwrap();
    check(&format!(" {long} {long}!!!")).unwrap();
    check(&"a".repeat(3000)).unwrap();
    check(&"é".repeat(500)).unwrap();
    // Self-merges over long runs: the heap's leftmost-first tie-break.
    check(&"l".repeat(301)).unwrap();
    check(&format!("x{}y", " ".repeat(299))).unwrap();
}

#[test]
fn unsupported_shapes_are_refused_with_a_reason() {
    let refused = |mutate: &dyn Fn(&mut Value)| {
        let mut t = fixture();
        mutate(&mut t);
        let stock = tokenizers::Tokenizer::from_bytes(t.to_string().as_bytes()).unwrap();
        Native::from_tokenizer(&stock).err().expect("refused")
    };
    assert!(refused(&|t| t["normalizer"] = json!({"type": "NFC"})).contains("normalizer"));
    assert!(refused(&|t| t["model"]["dropout"] = json!(0.1)).contains("dropout"));
    assert!(
        refused(&|t| t["model"]["end_of_word_suffix"] = json!("</w>"))
            .contains("end_of_word_suffix")
    );
    assert!(
        refused(&|t| t["added_tokens"][0]["single_word"] = json!(true)).contains("single_word")
    );
    assert!(
        refused(&|t| t["pre_tokenizer"] = json!({"type": "Whitespace"})).contains("pre-tokenizer")
    );
    assert!(refused(&|t| t["pre_tokenizer"] = Value::Null).contains("pre-tokenizer"));
    assert!(refused(&|t| {
        t["truncation"] = json!({"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                                 "stride": 0});
    })
    .contains("truncation"));
    // `tokenizers` would fail every encode that needs the unk.
    assert!(refused(&|t| t["model"]["unk_token"] = json!("<nope>")).contains("unk_token"));
}

fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just(" ".to_owned()),
        Just("  ".to_owned()),
        Just("\n".to_owned()),
        Just("\t".to_owned()),
        Just("\r\n".to_owned()),
        Just("\u{3000}".to_owned()),
        Just("\u{a0}".to_owned()),
        Just("'s".to_owned()),
        Just("'ll".to_owned()),
        Just("'RE".to_owned()),
        Just("'".to_owned()),
        Just("<|im_start|>".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<s>".to_owned()),
        Just("<|endoftext|>".to_owned()),
        Just("<mask>".to_owned()),
        Just("[R]".to_owned()),
        Just("[L]".to_owned()),
        Just("<|im".to_owned()),
        Just("router".to_owned()),
        Just(" the".to_owned()),
        Just(" worker".to_owned()),
        Just("Hello".to_owned()),
        "l{2,7}",
        " {2,9}",
        "\n{2,5}",
        Just(" prompt".to_owned()),
        "[a-zA-Z]{1,8}",
        "[a-z]{30,90}",
        "[0-9]{1,5}",
        "[!-/:-@\\[-`{-~]{1,3}",
        "[éüñßøΩжЖ]{1,3}",
        "[東京日本語한국어]{1,3}",
        "[🙂👍🏽🚀]{1,2}",
        "[\u{4}éüÃðĄ]{1,4}",
        "[½Ⅻ٣²]{1,2}",
        "\\PC{1,3}",
        any::<char>().prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn same_ids_as_tokenizers(s in text()) {
        check(&s)?;
    }
}
