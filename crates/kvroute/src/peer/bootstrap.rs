//! The bootstrap consumer's service side: the task that makes a booting replica warm.
//!
//! Every decision lives elsewhere, in pure code with its own tests: vetting, the sweep over
//! siblings and the coordinator in `kvroute_bootstrap`; holding, grafting, splice proofs and
//! heals in the KV plane's pump (`kvroute_kv`). This task only moves things between them and the
//! network, so it is shaped as one loop that owns all the bootstrap state (no locks on the
//! decision path) and never waits on the network or the pump itself:
//! - a worker registered for bootstrap arrives as a [`Command`]; each of its ranks becomes an
//!   obligation of its model's coordinator (one fleet-wide sweep per model at a time);
//! - every 250 ms (the sweep's pass interval) each coordinator is polled; the fetches it orders
//!   run as tasks (fetch, then `vet` on the blocking pool) and their results come back on a
//!   bounded channel;
//! - what the coordinator releases goes to the pump: a graft of the delivered snapshot (the
//!   `GraftPlan` is built on the blocking pool, off the pump), or a release with its outcome; a
//!   rank no sibling can seed is first offered a rebuild from its engine's replay buffer;
//! - the pump's reports (`BootstrapEvent`) come back on its bounded channel: a finished rank
//!   leaves the pending set, a gap asks for a fresher snapshot (a `Refused` late join), a
//!   deferred splice proof asks the siblings' cursor tables.
//!
//! Calls INTO the pump (graft, release, probe answer) run as spawned tasks: the pump may be
//! waiting for this loop to drain its events, so this loop must never wait for the pump.
//!
//! Readiness: the [`BootstrapGate`] holds `/readyz` by `kvroute_bootstrap::readiness_hold`
//! (only a timeout over a non-empty sibling set, or a pending rank before the deadline, may
//! hold it; "no peers" and "fleet cold" never do) and latches once it has said ready. The
//! internal listener's `producer_ready` reads the same gate, so a replica still bootstrapping
//! never serves its index to a sibling as warm.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_bootstrap::sweep::{FetchResult, PASS_INTERVAL_MS};
use kvroute_bootstrap::{
    BodyEncoding, Coordinator, Delivery, Disposition, Expectations, ExportStamp, FetchOrder,
    Incarnation, LateJoin, Obligation, Outcome, PeerBook, PeerView, ReadinessInputs,
    ReadinessLatch, Rejection, Tick, VerdictKind, fetch_timeout,
};
use kvroute_discovery::{PeerRegistry, PeerUrl};
use kvroute_index::{GraftPlan, RankId};
use kvroute_kv::bootstrap::{BootstrapEvent, GraftDisposition, GraftTarget};
use kvroute_kv::status::RankKey;
use kvroute_kv::{KvPlane, KvPlaneError};
use kvroute_snapshot::DecodeLimits;
use kvroute_wire::snapshot::RankRef;
use parking_lot::Mutex;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::control::readiness::ReadinessGate;
use crate::peer::fetch::{BodyReader, PeerFetcher, SnapshotHead, StreamedAnswer};

/// Default `--kv-bootstrap-timeout-ms`: how long the whole search for a warm sibling may take.
/// The shipped Deployment's readiness probe tolerates 60 s of 503s (period 2 s x
/// failureThreshold 30), so a replica gives up searching by then and serves cold.
pub const DEFAULT_BOOTSTRAP_TIMEOUT_MS: u64 = 60_000;
/// Default `--kv-bootstrap-fetch-timeout-cap-ms`: no single fetch may take longer, however long
/// the deadline, so one hung sibling cannot park the search.
pub const DEFAULT_BOOTSTRAP_FETCH_TIMEOUT_CAP_MS: u64 = 30_000;
/// Body size the start-up warning checks the per-fetch timeout against: a 64-rank x 100,000-block
/// index encodes to ~67 MB of binary + zstd.
pub const BOOTSTRAP_EXPECTED_SNAPSHOT_BYTES: u64 = 100 * 1024 * 1024;
/// Registrations queued for the bootstrap task before a registering caller waits.
pub const BOOTSTRAP_COMMANDS_MAX: usize = 1024;
/// Fetch results queued back to the task (one per fetch in flight; the sweep orders at most one
/// fetch per sibling per pass).
pub const BOOTSTRAP_RESULTS_MAX: usize = 1024;
/// Budget of one cursor-table fetch of a splice probe.
pub const PROBE_FETCH_TIMEOUT_MS: u64 = 5_000;

