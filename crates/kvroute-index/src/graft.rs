//! The graft: a sibling's snapshot unioned into the live index for a few named (booting) ranks,
//! in bounded slices, so the single writer can keep applying other ranks' live batches between
//! slices.
//!
//! Why slices and not one call: a restore of a 6.4 M-carrier snapshot runs ~0.5 s, and the writer
//! (the pump) applies nothing else meanwhile; live batches of the other ranks would wait that
//! long. Building aside and swapping is no cheaper here: the graft must share nodes with the
//! ranks already live, so "aside" would be a copy of the whole index. A slice costs at most
//! `items_max` units of work (one per snapshot node visited, one per carrier placed or filed) and
//! holds a shard write lock for at most [`GRAFT_LOCK_NODES_MAX`] nodes, so readers wait no longer
//! than behind a live store event.
//!
//! It runs in three stages, mirroring [`IndexWriter::restore_snapshot`]:
//! 1. **nodes**: snapshot nodes in order, each carrier of a grafted rank added to its node. A
//!    node is created only when it or a descendant gets a carrier, so a rank excluded mid-way
//!    leaves no empty node behind. Parents precede children in the snapshot and a node's
//!    missing ancestors are created before it, so a reader that sees half a graft sees each
//!    grafted rank holding a true, shorter prefix of what the snapshot says it holds, never a
//!    block without its prefix.
//! 2. **side maps**: each rank's (engine hash -> node) entries, one rank at a time, so a rank's
//!    map is sized once and built while hot in cache (the same reason restore does it last).
//! 3. **finish**: cursors set to the snapshot's, then the memory cap enforced.
//!
//! Between slices the writer may apply other ranks' batches, which can evict or prune nodes the
//! job placed. The job never trusts a remembered node blindly: before placing under a parent it
//! checks that the slot still holds a live node with the parent's content hash, and re-creates
//! missing ancestors otherwise; and if any eviction ran during the job, each side entry is checked
//! against its carrier before it is filed. A grafted rank's own batches must NOT be applied while
//! its job runs (the rank is held by its state machine; the pump queues the rank's later actions
//! behind the graft).
//!
//! Until stage 2 has filed a rank's side map, `clear_rank` and `remove_rank` cannot find that
//! rank's grafted carriers: a rank that must be dropped mid-job goes through
//! [`IndexWriter::abandon_graft_rank`], which files what was placed and then clears it.
//!
//! Validation is split from the writer on purpose: [`GraftPlan::new`] checks the whole snapshot
//! and reduces it to the ranks to graft, a linear pass that can run on any thread; the writer's
//! [`IndexWriter::begin_graft`] only maps ranks and allocates. The same goes for memory: a plan
//! laid out for the index ([`GraftPlan::lay_out_for`]) brings the job's columns already written,
//! and a [`GraftRoom`] that another thread fills with the storage the job will write into while
//! the job runs, so the writer spends its slices placing nodes rather than taking page faults.

use std::sync::Arc;

use hashbrown::HashSet;
use kvroute_wire::snapshot::{IndexSnapshot, NO_PARENT, RankCursor, RankRef, SnapshotNodes};
use thiserror::Error;

use crate::index::{
    EntryKeys, IndexReader, IndexWriter, RankId, RestoreDelta, SLAB_CHUNK_NODES, Shard, Shared,
    word, word_rank, written_zeros,
};
use crate::room::GraftRoom;
use crate::snapshot::{RestoreError, retain_ranks_validated, validate_snapshot};
use crate::table::HashSlots;

/// Default work per slice (see [`IndexWriter::graft_step`]), chosen with `benches/graft.rs` on
/// the 64 x 100,000-block shape: a node-stage slice of this size takes ~1.5 ms, so one slice
/// stays under 5 ms with room for a loaded machine, a small fraction of the 50 ms p99 budget for
/// a live batch waiting behind it, while the whole graft costs no more than with larger slices.
/// The side-map stage files one whole rank per slice whatever this is (~3 ms for a rank of
/// 100,000 carriers): a rank's map is sized once, because growing it in steps would re-read
/// every entry's node at each doubling.
pub const GRAFT_SLICE_ITEMS_MAX: usize = 32_768;

/// How far ahead of the node being placed the graft prefetches a node's table slot: far enough
/// for a miss to memory to complete while the nodes in between are placed (a few hundred
/// nanoseconds each on a large index).
const GRAFT_PREFETCH_NODES_AHEAD: usize = 8;

/// Threads (the caller's among them) that check a graft plan's engine hashes, one group of
/// ranks each.
pub const GRAFT_PLAN_THREADS_MAX: usize = 4;

/// Snapshot nodes placed per shard write-lock acquisition: a reader of that shard waits at most
/// this many placements (tens of microseconds), like behind one live store event.
pub const GRAFT_LOCK_NODES_MAX: usize = 256;

const NONE: u32 = u32::MAX;

/// Why a snapshot cannot be grafted, or a job cannot run on this writer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GraftError {
    #[error(transparent)]
    Invalid(#[from] RestoreError),
    /// A rank names one engine hash on two nodes. Its side map could file only one of them, and
    /// the other carrier could then never be removed, not even by clearing the rank.
    #[error("carrier {carrier}: rank {rank} carries engine hash {engine:#x} on two nodes")]
    DuplicateEngineHash {
        carrier: usize,
        rank: u32,
        engine: u64,
    },
    /// The job was begun on another index.
    #[error("graft job belongs to another index")]
    ForeignJob,
}

