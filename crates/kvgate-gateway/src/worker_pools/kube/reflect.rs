//! The list+watch loop ("reflector") of one resource: list, then watch from the list's
//! version; bookmarks and events move the version on; a watch that ends or breaks resumes from
//! it; `410 Gone` lists again; errors back off.

use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::{api, Api, ApiError, Settings};
use crate::worker_pools::{Event, Report};

/// Exponential backoff with jitter.
pub(super) struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    pub(super) fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            next: min,
            min,
            max,
        }
    }

    pub(super) fn reset(&mut self) {
        self.next = self.min;
    }

    /// Sleep the next delay (or until `stop`); false when stopped.
    pub(super) async fn wait(&mut self, stop: &CancellationToken) -> bool {
        let jitter = 0.8 + 0.4 * fastrand::f64();
        let d = self.next.mul_f64(jitter);
        self.next = (self.next * 2).min(self.max);
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(d) => true,
        }
    }
}

/// What a reflector keeps: a replaced list, then events.
pub(super) trait Store {
    /// The objects of a fresh list.
    fn replace(&mut self, items: Vec<Value>) -> Result<(), String>;
    /// One watch event (`ADDED`, `MODIFIED`, `DELETED`).
    fn apply(&mut self, kind: &str, obj: Value) -> Result<(), String>;
}

/// The resourceVersion of an object or list.
pub(super) fn resource_version(v: &Value) -> Option<String> {
    v.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// List then watch `path?query` into `store` until `stop` (returns only then).
pub(super) async fn reflect(
    api: &Api,
    s: &Settings,
    path: &str,
    query: &str,
    store: &mut (dyn Store + Send),
    report: &Report,
    stop: &CancellationToken,
) {
    let mut backoff = Backoff::new(s.backoff_min, s.backoff_max);
    'relist: loop {
        if stop.is_cancelled() {
            return;
        }
        let list = match api.get_json(&format!("{path}?{query}")).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(path, error = %e, "Kubernetes list failed");
                report(Event::Error(e.kind()));
                if !backoff.wait(stop).await {
                    return;
                }
                continue;
            }
        };
        let items = match list.get("items") {
            Some(Value::Array(a)) => a.clone(),
            Some(Value::Null) | None => Vec::new(),
            Some(_) => {
                tracing::warn!(path, "Kubernetes list without an items array");
                report(Event::Error("invalid_object"));
                if !backoff.wait(stop).await {
                    return;
                }
                continue;
            }
        };
        let mut rv = resource_version(&list).unwrap_or_default();
        if let Err(e) = store.replace(items) {
            tracing::warn!(path, error = %e, "Kubernetes object rejected");
            report(Event::Error("invalid_object"));
        }
        backoff.reset();
        // Watch from `rv`, resuming after every end, until a 410 sends us back to the list.
        loop {
            let timeout = s.watch_timeout.as_secs().max(1);
            let q = format!(
                "{query}&watch=1&allowWatchBookmarks=true&resourceVersion={}&timeoutSeconds={timeout}",
                api::encode(&rv)
            );
            let mut stream = match api.watch(&format!("{path}?{q}")).await {
                Ok(st) => st,
                Err(ApiError::Status(410, _)) => {
                    report(Event::Error("gone"));
                    continue 'relist;
                }
                Err(e) => {
                    tracing::warn!(path, error = %e, "Kubernetes watch failed");
                    report(Event::Error(e.kind()));
                    if !backoff.wait(stop).await {
                        return;
                    }
                    continue;
                }
            };
            let idle = s.watch_timeout + Duration::from_secs(30);
            let opened = tokio::time::Instant::now();
            let mut events = 0u64;
            loop {
                let ev = tokio::select! {
                    _ = stop.cancelled() => return,
                    ev = stream.next(idle) => ev,
                };
                let ev = match ev {
                    Ok(Some(ev)) => ev,
                    Ok(None) => {
                        // The server's timeout ends a watch after minutes; one that ends at once
                        // and empty (a proxy in the way, a server shedding load) is retried with
                        // backoff, not in a tight loop.
                        if events == 0
                            && opened.elapsed() < Duration::from_secs(1)
                            && !backoff.wait(stop).await
                        {
                            return;
                        }
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(path, error = %e, "Kubernetes watch broke; resuming");
                        report(Event::Error(e.kind()));
                        if !backoff.wait(stop).await {
                            return;
                        }
                        break;
                    }
                };
                events += 1;
                let kind = ev
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let obj = ev.get("object").cloned().unwrap_or(Value::Null);
                match kind.as_str() {
                    "BOOKMARK" => {
                        if let Some(v) = resource_version(&obj) {
                            rv = v;
                        }
                    }
                    "ERROR" => {
                        let code = obj.get("code").and_then(Value::as_u64).unwrap_or(0);
                        let msg = obj.get("message").and_then(Value::as_str).unwrap_or("");
                        if code == 410 {
                            tracing::info!(
                                path,
                                message = msg,
                                "watch version expired (410 Gone); relisting"
                            );
                            report(Event::Error("gone"));
                        } else {
                            tracing::warn!(
                                path,
                                code,
                                message = msg,
                                "Kubernetes watch error; relisting"
                            );
                            report(Event::Error("api"));
                            if !backoff.wait(stop).await {
                                return;
                            }
                        }
                        continue 'relist;
                    }
                    "ADDED" | "MODIFIED" | "DELETED" => {
                        if let Some(v) = resource_version(&obj) {
                            rv = v;
                        }
                        if let Err(e) = store.apply(&kind, obj) {
                            tracing::warn!(path, error = %e, "Kubernetes object rejected");
                            report(Event::Error("invalid_object"));
                        }
                        backoff.reset();
                    }
                    other => {
                        tracing::warn!(path, kind = other, "unknown watch event type");
                        report(Event::Error("invalid_object"));
                    }
                }
            }
        }
    }
}
