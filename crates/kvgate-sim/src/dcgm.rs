//! An emulated dcgm-exporter `/metrics` (served at `/dcgm/metrics` with `--dcgm`): the field
//! names, types, units and labels of NVIDIA's exporter (`gpu`, `UUID`, `pci_bus_id`, `device`,
//! `modelName`, `Hostname`), with figures that follow the simulated load, so the gateway's DCGM
//! path (scrape, parse, re-export as `kvgate_worker_gpu_*`) is exercised without a GPU.
//!
//! The load model (not a GPU's, just monotone in load): utilisation rises with the running batch
//! (saturating at 8 sequences), SM activity with utilisation and KV usage, framebuffer use with KV
//! usage (weights take 20 %, the KV pool up to 70 % more: a real vLLM preallocates its pool, so there
//! FB used stays flat), power between 60 W idle and 400 W, temperature between 30 and 75 °C, and
//! the energy counter integrates power over the time between reads.

use std::fmt::Write;
use std::time::Instant;

use crate::metrics::Metrics;

const FB_TOTAL_MIB: f64 = 81_920.0;
const IDLE_W: f64 = 60.0;
const MAX_W: f64 = 400.0;

/// The integrated energy (DCGM counts millijoules since the driver loaded).
#[derive(Debug)]
pub struct EnergyMeter {
    last: Instant,
    millijoules: f64,
    watts: f64,
}

impl Default for EnergyMeter {
    fn default() -> Self {
        Self {
            last: Instant::now(),
            millijoules: 0.0,
            watts: IDLE_W,
        }
    }
}

/// The figures one read shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuFigures {
    pub util_pct: f64,
    pub sm_active: f64,
    pub fb_used_mib: f64,
    pub fb_free_mib: f64,
    pub power_w: f64,
    pub temp_c: f64,
    pub energy_mj: f64,
}

/// Figures for the current load; the power of the previous read is integrated up to `now` (the
/// load between reads is unknown: the previous power is held).
pub fn figures(m: &Metrics, meter: &mut EnergyMeter, now: Instant) -> GpuFigures {
    let busy = (m.running as f64 / 8.0).min(1.0);
    let kv = m.kv_usage.clamp(0.0, 1.0);
    let util_pct = (busy * 100.0).round();
    let sm_active = busy * (0.35 + 0.5 * kv);
    let fb_used_mib = (FB_TOTAL_MIB * (0.2 + 0.7 * kv)).round();
    let power_w = IDLE_W + (MAX_W - IDLE_W) * (0.7 * busy + 0.3 * sm_active);
    let dt = now.saturating_duration_since(meter.last).as_secs_f64();
    meter.millijoules += meter.watts * dt * 1000.0;
    meter.last = now;
    meter.watts = power_w;
    GpuFigures {
        util_pct,
        sm_active,
        fb_used_mib,
        fb_free_mib: FB_TOTAL_MIB - fb_used_mib,
        power_w,
        temp_c: (30.0 + 45.0 * busy).round(),
        energy_mj: meter.millijoules.floor(),
    }
}

/// The exposition, as dcgm-exporter writes it (one GPU, `gpu="0"`).
pub fn render(f: &GpuFigures, host: &str) -> String {
    let labels = format!(
        "gpu=\"0\",UUID=\"GPU-5d3e0c8a-0000-4000-8000-00000000c0de\",pci_bus_id=\"00000000:07:00.0\",device=\"nvidia0\",modelName=\"kvgate sim GPU (emulated)\",Hostname=\"{host}\""
    );
    let mut o = String::with_capacity(2048);
    for (name, kind, help, v) in [
        (
            "DCGM_FI_DEV_GPU_TEMP",
            "gauge",
            "GPU temperature (in C).",
            f.temp_c,
        ),
        (
            "DCGM_FI_DEV_POWER_USAGE",
            "gauge",
            "Power draw (in W).",
            f.power_w,
        ),
        (
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            "counter",
            "Total energy consumption since boot (in mJ).",
            f.energy_mj,
        ),
        (
            "DCGM_FI_DEV_GPU_UTIL",
            "gauge",
            "GPU utilization (in %).",
            f.util_pct,
        ),
        (
            "DCGM_FI_DEV_FB_FREE",
            "gauge",
            "Framebuffer memory free (in MiB).",
            f.fb_free_mib,
        ),
        (
            "DCGM_FI_DEV_FB_USED",
            "gauge",
            "Framebuffer memory used (in MiB).",
            f.fb_used_mib,
        ),
        (
            "DCGM_FI_PROF_SM_ACTIVE",
            "gauge",
            "The ratio of cycles an SM has at least 1 warp assigned (in %).",
            f.sm_active,
        ),
    ] {
        let _ = write!(
            o,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}\n"
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn figures_follow_the_load_and_energy_integrates_power() {
        let t0 = Instant::now();
        let mut meter = EnergyMeter {
            last: t0,
            millijoules: 0.0,
            watts: IDLE_W,
        };
        let idle = figures(&Metrics::default(), &mut meter, t0);
        assert_eq!(
            (idle.util_pct, idle.sm_active, idle.power_w),
            (0.0, 0.0, IDLE_W)
        );
        let busy_m = Metrics {
            running: 16,
            kv_usage: 0.5,
            ..Metrics::default()
        };
        // 10 s idle at 60 W = 600 J before this read.
        let busy = figures(&busy_m, &mut meter, t0 + Duration::from_secs(10));
        assert_eq!(busy.energy_mj, 600_000.0);
        assert_eq!(busy.util_pct, 100.0);
        assert!(busy.sm_active > 0.5 && busy.power_w > 300.0 && busy.temp_c > idle.temp_c);
        assert!(busy.fb_used_mib > idle.fb_used_mib);
        assert_eq!(busy.fb_used_mib + busy.fb_free_mib, FB_TOTAL_MIB);
        let later = figures(&busy_m, &mut meter, t0 + Duration::from_secs(11));
        assert_eq!(later.energy_mj, (600_000.0 + busy.power_w * 1000.0).floor());
        let text = render(&later, "sim-host");
        assert!(text.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"));
        assert!(text.contains("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-"));
        assert!(text.contains("Hostname=\"sim-host\"} 100\n"), "{text}");
    }
}
