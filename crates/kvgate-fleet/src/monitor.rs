//! [`WorkerMonitor`]: every background task for one worker, owned by one [`MonitorHandle`].
//!
//! `spawn` starts a supervisor task that resolves the kind (`auto` probes) and, with `detect_role`,
//! the prefill/decode role (`role = auto`), then runs the scraper,
//! the health checker and the KV-event feed (ZMQ subscribers per DP rank, or the TRT-LLM poller) as
//! children. Cancelling the handle's token (drop, or `shutdown().await`) stops all of them; the
//! children live in a `JoinSet`, so even a panicking child cannot outlive the handle.

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::WorkerId;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::breaker::{Breaker, BreakerConfig};
use crate::discover::{detect_role, probe_kind, KvSource, RoleProbe};
use crate::health::{self, HealthSettings};
use crate::http::HttpClient;
use crate::kv_feed::{Feed, FeedSettings};
use crate::reset::ResetBus;
use crate::scrape::{self, ScrapeSettings, Scraper};
use crate::sink::FleetSink;
use crate::stats::FleetStats;
use crate::subscriber::SubscriberSettings;
use crate::trtllm_poll::{self, PollSettings};
use crate::WorkerKind;

/// Where the worker's KV events come from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KvEventsSource {
    /// No events: the gateway uses the approximate index for this worker.
    #[default]
    Off,
    /// Ask the worker (vLLM `/kv_event_sources`, SGLang `/server_info`; TRT-LLM: poll
    /// `POST /kv_cache_events`).
    Discover,
    /// Configured publishers (one per DP rank).
    Endpoints(Vec<KvSource>),
}

/// One worker's monitoring settings (the gateway builds it from the worker's config entry).
#[derive(Debug, Clone)]
pub struct MonitorConfig {
    pub worker: WorkerId,
    /// Name used in logs (the configured name, by default `host:port`).
    pub name: String,
    /// `http://host:port` (a `/v1` suffix is tolerated).
    pub base_url: String,
    pub kind: WorkerKind,
    pub scrape_interval: Duration,
    /// ± fraction of the interval, randomised per tick.
    pub scrape_jitter: f64,
    pub scrape_timeout: Duration,
    /// No successful scrape for this long → `on_load_stale` (fail open).
    pub stale_after: Duration,
    /// The pool's block size, for the mismatch check.
    pub block_size: Option<u32>,
    pub kv_events: KvEventsSource,
    /// TRT-LLM `/kv_cache_events` poll period.
    pub kv_poll_interval: Duration,
    pub health_interval: Duration,
    /// Health probe period while the worker is down or its breaker is open (≤ `health_interval`).
    pub health_recovery_interval: Duration,
    pub health_timeout: Duration,
    /// Failed probes in a row before the worker is reported down.
    pub health_down_after: u32,
    pub breaker: BreakerConfig,
    /// ZMQ reconnect backoff bounds.
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// Certificates trusted when `base_url` is `https://`.
    pub tls: Option<kvgate_http::Tls>,
    /// `authorization` value for health checks, scrapes and polls (the worker's API key).
    pub auth: Option<http::HeaderValue>,
    pub replay_timeout: Duration,
    /// The worker's dcgm-exporter `/metrics` URL (GPU figures), scraped every `scrape_interval`.
    pub dcgm_url: Option<String>,
    /// `role = auto`: ask the worker's `/server_info` (whatever its kind) for its prefill/decode
    /// role until it answers, and report it through `on_role`; then every `role_recheck`.
    pub detect_role: bool,
    /// With `detect_role`: how often a worker whose role is known is asked again (a worker
    /// restarted into another mode keeps its address).
    pub role_recheck: Duration,
}

