//! `kvgate serve`'s log lines carry ANSI colour codes only on a terminal (issue 37): piped into a
//! container runtime, journald or a file they are plain text. A pseudo-terminal comes from
//! util-linux's `script`; `NO_COLOR` turns colour off on a terminal too.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvgate_system_tests::harness::*;

/// The serve arguments: one sim worker, loopback port 0, logs at INFO.
fn serve_args(worker: SocketAddr) -> Vec<String> {
    [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &format!("http://{worker}"),
        "--model",
        "kvgate-sim",
        "--log",
        "info",
    ]
    .map(String::from)
    .to_vec()
}

/// Raw output lines (colour codes kept) of a child's pipe, on a channel.
fn raw_lines(pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Lines up to and including the first tracing line at INFO (`worker healthy` once the sim's
/// first health probe answers), within 30 s.
fn lines_until_info(rx: &mpsc::Receiver<String>) -> Vec<String> {
    let end = Instant::now() + Duration::from_secs(30);
    let mut seen: Vec<String> = Vec::new();
    loop {
        let line = rx
            .recv_timeout(end.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("no INFO line within 30 s: {seen:#?}"));
        let done = strip(&line).contains(" INFO ");
        seen.push(line);
        if done {
            return seen;
        }
    }
}

/// The text without CSI escape sequences (to find the line whatever its colouring).
fn strip(s: &str) -> String {
    let mut out = String::new();
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            for d in it.by_ref() {
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

/// A child stopped by pid (and reaped) on drop.
struct Reaped(Child);
impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn logs_to_a_pipe_are_plain_text() {
    let (_sim, worker) = start_sim("kvgate-sim");
    let mut child = Command::new(kvgate_system_tests::kvgate_bin())
        .args(serve_args(worker))
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate serve starts");
    let rx = raw_lines(child.stderr.take().unwrap());
    let _child = Reaped(child);
    let seen = lines_until_info(&rx);
    assert!(
        seen.iter().all(|l| !l.contains('\u{1b}')),
        "colour codes in piped logs: {seen:#?}"
    );
}

/// `kvgate serve` on a pseudo-terminal (util-linux `script`); the lines it printed there.
fn serve_on_a_terminal(no_color: Option<&str>) -> Option<Vec<String>> {
    if Command::new("script").arg("--version").output().is_err() {
        tool_missing("util-linux `script` (a pseudo-terminal) is not installed");
        return None;
    }
    let (_sim, worker) = start_sim("kvgate-sim");
    let bin = kvgate_system_tests::kvgate_bin();
    let mut inner = format!("exec '{}'", bin.display());
    for a in serve_args(worker) {
        inner.push_str(&format!(" '{a}'"));
    }
    let mut cmd = Command::new("script");
    // -q: no banner; -f: flush each write; -e: its exit status is the command's.
    cmd.args(["-qfec", &inner, "/dev/null"])
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(v) = no_color {
        cmd.env("NO_COLOR", v);
    }
    let mut script = cmd.spawn().expect("script starts");
    let rx = raw_lines(script.stdout.take().unwrap());
    let script_pid = script.id();
    let script = Reaped(script);
    let seen = lines_until_info(&rx);
    // kvgate is script's child (exec'd by its shell): stop it by its pid, then script ends too.
    let children =
        std::fs::read_to_string(format!("/proc/{script_pid}/task/{script_pid}/children"))
            .unwrap_or_default();
    for pid in children.split_whitespace() {
        let _ = Command::new("kill").args(["-KILL", pid]).status();
    }
    drop(script);
    Some(seen)
}

#[test]
fn logs_on_a_terminal_are_coloured() {
    let Some(seen) = serve_on_a_terminal(None) else {
        return;
    };
    let info = seen.last().unwrap();
    assert!(
        info.contains('\u{1b}'),
        "no colour on a terminal: {seen:#?}"
    );
}

#[test]
fn no_color_turns_colour_off_on_a_terminal() {
    let Some(seen) = serve_on_a_terminal(Some("1")) else {
        return;
    };
    assert!(
        seen.iter().all(|l| !l.contains('\u{1b}')),
        "colour codes with NO_COLOR=1: {seen:#?}"
    );
}
