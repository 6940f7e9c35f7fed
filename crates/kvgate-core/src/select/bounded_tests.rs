use super::*;
use crate::hash::{block_hashes, BASE_SEED};
use crate::latency::{EngineSlots, LatencyConfig, Speed, TimingCurve};
use crate::load::WorkerLoad;
use crate::policy::LatencyPolicyConfig;
use crate::{BusyThresholds, KvCostConfig, LoadGuard, ScrapedLoad, WorkerId};
use proptest::prelude::*;
use std::time::Duration;

const BS: usize = 4;

/// Prompt `g`'s tokens: a prefix shared by its group (`g % 3`), then its own tail.
fn tokens(g: usize, blocks: usize) -> Vec<u32> {
    (0..blocks * BS)
        .map(|i| {
            if i < 3 * BS {
                (g % 3 * 1000 + i) as u32
            } else {
                (g * 100_000 + i) as u32
            }
        })
        .collect()
}

/// What the caller adds per worker: `None` leaves the worker out, else extra (remote) load, whether
/// it caches, and its scraped load.
type Extra = Option<(WorkerLoad, bool, Option<ScrapedLoad>)>;

fn prepared(extra: &[Extra]) -> impl FnMut(&mut Candidate) -> bool + '_ {
    move |c: &mut Candidate| match extra[c.worker.index()] {
        None => false,
        Some((l, kv, scraped)) => {
            c.active_blocks += l.active_blocks;
            c.pending_prefill_tokens += l.pending_prefill_tokens;
            c.inflight += l.inflight;
            c.kv_scoring = kv;
            c.scraped = scraped;
            c.stable_id = crate::select::mix(u64::from(c.worker.0));
            true
        }
    }
}

/// The plain twin: every one of `workers` scored, completed by `prep` (which leaves out those
/// it refuses), then the policy.
#[allow(clippy::too_many_arguments)]
fn exhaustive(
    policy: &dyn Policy,
    index: &KvIndex,
    active: &ActiveSequences,
    req: &RouteRequest<'_>,
    now: Instant,
    workers: usize,
    mut prep: impl FnMut(&mut Candidate) -> bool,
    rng: &mut fastrand::Rng,
) -> Option<(Decision, Vec<Candidate>)> {
    let mut cands: Vec<Candidate> = (0..workers as u32)
        .map(|w| Candidate::new(WorkerId(w)))
        .collect();
    let mut scores = OverlapScores::new();
    crate::score_candidates(index, active, req.hashes, now, &mut scores, &mut cands);
    cands.retain_mut(|c| prep(c));
    let d = policy.select(req, &cands, rng)?;
    Some((d, cands))
}

/// The property tests' busy thresholds: none, or (active blocks, waiting).
fn thresholds(busy: Option<(u32, u32)>) -> BusyThresholds {
    busy.map_or(BusyThresholds::default(), |(a, w)| BusyThresholds {
        active_blocks: Some(a),
        waiting: Some(w),
        ..BusyThresholds::default()
    })
}

/// The bounded walk's decision `got` (with the candidates it `visited`) against the exhaustive
/// scan's `want` (with every eligible candidate): both or neither decide; the same cost always;
/// the same worker when that cost is reached by one eligible worker only (`cost` is the policy's
/// cost of a candidate); the chosen worker seen exactly as the scan saw it.
fn same_as_exhaustive(
    want: Option<(Decision, Vec<Candidate>)>,
    got: Option<Decision>,
    visited: &[Candidate],
    busy: &BusyThresholds,
    cost: impl Fn(&Candidate) -> f64,
) -> Result<(), TestCaseError> {
    match (want, got) {
        (None, None) => {}
        (Some((want, all)), Some(got)) => {
            prop_assert_eq!(
                got.cost,
                want.cost,
                "bounded {:?} exhaustive {:?}",
                got,
                want
            );
            let el = crate::Eligibility::new(&all, busy);
            let at_min = all
                .iter()
                .filter(|c| el.ok(c) && cost(c) == want.cost)
                .count();
            if at_min == 1 {
                prop_assert_eq!(got.worker, want.worker);
            }
            let mine = visited.iter().find(|c| c.worker == got.worker).unwrap();
            let theirs = all.iter().find(|c| c.worker == got.worker).unwrap();
            prop_assert_eq!(mine, theirs);
            prop_assert_eq!(got.overlap_blocks, theirs.effective_overlap());
        }
        (want, got) => prop_assert!(
            false,
            "exhaustive {:?} bounded {:?}",
            want.map(|w| w.0),
            got
        ),
    }
    Ok(())
}

