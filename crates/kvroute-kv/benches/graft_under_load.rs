//! A sibling's snapshot grafted by the real pump while live batches of OTHER ranks keep arriving:
//! what the sliced graft costs the live stream (custom harness: the figures are a latency
//! distribution and one wall time, not a mean per call).
//!
//! Shape (the generator of `kvroute-index/benches/graft.rs`): block size 16, 300 shared system
//! prompts of 1k-4k tokens with skewed popularity, extended by per-rank conversations. The
//! snapshot holds 64 ranks x ~100,000 carried blocks; the pump's index already serves 8 live
//! ranks of the same shape (so the graft shares their prompt nodes). Each booting rank holds one
//! batch at its cursor + 1, so each settles `warm` when the graft completes. During the graft a
//! driver task sends live batches for the 8 live ranks at `LIVE_BATCHES_PER_S` (16-block stores
//! under their system prompts); each batch's latency runs from just before it is enqueued on the
//! pump's channel to the moment the pump has applied it to the index.
//!
//! Two scenarios run. "equal live ranks" is the shape above as stated: 8 live ranks of one size
//! fed at one rate. Their per-rank side maps (engine hash -> node, in `kvroute-index`) then
//! reach a growth step together, and each step rehashes by reading every entry's node (~17 ms
//! at ~115,000 entries): unless the pump spaces the steps out ahead of need
//! (`SIDE_MAP_PREGROW_SPACING_MS`), eight of them back to back stall it for ~140 ms, graft or
//! no graft. "staggered live ranks" gives the live ranks different sizes (60k..130k blocks).
//! The baseline line (live batches applied outside the graft, before and after it) shows what
//! the live stream costs without a graft in the same run.
//!
//! Run: `cargo bench -p kvroute-kv --bench graft_under_load`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_index::{GRAFT_SLICE_ITEMS_MAX, GraftPlan, IndexConfig, PrefixIndex};
use kvroute_kv::RankKey;
use kvroute_kv::bootstrap::{BootstrapEvent, GraftDisposition, GraftTarget};
use kvroute_kv::testing::{DriverConfig, PumpDriver};
use kvroute_wire::event::{EngineHash, EventBatch};
use kvroute_wire::snapshot::RankRef;
use parking_lot::Mutex;

#[path = "../../kvroute-index/benches/support/chat_shape.rs"]
mod support;

use support::{BLOCK_SIZE, BLOCKS_PER_EVENT, token};

const SNAPSHOT_RANKS: u32 = 64;
const LIVE_RANKS: u32 = 8;
const BLOCKS_PER_RANK: u64 = 100_000;
const LIVE_BATCHES_PER_S: u64 = 10_000;
/// Live batches are sent in bursts every tick (tokio timers are millisecond-grained).
const LIVE_TICK_MS: u64 = 1;
/// Live traffic before the graft starts, for a baseline.
const BASELINE_MS: u64 = 500;
const WAIT_MS: u64 = 120_000;

/// SplitMix64: the generator needs reproducible draws, not statistical quality.
struct StdRng(u64);

