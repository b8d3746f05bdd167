//! The router's shared state and its lifecycle: registering and removing workers, and the
//! active health loop. Choosing ranks for a request is `routing::plan` (an `impl Router` there),
//! so the routing step reads in one place.
//!
//! [`Router`] is built once by `serve` and shared (`Arc`) by every handler; per-rank load lives
//! in atomics and the model groups are `Arc` snapshots, so the data plane reads it without
//! locks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::{RouterConfig, WorkerSpec};
use crate::control::metrics::Metrics;
use crate::control::registry::{HealthEvent, Registry, Worker, WorkerId};
use crate::peer::bootstrap::{Bootstrap, Command};
use crate::routing::kv::KvBridge;
use crate::routing::pending::PendingPrefixes;
use crate::routing::policy::{Policy, PolicyKind};
use crate::routing::tokenize::TokenizerSet;

pub use crate::routing::kv::FALLBACK_BLOCK_SIZE_TOKENS;
/// Longest wait between registration attempts of a start-up worker that is not up yet.
pub const REGISTER_RETRY_MAX_MS: u64 = 5_000;
/// Longest registration error kept for `/workers` (an error can quote an engine's answer).
pub const REGISTER_ERROR_BYTES_MAX: usize = 512;

/// Workers whose registration is being retried: an engine not up yet, a wrong URL, a model its
/// engine does not name. Until one registers it is in no model group, so without this it would
/// show only in the logs: `/workers` lists these under `registering`, and the `healthy_worker`
/// gate names the first. One entry per configured or discovered URL, removed when its retry
/// loop ends (registered, already registered, or stopped), so the map is bounded by the worker
/// list.
#[derive(Default)]
pub struct RegistrationsRetrying {
    by_url: parking_lot::Mutex<std::collections::BTreeMap<String, RetryingRegistration>>,
}

/// One worker whose registration failed and is retried.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RetryingRegistration {
    pub url: String,
    pub failed_attempts: u32,
    pub last_error: String,
}

impl RegistrationsRetrying {
    /// Records a failed attempt of `url`'s registration.
    fn failed(&self, url: &str, error: &str) {
        let mut by_url = self.by_url.lock();
        let entry = by_url
            .entry(url.to_string())
            .or_insert_with(|| RetryingRegistration {
                url: url.to_string(),
                failed_attempts: 0,
                last_error: String::new(),
            });
        entry.failed_attempts = entry.failed_attempts.saturating_add(1);
        let mut cut = error.len().min(REGISTER_ERROR_BYTES_MAX);
        while !error.is_char_boundary(cut) {
            cut -= 1;
        }
        entry.last_error = error[..cut].to_string();
    }

    fn ended(&self, url: &str) {
        self.by_url.lock().remove(url);
    }

    /// The workers being retried, by URL.
    pub fn list(&self) -> Vec<RetryingRegistration> {
        self.by_url.lock().values().cloned().collect()
    }
}

/// Held by a registration's retry loop: its `/workers` entry goes when the loop does, whether
/// it returned or its task was dropped.
pub struct RetryLoopEntry<'a> {
    retrying: &'a RegistrationsRetrying,
    url: &'a str,
}

impl<'a> RetryLoopEntry<'a> {
    pub fn new(retrying: &'a RegistrationsRetrying, url: &'a str) -> Self {
        RetryLoopEntry { retrying, url }
    }

    pub fn failed(&self, error: &str) {
        self.retrying.failed(self.url, error);
    }
}

impl Drop for RetryLoopEntry<'_> {
    fn drop(&mut self) {
        self.retrying.ended(self.url);
    }
}

