//! Peer bootstrap on the real pump and the real index, driven through the pump's channel (no
//! sockets: a ZMQ subscriber's slow-joiner window would make "which batches were held" racy).
//! A sibling's snapshot is made the way a sibling makes it: a producer index fed the same
//! batches, exported.

use std::sync::Arc;
use std::time::Duration;

use kvroute_index::hash::{hash_token_blocks, namespace_seed};
use kvroute_index::{GraftPlan, IndexConfig, IndexReader, IndexWriter, PrefixIndex, PrefixMatch};
use kvroute_kv::RankKey;
use kvroute_kv::bootstrap::{BootstrapEvent, GraftDisposition, GraftReceipt, GraftTarget};
use kvroute_kv::rank_state::BootstrapOutcome;
use kvroute_kv::status::BootstrapState;
use kvroute_kv::testing::{DriverConfig, PumpDriver};
use kvroute_wire::snapshot::{IndexSnapshot, RankRef};
use kvroute_wire::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use parking_lot::Mutex;

const BLOCK_SIZE: u32 = 4;
const WAIT_MS: u64 = 10_000;
const POLL_MS: u64 = 2;

fn key(url: &str) -> RankKey {
    RankKey {
        url: Arc::from(url),
        dp_rank: 0,
    }
}

fn rank_ref(key: &RankKey) -> RankRef {
    RankRef {
        worker_url: key.url.to_string(),
        dp_rank: key.dp_rank,
    }
}

/// Tokens of chain `tag` (`blocks` full blocks), distinct per tag.
fn tokens(tag: u64, blocks: u64) -> Vec<u32> {
    (0..blocks * u64::from(BLOCK_SIZE))
        .map(|i| (tag * 10_000 + i) as u32)
        .collect()
}

/// One batch storing chain `tag` of `blocks` blocks (engine hashes `tag * 1000 + i`); its `ts`
/// is the tag, so every batch is told apart.
fn store(tag: u64, blocks: u64) -> EventBatch {
    let hashes = (0..blocks).map(|i| EngineHash(tag * 1000 + i)).collect();
    EventBatch {
        ts: tag as f64,
        events: vec![KvEvent::BlockStored(BlockStored::new(
            hashes,
            None,
            tokens(tag, blocks),
            BLOCK_SIZE,
        ))],
        dp_rank: None,
    }
}

/// One batch removing the last block of chain `tag` of `blocks` blocks.
fn remove_last(tag: u64, blocks: u64, ts: f64) -> EventBatch {
    EventBatch {
        ts,
        events: vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(tag * 1000 + blocks - 1)],
            medium: None,
            group_idx: None,
        })],
        dp_rank: None,
    }
}

/// A sibling's index: feed it batches per rank, export it.
struct Sibling {
    writer: IndexWriter,
    reader: IndexReader,
}

impl Sibling {
    fn new() -> Self {
        let (writer, reader) = PrefixIndex::new(IndexConfig::new(BLOCK_SIZE));
        Self { writer, reader }
    }

    fn apply(&mut self, key: &RankKey, seq: i64, batch: &EventBatch) {
        let rank = match self
            .reader
            .ranks()
            .iter()
            .find(|(_, r)| *r == rank_ref(key))
        {
            Some((id, _)) => *id,
            None => self.writer.add_rank(rank_ref(key)),
        };
        self.writer.apply_batch(rank, seq, batch);
    }

    fn snapshot(&self) -> IndexSnapshot {
        let mut s = self.reader.export_snapshot();
        s.producer_ready = true;
        s
    }

    fn plan(&self) -> GraftPlan {
        GraftPlan::new(self.snapshot(), BLOCK_SIZE, |_| true).expect("a valid snapshot")
    }
}

/// Depth to which `key` carries chain `tag` of `blocks` blocks in `reader`.
fn depth(reader: &IndexReader, key: &RankKey, tag: u64, blocks: u64) -> u32 {
    let mut hashes = Vec::new();
    hash_token_blocks(
        &tokens(tag, blocks),
        BLOCK_SIZE as usize,
        namespace_seed(None, None),
        &mut hashes,
    );
    let Some((id, _)) = reader
        .ranks()
        .into_iter()
        .find(|(_, r)| *r == rank_ref(key))
    else {
        return 0;
    };
    let mut out = PrefixMatch::new();
    reader.match_prefix(&hashes, &mut out);
    out.get(id).map_or(0, |m| m.matched_blocks)
}

