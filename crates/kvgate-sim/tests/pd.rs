//! Prefill/decode disaggregation with vLLM NIXL semantics, over real sockets on 127.0.0.1:0:
//! a prefill leg pins its blocks and names them in `kv_transfer_params`, a decode leg pulls what
//! it lacks, reports it as cached and frees the prefill worker's blocks; leases, roles, faults.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use kvgate_sim::{PdConfig, Role, SimConfig, SimHandle, SimWorker};
use serde_json::{json, Value};
use support::*;

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn cfg(role: Role) -> SimConfig {
    SimConfig::default()
        .speedup(0.0)
        .num_gpu_blocks(512usize)
        .pd(PdConfig {
            role,
            ..PdConfig::default()
        })
}

async fn spawn(c: SimConfig) -> SimHandle {
    SimWorker::spawn(c, local(), None).await.unwrap()
}

fn prefill_body(prompt: &[u32]) -> Value {
    json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 1, "stream": false,
           "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
               "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}})
}

/// Polls the pinned-block gauge until it equals `want` (generous deadline, no fixed sleep).
async fn wait_pinned(w: &SimHandle, want: usize) {
    let reached = eventually(PATIENCE, || w.metrics().pd.pinned_blocks == want).await;
    let got = w.metrics().pd.pinned_blocks;
    assert!(reached, "pinned blocks stayed {got}, want {want}");
}

