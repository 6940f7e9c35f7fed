//! Per-kind parsers against the fixture texts in kvgate-protocol/tests/fixtures.

use super::*;
use crate::sink::SumCount;

macro_rules! fixture {
    ($f:literal) => {
        include_str!(concat!("../../../kvgate-protocol/tests/fixtures/", $f))
    };
}

#[test]
fn vllm_load_sums_engines_and_reads_cache_config() {
    let l = vllm::parse(&prom_text::parse(fixture!("metrics_vllm_0.33.prom"))).unwrap();
    assert_eq!((l.running, l.waiting), (Some(5), Some(1)));
    assert_eq!(l.kv_usage, Some((0.4375 + 0.125) / 2.0));
    assert_eq!(l.block_size, Some(16));
    assert_eq!(l.num_gpu_blocks, Some(2 * 27413));
    assert_eq!(l.prefix_cache_queries, Some(200800.0));
    assert_eq!(l.prefix_cache_hits, Some(130112.0));
    let core = l.core().unwrap();
    assert_eq!((core.running, core.waiting), (5, 1));
}

#[test]
fn vllm_old_names_and_missing_metrics() {
    let old = "vllm:num_requests_running{model_name=\"m\"} 2\nvllm:num_requests_waiting{model_name=\"m\"} 7\n\
               vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n";
    let l = vllm::parse(&prom_text::parse(old)).unwrap();
    assert_eq!(
        (l.running, l.waiting, l.kv_usage),
        (Some(2), Some(7), Some(0.5))
    );
    assert_eq!(
        vllm::parse(&prom_text::parse("other_metric 1\n")).unwrap_err(),
        ParseError::Missing("vllm:num_requests_running")
    );
}

#[test]
fn sglang_load_and_server_info() {
    let l = sglang::parse(&prom_text::parse(fixture!("metrics_sglang.prom"))).unwrap();
    assert_eq!(
        (l.running, l.waiting, l.kv_usage),
        (Some(4), Some(2), Some(0.31))
    );
    assert_eq!(l.prefix_cache_hits, Some(576000.0));
    let info =
        sglang::parse_server_info(fixture!("sglang_server_info.json").as_bytes(), "10.0.0.9")
            .unwrap();
    assert_eq!(info.page_size, Some(32));
    assert_eq!(
        info.kv_event_endpoints,
        vec!["tcp://10.0.0.9:5557".to_string()]
    );
    assert_eq!(info.kv_topic, "kv-events");
    assert_eq!(info.max_total_num_tokens, Some(264192));
}

