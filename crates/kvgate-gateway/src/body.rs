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
pub type BodyError = crate::upstream::Error;

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
