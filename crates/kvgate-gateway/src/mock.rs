//! A minimal OpenAI-compatible mock worker for tests and the overhead benchmark: configurable TTFT,
//! inter-token latency, token count, a forced status, death mid-stream, and a record of what it
//! received (to check byte-exact forwarding and cancellation).
//!
//! ```no_run
//! # async fn f() -> anyhow::Result<()> {
//! use std::time::Duration;
//! let w = kvgate_gateway::mock::MockWorker::builder().ttft(Duration::from_millis(5)).tokens(8).spawn().await?;
//! println!("mock worker at {}", w.addr);
//! # Ok(()) }
//! ```
//!
//! It parses nothing: `"stream":true` and `"include_usage":true` are found by byte search, so it
//! costs next to nothing per request (the benchmark's "direct" baseline).

pub mod kube;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use memchr::memmem;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug)]
pub struct MockConfig {
    pub models: Vec<String>,
    pub ttft: Duration,
    pub itl: Duration,
    pub tokens: usize,
    /// Answer every completion request with this status (and an OpenAI error body).
    pub status: Option<u16>,
    /// The error message of those answers (default `mock status <code>`).
    pub error_message: Option<String>,
    /// Streams: abort the connection after this many token events.
    pub die_after: Option<usize>,
    /// Report this many cached prompt tokens in usage.
    pub cached_tokens: u64,
    /// Streams: send every event in pieces of at most this many bytes (lines split across chunks).
    pub chunk_bytes: Option<usize>,
    /// Keep every request for [`MockHandle::received`] (tests). Off for long runs: the list
    /// grows with every request (the benchmark's mock ran out of memory with it).
    pub record: bool,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            models: vec!["mock-model".into()],
            ttft: Duration::ZERO,
            itl: Duration::ZERO,
            tokens: 4,
            status: None,
            error_message: None,
            die_after: None,
            cached_tokens: 0,
            chunk_bytes: None,
            record: true,
        }
    }
}

pub struct MockWorker;

impl MockWorker {
    pub fn builder() -> MockBuilder {
        MockBuilder {
            cfg: MockConfig::default(),
            addr: "127.0.0.1:0".parse().expect("addr"),
        }
    }
}

pub struct MockBuilder {
    cfg: MockConfig,
    addr: SocketAddr,
}

impl MockBuilder {
    pub fn models(mut self, m: &[&str]) -> Self {
        self.cfg.models = m.iter().map(|s| s.to_string()).collect();
        self
    }
    pub fn ttft(mut self, d: Duration) -> Self {
        self.cfg.ttft = d;
        self
    }
    pub fn itl(mut self, d: Duration) -> Self {
        self.cfg.itl = d;
        self
    }
    pub fn tokens(mut self, n: usize) -> Self {
        self.cfg.tokens = n;
        self
    }
    pub fn status(mut self, s: u16) -> Self {
        self.cfg.status = Some(s);
        self
    }
    pub fn error_message(mut self, m: &str) -> Self {
        self.cfg.error_message = Some(m.to_string());
        self
    }
    pub fn die_after(mut self, n: usize) -> Self {
        self.cfg.die_after = Some(n);
        self
    }
    pub fn cached_tokens(mut self, n: u64) -> Self {
        self.cfg.cached_tokens = n;
        self
    }
    pub fn chunk_bytes(mut self, n: usize) -> Self {
        self.cfg.chunk_bytes = Some(n.max(1));
        self
    }

    /// Whether requests are kept for [`MockHandle::received`] (default true).
    pub fn record(mut self, on: bool) -> Self {
        self.cfg.record = on;
        self
    }

