//! Side-map growth: the step the pump takes a little ahead of need when a rank's (engine hash ->
//! node) map nears its capacity (`IndexWriter::grow_side_map`). A growth files every entry into
//! a larger table, and an entry's key lives in its node (the map holds only the node's ref, to
//! keep the index at ~40 B per carried block), so the step reads one node per entry, and for a
//! node shared by several ranks that node's carrier list too. The writer applies nothing else
//! meanwhile, so this is how long every other rank's live batches wait behind one growth.
//!
//! Shape: 64 ranks of the chat shape (`support/chat_shape.rs`, the generator of the graft
//! bench), the peer-bootstrap benchmark's fleet. The ranks are filled in eight interleaved rounds
//! of 12,500 blocks asked each, so a rank's nodes are spread through the shards' slabs as live
//! streams spread them, not laid out one rank after another (about 73,000 blocks per rank stay
//! carried: a round's conversations often open with a system prompt the rank holds already).
//! Then every rank is grown once, and the 64 growths are reported: duration p50 / p90 / max and
//! nanoseconds per entry. The allocator is the `kvroute` binary's.
//!
//! Run: `cargo bench -p kvroute-index --bench side_map_growth`.

use std::time::Instant;

use kvroute_index::{IndexConfig, IndexWriter, PrefixIndex, RankId};
use kvroute_wire::event::{EventBatch, KvEvent};
use kvroute_wire::snapshot::RankRef;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The allocator of the `kvroute` binary: where the slab chunks land (and whether huge pages can
/// back them) is part of what a growth's misses cost.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "support/chat_shape.rs"]
mod support;

use support::{BLOCK_SIZE, Draws, percentile};

const RANKS: u32 = 64;
const BLOCKS_PER_RANK: u64 = 100_000;
/// Fill rounds: each gives every rank `BLOCKS_PER_RANK / FILL_ROUNDS` more blocks.
const FILL_ROUNDS: u32 = 8;

impl Draws for StdRng {
    fn unit(&mut self) -> f64 {
        self.random()
    }
    fn tail_blocks(&mut self) -> usize {
        self.random_range(16..=160usize)
    }
}

fn fill() -> (IndexWriter, Vec<RankId>) {
    let (mut w, _reader) = PrefixIndex::new(IndexConfig {
        max_carried_blocks: u64::MAX,
        ..IndexConfig::new(BLOCK_SIZE)
    });
    let ids: Vec<RankId> = (0..RANKS)
        .map(|rank| {
            w.add_rank(RankRef {
                worker_url: format!("http://10.0.0.{rank}:8000"),
                dp_rank: 0,
            })
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(7);
    let mut engine_seq: u64 = 0;
    let mut seqs = vec![0i64; RANKS as usize];
    for round in 0..FILL_ROUNDS {
        for rank in 0..RANKS {
            let id = ids[rank as usize];
            let seq = &mut seqs[rank as usize];
            // `net` = the round: each round's conversations are new content; the system prompts
            // (derived from the prompt alone) are shared by every round and rank.
            support::chat_rank(
                &mut rng,
                &mut engine_seq,
                round,
                rank,
                BLOCKS_PER_RANK / u64::from(FILL_ROUNDS),
                |ev: KvEvent| {
                    let batch = EventBatch {
                        ts: *seq as f64,
                        events: vec![ev],
                        dp_rank: None,
                    };
                    w.apply_batch(id, *seq, &batch);
                    *seq += 1;
                },
                |_| {},
            );
        }
    }
    (w, ids)
}

fn main() {
    let started = Instant::now();
    let (mut w, ids) = fill();
    let reader = w.reader();
    println!(
        "index: {RANKS} ranks, {} carried blocks, {} nodes, filled in {:.1} s",
        reader.total_carried(),
        reader.node_count(),
        started.elapsed().as_secs_f64()
    );
    let mut took_us: Vec<u64> = Vec::new();
    let mut ns_per_entry: Vec<u64> = Vec::new();
    let mut entries_total = 0usize;
    for &id in &ids {
        let (room, entries) = w.side_map_room(id).expect("registered");
        let t = Instant::now();
        w.grow_side_map(id);
        let took = t.elapsed();
        let (grown_room, grown_entries) = w.side_map_room(id).expect("registered");
        assert_eq!(grown_entries, entries, "a growth keeps every entry");
        assert!(grown_room > room, "a growth makes room");
        took_us.push(took.as_micros() as u64);
        ns_per_entry.push((took.as_nanos() / entries.max(1) as u128) as u64);
        entries_total += entries;
    }
    took_us.sort_unstable();
    ns_per_entry.sort_unstable();
    println!(
        "side-map growth, {} ranks, {} entries per rank on average: \
         took p50 {:.2} ms, p90 {:.2} ms, max {:.2} ms; per entry p50 {} ns, p90 {} ns, max {} ns",
        ids.len(),
        entries_total / ids.len(),
        percentile(&took_us, 0.5) as f64 / 1000.0,
        percentile(&took_us, 0.9) as f64 / 1000.0,
        *took_us.last().expect("ranks") as f64 / 1000.0,
        percentile(&ns_per_entry, 0.5),
        percentile(&ns_per_entry, 0.9),
        ns_per_entry.last().expect("ranks"),
    );
}
