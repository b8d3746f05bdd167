//! Custom harness (criterion reports means; routing cares about tails). Builds ONE realistic index
//! (64 ranks x ~100,000 carried blocks, block size 16, a few hundred shared system prompts of
//! 1-4k tokens extended by per-rank conversations) and reports:
//! * bytes allocated per carried (rank, block) pair, via a counting global allocator
//!   (target <= 40 B);
//! * `match_prefix` latency for 8,192-token prompts INCLUDING `hash_token_blocks`, p50/p99/p99.9
//!   over many calls on one thread (target p99 <= 20 us), and the same for the fused
//!   `match_tokens` (hashes a batch at a time and stops hashing where the match ends);
//! * export and restore throughput in carried blocks/s (target >= 10 M/s each way);
//! * `match_prefix` again on the index restored from the export, as a booting replica would
//!   route.
//!
//! Token content is derived from small seeds so the generator keeps no token arrays around that
//! would pollute the memory figure.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::time::Instant;

use kvroute_index::hash::{BASE_NAMESPACE, hash_token_blocks};
use kvroute_index::{IndexConfig, PrefixIndex, PrefixMatch};
use kvroute_wire::snapshot::RankRef;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[path = "support/chat_shape.rs"]
mod support;

use support::{BLOCK_SIZE, Draws, percentile};

impl Draws for StdRng {
    fn unit(&mut self) -> f64 {
        self.random()
    }
    fn tail_blocks(&mut self) -> usize {
        self.random_range(16..=160usize)
    }
}

struct Counting;

