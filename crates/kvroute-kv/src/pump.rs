//! The pump: the one task per model that owns the model's `IndexWriter`.
//!
//! Subscriber, load and replay tasks never touch the index; they send [`PumpMsg`]s through one
//! bounded channel (`PUMP_CHANNEL_CAPACITY`), which gives the index a single writer without
//! locks and gives every rank a total order of its inputs. A full channel back-pressures the
//! subscribers (the engine's PUB then drops for us, which the sequence numbers reveal as a gap)
//! rather than growing memory.
//!
//! Per-rank ordering decisions are delegated to the pure [`RankMachine`]; this module only routes
//! messages to the right rank (dropping those of removed ranks or old incarnations), executes the
//! machine's actions against the index, starts replay tasks, and mirrors state into metrics and
//! the status table. Registration and removal also go through the channel with an acknowledgement,
//! which is how `remove_worker` knows the ranks are gone from the index before it returns.
//!
//! **Peer bootstrap.** A sibling's snapshot is grafted here, because the graft must share nodes
//! with the live ranks and only the writer may touch them. A one-shot graft of a fleet-sized
//! snapshot would stop every other rank's live stream for about half a second, so the pump runs
//! ONE graft job at a time in slices of `graft_slice_items`, and between two slices handles every
//! message already waiting in its channel: a live batch of another rank waits for at most about
//! one slice. The rank machine's contract is that a rank's graft completes before any later action
//! of that rank runs; the pump keeps it by queueing the actions of a rank under graft (from the
//! graft itself and from inputs arriving meanwhile) and running them, in order, when the job is
//! done. That queue is bounded (`GRAFT_DEFERRED_ACTIONS_MAX`, `GRAFT_DEFERRED_MAX_BYTES`); a rank
//! that outgrows it makes the pump finish the job at once, trading one long stall for bounded
//! memory. A second graft that arrives while one runs waits its turn (`GRAFTS_QUEUED_MAX`).
//! A finished job is freed on a blocking thread, because returning a fleet-sized snapshot's
//! memory takes longer than a slice.
//!
//! Two other stalls of the writer are the pump's to schedule: a rank's side map grows by a
//! rehash that reads every entry's node (milliseconds for a large rank), and ranks of one size
//! fed at one rate would all grow within the same few milliseconds. The pump takes those steps a
//! little ahead of need, one rank at a time (`SIDE_MAP_PREGROW_SPACING_MS`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_index::{
    ApplyReport, GraftJob, GraftPlan, GraftProgress, GraftReport, IndexWriter, RankId,
    SkippedBlocks,
};
use kvroute_wire::snapshot::RankRef;
use kvroute_wire::{EventBatch, KvEvent, LoadStat};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::bootstrap::{BootstrapEvent, GraftDisposition, GraftReceipt, GraftTarget};
use crate::engine_loads::EngineLoads;
use crate::metrics::{DEVICE_TIER, KvMetrics, TIER_LABELS};
use crate::rank_state::{
    Action, BootstrapOutcome, GraftHistory, HeldCost, Phase, RankMachine, ReplayAnswer,
};
use crate::status::{BootstrapState, RankKey, SequencingProgress, StatusTable};
use crate::transport::KvSource;

/// Messages queued to one model's pump before senders wait.
pub const PUMP_CHANNEL_CAPACITY: usize = 4096;

/// Grafts waiting behind the running one. Past this the running graft is finished at once: the
/// coordinator delivers one fleet-wide graft at a time plus the odd gap retry, so a longer queue
/// means the caller misbehaves, and memory (each graft holds a snapshot) must stay bounded.
pub const GRAFTS_QUEUED_MAX: usize = 4;

/// Actions one rank may queue behind its running graft: its held batches at graft time plus what
/// arrives while the job runs.
pub const GRAFT_DEFERRED_ACTIONS_MAX: usize = 2 * crate::rank_state::BOOTSTRAP_HELD_BATCHES_MAX;

/// Estimated bytes ([`HeldCost`]) of the batches one rank may queue behind its running graft.
pub const GRAFT_DEFERRED_MAX_BYTES: u64 = 2 * crate::rank_state::BOOTSTRAP_HELD_BYTES_MAX;

/// Messages handled between two graft slices when the channel keeps delivering, so a flooded
/// channel cannot stop the graft from progressing.
pub const GRAFT_MSGS_BETWEEN_SLICES_MAX: usize = 1024;

/// Side maps below this many entries grow inside `apply_batch` as they fill: their rehash is
/// cheap (about a millisecond).
pub const SIDE_MAP_PREGROW_ENTRIES_MIN: usize = 16_384;

/// Least time between two side-map growth steps the pump takes ahead of need. Each step of a
/// large rank stalls the pump for milliseconds (a rehash that reads every entry's node); ranks
/// of one size fed at one rate would otherwise all step within the same few milliseconds and
/// stall it for their sum. Taking the steps a little early (within an eighth of capacity, which
/// a map sized for its entries, as a graft leaves it, is not yet) and spaced out turns that into
/// separate stalls. The spacing is above one step of a 100,000-entry rank (15-35 ms measured),
/// so the pump catches up between two steps.
pub const SIDE_MAP_PREGROW_SPACING_MS: u64 = 50;

/// Replays one model's pump has in flight at once; more wait for a permit, in the order asked.
/// Each answer is bounded by itself ([`crate::transport::REPLAY_BATCHES_MAX`],
/// [`crate::transport::REPLAY_TOTAL_MAX_BYTES`]); this bounds their sum, which the ranks would
/// otherwise multiply: every rank of a restarted fleet asks its engine for its stream from seq 0
/// at once, and so does every rank of a partial graft.
pub const REPLAYS_IN_FLIGHT_MAX: usize = 16;

/// Called with each batch the pump applies (rank, seq); benchmarks time the apply path with it.
pub type ApplyObserver = Arc<dyn Fn(&RankKey, i64) + Send + Sync>;

/// Called after each graft slice with its duration.
pub type SliceObserver = Arc<dyn Fn(Duration) + Send + Sync>;

