//! The keep-alive pool of the worker client: see [`Pool`].

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use bytes::BytesMut;
use http::uri::Authority;
use tokio::time::Sleep;

use super::{Conn, IdleState, StrayHook, STRAY_QUARANTINE};

/// Pool key: a worker address, and the TLS configuration it is reached with (0: plain).
///
/// Compared and hashed as the exact text: `Authority`'s own impls ignore ASCII case a byte at a
/// time (hashing each byte separately), and a worker's authority is always spelled the same way
/// (it comes from its configured URL).
#[derive(Clone)]
pub(crate) struct Key {
    pub(crate) tls: u64,
    pub(crate) authority: Authority,
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.tls == other.tls && self.authority.as_str() == other.authority.as_str()
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.tls.hash(h);
        self.authority.as_str().hash(h);
    }
}

struct Idle {
    io: Conn,
    /// The connection's read buffer, empty (its memory reused by the next response).
    buf: BytesMut,
    expires: Instant,
}

#[derive(Default)]
struct Stacks {
    idle: HashMap<Key, Vec<Idle>, ahash::RandomState>,
    /// Workers caught writing after a response, and until when their connections are not reused.
    quarantined: HashMap<Key, Instant, ahash::RandomState>,
    /// The timer of [`Pool::within`], kept between calls (still armed at its last deadline).
    timer: Option<Pin<Box<Sleep>>>,
}

/// Idle keep-alive connections to workers, keyed by worker address, newest last (a few hot
/// connections rather than many lukewarm ones), bounded by `Settings::max_idle_per_host` and
/// `Settings::idle_timeout`. A handle: clones share one pool.
///
/// A connection is registered with the reactor of the runtime that opened it, so a pool belongs
/// to one runtime: the gateway gives each io thread (each its own single-threaded runtime) its
/// own pool, and a request checks connections out of its thread's. The lock is never contended
/// there (one thread), and never held across an `.await`.
#[derive(Clone, Default)]
pub struct Pool(Arc<Mutex<Stacks>>);

