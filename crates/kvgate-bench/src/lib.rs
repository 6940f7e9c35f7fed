//! kvgate-bench (see ../shared/ARCHITECTURE.md).
#![forbid(unsafe_code)]

pub mod cli;
