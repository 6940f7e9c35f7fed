use super::approx::REFRESH_DIVISOR;
use super::*;
use crate::hash::{block_hashes, BASE_SEED};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};

const W0: WorkerId = WorkerId(0);
const W1: WorkerId = WorkerId(1);

fn toks(n: u32, base: u32) -> Vec<u32> {
    (base..base + n).collect()
}

fn matches(ix: &KvIndex, hashes: &[u64], now: Instant) -> BTreeMap<u32, u32> {
    let mut out = OverlapScores::new();
    ix.find_matches(hashes, now, &mut out);
    out.iter().map(|(w, r)| (w.0, r)).collect()
}

#[test]
fn stored_chain_matches_router_hashes() {
    let mut ix = KvIndex::new();
    let t = toks(64, 1);
    let h = block_hashes(&t, 16, BASE_SEED);
    // Engine hashes are opaque and unrelated to ours.
    assert_eq!(
        ix.apply_stored(W0, None, &[900, 901], &t[..32], 16, BASE_SEED),
        Ok(2)
    );
    assert_eq!(
        ix.apply_stored(W0, Some(901), &[902], &t[32..48], 16, BASE_SEED),
        Ok(1)
    );
    assert_eq!(ix.router_hashes(W0), {
        let mut v = h[..3].to_vec();
        v.sort();
        v
    });
    let now = Instant::now();
    assert_eq!(matches(&ix, &h, now), BTreeMap::from([(0, 3)]));
    // Idempotent.
    assert_eq!(
        ix.apply_stored(W0, None, &[900, 901], &t[..32], 16, BASE_SEED),
        Ok(0)
    );
    assert_eq!(ix.total_entries(), 3);
    // Removing the middle block breaks the run at block 1.
    assert_eq!(ix.apply_removed(W0, &[901, 12345]), 1);
    assert_eq!(matches(&ix, &h, now), BTreeMap::from([(0, 1)]));
    assert_eq!(ix.blocks_for(W0), 2);
    ix.clear_worker(W0);
    assert_eq!(ix.total_entries(), 0);
    assert_eq!(ix.distinct_blocks(), 0);
    assert_eq!(ix.mode(W0), Some(IndexMode::Exact));
}

#[test]
fn errors_apply_nothing() {
    let mut ix = KvIndex::new();
    let t = toks(32, 1);
    assert_eq!(
        ix.apply_stored(W0, Some(7), &[1, 2], &t, 16, BASE_SEED),
        Err(IndexError::UnknownParent {
            worker: W0,
            parent: 7
        })
    );
    assert!(matches!(
        ix.apply_stored(W0, None, &[1, 2], &t[..31], 16, BASE_SEED),
        Err(IndexError::TokenCount { tokens: 31, .. })
    ));
    assert_eq!(
        ix.apply_stored(W0, None, &[1], &t, 0, BASE_SEED),
        Err(IndexError::ZeroBlockSize)
    );
    assert_eq!(ix.total_entries(), 0);
    ix.set_mode(W1, IndexMode::Approximate(ApproxConfig::default()));
    assert_eq!(
        ix.apply_stored(W1, None, &[1, 2], &t, 16, BASE_SEED),
        Err(IndexError::NotExact { worker: W1 })
    );
    assert!(IndexError::ZeroBlockSize.to_string().contains("block size"));
}

#[test]
fn two_workers_runs_and_early_stop() {
    let mut ix = KvIndex::new();
    let t = toks(64, 1);
    let h = block_hashes(&t, 16, BASE_SEED);
    ix.apply_stored(W0, None, &[1, 2, 3, 4], &t, 16, BASE_SEED)
        .unwrap();
    ix.apply_stored(W1, None, &[1, 2], &t[..32], 16, BASE_SEED)
        .unwrap();
    let now = Instant::now();
    assert_eq!(matches(&ix, &h, now), BTreeMap::from([(0, 4), (1, 2)]));
    // W1 also holds block 3 but not block 2: its run stays 2.
    let mut t2 = t.clone();
    t2.truncate(64);
    ix.apply_stored(W1, None, &[1, 2, 3, 4], &t, 16, BASE_SEED)
        .unwrap();
    ix.apply_removed(W1, &[3]);
    assert_eq!(matches(&ix, &h, now), BTreeMap::from([(0, 4), (1, 2)]));
    // A different first block matches nobody.
    let other = block_hashes(&toks(64, 1000), 16, BASE_SEED);
    assert!(matches(&ix, &other, now).is_empty());
    ix.remove_worker(W0);
    assert_eq!(ix.mode(W0), None);
    assert_eq!(matches(&ix, &h, now), BTreeMap::from([(1, 2)]));
}

