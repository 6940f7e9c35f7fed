//! A bounded map whose entries expire: session → last worker (`route/router.rs`) and response id
//! → origin worker (`pins.rs`). Entries live `ttl` after their last insert; past `max` entries the
//! oldest insert is forgotten first. Time is passed in (tests use any `Instant`).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub struct TtlMap<K, V> {
    inner: Mutex<Inner<K, V>>,
}

struct Inner<K, V> {
    ttl: Duration,
    max: usize,
    map: HashMap<K, (V, Instant)>,
    /// Inserts in order, with their instant; an entry re-inserted later is found stale here (its
    /// instant differs from the map's) and skipped.
    order: VecDeque<(K, Instant)>,
}

impl<K: Hash + Eq + Clone, V: Clone> TtlMap<K, V> {
    pub fn new(ttl: Duration, max: usize) -> Self {
        TtlMap {
            inner: Mutex::new(Inner {
                ttl,
                max: max.max(1),
                map: HashMap::new(),
                order: VecDeque::new(),
            }),
        }
    }

    /// New bounds (a reload); entries over them go with the next inserts.
    pub fn set_limits(&self, ttl: Duration, max: usize) {
        let mut inner = self.inner.lock();
        inner.ttl = ttl;
        inner.max = max.max(1);
    }

    /// The live value of `k`.
    pub fn get(&self, k: &K, now: Instant) -> Option<V> {
        let inner = self.inner.lock();
        let (v, at) = inner.map.get(k)?;
        (now.saturating_duration_since(*at) < inner.ttl).then(|| v.clone())
    }

    /// The live value of `k` and when it was set.
    pub fn get_with_time(&self, k: &K, now: Instant) -> Option<(V, Instant)> {
        let inner = self.inner.lock();
        let (v, at) = inner.map.get(k)?;
        (now.saturating_duration_since(*at) < inner.ttl).then(|| (v.clone(), *at))
    }

    /// Sets `k` (its lifetime starts again), dropping expired entries and, past the bound, the
    /// oldest ones.
    pub fn insert(&self, k: K, v: V, now: Instant) {
        let mut inner = self.inner.lock();
        inner.map.insert(k.clone(), (v, now));
        inner.order.push_back((k, now));
        // Amortised: each insert pops what it can from the front.
        while let Some((front, at)) = inner.order.front().cloned() {
            let current = inner.map.get(&front).map(|(_, t)| *t);
            let stale = current != Some(at);
            let expired = now.saturating_duration_since(at) >= inner.ttl;
            let over = inner.map.len() > inner.max;
            if stale {
                inner.order.pop_front();
            } else if expired || over {
                inner.order.pop_front();
                inner.map.remove(&front);
            } else {
                break;
            }
        }
        // Keep the order queue from growing without bound under re-inserts of the same keys.
        if inner.order.len() > 2 * inner.max + 16 {
            let Inner { map, order, .. } = &mut *inner;
            order.retain(|(k, at)| map.get(k).is_some_and(|(_, t)| t == at));
        }
    }

    /// Forgets `k`.
    pub fn remove(&self, k: &K) {
        self.inner.lock().map.remove(k);
    }

    /// Entries held (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_expire_and_the_oldest_go_first() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let m = TtlMap::new(Duration::from_secs(10), 3);
        m.insert("a", 1, t0);
        m.insert("b", 2, t0 + s);
        assert_eq!(m.get(&"a", t0 + 9 * s), Some(1));
        assert_eq!(m.get(&"a", t0 + 10 * s), None, "expired");
        // Re-inserting renews.
        m.insert("a", 3, t0 + 5 * s);
        assert_eq!(m.get(&"a", t0 + 14 * s), Some(3));
        m.insert("c", 4, t0 + 6 * s);
        m.insert("d", 5, t0 + 7 * s);
        assert_eq!(m.len(), 3, "bounded");
        assert_eq!(m.get(&"b", t0 + 7 * s), None, "oldest insert forgotten");
        assert_eq!(m.get(&"a", t0 + 7 * s), Some(3));
        // Expired entries are dropped by later inserts.
        m.insert("e", 6, t0 + 30 * s);
        assert_eq!(m.len(), 1);
        m.remove(&"e");
        assert!(m.is_empty());
    }

    #[test]
    fn re_inserting_one_key_does_not_grow_memory() {
        let t0 = Instant::now();
        let m = TtlMap::new(Duration::from_secs(1000), 4);
        for i in 0..10_000u64 {
            m.insert(1u64, i, t0 + Duration::from_millis(i));
        }
        assert_eq!(m.len(), 1);
        assert!(m.inner.lock().order.len() <= 2 * 4 + 16 + 1);
    }
}
