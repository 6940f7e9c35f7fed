//! GPU figures end to end: `kvgate sim --dcgm` emulates a dcgm-exporter whose figures follow its
//! load; `kvgate serve` with the worker's `dcgm_url` scrapes it and re-exports
//! `kvgate_worker_gpu_*{worker}`. Idle, the GPU reads 0 % utilisation; while long streams run,
//! utilisation and power rise; the energy counter grows; tokens per joule is computable.

use std::time::{Duration, Instant};

use kvgate_system_tests::harness::*;
use kvgate_testkit::{poll_for_blocking, poll_until_blocking, PATIENCE};

const MODEL: &str = "kvgate-sim";

#[test]
fn dcgm_figures_of_a_sim_reach_the_gateway_and_follow_its_load() {
    // Real step times (speedup 1, not the harness's 0), so streams stay running while scraped.
    let mut sim = Proc::kvgate(
        "kvgate sim",
        &[
            "sim",
            "--port",
            "0",
            "--no-kv-events",
            "--speedup",
            "1",
            "--model",
            MODEL,
            "--dcgm",
        ],
    );
    let worker = sim.wait_for(Duration::from_secs(20), |l| addr_after(l, "http="));
    sim.wait_for(Duration::from_secs(20), |l| {
        (l.trim() == "ready").then_some(())
    });
    let (s, raw) = http(worker, "GET", "/dcgm/metrics", None);
    assert_eq!(s, 200);
    assert!(raw.contains("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\""), "{raw}");
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("kvgate.toml");
    std::fs::write(
        &cfg_path,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n\
             [[workers]]\nurl = \"http://{worker}\"\nname = \"gpu-worker\"\nmodels = [\"{MODEL}\"]\n\
             dcgm_url = \"http://{worker}/dcgm/metrics\"\ntensor_parallelism = 2\nmodel_version = \"rev-7\"\n"
        ),
    )
    .unwrap();
    let mut gw_proc = Proc::kvgate(
        "kvgate serve",
        &["serve", "--config", cfg_path.to_str().unwrap()],
    );
    let gw = gw_proc.wait_for(Duration::from_secs(20), serving_addr);
    let w = "{worker=\"gpu-worker\"}";
    let metric = |name: &str| sample(&http(gw, "GET", "/metrics", None).1, &format!("{name}{w}"));

    // Idle: the figures arrive and read an idle GPU.
    let idle_energy = poll_for_blocking(PATIENCE, "the GPU figures", || {
        let text = http(gw, "GET", "/metrics", None).1;
        let e = sample(&text, &format!("kvgate_worker_gpu_energy_joules_total{w}"))?;
        assert_eq!(
            sample(&text, &format!("kvgate_worker_gpu_utilization_ratio{w}")),
            Some(0.0)
        );
        assert_eq!(
            sample(&text, &format!("kvgate_worker_gpu_count{w}")),
            Some(1.0)
        );
        assert!(sample(&text, &format!("kvgate_worker_gpu_memory_free_bytes{w}")).unwrap() > 0.0);
        Some(e)
    });
    let idle_power = metric("kvgate_worker_gpu_power_watts").expect("power");

    // Load: long streams in the background; utilisation and power must rise while they run.
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"tell me a long story about GPUs","max_tokens":1000,"ignore_eos":true,"stream":true}}"#
    );
    let streams: Vec<_> = (0..4)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || http(gw, "POST", "/v1/completions", Some(&body)).0)
        })
        .collect();
    poll_until_blocking(PATIENCE, "the GPU figures to follow the load", || {
        let util = metric("kvgate_worker_gpu_utilization_ratio").unwrap_or(0.0);
        let power = metric("kvgate_worker_gpu_power_watts").unwrap_or(0.0);
        let followed = util > 0.0 && power > idle_power;
        if followed {
            eprintln!("measured: util {util} power {power} W (idle {idle_power} W)");
        }
        followed
    });
    let energy = metric("kvgate_worker_gpu_energy_joules_total").expect("energy");
    assert!(
        energy > idle_energy,
        "energy counter did not grow: {idle_energy} → {energy}"
    );
    let ok = metric("kvgate_worker_dcgm_scrapes_total").is_none();
    assert!(ok, "scrapes carry a result label");
    let text = http(gw, "GET", "/metrics", None).1;
    assert!(
        sample(
            &text,
            "kvgate_worker_dcgm_scrapes_total{worker=\"gpu-worker\",result=\"ok\"}"
        )
        .is_some_and(|n| n >= 2.0),
        "{text}"
    );
    assert!(
        text.contains("kvgate_worker_info{worker=\"gpu-worker\",model=\"kvgate-sim\",kind=\"vllm\",gpu_type=\"kvgate sim GPU (emulated)\",gpus=\"1\",role=\"both\",tensor_parallelism=\"2\",model_version=\"rev-7\"} 1"),
        "{text}"
    );
    for t in streams {
        assert_eq!(t.join().unwrap(), 200);
    }
}

/// KV health per worker from a sim with KV events and a small cache: blocks stored and removed
/// (evictions) from the exact index, the engine's capacity, prefix-cache counters and preemptions.
#[test]
fn kv_health_of_a_small_cache_shows_evictions() {
    let mut sim = Proc::kvgate(
        "kvgate sim",
        &[
            "sim",
            "--port",
            "0",
            "--speedup",
            "0",
            "--model",
            MODEL,
            "--num-gpu-blocks",
            "40",
        ],
    );
    let worker = sim.wait_for(Duration::from_secs(20), |l| addr_after(l, "http="));
    sim.wait_for(Duration::from_secs(20), |l| {
        (l.trim() == "ready").then_some(())
    });
    let mut gw_proc = Proc::kvgate(
        "kvgate serve",
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--worker",
            &format!("http://{worker}"),
            "--model",
            MODEL,
            "--no-request-log",
        ],
    );
    let gw = gw_proc.wait_for(Duration::from_secs(20), serving_addr);
    let w = format!("{{worker=\"{worker}\"}}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut round = 0;
    loop {
        // Distinct long prompts: 40 blocks of 16 tokens hold only a few, so blocks get evicted.
        let prompt = format!("round {round} ").repeat(60);
        let body = format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":4}}"#);
        let (s, b) = http(gw, "POST", "/v1/completions", Some(&body));
        assert_eq!(s, 200, "{b}");
        round += 1;
        let text = http(gw, "GET", "/metrics", None).1;
        let get = |name: &str| sample(&text, &format!("{name}{w}"));
        let removed = get("kvgate_worker_kv_blocks_removed_total").unwrap_or(0.0);
        // The engine's counters arrive with the next load scrape (every second).
        let queries = get("kvgate_worker_prefix_cache_queries_total").unwrap_or(0.0);
        if removed > 0.0 && queries > 0.0 {
            assert!(
                get("kvgate_worker_kv_blocks_stored_total").unwrap() >= removed,
                "{text}"
            );
            assert_eq!(
                get("kvgate_worker_kv_capacity_blocks"),
                Some(40.0),
                "{text}"
            );
            assert!(
                get("kvgate_worker_prefix_cache_hits_total").is_some(),
                "{text}"
            );
            assert!(get("kvgate_worker_preemptions_total").is_some(), "{text}");
            eprintln!("measured: {removed} blocks evicted after {round} prompts");
            break;
        }
        assert!(Instant::now() < deadline, "no eviction seen:\n{text}");
    }
}