#[test]
fn sglang_server_info_announces_the_disaggregation_mode() {
    use kvgate_protocol::pd::Role;
    let whole =
        sglang::parse_disaggregation(fixture!("sglang_server_info.json").as_bytes()).unwrap();
    assert_eq!(
        whole.mode,
        Some(Role::Both),
        "\"null\" is SGLang's whole-request mode"
    );
    assert_eq!(whole.bootstrap_port, Some(8998));
    let p = sglang::parse_disaggregation(fixture!("sglang_server_info_prefill.json").as_bytes())
        .unwrap();
    assert_eq!((p.mode, p.role()), (Some(Role::Prefill), Role::Prefill));
    assert_eq!(p.bootstrap_port, Some(9001));
    let d = sglang::parse_disaggregation(br#"{"disaggregation_mode":"decode"}"#).unwrap();
    assert_eq!((d.mode, d.bootstrap_port), (Some(Role::Decode), None));
    // Nothing announced (another engine's answer, JSON null, a mode unknown here): whole requests.
    for body in [
        &br#"{"vllm_config":"..."}"#[..],
        br#"{"disaggregation_mode":null,"disaggregation_bootstrap_port":null}"#,
        br#"{"disaggregation_mode":"encode","disaggregation_bootstrap_port":"x"}"#,
        br#"{"disaggregation_mode":7,"disaggregation_bootstrap_port":70000}"#,
    ] {
        let n = sglang::parse_disaggregation(body).unwrap();
        assert_eq!(
            (n.mode, n.role(), n.bootstrap_port),
            (None, Role::Both, None)
        );
    }
    assert!(sglang::parse_disaggregation(b"<html>").is_err());
}

#[test]
fn trtllm_prom_and_json() {
    let l = trtllm::parse_prom(&prom_text::parse(fixture!("metrics_trtllm.prom"))).unwrap();
    assert_eq!(
        (l.running, l.waiting, l.kv_usage),
        (Some(5), Some(1), Some(0.52))
    );
    let j = trtllm::parse_json(fixture!("metrics_trtllm_iteration_stats.json").as_bytes()).unwrap();
    assert_eq!(
        (j.running, j.waiting, j.block_size, j.num_gpu_blocks),
        (Some(4), Some(2), Some(32), Some(4096))
    );
    let idle = trtllm::parse_json(b"[]").unwrap();
    assert_eq!((idle.running, idle.waiting), (Some(0), Some(0)));
    assert!(trtllm::parse_json(b"{oops").is_err());
}

#[test]
fn llamacpp_metrics_and_slots() {
    let l = llamacpp::parse_metrics(&prom_text::parse(fixture!("metrics_llamacpp.prom"))).unwrap();
    assert_eq!((l.running, l.waiting), (Some(1), Some(0)));
    assert_eq!(
        llamacpp::parse_slots(fixture!("llamacpp_slots.json").as_bytes()).unwrap(),
        llamacpp::Slots {
            total: 2,
            busy: 1,
            ctx_tokens: 8192
        }
    );
    assert!(llamacpp::parse_slots(b"{}").is_err());
}

#[test]
fn ollama_ps_has_models_but_no_queue() {
    let l = ollama::parse_ps(fixture!("ollama_ps.json").as_bytes()).unwrap();
    assert_eq!(l.loaded_models, vec!["llama3.2:3b".to_string()]);
    assert_eq!(
        l.core(),
        None,
        "no running/waiting figures: the router uses its own accounting"
    );
}

#[test]
fn counts_and_jitter_are_bounded() {
    assert_eq!(count(f64::NAN), 0);
    assert_eq!(count(-3.0), 0);
    assert_eq!(count(2.6), 3);
    for _ in 0..100 {
        let d = jittered(Duration::from_millis(1000), 0.1);
        assert!(d >= Duration::from_millis(900) && d <= Duration::from_millis(1100));
    }
}

#[test]
fn real_llamacpp_samples() {
    let busy = llamacpp::parse_metrics(&prom_text::parse(fixture!(
        "metrics_llamacpp_real_busy.prom"
    )))
    .unwrap();
    assert_eq!((busy.running, busy.waiting), (Some(1), Some(0)));
    let after =
        llamacpp::parse_metrics(&prom_text::parse(fixture!("metrics_llamacpp_real.prom"))).unwrap();
    assert_eq!((after.running, after.waiting), (Some(0), Some(0)));
    assert_eq!(
        (after.prefix_cache_queries, after.prefix_cache_hits),
        (Some(156.0), Some(51.0))
    );
    // 105 prompt tokens processed + 360 predicted over 240 decode calls; spec decoding off (0).
    assert_eq!(
        after.iteration_tokens,
        Some(SumCount {
            sum: 465.0,
            count: 240.0
        })
    );
    assert_eq!(
        (after.spec_drafts, after.spec_accepted_tokens),
        (Some(0.0), Some(0.0))
    );
    assert_eq!(
        prom_text::parse(fixture!("metrics_llamacpp_real.prom")).bad_lines,
        0
    );
    assert_eq!(
        llamacpp::parse_slots(fixture!("llamacpp_slots_real_busy.json").as_bytes()).unwrap(),
        llamacpp::Slots {
            total: 2,
            busy: 1,
            ctx_tokens: 4096
        }
    );
    assert_eq!(
        llamacpp::parse_slots(fixture!("llamacpp_slots_real.json").as_bytes()).unwrap(),
        llamacpp::Slots {
            total: 2,
            busy: 0,
            ctx_tokens: 4096
        }
    );
}

#[test]
fn vllm_phase_timings_batching_spec_decode_and_start_time() {
    let l = vllm::parse(&prom_text::parse(fixture!(
        "metrics_vllm_0.33_timings.prom"
    )))
    .unwrap();
    let sc = |sum, count| Some(SumCount { sum, count });
    // summed over both DP engines
    assert_eq!(l.queue_time, sc(21.1 + 3.9, 500.0));
    assert_eq!(l.prefill_time, sc(40.0, 422.0));
    assert_eq!(l.decode_time, sc(1266.0, 422.0));
    assert_eq!(l.iteration_tokens, sc(150512.0 + 99488.0, 10000.0));
    assert_eq!(
        (l.spec_drafts, l.spec_draft_tokens, l.spec_accepted_tokens),
        (Some(1500.0), Some(4500.0), Some(3000.0))
    );
    assert_eq!(l.process_start_time, Some(1.76314301842e9));
    // the plain 0.33 fixture has no phase histograms and no speculative decoding
    let plain = vllm::parse(&prom_text::parse(fixture!("metrics_vllm_0.33.prom"))).unwrap();
    assert_eq!(plain.prefill_time, None);
    assert_eq!(plain.spec_drafts, None);
    assert_eq!(plain.iteration_tokens, sc(150512.0, 5301.0));
    assert_eq!(plain.preemptions, Some(2.0));
}

#[test]
fn sglang_retractions_are_preemptions_and_queue_time() {
    let l = sglang::parse(&prom_text::parse(fixture!(
        "metrics_sglang_retractions.prom"
    )))
    .unwrap();
    // the counter, not the last batch's `num_retracted_reqs` gauge
    assert_eq!(l.preemptions, Some(48.0));
    assert_eq!(
        l.queue_time,
        Some(SumCount {
            sum: 12.5,
            count: 100.0
        })
    );
    let old = sglang::parse(&prom_text::parse(fixture!("metrics_sglang.prom"))).unwrap();
    assert_eq!((old.preemptions, old.queue_time), (None, None));
}

#[test]
fn trtllm_queue_time_from_prometheus_and_iterations_from_json() {
    let text = "# HELP trtllm_num_requests_running Number of requests currently running.\n\
        # TYPE trtllm_num_requests_running gauge\n\
        trtllm_num_requests_running{model_name=\"m\",engine_type=\"trtllm\"} 2.0\n\
        # HELP trtllm_request_queue_time_seconds Histogram of time spent in WAITING phase for request.\n\
        # TYPE trtllm_request_queue_time_seconds histogram\n\
        trtllm_request_queue_time_seconds_bucket{model_name=\"m\",engine_type=\"trtllm\",le=\"0.3\"} 3.0\n\
        trtllm_request_queue_time_seconds_bucket{model_name=\"m\",engine_type=\"trtllm\",le=\"+Inf\"} 4.0\n\
        trtllm_request_queue_time_seconds_count{model_name=\"m\",engine_type=\"trtllm\"} 4.0\n\
        trtllm_request_queue_time_seconds_sum{model_name=\"m\",engine_type=\"trtllm\"} 0.8\n";
    let l = trtllm::parse_prom(&prom_text::parse(text)).unwrap();
    assert_eq!(
        l.queue_time,
        Some(SumCount {
            sum: 0.8,
            count: 4.0
        })
    );

    let body = fixture!("metrics_trtllm_iteration_stats_spec.json").as_bytes();
    let j = trtllm::parse_json(body).unwrap();
    // newest iteration's gauges and limits (runtime limits win over static ones)
    assert_eq!(j.paused, Some(1));
    assert_eq!(
        (j.max_num_batched_tokens, j.max_num_seqs),
        (Some(4096), Some(48))
    );
    // this read's increments: 1000 context tokens + 4 + 5 generation requests over 2 iterations
    assert_eq!(
        j.iteration_tokens,
        Some(SumCount {
            sum: 1009.0,
            count: 2.0
        })
    );
    // the scraper's running totals: a second identical read doubles them; an empty read keeps them
    let mut totals = trtllm::Totals::default();
    let mut a = j.clone();
    totals.accumulate(&mut a);
    let mut b = trtllm::parse_json(body).unwrap();
    totals.accumulate(&mut b);
    assert_eq!(
        b.iteration_tokens,
        Some(SumCount {
            sum: 2018.0,
            count: 4.0
        })
    );
    assert_eq!(
        (b.spec_drafts, b.spec_draft_tokens, b.spec_accepted_tokens),
        (Some(18.0), Some(54.0), Some(24.0))
    );
    let mut idle = trtllm::parse_json(b"[]").unwrap();
    totals.accumulate(&mut idle);
    assert_eq!(idle.iteration_tokens, b.iteration_tokens);
    assert_eq!(idle.spec_accepted_tokens, Some(24.0));
    // without speculative decoding the spec counters stay absent
    let mut plain =
        trtllm::parse_json(fixture!("metrics_trtllm_iteration_stats.json").as_bytes()).unwrap();
    let mut t2 = trtllm::Totals::default();
    t2.accumulate(&mut plain);
    assert_eq!(plain.spec_drafts, None);
    assert_eq!(
        plain.iteration_tokens,
        Some(SumCount {
            sum: 3.0 + 512.0 + 3.0,
            count: 2.0
        })
    );
    assert_eq!(plain.paused, Some(0));
}