fn carried(reader: &IndexReader, key: &RankKey) -> Option<u64> {
    let (id, _) = reader
        .ranks()
        .into_iter()
        .find(|(_, r)| *r == rank_ref(key))?;
    reader.rank_stats(id).map(|s| s.carried_blocks)
}

fn cursor(reader: &IndexReader, key: &RankKey) -> Option<i64> {
    let (id, _) = reader
        .ranks()
        .into_iter()
        .find(|(_, r)| *r == rank_ref(key))?;
    reader.rank_stats(id)?.cursor.map(|c| c.seq)
}

fn target(key: &RankKey, incarnation: u64) -> GraftTarget {
    GraftTarget {
        key: key.clone(),
        incarnation,
    }
}

/// The next bootstrap event, failing after `WAIT_MS`.
async fn next_event(d: &mut PumpDriver) -> BootstrapEvent {
    tokio::time::timeout(Duration::from_millis(WAIT_MS), d.events.recv())
        .await
        .unwrap_or_else(|_| panic!("no bootstrap event within {WAIT_MS} ms"))
        .expect("the events channel is open")
}

/// Every event already emitted (after a barrier, that is everything the inputs so far caused).
async fn drain_events(d: &mut PumpDriver) -> Vec<BootstrapEvent> {
    d.barrier().await;
    let mut out = Vec::new();
    while let Ok(ev) = d.events.try_recv() {
        out.push(ev);
    }
    out
}

async fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(WAIT_MS);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {WAIT_MS} ms waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

fn finished(key: &RankKey, incarnation: u64, outcome: BootstrapOutcome) -> BootstrapEvent {
    BootstrapEvent::Finished {
        key: key.clone(),
        incarnation,
        outcome,
    }
}

fn metric(d: &PumpDriver, name: &str, label: Option<(&str, &str)>) -> f64 {
    d.registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| {
            label.is_none_or(|(k, v)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == k && l.value() == v)
            })
        })
        // A family is either gauges or counters; the other reads as zero.
        .map(|m| m.get_gauge().get_value() + m.get_counter().get_value())
        .sum()
}

#[tokio::test]
async fn bootstrapping_rank_holds_until_a_graft_then_the_index_answers_like_the_snapshot_plus_the_held_batches()
 {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let w = key("http://w");
    let mut sibling = Sibling::new();
    for seq in 0..=5 {
        sibling.apply(&w, seq, &store(seq as u64, 3));
    }
    let plan = sibling.plan();
    // The live stream as this replica sees it: from seq 4 on (4 and 5 are in the snapshot).
    for seq in 6..=7 {
        sibling.apply(&w, seq, &store(seq as u64, 3));
    }
    d.add_rank(&w, 1, true).await;
    for seq in 4..=7 {
        d.batch(&w, 1, seq, store(seq as u64, 3)).await;
    }
    d.barrier().await;
    assert_eq!(
        carried(&d.reader, &w),
        Some(0),
        "held batches reached the index"
    );
    let status = d.status(&w).expect("status");
    assert_eq!(status.bootstrap, BootstrapState::Holding);
    assert_eq!(status.held_batches, 4);

    let receipt = d.graft(plan, vec![target(&w, 1)]).await;
    assert_eq!(
        receipt,
        GraftReceipt {
            ranks: vec![(w.clone(), GraftDisposition::Taken)]
        }
    );
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 1, BootstrapOutcome::Warm)
    );
    d.barrier().await;
    for tag in 0..=7 {
        assert_eq!(
            depth(&d.reader, &w, tag, 3),
            depth(&sibling.reader, &w, tag, 3),
            "chain {tag}"
        );
        assert_eq!(depth(&d.reader, &w, tag, 3), 3, "chain {tag}");
    }
    assert_eq!(carried(&d.reader, &w), carried(&sibling.reader, &w));
    assert_eq!(cursor(&d.reader, &w), Some(7));
    let status = d.status(&w).expect("status");
    assert_eq!(
        status.bootstrap,
        BootstrapState::Settled(BootstrapOutcome::Warm)
    );
    assert_eq!((status.held_batches, status.held_bytes), (0, 0));
}

