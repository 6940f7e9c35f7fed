//! The gateway's bounded `kv` and `latency` selections against its exhaustive scan, over fleet states built
//! through the `Router` API (dispatches, frees, predicted blocks, health, exclusions, limits,
//! scraped load, busy thresholds, a second pool sharing the load order).

use super::*;
use crate::config::{Config, WorkerConfig};
use crate::registry::Registry;
use kvgate_core::{KvCostConfig, ScrapedLoad};
use std::time::Duration;

fn config(workers: usize, other: usize, policy: &str, rng: &mut fastrand::Rng) -> Arc<Config> {
    let mut c = Config::default();
    for i in 0..workers + other {
        let mut w = WorkerConfig::from_url(&format!("http://w{i}:1"));
        w.models = vec![if i < workers { "m" } else { "n" }.to_string()];
        c.workers.push(w);
    }
    // Interleave the two pools' ids in the load order.
    rng.shuffle(&mut c.workers);
    c.routing.policy = policy.into();
    c.routing.temperature = 0.0;
    c.routing.max_inflight_per_worker = if rng.bool() { 0 } else { rng.u32(1..4) };
    c.routing.busy_active_blocks = rng.bool().then(|| rng.u32(0..24));
    c.routing.busy_pending_prefill_tokens = rng.bool().then(|| rng.u64(0..400));
    c.routing.busy_kv_usage = rng.bool().then(|| rng.f32());
    c.routing.prefill_weight = [0.0, 1.0, 2.5][rng.usize(0..3)];
    Arc::new(c)
}

/// `workers` workers serving model `m`, routed by `policy` (the rest as configured by default).
fn one_pool(workers: usize, policy: &str) -> Config {
    let mut c = Config::default();
    for i in 0..workers {
        let mut w = WorkerConfig::from_url(&format!("http://w{i}:1"));
        w.models = vec!["m".to_string()];
        c.workers.push(w);
    }
    c.routing.policy = policy.into();
    c
}

fn router(cfg: &Config, reg: &Registry) -> Router {
    let policy = RoutePolicy::from_config(&cfg.routing, &cfg.slo, &cfg.pd).unwrap();
    let router = Router::new(policy, Arc::new(Admission::new(16, Duration::from_secs(1))));
    for w in &reg.snapshot().workers {
        router.add_worker(w.id, true, w.kind, &cfg.routing);
    }
    router
}

/// A prompt of `len` blocks from one of a few prefix families (shared prefixes, divergent tails).
fn prompt(rng: &mut fastrand::Rng) -> Vec<u64> {
    let family = rng.u64(0..4);
    let shared = rng.usize(0..6);
    let len = shared + rng.usize(1..6);
    (0..len)
        .map(|i| {
            if i < shared {
                family * 1000 + i as u64 + 1
            } else {
                rng.u64(1..u64::MAX)
            }
        })
        .collect()
}

#[test]
fn bounded_selection_matches_the_exhaustive_scan() {
    check_bounded_selection("kv");
}

/// The same for `latency`, with learned speeds (first tokens at random delays) and engine slots.
#[test]
fn bounded_latency_selection_matches_the_exhaustive_scan() {
    check_bounded_selection("latency");
}

/// The same for `kv_time` with the cold rule open (`kv_cold_reuse = 1`: the recent reuse is
/// below 1 from the first prompt not cached whole): cold prompts take the bounded `latency` walk.
#[test]
fn bounded_kv_time_cold_selection_matches_the_exhaustive_scan() {
    check_bounded_selection("kv_time_cold");
}

