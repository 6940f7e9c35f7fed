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
//! `a_release_nobody_can_use_wakes_each_waiter_once` in `route.rs`). A release made while a
//! request's selection runs finds it outside the queue: the selection reads the release count
//! first ([`Admission::generation`]) and, once queued, the best waiter that has not tried the
//! missed release is woken for it ([`Admission::wait_observed`]; the test
//! `a_release_during_the_selection_is_not_lost`), so freed capacity never idles beside a queue.
//!
//! When the queue is full, a newcomer of a higher class takes the place of the lowest-ranked
//! waiter of a lower class (that one is shed); sheddable classes (priority < 0) queue only up to
//! their own `queue_size` (default 0: shed when the fleet is full).
//!
//! Cluster mode (docs/flow-control.md, "Cluster mode"): the queue publishes its best waiter per
//! pool and its class clocks (`publish_heads`, `report`), applies the peers' reports
//! (`apply_peer`: their tenants' usage charged here, clocks moved up), and a request that finds
//! capacity leaves it to a peer's better-ranked waiter (`peer_ahead`). With the bus down the
//! peers' reports stop counting at once: each replica orders its own queue.

use std::cmp::Ordering as Cmp;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvgate_cluster::{Cluster, FlowHead, FlowReport, FlowUsage, Message};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
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
    /// Its start tag where ranks compare between replicas (fair classes), else NaN.
    tag: f64,
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

crate::thread_cache::cached_load!(fn cached_policy(FlowPolicy));

pub struct Admission {
    queue: Mutex<Queue>,
    /// Read through [`Admission::policy`] on the request path (each thread keeps the last
    /// policy it read).
    policy: Arc<ArcSwap<FlowPolicy>>,
    /// The policy forwards the priority to some worker kind (flow control on and
    /// `forward_priority` not empty): the requests of the default setup (off) skip loading the
    /// policy for the engine priority and the lanes.
    forwards: AtomicBool,
    next_ticket: AtomicU64,
    max_len: AtomicUsize,
    timeout_ms: AtomicU64,
    /// Wake-ups delivered (releases and passes), for tests and the admin state.
    wakeups: AtomicU64,
    /// Deadlines are ranked as ms since this instant.
    epoch: Instant,
    /// Tickets numbered below this arrived before flow control was last turned off: they rank
    /// as the off mode's arrivals do (`off_priority`, then arrival), so no later arrival passes
    /// them (`set_policy`).
    reset_below: AtomicU64,
    off_priority: AtomicI32,
    /// Cluster mode: where our queue heads, clocks and usage go (`cluster.rs`).
    cluster: OnceLock<Arc<Cluster>>,
    /// Whether the bus was up at the last look (a change is logged once).
    bus_up: AtomicBool,
    /// `kvgate_flow_cluster_deferrals_total`, `kvgate_flow_cluster_fallback_total`.
    deferrals: Counter,
    fallback: Counter,
    /// `Queue::generation`, readable without the lock ([`Admission::generation`]).
    released: AtomicU64,
}

struct Queue {
    waiters: Vec<Waiter>,
    /// Releases so far.
    generation: Generation,
    clocks: HashMap<Arc<str>, ClassClock>,
    /// Cluster mode: each peer replica's best waiter per pool, as last reported, and when.
    peers: HashMap<String, (Instant, Vec<FlowHead>)>,
    /// Cluster mode: tokens admitted per (class, tenant) since the last report.
    usage: HashMap<(Arc<str>, Option<Arc<str>>), u64>,
    /// The heads we last published (a change is published at once).
    published: Vec<FlowHead>,
    /// A waiter left capacity to a peer's better waiter: the peer's next report wakes the queue.
    deferred: bool,
}

