//! The parts of Kubernetes objects a pool needs: an InferencePool's selector and ports, a pod's
//! name, IP, readiness and role label.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde_json::Value;

use crate::config::WorkerRole;
use crate::worker_pools::{role_from_labels, Member};

/// `metadata.name`.
pub fn name(o: &Value) -> Option<&str> {
    o.pointer("/metadata/name").and_then(Value::as_str)
}

/// What an InferencePool says about its members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Labels a pod must carry (all of them).
    pub selector: BTreeMap<String, String>,
    /// Every pod is a member at each of these ports.
    pub ports: Vec<u16>,
}

impl PoolSpec {
    /// v1: `spec.selector.matchLabels` + `spec.targetPorts[].number`; v1alpha2: `spec.selector`
    /// (a plain map) + `spec.targetPortNumber`.
    pub fn from_object(o: &Value) -> Result<PoolSpec, String> {
        let n = name(o).unwrap_or("?");
        let spec = o
            .get("spec")
            .ok_or_else(|| format!("InferencePool {n}: no spec"))?;
        let sel = spec
            .get("selector")
            .and_then(Value::as_object)
            .ok_or_else(|| format!("InferencePool {n}: spec.selector missing"))?;
        let labels = match sel.get("matchLabels") {
            Some(Value::Object(m)) => {
                if sel.get("matchExpressions").is_some_and(|e| !e.is_null()) {
                    return Err(format!(
                        "InferencePool {n}: selector.matchExpressions is not supported (matchLabels only)"
                    ));
                }
                m
            }
            Some(_) => {
                return Err(format!(
                    "InferencePool {n}: selector.matchLabels must be a map"
                ))
            }
            None => sel,
        };
        let mut selector = BTreeMap::new();
        for (k, v) in labels {
            let v = v.as_str().ok_or_else(|| {
                format!("InferencePool {n}: selector value of {k:?} must be a string")
            })?;
            selector.insert(k.clone(), v.to_string());
        }
        if selector.is_empty() {
            return Err(format!(
                "InferencePool {n}: empty selector (it would select every pod of the namespace)"
            ));
        }
        let mut ports = Vec::new();
        match (spec.get("targetPorts"), spec.get("targetPortNumber")) {
            (Some(Value::Array(tp)), _) => {
                for p in tp {
                    ports.push(port(p.get("number"), n)?);
                }
            }
            (None, Some(p)) => ports.push(port(Some(p), n)?),
            _ => return Err(format!("InferencePool {n}: spec.targetPorts missing")),
        }
        ports.sort_unstable();
        ports.dedup();
        if ports.is_empty() {
            return Err(format!("InferencePool {n}: no target port"));
        }
        Ok(PoolSpec { selector, ports })
    }

    /// `k1=v1,k2=v2` (sorted), a `labelSelector` value.
    pub fn selector_query(&self) -> String {
        self.selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn port(v: Option<&Value>, pool: &str) -> Result<u16, String> {
    v.and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
        .ok_or_else(|| {
            format!("InferencePool {pool}: a target port must be a number from 1 to 65535")
        })
}

/// What a pod contributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    pub name: String,
    pub ip: Option<IpAddr>,
    /// `Ready=True`, and not being deleted.
    pub ready: bool,
    pub role: Option<WorkerRole>,
}

impl PodInfo {
    pub fn from_object(o: &Value) -> Result<PodInfo, String> {
        let name = name(o).ok_or("a pod without metadata.name")?.to_string();
        let ip = match o.pointer("/status/podIP").and_then(Value::as_str) {
            None | Some("") => None,
            Some(s) => Some(
                s.parse::<IpAddr>()
                    .map_err(|_| format!("pod {name}: status.podIP {s:?} is not an IP"))?,
            ),
        };
        let deleting = o
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|v| !v.is_null());
        let ready_cond = o
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.get("type").and_then(Value::as_str) == Some("Ready")
                        && c.get("status").and_then(Value::as_str) == Some("True")
                })
            });
        let labels = o.pointer("/metadata/labels").and_then(Value::as_object);
        let role = match labels {
            Some(l) => {
                let pairs = l
                    .iter()
                    .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)));
                match role_from_labels(pairs) {
                    Ok(r) => r,
                    Err(e) => {
                        // One mislabelled pod should not stop the others: it keeps the pool's role.
                        tracing::warn!(pod = %name, error = %e, "ignoring the pod's role label");
                        None
                    }
                }
            }
            None => None,
        };
        Ok(PodInfo {
            name,
            ip,
            ready: ready_cond && !deleting,
            role,
        })
    }
}

