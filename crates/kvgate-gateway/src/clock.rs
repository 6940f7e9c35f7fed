//! The one clock the gateway reads: tokio's. `now()` is `tokio::time::Instant::now()` as a
//! `std::time::Instant` (the type kvgate-core, kvgate-fleet and kvgate-cluster take), so under a
//! paused test clock (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`) every deadline,
//! TTL, queue wait and latency the gateway computes moves with the test's time, not the machine's.
//! Outside tests it is the monotonic system clock (tokio's `test-util` feature is only enabled by
//! dev-dependencies).

use std::time::{Duration, Instant};

/// Now, on tokio's clock.
#[inline]
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Time since `t` on tokio's clock (zero if `t` is in the future).
#[inline]
pub fn since(t: Instant) -> Duration {
    now().saturating_duration_since(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_gateway_clock_follows_a_paused_tokio_clock() {
        let t0 = now();
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(since(t0) >= Duration::from_secs(3600));
        assert!(since(t0) < Duration::from_secs(3601));
    }
}
