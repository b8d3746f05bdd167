//! Apply throughput: vLLM-shaped store events (16 blocks of 16 tokens each, chained through
//! `parent_block_hash`) applied by the single writer, hashing included. Target >= 5 M blocks/s on
//! one core. Events are built outside the timed region; each iteration starts from an empty index
//! so node/map growth is part of the measured cost.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_index::{IndexConfig, PrefixIndex};
use kvroute_wire::event::{BlockStored, EngineHash, KvEvent};
use kvroute_wire::snapshot::RankRef;

const BLOCK_SIZE: u32 = 16;
const BLOCKS_PER_EVENT: usize = 16;
const RANKS: u32 = 8;
const CHAINS_PER_RANK: u64 = 32;
const EVENTS_PER_CHAIN: u64 = 16;

fn events() -> Vec<(u32, KvEvent)> {
    let mut out = Vec::new();
    for chain in 0..CHAINS_PER_RANK {
        for rank in 0..RANKS {
            let mut parent = None;
            for e in 0..EVENTS_PER_CHAIN {
                let first = (u64::from(rank) << 40) | (chain << 20) | (e * BLOCKS_PER_EVENT as u64);
                let hashes: Vec<EngineHash> = (0..BLOCKS_PER_EVENT as u64)
                    .map(|k| EngineHash(first + k + 1))
                    .collect();
                // Ranks share the first half of each chain's content, like a common system prompt.
                let owner = if e < EVENTS_PER_CHAIN / 2 { 0 } else { rank };
                let token_ids: Vec<u32> = (0..BLOCK_SIZE * BLOCKS_PER_EVENT as u32)
                    .map(|t| {
                        (owner * 7_919 + chain as u32 * 104_729 + e as u32 * 1_009 + t) % 128_000
                    })
                    .collect();
                let last = *hashes.last().expect("non-empty");
                out.push((
                    rank,
                    KvEvent::BlockStored(BlockStored::new(hashes, parent, token_ids, BLOCK_SIZE)),
                ));
                parent = Some(last);
            }
        }
    }
    out
}

fn bench_apply(c: &mut Criterion) {
    let evs = events();
    let blocks = evs.len() as u64 * BLOCKS_PER_EVENT as u64;
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(blocks));
    g.bench_function("store_16x16_events_into_empty_index", |b| {
        b.iter_batched(
            || {
                let (mut w, r) = PrefixIndex::new(IndexConfig::new(BLOCK_SIZE));
                let ids: Vec<_> = (0..RANKS)
                    .map(|i| {
                        w.add_rank(RankRef {
                            worker_url: format!("http://127.0.0.1:{}", 8000 + i),
                            dp_rank: 0,
                        })
                    })
                    .collect();
                (w, r, ids)
            },
            |(mut w, r, ids)| {
                for (rank, ev) in &evs {
                    w.apply_event(ids[*rank as usize], ev);
                }
                assert_eq!(r.total_carried(), blocks);
                (w, r)
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench_apply);
criterion_main!(benches);