/// The bootstrap's settings (flags `--kv-bootstrap-*`).
#[derive(Debug, Clone)]
pub struct BootstrapConfig {
    /// Bounds the whole search, not each request.
    pub timeout_ms: u64,
    /// Caps the per-fetch timeout derived from `timeout_ms`.
    pub fetch_timeout_cap_ms: u64,
    /// Hold `/readyz` while the search timed out over siblings without a seed (bounded by
    /// `SEED_REQUIRED_HOLD_DEADLINE_FACTOR` x the timeout).
    pub seed_required: bool,
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        BootstrapConfig {
            timeout_ms: DEFAULT_BOOTSTRAP_TIMEOUT_MS,
            fetch_timeout_cap_ms: DEFAULT_BOOTSTRAP_FETCH_TIMEOUT_CAP_MS,
            seed_required: false,
        }
    }
}

/// What the router tells the bootstrap task.
#[derive(Debug)]
pub enum Command {
    /// A worker's ranks were registered with the KV plane for bootstrap (they hold their live
    /// batches until this task grafts or releases them).
    Registered {
        model: String,
        url: String,
        dp_size: u32,
        incarnation: u64,
    },
    /// A worker was removed; its ranks owe nothing any more.
    Removed { url: String },
}

/// What `/readyz` and the metrics read of the bootstrap.
#[derive(Debug, Default)]
struct GateState {
    /// Milliseconds since the task started when the first rank registered (the deadline is
    /// armed then, so slow worker discovery does not eat the search window).
    armed_at_ms: Option<u64>,
    pending: usize,
    latest_verdict: Option<VerdictKind>,
    timed_out_peers_tried: usize,
    seeded: bool,
    latch: ReadinessLatch,
}

/// The `/readyz` gate of the bootstrap (and of `producer_ready` on the internal listener).
pub struct BootstrapGate {
    state: Arc<Mutex<GateState>>,
    config: BootstrapConfig,
    started: Instant,
}

impl ReadinessGate for BootstrapGate {
    fn name(&self) -> &str {
        "kv_bootstrap"
    }

    fn check(&self) -> Result<(), String> {
        let mut s = self.state.lock();
        let Some(armed_at_ms) = s.armed_at_ms else {
            // Nothing registered for bootstrap yet: nothing to wait for.
            return Ok(());
        };
        let inputs = ReadinessInputs {
            now_ms: elapsed_ms(self.started),
            armed_at_ms,
            timeout_ms: self.config.timeout_ms,
            any_pending: s.pending > 0,
            latest_verdict: s.latest_verdict,
            timed_out_peers_tried: s.timed_out_peers_tried,
            seeded: s.seeded,
            seed_required: self.config.seed_required,
        };
        match s.latch.admit(&inputs) {
            None => Ok(()),
            Some(hold) => Err(format!("{} ({} ranks pending)", hold.label(), s.pending)),
        }
    }
}

/// The bootstrap's metrics (the per-rank outcomes and held batches are the KV plane's).
#[derive(Clone)]
struct BootstrapMetrics {
    sweeps: IntCounterVec,
    fetches: IntCounterVec,
    pending: IntGauge,
    settled: IntGauge,
    seed_failed: IntGauge,
    time_to_warm_ms: IntGauge,
    /// Where time to warm goes: `fetch` (request to last body byte), `vet` (decode and checks),
    /// `plan` (the graft plan, off the pump) and `graft` (offer to receipt, on the pump).
    stage_seconds: HistogramVec,
}

