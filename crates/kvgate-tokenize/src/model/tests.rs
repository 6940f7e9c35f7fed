use super::*;

fn view(body: &str) -> RequestView<'_> {
    RequestView::parse(body.as_bytes()).unwrap()
}

#[test]
fn chat_uses_template_then_encodes() {
    let m = ModelTokenizer::default();
    let v = view(r#"{"model":"m","messages":[{"role":"user","content":"Hello world"}]}"#);
    let text = m.render_chat(&v).unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    );
    let toks = m.encode_prompt(&v).unwrap();
    assert_eq!(toks, PromptTokens::One(m.tokenizer().encode(&text)));
    let v = view(
        r#"{"model":"m","add_generation_prompt":false,"messages":[{"role":"user","content":"x"}]}"#,
    );
    assert_eq!(
        m.render_chat(&v).unwrap(),
        "<|im_start|>user\nx<|im_end|>\n"
    );
}

#[test]
fn prompts_strings_and_token_ids() {
    let m = ModelTokenizer::default();
    let t = m.tokenizer();
    let p = |b| m.encode_prompt(&view(b)).unwrap();
    assert_eq!(
        p(r#"{"model":"m","prompt":"a b"}"#),
        PromptTokens::One(t.encode("a b"))
    );
    assert_eq!(
        p(r#"{"model":"m","prompt":["a","b c"]}"#),
        PromptTokens::Batch(vec![t.encode("a"), t.encode("b c")])
    );
    let ids = p(r#"{"model":"m","prompt":[5,6,7]}"#);
    assert_eq!(ids, PromptTokens::One(vec![5, 6, 7]));
    assert_eq!((ids.first(), ids.total_len()), (&[5, 6, 7][..], 3));
    let b = p(r#"{"model":"m","prompt":[[1,2],[3]]}"#);
    assert_eq!(b.first(), &[1, 2]);
    assert_eq!(b.iter().count(), 2);
    assert_eq!(b.total_len(), 3);
}

#[test]
fn request_errors_keep_their_param() {
    let m = ModelTokenizer::default();
    for (body, param) in [
        (r#"{"model":"m"}"#, "messages"),
        (r#"{"model":"m","prompt":[-1]}"#, "prompt"),
    ] {
        match m.encode_prompt(&view(body)) {
            Err(TokenizeError::Request(e)) => assert_eq!(e.param(), Some(param), "{body}"),
            other => panic!("{body}: {other:?}"),
        }
    }
    // Malformed messages are refused by the view itself, with the same param.
    for body in [
        r#"{"model":"m","messages":[]}"#,
        r#"{"model":"m","messages":[{"content":"x"}]}"#,
    ] {
        let e = RequestView::parse(body.as_bytes()).unwrap_err();
        assert_eq!(e.param(), Some("messages"), "{body}");
    }
}

#[test]
fn shared_prefix_gives_shared_token_prefix() {
    // What KV routing relies on: a longer conversation starts with the shorter one's tokens
    // (minus the generation prompt).
    let m = ModelTokenizer::default();
    let short = view(
        r#"{"model":"m","add_generation_prompt":false,"messages":[{"role":"system","content":"You are a helpful assistant with a long system prompt."},{"role":"user","content":"First question?"}]}"#,
    );
    let long = view(
        r#"{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant with a long system prompt."},{"role":"user","content":"First question?"},{"role":"assistant","content":"Answer."},{"role":"user","content":"Next?"}]}"#,
    );
    let a = m.encode_prompt(&short).unwrap();
    let b = m.encode_prompt(&long).unwrap();
    let n = a.first().len() - 1; // the final piece may merge with what follows
    assert_eq!(&a.first()[..n], &b.first()[..n]);
}

/// The routing path's reused buffers give what `encode_prompt` gives, whatever came before
/// (a longer prompt's leftovers must not leak into a shorter one's ids).
#[test]
fn routing_tokens_match_encode_prompt_with_reused_buffers() {
    let m = ModelTokenizer::default();
    let long = "word ".repeat(2000);
    let bodies = [
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{long}"}}]}}"#),
        r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]}"#.to_string(),
        r#"{"model":"m","prompt":"a b c"}"#.to_string(),
        r#"{"model":"m","prompt":["first one","second"]}"#.to_string(),
        r#"{"model":"m","prompt":[[7,8,9],[1]]}"#.to_string(),
        r#"{"model":"m","add_generation_prompt":false,"messages":[{"role":"user","content":"x"}]}"#.to_string(),
    ];
    let mut scratch = Scratch::default();
    for round in 0..2 {
        for b in &bodies {
            let v = view(b);
            let want = m.encode_prompt(&v).unwrap();
            let got = m.routing_tokens(&v, &mut scratch).unwrap().to_vec();
            assert_eq!(got, want.first(), "round {round}: {b:.60}");
            scratch.trim();
        }
    }
    // Errors are the same too.
    for b in [r#"{"model":"m"}"#, r#"{"model":"m","prompt":[]}"#] {
        let v = view(b);
        assert_eq!(
            m.routing_tokens(&v, &mut scratch).unwrap_err().to_string(),
            m.encode_prompt(&v).unwrap_err().to_string()
        );
    }
}

/// `trim` lets go of what a huge prompt grew, and keeps ordinary buffers.
#[test]
fn scratch_trim_releases_only_huge_buffers() {
    let m = ModelTokenizer::default();
    let mut s = Scratch::default();
    let small = r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;
    m.routing_tokens(&view(small), &mut s).unwrap();
    s.trim();
    assert!(s.text.capacity() > 0 && !s.ids.is_empty());
    let huge = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "abc ".repeat(100_000)
    );
    m.routing_tokens(&view(&huge), &mut s).unwrap();
    s.trim();
    assert_eq!((s.text.capacity(), s.ids.capacity()), (0, 0));
}
