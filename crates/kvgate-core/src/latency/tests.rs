use super::*;
use crate::select::ScrapedLoad;

/// A random request/worker situation, its estimate at speed 1, and the "true" TTFT and ITL on a
/// worker of speed `truth`: the curve's shape, a uniform (not average) wait for the step in
/// progress, and ±10% log-normal-ish noise.
fn situation(rng: &mut fastrand::Rng, truth: Speed) -> (TtftEstimate, f64, f64) {
    let cfg = LatencyConfig::default();
    let mut c = Candidate::new(WorkerId(0));
    c.inflight = rng.u32(0..8);
    c.pending_prefill_tokens = if c.inflight > 0 { rng.u64(0..4000) } else { 0 };
    c.overlap_blocks = rng.u32(0..200);
    c.scraped = Some(ScrapedLoad {
        kv_usage: rng.f32() * 0.9,
        waiting: 0,
        running: c.inflight,
    });
    let req = plain_req(u64::from(c.overlap_blocks) * 16 + rng.u64(16..4000));
    let e = cfg.estimate(&req, &c);
    let noise = |rng: &mut fastrand::Rng| (0.2 * (rng.f64() - 0.5)).exp();
    let step = truth.decode * e.step_ms;
    let ttft = (rng.f64() * step + (truth.prefill * e.prefill_ms).max(step)) * noise(rng);
    let itl = truth.decode * e.itl_ref_ms * noise(rng);
    (e, ttft, itl)
}

/// A request of `isl` tokens in blocks of 16, without block hashes (the estimate reads only its
/// length and the candidate's overlap).
fn plain_req(isl: u64) -> RouteRequest<'static> {
    RouteRequest {
        hashes: &[],
        isl_tokens: isl,
        block_size: 16,
        affinity_key: None,
        hot: Default::default(),
    }
}

