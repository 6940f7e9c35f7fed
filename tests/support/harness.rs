//! Processes with their output on a channel ([`Proc`]), `kvgate sim` / `kvgate serve` started on
//! loopback ephemeral ports, a tiny HTTP/1.1 client, the skip-or-fail rule for external tools, and
//! a PromQL metric-name extractor (the `deploy_*`, `cost_replicas`, `gpu_metrics` suites).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

pub fn repo_root() -> PathBuf {
    crate::repo_root()
}

/// The common brief's rule for external tools: missing locally → print "skipped" and return
/// false; missing under CI → fail.
pub fn tool_missing(why: &str) -> bool {
    if std::env::var_os("CI").is_some() {
        panic!("CI is set but {why}");
    }
    eprintln!("skipped: {why}");
    true
}

/// A child process killed (by its pid) and reaped on drop, its output lines on a channel
/// (`Proc::kvgate`, `Proc::spawn`, `Proc::wait_for`).
pub use kvgate_testkit::Proc;

/// The first `key=<socket addr>` token in a line.
pub fn addr_after(line: &str, key: &str) -> Option<SocketAddr> {
    let i = line.find(key)?;
    let rest = &line[i + key.len()..];
    let end = rest
        .find(|c: char| c.is_whitespace() || c == ',' || c == '"')
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// A simulated vLLM worker (`kvgate sim`, no step delay, no KV events) and its HTTP address.
pub fn start_sim(model: &str) -> (Proc, SocketAddr) {
    start_sim_with(model, &[])
}

/// As [`start_sim`] with extra `kvgate sim` flags (faults, ...).
pub fn start_sim_with(model: &str, extra: &[&str]) -> (Proc, SocketAddr) {
    let mut args = vec![
        "sim",
        "--port",
        "0",
        "--no-kv-events",
        "--speedup",
        "0",
        "--model",
        model,
    ];
    args.extend_from_slice(extra);
    let mut sim = Proc::kvgate("kvgate sim", &args);
    let addr = sim.wait_for(Duration::from_secs(20), |l| addr_after(l, "http="));
    sim.wait_for(Duration::from_secs(20), |l| {
        (l.trim() == "ready").then_some(())
    });
    (sim, addr)
}

/// `kvgate serve` in front of `worker`, listening on an ephemeral loopback port.
pub fn start_gateway(worker: SocketAddr, model: &str) -> (Proc, SocketAddr) {
    let url = format!("http://{worker}");
    let mut gw = Proc::kvgate(
        "kvgate serve",
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--worker",
            &url,
            "--model",
            model,
            "--no-request-log",
            "--log",
            "info",
        ],
    );
    let addr = gw.wait_for(Duration::from_secs(20), serving_addr);
    (gw, addr)
}

/// The data-path address in `kvgate serve`'s startup line on stderr,
/// `kvgate serve: listening on http://ADDR` (earlier builds: a log line `kvgate serving addr=ADDR`).
pub fn serving_addr(line: &str) -> Option<SocketAddr> {
    if let Some(rest) = line.strip_prefix("kvgate serve: listening on http://") {
        return rest.trim().parse().ok();
    }
    if line.contains("kvgate serving") {
        return addr_after(line, "addr=");
    }
    None
}

/// One HTTP/1.1 request (Connection: close); returns status and body.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    try_http(addr, method, path, body)
        .unwrap_or_else(|e| panic!("{method} http://{addr}{path}: {e}"))
}

/// A GET that may fail (server still starting): None on any I/O error.
pub fn http_maybe(addr: SocketAddr, method: &str, path: &str) -> Option<(u16, String)> {
    try_http(addr, method, path, None).ok()
}

/// One HTTP/1.1 request (Connection: close) whose I/O errors the caller handles.
pub fn try_http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    try_http_with(addr, method, path, "", body)
}

/// As [`try_http`] with extra header lines (each ending in `\r\n`).
pub fn try_http_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/plain;version=0.0.4\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{headers}Connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
    });
    Ok((
        status,
        if chunked {
            dechunk(rest)
        } else {
            rest.to_string()
        },
    ))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Names a Prometheus text exposition declares: every sample name, plus for each `# TYPE` family
/// the names its samples may carry (histograms: `_bucket`, `_sum`, `_count`), so a family with no
/// sample yet (a labelled counter nothing has incremented) still counts as exported.
pub fn exported_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (it.next(), it.next()) {
                names.insert(name.to_string());
                if kind == "histogram" {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{suffix}"));
                    }
                }
                // OpenMetrics names a counter family without `_total` on its TYPE line; its
                // samples (none yet in a family without series) carry it.
                if kind == "counter" && !name.ends_with("_total") {
                    names.insert(format!("{name}_total"));
                }
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// Metric names referenced by a PromQL expression: identifiers that are not functions (followed by
/// `(`), not aggregations or keywords, not inside label matchers `{...}`, ranges `[...]` or strings, and not the
/// label lists of `by`/`without`/`on`/`ignoring`/`group_left`/`group_right`.
pub fn promql_metric_names(expr: &str) -> Vec<String> {
    const KEYWORDS: &[&str] = &[
        "and", "or", "unless", "bool", "offset", "inf", "nan", "atan2",
    ];
    const LABEL_LISTS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    // Aggregations may put `by (...)` between their name and `(`: `sum by (le) (rate(x[5m]))`.
    const AGGREGATIONS: &[&str] = &[
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
        "group",
    ];
    let b = expr.as_bytes();
    let mut names = Vec::new();
    let mut i = 0;
    let mut skip_next_parens = false;
    while i < b.len() {
        let c = b[i] as char;
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < b.len() && b[i] as char != c {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { b'}' } else { b']' };
                while i < b.len() && b[i] != close {
                    i += 1;
                }
                i += 1;
            }
            '(' if skip_next_parens => {
                while i < b.len() && b[i] != b')' {
                    i += 1;
                }
                i += 1;
                skip_next_parens = false;
            }
            c if c.is_ascii_digit() || c == '.' => {
                // numbers and durations: 0.99, 1e6, 5m
                while i < b.len() && ((b[i] as char).is_ascii_alphanumeric() || b[i] == b'.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < b.len()
                    && ((b[i] as char).is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b':')
                {
                    i += 1;
                }
                let word = &expr[start..i];
                let mut j = i;
                while j < b.len() && (b[j] as char).is_whitespace() {
                    j += 1;
                }
                let is_call = j < b.len() && b[j] == b'(';
                let lower = word.to_ascii_lowercase();
                if LABEL_LISTS.contains(&lower.as_str()) {
                    skip_next_parens = true;
                } else if !is_call
                    && !KEYWORDS.contains(&lower.as_str())
                    && !AGGREGATIONS.contains(&lower.as_str())
                {
                    names.push(word.to_string());
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// Every `expr:` of a Prometheus rules file (single-line or `|`/`>` block scalars).
pub fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("expr:") {
            let rest = rest.trim();
            if rest.starts_with('|') || rest.starts_with('>') {
                let indent = line.len() - trimmed.len();
                let mut block = String::new();
                i += 1;
                while i < lines.len() {
                    let l = lines[i];
                    let ind = l.len() - l.trim_start().len();
                    if !l.trim().is_empty() && ind <= indent {
                        break;
                    }
                    block.push_str(l.trim());
                    block.push('\n');
                    i += 1;
                }
                out.push(block);
                continue;
            }
            out.push(rest.trim_matches(|c| c == '\'' || c == '"').to_string());
        }
        i += 1;
    }
    out
}

/// The value of one exposition-format sample: the line that starts with `series` (name and label
/// set, exactly as rendered) followed by a space.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}
