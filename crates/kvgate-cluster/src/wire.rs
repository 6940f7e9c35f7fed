//! The cluster wire format: one binary message per NATS payload, versioned and size-limited.
//!
//! ```text
//! version u8 (= WIRE_VERSION) | kind u8 | sent_unix_us u64 LE | replica str8 | body (per kind)
//! str8 = len u8 + UTF-8 bytes; str16 = len u16 LE + bytes; list = count u32 LE + items
//! ```
//! Decoding is all-or-nothing: a message is parsed completely (every field, no trailing bytes)
//! before anything is applied, so a truncated, oversized, foreign-version or unknown-kind message
//! is dropped whole and counted under its [`DropReason`].

use bytes::{BufMut, Bytes, BytesMut};

/// The wire version this build speaks. A peer sending another version is dropped and counted.
pub const WIRE_VERSION: u8 = 1;

/// One cluster message as sent by replica `replica` at `sent_unix_us` (wall clock, microseconds;
/// only used for the sync-lag histogram).
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub replica: String,
    pub sent_unix_us: u64,
    pub msg: Message,
}

/// What replicas tell each other.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// A routing decision and its dispatch: `worker` of pool `model` got request `request` (id
    /// unique per sending replica) whose prompt has block `hashes`. Receivers insert the hashes
    /// into their approximate index (or the exact index's predicted inserts) and count
    /// `prefill_tokens` pending prefill and `blocks` active blocks on the worker under the sender
    /// (the prompt's blocks beyond the prefix the worker was predicted to hold).
    Route {
        model: String,
        worker: String,
        request: u64,
        prefill_tokens: u64,
        blocks: u32,
        hashes: Vec<u64>,
    },
    /// The request's first token arrived: its pending prefill is done.
    PrefillDone { request: u64 },
    /// The request ended (completion, error or cancel): its load is freed.
    Free { request: u64 },
    /// A worker's circuit breaker opened (`open`) or closed at the sender.
    Health { worker: String, open: bool },
    /// The sender is alive; `inflight` is how many requests it has in flight (a check on the
    /// receiver's table).
    Heartbeat { inflight: u32 },
    /// Requests admitted per API key (by a 64-bit key id, never the key) since the last report.
    RateUsage { keys: Vec<(u64, u32)> },
    /// A snapshot reply: the sender's approximate index entries and its own in-flight requests.
    Snapshot(Snapshot),
    /// An OpenAI Responses id the sender learned from `worker`'s reply: that worker stores it,
    /// so every replica sends the id's later uses there.
    Pin { id: String, worker: String },
    /// Session `key` (a hash of the client's session id) was last routed to `worker`.
    Session { key: u64, worker: String },
    /// Flow control (docs/flow-control.md, "Cluster mode"): the sender's queue as its peers need
    /// it to share one order: its fair-queueing clock per class, its best waiter per pool, and
    /// (every heartbeat) the tokens it admitted per class and tenant since its last report.
    Flow(FlowReport),
}

/// One replica's flow-control state for its peers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FlowReport {
    /// Per class name: the class's virtual time (the tag of its last admitted request).
    pub clocks: Vec<(String, f64)>,
    /// The best-ranked waiter of each pool with waiters.
    pub heads: Vec<FlowHead>,
    /// Tokens admitted per class and tenant since the previous report.
    pub usage: Vec<FlowUsage>,
}

/// The best-ranked waiter of one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowHead {
    /// The pool's stable id (a hash of its model name).
    pub pool: u64,
    /// Its class's priority.
    pub priority: i32,
    /// Its start tag in its class's fair share; NaN when its class orders by deadline (not
    /// comparable between replicas: only the priority counts).
    pub tag: f64,
}

/// Tokens admitted for one tenant of one class.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowUsage {
    pub class: String,
    /// The fairness key; empty = the anonymous tenant.
    pub tenant: String,
    pub tokens: u64,
}

