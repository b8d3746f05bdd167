//! Snapshot export shape and restore validation: each malformed case is rejected with the error
//! naming its rule, and a rejected restore leaves the index untouched.

mod common;

use common::*;
use kvroute_index::hash::HASH_SCHEME;
use kvroute_index::{
    IndexConfig, IndexWriter, PrefixIndex, PrefixMatch, RestoreError, retain_ranks,
};
use kvroute_wire::event::Medium;
use kvroute_wire::snapshot::{IndexSnapshot, NO_PARENT, RankCursor, SNAPSHOT_FORMAT};

const BS: u32 = 4;

fn cfg() -> IndexConfig {
    IndexConfig {
        block_size: BS,
        shard_count: 4,
        max_carried_blocks: 1_000_000,
    }
}

/// Two ranks sharing a 2-block prefix; rank 0 extends it by 2 blocks, rank 1 by 1 on host.
fn sample() -> IndexSnapshot {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let b = w.add_rank(rank_ref(1));
    w.add_rank(rank_ref(2));
    let sys = tokens(1, 2, BS);
    let mut ta = sys.clone();
    ta.extend(tokens(2, 2, BS));
    let mut tb = sys.clone();
    tb.extend(tokens(3, 1, BS));
    w.apply_batch(
        a,
        10,
        &batch(vec![stored(&[1, 2, 3, 4], None, ta, BS, None)]),
    );
    w.apply_batch(b, 20, &batch(vec![stored(&[1, 2], None, sys, BS, None)]));
    w.apply_batch(
        b,
        21,
        &batch(vec![stored(
            &[5],
            Some(2),
            tb[8..].to_vec(),
            BS,
            Some(Medium::Host),
        )]),
    );
    r.export_snapshot()
}

/// Columns sized by `export_column_room` keep their memory through the walk even when live
/// batches grew the index between sizing and walking (a caller may have made that memory
/// resident), and columns too small are replaced with the headroom, never grown by copying.
#[test]
fn an_export_fills_the_columns_it_was_given_when_the_index_grew_a_little_meanwhile() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let store = |w: &mut IndexWriter, seq: i64, first: u64, blocks: usize| {
        let engines: Vec<u64> = (first..first + blocks as u64).collect();
        let toks = tokens(first as u32, blocks, BS);
        w.apply_batch(a, seq, &batch(vec![stored(&engines, None, toks, BS, None)]));
    };
    store(&mut w, 1, 1_000, 64);
    let (nodes, carriers) = r.export_column_room();
    let (now_nodes, now_carriers) = r.export_column_hints();
    assert!(
        nodes > now_nodes && carriers > now_carriers,
        "room has headroom"
    );
    let columns = kvroute_wire::snapshot::SnapshotNodes::with_capacity(nodes, carriers);
    let given = (
        columns.parent.as_ptr(),
        columns.carrier_engine_hash.as_ptr(),
    );
    // The live stream adds blocks after the columns were sized.
    store(&mut w, 2, 5_000, 16);
    let (snap, _) = r.export_snapshot_into(columns);
    assert_eq!(snap.nodes.len(), 80);
    assert_eq!(
        (
            snap.nodes.parent.as_ptr(),
            snap.nodes.carrier_engine_hash.as_ptr()
        ),
        given,
        "the walk filled the caller's columns"
    );
    // Columns with no room at all are replaced once, with the headroom.
    let (snap, _) = r.export_snapshot_into(kvroute_wire::snapshot::SnapshotNodes::default());
    assert_eq!(snap.nodes.len(), 80);
    assert!(snap.nodes.parent.capacity() >= r.export_column_room().0);
}

