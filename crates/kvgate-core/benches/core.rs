//! kvgate-core benches: hashing, index query, full `kv` selection, exact-event ingest, memory.
//!
//! Run: `cargo bench -p kvgate-core -- --warm-up-time 1 --measurement-time 3`.
//! Besides criterion's estimates, `main` prints figures criterion cannot: a per-call latency
//! distribution (p50/p99/p99.9) of the full selection over many different prompts, the memory per
//! indexed (block, worker) entry, and the sustained exact-event ingest rate.

use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use kvgate_core::*;
use std::hint::black_box;
use std::time::{Duration, Instant};

#[path = "sched.rs"]
mod sched;
use sched::{percentiles, Sched};

const BS: usize = 16;
const WORKERS: u32 = 64;
const PROMPT_TOKENS: usize = 8192;
const SEQS: usize = 2048; // × 512 blocks = 1,048,576 (block, worker) entries
const GROUPS: usize = 256; // shared prefixes (system prompts / documents)
const SHARED_BLOCKS: usize = 128;

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    x = (x ^ (x >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Sequence `s`: its group's shared prefix, then a tail unique to `s`. 8192 tokens.
fn seq_tokens(s: usize) -> Vec<u32> {
    let g = s % GROUPS;
    let mut t: Vec<u32> = (0..SHARED_BLOCKS * BS)
        .map(|i| (mix((g * 1_000_003 + i) as u64) % 150_000) as u32)
        .collect();
    t.extend(
        (0..PROMPT_TOKENS - t.len())
            .map(|i| (mix((s * 7_919 + i + (1 << 40)) as u64) % 150_000) as u32),
    );
    t
}

fn worker_of(s: usize) -> WorkerId {
    WorkerId((mix(s as u64 ^ 0xabcdef) % u64::from(WORKERS)) as u32)
}

/// 2048 sequences of 512 blocks spread over 64 workers through exact BlockStored events
/// (64-block events chained by parent, as an engine emits them).
fn build_index() -> (KvIndex, Vec<Vec<u64>>) {
    let mut ix = KvIndex::new();
    let mut all = Vec::with_capacity(SEQS);
    for s in 0..SEQS {
        let t = seq_tokens(s);
        let w = worker_of(s);
        let engine: Vec<u64> = (0..PROMPT_TOKENS / BS)
            .map(|b| mix((s * 4096 + b) as u64))
            .collect();
        let mut parent = None;
        for (eb, tb) in engine.chunks(64).zip(t.chunks(64 * BS)) {
            ix.apply_stored(w, parent, eb, tb, BS, BASE_SEED).unwrap();
            parent = eb.last().copied();
        }
        all.push(block_hashes(&t, BS, BASE_SEED));
    }
    (ix, all)
}

/// Four in-flight 8k requests per worker, half still prefilling.
fn build_load(seqs: &[Vec<u64>]) -> (ActiveSequences, Vec<LoadGuard>) {
    let a = ActiveSequences::new();
    let mut guards = Vec::new();
    for (s, h) in seqs.iter().enumerate().take(WORKERS as usize * 4) {
        let g = a.add(
            WorkerId(s as u32 % WORKERS),
            s as u64,
            h,
            PROMPT_TOKENS as u64,
            2048,
        );
        if s % 2 == 0 {
            g.mark_prefill_done();
        }
        guards.push(g);
    }
    (a, guards)
}

/// A fresh prompt sharing group `g`'s prefix (128 blocks on ~8 workers) with a new tail.
fn query_prompt(q: usize) -> Vec<u64> {
    let mut t = seq_tokens(q % GROUPS);
    for (i, x) in t[SHARED_BLOCKS * BS..].iter_mut().enumerate() {
        *x = (mix((q * 31 + i) as u64 + (1 << 50)) % 150_000) as u32;
    }
    block_hashes(&t, BS, BASE_SEED)
}

fn bench_hash(c: &mut Criterion) {
    let tokens = seq_tokens(1);
    let mut out = Vec::new();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Elements(PROMPT_TOKENS as u64));
    for bs in [16usize, 64] {
        g.bench_function(format!("block_hashes_8k_tokens_bs{bs}"), |b| {
            b.iter(|| block_hashes_into(black_box(&tokens), bs, BASE_SEED, &mut out))
        });
    }
    g.finish();
}

fn bench_query_and_select(c: &mut Criterion) {
    let (mut ix, seqs) = build_index();
    let (active, _guards) = build_load(&seqs);
    // Worst case: one 512-block prompt held in full by all 64 workers.
    let hot = seq_tokens(SEQS + 1);
    let hot_h = block_hashes(&hot, BS, BASE_SEED);
    let engine: Vec<u64> = (0..hot_h.len() as u64)
        .map(|b| mix(b + (1 << 60)))
        .collect();
    for w in 0..WORKERS {
        ix.apply_stored(WorkerId(w), None, &engine, &hot, BS, BASE_SEED)
            .unwrap();
    }
    let now = Instant::now();
    let mut scores = OverlapScores::new();
    let full = &seqs[3]; // 512 blocks held by one worker, its 128-block prefix by ~8
    let partial = query_prompt(5);
    let miss = block_hashes(&seq_tokens(SEQS + 7)[SHARED_BLOCKS * BS..], BS, BASE_SEED);

    let mut g = c.benchmark_group("index_query_64w_1M");
    for (name, h) in [
        ("full_512_on_1_prefix_on_8", full),
        ("prefix_128_on_8", &partial),
        ("miss", &miss),
        ("worst_512_on_all_64", &hot_h),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| ix.find_matches(black_box(h), now, &mut scores))
        });
    }
    g.finish();

    let policy = policy_by_name("kv", &PolicyConfig::default()).unwrap();
    let mut cands: Vec<Candidate> = (0..WORKERS).map(|w| Candidate::new(WorkerId(w))).collect();
    let mut rng = fastrand::Rng::with_seed(1);
    let mut select = |h: &[u64], cands: &mut Vec<Candidate>, scores: &mut OverlapScores| {
        score_candidates(&ix, &active, h, now, scores, cands);
        let req = RouteRequest {
            hashes: h,
            isl_tokens: PROMPT_TOKENS as u64,
            block_size: BS as u32,
            affinity_key: None,
            hot: Default::default(),
        };
        policy.select(&req, cands, &mut rng)
    };
    let mut g = c.benchmark_group("kv_select_64w_8k_prompt");
    for (name, h) in [
        ("prefix_128_on_8", &partial),
        ("worst_512_on_all_64", &hot_h),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| select(black_box(h), &mut cands, &mut scores))
        });
    }
    g.finish();

    let latency = policy_by_name("latency", &PolicyConfig::default()).unwrap();
    let mut model = LatencyModel::new(LearnConfig::default());
    for w in 0..WORKERS {
        model.add_worker(WorkerId(w), Speed::uniform(1.0 + f64::from(w % 4) * 0.25));
    }
    let mut rng2 = fastrand::Rng::with_seed(3);
    let mut g = c.benchmark_group("latency_select_64w_8k_prompt");
    for (name, h) in [
        ("prefix_128_on_8", &partial),
        ("worst_512_on_all_64", &hot_h),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                score_candidates(&ix, &active, black_box(h), now, &mut scores, &mut cands);
                model.fill(&mut cands);
                let req = RouteRequest {
                    hashes: h,
                    isl_tokens: PROMPT_TOKENS as u64,
                    block_size: BS as u32,
                    affinity_key: None,
                    hot: Default::default(),
                };
                latency.select(&req, &cands, &mut rng2)
            })
        });
    }
    g.finish();
    let mut g = c.benchmark_group("kv_select_64w_8k_prompt");
    let tokens = seq_tokens(5);
    let mut hbuf = Vec::new();
    g.bench_function("with_hashing_prefix_128_on_8", |b| {
        b.iter(|| {
            block_hashes_into(black_box(&tokens), BS, BASE_SEED, &mut hbuf);
            select(&hbuf, &mut cands, &mut scores)
        })
    });
    g.finish();
}

