//! Prefill/decode disaggregation with SGLang's bootstrap handoff (`--pd-protocol sglang`), over
//! real sockets on 127.0.0.1:0: the same body goes to both workers with `bootstrap_host/port/
//! room`; the legs meet in a room on the prefill worker whichever arrives first, a leg whose
//! partner never comes fails after the bootstrap timeout, and a leg that goes away leaves no room
//! behind.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use kvgate_sim::{PdConfig, PdProtocol, Role, SimConfig, SimHandle, SimWorker};
use serde_json::{json, Value};
use support::*;

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn cfg(role: Role, timeout: Duration) -> SimConfig {
    SimConfig::default()
        .speedup(0.0)
        .num_gpu_blocks(512usize)
        .pd(PdConfig {
            role,
            protocol: PdProtocol::Sglang,
            bootstrap_timeout: timeout,
            ..PdConfig::default()
        })
}

async fn spawn(c: SimConfig) -> SimHandle {
    SimWorker::spawn(c, local(), None).await.unwrap()
}

/// The body both legs get: the client's plus the three bootstrap fields naming `p`.
fn body(p: &SimHandle, prompt: &[u32], room: u64, max_tokens: u32) -> Value {
    json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
           "bootstrap_host": "127.0.0.1", "bootstrap_port": p.http_addr().port(),
           "bootstrap_room": room})
}

/// Polls `f` on `w`'s metrics until it holds (generous deadline, no fixed sleep decides).
async fn until(w: &SimHandle, what: &str, f: impl Fn(&kvgate_sim::metrics::Metrics) -> bool) {
    kvgate_testkit::until(PATIENCE, what, || f(&w.metrics())).await
}

fn leg(url: String, b: Value) -> tokio::task::JoinHandle<(u16, Value)> {
    tokio::spawn(async move {
        let c = client();
        post(&c, &url, &b).await
    })
}

const LONG: Duration = Duration::from_secs(60);

