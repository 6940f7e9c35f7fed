//! [`RemoteLoads`]: the load other gateway replicas put on our workers (cluster mode), kept apart
//! from [`super::ActiveSequences`] (our own accounting, never mutated by peers) and added to each
//! candidate as a separate term. Keyed by replica: each replica's in-flight requests, so when its
//! heartbeats stop ([`RemoteLoads::expire`]) its whole share goes instead of leaking.
//!
//! Remote active blocks are summed per request, not deduplicated against our own or other
//! replicas' blocks (peers send counts, not block sets). The gateway therefore sends each
//! request's blocks beyond the prefix its worker is predicted to hold, so a prefix shared by many
//! in-flight requests on one worker is not counted once per request.

use crate::select::Candidate;
use crate::{WorkerId, WorkerLoad};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
struct Request {
    worker: WorkerId,
    prefill: u64,
    blocks: u32,
}

#[derive(Debug)]
struct Replica {
    last_heard: Instant,
    requests: HashMap<u64, Request>,
}

/// Peers' in-flight load per worker, per replica. Not thread-safe: the gateway holds it in a lock.
#[derive(Debug, Default)]
pub struct RemoteLoads {
    replicas: HashMap<String, Replica>,
    /// Sum over replicas, indexed by `WorkerId`.
    sums: Vec<WorkerLoad>,
}

impl RemoteLoads {
    /// An empty table (no peer heard from yet).
    pub fn new() -> Self {
        Self::default()
    }

    fn replica(&mut self, replica: &str, now: Instant) -> &mut Replica {
        let r = self
            .replicas
            .entry(replica.to_owned())
            .or_insert_with(|| Replica {
                last_heard: now,
                requests: HashMap::new(),
            });
        if now > r.last_heard {
            r.last_heard = now;
        }
        r
    }

    fn sum(&mut self, w: WorkerId) -> &mut WorkerLoad {
        if self.sums.len() <= w.index() {
            self.sums.resize(w.index() + 1, WorkerLoad::default());
        }
        &mut self.sums[w.index()]
    }

    fn add_sum(&mut self, r: Request, sign: bool) {
        let s = self.sum(r.worker);
        if sign {
            s.active_blocks = s.active_blocks.saturating_add(r.blocks);
            s.pending_prefill_tokens = s.pending_prefill_tokens.saturating_add(r.prefill);
            s.inflight = s.inflight.saturating_add(1);
        } else {
            s.active_blocks = s.active_blocks.saturating_sub(r.blocks);
            s.pending_prefill_tokens = s.pending_prefill_tokens.saturating_sub(r.prefill);
            s.inflight = s.inflight.saturating_sub(1);
        }
    }

    /// A message from `replica` arrived at `now` (any kind keeps its share alive).
    pub fn heard(&mut self, replica: &str, now: Instant) {
        self.replica(replica, now);
    }

    /// `replica` dispatched `request` to `worker`. A repeated id replaces the old entry.
    pub fn dispatch(
        &mut self,
        replica: &str,
        request: u64,
        worker: WorkerId,
        prefill_tokens: u64,
        blocks: u32,
        now: Instant,
    ) {
        let r = Request {
            worker,
            prefill: prefill_tokens,
            blocks,
        };
        let old = self.replica(replica, now).requests.insert(request, r);
        if let Some(old) = old {
            self.add_sum(old, false);
        }
        self.add_sum(r, true);
    }

    /// `request` of `replica` got its first token: its prefill is no longer pending.
    pub fn prefill_done(&mut self, replica: &str, request: u64, now: Instant) {
        let Some(r) = self.replica(replica, now).requests.get_mut(&request) else {
            return;
        };
        let (w, p) = (r.worker, r.prefill);
        r.prefill = 0;
        let s = self.sum(w);
        s.pending_prefill_tokens = s.pending_prefill_tokens.saturating_sub(p);
    }

    /// `request` of `replica` ended.
    pub fn free(&mut self, replica: &str, request: u64, now: Instant) {
        if let Some(r) = self.replica(replica, now).requests.remove(&request) {
            self.add_sum(r, false);
        }
    }

    /// Replace everything known of `replica` by its snapshot's list of
    /// `(request, worker, pending prefill tokens, blocks)`.
    pub fn replace(
        &mut self,
        replica: &str,
        entries: impl IntoIterator<Item = (u64, WorkerId, u64, u32)>,
        now: Instant,
    ) {
        self.drop_replica(replica);
        for (request, worker, prefill, blocks) in entries {
            self.dispatch(replica, request, worker, prefill, blocks, now);
        }
        self.heard(replica, now);
    }

