//! TTFT follows the timing model: it grows with the uncached prompt length and with load. Runs on
//! tokio's paused clock, so the only thing that moves time is the scheduler's step sleeps and the
//! measured TTFT (the sim's own histogram) can be compared with the model's prediction exactly
//! (up to tokio's 1 ms timer granularity per step).

mod support;

use kvgate_sim::engine::{Engine, EngineConfig, NewRequest};
use kvgate_sim::{SimConfig, SimWorker};
use serde_json::json;
use std::time::Duration;
use support::*;

fn cfg() -> SimConfig {
    SimConfig::default().num_gpu_blocks(4096usize).speedup(1.0)
}

/// The model's TTFT per request (ms) when `prompts` all arrive at t=0, plus the number of steps.
fn predicted(c: &SimConfig, prompts: &[Vec<u32>], warm: &[Vec<u32>]) -> (Vec<f64>, usize) {
    let mut e = Engine::new(EngineConfig {
        block_size: c.block_size,
        num_gpu_blocks: c.num_gpu_blocks,
        max_num_seqs: c.max_num_seqs,
        max_num_batched_tokens: c.max_num_batched_tokens,
        priority_scheduling: false,
        enable_prefix_caching: c.enable_prefix_caching,
        assume_cached: false,
        seed: c.seed,
        mean_output_tokens: c.mean_output_tokens,
    });
    let run = |e: &mut Engine, ps: &[Vec<u32>], base: u64| {
        for (i, p) in ps.iter().enumerate() {
            e.add_request(NewRequest {
                id: base + i as u64,
                prompt: p.clone(),
                max_tokens: 1,
                ignore_eos: true,
                kv: Default::default(),
                priority: 0,
                assumed_cached_tokens: 0,
            });
        }
        let (mut t, mut steps) = (0.0, 0);
        let mut ttft = vec![f64::NAN; ps.len()];
        while e.has_work() {
            let s = e.schedule();
            t += c
                .timing
                .step_ms(s.prefill_tokens, s.decode_seqs, s.kv_usage);
            steps += 1;
            for o in e.complete(&s) {
                let i = (o.id - base) as usize;
                if ttft[i].is_nan() {
                    ttft[i] = t;
                }
            }
        }
        (ttft, steps)
    };
    run(&mut e, warm, 1_000);
    run(&mut e, prompts, 0)
}

/// Sends `prompts` in ONE completions request (so they reach the scheduler together) and returns
/// the mean TTFT in ms the sim measured for them.
async fn measured_mean_ttft(
    w: &kvgate_sim::SimHandle,
    c: &HttpClient,
    prompts: &[Vec<u32>],
) -> f64 {
    let before = w.metrics().ttft;
    let body = json!({"prompt": prompts, "max_tokens": 1, "ignore_eos": true});
    let (st, v) = post(c, &format!("{}/v1/completions", w.base_url()), &body).await;
    assert_eq!(st, 200, "{v}");
    let after = w.metrics().ttft;
    let n = (after.count() - before.count()) as f64;
    assert_eq!(n as usize, prompts.len());
    (after.sum() - before.sum()) * 1000.0 / n
}

fn close(measured: f64, predicted: f64, steps: usize) -> bool {
    (measured - predicted).abs() <= steps as f64 * 1.0 + predicted * 0.01
}

