//! Child processes (`kvgate sim`, `kvgate serve`) owned by guards: a child is killed when its guard
//! drops, so an error, a panic or Ctrl-C in the comparison never leaves servers behind. Each
//! child's stderr goes to a log file under the output directory, for the post-mortem.
//!
//! These are `std::process` children (stdout read on a thread of its own): tokio's `process`
//! feature would make every park of every runtime in the binary check for orphans to reap,
//! `kvgate serve`'s request path included (about 116 instructions per request).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::sync::mpsc;

use super::http;

/// A running child process, killed on drop.
pub struct ChildGuard {
    name: String,
    child: Child,
    /// Lines the child printed on stdout (addresses, readiness).
    pub stdout: mpsc::UnboundedReceiver<String>,
    pub log: PathBuf,
}

impl ChildGuard {
    /// Starts `exe args...`, stdout captured line by line, stderr appended to `log_dir/name.log`.
    pub fn spawn(exe: &Path, args: &[String], name: &str, log_dir: &Path) -> anyhow::Result<Self> {
        Self::spawn_with_env(exe, args, name, log_dir, &[])
    }

    /// [`ChildGuard::spawn`] with extra environment variables.
    pub fn spawn_with_env(
        exe: &Path,
        args: &[String],
        name: &str,
        log_dir: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(log_dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", log_dir.display()))?;
        let log = log_dir.join(format!("{name}.log"));
        let err = std::fs::File::create(&log)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", log.display()))?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err))
            .env(
                "RUST_LOG",
                std::env::var("KVGATE_BENCH_CHILD_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .envs(env.iter().copied())
            .spawn()
            .map_err(|e| {
                anyhow::anyhow!("cannot start {} {}: {e}", exe.display(), args.join(" "))
            })?;
        // Printed so an operator (and the end-to-end test) can check no child outlives us.
        eprintln!("started {name} (pid {}), log {}", child.id(), log.display());
        let (tx, rx) = mpsc::unbounded_channel();
        let out = child.stdout.take();
        // From here on the guard owns the child: an error below still kills it.
        let guard = Self {
            name: name.to_owned(),
            child,
            stdout: rx,
            log,
        };
        if let Some(out) = out {
            // Ends by itself when the child's stdout closes (the child exited or was killed).
            std::thread::Builder::new()
                .name(format!("{name}-stdout"))
                .spawn(move || {
                    for line in BufReader::new(out).lines() {
                        let Ok(line) = line else { break };
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| {
                    anyhow::anyhow!("cannot start a thread reading {name}'s stdout: {e}")
                })?;
        }
        Ok(guard)
    }

    /// Fails if the child has already exited (with the tail of its log).
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            let tail = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(15).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            anyhow::bail!(
                "{} exited early ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                tail.join("\n")
            );
        }
        Ok(())
    }

    /// Waits until `url` answers 2xx, failing fast if the child dies.
    pub async fn wait_http_ok(&mut self, url: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            self.check_alive()?;
            if let Ok((status, _)) = http::get(url).await {
                if status.is_success() {
                    return Ok(());
                }
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{} not ready at {url} after {timeout:?} (log: {})",
                self.name,
                self.log.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills the child and reaps it (polling for its exit for up to 5 s; the drop that follows
    /// reaps it in any case).
    pub async fn stop(mut self) {
        let _ = self.child.kill();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while matches!(self.child.try_wait(), Ok(None)) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for ChildGuard {
    /// Kills a child still running and reaps it (SIGKILL: it is gone a moment later).
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A port that was free a moment ago on 127.0.0.1 (bind port 0, read it, release it).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(free_ports(1)?[0])
}

/// `n` distinct ports that were free a moment ago: every listener is held until all are bound,
/// so two children started back to back never get the same one.
pub fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let held = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| anyhow::anyhow!("cannot bind a loopback port: {e}"))?;
    held.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn free_ports_are_distinct() {
        let mut ports = super::free_ports(64).unwrap();
        assert!(ports.iter().all(|&p| p > 0));
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 64);
    }
}
