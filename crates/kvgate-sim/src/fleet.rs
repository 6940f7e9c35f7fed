//! N workers in one process, on consecutive ports (or all ephemeral).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::config::{Role, SimConfig};
use crate::server::{SimHandle, SimWorker};

/// Where a fleet listens. Worker i: HTTP on `http_base + i`, events on `kv_base + i`, replay on
/// events + 100. A base of 0 means every socket gets an ephemeral port.
#[derive(Clone, Debug)]
pub struct FleetPorts {
    pub host: IpAddr,
    pub http_base: u16,
    /// `None` = `http_base + 1000` (or ephemeral when `http_base` is 0).
    pub kv_base: Option<u16>,
}

impl Default for FleetPorts {
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            http_base: 0,
            kv_base: None,
        }
    }
}

/// Largest fleet with derived ports: replay ports (events + 100) must not collide with events.
pub const MAX_DERIVED_WORKERS: usize = 100;

pub struct SimFleet {
    workers: Vec<SimHandle>,
}

impl SimFleet {
    /// Starts `n` workers from `base`. Worker i gets `seed = base.seed + i` (a distinct engine hash
    /// seed, like separate vLLM processes). Workers already started are stopped on error.
    pub async fn spawn(n: usize, base: SimConfig, ports: FleetPorts) -> anyhow::Result<Self> {
        Self::spawn_pd(n, None, base, ports).await
    }

    /// Like [`SimFleet::spawn`]; with `prefill = Some(p)`, workers 0..p get role prefill and the
    /// rest role decode (a PD fleet in one process).
    pub async fn spawn_pd(
        n: usize,
        prefill: Option<usize>,
        base: SimConfig,
        ports: FleetPorts,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(n > 0, "a fleet needs at least one worker");
        if let Some(p) = prefill {
            anyhow::ensure!(
                p > 0 && p < n,
                "--prefill-workers must be between 1 and --workers - 1 (got {p} of {n})"
            );
        }
        let kv_base = match (ports.kv_base, ports.http_base) {
            (Some(k), _) => k,
            (None, 0) => 0,
            (None, h) => h.checked_add(1000).ok_or_else(|| {
                anyhow::anyhow!("--base-port {h} + 1000 overflows; pass --kv-events-base-port")
            })?,
        };
        if kv_base != 0 {
            anyhow::ensure!(
                n <= MAX_DERIVED_WORKERS,
                "at most {MAX_DERIVED_WORKERS} workers with fixed ports"
            );
        }
        let port = |b: u16, i: usize| -> anyhow::Result<u16> {
            if b == 0 {
                return Ok(0);
            }
            u16::try_from(usize::from(b) + i)
                .map_err(|_| anyhow::anyhow!("port {b}+{i} is out of range"))
        };
        let mut workers = Vec::with_capacity(n);
        for i in 0..n {
            let mut cfg = base.clone();
            cfg.seed = base.seed.wrapping_add(i as u64);
            if let Some(p) = prefill {
                cfg.pd.role = if i < p { Role::Prefill } else { Role::Decode };
            }
            if cfg
                .faults
                .slowdown
                .is_some_and(|s| s.worker.is_some_and(|k| k != i))
            {
                cfg.faults.slowdown = None;
            }
            let http = SocketAddr::new(ports.host, port(ports.http_base, i)?);
            let kv = base
                .kv_events
                .then(|| port(kv_base, i).map(|p| SocketAddr::new(ports.host, p)))
                .transpose()?;
            match SimWorker::spawn(cfg, http, kv).await {
                Ok(h) => workers.push(h),
                Err(e) => {
                    for w in workers {
                        w.shutdown().await;
                    }
                    return Err(e.context(format!("starting worker {i}")));
                }
            }
        }
        Ok(Self { workers })
    }

    /// `n` workers on 127.0.0.1 with ephemeral ports: what tests want.
    pub async fn spawn_local(n: usize, base: SimConfig) -> anyhow::Result<Self> {
        Self::spawn(n, base, FleetPorts::default()).await
    }

    pub fn workers(&self) -> &[SimHandle] {
        &self.workers
    }

    pub fn urls(&self) -> Vec<String> {
        self.workers.iter().map(SimHandle::base_url).collect()
    }

    pub async fn shutdown(self) {
        for w in self.workers {
            w.shutdown().await;
        }
    }
}

/// The machine-parsable line the CLI prints per worker.
pub fn describe(i: usize, w: &SimHandle) -> String {
    let mut s = format!("worker {i} http={}", w.http_addr());
    match (w.kv_events_addr(), w.replay_addr()) {
        (Some(k), Some(r)) => s.push_str(&format!(" kv_events=tcp://{k} replay=tcp://{r}")),
        _ => s.push_str(" kv_events=off"),
    }
    let role = w.config().pd.role;
    if role != Role::Both {
        s.push_str(&format!(" role={}", role.as_str()));
    }
    s
}
