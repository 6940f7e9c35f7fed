//! llm-d's file-discovery endpoints file (`docs/discovery.md` of llm-d/llm-d-router, "Endpoints
//! file format"; read at commit 1ccadadd): YAML or JSON,
//!
//! ```yaml
//! endpoints:
//!   - name: vllm-0          # required, unique within its namespace (the last entry wins)
//!     namespace: inference  # optional, default "default"
//!     address: "10.0.0.1"   # required, a literal IPv4 address
//!     port: "8000"          # required, decimal 1-65535 (a string; a number is accepted too)
//!     labels:               # optional, string → string
//!       llm-d.ai/role: decode
//! ```
//!
//! at most 1 MiB. JSON is parsed by serde_json; YAML by [`yaml`], a reader for the block-style
//! subset such files use (mappings, sequences, plain and quoted scalars, comments, empty `{}` /
//! `[]` and flow collections of scalars), which refuses anchors, tags, multi-line scalars and
//! multiple documents with an error naming the line. Unknown keys are refused too (a misspelt
//! `adress` should not pass as a missing address).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};

use serde_json::Value;

use super::{role_from_labels, Member};

/// llm-d's limit on the file's size.
pub const MAX_FILE_BYTES: usize = 1 << 20;

/// One entry of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub name: String,
    pub namespace: String,
    pub addr: SocketAddr,
    pub labels: BTreeMap<String, String>,
}

impl Endpoint {
    pub fn member(&self) -> Result<Member, String> {
        let role = role_from_labels(self.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .map_err(|e| format!("endpoint {:?}: {e}", self.name))?;
        Ok(Member {
            addr: self.addr,
            role,
        })
    }
}

/// Parse a whole file: its endpoints, duplicates by (namespace, name) resolved as llm-d does (the
/// last one wins), in file order.
pub fn parse(text: &[u8]) -> Result<Vec<Endpoint>, String> {
    if text.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{} bytes: larger than the 1 MiB an endpoints file may have",
            text.len()
        ));
    }
    let text = std::str::from_utf8(text).map_err(|e| format!("not UTF-8: {e}"))?;
    let trimmed = text.trim_start_matches('\u{feff}').trim_start();
    if trimmed.is_empty() {
        // An empty file is what a writer that truncates before writing leaves for a moment: not
        // a pool without members (write `endpoints: []` for that).
        return Err("the file is empty (write `endpoints: []` for a pool without members)".into());
    }
    let doc: Value = if trimmed.starts_with('{') {
        serde_json::from_str(trimmed).map_err(|e| format!("JSON: {e}"))?
    } else {
        yaml::parse(text)?
    };
    let Value::Object(top) = doc else {
        return Err("expected a mapping with an `endpoints` list at the top".into());
    };
    let mut list = None;
    for (k, v) in top {
        match k.as_str() {
            "endpoints" => list = Some(v),
            other => {
                return Err(format!(
                    "unknown top-level key {other:?} (expected `endpoints`)"
                ))
            }
        }
    }
    let items = match list {
        Some(Value::Array(a)) => a,
        Some(Value::Null) => Vec::new(),
        Some(_) => return Err("`endpoints` must be a list".into()),
        None => return Err("no `endpoints` key".into()),
    };
    let mut out: Vec<Endpoint> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let e = endpoint(item).map_err(|e| format!("endpoints[{i}]: {e}"))?;
        out.retain(|o| (&o.namespace, &o.name) != (&e.namespace, &e.name));
        out.push(e);
    }
    Ok(out)
}

/// The members of a parsed file: sorted, one per address (two names on one address are one
/// worker; the later entry's role wins).
pub fn members(endpoints: &[Endpoint]) -> Result<Vec<Member>, String> {
    let mut by_addr = BTreeMap::new();
    for e in endpoints {
        let m = e.member()?;
        by_addr.insert(m.addr, m);
    }
    Ok(by_addr.into_values().collect())
}

fn endpoint(v: Value) -> Result<Endpoint, String> {
    let Value::Object(map) = v else {
        return Err("expected a mapping (name, address, port, ...)".into());
    };
    let (mut name, mut namespace, mut address, mut port, mut labels) =
        (None, None, None, None, BTreeMap::new());
    for (k, v) in map {
        match k.as_str() {
            "name" => name = Some(string(&k, v)?),
            "namespace" => namespace = Some(string(&k, v)?),
            "address" => address = Some(string(&k, v)?),
            "port" => {
                port = Some(match v {
                    Value::Number(n) => n.to_string(),
                    v => string(&k, v)?,
                })
            }
            "labels" => match v {
                Value::Object(l) => {
                    for (lk, lv) in l {
                        let lv = match lv {
                            Value::String(s) => s,
                            Value::Number(n) => n.to_string(),
                            Value::Bool(b) => b.to_string(),
                            _ => return Err(format!("label {lk:?} must be a string")),
                        };
                        labels.insert(lk, lv);
                    }
                }
                Value::Null => {}
                _ => return Err("`labels` must be a mapping of strings".into()),
            },
            other => {
                return Err(format!(
                    "unknown key {other:?} (expected name, namespace, address, port, labels)"
                ))
            }
        }
    }
    let name = name.filter(|n| !n.is_empty()).ok_or("`name` is required")?;
    let address = address.ok_or_else(|| format!("{name}: `address` is required"))?;
    let ip: Ipv4Addr = address
        .parse()
        .map_err(|_| format!("{name}: address {address:?} is not an IPv4 address"))?;
    let port = port.ok_or_else(|| format!("{name}: `port` is required"))?;
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0 && port.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| format!("{name}: port {port:?} is not a number from 1 to 65535"))?;
    Ok(Endpoint {
        name,
        namespace: namespace
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".into()),
        addr: SocketAddr::from((ip, port)),
        labels,
    })
}

fn string(key: &str, v: Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s),
        _ => Err(format!("`{key}` must be a string")),
    }
}

pub mod yaml;

#[cfg(test)]
mod tests;
