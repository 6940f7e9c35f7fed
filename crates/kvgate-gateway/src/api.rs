//! Endpoints answered by the gateway itself (the OpenAI proxy endpoints are in `proxy.rs`).

pub mod health;
pub mod metrics;
pub mod models;
