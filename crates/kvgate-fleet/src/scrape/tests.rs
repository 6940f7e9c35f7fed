//! Per-kind parsers against the fixture texts in kvgate-protocol/tests/fixtures.

use super::*;

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