pub enum PumpMsg {
    Batch {
        key: RankKey,
        incarnation: u64,
        seq: i64,
        batch: EventBatch,
    },
    /// The rank's SUB (re)connected.
    Reconnected { key: RankKey, incarnation: u64 },
    ReplayResult {
        key: RankKey,
        incarnation: u64,
        generation: u64,
        answer: ReplayAnswer<EventBatch>,
    },
    AddRank {
        key: RankKey,
        incarnation: u64,
        replay_endpoint: Option<String>,
        /// The rank holds its live batches until a graft or a release.
        bootstrap: bool,
        done: oneshot::Sender<()>,
    },
    /// Removes every rank of `url` from the index, then acknowledges.
    RemoveRanks {
        url: Arc<str>,
        done: oneshot::Sender<()>,
    },
    Load {
        key: RankKey,
        incarnation: u64,
        stat: LoadStat,
    },
    /// Offers a validated snapshot to `targets`; answered once the offer is made (after any
    /// graft running before it), not when the graft completes.
    Graft {
        plan: Box<GraftPlan>,
        targets: Vec<GraftTarget>,
        done: oneshot::Sender<GraftReceipt>,
    },
    /// Ends a holding (or rebuilding) rank's bootstrap without a graft.
    Release {
        key: RankKey,
        incarnation: u64,
        outcome: BootstrapOutcome,
    },
    ProbeAnswer {
        key: RankKey,
        incarnation: u64,
        generation: u64,
        highest: Option<i64>,
    },
    /// Rebuild the rank from the engine's replay buffer; a rank that cannot (no replay socket) is
    /// released with `fallback` instead, so the request always leads to an outcome.
    EngineRebuild {
        key: RankKey,
        incarnation: u64,
        fallback: BootstrapOutcome,
    },
}

/// How a pump runs, beyond what it shares with the plane.
#[derive(Clone)]
pub(crate) struct PumpConfig {
    /// The model, for per-model gauges.
    pub model: Arc<str>,
    pub graft_slice_items: usize,
    pub probe_interval: Duration,
    pub events: mpsc::Sender<BootstrapEvent>,
    pub on_apply: Option<ApplyObserver>,
    pub on_slice: Option<SliceObserver>,
    /// Bytes all bootstrapping ranks of the model may hold together
    /// (`rank_state::BOOTSTRAP_HELD_BYTES_TOTAL_MAX` unless a test lowers it).
    pub held_bytes_total_max: u64,
}

struct PumpRank {
    incarnation: u64,
    rank_id: RankId,
    machine: RankMachine<EventBatch>,
    replay_endpoint: Option<String>,
    bootstrap: bool,
    /// The outcome reported to the service (the machine may know it earlier, while the report
    /// waits behind the rank's graft).
    settled: Option<BootstrapOutcome>,
    /// (batches, bytes) this rank currently adds to the model's held gauges.
    gauged: (u64, u64),
    /// Blocks this incarnation's batches named that the index did not take, by reason.
    skipped: SkippedBlocks,
    /// The rank's events did not fit the model's block size (a foreign block size or token
    /// count); said once per incarnation, since every later batch of the rank says it again.
    warned_misfit: bool,
}

/// Actions of one rank waiting for the running graft, with the batches among them.
#[derive(Default)]
struct Deferred {
    actions: VecDeque<Action<EventBatch>>,
    batches: u64,
    bytes: u64,
}

impl Deferred {
    fn push(&mut self, action: Action<EventBatch>) {
        if let Action::Apply { batch, .. } = &action {
            self.batches += 1;
            self.bytes += batch.held_bytes();
        }
        self.actions.push_back(action);
    }

    fn over_limits(&self) -> bool {
        self.actions.len() > GRAFT_DEFERRED_ACTIONS_MAX || self.bytes > GRAFT_DEFERRED_MAX_BYTES
    }
}

struct ActiveGraft {
    job: GraftJob,
    ranks: HashMap<RankKey, Deferred>,
    started: Instant,
    slices: u64,
}

struct QueuedGraft {
    plan: Box<GraftPlan>,
    targets: Vec<GraftTarget>,
    done: oneshot::Sender<GraftReceipt>,
}

pub(crate) struct Pump<S: KvSource> {
    pub writer: IndexWriter,
    pub source: Arc<S>,
    pub tx: mpsc::Sender<PumpMsg>,
    pub metrics: KvMetrics,
    pub status: Arc<StatusTable>,
    pub loads: Arc<EngineLoads>,
    pub cancel: CancellationToken,
    cfg: PumpConfig,
    ranks: HashMap<RankKey, PumpRank>,
    actions: Vec<Action<EventBatch>>,
    graft: Option<ActiveGraft>,
    queued_grafts: VecDeque<QueuedGraft>,
    /// Events the service's channel had no room for yet, in order; the run loop delivers them
    /// before it takes another message (back-pressure). At most what one message produced.
    unsent: VecDeque<BootstrapEvent>,
    last_pregrow: Option<Instant>,
    /// Bytes every bootstrapping rank holds together (the sum of `PumpRank::gauged.1`).
    held_bytes_total: u64,
    /// [`REPLAYS_IN_FLIGHT_MAX`] permits; a replay task holds one until its answer is queued.
    replay_permits: Arc<Semaphore>,
}

