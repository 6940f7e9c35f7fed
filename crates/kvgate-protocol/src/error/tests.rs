use serde_json::{json, Value};

use super::*;

fn body(e: &OpenAiError) -> Value {
    serde_json::from_slice(&e.to_json()).unwrap()
}

#[test]
fn json_shape_has_all_four_keys() {
    let e = OpenAiError::new(400, types::INVALID_REQUEST, "messages is required")
        .with_param("messages");
    assert_eq!(
        body(&e),
        json!({"error":{"message":"messages is required","type":"invalid_request_error","param":"messages","code":null}})
    );
    let e = OpenAiError::new(429, types::RATE_LIMIT, "slow down").with_code("rate_limit_exceeded");
    assert_eq!(
        body(&e),
        json!({"error":{"message":"slow down","type":"rate_limit_error","param":null,"code":"rate_limit_exceeded"}})
    );
    assert_eq!(e.status, 429);
    assert_eq!(e.to_string(), "429 rate_limit_error: slow down");
}

#[test]
fn message_escaping_and_sse_event() {
    let e = OpenAiError::new(502, types::SERVER, "worker said \"no\"\nbye");
    let ev = e.to_sse_event();
    let s = std::str::from_utf8(&ev).unwrap();
    assert!(s.starts_with("data: {\"error\":"));
    assert!(s.ends_with("\n\n"));
    // Exactly one event: the newline in the message is escaped inside the JSON.
    assert_eq!(s.matches('\n').count(), 2);
    let v: Value = serde_json::from_str(&s["data: ".len()..s.len() - 2]).unwrap();
    assert_eq!(v["error"]["message"], "worker said \"no\"\nbye");
    // The event reads back as an error with the scanner everyone uses.
    assert!(crate::sse::ChunkInfo::scan(&ev["data: ".len()..]).error);
}
