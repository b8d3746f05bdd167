//! kvroute-sim: a simulated LLM inference engine fleet, the stand-in a cache-aware router is
//! developed and demonstrated against.
//!
//! It behaves like SGLang / vLLM at the two interfaces a router touches, and is real at both:
//! * HTTP (axum): OpenAI completions and chat (plain and SSE), SGLang `/generate`,
//!   `/server_info` with the `kv_events` discovery block — see [`http`];
//! * ZeroMQ KV events: one PUB per DP rank with `[topic, seq, payload]` messages in any engine
//!   encoding, a replay ROUTER per rank, optional load-stat PUBs — see [`publish`].
//!
//! Behind them is a real paged prefix cache per rank ([`cache`]: LRU leaf eviction, optional host
//! tier) and a timing model ([`engine`]: fixed overhead + per-uncached-token prefill + per-token
//! decode, queueing beyond `--max-running`, optionally one prefill at a time per rank with
//! `--prefill-serial`), so a router's cache hits show up as lower latency.
//!
//! The library starts N engines in one process ([`start_fleet`]) so tests and the demo need no
//! child processes; the `kvroute-sim` binary is a thin wrapper over the same call.
//!
//! Deliberate simplifications (documented, not hidden): a list `prompt` / `text` / `input_ids`
//! is served by its first element only; `n`, sampling parameters and stop strings are ignored
//! (every completion runs to `max_tokens`, finish reason `length`); output tokens are not cached
//! (only the prompt's blocks are inserted, at the end of prefill); LoRA and cache salts are not
//! modelled (every block is in the base namespace); token ids are not checked against the
//! vocabulary, so synthetic ids work as prompts.

pub mod cache;
pub mod chat_memo;
pub mod config;
pub mod engine;
pub mod faults;
pub mod http;
pub mod publish;
pub mod tokenizer;

use std::sync::Arc;

use axum::serve::ListenerExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::{KvEncodingArg, SimConfig};
pub use engine::{Engine, EnginePorts, ServedStat};

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("cannot bind {what} on {addr}: {reason}")]
    Bind {
        what: String,
        addr: String,
        reason: String,
    },
}

pub type Result<T, E = SimError> = std::result::Result<T, E>;

/// A running fleet of simulated engines in this process.
pub struct Fleet {
    pub engines: Vec<EngineHandle>,
}

impl Fleet {
    /// Stops every engine, letting in-flight HTTP requests finish first.
    pub async fn shutdown(&self) {
        for e in &self.engines {
            e.cancel.cancel();
        }
        for e in &self.engines {
            e.shutdown().await;
        }
    }
}

/// One running engine: its addresses, and in-process access to the same operations the
/// test-only control endpoints offer.
pub struct EngineHandle {
    engine: Arc<Engine>,
    cancel: CancellationToken,
    server: parking_lot::Mutex<Option<JoinHandle<()>>>,
}

impl EngineHandle {
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }
    fn host(&self) -> &str {
        &self.engine.cfg.host
    }
    pub fn ports(&self) -> EnginePorts {
        *self.engine.ports.lock()
    }
    /// `http://host:port` of the engine's HTTP API.
    pub fn http_url(&self) -> String {
        format!("http://{}:{}", self.host(), self.ports().http)
    }
    /// `tcp://host:port` of rank `rank`'s KV event PUB.
    pub fn kv_endpoint(&self, rank: usize) -> String {
        format!(
            "tcp://{}:{}",
            self.host(),
            self.ports().kv_base as usize + rank
        )
    }
    /// `tcp://host:port` of rank `rank`'s replay ROUTER.
    pub fn replay_endpoint(&self, rank: usize) -> String {
        format!(
            "tcp://{}:{}",
            self.host(),
            self.ports().replay_base as usize + rank
        )
    }
    /// `tcp://host:port` of rank `rank`'s load-stat PUB, when `--load-publish` is on.
    pub fn load_endpoint(&self, rank: usize) -> Option<String> {
        self.ports()
            .load_base
            .map(|b| format!("tcp://{}:{}", self.host(), b as usize + rank))
    }
    pub fn dp_size(&self) -> usize {
        self.engine.dp_size()
    }
    pub fn block_size(&self) -> usize {
        self.engine.cfg.block_size
    }
    /// Seq of rank `rank`'s last published batch, -1 before the first.
    pub fn last_seq(&self, rank: usize) -> i64 {
        self.engine.last_seq(rank)
    }
    /// Same as `POST /control/store`: caches the chains as if prefilled, publishes, returns
    /// the rank's last seq.
    pub fn store_chains(&self, rank: usize, chains: &[Vec<u32>]) -> i64 {
        self.engine.store_chains(rank, chains)
    }
    /// Same as `POST /control/flush` for one rank.
    pub fn flush(&self, rank: usize) -> i64 {
        self.engine.flush(rank)
    }
    /// Same as `POST /control/drop_next`.
    pub fn drop_next(&self, rank: usize, batches: u64) {
        self.engine.drop_next(rank, batches)
    }
    /// Same as `POST /control/restart_publisher`.
    pub fn restart_publisher(&self, rank: usize) {
        self.engine.restart_publisher(rank)
    }
    /// Stops this engine: the HTTP server drains in-flight requests, the sockets close.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        let server = self.server.lock().take();
        if let Some(server) = server {
            let _ = server.await;
        }
    }
}

/// Dropping a handle stops its engine too (in the background), so a test that forgets
/// `shutdown` does not leave sockets bound for the rest of the test binary.
impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Starts `cfg.engines` engines in this process and returns once all of them are serving.
pub async fn start_fleet(cfg: SimConfig) -> Result<Fleet> {
    cfg.validate()?;
    let cfg = Arc::new(cfg);
    let text = Arc::new(tokenizer::TextModel::load(&cfg.tokenizer_path)?);
    let mut engines = Vec::with_capacity(cfg.engines);
    for i in 0..cfg.engines {
        let cancel = CancellationToken::new();
        let engine = Engine::start(i, cfg.clone(), text.clone(), cancel.clone()).await?;
        let port = if cfg.port == 0 {
            0
        } else {
            cfg.port + i as u16
        };
        let addr = format!("{}:{port}", cfg.host);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| SimError::Bind {
                what: "HTTP".into(),
                addr: addr.clone(),
                reason: e.to_string(),
            })?;
        let bound = listener.local_addr().map_err(|e| SimError::Bind {
            what: "HTTP".into(),
            addr,
            reason: e.to_string(),
        })?;
        engine.ports.lock().http = bound.port();
        let app = http::router(engine.clone());
        // As the engines do: SGLang and vLLM serve through uvicorn on asyncio (or uvloop), which
        // sets TCP_NODELAY on every TCP transport. Without it, Nagle holds a streamed answer's
        // first chunk until the router acknowledges the response head written before the
        // prefill, and a receiver's delayed ACK makes that up to 40 ms: every short prefill
        // would reach the client ~40 ms late, a delay no real engine adds.
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY on an HTTP connection");
            }
        });
        let stop = cancel.clone();
        let server = tokio::spawn(async move {
            let serve = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "HTTP server failed");
            }
        });
        engines.push(EngineHandle {
            engine,
            cancel,
            server: parking_lot::Mutex::new(Some(server)),
        });
    }
    Ok(Fleet { engines })
}
