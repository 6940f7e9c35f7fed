//! `--policies` entries: `[LABEL=]POLICY[:KEY=VALUE]...`, e.g. `kv`, `kv:prefill_weight=4`,
//! `kv_pw4=kv:prefill_weight=4:temperature=0.1`. Each KEY=VALUE becomes a `[routing]` key of that
//! gateway's generated config (the gateway rejects unknown keys, so a typo fails loudly).
//! Prefill/decode fleets (`--prefill-workers`): `pd_KEY=VALUE` becomes a `[pd]` key
//! (`kv:pd_min_uncached_tokens=0`), and `unified=true` gives that gateway the same workers without
//! roles (one unified fleet of the same size).
//! Replicas (`--replicas`): `replicas=N` runs that entry as N gateways (overriding `--replicas`),
//! and `cluster=false` runs them without `[cluster]` (each routes on what it alone sees), so one
//! comparison holds "1 replica", "N replicas" and "N replicas sharing state over NATS".
//! `cluster_KEY=VALUE` becomes a `[cluster]` key of those replicas (`kv:cluster_provisional_window_ms=0`).
//! `server_KEY=VALUE` and `upstream_KEY=VALUE` become `[server]` and `[upstream]` keys of that
//! gateway (`kv:server_io_threads=1`, `kv:upstream_monitor=false`).

/// One gateway to compare.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// The row name in the table and JSON (default: the whole spec).
    pub label: String,
    /// `kvgate serve --policy`.
    pub policy: String,
    /// `[routing]` keys and their TOML values, in the order given.
    pub routing: Vec<(String, String)>,
    /// `[pd]` keys (given as `pd_KEY`) and their TOML values.
    pub pd: Vec<(String, String)>,
    /// `[server]` keys (given as `server_KEY`) and their TOML values.
    pub server: Vec<(String, String)>,
    /// `[upstream]` keys (given as `upstream_KEY`) and their TOML values.
    pub upstream: Vec<(String, String)>,
    /// Route a prefill/decode fleet as one unified fleet (no worker roles).
    pub unified: bool,
    /// Gateway replicas for this entry (`None`: `--replicas`).
    pub replicas: Option<usize>,
    /// Whether N > 1 replicas share state over NATS (`cluster=false`: they do not).
    pub cluster: bool,
    /// `[cluster]` keys (given as `cluster_KEY`) and their TOML values, for clustered replicas.
    pub cluster_keys: Vec<(String, String)>,
}

impl PolicySpec {
    pub fn parse(spec: &str) -> anyhow::Result<Self> {
        let bad = |why: &str| {
            anyhow::anyhow!(
                "bad --policies entry {spec:?}: {why} (expected [LABEL=]POLICY[:KEY=VALUE]...)"
            )
        };
        let mut parts = spec.split(':');
        let head = parts.next().unwrap_or_default();
        let (label, policy) = match head.split_once('=') {
            Some((l, p)) => (l.to_owned(), p),
            None => (spec.to_owned(), head),
        };
        if label.is_empty() || policy.is_empty() {
            return Err(bad("empty label or policy"));
        }
        if !policy
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(bad("the policy is a name like kv or round_robin"));
        }
        let mut routing = Vec::new();
        let mut pd = Vec::new();
        let mut server = Vec::new();
        let mut upstream = Vec::new();
        let mut unified = false;
        let mut replicas = None;
        let mut cluster = true;
        let mut cluster_keys = Vec::new();
        for kv in parts {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad("KEY=VALUE expected"))?;
            if k.is_empty() || !k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
                return Err(bad("keys are [routing] keys like prefill_weight"));
            }
            if v.is_empty() {
                return Err(bad("empty value"));
            }
            if k == "policy" {
                return Err(bad("give the policy before the first ':'"));
            }
            if k == "unified" {
                unified = v == "true";
            } else if k == "replicas" {
                match v.parse::<usize>() {
                    Ok(n) if n > 0 => replicas = Some(n),
                    _ => return Err(bad("replicas is a number > 0")),
                }
            } else if k == "cluster" {
                cluster = match v {
                    "true" => true,
                    "false" => false,
                    _ => return Err(bad("cluster is true or false")),
                };
            } else if let Some(ck) = k.strip_prefix("cluster_") {
                cluster_keys.push((ck.to_owned(), toml_value(v)));
            } else if let Some(pk) = k.strip_prefix("pd_") {
                pd.push((pk.to_owned(), toml_value(v)));
            } else if let Some(sk) = k.strip_prefix("server_") {
                server.push((sk.to_owned(), toml_value(v)));
            } else if let Some(uk) = k.strip_prefix("upstream_") {
                upstream.push((uk.to_owned(), toml_value(v)));
            } else {
                routing.push((k.to_owned(), toml_value(v)));
            }
        }
        Ok(Self {
            label,
            policy: policy.to_owned(),
            routing,
            pd,
            server,
            upstream,
            unified,
            replicas,
            cluster,
            cluster_keys,
        })
    }

    /// A file-name-safe form of the label (logs, generated configs).
    pub fn file_stem(&self) -> String {
        self.label
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }

    /// The `[routing]` (and `[pd]`, `[server]`, `[upstream]`) tables for the generated config, empty when there
    /// are no keys.
    pub fn routing_toml(&self) -> String {
        let mut t = String::new();
        for (table, keys) in [
            ("routing", &self.routing),
            ("pd", &self.pd),
            ("server", &self.server),
            ("upstream", &self.upstream),
        ] {
            if keys.is_empty() {
                continue;
            }
            t.push_str(&format!("\n[{table}]\n"));
            for (k, v) in keys {
                t.push_str(&format!("{k} = {v}\n"));
            }
        }
        t
    }
}

