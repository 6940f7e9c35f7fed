//! Hot reload: re-read the config file when its modification time changes (polled) or on SIGHUP,
//! re-apply CLI/env overrides, validate, and swap it in. A bad file is rejected with a logged error
//! and the running config stays; in-flight requests are never affected (they hold their snapshot).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::config::Config;
use crate::metrics::ReasonLabel;
use crate::state::AppState;

/// Applied to every loaded file so CLI flags and env keep precedence across reloads.
pub type Overrides = Arc<dyn Fn(&mut Config) + Send + Sync>;

pub fn load(path: &Path, overrides: &Overrides) -> anyhow::Result<Config> {
    let mut cfg = Config::from_file(path)?;
    overrides(&mut cfg);
    cfg.validate()?;
    Ok(cfg)
}

/// Reload now. Returns the error text on failure (also logged and counted).
pub fn reload(app: &AppState, path: &Path, overrides: &Overrides) -> Result<(), String> {
    let r = load(path, overrides).and_then(|cfg| app.apply_config(Arc::new(cfg)));
    let label = ReasonLabel {
        reason: if r.is_ok() { "ok" } else { "error" },
    };
    app.metrics.config_reloads.get_or_create(&label).inc();
    match r {
        Ok(()) => {
            tracing::info!(path = %path.display(), "configuration reloaded");
            Ok(())
        }
        Err(e) => {
            tracing::error!(path = %path.display(), error = %format!("{e:#}"), "configuration reload failed; keeping the running config");
            Err(format!("{e:#}"))
        }
    }
}

fn mtime(path: &PathBuf) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Watch `path` (poll every `poll`, 0 = off) and SIGHUP until shutdown.
pub async fn watch(app: Arc<AppState>, path: PathBuf, overrides: Overrides, poll: Duration) {
    let mut last = mtime(&path);
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let mut tick = tokio::time::interval(if poll.is_zero() {
        Duration::from_secs(3600)
    } else {
        poll
    });
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(unix)]
        let hup_fut = async {
            match hup.as_mut() {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hup_fut = std::future::pending::<Option<()>>();
        tokio::select! {
            _ = app.shutdown.cancelled() => return,
            _ = hup_fut => {
                last = mtime(&path);
                let _ = reload(&app, &path, &overrides);
            }
            _ = tick.tick(), if !poll.is_zero() => {
                let now = mtime(&path);
                if now.is_some() && now != last {
                    last = now;
                    let _ = reload(&app, &path, &overrides);
                }
            }
        }
    }
}
