use super::*;
use crate::select::ScrapedLoad;
use crate::WorkerId;

fn cands(n: u32) -> Vec<Candidate> {
    (0..n).map(|w| Candidate::new(WorkerId(w))).collect()
}

fn req(hashes: &[u64]) -> RouteRequest<'_> {
    RouteRequest {
        hashes,
        isl_tokens: hashes.len() as u64 * 16,
        block_size: 16,
        affinity_key: None,
        hot: Default::default(),
    }
}

fn pick(p: &dyn Policy, r: &RouteRequest<'_>, c: &[Candidate], rng: &mut fastrand::Rng) -> u32 {
    p.select(r, c, rng).unwrap().worker.0
}

#[test]
fn by_name_and_empty_candidates() {
    let cfg = PolicyConfig::default();
    let mut rng = fastrand::Rng::with_seed(1);
    for name in POLICY_NAMES {
        let p = policy_by_name(name, &cfg).unwrap();
        assert_eq!(p.name(), name);
        assert!(p.select(&req(&[1, 2]), &[], &mut rng).is_none());
        // Every policy picks the only candidate, busy or not.
        let mut c = cands(1);
        c[0].active_blocks = 1_000_000;
        assert_eq!(pick(&*p, &req(&[1, 2]), &c, &mut rng), 0);
        assert_eq!(pick(&*p, &req(&[]), &c, &mut rng), 0);
    }
    assert_eq!(
        policy_by_name("Round-Robin", &cfg).unwrap().name(),
        "round_robin"
    );
    let err = policy_by_name("fastest", &cfg).unwrap_err();
    assert!(err.to_string().contains("\"fastest\"") && err.to_string().contains("cache_aware"));
}

