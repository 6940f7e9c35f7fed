//! KV-event subscriber: one ZMQ SUB socket per publisher (DP rank), sequence checks, replay of gaps
//! over the publisher's ROUTER socket (`subscriber/replay.rs`), reconnect with backoff. The
//! bookkeeping (applied seqs, history, what a reconnect means) is in `subscriber/state.rs`.
//!
//! Every decoded batch goes to [`FleetSink::on_kv_events`] in sequence order. A malformed message is
//! counted and dropped. Clears go through the worker's `ResetBus`, so a subscriber always knows when
//! its part of the index is gone (whoever cleared it) and rebuilds it from the replay buffer.
//!
//! - On connect (and after any clear) the whole replay buffer is fetched first ("history"); live
//!   batches wait until it is applied, and a failed fetch is retried with backoff.
//! - A lost connection is re-established here, not by the zeromq crate (its internal reconnect backs
//!   off to 30 s and would hide the restart): the socket is dropped and rebuilt with our backoff,
//!   cut short when the worker is seen coming back.
//! - After a reconnect, a replay from the last applied seq tells the same process (that batch is
//!   still buffered with the same timestamp: resume, nothing cleared) from a restarted one (clear,
//!   rebuild from its history).
//! - A gap is replayed; if the buffer no longer covers it, the worker is cleared and rebuilt. A
//!   sequence regression is a restart.
//! - Repeated connect failures ask the monitor to re-discover the worker's endpoints.

mod replay;
mod state;

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::WorkerId;
use kvgate_protocol::kv_events::decode_multipart;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv};

use crate::discover::KvSource;
use crate::reset::ResetBus;
use crate::sink::FleetSink;
use crate::stats::{inc, FleetStats};
use state::State;

pub use replay::{replay, ReplayError};

/// Settings of one subscriber.
#[derive(Debug, Clone)]
pub struct SubscriberSettings {
    pub source: KvSource,
    /// The pool's block size (for the mismatch check); `None` skips the check.
    pub block_size: Option<u32>,
    pub connect_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Bound on one whole replay exchange.
    pub replay_timeout: Duration,
    /// First retry delay of a failed history replay (doubles per attempt, up to 32×).
    pub history_retry: Duration,
    /// With a replay endpoint: after this long without a live batch, replay from the next expected
    /// seq to catch batches the live socket missed; doubles while nothing is found (up to 30 s).
    pub idle_check: Duration,
    /// Connect failures in a row after which the endpoints are re-discovered (and every further
    /// such run of failures).
    pub rediscover_after: u32,
}

impl SubscriberSettings {
    pub fn new(source: KvSource) -> Self {
        SubscriberSettings {
            source,
            block_size: None,
            connect_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            replay_timeout: Duration::from_secs(5),
            rediscover_after: 3,
            history_retry: Duration::from_millis(200),
            idle_check: Duration::from_secs(1),
        }
    }
}

/// How often the connection's monitor events and the history retry are looked at.
const TICK: Duration = Duration::from_millis(100);

/// Runs until `cancel` fires.
pub(crate) async fn run(
    worker: WorkerId,
    name: Arc<str>,
    s: SubscriberSettings,
    sink: Arc<dyn FleetSink>,
    stats: Arc<FleetStats>,
    bus: Arc<ResetBus>,
    cancel: CancellationToken,
) {
    let mut st = State::new(worker, name, s, sink, stats, bus);
    let mut backoff = st.s.backoff_min;
    let mut failures = 0u32;
    let mut attempt = 0u64;
    let mut had_session = false;
    loop {
        if attempt > 0 {
            inc(&st.stats.kv_reconnects);
            let wait = crate::scrape::jittered(backoff, 0.2);
            backoff = (backoff * 2).min(st.s.backoff_max);
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                // The worker was cleared (seen restarting): it is worth trying now. `changed()`
                // marks the epoch seen, so forget here: the reconnect must rebuild, not resume.
                r = st.epochs.changed() => {
                    if r.is_err() {
                        return;
                    }
                    st.cleared_elsewhere();
                }
            }
        }
        attempt += 1;
        let mut sock = zeromq::SubSocket::new();
        let mut monitor = sock.monitor();
        // Whether the socket's monitor reported the publisher gone (drains the events).
        let mut lost = move || {
            let mut gone = false;
            while let Ok(ev) = monitor.try_recv() {
                gone |= matches!(ev, zeromq::SocketEvent::Disconnected(_));
            }
            gone
        };
        let ep = st.s.source.endpoint.clone();
        let connected = tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(st.s.connect_timeout, connect(&mut sock, &ep)) => r,
        };
        let error = match connected {
            Ok(Ok(())) => match sock.subscribe(&st.s.source.topic).await {
                Ok(()) => None,
                Err(e) => Some(e.to_string()),
            },
            Ok(Err(e)) => Some(e),
            Err(_) => Some("connect timed out".to_owned()),
        };
        if let Some(error) = error {
            failures += 1;
            tracing::debug!(worker = %st.name, endpoint = %ep, %error, failures, "KV event connect failed");
            // A publisher that was there and now refuses may have moved (restart on other ports):
            // look at once; otherwise after every run of failures.
            if (had_session && failures == 1) || failures % st.s.rediscover_after.max(1) == 0 {
                st.bus.ask_rediscover();
            }
            continue;
        }
        failures = 0;
        had_session = true;
        tracing::info!(worker = %st.name, endpoint = %ep, "subscribed to KV events");
        if st.epochs.has_changed().unwrap_or(false) {
            st.epochs.borrow_and_update();
            st.cleared_elsewhere();
        } else if st.seq.last().is_some() {
            st.resume(&cancel).await;
        } else {
            st.forget();
        }
        if session(&mut st, &mut sock, &mut lost, &cancel).await {
            return;
        }
        backoff = if st.seq.last().is_some() {
            st.s.backoff_min
        } else {
            backoff
        };
    }
}

