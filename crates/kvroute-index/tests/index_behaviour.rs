//! Behaviour of the index under single events: placement, removal, tiers, ranks, eviction,
//! malformed stores, and concurrent readers.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use kvroute_index::{IndexConfig, PrefixIndex, PrefixMatch, RankId, RankMatch, SkippedBlocks};
use kvroute_wire::event::{KvEvent, Medium};

const BS: u32 = 4;

fn cfg() -> IndexConfig {
    IndexConfig {
        block_size: BS,
        shard_count: 8,
        max_carried_blocks: 1_000_000,
    }
}

fn match_of(reader: &kvroute_index::IndexReader, hashes: &[u64], rank: RankId) -> (u32, u32) {
    let mut m = PrefixMatch::new();
    reader.match_prefix(hashes, &mut m);
    m.get(rank)
        .map(|r| (r.matched_blocks, r.device_blocks))
        .unwrap_or((0, 0))
}

#[test]
fn a_stored_chain_matches_to_its_depth_and_stops_at_divergence() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t = tokens(1, 4, BS);
    w.apply_event(a, &stored(&[11, 12, 13, 14], None, t.clone(), BS, None));
    let h = hashes_of(&t, BS);
    assert_eq!(match_of(&r, &h, a), (4, 4));
    assert_eq!(match_of(&r, &h[..2], a), (2, 2));
    let mut other = t.clone();
    other[9] = 777_777; // inside block 2
    assert_eq!(match_of(&r, &hashes_of(&other, BS), a), (2, 2));
    assert_eq!(r.total_carried(), 4);
    assert_eq!(r.counters().stored_blocks, 4);
}

#[test]
fn a_child_store_extends_its_parent_chain_through_the_side_map() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t = tokens(2, 5, BS);
    w.apply_event(a, &stored(&[1, 2], None, t[..8].to_vec(), BS, None));
    w.apply_event(a, &stored(&[3, 4, 5], Some(2), t[8..].to_vec(), BS, None));
    assert_eq!(match_of(&r, &hashes_of(&t, BS), a), (5, 5));
}

#[test]
fn a_side_map_grown_ahead_of_need_keeps_every_entry_reachable() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t = tokens(2, 5, BS);
    w.apply_event(a, &stored(&[1, 2], None, t[..8].to_vec(), BS, None));
    let (room, entries) = w.side_map_room(a).expect("registered");
    assert_eq!(entries, 2);
    w.grow_side_map(a);
    let (grown_room, grown_entries) = w.side_map_room(a).expect("registered");
    assert_eq!(grown_entries, 2);
    assert!(grown_room > room, "{grown_room} <= {room}");
    // The parent is still found through the rehashed map, and a removal still finds its block.
    w.apply_event(a, &stored(&[3, 4, 5], Some(2), t[8..].to_vec(), BS, None));
    assert_eq!(match_of(&r, &hashes_of(&t, BS), a), (5, 5));
    w.apply_event(
        a,
        &KvEvent::BlockRemoved(kvroute_wire::event::BlockRemoved {
            block_hashes: vec![kvroute_wire::EngineHash(2)],
            medium: None,
            group_idx: None,
        }),
    );
    assert_eq!(match_of(&r, &hashes_of(&t, BS), a), (1, 1));
    assert_eq!(w.side_map_room(RankId(99)), None);
}

