use proptest::prelude::*;
use proptest::strategy::ValueTree;

use super::super::request::serde_fields;
use super::{fields, has_control, quote_or_backslash};

/// Same answer as serde whenever the fast reader answers.
fn agree(body: &str, with_messages: bool) -> Result<bool, TestCaseError> {
    let Some(fast) = fields(body, with_messages) else {
        return Ok(false);
    };
    let slow = serde_fields(body, with_messages);
    prop_assert!(slow.is_ok(), "fast read {body:?}, serde refused: {slow:?}");
    prop_assert_eq!(
        format!("{fast:?}"),
        format!("{:?}", slow.unwrap()),
        "{}",
        body
    );
    Ok(true)
}

#[test]
fn usual_bodies_take_the_fast_path() {
    let bodies = [
        // The overhead benchmark's body.
        r#"{"model":"mock-model","max_tokens":16,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Question 1"}]}"#,
        // The Python SDK: spaces, ASCII-only escapes (an emoji as a surrogate pair), stream_options.
        r#"{"messages": [{"role": "user", "content": "caf\u00e9 \ud83d\ude00 \"quoted\"\nnext line\\"}], "model": "m", "stream": true, "stream_options": {"include_usage": true}, "temperature": 0.7, "top_p": 1e-1}"#,
        // Parts, tools, nulls, unknown nested fields, extra vLLM knobs.
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"data:x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{}}}}],"max_completion_tokens":null,"cache_salt":"s","prompt_cache_key":"k","add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false},"logit_bias":{"50256":-100},"n":1,"stop":["\n"],"seed":-3}"#,
        // Completions: prompt as a string, strings and token ids.
        r#"{"model":"m","prompt":"Once upon a time","max_tokens":8}"#,
        r#"{"model":"m","prompt":[[1,2,3],[4]],"echo":true}"#,
        "\n\t{ \"model\" : \"m\" , \"messages\" : [ { \"role\" : \"user\" , \"content\" : \"x\" } ] }\r\n",
    ];
    for body in bodies {
        assert!(agree(body, true).unwrap(), "fast path declined {body}");
        assert!(agree(body, false).unwrap(), "fast path declined {body}");
    }
}

