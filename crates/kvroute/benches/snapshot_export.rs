//! Custom harness for the producer side of `GET /internal/kv_snapshot` (routing cares about
//! tails, and the export is one long operation, so criterion's means are the wrong tool).
//!
//! Run: `cargo bench -p kvroute --bench snapshot_export`.
//!
//! Builds ONE realistic index directly through `IndexWriter` (64 ranks x ~100,000 carried
//! blocks, block size 16, 300 shared system prompts of 1k-4k tokens with skewed popularity,
//! extended by per-rank conversations; vLLM-style engine hashes: shared prompts share theirs,
//! conversation blocks are unique) and reports:
//! 1. the export end to end on one thread, split into walk (`export_snapshot`), binary encode
//!    (uncompressed) and compression (binary+zstd minus binary), plus the service's own
//!    `encode_variant_into` path, and the wire bytes per carried block of binary+zstd vs JSON;
//! 2. `hash_token_blocks` + `match_prefix` latency percentiles on one thread with no export
//!    running, then with another thread exporting and encoding (binary+zstd) in a loop, in the
//!    same run, alternating phases so machine noise hits both. A "without" phase starts only
//!    once the exporter is idle, so an export finishing late cannot leak into it.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use kvroute::peer::producer::{SnapshotFormat, encode_variant_into};
use kvroute_index::hash::{BASE_NAMESPACE, hash_token_blocks};
use kvroute_index::{IndexConfig, IndexReader, PrefixIndex, PrefixMatch};
use kvroute_snapshot::{Compression, EncodeOptions};
use kvroute_wire::event::{BlockStored, EngineHash, KvEvent};
use kvroute_wire::snapshot::RankRef;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BLOCK_SIZE: u32 = 16;
const RANKS: u32 = 64;
const BLOCKS_PER_RANK: u64 = 100_000;
const SYSTEM_PROMPTS: u32 = 300;
const BLOCKS_PER_EVENT: usize = 16;
const QUERY_BLOCKS: usize = 512;
const QUERIES_PER_PHASE: usize = 40_000;
const PHASE_PAIRS: usize = 3;
const EXPORT_RUNS: usize = 3;

fn token(seed: u64, pos: u64) -> u32 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ pos.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    z ^= z >> 32;
    (z % 128_000) as u32
}

