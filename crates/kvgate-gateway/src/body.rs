//! The response body type of every gateway response: a small in-memory body, or a worker's body
//! passed through the [`ObservedBody`](crate::observer::ObservedBody) observer. An enum rather than
//! a boxed trait object, so the hot path does not allocate for it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::observer::ObservedBody;

pub enum GwBody {
    Full(Option<Bytes>),
    /// Boxed: the observer with its worker connection and buffers is ~0.5 KB, moved several times
    /// on its way into hyper.
    Observed(Box<ObservedBody>),
}

/// The error a gateway body can yield: only a non-streamed worker body failing mid-way (the client
/// then sees the connection reset, which is the honest signal for a truncated JSON document).
pub type BodyError = kvgate_http::client::Error;

impl GwBody {
    pub fn full(b: impl Into<Bytes>) -> Self {
        GwBody::Full(Some(b.into()))
    }

    pub fn empty() -> Self {
        GwBody::Full(None)
    }
}

impl Body for GwBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            GwBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            GwBody::Observed(o) => Pin::new(o.as_mut()).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            GwBody::Full(b) => b.is_none(),
            GwBody::Observed(o) => o.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GwBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            GwBody::Full(None) => SizeHint::with_exact(0),
            GwBody::Observed(o) => o.size_hint(),
        }
    }
}

/// The request body the route handlers get: read by hyper (HTTP/2, TLS), or already read whole
/// by kvgate's own HTTP/1.1 server (`kvgate_http::server`), which stops reading at `server.max_body_bytes`.
pub enum ReqBody {
    Hyper(hyper::body::Incoming),
    Full(Option<Bytes>),
    /// The body is larger than `server.max_body_bytes`; it was not read (the connection closes
    /// after the response).
    TooLarge,
}

impl From<kvgate_http::server::RequestBody> for ReqBody {
    fn from(b: kvgate_http::server::RequestBody) -> ReqBody {
        match b {
            kvgate_http::server::RequestBody::Full(b) => ReqBody::Full(b),
            kvgate_http::server::RequestBody::TooLarge => ReqBody::TooLarge,
        }
    }
}

/// What reading a [`ReqBody`] can fail with.
#[derive(Debug)]
pub enum ReqBodyError {
    Hyper(hyper::Error),
    TooLarge,
}

impl std::fmt::Display for ReqBodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReqBodyError::Hyper(e) => e.fmt(f),
            ReqBodyError::TooLarge => f.write_str("request body exceeds server.max_body_bytes"),
        }
    }
}

impl std::error::Error for ReqBodyError {}

impl Body for ReqBody {
    type Data = Bytes;
    type Error = ReqBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReqBodyError>>> {
        match self.get_mut() {
            ReqBody::Hyper(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(ReqBodyError::Hyper))),
            ReqBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ReqBody::TooLarge => Poll::Ready(Some(Err(ReqBodyError::TooLarge))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReqBody::Hyper(b) => b.is_end_stream(),
            ReqBody::Full(b) => b.is_none(),
            ReqBody::TooLarge => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ReqBody::Hyper(b) => b.size_hint(),
            ReqBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ReqBody::Full(None) => SizeHint::with_exact(0),
            ReqBody::TooLarge => SizeHint::default(),
        }
    }
}
