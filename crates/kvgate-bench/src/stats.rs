//! Per-request outcomes and their summary: hdrhistogram percentiles of TTFT, inter-token gaps and
//! end-to-end latency; throughput; cache hit rate from the workers' `cached_tokens`; goodput
//! against SLOs; errors by kind.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// When the request was sent, relative to the start of the run.
    pub sent_at: Duration,
    /// Time to the first content token.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    /// Prompt tokens (server's usage when reported, else what we sent).
    pub prompt_tokens: u64,
    /// Output tokens (server's usage when reported, else content chunks seen).
    pub output_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`, when the server reported it.
    pub cached_tokens: Option<u64>,
    /// Error kind (`connect`, `http_503`, `stream_error`, `timeout`, `truncated`, ...).
    pub error: Option<String>,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Mean inter-token gap (time per output token after the first).
    pub fn mean_itl(&self) -> Option<Duration> {
        if self.itl.is_empty() {
            None
        } else {
            Some(self.itl.iter().sum::<Duration>() / self.itl.len() as u32)
        }
    }
}

/// Service-level objectives for goodput (a request is good when it succeeded, its TTFT is within
/// `ttft` and its mean inter-token gap within `itl`; an unset SLO always passes).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Slo {
    #[serde(serialize_with = "ser_opt_ms")]
    pub ttft: Option<Duration>,
    #[serde(serialize_with = "ser_opt_ms")]
    pub itl: Option<Duration>,
}

fn ser_opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&(d.as_secs_f64() * 1e3)),
        None => s.serialize_none(),
    }
}

impl Slo {
    pub fn is_good(&self, o: &Outcome) -> bool {
        if !o.ok() {
            return false;
        }
        let ttft_ok = match (self.ttft, o.ttft) {
            (None, _) => true,
            (Some(slo), Some(t)) => t <= slo,
            (Some(_), None) => false,
        };
        let itl_ok = match (self.itl, o.mean_itl()) {
            (Some(slo), Some(t)) => t <= slo,
            _ => true,
        };
        ttft_ok && itl_ok
    }
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

/// Microsecond histogram up to one hour, 3 significant figures.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static histogram bounds are valid")
}

pub fn record(h: &mut Histogram<u64>, d: Duration) {
    let us = (d.as_micros() as u64).clamp(1, h.high());
    h.record(us).expect("value clamped into range");
}

pub fn percentiles(h: &Histogram<u64>) -> Percentiles {
    if h.is_empty() {
        return Percentiles::default();
    }
    let ms = |us: u64| us as f64 / 1e3;
    Percentiles {
        count: h.len(),
        mean: h.mean() / 1e3,
        p50: ms(h.value_at_quantile(0.50)),
        p90: ms(h.value_at_quantile(0.90)),
        p95: ms(h.value_at_quantile(0.95)),
        p99: ms(h.value_at_quantile(0.99)),
        max: ms(h.max()),
    }
}

/// The summary of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub requests: u64,
    pub succeeded: u64,
    pub errors: BTreeMap<String, u64>,
    pub duration_s: f64,
    pub req_per_s: f64,
    pub input_tok_per_s: f64,
    pub output_tok_per_s: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Sum of cached_tokens / sum of prompt tokens over successful requests that reported usage.
    pub hit_rate: Option<f64>,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub slo: Slo,
    pub good_requests: u64,
    pub goodput_req_per_s: f64,
    pub goodput_fraction: f64,
}

/// Summarises outcomes of a run that lasted `duration` (first send to last completion).
pub fn summarize(outcomes: &[Outcome], duration: Duration, slo: Slo) -> Summary {
    let (mut ttft, mut itl, mut e2e) = (new_histogram(), new_histogram(), new_histogram());
    let mut errors = BTreeMap::new();
    let (mut ok, mut good, mut ptok, mut otok) = (0u64, 0u64, 0u64, 0u64);
    let (mut cached, mut cached_of) = (0u64, 0u64);
    for o in outcomes {
        if let Some(kind) = &o.error {
            *errors.entry(kind.clone()).or_insert(0) += 1;
            continue;
        }
        ok += 1;
        ptok += o.prompt_tokens;
        otok += o.output_tokens;
        if let Some(c) = o.cached_tokens {
            cached += c;
            cached_of += o.prompt_tokens;
        }
        if let Some(t) = o.ttft {
            record(&mut ttft, t);
        }
        for &g in &o.itl {
            record(&mut itl, g);
        }
        record(&mut e2e, o.e2e);
        if slo.is_good(o) {
            good += 1;
        }
    }
    let secs = duration.as_secs_f64();
    let per_s = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    Summary {
        requests: outcomes.len() as u64,
        succeeded: ok,
        errors,
        duration_s: secs,
        req_per_s: per_s(ok),
        input_tok_per_s: per_s(ptok),
        output_tok_per_s: per_s(otok),
        prompt_tokens: ptok,
        output_tokens: otok,
        hit_rate: (cached_of > 0).then(|| cached as f64 / cached_of as f64),
        ttft_ms: percentiles(&ttft),
        itl_ms: percentiles(&itl),
        e2e_ms: percentiles(&e2e),
        slo,
        good_requests: good,
        goodput_req_per_s: per_s(good),
        goodput_fraction: if outcomes.is_empty() {
            0.0
        } else {
            good as f64 / outcomes.len() as f64
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= b * 0.001 + 1e-9
    }

    #[test]
    fn percentiles_and_goodput_match_a_hand_computed_example() {
        // Ten successful requests with TTFT 10..=100 ms; request i has two gaps of i ms each
        // (mean ITL = i ms), 100 prompt tokens of which 25 cached, 3 output tokens.
        let mut outs: Vec<Outcome> = (1..=10u64)
            .map(|i| Outcome {
                ttft: Some(ms(10 * i)),
                itl: vec![ms(i), ms(i)],
                e2e: ms(10 * i + 2 * i),
                prompt_tokens: 100,
                output_tokens: 3,
                cached_tokens: Some(25),
                ..Default::default()
            })
            .collect();
        outs.push(Outcome {
            error: Some("http_503".into()),
            ..Default::default()
        });
        let slo = Slo {
            ttft: Some(ms(50)),
            itl: Some(ms(4)),
        };
        let s = summarize(&outs, Duration::from_secs(2), slo);
        assert_eq!((s.requests, s.succeeded), (11, 10));
        assert_eq!(s.errors.get("http_503"), Some(&1));
        // Nearest-rank: p50 = 5th of 10 = 50 ms, p90 = 9th = 90 ms, p95/p99 = 10th = 100 ms.
        assert!(close(s.ttft_ms.p50, 50.0), "{:?}", s.ttft_ms);
        assert!(close(s.ttft_ms.p90, 90.0), "{:?}", s.ttft_ms);
        assert!(close(s.ttft_ms.p95, 100.0), "{:?}", s.ttft_ms);
        assert!(close(s.ttft_ms.p99, 100.0), "{:?}", s.ttft_ms);
        assert!(close(s.ttft_ms.mean, 55.0), "{:?}", s.ttft_ms);
        // 20 gaps: 1,1,2,2,...,10,10 -> p50 = 10th value = 5 ms.
        assert_eq!(s.itl_ms.count, 20);
        assert!(close(s.itl_ms.p50, 5.0), "{:?}", s.itl_ms);
        assert!(close(s.e2e_ms.max, 120.0), "{:?}", s.e2e_ms);
        // Good: TTFT <= 50 (i <= 5) and mean ITL <= 4 (i <= 4) -> 4 of 11 requests.
        assert_eq!(s.good_requests, 4);
        assert!(close(s.goodput_req_per_s, 2.0));
        assert!(close(s.goodput_fraction, 4.0 / 11.0));
        assert!(close(s.req_per_s, 5.0));
        assert!(close(s.input_tok_per_s, 500.0));
        assert!(close(s.output_tok_per_s, 15.0));
        assert_eq!(s.hit_rate, Some(0.25));
    }

    #[test]
    fn no_slo_means_every_success_is_good_and_missing_ttft_fails_a_ttft_slo() {
        let o = Outcome {
            ttft: None,
            ..Default::default()
        };
        assert!(Slo::default().is_good(&o));
        let slo = Slo {
            ttft: Some(ms(1)),
            itl: None,
        };
        assert!(!slo.is_good(&o));
        let s = summarize(&[], Duration::ZERO, slo);
        assert_eq!((s.requests, s.req_per_s, s.hit_rate), (0, 0.0, None));
    }
}