/// The query's fast path (block `i + 1` looked for in the slot after block `i`'s) must not trust a
/// freed slot that still carries the wanted hash while the hash now lives in another slot.
#[test]
fn stale_adjacent_slot_is_not_a_hit() {
    let mut ix = KvIndex::new();
    let t0 = Instant::now();
    let a = toks(64, 1);
    let ha = block_hashes(&a, 16, BASE_SEED);
    let c = toks(64, 500);
    ix.apply_stored(W0, None, &[1, 2, 3, 4], &a, 16, BASE_SEED)
        .unwrap();
    ix.apply_stored(W1, None, &[11, 12, 13, 14], &c, 16, BASE_SEED)
        .unwrap();
    // Free a2's slot (it keeps its stale hash) and one of W1's, then bring a2 back: it lands in
    // W1's freed slot, not in the one right after a1.
    ix.apply_removed(W0, &[3]);
    ix.apply_removed(W1, &[12]);
    ix.record_routed(WorkerId(2), &ha[2..3], t0);
    ix.apply_stored(W0, Some(2), &[3], &a[32..48], 16, BASE_SEED)
        .unwrap();
    let a1 = ix.blocks.find(ha[1]).unwrap();
    let a2 = ix.blocks.find(ha[2]).unwrap();
    assert_ne!(a2, a1 + 1, "precondition: a2 no longer right after a1");
    assert_eq!(ix.blocks.next(a1, ha[2]), None);
    assert_eq!(matches(&ix, &ha, t0), BTreeMap::from([(0, 4)]));
}

#[test]
fn approximate_ttl_refresh_and_capacity() {
    let mut ix = KvIndex::new();
    let cfg = ApproxConfig {
        ttl: Duration::from_secs(120),
        capacity_blocks: 4,
    };
    ix.set_mode(W0, IndexMode::Approximate(cfg));
    let t0 = Instant::now();
    let a = block_hashes(&toks(48, 1), 16, BASE_SEED);
    let b = block_hashes(&toks(48, 500), 16, BASE_SEED);
    assert_eq!(ix.record_routed(W0, &a, t0), 3);
    assert_eq!(
        matches(&ix, &a, t0 + Duration::from_secs(119)),
        BTreeMap::from([(0, 3)])
    );
    // Expired at exactly ttl even before expire() runs.
    assert!(matches(&ix, &a, t0 + Duration::from_secs(120)).is_empty());
    // Refresh a's first block at t=100: it lives until 220, the rest until 120.
    assert_eq!(
        ix.record_routed(W0, &a[..1], t0 + Duration::from_secs(100)),
        0
    );
    assert_eq!(ix.expire(t0 + Duration::from_secs(150)), 2);
    assert_eq!(ix.router_hashes(W0), vec![a[0]]);
    // Capacity 4: routing b (3 new) evicts nothing; one more evicts the least recently used (a[0]).
    let t1 = t0 + Duration::from_secs(160);
    assert_eq!(ix.record_routed(W0, &b, t1), 3);
    assert_eq!(ix.blocks_for(W0), 4);
    let c = block_hashes(&toks(16, 9000), 16, BASE_SEED);
    assert_eq!(ix.record_routed(W0, &c, t1), 1);
    assert_eq!(ix.blocks_for(W0), 4);
    assert!(!ix.contains(W0, a[0]));
    ix.set_capacity(W0, 1);
    assert_eq!(ix.router_hashes(W0), vec![c[0]]);
    assert_eq!(ix.total_entries(), 1);
    // Exact workers ignore routed records.
    assert_eq!(ix.record_routed(W1, &a, t1), 3); // unknown → approximate
    ix.set_mode(W1, IndexMode::Exact);
    assert_eq!(ix.blocks_for(W1), 0);
    assert_eq!(ix.record_routed(W1, &a, t1), 0);
}

