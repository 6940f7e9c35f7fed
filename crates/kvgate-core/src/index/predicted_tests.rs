//! Predicted insertion on exact workers: unit cases and a property test against a naive model
//! (confirmed blocks from events ∪ predictions younger than the TTL).

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

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn prediction_counts_until_ttl_and_events_confirm_it() {
    let mut ix = KvIndex::new();
    assert_eq!(ix.predicted_ttl(), DEFAULT_PREDICTED_TTL);
    ix.set_predicted_ttl(secs(5));
    ix.set_mode(W0, IndexMode::Exact);
    let t = toks(48, 1);
    let h = block_hashes(&t, 16, BASE_SEED);
    let t0 = Instant::now();
    assert_eq!(ix.record_predicted(W0, &h, t0), 3);
    assert_eq!(matches(&ix, &h, t0 + secs(4)), BTreeMap::from([(0, 3)]));
    assert_eq!((ix.total_entries(), ix.predicted_entries()), (3, 3));
    assert_eq!((ix.blocks_for(W0), ix.predicted_blocks_for(W0)), (0, 3));
    assert!(
        ix.router_hashes(W0).is_empty(),
        "accessor lists confirmed blocks only"
    );
    // The worker publishes the first two blocks: they are confirmed (counted once, no TTL).
    assert_eq!(
        ix.apply_stored(W0, None, &[70, 71], &t[..32], 16, BASE_SEED),
        Ok(2)
    );
    assert_eq!((ix.total_entries(), ix.predicted_entries()), (3, 1));
    assert_eq!(ix.blocks_for(W0), 2);
    // At the TTL only the unconfirmed third block stops counting, before and after expire().
    assert_eq!(matches(&ix, &h, t0 + secs(5)), BTreeMap::from([(0, 2)]));
    assert_eq!(ix.expire(t0 + secs(5)), 1);
    assert_eq!((ix.total_entries(), ix.predicted_entries()), (2, 0));
    assert_eq!(matches(&ix, &h, t0 + secs(60)), BTreeMap::from([(0, 2)]));
    // Predicting confirmed blocks again adds nothing; a later BlockRemoved still removes them.
    assert_eq!(ix.record_predicted(W0, &h[..2], t0 + secs(61)), 0);
    assert_eq!(ix.apply_removed(W0, &[70]), 1);
    assert!(matches(&ix, &h, t0 + secs(61)).is_empty());
    assert_eq!(ix.total_entries(), 1);
}

#[test]
fn refresh_clear_remove_and_off() {
    let mut ix = KvIndex::new();
    ix.set_predicted_ttl(secs(5));
    ix.set_mode(W0, IndexMode::Exact);
    ix.set_mode(W1, IndexMode::Approximate(ApproxConfig::default()));
    let h = block_hashes(&toks(32, 1), 16, BASE_SEED);
    let t0 = Instant::now();
    // Approximate and unknown workers take no predictions.
    assert_eq!(ix.record_predicted(W1, &h, t0), 0);
    assert_eq!(ix.record_predicted(WorkerId(9), &h, t0), 0);
    assert_eq!(ix.mode(WorkerId(9)), None);
    assert_eq!(ix.record_predicted(W0, &h, t0), 2);
    // Predicting again refreshes the deadline.
    assert_eq!(ix.record_predicted(W0, &h[..1], t0 + secs(4)), 0);
    assert_eq!(matches(&ix, &h, t0 + secs(6)), BTreeMap::from([(0, 1)]));
    ix.clear_worker(W0);
    assert_eq!((ix.total_entries(), ix.predicted_entries()), (0, 0));
    assert!(matches(&ix, &h, t0 + secs(6)).is_empty());
    ix.record_predicted(W0, &h, t0 + secs(7));
    ix.remove_worker(W0);
    assert_eq!((ix.total_entries(), ix.distinct_blocks()), (0, 0));
    // TTL 0 = off: nothing recorded, and lowering the TTL applies to existing predictions.
    ix.set_mode(W0, IndexMode::Exact);
    ix.record_predicted(W0, &h, t0 + secs(8));
    ix.set_predicted_ttl(Duration::ZERO);
    assert!(matches(&ix, &h, t0 + secs(8)).is_empty());
    assert_eq!(ix.record_predicted(W0, &h, t0 + secs(8)), 0);
    assert_eq!(ix.expire(t0 + secs(8)), 2);
    assert_eq!(ix.total_entries(), 0);
}

// ---------- property test: exact index with predictions == naive model ----------

#[derive(Debug, Clone)]
enum Op {
    /// `BlockStored` of blocks `start..start+len` of sequence `seq` (engine hash = block index +
    /// 10 × seq, so shared prefixes of different sequences alias on purpose).
    Store {
        w: u32,
        seq: usize,
        start: usize,
        len: usize,
    },
    Remove {
        w: u32,
        seq: usize,
        blocks: Vec<usize>,
    },
    Predict {
        w: u32,
        seq: usize,
        start: usize,
        len: usize,
    },
    Clear {
        w: u32,
    },
    RemoveWorker {
        w: u32,
    },
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3u32, 0..3usize, 0..4usize, 1..4usize)
            .prop_map(|(w, seq, start, len)| Op::Store { w, seq, start, len }),
        2 => (0..3u32, 0..3usize, prop::collection::vec(0..4usize, 1..3))
            .prop_map(|(w, seq, blocks)| Op::Remove { w, seq, blocks }),
        5 => (0..3u32, 0..3usize, 0..4usize, 1..5usize)
            .prop_map(|(w, seq, start, len)| Op::Predict { w, seq, start, len }),
        1 => (0..3u32).prop_map(|w| Op::Clear { w }),
        1 => (0..3u32).prop_map(|w| Op::RemoveWorker { w }),
        1 => Just(Op::Expire),
    ]
}

