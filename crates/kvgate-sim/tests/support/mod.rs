//! Shared helpers for the sim's integration tests: a tiny HTTP client and SSE reader.
#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

// Polling with a deadline, shared by every suite.
#[allow(unused_imports)]
pub use kvgate_testkit::{eventually, poll_until, until, PATIENCE};

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub async fn post_raw(c: &HttpClient, url: &str, body: &Value) -> (u16, hyper::body::Incoming) {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    let resp = c.request(req).await.expect("request failed");
    (resp.status().as_u16(), resp.into_body())
}

pub async fn post(c: &HttpClient, url: &str, body: &Value) -> (u16, Value) {
    let (st, b) = post_raw(c, url, body).await;
    let bytes = b.collect().await.unwrap().to_bytes();
    (st, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

pub async fn get_text(c: &HttpClient, url: &str) -> (u16, String, Option<String>) {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.expect("request failed");
    let st = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (st, String::from_utf8(bytes.to_vec()).unwrap(), ct)
}

/// Reads a whole SSE body into its `data:` payloads.
pub async fn sse_events(body: hyper::body::Incoming) -> Vec<String> {
    let bytes = body.collect().await.unwrap().to_bytes();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

/// A text prompt of `n` distinct words.
pub fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Token-id prompt: exact lengths, no tokenizer involved.
pub fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1000 + seed * 100_000 + i).collect()
}
