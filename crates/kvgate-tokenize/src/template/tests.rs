use super::*;

const MSGS: &str =
    r#"[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi <b>&'"}]"#;

#[test]
fn chatml_fallback_renders_natively() {
    let t = ChatTemplate::chatml();
    assert!(t.is_chatml_fallback());
    assert_eq!(
        t.render(MSGS, true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <b>&'<|im_end|>\n<|im_start|>assistant\n"
    );
    let parts = r#"[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]"#;
    assert_eq!(
        t.render(parts, false).unwrap(),
        "<|im_start|>user\na\nb<|im_end|>\n"
    );
    assert!(t.render("[]", true).is_err());
    assert!(t.render("{", true).is_err());
}

#[test]
fn jinja_chatml_matches_native_chatml() {
    let src = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    let j = ChatTemplate::from_source(src, SpecialTokens::default()).unwrap();
    assert!(!j.is_chatml_fallback());
    for agp in [true, false] {
        assert_eq!(
            j.render(MSGS, agp).unwrap(),
            ChatTemplate::chatml().render(MSGS, agp).unwrap()
        );
    }
    // A string-content template gets list content flattened, like vLLM does.
    let parts =
        r#"[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]"#;
    assert_eq!(
        j.render(parts, false).unwrap(),
        "<|im_start|>user\na\nb<|im_end|>\n"
    );
}

#[test]
fn hf_features_trim_blocks_loop_controls_namespace_methods() {
    let src = "{% set ns = namespace(n=0) %}\n{% for m in messages %}\n{% if loop.index0 > 1 %}{% break %}{% endif %}\n{% set ns.n = ns.n + 1 %}\n[{{ loop.index }}/{{ loop.length }} {{ m.role.upper() }}:{{ m.content.strip().split(' ')[0] }}{{ '|last' if loop.last }}]\n{% endfor %}\n{{ ns.n }} {{ messages[0].get('missing', 'dflt') }} {{ bos_token }}{{ eos_token }}\n";
    let special = SpecialTokens {
        bos_token: Some("<s>".into()),
        eos_token: Some("</s>".into()),
        ..Default::default()
    };
    let t = ChatTemplate::from_source(src, special).unwrap();
    let msgs = r#"[{"role":"user","content":"  one two "},{"role":"assistant","content":"three"},{"role":"user","content":"four"}]"#;
    assert_eq!(
        t.render(msgs, false).unwrap(),
        "[1/3 USER:one]\n[2/3 ASSISTANT:three]\n2 dflt <s></s>"
    );
}

#[test]
fn raise_exception_message_is_reported() {
    let t = ChatTemplate::from_source(
        "{{ raise_exception('roles must alternate') }}",
        SpecialTokens::default(),
    )
    .unwrap();
    let e = t.render(MSGS, true).unwrap_err();
    assert!(e.is_client_error());
    assert_eq!(e.to_string(), "chat template: roles must alternate");
}

#[test]
fn tojson_is_python_style_and_keeps_key_order() {
    let t = ChatTemplate::from_source(
        "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}",
        SpecialTokens::default(),
    )
    .unwrap();
    let tools = r#"[{"type":"function","function":{"name":"f<x>","parameters":{"z":1,"a":[true,null,1.5,2.0]}}}]"#;
    let out = t.render_full("[]", Some(tools), None, false).unwrap();
    let (flat, indented) = out.split_once('|').unwrap();
    assert_eq!(
        flat,
        r#"[{"type": "function", "function": {"name": "f<x>", "parameters": {"z": 1, "a": [true, null, 1.5, 2.0]}}}]"#
    );
    assert_eq!(indented, "{\n  \"type\": \"function\",\n  \"function\": {\n    \"name\": \"f<x>\",\n    \"parameters\": {\n      \"z\": 1,\n      \"a\": [\n        true,\n        null,\n        1.5,\n        2.0\n      ]\n    }\n  }\n}");
}

#[test]
fn tools_and_documents_are_none_unless_given_and_kwargs_pass_through() {
    let t = ChatTemplate::from_source(
        "{{ tools is none }} {{ documents is none }} {{ enable_thinking | default('unset') }}",
        SpecialTokens::default(),
    )
    .unwrap();
    // Python-style booleans, as Jinja2 prints them.
    assert_eq!(t.render(MSGS, true).unwrap(), "True True unset");
    assert_eq!(
        t.render_full(MSGS, Some("[]"), Some(r#"{"enable_thinking":false}"#), true)
            .unwrap(),
        "False True False"
    );
    assert!(t.render_full(MSGS, None, Some("[1]"), true).is_err());
}

#[test]
fn named_templates_pick_tool_use_when_tools_present() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tokenizer_config.json");
    std::fs::write(
        &p,
        r#"{"chat_template":[{"name":"default","template":"D"},{"name":"tool_use","template":"T"},{"name":"rag","template":"R"}],
           "bos_token":{"content":"<s>","lstrip":false},"eos_token":"</s>","pad_token":null}"#,
    )
    .unwrap();
    let t = ChatTemplate::from_tokenizer_config(&p).unwrap();
    assert_eq!(t.render(MSGS, true).unwrap(), "D");
    assert_eq!(t.render_full(MSGS, Some("[]"), None, true).unwrap(), "T");
    assert_eq!(t.special_tokens().bos_token.as_deref(), Some("<s>"));
    assert_eq!(t.special_tokens().pad_token, None);
}

#[test]
fn config_errors_name_the_file_and_problem() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tokenizer_config.json");
    let cases = [
        ("{", "not a tokenizer_config.json object"),
        (r#"{"bos_token":"<s>"}"#, "has no 'chat_template'"),
        (r#"{"chat_template":5}"#, "'chat_template' must be"),
        (r#"{"chat_template":[{"name":"x"}]}"#, "chat_template[0]"),
        (r#"{"chat_template":"{% for %}"}"#, "does not compile"),
        (
            r#"{"chat_template":[{"name":"rag","template":"x"}]}"#,
            "no 'default'",
        ),
        (
            r#"{"chat_template":"x","bos_token":{"lstrip":true}}"#,
            "bos_token",
        ),
    ];
    for (body, want) in cases {
        std::fs::write(&p, body).unwrap();
        let e = ChatTemplate::from_tokenizer_config(&p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer_config.json") && e.contains(want),
            "{body}: {e}"
        );
    }
    let missing = ChatTemplate::from_tokenizer_config(dir.path().join("nope.json"))
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains("nope.json") && missing.contains("cannot read"),
        "{missing}"
    );
    // A chat_template.jinja beside a config without a template is used.
    std::fs::write(&p, r#"{"eos_token":"</s>"}"#).unwrap();
    std::fs::write(dir.path().join("chat_template.jinja"), "J{{ eos_token }}").unwrap();
    assert_eq!(
        ChatTemplate::from_tokenizer_config(&p)
            .unwrap()
            .render(MSGS, true)
            .unwrap(),
        "J</s>"
    );
}

#[test]
fn strftime_subset() {
    // 2024-07-26 13:05:09 UTC was a Friday.
    let t = 1_721_999_109;
    assert_eq!(
        functions::strftime("%d %b %Y %H:%M:%S %A %B %j %-d %%", t),
        "26 Jul 2024 13:05:09 Friday July 208 26 %"
    );
    assert_eq!(functions::strftime("%Y-%m-%d", 0), "1970-01-01");
    let t =
        ChatTemplate::from_source("{{ strftime_now('%Y') }}", SpecialTokens::default()).unwrap();
    let year: i32 = t.render("[]", false).unwrap().parse().unwrap();
    assert!(year >= 2024);
}

#[test]
fn a_message_without_content_reaches_the_template_as_vllm_hands_it() {
    // SmolLM2-style concatenation fails on an undefined content; vLLM passes "" (string format).
    let src = "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '|' }}{% endfor %}";
    let t = ChatTemplate::from_source(src, SpecialTokens::default()).unwrap();
    let calls = r#"[{"role":"user","content":"run it"},
        {"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"run","arguments":"{}"}}]},
        {"role":"assistant","content":null},
        {"role":"tool","tool_call_id":"c1","content":"done"}]"#;
    assert_eq!(
        t.render(calls, false).unwrap(),
        "<user>run it|<assistant>|<assistant>|<tool>done|"
    );
    // The key order vLLM builds: role, content, then tool_calls.
    let keys = ChatTemplate::from_source(
        "{% for m in messages %}{% for k in m %}{{ k }},{% endfor %};{% endfor %}",
        SpecialTokens::default(),
    )
    .unwrap();
    assert_eq!(
        keys.render(calls, false).unwrap(),
        "role,content,;role,content,tool_calls,;role,content,;role,tool_call_id,content,;"
    );
    // A template that walks content parts gets an empty list.
    let parts = ChatTemplate::from_source(
        "{% for m in messages %}{{ m['content'] | length }}{% if m['content'] is string %}s{% endif %},{% endfor %}",
        SpecialTokens::default(),
    )
    .unwrap();
    assert_eq!(parts.render(calls, false).unwrap(), "6s,0,0,4s,");
}

/// vLLM 0.32's chat path drops Claude Code's per-request billing line from system text parts
/// (only there): the Jinja path and the native ChatML path alike, string and list content.
#[test]
fn the_billing_line_is_dropped_from_system_messages_only() {
    let src = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}";
    let j = ChatTemplate::from_source(src, SpecialTokens::default()).unwrap();
    let native = ChatTemplate::chatml();
    let cases = [
        // The header line with more after it: the rest stays.
        (
            r#"[{"role":"system","content":"x-anthropic-billing-header: cc_version=1; cch=abcde;\nYou are terse."},{"role":"user","content":"hi"}]"#,
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
        ),
        // The header alone: the part goes, the message stays (empty).
        (
            r#"[{"role":"system","content":"x-anthropic-billing-header: cch=1;"}]"#,
            "<|im_start|>system\n<|im_end|>\n",
        ),
        // Parts: the header part dropped, the others joined.
        (
            r#"[{"role":"system","content":[{"type":"text","text":"x-anthropic-billing-header: cch=2;"},{"type":"text","text":"A"},{"type":"text","text":"B"}]}]"#,
            "<|im_start|>system\nA\nB<|im_end|>\n",
        ),
        // Not a system message: kept as sent.
        (
            r#"[{"role":"user","content":"x-anthropic-billing-header: cch=3;\nq"}]"#,
            "<|im_start|>user\nx-anthropic-billing-header: cch=3;\nq<|im_end|>\n",
        ),
    ];
    for (msgs, want) in cases {
        assert_eq!(j.render(msgs, false).unwrap(), want, "jinja: {msgs}");
        assert_eq!(native.render(msgs, false).unwrap(), want, "native: {msgs}");
    }
}
