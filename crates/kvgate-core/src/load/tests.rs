use super::*;
use crate::hash::{block_hashes, BASE_SEED};
use proptest::prelude::*;
use std::collections::HashSet;

const W0: WorkerId = WorkerId(0);

fn seq(len_blocks: u32, tail: u32) -> Vec<u64> {
    // Shared 2-block prefix, then a distinct tail.
    let mut t: Vec<u32> = (0..32).collect();
    t.extend((0..(len_blocks.saturating_sub(2)) * 16).map(|i| 1000 * (tail + 1) + i));
    let mut h = block_hashes(&t, 16, BASE_SEED);
    h.truncate(len_blocks as usize);
    h
}

#[test]
fn shared_prefix_counted_once_and_freed_by_drop() {
    let a = ActiveSequences::new();
    let s1 = seq(4, 1);
    let s2 = seq(3, 2);
    let g1 = a.add(W0, 1, &s1, 64, 16);
    let g2 = a.add(W0, 2, &s2, 48, 0);
    assert_eq!(
        a.snapshot(W0),
        WorkerLoad {
            active_blocks: 4 + 1,
            pending_prefill_tokens: 48 + 48,
            inflight: 2
        }
    );
    g1.mark_prefill_done();
    g1.mark_prefill_done(); // idempotent
    assert_eq!(a.snapshot(W0).pending_prefill_tokens, 48);
    assert_eq!(a.new_blocks_for(W0, &s1), 0);
    assert_eq!(a.new_blocks_for(W0, &seq(6, 1)), 2);
    assert_eq!(a.new_blocks_for(W0, &seq(5, 9)), 3);
    assert_eq!(a.new_blocks_for(WorkerId(5), &s1), 4);
    drop(g1);
    assert_eq!(
        a.snapshot(W0),
        WorkerLoad {
            active_blocks: 3,
            pending_prefill_tokens: 48,
            inflight: 1
        }
    );
    assert_eq!(g2.worker(), W0);
    assert_eq!(g2.request_id(), 2);
    g2.free();
    assert_eq!(a.snapshot(W0), WorkerLoad::default());
}

#[test]
fn cached_beyond_isl_saturates() {
    let a = ActiveSequences::new();
    let _g = a.add(W0, 1, &[], 10, 50);
    assert_eq!(a.snapshot(W0).pending_prefill_tokens, 0);
}

#[test]
fn expiry_and_removal_make_guards_inert() {
    let a = ActiveSequences::new();
    let t0 = Instant::now();
    let old = a.add_at(W0, 7, &seq(2, 0), 32, 0, t0);
    let young = a.add_at(W0, 8, &seq(3, 1), 48, 0, t0 + Duration::from_secs(3000));
    let gone = a.expire_stale(t0 + Duration::from_secs(3601), Duration::from_secs(3600));
    assert_eq!(gone, vec![7]);
    assert_eq!(a.snapshot(W0).inflight, 1);
    drop(old); // must not free the young request's shared blocks
    assert_eq!(a.snapshot(W0).active_blocks, 3);
    a.remove_worker(W0);
    young.mark_prefill_done();
    drop(young);
    assert_eq!(a.snapshot(W0), WorkerLoad::default());
    assert!(a.all().is_empty());
}

#[test]
fn fill_loads_matches_snapshot() {
    let a = ActiveSequences::new();
    let _g = a.add(WorkerId(1), 1, &seq(4, 0), 64, 0);
    let mut c = [
        crate::Candidate::new(W0),
        crate::Candidate::new(WorkerId(1)),
    ];
    let req = seq(6, 0);
    a.fill_loads(&req, &mut c);
    assert_eq!(
        (c[0].active_blocks, c[0].new_blocks, c[0].inflight),
        (0, 6, 0)
    );
    assert_eq!(
        (c[1].active_blocks, c[1].new_blocks, c[1].inflight),
        (4, 2, 1)
    );
    assert_eq!(c[1].pending_prefill_tokens, 64);
}

