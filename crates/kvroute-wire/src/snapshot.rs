//! The index snapshot data model: a self-contained, versioned picture of a whole prefix index.
//!
//! It is columnar (struct of arrays, carriers in CSR form) rather than a `Vec` of node structs
//! because every consumer wants it that way: export and restore touch each column in one linear
//! pass with no per-node allocation (the index crate targets >= 10 M carried blocks/s each way),
//! and the compact binary encoding of `/internal/kv_snapshot` delta-codes and compresses columns
//! far better than interleaved records.
//!
//! Invariants a *valid* snapshot upholds (checked by `kvroute-index` on restore, never assumed):
//! * `parent[i]` is [`NO_PARENT`] or `< i`: parents precede children, so one forward pass rebuilds;
//! * every column of `nodes` has the same length; `carrier_end` is non-decreasing and its last
//!   value equals the carrier columns' length;
//! * every carrier's and cursor's rank index is `< ranks.len()`; no rank appears twice in
//!   `ranks`, and no rank has two cursors.

use serde::{Deserialize, Serialize};

/// Bumped on any incompatible change of meaning; a consumer refuses other values.
pub const SNAPSHOT_FORMAT: u32 = 1;

/// Marks a root node in [`SnapshotNodes::parent`].
pub const NO_PARENT: u32 = u32::MAX;

/// One rank of the producer's rank table. Carriers and cursors refer to ranks by their position
/// in [`IndexSnapshot::ranks`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankRef {
    pub worker_url: String,
    pub dp_rank: u32,
}

/// The last batch the producer applied for a rank: its sequence number and the `ts` carried in
/// that batch's payload (which lets a consumer check, against the engine's replay socket, that the
/// cursor speaks of the same publisher incarnation).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RankCursor {
    pub rank: u32,
    pub seq: i64,
    pub ts: f64,
}

/// Nodes as parallel columns. Node `i`'s carriers are
/// `carrier_*[carrier_end[i-1]..carrier_end[i]]` (with `carrier_end[-1] == 0`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotNodes {
    pub parent: Vec<u32>,
    /// The router's own chained content hash of the block (see `kvroute-index`'s hasher).
    pub content_hash: Vec<u64>,
    pub carrier_end: Vec<u32>,
    pub carrier_rank: Vec<u32>,
    /// Tier bitmask per carrier (device 1, host 2, disk 4, external 8).
    pub carrier_tiers: Vec<u8>,
    /// The carrier's engine block hash, so a consumer can apply that rank's later `BlockRemoved`.
    pub carrier_engine_hash: Vec<u64>,
}

impl SnapshotNodes {
    /// Empty columns with room for `nodes` nodes and `carriers` carriers.
    pub fn with_capacity(nodes: usize, carriers: usize) -> Self {
        let mut columns = SnapshotNodes::default();
        columns.clear_with_room(nodes, carriers);
        columns
    }

    /// Empties every column and makes sure each has room for `nodes` nodes and `carriers`
    /// carriers. A column already that large keeps its allocation (memory a caller may have
    /// made resident for it); a smaller one is replaced by a new one of exactly that room, never
    /// grown in place: growing copies the old allocation whole (the allocator does not know the
    /// column is empty), and `reserve` would double it.
    pub fn clear_with_room(&mut self, nodes: usize, carriers: usize) {
        fn room_for<T>(column: &mut Vec<T>, len: usize) {
            column.clear();
            if column.capacity() < len {
                *column = Vec::with_capacity(len);
            }
        }
        room_for(&mut self.parent, nodes);
        room_for(&mut self.content_hash, nodes);
        room_for(&mut self.carrier_end, nodes);
        room_for(&mut self.carrier_rank, carriers);
        room_for(&mut self.carrier_tiers, carriers);
        room_for(&mut self.carrier_engine_hash, carriers);
    }

    /// True when every column has room for `nodes` nodes and `carriers` carriers.
    pub fn has_room(&self, nodes: usize, carriers: usize) -> bool {
        self.parent.capacity() >= nodes
            && self.content_hash.capacity() >= nodes
            && self.carrier_end.capacity() >= nodes
            && self.carrier_rank.capacity() >= carriers
            && self.carrier_tiers.capacity() >= carriers
            && self.carrier_engine_hash.capacity() >= carriers
    }

    pub fn len(&self) -> usize {
        self.parent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parent.is_empty()
    }

    pub fn carried_blocks(&self) -> usize {
        self.carrier_rank.len()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexSnapshot {
    pub format: u32,
    /// Identifies the content-hash function and its parameters; a consumer built with another one
    /// must refuse the snapshot rather than graft hashes it would never reproduce.
    pub hash_scheme: String,
    pub block_size: u32,
    /// The producer considers its own index trustworthy (set by the service, not the index).
    pub producer_ready: bool,
    pub ranks: Vec<RankRef>,
    pub cursors: Vec<RankCursor>,
    /// Ranks that carry nothing AND whose whole stream since its publisher's seq 0 the producer
    /// has applied (so the engine holds nothing for them), by rank index. A rank the producer
    /// joined mid-stream, or lost batches of, is never listed, even when it carries nothing.
    pub empty_ranks: Vec<u32>,
    /// Ranks with a cursor whose history the producer does NOT hold since its publisher's seq 0,
    /// by rank index: it joined the stream mid-way, lost batches, or itself grafted such a
    /// partial view. Their carriers are what the producer has seen, not all the engine holds, so
    /// a consumer that grafts them sees what its sibling sees and must not call that `warm`.
    /// Absent (empty) in snapshots of producers that predate the field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial_ranks: Vec<u32>,
    pub nodes: SnapshotNodes,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clearing_keeps_a_large_enough_column_and_replaces_a_short_one_with_exact_room() {
        let mut columns = SnapshotNodes::with_capacity(100, 300);
        columns.parent.extend([NO_PARENT, 0]);
        columns.carrier_rank.push(7);
        let kept = columns.parent.as_ptr();
        columns.clear_with_room(100, 1_000);
        assert!(columns.is_empty() && columns.carrier_rank.is_empty());
        assert_eq!(columns.parent.as_ptr(), kept, "large enough: kept");
        assert_eq!(
            columns.carrier_rank.capacity(),
            1_000,
            "short: exact room, not doubled"
        );
        assert!(columns.has_room(100, 1_000));
        assert!(!columns.has_room(101, 1_000));
    }
}
