//! The sliced graft: it answers like a restore of the same snapshot, touches only the ranks it is
//! given, gives the same index whatever the slice size, survives the writer's other work between
//! slices (including evictions that prune what it placed), and can drop a rank mid-way without a
//! trace.

mod common;

use common::*;
use kvroute_index::{
    GraftError, GraftPlan, GraftProgress, GraftReport, IndexConfig, IndexReader, IndexWriter,
    PrefixIndex, PrefixMatch, RankId, RestoreError,
};
use kvroute_wire::event::Medium;
use kvroute_wire::snapshot::{IndexSnapshot, NO_PARENT, RankRef};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BS: u32 = 4;

fn cfg() -> IndexConfig {
    IndexConfig {
        block_size: BS,
        shard_count: 4,
        max_carried_blocks: 1_000_000,
    }
}

/// A source index of `ranks` ranks: conversations that share a few prompts across ranks, some
/// tails on host, a few removals; one batch per conversation so every rank has a cursor. Returns
/// the reader and every conversation's content hashes (the query set).
fn source(seed: u64, ranks: u32, convs: u32) -> (IndexReader, Vec<Vec<u64>>) {
    let (mut w, r) = PrefixIndex::new(cfg());
    let mut rng = StdRng::seed_from_u64(seed);
    let mut queries = Vec::new();
    for rank in 0..ranks {
        let id = w.add_rank(rank_ref(rank));
        for conv in 0..convs {
            let prompt = rng.random_range(0..4u32);
            let prompt_blocks = 1 + prompt as usize;
            let tail_blocks = rng.random_range(0..4usize);
            let mut toks = tokens(1000 + prompt, prompt_blocks, BS);
            toks.extend(tokens(5000 + rank * 100 + conv, tail_blocks, BS));
            let base = u64::from(rank + 1) << 40;
            let engines: Vec<u64> = (0..prompt_blocks as u64)
                .map(|i| base | u64::from(prompt) << 8 | i)
                .chain((0..tail_blocks as u64).map(|i| base | 1 << 32 | u64::from(conv) << 8 | i))
                .collect();
            let medium = rng.random_bool(0.2).then_some(Medium::Host);
            let mut events = vec![stored(&engines, None, toks.clone(), BS, medium)];
            if tail_blocks > 0 && rng.random_bool(0.15) {
                events.push(removed(&engines[engines.len() - 1..], None));
            }
            w.apply_batch(id, i64::from(conv), &batch(events));
            queries.push(hashes_of(&toks, BS));
        }
    }
    (r, queries)
}

/// One node: content hash, parent's content hash (0 for a root), carriers by rank ref.
type CanonNode = (u64, u64, Vec<(String, u32, u8, u64)>);
/// One cursor: rank ref, seq, ts bits.
type CanonCursor = (String, u32, i64, u64);
type Canon = (Vec<CanonNode>, Vec<CanonCursor>);

/// The index as an order-free value: nodes by content, carriers by rank ref, and cursors.
fn canonical(r: &IndexReader, only: Option<&RankRef>) -> Canon {
    let s = r.export_snapshot();
    canonical_snapshot(&s, only)
}

fn canonical_snapshot(s: &IndexSnapshot, only: Option<&RankRef>) -> Canon {
    let n = &s.nodes;
    let mut nodes = Vec::new();
    for i in 0..n.len() {
        let lo = if i == 0 {
            0
        } else {
            n.carrier_end[i - 1] as usize
        };
        let mut carriers: Vec<(String, u32, u8, u64)> = (lo..n.carrier_end[i] as usize)
            .map(|c| {
                let rr = &s.ranks[n.carrier_rank[c] as usize];
                (
                    rr.worker_url.clone(),
                    rr.dp_rank,
                    n.carrier_tiers[c],
                    n.carrier_engine_hash[c],
                )
            })
            .filter(|c| only.is_none_or(|o| o.worker_url == c.0 && o.dp_rank == c.1))
            .collect();
        carriers.sort_unstable();
        if only.is_some() && carriers.is_empty() {
            continue;
        }
        let parent = match n.parent[i] {
            NO_PARENT => 0,
            p => n.content_hash[p as usize],
        };
        nodes.push((n.content_hash[i], parent, carriers));
    }
    nodes.sort_unstable();
    let mut cursors: Vec<CanonCursor> = s
        .cursors
        .iter()
        .map(|c| {
            let rr = &s.ranks[c.rank as usize];
            (rr.worker_url.clone(), rr.dp_rank, c.seq, c.ts.to_bits())
        })
        .filter(|c| only.is_none_or(|o| o.worker_url == c.0 && o.dp_rank == c.1))
        .collect();
    cursors.sort_unstable();
    (nodes, cursors)
}