impl MonitorConfig {
    /// Defaults: scrape every 1 s ±10 % with a 500 ms timeout, stale after 5 s, health every 2 s
    /// (every 500 ms while the worker is down or its breaker open), events discovered for kinds that publish them.
    pub fn new(worker: WorkerId, base_url: impl Into<String>, kind: WorkerKind) -> Self {
        let base_url = base_url.into();
        let name = crate::http::host_of(&base_url)
            .and_then(|h| {
                let port = base_url.parse::<http::Uri>().ok()?.port_u16()?;
                Some(format!("{h}:{port}"))
            })
            .unwrap_or_else(|| base_url.clone());
        MonitorConfig {
            worker,
            name,
            base_url,
            kind,
            scrape_interval: Duration::from_secs(1),
            scrape_jitter: 0.1,
            scrape_timeout: Duration::from_millis(500),
            stale_after: Duration::from_secs(5),
            block_size: None,
            kv_events: if kind.has_kv_events() || kind == WorkerKind::Auto {
                KvEventsSource::Discover
            } else {
                KvEventsSource::Off
            },
            kv_poll_interval: Duration::from_millis(200),
            health_interval: Duration::from_secs(2),
            health_recovery_interval: Duration::from_millis(500),
            health_timeout: Duration::from_secs(1),
            health_down_after: 2,
            breaker: BreakerConfig::default(),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            replay_timeout: Duration::from_secs(5),
            tls: None,
            auth: None,
            dcgm_url: None,
            detect_role: false,
            role_recheck: Duration::from_secs(30),
        }
    }
}

/// Spawns monitors.
pub struct WorkerMonitor;

impl WorkerMonitor {
    /// Starts every task for the worker on the current tokio runtime.
    pub fn spawn(cfg: MonitorConfig, sink: Arc<dyn FleetSink>) -> MonitorHandle {
        let breaker = Arc::new(Breaker::new(cfg.breaker));
        Self::spawn_with_breaker(cfg, sink, breaker)
    }

    /// Like [`WorkerMonitor::spawn`], with a breaker the caller owns and also feeds with request
    /// outcomes (the gateway keeps it in the worker's state; it outlives monitor restarts).
    /// `cfg.breaker` is ignored: the breaker carries its own config.
    pub fn spawn_with_breaker(
        cfg: MonitorConfig,
        sink: Arc<dyn FleetSink>,
        breaker: Arc<Breaker>,
    ) -> MonitorHandle {
        let cancel = CancellationToken::new();
        let stats = Arc::new(FleetStats::default());
        let sup = tokio::spawn(supervise(
            cfg,
            sink,
            stats.clone(),
            breaker.clone(),
            cancel.clone(),
        ));
        MonitorHandle {
            cancel,
            supervisor: Some(sup),
            stats,
            breaker,
        }
    }
}

/// Owns a worker's tasks. Dropping it stops them; `shutdown().await` also waits until they ended.
pub struct MonitorHandle {
    cancel: CancellationToken,
    supervisor: Option<JoinHandle<()>>,
    stats: Arc<FleetStats>,
    breaker: Arc<Breaker>,
}

impl MonitorHandle {
    pub fn stats(&self) -> &Arc<FleetStats> {
        &self.stats
    }

    /// The worker's breaker; the gateway feeds it request outcomes too.
    pub fn breaker(&self) -> &Arc<Breaker> {
        &self.breaker
    }

    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(s) = self.supervisor.take() {
            let _ = s.await;
        }
    }
}