/// What a replica sends a joining peer, in one or more parts ([`Snapshot::split`]), each within
/// `max_message_bytes`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    /// 0: the first (or only) part of a snapshot, sent as kind `snapshot`: the receiver replaces
    /// what it holds of the sender's in-flight requests by this part's. n > 0: the n-th
    /// continuation (kind `snapshot_part`): its entries are added to the previous parts'.
    pub part: u32,
    /// Per worker name: the router block hashes the approximate index holds (a worker's list may
    /// be cut across parts, in order).
    pub approx: Vec<(String, Vec<u64>)>,
    /// The sender's own in-flight requests.
    pub inflight: Vec<InflightEntry>,
}

impl Snapshot {
    /// Cut this snapshot into parts numbered 0.. that each encode, sent by `replica`, within
    /// `max_bytes`: approximate entries first (a worker's hash list is cut where a part is
    /// full), then in-flight entries, greedily. Always at least one part (an empty snapshot is
    /// one empty part). `Err(Oversized)` only when `max_bytes` cannot hold one entry.
    pub fn split(self, replica: &str, max_bytes: usize) -> Result<Vec<Snapshot>, DropReason> {
        // Envelope header + the two list counts + the part number of a continuation.
        let fixed = 1 + 1 + 8 + 1 + truncate(replica, u8::MAX as usize).len() + 4 + 4 + 4;
        let budget = max_bytes.checked_sub(fixed).ok_or(DropReason::Oversized)?;
        let mut parts = Vec::new();
        let mut cur = Snapshot::default();
        let mut used = 0usize;
        fn flush(parts: &mut Vec<Snapshot>, cur: &mut Snapshot, used: &mut usize) {
            let mut next = Snapshot {
                part: parts.len() as u32 + 1,
                ..Snapshot::default()
            };
            std::mem::swap(cur, &mut next);
            parts.push(next);
            *used = 0;
        }
        for (worker, hashes) in self.approx {
            let head = 2 + truncate(&worker, u16::MAX as usize).len() + 4;
            let mut rest = &hashes[..];
            loop {
                let room = budget.checked_sub(used + head).map_or(0, |r| r / 8);
                let fits = used + head <= budget && (room > 0 || rest.is_empty());
                if !fits {
                    if used == 0 {
                        return Err(DropReason::Oversized);
                    }
                    flush(&mut parts, &mut cur, &mut used);
                    continue;
                }
                let n = room.min(rest.len());
                cur.approx.push((worker.clone(), rest[..n].to_vec()));
                used += head + 8 * n;
                rest = &rest[n..];
                if rest.is_empty() {
                    break;
                }
            }
        }
        for e in self.inflight {
            let size = 2 + truncate(&e.worker, u16::MAX as usize).len() + 8 + 8 + 4;
            if used + size > budget {
                if used == 0 {
                    return Err(DropReason::Oversized);
                }
                flush(&mut parts, &mut cur, &mut used);
            }
            cur.inflight.push(e);
            used += size;
        }
        parts.push(cur);
        // The first part is numbered 0, whatever `self.part` was.
        for (i, p) in parts.iter_mut().enumerate() {
            p.part = i as u32;
        }
        Ok(parts)
    }
}

/// One in-flight request of a replica, as listed in its snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct InflightEntry {
    pub worker: String,
    pub request: u64,
    pub prefill_tokens: u64,
    pub blocks: u32,
}

/// Message kinds, as metric labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Route,
    PrefillDone,
    Free,
    Health,
    Heartbeat,
    RateUsage,
    Snapshot,
    Pin,
    Session,
    SnapshotPart,
    Flow,
}

