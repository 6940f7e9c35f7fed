//! Cost with two gateway replicas in front of the same workers (the Helm chart runs two): each
//! replica accrues every worker's full cost, so the documented fleet queries aggregate with
//! `max by (worker)` and the fleet's cost rate equals the configured rate, not twice it; the
//! traffic share of each replica splits it (docs/metrics.md, "Cost with several replicas").

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvgate_system_tests::harness::*;

const MODEL: &str = "kvgate-sim";

/// `family{worker="W"} value` samples of one family, by worker.
fn by_worker(text: &str, family: &str) -> BTreeMap<String, f64> {
    let prefix = format!("{family}{{worker=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (w, v) = rest.split_once("\"} ")?;
            Some((w.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// PromQL's `sum(max by (worker) (X))` over the replicas' samples.
fn sum_of_max(replicas: &[BTreeMap<String, f64>]) -> f64 {
    let mut max: BTreeMap<&str, f64> = BTreeMap::new();
    for r in replicas {
        for (w, v) in r {
            let e = max.entry(w).or_insert(f64::MIN);
            *e = e.max(*v);
        }
    }
    max.values().sum()
}

fn scrape(gws: &[SocketAddr], family: &str) -> Vec<BTreeMap<String, f64>> {
    gws.iter()
        .map(|gw| {
            let (s, text) = http(*gw, "GET", "/metrics", None);
            assert_eq!(s, 200);
            by_worker(&text, family)
        })
        .collect()
}

/// As [`scrape`], each with the instants just before its request and just after its answer.
fn scrape_timed(
    gws: &[SocketAddr],
    family: &str,
) -> Vec<(BTreeMap<String, f64>, Instant, Instant)> {
    gws.iter()
        .map(|gw| {
            let sent = Instant::now();
            let got = scrape(&[*gw], family).remove(0);
            (got, sent, Instant::now())
        })
        .collect()
}

#[test]
fn two_replicas_do_not_double_the_fleet_cost() {
    let (_a, wa) = start_sim(MODEL);
    let (_b, wb) = start_sim(MODEL);
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("kvgate.toml");
    // $3600/h = $1/s and $7200/h = $2/s: the fleet costs $3/s, whatever the number of replicas.
    std::fs::write(
        &cfg_path,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n\
             [[workers]]\nurl = \"http://{wa}\"\nname = \"a\"\nmodels = [\"{MODEL}\"]\ncost_per_hour = 3600.0\ngpus = 2\n\
             [[workers]]\nurl = \"http://{wb}\"\nname = \"b\"\nmodels = [\"{MODEL}\"]\ncost_per_hour = 7200.0\n"
        ),
    )
    .unwrap();
    let mut procs = Vec::new();
    let mut gws = Vec::new();
    for _ in 0..2 {
        let mut p = Proc::kvgate(
            "kvgate serve",
            &["serve", "--config", cfg_path.to_str().unwrap()],
        );
        gws.push(p.wait_for(Duration::from_secs(20), serving_addr));
        procs.push(p);
    }
    let plain = format!(r#"{{"model":"{MODEL}","prompt":"hello there","max_tokens":2}}"#);
    for gw in &gws {
        let (s, body) = http(*gw, "POST", "/v1/completions", Some(&plain));
        assert_eq!(s, 200, "{body}");
    }

    // The rate gauge: every replica exports the same figure, so max by worker is the fleet's.
    let rates = scrape(&gws, "kvgate_worker_cost_per_hour");
    assert_eq!(sum_of_max(&rates), 10_800.0, "{rates:?}");
    let plain_sum: f64 = rates.iter().flat_map(|r| r.values()).sum();
    assert_eq!(
        plain_sum, 21_600.0,
        "a plain sum counts every worker once per replica"
    );
    let gpus = scrape(&gws, "kvgate_worker_gpus");
    assert_eq!(sum_of_max(&gpus), 3.0, "{gpus:?}");

    // The dollars counter: its increase over a window, aggregated with max by worker, is the
    // fleet's cost over that window, not twice it. A replica accrues at the instant it serves
    // `/metrics`, which lies between sending the scrape and reading its answer: each replica's
    // window is bracketed by the test's clock, however slowly a busy machine answers.
    let before = scrape_timed(&gws, "kvgate_cost_dollars_total");
    std::thread::sleep(Duration::from_secs(1));
    let after = scrape_timed(&gws, "kvgate_cost_dollars_total");
    const FLEET_RATE: f64 = 3.0; // $/s
                                 // 1 ms: the accrual counts whole milliseconds of each worker's life.
    let slack = 0.002;
    let mut windows = Vec::new();
    for ((b, b_sent, b_got), (a, a_sent, a_got)) in before.iter().zip(&after) {
        let (shortest, longest) = (
            (*a_sent - *b_got).as_secs_f64() - slack,
            (*a_got - *b_sent).as_secs_f64() + slack,
        );
        let increase: BTreeMap<String, f64> =
            a.iter().map(|(w, v)| (w.clone(), v - b[w])).collect();
        // Every replica accrues the whole fleet's cost (so a plain sum doubles it).
        let mine: f64 = increase.values().sum();
        eprintln!(
            "measured: a replica accrued {mine:.4} $ over {shortest:.3}..{longest:.3} s (configured {FLEET_RATE} $/s)"
        );
        assert!(
            (FLEET_RATE * shortest..=FLEET_RATE * longest).contains(&mine),
            "a replica accrued {mine} $ over {shortest}..{longest} s: {increase:?}"
        );
        windows.push((increase, shortest, longest));
    }
    let increases: Vec<BTreeMap<String, f64>> = windows.iter().map(|w| w.0.clone()).collect();
    let shortest = windows.iter().map(|w| w.1).fold(f64::MAX, f64::min);
    let longest = windows.iter().map(|w| w.2).fold(0.0, f64::max);
    let fleet = sum_of_max(&increases);
    assert!(
        (FLEET_RATE * shortest..=FLEET_RATE * longest).contains(&fleet),
        "max by worker: {fleet} $ over {shortest}..{longest} s, configured {FLEET_RATE} $/s: \
         {increases:?}"
    );
    let plain: f64 = increases.iter().flat_map(|r| r.values()).sum();
    assert!(
        plain >= 2.0 * FLEET_RATE * shortest,
        "a plain sum counts the fleet once per replica: {plain} $ over {shortest}..{longest} s"
    );
    for p in procs {
        drop(p);
    }
}
