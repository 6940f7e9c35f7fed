//! The one error type of the request path and the one function that turns it into an HTTP response.
//!
//! Every failure records which side caused it (client, upstream worker, the gateway itself) and
//! whether trying another worker is safe. `GatewayError::into_response` is the only place where a
//! failure becomes a status code + OpenAI error JSON (written by kvgate-protocol's `OpenAiError`),
//! so status and shape cannot drift apart.

use std::borrow::Cow;
use std::time::Duration;

use http::{header, HeaderValue, Response, StatusCode};
use kvgate_protocol::error::{types, OpenAiError};

use crate::body::GwBody;
use crate::client_api::ErrorShape;
use crate::metrics::ErrorLabel;

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
    /// Flow control shed the request: sheddable while saturated, or its place given to a higher
    /// class (429).
    Shed,
    /// Flow control: the TTFT objective cannot be met and the class rejects misses (429).
    ObjectiveUnreachable,
    /// TCP connect to the worker failed (retry-safe).
    UpstreamConnect,
    /// The worker connection failed after the request was sent, before response headers.
    UpstreamIo,
    /// No response headers within `upstream.response_timeout_s` / `request_timeout_s`, or (streams)
    /// no first body byte within `upstream.stream_first_byte_timeout_s` (504, retry-safe).
    UpstreamTimeout,
    /// The gateway is shutting down (503).
    ShuttingDown,
    /// `server.max_connections` are open: the connection is answered and closed (503).
    TooManyConnections,
    /// A Responses id that kvgate did not see stored, or whose origin worker is gone: the
    /// backend's own 404, with `x-should-retry: false` (`param` names the field that carried it).
    ResponseNotFound { param: Option<&'static str> },
}

