//! Real vLLM 0.32 engines (CPU build, installed by `benches/engines/vllm-setup.sh`) for the
//! `real_vllm` suite: where the install is, an engine started by `benches/engines/vllm-serve.sh` in
//! its own process group (stopped by that pid on drop), and a test-side subscriber to the engine's
//! KV events that keeps the engine's cache contents as the events describe them.

use std::collections::{BTreeSet, HashSet};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvgate_protocol::kv_events::{decode_multipart, KvEvent};

use crate::harness::{http_maybe, try_http};

/// The install directory: `$KVGATE_VLLM_DIR`, else `$KVGATE_ENGINE_CACHE/vllm-0.32.0` (default
/// cache `~/.cache/kvgate-engines`), if it holds a venv with `vllm` and the tiny model.
pub fn engine_dir() -> Result<PathBuf, String> {
    let dir = match std::env::var_os("KVGATE_VLLM_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let cache = std::env::var_os("KVGATE_ENGINE_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvgate-engines"))
                })
                .ok_or("neither KVGATE_ENGINE_CACHE nor HOME is set")?;
            cache.join("vllm-0.32.0")
        }
    };
    for need in [
        "venv/bin/vllm",
        "model-tiny/tokenizer.json",
        "model-tiny/config.json",
    ] {
        if !dir.join(need).is_file() {
            return Err(format!(
                "no vLLM engine at {} ({need} missing: run benches/engines/vllm-setup.sh)",
                dir.display()
            ));
        }
    }
    Ok(dir)
}

/// `n` distinct free TCP ports on every interface (vLLM binds its KV-event PUB on `*`), all held
/// open until every one is chosen. They are taken below the kernel's ephemeral range: vLLM binds its
/// HTTP port only minutes after it was chosen, and a port from the ephemeral range could meanwhile be
/// handed to any other process binding port 0 (other suites running beside this one).
pub fn free_ports(n: usize) -> Vec<u16> {
    let ephemeral_lo = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (lo, hi) = (10_000u32, ephemeral_lo.max(12_000));
    // A different start per process, so two runs side by side do not probe the same ports first.
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        ^ (u64::from(std::process::id()) << 32);
    let mut held = Vec::new();
    for _ in 0..100_000 {
        if held.len() == n {
            break;
        }
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let port = (lo + ((x >> 33) as u32) % (hi - lo)) as u16;
        if let Ok(l) = TcpListener::bind(("0.0.0.0", port)) {
            held.push(l);
        }
    }
    assert_eq!(held.len(), n, "no {n} free ports below {hi}");
    held.iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// How to start one engine.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    pub cpus: String,
    /// `--num-gpu-blocks-override` (a small cache: BlockRemoved flows).
    pub blocks: Option<u32>,
    pub extra: Vec<String>,
}

/// One `vllm serve` (API server + engine core) in its own process group.
pub struct Engine {
    pub spec: EngineSpec,
    pub dir: PathBuf,
    pub http: SocketAddr,
    pub kv_port: u16,
    pub replay_port: u16,
    child: Option<Child>,
    log: PathBuf,
}

impl Engine {
    /// Starts the engine on `ports` (HTTP, KV-event PUB, replay; from [`free_ports`], chosen for
    /// every engine of the test at once). Not yet ready: see [`Engine::wait_ready`].
    pub fn start(
        dir: &Path,
        spec: EngineSpec,
        log_dir: &Path,
        name: &str,
        ports: [u16; 3],
    ) -> Engine {
        let [http, kv, replay] = ports;
        let mut e = Engine {
            spec,
            dir: dir.to_path_buf(),
            http: SocketAddr::from(([127, 0, 0, 1], http)),
            kv_port: kv,
            replay_port: replay,
            child: None,
            log: log_dir.join(format!("{name}.log")),
        };
        e.spawn();
        e
    }

