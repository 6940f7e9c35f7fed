//! Test support shared by every suite in the workspace (a dev-dependency only, never published).
//!
//! The rule it serves (COMMON.md, CONVENTIONS.md): a test holds on a busy machine. Nothing waits a
//! fixed time and assumes "done by now"; it polls for the observable result with a generous
//! deadline, which only matters when the test fails.
//!
//! - [`poll`]: `poll_until` / `poll_for` / `eventually` / `until`, async (tokio), and `_blocking`
//!   twins for threads without a runtime.
//! - [`net`]: loopback ports (`free_port`, `free_port_pair`), waiting for a listener.
//! - [`proc`]: a child process killed by its pid and reaped on drop, its output lines on a
//!   channel, `Proc::wait_for` a line with what it printed in the failure message.
#![forbid(unsafe_code)]

pub mod net;
pub mod poll;
pub mod proc;

pub use net::{free_port, free_port_pair, loopback0};
pub use poll::{
    eventually, eventually_blocking, poll_for, poll_for_blocking, poll_until, poll_until_blocking,
    until, PATIENCE,
};
pub use proc::{kvgate_bin, ChildGuard, Proc};
