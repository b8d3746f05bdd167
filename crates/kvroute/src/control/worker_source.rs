//! Where workers come from: one path for the static `--worker-urls` list and for a dynamic
//! source of edits (Kubernetes engine discovery, or any `mpsc` stream of [`EngineEvent`]s).
//!
//! Why it is shaped this way:
//! - Every source ends in the SAME calls the admin API makes, [`Router::register`] and
//!   [`Router::deregister`], so a discovered worker gets exactly what a hand-added one gets
//!   (model lookup when the source names none, KV plane attach, health state, metrics) and its
//!   removal detaches it from the KV plane before `deregister` returns.
//! - The static list is a source with start-up workers and no edits; it is registered inline by
//!   `serve` so a router started against a running fleet is usable as soon as `serve` returns.
//!   A dynamic source adds an edit stream, consumed by ONE task ([`spawn_consumer`]) so edits of
//!   one URL are applied in the order the source emitted them.
//! - An `Added` never blocks the stream: its registration (first attempt, then retries with
//!   back-off while the engine does not answer) runs in its own task, tracked by URL. A
//!   `Removed` of that URL cancels the retries and WAITS for the task before deregistering, so a
//!   registration in flight can never re-add a worker the source has already removed.
//! - The registry is keyed by URL, whoever added the worker: a source's `Removed` removes a
//!   worker with that URL even if the admin API or the static list added it.
//! - Readiness: a dynamic source opens the `engine_discovery_synced` gate once the source has
//!   completed its first list, the consumer has received every edit queued before that, and each
//!   registration those edits started has made its first attempt. The gate then latches, so a
//!   later scale-up never flaps `/readyz`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_discovery::{EngineDiscoveryHandle, EngineEvent};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{RouterConfig, WorkerSpec};
use crate::control::readiness::ReadinessGate;
use crate::control::router::{REGISTER_RETRY_MAX_MS, RegisterError, Router};

/// Registrations (distinct URLs) in progress at once; beyond this an `Added` is refused with an
/// error log. Kubernetes discovery itself tracks at most `TRACKED_ENGINE_PODS_MAX` pods.
pub const PENDING_REGISTRATIONS_MAX: usize = kvroute_discovery::TRACKED_ENGINE_PODS_MAX;
/// First wait before retrying a registration whose engine did not answer.
pub const REGISTER_RETRY_START_MS: u64 = 200;
/// Name of the readiness gate a dynamic source adds.
pub const SYNCED_GATE_NAME: &str = "engine_discovery_synced";

/// The edit stream of a dynamic source.
struct DynamicWorkers {
    events: mpsc::Receiver<EngineEvent>,
    /// Completed (re)lists of the source; each increment comes after its edits were queued.
    syncs: watch::Receiver<u64>,
    /// The Kubernetes watcher feeding `events`, stopped on shutdown; `None` when the producer
    /// belongs to someone else (tests).
    producer: Option<EngineDiscoveryHandle>,
}

/// Where the router's workers come from (see the module doc).
pub struct WorkerSource {
    name: String,
    initial: Vec<WorkerSpec>,
    dynamic: Option<DynamicWorkers>,
}

impl WorkerSource {
    /// The `--worker-urls` list: start-up workers, no edits.
    pub fn static_list(workers: Vec<WorkerSpec>) -> WorkerSource {
        WorkerSource {
            name: "static".into(),
            initial: workers,
            dynamic: None,
        }
    }

    /// Start-up workers plus edits from `events`; `syncs` counts completed lists of the source
    /// (the readiness gate waits for `>= 1`). This is the seam tests feed with a plain channel.
    pub fn from_events(
        name: impl Into<String>,
        initial: Vec<WorkerSpec>,
        events: mpsc::Receiver<EngineEvent>,
        syncs: watch::Receiver<u64>,
    ) -> WorkerSource {
        WorkerSource {
            name: name.into(),
            initial,
            dynamic: Some(DynamicWorkers {
                events,
                syncs,
                producer: None,
            }),
        }
    }

    /// Start-up workers plus a running Kubernetes engine discovery, stopped with the router.
    pub fn kubernetes(
        initial: Vec<WorkerSpec>,
        handle: EngineDiscoveryHandle,
        events: mpsc::Receiver<EngineEvent>,
    ) -> WorkerSource {
        let name = if initial.is_empty() {
            "kubernetes"
        } else {
            "static+kubernetes"
        };
        WorkerSource {
            name: name.into(),
            initial,
            dynamic: Some(DynamicWorkers {
                syncs: handle.syncs(),
                events,
                producer: Some(handle),
            }),
        }
    }