    fn drop_replica(&mut self, replica: &str) -> bool {
        let Some(r) = self.replicas.remove(replica) else {
            return false;
        };
        for req in r.requests.into_values() {
            self.add_sum(req, false);
        }
        true
    }

    /// Drop every replica not heard from for more than `timeout` before `now`; returns their ids.
    pub fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<String> {
        let dead: Vec<String> = self
            .replicas
            .iter()
            .filter(|(_, r)| now.saturating_duration_since(r.last_heard) > timeout)
            .map(|(k, _)| k.clone())
            .collect();
        for d in &dead {
            self.drop_replica(d);
        }
        dead
    }

    /// Forget a worker removed from the fleet.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        for r in self.replicas.values_mut() {
            r.requests.retain(|_, q| q.worker != worker);
        }
        if let Some(s) = self.sums.get_mut(worker.index()) {
            *s = WorkerLoad::default();
        }
    }

    /// Peers' load on `worker`.
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.sums.get(worker.index()).copied().unwrap_or_default()
    }

    /// Adds peers' load to each candidate's router-side load (after our own was filled in).
    pub fn add_into(&self, candidates: &mut [Candidate]) {
        for c in candidates {
            let l = self.load(c.worker);
            c.active_blocks = c.active_blocks.saturating_add(l.active_blocks);
            c.pending_prefill_tokens = c
                .pending_prefill_tokens
                .saturating_add(l.pending_prefill_tokens);
            c.inflight = c.inflight.saturating_add(l.inflight);
        }
    }

    /// Replicas currently holding a share (heard from and not expired).
    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// Peers' requests in flight, all replicas and workers.
    pub fn total_inflight(&self) -> usize {
        self.replicas.values().map(|r| r.requests.len()).sum()
    }

    /// Requests `replica` has in flight as we know it.
    pub fn inflight_of(&self, replica: &str) -> usize {
        self.replicas.get(replica).map_or(0, |r| r.requests.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W0: WorkerId = WorkerId(0);
    const W1: WorkerId = WorkerId(1);

    #[test]
    fn shares_add_per_replica_and_free_releases_them() {
        let t = Instant::now();
        let mut r = RemoteLoads::new();
        r.dispatch("a", 1, W0, 100, 4, t);
        r.dispatch("b", 1, W0, 50, 2, t);
        r.dispatch("a", 2, W1, 10, 1, t);
        assert_eq!(
            r.load(W0),
            WorkerLoad {
                active_blocks: 6,
                pending_prefill_tokens: 150,
                inflight: 2
            }
        );
        r.prefill_done("a", 1, t);
        assert_eq!(r.load(W0).pending_prefill_tokens, 50);
        r.free("a", 1, t);
        r.free("a", 1, t);
        assert_eq!(
            r.load(W0),
            WorkerLoad {
                active_blocks: 2,
                pending_prefill_tokens: 50,
                inflight: 1
            }
        );
        let mut c = [Candidate::new(W0), Candidate::new(W1)];
        c[0].inflight = 3;
        r.add_into(&mut c);
        assert_eq!((c[0].inflight, c[0].active_blocks), (4, 2));
        assert_eq!((c[1].inflight, c[1].pending_prefill_tokens), (1, 10));
    }

    #[test]
    fn a_silent_replica_expires_with_its_whole_share() {
        let t = Instant::now();
        let mut r = RemoteLoads::new();
        r.dispatch("a", 1, W0, 100, 4, t);
        r.dispatch("b", 1, W0, 50, 2, t);
        let later = t + Duration::from_secs(3);
        r.heard("b", later);
        assert!(r.expire(later, Duration::from_secs(5)).is_empty());
        let dead = r.expire(t + Duration::from_secs(6), Duration::from_secs(5));
        assert_eq!(dead, vec!["a".to_string()]);
        assert_eq!(r.load(W0).inflight, 1);
        assert_eq!(r.replicas(), 1);
    }

    #[test]
    fn a_snapshot_replaces_a_replicas_entries() {
        let t = Instant::now();
        let mut r = RemoteLoads::new();
        r.dispatch("a", 1, W0, 100, 4, t);
        r.replace("a", [(7, W1, 5, 1), (8, W1, 0, 2)], t);
        assert_eq!(r.load(W0), WorkerLoad::default());
        assert_eq!(r.load(W1).inflight, 2);
        assert_eq!(r.inflight_of("a"), 2);
        r.remove_worker(W1);
        assert_eq!(r.load(W1), WorkerLoad::default());
    }
}