#[test]
fn export_lists_parents_before_children_with_engine_hashes_and_cursors() {
    let s = sample();
    assert_eq!(s.format, SNAPSHOT_FORMAT);
    assert_eq!(s.hash_scheme, HASH_SCHEME);
    assert_eq!(s.block_size, BS);
    assert!(!s.producer_ready);
    assert_eq!(s.ranks, vec![rank_ref(0), rank_ref(1), rank_ref(2)]);
    assert_eq!(s.empty_ranks, vec![2]);
    assert_eq!(s.nodes.len(), 5);
    assert_eq!(s.nodes.carried_blocks(), 7);
    for (i, &p) in s.nodes.parent.iter().enumerate() {
        assert!(p == NO_PARENT || (p as usize) < i, "node {i} parent {p}");
    }
    let mut engines: Vec<(u32, u64, u8)> = s
        .nodes
        .carrier_rank
        .iter()
        .zip(&s.nodes.carrier_engine_hash)
        .zip(&s.nodes.carrier_tiers)
        .map(|((&r, &e), &t)| (r, e, t))
        .collect();
    engines.sort_unstable();
    assert_eq!(
        engines,
        vec![
            (0, 1, 1),
            (0, 2, 1),
            (0, 3, 1),
            (0, 4, 1),
            (1, 1, 1),
            (1, 2, 1),
            (1, 5, 2)
        ]
    );
    let mut cursors: Vec<(u32, i64)> = s.cursors.iter().map(|c| (c.rank, c.seq)).collect();
    cursors.sort_unstable();
    assert_eq!(cursors, vec![(0, 10), (1, 21)]);
}

fn fresh_with_one_block() -> (IndexWriter, kvroute_index::IndexReader) {
    let (mut w, r) = PrefixIndex::new(cfg());
    let z = w.add_rank(rank_ref(9));
    w.apply_event(z, &stored(&[77], None, tokens(50, 1, BS), BS, None));
    (w, r)
}

fn rejects(mutate: impl FnOnce(&mut IndexSnapshot), want: RestoreError) {
    let mut s = sample();
    mutate(&mut s);
    let (mut w, r) = fresh_with_one_block();
    let before = (r.total_carried(), r.node_count(), r.ranks().len());
    assert_eq!(w.restore_snapshot(&s), Err(want));
    assert_eq!(
        (r.total_carried(), r.node_count(), r.ranks().len()),
        before,
        "a rejected restore must not touch the index"
    );
}

#[test]
fn restore_rejects_another_format() {
    rejects(
        |s| s.format = 99,
        RestoreError::Format {
            found: 99,
            expected: SNAPSHOT_FORMAT,
        },
    );
}

#[test]
fn restore_rejects_another_hash_scheme() {
    rejects(
        |s| s.hash_scheme = "other".into(),
        RestoreError::HashScheme {
            found: "other".into(),
            expected: HASH_SCHEME.into(),
        },
    );
}

#[test]
fn restore_rejects_another_block_size() {
    rejects(
        |s| s.block_size = 16,
        RestoreError::BlockSize {
            found: 16,
            expected: BS,
        },
    );
}

#[test]
fn restore_rejects_a_short_node_column() {
    rejects(
        |s| {
            s.nodes.content_hash.pop();
        },
        RestoreError::ColumnLength {
            column: "content_hash",
            len: 4,
            expected: 5,
        },
    );
}

#[test]
fn restore_rejects_a_short_carrier_column() {
    rejects(
        |s| {
            s.nodes.carrier_engine_hash.pop();
        },
        RestoreError::ColumnLength {
            column: "carrier_engine_hash",
            len: 6,
            expected: 7,
        },
    );
}

#[test]
fn restore_rejects_a_decreasing_carrier_end() {
    rejects(
        |s| {
            s.nodes.carrier_end[1] = s.nodes.carrier_end[0].wrapping_sub(1);
            s.nodes.carrier_end[0] = s.nodes.carrier_end[1] + 1;
        },
        RestoreError::CarrierEndNotMonotone { node: 1 },
    );
}

#[test]
fn restore_rejects_a_carrier_end_not_ending_at_the_carrier_count() {
    rejects(
        |s| *s.nodes.carrier_end.last_mut().unwrap() = 6,
        RestoreError::CarrierEndMismatch {
            last: 6,
            carriers: 7,
        },
    );
}

#[test]
fn restore_rejects_a_parent_that_does_not_precede_its_child() {
    rejects(
        |s| s.nodes.parent[2] = 3,
        RestoreError::ParentNotBefore { node: 2, parent: 3 },
    );
}

#[test]
fn restore_rejects_a_self_parent() {
    rejects(
        |s| s.nodes.parent[1] = 1,
        RestoreError::ParentNotBefore { node: 1, parent: 1 },
    );
}

#[test]
fn restore_rejects_a_carrier_rank_out_of_range() {
    rejects(
        |s| s.nodes.carrier_rank[3] = 3,
        RestoreError::CarrierRankOutOfRange {
            carrier: 3,
            rank: 3,
            ranks: 3,
        },
    );
}

