//! Loopback addresses and ports. Prefer binding port 0 and reading the bound address back; these
//! helpers are for the cases that cannot: a program that takes its port on the command line
//! (`nats-server -p`), or two ports at a fixed distance (the sim's replay port is its events port
//! plus 100). Such a port is free when returned and may be taken by the time it is used; callers
//! that bind it themselves retry with another.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use crate::poll::{poll_until, poll_until_blocking};

/// `127.0.0.1:0`: bind here and ask the socket for its port.
pub fn loopback0() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A loopback TCP port that was free a moment ago (see the module doc for the race).
pub fn free_port() -> u16 {
    TcpListener::bind(loopback0())
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// A loopback port `p` with `p` and `p + offset` both free a moment ago.
pub fn free_port_pair(offset: u16) -> u16 {
    for _ in 0..100 {
        let l = TcpListener::bind(loopback0()).expect("bind 127.0.0.1:0");
        let p = l.local_addr().expect("bound address").port();
        let Some(q) = p.checked_add(offset) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", q)).is_ok() {
            return p;
        }
    }
    panic!("no loopback port p with p + {offset} also free in 100 tries")
}

/// Wait until something accepts TCP connections at `addr` (a child process that binds a port
/// given on its command line); panics after `within`.
pub fn wait_listening_blocking(addr: SocketAddr, within: Duration) {
    poll_until_blocking(within, format!("a listener on {addr}"), || {
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
    })
}

/// [`wait_listening_blocking`] from async code.
pub async fn wait_listening(addr: SocketAddr, within: Duration) {
    poll_until(within, format!("a listener on {addr}"), || async move {
        tokio::net::TcpStream::connect(addr).await.is_ok()
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_bindable_and_pairs_keep_their_distance() {
        let p = free_port();
        assert!(p > 0);
        let p = free_port_pair(100);
        TcpListener::bind(("127.0.0.1", p)).unwrap();
        TcpListener::bind(("127.0.0.1", p + 100)).unwrap();
    }

    #[test]
    fn waits_for_a_listener_and_gives_up_on_none() {
        let l = TcpListener::bind(loopback0()).unwrap();
        wait_listening_blocking(l.local_addr().unwrap(), Duration::from_secs(5));
        let gone = l.local_addr().unwrap();
        drop(l);
        let r =
            std::panic::catch_unwind(|| wait_listening_blocking(gone, Duration::from_millis(50)));
        assert!(r.is_err(), "nothing listens on {gone}");
    }
}
