//! Response pinning: vLLM and SGLang keep stored Responses (`store: true`) in the process that
//! produced them, so a `previous_response_id`, a `GET`/`DELETE /v1/responses/{id}`, a cancel or a
//! stream resume that lands on another worker answers 404. The observer learns each response id
//! from the reply it relays (a stream's `response.created`, a JSON body's `id`) and records the
//! worker here; later uses of the id go to that worker only, never retried elsewhere
//! (`proxy.rs`). Bounded by `[response_pins]` (`ttl_s`, `max_entries`); its size is the
//! `kvgate_response_pins` gauge. In cluster mode each learned id is published to the peers
//! (`pin` messages), so a follow-up reaching another replica finds its worker too.

use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;

use crate::config::ResponsePinsConfig;
use crate::metrics::Lbl;
use crate::ttl_map::TtlMap;

/// Cluster mode: how long an unknown id is waited for before the 404 (a peer's `pin` message).
pub const PEER_WAIT: Duration = Duration::from_millis(250);

pub struct ResponsePins {
    map: TtlMap<String, Lbl>,
    size: Gauge,
    /// Cluster mode: learned ids are published to the peers (`cluster.rs` applies theirs).
    cluster: std::sync::OnceLock<std::sync::Arc<kvgate_cluster::Cluster>>,
}

impl ResponsePins {
    pub fn new(cfg: &ResponsePinsConfig, size: Gauge) -> Self {
        ResponsePins {
            map: TtlMap::new(Duration::from_secs(cfg.ttl_s), cfg.max_entries),
            size,
            cluster: std::sync::OnceLock::new(),
        }
    }

    /// Cluster mode on: ids learned here are published to the peers from now on.
    pub fn set_cluster(&self, cluster: std::sync::Arc<kvgate_cluster::Cluster>) {
        let _ = self.cluster.set(cluster);
    }

    /// `id` was produced by the worker named `worker`.
    pub fn learn(&self, id: &str, worker: &Lbl, now: Instant) {
        if id.is_empty() {
            return;
        }
        self.insert(id, worker, now);
        if let Some(c) = self.cluster.get() {
            c.pin(id, worker);
        }
    }

    /// A peer learned `id` from `worker`.
    pub fn learn_from_peer(&self, id: &str, worker: &Lbl, now: Instant) {
        if !id.is_empty() {
            self.insert(id, worker, now);
        }
    }

    fn insert(&self, id: &str, worker: &Lbl, now: Instant) {
        self.map.insert(id.to_owned(), worker.clone(), now);
        self.size.set(self.map.len() as i64);
    }

    /// The worker that produced `id`, if it is pinned.
    pub fn origin(&self, id: &str, now: Instant) -> Option<Lbl> {
        self.map.get(&id.to_owned(), now)
    }

    /// [`Self::origin`]; in cluster mode an id not known yet is waited for up to
    /// [`PEER_WAIT`]: a client may send its follow-up to another replica faster than the
    /// producing replica's `pin` message travels.
    pub async fn origin_or_wait(&self, id: &str) -> Option<Lbl> {
        let start = crate::clock::now();
        if let Some(w) = self.origin(id, start) {
            return Some(w);
        }
        self.cluster.get()?;
        let key = id.to_owned();
        let deadline = tokio::time::Instant::now() + PEER_WAIT;
        while tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
            if let Some(w) = self.map.get(&key, crate::clock::now()) {
                return Some(w);
            }
        }
        None
    }

    /// `id` was deleted on its worker.
    pub fn forget(&self, id: &str) {
        self.map.remove(&id.to_owned());
        self.size.set(self.map.len() as i64);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_pin_to_their_worker_until_they_expire() {
        let cfg = ResponsePinsConfig {
            ttl_s: 60,
            max_entries: 10,
        };
        let g = Gauge::default();
        let p = ResponsePins::new(&cfg, g.clone());
        let t0 = Instant::now();
        let w: Lbl = Lbl::from("w1");
        p.learn("resp_1", &w, t0);
        assert_eq!(g.get(), 1);
        assert_eq!(p.origin("resp_1", t0).as_deref(), Some("w1"));
        assert_eq!(p.origin("resp_2", t0), None);
        assert_eq!(p.origin("resp_1", t0 + Duration::from_secs(61)), None);
        p.forget("resp_1");
        assert!(p.is_empty());
    }
}