/// A validated snapshot reduced to the ranks to graft, each with a cursor.
///
/// A rank without a cursor in the snapshot is left out (listed in [`GraftPlan::uncovered`]): with
/// no watermark, its live stream can never be proven to continue the snapshot, so grafting it
/// would risk serving blocks the engine has since removed.
#[derive(Debug, Clone)]
pub struct GraftPlan {
    snapshot: IndexSnapshot,
    /// Every carrier's engine hash, grouped by snapshot rank in carrier order: rank `r`'s are
    /// `rank_engines[rank_carrier_start[r]..rank_carrier_start[r + 1]]`. Built by the duplicate
    /// check and kept for the job's side-map stage, which needs exactly this grouping; building
    /// it once saves the job a second column of the same size (820 MB of fresh memory at 1,024
    /// ranks x 100,000 blocks).
    rank_carrier_start: Vec<usize>,
    rank_engines: Vec<u64>,
    uncovered: Vec<RankRef>,
    /// Where the nodes land in one index's shards, if [`GraftPlan::lay_out_for`] computed it.
    shard_layout: Option<ShardLayout>,
}

/// Where a plan's nodes land in the shards of an index with `shards` shards, so the job can size
/// each shard's node table and list pool once, to what that shard will hold. Without it a shard
/// is sized to an even share of the snapshot; root-based sharding makes shards uneven (a popular
/// system prompt pulls all its conversations into one shard), and a shard past its share grows
/// its table by 1.25x steps, each a fresh table written whole and the last one discarded, while
/// a shard below its share leaves room unused. (At 1,024 ranks exact sizing lowered the peak by
/// 0.17 GB; the graft's time did not measurably change: docs/BENCHMARKS.md.)
///
/// It also carries each shard's empty table, already of that size: writing a table of tens of
/// megabytes (a large shard at 1,024 ranks) is fresh memory first touched, which took a graft
/// slice past 100 ms on the pump; built here it costs the plan's thread instead.
#[derive(Clone)]
struct ShardLayout {
    shards: usize,
    nodes_per_shard: Vec<usize>,
    /// Nodes with two or more carriers, each of which takes a carrier list.
    lists_per_shard: Vec<usize>,
    /// Per shard, an empty table with room for its nodes (taken by a shard that holds nothing).
    tables: Vec<HashSlots>,
    /// Slab chunks for the nodes, carrier lists for the shared ones and the ranks' side tables,
    /// made ready on a helper thread while the job runs (see [`crate::room`]); at most enough for
    /// every node and carrier of the plan.
    room: Arc<GraftRoom>,
    /// The job's own columns, made and written once here, beside the layout's pass, so the
    /// writer does not take their first-touch page faults: each node's shard (the layout
    /// computes it anyway), and the zeroed `placed` and `bucket_node` (see [`GraftJob`]).
    job_columns: Option<JobColumns>,
}

/// See [`ShardLayout::job_columns`].
#[derive(Clone)]
struct JobColumns {
    shard_of: Vec<u8>,
    placed: Vec<u32>,
    bucket_node: Vec<u32>,
}

impl JobColumns {
    /// Whether these columns are sized for a plan of `nodes` nodes and `carriers` bucketed
    /// carriers (a plan's columns are never used at another's size).
    fn fit(&self, nodes: usize, carriers: usize) -> bool {
        self.shard_of.len() == nodes
            && self.placed.len() == nodes
            && self.bucket_node.len() == carriers
    }
}

impl std::fmt::Debug for ShardLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardLayout")
            .field("shards", &self.shards)
            .field("nodes_per_shard", &self.nodes_per_shard)
            .field("lists_per_shard", &self.lists_per_shard)
            .field("room", &self.room)
            .finish_non_exhaustive()
    }
}

impl GraftPlan {
    /// Validates `snapshot` completely (header against `block_size`, structure, and one engine
    /// hash per node per rank) and keeps only the ranks `keep` accepts that have a cursor. Linear
    /// in the snapshot; meant to run off the writer.
    pub fn new(
        mut snapshot: IndexSnapshot,
        block_size: u32,
        keep: impl Fn(&RankRef) -> bool,
    ) -> Result<GraftPlan, GraftError> {
        validate_snapshot(&snapshot, block_size)?;
        let mut has_cursor = vec![false; snapshot.ranks.len()];
        for c in &snapshot.cursors {
            has_cursor[c.rank as usize] = true;
        }
        let mut uncovered = Vec::new();
        let kept: Vec<bool> = snapshot
            .ranks
            .iter()
            .zip(&has_cursor)
            .map(|(r, &cursor)| {
                let wanted = keep(r);
                if wanted && !cursor {
                    uncovered.push(r.clone());
                }
                wanted && cursor
            })
            .collect();
        if kept.iter().any(|k| !k) {
            retain_ranks_validated(&mut snapshot, |i, _| kept[i]);
        }
        let RankEngines { start, engines } = check_engine_hashes(&snapshot)?;
        Ok(GraftPlan {
            snapshot,
            rank_carrier_start: start,
            rank_engines: engines,
            uncovered,
            shard_layout: None,
        })
    }