#[test]
fn memory_estimate_is_plausible() {
    let mut ix = KvIndex::new();
    let t = toks(16 * 1000, 0);
    let engine: Vec<u64> = (0..1000).collect();
    ix.apply_stored(W0, None, &engine, &t, 16, BASE_SEED)
        .unwrap();
    let per_entry = ix.heap_bytes() as f64 / ix.total_entries() as f64;
    assert!((40.0..160.0).contains(&per_entry), "{per_entry}");
}

// ---------- property test: exact index == naive model ----------

/// Four token sequences sharing prefixes (block size 2): seq k = common[..2k blocks] + own tail.
fn universe() -> Vec<Vec<u32>> {
    let common: Vec<u32> = (1..=12).collect();
    (0..4u32)
        .map(|k| {
            let mut t = common[..(2 * k as usize) * 2].to_vec();
            t.extend((0..12 - t.len() as u32).map(|i| 100 * (k + 1) + i));
            t
        })
        .collect()
}

/// Opaque engine hash: depends on the sequence index too, so shared prefixes get several engine
/// hashes for one router hash on the same worker (exercises the extra-reference path).
fn engine(seq: usize, block: usize, alias: bool) -> u64 {
    if alias {
        (seq * 100 + block) as u64
    } else {
        block as u64 + 1_000 * (seq as u64 / 4)
    }
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        w: u32,
        seq: usize,
        start: usize,
        len: usize,
        alias: bool,
    },
    Remove {
        w: u32,
        seq: usize,
        blocks: Vec<usize>,
        alias: bool,
    },
    Clear {
        w: u32,
    },
    RemoveWorker {
        w: u32,
    },
}

fn op(workers: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..workers, 0..4usize, 0..6usize, 1..7usize, any::<bool>())
            .prop_map(|(w, seq, start, len, alias)| Op::Store { w, seq, start, len, alias }),
        3 => (0..workers, 0..4usize, prop::collection::vec(0..6usize, 1..4), any::<bool>())
            .prop_map(|(w, seq, blocks, alias)| Op::Remove { w, seq, blocks, alias }),
        1 => (0..workers).prop_map(|w| Op::Clear { w }),
        1 => (0..workers).prop_map(|w| Op::RemoveWorker { w }),
    ]
}

#[derive(Default)]
struct Model {
    workers: HashMap<u32, BTreeMap<u64, u64>>, // engine → router
}