#[tokio::test(start_paused = true)]
async fn ttft_grows_with_uncached_length_as_the_model_says() {
    let c = cfg();
    let w = SimWorker::spawn(c.clone(), "127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let http = client();
    let short = vec![ids(1, 256)];
    let long = vec![ids(2, 6000)];
    let m_short = measured_mean_ttft(&w, &http, &short).await;
    let m_long = measured_mean_ttft(&w, &http, &long).await;
    let (p_short, _) = predicted(&c, &short, &[]);
    let (p_long, _) = predicted(&c, &long, &[]);
    assert!(
        close(m_short, p_short[0], 1),
        "short: measured {m_short:.2} ms, model {:.2} ms",
        p_short[0]
    );
    assert!(
        close(m_long, p_long[0], 1),
        "long: measured {m_long:.2} ms, model {:.2} ms",
        p_long[0]
    );
    eprintln!("fidelity: ttft 256 tok measured {m_short:.2} ms, model {:.2}; 6000 tok measured {m_long:.2}, model {:.2}", p_short[0], p_long[0]);
    let ratio = m_long / m_short;
    let model_ratio = c.timing.prefill_ms(6000) / c.timing.prefill_ms(256);
    assert!(
        (ratio / model_ratio - 1.0).abs() < 0.05,
        "ratio {ratio:.3} vs model {model_ratio:.3}"
    );

    // The same long prompt again: only the last partial block is uncached → TTFT collapses.
    let m_cached = measured_mean_ttft(&w, &http, &long).await;
    let (p_cached, _) = predicted(&c, &long, &long);
    assert!(
        close(m_cached, p_cached[0], 1),
        "cached: measured {m_cached:.2}, model {:.2}",
        p_cached[0]
    );
    eprintln!(
        "fidelity: ttft 6000 tok again (cached) measured {m_cached:.2} ms, model {:.2}",
        p_cached[0]
    );
    assert!(
        m_cached * 4.0 < m_long,
        "cached {m_cached:.2} ms vs cold {m_long:.2} ms"
    );
    w.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn ttft_grows_with_load_as_the_model_says() {
    let c = cfg().max_num_batched_tokens(2048usize);
    let w = SimWorker::spawn(c.clone(), "127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let http = client();
    let alone = vec![ids(10, 1000)];
    let loaded: Vec<Vec<u32>> = (0..12).map(|i| ids(20 + i, 1000)).collect();
    let m_alone = measured_mean_ttft(&w, &http, &alone).await;
    let m_loaded = measured_mean_ttft(&w, &http, &loaded).await;
    let (p_alone, _) = predicted(&c, &alone, &[]);
    let (p_loaded, steps) = predicted(&c, &loaded, &[]);
    let p_mean = p_loaded.iter().sum::<f64>() / p_loaded.len() as f64;
    assert!(
        close(m_alone, p_alone[0], 1),
        "alone: {m_alone:.2} vs {:.2}",
        p_alone[0]
    );
    assert!(
        close(m_loaded, p_mean, steps),
        "loaded: {m_loaded:.2} vs {p_mean:.2} ({steps} steps)"
    );
    eprintln!("fidelity: ttft 1000 tok alone measured {m_alone:.2} ms, model {:.2}; 12 concurrent mean measured {m_loaded:.2}, model {p_mean:.2} ({steps} steps)", p_alone[0]);
    assert!(
        m_loaded > 3.0 * m_alone,
        "12 requests sharing 2048-token steps: {m_loaded:.1} vs {m_alone:.1} ms"
    );
    w.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_slowdown_with_a_duration_ends_and_the_worker_is_back_at_speed() {
    let mut c = cfg();
    c.faults.slowdown = Some(kvgate_sim::Slowdown {
        factor: 3.0,
        after_requests: 1,
        worker: None,
        lasts: Some(Duration::from_secs(5)),
    });
    let w = SimWorker::spawn(c.clone(), "127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let http = client();
    let (p, _) = predicted(&c, &[ids(40, 1000)], &[]);
    // Slow from the first request, for 5 s (paused clock: the sleep passes at once).
    let slow = measured_mean_ttft(&w, &http, &[ids(40, 1000)]).await;
    let still = measured_mean_ttft(&w, &http, &[ids(41, 1000)]).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let back = measured_mean_ttft(&w, &http, &[ids(42, 1000)]).await;
    assert!(close(slow, 3.0 * p[0], 1), "{slow:.2} vs {:.2}", 3.0 * p[0]);
    assert!(
        close(still, 3.0 * p[0], 1),
        "{still:.2} vs {:.2}",
        3.0 * p[0]
    );
    assert!(close(back, p[0], 1), "{back:.2} vs {:.2}", p[0]);
    w.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn slowdown_multiplies_step_times_from_the_nth_request() {
    let mut c = cfg();
    c.faults.slowdown = Some(kvgate_sim::Slowdown {
        factor: 2.0,
        after_requests: 2,
        worker: None,
        lasts: None,
    });
    let w = SimWorker::spawn(c.clone(), "127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let http = client();
    let (p, _) = predicted(&c, &[ids(30, 1000)], &[]);
    // Request 1 at full speed; from request 2 on every step takes twice as long.
    let first = measured_mean_ttft(&w, &http, &[ids(30, 1000)]).await;
    let second = measured_mean_ttft(&w, &http, &[ids(31, 1000)]).await;
    let third = measured_mean_ttft(&w, &http, &[ids(32, 1000)]).await;
    assert!(close(first, p[0], 1), "{first:.2} vs {:.2}", p[0]);
    assert!(
        close(second, 2.0 * p[0], 1),
        "{second:.2} vs {:.2}",
        2.0 * p[0]
    );
    assert!(
        close(third, 2.0 * p[0], 1),
        "{third:.2} vs {:.2}",
        2.0 * p[0]
    );
    w.shutdown().await;
}
