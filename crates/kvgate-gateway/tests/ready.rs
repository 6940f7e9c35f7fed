//! `/ready` means "a request can be routed now": at least one routable worker that serves a known
//! model. While model discovery has not succeeded yet every request would get 404, so the gateway
//! must say 503 (and `/health`, liveness, must still say 200). Real sockets, port 0.

#[path = "helpers/support.rs"]
mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvgate_gateway::config::WorkerConfig;
use support::*;

/// A worker whose `GET /v1/models` fails with 500 until `up` is set, then lists `model`.
struct Flaky {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    model_asks: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

async fn flaky_worker(model: &'static str) -> Flaky {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let up = Arc::new(AtomicBool::new(false));
    let model_asks = Arc::new(AtomicUsize::new(0));
    let (u, asks) = (up.clone(), model_asks.clone());
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (u, asks) = (u.clone(), asks.clone());
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let (u, asks) = (u.clone(), asks.clone());
                    async move {
                        let (status, body) = if req.uri().path() == "/v1/models" {
                            asks.fetch_add(1, Ordering::SeqCst);
                            if u.load(Ordering::SeqCst) {
                                (
                                    StatusCode::OK,
                                    format!(
                                        r#"{{"object":"list","data":[{{"id":"{model}","object":"model"}}]}}"#
                                    ),
                                )
                            } else {
                                (StatusCode::INTERNAL_SERVER_ERROR, "{}".to_string())
                            }
                        } else {
                            (StatusCode::OK, "{}".to_string())
                        };
                        let mut r = Response::new(Full::new(Bytes::from(body)));
                        *r.status_mut() = status;
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Flaky {
        addr,
        up,
        model_asks,
        task,
    }
}

#[tokio::test]
async fn ready_waits_for_model_discovery_and_follows_it() {
    let w = flaky_worker("late-model").await;
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false; // no health probes: only discovery decides here
    cfg.upstream.models_refresh_s = 1;
    cfg.workers
        .push(WorkerConfig::from_url(&format!("http://{}", w.addr)));
    let gw = gateway(cfg).await;
    let c = client();
    let ready = format!("{}/ready", gw.url());

    // Discovery has run once at start and failed: alive, not ready, and requests get 404.
    assert!(w.model_asks.load(Ordering::SeqCst) >= 1);
    assert_eq!(get(&c, &format!("{}/health", gw.url())).await.status, 200);
    let r = get(&c, &ready).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["status"], "no_routable_worker");
    let body = r#"{"model":"late-model","messages":[{"role":"user","content":"x"}]}"#;
    let r = post(&c, &format!("{}/v1/chat/completions", gw.url()), body).await;
    assert_openai_error(&r, 404);

    // The worker starts listing its model: the next discovery round makes the gateway ready.
    w.up.store(true, Ordering::SeqCst);
    poll_until(
        PATIENCE,
        "/ready to turn 200 after the model appeared",
        || async { get(&c, &ready).await.status == 200 },
    )
    .await;
    gw.shutdown().await;
    w.task.abort();
}

#[tokio::test]
async fn ready_is_503_when_the_only_worker_serves_no_model() {
    let w = flaky_worker("unused").await;
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false;
    cfg.workers
        .push(WorkerConfig::from_url(&format!("http://{}", w.addr)));
    let gw = gateway(cfg).await;
    let c = client();
    assert_eq!(get(&c, &format!("{}/ready", gw.url())).await.status, 503);

    // A configured model list makes the same worker routable without discovery.
    let w2 = flaky_worker("unused").await;
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false;
    let mut wc = WorkerConfig::from_url(&format!("http://{}", w2.addr));
    wc.models = vec!["configured".into()];
    cfg.workers.push(wc);
    let gw2 = gateway(cfg).await;
    assert_eq!(get(&c, &format!("{}/ready", gw2.url())).await.status, 200);
    assert_eq!(
        w2.model_asks.load(Ordering::SeqCst),
        0,
        "a worker with configured models is not asked for them"
    );
    gw.shutdown().await;
    gw2.shutdown().await;
    w.task.abort();
    w2.task.abort();
}
