//! The Responses and Messages clients against a simulated vLLM worker on 127.0.0.1:0: the agent
//! workload through each API, timing and cached tokens read from each API's own fields, and
//! `previous_response_id` chains that need the worker's response store.

use std::net::SocketAddr;
use std::time::Duration;

use kvgate_bench::client::{Api, Target};
use kvgate_bench::runner::{run, Arrival, RunConfig};
use kvgate_bench::stats::Outcome;
use kvgate_bench::workload::agentic::Agentic;
use kvgate_bench::workload::Workload;
use kvgate_sim::{SimConfig, SimWorker};

fn workload() -> Workload {
    Agentic {
        sessions: 6,
        turns: 3,
        system_prompts: 2,
        system_tokens: 64,
        user_tokens: 16,
        tool_tokens: 32,
        ..Agentic::default()
    }
    .build(4, 7)
    .unwrap()
}

async fn drive(api: Api, store: bool, chain_share: f64) -> Vec<Outcome> {
    let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let cfg = SimConfig::default()
        .model("m")
        .speedup(0.0)
        .num_gpu_blocks(2048usize)
        .responses_store(store);
    let w = SimWorker::spawn(cfg, local, None).await.unwrap();
    let target = Target::new(&w.base_url(), "m", api, Duration::from_secs(30))
        .unwrap()
        .with_chain_share(chain_share)
        .unwrap();
    let wl = workload();
    let cfg = RunConfig {
        arrival: Arrival::Closed { concurrency: 3 },
        max_requests: None,
        duration: None,
        progress: false,
    };
    let res = run(&target, &wl, &cfg).await.unwrap();
    w.shutdown().await;
    assert_eq!(res.outcomes.len(), wl.requests.len());
    res.outcomes
}

fn check_measured(api: Api, outcomes: &[Outcome]) {
    let mut cached = 0;
    for o in outcomes {
        assert!(o.ok(), "{api:?}: {o:?}");
        assert!(o.ttft.is_some(), "{api:?}: TTFT at the first delta");
        assert_eq!(o.output_tokens, 4, "{api:?}");
        assert_eq!(o.itl.len(), 3, "{api:?}: a gap per later delta");
        cached += o.cached_tokens.expect("cached tokens reported");
    }
    assert!(cached > 0, "{api:?}: sessions reuse their prefixes");
}

#[tokio::test]
async fn the_agent_workload_runs_through_every_api_and_messages_renders_like_chat() {
    let chat = drive(Api::Chat, false, 0.0).await;
    let responses = drive(Api::Responses, false, 0.0).await;
    let messages = drive(Api::Messages, false, 0.0).await;
    check_measured(Api::Chat, &chat);
    check_measured(Api::Responses, &responses);
    check_measured(Api::Messages, &messages);
    // vLLM turns a Messages body into the same chat conversation (billing header dropped,
    // tool_use → tool_calls, tool_result → tool message): the same prompt, request by request.
    // (Requests finish in any order under concurrency: compare the sorted lengths.)
    let tokens = |o: &[Outcome]| {
        let mut v: Vec<u64> = o.iter().map(|o| o.prompt_tokens).collect();
        v.sort();
        v
    };
    assert_eq!(tokens(&chat), tokens(&messages));
    assert_ne!(
        tokens(&chat),
        tokens(&responses),
        "Responses renders tool calls apart"
    );
}

#[tokio::test]
async fn responses_chains_need_the_workers_store() {
    // Every session chains: without the store every later turn is a 404.
    let off = drive(Api::Responses, false, 1.0).await;
    let failed = off.iter().filter(|o| !o.ok()).count();
    assert!(failed > 0, "chained turns fail without the store");
    assert!(off
        .iter()
        .filter_map(|o| o.error.as_deref())
        .all(|e| e == "http_404"));
    let on = drive(Api::Responses, true, 1.0).await;
    check_measured(Api::Responses, &on);
}
