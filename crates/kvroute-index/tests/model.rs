//! Model test: random event sequences applied to the index and to a naive reference model must
//! give the same per-rank contiguous match depths (any tier and device) and the same per-rank
//! stats. Also checks that a snapshot round trip preserves behaviour for LATER events (which
//! proves the side maps were rebuilt), and that `retain_ranks` keeps exactly the kept ranks.

mod common;

use std::collections::HashMap;

use common::*;
use kvroute_index::hash::{BASE_NAMESPACE, chain_hash};
use kvroute_index::{
    IndexConfig, IndexReader, IndexWriter, PrefixIndex, PrefixMatch, RankId, retain_ranks,
};
use kvroute_wire::event::{KvEvent, Medium};
use kvroute_wire::snapshot::RankRef;
use proptest::prelude::*;

const BS: u32 = 2;
const RANKS: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    Store {
        rank: usize,
        parent_pick: Option<usize>,
        unknown_parent: bool,
        blocks: Vec<u8>,
        medium: u8,
    },
    Remove {
        rank: usize,
        picks: Vec<usize>,
        unknown: bool,
        medium: u8,
    },
    Clear {
        rank: usize,
    },
    RemoveRank {
        rank: usize,
    },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..RANKS, prop::option::of(0usize..64), prop::bool::weighted(0.05),
              prop::collection::vec(0u8..3, 1..5), 0u8..6)
            .prop_map(|(rank, parent_pick, unknown_parent, blocks, medium)| Op::Store {
                rank, parent_pick, unknown_parent, blocks, medium }),
        4 => (0..RANKS, prop::collection::vec(0usize..64, 1..4), prop::bool::weighted(0.1), 0u8..4)
            .prop_map(|(rank, picks, unknown, medium)| Op::Remove { rank, picks, unknown, medium }),
        1 => (0..RANKS).prop_map(|rank| Op::Clear { rank }),
        1 => (0..RANKS).prop_map(|rank| Op::RemoveRank { rank }),
    ]
}

fn store_medium(m: u8) -> Option<Medium> {
    match m {
        0 => None,
        1 => Some(Medium::Device),
        2 => Some(Medium::Host),
        3 => Some(Medium::Disk),
        4 => Some(Medium::External),
        _ => Some(Medium::Unknown),
    }
}

fn remove_medium(m: u8) -> Option<Medium> {
    match m {
        0 => None,
        1 => Some(Medium::Device),
        2 => Some(Medium::Host),
        _ => Some(Medium::Unknown),
    }
}

fn bit(m: Option<Medium>) -> u8 {
    match m {
        None | Some(Medium::Device) => 1,
        Some(Medium::Host) => 2,
        Some(Medium::Disk) => 4,
        Some(Medium::External) => 8,
        Some(Medium::Unknown) => 0,
    }
}

/// Reference model: per rank slot, engine hash -> (content hash, tiers).
#[derive(Default, Clone)]
struct Model {
    ranks: Vec<HashMap<u64, (u64, u8)>>,
    /// Content hash -> full token path, for building queries from stored chains.
    paths: HashMap<u64, Vec<u32>>,
}

fn block_tokens(v: u8) -> Vec<u32> {
    (0..BS).map(|i| u32::from(v) * 10 + i).collect()
}

/// Engine hashes: ranks 0 and 1 share one scheme (same-seed engines), 2 and 3 use their own.
fn engine_of(slot: usize, content: u64) -> u64 {
    content ^ [0, 0, 0x5555, 0xaaaa_0000][slot]
}

struct Harness {
    w: IndexWriter,
    r: IndexReader,
    ids: Vec<RankId>,
    seq: i64,
}

impl Harness {
    fn new() -> Self {
        let (mut w, r) = PrefixIndex::new(IndexConfig {
            block_size: BS,
            shard_count: 4,
            max_carried_blocks: u64::MAX,
        });
        let ids = (0..RANKS as u32).map(|i| w.add_rank(rank_ref(i))).collect();
        Self { w, r, ids, seq: 0 }
    }
    fn event(&mut self, slot: usize, ev: KvEvent) {
        self.seq += 1;
        self.w
            .apply_batch(self.ids[slot], self.seq, &batch(vec![ev]));
    }
}