#[tokio::test]
async fn a_removal_held_during_the_bootstrap_is_not_resurrected_by_the_graft() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let w = key("http://w");
    let mut sibling = Sibling::new();
    for seq in 0..=5 {
        sibling.apply(&w, seq, &store(seq as u64, 3));
    }
    d.add_rank(&w, 1, true).await;
    // Batch 6 removes the last block of chain 2, which the snapshot (cursor 5) still carries.
    d.batch(&w, 1, 6, remove_last(2, 3, 6.5)).await;
    d.barrier().await;
    let receipt = d.graft(sibling.plan(), vec![target(&w, 1)]).await;
    assert_eq!(receipt.ranks[0].1, GraftDisposition::Taken);
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 1, BootstrapOutcome::Warm)
    );
    d.barrier().await;
    assert_eq!(depth(&d.reader, &w, 2, 3), 2, "the removed block came back");
    assert_eq!(depth(&d.reader, &w, 1, 3), 3);
    assert_eq!(cursor(&d.reader, &w), Some(6));
}

/// What the pump did, in order, as its observers saw it.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Slice,
    Applied(String, i64),
}

/// Holds the pump after each graft slice (inside the slice observer, so the pump is between two
/// slices) until the test lets one more slice go, while closed. Lets a test put a message in
/// the channel at a known point of the graft without racing it.
struct Gate {
    closed: std::sync::atomic::AtomicBool,
    tokens: Mutex<std::sync::mpsc::Receiver<()>>,
    sender: Mutex<std::sync::mpsc::Sender<()>>,
    slices: std::sync::atomic::AtomicU64,
}

impl Gate {
    fn new() -> Arc<Gate> {
        let (sender, tokens) = std::sync::mpsc::channel();
        Arc::new(Gate {
            closed: true.into(),
            tokens: Mutex::new(tokens),
            sender: Mutex::new(sender),
            slices: 0.into(),
        })
    }