#[test]
fn unusual_bodies_are_left_to_serde() {
    for body in [
        r#"{"model":"m",}"#,
        r#"{"model":"m"} x"#,
        r#"{"model":5}"#,
        r#"{"max_tokens":1.0}"#,
        r#"{"max_tokens":01}"#,
        r#"{"max_tokens":1e2}"#,
        r#"{"messages":[{"role":"user","content":5}]}"#,
        r#"{"messages":[{"role":null,"content":"x"}]}"#,
        r#"{"max_tokens":-1}"#,
        r#"{"max_tokens":18446744073709551616}"#,
        r#"{"stream":"yes"}"#,
        r#"{"messages":{}}"#,
        r#"{"messages":[{"content":"no role"}]}"#,
        r#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
        r#"{"messages":[{"role":"user","content":"lone \ud83d"}]}"#,
        r#"{"messages":[{"role":"user","content":"bad \x escape"}]}"#,
        "{\"messages\":[{\"role\":\"user\",\"content\":\"raw \u{1} control\"}]}",
        r#"{"x":01}"#,
        r#"{"x":[1,]}"#,
        r#"{"x":tru}"#,
    ] {
        assert!(fields(body, true).is_none(), "fast path read {body}");
    }
    // Deeper than the fast reader goes: serde's call (it has its own limit).
    let deep = format!(r#"{{"x":{}1{}}}"#, "[".repeat(120), "]".repeat(120));
    assert!(fields(&deep, true).is_none());
}

/// Pieces bodies are made of: valid JSON of every type the view reads, and now and then
/// something serde refuses (or the fast reader leaves to it).
fn scalar() -> impl Strategy<Value = String> {
    let good = prop_oneof![
        Just("null"),
        Just("true"),
        Just("false"),
        Just("0"),
        Just("16"),
        Just("-1"),
        Just("-0"),
        Just("1.5"),
        Just("2e3"),
        Just("1E+2"),
        Just("18446744073709551615"),
        Just("18446744073709551616"),
        Just("\"\""),
        Just("\"plain\""),
        Just("\"caf\u{e9}\""),
        Just(r#""esc \" \\ \/ \n \t \b \f \r""#),
        Just(r#""\u00e9\u0041""#),
        Just(r#""\ud83d\ude00""#),
    ];
    let bad = prop_oneof![
        Just("01"),
        Just("1."),
        Just("-"),
        Just(r#""\ud83d""#),
        Just(r#""\ude00x""#),
        Just(r#""\ud83dx\ude00""#),
        Just(r#""\u12g4""#),
        Just(r#""\q""#),
        Just("\"ctl\u{1f}\""),
        Just("tru"),
        Just("nul"),
    ];
    prop_oneof![30 => good, 1 => bad].prop_map(str::to_owned)
}

fn value() -> impl Strategy<Value = String> {
    scalar().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            prop::collection::vec((key(), inner), 0..4).prop_map(|m| {
                let m: Vec<String> = m.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                format!("{{{}}}", m.join(","))
            }),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\"model\""),
        Just("\"mod\\u0065l\""),
        Just("\"stream\""),
        Just("\"stream_options\""),
        Just("\"max_tokens\""),
        Just("\"max_completion_tokens\""),
        Just("\"cache_salt\""),
        Just("\"prompt_cache_key\""),
        Just("\"messages\""),
        Just("\"prompt\""),
        Just("\"tools\""),
        Just("\"add_generation_prompt\""),
        Just("\"chat_template_kwargs\""),
        Just("\"role\""),
        Just("\"content\""),
        Just("\"type\""),
        Just("\"text\""),
        Just("\"other\""),
        Just("\"\""),
    ]
    .prop_map(str::to_owned)
}

fn part() -> impl Strategy<Value = String> {
    let member = prop_oneof![
        Just("\"type\":\"text\"".to_owned()),
        Just("\"type\":\"image_url\"".to_owned()),
        (Just("\"text\""), scalar()).prop_map(|(k, v)| format!("{k}:{v}")),
        (key(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
    ];
    prop::collection::vec(member, 0..4).prop_map(|m| format!("{{{}}}", m.join(",")))
}

fn message() -> impl Strategy<Value = String> {
    let content = prop_oneof![
        scalar(),
        prop::collection::vec(part(), 0..3).prop_map(|p| format!("[{}]", p.join(","))),
        value(),
    ];
    let member = prop_oneof![
        Just("\"role\":\"user\"".to_owned()),
        Just("\"role\":\"system\"".to_owned()),
        (Just("\"role\""), scalar()).prop_map(|(k, v)| format!("{k}:{v}")),
        content.prop_map(|c| format!("\"content\":{c}")),
        (key(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
    ];
    prop_oneof![
        4 => prop::collection::vec(member, 0..4).prop_map(|m| format!("{{{}}}", m.join(","))),
        1 => value(),
    ]
}

fn member() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => prop::collection::vec(message(), 0..4)
            .prop_map(|m| format!("\"messages\":[{}]", m.join(","))),
        3 => (key(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
        1 => (key(), scalar()).prop_map(|(k, v)| format!("{k}:{v}")),
    ]
}

/// A body: members joined with commas, whitespace sprinkled between tokens, sometimes broken.
fn body() -> impl Strategy<Value = String> {
    (
        prop::collection::vec(member(), 0..6),
        prop_oneof![8 => Just(""), 8 => Just(" "), 8 => Just("\n\t "), 1 => Just("\u{c}")],
        prop_oneof![
            20 => Just(""),
            1 => Just(","),
            1 => Just("}"),
            1 => Just(" x"),
        ],
    )
        .prop_map(|(members, ws, tail)| {
            let inner = members.join(",");
            // Whitespace after every structural character, as a pretty-printer would.
            let spaced: String = inner
                .chars()
                .flat_map(|c| {
                    let pad = matches!(c, ',' | ':' | '[' | '{');
                    std::iter::once(c).chain(ws.chars().filter(move |_| pad))
                })
                .collect();
            // Padding inside strings changes them, but the same way for both readers.
            format!("{{{ws}{spaced}{ws}}}{tail}")
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn fast_fields_agree_with_serde(body in body(), with_messages in any::<bool>()) {
        agree(&body, with_messages)?;
    }
}

/// Share of generated bodies the fast reader takes, so the property above is not vacuous.
#[test]
fn the_property_exercises_the_fast_path() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut fast, mut total) = (0, 0);
    for _ in 0..2000 {
        let body = body().new_tree(&mut runner).unwrap().current();
        total += 1;
        fast += usize::from(fields(&body, true).is_some());
    }
    assert!(
        fast * 5 > total,
        "only {fast} of {total} generated bodies read fast"
    );
}

/// The blocked control-byte check finds one control byte at any position of any length (every
/// block size and remainder: the 256-byte blocks, the 16-byte chunks after them and the
/// overlapping last 16 bytes), and none in a body without one.
#[test]
fn has_control_finds_a_control_byte_anywhere() {
    let lens = (0..200).chain([
        255, 256, 257, 271, 272, 273, 287, 511, 512, 513, 527, 528, 529, 767, 768, 784, 800,
    ]);
    for len in lens {
        let clean = vec![b'a'; len];
        assert!(!has_control(&clean), "{len}");
        // The bytes around the threshold: 0x1f is a control byte, 0x20 (space), 0x7f and the
        // bytes of multi-byte UTF-8 (0x80 and up) are not.
        for c in [0x20, 0x7f, 0x80, 0xff] {
            assert!(!has_control(&vec![c; len]), "{len} {c}");
        }
        for at in 0..len {
            for c in [0u8, b'\n', 0x1f] {
                let mut b = clean.clone();
                b[at] = c;
                assert!(has_control(&b), "{len} {at} {c}");
            }
        }
    }
}

proptest! {
    /// Against the plain definition, over bodies of every length up to past four blocks, mostly
    /// without a control byte (1 byte in 51 is one) so that the tail paths run.
    #[test]
    fn has_control_is_any_byte_below_0x20(
        bytes in proptest::collection::vec(prop_oneof![50 => 0x20u8..=0xff, 1 => 0u8..0x20], 0..1100)
    ) {
        prop_assert_eq!(has_control(&bytes), bytes.iter().any(|&c| c < 0x20));
    }
}

/// The word-at-a-time search finds what memchr2 finds: every length up to 40, the quote or
/// backslash at every position (and none), with bytes that differ from them by one bit around.
#[test]
fn quote_or_backslash_matches_memchr2() {
    for len in 0..40 {
        for filler in [b'a', b'"' ^ 1, b'\\' ^ 1, 0x80 | b'"', 0xff, 0] {
            let clean = vec![filler; len];
            assert_eq!(
                quote_or_backslash(&clean),
                memchr::memchr2(b'"', b'\\', &clean),
                "{len} {filler}"
            );
            for at in 0..len {
                for c in [b'"', b'\\'] {
                    let mut s = clean.clone();
                    s[at] = c;
                    // A second hit later must not win.
                    if at + 3 < len {
                        s[at + 3] = b'"';
                    }
                    assert_eq!(
                        quote_or_backslash(&s),
                        memchr::memchr2(b'"', b'\\', &s),
                        "{len} {filler} {at} {c}"
                    );
                }
            }
        }
    }
}
