//! A scripted Kubernetes API server for tests of InferencePool pools: the list and watch
//! endpoints of InferencePools (`/apis/{group}/{version}/namespaces/{ns}/inferencepools`, with
//! `fieldSelector=metadata.name=`) and pods (`/api/v1/namespaces/{ns}/pods`, with
//! `labelSelector=k=v,...`), as the real one answers them: lists carry a `resourceVersion`,
//! watches replay what happened after the version they ask for, then stream `ADDED` /
//! `MODIFIED` / `DELETED` (by whether the object matched the watch's selector before and after
//! the change) and `BOOKMARK` events, one JSON object per line. The test changes objects and
//! scripts the failures a real server produces: an expired version (`410 Gone`), a dropped
//! connection, a watch the server ends, error statuses.
//!
//! ```no_run
//! # async fn f() -> anyhow::Result<()> {
//! use kvgate_gateway::mock::kube::MockKube;
//! let api = MockKube::start("inference.networking.k8s.io", "v1", "ns").await?;
//! api.set_pool(MockKube::pool_v1("p", &[("app", "vllm")], &[8000]));
//! api.put_pod(MockKube::pod("p-0", &[("app", "vllm")], "127.0.0.1", true));
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Pool,
    Pod,
}

/// One change, kept so a watch from an older version replays it.
struct Change {
    rv: u64,
    kind: Kind,
    old: Option<Value>,
    new: Option<Value>,
}

enum Msg {
    Line(Bytes),
    /// End the body cleanly (the server's `timeoutSeconds`).
    End,
    /// Break the connection (no last chunk).
    Drop,
}

struct Watch {
    kind: Kind,
    filter: Filter,
    tx: mpsc::UnboundedSender<Msg>,
}

#[derive(Clone, Debug, Default)]
enum Filter {
    #[default]
    All,
    Name(String),
    Labels(BTreeMap<String, String>),
}

impl Filter {
    fn matches(&self, o: &Value) -> bool {
        match self {
            Filter::All => true,
            Filter::Name(n) => o.pointer("/metadata/name").and_then(Value::as_str) == Some(n),
            Filter::Labels(sel) => sel.iter().all(|(k, v)| {
                o.pointer("/metadata/labels")
                    .and_then(|l| l.get(k))
                    .and_then(Value::as_str)
                    == Some(v.as_str())
            }),
        }
    }
}

#[derive(Default)]
struct State {
    rv: u64,
    /// Changes older than this are forgotten: a watch from before it gets `410 Gone`.
    compacted: u64,
    pools: BTreeMap<String, Value>,
    pods: BTreeMap<String, Value>,
    history: Vec<Change>,
    watches: Vec<Watch>,
    /// `path?query` and `authorization` of every request.
    requests: Vec<(String, Option<String>)>,
    /// Statuses to answer the next requests with, instead of serving them.
    fail_next: VecDeque<u16>,
}

impl State {
    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, kind: Kind, old: Option<Value>, new: Option<Value>) {
        let rv = self.rv;
        for w in self.watches.iter().filter(|w| w.kind == kind) {
            if let Some(line) = event_for(&w.filter, old.as_ref(), new.as_ref(), rv) {
                let _ = w.tx.send(Msg::Line(line));
            }
        }
        self.watches.retain(|w| !w.tx.is_closed());
        self.history.push(Change { rv, kind, old, new });
    }
}

/// The event a watch with `filter` sees for a change, as a line.
fn event_for(filter: &Filter, old: Option<&Value>, new: Option<&Value>, rv: u64) -> Option<Bytes> {
    let was = old.is_some_and(|o| filter.matches(o));
    let is = new.is_some_and(|n| filter.matches(n));
    let (ty, obj) = match (was, is) {
        (false, true) => ("ADDED", new?),
        (true, true) => ("MODIFIED", new?),
        (true, false) => ("DELETED", new.or(old)?),
        (false, false) => return None,
    };
    let mut obj = obj.clone();
    obj["metadata"]["resourceVersion"] = json!(rv.to_string());
    Some(line(&json!({"type": ty, "object": obj})))
}

fn line(v: &Value) -> Bytes {
    let mut s = serde_json::to_vec(v).unwrap_or_default();
    s.push(b'\n');
    Bytes::from(s)
}

/// A running mock API server.
pub struct MockKube {
    pub addr: SocketAddr,
    https: bool,
    group: String,
    version: String,
    namespace: String,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl MockKube {
    /// Serve InferencePools of `group`/`version` and pods in `namespace` on 127.0.0.1:0.
    pub async fn start(group: &str, version: &str, namespace: &str) -> anyhow::Result<MockKube> {
        Self::start_with(group, version, namespace, None).await
    }

