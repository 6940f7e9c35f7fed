//! Prefill/decode disaggregation (docs/routing.md, "Prefill/decode disaggregation"): which pools
//! split, the vLLM NixlConnector legs' bodies, and what the prefill leg leaves for the rest of the
//! request ([`Prefilled`]: the transfer-wait metric and the usage merge). The handoff itself runs
//! in `proxy/handoff.rs`, called by the proxy once per request to a pool with `role = "prefill"`
//! workers; it runs the prefill leg and hands the proxy's ordinary pick → dispatch → forward →
//! retry loop a decode-only pool and the decode leg's body, so the decode leg is chosen, retried
//! on another decode worker before its first byte, streamed and observed like any request.
//!
//! 1. Estimate the decode worker's pick (the pool's policy: decode load and overlap, since vLLM
//!    decode workers cache too) and its uncached prompt. Below `pd.min_uncached_tokens` the
//!    decode worker runs it all (`local`, `short_prompt`).
//! 2. Choose a prefill worker by the same policy (KV overlap + prefill queue + active load) without
//!    queueing: every prefill worker busy → `local` (`prefill_busy`).
//! 3. Prefill leg: the client's body with `max_tokens: 1` (and `max_completion_tokens: 1` if
//!    present), `stream: false`, `stream_options`/`min_tokens`/`min_completion_tokens` removed and
//!    `kv_transfer_params: {do_remote_decode: true, ...}`. Its load on the prefill worker ends when
//!    it answers (the handoff), not at the end of the client's stream.
//! 4. It failed → the next prefill worker, then `local` (`prefill_failed`, counted); it answered
//!    without params → `local` (`no_params`, counted: the decode worker computes it all).
//! 5. Decode leg: the original body plus the returned `kv_transfer_params`.
//!
//! Usage: the decode worker reports pulled tokens as cached (a cold request looks like a 100%
//! hit), so the client's usage and the recorded tokens take prompt and cached tokens from the
//! prefill leg and completion tokens from the decode leg ([`Prefilled::on_finish`],
//! `kvgate_protocol::usage::merge_pd_usage`).
//!
//! The other protocols (`[pd] protocol`) reuse steps 1–2. TensorRT-LLM runs the same sequence with
//! its own bodies ([`trtllm_context_body`], [`trtllm_context_outcome`], [`trtllm_generation_body`]).
//! SGLang sends one body ([`sglang_body`]: the client's plus `bootstrap_host/port/room`) to both
//! workers at once (`proxy/bootstrap.rs`) and passes the decode worker's usage through: it does not
//! count the transferred tokens as cached.

use std::time::Instant;

use bytes::Bytes;
use kvgate_protocol::usage::Usage;
use serde_json::{Map, Value};

use crate::config::{Handoff, PdProtocol, WorkerRole};
use crate::metrics::Metrics;
use crate::registry::{Pool, Worker};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Whether `worker` has more requests in flight than the average decode-capable worker of the
/// split plus one (then a short prompt is not run locally there: `route::Decider::plan_pd`). The
/// total is the split's maintained sum ([`RoleSplit::decode_inflight`]): no pass over the pool.
pub fn crowded(roles: &RoleSplit, worker: &Worker) -> bool {
    let n = roles.decode.workers.len().max(1) as u64;
    let total = roles.decode_inflight();
    let mine = u64::from(worker.state.inflight.load(Ordering::Relaxed));
    // mine > mean + 1, in integers.
    mine * n > total + n
}

/// What the prefill leg left for the rest of the request.
#[derive(Debug, Clone)]
pub struct Prefilled {
    /// When the prefill worker's answer had been read.
    pub answered: Instant,
    /// The prefill worker's usage: its prompt tokens and its own prefix hits.
    pub usage: Option<Usage>,
}

