//! Shared test helpers: building engine events as Rust values and waiting on conditions.
#![allow(dead_code)]

use kvroute_index::hash::{BASE_NAMESPACE, chain_hash, hash_token_blocks};
use kvroute_wire::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Medium};
use kvroute_wire::snapshot::RankRef;

pub fn rank_ref(i: u32) -> RankRef {
    RankRef {
        worker_url: format!("http://127.0.0.1:{}", 9000 + i),
        dp_rank: i % 2,
    }
}

pub fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: Vec<u32>,
    block_size: u32,
    medium: Option<Medium>,
) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        medium,
        ..BlockStored::new(
            hashes.iter().map(|&h| EngineHash(h)).collect(),
            parent.map(EngineHash),
            tokens,
            block_size,
        )
    })
}

pub fn removed(hashes: &[u64], medium: Option<Medium>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        medium,
        group_idx: None,
    })
}

pub fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts: 1.0,
        events,
        dp_rank: None,
    }
}

/// Tokens of `blocks` blocks whose values are derived from `seed`, so equal seeds share content.
pub fn tokens(seed: u32, blocks: usize, block_size: u32) -> Vec<u32> {
    (0..blocks as u32 * block_size)
        .map(|i| seed.wrapping_mul(1_000_003).wrapping_add(i))
        .collect()
}

pub fn hashes_of(tokens: &[u32], block_size: u32) -> Vec<u64> {
    let mut out = Vec::new();
    hash_token_blocks(tokens, block_size as usize, BASE_NAMESPACE, &mut out);
    out
}

pub fn chain(parent: u64, block: &[u32]) -> u64 {
    chain_hash(parent, block, None)
}