    /// The slice observer: counts, then waits for a token while the gate is closed.
    ///
    /// The wait blocks the runtime worker the pump runs on, so it is declared to tokio
    /// (`block_in_place`, which hands the worker's duties to another thread). Undeclared, it
    /// once hung a clean-clone CI run for good: the pump's worker blocked here, the other worker
    /// slept on its condition variable, and the test's thread waited in `wait_until`'s
    /// `tokio::time::sleep`, a timer no thread was left to drive, so the token never came. The
    /// tests using the gate run on the multi-thread runtime, which `block_in_place` needs.
    fn after_slice(&self) {
        self.slices
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::task::block_in_place(|| {
                let _ = self.tokens.lock().recv();
            });
        }
    }

    fn slices(&self) -> u64 {
        self.slices.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn one_more(&self) {
        let _ = self.sender.lock().send(());
    }

    fn open(&self) {
        self.closed
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.one_more();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_another_rank_are_applied_between_two_graft_slices() {
    let log: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let mut cfg = DriverConfig::new(BLOCK_SIZE);
    // Tiny slices, so the graft of a few thousand nodes takes many of them.
    cfg.graft_slice_items = 16;
    let (on_apply, on_slice) = (log.clone(), log.clone());
    cfg.on_apply = Some(Arc::new(move |k: &RankKey, seq| {
        on_apply.lock().push(Seen::Applied(k.url.to_string(), seq));
    }));
    let gate = Gate::new();
    let held_gate = gate.clone();
    cfg.on_slice = Some(Arc::new(move |_| {
        on_slice.lock().push(Seen::Slice);
        held_gate.after_slice();
    }));
    let mut d = PumpDriver::start(cfg);
    let (booting, live) = (key("http://booting"), key("http://live"));
    let mut sibling = Sibling::new();
    for seq in 0..200 {
        sibling.apply(&booting, seq, &store(seq as u64, 16));
    }
    d.add_rank(&live, 1, false).await;
    d.add_rank(&booting, 2, true).await;
    d.batch(&booting, 2, 200, store(200, 16)).await;
    let receipt = d.graft(sibling.plan(), vec![target(&booting, 2)]).await;
    assert_eq!(receipt.ranks[0].1, GraftDisposition::Taken);
    wait_until("the first graft slice", || gate.slices() >= 1).await;
    d.batch(&live, 1, 0, store(5_000, 2)).await;
    gate.open();
    assert_eq!(
        next_event(&mut d).await,
        finished(&booting, 2, BootstrapOutcome::Warm)
    );
    let log = log.lock().clone();
    let live_at = log
        .iter()
        .position(|s| *s == Seen::Applied("http://live".into(), 0))
        .expect("the live batch was applied");
    assert!(
        log[..live_at].contains(&Seen::Slice) && log[live_at..].contains(&Seen::Slice),
        "the live batch was not applied between two slices: {log:?}"
    );
    // The booting rank's own held batch waited for its graft.
    let held_at = log
        .iter()
        .position(|s| *s == Seen::Applied("http://booting".into(), 200))
        .expect("the held batch was applied");
    assert!(
        !log[held_at..].contains(&Seen::Slice),
        "the held batch ran before its graft finished"
    );
    assert_eq!(depth(&d.reader, &live, 5_000, 2), 2);
    assert_eq!(depth(&d.reader, &booting, 199, 16), 16);
    assert_eq!(depth(&d.reader, &booting, 200, 16), 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_worker_mid_graft_leaves_no_carrier_of_that_rank() {
    let gate = Gate::new();
    let mut cfg = DriverConfig::new(BLOCK_SIZE);
    cfg.graft_slice_items = 16;
    let held_gate = gate.clone();
    cfg.on_slice = Some(Arc::new(move |_| held_gate.after_slice()));
    let mut d = PumpDriver::start(cfg);
    let (gone, kept) = (key("http://gone"), key("http://kept"));
    let mut sibling = Sibling::new();
    for seq in 0..100 {
        // Shared chains (same tags) so the two ranks share nodes, plus one of each rank's own.
        sibling.apply(&gone, 2 * seq, &store(seq as u64, 8));
        sibling.apply(&gone, 2 * seq + 1, &store(1_000 + seq as u64, 8));
        sibling.apply(&kept, 2 * seq, &store(seq as u64, 8));
        sibling.apply(&kept, 2 * seq + 1, &store(2_000 + seq as u64, 8));
    }
    let kept_carried = carried(&sibling.reader, &kept).expect("kept");
    d.add_rank(&gone, 1, true).await;
    d.add_rank(&kept, 2, true).await;
    d.batch(&gone, 1, 200, store(3_000, 8)).await;
    d.batch(&kept, 2, 200, store(4_000, 8)).await;
    let receipt = d
        .graft(sibling.plan(), vec![target(&gone, 1), target(&kept, 2)])
        .await;
    assert!(
        receipt
            .ranks
            .iter()
            .all(|(_, d)| *d == GraftDisposition::Taken)
    );
    for _ in 0..3 {
        gate.one_more();
    }
    wait_until("a few graft slices", || gate.slices() >= 4).await;
    let removed = d.enqueue_remove("http://gone").await;
    gate.open();
    removed.await.expect("the pump acknowledges");
    assert!(
        d.reader.ranks().iter().all(|(_, r)| *r != rank_ref(&gone)),
        "the removed rank is still registered"
    );
    assert_eq!(
        next_event(&mut d).await,
        finished(&kept, 2, BootstrapOutcome::Warm),
        "only the kept rank reports"
    );
    d.barrier().await;
    let kept_carried = kept_carried + 8;
    assert_eq!(carried(&d.reader, &kept), Some(kept_carried));
    assert_eq!(
        d.reader.total_carried(),
        kept_carried,
        "a carrier of the removed rank survived"
    );
    for seq in 0..100 {
        assert_eq!(depth(&d.reader, &kept, seq, 8), 8);
    }
    assert!(drain_events(&mut d).await.is_empty());
}

#[tokio::test]
async fn release_applies_held_batches_cold() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let w = key("http://w");
    d.add_rank(&w, 1, true).await;
    d.batch(&w, 1, 6, store(6, 2)).await;
    d.batch(&w, 1, 7, store(7, 3)).await;
    d.release(&w, 1, BootstrapOutcome::Abandoned).await;
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 1, BootstrapOutcome::Abandoned)
    );
    d.barrier().await;
    assert_eq!(carried(&d.reader, &w), Some(5));
    assert_eq!(cursor(&d.reader, &w), Some(7));
    d.batch(&w, 1, 8, store(8, 1)).await;
    d.barrier().await;
    assert_eq!(
        depth(&d.reader, &w, 8, 1),
        1,
        "the rank runs live after release"
    );
    assert_eq!(
        metric(
            &d,
            "kvroute_kv_bootstrap_outcomes_total",
            Some(("outcome", "abandoned"))
        ),
        1.0
    );
}

#[tokio::test]
async fn stale_incarnation_messages_are_ignored() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let w = key("http://w");
    let mut sibling = Sibling::new();
    sibling.apply(&w, 0, &store(0, 2));
    sibling.apply(&w, 1, &store(1, 2));
    d.add_rank(&w, 1, true).await;
    d.remove("http://w").await;
    d.add_rank(&w, 2, true).await;
    d.batch(&w, 1, 2, store(2, 2)).await;
    d.release(&w, 1, BootstrapOutcome::Abandoned).await;
    d.answer_probe(&w, 1, 0, Some(1)).await;
    d.rebuild_from_engine(&w, 1, BootstrapOutcome::Abandoned)
        .await;
    let receipt = d.graft(sibling.plan(), vec![target(&w, 1)]).await;
    assert_eq!(receipt.ranks, vec![(w.clone(), GraftDisposition::Stale)]);
    assert!(drain_events(&mut d).await.is_empty());
    let status = d.status(&w).expect("status");
    assert_eq!(status.bootstrap, BootstrapState::Holding);
    assert_eq!(status.held_batches, 0, "a stale batch was held");
    assert_eq!(carried(&d.reader, &w), Some(0));
    // The current incarnation is still served.
    d.release(&w, 2, BootstrapOutcome::Abandoned).await;
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 2, BootstrapOutcome::Abandoned)
    );
}

