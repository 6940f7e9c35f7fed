//! A worker's event stream on its way to the client: every event's facts ([`ChunkInfo`]) for the
//! caller's metrics, and optionally the stream the client gets without what the gateway itself
//! asked for.
//!
//! Stripping: when the gateway spliced `stream_options.include_usage` into a request whose client
//! did not ask for it (`openai::splice_include_usage`), the worker adds a usage-only event at the
//! end and `"usage": null` to every other chunk; the client sees neither. An event's bytes are
//! held until its blank line shows what it is; everything else is delivered unchanged and in
//! order: bytes between events (keep-alive comments) at once, and an event too large to hold
//! unexamined.

use super::agent::{AgentState, Dialect};
use super::chunk::ChunkInfo;
use super::scanner::SseScanner;
use crate::usage::{finder, merge_pd_usage_event, Usage};

pub struct Relay {
    scanner: SseScanner,
    strip: Option<Strip>,
    saw_done: bool,
    max: usize,
    dialect: Dialect,
    /// Responses / Messages streams only (boxed: OpenAI streams carry none).
    agent: Option<Box<AgentState>>,
}

struct Strip {
    /// Bytes of the pending event that arrived in earlier chunks.
    held: Vec<u8>,
    /// Bytes of the chunk just fed to deliver.
    out: Vec<u8>,
    /// The pending event passes unexamined (it outgrew the bound).
    raw: bool,
    /// The last bytes seen were a dropped event's (the `\n` of its `\r\n` may follow).
    dropped: bool,
    max: usize,
    /// Remove the usage-only event and `"usage": null` members (else events pass unchanged).
    drop_usage: bool,
    /// Prefill/decode: the usage-only event's usage is merged with the prefill leg's.
    pd_usage: Option<Usage>,
}

impl Relay {
    /// `strip_usage`: remove the usage-only event and `"usage": null` members (see the module
    /// documentation). Events over `max_event_bytes` are passed on without being examined.
    pub fn new(strip_usage: bool, max_event_bytes: usize) -> Self {
        Relay {
            scanner: SseScanner::new(max_event_bytes),
            strip: strip_usage.then(|| Strip {
                held: Vec::new(),
                out: Vec::new(),
                raw: false,
                dropped: false,
                max: max_event_bytes,
                drop_usage: true,
                pd_usage: None,
            }),
            saw_done: false,
            max: max_event_bytes,
            dialect: Dialect::OpenAi,
            agent: None,
        }
    }

    /// Read the events as `dialect`'s (`sse/agent.rs`); OpenAI chunks by default.
    pub fn with_dialect(mut self, dialect: Dialect) -> Self {
        self.dialect = dialect;
        self.agent = (dialect != Dialect::OpenAi).then(Box::default);
        self
    }

    /// Responses: the id announced by `response.created`, once.
    pub fn take_response_id(&mut self) -> Option<String> {
        self.agent.as_mut()?.response_id.take()
    }

    /// Prefill/decode disaggregation: the usage-only event the client gets takes prompt and
    /// cached tokens from the prefill leg's usage (`usage::merge_pd_usage`). Without stripping,
    /// every other byte passes unchanged.
    pub fn with_pd_usage(mut self, prefill: Usage) -> Self {
        let max = self.max;
        let st = self.strip.get_or_insert_with(|| Strip {
            held: Vec::new(),
            out: Vec::new(),
            raw: false,
            dropped: false,
            max,
            drop_usage: false,
            pd_usage: None,
        });
        st.pd_usage = Some(prefill);
        self
    }

