//! The OpenAI error JSON shape: `{"error":{"message","type","param","code"}}`.
//!
//! Every error the gateway answers with goes through [`OpenAiError`], so clients (the official SDKs
//! included) always find `error.message`. `normalize` turns the differing shapes workers send
//! (vLLM's int `code` and `"BadRequestError"` types, llama.cpp, SGLang, TGI's `{"error": "text"}`)
//! into the same shape.

mod normalize;

use std::borrow::Cow;

use bytes::Bytes;
use serde::Serialize;

pub use normalize::normalize_worker_error;

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
    pub const PERMISSION: &str = "permission_error";
    pub const NOT_FOUND: &str = "not_found_error";
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

    /// 400 `invalid_request_error`; `param` names the offending field when known.
    pub fn invalid_request(
        message: impl Into<Cow<'static, str>>,
        param: Option<&'static str>,
    ) -> Self {
        let e = Self::new(400, types::INVALID_REQUEST, message);
        match param {
            Some(p) => e.with_param(p),
            None => e,
        }
    }

    /// 400 for a body that is not JSON (`detail` is the parser's message).
    pub fn invalid_json(detail: impl std::fmt::Display) -> Self {
        Self::new(
            400,
            types::INVALID_REQUEST,
            format!("We could not parse the JSON body of your request: {detail}"),
        )
        .with_code("invalid_json")
    }

    /// 401: missing or wrong API key.
    pub fn authentication(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(401, types::AUTHENTICATION, message).with_code("invalid_api_key")
    }

    /// 403: the key is valid but not allowed to do this.
    pub fn permission(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(403, types::PERMISSION, message)
    }

    /// 404 for a model no routable worker serves.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            404,
            types::INVALID_REQUEST,
            format!("The model `{model}` does not exist or no available worker serves it."),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// 404 for an unknown path.
    pub fn not_found(path: &str) -> Self {
        Self::new(404, types::NOT_FOUND, format!("Unknown path: {path}")).with_code("not_found")
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            405,
            types::INVALID_REQUEST,
            format!("Method {method} is not allowed for {path}."),
        )
        .with_code("method_not_allowed")
    }

    /// 413: request body over the configured limit.
    pub fn payload_too_large(limit_bytes: u64) -> Self {
        Self::new(
            413,
            types::INVALID_REQUEST,
            format!("Request body is larger than the limit of {limit_bytes} bytes."),
        )
        .with_code("request_too_large")
    }

    /// 429: a per-key rate limit or the admission queue is full.
    pub fn rate_limited(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(429, types::RATE_LIMIT, message).with_code("rate_limit_exceeded")
    }

    /// 503: no routable worker (send with `Retry-After`).
    pub fn service_unavailable(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(503, types::SERVER, message).with_code("service_unavailable")
    }

    /// 502: the worker failed (connect error, broken response, error after retries).
    pub fn upstream(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(502, types::SERVER, message).with_code("upstream_error")
    }

    /// 504: the worker did not answer in time.
    pub fn upstream_timeout(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(504, types::SERVER, message).with_code("upstream_timeout")
    }

    /// 500: a bug or an unexpected state inside kvgate.
    pub fn internal(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(500, types::SERVER, message).with_code("internal_error")
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
        serde_json::to_writer(&mut *out, &body).expect("serializing strings to a Vec never fails");
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

impl std::fmt::Display for OpenAiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.type_, self.message)
    }
}

impl std::error::Error for OpenAiError {}

#[cfg(test)]
mod tests;
