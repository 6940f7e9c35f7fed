//! The one error type of the request path and the one function that turns it into an HTTP response.
//!
//! Every failure records which side caused it (client, upstream worker, the gateway itself) and
//! whether trying another worker is safe. `GatewayError::into_response` is the only place where a
//! failure becomes a status code + OpenAI error JSON, so status and shape cannot drift apart.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::body::GwBody;

/// Which side of the proxy failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Upstream,
    Internal,
}

/// Failure kinds: each one is a bounded `kind` label on `kvgate_errors_total`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// Missing or wrong API key (401).
    Unauthorized,
    /// Per-key rate limit exceeded (429).
    RateLimited { retry_after: Duration },
    /// Unknown route (404).
    NotFound,
    /// Known route, wrong method (405).
    MethodNotAllowed,
    /// Body larger than `server.max_body_bytes` (413).
    PayloadTooLarge { limit: usize },
    /// Request head over `server.max_header_bytes` or 100 fields (431).
    HeadersTooLarge,
    /// Request body not received within `server.body_read_timeout_s` (408).
    RequestTimeout,
    /// Body not valid JSON or missing a routing field (400).
    BadRequest { param: Option<&'static str> },
    /// No pool serves the requested model (404).
    ModelNotFound,
    /// The model exists but no worker of its pool is routable (503).
    NoWorker,
    /// Every worker busy and the admission queue full (429).
    QueueFull,
    /// Waited in the admission queue past `admission.queue_timeout` (503).
    QueueTimeout,
    /// TCP connect to the worker failed (retry-safe).
    UpstreamConnect,
    /// The worker answered 429/5xx before any byte reached the client (retry-safe).
    UpstreamStatus(StatusCode),
    /// The worker connection failed after the request was sent, before response headers.
    UpstreamIo,
    /// No response headers within `upstream.response_timeout_s` / `request_timeout_s`, or (streams)
    /// no first body byte within `upstream.stream_first_byte_timeout_s` (504, retry-safe).
    UpstreamTimeout,
    /// The gateway is shutting down.
    ShuttingDown,
}

/// A request-path failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    pub kind: ErrorKind,
    pub message: String,
}

impl GatewayError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        GatewayError {
            kind,
            message: message.into(),
        }
    }

    pub fn side(&self) -> Side {
        use ErrorKind::*;
        match self.kind {
            Unauthorized
            | RateLimited { .. }
            | NotFound
            | MethodNotAllowed
            | PayloadTooLarge { .. }
            | HeadersTooLarge
            | RequestTimeout
            | BadRequest { .. }
            | ModelNotFound => Side::Client,
            UpstreamConnect | UpstreamStatus(_) | UpstreamIo | UpstreamTimeout => Side::Upstream,
            NoWorker | QueueFull | QueueTimeout | ShuttingDown => Side::Internal,
        }
    }

    /// Whether another worker may be tried. Only failures that happened before the worker sent a
    /// byte to the client qualify; the request path never calls this after the first byte.
    pub fn retry_safe(&self) -> bool {
        use ErrorKind::*;
        match self.kind {
            UpstreamConnect | UpstreamIo | UpstreamTimeout => true,
            UpstreamStatus(s) => s == StatusCode::TOO_MANY_REQUESTS || s.is_server_error(),
            _ => false,
        }
    }

    /// Bounded label for `kvgate_errors_total{kind}`.
    pub fn label(&self) -> &'static str {
        use ErrorKind::*;
        match self.kind {
            Unauthorized => "unauthorized",
            RateLimited { .. } => "rate_limited",
            NotFound => "not_found",
            MethodNotAllowed => "method_not_allowed",
            PayloadTooLarge { .. } => "payload_too_large",
            HeadersTooLarge => "headers_too_large",
            RequestTimeout => "request_timeout",
            BadRequest { .. } => "bad_request",
            ModelNotFound => "model_not_found",
            NoWorker => "no_worker",
            QueueFull => "queue_full",
            QueueTimeout => "queue_timeout",
            UpstreamConnect => "upstream_connect",
            UpstreamStatus(_) => "upstream_status",
            UpstreamIo => "upstream_io",
            UpstreamTimeout => "upstream_timeout",
            ShuttingDown => "shutting_down",
        }
    }

    /// HTTP status, OpenAI `type`, `code` and `Retry-After` for this failure.
    fn wire(&self) -> (StatusCode, &'static str, Option<&'static str>, Option<u64>) {
        use ErrorKind::*;
        match &self.kind {
            Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                Some("invalid_api_key"),
                None,
            ),
            RateLimited { retry_after } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("rate_limit_exceeded"),
                Some(retry_after.as_secs_f64().ceil().max(1.0) as u64),
            ),
            NotFound => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("not_found"),
                None,
            ),
            MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                Some("method_not_allowed"),
                None,
            ),
            PayloadTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                Some("payload_too_large"),
                None,
            ),
            HeadersTooLarge => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "invalid_request_error",
                Some("request_header_fields_too_large"),
                None,
            ),
            BadRequest { .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", None, None),
            RequestTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                Some("request_timeout"),
                None,
            ),
            ModelNotFound => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
                None,
            ),
            NoWorker => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("no_worker_available"),
                Some(1),
            ),
            QueueFull => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("gateway_overloaded"),
                Some(1),
            ),
            QueueTimeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("queue_timeout"),
                Some(1),
            ),
            UpstreamConnect | UpstreamIo => (
                StatusCode::BAD_GATEWAY,
                "server_error",
                Some("upstream_unavailable"),
                None,
            ),
            UpstreamTimeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                Some("upstream_timeout"),
                None,
            ),
            // Retries exhausted on 429/5xx: pass the worker's class on (429 stays 429, 5xx → 502).
            UpstreamStatus(s) if *s == StatusCode::TOO_MANY_REQUESTS => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("upstream_overloaded"),
                Some(1),
            ),
            UpstreamStatus(_) => (
                StatusCode::BAD_GATEWAY,
                "server_error",
                Some("upstream_error"),
                Some(1),
            ),
            ShuttingDown => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("shutting_down"),
                Some(1),
            ),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.wire().0
    }

    /// The OpenAI error JSON of this failure (the body of [`Self::into_response`]).
    pub fn json(&self) -> Bytes {
        let (_, typ, code, _) = self.wire();
        let param = match self.kind {
            ErrorKind::BadRequest { param } => param,
            ErrorKind::ModelNotFound => Some("model"),
            _ => None,
        };
        error_json(&self.message, typ, param, code)
    }

    /// The one mapping from a failure to an HTTP response (status + OpenAI error JSON).
    pub fn into_response(self) -> Response<GwBody> {
        let (status, _, _, retry_after) = self.wire();
        let body = self.json();
        let mut resp = Response::new(GwBody::full(body));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = retry_after {
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if status == StatusCode::UNAUTHORIZED {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.label(), self.message)
    }
}

