//! Size and speed of the snapshot encodings on a realistic fleet-sized index.
//!
//! Shape (see `build_fleet_snapshot`): 64 ranks, each carrying 100,000 blocks (6.4 M carried
//! (rank, block) pairs). A few hundred shared system-prompt chains of 64-256 blocks are carried
//! by many ranks each (popularity skewed, and each carrier holding a prefix of the chain because
//! LRU eviction trims tails first); per-rank conversation chains of 8-128 blocks extend them (or
//! fork earlier conversations), 15% of them also cached on a second rank, 5% of conversations
//! offloaded to host memory. Nodes are emitted in creation order, so parents precede children.
//! Engine hashes are modelled both ways: vLLM (per-process seed: a different random hash per
//! (rank, block)) and SGLang (content-derived: every rank shares one hash per block).
//!
//! Run: `cargo bench -p kvroute-snapshot --bench snapshot_codec`. Sizes are printed first (one
//! pass each, into counting writers), then criterion times encode+compress (starting from the
//! `IndexSnapshot`: the index walk is excluded) and decode, on one thread.

use std::hint::black_box;
use std::io::Write;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_snapshot::{
    CompressingWriter, Compression, DecodeLimits, EncodeOptions, decode_binary, encode_binary,
    encode_binary_to_vec, encode_json,
};
use kvroute_wire::snapshot::{
    IndexSnapshot, NO_PARENT, RankCursor, RankRef, SNAPSHOT_FORMAT, SnapshotNodes,
};

const RANKS: usize = 64;
const CARRIED_PER_RANK: usize = 100_000;

/// The knobs that decide how much of the index is shared, which is what decides bytes per
/// carried block: every node costs an 8-byte content hash, every distinct engine hash 8 more.
#[derive(Clone, Copy, Debug)]
struct Shape {
    name: &'static str,
    system_prompts: usize,
    /// Ranks carrying a prompt: `min_carriers + (63 - min_carriers) * u^skew`, u uniform.
    min_carriers: usize,
    popularity_skew: i32,
    conversation_blocks: (u64, u64),
    /// Percent of conversations also cached on a second rank.
    replicated_percent: u64,
}

/// Chat fleet: conversations dominate and live on one rank; prompts mostly on a few ranks.
const CHAT: Shape = Shape {
    name: "chat",
    system_prompts: 300,
    min_carriers: 1,
    popularity_skew: 3,
    conversation_blocks: (8, 128),
    replicated_percent: 15,
};