/// Turns an op into an event (using the model's knowledge) and applies it to the model.
fn step(model: &mut Model, op: &Op) -> (usize, Option<KvEvent>) {
    match op {
        Op::Store {
            rank,
            parent_pick,
            unknown_parent,
            blocks,
            medium,
        } => {
            let known: Vec<(u64, u64)> = {
                let mut v: Vec<(u64, u64)> = model.ranks[*rank]
                    .iter()
                    .map(|(e, (c, _))| (*e, *c))
                    .collect();
                v.sort_unstable();
                v
            };
            let (parent_engine, parent_content, mut path) = match parent_pick {
                Some(p) if !known.is_empty() => {
                    let (e, c) = known[p % known.len()];
                    (Some(e), Some(c), model.paths[&c].clone())
                }
                _ => (None, None, Vec::new()),
            };
            let parent_engine = if *unknown_parent {
                Some(0xdead_beef)
            } else {
                parent_engine
            };
            let medium = store_medium(*medium);
            let mut tokens = Vec::new();
            let mut hashes = Vec::new();
            let mut contents = Vec::new();
            let mut h = parent_content.unwrap_or(BASE_NAMESPACE);
            for &b in blocks {
                let bt = block_tokens(b);
                h = chain_hash(h, &bt, None);
                tokens.extend_from_slice(&bt);
                path.extend_from_slice(&bt);
                model.paths.entry(h).or_insert_with(|| path.clone());
                contents.push(h);
                hashes.push(engine_of(*rank, h));
            }
            let ev = stored(&hashes, parent_engine, tokens, BS, medium);
            let placeable = !*unknown_parent && bit(medium) != 0;
            if placeable {
                for (e, c) in hashes.iter().zip(&contents) {
                    model.ranks[*rank].entry(*e).or_insert((*c, 0)).1 |= bit(medium);
                }
            }
            (*rank, Some(ev))
        }
        Op::Remove {
            rank,
            picks,
            unknown,
            medium,
        } => {
            let mut known: Vec<u64> = model.ranks[*rank].keys().copied().collect();
            known.sort_unstable();
            let mut hashes: Vec<u64> = if known.is_empty() {
                Vec::new()
            } else {
                picks.iter().map(|p| known[p % known.len()]).collect()
            };
            if *unknown {
                hashes.push(0x1234_5678);
            }
            let medium = remove_medium(*medium);
            let mask = match medium {
                None | Some(Medium::Unknown) => 0x0f,
                m => bit(m),
            };
            for e in &hashes {
                if let Some(entry) = model.ranks[*rank].get_mut(e) {
                    entry.1 &= !mask;
                    if entry.1 == 0 {
                        model.ranks[*rank].remove(e);
                    }
                }
            }
            (*rank, Some(removed(&hashes, medium)))
        }
        Op::Clear { rank } => {
            model.ranks[*rank].clear();
            (*rank, Some(KvEvent::AllBlocksCleared))
        }
        Op::RemoveRank { rank } => {
            model.ranks[*rank].clear();
            (*rank, None)
        }
    }
}

fn apply(h: &mut Harness, slot: usize, ev: Option<KvEvent>) {
    match ev {
        Some(ev) => h.event(slot, ev),
        None => {
            h.w.remove_rank(h.ids[slot]);
            h.ids[slot] = h.w.add_rank(rank_ref(slot as u32));
        }
    }
}

fn model_match(model: &Model, slot: usize, q: &[u64]) -> (u32, u32) {
    let tiers_of = |c: u64| -> u8 {
        model.ranks[slot]
            .values()
            .filter(|(cc, _)| *cc == c)
            .fold(0, |a, (_, t)| a | t)
    };
    let (mut any, mut dev) = (0u32, 0u32);
    let mut dev_open = true;
    for &c in q {
        let t = tiers_of(c);
        if t == 0 {
            break;
        }
        any += 1;
        if dev_open && t & 1 != 0 {
            dev += 1;
        } else {
            dev_open = false;
        }
    }
    (any, dev)
}