impl BootstrapMetrics {
    fn new(registry: &prometheus::Registry) -> Result<Self, prometheus::Error> {
        let sweeps = IntCounterVec::new(
            Opts::new(
                "kvroute_bootstrap_sweeps_total",
                "Finished bootstrap sweeps by verdict.",
            ),
            &["verdict"],
        )?;
        let fetches = IntCounterVec::new(
            Opts::new(
                "kvroute_bootstrap_snapshot_fetches_total",
                "Snapshot fetches from siblings by result.",
            ),
            &["result"],
        )?;
        let pending = IntGauge::new(
            "kvroute_bootstrap_pending_ranks",
            "Ranks still waiting for a snapshot or a release.",
        )?;
        let settled = IntGauge::new(
            "kvroute_bootstrap_settled",
            "1 once every rank registered for bootstrap has settled.",
        )?;
        let seed_failed = IntGauge::new(
            "kvroute_bootstrap_seed_failed",
            "1 while the latest sweep timed out over siblings without a seed.",
        )?;
        let time_to_warm_ms = IntGauge::new(
            "kvroute_bootstrap_time_to_warm_ms",
            "Milliseconds from the first registration to the last rank settling.",
        )?;
        registry.register(Box::new(sweeps.clone()))?;
        registry.register(Box::new(fetches.clone()))?;
        registry.register(Box::new(pending.clone()))?;
        registry.register(Box::new(settled.clone()))?;
        registry.register(Box::new(seed_failed.clone()))?;
        let stage_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_bootstrap_stage_seconds",
                "Duration of each stage of taking a sibling's snapshot: fetch, vet, plan, graft.",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            &["stage"],
        )?;
        registry.register(Box::new(time_to_warm_ms.clone()))?;
        registry.register(Box::new(stage_seconds.clone()))?;
        Ok(BootstrapMetrics {
            sweeps,
            fetches,
            pending,
            settled,
            seed_failed,
            time_to_warm_ms,
            stage_seconds,
        })
    }
}

/// The router's side of the bootstrap: where registrations go, and the readiness gate.
pub struct Bootstrap {
    tx: mpsc::Sender<Command>,
    rx: Mutex<Option<mpsc::Receiver<Command>>>,
    state: Arc<Mutex<GateState>>,
    metrics: BootstrapMetrics,
    config: BootstrapConfig,
    /// The per-fetch timeout derived from the config (a strict fraction of the deadline, capped).
    fetch_timeout_ms: u64,
    started: Instant,
}

impl Bootstrap {
    pub fn new(config: BootstrapConfig, registry: &prometheus::Registry) -> Result<Self, String> {
        let (tx, rx) = mpsc::channel(BOOTSTRAP_COMMANDS_MAX);
        let metrics = BootstrapMetrics::new(registry).map_err(|e| e.to_string())?;
        let timeout = fetch_timeout(
            config.timeout_ms,
            config.fetch_timeout_cap_ms,
            BOOTSTRAP_EXPECTED_SNAPSHOT_BYTES,
        );
        let fetch_timeout_ms = timeout.timeout_ms;
        if let Some(w) = timeout.warning {
            tracing::warn!(
                fetch_timeout_ms = w.timeout_ms,
                needed_ms = w.needed_ms,
                expected_body_bytes = w.expected_body_bytes,
                "the per-fetch bootstrap timeout (a fraction of --kv-bootstrap-timeout-ms, capped by \
                 --kv-bootstrap-fetch-timeout-cap-ms) is below what a fleet-sized snapshot needs; \
                 large fetches will look like unreachable siblings"
            );
        }
        Ok(Bootstrap {
            tx,
            rx: Mutex::new(Some(rx)),
            state: Arc::new(Mutex::new(GateState::default())),
            metrics,
            config,
            fetch_timeout_ms,
            started: Instant::now(),
        })
    }

    /// The `/readyz` gate (also `producer_ready` on the internal listener).
    pub fn gate(&self) -> BootstrapGate {
        BootstrapGate {
            state: self.state.clone(),
            config: self.config.clone(),
            started: self.started,
        }
    }

    /// Tells the task about a registration or removal; waits while its queue is full.
    pub async fn send(&self, command: Command) {
        if self.tx.send(command).await.is_err() {
            tracing::warn!("the bootstrap task is gone; a rank may hold its batches until removed");
        }
    }

    /// Starts the task; `None` when it was started already or the plane's events are taken.
    pub fn start(
        &self,
        plane: KvPlane,
        peers: PeerRegistry,
        fetcher: PeerFetcher,
        self_url: Option<PeerUrl>,
        cancel: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let commands = self.rx.lock().take()?;
        let events = plane.take_bootstrap_events()?;
        let fetch_timeout_ms = self.fetch_timeout_ms;
        let (results_tx, results) = mpsc::channel(BOOTSTRAP_RESULTS_MAX);
        let task = Task {
            config: self.config.clone(),
            plane,
            peers,
            fetcher,
            self_url,
            state: self.state.clone(),
            metrics: self.metrics.clone(),
            started: self.started,
            fetch_timeout_ms,
            models: HashMap::new(),
            pending: HashMap::new(),
            results_tx,
            cancel: cancel.clone(),
        };
        Some(tokio::spawn(task.run(commands, events, results)))
    }
}

