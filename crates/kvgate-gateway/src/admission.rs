//! Admission control for a busy fleet: when every candidate worker is busy, requests wait in a
//! bounded FIFO queue until a dispatched request finishes (its guard wakes the queue head) or the
//! wait times out. Past the bound, requests are shed at once with 429 + `Retry-After`.
//!
//! FIFO: newcomers queue behind existing waiters instead of racing them; a woken waiter that still
//! finds no free worker (capacity went to another model's pool) passes the wake-up on and returns to
//! the head of the queue.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;

pub struct Admission {
    queue: Mutex<VecDeque<(u64, oneshot::Sender<()>)>>,
    next_ticket: AtomicU64,
    pub max_len: AtomicUsize,
    pub timeout_ms: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitError {
    Full,
    Timeout,
}

impl Admission {
    pub fn new(max_len: usize, timeout: Duration) -> Self {
        Admission {
            queue: Mutex::new(VecDeque::new()),
            next_ticket: AtomicU64::new(0),
            max_len: AtomicUsize::new(max_len),
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
        }
    }

    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a newcomer must queue to keep FIFO order.
    pub fn has_waiters(&self) -> bool {
        !self.queue.lock().is_empty()
    }

    /// Wait for a wake-up. `front` re-queues a waiter that was already woken once at the head.
    /// `deadline` bounds the total wait across re-queues.
    pub async fn wait(&self, front: bool, deadline: tokio::time::Instant) -> Result<(), WaitError> {
        let (tx, rx) = oneshot::channel();
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        {
            let mut q = self.queue.lock();
            if !front && q.len() >= self.max_len.load(Ordering::Relaxed) {
                return Err(WaitError::Full);
            }
            if front {
                q.push_front((ticket, tx));
            } else {
                q.push_back((ticket, tx));
            }
        }
        // Leave the queue on every exit (timeout, or the waiting future dropped on disconnect).
        let _leave = Leave { adm: self, ticket };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(_) => Ok(()),
            Err(_) => Err(WaitError::Timeout),
        }
    }

    /// Wake the oldest live waiter (called when load is released).
    pub fn wake_one(&self) {
        let mut q = self.queue.lock();
        while let Some((_, tx)) = q.pop_front() {
            if tx.send(()).is_ok() {
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
        if let Some(i) = q.iter().position(|(t, _)| *t == self.ticket) {
            q.remove(i);
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
        let first = tokio::spawn(async move { a1.wait(false, deadline).await });
        tokio::task::yield_now().await;
        let a2 = a.clone();
        let second = tokio::spawn(async move { a2.wait(false, deadline).await });
        tokio::task::yield_now().await;
        assert_eq!(a.len(), 2);
        assert_eq!(a.wait(false, deadline).await, Err(WaitError::Full));
        a.wake_one();
        assert_eq!(first.await.unwrap(), Ok(()));
        assert!(!second.is_finished());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(second.await.unwrap(), Err(WaitError::Timeout));
        assert_eq!(a.len(), 0, "timed-out waiters leave the queue");
    }
}