/// A fleet of `workers` known workers holding (`held`: worker, group, blocks, exact) and running
/// (`running`: worker, group, blocks, isl, prefill done) prompt prefixes; a third of the requests
/// freed again. The guards of the requests still running are returned.
#[allow(clippy::type_complexity)]
fn fleet(
    workers: usize,
    held: &[(usize, usize, usize, bool)],
    running: &[(usize, usize, usize, u64, bool)],
    now: Instant,
) -> (KvIndex, ActiveSequences, Vec<LoadGuard>) {
    let mut index = KvIndex::new();
    let active = ActiveSequences::new();
    for w in 0..workers as u32 {
        active.add_worker(WorkerId(w));
    }
    for &(w, g, len, exact) in held {
        let w = WorkerId((w % workers) as u32);
        let t = tokens(g, len);
        if exact {
            if index.mode(w).is_none() {
                index.set_mode(w, crate::IndexMode::Exact);
            }
            if index.mode(w) == Some(crate::IndexMode::Exact) {
                let engine: Vec<u64> = (0..len as u64).map(|b| (g as u64) << 32 | b).collect();
                let _ = index.apply_stored(w, None, &engine, &t, BS, BASE_SEED);
            }
        } else {
            if index.mode(w).is_none() {
                index.set_mode(w, crate::IndexMode::Approximate(Default::default()));
            }
            index.record_routed(w, &block_hashes(&t, BS, BASE_SEED), now);
        }
    }
    let mut guards: Vec<LoadGuard> = Vec::new();
    for &(w, g, len, isl, done) in running {
        let w = WorkerId((w % workers) as u32);
        let h = block_hashes(&tokens(g, len), BS, BASE_SEED);
        let guard = active.add(w, 0, &h, isl, 0);
        if done {
            guard.mark_prefill_done();
        }
        guards.push(guard);
    }
    for i in (0..guards.len()).rev().step_by(3) {
        drop(guards.swap_remove(i));
    }
    (index, active, guards)
}

/// A worker's latency fit as the caller fills it: prefill and decode speed factors, engine slots
/// (limit, service ms, output tokens; `None` = not learned) and KV capacity in blocks.
type Fit = (f64, f64, Option<(u32, f64, f64)>, u32);

fn fit_strategy() -> impl Strategy<Value = Fit> {
    (
        prop_oneof![Just(1.0), 0.3..4.0f64],
        prop_oneof![Just(1.0), 0.3..4.0f64],
        prop::option::of((1..4u32, 10.0..500.0f64, 1.0..200.0f64)),
        prop_oneof![Just(0u32), 4..60u32],
    )
}

fn prepared_latency<'a>(
    extra: &'a [Extra],
    fits: &'a [Fit],
) -> impl FnMut(&mut Candidate) -> bool + 'a {
    let mut base = prepared(extra);
    move |c: &mut Candidate| {
        if !base(c) {
            return false;
        }
        let (p, d, slots, cap) = fits[c.worker.index()];
        c.speed = Speed {
            prefill: p,
            decode: d,
        };
        c.slots = slots.map_or(
            EngineSlots::UNKNOWN,
            |(limit, service_ms, output_tokens)| EngineSlots {
                limit,
                service_ms,
                output_tokens,
            },
        );
        c.kv_capacity_blocks = cap;
        true
    }
}

