//! A worker's dcgm-exporter figures (kvgate-fleet's `dcgm` scrape) as `kvgate_worker_gpu_*`,
//! set when `/metrics` is served like the other worker signals.

use std::sync::atomic::Ordering::Relaxed;

use kvgate_fleet::FleetStats;

use crate::metrics::{WorkerLabel, WorkerResult, WorkerSignals};

pub(super) fn export(ws: &WorkerSignals, worker: &WorkerLabel, stats: &FleetStats) {
    let by = |result| WorkerResult {
        worker: worker.worker.clone(),
        result,
    };
    ws.dcgm_scrapes
        .get_or_create(&by("ok"))
        .inc_by(stats.dcgm_scrapes_ok.load(Relaxed));
    ws.dcgm_scrapes
        .get_or_create(&by("failed"))
        .inc_by(stats.dcgm_scrapes_failed.load(Relaxed));
    let Some(g) = stats.gpu.lock().clone() else {
        return;
    };
    ws.gpu_count.get_or_create(worker).set(i64::from(g.gpus));
    for (family, v) in [
        (&ws.gpu_utilization, g.util),
        (&ws.gpu_sm_active, g.sm_active),
        (&ws.gpu_memory_used, g.fb_used_bytes),
        (&ws.gpu_memory_free, g.fb_free_bytes),
        (&ws.gpu_power, g.power_watts),
        (&ws.gpu_temperature, g.temperature_celsius),
    ] {
        if let Some(v) = v {
            family.get_or_create(worker).set(v);
        }
    }
    if let Some(j) = g.energy_joules {
        ws.gpu_energy.get_or_create(worker).inc_by(j);
    }
}
