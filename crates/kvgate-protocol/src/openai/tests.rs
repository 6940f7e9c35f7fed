use std::borrow::Cow;

use proptest::prelude::*;

use super::*;

fn parse(s: &str) -> Result<RequestView<'_>, RequestError> {
    RequestView::parse(s.as_bytes())
}

#[test]
fn chat_fields_are_read_and_borrowed() {
    let body = r#"{"model":"llama-3","messages":[{"role":"user","content":"hi"}],"stream":true,
        "stream_options":{"include_usage":true},"max_tokens":12,"max_completion_tokens":34,
        "cache_salt":"s1","prompt_cache_key":"k1","unknown":{"deep":[1,2,{"x":null}]},"seed":7}"#;
    let v = parse(body).unwrap();
    assert!(matches!(v.model, Cow::Borrowed("llama-3")));
    assert!(v.stream);
    assert!(v.include_usage);
    assert_eq!(v.max_tokens, Some(12));
    assert_eq!(v.max_completion_tokens, Some(34));
    assert_eq!(v.max_output_tokens(), Some(34));
    assert_eq!(v.cache_salt.as_deref(), Some("s1"));
    assert_eq!(v.prompt_cache_key.as_deref(), Some("k1"));
    assert_eq!(
        v.messages_raw().unwrap().get(),
        r#"[{"role":"user","content":"hi"}]"#
    );
    assert!(v.prompt.is_none());
    assert!(
        v.tools.is_none() && v.add_generation_prompt.is_none() && v.chat_template_kwargs.is_none()
    );
    let msgs = v.messages().unwrap();
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0].role, "user");
    assert_eq!(msgs[0].content.as_ref().unwrap().text(), "hi");
}

