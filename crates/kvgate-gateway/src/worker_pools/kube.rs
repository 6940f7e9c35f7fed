//! A pool from a Kubernetes InferencePool: its members are the Ready pods its selector matches,
//! each at every target port, as llm-d's EPP and GAIE's lwepp count them.
//!
//! Two list+watch loops ("reflectors") on the API server, over kvgate's own HTTP/1 client (TLS
//! with the cluster's CA, a bearer token re-read at every connection, so rotated service-account
//! tokens work), no Kubernetes client library:
//! - the InferencePool object (`fieldSelector=metadata.name=NAME`): its selector and ports;
//!   `inference.networking.k8s.io/v1` (`spec.selector.matchLabels`, `spec.targetPorts[].number`)
//!   or `inference.networking.x-k8s.io/v1alpha2` (`spec.selector`, `spec.targetPortNumber`);
//! - the pods matching the selector (`labelSelector=`), restarted when the selector or ports
//!   change. A pod is a member while its `Ready` condition is `True`, it has a `podIP` and no
//!   `deletionTimestamp`: a pod that turns unready leaves the pool at once, and comes back when
//!   Ready again.
//!
//! Each loop lists (taking the list's `resourceVersion`), then watches from there with
//! `allowWatchBookmarks` (bookmarks move the version on without a change). A watch that ends (the
//! server's `timeoutSeconds`, a dropped connection) resumes from the last version seen; `410
//! Gone` (the version is too old, as an `ERROR` event or as the watch's status) relists. Errors
//! back off exponentially (0.2 s doubling to 30 s, ±20 % jitter) and are counted
//! (`kvgate_pool_discovery_errors_total{kind="api"|"gone"|"invalid_object"|"config"}`); the pool
//! keeps its last good members meanwhile. An InferencePool that is deleted (or not created yet)
//! has no members.

mod api;
mod objects;
mod reflect;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Event, Member, Report};
use crate::config::{WorkerPoolConfig, INFERENCE_POOL_GROUP_V1};
pub use api::{Api, ApiError};
pub use objects::{pod_members, PodInfo, PoolSpec};
use reflect::{reflect, Backoff, Store};

/// The service account's files in a pod.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Where and what to watch.
#[derive(Debug, Clone)]
pub struct Settings {
    pub pool: String,
    /// `None`: the service account's namespace, else `default`.
    pub namespace: Option<String>,
    pub group: String,
    /// `None`: in-cluster, from `KUBERNETES_SERVICE_HOST` / `KUBERNETES_SERVICE_PORT`.
    pub api_server: Option<String>,
    pub token_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    /// The server ends each watch after this (`timeoutSeconds`); a watch silent for this plus
    /// 30 s is taken as dead and resumed.
    pub watch_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

impl Settings {
    pub fn from_pool(p: &WorkerPoolConfig) -> Settings {
        Settings {
            pool: p.inference_pool.clone().unwrap_or_default(),
            namespace: p.namespace.clone(),
            group: p.inference_pool_group.clone(),
            api_server: p.api_server.clone(),
            token_file: p.token_file.clone(),
            ca_file: p.ca_file.clone(),
            watch_timeout: Duration::from_secs(290),
            backoff_min: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
        }
    }

    /// The InferencePool API's version for the group.
    pub fn version(&self) -> &'static str {
        if self.group == INFERENCE_POOL_GROUP_V1 {
            "v1"
        } else {
            "v1alpha2"
        }
    }
}