/// One sequence's worker, its block hashes in stored-event chunks, and its tokens.
type WorkerEvents = (WorkerId, Vec<Vec<u64>>, Vec<u32>);

/// Stored events of 16 blocks each (vLLM emits one per scheduling step per request), then removed,
/// so the index stays at a steady size. Throughput counts block events (stored + removed).
fn ingest_events(n_seqs: usize) -> Vec<WorkerEvents> {
    (0..n_seqs)
        .map(|s| {
            let t = seq_tokens(s);
            let engine: Vec<u64> = (0..512u64).map(|b| mix(((s as u64) << 20) + b)).collect();
            (
                worker_of(s),
                engine.chunks(16).map(<[u64]>::to_vec).collect(),
                t,
            )
        })
        .collect()
}

fn apply_all(ix: &mut KvIndex, events: &[WorkerEvents]) -> usize {
    let mut n = 0;
    for (w, chunks, t) in events {
        let mut parent = None;
        for (i, eb) in chunks.iter().enumerate() {
            ix.apply_stored(
                *w,
                parent,
                eb,
                &t[i * 16 * BS..(i + 1) * 16 * BS],
                BS,
                BASE_SEED,
            )
            .unwrap();
            parent = eb.last().copied();
            n += eb.len();
        }
    }
    for (w, chunks, _) in events {
        for eb in chunks.iter().rev() {
            n += ix.apply_removed(*w, eb);
        }
    }
    n
}

