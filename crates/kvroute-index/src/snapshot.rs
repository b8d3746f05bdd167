//! Export, validation, restore and rank filtering of the columnar [`IndexSnapshot`].
//!
//! Export never holds a shard lock for long: each shard's slab is read in chunks of
//! [`EXPORT_CHUNK_NODES`] under a read lock, then ordered off-lock depth-first (parents before
//! children, and each chain's nodes adjacent, so a restored slab keeps chains in order).
//! Because the writer may run between chunks, the walk is not atomic; two rules keep the result
//! honest:
//! * nodes are linked by content hash, not slab index, and a node whose parent was not seen is
//!   dropped (with its subtree), so a chunk race can lose blocks but never invent a broken tree;
//! * each rank's cursor is read BEFORE the walk, and that pre-walk cursor `c` is the snapshot's
//!   watermark for the rank even when batches were applied during the walk, as long as they
//!   belong to the same publisher stream (the cursor's stream epoch is unchanged and its `seq`
//!   did not go back; otherwise the rank gets no cursor). The snapshot then holds every effect of
//!   the batches `<= c` plus an arbitrary part of the effects of batches `c+1 ..` applied during
//!   the walk. A consumer drops what it holds up to `c` and applies every batch above `c` in
//!   order, and that converges to the producer's view, because every event names the keys it
//!   writes (the rank's carrier of one block, or all of the rank's carriers) and the last write
//!   to a key wins: a key no batch above `c` touched was constant during the walk, so the
//!   snapshot has its value at `c`; a key some batch above `c` touched ends with the replayed
//!   last write (re-storing a stored block and removing an absent one are no-ops). The one
//!   exception only ever LOSES blocks: a `BlockStored` whose parent the same rank removed later
//!   in the walk, when the walk already saw that removal, finds no parent on replay and is
//!   dropped (as the index drops any store under an unknown parent), so a consumer may lack a
//!   block the producer has, never hold one the producer does not (as long as the producer itself
//!   never dropped a store of that stream). `tests/export_under_writes.rs` checks both halves
//!   against a writer thread that never pauses. Requiring an unmoved cursor
//!   instead would make every rank of a busy fleet uncoverable (every cursor moves during a
//!   walk of a large index).
//!
//! Restore validates the whole snapshot before touching the index, so a malformed snapshot leaves
//! the index exactly as it was, and names the first violation with its position.

use std::sync::Arc;

use hashbrown::HashMap;
use kvroute_wire::snapshot::{
    IndexSnapshot, NO_PARENT, RankCursor, SNAPSHOT_FORMAT, SnapshotNodes,
};
use thiserror::Error;

use crate::hash::HASH_SCHEME;
use crate::index::{
    EntryKeys, IndexReader, IndexWriter, RankId, RestoreDelta, TIER_ALL, word_rank, word_tiers,
};

/// Nodes read per shard read-lock acquisition during export (bounds writer wait to ~tens of us).
pub const EXPORT_CHUNK_NODES: usize = 4096;
/// Snapshot nodes applied per shard write-lock acquisition during restore.
pub const RESTORE_CHUNK_NODES: usize = 4096;
/// An export's columns are allocated with 1/this more room than the index holds when they are
/// sized (see [`IndexReader::export_column_room`]).
pub const EXPORT_COLUMN_HEADROOM_DIVISOR: usize = 32;
/// ... and at least this many entries more.
pub const EXPORT_COLUMN_HEADROOM_MIN: usize = 4096;

/// The first violation found in a snapshot, with its position.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RestoreError {
    #[error("snapshot format {found}, this build reads {expected}")]
    Format { found: u32, expected: u32 },
    #[error("snapshot hash scheme {found:?}, this build uses {expected:?}")]
    HashScheme { found: String, expected: String },
    #[error("snapshot block size {found}, this index uses {expected}")]
    BlockSize { found: u32, expected: u32 },
    #[error("snapshot column {column} has {len} entries, expected {expected}")]
    ColumnLength {
        column: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("carrier_end decreases at node {node}")]
    CarrierEndNotMonotone { node: usize },
    #[error("carrier_end ends at {last}, but there are {carriers} carriers")]
    CarrierEndMismatch { last: u64, carriers: usize },
    #[error("node {node} has parent {parent}, which does not precede it")]
    ParentNotBefore { node: usize, parent: u32 },
    #[error("carrier {carrier} names rank {rank}, but there are {ranks} ranks")]
    CarrierRankOutOfRange {
        carrier: usize,
        rank: u32,
        ranks: usize,
    },
    #[error("rank {index} repeats rank {first}")]
    DuplicateRank { index: usize, first: usize },
    #[error("cursor {cursor} names rank {rank}, but there are {ranks} ranks")]
    CursorRankOutOfRange {
        cursor: usize,
        rank: u32,
        ranks: usize,
    },
    #[error("cursor {cursor} is a second cursor for rank {rank}")]
    DuplicateCursor { cursor: usize, rank: u32 },
    #[error("empty_ranks[{index}] names rank {rank}, but there are {ranks} ranks")]
    EmptyRankOutOfRange {
        index: usize,
        rank: u32,
        ranks: usize,
    },
    #[error("partial_ranks[{index}] names rank {rank}, but there are {ranks} ranks")]
    PartialRankOutOfRange {
        index: usize,
        rank: u32,
        ranks: usize,
    },
    #[error("carrier {carrier} has no tier bit set")]
    ZeroTiers { carrier: usize },
    #[error("carrier {carrier} has unknown tier bits {tiers:#x}")]
    UnknownTierBits { carrier: usize, tiers: u8 },
    #[error("snapshot has {ranks} ranks, more than the index can register")]
    TooManyRanks { ranks: usize },
}

