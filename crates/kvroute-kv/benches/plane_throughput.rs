//! End-to-end KV-plane figures against a simulated engine in the same process (custom harness:
//! the interesting numbers are a rate and a latency distribution, not a mean per call).
//!
//! * ingest: the engine publishes `BURST_BATCHES` batches back to back (each one chain of
//!   `BLOCKS_PER_BATCH` blocks of 16 tokens, SGLang encoding: one BlockStored per block); measured
//!   from the first publish until the plane's cursor reaches the last seq, so it includes ZMQ
//!   transport, decode in the subscriber task, the pump and the index writes. Batches the PUB drops
//!   under the burst are recovered by replay and included in the time.
//! * gap repair: the engine withholds `GAP_BATCHES` batches from its PUB, then publishes one more;
//!   measured from that publish until the cursor reaches it (detect gap -> replay over DEALER ->
//!   apply replayed + held).
//!
//! Engine and router share the machine's 2 cores (and the same tokio runtime), so these are
//! conservative figures; when the plane keeps pace, the ingest rate is the simulator's publish
//! rate and the "lag" figure is what the plane itself adds. Run: `cargo bench -p kvroute-kv --bench plane_throughput`.

use std::time::{Duration, Instant};

use kvroute_kv::{KvPlane, KvPlaneConfig, fetch_worker_info};
use kvroute_sim::{SimConfig, start_fleet};

const BLOCK_SIZE: usize = 16;
const BLOCKS_PER_BATCH: u32 = 4;
const BURST_BATCHES: u32 = 20_000;
const BURST_ROUNDS: u32 = 5;
const GAP_BATCHES: u64 = 8;
const GAP_TRIALS: u32 = 200;
const WAIT_MS: u64 = 60_000;

fn chain(tag: u32) -> Vec<u32> {
    (0..BLOCKS_PER_BATCH * BLOCK_SIZE as u32)
        .map(|i| tag.wrapping_mul(1_000).wrapping_add(i))
        .collect()
}

async fn wait_cursor(plane: &KvPlane, url: &str, seq: i64) {
    let deadline = Instant::now() + Duration::from_millis(WAIT_MS);
    loop {
        let cursor = plane
            .rank_states()
            .into_iter()
            .find(|s| s.worker_url == url)
            .and_then(|s| s.cursor);
        if cursor == Some(seq) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "cursor never reached {seq}; last seen {cursor:?}"
        );
        tokio::task::yield_now().await;
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let fleet = start_fleet(SimConfig {
            block_size: BLOCK_SIZE,
            // Large enough that the burst does not turn into eviction traffic.
            capacity_blocks: (BURST_BATCHES * BLOCKS_PER_BATCH) as usize * 2,
            replay_buffer_batches: BURST_BATCHES as usize,
            ..SimConfig::for_tests()
        })
        .await
        .expect("fleet");
        let engine = &fleet.engines[0];
        let url = engine.http_url();
        let registry = prometheus::Registry::new();
        let plane = KvPlane::new(KvPlaneConfig::default(), &registry).expect("plane");
        let kv = fetch_worker_info(&reqwest::Client::new(), &url)
            .await
            .expect("info")
            .kv_events
            .expect("kv");
        plane.add_worker(&url, "m", kv).await.expect("add");
        // Past the slow-joiner window.
        let mut tag = 1u32;
        loop {
            let seq = engine.store_chains(0, &[chain(tag)]);
            tag += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            let s = plane.rank_states().into_iter().next().unwrap();
            if s.cursor == Some(seq) {
                break;
            }
        }

        for round in 0..BURST_ROUNDS {
            let start = Instant::now();
            let mut last = 0;
            for _ in 0..BURST_BATCHES {
                last = engine.store_chains(0, &[chain(tag)]);
                tag += 1;
            }
            let published = start.elapsed();
            wait_cursor(&plane, &url, last).await;
            let took = start.elapsed();
            let s = plane.rank_states().into_iter().next().unwrap();
            println!(
                "ingest round {round}: {BURST_BATCHES} batches ({} blocks) in {:.1} ms \
                 (publishing took {:.1} ms; plane lag after the last publish {:.1} ms) \
                 = {:.0} batches/s, {:.0} blocks/s; cumulative replays {}, lost {}",
                BURST_BATCHES * BLOCKS_PER_BATCH,
                took.as_secs_f64() * 1e3,
                published.as_secs_f64() * 1e3,
                (took - published).as_secs_f64() * 1e3,
                f64::from(BURST_BATCHES) / took.as_secs_f64(),
                f64::from(BURST_BATCHES * BLOCKS_PER_BATCH) / took.as_secs_f64(),
                s.replays,
                s.lost_batches
            );
        }

        let mut repairs = Vec::with_capacity(GAP_TRIALS as usize);
        for _ in 0..GAP_TRIALS {
            engine.drop_next(0, GAP_BATCHES);
            for _ in 0..GAP_BATCHES {
                engine.store_chains(0, &[chain(tag)]);
                tag += 1;
            }
            let start = Instant::now();
            let last = engine.store_chains(0, &[chain(tag)]);
            tag += 1;
            wait_cursor(&plane, &url, last).await;
            repairs.push(start.elapsed());
        }
        repairs.sort();
        let s = plane.rank_states().into_iter().next().unwrap();
        println!(
            "gap repair ({GAP_BATCHES} withheld batches, {GAP_TRIALS} trials): p50 {:.2} ms, \
             p99 {:.2} ms, max {:.2} ms; lost batches total {}",
            percentile(&repairs, 0.5).as_secs_f64() * 1e3,
            percentile(&repairs, 0.99).as_secs_f64() * 1e3,
            repairs.last().unwrap().as_secs_f64() * 1e3,
            s.lost_batches
        );
        plane.shutdown().await;
        fleet.shutdown().await;
    });
}