fn elapsed_ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// One model's search: its coordinator, what it knows of each sibling, and which rank each
/// obligation it may still be holding stands for (the coordinator's "is this still owed?").
struct ModelSweep {
    coordinator: Coordinator<PeerUrl>,
    book: PeerBook<PeerUrl>,
    owed: HashMap<(RankId, u64), RankKey>,
}

/// A rank registered for bootstrap that has not reported `Finished` yet.
#[derive(Debug, Clone)]
struct PendingRank {
    model: String,
    incarnation: u64,
    rank: RankId,
}

type FetchAnswer = (String, FetchOrder<PeerUrl>, FetchResult);

struct Task {
    config: BootstrapConfig,
    plane: KvPlane,
    peers: PeerRegistry,
    fetcher: PeerFetcher,
    self_url: Option<PeerUrl>,
    state: Arc<Mutex<GateState>>,
    metrics: BootstrapMetrics,
    started: Instant,
    fetch_timeout_ms: u64,
    models: HashMap<String, ModelSweep>,
    pending: HashMap<RankKey, PendingRank>,
    results_tx: mpsc::Sender<FetchAnswer>,
    cancel: CancellationToken,
}

impl Task {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut events: mpsc::Receiver<BootstrapEvent>,
        mut results: mpsc::Receiver<FetchAnswer>,
    ) {
        let mut pass = tokio::time::interval(Duration::from_millis(PASS_INTERVAL_MS));
        pass.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return,
                Some(event) = events.recv() => self.on_event(event),
                Some(command) = commands.recv() => {
                    // A registration is polled at once rather than at the next pass tick: the
                    // first fetch of a boot is on the time-to-warm path. The coordinator keeps a
                    // single pass in flight, so registrations arriving together still fold into
                    // one fetch.
                    let registered = matches!(command, Command::Registered { .. });
                    self.on_command(command);
                    if registered {
                        self.poll_all();
                    }
                }
                Some((model, order, result)) = results.recv() => self.on_answer(model, order, result),
                _ = pass.tick() => self.poll_all(),
            }
            self.publish_state();
        }
    }

    fn now_ms(&self) -> u64 {
        elapsed_ms(self.started)
    }

    fn deadline_ms(&self) -> u64 {
        let armed = self.state.lock().armed_at_ms.unwrap_or(0);
        armed.saturating_add(self.config.timeout_ms)
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Registered {
                model,
                url,
                dp_size,
                incarnation,
            } => {
                let now = self.now_ms();
                {
                    let mut s = self.state.lock();
                    if s.armed_at_ms.is_none() {
                        s.armed_at_ms = Some(now);
                    }
                }
                let Some(view) = self.plane.model_view(&model) else {
                    tracing::warn!(%model, %url, "registered for bootstrap but the model has no index");
                    return;
                };
                let local: HashMap<(String, u32), RankId> = view
                    .reader
                    .ranks()
                    .into_iter()
                    .map(|(id, r)| ((r.worker_url, r.dp_rank), id))
                    .collect();
                let fetch_timeout_ms = self.fetch_timeout_ms;
                let sweep = self
                    .models
                    .entry(model.clone())
                    .or_insert_with(|| ModelSweep {
                        coordinator: Coordinator::new(fetch_timeout_ms),
                        book: PeerBook::new(self.self_url.clone()),
                        owed: HashMap::new(),
                    });
                for dp_rank in 0..dp_size {
                    let Some(&rank) = local.get(&(url.clone(), dp_rank)) else {
                        tracing::warn!(%model, %url, dp_rank, "bootstrapping rank missing from the index");
                        continue;
                    };
                    let key = RankKey {
                        url: Arc::from(url.as_str()),
                        dp_rank,
                    };
                    sweep.owed.insert((rank, incarnation), key.clone());
                    let earlier = self.pending.insert(
                        key,
                        PendingRank {
                            model: model.clone(),
                            incarnation,
                            rank,
                        },
                    );
                    // A re-registration: the older incarnation owes nothing any more.
                    if let Some(old) = earlier
                        && old.model == model
                        && old.incarnation != incarnation
                    {
                        sweep.owed.remove(&(old.rank, old.incarnation));
                    }
                    sweep.coordinator.submit(
                        Obligation {
                            rank,
                            incarnation: Incarnation(incarnation),
                            floor_ms: now,
                        },
                        LateJoin::Permitted,
                    );
                }
            }
            Command::Removed { url } => {
                let gone: Vec<RankKey> = self
                    .pending
                    .keys()
                    .filter(|k| &*k.url == url.as_str())
                    .cloned()
                    .collect();
                for key in gone {
                    self.forget(&key);
                }
            }
        }
    }

    fn on_event(&mut self, event: BootstrapEvent) {
        match event {
            BootstrapEvent::Finished {
                key,
                incarnation,
                outcome,
            } => {
                if self
                    .pending
                    .get(&key)
                    .is_some_and(|p| p.incarnation == incarnation)
                {
                    self.forget(&key);
                    tracing::info!(url = %key.url, dp_rank = key.dp_rank, outcome = outcome.label(),
                        "rank bootstrap settled");
                    if self.pending.is_empty() {
                        let armed = self.state.lock().armed_at_ms.unwrap_or(0);
                        let took = self.now_ms().saturating_sub(armed);
                        self.metrics
                            .time_to_warm_ms
                            .set(i64::try_from(took).unwrap_or(i64::MAX));
                    }
                }
            }
            BootstrapEvent::NeedFreshSnapshot {
                key, incarnation, ..
            } => {
                let Some(p) = self.pending.get(&key).cloned() else {
                    return;
                };
                if p.incarnation != incarnation {
                    return;
                }
                let now = self.now_ms();
                if let Some(sweep) = self.models.get_mut(&p.model) {
                    sweep.coordinator.submit(
                        Obligation {
                            rank: p.rank,
                            incarnation: Incarnation(incarnation),
                            floor_ms: now,
                        },
                        LateJoin::Refused,
                    );
                }
            }
            BootstrapEvent::ProbeSiblings {
                key,
                incarnation,
                generation,
                ..
            } => {
                let Some(model) = self.pending.get(&key).map(|p| p.model.clone()) else {
                    return;
                };
                let peers = self.peers.candidates();
                let fetcher = self.fetcher.clone();
                let plane = self.plane.clone();
                tokio::spawn(async move {
                    let highest = highest_sibling_cursor(&fetcher, &peers, &model, &key).await;
                    report(
                        plane
                            .answer_probe(&key, incarnation, generation, highest)
                            .await,
                    );
                });
            }
        }
    }

    fn view_parts(&self) -> (Vec<PeerUrl>, bool, bool) {
        let snapshot = self.peers.snapshot();
        (snapshot.peers, snapshot.synced, snapshot.ever_had_peers)
    }

    fn poll_all(&mut self) {
        if self.models.is_empty() {
            return;
        }
        let (peers, synced, ever_had_peers) = self.view_parts();
        let view = PeerView {
            peers: &peers,
            synced,
            ever_had_peers,
        };
        let now = self.now_ms();
        let deadline = self.deadline_ms();
        let models: Vec<String> = self.models.keys().cloned().collect();
        for model in models {
            let Some(ModelSweep {
                coordinator,
                book,
                owed,
            }) = self.models.get_mut(&model)
            else {
                continue;
            };
            if coordinator.is_idle() {
                continue;
            }
            let tick = coordinator.poll(&view, book, now, deadline, |ob| {
                owed.contains_key(&(ob.rank, ob.incarnation.0))
            });
            self.handle_tick(&model, tick);
        }
    }

    fn on_answer(&mut self, model: String, order: FetchOrder<PeerUrl>, result: FetchResult) {
        self.metrics
            .fetches
            .with_label_values(&[fetch_result_label(&result)])
            .inc();
        // Said once per sibling: the sweep never asks a permanently rejected sibling again this
        // boot, and the reason (another build, key or token) is the operator's to fix.
        if let FetchResult::Body {
            vetted: Err(rejection),
            ..
        } = &result
            && rejection.is_permanent()
        {
            tracing::warn!(%model, sibling = order.peer.as_str(), reason = %rejection,
                "sibling's snapshot refused for this boot");
        }
        let (peers, synced, ever_had_peers) = self.view_parts();
        let view = PeerView {
            peers: &peers,
            synced,
            ever_had_peers,
        };
        let now = self.now_ms();
        let Some(ModelSweep {
            coordinator,
            book,
            owed,
        }) = self.models.get_mut(&model)
        else {
            return;
        };
        let tick = coordinator.on_answer(&order, result, &view, book, now, |ob| {
            owed.contains_key(&(ob.rank, ob.incarnation.0))
        });
        self.handle_tick(&model, tick);
    }

    /// The rank owes nothing any more (settled, or its worker removed).
    fn forget(&mut self, key: &RankKey) {
        if let Some(p) = self.pending.remove(key)
            && let Some(sweep) = self.models.get_mut(&p.model)
        {
            sweep.owed.remove(&(p.rank, p.incarnation));
        }
    }

    fn key_of(&self, model: &str, ob: &Obligation) -> Option<RankKey> {
        self.models
            .get(model)?
            .owed
            .get(&(ob.rank, ob.incarnation.0))
            .cloned()
    }

    fn handle_tick(&mut self, model: &str, tick: Tick<PeerUrl>) {
        for order in tick.fetch {
            self.spawn_fetch(model, order);
        }
        let mut targets = Vec::new();
        for release in tick.released {
            let Some(key) = self.key_of(model, &release.obligation) else {
                continue;
            };
            let incarnation = release.obligation.incarnation.0;
            let plane = self.plane.clone();
            match release.disposition {
                Disposition::Graft => targets.push(GraftTarget { key, incarnation }),
                Disposition::Settle(outcome) if asks_the_engine_first(outcome) => {
                    tokio::spawn(async move {
                        report(plane.rebuild_from_engine(&key, incarnation, outcome).await);
                    });
                }
                Disposition::Settle(outcome) => {
                    tokio::spawn(async move {
                        report(plane.release_rank(&key, incarnation, outcome).await);
                    });
                }
                Disposition::NotOwed => {}
            }
        }
        if let Some(delivery) = tick.delivery {
            self.record_delivery(model, &delivery);
            if let Some(vetted) = delivery.graft
                && !targets.is_empty()
            {
                self.spawn_graft(model, vetted, targets);
            }
        }
    }

    fn record_delivery(&mut self, model: &str, d: &Delivery<PeerUrl>) {
        let verdict = d.verdict;
        self.metrics
            .sweeps
            .with_label_values(&[verdict.label()])
            .inc();
        tracing::info!(%model, verdict = verdict.label(), peer = d.peer.as_ref().map(PeerUrl::as_str),
            peers_tried = d.peers_tried, siblings = d.siblings, reason = d.last_reason.as_deref(),
            "bootstrap sweep finished");
        let mut s = self.state.lock();
        s.latest_verdict = Some(verdict);
        match verdict {
            VerdictKind::Found => {
                s.seeded = true;
                s.timed_out_peers_tried = 0;
            }
            VerdictKind::TimedOut => s.timed_out_peers_tried = d.peers_tried,
            _ => {}
        }
    }

    fn spawn_fetch(&self, model: &str, order: FetchOrder<PeerUrl>) {
        let fetcher = self.fetcher.clone();
        let results = self.results_tx.clone();
        let plane = self.plane.clone();
        let model = model.to_string();
        let started = self.started;
        let stages = self.metrics.stage_seconds.clone();
        tokio::spawn(async move {
            let fetch_started = Instant::now();
            let decode_inputs = (
                fetcher.config().auth_token.clone(),
                fetcher.config().max_bytes,
            );
            let vet_plane = plane.clone();
            let vet_model = model.clone();
            let answer = fetcher
                .fetch_snapshot_streamed(
                    order.peer.as_str(),
                    Some(&model),
                    Some(order.max_age_ms),
                    Some(order.timeout_ms),
                    move |head, body| {
                        vet_streamed_body(decode_inputs, &vet_plane, &vet_model, head, body)
                    },
                )
                .await;
            let received_ms = elapsed_ms(started);
            let result = match answer {
                StreamedAnswer::Consumed {
                    value: vetted,
                    head,
                    body_done,
                } => {
                    // "fetch" ends with the body's last byte, "vet" is what the decode and the
                    // checks took after it (most of their work overlapped the transfer).
                    stages
                        .with_label_values(&["fetch"])
                        .observe(body_done.duration_since(fetch_started).as_secs_f64());
                    stages
                        .with_label_values(&["vet"])
                        .observe(body_done.elapsed().as_secs_f64());
                    FetchResult::Body {
                        vetted,
                        stamp: ExportStamp {
                            received_ms,
                            age_ms: head.age_ms,
                        },
                    }
                }
                StreamedAnswer::NoSnapshot => FetchResult::NoSnapshot,
                StreamedAnswer::Busy => FetchResult::Busy,
                StreamedAnswer::TooLarge { limit_bytes } => FetchResult::Body {
                    vetted: Err(Rejection::TooLarge { limit_bytes }),
                    stamp: ExportStamp {
                        received_ms,
                        age_ms: None,
                    },
                },
                StreamedAnswer::Misdirected(m) => FetchResult::Body {
                    vetted: Err(Rejection::Misdirected {
                        reason: m.to_string(),
                    }),
                    stamp: ExportStamp {
                        received_ms,
                        age_ms: None,
                    },
                },
                StreamedAnswer::Unreachable(reason) => FetchResult::Unreachable { reason },
            };
            let _ = results.send((model, order, result)).await;
        });
    }

    fn spawn_graft(
        &self,
        model: &str,
        vetted: kvroute_bootstrap::VettedSnapshot,
        targets: Vec<GraftTarget>,
    ) {
        let plane = self.plane.clone();
        let model = model.to_string();
        let stages = self.metrics.stage_seconds.clone();
        tokio::spawn(async move {
            let Some(view) = plane.model_view(&model) else {
                return;
            };
            let (snapshot, _) = vetted.into_parts();
            let plan_started = Instant::now();
            // Laid out for this model's index here, off the pump, so the graft sizes each shard
            // once to what it receives.
            let plan = tokio::task::spawn_blocking(move || {
                GraftPlan::new_laid_out(snapshot, view.block_size, |_| true, &view.reader)
            })
            .await;
            stages
                .with_label_values(&["plan"])
                .observe(plan_started.elapsed().as_secs_f64());
            let plan = match plan {
                Ok(Ok(plan)) => plan,
                Ok(Err(e)) => {
                    tracing::warn!(%model, error = %e, "the vetted snapshot cannot be grafted");
                    for t in targets {
                        report(
                            plane
                                .release_rank(&t.key, t.incarnation, Outcome::Rejected)
                                .await,
                        );
                    }
                    return;
                }
                Err(e) => {
                    tracing::warn!(%model, error = %e, "building the graft plan failed");
                    return;
                }
            };
            // The slabs' chunks and the ranks' side tables are made on the blocking pool while
            // the pump grafts, so their first-touch page faults run beside the pump instead of
            // on it (`kvroute_index::room`). The helper ends when the job is over.
            if let Some(room) = plan.room() {
                let model = model.clone();
                tokio::task::spawn_blocking(move || {
                    let made = room.prepare();
                    tracing::debug!(%model, chunks = made.chunks_made, lists = made.lists_made,
                        side_tables = made.side_tables_made, bytes = made.bytes_made,
                        stopped_early = made.stopped_early, seconds = made.seconds,
                        "graft room prepared");
                });
            }
            let offered = targets.clone();
            let graft_started = Instant::now();
            let graft = plane.graft(&model, plan, targets).await;
            stages
                .with_label_values(&["graft"])
                .observe(graft_started.elapsed().as_secs_f64());
            match graft {
                Ok(receipt) => {
                    // The plan had no cursor for these ranks (they keep holding): nothing can
                    // prove a graft for them, so they run cold from their live stream.
                    for (key, disposition) in &receipt.ranks {
                        let Some(target) = offered.iter().find(|t| &t.key == key) else {
                            continue;
                        };
                        if *disposition == GraftDisposition::Uncovered {
                            report(
                                plane
                                    .release_rank(key, target.incarnation, Outcome::Uncovered)
                                    .await,
                            );
                        }
                    }
                }
                Err(e) => tracing::warn!(%model, error = %e, "the graft could not be offered"),
            }
        });
    }

    fn publish_state(&mut self) {
        let pending = self.pending.len();
        let (settled, seed_failed) = {
            let mut s = self.state.lock();
            s.pending = pending;
            (
                s.armed_at_ms.is_some() && pending == 0,
                s.latest_verdict == Some(VerdictKind::TimedOut) && s.timed_out_peers_tried > 0,
            )
        };
        self.metrics
            .pending
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
        self.metrics.settled.set(i64::from(settled));
        self.metrics.seed_failed.set(i64::from(seed_failed));
    }
}

