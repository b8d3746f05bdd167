//! The router's only door to the KV plane (`kvroute-kv`) and the index (`kvroute-index`).
//!
//! Everything the router needs from the KV side goes through [`KvBridge`]: learning a worker's
//! model and KV-event config, attaching/detaching it to the plane, matching a request's block
//! hashes against the model's index, and reading rank states and engine load. Keeping it in one
//! module keeps the rest of the router independent of the plane's internal types, and keeps the
//! per-request work (hash once, match into a reused thread-local buffer) in one place.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_index::{PrefixMatch, hash};
use kvroute_kv::{KvEventsConfig, KvPlane, KvPlaneConfig, KvPlaneError, WorkerInfo};
use parking_lot::RwLock;

use crate::routing::policy::EngineLoad;

/// KV settings for engines that do not advertise them in `/server_info` (vLLM).
#[derive(Debug, Clone, Default)]
pub struct KvFlagDefaults {
    /// e.g. `tcp://{host}:5557`; `{host}` is replaced by the worker's host.
    pub events_endpoint_template: Option<String>,
    pub replay_port_base: Option<u16>,
    pub block_size: Option<usize>,
    pub dp_size: Option<u32>,
}

/// Block size assumed for a model when neither the engine nor `--block-size` gives one: vLLM's
/// default on GPUs. The KV plane indexes such an engine's events in it too, so `--block-size`
/// left unset means 16 everywhere; an engine that stores other blocks is then named by the
/// plane's block-size warning and `GET /workers` (`foreign_block_size`), not refused in silence.
pub const FALLBACK_BLOCK_SIZE_TOKENS: usize = 16;
/// Largest `--block-size` accepted: engines' pages are tens to hundreds of tokens; a larger value
/// is a typo that would leave every prompt shorter than one block.
pub const BLOCK_SIZE_TOKENS_MAX: u32 = 65_536;

/// Largest `/v1/models` body read when `/server_info` does not name the model.
pub const MODELS_BODY_MAX_BYTES: usize = 1024 * 1024;
/// Time budget of the `/v1/models` fallback lookup.
pub const MODELS_TIMEOUT_MS: u64 = 2_000;

/// What the router learned about a worker before registering it.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub served_model_name: Option<String>,
    pub kv: Option<KvEventsConfig>,
    pub dp_size: u32,
    pub block_size: Option<usize>,
    /// "server_info", "flags" or "none".
    pub kv_source: &'static str,
    /// The model's context length as the engine states it (`/server_info`, or `max_model_len`
    /// in vLLM's `/v1/models`), if it does.
    pub context_length: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum KvBridgeError {
    #[error("{0}")]
    Discovery(#[from] kvroute_kv::DiscoveryError),
    #[error("cannot learn the model served by {url}: {reason}")]
    NoModel { url: String, reason: String },
}

/// Per-rank result of matching one request's prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankHit {
    pub matched_blocks: u32,
    pub device_blocks: u32,
}

/// A source of per-rank prefix matches other than the index: the demo's measuring stick.
///
/// The demo compares `cache_aware` with an "oracle" run that uses the same cost model but reads
/// the engines' ACTUAL caches instead of the router's event-built index, so the gap between the
/// two is exactly what the index's lag and blindness cost. It is a trait object set through
/// [`crate::config::RouterConfig::prefix_oracle`], which no CLI flag fills: only in-process code that owns
/// the engines (the demo, tests) can build one.
pub trait PrefixOracle: Send + Sync {
    /// Calls `visit(url, dp_rank, hit)` for every rank of `model` holding at least the first
    /// block of `tokens`; returns the block size used, or `None` when it knows no such model.
    fn match_prefix(
        &self,
        model: &str,
        tokens: &[u32],
        visit: &mut dyn FnMut(&str, u32, RankHit),
    ) -> Option<usize>;
}

/// RankId (as index) -> (worker url, dp rank) of one model's index.
type RankMap = Arc<Vec<Option<(Arc<str>, u32)>>>;

