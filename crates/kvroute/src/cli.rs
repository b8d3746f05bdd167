//! The command line: `clap` flags (each also readable from a `KVROUTE_...` env var) parsed into
//! a [`RouterConfig`]. Parsing and range checks only: every default and every type the flags
//! fill belongs to the part of the router that uses it.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::{Args, Parser, ValueEnum};

use crate::config::{
    DEFAULT_BODY_MAX_BYTES, DEFAULT_KV_SNAPSHOT_MAX_BYTES, DEFAULT_TOKENIZE_TEXT_BYTES_MAX,
    RouterConfig, WorkerSpec,
};
use crate::data_plane::limits::{
    ClientLimits, DEFAULT_CLIENT_CONNECTIONS_MAX, DEFAULT_CLIENT_IDLE_TIMEOUT_MS,
    DEFAULT_CLIENT_WRITE_TIMEOUT_MS, DEFAULT_REQUEST_BODY_TIMEOUT_MS,
    DEFAULT_REQUEST_HEAD_TIMEOUT_MS,
};
use crate::peer::bootstrap::{
    BootstrapConfig, DEFAULT_BOOTSTRAP_FETCH_TIMEOUT_CAP_MS, DEFAULT_BOOTSTRAP_TIMEOUT_MS,
};
use crate::peer::internal::{read_internal_auth_token, read_token_file};
use crate::routing::kv::KvFlagDefaults;
use crate::routing::pending::DEFAULT_PENDING_PREFIX_TTL_MS;
use crate::routing::policy::{
    CostWeights, DEFAULT_EVICTION_COST_FRACTION, DEFAULT_LOAD_BOUND_FACTOR,
    DEFAULT_LOAD_BOUND_SLACK_REQUESTS, EVICTION_COST_FRACTION_MAX, LOAD_BOUND_FACTOR_MAX,
    LOAD_BOUND_SLACK_REQUESTS_MAX, PolicyKind, RETRIES_MAX,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Parser)]