    fn spawn(&mut self) {
        use std::os::unix::process::CommandExt;
        let script = crate::repo_root().join("benches/engines/vllm-serve.sh");
        let log = std::fs::File::create(&self.log).expect("engine log file");
        let mut cmd = Command::new("bash");
        cmd.arg(script)
            .arg(self.http.port().to_string())
            .args(&self.spec.extra)
            .env("VLLM_DIR", &self.dir)
            .env("VARIANT", "tiny")
            .env("CPUS", &self.spec.cpus)
            .env("KV_PORT", self.kv_port.to_string())
            .env("REPLAY_PORT", self.replay_port.to_string())
            .env_remove("BLOCKS")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            // Its own group: the engine core and its workers are stopped with the API server.
            .process_group(0);
        if let Some(b) = self.spec.blocks {
            cmd.env("BLOCKS", b.to_string());
        }
        self.child = Some(cmd.spawn().expect("start vllm-serve.sh"));
    }

    /// Polls `GET /health` until 200; panics (with the log's tail) if the engine exits or
    /// `limit` passes.
    pub fn wait_ready(&mut self, limit: Duration) {
        let end = Instant::now() + limit;
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "vLLM on {} exited ({status}) before it was ready:\n{}",
                    self.http,
                    self.log_tail()
                );
            }
            if http_maybe(self.http, "GET", "/health").is_some_and(|(s, _)| s == 200) {
                return;
            }
            assert!(
                Instant::now() < end,
                "vLLM on {} not ready within {limit:?}:\n{}",
                self.http,
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    pub fn kv_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.kv_port)
    }

    pub fn replay_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }

    /// Stops the whole process group (SIGTERM, then SIGKILL after 20 s) and reaps the server.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = format!("-{}", child.id());
        let signal = |sig: &str| {
            let _ = Command::new("kill")
                .args([sig, "--", &group])
                .stderr(Stdio::null())
                .status();
        };
        signal("-TERM");
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Whatever is left of the group (the engine core outlives a killed server otherwise).
        signal("-KILL");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Stops the engine and starts it again on the same ports (its cache is empty again).
    pub fn restart(&mut self) {
        self.stop();
        // The old PUB/ROUTER ports must be free before the new engine binds them.
        let end = Instant::now() + Duration::from_secs(30);
        while [self.http.port(), self.kv_port, self.replay_port]
            .iter()
            .any(|p| TcpListener::bind(("0.0.0.0", *p)).is_err())
        {
            assert!(Instant::now() < end, "engine ports still taken after stop");
            std::thread::sleep(Duration::from_millis(200));
        }
        self.spawn();
    }

    pub fn post(&self, path: &str, body: &str) -> (u16, serde_json::Value) {
        let (s, b) = try_http(self.http, "POST", path, Some(body))
            .unwrap_or_else(|e| panic!("POST {}{path}: {e}", self.url()));
        (
            s,
            serde_json::from_str(&b).unwrap_or(serde_json::Value::String(b)),
        )
    }

    pub fn metrics(&self) -> String {
        try_http(self.http, "GET", "/metrics", None)
            .map(|(_, b)| b)
            .unwrap_or_default()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a test-side subscriber saw on one engine's PUB socket.
#[derive(Default, Debug)]
pub struct EventLog {
    pub batches: u64,
    pub last_seq: Option<u64>,
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
    pub malformed: u64,
    /// Engine block hashes the engine holds, per the events.
    pub blocks: HashSet<u64>,
    /// `(event type, field name)` of every event seen, from the raw msgpack (map encoding).
    pub fields: BTreeSet<(String, String)>,
    /// Payload shapes seen: "map" or "array" events.
    pub encodings: BTreeSet<String>,
    /// Block sizes the stored events carried.
    pub block_sizes: BTreeSet<u32>,
    /// Topics (first frame).
    pub topics: BTreeSet<String>,
    /// The first event of each type, as msgpack values (rendered), and the batch's shape.
    pub samples: std::collections::BTreeMap<String, String>,
    /// Lengths of the batch arrays (`[ts, events, dp_rank]` = 3).
    pub batch_lens: BTreeSet<usize>,
}

/// A ZMQ SUB connected to an engine's PUB socket on a background thread (with its own runtime),
/// stopped on drop.
pub struct Subscriber {
    pub log: Arc<Mutex<EventLog>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Subscriber {
    pub fn connect(endpoint: &str) -> Subscriber {
        let log = Arc::new(Mutex::new(EventLog::default()));
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let ep = endpoint.to_string();
        let l = log.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                use zeromq::{Socket, SocketRecv};
                let mut sock = zeromq::SubSocket::new();
                sock.connect(&ep).await.expect("connect SUB");
                sock.subscribe("").await.expect("subscribe");
                let _ = ready_tx.send(());
                loop {
                    tokio::select! {
                        _ = &mut rx => return,
                        m = sock.recv() => match m {
                            Ok(m) => record(&l, &m.into_vec()),
                            Err(_) => return,
                        }
                    }
                }
            });
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("subscriber connected");
        Subscriber {
            log,
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    pub fn with<T>(&self, f: impl FnOnce(&EventLog) -> T) -> T {
        f(&self.log.lock().unwrap())
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn record(log: &Mutex<EventLog>, frames: &[bytes::Bytes]) {
    let mut l = log.lock().unwrap();
    if let Some(t) = frames.first() {
        l.topics.insert(String::from_utf8_lossy(t).into_owned());
    }
    if let Some(payload) = frames.get(2) {
        raw_fields(&mut l, payload);
    }
    let batch = match decode_multipart(frames) {
        Ok(b) => b,
        Err(_) => {
            l.malformed += 1;
            return;
        }
    };
    l.batches += 1;
    l.last_seq = Some(batch.seq);
    for ev in batch.events {
        match ev {
            KvEvent::Stored {
                block_hashes,
                block_size,
                ..
            } => {
                l.stored += block_hashes.len() as u64;
                l.block_sizes.insert(block_size);
                l.blocks.extend(block_hashes);
            }
            KvEvent::Removed { block_hashes, .. } => {
                l.removed += block_hashes.len() as u64;
                for h in block_hashes {
                    l.blocks.remove(&h);
                }
            }
            KvEvent::AllCleared => {
                l.cleared += 1;
                l.blocks.clear();
            }
        }
    }
}

/// Field names of each event, read from the raw msgpack (independently of kvgate's decoder).
fn raw_fields(l: &mut EventLog, payload: &[u8]) {
    let Ok(v) = rmpv::decode::read_value(&mut &payload[..]) else {
        return;
    };
    if let Some(a) = v.as_array() {
        l.batch_lens.insert(a.len());
    }
    let Some(events) = v
        .as_array()
        .and_then(|a| a.get(1))
        .and_then(|e| e.as_array())
    else {
        return;
    };
    for ev in events {
        match ev {
            rmpv::Value::Map(kv) => {
                l.encodings.insert("map".into());
                let ty = kv
                    .iter()
                    .find(|(k, _)| k.as_str() == Some("type"))
                    .and_then(|(_, v)| v.as_str())
                    .unwrap_or("?")
                    .to_string();
                let order: Vec<&str> = kv.iter().filter_map(|(k, _)| k.as_str()).collect();
                l.samples
                    .entry(format!("{ty} key order"))
                    .or_insert_with(|| order.join(","));
                for (k, v) in kv {
                    if let Some(k) = k.as_str() {
                        l.fields.insert((ty.clone(), k.to_string()));
                        // Values that identify the shape, not the content.
                        if !matches!(k, "block_hashes" | "token_ids" | "parent_block_hash") {
                            l.samples
                                .entry(format!("{ty}.{k}"))
                                .or_insert_with(|| v.to_string());
                        }
                    }
                }
            }
            rmpv::Value::Array(a) => {
                l.encodings.insert("array".into());
                let ty = a.first().and_then(|t| t.as_str()).unwrap_or("?");
                l.fields
                    .insert((ty.to_string(), format!("<{} positional>", a.len())));
            }
            _ => {
                l.encodings.insert("other".into());
            }
        }
    }
}