/// A well-mixed 64-bit value: engine block hashes are random-looking on the wire, and sequential
/// ones would compress to nothing and flatter the byte figure.
fn mix64(seed: u64, pos: u64) -> u64 {
    let mut z = seed ^ pos.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn prompt_blocks(p: u32) -> usize {
    64 + (p as usize * 37) % 193
}

fn prompt_seed(p: u32) -> u64 {
    1 << 40 | u64::from(p)
}

fn store(hashes: Vec<EngineHash>, parent: Option<EngineHash>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::BlockStored(BlockStored::new(hashes, parent, tokens, BLOCK_SIZE))
}

/// (prompt, conversation seed, conversation blocks) of every stored conversation.
type Conv = (u32, u64, usize);

fn build_index() -> (IndexReader, Vec<Conv>) {
    let mut rng = StdRng::seed_from_u64(7);
    let (mut w, r) = PrefixIndex::new(IndexConfig {
        max_carried_blocks: u64::MAX,
        ..IndexConfig::new(BLOCK_SIZE)
    });
    let mut convs = Vec::new();
    let mut next_hash: u64 = 1;
    for rank in 0..RANKS {
        let id = w.add_rank(RankRef {
            worker_url: format!("http://10.0.{}.{}:8000", rank / 8, rank % 8),
            dp_rank: rank % 8,
        });
        let mut seq = 0i64;
        let mut prompt_tail: Vec<Option<EngineHash>> = vec![None; SYSTEM_PROMPTS as usize];
        let mut carried = 0u64;
        let mut conv = 0u64;
        while carried < BLOCKS_PER_RANK {
            let u: f64 = rng.random();
            let p = ((u * u * u) * f64::from(SYSTEM_PROMPTS)) as u32 % SYSTEM_PROMPTS;
            let tail_of_prompt = match prompt_tail[p as usize] {
                Some(h) => h,
                None => {
                    let n = prompt_blocks(p);
                    let mut parent = None;
                    for start in (0..n).step_by(BLOCKS_PER_EVENT) {
                        let k = BLOCKS_PER_EVENT.min(n - start);
                        let hashes: Vec<EngineHash> = (0..k)
                            .map(|i| EngineHash(mix64(prompt_seed(p), (start + i) as u64)))
                            .collect();
                        let tokens = (0..(k * BLOCK_SIZE as usize) as u64)
                            .map(|t| token(prompt_seed(p), start as u64 * 16 + t))
                            .collect();
                        let last = hashes[k - 1];
                        seq += 1;
                        w.apply_event(id, &store(hashes, parent, tokens));
                        parent = Some(last);
                    }
                    carried += n as u64;
                    prompt_tail[p as usize] = parent;
                    parent.expect("prompt has blocks")
                }
            };
            let tail = rng.random_range(16..=160usize);
            let seed = 2 << 40 | u64::from(rank) << 24 | conv;
            conv += 1;
            let mut parent = Some(tail_of_prompt);
            for start in (0..tail).step_by(BLOCKS_PER_EVENT) {
                let k = BLOCKS_PER_EVENT.min(tail - start);
                let hashes: Vec<EngineHash> = (0..k)
                    .map(|_| {
                        next_hash += 1;
                        EngineHash(mix64(3 << 40, next_hash))
                    })
                    .collect();
                let tokens = (0..(k * BLOCK_SIZE as usize) as u64)
                    .map(|t| token(seed, start as u64 * 16 + t))
                    .collect();
                let last = hashes[k - 1];
                seq += 1;
                w.apply_event(id, &store(hashes, parent, tokens));
                parent = Some(last);
            }
            w.set_cursor(id, Some((seq, 1.0)));
            carried += tail as u64;
            convs.push((p, seed, tail));
        }
    }
    (r, convs)
}

fn query_tokens(convs: &[Conv], rng: &mut StdRng) -> Vec<u32> {
    let (p, seed, tail) = convs[rng.random_range(0..convs.len())];
    let mut t: Vec<u32> = (0..(prompt_blocks(p) * 16) as u64)
        .map(|i| token(prompt_seed(p), i))
        .collect();
    if rng.random_bool(0.6) {
        t.extend((0..(tail * 16) as u64).map(|i| token(seed, i)));
    }
    let fresh: u64 = rng.random();
    let mut i = 0;
    while t.len() < QUERY_BLOCKS * BLOCK_SIZE as usize {
        t.push(token(fresh, i));
        i += 1;
    }
    t.truncate(QUERY_BLOCKS * BLOCK_SIZE as usize);
    t
}

struct Counter(u64);
impl Write for Counter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len() as u64;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)] as f64 / 1000.0
}

