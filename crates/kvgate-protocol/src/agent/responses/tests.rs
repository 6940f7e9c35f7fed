use serde_json::json;

use super::*;
use crate::agent::Content;
use crate::openai::RequestView;

fn conv(body: serde_json::Value) -> AgentRequest {
    parse(body.to_string().as_bytes()).unwrap()
}

fn msgs(r: &AgentRequest) -> serde_json::Value {
    serde_json::to_value(&r.messages).unwrap()
}

#[test]
fn instructions_come_first_and_a_string_input_is_one_user_message() {
    let r = conv(json!({"model": "m", "instructions": "Be brief.", "input": "hi"}));
    assert_eq!(
        msgs(&r),
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    );
    assert!(r.exact);
    // Empty instructions add nothing.
    let r = conv(json!({"model": "m", "instructions": "", "input": "hi"}));
    assert_eq!(msgs(&r), json!([{"role": "user", "content": "hi"}]));
}

#[test]
fn routing_fields_are_read() {
    let r = conv(json!({
        "model": "m", "input": "x", "stream": true, "max_output_tokens": 77,
        "prompt_cache_key": "pck", "previous_response_id": "resp_1", "store": false,
        "background": true, "cache_salt": "salt", "metadata": {"user_id": "u1"}
    }));
    assert_eq!(r.api, AgentApi::Responses);
    assert_eq!(r.model, "m");
    assert!(r.stream && r.background);
    assert_eq!(r.max_output_tokens, Some(77));
    assert_eq!(r.prompt_cache_key.as_deref(), Some("pck"));
    assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
    assert_eq!(r.store, Some(false));
    assert_eq!(r.cache_salt.as_deref(), Some("salt"));
    assert_eq!(r.user_id.as_deref(), Some("u1"));
    // The stored history is not known here.
    assert!(!r.exact);
    assert_eq!(r.approximations, ["previous_response_id"]);
}

#[test]
fn message_items_keep_their_role_and_parts() {
    let r = conv(json!({"model": "m", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "https://x/i.png", "detail": "auto"}
        ]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "seen", "annotations": []}]}
    ]}));
    assert_eq!(
        msgs(&r),
        json!([
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://x/i.png"}}
            ]},
            {"role": "assistant", "content": "seen"}
        ])
    );
    assert!(r.exact);
}

#[test]
fn function_calls_and_outputs_become_tool_calls_and_tool_messages() {
    let r = conv(json!({"model": "m", "input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    ]}));
    assert_eq!(
        msgs(&r),
        json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
        ])
    );
}

#[test]
fn reasoning_items_use_the_single_summary_else_the_single_content() {
    let r = conv(json!({"model": "m", "input": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "S"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [],
         "content": [{"type": "reasoning_text", "text": "C"}]},
        {"type": "reasoning", "id": "rs_3", "summary": [
            {"type": "summary_text", "text": "a"}, {"type": "summary_text", "text": "b"}]}
    ]}));
    assert_eq!(
        msgs(&r),
        json!([
            {"role": "assistant", "reasoning": "S"},
            {"role": "assistant", "reasoning": "C"},
            {"role": "assistant", "reasoning": ""}
        ])
    );
    assert!(r.vllm_rejects.is_none());
}

#[test]
fn encrypted_reasoning_is_what_vllm_rejects() {
    let r = conv(json!({"model": "m", "input": [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}
    ]}));
    assert!(r.vllm_rejects.is_some());
    assert!(!r.exact);
}

#[test]
fn an_mcp_call_after_reasoning_joins_the_reasoning_message() {
    let r = conv(json!({"model": "m", "input": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "id": "mcp_1", "call_id": "c1", "name": "t", "arguments": "{}"},
        {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "t", "arguments": "{}"}
    ]}));
    let m = msgs(&r);
    assert_eq!(m.as_array().unwrap().len(), 2);
    assert_eq!(m[0]["reasoning"], "think");
    assert_eq!(m[0]["tool_calls"][0]["id"], "c1");
    assert_eq!(m[1]["tool_calls"][0]["id"], "c2");
}

