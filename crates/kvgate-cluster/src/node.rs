//! [`Cluster`]: one replica's NATS connection. Publishing is fire-and-forget through a bounded
//! queue (full → dropped and counted; a request never waits on the bus); a subscriber task decodes
//! peers' messages and hands them to the gateway's [`Sink`]; a heartbeat task publishes liveness
//! and rate-limit usage and expires silent peers; every (re)connection asks the peers for a
//! snapshot (request/reply on `<prefix>.snapshot`, replies collected for `snapshot_wait`).
//!
//! Subjects: `<prefix>.msg` (every broadcast kind; the kind is in the payload) and
//! `<prefix>.snapshot`. Own messages are not echoed back (`no_echo`) and are ignored by replica id
//! in case two connections share one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use crate::metrics::ClusterMetrics;
use crate::wire::{self, DropReason, Envelope, FlowReport, InflightEntry, Kind, Message, Snapshot};

/// The cluster's slice of the gateway configuration.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub nats_url: String,
    pub replica_id: String,
    pub subject_prefix: String,
    pub heartbeat_interval: Duration,
    /// A peer not heard from for this long is gone: its load share expires.
    pub heartbeat_timeout: Duration,
    pub max_message_bytes: usize,
    /// Outbound messages queued while NATS is slow; past it they are dropped and counted.
    pub queue_capacity: usize,
    /// How long a (re)connecting replica collects snapshot replies.
    pub snapshot_wait: Duration,
}

/// What the gateway does with peers' messages.
pub trait Sink: Send + Sync + 'static {
    /// Apply one message from peer `from`, entirely or not at all (an `Err` is counted as dropped).
    fn apply(&self, from: &str, msg: &Message, now: Instant) -> Result<(), DropReason>;
    /// Our approximate index, per worker name, for a joining peer's snapshot.
    fn approx_entries(&self) -> Vec<(String, Vec<u64>)>;
    /// Drop the share of every peer silent for longer than `timeout`.
    fn expire(&self, now: Instant, timeout: Duration);
    /// API-key usage (key id, requests) since the last call, to publish.
    fn take_rate_usage(&self) -> Vec<(u64, u32)>;
    /// Flow control's report for the heartbeat (its clocks, queue heads and the tokens admitted
    /// since the last call), or `None` when flow control has nothing to share.
    fn flow_report(&self) -> Option<FlowReport> {
        None
    }
    /// A peer's routing decision arrived `lag` after it was sent (the sync lag, also observed in
    /// `kvgate_cluster_sync_lag_seconds`).
    fn route_lag(&self, lag: Duration, now: Instant) {
        let _ = (lag, now);
    }
}

/// A running cluster membership. Dropping the last handle does not stop it: call [`Cluster::shutdown`].
pub struct Cluster {
    cfg: ClusterConfig,
    tx: mpsc::Sender<Message>,
    metrics: ClusterMetrics,
    /// Our own in-flight requests as published (listed in our snapshot replies).
    own: Mutex<HashMap<u64, InflightEntry>>,
    stop: watch::Sender<bool>,
}

/// Microseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Cluster {
    /// Start the replica's tasks on the current tokio runtime. Never waits for NATS: the client
    /// connects (and reconnects) in the background.
    pub fn start(
        cfg: ClusterConfig,
        sink: Arc<dyn Sink>,
        metrics: ClusterMetrics,
    ) -> Result<Arc<Cluster>, String> {
        if cfg.subject_prefix.is_empty()
            || cfg
                .subject_prefix
                .chars()
                .any(|c| c.is_whitespace() || c == '*' || c == '>')
        {
            return Err(format!(
                "cluster.subject_prefix must be a non-empty NATS subject without spaces or wildcards, got {:?}",
                cfg.subject_prefix
            ));
        }
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let (stop, stop_rx) = watch::channel(false);
        let cluster = Arc::new(Cluster {
            cfg,
            tx,
            metrics,
            own: Mutex::new(HashMap::new()),
            stop,
        });
        let (conn_tx, conn_rx) = mpsc::channel::<()>(4);
        let m = cluster.metrics.clone();
        let opts = async_nats::ConnectOptions::new()
            .name(format!("kvgate/{}", cluster.cfg.replica_id))
            .no_echo()
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(2))
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((attempts as u64 * 100).min(1000))
            })
            .event_callback(move |ev| {
                let m = m.clone();
                let conn_tx = conn_tx.clone();
                async move {
                    match ev {
                        async_nats::Event::Connected => {
                            m.connected.set(1);
                            m.connects.inc();
                            tracing::info!("cluster: connected to NATS");
                            let _ = conn_tx.try_send(());
                        }
                        async_nats::Event::Disconnected => {
                            m.connected.set(0);
                            tracing::warn!("cluster: lost NATS; routing on local state");
                        }
                        other => tracing::debug!("cluster: NATS event: {other}"),
                    }
                }
            });
        let url = cluster.cfg.nats_url.clone();
        let c = cluster.clone();
        tokio::spawn(async move {
            let client = tokio::select! {
                r = opts.connect(url.as_str()) => r,
                _ = wait_stop(stop_rx.clone()) => return,
            };
            let client = match client {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!("cluster: bad NATS url {url:?}: {e}; cluster sync is off");
                    return;
                }
            };
            c.run(client, sink, rx, conn_rx, stop_rx).await;
        });
        Ok(cluster)
    }

    /// Stop every task (in-flight publishes are abandoned).
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
    }

    /// Connected to NATS now (peers hear us and we hear them).
    pub fn connected(&self) -> bool {
        self.metrics.connected.get() == 1
    }

    pub fn replica_id(&self) -> &str {
        &self.cfg.replica_id
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    pub fn metrics(&self) -> &ClusterMetrics {
        &self.metrics
    }

    /// Queue `msg` for publishing; drops and counts it when the queue is full.
    pub fn publish(&self, msg: Message) {
        let kind = msg.kind();
        if self.tx.try_send(msg).is_err() {
            self.metrics.dropped(Some(kind), DropReason::QueueFull);
        }
    }

    /// Publish a routing decision + dispatch and remember it for our snapshot replies.
    pub fn route(
        &self,
        model: &str,
        worker: &str,
        request: u64,
        prefill_tokens: u64,
        blocks: u32,
        hashes: &[u64],
    ) {
        self.own.lock().insert(
            request,
            InflightEntry {
                worker: worker.to_owned(),
                request,
                prefill_tokens,
                blocks,
            },
        );
        self.publish(Message::Route {
            model: model.to_owned(),
            worker: worker.to_owned(),
            request,
            prefill_tokens,
            blocks,
            hashes: hashes.to_vec(),
        });
    }

    pub fn prefill_done(&self, request: u64) {
        if let Some(e) = self.own.lock().get_mut(&request) {
            e.prefill_tokens = 0;
        }
        self.publish(Message::PrefillDone { request });
    }

    pub fn free(&self, request: u64) {
        self.own.lock().remove(&request);
        self.publish(Message::Free { request });
    }

    /// A Responses id learned from `worker`'s reply (peers pin its later uses there too).
    pub fn pin(&self, id: &str, worker: &str) {
        self.publish(Message::Pin {
            id: id.to_owned(),
            worker: worker.to_owned(),
        });
    }

    /// Session `key` was routed to `worker`.
    pub fn session(&self, key: u64, worker: &str) {
        self.publish(Message::Session {
            key,
            worker: worker.to_owned(),
        });
    }

    pub fn health(&self, worker: &str, open: bool) {
        self.publish(Message::Health {
            worker: worker.to_owned(),
            open,
        });
    }

    fn envelope(&self, msg: Message) -> Envelope {
        Envelope {
            replica: self.cfg.replica_id.clone(),
            sent_unix_us: unix_us(),
            msg,
        }
    }

    fn msg_subject(&self) -> String {
        format!("{}.msg", self.cfg.subject_prefix)
    }

    fn snapshot_subject(&self) -> String {
        format!("{}.snapshot", self.cfg.subject_prefix)
    }

    async fn run(
        self: Arc<Self>,
        client: async_nats::Client,
        sink: Arc<dyn Sink>,
        rx: mpsc::Receiver<Message>,
        conn_rx: mpsc::Receiver<()>,
        stop: watch::Receiver<bool>,
    ) {
        let peers: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let tasks = [
            tokio::spawn(self.clone().publisher(client.clone(), rx)),
            tokio::spawn(
                self.clone()
                    .subscriber(client.clone(), sink.clone(), peers.clone()),
            ),
            tokio::spawn(self.clone().responder(client.clone(), sink.clone())),
            tokio::spawn(self.clone().heartbeat(sink.clone(), peers)),
            tokio::spawn(self.clone().resync(client.clone(), sink, conn_rx)),
        ];
        wait_stop(stop).await;
        for t in &tasks {
            t.abort();
        }
        self.metrics.connected.set(0);
        let _ = client.drain().await;
    }

    async fn publisher(
        self: Arc<Self>,
        client: async_nats::Client,
        mut rx: mpsc::Receiver<Message>,
    ) {
        let subject = self.msg_subject();
        while let Some(msg) = rx.recv().await {
            let kind = msg.kind();
            let bytes = match wire::encode(&self.envelope(msg), self.cfg.max_message_bytes) {
                Ok(b) => b,
                Err(r) => {
                    self.metrics.dropped(Some(kind), r);
                    continue;
                }
            };
            match client.publish(subject.clone(), bytes).await {
                Ok(()) => self.metrics.sent(kind),
                Err(_) => self.metrics.dropped(Some(kind), DropReason::PublishFailed),
            }
        }
    }

    /// Decode, check and apply one peer payload.
    fn receive(&self, payload: &[u8], sink: &dyn Sink, peers: &Mutex<HashMap<String, Instant>>) {
        let env = match wire::decode(payload, self.cfg.max_message_bytes) {
            Ok(e) => e,
            Err(e) => {
                self.metrics.dropped(e.kind, e.reason);
                return;
            }
        };
        if env.replica == self.cfg.replica_id {
            return;
        }
        let now = Instant::now();
        peers.lock().insert(env.replica.clone(), now);
        let kind = env.msg.kind();
        match sink.apply(&env.replica, &env.msg, now) {
            Ok(()) => {
                self.metrics.received(kind);
                if kind == Kind::Route {
                    let lag = unix_us().saturating_sub(env.sent_unix_us);
                    self.metrics.sync_lag.observe(lag as f64 / 1e6);
                    sink.route_lag(Duration::from_micros(lag), now);
                }
            }
            Err(r) => self.metrics.dropped(Some(kind), r),
        }
    }

    async fn subscriber(
        self: Arc<Self>,
        client: async_nats::Client,
        sink: Arc<dyn Sink>,
        peers: Arc<Mutex<HashMap<String, Instant>>>,
    ) {
        let mut sub = match client.subscribe(self.msg_subject()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("cluster: cannot subscribe: {e}");
                return;
            }
        };
        while let Some(m) = sub.next().await {
            self.receive(&m.payload, &*sink, &peers);
        }
    }

    /// Answers peers' snapshot requests with our approximate index and our in-flight requests.
    async fn responder(self: Arc<Self>, client: async_nats::Client, sink: Arc<dyn Sink>) {
        let mut sub = match client.subscribe(self.snapshot_subject()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("cluster: cannot subscribe for snapshots: {e}");
                return;
            }
        };
        while let Some(m) = sub.next().await {
            let Some(reply) = m.reply else { continue };
            if m.payload.as_ref() == self.cfg.replica_id.as_bytes() {
                continue;
            }
            let snap = Snapshot {
                part: 0,
                approx: sink.approx_entries(),
                inflight: self.own.lock().values().cloned().collect(),
            };
            // Several replies when it does not fit one message: every part goes to the same
            // inbox, in order, the first replacing what the peer holds of us.
            let parts = match snap.split(&self.cfg.replica_id, self.cfg.max_message_bytes) {
                Ok(p) => p,
                Err(r) => {
                    tracing::warn!(
                        "cluster: cluster.max_message_bytes cannot hold one snapshot entry; not sent"
                    );
                    self.metrics.dropped(Some(Kind::Snapshot), r);
                    continue;
                }
            };
            for part in parts {
                let env = self.envelope(Message::Snapshot(part));
                let kind = env.msg.kind();
                match wire::encode(&env, self.cfg.max_message_bytes) {
                    Ok(b) => match client.publish(reply.clone(), b).await {
                        Ok(()) => self.metrics.sent(kind),
                        Err(_) => self.metrics.dropped(Some(kind), DropReason::PublishFailed),
                    },
                    Err(r) => self.metrics.dropped(Some(kind), r),
                }
            }
        }
    }

    async fn heartbeat(
        self: Arc<Self>,
        sink: Arc<dyn Sink>,
        peers: Arc<Mutex<HashMap<String, Instant>>>,
    ) {
        let mut tick = tokio::time::interval(self.cfg.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let inflight = self.own.lock().len() as u32;
            self.publish(Message::Heartbeat { inflight });
            let keys = sink.take_rate_usage();
            if !keys.is_empty() {
                self.publish(Message::RateUsage { keys });
            }
            if let Some(f) = sink.flow_report() {
                self.publish(Message::Flow(f));
            }
            let now = Instant::now();
            sink.expire(now, self.cfg.heartbeat_timeout);
            let timeout = self.cfg.heartbeat_timeout;
            let mut p = peers.lock();
            p.retain(|_, t| now.saturating_duration_since(*t) <= timeout);
            self.metrics.peers.set(p.len() as i64);
        }
    }

    /// On every (re)connection: ask the peers for a snapshot and apply each reply.
    async fn resync(
        self: Arc<Self>,
        client: async_nats::Client,
        sink: Arc<dyn Sink>,
        mut conn_rx: mpsc::Receiver<()>,
    ) {
        while conn_rx.recv().await.is_some() {
            // First tell the peers what we have in flight (replaces what they hold of us: load
            // deltas lost while we were away, or entries of our previous run), then ask them.
            let own = Snapshot {
                part: 0,
                approx: Vec::new(),
                inflight: self.own.lock().values().cloned().collect(),
            };
            match own.split(&self.cfg.replica_id, self.cfg.max_message_bytes) {
                Ok(parts) => parts
                    .into_iter()
                    .for_each(|p| self.publish(Message::Snapshot(p))),
                Err(r) => self.metrics.dropped(Some(Kind::Snapshot), r),
            }
            let started = Instant::now();
            let inbox = client.new_inbox();
            let mut sub = match client.subscribe(inbox.clone()).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("cluster: snapshot inbox: {e}");
                    continue;
                }
            };
            if let Err(e) = client
                .publish_with_reply(
                    self.snapshot_subject(),
                    inbox,
                    self.cfg.replica_id.clone().into(),
                )
                .await
            {
                tracing::warn!("cluster: snapshot request: {e}");
                continue;
            }
            let deadline = tokio::time::Instant::now() + self.cfg.snapshot_wait;
            let mut replies = 0usize;
            let mut bytes = 0usize;
            while let Ok(Some(m)) = tokio::time::timeout_at(deadline, sub.next()).await {
                let n = m.payload.len();
                match wire::decode(&m.payload, self.cfg.max_message_bytes) {
                    Ok(env) if matches!(env.msg, Message::Snapshot(_)) => {
                        if env.replica == self.cfg.replica_id {
                            continue;
                        }
                        match sink.apply(&env.replica, &env.msg, Instant::now()) {
                            Ok(()) => {
                                self.metrics.received(env.msg.kind());
                                self.metrics.snapshot_bytes.observe(n as f64);
                                self.metrics
                                    .snapshot_seconds
                                    .observe(started.elapsed().as_secs_f64());
                                replies += 1;
                                bytes += n;
                            }
                            Err(r) => self.metrics.dropped(Some(env.msg.kind()), r),
                        }
                    }
                    Ok(env) => self
                        .metrics
                        .dropped(Some(env.msg.kind()), DropReason::Malformed),
                    Err(e) => self.metrics.dropped(e.kind, e.reason),
                }
            }
            let _ = sub.unsubscribe().await;
            tracing::info!(
                parts = replies,
                bytes,
                elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                "cluster: snapshot applied"
            );
        }
    }
}

async fn wait_stop(mut stop: watch::Receiver<bool>) {
    while !*stop.borrow() {
        if stop.changed().await.is_err() {
            return;
        }
    }
}