    pub fn addr(mut self, a: SocketAddr) -> Self {
        self.addr = a;
        self
    }
    pub async fn spawn(self) -> anyhow::Result<MockHandle> {
        let listener = tokio::net::TcpListener::bind(self.addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            cfg: self.cfg,
            requests: Mutex::new(Vec::new()),
            active_streams: AtomicUsize::new(0),
            completions: AtomicUsize::new(0),
        });
        let stop = CancellationToken::new();
        let (s, st) = (shared.clone(), stop.clone());
        let task = tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    _ = st.cancelled() => return,
                    r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
                };
                let _ = stream.set_nodelay(true);
                let s = s.clone();
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let s = s.clone();
                        async move { Ok::<_, Infallible>(handle(s, req).await) }
                    });
                    let builder =
                        hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = st.cancelled() => {}
                    }
                });
            }
        });
        Ok(MockHandle {
            addr,
            shared,
            stop,
            task: Some(task),
        })
    }
}

struct Shared {
    cfg: MockConfig,
    requests: Mutex<Vec<Received>>,
    active_streams: AtomicUsize,
    completions: AtomicUsize,
}

/// A request as the mock received it.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

pub struct MockHandle {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl MockHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Requests received so far (completions, chat and embeddings; not `/v1/models`).
    pub fn received(&self) -> Vec<Received> {
        self.shared.requests.lock().clone()
    }
    pub fn completions(&self) -> usize {
        self.shared.completions.load(Ordering::Relaxed)
    }
    /// Streams still being produced (drops to 0 when the gateway cancels them).
    pub fn active_streams(&self) -> usize {
        self.shared.active_streams.load(Ordering::Relaxed)
    }
    /// Stop accepting and close every connection.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for MockHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn handle(s: Arc<Shared>, req: Request<Incoming>) -> Response<MockBody> {
    let path = req.uri().path().to_string();
    if path == "/v1/models" {
        let data: Vec<_> = s
            .cfg
            .models
            .iter()
            .map(|m| serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": "mock"}))
            .collect();
        return json(
            StatusCode::OK,
            serde_json::to_vec(&serde_json::json!({"object":"list","data":data}))
                .unwrap_or_default(),
        );
    }
    if path == "/health" {
        return json(StatusCode::OK, b"{}".to_vec());
    }
    if !matches!(
        path.as_str(),
        "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings"
    ) {
        return json(
            StatusCode::NOT_FOUND,
            br#"{"error":{"message":"not found","type":"not_found","param":null,"code":404}}"#
                .to_vec(),
        );
    }
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    if s.cfg.record {
        s.requests.lock().push(Received {
            path: path.clone(),
            headers: parts.headers,
            body: body.clone(),
        });
    }
    s.completions.fetch_add(1, Ordering::Relaxed);
    if let Some(code) = s.cfg.status {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let message = s
            .cfg
            .error_message
            .clone()
            .unwrap_or_else(|| format!("mock status {code}"));
        let message = serde_json::Value::String(message);
        let e = format!(
            r#"{{"error":{{"message":{message},"type":"server_error","param":null,"code":{code}}}}}"#
        );
        return json(status, e.into_bytes());
    }
    let model = s.cfg.models.first().cloned().unwrap_or_default();
    let prompt_tokens = body.len() as u64 / 4;
    let usage = format!(
        r#"{{"prompt_tokens":{prompt_tokens},"completion_tokens":{},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":{}}}}}"#,
        s.cfg.tokens,
        prompt_tokens + s.cfg.tokens as u64,
        s.cfg.cached_tokens.min(prompt_tokens)
    );
    if path == "/v1/embeddings" {
        let b = format!(
            r#"{{"object":"list","data":[{{"object":"embedding","index":0,"embedding":[0.1,0.2]}}],"model":"{model}","usage":{usage}}}"#
        );
        return json(StatusCode::OK, b.into_bytes());
    }
    let chat = path == "/v1/chat/completions";
    let stream = memmem::find(&body, b"\"stream\":true").is_some()
        || memmem::find(&body, b"\"stream\": true").is_some();
    let include_usage = memmem::find(&body, b"\"include_usage\":true").is_some()
        || memmem::find(&body, b"\"include_usage\": true").is_some();
    if !stream {
        if !s.cfg.ttft.is_zero() || !s.cfg.itl.is_zero() {
            tokio::time::sleep(s.cfg.ttft + s.cfg.itl * s.cfg.tokens.saturating_sub(1) as u32)
                .await;
        }
        let text = "tok ".repeat(s.cfg.tokens);
        let b = if chat {
            format!(
                r#"{{"id":"chatcmpl-mock","object":"chat.completion","created":0,"model":"{model}","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"length"}}],"usage":{usage}}}"#
            )
        } else {
            format!(
                r#"{{"id":"cmpl-mock","object":"text_completion","created":0,"model":"{model}","choices":[{{"index":0,"text":"{text}","finish_reason":"length"}}],"usage":{usage}}}"#
            )
        };
        return json(StatusCode::OK, b.into_bytes());
    }
    let (tx, rx) = mpsc::channel(16);
    let cfg = s.cfg.clone();
    s.active_streams.fetch_add(1, Ordering::Relaxed);
    let s2 = s.clone();
    tokio::spawn(async move {
        struct Active(Arc<Shared>);
        impl Drop for Active {
            fn drop(&mut self) {
                self.0.active_streams.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let _active = Active(s2);
        tokio::time::sleep(cfg.ttft).await;
        for i in 0..cfg.tokens {
            if i > 0 {
                tokio::time::sleep(cfg.itl).await;
            }
            if cfg.die_after == Some(i) {
                let _ = tx
                    .send(Err(std::io::Error::other("mock worker died")))
                    .await;
                return;
            }
            let ev = if chat {
                let delta = if i == 0 {
                    r#"{"role":"assistant","content":"tok "}"#
                } else {
                    r#"{"content":"tok "}"#
                };
                format!(
                    r#"data: {{"id":"chatcmpl-mock","object":"chat.completion.chunk","created":0,"model":"{model}","choices":[{{"index":0,"delta":{delta},"finish_reason":null}}]{}}}"#,
                    if include_usage {
                        r#","usage":null"#
                    } else {
                        ""
                    }
                )
            } else {
                format!(
                    r#"data: {{"id":"cmpl-mock","object":"text_completion","created":0,"model":"{model}","choices":[{{"index":0,"text":"tok ","finish_reason":null}}]}}"#
                )
            };
            if !send_event(&tx, ev + "\n\n", cfg.chunk_bytes).await {
                return; // client (the gateway) went away: stop generating
            }
        }
        if include_usage {
            let obj = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let ev = format!("data: {{\"id\":\"mock\",\"object\":\"{obj}\",\"created\":0,\"model\":\"{model}\",\"choices\":[],\"usage\":{usage}}}\n\n");
            if !send_event(&tx, ev, cfg.chunk_bytes).await {
                return;
            }
        }
        send_event(&tx, "data: [DONE]\n\n".into(), cfg.chunk_bytes).await;
    });
    let mut r = Response::new(MockBody::Stream(rx));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// Send one event, whole or in pieces of `chunk` bytes; false once the receiver is gone.
async fn send_event(
    tx: &mpsc::Sender<Result<Bytes, std::io::Error>>,
    ev: String,
    chunk: Option<usize>,
) -> bool {
    let ev = Bytes::from(ev);
    let n = chunk.unwrap_or(ev.len()).max(1);
    let mut at = 0;
    while at < ev.len() {
        let end = (at + n).min(ev.len());
        if tx.send(Ok(ev.slice(at..end))).await.is_err() {
            return false;
        }
        at = end;
    }
    true
}

fn json(status: StatusCode, body: Vec<u8>) -> Response<MockBody> {
    let mut r = Response::new(MockBody::Full(Some(Bytes::from(body))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub enum MockBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Result<Bytes, std::io::Error>>),
}

impl http_body::Body for MockBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            MockBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            MockBody::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data))),
        }
    }

    // A whole JSON body goes out with a content-length, as real engines (uvicorn, llama.cpp's
    // httplib) send non-streamed answers; streams are chunked.
    fn is_end_stream(&self) -> bool {
        matches!(self, MockBody::Full(None))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            MockBody::Full(b) => {
                http_body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            MockBody::Stream(_) => http_body::SizeHint::default(),
        }
    }
}