/// Applies `ops` (worker `w` of an op is `ids[w]`) to the index and the model, comparing everything
/// observable after each.
fn check_exact_model(ops: Vec<Op>, ids: &[u32]) -> Result<(), TestCaseError> {
    const BS: usize = 2;
    let u = universe();
    let hashes: Vec<Vec<u64>> = u.iter().map(|t| block_hashes(t, BS, BASE_SEED)).collect();
    let mut ix = KvIndex::new();
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Store {
                w,
                seq,
                start,
                len,
                alias,
            } => {
                let end = (start + len).min(6);
                if start >= end {
                    continue;
                }
                let parent = (start > 0).then(|| engine(seq, start - 1, alias));
                let eng: Vec<u64> = (start..end).map(|b| engine(seq, b, alias)).collect();
                let got = ix.apply_stored(
                    WorkerId(ids[w as usize]),
                    parent,
                    &eng,
                    &u[seq][start * BS..end * BS],
                    BS,
                    BASE_SEED,
                );
                let mw = m.workers.entry(w).or_default();
                match parent {
                    Some(p) if !mw.contains_key(&p) => {
                        prop_assert_eq!(
                            got,
                            Err(IndexError::UnknownParent {
                                worker: WorkerId(ids[w as usize]),
                                parent: p
                            })
                        );
                    }
                    _ => {
                        prop_assert!(got.is_ok());
                        // The engine's parent is trusted: chain from whatever it maps to.
                        let mut parent_r = parent.map(|p| mw[&p]);
                        for (b, e) in (start..end).zip(eng) {
                            let r = crate::hash::next_hash(
                                parent_r,
                                &u[seq][b * BS..(b + 1) * BS],
                                BASE_SEED,
                            );
                            // With a faithful parent the chain is the sequence's own hash.
                            let faithful = b == start
                                && (start == 0 || parent_r == Some(hashes[seq][start - 1]));
                            if faithful {
                                prop_assert_eq!(r, hashes[seq][b]);
                            }
                            mw.insert(e, r);
                            parent_r = Some(r);
                        }
                    }
                }
            }
            Op::Remove {
                w,
                seq,
                blocks,
                alias,
            } => {
                let eng: Vec<u64> = blocks.iter().map(|&b| engine(seq, b, alias)).collect();
                ix.apply_removed(WorkerId(ids[w as usize]), &eng);
                if let Some(mw) = m.workers.get_mut(&w) {
                    for e in eng {
                        mw.remove(&e);
                    }
                }
            }
            Op::Clear { w } => {
                ix.clear_worker(WorkerId(ids[w as usize]));
                if let Some(mw) = m.workers.get_mut(&w) {
                    mw.clear();
                }
            }
            Op::RemoveWorker { w } => {
                ix.remove_worker(WorkerId(ids[w as usize]));
                m.workers.remove(&w);
            }
        }
        // Compare everything observable.
        let mut total = 0;
        for w in 0..ids.len() as u32 {
            let mw = m.workers.get(&w).cloned().unwrap_or_default();
            let routers: BTreeSet<u64> = mw.values().copied().collect();
            total += routers.len();
            prop_assert_eq!(
                ix.engine_hashes(WorkerId(ids[w as usize])),
                mw.keys().copied().collect::<Vec<_>>()
            );
            prop_assert_eq!(
                ix.router_hashes(WorkerId(ids[w as usize])),
                routers.iter().copied().collect::<Vec<_>>()
            );
            prop_assert_eq!(ix.blocks_for(WorkerId(ids[w as usize])), routers.len());
        }
        prop_assert_eq!(ix.total_entries(), total);
        let now = Instant::now();
        for hs in &hashes {
            let mut want = BTreeMap::new();
            for (w, mw) in &m.workers {
                let set: BTreeSet<u64> = mw.values().copied().collect();
                let run = hs.iter().take_while(|h| set.contains(h)).count() as u32;
                if run > 0 {
                    want.insert(ids[*w as usize], run);
                }
            }
            prop_assert_eq!(matches(&ix, hs, now), want);
        }
    }
    Ok(())
}