/// The members of these pods: every Ready pod with an IP, at each port; sorted, one per address.
pub fn pod_members<'a>(pods: impl Iterator<Item = &'a PodInfo>, ports: &[u16]) -> Vec<Member> {
    let mut out = BTreeMap::new();
    for p in pods {
        let (true, Some(ip)) = (p.ready, p.ip) else {
            continue;
        };
        for port in ports {
            let addr = SocketAddr::new(ip, *port);
            out.insert(addr, Member { addr, role: p.role });
        }
    }
    out.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub fn pod(name: &str, ip: &str, ready: bool) -> Value {
        json!({
            "metadata": {"name": name, "labels": {"app": "vllm"}, "resourceVersion": "1"},
            "status": {"podIP": ip, "conditions": [
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": if ready { "True" } else { "False" }}
            ]}
        })
    }

    #[test]
    fn v1_and_v1alpha2_pools() {
        let v1 = json!({"metadata": {"name": "p"}, "spec": {
            "selector": {"matchLabels": {"app": "vllm", "tier": "a"}},
            "targetPorts": [{"number": 8001}, {"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}});
        let s = PoolSpec::from_object(&v1).unwrap();
        assert_eq!(s.ports, [8000, 8001]);
        assert_eq!(s.selector_query(), "app=vllm,tier=a");
        let a2 = json!({"metadata": {"name": "p"}, "spec": {
            "selector": {"app": "vllm"}, "targetPortNumber": 8000,
            "extensionRef": {"name": "epp"}}});
        let s = PoolSpec::from_object(&a2).unwrap();
        assert_eq!(
            (s.ports.as_slice(), s.selector_query().as_str()),
            (&[8000u16][..], "app=vllm")
        );
        for (bad, says) in [
            (json!({"metadata": {"name": "p"}}), "no spec"),
            (json!({"spec": {"targetPortNumber": 1}}), "selector missing"),
            (
                json!({"spec": {"selector": {}, "targetPortNumber": 1}}),
                "empty selector",
            ),
            (
                json!({"spec": {"selector": {"matchLabels": {"a": "b"}, "matchExpressions": [{}]}, "targetPorts": [{"number": 1}]}}),
                "matchExpressions",
            ),
            (
                json!({"spec": {"selector": {"a": "b"}}}),
                "targetPorts missing",
            ),
            (
                json!({"spec": {"selector": {"a": "b"}, "targetPorts": [{"number": 0}]}}),
                "1 to 65535",
            ),
            (
                json!({"spec": {"selector": {"a": "b"}, "targetPorts": []}}),
                "no target port",
            ),
            (
                json!({"spec": {"selector": {"a": 1}, "targetPortNumber": 1}}),
                "must be a string",
            ),
        ] {
            let e = PoolSpec::from_object(&bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn only_ready_pods_with_an_ip_not_deleting_are_members() {
        let mut deleting = pod("d", "10.0.0.4", true);
        deleting["metadata"]["deletionTimestamp"] = json!("2026-11-27T12:00:00Z");
        let mut decode = pod("e", "10.0.0.5", true);
        decode["metadata"]["labels"]["llm-d.ai/role"] = json!("decode");
        let mut nocond = pod("f", "10.0.0.6", true);
        nocond["status"]["conditions"] = json!([]);
        let pods: Vec<PodInfo> = [
            pod("a", "10.0.0.1", true),
            pod("b", "10.0.0.2", false),
            pod("c", "", true),
            deleting,
            decode,
            nocond,
            pod("v6", "fd00::7", true),
        ]
        .iter()
        .map(|o| PodInfo::from_object(o).unwrap())
        .collect();
        let m = pod_members(pods.iter(), &[8000, 8001]);
        let addrs: Vec<String> = m.iter().map(|m| m.addr.to_string()).collect();
        assert_eq!(
            addrs,
            [
                "10.0.0.1:8000",
                "10.0.0.1:8001",
                "10.0.0.5:8000",
                "10.0.0.5:8001",
                "[fd00::7]:8000",
                "[fd00::7]:8001"
            ]
        );
        assert_eq!(m[2].role, Some(WorkerRole::Decode));
        assert!(PodInfo::from_object(&pod("x", "nope", true)).is_err());
        assert!(PodInfo::from_object(&json!({})).is_err());
    }
}
