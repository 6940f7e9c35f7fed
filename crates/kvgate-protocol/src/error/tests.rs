use serde_json::{json, Value};

use super::*;

fn body(e: &OpenAiError) -> Value {
    serde_json::from_slice(&e.to_json()).unwrap()
}

#[test]
fn json_shape_has_all_four_keys() {
    let e = OpenAiError::invalid_request("messages is required", Some("messages"));
    assert_eq!(
        body(&e),
        json!({"error":{"message":"messages is required","type":"invalid_request_error","param":"messages","code":null}})
    );
    assert_eq!(e.status, 400);
}

#[test]
fn constructors_have_expected_status_type_code() {
    let cases = [
        (
            OpenAiError::invalid_json("eof"),
            400,
            "invalid_request_error",
            Some("invalid_json"),
        ),
        (
            OpenAiError::authentication("bad key"),
            401,
            "authentication_error",
            Some("invalid_api_key"),
        ),
        (OpenAiError::permission("no"), 403, "permission_error", None),
        (
            OpenAiError::model_not_found("x"),
            404,
            "invalid_request_error",
            Some("model_not_found"),
        ),
        (
            OpenAiError::not_found("/v2"),
            404,
            "not_found_error",
            Some("not_found"),
        ),
        (
            OpenAiError::method_not_allowed("GET", "/v1/chat/completions"),
            405,
            "invalid_request_error",
            Some("method_not_allowed"),
        ),
        (
            OpenAiError::payload_too_large(10),
            413,
            "invalid_request_error",
            Some("request_too_large"),
        ),
        (
            OpenAiError::rate_limited("slow down"),
            429,
            "rate_limit_error",
            Some("rate_limit_exceeded"),
        ),
        (
            OpenAiError::service_unavailable("none"),
            503,
            "server_error",
            Some("service_unavailable"),
        ),
        (
            OpenAiError::upstream("boom"),
            502,
            "server_error",
            Some("upstream_error"),
        ),
        (
            OpenAiError::upstream_timeout("slow"),
            504,
            "server_error",
            Some("upstream_timeout"),
        ),
        (
            OpenAiError::internal("bug"),
            500,
            "server_error",
            Some("internal_error"),
        ),
    ];
    for (e, status, ty, code) in cases {
        assert_eq!(e.status, status, "{e}");
        let b = body(&e);
        assert_eq!(b["error"]["type"], ty);
        assert_eq!(b["error"]["code"].as_str(), code);
        assert!(!b["error"]["message"].as_str().unwrap().is_empty());
    }
    assert_eq!(
        body(&OpenAiError::model_not_found("m\"x"))["error"]["param"],
        "model"
    );
}

#[test]
fn message_escaping_and_sse_event() {
    let e = OpenAiError::upstream("worker said \"no\"\nbye");
    let ev = e.to_sse_event();
    let s = std::str::from_utf8(&ev).unwrap();
    assert!(s.starts_with("data: {\"error\":"));
    assert!(s.ends_with("\n\n"));
    // Exactly one event: the newline in the message is escaped inside the JSON.
    assert_eq!(s.matches('\n').count(), 2);
    let v: Value = serde_json::from_str(&s["data: ".len()..s.len() - 2]).unwrap();
    assert_eq!(v["error"]["message"], "worker said \"no\"\nbye");
}

#[test]
fn normalizes_vllm_flat_error() {
    let b = br#"{"object":"error","message":"max_tokens too large","type":"BadRequestError","param":null,"code":400}"#;
    let e = normalize_worker_error(400, b);
    assert_eq!(e.status, 400);
    assert_eq!(e.message, "max_tokens too large");
    assert_eq!(e.type_, "invalid_request_error");
    assert_eq!(e.code, None);
    assert_eq!(e.param, None);
}

#[test]
fn normalizes_wrapped_vllm_and_llamacpp() {
    let b = br#"{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}"#;
    let e = normalize_worker_error(404, b);
    assert_eq!(
        (e.status, &*e.type_, e.param.as_deref()),
        (404, "not_found_error", Some("model"))
    );

    let b = br#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#;
    let e = normalize_worker_error(503, b);
    assert_eq!(
        (e.status, &*e.type_, &*e.message),
        (503, "server_error", "Loading model")
    );

    let b = br#"{"error":{"code":400,"message":"bad","type":"invalid_request_error"}}"#;
    let e = normalize_worker_error(400, b);
    assert_eq!(&*e.type_, "invalid_request_error");
}

#[test]
fn normalizes_openai_shape_unchanged() {
    let b = br#"{"error":{"message":"slow","type":"rate_limit_error","param":null,"code":"rate_limit_exceeded"}}"#;
    let e = normalize_worker_error(429, b);
    assert_eq!(e, OpenAiError::rate_limited("slow"));
}

#[test]
fn normalizes_tgi_and_text_and_garbage() {
    let e = normalize_worker_error(
        422,
        br#"{"error":"Input validation error","error_type":"validation"}"#,
    );
    assert_eq!(
        (e.status, &*e.type_, &*e.message),
        (422, "invalid_request_error", "Input validation error")
    );

    let e = normalize_worker_error(502, b"<html>Bad Gateway</html>");
    assert_eq!(e.status, 502);
    assert!(e.message.contains("Bad Gateway"));

    let e = normalize_worker_error(500, b"");
    assert_eq!(&*e.message, "upstream returned status 500");

    let e = normalize_worker_error(500, &[0xff, 0xfe, b'{']);
    assert_eq!(e.type_, "server_error");

    let big = vec![b'x'; 100_000];
    assert!(normalize_worker_error(500, &big).message.len() < 1100);
}

#[test]
fn in_stream_error_takes_status_from_int_code() {
    let e = normalize_worker_error(
        200,
        br#"{"error":{"message":"oom","type":"InternalServerError","code":500}}"#,
    );
    assert_eq!((e.status, &*e.type_), (500, "server_error"));
    let e = normalize_worker_error(200, br#"{"error":{"message":"x","code":"weird"}}"#);
    assert_eq!((e.status, e.code.as_deref()), (500, Some("weird")));
}
