//! Prefill/decode handoff on the HTTP side, vLLM NixlConnector semantics (docs/sim.md, "PD"):
//! reading `kv_transfer_params`, the prefill leg's answer (`kv_transfer_params` naming this worker,
//! only when the leg ended length-capped), the decode leg's pull (charged by the transfer-time
//! model, then a read notification to the prefill worker that frees its pinned blocks), and the
//! sim's stand-in for NIXL's notification channel: `POST /sim/kv/read` on the prefill worker.
//!
//! `remote_host`/`remote_port` name the prefill worker's HTTP listener (vLLM's name its NIXL side
//! channel); routers treat the dict as opaque, so only this sim reads them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use super::{error, json as json_resp, Body};
use crate::config::{LoadFailurePolicy, Role};
use crate::engine::KvTransfer;
use crate::metrics::Metrics;
use crate::server::Shared;
use crate::worker::Command;

/// How long a decode worker waits for the prefill worker's answer to its read notification.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a decode leg's KV lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    pub host: String,
    pub port: u16,
    pub request_id: String,
}

/// A request's role in a handoff, from its `kv_transfer_params`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    Plain,
    Prefill,
    Decode(Remote),
}

fn bad(msg: impl Into<String>) -> Box<Response<Body>> {
    Box::new(error(
        StatusCode::BAD_REQUEST,
        msg,
        Some("kv_transfer_params"),
    ))
}

/// Reads `kv_transfer_params` (absent, null or `{}` = a plain request) and checks it against the
/// worker's `--role`.
pub fn parse(v: &Value, role: Role) -> Result<Leg, Box<Response<Body>>> {
    let p = match v.get("kv_transfer_params") {
        None | Some(Value::Null) => return Ok(Leg::Plain),
        Some(Value::Object(m)) if m.is_empty() => return Ok(Leg::Plain),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("`kv_transfer_params` must be an object")),
    };
    let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
    let leg = match (flag("do_remote_decode"), flag("do_remote_prefill")) {
        (true, true) => {
            return Err(bad(
                "`do_remote_decode` and `do_remote_prefill` cannot both be true",
            ))
        }
        (true, false) => Leg::Prefill,
        (false, true) => {
            let host = p.get("remote_host").and_then(Value::as_str);
            let port = p
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|x| u16::try_from(x).ok());
            let id = match p.get("remote_request_id") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Number(n)) => Some(n.to_string()),
                _ => None,
            };
            match (host, port, id) {
                (Some(h), Some(port), Some(request_id)) => Leg::Decode(Remote {
                    host: h.to_string(),
                    port,
                    request_id,
                }),
                _ => {
                    return Err(bad(
                        "`do_remote_prefill` needs `remote_host`, `remote_port` and `remote_request_id`",
                    ))
                }
            }
        }
        (false, false) => Leg::Plain,
    };
    match (&leg, role) {
        (Leg::Prefill, Role::Decode) => Err(bad(
            "this worker has role decode: it does not serve prefill legs (`do_remote_decode`)",
        )),
        (Leg::Decode(_), Role::Prefill) => Err(bad(
            "this worker has role prefill: it does not serve decode legs (`do_remote_prefill`)",
        )),
        _ => Ok(leg),
    }
}

/// The prefill leg's `kv_transfer_params` for engine request `id` holding `blocks`.
pub fn params(sh: &Shared, id: u64, blocks: &[usize], prompt_len: usize) -> Value {
    let ip = sh.http_addr.ip();
    let host = if ip.is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        ip.to_string()
    };
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": format!("kvgate-sim-{}-{}", sh.cfg.seed, sh.http_addr.port()),
        "remote_request_id": id.to_string(),
        "remote_block_ids": blocks,
        "remote_host": host,
        "remote_port": sh.http_addr.port(),
        "remote_num_tokens": prompt_len,
        "tp_size": 1,
    })
}

/// Tells the prefill worker its blocks were read (or will never be). Answers the freed block count.
async fn notify(remote: &Remote) -> Result<usize, String> {
    let addr = format!("{}:{}", remote.host, remote.port);
    let body = json!({"remote_request_id": remote.request_id});
    let call = post_to_prefill(&addr, "/sim/kv/read", &body, "read notification");
    let v = tokio::time::timeout(READ_TIMEOUT, call)
        .await
        .map_err(|_| format!("prefill worker {addr} did not answer the read in time"))??;
    Ok(v["freed_blocks"].as_u64().unwrap_or(0) as usize)
}

