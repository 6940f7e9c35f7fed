//! A small incremental `text/event-stream` splitter: feed bytes as they arrive, get back the
//! `data:` payload of every complete event. Handles `\n` and `\r\n` line ends, multi-line data,
//! comments and events split across reads.

#[derive(Default)]
pub struct SseSplitter {
    buf: Vec<u8>,
    /// Start of the line not yet terminated.
    line_start: usize,
    data: Vec<u8>,
    has_data: bool,
}

impl SseSplitter {
    /// Feeds bytes; calls `on_event` with each complete event's data (lines joined by `\n`).
    pub fn feed(&mut self, bytes: &[u8], mut on_event: impl FnMut(&[u8])) {
        self.buf.extend_from_slice(bytes);
        while let Some(nl) = self.buf[self.line_start..].iter().position(|&b| b == b'\n') {
            let end = self.line_start + nl;
            let mut line = &self.buf[self.line_start..end];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            if line.is_empty() {
                if self.has_data {
                    on_event(&self.data);
                }
                self.data.clear();
                self.has_data = false;
            } else if let Some(rest) = line.strip_prefix(b"data:") {
                let rest = rest.strip_prefix(b" ").unwrap_or(rest);
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(rest);
                self.has_data = true;
            }
            // Other fields (event:, id:, retry:) and `:` comments carry nothing we measure.
            self.line_start = end + 1;
        }
        // Drop consumed lines so the buffer stays as small as one partial line.
        self.buf.drain(..self.line_start);
        self.line_start = 0;
    }

    /// Data of an event left unterminated at end of stream (servers that omit the last blank line).
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        let mut out = None;
        // Terminating the pending line and the pending event emits exactly what is left, if anything.
        self.feed(b"\n\n", |d| out = Some(d.to_vec()));
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
            s.feed(c, |d| out.push(String::from_utf8_lossy(d).into_owned()));
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
    }
}