impl Kind {
    pub const ALL: [Kind; 11] = [
        Kind::Route,
        Kind::PrefillDone,
        Kind::Free,
        Kind::Health,
        Kind::Heartbeat,
        Kind::RateUsage,
        Kind::Snapshot,
        Kind::Pin,
        Kind::Session,
        Kind::SnapshotPart,
        Kind::Flow,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Route => "route",
            Kind::PrefillDone => "prefill_done",
            Kind::Free => "free",
            Kind::Health => "health",
            Kind::Heartbeat => "heartbeat",
            Kind::RateUsage => "rate_usage",
            Kind::Snapshot => "snapshot",
            Kind::Pin => "pin",
            Kind::Session => "session",
            Kind::SnapshotPart => "snapshot_part",
            Kind::Flow => "flow",
        }
    }

    fn code(self) -> u8 {
        match self {
            Kind::Route => 1,
            Kind::PrefillDone => 2,
            Kind::Free => 3,
            Kind::Health => 4,
            Kind::Heartbeat => 5,
            Kind::RateUsage => 6,
            Kind::Snapshot => 7,
            // Added in place (same wire version): an older peer drops them as `unknown_kind`.
            Kind::Pin => 8,
            Kind::Session => 9,
            // A continuation of a snapshot too large for one message (an older peer drops it
            // as `unknown_kind` and keeps the first part).
            Kind::SnapshotPart => 10,
            Kind::Flow => 11,
        }
    }

    fn from_code(c: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.code() == c)
    }
}

impl Message {
    pub fn kind(&self) -> Kind {
        match self {
            Message::Route { .. } => Kind::Route,
            Message::PrefillDone { .. } => Kind::PrefillDone,
            Message::Free { .. } => Kind::Free,
            Message::Health { .. } => Kind::Health,
            Message::Heartbeat { .. } => Kind::Heartbeat,
            Message::RateUsage { .. } => Kind::RateUsage,
            Message::Snapshot(s) if s.part > 0 => Kind::SnapshotPart,
            Message::Snapshot(_) => Kind::Snapshot,
            Message::Pin { .. } => Kind::Pin,
            Message::Session { .. } => Kind::Session,
            Message::Flow(_) => Kind::Flow,
        }
    }
}

/// Why a message was not applied (metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Larger than `max_message_bytes` (sent or received).
    Oversized,
    /// Another wire version.
    Version,
    /// A kind this build does not know.
    UnknownKind,
    /// Truncated, trailing bytes, bad UTF-8 or an impossible count.
    Malformed,
    /// The outbound queue was full (NATS slow or down): dropped instead of waiting.
    QueueFull,
    /// The NATS client refused the publish (disconnected and its buffer full).
    PublishFailed,
    /// Named a worker or model this replica does not have.
    UnknownWorker,
}

impl DropReason {
    pub const ALL: [DropReason; 7] = [
        DropReason::Oversized,
        DropReason::Version,
        DropReason::UnknownKind,
        DropReason::Malformed,
        DropReason::QueueFull,
        DropReason::PublishFailed,
        DropReason::UnknownWorker,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Oversized => "oversized",
            DropReason::Version => "version",
            DropReason::UnknownKind => "unknown_kind",
            DropReason::Malformed => "malformed",
            DropReason::QueueFull => "queue_full",
            DropReason::PublishFailed => "publish_failed",
            DropReason::UnknownWorker => "unknown_worker",
        }
    }
}

/// A decode failure: the reason, and the kind when the header got that far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeError {
    pub reason: DropReason,
    pub kind: Option<Kind>,
}

