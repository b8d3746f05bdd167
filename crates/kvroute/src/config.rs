//! The router's configuration: one plain struct, [`RouterConfig`], with defaults.
//!
//! Tests and the demo build a `RouterConfig` directly and never go through argument parsing, so
//! anything the library needs lives in the struct; the CLI ([`crate::cli`]) is only a way of
//! filling it. Each room's own settings types live with their owner (the cost weights and policy
//! kind in `routing::policy`, the KV defaults in `routing::kv`); this struct only gathers them.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use crate::control::readiness::ReadinessGate;
use crate::data_plane::limits::ClientLimits;
use crate::peer::bootstrap::BootstrapConfig;
use crate::peer::fetch::{
    FETCH_CONNECT_TIMEOUT_MS, FETCH_READ_TIMEOUT_MS, FETCH_TOTAL_TIMEOUT_MS, FetchConfig,
};
use crate::routing::kv::{KvFlagDefaults, PrefixOracle};
use crate::routing::pending::DEFAULT_PENDING_PREFIX_TTL_MS;
use crate::routing::policy::{CostWeights, PolicyKind};

/// Longest prompt text the router tokenizes by default: about 260 k tokens of English, past the
/// context of most served models, at a worst-case peak of ~170 MB while it is tokenized.
pub const DEFAULT_TOKENIZE_TEXT_BYTES_MAX: usize = 1024 * 1024;
/// Large bodies (past `data_plane::request::INLINE_PREPARE_MAX_BYTES`) are prepared on the
/// blocking pool, each charged up to `tokenize_text_bytes_max` against a budget of this many
/// times it; the rest wait (at most [`PREPARE_BUDGET_WAIT_MS_MAX`]), so concurrent huge prompts
/// cannot multiply the tokenizer's peak memory.
pub const PREPARE_BUDGETS_IN_FLIGHT: usize = 2;
/// Longest a large body waits for the prepare budget before it is answered 503.
pub const PREPARE_BUDGET_WAIT_MS_MAX: u64 = 10_000;
/// Largest request body accepted by default: generous for long prompts as JSON token arrays.
pub const DEFAULT_BODY_MAX_BYTES: usize = 16 * 1024 * 1024;
/// Largest encoded snapshot served or accepted by default. Sized for the planned fleet: 64 ranks
/// x 100,000 blocks encode to roughly 100 MB of binary+zstd, JSON is several times that.
pub const DEFAULT_KV_SNAPSHOT_MAX_BYTES: usize = 1024 * 1024 * 1024;

/// One worker given on the command line: `URL` or `URL@model`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    pub url: String,
    pub model: Option<String>,
}

impl WorkerSpec {
    pub fn parse(s: &str) -> Result<WorkerSpec, String> {
        // The model suffix is split at the LAST '@' after the scheme, so URLs with userinfo are not
        // mistaken for a model (we never expect them, but must not mangle them).
        let (url, model) = match s.rfind('@') {
            Some(i)
                if i > s.find("://").map(|j| j + 3).unwrap_or(0) && !s[i + 1..].contains('/') =>
            {
                (&s[..i], Some(s[i + 1..].to_string()))
            }
            _ => (s, None),
        };
        let url = url.trim_end_matches('/').to_string();
        // The data path's own check (http:// only, a host and path a request line can carry):
        // what it would refuse at every request is refused here, once.
        kvroute_http1::client::check_base_url(&url).map_err(|e| e.to_string())?;
        if model.as_deref() == Some("") {
            return Err(format!("empty model after '@' in {s}"));
        }
        Ok(WorkerSpec { url, model })
    }
}

