//! The load generator against a tiny in-test SSE server on port 0: token counts, TTFT and gaps,
//! cached_tokens from the usage chunk, HTTP errors by kind, open and closed loops.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::TokioIo;
use kvgate_bench::client::{Api, Target};
use kvgate_bench::runner::{run, Arrival, RunConfig};
use kvgate_bench::stats::{summarize, Slo};
use kvgate_bench::workload::{Request, Workload};
use tokio::sync::mpsc;

const TTFT: Duration = Duration::from_millis(40);
const ITL: Duration = Duration::from_millis(8);

/// A response body fed by a channel (one SSE event per frame).
struct ChanBody(mpsc::Receiver<Bytes>);

impl Body for ChanBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// Streams `max_tokens` completion chunks (TTFT then ITL apart), a usage chunk with
/// cached_tokens = prompt/2, then [DONE]. A prompt starting with token 1 gets a 503.
async fn handle(req: hyper::Request<Incoming>) -> Result<hyper::Response<ChanBody>, Infallible> {
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let prompt = v["prompt"].as_array().unwrap().len() as u64;
    let n = v["max_tokens"].as_u64().unwrap();
    assert_eq!(v["stream_options"]["include_usage"], true);
    let (tx, rx) = mpsc::channel(4);
    if v["prompt"][0] == 1 {
        drop(tx);
        let mut r = hyper::Response::new(ChanBody(rx));
        *r.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
        return Ok(r);
    }
    tokio::spawn(async move {
        tokio::time::sleep(TTFT).await;
        for i in 0..n {
            if i > 0 {
                tokio::time::sleep(ITL).await;
            }
            let ev = format!("data: {{\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"t{i}\"}}],\"usage\":null}}\n\n");
            if tx.send(Bytes::from(ev)).await.is_err() {
                return;
            }
        }
        let usage = format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{n},\"prompt_tokens_details\":{{\"cached_tokens\":{}}}}}}}\n\ndata: [DONE]\n\n",
            prompt / 2
        );
        let _ = tx.send(Bytes::from(usage)).await;
    });
    let mut r = hyper::Response::new(ChanBody(rx));
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    Ok(r)
}

async fn mock_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((s, _)) = l.accept().await {
            conns.spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), hyper::service::service_fn(handle)),
            );
        }
    });
    (addr, task)
}

fn workload(prompts: &[Vec<u32>], max_tokens: u32) -> Workload {
    Workload {
        name: "t".into(),
        requests: prompts
            .iter()
            .map(|p| Request {
                at: None,
                prompt: p.clone(),
                max_tokens,
                turn: None,
                sim_cached_tokens: None,
            })
            .collect(),
    }
}

#[tokio::test]
async fn closed_loop_counts_tokens_timing_and_cached_tokens() {
    let (addr, server) = mock_server().await;
    let target = Target::new(
        &format!("http://{addr}"),
        "m",
        Api::Completions,
        Duration::from_secs(10),
    )
    .unwrap();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| vec![1000 + i; 20]).collect();
    let wl = workload(&prompts, 5);
    let cfg = RunConfig {
        arrival: Arrival::Closed { concurrency: 2 },
        max_requests: None,
        duration: None,
        progress: false,
    };
    let res = run(&target, &wl, &cfg).await.unwrap();
    assert_eq!(res.outcomes.len(), 6);
    for o in &res.outcomes {
        assert!(o.ok(), "{o:?}");
        assert_eq!(o.output_tokens, 5);
        assert_eq!(o.prompt_tokens, 20);
        assert_eq!(o.cached_tokens, Some(10));
        assert_eq!(o.itl.len(), 4);
        // Lower bounds only: the server cannot be faster than its sleeps (no flaky upper bounds).
        assert!(o.ttft.unwrap() >= TTFT, "{o:?}");
        // Each gap alone has no lower bound (a delayed chunk arrives right before the next one
        // on a loaded machine), but the last chunk cannot arrive before the server sent it.
        let last = o.ttft.unwrap() + o.itl.iter().sum::<Duration>();
        assert!(last >= TTFT + 4 * ITL, "{o:?}");
        assert!(o.e2e >= TTFT + 4 * ITL);
    }
    // Two in flight at a time: three rounds, so the run cannot be shorter than 3 request times.
    assert!(res.duration >= 3 * (TTFT + 4 * ITL));
    let s = summarize(&res.outcomes, res.duration, Slo::default());
    assert_eq!(s.hit_rate, Some(0.5));
    assert_eq!(s.output_tokens, 30);
    assert!(s.ttft_ms.p50 >= 40.0);
    server.abort();
}

#[tokio::test]
async fn open_loop_records_http_errors_by_kind() {
    let (addr, server) = mock_server().await;
    let target = Target::new(
        &format!("http://{addr}"),
        "m",
        Api::Completions,
        Duration::from_secs(10),
    )
    .unwrap();
    let prompts = vec![vec![1000; 8], vec![1, 2, 3], vec![1001; 8], vec![1, 9]];
    let wl = workload(&prompts, 2);
    let cfg = RunConfig {
        arrival: Arrival::Poisson {
            rate: 200.0,
            seed: 1,
        },
        max_requests: Some(3),
        duration: None,
        progress: false,
    };
    let res = run(&target, &wl, &cfg).await.unwrap();
    assert_eq!(res.outcomes.len(), 3, "--requests caps the run");
    let s = summarize(
        &res.outcomes,
        res.duration,
        Slo {
            ttft: Some(Duration::from_secs(5)),
            itl: None,
        },
    );
    assert_eq!(s.succeeded, 2);
    assert_eq!(s.errors.get("http_503"), Some(&1));
    assert_eq!(s.good_requests, 2);

    // Nothing listening: a connect error, not a hang or a panic.
    server.abort();
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let target = Target::new(
        &format!("http://{dead_addr}"),
        "m",
        Api::Completions,
        Duration::from_secs(10),
    )
    .unwrap();
    let o = target.send(&wl.requests[0], Duration::ZERO).await;
    assert_eq!(o.error.as_deref(), Some("connect"));
}