impl<S: KvSource> Pump<S> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        writer: IndexWriter,
        source: Arc<S>,
        tx: mpsc::Sender<PumpMsg>,
        metrics: KvMetrics,
        status: Arc<StatusTable>,
        loads: Arc<EngineLoads>,
        cancel: CancellationToken,
        cfg: PumpConfig,
    ) -> Self {
        Self {
            writer,
            source,
            tx,
            metrics,
            status,
            loads,
            cancel,
            cfg,
            ranks: HashMap::new(),
            actions: Vec::new(),
            graft: None,
            queued_grafts: VecDeque::new(),
            unsent: VecDeque::new(),
            last_pregrow: None,
            held_bytes_total: 0,
            replay_permits: Arc::new(Semaphore::new(REPLAYS_IN_FLIGHT_MAX)),
        }
    }

    pub async fn run(mut self, mut rx: mpsc::Receiver<PumpMsg>) {
        loop {
            if !self.deliver_unsent().await {
                break;
            }
            if self.graft.is_none() {
                let msg = tokio::select! {
                    biased;
                    _ = self.cancel.cancelled() => break,
                    msg = rx.recv() => msg,
                };
                match msg {
                    Some(msg) => self.handle(msg),
                    None => break,
                }
                continue;
            }
            if self.cancel.is_cancelled() {
                break;
            }
            // Grafting: first whatever already waits (live batches of other ranks must not wait
            // behind more than the one slice that was running when they arrived), then a slice.
            let mut handled = 0;
            while handled < GRAFT_MSGS_BETWEEN_SLICES_MAX && self.unsent.is_empty() {
                match rx.try_recv() {
                    Ok(msg) => {
                        self.handle(msg);
                        handled += 1;
                    }
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            if !self.unsent.is_empty() {
                continue;
            }
            self.graft_slice(self.cfg.graft_slice_items);
            // The slices run back to back on this task: let the subscribers and replay tasks
            // sharing the runtime thread run between them.
            tokio::task::yield_now().await;
        }
    }

    /// Delivers the events the channel had no room for; false once cancelled.
    async fn deliver_unsent(&mut self) -> bool {
        while let Some(ev) = self.unsent.pop_front() {
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return false,
                sent = self.cfg.events.send(ev) => {
                    if sent.is_err() {
                        tracing::warn!(model = %self.cfg.model,
                            "bootstrap events dropped: nobody receives them");
                        self.unsent.clear();
                    }
                }
            }
        }
        true
    }

    fn emit(&mut self, ev: BootstrapEvent) {
        if !self.unsent.is_empty() {
            self.unsent.push_back(ev);
            return;
        }
        match self.cfg.events.try_send(ev) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(ev)) => self.unsent.push_back(ev),
            Err(mpsc::error::TrySendError::Closed(ev)) => {
                tracing::warn!(model = %self.cfg.model, event = ?ev,
                    "bootstrap event dropped: nobody receives them");
            }
        }
    }

    fn handle(&mut self, msg: PumpMsg) {
        match msg {
            PumpMsg::Batch {
                key,
                incarnation,
                seq,
                batch,
            } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                rank.machine.on_live_batch(seq, batch, &mut self.actions);
                self.execute(&key);
                self.enforce_held_total();
            }
            PumpMsg::Reconnected { key, incarnation } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                rank.machine.on_reconnect(&mut self.actions);
                self.execute(&key);
            }
            PumpMsg::ReplayResult {
                key,
                incarnation,
                generation,
                answer,
            } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                rank.machine
                    .on_replay_answer(generation, answer, &mut self.actions);
                self.execute(&key);
            }
            PumpMsg::AddRank {
                key,
                incarnation,
                replay_endpoint,
                bootstrap,
                done,
            } => {
                self.drop_rank(&key);
                let rank_id = self.writer.add_rank(RankRef {
                    worker_url: key.url.to_string(),
                    dp_rank: key.dp_rank,
                });
                let has_replay = replay_endpoint.is_some();
                let machine = if bootstrap {
                    RankMachine::new_bootstrapping(has_replay)
                } else {
                    RankMachine::new(has_replay)
                };
                self.ranks.insert(
                    key.clone(),
                    PumpRank {
                        incarnation,
                        rank_id,
                        machine,
                        replay_endpoint,
                        bootstrap,
                        settled: None,
                        gauged: (0, 0),
                        skipped: SkippedBlocks::default(),
                        warned_misfit: false,
                    },
                );
                if bootstrap {
                    self.publish_bootstrap(&key);
                }
                // A rank whose publisher has sent nothing yet counts as empty (or withheld,
                // while bootstrapping) before its first batch: a fresh engine must be fillable.
                let empty = self.ranks[&key].machine.counts_whole_cache().then_some(0);
                self.loads.set_cached_device_blocks(&key, empty);
                let _ = done.send(());
            }
            PumpMsg::RemoveRanks { url, done } => {
                let keys: Vec<RankKey> = self
                    .ranks
                    .keys()
                    .filter(|k| k.url == url)
                    .cloned()
                    .collect();
                for key in keys {
                    self.drop_rank(&key);
                    self.loads.remove_rank(&key);
                }
                let _ = done.send(());
            }
            PumpMsg::Load {
                key,
                incarnation,
                stat,
            } => {
                if current(&mut self.ranks, &key, incarnation).is_some() {
                    self.loads.set(&key, stat);
                }
            }
            PumpMsg::Graft {
                plan,
                targets,
                done,
            } => self.offer_graft(QueuedGraft {
                plan,
                targets,
                done,
            }),
            PumpMsg::Release {
                key,
                incarnation,
                outcome,
            } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                if !rank.machine.on_release(outcome, &mut self.actions) {
                    tracing::debug!(worker = %key.url, dp_rank = key.dp_rank, outcome = outcome.label(),
                        "release ignored: the rank is not holding");
                }
                self.execute(&key);
            }
            PumpMsg::ProbeAnswer {
                key,
                incarnation,
                generation,
                highest,
            } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                rank.machine
                    .on_probe_answer(generation, highest, &mut self.actions);
                self.execute(&key);
            }
            PumpMsg::EngineRebuild {
                key,
                incarnation,
                fallback,
            } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                if !rank.machine.on_engine_rebuild(fallback, &mut self.actions) {
                    rank.machine.on_release(fallback, &mut self.actions);
                }
                self.execute(&key);
            }
        }
    }

    /// Removes a rank from the index (and from a running graft first: until the job files the
    /// rank's side map, removal alone could not find the grafted carriers).
    fn drop_rank(&mut self, key: &RankKey) {
        let Some(rank) = self.ranks.remove(key) else {
            return;
        };
        if let Some(active) = &mut self.graft
            && active.ranks.remove(key).is_some()
        {
            self.writer
                .abandon_graft_rank(&mut active.job, rank.rank_id);
            if active.ranks.is_empty() {
                // Nothing left to graft: the rest of the job would only visit nodes.
                if let Some(active) = self.graft.take() {
                    drop_off_pump(active.job);
                }
                self.metrics.grafts.with_label_values(&["abandoned"]).inc();
            }
        }
        self.writer.remove_rank(rank.rank_id);
        self.gauge_held(rank.gauged, (0, 0));
        if self.graft.is_none() {
            self.start_queued_graft();
        }
    }

    /// Runs a graft now, or queues it behind the running one.
    fn offer_graft(&mut self, graft: QueuedGraft) {
        if self.graft.is_some() {
            if self.queued_grafts.len() < GRAFTS_QUEUED_MAX {
                self.queued_grafts.push_back(graft);
                return;
            }
            tracing::warn!(model = %self.cfg.model, queued = GRAFTS_QUEUED_MAX,
                "graft queue full: finishing the running graft at once");
            self.finish_graft_now();
        }
        self.start_graft(graft);
    }

    fn start_queued_graft(&mut self) {
        while self.graft.is_none() {
            let Some(next) = self.queued_grafts.pop_front() else {
                return;
            };
            self.start_graft(next);
        }
    }

    /// Offers the plan to each target: the ranks whose machine takes it form one job; their
    /// actions after the `Graft` wait for the job.
    fn start_graft(&mut self, graft: QueuedGraft) {
        let QueuedGraft {
            plan,
            targets,
            done,
        } = graft;
        let mut receipt = GraftReceipt {
            ranks: Vec::with_capacity(targets.len()),
        };
        let mut candidates: Vec<(RankKey, RankId, (i64, f64), GraftHistory)> = Vec::new();
        for GraftTarget { key, incarnation } in targets {
            let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                receipt.ranks.push((key, GraftDisposition::Stale));
                continue;
            };
            let rank_ref = RankRef {
                worker_url: key.url.to_string(),
                dp_rank: key.dp_rank,
            };
            let duplicate = candidates.iter().any(|(k, ..)| *k == key);
            match plan.cover(&rank_ref) {
                Some(c) if !duplicate => {
                    let history = if c.partial {
                        GraftHistory::Partial
                    } else {
                        GraftHistory::Complete
                    };
                    let watermark = (c.cursor.seq, c.cursor.ts);
                    candidates.push((key, rank.rank_id, watermark, history))
                }
                Some(_) => receipt.ranks.push((key, GraftDisposition::Declined)),
                None => receipt.ranks.push((key, GraftDisposition::Uncovered)),
            }
        }
        if candidates.is_empty() {
            let _ = done.send(receipt);
            return;
        }
        let ids: Vec<RankId> = candidates.iter().map(|(_, id, ..)| *id).collect();
        let mut job = match self.writer.begin_graft(*plan, &ids) {
            Ok(job) => job,
            Err(e) => {
                tracing::warn!(model = %self.cfg.model, error = %e, "graft refused by the index");
                self.metrics.grafts.with_label_values(&["rejected"]).inc();
                for (key, ..) in candidates {
                    let taken = self.ranks.get_mut(&key).is_some_and(|r| {
                        r.machine
                            .on_release(BootstrapOutcome::Rejected, &mut self.actions)
                    });
                    let disposition = if taken {
                        GraftDisposition::Rejected
                    } else {
                        GraftDisposition::Declined
                    };
                    receipt.ranks.push((key.clone(), disposition));
                    self.execute(&key);
                }
                let _ = done.send(receipt);
                return;
            }
        };
        let mut grafted: HashMap<RankKey, Deferred> = HashMap::new();
        for (key, rank_id, watermark, history) in candidates {
            let mut out = Vec::new();
            let took = self
                .ranks
                .get_mut(&key)
                .is_some_and(|r| r.machine.on_graft(watermark, history, &mut out));
            if !took {
                // Declined before any slice ran, so the job has placed nothing for it.
                job.exclude_rank(rank_id);
                receipt.ranks.push((key, GraftDisposition::Declined));
                continue;
            }
            let mut deferred = Deferred::default();
            for action in out {
                if !matches!(action, Action::Graft { .. }) {
                    deferred.push(action);
                }
            }
            grafted.insert(key.clone(), deferred);
            receipt.ranks.push((key, GraftDisposition::Taken));
        }
        let _ = done.send(receipt);
        if grafted.is_empty() {
            return;
        }
        let keys: Vec<RankKey> = grafted.keys().cloned().collect();
        tracing::info!(model = %self.cfg.model, ranks = keys.len(),
            nodes = job.progress().1, "graft started");
        self.graft = Some(ActiveGraft {
            job,
            ranks: grafted,
            started: Instant::now(),
            slices: 0,
        });
        for key in &keys {
            self.publish_bootstrap(key);
        }
    }

    /// One slice of the running graft; finishes it when the job is done.
    fn graft_slice(&mut self, items_max: usize) {
        let Some(active) = &mut self.graft else {
            return;
        };
        let started = Instant::now();
        let step = self.writer.graft_step(&mut active.job, items_max);
        let took = started.elapsed();
        self.metrics.graft_slice_seconds.observe(took.as_secs_f64());
        if let Some(observe) = &self.cfg.on_slice {
            observe(took);
        }
        active.slices += 1;
        match step {
            Ok(GraftProgress::More { .. }) => {}
            Ok(GraftProgress::Done(report)) => self.finish_graft(Some(report)),
            Err(e) => {
                // Only a job begun on another index fails here, which this pump never does.
                tracing::error!(model = %self.cfg.model, error = %e, "graft slice failed");
                if let Some(mut active) = self.graft.take() {
                    for key in active.ranks.keys() {
                        if let Some(rank) = self.ranks.get(key) {
                            self.writer
                                .abandon_graft_rank(&mut active.job, rank.rank_id);
                        }
                    }
                    self.graft = Some(active);
                }
                self.metrics.grafts.with_label_values(&["failed"]).inc();
                self.finish_graft(None);
            }
        }
    }

    /// Runs the rest of the graft in one go.
    fn finish_graft_now(&mut self) {
        while self.graft.is_some() {
            self.graft_slice(usize::MAX);
        }
    }

    /// The job is over: run each rank's waiting actions in order, then the next graft.
    fn finish_graft(&mut self, report: Option<GraftReport>) {
        let Some(active) = self.graft.take() else {
            return;
        };
        if let Some(report) = report {
            self.metrics.grafts.with_label_values(&["completed"]).inc();
            tracing::info!(model = %self.cfg.model, ranks = active.ranks.len(),
                carriers = report.carriers, nodes = report.nodes, slices = active.slices,
                skipped_nodes = report.skipped_nodes, evicted = report.evicted_carriers,
                ms = active.started.elapsed().as_millis() as u64, "graft completed");
        }
        let ActiveGraft { job, ranks, .. } = active;
        for (key, deferred) in ranks {
            let mut actions = std::mem::take(&mut self.actions);
            actions.extend(deferred.actions);
            self.actions = actions;
            self.execute(&key);
        }
        drop_off_pump(job);
        self.start_queued_graft();
    }

    fn execute(&mut self, key: &RankKey) {
        if let Some(active) = &mut self.graft
            && let Some(deferred) = active.ranks.get_mut(key)
        {
            for action in self.actions.drain(..) {
                deferred.push(action);
            }
            if deferred.over_limits() {
                tracing::warn!(worker = %key.url, dp_rank = key.dp_rank,
                    "actions queued behind the graft passed their bound: finishing the graft at once");
                self.finish_graft_now();
            } else {
                self.publish_bootstrap(key);
            }
            return;
        }
        let Some(rank) = self.ranks.get_mut(key) else {
            self.actions.clear();
            return;
        };
        let mut events = Vec::new();
        let mut applied = false;
        for action in self.actions.drain(..) {
            match action {
                Action::Apply { seq, batch } => {
                    for ev in &batch.events {
                        let kind = match ev {
                            KvEvent::BlockStored(_) => "block_stored",
                            KvEvent::BlockRemoved(_) => "block_removed",
                            KvEvent::AllBlocksCleared => "all_blocks_cleared",
                        };
                        self.metrics.events_applied.with_label_values(&[kind]).inc();
                    }
                    let report = self.writer.apply_batch(rank.rank_id, seq, &batch);
                    if report.skipped.total() > 0 {
                        let model_block_size = self.writer.reader().config().block_size;
                        note_skipped(
                            &self.metrics,
                            &self.status,
                            key,
                            rank,
                            &report,
                            model_block_size,
                        );
                    }
                    self.metrics.batches_applied.inc();
                    applied = true;
                    if let Some(observe) = &self.cfg.on_apply {
                        observe(key, seq);
                    }
                }
                Action::ClearRank => {
                    self.writer.clear_rank(rank.rank_id);
                    // The old cursor speaks of the dead publisher; an exporter must not pair it
                    // with the new stream.
                    self.writer.set_cursor(rank.rank_id, None);
                }
                Action::StartReplay {
                    generation,
                    from_seq,
                    stop_before,
                } => match &rank.replay_endpoint {
                    Some(endpoint) => spawn_replay(
                        self.source.clone(),
                        self.replay_permits.clone(),
                        endpoint.clone(),
                        key.clone(),
                        rank.incarnation,
                        generation,
                        from_seq,
                        stop_before,
                        self.tx.clone(),
                        self.metrics.clone(),
                        self.cancel.clone(),
                    ),
                    None => {
                        // The machine only replays when told an endpoint exists.
                        tracing::error!(worker = %key.url, dp_rank = key.dp_rank,
                            "replay requested for a rank without replay endpoint");
                    }
                },
                Action::Duplicate { .. } => self.metrics.duplicate_batches.inc(),
                Action::Lost { batches } => {
                    self.metrics.lost_batches.inc_by(batches);
                    tracing::debug!(worker = %key.url, dp_rank = key.dp_rank, batches,
                        "KV event batches lost");
                }
                Action::PublisherRestarted => {
                    self.metrics.publisher_restarts.inc();
                    tracing::info!(worker = %key.url, dp_rank = key.dp_rank,
                        "engine publisher restarted; rank cleared");
                }
                Action::ReplayFinished { outcome } => {
                    self.metrics
                        .replays
                        .with_label_values(&[outcome.label()])
                        .inc();
                }
                Action::Graft { .. } => {
                    // Only `on_graft` emits it, and `start_graft` consumes it there.
                    tracing::error!(worker = %key.url, dp_rank = key.dp_rank,
                        "graft action outside a graft offer ignored");
                }
                Action::DiscardGraft => {
                    // Never inside a running job: the rank's actions wait for its graft.
                    self.writer.clear_rank(rank.rank_id);
                    self.writer.set_cursor(rank.rank_id, None);
                }
                Action::ProbeSiblings {
                    generation,
                    watermark,
                } => {
                    let ev = BootstrapEvent::ProbeSiblings {
                        key: key.clone(),
                        incarnation: rank.incarnation,
                        generation,
                        watermark,
                    };
                    if self.cfg.probe_interval.is_zero() {
                        events.push(ev);
                    } else {
                        spawn_paced_probe(
                            ev,
                            self.cfg.probe_interval,
                            self.cfg.events.clone(),
                            self.cancel.clone(),
                        );
                    }
                }
                Action::RequestFreshSnapshot { min_cursor } => {
                    tracing::info!(worker = %key.url, dp_rank = key.dp_rank, min_cursor,
                        "graft not proven: asking for a fresher snapshot");
                    events.push(BootstrapEvent::NeedFreshSnapshot {
                        key: key.clone(),
                        incarnation: rank.incarnation,
                        min_cursor,
                    });
                }
                Action::BootstrapFinished { outcome } => {
                    rank.settled = Some(outcome);
                    self.metrics
                        .bootstrap_outcomes
                        .with_label_values(&[outcome.label()])
                        .inc();
                    tracing::info!(worker = %key.url, dp_rank = key.dp_rank,
                        outcome = outcome.label(), reason = %outcome_reason(outcome),
                        "rank bootstrap settled");
                    events.push(BootstrapEvent::Finished {
                        key: key.clone(),
                        incarnation: rank.incarnation,
                        outcome,
                    });
                }
            }
        }
        let replaying = matches!(rank.machine.phase(), Phase::Replaying { .. });
        self.status.update_from_pump(
            key,
            rank.incarnation,
            SequencingProgress {
                cursor: rank.machine.cursor(),
                history_complete: rank.machine.history_complete(),
                counters: rank.machine.counters(),
                replaying,
            },
            &self.metrics,
        );
        if let Some(stats) = self.writer.reader().rank_stats(rank.rank_id) {
            let dp = key.dp_rank.to_string();
            for (tier, blocks) in TIER_LABELS.iter().zip(stats.tier_blocks) {
                self.metrics
                    .carried_blocks
                    .with_label_values(&[&*key.url, dp.as_str(), tier])
                    .set(blocks as i64);
            }
            // The routing path prices displacement by this count, so it is only offered while
            // it is the engine's whole cache: a rank joined mid-stream, or one that lost a
            // batch, counts fewer blocks than the engine holds and would look roomier than it
            // is (`engine_loads`, `RankMachine::counts_whole_cache`).
            let device_blocks = rank
                .machine
                .counts_whole_cache()
                .then_some(stats.tier_blocks[DEVICE_TIER]);
            self.loads.set_cached_device_blocks(key, device_blocks);
        }
        let (bootstrap, rank_id) = (rank.bootstrap, rank.rank_id);
        if applied {
            self.pregrow_side_map(rank_id);
        }
        // The status table first: whoever hears a `Finished` (readiness, then anyone reading
        // `/workers`) must find the rank's outcome there already.
        if bootstrap {
            self.publish_bootstrap(key);
        }
        for ev in events {
            self.emit(ev);
        }
    }

    /// Takes the rank's next side-map growth step now if it is near (see
    /// `SIDE_MAP_PREGROW_SPACING_MS`), unless another rank took one too recently.
    fn pregrow_side_map(&mut self, rank: RankId) {
        let Some((room, entries)) = self.writer.side_map_room(rank) else {
            return;
        };
        let near = entries >= SIDE_MAP_PREGROW_ENTRIES_MIN && room * 8 <= room + entries;
        let spacing = Duration::from_millis(SIDE_MAP_PREGROW_SPACING_MS);
        if !near || self.last_pregrow.is_some_and(|t| t.elapsed() < spacing) {
            return;
        }
        self.writer.grow_side_map(rank);
        self.last_pregrow = Some(Instant::now());
    }

    /// Mirrors a bootstrapping rank's state and held amounts into the status table and gauges.
    fn publish_bootstrap(&mut self, key: &RankKey) {
        let deferred = self.graft.as_ref().and_then(|g| g.ranks.get(key));
        let Some(rank) = self.ranks.get_mut(key) else {
            return;
        };
        let machine_held = if rank.machine.is_bootstrapping() {
            (rank.machine.held_len() as u64, rank.machine.held_bytes())
        } else {
            (0, 0)
        };
        let held = match deferred {
            Some(d) => (machine_held.0 + d.batches, machine_held.1 + d.bytes),
            None => machine_held,
        };
        let state = if deferred.is_some() {
            BootstrapState::Grafting
        } else if let Some(outcome) = rank.settled {
            BootstrapState::Settled(outcome)
        } else {
            match rank.machine.phase() {
                Phase::Holding { .. } => BootstrapState::Holding,
                Phase::Healing { .. } => BootstrapState::Healing,
                Phase::Proving { .. } => BootstrapState::Proving,
                Phase::Rebuilding { .. } => BootstrapState::Rebuilding,
                // Between the machine's outcome and its report (never observable outside).
                Phase::Live | Phase::Replaying { .. } => BootstrapState::Holding,
            }
        };
        let before = std::mem::replace(&mut rank.gauged, held);
        self.status
            .set_bootstrap(key, rank.incarnation, state, held.0, held.1);
        self.gauge_held(before, held);
    }

    /// Keeps what all bootstrapping ranks hold together under `held_bytes_total_max`: the rank
    /// holding the most is released cold (`overflow`), then the next, until the total fits.
    /// Ranks whose actions wait behind a running graft are not candidates (what they hold is the
    /// graft job's, and it is bounded by the job).
    fn enforce_held_total(&mut self) {
        while self.held_bytes_total > self.cfg.held_bytes_total_max {
            let deferred =
                |k: &RankKey| self.graft.as_ref().is_some_and(|g| g.ranks.contains_key(k));
            let Some(key) = self
                .ranks
                .iter()
                .filter(|(k, r)| r.gauged.1 > 0 && !deferred(k))
                .max_by_key(|(_, r)| r.gauged.1)
                .map(|(k, _)| k.clone())
            else {
                return;
            };
            let Some(rank) = self.ranks.get_mut(&key) else {
                return;
            };
            if !rank.machine.overflow_for_total(&mut self.actions) {
                return;
            }
            tracing::warn!(worker = %key.url, dp_rank = key.dp_rank,
                held_bytes_total = self.held_bytes_total,
                limit_bytes = self.cfg.held_bytes_total_max,
                "bootstrapping ranks hold too much together; the largest runs cold");
            self.execute(&key);
        }
    }

    fn gauge_held(&mut self, before: (u64, u64), after: (u64, u64)) {
        self.held_bytes_total = (self.held_bytes_total + after.1).saturating_sub(before.1);
        if before == after {
            return;
        }
        let model = [&*self.cfg.model];
        self.metrics
            .bootstrap_held_batches
            .with_label_values(&model)
            .add(after.0 as i64 - before.0 as i64);
        self.metrics
            .bootstrap_held_bytes
            .with_label_values(&model)
            .add(after.1 as i64 - before.1 as i64);
    }
}

