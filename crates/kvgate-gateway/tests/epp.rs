//! The ext_proc endpoint picker against a scripted gRPC client (a hyper HTTP/2 client playing
//! Envoy): the conversation in FULL_DUPLEX_STREAMED and BUFFERED modes, bodiless requests, the
//! served-endpoint correction, local replies (400/404/413/429/503), and hostile input (messages
//! out of order, truncated, garbage, oversized), each ending in a clear answer or gRPC error with
//! no reservation left behind.

#[path = "helpers/support.rs"]
mod support;

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvgate_gateway::epp::grpc::{encode, Decoder};
use kvgate_gateway::epp::pb::{self, ProcessingRequest, ProcessingResponse, Request, Response};
use kvgate_gateway::mock::{MockHandle, MockWorker};
use kvgate_gateway::{Config, Gateway, StartOptions};
use prost::Message;
use support::*;
use tokio::sync::mpsc;

/// The request body of a call: frames pushed by the test.
struct Pushed(mpsc::UnboundedReceiver<Bytes>);

impl Body for Pushed {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// One gRPC call, scripted.
struct Call {
    tx: Option<mpsc::UnboundedSender<Bytes>>,
    body: hyper::body::Incoming,
    dec: Decoder,
    trailers: Option<http::HeaderMap>,
}

async fn connect(addr: std::net::SocketAddr) -> hyper::client::conn::http2::SendRequest<Pushed> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    send
}

impl Call {
    async fn open(addr: std::net::SocketAddr, path: &str) -> Call {
        let mut send = connect(addr).await;
        let (tx, rx) = mpsc::unbounded_channel();
        let req = http::Request::post(format!("http://{addr}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Pushed(rx))
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "application/grpc");
        Call {
            tx: Some(tx),
            body: resp.into_body(),
            dec: Decoder::new(64 << 20),
            trailers: None,
        }
    }

    fn raw(&self, b: impl Into<Bytes>) {
        self.tx.as_ref().unwrap().send(b.into()).unwrap();
    }

    fn send(&self, m: &ProcessingRequest) {
        self.raw(encode(m));
    }

    /// Half-close: the gateway is done sending.
    fn close(&mut self) {
        self.tx = None;
    }

    /// The next message, or `None` once the call ended (then `trailers` are set).
    async fn recv(&mut self) -> Option<ProcessingResponse> {
        loop {
            if let Some(m) = self.dec.next_message().unwrap() {
                return Some(ProcessingResponse::decode(m).unwrap());
            }
            let f = tokio::time::timeout(Duration::from_secs(10), self.body.frame())
                .await
                .expect("an answer in time");
            match f {
                None => return None,
                Some(f) => {
                    let f = f.unwrap();
                    match f.into_data() {
                        Ok(d) => self.dec.push(&d),
                        Err(f) => {
                            self.trailers = f.into_trailers().ok();
                            return None;
                        }
                    }
                }
            }
        }
    }

    async fn expect(&mut self) -> ProcessingResponse {
        match self.recv().await {
            Some(m) => m,
            None => panic!("call ended: {:?}", self.trailers),
        }
    }

    /// Reads to the end; the grpc-status and message.
    async fn status(&mut self) -> (String, String) {
        if let Some(m) = self.recv().await {
            panic!("unexpected message {m:?}");
        }
        let t = self.trailers.as_ref().expect("trailers");
        (
            t["grpc-status"].to_str().unwrap().to_owned(),
            t.get("grpc-message")
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default(),
        )
    }
}

fn protocol(req: pb::BodySendMode, resp: pb::BodySendMode) -> Option<pb::ProtocolConfiguration> {
    Some(pb::ProtocolConfiguration {
        request_body_mode: req as i32,
        response_body_mode: resp as i32,
        send_body_without_waiting_for_header_response: false,
    })
}

fn headers(pairs: &[(&str, &str)], eos: bool) -> Request {
    Request::RequestHeaders(pb::HttpHeaders {
        headers: Some(pb::HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| pb::HeaderValue {
                    key: k.to_string(),
                    value: String::new(),
                    raw_value: v.as_bytes().to_vec(),
                })
                .collect(),
        }),
        end_of_stream: eos,
    })
}

fn resp_headers(pairs: &[(&str, &str)], eos: bool, served: Option<&str>) -> ProcessingRequest {
    let Request::RequestHeaders(h) = headers(pairs, eos) else {
        unreachable!()
    };
    ProcessingRequest {
        request: Some(Request::ResponseHeaders(h)),
        metadata_context: served.map(|s| {
            let mut lb = pb::Struct::default();
            lb.fields.insert(
                "x-gateway-destination-endpoint-served".into(),
                pb::Value::string(s),
            );
            let mut md = pb::Metadata::default();
            md.filter_metadata.insert("envoy.lb".into(), lb);
            md
        }),
        protocol_config: None,
    }
}

fn msg(r: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        metadata_context: None,
        protocol_config: None,
    }
}

fn body(b: impl Into<Bytes>, eos: bool) -> Request {
    Request::RequestBody(pb::HttpBody {
        body: b.into(),
        end_of_stream: eos,
    })
}

fn resp_body(b: impl Into<Bytes>, eos: bool) -> ProcessingRequest {
    msg(Request::ResponseBody(pb::HttpBody {
        body: b.into(),
        end_of_stream: eos,
    }))
}

fn first(p: pb::ProtocolConfiguration, r: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        metadata_context: None,
        protocol_config: Some(p),
    }
}

const CHAT: &str = "/v1/chat/completions";

fn chat(stream: bool) -> String {
    format!(
        r#"{{"model":"mock-model","stream":{stream},"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "tell me about the sea ".repeat(40)
    )
}

/// The destination the headers answer set, checked against its metadata twin.
fn destination(r: &ProcessingResponse) -> String {
    let common = match &r.response {
        Some(Response::RequestHeaders(h)) => h.response.clone().unwrap(),
        Some(Response::RequestBody(b)) => b.response.clone().unwrap(),
        other => panic!("not a request answer: {other:?}"),
    };
    assert!(common.clear_route_cache);
    let set = &common.header_mutation.as_ref().unwrap().set_headers;
    let h = set
        .iter()
        .find(|h| h.header.as_ref().unwrap().key == "x-gateway-destination-endpoint")
        .expect("destination header");
    assert_eq!(
        h.append_action,
        pb::AppendAction::OverwriteIfExistsOrAdd as i32
    );
    let value = String::from_utf8(h.header.as_ref().unwrap().raw_value.clone()).unwrap();
    let md = r.dynamic_metadata.as_ref().expect("dynamic metadata");
    let Some(pb::Kind::StructValue(lb)) = &md.fields["envoy.lb"].kind else {
        panic!("envoy.lb is a struct")
    };
    assert_eq!(
        lb.fields["x-gateway-destination-endpoint"],
        pb::Value::string(value.clone()),
        "header and metadata agree"
    );
    value
}

/// Body bytes and end flag of a streamed_response answer.
fn streamed(r: &ProcessingResponse) -> (Bytes, bool) {
    let br = match &r.response {
        Some(Response::RequestBody(b)) | Some(Response::ResponseBody(b)) => b,
        other => panic!("not a body answer: {other:?}"),
    };
    match br
        .response
        .as_ref()
        .unwrap()
        .body_mutation
        .as_ref()
        .unwrap()
        .mutation
        .as_ref()
    {
        Some(pb::Mutation::StreamedResponse(s)) => (s.body.clone(), s.end_of_stream),
        other => panic!("not streamed: {other:?}"),
    }
}

