use proptest::prelude::*;
use tokenizers::tokenizer::pattern::Pattern;
use tokenizers::utils::SysRegex;

use super::Gpt2Split;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

fn pieces_fast(s: &str) -> Vec<&str> {
    Gpt2Split
        .find_matches(s)
        .unwrap()
        .into_iter()
        .map(|((a, b), m)| {
            assert!(m);
            &s[a..b]
        })
        .collect()
}

fn pieces_regex<'a>(re: &SysRegex, s: &'a str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut prev = 0;
    for (a, b) in re.find_iter(s) {
        assert_eq!(a, prev, "regex left a gap in {s:?}");
        out.push(&s[a..b]);
        prev = b;
    }
    assert_eq!(prev, s.len());
    out
}

#[test]
fn known_splits() {
    let re = SysRegex::new(GPT2).unwrap();
    for s in [
        "",
        "Hello world",
        "I'm here, it's 'tis we'll they've you're he'd 'S",
        "  two  spaces   three\n\n\nnewlines \n x\t\ty ",
        "trailing   ",
        " 'quote' !!! ?? 12345 a1b2 東京タワー 🙂🙂 x",
        "\u{3000}ideographic\u{3000}\u{3000}space \u{a0}nbsp",
        "é café naïve Ⅻ ½ ٣",
    ] {
        assert_eq!(pieces_fast(s), pieces_regex(&re, s), "{s:?}");
    }
    assert_eq!(pieces_fast("a  b\n\nc"), ["a", " ", " b", "\n", "\n", "c"]);
}

fn alphabet() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just(" ".to_owned()),
        Just("  ".to_owned()),
        Just("\n".to_owned()),
        Just("\t".to_owned()),
        Just("\r\n".to_owned()),
        Just("\u{3000}".to_owned()),
        Just("\u{a0}".to_owned()),
        Just("'".to_owned()),
        Just("'s".to_owned()),
        Just("'ll".to_owned()),
        Just("'re".to_owned()),
        Just("'ve".to_owned()),
        Just("'d".to_owned()),
        Just("'m".to_owned()),
        Just("'t".to_owned()),
        Just("'S".to_owned()),
        "[a-zA-Z]{1,6}",
        "[0-9]{1,4}",
        "[!-/:-@\\[-`{-~]{1,3}",
        "[éüñßøΩжЖ]{1,3}",
        "[東京日本語한국어]{1,3}",
        "[🙂👍🏽🚀]{1,2}",
        "[½Ⅻ٣²]{1,2}",
        "\\PC{1,3}",
        any::<char>().prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn same_pieces_as_the_regex(s in alphabet()) {
        let re = SysRegex::new(GPT2).unwrap();
        prop_assert_eq!(pieces_fast(&s), pieces_regex(&re, &s));
    }
}
