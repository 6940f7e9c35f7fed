//! Incremental SSE event splitter (the WHATWG event-stream parsing rules, minus `id`/`retry`
//! bookkeeping nobody here needs).

use memchr::memchr2;

/// Events larger than this are not buffered (a broken or hostile worker must not grow our memory).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 8 << 20;

/// One dispatched event. Borrowed from the scanner's buffers until the callback returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SseEvent<'s> {
    /// The `event:` field; empty when absent (the default type, "message").
    pub event: &'s [u8],
    /// The `data:` lines joined by `\n`; empty for an oversized event.
    pub data: &'s [u8],
    /// The event's data outgrew the scanner's bound: its bytes were skipped, not buffered.
    pub oversized: bool,
    /// Offset in the chunk being fed just past the blank line that ended this event, so a caller
    /// that forwards the stream can tell which bytes belong to which event.
    pub end: usize,
}

/// Splits a byte stream into SSE events. Feed chunks in order; events come out through a callback
/// as soon as their terminating blank line arrives. No allocation per event once the buffers have
/// grown to the largest event seen.
#[derive(Debug)]
pub struct SseScanner {
    /// The current line when it started in an earlier chunk.
    line: Vec<u8>,
    data: Vec<u8>,
    /// Within one `feed`: the pending event's only data line so far, as a range of the chunk, not
    /// yet copied into `data` (an event that starts and ends in one chunk is never copied).
    borrowed: Option<(usize, usize)>,
    event: Vec<u8>,
    /// At least one `data` field was seen for the pending event.
    has_data: bool,
    /// The previous chunk ended in `\r`: a leading `\n` in the next one ends no new line.
    after_cr: bool,
    /// The pending event outgrew `max_event_bytes`: skip to its end without buffering.
    oversized: bool,
    /// Oversized only: the current line has bytes from an earlier chunk (so it is not blank).
    skipped_line: bool,
    max_event_bytes: usize,
}

impl Default for SseScanner {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseScanner {
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            line: Vec::new(),
            data: Vec::new(),
            borrowed: None,
            event: Vec::new(),
            has_data: false,
            after_cr: false,
            oversized: false,
            skipped_line: false,
            max_event_bytes,
        }
    }

    /// Scans `chunk`, calling `on_event` for every event it completes.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(SseEvent<'_>)) {
        if chunk.is_empty() {
            // Nothing arrived: a `\r` that ended the previous chunk still waits for its `\n`.
            return;
        }
        let mut pos = 0;
        if std::mem::take(&mut self.after_cr) && chunk.first() == Some(&b'\n') {
            pos = 1;
        }
        while pos < chunk.len() {
            let rest = &chunk[pos..];
            let Some(end) = memchr2(b'\n', b'\r', rest) else {
                self.own_borrowed(chunk);
                if self.oversized {
                    self.skipped_line = true;
                } else if self.line.len() + rest.len() + self.data.len() > self.max_event_bytes {
                    self.skip_event();
                    self.skipped_line = true;
                } else {
                    self.line.extend_from_slice(rest);
                }
                return;
            };
            let mut next = end + 1;
            if rest[end] == b'\r' {
                match rest.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            let line_end = pos + next;
            if self.oversized {
                let blank = end == 0 && !self.skipped_line;
                self.skipped_line = false;
                if blank {
                    on_event(SseEvent {
                        event: &self.event,
                        data: &[],
                        oversized: true,
                        end: line_end,
                    });
                    self.reset();
                }
            } else if self.line.is_empty() {
                self.process_line(chunk, Some(pos), &rest[..end], line_end, &mut on_event);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&rest[..end]);
                self.process_line(chunk, None, &line, line_end, &mut on_event);
                line.clear();
                self.line = line; // keep the allocation
            }
            pos += next;
        }
        self.own_borrowed(chunk);
    }

    /// Copies a borrowed data line into `data` (the chunk it lives in is about to go away, or a
    /// second data line follows).
    fn own_borrowed(&mut self, chunk: &[u8]) {
        if let Some((a, b)) = self.borrowed.take() {
            self.data.extend_from_slice(&chunk[a..b]);
        }
    }

    /// True when bytes of an unfinished event are pending (a stream that ends here was cut short).
    pub fn has_partial(&self) -> bool {
        !self.line.is_empty() || self.has_data || !self.event.is_empty() || self.oversized
    }

    /// The last chunk ended in `\r`: a `\n` first in the next chunk completes that line end
    /// (and starts nothing).
    pub fn ended_in_cr(&self) -> bool {
        self.after_cr
    }

    /// The pending event outgrew the bound and is being skipped.
    pub fn skipping(&self) -> bool {
        self.oversized
    }

    fn skip_event(&mut self) {
        self.oversized = true;
        self.borrowed = None;
        self.line.clear();
        self.data.clear();
        self.has_data = false;
    }

    fn reset(&mut self) {
        self.borrowed = None;
        self.data.clear();
        self.event.clear();
        self.has_data = false;
        self.oversized = false;
    }

    /// One complete line; `at`: its offset in `chunk` when it lies there whole.
    fn process_line(
        &mut self,
        chunk: &[u8],
        at: Option<usize>,
        line: &[u8],
        end: usize,
        on_event: &mut impl FnMut(SseEvent<'_>),
    ) {
        if line.is_empty() {
            if self.has_data {
                let data = match self.borrowed {
                    Some((a, b)) => &chunk[a..b],
                    None => &self.data[..],
                };
                on_event(SseEvent {
                    event: &self.event,
                    data,
                    oversized: false,
                    end,
                });
            }
            self.reset();
            return;
        }
        if line[0] == b':' {
            return; // comment / keep-alive
        }
        let (name, value) = match memchr::memchr(b':', line) {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &[][..]),
        };
        match name {
            b"data" => {
                if let (Some(at), false) = (at, self.has_data) {
                    if value.len() + 1 > self.max_event_bytes {
                        self.skip_event();
                        return;
                    }
                    // `value` ends the line: its place in the chunk follows from the lengths.
                    let from = at + line.len() - value.len();
                    self.borrowed = Some((from, from + value.len()));
                    self.has_data = true;
                    return;
                }
                self.own_borrowed(chunk);
                if self.data.len() + value.len() + 1 > self.max_event_bytes {
                    self.skip_event();
                    return;
                }
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            b"event" => {
                self.event.clear();
                self.event.extend_from_slice(value);
            }
            _ => {} // id, retry, unknown fields: nothing the gateway uses
        }
    }
}