#[tokio::test]
async fn finished_is_emitted_exactly_once_per_bootstrap() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let (grafted, released) = (key("http://grafted"), key("http://released"));
    let mut sibling = Sibling::new();
    for seq in 0..=3 {
        sibling.apply(&grafted, seq, &store(seq as u64, 2));
    }
    d.add_rank(&grafted, 1, true).await;
    d.add_rank(&released, 2, true).await;
    d.batch(&grafted, 1, 4, store(4, 2)).await;
    let plan = || sibling.plan();
    d.graft(plan(), vec![target(&grafted, 1)]).await;
    d.release(&released, 2, BootstrapOutcome::Abandoned).await;
    // Everything after the first settlement must not report again.
    let again = d.graft(plan(), vec![target(&grafted, 1)]).await;
    assert_eq!(again.ranks[0].1, GraftDisposition::Declined);
    d.release(&grafted, 1, BootstrapOutcome::Abandoned).await;
    d.release(&released, 2, BootstrapOutcome::Empty).await;
    d.rebuild_from_engine(&released, 2, BootstrapOutcome::Abandoned)
        .await;
    d.answer_probe(&grafted, 1, 0, Some(9)).await;
    for seq in 5..10 {
        d.batch(&grafted, 1, seq, store(seq as u64, 1)).await;
        d.batch(&released, 2, seq, store(100 + seq as u64, 1)).await;
    }
    let events = drain_events(&mut d).await;
    let count = |k: &RankKey| {
        events
            .iter()
            .filter(|e| matches!(e, BootstrapEvent::Finished { key, .. } if key == k))
            .count()
    };
    assert_eq!(count(&grafted), 1, "{events:?}");
    assert_eq!(count(&released), 1, "{events:?}");
    assert!(events.contains(&finished(&grafted, 1, BootstrapOutcome::Warm)));
    assert!(events.contains(&finished(&released, 2, BootstrapOutcome::Abandoned)));
    assert_eq!(metric(&d, "kvroute_kv_bootstrap_outcomes_total", None), 2.0);
}