#[command(
    name = "kvroute",
    version,
    about = "Cache-aware request router for LLM inference fleets"
)]
pub struct Cli {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Log lines as plain text or as one JSON object each.
    #[arg(long, env = "KVROUTE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

#[derive(Debug, Args, Clone)]
pub struct ServeArgs {
    /// Address of the public listener (the inference API, `/readyz`, `/metrics`, `/workers`).
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port of the public listener.
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 30000)]
    pub port: u16,
    /// Engine URLs, optionally `URL@model`.
    #[arg(long, env = "KVROUTE_WORKER_URLS", num_args = 1.., value_delimiter = ',')]
    pub worker_urls: Vec<String>,
    /// How a request's rank is chosen: `cache-aware` weighs each rank's cached prefix against
    /// its load; the others route on load or in turn, blind to the caches.
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
    /// Replay socket port of DP rank 0 for engines set up by `--kv-events-endpoint-template`
    /// (rank r uses this + r). Unset = no replay: a sequence gap is then not healed from the
    /// engine, and a graft's splice is proven by the siblings' cursors alone.
    #[arg(long, env = "KVROUTE_KV_EVENTS_REPLAY_PORT_BASE")]
    pub kv_events_replay_port_base: Option<u16>,
    /// Tokens per KV block for engines that do not advertise it (vLLM's `--block-size`). The
    /// router hashes prompts in blocks of this size, so it must equal the engines'; unset = 16.
    /// An engine whose events carry another size is named in a warning and on `GET /workers`.
    #[arg(long, env = "KVROUTE_BLOCK_SIZE",
          value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::routing::kv::BLOCK_SIZE_TOKENS_MAX)))]
    pub block_size: Option<u32>,
    /// Data-parallel ranks per engine, for engines that do not advertise it (with
    /// `--kv-events-endpoint-template`); unset = 1.
    #[arg(long, env = "KVROUTE_DP_SIZE",
          value_parser = clap::value_parser!(u32).range(1..=i64::from(kvroute_kv::DP_SIZE_MAX)))]
    pub dp_size: Option<u32>,
    /// Cost model: estimated prefill time per uncached prompt token, in microseconds.
    #[arg(
        long,
        env = "KVROUTE_PREFILL_COST_US_PER_TOKEN",
        default_value_t = 50.0
    )]
    pub prefill_cost_us_per_token: f64,
    /// Cost model: delay one request in flight on a rank adds to a new request's first token,
    /// in microseconds.
    #[arg(
        long,
        env = "KVROUTE_DECODE_PENALTY_US_PER_REQUEST",
        default_value_t = 2000.0
    )]
    pub decode_penalty_us_per_request: f64,
    /// Cost model: share of a full prefill that a block found only in a host or disk tier
    /// still costs (loading it back is cheaper than computing it, not free).
    #[arg(
        long,
        env = "KVROUTE_OFFLOADED_BLOCK_COST_FRACTION",
        default_value_t = 0.3
    )]
    pub offloaded_block_cost_fraction: f64,
    /// Share of a token's prefill charged on top for each uncached prompt token, for the
    /// cached block its insertion displaces once the rank's cache is full (conversations still
    /// running there recompute what they lose). Where the engine reports its capacity (SGLang's
    /// load feed), new tokens that fit a rank's free room are not charged; tokens another rank
    /// holds always are. 0 = price a cold placement at its compute only.
    #[arg(long, env = "KVROUTE_EVICTION_COST_FRACTION", default_value_t = DEFAULT_EVICTION_COST_FRACTION)]
    pub eviction_cost_fraction: f64,
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
    #[arg(long, env = "KVROUTE_PENDING_PREFIX_TTL_MS", default_value_t = DEFAULT_PENDING_PREFIX_TTL_MS)]
    pub pending_prefix_ttl_ms: u64,
    /// Finished requests with an engine-reported cached-token count that the prediction check
    /// looks back over, per model (0 turns the check off).
    #[arg(long, env = "KVROUTE_PREDICTION_CHECK_WINDOW",
          default_value_t = crate::routing::prediction::DEFAULT_PREDICTION_CHECK_WINDOW as u64,
          value_parser = clap::value_parser!(u64).range(0..=crate::routing::prediction::PREDICTION_CHECK_WINDOW_MAX as u64))]
    pub prediction_check_window: u64,
    /// How far (a fraction of the larger) the predicted and the engine-reported cached tokens
    /// of a model may disagree over the window before the router warns that its tokenization
    /// likely differs from the engines'.
    #[arg(long, env = "KVROUTE_PREDICTION_CHECK_TOLERANCE",
          default_value_t = crate::routing::prediction::DEFAULT_PREDICTION_CHECK_TOLERANCE,
          value_parser = parse_fraction)]
    pub prediction_check_tolerance: f64,
    /// Share per-rank load bookings with the sibling replicas peer discovery finds (each adds
    /// the others' in-flight requests and queued prefill to its own in the cost model), so
    /// replicas behind one Service do not each see a quarter of the load and herd together.
    #[arg(long, env = "KVROUTE_LOAD_SHARE", default_value_t = true, action = clap::ArgAction::Set)]
    pub load_share: bool,
    /// Shortest time between two load-bookings frames to one sibling (a frame goes out only
    /// when a booking changed, or as a heartbeat).
    #[arg(long, env = "KVROUTE_LOAD_SHARE_INTERVAL_MS",
          default_value_t = crate::peer::load_share::DEFAULT_LOAD_SHARE_INTERVAL_MS,
          value_parser = clap::value_parser!(u64).range(1..=crate::peer::load_share::LOAD_SHARE_INTERVAL_MS_MAX))]
    pub load_share_interval_ms: u64,
    /// A sibling silent this long (heartbeats included) no longer counts, nor do its bookings.
    #[arg(long, env = "KVROUTE_LOAD_SHARE_STALE_MS",
          default_value_t = crate::peer::load_share::DEFAULT_LOAD_SHARE_STALE_MS,
          value_parser = clap::value_parser!(u64).range(
              crate::peer::load_share::LOAD_SHARE_STALE_MS_MIN..=crate::peer::load_share::LOAD_SHARE_STALE_MS_MAX))]
    pub load_share_stale_ms: u64,
    /// Which replica places a cold prompt (one no engine has confirmed half of): `fleet`, one
    /// replica (a rendezvous hash over this replica and its siblings) for every cold prompt;
    /// `prefix`, the sibling that owns its prefix (the same hash keyed by its opening blocks);
    /// `off`, the replica it reached. With one owner, replicas receiving one new prefix at the
    /// same instant start it on one rank instead of each on its own.
    #[arg(long, env = "KVROUTE_COLD_OWNER", value_enum,
          default_value_t = crate::config::ColdOwnerScope::Fleet)]
    pub cold_owner: crate::config::ColdOwnerScope,
    /// Longest wait for the owner's placement before placing the cold prompt here.
    #[arg(long, env = "KVROUTE_COLD_OWNER_TIMEOUT_MS",
          default_value_t = crate::config::DEFAULT_COLD_OWNER_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..=crate::config::COLD_OWNER_TIMEOUT_MS_MAX))]
    pub cold_owner_timeout_ms: u64,
    /// How often (ms) engines without a ZMQ load feed (vLLM) have their `/metrics` read for
    /// running and waiting requests, which the cost model takes as the engine's own load.
    /// 0 = never.
    #[arg(long, env = "KVROUTE_ENGINE_METRICS_INTERVAL_MS",
          default_value_t = crate::control::engine_metrics::DEFAULT_ENGINE_METRICS_INTERVAL_MS,
          value_parser = clap::value_parser!(u64).range(0..=crate::control::engine_metrics::ENGINE_METRICS_INTERVAL_MS_MAX))]
    pub engine_metrics_interval_ms: u64,
    /// Add an `x-kvroute-decision` header to every routed response.
    #[arg(long, env = "KVROUTE_DECISION_HEADER")]
    pub decision_header: bool,
    /// Largest request body accepted (413 beyond).
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES", default_value_t = DEFAULT_BODY_MAX_BYTES)]
    pub max_body_bytes: usize,
    /// Longest wait for an engine's response headers (504 beyond); a streamed answer may then
    /// take as long as it generates.
    #[arg(long, env = "KVROUTE_REQUEST_TIMEOUT_MS", default_value_t = 300_000)]
    pub request_timeout_ms: u64,
    /// Further ranks a request is sent to, cheapest first, when its choice cannot be reached
    /// (at most 16).
    #[arg(long, env = "KVROUTE_MAX_RETRIES", default_value_t = 2)]
    pub max_retries: u32,
    /// Interval between active health checks of each worker.
    #[arg(long, env = "KVROUTE_HEALTH_INTERVAL_MS", default_value_t = 5_000)]
    pub health_interval_ms: u64,
    /// Timeout of one health check.
    #[arg(long, env = "KVROUTE_HEALTH_TIMEOUT_MS", default_value_t = 2_000)]
    pub health_timeout_ms: u64,
    /// Consecutive failures that eject a worker.
    #[arg(long, env = "KVROUTE_EJECT_AFTER_FAILURES", default_value_t = 3)]
    pub eject_after_failures: u32,
    /// How long an ejected worker stays out of routing before it is tried again.
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
    /// Start with the internal listener on a non-loopback address without
    /// `--internal-auth-token-file` (anyone who reaches it can read the index and use the admin
    /// API it serves).
    #[arg(long, env = "KVROUTE_ALLOW_UNAUTHENTICATED_INTERNAL")]
    pub allow_unauthenticated_internal: bool,
    /// File holding the admin token: the admin API's mutating routes (`POST /workers`,
    /// `DELETE /workers/{id}`, `POST /debug/route`) on the public listener then need
    /// `Authorization: Bearer <token>` (at least 16 printable bytes).
    #[arg(long, env = "KVROUTE_ADMIN_AUTH_TOKEN_FILE")]
    pub admin_auth_token_file: Option<PathBuf>,
    /// Serve the admin API's mutating routes without a token on a non-loopback public listener.
    /// Without this flag or a token they are served there only on a loopback address, and
    /// always on the internal listener.
    #[arg(long, env = "KVROUTE_ALLOW_UNAUTHENTICATED_ADMIN")]
    pub allow_unauthenticated_admin: bool,
    /// Longest prompt, in tokens, any model accepts (400 beyond); engines that state their
    /// context length (`/server_info`, `/v1/models`) lower it further. 0 = only theirs.
    #[arg(long, env = "KVROUTE_MAX_PROMPT_TOKENS", default_value_t = 0)]
    pub max_prompt_tokens: usize,
    /// Longest prompt text (or chat content), in bytes, the router tokenizes; a longer one is
    /// routed on load and forwarded untouched. Tokenizing costs up to ~170 bytes of memory per
    /// byte of text while it runs.
    #[arg(long, env = "KVROUTE_TOKENIZE_TEXT_BYTES_MAX", default_value_t = DEFAULT_TOKENIZE_TEXT_BYTES_MAX)]
    pub tokenize_text_bytes_max: usize,
    /// Close a keep-alive client connection idle this long between requests.
    #[arg(long, env = "KVROUTE_CLIENT_IDLE_TIMEOUT_MS", default_value_t = DEFAULT_CLIENT_IDLE_TIMEOUT_MS)]
    pub client_idle_timeout_ms: u64,
    /// A request's head must arrive within this long of its first byte (408 otherwise).
    #[arg(long, env = "KVROUTE_REQUEST_HEAD_TIMEOUT_MS", default_value_t = DEFAULT_REQUEST_HEAD_TIMEOUT_MS)]
    pub request_head_timeout_ms: u64,
    /// A request's body must arrive within this long of its head (408 otherwise).
    #[arg(long, env = "KVROUTE_REQUEST_BODY_TIMEOUT_MS", default_value_t = DEFAULT_REQUEST_BODY_TIMEOUT_MS)]
    pub request_body_timeout_ms: u64,
    /// Close a client that does not take a write of its answer within this long (its engine
    /// request is dropped with it).
    #[arg(long, env = "KVROUTE_CLIENT_WRITE_TIMEOUT_MS", default_value_t = DEFAULT_CLIENT_WRITE_TIMEOUT_MS)]
    pub client_write_timeout_ms: u64,
    /// Most client connections open at once on the public listener; one more is answered 503
    /// and closed. Keep it below the process's file-descriptor limit.
    #[arg(long, env = "KVROUTE_CLIENT_CONNECTIONS_MAX", default_value_t = DEFAULT_CLIENT_CONNECTIONS_MAX)]
    pub client_connections_max: usize,
    /// Largest encoded snapshot served (507 beyond) or fetched from a sibling.
    #[arg(long, env = "KVROUTE_KV_SNAPSHOT_MAX_BYTES", default_value_t = DEFAULT_KV_SNAPSHOT_MAX_BYTES)]
    pub kv_snapshot_max_bytes: usize,
    /// How long a booting replica searches its siblings for a warm index (the whole search, not
    /// one request); `/readyz` holds meanwhile only while siblings exist.
    #[arg(long, env = "KVROUTE_KV_BOOTSTRAP_TIMEOUT_MS", default_value_t = DEFAULT_BOOTSTRAP_TIMEOUT_MS)]
    pub kv_bootstrap_timeout_ms: u64,
    /// Cap of one snapshot fetch's timeout (derived as a fraction of the bootstrap timeout).
    #[arg(long, env = "KVROUTE_KV_BOOTSTRAP_FETCH_TIMEOUT_CAP_MS", default_value_t = DEFAULT_BOOTSTRAP_FETCH_TIMEOUT_CAP_MS)]
    pub kv_bootstrap_fetch_timeout_cap_ms: u64,
    /// Keep `/readyz` at 503 while the search timed out over siblings without a snapshot (at
    /// most 3x the bootstrap timeout).
    #[arg(long, env = "KVROUTE_KV_BOOTSTRAP_SEED_REQUIRED")]
    pub kv_bootstrap_seed_required: bool,
    #[command(flatten)]
    pub peers: kvroute_discovery::PeerDiscoveryArgs,
    #[command(flatten)]
    pub engines: kvroute_discovery::EngineDiscoveryArgs,
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
        if self.max_retries > RETRIES_MAX {
            return Err(format!("--max-retries must be at most {RETRIES_MAX}"));
        }
        if self.temperature < 0.0 || !self.temperature.is_finite() {
            return Err("--temperature must be a finite number >= 0".into());
        }
        if !(0.0..=LOAD_BOUND_FACTOR_MAX).contains(&self.load_bound_factor) {
            return Err(format!(
                "--load-bound-factor must be within 0..={LOAD_BOUND_FACTOR_MAX} (0 = off)"
            ));
        }
        if !(0.0..=EVICTION_COST_FRACTION_MAX).contains(&self.eviction_cost_fraction) {
            return Err(format!(
                "--eviction-cost-fraction must be within 0..={EVICTION_COST_FRACTION_MAX} (0 = off)"
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
        let admin_auth_token = self
            .admin_auth_token_file
            .as_deref()
            .map(|p| read_token_file(p, "--admin-auth-token-file"))
            .transpose()?;
        for (flag, value) in [
            ("--client-idle-timeout-ms", self.client_idle_timeout_ms),
            ("--request-head-timeout-ms", self.request_head_timeout_ms),
            ("--request-body-timeout-ms", self.request_body_timeout_ms),
            ("--client-write-timeout-ms", self.client_write_timeout_ms),
        ] {
            if value == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if self.client_connections_max == 0 {
            return Err("--client-connections-max must be at least 1".into());
        }
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
                eviction_cost_fraction: self.eviction_cost_fraction,
                temperature_ms: self.temperature,
                load_bound_factor: self.load_bound_factor,
                load_bound_slack_requests: self.load_bound_slack_requests,
            },
            tokenizer_path: self.tokenizer_path,
            model_tokenizers,
            kv_defaults: KvFlagDefaults {
                events_endpoint_template: self.kv_events_endpoint_template,
                replay_port_base: self.kv_events_replay_port_base,
                block_size: self.block_size.map(|b| b as usize),
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
            admin_auth_token,
            allow_unauthenticated_admin: self.allow_unauthenticated_admin,
            allow_unauthenticated_internal: self.allow_unauthenticated_internal,
            client_limits: ClientLimits {
                idle_timeout_ms: self.client_idle_timeout_ms,
                head_timeout_ms: self.request_head_timeout_ms,
                body_timeout_ms: self.request_body_timeout_ms,
                write_timeout_ms: self.client_write_timeout_ms,
                connections_max: self.client_connections_max,
            },
            prompt_tokens_max: (self.max_prompt_tokens > 0).then_some(self.max_prompt_tokens),
            tokenize_text_bytes_max: self.tokenize_text_bytes_max,
            peer_source,
            bootstrap: BootstrapConfig {
                timeout_ms: self.kv_bootstrap_timeout_ms,
                fetch_timeout_cap_ms: self.kv_bootstrap_fetch_timeout_cap_ms,
                seed_required: self.kv_bootstrap_seed_required,
            },
            engine_discovery,
            pending_prefix_ttl_ms: self.pending_prefix_ttl_ms,
            prediction_check: crate::routing::prediction::PredictionCheckConfig {
                window_requests: self.prediction_check_window as usize,
                tolerance: self.prediction_check_tolerance,
            },
            engine_metrics_interval_ms: self.engine_metrics_interval_ms,
            load_share: crate::peer::load_share::LoadShareConfig {
                enabled: self.load_share,
                interval_ms: self.load_share_interval_ms,
                stale_ms: self.load_share_stale_ms,
                cold_owner: self.cold_owner,
                cold_owner_timeout_ms: self.cold_owner_timeout_ms,
            },
            ..RouterConfig::default()
        })
    }
}