static LIVE_BYTES: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards to the system allocator; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(l.size() as i64, Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE_BYTES.fetch_sub(l.size() as i64, Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new as i64 - l.size() as i64, Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const RANKS: u32 = 64;
const BLOCKS_PER_RANK: u64 = 100_000;
const PROMPT_BLOCKS: usize = 512; // 8,192 tokens
const QUERIES: usize = 20_000;

fn main() {
    // `cargo bench` passes `--bench`; ignore arguments.
    let mut rng = StdRng::seed_from_u64(7);
    let base_bytes = LIVE_BYTES.load(Relaxed);
    let t_build = Instant::now();
    let (mut w, r) = PrefixIndex::new(IndexConfig {
        max_carried_blocks: u64::MAX,
        ..IndexConfig::new(BLOCK_SIZE)
    });
    let mut convs: Vec<support::Conversation> = Vec::new();
    let mut engine_seq: u64 = 1;
    for rank in 0..RANKS {
        let id = w.add_rank(RankRef {
            worker_url: format!("http://10.0.0.{rank}:8000"),
            dp_rank: 0,
        });
        support::chat_rank(
            &mut rng,
            &mut engine_seq,
            0,
            rank,
            BLOCKS_PER_RANK,
            |ev| {
                w.apply_event(id, &ev);
            },
            |c| convs.push(c),
        );
    }
    let build_s = t_build.elapsed().as_secs_f64();
    let convs_bytes = (convs.capacity() * std::mem::size_of::<support::Conversation>()) as i64;
    let index_bytes = LIVE_BYTES.load(Relaxed) - base_bytes - convs_bytes;
    let carried = r.total_carried();
    let nodes = r.node_count();
    println!(
        "index: {RANKS} ranks, {carried} carried (rank, block) pairs, {nodes} nodes, built in {build_s:.2} s ({:.2} M blocks/s incl. event construction)",
        carried as f64 / build_s / 1e6
    );
    println!(
        "memory: {} bytes allocated by the index = {:.1} bytes per carried pair ({:.1} per node)",
        index_bytes,
        index_bytes as f64 / carried as f64,
        index_bytes as f64 / nodes as f64
    );

    let mem = r.memory();
    let side = w.side_map_bytes();
    let per = |b: u64| b as f64 / carried as f64;
    println!(
        "  breakdown per carried pair: node slab {:.1} B, hash slots {:.1} B, multi-carrier lists {:.1} B, side maps {:.1} B (estimate), free lists {:.1} B",
        per(mem.node_slab_bytes),
        per(mem.hash_slot_bytes),
        per(mem.carrier_list_bytes),
        per(side),
        per(mem.free_list_bytes)
    );

    // Queries: 8,192 tokens each. 50% continue an existing conversation, 30% start a known
    // system prompt with new content, 20% are entirely new.
    let mut prompts: Vec<Vec<u32>> = Vec::with_capacity(256);
    for q in 0..256u64 {
        let kind: f64 = rng.random();
        prompts.push(support::chat_query(
            &convs,
            q,
            PROMPT_BLOCKS * BLOCK_SIZE as usize,
            kind,
            |n| rng.random_range(0..n),
        ));
    }
    let mut hashes = Vec::with_capacity(PROMPT_BLOCKS);
    let mut out = PrefixMatch::new();
    let mut lat_ns = Vec::with_capacity(QUERIES);
    let mut matched_sum = 0u64;
    for i in 0..QUERIES + 2_000 {
        let toks = &prompts[i % prompts.len()];
        let t0 = Instant::now();
        hash_token_blocks(toks, BLOCK_SIZE as usize, BASE_NAMESPACE, &mut hashes);
        r.match_prefix(&hashes, &mut out);
        let dt = t0.elapsed().as_nanos() as u64;
        if i >= 2_000 {
            lat_ns.push(dt);
            matched_sum += u64::from(out.max_matched_blocks());
        }
    }
    lat_ns.sort_unstable();
    println!(
        "match_prefix (8,192 tokens, hashing included, {} calls): p50 {:.2} us, p90 {:.2} us, p99 {:.2} us, p99.9 {:.2} us, max {:.2} us; mean best depth {:.0} blocks",
        lat_ns.len(),
        percentile(&lat_ns, 0.50) as f64 / 1e3,
        percentile(&lat_ns, 0.90) as f64 / 1e3,
        percentile(&lat_ns, 0.99) as f64 / 1e3,
        percentile(&lat_ns, 0.999) as f64 / 1e3,
        *lat_ns.last().expect("calls") as f64 / 1e3,
        matched_sum as f64 / QUERIES as f64
    );
    let mut fused_ns = Vec::with_capacity(QUERIES);
    let mut fused_hashed = 0u64;
    for i in 0..QUERIES + 2_000 {
        let toks = &prompts[i % prompts.len()];
        let t0 = Instant::now();
        r.match_tokens(toks, BASE_NAMESPACE, &mut hashes, &mut out);
        let dt = t0.elapsed().as_nanos() as u64;
        if i >= 2_000 {
            fused_ns.push(dt);
            fused_hashed += hashes.len() as u64;
        }
    }
    fused_ns.sort_unstable();
    println!(
        "match_tokens (fused hash+match, same prompts, {} calls): p50 {:.2} us, p90 {:.2} us, p99 {:.2} us, p99.9 {:.2} us, max {:.2} us; mean blocks hashed {:.0}",
        fused_ns.len(),
        percentile(&fused_ns, 0.50) as f64 / 1e3,
        percentile(&fused_ns, 0.90) as f64 / 1e3,
        percentile(&fused_ns, 0.99) as f64 / 1e3,
        percentile(&fused_ns, 0.999) as f64 / 1e3,
        *fused_ns.last().expect("calls") as f64 / 1e3,
        fused_hashed as f64 / QUERIES as f64
    );
    // Cache-warm floor: the deepest-matching prompt repeated, so its nodes stay in cache. The gap
    // to the figures above is memory latency (the index is ~10x the L3 of this machine).
    let deepest = prompts
        .iter()
        .max_by_key(|t| {
            hash_token_blocks(t, BLOCK_SIZE as usize, BASE_NAMESPACE, &mut hashes);
            r.match_prefix(&hashes, &mut out);
            out.max_matched_blocks()
        })
        .expect("prompts");
    let mut warm = Vec::with_capacity(2_000);
    for _ in 0..2_000 {
        let t0 = Instant::now();
        hash_token_blocks(deepest, BLOCK_SIZE as usize, BASE_NAMESPACE, &mut hashes);
        r.match_prefix(&hashes, &mut out);
        warm.push(t0.elapsed().as_nanos() as u64);
    }
    warm.sort_unstable();
    println!(
        "  cache-warm floor (deepest prompt, {} blocks matched, repeated): p50 {:.2} us, p99 {:.2} us",
        out.max_matched_blocks(),
        percentile(&warm, 0.5) as f64 / 1e3,
        percentile(&warm, 0.99) as f64 / 1e3
    );
    let mut hash_only = Vec::with_capacity(2_000);
    for toks in prompts.iter().cycle().take(2_000) {
        let t0 = Instant::now();
        hash_token_blocks(toks, BLOCK_SIZE as usize, BASE_NAMESPACE, &mut hashes);
        hash_only.push(t0.elapsed().as_nanos() as u64);
    }
    hash_only.sort_unstable();
    println!(
        "  of which hash_token_blocks alone: p50 {:.2} us, p99 {:.2} us",
        percentile(&hash_only, 0.5) as f64 / 1e3,
        percentile(&hash_only, 0.99) as f64 / 1e3
    );

    // Export / restore, best of 3.
    let mut best_export = f64::MAX;
    let mut snap = None;
    for _ in 0..3 {
        let t0 = Instant::now();
        let s = r.export_snapshot();
        best_export = best_export.min(t0.elapsed().as_secs_f64());
        snap = Some(s);
    }
    let snap = snap.expect("exported");
    assert_eq!(snap.nodes.carried_blocks() as u64, carried);
    println!(
        "export: {} nodes / {} carriers in {:.3} s = {:.1} M carried blocks/s",
        snap.nodes.len(),
        snap.nodes.carried_blocks(),
        best_export,
        carried as f64 / best_export / 1e6
    );
    drop(w);
    drop(r);
    let mut best_restore = f64::MAX;
    let mut restored = None;
    for _ in 0..3 {
        let (mut w2, r2) = PrefixIndex::new(IndexConfig {
            max_carried_blocks: u64::MAX,
            ..IndexConfig::new(BLOCK_SIZE)
        });
        // The previous copy is freed first so at most two indexes are alive at once.
        drop(restored.take());
        let t0 = Instant::now();
        w2.restore_snapshot(&snap).expect("own snapshot restores");
        best_restore = best_restore.min(t0.elapsed().as_secs_f64());
        assert_eq!(r2.total_carried(), carried);
        restored = Some((w2, r2));
    }
    println!(
        "restore: {:.3} s = {:.1} M carried blocks/s",
        best_restore,
        carried as f64 / best_restore / 1e6
    );

    // A replica that booted from the snapshot routes on the RESTORED layout: the same queries
    // against it, so a slab layout that only a live build produces cannot flatter the figure.
    let (_w2, r2) = restored.expect("restored");
    let mut restored_ns = Vec::with_capacity(QUERIES);
    let mut restored_matched = 0u64;
    for i in 0..QUERIES + 2_000 {
        let toks = &prompts[i % prompts.len()];
        let t0 = Instant::now();
        hash_token_blocks(toks, BLOCK_SIZE as usize, BASE_NAMESPACE, &mut hashes);
        r2.match_prefix(&hashes, &mut out);
        let dt = t0.elapsed().as_nanos() as u64;
        if i >= 2_000 {
            restored_ns.push(dt);
            restored_matched += u64::from(out.max_matched_blocks());
        }
    }
    assert_eq!(
        restored_matched, matched_sum,
        "the restored index answers the same best depths as the original"
    );
    restored_ns.sort_unstable();
    println!(
        "match_prefix on the restored index (same prompts, hashing included, {} calls): p50 {:.2} us, p90 {:.2} us, p99 {:.2} us, p99.9 {:.2} us",
        restored_ns.len(),
        percentile(&restored_ns, 0.50) as f64 / 1e3,
        percentile(&restored_ns, 0.90) as f64 / 1e3,
        percentile(&restored_ns, 0.99) as f64 / 1e3,
        percentile(&restored_ns, 0.999) as f64 / 1e3,
    );
}