/// What a restore did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RestoreReport {
    /// Snapshot rank index -> local rank id.
    pub rank_map: Vec<RankId>,
    /// Snapshot nodes placed (created or merged into existing nodes).
    pub nodes: u64,
    pub carriers: u64,
    /// Snapshot nodes not placed (a shard slab was full), with their subtrees.
    pub skipped_nodes: u64,
    /// Every snapshot cursor, with `rank` mapped to the local [`RankId`]; the caller decides.
    pub cursors: Vec<RankCursor>,
    /// Ranks that had no cursor and got the snapshot's.
    pub cursors_set: Vec<RankId>,
    pub evicted_carriers: u64,
}

/// Checks every structural rule of a snapshot (everything but format, scheme and block size).
/// The first entry of a list of rank indices that names no rank, with its position.
fn first_out_of_range(list: &[u32], ranks: usize) -> Option<(usize, u32)> {
    list.iter()
        .enumerate()
        .find(|(_, r)| **r as usize >= ranks)
        .map(|(i, &r)| (i, r))
}

pub fn validate_structure(s: &IndexSnapshot) -> Result<(), RestoreError> {
    let n = &s.nodes;
    let len = n.parent.len();
    for (column, l) in [
        ("content_hash", n.content_hash.len()),
        ("carrier_end", n.carrier_end.len()),
    ] {
        if l != len {
            return Err(RestoreError::ColumnLength {
                column,
                len: l,
                expected: len,
            });
        }
    }
    let carriers = n.carrier_rank.len();
    for (column, l) in [
        ("carrier_tiers", n.carrier_tiers.len()),
        ("carrier_engine_hash", n.carrier_engine_hash.len()),
    ] {
        if l != carriers {
            return Err(RestoreError::ColumnLength {
                column,
                len: l,
                expected: carriers,
            });
        }
    }
    let mut prev = 0u32;
    for (i, &end) in n.carrier_end.iter().enumerate() {
        if end < prev {
            return Err(RestoreError::CarrierEndNotMonotone { node: i });
        }
        prev = end;
    }
    if prev as usize != carriers {
        return Err(RestoreError::CarrierEndMismatch {
            last: u64::from(prev),
            carriers,
        });
    }
    for (i, &p) in n.parent.iter().enumerate() {
        if p != NO_PARENT && p as usize >= i {
            return Err(RestoreError::ParentNotBefore { node: i, parent: p });
        }
    }
    let ranks = s.ranks.len();
    if ranks > crate::index::RANK_IDS_MAX as usize {
        return Err(RestoreError::TooManyRanks { ranks });
    }
    for (i, &r) in n.carrier_rank.iter().enumerate() {
        if r as usize >= ranks {
            return Err(RestoreError::CarrierRankOutOfRange {
                carrier: i,
                rank: r,
                ranks,
            });
        }
    }
    let mut seen: HashMap<&kvroute_wire::snapshot::RankRef, usize> = HashMap::with_capacity(ranks);
    for (i, r) in s.ranks.iter().enumerate() {
        if let Some(&first) = seen.get(r) {
            return Err(RestoreError::DuplicateRank { index: i, first });
        }
        seen.insert(r, i);
    }
    let mut has_cursor = vec![false; ranks];
    for (i, c) in s.cursors.iter().enumerate() {
        let Some(slot) = has_cursor.get_mut(c.rank as usize) else {
            return Err(RestoreError::CursorRankOutOfRange {
                cursor: i,
                rank: c.rank,
                ranks,
            });
        };
        if *slot {
            return Err(RestoreError::DuplicateCursor {
                cursor: i,
                rank: c.rank,
            });
        }
        *slot = true;
    }
    if let Some((index, rank)) = first_out_of_range(&s.empty_ranks, ranks) {
        return Err(RestoreError::EmptyRankOutOfRange { index, rank, ranks });
    }
    if let Some((index, rank)) = first_out_of_range(&s.partial_ranks, ranks) {
        return Err(RestoreError::PartialRankOutOfRange { index, rank, ranks });
    }
    for (i, &t) in n.carrier_tiers.iter().enumerate() {
        if t == 0 {
            return Err(RestoreError::ZeroTiers { carrier: i });
        }
        if t & !TIER_ALL != 0 {
            return Err(RestoreError::UnknownTierBits {
                carrier: i,
                tiers: t,
            });
        }
    }
    Ok(())
}

