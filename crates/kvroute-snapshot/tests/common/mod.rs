//! Shared by the snapshot crate's tests: a generator of random *valid* snapshots, the strategy
//! over compressions, and an envelope builder for bodies the encoder would never write.
//!
//! Snapshots are built from a seed with a tiny deterministic PRNG (rather than nested proptest strategies) so
//! one `u64` reproduces a failing case, and biased towards the shapes the encoder special-cases:
//! rank lists copied from the parent, engine hashes shared by all carriers, long tier runs.

#![allow(dead_code)]

use std::io::Write;

use kvroute_snapshot::Compression;
use kvroute_snapshot::binary::{BINARY_MAGIC, BINARY_VERSION};
use kvroute_wire::snapshot::{
    IndexSnapshot, NO_PARENT, RankCursor, RankRef, SNAPSHOT_FORMAT, SnapshotNodes,
};

pub const TEST_KEY: &[u8] = b"kvroute-test-shared-secret-0001";
pub const OTHER_KEY: &[u8] = b"kvroute-test-shared-secret-0002";

pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A random valid snapshot with up to `max_nodes` nodes and `rank_count` ranks (>= 1).
pub fn random_snapshot(seed: u64, max_nodes: usize, rank_count: usize) -> IndexSnapshot {
    let node_count = SplitMix(seed ^ 0x5eed).below(max_nodes as u64 + 1) as usize;
    random_snapshot_with_nodes(seed, node_count, rank_count)
}

/// A random valid snapshot with exactly `node_count` nodes.
pub fn random_snapshot_with_nodes(
    seed: u64,
    node_count: usize,
    rank_count: usize,
) -> IndexSnapshot {
    let mut rng = SplitMix(seed);
    let ranks: Vec<RankRef> = (0..rank_count)
        .map(|i| RankRef {
            worker_url: format!("http://127.0.0.1:{}/wörker-{}", 8000 + i, rng.below(1000)),
            dp_rank: rng.below(8) as u32,
        })
        .collect();
    let mut cursors = Vec::new();
    for rank in 0..rank_count {
        if rng.chance(70) {
            cursors.push(RankCursor {
                rank: rank as u32,
                seq: rng.next() as i64,
                ts: finite_f64(&mut rng),
            });
        }
    }
    let empty_ranks = (0..rank_count)
        .filter(|_| rng.chance(20))
        .map(|r| r as u32)
        .collect();
    // Half the snapshots name no partial rank (written as binary version 1), half some.
    let partial_ranks = if rng.chance(50) {
        Vec::new()
    } else {
        (0..rank_count)
            .filter(|_| rng.chance(30))
            .map(|r| r as u32)
            .collect()
    };
    let mut nodes = SnapshotNodes::default();
    for i in 0..node_count {
        let parent = if i == 0 || rng.chance(20) {
            NO_PARENT
        } else if rng.chance(60) {
            (i - 1) as u32
        } else {
            rng.below(i as u64) as u32
        };
        nodes.parent.push(parent);
        nodes.content_hash.push(rng.next());
        let copy_parent = parent != NO_PARENT && rng.chance(40);
        let node_ranks: Vec<u32> = if copy_parent {
            let p = parent as usize;
            let start = if p == 0 {
                0
            } else {
                nodes.carrier_end[p - 1] as usize
            };
            nodes.carrier_rank[start..nodes.carrier_end[p] as usize].to_vec()
        } else {
            let count = rng.below(6) as usize;
            (0..count)
                .map(|_| rng.below(rank_count as u64) as u32)
                .collect()
        };
        let shared_hash = rng.chance(50).then(|| rng.next());
        for rank in node_ranks {
            nodes.carrier_rank.push(rank);
            nodes.carrier_tiers.push(if rng.chance(85) {
                1
            } else {
                rng.below(256) as u8
            });
            nodes
                .carrier_engine_hash
                .push(shared_hash.unwrap_or_else(|| rng.next()));
        }
        nodes.carrier_end.push(nodes.carrier_rank.len() as u32);
    }
    IndexSnapshot {
        format: SNAPSHOT_FORMAT,
        hash_scheme: format!("kvroute-xxh3-chain-v{}", rng.below(3)),
        block_size: [16u32, 32, 64, 1][rng.below(4) as usize],
        producer_ready: rng.chance(50),
        ranks,
        cursors,
        empty_ranks,
        partial_ranks,
        nodes,
    }
}

fn finite_f64(rng: &mut SplitMix) -> f64 {
    loop {
        let value = match rng.below(3) {
            0 => f64::from_bits(rng.next()),
            1 => 1.764e9 + rng.below(1_000_000) as f64 / 1024.0,
            _ => -0.0,
        };
        if value.is_finite() {
            return value;
        }
    }
}

/// Any compression the envelope can name.
pub fn compression_strategy() -> impl proptest::strategy::Strategy<Value = Compression> {
    proptest::sample::select(Compression::ALL.to_vec())
}

/// A binary envelope (magic, version, gzip) around the gzip of `parts`, in order: for bombs and
/// other bodies the encoder would never write.
pub fn gzip_envelope(parts: &[&[u8]]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    for part in parts {
        gz.write_all(part).unwrap();
    }
    let mut bytes = BINARY_MAGIC.to_vec();
    bytes.extend_from_slice(&[BINARY_VERSION, Compression::Gzip.code()]);
    bytes.extend_from_slice(&gz.finish().unwrap());
    bytes
}
