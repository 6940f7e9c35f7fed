//! The ZMQ KV-event feed of one worker: find its publishers (configured, or discovered through vLLM
//! `/kv_event_sources` / SGLang `/server_info`), run one subscriber per publisher (DP rank), and
//! look again when the worker restarted (health flap) or a subscriber keeps failing to connect: a
//! worker restarted on other event ports gets new subscribers, and its old entries are cleared.

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::WorkerId;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::discover::{discover_kv_sources, KvSource};
use crate::http::HttpClient;
use crate::reset::ResetBus;
use crate::sink::{FleetSink, ResetReason};
use crate::stats::FleetStats;
use crate::subscriber::{self, SubscriberSettings};
use crate::WorkerKind;

pub(crate) struct FeedSettings {
    pub base_url: String,
    pub kind: WorkerKind,
    /// Configured publishers; `None` = discover them.
    pub configured: Option<Vec<KvSource>>,
    pub discover_timeout: Duration,
    /// First retry delay of a failed discovery (doubles up to 30 s).
    pub retry: Duration,
    /// Template for each subscriber (its `source` is replaced).
    pub subscriber: SubscriberSettings,
}

pub(crate) struct Feed {
    pub worker: WorkerId,
    pub name: Arc<str>,
    pub client: HttpClient,
    pub sink: Arc<dyn FleetSink>,
    pub stats: Arc<FleetStats>,
    pub bus: Arc<ResetBus>,
}

impl Feed {
    /// Runs until `cancel` fires.
    pub async fn run(self, f: FeedSettings, cancel: CancellationToken) {
        let mut restarts = self.bus.restarts();
        restarts.borrow_and_update();
        let mut sources = match &f.configured {
            Some(s) => s.clone(),
            None => match self.discover_until_answered(&f, &cancel).await {
                Some(s) => s,
                None => return,
            },
        };
        loop {
            let generation = cancel.child_token();
            let mut subs = JoinSet::new();
            for source in &sources {
                let mut s = f.subscriber.clone();
                s.source = source.clone();
                subs.spawn(subscriber::run(
                    self.worker,
                    self.name.clone(),
                    s,
                    self.sink.clone(),
                    self.stats.clone(),
                    self.bus.clone(),
                    generation.clone(),
                ));
            }
            let next = loop {
                tokio::select! {
                    _ = cancel.cancelled() => {
                        crate::monitor::drain(subs).await;
                        return;
                    }
                    r = restarts.changed() => {
                        if r.is_err() {
                            return crate::monitor::drain(subs).await;
                        }
                        restarts.borrow_and_update();
                    }
                    _ = self.bus.rediscover_asked() => {}
                }
                if f.configured.is_some() {
                    continue;
                }
                match discover_kv_sources(&self.client, &f.base_url, f.kind, f.discover_timeout)
                    .await
                {
                    Ok(new) if new != sources => break new,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(worker = %self.name, error = %e, "KV event re-discovery failed")
                    }
                }
            };
            tracing::info!(worker = %self.name, from = ?sources, to = ?next,
                "KV event endpoints changed: resubscribing");
            generation.cancel();
            crate::monitor::drain(subs).await;
            // What the old publishers told us describes a process that is gone.
            self.bus.clear(ResetReason::Restart);
            sources = next;
        }
    }

    /// Asks the worker until it answers; `None` when cancelled. A worker without a discovery
    /// endpoint (404) publishes nothing: approximate index.
    async fn discover_until_answered(
        &self,
        f: &FeedSettings,
        cancel: &CancellationToken,
    ) -> Option<Vec<KvSource>> {
        let mut wait = f.retry;
        loop {
            match discover_kv_sources(&self.client, &f.base_url, f.kind, f.discover_timeout).await {
                Ok(s) => {
                    if s.is_empty() {
                        tracing::info!(worker = %self.name, "worker publishes no KV events: approximate index");
                    }
                    return Some(s);
                }
                Err(e) if e.contains("HTTP 404") => {
                    tracing::info!(worker = %self.name, error = %e, "no KV event discovery endpoint: approximate index");
                    return Some(Vec::new());
                }
                Err(e) => {
                    tracing::debug!(worker = %self.name, error = %e, "KV event discovery failed; retrying")
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(Duration::from_secs(30));
        }
    }
}