#[tokio::test]
async fn prefill_first_then_decode_meet_and_decode_reports_usage() {
    let p = spawn(cfg(Role::Prefill, LONG)).await;
    let d = spawn(cfg(Role::Decode, LONG)).await;
    let prompt = ids(3, 100);
    let b = body(&p, &prompt, 42, 6);
    let pl = leg(format!("{}/v1/completions", p.base_url()), b.clone());
    until(&p, "prefill leg waits for its decode leg", |m| {
        m.pd.bootstrap_waiting == 1 && m.pd.bootstrap_rooms == 1
    })
    .await;
    let (st, dv) = post(&client(), &format!("{}/v1/completions", d.base_url()), &b).await;
    assert_eq!(st, 200, "{dv}");
    let (st, pv) = pl.await.unwrap();
    assert_eq!(st, 200, "{pv}");
    assert_eq!(pv["usage"]["completion_tokens"], 1, "{pv}");
    assert_eq!(dv["usage"]["completion_tokens"], 6, "{dv}");
    assert_eq!(dv["usage"]["prompt_tokens"], 100, "{dv}");
    // The transferred tokens are not reported as cached (SGLang's decode side), unlike vLLM's.
    assert_eq!(
        dv["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{dv}"
    );
    assert_eq!(d.metrics().pd.xfer_time.count(), 1);
    let pm = p.metrics();
    assert_eq!((pm.pd.bootstrap_rooms, pm.pd.bootstrap_waiting), (0, 0));
    assert_eq!(pm.pd.bootstrap_timeouts, 0);
    assert_eq!(
        pm.pd.bootstrap_wait.count(),
        2,
        "the prefill leg and the join"
    );
    assert_eq!(d.metrics().pd.bootstrap_waiting, 0);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn decode_first_then_prefill_meet() {
    let p = spawn(cfg(Role::Prefill, LONG)).await;
    let d = spawn(cfg(Role::Decode, LONG)).await;
    let prompt = ids(4, 80);
    let b = body(&p, &prompt, 7, 3);
    let dl = leg(format!("{}/v1/completions", d.base_url()), b.clone());
    until(&p, "the decode leg joined room 7", |m| {
        m.pd.bootstrap_rooms == 1
    })
    .await;
    until(&d, "the decode leg waits", |m| m.pd.bootstrap_waiting == 1).await;
    let (st, pv) = post(&client(), &format!("{}/v1/completions", p.base_url()), &b).await;
    assert_eq!(st, 200, "{pv}");
    let (st, dv) = dl.await.unwrap();
    assert_eq!(st, 200, "{dv}");
    assert_eq!(dv["usage"]["completion_tokens"], 3, "{dv}");
    assert_eq!(p.metrics().pd.bootstrap_rooms, 0);
    assert_eq!(d.metrics().pd.bootstrap_waiting, 0);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn a_partner_that_never_comes_times_out_without_a_leak() {
    let t = Duration::from_millis(200);
    let p = spawn(cfg(Role::Prefill, t)).await;
    let d = spawn(cfg(Role::Decode, t)).await;
    let prompt = ids(5, 40);
    // A prefill leg alone.
    let (st, v) = post(
        &client(),
        &format!("{}/v1/completions", p.base_url()),
        &body(&p, &prompt, 1, 2),
    )
    .await;
    assert_eq!(st, 500, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("did not come"),
        "{v}"
    );
    assert_eq!(p.metrics().pd.bootstrap_timeouts, 1);
    // A decode leg alone.
    let (st, v) = post(
        &client(),
        &format!("{}/v1/completions", d.base_url()),
        &body(&p, &prompt, 2, 2),
    )
    .await;
    assert_eq!(st, 500, "{v}");
    assert!(p.metrics().pd.bootstrap_timeouts + d.metrics().pd.bootstrap_timeouts >= 2);
    until(&p, "no room left", |m| {
        m.pd.bootstrap_rooms == 0 && m.pd.bootstrap_waiting == 0
    })
    .await;
    assert_eq!(d.metrics().pd.bootstrap_waiting, 0);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn a_leg_that_goes_away_leaves_no_room() {
    let p = spawn(cfg(Role::Prefill, LONG)).await;
    let d = spawn(cfg(Role::Decode, LONG)).await;
    let prompt = ids(6, 40);
    // The decode leg's client leaves while it waits for its prefill leg.
    let dl = leg(
        format!("{}/v1/completions", d.base_url()),
        body(&p, &prompt, 9, 2),
    );
    until(&p, "the decode leg joined", |m| m.pd.bootstrap_rooms == 1).await;
    dl.abort();
    until(&p, "the room is gone", |m| m.pd.bootstrap_rooms == 0).await;
    until(&d, "nothing waits on the decode worker", |m| {
        m.pd.bootstrap_waiting == 0
    })
    .await;
    // The prefill leg's client leaves while it waits for its decode leg.
    let pl = leg(
        format!("{}/v1/completions", p.base_url()),
        body(&p, &prompt, 10, 2),
    );
    until(&p, "the prefill leg waits", |m| m.pd.bootstrap_waiting == 1).await;
    pl.abort();
    until(&p, "the room is gone", |m| {
        m.pd.bootstrap_rooms == 0 && m.pd.bootstrap_waiting == 0
    })
    .await;
    assert_eq!(p.metrics().pd.bootstrap_timeouts, 0, "not by the timeout");
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn bad_bootstrap_fields_are_refused_and_both_role_ignores_them() {
    let p = spawn(cfg(Role::Prefill, LONG)).await;
    let d = spawn(cfg(Role::Decode, LONG)).await;
    let both = spawn(cfg(Role::Both, LONG)).await;
    let prompt = ids(8, 20);
    let c = client();
    let mut b = body(&p, &prompt, 3, 2);
    b["bootstrap_port"] = Value::Null;
    let (st, v) = post(&c, &format!("{}/v1/completions", d.base_url()), &b).await;
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("bootstrap_port"))
    );
    let mut b = body(&p, &prompt, 3, 2);
    b["bootstrap_room"] = json!(-1);
    let (st, _) = post(&c, &format!("{}/v1/completions", p.base_url()), &b).await;
    assert_eq!(st, 400);
    let mut b = body(&p, &prompt, 3, 2);
    b["n"] = json!(2);
    let (st, _) = post(&c, &format!("{}/v1/completions", p.base_url()), &b).await;
    assert_eq!(st, 400);
    // A `both` worker serves the body as a plain request (SGLang's disaggregation mode null).
    let (st, v) = post(
        &c,
        &format!("{}/v1/completions", both.base_url()),
        &body(&p, &prompt, 3, 2),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    // The bootstrap route lives on prefill workers only.
    let (st, _) = post(
        &c,
        &format!("{}/sim/bootstrap", d.base_url()),
        &json!({"bootstrap_room": 3}),
    )
    .await;
    assert_eq!(st, 400);
    p.shutdown().await;
    d.shutdown().await;
    both.shutdown().await;
}

/// `smg launch --pd-disaggregation --prefill URL` (no port) sends `bootstrap_port: null`; SGLang's
/// decode side then uses its own configured bootstrap port, the sim's
/// `--disaggregation-bootstrap-port` (here: the prefill worker's HTTP port).
#[tokio::test]
async fn a_null_bootstrap_port_uses_the_configured_one() {
    let p = spawn(cfg(Role::Prefill, LONG)).await;
    let mut dc = cfg(Role::Decode, LONG);
    dc.pd.bootstrap_port = Some(p.http_addr().port());
    let d = spawn(dc).await;
    let prompt = ids(9, 40);
    for null_or_absent in [true, false] {
        let room = if null_or_absent { 7 } else { 8 };
        let mut b = body(&p, &prompt, room, 3);
        if null_or_absent {
            b["bootstrap_port"] = Value::Null;
        } else if let Some(o) = b.as_object_mut() {
            o.remove("bootstrap_port");
        }
        let pl = leg(format!("{}/v1/completions", p.base_url()), b.clone());
        let (st, dv) = post(&client(), &format!("{}/v1/completions", d.base_url()), &b).await;
        assert_eq!(st, 200, "{dv}");
        assert_eq!(dv["usage"]["completion_tokens"], 3, "{dv}");
        let (st, pv) = pl.await.unwrap();
        assert_eq!(st, 200, "{pv}");
    }
    assert_eq!(d.metrics().pd.xfer_time.count(), 2);
    let pm = p.metrics();
    assert_eq!((pm.pd.bootstrap_rooms, pm.pd.bootstrap_waiting), (0, 0));
    // An explicit port still wins, and a bad one is still refused.
    let mut b = body(&p, &prompt, 9, 2);
    b["bootstrap_port"] = json!("x");
    let (st, v) = post(&client(), &format!("{}/v1/completions", d.base_url()), &b).await;
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("bootstrap_port"))
    );
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn server_info_announces_the_role_and_the_bootstrap_port() {
    let p = spawn(cfg(Role::Prefill, LONG)).await;
    let d = spawn(cfg(Role::Decode, LONG)).await;
    let b = spawn(cfg(Role::Both, LONG)).await;
    let info = |h: &SimHandle, path: &'static str| {
        let url = format!("{}{path}", h.base_url());
        async move {
            let (st, body, _) = get_text(&client(), &url).await;
            assert_eq!(st, 200, "{url}: {body}");
            serde_json::from_str::<Value>(&body).unwrap()
        }
    };
    let v = info(&p, "/server_info").await;
    assert_eq!(v["disaggregation_mode"], "prefill");
    // The sim's bootstrap server is its HTTP port.
    assert_eq!(v["disaggregation_bootstrap_port"], p.http_addr().port());
    assert_eq!(v["page_size"], 16);
    assert_eq!(v["max_total_num_tokens"], 511 * 16);
    assert_eq!(v["served_model_name"], "kvgate-sim");
    assert_eq!(info(&p, "/get_server_info").await, v, "the legacy path");
    let v = info(&d, "/server_info").await;
    assert_eq!(v["disaggregation_mode"], "decode");
    assert_eq!(v["disaggregation_bootstrap_port"], 8998);
    assert_eq!(
        info(&b, "/server_info").await["disaggregation_mode"],
        "null"
    );
    // A vLLM-protocol sim is a vLLM server: no such route.
    let vllm = spawn(SimConfig::default().speedup(0.0)).await;
    for path in ["/server_info", "/get_server_info"] {
        let (st, _, _) = get_text(&client(), &format!("{}{path}", vllm.base_url())).await;
        assert_eq!(st, 404, "{path}");
    }
}
