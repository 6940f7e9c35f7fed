//! Helpers shared by the gateway's end-to-end tests: start mock workers and a gateway in-process on
//! port 0, and a tiny HTTP client.
#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvgate_gateway::config::{Config, WorkerConfig};
use kvgate_gateway::mock::MockHandle;
use kvgate_gateway::Gateway;
// Polling with a deadline (`eventually`, `poll_until`, ...) and ports: shared by every suite.
#[allow(unused_imports)]
pub use kvgate_testkit::*;

pub fn config_for(workers: &[&MockHandle], policy: &str) -> Config {
    let mut cfg = Config::default();
    cfg.server.listen = "127.0.0.1:0".parse().unwrap();
    cfg.server.request_log = false;
    cfg.routing.policy = policy.into();
    for w in workers {
        cfg.workers.push(WorkerConfig::from_url(&w.url()));
    }
    cfg
}

pub async fn gateway(cfg: Config) -> Gateway {
    Gateway::start(cfg).await.expect("gateway starts")
}

pub type TestClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub struct Resp {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub async fn send(c: &TestClient, req: Request<Full<Bytes>>) -> Resp {
    let resp: Response<_> = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .expect("response in time")
        .expect("request ok");
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("body in time")
        .expect("body ok")
        .to_bytes();
    Resp {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn post(c: &TestClient, url: &str, body: impl Into<Bytes>) -> Resp {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .unwrap();
    send(c, req).await
}

pub async fn get(c: &TestClient, url: &str) -> Resp {
    send(c, Request::get(url).body(Full::new(Bytes::new())).unwrap()).await
}

/// Assert the OpenAI error shape and return the error object.
pub fn assert_openai_error(r: &Resp, status: u16) -> serde_json::Value {
    assert_eq!(r.status.as_u16(), status, "body: {}", r.text());
    let j = r.json();
    let e = j["error"].clone();
    assert!(e["message"].is_string(), "{j}");
    assert!(e["type"].is_string(), "{j}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{j}");
    e
}

pub fn chat_body(system: &str, user: &str, stream: bool) -> String {
    serde_json::json!({
        "model": "mock-model",
        "stream": stream,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    })
    .to_string()
}

/// `promtool check metrics` on a scrape; skipped without promtool locally, a failure under CI.
pub fn promtool_check(text: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        if std::env::var_os("CI").is_some() {
            panic!("promtool not found (CI must install the prometheus package)");
        }
        eprintln!("skipped: promtool not installed");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A scripted worker: a one-request-per-connection HTTP/1.1 server on 127.0.0.1:0 that reads each
/// request's head and `content-length` body and hands the head (as text) and the connection to
/// `answer`, which writes whatever it likes. Stops accepting when `stop` fires.
pub async fn raw_worker<F, Fut>(
    stop: tokio_util::sync::CancellationToken,
    answer: F,
) -> std::net::SocketAddr
where
    F: Fn(String, tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    use tokio::io::AsyncReadExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let answer = std::sync::Arc::new(answer);
    tokio::spawn(async move {
        loop {
            let (mut s, _) = tokio::select! {
                _ = stop.cancelled() => return,
                r = l.accept() => match r { Ok(c) => c, Err(_) => return },
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                let len: usize = head
                    .to_ascii_lowercase()
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:")?.trim().parse().ok())
                    .unwrap_or(0);
                while buf.len() < head_end + len {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                answer(head, s).await;
            });
        }
    });
    addr
}