/// A large map grows by reading its keys in batches, through nodes of either kind (a carrier of
/// its own, or a list shared with another rank), with tombstones left by removals; every entry
/// must still be found afterwards, by a child store and by a removal.
#[test]
fn a_large_side_map_grown_in_batches_keeps_every_entry_reachable() {
    const BLOCKS: usize = 12_000;
    const SHARED: usize = 5_000;
    const REMOVED_TAIL: usize = 1_500;
    const PER_EVENT: usize = 100;
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let b = w.add_rank(rank_ref(1));
    let t = tokens(9, BLOCKS, BS);
    let a_hash = |i: usize| i as u64 + 1;
    let b_hash = |i: usize| 1_000_000 + i as u64;
    let per_event = PER_EVENT * BS as usize;
    for (e, chunk) in t.chunks(per_event).enumerate() {
        let first = e * PER_EVENT;
        let hashes: Vec<u64> = (first..first + PER_EVENT).map(a_hash).collect();
        let parent = first.checked_sub(1).map(a_hash);
        w.apply_event(a, &stored(&hashes, parent, chunk.to_vec(), BS, None));
        if first < SHARED {
            let hashes: Vec<u64> = (first..first + PER_EVENT).map(b_hash).collect();
            let parent = first.checked_sub(1).map(b_hash);
            w.apply_event(b, &stored(&hashes, parent, chunk.to_vec(), BS, None));
        }
    }
    assert_eq!(r.rank_stats(a).unwrap().carried_blocks, BLOCKS as u64);
    assert_eq!(r.rank_stats(b).unwrap().carried_blocks, SHARED as u64);
    let kept = BLOCKS - REMOVED_TAIL;
    let tail: Vec<u64> = (kept..BLOCKS).map(a_hash).collect();
    w.apply_event(a, &removed(&tail, None));
    for _ in 0..3 {
        let (room, entries) = w.side_map_room(a).expect("registered");
        assert_eq!(entries, kept);
        w.grow_side_map(a);
        let (grown_room, grown_entries) = w.side_map_room(a).expect("registered");
        assert_eq!(grown_entries, kept, "a growth keeps every entry");
        assert!(grown_room > room, "{grown_room} <= {room}");
    }
    let h = hashes_of(&t, BS);
    assert_eq!(match_of(&r, &h, a), (kept as u32, kept as u32));
    // A child finds its parent (a node of a's own) through the grown map.
    w.apply_event(
        a,
        &stored(
            &[a_hash(kept)],
            Some(a_hash(kept - 1)),
            t[kept * BS as usize..(kept + 1) * BS as usize].to_vec(),
            BS,
            None,
        ),
    );
    assert_eq!(match_of(&r, &h, a), (kept as u32 + 1, kept as u32 + 1));
    // Every entry is found by its removal, through shared nodes and own ones alike.
    let all: Vec<u64> = (0..=kept).map(a_hash).collect();
    w.apply_event(a, &removed(&all, None));
    assert_eq!(r.rank_stats(a).unwrap().carried_blocks, 0);
    assert_eq!(r.rank_stats(b).unwrap().carried_blocks, SHARED as u64);
    assert_eq!(match_of(&r, &h, b), (SHARED as u32, SHARED as u32));
}

#[test]
fn blocks_with_an_unknown_parent_are_dropped_and_counted() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let b = w.add_rank(rank_ref(1));
    let t = tokens(3, 3, BS);
    w.apply_event(a, &stored(&[1], None, t[..4].to_vec(), BS, None));
    // Rank b never announced engine hash 1, so its child cannot be placed.
    let rep = w.apply_event(b, &stored(&[2, 3], Some(1), t[4..].to_vec(), BS, None));
    assert_eq!(rep.stored_blocks, 0);
    assert_eq!(r.counters().stored_unknown_parent_blocks, 2);
    assert_eq!(match_of(&r, &hashes_of(&t, BS), b), (0, 0));
    assert_eq!(r.rank_stats(b).unwrap().carried_blocks, 0);
}

#[test]
fn removing_an_unknown_engine_hash_is_counted_not_an_error() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    w.apply_event(a, &stored(&[1], None, tokens(4, 1, BS), BS, None));
    let rep = w.apply_event(a, &removed(&[99, 1], None));
    assert_eq!(rep.removed_blocks, 1);
    assert_eq!(r.counters().removed_unknown_blocks, 1);
    assert_eq!(r.total_carried(), 0);
    assert_eq!(
        r.node_count(),
        0,
        "an uncarried childless node must be pruned"
    );
}

#[test]
fn removing_an_interior_block_cuts_the_contiguous_match_there() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t = tokens(5, 4, BS);
    w.apply_event(a, &stored(&[1, 2, 3, 4], None, t.clone(), BS, None));
    w.apply_event(a, &removed(&[2], None));
    assert_eq!(match_of(&r, &hashes_of(&t, BS), a), (1, 1));
    assert_eq!(r.total_carried(), 3);
    assert_eq!(
        r.node_count(),
        4,
        "the interior node stays while it has children"
    );
    w.apply_event(a, &removed(&[4, 3], None));
    assert_eq!(
        r.node_count(),
        1,
        "pruning walks upward through uncarried nodes"
    );
}