async fn epp_gateway(workers: &[&MockHandle], tweak: impl FnOnce(&mut Config)) -> Gateway {
    let mut cfg = config_for(workers, "kv");
    cfg.epp.listen = "127.0.0.1:0".parse().unwrap();
    cfg.upstream.monitor = false;
    tweak(&mut cfg);
    Gateway::start(StartOptions {
        config: cfg,
        config_path: None,
        overrides: std::sync::Arc::new(|_| {}),
        epp: true,
    })
    .await
    .unwrap()
}

fn inflight(gw: &Gateway) -> Vec<u32> {
    gw.app
        .fleet
        .registry
        .snapshot()
        .workers
        .iter()
        .map(|w| w.state.inflight.load(Ordering::Relaxed))
        .collect()
}

async fn no_load_left(gw: &Gateway) {
    assert!(
        eventually(Duration::from_secs(5), || inflight(gw)
            .iter()
            .all(|n| *n == 0))
        .await,
        "load left: {:?}",
        inflight(gw)
    );
}

fn metrics(gw: &Gateway) -> String {
    gw.app.metrics.render()
}

async fn two_workers() -> (MockHandle, MockHandle) {
    let a = MockWorker::builder().spawn().await.unwrap();
    let b = MockWorker::builder().spawn().await.unwrap();
    (a, b)
}

fn sse(events: &[&str]) -> String {
    events.iter().map(|e| format!("data: {e}\n\n")).collect()
}