#[test]
fn guards_are_shareable_across_threads() {
    let a = ActiveSequences::new();
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let g = a.add(
                        WorkerId((i % 3) as u32),
                        t * 1000 + i,
                        &seq(4, i as u32 % 5),
                        64,
                        0,
                    );
                    if i % 2 == 0 {
                        g.mark_prefill_done();
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    for w in 0..3 {
        assert_eq!(a.snapshot(WorkerId(w)), WorkerLoad::default());
    }
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        w: u32,
        len: u32,
        tail: u32,
        isl: u64,
        cached: u64,
    },
    Prefill(usize),
    Drop(usize),
    Expire(u64),
    RemoveWorker(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4u32, 0..6u32, 0..4u32, 0..200u64, 0..100u64)
            .prop_map(|(w, len, tail, isl, cached)| Op::Add { w, len, tail, isl, cached }),
        2 => any::<usize>().prop_map(Op::Prefill),
        3 => any::<usize>().prop_map(Op::Drop),
        1 => (0..50u64).prop_map(Op::Expire),
        1 => (0..4u32).prop_map(Op::RemoveWorker),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]
    #[test]
    fn load_matches_model_and_returns_to_zero(ops in prop::collection::vec(op(), 0..80)) {
        // Hashing is unoptimised in test builds: compute every sequence once.
        let table: Vec<Vec<Vec<u64>>> = (0..6).map(|len| (0..4).map(|tail| seq(len, tail)).collect()).collect();
        // Worker ids beyond 63 exercise the inverse map's multi-word sets.
        let ids = [0u32, 1, 2, 70];
        let probes = [seq(6, 1), seq(3, 0), seq(5, 3), seq(1, 2), Vec::new()];
        let a = ActiveSequences::new();
        let t0 = Instant::now();
        let mut clock = 0u64;
        // Model: live requests (guard, worker, hashes, pending prefill, start, alive).
        struct Live { g: LoadGuard, w: u32, h: Vec<u64>, pending: u64, start: u64, alive: bool }
        let mut live: Vec<Live> = Vec::new();
        for op in ops {
            clock += 1;
            match op {
                Op::Add { w, len, tail, isl, cached } => {
                    let h = table[len as usize][tail as usize].clone();
                    let w = ids[w as usize];
                    let g = a.add_at(WorkerId(w), clock, &h, isl, cached, t0 + Duration::from_secs(clock));
                    live.push(Live { g, w, h, pending: isl.saturating_sub(cached), start: clock, alive: true });
                }
                Op::Prefill(i) if !live.is_empty() => {
                    let k = i % live.len();
                    let l = &mut live[k];
                    l.g.mark_prefill_done();
                    l.pending = 0;
                }
                Op::Drop(i) if !live.is_empty() => { live.swap_remove(i % live.len()); }
                Op::Expire(age) => {
                    let mut got = a.expire_stale(t0 + Duration::from_secs(clock), Duration::from_secs(age));
                    let mut want: Vec<u64> = live.iter()
                        .filter(|l| l.alive && clock - l.start > age).map(|l| l.start).collect();
                    for l in live.iter_mut() { if clock - l.start > age { l.alive = false; } }
                    got.sort();
                    want.sort();
                    prop_assert_eq!(got, want);
                }
                Op::RemoveWorker(w) => {
                    let w = ids[w as usize];
                    a.remove_worker(WorkerId(w));
                    for l in live.iter_mut() { if l.w == w { l.alive = false; } }
                }
                _ => {}
            }
            prop_assert_eq!(a.inverse(), a.inverse_naive());
            let mut cands: Vec<Candidate> = ids.iter().chain(&[5u32, 200]).map(|&w| Candidate::new(WorkerId(w))).collect();
            for w in ids {
                let mine: Vec<&Live> = live.iter().filter(|l| l.alive && l.w == w).collect();
                let blocks: HashSet<u64> = mine.iter().flat_map(|l| l.h.iter().copied()).collect();
                prop_assert_eq!(a.snapshot(WorkerId(w)), WorkerLoad {
                    active_blocks: blocks.len() as u32,
                    pending_prefill_tokens: mine.iter().map(|l| l.pending).sum(),
                    inflight: mine.len() as u32,
                });
                for probe in &probes {
                    let want_new = probe.iter().filter(|h| !blocks.contains(h)).count() as u32;
                    prop_assert_eq!(a.new_blocks_for(WorkerId(w), probe), want_new);
                }
            }
            // The one-walk scoring path (inverse map) against the model, unknown workers included.
            for probe in &probes {
                a.fill_loads(probe, &mut cands);
                for c in &cands {
                    let blocks: HashSet<u64> = live.iter().filter(|l| l.alive && l.w == c.worker.0)
                        .flat_map(|l| l.h.iter().copied()).collect();
                    let want_new = probe.iter().filter(|h| !blocks.contains(h)).count() as u32;
                    prop_assert_eq!(c.new_blocks, want_new, "worker {}", c.worker.0);
                    prop_assert_eq!(c.active_blocks, blocks.len() as u32);
                }
            }
        }
        drop(live);
        for w in ids {
            prop_assert_eq!(a.snapshot(WorkerId(w)), WorkerLoad::default());
        }
        prop_assert!(a.inverse().is_empty());
    }
}