    /// The source `config` describes: its static list, plus Kubernetes engine discovery when
    /// `engine_discovery` is set (this starts the watcher).
    pub async fn from_config(config: &RouterConfig) -> Result<WorkerSource, String> {
        match &config.engine_discovery {
            None => Ok(WorkerSource::static_list(config.workers.clone())),
            Some(cfg) => {
                let (handle, events) = kvroute_discovery::start_engine_discovery(cfg.clone(), None)
                    .await
                    .map_err(|e| format!("engine discovery: {e}"))?;
                Ok(WorkerSource::kubernetes(
                    config.workers.clone(),
                    handle,
                    events,
                ))
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Workers known at start-up (registered inline by `serve`).
    pub fn initial_workers(&self) -> &[WorkerSpec] {
        &self.initial
    }

    pub fn is_dynamic(&self) -> bool {
        self.dynamic.is_some()
    }
}

/// What the consumer has done, read by the readiness gate.
#[derive(Debug, Default)]
pub struct SyncProgress {
    /// Highest source sync count all of whose edits the consumer has received.
    drained_syncs: AtomicU64,
    /// Registrations started by the consumer whose first attempt has not finished.
    first_attempts_pending: AtomicUsize,
    latched: AtomicBool,
}

impl SyncProgress {
    pub fn new() -> Arc<SyncProgress> {
        Arc::new(SyncProgress::default())
    }
}

/// `engine_discovery_synced`: the dynamic source's first list is applied (see the module doc).
pub struct SyncedGate(pub Arc<SyncProgress>);

impl ReadinessGate for SyncedGate {
    fn name(&self) -> &str {
        SYNCED_GATE_NAME
    }
    fn check(&self) -> Result<(), String> {
        let p = &self.0;
        if p.latched.load(Ordering::Acquire) {
            return Ok(());
        }
        let drained = p.drained_syncs.load(Ordering::Acquire);
        let pending = p.first_attempts_pending.load(Ordering::Acquire);
        if drained >= 1 && pending == 0 {
            p.latched.store(true, Ordering::Release);
            Ok(())
        } else if drained == 0 {
            Err("engine discovery has not completed its first list yet".into())
        } else {
            Err(format!(
                "{pending} discovered workers are making their first registration attempt"
            ))
        }
    }
}

/// The running consumer of a dynamic source.
pub struct WorkerSourceTask {
    consumer: JoinHandle<()>,
    producer: Option<EngineDiscoveryHandle>,
}

impl WorkerSourceTask {
    /// Stops the producer (no more edits), then waits for the consumer, which exits once the
    /// router's shutdown token is cancelled and its registrations in flight have finished.
    pub async fn shutdown(self) {
        if let Some(p) = self.producer {
            p.shutdown().await;
        }
        if let Err(e) = self.consumer.await {
            tracing::warn!(error = %e, "worker source consumer ended abnormally");
        }
    }
}

/// Registers the start-up workers inline (a failure is retried in the background), then starts
/// the consumer of the source's edits, if it has any.
pub async fn start(
    router: &Arc<Router>,
    source: WorkerSource,
    progress: Option<Arc<SyncProgress>>,
) -> Option<WorkerSourceTask> {
    let specs = source.initial;
    let results = futures::future::join_all(specs.iter().map(|s| router.register(s))).await;
    for (spec, result) in specs.into_iter().zip(results) {
        if let Err(e) = result {
            tracing::warn!(url = %spec.url, error = %e, "start-up registration failed; retrying in background");
            router.spawn_register_with_retry(spec);
        }
    }
    let mut dynamic = source.dynamic?;
    let producer = dynamic.producer.take();
    let progress = progress.unwrap_or_default();
    Some(WorkerSourceTask {
        consumer: spawn_consumer(router.clone(), dynamic.events, dynamic.syncs, progress),
        producer,
    })
}

struct Pending {
    cancel: CancellationToken,
    join: JoinHandle<()>,
}

/// Applies `events` to `router`'s registry until the router shuts down.
pub fn spawn_consumer(
    router: Arc<Router>,
    mut events: mpsc::Receiver<EngineEvent>,
    mut syncs: watch::Receiver<u64>,
    progress: Arc<SyncProgress>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut pending: HashMap<String, Pending> = HashMap::new();
        let mut syncs_open = true;
        let mut events_open = true;
        loop {
            pending.retain(|_, p| !p.join.is_finished());
            // Sync count first, emptiness second: the source queues a list's edits before it
            // bumps the count, so an empty queue after seeing count n means every edit of list n
            // has been received (and, being applied in order, started).
            let seen = *syncs.borrow_and_update();
            if events.is_empty() {
                progress.drained_syncs.fetch_max(seen, Ordering::AcqRel);
            }
            tokio::select! {
                biased;
                _ = router.shutdown.cancelled() => break,
                ev = events.recv(), if events_open => match ev {
                    Some(ev) => apply(&router, &mut pending, &progress, ev).await,
                    None => {
                        tracing::warn!("worker source closed its edit stream; the worker set is frozen");
                        events_open = false;
                    }
                },
                changed = syncs.changed(), if syncs_open => {
                    if changed.is_err() {
                        syncs_open = false;
                    }
                }
            }
            if !events_open && !syncs_open {
                router.shutdown.cancelled().await;
                break;
            }
        }
        for (_, p) in pending.drain() {
            p.cancel.cancel();
            let _ = p.join.await;
        }
    })
}

async fn apply(
    router: &Arc<Router>,
    pending: &mut HashMap<String, Pending>,
    progress: &Arc<SyncProgress>,
    event: EngineEvent,
) {
    match event {
        EngineEvent::Added { url, model } => {
            let mut spec = match WorkerSpec::parse(&url) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(%url, error = %e, "discovered worker has an unusable URL; ignored");
                    return;
                }
            };
            if model.is_some() {
                spec.model = model;
            }
            if pending.contains_key(&spec.url) {
                tracing::debug!(url = %spec.url, "worker is already being registered");
                return;
            }
            if pending.len() >= PENDING_REGISTRATIONS_MAX {
                tracing::error!(url = %spec.url, limit = PENDING_REGISTRATIONS_MAX,
                    "too many registrations in progress; discovered worker ignored");
                return;
            }
            progress
                .first_attempts_pending
                .fetch_add(1, Ordering::AcqRel);
            let cancel = router.shutdown.child_token();
            let join = tokio::spawn(register_until_done(
                router.clone(),
                spec.clone(),
                cancel.clone(),
                FirstAttempt(Some(progress.clone())),
            ));
            pending.insert(spec.url, Pending { cancel, join });
        }
        EngineEvent::Removed { url } => {
            let url = WorkerSpec::parse(&url).map(|s| s.url).unwrap_or(url);
            if let Some(p) = pending.remove(&url) {
                p.cancel.cancel();
                // Waiting (one attempt at most) is what keeps a registration in flight from
                // re-adding the worker after the deregistration below.
                let _ = p.join.await;
            }
            match router.registry.by_url(&url) {
                Some(w) => {
                    router.deregister(w.id).await;
                }
                None => tracing::debug!(%url, "removed worker was not registered"),
            }
        }
    }
}