/// Checks header fields against this build and index, then the structure.
pub fn validate_snapshot(s: &IndexSnapshot, block_size: u32) -> Result<(), RestoreError> {
    if s.format != SNAPSHOT_FORMAT {
        return Err(RestoreError::Format {
            found: s.format,
            expected: SNAPSHOT_FORMAT,
        });
    }
    if s.hash_scheme != HASH_SCHEME {
        return Err(RestoreError::HashScheme {
            found: s.hash_scheme.clone(),
            expected: HASH_SCHEME.to_string(),
        });
    }
    if s.block_size != block_size {
        return Err(RestoreError::BlockSize {
            found: s.block_size,
            expected: block_size,
        });
    }
    validate_structure(s)
}

type HashToIdx = HashMap<u64, u32, crate::hash::ContentHashBuilder>;

const NONE: u32 = u32::MAX;

struct Rec {
    hash: u64,
    parent_hash: u64,
    slot: u32,
    parent_slot: u32,
    is_root: bool,
    c_start: u32,
    c_end: u32,
}

const ROOT_REC: u32 = u32::MAX;
const ORPHAN_REC: u32 = u32::MAX - 1;

/// What an export saw of the writer while it walked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// Ranks whose cursor advanced during the walk; each keeps its pre-walk cursor as the
    /// watermark (see the module doc).
    pub cursors_advanced: usize,
    /// Ranks whose cursor went to another stream during the walk (publisher reset, discarded
    /// graft, cleared), or that had no cursor before it: they carry no cursor in the snapshot.
    pub cursors_withheld: usize,
}

/// The cursor an export may claim for one rank, from its cells before and after the walk.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum WalkWatermark {
    /// The pre-walk cursor; `advanced` when batches of the same stream applied during the walk.
    Claim { seq: i64, ts: f64, advanced: bool },
    /// The rank had no cursor before or after: nothing to claim, nothing moved.
    NoStream,
    /// Another stream began (or the cursor appeared) during the walk: no cursor may be claimed.
    Withheld,
}

pub(crate) fn walk_watermark(
    before: crate::index::CursorCell,
    after: crate::index::CursorCell,
) -> WalkWatermark {
    match (before.value, after.value) {
        (Some((seq, ts)), Some((after_seq, _)))
            if before.stream_epoch == after.stream_epoch && after_seq >= seq =>
        {
            WalkWatermark::Claim {
                seq,
                ts,
                advanced: after_seq != seq,
            }
        }
        (None, None) if before.stream_epoch == after.stream_epoch => WalkWatermark::NoStream,
        _ => WalkWatermark::Withheld,
    }
}

impl IndexReader {
    /// A snapshot of the whole index; see the module doc for its consistency rules.
    /// `producer_ready` is always false: only the service knows whether to trust the index.
    pub fn export_snapshot(&self) -> IndexSnapshot {
        self.export_snapshot_with_report().0
    }

    /// [`IndexReader::export_snapshot`], with what the walk saw of the writer.
    pub fn export_snapshot_with_report(&self) -> (IndexSnapshot, ExportReport) {
        let (nodes, carriers) = self.export_column_room();
        self.export_snapshot_into(SnapshotNodes::with_capacity(nodes, carriers))
    }

    /// The room an export's columns need for what the index holds now, as (nodes, carriers):
    /// bounded by the index's own cap on carried pairs, and by its nodes.
    pub fn export_column_hints(&self) -> (usize, usize) {
        let carriers = self
            .shared
            .total_carried_hint()
            .min(self.shared.cfg.max_carried_blocks) as usize;
        (self.node_count() as usize, carriers)
    }