/// Everything the router library needs. Build with `RouterConfig::default()` and override.
#[derive(Clone)]
pub struct RouterConfig {
    pub listen: SocketAddr,
    pub workers: Vec<WorkerSpec>,
    pub policy: PolicyKind,
    pub weights: CostWeights,
    pub tokenizer_path: Option<PathBuf>,
    pub model_tokenizers: HashMap<String, PathBuf>,
    pub kv_defaults: KvFlagDefaults,
    pub decision_header: bool,
    pub max_body_bytes: usize,
    pub request_timeout_ms: u64,
    pub max_retries: u32,
    pub health_interval_ms: u64,
    pub health_timeout_ms: u64,
    pub eject_after_failures: u32,
    pub eject_cooldown_ms: u64,
    pub shutdown_grace_ms: u64,
    /// Threads serving the public listener, each with its own runtime and upstream pool
    /// (see [`crate::data_plane`]); 0 = one per available CPU.
    pub data_plane_threads: usize,
    pub tokenizer_cache_entries_max: usize,
    /// `--tokenize-text-bytes-max`: the longest prompt text (or chat content) the router
    /// tokenizes; a longer one is routed on load and forwarded untouched, and the engine, which
    /// tokenizes it anyway, judges it. Tokenizing costs about 170 bytes of peak memory per byte
    /// of text, so this bounds what one request can make the router hold; with the prepare
    /// budget ([`PREPARE_BUDGETS_IN_FLIGHT`] of these at once) it bounds all of them.
    pub tokenize_text_bytes_max: usize,
    /// Extra readiness gates (e.g. peer bootstrap) ANDed with the built-in ones.
    pub extra_readiness_gates: Vec<Arc<dyn ReadinessGate>>,
    /// Seed for the policies' random choices; `None` seeds from the OS.
    pub rng_seed: Option<u64>,
    /// Address of the internal (peer) listener; `None` = the main listener's address.
    pub internal_bind: Option<IpAddr>,
    /// Port of the internal listener; `None` = main port + 1, or 0 (OS-assigned) when the main
    /// port is 0, so tests on port 0 never collide.
    pub internal_port: Option<u16>,
    /// Contents of `--internal-auth-token-file` (trailing whitespace trimmed). When set, every
    /// internal request needs `Authorization: Bearer <token>` and the same bytes key the binary
    /// snapshot's HMAC, so the compact snapshot is authenticated end to end.
    pub internal_auth_token: Option<Arc<[u8]>>,
    /// Largest encoded snapshot this replica serves (507 beyond) and its fetch client accepts.
    pub kv_snapshot_max_bytes: usize,
    /// Contents of `--admin-auth-token-file`: when set, the admin API's mutating routes on the
    /// public listener need `Authorization: Bearer <token>` (see [`crate::api::admin`]).
    pub admin_auth_token: Option<Arc<[u8]>>,
    /// `--allow-unauthenticated-admin`: serve the admin API's mutating routes without a token on
    /// a public listener that is not loopback-bound.
    pub allow_unauthenticated_admin: bool,
    /// `--allow-unauthenticated-internal`: start with the internal listener on a non-loopback
    /// address without `--internal-auth-token-file`.
    pub allow_unauthenticated_internal: bool,
    /// Timeouts and the connection cap of the public listener.
    pub client_limits: ClientLimits,
    /// `--max-prompt-tokens`: the longest prompt any model accepts, on top of the context
    /// lengths engines state (`None` = only theirs).
    pub prompt_tokens_max: Option<usize>,
    /// Sibling discovery for peer bootstrap; `None` = off (and so is the bootstrap).
    pub peer_source: Option<kvroute_discovery::PeerSourceConfig>,
    /// How a booting replica searches its siblings (used when `peer_source` is set and the
    /// policy is cache_aware, the only one with an index to warm).
    pub bootstrap: BootstrapConfig,
    /// Kubernetes discovery of engine pods (`--service-discovery`); `None` = off. Its edits go
    /// to the same registry as `workers` (see `worker_source`).
    pub engine_discovery: Option<kvroute_discovery::EngineDiscoveryConfig>,
    /// Demo / test only (no flag sets it): prefix matches from the engines' real caches instead
    /// of the index, see [`PrefixOracle`].
    pub prefix_oracle: Option<Arc<dyn PrefixOracle>>,
    /// How long a routed request's blocks count as pending on the chosen rank before its KV
    /// events confirm them (see [`crate::routing::pending`]); 0 disables pending prefixes.
    pub pending_prefix_ttl_ms: u64,
    /// The prediction check (`--prediction-check-window`, `--prediction-check-tolerance`).
    pub prediction_check: crate::routing::prediction::PredictionCheckConfig,
    /// `--engine-metrics-interval-ms`: how often engines without a ZMQ load feed have their
    /// `/metrics` read for vLLM's running and waiting requests (0 = never).
    pub engine_metrics_interval_ms: u64,
    /// Load sharing with the siblings in the peer registry (`--load-share*`).
    pub load_share: LoadShareConfig,
}