#[tokio::test]
async fn held_batches_and_bytes_are_gauged_per_model_and_drop_to_zero_when_settled() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let (a, b) = (key("http://a"), key("http://b"));
    d.add_rank(&a, 1, true).await;
    d.add_rank(&b, 2, true).await;
    d.batch(&a, 1, 3, store(3, 2)).await;
    d.batch(&a, 1, 4, store(4, 2)).await;
    d.batch(&b, 2, 9, store(9, 2)).await;
    d.barrier().await;
    let model = Some(("model", "m"));
    assert_eq!(metric(&d, "kvroute_kv_bootstrap_held_batches", model), 3.0);
    let bytes = metric(&d, "kvroute_kv_bootstrap_held_bytes", model);
    let status_bytes = d.status(&a).unwrap().held_bytes + d.status(&b).unwrap().held_bytes;
    assert!(bytes > 0.0);
    assert_eq!(bytes, status_bytes as f64);
    d.release(&a, 1, BootstrapOutcome::Abandoned).await;
    next_event(&mut d).await;
    d.remove("http://b").await;
    assert_eq!(metric(&d, "kvroute_kv_bootstrap_held_batches", model), 0.0);
    assert_eq!(metric(&d, "kvroute_kv_bootstrap_held_bytes", model), 0.0);
}

#[tokio::test]
async fn a_snapshot_the_index_refuses_releases_its_ranks_rejected() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let w = key("http://w");
    // A sibling indexing with another block size: the plan is valid on its own terms, but this
    // index cannot take it.
    let (mut writer, reader) = PrefixIndex::new(IndexConfig::new(8));
    let id = writer.add_rank(rank_ref(&w));
    let batch = EventBatch {
        ts: 1.0,
        events: vec![KvEvent::BlockStored(BlockStored::new(
            vec![EngineHash(1)],
            None,
            (0..8).collect(),
            8,
        ))],
        dp_rank: None,
    };
    writer.apply_batch(id, 0, &batch);
    let mut snapshot = reader.export_snapshot();
    snapshot.producer_ready = true;
    let plan = GraftPlan::new(snapshot, 8, |_| true).expect("valid for block size 8");
    d.add_rank(&w, 1, true).await;
    d.batch(&w, 1, 1, store(1, 2)).await;
    let receipt = d.graft(plan, vec![target(&w, 1)]).await;
    assert_eq!(receipt.ranks, vec![(w.clone(), GraftDisposition::Rejected)]);
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 1, BootstrapOutcome::Rejected)
    );
    d.barrier().await;
    assert_eq!(depth(&d.reader, &w, 1, 2), 2, "held batches applied cold");
    assert_eq!(
        metric(&d, "kvroute_kv_grafts_total", Some(("result", "rejected"))),
        1.0
    );
}

#[tokio::test]
async fn a_rank_the_snapshot_has_no_cursor_for_is_reported_uncovered_and_keeps_holding() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let (w, other) = (key("http://w"), key("http://other"));
    let mut sibling = Sibling::new();
    sibling.apply(&other, 0, &store(0, 2));
    d.add_rank(&w, 1, true).await;
    let receipt = d.graft(sibling.plan(), vec![target(&w, 1)]).await;
    assert_eq!(
        receipt.ranks,
        vec![(w.clone(), GraftDisposition::Uncovered)]
    );
    assert!(drain_events(&mut d).await.is_empty());
    assert_eq!(d.status(&w).unwrap().bootstrap, BootstrapState::Holding);
}

#[tokio::test]
async fn deferred_proof_without_replay_asks_the_siblings_and_a_cursor_at_the_watermark_proves_it() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let w = key("http://w");
    let mut sibling = Sibling::new();
    for seq in 0..=5 {
        sibling.apply(&w, seq, &store(seq as u64, 2));
    }
    d.add_rank(&w, 1, true).await;
    d.graft(sibling.plan(), vec![target(&w, 1)]).await;
    let generation = match next_event(&mut d).await {
        BootstrapEvent::ProbeSiblings {
            key,
            incarnation,
            generation,
            watermark,
        } => {
            assert_eq!((key, incarnation, watermark), (w.clone(), 1, (5, 5.0)));
            generation
        }
        other => panic!("expected a probe request, got {other:?}"),
    };
    d.barrier().await;
    assert_eq!(d.status(&w).unwrap().bootstrap, BootstrapState::Proving);
    d.answer_probe(&w, 1, generation, Some(5)).await;
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 1, BootstrapOutcome::Warm)
    );
    assert_eq!(depth(&d.reader, &w, 5, 2), 2);
}

