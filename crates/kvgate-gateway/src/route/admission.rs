//! Admission control for a busy fleet, with flow control (docs/flow-control.md): when every
//! candidate worker is busy, a request waits in a bounded queue until load is released somewhere
//! (every [`crate::route::router::DispatchGuard`] releases through [`Admission::release`] when
//! dropped) or its wait ends. Past the bounds, requests are shed at once with 429 + `Retry-After`.
//!
//! Who goes first: every request gets a [`Ticket`] on arrival ([`Admission::admit`]) whose rank
//! orders it: strict priority between classes, then inside a class weighted fair sharing of
//! tokens between tenants (start-time fair queueing: a request's tag is
//! `max(class virtual time, its tenant's last finish tag)` and its tenant's finish tag grows by
//! `tokens / weight`; the class's virtual time is the tag of the last request admitted, so a
//! tenant that was idle restarts at the current virtual time and banks no credit), or earliest
//! deadline first in a class ordered by `deadline`.
//!
//! A newcomer that finds a free worker takes it at once, unless a waiter of the same pool ranks
//! before it: then it queues and offers the capacity it saw to the waiters (a "kick", a new
//! release). Each release wakes the best-ranked waiter. A woken waiter that still finds no free
//! worker (the capacity was in another model's pool, or a newcomer took it first) returns to the
//! queue with its rank and passes the wake-up on to the next best waiter that has not yet tried
//! this release ([`Admission::pass_on`]); once every waiter has tried, the wake-up ends. So one
//! release causes at most one selection per waiter (the test
//! `a_release_nobody_can_use_wakes_each_waiter_once` in `route.rs`).
//!
//! When the queue is full, a newcomer of a higher class takes the place of the lowest-ranked
//! waiter of a lower class (that one is shed); sheddable classes (priority < 0) queue only up to
//! their own `queue_size` (default 0: shed when the fleet is full).

use std::cmp::Ordering as Cmp;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::flow::{Class, FlowKey, FlowPolicy};
use crate::config::ClassOrder;

/// A wake-up's release number: a waiter that has tried release `g` is not woken for it again.
pub type Generation = u64;

/// Where a ticket stands in line: lower first. Between classes by priority (higher first), then
/// `first` (start tag, or deadline), `second` (start tag under deadline order), arrival.
#[derive(Debug, Clone, Copy)]
struct Rank {
    priority: i32,
    first: f64,
    second: f64,
    id: u64,
}

impl Rank {
    fn cmp(&self, o: &Rank) -> Cmp {
        o.priority
            .cmp(&self.priority)
            .then(self.first.total_cmp(&o.first))
            .then(self.second.total_cmp(&o.second))
            .then(self.id.cmp(&o.id))
    }

    fn before(&self, o: &Rank) -> bool {
        self.cmp(o) == Cmp::Less
    }
}

enum Wake {
    Go(Generation),
    /// Taken out of the queue for a higher class's request.
    Shed,
}

struct Waiter {
    rank: Rank,
    pool: u64,
    class: Arc<str>,
    tenant: Arc<str>,
    /// The newest release this waiter has already tried (0: none).
    seen: Generation,
    tx: oneshot::Sender<Wake>,
}

/// A class's fair-queueing clock.
#[derive(Default)]
struct ClassClock {
    vtime: f64,
    /// Each tenant's last finish tag (only tenants ahead of `vtime` matter; the rest are pruned).
    finish: HashMap<Option<Arc<str>>, f64>,
    pruned_at: usize,
}

/// Most tenants a class remembers: past it, the half with the smallest finish tags (closest
/// to the virtual time, so the least credit lost) are forgotten.
const MAX_TENANTS: usize = 4096;

impl ClassClock {
    /// Forget tenants with no debt (finish tag at or before the virtual time: they would start at
    /// the virtual time anyway), and past [`MAX_TENANTS`] the half nearest to it.
    fn prune(&mut self) {
        let v = self.vtime;
        self.finish.retain(|_, f| *f > v);
        if self.finish.len() > MAX_TENANTS {
            let mut tags: Vec<f64> = self.finish.values().copied().collect();
            let mid = tags.len() / 2;
            let (_, cut, _) = tags.select_nth_unstable_by(mid, f64::total_cmp);
            let cut = *cut;
            self.finish.retain(|_, f| *f > cut);
        }
        self.pruned_at = self.finish.len();
    }
}

