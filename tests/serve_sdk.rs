//! End-to-end through the real binaries: `kvgate sim --workers 3` + `kvgate serve`, driven by the
//! official `openai` Python SDK ($KVGATE_PYTHON) and raw HTTP. Needs Python with `openai`: skipped
//! locally without it, a failure in CI.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use kvgate_system_tests::{Proc, Sims};
use std::time::{Duration, Instant};

/// Read lines from `r` until `f` returns Some, or panic after `within`.
fn wait_line<R: BufRead>(
    r: &mut R,
    within: Duration,
    mut f: impl FnMut(&str) -> Option<String>,
) -> String {
    let end = Instant::now() + within;
    let mut line = String::new();
    while Instant::now() < end {
        line.clear();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        if let Some(v) = f(line.trim()) {
            return v;
        }
    }
    panic!("expected line not seen (last: {line:?})");
}

const SDK_SCRIPT: &str = r#"
import json, sys, openai
base = sys.argv[1]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
out = {}
r = c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=8)
out["chat"] = {"content": r.choices[0].message.content, "completion_tokens": r.usage.completion_tokens}
chunks = list(c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "stream please"}],
    max_tokens=8, stream=True, stream_options={"include_usage": True}))
out["chat_stream"] = {"chunks": len(chunks), "usage": chunks[-1].usage.completion_tokens if chunks[-1].usage else None,
    "text": "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)}
r = c.completions.create(model="sim-model", prompt="once upon a time", max_tokens=6)
out["completion"] = {"text": r.choices[0].text, "completion_tokens": r.usage.completion_tokens}
chunks = list(c.completions.create(model="sim-model", prompt=[1, 2, 3, 4, 5], max_tokens=6, stream=True))
out["completion_stream"] = {"chunks": len(chunks)}
try:
    c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    out["unknown_model"] = "no error"
except openai.NotFoundError as e:
    out["unknown_model"] = e.status_code
try:
    c.post("/chat/completions", body=None, cast_to=object, options={"headers": {"content-type": "application/json"}})
    out["bad_body"] = "no error"
except openai.BadRequestError as e:
    out["bad_body"] = e.status_code
print(json.dumps(out))
"#;

#[test]
fn openai_sdk_through_kvgate_serve_and_three_sims() {
    let Some(py) = kvgate_system_tests::python_with("openai") else {
        return;
    };
    let bin = kvgate_system_tests::kvgate_bin();
    let sims = Sims::start(3, "sim-model", &[]);
    let urls = &sims.urls;

    let mut serve = Command::new(&bin)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            "kv",
            "--no-request-log",
            "--worker",
            &urls.join(","),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate serve starts");
    let mut serve_err = BufReader::new(serve.stderr.take().unwrap());
    let _serve = Proc(serve);
    let base = wait_line(&mut serve_err, Duration::from_secs(20), |l| {
        l.strip_prefix("kvgate serve: listening on ")
            .map(str::to_string)
    });
    // Keep draining stderr so the gateway never blocks on a full pipe.
    std::thread::spawn(move || for _ in serve_err.lines() {});

    let out = Command::new(&py)
        .args(["-c", SDK_SCRIPT, &base])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "sdk script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json from script");
    assert!(j["chat"]["completion_tokens"].as_u64().unwrap() > 0, "{j}");
    assert!(j["chat_stream"]["chunks"].as_u64().unwrap() >= 2, "{j}");
    assert!(j["chat_stream"]["usage"].as_u64().unwrap() > 0, "{j}");
    assert!(
        j["completion"]["completion_tokens"].as_u64().unwrap() > 0,
        "{j}"
    );
    assert!(
        j["completion_stream"]["chunks"].as_u64().unwrap() >= 1,
        "{j}"
    );
    assert_eq!(j["unknown_model"], 404, "{j}");
    assert_eq!(j["bad_body"], 400, "{j}");
    drop(sims);
}