/// Frees a graft job (the snapshot and its per-node tables: hundreds of MB for a fleet-sized
/// snapshot) on a blocking thread: handing that much memory back to the OS takes tens of
/// milliseconds in which the pump would apply nothing.
fn drop_off_pump(job: GraftJob) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn_blocking(move || drop(job));
        }
        Err(_) => drop(job),
    }
}

/// Why a rank settled with `outcome`, for the one info line each outcome gets.
fn outcome_reason(outcome: BootstrapOutcome) -> &'static str {
    match outcome {
        BootstrapOutcome::Warm => "graft spliced to the live stream, proven by sequence numbers",
        BootstrapOutcome::WarmUnwitnessed => {
            "graft kept; no batch, replay or sibling witnessed the splice"
        }
        BootstrapOutcome::WarmPartial => {
            "graft spliced and proven, but the sibling joined the rank's stream mid-way: \
             this replica sees what the sibling sees, not all the engine holds"
        }
        BootstrapOutcome::Gap => "live stream does not join the snapshot; graft discarded, cold",
        BootstrapOutcome::Uncovered => "no snapshot had a cursor for the rank; cold",
        BootstrapOutcome::Abandoned => "no snapshot found; cold",
        BootstrapOutcome::Overflow => "held batches passed their bound; cold",
        BootstrapOutcome::PublisherReset => "engine publisher restarted during the bootstrap",
        BootstrapOutcome::Rejected => "the index refused the snapshot; cold",
        BootstrapOutcome::FromOrigin => "stream began at seq 0 while watched; nothing missed",
        BootstrapOutcome::Empty => "every sibling says the rank holds nothing",
        BootstrapOutcome::FromEngineReplay => "rebuilt from the engine's replay from seq 0",
    }
}