#[test]
fn every_policy_skips_busy_workers() {
    let cfg = PolicyConfig {
        busy: BusyThresholds {
            waiting: Some(5),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut rng = fastrand::Rng::with_seed(2);
    let mut c = cands(3);
    for i in [0, 2] {
        c[i].scraped = Some(ScrapedLoad {
            kv_usage: 0.1,
            waiting: 9,
            running: 1,
        });
    }
    c[1].inflight = 50; // the least attractive by load, but the only non-busy one
    for name in POLICY_NAMES {
        let p = policy_by_name(name, &cfg).unwrap();
        for _ in 0..20 {
            assert_eq!(pick(&*p, &req(&[1, 2]), &c, &mut rng), 1, "{name}");
        }
    }
}

#[test]
fn round_robin_cycles() {
    let p = RoundRobin::default();
    let mut rng = fastrand::Rng::with_seed(3);
    let c = cands(3);
    let got: Vec<u32> = (0..6).map(|_| pick(&p, &req(&[]), &c, &mut rng)).collect();
    assert_eq!(got, [0, 1, 2, 0, 1, 2]);
}

#[test]
fn random_covers_all() {
    let p = Random::default();
    let mut rng = fastrand::Rng::with_seed(4);
    let c = cands(4);
    let mut hits = [0u32; 4];
    for _ in 0..4000 {
        hits[pick(&p, &req(&[]), &c, &mut rng) as usize] += 1;
    }
    assert!(hits.iter().all(|&h| (800..1200).contains(&h)), "{hits:?}");
}

#[test]
fn least_loaded_and_power_of_two() {
    let mut rng = fastrand::Rng::with_seed(5);
    let mut c = cands(4);
    for (i, l) in [5, 2, 9, 2].into_iter().enumerate() {
        c[i].inflight = l;
    }
    c[3].active_blocks = 1;
    for _ in 0..50 {
        assert_eq!(pick(&LeastLoaded::default(), &req(&[]), &c, &mut rng), 1);
    }
    // Power of two never picks the single most loaded worker, and with two always the lighter.
    let p2 = PowerOfTwo::default();
    for _ in 0..200 {
        assert_ne!(pick(&p2, &req(&[]), &c, &mut rng), 2);
        assert_eq!(pick(&p2, &req(&[]), &c[..2], &mut rng), 1);
    }
}

#[test]
fn consistent_hash_is_sticky_consistent_and_bounded() {
    let p = ConsistentHash::default();
    let mut rng = fastrand::Rng::with_seed(6);
    let c = cands(8);
    let mut r = req(&[42]);
    r.affinity_key = Some(7);
    let first = pick(&p, &r, &c, &mut rng);
    for _ in 0..20 {
        assert_eq!(pick(&p, &r, &c, &mut rng), first);
    }
    // Removing another worker does not move the key; removing its worker does.
    let without_other: Vec<Candidate> = c
        .iter()
        .copied()
        .filter(|x| x.worker.0 != (first + 1) % 8)
        .collect();
    assert_eq!(pick(&p, &r, &without_other, &mut rng), first);
    let without_own: Vec<Candidate> = c.iter().copied().filter(|x| x.worker.0 != first).collect();
    assert_ne!(pick(&p, &r, &without_own, &mut rng), first);
    // Keys spread: 800 keys over 8 workers, none empty.
    let mut hits = [0u32; 8];
    for k in 0..800u64 {
        r.affinity_key = Some(k);
        hits[pick(&p, &r, &c, &mut rng) as usize] += 1;
    }
    assert!(hits.iter().all(|&h| h > 40), "{hits:?}");
    // Bounded load: the key's worker at the cap spills to another worker.
    r.affinity_key = Some(7);
    let mut loaded = c.clone();
    loaded[first as usize].inflight = 10; // cap = ceil(1.25 · 11 / 8) = 2
    assert_ne!(pick(&p, &r, &loaded, &mut rng), first);
    // Without an affinity key the first block hash is the key.
    r.affinity_key = None;
    let a = pick(&p, &r, &c, &mut rng);
    assert_eq!(pick(&p, &r, &c, &mut rng), a);
}

#[test]
fn cache_aware_threshold_and_imbalance() {
    let p = CacheAware::default();
    let mut rng = fastrand::Rng::with_seed(8);
    let h: Vec<u64> = (0..10).collect();
    let mut c = cands(3);
    c[0].overlap_blocks = 6; // ratio 0.6 > 0.3
    c[0].inflight = 10;
    c[1].inflight = 3;
    c[2].inflight = 4;
    assert_eq!(pick(&p, &req(&h), &c, &mut rng), 0);
    c[0].overlap_blocks = 3; // ratio 0.3, not above → least loaded
    assert_eq!(pick(&p, &req(&h), &c, &mut rng), 1);
    c[0].overlap_blocks = 9;
    c[0].inflight = 100; // 100 − 3 > 64 and 100 > 1.5·3 → balance
    assert_eq!(pick(&p, &req(&h), &c, &mut rng), 1);
    c[0].kv_scoring = false; // overlap ignored
    c[0].inflight = 10;
    assert_eq!(pick(&p, &req(&h), &c, &mut rng), 1);
}

#[test]
fn kv_prefers_cache_until_load_outweighs_it() {
    let p = KvPolicy::default();
    let mut rng = fastrand::Rng::with_seed(9);
    let h: Vec<u64> = (0..20).collect();
    let mut c = cands(2);
    for x in &mut c {
        x.new_blocks = 20;
    }
    c[0].overlap_blocks = 15;
    let d = p.select(&req(&h), &c, &mut rng).unwrap();
    assert_eq!(d.worker.0, 0);
    // Default prefill_weight 4: 5 uncached blocks weigh 20, plus 20 potential decode blocks.
    assert_eq!(d.cost, 4.0 * 5.0 + 20.0);
    assert_eq!(d.overlap_blocks, 15);
    assert_eq!(d.predicted_hit_ratio, 0.75);
    // The cached worker's 15-block head start is worth 4 · 15 = 60 blocks of load: 60 extra active
    // blocks tie (random pick), 61 outweigh it.
    c[0].active_blocks = 59;
    assert_eq!(pick(&p, &req(&h), &c, &mut rng), 0);
    c[0].active_blocks = 61;
    assert_eq!(pick(&p, &req(&h), &c, &mut rng), 1);
    // With prefill_weight 1 the head start is worth 15 blocks: 16 extra outweigh it.
    let p1 = KvPolicy::new(
        KvCostConfig {
            prefill_weight: 1.0,
            ..Default::default()
        },
        Default::default(),
    );
    c[0].active_blocks = 14;
    assert_eq!(pick(&p1, &req(&h), &c, &mut rng), 0);
    c[0].active_blocks = 16;
    assert_eq!(pick(&p1, &req(&h), &c, &mut rng), 1);
    assert!(p.uses_overlap() && !RoundRobin::default().uses_overlap());
}

mod latency_policy {
    use super::*;
    use crate::latency::Speed;

    fn big_req(hashes: &[u64]) -> RouteRequest<'_> {
        RouteRequest {
            hashes,
            isl_tokens: 4096,
            block_size: 16,
            affinity_key: None,
            hot: Default::default(),
        }
    }

    /// Worker 0 holds 250 of the prompt's 256 blocks but has 6000 prompt tokens queued (predicted
    /// ~138 ms); worker 1 is idle with nothing cached (~86 ms).
    fn hit_vs_fast() -> Vec<Candidate> {
        let mut c = cands(2);
        c[0].overlap_blocks = 250;
        c[0].inflight = 4;
        c[0].pending_prefill_tokens = 6000;
        c[0].scraped = Some(ScrapedLoad {
            kv_usage: 0.5,
            waiting: 0,
            running: 4,
        });
        c
    }

    fn policy(slo_ttft_ms: f64, slo_itl_ms: f64) -> LatencyPolicy {
        LatencyPolicy::new(
            LatencyPolicyConfig {
                slo_ttft_ms,
                slo_itl_ms,
                ..Default::default()
            },
            BusyThresholds::default(),
        )
    }

    #[test]
    fn picks_the_lowest_predicted_ttft_without_slo() {
        let mut rng = fastrand::Rng::with_seed(20);
        let h = [0u64; 256];
        let c = hit_vs_fast();
        let cfg = LatencyPolicyConfig::default();
        let (c0, _) = cfg.cost(&big_req(&h), &c[0]);
        let (c1, _) = cfg.cost(&big_req(&h), &c[1]);
        assert!(c1 < c0, "{c0} {c1}");
        assert_eq!(pick(&policy(0.0, 0.0), &big_req(&h), &c, &mut rng), 1);
        // The same queue without the cached prefix there, and with: the cache enters through
        // the uncached tokens.
        let mut c = cands(2);
        c[0].overlap_blocks = 200;
        assert_eq!(pick(&policy(0.0, 0.0), &big_req(&h), &c, &mut rng), 0);
    }

    #[test]
    fn slo_prefers_the_best_hit_among_those_meeting_it_else_the_fastest() {
        let mut rng = fastrand::Rng::with_seed(21);
        let h = [0u64; 256];
        let c = hit_vs_fast();
        // Both predicted under 200 ms: the cached one keeps the session's locality.
        assert_eq!(pick(&policy(200.0, 0.0), &big_req(&h), &c, &mut rng), 0);
        // Only the idle one is predicted under 100 ms.
        assert_eq!(pick(&policy(100.0, 0.0), &big_req(&h), &c, &mut rng), 1);
        // Nobody meets 10 ms: the fastest.
        assert_eq!(pick(&policy(10.0, 0.0), &big_req(&h), &c, &mut rng), 1);
        // An ITL SLO the busy worker's decode step (~26 ms at KV usage 0.5) breaks.
        assert_eq!(pick(&policy(200.0, 20.0), &big_req(&h), &c, &mut rng), 1);
        assert_eq!(pick(&policy(200.0, 40.0), &big_req(&h), &c, &mut rng), 0);
        // Among several meeting it with the same hit, the cheapest.
        let mut c = cands(3);
        for x in &mut c {
            x.overlap_blocks = 100;
        }
        c[0].inflight = 5;
        c[2].pending_prefill_tokens = 2000;
        c[2].inflight = 1;
        assert_eq!(pick(&policy(500.0, 0.0), &big_req(&h), &c, &mut rng), 1);
    }

    #[test]
    fn a_slower_worker_gets_less_traffic() {
        let mut rng = fastrand::Rng::with_seed(22);
        let h = [0u64; 64];
        let mut c = cands(2);
        c[0].speed = Speed::uniform(2.0);
        for _ in 0..20 {
            assert_eq!(pick(&policy(0.0, 0.0), &req(&h), &c, &mut rng), 1);
        }
        // Until the fast one's queue makes it slower than the slow idle one.
        c[1].inflight = 3;
        c[1].pending_prefill_tokens = 20_000;
        assert_eq!(pick(&policy(0.0, 0.0), &req(&h), &c, &mut rng), 0);
    }

    #[test]
    fn decode_weight_charges_the_slowdown_inflicted_on_requests_in_flight() {
        let mut rng = fastrand::Rng::with_seed(23);
        let h = [0u64; 256];
        // Same predicted TTFT shape, but worker 0 has 40 requests decoding.
        let mut c = cands(2);
        for x in &mut c {
            x.inflight = 1;
        }
        c[0].inflight = 40;
        c[1].pending_prefill_tokens = 600;
        let p = |w: f64| {
            LatencyPolicy::new(
                LatencyPolicyConfig {
                    decode_weight: w,
                    ..Default::default()
                },
                BusyThresholds::default(),
            )
        };
        assert_eq!(pick(&p(0.0), &big_req(&h), &c, &mut rng), 0);
        assert_eq!(pick(&p(0.25), &big_req(&h), &c, &mut rng), 1);
    }

    #[test]
    fn a_worker_out_of_engine_slots_waits_for_one_to_free() {
        let mut rng = fastrand::Rng::with_seed(24);
        let h = [0u64; 256];
        // Worker 0 holds the whole prefix; worker 1 is idle and cold.
        let mut c = cands(2);
        c[0].overlap_blocks = 200;
        c[0].inflight = 2;
        let cfg = LatencyPolicyConfig::default();
        let (hit, _) = cfg.cost(&big_req(&h), &c[0]);
        let (cold, _) = cfg.cost(&big_req(&h), &c[1]);
        assert!(
            hit < cold,
            "the hit wins while slots are unknown: {hit} {cold}"
        );
        assert_eq!(pick(&policy(0.0, 0.0), &big_req(&h), &c, &mut rng), 0);
        // The engine runs 2 at once and a request stays 3 s: the third waits ~1 s for a slot,
        // longer than the cold prefill elsewhere.
        c[0].slots = crate::latency::EngineSlots {
            limit: 2,
            service_ms: 3000.0,
            output_tokens: 0.0,
        };
        let (full, _) = cfg.cost(&big_req(&h), &c[0]);
        assert!(full > cold, "{full} {cold}");
        assert_eq!(pick(&policy(0.0, 0.0), &big_req(&h), &c, &mut rng), 1);
        // A slot free again: back to the hit.
        c[0].inflight = 1;
        assert_eq!(pick(&policy(0.0, 0.0), &big_req(&h), &c, &mut rng), 0);
    }

    #[test]
    fn a_worker_whose_kv_memory_is_full_is_not_where_a_cached_prompt_goes() {
        let mut rng = fastrand::Rng::with_seed(25);
        let h = [0u64; 256];
        // Worker 0 caches the prompt but its two requests in flight pin 900 of its 1024 blocks;
        // running this one there needs all 256 of its blocks (cached ones pinned too).
        let mut c = cands(2);
        c[0].overlap_blocks = 250;
        (c[0].inflight, c[0].active_blocks, c[0].new_blocks) = (2, 900, 256);
        c[1].new_blocks = 256;
        for x in &mut c {
            x.kv_capacity_blocks = 1024;
            x.slots.service_ms = 3000.0;
        }
        assert_eq!(pick(&policy(0.0, 0.0), &big_req(&h), &c, &mut rng), 1);
        // Without the KV wait, or with room there, the hit wins.
        let no_kv = LatencyPolicy::new(
            LatencyPolicyConfig {
                model: crate::latency::LatencyConfig {
                    kv_wait: false,
                    ..Default::default()
                },
                ..Default::default()
            },
            BusyThresholds::default(),
        );
        assert_eq!(pick(&no_kv, &big_req(&h), &c, &mut rng), 0);
        c[0].active_blocks = 700;
        assert_eq!(pick(&policy(0.0, 0.0), &big_req(&h), &c, &mut rng), 0);
    }
}

#[test]
fn kv_time_is_kv_with_the_queue_term_on() {
    let cfg = PolicyConfig::default();
    assert_eq!(cfg.kv.queue_time, None);
    let t = policy_by_name("kv-time", &cfg).unwrap();
    assert_eq!(t.name(), "kv_time");
    let k = t
        .as_kv()
        .expect("kv_time is a kv policy (bounded walk, explanations)");
    assert_eq!(k.config().queue_time, Some(cfg.latency.model));
    assert_eq!(
        KvCostConfig {
            queue_time: None,
            ..*k.config()
        },
        cfg.kv
    );
    // `kv` keeps its meaning: no queue term unless configured; replication off in both.
    let plain = policy_by_name("kv", &cfg).unwrap();
    assert_eq!(plain.as_kv().unwrap().config().queue_time, None);
    assert_eq!(plain.as_kv().unwrap().config().replicate, 0.0);
    assert_eq!(k.config().replicate, 0.0);
}

/// `kv_time` with the cold rule: a prompt no worker holds more than `cold_latency` of goes where
/// the latency cost says once the recent reuse is below `cold_reuse`, and where the block cost
/// says otherwise (reuse high, the prompt cached beyond the share, or no latency model).
#[test]
fn kv_time_places_cold_prompts_by_latency_only_where_reuse_is_low() {
    use crate::latency::LatencyConfig;
    let h: Vec<u64> = (1..=64).collect(); // 1024 tokens
    let cfg = KvCostConfig {
        cold_latency: 0.8,
        cold_reuse: 0.5,
        ..Default::default()
    };
    let p = KvPolicy::time(cfg, LatencyConfig::default(), Default::default());
    let mut rng = fastrand::Rng::with_seed(3);
    // Worker 0 holds much decode memory but has no prompt work queued; worker 1 little memory
    // and 4000 prompt tokens queued. Blocks: 0 costs 4·64 + 2000 = 2256, 1 costs
    // 4·(0.25·4000/16 + 64) + 10 = 516. Time: 0 prefills 1024 tokens (~32 ms), 1 4064 (~85 ms).
    let mut c = cands(2);
    c[0].active_blocks = 2000;
    c[0].inflight = 1;
    c[1].active_blocks = 10;
    c[1].inflight = 1;
    c[1].pending_prefill_tokens = 4000;
    let lat = LatencyPolicyConfig::default();
    assert!(lat.cost(&req(&h), &c[0]).0 < lat.cost(&req(&h), &c[1]).0);
    assert!(cfg.cost(&req(&h), &c[0]) > cfg.cost(&req(&h), &c[1]));
    // A new policy starts at reuse 1: blocks.
    assert_eq!(p.recent_reuse(), 1.0);
    assert_eq!(pick(&p, &req(&h), &c, &mut rng), 1);
    // About 35 prompts with nothing cached take the recent reuse below 0.5; then time decides.
    let mut picks = Vec::new();
    for _ in 0..40 {
        picks.push(pick(&p, &req(&h), &c, &mut rng));
    }
    assert!(p.recent_reuse() < 0.5, "{}", p.recent_reuse());
    assert_eq!(picks[..30], [1; 30]);
    assert_eq!(picks[36..], [0; 4]);
    let d = p.select(&req(&h), &c, &mut rng).unwrap();
    assert_eq!(d.worker.0, 0);
    assert_eq!(
        d.cost,
        lat.cost(&req(&h), &c[0]).0,
        "the latency cost in ms"
    );
    // Cached beyond the share (60 of 64 blocks on worker 1): blocks, though time says 0.
    let mut warm = c.clone();
    warm[1].overlap_blocks = 60;
    assert!(lat.cost(&req(&h), &warm[0]).0 < lat.cost(&req(&h), &warm[1]).0);
    assert_eq!(pick(&p, &req(&h), &warm, &mut rng), 1);
    // At the share (51 of 64 ≤ 0.8 · 64): still cold.
    let mut edge = c.clone();
    edge[1].overlap_blocks = 51;
    assert_eq!(pick(&p, &req(&h), &edge, &mut rng), 0);
    // Reuse back up (prompts cached whole): blocks again.
    let mut whole = c.clone();
    whole[1].overlap_blocks = 64;
    for _ in 0..15 {
        pick(&p, &req(&h), &whole, &mut rng);
    }
    assert!(p.recent_reuse() > 0.5, "{}", p.recent_reuse());
    assert_eq!(pick(&p, &req(&h), &c, &mut rng), 1);
    // `kv` without the latency model, and `kv_time` with the rule off: never.
    for q in [
        KvPolicy::new(cfg, Default::default()),
        KvPolicy::time(
            KvCostConfig {
                cold_latency: 0.0,
                ..cfg
            },
            LatencyConfig::default(),
            Default::default(),
        ),
    ] {
        for _ in 0..60 {
            assert_eq!(pick(&q, &req(&h), &c, &mut rng), 1);
        }
    }
}