impl RouterConfig {
    /// Where the internal listener binds (see [`RouterConfig::internal_port`]).
    pub fn internal_listen(&self) -> SocketAddr {
        let ip = self.internal_bind.unwrap_or(self.listen.ip());
        let port = match (self.internal_port, self.listen.port()) {
            (Some(p), _) => p,
            (None, 0) => 0,
            (None, p) => p.saturating_add(1),
        };
        SocketAddr::new(ip, port)
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            workers: Vec::new(),
            policy: PolicyKind::CacheAware,
            weights: CostWeights::default(),
            tokenizer_path: None,
            model_tokenizers: HashMap::new(),
            kv_defaults: KvFlagDefaults::default(),
            decision_header: false,
            max_body_bytes: DEFAULT_BODY_MAX_BYTES,
            request_timeout_ms: 300_000,
            max_retries: 2,
            health_interval_ms: 5_000,
            health_timeout_ms: 2_000,
            eject_after_failures: 3,
            eject_cooldown_ms: 10_000,
            shutdown_grace_ms: 10_000,
            data_plane_threads: 0,
            tokenizer_cache_entries_max: 65_536,
            tokenize_text_bytes_max: DEFAULT_TOKENIZE_TEXT_BYTES_MAX,
            extra_readiness_gates: Vec::new(),
            rng_seed: None,
            internal_bind: None,
            internal_port: None,
            internal_auth_token: None,
            kv_snapshot_max_bytes: DEFAULT_KV_SNAPSHOT_MAX_BYTES,
            admin_auth_token: None,
            allow_unauthenticated_admin: false,
            allow_unauthenticated_internal: false,
            client_limits: ClientLimits::default(),
            prompt_tokens_max: None,
            peer_source: None,
            bootstrap: BootstrapConfig::default(),
            engine_discovery: None,
            prefix_oracle: None,
            pending_prefix_ttl_ms: DEFAULT_PENDING_PREFIX_TTL_MS,
            prediction_check: Default::default(),
            load_share: Default::default(),
            engine_metrics_interval_ms: DEFAULT_ENGINE_METRICS_INTERVAL_MS,
        }
    }
}

/// The fetch client's settings from the router's (its token and size limit), here so the
/// client does not depend on the router's configuration.
impl FetchConfig {
    /// Defaults, with the router's own token and size limit.
    pub fn from_router_config(cfg: &RouterConfig) -> Self {
        FetchConfig {
            connect_timeout_ms: FETCH_CONNECT_TIMEOUT_MS,
            read_timeout_ms: FETCH_READ_TIMEOUT_MS,
            total_timeout_ms: FETCH_TOTAL_TIMEOUT_MS,
            max_bytes: cfg.kv_snapshot_max_bytes,
            auth_token: cfg.internal_auth_token.clone(),
        }
    }
}

// Load sharing between sibling replicas (`crate::peer::load_share` explains it) and the engine
// metrics scrape (`crate::control::engine_metrics`): their settings live here, with the rest of
// the configuration, so the configuration depends on no service module.

