//! The resolver loop against a scripted resolver (diff logic, failure policy, shutdown) and against
//! the real system resolver (`localhost`, a name under `.invalid`, which RFC 6761 guarantees never
//! resolves).
//!
//! The scripted tests use a 1 ms interval and wait on the callback's channel: every assertion is on
//! the *sequence* of reported changes, never on elapsed time.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Mutex;

use tokio::sync::mpsc;

use super::*;

fn a(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)), port)
}

fn fast(target: &str) -> DnsConfig {
    DnsConfig {
        target: target.into(),
        interval: Duration::from_millis(1),
        timeout: Duration::from_secs(5),
    }
}

/// Answers from a script, one per lookup; the last answer repeats forever.
fn scripted(answers: Vec<io::Result<Vec<SocketAddr>>>) -> impl Resolve {
    let q = Arc::new(Mutex::new(VecDeque::from(answers)));
    move |_: &str| {
        let q = q.clone();
        async move {
            let mut q = q.lock().unwrap();
            if q.len() > 1 {
                q.pop_front().unwrap()
            } else {
                match q.front().unwrap() {
                    Ok(v) => Ok(v.clone()),
                    Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
                }
            }
        }
    }
}

async fn next(rx: &mut mpsc::UnboundedReceiver<DnsChange>) -> DnsChange {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a DNS change")
        .expect("open channel")
}

fn channel() -> (
    impl FnMut(DnsChange) + Send + 'static,
    mpsc::UnboundedReceiver<DnsChange>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    (move |c| drop(tx.send(c)), rx)
}

#[test]
fn diff_reports_both_sides_sorted() {
    let old: BTreeSet<_> = [a(1, 80), a(2, 80)].into();
    let new: BTreeSet<_> = [a(3, 80), a(2, 80)].into();
    let d = diff(&old, &new).unwrap();
    assert_eq!(d.added, vec![a(3, 80)]);
    assert_eq!(d.removed, vec![a(1, 80)]);
    assert_eq!(d.current, vec![a(2, 80), a(3, 80)]);
    assert_eq!(diff(&new, &new), None);
    // Same IP, other port: a different worker.
    let d = diff(&[a(1, 80)].into(), &[a(1, 81)].into()).unwrap();
    assert_eq!((d.added, d.removed), (vec![a(1, 81)], vec![a(1, 80)]));
}

#[tokio::test]
async fn adds_and_removes_as_records_change_and_keeps_last_good_set_on_failure() {
    let err = || Err(io::Error::new(io::ErrorKind::NotFound, "NXDOMAIN"));
    let resolver = scripted(vec![
        Ok(vec![a(1, 8000), a(2, 8000)]),
        Ok(vec![a(2, 8000), a(1, 8000)]), // same set, other order: no change
        err(),
        Ok(vec![]), // empty answer: treated as a failure, not as "remove everything"
        err(),
        Ok(vec![a(1, 8000), a(2, 8000), a(3, 8000)]),
        Ok(vec![a(3, 8000)]),
    ]);
    let (cb, mut rx) = channel();
    let w = DnsWatcher::spawn_with(fast("pool:8000"), resolver, cb);

    let c = next(&mut rx).await;
    assert_eq!(c.added, vec![a(1, 8000), a(2, 8000)]);
    assert!(c.removed.is_empty());

    // The failures in between did not remove anything: the next change only adds .3.
    let c = next(&mut rx).await;
    assert_eq!(c.added, vec![a(3, 8000)]);
    assert!(c.removed.is_empty(), "{c:?}");
    assert_eq!(c.current.len(), 3);

    let c = next(&mut rx).await;
    assert!(c.added.is_empty());
    assert_eq!(c.removed, vec![a(1, 8000), a(2, 8000)]);
    assert_eq!(c.current, vec![a(3, 8000)]);

    let stats = w.stats().clone();
    w.shutdown().await;
    assert_eq!(stats.failures(), 3);
    assert_eq!(stats.changes(), 3);
    assert_eq!(stats.addresses(), 1);
    assert!(stats.lookups() >= 7);
    // The loop has exited and dropped the callback: the channel is closed with nothing more in it.
    assert!(rx.recv().await.is_none());
}

#[tokio::test]
async fn a_hanging_lookup_times_out_and_counts_as_failure() {
    let hang = |_: &str| std::future::pending::<io::Result<Vec<SocketAddr>>>();
    let (cb, mut rx) = channel();
    let cfg = DnsConfig {
        timeout: Duration::from_millis(5),
        ..fast("slow:1")
    };
    let w = DnsWatcher::spawn_with(cfg, hang, cb);
    let stats = w.stats().clone();
    for _ in 0..1000 {
        if stats.failures() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        stats.failures() >= 2,
        "timeouts counted: {}",
        stats.failures()
    );
    w.shutdown().await;
    assert!(
        rx.try_recv().is_err(),
        "no change reported without an answer"
    );
}

#[tokio::test]
async fn dropping_the_handle_stops_the_loop() {
    let calls = Arc::new(AtomicU64::new(0));
    let c2 = calls.clone();
    let resolver = move |_: &str| {
        c2.fetch_add(1, Ordering::Relaxed);
        async { Ok(vec![a(9, 1)]) }
    };
    let (cb, mut rx) = channel();
    let w = DnsWatcher::spawn_with(fast("x:1"), resolver, cb);
    next(&mut rx).await;
    drop(w);
    // The task drops the callback (and so the sender) when it exits.
    tokio::time::timeout(Duration::from_secs(10), async {
        while rx.recv().await.is_some() {}
    })
    .await
    .expect("loop stopped after drop");
    let n = calls.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        calls.load(Ordering::Relaxed),
        n,
        "no lookups after the loop stopped"
    );
}

#[tokio::test]
async fn system_resolver_resolves_localhost() {
    let (cb, mut rx) = channel();
    let w = DnsWatcher::spawn(fast("localhost:8123"), cb);
    let c = next(&mut rx).await;
    assert!(!c.added.is_empty());
    assert!(
        c.added
            .iter()
            .all(|s| s.port() == 8123 && s.ip().is_loopback()),
        "{c:?}"
    );
    assert!(
        c.added.contains(&"127.0.0.1:8123".parse().unwrap()),
        "{c:?}"
    );
    w.shutdown().await;
}

#[tokio::test]
async fn system_resolver_ip_literal_needs_no_dns() {
    let (cb, mut rx) = channel();
    let w = DnsWatcher::spawn(fast("127.0.0.7:9"), cb);
    assert_eq!(
        next(&mut rx).await.current,
        vec!["127.0.0.7:9".parse().unwrap()]
    );
    w.shutdown().await;
}

#[tokio::test]
async fn a_name_that_does_not_resolve_is_counted_and_reports_nothing() {
    let (cb, mut rx) = channel();
    let w = DnsWatcher::spawn(fast("kvgate-no-such-pool.invalid:8000"), cb);
    let stats = w.stats().clone();
    for _ in 0..2000 {
        if stats.failures() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(stats.failures() >= 2, "failures: {}", stats.failures());
    assert_eq!(stats.addresses(), 0);
    w.shutdown().await;
    assert!(rx.try_recv().is_err());
}
