//! A pool from an llm-d endpoints file (`endpoints.rs` has the format), checked every interval.
//!
//! Polled rather than watched with inotify: a check is one `stat`, and the file is read again
//! only when its modification time, size or inode changed (an editor's in-place write, a
//! `mv` of a new file over it, a Kubernetes ConfigMap volume's symlink swap all change one). A
//! file that cannot be read or parsed keeps the last good member set; the failure is logged once
//! per change of the file (not at every check) and counted (`kvgate_pool_discovery_errors_total
//! {kind="unreadable"|"invalid"}`).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::{endpoints, Event, Member, Report};

/// What identifies one version of the file without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fingerprint {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn fingerprint(md: &std::fs::Metadata) -> Fingerprint {
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(md);
    #[cfg(not(unix))]
    let inode = 0;
    Fingerprint {
        modified: md.modified().ok(),
        len: md.len(),
        inode,
    }
}

/// The watcher's memory between checks.
#[derive(Default)]
pub struct FileState {
    seen: Option<Fingerprint>,
    /// The last failure reported, so a file that stays missing is logged and counted once.
    failing: Option<String>,
    applied: Option<Vec<Member>>,
}

/// Check `path` every `every` until `stop`; report member sets and failures to `report`.
pub async fn watch(path: PathBuf, every: Duration, report: Report, stop: CancellationToken) {
    let mut state = FileState::default();
    loop {
        check(&path, &mut state, &report).await;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// One check: re-read the file if it changed, report a new member set or a new failure.
pub async fn check(path: &Path, state: &mut FileState, report: &Report) {
    let md = match tokio::fs::metadata(path).await {
        Ok(md) => md,
        Err(e) => {
            state.seen = None;
            fail(path, state, report, "unreadable", format!("{e}"));
            return;
        }
    };
    let fp = fingerprint(&md);
    if state.seen.as_ref() == Some(&fp) {
        return;
    }
    state.seen = Some(fp);
    if md.len() > endpoints::MAX_FILE_BYTES as u64 {
        let msg = format!(
            "{} bytes: larger than the 1 MiB an endpoints file may have",
            md.len()
        );
        fail(path, state, report, "invalid", msg);
        return;
    }
    let text = match tokio::fs::read(path).await {
        Ok(t) => t,
        Err(e) => {
            state.seen = None;
            fail(path, state, report, "unreadable", format!("{e}"));
            return;
        }
    };
    let members = match endpoints::parse(&text).and_then(|e| endpoints::members(&e)) {
        Ok(m) => m,
        Err(e) => {
            fail(path, state, report, "invalid", e);
            return;
        }
    };
    if state.failing.take().is_some() {
        tracing::info!(file = %path.display(), members = members.len(), "endpoints file readable again");
    }
    if state.applied.as_ref() != Some(&members) {
        state.applied = Some(members.clone());
        report(Event::Members(members));
    }
}

fn fail(path: &Path, state: &mut FileState, report: &Report, kind: &'static str, msg: String) {
    let msg = format!("{kind}: {msg}");
    if state.failing.as_ref() == Some(&msg) {
        return;
    }
    tracing::error!(
        file = %path.display(),
        error = %msg,
        kept = state.applied.as_ref().map_or(0, Vec::len),
        "endpoints file rejected; the pool keeps its last good members"
    );
    state.failing = Some(msg);
    report(Event::Error(kind));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn recorder() -> (Report, Arc<Mutex<Vec<Event>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        (Arc::new(move |e| s.lock().unwrap().push(e)), seen)
    }

    fn addrs(ev: &Event) -> Vec<String> {
        match ev {
            Event::Members(m) => m.iter().map(|m| m.addr.to_string()).collect(),
            Event::Error(k) => vec![format!("error:{k}")],
        }
    }

    /// Write by rename, as a careful writer (or a ConfigMap update) does: a new inode each time,
    /// so the change is seen even within one mtime tick.
    fn replace(path: &Path, text: &str) {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    #[tokio::test]
    async fn changes_errors_and_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("endpoints.yaml");
        let (report, seen) = recorder();
        let mut st = FileState::default();
        let take = || std::mem::take(&mut *seen.lock().unwrap());

        // Missing: one error, however many checks.
        check(&path, &mut st, &report).await;
        check(&path, &mut st, &report).await;
        assert_eq!(
            take().iter().map(addrs).collect::<Vec<_>>(),
            [["error:unreadable"]]
        );

        replace(
            &path,
            "endpoints:\n- {name: a, address: 10.0.0.1, port: 8000}\n",
        );
        check(&path, &mut st, &report).await;
        check(&path, &mut st, &report).await;
        assert_eq!(
            take().iter().map(addrs).collect::<Vec<_>>(),
            [["10.0.0.1:8000"]]
        );

        // A bad version: counted once, nothing applied (the last good set stays).
        replace(
            &path,
            "endpoints:\n- {name: a, address: 10.0.0.1, port: 99999}\n",
        );
        check(&path, &mut st, &report).await;
        check(&path, &mut st, &report).await;
        assert_eq!(
            take().iter().map(addrs).collect::<Vec<_>>(),
            [["error:invalid"]]
        );

        // Fixed, with a second member.
        replace(
            &path,
            "endpoints:\n- {name: a, address: 10.0.0.1, port: 8000}\n- {name: b, address: 10.0.0.2, port: 8000}\n",
        );
        check(&path, &mut st, &report).await;
        assert_eq!(
            take().iter().map(addrs).collect::<Vec<_>>(),
            [["10.0.0.1:8000", "10.0.0.2:8000"]]
        );

        // A rewrite with the same members (a comment added) changes nothing.
        replace(
            &path,
            "# same\nendpoints:\n- {name: b, address: 10.0.0.2, port: 8000}\n- {name: a, address: 10.0.0.1, port: 8000}\n",
        );
        check(&path, &mut st, &report).await;
        assert!(take().is_empty());

        // Truncated to nothing mid-write: refused, not an empty pool.
        replace(&path, "");
        check(&path, &mut st, &report).await;
        assert_eq!(
            take().iter().map(addrs).collect::<Vec<_>>(),
            [["error:invalid"]]
        );

        // An explicit empty list empties the pool.
        replace(&path, "endpoints: []\n");
        check(&path, &mut st, &report).await;
        assert_eq!(
            take().iter().map(addrs).collect::<Vec<_>>(),
            [Vec::<String>::new()]
        );
    }

    #[tokio::test]
    async fn the_watch_loop_notices_a_change_and_stops() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.json");
        replace(
            &path,
            r#"{"endpoints": [{"name": "a", "address": "10.0.0.1", "port": "1"}]}"#,
        );
        let (report, seen) = recorder();
        let stop = CancellationToken::new();
        let task = tokio::spawn(watch(
            path.clone(),
            Duration::from_millis(10),
            report,
            stop.clone(),
        ));
        assert!(
            kvgate_testkit::eventually(Duration::from_secs(10), || seen.lock().unwrap().len() == 1)
                .await
        );
        replace(
            &path,
            r#"{"endpoints": [{"name": "b", "address": "10.0.0.2", "port": "1"}]}"#,
        );
        assert!(
            kvgate_testkit::eventually(Duration::from_secs(10), || seen.lock().unwrap().len() == 2)
                .await
        );
        assert_eq!(addrs(&seen.lock().unwrap()[1]), ["10.0.0.2:1"]);
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
    }
}
