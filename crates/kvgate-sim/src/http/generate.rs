//! One engine request for the APIs that translate to a single chat choice (Responses, Messages):
//! the request-level faults of `--fail-rate` / `--stall-ms` as chat applies them, then the submit.
//! Each API formats the failure in its own error shape.

use std::sync::Arc;

use http::StatusCode;
use tokio::sync::mpsc;

use crate::engine::{KvTransfer, NewRequest};
use crate::server::Shared;
use crate::worker::{Command, ReqEvent};

/// Why a request was not submitted: the status and message to answer with.
pub struct Refused {
    pub status: StatusCode,
    pub message: &'static str,
}

/// Applies the request faults and submits `prompt` as one choice (index 0).
pub async fn submit(
    sh: &Arc<Shared>,
    prompt: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
) -> Result<mpsc::UnboundedReceiver<ReqEvent>, Refused> {
    let f = &sh.cfg.faults;
    if f.fail_rate > 0.0 {
        let (fail, unavailable) = {
            let mut rng = sh.rng.lock();
            (rng.f64() < f.fail_rate, rng.bool())
        };
        if fail {
            sh.metrics.lock().finished(None);
            return Err(if unavailable {
                Refused {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    message: "injected fault: worker unavailable",
                }
            } else {
                Refused {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: "injected fault: internal error",
                }
            });
        }
    }
    if !f.stall.is_zero() {
        tokio::time::sleep(f.stall).await;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let req = NewRequest {
        id: sh.next_id(),
        prompt,
        max_tokens,
        ignore_eos,
        kv: KvTransfer::None,
        // The agent APIs carry no `priority` here: vLLM's default (0) under `--scheduling-policy priority`.
        priority: 0,
        // The sim's assumed-cache header is honoured on the OpenAI completions routes only.
        assumed_cached_tokens: 0,
    };
    sh.cmd
        .send(Command::Submit {
            req,
            idx: 0,
            tx,
            sent: tokio::time::Instant::now(),
        })
        .map_err(|_| Refused {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "worker is shutting down",
        })?;
    Ok(rx)
}

/// Prompt tokens this request wrote into the prefix cache: the prompt's full blocks minus the ones
/// it found cached (vLLM 0.32's `num_cache_creation_tokens`: cached after prefill − cached before).
pub fn cache_creation(sh: &Shared, prompt_len: usize, cached: usize) -> usize {
    if !sh.cfg.enable_prefix_caching {
        return 0;
    }
    let bs = sh.cfg.block_size;
    (prompt_len / bs * bs).saturating_sub(cached)
}

/// A random-looking 16-hex-digit id (vLLM's `random_uuid()` length), unique across the workers of a
/// fleet and across restarts: the worker's port, start time and a counter, hashed.
pub fn uid(sh: &Shared) -> String {
    let mut b = [0u8; 26];
    b[..2].copy_from_slice(&sh.http_addr.port().to_le_bytes());
    b[2..10].copy_from_slice(&sh.started.to_bits().to_le_bytes());
    b[10..18].copy_from_slice(&sh.next_id().to_le_bytes());
    b[18..].copy_from_slice(&(std::process::id() as u64).to_le_bytes());
    format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64_with_seed(&b, 0x7265_7370)
    )
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