/// Three sequences of 4 blocks (block size 2) sharing their first 0, 1 and 2 blocks.
fn universe() -> Vec<Vec<u32>> {
    (0..3u32)
        .map(|k| {
            let mut t: Vec<u32> = (1..=2 * k).collect();
            t.extend((0..8 - 2 * k).map(|i| 100 * (k + 1) + i));
            t
        })
        .collect()
}

#[derive(Default, Debug)]
struct ModelWorker {
    confirmed: BTreeMap<u64, u64>, // engine → router
    predicted: BTreeMap<u64, u64>, // router → last predicted (s)
}

const TTL: u64 = 3;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn predicted_index_equals_naive_model(
        ops in prop::collection::vec((op(), 0..3u64), 1..60),
    ) {
        const BS: usize = 2;
        let u = universe();
        let hashes: Vec<Vec<u64>> = u.iter().map(|t| block_hashes(t, BS, BASE_SEED)).collect();
        let mut ix = KvIndex::new();
        ix.set_predicted_ttl(secs(TTL));
        let mut m: HashMap<u32, ModelWorker> = HashMap::new();
        let t0 = Instant::now();
        let mut now = 0u64;
        for (op, dt) in ops {
            now += dt;
            let at = t0 + secs(now);
            let live = |p: &BTreeMap<u64, u64>| -> BTreeSet<u64> {
                p.iter().filter(|&(_, &t)| t + TTL > now).map(|(&h, _)| h).collect()
            };
            let mut expired_dropped = false;
            match op {
                Op::Store { w, seq, start, len } => {
                    let end = (start + len).min(4);
                    let parent = (start > 0).then(|| (start - 1 + 10 * seq) as u64);
                    let eng: Vec<u64> = (start..end).map(|b| (b + 10 * seq) as u64).collect();
                    let got = ix.apply_stored(
                        WorkerId(w), parent, &eng, &u[seq][start * BS..end * BS], BS, BASE_SEED,
                    );
                    let mw = m.entry(w).or_default();
                    match parent {
                        Some(p) if !mw.confirmed.contains_key(&p) => prop_assert!(got.is_err()),
                        _ => {
                            prop_assert!(got.is_ok());
                            let mut parent_r = parent.map(|p| mw.confirmed[&p]);
                            for (b, e) in (start..end).zip(eng) {
                                let r = crate::hash::next_hash(
                                    parent_r, &u[seq][b * BS..(b + 1) * BS], BASE_SEED,
                                );
                                mw.confirmed.insert(e, r);
                                mw.predicted.remove(&r);
                                parent_r = Some(r);
                            }
                        }
                    }
                }
                Op::Remove { w, seq, blocks } => {
                    let eng: Vec<u64> = blocks.iter().map(|&b| (b + 10 * seq) as u64).collect();
                    ix.apply_removed(WorkerId(w), &eng);
                    if let Some(mw) = m.get_mut(&w) {
                        for e in eng {
                            mw.confirmed.remove(&e);
                        }
                    }
                }
                Op::Predict { w, seq, start, len } => {
                    let end = (start + len).min(4);
                    ix.record_predicted(WorkerId(w), &hashes[seq][start..end], at);
                    if let Some(mw) = m.get_mut(&w) {
                        let held: BTreeSet<u64> = mw.confirmed.values().copied().collect();
                        for &h in &hashes[seq][start..end] {
                            if !held.contains(&h) {
                                mw.predicted.insert(h, now);
                            }
                        }
                    }
                }
                Op::Clear { w } => {
                    ix.clear_worker(WorkerId(w));
                    if let Some(mw) = m.get_mut(&w) {
                        *mw = ModelWorker::default();
                    }
                }
                Op::RemoveWorker { w } => {
                    ix.remove_worker(WorkerId(w));
                    m.remove(&w);
                }
                Op::Expire => {
                    ix.expire(at);
                    for mw in m.values_mut() {
                        mw.predicted.retain(|_, &mut t| t + TTL > now);
                    }
                    expired_dropped = true;
                }
            }
            let mut total = 0;
            let mut predicted = 0;
            for w in 0..3u32 {
                let wid = WorkerId(w);
                let (conf, pred) = m
                    .get(&w)
                    .map(|mw| (mw.confirmed.values().copied().collect::<BTreeSet<u64>>(), mw.predicted.clone()))
                    .unwrap_or_default();
                prop_assert_eq!(ix.router_hashes(wid), conf.iter().copied().collect::<Vec<_>>());
                prop_assert_eq!(ix.blocks_for(wid), conf.len());
                let p = ix.predicted_blocks_for(wid);
                prop_assert!(p >= live(&pred).len() && p <= pred.len(), "{} vs {:?}", p, pred);
                if expired_dropped {
                    prop_assert_eq!(p, pred.len());
                }
                total += conf.len() + p;
                predicted += p;
            }
            prop_assert_eq!(ix.total_entries(), total);
            prop_assert_eq!(ix.predicted_entries(), predicted);
            for hs in &hashes {
                let mut want = BTreeMap::new();
                for (w, mw) in &m {
                    let mut held: BTreeSet<u64> = mw.confirmed.values().copied().collect();
                    held.extend(live(&mw.predicted));
                    let run = hs.iter().take_while(|h| held.contains(h)).count() as u32;
                    if run > 0 {
                        want.insert(*w, run);
                    }
                }
                prop_assert_eq!(matches(&ix, hs, at), want);
            }
        }
    }
}
