//! Command line and configuration of the router.
//!
//! The CLI (`clap`, every flag also readable from a `KVROUTE_...` env var) is parsed into
//! [`RouterConfig`], a plain struct with defaults. Tests and the demo build a `RouterConfig`
//! directly and never go through argument parsing, so anything the library needs lives in the
//! struct, and the CLI is only a way of filling it.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::readiness::ReadinessGate;

/// Largest request body accepted by default: generous for long prompts as JSON token arrays.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// Largest encoded snapshot served or accepted by default. Sized for the planned fleet: 64 ranks
/// x 100,000 blocks encode to roughly 100 MB of binary+zstd, JSON is several times that.
pub const DEFAULT_KV_SNAPSHOT_MAX_BYTES: usize = 1024 * 1024 * 1024;
/// Largest `--internal-auth-token-file` read; a token is a short secret, not a document.
pub const INTERNAL_AUTH_TOKEN_FILE_MAX_BYTES: u64 = 4096;

/// Routing policy selected by `--policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    CacheAware,
    RoundRobin,
    Random,
    PowerOfTwo,
    LeastLoad,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::LeastLoad => "least_load",
        }
    }

    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::CacheAware,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::PowerOfTwo,
        PolicyKind::LeastLoad,
    ];
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Weights of the cache-aware cost model (see `policy` for the formula).
#[derive(Debug, Clone, Copy)]
pub struct CostWeights {
    /// Estimated prefill time per uncached prompt token, in microseconds.
    pub prefill_cost_us_per_token: f64,
    /// Estimated delay one in-flight (decoding) request adds to a new request's first token, in
    /// microseconds.
    pub decode_penalty_us_per_request: f64,
    /// Fraction of a full prefill a block found only in a host/disk tier still costs (loading it
    /// back is cheaper than recomputing, but not free).
    pub offloaded_block_cost_fraction: f64,
    /// Softmax temperature over the cost in milliseconds; 0 picks the argmin.
    pub temperature_ms: f64,
    /// Bounded-load guard: a rank whose in-flight requests (this one included) would exceed
    /// `load_bound_factor` x the fleet's mean plus `load_bound_slack_requests` is not chosen
    /// first while another rank is within the bound, whatever its cache. 0 = no guard.
    pub load_bound_factor: f64,
    /// Requests a rank may carry above `load_bound_factor` x the mean (affinity is nearly free at
    /// low load: a second request sharing a prefix should still land with the first).
    pub load_bound_slack_requests: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        CostWeights {
            prefill_cost_us_per_token: 50.0,
            decode_penalty_us_per_request: 2_000.0,
            offloaded_block_cost_fraction: 0.3,
            temperature_ms: 0.0,
            load_bound_factor: DEFAULT_LOAD_BOUND_FACTOR,
            load_bound_slack_requests: DEFAULT_LOAD_BOUND_SLACK_REQUESTS,
        }
    }
}

/// Default bounded-load factor: a rank may carry twice the mean in-flight load (plus the slack)
/// before the cache stops being allowed to pull more work onto it. Chosen on the demo's mixed
/// load (docs/BENCHMARKS.md): 2.0 removed the herding rounds and kept the median hit rate; 1.5
/// also removed them but cost hit rate.
pub const DEFAULT_LOAD_BOUND_FACTOR: f64 = 2.0;
/// Default slack of the bound, in requests: on an idle fleet a rank can still take a second
/// request sharing its prefix (with 8 ranks a third waits until the fleet's mean load rises),
/// so light traffic keeps its affinity and the guard acts only on real imbalance.
pub const DEFAULT_LOAD_BOUND_SLACK_REQUESTS: f64 = 2.0;
/// Largest accepted `--load-bound-factor` (beyond it the guard can never act).
pub const LOAD_BOUND_FACTOR_MAX: f64 = 1_000.0;
/// Largest accepted `--load-bound-slack-requests`.
pub const LOAD_BOUND_SLACK_REQUESTS_MAX: f64 = 1_000_000.0;

