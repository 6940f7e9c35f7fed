//! Starting and stopping one simulated worker: binds HTTP (and the ZMQ sockets), spawns the
//! scheduler task, the KV-event publisher and the accept loop, and hands back a [`SimHandle`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use kvgate_tokenize::ModelTokenizer;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::SimConfig;
use crate::engine::CacheEntry;
use crate::metrics::Metrics;
use crate::publisher::{self, Endpoints, PublisherConfig};
use crate::worker::{Command, Scheduler};

/// How long `shutdown` lets in-flight HTTP requests finish before cutting them off.
const GRACE: Duration = Duration::from_secs(5);

/// State shared by the HTTP handlers of one worker.
pub struct Shared {
    pub cfg: SimConfig,
    /// The bound HTTP address (named in a prefill leg's `kv_transfer_params`).
    pub http_addr: SocketAddr,
    pub tokenizer: ModelTokenizer,
    pub cmd: mpsc::UnboundedSender<Command>,
    pub metrics: Arc<Mutex<Metrics>>,
    pub draining: AtomicBool,
    pub next_id: AtomicU64,
    pub kv: Option<Endpoints>,
    pub created: u64,
    /// Unix seconds (fractional) the worker started: `process_start_time_seconds`.
    pub started: f64,
    /// Fault-injection dice (seeded, so a run is reproducible).
    pub rng: Mutex<fastrand::Rng>,
    /// The emulated GPU's energy counter (`--dcgm`).
    pub energy: Mutex<crate::dcgm::EnergyMeter>,
    /// SGLang bootstrap rooms (prefill workers with `--pd-protocol sglang`).
    pub rooms: crate::http::bootstrap::Rooms,
    /// Stored Responses-API responses: this worker's own, as vLLM keeps them per process.
    pub responses: crate::http::ResponseStore,
    /// `traceparent`s received, and the engine span exporter (`--otlp-traces-endpoint`).
    pub traces: crate::http::otel::Traces,
}

impl Shared {
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// Entry point for one worker.
pub struct SimWorker;

impl SimWorker {
    /// Starts a worker. Port 0 works for both addresses; read the bound ones from the handle.
    /// KV events are published when `config.kv_events` is set and `kv_events_addr` is given; the
    /// replay socket binds `config`'s derived address (see [`replay_addr_for`]).
    pub async fn spawn(
        config: SimConfig,
        http_addr: SocketAddr,
        kv_events_addr: Option<SocketAddr>,
    ) -> anyhow::Result<SimHandle> {
        config.validate()?;
        let tokenizer =
            crate::tokenizer::load(config.tokenizer.as_deref(), config.tokenizer_chatml)?;
        let listener = tokio::net::TcpListener::bind(http_addr)
            .await
            .map_err(|e| anyhow::anyhow!("binding HTTP on {http_addr}: {e}"))?;
        let http_addr = listener.local_addr()?;
        let engine_cancel = CancellationToken::new();
        let http_cancel = CancellationToken::new();
        let mut tasks = Vec::new();

        let (events_tx, kv) = match (config.kv_events, kv_events_addr) {
            (true, Some(addr)) => {
                let (tx, rx) = mpsc::unbounded_channel();
                let pcfg = PublisherConfig {
                    topic: config.kv_events_topic.clone(),
                    encoding: config.kv_events_encoding,
                    dp_rank: config.dp_rank,
                    buffer_steps: config.kv_events_buffer_steps,
                    garbage_rate: config.faults.garbage_events,
                    seed: config.seed,
                };
                let (eps, task) =
                    publisher::start(pcfg, addr, replay_addr_for(addr), rx, engine_cancel.clone())
                        .await?;
                tasks.push(task);
                (Some(tx), Some(eps))
            }
            _ => (None, None),
        };

        let metrics = Arc::new(Mutex::new(Metrics::default()));
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let sched = Scheduler::new(config.clone(), metrics.clone(), events_tx);
        tasks.push(tokio::spawn(sched.run(cmd_rx, engine_cancel.clone())));

        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let created = started as u64;
        let traces = crate::http::otel::Traces::new(
            config.otlp_traces_endpoint.as_deref(),
            &config.model,
            http_cancel.clone(),
        )?;
        let shared = Arc::new(Shared {
            traces,
            rng: Mutex::new(fastrand::Rng::with_seed(config.seed ^ 0x00fa_0175)),
            energy: Mutex::new(crate::dcgm::EnergyMeter::default()),
            rooms: Default::default(),
            responses: crate::http::ResponseStore::new(config.responses_store),
            cfg: config,
            http_addr,
            tokenizer,
            cmd: cmd_tx,
            metrics,
            draining: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            kv,
            created,
            started,
        });
        let http_task = tokio::spawn(accept_loop(listener, shared.clone(), http_cancel.clone()));
        Ok(SimHandle {
            http_addr,
            shared,
            engine_cancel,
            http_cancel,
            http_task: Some(http_task),
            tasks,
        })
    }
}

/// The replay socket's address for an events address: port + 100 (0 stays 0 = ephemeral).
pub fn replay_addr_for(events: SocketAddr) -> SocketAddr {
    let port = if events.port() == 0 {
        0
    } else {
        events.port().saturating_add(100)
    };
    SocketAddr::new(events.ip(), port)
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    sh: Arc<Shared>,
    cancel: CancellationToken,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    loop {
        let stream = tokio::select! {
            _ = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let sh = sh.clone();
        let svc = hyper::service::service_fn(move |req| crate::http::route(sh.clone(), req));
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(GRACE, graceful.shutdown()).await;
}

/// A running worker. Dropping it stops everything too, but `shutdown().await` waits for it.
pub struct SimHandle {
    http_addr: SocketAddr,
    shared: Arc<Shared>,
    engine_cancel: CancellationToken,
    http_cancel: CancellationToken,
    http_task: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl SimHandle {
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// `http://127.0.0.1:port`, handy for clients.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    pub fn kv_events_addr(&self) -> Option<SocketAddr> {
        self.shared.kv.as_ref().map(|e| e.publish)
    }

    pub fn replay_addr(&self) -> Option<SocketAddr> {
        self.shared.kv.as_ref().map(|e| e.replay)
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }

    /// `/health` answers 503 from now on (requests are still served).
    pub fn set_draining(&self, draining: bool) {
        self.shared.draining.store(draining, Ordering::Relaxed);
    }

    /// The engine's view of its prefix cache: every cached block with its wire hash and tokens.
    pub async fn cache_snapshot(&self) -> Vec<CacheEntry> {
        let (tx, rx) = oneshot::channel();
        if self.shared.cmd.send(Command::Snapshot(tx)).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// A copy of the current metrics.
    pub fn metrics(&self) -> Metrics {
        self.shared.metrics.lock().clone()
    }

    /// Drains (503 on /health), stops accepting, lets in-flight requests finish (up to 5 s), then
    /// stops the engine and the publisher.
    pub async fn shutdown(mut self) {
        self.set_draining(true);
        self.http_cancel.cancel();
        if let Some(t) = self.http_task.take() {
            let _ = t.await;
        }
        self.engine_cancel.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.http_cancel.cancel();
        self.engine_cancel.cancel();
    }
}