/// Per query: each matching rank's (ref, matched, device) in ref order.
fn answers(r: &IndexReader, queries: &[Vec<u64>]) -> Vec<Vec<(String, u32, u32, u32)>> {
    let names = r.ranks();
    let mut out = PrefixMatch::new();
    queries
        .iter()
        .map(|q| {
            r.match_prefix(q, &mut out);
            let mut v: Vec<(String, u32, u32, u32)> = out
                .ranks
                .iter()
                .filter(|m| m.matched_blocks > 0)
                .map(|m| {
                    let rr = &names.iter().find(|(id, _)| *id == m.rank).expect("known").1;
                    (
                        rr.worker_url.clone(),
                        rr.dp_rank,
                        m.matched_blocks,
                        m.device_blocks,
                    )
                })
                .collect();
            v.sort_unstable();
            v
        })
        .collect()
}

fn target(ranks: u32) -> (IndexWriter, IndexReader, Vec<RankId>) {
    let (mut w, r) = PrefixIndex::new(cfg());
    let ids = (0..ranks).map(|i| w.add_rank(rank_ref(i))).collect();
    (w, r, ids)
}

/// The engine hashes snapshot rank `rank` carries, in snapshot order.
fn engines_of_rank(snap: &IndexSnapshot, rank: usize) -> Vec<u64> {
    snap.nodes
        .carrier_rank
        .iter()
        .zip(&snap.nodes.carrier_engine_hash)
        .filter(|(r, _)| **r as usize == rank)
        .map(|(_, e)| *e)
        .collect()
}

fn plan_all(s: &IndexSnapshot) -> GraftPlan {
    GraftPlan::new(s.clone(), BS, |_| true).expect("valid snapshot")
}

/// Grafts `plan` for `ranks` in slices of `items_max`; returns the number of slices.
fn graft_in_slices(
    w: &mut IndexWriter,
    plan: GraftPlan,
    ranks: &[RankId],
    items_max: usize,
) -> usize {
    graft_reporting(w, plan, ranks, items_max).0
}

/// [`graft_in_slices`], also returning the job's report.
fn graft_reporting(
    w: &mut IndexWriter,
    plan: GraftPlan,
    ranks: &[RankId],
    items_max: usize,
) -> (usize, GraftReport) {
    let mut job = w.begin_graft(plan, ranks).expect("graft begins");
    let mut slices = 0;
    loop {
        slices += 1;
        if let GraftProgress::Done(report) = w.graft_step(&mut job, items_max).expect("own job") {
            return (slices, report);
        }
    }
}

#[test]
fn graft_answers_match_prefix_like_restore_for_the_same_snapshot() {
    let (src, queries) = source(1, 4, 12);
    let snap = src.export_snapshot();
    let (mut wr, rr, _) = target(4);
    wr.restore_snapshot(&snap).expect("restores");
    let (mut wg, rg, ids) = target(4);
    let slices = graft_in_slices(&mut wg, plan_all(&snap), &ids, 7);
    assert!(slices > 3, "small slices really slice ({slices})");
    assert_eq!(answers(&rg, &queries), answers(&rr, &queries));
    assert_eq!(answers(&rg, &queries), answers(&src, &queries));
    assert_eq!(canonical(&rg, None), canonical(&rr, None));
    for id in ids {
        assert_eq!(rg.rank_stats(id), rr.rank_stats(id));
    }
}

#[test]
fn graft_never_touches_a_carrier_of_a_rank_not_named() {
    // The target already serves ranks 0 and 1 (its own content); the snapshot carries ranks 0..3.
    // Laid out for the target, the plan brings prebuilt tables, which only a shard holding
    // nothing may take: a shard with live nodes must keep its table.
    for laid_out in [false, true] {
        graft_leaves_ranks_not_named_alone(laid_out);
    }
}

