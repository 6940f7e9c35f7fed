//! DNS worker pools (`[[worker_pools]] dns = "host:port"`): one kvgate-fleet [`DnsWatcher`] per
//! pool; each change of the resolved address set replaces the pool's workers in the registry, so
//! added addresses get a worker with fresh state (index entry, load, monitor) and removed ones lose
//! theirs, through the same rebuild path as config reloads and the admin API.
//!
//! Reload safety: [`run`] re-reads the registry's config every second and restarts the watcher of
//! a pool whose settings changed, stops the watcher of a pool that is gone (the registry already
//! dropped its workers on the reload), and starts watchers for new pools. Addresses that survive a
//! restart keep their state, because the registry keys worker state by URL.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvgate_fleet::dns::{DnsChange, DnsConfig, DnsWatcher};

use crate::config::WorkerPoolConfig;
use crate::fleet::WorkerFleet;

/// How often the set of pools is compared with the running config.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// Keep one watcher per configured pool until shutdown, then stop them all.
pub async fn run(app: Arc<WorkerFleet>) {
    let mut running: HashMap<String, (WorkerPoolConfig, DnsWatcher)> = HashMap::new();
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
pub async fn sync(
    app: &Arc<WorkerFleet>,
    running: &mut HashMap<String, (WorkerPoolConfig, DnsWatcher)>,
) {
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
            tracing::info!(pool = %key, "DNS worker pool stopped");
        }
    }
    for pool in &cfg.worker_pools {
        let key = pool.prefix().to_string();
        if running.contains_key(&key) {
            continue;
        }
        tracing::info!(pool = %key, dns = %pool.dns, every_s = pool.refresh_s, "DNS worker pool started");
        let watcher = spawn_watcher(app.clone(), pool.clone());
        running.insert(key, (pool.clone(), watcher));
    }
}

fn spawn_watcher(app: Arc<WorkerFleet>, pool: WorkerPoolConfig) -> DnsWatcher {
    let mut dc = DnsConfig::new(pool.dns.clone());
    dc.interval = Duration::from_secs(pool.refresh_s.max(1));
    let key = pool.prefix().to_string();
    DnsWatcher::spawn(dc, move |change: DnsChange| {
        let workers = change.current.iter().map(|a| pool.worker_for(*a)).collect();
        match app.registry.set_dns_pool(&key, workers) {
            Ok(r) => app.apply_rebuild(&r),
            Err(e) => {
                tracing::error!(pool = %key, error = %format!("{e:#}"), "applying DNS change failed")
            }
        }
    })
}