#[test]
fn a_device_eviction_with_a_host_copy_keeps_the_block_carried_on_host() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t = tokens(6, 3, BS);
    w.apply_event(a, &stored(&[1, 2, 3], None, t.clone(), BS, None));
    w.apply_event(
        a,
        &stored(&[2, 3], Some(1), t[4..].to_vec(), BS, Some(Medium::Host)),
    );
    w.apply_event(a, &removed(&[2], Some(Medium::Device)));
    let h = hashes_of(&t, BS);
    assert_eq!(
        match_of(&r, &h, a),
        (3, 1),
        "any-tier depth 3, device depth stops at block 1"
    );
    let st = r.rank_stats(a).unwrap();
    assert_eq!(st.carried_blocks, 3);
    assert_eq!(st.tier_blocks, [2, 2, 0, 0]);
    // A removal with no medium clears every tier.
    w.apply_event(a, &removed(&[3], None));
    assert_eq!(match_of(&r, &h, a), (2, 1));
    // An unknown medium on a removal is read as "all tiers".
    w.apply_event(a, &removed(&[2], Some(Medium::Unknown)));
    assert_eq!(match_of(&r, &h, a), (1, 1));
    assert_eq!(r.rank_stats(a).unwrap().tier_blocks, [1, 0, 0, 0]);
}

#[test]
fn a_store_in_an_unknown_medium_is_ignored_and_counted() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    w.apply_event(
        a,
        &stored(&[1, 2], None, tokens(7, 2, BS), BS, Some(Medium::Unknown)),
    );
    assert_eq!(r.total_carried(), 0);
    assert_eq!(r.counters().unknown_medium_stored_blocks, 2);
}

#[test]
fn a_token_count_mismatch_is_counted_and_skipped() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let mut t = tokens(8, 2, BS);
    t.pop();
    let short = w.apply_event(a, &stored(&[1, 2], None, t, BS, None));
    let foreign = w.apply_event(a, &stored(&[1], None, tokens(8, 1, 8), 8, None));
    assert_eq!(r.total_carried(), 0);
    assert_eq!(r.counters().token_mismatch_events, 1);
    assert_eq!(r.counters().block_size_mismatch_events, 1);
    // The report says why, so the caller can tell a misconfigured engine from the rest.
    assert_eq!(short.skipped.token_count, 2, "{short:?}");
    assert_eq!(short.skipped.total(), 2, "{short:?}");
    assert_eq!(short.foreign_block_size, None);
    assert_eq!(foreign.skipped.block_size, 1, "{foreign:?}");
    assert_eq!(foreign.skipped.total(), 1, "{foreign:?}");
    assert_eq!(foreign.foreign_block_size, Some(8));
}

#[test]
fn a_store_under_an_unknown_parent_is_reported_as_such_and_a_good_one_skips_nothing() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let good = w.apply_event(a, &stored(&[1, 2], None, tokens(3, 2, BS), BS, None));
    assert_eq!(good.stored_blocks, 2, "{good:?}");
    assert_eq!(good.skipped, SkippedBlocks::default(), "{good:?}");
    let orphan = w.apply_event(a, &stored(&[5], Some(99), tokens(4, 1, BS), BS, None));
    assert_eq!(orphan.skipped.unknown_parent, 1, "{orphan:?}");
    assert_eq!(orphan.skipped.total(), 1, "{orphan:?}");
    let gone = w.apply_event(a, &removed(&[42], None));
    assert_eq!(gone.skipped.unknown_removed, 1, "{gone:?}");
    assert_eq!(r.total_carried(), 2);
}

#[test]
fn bigram_token_pairs_hash_like_the_plain_tokens() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t = tokens(9, 2, BS);
    let pairs: Vec<u32> = t
        .iter()
        .enumerate()
        .flat_map(|(i, &x)| [x, t.get(i + 1).copied().unwrap_or(0)])
        .collect();
    w.apply_event(a, &stored(&[1, 2], None, pairs, BS, None));
    assert_eq!(match_of(&r, &hashes_of(&t, BS), a), (2, 2));
    assert_eq!(r.counters().token_mismatch_events, 0);
}