#[test]
fn restore_rejects_a_duplicate_rank() {
    rejects(
        |s| s.ranks[2] = rank_ref(0),
        RestoreError::DuplicateRank { index: 2, first: 0 },
    );
}

#[test]
fn restore_rejects_a_cursor_rank_out_of_range() {
    rejects(
        |s| {
            s.cursors.push(RankCursor {
                rank: 5,
                seq: 1,
                ts: 0.0,
            })
        },
        RestoreError::CursorRankOutOfRange {
            cursor: 2,
            rank: 5,
            ranks: 3,
        },
    );
}

#[test]
fn restore_rejects_a_second_cursor_for_a_rank() {
    rejects(
        |s| {
            let c = s.cursors[0];
            s.cursors.push(c);
        },
        RestoreError::DuplicateCursor {
            cursor: 2,
            rank: sample().cursors[0].rank,
        },
    );
}

#[test]
fn restore_rejects_an_empty_rank_out_of_range() {
    rejects(
        |s| s.empty_ranks.push(7),
        RestoreError::EmptyRankOutOfRange {
            index: 1,
            rank: 7,
            ranks: 3,
        },
    );
}

#[test]
fn restore_rejects_a_partial_rank_out_of_range() {
    rejects(
        |s| s.partial_ranks = vec![0, 9],
        RestoreError::PartialRankOutOfRange {
            index: 1,
            rank: 9,
            ranks: 3,
        },
    );
}

#[test]
fn restore_rejects_a_carrier_with_no_tier() {
    rejects(
        |s| s.nodes.carrier_tiers[4] = 0,
        RestoreError::ZeroTiers { carrier: 4 },
    );
}

#[test]
fn restore_rejects_unknown_tier_bits() {
    rejects(
        |s| s.nodes.carrier_tiers[5] = 0x11,
        RestoreError::UnknownTierBits {
            carrier: 5,
            tiers: 0x11,
        },
    );
}

#[test]
fn restore_unions_into_existing_nodes_and_sets_only_missing_cursors() {
    let s = sample();
    let (mut w, r) = PrefixIndex::new(cfg());
    // The local index already knows rank 1 with a cursor and one shared block.
    let b = w.add_rank(rank_ref(1));
    w.apply_batch(
        b,
        99,
        &batch(vec![stored(
            &[1],
            None,
            tokens(1, 1, BS),
            BS,
            Some(Medium::Disk),
        )]),
    );
    let rep = w.restore_snapshot(&s).expect("valid");
    assert_eq!(rep.rank_map[1], b);
    assert_eq!(rep.cursors.len(), 2);
    assert_eq!(rep.cursors_set, vec![rep.rank_map[0]]);
    assert_eq!(
        r.rank_stats(b).unwrap().cursor.unwrap().seq,
        99,
        "an existing cursor is kept"
    );
    assert_eq!(
        r.rank_stats(rep.rank_map[0]).unwrap().cursor.unwrap().seq,
        10
    );
    assert_eq!(
        r.node_count(),
        5,
        "nodes are merged by content hash, not duplicated"
    );
    assert_eq!(r.rank_stats(b).unwrap().tier_blocks, [2, 1, 1, 0]);
    // Side maps were rebuilt: the restored rank can extend and remove by engine hash.
    w.apply_event(rep.rank_map[0], &removed(&[4, 3], None));
    let mut m = PrefixMatch::new();
    let mut ta = tokens(1, 2, BS);
    ta.extend(tokens(2, 2, BS));
    r.match_prefix(&hashes_of(&ta, BS), &mut m);
    assert_eq!(m.get(rep.rank_map[0]).map(|x| x.matched_blocks), Some(2));
}

#[test]
fn retain_ranks_keeps_interior_nodes_on_a_kept_path_and_renumbers() {
    let mut s = sample();
    // Keep only rank 1, whose chain is blocks 1,2 then 5 on host.
    retain_ranks(&mut s, |r| *r == rank_ref(1)).expect("valid");
    assert_eq!(s.ranks, vec![rank_ref(1)]);
    assert_eq!(s.nodes.len(), 3);
    assert_eq!(s.nodes.carrier_rank, vec![0, 0, 0]);
    assert_eq!(
        s.cursors
            .iter()
            .map(|c| (c.rank, c.seq))
            .collect::<Vec<_>>(),
        vec![(0, 21)]
    );
    assert!(s.empty_ranks.is_empty());
    for (i, &p) in s.nodes.parent.iter().enumerate() {
        assert!(p == NO_PARENT || (p as usize) < i);
    }
    let mut bad = sample();
    bad.nodes.parent[0] = 0;
    assert_eq!(
        retain_ranks(&mut bad, |_| true),
        Err(RestoreError::ParentNotBefore { node: 0, parent: 0 })
    );
}

