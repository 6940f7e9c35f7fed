//! Engine behaviour on its own (no clock, no sockets).

use super::*;

fn cfg(blocks: usize) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_gpu_blocks: blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        priority_scheduling: false,
        enable_prefix_caching: true,
        assume_cached: false,
        seed: 1,
        mean_output_tokens: 8,
    }
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    NewRequest {
        id,
        prompt,
        max_tokens,
        ignore_eos: true,
        kv: Default::default(),
        priority: 0,
        assumed_cached_tokens: 0,
    }
}

/// Runs until idle; returns outputs per request and the started (id, cached) pairs.
fn drain(e: &mut Engine, max_steps: usize) -> (Vec<Output>, Vec<(RequestId, usize)>, Vec<KvEvent>) {
    let (mut outs, mut started, mut events) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..max_steps {
        if !e.has_work() {
            return (outs, started, events);
        }
        let step = e.schedule();
        assert!(
            !step.is_empty(),
            "work pending but nothing scheduled: deadlock"
        );
        started.extend(step.started.iter().copied());
        outs.extend(e.complete(&step));
        events.extend(e.take_events());
    }
    panic!("engine did not drain in {max_steps} steps");
}

#[test]
fn repeated_prompt_hits_the_prefix_cache() {
    let mut e = Engine::new(cfg(64));
    let prompt: Vec<u32> = (0..30).collect(); // 7 full blocks of 4 + 2 tokens
    e.add_request(req(1, prompt.clone(), 3));
    let (_, s1, ev) = drain(&mut e, 100);
    assert_eq!(s1, vec![(1, 0)]);
    let stored: usize = ev
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                token_ids,
                ..
            } => {
                assert_eq!(token_ids.len(), block_hashes.len() * 4);
                block_hashes.len()
            }
            _ => 0,
        })
        .sum();
    assert_eq!(
        stored, 8,
        "7 prompt blocks + the block completed by computed output tokens (the last sampled token is never computed)"
    );
    e.add_request(req(2, prompt, 2));
    let (_, s2, _) = drain(&mut e, 100);
    assert_eq!(s2, vec![(2, 28)]);
    assert_eq!(e.counters.prefix_cache_hits, 28);
    assert_eq!(e.counters.prefix_cache_queries, 60);
}

#[test]
fn full_cache_hit_still_computes_the_last_token() {
    let mut e = Engine::new(cfg(64));
    let prompt: Vec<u32> = (0..16).collect();
    e.add_request(req(1, prompt.clone(), 1));
    drain(&mut e, 100);
    e.add_request(req(2, prompt, 1));
    let (_, s, _) = drain(&mut e, 100);
    assert_eq!(
        s,
        vec![(2, 12)],
        "3 of 4 blocks: at least one token is recomputed"
    );
}

#[test]
fn lru_eviction_emits_block_removed_for_the_oldest_blocks() {
    let mut e = Engine::new(cfg(9)); // 8 usable blocks
    e.add_request(req(1, (0..16).collect(), 1));
    let (_, _, ev1) = drain(&mut e, 100);
    let first: Vec<u64> = ev1
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
            _ => vec![],
        })
        .collect();
    e.add_request(req(2, (100..128).collect(), 1));
    let (_, _, ev2) = drain(&mut e, 100);
    let removed: Vec<u64> = ev2
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes } => block_hashes.clone(),
            _ => vec![],
        })
        .collect();
    assert!(
        !removed.is_empty(),
        "second prompt needs evictions: {ev2:?}"
    );
    assert!(removed.iter().all(|h| first.contains(h)));
    // Tail blocks of the first request go first (freed in reverse order).
    assert_eq!(removed[0], *first.last().unwrap());
    let snap = e.cache_snapshot();
    assert!(snap.iter().all(|c| !removed.contains(&c.hash)));
}

#[test]
fn preemption_when_blocks_run_out_and_everything_finishes() {
    let mut c = cfg(9); // 8 usable blocks = 32 tokens
    c.max_num_batched_tokens = 16;
    let mut e = Engine::new(c);
    for id in 0..4 {
        // Each needs 4..6 blocks over its lifetime: they cannot all fit at once.
        e.add_request(req(
            id,
            (id as u32 * 100..id as u32 * 100 + 10).collect(),
            12,
        ));
    }
    let (outs, started, _) = drain(&mut e, 10_000);
    assert!(e.counters.preemptions > 0, "expected preemption");
    assert_eq!(started.len(), 4);
    for id in 0..4 {
        let mine: Vec<_> = outs.iter().filter(|o| o.id == id).collect();
        assert_eq!(mine.len(), 12, "request {id} got every token exactly once");
        assert_eq!(mine.last().unwrap().finished, Some(FinishReason::Length));
    }
    assert_eq!(e.num_free_blocks(), 8, "all blocks returned");
}

