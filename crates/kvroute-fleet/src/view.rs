//! Canonical views of "which rank holds which block": the same shape whether read from a
//! router's index (its `/internal/kv_snapshot` JSON, decoded by the project's own decoder) or
//! from an engine's true cache (`kvroute-sim`'s `GET /control/cache`), so two replicas, or a
//! replica and the engines, compare with `==`.
//!
//! A block is identified by the router's content hash (the sim keys its cache by the very same
//! chained hash), with its parent's content hash, the engine's own block hash (what a later
//! `BlockRemoved` names) and its tiers: equal views mean equal prefix trees per rank, equal
//! removal keys and equal tiers. Sorted maps and sets make the comparison independent of the
//! order anything was listed in; ranks that hold nothing are left out on both sides, so "a rank
//! the index lists empty" and "a rank it does not list" compare equal, as they route equally.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use kvroute_wire::snapshot::{IndexSnapshot, NO_PARENT};
use serde_json::Value;

/// Tier bit of the device (the snapshot's and the index's encoding).
pub const TIER_DEVICE: u8 = 1;
/// Tier bit of the host.
pub const TIER_HOST: u8 = 2;
/// Blocks listed per rank when a diff is printed.
pub const DIFF_BLOCKS_SHOWN_MAX: usize = 5;

/// One block carried by one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Block {
    pub hash: u64,
    pub parent: Option<u64>,
    pub engine_hash: u64,
    pub tiers: u8,
}

/// `(worker_url, dp_rank)`.
pub type RankName = (String, u32);

/// Per rank, the set of blocks it carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexView {
    pub ranks: BTreeMap<RankName, BTreeSet<Block>>,
}

fn hex(v: &Value) -> Option<u64> {
    v.as_str().and_then(|s| u64::from_str_radix(s, 16).ok())
}

impl IndexView {
    /// The view of a decoded snapshot.
    pub fn from_snapshot(s: &IndexSnapshot) -> IndexView {
        let n = &s.nodes;
        let mut view = IndexView::default();
        let mut start = 0usize;
        for i in 0..n.len() {
            let end = n.carrier_end[i] as usize;
            let parent = match n.parent[i] {
                NO_PARENT => None,
                p => Some(n.content_hash[p as usize]),
            };
            for c in start..end {
                let r = &s.ranks[n.carrier_rank[c] as usize];
                view.ranks
                    .entry((r.worker_url.clone(), r.dp_rank))
                    .or_default()
                    .insert(Block {
                        hash: n.content_hash[i],
                        parent,
                        engine_hash: n.carrier_engine_hash[c],
                        tiers: n.carrier_tiers[c],
                    });
            }
            start = end;
        }
        view
    }

    /// Adds one engine rank's `/control/cache` blocks.
    pub fn add_truth_rank(&mut self, url: &str, dp_rank: u32, blocks: &[Value]) {
        let mut set = BTreeSet::new();
        for b in blocks {
            let tiers = if b["device"].as_bool() == Some(true) {
                TIER_DEVICE
            } else {
                0
            } | if b["host"].as_bool() == Some(true) {
                TIER_HOST
            } else {
                0
            };
            set.insert(Block {
                hash: hex(&b["hash"]).expect("hash"),
                parent: hex(&b["parent"]),
                engine_hash: hex(&b["engine_hash"]).expect("engine_hash"),
                tiers,
            });
        }
        if !set.is_empty() {
            self.ranks.insert((url.to_string(), dp_rank), set);
        }
    }

    pub fn merge(&mut self, other: IndexView) {
        self.ranks.extend(other.ranks);
    }

    pub fn restricted_to(&self, urls: &[String]) -> IndexView {
        IndexView {
            ranks: self
                .ranks
                .iter()
                .filter(|((u, _), _)| urls.contains(u))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }

    /// Blocks carried in total.
    pub fn carried(&self) -> usize {
        self.ranks.values().map(BTreeSet::len).sum()
    }

    /// A readable account of how `self` differs from `want` (empty when equal): per rank, how
    /// many blocks are missing and extra, with a few of each.
    pub fn diff(&self, want: &IndexView) -> String {
        let mut out = String::new();
        let names: BTreeSet<&RankName> = self.ranks.keys().chain(want.ranks.keys()).collect();
        let empty = BTreeSet::new();
        for name in names {
            let have = self.ranks.get(name).unwrap_or(&empty);
            let need = want.ranks.get(name).unwrap_or(&empty);
            if have == need {
                continue;
            }
            let missing: Vec<&Block> = need.difference(have).collect();
            let extra: Vec<&Block> = have.difference(need).collect();
            let _ = writeln!(
                out,
                "{} rank {}: holds {}, want {}; missing {} {:x?}; extra {} {:x?}",
                name.0,
                name.1,
                have.len(),
                need.len(),
                missing.len(),
                &missing[..missing.len().min(DIFF_BLOCKS_SHOWN_MAX)],
                extra.len(),
                &extra[..extra.len().min(DIFF_BLOCKS_SHOWN_MAX)],
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_wire::snapshot::{RankRef, SnapshotNodes};
    use serde_json::json;

    /// A router's snapshot and an engine's `/control/cache` listing the same two-block chain
    /// (in different orders) are the same view; one differing tier makes them differ, and the
    /// diff names the rank.
    #[test]
    fn a_snapshot_and_the_engine_truth_of_one_chain_compare_equal_whatever_the_order() {
        let snapshot = IndexSnapshot {
            format: 1,
            hash_scheme: "x".into(),
            block_size: 16,
            producer_ready: true,
            ranks: vec![RankRef {
                worker_url: "http://e".into(),
                dp_rank: 1,
            }],
            cursors: vec![],
            empty_ranks: vec![],
            partial_ranks: vec![],
            nodes: SnapshotNodes {
                parent: vec![NO_PARENT, 0],
                content_hash: vec![0xa, 0xb],
                carrier_end: vec![1, 2],
                carrier_rank: vec![0, 0],
                carrier_tiers: vec![TIER_DEVICE, TIER_DEVICE],
                carrier_engine_hash: vec![0x1a, 0x1b],
            },
        };
        let have = IndexView::from_snapshot(&snapshot);
        let mut truth = IndexView::default();
        let blocks = [
            json!({"hash": "000000000000000b", "parent": "000000000000000a",
                   "engine_hash": "000000000000001b", "device": true, "host": false}),
            json!({"hash": "000000000000000a", "parent": null,
                   "engine_hash": "000000000000001a", "device": true, "host": false}),
        ];
        truth.add_truth_rank("http://e", 1, &blocks);
        assert_eq!(have, truth);
        assert!(have.diff(&truth).is_empty());

        let mut host_only = IndexView::default();
        let mut moved = blocks.clone();
        moved[0]["device"] = json!(false);
        moved[0]["host"] = json!(true);
        host_only.add_truth_rank("http://e", 1, &moved);
        assert_ne!(have, host_only);
        assert!(have.diff(&host_only).contains("http://e rank 1"));
    }
}