#[test]
fn template_fields() {
    let v = parse(
        r#"{"model":"m","tools":[{"type":"function"}],"add_generation_prompt":false,
        "chat_template_kwargs":{"enable_thinking":false}}"#,
    )
    .unwrap();
    assert_eq!(v.tools.unwrap().get(), r#"[{"type":"function"}]"#);
    assert_eq!(v.add_generation_prompt, Some(false));
    assert_eq!(
        v.chat_template_kwargs.unwrap().get(),
        r#"{"enable_thinking":false}"#
    );
    let e = parse(r#"{"model":"m","add_generation_prompt":1}"#).unwrap_err();
    assert_eq!(e.param(), Some("add_generation_prompt"));
}

#[test]
fn defaults_and_nulls() {
    let v = parse(
        r#"{"model":"m","stream":null,"max_tokens":null,"stream_options":null,"prompt":null}"#,
    )
    .unwrap();
    assert!(!v.stream);
    assert!(!v.include_usage);
    assert!(v.stream_options.is_none());
    assert_eq!(v.max_output_tokens(), None);
    assert!(v.prompt.is_none());
    assert_eq!(
        v.prompt_input().unwrap_err(),
        RequestError::Missing("prompt")
    );
    assert_eq!(v.messages().unwrap_err().param(), Some("messages"));
}

#[test]
fn escaped_model_name_is_unescaped() {
    let v = parse(r#"{"model":"org\/llama \"x\" \u00e9"}"#).unwrap();
    assert_eq!(v.model, "org/llama \"x\" é");
    assert!(matches!(v.model, Cow::Owned(_)));
}

#[test]
fn last_duplicate_wins_like_python() {
    let v = parse(r#"{"model":"a","model":"b","stream":true,"stream":false}"#).unwrap();
    assert_eq!(v.model, "b");
    assert!(!v.stream);
}

#[test]
fn errors_name_the_param() {
    assert_eq!(
        parse(r#"{"messages":[]}"#).unwrap_err(),
        RequestError::Missing("model")
    );
    assert_eq!(
        parse(r#"{"model":null}"#).unwrap_err(),
        RequestError::Missing("model")
    );
    for (body, param) in [
        (r#"{"model":1}"#, "model"),
        (r#"{"model":"m","stream":"yes"}"#, "stream"),
        (r#"{"model":"m","max_tokens":-1}"#, "max_tokens"),
        (r#"{"model":"m","max_tokens":1e40}"#, "max_tokens"),
        (
            r#"{"model":"m","max_tokens":99999999999999999999999999}"#,
            "max_tokens",
        ),
        (
            r#"{"model":"m","max_completion_tokens":1.5}"#,
            "max_completion_tokens",
        ),
        (r#"{"model":"m","stream_options":[true]}"#, "stream_options"),
        (
            r#"{"model":"m","stream_options":{"include_usage":"y"}}"#,
            "stream_options",
        ),
        (r#"{"model":"m","cache_salt":5}"#, "cache_salt"),
        (r#"{"model":"m","prompt_cache_key":{}}"#, "prompt_cache_key"),
    ] {
        let e = parse(body).unwrap_err();
        assert_eq!(e.param(), Some(param), "{body}: {e}");
        assert!(matches!(e, RequestError::Invalid { .. }), "{body}: {e:?}");
        assert!(!e.to_string().contains(" at line "), "{e}");
    }
}

#[test]
fn malformed_and_non_object_bodies() {
    for body in [
        "",
        "  ",
        "{",
        r#"{"model":"m""#,
        r#"{"model":"m"} x"#,
        "nul",
        r#"{"model":"m",}"#,
    ] {
        let e = parse(body).unwrap_err();
        assert!(matches!(e, RequestError::Json(_)), "{body:?}: {e:?}");
        assert_eq!(e.param(), None);
    }
    for body in ["[]", "1", "\"model\"", "null", " [ {\"model\":\"m\"} ]"] {
        assert_eq!(
            parse(body).unwrap_err(),
            RequestError::NotObject,
            "{body:?}"
        );
    }
    // Invalid UTF-8 is a JSON error, not a panic, wherever it is (JSON text is UTF-8).
    for body in [
        &b"{\"model\":\"\xff\"}"[..],
        b"{\"model\":\"m\",\"unknown\":\"\xc3\"}",
        b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xe2\x82\"}]}",
    ] {
        let e = RequestView::parse(body).unwrap_err();
        assert!(
            matches!(&e, RequestError::Json(m) if m.starts_with("invalid UTF-8 at byte")),
            "{e:?}"
        );
    }
}

#[test]
fn prompt_shapes() {
    let p = |s: &str| {
        let body = format!(r#"{{"model":"m","prompt":{s}}}"#);
        let v = RequestView::parse(body.as_bytes()).unwrap();
        v.prompt_input().map(|p| format!("{p:?}"))
    };
    assert_eq!(p(r#""hello""#).unwrap(), r#"Text("hello")"#);
    assert_eq!(p(r#"["a","b\n"]"#).unwrap(), r#"Texts(["a", "b\n"])"#);
    assert_eq!(
        p("[1, 2, 4294967295]").unwrap(),
        "Tokens([1, 2, 4294967295])"
    );
    assert_eq!(p("[[1],[2,3]]").unwrap(), "TokenBatches([[1], [2, 3]])");
    for bad in [
        "[]",
        "[[]]",
        "[1,\"a\"]",
        "[\"a\",1]",
        "[[1],2]",
        "[4294967296]",
        "[-1]",
        "[1.5]",
        "[[1,-2]]",
        "[[1,1e3]]",
        "{}",
        "true",
        "3",
        "[null]",
        "[[\"a\"]]",
    ] {
        let e = p(bad).unwrap_err();
        assert_eq!(e.param(), Some("prompt"), "{bad}: {e}");
    }
}

#[test]
fn prompt_text_borrows() {
    let v = parse(r#"{"model":"m","prompt":["x","y"]}"#).unwrap();
    match v.prompt_input().unwrap() {
        PromptInput::Texts(t) => assert!(t.iter().all(|s| matches!(s, Cow::Borrowed(_)))),
        other => panic!("{other:?}"),
    }
}

#[test]
fn messages_content_shapes() {
    let body = r#"{"model":"m","messages":[
        {"role":"system","content":"be brief"},
        {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"b"}]},
        {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"1","content":"42"}]}"#;
    let v = parse(body).unwrap();
    let m = v.messages().unwrap();
    assert_eq!(m.len(), 4);
    assert_eq!(m[1].content.as_ref().unwrap().text(), "a\nb");
    match m[1].content.as_ref().unwrap() {
        MessageContent::Parts(p) => {
            assert_eq!(p.len(), 3);
            assert_eq!(p[1].kind, "image_url");
            assert_eq!(p[1].text, None);
        }
        MessageContent::Text(_) => panic!("expected parts"),
    }
    assert!(m[2].content.is_none());
    assert_eq!(m[2].role, "assistant");
    assert_eq!(m[3].role, "tool");
}

#[test]
fn bad_messages_are_rejected_with_param() {
    for bad in [
        "[]",
        "{}",
        "\"hi\"",
        "[1]",
        r#"[{"content":"x"}]"#,
        r#"[{"role":3,"content":"x"}]"#,
        r#"[{"role":"user","content":5}]"#,
        r#"[{"role":"user","content":[{"text":"x"}]}]"#,
        r#"[{"role":"user","content":[{"type":"text"}]}]"#,
        r#"[{"role":"user","content":["x"]}]"#,
    ] {
        let body = format!(r#"{{"model":"m","messages":{bad}}}"#);
        let e = RequestView::parse(body.as_bytes()).unwrap_err();
        assert_eq!(e.param(), Some("messages"), "{bad}: {e}");
        // Where messages mean nothing they are skipped, whatever they hold.
        let v = RequestView::parse_without_messages(body.as_bytes()).unwrap();
        assert!(v.messages.is_none());
    }
}

#[test]
fn splice_adds_include_usage() {
    let body = br#"{"model":"m","stream":true,"x":[1]}"#;
    let v = RequestView::parse(body).unwrap();
    let out = splice_include_usage(body, &v).unwrap();
    let again = RequestView::parse(&out).unwrap();
    assert!(again.include_usage);
    assert_eq!(again.model, "m");
    // Everything else is byte-identical.
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"x":[1]}"#
    );
}

#[test]
fn splice_keeps_existing_stream_options_keys() {
    let body = br#" {"model":"m","stream_options":{"include_usage":false,"include_obfuscation":false},"z":0}"#;
    let v = RequestView::parse(body).unwrap();
    let out = splice_include_usage(body, &v).unwrap();
    let val: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(val["stream_options"]["include_usage"], true);
    assert_eq!(val["stream_options"]["include_obfuscation"], false);
    assert_eq!(val["z"], 0);

    let already = br#"{"model":"m","stream_options":{"include_usage":true}}"#;
    assert!(splice_include_usage(already, &RequestView::parse(already).unwrap()).is_none());
}

#[test]
fn splice_into_minimal_object() {
    // `model` is required, so the smallest valid body still has a field; make sure no stray comma.
    let body = br#"{"model":"m"}"#;
    let out = splice_include_usage(body, &RequestView::parse(body).unwrap()).unwrap();
    assert!(RequestView::parse(&out).unwrap().include_usage);
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(v) = RequestView::parse(&bytes) {
            let _ = v.prompt_input();
            let _ = v.messages();
            let _ = splice_include_usage(&bytes, &v);
        }
    }

    #[test]
    fn any_model_string_round_trips(model in ".{0,40}", extra in "[a-z]{1,8}") {
        let body = serde_json::json!({ extra.clone(): [1, {"a": null}], "model": model, "messages": [{"role": "user"}] });
        let bytes = serde_json::to_vec(&body).unwrap();
        let v = RequestView::parse(&bytes).unwrap();
        prop_assert_eq!(&*v.model, model.as_str());
    }

    #[test]
    fn splice_preserves_everything_else(model in "[ -~]{0,20}", n in 0u32..5, stream in any::<bool>()) {
        let body = serde_json::to_vec(&serde_json::json!({
            "model": model, "n": n, "stream": stream, "extra": {"k": [n]}
        })).unwrap();
        let v = RequestView::parse(&body).unwrap();
        let out = splice_include_usage(&body, &v).unwrap();
        let mut a: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let b: serde_json::Value = serde_json::from_slice(&out).unwrap();
        a["stream_options"] = serde_json::json!({"include_usage": true});
        prop_assert_eq!(a, b);
    }
}

#[test]
fn bad_messages_say_where() {
    for (bad, want) in [
        ("[]", "must contain at least one message"),
        ("{}", "expected an array of message objects"),
        ("\"hi\"", "expected an array of message objects"),
        ("[1]", "messages[0] must be an object"),
        (
            r#"[{"role":"user","content":"a"},[]]"#,
            "messages[1] must be an object",
        ),
        (r#"[{"content":"x"}]"#, "messages[0].role is required"),
        (
            r#"[{"role":3,"content":"x"}]"#,
            "messages[0]: invalid type: integer `3`, expected a string",
        ),
        (
            r#"[{"role":"user","content":5}]"#,
            "messages[0].content: expected a string or an array of content parts",
        ),
        (
            r#"[{"role":"user","content":[{"text":"x"}]}]"#,
            "messages[0].content: part 0: 'type' is required",
        ),
        (
            r#"[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text"}]}]"#,
            "messages[0].content: part 1: text parts need 'text'",
        ),
        (
            r#"[{"role":"user","content":["x"]}]"#,
            "messages[0].content: part 0 must be an object",
        ),
    ] {
        let body = format!(r#"{{"model":"m","messages":{bad}}}"#);
        let e = RequestView::parse(body.as_bytes()).unwrap_err().to_string();
        assert!(e.ends_with(want), "{bad}: {e}");
        assert!(!e.contains(" at line "), "{bad}: {e}");
    }
}

#[test]
fn raw_messages_are_found_again_for_templates() {
    let raw = r#"[ {"role":"user","content":"a \"q\"","tool_calls":[{"id":"x"}]} ,{"role":"tool","name":"f","content":null}]"#;
    let body = format!(r#"{{"messages":{raw} , "model":"m","messages_x":[1]}}"#);
    let v = RequestView::parse(body.as_bytes()).unwrap();
    assert_eq!(v.messages_raw().unwrap().get(), raw);
    assert_eq!(v.messages().unwrap().len(), 2);
    assert_eq!(v.messages().unwrap()[1].role, "tool");
    assert!(v.messages().unwrap()[1].content.is_none());
    // The last of duplicate fields, as parsed.
    let body = r#"{"model":"m","messages":[{"role":"a"}],"messages":[{"role":"b"}]}"#;
    let v = RequestView::parse(body.as_bytes()).unwrap();
    assert_eq!(v.messages().unwrap()[0].role, "b");
    assert_eq!(v.messages_raw().unwrap().get(), r#"[{"role":"b"}]"#);
    // Absent or null: missing either way.
    for body in [r#"{"model":"m"}"#, r#"{"model":"m","messages":null}"#] {
        let v = RequestView::parse(body.as_bytes()).unwrap();
        assert_eq!(v.messages().unwrap_err(), RequestError::Missing("messages"));
        assert_eq!(
            v.messages_raw().unwrap_err(),
            RequestError::Missing("messages")
        );
    }
    // Skipped messages are not parsed, but a template could still find them.
    let v =
        RequestView::parse_without_messages(br#"{"model":"m","messages":[{"role":"u"}]}"#).unwrap();
    assert!(v.messages.is_none());
    assert_eq!(v.messages_raw().unwrap().get(), r#"[{"role":"u"}]"#);
}

#[test]
fn message_strings_borrow_unless_escaped() {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"plain"},{"role":"user","content":"tab\tquote\"","name":"x","extra":{"a":[1,2]}}]}"#;
    let v = RequestView::parse(body.as_bytes()).unwrap();
    let m = v.messages().unwrap();
    match (&m[0].content, &m[1].content) {
        (Some(MessageContent::Text(a)), Some(MessageContent::Text(b))) => {
            assert!(matches!(a, Cow::Borrowed("plain")));
            assert_eq!(b, "tab\tquote\"");
        }
        other => panic!("{other:?}"),
    }
}
