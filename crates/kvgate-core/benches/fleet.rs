//! Large fleets: the `kv` decision at 64, 1,024 and 4,096 workers, exhaustive scan
//! ([`score_candidates`] + [`Policy::select`], what the gateway runs today) against
//! [`select_kv_bounded`] (holders + least-loaded walk), side by side in one run.
//!
//! Run: `cargo bench -p kvgate-core --bench fleet_bench -- --warm-up-time 1 --measurement-time 3`
//! (`FLEET_SIZES=64,1024` to pick sizes). Workload (the one of issue 36): an exact index built
//! from BlockStored events (64-block events chained by parent), 4096-token prompts (256 blocks of
//! 16) made of one of 256 group prefixes (128 blocks) and a tail of their own, four requests in
//! flight per worker, half still prefilling. Each timed prompt shares a group prefix with a new tail.
//!
//! Besides criterion's estimates `main` prints, per fleet size: the per-call latency distribution
//! of both paths over 20k interleaved calls (the load changes between calls: each call's request
//! is dispatched to the bounded pick and the oldest in-flight request is freed, so the maintained
//! load order is exercised), how often both pick the same worker and the largest relative cost
//! difference, the memory per indexed (block, worker) entry and the event ingest rate; then the
//! same for the `latency` policy ([`select_latency_bounded`] against every worker scored, learned
//! prefill speeds 0.8–1.6 by worker, decode speed 1, 5k calls each, no dispatch between calls).

use criterion::{criterion_group, Criterion};
use kvgate_core::policy::{KvPolicy, LatencyPolicy, LatencyPolicyConfig};
use kvgate_core::*;
use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

#[path = "sched.rs"]
mod sched;
use sched::{percentiles, Sched};