    /// [`GraftPlan::new`] then [`GraftPlan::lay_out_for`] `index`, with the job's zeroed
    /// columns written on a second thread from the start: their sizes are the snapshot's, known
    /// before it is checked, so their page faults overlap the validation and the engine-hash
    /// check instead of the short layout walk (measured at 64 ranks: the layout waited ~90 ms
    /// for them, a third of the plan). Columns whose sizes `keep` changed are dropped and written
    /// again during the layout, at the plan's sizes.
    pub fn new_laid_out(
        snapshot: IndexSnapshot,
        block_size: u32,
        keep: impl Fn(&RankRef) -> bool,
        index: &IndexReader,
    ) -> Result<GraftPlan, GraftError> {
        let nodes = snapshot.nodes.len();
        let carriers = snapshot.nodes.carrier_rank.len();
        std::thread::scope(|scope| {
            let zeroed = spawn_job_columns(scope, nodes, carriers);
            let mut plan = GraftPlan::new(snapshot, block_size, keep)?;
            let zeroed = zeroed
                .and_then(|h| h.join().ok())
                .filter(|(placed, bucket_node)| {
                    placed.len() == plan.snapshot.nodes.len()
                        && bucket_node.len() == plan.rank_engines.len()
                });
            plan.lay_out_with(index, zeroed);
            Ok(plan)
        })
    }

    /// Computes where the plan's nodes land in `index`'s shards and builds each shard's empty
    /// table of that size (see [`ShardLayout`]). Linear in the snapshot; meant to run off the
    /// writer, like [`GraftPlan::new`]. A plan laid out for another index still grafts there,
    /// with evenly shared sizing.
    pub fn lay_out_for(&mut self, index: &IndexReader) {
        self.lay_out_with(index, None);
    }

    /// [`GraftPlan::lay_out_for`] with the job's zeroed columns when they were made already
    /// (else they are written on a second thread during the layout walk).
    fn lay_out_with(&mut self, index: &IndexReader, made: Option<(Vec<u32>, Vec<u32>)>) {
        let shared = &index.shared;
        let n = &self.snapshot.nodes;
        let shards = shared.shards.len();
        let carriers = self.rank_engines.len();
        let mut nodes_per_shard = vec![0usize; shards];
        let mut lists_per_shard = vec![0usize; shards];
        let mut shared_nodes: Vec<(u32, u32)> = Vec::new();
        let (shard_of, zeroed) = std::thread::scope(|scope| {
            // The job's zeroed columns are written on a second thread while this one walks the
            // nodes: their page faults then overlap the walk instead of following it.
            let making = match made {
                Some(_) => None,
                None => spawn_job_columns(scope, n.len(), carriers),
            };
            // Written whole by the loop below.
            let mut shard_of = vec![0u8; n.len()];
            let mut carriers_before = 0u32;
            for i in 0..n.len() {
                // Parents precede children (validated by `new`), so a parent's shard is known.
                let s = shard_of_node(shared, n, &mut shard_of, i);
                nodes_per_shard[s] += 1;
                let carriers = n.carrier_end[i] - carriers_before;
                if carriers >= 2 {
                    lists_per_shard[s] += 1;
                    // Node indices fit u32: the snapshot's own carrier offsets are u32.
                    shared_nodes.push((i as u32, carriers));
                }
                carriers_before = n.carrier_end[i];
            }
            // No thread to spare: the job allocates its own columns, as without a layout.
            let zeroed = made.or_else(|| making.and_then(|h| h.join().ok()));
            (shard_of, zeroed)
        });
        let job_columns = zeroed.map(|(placed, bucket_node)| JobColumns {
            shard_of,
            placed,
            bucket_node,
        });
        let tables = nodes_per_shard
            .iter()
            .map(|&nodes| HashSlots::with_room(nodes))
            .collect();
        let chunks_max = nodes_per_shard
            .iter()
            .map(|&nodes| nodes.div_ceil(SLAB_CHUNK_NODES))
            .sum();
        let side_entries = self
            .rank_carrier_start
            .windows(2)
            .map(|w| w[1] - w[0])
            .collect();
        self.shard_layout = Some(ShardLayout {
            shards,
            nodes_per_shard,
            lists_per_shard,
            tables,
            room: Arc::new(GraftRoom::new(
                chunks_max,
                n.len(),
                shared_nodes,
                side_entries,
            )),
            job_columns,
        });
    }

    /// The storage a job of this plan grafts into, once the plan is laid out: run
    /// [`GraftRoom::prepare`] on another thread while the writer grafts, so the slabs' and side
    /// maps' fresh memory is first touched there. Optional: a job whose room nobody prepares
    /// allocates its own, as without a layout.
    pub fn room(&self) -> Option<Arc<GraftRoom>> {
        self.shard_layout.as_ref().map(|l| l.room.clone())
    }

    pub fn snapshot(&self) -> &IndexSnapshot {
        &self.snapshot
    }

    /// Whether the job's zeroed columns are made and sized to this plan (laid out, and a thread
    /// could be spared to write them); otherwise the job allocates its own.
    pub fn has_job_columns(&self) -> bool {
        self.shard_layout.as_ref().is_some_and(|l| {
            l.job_columns
                .as_ref()
                .is_some_and(|c| c.fit(self.snapshot.nodes.len(), self.rank_engines.len()))
        })
    }

    /// The ranks this plan grafts.
    pub fn ranks(&self) -> &[RankRef] {
        &self.snapshot.ranks
    }

    /// Ranks `keep` accepted that the snapshot has no cursor for.
    pub fn uncovered(&self) -> &[RankRef] {
        &self.uncovered
    }

    /// The snapshot's cursor for `rank` (its rank index is the snapshot's).
    pub fn cursor(&self, rank: &RankRef) -> Option<RankCursor> {
        self.cover(rank).map(|c| c.cursor)
    }

    /// What the snapshot says about `rank` when it has a cursor for it: the cursor and whether
    /// the rank is listed in `partial_ranks`.
    pub fn cover(&self, rank: &RankRef) -> Option<PlanCover> {
        let pos = self.snapshot.ranks.iter().position(|r| r == rank)? as u32;
        let cursor = *self.snapshot.cursors.iter().find(|c| c.rank == pos)?;
        Some(PlanCover {
            cursor,
            partial: self.snapshot.partial_ranks.contains(&pos),
        })
    }
}

