//! The router's shared state and the decisions made on it: registering workers, choosing ranks
//! for a request, and the active health loop.
//!
//! [`Router`] is built once by `serve` and shared (`Arc`) by every handler. Choosing a rank is
//! synchronous and lock-light: the model group is an `Arc` snapshot, per-rank load is atomics,
//! the prefix match writes into a thread-local buffer, and nothing is held across an await.
//! A routed `cache_aware` plan also records the prompt's blocks as pending on the chosen rank
//! ([`crate::pending`]) while the block hashes are still in that buffer; `/debug/route` plans
//! without recording, so looking never changes what the next request sees.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::{RouterConfig, WorkerSpec};
use crate::error::ApiError;
use crate::kv::KvBridge;
use crate::metrics::Metrics;
use crate::pending::{PendingPrefixes, RankKey, RankWalk};
use crate::policy::{Decision, Policy, RankInput};
use crate::registry::{HealthEvent, ModelGroup, Registry, Worker, WorkerId};
use crate::tokenize::TokenizerSet;

/// Block size assumed for a model when neither the engine nor `--block-size` gives one.
pub const FALLBACK_BLOCK_SIZE_TOKENS: usize = 16;
/// Longest wait between registration attempts of a start-up worker that is not up yet.
pub const REGISTER_RETRY_MAX_MS: u64 = 5_000;

thread_local! {
    /// Per routing thread: the request's block hashes and the pending walk's per-rank state,
    /// reused so planning allocates neither.
    static PLAN_SCRATCH: RefCell<(Vec<u64>, Vec<RankWalk>)> = const { RefCell::new((Vec::new(), Vec::new())) };
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
    pub peers: kvroute_peers::PeerRegistry,
    /// Producer of `GET /internal/kv_snapshot`.
    pub snapshots: Arc<crate::snapshot_producer::SnapshotProducer>,
    /// Blocks routed to a rank and not yet confirmed by its KV events.
    pub pending: PendingPrefixes,
}

/// One routable rank of the request's model.
#[derive(Clone)]
pub struct RankCandidate {
    pub worker: Arc<Worker>,
    pub dp_rank: u32,
    pub input: RankInput,
}

pub struct RoutePlan {
    pub model: Arc<ModelGroup>,
    pub candidates: Vec<RankCandidate>,
    pub decision: Decision,
    pub prompt_tokens: usize,
    pub indexed: bool,
}

impl RoutePlan {
    pub fn chosen(&self) -> &RankCandidate {
        &self.candidates[self.decision.order[0]]
    }

    /// Compact one-line explanation for the `x-kvroute-decision` header.
    pub fn header_value(&self, policy: &str, idx: usize) -> String {
        let c = &self.candidates[idx];
        let s = &self.decision.scores[idx];
        format!(
            "policy={policy};reason={};worker={};url={};dp_rank={};matched_blocks={};prompt_tokens={};cost_ms={:.3};candidates={};pending_blocks={}",
            self.decision.reason,
            c.worker.id,
            c.worker.url,
            c.dp_rank,
            c.input.matched_blocks,
            self.prompt_tokens,
            s.cost_ms,
            self.candidates.len(),
            c.input.pending_blocks
        )
    }
}

