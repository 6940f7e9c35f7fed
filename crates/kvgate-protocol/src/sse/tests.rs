use proptest::prelude::*;

use super::chunk::plain_facts;
use super::relay::null_usage;
use super::*;

type Owned = (Vec<u8>, Vec<u8>);

fn collect(chunks: &[&[u8]]) -> (Vec<Owned>, bool) {
    let mut s = SseScanner::default();
    let mut out = Vec::new();
    for c in chunks {
        s.feed(c, |e| out.push((e.event.to_vec(), e.data.to_vec())));
    }
    (out, s.has_partial())
}

fn data(events: &[Owned]) -> Vec<String> {
    events
        .iter()
        .map(|(_, d)| String::from_utf8(d.clone()).unwrap())
        .collect()
}

/// Every chunking of a stream: split at each offset, and byte by byte.
fn splits(stream: &[u8]) -> Vec<Vec<&[u8]>> {
    let mut all: Vec<Vec<&[u8]>> = (0..=stream.len())
        .map(|i| {
            let (a, b) = stream.split_at(i);
            vec![a, b]
        })
        .collect();
    all.push(stream.chunks(1).collect());
    all
}

/// `stream` cut at the given offsets (any order).
fn cut_at(stream: &[u8], mut cuts: Vec<usize>) -> Vec<&[u8]> {
    cuts.sort_unstable();
    let mut chunks = Vec::new();
    let mut prev = 0;
    for c in cuts {
        chunks.push(&stream[prev..c]);
        prev = c;
    }
    chunks.push(&stream[prev..]);
    chunks
}

const STREAM: &[u8] = b": keep-alive\n\
data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\r\n\r\n\
event: error\rdata: line1\rdata: line2\r\r\
id: 7\nretry: 10\ndata\n\n\
data:no-space\n\n\
data: [DONE]\n\n";

#[test]
fn splits_events_with_all_line_endings() {
    let (ev, partial) = collect(&[STREAM]);
    assert!(!partial);
    assert_eq!(
        data(&ev),
        [
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"choices":[{"delta":{"content":"Hel"}}]}"#,
            "line1\nline2",
            "",
            "no-space",
            "[DONE]",
        ]
    );
    assert_eq!(ev[2].0, b"error");
    assert_eq!(ev[3].0, b"");
}

#[test]
fn split_at_every_offset_gives_same_events() {
    let (whole, _) = collect(&[STREAM]);
    for chunks in splits(STREAM) {
        let (ev, partial) = collect(&chunks);
        assert_eq!(ev, whole, "split {:?}", chunks.first().map(|c| c.len()));
        assert!(!partial);
    }
}

#[test]
fn event_end_offsets_point_past_the_blank_line() {
    let stream = b": c\n\ndata: a\n\ndata: b\r\n\r\n";
    let mut ends = Vec::new();
    SseScanner::default().feed(stream, |e| ends.push(e.end));
    assert_eq!(ends, [14, stream.len()]);
    assert_eq!(&stream[..ends[0]], b": c\n\ndata: a\n\n");
}