/// One JSON `POST path` to the prefill worker at `addr` (`what` names it in errors), on a
/// connection that lives as long as the call: dropping the call closes it, which the prefill worker
/// sees. Its JSON answer, or why there is none (a non-2xx answer carries its error message).
pub(super) async fn post_to_prefill(
    addr: &str,
    path: &str,
    body: &Value,
    what: &str,
) -> Result<Value, String> {
    let body = serde_json::to_vec(body).map_err(|e| e.to_string())?;
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to prefill worker {addr}: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake with {addr}: {e}"))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        tokio::select! {
            _ = conn => {}
            _ = stopped => {}
        }
    });
    let _stop = stop;
    let req = Request::post(path)
        .header(http::header::HOST, addr)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = send
        .send_request(req)
        .await
        .map_err(|e| format!("{what} to {addr}: {e}"))?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if !status.is_success() {
        let msg = v["error"]["message"].as_str().unwrap_or("no detail");
        return Err(format!("prefill worker {addr} answered {status}: {msg}"));
    }
    Ok(v)
}

/// Sends the read notification if the decode leg is dropped before it did (the client went
/// away mid-transfer), as vLLM's decode side notifies the prefill side on abort.
struct ReadGuard(Option<Remote>);

impl Drop for ReadGuard {
    fn drop(&mut self) {
        if let (Some(r), Ok(rt)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            rt.spawn(async move {
                if let Err(e) = notify(&r).await {
                    tracing::debug!(error = %e, "read notification after abort failed");
                }
            });
        }
    }
}

/// Counts a pull in `pulls_in_flight` for as long as it runs, aborted or not.
struct PullGauge(Arc<Mutex<Metrics>>);

impl PullGauge {
    fn start(metrics: &Arc<Mutex<Metrics>>) -> Self {
        metrics.lock().pd.pulls_in_flight += 1;
        Self(metrics.clone())
    }
}

impl Drop for PullGauge {
    fn drop(&mut self) {
        let mut m = self.0.lock();
        m.pd.pulls_in_flight = m.pd.pulls_in_flight.saturating_sub(1);
    }
}

/// A decode leg refused before its pull (an injected fault): tell the prefill worker, as vLLM's
/// decode side sends an empty read for a request it aborts before scheduling.
pub fn abandon(remote: &Remote) {
    drop(ReadGuard(Some(remote.clone())));
}

/// The decode leg's pull: charges `fixed + bytes / bandwidth` for the prompt tokens this worker's
/// cache lacks (all but the last, which is recomputed), then notifies the prefill worker. Returns
/// how the engine should run the request, or the error response (`kv_load_failure_policy=fail`).
pub async fn pull(
    sh: &Shared,
    remote: Remote,
    prompt: &[u32],
) -> Result<KvTransfer, Box<Response<Body>>> {
    let mut guard = ReadGuard(Some(remote.clone()));
    let _pulling = PullGauge::start(&sh.metrics);
    let (tx, rx) = oneshot::channel();
    let _ = sh.cmd.send(Command::LocalHit {
        prompt: prompt.to_vec(),
        tx,
    });
    let local = rx.await.unwrap_or(0);
    let tokens = prompt.len().saturating_sub(1).saturating_sub(local);
    let pd = &sh.cfg.pd;
    let ms = pd.transfer_ms(tokens);
    let started = tokio::time::Instant::now();
    if let Some(d) = sh.cfg.scaled(ms) {
        tokio::time::sleep(d).await;
    }
    guard.0 = None;
    match notify(&remote).await {
        Ok(_) => {
            let mut m = sh.metrics.lock();
            m.pd.xfer_time.observe(started.elapsed().as_secs_f64());
            m.pd.bytes
                .observe(tokens as f64 * pd.kv_bytes_per_token as f64);
            Ok(KvTransfer::RemotePrefill)
        }
        Err(e) => {
            sh.metrics.lock().pd.failed_transfers += 1;
            match pd.load_failure_policy {
                LoadFailurePolicy::Recompute => Ok(KvTransfer::None),
                LoadFailurePolicy::Fail => Err(Box::new(error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("KV transfer from the prefill worker failed: {e}"),
                    None,
                ))),
            }
        }
    }
}

/// `POST /sim/kv/read {"remote_request_id": "..."}` on a prefill worker: a decode worker read the
/// pinned blocks (or gave up on them); free them.
pub async fn read(sh: &Shared, body: &[u8]) -> Response<Body> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let id = match &v["remote_request_id"] {
        Value::String(s) => s.parse::<u64>().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    };
    let Some(id) = id else {
        return error(
            StatusCode::BAD_REQUEST,
            "`remote_request_id` must be a request id this worker returned",
            Some("remote_request_id"),
        );
    };
    let (tx, rx) = oneshot::channel();
    if sh.cmd.send(Command::ReleasePinned { id, tx }).is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "worker is shutting down",
            None,
        );
    }
    match rx.await {
        Ok(Some(n)) => json_resp(StatusCode::OK, &json!({"freed_blocks": n})),
        _ => error(
            StatusCode::NOT_FOUND,
            format!("no pinned KV for request {id}: its lease expired or it was already read"),
            Some("remote_request_id"),
        ),
    }
}
