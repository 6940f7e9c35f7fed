//! Streaming answer: an `http_body::Body` fed straight from the request's event channel, so no task
//! sits between the scheduler and the socket. Dropping the body (client gone) closes the channel,
//! which the scheduler notices and aborts the request, freeing its blocks.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderValue, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::completions::Meta;
use super::Body;
use crate::worker::ReqEvent;

pub struct SseBody {
    meta: Meta,
    rx: mpsc::UnboundedReceiver<ReqEvent>,
    pending: VecDeque<Bytes>,
    completion: usize,
    cached: Vec<usize>,
    done: usize,
    finished: bool,
}

impl SseBody {
    pub fn response(meta: Meta, rx: mpsc::UnboundedReceiver<ReqEvent>) -> Response<Body> {
        let k = meta.choices();
        let body = SseBody {
            meta,
            rx,
            pending: VecDeque::new(),
            completion: 0,
            cached: vec![0; k],
            done: 0,
            finished: false,
        };
        let mut r = Response::new(body.boxed_unsync());
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    }

    fn push(&mut self, v: &Value) {
        let mut s = Vec::with_capacity(256);
        s.extend_from_slice(b"data: ");
        let _ = serde_json::to_writer(&mut s, v);
        s.extend_from_slice(b"\n\n");
        self.pending.push_back(Bytes::from(s));
    }

    fn chunk(&self, choice: Value) -> Value {
        let mut c = json!({
            "id": self.meta.id,
            "object": if self.meta.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [choice],
        });
        if self.meta.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn on_event(&mut self, ev: ReqEvent) -> Result<(), std::io::Error> {
        match ev {
            ReqEvent::Started { idx, cached_tokens } => {
                self.cached[idx as usize] = cached_tokens;
                if self.meta.chat {
                    let c = self.chunk(
                        json!({"index": idx, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": null, "finish_reason": null}),
                    );
                    self.push(&c);
                }
            }
            ReqEvent::Token { idx, token } => {
                self.completion += 1;
                let text = self.meta.tokenizer.decode(&[token]);
                let choice = if self.meta.chat {
                    json!({"index": idx, "delta": {"content": text}, "logprobs": null, "finish_reason": null})
                } else {
                    json!({"index": idx, "text": text, "logprobs": null, "finish_reason": null, "stop_reason": null})
                };
                let c = self.chunk(choice);
                self.push(&c);
            }
            ReqEvent::Done { idx, reason } => {
                self.done += 1;
                let choice = if self.meta.chat {
                    json!({"index": idx, "delta": {}, "logprobs": null, "finish_reason": reason.as_str(), "stop_reason": null})
                } else {
                    json!({"index": idx, "text": "", "logprobs": null, "finish_reason": reason.as_str(), "stop_reason": null})
                };
                let c = self.chunk(choice);
                self.push(&c);
                if self.done == self.meta.choices() {
                    self.finish();
                }
            }
            // A streamed prefill leg has no place for `kv_transfer_params`: its blocks stay pinned
            // until the lease expires (routers send prefill legs with `stream: false`).
            ReqEvent::Pinned { .. } => {}
            ReqEvent::Crash => {
                return Err(std::io::Error::other(
                    "injected fault: crash after N tokens",
                ))
            }
        }
        Ok(())
    }

    fn finish(&mut self) {
        if self.meta.include_usage {
            let cached: usize = self.cached.iter().step_by(self.meta.n).sum();
            let u = json!({
                "id": self.meta.id,
                "object": if self.meta.chat { "chat.completion.chunk" } else { "text_completion" },
                "created": self.meta.created,
                "model": self.meta.model,
                "choices": [],
                "usage": self.meta.usage(self.completion, cached),
            });
            self.push(&u);
        }
        self.pending
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.finished = true;
    }
}

impl http_body::Body for SseBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if self.finished {
                return Poll::Ready(None);
            }
            match self.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(ev)) => {
                    if let Err(e) = self.on_event(ev) {
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                Poll::Ready(None) => {
                    // The worker stopped mid-request: tell the client in-band (status is already sent).
                    let e = json!({"error": {"message": "worker stopped before the request finished",
                                             "type": "ServiceUnavailableError", "param": null, "code": 503}});
                    self.push(&e);
                    self.finished = true;
                }
            }
        }
    }
}