pub struct KvBridge {
    defaults: KvFlagDefaults,
    plane: KvPlane,
    /// Per model, RankId -> (worker url, dp rank). Rank ids are never reused by an index, so a
    /// cached map can only lack new ranks; it is refreshed when a match names an unknown id.
    rank_maps: RwLock<HashMap<String, RankMap>>,
    /// When set, prefix matches come from here instead of the index (demo / tests only).
    oracle: Option<Arc<dyn PrefixOracle>>,
}

thread_local! {
    /// Per routing thread: the match output, reused.
    static SCRATCH: RefCell<PrefixMatch> = RefCell::new(PrefixMatch::new());
}

impl KvBridge {
    pub fn new(
        defaults: KvFlagDefaults,
        registry: &prometheus::Registry,
        oracle: Option<Arc<dyn PrefixOracle>>,
    ) -> Result<KvBridge, KvPlaneError> {
        let cfg = KvPlaneConfig {
            // A size past u32 cannot be an engine's; the plane's default then matches no event
            // and the block-size warning names the engines' real one.
            default_block_size: Some(
                u32::try_from(defaults.block_size.unwrap_or(FALLBACK_BLOCK_SIZE_TOKENS))
                    .unwrap_or(u32::MAX),
            ),
            ..KvPlaneConfig::default()
        };
        let plane = KvPlane::new(cfg, registry)?;
        Ok(KvBridge {
            defaults,
            plane,
            rank_maps: RwLock::new(HashMap::new()),
            oracle,
        })
    }

    pub fn plane(&self) -> &KvPlane {
        &self.plane
    }

    /// Learns model name and KV config: from `/server_info` (SGLang), else from the router's
    /// flags (vLLM advertises nothing), and the model name from `/v1/models` if still unknown.
    pub async fn discover(
        &self,
        http: &reqwest::Client,
        url: &str,
    ) -> Result<EngineInfo, KvBridgeError> {
        let info = match kvroute_kv::fetch_worker_info(http, url).await {
            Ok(info) => info,
            // An engine without /server_info (vLLM) answers 404; that is "nothing advertised",
            // not a failure. An unreachable engine is a failure.
            Err(kvroute_kv::DiscoveryError::HttpStatus { status: 404, .. }) => WorkerInfo {
                served_model_name: None,
                kv_events: None,
                context_length: None,
            },
            Err(e) => return Err(e.into()),
        };
        let (kv, kv_source) = match info.kv_events {
            Some(kv) => (Some(kv), "server_info"),
            None => match &self.defaults.events_endpoint_template {
                Some(tpl) => (
                    Some(kvroute_kv::kv_config_from_template(
                        url,
                        tpl,
                        self.defaults.replay_port_base,
                        self.defaults.block_size.map(|b| b as u32),
                        self.defaults.dp_size.unwrap_or(1),
                    )?),
                    "flags",
                ),
                None => (None, "none"),
            },
        };
        let (served_model_name, context_length) = match info.served_model_name {
            Some(m) => (Some(m), info.context_length),
            None => match models_endpoint_first(http, url).await {
                Ok((id, max_model_len)) => (Some(id), info.context_length.or(max_model_len)),
                Err(_) => (None, info.context_length),
            },
        };
        let dp_size = kv
            .as_ref()
            .map(|k| k.dp_size)
            .or(self.defaults.dp_size)
            .unwrap_or(1);
        let block_size = kv
            .as_ref()
            .and_then(|k| k.block_size.map(|b| b as usize))
            .or(self.defaults.block_size);
        Ok(EngineInfo {
            served_model_name,
            kv,
            dp_size,
            block_size,
            kv_source,
            context_length: context_length.and_then(|n| usize::try_from(n).ok()),
        })
    }

