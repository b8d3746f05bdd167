//! Command-line / library configuration of a simulated engine fleet.
//!
//! One struct serves both the `kvroute-sim` binary (clap) and in-process users (the router's
//! demo and tests), so the two can never drift: a test builds `SimConfig::for_tests()` and tweaks
//! fields, the binary parses the same fields from flags.
//!
//! Port layout (documented in `--help` too): engine `i` of the fleet serves HTTP on `port + i`;
//! DP rank `r` of engine `i` publishes KV events on `kv_port_base + i * dp_size + r`, serves
//! replay on `replay_port_base + i * dp_size + r` and (with `--load-publish`) load stats on
//! `load_port_base + i * dp_size + r`. A value of 0 for any of these asks the OS for free ports
//! instead; ranks of one engine still get consecutive ports (the router computes
//! `base + rank` from `/server_info`), found by probing a contiguous free range below the
//! kernel's ephemeral ports (`publish::PORT_PROBE_HIGH`).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use kvroute_wire::Encoding;

/// Largest completion the simulator will generate for one request (`max_tokens` above it is a
/// 400), so a single request cannot pin a slot or a buffer for unbounded time.
pub const COMPLETION_MAX_TOKENS: u32 = 8192;
/// Largest prompt accepted, in tokens (400 above it), the simulated context window.
pub const PROMPT_MAX_TOKENS: usize = 131_072;
/// Largest fleet one process will start.
pub const ENGINES_MAX: usize = 256;
/// Largest data-parallel size of one simulated engine: each rank is a real cache, PUB and replay
/// socket in this process. Not the router's limit on what an engine may advertise
/// (`kvroute_kv::discovery::DP_SIZE_MAX`), which real engines set.
pub const SIMULATED_DP_SIZE_MAX: usize = 64;
/// Largest block (page) size in tokens.
pub const BLOCK_SIZE_MAX_TOKENS: usize = 1024;

/// The KV-event encodings an engine can be told to publish (see `kvroute_wire::Encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvEncodingArg {
    /// SGLang: array batch, map events, signed i64 hashes, one block per BlockStored.
    Sglang,
    /// vLLM 0.33: array batch, map events with lora_name, u64 hashes, several blocks per event.
    Vllm,
    /// vLLM in bytes mode (same as `vllm` plus `--block-hash-bytes`).
    VllmBytes,
    /// Newer vLLM: the batch itself is a map.
    VllmMap,
    /// Older engines: tagged positional-array events.
    Legacy,
}

#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvroute-sim",
    about = "Simulated SGLang/vLLM-shaped inference engines with a real paged prefix cache and \
             real ZeroMQ KV events",
    after_help = "Port layout: engine i serves HTTP on PORT+i; DP rank r of engine i uses \
                  KV_PORT_BASE + i*DP_SIZE + r (likewise replay and load). 0 = OS-assigned \
                  (ranks of one engine still get consecutive ports).\n\
                  Control endpoints (/control/*) are for tests only and exist only with \
                  --enable-control."
)]
pub struct SimConfig {
    /// Number of engines started in this process.
    #[arg(long, default_value_t = 1)]
    pub engines: usize,
    /// Data-parallel ranks per engine (one cache, one KV publisher per rank).
    #[arg(long, default_value_t = 1)]
    pub dp_size: usize,
    /// Address every listener binds (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port of engine 0 (engine i uses port+i); 0 = OS-assigned.
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// KV event PUB port of engine 0 rank 0; 0 = OS-assigned.
    #[arg(long, default_value_t = 5557)]
    pub kv_port_base: u16,
    /// Replay ROUTER port of engine 0 rank 0; 0 = OS-assigned.
    #[arg(long, default_value_t = 5657)]
    pub replay_port_base: u16,
    /// Load-stat PUB port of engine 0 rank 0 (used with --load-publish); 0 = OS-assigned.
    #[arg(long, default_value_t = 5757)]
    pub load_port_base: u16,
    /// ZMQ topic of KV event messages.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Wire encoding of KV event payloads.
    #[arg(long, value_enum, default_value_t = KvEncodingArg::Sglang)]
    pub kv_encoding: KvEncodingArg,
    /// With `--kv-encoding vllm`: publish 32-byte binary block hashes (vLLM's bytes mode, same
    /// as `--kv-encoding vllm-bytes`); ignored by the other encodings.
    #[arg(long, default_value_t = false)]
    pub block_hash_bytes: bool,
    /// Seed of the engine's own block hash (engine i uses seed + i, like vLLM processes that
    /// each draw their own); never equal to the router's content hash.
    #[arg(long, default_value_t = 0)]
    pub hash_seed: u64,
    /// Tokens per KV block (page).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Device cache capacity per DP rank, in blocks.
    #[arg(long, default_value_t = 4096)]
    pub capacity_blocks: usize,
    /// Host (CPU) tier capacity per DP rank, in blocks; 0 disables the tier.
    #[arg(long, default_value_t = 0)]
    pub host_capacity_blocks: usize,
    /// Batches kept per rank for replay.
    #[arg(long, default_value_t = 10_000)]
    pub replay_buffer_batches: usize,
    /// Publish LoadStat records on a per-rank PUB with topic "load".
    #[arg(long, default_value_t = false)]
    pub load_publish: bool,
    /// Period of load-stat publishing (they are also sent on every change).
    #[arg(long, default_value_t = 100)]
    pub load_interval_ms: u64,
    /// Requests running concurrently per DP rank; more wait in a queue.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Prefill one request at a time per DP rank (a real engine's forward pass is shared by
    /// everything it batches, so concurrent prefills on one rank slow each other down). Off by
    /// default: each running request's prefill then proceeds independently of the others, so a
    /// rank's load costs a new request nothing until `--max-running` is reached. With it on, a
    /// request queued for its prefill turn is reported as waiting, not running (as SGLang does).
    #[arg(long, default_value_t = false)]
    pub prefill_serial: bool,
    /// Fixed scheduling overhead per request before the first token.
    #[arg(long, default_value_t = 2000)]
    pub overhead_us: u64,
    /// Prefill cost per uncached prompt token.
    #[arg(long, default_value_t = 20)]
    pub prefill_us_per_token: u64,
    /// Cost per prompt token found in the host tier (loaded back to the device).
    #[arg(long, default_value_t = 2)]
    pub host_load_us_per_token: u64,
    /// Decode cost per generated token.
    #[arg(long, default_value_t = 1000)]
    pub decode_us_per_token: u64,
    /// Divides every simulated duration (2.0 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// No simulated delays at all (throughput runs).
    #[arg(long, default_value_t = false)]
    pub instant: bool,
    /// Model name served on /v1/models and /server_info.
    #[arg(long, default_value = "kvroute-sim")]
    pub served_model_name: String,
    /// HF tokenizer.json; its directory may hold tokenizer_config.json with a chat_template.
    #[arg(long, default_value_os_t = default_tokenizer_path())]
    pub tokenizer_path: PathBuf,
    /// Largest accepted request body.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Enables the test-only /control/* endpoints (never in production).
    #[arg(long, default_value_t = false)]
    pub enable_control: bool,
    /// Serve no `/server_info` (404), as vLLM does: a router then learns the KV publisher,
    /// block size and DP size from its own flags (`--kv-events-endpoint-template`,
    /// `--block-size`, `--dp-size`), as it must for a real vLLM fleet.
    #[arg(long, default_value_t = false)]
    pub no_server_info: bool,
}