fn graft_leaves_ranks_not_named_alone(laid_out: bool) {
    let (src, queries) = source(2, 4, 10);
    let snap = src.export_snapshot();
    let (own, _) = source(3, 2, 8);
    let (mut w, r, ids) = target(4);
    w.restore_snapshot(&own.export_snapshot())
        .expect("restores");
    let live_before: Vec<_> = (0..2)
        .map(|i| {
            (
                canonical(&r, Some(&rank_ref(i))),
                r.rank_stats(ids[i as usize]),
            )
        })
        .collect();
    // The plan keeps every rank; the writer is told to graft only 2 and 3.
    let mut plan = plan_all(&snap);
    if laid_out {
        plan.lay_out_for(&r);
    }
    graft_in_slices(&mut w, plan, &ids[2..], 5);
    for i in 0..2u32 {
        assert_eq!(
            (
                canonical(&r, Some(&rank_ref(i))),
                r.rank_stats(ids[i as usize])
            ),
            live_before[i as usize],
            "rank {i} changed (plan laid out: {laid_out})"
        );
    }
    for i in 2..4u32 {
        assert_eq!(
            canonical(&r, Some(&rank_ref(i))),
            canonical(&src, Some(&rank_ref(i))),
            "rank {i} grafted whole"
        );
    }
    // Shared prompts share nodes: some query is matched by a live and a grafted rank at once.
    let is_live = |url: &str| url == rank_ref(0).worker_url || url == rank_ref(1).worker_url;
    assert!(
        answers(&r, &queries)
            .iter()
            .any(|a| { a.iter().any(|m| is_live(&m.0)) && a.iter().any(|m| !is_live(&m.0)) })
    );
}

#[test]
fn plan_keeps_only_the_accepted_ranks_with_a_cursor() {
    let (src, _) = source(4, 3, 5);
    let mut snap = src.export_snapshot();
    snap.cursors.retain(|c| c.rank != 2);
    let plan = GraftPlan::new(snap, BS, |r| r != &rank_ref(1)).expect("valid");
    assert_eq!(plan.ranks(), &[rank_ref(0)]);
    assert_eq!(plan.uncovered(), &[rank_ref(2)]);
    assert_eq!(plan.cursor(&rank_ref(0)).map(|c| c.seq), Some(4));
    assert!(plan.cursor(&rank_ref(1)).is_none());
    let carried: std::collections::HashSet<u32> =
        plan.snapshot().nodes.carrier_rank.iter().copied().collect();
    assert_eq!(carried, [0].into_iter().collect());
}

#[test]
fn a_held_removal_applied_after_the_graft_removes_the_grafted_block() {
    // The sibling's snapshot (cursor 5) still holds block X; the rank's held batch 6 removes it.
    let (mut src_w, src) = PrefixIndex::new(cfg());
    let a = src_w.add_rank(rank_ref(0));
    let toks = tokens(7, 2, BS);
    src_w.apply_batch(
        a,
        5,
        &batch(vec![stored(&[11, 12], None, toks.clone(), BS, None)]),
    );
    let snap = src.export_snapshot();
    let q = hashes_of(&toks, BS);

    let (mut w, r, ids) = target(1);
    graft_in_slices(&mut w, plan_all(&snap), &ids, 1);
    assert_eq!(
        answers(&r, std::slice::from_ref(&q))[0][0].2,
        2,
        "X (block 2) grafted"
    );
    assert_eq!(
        r.rank_stats(ids[0]).and_then(|s| s.cursor).map(|c| c.seq),
        Some(5)
    );
    w.apply_batch(ids[0], 6, &batch(vec![removed(&[12], None)]));
    assert_eq!(answers(&r, &[q])[0][0].2, 1, "X stays removed");
    assert_eq!(r.total_carried(), 1);
    assert_eq!(r.node_count(), 1, "the removed block's node is pruned");
}

#[test]
fn every_grafted_carrier_is_found_by_its_engine_hash() {
    // The side maps of pending ranks are filed in bulk without key comparisons; a removal by
    // engine hash must still find every carrier the graft placed, whatever the slice size and
    // whether the plan was laid out for the index.
    let (src, _) = source(9, 4, 16);
    let snap = src.export_snapshot();
    for (items_max, laid_out) in [(1, false), (7, false), (usize::MAX, false), (7, true)] {
        let (mut w, r, ids) = target(4);
        let mut plan = plan_all(&snap);
        if laid_out {
            plan.lay_out_for(&r);
        }
        graft_in_slices(&mut w, plan, &ids, items_max);
        assert!(r.total_carried() > 0, "the graft placed carriers");
        for (i, &id) in ids.iter().enumerate() {
            let engines = engines_of_rank(&snap, i);
            assert!(
                !engines.is_empty(),
                "rank {i} carries blocks in the snapshot"
            );
            w.apply_batch(id, 1_000, &batch(vec![removed(&engines, None)]));
            assert_eq!(
                r.rank_stats(id).map(|s| s.carried_blocks),
                Some(0),
                "slices of {items_max}: rank {i} keeps a carrier its engine removed"
            );
        }
        assert_eq!(r.total_carried(), 0);
        assert_eq!(r.node_count(), 0, "every node pruned with its last carrier");
    }
}