pub struct Admission {
    queue: Mutex<Queue>,
    policy: ArcSwap<FlowPolicy>,
    next_ticket: AtomicU64,
    max_len: AtomicUsize,
    timeout_ms: AtomicU64,
    /// Wake-ups delivered (releases and passes), for tests and the admin state.
    wakeups: AtomicU64,
    /// Deadlines are ranked as ms since this instant.
    epoch: Instant,
}

struct Queue {
    waiters: Vec<Waiter>,
    /// Releases so far.
    generation: Generation,
    clocks: HashMap<Arc<str>, ClassClock>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitError {
    /// The queue (or the class's share of it) is full.
    Full,
    Timeout,
    /// Sheddable, or taken out of the queue for a higher class.
    Shed,
}

/// A request's place in flow control, from arrival to admission. Dropped without
/// [`Ticket::admitted`] (refused, timed out, or the client went away), it gives its tenant back
/// the share it was charged, when nothing was charged after it.
pub struct Ticket<'a> {
    adm: &'a Admission,
    pub class: Arc<Class>,
    pub tenant: Option<Arc<str>>,
    /// The `tenant` metric label (bounded).
    pub tenant_label: Arc<str>,
    /// The TTFT objective this request is held to (ms).
    pub objective_ms: Option<u64>,
    pub tokens: u64,
    /// When the request arrived (its objective counts from here).
    pub arrival: Instant,
    pool: u64,
    rank: Rank,
    finish: f64,
    done: bool,
    /// Flow control on: the ticket was charged to its class's fair-share clock (off: one FIFO
    /// queue by arrival, no clock kept).
    pub fair: bool,
    /// 1 + the waiters ranked before it when it first queued; 0: it has not queued.
    position: AtomicU32,
}

impl Ticket<'_> {
    /// The request got a worker: its class's virtual time moves to its tag.
    pub fn admitted(mut self) {
        self.done = true;
        if !self.fair {
            return;
        }
        let mut q = self.adm.queue.lock();
        if let Some(c) = q.clocks.get_mut(&self.class.name) {
            let start = self.start();
            if start > c.vtime {
                c.vtime = start;
            }
            if c.finish.len() > 2 * c.pruned_at.max(32) {
                c.prune();
            }
        }
    }

    fn start(&self) -> f64 {
        match self.class.order {
            ClassOrder::Fair => self.rank.first,
            ClassOrder::Deadline => self.rank.second,
        }
    }

    /// The rank's priority (the class's).
    pub fn priority(&self) -> i32 {
        self.rank.priority
    }

    /// Its place in line when it first queued (1 = first): `None` if it never queued.
    pub fn position(&self) -> Option<u32> {
        std::num::NonZeroU32::new(self.position.load(Ordering::Relaxed)).map(|p| p.get())
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.done || !self.fair {
            return;
        }
        let start = self.start();
        let mut q = self.adm.queue.lock();
        if let Some(c) = q.clocks.get_mut(&self.class.name) {
            if let Some(f) = c.finish.get_mut(&self.tenant) {
                if *f == self.finish {
                    *f = start;
                }
            }
        }
    }
}

impl Admission {
    pub fn new(max_len: usize, timeout: Duration) -> Self {
        Admission {
            queue: Mutex::new(Queue {
                waiters: Vec::new(),
                generation: 0,
                clocks: HashMap::new(),
            }),
            policy: ArcSwap::from_pointee(FlowPolicy::default()),
            next_ticket: AtomicU64::new(1),
            max_len: AtomicUsize::new(max_len),
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            wakeups: AtomicU64::new(0),
            epoch: crate::clock::now(),
        }
    }