#[test]
fn shared_prefixes_report_each_rank_its_own_depth() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let b = w.add_rank(rank_ref(1));
    let sys = tokens(10, 3, BS);
    let mut conv_a = sys.clone();
    conv_a.extend(tokens(11, 2, BS));
    w.apply_event(a, &stored(&[1, 2, 3, 4, 5], None, conv_a.clone(), BS, None));
    w.apply_event(
        b,
        &stored(&[1, 2, 3], None, sys.clone(), BS, Some(Medium::Host)),
    );
    let mut m = PrefixMatch::new();
    r.match_prefix(&hashes_of(&conv_a, BS), &mut m);
    let mut got = m.ranks.clone();
    got.sort_by_key(|x| x.rank);
    assert_eq!(
        got,
        vec![
            RankMatch {
                rank: a,
                matched_blocks: 5,
                device_blocks: 5
            },
            RankMatch {
                rank: b,
                matched_blocks: 3,
                device_blocks: 0
            },
        ]
    );
    assert_eq!(r.node_count(), 5);
    assert_eq!(r.total_carried(), 8);
}

#[test]
fn lora_namespaces_do_not_match_base_requests() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t = tokens(12, 2, BS);
    let mut ev = stored(&[1, 2], None, t.clone(), BS, None);
    if let KvEvent::BlockStored(s) = &mut ev {
        s.lora_name = Some("adapter".into());
    }
    w.apply_event(a, &ev);
    assert_eq!(match_of(&r, &hashes_of(&t, BS), a), (0, 0));
}

#[test]
fn all_blocks_cleared_drops_only_that_ranks_carriers() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let b = w.add_rank(rank_ref(1));
    let t = tokens(13, 3, BS);
    w.apply_event(a, &stored(&[1, 2, 3], None, t.clone(), BS, None));
    w.apply_event(b, &stored(&[7, 8], None, t[..8].to_vec(), BS, None));
    w.apply_batch(a, 5, &batch(vec![KvEvent::AllBlocksCleared]));
    let h = hashes_of(&t, BS);
    assert_eq!(match_of(&r, &h, a), (0, 0));
    assert_eq!(match_of(&r, &h, b), (2, 2));
    assert_eq!(r.total_carried(), 2);
    assert_eq!(r.node_count(), 2);
    assert_eq!(r.counters().cleared_ranks, 1);
    let st = r.rank_stats(a).unwrap();
    assert_eq!((st.carried_blocks, st.cursor.map(|c| c.seq)), (0, Some(5)));
    // The side map went too: removing an old hash is now unknown.
    w.apply_event(a, &removed(&[1], None));
    assert_eq!(r.counters().removed_unknown_blocks, 1);
}

#[test]
fn remove_rank_forgets_the_rank_and_never_reuses_its_id() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    assert_eq!(
        w.add_rank(rank_ref(0)),
        a,
        "add_rank is idempotent by RankRef"
    );
    let t = tokens(14, 2, BS);
    w.apply_event(a, &stored(&[1, 2], None, t.clone(), BS, None));
    w.remove_rank(a);
    assert!(r.rank_stats(a).is_none());
    assert!(r.ranks().is_empty());
    assert_eq!(r.total_carried(), 0);
    assert_eq!(r.node_count(), 0);
    let again = w.add_rank(rank_ref(0));
    assert_ne!(again, a);
    let rep = w.apply_event(a, &stored(&[1], None, t[..4].to_vec(), BS, None));
    assert_eq!(rep.stored_blocks, 0, "events for a removed id are refused");
    assert_eq!(r.counters().unknown_rank_events, 1);
}

#[test]
fn an_engine_hash_reused_for_new_content_drops_the_old_carrier() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t1 = tokens(15, 1, BS);
    let t2 = tokens(16, 1, BS);
    w.apply_event(a, &stored(&[1], None, t1.clone(), BS, None));
    w.apply_event(a, &stored(&[1], None, t2.clone(), BS, None));
    assert_eq!(match_of(&r, &hashes_of(&t1, BS), a), (0, 0));
    assert_eq!(match_of(&r, &hashes_of(&t2, BS), a), (1, 1));
    assert_eq!(r.total_carried(), 1);
    w.apply_event(a, &removed(&[1], None));
    assert_eq!(r.total_carried(), 0);
    assert_eq!(r.node_count(), 0);
}