impl std::error::Error for GatewayError {}

/// `{"error":{"message","type","param","code"}}` as bytes.
pub fn error_json(message: &str, typ: &str, param: Option<&str>, code: Option<&str>) -> Bytes {
    let v = serde_json::json!({
        "error": { "message": message, "type": typ, "param": param, "code": code }
    });
    Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
}

/// The SSE event that ends a stream whose worker failed after the first byte.
pub fn sse_error_event(message: &str) -> Bytes {
    let json = error_json(message, "server_error", None, Some("upstream_stream_error"));
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&json);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_shape() {
        let cases = [
            (ErrorKind::Unauthorized, 401),
            (ErrorKind::MethodNotAllowed, 405),
            (ErrorKind::PayloadTooLarge { limit: 1 }, 413),
            (ErrorKind::BadRequest { param: None }, 400),
            (ErrorKind::ModelNotFound, 404),
            (ErrorKind::NoWorker, 503),
            (ErrorKind::QueueFull, 429),
            (
                ErrorKind::UpstreamStatus(StatusCode::SERVICE_UNAVAILABLE),
                502,
            ),
        ];
        for (kind, code) in cases {
            let e = GatewayError::new(kind, "m");
            assert_eq!(e.status().as_u16(), code, "{e}");
        }
        let j: serde_json::Value =
            serde_json::from_slice(&error_json("boom", "server_error", None, Some("x"))).unwrap();
        assert_eq!(j["error"]["message"], "boom");
        assert!(j["error"]["param"].is_null());
        assert_eq!(j["error"]["code"], "x");
    }

    #[test]
    fn retry_safety() {
        let e = |k| GatewayError::new(k, "");
        assert!(e(ErrorKind::UpstreamConnect).retry_safe());
        assert!(e(ErrorKind::UpstreamStatus(StatusCode::SERVICE_UNAVAILABLE)).retry_safe());
        assert!(e(ErrorKind::UpstreamStatus(StatusCode::TOO_MANY_REQUESTS)).retry_safe());
        assert!(!e(ErrorKind::UpstreamStatus(StatusCode::BAD_REQUEST)).retry_safe());
        assert!(!e(ErrorKind::BadRequest { param: None }).retry_safe());
        assert_eq!(
            e(ErrorKind::BadRequest { param: None }).side(),
            Side::Client
        );
    }

    #[test]
    fn sse_event_is_one_data_line() {
        let ev = sse_error_event("worker died");
        assert!(ev.starts_with(b"data: {\"error\":"));
        assert!(ev.ends_with(b"\n\n"));
    }
}
