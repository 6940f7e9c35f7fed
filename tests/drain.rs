//! Graceful drain through the real binary (issue 16, the preStop pattern): on SIGTERM `/ready`
//! turns 503 at once while the listener keeps accepting and serving for `server.drain_delay_s`,
//! then the port closes and the process exits cleanly.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};

use kvgate_system_tests::{Proc, Sims};
use kvgate_testkit::{poll_for_blocking, poll_until_blocking, PATIENCE};
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

    poll_until_blocking(PATIENCE, "the gateway to become ready", || {
        http(addr, "GET", "/ready", "").map(|r| r.0).ok() == Some(200)
    });
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

    // Not ready at once, while still accepting and serving. The drain delay bounds the wait: if
    // /ready were still 200 when the listener closes, the exchange below fails and says so.
    poll_until_blocking(PATIENCE, "/ready 503 after SIGTERM", || {
        let (status, body) = http(addr, "GET", "/ready", "")
            .expect("listener open until /ready turned 503 (the drain delay ended first)");
        assert!(
            status == 200 || body.contains("draining"),
            "{status}: {body}"
        );
        status == 503
    });
    let (status, body) = http(addr, "POST", "/v1/chat/completions", chat)
        .expect("requests are still served during the drain delay");
    assert_eq!(status, 200, "{body}");
    let served_at = term.elapsed();
    eprintln!("measured: /ready 503 and a request served {served_at:?} after SIGTERM");

    // Then the port closes and the process exits by itself.
    poll_until_blocking(PATIENCE, "the listener to close after SIGTERM", || {
        TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err()
    });
    let closed_at = term.elapsed();
    eprintln!("measured: port refused {closed_at:?} after SIGTERM (drain_delay_s = 4)");
    // The gateway's delay starts when it gets the signal, after `term` was read.
    assert!(
        closed_at >= Duration::from_secs(4),
        "closed after {closed_at:?}"
    );
    let st = poll_for_blocking(PATIENCE, "the gateway to exit", || gw.0.try_wait().unwrap());
    assert!(st.success(), "gateway exit status {st}");
}