/// Ids across several bitset words, so blocks held by four or more of them are bitsets (shared
/// between chained blocks with the same holders, copied on write when one changes).
const WIDE: [u32; 10] = [0, 5, 63, 64, 65, 127, 130, 200, 300, 4095];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn exact_index_equals_naive_model(ops in prop::collection::vec(op(3), 1..60)) {
        check_exact_model(ops, &[0, 1, 2])?;
    }

    /// The same with ten workers over several words: wide holder sets, shared bitsets.
    #[test]
    fn exact_index_equals_naive_model_wide(ops in prop::collection::vec(op(WIDE.len() as u32), 1..120)) {
        check_exact_model(ops, &WIDE)?;
    }

    #[test]
    fn approximate_index_equals_lru_ttl_model(
        ops in prop::collection::vec((0..2u32, 0..4usize, 1..7usize, 0..80u64, any::<bool>()), 1..60),
        cap in 1..8usize,
    ) {
        const BS: usize = 2;
        let ttl = Duration::from_secs(100);
        let u = universe();
        let hashes: Vec<Vec<u64>> = u.iter().map(|t| block_hashes(t, BS, BASE_SEED)).collect();
        let mut ix = KvIndex::new();
        for w in 0..2 {
            ix.set_mode(WorkerId(w), IndexMode::Approximate(ApproxConfig { ttl, capacity_blocks: cap }));
        }
        // Model: per worker, LRU order (front = oldest) of (hash, last use secs).
        let mut lru: Vec<Vec<(u64, u64)>> = vec![Vec::new(); 2];
        let t0 = Instant::now();
        let mut now = 0u64;
        for (w, seq, n, dt, only_expire) in ops {
            now += dt;
            let at = t0 + Duration::from_secs(now);
            let l = &mut lru[w as usize];
            if only_expire {
                ix.expire(at);
                for l in lru.iter_mut() { l.retain(|&(_, t)| t + 100 > now); }
            } else {
                ix.record_routed(WorkerId(w), &hashes[seq][..n], at);
                l.retain(|&(_, t)| t + 100 > now);
                for &h in &hashes[seq][..n] {
                    // Used again within TTL/64 (1.5625 s here) of its recorded use: not refreshed.
                    if l.iter().any(|&(x, t)| x == h && (now - t) * REFRESH_DIVISOR < 100) {
                        continue;
                    }
                    l.retain(|&(x, _)| x != h);
                    l.push((h, now));
                }
                while l.len() > cap { l.remove(0); }
            }
            for w in 0..2u32 {
                let want: BTreeSet<u64> = lru[w as usize].iter().map(|&(h, _)| h).collect();
                // Entries past TTL may linger until expire(), but never count in matches.
                let have: BTreeSet<u64> = ix.router_hashes(WorkerId(w)).into_iter().collect();
                prop_assert!(want.is_subset(&have));
                prop_assert!(have.len() <= cap);
            }
            for hs in &hashes {
                let mut want = BTreeMap::new();
                for (w, l) in lru.iter().enumerate() {
                    let set: BTreeSet<u64> = l.iter().filter(|&&(_, t)| t + 100 > now).map(|&(h, _)| h).collect();
                    let run = hs.iter().take_while(|h| set.contains(h)).count() as u32;
                    if run > 0 { want.insert(w as u32, run); }
                }
                prop_assert_eq!(matches(&ix, hs, at), want);
            }
        }
    }
}

/// A prefix the same wide set of workers holds is one shared bitset for all its blocks; removing
/// a middle block from one worker copies that block's set only, and the walk still sees the gap.
#[test]
fn chained_blocks_with_the_same_holders_share_one_bitset() {
    const BS: usize = 2;
    let t = toks(16, 1);
    let h = block_hashes(&t, BS, BASE_SEED);
    let mut ix = KvIndex::new();
    let ids = [3u32, 70, 140, 700, 2000];
    let engine: Vec<u64> = (0..8).collect();
    for &w in &ids {
        ix.apply_stored(WorkerId(w), None, &engine[..4], &t[..8], BS, BASE_SEED)
            .unwrap();
        ix.apply_stored(WorkerId(w), Some(3), &engine[4..], &t[8..], BS, BASE_SEED)
            .unwrap();
    }
    let bits: Vec<usize> = h
        .iter()
        .map(|&x| ix.blocks.get(x).unwrap().same_bits())
        .collect();
    assert!(
        bits[0] != 0 && bits.iter().all(|&b| b == bits[0]),
        "{bits:?}"
    );
    let now = Instant::now();
    let all: BTreeMap<u32, u32> = ids.iter().map(|&w| (w, 8)).collect();
    assert_eq!(matches(&ix, &h, now), all);
    ix.apply_removed(WorkerId(700), &[5]);
    let bits: Vec<usize> = h
        .iter()
        .map(|&x| ix.blocks.get(x).unwrap().same_bits())
        .collect();
    assert!(
        bits[5] != bits[0] && bits[4] == bits[0] && bits[6] == bits[0],
        "{bits:?}"
    );
    let mut want = all.clone();
    want.insert(700, 5);
    assert_eq!(matches(&ix, &h, now), want);
}