/// Agent/RAG fleet: long shared tool+instruction prefixes on many ranks, short per-session tails.
const SHARED_HEAVY: Shape = Shape {
    name: "shared-heavy",
    system_prompts: 600,
    min_carriers: 8,
    popularity_skew: 1,
    conversation_blocks: (8, 32),
    replicated_percent: 40,
};
const BENCH_KEY: &[u8] = b"bench-shared-secret-32-bytes-xx!";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum EngineHashes {
    /// vLLM: each rank hashes with its own seed, so one block has a different hash per rank.
    PerRankRandom,
    /// SGLang: the hash is derived from content, so all ranks agree per block.
    SharedPerBlock,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn range(&mut self, lo: u64, hi_inclusive: u64) -> u64 {
        lo + self.next() % (hi_inclusive - lo + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

struct Builder {
    nodes: SnapshotNodes,
    carried: Vec<usize>,
    rng: Rng,
    hashes: EngineHashes,
}

impl Builder {
    fn push(&mut self, parent: u32, ranks: &[u32], tier: u8) -> u32 {
        let id = self.nodes.parent.len() as u32;
        self.nodes.parent.push(parent);
        self.nodes.content_hash.push(self.rng.next());
        let shared = self.rng.next();
        for &rank in ranks {
            self.nodes.carrier_rank.push(rank);
            self.nodes.carrier_tiers.push(tier);
            let hash = match self.hashes {
                EngineHashes::PerRankRandom => self.rng.next(),
                EngineHashes::SharedPerBlock => shared,
            };
            self.nodes.carrier_engine_hash.push(hash);
            self.carried[rank as usize] += 1;
        }
        self.nodes
            .carrier_end
            .push(self.nodes.carrier_rank.len() as u32);
        id
    }
}

fn build_fleet_snapshot(shape: Shape, hashes: EngineHashes) -> IndexSnapshot {
    let mut b = Builder {
        nodes: SnapshotNodes::default(),
        carried: vec![0; RANKS],
        rng: Rng(0x6b76_726f_7574_6521),
        hashes,
    };
    // Per rank: (node ids of the prompt chain it holds, up to its depth) for conversation roots.
    let mut rank_prompt_tails: Vec<Vec<u32>> = vec![Vec::new(); RANKS];
    for _ in 0..shape.system_prompts {
        let len = b.rng.range(64, 256) as usize;
        // Skewed popularity: with skew > 1 most prompts sit on a handful of ranks, a few on
        // nearly all of them.
        let u = (b.rng.next() % 1000) as f64 / 1000.0;
        let spread = (RANKS - shape.min_carriers) as f64;
        let k = shape.min_carriers + (spread * u.powi(shape.popularity_skew)) as usize;
        let mut carriers: Vec<u32> = (0..RANKS as u32).collect();
        for i in 0..k {
            let j = i + (b.rng.next() as usize) % (RANKS - i);
            carriers.swap(i, j);
        }
        let mut carriers: Vec<(u32, usize)> = carriers[..k]
            .iter()
            .map(|&r| {
                let depth = if b.rng.chance(50) {
                    len
                } else {
                    b.rng.range(len as u64 / 2, len as u64) as usize
                };
                (r, depth)
            })
            .collect();
        carriers.sort_unstable();
        let mut parent = NO_PARENT;
        let mut ranks_here: Vec<u32> = Vec::with_capacity(k);
        for depth in 0..len {
            ranks_here.clear();
            ranks_here.extend(carriers.iter().filter(|c| c.1 > depth).map(|c| c.0));
            parent = b.push(parent, &ranks_here, 1);
            for c in carriers.iter().filter(|c| c.1 == depth + 1) {
                rank_prompt_tails[c.0 as usize].push(parent);
            }
        }
    }
    // Conversations, round-robin over ranks until each carries its quota.
    let mut rank_conversation_nodes: Vec<Vec<u32>> = vec![Vec::new(); RANKS];
    loop {
        let mut progressed = false;
        for rank in 0..RANKS as u32 {
            if b.carried[rank as usize] >= CARRIED_PER_RANK {
                continue;
            }
            progressed = true;
            let own = &rank_conversation_nodes[rank as usize];
            let tails = &rank_prompt_tails[rank as usize];
            let attach = if !own.is_empty() && b.rng.chance(30) {
                own[(b.rng.next() as usize) % own.len()]
            } else if !tails.is_empty() && b.rng.chance(90) {
                tails[(b.rng.next() as usize) % tails.len()]
            } else {
                NO_PARENT
            };
            let mut ranks = vec![rank];
            if b.rng.chance(shape.replicated_percent) {
                let other = (rank + 1 + (b.rng.next() % (RANKS as u64 - 1)) as u32) % RANKS as u32;
                ranks.push(other);
                ranks.sort_unstable();
            }
            let tier = if b.rng.chance(5) { 2 } else { 1 };
            let room = CARRIED_PER_RANK - b.carried[rank as usize];
            let (lo, hi) = shape.conversation_blocks;
            let len = (b.rng.range(lo, hi) as usize).min(room);
            let mut parent = attach;
            for _ in 0..len {
                parent = b.push(parent, &ranks, tier);
                rank_conversation_nodes[rank as usize].push(parent);
            }
        }
        if !progressed {
            break;
        }
    }
    IndexSnapshot {
        format: SNAPSHOT_FORMAT,
        hash_scheme: "kvroute-xxh3-chain-v1".to_owned(),
        block_size: 16,
        producer_ready: true,
        ranks: (0..RANKS)
            .map(|i| RankRef {
                worker_url: format!("http://10.0.{}.{}:8000", i / 8, i % 8 + 10),
                dp_rank: (i % 8) as u32,
            })
            .collect(),
        cursors: (0..RANKS as u32)
            .map(|rank| RankCursor {
                rank,
                seq: 1_000_000 + i64::from(rank),
                ts: 1_764_467_000.25 + f64::from(rank),
            })
            .collect(),
        empty_ranks: Vec::new(),
        partial_ranks: vec![],
        nodes: b.nodes,
    }
}

/// Engine hashes the encoding must carry: one per node when all its carriers agree, else one
/// per carrier.
fn distinct_engine_hashes(snapshot: &IndexSnapshot) -> usize {
    let nodes = &snapshot.nodes;
    let mut start = 0usize;
    let mut total = 0;
    for &end in &nodes.carrier_end {
        let hashes = &nodes.carrier_engine_hash[start..end as usize];
        total += match hashes.split_first() {
            None => 0,
            Some((first, rest)) if rest.iter().all(|h| h == first) => 1,
            Some(_) => hashes.len(),
        };
        start = end as usize;
    }
    total
}

/// Counts bytes without keeping them, so the ~0.5 GB JSON never sits in memory.
struct CountingWriter(u64);

impl Write for CountingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn json_bytes(snapshot: &IndexSnapshot, compression: Compression) -> u64 {
    let counter = CompressingWriter::new(CountingWriter(0), compression).unwrap();
    let mut buffered = std::io::BufWriter::with_capacity(1 << 16, counter);
    encode_json(snapshot, &mut buffered).unwrap();
    let counter = buffered.into_inner().ok().unwrap();
    counter.finish().unwrap().0
}

fn print_sizes(name: &str, snapshot: &IndexSnapshot) {
    let nodes = snapshot.nodes.len();
    let carried = snapshot.nodes.carried_blocks();
    let distinct_engine_hashes = distinct_engine_hashes(snapshot);
    eprintln!(
        "\n[{name}] nodes {nodes}, carried (rank, block) {carried}, carriers/node {:.2}, \
         floor (8 B per content hash + 8 B per distinct engine hash per node) {:.2} B/carried",
        carried as f64 / nodes as f64,
        (8 * nodes + 8 * distinct_engine_hashes) as f64 / carried as f64
    );
    let per = |bytes: u64| bytes as f64 / carried as f64;
    for (label, compression, key) in [
        ("binary", Compression::None, None),
        ("binary+zstd", Compression::Zstd, None),
        ("binary+gzip", Compression::Gzip, None),
        ("binary+zstd+hmac", Compression::Zstd, Some(BENCH_KEY)),
    ] {
        let started = Instant::now();
        let stats = encode_binary(
            snapshot,
            &EncodeOptions {
                compression,
                mac_key: key,
            },
            CountingWriter(0),
        )
        .unwrap();
        eprintln!(
            "  {label:<18} {:>12} bytes  {:>6.2} B/carried  (one pass {:>6.0} ms)",
            stats.wire_bytes,
            per(stats.wire_bytes),
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    for (label, compression) in [
        ("json", Compression::None),
        ("json+gzip", Compression::Gzip),
        ("json+zstd", Compression::Zstd),
    ] {
        let started = Instant::now();
        let bytes = json_bytes(snapshot, compression);
        eprintln!(
            "  {label:<18} {bytes:>12} bytes  {:>6.2} B/carried  (one pass {:>6.0} ms)",
            per(bytes),
            started.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// Why the crate's levels are what they are: the same uncompressed body through each level.
fn print_level_sweep(snapshot: &IndexSnapshot) {
    let body = encode_binary_to_vec(snapshot, &EncodeOptions::default()).unwrap();
    let carried = snapshot.nodes.carried_blocks() as f64;
    eprintln!(
        "  level sweep over the {} byte uncompressed encoding:",
        body.len()
    );
    for level in [1, 3, 6] {
        let started = Instant::now();
        let out = zstd::bulk::compress(&body, level).unwrap();
        eprintln!(
            "    zstd {level}: {:>6.2} B/carried in {:>6.0} ms",
            out.len() as f64 / carried,
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    for level in [1, 6] {
        let started = Instant::now();
        let mut gz =
            flate2::write::GzEncoder::new(CountingWriter(0), flate2::Compression::new(level));
        gz.write_all(&body).unwrap();
        let out = gz.finish().unwrap().0;
        eprintln!(
            "    gzip {level}: {:>6.2} B/carried in {:>6.0} ms",
            out as f64 / carried,
            started.elapsed().as_secs_f64() * 1e3
        );
    }
}

fn bench_codecs(c: &mut Criterion) {
    for (shape, hashes) in [
        (CHAT, EngineHashes::PerRankRandom),
        (CHAT, EngineHashes::SharedPerBlock),
        (SHARED_HEAVY, EngineHashes::PerRankRandom),
        (SHARED_HEAVY, EngineHashes::SharedPerBlock),
    ] {
        let engine = match hashes {
            EngineHashes::PerRankRandom => "vllm",
            EngineHashes::SharedPerBlock => "sglang",
        };
        let name = format!("{}_{engine}", shape.name);
        let snapshot = build_fleet_snapshot(shape, hashes);
        print_sizes(&name, &snapshot);
        if shape.name == CHAT.name && hashes == EngineHashes::PerRankRandom {
            print_level_sweep(&snapshot);
        }
        if shape.name != CHAT.name {
            // Timings are taken on the chat shape: more nodes per carried block, so slower.
            continue;
        }
        let carried = snapshot.nodes.carried_blocks() as u64;
        let mut group = c.benchmark_group(format!("snapshot_{name}"));
        group.sample_size(10);
        group.throughput(Throughput::Elements(carried));
        for (label, compression, key) in [
            ("encode_binary", Compression::None, None),
            ("encode_binary_zstd", Compression::Zstd, None),
            (
                "encode_binary_zstd_hmac",
                Compression::Zstd,
                Some(BENCH_KEY),
            ),
            ("encode_binary_gzip", Compression::Gzip, None),
        ] {
            let options = EncodeOptions {
                compression,
                mac_key: key,
            };
            group.bench_function(label, |bench| {
                bench.iter(|| encode_binary(black_box(&snapshot), &options, CountingWriter(0)))
            });
        }
        let zstd = encode_binary_to_vec(
            &snapshot,
            &EncodeOptions {
                compression: Compression::Zstd,
                mac_key: Some(BENCH_KEY),
            },
        )
        .unwrap();
        group.bench_function("decode_binary_zstd_hmac", |bench| {
            bench.iter(|| {
                decode_binary(black_box(&zstd), &DecodeLimits::default(), Some(BENCH_KEY)).unwrap()
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench_codecs);
criterion_main!(benches);
