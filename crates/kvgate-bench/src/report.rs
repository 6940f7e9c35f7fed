//! Reports: the human summary of one run, the compare table (markdown) and the JSON written
//! beside it.

use std::fmt::Write;

use serde::Serialize;

use crate::compare::gateways::LagHistogram;
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
    /// Gateway replicas the client spread the requests over, in turn (1 for an external router).
    pub replicas: usize,
    /// Whether those replicas shared routing state over NATS (`[cluster]`).
    pub cluster: bool,
    /// Per gateway replica: requests the client sent to it and requests it counted itself.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replica_traffic: Vec<ReplicaTraffic>,
    /// `kvgate_cluster_sync_lag_seconds` summed over the replicas (rows with the cluster on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_lag: Option<LagHistogram>,
    /// Means per request from the workers' own histograms over the row (`compare/engine.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<crate::compare::engine::EngineSplit>,
    /// A `--loaded-floor` row (`floor:<policy>`): every request carried the infinite cache's hit
    /// in the sims' assumed-cache header.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub loaded_floor: bool,
    /// This row's TTFT p50 and p99 over the loaded floor's ([`LoadedFloor`]); other rows only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_loaded_floor: Option<FloorRatio>,
}

/// The loaded floor of a `bench compare --loaded-floor` run: the best TTFT p50 and the best p99
/// among its `floor:` rows (each may come from a different row).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LoadedFloor {
    /// The `floor:` rows it is the best of.
    pub rows: Vec<String>,
    pub p50_ms: f64,
    pub p50_row: String,
    pub p99_ms: f64,
    pub p99_row: String,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct FloorRatio {
    pub p50: f64,
    pub p99: f64,
}

/// Below this hit ÷ oracle a `floor:` row did not get the hits it asked for (sims without
/// `--assume-cached-header`): flagged in the table.
const FLOOR_HIT_MIN: f64 = 0.95;

/// The loaded floor of `rows`: the best p50 and p99 of the `floor:` rows that served requests
/// and got their hits.
pub fn loaded_floor(rows: &[PolicyRow]) -> Option<LoadedFloor> {
    let floor: Vec<&PolicyRow> = rows
        .iter()
        .filter(|r| {
            r.loaded_floor
                && r.summary.succeeded > 0
                && r.hit_over_oracle.is_none_or(|h| h >= FLOOR_HIT_MIN)
        })
        .collect();
    let best = |q: fn(&PolicyRow) -> f64| {
        floor
            .iter()
            .min_by(|a, b| q(a).total_cmp(&q(b)))
            .map(|r| (q(r), r.policy.clone()))
    };
    let (p50_ms, p50_row) = best(|r| r.summary.ttft_ms.p50)?;
    let (p99_ms, p99_row) = best(|r| r.summary.ttft_ms.p99)?;
    Some(LoadedFloor {
        rows: floor.iter().map(|r| r.policy.clone()).collect(),
        p50_ms,
        p50_row,
        p99_ms,
        p99_row,
    })
}

/// Sets every other row's ratio to the loaded floor; returns the floor.
pub fn apply_loaded_floor(rows: &mut [PolicyRow]) -> Option<LoadedFloor> {
    let f = loaded_floor(rows)?;
    for r in rows
        .iter_mut()
        .filter(|r| !r.loaded_floor && r.summary.succeeded > 0)
    {
        r.over_loaded_floor = (f.p50_ms > 0.0 && f.p99_ms > 0.0).then(|| FloorRatio {
            p50: r.summary.ttft_ms.p50 / f.p50_ms,
            p99: r.summary.ttft_ms.p99 / f.p99_ms,
        });
    }
    Some(f)
}

/// One gateway replica's share of a row's requests.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaTraffic {
    /// Requests the client sent to this replica.
    pub sent: u64,
    /// `kvgate_requests_total` on its `/metrics` (every label) after the run; None if unreadable.
    pub served: Option<u64>,
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

