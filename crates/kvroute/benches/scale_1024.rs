//! Scale past one machine's engines: a synthetic index of 1,024 ranks x 100,000 carried blocks
//! (the chat shape every index benchmark uses: a few hundred shared system prompts of 1k-4k
//! tokens, each rank's own conversations after them), no engines and no HTTP server. Reports:
//! * the index's memory (bytes the allocator handed it; goal <= 4 GB);
//! * the full routing decision's latency for 8,192-token prompts: hash the prompt, match it
//!   against the index, and let the cache_aware policy score EVERY rank (goal p99 <= 50 us),
//!   and how the calls over the goal spread over the prompts asked (a slow code path is one
//!   prompt slow every time; the machine's interruptions are single calls on any prompt);
//! * the snapshot a warm replica would serve: export, encode (binary, zstd), its size (goal
//!   <= 1.2 GB) and whether the default decode limits and `--kv-snapshot-max-bytes` admit it;
//! * time to warm, as the sum of the stages a joining replica runs one after another: export;
//!   the encode written straight onto a loopback socket while the other end decodes it as it
//!   arrives (the producer's and the fetch's paths: `encode_binary` into the socket,
//!   `decode_binary_stream` from it, neither side holding the body); the graft plan; and the
//!   sliced graft into an index whose ranks are registered and pending (goal <= 10 s). The
//!   service adds its vetting checks and interleaves live batches between slices; the whole path
//!   is measured at 64 ranks by `time_to_warm`. The encode into memory is timed too, for the
//!   body's size and as the reference for both sides' memory.
//!
//! Memory is counted on the allocator the `kvroute` binary ships with (mimalloc), which also
//! serves every allocation, so the times are those of the shipped allocator.
//!
//! One process plays both sides, so the consumer's graft can reuse memory the producer's index
//! freed just before, which a joining replica never can: `KVROUTE_SCALE_SNAPSHOT_OUT=<file>`
//! saves the encoded snapshot, and `KVROUTE_SCALE_SNAPSHOT_IN=<file>` runs the consumer alone
//! on it (decode from the file, plan, graft) in a fresh process.
//!
//! Run: `CARGO_PROFILE_BENCH_DEBUG=0 cargo bench -p kvroute --bench scale_1024`. Env:
//! KVROUTE_SCALE_RANKS (1024), KVROUTE_SCALE_BLOCKS (100000, per rank),
//! KVROUTE_SCALE_PLAN_LAYOUT (`0` grafts without the plan's shard layout, each shard sized to an
//! even share), KVROUTE_SCALE_DECISION_ONLY (`1` stops after the routing decision's figures).
//! Needs ~12 GB of memory at the default size (the index, its export and a grafted copy are
//! alive at once).

use std::alloc::{GlobalAlloc, Layout};
use std::io::Write;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::time::Instant;