    /// `admission.queue_size` and `admission.queue_timeout_ms` (reload).
    pub fn configure(&self, max_len: usize, timeout: Duration) {
        self.max_len.store(max_len, Ordering::Relaxed);
        self.timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    /// A new `[flow_control]` policy (start, reload). Waiters keep their rank; fair-queueing
    /// clocks of classes that no longer exist are dropped.
    pub fn set_policy(&self, policy: FlowPolicy) {
        let mut q = self.queue.lock();
        q.clocks
            .retain(|name, _| policy.classes.iter().any(|c| &c.name == name));
        self.policy.store(Arc::new(policy));
    }

    /// The `[flow_control]` policy now in force.
    pub fn policy(&self) -> arc_swap::Guard<Arc<FlowPolicy>> {
        self.policy.load()
    }

    pub fn len(&self) -> usize {
        self.queue.lock().waiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waiters per (class, tenant label), for the queue-length gauges.
    pub fn queued(&self) -> Vec<(Arc<str>, Arc<str>, usize)> {
        let q = self.queue.lock();
        let mut out: Vec<(Arc<str>, Arc<str>, usize)> = Vec::new();
        for w in &q.waiters {
            match out
                .iter_mut()
                .find(|(c, t, _)| *c == w.class && *t == w.tenant)
            {
                Some(e) => e.2 += 1,
                None => out.push((w.class.clone(), w.tenant.clone(), 1)),
            }
        }
        out
    }

    /// Wake-ups delivered so far.
    pub fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// A request arrives for pool `pool` (any stable id of the pool): its class, tag and rank.
    /// With flow control off every request is the same class and tenant: arrival order.
    pub fn admit(&self, key: &FlowKey, pool: u64, arrival: Instant) -> Ticket<'_> {
        let policy = self.policy.load();
        let class = policy.class(key.priority).clone();
        let weight = policy.weight(key.tenant.as_deref());
        let objective_ms = policy.objective(key, &class);
        let tenant_label = policy.tenant_label(key.tenant.as_deref());
        let fair = policy.enabled;
        drop(policy);
        let id = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        // Off: every request in one class with no tenant, so the clock's tags only grow with
        // arrival; equal tags rank by arrival (`id`) alike, without the lock and the maps.
        let (start, finish) = if !fair {
            (0.0, 0.0)
        } else {
            let mut q = self.queue.lock();
            let c = q.clocks.entry(class.name.clone()).or_default();
            let last = c.finish.get(&key.tenant).copied().unwrap_or(0.0);
            let start = last.max(c.vtime);
            let finish = start + key.tokens.max(1) as f64 / weight;
            c.finish.insert(key.tenant.clone(), finish);
            (start, finish)
        };
        let (first, second) = match class.order {
            ClassOrder::Fair => (start, 0.0),
            ClassOrder::Deadline => (
                objective_ms.map_or(f64::INFINITY, |o| {
                    arrival.saturating_duration_since(self.epoch).as_secs_f64() * 1000.0 + o as f64
                }),
                start,
            ),
        };
        Ticket {
            adm: self,
            rank: Rank {
                priority: class.priority,
                first,
                second,
                id,
            },
            class,
            tenant: key.tenant.clone(),
            tenant_label,
            objective_ms,
            tokens: key.tokens,
            arrival,
            pool,
            finish,
            done: false,
            fair,
            position: AtomicU32::new(0),
        }
    }

    /// Whether a waiter of the ticket's pool ranks before it (then a newcomer queues behind it).
    pub fn ahead(&self, t: &Ticket<'_>) -> bool {
        self.queue
            .lock()
            .waiters
            .iter()
            .any(|w| w.pool == t.pool && w.rank.before(&t.rank))
    }

    /// Wait for a wake-up; returns the release it is for. `seen` is `Some(g)` for a waiter that
    /// was woken for release `g` and found nothing free: it re-queues with its rank and is not
    /// woken for `g` again (the bounds were checked when it first queued). `kick`: the caller saw
    /// free capacity that a better-ranked waiter should have: a new release once it is queued.
    /// `deadline` bounds the total wait across re-queues.
    pub async fn wait(
        &self,
        t: &Ticket<'_>,
        seen: Option<Generation>,
        deadline: tokio::time::Instant,
        kick: bool,
    ) -> Result<Generation, WaitError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut q = self.queue.lock();
            let room = match seen {
                None => self.make_room(&mut q, t),
                Some(_) => Ok(()),
            };
            if room.is_ok() {
                if seen.is_none() {
                    let ahead = q.waiters.iter().filter(|w| w.rank.before(&t.rank)).count();
                    t.position
                        .store(ahead.saturating_add(1) as u32, Ordering::Relaxed);
                }
                q.waiters.push(Waiter {
                    rank: t.rank,
                    pool: t.pool,
                    class: t.class.name.clone(),
                    tenant: t.tenant_label.clone(),
                    seen: seen.unwrap_or(0),
                    tx,
                });
            }
            // Refused or queued, the free capacity seen is offered to the waiters.
            if kick {
                q.generation += 1;
                let g = q.generation;
                self.wake_best(&mut q, g);
            }
            room?;
        }
        // Leave the queue on every exit (timeout, or the waiting future dropped on disconnect).
        let _leave = Leave {
            adm: self,
            id: t.rank.id,
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(Wake::Go(g))) => Ok(g),
            Ok(Ok(Wake::Shed)) => Err(WaitError::Shed),
            // The sender is only dropped with the queue entry, which `Leave` removes: unreachable
            // while we wait, but a timeout is the honest answer if it ever happens.
            Ok(Err(_)) | Err(_) => Err(WaitError::Timeout),
        }
    }

    /// The bounds for a newcomer: its class's `queue_size`, then `admission.queue_size`, where a
    /// waiter of a lower class gives way (the lowest-ranked one is shed).
    fn make_room(&self, q: &mut Queue, t: &Ticket<'_>) -> Result<(), WaitError> {
        let refuse = if t.class.sheddable() {
            WaitError::Shed
        } else {
            WaitError::Full
        };
        if let Some(max) = t.class.queue_size {
            let n = q.waiters.iter().filter(|w| w.class == t.class.name).count();
            if n >= max {
                return Err(refuse);
            }
        }
        if q.waiters.len() < self.max_len.load(Ordering::Relaxed) {
            return Ok(());
        }
        let worst = q
            .waiters
            .iter()
            .enumerate()
            .filter(|(_, w)| w.rank.priority < t.rank.priority)
            .max_by(|a, b| a.1.rank.cmp(&b.1.rank))
            .map(|(i, _)| i);
        match worst {
            Some(i) => {
                let w = q.waiters.swap_remove(i);
                let _ = w.tx.send(Wake::Shed);
                Ok(())
            }
            None => Err(refuse),
        }
    }

    /// Load was released somewhere: wake the best-ranked waiter (a new release: everyone may
    /// try it).
    pub fn release(&self) {
        let mut q = self.queue.lock();
        q.generation += 1;
        let g = q.generation;
        self.wake_best(&mut q, g);
    }

    /// A waiter woken for release `g` found nothing free: wake the next best waiter that has not
    /// tried `g` yet (none left: the wake-up ends here).
    pub fn pass_on(&self, g: Generation) {
        let mut q = self.queue.lock();
        self.wake_best(&mut q, g);
    }

    fn wake_best(&self, q: &mut Queue, g: Generation) {
        loop {
            let best = q
                .waiters
                .iter()
                .enumerate()
                .filter(|(_, w)| w.seen < g)
                .min_by(|a, b| a.1.rank.cmp(&b.1.rank))
                .map(|(i, _)| i);
            let Some(i) = best else { return };
            let w = q.waiters.swap_remove(i);
            if w.tx.send(Wake::Go(g)).is_ok() {
                self.wakeups.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }
}

struct Leave<'a> {
    adm: &'a Admission,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut q = self.adm.queue.lock();
        if let Some(i) = q.waiters.iter().position(|w| w.rank.id == self.id) {
            q.waiters.swap_remove(i);
        }
    }
}

#[cfg(test)]
#[path = "admission_tests.rs"]
mod tests;
