//! Admission control for a busy fleet: when every candidate worker is busy, a request waits in a
//! bounded queue until load is released somewhere (every [`crate::route::router::DispatchGuard`]
//! releases through [`Admission::release`] when dropped) or the wait times out. Past the bound,
//! requests are shed at once with 429 + `Retry-After`.
//!
//! Who goes first: a newcomer that finds a free worker takes it at once (the queue is not checked
//! first: a free worker is never left idle while a waiter of another model's pool sleeps); only a
//! request that finds every candidate busy queues, at the back. Each release wakes the oldest
//! waiter. A woken waiter that still finds no free worker (the capacity was in another model's
//! pool, or a newcomer took it first) returns to the head of the queue and passes the wake-up on
//! to the next waiter that has not yet tried this release ([`Admission::pass_on`]); once every
//! waiter has tried, the wake-up ends. So one release causes at most one selection per waiter,
//! never a loop of waiters waking each other until capacity frees (the test
//! `a_release_nobody_can_use_wakes_each_waiter_once` in `route.rs`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;

/// A wake-up's release number: a waiter that has tried release `g` is not woken for it again.
pub type Generation = u64;

struct Waiter {
    ticket: u64,
    /// The newest release this waiter has already tried (0: none).
    seen: Generation,
    tx: oneshot::Sender<Generation>,
}

pub struct Admission {
    queue: Mutex<Queue>,
    next_ticket: AtomicU64,
    max_len: AtomicUsize,
    timeout_ms: AtomicU64,
    /// Wake-ups delivered (releases and passes), for tests and the admin state.
    wakeups: AtomicU64,
}

struct Queue {
    waiters: VecDeque<Waiter>,
    /// Releases so far.
    generation: Generation,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitError {
    Full,
    Timeout,
}

impl Admission {
    pub fn new(max_len: usize, timeout: Duration) -> Self {
        Admission {
            queue: Mutex::new(Queue {
                waiters: VecDeque::new(),
                generation: 0,
            }),
            next_ticket: AtomicU64::new(0),
            max_len: AtomicUsize::new(max_len),
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            wakeups: AtomicU64::new(0),
        }
    }

    /// `admission.queue_size` and `admission.queue_timeout_ms` (reload).
    pub fn configure(&self, max_len: usize, timeout: Duration) {
        self.max_len.store(max_len, Ordering::Relaxed);
        self.timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn len(&self) -> usize {
        self.queue.lock().waiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wake-ups delivered so far.
    pub fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// Wait for a wake-up; returns the release it is for. `seen` is `Some(g)` for a waiter that
    /// was woken for release `g` and found nothing free: it re-queues at the head (its place in
    /// line is kept) and is not woken for `g` again. `deadline` bounds the total wait across
    /// re-queues.
    pub async fn wait(
        &self,
        seen: Option<Generation>,
        deadline: tokio::time::Instant,
    ) -> Result<Generation, WaitError> {
        let (tx, rx) = oneshot::channel();
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        {
            let mut q = self.queue.lock();
            let w = Waiter {
                ticket,
                seen: seen.unwrap_or(0),
                tx,
            };
            match seen {
                Some(_) => q.waiters.push_front(w),
                None if q.waiters.len() >= self.max_len.load(Ordering::Relaxed) => {
                    return Err(WaitError::Full)
                }
                None => q.waiters.push_back(w),
            }
        }
        // Leave the queue on every exit (timeout, or the waiting future dropped on disconnect).
        let _leave = Leave { adm: self, ticket };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(g)) => Ok(g),
            // The sender is only dropped with the queue entry, which `Leave` removes: unreachable
            // while we wait, but a timeout is the honest answer if it ever happens.
            Ok(Err(_)) | Err(_) => Err(WaitError::Timeout),
        }
    }

    /// Load was released somewhere: wake the oldest waiter (a new release: everyone may try it).
    pub fn release(&self) {
        let mut q = self.queue.lock();
        q.generation += 1;
        let g = q.generation;
        self.wake_first(&mut q, g);
    }

    /// A waiter woken for release `g` found nothing free: wake the next waiter that has not tried
    /// `g` yet (none left: the wake-up ends here).
    pub fn pass_on(&self, g: Generation) {
        let mut q = self.queue.lock();
        self.wake_first(&mut q, g);
    }

    fn wake_first(&self, q: &mut Queue, g: Generation) {
        let mut i = 0;
        while i < q.waiters.len() {
            if q.waiters[i].seen >= g {
                i += 1;
                continue;
            }
            let w = q.waiters.remove(i).expect("index in range");
            if w.tx.send(g).is_ok() {
                self.wakeups.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }
}

struct Leave<'a> {
    adm: &'a Admission,
    ticket: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut q = self.adm.queue.lock();
        if let Some(i) = q.waiters.iter().position(|w| w.ticket == self.ticket) {
            q.waiters.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn fifo_bound_and_timeout() {
        let a = Arc::new(Admission::new(2, Duration::from_secs(1)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        let a1 = a.clone();
        let first = tokio::spawn(async move { a1.wait(None, deadline).await });
        tokio::task::yield_now().await;
        let a2 = a.clone();
        let second = tokio::spawn(async move { a2.wait(None, deadline).await });
        tokio::task::yield_now().await;
        assert_eq!(a.len(), 2);
        assert_eq!(a.wait(None, deadline).await, Err(WaitError::Full));
        a.release();
        assert_eq!(first.await.unwrap(), Ok(1));
        assert!(!second.is_finished());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(second.await.unwrap(), Err(WaitError::Timeout));
        assert_eq!(a.len(), 0, "timed-out waiters leave the queue");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pass_skips_waiters_that_tried_the_release() {
        let a = Arc::new(Admission::new(8, Duration::from_secs(10)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let a1 = a.clone();
        // Woken for release 1 already: back at the head, but not for 1 again.
        let tried = tokio::spawn(async move { a1.wait(Some(1), deadline).await });
        tokio::task::yield_now().await;
        a.queue.lock().generation = 1;
        let a2 = a.clone();
        let fresh = tokio::spawn(async move { a2.wait(None, deadline).await });
        tokio::task::yield_now().await;
        a.pass_on(1);
        assert_eq!(
            fresh.await.unwrap(),
            Ok(1),
            "the waiter behind gets the pass"
        );
        a.pass_on(1);
        tokio::task::yield_now().await;
        assert!(!tried.is_finished(), "nobody left to try release 1");
        assert_eq!(a.wakeups(), 1);
        a.release();
        assert_eq!(tried.await.unwrap(), Ok(2), "a new release wakes it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_with_nobody_waiting_is_not_kept() {
        let a = Arc::new(Admission::new(8, Duration::from_secs(10)));
        a.release();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        assert_eq!(a.wait(None, deadline).await, Err(WaitError::Timeout));
        assert_eq!(a.wakeups(), 0);
    }
}
