//! TensorRT-LLM's context-first handoff (`--pd-protocol trtllm`) over real sockets: the context
//! leg pins its blocks and answers with `choices[0].disaggregated_params`; the generation leg with
//! those params (as `generation_only`) pulls them and frees the context worker's blocks.

mod support;

use std::net::SocketAddr;

use kvgate_sim::{PdConfig, PdProtocol, Role, SimConfig, SimHandle, SimWorker};
use serde_json::{json, Value};
use support::*;

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn spawn(role: Role) -> SimHandle {
    let c = SimConfig::default()
        .speedup(0.0)
        .num_gpu_blocks(512usize)
        .pd(PdConfig {
            role,
            protocol: PdProtocol::Trtllm,
            ..PdConfig::default()
        });
    SimWorker::spawn(c, local(), None).await.unwrap()
}

#[tokio::test]
async fn context_then_generation() {
    let p = spawn(Role::Prefill).await;
    let d = spawn(Role::Decode).await;
    let c = client();
    let prompt = ids(9, 100);
    let ctx_body = json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 8,
        "ignore_eos": true, "stream": false, "stream_options": null,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 77}});
    let (st, a) = post(&c, &format!("{}/v1/completions", p.base_url()), &ctx_body).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["usage"]["completion_tokens"], 1, "one token: {a}");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    let mut params = a["choices"][0]["disaggregated_params"].clone();
    assert_eq!(params["disagg_request_id"], 77, "{a}");
    assert!(params["ctx_request_id"].is_u64(), "{a}");
    assert_eq!(
        params["ctx_info_endpoint"],
        format!("127.0.0.1:{}", p.http_addr().port())
    );
    assert!(p.metrics().pd.pinned_blocks > 0);
    params["request_type"] = json!("generation_only");
    let gen_body = json!({"model": "kvgate-sim", "prompt": prompt, "max_tokens": 8,
        "ignore_eos": true, "disaggregated_params": params});
    let (st, g) = post(&c, &format!("{}/v1/completions", d.base_url()), &gen_body).await;
    assert_eq!(st, 200, "{g}");
    assert_eq!(g["usage"]["completion_tokens"], 8, "{g}");
    assert_eq!(p.metrics().pd.pinned_blocks, 0, "read and freed");
    assert_eq!(d.metrics().pd.xfer_time.count(), 1);

    // The wrong leg on a worker, and a generation leg without an endpoint, are refused.
    let (st, _) = post(&c, &format!("{}/v1/completions", d.base_url()), &ctx_body).await;
    assert_eq!(st, 400);
    let bad = json!({"prompt": prompt, "disaggregated_params":
        {"request_type": "generation_only", "ctx_request_id": 1}});
    let (st, v): (u16, Value) = post(&c, &format!("{}/v1/completions", d.base_url()), &bad).await;
    assert_eq!(st, 400, "{v}");
    p.shutdown().await;
    d.shutdown().await;
}
