//! SGLang's bootstrap handoff on the HTTP side (docs/sim.md, "PD", `--pd-protocol sglang`).
//!
//! The router sends the same body to both workers at once with `bootstrap_host`,
//! `bootstrap_port` and `bootstrap_room`. The two legs meet in a *room* kept by the prefill
//! worker; the decode worker joins it over HTTP (`POST /sim/bootstrap {"bootstrap_room": R}` on
//! `bootstrap_host:bootstrap_port`, the sim's stand-in for SGLang's bootstrap server and KV
//! receiver handshake), so either leg may arrive first:
//!
//! 1. Prefill leg: opens (or finds) the room, waits until the decode worker has joined (SGLang's
//!    prefill waits in its bootstrap queue for the decode side's KV indices), computes the prompt
//!    (one token), marks the room prefilled and answers.
//! 2. Decode leg: joins the room on the prefill worker; that call answers once the prompt is
//!    computed. The decode worker then charges the transfer (the transfer-time model, for the
//!    prompt tokens its own cache lacks) and decodes; its usage reports the prompt tokens and only
//!    its own prefix hits as cached.
//!
//! Either side waits at most `--bootstrap-timeout-ms` for the other (then a 500). A leg that goes
//! away (its client closed the connection) marks the room failed, so its partner fails at once
//! instead of waiting out the timeout; a room is removed when both sides are gone.

use std::collections::HashMap;
use std::sync::Arc;

use http::{Response, StatusCode};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};

use super::{error, json as json_resp, Body};
use crate::config::Role;
use crate::engine::KvTransfer;
use crate::server::Shared;
use crate::worker::Command;

/// A request's role in a bootstrap handoff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootLeg {
    Prefill { room: u64 },
    Decode { host: String, port: u16, room: u64 },
}

type Bad = Box<Response<Body>>;

fn bad(msg: impl Into<String>, param: &str) -> Bad {
    Box::new(error(StatusCode::BAD_REQUEST, msg, Some(param)))
}

fn failed(msg: impl Into<String>) -> Bad {
    Box::new(error(StatusCode::INTERNAL_SERVER_ERROR, msg, None))
}

/// Reads `bootstrap_room/host/port`; `None` = a plain request (no room, or a `both` worker, which
/// like SGLang's `--disaggregation-mode null` ignores the fields). A decode leg with a null or
/// absent `bootstrap_port` uses `own_port` (`--disaggregation-bootstrap-port`), as SGLang uses its
/// own configured port there.
pub fn parse(v: &Value, role: Role, own_port: Option<u16>) -> Result<Option<BootLeg>, Bad> {
    let room = match v.get("bootstrap_room") {
        None | Some(Value::Null) => return Ok(None),
        Some(r) => r
            .as_u64()
            .filter(|r| *r <= i64::MAX as u64)
            .ok_or_else(|| {
                bad(
                    "`bootstrap_room` must be an integer in [0, 2^63-1]",
                    "bootstrap_room",
                )
            })?,
    };
    match role {
        Role::Both => Ok(None),
        Role::Prefill => Ok(Some(BootLeg::Prefill { room })),
        Role::Decode => {
            let host = v
                .get("bootstrap_host")
                .and_then(Value::as_str)
                .filter(|h| !h.is_empty())
                .ok_or_else(|| bad("a decode leg needs `bootstrap_host`", "bootstrap_host"))?;
            // SGLang substitutes its own bootstrap port for null; the sim serves the bootstrap
            // routes on each worker's HTTP port, so it needs the prefill worker's: from the
            // request, or for null from --disaggregation-bootstrap-port.
            let given = match v.get("bootstrap_port") {
                None | Some(Value::Null) => own_port,
                Some(p) => p.as_u64().and_then(|p| u16::try_from(p).ok()),
            };
            let port = given.filter(|p| *p != 0).ok_or_else(|| {
                bad(
                    "the sim needs `bootstrap_port` (the prefill worker's HTTP port), or \
                     --disaggregation-bootstrap-port for a null one",
                    "bootstrap_port",
                )
            })?;
            Ok(Some(BootLeg::Decode {
                host: host.to_string(),
                port,
                room,
            }))
        }
    }
}

