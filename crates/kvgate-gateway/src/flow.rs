//! Flow control's one entry point for front ends: [`key`] turns a request's headers and its API
//! key into the [`FlowKey`] the decision core queues it by (put it in `RouteInput::flow`). The
//! queue discipline itself is in `route/admission.rs`, the `[flow_control]` policy in
//! `route/flow.rs` (docs/flow-control.md).
//!
//! - priority: `x-kvgate-priority`, else `x-llm-d-inference-objective` mapped through
//!   `flow_control.objectives`, else the API key's `priority`, else `flow_control.models`, else
//!   `flow_control.default_priority`;
//! - tenant (fairness key): the API key's `tenant` (or `name`), else `x-kvgate-tenant`, else
//!   `x-llm-d-inference-fairness-id`, else the first of `routing.session_headers` present (the
//!   same list session affinity reads: one agent session shares one fair share);
//! - TTFT objective: `x-kvgate-slo-ttft-ms`, else the objective's `ttft_ms`, else the class's;
//! - tokens: prompt tokens + expected output (`max_tokens`, at most
//!   `flow_control.expected_output_tokens`).

use std::sync::Arc;

use http::HeaderMap;

use crate::auth::Caller;
use crate::error::{ErrorKind, GatewayError};
pub use crate::route::flow::FlowPolicy;
pub use crate::route::FlowKey;

pub const PRIORITY: &str = "x-kvgate-priority";
pub const TENANT: &str = "x-kvgate-tenant";
pub const SLO_TTFT_MS: &str = "x-kvgate-slo-ttft-ms";
/// The Gateway API inference extension's objective (an `InferenceObjective` name).
pub const OBJECTIVE: &str = "x-llm-d-inference-objective";
/// llm-d's flow-control fairness id.
pub const FAIRNESS_ID: &str = "x-llm-d-inference-fairness-id";

/// Longest fairness key taken from a header (longer: 400).
const MAX_TENANT_BYTES: usize = 256;

/// The request's flow key. `caller` is what `Auth::check` returned (None: auth off),
/// `session_headers` the router's `routing.session_headers` (lower-case), `model` the canonical
/// model name, `isl` the prompt's tokens, `max_tokens` the request's output limit.
/// With flow control off: the default key (every request alike, arrival order), headers unread.
/// Malformed flow headers are a 400 naming the header.
#[allow(clippy::too_many_arguments)]
pub fn key(
    policy: &FlowPolicy,
    headers: &HeaderMap,
    caller: Option<&Caller>,
    session_headers: &[String],
    model: &str,
    isl: u64,
    max_tokens: Option<u64>,
) -> Result<FlowKey, GatewayError> {
    let tokens = policy.cost(isl, max_tokens);
    if !policy.enabled {
        return Ok(FlowKey {
            tokens,
            ..FlowKey::default()
        });
    }
    let objective = text(headers, OBJECTIVE)?.and_then(|o| policy.objectives.get(o));
    let priority = match number::<i32>(headers, PRIORITY)? {
        Some(p) => p,
        None => objective
            .map(|o| o.0)
            .or(caller.and_then(|c| c.priority))
            .or(policy.models.get(model).copied())
            .unwrap_or(policy.default_priority),
    };
    let slo_ttft_ms = match number::<u64>(headers, SLO_TTFT_MS)? {
        Some(0) => return Err(bad(SLO_TTFT_MS, "must be >= 1")),
        Some(ms) => Some(ms),
        None => objective.and_then(|o| o.1),
    };
    let tenant = match caller.and_then(|c| c.tenant.clone()) {
        Some(t) => Some(t),
        None => {
            let mut t = None;
            let names = [TENANT, FAIRNESS_ID]
                .into_iter()
                .chain(session_headers.iter().map(String::as_str));
            for h in names {
                if let Some(v) = text(headers, h)?.filter(|v| !v.is_empty()) {
                    if v.len() > MAX_TENANT_BYTES {
                        return Err(bad(h, "is longer than 256 bytes"));
                    }
                    t = Some(Arc::from(v));
                    break;
                }
            }
            t
        }
    };
    Ok(FlowKey {
        priority,
        tenant,
        slo_ttft_ms,
        tokens,
    })
}

