//! The sliced graft on the peer-bootstrap shape: a sibling's snapshot of 64 ranks x ~100,000
//! carried blocks (the generator of `match_latency`: block size 16, 300 shared system prompts of
//! 1k-4k tokens with skewed popularity, extended by per-rank conversations) grafted into an index
//! that already serves 8 other live ranks of the same shape (so the graft shares their prompt
//! nodes), in slices of several sizes.
//!
//! Criterion times the whole graft (begin + every slice, one graft per iteration, a fresh target
//! each time, built outside the timed region). A second group grafts the same snapshot into a
//! booting replica (all 64 ranks pending, nothing live), where every node placed is new. Next to
//! the first group, per slice size, this prints what the pump cares about: the duration of one
//! slice (p50/p99/max over every slice of every iteration), which bounds how long a live batch of
//! another rank waits, and the apply time of one live batch run between slices. It also prints
//! the off-writer cost of `GraftPlan::new` and a one-shot `restore_snapshot` of the same snapshot
//! into the same target for comparison.
//!
//! Run: `cargo bench -p kvroute-index --bench graft`.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use kvroute_index::{
    GRAFT_SLICE_ITEMS_MAX, GraftPlan, GraftProgress, IndexConfig, IndexWriter, PrefixIndex, RankId,
};
use kvroute_wire::event::{EngineHash, EventBatch, KvEvent};
use kvroute_wire::snapshot::{IndexSnapshot, RankRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[path = "support/chat_shape.rs"]
mod support;

use support::{BLOCK_SIZE, BLOCKS_PER_EVENT, Draws, store_event, token};

impl Draws for StdRng {
    fn unit(&mut self) -> f64 {
        self.random()
    }
    fn tail_blocks(&mut self) -> usize {
        self.random_range(16..=160usize)
    }
}

const SNAPSHOT_RANKS: u32 = 64;
const LIVE_RANKS: u32 = 8;
const BLOCKS_PER_RANK: u64 = 100_000;
const LIVE_EVENTS: usize = 4096;

/// Slice sizes tried, in graft items (a node visited, a carrier placed or filed).
const SLICE_ITEMS: [usize; 4] = [8_192, 32_768, 131_072, 524_288];

fn rank_ref(net: u32, rank: u32) -> RankRef {
    RankRef {
        worker_url: format!("http://10.{net}.0.{rank}:8000"),
        dp_rank: 0,
    }
}

/// Fills `ranks` ranks of network `net` with ~`BLOCKS_PER_RANK` carried blocks each, one batch
/// per event so every rank ends with a cursor.
fn populate(w: &mut IndexWriter, net: u32, ranks: u32, seed: u64) -> Vec<RankId> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut engine_seq: u64 = u64::from(net) << 48;
    let mut ids = Vec::new();
    for rank in 0..ranks {
        let id = w.add_rank(rank_ref(net, rank));
        ids.push(id);
        let mut seq = 0i64;
        let mut apply = |w: &mut IndexWriter, ev: KvEvent| {
            let batch = EventBatch {
                ts: seq as f64,
                events: vec![ev],
                dp_rank: None,
            };
            w.apply_batch(id, seq, &batch);
            seq += 1;
        };
        support::chat_rank(
            &mut rng,
            &mut engine_seq,
            net,
            rank,
            BLOCKS_PER_RANK,
            |ev| apply(w, ev),
            |_| {},
        );
    }
    ids
}

fn config() -> IndexConfig {
    IndexConfig {
        max_carried_blocks: u64::MAX,
        ..IndexConfig::new(BLOCK_SIZE)
    }
}

/// The sibling's snapshot: 64 ranks of network 0.
fn sibling_snapshot() -> IndexSnapshot {
    let (mut w, r) = PrefixIndex::new(config());
    populate(&mut w, 0, SNAPSHOT_RANKS, 7);
    let mut s = r.export_snapshot();
    s.producer_ready = true;
    s
}

/// A booting replica: 8 live ranks of network 1 already applied, the 64 pending ranks registered.
fn booting_target() -> (IndexWriter, Vec<RankId>, Vec<RankId>) {
    let (mut w, _r) = PrefixIndex::new(config());
    let live = populate(&mut w, 1, LIVE_RANKS, 11);
    let pending = (0..SNAPSHOT_RANKS)
        .map(|rank| w.add_rank(rank_ref(0, rank)))
        .collect();
    (w, live, pending)
}

/// Fresh root chains for a live rank, applied between slices.
fn live_batches() -> Vec<EventBatch> {
    (0..LIVE_EVENTS as u64)
        .map(|e| {
            let hashes = (0..BLOCKS_PER_EVENT as u64)
                .map(|i| EngineHash(9 << 56 | e << 8 | i))
                .collect();
            let tokens = (0..BLOCKS_PER_EVENT as u64 * u64::from(BLOCK_SIZE))
                .map(|t| token(3 << 40 | e, t))
                .collect();
            EventBatch {
                ts: e as f64,
                events: vec![store_event(hashes, None, tokens)],
                dp_rank: None,
            }
        })
        .collect()
}