/// Connects the socket (after [`reachable`]).
async fn connect(sock: &mut zeromq::SubSocket, ep: &str) -> Result<(), String> {
    reachable(ep).await?;
    sock.connect(ep).await.map_err(|e| e.to_string())
}

/// zeromq's `connect` retries a refused TCP port internally until the caller's timeout; a plain TCP
/// connect first (closed at once) makes "nothing listens there" an immediate failure, so a
/// publisher that moved is re-discovered, and a dead replay socket given up on, in a moment.
pub(crate) async fn reachable(ep: &str) -> Result<(), String> {
    if let Some(addr) = ep.strip_prefix("tcp://") {
        // `host:port` or `[v6]:port`: both parse as tokio addresses.
        tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("{ep}: {e}"))?;
    }
    Ok(())
}

/// One connection's life: live batches, history fetches, clears elsewhere. Returns true when
/// cancelled, false when the connection was lost.
async fn session(
    st: &mut State,
    sock: &mut zeromq::SubSocket,
    lost: &mut impl FnMut() -> bool,
    cancel: &CancellationToken,
) -> bool {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut idle_every = st.s.idle_check;
    let mut quiet_since = tokio::time::Instant::now();
    loop {
        if st
            .pending
            .as_ref()
            .is_some_and(|p| p.next_try <= tokio::time::Instant::now())
        {
            st.fetch_history(cancel).await;
        }
        let msg = tokio::select! {
            biased;
            _ = cancel.cancelled() => return true,
            r = st.epochs.changed() => {
                if r.is_err() {
                    return true;
                }
                st.cleared_elsewhere();
                continue;
            }
            _ = tick.tick() => {
                if lost() {
                    tracing::info!(worker = %st.name, "KV event publisher disconnected; reconnecting");
                    return false;
                }
                if st.s.source.replay_endpoint.is_some()
                    && quiet_since.elapsed() >= idle_every
                {
                    idle_every = if st.catch_up(cancel).await {
                        st.s.idle_check
                    } else {
                        (idle_every * 2).min(Duration::from_secs(30))
                    };
                    quiet_since = tokio::time::Instant::now();
                }
                continue;
            }
            m = sock.recv() => m,
        };
        // A message after a disconnect comes from zeromq's own reconnect, maybe to a new process:
        // drop it and reconnect ourselves (the replay on resume recovers it).
        if lost() {
            tracing::info!(worker = %st.name, "KV event publisher disconnected; reconnecting");
            return false;
        }
        match msg {
            Ok(m) => match decode_multipart(&m.into_vec()) {
                Ok(b) => {
                    quiet_since = tokio::time::Instant::now();
                    idle_every = st.s.idle_check;
                    st.on_batch(b, cancel).await
                }
                Err(e) => {
                    inc(&st.stats.kv_malformed);
                    tracing::debug!(worker = %st.name, error = %e, "malformed KV event message dropped");
                }
            },
            Err(e) => {
                tracing::info!(worker = %st.name, error = %e, "KV event socket lost; reconnecting");
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests;