#[test]
fn retain_ranks_keeping_every_rank_changes_nothing_but_still_prunes_a_carrierless_leaf() {
    let whole = sample();
    let mut kept = whole.clone();
    retain_ranks(&mut kept, |_| true).expect("valid");
    assert_eq!(
        kept, whole,
        "nothing to drop: the snapshot is left as it was"
    );

    // A node with no carrier and no descendant (a producer's leftover) is dropped even when
    // every rank is kept.
    let mut leftover = sample();
    leftover.nodes.parent.push(NO_PARENT);
    leftover.nodes.content_hash.push(0xdead);
    let carriers = *leftover.nodes.carrier_end.last().expect("sample has nodes");
    leftover.nodes.carrier_end.push(carriers);
    retain_ranks(&mut leftover, |_| true).expect("valid");
    assert_eq!(leftover, whole, "the carrierless leaf is pruned");
}

#[test]
fn each_export_carries_the_cursor_of_the_nodes_it_shows() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    w.apply_batch(
        a,
        1,
        &batch(vec![stored(&[1], None, tokens(60, 1, BS), BS, None)]),
    );
    let s1 = r.export_snapshot();
    w.apply_batch(
        a,
        2,
        &batch(vec![stored(&[2], Some(1), tokens(61, 1, BS), BS, None)]),
    );
    let s2 = r.export_snapshot();
    assert_eq!((s1.cursors[0].seq, s1.nodes.carried_blocks()), (1, 1));
    assert_eq!((s2.cursors[0].seq, s2.nodes.carried_blocks()), (2, 2));
}

#[test]
fn a_cursor_never_claims_more_blocks_than_the_export_shows_while_the_writer_runs() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    let (mut w, r) = PrefixIndex::new(IndexConfig {
        shard_count: 2,
        ..cfg()
    });
    // Ballast so a walk spans many read-lock chunks and the writer can run between them.
    let ballast = w.add_rank(rank_ref(1));
    for i in 0..2_000u32 {
        let hs: Vec<u64> = (0..16).map(|k| 1_000_000 + u64::from(i) * 16 + k).collect();
        w.apply_event(
            ballast,
            &stored(&hs, None, tokens(10_000 + i, 16, BS), BS, None),
        );
    }
    let a = w.add_rank(rank_ref(0));
    let stop = Arc::new(AtomicBool::new(false));
    let exporter = {
        let (r, stop) = (r.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut with_cursor, mut exports) = (0u32, 0u32);
            let mut violations = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let s = r.export_snapshot();
                exports += 1;
                let Some(pos) = s.ranks.iter().position(|x| *x == rank_ref(0)) else {
                    continue;
                };
                let shown = s
                    .nodes
                    .carrier_rank
                    .iter()
                    .filter(|&&x| x as usize == pos)
                    .count() as i64;
                if let Some(c) = s.cursors.iter().find(|c| c.rank as usize == pos) {
                    with_cursor += 1;
                    // Batch `seq` stores exactly one block, so cursor seq = blocks it covers.
                    if c.seq > shown {
                        violations.push((c.seq, shown));
                    }
                }
            }
            (exports, with_cursor, violations)
        })
    };
    // Rank a: batch seq k stores block k, chained on block k - 1.
    let chain = tokens(70, 1, BS);
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut seq = 0i64;
    let mut parent = None;
    while Instant::now() < deadline && seq < 200_000 {
        seq += 1;
        let engine = seq as u64;
        let mut t = chain.clone();
        t[0] = seq as u32;
        w.apply_batch(a, seq, &batch(vec![stored(&[engine], parent, t, BS, None)]));
        parent = Some(engine);
    }
    stop.store(true, Ordering::Relaxed);
    let (exports, with_cursor, violations) = exporter.join().expect("exporter thread");
    assert!(exports > 0, "no export completed while the writer ran");
    assert!(
        violations.is_empty(),
        "cursor claimed more than the nodes showed: {violations:?} (of {with_cursor} exports with a cursor)"
    );
}