/// Encode `env`; `Err(Oversized)` when it exceeds `max_bytes`.
pub fn encode(env: &Envelope, max_bytes: usize) -> Result<Bytes, DropReason> {
    let mut b = BytesMut::with_capacity(64);
    b.put_u8(WIRE_VERSION);
    b.put_u8(env.msg.kind().code());
    b.put_u64_le(env.sent_unix_us);
    put_str8(&mut b, &env.replica);
    match &env.msg {
        Message::Route {
            model,
            worker,
            request,
            prefill_tokens,
            blocks,
            hashes,
        } => {
            put_str16(&mut b, model);
            put_str16(&mut b, worker);
            b.put_u64_le(*request);
            b.put_u64_le(*prefill_tokens);
            b.put_u32_le(*blocks);
            put_hashes(&mut b, hashes);
        }
        Message::PrefillDone { request } | Message::Free { request } => b.put_u64_le(*request),
        Message::Health { worker, open } => {
            put_str16(&mut b, worker);
            b.put_u8(u8::from(*open));
        }
        Message::Heartbeat { inflight } => b.put_u32_le(*inflight),
        Message::RateUsage { keys } => {
            b.put_u32_le(keys.len() as u32);
            for (k, n) in keys {
                b.put_u64_le(*k);
                b.put_u32_le(*n);
            }
        }
        Message::Pin { id, worker } => {
            put_str16(&mut b, id);
            put_str16(&mut b, worker);
        }
        Message::Session { key, worker } => {
            b.put_u64_le(*key);
            put_str16(&mut b, worker);
        }
        Message::Flow(f) => {
            b.put_u32_le(f.clocks.len() as u32);
            for (class, v) in &f.clocks {
                put_str16(&mut b, class);
                b.put_u64_le(v.to_bits());
            }
            b.put_u32_le(f.heads.len() as u32);
            for h in &f.heads {
                b.put_u64_le(h.pool);
                b.put_i32_le(h.priority);
                b.put_u64_le(h.tag.to_bits());
            }
            b.put_u32_le(f.usage.len() as u32);
            for u in &f.usage {
                put_str16(&mut b, &u.class);
                put_str16(&mut b, &u.tenant);
                b.put_u64_le(u.tokens);
            }
        }
        Message::Snapshot(s) => {
            if s.part > 0 {
                b.put_u32_le(s.part);
            }
            b.put_u32_le(s.approx.len() as u32);
            for (w, hs) in &s.approx {
                put_str16(&mut b, w);
                put_hashes(&mut b, hs);
            }
            b.put_u32_le(s.inflight.len() as u32);
            for e in &s.inflight {
                put_str16(&mut b, &e.worker);
                b.put_u64_le(e.request);
                b.put_u64_le(e.prefill_tokens);
                b.put_u32_le(e.blocks);
            }
        }
    }
    if b.len() > max_bytes {
        return Err(DropReason::Oversized);
    }
    Ok(b.freeze())
}

/// Decode one payload of at most `max_bytes`, entirely or not at all.
pub fn decode(buf: &[u8], max_bytes: usize) -> Result<Envelope, DecodeError> {
    let err = |reason, kind| DecodeError { reason, kind };
    if buf.len() > max_bytes {
        return Err(err(DropReason::Oversized, None));
    }
    let mut r = Reader { buf };
    let version = r.u8().ok_or(err(DropReason::Malformed, None))?;
    if version != WIRE_VERSION {
        return Err(err(DropReason::Version, None));
    }
    let code = r.u8().ok_or(err(DropReason::Malformed, None))?;
    let kind = Kind::from_code(code).ok_or(err(DropReason::UnknownKind, None))?;
    let malformed = err(DropReason::Malformed, Some(kind));
    let sent_unix_us = r.u64().ok_or(malformed)?;
    let replica = r.str8().ok_or(malformed)?;
    let msg = decode_body(kind, &mut r).ok_or(malformed)?;
    if !r.buf.is_empty() {
        return Err(malformed);
    }
    Ok(Envelope {
        replica,
        sent_unix_us,
        msg,
    })
}

