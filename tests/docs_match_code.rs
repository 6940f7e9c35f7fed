//! The docs match the code: every `kvgate_*` metric family the gateway registers is described in
//! docs/metrics.md, and every key of the gateway's config structs in docs/configuration.md. The
//! lists are read from the source, so a new metric or key without docs fails here, naming it.

use std::collections::BTreeSet;
use std::path::PathBuf;

fn root() -> PathBuf {
    kvgate_system_tests::repo_root()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// The source without its `#[cfg(test)]` module (tests mention exposition names like `_total`).
fn non_test(src: &str) -> &str {
    src.split("#[cfg(test)]").next().unwrap_or(src)
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Whether `word` occurs in `text` as a whole identifier, or followed by one of `suffixes`.
fn mentions(text: &str, word: &str, suffixes: &[&str]) -> bool {
    text.match_indices(word).any(|(i, _)| {
        let before_ok = text[..i].chars().next_back().is_none_or(|c| !is_ident(c));
        let rest = &text[i + word.len()..];
        let after_ok = rest.chars().next().is_none_or(|c| !is_ident(c))
            || suffixes.iter().any(|s| {
                rest.strip_prefix(s)
                    .is_some_and(|r| !r.starts_with(is_ident))
            });
        before_ok && after_ok
    })
}

/// Quoted `"kvgate_…"` names in the gateway's metrics source (the families it registers).
fn registered_metrics() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for file in [
        "crates/kvgate-gateway/src/metrics.rs",
        "crates/kvgate-cluster/src/metrics.rs",
    ] {
        let src = read(file);
        for (i, _) in non_test(&src).match_indices("\"kvgate_") {
            let name: String = src[i + 1..].chars().take_while(|c| is_ident(*c)).collect();
            if src[i + 1 + name.len()..].starts_with('"') {
                out.insert(name);
            }
        }
    }
    out
}

/// `pub field:` names of every serde-deserialized struct in the gateway's config.rs, as
/// `Struct.field`.
fn config_keys() -> BTreeSet<(String, String)> {
    let src = read("crates/kvgate-gateway/src/config.rs");
    let mut out = BTreeSet::new();
    let mut in_struct: Option<String> = None;
    let mut deserialize = false;
    for line in non_test(&src).lines() {
        let t = line.trim();
        if t.starts_with("#[derive(") {
            deserialize = t.contains("Deserialize");
        } else if let Some(rest) = t.strip_prefix("pub struct ") {
            if deserialize && rest.ends_with('{') {
                in_struct = Some(rest.trim_end_matches('{').trim().to_string());
            }
            deserialize = false;
        } else if t == "}" {
            in_struct = None;
        } else if let (Some(s), Some(rest)) = (&in_struct, t.strip_prefix("pub ")) {
            if let Some((field, _)) = rest.split_once(':') {
                out.insert((s.clone(), field.trim().to_string()));
            }
        }
    }
    out
}

#[test]
fn every_gateway_metric_is_documented() {
    let names = registered_metrics();
    assert!(
        names.len() >= 20 && names.contains("kvgate_requests"),
        "metric extraction broke: {names:?}"
    );
    let doc = read("docs/metrics.md");
    let suffixes = ["_total", "_bucket", "_sum", "_count", "_created", "_info"];
    let missing: Vec<_> = names
        .iter()
        .filter(|n| !mentions(&doc, n, &suffixes))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics registered in crates/kvgate-gateway/src/metrics.rs but not in docs/metrics.md: {missing:?}"
    );
}

#[test]
fn every_config_key_is_documented() {
    let keys = config_keys();
    let has = |s: &str, f: &str| keys.contains(&(s.to_string(), f.to_string()));
    assert!(
        has("Config", "worker_pools") && has("RoutingConfig", "block_size") && keys.len() >= 40,
        "config key extraction broke: {keys:?}"
    );
    // A key is documented when the first cell of a reference-table row names it (`key`,
    // `tls.cert`, `keys[].burst`); a top-level key when a heading names its table.
    let doc = read("docs/configuration.md");
    let first_cells: String = doc
        .lines()
        .filter_map(|l| l.trim().strip_prefix('|'))
        .filter_map(|l| l.split('|').next())
        .collect::<Vec<_>>()
        .join("\n");
    let headings: String = doc
        .lines()
        .filter(|l| l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let missing: Vec<String> = keys
        .iter()
        .filter(|(s, f)| {
            !(mentions(&first_cells, f, &[])
                || (s == "Config"
                    && (headings.contains(&format!("[{f}]"))
                        || headings.contains(&format!("[[{f}]]")))))
        })
        .map(|(s, f)| format!("{s}.{f}"))
        .collect();
    assert!(
        missing.is_empty(),
        "config keys in crates/kvgate-gateway/src/config.rs but not in docs/configuration.md: {missing:?}"
    );
}

#[test]
fn the_checks_can_fail() {
    assert!(mentions(
        "`kvgate_requests_total` counter",
        "kvgate_requests",
        &["_total"]
    ));
    assert!(!mentions(
        "kvgate_requests_extra",
        "kvgate_requests",
        &["_total"]
    ));
    assert!(!mentions("xkvgate_requests", "kvgate_requests", &[]));
    assert!(mentions(
        "see kvgate_queue_depth.",
        "kvgate_queue_depth",
        &[]
    ));
}