/// Many distinct depths over 130 workers (three 64-worker words): the galloping walk must find each
/// worker's own depth, as the per-worker search does.
#[test]
fn fill_loads_one_walk_finds_every_depth() {
    let full = seq(80, 7);
    let a = ActiveSequences::new();
    let mut guards = Vec::new();
    for w in 0..130u32 {
        let d = (w as usize * 37) % 81;
        guards.push(a.add(WorkerId(w), u64::from(w), &full[..d], 0, 0));
        // A second, shorter request on the same prefix must not change the depth.
        guards.push(a.add(WorkerId(w), 1000, &full[..d / 2], 0, 0));
    }
    for probe in [&full[..], &full[..40], &full[..1], &seq(80, 8)[..]] {
        let mut cands: Vec<Candidate> = (0..132).map(|w| Candidate::new(WorkerId(w))).collect();
        a.fill_loads(probe, &mut cands);
        for c in &cands {
            let d = if c.worker.0 < 130 {
                (c.worker.0 as usize * 37) % 81
            } else {
                0
            };
            let shared = if std::ptr::eq(probe.as_ptr(), full.as_ptr()) || probe.len() <= 40 {
                d.min(probe.len())
            } else {
                d.min(2) // seq(80, 8) shares only the 2-block prefix
            };
            assert_eq!(
                c.new_blocks,
                (probe.len() - shared) as u32,
                "worker {}",
                c.worker.0
            );
            assert_eq!(c.new_blocks, a.new_blocks_for(c.worker, probe));
        }
    }
    drop(guards);
    assert!(a.inverse().is_empty());
}

/// Idle entries (count 0, empty worker sets) are kept for the next request that needs them but
/// swept once they outnumber live ones: memory stays bounded over many distinct prompts, and
/// loads, depths and the inverse map stay exact across sweeps.
#[test]
fn idle_entries_are_swept_and_loads_stay_exact() {
    let a = ActiveSequences::new();
    let (w0, w1) = (WorkerId(0), WorkerId(1));
    // One long-lived request keeps a prefix active on w1 throughout.
    let pinned = a.add(w1, 0, &seq(8, 0), 0, 0);
    let mut held = std::collections::VecDeque::new();
    for i in 1..3000u32 {
        let w = if i % 3 == 0 { w1 } else { w0 };
        held.push_back(a.add(w, u64::from(i), &seq(6, i), 10, 0));
        if held.len() > 4 {
            drop(held.pop_front());
        }
        let g = a.lock();
        assert!(
            g.active.empty <= SWEEP_MIN + 1,
            "{} idle entries at {i}",
            g.active.empty
        );
        let idle = g.active.entries().filter(|b| b.set.is_empty()).count();
        assert_eq!(idle, g.active.empty);
        // Per-worker counts beyond one exist only where several held requests share a block.
        assert!(g.active.entries().all(|b| b.extra.len() <= 2));
        // Every place holds a mapped block or is vacant, and swept places are reused: the slab
        // stays within the idle bound plus the live blocks (without reuse it would reach ~12,000).
        assert_eq!(
            g.active.blocks.len(),
            g.active.places.len() + g.active.vacant.len()
        );
        assert!(g.active.blocks.len() <= SWEEP_MIN + 1 + 8 + 6 * 5);
        drop(g);
        if i % 500 == 0 {
            assert_eq!(a.inverse(), a.inverse_naive());
            // The pinned prefix is still found on w1 only; the shared 2-block prefix wherever a
            // held request has it.
            let mut cands = vec![Candidate::new(w0), Candidate::new(w1)];
            a.fill_loads(&seq(8, 0), &mut cands);
            assert_eq!(cands[1].new_blocks, 0);
            assert_eq!(cands[1].new_blocks, a.new_blocks_for(w1, &seq(8, 0)));
            assert_eq!(cands[0].new_blocks, a.new_blocks_for(w0, &seq(8, 0)));
        }
    }
    // Six blocks per held request, the first two shared by all; eight pinned, sharing them too.
    let total: u32 = a.all().iter().map(|(_, l)| l.active_blocks).sum();
    let held_on = |w| held.iter().filter(|g| g.worker() == w).count() as u32;
    let expect_w0 = if held_on(w0) > 0 {
        2 + 4 * held_on(w0)
    } else {
        0
    };
    assert_eq!(total, expect_w0 + 8 + 4 * held_on(w1));
    drop(held);
    drop(pinned);
    assert!(a.all().iter().all(|(_, l)| *l == WorkerLoad::default()));
    assert!(a.inverse().is_empty());
}