#[test]
fn apply_batch_records_the_cursor_it_is_told() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let mut b = batch(vec![stored(&[1], None, tokens(17, 1, BS), BS, None)]);
    b.ts = 42.5;
    w.apply_batch(a, 7, &b);
    let c = r.rank_stats(a).unwrap().cursor.unwrap();
    assert_eq!((c.rank, c.seq, c.ts), (a.0, 7, 42.5));
    w.set_cursor(a, None);
    assert!(r.rank_stats(a).unwrap().cursor.is_none());
}

#[test]
fn over_the_cap_the_least_recently_matched_leaves_are_evicted_first() {
    let (mut w, r) = PrefixIndex::new(IndexConfig {
        max_carried_blocks: 100,
        ..cfg()
    });
    let a = w.add_rank(rank_ref(0));
    // 25 chains of 4 blocks = 100 carried blocks (at the cap, nothing evicted yet).
    let chains: Vec<Vec<u32>> = (0..25).map(|i| tokens(100 + i, 4, BS)).collect();
    for (i, t) in chains.iter().enumerate() {
        let base = 1000 * (i as u64 + 1);
        w.apply_event(
            a,
            &stored(
                &[base, base + 1, base + 2, base + 3],
                None,
                t.clone(),
                BS,
                None,
            ),
        );
    }
    assert_eq!(r.total_carried(), 100);
    assert_eq!(r.counters().evicted_carriers, 0);
    // Touch chain 0 so it is the most recently matched.
    let hot = hashes_of(&chains[0], BS);
    assert_eq!(match_of(&r, &hot, a), (4, 4));
    let extra = tokens(999, 1, BS);
    let rep = w.apply_event(a, &stored(&[5], None, extra, BS, None));
    assert!(
        r.total_carried() <= 95,
        "evicted down to 95% of the cap, got {}",
        r.total_carried()
    );
    assert_eq!(rep.evicted_carriers, r.counters().evicted_carriers);
    assert!(rep.evicted_carriers >= 6);
    assert_eq!(
        match_of(&r, &hot, a),
        (4, 4),
        "the recently matched chain survives"
    );
    assert_eq!(r.rank_stats(a).unwrap().carried_blocks, r.total_carried());
    // Evicted carriers leave the side map too: removing one is an unknown removal, no panic.
    let before = r.counters().removed_unknown_blocks;
    w.apply_event(a, &removed(&[2003], None));
    w.apply_event(a, &removed(&[2003], None));
    assert!(r.counters().removed_unknown_blocks > before);
}

