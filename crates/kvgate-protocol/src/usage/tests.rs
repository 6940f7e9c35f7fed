use super::*;

type Key = (u64, u64, Option<u64>);

fn key(u: Option<Usage>) -> Option<Key> {
    u.map(|u| (u.prompt_tokens, u.completion_tokens, u.cached_tokens))
}

#[test]
fn usage_is_found_at_the_end() {
    let body = br#"{"id":"x","choices":[{"message":{"content":"say \"usage\": {\"prompt_tokens\":1}"}}],"usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#;
    assert_eq!(key(find_usage(body)), Some((12, 3, Some(8))));
    assert!(find_usage(br#"{"usage":null}"#).is_none());
    // Spaces around the colon; the last `"usage"` key decides.
    let spaced = br#"{"x": {"usage": 1}, "usage" : {"prompt_tokens": 5}}"#;
    assert_eq!(key(find_usage(spaced)), Some((5, 0, None)));
    assert!(find_usage(br#"{"x": {"usage": {"prompt_tokens": 5}}, "usage": null}"#).is_none());
    // `"usage"` as a string value is not a key.
    assert!(find_usage(br#"{"type":"usage","v":{}}"#).is_none());
}

#[test]
fn worker_usage_shapes_take_the_fast_path() {
    for (obj, want) in [
        // vLLM
        (
            r#"{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,"prompt_tokens_details":null}"#,
            (12, 3, None),
        ),
        (
            r#"{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}"#,
            (12, 3, Some(8)),
        ),
        // SGLang, spaced
        (
            "{ \"prompt_tokens\" : 7 ,\n \"completion_tokens\":0, \"total_tokens\": 7, \"prompt_tokens_details\": { \"cached_tokens\": null } }",
            (7, 0, None),
        ),
        (r#"{}"#, (0, 0, None)),
        (r#"{"completion_tokens":18446744073709551615}"#, (0, u64::MAX, None)),
        // 19 digits (the most that cannot overflow) and 20 that do not.
        (r#"{"prompt_tokens":9999999999999999999}"#, (9_999_999_999_999_999_999, 0, None)),
        (r#"{"prompt_tokens":10000000000000000000}"#, (10_000_000_000_000_000_000, 0, None)),
    ] {
        let fast = usage_fast(obj.as_bytes());
        assert_eq!(key(fast), Some(want), "{obj}");
        assert_eq!(key(usage_serde(obj.as_bytes())), Some(want), "{obj}");
    }
}

#[test]
fn other_shapes_are_left_to_serde() {
    for obj in [
        r#"{"prompt_tokens":12,"prompt_tokens":13}"#,
        r#"{"prompt_tokens":1.0}"#,
        r#"{"prompt_tokens":-1}"#,
        r#"{"prompt_tokens":01}"#,
        r#"{"prompt_tokens":null}"#,
        r#"{"prompt_tokens":"12"}"#,
        r#"{"completion_tokens":18446744073709551616}"#,
        r#"{"prompt_tokens_details":{"cached_tokens":1,"cached_tokens":2}}"#,
        r#"{"prompt_tokens_details":{"audio_tokens":{"x":1}}}"#,
        r#"{"extra":[1,2],"prompt_tokens":3}"#,
        r#"{"extra":"text","prompt_tokens":3}"#,
        r#"{"pro\u006dpt_tokens":3}"#,
        // Escapes in keys the fast path does not match by name: serde unescapes them.
        r#"{"tot\u0061l_tokens":3}"#,
        r#"{"x\"y":3}"#,
        r#"{"prompt_tokens\"":3}"#,
        r#"{"prompt_tokens_details":{"c\u0061ched_tokens":1}}"#,
        "{\"x\ty\":3}",
        r#"{"prompt_tokens":3,}"#,
        r#"{"prompt_tokens":3"#,
        r#"{"prompt_tokens" 3}"#,
        r#"{"prompt_tokens":nullx}"#,
    ] {
        assert!(usage_fast(obj.as_bytes()).is_none(), "{obj}");
    }
    // serde still reads what it can.
    let u = find_usage(br#"{"usage":{"extra":"text","prompt_tokens":3}}"#);
    assert_eq!(key(u), Some((3, 0, None)));
    let u = find_usage(br#"{"usage":{"pro\u006dpt_tokens":3}}"#);
    assert_eq!(key(u), Some((3, 0, None)));
    // A null count is not a count: the usage is unreadable, not zero.
    assert!(find_usage(br#"{"usage":{"prompt_tokens":null}}"#).is_none());
}

proptest::proptest! {
    /// Whenever the fast path answers, serde answers the same; it answers for every object of
    /// unescaped keys with integer or null values.
    #[test]
    fn fast_usage_agrees_with_serde(
        members in proptest::collection::vec((0usize..6, 0usize..8, proptest::bool::ANY), 0..6),
        inner in proptest::collection::vec((0usize..3, 0usize..8), 0..3),
        ws in 0usize..3,
    ) {
        const KEYS: [&str; 6] = [
            "prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
            "x", "prompt_tokens_details",
        ];
        const VALUES: [&str; 8] = ["0", "7", "123456", "null", "1.5", "\"s\"", "-3", "012"];
        const IN_KEYS: [&str; 3] = ["cached_tokens", "audio_tokens", "cached_tokens"];
        let sp = [" ", "", "\n\t "][ws];
        let nested: Vec<String> = inner
            .iter()
            .map(|&(k, v)| format!("\"{}\"{sp}:{sp}{}", IN_KEYS[k], VALUES[v]))
            .collect();
        let nested = format!("{{{sp}{}{sp}}}", nested.join(","));
        let body: Vec<String> = members
            .iter()
            .map(|&(k, v, obj)| {
                let v = if KEYS[k] == "prompt_tokens_details" && obj { nested.as_str() } else { VALUES[v] };
                format!("{sp}\"{}\"{sp}:{v}", KEYS[k])
            })
            .collect();
        let obj = format!("{{{}{sp}}}", body.join(","));
        let serde = key(usage_serde(obj.as_bytes()));
        if let Some(fast) = usage_fast(obj.as_bytes()) {
            proptest::prop_assert_eq!(key(Some(fast)), serde, "{}", obj);
        }
        let simple = ["1.5", "\"s\"", "-3", "012"].iter().all(|v| !obj.contains(v));
        if simple && serde.is_some() {
            proptest::prop_assert!(usage_fast(obj.as_bytes()).is_some(), "{}", obj);
        }
    }
}

/// The last `"usage"` key, by checking every position: what the windowed search must equal.
fn last_usage_key_naive(buf: &[u8]) -> Option<(usize, u8)> {
    const KEY: &[u8] = b"\"usage\"";
    (0..buf.len().saturating_sub(KEY.len() - 1))
        .rev()
        .filter(|&i| &buf[i..i + KEY.len()] == KEY)
        .find_map(|i| value_start(buf, i + KEY.len()))
}

#[test]
fn a_key_across_a_window_boundary_is_found_once() {
    // The last 1024-byte window starts `shift` bytes into the 29-byte document head, so the key
    // (bytes 1..8) is before, across or after the boundary.
    for shift in 0..12 {
        let mut doc = br#"{"usage":{"prompt_tokens":9}}"#.to_vec();
        doc.extend(std::iter::repeat_n(b' ', 1024 - 29 + shift));
        assert_eq!(last_usage_key(&doc), last_usage_key_naive(&doc), "{shift}");
        assert_eq!(key(find_usage(&doc)), Some((9, 0, None)), "{shift}");
    }
    // Only a string value in the last window: the key further back decides.
    let mut doc = br#"{"usage":{"prompt_tokens":4},"t":""#.to_vec();
    doc.extend(std::iter::repeat_n(b'x', 3000));
    doc.extend_from_slice(br#"","k":"usage"}"#);
    assert_eq!(key(find_usage(&doc)), Some((4, 0, None)));
}

proptest::proptest! {
    /// Over documents of up to a few windows, with keys, string values and key-like text at any
    /// place, the windowed search finds what a check of every position finds.
    #[test]
    fn windowed_search_finds_the_last_key(
        parts in proptest::collection::vec((0usize..6, 0usize..1500), 0..12),
    ) {
        const PIECES: [&str; 6] = [
            "\"usage\":{\"prompt_tokens\":1}", "\"usage\" : null", "\"usage\"", "\"usag",
            "e\":{}", "\"usage\"\n:\n{\"completion_tokens\":2}",
        ];
        let mut doc = Vec::new();
        for &(p, pad) in &parts {
            doc.extend(std::iter::repeat_n(b'a', pad));
            doc.extend_from_slice(PIECES[p].as_bytes());
        }
        proptest::prop_assert_eq!(last_usage_key(&doc), last_usage_key_naive(&doc));
    }
}