/// Watch the InferencePool and its pods until `stop`, reporting member sets and failures.
pub async fn watch(s: Settings, report: Report, stop: CancellationToken) {
    let mut backoff = Backoff::new(s.backoff_min, s.backoff_max);
    let api = loop {
        match Api::new(&s) {
            Ok(a) => break a,
            Err(e) => {
                tracing::error!(inference_pool = %s.pool, error = %e, "cannot reach the Kubernetes API; retrying");
                report(Event::Error("config"));
                if !backoff.wait(&stop).await {
                    return;
                }
            }
        }
    };
    tracing::info!(inference_pool = %s.pool, namespace = %api.namespace, api = %api.describe(), "watching the InferencePool's pods");
    let (spec_tx, mut spec_rx) = watch::channel(Known::Unknown);
    let pool_path = format!(
        "/apis/{}/{}/namespaces/{}/inferencepools",
        s.group,
        s.version(),
        api.namespace
    );
    let pool_query = format!(
        "fieldSelector={}",
        api::encode(&format!("metadata.name={}", s.pool))
    );
    let mut pool_store = PoolStore {
        name: s.pool.clone(),
        tx: spec_tx,
    };
    let pools = reflect(
        &api,
        &s,
        &pool_path,
        &pool_query,
        &mut pool_store,
        &report,
        &stop,
    );
    let pods = async {
        loop {
            let known = spec_rx.borrow_and_update().clone();
            let spec = match known {
                Known::Present(spec) => spec,
                // Not listed yet: the pool keeps what it has (a restarted watcher must not
                // empty it before the API server answered).
                Known::Unknown | Known::Absent => {
                    if known == Known::Absent {
                        report(Event::Members(Vec::new()));
                    }
                    if spec_rx.changed().await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            tracing::info!(inference_pool = %s.pool, selector = %spec.selector_query(), ports = ?spec.ports, "InferencePool selector");
            let mut store = PodStore {
                spec: spec.clone(),
                pods: BTreeMap::new(),
                report: report.clone(),
                last: None,
            };
            let path = format!("/api/v1/namespaces/{}/pods", api.namespace);
            let query = format!("labelSelector={}", api::encode(&spec.selector_query()));
            tokio::select! {
                _ = reflect(&api, &s, &path, &query, &mut store, &report, &stop) => return,
                changed = spec_rx.changed() => if changed.is_err() { return },
            }
        }
    };
    tokio::select! {
        _ = pools => {},
        _ = pods => {},
        _ = stop.cancelled() => {},
    }
}

/// What the API server said about the InferencePool.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Known {
    /// Not listed yet.
    Unknown,
    /// Not there (not created yet, or deleted): no members.
    Absent,
    Present(PoolSpec),
}

/// The InferencePool reflector's store: publishes the pool's spec.
struct PoolStore {
    name: String,
    tx: watch::Sender<Known>,
}

impl PoolStore {
    fn set(&mut self, obj: Option<&Value>) -> Result<(), String> {
        let spec = match obj {
            None => {
                if *self.tx.borrow() != Known::Absent {
                    tracing::warn!(inference_pool = %self.name, "InferencePool not found: the pool has no members");
                }
                Known::Absent
            }
            Some(o) => Known::Present(PoolSpec::from_object(o)?),
        };
        self.tx.send_if_modified(|cur| {
            let changed = *cur != spec;
            *cur = spec;
            changed
        });
        Ok(())
    }
}

impl Store for PoolStore {
    fn replace(&mut self, items: Vec<Value>) -> Result<(), String> {
        // None: not created yet (or deleted while we were away): no members until it is.
        let mine = items
            .iter()
            .find(|o| objects::name(o) == Some(self.name.as_str()));
        self.set(mine)
    }

    fn apply(&mut self, kind: &str, obj: Value) -> Result<(), String> {
        if objects::name(&obj) != Some(self.name.as_str()) {
            return Ok(());
        }
        if kind == "DELETED" {
            self.set(None)
        } else {
            self.set(Some(&obj))
        }
    }
}

/// The pod reflector's store: the selected pods, and the members they make.
struct PodStore {
    spec: PoolSpec,
    pods: BTreeMap<String, PodInfo>,
    report: Report,
    last: Option<Vec<Member>>,
}

impl PodStore {
    fn publish(&mut self) {
        let members = pod_members(self.pods.values(), &self.spec.ports);
        if self.last.as_ref() != Some(&members) {
            self.last = Some(members.clone());
            (self.report)(Event::Members(members));
        }
    }
}

impl Store for PodStore {
    fn replace(&mut self, items: Vec<Value>) -> Result<(), String> {
        let mut bad = None;
        self.pods.clear();
        for o in &items {
            match PodInfo::from_object(o) {
                Ok(p) => {
                    self.pods.insert(p.name.clone(), p);
                }
                Err(e) => bad = Some(e),
            }
        }
        self.publish();
        bad.map_or(Ok(()), Err)
    }

    fn apply(&mut self, kind: &str, obj: Value) -> Result<(), String> {
        let p = PodInfo::from_object(&obj)?;
        if kind == "DELETED" {
            self.pods.remove(&p.name);
        } else {
            self.pods.insert(p.name.clone(), p);
        }
        self.publish();
        Ok(())
    }
}