pub struct Router {
    pub config: RouterConfig,
    pub registry: Registry,
    pub kv: KvBridge,
    pub policy: Policy,
    pub metrics: Metrics,
    /// Control-plane client (discovery, health checks, peers).
    pub http: reqwest::Client,
    /// The runtime the control plane (pump, subscribers, health loop, admin handlers) runs on;
    /// data-plane threads hand control-plane work to it (see [`crate::data_plane`]).
    pub control: tokio::runtime::Handle,
    pub tokenizers: TokenizerSet,
    pub shutdown: CancellationToken,
    /// Siblings found by peer discovery (empty and never synced when discovery is off); the
    /// bootstrap consumer reads it.
    pub peers: kvroute_discovery::PeerRegistry,
    /// Producer of `GET /internal/kv_snapshot`.
    pub snapshots: Arc<crate::peer::producer::SnapshotProducer>,
    /// Blocks routed to a rank and not yet confirmed by its KV events.
    pub pending: PendingPrefixes,
    /// Peer bootstrap of the index from a warm sibling (a peer source and cache_aware); its
    /// task is started by `serve` before the first worker registers.
    pub bootstrap: Option<Arc<Bootstrap>>,
    /// Predicted against reported cached tokens, per model.
    pub predictions: crate::routing::prediction::PredictionChecks,
    /// The siblings' load bookings as followed (see [`crate::peer::load_share`]).
    pub load_share: crate::peer::load_share::LoadShare,
    /// Bytes of large bodies being prepared at once (see
    /// [`crate::config::PREPARE_BUDGETS_IN_FLIGHT`]).
    pub prepare_budget: Arc<tokio::sync::Semaphore>,
    /// How the siblings name this replica, set by `serve` once the internal listener is bound;
    /// unset (cold-prompt ownership off) when it cannot be known
    /// (`crate::peer::cold_owner::self_peer_url`).
    pub self_peer: std::sync::OnceLock<kvroute_discovery::PeerUrl>,
    /// Held while this replica places a cold prompt it owns (`crate::routing::plan`), so two
    /// such placements see each other's pending prefix.
    pub cold_placement_lock: parking_lot::Mutex<()>,
    /// Siblings whose placement asks failed lately (`crate::peer::owner_standings`); written
    /// by the requests that asked, read when a cold prompt's owner is named.
    pub cold_owner_standings: parking_lot::Mutex<crate::peer::owner_standings::OwnerStandings>,
    /// Workers whose registration failed and is being retried.
    pub registrations_retrying: RegistrationsRetrying,
}

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Kv(#[from] crate::routing::kv::KvBridgeError),
    #[error(transparent)]
    Registry(#[from] crate::control::registry::RegistryError),
}

impl Router {
    /// Connect timeout of the data-path clients (one per data-plane thread).
    pub fn upstream_connect_timeout_ms(&self) -> u64 {
        self.config.health_timeout_ms.max(100)
    }

    pub fn new(config: RouterConfig, prom: prometheus::Registry) -> Result<Router, String> {
        let metrics = Metrics::new(prom.clone()).map_err(|e| e.to_string())?;
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_millis(config.health_timeout_ms.max(100)))
            .build()
            .map_err(|e| e.to_string())?;
        let peers =
            kvroute_discovery::PeerRegistry::with_metrics(&prom).map_err(|e| e.to_string())?;
        let snapshot_metrics =
            crate::peer::producer::SnapshotMetrics::new(&prom).map_err(|e| e.to_string())?;
        let snapshots = Arc::new(crate::peer::producer::SnapshotProducer::new(
            snapshot_metrics,
            config.internal_auth_token.clone(),
            config.kv_snapshot_max_bytes,
        ));
        let pending =
            PendingPrefixes::new(config.pending_prefix_ttl_ms, &prom).map_err(|e| e.to_string())?;
        // Peer bootstrap needs siblings to ask and an index to warm.
        let bootstrap = match (&config.peer_source, config.policy) {
            (Some(_), PolicyKind::CacheAware) => {
                Some(Arc::new(Bootstrap::new(config.bootstrap.clone(), &prom)?))
            }
            _ => None,
        };
        Ok(Router {
            bootstrap,
            peers,
            snapshots,
            pending,
            kv: KvBridge::new(
                config.kv_defaults.clone(),
                &prom,
                config.prefix_oracle.clone(),
            )
            .map_err(|e| e.to_string())?,
            policy: Policy::new(config.policy, config.weights, config.rng_seed),
            registry: Registry::new(config.prompt_tokens_max),
            predictions: crate::routing::prediction::PredictionChecks::new(config.prediction_check),
            load_share: Default::default(),
            self_peer: std::sync::OnceLock::new(),
            cold_placement_lock: parking_lot::Mutex::new(()),
            cold_owner_standings: Default::default(),
            registrations_retrying: Default::default(),
            prepare_budget: Arc::new(tokio::sync::Semaphore::new(
                crate::config::PREPARE_BUDGETS_IN_FLIGHT
                    .saturating_mul(config.tokenize_text_bytes_max)
                    .clamp(1, u32::MAX as usize),
            )),
            tokenizers: TokenizerSet::default(),
            shutdown: CancellationToken::new(),
            metrics,
            http,
            control: tokio::runtime::Handle::try_current()
                .map_err(|e| format!("the router must be created inside a tokio runtime: {e}"))?,
            config,
        })
    }

    /// Discovers and registers one worker; the worker is healthy at once if discovery reached it.
    pub async fn register(&self, spec: &WorkerSpec) -> Result<Arc<Worker>, RegisterError> {
        let discovered = self.kv.discover(&self.http, &spec.url).await;
        let (info, reached) = match discovered {
            Ok(info) => (info, true),
            Err(e) if spec.model.is_some() => {
                tracing::warn!(url = %spec.url, error = %e, "worker unreachable; registering it as pending");
                (
                    crate::routing::kv::EngineInfo {
                        served_model_name: None,
                        kv: None,
                        dp_size: self.config.kv_defaults.dp_size.unwrap_or(1),
                        block_size: self.config.kv_defaults.block_size,
                        kv_source: "none",
                        context_length: None,
                    },
                    false,
                )
            }
            Err(e) => return Err(e.into()),
        };
        let model = match spec.model.clone().or(info.served_model_name.clone()) {
            Some(m) => m,
            None => {
                return Err(crate::routing::kv::KvBridgeError::NoModel {
                    url: spec.url.clone(),
                    reason: "neither /server_info nor /v1/models named it; use URL@model".into(),
                }
                .into());
            }
        };
        let tokenizer_path = self
            .config
            .model_tokenizers
            .get(&model)
            .or(self.config.tokenizer_path.as_ref());
        let tokenizer = match tokenizer_path {
            Some(p) => match self
                .tokenizers
                .get_or_load(p, self.config.tokenizer_cache_entries_max)
            {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!(%model, error = %e, "no tokenizer; text requests route on load only");
                    None
                }
            },
            None => None,
        };
        let block_size = info.block_size.unwrap_or(FALLBACK_BLOCK_SIZE_TOKENS);
        let existing_group = self.registry.model(&model);
        if existing_group.is_none() && self.policy.kind == PolicyKind::CacheAware {
            // Said once per model, when its group is made: the group keeps this tokenizer for
            // its life, and every text request of the model is routed blind without one.
            match &tokenizer {
                None => tracing::warn!(%model,
                    "no tokenizer for this model (--tokenizer-path, --model-tokenizer): its text prompts and chats are routed on load alone, blind to the engines' caches (token-id requests stay cache-aware); /workers and kvroute_untokenized_prompts_total{{reason=\"no_tokenizer\"}} show it"),
                Some(t) if !t.has_chat_template() => tracing::warn!(%model,
                    "this model's tokenizer has no chat template (tokenizer_config.json's chat_template): its chats are routed on load alone, blind to the engines' caches"),
                Some(_) => {}
            }
        }
        if let Some(group) = existing_group
            && group.block_size != block_size
        {
            tracing::warn!(%model, group = group.block_size, worker = block_size, url = %spec.url,
                "worker block size differs from its model group's; the group's is used for hashing");
        }
        let worker = self.registry.add(
            &spec.url,
            &model,
            crate::control::registry::EngineFacts {
                dp_size: info.dp_size,
                block_size,
                kv_source: info.kv_source,
                context_length: info.context_length,
            },
            tokenizer,
        )?;
        worker
            .discovered
            .store(reached, std::sync::atomic::Ordering::Relaxed);
        if reached {
            worker
                .health
                .lock()
                .on_event(HealthEvent::CheckOk, Instant::now(), 1, Duration::ZERO);
        }
        let kv_attached = self
            .attach_kv(&spec.url, &model, info.kv.as_ref(), info.dp_size)
            .await;
        if let Err(reason) = &kv_attached {
            tracing::warn!(url = %spec.url, %reason, "no KV events from this worker; it is routed on load only");
        }
        *worker.kv_attach_error.lock() = kv_attached.err();
        tracing::info!(id = worker.id, url = %spec.url, %model, dp_size = info.dp_size, block_size,
            kv = info.kv_source, "worker registered");
        Ok(worker)
    }

    /// Attaches a worker's KV events to the plane; with peer bootstrap on, its ranks hold their
    /// batches and the bootstrap task is told about them. The one path for a registration and
    /// for a late discovery.
    async fn attach_kv(
        &self,
        url: &str,
        model: &str,
        kv: Option<&kvroute_kv::KvEventsConfig>,
        dp_size: u32,
    ) -> Result<u64, String> {
        let attached = self
            .kv
            .attach(url, model, kv, self.bootstrap.is_some())
            .await;
        if let (Some(bootstrap), Ok(incarnation)) = (&self.bootstrap, &attached) {
            bootstrap
                .send(Command::Registered {
                    model: model.to_string(),
                    url: url.to_string(),
                    dp_size,
                    incarnation: *incarnation,
                })
                .await;
        }
        attached
    }

    pub async fn deregister(&self, id: WorkerId) -> Option<Arc<Worker>> {
        let worker = self.registry.remove(id)?;
        self.kv.detach(&worker.url).await;
        if let Some(bootstrap) = &self.bootstrap {
            bootstrap
                .send(Command::Removed {
                    url: worker.url.clone(),
                })
                .await;
        }
        for r in 0..worker.dp_size {
            let _ = self
                .metrics
                .in_flight
                .remove_label_values(&[&worker.url, &r.to_string()]);
        }
        tracing::info!(id, url = %worker.url, "worker removed");
        Some(worker)
    }

    /// Registers a start-up worker, retrying in the background until it answers or shutdown.
    pub fn spawn_register_with_retry(self: &Arc<Self>, spec: WorkerSpec) {
        let router = self.clone();
        tokio::spawn(async move {
            let mut wait_ms = 200;
            let entry = RetryLoopEntry::new(&router.registrations_retrying, &spec.url);
            loop {
                match router.register(&spec).await {
                    Ok(_) => return,
                    Err(RegisterError::Registry(_)) => return,
                    Err(e) => {
                        entry.failed(&e.to_string());
                        tracing::warn!(url = %spec.url, error = %e, "worker registration failed; retrying")
                    }
                }
                tokio::select! {
                    _ = router.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(wait_ms)) => {}
                }
                wait_ms = (wait_ms * 2).min(REGISTER_RETRY_MAX_MS);
            }
        });
    }

    pub fn health_event(&self, worker: &Worker, ev: HealthEvent) {
        let before = worker.health.lock().label(Instant::now());
        worker.health.lock().on_event(
            ev,
            Instant::now(),
            self.config.eject_after_failures,
            Duration::from_millis(self.config.eject_cooldown_ms),
        );
        let after = worker.health.lock().label(Instant::now());
        if before != after {
            tracing::info!(url = %worker.url, from = before, to = after, "worker health changed");
        }
    }

    /// Discovers and attaches the KV events of a worker that was registered while unreachable.
    async fn late_discovery(&self, w: &Worker) {
        match self.kv.discover(&self.http, &w.url).await {
            Ok(info) => {
                if info.dp_size != w.dp_size {
                    tracing::warn!(url = %w.url, registered = w.dp_size, reported = info.dp_size,
                        "worker reports another dp_size than it was registered with; re-add it to use all ranks");
                }
                let attached = self
                    .attach_kv(&w.url, &w.model, info.kv.as_ref(), w.dp_size)
                    .await;
                *w.kv_attach_error.lock() = attached.err();
                w.discovered
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(url = %w.url, "late discovery of a worker registered while down");
            }
            Err(e) => {
                tracing::debug!(url = %w.url, error = %e, "late discovery failed; will retry")
            }
        }
    }

    /// `GET /health` on every worker each `health_interval_ms`, until shutdown.
    pub fn spawn_health_loop(self: &Arc<Self>) {
        let router = self.clone();
        tokio::spawn(async move {
            let period = Duration::from_millis(router.config.health_interval_ms.max(10));
            // Registration has just contacted every worker, so the first check waits one period.
            let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = router.shutdown.cancelled() => return,
                    _ = ticker.tick() => {}
                }
                let checks = router.registry.workers().into_iter().map(|w| {
                    let router = router.clone();
                    async move {
                        let ok = router
                            .http
                            .get(format!("{}/health", w.url))
                            .timeout(Duration::from_millis(router.config.health_timeout_ms))
                            .send()
                            .await
                            .map(|r| r.status().is_success())
                            .unwrap_or(false);
                        router.health_event(
                            &w,
                            if ok {
                                HealthEvent::CheckOk
                            } else {
                                HealthEvent::CheckFailed
                            },
                        );
                        if ok && !w.discovered.load(std::sync::atomic::Ordering::Relaxed) {
                            router.late_discovery(&w).await;
                        }
                    }
                });
                futures::future::join_all(checks).await;
            }
        });
    }
}