#[test]
fn a_node_listing_one_rank_twice_is_grafted_like_restore_grafts_it() {
    // A node shared by several ranks is normally given all its carriers at once; a snapshot may
    // still list one rank twice on a node (under two engine hashes, which the plan accepts), and
    // then the later carrier must win exactly as in a restore.
    let (src, queries) = source(3, 3, 10);
    let mut snap = src.export_snapshot();
    let n = &mut snap.nodes;
    let start = |n: &kvroute_wire::snapshot::SnapshotNodes, i: usize| {
        if i == 0 {
            0
        } else {
            n.carrier_end[i - 1] as usize
        }
    };
    let shared = (0..n.len())
        .find(|&i| n.carrier_end[i] as usize - start(n, i) >= 2)
        .expect("the source shares a prompt between ranks");
    let end = n.carrier_end[shared] as usize;
    let twice = n.carrier_rank[start(n, shared)];
    n.carrier_rank.insert(end, twice);
    n.carrier_tiers.insert(end, 1);
    n.carrier_engine_hash.insert(end, 0xD0B1_E000_0000_0001);
    for e in &mut n.carrier_end[shared..] {
        *e += 1;
    }
    let (mut wr, rr, _) = target(3);
    wr.restore_snapshot(&snap).expect("restores");
    let (mut wg, rg, ids) = target(3);
    graft_in_slices(&mut wg, plan_all(&snap), &ids, 5);
    assert_eq!(canonical(&rg, None), canonical(&rr, None));
    assert_eq!(answers(&rg, &queries), answers(&rr, &queries));
    for id in ids {
        assert_eq!(rg.rank_stats(id), rr.rank_stats(id));
    }
}

#[test]
fn cursors_are_set_only_when_the_graft_completes() {
    let (src, _) = source(5, 2, 6);
    let snap = src.export_snapshot();
    let (mut w, r, ids) = target(2);
    let mut job = w.begin_graft(plan_all(&snap), &ids).expect("begins");
    let first = w.graft_step(&mut job, 3).expect("steps");
    assert!(matches!(first, GraftProgress::More { .. }));
    assert!(r.total_carried() > 0, "a slice places carriers");
    assert!(
        ids.iter()
            .all(|&id| r.rank_stats(id).unwrap().cursor.is_none())
    );
    let report = w.graft_all(&mut job).expect("finishes");
    assert_eq!(report.cursors_set.len(), 2);
    for &id in &ids {
        assert_eq!(r.rank_stats(id).unwrap().cursor.map(|c| c.seq), Some(5));
    }
    // Stepping a finished job changes nothing and reports the same.
    assert_eq!(w.graft_step(&mut job, 3), Ok(GraftProgress::Done(report)));
}

#[test]
fn abandoning_a_rank_mid_graft_leaves_what_a_graft_without_it_leaves() {
    let (src, queries) = source(6, 3, 12);
    let snap = src.export_snapshot();
    let (mut w, r, ids) = target(3);
    let mut job = w.begin_graft(plan_all(&snap), &ids).expect("begins");
    while r.rank_stats(ids[1]).unwrap().carried_blocks == 0 {
        w.graft_step(&mut job, 5).expect("steps");
    }
    assert!(!job.is_done(), "abandoned mid-way");
    w.abandon_graft_rank(&mut job, ids[1]);
    assert_eq!(r.rank_stats(ids[1]).unwrap().carried_blocks, 0);
    assert_eq!(job.ranks(), vec![ids[0], ids[2]]);
    w.graft_all(&mut job).expect("finishes");

    let (mut w2, r2, ids2) = target(3);
    graft_in_slices(&mut w2, plan_all(&snap), &[ids2[0], ids2[2]], usize::MAX);
    assert_eq!(canonical(&r, None), canonical(&r2, None));
    assert_eq!(r.node_count(), r2.node_count(), "no node left behind");
    assert_eq!(answers(&r, &queries), answers(&r2, &queries));
}