/// The tokenizer shipped in the repository (`assets/tokenizer/tokenizer.json`).
pub fn default_tokenizer_path() -> PathBuf {
    let crate_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // crates/kvroute-sim -> repository root; fall back to the literal relative form.
    match crate_dir.parent().and_then(|c| c.parent()) {
        Some(root) => root.join("assets/tokenizer/tokenizer.json"),
        None => crate_dir.join("../../assets/tokenizer/tokenizer.json"),
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig::parse_from(["kvroute-sim"])
    }
}

impl SimConfig {
    /// One engine, one rank, every port OS-assigned, no delays, control endpoints on.
    pub fn for_tests() -> Self {
        SimConfig {
            port: 0,
            kv_port_base: 0,
            replay_port_base: 0,
            load_port_base: 0,
            instant: true,
            enable_control: true,
            ..SimConfig::default()
        }
    }

    /// The `kvroute_wire` encoding selected by `--kv-encoding` / `--block-hash-bytes`.
    pub fn encoding(&self) -> Encoding {
        match (self.kv_encoding, self.block_hash_bytes) {
            (KvEncodingArg::Sglang, _) => Encoding::Sglang,
            (KvEncodingArg::Vllm, false) => Encoding::Vllm,
            (KvEncodingArg::Vllm, true) | (KvEncodingArg::VllmBytes, _) => Encoding::VllmBytes,
            (KvEncodingArg::VllmMap, _) => Encoding::VllmMap,
            (KvEncodingArg::Legacy, _) => Encoding::Legacy,
        }
    }

    /// Rejects configurations that would panic or allocate without bound later.
    pub fn validate(&self) -> Result<(), crate::SimError> {
        let bad = |msg: String| Err(crate::SimError::Config(msg));
        if self.engines == 0 || self.engines > ENGINES_MAX {
            return bad(format!("--engines must be 1..={ENGINES_MAX}"));
        }
        if self.dp_size == 0 || self.dp_size > SIMULATED_DP_SIZE_MAX {
            return bad(format!("--dp-size must be 1..={SIMULATED_DP_SIZE_MAX}"));
        }
        if self.block_size == 0 || self.block_size > BLOCK_SIZE_MAX_TOKENS {
            return bad(format!("--block-size must be 1..={BLOCK_SIZE_MAX_TOKENS}"));
        }
        if self.capacity_blocks == 0 {
            return bad("--capacity-blocks must be positive".into());
        }
        if self.max_running == 0 {
            return bad("--max-running must be positive".into());
        }
        if !(self.speed.is_finite() && self.speed > 0.0) {
            return bad("--speed must be a positive number".into());
        }
        if self.replay_buffer_batches == 0 {
            return bad("--replay-buffer-batches must be positive".into());
        }
        if self.load_interval_ms == 0 {
            return bad("--load-interval-ms must be positive".into());
        }
        let span = self.engines * self.dp_size;
        for (name, base) in [
            ("--kv-port-base", self.kv_port_base),
            ("--replay-port-base", self.replay_port_base),
            ("--load-port-base", self.load_port_base),
        ] {
            if base != 0 && base as usize + span > u16::MAX as usize {
                return bad(format!("{name} {base} + {span} ports exceeds 65535"));
            }
        }
        if self.port != 0 && self.port as usize + self.engines > u16::MAX as usize {
            return bad("--port + --engines exceeds 65535".into());
        }
        Ok(())
    }
}
