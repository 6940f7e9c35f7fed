//! `kvgate serve`: flags, environment overrides (`KVGATE_*`), and the entry point.
//!
//! Precedence: command-line flag > environment variable > config file > built-in default. Flags
//! and env are re-applied on every config reload, so they keep winning.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::config::{ApiKeyConfig, Config, RoleSetting, WorkerConfig, WorkerRole};
use crate::{Gateway, StartOptions};

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// TOML config file (hot-reloaded on change and SIGHUP).
    #[arg(long, short = 'c', env = "KVGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address of the OpenAI endpoint [default: 127.0.0.1:8080].
    #[arg(long, env = "KVGATE_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Worker base URL (repeat, or comma-separated in KVGATE_WORKERS). Replaces `[[workers]]`.
    #[arg(long = "worker", env = "KVGATE_WORKERS", value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Prefill worker base URL (repeatable; role = "prefill"), added to the --worker list.
    #[arg(long = "prefill-worker", value_delimiter = ',')]
    pub prefill_workers: Vec<String>,
    /// Decode worker base URL (repeatable; role = "decode"), added to the --worker list.
    #[arg(long = "decode-worker", value_delimiter = ',')]
    pub decode_workers: Vec<String>,
    /// Worker base URL whose prefill/decode role its /server_info tells (repeatable;
    /// role = "auto": no traffic until it answers), added to the --worker list.
    #[arg(long = "auto-role-worker", value_delimiter = ',')]
    pub auto_role_workers: Vec<String>,
    /// Conditional disaggregation threshold (`pd.min_uncached_tokens`; 0 = always disaggregate).
    #[arg(long)]
    pub pd_min_uncached_tokens: Option<u64>,
    /// Prefill/decode handoff protocol (`pd.protocol`): vllm, sglang or trtllm.
    #[arg(long)]
    pub pd_protocol: Option<crate::config::PdProtocol>,
    /// Model the `--worker`s serve (repeatable); default: discovered from each worker's /v1/models.
    #[arg(long = "model", env = "KVGATE_MODELS", value_delimiter = ',')]
    pub models: Vec<String>,
    /// Routing policy: kv_time (default), kv, latency, round_robin, random, least_loaded, power_of_two, consistent_hash, cache_aware.
    #[arg(long, env = "KVGATE_POLICY")]
    pub policy: Option<String>,
    /// KV block size in tokens (must match the workers').
    #[arg(long, env = "KVGATE_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// HF tokenizer.json for every model without its own `[models."name"] tokenizer`.
    #[arg(long, env = "KVGATE_TOKENIZER_JSON")]
    pub tokenizer_json: Option<PathBuf>,
    /// Admin API listen address (off unless set; needs --admin-key).
    #[arg(long, env = "KVGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Bearer key of the admin API.
    #[arg(long, env = "KVGATE_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Client API key(s) (comma-separated in KVGATE_API_KEYS); replaces `[auth] keys`.
    #[arg(
        long = "api-key",
        env = "KVGATE_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// Disable the per-request JSON log line on stdout.
    #[arg(long, env = "KVGATE_NO_REQUEST_LOG")]
    pub no_request_log: bool,
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `kvgate_gateway=debug`.
    #[arg(long, env = "KVGATE_LOG", default_value = "info")]
    pub log: String,
}

/// `kvgate epp`: the same gateway as `kvgate serve` (same config file and flags), plus the Envoy
/// ext_proc endpoint picker on `[epp] listen`.
#[derive(clap::Args, Debug, Clone)]
pub struct EppArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Listen address of the ext_proc gRPC endpoint picker (`epp.listen`) [default: 127.0.0.1:9002].
    #[arg(long, env = "KVGATE_EPP_LISTEN")]
    pub epp_listen: Option<SocketAddr>,
    /// Endpoints in x-gateway-destination-endpoint: the pick and its fallbacks (`epp.fallback_endpoints`).
    #[arg(long)]
    pub fallback_endpoints: Option<usize>,
}

impl EppArgs {
    pub fn apply(&self, cfg: &mut Config) {
        self.serve.apply(cfg);
        if let Some(l) = self.epp_listen {
            cfg.epp.listen = l;
        }
        if let Some(k) = self.fallback_endpoints {
            cfg.epp.fallback_endpoints = k;
        }
    }
}