    /// [`MockKube::start`] over TLS with this certificate (`url()` is then `https://`).
    pub async fn start_with(
        group: &str,
        version: &str,
        namespace: &str,
        tls: Option<&crate::config::TlsConfig>,
    ) -> anyhow::Result<MockKube> {
        let acceptor = tls.map(crate::tls::acceptor).transpose()?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            rv: 100,
            ..State::default()
        }));
        let stop = CancellationToken::new();
        let base = (
            format!("/apis/{group}/{version}/namespaces/{namespace}/inferencepools"),
            format!("/api/v1/namespaces/{namespace}/pods"),
        );
        let (st, s) = (stop.clone(), state.clone());
        let task = tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    _ = st.cancelled() => return,
                    r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
                };
                let (s, st, base) = (s.clone(), st.clone(), base.clone());
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let r = handle(&s, &base, req);
                        async move { Ok::<_, Infallible>(r) }
                    });
                    let builder =
                        hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    match acceptor {
                        None => {
                            let conn = builder.serve_connection(TokioIo::new(stream), svc);
                            tokio::select! {
                                _ = conn => {}
                                _ = st.cancelled() => {}
                            }
                        }
                        Some(a) => {
                            let Ok(tls) = a.accept(stream).await else {
                                return;
                            };
                            let conn = builder.serve_connection(TokioIo::new(tls), svc);
                            tokio::select! {
                                _ = conn => {}
                                _ = st.cancelled() => {}
                            }
                        }
                    }
                });
            }
        });
        Ok(MockKube {
            addr,
            https: tls.is_some(),
            group: group.into(),
            version: version.into(),
            namespace: namespace.into(),
            state,
            stop,
            task: Some(task),
        })
    }

    /// `http://127.0.0.1:PORT` (`https://` over TLS).
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// A v1 InferencePool object.
    pub fn pool_v1(name: &str, selector: &[(&str, &str)], ports: &[u16]) -> Value {
        let sel: serde_json::Map<String, Value> = selector
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": sel},
                "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
                "endpointPickerRef": {"name": format!("{name}-epp"), "port": {"number": 9002}},
            }
        })
    }

    /// A v1alpha2 InferencePool object.
    pub fn pool_v1alpha2(name: &str, selector: &[(&str, &str)], port: u16) -> Value {
        let sel: serde_json::Map<String, Value> = selector
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {"selector": sel, "targetPortNumber": port, "extensionRef": {"name": format!("{name}-epp")}}
        })
    }

    /// A pod with these labels, IP and `Ready` condition.
    pub fn pod(name: &str, labels: &[(&str, &str)], ip: &str, ready: bool) -> Value {
        let l: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": l},
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            }
        })
    }

    /// Create or replace an InferencePool.
    pub fn set_pool(&self, obj: Value) {
        let name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut s = self.state.lock();
        let rv = s.bump();
        let mut obj = obj;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        let old = s.pools.insert(name, obj.clone());
        s.record(Kind::Pool, old, Some(obj));
    }

    pub fn delete_pool(&self, name: &str) {
        let mut s = self.state.lock();
        if let Some(old) = s.pools.remove(name) {
            s.bump();
            s.record(Kind::Pool, Some(old), None);
        }
    }

    /// Create or replace a pod.
    pub fn put_pod(&self, obj: Value) {
        let name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut s = self.state.lock();
        let rv = s.bump();
        let mut obj = obj;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        let old = s.pods.insert(name, obj.clone());
        s.record(Kind::Pod, old, Some(obj));
    }

    pub fn delete_pod(&self, name: &str) {
        let mut s = self.state.lock();
        if let Some(old) = s.pods.remove(name) {
            s.bump();
            s.record(Kind::Pod, Some(old), None);
        }
    }

    /// Send a `BOOKMARK` at the current version to every watch.
    pub fn bookmark(&self) {
        let s = self.state.lock();
        let l = line(
            &json!({"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": s.rv.to_string()}}}),
        );
        for w in &s.watches {
            let _ = w.tx.send(Msg::Line(l.clone()));
        }
    }

    /// Forget the history (as etcd compaction does) and tell every watch `410 Gone`: watchers
    /// must list again.
    pub fn expire(&self) {
        let mut s = self.state.lock();
        s.compacted = s.rv + 1;
        s.history.clear();
        let gone = line(
            &json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "too old resource version", "reason": "Expired", "code": 410}}),
        );
        for w in s.watches.drain(..) {
            let _ = w.tx.send(Msg::Line(gone.clone()));
            let _ = w.tx.send(Msg::End);
        }
    }

    /// Break every watch connection (no clean end).
    pub fn drop_watches(&self) {
        for w in self.state.lock().watches.drain(..) {
            let _ = w.tx.send(Msg::Drop);
        }
    }

    /// End every watch cleanly (as the server does after `timeoutSeconds`).
    pub fn end_watches(&self) {
        for w in self.state.lock().watches.drain(..) {
            let _ = w.tx.send(Msg::End);
        }
    }

    /// Answer the next `n` requests with `status` (a Status body).
    pub fn fail_next(&self, n: usize, status: u16) {
        self.state
            .lock()
            .fail_next
            .extend(std::iter::repeat_n(status, n));
    }

    /// Watches open now on pods (`pods = true`) or InferencePools.
    pub fn watching(&self, pods: bool) -> usize {
        let want = if pods { Kind::Pod } else { Kind::Pool };
        let mut s = self.state.lock();
        s.watches.retain(|w| !w.tx.is_closed());
        s.watches.iter().filter(|w| w.kind == want).count()
    }

    /// Every request so far: `path?query` and its `authorization` header.
    pub fn requests(&self) -> Vec<(String, Option<String>)> {
        self.state.lock().requests.clone()
    }

    /// The API this mock serves: `(group, version, namespace)`.
    pub fn serves(&self) -> (&str, &str, &str) {
        (&self.group, &self.version, &self.namespace)
    }

    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for MockKube {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn status(code: u16, reason: &str, message: &str) -> Response<WatchBody> {
    let body = line(
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason, "code": code}),
    );
    let mut r = Response::new(WatchBody::full(body));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn handle(
    state: &Mutex<State>,
    base: &(String, String),
    req: Request<Incoming>,
) -> Response<WatchBody> {
    let path = req.uri().path().to_string();
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), decode(v)))
        .collect();
    let auth = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut s = state.lock();
    s.requests.push((req.uri().to_string(), auth));
    if let Some(code) = s.fail_next.pop_front() {
        return status(code, "InternalError", "scripted failure");
    }
    let kind = if path == base.0 {
        Kind::Pool
    } else if path == base.1 {
        Kind::Pod
    } else {
        return status(
            404,
            "NotFound",
            &format!("the server could not find the requested resource ({path})"),
        );
    };
    let filter = match kind {
        Kind::Pool => match query
            .get("fieldSelector")
            .and_then(|f| f.strip_prefix("metadata.name="))
        {
            Some(n) => Filter::Name(n.to_string()),
            None => Filter::All,
        },
        Kind::Pod => match query.get("labelSelector") {
            Some(sel) => Filter::Labels(
                sel.split(',')
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            None => Filter::All,
        },
    };
    if query.get("watch").is_some_and(|w| w == "1" || w == "true") {
        let from: u64 = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (tx, rx) = mpsc::unbounded_channel();
        if from + 1 < s.compacted {
            let gone = line(
                &json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": format!("too old resource version: {from}"), "reason": "Expired", "code": 410}}),
            );
            let _ = tx.send(Msg::Line(gone));
            let _ = tx.send(Msg::End);
        } else {
            for c in s.history.iter().filter(|c| c.kind == kind && c.rv > from) {
                if let Some(l) = event_for(&filter, c.old.as_ref(), c.new.as_ref(), c.rv) {
                    let _ = tx.send(Msg::Line(l));
                }
            }
            s.watches.push(Watch { kind, filter, tx });
        }
        let mut r = Response::new(WatchBody::stream(rx));
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        return r;
    }
    let items: Vec<Value> = match kind {
        Kind::Pool => s.pools.values(),
        Kind::Pod => s.pods.values(),
    }
    .filter(|o| filter.matches(o))
    .cloned()
    .collect();
    let list = json!({
        "kind": if kind == Kind::Pool { "InferencePoolList" } else { "PodList" },
        "apiVersion": "v1",
        "metadata": {"resourceVersion": s.rv.to_string()},
        "items": items,
    });
    let mut r = Response::new(WatchBody::full(line(&list)));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// A whole body, or a watch stream fed by the test.
pub struct WatchBody {
    full: Option<Bytes>,
    rx: Option<mpsc::UnboundedReceiver<Msg>>,
}

impl WatchBody {
    fn full(b: Bytes) -> WatchBody {
        WatchBody {
            full: Some(b),
            rx: None,
        }
    }
    fn stream(rx: mpsc::UnboundedReceiver<Msg>) -> WatchBody {
        WatchBody {
            full: None,
            rx: Some(rx),
        }
    }
}

impl http_body::Body for WatchBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(b) = this.full.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        let Some(rx) = this.rx.as_mut() else {
            return Poll::Ready(None);
        };
        match rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Msg::Line(l))) => Poll::Ready(Some(Ok(Frame::data(l)))),
            Poll::Ready(Some(Msg::End)) | Poll::Ready(None) => {
                this.rx = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Msg::Drop)) => {
                this.rx = None;
                Poll::Ready(Some(Err(std::io::Error::other("dropped by the test"))))
            }
        }
    }
}