#[tokio::test]
async fn gap_without_replay_asks_for_a_fresher_snapshot_whose_graft_then_splices() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let w = key("http://w");
    let mut sibling = Sibling::new();
    for seq in 0..=5 {
        sibling.apply(&w, seq, &store(seq as u64, 2));
    }
    let stale = sibling.plan();
    sibling.apply(&w, 6, &store(6, 2));
    d.add_rank(&w, 1, true).await;
    // Cursor 5, first held 7: a gap (batch 6 was missed).
    d.batch(&w, 1, 7, store(7, 2)).await;
    d.graft(stale, vec![target(&w, 1)]).await;
    assert_eq!(
        next_event(&mut d).await,
        BootstrapEvent::NeedFreshSnapshot {
            key: w.clone(),
            incarnation: 1,
            min_cursor: 6
        }
    );
    d.barrier().await;
    assert_eq!(
        carried(&d.reader, &w),
        Some(0),
        "the unproven graft was kept"
    );
    assert_eq!(cursor(&d.reader, &w), None);
    let receipt = d.graft(sibling.plan(), vec![target(&w, 1)]).await;
    assert_eq!(receipt.ranks[0].1, GraftDisposition::Taken);
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 1, BootstrapOutcome::Warm)
    );
    d.barrier().await;
    for tag in 0..=7 {
        assert_eq!(depth(&d.reader, &w, tag, 2), 2, "chain {tag}");
    }
}

#[tokio::test]
async fn engine_rebuild_without_a_replay_socket_releases_with_the_fallback() {
    let mut d = PumpDriver::start(DriverConfig::new(BLOCK_SIZE));
    let w = key("http://w");
    d.add_rank(&w, 1, true).await;
    d.batch(&w, 1, 3, store(3, 2)).await;
    d.rebuild_from_engine(&w, 1, BootstrapOutcome::Abandoned)
        .await;
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 1, BootstrapOutcome::Abandoned)
    );
    d.barrier().await;
    assert_eq!(depth(&d.reader, &w, 3, 2), 2);
}