fn bench_ingest(c: &mut Criterion) {
    let events = ingest_events(64); // 32,768 blocks stored + removed
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(2 * 64 * 512));
    let mut ix = KvIndex::new();
    g.bench_function("exact_store_then_remove_16_block_events", |b| {
        b.iter(|| apply_all(&mut ix, black_box(&events)))
    });
    let routed: Vec<(WorkerId, Vec<u64>)> =
        (0..64).map(|s| (worker_of(s), query_prompt(s))).collect();
    let mut ix = KvIndex::new();
    for w in 0..WORKERS {
        ix.set_mode(
            WorkerId(w),
            IndexMode::Approximate(ApproxConfig {
                ttl: Duration::from_secs(120),
                capacity_blocks: 4096,
            }),
        );
    }
    let t0 = Instant::now();
    let mut tick = 0u64;
    g.throughput(Throughput::Elements(64 * 512));
    g.bench_function("approx_record_routed_512_blocks", |b| {
        b.iter_batched(
            || {
                tick += 1;
                t0 + Duration::from_millis(tick)
            },
            |now| {
                for (w, h) in &routed {
                    ix.record_routed(*w, h, now);
                }
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// Prints `label: percentiles` when enough calls ran undisturbed to mean anything.
fn print_undisturbed(label: &str, v: Vec<Duration>) {
    if v.len() > 100 {
        println!("  {label}, calls not descheduled: {}", percentiles(v));
    }
}

/// Figures criterion does not give: latency distribution over varied prompts, memory, ingest rate.
fn report() {
    println!("== kvgate-core report ==");
    let t = Instant::now();
    let (mut ix, seqs) = build_index();
    let build = t.elapsed();
    let entries = ix.total_entries();
    let bytes = ix.heap_bytes();
    println!(
        "index: {} workers, {} (block, worker) entries, {} distinct blocks, built from events in {:.2?} ({:.2} M block events/s incl. hashing)",
        WORKERS,
        entries,
        ix.distinct_blocks(),
        build,
        entries as f64 / build.as_secs_f64() / 1e6
    );
    println!(
        "memory: {:.1} MiB estimated heap → {:.1} B per (block, worker) entry (target ≤ 64)",
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / entries as f64
    );

    let (active, guards) = build_load(&seqs);
    let policy = policy_by_name("kv", &PolicyConfig::default()).unwrap();
    let mut cands: Vec<Candidate> = (0..WORKERS).map(|w| Candidate::new(WorkerId(w))).collect();
    let mut scores = OverlapScores::new();
    let mut rng = fastrand::Rng::with_seed(2);
    let prompts: Vec<Vec<u64>> = (0..512)
        .map(query_prompt)
        .chain(seqs[..512].iter().cloned())
        .collect();
    let now = Instant::now();
    let sched = Sched::new();
    println!(
        "kv selection (find_matches + load + cost + pick), 64 workers, 8k-token prompts (half 128-block prefix on ~8 workers, half full 512-block match), 1024 distinct prompts, 20k calls each:"
    );
    // In the gateway the prompt's 512 hashes were computed just before the selection, so they are
    // in cache (the index is not). `fresh` mirrors that; the second pass reads them cold from a
    // 4 MB set of prompts, which costs a cache miss every few blocks on top.
    let mut fresh: Vec<u64> = Vec::with_capacity(PROMPT_TOKENS / BS);
    for variant in 0..3 {
        let hashes_in_cache = variant != 1;
        if variant == 2 {
            // Routed prompts not yet confirmed by KV events (predicted insertion, the default
            // with events on): 64 requests in flight, one per worker, 512 blocks each. Then every
            // walked block is also looked up among the predictions.
            ix.set_predicted_ttl(Duration::from_secs(60));
            for w in 0..WORKERS {
                ix.record_predicted(WorkerId(w), &query_prompt(5_000 + w as usize), now);
            }
        }
        let mut lat = Vec::with_capacity(20_000);
        let mut undisturbed = Vec::with_capacity(20_000);
        let mut picked_best = 0;
        let cpu0 = sched.read();
        let wall0 = Instant::now();
        for i in 0..20_000 {
            let h: &[u64] = if hashes_in_cache {
                fresh.clear();
                fresh.extend_from_slice(&prompts[i % prompts.len()]);
                &fresh
            } else {
                &prompts[i % prompts.len()]
            };
            let (d, el, kept) = sched.time(|| {
                score_candidates(&ix, &active, h, now, &mut scores, &mut cands);
                let req = RouteRequest {
                    hashes: h,
                    isl_tokens: PROMPT_TOKENS as u64,
                    block_size: BS as u32,
                    affinity_key: None,
                    hot: Default::default(),
                };
                black_box(policy.select(&req, &cands, &mut rng)).unwrap()
            });
            lat.push(el);
            if kept {
                undisturbed.push(el);
            }
            picked_best += usize::from(d.overlap_blocks == scores.max());
        }
        let wall = wall0.elapsed();
        let label = match variant {
            0 => "prompt hashes in cache (as in the gateway)",
            1 => "prompt hashes cold (read from the 4 MB prompt set)",
            _ => {
                "prompt hashes in cache, 64 routed prompts awaiting confirmation (predicted blocks)"
            }
        };
        println!("  {label}:");
        println!("    wall, all calls:            {}", percentiles(lat));
        if undisturbed.len() > 100 {
            println!(
                "    wall, calls not descheduled ({:.1}%): {}",
                undisturbed.len() as f64 / 200.0,
                percentiles(undisturbed)
            );
        }
        if let (Some(a), Some(b)) = (cpu0, sched.read()) {
            println!(
                "    on-CPU share of the loop: {:.0}% (the rest is other processes on this shared machine)",
                (b.0 - a.0) as f64 / wall.as_nanos() as f64 * 100.0
            );
        }
        println!(
            "    (picked a max-overlap worker in {:.1}% of calls)",
            picked_best as f64 / 200.0
        );
    }
    // Predictions lapse: the loops below see confirmed blocks only, as variants 0 and 1 did.
    ix.expire(now + Duration::from_secs(120));
    // `kv` against `latency` (with the latency model's fill, as the gateway does), interleaved in
    // one loop so both see the same machine load.
    {
        let latency = policy_by_name("latency", &PolicyConfig::default()).unwrap();
        let mut model = LatencyModel::new(LearnConfig::default());
        for w in 0..WORKERS {
            model.add_worker(WorkerId(w), Speed::uniform(1.0 + f64::from(w % 4) * 0.25));
        }
        let (mut kv_lat, mut lat_lat) = (Vec::new(), Vec::new());
        for i in 0..40_000 {
            fresh.clear();
            fresh.extend_from_slice(&prompts[(i / 2) % prompts.len()]);
            let use_latency = i % 2 == 1;
            let (_, el, kept) = sched.time(|| {
                score_candidates(&ix, &active, &fresh, now, &mut scores, &mut cands);
                let req = RouteRequest {
                    hashes: &fresh,
                    isl_tokens: PROMPT_TOKENS as u64,
                    block_size: BS as u32,
                    affinity_key: None,
                    hot: Default::default(),
                };
                if use_latency {
                    model.fill(&mut cands);
                    black_box(latency.select(&req, &cands, &mut rng)).unwrap()
                } else {
                    black_box(policy.select(&req, &cands, &mut rng)).unwrap()
                }
            });
            if kept {
                if use_latency {
                    lat_lat.push(el);
                } else {
                    kv_lat.push(el);
                }
            }
        }
        println!("  kv vs latency selection, interleaved, prompt hashes in cache, calls not descheduled:");
        println!("    kv:      {}", percentiles(kv_lat));
        println!("    latency: {}", percentiles(lat_lat));
    }
    // The same prompts through the index query alone (where the selection's time goes).
    print_undisturbed(
        "of which find_matches alone (hashes in cache)",
        sched.undisturbed(20_000, |i| {
            fresh.clear();
            fresh.extend_from_slice(&prompts[i % prompts.len()]);
            ix.find_matches(black_box(&fresh), now, &mut scores);
        }),
    );
    // … and through the router-side load part alone (`ActiveSequences::fill_loads`), right after
    // the (untimed) index query as in a selection, so the caches are as cold as there.
    let mut load_part = |prompts: &[Vec<u64>]| {
        (0..20_000)
            .filter_map(|i| {
                let h = &prompts[i % prompts.len()];
                ix.find_matches(black_box(h), now, &mut scores);
                let ((), el, kept) = sched.time(|| active.fill_loads(black_box(h), &mut cands));
                kept.then_some(el)
            })
            .collect::<Vec<_>>()
    };
    print_undisturbed("of which fill_loads alone", load_part(&prompts));
    // Prefixes in flight on every worker (shared system prompts: each of the 64 workers also runs
    // requests of groups 0..4, whose 128-block prefix the timed prompts share), the case where a
    // search per worker costs most.
    let mut shared = Vec::new();
    for w in 0..WORKERS {
        for g in 0..4 {
            shared.push(active.add(WorkerId(w), 0, &query_prompt(g)[..SHARED_BLOCKS], 0, 0));
        }
    }
    let prompts: Vec<Vec<u64>> = (0..256).map(|k| query_prompt(k * GROUPS + k % 4)).collect();
    print_undisturbed(
        "fill_loads, 128-block prefix of the prompt also in flight on all 64 workers",
        load_part(&prompts),
    );
    drop(shared);
    drop(guards);

    let events = ingest_events(256);
    let mut ix = KvIndex::new();
    let cpu0 = sched.read();
    let t = Instant::now();
    let mut n = 0;
    for _ in 0..4 {
        n += apply_all(&mut ix, &events);
    }
    let el = t.elapsed();
    let cpu = match (cpu0, sched.read()) {
        (Some(a), Some(b)) => format!(
            ", {:.2} M events per on-CPU second",
            n as f64 / ((b.0 - a.0) as f64 / 1e9) / 1e6
        ),
        _ => String::new(),
    };
    println!(
        "exact ingest incl. hashing: {} block events (stored + removed, 16-block events) in {:.2?} → {:.2} M events/s wall{} (target ≥ 2)",
        n,
        el,
        n as f64 / el.as_secs_f64() / 1e6,
        cpu
    );
    println!("== end report ==");
}

criterion_group!(benches, bench_hash, bench_query_and_select, bench_ingest);

fn main() {
    // `cargo bench -- --list` and test mode only enumerate; skip the slow report there.
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--list" || a == "--test") {
        report();
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