/// Numbers and booleans as they are, anything else as a TOML string.
fn toml_value(v: &str) -> String {
    if v == "true" || v == "false" || v.parse::<f64>().is_ok_and(f64::is_finite) {
        v.to_owned()
    } else {
        serde_json::to_string(v).expect("strings serialize")
    }
}

/// Parses every entry; labels must be unique (they name rows and files).
pub fn parse_all(specs: &[String]) -> anyhow::Result<Vec<PolicySpec>> {
    let parsed: Vec<PolicySpec> = specs
        .iter()
        .map(|s| PolicySpec::parse(s))
        .collect::<anyhow::Result<_>>()?;
    for (i, p) in parsed.iter().enumerate() {
        anyhow::ensure!(
            !parsed[..i]
                .iter()
                .any(|q| q.label == p.label || q.file_stem() == p.file_stem()),
            "--policies: two entries are named {:?}; give one a LABEL= prefix",
            p.label
        );
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_keyed_and_labelled_specs() {
        let p = PolicySpec::parse("kv").unwrap();
        assert_eq!((p.label.as_str(), p.policy.as_str()), ("kv", "kv"));
        assert!(p.routing.is_empty() && p.routing_toml().is_empty());

        let p = PolicySpec::parse("kv:prefill_weight=4:temperature=0.1").unwrap();
        assert_eq!(p.label, "kv:prefill_weight=4:temperature=0.1");
        assert_eq!(p.policy, "kv");
        assert_eq!(
            p.routing_toml(),
            "\n[routing]\nprefill_weight = 4\ntemperature = 0.1\n"
        );
        assert_eq!(p.file_stem(), "kv_prefill_weight_4_temperature_0.1");

        let p = PolicySpec::parse("pw4=kv:prefill_weight=4:tokenizer=x").unwrap();
        assert_eq!((p.label.as_str(), p.policy.as_str()), ("pw4", "kv"));
        assert_eq!(p.routing[1], ("tokenizer".into(), "\"x\"".into()));

        for bad in [
            "",
            "=kv",
            "l=",
            "kv:prefill_weight",
            "kv:=4",
            "kv:Weight=1",
            "kv:policy=rr",
            "k v",
        ] {
            let e = PolicySpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains("bad --policies entry"), "{bad}: {e}");
        }
    }

    #[test]
    fn pd_keys_and_unified() {
        let p = PolicySpec::parse("pd=kv:prefill_weight=2:pd_min_uncached_tokens=0").unwrap();
        assert!(!p.unified);
        assert_eq!(
            p.routing_toml(),
            "\n[routing]\nprefill_weight = 2\n\n[pd]\nmin_uncached_tokens = 0\n"
        );
        let p = PolicySpec::parse("one=kv:unified=true").unwrap();
        assert!(p.unified && p.routing_toml().is_empty());
        let p =
            PolicySpec::parse("t1=kv:server_io_threads=1:prefill_weight=2:upstream_monitor=false")
                .unwrap();
        assert_eq!(
            p.routing_toml(),
            "\n[routing]\nprefill_weight = 2\n\n[server]\nio_threads = 1\n\n[upstream]\nmonitor = false\n"
        );
    }

    #[test]
    fn replicas_and_cluster_keys() {
        let p = PolicySpec::parse("kv").unwrap();
        assert_eq!((p.replicas, p.cluster), (None, true));
        let p = PolicySpec::parse("solo=kv:replicas=1:prefill_weight=8").unwrap();
        assert_eq!((p.replicas, p.cluster), (Some(1), true));
        assert_eq!(p.routing_toml(), "\n[routing]\nprefill_weight = 8\n");
        let p = PolicySpec::parse("kv4=kv:replicas=4:cluster=false").unwrap();
        assert_eq!((p.replicas, p.cluster), (Some(4), false));
        assert!(p.routing_toml().is_empty());
        let p = PolicySpec::parse("kv4=kv:replicas=4:cluster_provisional_window_ms=0").unwrap();
        assert_eq!(
            p.cluster_keys,
            [("provisional_window_ms".into(), "0".into())]
        );
        assert!(p.routing_toml().is_empty());
        for bad in ["kv:replicas=0", "kv:replicas=x", "kv:cluster=no"] {
            let e = PolicySpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains("bad --policies entry"), "{bad}: {e}");
        }
    }

    #[test]
    fn duplicate_labels_are_rejected() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            parse_all(&s(&["kv", "kv:prefill_weight=4"])).unwrap().len(),
            2
        );
        assert!(parse_all(&s(&["kv", "kv"])).is_err());
        assert!(parse_all(&s(&["a=kv", "a=round_robin"])).is_err());
    }
}