#[tokio::test]
async fn full_duplex_chat_stream_is_picked_echoed_and_accounted() {
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |_| {}).await;
    let addrs = [a.url(), b.url()].map(|u| u.trim_start_matches("http://").to_owned());
    let mut call = Call::open(gw.epp_addr.unwrap(), kvgate_gateway::epp::PROCESS_PATH).await;
    call.send(&first(
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap(),
        headers(
            &[
                (":method", "POST"),
                (":path", CHAT),
                ("content-type", "application/json"),
                ("x-gateway-destination-endpoint", "10.9.9.9:80"),
                ("x-gateway-destination-endpoint-served", "10.9.9.9:80"),
            ],
            false,
        ),
    ));
    let text = chat(true);
    let (p1, p2) = text.as_bytes().split_at(100);
    call.send(&msg(body(p1.to_vec(), false)));
    call.send(&msg(body(p2.to_vec(), false)));
    // Envoy 1.40 ends the body with an empty end_of_stream chunk.
    call.send(&msg(body(Bytes::new(), true)));
    let h = call.expect().await;
    let dest = destination(&h);
    let list: Vec<&str> = dest.split(',').collect();
    assert_eq!(
        list.len(),
        2,
        "the pick and one fallback (two workers): {dest}"
    );
    assert!(
        list.iter().all(|e| addrs.contains(&e.to_string())),
        "{dest}"
    );
    assert_ne!(list[0], list[1]);
    let Some(Response::RequestHeaders(hr)) = &h.response else {
        unreachable!()
    };
    let m = hr
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap();
    assert!(m
        .remove_headers
        .iter()
        .any(|r| r == "x-gateway-destination-endpoint-served"));
    // The body comes back whole, with stream_options.include_usage asked for (counted, then
    // stripped from the client's stream).
    let mut echoed = Vec::new();
    loop {
        let (b, end) = streamed(&call.expect().await);
        echoed.extend_from_slice(&b);
        if end {
            break;
        }
    }
    let sent: serde_json::Value = serde_json::from_str(&text).unwrap();
    let got: serde_json::Value = serde_json::from_slice(&echoed).unwrap();
    assert_eq!(got["messages"], sent["messages"]);
    assert_eq!(got["stream_options"]["include_usage"], true);
    let cl = m
        .set_headers
        .iter()
        .find(|h| h.header.as_ref().unwrap().key == "content-length")
        .unwrap();
    assert_eq!(
        cl.header.as_ref().unwrap().raw_value,
        echoed.len().to_string().as_bytes()
    );
    // The load sits on the picked worker until the response ends.
    let picked = addrs.iter().position(|x| x == list[0]).unwrap();
    assert_eq!(inflight(&gw)[picked], 1);
    assert_eq!(inflight(&gw).iter().sum::<u32>(), 1);

    call.send(&resp_headers(
        &[(":status", "200"), ("content-type", "text/event-stream")],
        false,
        Some(list[0]),
    ));
    let r = call.expect().await;
    assert!(matches!(r.response, Some(Response::ResponseHeaders(_))));
    let events = sse(&[
        r#"{"choices":[{"index":0,"delta":{"content":"Hello"}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"content":" sea"},"finish_reason":"stop"}]}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":200,"completion_tokens":2,"total_tokens":202,"prompt_tokens_details":{"cached_tokens":64}}}"#,
        "[DONE]",
    ]);
    let (e1, e2) = events.split_at(events.len() / 2);
    let mut client_saw = Vec::new();
    call.send(&resp_body(e1.to_owned(), false));
    call.send(&resp_body(e2.to_owned(), true));
    loop {
        let (b, end) = streamed(&call.expect().await);
        client_saw.extend_from_slice(&b);
        if end {
            break;
        }
    }
    let client_saw = String::from_utf8(client_saw).unwrap();
    assert!(client_saw.contains("Hello") && client_saw.contains("[DONE]"));
    assert!(
        !client_saw.contains("usage"),
        "usage event stripped: {client_saw}"
    );
    assert_eq!(inflight(&gw).iter().sum::<u32>(), 0, "released at the end");
    call.close();
    assert_eq!(call.status().await.0, "0");
    let text = metrics(&gw);
    assert!(
        text.contains(r#"kvgate_cached_tokens_total{model="mock-model""#),
        "{text}"
    );
    assert!(
        text.contains(r#"kvgate_epp_picks_total{kind="api"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kvgate_epp_streams_total{end="ok"} 1"#),
        "{text}"
    );
    assert!(text.contains(r#"status="200"} 1"#), "{text}");
    gw.shutdown().await;
}

#[tokio::test]
async fn buffered_mode_answers_headers_first_and_routes_on_the_body() {
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |c| c.epp.fallback_endpoints = 1).await;
    let mut call = Call::open(gw.epp_addr.unwrap(), kvgate_gateway::epp::PROCESS_PATH).await;
    call.send(&first(
        protocol(pb::BodySendMode::Buffered, pb::BodySendMode::Buffered).unwrap(),
        headers(&[(":method", "POST"), (":path", "/v1/completions")], false),
    ));
    let h = call.expect().await;
    let Some(Response::RequestHeaders(hr)) = &h.response else {
        panic!("{h:?}")
    };
    let m = hr
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap();
    assert!(m.set_headers.is_empty());
    assert!(m
        .remove_headers
        .iter()
        .any(|r| r == "x-gateway-destination-endpoint"));
    assert!(h.dynamic_metadata.is_none());
    call.send(&msg(body(
        r#"{"model":"mock-model","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18]}"#,
        true,
    )));
    let r = call.expect().await;
    let dest = destination(&r);
    assert_eq!(dest.split(',').count(), 1, "fallback_endpoints = 1");
    assert_eq!(inflight(&gw).iter().sum::<u32>(), 1);
    call.send(&resp_headers(
        &[(":status", "200"), ("content-type", "application/json")],
        false,
        None,
    ));
    call.expect().await;
    call.send(&resp_body(
        r#"{"choices":[{"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":18,"completion_tokens":1,"total_tokens":19}}"#,
        true,
    ));
    let r = call.expect().await;
    let Some(Response::ResponseBody(br)) = &r.response else {
        panic!("{r:?}")
    };
    assert!(
        br.response.as_ref().unwrap().body_mutation.is_none(),
        "BUFFERED: body left as is"
    );
    assert_eq!(inflight(&gw).iter().sum::<u32>(), 0);
    call.close();
    assert_eq!(call.status().await.0, "0");
    assert!(metrics(&gw).contains("kvgate_completion_tokens_total{model=\"mock-model\""));
    gw.shutdown().await;
}

#[tokio::test]
async fn bodiless_requests_are_picked_by_load_at_once() {
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |_| {}).await;
    let mut call = Call::open(gw.epp_addr.unwrap(), kvgate_gateway::epp::PROCESS_PATH).await;
    call.send(&first(
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap(),
        headers(&[(":method", "GET"), (":path", "/v1/models")], true),
    ));
    let r = call.expect().await;
    assert_eq!(destination(&r).split(',').count(), 2);
    assert_eq!(inflight(&gw).iter().sum::<u32>(), 1);
    call.send(&resp_headers(&[(":status", "200")], true, None));
    call.expect().await;
    assert_eq!(inflight(&gw).iter().sum::<u32>(), 0);
    call.close();
    assert_eq!(call.status().await.0, "0");
    assert!(metrics(&gw).contains(r#"kvgate_epp_picks_total{kind="load"} 1"#));
    gw.shutdown().await;
}

#[tokio::test]
async fn the_served_endpoint_moves_the_load_when_the_gateway_fell_back() {
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |_| {}).await;
    let addrs = [a.url(), b.url()].map(|u| u.trim_start_matches("http://").to_owned());
    let mut call = Call::open(gw.epp_addr.unwrap(), kvgate_gateway::epp::PROCESS_PATH).await;
    call.send(&first(
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap(),
        headers(&[(":method", "POST"), (":path", CHAT)], false),
    ));
    call.send(&msg(body(chat(false), true)));
    let dest = destination(&call.expect().await);
    while !streamed(&call.expect().await).1 {}
    let list: Vec<&str> = dest.split(',').collect();
    let first_i = addrs.iter().position(|x| x == list[0]).unwrap();
    assert_eq!(inflight(&gw)[first_i], 1);
    call.send(&resp_headers(
        &[(":status", "200"), ("content-type", "application/json")],
        false,
        Some(list[1]),
    ));
    call.expect().await;
    assert_eq!(inflight(&gw)[first_i], 0, "moved off the first pick");
    assert_eq!(
        inflight(&gw)[1 - first_i],
        1,
        "onto the endpoint that served"
    );
    call.send(&resp_body(
        r#"{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}]}"#,
        true,
    ));
    call.expect().await;
    no_load_left(&gw).await;
    call.close();
    call.status().await;
    let text = metrics(&gw);
    assert!(
        text.contains("kvgate_epp_served_elsewhere_total 1"),
        "{text}"
    );
    gw.shutdown().await;
}

async fn immediate(call: &mut Call) -> pb::ImmediateResponse {
    let r = call.expect().await;
    match r.response {
        Some(Response::ImmediateResponse(i)) => i,
        other => panic!("not an immediate response: {other:?}"),
    }
}

fn header_of(i: &pb::ImmediateResponse, key: &str) -> Option<String> {
    i.headers.as_ref()?.set_headers.iter().find_map(|h| {
        let h = h.header.as_ref()?;
        (h.key == key).then(|| String::from_utf8(h.raw_value.clone()).unwrap())
    })
}

#[tokio::test]
async fn local_replies_for_bad_requests_unknown_models_subsets_and_shedding() {
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |c| {
        c.routing.max_inflight_per_worker = 1;
        c.admission.queue_size = 0;
    })
    .await;
    let epp = gw.epp_addr.unwrap();
    let fd = || {
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap()
    };
    let open = |b: String| async move {
        let mut c = Call::open(epp, kvgate_gateway::epp::PROCESS_PATH).await;
        c.send(&first(
            fd(),
            headers(&[(":method", "POST"), (":path", CHAT)], false),
        ));
        c.send(&msg(body(b, true)));
        let _ = &mut c;
        c
    };
    // 400: not JSON; 404: unknown model.
    let mut c = open("{not json".into()).await;
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 400);
    assert!(String::from_utf8_lossy(&i.body).contains("invalid_request_error"));
    c.close();
    assert_eq!(c.status().await.0, "0");
    let mut c = open(chat(false).replace("mock-model", "nope")).await;
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 404);
    c.close();
    assert_eq!(c.status().await.0, "0");
    // 503: a subset hint naming no worker of the pool.
    let mut c = Call::open(epp, kvgate_gateway::epp::PROCESS_PATH).await;
    let mut hint = pb::Struct::default();
    hint.fields.insert(
        "x-gateway-destination-endpoint-subset".into(),
        pb::Value {
            kind: Some(pb::Kind::ListValue(pb::ListValue {
                values: vec![pb::Value::string("10.1.2.3:8000")],
            })),
        },
    );
    let mut md = pb::Metadata::default();
    md.filter_metadata
        .insert("envoy.lb.subset_hint".into(), hint);
    c.send(&ProcessingRequest {
        request: Some(headers(&[(":method", "POST"), (":path", CHAT)], false)),
        metadata_context: Some(md),
        protocol_config: Some(fd()),
    });
    c.send(&msg(body(chat(false), true)));
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 503);
    c.close();
    assert_eq!(c.status().await.0, "0");
    // A subset hint naming one worker: only that one is picked.
    let b_addr = b.url().trim_start_matches("http://").to_owned();
    let mut hint = pb::Struct::default();
    hint.fields.insert(
        "x-gateway-destination-endpoint-subset".into(),
        pb::Value::string(format!("10.1.2.3:8000, {b_addr}")),
    );
    let mut md = pb::Metadata::default();
    md.filter_metadata
        .insert("envoy.lb.subset_hint".into(), hint);
    let mut held = Call::open(epp, kvgate_gateway::epp::PROCESS_PATH).await;
    held.send(&ProcessingRequest {
        request: Some(headers(&[(":method", "POST"), (":path", CHAT)], false)),
        metadata_context: Some(md),
        protocol_config: Some(fd()),
    });
    held.send(&msg(body(chat(false), true)));
    assert_eq!(destination(&held.expect().await), b_addr);
    // 429 + Retry-After: both workers at max_inflight_per_worker and no queue.
    let mut other = open(chat(false)).await;
    destination(&other.expect().await);
    assert_eq!(inflight(&gw), vec![1, 1]);
    let mut c = open(chat(false)).await;
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 429);
    assert_eq!(header_of(&i, "retry-after").as_deref(), Some("1"));
    c.close();
    assert_eq!(c.status().await.0, "0");
    // The held calls end without a response: cancelled, load released.
    drop(held);
    other.close();
    while other.recv().await.is_some() {}
    assert_eq!(other.trailers.as_ref().unwrap()["grpc-status"], "0");
    no_load_left(&gw).await;
    let text = metrics(&gw);
    for s in ["400", "404", "429", "503"] {
        assert!(
            text.contains(&format!(
                "kvgate_epp_immediate_responses_total{{status=\"{s}\"}} 1"
            )),
            "{s}: {text}"
        );
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn out_of_order_truncated_and_garbage_streams_get_grpc_errors_and_leak_nothing() {
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |_| {}).await;
    let epp = gw.epp_addr.unwrap();
    let path = kvgate_gateway::epp::PROCESS_PATH;
    // Response headers before any request.
    let mut c = Call::open(epp, path).await;
    c.send(&resp_headers(&[(":status", "200")], false, None));
    let (code, m) = c.status().await;
    assert_eq!(code, "3", "{m}");
    assert!(m.contains("response_headers"), "{m}");
    // A body before the headers.
    let mut c = Call::open(epp, path).await;
    c.send(&msg(body("x", true)));
    assert_eq!(c.status().await.0, "3");
    // Headers twice, after a pick (the load is released).
    let mut c = Call::open(epp, path).await;
    c.send(&msg(headers(&[(":method", "GET"), (":path", "/x")], true)));
    destination(&c.expect().await);
    c.send(&msg(headers(&[(":method", "GET"), (":path", "/x")], true)));
    assert_eq!(c.status().await.0, "3");
    // A message without a request.
    let mut c = Call::open(epp, path).await;
    c.send(&ProcessingRequest::default());
    assert_eq!(c.status().await.0, "3");
    // Garbage bytes.
    let mut c = Call::open(epp, path).await;
    c.raw(&b"\x00\x00\x00\x00\x05\xff\xff\xff\xff\xff"[..]);
    let (code, m) = c.status().await;
    assert_eq!(code, "3");
    assert!(m.contains("malformed"), "{m}");
    let mut c = Call::open(epp, path).await;
    c.raw(&b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"[..]);
    assert_eq!(c.status().await.0, "3");
    // Truncated: a prefix announcing 100 bytes, 10 sent, then the end.
    let mut c = Call::open(epp, path).await;
    c.send(&first(
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap(),
        headers(&[(":method", "POST"), (":path", CHAT)], false),
    ));
    c.raw(&b"\x00\x00\x00\x00\x64abcdefghij"[..]);
    c.close();
    let (code, m) = c.status().await;
    assert_eq!(code, "3");
    assert!(m.contains("inside a message"), "{m}");
    // Oversized message prefix.
    let mut c = Call::open(epp, path).await;
    c.raw(&b"\x00\x7f\xff\xff\xff"[..]);
    assert_eq!(c.status().await.0, "8");
    // Unsupported body mode.
    let mut c = Call::open(epp, path).await;
    c.send(&first(
        protocol(pb::BodySendMode::Streamed, pb::BodySendMode::Streamed).unwrap(),
        headers(&[(":method", "POST"), (":path", CHAT)], false),
    ));
    let (code, m) = c.status().await;
    assert_eq!(code, "9");
    assert!(m.contains("FULL_DUPLEX_STREAMED"), "{m}");
    // A stream reset mid-response: the load is released.
    let mut c = Call::open(epp, path).await;
    c.send(&first(
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap(),
        headers(&[(":method", "POST"), (":path", CHAT)], false),
    ));
    c.send(&msg(body(chat(true), true)));
    destination(&c.expect().await);
    while !streamed(&c.expect().await).1 {}
    c.send(&resp_headers(
        &[(":status", "200"), ("content-type", "text/event-stream")],
        false,
        None,
    ));
    c.expect().await;
    c.send(&resp_body(
        sse(&[r#"{"choices":[{"delta":{"content":"a"}}]}"#]),
        false,
    ));
    c.expect().await;
    assert_eq!(inflight(&gw).iter().sum::<u32>(), 1);
    drop(c);
    no_load_left(&gw).await;
    // Not gRPC, unknown method.
    let mut c = Call::open(epp, "/nope.Service/Method").await;
    assert_eq!(c.status().await.0, "12");
    let text = metrics(&gw);
    assert!(
        text.contains(r#"kvgate_epp_streams_total{end="cancelled"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("kvgate_requests_total{model=\"mock-model\",worker="),
        "{text}"
    );
    assert!(
        text.contains("status=\"499\"} 1"),
        "the reset request counted as cancelled: {text}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_16_mib_body_in_62000_byte_chunks_is_refused_or_echoed_whole() {
    let (a, b) = two_workers().await;
    let input = "x".repeat(16 << 20);
    let text = format!(r#"{{"model":"mock-model","input":"{input}"}}"#);
    let chunks: Vec<Bytes> = text
        .as_bytes()
        .chunks(62_000)
        .map(Bytes::copy_from_slice)
        .collect();
    // Under the default 8 MiB limit: 413 as soon as the limit is crossed, the rest ignored.
    let gw = epp_gateway(&[&a, &b], |_| {}).await;
    let mut c = Call::open(gw.epp_addr.unwrap(), kvgate_gateway::epp::PROCESS_PATH).await;
    c.send(&first(
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap(),
        headers(&[(":method", "POST"), (":path", "/v1/embeddings")], false),
    ));
    for (i, ch) in chunks.iter().enumerate() {
        c.send(&msg(body(ch.clone(), i + 1 == chunks.len())));
    }
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 413);
    c.close();
    assert_eq!(c.status().await.0, "0");
    no_load_left(&gw).await;
    gw.shutdown().await;
    // With a 32 MiB limit: routed, and echoed in chunks of at most 62,000 bytes.
    let gw = epp_gateway(&[&a, &b], |c| c.server.max_body_bytes = 32 << 20).await;
    let mut c = Call::open(gw.epp_addr.unwrap(), kvgate_gateway::epp::PROCESS_PATH).await;
    c.send(&first(
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap(),
        headers(&[(":method", "POST"), (":path", "/v1/embeddings")], false),
    ));
    for ch in &chunks {
        c.send(&msg(body(ch.clone(), false)));
    }
    c.send(&msg(body(Bytes::new(), true)));
    destination(&c.expect().await);
    let mut total = 0;
    loop {
        let (b, end) = streamed(&c.expect().await);
        assert!(b.len() <= 62_000);
        total += b.len();
        if end {
            break;
        }
    }
    assert_eq!(total, text.len());
    assert_eq!(inflight(&gw).iter().sum::<u32>(), 1);
    c.close();
    c.status().await;
    no_load_left(&gw).await;
    gw.shutdown().await;
}

#[tokio::test]
async fn grpc_health_answers_liveness_readiness_and_the_ext_proc_service() {
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |_| {}).await;
    let epp = gw.epp_addr.unwrap();
    for (svc, want) in [
        ("liveness", Some(1)),
        ("readiness", Some(1)),
        ("envoy.service.ext_proc.v3.ExternalProcessor", Some(1)),
        ("", Some(1)),
        ("nope", None),
    ] {
        let mut c = Call::open(epp, kvgate_gateway::epp::HEALTH_PATH).await;
        c.raw(encode(&pb::HealthCheckRequest {
            service: svc.into(),
        }));
        c.close();
        match want {
            Some(s) => {
                let m = c.dec_next_health().await;
                assert_eq!(m.status, s, "{svc}");
                assert_eq!(c.status().await.0, "0");
            }
            None => assert_eq!(c.status().await.0, "5", "{svc}"),
        }
    }
    gw.shutdown().await;
}

impl Call {
    async fn dec_next_health(&mut self) -> pb::HealthCheckResponse {
        loop {
            if let Some(m) = self.dec.next_message().unwrap() {
                return pb::HealthCheckResponse::decode(m).unwrap();
            }
            let f = tokio::time::timeout(Duration::from_secs(10), self.body.frame())
                .await
                .unwrap()
                .expect("a message")
                .unwrap();
            self.dec.push(&f.into_data().expect("data"));
        }
    }
}

fn set_header_of(r: &ProcessingResponse, key: &str) -> Option<String> {
    let Some(Response::RequestHeaders(h)) = &r.response else {
        panic!("not a headers answer: {r:?}")
    };
    h.response
        .as_ref()?
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .find_map(|h| {
            let h = h.header.as_ref()?;
            (h.key == key).then(|| String::from_utf8(h.raw_value.clone()).unwrap())
        })
}

fn removes(r: &ProcessingResponse, key: &str) -> bool {
    let Some(Response::RequestHeaders(h)) = &r.response else {
        panic!("not a headers answer: {r:?}")
    };
    h.response
        .as_ref()
        .and_then(|c| c.header_mutation.as_ref())
        .is_some_and(|m| m.remove_headers.iter().any(|h| h == key))
}

/// A prefill/decode pool: the destination is the decode worker and the prefill worker goes in
/// `x-prefiller-host-port` (llm-d's P/D sidecar convention); its load is held until the decode
/// worker answers. A short prompt (below `pd.min_uncached_tokens`) runs whole on the decode worker,
/// and a client-supplied `x-prefiller-host-port` is removed.
#[tokio::test]
async fn prefill_decode_pools_name_the_prefill_worker_for_the_sidecar() {
    use kvgate_gateway::config::{RoleSetting, WorkerRole};
    let (p, d) = two_workers().await;
    let gw = epp_gateway(&[&p, &d], |c| {
        c.workers[0].role = RoleSetting::Fixed(WorkerRole::Prefill);
        c.workers[1].role = RoleSetting::Fixed(WorkerRole::Decode);
        c.pd.min_uncached_tokens = 64;
        c.pd.local_on_idle_decode = false;
    })
    .await;
    let (pa, da) = (
        p.url().trim_start_matches("http://").to_owned(),
        d.url().trim_start_matches("http://").to_owned(),
    );
    let epp = gw.epp_addr.unwrap();
    let fd = protocol(
        pb::BodySendMode::FullDuplexStreamed,
        pb::BodySendMode::FullDuplexStreamed,
    )
    .unwrap();
    // Long prompt: disaggregated.
    let mut c = Call::open(epp, kvgate_gateway::epp::PROCESS_PATH).await;
    c.send(&first(
        fd,
        headers(&[(":method", "POST"), (":path", CHAT)], false),
    ));
    c.send(&msg(body(chat(true), true)));
    let h = c.expect().await;
    assert_eq!(
        destination(&h),
        da,
        "only the decode worker is a destination"
    );
    assert_eq!(set_header_of(&h, "x-prefiller-host-port"), Some(pa.clone()));
    while !streamed(&c.expect().await).1 {}
    assert_eq!(inflight(&gw), vec![1, 1], "prefill and decode loads held");
    c.send(&resp_headers(
        &[(":status", "200"), ("content-type", "text/event-stream")],
        false,
        Some(&da),
    ));
    c.expect().await;
    assert_eq!(
        inflight(&gw),
        vec![0, 1],
        "the prefill ran before the decode worker answered"
    );
    c.send(&resp_body(
        sse(&[r#"{"choices":[{"delta":{"content":"a"}}]}"#, "[DONE]"]),
        true,
    ));
    c.expect().await;
    c.close();
    assert_eq!(c.status().await.0, "0");
    no_load_left(&gw).await;
    // Short prompt: the decode worker runs it whole; a spoofed prefiller header is removed.
    let mut c = Call::open(epp, kvgate_gateway::epp::PROCESS_PATH).await;
    c.send(&first(
        fd,
        headers(
            &[
                (":method", "POST"),
                (":path", CHAT),
                ("x-prefiller-host-port", "10.0.0.1:80"),
            ],
            false,
        ),
    ));
    c.send(&msg(body(
        r#"{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}"#,
        true,
    )));
    let h = c.expect().await;
    assert_eq!(destination(&h), da);
    assert_eq!(set_header_of(&h, "x-prefiller-host-port"), None);
    assert!(removes(&h, "x-prefiller-host-port"));
    assert_eq!(inflight(&gw), vec![0, 1]);
    c.close();
    while c.recv().await.is_some() {}
    no_load_left(&gw).await;
    let text = metrics(&gw);
    assert!(
        text.contains(r#"kvgate_pd_decisions_total{model="mock-model",path="disaggregated",reason="epp_sidecar"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"kvgate_pd_decisions_total{model="mock-model",path="local",reason="short_prompt"} 1"#
        ),
        "{text}"
    );
    gw.shutdown().await;
}

/// `[epp] tls`: the same gRPC over TLS (ALPN h2).
#[tokio::test]
async fn the_picker_serves_grpc_over_tls() {
    let (a, b) = two_workers().await;
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let gw = epp_gateway(&[&a, &b], |c| {
        c.epp.tls = Some(kvgate_gateway::config::TlsConfig {
            cert: fixtures.join("cert.pem"),
            key: fixtures.join("key.pem"),
        })
    })
    .await;
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(fixtures.join("cert.pem")).unwrap();
    for cert in rustls_pemfile::certs(&mut &pem[..]) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut cc = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cc.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(gw.epp_addr.unwrap())
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cc))
        .connect(name, tcp)
        .await
        .expect("TLS handshake");
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(kvgate_gateway::epp::HEALTH_PATH)
        .header("content-type", "application/grpc")
        .body(http_body_util::Full::new(encode(&pb::HealthCheckRequest {
            service: "liveness".into(),
        })))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let mut body = resp.into_body();
    let mut dec = Decoder::new(1024);
    let mut status = None;
    let mut answer = None;
    while let Some(f) = body.frame().await {
        let f = f.unwrap();
        match f.into_data() {
            Ok(d) => {
                dec.push(&d);
                if let Some(m) = dec.next_message().unwrap() {
                    answer = Some(pb::HealthCheckResponse::decode(m).unwrap());
                }
            }
            Err(f) => status = f.into_trailers().ok().map(|t| t["grpc-status"].clone()),
        }
    }
    assert_eq!(answer.unwrap().status, 1, "SERVING");
    assert_eq!(status.unwrap(), "0");
    gw.shutdown().await;
}

/// A FULL_DUPLEX call to `path` with `extra` request headers and `body` (ends with the body).
async fn api_call(
    epp: std::net::SocketAddr,
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    b: Option<String>,
) -> Call {
    let c = Call::open(epp, kvgate_gateway::epp::PROCESS_PATH).await;
    let mut h = vec![(":method", method), (":path", path)];
    h.extend_from_slice(extra);
    c.send(&first(
        protocol(
            pb::BodySendMode::FullDuplexStreamed,
            pb::BodySendMode::FullDuplexStreamed,
        )
        .unwrap(),
        headers(&h, b.is_none()),
    ));
    if let Some(b) = b {
        c.send(&msg(body(b, true)));
    }
    c
}

/// The request answer and the body echoed after it (FULL_DUPLEX).
async fn answer(c: &mut Call) -> (ProcessingResponse, Bytes) {
    let h = c.expect().await;
    let mut all = Vec::new();
    if matches!(&h.response, Some(Response::RequestHeaders(_)))
        && set_header_of(&h, "content-length").is_some()
    {
        loop {
            let r = c.recv().await;
            let Some(r) = r else { break };
            let (b, end) = streamed(&r);
            all.extend_from_slice(&b);
            if end {
                break;
            }
        }
    }
    (h, Bytes::from(all))
}

/// Plays the worker's whole answer and the stream's end; returns the echoed response body.
async fn respond_and_end(c: &mut Call, served: &str, ctype: &str, b: &str) -> Bytes {
    c.send(&resp_headers(
        &[(":status", "200"), ("content-type", ctype)],
        false,
        Some(served),
    ));
    c.expect().await;
    c.send(&resp_body(b.to_owned(), true));
    let mut out = Vec::new();
    loop {
        let (b, end) = streamed(&c.expect().await);
        out.extend_from_slice(&b);
        if end {
            break;
        }
    }
    c.close();
    assert_eq!(c.status().await.0, "0");
    Bytes::from(out)
}

/// The first endpoint of a pick (the one the gateway tries first).
fn picked(h: &ProcessingResponse) -> String {
    destination(h).split(',').next().unwrap().to_owned()
}

fn queued(gw: &Gateway) -> usize {
    gw.app.fleet.router.admission().len()
}

/// Flow control in the picker, as at the front door (`flow::key` and the same admission): a
/// sheddable request is shed at once (429 + Retry-After; Anthropic's 529 on /v1/messages), a
/// malformed flow header is a 400, an objective's priority puts a later waiter ahead of an
/// earlier one, the fairness id names the tenant, the engine gets the class priority
/// (`forward_priority`), and a waiter whose stream the gateway resets leaves the queue at once.
#[tokio::test]
async fn flow_control_keys_orders_and_sheds_as_at_the_front_door() {
    use kvgate_gateway::config::{FlowClassConfig, FlowObjectiveConfig};
    #[derive(serde::Deserialize)]
    struct Classes {
        classes: Vec<FlowClassConfig>,
    }
    let a = MockWorker::builder().spawn().await.unwrap();
    let gw = epp_gateway(&[&a], |c| {
        c.routing.max_inflight_per_worker = 1;
        c.flow_control.enabled = true;
        c.flow_control.objectives.insert(
            "chat".into(),
            FlowObjectiveConfig {
                priority: 10,
                ttft_ms: None,
            },
        );
        c.flow_control.tenants.insert("t9".into(), 1.0);
        c.flow_control.forward_priority = vec!["vllm".into()];
        c.flow_control.classes = toml::from_str::<Classes>(
            r#"
            [[classes]]
            name = "interactive"
            priority = 10
            [[classes]]
            name = "default"
            priority = 0
            [[classes]]
            name = "sheddable"
            priority = -1
            "#,
        )
        .unwrap()
        .classes;
    })
    .await;
    let epp = gw.epp_addr.unwrap();
    let addr = a.url().trim_start_matches("http://").to_owned();
    let fairness = [("x-llm-d-inference-fairness-id", "t9")];
    let mut holder = api_call(epp, "POST", CHAT, &fairness, Some(chat(false))).await;
    let (h, echoed) = answer(&mut holder).await;
    assert_eq!(destination(&h), addr);
    assert!(
        String::from_utf8_lossy(&echoed).ends_with(r#","priority":0}"#),
        "the class priority for vLLM: {}",
        String::from_utf8_lossy(&echoed)
    );
    assert_eq!(
        set_header_of(&h, "content-length"),
        Some(echoed.len().to_string())
    );
    assert_eq!(inflight(&gw), vec![1]);
    // Sheddable while the fleet is full: shed at once, in each API's shape.
    let shed = [("x-kvgate-priority", "-1")];
    let mut c = api_call(epp, "POST", CHAT, &shed, Some(chat(false))).await;
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 429);
    assert_eq!(header_of(&i, "retry-after").as_deref(), Some("1"));
    assert!(String::from_utf8_lossy(&i.body).contains("request_shed"));
    drop(c);
    let messages = r#"{"model":"mock-model","max_tokens":16,"messages":[{"role":"user","content":"hello there"}]}"#;
    let mut c = api_call(epp, "POST", "/v1/messages", &shed, Some(messages.into())).await;
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 529, "Anthropic's overloaded status");
    let body = String::from_utf8_lossy(&i.body).into_owned();
    assert!(
        body.contains(r#""type":"error""#) && body.contains("overloaded_error"),
        "{body}"
    );
    drop(c);
    let mut c = api_call(
        epp,
        "POST",
        CHAT,
        &[("x-kvgate-priority", "high")],
        Some(chat(false)),
    )
    .await;
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 400);
    assert!(String::from_utf8_lossy(&i.body).contains("x-kvgate-priority"));
    drop(c);
    // Waiters: a default one, then one the objective ranks higher, then one that is cancelled.
    let mut low = api_call(epp, "POST", CHAT, &[], Some(chat(false))).await;
    assert!(eventually(Duration::from_secs(5), || queued(&gw) == 1).await);
    let objective = [("x-llm-d-inference-objective", "chat")];
    let mut high = api_call(epp, "POST", CHAT, &objective, Some(chat(false))).await;
    assert!(eventually(Duration::from_secs(5), || queued(&gw) == 2).await);
    let gone = api_call(epp, "POST", CHAT, &[], Some(chat(false))).await;
    assert!(eventually(Duration::from_secs(5), || queued(&gw) == 3).await);
    drop(gone);
    assert!(
        eventually(Duration::from_secs(2), || queued(&gw) == 2).await,
        "the reset waiter left the queue"
    );
    assert_eq!(inflight(&gw), vec![1], "while the worker is still held");
    respond_and_end(&mut holder, &addr, "application/json", "{}").await;
    let (h, echoed) = answer(&mut high).await;
    assert_eq!(destination(&h), addr, "the objective's waiter goes first");
    assert!(
        String::from_utf8_lossy(&echoed).ends_with(r#","priority":-10}"#),
        "vLLM schedules lower first: {}",
        String::from_utf8_lossy(&echoed)
    );
    assert_eq!(queued(&gw), 1, "the earlier default waiter still waits");
    respond_and_end(&mut high, &addr, "application/json", "{}").await;
    let (h, _) = answer(&mut low).await;
    assert_eq!(destination(&h), addr);
    respond_and_end(&mut low, &addr, "application/json", "{}").await;
    no_load_left(&gw).await;
    let text = metrics(&gw);
    for want in [
        r#"kvgate_flow_requests_total{class="sheddable",outcome="shed"} 2"#,
        r#"tenant="t9"}"#,
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    gw.shutdown().await;
}

/// The front door's authentication in the picker: no key → 401 local reply; with a key, the
/// client's credentials are removed from the request and the API key's tenant and priority
/// key its flow.
#[tokio::test]
async fn api_keys_authenticate_and_never_reach_the_worker() {
    let a = MockWorker::builder().spawn().await.unwrap();
    let gw = epp_gateway(&[&a], |c| {
        c.auth.keys.push(kvgate_gateway::config::ApiKeyConfig {
            key: "sk-team-a".into(),
            name: Some("team-a".into()),
            rate_per_s: None,
            burst: None,
            priority: Some(3),
            tenant: None,
        });
        c.flow_control.enabled = true;
        c.flow_control.tenants.insert("team-a".into(), 1.0);
    })
    .await;
    let epp = gw.epp_addr.unwrap();
    let mut c = api_call(epp, "POST", CHAT, &[], Some(chat(false))).await;
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 401);
    drop(c);
    let mut c = api_call(
        epp,
        "POST",
        CHAT,
        &[("authorization", "Bearer sk-team-a"), ("cookie", "c=1")],
        Some(chat(false)),
    )
    .await;
    let (h, _) = answer(&mut c).await;
    for k in ["authorization", "cookie", "x-api-key"] {
        assert!(removes(&h, k), "{k} removed");
    }
    let addr = a.url().trim_start_matches("http://").to_owned();
    respond_and_end(&mut c, &addr, "application/json", "{}").await;
    no_load_left(&gw).await;
    let text = metrics(&gw);
    assert!(
        text.contains(r#"kvgate_flow_admitted_tokens_total{class="default",tenant="team-a"}"#),
        "{text}"
    );
    gw.shutdown().await;
}

fn overlap_sum(gw: &Gateway) -> f64 {
    metrics(gw)
        .lines()
        .find_map(|l| l.strip_prefix("kvgate_predicted_overlap_ratio_sum "))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// Responses and Messages prompts are rendered and hashed through the front door's client-API
/// table (the second request with the same prompt goes where the first one's blocks are, and the
/// decision predicted the overlap); count_tokens goes by model; a Responses answer's id pins
/// its worker: GET / DELETE / cancel of `/v1/responses/{id}` go there alone (no fallbacks), an
/// unknown id is a 404 in the Responses shape with `x-should-retry: false`, and a DELETE that
/// the worker answers 2xx forgets the pin.
#[tokio::test]
async fn agent_apis_are_rendered_hashed_and_their_stored_responses_pinned() {
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |_| {}).await;
    let epp = gw.epp_addr.unwrap();
    let text = "the tide comes in over the long grey sand ".repeat(60);
    let responses = format!(r#"{{"model":"mock-model","input":"{text}","store":true}}"#);
    let mut first = api_call(epp, "POST", "/v1/responses", &[], Some(responses.clone())).await;
    let (h, echoed) = answer(&mut first).await;
    assert_eq!(echoed, Bytes::from(responses.clone()), "the body unchanged");
    let origin = picked(&h);
    assert_eq!(overlap_sum(&gw), 0.0);
    // The same prompt while the first is in flight: its blocks are on `origin`.
    let mut again = api_call(epp, "POST", "/v1/responses", &[], Some(responses)).await;
    let (h, _) = answer(&mut again).await;
    assert!(
        destination(&h).starts_with(&origin),
        "routed on the rendered prompt's blocks"
    );
    assert!(
        overlap_sum(&gw) > 0.5,
        "predicted overlap {}",
        overlap_sum(&gw)
    );
    let stored = r#"{"id":"resp_epp1","object":"response","status":"completed","model":"mock-model","output":[],"usage":{"input_tokens":9,"output_tokens":1,"total_tokens":10}}"#;
    respond_and_end(&mut first, &origin, "application/json", stored).await;
    respond_and_end(&mut again, &origin, "application/json", "{}").await;
    // Messages: rendered and hashed too.
    let before = overlap_sum(&gw);
    let messages = format!(
        r#"{{"model":"mock-model","max_tokens":8,"messages":[{{"role":"user","content":"{text}"}}]}}"#
    );
    for _ in 0..2 {
        let mut m = api_call(epp, "POST", "/v1/messages", &[], Some(messages.clone())).await;
        let (h, _) = answer(&mut m).await;
        respond_and_end(&mut m, &picked(&h), "application/json", "{}").await;
    }
    assert!(
        overlap_sum(&gw) > before,
        "the second Messages request hit the first's blocks"
    );
    // count_tokens and the pass-through endpoints: by model (optional with one model) and load,
    // as requests of their API (counted per endpoint); a pass-through body naming an unknown
    // model is the front door's 400.
    for (path, b) in [
        ("/v1/messages/count_tokens", messages.clone()),
        ("/tokenize", r#"{"prompt":"hello"}"#.to_owned()),
        (
            "/v1/rerank",
            r#"{"model":"mock-model","query":"q","documents":["a"]}"#.to_owned(),
        ),
    ] {
        let mut c = api_call(epp, "POST", path, &[], Some(b)).await;
        let (h, _) = answer(&mut c).await;
        respond_and_end(&mut c, &picked(&h), "application/json", "{}").await;
    }
    let text = metrics(&gw);
    for endpoint in ["messages_count_tokens", "tokenize", "rerank"] {
        assert!(
            text.contains(&format!("endpoint=\"{endpoint}\"")),
            "{endpoint}: {text}"
        );
    }
    let mut c = api_call(
        epp,
        "POST",
        "/v1/rerank",
        &[],
        Some(r#"{"model":"nope","query":"q","documents":["a"]}"#.into()),
    )
    .await;
    assert_eq!(immediate(&mut c).await.status.unwrap().code, 400);
    drop(c);
    // The stored response: its worker alone, whatever the load says.
    let mut busy = api_call(epp, "POST", CHAT, &[], Some(chat(false))).await;
    let (h, _) = answer(&mut busy).await;
    let busy_on = picked(&h);
    for (method, path) in [
        ("GET", "/v1/responses/resp_epp1"),
        (
            "GET",
            "/v1/responses/resp_epp1?stream=true&starting_after=2",
        ),
        ("POST", "/v1/responses/resp_epp1/cancel"),
    ] {
        let b = (method == "POST").then(String::new);
        let mut c = api_call(epp, method, path, &[], b).await;
        let (h, _) = answer(&mut c).await;
        assert_eq!(destination(&h), origin, "{method} {path}: the origin alone");
        respond_and_end(&mut c, &origin, "application/json", "{}").await;
    }
    // previous_response_id: pinned too.
    let follow = r#"{"model":"mock-model","input":"and then?","previous_response_id":"resp_epp1"}"#;
    let mut c = api_call(epp, "POST", "/v1/responses", &[], Some(follow.into())).await;
    let (h, _) = answer(&mut c).await;
    assert_eq!(destination(&h), origin);
    respond_and_end(&mut c, &origin, "application/json", "{}").await;
    let mut c = api_call(epp, "GET", "/v1/responses/resp_never", &[], None).await;
    let i = immediate(&mut c).await;
    assert_eq!(i.status.unwrap().code, 404);
    assert_eq!(header_of(&i, "x-should-retry").as_deref(), Some("false"));
    let body = String::from_utf8_lossy(&i.body).into_owned();
    assert!(
        body.contains("resp_never") && body.contains(r#""error""#),
        "{body}"
    );
    drop(c);
    let mut c = api_call(epp, "DELETE", "/v1/responses/resp_epp1", &[], None).await;
    let (h, _) = answer(&mut c).await;
    assert_eq!(destination(&h), origin);
    respond_and_end(&mut c, &origin, "application/json", r#"{"deleted":true}"#).await;
    let mut c = api_call(epp, "GET", "/v1/responses/resp_epp1", &[], None).await;
    assert_eq!(
        immediate(&mut c).await.status.unwrap().code,
        404,
        "forgotten"
    );
    drop(c);
    respond_and_end(&mut busy, &busy_on, "application/json", "{}").await;
    no_load_left(&gw).await;
    gw.shutdown().await;
}

/// An OTLP/HTTP collector that keeps every export body.
async fn collector() -> (String, std::sync::Arc<std::sync::Mutex<Vec<Bytes>>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = got.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let keep = keep.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let keep = keep.clone();
                        async move {
                            let b = req.into_body().collect().await.unwrap().to_bytes();
                            keep.lock().unwrap().push(b);
                            Ok::<_, std::convert::Infallible>(http::Response::new(
                                http_body_util::Full::new(Bytes::new()),
                            ))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (url, got)
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Tracing as at the front door: a request's `traceparent` is continued, the worker gets a
/// `traceparent` of the same trace naming the picker's upstream span (so the engine's spans
/// join), and the request's spans (request, route/queue, upstream) are exported when the
/// response ends; a request without one starts a trace.
#[tokio::test]
async fn traces_are_continued_and_handed_to_the_worker() {
    let (a, b) = two_workers().await;
    let (endpoint, exported) = collector().await;
    let gw = epp_gateway(&[&a, &b], |c| {
        c.tracing.otlp_endpoint = endpoint;
        c.tracing.sample_ratio = 1.0;
        c.tracing.batch_delay_ms = 20;
    })
    .await;
    let epp = gw.epp_addr.unwrap();
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let mut c = api_call(
        epp,
        "POST",
        CHAT,
        &[("traceparent", &parent)],
        Some(chat(true)),
    )
    .await;
    let (h, _) = answer(&mut c).await;
    let tp = set_header_of(&h, "traceparent").expect("traceparent for the worker");
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[1], trace_id, "the caller's trace goes on");
    assert_ne!(
        parts[2], "00f067aa0ba902b7",
        "a span of ours is the worker's parent"
    );
    assert_eq!(parts[3], "01");
    // Nothing is exported before the response ends.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(exported.lock().unwrap().is_empty());
    respond_and_end(
        &mut c,
        &picked(&h),
        "text/event-stream",
        &sse(&[r#"{"choices":[{"delta":{"content":"a"}}]}"#, "[DONE]"]),
    )
    .await;
    let (trace_bytes, span_bytes) = (unhex(trace_id), unhex(parts[2]));
    let has = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
    assert!(
        eventually(Duration::from_secs(5), || {
            exported.lock().unwrap().iter().any(|b| {
                has(b, &trace_bytes)
                    && has(b, &span_bytes)
                    && has(b, b"kvgate.upstream")
                    && has(b, b"kvgate.route")
            })
        })
        .await,
        "the request's spans, with the upstream span the worker was told of"
    );
    // No traceparent: a new trace, still handed on.
    let mut c = api_call(epp, "POST", CHAT, &[], Some(chat(false))).await;
    let (h, _) = answer(&mut c).await;
    let tp = set_header_of(&h, "traceparent").expect("traceparent");
    assert!(!tp.contains(trace_id));
    respond_and_end(&mut c, &picked(&h), "application/json", "{}").await;
    no_load_left(&gw).await;
    gw.shutdown().await;
}

/// `[[epp.model_rewrites]]`: a request for `alias` goes to `mock-model` (the body's model
/// replaced, every other byte kept, the new content-length; routed on the target's pool) and the
/// response says `alias` again; `x-llm-d-model-name-rewrite` forces a target; BUFFERED request
/// bodies get the new body as a body mutation.
#[tokio::test]
async fn model_rewrites_replace_the_model_route_on_the_target_and_restore_the_response() {
    use kvgate_gateway::config::{ModelRewriteConfig, RewriteTargetConfig};
    let (a, b) = two_workers().await;
    let gw = epp_gateway(&[&a, &b], |c| {
        c.epp.model_rewrites.push(ModelRewriteConfig {
            models: vec!["alias".into()],
            targets: vec![RewriteTargetConfig {
                model: "mock-model".into(),
                weight: 5,
            }],
        });
    })
    .await;
    let epp = gw.epp_addr.unwrap();
    let sent = chat(true).replace("mock-model", "alias");
    let mut c = api_call(epp, "POST", CHAT, &[], Some(sent.clone())).await;
    let (h, echoed) = answer(&mut c).await;
    let echoed = String::from_utf8(echoed.to_vec()).unwrap();
    let want = sent.replacen(r#""model":"alias""#, r#""model":"mock-model""#, 1);
    assert_eq!(
        echoed,
        format!(
            r#"{{"stream_options":{{"include_usage":true}},{}"#,
            &want[1..]
        ),
        "only the model changed (and include_usage asked for)"
    );
    assert_eq!(
        set_header_of(&h, "content-length"),
        Some(echoed.len().to_string())
    );
    let back = respond_and_end(
        &mut c,
        &picked(&h),
        "text/event-stream",
        &sse(&[
            r#"{"id":"c1","model":"mock-model","choices":[{"delta":{"content":"a"}}]}"#,
            "[DONE]",
        ]),
    )
    .await;
    let back = String::from_utf8(back.to_vec()).unwrap();
    assert!(
        back.contains(r#""model":"alias""#) && !back.contains("mock-model"),
        "{back}"
    );
    // Not a rule's model, but forced by the header.
    let mut c = api_call(
        epp,
        "POST",
        CHAT,
        &[("x-llm-d-model-name-rewrite", "mock-model")],
        Some(chat(false).replace("mock-model", "whatever")),
    )
    .await;
    let (h, echoed) = answer(&mut c).await;
    assert!(String::from_utf8_lossy(&echoed).contains(r#""model":"mock-model""#));
    let back = respond_and_end(
        &mut c,
        &picked(&h),
        "application/json",
        r#"{"id":"c2","model": "mock-model","choices":[]}"#,
    )
    .await;
    assert_eq!(
        &back[..],
        br#"{"id":"c2","model": "whatever","choices":[]}"#
    );
    // An unknown model with no rule: 404 as before.
    let mut c = api_call(
        epp,
        "POST",
        CHAT,
        &[],
        Some(chat(false).replace("mock-model", "nope")),
    )
    .await;
    assert_eq!(immediate(&mut c).await.status.unwrap().code, 404);
    drop(c);
    // BUFFERED: the body's answer carries the destination and the new body.
    let mut c = Call::open(epp, kvgate_gateway::epp::PROCESS_PATH).await;
    c.send(&first(
        protocol(pb::BodySendMode::Buffered, pb::BodySendMode::None).unwrap(),
        headers(&[(":method", "POST"), (":path", CHAT)], false),
    ));
    c.expect().await;
    let sent = chat(false).replace("mock-model", "alias");
    c.send(&msg(body(sent.clone(), true)));
    let r = c.expect().await;
    destination(&r);
    let Some(Response::RequestBody(br)) = &r.response else {
        panic!("{r:?}")
    };
    let common = br.response.as_ref().unwrap();
    let Some(pb::Mutation::Body(new)) = common.body_mutation.as_ref().unwrap().mutation.as_ref()
    else {
        panic!("a body mutation: {common:?}")
    };
    assert_eq!(&new[..], sent.replacen("alias", "mock-model", 1).as_bytes());
    let cl = common
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers
        .iter()
        .find(|h| h.header.as_ref().unwrap().key == "content-length")
        .map(|h| String::from_utf8(h.header.as_ref().unwrap().raw_value.clone()).unwrap());
    assert_eq!(cl, Some(new.len().to_string()));
    c.close();
    while c.recv().await.is_some() {}
    no_load_left(&gw).await;
    assert!(
        metrics(&gw).contains(r#"kvgate_epp_model_rewrites_total{model="mock-model"} 3"#),
        "{}",
        metrics(&gw)
    );
    gw.shutdown().await;
}

/// `/v1/messages` local replies are Anthropic's shape from the first message on: a body over
/// `server.max_body_bytes` (413 `request_too_large`) and an unknown model (404
/// `not_found_error`), as at the front door.
#[tokio::test]
async fn messages_get_anthropic_local_replies() {
    let a = MockWorker::builder().spawn().await.unwrap();
    let gw = epp_gateway(&[&a], |c| c.server.max_body_bytes = 1024).await;
    let epp = gw.epp_addr.unwrap();
    let big = format!(
        r#"{{"model":"mock-model","max_tokens":8,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2000)
    );
    let small = r#"{"model":"nope","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    for (b, status, typ) in [
        (big, 413, "request_too_large"),
        (small.to_owned(), 404, "not_found_error"),
    ] {
        let mut c = api_call(epp, "POST", "/v1/messages", &[], Some(b)).await;
        let i = immediate(&mut c).await;
        assert_eq!(i.status.unwrap().code, status);
        let j: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
        assert_eq!(j["type"], "error", "{j}");
        assert_eq!(j["error"]["type"], typ, "{j}");
    }
    no_load_left(&gw).await;
    gw.shutdown().await;
}