/// Waits for `cond` with a deadline, naming what was awaited.
fn wait_until(what: &str, deadline: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

#[test]
fn concurrent_readers_never_see_a_partially_applied_store() {
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    // Each store event adds a whole 8-block chain; a reader must see 0 or 8, never in between,
    // and removals take it back to 0 atomically per event too.
    const CHAIN_BLOCKS: usize = 8;
    let chains: Vec<Vec<u32>> = (0..16).map(|i| tokens(500 + i, CHAIN_BLOCKS, BS)).collect();
    let queries: Arc<Vec<Vec<u64>>> = Arc::new(chains.iter().map(|t| hashes_of(t, BS)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let seen_full = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut handles = Vec::new();
    for _ in 0..2 {
        let (r, q, stop, seen_full) = (r.clone(), queries.clone(), stop.clone(), seen_full.clone());
        handles.push(std::thread::spawn(move || {
            let mut m = PrefixMatch::new();
            let mut torn = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for h in q.iter() {
                    r.match_prefix(h, &mut m);
                    for x in &m.ranks {
                        if x.matched_blocks as usize == CHAIN_BLOCKS {
                            seen_full.fetch_add(1, Ordering::Relaxed);
                        } else {
                            torn.push(x.matched_blocks);
                        }
                    }
                }
            }
            torn
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut round = 0u64;
    while seen_full.load(Ordering::Relaxed) < 1000 && Instant::now() < deadline {
        for (i, t) in chains.iter().enumerate() {
            let base = (round * 100 + i as u64) * 16;
            let hs: Vec<u64> = (0..CHAIN_BLOCKS as u64).map(|k| base + k).collect();
            w.apply_event(a, &stored(&hs, None, t.clone(), BS, None));
            w.apply_event(a, &removed(&hs, None));
            w.apply_event(a, &stored(&hs, None, t.clone(), BS, None));
        }
        for (i, _) in chains.iter().enumerate() {
            let base = (round * 100 + i as u64) * 16;
            let hs: Vec<u64> = (0..CHAIN_BLOCKS as u64).rev().map(|k| base + k).collect();
            w.apply_event(a, &removed(&hs, None));
        }
        round += 1;
    }
    wait_until(
        "readers to observe full chains",
        Duration::from_secs(5),
        || seen_full.load(Ordering::Relaxed) > 0,
    );
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        let torn = h.join().expect("reader thread");
        assert!(
            torn.is_empty(),
            "readers saw partial depths {:?}",
            &torn[..torn.len().min(10)]
        );
    }
}

#[test]
fn long_prompts_match_exactly_across_lookup_batches_with_both_match_paths() {
    use kvroute_index::hash::BASE_NAMESPACE;
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let b = w.add_rank(rank_ref(1));
    let c = w.add_rank(rank_ref(2));
    // 100 blocks for a; b holds the first 70 (blocks 40.. on host only); c holds 33 blocks.
    let t = tokens(40, 100, BS);
    let ea: Vec<u64> = (0..100).collect();
    w.apply_event(a, &stored(&ea, None, t.clone(), BS, None));
    w.apply_event(b, &stored(&ea[..40], None, t[..160].to_vec(), BS, None));
    w.apply_event(
        b,
        &stored(
            &ea[40..70],
            Some(39),
            t[160..280].to_vec(),
            BS,
            Some(Medium::Host),
        ),
    );
    w.apply_event(c, &stored(&ea[..33], None, t[..132].to_vec(), BS, None));
    let mut query = t.clone();
    query.extend(tokens(41, 300, BS));
    let want = vec![
        RankMatch {
            rank: a,
            matched_blocks: 100,
            device_blocks: 100,
        },
        RankMatch {
            rank: b,
            matched_blocks: 70,
            device_blocks: 40,
        },
        RankMatch {
            rank: c,
            matched_blocks: 33,
            device_blocks: 33,
        },
    ];
    let mut m = PrefixMatch::new();
    r.match_prefix(&hashes_of(&query, BS), &mut m);
    let mut got = m.ranks.clone();
    got.sort_by_key(|x| x.rank);
    assert_eq!(got, want, "match_prefix");
    let mut hs = Vec::new();
    r.match_tokens(&query, BASE_NAMESPACE, &mut hs, &mut m);
    let mut got = m.ranks.clone();
    got.sort_by_key(|x| x.rank);
    assert_eq!(got, want, "match_tokens");
    let limit = 100 + kvroute_index::index::MATCH_SLOT_LEAD_BLOCKS + 1;
    assert!(
        hs.len() <= limit,
        "match_tokens stops hashing after the match ends, hashed {}",
        hs.len()
    );
    assert!(hs.len() >= 100);
}

/// Runs along shared nodes are recognised from a digest of each node's carrier SET: the same
/// ranks with the same tiers continue a run whatever order they were added in, and a tier
/// difference ends it (else the device depth would run on where the device copy stops).
#[test]
fn a_carrier_run_follows_equal_sets_in_any_order_and_stops_at_a_tier_change() {
    for (medium, want_a) in [(None, (4, 4)), (Some(Medium::Host), (4, 2))] {
        let (mut w, r) = PrefixIndex::new(cfg());
        let a = w.add_rank(rank_ref(0));
        let b = w.add_rank(rank_ref(1));
        let t = tokens(70, 4, BS);
        // Blocks 0-1 list (a, b); blocks 2-3 list (b, a), a's copy in `medium`.
        w.apply_event(a, &stored(&[1, 2], None, t[..8].to_vec(), BS, None));
        w.apply_event(b, &stored(&[11, 12, 13, 14], None, t.clone(), BS, None));
        w.apply_event(a, &stored(&[3, 4], Some(2), t[8..].to_vec(), BS, medium));
        let h = hashes_of(&t, BS);
        assert_eq!(match_of(&r, &h, a), want_a, "rank a, medium {medium:?}");
        assert_eq!(match_of(&r, &h, b), (4, 4), "rank b, medium {medium:?}");
    }
}

/// The walk first tries the previous block's slab successor; a FREED slot there still holds
/// its old node's hash and must not be taken for the live node that now has it elsewhere.
#[test]
fn a_freed_slab_slot_holding_the_next_blocks_hash_is_not_taken_for_its_node() {
    let one_shard = IndexConfig {
        shard_count: 1,
        ..cfg()
    };
    let (mut w, r) = PrefixIndex::new(one_shard);
    let a = w.add_rank(rank_ref(0));
    let x = tokens(80, 2, BS);
    // x0, x1 take slots 0 and 1, z0 slot 2.
    w.apply_event(a, &stored(&[1, 2], None, x.clone(), BS, None));
    w.apply_event(a, &stored(&[9], None, tokens(81, 1, BS), BS, None));
    // Free x1 (slot 1 keeps x1's hash), then z0: the free list pops slot 2 next.
    w.apply_event(a, &removed(&[2], None));
    w.apply_event(a, &removed(&[9], None));
    w.apply_event(a, &stored(&[3], Some(1), x[4..].to_vec(), BS, None));
    let h = hashes_of(&x, BS);
    assert_eq!(match_of(&r, &h, a), (2, 2), "x1 lives in slot 2 now");
    let mut hs = Vec::new();
    let mut m = PrefixMatch::new();
    r.match_tokens(&x, kvroute_index::hash::BASE_NAMESPACE, &mut hs, &mut m);
    assert_eq!(m.max_matched_blocks(), 2, "match_tokens: {:?}", m.ranks);
}

/// Chains are followed through the slab, which is stored in chunks: a chain that crosses a
/// chunk boundary must match to its end like any other.
#[test]
fn a_chain_longer_than_a_slab_chunk_matches_to_its_end() {
    use kvroute_index::index::SLAB_CHUNK_NODES;
    let blocks = SLAB_CHUNK_NODES + 300;
    let (mut w, r) = PrefixIndex::new(cfg());
    let a = w.add_rank(rank_ref(0));
    let t = tokens(90, blocks, BS);
    let engines: Vec<u64> = (1..=blocks as u64).collect();
    // Stores of at most 1,000 blocks, each continuing the previous one.
    let mut parent = None;
    for (e, toks) in engines.chunks(1_000).zip(t.chunks(1_000 * BS as usize)) {
        w.apply_event(a, &stored(e, parent, toks.to_vec(), BS, None));
        parent = e.last().copied();
    }
    let h = hashes_of(&t, BS);
    assert_eq!(match_of(&r, &h, a), (blocks as u32, blocks as u32));
    let mut hs = Vec::new();
    let mut m = PrefixMatch::new();
    r.match_tokens(&t, kvroute_index::hash::BASE_NAMESPACE, &mut hs, &mut m);
    assert_eq!(m.max_matched_blocks(), blocks as u32, "match_tokens");
}

#[test]
fn the_writer_is_send_and_the_reader_is_shareable_across_threads() {
    fn send<T: Send>() {}
    fn shareable<T: Send + Sync + Clone>() {}
    send::<kvroute_index::IndexWriter>();
    shareable::<kvroute_index::IndexReader>();
    // Moving the writer to another thread and reading from this one works end to end.
    let (mut w, r) = PrefixIndex::new(cfg());
    let t = tokens(80, 2, BS);
    let h = hashes_of(&t, BS);
    let id = std::thread::spawn(move || {
        let a = w.add_rank(rank_ref(0));
        w.apply_event(a, &stored(&[1, 2], None, t, BS, None));
        a
    })
    .join()
    .expect("writer thread");
    assert_eq!(match_of(&r, &h, id), (2, 2));
}