#[test]
fn chunked_prefill_splits_long_prompts_across_steps() {
    let mut c = cfg(64);
    c.max_num_batched_tokens = 10;
    let mut e = Engine::new(c);
    e.add_request(req(1, (0..25).collect(), 1));
    let s1 = e.schedule();
    assert_eq!(s1.scheduled, vec![(1, 10)]);
    assert!(
        e.complete(&s1).is_empty(),
        "no token before the prompt is done"
    );
    let s2 = e.schedule();
    assert_eq!(s2.scheduled, vec![(1, 10)]);
    e.complete(&s2);
    let s3 = e.schedule();
    assert_eq!((s3.scheduled.clone(), s3.prefill_tokens), (vec![(1, 5)], 5));
    assert_eq!(e.complete(&s3).len(), 1);
}

#[test]
fn max_num_seqs_caps_the_batch_and_the_queue_is_fcfs() {
    let mut c = cfg(64);
    c.max_num_seqs = 2;
    let mut e = Engine::new(c);
    for id in 0..3 {
        e.add_request(req(id, vec![id as u32 + 1; 5], 3));
    }
    let s = e.schedule();
    assert_eq!(
        s.scheduled.iter().map(|x| x.0).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!((e.num_running(), e.num_waiting()), (2, 1));
}

#[test]
fn abort_frees_blocks() {
    let mut e = Engine::new(cfg(16));
    e.add_request(req(1, (0..20).collect(), 50));
    let s = e.schedule();
    e.complete(&s);
    assert!(e.num_free_blocks() < 15);
    assert!(e.abort(1));
    assert_eq!(e.num_free_blocks(), 15);
    assert!(!e.has_work());
}

#[test]
fn outputs_are_deterministic_and_natural_stop_is_reported() {
    let run = || {
        let mut e = Engine::new(cfg(64));
        e.add_request(NewRequest {
            id: 1,
            prompt: (0..9).collect(),
            max_tokens: 1000,
            ignore_eos: false,
            kv: Default::default(),
            priority: 0,
            assumed_cached_tokens: 0,
        });
        drain(&mut e, 10_000).0
    };
    let a = run();
    assert_eq!(a, run());
    assert!(a.len() <= 16, "mean 8 → natural length at most 16");
    assert_eq!(a.last().unwrap().finished, Some(FinishReason::Stop));
}

#[test]
fn reset_prefix_cache_clears_and_reports() {
    let mut e = Engine::new(cfg(64));
    e.add_request(req(1, (0..20).collect(), 1));
    drain(&mut e, 100);
    assert!(!e.cache_snapshot().is_empty());
    e.reset_prefix_cache();
    assert_eq!(e.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert!(e.cache_snapshot().is_empty());
    e.add_request(req(2, (0..20).collect(), 1));
    let (_, s, _) = drain(&mut e, 100);
    assert_eq!(s, vec![(2, 0)]);
}

#[test]
fn decode_leg_computes_only_the_last_token_and_reports_the_rest_cached() {
    let mut e = Engine::new(cfg(32));
    let mut r = req(1, (100..118).collect(), 2); // 18 tokens: 4 full blocks + 2
    r.kv = KvTransfer::RemotePrefill;
    e.add_request(r);
    let step = e.schedule();
    assert_eq!(step.started, vec![(1, 17)]);
    assert_eq!((step.prefill_tokens, step.decode_seqs), (0, 1));
    assert_eq!(step.scheduled, vec![(1, 1)]);
    let out = e.complete(&step);
    assert_eq!(
        out.len(),
        1,
        "the first token comes from the recompute step"
    );
    assert_eq!(e.counters.remote_prefill_tokens, 17);
    // The pulled blocks are now in this worker's prefix cache.
    assert_eq!(e.local_hit_tokens(&(100..118).collect::<Vec<_>>()), 16);
}

#[test]
fn prefill_leg_pins_its_blocks_until_released() {
    let mut e = Engine::new(cfg(32));
    let mut r = req(1, (100..118).collect(), 1);
    r.kv = KvTransfer::RemoteDecode;
    e.add_request(r);
    let free0 = e.num_free_blocks();
    let (outs, _, _) = drain(&mut e, 10);
    let pinned = outs[0].pinned.clone().expect("length-capped leg pins");
    assert_eq!(pinned.len(), 5);
    assert_eq!(e.num_pinned_blocks(), 5);
    assert_eq!(e.num_free_blocks(), free0 - 5);
    assert_eq!(e.release_pinned(1), Some(5));
    assert_eq!(e.release_pinned(1), None);
    assert_eq!((e.num_pinned_blocks(), e.num_free_blocks()), (0, free0));
}

fn prio(id: u64, priority: i64, prompt_len: u32, max_tokens: usize) -> NewRequest {
    NewRequest {
        priority,
        ..req(
            id,
            (id as u32 * 1000..id as u32 * 1000 + prompt_len).collect(),
            max_tokens,
        )
    }
}

/// `--scheduling-policy priority`: the waiting queue is ordered by (priority, arrival), lower
/// first; FCFS admits in arrival order. As in vLLM 0.32's v1 scheduler, a full batch preempts
/// nobody for a waiting request, whatever its priority: it runs when a slot frees.
#[test]
fn priority_policy_orders_waiting_and_a_full_batch_preempts_nobody() {
    let run = |priority_scheduling: bool| {
        let mut e = Engine::new(EngineConfig {
            max_num_seqs: 1,
            priority_scheduling,
            ..cfg(256)
        });
        e.add_request(prio(1, 5, 8, 3));
        let first = e.schedule();
        let _ = e.complete(&first);
        // Arrive while the batch is full: 3 (priority 9) before 4 (priority -1).
        e.add_request(prio(3, 9, 8, 2));
        e.add_request(prio(4, -1, 8, 2));
        let mut started = Vec::new();
        for _ in 0..50 {
            let step = e.schedule();
            started.extend(step.started.iter().map(|s| s.0));
            let _ = e.complete(&step);
            if !e.has_work() {
                break;
            }
        }
        (started, e.counters.preemptions)
    };
    assert_eq!(run(false), (vec![3, 4], 0), "FCFS: arrival order");
    assert_eq!(
        run(true),
        (vec![4, 3], 0),
        "priority: the urgent request first, once request 1 is done (no preemption)"
    );
}

#[test]
fn priority_policy_preempts_the_lowest_priority_when_blocks_run_out() {
    // 9 usable blocks of 4 tokens: two 12-token prompts (3 blocks each) that grow to 6 blocks
    // each: both cannot finish together.
    let mut e = Engine::new(EngineConfig {
        priority_scheduling: true,
        ..cfg(10)
    });
    // Request 2 arrives later but ranks first in the batch order: FCFS would preempt it as the
    // newest too, so give the later arrival the higher priority.
    e.add_request(prio(1, 7, 12, 12));
    e.add_request(prio(2, 0, 12, 12));
    let mut preempted_low = false;
    for _ in 0..200 {
        let step = e.schedule();
        if step.preempted > 0 {
            // The victim is the priority-7 request, not the newest (FCFS would take 2).
            let waiting: Vec<_> = e.waiting.iter().map(|r| r.id).collect();
            assert_eq!(waiting, [1]);
            preempted_low = true;
        }
        let _ = e.complete(&step);
        if !e.has_work() {
            break;
        }
    }
    assert!(
        preempted_low,
        "the cache ran short and the low-priority request gave way"
    );
    assert!(!e.has_work());
}

/// `--assume-cached-header`: runs `r` alone and returns (model TTFT in ms under the default timing
/// model, the (id, cached) it started with, the free blocks while it ran, the events of its
/// admission: those published before its first step ran).
fn ttft_alone(e: &mut Engine, r: NewRequest) -> (f64, (RequestId, usize), usize, Vec<KvEvent>) {
    let timing = crate::config::TimingModel::default();
    e.add_request(r);
    let (mut t, mut started, mut free, mut first_events) = (0.0, None, 0, None);
    loop {
        let step = e.schedule();
        assert!(!step.is_empty(), "nothing scheduled");
        t += timing.step_ms(step.prefill_tokens, step.decode_seqs, step.kv_usage);
        if started.is_none() {
            started = step.started.first().copied();
            free = e.num_free_blocks();
            first_events = Some(e.take_events());
        }
        let outs = e.complete(&step);
        if !outs.is_empty() {
            drain(e, 100);
            return (t, started.expect("started"), free, first_events.unwrap());
        }
    }
}

fn assuming(mut c: EngineConfig) -> EngineConfig {
    c.assume_cached = true;
    c
}

fn stored(ev: &[KvEvent]) -> Vec<(Vec<u64>, Option<u64>, usize)> {
    ev.iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } => Some((block_hashes.clone(), *parent_block_hash, token_ids.len())),
            _ => None,
        })
        .collect()
}

