//! Throughput of the per-message work of the fleet tasks: KV-event decoding (both msgpack shapes),
//! applying a batch to the index, and parsing a vLLM `/metrics` page.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvgate_core::{KvIndex, WorkerId};
use kvgate_fleet::apply_batch;
use kvgate_protocol::kv_events::{decode_payload, KvEvent, KvEventBatch, Medium};
use kvgate_protocol::prom_text;

/// msgpack of one vLLM batch with `n` BlockStored events of 4 blocks × 16 tokens, as maps or arrays.
fn payload(n: u32, maps: bool) -> Vec<u8> {
    use rmp::encode::*;
    let mut b = Vec::new();
    write_array_len(&mut b, 3).unwrap();
    write_f64(&mut b, 1.7e9).unwrap();
    write_array_len(&mut b, n).unwrap();
    for e in 0..n {
        let hashes: Vec<u64> = (0..4).map(|i| u64::MAX - (e * 4 + i) as u64).collect();
        let parent = (e > 0).then(|| u64::MAX - (e * 4 - 1) as u64);
        let field = |b: &mut Vec<u8>, k: &str| {
            if maps {
                write_str(b, k).unwrap();
            }
        };
        if maps {
            write_map_len(&mut b, 8).unwrap();
            write_str(&mut b, "type").unwrap();
        } else {
            write_array_len(&mut b, 8).unwrap();
        }
        write_str(&mut b, "BlockStored").unwrap();
        field(&mut b, "block_hashes");
        write_array_len(&mut b, 4).unwrap();
        hashes
            .iter()
            .for_each(|h| write_uint(&mut b, *h).map(|_| ()).unwrap());
        field(&mut b, "parent_block_hash");
        match parent {
            Some(p) => write_uint(&mut b, p).map(|_| ()).unwrap(),
            None => write_nil(&mut b).unwrap(),
        }
        field(&mut b, "token_ids");
        write_array_len(&mut b, 64).unwrap();
        (0..64u32).for_each(|t| write_uint(&mut b, (e * 64 + t) as u64).map(|_| ()).unwrap());
        field(&mut b, "block_size");
        write_uint(&mut b, 16).unwrap();
        field(&mut b, "lora_id");
        write_nil(&mut b).unwrap();
        field(&mut b, "medium");
        write_str(&mut b, "GPU").unwrap();
        field(&mut b, "lora_name");
        write_nil(&mut b).unwrap();
    }
    write_uint(&mut b, 0).unwrap();
    b
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv_events");
    for (name, maps) in [
        ("decode_map_32x4blocks", true),
        ("decode_array_32x4blocks", false),
    ] {
        let p = payload(32, maps);
        g.throughput(Throughput::Elements(32));
        g.bench_function(name, |b| b.iter(|| decode_payload(1, &p).unwrap()));
    }
    let batch = decode_payload(1, &payload(32, true)).unwrap();
    g.throughput(Throughput::Elements(32));
    g.bench_function("apply_32x4blocks_fresh_index", |b| {
        b.iter_batched(
            KvIndex::new,
            |mut idx| apply_batch(&mut idx, WorkerId(0), &batch, 16),
            BatchSize::SmallInput,
        )
    });
    let removed = KvEventBatch {
        seq: 2,
        ts: 0.0,
        dp_rank: None,
        events: vec![KvEvent::Removed {
            block_hashes: (0..128).map(|i| u64::MAX - i).collect(),
            medium: Medium::Gpu,
            group_idx: 0,
        }],
    };
    g.throughput(Throughput::Elements(128));
    g.bench_function("store_then_remove_128_blocks", |b| {
        b.iter_batched(
            KvIndex::new,
            |mut idx| {
                apply_batch(&mut idx, WorkerId(0), &batch, 16);
                apply_batch(&mut idx, WorkerId(0), &removed, 16)
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();

    let text = include_str!("../../kvgate-protocol/tests/fixtures/metrics_vllm_0.33.prom");
    let mut g = c.benchmark_group("prom_text");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("parse_vllm_metrics", |b| {
        b.iter(|| prom_text::parse(text).samples.len())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
