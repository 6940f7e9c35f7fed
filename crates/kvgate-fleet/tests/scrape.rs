//! Monitors against tiny in-test HTTP servers serving the fixture texts: fresh load, a stalled
//! `/metrics` going stale without blocking anything, block-size mismatch, kind probing, health flaps,
//! TRT-LLM event polling, and clean shutdown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvgate_core::{block_hashes, hash_seed, KvIndex, WorkerId};
use kvgate_fleet::{
    BreakerConfig, BreakerState, IndexSink, KvEventsSource, MonitorConfig, ResetReason, WorkerKind,
    WorkerMonitor,
};
use kvgate_testkit::{until, PATIENCE};
use parking_lot::RwLock;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

macro_rules! fixture {
    ($f:literal) => {
        include_str!(concat!("../../kvgate-protocol/tests/fixtures/", $f))
    };
}

enum Reply {
    Body(u16, &'static str, String),
    Stall,
}

type Handler = Arc<dyn Fn(&str, &str) -> Reply + Send + Sync>;

/// A one-request-per-connection HTTP/1.1 server on 127.0.0.1:0; stops when the runtime does.
async fn serve(h: Handler) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let h = h.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).to_string();
                let mut first = head.lines().next().unwrap_or("").split(' ');
                let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
                match h(method, path) {
                    Reply::Stall => {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    Reply::Body(status, ctype, body) => {
                        let resp = format!(
                            "HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = s.write_all(resp.as_bytes()).await;
                    }
                }
            });
        }
    });
    addr
}

fn ok(ctype: &'static str, body: &str) -> Reply {
    Reply::Body(200, ctype, body.to_owned())
}

fn not_found() -> Reply {
    Reply::Body(404, "text/plain", "not found".into())
}

fn fast(cfg: &mut MonitorConfig) {
    // Short periods, timeouts with room: a scrape or probe a loaded machine answers late must
    // not read as a stalled or dead worker.
    cfg.scrape_interval = Duration::from_millis(20);
    cfg.scrape_timeout = Duration::from_millis(500);
    cfg.stale_after = Duration::from_secs(1);
    cfg.health_interval = Duration::from_millis(20);
    cfg.health_timeout = Duration::from_secs(1);
    cfg.kv_poll_interval = Duration::from_millis(20);
}

