//! The decision component: which worker serves a request, and (prefill/decode pools) how its
//! handoff is planned. No HTTP here (`tests/layout.rs` checks it): a front end (the proxy's route
//! table today; an Envoy ext_proc endpoint picker next) parses its request into a pool and a
//! [`RouteInput`], asks for a [`Reservation`], and carries it out; execution (the proxy hop, the PD
//! legs) lives in `proxy/`.
//!
//! - [`Decider::reserve`]: pick (the core policy over the pool's candidates) → dispatch (the load
//!   guard), waiting in the admission queue while every candidate is busy. A reservation holds the
//!   pick and its load; dropping it releases the load and wakes the queue, whatever the path.
//! - [`Decider::try_reserve`]: the same without queueing (prefill legs: a busy prefill pool means
//!   "run it locally", not "wait").
//! - [`Decider::plan_pd`]: for a pool with prefill workers, whether this request runs whole on a
//!   decode worker (and why) or is split, and on which prefill pool ([`PdPlan`]).
//! - `router.rs`: the selection and the dispatch guard; `admission.rs`: the busy-fleet queue and
//!   its flow control (classes, tenant shares, objectives); `flow.rs`: the `[flow_control]`
//!   policy and the [`FlowKey`] a front end builds per request.

pub mod admission;
pub mod flow;
pub mod router;
pub mod speeds;

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvgate_core::WorkerId;
use tokio_util::sync::CancellationToken;

use crate::config::{Handoff, OnMiss, PdConfig};
use crate::metrics::Metrics;
use crate::registry::Pool;
use admission::{Generation, Ticket, WaitError};
pub use flow::FlowKey;
use router::{DispatchGuard, Lane, Leg, NoPick, Pick, Router};

/// What routing needs of one request: its prompt's chained block hashes, its length in tokens
/// and its affinity key: the session it belongs to (a session header, `prompt_cache_key`, the
/// session of Anthropic `metadata.user_id`), hashed. `consistent_hash` routes on the key; the cost
/// policies prefer the session's last worker by `routing.session_affinity_blocks`. Built by each
/// client API from its own request shape.
#[derive(Debug, Default)]
pub struct RouteInput {
    pub hashes: Vec<u64>,
    pub isl: u64,
    pub affinity: Option<u64>,
    /// Flow control: priority, tenant, objective and token cost (the front ends' `flow::key` builds it
    /// from the request's headers and API key; the default is priority 0, no tenant).
    pub flow: FlowKey,
    /// How many top candidates the decision lists with its reason ([`router::Pick::explain`]),
    /// and whether a queued request learns its place ([`Reservation::queued`]): a sampled trace
    /// asks (`tracing.route_candidates`); 0 (the default) costs nothing.
    pub explain: u8,
}

/// Why no worker was reserved; each front end renders it in its own error shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No routable worker for the pool (all unhealthy, draining, open breakers, or all tried).
    NoWorker(String),
    /// Every worker busy and the queue at `admission.queue_size`: shed at once.
    QueueFull,
    /// Waited past `admission.queue_timeout_ms`.
    QueueTimeout,
    /// The gateway is shutting down: queued requests leave at once.
    ShuttingDown,
    /// Flow control: a sheddable request while the fleet is saturated, or a lower class's waiter
    /// that gave its place to a higher class (429 + `Retry-After`).
    Shed,
    /// Flow control: the request's TTFT objective cannot be met (predicted, or its wait passed
    /// it) and its class says `on_miss = "reject"` (429 + `Retry-After`).
    ObjectiveUnreachable,
}

/// A worker chosen for a request, with the request's load held on it. Dropping it (request
/// finished, failed, cancelled, or a retry elsewhere) releases the load and wakes the queue.
pub struct Reservation {
    pub pick: Pick,
    pub guard: DispatchGuard,
    /// When the load was placed (the decision's end).
    pub at: Instant,
    /// The request waited in the admission queue, and asked to know where
    /// ([`RouteInput::explain`]): its class, tenant and place in line.
    pub queued: Option<Queued>,
}

/// Where a request stood in the admission queue when it joined it.
#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    /// Flow control's class and tenant label (with flow control off: `default`, no tenant).
    pub class: Arc<str>,
    pub tenant: Arc<str>,
    /// 1 + the waiters ranked before it then (every pool's).
    pub position: u32,
    /// Whether flow control was on (ranks by class and tenant share; off: arrival order).
    pub flow_control: bool,
}

