//! A streaming answer fed straight from a request's engine events, for the APIs whose events are
//! a translation of the engine's (Responses, Messages): the [`Translate`] impl turns each
//! [`ReqEvent`] into SSE frames. As with the chat stream (`sse.rs`), dropping the body (client gone)
//! drops the channel, which the scheduler notices and aborts the request, freeing its blocks.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderValue, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::sync::mpsc;

use super::Body;
use crate::worker::ReqEvent;

/// One API's view of the engine events.
pub trait Translate: Send + Unpin + 'static {
    /// Frames for one event; `Ok(true)` once the answer is complete.
    fn on_event(&mut self, ev: ReqEvent, out: &mut Frames) -> std::io::Result<bool>;
    /// The worker stopped before the request finished (the status is already sent).
    fn on_closed(&mut self, out: &mut Frames);
}

/// Frames waiting to be written.
#[derive(Default)]
pub struct Frames(VecDeque<Bytes>);

impl Frames {
    /// `event: <name>\ndata: <json>\n\n` (the framing both APIs use; clients dispatch on `event:`).
    pub fn event(&mut self, name: &str, data: &Value) {
        let mut s = Vec::with_capacity(256);
        s.extend_from_slice(b"event: ");
        s.extend_from_slice(name.as_bytes());
        s.extend_from_slice(b"\ndata: ");
        let _ = serde_json::to_writer(&mut s, data);
        s.extend_from_slice(b"\n\n");
        self.0.push_back(Bytes::from(s));
    }

    pub fn pop(&mut self) -> Option<Bytes> {
        self.0.pop_front()
    }
}

pub struct EventStream<T> {
    t: T,
    rx: mpsc::UnboundedReceiver<ReqEvent>,
    out: Frames,
    finished: bool,
}

impl<T: Translate> EventStream<T> {
    /// A `text/event-stream` response; `first` are frames sent before any engine event.
    pub fn response(t: T, rx: mpsc::UnboundedReceiver<ReqEvent>, first: Frames) -> Response<Body> {
        sse_response(
            EventStream {
                t,
                rx,
                out: first,
                finished: false,
            }
            .boxed_unsync(),
        )
    }
}

/// A `text/event-stream` response around `body`.
pub fn sse_response(body: Body) -> Response<Body> {
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

impl<T: Translate> http_body::Body for EventStream<T> {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.out.pop() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(ev)) => match this.t.on_event(ev, &mut this.out) {
                    Ok(done) => this.finished = done,
                    Err(e) => return Poll::Ready(Some(Err(e))),
                },
                Poll::Ready(None) => {
                    this.t.on_closed(&mut this.out);
                    this.finished = true;
                }
            }
        }
    }
}

/// A body of the frames sent on `rx`, ending when every sender is gone.
pub fn channel_body(rx: mpsc::UnboundedReceiver<Bytes>) -> Body {
    ChannelBody(rx).boxed_unsync()
}

struct ChannelBody(mpsc::UnboundedReceiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.get_mut()
            .0
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}
