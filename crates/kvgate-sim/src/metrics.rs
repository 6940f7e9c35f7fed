//! vLLM 0.33 `/metrics` in Prometheus text format 0.0.4: the same names, types and labels
//! (`model_name`, `engine`) a router scrapes from a real worker (interfaces.md §1).

use std::fmt::Write;

use crate::engine::{EngineCounters, FinishReason};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's `iteration_tokens_total` buckets (`cudagraph_capture_sizes`-like powers of two).
const ITERATION_TOKENS_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// `kvgate_sim_step_wait_seconds`: a request's wait for the engine step in progress at its arrival.
const STEP_WAIT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0,
];
const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }
}

const XFER_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
];
const BYTES_BUCKETS: &[f64] = &[1.0e6, 1.0e7, 5.0e7, 1.0e8, 5.0e8, 1.0e9, 5.0e9, 1.0e10];
const WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Prefill/decode figures, named as vLLM's NIXL connector names them (plus the sim's own pinned
/// gauges, which vLLM does not export).
#[derive(Debug, Clone)]
pub struct PdMetrics {
    /// Blocks held by finished prefill legs waiting for a decode worker's read.
    pub pinned_blocks: usize,
    pub pinned_requests: usize,
    /// `vllm:nixl_num_kv_expired_reqs`: pinned legs freed by their lease, never read.
    pub expired_reqs: u64,
    /// `vllm:nixl_num_failed_transfers`: decode-side reads that failed.
    pub failed_transfers: u64,
    /// Decode legs pulling their KV right now (not exported; tests wait on it instead of a sleep).
    pub pulls_in_flight: usize,
    /// `vllm:nixl_xfer_time_seconds` (charged by the transfer-time model, after the speed-up).
    pub xfer_time: Histogram,
    /// `vllm:nixl_bytes_transferred` per transfer.
    pub bytes: Histogram,
    /// SGLang bootstrap rooms open on this (prefill) worker: a leg arrived, its handoff is not
    /// over. 0 when idle; a room left behind is a leak.
    pub bootstrap_rooms: usize,
    /// Legs on this worker waiting for their partner leg right now.
    pub bootstrap_waiting: usize,
    /// How long each leg waited for its partner (both sides; timeouts included).
    pub bootstrap_wait: Histogram,
    /// Legs that gave up because their partner never came within `--bootstrap-timeout-ms`.
    pub bootstrap_timeouts: u64,
}

impl Default for PdMetrics {
    fn default() -> Self {
        Self {
            pinned_blocks: 0,
            pinned_requests: 0,
            expired_reqs: 0,
            failed_transfers: 0,
            pulls_in_flight: 0,
            xfer_time: Histogram::new(XFER_BUCKETS),
            bytes: Histogram::new(BYTES_BUCKETS),
            bootstrap_rooms: 0,
            bootstrap_waiting: 0,
            bootstrap_wait: Histogram::new(WAIT_BUCKETS),
            bootstrap_timeouts: 0,
        }
    }
}

/// Everything `/metrics` shows; the scheduler task updates it after each step.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub engine: EngineCounters,
    /// Finished requests by reason: stop, length, abort, error.
    pub success: [u64; 4],
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
    /// Scheduled → first token, and first token → finished (vLLM's PREFILL and DECODE phases).
    pub prefill: Histogram,
    pub decode: Histogram,
    /// Arrival (the HTTP handler's submit) → the scheduler taking the request in, between two
    /// steps: the wait for the step in progress. Not in vLLM's queue time, which starts when the
    /// engine core adds the request (between steps too), but in every client's TTFT.
    pub step_wait: Histogram,
    /// Tokens per engine step (prefill tokens + decoding sequences).
    pub iteration_tokens: Histogram,
    /// Speculative decoding (`--spec-tokens`): drafts, draft tokens, accepted tokens.
    pub spec: SpecCounters,
    pub pd: PdMetrics,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct SpecCounters {
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            engine: EngineCounters::default(),
            success: [0; 4],
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            queue: Histogram::new(LATENCY_BUCKETS),
            prefill: Histogram::new(LATENCY_BUCKETS),
            decode: Histogram::new(LATENCY_BUCKETS),
            step_wait: Histogram::new(STEP_WAIT_BUCKETS),
            iteration_tokens: Histogram::new(ITERATION_TOKENS_BUCKETS),
            spec: SpecCounters::default(),
            pd: PdMetrics::default(),
        }
    }
}

