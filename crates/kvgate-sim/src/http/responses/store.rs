//! The worker's stored responses, as vLLM 0.32 keeps them: plain maps in the serving process (here:
//! in each simulated worker), never expired, filled only when `VLLM_ENABLE_RESPONSES_API_STORE` is
//! on. `responses` (the response objects), `messages` (each stored response's input conversation,
//! vLLM's `msg_store`), `logs` (the event buffer of a background stream, for resuming) and `tasks`
//! (running background requests, for cancel).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use kvgate_protocol::agent::Message;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use crate::http::Body;

pub struct Store {
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`.
    pub enabled: bool,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    responses: HashMap<String, Value>,
    messages: HashMap<String, Vec<Message>>,
    logs: HashMap<String, Arc<EventLog>>,
    tasks: HashMap<String, tokio::task::AbortHandle>,
}

impl Store {
    pub fn new(enabled: bool) -> Self {
        Store {
            enabled,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn get(&self, id: &str) -> Option<Value> {
        self.inner.lock().responses.get(id).cloned()
    }

    pub fn messages(&self, id: &str) -> Option<Vec<Message>> {
        self.inner.lock().messages.get(id).cloned()
    }

    pub fn put(&self, id: &str, response: Value) {
        self.inner.lock().responses.insert(id.to_owned(), response);
    }

    pub fn put_messages(&self, id: &str, messages: Vec<Message>) {
        self.inner.lock().messages.insert(id.to_owned(), messages);
    }

    /// Stores a finished response unless it was cancelled meanwhile (vLLM keeps the cancelled one).
    pub fn finish(&self, id: &str, response: Value) {
        let mut g = self.inner.lock();
        let cancelled = g
            .responses
            .get(id)
            .is_some_and(|r| r["status"] == "cancelled");
        if !cancelled {
            g.responses.insert(id.to_owned(), response);
        }
        g.tasks.remove(id);
    }

    /// A background request ended without an answer: `failed`, unless it completed or was
    /// cancelled (vLLM's `_run_background_request`).
    pub fn fail(&self, id: &str) {
        let mut g = self.inner.lock();
        if let Some(r) = g.responses.get_mut(id) {
            if r["status"] != "completed" && r["status"] != "cancelled" {
                r["status"] = Value::from("failed");
            }
        }
        g.tasks.remove(id);
    }

    pub fn add_log(&self, id: &str) -> Arc<EventLog> {
        let log = Arc::new(EventLog::new());
        self.inner.lock().logs.insert(id.to_owned(), log.clone());
        log
    }

    pub fn log(&self, id: &str) -> Option<Arc<EventLog>> {
        self.inner.lock().logs.get(id).cloned()
    }

    pub fn add_task(&self, id: &str, task: tokio::task::AbortHandle) {
        self.inner.lock().tasks.insert(id.to_owned(), task);
    }

    /// vLLM's cancel: only a `queued` / `in_progress` response; marks it `cancelled` and stops its
    /// background task (which aborts the engine request). `Err(None)`: unknown id;
    /// `Err(Some(status))`: not cancellable.
    pub fn cancel(&self, id: &str) -> Result<Value, Option<String>> {
        let (resp, task, log) = {
            let mut g = self.inner.lock();
            let Some(r) = g.responses.get_mut(id) else {
                return Err(None);
            };
            let status = r["status"].as_str().unwrap_or_default().to_owned();
            if status != "queued" && status != "in_progress" {
                return Err(Some(status));
            }
            r["status"] = Value::from("cancelled");
            let resp = r.clone();
            (resp, g.tasks.remove(id), g.logs.get(id).cloned())
        };
        if let Some(t) = task {
            t.abort();
        }
        if let Some(log) = log {
            log.close();
        }
        Ok(resp)
    }

    /// Removes a stored response (OpenAI's DELETE; vLLM has no such route, see docs/sim.md).
    pub fn delete(&self, id: &str) -> bool {
        let mut g = self.inner.lock();
        let found = g.responses.remove(id).is_some();
        g.messages.remove(id);
        g.logs.remove(id);
        if let Some(t) = g.tasks.remove(id) {
            t.abort();
        }
        found
    }
}

/// The events of one background stream, kept for `GET ...?stream=true&starting_after=N`.
pub struct EventLog {
    frames: Mutex<Vec<Bytes>>,
    /// Frames written so far; `closed` once no more will come.
    version: watch::Sender<(usize, bool)>,
}

impl EventLog {
    fn new() -> Self {
        EventLog {
            frames: Mutex::new(Vec::new()),
            version: watch::channel((0, false)).0,
        }
    }

    pub fn push(&self, frame: Bytes) {
        let n = {
            let mut f = self.frames.lock();
            f.push(frame);
            f.len()
        };
        self.version.send_modify(|v| v.0 = n);
    }

    pub fn close(&self) {
        self.version.send_modify(|v| v.1 = true);
    }

    /// A body replaying the frames from index `from` (= sequence number) and following new ones
    /// until the log closes. (vLLM waits forever on a cancelled stream's buffer; this one ends.)
    pub fn follow(self: &Arc<Self>, from: usize) -> Body {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        let log = self.clone();
        let mut seen = log.version.subscribe();
        tokio::spawn(async move {
            let mut next = from;
            loop {
                let (n, closed) = *seen.borrow_and_update();
                let batch: Vec<Bytes> = {
                    let f = log.frames.lock();
                    f.get(next.min(n)..n)
                        .map(<[Bytes]>::to_vec)
                        .unwrap_or_default()
                };
                next = next.max(n);
                for b in batch {
                    if tx.send(b).is_err() {
                        return; // the reader is gone
                    }
                }
                if closed || seen.changed().await.is_err() {
                    return;
                }
            }
        });
        crate::http::stream::channel_body(rx)
    }
}