/// Whether a rank released with `outcome` is first offered a rebuild from its engine's replay
/// buffer (the outcome then stands only if the buffer cannot rebuild it):
/// - `abandoned`: no sibling could seed it, but the buffer may still reach back to seq 0 (a young
///   engine, or the whole router fleet restarting);
/// - `empty`: every sibling names it empty. Siblings name a rank empty only when they hold its
///   whole history, but the engine is still the better witness: an empty buffer confirms
///   `empty`, batches from seq 0 rebuild the rank exactly;
/// - `uncovered`: no sibling knows the rank (they hold it in their own bootstrap, or joined its
///   stream mid-way, e.g. an engine registered on every replica at once), or the snapshot never
///   spoke for it; the engine may still hold its whole stream, or say it holds nothing.
fn asks_the_engine_first(outcome: Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Abandoned | Outcome::Empty | Outcome::Uncovered
    )
}

/// Decodes a sibling's body while it arrives, then vets it against this replica's live ranks of
/// `model` as they are once the body is in (runs on the blocking pool, fed by the fetch). The
/// live set is read only then, not when the fetch starts: ranks keep registering while a large
/// body is on the wire, and one read too early would leave them out of this graft.
fn vet_streamed_body(
    (mac_key, max_bytes): (Option<Arc<[u8]>>, usize),
    plane: &KvPlane,
    model: &str,
    head: SnapshotHead,
    body: BodyReader,
) -> Result<kvroute_bootstrap::VettedSnapshot, Rejection> {
    let encoding =
        BodyEncoding::from_headers(Some(&head.content_type), head.content_encoding.as_deref())?;
    let limits = DecodeLimits {
        max_bytes,
        ..DecodeLimits::default()
    };
    let snapshot = kvroute_bootstrap::decode_stream(body, encoding, &limits, mac_key.as_deref())?;
    let Some(view) = plane.model_view(model) else {
        return Err(Rejection::CoversNothing);
    };
    let live: Vec<(RankRef, RankId)> = view
        .reader
        .ranks()
        .into_iter()
        .map(|(id, r)| (r, id))
        .collect();
    kvroute_bootstrap::vet_decoded(
        snapshot,
        &Expectations {
            block_size: view.block_size,
            live: &live,
            mac_key: mac_key.as_deref(),
            limits,
        },
    )
}