    /// The room to allocate for an export's columns before its walk: what the index holds now
    /// ([`IndexReader::export_column_hints`]) plus a 1/[`EXPORT_COLUMN_HEADROOM_DIVISOR`] share
    /// and [`EXPORT_COLUMN_HEADROOM_MIN`] entries for what live batches add before and during the
    /// walk. Without it, a live index had always grown a little by the time the walk sized its
    /// columns, and every column was allocated again and the first copied into it (measured:
    /// a quarter of a 64-rank export walk's samples, docs/BENCHMARKS.md).
    pub fn export_column_room(&self) -> (usize, usize) {
        let (nodes, carriers) = self.export_column_hints();
        let padded = |n: usize| {
            n.saturating_add(n / EXPORT_COLUMN_HEADROOM_DIVISOR)
                .saturating_add(EXPORT_COLUMN_HEADROOM_MIN)
        };
        (padded(nodes), padded(carriers))
    }

    /// [`IndexReader::export_snapshot_with_report`] into `columns` the caller allocated (cleared
    /// first, replaced only if smaller than [`IndexReader::export_column_hints`]: allocate them
    /// with [`IndexReader::export_column_room`]), so a caller can prepare their memory while the
    /// walk fills them.
    pub fn export_snapshot_into(&self, columns: SnapshotNodes) -> (IndexSnapshot, ExportReport) {
        let shared = &self.shared;
        let table: Vec<(u32, Arc<crate::index::RankShared>)> = shared
            .ranks
            .read()
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (i as u32, r.clone())))
            .collect();
        let cursors_before: Vec<crate::index::CursorCell> =
            table.iter().map(|(_, r)| r.cursor_cell()).collect();
        let id_limit = table.last().map_or(0, |(id, _)| *id as usize + 1);
        let mut snap_rank_of_id = vec![NONE; id_limit];
        for (pos, (id, _)) in table.iter().enumerate() {
            snap_rank_of_id[*id as usize] = pos as u32;
        }

        // Every column sized once to what the index holds now: grown by doubling instead, a
        // column is written about twice over and copied at each step, and at 1,024 ranks the
        // carrier columns passed the old fixed cap of 50 M and doubled to room for 200 M. On a
        // host where first touches of memory are slow, that writing is most of an export's time.
        // Columns the caller sized with headroom keep their memory: only what the index holds
        // now must fit, and a column short of it is replaced by one with the headroom.
        let (nodes_hint, carriers_hint) = self.export_column_hints();
        let mut out = columns;
        let (nodes_room, carriers_room) = if out.has_room(nodes_hint, carriers_hint) {
            (nodes_hint, carriers_hint)
        } else {
            self.export_column_room()
        };
        out.clear_with_room(nodes_room, carriers_room);
        let mut carried_per_rank = vec![0u64; table.len()];
        let mut recs: Vec<Rec> = Vec::new();
        let mut tmp_carriers: Vec<(u32, u8, u64)> = Vec::new();
        let mut order: Vec<u32> = Vec::new();
        let mut child_start: Vec<u32> = Vec::new();
        let mut child_fill: Vec<u32> = Vec::new();
        let mut children: Vec<u32> = Vec::new();
        let mut emitted: HashToIdx = HashToIdx::default();
        let mut slot_to_snap: Vec<u32> = Vec::new();
        let mut rec_of_slot: Vec<u32> = Vec::new();
        let mut parent_rec: Vec<u32> = Vec::new();
        let mut dfs_stack: Vec<u32> = Vec::new();

        for lock in shared.shards.iter() {
            recs.clear();
            tmp_carriers.clear();
            let mut start = 0usize;
            // The shard's write counter at the first chunk; if it never changes, slab indices
            // are a consistent naming and the hash map is not needed.
            let mut first_mutations = None;
            let mut stable = true;
            let mut slab_len = 0usize;
            loop {
                let shard = lock.read();
                let m = *first_mutations.get_or_insert(shard.mutations);
                stable &= m == shard.mutations;
                slab_len = slab_len.max(shard.nodes.len());
                let end = shard.nodes.len().min(start + EXPORT_CHUNK_NODES);
                if start >= end {
                    break;
                }
                for slot in start..end {
                    let node = &shard.nodes[slot];
                    if node.is_free() {
                        continue;
                    }
                    let c_start = tmp_carriers.len() as u32;
                    let (words, engines) = shard.carriers(node);
                    for (&w, &e) in words.iter().zip(engines) {
                        let snap_rank = snap_rank_of_id
                            .get(word_rank(w) as usize)
                            .copied()
                            .unwrap_or(NONE);
                        if snap_rank != NONE {
                            tmp_carriers.push((snap_rank, word_tiers(w), e));
                        }
                    }
                    let (parent_hash, is_root) = if node.parent == NONE {
                        (0, true)
                    } else {
                        (shard.nodes[node.parent as usize].hash, false)
                    };
                    recs.push(Rec {
                        hash: node.hash,
                        parent_hash,
                        slot: slot as u32,
                        parent_slot: node.parent,
                        is_root,
                        c_start,
                        c_end: tmp_carriers.len() as u32,
                    });
                }
                start = end;
            }
            // Link each rec to its parent's rec off-lock: by slab slot when the shard did not
            // move during the walk, else by content hash (slots may have been reused between
            // chunks). A rec whose parent was not seen gets ORPHAN_REC.
            parent_rec.clear();
            if stable {
                rec_of_slot.clear();
                rec_of_slot.resize(slab_len, NONE);
                for (i, r) in recs.iter().enumerate() {
                    rec_of_slot[r.slot as usize] = i as u32;
                }
                parent_rec.extend(recs.iter().map(|r| {
                    if r.is_root {
                        ROOT_REC
                    } else {
                        match rec_of_slot.get(r.parent_slot as usize) {
                            Some(&p) if p != NONE => p,
                            _ => ORPHAN_REC,
                        }
                    }
                }));
            } else {
                emitted.clear();
                emitted.reserve(recs.len());
                for (i, r) in recs.iter().enumerate() {
                    let _ = emitted.try_insert(r.hash, i as u32);
                }
                parent_rec.extend(recs.iter().map(|r| {
                    if r.is_root {
                        ROOT_REC
                    } else {
                        emitted.get(&r.parent_hash).copied().unwrap_or(ORPHAN_REC)
                    }
                }));
            }
            // Depth-first preorder from the roots, children in slab order: parents still come
            // before children, and a chain whose nodes were created together (adjacent in the
            // slab) is emitted, hence restored, as adjacent nodes again, which is what lets
            // `match_prefix` follow chains through the slab on a restored replica too. Recs
            // below an orphan, or on a parent cycle (possible only through a content-hash
            // collision in a racing walk), are never reached from a root, so they are dropped.
            child_start.clear();
            child_start.resize(recs.len() + 1, 0);
            for &p in &parent_rec {
                if p != ROOT_REC && p != ORPHAN_REC {
                    child_start[p as usize + 1] += 1;
                }
            }
            for i in 1..child_start.len() {
                child_start[i] += child_start[i - 1];
            }
            children.clear();
            children.resize(child_start[recs.len()] as usize, 0);
            child_fill.clear();
            child_fill.extend_from_slice(&child_start[..recs.len()]);
            for (i, &p) in parent_rec.iter().enumerate() {
                if p != ROOT_REC && p != ORPHAN_REC {
                    let f = &mut child_fill[p as usize];
                    children[*f as usize] = i as u32;
                    *f += 1;
                }
            }
            order.clear();
            dfs_stack.clear();
            dfs_stack.extend(
                (0..recs.len() as u32)
                    .rev()
                    .filter(|&i| parent_rec[i as usize] == ROOT_REC),
            );
            while let Some(ri) = dfs_stack.pop() {
                order.push(ri);
                let kids = &children
                    [child_start[ri as usize] as usize..child_start[ri as usize + 1] as usize];
                dfs_stack.extend(kids.iter().rev());
            }
            emitted.clear();
            slot_to_snap.clear();
            if stable {
                slot_to_snap.resize(slab_len, NONE);
            } else {
                emitted.reserve(recs.len());
            }
            for &ri in &order {
                let r = &recs[ri as usize];
                let idx = out.parent.len() as u32;
                let parent = if stable {
                    slot_to_snap[r.slot as usize] = idx;
                    if r.is_root {
                        NO_PARENT
                    } else {
                        slot_to_snap[r.parent_slot as usize]
                    }
                } else {
                    let parent = if r.is_root {
                        NO_PARENT
                    } else {
                        match emitted.get(&r.parent_hash) {
                            Some(&p) => p,
                            // Parent created after its chunk was read: drop the orphan.
                            None => continue,
                        }
                    };
                    if emitted.try_insert(r.hash, idx).is_err() {
                        // The same node seen twice (freed and recreated between chunks).
                        continue;
                    }
                    parent
                };
                out.parent.push(parent);
                out.content_hash.push(r.hash);
                for &(rank, tiers, engine) in &tmp_carriers[r.c_start as usize..r.c_end as usize] {
                    out.carrier_rank.push(rank);
                    out.carrier_tiers.push(tiers);
                    out.carrier_engine_hash.push(engine);
                    carried_per_rank[rank as usize] += 1;
                }
                out.carrier_end.push(out.carrier_rank.len() as u32);
            }
        }

        let mut cursors = Vec::new();
        let mut report = ExportReport::default();
        for (pos, ((_, r), before)) in table.iter().zip(&cursors_before).enumerate() {
            match walk_watermark(*before, r.cursor_cell()) {
                WalkWatermark::Claim { seq, ts, advanced } => {
                    report.cursors_advanced += usize::from(advanced);
                    cursors.push(RankCursor {
                        rank: pos as u32,
                        seq,
                        ts,
                    });
                }
                WalkWatermark::NoStream => {}
                WalkWatermark::Withheld => report.cursors_withheld += 1,
            }
        }
        let snapshot = IndexSnapshot {
            format: SNAPSHOT_FORMAT,
            hash_scheme: HASH_SCHEME.to_string(),
            block_size: shared.cfg.block_size,
            producer_ready: false,
            ranks: table.iter().map(|(_, r)| r.rank_ref.clone()).collect(),
            cursors,
            // Every rank carrying nothing; the index cannot know whether it saw a rank's whole
            // history, so the service narrows this to the ranks whose history was complete.
            empty_ranks: carried_per_rank
                .iter()
                .enumerate()
                .filter(|(_, c)| **c == 0)
                .map(|(i, _)| i as u32)
                .collect(),
            // Likewise only the service knows which ranks' histories are partial.
            partial_ranks: Vec::new(),
            nodes: out,
        };
        (snapshot, report)
    }
}

