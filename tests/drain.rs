//! Graceful drain through the real binary (issue 16, the preStop pattern): on SIGTERM `/ready`
//! turns 503 at once while the listener keeps accepting and serving for `server.drain_delay_s`,
//! then the port closes and the process exits cleanly.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};

use kvgate_system_tests::{Proc, Sims};
use std::time::{Duration, Instant};

/// One HTTP/1.1 exchange with `Connection: close`: (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    kvgate_system_tests::harness::try_http(addr, method, path, Some(body))
}

fn read_until<R: BufRead>(r: &mut R, within: Duration, mut f: impl FnMut(&str) -> bool) -> String {
    let end = Instant::now() + within;
    let mut line = String::new();
    while Instant::now() < end {
        line.clear();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        if f(line.trim()) {
            return line.trim().to_string();
        }
    }
    panic!("expected line not seen (last: {line:?})");
}

#[test]
fn sigterm_reports_not_ready_keeps_serving_for_the_drain_delay_then_closes() {
    let bin = kvgate_system_tests::kvgate_bin();
    let sims = Sims::start(1, "sim-model", &[]);
    let url = &sims.urls[0];

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kvgate.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\ndrain_delay_s = 4\n\
             [[workers]]\nurl = \"{url}\"\nmodels = [\"sim-model\"]\n"
        ),
    )
    .unwrap();
    let mut gw = Command::new(&bin)
        .args(["serve", "--config", cfg.to_str().unwrap(), "--log", "warn"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate serve starts");
    let mut gw_err = BufReader::new(gw.stderr.take().unwrap());
    let pid = gw.id();
    let mut gw = Proc(gw);
    let line = read_until(&mut gw_err, Duration::from_secs(30), |l| {
        l.starts_with("kvgate serve: listening on http://")
    });
    let addr: SocketAddr = line
        .trim_start_matches("kvgate serve: listening on http://")
        .parse()
        .unwrap();
    // Keep draining the gateway's stderr so it never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        while gw_err.read_line(&mut sink).unwrap_or(0) > 0 {
            sink.clear();
        }
    });

    let end = Instant::now() + Duration::from_secs(30);
    while http(addr, "GET", "/ready", "").map(|r| r.0).ok() != Some(200) {
        assert!(Instant::now() < end, "gateway never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let chat =
        r#"{"model":"sim-model","messages":[{"role":"user","content":"hello"}],"max_tokens":4}"#;
    assert_eq!(
        http(addr, "POST", "/v1/chat/completions", chat).unwrap().0,
        200
    );

    let term = Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());

    // Not ready at once, while still accepting and serving.
    let end = Instant::now() + Duration::from_secs(3);
    loop {
        let (status, body) = http(addr, "GET", "/ready", "").expect("listener still open");
        if status == 503 {
            assert!(body.contains("draining"), "{body}");
            break;
        }
        assert!(Instant::now() < end, "/ready still {status} after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, body) = http(addr, "POST", "/v1/chat/completions", chat)
        .expect("requests are still served during the drain delay");
    assert_eq!(status, 200, "{body}");
    let served_at = term.elapsed();
    eprintln!("measured: /ready 503 and a request served {served_at:?} after SIGTERM");

    // Then the port closes and the process exits by itself.
    let end = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok() {
        assert!(
            Instant::now() < end,
            "listener still open 30 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let closed_at = term.elapsed();
    eprintln!("measured: port refused {closed_at:?} after SIGTERM (drain_delay_s = 4)");
    // The gateway's delay starts when it gets the signal, after `term` was read.
    assert!(
        closed_at >= Duration::from_secs(4),
        "closed after {closed_at:?}"
    );
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = gw.0.try_wait().unwrap() {
            assert!(st.success(), "gateway exit status {st}");
            break;
        }
        assert!(Instant::now() < end, "gateway did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}
