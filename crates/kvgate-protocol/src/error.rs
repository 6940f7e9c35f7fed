//! The OpenAI error JSON shape: `{"error":{"message","type","param","code"}}` (and Anthropic's,
//! [`anthropic_error_json`]).
//!
//! Every error the gateway answers with is written by [`OpenAiError`], as a JSON body or as the
//! SSE event that ends a stream which failed after its first byte, so clients (the official SDKs
//! included) always find `error.message`. Which status, type and code a failure gets is the
//! gateway's business (`GatewayError::into_response`, its one mapping).

use std::borrow::Cow;

use bytes::Bytes;
use serde::Serialize;

/// An OpenAI-shaped error plus the HTTP status it is sent with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiError {
    /// HTTP status code (not part of the JSON body).
    pub status: u16,
    pub message: Cow<'static, str>,
    /// `error.type`, e.g. `invalid_request_error`.
    pub type_: Cow<'static, str>,
    /// The request parameter at fault, e.g. `messages`.
    pub param: Option<Cow<'static, str>>,
    /// A machine-readable code, e.g. `model_not_found`.
    pub code: Option<Cow<'static, str>>,
}

/// Error `type` strings used by kvgate (the ones OpenAI uses where one exists).
pub mod types {
    pub const INVALID_REQUEST: &str = "invalid_request_error";
    pub const AUTHENTICATION: &str = "authentication_error";
    pub const RATE_LIMIT: &str = "rate_limit_error";
    pub const SERVER: &str = "server_error";
}

#[derive(Serialize)]
struct Body<'e> {
    error: Inner<'e>,
}

#[derive(Serialize)]
struct Inner<'e> {
    message: &'e str,
    #[serde(rename = "type")]
    type_: &'e str,
    param: Option<&'e str>,
    code: Option<&'e str>,
}

impl OpenAiError {
    pub fn new(
        status: u16,
        type_: impl Into<Cow<'static, str>>,
        message: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            type_: type_.into(),
            param: None,
            code: None,
        }
    }

    pub fn with_param(mut self, param: impl Into<Cow<'static, str>>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: impl Into<Cow<'static, str>>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// Appends the JSON body to `out`.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        let body = Body {
            error: Inner {
                message: &self.message,
                type_: &self.type_,
                param: self.param.as_deref(),
                code: self.code.as_deref(),
            },
        };
        // Serializing string fields into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, &body);
    }

    /// The JSON body `{"error":{...}}`.
    pub fn to_json(&self) -> Bytes {
        let mut out = Vec::with_capacity(96 + self.message.len());
        self.write_json(&mut out);
        Bytes::from(out)
    }

    /// The error as one SSE event, `data: {"error":{...}}\n\n`, for failures after the first byte.
    pub fn to_sse_event(&self) -> Bytes {
        let mut out = Vec::with_capacity(104 + self.message.len());
        out.extend_from_slice(b"data: ");
        self.write_json(&mut out);
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }
}

/// Anthropic's error body: `{"type":"error","error":{"type":…,"message":…}}`.
pub fn anthropic_error_json(typ: &str, message: &str) -> Bytes {
    #[derive(Serialize)]
    struct Body<'e> {
        #[serde(rename = "type")]
        type_: &'static str,
        error: Inner<'e>,
    }
    #[derive(Serialize)]
    struct Inner<'e> {
        #[serde(rename = "type")]
        type_: &'e str,
        message: &'e str,
    }
    let body = Body {
        type_: "error",
        error: Inner {
            type_: typ,
            message,
        },
    };
    Bytes::from(serde_json::to_vec(&body).expect("strings serialize"))
}

impl std::fmt::Display for OpenAiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.type_, self.message)
    }
}

impl std::error::Error for OpenAiError {}

#[cfg(test)]
mod tests;
