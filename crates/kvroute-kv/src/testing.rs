//! One model's pump driven directly through its channel, with a transport that never delivers:
//! for tests and benchmarks that need the real pump and index but control every input, which
//! sockets would make racy (a ZMQ subscriber drops what it receives before it is connected).
//!
//! Not part of the plane's API (hidden from docs); the router goes through [`crate::KvPlane`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_index::{GRAFT_SLICE_ITEMS_MAX, GraftPlan, IndexConfig, IndexReader, PrefixIndex};
use kvroute_wire::EventBatch;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::bootstrap::{BOOTSTRAP_EVENTS_CAPACITY, BootstrapEvent, GraftReceipt, GraftTarget};
use crate::metrics::KvMetrics;
pub use crate::pump::{ApplyObserver, SliceObserver};
use crate::pump::{PUMP_CHANNEL_CAPACITY, Pump, PumpConfig, PumpMsg};
use crate::rank_state::BootstrapOutcome;
use crate::status::{RankKey, RankStatus, StatusTable};
use crate::transport::{KvSource, KvSubscription, SourceEvent, TransportError};

/// A transport with no engine behind it: subscriptions never deliver, replays fail.
pub struct SilentSource;

pub struct SilentSubscription;

impl KvSubscription for SilentSubscription {
    async fn next_event(&mut self) -> SourceEvent {
        std::future::pending().await
    }
}

impl KvSource for SilentSource {
    type Subscription = SilentSubscription;
    async fn subscribe(&self, _: &str, _: &str) -> SilentSubscription {
        std::future::pending().await
    }
    async fn replay(
        &self,
        _: &str,
        _: i64,
        _: Option<i64>,
    ) -> Result<Vec<(i64, Bytes)>, TransportError> {
        Err(TransportError::ReplayTimeout { timeout_ms: 0 })
    }
}

/// How to start a [`PumpDriver`].
#[derive(Clone)]
pub struct DriverConfig {
    pub index: IndexConfig,
    pub graft_slice_items: usize,
    pub probe_interval: Duration,
    pub on_apply: Option<ApplyObserver>,
    pub on_slice: Option<SliceObserver>,
    /// Bytes all bootstrapping ranks may hold together.
    pub held_bytes_total_max: u64,
}

impl DriverConfig {
    pub fn new(block_size: u32) -> Self {
        Self {
            index: IndexConfig {
                max_carried_blocks: u64::MAX,
                ..IndexConfig::new(block_size)
            },
            graft_slice_items: GRAFT_SLICE_ITEMS_MAX,
            probe_interval: Duration::ZERO,
            on_apply: None,
            on_slice: None,
            held_bytes_total_max: crate::rank_state::BOOTSTRAP_HELD_BYTES_TOTAL_MAX,
        }
    }
}

/// A running pump of model `"m"` and the handles to feed and observe it.
pub struct PumpDriver {
    tx: mpsc::Sender<PumpMsg>,
    pub reader: IndexReader,
    pub registry: prometheus::Registry,
    pub events: mpsc::Receiver<BootstrapEvent>,
    status: Arc<StatusTable>,
    cancel: CancellationToken,
}

pub const DRIVER_MODEL: &str = "m";

impl PumpDriver {
    /// Spawns the pump on the current tokio runtime.
    pub fn start(cfg: DriverConfig) -> Self {
        let (writer, reader) = PrefixIndex::new(cfg.index);
        let (tx, rx) = mpsc::channel(PUMP_CHANNEL_CAPACITY);
        let (events_tx, events) = mpsc::channel(BOOTSTRAP_EVENTS_CAPACITY);
        let registry = prometheus::Registry::new();
        let metrics = KvMetrics::register(&registry).expect("fresh registry");
        let status = Arc::new(StatusTable::default());
        let cancel = CancellationToken::new();
        let pump = Pump::new(
            writer,
            Arc::new(SilentSource),
            tx.clone(),
            metrics,
            status.clone(),
            Arc::new(crate::engine_loads::EngineLoads::new()),
            cancel.clone(),
            PumpConfig {
                model: Arc::from(DRIVER_MODEL),
                graft_slice_items: cfg.graft_slice_items.max(1),
                probe_interval: cfg.probe_interval,
                events: events_tx,
                on_apply: cfg.on_apply,
                on_slice: cfg.on_slice,
                held_bytes_total_max: cfg.held_bytes_total_max,
            },
        );
        tokio::spawn(pump.run(rx));
        Self {
            tx,
            reader,
            registry,
            events,
            status,
            cancel,
        }
    }