fn check_bounded_selection(policy: &str) {
    let mut checked = 0;
    let mut unique = 0;
    let (name, cold) = match policy {
        "kv_time_cold" => ("kv_time", true),
        p => (p, false),
    };
    let policy = name;
    for seed in 0..120u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut cfg = config(rng.usize(1..40), rng.usize(0..20), policy, &mut rng);
        if cold {
            let c = Arc::make_mut(&mut cfg);
            c.routing.kv_cold_latency = Some(0.5);
            c.routing.kv_cold_reuse = 1.0;
            // The replication term reads the router's hot prefix, which the tie count below
            // does not rebuild.
            c.routing.kv_replicate = Some(0.0);
        }
        let (reg, _) = Registry::new(cfg.clone()).unwrap();
        let router = router(&cfg, &reg);
        let fleet = reg.snapshot();
        let pools: Vec<Arc<Pool>> = ["m", "n"]
            .iter()
            .filter_map(|m| fleet.pool(m).cloned())
            .collect();
        let now = Instant::now();
        if cold {
            // Open the rule: one prompt cached nowhere takes the recent reuse below 1.
            let fresh: Vec<u64> = (0..4).map(|_| rng.u64(1..u64::MAX)).collect();
            router
                .select(&pools[0], &fresh, 64, None, &[], now)
                .expect("an idle pool picks");
            let rp = router.policy();
            assert!(rp.policy.as_kv().expect("kv_time").recent_reuse() < 1.0);
        }
        let mut guards = Vec::new();
        for _ in 0..rng.usize(0..80) {
            let pool = &pools[rng.usize(0..pools.len())];
            let hashes = prompt(&mut rng);
            let isl = hashes.len() as u64 * 16 - rng.u64(0..16);
            // Build state through the router's own decisions and a few arbitrary placements.
            let pick = if rng.u8(0..4) == 0 {
                let w = pool.workers[rng.usize(0..pool.workers.len())].clone();
                let decision = Decision::for_candidate(
                    &RouteRequest {
                        hashes: &hashes,
                        isl_tokens: isl,
                        block_size: 16,
                        affinity_key: None,
                        hot: Default::default(),
                    },
                    &Candidate::new(w.id),
                    0.0,
                );
                Pick {
                    worker: w,
                    decision,
                    estimate: TtftEstimate::default(),
                    explain: None,
                }
            } else {
                match router.select(pool, &hashes, isl, None, &[], now) {
                    Ok(p) => p,
                    Err(_) => continue,
                }
            };
            let g = router.dispatch(&pick, &hashes, isl, 16, now);
            if (policy == "latency" || cold) && rng.bool() {
                // Learned speeds differ per worker: the floor is the fastest's.
                g.observe_first_token(now + Duration::from_millis(rng.u64(1..2000)));
                router.observe_engine(pick.worker.id, rng.u32(0..6), rng.u32(0..3));
            }
            guards.push(g);
            if rng.u8(0..3) == 0 {
                let g = guards.swap_remove(rng.usize(0..guards.len()));
                if rng.bool() {
                    g.prefill_done();
                    guards.push(g);
                }
            }
        }
        for w in &fleet.workers {
            match rng.u8(0..8) {
                0 => w.state.healthy.store(false, Ordering::Relaxed),
                1 => {
                    *w.state.scraped.lock() = Some((
                        now,
                        ScrapedLoad {
                            kv_usage: rng.f32(),
                            waiting: rng.u32(0..4),
                            running: rng.u32(0..8),
                        },
                    ))
                }
                2 => w
                    .state
                    .kv_capacity_blocks
                    .store(rng.u32(0..64), Ordering::Relaxed),
                _ => {}
            }
        }
        for _ in 0..20 {
            let pool = &pools[0];
            let hashes = prompt(&mut rng);
            let isl = hashes.len() as u64 * 16;
            let exclude: Vec<WorkerId> = (0..rng.usize(0..3))
                .map(|_| pool.workers[rng.usize(0..pool.workers.len())].id)
                .collect();
            let args = (
                pool.as_ref(),
                &hashes[..],
                isl,
                None,
                &exclude[..],
                now,
                Leg::Whole,
            );
            let bounded = router.select_with(
                args.0,
                args.1,
                args.2,
                args.3,
                args.4,
                args.5,
                args.6,
                Bounded::ALL,
                Lane::Any,
                0,
            );
            let exhaustive = router.select_with(
                args.0,
                args.1,
                args.2,
                args.3,
                args.4,
                args.5,
                args.6,
                Bounded::NONE,
                Lane::Any,
                0,
            );
            checked += 1;
            match (&bounded, &exhaustive) {
                (Err(a), Err(b)) => assert_eq!(a, b, "seed {seed}"),
                (Ok(a), Ok(b)) => {
                    let (ca, cb) = (a.decision.cost, b.decision.cost);
                    assert!(
                        (ca - cb).abs() <= 1e-9 * cb.abs().max(1.0),
                        "seed {seed}: bounded cost {ca} ({}) vs exhaustive {cb} ({})",
                        a.worker.name,
                        b.worker.name
                    );
                    // The exhaustive scan's candidates are still in the scratch: is its minimum
                    // unique among the workers the policy could choose?
                    let rp = router.policy();
                    let req = RouteRequest {
                        hashes: &hashes,
                        isl_tokens: isl,
                        block_size: pool.block_size,
                        affinity_key: None,
                        hot: Default::default(),
                    };
                    let tied = SCRATCH.with(|s| {
                        let s = s.borrow();
                        // A cold prompt was placed by the latency cost (the rule is open here).
                        let by_latency = rp
                            .policy
                            .as_kv()
                            .and_then(|kv| kv.placed_by_latency(&req, &s.candidates))
                            .map(|l| *l.config());
                        let cost_of = |req: &RouteRequest, c: &Candidate| match (
                            by_latency,
                            rp.policy.as_kv(),
                        ) {
                            (Some(l), _) => l.cost(req, c).0,
                            (None, Some(kv)) => kv.config().cost(req, c),
                            (None, None) => rp.policy.as_latency().unwrap().config().cost(req, c).0,
                        };
                        s.candidates
                            .iter()
                            .filter(|c| rp.busy.is_off() || !kvgate_core::is_busy(c, &rp.busy))
                            .filter(|c| (cost_of(&req, c) - cb).abs() <= 1e-9 * cb.abs().max(1.0))
                            .count()
                    });
                    assert!(tied >= 1, "seed {seed}");
                    if tied == 1 {
                        unique += 1;
                        assert_eq!(a.worker.id, b.worker.id, "seed {seed}: unique minimum");
                    }
                    assert_eq!(
                        a.decision.overlap_blocks, b.decision.overlap_blocks,
                        "seed {seed}"
                    );
                }
                _ => panic!(
                    "seed {seed}: bounded {:?} vs exhaustive {:?}",
                    bounded.as_ref().map(|p| &p.worker.name).err(),
                    exhaustive.as_ref().map(|p| &p.worker.name).err()
                ),
            }
        }
        drop(guards);
    }
    assert!(checked > 2000 && unique > checked / 4, "{checked} {unique}");
}

