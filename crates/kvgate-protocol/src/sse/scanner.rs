//! Incremental SSE event splitter (the WHATWG event-stream parsing rules, minus `id`/`retry`
//! bookkeeping the gateway does not need).

use memchr::memchr2;

/// Events larger than this are refused (a broken or hostile worker must not grow our memory).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 8 << 20;

/// One dispatched event. Borrowed from the scanner's buffers until the callback returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SseEvent<'s> {
    /// The `event:` field; empty when absent (the default type, "message").
    pub event: &'s [u8],
    /// The `data:` lines joined by `\n`.
    pub data: &'s [u8],
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("SSE event larger than {0} bytes")]
    EventTooLarge(usize),
}

/// Splits a byte stream into SSE events. Feed chunks in order; events come out through a callback
/// as soon as their terminating blank line arrives.
#[derive(Debug)]
pub struct SseScanner {
    /// The current line when it started in an earlier chunk.
    line: Vec<u8>,
    data: Vec<u8>,
    event: Vec<u8>,
    /// At least one `data` field was seen for the pending event.
    has_data: bool,
    /// The previous chunk ended in `\r`: a leading `\n` in the next one ends no new line.
    after_cr: bool,
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
            event: Vec::new(),
            has_data: false,
            after_cr: false,
            max_event_bytes,
        }
    }

    /// Scans `chunk`, calling `on_event` for every event it completes.
    pub fn feed(
        &mut self,
        mut chunk: &[u8],
        mut on_event: impl FnMut(SseEvent<'_>),
    ) -> Result<(), SseError> {
        if self.after_cr {
            self.after_cr = false;
            if chunk.first() == Some(&b'\n') {
                chunk = &chunk[1..];
            }
        }
        while !chunk.is_empty() {
            let Some(end) = memchr2(b'\n', b'\r', chunk) else {
                if self.line.len() + chunk.len() + self.data.len() > self.max_event_bytes {
                    return Err(SseError::EventTooLarge(self.max_event_bytes));
                }
                self.line.extend_from_slice(chunk);
                return Ok(());
            };
            let terminator = chunk[end];
            let mut next = end + 1;
            if terminator == b'\r' {
                match chunk.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            if self.line.is_empty() {
                self.process_line(&chunk[..end], &mut on_event)?;
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&chunk[..end]);
                let r = self.process_line(&line, &mut on_event);
                line.clear();
                self.line = line; // keep the allocation
                r?;
            }
            chunk = &chunk[next..];
        }
        Ok(())
    }

    /// True when bytes of an unfinished event are buffered (a stream that ends here was cut short).
    pub fn has_partial(&self) -> bool {
        !self.line.is_empty() || self.has_data || !self.event.is_empty()
    }

    fn process_line(
        &mut self,
        line: &[u8],
        on_event: &mut impl FnMut(SseEvent<'_>),
    ) -> Result<(), SseError> {
        if line.is_empty() {
            if self.has_data {
                on_event(SseEvent {
                    event: &self.event,
                    data: &self.data,
                });
            }
            self.data.clear();
            self.event.clear();
            self.has_data = false;
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(()); // comment / keep-alive
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
                if self.data.len() + value.len() + 1 > self.max_event_bytes {
                    return Err(SseError::EventTooLarge(self.max_event_bytes));
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
        Ok(())
    }
}

/// Appends `data` as one event (`data: …\n` per line, then a blank line) to `out`. Used when the
/// gateway re-emits a stream it filtered (e.g. without the injected usage-only chunk).
pub fn write_data_event(data: &[u8], out: &mut Vec<u8>) {
    for line in data.split(|&b| b == b'\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line);
        out.push(b'\n');
    }
    out.push(b'\n');
}
