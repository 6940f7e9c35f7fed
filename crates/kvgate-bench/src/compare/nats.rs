//! The NATS server that replicated gateways share (`--replicas N` with the cluster on): the one
//! given with `--nats-url`, or a `nats-server` from PATH that the comparison starts on a free
//! loopback port and stops (by its pid, through its guard) when it ends.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::children::{self, ChildGuard};

/// The `nats-server` executable on PATH, if any.
pub fn find_server() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("nats-server"))
        .find(|p| p.is_file())
}

/// Where `nats-server` was found, or the error that says what to do.
pub fn require_server() -> anyhow::Result<PathBuf> {
    find_server().ok_or_else(|| {
        anyhow::anyhow!(
            "replicas with the cluster on need NATS: nats-server is not on PATH (install it, e.g. \
             `apt-get install nats-server`), or give --nats-url nats://HOST:PORT of a running NATS, \
             or run the replicas without the cluster (policy key cluster=false)"
        )
    })
}

/// A NATS server for the comparison's gateways.
pub struct Nats {
    /// `nats://127.0.0.1:PORT`, or `--nats-url` as given.
    pub url: String,
    /// The server we started (none when `--nats-url` was given).
    child: Option<ChildGuard>,
}

impl Nats {
    /// Uses `url` when given; otherwise starts `server` (default: the one on PATH) on a free
    /// loopback port and waits until it accepts connections.
    pub async fn start(
        url: Option<&str>,
        server: Option<&Path>,
        log_dir: &Path,
    ) -> anyhow::Result<Self> {
        if let Some(url) = url {
            anyhow::ensure!(
                url.starts_with("nats://"),
                "--nats-url must be nats://host:port (got {url:?})"
            );
            return Ok(Self {
                url: url.to_owned(),
                child: None,
            });
        }
        let server = match server {
            Some(s) => s.to_path_buf(),
            None => require_server()?,
        };
        let port = children::free_port()?;
        let args: Vec<String> = vec![
            "-a".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
        ];
        let mut child = ChildGuard::spawn(&server, &args, "nats-server", log_dir)?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Err(e) = child.check_alive() {
                child.stop().await;
                return Err(e);
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                let log = child.log.clone();
                child.stop().await;
                anyhow::bail!(
                    "nats-server did not listen on 127.0.0.1:{port} within 20 s (log: {})",
                    log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            url: format!("nats://127.0.0.1:{port}"),
            child: Some(child),
        })
    }

    /// Stops the server we started (and reaps it); a given `--nats-url` is left alone.
    pub async fn stop(self) {
        if let Some(c) = self.child {
            c.stop().await;
        }
    }
}