/// Most (class, tenant) usage entries in one report (the rest wait for the next): keeps a report
/// well inside `cluster.max_message_bytes` whatever the tenants' names.
const MAX_USAGE_ENTRIES: usize = 1024;

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
        if self.adm.cluster.get().is_some() {
            *q.usage
                .entry((self.class.name.clone(), self.tenant.clone()))
                .or_default() += self.tokens;
        }
    }

    /// The start tag peers compare with theirs (fair classes), else NaN.
    fn tag(&self) -> f64 {
        match self.class.order {
            ClassOrder::Fair => self.rank.first,
            ClassOrder::Deadline => f64::NAN,
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
                peers: HashMap::new(),
                usage: HashMap::new(),
                published: Vec::new(),
                deferred: false,
            }),
            policy: Arc::new(ArcSwap::from_pointee(FlowPolicy::default())),
            forwards: AtomicBool::new(false),
            next_ticket: AtomicU64::new(1),
            max_len: AtomicUsize::new(max_len),
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            wakeups: AtomicU64::new(0),
            epoch: crate::clock::now(),
            reset_below: AtomicU64::new(0),
            off_priority: AtomicI32::new(0),
            cluster: OnceLock::new(),
            bus_up: AtomicBool::new(true),
            deferrals: Counter::default(),
            fallback: Counter::default(),
            released: AtomicU64::new(0),
        }
    }

    /// The registered `kvgate_flow_cluster_deferrals_total` and `..._fallback_total` counters.
    pub fn with_counters(mut self, deferrals: Counter, fallback: Counter) -> Self {
        self.deferrals = deferrals;
        self.fallback = fallback;
        self
    }

    /// `admission.queue_size` and `admission.queue_timeout_ms` (reload).
    pub fn configure(&self, max_len: usize, timeout: Duration) {
        self.max_len.store(max_len, Ordering::Relaxed);
        self.timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    /// A new `[flow_control]` policy (start, reload). Waiters keep their rank; fair-queueing
    /// clocks of classes that no longer exist are dropped.
    ///
    /// Turning flow control off: from then on requests rank by arrival in one class, and the
    /// waiters queued before keep their places ahead of every later arrival (their ranks count
    /// as the off mode's, by arrival), whatever their tags were.
    pub fn set_policy(&self, policy: FlowPolicy) {
        let mut q = self.queue.lock();
        q.clocks
            .retain(|name, _| policy.classes.iter().any(|c| &c.name == name));
        if self.policy.load().enabled && !policy.enabled {
            self.off_priority
                .store(policy.class(0).priority, Ordering::Relaxed);
            self.reset_below
                .store(self.next_ticket.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.forwards.store(
            policy.enabled && !policy.forward_priority.is_empty(),
            Ordering::Relaxed,
        );
        self.policy.store(Arc::new(policy));
    }

    /// Whether any worker kind gets the priority forwarded (see [`FlowPolicy::forwards_to`]):
    /// when not, neither the engine priority nor the lanes apply, and the policy need not be read.
    pub fn forwards(&self) -> bool {
        self.forwards.load(Ordering::Relaxed)
    }

    /// A rank as it compares now: tickets from before flow control was turned off rank by
    /// arrival in the off mode's class.
    fn eff(&self, r: &Rank) -> Rank {
        if r.id < self.reset_below.load(Ordering::Relaxed) {
            Rank {
                priority: self.off_priority.load(Ordering::Relaxed),
                first: 0.0,
                second: 0.0,
                id: r.id,
            }
        } else {
            *r
        }
    }

    fn before(&self, a: &Rank, b: &Rank) -> bool {
        self.eff(a).before(&self.eff(b))
    }

    fn cmp(&self, a: &Rank, b: &Rank) -> Cmp {
        self.eff(a).cmp(&self.eff(b))
    }

    /// The `[flow_control]` policy now in force, read through this thread's cache (a reload is
    /// seen at the next read, as with a load).
    pub fn policy(&self) -> Arc<FlowPolicy> {
        cached_policy(&self.policy)
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
        let policy = self.policy();
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
            .any(|w| w.pool == t.pool && self.before(&w.rank, &t.rank))
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
        self.wait_observed(t, seen, None, deadline, kick).await
    }

    /// The release count now: read before a selection and passed to
    /// [`Admission::wait_observed`], which then catches a release made while that selection
    /// ran (its waiter was not in the queue yet to be woken).
    pub fn generation(&self) -> Generation {
        self.released.load(Ordering::Acquire)
    }

    fn next_release(&self, q: &mut Queue) -> Generation {
        q.generation += 1;
        self.released.store(q.generation, Ordering::Release);
        q.generation
    }

    /// [`Admission::wait`] for a caller whose selection began at release `observed`
    /// ([`Admission::generation`]): a release since then found this waiter outside the queue, so
    /// once queued the best waiter that has not tried it is woken for it (maybe this one). Without
    /// that, capacity freed between a selection that saw none and the queueing went unused until
    /// the next release (a newcomer could wait its whole timeout beside an idle worker).
    pub async fn wait_observed(
        &self,
        t: &Ticket<'_>,
        seen: Option<Generation>,
        observed: Option<Generation>,
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
                    tag: t.tag(),
                    pool: t.pool,
                    class: t.class.name.clone(),
                    tenant: t.tenant_label.clone(),
                    seen: seen.unwrap_or(0),
                    tx,
                });
            }
            // Refused or queued, the free capacity seen is offered to the waiters.
            if kick {
                let g = self.next_release(&mut q);
                self.wake_best(&mut q, g);
            } else if room.is_ok() && observed.is_some_and(|o| q.generation > o) {
                let g = q.generation;
                self.wake_best(&mut q, g);
            }
            self.publish_heads(&mut q);
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
            .filter(|(_, w)| self.eff(&w.rank).priority < self.eff(&t.rank).priority)
            .max_by(|a, b| self.cmp(&a.1.rank, &b.1.rank))
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
        let g = self.next_release(&mut q);
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
                .min_by(|a, b| self.cmp(&a.1.rank, &b.1.rank))
                .map(|(i, _)| i);
            let Some(i) = best else { return };
            let w = q.waiters.swap_remove(i);
            if w.tx.send(Wake::Go(g)).is_ok() {
                self.wakeups.fetch_add(1, Ordering::Relaxed);
                self.publish_heads(q);
                return;
            }
        }
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    // ---- Cluster mode (docs/flow-control.md, "Cluster mode") ----

    /// Cluster mode on: our queue heads, clocks and usage are shared over `cluster` from now on.
    pub fn set_cluster(&self, cluster: Arc<Cluster>) {
        let _ = self.cluster.set(cluster);
    }

    /// Whether peers' reports count now: cluster mode with flow control on and the bus up. With
    /// the bus down each replica orders its own queue alone (a change is logged once).
    fn peers_count(&self) -> Option<&Arc<Cluster>> {
        let c = self.cluster.get()?;
        if !self.policy.load().enabled {
            return None;
        }
        let up = c.connected();
        if self.bus_up.swap(up, Ordering::Relaxed) != up {
            if up {
                tracing::info!(
                    "flow control: NATS back; shares and class order are cluster-wide again"
                );
            } else {
                tracing::warn!(
                    "flow control: NATS down; shares and class order fall back to this replica's own queue"
                );
            }
        }
        up.then_some(c)
    }

    /// A request admitted while cluster mode is on but the bus is down (decided on this
    /// replica's own view): counted in `kvgate_flow_cluster_fallback_total`.
    pub fn note_admitted(&self) {
        if self.cluster.get().is_some()
            && self.policy.load().enabled
            && self.peers_count().is_none()
        {
            self.fallback.inc();
        }
    }

    /// Whether a peer replica's best waiter of the ticket's pool ranks before it (a higher
    /// class, or the same fair class with a smaller start tag): then the capacity this replica
    /// sees free is left to it (the peer hears of it from our load deltas). Reports older than
    /// two heartbeats are not trusted.
    pub fn peer_ahead(&self, t: &Ticket<'_>) -> bool {
        let Some(c) = self.peers_count() else {
            return false;
        };
        let fresh = 2 * c.config().heartbeat_interval;
        let me = self.eff(&t.rank);
        let tag = if t.rank.id < self.reset_below.load(Ordering::Relaxed) {
            f64::NAN
        } else {
            t.tag()
        };
        let now = crate::clock::now();
        let mut q = self.queue.lock();
        let ahead = q.peers.values().any(|(at, heads)| {
            now.saturating_duration_since(*at) <= fresh
                && ranks_before(heads, t.pool, me.priority, tag)
        });
        if ahead {
            q.deferred = true;
            self.deferrals.inc();
        }
        ahead
    }

    /// Our best waiter per pool.
    fn heads(&self, q: &Queue) -> Vec<FlowHead> {
        let reset = self.reset_below.load(Ordering::Relaxed);
        let mut best: Vec<(&Waiter, Rank)> = Vec::new();
        for w in &q.waiters {
            let r = self.eff(&w.rank);
            match best.iter_mut().find(|(b, _)| b.pool == w.pool) {
                Some(b) if r.before(&b.1) => *b = (w, r),
                Some(_) => {}
                None => best.push((w, r)),
            }
        }
        let mut heads: Vec<FlowHead> = best
            .into_iter()
            .map(|(w, r)| FlowHead {
                pool: w.pool,
                priority: r.priority,
                tag: if w.rank.id < reset { f64::NAN } else { w.tag },
            })
            .collect();
        heads.sort_by_key(|h| h.pool);
        heads
    }

    /// Publish our heads when they changed (cluster mode, flow control on, bus up).
    fn publish_heads(&self, q: &mut Queue) {
        let Some(c) = self.cluster.get() else { return };
        if !self.policy.load().enabled || !c.connected() {
            return;
        }
        let heads = self.heads(q);
        // Bit-equal (NaN tags compare equal to themselves here).
        let same = heads.len() == q.published.len()
            && heads.iter().zip(&q.published).all(|(a, b)| {
                a.pool == b.pool && a.priority == b.priority && a.tag.to_bits() == b.tag.to_bits()
            });
        if same {
            return;
        }
        q.published = heads.clone();
        c.publish(Message::Flow(FlowReport {
            clocks: clocks(q),
            heads,
            usage: Vec::new(),
        }));
    }

    /// The heartbeat's report: clocks, heads and the usage since the last one (`None` with flow
    /// control off).
    pub fn report(&self) -> Option<FlowReport> {
        if !self.policy.load().enabled {
            return None;
        }
        let mut q = self.queue.lock();
        let heads = self.heads(&q);
        q.published = heads.clone();
        let keys: Vec<_> = q.usage.keys().take(MAX_USAGE_ENTRIES).cloned().collect();
        let usage = keys
            .into_iter()
            .filter_map(|k| {
                let tokens = q.usage.remove(&k)?;
                Some(FlowUsage {
                    class: k.0.to_string(),
                    tenant: k.1.as_deref().unwrap_or("").to_owned(),
                    tokens,
                })
            })
            .collect();
        Some(FlowReport {
            clocks: clocks(&q),
            heads,
            usage,
        })
    }

    /// A peer's report: its heads replace what we held of it; each class's virtual time moves up
    /// to the peer's (one clock for the cluster); the tokens it admitted are charged to their
    /// tenants here as if admitted here (so a tenant's share counts every replica). A waiter that
    /// left capacity to that peer tries again.
    pub fn apply_peer(&self, from: &str, report: &FlowReport, now: Instant) {
        let policy = self.policy.load();
        let mut q = self.queue.lock();
        for (class, v) in &report.clocks {
            if let Some(c) = policy.classes.iter().find(|c| &*c.name == class.as_str()) {
                let clock = q.clocks.entry(c.name.clone()).or_default();
                if *v > clock.vtime && v.is_finite() {
                    clock.vtime = *v;
                }
            }
        }
        for u in &report.usage {
            let Some(c) = policy.classes.iter().find(|c| &*c.name == u.class.as_str()) else {
                continue;
            };
            let tenant: Option<Arc<str>> =
                (!u.tenant.is_empty()).then(|| Arc::from(u.tenant.as_str()));
            let weight = policy.weight(tenant.as_deref());
            let clock = q.clocks.entry(c.name.clone()).or_default();
            let last = clock.finish.get(&tenant).copied().unwrap_or(0.0);
            let finish = last.max(clock.vtime) + u.tokens.max(1) as f64 / weight;
            clock.finish.insert(tenant, finish);
        }
        q.peers.insert(from.to_owned(), (now, report.heads.clone()));
        if std::mem::take(&mut q.deferred) {
            let g = self.next_release(&mut q);
            self.wake_best(&mut q, g);
        }
    }

    /// Forget peers not heard from for `timeout` (the cluster's heartbeat timeout).
    pub fn expire_peers(&self, now: Instant, timeout: Duration) {
        self.queue
            .lock()
            .peers
            .retain(|_, (at, _)| now.saturating_duration_since(*at) <= timeout);
    }
}

/// Whether one of a peer's `heads` for `pool` ranks before a request of class `priority` and
/// start tag `tag`: a higher class, or the same class with a smaller tag (NaN: not comparable,
/// so never before).
fn ranks_before(heads: &[FlowHead], pool: u64, priority: i32, tag: f64) -> bool {
    heads.iter().any(|h| {
        h.pool == pool && (h.priority > priority || (h.priority == priority && h.tag < tag))
    })
}

/// Each class's virtual time.
fn clocks(q: &Queue) -> Vec<(String, f64)> {
    q.clocks
        .iter()
        .map(|(name, c)| (name.to_string(), c.vtime))
        .collect()
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
            self.adm.publish_heads(&mut q);
        }
    }
}

#[cfg(test)]
#[path = "admission_tests.rs"]
mod tests;