/// The highest cursor any sibling reports for `key`'s rank (`None` when none names it): the
/// witness of a deferred splice proof. Siblings are asked one after another, each within
/// [`PROBE_FETCH_TIMEOUT_MS`].
async fn highest_sibling_cursor(
    fetcher: &PeerFetcher,
    peers: &[PeerUrl],
    model: &str,
    key: &RankKey,
) -> Option<i64> {
    let mut highest: Option<i64> = None;
    for peer in peers {
        let fetch = fetcher.fetch_cursors(peer.as_str(), Some(model));
        let Ok(crate::peer::fetch::FetchOutcome::Body(table)) =
            tokio::time::timeout(Duration::from_millis(PROBE_FETCH_TIMEOUT_MS), fetch).await
        else {
            continue;
        };
        let Some(pos) = table
            .ranks
            .iter()
            .position(|r| r.worker_url == *key.url && r.dp_rank == key.dp_rank)
        else {
            continue;
        };
        for c in table.cursors.iter().filter(|c| c.rank as usize == pos) {
            highest = Some(highest.map_or(c.seq, |h| h.max(c.seq)));
        }
    }
    highest
}

fn fetch_result_label(result: &FetchResult) -> &'static str {
    match result {
        FetchResult::Body { vetted: Ok(_), .. } => "vetted",
        FetchResult::Body { vetted: Err(r), .. } if r.is_permanent() => "rejected",
        FetchResult::Body { vetted: Err(_), .. } => "refused_for_now",
        FetchResult::NoSnapshot => "no_snapshot",
        FetchResult::Busy => "busy",
        FetchResult::Unreachable { .. } => "unreachable",
    }
}

/// A message to the pump that could not be sent means the plane is shutting down.
fn report(result: Result<(), KvPlaneError>) {
    if let Err(e) = result {
        tracing::debug!(error = %e, "bootstrap message to the KV plane dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_released_without_a_graft_are_checked_against_their_engine_before_they_settle() {
        assert!(asks_the_engine_first(Outcome::Empty));
        assert!(asks_the_engine_first(Outcome::Abandoned));
        assert!(asks_the_engine_first(Outcome::Uncovered));
        for o in Outcome::ALL {
            if !matches!(o, Outcome::Empty | Outcome::Abandoned | Outcome::Uncovered) {
                assert!(!asks_the_engine_first(o), "{o:?}");
            }
        }
    }
}
