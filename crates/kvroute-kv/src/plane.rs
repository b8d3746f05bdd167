//! [`KvPlane`]: the router-facing handle of the KV plane (register and remove workers, read each
//! model's index, inspect ranks).
//!
//! One prefix index and one pump per model, because block sizes and prefixes are per model: a
//! request for model A can never hit blocks of model B, and mixing them would only dilute shards.
//! The model's block size is fixed by its first worker; a worker reporting another one is refused
//! (its events would be counted and skipped by the index anyway, so accepting it would only
//! produce a rank that silently never matches).
//!
//! Registration and removal are serialised by an async admin lock so a concurrent add and remove
//! of one URL cannot interleave their pump acknowledgements; reads (`model_view`, `rank_states`,
//! `engine_load`) take only short synchronous locks and never wait on the admin lock.
//!
//! Peer bootstrap (see [`crate::bootstrap`]) is opt-in per registration
//! ([`KvPlane::add_worker_bootstrapping`]); the service drives it through the `graft`,
//! `release_rank`, `answer_probe` and `rebuild_from_engine` methods, which only enqueue pump
//! messages, and reads what the pumps report from the one events channel it takes at startup.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_index::{GRAFT_SLICE_ITEMS_MAX, GraftPlan, IndexConfig, IndexReader, PrefixIndex};
use kvroute_wire::LoadStat;
use parking_lot::RwLock;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::bootstrap::{
    BOOTSTRAP_EVENTS_CAPACITY, BootstrapEvent, GraftReceipt, GraftTarget, SPLICE_PROBE_INTERVAL_MS,
};
use crate::discovery::{DiscoveryError, KvEventsConfig};
use crate::engine_loads::EngineLoads;
use crate::metrics::KvMetrics;
use crate::pump::{PUMP_CHANNEL_CAPACITY, Pump, PumpConfig, PumpMsg};
use crate::rank_state::BootstrapOutcome;
use crate::status::{RankKey, RankStatus, StatusTable};
use crate::subscriber::{SubscriberCtx, run_kv_subscriber, run_load_subscriber};
use crate::transport::ZmqSource;

/// Default shard count of each model's index.
pub const DEFAULT_SHARD_COUNT: usize = 64;
/// Default cap on carried (rank, block) pairs per model index: the index's own default.
pub const DEFAULT_CARRIED_BLOCKS_MAX: usize =
    kvroute_index::index::DEFAULT_CARRIED_BLOCKS_MAX as usize;

#[derive(Debug, Clone)]
pub struct KvPlaneConfig {
    pub shard_count: usize,
    pub max_carried_blocks: usize,
    /// Block size used for workers that do not report one (vLLM, or SGLang without a page size).
    pub default_block_size: Option<u32>,
    /// Work per graft slice (see `kvroute_index::IndexWriter::graft_step`): what a live batch of
    /// another rank may wait behind while a snapshot is grafted.
    pub graft_slice_items: usize,
    /// Pause before each sibling-cursor probe of a deferred splice proof.
    pub splice_probe_interval_ms: u64,
}

impl Default for KvPlaneConfig {
    fn default() -> Self {
        Self {
            shard_count: DEFAULT_SHARD_COUNT,
            max_carried_blocks: DEFAULT_CARRIED_BLOCKS_MAX,
            default_block_size: None,
            graft_slice_items: GRAFT_SLICE_ITEMS_MAX,
            splice_probe_interval_ms: SPLICE_PROBE_INTERVAL_MS,
        }
    }
}

/// What routing needs of one model's index.
#[derive(Clone)]
pub struct ModelView {
    pub reader: IndexReader,
    pub block_size: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum KvPlaneError {
    #[error("registering KV metrics failed: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("worker {url} is already registered (remove it first)")]
    WorkerAlreadyRegistered { url: String },
    #[error("worker {url} is not registered")]
    WorkerNotFound { url: String },
    #[error(
        "worker {url} reports no KV block size and no default is configured; model {model} cannot be indexed"
    )]
    BlockSizeUnknown { url: String, model: String },
    #[error(
        "worker {url} uses KV block size {worker_block_size} but model {model} is indexed with {model_block_size}; refused"
    )]
    BlockSizeMismatch {
        url: String,
        model: String,
        model_block_size: u32,
        worker_block_size: u32,
    },
    #[error("worker endpoint: {0}")]
    Endpoint(#[from] DiscoveryError),
    #[error("the KV plane is shut down")]
    ShuttingDown,
    #[error("the pump of model {model} is gone")]
    PumpGone { model: String },
    #[error(
        "worker {url} asks for peer bootstrap but nobody took the bootstrap events (take_bootstrap_events)"
    )]
    BootstrapEventsNotTaken { url: String },
    #[error("model {model} has no index")]
    ModelNotFound { model: String },
}