/// A fraction in [0, 1].
fn parse_fraction(raw: &str) -> Result<f64, String> {
    let v: f64 = raw.parse().map_err(|e| format!("not a number: {e}"))?;
    if !(0.0..=1.0).contains(&v) {
        return Err("must be within 0..=1".into());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prediction_tolerance_outside_zero_to_one_or_not_a_number_is_refused() {
        assert_eq!(parse_fraction("0.5"), Ok(0.5));
        assert_eq!(parse_fraction("0"), Ok(0.0));
        assert_eq!(parse_fraction("1"), Ok(1.0));
        for bad in ["-0.1", "1.5", "NaN", "x"] {
            assert!(parse_fraction(bad).is_err(), "{bad} accepted");
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
        // What the data path cannot send to is refused at registration, not at every request.
        for bad in ["https://h:1", "http://exa mple:1", "http://h:1/x?y"] {
            let err = WorkerSpec::parse(bad).expect_err(bad);
            assert!(err.contains("http"), "{bad}: {err}");
        }
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
    fn the_eviction_cost_flag_fills_the_weights_and_out_of_range_values_are_refused() {
        let cfg = Cli::parse_from(["kvroute"]).serve.into_config().unwrap();
        assert_eq!(
            cfg.weights.eviction_cost_fraction,
            DEFAULT_EVICTION_COST_FRACTION
        );
        let cfg = Cli::parse_from(["kvroute", "--eviction-cost-fraction", "0"])
            .serve
            .into_config()
            .unwrap();
        assert_eq!(cfg.weights.eviction_cost_fraction, 0.0);
        for bad in ["-0.1", "NaN", "inf", "10.5"] {
            let arg = format!("--eviction-cost-fraction={bad}");
            let err = Cli::parse_from(["kvroute", arg.as_str()])
                .serve
                .into_config()
                .err()
                .unwrap_or_else(|| panic!("--eviction-cost-fraction {bad} accepted"));
            assert!(err.contains("--eviction-cost-fraction"), "{bad}: {err}");
        }
    }

    #[test]
    fn engine_shape_flags_fill_the_kv_defaults_and_out_of_range_values_are_refused() {
        let cfg = Cli::parse_from(["kvroute", "--block-size", "32", "--dp-size", "8"])
            .serve
            .into_config()
            .unwrap();
        assert_eq!(cfg.kv_defaults.block_size, Some(32));
        assert_eq!(cfg.kv_defaults.dp_size, Some(8));
        // A block of 0 tokens hashes nothing and a DP size of 0 names no rank: typos, refused
        // when the flags are read, not at the first registration.
        for (flag, bad) in [
            ("--block-size", "0"),
            ("--block-size", "65537"),
            ("--block-size", "-16"),
            ("--dp-size", "0"),
            ("--dp-size", "1025"),
        ] {
            let arg = format!("{flag}={bad}");
            let err = Cli::try_parse_from(["kvroute", arg.as_str()])
                .err()
                .unwrap_or_else(|| panic!("{flag} {bad} accepted"));
            assert!(err.to_string().contains(flag), "{flag} {bad}: {err}");
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
}