/// Sends a sibling probe request after `interval` (see `SPLICE_PROBE_INTERVAL_MS`). A task per
/// proving rank at most, since the machine asks for the next round only after an answer.
fn spawn_paced_probe(
    ev: BootstrapEvent,
    interval: Duration,
    events: mpsc::Sender<BootstrapEvent>,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = async {
                tokio::time::sleep(interval).await;
                let _ = events.send(ev).await;
            } => {}
        }
    });
}

/// The rank if it is registered under this incarnation; anything else is a late message of a
/// removed or replaced registration and must not touch the index.
fn current<'a>(
    ranks: &'a mut HashMap<RankKey, PumpRank>,
    key: &RankKey,
    incarnation: u64,
) -> Option<&'a mut PumpRank> {
    ranks.get_mut(key).filter(|r| r.incarnation == incarnation)
}

#[allow(clippy::too_many_arguments)]
fn spawn_replay<S: KvSource>(
    source: Arc<S>,
    permits: Arc<Semaphore>,
    endpoint: String,
    key: RankKey,
    incarnation: u64,
    generation: u64,
    from_seq: i64,
    stop_before: Option<i64>,
    tx: mpsc::Sender<PumpMsg>,
    metrics: KvMetrics,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        // Held until the answer is in the pump's channel: the answer's memory is what it bounds.
        // The semaphore is never closed; without a permit the replay still runs.
        let _permit = tokio::select! {
            _ = cancel.cancelled() => return,
            permit = permits.acquire_owned() => permit.ok(),
        };
        let fetched = tokio::select! {
            _ = cancel.cancelled() => return,
            r = source.replay(&endpoint, from_seq, stop_before) => r,
        };
        let answer = match fetched {
            Ok(raw) => {
                let mut batches = Vec::with_capacity(raw.len());
                for (seq, payload) in raw {
                    match kvroute_wire::decode_batch(&payload) {
                        Ok(batch) => batches.push((seq, batch)),
                        // Left out: the machine counts it lost when it passes over the hole.
                        Err(e) => {
                            metrics.decode_errors.inc();
                            tracing::debug!(%endpoint, seq, error = %e, "replayed batch undecodable");
                        }
                    }
                }
                ReplayAnswer::Batches(batches)
            }
            Err(e) => {
                tracing::info!(%endpoint, from_seq, error = %e, "replay failed");
                ReplayAnswer::Failed
            }
        };
        let msg = PumpMsg::ReplayResult {
            key,
            incarnation,
            generation,
            answer,
        };
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = tx.send(msg) => {}
        }
    });
}