#[test]
fn a_rank_excluded_before_the_first_slice_keeps_its_own_carriers() {
    // A rank that declined the graft (its stream began at seq 0 meanwhile) already carries live
    // blocks; excluding it must neither graft nor clear them.
    let (src, _) = source(13, 2, 6);
    let snap = src.export_snapshot();
    let (mut w, r, ids) = target(2);
    let toks = tokens(77, 2, BS);
    w.apply_batch(
        ids[0],
        0,
        &batch(vec![stored(&[1, 2], None, toks, BS, None)]),
    );
    let before = canonical(&r, Some(&rank_ref(0)));
    let mut job = w.begin_graft(plan_all(&snap), &ids).expect("begins");
    assert!(job.exclude_rank(ids[0]));
    assert!(!job.exclude_rank(ids[0]), "already out");
    while r.rank_stats(ids[1]).unwrap().carried_blocks == 0 {
        w.graft_step(&mut job, 5).expect("steps");
    }
    assert!(
        !job.exclude_rank(ids[1]),
        "carriers placed: only abandoning removes them"
    );
    w.graft_all(&mut job).expect("finishes");
    assert_eq!(canonical(&r, Some(&rank_ref(0))), before);
    assert_eq!(
        canonical(&r, Some(&rank_ref(1))),
        canonical(&src, Some(&rank_ref(1)))
    );
}

#[test]
fn abandoning_after_the_graft_completes_clears_the_rank_and_its_cursor() {
    let (src, _) = source(7, 2, 5);
    let snap = src.export_snapshot();
    let (mut w, r, ids) = target(2);
    let mut job = w.begin_graft(plan_all(&snap), &ids).expect("begins");
    w.graft_all(&mut job).expect("finishes");
    w.abandon_graft_rank(&mut job, ids[0]);
    let st = r.rank_stats(ids[0]).unwrap();
    assert_eq!((st.carried_blocks, st.cursor), (0, None));
    assert!(r.rank_stats(ids[1]).unwrap().carried_blocks > 0);
}

#[test]
fn a_rank_removed_and_re_added_mid_graft_is_not_grafted_into_its_new_incarnation() {
    let (src, _) = source(8, 2, 10);
    let snap = src.export_snapshot();
    let (mut w, r, ids) = target(2);
    let mut job = w.begin_graft(plan_all(&snap), &ids).expect("begins");
    w.graft_step(&mut job, 10).expect("steps");
    w.abandon_graft_rank(&mut job, ids[0]);
    w.remove_rank(ids[0]);
    let again = w.add_rank(rank_ref(0));
    assert_ne!(again, ids[0]);
    w.graft_all(&mut job).expect("finishes");
    let st = r.rank_stats(again).unwrap();
    assert_eq!((st.carried_blocks, st.cursor), (0, None));
    assert_eq!(
        canonical(&r, Some(&rank_ref(1))),
        canonical(&src, Some(&rank_ref(1)))
    );
}

#[test]
fn live_batches_of_other_ranks_between_slices_are_kept() {
    let (src, queries) = source(9, 2, 10);
    let snap = src.export_snapshot();
    let (mut w, r, ids) = target(2);
    let live = w.add_rank(rank_ref(7));
    let mut job = w.begin_graft(plan_all(&snap), &ids).expect("begins");
    let mut seq = 0;
    let mut live_queries = Vec::new();
    loop {
        // A live rank stores a prompt the snapshot also holds, plus its own tail.
        let mut toks = tokens(1000 + (seq % 4) as u32, 1 + (seq % 4) as usize, BS);
        toks.extend(tokens(90_000 + seq as u32, 1, BS));
        let n = toks.len() / BS as usize;
        let engines: Vec<u64> = (0..n as u64)
            .map(|i| 7 << 40 | (seq as u64) << 8 | i)
            .collect();
        w.apply_batch(
            live,
            seq,
            &batch(vec![stored(&engines, None, toks.clone(), BS, None)]),
        );
        live_queries.push(hashes_of(&toks, BS));
        seq += 1;
        if let GraftProgress::Done(_) = w.graft_step(&mut job, 6).expect("steps") {
            break;
        }
    }
    assert!(seq > 3);
    for i in 0..2u32 {
        assert_eq!(
            canonical(&r, Some(&rank_ref(i))),
            canonical(&src, Some(&rank_ref(i)))
        );
    }
    let live_url = rank_ref(7).worker_url;
    let without_live: Vec<Vec<_>> = answers(&r, &queries)
        .into_iter()
        .map(|a| a.into_iter().filter(|m| m.0 != live_url).collect())
        .collect();
    assert_eq!(without_live, answers(&src, &queries));
    let live_hits = answers(&r, &live_queries);
    assert!(live_hits.iter().all(|a| a.iter().any(|m| m.0 == live_url)));
    assert_eq!(r.rank_stats(ids[0]).unwrap().cursor.map(|c| c.seq), Some(9));
}