#[test]
fn a_reused_worker_id_starts_with_no_load() {
    let mut rng = fastrand::Rng::with_seed(7);
    let mut cfg = (*config(2, 0, "kv", &mut rng)).clone();
    cfg.routing.max_inflight_per_worker = 0;
    cfg.routing.busy_active_blocks = None;
    cfg.routing.busy_pending_prefill_tokens = None;
    cfg.routing.busy_kv_usage = None;
    let cfg = Arc::new(cfg);
    let (reg, _) = Registry::new(cfg.clone()).unwrap();
    let router = router(&cfg, &reg);
    let pool = reg.snapshot().pool("m").unwrap().clone();
    let now = Instant::now();
    let ids: Vec<WorkerId> = pool.workers.iter().map(|w| w.id).collect();
    let loads = |r: &Router| {
        let mut all = r.active().all();
        all.sort_by_key(|(w, _)| *w);
        all
    };
    // Both idle workers are known (once each) before any request.
    assert_eq!(
        loads(&router).iter().map(|(w, _)| *w).collect::<Vec<_>>(),
        ids.iter()
            .copied()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
    );
    let hashes = [1, 2, 3, 4];
    let pick = router.select(&pool, &hashes, 64, None, &[], now).unwrap();
    let busy = pick.worker.id;
    let guard = router.dispatch(&pick, &hashes, 64, 16, now);
    let other = *ids.iter().find(|&&w| w != busy).unwrap();
    // A prompt nobody holds goes to the idle worker.
    let p = router.select(&pool, &[9, 9], 32, None, &[], now).unwrap();
    assert_eq!(p.worker.id, other);
    // The loaded worker leaves; its id comes back (reused) while its old request still runs.
    router.remove_worker(busy);
    assert!(
        loads(&router).iter().all(|(w, _)| *w != busy),
        "removed from the load set"
    );
    router.add_worker(busy, true, pick.worker.kind, &cfg.routing);
    let all = loads(&router);
    assert_eq!(all.iter().filter(|(w, _)| *w == busy).count(), 1);
    let (_, l) = all.iter().find(|(w, _)| *w == busy).unwrap();
    assert_eq!(
        (l.active_blocks, l.inflight, l.pending_prefill_tokens),
        (0, 0, 0)
    );
    // The old request's end does not touch the new worker of that id.
    drop(guard);
    let (_, l) = loads(&router)
        .into_iter()
        .find(|(w, _)| *w == busy)
        .unwrap();
    assert_eq!((l.active_blocks, l.inflight), (0, 0));
    // Load the other worker: the reused id, idle, is now the cheapest for a fresh prompt, also
    // on the bounded path (it must be in the load order again).
    // (A two-worker pool takes the exhaustive scan by default: the bounded path is asked for.)
    let p = router
        .select_with(
            &pool,
            &[5, 6, 7],
            48,
            None,
            &[busy],
            now,
            Leg::Whole,
            Bounded::ALL,
            Lane::Any,
            0,
        )
        .unwrap();
    assert_eq!(p.worker.id, other);
    let _g = router.dispatch(&p, &[5, 6, 7], 48, 16, now);
    let fresh = router
        .select_with(
            &pool,
            &[8, 8, 8, 8],
            64,
            None,
            &[],
            now,
            Leg::Whole,
            Bounded::ALL,
            Lane::Any,
            0,
        )
        .unwrap();
    assert_eq!(fresh.worker.id, busy, "the reused id, idle, is picked");
}