impl IndexWriter {
    /// Validates `s` completely, then unions it into the index: ranks mapped by [`RankRef`]
    /// through [`IndexWriter::add_rank`], carriers merged into existing nodes, side maps rebuilt.
    /// A rank's cursor is set only when it has none; every snapshot cursor is reported.
    ///
    /// [`RankRef`]: kvroute_wire::snapshot::RankRef
    pub fn restore_snapshot(&mut self, s: &IndexSnapshot) -> Result<RestoreReport, RestoreError> {
        validate_snapshot(s, self.config().block_size)?;
        let mut report = RestoreReport {
            rank_map: s.ranks.iter().map(|r| self.add_rank(r.clone())).collect(),
            ..RestoreReport::default()
        };
        let shared = self.shared.clone();
        let n = &s.nodes;
        self.reserve_for_restore(n.len());
        let mut node_ref_of = vec![NONE; n.len()];
        let mut delta = RestoreDelta::default();
        let mut displaced: Vec<(RankId, u64, u32)> = Vec::new();
        let mut i = 0usize;
        while i < n.len() {
            // Lock the shard of node i and keep it while the following nodes stay in it.
            let shard_idx = match self.restore_shard_of(s, i, &node_ref_of) {
                Some(sh) => sh,
                None => {
                    report.skipped_nodes += 1;
                    i += 1;
                    continue;
                }
            };
            let mut shard = shared.shards[shard_idx].write();
            shard.mutations += 1;
            let chunk_end = (i + RESTORE_CHUNK_NODES).min(n.len());
            while i < chunk_end {
                let sh = match self.restore_shard_of(s, i, &node_ref_of) {
                    Some(sh) => sh,
                    None => {
                        report.skipped_nodes += 1;
                        i += 1;
                        continue;
                    }
                };
                if sh != shard_idx {
                    break;
                }
                let parent = n.parent[i];
                let parent_idx = if parent == NO_PARENT {
                    NONE
                } else {
                    shared.split_ref(node_ref_of[parent as usize]).1
                };
                let Some(idx) = self.find_or_create_in(&mut shard, n.content_hash[i], parent_idx)
                else {
                    self.count_shard_full(1);
                    report.skipped_nodes += 1;
                    i += 1;
                    continue;
                };
                let node_ref = shared.node_ref(shard_idx, idx);
                node_ref_of[i] = node_ref;
                let c_start = if i == 0 {
                    0
                } else {
                    n.carrier_end[i - 1] as usize
                };
                for c in c_start..n.carrier_end[i] as usize {
                    let rank = report.rank_map[n.carrier_rank[c] as usize];
                    self.restore_carrier(
                        rank,
                        node_ref,
                        n.carrier_tiers[c],
                        n.carrier_engine_hash[c],
                        &mut shard,
                        &mut delta,
                        &mut displaced,
                    );
                    report.carriers += 1;
                }
                report.nodes += 1;
                i += 1;
            }
        }
        self.flush_restore_delta(&mut delta);
        // Side maps, rank by rank: carriers bucketed by snapshot rank (counting sort) so each
        // rank's map is built while it is hot in cache.
        let ranks = s.ranks.len();
        let mut start = vec![0usize; ranks + 1];
        for &r in &n.carrier_rank {
            start[r as usize + 1] += 1;
        }
        for r in 0..ranks {
            start[r + 1] += start[r];
        }
        let mut fill = start.clone();
        let mut by_rank: Vec<(u64, u32)> = vec![(0, NONE); n.carrier_rank.len()];
        for (node, &node_ref) in node_ref_of.iter().enumerate() {
            if node_ref == NONE {
                continue;
            }
            let c_start = if node == 0 {
                0
            } else {
                n.carrier_end[node - 1] as usize
            };
            for c in c_start..n.carrier_end[node] as usize {
                let r = n.carrier_rank[c] as usize;
                by_rank[fill[r]] = (n.carrier_engine_hash[c], node_ref);
                fill[r] += 1;
            }
        }
        displaced.sort_unstable_by_key(|d| d.0);
        for r in 0..ranks {
            let local = report.rank_map[r];
            let lo = displaced.partition_point(|d| d.0 < local);
            let hi = displaced.partition_point(|d| d.0 <= local);
            let mine: Vec<(u64, u32)> = displaced[lo..hi].iter().map(|d| (d.1, d.2)).collect();
            self.restore_side_entries(
                local,
                &mine,
                &by_rank[start[r]..fill[r]],
                EntryKeys::Unchecked,
                None,
            );
        }
        for c in &s.cursors {
            let local = report.rank_map[c.rank as usize];
            report.cursors.push(RankCursor {
                rank: local.0,
                seq: c.seq,
                ts: c.ts,
            });
            if self.cursor_of(local).is_none() {
                self.set_cursor(local, Some((c.seq, c.ts)));
                report.cursors_set.push(local);
            }
        }
        report.evicted_carriers = self.enforce_cap();
        Ok(report)
    }