/// KV settings for engines that do not advertise them in `/server_info` (vLLM).
#[derive(Debug, Clone, Default)]
pub struct KvFlagDefaults {
    /// e.g. `tcp://{host}:5557`; `{host}` is replaced by the worker's host.
    pub events_endpoint_template: Option<String>,
    pub replay_port_base: Option<u16>,
    pub block_size: Option<usize>,
    pub dp_size: Option<u32>,
}

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
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(format!(
                "worker url must start with http:// or https://: {s}"
            ));
        }
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
    /// Sibling discovery for peer bootstrap; `None` = off.
    pub peer_source: Option<kvroute_peers::PeerSourceConfig>,
    /// Kubernetes discovery of engine pods (`--service-discovery`); `None` = off. Its edits go
    /// to the same registry as `workers` (see `worker_source`).
    pub engine_discovery: Option<kvroute_peers::EngineDiscoveryConfig>,
    /// Demo / test only (no flag sets it): prefix matches from the engines' real caches instead
    /// of the index, see [`crate::kv::PrefixOracle`].
    pub prefix_oracle: Option<Arc<dyn crate::kv::PrefixOracle>>,
    /// How long a routed request's blocks count as pending on the chosen rank before its KV
    /// events confirm them (see [`crate::pending`]); 0 disables pending prefixes.
    pub pending_prefix_ttl_ms: u64,
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

/// Reads an internal auth token file: bounded, trailing whitespace (the newline `echo` and
/// editors add) trimmed, and long enough to key the snapshot HMAC.
pub fn read_internal_auth_token(path: &std::path::Path) -> Result<Arc<[u8]>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| {
        format!(
            "cannot open --internal-auth-token-file {}: {e}",
            path.display()
        )
    })?;
    let mut raw = Vec::new();
    file.take(INTERNAL_AUTH_TOKEN_FILE_MAX_BYTES + 1)
        .read_to_end(&mut raw)
        .map_err(|e| {
            format!(
                "cannot read --internal-auth-token-file {}: {e}",
                path.display()
            )
        })?;
    if raw.len() as u64 > INTERNAL_AUTH_TOKEN_FILE_MAX_BYTES {
        return Err(format!(
            "--internal-auth-token-file is larger than {INTERNAL_AUTH_TOKEN_FILE_MAX_BYTES} bytes"
        ));
    }
    let end = raw
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    raw.truncate(end);
    if raw.len() < kvroute_snapshot::limits::MIN_MAC_KEY_BYTES {
        return Err(format!(
            "--internal-auth-token-file holds {} bytes; at least {} are needed (it also keys the snapshot HMAC)",
            raw.len(),
            kvroute_snapshot::limits::MIN_MAC_KEY_BYTES
        ));
    }
    if raw.iter().any(|b| !b.is_ascii_graphic()) {
        return Err(
            "--internal-auth-token-file must hold printable ASCII without spaces (it is sent as a bearer token)"
                .into(),
        );
    }
    Ok(Arc::from(raw))
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
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            request_timeout_ms: 300_000,
            max_retries: 2,
            health_interval_ms: 5_000,
            health_timeout_ms: 2_000,
            eject_after_failures: 3,
            eject_cooldown_ms: 10_000,
            shutdown_grace_ms: 10_000,
            data_plane_threads: 0,
            tokenizer_cache_entries_max: 65_536,
            extra_readiness_gates: Vec::new(),
            rng_seed: None,
            internal_bind: None,
            internal_port: None,
            internal_auth_token: None,
            kv_snapshot_max_bytes: DEFAULT_KV_SNAPSHOT_MAX_BYTES,
            peer_source: None,
            engine_discovery: None,
            prefix_oracle: None,
            pending_prefix_ttl_ms: crate::pending::DEFAULT_PENDING_PREFIX_TTL_MS,
        }
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "kvroute",
    version,
    about = "Cache-aware request router for LLM inference fleets"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: ServeArgs,
    #[arg(
        long,
        env = "KVROUTE_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run an embedded simulated fleet and compare the routing policies on a chat workload.
    Demo(DemoArgs),
}

/// The demo fleet's prefill model (see `kvroute_sim`'s `--prefill-serial`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FleetPrefill {
    Serial,
    Parallel,
}

