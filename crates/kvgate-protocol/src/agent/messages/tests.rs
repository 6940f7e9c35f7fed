use serde_json::json;

use super::*;
use crate::openai::RequestView;

fn conv(body: serde_json::Value) -> AgentRequest {
    parse(body.to_string().as_bytes()).unwrap()
}

fn msgs(r: &AgentRequest) -> serde_json::Value {
    serde_json::to_value(&r.messages).unwrap()
}

#[test]
fn routing_fields_are_read() {
    let r = conv(json!({"model": "claude", "max_tokens": 64, "stream": true,
        "metadata": {"user_id": "u"}, "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(r.api, AgentApi::Messages);
    assert_eq!(r.model, "claude");
    assert_eq!(r.max_output_tokens, Some(64));
    assert!(r.stream);
    assert_eq!(r.user_id.as_deref(), Some("u"));
    assert_eq!(msgs(&r), json!([{"role": "user", "content": "hi"}]));
    assert!(r.exact);
}

#[test]
fn system_blocks_are_concatenated_and_the_billing_header_dropped() {
    let body = |cch: &str| {
        json!({"model": "m", "max_tokens": 8, "system": [
            {"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.1.90.abc; cc_entrypoint=cli; cch={cch};")},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Be careful."}
        ], "messages": [{"role": "user", "content": "hi"}]})
    };
    let a = conv(body("a1b2c"));
    let b = conv(body("ffff0"));
    assert_eq!(
        msgs(&a)[0],
        json!({"role": "system", "content": "You are Claude Code. Be careful."})
    );
    // The per-request hash no longer changes the rendered prompt.
    assert_eq!(a.chat_body(), b.chat_body());
    assert!(a.exact);
    // A string system is kept as is.
    let s = conv(json!({"model": "m", "max_tokens": 8, "system": "plain",
        "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(msgs(&s)[0], json!({"role": "system", "content": "plain"}));
}

#[test]
fn leading_system_messages_join_the_system_prompt() {
    let r = conv(
        json!({"model": "m", "max_tokens": 8, "system": "top", "messages": [
            {"role": "system", "content": "more"},
            {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}]},
            {"role": "user", "content": "hi"}
        ]}),
    );
    assert_eq!(
        msgs(&r),
        json!([{"role": "system", "content": "top\n\nmore"}, {"role": "user", "content": "hi"}])
    );
    assert!(r.exact);
}

#[test]
fn inline_system_messages_are_kept_outside_tool_runs_and_flagged() {
    let r = conv(json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
        {"role": "system", "content": "note"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a b"}]}
    ]}));
    let m = msgs(&r);
    assert_eq!(m[1]["tool_calls"][0]["id"], "t1");
    assert_eq!(
        m[2],
        json!({"role": "tool", "content": "a b", "tool_call_id": "t1"})
    );
    assert_eq!(m[3], json!({"role": "system", "content": "note"}));
    assert!(!r.exact);
    assert_eq!(r.approximations, ["inline system message"]);
}

#[test]
fn content_blocks_convert_like_vllm() {
    let r = conv(json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "only"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm ", "signature": "sig"},
            {"type": "thinking", "thinking": "ok", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "read",
             "input": {"flags": [true, null], "n": 1.0, "path": "/tmp/é"}}
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "line1"}, {"type": "text", "text": "line2"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}}
            ]},
            {"type": "text", "text": "thanks"},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
        ]}
    ]}));
    assert_eq!(
        msgs(&r),
        json!([
            {"role": "user", "content": "only"},
            {"role": "assistant", "content": "Let me look.", "reasoning": "hmm ok",
             "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "read",
                "arguments": "{\"flags\": [true, null], \"n\": 1.0, \"path\": \"/tmp/\\u00e9\"}"}}]},
            {"role": "tool", "content": "line1\nline2", "tool_call_id": "toolu_1"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "thanks"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
            ]}
        ])
    );
    assert!(r.exact, "{:?}", r.approximations);
}

#[test]
fn tool_result_only_turns_leave_no_empty_user_message() {
    let r = conv(json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": "b"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "odd"}]}
    ]}));
    let m = msgs(&r);
    assert_eq!(m.as_array().unwrap().len(), 4);
    assert_eq!(
        m[1]["tool_calls"][0]["function"]["arguments"],
        "{\"a\": \"b\"}"
    );
    assert_eq!(m[2]["role"], "tool");
    assert_eq!(
        m[3],
        json!({"role": "assistant", "content": "Tool result: odd"})
    );
}