#[test]
fn unfinished_event_is_reported_partial() {
    let (ev, partial) = collect(&[b"data: {\"a\":1}\n\ndata: {\"b\""]);
    assert_eq!(data(&ev), [r#"{"a":1}"#]);
    assert!(partial);
    let (_, partial) = collect(&[b"data: x\n"]);
    assert!(partial, "data line without blank line is not dispatched");
}

#[test]
fn oversized_event_is_skipped_not_buffered() {
    for chunks in splits(b"data: 0123456789abcdefXYZ\n\ndata: ok\n\n") {
        let mut s = SseScanner::new(16);
        let mut got = Vec::new();
        for c in &chunks {
            s.feed(c, |e| got.push((e.oversized, e.data.to_vec())));
        }
        assert_eq!(got, [(true, vec![]), (false, b"ok".to_vec())]);
        assert!(!s.has_partial());
    }
    // Several data lines adding up past the bound.
    let mut s = SseScanner::new(16);
    s.feed(b"data: 0123456789\ndata: 0123456789\n", |_| {
        panic!("no event yet")
    });
    assert!(s.skipping() && s.has_partial());
    let mut got = Vec::new();
    s.feed(b"\ndata: x\n\n", |e| {
        got.push((e.oversized, e.data.to_vec()))
    });
    assert_eq!(got, [(true, vec![]), (false, b"x".to_vec())]);
    // A line without end never grows the buffer past the bound.
    let mut s = SseScanner::new(16);
    for _ in 0..100 {
        s.feed(b"data: 0123456789", |_| panic!("no event"));
    }
    assert!(s.skipping());
}

#[test]
fn chunk_info_token_definition() {
    let token = |d: &[u8]| ChunkInfo::scan(d).has_token;
    // Not tokens: the role-only first chunk, an empty delta with the finish reason, null content.
    assert!(!token(br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#));
    assert!(!token(
        br#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#
    ));
    assert!(!token(
        br#"{"choices":[{"delta":{"content":null,"tool_calls":[]}}]}"#
    ));
    assert!(!token(
        br#"{"choices":[{"text":"","finish_reason":"length"}]}"#
    ));
    // Tokens: content, text, reasoning, refusal, tool-call deltas (the first one names the
    // function and has empty arguments).
    assert!(token(
        br#"{"choices":[{"delta":{"content":"Hi"},"logprobs":{"content":[]}}]}"#
    ));
    assert!(token(
        br#"{"choices":[{"text": " x", "finish_reason": "length"}]}"#
    ));
    assert!(token(
        br#"{"choices":[{"delta":{"reasoning_content":"hmm"}}]}"#
    ));
    assert!(token(br#"{"choices":[{"delta":{"reasoning":"hmm"}}]}"#));
    assert!(token(br#"{"choices":[{"delta":{"refusal":"no"}}]}"#));
    assert!(token(br#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":""}}]}}]}"#));
    assert!(token(
        br#"{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\""}}]}}]}"#
    ));
    // A key name inside content text is escaped, so it is not mistaken for a key.
    let i = ChunkInfo::scan(br#"{"choices":[{"delta":{"content":""},"x":"\"usage\":{\"prompt_tokens\":1} \"error\":{} \"text\":\"t\""}]}"#);
    assert!(!i.has_token && i.usage.is_none() && !i.error);
    assert!(ChunkInfo::scan(b" [DONE] ").done);
}

#[test]
fn chunk_info_usage_and_usage_only() {
    let i = ChunkInfo::scan(br#"{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":8}}}"#);
    assert_eq!(
        i.usage,
        Some(crate::usage::Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            cached_tokens: Some(8)
        })
    );
    assert!(i.usage_only && !i.has_token);
    assert!(ChunkInfo::scan(br#"{"choices": [ ], "usage": {"prompt_tokens": 1}}"#).usage_only);
    // Usage on the last content chunk (SGLang): a token, not usage-only.
    let i = ChunkInfo::scan(br#"{"choices":[{"delta":{"content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":null}}"#);
    assert_eq!(i.usage.unwrap().cached_tokens, None);
    assert!(!i.usage_only && i.has_token);
    // `"choices":[]` without usage is nothing.
    assert!(!ChunkInfo::scan(br#"{"choices":[]}"#).usage_only);
}

#[test]
fn chunk_info_error_shapes() {
    for err in [
        &br#"{"error":{"object":"error","message":"engine died","type":"InternalServerError","param":null,"code":500}}"#[..],
        br#"{"object":"error","message":"oom","type":"InternalServerError","param":null,"code":500}"#,
        br#"{"object" : "error", "message": "x"}"#,
        br#"{"id":"x", "error": "text", "error_type": "validation"}"#,
    ] {
        let i = ChunkInfo::scan(err);
        assert!(i.error && !i.has_token, "{}", String::from_utf8_lossy(err));
    }
    for ok in [
        &br#"{"choices":[],"error":null}"#[..],
        br#"{"object":"chat.completion.chunk","choices":[{"delta":{"content":"error"}}]}"#,
        br#"{"choices":[{"delta":{"content":"\"object\":\"error\""}}]}"#,
    ] {
        assert!(
            !ChunkInfo::scan(ok).error,
            "{}",
            String::from_utf8_lossy(ok)
        );
    }
}

/// Feeds `chunks` through a stripping relay: the bytes delivered and the facts seen.
fn relay(chunks: &[&[u8]], max: usize) -> (Vec<u8>, Vec<ChunkInfo>, bool) {
    let mut r = Relay::new(true, max);
    let (mut out, mut facts) = (Vec::new(), Vec::new());
    for c in chunks {
        r.feed(c, |i| facts.push(*i));
        out.extend(r.take_out().unwrap());
    }
    if let Some(h) = r.take_held() {
        out.extend(h);
    }
    (out, facts, r.saw_done())
}

const WITH_USAGE: &[u8] = b": ping\n\n\
data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n\
data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\r\n\r\n\
data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}\n\n\
data: [DONE]\n\n";

const STRIPPED: &[u8] = b": ping\n\n\
data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\r\n\r\n\
data: [DONE]\n\n";

#[test]
fn relay_strips_what_the_gateway_asked_for_at_any_chunking() {
    for chunks in splits(WITH_USAGE) {
        let (out, facts, done) = relay(&chunks, 1 << 20);
        assert_eq!(
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(STRIPPED)
        );
        let tokens = facts.iter().filter(|i| i.has_token).count();
        let usage = facts.iter().find_map(|i| i.usage).unwrap();
        assert_eq!((tokens, usage.prompt_tokens, done), (1, 9, true));
    }
    // Without stripping the relay only watches.
    let mut r = Relay::new(false, 1 << 20);
    r.feed(WITH_USAGE, |_| {});
    assert!(r.take_out().is_none() && r.take_held().is_none() && r.saw_done());
}

#[test]
fn relay_delivers_keep_alives_at_once_and_a_cut_stream_at_the_end() {
    let mut r = Relay::new(true, 1 << 20);
    r.feed(b": ping\n\n: ping\n", |_| {});
    assert_eq!(r.take_out().unwrap(), b": ping\n\n: ping\n");
    r.feed(
        b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n",
        |_| {},
    );
    assert_eq!(r.take_out().unwrap(), b"", "held until the event ends");
    assert_eq!(
        r.take_held().unwrap(),
        b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n"
    );
}

#[test]
fn relay_passes_an_oversized_event_through_unexamined() {
    let big = format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1}},\"pad\":\"{}\"}}\n\n",
        "x".repeat(100)
    );
    let stream = [big.as_bytes(), b"data: {\"text\":\"a\",\"usage\":null}\n\n"].concat();
    for chunks in splits(&stream) {
        let (out, facts, _) = relay(&chunks, 64);
        let want = [big.as_bytes(), b"data: {\"text\":\"a\"}\n\n"].concat();
        assert_eq!(
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&want)
        );
        assert_eq!(facts.len(), 2);
        assert!(facts[0] == ChunkInfo::default() && facts[1].has_token);
    }
}

#[test]
fn null_usage_members_are_cut_with_their_comma() {
    let cut = |l: &str| {
        let b = l.as_bytes();
        match null_usage(b) {
            Some((f, t)) => format!("{}{}", &l[..f], &l[t..]),
            None => l.to_owned(),
        }
    };
    assert_eq!(
        cut(r#"data: {"id":"x","choices":[{"index":0}],"usage":null}"#),
        r#"data: {"id":"x","choices":[{"index":0}]}"#
    );
    assert_eq!(
        cut(r#"data: {"id": "x", "usage": null, "choices": []}"#),
        r#"data: {"id": "x", "choices": []}"#
    );
    assert_eq!(cut(r#"data: {"usage":null}"#), r#"data: {}"#);
    assert_eq!(
        cut(r#"data: {"usage": null , "a": 1}"#),
        r#"data: {"a": 1}"#
    );
    // Not null, or not a member: untouched.
    for keep in [
        r#"data: {"usage":{"prompt_tokens":1}}"#,
        r#"data: {"usage":nullx}"#,
        r#"data: {"text":"say "usage":null"}"#,
    ] {
        let b = keep.as_bytes();
        if let Some((f, t)) = null_usage(b) {
            panic!("{keep}: would cut {:?}", &keep[f..t]);
        }
    }
}

/// Streamed chunks built from the parts workers send, for the token-definition twin.
fn chunk_strategy() -> impl Strategy<Value = String> {
    const VALUES: [&str; 6] = [r#""""#, r#""a""#, "null", r#"" ""#, "[]", r#""\"x\"""#];
    const DELTA_KEYS: [&str; 5] = [
        "content",
        "reasoning_content",
        "reasoning",
        "refusal",
        "role",
    ];
    const TOOLS: [&str; 3] = [
        "[]",
        r#"[{"index":0,"function":{"name":"f","arguments":""}}]"#,
        r#"[{"index":0,"function":{"arguments":"{\"a\":1}"}}]"#,
    ];
    // Each delta key at most once (a JSON object with a repeated key means what its parser says).
    let delta = (
        proptest::collection::vec(proptest::option::of(0usize..VALUES.len()), DELTA_KEYS.len()),
        proptest::option::of(0usize..TOOLS.len()),
    )
        .prop_map(|(values, tools)| {
            let mut ms: Vec<String> = DELTA_KEYS
                .iter()
                .zip(values)
                .filter_map(|(k, v)| Some(format!(r#""{k}":{}"#, VALUES[v?])))
                .collect();
            if let Some(t) = tools {
                ms.push(format!(r#""tool_calls":{}"#, TOOLS[t]));
            }
            format!("{{{}}}", ms.join(","))
        });
    const FINISH: [&str; 5] = [
        "null",
        r#""stop""#,
        r#""length""#,
        r#""tool_calls""#,
        r#""abort""#,
    ];
    let choice = prop_oneof![
        (delta, 0usize..FINISH.len()).prop_map(|(d, f)| format!(
            r#"{{"index":0,"delta":{d},"logprobs":{{"content":[]}},"finish_reason":{}}}"#,
            FINISH[f]
        )),
        (0usize..VALUES.len(), 0usize..FINISH.len()).prop_map(|(v, f)| format!(
            r#"{{"index":0,"text":{},"finish_reason":{}}}"#,
            VALUES[v], FINISH[f]
        )),
    ];
    const TOP: [&str; 7] = [
        "",
        r#","usage":null"#,
        r#","usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}"#,
        r#","usage": {"prompt_tokens": 9, "completion_tokens": 2}"#,
        r#","error":null"#,
        r#","error":{"message":"boom","code":500}"#,
        r#","error":"boom""#,
    ];
    (
        proptest::collection::vec(choice, 0..3),
        0usize..TOP.len(),
        proptest::bool::ANY,
    )
        .prop_map(|(cs, top, flat_error)| {
            let object = if flat_error {
                "error"
            } else {
                "chat.completion.chunk"
            };
            format!(
                r#"{{"id":"x","object":"{object}","choices":[{}]{}}}"#,
                cs.join(","),
                TOP[top]
            )
        })
}

proptest! {
    #[test]
    fn any_chunking_gives_same_events(cuts in proptest::collection::vec(0usize..=STREAM.len(), 0..8)) {
        prop_assert_eq!(collect(&cut_at(STREAM, cuts)).0, collect(&[STREAM]).0);
    }

    #[test]
    fn relay_output_does_not_depend_on_chunking(cuts in proptest::collection::vec(0usize..=WITH_USAGE.len(), 0..8)) {
        prop_assert_eq!(relay(&cut_at(WITH_USAGE, cuts), 1 << 20).0, STRIPPED.to_vec());
    }

    /// The one-pass scan and the parsed-JSON definitions (token, error, usage-only) agree.
    #[test]
    fn scan_agrees_with_parsed_json(chunk in chunk_strategy()) {
        let plain = plain_facts(chunk.as_bytes());
        prop_assert!(plain.is_some(), "{}", chunk);
        prop_assert_eq!(Some(ChunkInfo::scan(chunk.as_bytes())), plain, "{}", chunk);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300), cut in 0usize..300) {
        let cut = cut.min(bytes.len());
        let mut r = Relay::new(true, 128);
        r.feed(&bytes[..cut], |_| {});
        r.feed(&bytes[cut..], |_| {});
        let _ = (r.take_out(), r.take_held());
        let _ = ChunkInfo::scan(&bytes);
    }
}

#[test]
fn relay_merges_prefill_usage_into_the_usage_event_at_any_chunking() {
    let prefill = crate::usage::Usage {
        prompt_tokens: 9,
        completion_tokens: 1,
        cached_tokens: Some(4),
    };
    for chunks in splits(WITH_USAGE) {
        let mut r = Relay::new(false, 1 << 20).with_pd_usage(prefill);
        let mut out = Vec::new();
        for c in &chunks {
            r.feed(c, |_| {});
            out.extend(r.take_out().unwrap());
        }
        if let Some(h) = r.take_held() {
            out.extend(h);
        }
        let text = String::from_utf8(out).unwrap();
        // Everything but the usage event passes unchanged, `"usage": null` members included.
        assert!(text.starts_with(": ping\n\ndata: {\"id\":\"c\",\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n"), "{text}");
        assert!(
            text.contains("\"prompt_tokens_details\":{\"cached_tokens\":4}"),
            "{text}"
        );
        assert!(text.contains("\"total_tokens\":10"), "{text}");
        assert!(text.ends_with("}\n\ndata: [DONE]\n\n"), "{text}");
    }
    // Stripping wins when the client did not ask for usage.
    let (out, _, _) = {
        let mut r = Relay::new(true, 1 << 20).with_pd_usage(prefill);
        r.feed(WITH_USAGE, |_| {});
        (r.take_out().unwrap(), (), ())
    };
    assert_eq!(out, STRIPPED);
}