/// The session term: a session's later requests go to its last worker when costs are otherwise
/// even, but not when that worker is loaded (soft), and not at all with the term off.
#[test]
fn a_session_prefers_its_last_worker_softly() {
    let c = one_pool(3, "kv");
    let cfg = Arc::new(c);
    let (reg, _) = Registry::new(cfg.clone()).unwrap();
    let router = router(&cfg, &reg);
    let fleet = reg.snapshot();
    let pool = fleet.pool("m").cloned().unwrap();
    let now = Instant::now();
    let session = Some(42u64);
    // New prompts (no overlap anywhere): each picks by tie-break on its own first block.
    let fresh = |i: u64| -> Vec<u64> { (0..4).map(|b| i * 100 + b + 1).collect() };
    let first = router
        .select(&pool, &fresh(1), 64, session, &[], now)
        .unwrap();
    router.note_session(session, &first.worker, now);
    for i in 2..12 {
        let pick = router
            .select(&pool, &fresh(i), 64, session, &[], now)
            .unwrap();
        assert_eq!(pick.worker.name, first.worker.name, "prompt {i}");
    }
    // Without the session key, new prompts spread over the workers.
    let spread: std::collections::HashSet<_> = (2..40)
        .map(|i| {
            router
                .select(&pool, &fresh(i), 64, None, &[], now)
                .unwrap()
                .worker
                .name
                .clone()
        })
        .collect();
    assert!(spread.len() > 1, "{spread:?}");
    // A loaded session worker loses to idle ones: the term is worth 4 blocks here, the load more.
    let mut guards = Vec::new();
    for j in 0..6 {
        let hashes: Vec<u64> = (0..8).map(|b| 9_000 + j * 100 + b).collect();
        let decision = Decision::for_candidate(
            &RouteRequest {
                hashes: &hashes,
                isl_tokens: 128,
                block_size: 16,
                affinity_key: None,
                hot: Default::default(),
            },
            &Candidate::new(first.worker.id),
            0.0,
        );
        let pick = Pick {
            worker: first.worker.clone(),
            decision,
            estimate: first.estimate,
            explain: None,
        };
        guards.push(router.dispatch(&pick, &hashes, 128, 16, now));
    }
    let pick = router
        .select(&pool, &fresh(99), 64, session, &[], now)
        .unwrap();
    assert_ne!(pick.worker.name, first.worker.name);
    drop(guards);
}

#[test]
fn pool_size_picks_the_bounded_paths() {
    let b = Bounded::for_pool;
    assert_eq!(b(31), Bounded::NONE);
    assert!(b(32).kv && !b(32).latency);
    // `latency` only where fleet_bench had the bounded walk faster than the scan (§8b): from
    // 128 workers.
    assert!(b(64).kv && !b(64).latency);
    assert!(b(127).kv && !b(127).latency);
    assert_eq!(b(128), Bounded::ALL);
    assert_eq!(b(4096), Bounded::ALL);
}

