//! The gateway's modules depend on each other one way: no module reaches back into one that
//! depends on it (src/lib.rs: each component gets its slice and its handle, no hub every module
//! reaches into). A module is a `src/NAME.rs` file with its `src/NAME/` folder; a dependency is a
//! `crate::NAME` path outside `#[cfg(test)]` code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn module_sources(src: &Path) -> BTreeMap<String, String> {
    let mut mods = BTreeMap::new();
    for entry in std::fs::read_dir(src).expect("src/") {
        let path = entry.expect("entry").path();
        let Some(name) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".rs"))
        else {
            continue;
        };
        if name == "lib" || name == "main" {
            continue;
        }
        let mut text = String::new();
        let mut files = vec![path.clone()];
        let dir = src.join(name);
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd {
                let p = e.expect("entry").path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    files.push(p);
                }
            }
        }
        for f in files {
            let s = std::fs::read_to_string(&f).expect("read");
            // Unit tests may reach anywhere.
            let s = s.split("#[cfg(test)]").next().unwrap_or("");
            text.push_str(s);
            text.push('\n');
        }
        mods.insert(name.to_string(), text);
    }
    mods
}

/// `crate::a` and `crate::{a, b::c}` references, by module name.
fn deps(text: &str, mods: &BTreeMap<String, String>, me: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end]
                .split(',')
                .map(|p| p.trim().split("::").next().unwrap_or(""))
                .collect()
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            vec![&rest[..end]]
        };
        for n in names {
            if n != me && mods.contains_key(n) {
                out.insert(n.to_string());
            }
        }
    }
    out
}

#[test]
fn gateway_modules_have_no_dependency_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mods = module_sources(&src);
    assert!(mods.len() > 10, "found the modules: {:?}", mods.keys());
    let graph: BTreeMap<&str, BTreeSet<String>> = mods
        .iter()
        .map(|(m, text)| (m.as_str(), deps(text, &mods, m)))
        .collect();
    // The proxy reaches the decision component: the parser found real edges.
    assert!(graph["proxy"].contains("route"), "{graph:?}");
    // Depth-first search for a back edge; report the cycle found.
    fn visit<'a>(
        m: &'a str,
        graph: &'a BTreeMap<&'a str, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| *p == m) {
            let mut cycle: Vec<String> = path[at..].iter().map(|s| s.to_string()).collect();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m);
        for d in &graph[m] {
            if let Some(c) = visit(d.as_str(), graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m);
        None
    }
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        let mut path = Vec::new();
        if let Some(cycle) = visit(m, &graph, &mut path, &mut done) {
            panic!("module cycle: {}", cycle.join(" -> "));
        }
    }
}

/// The text of `src/NAME.rs` and everything under `src/NAME/`, or of one file, without unit tests
/// and comments (a doc may name what the code must not use).
fn code_of(paths: &[std::path::PathBuf]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack: Vec<std::path::PathBuf> = paths.to_vec();
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            for e in std::fs::read_dir(&p).expect("dir") {
                stack.push(e.expect("entry").path());
            }
            continue;
        }
        if p.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let s = std::fs::read_to_string(&p).expect("read");
        let s = s.split("#[cfg(test)]").next().unwrap_or("");
        let code: String = s
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        out.push((p.display().to_string(), code));
    }
    out
}

#[test]
fn the_decision_component_uses_no_http_types() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = code_of(&[src.join("route.rs"), src.join("route")]);
    assert!(files.len() >= 3, "found {files:?}");
    let forbidden = [
        "http::",
        "hyper",
        "kvgate_http",
        "Request<",
        "Response<",
        "HeaderMap",
        "HeaderValue",
        "StatusCode",
        "AppState",
        "crate::proxy",
        "crate::server",
        "crate::body",
        "crate::error",
    ];
    for (path, code) in &files {
        for f in forbidden {
            assert!(
                !code.contains(f),
                "{path} uses `{f}`: the decision component must not depend on HTTP or the proxy"
            );
        }
    }
}

#[test]
fn only_the_route_table_and_the_admin_api_see_app_state() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    // The route table (server.rs and the endpoints it answers itself, api/), the admin API, the
    // config reload that applies a new config to every component, and the state's own files.
    let allowed = [
        "state.rs",
        "lib.rs",
        "server.rs",
        "admin.rs",
        "reload.rs",
        "api.rs",
        "api/",
    ];
    let files = code_of(std::slice::from_ref(&src));
    let mut seen = 0;
    for (path, code) in &files {
        let rel = path
            .strip_prefix(&format!("{}/", src.display()))
            .unwrap_or(path);
        if !code.contains("AppState") {
            continue;
        }
        seen += 1;
        assert!(
            allowed
                .iter()
                .any(|a| rel == *a || (a.ends_with('/') && rel.starts_with(a))),
            "{rel} sees AppState: pass it the component it needs instead"
        );
    }
    assert!(seen >= 4, "the scan found AppState's users ({seen})");
}