#[tokio::test]
async fn handoff_pins_pulls_reports_cached_and_frees() {
    let p = spawn(cfg(Role::Prefill)).await;
    let d = spawn(cfg(Role::Decode)).await;
    let c = client();
    let prompt = ids(7, 200); // 12 full blocks + 8 tokens → 13 blocks
    let (st, a) = post(
        &c,
        &format!("{}/v1/completions", p.base_url()),
        &prefill_body(&prompt),
    )
    .await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 1);
    let params = a["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{a}");
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_port"], p.http_addr().port());
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 13);
    assert_eq!(p.metrics().pd.pinned_blocks, 13);
    assert_eq!(p.metrics().pd.pinned_requests, 1);

    // Decode leg: the original body plus P's params.
    let body = json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 5,
                      "ignore_eos": true, "kv_transfer_params": params});
    let (st, b) = post(&c, &format!("{}/v1/completions", d.base_url()), &body).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["usage"]["completion_tokens"], 5);
    // Pulled tokens count as cached: all but the recomputed last one.
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 199);
    assert_eq!(b["kv_transfer_params"], Value::Null);
    assert_eq!(p.metrics().pd.pinned_blocks, 0, "the read freed P's blocks");
    let dm = d.metrics();
    assert_eq!(dm.pd.xfer_time.count(), 1);
    assert_eq!(dm.pd.bytes.sum(), 199.0 * 131_072.0);
    assert_eq!(dm.engine.remote_prefill_tokens, 199);
    assert_eq!(dm.engine.prefix_cache_hits, 0, "nothing was local");

    // A second read of the same params fails: the blocks are gone (default policy: fail).
    let (st, e) = post(&c, &format!("{}/v1/completions", d.base_url()), &body).await;
    assert_eq!(st, 500, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV transfer"),
        "{e}"
    );
    assert_eq!(d.metrics().pd.failed_transfers, 1);

    let (_, text, _) = get_text(&c, &format!("{}/metrics", p.base_url())).await;
    assert!(
        text.contains("kvgate_sim_pd_pinned_blocks{engine=\"0\",model_name=\"kvgate-sim\"} 0.0")
    );
    let (_, text, _) = get_text(&c, &format!("{}/metrics", d.base_url())).await;
    assert!(
        text.contains("vllm:nixl_num_failed_transfers{engine=\"0\",model_name=\"kvgate-sim\"} 1.0")
    );
    assert!(text.contains("vllm:nixl_xfer_time_seconds_count"));
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn decode_pulls_only_what_its_cache_lacks() {
    let p = spawn(cfg(Role::Prefill)).await;
    let d = spawn(cfg(Role::Decode)).await;
    let c = client();
    let prompt = ids(9, 100); // 6 full blocks + 4
                              // Warm D's cache with the same prompt (a plain request).
    let plain = json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 1});
    let (st, _) = post(&c, &format!("{}/v1/completions", d.base_url()), &plain).await;
    assert_eq!(st, 200);
    let (_, a) = post(
        &c,
        &format!("{}/v1/completions", p.base_url()),
        &prefill_body(&prompt),
    )
    .await;
    let body = json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 2,
                      "kv_transfer_params": a["kv_transfer_params"]});
    let (st, b) = post(&c, &format!("{}/v1/completions", d.base_url()), &body).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 99);
    // 96 tokens were local (6 blocks); only 3 were pulled.
    assert_eq!(d.metrics().engine.remote_prefill_tokens, 3);
    assert_eq!(d.metrics().pd.bytes.sum(), 3.0 * 131_072.0);
    assert_eq!(
        p.metrics().pd.pinned_blocks,
        0,
        "a full local hit still notifies P"
    );
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn lease_expiry_frees_blocks_and_decode_cannot_read() {
    let mut pc = cfg(Role::Prefill);
    // Long enough that the pinned blocks are still there when the test reads the gauge right
    // after the answer, however late a busy machine runs it; short enough to wait out.
    pc.pd.kv_lease = Duration::from_secs(1);
    let p = spawn(pc).await;
    let mut dc = cfg(Role::Decode);
    let d = spawn(dc.clone()).await;
    let c = client();
    let prompt = ids(3, 64);
    let (_, a) = post(
        &c,
        &format!("{}/v1/completions", p.base_url()),
        &prefill_body(&prompt),
    )
    .await;
    assert_eq!(p.metrics().pd.pinned_blocks, 4, "{a}");
    wait_pinned(&p, 0).await;
    assert_eq!(p.metrics().pd.expired_reqs, 1);
    let body = json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 2,
                      "kv_transfer_params": a["kv_transfer_params"]});
    let (st, e) = post(&c, &format!("{}/v1/completions", d.base_url()), &body).await;
    assert_eq!(st, 500, "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("expired"),
        "{e}"
    );
    d.shutdown().await;

    // With kv_load_failure_policy=recompute the decode worker computes the prompt itself.
    dc.pd.load_failure_policy = kvgate_sim::LoadFailurePolicy::Recompute;
    let d = spawn(dc).await;
    let (st, b) = post(&c, &format!("{}/v1/completions", d.base_url()), &body).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(d.metrics().pd.failed_transfers, 1);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn roles_refuse_the_wrong_leg_and_bad_params() {
    let p = spawn(cfg(Role::Prefill)).await;
    let d = spawn(cfg(Role::Decode)).await;
    let c = client();
    let prompt = ids(1, 40);
    let (st, e) = post(
        &c,
        &format!("{}/v1/completions", d.base_url()),
        &prefill_body(&prompt),
    )
    .await;
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "kv_transfer_params");
    let dec = json!({"prompt": prompt, "kv_transfer_params": {"do_remote_prefill": true,
        "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "1"}});
    let (st, _) = post(&c, &format!("{}/v1/completions", p.base_url()), &dec).await;
    assert_eq!(st, 400);
    let missing = json!({"prompt": prompt, "kv_transfer_params": {"do_remote_prefill": true}});
    let (st, e) = post(&c, &format!("{}/v1/completions", d.base_url()), &missing).await;
    assert_eq!(st, 400, "{e}");
    let (st, _) = post(
        &c,
        &format!("{}/v1/completions", p.base_url()),
        &json!({"prompt": prompt, "kv_transfer_params": 3}),
    )
    .await;
    assert_eq!(st, 400);
    let mut n2 = prefill_body(&prompt);
    n2["n"] = json!(2);
    let (st, _) = post(&c, &format!("{}/v1/completions", p.base_url()), &n2).await;
    assert_eq!(st, 400);
    // Plain requests run anywhere (conditional disaggregation runs them on decode workers).
    let (st, _) = post(
        &c,
        &format!("{}/v1/completions", d.base_url()),
        &json!({"prompt": prompt, "max_tokens": 2}),
    )
    .await;
    assert_eq!(st, 200);
    // A prefill leg that stopped on EOS (not length-capped) returns null params and pins nothing.
    let mut eos = prefill_body(&prompt);
    eos["max_tokens"] = json!(1000);
    let (st, a) = post(&c, &format!("{}/v1/completions", p.base_url()), &eos).await;
    assert_eq!(st, 200);
    assert_eq!(a["choices"][0]["finish_reason"], "stop", "{a}");
    assert_eq!(a["kv_transfer_params"], Value::Null);
    assert_eq!(p.metrics().pd.pinned_blocks, 0);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn faults_prefill_fails_and_no_params() {
    let mut fc = cfg(Role::Prefill);
    fc.pd.prefill_fail_rate = 1.0;
    let p = spawn(fc).await;
    let c = client();
    let prompt = ids(2, 40);
    let (st, e) = post(
        &c,
        &format!("{}/v1/completions", p.base_url()),
        &prefill_body(&prompt),
    )
    .await;
    assert_eq!(st, 500, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("prefill"));
    p.shutdown().await;

    let mut nc = cfg(Role::Prefill);
    nc.pd.no_params_rate = 1.0;
    let p = spawn(nc).await;
    let (st, a) = post(
        &c,
        &format!("{}/v1/completions", p.base_url()),
        &prefill_body(&prompt),
    )
    .await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["kv_transfer_params"], Value::Null);
    assert_eq!(p.metrics().pd.pinned_blocks, 0);
    p.shutdown().await;
}

#[tokio::test]
async fn slow_transfer_is_charged_by_the_model() {
    let p = spawn(cfg(Role::Prefill)).await;
    // speedup 1000 with 0.001 GB/s: 63 tokens × 131072 B = 8.26 MB → 8257 ms + 1 ms model time,
    // 8.3 ms real. The histogram records what was slept, never less than the model asked.
    let mut dc = cfg(Role::Decode).speedup(1000.0);
    dc.pd.kv_transfer_gbps = 0.001;
    let d = spawn(dc.clone()).await;
    let c = client();
    let prompt = ids(4, 64);
    let (_, a) = post(
        &c,
        &format!("{}/v1/completions", p.base_url()),
        &prefill_body(&prompt),
    )
    .await;
    let body = json!({"prompt": prompt, "max_tokens": 1,
                      "kv_transfer_params": a["kv_transfer_params"]});
    let (st, _) = post(&c, &format!("{}/v1/completions", d.base_url()), &body).await;
    assert_eq!(st, 200);
    let want = dc.pd.transfer_ms(63) / 1000.0 / 1000.0;
    assert!((want - 0.00826).abs() < 1e-4, "model {want}");
    assert!(d.metrics().pd.xfer_time.sum() >= want);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn decode_aborted_mid_transfer_still_frees_prefill_blocks() {
    let p = spawn(cfg(Role::Prefill)).await;
    // A transfer that would take ~1000 s of real time: the client gives up long before.
    let mut dc = cfg(Role::Decode).speedup(1.0);
    dc.pd.kv_transfer_gbps = 0.000_01;
    let d = spawn(dc).await;
    let c = client();
    let prompt = ids(5, 64);
    let (_, a) = post(
        &c,
        &format!("{}/v1/completions", p.base_url()),
        &prefill_body(&prompt),
    )
    .await;
    assert_eq!(p.metrics().pd.pinned_blocks, 4);
    let body = json!({"prompt": prompt, "max_tokens": 1,
                      "kv_transfer_params": a["kv_transfer_params"]});
    let url = format!("{}/v1/completions", d.base_url());
    let call = tokio::spawn(async move {
        let c = client();
        post(&c, &url, &body).await
    });
    // Abort once the decode worker's pull is under way, not after a guessed delay.
    until(
        PATIENCE,
        "the decode leg to reach the decode worker",
        || d.metrics().pd.pulls_in_flight > 0,
    )
    .await;
    call.abort();
    wait_pinned(&p, 0).await;
    assert_eq!(
        p.metrics().pd.expired_reqs,
        0,
        "freed by the notification, not the lease"
    );
    p.shutdown().await;
    d.shutdown().await;
}
