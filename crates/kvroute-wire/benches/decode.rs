//! Decode (and encode) throughput, in blocks per second, for the two batch shapes the router
//! sees most: SGLang's one-block-per-event batches and vLLM's multi-block events.
//!
//! Run: `cargo bench -p kvroute-wire -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_wire::{
    BlockStored, Encoding, EngineHash, EventBatch, KvEvent, Medium, decode_batch, encode_batch,
    encode_batch_into,
};

const BLOCK_SIZE_TOKENS: u32 = 16;

fn stored(first_hash: u64, blocks: usize, parent: Option<u64>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        medium: Some(Medium::Device),
        group_idx: Some(0),
        ..BlockStored::new(
            (0..blocks as u64)
                .map(|i| EngineHash((first_hash + i).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
                .collect(),
            parent.map(EngineHash),
            (0..blocks as u32 * BLOCK_SIZE_TOKENS)
                .map(|t| 1000 + t * 37 % 150_000)
                .collect(),
            BLOCK_SIZE_TOKENS,
        )
    })
}

/// 64 events of one block each, as SGLang emits one `BlockStored` per page.
fn sglang_batch() -> EventBatch {
    EventBatch {
        ts: 1_764_467_272.5,
        events: (0..64).map(|i| stored(i, 1, Some(i + 1000))).collect(),
        dp_rank: Some(0),
    }
}

/// 8 events of 16 blocks each, as vLLM emits one `BlockStored` per request step.
fn vllm_batch() -> EventBatch {
    EventBatch {
        ts: 1_764_467_272.5,
        events: (0..8).map(|i| stored(i * 16, 16, None)).collect(),
        dp_rank: Some(0),
    }
}

fn bench(c: &mut Criterion) {
    let cases = [
        ("sglang_64x1", sglang_batch(), Encoding::Sglang, 64u64),
        ("vllm_8x16", vllm_batch(), Encoding::Vllm, 128),
        ("vllm_bytes_8x16", vllm_batch(), Encoding::VllmBytes, 128),
    ];
    let mut group = c.benchmark_group("decode_batch");
    for (name, batch, enc, blocks) in &cases {
        let payload = encode_batch(batch, *enc);
        group.throughput(Throughput::Elements(*blocks));
        group.bench_function(*name, |b| {
            b.iter(|| decode_batch(black_box(&payload)).expect("valid payload"))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("encode_batch_into");
    for (name, batch, enc, blocks) in &cases {
        let mut out = Vec::new();
        group.throughput(Throughput::Elements(*blocks));
        group.bench_function(*name, |b| {
            b.iter(|| {
                out.clear();
                encode_batch_into(black_box(batch), *enc, &mut out);
                out.len()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
