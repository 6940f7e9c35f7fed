//! kvgate's own `process_*` metrics (the names Prometheus client libraries use), read from Linux
//! `/proc/self` when `/metrics` is served. Nothing is cached: each read is a handful of small
//! files. On other systems (or if `/proc` is unreadable) the families are simply absent.

use std::fmt::Write;

/// `/proc` reports CPU times and the start time in clock ticks of `USER_HZ`, which the Linux ABI
/// fixes at 100 for user space on every architecture kvgate builds for (`sysconf(_SC_CLK_TCK)`
/// would need libc).
const USER_HZ: f64 = 100.0;
const PAGE_BYTES: f64 = 4096.0;

/// What one read of `/proc/self` found.
#[derive(Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    pub start_time_seconds: f64,
    pub open_fds: Option<f64>,
    pub max_fds: Option<f64>,
    pub threads: f64,
}

/// Fields of `/proc/self/stat` after the `(comm)` field (which may contain spaces and parens),
/// plus the boot time from `/proc/stat`'s `btime` line.
pub fn parse(stat: &str, proc_stat: &str) -> Option<ProcessStats> {
    let after = &stat[stat.rfind(')')? + 1..];
    // `after` starts at field 3 (state); field n is at index n - 3.
    let f: Vec<&str> = after.split_whitespace().collect();
    let num = |n: usize| f.get(n - 3)?.parse::<f64>().ok();
    let btime = proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse::<f64>()
        .ok()?;
    Some(ProcessStats {
        cpu_seconds: (num(14)? + num(15)?) / USER_HZ,
        threads: num(20)?,
        start_time_seconds: btime + num(22)? / USER_HZ,
        virtual_bytes: num(23)?,
        resident_bytes: num(24)? * PAGE_BYTES,
        open_fds: None,
        max_fds: None,
    })
}

/// The soft "Max open files" limit from `/proc/self/limits`.
pub fn parse_max_fds(limits: &str) -> Option<f64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub fn read() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let proc_stat = std::fs::read_to_string("/proc/stat").ok()?;
    let mut s = parse(&stat, &proc_stat)?;
    s.open_fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| d.count() as f64);
    s.max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| parse_max_fds(&l));
    Some(s)
}

/// Append the families in the classic text format.
pub fn render(s: &ProcessStats, out: &mut String) {
    let mut one = |name: &str, kind: &str, help: &str, v: Option<f64>| {
        if let Some(v) = v {
            let _ = write!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            );
        }
    };
    one(
        "process_cpu_seconds_total",
        "counter",
        "Total user and system CPU time spent in seconds.",
        Some(s.cpu_seconds),
    );
    one(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
        Some(s.resident_bytes),
    );
    one(
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual memory size in bytes.",
        Some(s.virtual_bytes),
    );
    one(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
        Some(s.start_time_seconds),
    );
    one(
        "process_open_fds",
        "gauge",
        "Number of open file descriptors.",
        s.open_fds,
    );
    one(
        "process_max_fds",
        "gauge",
        "Maximum number of open file descriptors.",
        s.max_fds,
    );
    one(
        "process_threads",
        "gauge",
        "Number of OS threads in the process.",
        Some(s.threads),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    // A real /proc/self/stat line shape, with a comm holding a space and a paren.
    const STAT: &str = "4242 (kv gate) x) S 1 4242 4242 0 -1 4194560 2000 0 0 0 250 130 0 0 20 0 7 0 123456 987654321 5000 18446744073709551615 1 1 0 0 0 0 0 4096 17926 0 0 0 17 1 0 0 0 0 0";
    const PROC_STAT: &str = "cpu  1 2 3 4\nintr 5\nbtime 1700000000\nprocesses 9\n";

    #[test]
    fn stat_fields_are_read_after_the_command_name() {
        let s = parse(STAT, PROC_STAT).expect("parses");
        assert_eq!(s.cpu_seconds, 3.8);
        assert_eq!(s.threads, 7.0);
        assert_eq!(s.start_time_seconds, 1_700_000_000.0 + 1234.56);
        assert_eq!(s.virtual_bytes, 987_654_321.0);
        assert_eq!(s.resident_bytes, 5000.0 * 4096.0);
        assert!(parse("garbage", PROC_STAT).is_none());
        assert!(parse(STAT, "cpu 1\n").is_none());
    }

    #[test]
    fn max_fds_is_the_soft_limit() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax processes             63432                63432                processes\nMax open files            1024                 524288               files\n";
        assert_eq!(parse_max_fds(limits), Some(1024.0));
        assert_eq!(
            parse_max_fds("Max open files unlimited unlimited files"),
            None
        );
    }

    #[test]
    fn this_process_is_readable_on_linux() {
        if !cfg!(target_os = "linux") {
            return;
        }
        let s = read().expect("/proc/self readable");
        assert!(s.resident_bytes > 0.0 && s.threads >= 1.0);
        assert!(s.open_fds.is_some_and(|n| n >= 3.0));
        let mut out = String::new();
        render(&s, &mut out);
        assert!(out.contains("# TYPE process_cpu_seconds_total counter\n"));
        assert!(out.contains("\nprocess_open_fds "));
    }
}
