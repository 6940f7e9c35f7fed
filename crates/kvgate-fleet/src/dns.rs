//! DNS discovery: a worker pool given as `host:port` (typically a Kubernetes headless Service) is
//! re-resolved every interval, and each change of the address set is reported as a diff
//! (`added`/`removed` socket addresses), the way Envoy's strict-DNS clusters track their hosts.
//!
//! Failure policy (also Envoy's): a lookup that errors, times out or returns no address is counted
//! in [`DnsStats`] and the last good set is kept, so a DNS blip never empties the fleet. Only a
//! successful answer removes addresses.
//!
//! The loop owns nothing but the name: what an address *means* (a worker with its scraper, KV
//! subscriber and index entries) is the caller's business, done in the `on_change` callback. The
//! callback runs on the resolver task, so it must not block; the gateway applies the diff to its
//! registry snapshot (short, non-async) there.

use std::collections::BTreeSet;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What to resolve and how often.
#[derive(Debug, Clone)]
pub struct DnsConfig {
    /// `host:port`, e.g. `vllm-headless.llm.svc.cluster.local:8000`. IP literals work too.
    pub target: String,
    /// Time between the end of one lookup and the start of the next.
    pub interval: Duration,
    /// A lookup slower than this counts as a failure (the system resolver can hang for seconds).
    pub timeout: Duration,
}

impl DnsConfig {
    pub fn new(target: impl Into<String>) -> Self {
        DnsConfig {
            target: target.into(),
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(2),
        }
    }
}

/// One change of the resolved set. `current` is the whole set after the change, sorted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsChange {
    pub added: Vec<SocketAddr>,
    pub removed: Vec<SocketAddr>,
    pub current: Vec<SocketAddr>,
}

/// Counters the gateway may re-export as metrics.
#[derive(Debug, Default)]
pub struct DnsStats {
    /// Lookups attempted.
    pub lookups: AtomicU64,
    /// Lookups that failed (error, timeout or empty answer); the previous set was kept.
    pub failures: AtomicU64,
    /// Diffs reported through the callback.
    pub changes: AtomicU64,
    /// Size of the current (last good) set.
    pub addresses: AtomicU64,
}

impl DnsStats {
    pub fn lookups(&self) -> u64 {
        self.lookups.load(Ordering::Relaxed)
    }
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }
    pub fn addresses(&self) -> u64 {
        self.addresses.load(Ordering::Relaxed)
    }
}

pub type ResolveFuture = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send>>;

/// Name resolution behind a trait so tests can script answers under a paused clock.
pub trait Resolve: Send + Sync + 'static {
    fn resolve(&self, target: &str) -> ResolveFuture;
}

/// The operating system's resolver (`getaddrinfo` via `tokio::net::lookup_host`): honours
/// /etc/hosts, search domains and ndots, as every other process in the pod does.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(&self, target: &str) -> ResolveFuture {
        let target = target.to_owned();
        Box::pin(async move { Ok(tokio::net::lookup_host(target).await?.collect()) })
    }
}

impl<F, Fut> Resolve for F
where
    F: Fn(&str) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = io::Result<Vec<SocketAddr>>> + Send + 'static,
{
    fn resolve(&self, target: &str) -> ResolveFuture {
        Box::pin(self(target))
    }
}

/// Handle of a running resolver loop. Dropping it stops the loop; `shutdown` also waits for it.
pub struct DnsWatcher {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
    stats: Arc<DnsStats>,
}

impl DnsWatcher {
    /// Start resolving `cfg.target` with the system resolver. The first lookup happens at once;
    /// `on_change` is called only when the set changes (the first good answer is a change from
    /// the empty set).
    pub fn spawn<C>(cfg: DnsConfig, on_change: C) -> DnsWatcher
    where
        C: FnMut(DnsChange) + Send + 'static,
    {
        Self::spawn_with(cfg, SystemResolver, on_change)
    }

    /// As [`DnsWatcher::spawn`] with a custom resolver.
    pub fn spawn_with<R, C>(cfg: DnsConfig, resolver: R, on_change: C) -> DnsWatcher
    where
        R: Resolve,
        C: FnMut(DnsChange) + Send + 'static,
    {
        let cancel = CancellationToken::new();
        let stats = Arc::new(DnsStats::default());
        let task = tokio::spawn(run(cfg, resolver, on_change, cancel.clone(), stats.clone()));
        DnsWatcher {
            cancel,
            task: Some(task),
            stats,
        }
    }

    pub fn stats(&self) -> &Arc<DnsStats> {
        &self.stats
    }

    /// Stop the loop and wait until it has exited (no callback runs after this returns).
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for DnsWatcher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn run<R: Resolve, C: FnMut(DnsChange)>(
    cfg: DnsConfig,
    resolver: R,
    mut on_change: C,
    cancel: CancellationToken,
    stats: Arc<DnsStats>,
) {
    let mut current: BTreeSet<SocketAddr> = BTreeSet::new();
    loop {
        stats.lookups.fetch_add(1, Ordering::Relaxed);
        let answer = tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(cfg.timeout, resolver.resolve(&cfg.target)) => r,
        };
        match answer {
            Ok(Ok(addrs)) if !addrs.is_empty() => {
                let next: BTreeSet<SocketAddr> = addrs.into_iter().collect();
                if let Some(change) = diff(&current, &next) {
                    tracing::info!(target_name = %cfg.target, added = ?change.added, removed = ?change.removed, "DNS pool changed");
                    current = next;
                    stats
                        .addresses
                        .store(current.len() as u64, Ordering::Relaxed);
                    stats.changes.fetch_add(1, Ordering::Relaxed);
                    on_change(change);
                }
            }
            other => {
                stats.failures.fetch_add(1, Ordering::Relaxed);
                let why = match other {
                    Ok(Ok(_)) => "no addresses".to_string(),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("timed out after {:?}", cfg.timeout),
                };
                tracing::warn!(target_name = %cfg.target, error = %why, kept = current.len(), "DNS lookup failed; keeping the last good set");
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(cfg.interval) => {}
        }
    }
}

/// The change from `old` to `new`, or `None` when they are equal.
pub fn diff(old: &BTreeSet<SocketAddr>, new: &BTreeSet<SocketAddr>) -> Option<DnsChange> {
    let added: Vec<SocketAddr> = new.difference(old).copied().collect();
    let removed: Vec<SocketAddr> = old.difference(new).copied().collect();
    if added.is_empty() && removed.is_empty() {
        return None;
    }
    Some(DnsChange {
        added,
        removed,
        current: new.iter().copied().collect(),
    })
}

#[cfg(test)]
mod tests;