    /// Scans one chunk, calling `on_event` with the facts of every event it completes.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(&ChunkInfo)) {
        let Relay {
            scanner,
            strip,
            saw_done,
            dialect,
            agent,
            ..
        } = self;
        let mut from = 0;
        if let Some(st) = strip.as_mut() {
            // A `\r\n` split across chunks: the `\n` goes where its `\r` went.
            if scanner.ended_in_cr() && chunk.first() == Some(&b'\n') {
                from = 1;
                if !st.held.is_empty() {
                    st.held.push(b'\n');
                } else if !st.dropped {
                    st.out.push(b'\n');
                }
            }
        }
        scanner.feed(chunk, |ev| {
            let info = if ev.oversized {
                ChunkInfo::default()
            } else if let Some(agent) = agent.as_deref_mut() {
                super::agent::scan(*dialect, ev.event, ev.data, agent)
            } else {
                ChunkInfo::scan(ev.data)
            };
            *saw_done |= info.done;
            on_event(&info);
            if let Some(st) = strip.as_mut() {
                st.event(&chunk[from..ev.end], info.usage_only);
            }
            from = ev.end;
        });
        if let Some(st) = strip.as_mut() {
            let rest = &chunk[from..];
            if !scanner.has_partial() {
                // Between events (comments, blank lines): nothing to decide, deliver now.
                st.flush(rest);
                st.raw = false;
            } else if st.raw || scanner.skipping() || st.held.len() + rest.len() > st.max {
                st.flush(rest);
                st.raw = true;
            } else {
                st.held.extend_from_slice(rest);
            }
        }
    }

    /// Stripping: the bytes of the chunk just fed to deliver (`None`: deliver the chunk as is).
    pub fn take_out(&mut self) -> Option<Vec<u8>> {
        self.strip.as_mut().map(|st| std::mem::take(&mut st.out))
    }

    /// Stripping: the bytes of an unfinished event held back, to deliver when the stream ends.
    pub fn take_held(&mut self) -> Option<Vec<u8>> {
        self.strip
            .as_mut()
            .filter(|st| !st.held.is_empty())
            .map(|st| std::mem::take(&mut st.held))
    }

    /// `data: [DONE]` was seen: the worker finished its answer.
    pub fn saw_done(&self) -> bool {
        self.saw_done
    }
}

impl Strip {
    /// The event that ends with `tail` (its earlier bytes are in `held`) is complete.
    fn event(&mut self, tail: &[u8], usage_only: bool) {
        self.dropped = false;
        if std::mem::take(&mut self.raw) {
            self.out.extend_from_slice(tail);
        } else if usage_only && self.drop_usage {
            self.held.clear();
            self.dropped = true;
        } else if let (true, Some(p)) = (usage_only, self.pd_usage) {
            let mut ev = std::mem::take(&mut self.held);
            ev.extend_from_slice(tail);
            match merge_pd_usage_event(&ev, &p) {
                Some(merged) => self.out.extend_from_slice(&merged),
                None => self.out.extend_from_slice(&ev),
            }
        } else if !self.drop_usage {
            self.out.append(&mut self.held);
            self.out.extend_from_slice(tail);
        } else if self.held.is_empty() {
            push_without_null_usage(&mut self.out, tail);
        } else {
            let mut ev = std::mem::take(&mut self.held);
            ev.extend_from_slice(tail);
            push_without_null_usage(&mut self.out, &ev);
            ev.clear();
            self.held = ev; // keep the allocation
        }
    }

    fn flush(&mut self, rest: &[u8]) {
        if !rest.is_empty() || !self.held.is_empty() {
            self.dropped = false;
        }
        self.out.append(&mut self.held);
        self.out.extend_from_slice(rest);
    }
}

fn push_without_null_usage(out: &mut Vec<u8>, ev: &[u8]) {
    match null_usage(ev) {
        Some((from, to)) => {
            out.extend_from_slice(&ev[..from]);
            out.extend_from_slice(&ev[to..]);
        }
        None => out.extend_from_slice(ev),
    }
}

/// The byte range of a `"usage": null` member in `ev` with the comma that separates it from
/// its neighbour, if there is one. A raw `"usage"` cannot occur inside a JSON string (its quotes
/// would be escaped), so a match is a member of some object, in practice the chunk itself.
pub(crate) fn null_usage(ev: &[u8]) -> Option<(usize, usize)> {
    const KEY: &[u8] = b"\"usage\"";
    let ws = |b: &u8| matches!(b, b' ' | b'\t');
    let k = finder!(Finder, KEY).find(ev)?;
    let mut e = k + KEY.len();
    e += ev[e..].iter().take_while(|b| ws(b)).count();
    if ev.get(e) != Some(&b':') {
        return None;
    }
    e += 1;
    e += ev[e..].iter().take_while(|b| ws(b)).count();
    if !ev[e..].starts_with(b"null") {
        return None;
    }
    e += 4;
    if !matches!(ev.get(e), Some(b' ' | b'\t' | b',' | b'}')) {
        return None;
    }
    // `, "usage": null` after a member, or `"usage": null, ` before one.
    let before = ev[..k].iter().rev().take_while(|b| ws(b)).count();
    if k > before && ev[k - before - 1] == b',' {
        return Some((k - before - 1, e));
    }
    let after = ev[e..].iter().take_while(|b| ws(b)).count();
    if ev.get(e + after) == Some(&b',') {
        let next = ev[e + after + 1..].iter().take_while(|b| ws(b)).count();
        return Some((k, e + after + 1 + next));
    }
    Some((k, e))
}
