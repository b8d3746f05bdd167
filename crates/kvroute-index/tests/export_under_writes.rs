//! The export's watermark under a writer that never pauses: a snapshot taken while batches are
//! applied, grafted on a fresh index and followed by every batch above its pre-walk cursor,
//! converges to the producer's view.
//!
//! The writer runs on its own thread against the real sharded index, so the walk and the writes
//! really interleave (each test first proves that they did: the export reports cursors that
//! advanced during its walk). The workload is an engine's radix cache per rank: documents whose
//! blocks are stored as contiguous prefixes (a store always names the block before it as
//! parent), removed either leaf first (how SGLang and vLLM evict) or anywhere in the chain, and an
//! occasional `AllBlocksCleared`.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use kvroute_index::{IndexConfig, IndexReader, IndexWriter, PrefixIndex, RankId};
use kvroute_wire::event::{EventBatch, KvEvent};
use kvroute_wire::snapshot::IndexSnapshot;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BS: u32 = 4;
const RANKS: u32 = 4;
const DOCS: u32 = 3_000;
const DOC_BLOCKS: usize = 12;
/// Batches applied before the concurrent phase, so a walk takes long enough to overlap writes.
const PRELOAD_BATCHES: u64 = 40_000;
/// Batches the writer must apply after the export returned before it is stopped.
const AFTER_EXPORT_BATCHES: u64 = 2_000;
const EXPORT_ATTEMPTS_MAX: usize = 50;
const WAIT_TIMEOUT_MS: u64 = 60_000;

fn cfg() -> IndexConfig {
    IndexConfig {
        block_size: BS,
        shard_count: 8,
        max_carried_blocks: 50_000_000,
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Removal {
    LeafFirst,
    Anywhere,
}

/// One rank's engine cache: for each document, the depths it holds.
struct EngineModel {
    doc_hashes: Vec<Vec<u64>>,
    doc_tokens: Vec<Vec<u32>>,
    held: Vec<Vec<BTreeSet<usize>>>,
    removal: Removal,
}

impl EngineModel {
    fn new(removal: Removal) -> Self {
        let doc_tokens: Vec<Vec<u32>> = (0..DOCS).map(|d| tokens(d + 1, DOC_BLOCKS, BS)).collect();
        let doc_hashes = doc_tokens.iter().map(|t| hashes_of(t, BS)).collect();
        EngineModel {
            doc_hashes,
            doc_tokens,
            held: (0..RANKS)
                .map(|_| vec![BTreeSet::new(); DOCS as usize])
                .collect(),
            removal,
        }
    }

    /// The next batch the engine of `rank` publishes: a store extending a document's held
    /// prefix (its parent is always held), a removal, or rarely a clear.
    fn next_batch(&mut self, rank: usize, rng: &mut StdRng) -> EventBatch {
        let roll = rng.random_range(0..1_000u32);
        if roll == 0 {
            for doc in &mut self.held[rank] {
                doc.clear();
            }
            return batch(vec![KvEvent::AllBlocksCleared]);
        }
        // Popular documents are shared by every rank, so ranks share nodes.
        let doc = if rng.random_bool(0.5) {
            rng.random_range(0..50)
        } else {
            rng.random_range(0..DOCS as usize)
        };
        let held = &mut self.held[rank][doc];
        if roll < 600 || held.is_empty() {
            let next = held.last().map_or(0, |&d| d + 1);
            if next >= DOC_BLOCKS {
                return self.remove(rank, doc, rng);
            }
            let n = rng.random_range(1..=3usize).min(DOC_BLOCKS - next);
            let hashes = &self.doc_hashes[doc][next..next + n];
            let parent = next.checked_sub(1).map(|p| self.doc_hashes[doc][p]);
            let toks = self.doc_tokens[doc][next * BS as usize..(next + n) * BS as usize].to_vec();
            held.extend(next..next + n);
            return batch(vec![stored(hashes, parent, toks, BS, None)]);
        }
        self.remove(rank, doc, rng)
    }

    fn remove(&mut self, rank: usize, doc: usize, rng: &mut StdRng) -> EventBatch {
        let held = &mut self.held[rank][doc];
        let depth = match self.removal {
            Removal::LeafFirst => *held.last().expect("removal from an empty document"),
            Removal::Anywhere => {
                let i = rng.random_range(0..held.len());
                *held.iter().nth(i).expect("index in range")
            }
        };
        held.remove(&depth);
        batch(vec![removed(&[self.doc_hashes[doc][depth]], None)])
    }
}

/// Every `(node content hash, rank, engine hash, tiers)` the snapshot carries, sorted: two indexes
/// hold the same view exactly when these are equal.
fn canonical_view(s: &IndexSnapshot) -> BTreeSet<(u64, String, u32, u64, u8)> {
    let mut out = BTreeSet::new();
    let mut carrier = 0usize;
    for (node, &end) in s.nodes.carrier_end.iter().enumerate() {
        while carrier < end as usize {
            out.insert((
                s.nodes.content_hash[node],
                s.ranks[s.nodes.carrier_rank[carrier] as usize]
                    .worker_url
                    .clone(),
                s.ranks[s.nodes.carrier_rank[carrier] as usize].dp_rank,
                s.nodes.carrier_engine_hash[carrier],
                s.nodes.carrier_tiers[carrier],
            ));
            carrier += 1;
        }
    }
    out
}

struct Run {
    /// The producer's view once the writer stopped.
    final_view: BTreeSet<(u64, String, u32, u64, u8)>,
    /// The consumer's view: `mid_walk` restored, then every logged batch above its cursor.
    consumer_view: BTreeSet<(u64, String, u32, u64, u8)>,
    cursors_advanced: usize,
}

fn wait_until(what: &str, timeout_ms: u64, mut cond: impl FnMut() -> Option<String>) {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    loop {
        let Some(seen) = cond() else { return };
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout_ms} ms waiting for {what}; saw {seen}"
        );
        std::thread::yield_now();
    }
}