/// What the two legs of one room have done so far.
#[derive(Debug, Clone, Copy, Default)]
struct RoomState {
    decode_joined: bool,
    /// The prompt is computed: its length in tokens.
    prefilled: Option<usize>,
    /// A leg went away or failed: its partner fails too.
    failed: bool,
}

/// The rooms of one prefill worker (in `Shared`).
#[derive(Default)]
pub struct Rooms {
    map: Mutex<HashMap<u64, Arc<watch::Sender<RoomState>>>>,
}

/// One leg's place in a room; leaving it (drop) before `done` fails the room, and the last one
/// out removes it.
struct Seat {
    sh: Arc<Shared>,
    id: u64,
    room: Option<Arc<watch::Sender<RoomState>>>,
    done: bool,
}

impl Seat {
    fn take(sh: &Arc<Shared>, id: u64) -> Seat {
        let room = {
            let mut map = sh.rooms.map.lock();
            let r = map
                .entry(id)
                .or_insert_with(|| Arc::new(watch::channel(RoomState::default()).0))
                .clone();
            sh.metrics.lock().pd.bootstrap_rooms = map.len();
            r
        };
        Seat {
            sh: sh.clone(),
            id,
            room: Some(room),
            done: false,
        }
    }

    fn update(&self, f: impl FnOnce(&mut RoomState)) {
        if let Some(r) = &self.room {
            r.send_modify(f);
        }
    }

    /// Waits until `ready` holds (counted as a waiting leg); `Err` with the reason otherwise.
    async fn wait(
        &self,
        partner: &str,
        ready: impl Fn(&RoomState) -> bool,
    ) -> Result<RoomState, String> {
        let Some(room) = &self.room else {
            return Err("room closed".into());
        };
        let mut rx = room.subscribe();
        let _waiting = Waiting::start(&self.sh);
        let started = tokio::time::Instant::now();
        let timeout = self.sh.cfg.pd.bootstrap_timeout;
        let got = tokio::time::timeout(timeout, rx.wait_for(|s| s.failed || ready(s))).await;
        self.sh
            .metrics
            .lock()
            .pd
            .bootstrap_wait
            .observe(started.elapsed().as_secs_f64());
        match got {
            Ok(Ok(s)) if !s.failed => Ok(*s),
            Ok(_) => Err(format!(
                "the {partner} leg of bootstrap room {} failed or went away",
                self.id
            )),
            Err(_) => {
                self.sh.metrics.lock().pd.bootstrap_timeouts += 1;
                Err(format!(
                    "the {partner} leg of bootstrap room {} did not come within {timeout:?}",
                    self.id
                ))
            }
        }
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let Some(room) = self.room.take() else {
            return;
        };
        if !self.done {
            room.send_modify(|s| s.failed = true);
        }
        let mut map = self.sh.rooms.map.lock();
        drop(room);
        if map.get(&self.id).is_some_and(|r| Arc::strong_count(r) == 1) {
            map.remove(&self.id);
        }
        self.sh.metrics.lock().pd.bootstrap_rooms = map.len();
    }
}

/// Counts a leg in `bootstrap_waiting` while it waits for its partner.
struct Waiting(Arc<Shared>);

