//! GPU telemetry from a worker's dcgm-exporter (`dcgm_url`), scraped like the load and kept for
//! the gateway to re-export as `kvgate_worker_gpu_*{worker}`.
//!
//! dcgm-exporter writes one sample per GPU (labels `gpu`, `UUID`, `pci_bus_id`, `device`,
//! `modelName`, `Hostname`, optionally the driver version and the Kubernetes `pod`/`namespace`/
//! `container` it is attached to). A worker spans every GPU the endpoint reports: utilisation and
//! SM activity are averaged over them, memory, power and energy summed, temperature the hottest.
//! DCGM marks a field it could not read with a "blank" sentinel near `i64::MAX`: such samples are
//! ignored, never averaged in.

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::WorkerId;
use kvgate_protocol::prom_text::{self, Exposition};
use tokio_util::sync::CancellationToken;

use crate::http::{HttpClient, ACCEPT_PROM};
use crate::scrape::{jittered, ParseError};
use crate::stats::{inc, FleetStats};

/// Smallest DCGM blank value (`DCGM_INT64_BLANK` = 0x7ffffffffffffff0 and the codes above it).
const BLANK_MIN: f64 = 9.223_372_036_854_775e18;
const MIB: f64 = 1024.0 * 1024.0;

/// One worker's GPUs, as its dcgm-exporter last reported them. Fields the exporter did not report
/// (or reported blank) are `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuStats {
    /// Distinct `gpu` label values seen.
    pub gpus: u32,
    /// `DCGM_FI_DEV_GPU_UTIL` / 100, mean over GPUs (0 … 1).
    pub util: Option<f64>,
    /// `DCGM_FI_PROF_SM_ACTIVE`, mean over GPUs (0 … 1; profiling metrics need DCGM's DCP module).
    pub sm_active: Option<f64>,
    /// `DCGM_FI_DEV_FB_USED` / `_FREE` (MiB) in bytes, summed.
    pub fb_used_bytes: Option<f64>,
    pub fb_free_bytes: Option<f64>,
    /// `DCGM_FI_DEV_POWER_USAGE`, watts, summed.
    pub power_watts: Option<f64>,
    /// `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` (mJ since boot) in joules, summed.
    pub energy_joules: Option<f64>,
    /// `DCGM_FI_DEV_GPU_TEMP`, °C, the hottest GPU.
    pub temperature_celsius: Option<f64>,
    /// The `modelName` label (e.g. `NVIDIA H100 80GB HBM3`).
    pub model_name: Option<String>,
}

fn readable(v: f64) -> bool {
    v.is_finite() && v < BLANK_MIN
}

fn values<'e>(e: &'e Exposition<'_>, name: &'e str) -> impl Iterator<Item = f64> + 'e {
    e.samples_named(name)
        .map(|s| s.value)
        .filter(|v| readable(*v))
}

fn sum(e: &Exposition<'_>, name: &str) -> Option<f64> {
    let mut it = values(e, name).peekable();
    it.peek()?;
    Some(it.sum())
}

fn mean(e: &Exposition<'_>, name: &str) -> Option<f64> {
    let (n, total) = values(e, name).fold((0u32, 0.0), |(n, t), v| (n + 1, t + v));
    (n > 0).then(|| total / f64::from(n))
}