fn rank_key(c: &RankCandidate) -> RankKey {
    RankKey {
        worker: c.worker.id,
        dp_rank: c.dp_rank,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Kv(#[from] crate::kv::KvBridgeError),
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
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
        let peers = kvroute_peers::PeerRegistry::with_metrics(&prom).map_err(|e| e.to_string())?;
        let snapshot_metrics =
            crate::snapshot_producer::SnapshotMetrics::new(&prom).map_err(|e| e.to_string())?;
        let snapshots = Arc::new(crate::snapshot_producer::SnapshotProducer::new(
            snapshot_metrics,
            config.internal_auth_token.clone(),
            config.kv_snapshot_max_bytes,
        ));
        let pending =
            PendingPrefixes::new(config.pending_prefix_ttl_ms, &prom).map_err(|e| e.to_string())?;
        Ok(Router {
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
            registry: Registry::default(),
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
                    crate::kv::EngineInfo {
                        served_model_name: None,
                        kv: None,
                        dp_size: self.config.kv_defaults.dp_size.unwrap_or(1),
                        block_size: self.config.kv_defaults.block_size,
                        kv_source: "none",
                    },
                    false,
                )
            }
            Err(e) => return Err(e.into()),
        };
        let model = match spec.model.clone().or(info.served_model_name.clone()) {
            Some(m) => m,
            None => {
                return Err(crate::kv::KvBridgeError::NoModel {
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
        if let Some(group) = self.registry.model(&model)
            && group.block_size != block_size
        {
            tracing::warn!(%model, group = group.block_size, worker = block_size, url = %spec.url,
                "worker block size differs from its model group's; the group's is used for hashing");
        }
        let worker = self.registry.add(
            &spec.url,
            &model,
            info.dp_size,
            block_size,
            tokenizer,
            info.kv_source,
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
        let kv_attached = self.kv.attach(&spec.url, &model, info.kv.as_ref()).await;
        if let Err(reason) = &kv_attached {
            tracing::warn!(url = %spec.url, %reason, "no KV events from this worker; it is routed on load only");
        }
        *worker.kv_attach_error.lock() = kv_attached.err();
        tracing::info!(id = worker.id, url = %spec.url, %model, dp_size = info.dp_size, block_size,
            kv = info.kv_source, "worker registered");
        Ok(worker)
    }

    pub async fn deregister(&self, id: WorkerId) -> Option<Arc<Worker>> {
        let worker = self.registry.remove(id)?;
        self.kv.detach(&worker.url).await;
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
            loop {
                match router.register(&spec).await {
                    Ok(_) => return,
                    Err(RegisterError::Registry(_)) => return,
                    Err(e) => {
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

    /// The model group a request names (or the only one when it names none).
    pub fn resolve_model(&self, model: Option<&str>) -> Result<Arc<ModelGroup>, ApiError> {
        match model {
            Some(m) => self
                .registry
                .model(m)
                .ok_or_else(|| ApiError::UnknownModel(m.to_string())),
            None => self
                .registry
                .sole_model()
                .ok_or_else(|| ApiError::MissingField {
                    message: "'model' is required when the router serves several models (or none)"
                        .into(),
                    param: "model".into(),
                }),
        }
    }

    /// Scores every routable rank of `group` for `tokens` and orders them, and (cache_aware)
    /// records the prompt's blocks as pending on the chosen rank: the routing path.
    pub fn plan(&self, group: Arc<ModelGroup>, tokens: &[u32]) -> Result<RoutePlan, ApiError> {
        self.plan_inner(group, tokens, true)
    }

    /// Like [`Router::plan`] but without side effects on routing state (no pending entries):
    /// for `/debug/route`, so inspecting a decision never changes the next one.
    pub fn plan_preview(
        &self,
        group: Arc<ModelGroup>,
        tokens: &[u32],
    ) -> Result<RoutePlan, ApiError> {
        self.plan_inner(group, tokens, false)
    }

    fn plan_inner(
        &self,
        group: Arc<ModelGroup>,
        tokens: &[u32],
        record_pending: bool,
    ) -> Result<RoutePlan, ApiError> {
        let started = Instant::now();
        let now = started;
        let now_us = crate::registry::clock_us();
        let mut candidates = Vec::with_capacity(group.workers.len() * 2);
        for w in &group.workers {
            if !w.routable(now) {
                continue;
            }
            for (r, load) in w.ranks.iter().enumerate() {
                candidates.push(RankCandidate {
                    worker: w.clone(),
                    dp_rank: r as u32,
                    input: RankInput {
                        matched_blocks: 0,
                        device_blocks: 0,
                        pending_blocks: 0,
                        in_flight: load.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                        queued_prefill_tokens: load
                            .queued_prefill_tokens
                            .load(std::sync::atomic::Ordering::Relaxed),
                        prefill_backlog_us: load.prefill_backlog_us(now_us) as f64,
                        engine: self.kv.engine_load(&w.url, r as u32),
                    },
                });
            }
        }
        if candidates.is_empty() {
            return Err(ApiError::NoHealthyWorker(format!(
                "no healthy worker serves model '{}'",
                group.name
            )));
        }
        let needs_match =
            self.policy.kind == crate::config::PolicyKind::CacheAware && !tokens.is_empty();
        let mut block_size = group.block_size;
        let mut indexed = false;
        let decision = PLAN_SCRATCH.with(|scratch| {
            let (hashes, walks) = &mut *scratch.borrow_mut();
            hashes.clear();
            if needs_match
                && let Some(bs) =
                    self.kv
                        .match_prefix(&group.name, tokens, hashes, |url, dp, hit| {
                            if let Some(c) = candidates
                                .iter_mut()
                                .find(|c| c.dp_rank == dp && &*c.worker.url == url)
                            {
                                c.input.matched_blocks = hit.matched_blocks;
                                c.input.device_blocks = hit.device_blocks;
                            }
                        })
            {
                block_size = bs;
                indexed = true;
            }
            let use_pending = needs_match && self.pending.enabled();
            if use_pending && !indexed {
                // No index for this model (no KV events): pending entries alone still keep a
                // cold burst together, hashed at the group's block size.
                crate::kv::hash_blocks(tokens, block_size, hashes);
            }
            if use_pending && let Some(table) = self.pending.model(&group.name) {
                walks.clear();
                walks.extend(candidates.iter().map(|c| {
                    RankWalk::new(rank_key(c), c.input.matched_blocks, c.input.device_blocks)
                }));
                table.extend(hashes, self.pending.now_ms(now), walks);
                for (c, w) in candidates.iter_mut().zip(walks.iter()) {
                    c.input.matched_blocks = w.blocks;
                    c.input.device_blocks = w.device_blocks;
                    c.input.pending_blocks = w.pending_blocks();
                }
            }
            let inputs: Vec<RankInput> = candidates.iter().map(|c| c.input).collect();
            let decision = self.policy.decide(&inputs, tokens.len(), block_size);
            if use_pending && record_pending {
                let chosen = &candidates[decision.order[0]];
                // Only blocks neither indexed nor already pending there: an existing entry is
                // not refreshed, because the request that made it is the one that will produce
                // those blocks, so its TTL is the right horizon (and a stream of requests for
                // a prefix that is never confirmed cannot keep it alive forever).
                self.pending.record(
                    &group.name,
                    hashes,
                    chosen.input.matched_blocks as usize,
                    rank_key(chosen),
                    now,
                    chosen.input.pending_blocks > 0,
                );
            }
            decision
        });
        let policy = self.policy.kind.as_str();
        self.metrics
            .routing_latency
            .with_label_values(&[policy])
            .observe(started.elapsed().as_secs_f64());
        Ok(RoutePlan {
            model: group,
            candidates,
            decision,
            prompt_tokens: tokens.len(),
            indexed,
        })
    }

    /// Records a routed decision in the metrics (not done for `/debug/route`).
    pub fn record_decision(&self, plan: &RoutePlan) {
        let policy = self.policy.kind.as_str();
        self.metrics
            .decisions
            .with_label_values(&[policy, plan.decision.reason])
            .inc();
        self.metrics
            .matched_blocks
            .with_label_values(&[&plan.model.name])
            .observe(plan.chosen().input.matched_blocks as f64);
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
                let attached = self.kv.attach(&w.url, &w.model, info.kv.as_ref()).await;
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