fn sink(bs: u32) -> Arc<IndexSink> {
    Arc::new(IndexSink::new(Arc::new(RwLock::new(KvIndex::new())), bs))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_load_stale_worker_and_block_size_mismatch() {
    let vllm = serve(Arc::new(|_, p| match p {
        "/metrics" => ok(
            "text/plain; version=0.0.4",
            fixture!("metrics_vllm_0.33.prom"),
        ),
        "/health" => ok("text/plain", ""),
        _ => not_found(),
    }))
    .await;
    let stalled = serve(Arc::new(|_, p| match p {
        "/metrics" => Reply::Stall,
        "/health" => ok("text/plain", ""),
        _ => not_found(),
    }))
    .await;
    let s = sink(32);
    let mut a = MonitorConfig::new(WorkerId(0), format!("http://{vllm}/v1"), WorkerKind::Vllm);
    let mut b = MonitorConfig::new(WorkerId(1), format!("http://{stalled}"), WorkerKind::Vllm);
    for c in [&mut a, &mut b] {
        fast(c);
        c.block_size = Some(32);
        c.kv_events = KvEventsSource::Off;
    }
    let ha = WorkerMonitor::spawn(a, s.clone());
    let hb = WorkerMonitor::spawn(b, s.clone());
    until(PATIENCE, "worker 1 stale", || s.view(WorkerId(1)).stale).await;
    let before = ha.stats().snapshot().scrapes_ok;
    until(PATIENCE, "worker 0 keeps scraping", || {
        ha.stats().snapshot().scrapes_ok >= before + 3
    })
    .await;
    let v0 = s.view(WorkerId(0));
    let load = v0.load.expect("worker 0 scraped");
    assert_eq!(
        (load.running, load.waiting, load.block_size),
        (Some(5), Some(1), Some(16))
    );
    assert!(!v0.stale);
    assert_eq!(
        v0.block_size_mismatch,
        Some(16),
        "engine 16 vs configured 32 is reported"
    );
    assert_eq!(v0.up, Some(true));
    let v1 = s.view(WorkerId(1));
    assert!(v1.load.is_none());
    assert_eq!(v1.up, Some(true), "a stalled /metrics is not a dead worker");
    assert_eq!(
        hb.stats().snapshot().scrapes_stale,
        1,
        "stale is reported once"
    );
    tokio::time::timeout(Duration::from_secs(5), async {
        ha.shutdown().await;
        hb.shutdown().await;
    })
    .await
    .expect("shutdown does not hang on a stalled scrape");
}

/// The mismatch flag is not sticky: once the engine reports the pool's block size (restarted with
/// the right setting), the worker is back in KV scoring.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_size_mismatch_clears_when_a_later_scrape_agrees() {
    let fixed = Arc::new(AtomicBool::new(false));
    let f = fixed.clone();
    let addr = serve(Arc::new(move |_, p| match p {
        "/metrics" if f.load(Ordering::Relaxed) => ok(
            "text/plain; version=0.0.4",
            &fixture!("metrics_vllm_0.33.prom").replace("block_size=\"16\"", "block_size=\"32\""),
        ),
        "/metrics" => ok(
            "text/plain; version=0.0.4",
            fixture!("metrics_vllm_0.33.prom"),
        ),
        "/health" => ok("text/plain", ""),
        _ => not_found(),
    }))
    .await;
    let s = sink(32);
    let mut c = MonitorConfig::new(WorkerId(0), format!("http://{addr}"), WorkerKind::Vllm);
    fast(&mut c);
    c.block_size = Some(32);
    c.kv_events = KvEventsSource::Off;
    let h = WorkerMonitor::spawn(c, s.clone());
    until(PATIENCE, "mismatch reported", || {
        s.view(WorkerId(0)).block_size_mismatch == Some(16)
    })
    .await;
    fixed.store(true, Ordering::Relaxed);
    until(PATIENCE, "mismatch cleared", || {
        s.view(WorkerId(0)).block_size_mismatch.is_none()
    })
    .await;
    assert_eq!(s.view(WorkerId(0)).load.unwrap().block_size, Some(32));
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_probe_llamacpp_and_trtllm_json_fallback() {
    let llama = serve(Arc::new(|_, p| match p {
        "/metrics" => ok(
            "text/plain; version=0.0.4",
            fixture!("metrics_llamacpp.prom"),
        ),
        "/slots" => ok("application/json", fixture!("llamacpp_slots.json")),
        "/health" => ok("application/json", r#"{"status":"ok"}"#),
        _ => not_found(),
    }))
    .await;
    let trt = serve(Arc::new(|_, p| match p {
        "/metrics" => ok(
            "application/json",
            fixture!("metrics_trtllm_iteration_stats.json"),
        ),
        "/health" => ok("text/plain", ""),
        _ => not_found(),
    }))
    .await;
    let s = sink(16);
    let mut a = MonitorConfig::new(WorkerId(0), format!("http://{llama}"), WorkerKind::Auto);
    let mut b = MonitorConfig::new(WorkerId(1), format!("http://{trt}"), WorkerKind::Trtllm);
    fast(&mut a);
    fast(&mut b);
    b.kv_events = KvEventsSource::Off;
    let ha = WorkerMonitor::spawn(a, s.clone());
    let hb = WorkerMonitor::spawn(b, s.clone());
    until(PATIENCE, "llama.cpp scraped", || {
        s.view(WorkerId(0)).load.is_some()
    })
    .await;
    until(PATIENCE, "trtllm scraped", || {
        s.view(WorkerId(1)).load.is_some()
    })
    .await;
    let v = s.view(WorkerId(0));
    assert_eq!(v.kind, Some(WorkerKind::Llamacpp));
    let l = v.load.unwrap();
    assert_eq!(
        (l.running, l.slots_total, l.slots_busy),
        (Some(1), Some(2), Some(1))
    );
    assert_eq!(l.kv_capacity_tokens, Some(8192), "two slots of n_ctx 4096");
    let t = s.view(WorkerId(1)).load.unwrap();
    assert_eq!(
        (t.running, t.waiting, t.block_size),
        (Some(4), Some(2), Some(32))
    );
    assert_eq!(
        t.kv_capacity_tokens,
        t.num_gpu_blocks.map(|n| n * 32),
        "blocks × tokens per block"
    );
    ha.shutdown().await;
    hb.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_flap_opens_breaker_and_restart_resets_index() {
    let healthy = Arc::new(AtomicBool::new(true));
    let h = healthy.clone();
    let addr = serve(Arc::new(move |_, p| match p {
        // kind openai: health is GET /v1/models
        "/v1/models" if h.load(Ordering::SeqCst) => {
            ok("application/json", r#"{"object":"list","data":[]}"#)
        }
        "/v1/models" => Reply::Body(503, "text/plain", "loading".into()),
        _ => not_found(),
    }))
    .await;
    let s = sink(16);
    let mut c = MonitorConfig::new(WorkerId(3), format!("http://{addr}"), WorkerKind::Openai);
    fast(&mut c);
    c.health_down_after = 2;
    c.breaker = BreakerConfig {
        failure_threshold: 2,
        // Long enough to still be open when the test looks, however late that is.
        open_for: Duration::from_secs(1),
    };
    let hm = WorkerMonitor::spawn(c, s.clone());
    until(PATIENCE, "up", || s.view(WorkerId(3)).up == Some(true)).await;
    healthy.store(false, Ordering::SeqCst);
    until(PATIENCE, "down", || s.view(WorkerId(3)).up == Some(false)).await;
    assert_eq!(hm.breaker().state(), BreakerState::Open);
    healthy.store(true, Ordering::SeqCst);
    until(PATIENCE, "up again", || {
        s.view(WorkerId(3)).up == Some(true)
    })
    .await;
    assert!(s.view(WorkerId(3)).resets.contains(&ResetReason::Restart));
    until(PATIENCE, "breaker closed by a half-open probe", || {
        hm.breaker().state() == BreakerState::Closed
    })
    .await;
    assert!(hm.breaker().opens() >= 1);
    hm.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_kv_cache_events_are_polled_into_the_index() {
    let calls = Arc::new(AtomicU32::new(0));
    let c2 = calls.clone();
    let addr = serve(Arc::new(move |m, p| match (m, p) {
        ("POST", "/kv_cache_events") => {
            // The endpoint drains: the events come once, then an empty array.
            if c2.fetch_add(1, Ordering::SeqCst) == 0 {
                ok("application/json", fixture!("trtllm_kv_events.json"))
            } else {
                ok("application/json", "[]")
            }
        }
        ("GET", "/health") => ok("text/plain", ""),
        ("GET", "/prometheus/metrics") => ok("text/plain", fixture!("metrics_trtllm.prom")),
        _ => not_found(),
    }))
    .await;
    let s = sink(32);
    let mut c = MonitorConfig::new(WorkerId(2), format!("http://{addr}"), WorkerKind::Trtllm);
    fast(&mut c);
    c.block_size = Some(32);
    let hm = WorkerMonitor::spawn(c, s.clone());
    until(PATIENCE, "polled twice", || {
        calls.load(Ordering::SeqCst) >= 2
    })
    .await;
    until(PATIENCE, "events applied", || {
        s.view(WorkerId(2)).batches >= 4
    })
    .await;
    let held = s.index.read().router_hashes(WorkerId(2));
    // Blocks 0..64 stay on the GPU; block 64..96 moved to host then was removed; the 7-token block
    // is partial; the last run lives on cache level 1.
    let expect = block_hashes(&(0..64).collect::<Vec<u32>>(), 32, hash_seed(None, None));
    assert_eq!(held, {
        let mut e = expect.clone();
        e.sort_unstable();
        e
    });
    assert!(s
        .view(WorkerId(2))
        .resets
        .contains(&ResetReason::AllBlocksCleared));
    until(PATIENCE, "scraped", || s.view(WorkerId(2)).load.is_some()).await;
    assert_eq!(s.view(WorkerId(2)).load.unwrap().running, Some(5));
    hm.shutdown().await;
}

/// Against a running llama.cpp server (`KVGATE_LLAMACPP_URL=http://127.0.0.1:PORT`, see
/// shared/tools/real-engine); skipped when unset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_llamacpp_when_available() {
    let Ok(url) = std::env::var("KVGATE_LLAMACPP_URL") else {
        eprintln!("skipped: KVGATE_LLAMACPP_URL not set");
        return;
    };
    let s = sink(16);
    let mut c = MonitorConfig::new(WorkerId(0), url, WorkerKind::Auto);
    fast(&mut c);
    c.scrape_timeout = Duration::from_secs(2);
    let h = WorkerMonitor::spawn(c, s.clone());
    until(PATIENCE, "real llama.cpp scraped", || {
        s.view(WorkerId(0)).load.is_some()
    })
    .await;
    let v = s.view(WorkerId(0));
    assert_eq!(v.kind, Some(WorkerKind::Llamacpp));
    assert_eq!(v.up, Some(true));
    let l = v.load.unwrap();
    eprintln!("real llama.cpp load: {l:?}");
    assert!(l.running.is_some() && l.slots_total.unwrap_or(0) >= 1);
    h.shutdown().await;
}