    /// Starts consuming the worker's KV events into its model's index. A worker the plane
    /// refuses (no KV config, block size mismatch) stays routable on load alone; the reason is
    /// returned for the logs and `GET /workers`.
    /// With `bootstrap`, the worker's ranks hold their live batches until the bootstrap task
    /// grafts a sibling's snapshot under them or releases them.
    pub async fn attach(
        &self,
        url: &str,
        model: &str,
        kv: Option<&KvEventsConfig>,
        bootstrap: bool,
    ) -> Result<u64, String> {
        let Some(kv) = kv else {
            return Err(
                "worker advertises no KV events and no --kv-events-endpoint-template is set".into(),
            );
        };
        let added = if bootstrap {
            self.plane
                .add_worker_bootstrapping(url, model, kv.clone())
                .await
        } else {
            self.plane.add_worker(url, model, kv.clone()).await
        };
        added.map_err(|e| e.to_string())
    }

    /// Stops consuming a worker's events; its ranks are gone from the index when this returns.
    pub async fn detach(&self, url: &str) {
        match self.plane.remove_worker(url).await {
            Ok(()) | Err(KvPlaneError::WorkerNotFound { .. }) => {}
            Err(e) => tracing::warn!(url, error = %e, "removing worker from the KV plane failed"),
        }
    }

    pub async fn shutdown(&self) {
        self.plane.shutdown().await;
    }

    fn rank_map(&self, model: &str, reader: &kvroute_index::IndexReader, need: u32) -> RankMap {
        if let Some(m) = self.rank_maps.read().get(model)
            && (need as usize) < m.len()
            && m[need as usize].is_some()
        {
            return m.clone();
        }
        let mut map: Vec<Option<(Arc<str>, u32)>> = Vec::new();
        for (id, r) in reader.ranks() {
            let i = id.0 as usize;
            if map.len() <= i {
                map.resize(i + 1, None);
            }
            map[i] = Some((Arc::from(r.worker_url.as_str()), r.dp_rank));
        }
        let map = Arc::new(map);
        self.rank_maps
            .write()
            .insert(model.to_string(), map.clone());
        map
    }

    /// Hashes `tokens` once into `hashes` and matches them against `model`'s index, calling
    /// `visit(url, dp_rank, hit)` for every rank holding at least the first block. Returns the
    /// index's block size, or `None` when the model has no index (no worker publishes events;
    /// `hashes` is then left empty). The caller keeps the hashes for the pending-prefix table,
    /// whose keys must be exactly the index's.
    pub fn match_prefix(
        &self,
        model: &str,
        tokens: &[u32],
        hashes: &mut Vec<u64>,
        mut visit: impl FnMut(&str, u32, RankHit),
    ) -> Option<usize> {
        hashes.clear();
        if let Some(oracle) = &self.oracle {
            let block_size = oracle.match_prefix(model, tokens, &mut visit)?;
            hash_blocks(tokens, block_size, hashes);
            return Some(block_size);
        }
        let view = self.plane.model_view(model)?;
        let block_size = view.block_size as usize;
        hash_blocks(tokens, block_size, hashes);
        SCRATCH.with(|scratch| {
            let matched = &mut *scratch.borrow_mut();
            view.reader.match_prefix(hashes, matched);
            let mut map: Option<RankMap> = None;
            for m in &matched.ranks {
                let known = map
                    .as_ref()
                    .and_then(|mp| mp.get(m.rank.0 as usize).cloned().flatten());
                let entry = match known {
                    Some(e) => Some(e),
                    None => {
                        let fresh = self.rank_map(model, &view.reader, m.rank.0);
                        let e = fresh.get(m.rank.0 as usize).cloned().flatten();
                        map = Some(fresh);
                        e
                    }
                };
                if let Some((url, dp)) = entry {
                    visit(
                        &url,
                        dp,
                        RankHit {
                            matched_blocks: m.matched_blocks,
                            device_blocks: m.device_blocks,
                        },
                    );
                }
            }
        });
        Some(block_size)
    }

    /// Every rank's engine-reported load and index occupancy of the worker at `url` (indexed by
    /// DP rank), read under one lock, for the routing path.
    pub fn with_engine_loads<R>(
        &self,
        url: &str,
        read: impl FnOnce(&[kvroute_kv::engine_loads::RankSlot]) -> R,
    ) -> R {
        self.plane.with_engine_loads(url, read)
    }