fn main() {
    let t = Instant::now();
    let (reader, convs) = build_index();
    let carried = reader.total_carried();
    println!(
        "index: {RANKS} ranks, {carried} carried blocks, {} nodes, built in {:.1} s",
        reader.node_count(),
        t.elapsed().as_secs_f64()
    );

    // 1. Export end to end, one thread.
    let (mut walk, mut bin, mut zstd, mut variant, mut variant_mac) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut sizes = (0u64, 0u64, 0u64, 0u64);
    let key = b"bench-internal-token-0123456789";
    for _ in 0..EXPORT_RUNS {
        let t = Instant::now();
        let snap = reader.export_snapshot();
        walk.push(t.elapsed().as_secs_f64());
        let mut c = Counter(0);
        let t = Instant::now();
        kvroute_snapshot::encode_binary(&snap, &EncodeOptions::default(), &mut c).unwrap();
        bin.push(t.elapsed().as_secs_f64());
        sizes.0 = c.0;
        let mut c = Counter(0);
        let t = Instant::now();
        kvroute_snapshot::encode_binary(
            &snap,
            &EncodeOptions {
                compression: Compression::Zstd,
                mac_key: None,
            },
            &mut c,
        )
        .unwrap();
        zstd.push(t.elapsed().as_secs_f64());
        sizes.1 = c.0;
        let t = Instant::now();
        let mut b = Vec::new();
        encode_variant_into(
            &snap,
            SnapshotFormat::Binary,
            Compression::Zstd,
            None,
            &mut b,
        )
        .unwrap();
        variant.push(t.elapsed().as_secs_f64());
        drop(b);
        let t = Instant::now();
        let mut b = Vec::new();
        encode_variant_into(
            &snap,
            SnapshotFormat::Binary,
            Compression::Zstd,
            Some(key),
            &mut b,
        )
        .unwrap();
        variant_mac.push(t.elapsed().as_secs_f64());
        drop(b);
    }
    let snap = reader.export_snapshot();
    let carried_snap = snap.nodes.carried_blocks() as f64;
    let mut c = Counter(0);
    kvroute_snapshot::encode_json(&snap, std::io::BufWriter::new(&mut c)).unwrap();
    sizes.2 = c.0;
    let mut c = Counter(0);
    {
        let mut w = kvroute_snapshot::CompressingWriter::new(&mut c, Compression::Zstd).unwrap();
        kvroute_snapshot::encode_json(&snap, std::io::BufWriter::new(&mut w)).unwrap();
        w.finish().unwrap();
    }
    sizes.3 = c.0;
    drop(snap);
    let (walk, bin, zstd) = (median(walk), median(bin), median(zstd));
    println!(
        "export (median of {EXPORT_RUNS}): walk {:.0} ms, binary encode {:.0} ms, zstd compression {:.0} ms (binary+zstd {:.0} ms); end to end walk+encode+compress {:.0} ms",
        walk * 1e3,
        bin * 1e3,
        (zstd - bin) * 1e3,
        zstd * 1e3,
        (walk + zstd) * 1e3
    );
    println!(
        "service path encode_variant_into(binary, zstd), into memory: {:.0} ms, with HMAC {:.0} ms",
        median(variant) * 1e3,
        median(variant_mac) * 1e3
    );
    println!(
        "wire bytes per carried block ({carried_snap} carried): binary {:.2}, binary+zstd {:.2} ({:.1} MB), JSON {:.2} ({:.1} MB), JSON+zstd {:.2}",
        sizes.0 as f64 / carried_snap,
        sizes.1 as f64 / carried_snap,
        sizes.1 as f64 / 1e6,
        sizes.2 as f64 / carried_snap,
        sizes.2 as f64 / 1e6,
        sizes.3 as f64 / carried_snap
    );

    // 2. Routing latency with and without a concurrent export.
    let mut rng = StdRng::seed_from_u64(11);
    let queries: Vec<Vec<u32>> = (0..4_096).map(|_| query_tokens(&convs, &mut rng)).collect();
    let exporting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let exports_done = Arc::new(AtomicU64::new(0));
    let busy = Arc::new(AtomicBool::new(false));
    let exporter = {
        let (reader, exporting, stop, done, busy) = (
            reader.clone(),
            exporting.clone(),
            stop.clone(),
            exports_done.clone(),
            busy.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                if exporting.load(Relaxed) {
                    busy.store(true, Relaxed);
                    let snap = reader.export_snapshot();
                    let mut b = Vec::new();
                    encode_variant_into(
                        &snap,
                        SnapshotFormat::Binary,
                        Compression::Zstd,
                        None,
                        &mut b,
                    )
                    .unwrap();
                    std::hint::black_box(b.len());
                    done.fetch_add(1, Relaxed);
                    busy.store(false, Relaxed);
                } else {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        })
    };
    let mut hashes = Vec::new();
    let mut out = PrefixMatch::new();
    let mut without = Vec::new();
    let mut with = Vec::new();
    let mut qi = 0usize;
    let mut depth_sum = 0u64;
    for _ in 0..PHASE_PAIRS {
        for (flag, sink) in [(false, &mut without), (true, &mut with)] {
            exporting.store(flag, Relaxed);
            while !flag && busy.load(Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if flag {
                // Let the exporter get going before measuring.
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            for _ in 0..QUERIES_PER_PHASE {
                let q = &queries[qi % queries.len()];
                qi += 1;
                let t = Instant::now();
                hash_token_blocks(q, BLOCK_SIZE as usize, BASE_NAMESPACE, &mut hashes);
                reader.match_prefix(&hashes, &mut out);
                sink.push(t.elapsed().as_nanos() as u64);
                depth_sum += u64::from(out.max_matched_blocks());
            }
        }
    }
    exporting.store(false, Relaxed);
    stop.store(true, Relaxed);
    exporter.join().unwrap();
    without.sort_unstable();
    with.sort_unstable();
    println!(
        "routing (hash 512 blocks + match_prefix), {} calls per side, mean best depth {:.0} blocks, {} exports ran concurrently:",
        without.len(),
        depth_sum as f64 / qi as f64,
        exports_done.load(Relaxed)
    );
    for (name, v) in [("without export", &without), ("during export ", &with)] {
        println!(
            "  {name}: p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, p99.9 {:.1} us",
            pct(v, 0.5),
            pct(v, 0.9),
            pct(v, 0.99),
            pct(v, 0.999)
        );
    }
    println!(
        "  p99 change during export: {:+.1}%",
        (pct(&with, 0.99) / pct(&without, 0.99) - 1.0) * 100.0
    );
}
