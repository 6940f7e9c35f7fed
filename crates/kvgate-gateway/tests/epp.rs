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
