//! Child processes a test starts: killed by their pid and reaped on drop, so a failing assertion
//! leaks nothing, with their output lines on a channel to wait on.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The `kvgate` binary: `$KVGATE_BIN`, else the one cargo built beside the running test
/// executable (`target/<profile>/deps/<test>` → `target/<profile>/kvgate`).
pub fn kvgate_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVGATE_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executable under target/<profile>/deps");
    let bin = profile_dir.join(format!("kvgate{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} not found: build it first (`cargo build -p kvgate`, or run the suites with \
         `cargo nextest run --workspace`, which builds it), or set KVGATE_BIN",
        bin.display()
    );
    bin
}

/// A child whose pipes the caller handles, killed (by its pid) and reaped on drop.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A child process with its stdout and stderr lines (ANSI colour removed) arriving on `lines`,
/// killed (by its pid) and reaped on drop.
pub struct Proc {
    pub name: &'static str,
    child: Child,
    pub lines: mpsc::Receiver<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Spawn the kvgate binary with `args`.
    pub fn kvgate(name: &'static str, args: &[&str]) -> Proc {
        Self::kvgate_env(name, args, &[])
    }

    /// As [`Proc::kvgate`] with extra environment variables. Inherited `KVGATE_*` variables
    /// (but `KVGATE_PYTHON`) are removed so the developer's shell cannot change what a test runs.
    pub fn kvgate_env(name: &'static str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(kvgate_bin());
        cmd.args(args).env("NO_COLOR", "1");
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("KVGATE_") && k != "KVGATE_PYTHON" {
                cmd.env_remove(k);
            }
        }
        cmd.envs(env.iter().copied());
        Self::spawn(name, cmd)
    }

    /// Spawn any command with its output collected line by line on `lines`.
    pub fn spawn(name: &'static str, mut cmd: Command) -> Proc {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        for pipe in [Box::new(out) as Box<dyn Read + Send>, Box::new(err)] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    if tx.send(strip_ansi(&line)).is_err() {
                        break;
                    }
                }
            });
        }
        Proc {
            name,
            child,
            lines: rx,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has ended.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Wait for an output line for which `f` returns `Some`, up to `limit`. Panics with every
    /// line seen when the process exits first or the limit passes.
    pub fn wait_for<T>(&mut self, limit: Duration, mut f: impl FnMut(&str) -> Option<T>) -> T {
        let end = Instant::now() + limit;
        let mut seen = Vec::new();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Its last lines may still be in the pipe readers: take what they have.
                let drained = Instant::now() + Duration::from_secs(2);
                while let Ok(l) = self
                    .lines
                    .recv_timeout(drained.saturating_duration_since(Instant::now()))
                {
                    if let Some(v) = f(&l) {
                        return v;
                    }
                    seen.push(l);
                }
                panic!(
                    "{} exited ({status}) before the awaited line; output:\n{}",
                    self.name,
                    seen.join("\n")
                );
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                panic!(
                    "{}: no awaited line within {limit:?}; output:\n{}",
                    self.name,
                    seen.join("\n")
                );
            }
            match self
                .lines
                .recv_timeout(left.min(Duration::from_millis(200)))
            {
                Ok(line) => {
                    if let Some(v) = f(&line) {
                        return v;
                    }
                    seen.push(line);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                // Both pipes closed: the process is exiting; the next try_wait sees it.
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

/// `s` without ANSI CSI sequences (ESC [ params final-byte).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if ('@'..='~').contains(&d) && d != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn waits_for_a_line_and_kills_by_pid_on_drop() {
        let mut p = Proc::spawn(
            "sh",
            sh("echo '\x1b[32mhello\x1b[0m port=7'; exec sleep 600"),
        );
        let port = p.wait_for(Duration::from_secs(20), |l| {
            l.strip_prefix("hello port=").map(str::to_string)
        });
        assert_eq!(port, "7");
        let pid = p.id();
        drop(p);
        // Reaped: the pid no longer names a live child of ours.
        let alive = std::path::Path::new(&format!("/proc/{pid}")).exists()
            && std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| !s.contains(") Z "));
        assert!(!alive, "pid {pid} survived its guard");
    }

    #[test]
    fn a_process_that_exits_first_fails_with_its_output() {
        let mut p = Proc::spawn("sh", sh("echo starting; echo oops >&2; exit 3"));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.wait_for(Duration::from_secs(20), |l| (l == "ready").then_some(()))
        }));
        let msg = r.unwrap_err();
        let msg = msg.downcast_ref::<String>().unwrap();
        assert!(msg.contains("exited") && msg.contains("oops"), "{msg}");
    }

    #[test]
    fn a_child_guard_kills_on_drop() {
        let g = ChildGuard(sh("exec sleep 600").spawn().unwrap());
        let pid = g.id();
        drop(g);
        let alive =
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "));
        assert!(!alive, "pid {pid} survived its guard");
    }
}