fn index_matches(r: &IndexReader, q: &[u64]) -> HashMap<RankRef, (u32, u32)> {
    let mut m = PrefixMatch::new();
    r.match_prefix(q, &mut m);
    let refs: HashMap<RankId, RankRef> = r.ranks().into_iter().collect();
    m.ranks
        .iter()
        .map(|x| (refs[&x.rank].clone(), (x.matched_blocks, x.device_blocks)))
        .collect()
}

fn query_tokens(model: &Model, extra: &[(usize, Vec<u8>)]) -> Vec<Vec<u32>> {
    let mut paths: Vec<&Vec<u32>> = model.paths.values().collect();
    paths.sort();
    let mut out = Vec::new();
    for (pick, tail) in extra {
        let mut tokens = if paths.is_empty() {
            Vec::new()
        } else {
            paths[pick % paths.len()].clone()
        };
        for &b in tail {
            tokens.extend(block_tokens(b));
        }
        out.push(tokens);
    }
    out
}

fn queries(model: &Model, extra: &[(usize, Vec<u8>)]) -> Vec<Vec<u64>> {
    query_tokens(model, extra)
        .iter()
        .map(|t| hashes_of(t, BS))
        .collect()
}

fn check_against_model(h: &Harness, model: &Model, qs: &[Vec<u64>]) -> Result<(), TestCaseError> {
    for q in qs {
        let got = index_matches(&h.r, q);
        for slot in 0..RANKS {
            let want = model_match(model, slot, q);
            let have = got.get(&rank_ref(slot as u32)).copied().unwrap_or((0, 0));
            prop_assert_eq!(have, want, "rank slot {} query {:?}", slot, q);
        }
    }
    let mut total = 0;
    for slot in 0..RANKS {
        let st = h.r.rank_stats(h.ids[slot]).expect("registered");
        let carried = model.ranks[slot].len() as u64;
        let mut tiers = [0u64; 4];
        for (_, t) in model.ranks[slot].values() {
            for (b, x) in tiers.iter_mut().enumerate() {
                *x += u64::from(t >> b & 1);
            }
        }
        prop_assert_eq!(st.carried_blocks, carried, "carried of slot {}", slot);
        prop_assert_eq!(st.tier_blocks, tiers, "tiers of slot {}", slot);
        total += carried;
    }
    prop_assert_eq!(h.r.total_carried(), total);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_agree_with_a_brute_force_model(
        ops in prop::collection::vec(op_strategy(), 1..60),
        qs in prop::collection::vec((0usize..1000, prop::collection::vec(0u8..3, 0..3)), 1..12),
    ) {
        let mut model = Model { ranks: vec![HashMap::new(); RANKS], ..Model::default() };
        let mut h = Harness::new();
        for op in &ops {
            let (slot, ev) = step(&mut model, op);
            apply(&mut h, slot, ev);
        }
        let tq = query_tokens(&model, &qs);
        let qs = queries(&model, &qs);
        check_against_model(&h, &model, &qs)?;
        // The fused hash-and-match path must agree with hashing first.
        let (mut a, mut b, mut hs) = (PrefixMatch::new(), PrefixMatch::new(), Vec::new());
        for (t, q) in tq.iter().zip(&qs) {
            h.r.match_prefix(q, &mut a);
            h.r.match_tokens(t, BASE_NAMESPACE, &mut hs, &mut b);
            let (mut x, mut y) = (a.ranks.clone(), b.ranks.clone());
            x.sort_by_key(|m| m.rank);
            y.sort_by_key(|m| m.rank);
            prop_assert_eq!(x, y);
            prop_assert!(q.starts_with(&hs), "match_tokens hashes must be a prefix of all hashes");
        }
    }

    #[test]
    fn a_restored_snapshot_matches_and_evolves_like_the_original(
        before in prop::collection::vec(op_strategy(), 1..40),
        after in prop::collection::vec(op_strategy(), 0..30),
        qs in prop::collection::vec((0usize..1000, prop::collection::vec(0u8..3, 0..3)), 1..10),
    ) {
        let mut model = Model { ranks: vec![HashMap::new(); RANKS], ..Model::default() };
        let mut orig = Harness::new();
        for op in &before {
            let (slot, ev) = step(&mut model, op);
            apply(&mut orig, slot, ev);
        }
        let snap = orig.r.export_snapshot();
        prop_assert_eq!(snap.nodes.carried_blocks() as u64, orig.r.total_carried());
        let (mut w, r) = PrefixIndex::new(orig.w.config());
        let report = w.restore_snapshot(&snap).expect("own export restores");
        let mut copy = Harness { w, r, ids: report.rank_map.clone(), seq: orig.seq };
        // rank_map follows snapshot rank order, which is the original's id order.
        let order: Vec<RankRef> = snap.ranks.clone();
        for (slot, id) in copy.ids.iter_mut().enumerate() {
            let pos = order.iter().position(|x| *x == rank_ref(slot as u32)).expect("rank exported");
            *id = report.rank_map[pos];
        }
        for slot in 0..RANKS {
            let a = orig.r.rank_stats(orig.ids[slot]).unwrap();
            let b = copy.r.rank_stats(copy.ids[slot]).unwrap();
            prop_assert_eq!(a.carried_blocks, b.carried_blocks);
            prop_assert_eq!(a.tier_blocks, b.tier_blocks);
            prop_assert_eq!(a.cursor.map(|c| (c.seq, c.ts)), b.cursor.map(|c| (c.seq, c.ts)));
        }
        let q = queries(&model, &qs);
        check_against_model(&copy, &model, &q)?;
        for op in &after {
            let (slot, ev) = step(&mut model, op);
            apply(&mut orig, slot, ev.clone());
            apply(&mut copy, slot, ev);
        }
        let q = queries(&model, &qs);
        check_against_model(&orig, &model, &q)?;
        check_against_model(&copy, &model, &q)?;
    }

    #[test]
    fn retain_ranks_keeps_exactly_the_kept_ranks_blocks(
        ops in prop::collection::vec(op_strategy(), 1..50),
        keep_mask in 0u8..16,
        qs in prop::collection::vec((0usize..1000, prop::collection::vec(0u8..3, 0..3)), 1..10),
    ) {
        let mut model = Model { ranks: vec![HashMap::new(); RANKS], ..Model::default() };
        let mut h = Harness::new();
        for op in &ops {
            let (slot, ev) = step(&mut model, op);
            apply(&mut h, slot, ev);
        }
        let mut snap = h.r.export_snapshot();
        let kept = |r: &RankRef| (0..RANKS).any(|s| keep_mask >> s & 1 == 1 && *r == rank_ref(s as u32));
        retain_ranks(&mut snap, kept).expect("valid snapshot");
        prop_assert!(snap.ranks.iter().all(kept));
        let (mut w, r) = PrefixIndex::new(h.w.config());
        w.restore_snapshot(&snap).expect("filtered snapshot restores");
        let filtered: Vec<_> = r.ranks().into_iter().map(|(_, x)| x).collect();
        prop_assert!(filtered.iter().all(kept));
        // Build the expected model: dropped ranks carry nothing.
        let mut m2 = model.clone();
        for (slot, ranks) in m2.ranks.iter_mut().enumerate() {
            if keep_mask >> slot & 1 == 0 { ranks.clear(); }
        }
        for q in queries(&model, &qs) {
            let got = index_matches(&r, &q);
            for slot in 0..RANKS {
                let want = model_match(&m2, slot, &q);
                let have = got.get(&rank_ref(slot as u32)).copied().unwrap_or((0, 0));
                prop_assert_eq!(have, want);
            }
        }
        // No node survives without a carrier somewhere at or below it.
        prop_assert_eq!(r.node_count(), snap.nodes.len() as u64);
    }
}