/// Flow control's lanes (`Lane`): a priority request goes where no prefill is pending; while
/// one is about, a lower-class request keeps off a worker where a priority request waits for its
/// first token and off the last worker with no prefill pending.
#[test]
fn lanes_keep_prefill_steps_out_of_the_priority_class_way() {
    let mut c = one_pool(3, "least_loaded");
    c.routing.max_inflight_per_worker = 4;
    let (reg, _) = Registry::new(Arc::new(c.clone())).unwrap();
    let router = router(&c, &reg);
    let fleet = reg.snapshot();
    let pool = fleet.pool("m").cloned().unwrap();
    let now = Instant::now();
    let pick_on = |w: usize| {
        let w = pool.workers[w].clone();
        Pick {
            decision: Decision::for_candidate(
                &RouteRequest {
                    hashes: &[],
                    isl_tokens: 256,
                    block_size: 16,
                    affinity_key: None,
                    hot: Default::default(),
                },
                &Candidate::new(w.id),
                0.0,
            ),
            worker: w,
            estimate: Default::default(),
            explain: None,
        }
    };
    let select = |lane: Lane| {
        router
            .select_for(&pool, &[], 256, None, &[], now, Leg::Whole, lane, 0)
            .map(|p| {
                pool.workers
                    .iter()
                    .position(|w| w.id == p.worker.id)
                    .unwrap()
            })
    };
    // Worker 0 has a batch prefill pending; workers 1 and 2 decode (prefill done).
    let _b0 = router.dispatch(&pick_on(0), &[], 256, 16, now);
    let b1 = router.dispatch(&pick_on(1), &[], 256, 16, now);
    b1.prefill_done();
    let b2 = router.dispatch(&pick_on(2), &[], 256, 16, now);
    b2.prefill_done();
    // No priority request yet: lower classes use every worker.
    assert!(select(Lane::Below).is_ok());
    for _ in 0..20 {
        let w = select(Lane::Priority).unwrap();
        assert_ne!(w, 0, "a priority request avoids the pending prefill");
    }
    // A priority request waits for its first token on worker 1.
    let p1 = router.dispatch(&pick_on(1), &[], 256, 16, now);
    p1.hold_priority_prefill();
    // Worker 2 is the last one free of prefill: lower classes join worker 0's prefill.
    for _ in 0..20 {
        assert_eq!(select(Lane::Below), Ok(0));
    }
    // Worker 0 at its bound: nothing for lower classes (they wait; a first token wakes them).
    let _fill: Vec<_> = (0..3)
        .map(|_| router.dispatch(&pick_on(0), &[], 256, 16, now))
        .collect();
    assert_eq!(select(Lane::Below).err(), Some(NoPick::AllBusy));
    assert_eq!(
        select(Lane::Priority),
        Ok(2),
        "past the bound, no prefill ahead"
    );
    // The priority request's first token: two workers free of prefill again, so a lower class
    // may take one (least loaded: worker 2).
    p1.prefill_done();
    assert_eq!(select(Lane::Below), Ok(2));
}

/// `explain`: a pick lists the chosen worker first and the best others by the policy's cost,
/// at most the number asked for, with the reason; asked for nothing it carries nothing.
#[test]
fn a_pick_explains_itself_only_when_asked() {
    let c = one_pool(4, "kv");
    let cfg = Arc::new(c);
    let (reg, _) = Registry::new(cfg.clone()).unwrap();
    let router = router(&cfg, &reg);
    let pool = reg.snapshot().pool("m").cloned().unwrap();
    let now = Instant::now();
    let hashes = [11, 12, 13, 14];
    let sel = |explain: u8, hashes: &[u64]| {
        router
            .select_for(
                &pool,
                hashes,
                64,
                None,
                &[],
                now,
                Leg::Whole,
                Lane::Any,
                explain,
            )
            .unwrap()
    };
    assert!(sel(0, &hashes).explain.is_none(), "not asked: nothing");
    // A cold fleet: no overlap anywhere, the least cost wins.
    let first = sel(3, &hashes);
    let e = first.explain.as_deref().unwrap();
    assert_eq!((e.seen, e.candidates.len(), e.reason), (4, 3, "load"));
    assert!(e.candidates[0].chosen && e.candidates[0].worker == first.worker.name);
    assert!(e.candidates[1..].iter().all(|c| !c.chosen));
    let costs: Vec<f64> = e.candidates.iter().map(|c| c.cost.unwrap()).collect();
    assert_eq!(costs[0], first.decision.cost);
    assert!(costs.windows(2).all(|w| w[0] <= w[1]), "{costs:?}");
    assert!(e.candidates.iter().all(|c| c.predicted_ttft_ms > 0.0));
    // Dispatched there, the prompt's blocks are on that worker: the same prompt goes back there
    // for its overlap, and the others (loaded less) rank after it.
    let _g = router.dispatch(&first, &hashes, 64, 16, now);
    let again = sel(8, &hashes);
    let e = again.explain.as_deref().unwrap();
    assert_eq!(e.candidates.len(), 4, "all four, fewer than asked");
    assert_eq!(e.reason, "overlap");
    assert_eq!(again.worker.name, first.worker.name);
    assert_eq!(e.candidates[0].overlap_blocks, 4);
    assert_eq!(e.candidates[0].inflight, 1);
    assert!(e.candidates[1..]
        .iter()
        .all(|c| c.overlap_blocks == 0 && c.inflight == 0));
}