    pub fn engine_load(&self, url: &str, dp_rank: u32) -> Option<EngineLoad> {
        self.plane.engine_load(url, dp_rank).map(EngineLoad::from)
    }

    /// The ranks of `model` that this replica may name empty to a sibling: the index holds their
    /// publisher's whole stream since seq 0, and no bootstrap step (a graft still being applied,
    /// batches queued behind it) is between that knowledge and the index.
    pub fn ranks_with_complete_history(
        &self,
        model: &str,
    ) -> std::collections::HashSet<kvroute_wire::snapshot::RankRef> {
        use kvroute_kv::status::BootstrapState;
        self.plane
            .rank_states()
            .into_iter()
            .filter(|s| {
                s.model == model
                    && s.history_complete
                    && s.held_batches == 0
                    && matches!(
                        s.bootstrap,
                        BootstrapState::Off | BootstrapState::Settled(_)
                    )
            })
            .map(|s| kvroute_wire::snapshot::RankRef {
                worker_url: s.worker_url,
                dp_rank: s.dp_rank,
            })
            .collect()
    }

    /// Per-rank KV state for `GET /workers` (cursor, subscriber state, counters).
    pub fn rank_states(&self, url: &str) -> Vec<serde_json::Value> {
        let mut states: Vec<_> = self
            .plane
            .rank_states()
            .into_iter()
            .filter(|s| s.worker_url == url)
            .collect();
        states.sort_by_key(|s| s.dp_rank);
        states
            .into_iter()
            .map(|s| {
                serde_json::json!({
                    "dp_rank": s.dp_rank, "incarnation": s.incarnation, "cursor": s.cursor,
                    "subscriber": format!("{:?}", s.subscriber).to_lowercase(),
                    "applied_batches": s.applied_batches, "duplicate_batches": s.duplicate_batches,
                    "lost_batches": s.lost_batches, "replays": s.replays,
                    "publisher_restarts": s.publisher_restarts,
                    "history_complete": s.history_complete,
                    "skipped_blocks": skipped_blocks_json(&s.skipped_blocks),
                    "foreign_block_size": s.foreign_block_size,
                    "bootstrap": {
                        "state": s.bootstrap.label(),
                        "outcome": s.bootstrap.outcome().map(|o| o.label()),
                        "held_batches": s.held_batches, "held_bytes": s.held_bytes,
                    },
                })
            })
            .collect()
    }
}

/// What the index did not take from a rank's events, by reason (the metric's labels).
fn skipped_blocks_json(skipped: &kvroute_index::SkippedBlocks) -> serde_json::Value {
    skipped
        .by_reason()
        .into_iter()
        .map(|(reason, blocks)| (reason.to_string(), serde_json::Value::from(blocks)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The block hashes the index keys its nodes by (base namespace), for `tokens` at `block_size`.
pub fn hash_blocks(tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    hash::hash_token_blocks(tokens, block_size, hash::BASE_NAMESPACE, out);
}

/// The first model of `/v1/models`: its id, and vLLM's `max_model_len` if given.
async fn models_endpoint_first(
    http: &reqwest::Client,
    url: &str,
) -> Result<(String, Option<u64>), String> {
    let resp = http
        .get(format!("{url}/v1/models"))
        .timeout(Duration::from_millis(MODELS_TIMEOUT_MS))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("/v1/models answered {}", resp.status()));
    }
    let body = read_capped(resp, MODELS_BODY_MAX_BYTES).await?;
    let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    let first = &v["data"][0];
    let id = first["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| "no data[0].id in /v1/models".to_string())?;
    Ok((id, first["max_model_len"].as_u64().filter(|&n| n > 0)))
}

pub async fn read_capped(
    mut resp: reqwest::Response,
    limit_bytes: usize,
) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > limit_bytes {
            return Err(format!("body exceeds {limit_bytes} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