/// Writes a job's zeroed columns (`placed` per node, `bucket_node` per carrier) on a thread of
/// `scope`; `None` when no thread can be spawned (the job then allocates its own).
fn spawn_job_columns<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    nodes: usize,
    carriers: usize,
) -> Option<std::thread::ScopedJoinHandle<'scope, (Vec<u32>, Vec<u32>)>> {
    std::thread::Builder::new()
        .name("kvroute-graft-columns".into())
        .spawn_scoped(scope, move || {
            (written_zeros::<u32>(nodes), written_zeros::<u32>(carriers))
        })
        .ok()
}

/// A planned rank's watermark, and whether its producer's history of it is partial (it does not
/// reach back to the publisher's origin, so a graft of it is only as complete as that view).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanCover {
    pub cursor: RankCursor,
    pub partial: bool,
}

/// A snapshot's engine hashes grouped by rank (see [`GraftPlan`]).
struct RankEngines {
    start: Vec<usize>,
    engines: Vec<u64>,
}

/// The engine hashes grouped by rank; fails on a rank carrying one engine hash twice.
///
/// Ranks are independent, so each group of them is gathered and checked on a thread of its own:
/// the check is a hash-set insert per carrier (a third of a plan's time on a large snapshot), and
/// the gathering is the first write to every page of a column as long as the snapshot's carriers
/// (51 MB at 64 ranks x 100,000 blocks), whose page faults were the plan's longest serial stretch
/// (measured: ~140 of ~330 ms) while it was gathered on one thread. Each group reads the whole
/// carrier columns and writes only its own ranks' region.
fn check_engine_hashes(s: &IndexSnapshot) -> Result<RankEngines, GraftError> {
    let n = &s.nodes;
    let ranks = s.ranks.len();
    let mut start = vec![0usize; ranks + 1];
    for &r in &n.carrier_rank {
        start[r as usize + 1] += 1;
    }
    for r in 0..ranks {
        start[r + 1] += start[r];
    }
    let mut engines = vec![0u64; n.carrier_rank.len()];
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(GRAFT_PLAN_THREADS_MAX)
        .min(ranks)
        .max(1);
    let group = ranks.div_ceil(threads).max(1);
    let start_ref = &start;
    // Gathers ranks `lo..hi` into `region` (their slots of `engines`), then returns the first
    // engine hash one of them carries twice.
    let gather_and_check = |lo: usize, hi: usize, region: &mut [u64]| -> Option<(usize, u64)> {
        let base = start_ref[lo];
        let mut fill: Vec<usize> = start_ref[lo..hi].iter().map(|&at| at - base).collect();
        for (&r, &e) in n.carrier_rank.iter().zip(&n.carrier_engine_hash) {
            let r = r as usize;
            if (lo..hi).contains(&r) {
                region[fill[r - lo]] = e;
                fill[r - lo] += 1;
            }
        }
        let mut seen: HashSet<u64> = HashSet::new();
        for r in lo..hi {
            let mine = &region[start_ref[r] - base..start_ref[r + 1] - base];
            seen.clear();
            seen.reserve(mine.len());
            if let Some(&e) = mine.iter().find(|&&e| !seen.insert(e)) {
                return Some((r, e));
            }
        }
        None
    };
    let (duplicate, died) = std::thread::scope(|scope| {
        let mut rest: &mut [u64] = &mut engines;
        let mut groups = Vec::new();
        for lo in (0..ranks).step_by(group) {
            let hi = (lo + group).min(ranks);
            let (region, tail) = std::mem::take(&mut rest).split_at_mut(start[hi] - start[lo]);
            rest = tail;
            groups.push((lo, hi, region));
        }
        let mut groups = groups.into_iter();
        // The caller's thread takes the first group; one group spawns no helper.
        let first = groups.next();
        let helpers: Vec<_> = groups
            .map(|(lo, hi, region)| {
                (
                    lo,
                    hi,
                    scope.spawn(move || gather_and_check(lo, hi, region)),
                )
            })
            .collect();
        let mut found = first.and_then(|(lo, hi, region)| gather_and_check(lo, hi, region));
        let mut died = Vec::new();
        // Groups are in rank order, so the first duplicate found in group order is the lowest
        // rank's, the one a single thread would report.
        for (lo, hi, helper) in helpers {
            match helper.join() {
                Ok(in_group) => found = found.or(in_group),
                Err(_) => died.push((lo, hi)),
            }
        }
        (found, died)
    });
    // A helper that died left its region unfinished: it is gathered and checked again here, so
    // no group goes unchecked. Its duplicate, if any, is reported in rank order.
    let mut duplicate = duplicate;
    for (lo, hi) in died {
        let (from, to) = (start[lo], start[hi]);
        let again = gather_and_check(lo, hi, &mut engines[from..to]);
        duplicate = match (duplicate, again) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        };
    }
    if let Some((r, e)) = duplicate {
        // The rare path: find the second carrier for the report.
        let carrier = n
            .carrier_rank
            .iter()
            .zip(&n.carrier_engine_hash)
            .enumerate()
            .filter(|(_, (cr, ce))| **cr as usize == r && **ce == e)
            .nth(1)
            .map_or(0, |(c, _)| c);
        return Err(GraftError::DuplicateEngineHash {
            carrier,
            rank: r as u32,
            engine: e,
        });
    }
    Ok(RankEngines { start, engines })
}

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Next snapshot node to visit.
    Nodes {
        next: usize,
    },
    /// Next snapshot rank whose side map to file.
    Sides {
        rank: usize,
    },
    Done,
}

