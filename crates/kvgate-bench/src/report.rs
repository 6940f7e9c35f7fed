//! Reports: the human summary of one run, the compare table (markdown) and the JSON written
//! beside it.

use std::fmt::Write;

use serde::Serialize;

use crate::oracle::Oracle;
use crate::stats::Summary;

/// One policy's (or external router's) result in a comparison.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRow {
    pub policy: String,
    pub summary: Summary,
    /// hit rate / infinite-cache oracle hit rate.
    pub hit_over_oracle: Option<f64>,
    /// Time-averaged running requests per worker (from the workers' /metrics).
    pub worker_mean_running: Vec<f64>,
    /// max over workers / mean over workers of `worker_mean_running` (1.0 = perfectly even).
    pub load_max_over_mean: Option<f64>,
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_string(), |v| format!("{v:.digits$}"))
}

/// The human summary of `kvgate bench run`.
pub fn run_text(s: &Summary, oracle: Option<&Oracle>) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "requests: {} ok, {} failed in {:.1} s",
        s.succeeded,
        s.requests - s.succeeded,
        s.duration_s
    );
    for (k, n) in &s.errors {
        let _ = writeln!(t, "  error {k}: {n}");
    }
    let _ = writeln!(
        t,
        "throughput: {:.2} req/s, {:.0} tok/s in, {:.0} tok/s out",
        s.req_per_s, s.input_tok_per_s, s.output_tok_per_s
    );
    for (name, p) in [("TTFT", &s.ttft_ms), ("ITL", &s.itl_ms), ("e2e", &s.e2e_ms)] {
        let _ = writeln!(
            t,
            "{name:>5} ms: mean {:.1}  p50 {:.1}  p90 {:.1}  p95 {:.1}  p99 {:.1}  max {:.1}",
            p.mean, p.p50, p.p90, p.p95, p.p99, p.max
        );
    }
    let _ = writeln!(
        t,
        "goodput: {:.2} req/s ({:.1}% of requests within SLO)",
        s.goodput_req_per_s,
        s.goodput_fraction * 100.0
    );
    let _ = write!(t, "cache hit rate: {}", opt(s.hit_rate, 3));
    if let Some(o) = oracle {
        let _ = write!(
            t,
            " (oracle: infinite {:.3}, pooled LRU {} at {} blocks of {})",
            o.infinite_hit_rate,
            opt(o.capacity_hit_rate, 3),
            o.capacity_blocks.map_or("–".into(), |c| c.to_string()),
            o.block_size
        );
    }
    t.push('\n');
    t
}

/// The markdown comparison table.
pub fn compare_table(rows: &[PolicyRow], oracle: &Oracle) -> String {
    let mut t = String::from(
        "| policy | hit | hit/oracle | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | e2e p99 ms | req/s | goodput req/s | max/mean load | errors |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let s = &r.summary;
        let _ = writeln!(
            t,
            "| {} | {} | {} | {:.1} | {:.1} | {:.2} | {:.1} | {:.2} | {:.2} | {} | {} |",
            r.policy,
            opt(s.hit_rate, 3),
            opt(r.hit_over_oracle, 2),
            s.ttft_ms.p50,
            s.ttft_ms.p99,
            s.itl_ms.p50,
            s.e2e_ms.p99,
            s.req_per_s,
            s.goodput_req_per_s,
            opt(r.load_max_over_mean, 2),
            s.requests - s.succeeded,
        );
    }
    let _ = writeln!(
        t,
        "\noracle hit rate (block {}): infinite cache {:.3}; one pooled LRU cache of {} blocks {}",
        oracle.block_size,
        oracle.infinite_hit_rate,
        oracle.capacity_blocks.map_or("–".into(), |c| c.to_string()),
        opt(oracle.capacity_hit_rate, 3),
    );
    t
}

/// max / mean of per-worker averages (None when there is no load at all).
pub fn max_over_mean(per_worker: &[f64]) -> Option<f64> {
    if per_worker.is_empty() {
        return None;
    }
    let mean = per_worker.iter().sum::<f64>() / per_worker.len() as f64;
    let max = per_worker.iter().copied().fold(0.0, f64::max);
    (mean > 0.0).then(|| max / mean)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{summarize, Outcome, Slo};
    use std::time::Duration;

    #[test]
    fn table_has_one_row_per_policy() {
        let s = summarize(
            &[Outcome {
                ttft: Some(Duration::from_millis(12)),
                prompt_tokens: 10,
                cached_tokens: Some(5),
                ..Default::default()
            }],
            Duration::from_secs(1),
            Slo::default(),
        );
        let o = Oracle {
            block_size: 16,
            prompt_tokens: 10,
            infinite_hit_rate: 0.8,
            capacity_blocks: Some(100),
            capacity_hit_rate: Some(0.7),
        };
        let rows = vec![PolicyRow {
            policy: "kv".into(),
            summary: s,
            hit_over_oracle: Some(0.5 / 0.8),
            worker_mean_running: vec![1.0, 3.0],
            load_max_over_mean: max_over_mean(&[1.0, 3.0]),
        }];
        let t = compare_table(&rows, &o);
        assert!(t.contains("| kv | 0.500 | 0.62 | 12.0 |"), "{t}");
        assert!(t.contains("| 1.50 | 0 |"), "{t}");
        assert!(t.contains("infinite cache 0.800"), "{t}");
        assert_eq!(max_over_mean(&[0.0, 0.0]), None);
    }
}