#[test]
fn assumed_cached_prefix_costs_and_pins_what_a_real_cached_prefix_does() {
    // Real: a first request computes 80 tokens (20 blocks of 4), a second one shares them.
    let shared: Vec<u32> = (0..80).collect();
    let mut long = shared.clone();
    long.extend(1000..1400); // 100 more blocks: a prefill step well above a decode step
    let mut real = Engine::new(cfg(512));
    real.add_request(req(1, shared.clone(), 1));
    let (_, _, warm_events) = drain(&mut real, 100);
    let (real_ttft, real_started, real_free, _) = ttft_alone(&mut real, req(2, long.clone(), 1));

    // Assumed: a cold engine told by the header that the first 82 tokens are cached (20 full
    // blocks; the partial block does not count).
    let mut cold = Engine::new(assuming(cfg(512)));
    let warm_free = cold.num_free_blocks();
    let r = NewRequest {
        assumed_cached_tokens: 82,
        ..req(2, long.clone(), 1)
    };
    let (ttft, started, free, events) = ttft_alone(&mut cold, r);
    assert_eq!(started, (2, 80));
    assert_eq!(started, real_started);
    assert!((ttft - real_ttft).abs() < 1e-9, "{ttft} vs {real_ttft}");
    // The assumed blocks are held by the running request like the real hit: same free count
    // (the real engine's idle warm blocks are evictable, so free counts match).
    assert_eq!(free, real_free);
    // 20 assumed blocks + the first 64-token chunk's 16 (max_num_batched_tokens 64).
    assert_eq!(warm_free - free, 20 + 16);
    // Reported stored exactly as the warm-up request's own prompt blocks were.
    let assumed = stored(&events);
    let warm: Vec<u64> = stored(&warm_events)
        .into_iter()
        .flat_map(|(h, _, _)| h)
        .collect();
    assert_eq!(assumed, vec![(warm[..20].to_vec(), None, 80)]);
    assert_eq!(cold.counters.prefix_cache_hits, 80);
    // Cached afterwards: a plain request with the same prefix hits them.
    let (_, s, _) = {
        cold.add_request(req(3, long.clone(), 1));
        drain(&mut cold, 100)
    };
    assert_eq!(s, vec![(3, long.len() - 4)]);
}