#[test]
fn a_parent_evicted_between_slices_is_recreated_under_its_child() {
    // Rank 0 in the snapshot: a 2-block chain A -> B. The job places A, then a live store of
    // another rank pushes the index over its cap: A (an old leaf at that moment) loses its
    // carrier and is pruned. The next slice must re-create A (carrier-less) to place B.
    let (mut sw, src) = PrefixIndex::new(cfg());
    let s0 = sw.add_rank(rank_ref(0));
    let toks = tokens(3, 2, BS);
    sw.apply_batch(
        s0,
        1,
        &batch(vec![stored(&[21, 22], None, toks.clone(), BS, None)]),
    );
    let snap = src.export_snapshot();
    let (mut w, r) = PrefixIndex::new(IndexConfig {
        max_carried_blocks: 3,
        ..cfg()
    });
    let p = w.add_rank(rank_ref(0));
    let q = w.add_rank(rank_ref(1));
    let mut job = w.begin_graft(plan_all(&snap), &[p]).expect("begins");
    assert!(matches!(
        w.graft_step(&mut job, 2).expect("steps"),
        GraftProgress::More { .. }
    ));
    assert_eq!(r.rank_stats(p).unwrap().carried_blocks, 1, "A placed");
    let other = tokens(44, 3, BS);
    w.apply_batch(
        q,
        0,
        &batch(vec![stored(&[31, 32, 33], None, other, BS, None)]),
    );
    assert_eq!(r.rank_stats(p).unwrap().carried_blocks, 0, "A evicted");
    let report = w.graft_all(&mut job).expect("finishes");
    assert_eq!(report.stale_entries, 1, "A's side entry is not filed");
    let hashes = hashes_of(&toks, BS);
    let after = r.export_snapshot();
    kvroute_index::validate_snapshot(&after, BS).expect("a well-formed tree");
    let b = after
        .nodes
        .content_hash
        .iter()
        .position(|&h| h == hashes[1])
        .expect("B placed");
    let parent = after.nodes.parent[b];
    assert_ne!(parent, NO_PARENT);
    assert_eq!(after.nodes.content_hash[parent as usize], hashes[0]);
    // B's side entry works: removing it prunes B and the carrier-less A with it.
    let nodes_before = r.node_count();
    w.apply_batch(p, 2, &batch(vec![removed(&[22], None)]));
    assert_eq!(r.rank_stats(p).unwrap().carried_blocks, 0);
    assert_eq!(r.node_count(), nodes_before - 2);
}

#[test]
fn begin_graft_refuses_another_block_size_and_a_job_of_another_index() {
    let (src, _) = source(10, 1, 3);
    let snap = src.export_snapshot();
    let plan = plan_all(&snap);
    let (mut w8, _) = PrefixIndex::new(IndexConfig {
        block_size: 8,
        ..cfg()
    });
    let id = w8.add_rank(rank_ref(0));
    assert_eq!(
        w8.begin_graft(plan.clone(), &[id]).err(),
        Some(GraftError::Invalid(RestoreError::BlockSize {
            found: BS,
            expected: 8
        }))
    );
    let (mut a, ra, ids) = target(1);
    let (mut b, _, _) = target(1);
    let mut job = a.begin_graft(plan, &ids).expect("begins");
    assert_eq!(b.graft_step(&mut job, 10), Err(GraftError::ForeignJob));
    assert_eq!(ra.total_carried(), 0, "nothing grafted by the refusal");
}

#[test]
fn plan_refuses_a_rank_carrying_one_engine_hash_on_two_nodes() {
    let (src, _) = source(11, 2, 4);
    let mut snap = src.export_snapshot();
    let c0 = (0..snap.nodes.carrier_rank.len())
        .filter(|&c| snap.nodes.carrier_rank[c] == 1)
        .take(2)
        .collect::<Vec<_>>();
    let dup = snap.nodes.carrier_engine_hash[c0[0]];
    snap.nodes.carrier_engine_hash[c0[1]] = dup;
    assert_eq!(
        GraftPlan::new(snap, BS, |_| true).err(),
        Some(GraftError::DuplicateEngineHash {
            carrier: c0[1],
            rank: 1,
            engine: dup
        })
    );
}

