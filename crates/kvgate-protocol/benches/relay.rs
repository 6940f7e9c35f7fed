//! The response observer's per-stream cost: kvgate-protocol's `sse::Relay` on a vLLM-like chat
//! stream (a role chunk, 64 content chunks and a finish chunk with `"usage": null`, the
//! usage-only event, `[DONE]`; one event per chunk), watching only and stripping what the gateway
//! asked for, and its two parts (`SseScanner`, `ChunkInfo::scan`) alone.
//!
//! `cargo bench -p kvgate-protocol --bench relay`
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_protocol::sse::{ChunkInfo, Relay, SseScanner};

fn stream() -> Vec<Vec<u8>> {
    let head = r#"{"id":"chatcmpl-3f1c","object":"chat.completion.chunk","created":1732500000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":"#;
    let mut evs = vec![format!("data: {head}{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n")];
    for i in 0..64 {
        evs.push(format!("data: {head}{{\"content\":\" tok{i}\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n"));
    }
    evs.push(format!(
        "data: {head}{{}},\"logprobs\":null,\"finish_reason\":\"length\"}}],\"usage\":null}}\n\n"
    ));
    evs.push(r#"data: {"id":"chatcmpl-3f1c","object":"chat.completion.chunk","created":1732500000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":812,"total_tokens":876,"completion_tokens":64,"prompt_tokens_details":{"cached_tokens":768}}}"#.to_string() + "\n\n");
    evs.push("data: [DONE]\n\n".into());
    evs.into_iter().map(String::into_bytes).collect()
}

fn relay_stream(chunks: &[Vec<u8>], strip: bool) -> (u32, u64) {
    let mut r = Relay::new(strip, 1 << 20);
    let (mut tokens, mut out) = (0u32, 0u64);
    for c in chunks {
        // The gateway's observer reads the clock once per chunk.
        std::hint::black_box(Instant::now());
        r.feed(c, |ev| tokens += u32::from(ev.has_token));
        if let Some(o) = r.take_out() {
            out += o.len() as u64;
        }
    }
    (tokens, out)
}

fn bench(c: &mut Criterion) {
    let chunks = stream();
    let payloads: Vec<Vec<u8>> = chunks.iter().map(|c| c[6..c.len() - 2].to_vec()).collect();
    let mut g = c.benchmark_group("observer_stream");
    g.bench_function("relay_watch", |b| {
        b.iter(|| relay_stream(std::hint::black_box(&chunks), false))
    });
    g.bench_function("relay_strip", |b| {
        b.iter(|| relay_stream(std::hint::black_box(&chunks), true))
    });
    g.bench_function("scanner_only", |b| {
        b.iter(|| {
            let mut s = SseScanner::new(1 << 20);
            let mut n = 0usize;
            for c in &chunks {
                s.feed(std::hint::black_box(c), |e| n += e.data.len());
            }
            n
        })
    });
    g.bench_function("chunk_info_only", |b| {
        b.iter(|| {
            payloads
                .iter()
                .filter(|p| ChunkInfo::scan(std::hint::black_box(p)).has_token)
                .count()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