    async fn send(&self, msg: PumpMsg) {
        assert!(self.tx.send(msg).await.is_ok(), "the pump stopped");
    }

    /// A handle that feeds batches from another task.
    pub fn sender(&self) -> PumpSender {
        PumpSender {
            tx: self.tx.clone(),
        }
    }

    /// Registers a rank (as `KvPlane` does: status entry first, then the pump) and waits for it.
    pub async fn add_rank(&self, key: &RankKey, incarnation: u64, bootstrap: bool) {
        self.status.insert(key.clone(), DRIVER_MODEL, incarnation);
        let (done, rx) = oneshot::channel();
        self.send(PumpMsg::AddRank {
            key: key.clone(),
            incarnation,
            replay_endpoint: None,
            bootstrap,
            done,
        })
        .await;
        rx.await.expect("the pump acknowledges");
    }

    /// Removes every rank of `url` and waits until the index no longer has them.
    pub async fn remove(&self, url: &str) {
        let (done, rx) = oneshot::channel();
        let url: Arc<str> = Arc::from(url);
        self.send(PumpMsg::RemoveRanks {
            url: url.clone(),
            done,
        })
        .await;
        rx.await.expect("the pump acknowledges");
        let keys: Vec<RankKey> = self
            .status
            .snapshot()
            .into_iter()
            .filter(|s| *s.worker_url == *url)
            .map(|s| RankKey {
                url: url.clone(),
                dp_rank: s.dp_rank,
            })
            .collect();
        for key in keys {
            self.status.remove(&key);
        }
    }

    /// Enqueues the removal of every rank of `url` without waiting for it; the receiver
    /// completes once the pump has removed them (for a test that must let the pump go on only
    /// after the removal is queued).
    pub async fn enqueue_remove(&self, url: &str) -> oneshot::Receiver<()> {
        let (done, rx) = oneshot::channel();
        self.send(PumpMsg::RemoveRanks {
            url: Arc::from(url),
            done,
        })
        .await;
        rx
    }

    /// Returns once everything sent before has been handled (the channel is FIFO).
    pub async fn barrier(&self) {
        let (done, rx) = oneshot::channel();
        self.send(PumpMsg::RemoveRanks {
            url: Arc::from("barrier://"),
            done,
        })
        .await;
        rx.await.expect("the pump acknowledges");
    }

    pub async fn batch(&self, key: &RankKey, incarnation: u64, seq: i64, batch: EventBatch) {
        self.send(PumpMsg::Batch {
            key: key.clone(),
            incarnation,
            seq,
            batch,
        })
        .await;
    }

    pub async fn graft(&self, plan: GraftPlan, targets: Vec<GraftTarget>) -> GraftReceipt {
        let (done, rx) = oneshot::channel();
        self.send(PumpMsg::Graft {
            plan: Box::new(plan),
            targets,
            done,
        })
        .await;
        rx.await.expect("the pump answers a graft offer")
    }

    pub async fn release(&self, key: &RankKey, incarnation: u64, outcome: BootstrapOutcome) {
        self.send(PumpMsg::Release {
            key: key.clone(),
            incarnation,
            outcome,
        })
        .await;
    }

    pub async fn answer_probe(
        &self,
        key: &RankKey,
        incarnation: u64,
        generation: u64,
        highest: Option<i64>,
    ) {
        self.send(PumpMsg::ProbeAnswer {
            key: key.clone(),
            incarnation,
            generation,
            highest,
        })
        .await;
    }

    pub async fn rebuild_from_engine(
        &self,
        key: &RankKey,
        incarnation: u64,
        fallback: BootstrapOutcome,
    ) {
        self.send(PumpMsg::EngineRebuild {
            key: key.clone(),
            incarnation,
            fallback,
        })
        .await;
    }

    pub fn status(&self, key: &RankKey) -> Option<RankStatus> {
        self.status
            .snapshot()
            .into_iter()
            .find(|s| *s.worker_url == *key.url && s.dp_rank == key.dp_rank)
    }
}

/// Feeds batches to a [`PumpDriver`]'s pump from another task.
#[derive(Clone)]
pub struct PumpSender {
    tx: mpsc::Sender<PumpMsg>,
}

impl PumpSender {
    pub async fn batch(&self, key: &RankKey, incarnation: u64, seq: i64, batch: EventBatch) {
        let msg = PumpMsg::Batch {
            key: key.clone(),
            incarnation,
            seq,
            batch,
        };
        assert!(self.tx.send(msg).await.is_ok(), "the pump stopped");
    }
}

impl Drop for PumpDriver {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