impl StdRng {
    fn seed_from_u64(seed: u64) -> Self {
        Self(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn random(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn random_range(&mut self, range: std::ops::RangeInclusive<usize>) -> usize {
        let span = (range.end() - range.start() + 1) as u64;
        range.start() + (self.next_u64() % span) as usize
    }
}

impl support::Draws for StdRng {
    fn unit(&mut self) -> f64 {
        self.random()
    }
    fn tail_blocks(&mut self) -> usize {
        self.random_range(16..=160usize)
    }
}

fn store(
    hashes: Vec<EngineHash>,
    parent: Option<EngineHash>,
    tokens: Vec<u32>,
    ts: f64,
) -> EventBatch {
    EventBatch {
        ts,
        events: vec![support::store_event(hashes, parent, tokens)],
        dp_rank: None,
    }
}

fn rank_ref(net: u32, rank: u32) -> RankRef {
    RankRef {
        worker_url: format!("http://10.{net}.0.{rank}:8000"),
        dp_rank: 0,
    }
}

fn rank_key(net: u32, rank: u32) -> RankKey {
    RankKey {
        url: Arc::from(rank_ref(net, rank).worker_url),
        dp_rank: 0,
    }
}

/// One rank's stream of ~`BLOCKS_PER_RANK` carried blocks (one event per batch, seq from 0),
/// and the last engine hash of each system prompt it stored.
struct RankStream {
    batches: Vec<EventBatch>,
    prompt_tails: Vec<EngineHash>,
    next_engine: u64,
}

fn rank_stream(net: u32, rank: u32, blocks: u64, rng: &mut StdRng) -> RankStream {
    let mut engine_seq: u64 = u64::from(net) << 48 | u64::from(rank) << 32;
    let mut batches = Vec::new();
    let prompt_tails = support::chat_rank(
        rng,
        &mut engine_seq,
        net,
        rank,
        blocks,
        |ev| {
            let ts = batches.len() as f64;
            batches.push(EventBatch {
                ts,
                events: vec![ev],
                dp_rank: None,
            });
        },
        |_| {},
    );
    RankStream {
        batches,
        prompt_tails,
        next_engine: engine_seq + 1,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report(what: &str, mut lat: Vec<Duration>) {
    if lat.is_empty() {
        println!("{what}: no samples");
        return;
    }
    lat.sort();
    println!(
        "{what}: {} batches, p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        lat.len(),
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.99)),
        ms(*lat.last().expect("non-empty"))
    );
}

/// When each live batch was in the pump's channel (its send completed) and when it was applied.
/// Joined after the run: stamping after the send means a sender task descheduled between the
/// stamp and the send is never charged to the pump.
#[derive(Default)]
struct Clock {
    sent: HashMap<(Arc<str>, i64), Instant>,
    applied: HashMap<(Arc<str>, i64), Instant>,
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run());
}

async fn run() {
    let t = Instant::now();
    let mut rng = StdRng::seed_from_u64(7);
    let (mut sibling_w, sibling_r) = PrefixIndex::new(IndexConfig {
        max_carried_blocks: u64::MAX,
        ..IndexConfig::new(BLOCK_SIZE)
    });
    let mut cursors = Vec::new();
    for rank in 0..SNAPSHOT_RANKS {
        let id = sibling_w.add_rank(rank_ref(0, rank));
        let stream = rank_stream(0, rank, BLOCKS_PER_RANK, &mut rng);
        for (seq, b) in stream.batches.iter().enumerate() {
            sibling_w.apply_batch(id, seq as i64, b);
        }
        cursors.push(stream.batches.len() as i64 - 1);
    }
    let mut snapshot = sibling_r.export_snapshot();
    snapshot.producer_ready = true;
    let carriers = snapshot.nodes.carrier_rank.len();
    drop(sibling_w);
    drop(sibling_r);
    println!(
        "snapshot: {SNAPSHOT_RANKS} ranks, {} nodes, {carriers} carriers (built in {:.1} s)",
        snapshot.nodes.len(),
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let plan = GraftPlan::new(snapshot, BLOCK_SIZE, |_| true).expect("valid snapshot");
    let plan_ms = ms(t.elapsed());
    println!("GraftPlan::new (off the pump): {plan_ms:.0} ms");
    // As the issue states it: live ranks of one size, fed at one rate.
    scenario("equal live ranks", plan.clone(), &cursors, carriers, |_| {
        BLOCKS_PER_RANK
    })
    .await;
    // The same with live ranks of different sizes (60k..130k blocks), so their side maps do not
    // all reach a growth step within the same few milliseconds (see the module doc).
    scenario("staggered live ranks", plan, &cursors, carriers, |rank| {
        BLOCKS_PER_RANK * (6 + u64::from(rank)) / 10
    })
    .await;
}

async fn scenario(
    label: &str,
    plan: GraftPlan,
    cursors: &[i64],
    carriers: usize,
    live_blocks: fn(u32) -> u64,
) {
    println!("--- {label} ---");
    let mut rng = StdRng::seed_from_u64(11);

    let clock: Arc<Mutex<Clock>> = Arc::default();
    let slices: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut cfg = DriverConfig::new(BLOCK_SIZE);
    cfg.graft_slice_items = GRAFT_SLICE_ITEMS_MAX;
    let on_apply = clock.clone();
    cfg.on_apply = Some(Arc::new(move |key: &RankKey, seq| {
        on_apply
            .lock()
            .applied
            .insert((key.url.clone(), seq), Instant::now());
    }));
    let on_slice = slices.clone();
    cfg.on_slice = Some(Arc::new(move |d| on_slice.lock().push(d)));
    let mut d = PumpDriver::start(cfg);

    // The live ranks, filled through the pump before anything is measured.
    let mut live = Vec::new();
    for rank in 0..LIVE_RANKS {
        let key = rank_key(1, rank);
        d.add_rank(&key, 1, false).await;
        let stream = rank_stream(1, rank, live_blocks(rank), &mut rng);
        for (seq, b) in stream.batches.iter().enumerate() {
            d.batch(&key, 1, seq as i64, b.clone()).await;
        }
        live.push((
            key,
            stream.batches.len() as i64,
            stream.prompt_tails,
            stream.next_engine,
        ));
    }
    // The booting ranks, each holding its batch at cursor + 1.
    let mut targets = Vec::new();
    for rank in 0..SNAPSHOT_RANKS {
        let key = rank_key(0, rank);
        d.add_rank(&key, 2, true).await;
        let next = cursors[rank as usize] + 1;
        let held = store(
            vec![EngineHash(9 << 56 | u64::from(rank))],
            None,
            (0..BLOCK_SIZE)
                .map(|t| token(9 << 40 | u64::from(rank), u64::from(t)))
                .collect(),
            next as f64,
        );
        d.batch(&key, 2, next, held).await;
        targets.push(GraftTarget {
            key,
            incarnation: 2,
        });
    }
    d.barrier().await;
    println!(
        "pump ready: {} carried by {LIVE_RANKS} live ranks",
        d.reader.total_carried()
    );

    // Live traffic for the live ranks until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let stop = stop.clone();
        let clock = clock.clone();
        let tx = d.sender();
        tokio::spawn(async move {
            let per_tick = (LIVE_BATCHES_PER_S * LIVE_TICK_MS / 1000).max(1);
            let mut tick = tokio::time::interval(Duration::from_millis(LIVE_TICK_MS));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut n = 0u64;
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                for _ in 0..per_tick {
                    let (key, seq, tails, engine) = &mut live[(n % u64::from(LIVE_RANKS)) as usize];
                    n += 1;
                    let parent = tails[(n as usize / LIVE_RANKS as usize) % tails.len()];
                    let hashes: Vec<EngineHash> = (0..BLOCKS_PER_EVENT)
                        .map(|_| {
                            *engine += 1;
                            EngineHash(*engine)
                        })
                        .collect();
                    let tokens = (0..BLOCKS_PER_EVENT as u64 * u64::from(BLOCK_SIZE))
                        .map(|t| token(3 << 40 | n, t))
                        .collect();
                    let batch = store(hashes, Some(parent), tokens, *seq as f64);
                    tx.batch(key, 1, *seq, batch).await;
                    clock
                        .lock()
                        .sent
                        .insert((key.url.clone(), *seq), Instant::now());
                    *seq += 1;
                    sent += 1;
                }
            }
            sent
        })
    };
    tokio::time::sleep(Duration::from_millis(BASELINE_MS)).await;

    let graft_start = Instant::now();
    let receipt = d.graft(plan, targets).await;
    assert!(
        receipt
            .ranks
            .iter()
            .all(|(_, d)| *d == GraftDisposition::Taken),
        "every booting rank takes the graft"
    );
    let mut warm = 0;
    let deadline = Duration::from_millis(WAIT_MS);
    while warm < SNAPSHOT_RANKS {
        match tokio::time::timeout(deadline, d.events.recv()).await {
            Ok(Some(BootstrapEvent::Finished { outcome, .. })) => {
                assert_eq!(outcome.label(), "warm");
                warm += 1;
            }
            Ok(Some(other)) => panic!("unexpected event {other:?}"),
            Ok(None) | Err(_) => panic!("graft did not finish; {warm} ranks warm"),
        }
    }
    let graft_end = Instant::now();
    let graft_total = graft_end - graft_start;
    tokio::time::sleep(Duration::from_millis(BASELINE_MS)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = sender.await.expect("sender");
    d.barrier().await;

    let clock = clock.lock();
    let done: Vec<(Instant, Duration)> = clock
        .sent
        .iter()
        .filter_map(|(k, sent)| {
            let applied = clock.applied.get(k)?;
            Some((*applied, applied.saturating_duration_since(*sent)))
        })
        .collect();
    let unapplied = clock
        .sent
        .keys()
        .filter(|k| !clock.applied.contains_key(*k))
        .count();
    let during: Vec<Duration> = done
        .iter()
        .filter(|(at, _)| *at >= graft_start && *at <= graft_end)
        .map(|(_, l)| *l)
        .collect();
    let outside: Vec<Duration> = done
        .iter()
        .filter(|(at, _)| *at < graft_start || *at > graft_end)
        .map(|(_, l)| *l)
        .collect();
    let mut worst: Vec<(Duration, Duration)> = done
        .iter()
        .filter(|(at, _)| *at >= graft_start && *at <= graft_end)
        .map(|(at, l)| (*l, *at - graft_start))
        .collect();
    worst.sort();
    for (lat, at) in worst.iter().rev().take(3) {
        println!(
            "slow live batch: {:.1} ms, applied {:.1} ms into the graft",
            ms(*lat),
            ms(*at)
        );
    }
    let mut worst_outside: Vec<(Duration, f64)> = done
        .iter()
        .filter(|(at, _)| *at < graft_start || *at > graft_end)
        .map(|(at, l)| {
            let offset = if *at > graft_end {
                ms(*at - graft_end)
            } else {
                -ms(graft_start - *at)
            };
            (*l, offset)
        })
        .collect();
    worst_outside.sort_by_key(|w| w.0);
    if let Some((lat, offset)) = worst_outside.last() {
        println!(
            "slowest baseline batch: {:.1} ms, applied {offset:.1} ms {} the graft",
            ms(*lat),
            if *offset < 0.0 { "before" } else { "after" }
        );
    }
    let elapsed_live = BASELINE_MS as f64 * 2.0 / 1e3 + graft_total.as_secs_f64();
    println!(
        "graft of {carriers} carriers for {SNAPSHOT_RANKS} ranks: {:.0} ms total \
         (offer to the last rank warm), {} slices of {GRAFT_SLICE_ITEMS_MAX} items",
        ms(graft_total),
        slices.lock().len()
    );
    println!(
        "live traffic: {sent} batches sent ({:.0}/s offered over {:.1} s), {} still unapplied",
        sent as f64 / elapsed_live,
        elapsed_live,
        unapplied
    );
    report(
        "live apply latency while grafting (enqueue -> applied)",
        during,
    );
    report("live apply latency outside the graft (baseline)", outside);
    report("graft slice duration", slices.lock().clone());
}