fn run(removal: Removal, seed: u64) -> Run {
    let (mut w, reader) = PrefixIndex::new(cfg());
    let ids: Vec<RankId> = (0..RANKS).map(|i| w.add_rank(rank_ref(i))).collect();
    let mut model = EngineModel::new(removal);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut seqs = vec![0i64; RANKS as usize];
    let mut log: Vec<(usize, i64, EventBatch)> = Vec::new();
    let mut step =
        move |w: &mut IndexWriter, log: &mut Vec<(usize, i64, EventBatch)>, rng: &mut StdRng| {
            let rank = rng.random_range(0..RANKS as usize);
            let b = model.next_batch(rank, rng);
            seqs[rank] += 1;
            w.apply_batch(ids[rank], seqs[rank], &b);
            log.push((rank, seqs[rank], b));
        };
    for _ in 0..PRELOAD_BATCHES {
        step(&mut w, &mut log, &mut rng);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let applied = Arc::new(AtomicU64::new(0));
    let writer = {
        let (stop, applied) = (stop.clone(), applied.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                step(&mut w, &mut log, &mut rng);
                applied.fetch_add(1, Ordering::Release);
            }
            log
        })
    };

    let mut found = None;
    for _ in 0..EXPORT_ATTEMPTS_MAX {
        let (snap, report) = reader.export_snapshot_with_report();
        assert_eq!(
            report.cursors_withheld, 0,
            "no stream restarts in this workload"
        );
        if report.cursors_advanced > 0 {
            found = Some((snap, report.cursors_advanced));
            break;
        }
    }
    let (mid_walk, cursors_advanced) = found.unwrap_or_else(|| {
        panic!("no export out of {EXPORT_ATTEMPTS_MAX} overlapped a write: the test proves nothing")
    });
    let at_export = applied.load(Ordering::Acquire);
    wait_until(
        "the writer to apply batches after the export",
        WAIT_TIMEOUT_MS,
        || {
            let now = applied.load(Ordering::Acquire);
            (now < at_export + AFTER_EXPORT_BATCHES)
                .then(|| format!("{} after it", now - at_export))
        },
    );
    stop.store(true, Ordering::Release);
    let log = writer.join().expect("writer thread");
    let final_view = canonical_view(&reader.export_snapshot());

    let consumer_view = replay_over(&mid_walk, &log);
    Run {
        final_view,
        consumer_view,
        cursors_advanced,
    }
}

/// A fresh index restored from `snap`, then every logged batch above the snapshot's cursor of
/// its rank, in log order.
fn replay_over(
    snap: &IndexSnapshot,
    log: &[(usize, i64, EventBatch)],
) -> BTreeSet<(u64, String, u32, u64, u8)> {
    let (mut w, r): (IndexWriter, IndexReader) = PrefixIndex::new(cfg());
    w.restore_snapshot(snap)
        .expect("the mid-walk snapshot is valid");
    assert_eq!(
        snap.cursors.len(),
        RANKS as usize,
        "every rank keeps a watermark"
    );
    let mut watermark = vec![i64::MAX; RANKS as usize];
    for c in &snap.cursors {
        let rank_ref = &snap.ranks[c.rank as usize];
        let i = (0..RANKS as usize)
            .find(|&i| *rank_ref == common::rank_ref(i as u32))
            .expect("a rank of this workload");
        watermark[i] = c.seq;
    }
    let local: Vec<RankId> = (0..RANKS)
        .map(|i| w.rank_id(&rank_ref(i)).expect("restored rank"))
        .collect();
    for (rank, seq, b) in log {
        if *seq > watermark[*rank] {
            w.apply_batch(local[*rank], *seq, b);
        }
    }
    canonical_view(&r.export_snapshot())
}

#[test]
fn a_snapshot_taken_under_writes_plus_the_batches_above_its_pre_walk_cursor_equals_the_producer() {
    for seed in [1, 2, 3] {
        let run = run(Removal::LeafFirst, seed);
        assert!(run.cursors_advanced > 0);
        assert!(!run.final_view.is_empty());
        let missing: Vec<_> = run
            .final_view
            .difference(&run.consumer_view)
            .take(5)
            .collect();
        let extra: Vec<_> = run
            .consumer_view
            .difference(&run.final_view)
            .take(5)
            .collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "seed {seed}: consumer lacks {missing:?} and holds extra {extra:?} \
             ({} cursors advanced during the walk)",
            run.cursors_advanced
        );
    }
}

#[test]
fn with_removals_anywhere_in_a_chain_the_consumer_never_holds_a_block_the_producer_does_not() {
    for seed in [4, 5, 6] {
        let run = run(Removal::Anywhere, seed);
        assert!(run.cursors_advanced > 0);
        let extra: Vec<_> = run
            .consumer_view
            .difference(&run.final_view)
            .take(5)
            .collect();
        assert!(
            extra.is_empty(),
            "seed {seed}: consumer holds extra {extra:?}"
        );
        let missing = run.final_view.difference(&run.consumer_view).count();
        // Only a store whose parent the walk already saw removed can be lost.
        assert!(
            missing * 100 <= run.final_view.len(),
            "seed {seed}: consumer lacks {missing} of {} carriers",
            run.final_view.len()
        );
    }
}