impl Drop for MonitorHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn supervise(
    cfg: MonitorConfig,
    sink: Arc<dyn FleetSink>,
    stats: Arc<FleetStats>,
    breaker: Arc<Breaker>,
    cancel: CancellationToken,
) {
    let client = HttpClient::new()
        .with_tls(cfg.tls.clone())
        .with_auth(cfg.auth.clone());
    let name: Arc<str> = cfg.name.clone().into();
    let mut tasks = JoinSet::new();
    let bus = Arc::new(ResetBus::new(cfg.worker, sink.clone(), stats.clone()));

    let mut kind = cfg.kind;
    // Health first, so an unreachable worker is reported while the kind is still unknown.
    let health_path = if kind == WorkerKind::Auto {
        "/health"
    } else {
        kind.health_path()
    };
    tasks.spawn(health::run(
        cfg.worker,
        name.clone(),
        client.clone(),
        HealthSettings {
            base: cfg.base_url.clone(),
            path: health_path,
            interval: cfg.health_interval,
            recovery_interval: cfg.health_recovery_interval,
            timeout: cfg.health_timeout,
            down_after: cfg.health_down_after,
            breaker,
            bus: bus.clone(),
        },
        sink.clone(),
        stats.clone(),
        cancel.child_token(),
    ));

    // Beside the kind probe, not after it: a worker of unknown role gets no traffic.
    if cfg.detect_role {
        tasks.spawn(detect_role(
            cfg.worker,
            name.clone(),
            client.clone(),
            RoleProbe {
                base: cfg.base_url.clone(),
                timeout: cfg.scrape_timeout.max(Duration::from_secs(1)),
                retry: cfg.scrape_interval,
                recheck: cfg.role_recheck,
            },
            sink.clone(),
            cancel.child_token(),
        ));
    }

    let mut backoff = cfg.scrape_interval;
    while kind == WorkerKind::Auto {
        if let Some(k) = probe_kind(&client, &cfg.base_url, cfg.scrape_timeout).await {
            tracing::info!(worker = %name, kind = %k, "detected worker kind");
            sink.on_kind(cfg.worker, k);
            kind = k;
            break;
        }
        tokio::select! {
            _ = cancel.cancelled() => return drain(tasks).await,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }

    if kind != WorkerKind::Openai {
        let scraper = Scraper::new(
            client.clone(),
            cfg.base_url.clone(),
            kind,
            cfg.scrape_timeout,
        );
        let settings = ScrapeSettings {
            interval: cfg.scrape_interval,
            jitter: cfg.scrape_jitter,
            timeout: cfg.scrape_timeout,
            stale_after: cfg.stale_after,
            block_size: cfg.block_size,
        };
        tasks.spawn(scrape::run(
            scraper,
            cfg.worker,
            name.clone(),
            settings,
            sink.clone(),
            stats.clone(),
            cancel.child_token(),
        ));
    }

    if let Some(url) = &cfg.dcgm_url {
        tasks.spawn(crate::dcgm::run(
            HttpClient::new().with_tls(cfg.tls.clone()),
            cfg.worker,
            name.clone(),
            crate::dcgm::DcgmSettings {
                url: url.clone(),
                interval: cfg.scrape_interval,
                jitter: cfg.scrape_jitter,
                timeout: cfg.scrape_timeout,
                stale_after: cfg.stale_after,
            },
            stats.clone(),
            cancel.child_token(),
        ));
    }

    let configured = match (&cfg.kv_events, kind) {
        (KvEventsSource::Off, _) => None,
        (_, WorkerKind::Trtllm) => {
            let poll = PollSettings {
                base: cfg.base_url.clone(),
                interval: cfg.kv_poll_interval,
                timeout: cfg.scrape_timeout.max(Duration::from_secs(1)),
            };
            tasks.spawn(trtllm_poll::run(
                cfg.worker,
                client.clone(),
                poll,
                sink.clone(),
                stats.clone(),
                cancel.child_token(),
            ));
            None
        }
        (KvEventsSource::Endpoints(e), _) => Some(Some(e.clone())),
        (KvEventsSource::Discover, k) if k.has_kv_events() => Some(None),
        (KvEventsSource::Discover, _) => None,
    };
    if let Some(configured) = configured {
        let mut template = SubscriberSettings::new(KvSource {
            endpoint: String::new(),
            replay_endpoint: None,
            topic: String::new(),
        });
        template.block_size = cfg.block_size;
        template.backoff_min = cfg.reconnect_min;
        template.backoff_max = cfg.reconnect_max;
        template.replay_timeout = cfg.replay_timeout;
        let feed = Feed {
            worker: cfg.worker,
            name: name.clone(),
            client: client.clone(),
            sink: sink.clone(),
            stats: stats.clone(),
            bus,
        };
        let settings = FeedSettings {
            base_url: cfg.base_url.clone(),
            kind,
            configured,
            discover_timeout: cfg.scrape_timeout.max(Duration::from_secs(1)),
            retry: cfg.scrape_interval,
            subscriber: template,
        };
        tasks.spawn(feed.run(settings, cancel.child_token()));
    }

    cancel.cancelled().await;
    drain(tasks).await;
}

pub(crate) async fn drain(mut tasks: JoinSet<()>) {
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            if e.is_panic() {
                tracing::error!(error = %e, "fleet task panicked");
            }
        }
    }
}
