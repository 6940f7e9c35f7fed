//! The bench's view of a `text/event-stream`: kvgate-protocol's [`SseScanner`] (the gateway's
//! tested, allocation-light splitter) yields each event's `data`, plus the end-of-stream flush
//! a load generator needs for servers that omit the last blank line.

use kvgate_protocol::sse::{SseScanner, DEFAULT_MAX_EVENT_BYTES};

/// Feed bytes as they arrive, get back the `data:` payload of every complete event.
#[derive(Default)]
pub struct SseSplitter {
    scanner: SseScanner,
}

/// An event larger than the scanner's bound: not an OpenAI stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventTooLarge;

impl std::fmt::Display for EventTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SSE event larger than {DEFAULT_MAX_EVENT_BYTES} bytes")
    }
}

impl SseSplitter {
    /// Feeds bytes; calls `on_event` with each complete event's data (lines joined by `\n`).
    /// Fails only on an event larger than the scanner's bound (8 MiB), as soon as it is.
    pub fn feed(
        &mut self,
        bytes: &[u8],
        mut on_event: impl FnMut(&[u8]),
    ) -> Result<(), EventTooLarge> {
        let mut too_large = false;
        self.scanner.feed(bytes, |ev| {
            if ev.oversized {
                too_large = true;
            } else {
                on_event(ev.data);
            }
        });
        if too_large || self.scanner.skipping() {
            return Err(EventTooLarge);
        }
        Ok(())
    }

    /// Data of an event left unterminated at end of stream (servers that omit the last blank line).
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        let mut out = None;
        // Two line ends terminate the pending line and then the pending event, whatever state
        // the scanner is in (including a chunk that ended on `\r`); nothing else is emitted.
        self.scanner.feed(b"\n\n", |ev| {
            if !ev.oversized {
                out = Some(ev.data.to_vec());
            }
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(chunks: &[&[u8]]) -> Vec<String> {
        let mut s = SseSplitter::default();
        let mut out = vec![];
        for c in chunks {
            s.feed(c, |d| out.push(String::from_utf8_lossy(d).into_owned()))
                .unwrap();
        }
        if let Some(d) = s.finish() {
            out.push(String::from_utf8_lossy(&d).into_owned());
        }
        out
    }

    #[test]
    fn splits_events_across_reads_and_line_endings() {
        let got = split_all(&[
            b"data: {\"a\"",
            b":1}\n\n: keep-alive\n\ndata: x\r\ndata: y\r\n\r\ndata: [DONE]\n\n",
        ]);
        assert_eq!(got, vec!["{\"a\":1}", "x\ny", "[DONE]"]);
        let got = split_all(&[b"da", b"ta:z\n", b"\n", b"data: tail"]);
        assert_eq!(got, vec!["z", "tail"]);
        assert!(split_all(&[b"event: ping\n\n"]).is_empty());
        // A stream cut right after a `\r` line end, and after a complete line without the blank.
        assert_eq!(split_all(&[b"data: a\r"]), vec!["a"]);
        assert_eq!(split_all(&[b"data: b\n"]), vec!["b"]);
        assert!(split_all(&[b"data: c\n\n"]) == vec!["c"]);
    }

    #[test]
    fn oversized_event_is_an_error_not_unbounded_memory() {
        let mut s = SseSplitter::default();
        let big = vec![b'x'; DEFAULT_MAX_EVENT_BYTES + 1];
        let mut r = s.feed(b"data: ", |_| {});
        assert!(r.is_ok());
        r = s.feed(&big, |_| {});
        assert!(r.is_err());
    }
}