impl Waiting {
    fn start(sh: &Arc<Shared>) -> Self {
        sh.metrics.lock().pd.bootstrap_waiting += 1;
        Self(sh.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut m = self.0.metrics.lock();
        m.pd.bootstrap_waiting = m.pd.bootstrap_waiting.saturating_sub(1);
    }
}

/// The prefill leg's part, held while the leg runs: wait for the decode leg, then (after the
/// prompt is computed) [`PrefillSeat::prefilled`].
pub struct PrefillSeat(Seat);

/// A prefill leg arrived for `room`: waits until its decode leg joined.
pub async fn prefill_arrives(sh: &Arc<Shared>, room: u64) -> Result<PrefillSeat, Bad> {
    let seat = Seat::take(sh, room);
    seat.wait("decode", |s| s.decode_joined)
        .await
        .map_err(failed)?;
    Ok(PrefillSeat(seat))
}

impl PrefillSeat {
    /// The prompt (`tokens` long) is computed: the decode leg may take the KV. `Err` when the
    /// decode leg went away meanwhile.
    pub fn prefilled(mut self, tokens: usize) -> Result<(), Bad> {
        let mut gone = false;
        self.0.update(|s| {
            gone = s.failed;
            s.prefilled = Some(tokens);
        });
        if gone {
            return Err(failed(format!(
                "the decode leg of bootstrap room {} went away before the KV transfer",
                self.0.id
            )));
        }
        self.0.done = true;
        Ok(())
    }
}

/// `POST /sim/bootstrap {"bootstrap_room": R}` on a prefill worker: a decode worker joins room R
/// and waits until the prompt is computed; answers `{"prompt_tokens": N}`.
pub async fn join(sh: &Arc<Shared>, body: &[u8]) -> Response<Body> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let Some(room) = v["bootstrap_room"].as_u64() else {
        return error(
            StatusCode::BAD_REQUEST,
            "`bootstrap_room` must be an integer",
            Some("bootstrap_room"),
        );
    };
    if sh.cfg.pd.role != Role::Prefill {
        return error(
            StatusCode::BAD_REQUEST,
            "this worker is not a prefill worker: it has no bootstrap rooms",
            Some("bootstrap_room"),
        );
    }
    let mut seat = Seat::take(sh, room);
    seat.update(|s| s.decode_joined = true);
    match seat.wait("prefill", |s| s.prefilled.is_some()).await {
        Ok(s) => {
            seat.done = true;
            json_resp(
                StatusCode::OK,
                &json!({"bootstrap_room": room, "prompt_tokens": s.prefilled.unwrap_or(0)}),
            )
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e, None),
    }
}

/// The decode leg's part: join the room on the prefill worker (waiting for the prompt), then
/// charge the transfer of what this worker's cache lacks. Returns how the engine runs it.
pub async fn decode_joins(
    sh: &Arc<Shared>,
    host: &str,
    port: u16,
    room: u64,
    prompt: &[u32],
) -> Result<KvTransfer, Bad> {
    let started = tokio::time::Instant::now();
    let timeout = sh.cfg.pd.bootstrap_timeout;
    let call = {
        let _waiting = Waiting::start(sh);
        tokio::time::timeout(timeout, call_join(host, port, room)).await
    };
    sh.metrics
        .lock()
        .pd
        .bootstrap_wait
        .observe(started.elapsed().as_secs_f64());
    match call {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            sh.metrics.lock().pd.failed_transfers += 1;
            return Err(failed(format!("KV bootstrap for room {room} failed: {e}")));
        }
        Err(_) => {
            let mut m = sh.metrics.lock();
            m.pd.bootstrap_timeouts += 1;
            m.pd.failed_transfers += 1;
            return Err(failed(format!(
                "KV bootstrap for room {room}: the prefill leg did not come within {timeout:?}"
            )));
        }
    }
    let (tx, rx) = oneshot::channel();
    let _ = sh.cmd.send(Command::LocalHit {
        prompt: prompt.to_vec(),
        tx,
    });
    let local = rx.await.unwrap_or(0);
    let tokens = prompt.len().saturating_sub(1).saturating_sub(local);
    let pd = &sh.cfg.pd;
    let t = tokio::time::Instant::now();
    if let Some(d) = sh.cfg.scaled(pd.transfer_ms(tokens)) {
        tokio::time::sleep(d).await;
    }
    let mut m = sh.metrics.lock();
    m.pd.xfer_time.observe(t.elapsed().as_secs_f64());
    m.pd.bytes
        .observe(tokens as f64 * pd.kv_bytes_per_token as f64);
    Ok(KvTransfer::Bootstrapped)
}

/// One `POST /sim/bootstrap` to the prefill worker at `host:port`; its answer's prompt tokens.
/// The connection lives as long as this call: dropping the call (the decode leg's client went
/// away) closes it, which makes the prefill worker leave the room.
async fn call_join(host: &str, port: u16, room: u64) -> Result<usize, String> {
    let addr = format!("{host}:{port}");
    let body = json!({"bootstrap_room": room});
    let v = super::pd::post_to_prefill(&addr, "/sim/bootstrap", &body, "bootstrap call").await?;
    Ok(v["prompt_tokens"].as_u64().unwrap_or(0) as usize)
}
