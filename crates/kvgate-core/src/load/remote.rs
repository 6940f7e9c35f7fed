//! [`RemoteLoads`]: the load other gateway replicas put on our workers (cluster mode), kept apart
//! from [`super::ActiveSequences`] (our own accounting, never mutated by peers) and added to each
//! candidate as a separate term. Keyed by replica: each replica's in-flight requests, so when its
//! heartbeats stop ([`RemoteLoads::expire`]) its whole share goes instead of leaking.
//!
//! A peer's request that came with its block hashes (every `route` message) is *tracked*: it is
//! registered in our [`super::ActiveSequences`] under a [`LoadGuard`] held here, so its blocks
//! are counted as a set together with ours and every other peer's (a prefix four replicas sent to
//! one worker at the same instant is active there once, as through one replica), and freed when
//! the peer frees it or its share expires. Requests known only as counts (a snapshot's list) are
//! summed per request, not deduplicated; the gateway sends each request's blocks beyond the prefix
//! its worker is predicted to hold, so a shared prefix is not counted once per request there.
//!
//! Provisional load: peers' decisions reach us a few milliseconds late (the sync lag), and in a
//! burst behind a load balancer every replica takes its share of the decisions in that same
//! instant, from the same picture of the fleet. Each of our own decisions therefore also counts as
//! if each live peer had just made it ([`RemoteLoads::routed_here`]: once per peer we hold a share
//! of), until that peer's next real decision arrives and replaces the guess (each decision of a
//! peer retires its oldest outstanding guess, whichever worker either names) or the guess is older
//! than the provisional window (a peer that routed nothing meanwhile). Without the retirement a
//! peer's decision counted twice for the whole window, once as itself and once as our guess of it,
//! and a burst spread over more workers (opening more prefixes) than through one replica. The window is the configured floor or the recent sync lag
//! ([`RemoteLoads::observe_lag`]: its peak, halving every second), whichever is longer: a busy
//! host's lag outlasts a fixed window. Without it four replicas each sent their share of a burst to the
//! worker that looked cheapest, and the burst piled onto fewer workers than through one replica
//! (docs/cluster.md, Measured).

use crate::select::Candidate;
use crate::{LoadGuard, WorkerId, WorkerLoad};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
struct Request {
    worker: WorkerId,
    prefill: u64,
    blocks: u32,
}

/// A peer's in-flight request.
#[derive(Debug)]
enum Remote {
    /// Known by its counts: summed in `RemoteLoads::sums`.
    Counted(Request),
    /// Registered in the router's active sequences (its blocks deduplicated with everyone's).
    Tracked(LoadGuard),
}

#[derive(Debug)]
struct Replica {
    last_heard: Instant,
    requests: HashMap<u64, Remote>,
    /// Sequence number of our oldest provisional decision this replica's next real one retires.
    retire_from: u64,
}

/// One of our own decisions, still young enough to stand for the peers' concurrent ones.
#[derive(Debug, Clone, Copy)]
struct Provisional {
    at: Instant,
    req: Request,
    /// The decision's [`crate::Decision::share`]: how likely a peer with our view made it too.
    share: f64,
    /// Our decisions are numbered in order (see `Replica::retire_from`).
    seq: u64,
    /// Live peers it still stands for: those at the decision, less those whose real decision has
    /// retired it since.
    peers: f64,
}

/// The recent sync lag stretches the provisional window at most to this (a skewed clock between
/// hosts must not make every decision count for seconds).
const LAG_WINDOW_MAX: Duration = Duration::from_millis(250);

/// Our own decisions kept at most this many (a bound on memory, not a setting: at any realistic
/// rate the window empties the queue long before).
const PROVISIONAL_MAX: usize = 4096;