#[test]
fn plan_reports_the_lowest_rank_carrying_a_duplicate_whatever_group_checks_it() {
    // Ranks are checked in groups on several threads; with duplicates in two ranks far apart
    // (so in different groups whenever there is more than one), the report names the lower
    // rank, as a check of one rank after another would.
    let (src, _) = source(13, 8, 4);
    let mut snap = src.export_snapshot();
    fn plant(snap: &mut IndexSnapshot, rank: u32) -> (usize, u64) {
        let c: Vec<usize> = (0..snap.nodes.carrier_rank.len())
            .filter(|&c| snap.nodes.carrier_rank[c] == rank)
            .take(2)
            .collect();
        let dup = snap.nodes.carrier_engine_hash[c[0]];
        snap.nodes.carrier_engine_hash[c[1]] = dup;
        (c[1], dup)
    }
    let (late_carrier, late_dup) = plant(&mut snap, 7);
    let late_only = snap.clone();
    let (early_carrier, early_dup) = plant(&mut snap, 2);
    assert_eq!(
        GraftPlan::new(late_only, BS, |_| true).err(),
        Some(GraftError::DuplicateEngineHash {
            carrier: late_carrier,
            rank: 7,
            engine: late_dup
        })
    );
    assert_eq!(
        GraftPlan::new(snap, BS, |_| true).err(),
        Some(GraftError::DuplicateEngineHash {
            carrier: early_carrier,
            rank: 2,
            engine: early_dup
        })
    );
}

#[test]
fn plan_refuses_what_restore_refuses() {
    let (src, _) = source(12, 1, 3);
    let mut snap = src.export_snapshot();
    snap.nodes.parent[0] = 1;
    assert_eq!(
        GraftPlan::new(snap, BS, |_| true).err(),
        Some(GraftError::Invalid(RestoreError::ParentNotBefore {
            node: 0,
            parent: 1
        }))
    );
}

#[test]
fn a_plan_laid_out_for_another_index_shape_still_grafts_exactly() {
    // The layout counts nodes for an index with 2 shards; the target has 4. The job must notice
    // and size the target's shards evenly instead of reading counts of shards that do not exist.
    let (src, queries) = source(21, 3, 10);
    let snap = src.export_snapshot();
    let (_, two_shards) = PrefixIndex::new(IndexConfig {
        shard_count: 2,
        ..cfg()
    });
    let mut foreign = plan_all(&snap);
    foreign.lay_out_for(&two_shards);
    let (mut w1, r1, ids1) = target(3);
    let (mut w2, r2, ids2) = target(3);
    graft_in_slices(&mut w1, plan_all(&snap), &ids1, 5);
    graft_in_slices(&mut w2, foreign, &ids2, 5);
    assert_eq!(canonical(&r2, None), canonical(&r1, None));
    assert_eq!(answers(&r2, &queries), answers(&src, &queries));
}

/// The storage a plan's room makes on another thread (slab chunks, side tables) changes where
/// the graft writes, never what the index holds: grafting into a room made whole beforehand, into
/// one made by a thread while the writer grafts, and into none give the same index, and every
/// carrier is found again by its engine hash (the side tables the room made are the ranks' maps).
#[test]
fn a_graft_into_the_storage_its_room_made_gives_the_same_index() {
    // Enough nodes that a shard's slab grows by several chunks.
    let (src, queries) = source(31, 4, 8_000);
    let snap = src.export_snapshot();
    let (mut w0, r0, ids0) = target(4);
    graft_in_slices(&mut w0, plan_all(&snap), &ids0, 4_096);
    for concurrent in [false, true] {
        let (mut w, r, ids) = target(4);
        let mut plan = plan_all(&snap);
        plan.lay_out_for(&r);
        let room = plan.room().expect("a laid-out plan has a room");
        assert!(
            room.chunks_max() >= 5,
            "the shape needs several chunks: {room:?}, {} nodes",
            snap.nodes.len()
        );
        let (helper, made) = if concurrent {
            let room = room.clone();
            (Some(std::thread::spawn(move || room.prepare())), None)
        } else {
            let made = room.prepare();
            assert_eq!(made.chunks_made, room.chunks_max(), "{made:?}");
            assert!(made.lists_made > 100, "{made:?}");
            assert_eq!(made.side_tables_made, 4, "{made:?}");
            (None, Some(made))
        };
        let (_, report) = graft_reporting(&mut w, plan, &ids, 4_096);
        if let Some(helper) = helper {
            helper.join().expect("the room's helper");
        }
        if let Some(made) = made {
            // Every list was for a node the writer gave its carriers at once, and every table
            // for a rank it filed; a shard's last chunk may stay unused.
            let taken = report.room_pieces_taken as usize;
            let all = made.chunks_made + made.lists_made + made.side_tables_made;
            assert!(
                taken + 4 >= all && taken <= all,
                "taken {taken} of {all} pieces: {made:?}"
            );
            assert_eq!(room.ready_side_tables(), 0, "every rank took its table");
        }
        assert_eq!(
            canonical(&r, None),
            canonical(&r0, None),
            "concurrent: {concurrent}"
        );
        assert_eq!(answers(&r, &queries), answers(&src, &queries));
        for (a, b) in ids0.iter().zip(&ids) {
            assert_eq!(r0.rank_stats(*a), r.rank_stats(*b));
        }
        for (i, &id) in ids.iter().enumerate() {
            let engines = engines_of_rank(&snap, i);
            w.apply_batch(id, 1_000_000, &batch(vec![removed(&engines, None)]));
            assert_eq!(
                r.rank_stats(id).map(|s| s.carried_blocks),
                Some(0),
                "rank {i} keeps a carrier its engine removed (concurrent: {concurrent})"
            );
        }
        assert_eq!(r.node_count(), 0, "every node pruned with its last carrier");
    }
}