fn decode_body(kind: Kind, r: &mut Reader<'_>) -> Option<Message> {
    Some(match kind {
        Kind::Route => Message::Route {
            model: r.str16()?,
            worker: r.str16()?,
            request: r.u64()?,
            prefill_tokens: r.u64()?,
            blocks: r.u32()?,
            hashes: r.hashes()?,
        },
        Kind::PrefillDone => Message::PrefillDone { request: r.u64()? },
        Kind::Free => Message::Free { request: r.u64()? },
        Kind::Health => Message::Health {
            worker: r.str16()?,
            open: match r.u8()? {
                0 => false,
                1 => true,
                _ => return None,
            },
        },
        Kind::Heartbeat => Message::Heartbeat { inflight: r.u32()? },
        Kind::RateUsage => {
            let n = r.count(12)?;
            let mut keys = Vec::with_capacity(n);
            for _ in 0..n {
                keys.push((r.u64()?, r.u32()?));
            }
            Message::RateUsage { keys }
        }
        Kind::Pin => Message::Pin {
            id: r.str16()?,
            worker: r.str16()?,
        },
        Kind::Session => Message::Session {
            key: r.u64()?,
            worker: r.str16()?,
        },
        Kind::Flow => {
            let n = r.count(10)?;
            let mut clocks = Vec::with_capacity(n);
            for _ in 0..n {
                clocks.push((r.str16()?, f64::from_bits(r.u64()?)));
            }
            let n = r.count(20)?;
            let mut heads = Vec::with_capacity(n);
            for _ in 0..n {
                heads.push(FlowHead {
                    pool: r.u64()?,
                    priority: r.u32()? as i32,
                    tag: f64::from_bits(r.u64()?),
                });
            }
            let n = r.count(12)?;
            let mut usage = Vec::with_capacity(n);
            for _ in 0..n {
                usage.push(FlowUsage {
                    class: r.str16()?,
                    tenant: r.str16()?,
                    tokens: r.u64()?,
                });
            }
            Message::Flow(FlowReport {
                clocks,
                heads,
                usage,
            })
        }
        Kind::Snapshot | Kind::SnapshotPart => {
            let part = if kind == Kind::SnapshotPart {
                match r.u32()? {
                    0 => return None,
                    n => n,
                }
            } else {
                0
            };
            let n = r.count(6)?;
            let mut approx = Vec::with_capacity(n);
            for _ in 0..n {
                approx.push((r.str16()?, r.hashes()?));
            }
            let n = r.count(22)?;
            let mut inflight = Vec::with_capacity(n);
            for _ in 0..n {
                inflight.push(InflightEntry {
                    worker: r.str16()?,
                    request: r.u64()?,
                    prefill_tokens: r.u64()?,
                    blocks: r.u32()?,
                });
            }
            Message::Snapshot(Snapshot {
                part,
                approx,
                inflight,
            })
        }
    })
}

fn put_str8(b: &mut BytesMut, s: &str) {
    let s = truncate(s, u8::MAX as usize);
    b.put_u8(s.len() as u8);
    b.put_slice(s.as_bytes());
}

fn put_str16(b: &mut BytesMut, s: &str) {
    let s = truncate(s, u16::MAX as usize);
    b.put_u16_le(s.len() as u16);
    b.put_slice(s.as_bytes());
}

/// The longest prefix of `s` of at most `max` bytes on a char boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn put_hashes(b: &mut BytesMut, hs: &[u64]) {
    b.put_u32_le(hs.len() as u32);
    for h in hs {
        b.put_u64_le(*h);
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (a, rest) = self.buf.split_at(n);
        self.buf = rest;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2)?.try_into().ok().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }
    /// A list count whose items take at least `min_item` bytes each: a count the rest of the
    /// buffer cannot hold is malformed (and never drives a large allocation).
    fn count(&mut self, min_item: usize) -> Option<usize> {
        let n = self.u32()? as usize;
        (n.checked_mul(min_item)? <= self.buf.len()).then_some(n)
    }
    fn str_of(&mut self, n: usize) -> Option<String> {
        std::str::from_utf8(self.take(n)?).ok().map(str::to_owned)
    }
    fn str8(&mut self) -> Option<String> {
        let n = self.u8()? as usize;
        self.str_of(n)
    }
    fn str16(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        self.str_of(n)
    }
    fn hashes(&mut self) -> Option<Vec<u64>> {
        let n = self.count(8)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.u64()?);
        }
        Some(v)
    }
}

#[cfg(test)]
mod tests;