/// Peers' in-flight load per worker, per replica. Not thread-safe: the gateway holds it in a lock.
#[derive(Debug, Default)]
pub struct RemoteLoads {
    replicas: HashMap<String, Replica>,
    /// Sum over replicas, indexed by `WorkerId`.
    sums: Vec<WorkerLoad>,
    /// Our own decisions younger than `window`, oldest first.
    provisional: VecDeque<Provisional>,
    /// `provisional` summed per worker (indexed by `WorkerId`): requests, blocks and prefill
    /// tokens weighted by share × peers, kept as entries come and go so a decision reads one entry
    /// per candidate.
    provisional_sums: Vec<[f64; 3]>,
    /// Sequence number of our next decision.
    next_seq: u64,
    /// Shortest time one of our decisions also stands for the peers' (zero: off).
    window: Duration,
    /// Peak sync lag of peers' decisions and when it was seen (decays: see `recent_lag`).
    lag_peak: (Duration, Option<Instant>),
}

impl RemoteLoads {
    /// An empty table (no peer heard from yet).
    pub fn new() -> Self {
        Self::default()
    }

    fn replica(&mut self, replica: &str, now: Instant) -> &mut Replica {
        // Our decisions before a replica was heard from do not stand for it.
        let next = self.next_seq;
        let r = self
            .replicas
            .entry(replica.to_owned())
            .or_insert_with(|| Replica {
                last_heard: now,
                requests: HashMap::new(),
                retire_from: next,
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

    /// Takes a request that left out of the sums (a tracked one frees itself when dropped).
    fn forget(&mut self, r: Remote) {
        if let Remote::Counted(r) = r {
            self.add_sum(r, false);
        }
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

    /// How long each of our own decisions also counts as provisional load of every live peer
    /// ([`RemoteLoads::routed_here`]); zero turns it off.
    pub fn set_provisional_window(&mut self, window: Duration) {
        self.window = window;
        if window.is_zero() {
            self.provisional.clear();
            self.provisional_sums.clear();
        }
    }

    /// Adds `peers` (negative: removes) times the share-weighted load of one provisional entry to
    /// the per-worker sums.
    fn count_provisional(&mut self, p: &Provisional, peers: f64) {
        let i = p.req.worker.index();
        if self.provisional_sums.len() <= i {
            self.provisional_sums.resize(i + 1, [0.0; 3]);
        }
        let s = &mut self.provisional_sums[i];
        let w = peers * p.share;
        s[0] += w;
        s[1] += w * f64::from(p.req.blocks);
        s[2] += w * p.req.prefill as f64;
    }

    fn pop_provisional(&mut self) {
        if let Some(p) = self.provisional.pop_front() {
            self.count_provisional(&p, -p.peers);
        }
        if self.provisional.is_empty() {
            // No rounding residue survives an empty window.
            self.provisional_sums.iter_mut().for_each(|s| *s = [0.0; 3]);
        }
    }

    /// We dispatched a request to `worker` at `now`, with the load a `route` message of ours
    /// carries (`prefill_tokens` pending, `blocks` added) and the decision's `share` (the
    /// probability a router with our view picks that worker: 1 for a clear winner, 1/k among k
    /// equally cheap workers, which peers spread over). It counts `share` more times for each peer
    /// live now in [`RemoteLoads::add_into_at`], until that peer's next real decision retires it
    /// ([`RemoteLoads::dispatch`]) or it is older than the provisional window. No live peer:
    /// nothing to stand for.
    pub fn routed_here(
        &mut self,
        worker: WorkerId,
        prefill_tokens: u64,
        blocks: u32,
        share: f64,
        now: Instant,
    ) {
        if self.window.is_zero() || share.is_nan() || share <= 0.0 || self.replicas.is_empty() {
            return;
        }
        self.prune(now);
        if self.provisional.len() >= PROVISIONAL_MAX {
            self.pop_provisional();
        }
        let p = Provisional {
            at: now,
            req: Request {
                worker,
                prefill: prefill_tokens,
                blocks,
            },
            share: share.min(1.0),
            seq: self.next_seq,
            peers: self.replicas.len() as f64,
        };
        self.next_seq += 1;
        self.count_provisional(&p, p.peers);
        self.provisional.push_back(p);
    }

    /// `replica` made a real decision: it retires the oldest of our provisional decisions that
    /// still stands for one of its own (none outstanding: nothing to retire).
    fn retire_guess(&mut self, replica: &str, now: Instant) {
        let Some(front) = self.provisional.front().map(|p| p.seq) else {
            return;
        };
        let next = self.next_seq;
        let r = self.replica(replica, now);
        let seq = r.retire_from.max(front);
        if seq >= next {
            return;
        }
        r.retire_from = seq + 1;
        let i = (seq - front) as usize;
        let Some(&p) = self.provisional.get(i) else {
            return;
        };
        if p.peers >= 1.0 {
            self.provisional[i].peers -= 1.0;
            self.count_provisional(&p, -1.0);
        }
    }

    /// A peer's routing decision reached us `lag` after it was sent, at `now`.
    pub fn observe_lag(&mut self, lag: Duration, now: Instant) {
        if lag >= self.recent_lag(now) {
            self.lag_peak = (lag, Some(now));
        }
    }

    /// The peak sync lag, halved for every second since it was seen.
    fn recent_lag(&self, now: Instant) -> Duration {
        let (peak, Some(at)) = self.lag_peak else {
            return Duration::ZERO;
        };
        let age = now.saturating_duration_since(at).as_secs_f64();
        peak.mul_f64(0.5f64.powf(age))
    }

    /// How long our decisions count as provisional load at `now`: the configured window, or the
    /// recent sync lag when longer (up to [`LAG_WINDOW_MAX`]); zero when off.
    pub fn provisional_window(&self, now: Instant) -> Duration {
        if self.window.is_zero() {
            return Duration::ZERO;
        }
        self.window.max(self.recent_lag(now).min(LAG_WINDOW_MAX))
    }

    /// Drops our decisions older than the window.
    fn prune(&mut self, now: Instant) {
        let window = self.provisional_window(now);
        while let Some(p) = self.provisional.front() {
            if now.saturating_duration_since(p.at) < window {
                break;
            }
            self.pop_provisional();
        }
    }

    /// A message from `replica` arrived at `now` (any kind keeps its share alive).
    pub fn heard(&mut self, replica: &str, now: Instant) {
        self.replica(replica, now);
    }

    /// `replica` dispatched `request` to `worker`. A repeated id replaces the old entry. Its
    /// oldest outstanding provisional stand-in (our decision guessed for it) is retired.
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
        self.add_sum(r, true);
        self.insert(replica, request, Remote::Counted(r), now);
        self.retire_guess(replica, now);
    }

    /// [`RemoteLoads::dispatch`] of a request the caller registered in the router's active
    /// sequences (`guard`: its blocks, pending prefill and one in-flight request on its worker).
    /// Held until the peer frees it, its snapshot replaces it or the peer expires.
    pub fn dispatch_tracked(
        &mut self,
        replica: &str,
        request: u64,
        guard: LoadGuard,
        now: Instant,
    ) {
        self.insert(replica, request, Remote::Tracked(guard), now);
        self.retire_guess(replica, now);
    }

    fn insert(&mut self, replica: &str, request: u64, r: Remote, now: Instant) {
        if let Some(old) = self.replica(replica, now).requests.insert(request, r) {
            self.forget(old);
        }
    }

    /// `request` of `replica` got its first token: its prefill is no longer pending.
    pub fn prefill_done(&mut self, replica: &str, request: u64, now: Instant) {
        let Some(r) = self.replica(replica, now).requests.get_mut(&request) else {
            return;
        };
        match r {
            Remote::Tracked(g) => g.mark_prefill_done(),
            Remote::Counted(r) => {
                let (w, p) = (r.worker, r.prefill);
                r.prefill = 0;
                let s = self.sum(w);
                s.pending_prefill_tokens = s.pending_prefill_tokens.saturating_sub(p);
            }
        }
    }

    /// `request` of `replica` ended.
    pub fn free(&mut self, replica: &str, request: u64, now: Instant) {
        if let Some(r) = self.replica(replica, now).requests.remove(&request) {
            self.forget(r);
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
        let retire_from = self.replicas.get(replica).map_or(0, |r| r.retire_from);
        self.drop_replica(replica);
        self.extend(replica, entries, now);
        self.replica(replica, now).retire_from = retire_from;
    }

    /// Add a continuation of `replica`'s snapshot (its later parts, after
    /// [`RemoteLoads::replace`] took the first) to what is known of it.
    pub fn extend(
        &mut self,
        replica: &str,
        entries: impl IntoIterator<Item = (u64, WorkerId, u64, u32)>,
        now: Instant,
    ) {
        for (request, worker, prefill, blocks) in entries {
            let r = Request {
                worker,
                prefill,
                blocks,
            };
            self.add_sum(r, true);
            self.insert(replica, request, Remote::Counted(r), now);
        }
    }

    fn drop_replica(&mut self, replica: &str) -> bool {
        let Some(r) = self.replicas.remove(replica) else {
            return false;
        };
        for req in r.requests.into_values() {
            self.forget(req);
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
        // Tracked requests there are dropped from the active sequences with the worker.
        for r in self.replicas.values_mut() {
            r.requests.retain(|_, q| match q {
                Remote::Counted(q) => q.worker != worker,
                Remote::Tracked(g) => g.worker() != worker,
            });
        }
        if let Some(s) = self.sums.get_mut(worker.index()) {
            *s = WorkerLoad::default();
        }
    }

    /// Peers' counted load on `worker` (tracked requests are in the active sequences).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.sums.get(worker.index()).copied().unwrap_or_default()
    }

    /// Adds peers' load to each candidate's router-side load (after our own was filled in),
    /// without provisional load.
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

    /// [`RemoteLoads::add_into`] plus the provisional load at `now`: each of our decisions younger
    /// than the window counted `share` times per peer it still stands for on its worker (the
    /// expected number of peers that made it too and whose decision has not arrived), summed per
    /// worker and then rounded.
    pub fn add_into_at(&mut self, candidates: &mut [Candidate], now: Instant) {
        self.add_into(candidates);
        self.add_provisional_at(candidates, now);
    }

    /// The provisional part of [`RemoteLoads::add_into_at`] alone (after [`RemoteLoads::add_into`]).
    pub fn add_provisional_at(&mut self, candidates: &mut [Candidate], now: Instant) {
        self.prune(now);
        if self.provisional.is_empty() {
            return;
        }
        for c in candidates {
            let Some(&[n, blocks, prefill]) = self.provisional_sums.get(c.worker.index()) else {
                continue;
            };
            // `as` saturates: a sum past the integer's range counts as its maximum.
            c.active_blocks = c.active_blocks.saturating_add(blocks.round() as u32);
            c.pending_prefill_tokens = c
                .pending_prefill_tokens
                .saturating_add(prefill.round() as u64);
            c.inflight = c.inflight.saturating_add(n.round() as u32);
        }
    }

    /// Our decisions currently counted as provisional load (for tests and metrics).
    pub fn provisional_len(&self) -> usize {
        self.provisional.len()
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
    fn our_young_decisions_count_once_per_live_peer_until_the_window_ends() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut r = RemoteLoads::new();
        r.set_provisional_window(ms(10));
        // Alone (no peer heard from): our decisions are only our own load, then and later.
        r.routed_here(W0, 128, 8, 1.0, t);
        let mut c = [Candidate::new(W0), Candidate::new(W1)];
        r.add_into_at(&mut c, t);
        assert_eq!((c[0].inflight, c[0].active_blocks), (0, 0));
        assert_eq!(r.provisional_len(), 0);
        // Three live peers: each of them is taken to have made the same decision just now.
        for p in ["a", "b", "c"] {
            r.heard(p, t);
        }
        r.dispatch("a", 1, W1, 50, 2, t);
        r.routed_here(W0, 128, 8, 1.0, t);
        r.routed_here(W0, 128, 8, 1.0, t + ms(4));
        let mut c = [Candidate::new(W0), Candidate::new(W1)];
        r.add_into_at(&mut c, t + ms(5));
        assert_eq!(
            (
                c[0].inflight,
                c[0].active_blocks,
                c[0].pending_prefill_tokens
            ),
            (6, 48, 768)
        );
        assert_eq!((c[1].inflight, c[1].active_blocks), (1, 2));
        // The first decision ages out of the window, then the second; peers' real load stays.
        let mut c = [Candidate::new(W0), Candidate::new(W1)];
        r.add_into_at(&mut c, t + ms(10));
        assert_eq!((c[0].inflight, c[0].active_blocks), (3, 24));
        let mut c = [Candidate::new(W0), Candidate::new(W1)];
        r.add_into_at(&mut c, t + ms(14));
        assert_eq!((c[0].inflight, c[0].active_blocks), (0, 0));
        assert_eq!((c[1].inflight, c[1].active_blocks), (1, 2));
        assert_eq!(r.provisional_len(), 0);
        // A pick among 4 equally cheap workers: peers with our view spread over them, so it
        // stands for 3/4 of a request there.
        r.routed_here(W1, 1152, 72, 0.25, t + ms(14));
        let mut c = [Candidate::new(W0), Candidate::new(W1)];
        r.add_into_at(&mut c, t + ms(14));
        assert_eq!(
            (
                c[1].inflight,
                c[1].active_blocks,
                c[1].pending_prefill_tokens
            ),
            (1 + 1, 2 + 54, 50 + 864)
        );
        // A sync lag longer than the window stretches it while it is recent.
        r.observe_lag(ms(40), t + ms(20));
        assert_eq!(r.provisional_window(t + ms(20)), ms(40));
        r.routed_here(W0, 128, 8, 1.0, t + ms(20));
        let mut c = [Candidate::new(W0)];
        r.add_into_at(&mut c, t + ms(50));
        assert_eq!(c[0].inflight, 3);
        r.observe_lag(ms(5), t + ms(50));
        assert_eq!(r.provisional_window(t + ms(1020)), ms(20));
        assert_eq!(r.provisional_window(t + ms(3020)), ms(10));
        r.observe_lag(Duration::from_secs(30), t + ms(3020));
        assert_eq!(r.provisional_window(t + ms(3020)), LAG_WINDOW_MAX);
        // Past the cap the oldest entries leave the per-worker sums with the queue.
        let mut r2 = RemoteLoads::new();
        r2.set_provisional_window(ms(10));
        r2.heard("a", t);
        for _ in 0..PROVISIONAL_MAX + 10 {
            r2.routed_here(W1, 0, 1, 1.0, t);
        }
        r2.routed_here(W0, 0, 1, 1.0, t);
        assert_eq!(r2.provisional_len(), PROVISIONAL_MAX);
        let mut c = [Candidate::new(W0), Candidate::new(W1)];
        r2.add_into_at(&mut c, t);
        assert_eq!(
            (c[0].inflight, c[1].inflight),
            (1, PROVISIONAL_MAX as u32 - 1)
        );
        // A zero window turns it off.
        r.set_provisional_window(Duration::ZERO);
        r.routed_here(W0, 128, 8, 1.0, t + ms(15));
        let mut c = [Candidate::new(W0)];
        r.add_into_at(&mut c, t + ms(15));
        assert_eq!(c[0].inflight, 0);
    }

    #[test]
    fn a_peers_real_decision_retires_our_guess_of_it() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut r = RemoteLoads::new();
        r.set_provisional_window(ms(100));
        r.heard("a", t);
        r.heard("b", t);
        // Two of our decisions: each stands for one decision of a and one of b.
        r.routed_here(W0, 100, 4, 1.0, t);
        r.routed_here(W0, 100, 4, 1.0, t);
        let load = |r: &mut RemoteLoads| {
            let mut c = [Candidate::new(W0), Candidate::new(W1)];
            r.add_into_at(&mut c, t + ms(1));
            (c[0].inflight, c[0].active_blocks, c[1].inflight)
        };
        assert_eq!(load(&mut r), (4, 16, 0));
        // a's real decision (to another worker) arrives: it replaces a's share of our oldest
        // guess, it does not add to it.
        r.dispatch("a", 1, W1, 100, 4, t + ms(1));
        assert_eq!(load(&mut r), (3, 12, 1));
        r.dispatch("a", 2, W0, 100, 4, t + ms(1));
        assert_eq!(load(&mut r), (2 + 1, 8 + 4, 1));
        // a has replaced both guesses: its third decision retires nothing of b's.
        r.dispatch("a", 3, W1, 100, 4, t + ms(1));
        assert_eq!(load(&mut r), (2 + 1, 8 + 4, 2));
        r.dispatch("b", 1, W0, 100, 4, t + ms(1));
        assert_eq!(load(&mut r), (1 + 2, 4 + 8, 2));
        // A snapshot of b neither retires a guess nor forgets which ones b has replaced.
        r.replace("b", [(1, W0, 100, 4)], t + ms(1));
        assert_eq!(load(&mut r), (1 + 2, 4 + 8, 2));
        r.dispatch("b", 2, W1, 100, 4, t + ms(1));
        assert_eq!(load(&mut r), (2, 8, 3));
        // A replica first heard after our decisions retires none of them.
        r.dispatch("late", 1, W1, 100, 4, t + ms(1));
        assert_eq!(load(&mut r), (2, 8, 4));
        // A newer decision of ours stands for all three peers now; b's next one retires b's part.
        r.routed_here(W1, 100, 4, 1.0, t + ms(2));
        r.dispatch("b", 3, W0, 100, 4, t + ms(2));
        let mut c = [Candidate::new(W0), Candidate::new(W1)];
        r.add_into_at(&mut c, t + ms(3));
        assert_eq!((c[0].inflight, c[1].inflight), (3, 4 + 2));
    }

    #[test]
    fn tracked_requests_share_blocks_with_ours_and_leave_with_their_replica() {
        let t = Instant::now();
        let active = crate::ActiveSequences::new();
        let mut r = RemoteLoads::new();
        // A new 4-block prefix, sent to W0 at the same instant by us and by two peers (each with
        // its own 1-block suffix): active there once, plus the three suffixes.
        let ours = active.add_at(W0, 1, &[1, 2, 3, 4, 10], 80, 0, t);
        r.dispatch_tracked("a", 7, active.add_at(W0, 7, &[1, 2, 3, 4, 11], 80, 0, t), t);
        r.dispatch_tracked("b", 7, active.add_at(W0, 7, &[1, 2, 3, 4, 12], 16, 0, t), t);
        let mut c = [Candidate::new(W0)];
        active.fill_loads(&[1, 2, 3, 4, 13], &mut c);
        r.add_into(&mut c);
        assert_eq!(
            (c[0].active_blocks, c[0].inflight, c[0].new_blocks),
            (7, 3, 1)
        );
        assert_eq!(c[0].pending_prefill_tokens, 176);
        assert_eq!(r.total_inflight(), 2);
        r.prefill_done("a", 7, t);
        assert_eq!(active.snapshot(W0).pending_prefill_tokens, 96);
        // a frees its request; b goes silent and expires with its whole share.
        r.free("a", 7, t);
        assert_eq!(active.snapshot(W0).active_blocks, 6);
        r.heard("c", t + Duration::from_secs(10));
        assert_eq!(
            r.expire(t + Duration::from_secs(10), Duration::from_secs(5))
                .len(),
            2
        );
        assert_eq!(
            (
                active.snapshot(W0).active_blocks,
                active.snapshot(W0).inflight
            ),
            (5, 1)
        );
        drop(ours);
        assert_eq!(active.snapshot(W0), WorkerLoad::default());
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

    #[test]
    fn a_snapshot_in_parts_equals_one_snapshot() {
        let t = Instant::now();
        let entries = [(7, W1, 5, 1), (8, W1, 0, 2), (9, W0, 3, 3), (10, W0, 0, 1)];
        let mut whole = RemoteLoads::new();
        whole.dispatch("a", 1, W0, 100, 4, t);
        whole.replace("a", entries, t);
        let mut parts = RemoteLoads::new();
        parts.dispatch("a", 1, W0, 100, 4, t);
        parts.replace("a", entries[..1].iter().copied(), t);
        parts.extend("a", entries[1..3].iter().copied(), t);
        parts.extend("a", entries[3..].iter().copied(), t);
        for w in [W0, W1] {
            assert_eq!(parts.load(w), whole.load(w));
        }
        assert_eq!(parts.inflight_of("a"), 4);
        // A part repeating an entry replaces it, never counts it twice.
        parts.extend("a", [(9, W0, 3, 3)], t);
        assert_eq!(parts.load(W0), whole.load(W0));
        // A later first part starts over.
        parts.replace("a", [(11, W1, 1, 1)], t);
        assert_eq!(parts.load(W0), WorkerLoad::default());
        assert_eq!(parts.inflight_of("a"), 1);
    }
}
