use super::*;

const VLLM: &str = include_str!("../../tests/fixtures/metrics_vllm_0.33.prom");
const SGLANG: &str = include_str!("../../tests/fixtures/metrics_sglang.prom");
const TRTLLM: &str = include_str!("../../tests/fixtures/metrics_trtllm.prom");
const LLAMACPP: &str = include_str!("../../tests/fixtures/metrics_llamacpp.prom");

#[test]
fn vllm_sample_parses_without_errors() {
    let e = parse(VLLM);
    assert_eq!(e.bad_lines, 0, "{:?}", e.first_error);
    assert_eq!(e.sum("vllm:num_requests_running", |_| true), Some(5.0));
    assert_eq!(
        e.find("vllm:num_requests_waiting", |s| s.label("engine")
            == Some("0"))
            .unwrap()
            .value,
        1.0
    );
    assert_eq!(e.value("vllm:kv_cache_usage_perc"), Some(0.4375));
    let info = e
        .find("vllm:cache_config_info", |s| s.label("engine") == Some("1"))
        .unwrap();
    assert_eq!(info.label("block_size"), Some("16"));
    assert_eq!(info.label("num_gpu_blocks"), Some("27413"));
    assert_eq!(e.type_of("vllm:cache_config_info"), Some(MetricType::Gauge));
    // Two DP engines of 27413 blocks each.
    let engines = e.samples_named("vllm:cache_config_info").count() as u64;
    assert_eq!(
        VllmCacheConfig::read(&e),
        VllmCacheConfig {
            block_size: Some(16),
            num_gpu_blocks: Some(27413 * engines),
        }
    );
    assert_eq!(
        VllmCacheConfig::read(&parse(SGLANG)),
        VllmCacheConfig::default()
    );
    assert_eq!(
        e.sum("vllm:prefix_cache_hits_total", |_| true),
        Some(130112.0)
    );
    // `_created` samples are ordinary samples under their own name; lookups by name skip them
    assert!(e.value("vllm:prefix_cache_queries_created").unwrap() > 1.7e9);
    let inf = e
        .find("vllm:time_to_first_token_seconds_bucket", |s| {
            s.label("le") == Some("+Inf")
        })
        .unwrap();
    assert_eq!(inf.value, 422.0);
    assert_eq!(
        e.find("vllm:lora_requests_info", |_| true)
            .unwrap()
            .label("running_lora_adapters"),
        Some("")
    );
}

#[test]
fn sglang_trtllm_llamacpp_samples_parse() {
    let s = parse(SGLANG);
    assert_eq!(s.bad_lines, 0);
    assert_eq!(s.value("sglang:num_running_reqs"), Some(4.0));
    assert_eq!(s.value("sglang:num_queue_reqs"), Some(2.0));
    assert_eq!(s.value("sglang:token_usage"), Some(0.31));
    let t = parse(TRTLLM);
    assert_eq!(t.bad_lines, 0);
    assert_eq!(t.value("trtllm_num_requests_running"), Some(5.0));
    assert_eq!(t.value("trtllm_kv_cache_utilization"), Some(0.52));
    let l = parse(LLAMACPP);
    assert_eq!(l.bad_lines, 0);
    assert_eq!(l.value("llamacpp:requests_processing"), Some(1.0));
    assert_eq!(l.value("llamacpp:requests_deferred"), Some(0.0));
    assert_eq!(l.value("llamacpp:prompt_tokens_total"), Some(4812.0));
}

#[test]
fn escapes_special_values_timestamps_and_eof() {
    let text = "# TYPE a gauge\n\n\
        a{path=\"C:\\\\dir\",msg=\"say \\\"hi\\\"\\nbye\"} 1 1700000000000\n\
        b NaN\n c +Inf\nd{} -Inf\ne 1.5e-3 # {trace_id=\"x\"} 1.0\n\
        {\"my.metric\", le=\"1\"} 2\n\
        # EOF\n\
        after_eof 1\n";
    let e = parse(text);
    assert_eq!(e.bad_lines, 0, "{:?}", e.first_error);
    assert!(e.eof);
    let a = e.find("a", |_| true).unwrap();
    assert_eq!(a.label("path"), Some("C:\\dir"));
    assert_eq!(a.label("msg"), Some("say \"hi\"\nbye"));
    assert_eq!(a.timestamp, Some(1.7e12));
    assert!(e.value("b").unwrap().is_nan());
    assert_eq!(e.value("c"), Some(f64::INFINITY));
    assert_eq!(e.value("d"), Some(f64::NEG_INFINITY));
    assert_eq!(e.value("e"), Some(0.0015));
    assert_eq!(
        e.find("my.metric", |s| s.label("le") == Some("1"))
            .unwrap()
            .value,
        2.0
    );
    assert_eq!(e.value("after_eof"), None);
    // unescaped values borrow from the input
    assert!(matches!(
        e.find("my.metric", |_| true).unwrap().labels[0].1,
        Cow::Borrowed(_)
    ));
}

#[test]
fn bad_lines_are_counted_not_fatal() {
    let e = parse(
        "ok 1\n9bad 1\nx{a=\"1\" 2\nnovalue\nx{a=1} 3\ny 1 2 3\nz notanumber\nfine{a=\"b\"} 4\n",
    );
    assert_eq!(e.bad_lines, 6);
    assert_eq!(e.first_error.map(|(n, _)| n), Some(2));
    assert_eq!(e.value("ok"), Some(1.0));
    assert_eq!(e.value("fine"), Some(4.0));
}

proptest::proptest! {
    #[test]
    fn arbitrary_text_never_panics(s in ".{0,300}") {
        let _ = parse(&s);
    }
}
