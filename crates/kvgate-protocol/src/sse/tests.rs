use proptest::prelude::*;

use super::*;

type Owned = (Vec<u8>, Vec<u8>);

fn collect(chunks: &[&[u8]]) -> (Vec<Owned>, bool) {
    let mut s = SseScanner::default();
    let mut out = Vec::new();
    for c in chunks {
        s.feed(c, |e| out.push((e.event.to_vec(), e.data.to_vec())))
            .unwrap();
    }
    (out, s.has_partial())
}

fn data(events: &[Owned]) -> Vec<String> {
    events
        .iter()
        .map(|(_, d)| String::from_utf8(d.clone()).unwrap())
        .collect()
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
    for i in 0..=STREAM.len() {
        let (a, b) = STREAM.split_at(i);
        let (ev, partial) = collect(&[a, b]);
        assert_eq!(ev, whole, "split at {i}");
        assert!(!partial);
    }
    // One byte at a time.
    let bytes: Vec<&[u8]> = STREAM.chunks(1).collect();
    assert_eq!(collect(&bytes).0, whole);
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
fn oversized_event_is_refused() {
    let mut s = SseScanner::new(16);
    assert_eq!(
        s.feed(b"data: 0123456789abcdefXYZ", |_| {}),
        Err(SseError::EventTooLarge(16))
    );
    let mut s = SseScanner::new(16);
    let r = s.feed(b"data: 0123456789\ndata: 0123456789\n", |_| {});
    assert_eq!(r, Err(SseError::EventTooLarge(16)));
}

#[test]
fn write_data_event_round_trips() {
    let mut out = Vec::new();
    write_data_event(b"a\nb", &mut out);
    write_data_event(b"{\"x\":1}", &mut out);
    assert_eq!(out, b"data: a\ndata: b\n\ndata: {\"x\":1}\n\n");
    assert_eq!(data(&collect(&[&out]).0), ["a\nb", "{\"x\":1}"]);
}

#[test]
fn chunk_info_token_and_finish() {
    let i = ChunkInfo::scan(br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#);
    assert!(!i.has_token && i.finish_reason.is_none() && i.usage.is_none() && !i.done);
    let i =
        ChunkInfo::scan(br#"{"choices":[{"delta":{"content":"Hi"},"logprobs":{"content":[]}}]}"#);
    assert!(i.has_token);
    let i = ChunkInfo::scan(br#"{"choices":[{"text": " x", "finish_reason": "length"}]}"#);
    assert!(i.has_token);
    assert_eq!(i.finish_reason, Some("length"));
    let i = ChunkInfo::scan(
        br#"{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\""}}]}}]}"#,
    );
    assert!(i.has_token);
    let i = ChunkInfo::scan(br#"{"choices":[{"delta":{"reasoning_content":"hmm"}}]}"#);
    assert!(i.has_token);
    // A key name inside content text is escaped, so it is not mistaken for a key.
    let i = ChunkInfo::scan(br#"{"choices":[{"delta":{"content":""},"x":"\"usage\":{\"prompt_tokens\":1} \"error\":{}"}]}"#);
    assert!(!i.has_token && i.usage.is_none() && i.error.is_none());
    assert!(ChunkInfo::scan(b" [DONE] ").done);
}

#[test]
fn chunk_info_usage_and_usage_only() {
    let i = ChunkInfo::scan(br#"{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":8}}}"#);
    assert_eq!(
        i.usage,
        Some(Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            total_tokens: 15,
            cached_tokens: Some(8)
        })
    );
    assert!(i.usage_only && !i.has_token);
    // Usage on the last content chunk (SGLang / non-stream bodies): not usage-only.
    let i = ChunkInfo::scan(br#"{"choices":[{"message":{"content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":null}}"#);
    assert_eq!(i.usage.unwrap().cached_tokens, None);
    assert!(!i.usage_only);
    assert_eq!(i.finish_reason, Some("stop"));
}

#[test]
fn chunk_info_error_event() {
    let i = ChunkInfo::scan(br#"{"error":{"object":"error","message":"engine died","type":"InternalServerError","param":null,"code":500}}"#);
    let e = i.error.unwrap();
    assert_eq!((e.status, &*e.message), (500, "engine died"));
    assert!(ChunkInfo::scan(br#"{"choices":[],"error":null}"#)
        .error
        .is_none());
}

proptest! {
    #[test]
    fn any_chunking_gives_same_events(cuts in proptest::collection::vec(0usize..=STREAM.len(), 0..8)) {
        let mut cuts = cuts;
        cuts.sort_unstable();
        let mut chunks: Vec<&[u8]> = Vec::new();
        let mut prev = 0;
        for c in cuts {
            chunks.push(&STREAM[prev..c]);
            prev = c;
        }
        chunks.push(&STREAM[prev..]);
        prop_assert_eq!(collect(&chunks).0, collect(&[STREAM]).0);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300), cut in 0usize..300) {
        let cut = cut.min(bytes.len());
        let mut s = SseScanner::new(128);
        let _ = s.feed(&bytes[..cut], |e| { let _ = ChunkInfo::scan(e.data); });
        let _ = s.feed(&bytes[cut..], |e| { let _ = ChunkInfo::scan(e.data); });
        let _ = ChunkInfo::scan(&bytes);
    }
}