impl Prefilled {
    /// At the request's end: the transfer wait (streams), and usage with prompt and cached tokens
    /// from the prefill leg, completion tokens from the decode leg (vllm-project/router's
    /// usage merge does the same).
    pub fn on_finish(
        &self,
        m: &Metrics,
        stream: bool,
        first_token: Option<Instant>,
        usage: &mut Option<Usage>,
    ) {
        if let (true, Some(t)) = (stream, first_token) {
            m.pd.transfer_wait
                .observe(t.saturating_duration_since(self.answered).as_secs_f64());
        }
        if let (Some(u), Some(p)) = (usage.as_mut(), self.usage) {
            u.prompt_tokens = p.prompt_tokens;
            u.cached_tokens = p.cached_tokens;
        }
    }
}

/// SGLang: the client's (decode) body's link to the prefill leg, which is still being drained
/// when the decode worker's answer starts. A prefill leg that fails then fails the client's
/// answer (one SSE error event, or a cut JSON body) and so closes the decode worker's
/// connection; a client that leaves cancels the prefill leg's drain.
#[derive(Debug)]
pub struct Partner {
    /// Gets the reason if the prefill leg failed; closed without one when it completed.
    pub failed: tokio::sync::oneshot::Receiver<String>,
    /// Cancelled when the client's body is dropped before its end.
    pub leave: tokio_util::sync::CancellationToken,
}

/// Whether requests to `pool` are split: it has a dedicated prefill worker (configured, or
/// detected for `role = "auto"`). From the pool's cached [`RoleSplit`]: no pass over the pool.
pub fn applies(pool: &Pool) -> bool {
    // Every request asks: the cached answer (one atomic, not the split's `ArcSwap`) when it is
    // of the current generation.
    let at = pool.applies_at.load(Ordering::Acquire);
    if at >> 1 == crate::registry::role_generation() {
        return at & 1 == 1;
    }
    roles(pool).applies
}

pub use crate::registry::RoleSplit;

/// `pool`'s [`RoleSplit`], recomputed only when a worker's detected role changed since.
pub fn roles(pool: &Pool) -> Arc<RoleSplit> {
    // The generation first: a role change racing the computation bumps it after, so the next
    // call recomputes.
    let generation = crate::registry::role_generation();
    if let Some(s) = pool.roles.load_full() {
        if s.generation == generation {
            return s;
        }
    }
    let s = Arc::new(RoleSplit::new(
        generation,
        pool.workers
            .iter()
            .any(|w| w.role() == Some(WorkerRole::Prefill)),
        Arc::new(sub_pool(pool, WorkerRole::can_decode)),
        Arc::new(sub_pool(pool, WorkerRole::can_prefill)),
    ));
    pool.roles.store(Some(s.clone()));
    pool.applies_at
        .store(generation << 1 | u64::from(s.applies), Ordering::Release);
    s
}

/// The handoff to run for a pool whose prefill-capable workers are `prefill`: the configured
/// protocol, or with `auto` from its first dedicated prefill worker (else its first worker; one
/// model's pool runs one engine): SGLang when the worker announced its role in `/server_info`
/// (`role = "auto"`), else by its `kind`.
pub fn protocol_for(configured: PdProtocol, prefill: &Pool) -> Handoff {
    if let PdProtocol::Fixed(h) = configured {
        return h;
    }
    let first = prefill
        .workers
        .iter()
        .find(|w| w.role() == Some(WorkerRole::Prefill))
        .or(prefill.workers.first());
    match first {
        Some(w) if w.role_announced() => Handoff::Sglang,
        Some(w) if w.kind == kvgate_fleet::WorkerKind::Sglang => Handoff::Sglang,
        Some(w) if w.kind == kvgate_fleet::WorkerKind::Trtllm => Handoff::Trtllm,
        _ => Handoff::Vllm,
    }
}

/// The workers of `pool` whose role `keep` accepts, as a pool of their own (an `auto` worker of
/// unknown role is in neither).
pub fn sub_pool(pool: &Pool, keep: impl Fn(WorkerRole) -> bool) -> Pool {
    Pool::new(
        pool.model.clone(),
        pool.workers
            .iter()
            .filter(|w| w.role().is_some_and(&keep))
            .cloned()
            .collect(),
        pool.block_size,
        pool.tokenizer.clone(),
    )
}

