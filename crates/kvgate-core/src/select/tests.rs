use super::*;
use crate::hash::{block_hashes, BASE_SEED};
use proptest::prelude::*;

fn req(hashes: &[u64], isl: u64) -> RouteRequest<'_> {
    RouteRequest {
        hashes,
        isl_tokens: isl,
        block_size: 16,
        affinity_key: None,
        hot: Default::default(),
    }
}

#[test]
fn a_pick_reports_how_likely_it_was() {
    let mut rng = fastrand::Rng::with_seed(7);
    // Argmin: a clear winner is certain; among k exact ties each is 1/k.
    let (i, share) = pick_with_share(3, |i| Some([2.0, 1.0, 3.0][i]), 0.0, &mut rng).unwrap();
    assert_eq!((i, share), (1, 1.0));
    let costs = [1.0, 5.0, 1.0, 1.0, 1.0];
    let (i, share) = pick_with_share(5, |i| Some(costs[i]), 0.0, &mut rng).unwrap();
    assert!(costs[i] == 1.0 && share == 0.25, "{i} {share}");
    // Temperature: the softmax probability of the pick, summing to 1 over the candidates.
    let costs = [0.0, 1.0, 2.0];
    let w: Vec<f64> = costs.iter().map(|c: &f64| (-c / 2.0).exp()).collect();
    let total: f64 = w.iter().sum();
    for _ in 0..20 {
        let (i, share) = pick_with_share(3, |i| Some(costs[i]), 1.0, &mut rng).unwrap();
        assert!((share - w[i] / total).abs() < 1e-12, "{i} {share}");
    }
}

#[test]
fn dynamo_log_check() {
    // ISL 296, block size 16, 12 blocks overlap, idle worker → (18.5 − 12) + 18 = 24.5; no overlap 36.5.
    let h = vec![0u64; 18];
    let r = req(&h, 296);
    let mut c = Candidate::new(WorkerId(0));
    c.new_blocks = 18;
    c.overlap_blocks = 12;
    // Dynamo's own weight is 1; kvgate's default is 4 (measured: see docs/routing.md §7).
    assert_eq!(KvCostConfig::default().prefill_weight, 4.0);
    let cfg = KvCostConfig {
        prefill_weight: 1.0,
        ..KvCostConfig::default()
    };
    assert_eq!(cfg.cost(&r, &c), 24.5);
    c.kv_scoring = false;
    assert_eq!(cfg.cost(&r, &c), 36.5);
    c.kv_scoring = true;
    c.overlap_blocks = 0;
    assert_eq!(cfg.cost(&r, &c), 36.5);
    // Pending prefill and in-flight weight.
    c.pending_prefill_tokens = 160;
    c.inflight = 3;
    c.active_blocks = 7;
    let cfg = KvCostConfig {
        prefill_weight: 2.0,
        request_weight: 0.5,
        ..cfg
    };
    assert_eq!(cfg.cost(&r, &c), 2.0 * (456.0 / 16.0) + 25.0 + 1.5);
    // pending_weight charges only a share of the in-flight prefill: 0.25 · 160 = 40 tokens.
    let quarter = KvCostConfig {
        pending_weight: 0.25,
        ..cfg
    };
    assert_eq!(quarter.cost(&r, &c), 2.0 * (336.0 / 16.0) + 25.0 + 1.5);
    // Overlap beyond the prompt cannot make prefill negative.
    c.pending_prefill_tokens = 0;
    c.overlap_blocks = 1000;
    assert_eq!(cfg.cost(&r, &c), 25.0 + 1.5);
}

#[test]
fn busy_filter_drops_busy_unless_all_busy() {
    let t = BusyThresholds {
        active_blocks: Some(10),
        kv_usage: Some(0.9),
        ..Default::default()
    };
    let mut a = Candidate::new(WorkerId(0));
    let mut b = Candidate::new(WorkerId(1));
    a.active_blocks = 11;
    assert!(is_busy(&a, &t) && !is_busy(&b, &t));
    // Stale scraped load (None) never makes a worker busy; fresh does.
    b.scraped = Some(ScrapedLoad {
        kv_usage: 0.95,
        waiting: 0,
        running: 1,
    });
    assert!(is_busy(&b, &t));
    assert!(all_busy(&[a, b], &t));
    let el = Eligibility::new(&[a, b], &t);
    assert!(el.ok(&a) && el.ok(&b));
    b.scraped = None;
    let el = Eligibility::new(&[a, b], &t);
    assert!(!el.ok(&a) && el.ok(&b));
    assert_eq!(el.count(&[a, b]), 1);
    assert!(all_busy(&[], &t));
    assert!(!all_busy(&[a], &BusyThresholds::default()));
}