impl ServeArgs {
    /// Apply flags/env on top of a config (file or default).
    pub fn apply(&self, cfg: &mut Config) {
        if let Some(l) = self.listen {
            cfg.server.listen = l;
        }
        if !self.workers.is_empty()
            || !self.prefill_workers.is_empty()
            || !self.decode_workers.is_empty()
            || !self.auto_role_workers.is_empty()
        {
            let roles = [
                (&self.workers, RoleSetting::Fixed(WorkerRole::Both)),
                (&self.prefill_workers, WorkerRole::Prefill.into()),
                (&self.decode_workers, WorkerRole::Decode.into()),
                (&self.auto_role_workers, RoleSetting::Auto),
            ];
            cfg.workers = roles
                .iter()
                .flat_map(|(urls, role)| urls.iter().map(move |u| (u, *role)))
                .map(|(u, role)| {
                    let mut w = WorkerConfig::from_url(u.trim());
                    w.models = self.models.clone();
                    w.role = role;
                    w
                })
                .collect();
        }
        if let Some(t) = self.pd_min_uncached_tokens {
            cfg.pd.min_uncached_tokens = t;
        }
        if let Some(p) = self.pd_protocol {
            cfg.pd.protocol = p;
        }
        if let Some(p) = &self.policy {
            cfg.routing.policy = p.clone();
        }
        if let Some(b) = self.block_size {
            cfg.routing.block_size = b;
        }
        if let Some(p) = &self.tokenizer_json {
            cfg.routing.tokenizer = Some(kvgate_tokenize::TokenizerSpec::Hf {
                tokenizer_json: p.clone(),
                tokenizer_config: None,
            });
        }
        if let Some(a) = self.admin_listen {
            cfg.admin.listen = Some(a);
        }
        if let Some(k) = &self.admin_key {
            cfg.admin.key = Some(k.clone());
        }
        if !self.api_keys.is_empty() {
            cfg.auth.keys = self
                .api_keys
                .iter()
                .map(|k| ApiKeyConfig {
                    key: k.clone(),
                    name: None,
                    rate_per_s: None,
                    burst: None,
                    priority: None,
                    tenant: None,
                })
                .collect();
        }
        if self.no_request_log {
            cfg.server.request_log = false;
        }
    }
}

/// Whether log lines carry ANSI colour: only when they go to a terminal and NO_COLOR
/// (<https://no-color.org>) is unset or empty.
fn log_colour(stderr_is_terminal: bool, no_color: bool) -> bool {
    stderr_is_terminal && !no_color
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let overrides = args.clone();
    run_with(
        args,
        Arc::new(move |c: &mut Config| overrides.apply(c)),
        false,
    )
    .await
}

/// `kvgate epp`.
pub async fn run_epp(args: EppArgs) -> anyhow::Result<()> {
    let overrides = args.clone();
    run_with(
        args.serve.clone(),
        Arc::new(move |c: &mut Config| overrides.apply(c)),
        true,
    )
    .await
}

async fn run_with(
    args: ServeArgs,
    overrides: crate::reload::Overrides,
    epp: bool,
) -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&args.log).unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: container runtimes, journald and log shippers read a pipe or
        // file, where ANSI escape codes are noise in every line. NO_COLOR turns colour off anywhere.
        .with_ansi(log_colour(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty()),
        ))
        .try_init();
    let mut config = match &args.config {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    };
    overrides(&mut config);
    config.validate()?;
    // A discovered pool (DNS, endpoints file, InferencePool) may start empty and fill later.
    if config.workers.is_empty() && config.worker_pools.is_empty() {
        anyhow::bail!("no workers: pass --worker URL (repeatable), or list [[workers]] or [[worker_pools]] in --config");
    }
    let drain_delay_s = config.server.drain_delay_s;
    let gw = Gateway::start(StartOptions {
        config,
        config_path: args.config.clone(),
        overrides,
        epp,
    })
    .await?;
    // A fixed line on stderr, so scripts and tests can find the address when listening on port 0.
    eprintln!("kvgate serve: listening on http://{}", gw.addr);
    if let Some(a) = gw.admin_addr {
        eprintln!("kvgate serve: admin on http://{a}");
    }
    if let Some(a) = gw.epp_addr {
        eprintln!("kvgate epp: ext_proc on {a}");
    }
    let stop = gw.shutdown_token();
    let app = gw.app.clone();
    let delay = std::time::Duration::from_secs(drain_delay_s);
    tokio::spawn(async move {
        shutdown_signal().await;
        if !delay.is_zero() {
            // The preStop pattern: load balancers polling /ready see 503 and stop sending while
            // the listener still accepts and serves; a second signal cuts the delay short.
            app.draining
                .store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(
                delay_s = delay.as_secs(),
                "shutting down: /ready reports 503; still serving until the drain delay ends"
            );
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown_signal() => {}
            }
        }
        tracing::info!("shutting down: listener closed, draining in-flight requests");
        stop.cancel();
    });
    gw.wait().await;
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