/// The prefill leg's body (vLLM toy proxy / NIXL semantics); `None` when the client's body is not
/// a JSON object or asks for several choices (one handoff serves one sequence: decode-only).
pub fn prefill_body(body: &[u8]) -> Option<Map<String, Value>> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    if o.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return None;
    }
    let mut params = Map::new();
    params.insert("do_remote_decode".into(), Value::Bool(true));
    params.insert("do_remote_prefill".into(), Value::Bool(false));
    for k in [
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
    ] {
        params.insert(k.into(), Value::Null);
    }
    o.insert("kv_transfer_params".into(), Value::Object(params));
    o.insert("stream".into(), Value::Bool(false));
    o.insert("max_tokens".into(), Value::from(1));
    if o.contains_key("max_completion_tokens") {
        o.insert("max_completion_tokens".into(), Value::from(1));
    }
    for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
        o.remove(k);
    }
    Some(o)
}

/// The decode leg's body: the client's body (as forwarded) with the prefill's params.
pub fn decode_body(body: &[u8], params: &Value) -> Option<Bytes> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    o.insert("kv_transfer_params".into(), params.clone());
    serde_json::to_vec(&o).ok().map(Bytes::from)
}

/// Where a prefill worker's bootstrap server listens, as SGLang routers send it: the host of the
/// worker's URL, and its `bootstrap_port` ([`crate::registry::Worker::bootstrap_port`]; 0 = null:
/// the engine uses its own).
pub fn bootstrap_addr(url: &str, port: u16) -> Option<(String, Option<u16>)> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_string(), (port != 0).then_some(port)))
}

/// A fresh `bootstrap_room`: uniform in [0, 2^63 − 1] (SMG masks a random u64 with `i64::MAX`).
pub fn bootstrap_room() -> u64 {
    fastrand::u64(..) & (i64::MAX as u64)
}

/// SGLang's body for both legs: the client's body (as forwarded) plus `bootstrap_host`,
/// `bootstrap_port` (null when `None`) and `bootstrap_room`. `None` when the body is not a JSON
/// object or asks for several choices (one room serves one sequence: decode-only).
pub fn sglang_body(body: &[u8], host: &str, port: Option<u16>, room: u64) -> Option<Bytes> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    if o.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return None;
    }
    o.insert("bootstrap_host".into(), Value::from(host));
    o.insert(
        "bootstrap_port".into(),
        port.map_or(Value::Null, Value::from),
    );
    o.insert("bootstrap_room".into(), Value::from(room));
    serde_json::to_vec(&o).ok().map(Bytes::from)
}

/// TensorRT-LLM's context leg (context-first): the client's body with `stream: false`,
/// `stream_options: null` and `disaggregated_params: {request_type: "context_only",
/// disagg_request_id}`. `None` when not a JSON object or several choices are asked for.
pub fn trtllm_context_body(body: &[u8], disagg_request_id: u64) -> Option<Bytes> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    if o.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return None;
    }
    let mut params = Map::new();
    params.insert("request_type".into(), Value::from("context_only"));
    params.insert("disagg_request_id".into(), Value::from(disagg_request_id));
    o.insert("disaggregated_params".into(), Value::Object(params));
    o.insert("stream".into(), Value::Bool(false));
    o.insert("stream_options".into(), Value::Null);
    serde_json::to_vec(&o).ok().map(Bytes::from)
}

/// What a TensorRT-LLM context answer leaves for the generation leg.
#[derive(Debug, Clone, PartialEq)]
pub enum ContextOutcome {
    /// Generate with these `disaggregated_params` (already `request_type: "generation_only"`).
    Generate(Value),
    /// The context leg finished the request (its one token was EOS or a stop): its answer is the
    /// client's answer.
    Finished,
    /// Not a usable context answer (not one choice, no params, no `ctx_request_id` or
    /// `disagg_request_id`).
    Invalid,
}