/// An in-progress graft; drive it with [`IndexWriter::graft_step`].
pub struct GraftJob {
    shared: Arc<Shared>,
    plan: GraftPlan,
    /// Snapshot rank -> local rank id, or [`NONE`] when that rank is not (or no longer) grafted.
    local: Vec<u32>,
    stage: Stage,
    /// Node ref + 1 of each placed snapshot node; 0 = not placed (zeroed memory is free to get).
    placed: Vec<u32>,
    /// Shard of each visited snapshot node (its root's shard).
    shard_of: Vec<u8>,
    /// Carriers bucketed by snapshot rank, to file side maps rank by rank, in the slots of the
    /// plan's `rank_engines`: slot `s` of rank `r` (`bucket_start[r] <= s < bucket_fill[r]`) is
    /// the rank's `s - bucket_start[r]`-th carrier in snapshot order, and `bucket_node[s]` its
    /// node ref + 1, or 0 when it was not placed (its node was skipped). `bucket_fill[r]`
    /// advances for every carrier of a grafted rank the job visits, placed or not, which keeps
    /// the slots aligned with the plan's column.
    bucket_start: Vec<usize>,
    bucket_fill: Vec<usize>,
    bucket_node: Vec<u32>,
    /// Engine hashes a placed carrier replaced (the rank already carried the node).
    displaced: Vec<(RankId, u64, u32)>,
    eviction_runs_at_begin: u64,
    ancestors: Vec<u32>,
    /// Shards whose node table was sized for this job's share of the snapshot (see
    /// `place_nodes`).
    shard_sized: Vec<bool>,
    /// What each shard receives, with its prebuilt table, when the plan was laid out for this
    /// index.
    shard_room: Option<ShardLayout>,
    /// Per snapshot rank, 1 + the last snapshot node at which the rank had a grafted carrier:
    /// tells in one pass whether a node's grafted carriers are of distinct ranks.
    rank_seen_at: Vec<usize>,
    /// A node's grafted carriers, gathered to be set at once (see `place_nodes`).
    bare_words: Vec<u32>,
    bare_engines: Vec<u64>,
    report: GraftReport,
}

impl GraftJob {
    pub fn plan(&self) -> &GraftPlan {
        &self.plan
    }

    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done
    }

    /// Local ids of the ranks this job still grafts.
    pub fn ranks(&self) -> Vec<RankId> {
        self.local
            .iter()
            .filter(|&&l| l != NONE)
            .map(|&l| RankId(l))
            .collect()
    }

    /// Snapshot nodes visited so far and in total.
    pub fn progress(&self) -> (usize, usize) {
        let total = self.plan.snapshot.nodes.len();
        match self.stage {
            Stage::Nodes { next } => (next, total),
            _ => (total, total),
        }
    }

    /// Leaves `rank` out of the rest of the job without touching the index: for a rank that
    /// declined the graft before any slice ran. Returns false, excluding nothing, when the job
    /// already placed carriers for it (use [`IndexWriter::abandon_graft_rank`] then) or does not
    /// graft it.
    pub fn exclude_rank(&mut self, rank: RankId) -> bool {
        match self.snapshot_rank_of(rank) {
            Some(r) if self.bucket_fill[r] == self.bucket_start[r] && !self.filed(r) => {
                self.local[r] = NONE;
                true
            }
            _ => false,
        }
    }

    /// Whether snapshot rank `r`'s side map was already filed (its bucket is emptied then).
    fn filed(&self, r: usize) -> bool {
        match self.stage {
            Stage::Nodes { .. } => false,
            Stage::Sides { rank } => rank > r,
            Stage::Done => true,
        }
    }

    fn snapshot_rank_of(&self, rank: RankId) -> Option<usize> {
        self.local.iter().position(|&l| l == rank.0)
    }
}

/// What a finished graft did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GraftReport {
    /// Snapshot nodes placed (created or merged into existing ones), ancestors included.
    pub nodes: u64,
    pub carriers: u64,
    /// Carriers of ranks not (or no longer) grafted, left out.
    pub excluded_carriers: u64,
    /// Snapshot nodes that could not be placed (a shard slab was full), with their carriers.
    pub skipped_nodes: u64,
    /// Side entries left out because the carrier was evicted while the job ran.
    pub stale_entries: u64,
    /// Cursors set, as (local rank id, snapshot cursor).
    pub cursors_set: Vec<(RankId, RankCursor)>,
    pub evicted_carriers: u64,
    /// Pieces of storage taken from the plan's [`GraftRoom`] (slab chunks, carrier lists, side
    /// tables) instead of allocated by the writer.
    pub room_pieces_taken: u64,
}

/// Whether a job is finished.
#[derive(Debug, Clone, PartialEq)]
pub enum GraftProgress {
    More {
        /// Snapshot nodes visited so far.
        nodes_done: usize,
        nodes_total: usize,
    },
    Done(GraftReport),
}