/// How a request to a prefill/decode pool runs.
pub enum PdPlan {
    /// Whole on a decode worker, for `reason` (the `kvgate_pd_decisions_total` label).
    Local(&'static str),
    /// Split: a prefill leg on `prefill` with `protocol`, then the decode leg.
    Split {
        prefill: Arc<Pool>,
        protocol: Handoff,
        /// The prefill pick the idle-decode comparison already made: the first prefill
        /// attempt's pick, not selected a second time.
        first_prefill: Option<Pick>,
    },
}

/// A prefill/decode pool's plan: the decode workers (the request's pool from now on) and how it
/// runs.
pub struct PdRoute {
    pub decode: Arc<Pool>,
    pub plan: PdPlan,
}

/// The decision component, built from the router (fleet state), the `[pd]` settings, the metrics
/// and the shutdown signal; shared by every front end.
pub struct Decider {
    router: Arc<Router>,
    pd: ArcSwap<PdConfig>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
}

impl Decider {
    pub fn new(
        router: Arc<Router>,
        pd: &PdConfig,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> Decider {
        Decider {
            router,
            pd: ArcSwap::from_pointee(pd.clone()),
            metrics,
            shutdown,
        }
    }

    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// The `[pd]` settings now in force.
    pub fn pd(&self) -> Arc<PdConfig> {
        self.pd.load_full()
    }

    /// A reloaded `[pd]` section.
    pub fn set_pd(&self, pd: &PdConfig) {
        self.pd.store(Arc::new(pd.clone()));
    }

    /// Choose a worker of `pool` (not in `exclude`) and place the request's load on it, waiting in
    /// the admission queue while every candidate is busy. `at` is when the decision started (the
    /// first selection is made as of then; selections after a wait read the clock again); the
    /// time spent queued is added to `queue_wait`.
    pub async fn reserve(
        &self,
        pool: &Pool,
        input: &RouteInput,
        exclude: &[WorkerId],
        at: Instant,
        leg: Leg,
        queue_wait: &mut Duration,
    ) -> Result<Reservation, Refusal> {
        let router = &self.router;
        let adm = router.admission();
        let ticket = adm.admit(&input.flow, pool_key(pool), at);
        // The flow metric's labels, kept only when flow control records them (`fair`) or the
        // trace's queue span names them (a sampled request).
        let fair = ticket.fair;
        let labels = (fair || input.explain > 0).then(|| {
            (
                ticket.class.name.clone(),
                ticket.tenant_label.clone(),
                ticket.tokens,
            )
        });
        let waited_before = *queue_wait;
        let lane = self.lane(&ticket, pool);
        let result = wait_for_pick(
            adm,
            &self.shutdown,
            at,
            ticket,
            |now| {
                router.select_for(
                    pool,
                    &input.hashes,
                    input.isl,
                    input.affinity,
                    exclude,
                    now,
                    leg,
                    lane,
                    input.explain,
                )
            },
            |p: &Pick| p.estimate.predicted_ms,
            queue_wait,
        )
        .await;
        let outcome = match &result {
            Ok(a) if a.missed_objective => "admitted_best_effort",
            Ok(_) => "admitted",
            Err(r) => refusal_outcome(r),
        };
        // `kvgate_flow_*` are flow control's (on); off, `kvgate_queue_wait_seconds` has the wait.
        if let Some((class, tenant, tokens)) = labels.as_ref().filter(|_| fair) {
            self.metrics.flow.record(
                class,
                tenant,
                outcome,
                queue_wait.saturating_sub(waited_before),
                result.is_ok().then_some(*tokens),
            );
        }
        let admitted = result.map_err(|e| match e {
            Refusal::NoWorker(_) => {
                Refusal::NoWorker(format!("no routable worker for model `{}`", pool.model))
            }
            other => other,
        })?;
        let queued = admitted
            .position
            .filter(|_| input.explain > 0)
            .zip(labels)
            .map(|(position, (class, tenant, _))| Queued {
                class,
                tenant,
                position,
                flow_control: fair,
            });
        let pick = admitted.pick;
        let now = crate::clock::now();
        let guard = router.dispatch(&pick, &input.hashes, input.isl, pool.block_size, now);
        if lane == Lane::Priority {
            guard.hold_priority_prefill();
        }
        router.note_session(input.affinity, &pick.worker, now);
        Ok(Reservation {
            pick,
            guard,
            at: now,
            queued,
        })
    }

    /// The request's [`Lane`]: flow control lets classes at or above
    /// `flow_control.bypass_busy_priority` past the busy bound of pools whose every worker gets
    /// the priority forwarded (they schedule by it), and keeps the lower classes of such pools
    /// out of their way.
    fn lane(&self, t: &Ticket<'_>, pool: &Pool) -> Lane {
        if !self.router.admission().forwards() {
            return Lane::Any;
        }
        let p = self.router.admission().policy();
        let Some(b) = p.bypass_busy_priority.filter(|_| p.enabled) else {
            return Lane::Any;
        };
        if pool.workers.is_empty() || !pool.workers.iter().all(|w| p.forwards_to(w.kind.as_str())) {
            return Lane::Any;
        }
        if t.priority() >= b {
            Lane::Priority
        } else {
            Lane::Below
        }
    }

    /// [`Decider::reserve`] without queueing: `Err` at once when no worker is free.
    pub fn try_reserve(
        &self,
        pool: &Pool,
        input: &RouteInput,
        exclude: &[WorkerId],
        now: Instant,
    ) -> Result<Reservation, NoPick> {
        let pick = self.select(pool, input, exclude, now)?;
        Ok(self.place(pick, pool, input, now))
    }

    /// A pick made earlier (see [`PdPlan::Split`]'s `first_prefill`), its load placed now.
    pub fn place(&self, pick: Pick, pool: &Pool, input: &RouteInput, now: Instant) -> Reservation {
        let guard = self
            .router
            .dispatch(&pick, &input.hashes, input.isl, pool.block_size, now);
        self.router.note_session(input.affinity, &pick.worker, now);
        Reservation {
            pick,
            guard,
            at: now,
            queued: None,
        }
    }

    /// The request's load placed on `worker`, a member of `pool` chosen by someone else (the
    /// endpoint picker's gateway served the request on a fallback endpoint): its overlap and TTFT
    /// estimate as a selection restricted to it sees them, or none when it counts as busy or
    /// unroutable there (the load is placed all the same: the request is running on it).
    pub fn reserve_on(
        &self,
        pool: &Pool,
        input: &RouteInput,
        worker: &Arc<crate::registry::Worker>,
        now: Instant,
    ) -> Reservation {
        let others: Vec<WorkerId> = pool
            .workers
            .iter()
            .map(|w| w.id)
            .filter(|id| *id != worker.id)
            .collect();
        let pick = match self.select(pool, input, &others, now) {
            Ok(p) if p.worker.id == worker.id => p,
            _ => Pick {
                worker: worker.clone(),
                decision: kvgate_core::Decision {
                    worker: worker.id,
                    cost: 0.0,
                    overlap_blocks: 0,
                    predicted_hit_ratio: 0.0,
                    share: 1.0,
                },
                estimate: kvgate_core::TtftEstimate::default(),
                explain: None,
            },
        };
        self.place(pick, pool, input, now)
    }

    /// Choose a worker without placing load (a plan's comparison; [`Decider::place`] makes it a
    /// reservation).
    pub fn select(
        &self,
        pool: &Pool,
        input: &RouteInput,
        exclude: &[WorkerId],
        now: Instant,
    ) -> Result<Pick, NoPick> {
        self.router.select_for(
            pool,
            &input.hashes,
            input.isl,
            input.affinity,
            exclude,
            now,
            Leg::Whole,
            Lane::Any,
            input.explain,
        )
    }

    /// Plan a request to a prefill/decode pool (docs/routing.md §9; the steps are in `pd.rs`).
    /// `Err` when the pool has no decode-capable worker.
    pub fn plan_pd(
        &self,
        pool: &Pool,
        input: &RouteInput,
        now: Instant,
    ) -> Result<PdRoute, Refusal> {
        let settings = self.pd.load();
        let roles = crate::pd::roles(pool);
        let decode = roles.decode.clone();
        if decode.workers.is_empty() {
            return Err(Refusal::NoWorker(format!(
                "no decode worker for model `{}`",
                pool.model
            )));
        }
        let prefill = roles.prefill.clone();
        let bs = u64::from(pool.block_size);
        let (uncached, crowded, idle_estimate) = match self.select(&decode, input, &[], now) {
            Ok(pick) => {
                let uncached = input
                    .isl
                    .saturating_sub(u64::from(pick.decision.overlap_blocks) * bs);
                // Nothing in flight there (as the router counts it, peers' requests included):
                // the request's TTFT estimate if that worker ran it whole.
                let idle = pick.estimate.step_ms == 0.0
                    && pick
                        .worker
                        .state
                        .inflight
                        .load(std::sync::atomic::Ordering::Relaxed)
                        == 0;
                (
                    uncached,
                    crate::pd::crowded(&roles, &pick.worker),
                    idle.then_some(pick.estimate),
                )
            }
            // Every decode worker busy: a short prompt still skips the handoff (it waits for a
            // decode worker either way).
            Err(_) => (input.isl, false, None),
        };
        let local = |reason| PdRoute {
            decode: decode.clone(),
            plan: PdPlan::Local(reason),
        };
        let mut first_prefill = None;
        if settings.min_uncached_tokens > 0 && uncached < settings.min_uncached_tokens {
            if !crowded {
                return Ok(local("short_prompt"));
            }
            // The worker holding the prompt already has more than its share of the decode
            // pool's requests: local runs of one shared prompt would pile there, while a
            // disaggregated request's decode leg goes where decode load is least.
            self.metrics.pd.local_declined.inc();
        } else if settings.min_uncached_tokens > 0 && settings.local_on_idle_decode {
            // A long prompt on an idle decode worker: a prefill there holds up no stream, so it
            // runs there whole unless the prefill worker the handoff would use is predicted to
            // give the first token sooner (a longer cached prefix there, net of its queue); the
            // handoff's own cost is not counted.
            if let Some(local_estimate) = idle_estimate {
                if let Ok(pp) = self.select(&prefill, input, &[], now) {
                    // Both at the prefill worker's learned speed: a decode worker learns its own
                    // prefill speed only from the requests it runs whole (a disaggregated
                    // request's first token there follows another worker's prefill).
                    let speed = self.router.speed(pp.worker.id);
                    if local_estimate.at_speed(speed) <= pp.estimate.predicted_ms {
                        return Ok(local("decode_idle"));
                    }
                    first_prefill = Some(pp);
                }
            }
        }
        let protocol = crate::pd::protocol_for(settings.protocol, &prefill);
        Ok(PdRoute {
            decode,
            plan: PdPlan::Split {
                prefill,
                protocol,
                first_prefill,
            },
        })
    }
}

/// A stable id of a pool for the queue (its model name).
fn pool_key(pool: &Pool) -> u64 {
    xxhash_rust::xxh3::xxh3_64(pool.model.as_bytes())
}

/// The `outcome` label of `kvgate_flow_requests_total` for a refusal.
fn refusal_outcome(r: &Refusal) -> &'static str {
    match r {
        Refusal::NoWorker(_) => "no_worker",
        Refusal::QueueFull => "queue_full",
        Refusal::QueueTimeout => "queue_timeout",
        Refusal::ShuttingDown => "shutting_down",
        Refusal::Shed => "shed",
        Refusal::ObjectiveUnreachable => "objective_rejected",
    }
}

/// A pick that passed admission; `missed_objective`: served best-effort although its predicted
/// TTFT misses its objective; `position`: its place in line when it queued (`None`: it did not).
#[derive(Debug, PartialEq)]
struct Admitted<T> {
    pick: T,
    missed_objective: bool,
    position: Option<u32>,
}

/// The admission loop: `select` until it picks, waiting in the queue while it answers `AllBusy`
/// or a better-ranked waiter of the same pool is queued (then the capacity seen is offered to
/// the waiters). The first selection is made as of `at`; after a wake-up, as of then. A waiter
/// woken for a release it cannot use passes the wake-up on to the next waiter that has not tried
/// it and returns to the queue with its rank (`admission.rs`). A pick whose predicted TTFT
/// (`predicted_ms`, plus the wait so far) misses the ticket's objective is refused when its class
/// rejects misses. Generic over the pick so the loop is tested on its own.
async fn wait_for_pick<T>(
    admission: &admission::Admission,
    shutdown: &CancellationToken,
    at: Instant,
    ticket: Ticket<'_>,
    mut select: impl FnMut(Instant) -> Result<T, NoPick>,
    predicted_ms: impl Fn(&T) -> f64,
    queue_wait: &mut Duration,
) -> Result<Admitted<T>, Refusal> {
    let mut now = at;
    let mut queued_at: Option<Instant> = None;
    let mut woken: Option<Generation> = None;
    let reject = ticket.class.on_miss == OnMiss::Reject;
    let objective = ticket.objective_ms;
    let count_wait = |queued_at: Option<Instant>, queue_wait: &mut Duration| {
        if let Some(q) = queued_at {
            *queue_wait += crate::clock::since(q);
        }
    };
    loop {
        let newcomer = woken.is_none() && queued_at.is_none();
        let mut kick = false;
        // A release while `select` runs is caught when we queue (`wait_observed`).
        let observed = admission.generation();
        match select(now) {
            Ok(p) if newcomer && admission.ahead(&ticket) => {
                // A better-ranked request waits for this pool: it gets the capacity.
                drop(p);
                kick = true;
            }
            Ok(p) if admission.peer_ahead(&ticket) => {
                // Cluster mode: a better-ranked request waits at a peer replica for this pool;
                // the peer hears of the free capacity from our load deltas and takes it. We wait
                // (the peer's next report, or the next release, wakes us).
                drop(p);
            }
            Ok(p) => {
                // The wait so far is read only against an objective (none by default).
                let missed = objective.is_some_and(|o| {
                    let waited = now.saturating_duration_since(ticket.arrival);
                    waited.as_secs_f64() * 1000.0 + predicted_ms(&p) > o as f64
                });
                count_wait(queued_at, queue_wait);
                if missed && reject {
                    if let Some(g) = woken {
                        admission.pass_on(g);
                    }
                    return Err(Refusal::ObjectiveUnreachable);
                }
                admission.note_admitted();
                let position = ticket.position();
                ticket.admitted();
                return Ok(Admitted {
                    pick: p,
                    missed_objective: missed,
                    position,
                });
            }
            Err(NoPick::NoWorker) => {
                count_wait(queued_at, queue_wait);
                if let Some(g) = woken {
                    admission.pass_on(g);
                }
                return Err(Refusal::NoWorker(String::new()));
            }
            Err(NoPick::AllBusy) => {}
        }
        if let Some(g) = woken {
            // The capacity we were woken for went elsewhere: pass the wake-up on.
            admission.pass_on(g);
        }
        let q0 = *queued_at.get_or_insert_with(crate::clock::now);
        let mut limit = q0 + admission.timeout();
        if let Some(m) = ticket.class.max_wait_ms {
            limit = limit.min(q0 + Duration::from_millis(m));
        }
        // A request that rejects misses leaves when its objective has passed.
        let objective_at = objective
            .filter(|_| reject)
            .map(|o| ticket.arrival + Duration::from_millis(o))
            .filter(|d| *d <= limit);
        let deadline = tokio::time::Instant::from_std(objective_at.unwrap_or(limit));
        // A gateway shutting down sends its queue away at once (503 `shutting_down`, retryable
        // elsewhere) rather than holding it into the end of the grace period.
        let waited = tokio::select! {
            w = admission.wait_observed(&ticket, woken, Some(observed), deadline, kick) => w,
            _ = shutdown.cancelled() => {
                *queue_wait += crate::clock::since(q0);
                return Err(Refusal::ShuttingDown);
            }
        };
        match waited {
            Ok(g) => {
                woken = Some(g);
                now = crate::clock::now();
            }
            Err(e) => {
                *queue_wait += crate::clock::since(q0);
                return Err(match e {
                    WaitError::Full => Refusal::QueueFull,
                    WaitError::Shed => Refusal::Shed,
                    WaitError::Timeout if objective_at.is_some() => Refusal::ObjectiveUnreachable,
                    WaitError::Timeout => Refusal::QueueTimeout,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Issue 29's question: two waiters, a release neither can use (the capacity was in another
    /// pool), and capacity that never frees. Before the fix, each woken waiter woke the next and
    /// re-queued at the head, so the two woke each other in a loop until the queue timeout. Now
    /// the release is tried once by each waiter and ends.
    #[tokio::test(start_paused = true)]
    async fn a_release_nobody_can_use_wakes_each_waiter_once() {
        let adm = Arc::new(admission::Admission::new(8, Duration::from_secs(30)));
        let shutdown = CancellationToken::new();
        let selections = Arc::new(AtomicUsize::new(0));
        let free = Arc::new(AtomicBool::new(false));
        let mut waiters = Vec::new();
        for _ in 0..2 {
            let (adm, shutdown, selections, free) = (
                adm.clone(),
                shutdown.clone(),
                selections.clone(),
                free.clone(),
            );
            waiters.push(tokio::spawn(async move {
                let mut waited = Duration::ZERO;
                let ticket = adm.admit(&FlowKey::default(), 1, crate::clock::now());
                wait_for_pick(
                    &adm,
                    &shutdown,
                    crate::clock::now(),
                    ticket,
                    |_| {
                        selections.fetch_add(1, Ordering::SeqCst);
                        if free.load(Ordering::SeqCst) {
                            Ok(())
                        } else {
                            Err(NoPick::AllBusy)
                        }
                    },
                    |_| 0.0,
                    &mut waited,
                )
                .await
                .map(|a| a.pick)
            }));
        }
        while adm.len() < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(selections.load(Ordering::SeqCst), 2);
        adm.release();
        // Let every woken task run as long as it wants (paused clock: no timer fires).
        for _ in 0..1000 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            selections.load(Ordering::SeqCst),
            4,
            "one release: one more selection per waiter, then quiet"
        );
        assert_eq!(adm.wakeups(), 2);
        assert_eq!(adm.len(), 2, "both still waiting, in the queue");
        // A release that frees capacity serves them.
        free.store(true, Ordering::SeqCst);
        adm.release();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        adm.release();
        for w in waiters {
            assert_eq!(w.await.unwrap(), Ok(()));
        }
    }

    /// A release made while a request's selection runs (it saw no capacity, the capacity frees
    /// before it is queued, no waiter to wake) is not lost: once queued it is woken for it and
    /// takes the capacity at once. Before the fix it waited its whole queue timeout beside the
    /// freed worker (the paused clock would have run to the 30 s timeout).
    #[tokio::test(start_paused = true)]
    async fn a_release_during_the_selection_is_not_lost() {
        let adm = admission::Admission::new(8, Duration::from_secs(30));
        let mut waited = Duration::ZERO;
        let ticket = adm.admit(&FlowKey::default(), 1, crate::clock::now());
        let start = tokio::time::Instant::now();
        let calls = AtomicUsize::new(0);
        let r = wait_for_pick::<()>(
            &adm,
            &CancellationToken::new(),
            crate::clock::now(),
            ticket,
            |_| {
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The only busy request ends as this selection found nothing free.
                    adm.release();
                    Err(NoPick::AllBusy)
                } else {
                    Ok(())
                }
            },
            |_| 0.0,
            &mut waited,
        )
        .await;
        assert_eq!(r.map(|a| a.pick), Ok(()));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(start.elapsed(), Duration::ZERO, "woken at once, no timer");
        assert_eq!(adm.wakeups(), 1);
        assert!(adm.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_request_times_out_and_counts_its_wait() {
        let adm = admission::Admission::new(8, Duration::from_secs(2));
        let mut waited = Duration::ZERO;
        let ticket = adm.admit(&FlowKey::default(), 1, crate::clock::now());
        let r = wait_for_pick::<()>(
            &adm,
            &CancellationToken::new(),
            crate::clock::now(),
            ticket,
            |_| Err(NoPick::AllBusy),
            |_| 0.0,
            &mut waited,
        )
        .await;
        assert_eq!(r, Err(Refusal::QueueTimeout));
        assert!(adm.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_sends_the_queue_away() {
        let adm = Arc::new(admission::Admission::new(8, Duration::from_secs(60)));
        let shutdown = CancellationToken::new();
        let (a, s) = (adm.clone(), shutdown.clone());
        let t = tokio::spawn(async move {
            let mut waited = Duration::ZERO;
            let ticket = a.admit(&FlowKey::default(), 1, crate::clock::now());
            wait_for_pick::<()>(
                &a,
                &s,
                crate::clock::now(),
                ticket,
                |_| Err(NoPick::AllBusy),
                |_| 0.0,
                &mut waited,
            )
            .await
        });
        while adm.is_empty() {
            tokio::task::yield_now().await;
        }
        shutdown.cancel();
        assert_eq!(t.await.unwrap(), Err(Refusal::ShuttingDown));
        assert!(adm.is_empty());
    }

    fn flow_adm() -> Arc<admission::Admission> {
        use crate::config::{ClassOrder, FlowClassConfig, FlowControlConfig};
        let class = |name: &str, priority, ttft_ms, on_miss| FlowClassConfig {
            name: name.into(),
            priority,
            queue_size: None,
            max_wait_ms: None,
            ttft_ms,
            on_miss,
            order: ClassOrder::Fair,
        };
        let cfg = FlowControlConfig {
            enabled: true,
            classes: vec![
                class("interactive", 10, Some(200), OnMiss::Reject),
                class("standard", 5, Some(200), OnMiss::BestEffort),
                class("batch", 0, None, OnMiss::BestEffort),
            ],
            ..Default::default()
        };
        let adm = admission::Admission::new(8, Duration::from_secs(60));
        adm.set_policy(flow::FlowPolicy::new(&cfg));
        Arc::new(adm)
    }

    fn prio(p: i32) -> FlowKey {
        FlowKey {
            priority: p,
            ..FlowKey::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_predicted_miss_is_rejected_or_served_best_effort() {
        let adm = flow_adm();
        let shutdown = CancellationToken::new();
        let run = |p: i32, predicted: f64| {
            let (adm, shutdown) = (adm.clone(), shutdown.clone());
            async move {
                let mut waited = Duration::ZERO;
                let t = adm.admit(&prio(p), 1, crate::clock::now());
                wait_for_pick(
                    &adm,
                    &shutdown,
                    crate::clock::now(),
                    t,
                    |_| Ok(()),
                    move |_| predicted,
                    &mut waited,
                )
                .await
            }
        };
        assert_eq!(run(10, 500.0).await, Err(Refusal::ObjectiveUnreachable));
        assert_eq!(
            run(10, 150.0).await,
            Ok(Admitted {
                pick: (),
                missed_objective: false,
                position: None
            })
        );
        assert_eq!(
            run(5, 500.0).await,
            Ok(Admitted {
                pick: (),
                missed_objective: true,
                position: None
            })
        );
        assert_eq!(run(0, 1e9).await.map(|a| a.missed_objective), Ok(false));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_rejects_misses_leaves_when_its_objective_passes() {
        let adm = flow_adm();
        let mut waited = Duration::ZERO;
        let t = adm.admit(&prio(10), 1, crate::clock::now());
        let r = wait_for_pick::<()>(
            &adm,
            &CancellationToken::new(),
            crate::clock::now(),
            t,
            |_| Err(NoPick::AllBusy),
            |_| 0.0,
            &mut waited,
        )
        .await;
        assert_eq!(r, Err(Refusal::ObjectiveUnreachable));
        assert_eq!(
            waited,
            Duration::from_millis(200),
            "not the 60 s queue timeout"
        );
        assert!(adm.is_empty());
    }

    /// A newcomer of a lower class that finds capacity free while a higher class waits for the
    /// same pool queues behind it and hands it the capacity.
    #[tokio::test(start_paused = true)]
    async fn a_newcomer_gives_free_capacity_to_a_better_waiter() {
        let adm = flow_adm();
        let shutdown = CancellationToken::new();
        let slots = Arc::new(AtomicUsize::new(0));
        let spawn = |p: i32| {
            let (adm, shutdown, slots) = (adm.clone(), shutdown.clone(), slots.clone());
            tokio::spawn(async move {
                let mut waited = Duration::ZERO;
                let t = adm.admit(&prio(p), 1, crate::clock::now());
                let r = wait_for_pick(
                    &adm,
                    &shutdown,
                    crate::clock::now(),
                    t,
                    |_| {
                        if slots.load(Ordering::SeqCst) > 0 {
                            Ok(())
                        } else {
                            Err(NoPick::AllBusy)
                        }
                    },
                    |_| 0.0,
                    &mut waited,
                )
                .await;
                if r.is_ok() {
                    slots.fetch_sub(1, Ordering::SeqCst);
                }
                r.map(|a| a.pick)
            })
        };
        let inter = spawn(0);
        while adm.is_empty() {
            tokio::task::yield_now().await;
        }
        // Capacity frees without a release (a scrape, a breaker closing).
        slots.store(1, Ordering::SeqCst);
        // Same class, later tag: it queues behind and kicks; the earlier waiter gets the slot.
        let batch = spawn(0);
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(inter.await.unwrap(), Ok(()));
        assert!(!batch.is_finished(), "the newcomer waits its turn");
        assert_eq!(adm.len(), 1);
        assert_eq!(slots.load(Ordering::SeqCst), 0);
        slots.store(1, Ordering::SeqCst);
        adm.release();
        assert_eq!(batch.await.unwrap(), Ok(()));
    }
}