/// Nodes store no depth, so export derives parent-before-child order from parent links; slab
/// slot reuse can put a child in a LOWER slot than its parent, which a slot-order export would
/// get wrong.
#[test]
fn export_orders_a_child_in_a_reused_lower_slot_after_its_parent() {
    let one_shard = IndexConfig {
        shard_count: 1,
        ..cfg()
    };
    let (mut w, r) = PrefixIndex::new(one_shard);
    let a = w.add_rank(rank_ref(0));
    // Chain x (3 blocks) takes slots 0..3, chain y's root slot 3.
    w.apply_event(a, &stored(&[1, 2, 3], None, tokens(10, 3, BS), BS, None));
    w.apply_event(a, &stored(&[20], None, tokens(20, 1, BS), BS, None));
    // Freeing chain x leaves slot 0 on top of the free list, so y's child lands below y's root.
    w.apply_event(a, &removed(&[3, 2, 1], None));
    w.apply_event(a, &stored(&[21, 22], Some(20), tokens(21, 2, BS), BS, None));
    let s = r.export_snapshot();
    assert_eq!(s.nodes.len(), 3, "exported nodes {:?}", s.nodes.parent);
    assert_eq!(
        s.nodes.parent,
        vec![NO_PARENT, 0, 1],
        "parents precede children"
    );
    let (mut w2, r2) = PrefixIndex::new(cfg());
    w2.restore_snapshot(&s).expect("valid");
    let mut y = tokens(20, 1, BS);
    y.extend(tokens(21, 2, BS));
    let mut m = PrefixMatch::new();
    r2.match_prefix(&hashes_of(&y, BS), &mut m);
    assert_eq!(m.max_matched_blocks(), 3, "restored matches {:?}", m.ranks);
}

/// Export is depth-first: a chain comes out as consecutive nodes (so a restored slab keeps it
/// in order, which the routing walk follows), branches after the chain they leave.
#[test]
fn export_emits_a_chain_as_consecutive_nodes_before_a_branch_off_it() {
    let one_shard = IndexConfig {
        shard_count: 1,
        ..cfg()
    };
    let (mut w, r) = PrefixIndex::new(one_shard);
    let a = w.add_rank(rank_ref(0));
    let t = tokens(30, 3, BS);
    w.apply_event(a, &stored(&[1, 2, 3], None, t.clone(), BS, None));
    // A branch off block 0, created after the chain.
    w.apply_event(a, &stored(&[4], Some(1), tokens(31, 1, BS), BS, None));
    let s = r.export_snapshot();
    assert_eq!(
        s.nodes.parent,
        vec![NO_PARENT, 0, 1, 0],
        "chain 0-1-2, then the branch under node 0"
    );
    assert_eq!(s.nodes.content_hash[..3], hashes_of(&t, BS)[..]);
}

/// A snapshot naming the same (rank, node) twice with different engine hashes: the carrier
/// keeps the last hash, and only that hash removes it (the side map never files a node under a
/// hash its carrier does not hold).
#[test]
fn restore_of_a_node_carried_twice_by_one_rank_keeps_the_last_engine_hash() {
    let mut s = sample();
    // Append a second copy of root node 0, carried by rank 0 under engine hash 77.
    let n = &mut s.nodes;
    n.parent.push(NO_PARENT);
    n.content_hash.push(n.content_hash[0]);
    n.carrier_rank.push(0);
    n.carrier_tiers.push(1);
    n.carrier_engine_hash.push(77);
    n.carrier_end.push(n.carrier_rank.len() as u32);
    let (mut w, r) = PrefixIndex::new(cfg());
    let rep = w.restore_snapshot(&s).expect("valid");
    let a = rep.rank_map[0];
    let carried = r.rank_stats(a).unwrap().carried_blocks;
    assert_eq!(carried, 4, "the duplicate merges into one carrier");
    let unknown_before = r.counters().removed_unknown_blocks;
    w.apply_event(a, &removed(&[1], None));
    assert_eq!(
        r.rank_stats(a).unwrap().carried_blocks,
        4,
        "hash 1 was replaced"
    );
    assert_eq!(r.counters().removed_unknown_blocks, unknown_before + 1);
    w.apply_event(a, &removed(&[77], None));
    assert_eq!(
        r.rank_stats(a).unwrap().carried_blocks,
        3,
        "hash 77 removes it"
    );
}