impl IndexWriter {
    /// Starts grafting `plan` for the plan's ranks that are registered here AND named in `ranks`
    /// (every other carrier is left out). Touches nothing in the index; cost is independent of
    /// the snapshot's size apart from zeroed allocations.
    pub fn begin_graft(
        &mut self,
        mut plan: GraftPlan,
        ranks: &[RankId],
    ) -> Result<GraftJob, GraftError> {
        let block_size = self.config().block_size;
        if plan.snapshot.block_size != block_size {
            return Err(RestoreError::BlockSize {
                found: plan.snapshot.block_size,
                expected: block_size,
            }
            .into());
        }
        let named: HashSet<u32> = ranks.iter().map(|r| r.0).collect();
        let local: Vec<u32> = plan
            .snapshot
            .ranks
            .iter()
            .map(|r| match self.rank_id(r) {
                Some(id) if named.contains(&id.0) => id.0,
                _ => NONE,
            })
            .collect();
        let bucket_start = plan.rank_carrier_start.clone();
        let bucketed = plan.rank_engines.len();
        let nodes = plan.snapshot.nodes.len();
        let snapshot_ranks = local.len();
        let mut shard_room = plan
            .shard_layout
            .take()
            .filter(|l| l.shards == self.shared.shards.len());
        // The layout's columns when it made them for this plan: all zeros but `shard_of`, whose
        // entries the job rewrites in order before reading them, whatever index it was laid out
        // for.
        let JobColumns {
            shard_of,
            placed,
            bucket_node,
        } = shard_room
            .as_mut()
            .and_then(|l| l.job_columns.take())
            .filter(|c| c.fit(nodes, bucketed))
            .unwrap_or_else(|| JobColumns {
                shard_of: vec![0; nodes],
                placed: vec![0; nodes],
                // Zeroed memory is free to get, and only the grafted ranks' slots are ever
                // written.
                bucket_node: vec![0; bucketed],
            });
        Ok(GraftJob {
            shared: self.shared.clone(),
            local,
            stage: Stage::Nodes { next: 0 },
            placed,
            shard_of,
            bucket_fill: bucket_start[..bucket_start.len() - 1].to_vec(),
            bucket_start,
            bucket_node,
            displaced: Vec::new(),
            eviction_runs_at_begin: self.reader().counters().eviction_runs,
            ancestors: Vec::new(),
            shard_sized: vec![false; self.shared.shards.len()],
            shard_room,
            rank_seen_at: vec![0; snapshot_ranks],
            bare_words: Vec::new(),
            bare_engines: Vec::new(),
            report: GraftReport::default(),
            plan,
        })
    }

    /// Runs about `items_max` units of the job (at least one node or one rank's side map, so it
    /// always progresses): a snapshot node visited or a carrier placed costs one, as does a side
    /// entry filed. A rank's side map is filed in one go, so a slice can overrun by one rank's
    /// entry count.
    pub fn graft_step(
        &mut self,
        job: &mut GraftJob,
        items_max: usize,
    ) -> Result<GraftProgress, GraftError> {
        if !Arc::ptr_eq(&job.shared, &self.shared) {
            return Err(GraftError::ForeignJob);
        }
        self.drop_unregistered(job);
        let mut spent = 0usize;
        loop {
            match job.stage {
                Stage::Nodes { next } if next < job.plan.snapshot.nodes.len() => {
                    if spent >= items_max.max(1) {
                        break;
                    }
                    spent += self.place_nodes(job, items_max.max(1) - spent);
                }
                Stage::Nodes { .. } => {
                    if let Some(l) = &job.shard_room {
                        l.room.writer_at_node(job.plan.snapshot.nodes.len());
                    }
                    job.stage = Stage::Sides { rank: 0 };
                }
                Stage::Sides { rank } if rank < job.local.len() => {
                    let entries = job.bucket_fill[rank] - job.bucket_start[rank];
                    if spent > 0 && spent.saturating_add(entries) > items_max {
                        break;
                    }
                    self.file_side_entries(job, rank);
                    spent += entries.max(1);
                    job.stage = Stage::Sides { rank: rank + 1 };
                }
                Stage::Sides { .. } => {
                    self.finish_graft(job);
                    job.stage = Stage::Done;
                }
                Stage::Done => return Ok(GraftProgress::Done(job.report.clone())),
            }
        }
        let (nodes_done, nodes_total) = job.progress();
        Ok(GraftProgress::More {
            nodes_done,
            nodes_total,
        })
    }

    /// Runs the whole job at once (tests, and callers with nothing to interleave).
    pub fn graft_all(&mut self, job: &mut GraftJob) -> Result<GraftReport, GraftError> {
        loop {
            if let GraftProgress::Done(report) = self.graft_step(job, usize::MAX)? {
                return Ok(report);
            }
        }
    }

    /// Stops grafting `rank` and removes every carrier the job gave it, and its cursor, whatever
    /// stage the job is at (after `Done`, this is just clearing the rank). Call it BEFORE
    /// `remove_rank` of a rank in a running job: until the job files the rank's side map,
    /// removal could not find the grafted carriers.
    pub fn abandon_graft_rank(&mut self, job: &mut GraftJob, rank: RankId) {
        if Arc::ptr_eq(&job.shared, &self.shared)
            && let Some(r) = job.snapshot_rank_of(rank)
        {
            // A no-op when the rank's map is already filed (its bucket is emptied then).
            self.file_side_entries(job, r);
            job.local[r] = NONE;
        }
        self.clear_rank(rank);
        self.set_cursor(rank, None);
    }

    /// Excludes plan ranks that were removed (or removed and re-added under a new id) since the
    /// job began: what they had was dropped with them, and a new incarnation is not theirs.
    fn drop_unregistered(&self, job: &mut GraftJob) {
        for (r, l) in job.local.iter_mut().enumerate() {
            if *l != NONE && self.rank_id(&job.plan.snapshot.ranks[r]) != Some(RankId(*l)) {
                *l = NONE;
            }
        }
    }