/// The markdown comparison table. A `replicas` column is added when a row ran more than one
/// gateway replica, and a line per replicated row after the oracle's (requests per replica, and
/// the cluster's sync lag).
pub fn compare_table(rows: &[PolicyRow], oracle: &Oracle) -> String {
    let replicated = rows.iter().any(|r| r.replicas > 1);
    let mut t = String::from(
        "| policy | hit | hit/oracle | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | e2e p99 ms | req/s | goodput req/s | max/mean load | errors |",
    );
    t.push_str(if replicated { " replicas |\n" } else { "\n" });
    t.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    t.push_str(if replicated { "---:|\n" } else { "\n" });
    for r in rows {
        let s = &r.summary;
        let _ = write!(
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
        if replicated {
            let _ = write!(t, " {} |", replicas_cell(r));
        }
        t.push('\n');
    }
    let _ = writeln!(
        t,
        "\noracle hit rate (block {}): infinite cache {:.3}; one pooled LRU cache of {} blocks {}",
        oracle.block_size,
        oracle.infinite_hit_rate,
        oracle.capacity_blocks.map_or("–".into(), |c| c.to_string()),
        opt(oracle.capacity_hit_rate, 3),
    );
    if let Some(f) = &oracle.ttft_floor {
        let _ = writeln!(
            t,
            "TTFT floor (every request at the infinite cache's hit, alone on an idle sim): p50 {:.1} ms, p99 {:.1} ms, mean {:.1} ms",
            f.p50_ms, f.p99_ms, f.mean_ms
        );
    }
    if let Some(f) = loaded_floor(rows) {
        let _ = writeln!(
            t,
            "TTFT loaded floor (every request at the infinite cache's hit on any worker, best of: {}): p50 {:.1} ms ({}), p99 {:.1} ms ({})",
            f.rows.join(", "),
            f.p50_ms,
            f.p50_row,
            f.p99_ms,
            f.p99_row
        );
        let ratios: Vec<String> = rows
            .iter()
            .filter_map(|r| {
                r.over_loaded_floor
                    .map(|x| format!("{} {:.2} / {:.2}", r.policy, x.p50, x.p99))
            })
            .collect();
        if !ratios.is_empty() {
            let _ = writeln!(
                t,
                "TTFT p50 / p99 ÷ the loaded floor's: {}",
                ratios.join("; ")
            );
        }
    }
    for r in rows.iter().filter(|r| r.loaded_floor) {
        if let Some(h) = r.hit_over_oracle.filter(|&h| h < FLOOR_HIT_MIN) {
            let _ = writeln!(
                t,
                "warning: {} reached only {h:.2} of the oracle's hit: its sims did not honour the assumed-cache header (kvgate sim --assume-cached-header), so it is no floor",
                r.policy
            );
        }
    }
    if rows.iter().any(|r| r.engine.is_some()) {
        let _ = writeln!(
            t,
            "\nat the engines, mean per request (ms): wait for the step in progress / queued / scheduled → first token"
        );
        for r in rows {
            if let Some(e) = &r.engine {
                let _ = writeln!(
                    t,
                    "{}: {} / {} / {}",
                    r.policy,
                    opt(e.step_wait_ms, 1),
                    opt(e.queue_ms, 1),
                    opt(e.prefill_ms, 1)
                );
            }
        }
    }
    for r in rows.iter().filter(|r| r.replicas > 1) {
        let list = |f: &dyn Fn(&ReplicaTraffic) -> String| {
            r.replica_traffic
                .iter()
                .map(f)
                .collect::<Vec<_>>()
                .join("/")
        };
        let _ = write!(
            t,
            "{}: requests per replica sent {}, served {}",
            r.policy,
            list(&|x| x.sent.to_string()),
            list(&|x| x.served.map_or("?".into(), |n| n.to_string())),
        );
        if let Some(h) = &r.sync_lag {
            let _ = write!(
                t,
                "; sync lag over {} messages: mean {} ms, p99 ≤ {}",
                h.count,
                opt(h.mean_ms(), 2),
                h.quantile_bound_ms(0.99)
                    .map_or("–".into(), |v| format!("{v} ms")),
            );
        }
        t.push('\n');
    }
    t
}

fn replicas_cell(r: &PolicyRow) -> String {
    match (r.replicas, r.cluster) {
        (1, _) => "1".into(),
        (n, true) => format!("{n} (cluster)"),
        (n, false) => format!("{n} (no cluster)"),
    }
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
            ttft_floor: Some(crate::oracle::TtftFloor {
                p50_ms: 21.25,
                p99_ms: 40.0,
                mean_ms: 25.0,
            }),
        };
        let rows = vec![PolicyRow {
            policy: "kv".into(),
            summary: s,
            hit_over_oracle: Some(0.5 / 0.8),
            worker_mean_running: vec![1.0, 3.0],
            load_max_over_mean: max_over_mean(&[1.0, 3.0]),
            replicas: 1,
            cluster: false,
            replica_traffic: vec![],
            sync_lag: None,
            engine: None,
            loaded_floor: false,
            over_loaded_floor: None,
        }];
        let t = compare_table(&rows, &o);
        assert!(!t.contains("at the engines"), "{t}");
        assert!(t.contains("| kv | 0.500 | 0.62 | 12.0 |"), "{t}");
        assert!(t.contains("| 1.50 | 0 |\n"), "{t}");
        assert!(t.contains("infinite cache 0.800"), "{t}");
        assert!(t.contains("p50 21.2 ms, p99 40.0 ms, mean 25.0 ms"), "{t}");
        assert!(!t.contains("replicas"), "{t}");
        assert_eq!(max_over_mean(&[0.0, 0.0]), None);

        // The engines' split, when the workers export it.
        let mut split = rows[0].clone();
        split.engine = Some(crate::compare::engine::EngineSplit {
            step_wait_ms: Some(12.25),
            queue_ms: Some(0.5),
            prefill_ms: None,
        });
        let t = compare_table(&[split], &o);
        assert!(t.contains("kv: 12.2 / 0.5 / –\n"), "{t}");

        // Replicated rows: a replicas column and a line each.
        let mut two = rows[0].clone();
        two.policy = "kv2".into();
        two.replicas = 2;
        two.cluster = true;
        two.replica_traffic = vec![
            ReplicaTraffic {
                sent: 3,
                served: Some(3),
            },
            ReplicaTraffic {
                sent: 2,
                served: None,
            },
        ];
        two.sync_lag = Some(LagHistogram {
            buckets: vec![("0.005".into(), 4), ("+Inf".into(), 4)],
            sum_s: 0.004,
            count: 4,
        });
        // Loaded floor: the best p50 and the best p99 of the `floor:` rows that got their hits.
        let floor = |name: &str, p50: f64, p99: f64, hit: f64| {
            let mut r = rows[0].clone();
            r.policy = name.into();
            r.loaded_floor = true;
            r.summary.ttft_ms.p50 = p50;
            r.summary.ttft_ms.p99 = p99;
            r.hit_over_oracle = Some(hit);
            r
        };
        let mut base = rows[0].clone();
        base.summary.ttft_ms.p50 = 12.0;
        base.summary.ttft_ms.p99 = 12.0;
        let mut with_floor = vec![
            base,
            floor("floor:rr", 8.0, 30.0, 1.0),
            floor("floor:lat", 6.0, 40.0, 1.0),
            floor("floor:bad", 1.0, 1.0, 0.5),
        ];
        let f = apply_loaded_floor(&mut with_floor).expect("floor rows");
        assert_eq!((f.p50_ms, f.p50_row.as_str()), (6.0, "floor:lat"));
        assert_eq!((f.p99_ms, f.p99_row.as_str()), (30.0, "floor:rr"));
        assert_eq!(f.rows, ["floor:rr", "floor:lat"]);
        assert_eq!(
            with_floor[0].over_loaded_floor,
            Some(FloorRatio { p50: 2.0, p99: 0.4 })
        );
        assert!(with_floor[1..]
            .iter()
            .all(|r| r.over_loaded_floor.is_none()));
        let t = compare_table(&with_floor, &o);
        assert!(
            t.contains("TTFT loaded floor (every request at the infinite cache's hit on any worker, best of: floor:rr, floor:lat): p50 6.0 ms (floor:lat), p99 30.0 ms (floor:rr)\n"),
            "{t}"
        );
        assert!(t.contains("÷ the loaded floor's: kv 2.00 / 0.40\n"), "{t}");
        assert!(t.contains("warning: floor:bad reached only 0.50"), "{t}");
        assert_eq!(loaded_floor(&rows), None);
        assert!(!compare_table(&rows, &o).contains("loaded floor"));

        let t = compare_table(&[rows[0].clone(), two], &o);
        assert!(t.contains("| errors | replicas |\n"), "{t}");
        assert!(t.contains("| 1.50 | 0 | 1 |\n"), "{t}");
        assert!(t.contains("| 0 | 2 (cluster) |\n"), "{t}");
        assert!(
            t.contains("kv2: requests per replica sent 3/2, served 3/?; sync lag over 4 messages: mean 1.00 ms, p99 ≤ 5 ms\n"),
            "{t}"
        );
    }
}