#[test]
fn assumed_blocks_fill_the_gaps_of_a_partial_hit_and_are_capped_by_the_prompt() {
    let prompt: Vec<u32> = (0..40).collect(); // 10 blocks
    let mut e = Engine::new(assuming(cfg(128)));
    e.add_request(req(1, prompt[..8].to_vec(), 1)); // 2 blocks really cached
    let (_, _, ev) = drain(&mut e, 100);
    let held = stored(&ev)[0].0.clone();
    // The header claims more than the prompt: capped at 9 blocks (one token is always computed).
    let r = NewRequest {
        assumed_cached_tokens: 1_000,
        ..req(2, prompt.clone(), 1)
    };
    let (_, started, _, events) = ttft_alone(&mut e, r);
    assert_eq!(started, (2, 36));
    let s = stored(&events);
    // Blocks 2..9 are new, chained to the held block 1; nothing re-reported for blocks 0 and 1.
    assert_eq!(s[0].0.len(), 7);
    assert_eq!(s[0].1, Some(held[1]));
    assert_eq!(s[0].2, 28);
    assert!(s[0].0.iter().all(|h| !held.contains(h)));
}

#[test]
fn assumed_cached_tokens_are_ignored_without_the_flag() {
    let prompt: Vec<u32> = (0..40).collect();
    let mut e = Engine::new(cfg(128));
    let r = NewRequest {
        assumed_cached_tokens: 32,
        ..req(1, prompt, 1)
    };
    let (_, started, _, events) = ttft_alone(&mut e, r);
    assert_eq!(started, (1, 0));
    assert!(stored(&events).is_empty(), "{events:?}");
    assert_eq!(e.counters.prefix_cache_hits, 0);
}