    /// Visits snapshot nodes from the job's cursor for about `budget` units; returns units spent.
    fn place_nodes(&mut self, job: &mut GraftJob, budget: usize) -> usize {
        let shared = self.shared.clone();
        let GraftJob {
            plan,
            local,
            stage,
            placed,
            shard_of,
            bucket_fill,
            bucket_node,
            displaced,
            ancestors,
            shard_sized,
            shard_room,
            rank_seen_at,
            bare_words,
            bare_engines,
            report,
            ..
        } = job;
        let Stage::Nodes { mut next } = *stage else {
            return 0;
        };
        let n = &plan.snapshot.nodes;
        let total = n.len();
        let mut spent = 0usize;
        let mut delta = RestoreDelta::default();
        while next < total && spent < budget {
            let shard_idx = shard_of_node(&shared, n, shard_of, next);
            let mut shard = shared.shards[shard_idx].write();
            shard.mutations += 1;
            if !shard_sized[shard_idx] {
                // Room for what this shard receives (exact when the plan was laid out for this
                // index, else an even share with some slack), taken the first time the job
                // writes here: one rehash of the shard's table instead of one per growth step
                // while its nodes arrive. Nodes already in the index (shared with live ranks)
                // only leave room unused.
                let (nodes, lists, table) = match shard_room {
                    Some(room) => (
                        room.nodes_per_shard[shard_idx],
                        room.lists_per_shard[shard_idx],
                        std::mem::take(&mut room.tables[shard_idx]),
                    ),
                    None => {
                        let share = total / shard_sized.len();
                        (share + share / 8, 0, HashSlots::default())
                    }
                };
                shard.reserve_for_graft(nodes, lists, table);
                shard_sized[shard_idx] = true;
            }
            // A chunk made ready on the room's thread, when this lock span may grow the slab
            // past what it has: its pages are resident, so the placements below do not fault.
            if let Some(room) = shard_room.as_ref().map(|l| &l.room)
                && shard.nodes.needs_chunk_within(GRAFT_LOCK_NODES_MAX)
                && let Some(chunk) = room.take_chunk()
            {
                shard.nodes.give_spare(chunk);
                report.room_pieces_taken += 1;
            }
            let mut in_lock = 0usize;
            while next < total && spent < budget && in_lock < GRAFT_LOCK_NODES_MAX {
                let i = next;
                if shard_of_node(&shared, n, shard_of, i) != shard_idx {
                    break;
                }
                // The node a few places ahead is, unless a root starts between, in this
                // subtree and so in this shard: its table slot is fetched while this one is
                // placed. On a large index every placement probes a table no cache holds, and
                // that probe is most of a graft's time.
                if let Some(&ahead) = n.content_hash.get(i + GRAFT_PREFETCH_NODES_AHEAD)
                    && n.parent[i + GRAFT_PREFETCH_NODES_AHEAD] != NO_PARENT
                {
                    shard.prefetch_slot(ahead);
                }
                let c_start = if i == 0 {
                    0
                } else {
                    n.carrier_end[i - 1] as usize
                };
                let c_end = n.carrier_end[i] as usize;
                spent += 1 + (c_end - c_start);
                in_lock += 1;
                next += 1;
                let mut grafted = 0usize;
                let mut ranks_distinct = true;
                for c in c_start..c_end {
                    let r = n.carrier_rank[c] as usize;
                    if local[r] == NONE {
                        continue;
                    }
                    grafted += 1;
                    ranks_distinct &= rank_seen_at[r] != i + 1;
                    rank_seen_at[r] = i + 1;
                }
                report.excluded_carriers += (c_end - c_start - grafted) as u64;
                if grafted == 0 {
                    // Placed later, and only if a descendant needs it as an ancestor.
                    continue;
                }
                let placement = Placement {
                    n,
                    placed: placed.as_mut_slice(),
                    ancestors: &mut *ancestors,
                    report: &mut *report,
                };
                let Some(idx) = self.place_with_ancestors(placement, &mut shard, shard_idx, i)
                else {
                    report.skipped_nodes += 1;
                    // The node's carriers keep their slots, empty, so the ranks' later carriers
                    // stay aligned with the plan's engine column.
                    for c in c_start..c_end {
                        let r = n.carrier_rank[c] as usize;
                        if local[r] != NONE {
                            bucket_fill[r] += 1;
                        }
                    }
                    continue;
                };
                let node_ref = shared.node_ref(shard_idx, idx);
                // The common case on a booting replica, whose index holds nothing yet: a shared
                // prefix's node gets its carriers in one list of the final size.
                let at_once = grafted >= 2 && ranks_distinct && shard.carries_nothing(idx);
                bare_words.clear();
                bare_engines.clear();
                for c in c_start..c_end {
                    let r = n.carrier_rank[c] as usize;
                    if local[r] == NONE {
                        continue;
                    }
                    let engine = n.carrier_engine_hash[c];
                    if at_once {
                        bare_words.push(word(local[r], n.carrier_tiers[c]));
                        bare_engines.push(engine);
                    } else {
                        self.restore_carrier(
                            RankId(local[r]),
                            node_ref,
                            n.carrier_tiers[c],
                            engine,
                            &mut shard,
                            &mut delta,
                            displaced,
                        );
                    }
                    let slot = bucket_fill[r];
                    debug_assert_eq!(plan.rank_engines[slot], engine, "bucket slots aligned");
                    bucket_node[slot] = node_ref + 1;
                    bucket_fill[r] += 1;
                }
                if at_once {
                    let made = shard_room.as_ref().and_then(|l| l.room.take_list(i));
                    report.room_pieces_taken += u64::from(made.is_some());
                    self.restore_bare_carriers(
                        &mut shard,
                        idx,
                        bare_words,
                        bare_engines,
                        &mut delta,
                        made,
                    );
                }
                report.carriers += grafted as u64;
            }
        }
        self.flush_restore_delta(&mut delta);
        if let Some(l) = shard_room.as_ref() {
            l.room.writer_at_node(next);
        }
        *stage = Stage::Nodes { next };
        spent
    }