#[test]
fn decision_hit_ratio() {
    let h = [1u64, 2, 3];
    let mut c = Candidate::new(WorkerId(3));
    c.overlap_blocks = 2;
    let d = Decision::for_candidate(&req(&h, 50), &c, 1.0);
    assert_eq!(d.predicted_hit_ratio, 32.0 / 50.0);
    assert_eq!(
        Decision::for_candidate(&req(&h, 0), &c, 1.0).predicted_hit_ratio,
        0.0
    );
}

#[test]
fn score_candidates_fills_everything() {
    let idx_tokens: Vec<u32> = (0..64).collect();
    let h = block_hashes(&idx_tokens, 16, BASE_SEED);
    let mut index = KvIndex::new();
    index
        .apply_stored(
            WorkerId(1),
            None,
            &[1, 2, 3],
            &idx_tokens[..48],
            16,
            BASE_SEED,
        )
        .unwrap();
    let active = ActiveSequences::new();
    let _g = active.add(WorkerId(0), 1, &h[..2], 32, 0);
    let mut scores = OverlapScores::new();
    let mut c = [Candidate::new(WorkerId(0)), Candidate::new(WorkerId(1))];
    score_candidates(&index, &active, &h, Instant::now(), &mut scores, &mut c);
    assert_eq!(
        (c[0].overlap_blocks, c[0].active_blocks, c[0].new_blocks),
        (0, 2, 2)
    );
    assert_eq!(
        (c[1].overlap_blocks, c[1].active_blocks, c[1].new_blocks),
        (3, 0, 4)
    );
    // kv cost (default prefill_weight 4): w0 = 4 · 96/16 + 4 = 28 ; w1 = 4 · (4 − 3) + 4 = 8 → w1.
    let r = req(&h, 64);
    let cfg = KvCostConfig::default();
    assert_eq!((cfg.cost(&r, &c[0]), cfg.cost(&r, &c[1])), (28.0, 8.0));
}