/// Policies without a cost list candidates by predicted TTFT and say their own name.
#[test]
fn a_round_robin_pick_explains_itself_by_name() {
    let c = one_pool(2, "round_robin");
    let cfg = Arc::new(c);
    let (reg, _) = Registry::new(cfg.clone()).unwrap();
    let router = router(&cfg, &reg);
    let pool = reg.snapshot().pool("m").cloned().unwrap();
    let p = router
        .select_for(
            &pool,
            &[1],
            16,
            None,
            &[],
            Instant::now(),
            Leg::Whole,
            Lane::Any,
            4,
        )
        .unwrap();
    let e = p.explain.unwrap();
    assert_eq!(e.reason, "round_robin");
    assert_eq!(e.candidates.len(), 2);
    assert!(e.candidates.iter().all(|c| c.cost.is_none()));
    assert!(e.candidates[0].chosen);
}

#[test]
fn kv_queue_time_reaches_the_kv_cost_with_the_latency_models_waits() {
    let kv = kv_cost_of;
    // Off by default under `kv`; always on under `kv_time`, the default policy.
    assert_eq!(kv("[routing]\npolicy = \"kv\"\n").queue_time, None);
    assert_eq!(kv("").queue_time, Some(LatencyConfig::default()));
    let t = kv("[routing]\nkv_queue_time = false\nlatency_slot_wait = false\n");
    assert!(
        !t.queue_time
            .expect("kv_time: on whatever kv_queue_time says")
            .slot_wait
    );
    // On: the latency model's settings, the slot and KV-memory switches included.
    let on = kv("[routing]\npolicy = \"kv\"\nkv_queue_time = true\nlatency_kv_wait = false\n");
    let l = on.queue_time.expect("queue_time on");
    assert!(l.slot_wait && !l.kv_wait);
    assert_eq!(l.curve, TimingCurve::default());
    // Not a `kv` key only in name: a wrong type is refused.
    assert!(Config::from_toml("[routing]\nkv_queue_time = 1\n").is_err());
    // The step wait: off by default, on with the queue term, refused without it.
    assert!(!on.step_wait);
    assert!(
        kv("[routing]\npolicy = \"kv\"\nkv_queue_time = true\nkv_step_wait = true\n").step_wait
    );
    assert!(
        kv("[routing]\nkv_step_wait = true\n").step_wait,
        "kv_time needs no kv_queue_time"
    );
    let cfg =
        Config::from_toml("[routing]\npolicy = \"kv\"\nkv_step_wait = true\n").expect("config");
    let err = RoutePolicy::from_config(&cfg.routing, &cfg.slo, &cfg.pd)
        .err()
        .expect("kv_step_wait without kv_queue_time accepted");
    assert!(err.to_string().contains("kv_queue_time"), "{err}");
}

/// The routing policy a config builds (its error when refused).
fn policy_of(toml: &str) -> anyhow::Result<RoutePolicy> {
    let cfg = Config::from_toml(toml).expect("config");
    RoutePolicy::from_config(&cfg.routing, &cfg.slo, &cfg.pd)
}