#[derive(Debug, Args, Clone)]
pub struct DemoArgs {
    /// Number of conversations in the workload.
    #[arg(long, env = "KVROUTE_DEMO_CONVERSATIONS", default_value_t = 96)]
    pub conversations: usize,
    /// Distinct shared system prompts.
    #[arg(long, env = "KVROUTE_DEMO_SYSTEM_PROMPTS", default_value_t = 8)]
    pub system_prompts: usize,
    /// User turns per conversation.
    #[arg(long, env = "KVROUTE_DEMO_TURNS", default_value_t = 4)]
    pub turns: usize,
    /// Zipf exponent of the system prompts' popularity (0 = uniform): with 1.2, the most
    /// popular of 8 prompts opens ~43 % of the conversations, like one big tenant among small ones.
    #[arg(long, env = "KVROUTE_DEMO_SYSTEM_PROMPT_SKEW", default_value_t = 1.2, value_parser = parse_skew)]
    pub system_prompt_skew: f64,
    /// How the in-process fleet's ranks prefill: `serial` (one prompt at a time per rank, like a
    /// compute-bound GPU) or `parallel` (every prompt at full speed, load never delays it).
    #[arg(long, env = "KVROUTE_DEMO_FLEET_PREFILL", value_enum, default_value_t = FleetPrefill::Serial)]
    pub fleet_prefill: FleetPrefill,
    /// Concurrent conversations.
    #[arg(long, env = "KVROUTE_DEMO_CONCURRENCY", default_value_t = 32)]
    pub concurrency: usize,
    #[arg(long, env = "KVROUTE_DEMO_SEED", default_value_t = 7)]
    pub seed: u64,
    /// Run only these policies (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub policies: Vec<PolicyKind>,
    /// Drive this router (base URL, e.g. `http://127.0.0.1:30000`) with the same workload once,
    /// instead of starting the in-process fleet and router (for comparing other routers in
    /// front of `kvroute-sim` engines).
    #[arg(long, env = "KVROUTE_DEMO_ROUTER_URL")]
    pub router_url: Option<String>,
    /// With `--router-url`: the engines behind it, whose `/served_stats` give the per-rank
    /// load-balance figures.
    #[arg(long, env = "KVROUTE_DEMO_ENGINE_URLS", value_delimiter = ',')]
    pub engine_urls: Vec<String>,
    /// With `--router-url`: the row's name.
    #[arg(long, env = "KVROUTE_DEMO_LABEL", default_value = "external")]
    pub label: String,
    /// Print the results as one JSON document (with per-rank balance) instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args, Clone)]
pub struct ServeArgs {
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 30000)]
    pub port: u16,
    /// Engine URLs, optionally `URL@model`.
    #[arg(long, env = "KVROUTE_WORKER_URLS", num_args = 1.., value_delimiter = ',')]
    pub worker_urls: Vec<String>,
    #[arg(
        long,
        env = "KVROUTE_POLICY",
        value_enum,
        default_value = "cache-aware"
    )]
    pub policy: PolicyKind,
    /// Default tokenizer.json (or its directory) for every model.
    #[arg(long, env = "KVROUTE_TOKENIZER_PATH")]
    pub tokenizer_path: Option<PathBuf>,
    /// Per-model tokenizer: `MODEL=PATH` (repeatable).
    #[arg(long, env = "KVROUTE_MODEL_TOKENIZER", value_delimiter = ',')]
    pub model_tokenizer: Vec<String>,
    /// KV events endpoint for engines that do not advertise one, e.g. `tcp://{host}:5557`.
    #[arg(long, env = "KVROUTE_KV_EVENTS_ENDPOINT_TEMPLATE")]
    pub kv_events_endpoint_template: Option<String>,
    #[arg(long, env = "KVROUTE_KV_EVENTS_REPLAY_PORT_BASE")]
    pub kv_events_replay_port_base: Option<u16>,
    #[arg(long, env = "KVROUTE_BLOCK_SIZE")]
    pub block_size: Option<usize>,
    #[arg(long, env = "KVROUTE_DP_SIZE")]
    pub dp_size: Option<u32>,
    #[arg(
        long,
        env = "KVROUTE_PREFILL_COST_US_PER_TOKEN",
        default_value_t = 50.0
    )]
    pub prefill_cost_us_per_token: f64,
    #[arg(
        long,
        env = "KVROUTE_DECODE_PENALTY_US_PER_REQUEST",
        default_value_t = 2000.0
    )]
    pub decode_penalty_us_per_request: f64,
    #[arg(
        long,
        env = "KVROUTE_OFFLOADED_BLOCK_COST_FRACTION",
        default_value_t = 0.3
    )]
    pub offloaded_block_cost_fraction: f64,
    /// Softmax temperature in milliseconds of estimated TTFT; 0 = always the cheapest rank.
    #[arg(long, env = "KVROUTE_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f64,
    /// Bounded-load guard of cache_aware: a rank whose in-flight requests would exceed this
    /// factor x the fleet's mean (plus --load-bound-slack-requests) is not chosen first while
    /// another rank is within the bound, however much of the prompt it holds. 0 = off.
    #[arg(long, env = "KVROUTE_LOAD_BOUND_FACTOR", default_value_t = DEFAULT_LOAD_BOUND_FACTOR)]
    pub load_bound_factor: f64,
    /// Requests a rank may carry above --load-bound-factor x the mean.
    #[arg(long, env = "KVROUTE_LOAD_BOUND_SLACK_REQUESTS", default_value_t = DEFAULT_LOAD_BOUND_SLACK_REQUESTS)]
    pub load_bound_slack_requests: f64,
    /// How long (ms) a routed request's prompt blocks count as cached on the chosen rank until
    /// the engine's KV events confirm them; same-prefix requests arriving meanwhile follow it.
    /// 0 disables.
    #[arg(long, env = "KVROUTE_PENDING_PREFIX_TTL_MS", default_value_t = crate::pending::DEFAULT_PENDING_PREFIX_TTL_MS)]
    pub pending_prefix_ttl_ms: u64,
    /// Add an `x-kvroute-decision` header to every routed response.
    #[arg(long, env = "KVROUTE_DECISION_HEADER")]
    pub decision_header: bool,
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    #[arg(long, env = "KVROUTE_REQUEST_TIMEOUT_MS", default_value_t = 300_000)]
    pub request_timeout_ms: u64,
    #[arg(long, env = "KVROUTE_MAX_RETRIES", default_value_t = 2)]
    pub max_retries: u32,
    #[arg(long, env = "KVROUTE_HEALTH_INTERVAL_MS", default_value_t = 5_000)]
    pub health_interval_ms: u64,
    #[arg(long, env = "KVROUTE_HEALTH_TIMEOUT_MS", default_value_t = 2_000)]
    pub health_timeout_ms: u64,
    /// Consecutive failures that eject a worker.
    #[arg(long, env = "KVROUTE_EJECT_AFTER_FAILURES", default_value_t = 3)]
    pub eject_after_failures: u32,
    #[arg(long, env = "KVROUTE_EJECT_COOLDOWN_MS", default_value_t = 10_000)]
    pub eject_cooldown_ms: u64,
    /// Threads serving client connections, each with its own runtime and upstream connection
    /// pool, so a request never hops threads; 0 = one per available CPU (at most 256).
    #[arg(long, env = "KVROUTE_DATA_PLANE_THREADS", default_value_t = 0)]
    pub data_plane_threads: usize,
    /// Port of the internal listener (`/internal/*`, peer traffic); default `--port` + 1.
    #[arg(long, env = "KVROUTE_INTERNAL_PORT")]
    pub internal_port: Option<u16>,
    /// Bind address of the internal listener; default `--host`.
    #[arg(long, env = "KVROUTE_INTERNAL_BIND")]
    pub internal_bind: Option<IpAddr>,
    /// File holding the shared internal token: required as a bearer token on `/internal/*` and
    /// used as the HMAC key of the binary snapshot (at least 16 printable bytes).
    #[arg(long, env = "KVROUTE_INTERNAL_AUTH_TOKEN_FILE")]
    pub internal_auth_token_file: Option<PathBuf>,
    /// Largest encoded snapshot served (507 beyond) or fetched from a sibling.
    #[arg(long, env = "KVROUTE_KV_SNAPSHOT_MAX_BYTES", default_value_t = DEFAULT_KV_SNAPSHOT_MAX_BYTES)]
    pub kv_snapshot_max_bytes: usize,
    #[command(flatten)]
    pub peers: kvroute_peers::PeerDiscoveryArgs,
    #[command(flatten)]
    pub engines: kvroute_peers::EngineDiscoveryArgs,
}

