//! Time to warm: a replica joining a warm fleet, end to end on loopback.
//!
//! A simulated fleet (engines x DP ranks, every rank holding BLOCKS blocks in 100-block chains
//! whose first halves are shared by every rank) feeds router A until A's index holds it all. Then router B starts with A as its only
//! sibling while a background writer keeps storing one-block chains at EVENTS_PER_S batches per
//! second across the ranks (so B holds and splices live batches during its bootstrap). Reported:
//! the time from B's start (its workers are discovered and registered inside `serve`) to every
//! rank settled, the outcomes, and a check that B then answers a sample of queries like A.
//!
//! Both routers run in this process on the allocator the `kvroute` binary ships with (mimalloc):
//! a booting replica writes its whole index into fresh memory, so the allocator is part of what
//! is timed.
//!
//! Env: KVROUTE_WARM_ENGINES (8), KVROUTE_WARM_DP (8), KVROUTE_WARM_BLOCKS (100000, per rank),
//! KVROUTE_WARM_EVENTS_PER_S (10000; 0 = a quiet fleet). Run: `cargo bench -p kvroute --bench time_to_warm`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute::{RouterConfig, WorkerSpec};
use kvroute_index::hash::{BASE_NAMESPACE, hash_token_blocks};
use kvroute_index::{IndexReader, PrefixMatch};

/// The allocator of the `kvroute` binary (its `main.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Blocks stored per `store_chains` call (one published batch).
const BLOCKS_PER_BATCH: usize = 1_000;
/// Blocks per chain; chains of one family share their first half.
const CHAIN_BLOCKS: usize = 100;
/// Longest wait for A to index the fleet, and for B to settle.
const WAIT_MAX: Duration = Duration::from_secs(600);

fn chains_for(rank: usize, blocks: usize, block_size: usize) -> Vec<Vec<u32>> {
    let chains = blocks.div_ceil(CHAIN_BLOCKS);
    (0..chains)
        .map(|c| {
            // Chain c's first half is the same on every rank (a prefix shared fleet-wide, one
            // node carried by every rank); its second half is the rank's own.
            let family = c as u32;
            (0..CHAIN_BLOCKS * block_size)
                .map(|t| {
                    if t < CHAIN_BLOCKS * block_size / 2 {
                        1_000_000 + family * 10_000 + t as u32
                    } else {
                        50_000_000 + (rank as u32) * 1_000_000 + (c as u32) * 10_000 + t as u32
                    }
                })
                .collect()
        })
        .collect()
}

fn view(reader: &IndexReader, tokens: &[u32], bs: usize) -> BTreeMap<(String, u32), u32> {
    let names: BTreeMap<u32, (String, u32)> = reader
        .ranks()
        .into_iter()
        .map(|(id, r)| (id.0, (r.worker_url, r.dp_rank)))
        .collect();
    let mut hashes = Vec::new();
    hash_token_blocks(tokens, bs, BASE_NAMESPACE, &mut hashes);
    let mut out = PrefixMatch::new();
    reader.match_prefix(&hashes, &mut out);
    out.ranks
        .iter()
        .map(|m| (names[&m.rank.0].clone(), m.matched_blocks))
        .collect()
}