#[test]
fn pick_edge_cases() {
    let mut rng = fastrand::Rng::with_seed(1);
    assert_eq!(pick_by_cost(&[], 0.0, &mut rng), None);
    assert_eq!(pick_by_cost(&[f64::NAN, 3.0], 0.0, &mut rng), Some(1));
    assert_eq!(pick_by_cost(&[f64::INFINITY, 3.0], 1.0, &mut rng), Some(1));
    assert_eq!(pick_with(3, |_| None, 0.5, &mut rng), None);
    assert_eq!(
        pick_with(3, |i| (i == 2).then_some(9.0), 0.5, &mut rng),
        Some(2)
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn temperature_zero_picks_an_argmin(costs in prop::collection::vec(0u32..20, 1..40), seed: u64) {
        let costs: Vec<f64> = costs.into_iter().map(f64::from).collect();
        let mut rng = fastrand::Rng::with_seed(seed);
        let i = pick_by_cost(&costs, 0.0, &mut rng).unwrap();
        let min = costs.iter().cloned().fold(f64::INFINITY, f64::min);
        prop_assert_eq!(costs[i], min);
    }
}

// Sampling tests draw thousands of picks per case: fewer cases keep the suite fast.
proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn ties_spread_uniformly(ties in 2usize..6, others in 0usize..4, seed: u64) {
        // `ties` workers share the minimum; each should get 1/ties of 6000 picks (within 5σ).
        let mut costs = vec![1.0; ties];
        costs.extend(std::iter::repeat_n(2.0, others));
        let mut rng = fastrand::Rng::with_seed(seed);
        let n = 6000;
        let mut hits = vec![0u32; costs.len()];
        for _ in 0..n { hits[pick_by_cost(&costs, 0.0, &mut rng).unwrap()] += 1; }
        let p = 1.0 / ties as f64;
        let sigma = (n as f64 * p * (1.0 - p)).sqrt();
        for (i, &h) in hits.iter().enumerate() {
            if i < ties {
                prop_assert!((f64::from(h) - n as f64 * p).abs() < 5.0 * sigma, "{hits:?}");
            } else {
                prop_assert_eq!(h, 0);
            }
        }
    }

    #[test]
    fn softmax_frequencies(costs in prop::collection::vec(0.0f64..50.0, 2..6), t in 0.1f64..3.0, seed: u64) {
        let min = costs.iter().cloned().fold(f64::INFINITY, f64::min);
        let max = costs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        prop_assume!(max - min > 1e-6);
        let w: Vec<f64> = costs.iter().map(|c| (-(c - min) / ((max - min) * t)).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut rng = fastrand::Rng::with_seed(seed);
        let n = 8000;
        let mut hits = vec![0u32; costs.len()];
        for _ in 0..n { hits[pick_by_cost(&costs, t, &mut rng).unwrap()] += 1; }
        for (i, &h) in hits.iter().enumerate() {
            let p = w[i] / total;
            let sigma = (n as f64 * p * (1.0 - p)).sqrt().max(1.0);
            prop_assert!((f64::from(h) - n as f64 * p).abs() < 5.0 * sigma, "i={i} p={p} hits={hits:?}");
        }
    }

    #[test]
    fn equal_costs_with_temperature_are_uniform(k in 2usize..6, t in 0.1f64..3.0, seed: u64) {
        let costs = vec![4.0; k];
        let mut rng = fastrand::Rng::with_seed(seed);
        let n = 6000;
        let mut hits = vec![0u32; k];
        for _ in 0..n { hits[pick_by_cost(&costs, t, &mut rng).unwrap()] += 1; }
        let p = 1.0 / k as f64;
        let sigma = (n as f64 * p * (1.0 - p)).sqrt();
        for &h in &hits { prop_assert!((f64::from(h) - n as f64 * p).abs() < 5.0 * sigma); }
    }
}

#[test]
fn pending_weight_keeps_a_long_prefix_through_a_burst() {
    // Mooncake req828-like case: 1904-token prompt, 108 blocks cached on A, which has a 4412-token
    // prompt of the same arrival burst in prefill; B holds only the common first 4 blocks.
    let h = vec![0u64; 119];
    let r = req(&h, 1904);
    let mut a = Candidate::new(WorkerId(0));
    a.overlap_blocks = 108;
    a.pending_prefill_tokens = 4412;
    let mut b = Candidate::new(WorkerId(1));
    b.overlap_blocks = 4;
    let pick = |cfg: KvCostConfig| {
        let costs = [cfg.cost(&r, &a), cfg.cost(&r, &b)];
        pick_by_cost(&costs, 0.0, &mut fastrand::Rng::with_seed(1))
    };
    // With the whole pending prefill charged, no prefill_weight keeps the prefix: it scales both.
    for pw in [1.0, 8.0, 1000.0] {
        let cfg = KvCostConfig {
            prefill_weight: pw,
            ..KvCostConfig::default()
        };
        assert_eq!(pick(cfg), Some(1), "prefill_weight {pw}");
    }
    let cfg = KvCostConfig {
        prefill_weight: 8.0,
        pending_weight: 0.25,
        ..KvCostConfig::default()
    };
    assert_eq!(pick(cfg), Some(0));
}

/// Four idle workers: every one equally cheap for a new prompt.
fn idle_fleet(stable: [u64; 4]) -> Vec<Candidate> {
    (0..4)
        .map(|i| {
            let mut c = Candidate::new(WorkerId(i));
            c.stable_id = stable[i as usize];
            c
        })
        .collect()
}

fn kv_pick(r: &RouteRequest<'_>, cands: &[Candidate], rng: &mut fastrand::Rng) -> (u64, f64) {
    let cfg = KvCostConfig::default();
    let (i, share) =
        pick_for_request(r, cands, |i| Some(cfg.cost(r, &cands[i])), 0.0, rng).unwrap();
    (cands[i].stable_id, share)
}

#[test]
fn replicas_break_a_tie_on_a_new_prefix_the_same_way() {
    let stable = [11, 22, 33, 44];
    let hashes = [7u64, 8, 9];
    let r = req(&hashes, 48);
    // Replicas with their own random state and their own worker ids (another order) agree. The
    // share stays 1/4: a peer's request with another prompt would land on any of the four.
    let a = kv_pick(&r, &idle_fleet(stable), &mut fastrand::Rng::with_seed(1));
    let mut other = idle_fleet(stable);
    other.reverse();
    for (i, c) in other.iter_mut().enumerate() {
        c.worker = WorkerId(i as u32);
    }
    for seed in 2..20 {
        assert_eq!(kv_pick(&r, &other, &mut fastrand::Rng::with_seed(seed)), a);
    }
    assert_eq!(a.1, 0.25);
    // The next request of the same new prefix (another suffix) opens the same worker.
    let next = [7u64, 8, 10];
    let b = kv_pick(
        &req(&next, 48),
        &idle_fleet(stable),
        &mut fastrand::Rng::with_seed(5),
    );
    assert_eq!(b, a);
}

#[test]
fn ties_key_on_the_first_block_no_tied_worker_holds() {
    // Every worker holds a 2-block system prompt: requests that differ after it spread over the
    // workers (their keys differ); without the overlap they would all share hashes[0]'s pick.
    let mut cands = idle_fleet([1, 2, 3, 4]);
    for c in &mut cands {
        c.overlap_blocks = 2;
    }
    let mut seen = std::collections::HashSet::new();
    for k in 0..64u64 {
        let hashes = [100, 200, mix(k), mix(k + 1000)];
        let (w, share) = kv_pick(&req(&hashes, 64), &cands, &mut fastrand::Rng::with_seed(k));
        assert_eq!(share, 0.25);
        seen.insert(w);
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    // A prompt every tied worker holds whole (or shorter than a block) has no key: at random.
    let hashes = [100u64, 200];
    let mut seen = std::collections::HashSet::new();
    for seed in 0..64 {
        let (w, share) = kv_pick(
            &req(&hashes, 32),
            &cands,
            &mut fastrand::Rng::with_seed(seed),
        );
        assert_eq!(share, 0.25);
        seen.insert(w);
    }
    assert_eq!(seen.len(), 4);
    // A clear winner is not a tie.
    cands[2].overlap_blocks = 4;
    let hashes = [100u64, 200, 300, 400, 500];
    assert_eq!(
        kv_pick(&req(&hashes, 80), &cands, &mut fastrand::Rng::with_seed(0)),
        (3, 1.0)
    );
}

#[test]
fn queue_time_charges_the_predicted_start_wait_as_prefill_blocks() {
    use crate::latency::{EngineSlots, LatencyConfig, Speed, TimingCurve};
    let h = vec![0u64; 20];
    let r = req(&h, 320);
    // The holder: 18 of 20 blocks cached, but a full KV cache (1000 of 1024 blocks held by 4
    // requests) whose requests take 400 ms: the first end is a whole request time away.
    let mut holder = Candidate::new(WorkerId(0));
    holder.overlap_blocks = 18;
    holder.new_blocks = 20;
    holder.active_blocks = 1000;
    holder.inflight = 4;
    holder.kv_capacity_blocks = 1024;
    holder.slots = EngineSlots {
        limit: 0,
        service_ms: 400.0,
        output_tokens: 16.0,
    };
    // An idle worker without the prefix.
    let mut idle = Candidate::new(WorkerId(1));
    idle.new_blocks = 20;
    idle.kv_capacity_blocks = 1024;
    let plain = KvCostConfig::default();
    let lat = LatencyConfig::default();
    let timed = KvCostConfig {
        queue_time: Some(lat),
        ..plain
    };
    // Off by default.
    assert_eq!(KvCostConfig::default().queue_time, None);
    let wait = lat.start_wait_ms(&r, &holder);
    assert_eq!(wait, 400.0, "a full cache: one whole request time");
    // 400 ms over 0.01518344 ms/token · 16 tokens ≈ 1646.5 blocks, times prefill_weight 4.
    let per_block = TimingCurve::default().prefill[1] * 16.0;
    let extra = 4.0 * 400.0 / per_block;
    assert!((timed.cost(&r, &holder) - plain.cost(&r, &holder) - extra).abs() < 1e-6);
    // No wait predicted: the same cost as without the term.
    assert_eq!(timed.cost(&r, &idle), plain.cost(&r, &idle));
    // A slower prefill makes the same wait fewer blocks (the blocks it would recompute take
    // longer there).
    holder.speed = Speed {
        prefill: 2.0,
        decode: 1.0,
    };
    assert!((timed.cost(&r, &holder) - plain.cost(&r, &holder) - extra / 2.0).abs() < 1e-6);
    holder.speed = Speed::default();

    // Where it decides: a holder with a light decode load but a full cache (few, long requests).
    // By blocks it wins (cached 18 blocks · 4 outweigh the active difference); by time it loses.
    holder.active_blocks = 1010;
    holder.inflight = 1;
    idle.active_blocks = 1000;
    idle.inflight = 1;
    idle.slots = holder.slots;
    idle.kv_capacity_blocks = 4096;
    let mut rng = fastrand::Rng::with_seed(1);
    let cands = [holder, idle];
    let pick = |cfg: &KvCostConfig, rng: &mut fastrand::Rng| {
        pick_by_cost(
            &[cfg.cost(&r, &cands[0]), cfg.cost(&r, &cands[1])],
            0.0,
            rng,
        )
    };
    assert_eq!(pick(&plain, &mut rng), Some(0));
    assert_eq!(pick(&timed, &mut rng), Some(1));
    // A curve without a per-token term gives no exchange rate: no term.
    let flat = KvCostConfig {
        queue_time: Some(LatencyConfig {
            curve: TimingCurve {
                prefill: [0.0, 0.0, 16.5],
                ..TimingCurve::default()
            },
            ..lat
        }),
        ..plain
    };
    assert_eq!(flat.cost(&r, &cands[0]), plain.cost(&r, &cands[0]));
}

#[test]
fn step_wait_charges_the_step_in_progress_and_a_longer_decode_step() {
    use crate::latency::{LatencyConfig, Speed};
    use crate::select::ScrapedLoad;
    // A 12-block prompt (192 tokens + 8): the holder has 10 blocks cached but 4 requests in
    // flight at 40 % KV usage; the other worker is idle with nothing cached.
    let h = vec![0u64; 12];
    let r = req(&h, 200);
    let mut holder = Candidate::new(WorkerId(0));
    holder.overlap_blocks = 10;
    holder.new_blocks = 2;
    holder.active_blocks = 400;
    holder.inflight = 4;
    holder.scraped = Some(ScrapedLoad {
        kv_usage: 0.4,
        waiting: 0,
        running: 4,
    });
    let mut idle = Candidate::new(WorkerId(1));
    idle.new_blocks = 12;
    let lat = LatencyConfig::default();
    let plain = KvCostConfig {
        queue_time: Some(lat),
        ..KvCostConfig::default()
    };
    let stepped = KvCostConfig {
        step_wait: true,
        ..plain
    };
    // Off by default; no waits of any kind predicted here, so queue_time alone adds nothing.
    assert!(!KvCostConfig::default().step_wait);
    assert_eq!(
        plain.cost(&r, &holder),
        KvCostConfig::default().cost(&r, &holder)
    );
    // The wait is the latency estimate minus its prefill part.
    let e = lat.estimate(&r, &holder);
    let unseen = lat.unseen_wait_ms(&r, &holder, true);
    let prefill = holder.speed.prefill * e.prefill_ms;
    assert!(
        (unseen - (e.predicted_ms - prefill)).abs() < 1e-9,
        "{unseen} vs {e:?}"
    );
    let step = lat.curve.decode_ms(f64::from(0.4f32));
    assert!((unseen - (0.5 * step + (step - prefill).max(0.0))).abs() < 1e-9);
    assert!(unseen > 0.0);
    // In blocks: the wait over the curve's ms per block, times prefill_weight.
    let per_block = lat.curve.prefill[1] * 16.0;
    let extra = 4.0 * unseen / per_block;
    assert!((stepped.cost(&r, &holder) - plain.cost(&r, &holder) - extra).abs() < 1e-6);
    // An idle worker has no step in progress: nothing added.
    assert_eq!(stepped.cost(&r, &idle), plain.cost(&r, &idle));
    // The decision it changes: a holder with few active blocks. By blocks it stays (4 · 10
    // cached blocks outweigh its 40 active ones); by time the idle worker wins (the step in
    // progress and a decode step longer than the 2-block prefill cost more than recomputing
    // 10 blocks).
    let mut light = [holder, idle];
    light[0].active_blocks = 40;
    let pick = |cfg: &KvCostConfig| {
        pick_by_cost(
            &[cfg.cost(&r, &light[0]), cfg.cost(&r, &light[1])],
            0.0,
            &mut fastrand::Rng::with_seed(3),
        )
    };
    assert_eq!(pick(&plain), Some(0));
    assert_eq!(pick(&stepped), Some(1));
    // A faster decode (half the step) halves the step part.
    let mut fast = holder;
    fast.speed = Speed {
        prefill: 1.0,
        decode: 0.5,
    };
    let half = lat.unseen_wait_ms(&r, &fast, true);
    let s2 = 0.5 * step;
    assert!((half - (0.5 * s2 + (s2 - prefill).max(0.0))).abs() < 1e-9);
}

/// The replication term: a worker without the hot prefix is waived
/// `min(1, replicate · max(0, k − w)/(k + 1))` of its uncached hot blocks (k requests on w workers
/// hold the prefix); holders, a cold prefix, users no more than replicas and `replicate = 0`
/// change nothing.
#[test]
fn replication_waives_a_share_of_the_hot_prefix_on_workers_without_it() {
    let h = vec![0u64; 20];
    let mut r = req(&h, 320);
    let mut cold = Candidate::new(WorkerId(0));
    cold.new_blocks = 20;
    let mut holder = Candidate::new(WorkerId(1));
    holder.overlap_blocks = 12;
    holder.new_blocks = 8;
    holder.active_blocks = 40;
    let mut partial = Candidate::new(WorkerId(2));
    partial.overlap_blocks = 4;
    partial.new_blocks = 20;
    let off = KvCostConfig::default();
    let on = |replicate| KvCostConfig {
        replicate,
        ..KvCostConfig::default()
    };
    // Nothing in flight: no term.
    for c in [&cold, &holder, &partial] {
        assert_eq!(on(1.0).cost(&r, c), off.cost(&r, c));
    }
    // As many users as replicas: nothing to relieve.
    r.hot = HotPrefix {
        blocks: 12,
        holders: 2,
        workers: 2,
        ..HotPrefix::default()
    };
    assert_eq!(r.hot.waiver(), 0.0);
    assert_eq!(on(1.0).cost(&r, &cold), off.cost(&r, &cold));
    // 12 blocks hot, seven requests on three workers hold them: ½ of each uncached hot block.
    r.hot = HotPrefix {
        blocks: 12,
        holders: 7,
        workers: 3,
        ..HotPrefix::default()
    };
    assert_eq!(r.hot.waiver(), 0.5);
    // The fleet's mean load is what a replica may carry: below one request per worker it is one
    // (the same half), at two per worker the three replicas carry six of the seven (1/8), at
    // three per worker the prefix is no busier than any worker (nothing).
    for ((requests, workers), share) in [((7, 8), 0.5), ((16, 8), 0.125), ((24, 8), 0.0)] {
        let fleet = HotPrefix {
            fleet_requests: requests,
            fleet_workers: workers,
            ..r.hot
        };
        assert_eq!(
            fleet.waiver(),
            share,
            "{requests} requests on {workers} workers"
        );
    }
    assert_eq!(on(1.0).cost(&r, &holder), off.cost(&r, &holder));
    assert_eq!(off.cost(&r, &cold), 4.0 * 20.0 + 20.0);
    assert_eq!(on(1.0).cost(&r, &cold), 4.0 * (20.0 - 6.0) + 20.0);
    assert_eq!(on(0.5).cost(&r, &cold), 4.0 * (20.0 - 3.0) + 20.0);
    assert_eq!(on(1.0).cost(&r, &partial), 4.0 * (16.0 - 4.0) + 20.0);
    // `replicate` above 1 scales the share up to the whole hot part, never past it.
    assert_eq!(on(1.5).cost(&r, &cold), 4.0 * (20.0 - 9.0) + 20.0);
    assert_eq!(on(3.0).cost(&r, &cold), 4.0 * (20.0 - 12.0) + 20.0);
    assert_eq!(on(30.0).cost(&r, &cold), on(3.0).cost(&r, &cold));
    // Cold worker vs the loaded holder: off, the holder wins; fully on, the cold one does.
    assert!(off.cost(&r, &holder) < off.cost(&r, &cold));
    assert!(on(3.0).cost(&r, &cold) < on(3.0).cost(&r, &holder));
    // A worker that does not score overlap is cold, whatever the index says.
    let mut blind = holder;
    blind.kv_scoring = false;
    assert_eq!(on(1.0).cost(&r, &blind), 4.0 * (20.0 - 6.0) + 48.0);
}