impl Pool {
    fn stacks(&self) -> std::sync::MutexGuard<'_, Stacks> {
        // Nothing under the lock can panic half-way through an update.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `fut`'s output, or `None` once `deadline` has passed without it: `tokio::time::timeout_at`
    /// (the future is polled first, then the timer), with the timer kept in the pool from one
    /// call to the next. A timer still armed at an earlier call's deadline is left there and moved
    /// to `deadline` only when it fires; one armed later is moved at once. A request's timeout
    /// then costs no timer-wheel insertion and removal, only a poll. `fut` is borrowed pinned
    /// where it is (a request's future is not moved into another one).
    pub fn within<'a, F: Future + ?Sized>(
        &'a self,
        deadline: tokio::time::Instant,
        fut: Pin<&'a mut F>,
    ) -> Within<'a, F> {
        Within {
            pool: self,
            deadline,
            fut,
            timer: None,
            taken: false,
        }
    }

    /// A live idle connection for `key`, newest first.
    pub(super) fn checkout(
        &self,
        key: &Key,
        now: Instant,
        on_stray: &Option<StrayHook>,
    ) -> Option<(Conn, BytesMut)> {
        let mut p = self.stacks();
        let stack = p.idle.get_mut(key)?;
        while let Some(mut c) = stack.pop() {
            if c.expires <= now {
                // Everything below is older still.
                stack.clear();
                break;
            }
            // Every checkout probes, however recently the connection was used: a worker that
            // wrote anything after its last response (a stray response, the rest of a body its
            // content-length undercounted, a close) must never have those bytes read as the
            // next request's answer. The probe reads the socket itself (the reactor's readiness
            // is still set from the last response's read, so it is never skipped on a stale
            // flag): one non-blocking `recv` per reused connection.
            match c.io.probe() {
                IdleState::Alive => return Some((c.io, c.buf)),
                IdleState::Closed => {}
                IdleState::Stray => {
                    drop(p);
                    self.stray(key, now, on_stray);
                    return None;
                }
            }
        }
        None
    }

    /// The worker at `key` wrote after a finished response: close its idle connections and
    /// reuse none for [`STRAY_QUARANTINE`].
    pub(super) fn stray(&self, key: &Key, now: Instant, on_stray: &Option<StrayHook>) {
        tracing::warn!(
            worker = %key.authority,
            "worker wrote bytes after a finished response; its connections are not reused for {:?}",
            STRAY_QUARANTINE
        );
        {
            let mut p = self.stacks();
            p.idle.remove(key);
            p.quarantined.insert(key.clone(), now + STRAY_QUARANTINE);
        }
        if let Some(hook) = on_stray {
            hook(&key.authority);
        }
    }

    pub(super) fn checkin(
        &self,
        key: Key,
        io: Conn,
        buf: BytesMut,
        now: Instant,
        idle: Duration,
        max: usize,
    ) {
        if max == 0 || idle.is_zero() {
            return;
        }
        let mut p = self.stacks();
        // Almost always empty: no hashing of the key on the usual path.
        if !p.quarantined.is_empty() {
            if let Some(&until) = p.quarantined.get(&key) {
                if now < until {
                    return;
                }
                p.quarantined.remove(&key);
            }
        }
        let stack = p.idle.entry(key).or_default();
        if stack.len() >= max {
            stack.remove(0);
        }
        stack.push(Idle {
            io,
            buf,
            expires: now + idle,
        });
    }

    /// Close the idle connections whose idle time is over (the gateway's io threads call this
    /// every second, so connections to a worker that gets no more traffic do not stay open).
    pub fn evict_idle(&self, now: Instant) {
        let mut p = self.stacks();
        p.idle.retain(|_, stack| {
            stack.retain(|c| c.expires > now);
            !stack.is_empty()
        });
        p.quarantined.retain(|_, until| *until > now);
    }

    /// Idle connections to `authority` (plain or TLS).
    pub fn idle_count(&self, authority: &Authority) -> usize {
        self.stacks()
            .idle
            .iter()
            .filter(|(k, _)| k.authority.as_str() == authority.as_str())
            .map(|(_, s)| s.len())
            .sum()
    }

    /// The newest idle connection's read buffer for `key`: (empty, capacity) (tests).
    #[cfg(test)]
    pub(crate) fn newest_buf(&self, key: &Key) -> Option<(bool, usize)> {
        let p = self.stacks();
        let c = p.idle.get(key)?.last()?;
        Some((c.buf.is_empty(), c.buf.capacity()))
    }
}

/// The future of [`Pool::within`]. It holds the pool's timer once the wrapped future was
/// pending, and gives it back when it ends or is dropped (still registered; a second timer, from
/// calls at once, is dropped).
pub struct Within<'a, F: ?Sized> {
    pool: &'a Pool,
    deadline: tokio::time::Instant,
    fut: Pin<&'a mut F>,
    timer: Option<Pin<Box<Sleep>>>,
    /// The pool's timer was asked for (once per call).
    taken: bool,
}

impl<F: Future + ?Sized> Future for Within<'_, F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Poll::Ready(v) = this.fut.as_mut().poll(cx) {
            return Poll::Ready(Some(v));
        }
        let deadline = this.deadline;
        if !this.taken {
            this.taken = true;
            this.timer = this.pool.stacks().timer.take();
        }
        let t = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if t.deadline() > deadline {
            t.as_mut().reset(deadline);
        }
        loop {
            if t.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if t.deadline() >= deadline {
                return Poll::Ready(None);
            }
            // Armed for an earlier call: not this deadline yet.
            t.as_mut().reset(deadline);
        }
    }
}

impl<F: ?Sized> Drop for Within<'_, F> {
    fn drop(&mut self) {
        if let Some(t) = self.timer.take() {
            let mut p = self.pool.stacks();
            if p.timer.is_none() {
                p.timer = Some(t);
            }
        }
    }
}