    fn restore_shard_of(&self, s: &IndexSnapshot, i: usize, node_ref_of: &[u32]) -> Option<usize> {
        let parent = s.nodes.parent[i];
        if parent == NO_PARENT {
            Some(self.shared.shard_of_root(s.nodes.content_hash[i]))
        } else {
            let r = node_ref_of[parent as usize];
            (r != NONE).then(|| self.shared.split_ref(r).0)
        }
    }
}

/// Keeps only the ranks for which `keep` is true: drops other ranks' carriers, cursors and
/// empty-rank entries, drops nodes left with no carrier and no kept descendant (interior nodes on
/// a kept path stay), and renumbers ranks and parents. The snapshot's structure is validated
/// first; on error it is left untouched.
pub fn retain_ranks(
    s: &mut IndexSnapshot,
    keep: impl Fn(&kvroute_wire::snapshot::RankRef) -> bool,
) -> Result<(), RestoreError> {
    validate_structure(s)?;
    retain_ranks_validated(s, |_, r| keep(r));
    Ok(())
}

/// [`retain_ranks`] on a snapshot whose structure is already validated; `keep` gets each rank's
/// index and ref.
pub(crate) fn retain_ranks_validated(
    s: &mut IndexSnapshot,
    mut keep: impl FnMut(usize, &kvroute_wire::snapshot::RankRef) -> bool,
) {
    let mut rank_map = vec![NONE; s.ranks.len()];
    let mut ranks = Vec::new();
    for (i, r) in s.ranks.iter().enumerate() {
        if keep(i, r) {
            rank_map[i] = ranks.len() as u32;
            ranks.push(r.clone());
        }
    }
    let n = &s.nodes;
    let len = n.len();
    let mut keep_node: Vec<bool> = (0..len)
        .map(|i| {
            let c_start = if i == 0 {
                0
            } else {
                n.carrier_end[i - 1] as usize
            };
            n.carrier_rank[c_start..n.carrier_end[i] as usize]
                .iter()
                .any(|&r| rank_map[r as usize] != NONE)
        })
        .collect();
    // Children follow parents, so one backward pass marks every ancestor of a kept node.
    for i in (0..len).rev() {
        if keep_node[i] && n.parent[i] != NO_PARENT {
            keep_node[n.parent[i] as usize] = true;
        }
    }
    // Every rank kept and every node kept: the rebuild below would copy the snapshot unchanged.
    // That is the common case (a sibling serving the same engines), and the copy of a
    // 100-million-carrier snapshot is seconds of a booting replica's time to warm.
    if ranks.len() == s.ranks.len() && keep_node.iter().all(|&k| k) {
        return;
    }
    let mut new_idx = vec![NONE; len];
    let mut out = SnapshotNodes::default();
    for i in 0..len {
        if !keep_node[i] {
            continue;
        }
        new_idx[i] = out.parent.len() as u32;
        out.parent.push(if n.parent[i] == NO_PARENT {
            NO_PARENT
        } else {
            new_idx[n.parent[i] as usize]
        });
        out.content_hash.push(n.content_hash[i]);
        let c_start = if i == 0 {
            0
        } else {
            n.carrier_end[i - 1] as usize
        };
        for c in c_start..n.carrier_end[i] as usize {
            let r = rank_map[n.carrier_rank[c] as usize];
            if r != NONE {
                out.carrier_rank.push(r);
                out.carrier_tiers.push(n.carrier_tiers[c]);
                out.carrier_engine_hash.push(n.carrier_engine_hash[c]);
            }
        }
        out.carrier_end.push(out.carrier_rank.len() as u32);
    }
    s.cursors = s
        .cursors
        .iter()
        .filter(|c| rank_map[c.rank as usize] != NONE)
        .map(|c| RankCursor {
            rank: rank_map[c.rank as usize],
            ..*c
        })
        .collect();
    s.empty_ranks = s
        .empty_ranks
        .iter()
        .filter(|&&r| rank_map[r as usize] != NONE)
        .map(|&r| rank_map[r as usize])
        .collect();
    s.partial_ranks = s
        .partial_ranks
        .iter()
        .filter(|&&r| rank_map[r as usize] != NONE)
        .map(|&r| rank_map[r as usize])
        .collect();
    s.ranks = ranks;
    s.nodes = out;
}