/// The engine's `priority` field for a request of class priority `class_priority` on a worker of
/// `kind`, when `flow_control.forward_priority` lists that kind: vLLM schedules lower values
/// first (so the class priority is negated), SGLang higher values first (its default).
pub fn engine_priority(
    policy: &FlowPolicy,
    kind: kvgate_fleet::WorkerKind,
    class_priority: i32,
) -> Option<i64> {
    if !policy.forwards_to(kind.as_str()) {
        return None;
    }
    match kind {
        kvgate_fleet::WorkerKind::Vllm => Some(-i64::from(class_priority)),
        kvgate_fleet::WorkerKind::Sglang => Some(i64::from(class_priority)),
        _ => None,
    }
}

/// `body` (a JSON object) with `"priority":N` appended as its last member: the engines' JSON
/// parsers keep the last of duplicate keys, so the gateway's value wins over a client's own.
/// `None` when the body does not end in `}` (not an object: forwarded unchanged).
pub fn splice_priority(body: &[u8], priority: i64) -> Option<Vec<u8>> {
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if body[end] != b'}' {
        return None;
    }
    let inner_empty = body[..end]
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .is_some_and(|i| body[i] == b'{');
    let mut out = Vec::with_capacity(body.len() + 24);
    out.extend_from_slice(&body[..end]);
    if !inner_empty {
        out.push(b',');
    }
    out.extend_from_slice(format!("\"priority\":{priority}}}").as_bytes());
    out.extend_from_slice(&body[end + 1..]);
    Some(out)
}

fn bad(header: &str, what: &str) -> GatewayError {
    GatewayError::new(
        ErrorKind::BadRequest { param: None },
        format!("header {header} {what}"),
    )
}

fn text<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, GatewayError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()))
            .map_err(|_| bad(name, "is not visible ASCII")),
    }
}