/// Default `--load-share-interval-ms`: shortest time between two frames of one stream. A
/// prompt's prefill on the demo fleet takes 5-60 ms; 5 ms puts a booking in front of the
/// siblings before most of the requests that could herd behind it arrive.
pub const DEFAULT_LOAD_SHARE_INTERVAL_MS: u64 = 5;
/// Largest accepted `--load-share-interval-ms`.
pub const LOAD_SHARE_INTERVAL_MS_MAX: u64 = 1_000;
/// Default `--load-share-stale-ms`: a sibling silent this long (no frame, heartbeats included)
/// no longer counts, and neither do its bookings.
pub const DEFAULT_LOAD_SHARE_STALE_MS: u64 = 1_000;
/// Range of `--load-share-stale-ms`: above the heartbeat, below a minute.
pub const LOAD_SHARE_STALE_MS_MIN: u64 = 4 * LOAD_SHARE_HEARTBEAT_MS;
pub const LOAD_SHARE_STALE_MS_MAX: u64 = 60_000;
/// A stream with nothing new still sends an empty delta this often, so silence means trouble.
pub const LOAD_SHARE_HEARTBEAT_MS: u64 = 100;

/// Default `--engine-metrics-interval-ms` (`crate::control::engine_metrics`).
pub const DEFAULT_ENGINE_METRICS_INTERVAL_MS: u64 = 500;
/// Largest accepted `--engine-metrics-interval-ms`.
pub const ENGINE_METRICS_INTERVAL_MS_MAX: u64 = 60_000;

/// Default `--cold-owner-timeout-ms`: longest wait for the owner replica's placement of a cold
/// prompt (`crate::peer::cold_owner`). Between two hosts the answer takes well under a
/// millisecond, and a cold prompt's prefill tens of milliseconds. The bound is for an owner
/// that is slow to schedule: with four replicas, eight engine ranks and the client sharing two
/// cores (the demo's replica sweep), 5 ms timed out on about half the placements and 25 ms on
/// one in twenty, and a placement that times out is worse than none (docs/BENCHMARKS.md).
pub const DEFAULT_COLD_OWNER_TIMEOUT_MS: u64 = 25;
/// Largest accepted `--cold-owner-timeout-ms`.
pub const COLD_OWNER_TIMEOUT_MS_MAX: u64 = 1_000;

/// `--cold-owner`: which replica places a cold prompt (`crate::peer::cold_owner`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ColdOwnerScope {
    /// Every replica places the cold prompts it receives.
    Off,
    /// The replica that owns the prompt's prefix (a rendezvous hash of its opening blocks):
    /// replicas agree per prefix, and the placements spread over the replicas. Measured worse
    /// than `fleet` on the demo (each owner sees only its own cold placements at once); for a
    /// fleet whose cold placements one replica could not answer.
    Prefix,
    /// One replica (the rendezvous winner of a fixed key) places every cold prompt: replicas
    /// agree per prefix AND every cold placement sees the ones before it, as with one router.
    /// The default.
    Fleet,
}

/// `--load-share*` and `--cold-owner*`.
#[derive(Debug, Clone, Copy)]
pub struct LoadShareConfig {
    /// Follow the siblings' bookings (the producer endpoint is always served).
    pub enabled: bool,
    pub interval_ms: u64,
    pub stale_ms: u64,
    /// Ask the replica that owns a cold prompt's prefix to place it (the placement endpoint is
    /// always served).
    pub cold_owner: ColdOwnerScope,
    pub cold_owner_timeout_ms: u64,
}

impl Default for LoadShareConfig {
    fn default() -> Self {
        LoadShareConfig {
            enabled: true,
            interval_ms: DEFAULT_LOAD_SHARE_INTERVAL_MS,
            stale_ms: DEFAULT_LOAD_SHARE_STALE_MS,
            cold_owner: ColdOwnerScope::Fleet,
            cold_owner_timeout_ms: DEFAULT_COLD_OWNER_TIMEOUT_MS,
        }
    }
}