fn extra_strategy() -> impl Strategy<Value = Extra> {
    prop_oneof![
        1 => Just(None),
        6 => (0..3u32, 0..40u64, 0..2u32, prop::bool::weighted(0.8), prop::option::of((0..4u32, 0..100u32)))
            .prop_map(|(a, p, f, kv, s)| Some((
                WorkerLoad { active_blocks: a, pending_prefill_tokens: p, inflight: f },
                kv,
                s.map(|(w, u)| ScrapedLoad { kv_usage: u as f32 / 100.0, waiting: w, running: 0 }),
            ))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    /// Fleets of up to 150 workers (several bitset words), each holding prompt prefixes in the index
    /// (exact events or approximate routing) and running requests of them, some left out by the
    /// caller, some with extra (peer) load, scraped load and busy thresholds, under several cost
    /// weights: the bounded decision always has the exhaustive one's cost, and the same worker
    /// whenever that cost is unique among the eligible workers.
    #[test]
    fn bounded_matches_exhaustive(
        workers in 1..150usize,
        held in prop::collection::vec((0..150usize, 0..6usize, 1..12usize, any::<bool>()), 0..40),
        running in prop::collection::vec((0..150usize, 0..6usize, 1..12usize, 0..200u64, any::<bool>()), 0..200),
        extra in prop::collection::vec(extra_strategy(), 150),
        query in (0..8usize, 0..12usize),
        weights in (0..3usize, 0..2usize, 0..2usize),
        busy in prop::option::of((2..30u32, 0..3u32)),
        seed in any::<u64>(),
    ) {
        let now = Instant::now();
        let mut index = KvIndex::new();
        let active = ActiveSequences::new();
        for w in 0..workers as u32 {
            active.add_worker(WorkerId(w));
        }
        for &(w, g, len, exact) in &held {
            let w = WorkerId((w % workers) as u32);
            let t = tokens(g, len);
            if exact {
                if index.mode(w).is_none() {
                    index.set_mode(w, crate::IndexMode::Exact);
                }
                if index.mode(w) == Some(crate::IndexMode::Exact) {
                    let engine: Vec<u64> = (0..len as u64).map(|b| (g as u64) << 32 | b).collect();
                    let _ = index.apply_stored(w, None, &engine, &t, BS, BASE_SEED);
                }
            } else {
                if index.mode(w).is_none() {
                    index.set_mode(w, crate::IndexMode::Approximate(Default::default()));
                }
                index.record_routed(w, &block_hashes(&t, BS, BASE_SEED), now);
            }
        }
        let mut guards: Vec<LoadGuard> = Vec::new();
        for &(w, g, len, isl, done) in &running {
            let w = WorkerId((w % workers) as u32);
            let h = block_hashes(&tokens(g, len), BS, BASE_SEED);
            let guard = active.add(w, 0, &h, isl, 0);
            if done {
                guard.mark_prefill_done();
            }
            guards.push(guard);
        }
        // Some requests finished: the maintained order must follow frees too.
        for i in (0..guards.len()).rev().step_by(3) {
            drop(guards.swap_remove(i));
        }
        let (pw, rw, pend) = ([0.0, 1.0, 4.0][weights.0], [0.0, 0.5][weights.1], [1.0, 0.5][weights.2]);
        // The replication term (off, half, full) with the prompt's hot prefix from the same load.
        let replicate = [0.0, 0.5, 1.0, 3.0][(seed % 4) as usize];
        let cfg = KvCostConfig { prefill_weight: pw, request_weight: rw, pending_weight: pend, temperature: 0.0, queue_time: None, step_wait: false, replicate, ..KvCostConfig::default() };
        let busy = thresholds(busy);
        let policy = KvPolicy::new(cfg, busy);
        let h = block_hashes(&tokens(query.0, query.1), BS, BASE_SEED);
        let req = RouteRequest { hashes: &h, isl_tokens: (query.1 * BS) as u64 + 1, block_size: BS as u32, affinity_key: None, hot: active.hot_prefix(&h) };
        let extra = &extra[..workers];
        let want = exhaustive(&policy, &index, &active, &req, now + Duration::from_secs(1), extra.len(), prepared(extra), &mut fastrand::Rng::with_seed(seed));
        let (mut scores, mut cands) = (OverlapScores::new(), Vec::new());
        let got = select_kv_bounded(&policy, &index, &active, &req, now + Duration::from_secs(1), &mut scores, &mut cands, prepared(extra), &mut fastrand::Rng::with_seed(seed));
        same_as_exhaustive(want, got, &cands, &busy, |c| cfg.cost(&req, c))?;
    }

    /// The same for `kv` with the time-based queue term (`queue_time`): learned speeds, engine
    /// slots and KV capacities (so slot and KV-memory waits), two timing curves: a term that only
    /// raises costs keeps the bounded walk exact; with and without the step wait.
    #[test]
    fn kv_queue_time_bounded_matches_exhaustive(
        workers in 1..150usize,
        held in prop::collection::vec((0..150usize, 0..6usize, 1..12usize, any::<bool>()), 0..40),
        running in prop::collection::vec((0..150usize, 0..6usize, 1..12usize, 0..2000u64, any::<bool>()), 0..200),
        extra in prop::collection::vec(extra_strategy(), 150),
        fits in prop::collection::vec(fit_strategy(), 150),
        query in (0..8usize, 0..12usize),
        knobs in (0..3usize, 0..2usize, any::<bool>(), any::<bool>(), any::<bool>()),
        busy in prop::option::of((2..30u32, 0..3u32)),
        seed in any::<u64>(),
    ) {
        let now = Instant::now();
        let (index, active, _guards) = fleet(workers, &held, &running, now);
        let (pw, curve, slot_wait, kv_wait, step_wait) = knobs;
        let curve = [TimingCurve::default(), TimingCurve { prefill: [0.0, 0.02, 5.0], decode: [0.0, 10.0, 8.0] }][curve];
        let cfg = KvCostConfig {
            prefill_weight: [0.0, 1.0, 4.0][pw],
            pending_weight: 0.25,
            queue_time: Some(LatencyConfig { curve, pending_weight: 1.0, slot_wait, kv_wait }),
            step_wait,
            ..KvCostConfig::default()
        };
        let busy = thresholds(busy);
        let policy = KvPolicy::new(cfg, busy);
        let extra = &extra[..workers];
        let fits = &fits[..workers];
        let h = block_hashes(&tokens(query.0, query.1), BS, BASE_SEED);
        let req = RouteRequest { hashes: &h, isl_tokens: (query.1 * BS) as u64 + 1, block_size: BS as u32, affinity_key: None, hot: Default::default() };
        let at = now + Duration::from_secs(1);
        let want = exhaustive(&policy, &index, &active, &req, at, workers, prepared_latency(extra, fits), &mut fastrand::Rng::with_seed(seed));
        let (mut scores, mut cands) = (OverlapScores::new(), Vec::new());
        let got = select_kv_bounded(&policy, &index, &active, &req, at, &mut scores, &mut cands, prepared_latency(extra, fits), &mut fastrand::Rng::with_seed(seed));
        same_as_exhaustive(want, got, &cands, &busy, |c| cfg.cost(&req, c))?;
    }

    /// The same for the `latency` policy: learned speeds, engine slots (slot and KV waits), KV
    /// capacities, scraped KV usage, peers' load, busy thresholds, several decode weights and
    /// timing curves (one whose prefill time falls with more tokens: no bound, every worker
    /// visited), with the speed floor the fastest worker's factor or below it and the decode
    /// ceiling the slowest worker's factor, above it or none: the same cost
    /// always, the same worker whenever that cost is unique among the eligible workers.
    #[test]
    fn latency_bounded_matches_exhaustive(
        workers in 1..150usize,
        held in prop::collection::vec((0..150usize, 0..6usize, 1..12usize, any::<bool>()), 0..40),
        running in prop::collection::vec((0..150usize, 0..6usize, 1..12usize, 0..2000u64, any::<bool>()), 0..200),
        extra in prop::collection::vec(extra_strategy(), 150),
        fits in prop::collection::vec(fit_strategy(), 150),
        query in (0..8usize, 0..12usize, prop_oneof![0..3000u64, 3000..8000u64]),
        knobs in (0..3usize, 0..2usize, 0..3usize, any::<bool>(), any::<bool>(), 0..2usize, 0..3usize),
        base in prop_oneof![Just(0u32), 1..5u32],
        uniform_decode in any::<bool>(),
        busy in prop::option::of((2..30u32, 0..3u32)),
        seed in any::<u64>(),
    ) {
        let now = Instant::now();
        let (index, active, mut _guards) = fleet(workers, &held, &running, now);
        let (dw, pend, curve, slot_wait, kv_wait, floor, ceiling) = knobs;
        // Every worker running `base` more requests: no idle worker, so the bound's in-flight
        // terms decide where the walk stops.
        for w in 0..workers as u32 {
            for r in 0..base {
                let g = active.add(WorkerId(w), 0, &[crate::select::mix(u64::from(w) << 8 | u64::from(r))], 100, 0);
                g.mark_prefill_done();
                _guards.push(g);
            }
        }
        let curve = match curve {
            0 => TimingCurve::default(),
            1 => TimingCurve { prefill: [0.0, 0.02, 5.0], decode: [0.0, 10.0, 8.0] },
            // Falls with more tokens past ~500: no lower bound from the order.
            _ => TimingCurve { prefill: [-1e-4, 0.1, 30.0], decode: [0.0, 10.0, 8.0] },
        };
        let cfg = LatencyPolicyConfig {
            model: LatencyConfig { curve, pending_weight: [1.0, 0.5][pend], slot_wait, kv_wait },
            decode_weight: [0.0, 0.25, 1.0][dw],
            ..LatencyPolicyConfig::default()
        };
        let busy = thresholds(busy);
        let policy = LatencyPolicy::new(cfg, busy);
        let extra = &extra[..workers];
        // Half the cases: every decode factor 1 (a ceiling below the own prefill of long prompts).
        let fits: Vec<Fit> = fits[..workers].iter().map(|&(p, d, s, c)| (p, if uniform_decode { 1.0 } else { d }, s, c)).collect();
        let fits = &fits[..];
        let fastest = fits.iter().map(|f| f.0).fold(f64::INFINITY, f64::min);
        let slowest_decode = fits.iter().map(|f| f.1).fold(0.0, f64::max);
        let speeds = SpeedBounds {
            prefill_floor: [fastest, fastest * 0.5][floor],
            decode_ceiling: [slowest_decode, slowest_decode * 2.0, f64::INFINITY][ceiling],
        };
        let h = block_hashes(&tokens(query.0, query.1), BS, BASE_SEED);
        let req = RouteRequest { hashes: &h, isl_tokens: (query.1 * BS) as u64 + query.2, block_size: BS as u32, affinity_key: None, hot: Default::default() };
        let at = now + Duration::from_secs(1);
        let want = exhaustive(&policy, &index, &active, &req, at, workers, prepared_latency(extra, fits), &mut fastrand::Rng::with_seed(seed));
        let (mut scores, mut cands) = (OverlapScores::new(), Vec::new());
        let got = select_latency_bounded(&policy, &index, &active, &req, at, speeds, &mut scores, &mut cands, prepared_latency(extra, fits), &mut fastrand::Rng::with_seed(seed));
        same_as_exhaustive(want, got, &cands, &busy, |c| cfg.cost(&req, c).0)?;
    }

    /// The bound of a non-holder's `latency` cost from its pending tokens and in-flight requests
    /// is below the cost of every worker whose speeds are within the bounds, whatever its KV
    /// usage, slots and waits; and it is reached (so it cannot be raised) by a worker at the
    /// floor and the ceiling, at the curve's longest decode step, when that step is shorter than
    /// the request's own prefill and the running requests' weight is at least ½.
    #[test]
    fn latency_bound_is_a_tight_lower_bound(
        fit in fit_strategy(),
        slack in (1.0..3.0f64, 0.2..1.0f64, 0.0..=1.0f64),
        load in (0..5000u64, 0..12u32, 0..40u32, 0..60u32),
        isl in 1..9000u64,
        knobs in (0..3usize, 0..2usize, 0..2usize, any::<bool>(), any::<bool>()),
        tight in any::<bool>(),
    ) {
        let (dw, pend, curve, slot_wait, kv_wait) = knobs;
        let curve = [TimingCurve::default(), TimingCurve { prefill: [0.0, 0.02, 5.0], decode: [-20.0, 30.0, 8.0] }][curve];
        let cfg = LatencyPolicyConfig {
            model: LatencyConfig { curve, pending_weight: [1.0, 0.5][pend], slot_wait, kv_wait },
            decode_weight: [0.0, 0.25, 1.0][dw],
            ..LatencyPolicyConfig::default()
        };
        let (pending, inflight, active_blocks, cap) = load;
        let (p, d, slots, _) = fit;
        // The bounds: the floor `slack.0` times below the prefill factor, the ceiling
        // `1 / slack.1` times above the decode factor.
        let bounds = SpeedBounds { prefill_floor: p / slack.0, decode_ceiling: d / slack.1 };
        let mut c = Candidate::new(WorkerId(0));
        c.pending_prefill_tokens = pending;
        c.inflight = inflight;
        c.active_blocks = active_blocks;
        c.kv_capacity_blocks = cap;
        c.new_blocks = 16;
        c.speed = Speed { prefill: p, decode: d };
        c.slots = slots.map_or(EngineSlots::UNKNOWN, |(limit, service_ms, output_tokens)| EngineSlots { limit, service_ms, output_tokens });
        c.scraped = Some(ScrapedLoad { kv_usage: slack.2 as f32, waiting: 0, running: 0 });
        let req_hashes = [1u64; 4];
        let req = RouteRequest { hashes: &req_hashes, isl_tokens: isl, block_size: 16, affinity_key: None, hot: Default::default() };
        let uncached = (isl as f64).max(1.0);
        let lb = LatencyBound::new(&cfg, uncached, bounds);
        let at = lb.at(pending as f64, f64::from(inflight));
        let cost = cfg.cost(&req, &c).0;
        prop_assert!(at <= cost * (1.0 + 1e-12) + 1e-9, "bound {} above cost {}", at, cost);
        if tight {
            // A worker at the bounds: the longest decode step (KV usage at the curve's top).
            let [da, db, _] = curve.decode;
            let top = if da < 0.0 { (-db / (2.0 * da)).clamp(0.0, 1.0) } else { 1.0 };
            c.speed = Speed { prefill: bounds.prefill_floor, decode: bounds.decode_ceiling };
            c.scraped = Some(ScrapedLoad { kv_usage: top as f32, waiting: 0, running: 0 });
            c.slots = EngineSlots::UNKNOWN;
            let cost = cfg.cost(&req, &c).0;
            prop_assert!(at <= cost * (1.0 + 1e-6) + 1e-9, "bound {} above cost {}", at, cost);
            let s = bounds.decode_ceiling * curve.decode_ms(top as f32 as f64);
            let p0 = bounds.prefill_floor * curve.prefill_ms(uncached);
            if inflight > 0 && s <= p0 && cfg.decode_weight * f64::from(inflight) >= 0.5 {
                prop_assert!((cost - at).abs() <= 1e-6 * cost.max(1.0), "bound {} below the cost {} it should reach", at, cost);
            }
        }
    }

    /// The maintained load order is the fleet sorted by key after any mix of adds, prefill
    /// completions, frees, expiry and removals.
    #[test]
    fn load_order_follows_every_change(
        ops in prop::collection::vec((0..5u8, 0..70u32, 1..6usize, 0..50u64), 0..120),
    ) {
        let active = ActiveSequences::new();
        let weights = OrderWeights { pending: 0.25, active: 1.0, inflight: 0.5 };
        // Build the order before the changes so it is maintained, not rebuilt.
        active.locked().walk_order(weights, |_, _, _| true);
        let t0 = Instant::now();
        let mut guards: Vec<LoadGuard> = Vec::new();
        for (k, &(op, w, len, isl)) in ops.iter().enumerate() {
            let w = WorkerId(w);
            match op {
                0 | 1 => {
                    let h = block_hashes(&tokens(k % 5, len), BS, BASE_SEED);
                    guards.push(active.add_at(w, 0, &h, isl, 0, t0 + Duration::from_secs(k as u64)));
                }
                2 => if let Some(g) = guards.get(isl as usize % guards.len().max(1)) { g.mark_prefill_done() },
                3 => { if !guards.is_empty() { drop(guards.swap_remove(isl as usize % guards.len())); } }
                _ => if isl % 2 == 0 { active.remove_worker(w) } else {
                    active.expire_stale(t0 + Duration::from_secs(k as u64), Duration::from_secs(isl));
                },
            }
        }
        let mut want: Vec<(u64, u32)> = active
            .all()
            .into_iter()
            .map(|(w, l)| ((weights.key(&l) + 0.0).to_bits(), w.0))
            .collect();
        want.sort_unstable();
        let mut got = Vec::new();
        active.locked().walk_order(weights, |k, w, l| {
            got.push((k.to_bits(), w.0));
            assert_eq!(k, weights.key(&l));
            true
        });
        prop_assert_eq!(got, want);
    }
}

/// On a large idle-looking fleet the walk stops early: holders plus a few of the least loaded.
#[test]
fn a_large_fleet_visits_few_workers() {
    let now = Instant::now();
    let active = ActiveSequences::new();
    let mut guards = Vec::new();
    for w in 0..2048u32 {
        active.add_worker(WorkerId(w));
        // 1..=97 active blocks each.
        let h: Vec<u64> = (0..u64::from(w % 97 + 1))
            .map(|b| crate::select::mix(u64::from(w) << 20 | b))
            .collect();
        guards.push(active.add(WorkerId(w), 0, &h, 0, 0));
    }
    let mut index = KvIndex::new();
    let t = tokens(1, 8);
    let engine: Vec<u64> = (0..8).collect();
    for w in [5u32, 700, 1900] {
        index.set_mode(WorkerId(w), crate::IndexMode::Exact);
        index
            .apply_stored(WorkerId(w), None, &engine, &t, BS, BASE_SEED)
            .unwrap();
    }
    let h = block_hashes(&tokens(1, 10), BS, BASE_SEED);
    let req = RouteRequest {
        hashes: &h,
        isl_tokens: 40,
        block_size: BS as u32,
        affinity_key: None,
        hot: Default::default(),
    };
    let policy = KvPolicy::new(KvCostConfig::default(), BusyThresholds::default());
    let (mut scores, mut cands) = (OverlapScores::new(), Vec::new());
    let mut rng = fastrand::Rng::with_seed(1);
    let d = select_kv_bounded(
        &policy,
        &index,
        &active,
        &req,
        now,
        &mut scores,
        &mut cands,
        |_| true,
        &mut rng,
    )
    .unwrap();
    assert!(cands.len() < 64, "visited {} workers", cands.len());
    for w in [5u32, 700, 1900] {
        assert!(
            cands.iter().any(|c| c.worker == WorkerId(w)),
            "holder {w} visited"
        );
    }
    let extra = vec![Some((WorkerLoad::default(), true, None)); 2048];
    let (want, _) = exhaustive(
        &policy,
        &index,
        &active,
        &req,
        now,
        extra.len(),
        prepared(&extra),
        &mut rng,
    )
    .unwrap();
    assert_eq!(d.cost, want.cost);
}

/// `latency` on a large loaded fleet: the walk stops after the holders and a few of the workers
/// with the least pending prefill; every worker with a slower or equal floor stays unvisited.
#[test]
fn latency_on_a_large_fleet_visits_few_workers() {
    let now = Instant::now();
    let active = ActiveSequences::new();
    let mut guards = Vec::new();
    for w in 0..2048u32 {
        active.add_worker(WorkerId(w));
        // 100..=9,800 prompt tokens pending on each worker.
        let h = [crate::select::mix(u64::from(w))];
        guards.push(active.add(WorkerId(w), 0, &h, u64::from(w % 98 + 1) * 100, 0));
    }
    let mut index = KvIndex::new();
    let t = tokens(1, 8);
    let engine: Vec<u64> = (0..8).collect();
    for w in [5u32, 700, 1900] {
        index
            .apply_stored(WorkerId(w), None, &engine, &t, BS, BASE_SEED)
            .unwrap();
    }
    let h = block_hashes(&tokens(1, 10), BS, BASE_SEED);
    let req = RouteRequest {
        hashes: &h,
        isl_tokens: 40,
        block_size: BS as u32,
        affinity_key: None,
        hot: Default::default(),
    };
    let policy = LatencyPolicy::new(LatencyPolicyConfig::default(), BusyThresholds::default());
    let (mut scores, mut cands) = (OverlapScores::new(), Vec::new());
    let mut rng = fastrand::Rng::with_seed(1);
    let d = select_latency_bounded(
        &policy,
        &index,
        &active,
        &req,
        now,
        SpeedBounds::exactly(Speed::default()),
        &mut scores,
        &mut cands,
        |_| true,
        &mut rng,
    )
    .unwrap();
    assert!(cands.len() < 128, "visited {} workers", cands.len());
    for w in [5u32, 700, 1900] {
        assert!(cands.iter().any(|c| c.worker == WorkerId(w)));
    }
    let extra = vec![Some((WorkerLoad::default(), true, None)); 2048];
    let (want, _) = exhaustive(
        &policy,
        &index,
        &active,
        &req,
        now,
        extra.len(),
        prepared(&extra),
        &mut rng,
    )
    .unwrap();
    // 21 workers tie at the least pending prefill: the same cost (the pick among them is the
    // tie-break's).
    assert_eq!(d.cost, want.cost);
}

/// `latency` on a large fleet with nothing pending and 1 to 8 requests in flight on each worker
/// (the load the running requests' decode slowdown is about): the walk by in-flight requests stops
/// after the least loaded, where a walk by pending prefill alone would visit most of the fleet.
#[test]
fn latency_counts_the_running_requests() {
    let now = Instant::now();
    let active = ActiveSequences::new();
    let mut guards = Vec::new();
    for w in 0..2048u32 {
        active.add_worker(WorkerId(w));
        let running = 1 + crate::select::mix(u64::from(w)) % 8;
        for r in 0..running {
            let h = [crate::select::mix(u64::from(w) << 8 | r)];
            let g = active.add(WorkerId(w), 0, &h, 1000, 0);
            g.mark_prefill_done();
            guards.push(g);
        }
    }
    let index = KvIndex::new();
    let h = block_hashes(&tokens(1, 10), BS, BASE_SEED);
    let req = RouteRequest {
        hashes: &h,
        isl_tokens: 4096,
        block_size: BS as u32,
        affinity_key: None,
        hot: Default::default(),
    };
    let policy = LatencyPolicy::new(LatencyPolicyConfig::default(), BusyThresholds::default());
    let speed = |c: &mut Candidate| {
        c.speed = Speed {
            prefill: 0.8 + f64::from(c.worker.0 % 9) * 0.1,
            decode: 1.0,
        };
        true
    };
    let bounds = SpeedBounds {
        prefill_floor: 0.8,
        decode_ceiling: 1.0,
    };
    let (mut scores, mut cands) = (OverlapScores::new(), Vec::new());
    let mut rng = fastrand::Rng::with_seed(1);
    let d = select_latency_bounded(
        &policy,
        &index,
        &active,
        &req,
        now,
        bounds,
        &mut scores,
        &mut cands,
        speed,
        &mut rng,
    )
    .unwrap();
    let visited = cands.len();
    let ones = (0..2048u64)
        .filter(|&w| crate::select::mix(w) % 8 == 0)
        .count();
    assert!(
        visited <= ones + 8,
        "visited {visited} workers ({ones} with one request)"
    );
    let mut all: Vec<Candidate> = (0..2048).map(|w| Candidate::new(WorkerId(w))).collect();
    crate::score_candidates(&index, &active, req.hashes, now, &mut scores, &mut all);
    for c in &mut all {
        speed(c);
    }
    let want = policy.select(&req, &all, &mut rng).unwrap();
    assert_eq!(d.cost, want.cost);
    assert_eq!(d.worker, want.worker);
}