impl From<crate::route::Refusal> for GatewayError {
    fn from(r: crate::route::Refusal) -> Self {
        use crate::route::Refusal;
        match r {
            Refusal::NoWorker(msg) => GatewayError::new(ErrorKind::NoWorker, msg),
            Refusal::QueueFull => GatewayError::new(
                ErrorKind::QueueFull,
                "all workers are busy and the queue is full; retry later",
            ),
            Refusal::QueueTimeout => GatewayError::new(
                ErrorKind::QueueTimeout,
                "all workers stayed busy; retry later",
            ),
            Refusal::ShuttingDown => GatewayError::new(
                ErrorKind::ShuttingDown,
                "the gateway is shutting down; retry on another replica",
            ),
            Refusal::Shed => GatewayError::new(
                ErrorKind::Shed,
                "the fleet is saturated and this request's priority class is shed; retry later",
            ),
            Refusal::ObjectiveUnreachable => GatewayError::new(
                ErrorKind::ObjectiveUnreachable,
                "the request's time-to-first-token objective cannot be met now; retry later",
            ),
        }
    }
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
            | ModelNotFound
            | ResponseNotFound { .. } => Side::Client,
            UpstreamConnect | UpstreamIo | UpstreamTimeout => Side::Upstream,
            NoWorker | QueueFull | QueueTimeout | Shed | ObjectiveUnreachable | ShuttingDown
            | TooManyConnections => Side::Internal,
        }
    }

    /// Whether another worker may be tried. Only failures that happened before the worker sent a
    /// byte to the client qualify; the request path never calls this after the first byte. (A
    /// worker's own 429/5xx answer is a response, not a `GatewayError`: `proxy.rs` retries it.)
    pub fn retry_safe(&self) -> bool {
        use ErrorKind::*;
        matches!(self.kind, UpstreamConnect | UpstreamIo | UpstreamTimeout)
    }

    /// Bounded label for `kvgate_errors_total{kind}`.
    pub fn label(&self) -> ErrorLabel {
        use ErrorKind::*;
        match self.kind {
            Unauthorized => ErrorLabel::Unauthorized,
            RateLimited { .. } => ErrorLabel::RateLimited,
            NotFound => ErrorLabel::NotFound,
            MethodNotAllowed => ErrorLabel::MethodNotAllowed,
            PayloadTooLarge { .. } => ErrorLabel::PayloadTooLarge,
            HeadersTooLarge => ErrorLabel::HeadersTooLarge,
            RequestTimeout => ErrorLabel::RequestTimeout,
            BadRequest { .. } => ErrorLabel::BadRequest,
            ModelNotFound => ErrorLabel::ModelNotFound,
            NoWorker => ErrorLabel::NoWorker,
            QueueFull => ErrorLabel::QueueFull,
            QueueTimeout => ErrorLabel::QueueTimeout,
            Shed => ErrorLabel::Shed,
            ObjectiveUnreachable => ErrorLabel::ObjectiveUnreachable,
            UpstreamConnect => ErrorLabel::UpstreamConnect,
            UpstreamIo => ErrorLabel::UpstreamIo,
            UpstreamTimeout => ErrorLabel::UpstreamTimeout,
            ShuttingDown => ErrorLabel::ShuttingDown,
            TooManyConnections => ErrorLabel::TooManyConnections,
            ResponseNotFound { .. } => ErrorLabel::ResponseNotFound,
        }
    }

    /// HTTP status, OpenAI `type`, `code` and `Retry-After` for this failure.
    fn wire(&self) -> (StatusCode, &'static str, Option<&'static str>, Option<u64>) {
        use ErrorKind::*;
        match &self.kind {
            Unauthorized => (
                StatusCode::UNAUTHORIZED,
                types::AUTHENTICATION,
                Some("invalid_api_key"),
                None,
            ),
            RateLimited { retry_after } => (
                StatusCode::TOO_MANY_REQUESTS,
                types::RATE_LIMIT,
                Some("rate_limit_exceeded"),
                Some(retry_after.as_secs_f64().ceil().max(1.0) as u64),
            ),
            NotFound => (
                StatusCode::NOT_FOUND,
                types::INVALID_REQUEST,
                Some("not_found"),
                None,
            ),
            MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                types::INVALID_REQUEST,
                Some("method_not_allowed"),
                None,
            ),
            PayloadTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                types::INVALID_REQUEST,
                Some("payload_too_large"),
                None,
            ),
            HeadersTooLarge => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                types::INVALID_REQUEST,
                Some("request_header_fields_too_large"),
                None,
            ),
            BadRequest { .. } => (StatusCode::BAD_REQUEST, types::INVALID_REQUEST, None, None),
            RequestTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                types::INVALID_REQUEST,
                Some("request_timeout"),
                None,
            ),
            ModelNotFound => (
                StatusCode::NOT_FOUND,
                types::INVALID_REQUEST,
                Some("model_not_found"),
                None,
            ),
            NoWorker => (
                StatusCode::SERVICE_UNAVAILABLE,
                types::SERVER,
                Some("no_worker_available"),
                Some(1),
            ),
            QueueFull => (
                StatusCode::TOO_MANY_REQUESTS,
                types::RATE_LIMIT,
                Some("gateway_overloaded"),
                Some(1),
            ),
            Shed => (
                StatusCode::TOO_MANY_REQUESTS,
                types::RATE_LIMIT,
                Some("request_shed"),
                Some(1),
            ),
            ObjectiveUnreachable => (
                StatusCode::TOO_MANY_REQUESTS,
                types::RATE_LIMIT,
                Some("objective_unreachable"),
                Some(1),
            ),
            QueueTimeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                types::SERVER,
                Some("queue_timeout"),
                Some(1),
            ),
            UpstreamConnect | UpstreamIo => (
                StatusCode::BAD_GATEWAY,
                types::SERVER,
                Some("upstream_unavailable"),
                None,
            ),
            UpstreamTimeout => (
                StatusCode::GATEWAY_TIMEOUT,
                types::SERVER,
                Some("upstream_timeout"),
                None,
            ),
            ShuttingDown => (
                StatusCode::SERVICE_UNAVAILABLE,
                types::SERVER,
                Some("shutting_down"),
                Some(1),
            ),
            TooManyConnections => (
                StatusCode::SERVICE_UNAVAILABLE,
                types::SERVER,
                Some("too_many_connections"),
                Some(1),
            ),
            // What vLLM and OpenAI answer for an unknown id (no code).
            ResponseNotFound { .. } => (StatusCode::NOT_FOUND, types::INVALID_REQUEST, None, None),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.wire().0
    }

    /// The `Retry-After` seconds of this failure, if it has one.
    pub fn retry_after(&self) -> Option<u64> {
        self.wire().3
    }

    /// The OpenAI error JSON of this failure (the body of [`Self::into_response`]).
    pub fn json(&self) -> bytes::Bytes {
        let (_, typ, code, _) = self.wire();
        let param = match self.kind {
            ErrorKind::BadRequest { param } | ErrorKind::ResponseNotFound { param } => param,
            ErrorKind::ModelNotFound => Some("model"),
            _ => None,
        };
        OpenAiError {
            status: self.status().as_u16(),
            message: Cow::Owned(self.message.clone()),
            type_: Cow::Borrowed(typ),
            param: param.map(Cow::Borrowed),
            code: code.map(Cow::Borrowed),
        }
        .to_json()
    }

    /// The one mapping from a failure to an HTTP response (status + OpenAI error JSON).
    pub fn into_response(self) -> Response<GwBody> {
        self.into_response_for(ErrorShape::OpenAi)
    }

    /// Anthropic's status and `error.type` for this failure: requests shed for load (flow
    /// control's sheds included) get 529 `overloaded_error` (the SDKs retry it), the rest the
    /// type of their status.
    fn anthropic(&self) -> (StatusCode, &'static str) {
        use ErrorKind::*;
        let status = match self.kind {
            QueueFull | QueueTimeout | NoWorker | ShuttingDown | TooManyConnections | Shed
            | ObjectiveUnreachable => {
                return (
                    StatusCode::from_u16(529).expect("529 is a valid status"),
                    "overloaded_error",
                )
            }
            _ => self.status(),
        };
        let typ = match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            504 => "timeout_error",
            s if s >= 500 => "api_error",
            _ => "invalid_request_error",
        };
        (status, typ)
    }

    /// The error body in `shape` (Anthropic: `{"type":"error","error":{"type","message"}}`).
    pub fn json_for(&self, shape: ErrorShape) -> bytes::Bytes {
        match shape {
            ErrorShape::OpenAi | ErrorShape::Responses => self.json(),
            ErrorShape::Anthropic => {
                kvgate_protocol::error::anthropic_error_json(self.anthropic().1, &self.message)
            }
        }
    }

    /// The status a client of an API in `shape` gets (Anthropic: 529 for sheds).
    pub fn status_for(&self, shape: ErrorShape) -> StatusCode {
        match shape {
            ErrorShape::Anthropic => self.anthropic().0,
            _ => self.status(),
        }
    }

    /// [`Self::into_response`] in the error shape of the request's API.
    pub fn into_response_for(self, shape: ErrorShape) -> Response<GwBody> {
        let (_, _, _, retry_after) = self.wire();
        let status = self.status_for(shape);
        let no_retry = matches!(self.kind, ErrorKind::ResponseNotFound { .. });
        let body = self.json_for(shape);
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
        if no_retry {
            // Final: the SDKs (and proxies that honour it) must not try this id elsewhere.
            h.insert("x-should-retry", HeaderValue::from_static("false"));
        }
        resp
    }
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.label().as_str(), self.message)
    }
}