    /// Slab index of snapshot node `i`, creating it and any ancestor that is not (or no longer)
    /// in the index, top-down; `None` when the shard is full.
    fn place_with_ancestors(
        &self,
        p: Placement<'_>,
        shard: &mut Shard,
        shard_idx: usize,
        i: usize,
    ) -> Option<u32> {
        p.ancestors.clear();
        let mut j = i;
        let mut base = NONE;
        loop {
            if let Some(idx) = live_placement(
                &self.shared,
                shard,
                shard_idx,
                p.placed[j],
                p.n.content_hash[j],
            ) {
                base = idx;
                break;
            }
            p.ancestors.push(j as u32);
            match p.n.parent[j] {
                NO_PARENT => break,
                parent => j = parent as usize,
            }
        }
        let mut parent = base;
        while let Some(j) = p.ancestors.pop() {
            let j = j as usize;
            let Some(idx) = self.find_or_create_in(shard, p.n.content_hash[j], parent) else {
                self.count_shard_full(1);
                return None;
            };
            p.placed[j] = self.shared.node_ref(shard_idx, idx) + 1;
            p.report.nodes += 1;
            parent = idx;
        }
        Some(parent)
    }

    /// Files snapshot rank `r`'s placed carriers in its side map (skipping carriers evicted since
    /// they were placed), then forgets them.
    fn file_side_entries(&mut self, job: &mut GraftJob, r: usize) {
        let local = job.local[r];
        let (lo, hi) = (job.bucket_start[r], job.bucket_fill[r]);
        job.bucket_fill[r] = lo;
        if local == NONE || lo == hi {
            return;
        }
        let rank = RankId(local);
        let made = job
            .shard_room
            .as_ref()
            .and_then(|l| l.room.take_side_table(r));
        job.report.room_pieces_taken += u64::from(made.is_some());
        let mut entries: Vec<(u64, u32)> = job.plan.rank_engines[lo..hi]
            .iter()
            .zip(&job.bucket_node[lo..hi])
            .filter(|&(_, &placed)| placed != 0)
            .map(|(&engine, &placed)| (engine, placed - 1))
            .collect();
        if self.reader().counters().eviction_runs != job.eviction_runs_at_begin {
            let before = entries.len();
            let guards: Vec<_> = self.shared.shards.iter().map(|s| s.read()).collect();
            entries.retain(|&(engine, node_ref)| {
                let (s, idx) = self.shared.split_ref(node_ref);
                guards.get(s).is_some_and(|g| carries(g, idx, rank, engine))
            });
            job.report.stale_entries += (before - entries.len()) as u64;
        }
        let displaced: Vec<(u64, u32)> = job
            .displaced
            .iter()
            .filter(|d| d.0 == rank)
            .map(|d| (d.1, d.2))
            .collect();
        job.displaced.retain(|d| d.0 != rank);
        self.restore_side_entries(rank, &displaced, &entries, EntryKeys::Distinct, made);
    }

    fn finish_graft(&mut self, job: &mut GraftJob) {
        for c in &job.plan.snapshot.cursors {
            let local = job.local[c.rank as usize];
            if local == NONE {
                continue;
            }
            self.set_cursor(RankId(local), Some((c.seq, c.ts)));
            job.report.cursors_set.push((RankId(local), *c));
        }
        job.report.evicted_carriers = self.enforce_cap();
    }
}

/// The shard of snapshot node `i`, its root's; recorded so descendants find it without a walk.
fn shard_of_node(shared: &Shared, n: &SnapshotNodes, shard_of: &mut [u8], i: usize) -> usize {
    let s = match n.parent[i] {
        NO_PARENT => shared.shard_of_root(n.content_hash[i]),
        p => usize::from(shard_of[p as usize]),
    };
    // Shard counts are at most SHARD_COUNT_MAX (256), so a shard index fits a byte.
    shard_of[i] = s as u8;
    s
}

/// The parts of a job that placing one node touches.
struct Placement<'a> {
    n: &'a SnapshotNodes,
    placed: &'a mut [u32],
    ancestors: &'a mut Vec<u32>,
    report: &'a mut GraftReport,
}

/// The slab index `placed` (a node ref + 1, or 0) names, if that slot still holds a live node
/// with `hash`. A node the job placed may have been pruned (after an eviction) and its slot
/// reused between slices; a slot reused for the same hash is the same block, so it is accepted.
fn live_placement(
    shared: &Shared,
    shard: &Shard,
    shard_idx: usize,
    placed: u32,
    hash: u64,
) -> Option<u32> {
    let (s, idx) = shared.split_ref(placed.checked_sub(1)?);
    let node = shard.nodes.get(idx as usize)?;
    (s == shard_idx && !node.is_free() && node.hash == hash).then_some(idx)
}

/// Whether `rank` carries the node at `idx` under `engine`.
fn carries(shard: &Shard, idx: u32, rank: RankId, engine: u64) -> bool {
    let Some(node) = shard.nodes.get(idx as usize) else {
        return false;
    };
    if node.is_free() {
        return false;
    }
    let (words, engines) = shard.carriers(node);
    words
        .iter()
        .zip(engines)
        .any(|(&w, &e)| word_rank(w) == rank.0 && e == engine)
}