impl Metrics {
    pub fn finished(&mut self, reason: Option<FinishReason>) {
        let i = match reason {
            Some(FinishReason::Stop) => 0,
            Some(FinishReason::Length) => 1,
            Some(FinishReason::Abort) => 2,
            None => 3,
        };
        self.success[i] += 1;
    }
}

/// Static labels of a worker (`model_name`, `engine`) plus the cache config info.
pub struct Labels<'a> {
    pub model: &'a str,
    pub engine: u32,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub enable_prefix_caching: bool,
    /// `process_start_time_seconds` (prometheus_client's process collector on a real worker).
    pub start_time: f64,
    /// Render `vllm:spec_decode_*` (vLLM has them only with a speculative config).
    pub spec_decode: bool,
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn float(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

pub fn render(m: &Metrics, l: &Labels<'_>) -> String {
    let base = format!("engine=\"{}\",model_name=\"{}\"", l.engine, escape(l.model));
    let mut o = String::with_capacity(8192);
    header(
        &mut o,
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
    );
    let _ = writeln!(o, "process_start_time_seconds {}", float(l.start_time));
    let scalar = |o: &mut String, name: &str, kind: &str, help: &str, v: f64| {
        header(o, name, kind, help);
        let _ = writeln!(o, "{name}{{{base}}} {}", float(v));
    };
    scalar(
        &mut o,
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        m.running as f64,
    );
    scalar(
        &mut o,
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        m.waiting as f64,
    );
    scalar(
        &mut o,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        m.kv_usage,
    );
    let e = &m.engine;
    scalar(
        &mut o,
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        e.prefix_cache_queries as f64,
    );
    scalar(
        &mut o,
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        e.prefix_cache_hits as f64,
    );
    scalar(
        &mut o,
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        e.preemptions as f64,
    );
    scalar(
        &mut o,
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        e.prompt_tokens as f64,
    );
    scalar(
        &mut o,
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        e.generation_tokens as f64,
    );
    scalar(
        &mut o,
        "vllm:prompt_tokens_cached_total",
        "counter",
        "Number of cached prompt tokens (local + external).",
        e.prefix_cache_hits as f64,
    );

    header(
        &mut o,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for (i, reason) in ["stop", "length", "abort", "error"].iter().enumerate() {
        let _ = writeln!(
            o,
            "vllm:request_success_total{{{base},finished_reason=\"{reason}\"}} {}",
            float(m.success[i] as f64)
        );
    }

    let hist = |o: &mut String, name: &str, help: &str, h: &Histogram| {
        header(o, name, "histogram", help);
        for (b, c) in h.bounds.iter().zip(&h.counts) {
            let _ = writeln!(
                o,
                "{name}_bucket{{{base},le=\"{}\"}} {}",
                float(*b),
                float(*c as f64)
            );
        }
        let _ = writeln!(
            o,
            "{name}_bucket{{{base},le=\"+Inf\"}} {}",
            float(h.count as f64)
        );
        let _ = writeln!(o, "{name}_count{{{base}}} {}", float(h.count as f64));
        let _ = writeln!(o, "{name}_sum{{{base}}} {}", float(h.sum));
    };
    hist(
        &mut o,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &m.ttft,
    );
    hist(
        &mut o,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &m.itl,
    );
    hist(
        &mut o,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &m.e2e,
    );
    hist(
        &mut o,
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &m.queue,
    );

    hist(
        &mut o,
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        &m.prefill,
    );
    hist(
        &mut o,
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        &m.decode,
    );
    hist(
        &mut o,
        "kvgate_sim_step_wait_seconds",
        "Histogram of the wait for the engine step in progress when a request arrived (sim only).",
        &m.step_wait,
    );
    hist(
        &mut o,
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        &m.iteration_tokens,
    );
    if l.spec_decode {
        let sp = m.spec;
        for (name, help, v) in [
            (
                "vllm:spec_decode_num_drafts_total",
                "Number of spec decoding drafts.",
                sp.drafts,
            ),
            (
                "vllm:spec_decode_num_draft_tokens_total",
                "Number of draft tokens.",
                sp.draft_tokens,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens_total",
                "Number of accepted tokens.",
                sp.accepted_tokens,
            ),
        ] {
            scalar(&mut o, name, "counter", help, v as f64);
        }
    }

    let pd = &m.pd;
    scalar(
        &mut o,
        "vllm:nixl_num_kv_expired_reqs",
        "counter",
        "Prefill requests whose pinned KV blocks expired before a decode worker read them.",
        pd.expired_reqs as f64,
    );
    scalar(
        &mut o,
        "vllm:nixl_num_failed_transfers",
        "counter",
        "KV transfers (reads of a remote prefill) that failed.",
        pd.failed_transfers as f64,
    );
    hist(
        &mut o,
        "vllm:nixl_xfer_time_seconds",
        "Histogram of KV transfer time in seconds.",
        &pd.xfer_time,
    );
    hist(
        &mut o,
        "vllm:nixl_bytes_transferred",
        "Histogram of bytes moved per KV transfer.",
        &pd.bytes,
    );
    scalar(
        &mut o,
        "kvgate_sim_pd_pinned_blocks",
        "gauge",
        "KV blocks held by finished prefill legs until a decode worker reads them (sim only).",
        pd.pinned_blocks as f64,
    );
    scalar(
        &mut o,
        "kvgate_sim_pd_pinned_requests",
        "gauge",
        "Finished prefill legs whose KV blocks are still pinned (sim only).",
        pd.pinned_requests as f64,
    );
    scalar(
        &mut o,
        "kvgate_sim_pd_bootstrap_rooms",
        "gauge",
        "SGLang bootstrap rooms open on this prefill worker (sim only).",
        pd.bootstrap_rooms as f64,
    );
    scalar(
        &mut o,
        "kvgate_sim_pd_bootstrap_waiting",
        "gauge",
        "Legs waiting for their partner leg of the same bootstrap room (sim only).",
        pd.bootstrap_waiting as f64,
    );
    hist(
        &mut o,
        "kvgate_sim_pd_bootstrap_wait_seconds",
        "Histogram of how long a leg waited for its partner leg (sim only).",
        &pd.bootstrap_wait,
    );
    scalar(
        &mut o,
        "kvgate_sim_pd_bootstrap_timeouts_total",
        "counter",
        "Legs whose partner leg never came within the bootstrap timeout (sim only).",
        pd.bootstrap_timeouts as f64,
    );

    header(
        &mut o,
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    let _ = writeln!(
        o,
        "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"{}\",engine=\"{}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"xxhash\"}} 1.0",
        l.block_size,
        if l.enable_prefix_caching { "True" } else { "False" },
        l.engine,
        l.num_gpu_blocks,
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_names_types_and_buckets() {
        let mut m = Metrics::default();
        m.ttft.observe(0.03);
        m.finished(Some(FinishReason::Length));
        let l = Labels {
            model: "m\"x",
            engine: 0,
            block_size: 16,
            num_gpu_blocks: 100,
            enable_prefix_caching: true,
            start_time: 1.7e9,
            spec_decode: true,
        };
        let t = render(&m, &l);
        assert!(t.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
        assert!(t.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\\\"x\",le=\"0.02\"} 0.0\n"));
        assert!(t.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\\\"x\",le=\"0.04\"} 1.0\n"));
        assert!(t.contains("finished_reason=\"length\"} 1.0\n"));
        assert!(t.contains("num_gpu_blocks=\"100\""));
        assert!(
            t.contains("\nprocess_start_time_seconds 1700000000.0\n"),
            "{t}"
        );
        assert!(t.contains("# TYPE vllm:iteration_tokens_total histogram\n"));
        assert!(t.contains("vllm:request_prefill_time_seconds_count{"));
        assert!(t.contains("vllm:spec_decode_num_accepted_tokens_total{"));
        // Every sample line belongs to a family announced by a TYPE line.
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let fam = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_count")
                .trim_end_matches("_sum");
            assert!(
                t.contains(&format!("# TYPE {fam} ")) || t.contains(&format!("# TYPE {name} ")),
                "{line}"
            );
        }
    }
}