/// Marks a registration's first attempt as done exactly once, also if its task is aborted.
struct FirstAttempt(Option<Arc<SyncProgress>>);

impl FirstAttempt {
    fn done(&mut self) {
        if let Some(p) = self.0.take() {
            p.first_attempts_pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for FirstAttempt {
    fn drop(&mut self) {
        self.done();
    }
}

async fn register_until_done(
    router: Arc<Router>,
    spec: WorkerSpec,
    cancel: CancellationToken,
    mut first: FirstAttempt,
) {
    let mut wait_ms = REGISTER_RETRY_START_MS;
    let entry =
        crate::control::router::RetryLoopEntry::new(&router.registrations_retrying, &spec.url);
    loop {
        let result = router.register(&spec).await;
        first.done();
        match result {
            Ok(_) => return,
            Err(RegisterError::Registry(e)) => {
                tracing::info!(url = %spec.url, error = %e, "discovered worker is already registered");
                return;
            }
            Err(e) => {
                entry.failed(&e.to_string());
                tracing::warn!(url = %spec.url, error = %e, retry_ms = wait_ms,
                    "discovered worker cannot be registered yet; retrying")
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(wait_ms)) => {}
        }
        wait_ms = (wait_ms * 2).min(REGISTER_RETRY_MAX_MS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synced_gate_opens_only_after_a_drained_list_and_first_attempts_then_latches() {
        let p = SyncProgress::new();
        let gate = SyncedGate(p.clone());
        assert!(gate.check().is_err(), "no list yet");
        p.first_attempts_pending.store(2, Ordering::Release);
        p.drained_syncs.store(1, Ordering::Release);
        let why = gate.check().unwrap_err();
        assert!(why.contains("2 discovered workers"), "{why}");
        p.first_attempts_pending.store(0, Ordering::Release);
        assert!(gate.check().is_ok());
        p.first_attempts_pending.store(5, Ordering::Release);
        assert!(
            gate.check().is_ok(),
            "latched: a scale-up does not close it"
        );
    }

    #[test]
    fn a_first_attempt_guard_decrements_once_even_when_dropped_after_done() {
        let p = SyncProgress::new();
        p.first_attempts_pending.store(1, Ordering::Release);
        let mut g = FirstAttempt(Some(p.clone()));
        g.done();
        drop(g);
        assert_eq!(p.first_attempts_pending.load(Ordering::Acquire), 0);
        p.first_attempts_pending.store(1, Ordering::Release);
        drop(FirstAttempt(Some(p.clone())));
        assert_eq!(p.first_attempts_pending.load(Ordering::Acquire), 0);
    }
}