#[test]
fn flat_tools_are_nested_and_dropped_with_tool_choice_none() {
    // A raw body: key order inside `parameters` is kept (templates print it with tojson).
    let body = r#"{"model":"m","input":"x","tools":[{"type":"function","name":"f","description":"d","parameters":{"type":"object","properties":{"z":{},"a":{}}}}]"#;
    let r = parse(format!("{body}}}").as_bytes()).unwrap();
    assert_eq!(
        r.tools.as_ref().unwrap()[0].get(),
        r#"{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"z":{},"a":{}}},"strict":null,"type":"function","description":"d"}}"#
    );
    let r = parse(format!(r#"{body},"tool_choice":"none"}}"#).as_bytes()).unwrap();
    assert!(r.tools.is_none());
    assert_eq!(r.tool_choice, Some(json!("none")));
    let named = conv(json!({"model": "m", "input": "x",
        "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": "f"}}));
    assert_eq!(
        named.tool_choice,
        Some(json!({"type": "function", "function": {"name": "f"}}))
    );
}

#[test]
fn reasoning_effort_becomes_a_template_variable() {
    let r = conv(
        json!({"model": "m", "input": "x", "reasoning": {"effort": "low"},
        "chat_template_kwargs": {"enable_thinking": true}}),
    );
    let kw = r.chat_template_kwargs.unwrap();
    assert_eq!(kw["reasoning_effort"], "low");
    assert_eq!(kw["enable_thinking"], true);
}

#[test]
fn unrenderable_shapes_are_approximated_not_refused() {
    let r = conv(json!({"model": "m", "input": [
        {"role": "user", "content": [
            {"type": "input_text", "text": "t"},
            {"type": "input_file", "file_id": "file_1"}
        ]},
        {"type": "item_reference", "id": "msg_0"}
    ], "tools": [{"type": "web_search"}]}));
    assert!(!r.exact);
    assert_eq!(
        r.approximations,
        [
            "input_file",
            "input item without a chat form",
            "non-function tool"
        ]
    );
    assert_eq!(r.messages.len(), 1);
    assert_eq!(
        r.messages[0].content,
        Some(Content::Parts(vec![crate::agent::Part::Text {
            text: "t".into()
        }]))
    );
}

#[test]
fn bad_bodies_are_client_errors_with_a_param() {
    for (body, param) in [
        (r#"{"input":"x"}"#, Some("model")),
        (r#"{"model":"m"}"#, Some("input")),
        (
            r#"{"model":"m","input":[{"role":"wizard","content":"x"}]}"#,
            Some("input"),
        ),
        (
            r#"{"model":"m","input":[{"type":"function_call","name":"f"}]}"#,
            Some("input"),
        ),
        (r#"{"model":"m","input":7}"#, Some("input")),
        (
            r#"{"model":"m","input":"x","stream":"yes"}"#,
            Some("stream"),
        ),
        (
            r#"{"model":"m","input":"x","tools":[{"type":"function"}]}"#,
            Some("tools"),
        ),
        (r#"[1]"#, None),
        (r#"{"model":"#, None),
    ] {
        let e = parse(body.as_bytes()).unwrap_err();
        assert_eq!(e.param(), param, "{body}: {e}");
    }
}

#[test]
fn the_chat_body_is_a_chat_request_the_view_parses() {
    let r = conv(json!({"model": "m", "instructions": "sys", "input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "out"}
    ], "tools": [{"type": "function", "name": "f"}], "cache_salt": "s", "max_output_tokens": 5}));
    let body = r.chat_body();
    let view = RequestView::parse(body.as_bytes()).unwrap();
    assert_eq!(view.model, "m");
    assert_eq!(view.messages.as_ref().unwrap().len(), 4);
    assert_eq!(view.cache_salt.as_deref(), Some("s"));
    assert!(view.tools.is_some());
    assert_eq!(view.max_output_tokens(), Some(5));
    assert!(!view.stream);
}