/// Reads a context answer as TensorRT-LLM's disaggregated server does: exactly one choice whose
/// `disaggregated_params` carry `ctx_request_id` and `disagg_request_id`; a `finish_reason` other
/// than `length`/`not_finished` means the context leg already finished the request.
pub fn trtllm_context_outcome(answer: &Value) -> ContextOutcome {
    let Some([choice]) = answer
        .get("choices")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    else {
        return ContextOutcome::Invalid;
    };
    if let Some(r) = choice.get("finish_reason").and_then(Value::as_str) {
        if r != "length" && r != "not_finished" {
            return ContextOutcome::Finished;
        }
    }
    let Some(Value::Object(p)) = choice.get("disaggregated_params") else {
        return ContextOutcome::Invalid;
    };
    let present = |k: &str| p.get(k).is_some_and(|v| !v.is_null());
    if !present("ctx_request_id") || !present("disagg_request_id") {
        return ContextOutcome::Invalid;
    }
    let mut p = p.clone();
    p.insert("request_type".into(), Value::from("generation_only"));
    ContextOutcome::Generate(Value::Object(p))
}

/// TensorRT-LLM's generation leg: the client's body (its own `stream`, `max_tokens`,
/// `stream_options`) plus the context's params.
pub fn trtllm_generation_body(body: &[u8], params: &Value) -> Option<Bytes> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    o.insert("disaggregated_params".into(), params.clone());
    serde_json::to_vec(&o).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_protocol_from_the_prefill_workers_kind() {
        let pool_of = |kind: &str| {
            let mut cfg = crate::config::Config::default();
            for (url, role) in [
                ("http://10.0.0.1:8000", WorkerRole::Prefill),
                ("http://10.0.0.2:8000", WorkerRole::Decode),
            ] {
                let mut w = crate::config::WorkerConfig::from_url(url);
                w.kind = kind.into();
                w.role = role.into();
                w.models = vec!["m".into()];
                cfg.workers.push(w);
            }
            let (reg, _) = crate::registry::Registry::new(std::sync::Arc::new(cfg)).unwrap();
            let fleet = reg.snapshot();
            sub_pool(fleet.pool("m").unwrap(), WorkerRole::can_prefill)
        };
        for (kind, want) in [
            ("sglang", Handoff::Sglang),
            ("trtllm", Handoff::Trtllm),
            ("vllm", Handoff::Vllm),
            ("openai", Handoff::Vllm),
        ] {
            assert_eq!(
                protocol_for(PdProtocol::Auto, &pool_of(kind)),
                want,
                "{kind}"
            );
        }
        // A configured protocol wins over the workers' kind.
        assert_eq!(
            protocol_for(PdProtocol::Fixed(Handoff::Vllm), &pool_of("sglang")),
            Handoff::Vllm
        );
    }

    #[test]
    fn auto_roles_count_once_detected_and_an_announced_mode_means_sglang() {
        use crate::config::{RoleSetting, WorkerConfig};
        use crate::registry::DetectedRole;
        let mut cfg = crate::config::Config::default();
        for (url, port) in [
            ("http://10.0.0.1:30000", None),
            ("http://10.0.0.2:30000", Some(7000)),
        ] {
            let mut w = WorkerConfig::from_url(url);
            w.role = RoleSetting::Auto;
            w.bootstrap_port = port;
            w.models = vec!["m".into()];
            cfg.workers.push(w);
        }
        let (reg, _) = crate::registry::Registry::new(std::sync::Arc::new(cfg)).unwrap();
        let fleet = reg.snapshot();
        let pool = fleet.pool("m").unwrap();
        let (p, d) = (&pool.workers[0], &pool.workers[1]);
        let now = crate::clock::now();
        // Not told yet: in neither sub-pool, not routable, no split.
        assert_eq!(p.role(), None);
        assert_eq!(p.role_label(), "unknown");
        assert!(!p.state.routable(now));
        assert!(!applies(pool));
        assert!(sub_pool(pool, WorkerRole::can_decode).workers.is_empty());
        let told = |role, port| DetectedRole {
            role,
            announced: true,
            bootstrap_port: port,
        };
        p.state
            .set_detected_role(&told(WorkerRole::Prefill, Some(9001)));
        d.state
            .set_detected_role(&told(WorkerRole::Prefill, Some(9002)));
        assert!(p.state.routable(now));
        assert!(applies(pool));
        // The announced port, unless the config names one.
        assert_eq!((p.bootstrap_port(), d.bootstrap_port()), (9001, 7000));
        let prefill = sub_pool(pool, WorkerRole::can_prefill);
        assert_eq!(prefill.workers.len(), 2);
        // kind is vllm (the default): the announced mode decides.
        assert_eq!(protocol_for(PdProtocol::Auto, &prefill), Handoff::Sglang);
        d.state.set_detected_role(&told(WorkerRole::Decode, None));
        assert_eq!(sub_pool(pool, WorkerRole::can_decode).workers.len(), 1);
        // A worker without /server_info (nothing announced) is `both`, its handoff by kind.
        p.state.set_detected_role(&DetectedRole {
            role: WorkerRole::Both,
            announced: false,
            bootstrap_port: None,
        });
        assert_eq!(p.role(), Some(WorkerRole::Both));
        assert_eq!(p.bootstrap_port(), crate::config::DEFAULT_BOOTSTRAP_PORT);
        assert!(!applies(pool));
        assert_eq!(
            protocol_for(PdProtocol::Auto, &sub_pool(pool, WorkerRole::can_prefill)),
            Handoff::Vllm
        );
        // The cached split equals the sub-pools (reused while no worker's role changes; other
        // tests of this process may change roles concurrently, so reuse is not asserted).
        let a = roles(pool);
        let ids = |p: &Pool| p.workers.iter().map(|w| w.id).collect::<Vec<_>>();
        assert_eq!(ids(&a.decode), ids(&sub_pool(pool, WorkerRole::can_decode)));
        assert_eq!(
            ids(&a.prefill),
            ids(&sub_pool(pool, WorkerRole::can_prefill))
        );
        // A new role recomputes it.
        d.state.set_detected_role(&told(WorkerRole::Prefill, None));
        let c = roles(pool);
        assert!(!Arc::ptr_eq(&a, &c) && c.applies);
        assert_eq!(ids(&c.decode), ids(&sub_pool(pool, WorkerRole::can_decode)));
        assert_eq!(
            ids(&c.prefill),
            ids(&sub_pool(pool, WorkerRole::can_prefill))
        );
    }

    /// The decode workers' in-flight sum that `crowded` reads is kept by the workers as requests
    /// come and go: it equals the sum over the split's decode workers after adds, frees, a split
    /// made while requests were in flight, a worker left out of a newer split (removed) and the
    /// old split dropped, and after concurrent adds and frees racing splits made and dropped.
    #[test]
    fn the_decode_inflight_sum_is_kept_through_adds_frees_and_removals() {
        let mut cfg = crate::config::Config::default();
        for (i, role) in [
            WorkerRole::Prefill,
            WorkerRole::Decode,
            WorkerRole::Decode,
            WorkerRole::Both,
            WorkerRole::Decode,
        ]
        .into_iter()
        .enumerate()
        {
            let mut w = crate::config::WorkerConfig::from_url(&format!("http://10.0.1.{i}:8000"));
            w.role = role.into();
            w.models = vec!["m".into()];
            cfg.workers.push(w);
        }
        let (reg, _) = crate::registry::Registry::new(Arc::new(cfg)).unwrap();
        let fleet = reg.snapshot();
        let pool = fleet.pool("m").unwrap();
        let sum = |p: &Pool| -> u64 {
            p.workers
                .iter()
                .map(|w| u64::from(w.state.inflight.load(Ordering::Relaxed)))
                .sum()
        };
        let split = roles(pool);
        assert_eq!(split.decode.workers.len(), 4);
        assert_eq!(split.decode_inflight(), 0);
        // Adds and frees on every worker, the prefill worker too (not counted).
        let ws = &pool.workers;
        for (w, n) in [(0, 3), (1, 2), (2, 5), (3, 1), (4, 4)] {
            for _ in 0..n {
                ws[w].state.add_inflight();
            }
        }
        ws[2].state.sub_inflight();
        ws[0].state.sub_inflight();
        assert_eq!(split.decode_inflight(), sum(&split.decode));
        assert_eq!(split.decode_inflight(), 2 + 4 + 1 + 4);
        // A worker with the pool's mean + 1 or fewer is not crowded; one above it is.
        assert!(!crowded(&split, &ws[3]));
        for _ in 0..3 {
            ws[2].state.add_inflight();
        }
        assert!(crowded(&split, &ws[2]));
        // A newer split without worker 2 (it was removed), made while requests are in flight:
        // it starts at its workers' sum and does not count worker 2's requests.
        let newer = RoleSplit::new(
            0,
            true,
            Arc::new(Pool::new(
                pool.model.clone(),
                vec![ws[1].clone(), ws[3].clone(), ws[4].clone()],
                pool.block_size,
                pool.tokenizer.clone(),
            )),
            split.prefill.clone(),
        );
        assert_eq!(newer.decode_inflight(), 2 + 1 + 4);
        ws[2].state.add_inflight();
        ws[1].state.sub_inflight();
        assert_eq!(newer.decode_inflight(), sum(&newer.decode));
        assert_eq!(split.decode_inflight(), sum(&split.decode));
        // The old split dropped: its workers stop counting in it, the newer one is unchanged.
        let old_sum = Arc::clone(&split.decode_inflight);
        drop(split);
        pool.roles.store(None);
        assert_eq!(
            Arc::strong_count(&old_sum),
            1,
            "a worker still counts in a dropped split"
        );
        ws[4].state.sub_inflight();
        assert_eq!(newer.decode_inflight(), sum(&newer.decode));
        // Concurrent adds and frees racing splits made and dropped: every split still alive at
        // the end holds its workers' exact sum.
        std::thread::scope(|s| {
            for t in 0..3usize {
                s.spawn(move || {
                    for i in 0..20_000usize {
                        let w = &ws[(i * 7 + t) % ws.len()];
                        w.state.add_inflight();
                        if i % 3 != 0 {
                            w.state.sub_inflight();
                        }
                    }
                });
            }
            for i in 0..200 {
                let keep: Vec<_> = ws.iter().skip(i % 3).cloned().collect();
                let p = Arc::new(Pool::new(
                    pool.model.clone(),
                    keep,
                    pool.block_size,
                    pool.tokenizer.clone(),
                ));
                drop(RoleSplit::new(0, true, p, newer.prefill.clone()));
            }
        });
        assert_eq!(newer.decode_inflight(), sum(&newer.decode));
        let last = roles(pool);
        assert_eq!(last.decode_inflight(), sum(&last.decode));
    }

    #[test]
    fn sglang_body_adds_the_bootstrap_fields_and_keeps_the_rest() {
        let b = sglang_body(
            br#"{"model":"m","stream":true,"max_tokens":9,"stream_options":{"include_usage":true}}"#,
            "10.0.0.5",
            Some(8998),
            (1 << 63) - 1,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["bootstrap_host"], "10.0.0.5");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], i64::MAX);
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(v["stream_options"]["include_usage"], true);
        let b = sglang_body(br#"{"model":"m"}"#, "h", None, 0).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert!(v["bootstrap_port"].is_null());
        assert!(sglang_body(br#"{"model":"m","n":2}"#, "h", None, 0).is_none());
        assert!(sglang_body(b"[1]", "h", None, 0).is_none());
    }

    #[test]
    fn bootstrap_addr_and_room() {
        assert_eq!(
            bootstrap_addr("http://10.0.0.5:30000", 8998),
            Some(("10.0.0.5".into(), Some(8998)))
        );
        assert_eq!(
            bootstrap_addr("http://[::1]:30000/x", 0),
            Some(("::1".into(), None))
        );
        assert_eq!(
            bootstrap_addr("https://p.svc", 9000),
            Some(("p.svc".into(), Some(9000)))
        );
        for _ in 0..1000 {
            assert!(bootstrap_room() <= i64::MAX as u64);
        }
    }

    #[test]
    fn trtllm_context_leg_is_unstreamed_and_tagged() {
        let b = trtllm_context_body(
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":9}"#,
            77,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream"], false);
        assert!(v["stream_options"].is_null());
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(v["disaggregated_params"]["request_type"], "context_only");
        assert_eq!(v["disaggregated_params"]["disagg_request_id"], 77);
        assert!(trtllm_context_body(br#"{"n":3}"#, 1).is_none());
    }

    #[test]
    fn trtllm_context_answer_decides_the_generation_leg() {
        let params = serde_json::json!({"request_type": "context_only", "ctx_request_id": 5,
            "disagg_request_id": 77, "first_gen_tokens": [11], "encoded_opaque_state": "AAE="});
        let answer = |reason: &str, p: &Value| {
            serde_json::json!({"choices": [{"index": 0, "text": "x", "finish_reason": reason,
                "disaggregated_params": p}]})
        };
        let ContextOutcome::Generate(g) = trtllm_context_outcome(&answer("length", &params)) else {
            panic!("length-capped context must generate");
        };
        assert_eq!(g["request_type"], "generation_only");
        assert_eq!(g["ctx_request_id"], 5);
        assert_eq!(g["first_gen_tokens"], serde_json::json!([11]));
        assert!(matches!(
            trtllm_context_outcome(&answer("not_finished", &params)),
            ContextOutcome::Generate(_)
        ));
        assert_eq!(
            trtllm_context_outcome(&answer("stop", &params)),
            ContextOutcome::Finished
        );
        let mut no_ctx = params.clone();
        no_ctx["ctx_request_id"] = Value::Null;
        assert_eq!(
            trtllm_context_outcome(&answer("length", &no_ctx)),
            ContextOutcome::Invalid
        );
        assert_eq!(
            trtllm_context_outcome(&serde_json::json!({"choices": []})),
            ContextOutcome::Invalid
        );
        let b =
            trtllm_generation_body(br#"{"model":"m","stream":true,"max_tokens":9}"#, &g).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(v["disaggregated_params"], g);
    }

    #[test]
    fn prefill_body_is_capped_unstreamed_and_tagged() {
        let b =
            br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},
            "max_tokens":50,"max_completion_tokens":50,"min_tokens":5,"min_completion_tokens":5}"#;
        let o = prefill_body(b).unwrap();
        assert_eq!(o["max_tokens"], 1);
        assert_eq!(o["max_completion_tokens"], 1);
        assert_eq!(o["stream"], false);
        for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
            assert!(!o.contains_key(k), "{k}");
        }
        assert_eq!(o["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(o["kv_transfer_params"]["do_remote_prefill"], false);
        assert_eq!(o["kv_transfer_params"]["remote_block_ids"], Value::Null);
        // No max_completion_tokens added when the client did not send it.
        let o = prefill_body(br#"{"model":"m","prompt":"x"}"#).unwrap();
        assert!(!o.contains_key("max_completion_tokens"));
        assert_eq!(o["max_tokens"], 1);
    }

    #[test]
    fn several_choices_or_non_objects_are_not_split() {
        assert!(prefill_body(br#"{"model":"m","prompt":"x","n":2}"#).is_none());
        assert!(prefill_body(br#"[1,2]"#).is_none());
        assert!(prefill_body(b"not json").is_none());
        assert!(prefill_body(br#"{"model":"m","prompt":"x","n":1}"#).is_some());
    }

    #[test]
    fn decode_body_keeps_the_original_and_adds_params() {
        let params = serde_json::json!({"do_remote_prefill": true, "remote_block_ids": [1, 2]});
        let b = decode_body(
            br#"{"model":"m","stream":true,"max_tokens":9,"min_tokens":2}"#,
            &params,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(v["min_tokens"], 2);
        assert_eq!(v["kv_transfer_params"], params);
    }

    #[test]
    fn usage_comes_from_prefill_for_prompt_and_cache() {
        let m = Metrics::new();
        let pre = Prefilled {
            answered: crate::clock::now(),
            usage: Some(Usage {
                prompt_tokens: 200,
                completion_tokens: 1,
                cached_tokens: Some(32),
            }),
        };
        let mut u = Some(Usage {
            prompt_tokens: 200,
            completion_tokens: 7,
            cached_tokens: Some(199),
        });
        pre.on_finish(&m, true, Some(crate::clock::now()), &mut u);
        assert_eq!(
            u,
            Some(Usage {
                prompt_tokens: 200,
                completion_tokens: 7,
                cached_tokens: Some(32),
            })
        );
        assert!(
            m.render()
                .contains("kvgate_pd_transfer_wait_seconds_count 1"),
            "{}",
            m.render()
        );
    }
}