fn router_config(urls: &[String]) -> RouterConfig {
    RouterConfig {
        workers: urls
            .iter()
            .map(|u| WorkerSpec::parse(&format!("{u}@m")).expect("worker url"))
            .collect(),
        health_interval_ms: 600_000,
        ..RouterConfig::default()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // RUST_LOG=kvroute=info shows the bootstrap's timeline.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let engines = env("KVROUTE_WARM_ENGINES", 8);
    let dp = env("KVROUTE_WARM_DP", 8);
    let blocks = env("KVROUTE_WARM_BLOCKS", 100_000);
    let events_per_s = env("KVROUTE_WARM_EVENTS_PER_S", 10_000);
    let fleet = kvroute_sim::start_fleet(kvroute_sim::SimConfig {
        engines,
        dp_size: dp,
        served_model_name: "m".into(),
        capacity_blocks: blocks + blocks / 2 + 10_000,
        ..kvroute_sim::SimConfig::for_tests()
    })
    .await
    .expect("fleet starts");
    let urls: Vec<String> = fleet.engines.iter().map(|e| e.http_url()).collect();
    let bs = fleet.engines[0].block_size();
    let a = kvroute::serve(router_config(&urls))
        .await
        .expect("router A");
    let plane_a = a.router.kv.plane().clone();
    let ranks = engines * dp;
    let started = Instant::now();
    while plane_a
        .rank_states()
        .iter()
        .filter(|s| format!("{:?}", s.subscriber) == "Connected")
        .count()
        < ranks
    {
        assert!(
            started.elapsed() < WAIT_MAX,
            "A's subscribers never connected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fill = Instant::now();
    for (e, engine) in fleet.engines.iter().enumerate() {
        for r in 0..dp {
            let chains = chains_for(e * dp + r, blocks, bs);
            for batch in chains.chunks(BLOCKS_PER_BATCH / CHAIN_BLOCKS) {
                engine.store_chains(r, batch);
            }
        }
    }
    let reader_a = plane_a.model_view("m").expect("A indexes m").reader;
    let caught_up = |reader: &IndexReader| {
        let cursors: BTreeMap<(String, u32), i64> = reader
            .ranks()
            .into_iter()
            .filter_map(|(id, r)| {
                Some((
                    (r.worker_url, r.dp_rank),
                    reader.rank_stats(id)?.cursor?.seq,
                ))
            })
            .collect();
        fleet.engines.iter().all(|e| {
            (0..dp).all(|r| cursors.get(&(e.http_url(), r as u32)) == Some(&e.last_seq(r)))
        })
    };
    while !caught_up(&reader_a) {
        assert!(
            fill.elapsed() < WAIT_MAX,
            "A never caught up with the fleet"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "fleet: {engines} engines x {dp} ranks x {blocks} blocks; A indexed {} carried blocks, {} nodes in {:.1} s",
        reader_a.total_carried(),
        reader_a.node_count(),
        fill.elapsed().as_secs_f64()
    );

    // Live traffic during B's bootstrap: one-block chains, round robin over the ranks.
    let stop = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicU64::new(0));
    let writer = {
        let stop = stop.clone();
        let published = published.clone();
        let engines_h: Vec<_> = fleet.engines.iter().map(|e| e.engine().clone()).collect();
        std::thread::spawn(move || {
            let tick = Duration::from_millis(1);
            let per_tick = (events_per_s / 1000).max(1);
            let mut n: u64 = 0;
            let begin = Instant::now();
            while events_per_s > 0 && !stop.load(Ordering::Relaxed) {
                for _ in 0..per_tick {
                    let rank = (n as usize) % (engines_h.len() * dp);
                    let (e, r) = (rank / dp, rank % dp);
                    let chain: Vec<u32> = (0..bs as u32)
                        .map(|t| 900_000_000 + (n as u32) * 64 + t)
                        .collect();
                    engines_h[e].store_chains(r, &[chain]);
                    n += 1;
                }
                published.store(n, Ordering::Relaxed);
                let due = tick * u32::try_from(n / per_tick as u64).unwrap_or(u32::MAX);
                if let Some(wait) = due.checked_sub(begin.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let peer = kvroute_discovery::PeerUrl::parse(&a.internal_url()).expect("A's internal url");
    let b_started = Instant::now();
    let published_at_start = published.load(Ordering::Relaxed);
    let b = kvroute::serve(RouterConfig {
        peer_source: Some(kvroute_discovery::PeerSourceConfig::Static(
            kvroute_discovery::StaticPeers {
                peers: vec![peer],
                advertise_url: None,
            },
        )),
        ..router_config(&urls)
    })
    .await
    .expect("router B");
    let registered = b_started.elapsed();
    let plane_b = b.router.kv.plane().clone();
    let outcomes = loop {
        let states = plane_b.rank_states();
        let settled: Vec<String> = states
            .iter()
            .filter_map(|s| s.bootstrap.outcome().map(|o| o.label().to_string()))
            .collect();
        if states.len() == ranks && settled.len() == ranks {
            break settled;
        }
        assert!(
            b_started.elapsed() < WAIT_MAX,
            "B never settled: {} of {ranks}",
            settled.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let warm_after = b_started.elapsed();
    let metrics = reqwest::get(format!("{}/metrics", b.url()))
        .await
        .expect("B's metrics")
        .text()
        .await
        .expect("metrics text");
    for line in metrics.lines().filter(|l| {
        (l.starts_with("kvroute_bootstrap_") && !l.contains("_bucket"))
            || l.starts_with("kvroute_kv_grafts_total")
            || l.starts_with("kvroute_kv_graft_slice_seconds_sum")
            || l.starts_with("kvroute_kv_graft_slice_seconds_count")
    }) {
        println!("  B {line}");
    }
    let metrics_a = reqwest::get(format!("{}/metrics", a.url()))
        .await
        .expect("A's metrics")
        .text()
        .await
        .expect("metrics text");
    for line in metrics_a.lines().filter(|l| {
        l.starts_with("kvroute_snapshot_export_duration_seconds_sum")
            || l.starts_with("kvroute_snapshot_export_duration_seconds_count")
            || l.starts_with("kvroute_snapshot_encoded_bytes_sum")
            || l.starts_with("kvroute_snapshot_bytes_served_total")
    }) {
        println!("  A {line}");
    }
    let during = published.load(Ordering::Relaxed) - published_at_start;
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer thread");
    let mut by_outcome: BTreeMap<String, usize> = BTreeMap::new();
    for o in outcomes {
        *by_outcome.entry(o).or_default() += 1;
    }
    println!(
        "B: serve() returned after {:.3} s (workers registered); every rank settled {:.3} s after start; outcomes {by_outcome:?}; {during} live batches published meanwhile ({:.0}/s)",
        registered.as_secs_f64(),
        warm_after.as_secs_f64(),
        during as f64 / warm_after.as_secs_f64()
    );
    let warm = by_outcome
        .keys()
        .all(|o| matches!(o.as_str(), "warm" | "warm_unwitnessed" | "from_origin"));
    if !warm {
        println!("B is NOT warm on every rank: {by_outcome:?}; no equality check");
        b.shutdown().await;
        a.shutdown().await;
        fleet.shutdown().await;
        return;
    }
    // Correctness: once both caught up with the fleet, B answers like A.
    let reader_b = plane_b.model_view("m").expect("B indexes m").reader;
    let check = Instant::now();
    while !(caught_up(&reader_a) && caught_up(&reader_b)) {
        assert!(
            check.elapsed() < WAIT_MAX,
            "A and B never caught up after the traffic"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut same = 0;
    let mut hits = 0;
    for rank in (0..ranks).step_by((ranks / 16).max(1)) {
        for chain in chains_for(rank, blocks, bs).iter().step_by(97) {
            let va = view(&reader_a, chain, bs);
            let vb = view(&reader_b, chain, bs);
            hits += usize::from(!va.is_empty());
            same += usize::from(va == vb);
            assert_eq!(va, vb, "B differs from A on rank {rank}'s chain");
        }
    }
    println!(
        "B answers like A on {same} sampled chains ({hits} hit); carried blocks A {} / B {}",
        reader_a.total_carried(),
        reader_b.total_carried()
    );
    b.shutdown().await;
    a.shutdown().await;
    fleet.shutdown().await;
}