#[cfg(test)]
mod watermark_tests {
    use super::*;
    use crate::index::{CursorCell, IndexConfig, PrefixIndex};
    use kvroute_wire::snapshot::RankRef;

    fn cell(value: Option<(i64, f64)>, stream_epoch: u64) -> CursorCell {
        CursorCell {
            value,
            stream_epoch,
        }
    }

    #[test]
    fn an_unmoved_cursor_is_claimed_as_is() {
        let c = cell(Some((5, 1.5)), 3);
        assert_eq!(
            walk_watermark(c, c),
            WalkWatermark::Claim {
                seq: 5,
                ts: 1.5,
                advanced: false
            }
        );
    }

    #[test]
    fn a_cursor_that_advanced_in_its_stream_claims_the_pre_walk_value() {
        assert_eq!(
            walk_watermark(cell(Some((5, 1.5)), 3), cell(Some((90, 9.0)), 3)),
            WalkWatermark::Claim {
                seq: 5,
                ts: 1.5,
                advanced: true
            }
        );
    }

    #[test]
    fn a_new_stream_during_the_walk_withholds_the_cursor_even_when_it_climbed_past() {
        assert_eq!(
            walk_watermark(cell(Some((5, 1.5)), 3), cell(Some((900, 9.0)), 5)),
            WalkWatermark::Withheld
        );
        assert_eq!(
            walk_watermark(cell(Some((5, 1.5)), 3), cell(None, 4)),
            WalkWatermark::Withheld
        );
        assert_eq!(
            walk_watermark(cell(None, 3), cell(Some((1, 1.0)), 4)),
            WalkWatermark::Withheld
        );
        assert_eq!(
            walk_watermark(cell(None, 3), cell(None, 3)),
            WalkWatermark::NoStream
        );
    }

    #[test]
    fn set_cursor_starts_a_new_stream_epoch_on_anything_but_a_forward_step() {
        let (mut w, r) = PrefixIndex::new(IndexConfig {
            block_size: 4,
            shard_count: 1,
            max_carried_blocks: 1_000,
        });
        let id = w.add_rank(RankRef {
            worker_url: "http://e".into(),
            dp_rank: 0,
        });
        let epoch = || {
            r.shared.ranks.read()[id.0 as usize]
                .as_ref()
                .unwrap()
                .cursor_cell()
                .stream_epoch
        };
        let start = epoch();
        w.set_cursor(id, Some((1, 1.0)));
        assert_eq!(epoch(), start + 1, "None -> Some begins a stream");
        w.set_cursor(id, Some((2, 2.0)));
        w.set_cursor(id, Some((2, 2.5)));
        assert_eq!(epoch(), start + 1, "forward steps keep the stream");
        w.set_cursor(id, Some((0, 3.0)));
        assert_eq!(epoch(), start + 2, "a lower seq is another stream");
        w.set_cursor(id, None);
        assert_eq!(epoch(), start + 3, "a cleared cursor ends the stream");
    }
}
