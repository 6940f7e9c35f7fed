//! gRPC over HTTP/2, the part an ext_proc server needs: length-prefixed messages (1 byte
//! compressed flag, 4 bytes big-endian length, the protobuf bytes) in both directions, the
//! response head (`content-type: application/grpc`) and the trailers that carry the call's status
//! (`grpc-status`, `grpc-message`). Compression is not negotiated (we send no
//! `grpc-accept-encoding`), so a compressed message is a protocol error.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

/// gRPC status codes used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    InvalidArgument = 3,
    NotFound = 5,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
}

/// A failed call: its status code and message (sent as `grpc-status` / `grpc-message`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub message: String,
}

impl Status {
    pub fn new(code: Code, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
        }
    }

    /// The label of `kvgate_epp_streams_total{end}`.
    pub fn label(&self) -> &'static str {
        match self.code {
            Code::Ok => "ok",
            Code::Cancelled => "cancelled",
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

/// The trailers ending a call with `status` (`None`: OK).
pub fn trailers(status: Option<&Status>) -> HeaderMap {
    let mut h = HeaderMap::new();
    let (code, msg) = match status {
        None => (Code::Ok, ""),
        Some(s) => (s.code, s.message.as_str()),
    };
    h.insert("grpc-status", HeaderValue::from(code as u16));
    if !msg.is_empty() {
        // grpc-message is percent-encoded; keep it to printable ASCII, encode the rest.
        let mut enc = String::with_capacity(msg.len());
        for b in msg.bytes().take(1024) {
            if (0x20..0x7f).contains(&b) && b != b'%' {
                enc.push(b as char);
            } else {
                enc.push_str(&format!("%{b:02X}"));
            }
        }
        if let Ok(v) = HeaderValue::from_str(&enc) {
            h.insert("grpc-message", v);
        }
    }
    h
}

/// One message framed for the wire.
pub fn encode<M: prost::Message>(m: &M) -> Bytes {
    let len = m.encoded_len();
    let mut b = BytesMut::with_capacity(5 + len);
    b.put_u8(0);
    b.put_u32(len as u32);
    // Encoding into a buffer with the exact capacity cannot fail.
    let _ = m.encode(&mut b);
    b.freeze()
}

/// Splits the request body's bytes into messages, each at most `max` bytes.
pub struct Decoder {
    buf: BytesMut,
    max: usize,
}

impl Decoder {
    pub fn new(max: usize) -> Decoder {
        Decoder {
            buf: BytesMut::new(),
            max,
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole message, `Ok(None)` until one has arrived. Refused: a compressed message
    /// (none was negotiated) or one larger than `max` (refused from its prefix, before its bytes
    /// are buffered).
    pub fn next_message(&mut self) -> Result<Option<Bytes>, Status> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flag = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        match flag {
            0 => {}
            1 => {
                return Err(Status::new(
                    Code::Unimplemented,
                    "compressed gRPC messages are not supported (no grpc-encoding was negotiated)",
                ))
            }
            f => {
                return Err(Status::new(
                    Code::InvalidArgument,
                    format!("bad gRPC message prefix (flag byte {f:#04x})"),
                ))
            }
        }
        if len > self.max {
            return Err(Status::new(
                Code::ResourceExhausted,
                format!(
                    "gRPC message of {len} bytes exceeds the limit of {} bytes (epp.max_message_bytes)",
                    self.max
                ),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        Ok(Some(self.buf.split_to(len).freeze()))
    }

    /// Bytes of an unfinished message (the stream ended inside one: truncated).
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// What the call's task sends to the response body.
pub enum Out {
    Message(Bytes),
    /// The call's end: its trailers.
    End(Option<Status>),
}

/// The response body of a call: messages as the call's task produces them, then the trailers.
/// The task ends with the body's receiver: when Envoy resets the stream, hyper drops this body,
/// the task's next send fails and it stops (releasing what the request held).
pub struct CallBody {
    rx: mpsc::Receiver<Out>,
    done: bool,
}

impl CallBody {
    pub fn new(rx: mpsc::Receiver<Out>) -> CallBody {
        CallBody { rx, done: false }
    }
}

impl Body for CallBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match this.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Out::Message(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(Some(Out::End(s))) => {
                this.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers(s.as_ref())))))
            }
            // The task ended without a status (it panicked or was dropped): an internal error.
            Poll::Ready(None) => {
                this.done = true;
                let s = Status::new(Code::Internal, "the call ended without a status");
                Poll::Ready(Some(Ok(Frame::trailers(trailers(Some(&s))))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_split_across_and_within_chunks() {
        let a = encode(&super::super::pb::HealthCheckRequest {
            service: "liveness".into(),
        });
        let b = encode(&super::super::pb::HealthCheckRequest {
            service: String::new(),
        });
        let mut all = a.to_vec();
        all.extend_from_slice(&b);
        let mut d = Decoder::new(1024);
        let mut got = Vec::new();
        for byte in &all {
            d.push(std::slice::from_ref(byte));
            while let Some(m) = d.next_message().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], a.slice(5..));
        assert_eq!(got[1].len(), 0, "an empty message is a message");
        assert_eq!(d.pending(), 0);
    }

    #[test]
    fn oversized_compressed_and_bad_prefixes_are_refused() {
        let mut d = Decoder::new(10);
        d.push(&[0, 0, 0, 0, 11]);
        assert_eq!(d.next_message().unwrap_err().code, Code::ResourceExhausted);
        let mut d = Decoder::new(10);
        d.push(&[1, 0, 0, 0, 1, 0]);
        assert_eq!(d.next_message().unwrap_err().code, Code::Unimplemented);
        let mut d = Decoder::new(10);
        d.push(b"GET / HTTP/1.1\r\n");
        assert_eq!(d.next_message().unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        let t = trailers(Some(&Status::new(Code::InvalidArgument, "50% bad\nline é")));
        assert_eq!(t["grpc-status"], "3");
        assert_eq!(t["grpc-message"], "50%25 bad%0Aline %C3%A9");
    }
}