/// The `kv` cost model of a config whose policy is `kv` or `kv_time`.
fn kv_cost_of(toml: &str) -> KvCostConfig {
    *policy_of(toml)
        .expect("policy")
        .policy
        .as_kv()
        .expect("kv")
        .config()
}

#[test]
fn request_weight_reaches_the_kv_cost_and_bad_values_are_refused() {
    let (build, kv) = (policy_of, kv_cost_of);
    assert_eq!(kv("").request_weight, 0.0);
    assert_eq!(
        kv("[routing]\nrequest_weight = 24.5\n").request_weight,
        24.5
    );
    for bad in ["-1.0", "nan", "inf"] {
        let err = build(&format!("[routing]\nrequest_weight = {bad}\n"))
            .err()
            .unwrap_or_else(|| panic!("request_weight = {bad} accepted"));
        assert!(err.to_string().contains("routing.request_weight"), "{err}");
    }
}

#[test]
fn kv_replicate_reaches_the_cost_and_bad_values_are_refused() {
    let build = policy_of;
    let replicate = |toml: &str| kv_cost_of(toml).replicate;
    // Unset: on in kv_time (the default policy), off in kv; set, the value in both.
    assert_eq!(replicate(""), crate::config::KV_TIME_REPLICATE);
    const { assert!(crate::config::KV_TIME_REPLICATE > 0.0) };
    assert_eq!(
        replicate("[routing]\npolicy = \"kv_time\"\n"),
        crate::config::KV_TIME_REPLICATE
    );
    assert_eq!(replicate("[routing]\npolicy = \"kv\"\n"), 0.0);
    assert_eq!(replicate("[routing]\nkv_replicate = 0\n"), 0.0);
    assert_eq!(replicate("[routing]\nkv_replicate = 4\n"), 4.0);
    assert_eq!(
        replicate("[routing]\npolicy = \"kv\"\nkv_replicate = 2.5\n"),
        2.5
    );
    for bad in ["-1.0", "nan", "inf"] {
        let err = build(&format!("[routing]\nkv_replicate = {bad}\n"))
            .err()
            .unwrap_or_else(|| panic!("kv_replicate = {bad} accepted"));
        assert!(err.to_string().contains("routing.kv_replicate"), "{err}");
    }
    assert!(Config::from_toml("[routing]\nkv_replicate = \"high\"\n").is_err());
}

#[test]
fn kv_cold_latency_reaches_the_cost_and_bad_values_are_refused() {
    let build = policy_of;
    let cold = |toml: &str| {
        let c = kv_cost_of(toml);
        (c.cold_latency, c.cold_reuse, c.cold_decode_weight)
    };
    // Unset: on in kv_time (the default policy), off in kv.
    assert_eq!(cold(""), (crate::config::KV_TIME_COLD_LATENCY, 0.5, 0.25));
    assert_eq!(cold("[routing]\npolicy = \"kv\"\n").0, 0.0);
    assert_eq!(
        cold("[routing]\nkv_cold_latency = 0.3\nkv_cold_reuse = 0.9\nlatency_decode_weight = 1\n"),
        (0.3, 0.9, 1.0)
    );
    assert_eq!(cold("[routing]\nkv_cold_latency = 0\n").0, 0.0);
    // `kv` has the latency model only with kv_queue_time.
    assert_eq!(
        cold("[routing]\npolicy = \"kv\"\nkv_queue_time = true\nkv_cold_latency = 0.5\n").0,
        0.5
    );
    let err = build("[routing]\npolicy = \"kv\"\nkv_cold_latency = 0.5\n")
        .err()
        .expect("kv_cold_latency without the latency model accepted");
    assert!(err.to_string().contains("routing.kv_cold_latency"), "{err}");
    for (key, bad) in [
        ("kv_cold_latency", "-0.1"),
        ("kv_cold_latency", "1.5"),
        ("kv_cold_latency", "nan"),
        ("kv_cold_reuse", "-1"),
        ("kv_cold_reuse", "2"),
        ("kv_cold_reuse", "nan"),
    ] {
        let err = build(&format!("[routing]\n{key} = {bad}\n"))
            .err()
            .unwrap_or_else(|| panic!("{key} = {bad} accepted"));
        assert!(err.to_string().contains(&format!("routing.{key}")), "{err}");
    }
    assert!(Config::from_toml("[routing]\nkv_cold_latency = \"high\"\n").is_err());
}
