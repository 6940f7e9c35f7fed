//! kvgate-gateway: the `kvgate serve` gateway — a reverse proxy for OpenAI-compatible clients that
//! routes each request to the worker holding most of its KV cache without overloading it, and
//! measures it all.
//!
//! Layout, front ends → decision → execution → observation (`tests/layout.rs` checks that module
//! dependencies point one way, that the decision component uses no HTTP types, and that only the
//! route table, the admin API and the reload see `AppState`):
//! - **Front ends.** `server.rs`: listeners (HTTP/1.1 + h2, TLS via `tls.rs`), io threads (one
//!   single-threaded runtime and worker connection pool per core), the route table, graceful
//!   shutdown. `client_api/`: the client APIs served (each a `ClientApi` value: route, label,
//!   parser, prompt field, response and error shapes). `api/`: what the gateway answers itself
//!   (`/v1/models`, `/health`, `/ready`, `/metrics`). `admin.rs`: the admin listener. `auth.rs`:
//!   API keys and rate limits. `prompt.rs`: a parsed request → tokens → block hashes
//!   (`route::RouteInput`).
//! - **Decision.** `route/`: `Decider` (reserve a worker: pick + load, queueing while the fleet is
//!   busy; plan a prefill/decode request), `route/router.rs` (selection through kvgate-core's
//!   policies, the dispatch guard that holds a request's load), `route/admission.rs` (the busy-fleet
//!   queue).
//! - **Execution.** `proxy/`: the request path of the OpenAI endpoints, top to bottom (auth → body
//!   → parse → pool → tokens → PD plan and prefill leg → reserve → forward → retry → respond);
//!   `proxy/handoff.rs` and `proxy/bootstrap.rs`: the legs of each PD handoff protocol; `pd.rs`:
//!   the PD bodies and usage merge; `forward.rs`: the hop's settings (client, time limits, retry
//!   budget); kvgate-http's client does the HTTP/1.1 hop (keep-alive pool per io thread, header
//!   hygiene, TLS for https workers). `error.rs`: the one error type and its one mapping to HTTP.
//! - **Observation.** `observer.rs`: the response observer (push-style `Observation`, fed by the
//!   proxy's `ObservedBody`: TTFT, ITL, usage, finish reason, mid-stream errors); `ctx.rs`:
//!   per-request state and `Telemetry`, what a finished request is recorded into; `metrics.rs`,
//!   `cost.rs` (worker cost, GPU-seconds and idle cost, accrued every second); `pins.rs` (the
//!   Responses ids learned from relayed replies → their origin worker) over `ttl_map.rs` (the
//!   bounded expiring map sessions and pins share); `trace.rs`: W3C trace context in and out, the
//!   request's spans (carried in its ctx), sampling, OTLP export.
//! - **Fleet.** `fleet.rs` (registry + router + monitors, the one place worker changes are
//!   applied), `fleet/monitors.rs` (kvgate-fleet monitors feeding worker state and the KV index),
//!   `registry.rs` (fleet snapshot behind arc-swap, per-worker state, breaker, worker ids),
//!   `discovery.rs` (models from workers' `/v1/models`), `worker_pools.rs` (`[[worker_pools]]`
//!   from DNS, llm-d endpoints files or a Kubernetes InferencePool's pods), `cluster.rs` (cluster mode: peers' decisions, loads and snapshots over NATS).
//! - **State and control.** `state.rs`: `AppState`, the components side by side (fleet, decider,
//!   proxy slice, upstream, telemetry, admission, auth), each built from its config slice;
//!   `config.rs`, `reload.rs` (file poll + SIGHUP), `cli.rs` (`kvgate serve` flags), `body.rs`
//!   (request and response body types).
//! - `mock.rs` (feature `mock`, test support only): a mock OpenAI worker for this crate's tests and
//!   the overhead benchmark's `mock_worker` example.
#![forbid(unsafe_code)]

pub mod admin;
pub mod api;
pub mod auth;
pub mod body;
pub mod cli;
pub mod client_api;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod cost;
pub mod ctx;
pub mod discovery;
pub mod epp;
pub mod error;
pub mod fleet;
pub mod flow;
pub mod forward;
pub mod metrics;
#[cfg(feature = "mock")]
pub mod mock;
pub mod observer;
pub mod pd;
pub mod pins;
pub mod prompt;
pub mod proxy;
pub mod registry;
pub mod reload;
pub mod route;
pub mod server;
pub mod state;
mod thread_cache;
pub mod tls;
pub mod trace;
pub mod ttl_map;
pub mod worker_pools;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use state::AppState;