/// Largest Zipf exponent accepted for the demo's prompt popularity (beyond it every
/// conversation uses the first prompt anyway).
pub const SYSTEM_PROMPT_SKEW_MAX: f64 = 16.0;

fn parse_skew(raw: &str) -> Result<f64, String> {
    let v: f64 = raw.parse().map_err(|e| format!("not a number: {e}"))?;
    if !(0.0..=SYSTEM_PROMPT_SKEW_MAX).contains(&v) {
        return Err(format!("must be within 0..={SYSTEM_PROMPT_SKEW_MAX}"));
    }
    Ok(v)
}

impl ServeArgs {
    pub fn into_config(self) -> Result<RouterConfig, String> {
        let listen: SocketAddr = format!("{}:{}", self.host, self.port)
            .parse()
            .map_err(|e| format!("bad --host/--port: {e}"))?;
        let workers = self
            .worker_urls
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| WorkerSpec::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        let mut model_tokenizers = HashMap::new();
        for item in &self.model_tokenizer {
            let (model, path) = item
                .split_once('=')
                .ok_or_else(|| format!("--model-tokenizer expects MODEL=PATH, got {item}"))?;
            model_tokenizers.insert(model.to_string(), PathBuf::from(path));
        }
        if self.temperature < 0.0 || !self.temperature.is_finite() {
            return Err("--temperature must be a finite number >= 0".into());
        }
        if !(0.0..=LOAD_BOUND_FACTOR_MAX).contains(&self.load_bound_factor) {
            return Err(format!(
                "--load-bound-factor must be within 0..={LOAD_BOUND_FACTOR_MAX} (0 = off)"
            ));
        }
        if !(0.0..=LOAD_BOUND_SLACK_REQUESTS_MAX).contains(&self.load_bound_slack_requests) {
            return Err(format!(
                "--load-bound-slack-requests must be within 0..={LOAD_BOUND_SLACK_REQUESTS_MAX}"
            ));
        }
        let internal_auth_token = self
            .internal_auth_token_file
            .as_deref()
            .map(read_internal_auth_token)
            .transpose()?;
        let peer_source = self
            .peers
            .to_config()
            .map_err(|e| format!("peer discovery: {e}"))?;
        let engine_discovery = self
            .engines
            .to_config()
            .map_err(|e| format!("engine discovery: {e}"))?;
        Ok(RouterConfig {
            listen,
            workers,
            policy: self.policy,
            weights: CostWeights {
                prefill_cost_us_per_token: self.prefill_cost_us_per_token,
                decode_penalty_us_per_request: self.decode_penalty_us_per_request,
                offloaded_block_cost_fraction: self.offloaded_block_cost_fraction,
                temperature_ms: self.temperature,
                load_bound_factor: self.load_bound_factor,
                load_bound_slack_requests: self.load_bound_slack_requests,
            },
            tokenizer_path: self.tokenizer_path,
            model_tokenizers,
            kv_defaults: KvFlagDefaults {
                events_endpoint_template: self.kv_events_endpoint_template,
                replay_port_base: self.kv_events_replay_port_base,
                block_size: self.block_size,
                dp_size: self.dp_size,
            },
            decision_header: self.decision_header,
            max_body_bytes: self.max_body_bytes,
            request_timeout_ms: self.request_timeout_ms,
            max_retries: self.max_retries,
            health_interval_ms: self.health_interval_ms,
            health_timeout_ms: self.health_timeout_ms,
            eject_after_failures: self.eject_after_failures,
            eject_cooldown_ms: self.eject_cooldown_ms,
            data_plane_threads: self.data_plane_threads,
            internal_bind: self.internal_bind,
            internal_port: self.internal_port,
            internal_auth_token,
            kv_snapshot_max_bytes: self.kv_snapshot_max_bytes,
            peer_source,
            engine_discovery,
            pending_prefix_ttl_ms: self.pending_prefix_ttl_ms,
            ..RouterConfig::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_skew_outside_its_range_or_not_a_number_is_refused() {
        assert_eq!(parse_skew("1.2"), Ok(1.2));
        assert_eq!(parse_skew("0"), Ok(0.0));
        for bad in ["-0.5", "17", "NaN", "inf", "x"] {
            assert!(parse_skew(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn worker_spec_splits_a_model_suffix_but_keeps_plain_urls_whole() {
        let w = WorkerSpec::parse("http://127.0.0.1:8000@llama").unwrap();
        assert_eq!(w.url, "http://127.0.0.1:8000");
        assert_eq!(w.model.as_deref(), Some("llama"));
        let w = WorkerSpec::parse("http://127.0.0.1:8000/").unwrap();
        assert_eq!(w.url, "http://127.0.0.1:8000");
        assert_eq!(w.model, None);
        assert!(WorkerSpec::parse("127.0.0.1:8000").is_err());
        assert!(WorkerSpec::parse("http://h:1@").is_err());
    }

    #[test]
    fn cli_flags_fill_the_config() {
        let cli = Cli::parse_from([
            "kvroute",
            "--worker-urls",
            "http://127.0.0.1:1@m",
            "http://127.0.0.1:2",
            "--policy",
            "round-robin",
            "--model-tokenizer",
            "m=/tmp/t.json",
        ]);
        let cfg = cli.serve.into_config().unwrap();
        assert_eq!(cfg.workers.len(), 2);
        assert_eq!(cfg.policy, PolicyKind::RoundRobin);
        assert_eq!(cfg.model_tokenizers["m"], PathBuf::from("/tmp/t.json"));
        assert_eq!(cfg.internal_listen().port(), 30001);
    }

    #[test]
    fn service_discovery_flags_fill_the_engine_discovery_config_and_need_each_other() {
        let cli = Cli::parse_from([
            "kvroute",
            "--service-discovery",
            "--selector",
            "app=sglang,tier!=canary",
            "--service-discovery-port",
            "30000",
        ]);
        let cfg = cli.serve.into_config().unwrap();
        let d = cfg.engine_discovery.expect("discovery on");
        assert_eq!(d.label_selector, "app=sglang,tier!=canary");
        assert_eq!(d.default_port, 30000);
        assert!(
            Cli::parse_from(["kvroute"])
                .serve
                .into_config()
                .unwrap()
                .engine_discovery
                .is_none()
        );
        let err = Cli::parse_from(["kvroute", "--selector", "app=x"])
            .serve
            .into_config()
            .err()
            .expect("--selector alone is refused");
        assert!(err.contains("engine discovery"), "{err}");
        let err = Cli::parse_from(["kvroute", "--service-discovery"])
            .serve
            .into_config()
            .err()
            .expect("--service-discovery without a selector is refused");
        assert!(err.contains("--selector"), "{err}");
    }

    #[test]
    fn load_bound_flags_fill_the_weights_and_out_of_range_values_are_refused() {
        let cfg = Cli::parse_from(["kvroute"]).serve.into_config().unwrap();
        assert_eq!(cfg.weights.load_bound_factor, DEFAULT_LOAD_BOUND_FACTOR);
        assert_eq!(
            cfg.weights.load_bound_slack_requests,
            DEFAULT_LOAD_BOUND_SLACK_REQUESTS
        );
        let cfg = Cli::parse_from([
            "kvroute",
            "--load-bound-factor",
            "0",
            "--load-bound-slack-requests",
            "5",
        ])
        .serve
        .into_config()
        .unwrap();
        assert_eq!(cfg.weights.load_bound_factor, 0.0);
        assert_eq!(cfg.weights.load_bound_slack_requests, 5.0);
        for (flag, bad) in [
            ("--load-bound-factor", "-1"),
            ("--load-bound-factor", "NaN"),
            ("--load-bound-factor", "1e9"),
            ("--load-bound-slack-requests", "-0.5"),
            ("--load-bound-slack-requests", "inf"),
        ] {
            let arg = format!("{flag}={bad}");
            let err = Cli::parse_from(["kvroute", arg.as_str()])
                .serve
                .into_config()
                .err()
                .unwrap_or_else(|| panic!("{flag} {bad} accepted"));
            assert!(err.contains(flag), "{flag} {bad}: {err}");
        }
    }

    #[test]
    fn internal_listener_defaults_to_main_port_plus_one_or_os_assigned() {
        let mut cfg = RouterConfig::default();
        assert_eq!(cfg.internal_listen().port(), 0);
        cfg.listen = "0.0.0.0:8080".parse().unwrap();
        assert_eq!(cfg.internal_listen(), "0.0.0.0:8081".parse().unwrap());
        cfg.internal_bind = Some("127.0.0.1".parse().unwrap());
        cfg.internal_port = Some(9000);
        assert_eq!(cfg.internal_listen(), "127.0.0.1:9000".parse().unwrap());
    }

    #[test]
    fn token_file_is_trimmed_and_a_short_token_is_refused() {
        let dir = std::env::temp_dir().join(format!("kvroute-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good");
        std::fs::write(&good, "0123456789abcdef-token\n").unwrap();
        assert_eq!(
            &*read_internal_auth_token(&good).unwrap(),
            b"0123456789abcdef-token"
        );
        let short = dir.join("short");
        std::fs::write(&short, "short\n").unwrap();
        assert!(
            read_internal_auth_token(&short)
                .unwrap_err()
                .contains("at least 16")
        );
        assert!(read_internal_auth_token(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