fn predicted(m: &LatencyModel, w: WorkerId, e: &TtftEstimate) -> f64 {
    e.at_speed(m.speed(w))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Feeds `n` observations from a worker of speed `truth`; returns the relative errors of the
/// predictions made just before each observation.
fn feed(m: &mut LatencyModel, rng: &mut fastrand::Rng, truth: Speed, n: usize) -> Vec<f64> {
    let w = WorkerId(0);
    (0..n)
        .map(|_| {
            let (e, ttft, itl) = situation(rng, truth);
            let err = (predicted(m, w, &e) - ttft).abs() / ttft;
            m.observe_ttft(w, &e, ttft);
            m.observe_itl(w, &e, itl);
            err
        })
        .collect()
}

#[test]
fn curve_is_the_sims_default() {
    let c = TimingCurve::default();
    assert!((c.prefill_ms(1000.0) - (4.209989e-7 * 1e6 + 15.18344 + 16.50142)).abs() < 1e-9);
    assert!((c.decode_ms(0.5) - (-25.74 * 0.25 + 27.005 + 5.74)).abs() < 1e-9);
    assert_eq!(c.decode_ms(-3.0), c.decode_ms(0.0));
}

#[test]
fn converges_from_the_seed_to_a_slower_worker_within_200_observations() {
    let mut rng = fastrand::Rng::with_seed(11);
    let truth = Speed {
        prefill: 2.0,
        decode: 1.5,
    };
    let mut m = LatencyModel::new(LearnConfig::default());
    m.add_worker(WorkerId(0), Speed::default());
    let early = feed(&mut m, &mut rng, truth, 200);
    let late = feed(&mut m, &mut rng, truth, 200);
    // Seeded at the reference speed, the first predictions are far off ...
    assert!(median(early[..10].to_vec()) > 0.3, "{early:?}");
    // ... after 200 observations the median error is within 20%.
    let med = median(late);
    assert!(med <= 0.2, "median relative error {med}");
    let s = m.speed(WorkerId(0));
    assert!((s.prefill / 2.0 - 1.0).abs() < 0.15, "{s:?}");
    assert!((s.decode / 1.5 - 1.0).abs() < 0.15, "{s:?}");
}

#[test]
fn a_2x_slowdown_is_picked_up_within_50_observations() {
    let mut rng = fastrand::Rng::with_seed(12);
    let mut m = LatencyModel::new(LearnConfig::default());
    m.add_worker(WorkerId(0), Speed::default());
    feed(&mut m, &mut rng, Speed::default(), 200);
    let before = m.speed(WorkerId(0));
    assert!((before.prefill - 1.0).abs() < 0.15, "{before:?}");
    feed(&mut m, &mut rng, Speed::uniform(2.0), 50);
    let after = m.speed(WorkerId(0));
    assert!(after.prefill > 1.7 && after.decode > 1.7, "{after:?}");
    // And the errors are back within 20% right after.
    let med = median(feed(&mut m, &mut rng, Speed::uniform(2.0), 50));
    assert!(med <= 0.2, "{med}");
}

#[test]
fn outliers_do_not_swing_it() {
    let mut rng = fastrand::Rng::with_seed(13);
    let mut m = LatencyModel::new(LearnConfig::default());
    m.add_worker(WorkerId(0), Speed::default());
    feed(&mut m, &mut rng, Speed::default(), 200);
    let before = m.speed(WorkerId(0));
    // One request 10× slower (a GC pause, a retransmit) and one 10× faster.
    let (e, ttft, itl) = situation(&mut rng, Speed::default());
    m.observe_ttft(WorkerId(0), &e, 10.0 * ttft);
    m.observe_itl(WorkerId(0), &e, 10.0 * itl);
    let after = m.speed(WorkerId(0));
    // (≤ two clipped steps of 0.1 × the clip each: a few percent.)
    assert!(
        after.prefill / before.prefill < 1.08,
        "{before:?} {after:?}"
    );
    assert!(after.decode / before.decode < 1.08, "{before:?} {after:?}");
    // A steady 10% of 10× outliers in the stream bias it by little.
    for i in 0..300 {
        let (e, mut ttft, mut itl) = situation(&mut rng, Speed::default());
        if i % 10 == 0 {
            ttft *= 10.0;
            itl *= 10.0;
        }
        m.observe_ttft(WorkerId(0), &e, ttft);
        m.observe_itl(WorkerId(0), &e, itl);
    }
    let s = m.speed(WorkerId(0));
    assert!(s.prefill < 1.2 && s.decode < 1.2, "{s:?}");
    // Nonsense observations are ignored.
    let before = m.speed(WorkerId(0));
    m.observe_ttft(WorkerId(0), &e, f64::NAN);
    m.observe_ttft(WorkerId(0), &e, -1.0);
    m.observe_itl(WorkerId(0), &e, 0.0);
    assert_eq!(m.speed(WorkerId(0)), before);
}

#[test]
fn workers_learn_separately_and_are_seeded_by_kind() {
    let mut rng = fastrand::Rng::with_seed(14);
    // (Without relaxation: worker 3, never observed, would drift to the fleet's consensus.)
    let mut m = LatencyModel::new(LearnConfig {
        relax_after: 0,
        ..LearnConfig::default()
    });
    m.add_worker(WorkerId(0), Speed::default());
    m.add_worker(WorkerId(3), Speed::uniform(10.0));
    let near = |a: Speed, b: Speed| {
        (a.prefill - b.prefill).abs() < 1e-9 && (a.decode - b.decode).abs() < 1e-9
    };
    assert!(near(m.speed(WorkerId(3)), Speed::uniform(10.0)));
    assert_eq!(m.speed(WorkerId(7)), Speed::default()); // unknown
    feed(&mut m, &mut rng, Speed::uniform(3.0), 100);
    assert!(m.speed(WorkerId(0)).prefill > 2.5);
    assert!((m.speed(WorkerId(3)).prefill - 10.0).abs() < 1e-9);
    let mut c = vec![Candidate::new(WorkerId(0)), Candidate::new(WorkerId(3))];
    m.fill(&mut c);
    assert!(near(c[1].speed, Speed::uniform(10.0)));
    assert_eq!(c[0].speed, m.speed(WorkerId(0)));
    let curve = TimingCurve::default();
    let tps = m.prefill_tokens_per_second(&curve, WorkerId(3), 1024.0);
    assert!((tps - 1024.0 * 1000.0 / (10.0 * curve.prefill_ms(1024.0))).abs() < 1e-6);
    m.remove_worker(WorkerId(3));
    assert!(m.fit(WorkerId(3)).is_none());
    assert_eq!(m.workers().count(), 1);
}

#[test]
fn estimate_counts_the_queue_the_cache_and_the_decode_step() {
    let cfg = LatencyConfig::default();
    let curve = cfg.curve;
    let req = plain_req(1000);
    // Idle, nothing cached: the prefill of the whole prompt.
    let idle = Candidate::new(WorkerId(0));
    let e = cfg.estimate(&req, &idle);
    assert!((e.predicted_ms - curve.prefill_ms(1000.0)).abs() < 1e-9);
    assert_eq!(cfg.inflicted_ms(&e, &idle), 0.0);
    // 50 blocks cached: 200 tokens left.
    let mut cached = idle;
    cached.overlap_blocks = 50;
    assert!((cfg.estimate(&req, &cached).predicted_ms - curve.prefill_ms(200.0)).abs() < 1e-9);
    // A fully cached prompt still computes its last token.
    cached.overlap_blocks = 100;
    assert!((cfg.estimate(&req, &cached).uncached_tokens - 1.0).abs() < 1e-9);
    // Busy: queue ahead, half a decode step of wait, the step at KV usage 0.5 at least.
    let mut busy = idle;
    busy.inflight = 3;
    busy.pending_prefill_tokens = 3000;
    busy.scraped = Some(ScrapedLoad {
        kv_usage: 0.5,
        waiting: 0,
        running: 3,
    });
    let e = cfg.estimate(&req, &busy);
    let step = curve.decode_ms(0.5);
    let want = 0.5 * step + curve.prefill_ms(4000.0).max(step);
    assert!((e.predicted_ms - want).abs() < 1e-9);
    let inflicted = 3.0 * (curve.prefill_ms(1000.0) - step).max(0.0);
    assert!((cfg.inflicted_ms(&e, &busy) - inflicted).abs() < 1e-9);
    // Twice as slow: twice the time.
    busy.speed = Speed::uniform(2.0);
    assert!((cfg.estimate(&req, &busy).predicted_ms - 2.0 * want).abs() < 1e-9);
}

#[test]
fn engine_slots_are_learned_from_saturated_scrapes_and_request_ends() {
    let mut m = LatencyModel::new(LearnConfig::default());
    let w = WorkerId(3);
    m.add_worker(w, Speed::default());
    // Running without waiting says nothing about the limit.
    m.observe_engine(w, 5, 0);
    assert_eq!(m.fit(w).unwrap().slots().limit, 0);
    // One scrape with a queue is not saturation: a request can wait for the next scheduler step
    // (or behind a full token budget) while slots are free.
    m.observe_engine(w, 2, 1);
    m.observe_engine(w, 3, 0);
    m.observe_engine(w, 1, 2);
    m.observe_engine(w, 3, 0);
    assert_eq!(m.fit(w).unwrap().slots().limit, 0);
    // Running while others wait in two scrapes in a row: the smaller running count is the limit.
    m.observe_engine(w, 5, 3);
    assert_eq!(m.fit(w).unwrap().slots().limit, 0);
    m.observe_engine(w, 4, 3);
    assert_eq!(m.fit(w).unwrap().slots().limit, 4);
    // A smaller saturated moment (KV cache full) does not lower it; running past it raises it.
    m.observe_engine(w, 2, 1);
    m.observe_engine(w, 2, 1);
    assert_eq!(m.fit(w).unwrap().slots().limit, 4);
    m.observe_engine(w, 6, 0);
    assert_eq!(m.fit(w).unwrap().slots().limit, 6);
    // Service time: the first end sets it, later ones move it by the learning rate.
    m.observe_done(w, 1000.0);
    assert_eq!(m.fit(w).unwrap().slots().service_ms, 1000.0);
    m.observe_done(w, 2000.0);
    let s = m.fit(w).unwrap().slots();
    assert!((s.service_ms - 1100.0).abs() < 1e-9, "{s:?}");
    // The candidate sees it; below the limit no wait, at it one end's worth, beyond it more.
    let mut c = [Candidate::new(w)];
    m.fill(&mut c);
    assert_eq!(c[0].slots, s);
    assert_eq!(s.wait_ms(5), 0.0);
    assert!((s.wait_ms(6) - 1100.0 / 7.0).abs() < 1e-9);
    assert!((s.wait_ms(8) - 3.0 * 1100.0 / 7.0).abs() < 1e-9);
    assert_eq!(EngineSlots::UNKNOWN.wait_ms(100), 0.0);
}

#[test]
fn kv_wait_counts_the_ends_that_free_enough_blocks() {
    let s = EngineSlots {
        limit: 0,
        service_ms: 1000.0,
        output_tokens: 0.0,
    };
    // Fits, or nothing known: no wait.
    assert_eq!(s.kv_wait_ms(4, 900, 124, 1024, 0), 0.0);
    assert_eq!(s.kv_wait_ms(4, 1000, 100, 0, 0), 0.0);
    assert_eq!(s.kv_wait_ms(0, 0, 2000, 1024, 0), 0.0);
    assert_eq!(EngineSlots::UNKNOWN.kv_wait_ms(4, 1000, 100, 1024, 0), 0.0);
    // 4 requests hold 1000 blocks (250 each): 76 blocks short is one end away (a whole request
    // time: they may all have just started), 376 two (the next a fifth of it later), and never
    // more than every request in flight.
    assert!((s.kv_wait_ms(4, 1000, 100, 1024, 0) - 1000.0).abs() < 1e-9);
    assert!((s.kv_wait_ms(4, 1000, 400, 1024, 0) - 1200.0).abs() < 1e-9);
    assert!((s.kv_wait_ms(4, 1000, 9000, 1024, 0) - 1600.0).abs() < 1e-9);
    // What fits exactly does not once the five requests grow (output, partial blocks).
    assert_eq!(s.kv_wait_ms(4, 900, 114, 1024, 2), 0.0);
    assert!(s.kv_wait_ms(4, 900, 124, 1024, 1) > 0.0);
    // Growth: the partial prompt block plus the mean output (32 tokens = 2 blocks of 16).
    assert_eq!(s.growth_blocks(16), 1);
    let s32 = EngineSlots {
        output_tokens: 32.0,
        ..s
    };
    assert_eq!(s32.growth_blocks(16), 3);
    assert_eq!(
        EngineSlots {
            output_tokens: 33.0,
            ..s
        }
        .growth_blocks(16),
        4
    );
    // The estimate takes the longer of the slot and KV waits, and only when asked to.
    let mut c = Candidate::new(WorkerId(0));
    (
        c.inflight,
        c.active_blocks,
        c.new_blocks,
        c.kv_capacity_blocks,
    ) = (4, 995, 100, 1024);
    c.slots = EngineSlots {
        limit: 4,
        service_ms: 1000.0,
        output_tokens: 0.0,
    };
    let req = plain_req(1600);
    let on = LatencyConfig::default();
    assert!((on.estimate(&req, &c).slot_wait_ms - 1000.0).abs() < 1e-9);
    c.new_blocks = 400;
    assert!((on.estimate(&req, &c).slot_wait_ms - 1200.0).abs() < 1e-9);
    let off = LatencyConfig {
        kv_wait: false,
        ..on
    };
    assert!((off.estimate(&req, &c).slot_wait_ms - 1000.0 / 5.0).abs() < 1e-9);
}

#[test]
fn mean_output_is_learned_per_worker() {
    let mut m = LatencyModel::new(LearnConfig::default());
    let w = WorkerId(1);
    m.add_worker(w, Speed::default());
    assert_eq!(m.fit(w).unwrap().slots().output_tokens, 0.0);
    m.observe_output(w, 100);
    assert_eq!(m.fit(w).unwrap().slots().output_tokens, 100.0);
    m.observe_output(w, 200);
    assert!((m.fit(w).unwrap().slots().output_tokens - 110.0).abs() < 1e-9);
    assert_eq!(m.fit(WorkerId(0)).map(|f| f.slots().output_tokens), None);
}

#[test]
fn a_predicted_slot_wait_is_not_learned_as_slow_prefill() {
    let mut m = LatencyModel::new(LearnConfig::default());
    let w = WorkerId(0);
    m.add_worker(w, Speed::default());
    let e = TtftEstimate {
        prefill_ms: 100.0,
        slot_wait_ms: 400.0,
        ..Default::default()
    };
    // Observed = the slot wait + a prefill at the reference speed, many times.
    for _ in 0..50 {
        m.observe_ttft(w, &e, 500.0);
    }
    let s = m.speed(w);
    assert!((s.prefill - 1.0).abs() < 0.05, "{s:?}");
}

/// Feeds `n` observations to each of `workers`, worker `i` at speed `truth(i)`.
fn feed_fleet(
    m: &mut LatencyModel,
    rng: &mut fastrand::Rng,
    workers: &[u32],
    truth: impl Fn(u32) -> Speed,
    n: usize,
) {
    for _ in 0..n {
        for &w in workers {
            let (e, ttft, itl) = situation(rng, truth(w));
            m.observe_ttft(WorkerId(w), &e, ttft);
            m.observe_itl(WorkerId(w), &e, itl);
        }
    }
}

#[test]
fn a_run_of_same_sign_outliers_is_a_change_of_speed_and_is_followed_at_once() {
    let mut rng = fastrand::Rng::with_seed(21);
    let mut m = LatencyModel::new(LearnConfig::default());
    m.add_worker(WorkerId(0), Speed::default());
    feed(&mut m, &mut rng, Speed::default(), 200);
    // Three requests at a 2x slowdown: the factor is there after the third, not 28 clipped
    // steps later (each alone moves it by at most 0.1 x the clip).
    feed(&mut m, &mut rng, Speed::uniform(2.0), 3);
    let s = m.speed(WorkerId(0));
    assert!(s.prefill > 1.6 && s.decode > 1.6, "{s:?}");
    // Without the shift rule three observations move it by a few percent only.
    let mut m = LatencyModel::new(LearnConfig {
        shift_run: 0,
        ..LearnConfig::default()
    });
    m.add_worker(WorkerId(0), Speed::default());
    let mut rng = fastrand::Rng::with_seed(21);
    feed(&mut m, &mut rng, Speed::default(), 200);
    feed(&mut m, &mut rng, Speed::uniform(2.0), 3);
    assert!(
        m.speed(WorkerId(0)).prefill < 1.3,
        "{:?}",
        m.speed(WorkerId(0))
    );
    // A run of one sign that scatters (1.5x, 4x, 1.4x: max - min beyond the median's distance)
    // is not a level: clipped steps only.
    let mut m = LatencyModel::new(LearnConfig::default());
    m.add_worker(WorkerId(0), Speed::default());
    let mut rng = fastrand::Rng::with_seed(24);
    feed(&mut m, &mut rng, Speed::default(), 200);
    let before = m.speed(WorkerId(0)).prefill;
    for f in [1.5, 4.0, 1.4] {
        let (e, ttft, _) = loop {
            let s = situation(&mut rng, Speed::default());
            if s.0.prefill_ms > 4.0 * s.0.step_ms {
                break s;
            }
        };
        m.observe_ttft(WorkerId(0), &e, f * ttft);
    }
    let after = m.speed(WorkerId(0)).prefill;
    assert!(after / before < 1.15, "{before} -> {after}");
    // Outliers of alternating sign never make a run. (Prefill-bound situations, so that every
    // TTFT teaches the prefill factor and the signs alternate for each factor.)
    let mut m = LatencyModel::new(LearnConfig::default());
    m.add_worker(WorkerId(0), Speed::default());
    let mut rng = fastrand::Rng::with_seed(22);
    feed(&mut m, &mut rng, Speed::default(), 200);
    for i in 0..20 {
        let (e, ttft, itl) = loop {
            let s = situation(&mut rng, Speed::default());
            if s.0.prefill_ms > 4.0 * s.0.step_ms {
                break s;
            }
        };
        let f = if i % 2 == 0 { 5.0 } else { 0.2 };
        m.observe_ttft(WorkerId(0), &e, f * ttft);
        m.observe_itl(WorkerId(0), &e, f * itl);
    }
    let s = m.speed(WorkerId(0));
    assert!((0.8..1.25).contains(&s.prefill), "{s:?}");
    assert!((0.8..1.25).contains(&s.decode), "{s:?}");
}

#[test]
fn an_avoided_worker_relaxes_to_the_fleet_and_is_seen_again() {
    let mut rng = fastrand::Rng::with_seed(23);
    let mut m = LatencyModel::new(LearnConfig::default());
    for w in 0..4 {
        m.add_worker(WorkerId(w), Speed::default());
    }
    // The fleet runs at half the curve's times; worker 0 was seen slow (4x the others) ...
    let fast = Speed::uniform(0.5);
    feed_fleet(&mut m, &mut rng, &[0, 1, 2, 3], |_| fast, 100);
    feed_fleet(&mut m, &mut rng, &[0], |_| Speed::uniform(2.0), 10);
    let slow = m.speed(WorkerId(0)).prefill;
    assert!(slow > 1.6, "{slow}");
    // ... and then got no traffic. Within 2 x relax_after x 4 = 64 of the others' requests it is
    // still known slow (stale only after 32, then half the distance per 32) ...
    feed_fleet(&mut m, &mut rng, &[1, 2, 3], |_| fast, 12);
    let s = m.speed(WorkerId(0)).prefill;
    assert!(s > 1.2, "{s}");
    // ... and after a few more half-lives it is back near the fleet's speed, not the seed's.
    feed_fleet(&mut m, &mut rng, &[1, 2, 3], |_| fast, 100);
    let s = m.speed(WorkerId(0));
    assert!((0.4..0.65).contains(&s.prefill), "{s:?}");
    assert!((0.4..0.65).contains(&s.decode), "{s:?}");
    // The others never relax: they are observed.
    assert!((m.speed(WorkerId(1)).prefill / 0.5 - 1.0).abs() < 0.2);
    // A worker added now starts at the fleet's speed.
    m.add_worker(WorkerId(9), Speed::default());
    let s = m.speed(WorkerId(9));
    assert!((0.4..0.65).contains(&s.prefill), "{s:?}");
    // A worker that gets traffic is not relaxed, even if its requests teach only its decode
    // factor (cached prompts: decode-bound first tokens).
    let mut rng = fastrand::Rng::with_seed(25);
    feed_fleet(&mut m, &mut rng, &[0], |_| Speed::uniform(2.0), 10);
    let learned = m.speed(WorkerId(0)).prefill;
    for _ in 0..100 {
        feed_fleet(&mut m, &mut rng, &[1, 2, 3], |_| fast, 1);
        let (e, _, itl) = situation(&mut rng, fast);
        m.observe_itl(WorkerId(0), &e, itl);
    }
    assert_eq!(m.speed(WorkerId(0)).prefill, learned);
    // Without relaxation it would stay slow for ever.
    let mut m = LatencyModel::new(LearnConfig {
        relax_after: 0,
        ..LearnConfig::default()
    });
    let mut rng = fastrand::Rng::with_seed(23);
    for w in 0..4 {
        m.add_worker(WorkerId(w), Speed::default());
    }
    feed_fleet(&mut m, &mut rng, &[0, 1, 2, 3], |_| fast, 100);
    feed_fleet(&mut m, &mut rng, &[0], |_| Speed::uniform(2.0), 10);
    feed_fleet(&mut m, &mut rng, &[1, 2, 3], |_| fast, 112);
    assert!(m.speed(WorkerId(0)).prefill > 1.6);
}