#[tokio::test]
async fn a_graft_offered_while_another_runs_waits_its_turn_and_both_splice() {
    let mut cfg = DriverConfig::new(BLOCK_SIZE);
    cfg.graft_slice_items = 8;
    let mut d = PumpDriver::start(cfg);
    let (a, b) = (key("http://a"), key("http://b"));
    let mut sibling = Sibling::new();
    for seq in 0..50 {
        sibling.apply(&a, seq, &store(seq as u64, 4));
        sibling.apply(&b, seq, &store(500 + seq as u64, 4));
    }
    let plan_a = GraftPlan::new(sibling.snapshot(), BLOCK_SIZE, |r| *r == rank_ref(&a)).unwrap();
    let plan_b = GraftPlan::new(sibling.snapshot(), BLOCK_SIZE, |r| *r == rank_ref(&b)).unwrap();
    d.add_rank(&a, 1, true).await;
    d.add_rank(&b, 2, true).await;
    d.batch(&a, 1, 50, store(50, 4)).await;
    d.batch(&b, 2, 50, store(550, 4)).await;
    let (ra, rb) = tokio::join!(
        d.graft(plan_a, vec![target(&a, 1)]),
        d.graft(plan_b, vec![target(&b, 2)])
    );
    assert_eq!(ra.ranks[0].1, GraftDisposition::Taken);
    assert_eq!(rb.ranks[0].1, GraftDisposition::Taken);
    let mut events = vec![next_event(&mut d).await, next_event(&mut d).await];
    events.sort_by_key(|e| format!("{e:?}"));
    assert_eq!(
        events,
        vec![
            finished(&a, 1, BootstrapOutcome::Warm),
            finished(&b, 2, BootstrapOutcome::Warm)
        ]
    );
    d.barrier().await;
    for seq in 0..=50u64 {
        assert_eq!(depth(&d.reader, &a, seq, 4), 4);
        assert_eq!(depth(&d.reader, &b, 500 + seq, 4), 4);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_queued_behind_a_graft_past_their_bound_finish_the_graft_at_once() {
    let gate = Gate::new();
    let mut cfg = DriverConfig::new(BLOCK_SIZE);
    // One item per slice, and one slice per token: the graft cannot end by itself while the
    // test sends (it needs over a thousand slices; the test lets a few dozen go).
    cfg.graft_slice_items = 1;
    let held_gate = gate.clone();
    cfg.on_slice = Some(Arc::new(move |_| held_gate.after_slice()));
    let mut d = PumpDriver::start(cfg);
    let w = key("http://w");
    let mut sibling = Sibling::new();
    for seq in 0..100 {
        sibling.apply(&w, seq, &store(seq as u64, 8));
    }
    d.add_rank(&w, 1, true).await;
    d.batch(&w, 1, 100, store(100, 1)).await;
    let receipt = d.graft(sibling.plan(), vec![target(&w, 1)]).await;
    assert_eq!(receipt.ranks[0].1, GraftDisposition::Taken);
    let last = 100 + kvroute_kv::GRAFT_DEFERRED_ACTIONS_MAX as i64 + 1;
    for seq in 101..=last {
        d.batch(&w, 1, seq, store(seq as u64, 1)).await;
        if seq % 512 == 0 {
            gate.one_more();
        }
    }
    let gated_slices = gate.slices();
    gate.open();
    assert!(
        gated_slices < 100,
        "{gated_slices} slices ran while sending"
    );
    assert_eq!(
        next_event(&mut d).await,
        finished(&w, 1, BootstrapOutcome::Warm)
    );
    d.barrier().await;
    assert_eq!(cursor(&d.reader, &w), Some(last));
    assert_eq!(depth(&d.reader, &w, 99, 8), 8);
    assert_eq!(depth(&d.reader, &w, last as u64, 1), 1);
    let status = d.status(&w).expect("status");
    assert_eq!((status.held_batches, status.held_bytes), (0, 0));
}

#[tokio::test]
async fn past_the_total_held_bound_the_rank_holding_the_most_runs_cold_and_the_others_keep_holding()
{
    // Three ranks hold; the bound fits ten of these batches in all.
    let per_batch_bytes = {
        use kvroute_kv::rank_state::HeldCost;
        store(1, 4).held_bytes()
    };
    let mut cfg = DriverConfig::new(BLOCK_SIZE);
    cfg.held_bytes_total_max = per_batch_bytes * 10;
    let mut d = PumpDriver::start(cfg);
    let (big, small_a, small_b) = (key("http://big"), key("http://a"), key("http://b"));
    for k in [&big, &small_a, &small_b] {
        d.add_rank(k, 1, true).await;
    }
    for seq in 1..=3 {
        d.batch(&small_a, 1, seq, store(100 + seq as u64, 4)).await;
        d.batch(&small_b, 1, seq, store(200 + seq as u64, 4)).await;
    }
    // 6 held so far; `big` takes the total past 10 at its 5th batch.
    for seq in 1..=5 {
        d.batch(&big, 1, seq, store(300 + seq as u64, 4)).await;
    }
    let events = drain_events(&mut d).await;
    assert!(
        events.contains(&finished(&big, 1, BootstrapOutcome::Overflow)),
        "the rank holding the most overflows: {events:?}"
    );
    for k in [&small_a, &small_b] {
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, BootstrapEvent::Finished { key, .. } if key == k)),
            "{} keeps holding: {events:?}",
            k.url
        );
        assert_eq!(
            d.status(k).map(|s| s.held_batches),
            Some(3),
            "{} still holds its 3 batches",
            k.url
        );
    }
    // What `big` held was applied in order when it went cold.
    assert_eq!(d.reader.total_carried(), 5 * 4);
    assert!(
        metric(&d, "kvroute_kv_bootstrap_held_bytes", None) <= (per_batch_bytes * 10) as f64,
        "the held total is back under its bound"
    );
}