impl std::error::Error for GatewayError {}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_json(r: Response<GwBody>) -> serde_json::Value {
        use http_body_util::BodyExt;
        let b = r.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&b).unwrap()
    }

    #[tokio::test]
    async fn statuses_and_shape() {
        let cases = [
            (
                ErrorKind::Unauthorized,
                401,
                "authentication_error",
                Some("invalid_api_key"),
            ),
            (
                ErrorKind::MethodNotAllowed,
                405,
                "invalid_request_error",
                Some("method_not_allowed"),
            ),
            (
                ErrorKind::PayloadTooLarge { limit: 1 },
                413,
                "invalid_request_error",
                Some("payload_too_large"),
            ),
            (
                ErrorKind::BadRequest {
                    param: Some("messages"),
                },
                400,
                "invalid_request_error",
                None,
            ),
            (
                ErrorKind::ModelNotFound,
                404,
                "invalid_request_error",
                Some("model_not_found"),
            ),
            (
                ErrorKind::NoWorker,
                503,
                "server_error",
                Some("no_worker_available"),
            ),
            (
                ErrorKind::QueueFull,
                429,
                "rate_limit_error",
                Some("gateway_overloaded"),
            ),
            (
                ErrorKind::UpstreamTimeout,
                504,
                "server_error",
                Some("upstream_timeout"),
            ),
        ];
        for (kind, code, typ, err_code) in cases {
            let e = GatewayError::new(kind.clone(), "m \"quoted\"");
            assert_eq!(e.status().as_u16(), code, "{e}");
            let r = e.into_response();
            assert_eq!(r.status().as_u16(), code);
            let j = body_json(r).await;
            assert_eq!(j["error"]["message"], "m \"quoted\"", "{kind:?}");
            assert_eq!(j["error"]["type"], typ, "{kind:?}");
            assert_eq!(j["error"]["code"].as_str(), err_code, "{kind:?}");
            let param = match kind {
                ErrorKind::BadRequest { param } => param,
                ErrorKind::ModelNotFound => Some("model"),
                _ => None,
            };
            assert_eq!(j["error"]["param"].as_str(), param, "{kind:?}");
        }
    }

    #[tokio::test]
    async fn anthropic_shape_and_overload() {
        let r = GatewayError::new(ErrorKind::QueueFull, "busy")
            .into_response_for(ErrorShape::Anthropic);
        assert_eq!(r.status().as_u16(), 529);
        assert!(r.headers().contains_key(header::RETRY_AFTER));
        let j = body_json(r).await;
        assert_eq!(j["type"], "error");
        assert_eq!(j["error"]["type"], "overloaded_error");
        assert_eq!(j["error"]["message"], "busy");
        // Flow control's sheds are load sheds too.
        for kind in [ErrorKind::Shed, ErrorKind::ObjectiveUnreachable] {
            let name = format!("{kind:?}");
            let r = GatewayError::new(kind, "shed").into_response_for(ErrorShape::Anthropic);
            assert_eq!(r.status().as_u16(), 529, "{name}");
            assert_eq!(body_json(r).await["error"]["type"], "overloaded_error");
        }
        let r = GatewayError::new(
            ErrorKind::BadRequest {
                param: Some("messages"),
            },
            "bad",
        )
        .into_response_for(ErrorShape::Anthropic);
        assert_eq!(r.status().as_u16(), 400);
        assert_eq!(body_json(r).await["error"]["type"], "invalid_request_error");
        // OpenAI APIs keep 429 for the same refusal.
        let r = GatewayError::new(ErrorKind::QueueFull, "busy")
            .into_response_for(ErrorShape::Responses);
        assert_eq!(r.status().as_u16(), 429);
    }

    #[tokio::test]
    async fn unknown_response_ids_are_404_without_retry() {
        let r = GatewayError::new(
            ErrorKind::ResponseNotFound {
                param: Some("previous_response_id"),
            },
            "Response with id 'resp_x' not found.",
        )
        .into_response_for(ErrorShape::Responses);
        assert_eq!(r.status().as_u16(), 404);
        assert_eq!(r.headers()["x-should-retry"], "false");
        let j = body_json(r).await;
        assert_eq!(j["error"]["type"], "invalid_request_error");
        assert_eq!(j["error"]["param"], "previous_response_id");
    }

    #[test]
    fn retry_safety() {
        let e = |k| GatewayError::new(k, "");
        assert!(e(ErrorKind::UpstreamConnect).retry_safe());
        assert!(e(ErrorKind::UpstreamIo).retry_safe());
        assert!(e(ErrorKind::UpstreamTimeout).retry_safe());
        assert!(!e(ErrorKind::NoWorker).retry_safe());
        assert!(!e(ErrorKind::BadRequest { param: None }).retry_safe());
        assert_eq!(
            e(ErrorKind::BadRequest { param: None }).side(),
            Side::Client
        );
    }
}
