//! Polling with a deadline. A condition is checked at once, then again every few milliseconds
//! (backing off to 50 ms) until it holds or the deadline passes; the deadline is a failure
//! bound, never the expected duration, so give it room (see [`PATIENCE`]).

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

/// A deadline for "this happens soon" on a loaded machine: long enough that only a real failure
/// reaches it, short enough that a hung test ends with a message.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The pause before the `n`th re-check: 5 ms, doubling up to 50 ms.
fn pause(n: u32) -> Duration {
    Duration::from_millis(5u64 << n.min(4)).min(Duration::from_millis(50))
}

fn timed_out(within: Duration, what: &dyn Display, checks: u32) -> ! {
    if checks == 0 {
        panic!("timed out after {within:?} waiting for {what}")
    }
    panic!("timed out after {within:?} ({checks} checks) waiting for {what}")
}

/// Poll `f` until it returns `Some`, and return that value; panics naming `what` when `within`
/// passes first.
pub async fn poll_for<T, F, Fut>(within: Duration, what: impl Display, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = Instant::now() + within;
    let mut n = 0;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if Instant::now() >= end {
            timed_out(within, &what, n + 1);
        }
        tokio::time::sleep(pause(n)).await;
        n += 1;
    }
}

/// Poll the async condition `f` until it holds; panics naming `what` when `within` passes first.
pub async fn poll_until<F, Fut>(within: Duration, what: impl Display, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll_for(within, what, || {
        let fut = f();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Poll the condition `f` until it holds (true) or `within` passes (false), for callers that
/// build their own failure message: `assert!(eventually(..).await, "state: {:?}", ..)`.
pub async fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    let mut n = 0;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(pause(n)).await;
        n += 1;
    }
}

/// [`poll_until`] for a condition that needs no `.await` (state read in process).
pub async fn until(within: Duration, what: impl Display, mut f: impl FnMut() -> bool) {
    if !eventually(within, &mut f).await {
        timed_out(within, &what, 0);
    }
}

/// [`poll_for`] for threads without a runtime.
pub fn poll_for_blocking<T>(
    within: Duration,
    what: impl Display,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let end = Instant::now() + within;
    let mut n = 0;
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() >= end {
            timed_out(within, &what, n + 1);
        }
        std::thread::sleep(pause(n));
        n += 1;
    }
}

/// [`poll_until`] for threads without a runtime.
pub fn poll_until_blocking(within: Duration, what: impl Display, mut f: impl FnMut() -> bool) {
    poll_for_blocking(within, what, || f().then_some(()))
}

/// [`eventually`] for threads without a runtime.
pub fn eventually_blocking(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    let mut n = 0;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(pause(n));
        n += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn returns_the_value_once_the_condition_holds() {
        let mut calls = 0;
        let v = poll_for_blocking(PATIENCE, "three calls", || {
            calls += 1;
            (calls == 3).then_some(calls * 10)
        });
        assert_eq!(v, 30);
    }

    #[test]
    fn a_condition_that_never_holds_fails_with_what_was_awaited() {
        let r = std::panic::catch_unwind(|| {
            poll_until_blocking(Duration::from_millis(30), "the moon", || false)
        });
        let msg = r.unwrap_err();
        let msg = msg.downcast_ref::<String>().unwrap();
        assert!(msg.contains("waiting for the moon"), "{msg}");
        assert!(!eventually_blocking(Duration::from_millis(10), || false));
    }

    #[test]
    fn checks_at_least_once_even_with_no_time_left() {
        assert!(eventually_blocking(Duration::ZERO, || true));
    }

    #[tokio::test]
    async fn async_variants_poll_the_condition_again() {
        let calls = AtomicU32::new(0);
        poll_until(PATIENCE, "two calls", || async {
            calls.fetch_add(1, Ordering::Relaxed) >= 1
        })
        .await;
        assert_eq!(calls.load(Ordering::Relaxed), 2);
        assert!(!eventually(Duration::from_millis(10), || false).await);
        until(PATIENCE, "a true condition", || true).await;
        let late = tokio::spawn(async {
            poll_for(Duration::from_millis(20), "nothing", || async {
                None::<()>
            })
            .await
        });
        assert!(late.await.unwrap_err().is_panic());
    }

    #[test]
    fn the_pause_backs_off_to_50ms() {
        let p: Vec<u64> = (0..7).map(|n| pause(n).as_millis() as u64).collect();
        assert_eq!(p, [5, 10, 20, 40, 50, 50, 50]);
    }
}
