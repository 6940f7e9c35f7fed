use super::*;
use crate::config::WorkerRole;

/// The two examples of llm-d's docs/discovery.md, as written there.
const LLMD_EXAMPLE: &str = r#"endpoints:
  - name: vllm-0
    address: "10.0.0.1"
    port: "8000"
    labels:
      model: llama-3-8b

  - name: vllm-1
    address: "10.0.0.2"
    port: "8000"
    labels:
      model: llama-3-8b
"#;

const LLMD_TP_EXAMPLE: &str = r#"endpoints:
  - name: tp-rank-0
    namespace: inference
    address: "192.168.1.10"
    port: "8000"
    labels:
      rank: "0"
      job: tp-job-42

  - name: tp-rank-1
    namespace: inference
    address: "192.168.1.11"
    port: "8000"
    labels:
      rank: "1"
      job: tp-job-42
"#;

#[test]
fn llm_d_examples_parse() {
    let e = parse(LLMD_EXAMPLE.as_bytes()).unwrap();
    assert_eq!(e.len(), 2);
    assert_eq!(e[0].name, "vllm-0");
    assert_eq!(e[0].namespace, "default");
    assert_eq!(e[0].addr, "10.0.0.1:8000".parse().unwrap());
    assert_eq!(e[1].labels["model"], "llama-3-8b");
    let t = parse(LLMD_TP_EXAMPLE.as_bytes()).unwrap();
    assert_eq!(t[1].namespace, "inference");
    assert_eq!(t[1].labels["rank"], "1");
    assert_eq!(t[1].labels["job"], "tp-job-42");
}

#[test]
fn json_and_yaml_styles_agree() {
    let json = r#"{"endpoints": [
        {"name": "a", "address": "10.0.0.1", "port": "8000", "labels": {"llm-d.ai/role": "decode"}},
        {"name": "b", "namespace": "ns", "address": "10.0.0.2", "port": 8001}
    ]}"#;
    let yaml = "# kvgate test\n---\nendpoints:\n- name: a   # first\n  address: 10.0.0.1\n  port: '8000'\n  labels: {llm-d.ai/role: decode}\n- {name: b, namespace: ns, address: \"10.0.0.2\", port: 8001}\n";
    let (j, y) = (
        parse(json.as_bytes()).unwrap(),
        parse(yaml.as_bytes()).unwrap(),
    );
    assert_eq!(j, y);
    let m = members(&j).unwrap();
    assert_eq!(m[0].role, Some(WorkerRole::Decode));
    assert_eq!(m[1].addr, "10.0.0.2:8001".parse().unwrap());
    assert_eq!(m[1].role, None);
}

#[test]
fn empty_lists_and_duplicates() {
    assert!(parse(b"endpoints: []\n").unwrap().is_empty());
    assert!(parse(b"endpoints:\n").unwrap().is_empty());
    // Same (namespace, name): the last entry wins, as llm-d's top-to-bottom upserts do.
    let e = parse(
        b"endpoints:\n  - name: a\n    address: 10.0.0.1\n    port: 1\n  - name: a\n    address: 10.0.0.2\n    port: 1\n  - name: a\n    namespace: other\n    address: 10.0.0.3\n    port: 1\n",
    )
    .unwrap();
    let addrs: Vec<String> = e.iter().map(|e| e.addr.to_string()).collect();
    assert_eq!(addrs, ["10.0.0.2:1", "10.0.0.3:1"]);
    // Two names on one address are one member.
    let e = parse(
        b"endpoints:\n- {name: a, address: 10.0.0.1, port: 1}\n- {name: b, address: 10.0.0.1, port: 1}\n",
    )
    .unwrap();
    assert_eq!(members(&e).unwrap().len(), 1);
}

#[test]
fn bad_files_are_refused_with_the_reason() {
    let big = vec![b' '; MAX_FILE_BYTES + 1];
    for (text, says) in [
        (&b""[..], "empty"),
        (b"   \n\n", "empty"),
        (b"\xff\xfe", "UTF-8"),
        (b"{\"endpoints\": [", "JSON"),
        (b"endpoint:\n- name: a\n", "unknown top-level key \"endpoint\""),
        (b"hosts: 1\n", "unknown top-level key"),
        (b"endpoints: 3\n", "must be a list"),
        (b"endpoints:\n- address: 10.0.0.1\n  port: 1\n", "`name` is required"),
        (b"endpoints:\n- name: a\n  port: 1\n", "`address` is required"),
        (b"endpoints:\n- name: a\n  address: 10.0.0.1\n", "`port` is required"),
        (b"endpoints:\n- name: a\n  address: fd00::1\n  port: 1\n", "not an IPv4"),
        (b"endpoints:\n- name: a\n  address: vllm.local\n  port: 1\n", "not an IPv4"),
        (b"endpoints:\n- name: a\n  address: 10.0.0.1\n  port: 0\n", "1 to 65535"),
        (b"endpoints:\n- name: a\n  address: 10.0.0.1\n  port: 70000\n", "1 to 65535"),
        (b"endpoints:\n- name: a\n  address: 10.0.0.1\n  port: +80\n", "1 to 65535"),
        (b"endpoints:\n- name: a\n  adress: 10.0.0.1\n  port: 1\n", "unknown key \"adress\""),
        (b"endpoints:\n- name: a\n  address: 10.0.0.1\n  port: 1\n  labels: [x]\n", "labels"),
        (b"endpoints:\n- name: a\n  address: 10.0.0.1\n  port: 1\n  labels:\n    llm-d.ai/role: leader\n", "llm-d.ai/role"),
        (b"endpoints:\n  - name: a\n     address: 10.0.0.1\n", "line 3: unexpected indentation"),
        (b"endpoints:\n\t- name: a\n", "line 2: tabs"),
        (b"endpoints: &list\n  - name: a\n", "anchors"),
        (b"endpoints:\n- name: a\n  address: \"10.0.0.1\n", "unterminated"),
        (b"endpoints: []\n---\nendpoints: []\n", "one YAML document"),
        (b"endpoints: []\nendpoints: []\n", "duplicate key"),
        (b"- a\n- b\n", "mapping with an `endpoints` list"),
        (&big[..], "1 MiB"),
    ] {
        let err = parse(text)
            .and_then(|e| members(&e).map(|_| e))
            .unwrap_err();
        assert!(
            err.contains(says),
            "{:?}: {err:?} should say {says:?}",
            String::from_utf8_lossy(&text[..text.len().min(60)])
        );
    }
}

#[test]
fn yaml_reader_handles_the_block_subset() {
    let v = yaml::parse(
        "a: 1\nb:\n  c: 'it''s'\n  d: \"x\\\"y\"\nl:\n- x\n-   y: 2\n    z: 3\n- [p, 'q']\ne: {}\nurl: http://h:1/p # comment\nhash: a#b\n",
    )
    .unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "a": "1",
            "b": {"c": "it's", "d": "x\"y"},
            "l": ["x", {"y": "2", "z": "3"}, ["p", "q"]],
            "e": {},
            "url": "http://h:1/p",
            "hash": "a#b",
        })
    );
}
