//! Worker error bodies → [`OpenAiError`].
//!
//! Shapes seen in the field:
//! - OpenAI / llama.cpp: `{"error":{"message","type","param"?,"code"}}` (llama.cpp's `code` is an int).
//! - vLLM / SGLang: `{"object":"error","message","type":"BadRequestError","param":null,"code":400}`,
//!   newer vLLM wraps the same object in `"error"`.
//! - TGI: `{"error":"text","error_type":"validation"}`.
//! - Anything else (HTML from a proxy, plain text): the text becomes the message.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

use super::{types, OpenAiError};

/// Longest message kept from a worker body (a worker can send megabytes of HTML).
const MAX_MESSAGE: usize = 1024;

/// Normalizes a worker's error response (`status` is the worker's HTTP status; for an error event
/// inside a 200 stream pass 200 and the status is taken from the body's int `code`, else 500).
pub fn normalize_worker_error(status: u16, body: &[u8]) -> OpenAiError {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let obj = match parsed {
        Some(Value::Object(mut top)) => match top.remove("error") {
            Some(Value::Object(inner)) => Some(inner),
            Some(Value::String(text)) => {
                let mut m = serde_json::Map::new();
                m.insert("message".into(), Value::String(text));
                if let Some(t) = top.remove("error_type") {
                    m.insert("type".into(), t);
                }
                Some(m)
            }
            Some(_) | None => Some(top),
        },
        _ => None,
    };
    let Some(obj) = obj else {
        return from_text(status, body);
    };
    let fields = Fields::deserialize(Value::Object(obj)).unwrap_or_default();
    let int_code = match &fields.code {
        Some(Value::Number(n)) => n.as_u64().and_then(|c| u16::try_from(c).ok()),
        _ => None,
    };
    let status = effective_status(status, int_code);
    let message = match fields.message {
        Some(Value::String(s)) if !s.is_empty() => truncate(s),
        Some(v @ (Value::Array(_) | Value::Object(_))) => truncate(v.to_string()),
        _ => format!("upstream returned status {status}"),
    };
    let type_: Cow<'static, str> = match fields.type_.as_deref() {
        Some(t) if is_openai_type(t) => Cow::Owned(t.to_owned()),
        _ => Cow::Borrowed(type_for_status(status)),
    };
    let code = match fields.code {
        Some(Value::String(s)) if !s.is_empty() => Some(Cow::Owned(s)),
        _ => None,
    };
    let param = match fields.param {
        Some(Value::String(s)) if !s.is_empty() => Some(Cow::Owned(s)),
        _ => None,
    };
    OpenAiError {
        status,
        message: Cow::Owned(message),
        type_,
        param,
        code,
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Fields {
    message: Option<Value>,
    #[serde(rename = "type", deserialize_with = "lenient_string")]
    type_: Option<String>,
    param: Option<Value>,
    code: Option<Value>,
}

fn lenient_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::String(s) => Some(s),
        _ => None,
    })
}

fn from_text(status: u16, body: &[u8]) -> OpenAiError {
    let status = effective_status(status, None);
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    let message = if text.is_empty() {
        format!("upstream returned status {status}")
    } else {
        truncate(format!("upstream returned status {status}: {text}"))
    };
    OpenAiError::new(status, type_for_status(status), message)
}

fn effective_status(status: u16, int_code: Option<u16>) -> u16 {
    if (400..=599).contains(&status) {
        return status;
    }
    match int_code {
        Some(c) if (400..=599).contains(&c) => c,
        _ => 500,
    }
}

fn is_openai_type(t: &str) -> bool {
    matches!(
        t,
        types::INVALID_REQUEST
            | types::AUTHENTICATION
            | types::PERMISSION
            | types::NOT_FOUND
            | types::RATE_LIMIT
            | types::SERVER
    )
}

fn type_for_status(status: u16) -> &'static str {
    match status {
        401 => types::AUTHENTICATION,
        403 => types::PERMISSION,
        404 => types::NOT_FOUND,
        429 => types::RATE_LIMIT,
        400..=499 => types::INVALID_REQUEST,
        _ => types::SERVER,
    }
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}