fn number<T: std::str::FromStr>(
    headers: &HeaderMap,
    name: &str,
) -> Result<Option<T>, GatewayError> {
    match text(headers, name)? {
        None => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| bad(name, &format!("is not an integer in range: {s:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FlowControlConfig, FlowObjectiveConfig};

    fn policy() -> FlowPolicy {
        let mut cfg = FlowControlConfig {
            enabled: true,
            ..Default::default()
        };
        cfg.objectives.insert(
            "chat".into(),
            FlowObjectiveConfig {
                priority: 10,
                ttft_ms: Some(300),
            },
        );
        cfg.models.insert("big".into(), -1);
        FlowPolicy::new(&cfg)
    }

    /// `routing.session_headers` as configured by default.
    fn sessions() -> Vec<String> {
        crate::config::RoutingConfig::default().session_headers
    }

    #[test]
    fn the_session_headers_are_routings() {
        let p = policy();
        let h = headers(&[("x-my-session", "s7"), ("x-session-id", "s1")]);
        let mine = vec!["x-my-session".to_owned()];
        let k = key(&p, &h, None, &mine, "m", 1, None).unwrap();
        assert_eq!(k.tenant.as_deref(), Some("s7"), "the configured list");
        let k = key(&p, &h, None, &[], "m", 1, None).unwrap();
        assert_eq!(k.tenant, None, "no session headers configured: none read");
        let k = key(&p, &h, None, &sessions(), "m", 1, None).unwrap();
        assert_eq!(k.tenant.as_deref(), Some("s1"), "the default list");
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn precedence_of_priority_tenant_and_objective() {
        let p = policy();
        let caller = Caller {
            priority: Some(5),
            tenant: Some("team-a".into()),
        };
        let k = key(&p, &headers(&[]), Some(&caller), &sessions(), "m", 10, None).unwrap();
        assert_eq!((k.priority, k.tenant.as_deref()), (5, Some("team-a")));
        assert_eq!(k.tokens, 10 + 256);
        let h = headers(&[(OBJECTIVE, "chat"), (TENANT, "forged")]);
        let k = key(&p, &h, Some(&caller), &sessions(), "m", 10, Some(4)).unwrap();
        assert_eq!(k.priority, 10, "the objective before the key's default");
        assert_eq!(k.slo_ttft_ms, Some(300));
        assert_eq!(
            k.tenant.as_deref(),
            Some("team-a"),
            "the key names the tenant"
        );
        assert_eq!(k.tokens, 14);
        let h = headers(&[(PRIORITY, "-3"), (OBJECTIVE, "chat"), (SLO_TTFT_MS, "50")]);
        let k = key(&p, &h, None, &sessions(), "m", 1, None).unwrap();
        assert_eq!((k.priority, k.slo_ttft_ms), (-3, Some(50)));
        let k = key(
            &p,
            &headers(&[(FAIRNESS_ID, "t9")]),
            None,
            &sessions(),
            "big",
            1,
            None,
        )
        .unwrap();
        assert_eq!((k.priority, k.tenant.as_deref()), (-1, Some("t9")));
        let h = headers(&[("x-session-id", "s1"), (OBJECTIVE, "unknown")]);
        let k = key(&p, &h, None, &sessions(), "m", 1, None).unwrap();
        assert_eq!((k.priority, k.tenant.as_deref()), (0, Some("s1")));
    }

    #[test]
    fn the_priority_is_appended_as_the_last_member() {
        let v = |b: &[u8], p| {
            let out = splice_priority(b, p).unwrap();
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            v["priority"].as_i64().unwrap()
        };
        assert_eq!(v(br#"{"model":"m"}"#, -10), -10);
        assert_eq!(v(b"{ }", 3), 3);
        assert_eq!(
            v(b"{\"priority\":99,\"a\":[1]}\n", 2),
            2,
            "ours is last: it wins"
        );
        assert!(splice_priority(b"[1]", 1).is_none());
        assert!(splice_priority(b"", 1).is_none());
        let mut cfg = crate::config::FlowControlConfig {
            enabled: true,
            ..Default::default()
        };
        cfg.forward_priority = vec!["vllm".into(), "sglang".into()];
        let p = FlowPolicy::new(&cfg);
        use kvgate_fleet::WorkerKind as K;
        assert_eq!(
            engine_priority(&p, K::Vllm, 10),
            Some(-10),
            "vLLM: lower first"
        );
        assert_eq!(engine_priority(&p, K::Sglang, 10), Some(10));
        assert_eq!(engine_priority(&p, K::Llamacpp, 10), None);
        assert_eq!(engine_priority(&FlowPolicy::default(), K::Vllm, 10), None);
    }

    #[test]
    fn bad_headers_are_400_and_off_means_default() {
        let p = policy();
        for h in [
            headers(&[(PRIORITY, "high")]),
            headers(&[(PRIORITY, "99999999999")]),
            headers(&[(SLO_TTFT_MS, "0")]),
            headers(&[(SLO_TTFT_MS, "-5")]),
        ] {
            let e = key(&p, &h, None, &sessions(), "m", 1, None).unwrap_err();
            assert_eq!(e.status(), http::StatusCode::BAD_REQUEST, "{e}");
        }
        let long = "x".repeat(300);
        let e = key(
            &p,
            &headers(&[(TENANT, &long)]),
            None,
            &sessions(),
            "m",
            1,
            None,
        )
        .unwrap_err();
        assert!(e.message.contains(TENANT), "{e}");
        let off = FlowPolicy::default();
        let k = key(
            &off,
            &headers(&[(PRIORITY, "high")]),
            None,
            &sessions(),
            "m",
            7,
            Some(1),
        )
        .unwrap();
        assert_eq!(
            k,
            FlowKey {
                tokens: 8,
                ..FlowKey::default()
            }
        );
    }
}