/// Counts what a batch's events named that the index did not take, keeps the rank's totals
/// for `GET /workers`, and warns once per incarnation when the rank's events do not fit the
/// model's block size. That last case is a configuration mismatch the router cannot recover
/// from by itself (its prompts are hashed in the model's blocks, the engine stores other
/// ones), and without the warning it looks like a healthy stream and a 0 % hit rate.
fn note_skipped(
    metrics: &KvMetrics,
    status: &StatusTable,
    key: &RankKey,
    rank: &mut PumpRank,
    report: &ApplyReport,
    model_block_size: u32,
) {
    for (reason, blocks) in report.skipped.by_reason() {
        if blocks > 0 {
            metrics
                .skipped_blocks
                .with_label_values(&[reason])
                .inc_by(blocks);
        }
    }
    rank.skipped += report.skipped;
    status.set_skipped(
        key,
        rank.incarnation,
        rank.skipped,
        report.foreign_block_size,
    );
    if rank.warned_misfit {
        return;
    }
    if let Some(engine_block_size) = report.foreign_block_size {
        rank.warned_misfit = true;
        tracing::warn!(worker = %key.url, dp_rank = key.dp_rank, engine_block_size,
            model_block_size,
            "this rank's KV events use blocks of {engine_block_size} tokens, but the model's index hashes prompts in blocks of {model_block_size} (the engine's /server_info, else --block-size): every block it stores is skipped and routing is blind to its cache; start the router with --block-size {engine_block_size} or align the engine (kvroute_kv_skipped_blocks_total{{reason=\"block_size\"}}, GET /workers)");
    } else if report.skipped.token_count > 0 {
        rank.warned_misfit = true;
        tracing::warn!(worker = %key.url, dp_rank = key.dp_rank, model_block_size,
            "this rank's stored blocks carry a token count that is not {model_block_size} per block: they are skipped and routing is blind to its cache; check the engine's block (page) size against the router's (kvroute_kv_skipped_blocks_total{{reason=\"token_count\"}}, GET /workers)");
    }
}