/// Parse a dcgm-exporter exposition. Fails only when none of the fields kvgate uses is present.
pub fn parse(text: &str) -> Result<GpuStats, ParseError> {
    let e = prom_text::parse(text);
    let mut gpus: Vec<&str> = Vec::new();
    let mut model_name = None;
    for s in e.samples.iter().filter(|s| s.name.starts_with("DCGM_FI_")) {
        if let Some(g) = s.label("gpu") {
            if !gpus.contains(&g) {
                gpus.push(g);
            }
        }
        if model_name.is_none() {
            model_name = s.label("modelName").map(str::to_string);
        }
    }
    let stats = GpuStats {
        gpus: gpus.len() as u32,
        util: mean(&e, "DCGM_FI_DEV_GPU_UTIL").map(|v| (v / 100.0).clamp(0.0, 1.0)),
        sm_active: mean(&e, "DCGM_FI_PROF_SM_ACTIVE").map(|v| v.clamp(0.0, 1.0)),
        fb_used_bytes: sum(&e, "DCGM_FI_DEV_FB_USED").map(|v| v * MIB),
        fb_free_bytes: sum(&e, "DCGM_FI_DEV_FB_FREE").map(|v| v * MIB),
        power_watts: sum(&e, "DCGM_FI_DEV_POWER_USAGE"),
        energy_joules: sum(&e, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION").map(|v| v / 1000.0),
        temperature_celsius: values(&e, "DCGM_FI_DEV_GPU_TEMP").reduce(f64::max),
        model_name,
    };
    let any = stats.util.is_some()
        || stats.sm_active.is_some()
        || stats.fb_used_bytes.is_some()
        || stats.power_watts.is_some()
        || stats.energy_joules.is_some()
        || stats.temperature_celsius.is_some();
    if any {
        Ok(stats)
    } else {
        Err(ParseError::Missing("DCGM_FI_DEV_GPU_UTIL"))
    }
}

/// Settings of the DCGM scrape task.
#[derive(Debug, Clone)]
pub(crate) struct DcgmSettings {
    pub url: String,
    pub interval: Duration,
    pub jitter: f64,
    pub timeout: Duration,
    /// No successful scrape for this long → the figures are dropped (not re-exported stale).
    pub stale_after: Duration,
}

/// The periodic DCGM scrape; the latest figures go to `stats.gpu`. `client` carries no worker
/// credentials: the exporter is another endpoint than the worker.
pub(crate) async fn run(
    client: HttpClient,
    worker: WorkerId,
    name: Arc<str>,
    s: DcgmSettings,
    stats: Arc<FleetStats>,
    cancel: CancellationToken,
) {
    let mut last_ok = tokio::time::Instant::now();
    let mut warned = false;
    loop {
        let got = tokio::select! {
            _ = cancel.cancelled() => return,
            r = client.get(&s.url, "", ACCEPT_PROM, s.timeout) => r,
        };
        let parsed = match got {
            Ok(f) if f.status.is_success() => std::str::from_utf8(&f.body)
                .map_err(|_| "response is not UTF-8".to_string())
                .and_then(|t| parse(t).map_err(|e| e.to_string())),
            Ok(f) => Err(format!("HTTP {}", f.status)),
            Err(e) => Err(e.to_string()),
        };
        match parsed {
            Ok(g) => {
                inc(&stats.dcgm_scrapes_ok);
                last_ok = tokio::time::Instant::now();
                warned = false;
                *stats.gpu.lock() = Some(g);
            }
            Err(e) => {
                inc(&stats.dcgm_scrapes_failed);
                if last_ok.elapsed() >= s.stale_after && !warned {
                    warned = true;
                    tracing::warn!(worker = %name, id = worker.0, url = %s.url, error = %e,
                        "dcgm-exporter unreadable: GPU figures dropped until it answers");
                    *stats.gpu.lock() = None;
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(jittered(s.interval, s.jitter)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = include_str!("../tests/fixtures/dcgm-exporter.txt");

    #[test]
    fn real_dcgm_exporter_output_is_summarised_per_worker() {
        let g = parse(FIXTURE).expect("fixture parses");
        assert_eq!(g.gpus, 2);
        assert_eq!(g.util, Some(0.94));
        let sm = g.sm_active.expect("sm active");
        assert!((sm - (0.812345 + 0.774211) / 2.0).abs() < 1e-12, "{sm}");
        assert_eq!(g.fb_used_bytes, Some((76556.0 + 76478.0) * MIB));
        assert_eq!(g.fb_free_bytes, Some((4523.0 + 4601.0) * MIB));
        let p = g.power_watts.expect("power");
        assert!((p - 1010.44).abs() < 1e-9, "{p}");
        assert_eq!(
            g.energy_joules,
            Some((81_234_567_890.0 + 79_876_543_210.0) / 1000.0)
        );
        assert_eq!(g.temperature_celsius, Some(67.0));
        assert_eq!(g.model_name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    }

    #[test]
    fn blank_values_are_ignored_and_nothing_known_is_an_error() {
        let blank = "DCGM_FI_DEV_GPU_TEMP{gpu=\"0\"} 9223372036854775794\nDCGM_FI_DEV_POWER_USAGE{gpu=\"0\"} 100\n";
        let g = parse(blank).expect("power is readable");
        assert_eq!(g.temperature_celsius, None);
        assert_eq!(g.power_watts, Some(100.0));
        assert!(parse("vllm:num_requests_running 1\n").is_err());
        assert!(parse("").is_err());
        // Spaces after commas, as in dcgm-exporter's README, parse the same.
        let spaced = "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\", UUID=\"GPU-x\", modelName=\"A100\"} 50\n";
        let g = parse(spaced).expect("spaced labels");
        assert_eq!((g.util, g.model_name.as_deref()), (Some(0.5), Some("A100")));
    }

    #[test]
    fn the_emulated_exporter_of_kvgate_sim_parses() {
        let m = kvgate_sim::metrics::Metrics {
            running: 4,
            kv_usage: 0.25,
            ..Default::default()
        };
        let mut meter = kvgate_sim::dcgm::EnergyMeter::default();
        let f = kvgate_sim::dcgm::figures(&m, &mut meter, std::time::Instant::now());
        let g = parse(&kvgate_sim::dcgm::render(&f, "h")).expect("sim output parses");
        assert_eq!(g.gpus, 1);
        assert_eq!(g.util, Some(0.5));
        assert_eq!(g.power_watts, Some(f.power_w));
        assert_eq!(g.fb_used_bytes, Some(f.fb_used_mib * MIB));
    }
}
