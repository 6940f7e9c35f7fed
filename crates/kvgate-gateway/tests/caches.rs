//! Every cache's size is exported (`kvgate_cache_entries{cache}`, `kvgate_cache_bytes{cache}`) and
//! its bound comes from config: unique prompts fill the tokenizer's segment cache up to
//! `cache.tokenizer_segment_bytes` and no further; 0 turns it off.

#[path = "helpers/support.rs"]
mod support;

use support::*;

fn gauge(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing:\n{metrics}"))
}

async fn segment_cache_after_unique_prompts(bound: usize, prompts: usize) -> (f64, f64, f64) {
    let w = kvgate_gateway::mock::MockWorker::builder()
        .record(false)
        .spawn()
        .await
        .unwrap();
    let mut cfg = config_for(&[&w], "kv");
    cfg.workers[0].models = vec!["mock-model".into()];
    cfg.cache.tokenizer_segment_bytes = bound;
    let gw = gateway(cfg).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    for i in 0..prompts {
        let sys = format!("system prompt number {i}: ").repeat(20);
        let user = format!("a question nobody asked before, number {i}. ").repeat(10);
        let r = post(&c, &url, chat_body(&sys, &user, false)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let m = get(&c, &format!("{}/metrics", gw.url())).await.text();
    promtool_check(&m);
    let out = (
        gauge(&m, "kvgate_cache_entries{cache=\"tokenizer_segments\"}"),
        gauge(&m, "kvgate_cache_bytes{cache=\"tokenizer_segments\"}"),
        gauge(&m, "kvgate_cache_entries{cache=\"kv_index\"}"),
    );
    gauge(&m, "kvgate_cache_entries{cache=\"tokenizer_words\"}");
    gw.shutdown().await;
    out
}

#[tokio::test]
async fn segment_cache_size_is_exported_and_bounded_by_config() {
    // Roomy bound: every unique message is cached (2 segments per request).
    let (entries, bytes, index) = segment_cache_after_unique_prompts(1 << 20, 40).await;
    assert!(entries >= 40.0, "{entries} entries");
    assert!(
        bytes > 40.0 * 500.0 && bytes <= (1 << 20) as f64,
        "{bytes} bytes"
    );
    assert!(index > 0.0, "approximate index entries: {index}");
    // A bound smaller than what 40 requests bring: the cache stays within it.
    let bound = 16 << 10;
    let (entries_small, bytes_small, _) = segment_cache_after_unique_prompts(bound, 40).await;
    assert!(bytes_small <= bound as f64, "{bytes_small} > {bound}");
    assert!(entries_small < entries, "{entries_small} vs {entries}");
    // Off.
    let (entries_off, bytes_off, _) = segment_cache_after_unique_prompts(0, 10).await;
    assert_eq!((entries_off, bytes_off), (0.0, 0.0));
}