/// A running gateway (data listener, optional admin listener, background tasks).
pub struct Gateway {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    /// The ext_proc endpoint picker's listener (`kvgate epp`).
    pub epp_addr: Option<SocketAddr>,
    pub app: Arc<AppState>,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

/// How to start: the config, and where it came from (for hot reload).
pub struct StartOptions {
    pub config: Config,
    pub config_path: Option<PathBuf>,
    pub overrides: reload::Overrides,
    /// Also serve the ext_proc endpoint picker on `[epp] listen` (`kvgate epp`).
    pub epp: bool,
}

impl From<Config> for StartOptions {
    fn from(config: Config) -> Self {
        StartOptions {
            config,
            config_path: None,
            overrides: Arc::new(|_| {}),
            epp: false,
        }
    }
}

impl Gateway {
    /// Bind the listeners (port 0 is fine), discover worker models, and start serving.
    pub async fn start(opts: impl Into<StartOptions>) -> anyhow::Result<Gateway> {
        let StartOptions {
            config,
            config_path,
            overrides,
            epp,
        } = opts.into();
        config.validate()?;
        let shutdown = CancellationToken::new();
        let server_cfg = config.server.clone();
        let admin_cfg = config.admin.clone();
        let epp_cfg = config.epp.clone();
        let refresh = Duration::from_secs(config.upstream.models_refresh_s);
        let app = AppState::new(Arc::new(config), shutdown.clone())?;
        let tls = server_cfg.tls.as_ref().map(tls::acceptor).transpose()?;
        let listener = tokio::net::TcpListener::bind(server_cfg.listen)
            .await
            .map_err(|e| anyhow::anyhow!("binding {}: {e}", server_cfg.listen))?;
        let addr = listener.local_addr()?;
        app.fleet.discover().await;

        let mut tasks = Vec::new();
        let grace = Duration::from_secs(server_cfg.shutdown_grace_s);
        let builder = Arc::new(server::conn_builder(&server_cfg));
        let a = app.clone();
        let handler = move |pool: kvgate_http::client::Pool| {
            let a = a.clone();
            move |req| server::route(a.clone(), pool.clone(), req)
        };
        let io_threads = match server_cfg.io_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let h1 = (server_cfg.http1 == config::Http1Server::Kvgate).then(|| {
            let a = app.clone();
            Arc::new(server::h1_limits(
                &server_cfg,
                Some(Arc::new(move |e: &error::GatewayError| {
                    a.metrics.error(e.label())
                })),
            ))
        });
        tasks.push(tokio::spawn(server::serve(
            listener,
            builder.clone(),
            tls,
            handler,
            shutdown.clone(),
            grace,
            server::ServeOpts {
                io_threads,
                h1: h1.clone(),
                conn_limit: (server_cfg.max_connections > 0).then(|| {
                    Arc::new(server::ConnLimit {
                        max: server_cfg.max_connections,
                        open: app.metrics.client_connections.clone(),
                        refused: app.metrics.connections_refused.clone(),
                    })
                }),
            },
        )));

        let mut admin_addr = None;
        if let Some(admin_listen) = admin_cfg.listen {
            let l = tokio::net::TcpListener::bind(admin_listen)
                .await
                .map_err(|e| anyhow::anyhow!("binding admin {admin_listen}: {e}"))?;
            admin_addr = Some(l.local_addr()?);
            let actx = Arc::new(admin::AdminCtx {
                app: app.clone(),
                key: admin_cfg.key.clone().unwrap_or_default(),
                config_path: config_path.clone(),
                overrides: overrides.clone(),
            });
            let handler = move |_pool| {
                let actx = actx.clone();
                move |req| admin::route(actx.clone(), req)
            };
            tasks.push(tokio::spawn(server::serve(
                l,
                builder,
                None,
                handler,
                shutdown.clone(),
                grace,
                server::ServeOpts {
                    io_threads: 0,
                    // Admin refusals are not the data path's errors.
                    h1: h1
                        .as_ref()
                        .map(|_| Arc::new(server::h1_limits(&server_cfg, None))),
                    conn_limit: None,
                },
            )));
        }
        let mut epp_addr = None;
        if epp {
            let tls = epp_cfg.tls.as_ref().map(tls::acceptor).transpose()?;
            let l = tokio::net::TcpListener::bind(epp_cfg.listen)
                .await
                .map_err(|e| anyhow::anyhow!("binding epp {}: {e}", epp_cfg.listen))?;
            epp_addr = Some(l.local_addr()?);
            let a = app.clone();
            let picker = Arc::new(epp::Epp {
                proxy: app.proxy.clone(),
                telemetry: app.telemetry.clone(),
                rewrites: epp::ModelRewrites::new(&epp_cfg.model_rewrites),
                settings: epp_cfg,
                ready: Box::new(move || api::health::is_ready(&a)),
            });
            tasks.push(tokio::spawn(epp::serve(
                l,
                tls,
                picker,
                shutdown.clone(),
                grace,
            )));
        }
        tasks.push(tokio::spawn(app.fleet.clone().run_discovery(refresh)));
        tasks.push(tokio::spawn(worker_pools::run(app.fleet.clone())));
        if let Some(path) = config_path {
            let poll = Duration::from_millis(server_cfg.reload_poll_ms);
            tasks.push(tokio::spawn(reload::watch(
                app.clone(),
                path,
                overrides,
                poll,
            )));
        }
        tasks.push(tokio::spawn(housekeeping(app.clone())));
        Ok(Gateway {
            addr,
            admin_addr,
            epp_addr,
            app,
            shutdown,
            tasks,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stop accepting, drain in-flight requests (up to the grace period), stop background tasks.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.wait().await;
    }

    /// Wait until the gateway stops (after `shutdown_token().cancel()`).
    pub async fn wait(self) {
        for t in self.tasks {
            let _ = t.await;
        }
        self.app.fleet.monitors.stop_all();
    }
}

/// Periodic upkeep: expire approximate-index entries and lost load entries, accrue worker cost. Every second: a
/// worker holding an entry past its TTL that no sweep has dropped yet makes each query check
/// that worker's blocks one by one, so the sweep keeps that window short (it is cheap when
/// nothing expired).
async fn housekeeping(app: Arc<AppState>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = app.shutdown.cancelled() => return,
            _ = tick.tick() => {
                let now = crate::clock::now();
                app.fleet.router.housekeep(now);
                // Cost accrues with time, whether or not anyone reads /metrics.
                crate::cost::accrue(&app.fleet.registry.snapshot(), &app.metrics, now);
            }
        }
    }
}