#[cfg(test)]
mod tests {
    //! The pump's routing rules (incarnations, removal, load) on a real index, with a transport
    //! that never delivers (these tests feed the channel directly, as subscriber tasks would).
    use super::*;
    use crate::transport::{KvSubscription, SourceEvent, TransportError};
    use bytes::Bytes;
    use kvroute_index::{IndexConfig, IndexReader, PrefixIndex};
    use kvroute_wire::{BlockStored, EngineHash};

    struct SilentSub;
    impl KvSubscription for SilentSub {
        async fn next_event(&mut self) -> SourceEvent {
            std::future::pending().await
        }
    }

    struct NoEngine;
    impl KvSource for NoEngine {
        type Subscription = SilentSub;
        async fn subscribe(&self, _: &str, _: &str) -> SilentSub {
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

    struct Harness {
        tx: mpsc::Sender<PumpMsg>,
        reader: IndexReader,
        loads: Arc<EngineLoads>,
        status: Arc<StatusTable>,
        cancel: CancellationToken,
    }

    fn harness() -> Harness {
        let (writer, reader) = PrefixIndex::new(IndexConfig::new(4));
        let (tx, rx) = mpsc::channel(PUMP_CHANNEL_CAPACITY);
        let metrics = KvMetrics::register(&prometheus::Registry::new()).unwrap();
        let loads = Arc::new(EngineLoads::new());
        let cancel = CancellationToken::new();
        let status = Arc::new(StatusTable::default());
        let pump = Pump::new(
            writer,
            Arc::new(NoEngine),
            tx.clone(),
            metrics,
            status.clone(),
            loads.clone(),
            cancel.clone(),
            PumpConfig {
                model: Arc::from("m"),
                graft_slice_items: kvroute_index::GRAFT_SLICE_ITEMS_MAX,
                probe_interval: Duration::ZERO,
                events: mpsc::channel(1).0,
                on_apply: None,
                on_slice: None,
                held_bytes_total_max: crate::rank_state::BOOTSTRAP_HELD_BYTES_TOTAL_MAX,
            },
        );
        tokio::spawn(pump.run(rx));
        Harness {
            tx,
            reader,
            loads,
            status,
            cancel,
        }
    }

    fn key(url: &str) -> RankKey {
        RankKey {
            url: Arc::from(url),
            dp_rank: 0,
        }
    }

    fn one_block_batch(engine_hash: u64) -> EventBatch {
        EventBatch {
            ts: 1.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(engine_hash)],
                parent_block_hash: None,
                // Distinct content per engine hash, so distinct batches store distinct blocks.
                token_ids: vec![engine_hash as u32; 4],
                block_size: 4,
                lora_id: None,
                lora_name: None,
                medium: None,
                extra_keys: vec![],
                group_idx: None,
            })],
            dp_rank: None,
        }
    }

    impl Harness {
        async fn add(&self, key: RankKey, incarnation: u64) {
            let (done, rx) = oneshot::channel();
            let msg = PumpMsg::AddRank {
                key,
                incarnation,
                replay_endpoint: None,
                bootstrap: false,
                done,
            };
            self.tx.send(msg).await.unwrap();
            rx.await.unwrap();
        }

        async fn remove(&self, url: &str) {
            let (done, rx) = oneshot::channel();
            let msg = PumpMsg::RemoveRanks {
                url: Arc::from(url),
                done,
            };
            self.tx.send(msg).await.unwrap();
            rx.await.unwrap();
        }

        /// Everything sent before has been handled once this returns (the channel is FIFO).
        async fn barrier(&self) {
            self.remove("http://barrier").await;
        }

        async fn batch(&self, key: RankKey, incarnation: u64, seq: i64, hash: u64) {
            let msg = PumpMsg::Batch {
                key,
                incarnation,
                seq,
                batch: one_block_batch(hash),
            };
            self.tx.send(msg).await.unwrap();
        }
    }

    #[tokio::test]
    async fn batches_of_a_stale_incarnation_never_reach_the_index() {
        let h = harness();
        h.add(key("http://w"), 2).await;
        h.batch(key("http://w"), 1, 0, 11).await;
        h.barrier().await;
        assert_eq!(h.reader.total_carried(), 0, "old incarnation applied");
        h.batch(key("http://w"), 2, 0, 11).await;
        h.barrier().await;
        assert_eq!(h.reader.total_carried(), 1);
        h.cancel.cancel();
    }

    #[tokio::test]
    async fn batches_of_a_removed_rank_are_dropped_and_removal_is_acknowledged_after_it() {
        let h = harness();
        h.add(key("http://w"), 1).await;
        h.batch(key("http://w"), 1, 0, 11).await;
        h.barrier().await;
        assert_eq!(h.reader.total_carried(), 1);
        h.remove("http://w").await;
        assert!(h.reader.ranks().is_empty());
        assert_eq!(h.reader.total_carried(), 0);
        h.batch(key("http://w"), 1, 1, 12).await;
        h.barrier().await;
        assert!(h.reader.ranks().is_empty());
        assert_eq!(h.reader.total_carried(), 0);
        h.cancel.cancel();
    }

    #[tokio::test]
    async fn a_ranks_cached_blocks_are_offered_to_routing_until_its_stream_shows_a_missed_history()
    {
        let h = harness();
        let cached = |url: &str| {
            h.loads.with_worker(url, |ranks| {
                ranks.first().and_then(|r| r.cached_device_blocks())
            })
        };
        h.add(key("http://w"), 1).await;
        assert_eq!(
            cached("http://w"),
            Some(0),
            "registered, nothing published yet"
        );
        h.batch(key("http://w"), 1, 0, 11).await;
        h.batch(key("http://w"), 1, 1, 12).await;
        h.barrier().await;
        assert_eq!(
            cached("http://w"),
            Some(2),
            "two blocks, every batch since seq 0"
        );
        // Batch 2 never arrives and there is no replay socket: the index misses what it held.
        h.batch(key("http://w"), 1, 3, 13).await;
        h.barrier().await;
        assert_eq!(h.reader.total_carried(), 3);
        assert_eq!(cached("http://w"), None, "a lost batch withdraws the count");
        // A rank first heard mid-stream never had its whole history.
        h.add(key("http://late"), 1).await;
        assert_eq!(cached("http://late"), Some(0), "nothing heard yet");
        h.batch(key("http://late"), 1, 5, 21).await;
        h.barrier().await;
        assert_eq!(cached("http://late"), None, "joined at seq 5");
        h.remove("http://w").await;
        assert_eq!(cached("http://w"), None, "a removed rank has no count");
        h.cancel.cancel();
    }

    #[tokio::test]
    async fn load_is_kept_only_for_registered_ranks_and_dropped_on_removal() {
        let h = harness();
        let stat = LoadStat {
            num_running_reqs: 3,
            ..LoadStat::default()
        };
        let load = |url: &str, incarnation| PumpMsg::Load {
            key: key(url),
            incarnation,
            stat,
        };
        h.tx.send(load("http://unknown", 1)).await.unwrap();
        h.add(key("http://w"), 1).await;
        h.tx.send(load("http://w", 1)).await.unwrap();
        h.barrier().await;
        assert_eq!(h.loads.get("http://w", 0), Some(stat));
        assert_eq!(h.loads.get("http://unknown", 0), None);
        h.remove("http://w").await;
        assert!(h.loads.is_empty());
        h.cancel.cancel();
    }

    #[tokio::test]
    async fn a_failed_replay_counts_the_gap_and_applies_what_was_held() {
        let h = harness();
        h.status.insert(key("http://w"), "m", 1);
        let (done, rx) = oneshot::channel();
        h.tx.send(PumpMsg::AddRank {
            key: key("http://w"),
            incarnation: 1,
            replay_endpoint: Some("tcp://127.0.0.1:9".into()),
            bootstrap: false,
            done,
        })
        .await
        .unwrap();
        rx.await.unwrap();
        h.batch(key("http://w"), 1, 0, 11).await;
        h.batch(key("http://w"), 1, 3, 12).await;
        // The replay task answers Failed through the channel; wait for its effect.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            h.barrier().await;
            if h.reader.total_carried() == 2 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "held batch 3 never applied; carried {}",
                h.reader.total_carried()
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let status = &h.status.snapshot()[0];
        assert_eq!(status.lost_batches, 2, "{status:?}");
        assert_eq!(status.cursor, Some(3));
        h.cancel.cancel();
    }

    /// Replays that wait for the test's go, counting how many run at once.
    struct ParkedReplays {
        running: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
        go: Semaphore,
    }

    impl KvSource for ParkedReplays {
        type Subscription = SilentSub;
        async fn subscribe(&self, _: &str, _: &str) -> SilentSub {
            std::future::pending().await
        }
        async fn replay(
            &self,
            _: &str,
            from_seq: i64,
            _: Option<i64>,
        ) -> Result<Vec<(i64, Bytes)>, TransportError> {
            use std::sync::atomic::Ordering::SeqCst;
            let now = self.running.fetch_add(1, SeqCst) + 1;
            self.most.fetch_max(now, SeqCst);
            self.go.acquire().await.expect("open").forget();
            self.running.fetch_sub(1, SeqCst);
            Ok(vec![(from_seq, Bytes::new())])
        }
    }

    #[tokio::test]
    async fn replays_past_the_in_flight_bound_wait_and_all_are_answered() {
        use std::sync::atomic::Ordering::SeqCst;
        let asked = REPLAYS_IN_FLIGHT_MAX * 3;
        let source = Arc::new(ParkedReplays {
            running: Default::default(),
            most: Default::default(),
            go: Semaphore::new(0),
        });
        let permits = Arc::new(Semaphore::new(REPLAYS_IN_FLIGHT_MAX));
        let (tx, mut rx) = mpsc::channel(asked);
        let metrics = KvMetrics::register(&prometheus::Registry::new()).unwrap();
        let cancel = CancellationToken::new();
        for generation in 0..asked as u64 {
            spawn_replay(
                source.clone(),
                permits.clone(),
                "tcp://replay".to_string(),
                key("http://w"),
                1,
                generation,
                0,
                None,
                tx.clone(),
                metrics.clone(),
                cancel.clone(),
            );
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while source.running.load(SeqCst) < REPLAYS_IN_FLIGHT_MAX {
            assert!(
                Instant::now() < deadline,
                "waited for {REPLAYS_IN_FLIGHT_MAX} replays in flight, saw {}",
                source.running.load(SeqCst)
            );
            tokio::task::yield_now().await;
        }
        // Every task has had its turn to start: none past the bound got in.
        for _ in 0..asked * 4 {
            tokio::task::yield_now().await;
        }
        assert_eq!(source.running.load(SeqCst), REPLAYS_IN_FLIGHT_MAX);
        source.go.add_permits(asked);
        let mut answered = std::collections::HashSet::new();
        while answered.len() < asked {
            let msg = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .unwrap_or_else(|_| panic!("{} of {asked} replays answered", answered.len()))
                .expect("the channel stays open");
            let PumpMsg::ReplayResult { generation, .. } = msg else {
                panic!("only replay answers are sent");
            };
            answered.insert(generation);
        }
        assert_eq!(source.most.load(SeqCst), REPLAYS_IN_FLIGHT_MAX);
        cancel.cancel();
    }
}