#[test]
fn tool_use_input_keeps_the_clients_key_order() {
    let r = parse(br#"{"model":"m","max_tokens":8,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{"z":1,"a":{"y":2,"b":3}}}]}]}"#).unwrap();
    assert_eq!(
        r.messages[0].tool_calls.as_ref().unwrap()[0]
            .function
            .arguments,
        r#"{"z": 1, "a": {"y": 2, "b": 3}}"#
    );
}

#[test]
fn tools_and_tool_choice_map_to_chat() {
    let r = parse(br#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"x"}],"tools":[{"name":"f","input_schema":{"type":"object","properties":{"b":{},"a":{}}}}]}"#).unwrap();
    assert_eq!(
        r.tools.as_ref().unwrap()[0].get(),
        r#"{"type":"function","function":{"name":"f","description":null,"parameters":{"type":"object","properties":{"b":{},"a":{}}}}}"#
    );
    assert_eq!(r.tool_choice, Some(json!("auto")));
    for (choice, want) in [
        (json!({"type": "auto"}), json!("auto")),
        (json!({"type": "any"}), json!("required")),
        (json!({"type": "none"}), json!("none")),
        (
            json!({"type": "tool", "name": "f"}),
            json!({"type": "function", "function": {"name": "f"}}),
        ),
    ] {
        let r = conv(json!({"model": "m", "max_tokens": 8, "tool_choice": choice,
            "messages": [{"role": "user", "content": "x"}]}));
        assert_eq!(r.tool_choice, Some(want));
    }
}

#[test]
fn unknown_blocks_are_approximated_not_refused() {
    let r = conv(json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "d"}},
            {"type": "text", "text": "q"}
        ]}
    ]}));
    assert!(!r.exact);
    assert_eq!(msgs(&r), json!([{"role": "user", "content": "q"}]));
}

#[test]
fn count_tokens_needs_no_max_tokens_but_create_does() {
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(parse(body).unwrap_err().param(), Some("max_tokens"));
    assert!(parse_count_tokens(body).is_ok());
}

#[test]
fn bad_bodies_are_client_errors_with_a_param() {
    for (body, param) in [
        (
            r#"{"max_tokens":1,"messages":[{"role":"user","content":"x"}]}"#,
            Some("model"),
        ),
        (r#"{"model":"m","max_tokens":1}"#, Some("messages")),
        (
            r#"{"model":"m","max_tokens":1,"messages":[]}"#,
            Some("messages"),
        ),
        (
            r#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[]}]}"#,
            Some("messages"),
        ),
        (
            r#"{"model":"m","max_tokens":1,"messages":[{"role":"bot","content":"x"}]}"#,
            Some("messages"),
        ),
        (
            r#"{"model":"m","max_tokens":1,"messages":[{"role":"user"}]}"#,
            Some("messages"),
        ),
        (
            r#"{"model":"m","max_tokens":"1","messages":[{"role":"user","content":"x"}]}"#,
            Some("max_tokens"),
        ),
        (
            r#"{"model":"m","max_tokens":1,"system":5,"messages":[{"role":"user","content":"x"}]}"#,
            Some("system"),
        ),
        (
            r#"{"model":"m","max_tokens":1,"tool_choice":{"type":"tool"},"messages":[{"role":"user","content":"x"}]}"#,
            Some("tool_choice"),
        ),
        ("not json", None),
    ] {
        let e = parse(body.as_bytes()).unwrap_err();
        assert_eq!(e.param(), param, "{body}: {e}");
    }
}

#[test]
fn claude_code_sessions_are_found_in_user_id() {
    assert_eq!(
        session_of_user_id(r#"{"device_id":"d","account_uuid":"a","session_id":"s-1"}"#).as_deref(),
        Some("s-1")
    );
    assert_eq!(
        session_of_user_id("user_abc_account_0f_session_1234-5678").as_deref(),
        Some("1234-5678")
    );
    assert_eq!(session_of_user_id("plain-user"), None);
}

#[test]
fn the_chat_body_parses_as_chat() {
    let r = conv(
        json!({"model": "m", "max_tokens": 9, "system": "s", "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}]}),
    );
    let body = r.chat_body();
    let view = RequestView::parse(body.as_bytes()).unwrap();
    assert_eq!(view.messages.as_ref().unwrap().len(), 4);
    assert_eq!(view.max_output_tokens(), Some(9));
}

#[test]
fn the_billing_line_is_stripped_as_vllm_strips_it() {
    use super::strip_billing_line;
    assert_eq!(strip_billing_line("You are terse."), Some("You are terse."));
    assert_eq!(
        strip_billing_line("x-anthropic-billing-header: cch=1;"),
        None
    );
    assert_eq!(
        strip_billing_line("x-anthropic-billing-header: cch=1;\n"),
        None
    );
    assert_eq!(
        strip_billing_line("x-anthropic-billing-header: cch=1;\nrest\nmore"),
        Some("rest\nmore")
    );
    // Only at the start.
    assert_eq!(
        strip_billing_line(" x-anthropic-billing-header: cch=1;\nrest"),
        Some(" x-anthropic-billing-header: cch=1;\nrest")
    );
}