struct ModelEntry {
    block_size: u32,
    reader: IndexReader,
    tx: mpsc::Sender<PumpMsg>,
    pump: JoinHandle<()>,
}

struct WorkerEntry {
    model: String,
    dp_size: u32,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

struct Inner {
    cfg: KvPlaneConfig,
    metrics: KvMetrics,
    source: Arc<ZmqSource>,
    models: RwLock<HashMap<String, ModelEntry>>,
    /// Held across the awaits of add/remove; see the module doc.
    workers: Mutex<HashMap<String, WorkerEntry>>,
    status: Arc<StatusTable>,
    loads: Arc<EngineLoads>,
    next_incarnation: AtomicU64,
    shutdown: CancellationToken,
    events_tx: mpsc::Sender<BootstrapEvent>,
    /// Handed out once; `None` afterwards.
    events_rx: parking_lot::Mutex<Option<mpsc::Receiver<BootstrapEvent>>>,
}

/// The KV plane. Cheap to clone; all clones share one state.
#[derive(Clone)]
pub struct KvPlane {
    inner: Arc<Inner>,
}

impl KvPlane {
    pub fn new(cfg: KvPlaneConfig, metrics: &prometheus::Registry) -> Result<Self, KvPlaneError> {
        let metrics = KvMetrics::register(metrics)?;
        let (events_tx, events_rx) = mpsc::channel(BOOTSTRAP_EVENTS_CAPACITY);
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                metrics,
                source: Arc::new(ZmqSource),
                models: RwLock::new(HashMap::new()),
                workers: Mutex::new(HashMap::new()),
                status: Arc::new(StatusTable::default()),
                loads: Arc::new(EngineLoads::new()),
                next_incarnation: AtomicU64::new(1),
                shutdown: CancellationToken::new(),
                events_tx,
                events_rx: parking_lot::Mutex::new(Some(events_rx)),
            }),
        })
    }

    /// Registers `url`'s ranks under `model` and starts their subscribers in the background.
    /// Returns the registration's incarnation (distinct for every registration, so a re-added
    /// worker never receives its previous registration's late events).
    pub async fn add_worker(
        &self,
        url: &str,
        model: &str,
        kv: KvEventsConfig,
    ) -> Result<u64, KvPlaneError> {
        self.register(url, model, kv, false).await
    }

    /// [`Self::add_worker`] for a worker whose ranks bootstrap from a sibling's snapshot: each
    /// rank holds its live batches until the service grafts a snapshot
    /// ([`Self::graft`]) or releases it ([`Self::release_rank`]), and each reports exactly one
    /// [`BootstrapEvent::Finished`]. Refused until the bootstrap events were taken
    /// ([`Self::take_bootstrap_events`]), since a rank whose reports nobody reads would hold
    /// readiness (and, once the channel fills, the pump) forever.
    pub async fn add_worker_bootstrapping(
        &self,
        url: &str,
        model: &str,
        kv: KvEventsConfig,
    ) -> Result<u64, KvPlaneError> {
        if self.inner.events_rx.lock().is_some() {
            return Err(KvPlaneError::BootstrapEventsNotTaken {
                url: url.to_string(),
            });
        }
        self.register(url, model, kv, true).await
    }

    /// The pumps' bootstrap reports (bounded by `BOOTSTRAP_EVENTS_CAPACITY`; a full channel
    /// makes the pumps wait). Handed out once; `None` afterwards. Drain it from a task that never
    /// waits on the plane (see [`crate::bootstrap`]).
    pub fn take_bootstrap_events(&self) -> Option<mpsc::Receiver<BootstrapEvent>> {
        self.inner.events_rx.lock().take()
    }

    /// Offers a validated snapshot of `model`'s index (built off the pump with
    /// `GraftPlan::new`) to `targets`. The pump grafts it, in slices, for the ranks that take it;
    /// the receipt says what each rank did with the offer and arrives when the offer is made,
    /// which can be after a graft already running completes. How each bootstrap ends comes as a
    /// [`BootstrapEvent`].
    pub async fn graft(
        &self,
        model: &str,
        plan: GraftPlan,
        targets: Vec<GraftTarget>,
    ) -> Result<GraftReceipt, KvPlaneError> {
        let tx = self.pump_of(model)?;
        let (done, receipt) = oneshot::channel();
        let gone = || KvPlaneError::PumpGone {
            model: model.to_string(),
        };
        let msg = PumpMsg::Graft {
            plan: Box::new(plan),
            targets,
            done,
        };
        tx.send(msg).await.map_err(|_| gone())?;
        receipt.await.map_err(|_| gone())
    }

    /// Ends a holding (or rebuilding) rank's bootstrap without a graft, with the caller's reason
    /// (`abandoned`, `uncovered`, `empty`, ...): its held batches apply and it runs cold. Ignored
    /// for a rank in another phase (a graft in place is judged by its own proof), for a removed
    /// rank and for an older incarnation.
    pub async fn release_rank(
        &self,
        key: &RankKey,
        incarnation: u64,
        outcome: BootstrapOutcome,
    ) -> Result<(), KvPlaneError> {
        let msg = PumpMsg::Release {
            key: key.clone(),
            incarnation,
            outcome,
        };
        self.send_to_rank(key, msg).await
    }

    /// The siblings' answer to a [`BootstrapEvent::ProbeSiblings`]: the highest cursor any of
    /// them reports for the rank (`None` when none names it).
    pub async fn answer_probe(
        &self,
        key: &RankKey,
        incarnation: u64,
        generation: u64,
        highest: Option<i64>,
    ) -> Result<(), KvPlaneError> {
        let msg = PumpMsg::ProbeAnswer {
            key: key.clone(),
            incarnation,
            generation,
            highest,
        };
        self.send_to_rank(key, msg).await
    }

    /// No sibling is warm: rebuild the holding rank from its engine's replay buffer if that still
    /// reaches back to seq 0, else (or without a replay socket) release it with `fallback`.
    pub async fn rebuild_from_engine(
        &self,
        key: &RankKey,
        incarnation: u64,
        fallback: BootstrapOutcome,
    ) -> Result<(), KvPlaneError> {
        let msg = PumpMsg::EngineRebuild {
            key: key.clone(),
            incarnation,
            fallback,
        };
        self.send_to_rank(key, msg).await
    }

    /// Sends `msg` to the pump of `key`'s model; a rank that is not registered is ignored, like a
    /// stale incarnation is by the pump.
    async fn send_to_rank(&self, key: &RankKey, msg: PumpMsg) -> Result<(), KvPlaneError> {
        let Some(model) = self.inner.status.model_of(key) else {
            tracing::debug!(worker = %key.url, dp_rank = key.dp_rank,
                "bootstrap input for an unregistered rank ignored");
            return Ok(());
        };
        let tx = self.pump_of(&model)?;
        tx.send(msg)
            .await
            .map_err(|_| KvPlaneError::PumpGone { model })
    }

    fn pump_of(&self, model: &str) -> Result<mpsc::Sender<PumpMsg>, KvPlaneError> {
        self.inner
            .models
            .read()
            .get(model)
            .map(|m| m.tx.clone())
            .ok_or_else(|| KvPlaneError::ModelNotFound {
                model: model.to_string(),
            })
    }

    async fn register(
        &self,
        url: &str,
        model: &str,
        kv: KvEventsConfig,
        bootstrap: bool,
    ) -> Result<u64, KvPlaneError> {
        let inner = &self.inner;
        let mut workers = inner.workers.lock().await;
        if inner.shutdown.is_cancelled() {
            return Err(KvPlaneError::ShuttingDown);
        }
        if workers.contains_key(url) {
            return Err(KvPlaneError::WorkerAlreadyRegistered {
                url: url.to_string(),
            });
        }
        let Some(block_size) = kv.block_size.or(inner.cfg.default_block_size) else {
            return Err(KvPlaneError::BlockSizeUnknown {
                url: url.to_string(),
                model: model.to_string(),
            });
        };
        if kv.dp_size == 0 || kv.dp_size > crate::discovery::DP_SIZE_MAX {
            return Err(KvPlaneError::Endpoint(DiscoveryError::BadKvEvents(
                format!(
                    "dp_size {} outside 1..={}",
                    kv.dp_size,
                    crate::discovery::DP_SIZE_MAX
                ),
            )));
        }
        // Resolve every endpoint before touching any state, so a bad config leaves nothing behind.
        let mut endpoints = Vec::with_capacity(kv.dp_size as usize);
        for dp_rank in 0..kv.dp_size {
            endpoints.push((
                dp_rank,
                kv.kv_endpoint(dp_rank)?,
                kv.replay_endpoint(dp_rank)?,
                kv.load_endpoint(dp_rank)?,
            ));
        }
        let tx = self.model_pump(url, model, block_size)?;

        let incarnation = inner.next_incarnation.fetch_add(1, Ordering::Relaxed);
        let url_arc: Arc<str> = Arc::from(url);
        let cancel = inner.shutdown.child_token();
        let mut tasks = Vec::new();
        for (dp_rank, kv_endpoint, replay_endpoint, load) in endpoints {
            let key = RankKey {
                url: url_arc.clone(),
                dp_rank,
            };
            inner.status.insert(key.clone(), model, incarnation);
            let (done_tx, done_rx) = oneshot::channel();
            let add = PumpMsg::AddRank {
                key: key.clone(),
                incarnation,
                replay_endpoint,
                bootstrap,
                done: done_tx,
            };
            let gone = || KvPlaneError::PumpGone {
                model: model.to_string(),
            };
            if tx.send(add).await.is_err() || done_rx.await.is_err() {
                cancel.cancel();
                for dp in 0..=dp_rank {
                    inner.status.remove(&RankKey {
                        url: url_arc.clone(),
                        dp_rank: dp,
                    });
                }
                return Err(gone());
            }
            let ctx = |endpoint: String, topic: String| SubscriberCtx {
                source: inner.source.clone(),
                endpoint,
                topic,
                key: key.clone(),
                incarnation,
                tx: tx.clone(),
                cancel: cancel.clone(),
                status: inner.status.clone(),
                metrics: inner.metrics.clone(),
            };
            tasks.push(tokio::spawn(run_kv_subscriber(ctx(
                kv_endpoint,
                kv.topic.clone(),
            ))));
            if let Some((load_endpoint, load_topic)) = load {
                tasks.push(tokio::spawn(run_load_subscriber(ctx(
                    load_endpoint,
                    load_topic,
                ))));
            }
        }
        tracing::info!(
            worker = url,
            model,
            block_size,
            dp_size = kv.dp_size,
            incarnation,
            bootstrap,
            "worker registered with the KV plane"
        );
        workers.insert(
            url.to_string(),
            WorkerEntry {
                model: model.to_string(),
                dp_size: kv.dp_size,
                cancel,
                tasks,
            },
        );
        Ok(incarnation)
    }

    /// The model's pump sender, creating the model's index and pump on first use.
    fn model_pump(
        &self,
        url: &str,
        model: &str,
        block_size: u32,
    ) -> Result<mpsc::Sender<PumpMsg>, KvPlaneError> {
        let inner = &self.inner;
        let mut models = inner.models.write();
        if let Some(entry) = models.get(model) {
            if entry.block_size != block_size {
                inner.metrics.block_size_mismatch.inc();
                tracing::warn!(
                    worker = url,
                    model,
                    model_block_size = entry.block_size,
                    worker_block_size = block_size,
                    "worker refused: its KV block size differs from the model's"
                );
                return Err(KvPlaneError::BlockSizeMismatch {
                    url: url.to_string(),
                    model: model.to_string(),
                    model_block_size: entry.block_size,
                    worker_block_size: block_size,
                });
            }
            return Ok(entry.tx.clone());
        }
        let (writer, reader) = PrefixIndex::new(IndexConfig {
            block_size,
            shard_count: inner.cfg.shard_count,
            max_carried_blocks: inner.cfg.max_carried_blocks as u64,
        });
        let (tx, rx) = mpsc::channel(PUMP_CHANNEL_CAPACITY);
        let pump = Pump::new(
            writer,
            inner.source.clone(),
            tx.clone(),
            inner.metrics.clone(),
            inner.status.clone(),
            inner.loads.clone(),
            inner.shutdown.child_token(),
            PumpConfig {
                model: Arc::from(model),
                graft_slice_items: inner.cfg.graft_slice_items.max(1),
                probe_interval: Duration::from_millis(inner.cfg.splice_probe_interval_ms),
                events: inner.events_tx.clone(),
                on_apply: None,
                on_slice: None,
                held_bytes_total_max: crate::rank_state::BOOTSTRAP_HELD_BYTES_TOTAL_MAX,
            },
        );
        let handle = tokio::spawn(pump.run(rx));
        models.insert(
            model.to_string(),
            ModelEntry {
                block_size,
                reader,
                tx: tx.clone(),
                pump: handle,
            },
        );
        tracing::info!(model, block_size, "model index created");
        Ok(tx)
    }

    /// Stops the worker's subscribers and removes all its ranks from the index before returning.
    pub async fn remove_worker(&self, url: &str) -> Result<(), KvPlaneError> {
        let inner = &self.inner;
        let mut workers = inner.workers.lock().await;
        let Some(entry) = workers.remove(url) else {
            return Err(KvPlaneError::WorkerNotFound {
                url: url.to_string(),
            });
        };
        entry.cancel.cancel();
        for task in entry.tasks {
            // A task that panicked is already stopped, which is all removal needs.
            let _ = task.await;
        }
        let url_arc: Arc<str> = Arc::from(url);
        let tx = inner.models.read().get(&entry.model).map(|m| m.tx.clone());
        let mut result = Ok(());
        if let Some(tx) = tx {
            let (done_tx, done_rx) = oneshot::channel();
            let msg = PumpMsg::RemoveRanks {
                url: url_arc.clone(),
                done: done_tx,
            };
            if tx.send(msg).await.is_err() || done_rx.await.is_err() {
                result = Err(KvPlaneError::PumpGone {
                    model: entry.model.clone(),
                });
            }
        }
        for dp_rank in 0..entry.dp_size {
            let key = RankKey {
                url: url_arc.clone(),
                dp_rank,
            };
            inner.status.remove(&key);
            inner.loads.remove_rank(&key);
            inner.metrics.forget_rank(url, dp_rank);
        }
        tracing::info!(worker = url, model = %entry.model, "worker removed from the KV plane");
        result
    }

    pub fn model_view(&self, model: &str) -> Option<ModelView> {
        self.inner.models.read().get(model).map(|m| ModelView {
            reader: m.reader.clone(),
            block_size: m.block_size,
        })
    }

    pub fn rank_states(&self) -> Vec<RankStatus> {
        self.inner.status.snapshot()
    }

    pub fn engine_load(&self, url: &str, dp_rank: u32) -> Option<LoadStat> {
        self.inner.loads.get(url, dp_rank)
    }

    /// Every rank's engine-reported load and index occupancy of the worker at `url`, read under
    /// one lock (the routing path reads all ranks of every worker per request).
    pub fn with_engine_loads<R>(
        &self,
        url: &str,
        read: impl FnOnce(&[crate::engine_loads::RankSlot]) -> R,
    ) -> R {
        self.inner.loads.with_worker(url, read)
    }

    /// Stops every subscriber, replay and pump task and waits for them.
    pub async fn shutdown(&self) {
        let inner = &self.inner;
        let mut workers = inner.workers.lock().await;
        inner.shutdown.cancel();
        for (_, entry) in workers.drain() {
            for task in entry.tasks {
                let _ = task.await;
            }
        }
        let pumps: Vec<JoinHandle<()>> =
            inner.models.write().drain().map(|(_, m)| m.pump).collect();
        for pump in pumps {
            let _ = pump.await;
        }
    }
}
