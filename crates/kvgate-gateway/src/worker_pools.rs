//! Discovered worker pools (`[[worker_pools]]`): one watcher per pool, of one of three kinds:
//! - `dns = "host:port"`: a kvgate-fleet [`DnsWatcher`] re-resolving the name;
//! - `file = "endpoints.yaml"`: llm-d's file-discovery format, polled for changes
//!   (`worker_pools/file.rs`, the format in `worker_pools/endpoints.rs`);
//! - `inference_pool = "name"`: the Ready pods × target ports of a Kubernetes InferencePool,
//!   listed and watched on the API server (`worker_pools/kube.rs`).
//!
//! Every watcher reports the pool's whole member set; each change replaces the pool's workers in
//! the registry ([`Registry::set_pool_members`]), so added members get a worker with fresh state
//! (index entry, load, monitor) and removed ones lose theirs, through the same rebuild path as
//! config reloads and the admin API (ids reused, load released, metric series dropped). A source
//! that fails (a bad file, an unreachable API server) keeps the last good set and counts the
//! failure (`kvgate_pool_discovery_errors_total`).
//!
//! Reload safety: [`run`] re-reads the registry's config every second and restarts the watcher of
//! a pool whose settings changed, stops the watcher of a pool that is gone (the registry already
//! dropped its workers on the reload), and starts watchers for new pools. Members that survive a
//! restart keep their state, because the registry keys worker state by URL.
//!
//! [`Registry::set_pool_members`]: crate::registry::Registry::set_pool_members

pub mod endpoints;
pub mod file;
pub mod kube;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvgate_fleet::dns::{DnsChange, DnsConfig, DnsWatcher};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{PoolSource, WorkerPoolConfig, WorkerRole};
use crate::fleet::WorkerFleet;
use crate::metrics::{Lbl, PoolKindLabel, PoolLabel};

/// How often the set of pools is compared with the running config.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// One member of a discovered pool: where it listens, and the role its source named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub addr: SocketAddr,
    /// From llm-d's `llm-d.ai/role` label (endpoints file labels, pod labels).
    pub role: Option<WorkerRole>,
}

/// What a file or Kubernetes watcher tells the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The pool's whole member set now (sorted, no duplicate address).
    Members(Vec<Member>),
    /// A failure, by kind (`kvgate_pool_discovery_errors_total{kind}`); the last good set stays.
    /// The watcher has logged the details.
    Error(&'static str),
}

/// Where a watcher reports to.
pub type Report = Arc<dyn Fn(Event) + Send + Sync>;

/// llm-d's pod/endpoint role label (`prefill`, `decode`, `both` or `prefill-decode`).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// The role a member's labels name, if any.
pub fn role_from_labels<'a>(
    mut labels: impl Iterator<Item = (&'a str, &'a str)>,
) -> Result<Option<WorkerRole>, String> {
    let Some((_, v)) = labels.find(|(k, _)| *k == ROLE_LABEL) else {
        return Ok(None);
    };
    match v {
        "prefill" => Ok(Some(WorkerRole::Prefill)),
        "decode" => Ok(Some(WorkerRole::Decode)),
        "both" | "prefill-decode" => Ok(Some(WorkerRole::Both)),
        other => Err(format!(
            "label {ROLE_LABEL}={other:?}: expected prefill, decode, both or prefill-decode"
        )),
    }
}

/// A running watcher.
enum Watcher {
    Dns(DnsWatcher),
    Task {
        stop: CancellationToken,
        task: JoinHandle<()>,
    },
}

impl Watcher {
    async fn shutdown(self) {
        match self {
            Watcher::Dns(w) => w.shutdown().await,
            Watcher::Task { stop, task } => {
                stop.cancel();
                let _ = task.await;
            }
        }
    }
}

/// Keep one watcher per configured pool until shutdown, then stop them all.
pub async fn run(app: Arc<WorkerFleet>) {
    let mut running: HashMap<String, (WorkerPoolConfig, Watcher)> = HashMap::new();
    let mut tick = tokio::time::interval(SYNC_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = app.shutdown.cancelled() => break,
            _ = tick.tick() => sync(&app, &mut running).await,
        }
    }
    for (_, (_, w)) in running.drain() {
        w.shutdown().await;
    }
}