#[derive(Default)]
struct SliceStats {
    slice_ns: Vec<u64>,
    /// Slices of the side-map stage (one rank's map each, at least), apart.
    side_slice_ns: Vec<u64>,
    live_apply_ns: Vec<u64>,
    slices_per_graft: Vec<usize>,
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)] as f64 / 1e6
}

fn bench_graft(c: &mut Criterion) {
    let t0 = Instant::now();
    let snapshot = sibling_snapshot();
    println!(
        "snapshot: {} ranks, {} nodes, {} carried blocks (built and exported in {:.1} s)",
        snapshot.ranks.len(),
        snapshot.nodes.len(),
        snapshot.nodes.carried_blocks(),
        t0.elapsed().as_secs_f64()
    );
    let t0 = Instant::now();
    let plan = GraftPlan::new(snapshot.clone(), BLOCK_SIZE, |_| true).expect("valid snapshot");
    println!(
        "GraftPlan::new (validation + duplicate engine-hash check, off the writer): {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    {
        let (mut w, _, _) = booting_target();
        let t0 = Instant::now();
        w.restore_snapshot(&snapshot).expect("restores");
        println!(
            "one-shot restore_snapshot into the same target: {:.1} ms (the pump would block this long)",
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    let live = live_batches();

    let mut group = c.benchmark_group("graft_64x100k_into_8_live");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(1));
    group.measurement_time(Duration::from_secs(5));
    for items in SLICE_ITEMS {
        let stats = RefCell::new(SliceStats::default());
        group.bench_function(format!("slice_items_{items}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let (mut w, live_ids, pending) = booting_target();
                    let plan = plan.clone();
                    let mut st = stats.borrow_mut();
                    let mut next_live = 0usize;
                    let start = Instant::now();
                    let mut job = w.begin_graft(plan, &pending).expect("begins");
                    let mut slices = 0usize;
                    let mut nodes_finished = false;
                    loop {
                        let s0 = Instant::now();
                        let progress = w.graft_step(&mut job, items).expect("own job");
                        let ns = s0.elapsed().as_nanos() as u64;
                        st.slice_ns.push(ns);
                        if nodes_finished {
                            st.side_slice_ns.push(ns);
                        }
                        slices += 1;
                        match progress {
                            GraftProgress::Done(_) => break,
                            GraftProgress::More {
                                nodes_done,
                                nodes_total,
                            } => nodes_finished = nodes_done == nodes_total,
                        }
                        // The pump's turn between slices: one live batch of another rank.
                        let batch = &live[next_live % live.len()];
                        let a0 = Instant::now();
                        w.apply_batch(live_ids[0], 1_000_000 + next_live as i64, batch);
                        st.live_apply_ns.push(a0.elapsed().as_nanos() as u64);
                        next_live += 1;
                    }
                    total += start.elapsed();
                    st.slices_per_graft.push(slices);
                }
                total
            });
        });
        let mut st = stats.into_inner();
        if st.slice_ns.is_empty() {
            // Left out by a criterion name filter: nothing to report.
            continue;
        }
        st.slice_ns.sort_unstable();
        st.side_slice_ns.sort_unstable();
        st.live_apply_ns.sort_unstable();
        let grafts = st.slices_per_graft.len().max(1);
        println!(
            "  slice_items {items}{}: {} grafts, {:.0} slices/graft; slice p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; live batch apply between slices p50 {:.3} ms, p99 {:.3} ms",
            if items == GRAFT_SLICE_ITEMS_MAX {
                " (default)"
            } else {
                ""
            },
            grafts,
            st.slices_per_graft.iter().sum::<usize>() as f64 / grafts as f64,
            pct(&st.slice_ns, 0.50),
            pct(&st.slice_ns, 0.99),
            pct(&st.slice_ns, 1.0),
            pct(&st.live_apply_ns, 0.50),
            pct(&st.live_apply_ns, 0.99),
        );
        if !st.side_slice_ns.is_empty() {
            println!(
                "    of which side-map stage: {:.0} slices/graft, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                st.side_slice_ns.len() as f64 / grafts as f64,
                pct(&st.side_slice_ns, 0.50),
                pct(&st.side_slice_ns, 0.99),
                pct(&st.side_slice_ns, 1.0),
            );
        }
    }
    group.finish();

    // A booting replica: every rank of the snapshot registered and pending, nothing live, so
    // every node the graft places is new (the case of a replica joining a fleet).
    let mut group = c.benchmark_group("graft_64x100k_into_booting");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(1));
    group.measurement_time(Duration::from_secs(5));
    group.bench_function(format!("slice_items_{GRAFT_SLICE_ITEMS_MAX}"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (mut w, _r) = PrefixIndex::new(config());
                let pending: Vec<RankId> = (0..SNAPSHOT_RANKS)
                    .map(|rank| w.add_rank(rank_ref(0, rank)))
                    .collect();
                let plan = plan.clone();
                let start = Instant::now();
                let mut job = w.begin_graft(plan, &pending).expect("begins");
                while let GraftProgress::More { .. } = w
                    .graft_step(&mut job, GRAFT_SLICE_ITEMS_MAX)
                    .expect("own job")
                {}
                total += start.elapsed();
            }
            total
        });
    });
    group.finish();
}

criterion_group!(benches, bench_graft);
criterion_main!(benches);