/// A hot prefix of `blocks` held by `holders` requests on `workers` workers, in a fleet of
/// `fleet.1` known workers carrying `fleet.0` requests.
fn hot(blocks: u32, holders: u32, workers: u32, fleet: (u32, u32)) -> HotPrefix {
    HotPrefix {
        blocks,
        holders,
        workers,
        fleet_requests: fleet.0,
        fleet_workers: fleet.1,
    }
}

/// The hot prefix: the prompt's leading blocks some request in flight holds, anywhere, and how
/// many requests hold the last of them; back to none once they end.
#[test]
fn hot_prefix_is_the_prefix_in_flight_and_its_holders() {
    let a = ActiveSequences::new();
    let probe = seq(10, 1);
    assert_eq!(a.hot_prefix(&probe), HotPrefix::default());
    assert_eq!(a.hot_prefix(&[]), HotPrefix::default());
    // Another session over the same 2-block prefix on worker 0: 2 blocks hot, one holder.
    let g1 = a.add(W0, 1, &seq(6, 2), 96, 0);
    assert_eq!(a.hot_prefix(&probe), hot(2, 1, 1, (1, 1)));
    // The probe's own history (5 blocks) in flight on worker 3; a second request on it on worker 3
    // and one more on the shared prefix elsewhere.
    let g2 = a.add(WorkerId(3), 2, &probe[..5], 80, 0);
    assert_eq!(a.hot_prefix(&probe), hot(5, 1, 1, (2, 2)));
    let g3 = a.add(WorkerId(3), 3, &probe[..5], 80, 0);
    let g4 = a.add(WorkerId(7), 4, &seq(3, 4), 48, 0);
    assert_eq!(a.hot_prefix(&probe), hot(5, 2, 1, (4, 3)));
    assert_eq!(a.hot_prefix(&probe[..2]), hot(2, 4, 3, (4, 3)));
    assert_eq!(a.hot_prefix(&seq(10, 9)), hot(2, 4, 3, (4, 3)));
    // A worker known without requests counts in the fleet; an idle one added twice, once.
    a.add_worker(WorkerId(5));
    a.add_worker(WorkerId(5));
    a.add_worker(W0);
    assert_eq!(a.hot_prefix(&probe), hot(5, 2, 1, (4, 4)));
    drop((g2, g3));
    assert_eq!(a.hot_prefix(&probe), hot(2, 2, 2, (2, 4)));
    drop((g1, g4));
    assert_eq!(a.hot_prefix(&probe), HotPrefix::default());
    // Removing a worker with requests takes them and the worker out of the fleet's figures;
    // their guards free nothing twice.
    let g5 = a.add(WorkerId(7), 5, &probe[..3], 48, 0);
    let g6 = a.add(WorkerId(7), 6, &probe[..3], 48, 0);
    let g7 = a.add(W0, 7, &probe[..2], 32, 0);
    assert_eq!(a.hot_prefix(&probe), hot(3, 2, 1, (3, 4)));
    a.remove_worker(WorkerId(7));
    assert_eq!(a.hot_prefix(&probe), hot(2, 1, 1, (1, 3)));
    drop((g5, g6));
    assert_eq!(a.hot_prefix(&probe), hot(2, 1, 1, (1, 3)));
    // Expired requests leave the fleet's count too.
    let later = Instant::now() + Duration::from_secs(7200);
    assert_eq!(a.expire_stale(later, Duration::from_secs(3600)), vec![7]);
    drop(g7);
    assert_eq!(a.hot_prefix(&probe), HotPrefix::default());
    let g8 = a.add(WorkerId(3), 8, &probe[..1], 16, 0);
    assert_eq!(a.hot_prefix(&probe), hot(1, 1, 1, (1, 3)));
    drop(g8);
}