/// A plan laid out while it is checked (`new_laid_out`: the job's columns written on another
/// thread from the start) is the plan laid out after the check: the same index once grafted, and
/// the job's columns made to its sizes, also when `keep` drops a rank (the columns written for
/// the whole snapshot are then too long: they are dropped and made again during the layout,
/// never used at the wrong size).
#[test]
fn a_plan_laid_out_while_it_is_checked_grafts_like_one_laid_out_after() {
    let (src, queries) = source(37, 4, 600);
    let snap = src.export_snapshot();
    let (mut w0, r0, ids0) = target(4);
    let mut after = plan_all(&snap);
    after.lay_out_for(&r0);
    assert!(after.has_job_columns(), "lay_out_for makes the columns");
    graft_in_slices(&mut w0, after, &ids0, 512);

    let (mut w, r, ids) = target(4);
    let during = GraftPlan::new_laid_out(snap.clone(), BS, |_| true, &r).expect("valid");
    assert!(during.has_job_columns(), "new_laid_out makes the columns");
    graft_in_slices(&mut w, during, &ids, 512);
    assert_eq!(canonical(&r, None), canonical(&r0, None));
    assert_eq!(answers(&r, &queries), answers(&src, &queries));

    let dropped = rank_ref(1);
    let (mut wk, rk, idsk) = target(4);
    let kept = GraftPlan::new_laid_out(snap.clone(), BS, |rr| rr != &dropped, &rk).expect("valid");
    assert_eq!(kept.ranks().len(), 3);
    assert!(
        kept.has_job_columns(),
        "columns written for four ranks' carriers are made again to three's"
    );
    let kept_ids: Vec<_> = [0usize, 2, 3].iter().map(|&i| idsk[i]).collect();
    graft_in_slices(&mut wk, kept, &kept_ids, 512);
    for i in [0u32, 2, 3] {
        assert_eq!(
            canonical(&rk, Some(&rank_ref(i))),
            canonical_snapshot(&snap, Some(&rank_ref(i))),
            "rank {i} grafted whole without the job's columns"
        );
    }
    assert_eq!(
        rk.rank_stats(idsk[1]).map(|s| s.carried_blocks),
        Some(0),
        "the dropped rank got nothing"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Also whether or not the plan was laid out for the index: exact sizing of the shards
    /// changes where memory goes, never what the index holds.
    #[test]
    fn slices_of_any_size_give_the_same_index(
        seed in any::<u64>(),
        ranks in 1u32..5,
        convs in 1u32..10,
        items_max in 1usize..64,
        grafted_mask in 1u8..16,
        laid_out in any::<bool>(),
    ) {
        let (src, queries) = source(seed, ranks, convs);
        let snap = src.export_snapshot();
        let (mut w1, r1, ids1) = target(ranks);
        let (mut w2, r2, ids2) = target(ranks);
        let pick = |ids: &[RankId]| -> Vec<RankId> {
            ids.iter().enumerate().filter(|(i, _)| grafted_mask >> i & 1 == 1).map(|(_, &id)| id).collect()
        };
        let mut sliced = plan_all(&snap);
        if laid_out {
            sliced.lay_out_for(&r2);
        }
        graft_in_slices(&mut w1, plan_all(&snap), &pick(&ids1), usize::MAX);
        graft_in_slices(&mut w2, sliced, &pick(&ids2), items_max);
        prop_assert_eq!(canonical(&r2, None), canonical(&r1, None));
        prop_assert_eq!(answers(&r2, &queries), answers(&r1, &queries));
        prop_assert_eq!(r2.node_count(), r1.node_count());
        for (a, b) in ids1.iter().zip(&ids2) {
            prop_assert_eq!(r1.rank_stats(*a), r2.rank_stats(*b));
        }
    }
}