use kvroute::routing::policy::{CostWeights, Policy, PolicyKind, RankInput};
use kvroute_index::hash::{BASE_NAMESPACE, hash_token_blocks};
use kvroute_index::{
    GRAFT_SLICE_ITEMS_MAX, GraftPlan, GraftProgress, IndexConfig, PrefixIndex, PrefixMatch,
};
use kvroute_snapshot::{Compression, DecodeLimits, EncodeOptions};
use kvroute_wire::snapshot::{IndexSnapshot, RankRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[path = "../../kvroute-index/benches/support/chat_shape.rs"]
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

/// Counts the bytes asked of the allocator the `kvroute` binary ships with (mimalloc, its
/// `main.rs`): building and grafting an index of gigabytes is mostly first touches of fresh
/// memory, and how an allocator gets and reuses it is part of the times measured.
struct Counting;

static SHIPPED: mimalloc::MiMalloc = mimalloc::MiMalloc;

static LIVE_BYTES: AtomicI64 = AtomicI64::new(0);
static PEAK_BYTES: AtomicI64 = AtomicI64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = LIVE_BYTES.fetch_add(layout.size() as i64, Relaxed) + layout.size() as i64;
        PEAK_BYTES.fetch_max(now, Relaxed);
        unsafe { SHIPPED.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as i64, Relaxed);
        unsafe { SHIPPED.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let delta = new_size as i64 - layout.size() as i64;
        let now = LIVE_BYTES.fetch_add(delta, Relaxed) + delta;
        PEAK_BYTES.fetch_max(now, Relaxed);
        unsafe { SHIPPED.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const PROMPT_BLOCKS: usize = 512; // 8,192 tokens
const QUERIES: usize = 20_000;
/// The goal for the decision's p99, in nanoseconds.
const DECISION_GOAL_NS: u64 = 50_000;
/// The snapshot's HMAC key: the service signs whenever an internal token is configured.
const MAC_KEY: &[u8] = b"0123456789abcdef-scale-bench";
const WARMUP_QUERIES: usize = 2_000;
/// The timed decodes run without ceilings: whether the default limits admit this snapshot is
/// reported separately, and the stage times must not depend on them.
const UNCAPPED_DECODE: DecodeLimits = DecodeLimits {
    max_nodes: usize::MAX,
    max_carriers: usize::MAX,
    max_ranks: usize::MAX,
    max_bytes: usize::MAX,
};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Binary, zstd, signed: what a sibling asks for and gets.
fn encode_options() -> EncodeOptions<'static> {
    EncodeOptions {
        compression: Compression::Zstd,
        mac_key: Some(MAC_KEY),
    }
}

/// How a decision's latency spreads over the prompts that were asked: whether the calls over
/// the goal come from a few prompts (a slow path in the code) or from anywhere (the machine).
struct PromptSpread {
    /// The largest per-prompt median, and that prompt's p90.
    slowest_median_ns: u64,
    slowest_p90_ns: u64,
    /// Prompts with at least one call over the goal, and the most such calls on one prompt.
    prompts_over_goal: usize,
    most_over_goal_on_one: usize,
}

impl PromptSpread {
    fn of(per_prompt_ns: &mut [Vec<u64>], goal_ns: u64) -> Self {
        let mut spread = PromptSpread {
            slowest_median_ns: 0,
            slowest_p90_ns: 0,
            prompts_over_goal: 0,
            most_over_goal_on_one: 0,
        };
        for calls in per_prompt_ns.iter_mut().filter(|c| !c.is_empty()) {
            calls.sort_unstable();
            let median = percentile(calls, 0.50);
            if median > spread.slowest_median_ns {
                spread.slowest_median_ns = median;
                spread.slowest_p90_ns = percentile(calls, 0.90);
            }
            let over = calls.iter().filter(|&&ns| ns > goal_ns).count();
            spread.prompts_over_goal += usize::from(over > 0);
            spread.most_over_goal_on_one = spread.most_over_goal_on_one.max(over);
        }
        spread
    }
}

fn gb(bytes: i64) -> f64 {
    bytes as f64 / 1e9
}

fn main() {
    if let Ok(path) = std::env::var("KVROUTE_SCALE_SNAPSHOT_IN") {
        consume_saved_snapshot(&path);
        return;
    }
    let ranks = env("KVROUTE_SCALE_RANKS", 1024) as u32;
    let blocks = env("KVROUTE_SCALE_BLOCKS", 100_000);
    let mut rng = StdRng::seed_from_u64(7);
    let base = LIVE_BYTES.load(Relaxed);
    let built = Instant::now();
    let (mut w, r) = PrefixIndex::new(IndexConfig {
        max_carried_blocks: u64::MAX,
        ..IndexConfig::new(BLOCK_SIZE)
    });
    let mut convs: Vec<support::Conversation> = Vec::new();
    let mut engine_seq: u64 = 1;
    for rank in 0..ranks {
        let id = w.add_rank(RankRef {
            worker_url: format!(
                "http://10.{}.{}.{}:8000",
                rank >> 16,
                (rank >> 8) & 255,
                rank & 255
            ),
            dp_rank: 0,
        });
        support::chat_rank(
            &mut rng,
            &mut engine_seq,
            0,
            rank,
            blocks,
            |ev| {
                w.apply_event(id, &ev);
            },
            |c| {
                // Kept only for a sample of ranks, so the query set costs no memory to speak of.
                if rank % 16 == 0 {
                    convs.push(c);
                }
            },
        );
        w.set_cursor(id, Some((1, 1.0)));
    }
    let convs_bytes = (convs.capacity() * std::mem::size_of::<support::Conversation>()) as i64;
    let index_bytes = LIVE_BYTES.load(Relaxed) - base - convs_bytes;
    let carried = r.total_carried();
    let nodes = r.node_count();
    println!(
        "index: {ranks} ranks x {blocks} blocks: {carried} carried pairs, {nodes} nodes, built in {:.1} s",
        built.elapsed().as_secs_f64()
    );
    println!(
        "memory: {:.2} GB allocated by the index ({:.1} B per carried pair) [goal <= 4 GB]",
        gb(index_bytes),
        index_bytes as f64 / carried as f64
    );

    // The routing decision: hash, match, score every rank.
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
    let policy = Policy::new(PolicyKind::CacheAware, CostWeights::default(), Some(11));
    let idle = RankInput {
        matched_blocks: 0,
        device_blocks: 0,
        pending_blocks: 0,
        in_flight: 0,
        queued_prefill_tokens: 0,
        prefill_backlog_us: f64::INFINITY,
        engine: None,
        cache_room_tokens: kvroute::routing::policy::CacheRoom::UNKNOWN,
    };
    let mut inputs = vec![idle; ranks as usize];
    let mut load_rng = StdRng::seed_from_u64(3);
    for input in &mut inputs {
        input.in_flight = load_rng.random_range(0..8);
        input.queued_prefill_tokens = load_rng.random_range(0..20_000);
    }
    let mut hashes = Vec::with_capacity(PROMPT_BLOCKS);
    let mut out = PrefixMatch::new();
    let mut lat_ns = Vec::with_capacity(QUERIES);
    let mut match_ns = Vec::with_capacity(QUERIES);
    let mut decide_ns = Vec::with_capacity(QUERIES);
    let mut best_sum = 0u64;
    // Each prompt's own latencies: a slow code path shows as a prompt slow every time it runs;
    // the machine's interruptions as single slow calls spread over many prompts. Sized up front,
    // so the loop allocates nothing between its timed calls.
    let mut per_prompt_ns: Vec<Vec<u64>> = (0..prompts.len())
        .map(|_| Vec::with_capacity(QUERIES / prompts.len() + 1))
        .collect();
    let mut matching_ranks_sum = 0u64;
    for i in 0..QUERIES + WARMUP_QUERIES {
        let toks = &prompts[i % prompts.len()];
        let t0 = Instant::now();
        hash_token_blocks(toks, BLOCK_SIZE as usize, BASE_NAMESPACE, &mut hashes);
        r.match_prefix(&hashes, &mut out);
        let matched_at = t0.elapsed().as_nanos() as u64;
        for m in &out.ranks {
            let input = &mut inputs[m.rank.0 as usize];
            input.matched_blocks = m.matched_blocks;
            input.device_blocks = m.device_blocks;
        }
        let decision = policy.decide(&inputs, toks.len(), BLOCK_SIZE as usize);
        let dt = t0.elapsed().as_nanos() as u64;
        if i >= WARMUP_QUERIES {
            match_ns.push(matched_at);
            decide_ns.push(dt - matched_at);
            matching_ranks_sum += out.ranks.len() as u64;
        }
        for m in &out.ranks {
            let input = &mut inputs[m.rank.0 as usize];
            input.matched_blocks = 0;
            input.device_blocks = 0;
        }
        if i >= WARMUP_QUERIES {
            per_prompt_ns[i % prompts.len()].push(dt);
            lat_ns.push(dt);
            best_sum += u64::from(out.max_matched_blocks());
            std::hint::black_box(decision.order.first());
        }
    }
    lat_ns.sort_unstable();
    match_ns.sort_unstable();
    decide_ns.sort_unstable();
    println!(
        "  of which hash + match_prefix: p50 {:.1} us, p99 {:.1} us ({:.0} ranks match block 0 on average)",
        percentile(&match_ns, 0.50) as f64 / 1e3,
        percentile(&match_ns, 0.99) as f64 / 1e3,
        matching_ranks_sum as f64 / QUERIES as f64
    );
    println!(
        "  of which scoring and ordering (policy.decide over {ranks} ranks): p50 {:.1} us, p99 {:.1} us",
        percentile(&decide_ns, 0.50) as f64 / 1e3,
        percentile(&decide_ns, 0.99) as f64 / 1e3,
    );
    println!(
        "routing decision (8,192 tokens: hash + match + cache_aware scoring of all {ranks} ranks, {} calls): p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, p99.9 {:.1} us [goal p99 <= 50 us]; mean best depth {:.0} blocks",
        lat_ns.len(),
        percentile(&lat_ns, 0.50) as f64 / 1e3,
        percentile(&lat_ns, 0.90) as f64 / 1e3,
        percentile(&lat_ns, 0.99) as f64 / 1e3,
        percentile(&lat_ns, 0.999) as f64 / 1e3,
        best_sum as f64 / QUERIES as f64
    );
    // A decision the machine interrupts (a timer tick every 4 ms at HZ=250, a vCPU descheduled)
    // lands far above the rest: how many did is what decides whether p99 is a clean one.
    let over_goal = lat_ns.iter().filter(|&&ns| ns > DECISION_GOAL_NS).count();
    println!(
        "  decisions over {} us: {over_goal} of {} ({:.2} %)",
        DECISION_GOAL_NS / 1_000,
        lat_ns.len(),
        over_goal as f64 * 100.0 / lat_ns.len() as f64
    );
    let by_prompt = PromptSpread::of(&mut per_prompt_ns, DECISION_GOAL_NS);
    println!(
        "  per prompt ({} prompts, ~{} calls each): the slowest prompt's median {:.1} us and p90 {:.1} us; the calls over {} us fall on {} prompts, at most {} on one",
        per_prompt_ns.len(),
        lat_ns.len() / per_prompt_ns.len().max(1),
        by_prompt.slowest_median_ns as f64 / 1e3,
        by_prompt.slowest_p90_ns as f64 / 1e3,
        DECISION_GOAL_NS / 1_000,
        by_prompt.prompts_over_goal,
        by_prompt.most_over_goal_on_one,
    );

    if std::env::var("KVROUTE_SCALE_DECISION_ONLY").as_deref() == Ok("1") {
        return;
    }

    // The joining replica's path, stage by stage.
    let t = Instant::now();
    let mut snapshot = r.export_snapshot();
    snapshot.producer_ready = true;
    let export_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut encoded = Vec::new();
    kvroute_snapshot::encode_binary(&snapshot, &encode_options(), &mut encoded)
        .expect("the export encodes");
    let encode_s = t.elapsed().as_secs_f64();
    let snapshot_nodes = snapshot.nodes.len();
    println!(
        "snapshot: {snapshot_nodes} nodes; export {export_s:.2} s, encode into memory (binary, zstd, HMAC) {encode_s:.2} s, {:.3} GB on the wire [goal <= 1.2 GB]; admitted by the default --kv-snapshot-max-bytes ({} B): {}",
        encoded.len() as f64 / 1e9,
        kvroute::config::DEFAULT_KV_SNAPSHOT_MAX_BYTES,
        encoded.len() <= kvroute::config::DEFAULT_KV_SNAPSHOT_MAX_BYTES
    );
    if let Ok(path) = std::env::var("KVROUTE_SCALE_SNAPSHOT_OUT") {
        std::fs::write(&path, &encoded).expect("the snapshot is saved");
    }
    // The index is dropped before the consumer side is built, as on a real joining replica
    // (the producer is another process, and what it streams from is the export).
    drop(w);
    drop(r);

    // The reference: the in-memory decode of the whole body, which a fetch that buffers the body
    // also pays the received copy on top of.
    let live_before_whole = LIVE_BYTES.load(Relaxed);
    PEAK_BYTES.store(live_before_whole, Relaxed);
    let defaults = DecodeLimits::default();
    let t = Instant::now();
    let default_verdict = kvroute_snapshot::decode_binary(&encoded, &defaults, Some(MAC_KEY))
        .map(|_| "yes".to_string())
        .unwrap_or_else(|e| format!("NO ({e})"));
    let whole_decode_s = t.elapsed().as_secs_f64();
    let whole_peak = PEAK_BYTES.load(Relaxed) - live_before_whole;
    let encoded_len = encoded.len();
    drop(encoded);

    // The producer alone, streaming: what encoding onto a socket holds above the export.
    let live_before_encode = LIVE_BYTES.load(Relaxed);
    PEAK_BYTES.store(live_before_encode, Relaxed);
    let mut sink = std::io::BufWriter::with_capacity(
        kvroute::peer::producer::SNAPSHOT_STREAM_CHUNK_BYTES,
        std::io::sink(),
    );
    kvroute_snapshot::encode_binary(&snapshot, &encode_options(), &mut sink)
        .expect("the export encodes");
    drop(sink);
    let producer_peak = PEAK_BYTES.load(Relaxed) - live_before_encode;

    // Encode, transfer and decode overlap, as between a producer and a joining replica: one
    // thread encodes onto the socket, the other decodes from it as the bytes arrive.
    let live_before_stream = LIVE_BYTES.load(Relaxed);
    PEAK_BYTES.store(live_before_stream, Relaxed);
    let t = Instant::now();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("loopback listener");
    let addr = listener.local_addr().expect("address");
    let sender = std::thread::spawn(move || {
        let (conn, _) = listener.accept().expect("accept");
        let mut conn = std::io::BufWriter::with_capacity(
            kvroute::peer::producer::SNAPSHOT_STREAM_CHUNK_BYTES,
            conn,
        );
        kvroute_snapshot::encode_binary(&snapshot, &encode_options(), &mut conn)
            .expect("the export encodes onto the socket");
        conn.flush().expect("send");
        // Handed back so that it is freed after the consumer's memory is read.
        snapshot
    });
    let decoded = kvroute_snapshot::decode_binary_stream(
        std::net::TcpStream::connect(addr).expect("connect"),
        &UNCAPPED_DECODE,
        Some(MAC_KEY),
    )
    .expect("the snapshot decodes");
    let stream_s = t.elapsed().as_secs_f64();
    let snapshot = sender.join().expect("sender");
    let streamed_peak = PEAK_BYTES.load(Relaxed) - live_before_stream;
    let decoded_bytes = LIVE_BYTES.load(Relaxed) - live_before_stream;
    drop(snapshot);
    println!(
        "memory while streaming: the producer's encode holds {:.1} MB above its export (the body encoded into memory: {:.2} GB); the consumer's decode, with the producer's encode beside it, {:.2} GB above what was live (the decoded columns are {:.2} GB of it); the in-memory decode of the same bytes {:.2} GB, plus the {:.2} GB received copy a buffering fetch holds",
        producer_peak as f64 / 1e6,
        encoded_len as f64 / 1e9,
        gb(streamed_peak),
        gb(decoded_bytes),
        gb(whole_peak),
        encoded_len as f64 / 1e9
    );
    let Grafted {
        plan_s,
        graft_s,
        slices,
        carried: grafted_carried,
    } = plan_and_graft(decoded);
    assert_eq!(
        grafted_carried, carried,
        "the grafted index carries the same pairs"
    );
    println!(
        "encode onto a loopback socket while the other end decodes {stream_s:.2} s, against encode into memory {encode_s:.2} s + decode of the whole body {whole_decode_s:.2} s in sequence (admitted by the default decode limits: {default_verdict}); graft plan {plan_s:.2} s; graft {graft_s:.2} s in {}",
        slices.describe()
    );
    let total = export_s + stream_s + plan_s + graft_s;
    println!(
        "time to warm (stages in sequence: export + encode, transfer and decode overlapped + plan + graft): {total:.1} s [goal <= 10 s]"
    );
    println!(
        "peak bytes allocated by this process: {:.2} GB",
        gb(PEAK_BYTES.load(Relaxed))
    );
}

/// What the consumer's last two stages took.
struct Grafted {
    plan_s: f64,
    graft_s: f64,
    slices: SliceTimes,
    carried: u64,
}

/// How long the graft's slices held the writer: each is time a live batch of another rank may
/// wait behind it.
struct SliceTimes {
    sorted_us: Vec<u64>,
}

/// The wait a live batch may have behind a slice at 64 ranks (the live-apply bound).
const SLICE_BUDGET_US: u64 = 50_000;

impl SliceTimes {
    fn describe(&self) -> String {
        let over = self
            .sorted_us
            .iter()
            .filter(|&&us| us > SLICE_BUDGET_US)
            .count();
        format!(
            "{} slices (p99 {:.1} ms, longest {:.1} ms, {over} over {} ms)",
            self.sorted_us.len(),
            percentile(&self.sorted_us, 0.99) as f64 / 1e3,
            self.sorted_us.last().copied().unwrap_or(0) as f64 / 1e3,
            SLICE_BUDGET_US / 1_000
        )
    }
}

/// The consumer's own stages: the graft plan (validation and the engine-hash check, off the
/// writer), then the graft into an index where the ranks are registered and pending, run slice
/// after slice as the pump runs it (here with nothing to interleave).
fn plan_and_graft(decoded: IndexSnapshot) -> Grafted {
    let (mut w2, r2) = PrefixIndex::new(IndexConfig {
        max_carried_blocks: u64::MAX,
        ..IndexConfig::new(BLOCK_SIZE)
    });
    let t = Instant::now();
    // As the service does; KVROUTE_SCALE_PLAN_LAYOUT=0 leaves the layout out, to compare with
    // shards sized to an even share.
    let plan = if std::env::var("KVROUTE_SCALE_PLAN_LAYOUT").as_deref() != Ok("0") {
        GraftPlan::new_laid_out(decoded, BLOCK_SIZE, |_| true, &r2)
    } else {
        GraftPlan::new(decoded, BLOCK_SIZE, |_| true)
    }
    .expect("the snapshot plans");
    let plan_s = t.elapsed().as_secs_f64();
    let pending: Vec<_> = plan
        .ranks()
        .iter()
        .map(|r| w2.add_rank(r.clone()))
        .collect();
    let t = Instant::now();
    // As the service does: the slabs' chunks and the side tables are made on another thread
    // while the writer grafts (KVROUTE_SCALE_GRAFT_ROOM=0 leaves it out).
    let room = plan
        .room()
        .filter(|_| std::env::var("KVROUTE_SCALE_GRAFT_ROOM").as_deref() != Ok("0"));
    let helper = room.map(|room| std::thread::spawn(move || room.prepare()));
    let mut job = w2.begin_graft(plan, &pending).expect("the graft begins");
    let mut slice_us = Vec::new();
    loop {
        let slice = Instant::now();
        let progress = w2
            .graft_step(&mut job, GRAFT_SLICE_ITEMS_MAX)
            .expect("own job");
        slice_us.push(slice.elapsed().as_micros() as u64);
        if let GraftProgress::Done(_) = progress {
            break;
        }
    }
    let graft_s = t.elapsed().as_secs_f64();
    drop(job);
    if let Some(made) = helper.and_then(|h| h.join().ok()) {
        println!(
            "graft room: {} slab chunks, {} carrier lists and {} side tables ({:.2} GB) made beside the writer in {:.2} s{}",
            made.chunks_made,
            made.lists_made,
            made.side_tables_made,
            made.bytes_made as f64 / 1e9,
            made.seconds,
            if made.stopped_early {
                ", stopped when the graft ended"
            } else {
                ""
            }
        );
    }
    slice_us.sort_unstable();
    Grafted {
        plan_s,
        graft_s,
        slices: SliceTimes {
            sorted_us: slice_us,
        },
        carried: r2.total_carried(),
    }
}

/// `KVROUTE_SCALE_SNAPSHOT_IN`: the consumer alone, in a process that never held the warm index,
/// as a joining replica is: decode the saved snapshot from its file as it is read, plan, graft.
fn consume_saved_snapshot(path: &str) {
    let file = std::fs::File::open(path).expect("the saved snapshot opens");
    let t = Instant::now();
    let decoded = kvroute_snapshot::decode_binary_stream(
        std::io::BufReader::with_capacity(
            kvroute::peer::producer::SNAPSHOT_STREAM_CHUNK_BYTES,
            file,
        ),
        &UNCAPPED_DECODE,
        Some(MAC_KEY),
    )
    .expect("the saved snapshot decodes");
    let decode_s = t.elapsed().as_secs_f64();
    let nodes = decoded.nodes.len();
    let grafted = plan_and_graft(decoded);
    println!(
        "consumer alone (a process that never held the warm index): decode from the file {decode_s:.2} s, graft plan {:.2} s, graft {:.2} s in {} of {nodes} nodes and {} carried pairs; peak bytes allocated {:.2} GB",
        grafted.plan_s,
        grafted.graft_s,
        grafted.slices.describe(),
        grafted.carried,
        gb(PEAK_BYTES.load(Relaxed))
    );
}