const BS: usize = 16;
const PROMPT_TOKENS: usize = 4096;
const BLOCKS: usize = PROMPT_TOKENS / BS;
const GROUPS: usize = 256;
const SHARED_BLOCKS: usize = 128;
const PER_WORKER: usize = 4;

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    x = (x ^ (x >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Prompt tokens: group `g`'s shared prefix, then a tail keyed by `tail`.
fn tokens(g: usize, tail: u64) -> Vec<u32> {
    let mut t: Vec<u32> = (0..SHARED_BLOCKS * BS)
        .map(|i| (mix((g * 1_000_003 + i) as u64) % 150_000) as u32)
        .collect();
    t.extend((0..PROMPT_TOKENS - t.len()).map(|i| (mix((tail << 20) + i as u64) % 150_000) as u32));
    t
}

struct Fleet {
    workers: u32,
    index: KvIndex,
    active: ActiveSequences,
    guards: VecDeque<LoadGuard>,
    ingest: Duration,
}

/// `workers` workers, each holding (and running) four sequences of random groups.
fn build(workers: u32) -> Fleet {
    let mut index = KvIndex::new();
    let active = ActiveSequences::new();
    let mut guards = VecDeque::new();
    let mut ingest = Duration::ZERO;
    for w in 0..workers {
        active.add_worker(WorkerId(w));
    }
    for s in 0..workers as usize * PER_WORKER {
        let w = WorkerId((s % workers as usize) as u32);
        let g = (mix(s as u64 ^ 0x5eed) % GROUPS as u64) as usize;
        let t = tokens(g, s as u64);
        let engine: Vec<u64> = (0..BLOCKS as u64)
            .map(|b| mix(((s as u64) << 16) + b))
            .collect();
        let t0 = Instant::now();
        let mut parent = None;
        for (eb, tb) in engine.chunks(64).zip(t.chunks(64 * BS)) {
            index
                .apply_stored(w, parent, eb, tb, BS, BASE_SEED)
                .unwrap();
            parent = eb.last().copied();
        }
        ingest += t0.elapsed();
        let h = block_hashes(&t, BS, BASE_SEED);
        let guard = active.add(w, s as u64, &h, PROMPT_TOKENS as u64, 0);
        if s % 2 == 0 {
            guard.mark_prefill_done();
        }
        guards.push_back(guard);
    }
    Fleet {
        workers,
        index,
        active,
        guards,
        ingest,
    }
}

fn query(q: usize) -> Vec<u64> {
    block_hashes(&tokens(q % GROUPS, (1 << 40) + q as u64), BS, BASE_SEED)
}

fn req(h: &[u64]) -> RouteRequest<'_> {
    RouteRequest {
        hashes: h,
        isl_tokens: PROMPT_TOKENS as u64,
        block_size: BS as u32,
        affinity_key: None,
        hot: Default::default(),
    }
}

/// Scratch of one path.
struct Path {
    scores: OverlapScores,
    cands: Vec<Candidate>,
    rng: fastrand::Rng,
}

impl Path {
    fn new(seed: u64) -> Self {
        Path {
            scores: OverlapScores::new(),
            cands: Vec::new(),
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// Today's gateway path: every worker a candidate, scored, then the policy.
    fn exhaustive(&mut self, f: &Fleet, p: &KvPolicy, h: &[u64], now: Instant) -> Decision {
        self.cands.clear();
        self.cands
            .extend((0..f.workers).map(|w| Candidate::new(WorkerId(w))));
        score_candidates(
            &f.index,
            &f.active,
            h,
            now,
            &mut self.scores,
            &mut self.cands,
        );
        p.select(&req(h), &self.cands, &mut self.rng).unwrap()
    }

    /// `latency` over every worker (speeds filled per candidate, as the gateway does).
    fn exhaustive_latency(
        &mut self,
        f: &Fleet,
        p: &LatencyPolicy,
        h: &[u64],
        now: Instant,
    ) -> Decision {
        self.cands.clear();
        self.cands
            .extend((0..f.workers).map(|w| Candidate::new(WorkerId(w))));
        score_candidates(
            &f.index,
            &f.active,
            h,
            now,
            &mut self.scores,
            &mut self.cands,
        );
        for c in &mut self.cands {
            c.speed = speed_of(c.worker);
        }
        p.select(&req(h), &self.cands, &mut self.rng).unwrap()
    }

    fn bounded_latency(
        &mut self,
        f: &Fleet,
        p: &LatencyPolicy,
        h: &[u64],
        now: Instant,
    ) -> Decision {
        select_latency_bounded(
            p,
            &f.index,
            &f.active,
            &req(h),
            now,
            SpeedBounds {
                prefill_floor: SPEED_FLOOR,
                decode_ceiling: 1.0,
            },
            &mut self.scores,
            &mut self.cands,
            |c| {
                c.speed = speed_of(c.worker);
                true
            },
            &mut self.rng,
        )
        .unwrap()
    }

    fn bounded(&mut self, f: &Fleet, p: &KvPolicy, h: &[u64], now: Instant) -> Decision {
        select_kv_bounded(
            p,
            &f.index,
            &f.active,
            &req(h),
            now,
            &mut self.scores,
            &mut self.cands,
            |_| true,
            &mut self.rng,
        )
        .unwrap()
    }
}

/// Learned prefill speeds of the `latency` rows: 0.8 to 1.6 by worker (the fastest is the floor).
const SPEED_FLOOR: f64 = 0.8;

fn speed_of(w: WorkerId) -> Speed {
    Speed {
        prefill: SPEED_FLOOR + f64::from(w.0 % 9) * 0.1,
        decode: 1.0,
    }
}

fn sizes() -> Vec<u32> {
    std::env::var("FLEET_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![64, 1024, 4096])
}

fn report() {
    println!("== kvgate-core fleet report ==");
    let policy = KvPolicy::new(KvCostConfig::default(), BusyThresholds::default());
    let sched = Sched::new();
    for workers in sizes() {
        let t = Instant::now();
        let mut f = build(workers);
        let built = t.elapsed();
        let entries = f.index.total_entries();
        println!(
            "{workers} workers: {entries} (block, worker) entries, {} distinct blocks, built in {built:.2?}",
            f.index.distinct_blocks()
        );
        println!(
            "  memory: {:.1} MiB index heap → {:.1} B per (block, worker) entry (target ≤ 64)",
            f.index.heap_bytes() as f64 / (1 << 20) as f64,
            f.index.heap_bytes() as f64 / entries as f64
        );
        println!(
            "  ingest: {:.2} M block events/s (BlockStored, 64-block events, incl. hashing)",
            entries as f64 / f.ingest.as_secs_f64() / 1e6
        );
        let prompts: Vec<Vec<u64>> = (0..1024).map(query).collect();
        let (mut ex, mut bo) = (Path::new(1), Path::new(2));
        let (mut t_ex, mut t_bo, mut t_load, mut t_ix) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut all_ex, mut all_bo) = (Vec::new(), Vec::new());
        let (mut same, mut worst, mut visited) = (0usize, 0f64, 0usize);
        let calls = 20_000;
        let now = Instant::now();
        let mut fresh = Vec::with_capacity(BLOCKS);
        for i in 0..calls {
            fresh.clear();
            fresh.extend_from_slice(&prompts[i % prompts.len()]);
            // Alternate which path runs first, so neither always finds the caches warmed.
            let (de, el_e, kept_e, db, el_b, kept_b);
            if i % 2 == 0 {
                (de, el_e, kept_e) = sched.time(|| ex.exhaustive(&f, &policy, &fresh, now));
                (db, el_b, kept_b) = sched.time(|| bo.bounded(&f, &policy, &fresh, now));
            } else {
                (db, el_b, kept_b) = sched.time(|| bo.bounded(&f, &policy, &fresh, now));
                (de, el_e, kept_e) = sched.time(|| ex.exhaustive(&f, &policy, &fresh, now));
            }
            all_ex.push(el_e);
            all_bo.push(el_b);
            if kept_e {
                t_ex.push(el_e);
            }
            if kept_b {
                t_bo.push(el_b);
            }
            visited += bo.cands.len();
            // The index query alone, the part both paths share.
            let ((), el, kept) =
                sched.time(|| f.index.find_matches(black_box(&fresh), now, &mut ex.scores));
            if kept {
                t_ix.push(el);
            }
            same += usize::from(de.worker == db.worker);
            worst = worst.max((db.cost - de.cost) / de.cost.abs().max(1e-9));
            // Dispatch to the bounded pick, free the oldest request: load keeps moving.
            let ((), el, kept) = sched.time(|| {
                let g = f
                    .active
                    .add(db.worker, i as u64, &fresh, PROMPT_TOKENS as u64, 0);
                g.mark_prefill_done();
                f.guards.push_back(g);
                drop(f.guards.pop_front());
            });
            if kept {
                t_load.push(el);
            }
        }
        println!("  kv selection, {calls} calls each, interleaved (calls not descheduled):");
        println!("    exhaustive: {}", percentiles(t_ex));
        println!("    bounded:    {}", percentiles(t_bo));
        println!(
            "    of which find_matches (both paths): {}",
            percentiles(t_ix)
        );
        println!("    (all calls) exhaustive: {}", percentiles(all_ex));
        println!("    (all calls) bounded:    {}", percentiles(all_bo));
        println!(
            "    same pick in {:.2}% of calls; bounded cost worse by at most {:.4}%; {:.1} workers visited per bounded call",
            same as f64 * 100.0 / calls as f64,
            worst * 100.0,
            visited as f64 / calls as f64
        );
        println!(
            "  load bookkeeping, add + prefill done + free of one request (maintained order included): {}",
            percentiles(t_load)
        );
        // The `latency` policy, both paths interleaved over the same prompts (no dispatch:
        // the load left by the kv rows stays).
        let lat = LatencyPolicy::new(LatencyPolicyConfig::default(), BusyThresholds::default());
        let (mut t_ex, mut t_bo) = (Vec::new(), Vec::new());
        let (mut same, mut worst, mut visited) = (0usize, 0f64, 0usize);
        let lcalls = 5_000;
        for i in 0..lcalls {
            let h = &prompts[i % prompts.len()];
            let (de, el_e, kept_e, db, el_b, kept_b);
            if i % 2 == 0 {
                (de, el_e, kept_e) = sched.time(|| ex.exhaustive_latency(&f, &lat, h, now));
                (db, el_b, kept_b) = sched.time(|| bo.bounded_latency(&f, &lat, h, now));
            } else {
                (db, el_b, kept_b) = sched.time(|| bo.bounded_latency(&f, &lat, h, now));
                (de, el_e, kept_e) = sched.time(|| ex.exhaustive_latency(&f, &lat, h, now));
            }
            if kept_e {
                t_ex.push(el_e);
            }
            if kept_b {
                t_bo.push(el_b);
            }
            visited += bo.cands.len();
            same += usize::from(de.worker == db.worker);
            worst = worst.max((db.cost - de.cost) / de.cost.abs().max(1e-9));
        }
        println!("  latency selection, {lcalls} calls each, interleaved (calls not descheduled):");
        println!("    exhaustive: {}", percentiles(t_ex));
        println!("    bounded:    {}", percentiles(t_bo));
        println!(
            "    same pick in {:.2}% of calls; bounded cost worse by at most {:.4}%; {:.1} workers visited per bounded call",
            same as f64 * 100.0 / lcalls as f64,
            worst * 100.0,
            visited as f64 / lcalls as f64
        );
    }
    println!("== end fleet report ==");
}

fn bench_fleet(c: &mut Criterion) {
    let policy = KvPolicy::new(KvCostConfig::default(), BusyThresholds::default());
    let now = Instant::now();
    for workers in sizes() {
        let f = build(workers);
        let prompts: Vec<Vec<u64>> = (0..256).map(query).collect();
        let mut g = c.benchmark_group(format!("fleet_kv_select_{workers}w"));
        let (mut ex, mut bo) = (Path::new(1), Path::new(2));
        let mut i = 0;
        g.bench_function("exhaustive", |b| {
            b.iter(|| {
                i += 1;
                ex.exhaustive(&f, &policy, black_box(&prompts[i % prompts.len()]), now)
            })
        });
        g.bench_function("bounded", |b| {
            b.iter(|| {
                i += 1;
                bo.bounded(&f, &policy, black_box(&prompts[i % prompts.len()]), now)
            })
        });
        g.finish();
    }
}

criterion_group!(benches, bench_fleet);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--list" || a == "--test") {
        report();
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