/// Start, restart or stop watchers so they match `app`'s current `worker_pools`.
async fn sync(app: &Arc<WorkerFleet>, running: &mut HashMap<String, (WorkerPoolConfig, Watcher)>) {
    let cfg = app.registry.config();
    let stale: Vec<String> = running
        .iter()
        .filter(|(_, (pool, _))| !cfg.worker_pools.iter().any(|p| p == pool))
        .map(|(k, _)| k.clone())
        .collect();
    for key in stale {
        if let Some((_, w)) = running.remove(&key) {
            // Wait for it to exit, so no late answer of the old settings lands after the new
            // watcher's first one. A pool that is gone already lost its workers in
            // `Registry::set_config`; one with new settings is restarted below.
            w.shutdown().await;
            app.metrics().pools.members.remove(&PoolLabel {
                pool: key.as_str().into(),
            });
            tracing::info!(pool = %key, "worker pool stopped");
        }
    }
    for pool in &cfg.worker_pools {
        let key = pool.prefix().to_string();
        if running.contains_key(&key) {
            continue;
        }
        tracing::info!(pool = %key, source = %pool.describe(), every_s = pool.refresh_s, "worker pool started");
        let watcher = spawn_watcher(app.clone(), pool.clone());
        running.insert(key, (pool.clone(), watcher));
    }
}

fn spawn_watcher(app: Arc<WorkerFleet>, pool: WorkerPoolConfig) -> Watcher {
    let every = Duration::from_secs(pool.refresh_s.max(1));
    match pool.source() {
        PoolSource::Dns(dns) => {
            let mut dc = DnsConfig::new(dns.to_string());
            dc.interval = every;
            let report = reporter(app, pool.clone());
            Watcher::Dns(DnsWatcher::spawn(dc, move |change: DnsChange| {
                report(Event::Members(
                    change
                        .current
                        .iter()
                        .map(|a| Member {
                            addr: *a,
                            role: None,
                        })
                        .collect(),
                ))
            }))
        }
        PoolSource::File(path) => {
            let stop = app.shutdown.child_token();
            let task = tokio::spawn(file::watch(
                path.to_path_buf(),
                every,
                reporter(app, pool.clone()),
                stop.clone(),
            ));
            Watcher::Task { stop, task }
        }
        PoolSource::InferencePool(_) => {
            let stop = app.shutdown.child_token();
            let settings = kube::Settings::from_pool(&pool);
            let task = tokio::spawn(kube::watch(
                settings,
                reporter(app, pool.clone()),
                stop.clone(),
            ));
            Watcher::Task { stop, task }
        }
    }
}

/// The pool's report sink: members → the registry (and `kvgate_pool_members`), errors → the
/// error counter.
fn reporter(app: Arc<WorkerFleet>, pool: WorkerPoolConfig) -> Report {
    let key = pool.prefix().to_string();
    let label = PoolLabel {
        pool: Lbl::from(key.as_str()),
    };
    Arc::new(move |ev: Event| match ev {
        Event::Members(members) => {
            let n = members.len();
            let workers = members
                .iter()
                .map(|m| pool.member(m.addr, m.role))
                .collect();
            match app.registry.set_pool_members(&key, workers) {
                Ok(r) => {
                    if !r.added.is_empty() || !r.removed.is_empty() {
                        tracing::info!(pool = %key, members = n, added = r.added.len(), removed = r.removed.len(), "worker pool changed");
                    }
                    app.apply_rebuild(&r);
                    let m = &app.metrics().pools;
                    m.members.get_or_create(&label).set(n as i64);
                    m.updates.get_or_create(&label).inc();
                }
                Err(e) => {
                    tracing::error!(pool = %key, error = %format!("{e:#}"), "applying a worker pool change failed")
                }
            }
        }
        Event::Error(kind) => {
            app.metrics()
                .pools
                .errors
                .get_or_create(&PoolKindLabel {
                    pool: label.pool.clone(),
                    kind,
                })
                .inc();
        }
    })
}
