//! kvroute: the cache-aware request router service.
//!
//! The library holds all logic so tests and the demo (`kvroute-demo`) can run a router
//! in-process on port 0 ([`serve`]); `main.rs` only parses flags ([`cli`]), sets up logging and
//! waits for a signal. Each room has one job (ARCHITECTURE.md has the map):
//! - [`data_plane`]: the path of a proxied request, top to bottom: accept (the threads and the
//!   acceptor), [`data_plane::connection`] (frame by hand, or hand the connection to hyper),
//!   [`data_plane::request`] (prepare: parse and tokenize), then routing, then
//!   [`data_plane::forward`] (send to the engine, stream the answer back);
//! - [`routing`]: which rank: [`routing::plan`] over [`routing::kv`] (the only door to the KV
//!   plane and index), [`routing::pending`], [`routing::policy`], [`routing::tokenize`];
//! - [`api`]: the route table hyper serves (fallback for the proxied routes, operations
//!   endpoints, the admin API);
//! - [`control`]: shared state and lifecycle (the [`Router`], worker registry, worker sources,
//!   readiness, metrics);
//! - [`peer`]: what siblings ask of this replica and what it asks of them (internal listener,
//!   snapshot producer, fetch client);
//! - [`config`] (the plain config struct), [`cli`] (flags into it), [`error`] (the API's error
//!   table).

pub mod api;
pub mod cli;
pub mod config;
pub mod control;
pub mod data_plane;
pub mod error;
pub mod peer;
pub mod routing;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use config::{RouterConfig, WorkerSpec};
pub use control::router::Router;
pub use routing::policy::PolicyKind;

use control::worker_source::{self, WorkerSource};
use kvroute_http1::client::UpstreamClient;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("router setup failed: {0}")]
    Setup(String),
}

/// Loads every tokenizer the configuration names, refusing to start when one cannot be loaded:
/// a model whose tokenizer fails would have its text routed blind to the engines' caches
/// (`routing::tokenize::Untokenized`), a misconfiguration better refused at start-up than found
/// from a falling hit rate. Loaded off the runtime's threads, and kept in the router's tokenizer
/// set, so registering a worker later finds it loaded.
async fn load_configured_tokenizers(router: &Arc<Router>) -> Result<(), ServeError> {
    let config = &router.config;
    let mut paths: Vec<(String, std::path::PathBuf)> = config
        .model_tokenizers
        .iter()
        .map(|(model, path)| {
            (
                format!("--model-tokenizer {model}={}", path.display()),
                path.clone(),
            )
        })
        .collect();
    if let Some(path) = &config.tokenizer_path {
        paths.push((format!("--tokenizer-path {}", path.display()), path.clone()));
    }
    for (flag, path) in paths {
        let r = router.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            r.tokenizers
                .get_or_load(&path, r.config.tokenizer_cache_entries_max)
                .map(|_| ())
        })
        .await
        .map_err(|e| ServeError::Setup(format!("loading {flag}: {e}")))?;
        loaded.map_err(|e| ServeError::Setup(format!("{flag}: {e}")))?;
    }
    Ok(())
}

/// A running router. Dropping it does not stop the server; call [`RouterHandle::shutdown`].
pub struct RouterHandle {
    pub addr: SocketAddr,
    /// Where the internal listener (`/internal/*`) is bound.
    pub internal_addr: SocketAddr,
    pub router: Arc<Router>,
    data_plane: data_plane::DataPlane,
    internal_join: tokio::task::JoinHandle<()>,
    peer_source: Option<kvroute_discovery::PeerSourceHandle>,
    worker_source: Option<worker_source::WorkerSourceTask>,
}

impl RouterHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Base URL of the internal listener, as a sibling would dial it.
    pub fn internal_url(&self) -> String {
        format!("http://{}", self.internal_addr)
    }

    /// Stops accepting, lets in-flight requests finish (bounded by `shutdown_grace_ms`), stops
    /// the background tasks.
    pub async fn shutdown(self) {
        self.router.shutdown.cancel();
        let grace = Duration::from_millis(self.router.config.shutdown_grace_ms);
        let internal_abort = self.internal_join.abort_handle();
        let mut data_plane_done = self.data_plane.done;
        let both = futures::future::join(&mut data_plane_done, self.internal_join);
        if tokio::time::timeout(grace, both).await.is_err() {
            tracing::warn!(
                "graceful shutdown exceeded its grace period; aborting open connections"
            );
            internal_abort.abort();
            // Each data-plane thread then returns and drops its runtime, closing what is open.
            self.data_plane.hard_stop.cancel();
            let _ = data_plane_done.await;
        }
        if let Some(peers) = self.peer_source {
            peers.shutdown().await;
        }
        if let Some(workers) = self.worker_source {
            workers.shutdown().await;
        }
        self.router.kv.shutdown().await;
    }
}

/// Starts a router with its own Prometheus registry.
pub async fn serve(config: RouterConfig) -> Result<RouterHandle, ServeError> {
    serve_with_registry(config, prometheus::Registry::new()).await
}

/// Starts a router whose metrics (and the KV plane's) go to `prom`; its workers come from
/// `config.workers` and, when `config.engine_discovery` is set, from Kubernetes.
pub async fn serve_with_registry(
    config: RouterConfig,
    prom: prometheus::Registry,
) -> Result<RouterHandle, ServeError> {
    let source = WorkerSource::from_config(&config)
        .await
        .map_err(ServeError::Setup)?;
    serve_with_workers(config, prom, source).await
}

/// Starts a router whose workers come from `source` (`config.workers` is not read). A dynamic
/// source adds the `engine_discovery_synced` readiness gate and is stopped by
/// [`RouterHandle::shutdown`].
pub async fn serve_with_workers(
    mut config: RouterConfig,
    prom: prometheus::Registry,
    source: WorkerSource,
) -> Result<RouterHandle, ServeError> {
    let listen = config.listen;
    let internal_listen = config.internal_listen();
    // The internal listener serves the whole index and the admin API: on an address others can
    // reach, it needs a token unless the operator says otherwise, explicitly.
    if !internal_listen.ip().is_loopback()
        && config.internal_auth_token.is_none()
        && !config.allow_unauthenticated_internal
    {
        return Err(ServeError::Setup(format!(
            "the internal listener {internal_listen} is not loopback-bound and has no \
             --internal-auth-token-file: anyone who reaches it could read the index and change \
             the workers; set the token, bind it with --internal-bind 127.0.0.1, or start with \
             --allow-unauthenticated-internal"
        )));
    }
    let peer_config = config.peer_source.clone();
    let sync_progress = source.is_dynamic().then(worker_source::SyncProgress::new);
    if let Some(p) = &sync_progress {
        config
            .extra_readiness_gates
            .push(Arc::new(worker_source::SyncedGate(p.clone())));
    }
    let source_name = source.name().to_string();
    let router = Arc::new(Router::new(config, prom).map_err(ServeError::Setup)?);
    load_configured_tokenizers(&router).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: listen,
        source,
    })?;
    let internal_listener = tokio::net::TcpListener::bind(internal_listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: internal_listen,
            source,
        })?;
    let internal_addr = internal_listener
        .local_addr()
        .map_err(|source| ServeError::Bind {
            addr: internal_listen,
            source,
        })?;
    match peer::cold_owner::self_peer_url(peer_config.as_ref(), internal_addr) {
        Some(me) => {
            let _ = router.self_peer.set(me);
        }
        None if router.config.load_share.cold_owner != config::ColdOwnerScope::Off
            && peer_config.is_some() =>
        {
            tracing::warn!(
                %internal_addr,
                "cold-prompt ownership is off: this replica cannot tell how its siblings name \
                 it (a wildcard --internal-bind and no --advertise-url or POD_IP); set one of them"
            )
        }
        None => {}
    }
    let peer_source = match peer_config {
        Some(cfg) => Some(
            kvroute_discovery::spawn_peer_source(cfg, router.peers.clone())
                .await
                .map_err(|e| ServeError::Setup(format!("peer discovery: {e}")))?,
        ),
        None => None,
    };
    if let Some(bootstrap) = &router.bootstrap {
        let fetcher = peer::fetch::PeerFetcher::new(peer::fetch::FetchConfig::from_router_config(
            &router.config,
        ))
        .map_err(|e| ServeError::Setup(format!("peer bootstrap: {e}")))?;
        let self_url = kvroute_discovery::PeerUrl::parse(&format!("http://{internal_addr}")).ok();
        bootstrap.start(
            router.kv.plane().clone(),
            router.peers.clone(),
            fetcher,
            self_url,
            router.shutdown.clone(),
        );
    }
    // Start-up workers get their first attempt inline so a router started against a running
    // fleet is usable as soon as `serve` returns; workers not up yet keep being retried in the
    // background, and a dynamic source's edits are applied by its consumer task.
    let worker_source = worker_source::start(&router, source, sync_progress).await;
    router.spawn_health_loop();
    peer::load_share_tasks::start_following(&router);
    control::engine_metrics::start(&router);
    let internal = peer::internal::internal_app(
        router.clone(),
        control::gates::readiness_gates(&router),
        api::internal_admin_app(
            router.clone(),
            UpstreamClient::new(router.upstream_connect_timeout_ms()),
        ),
    );
    let internal_token = router.shutdown.clone();
    // No Nagle: the load-bookings stream writes a small frame every few milliseconds, and
    // Nagle's wait for the previous frame's ACK (which the sibling delays up to 40 ms) would
    // age every booking by that much.
    let internal_listener = axum::serve::ListenerExt::tap_io(internal_listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on an internal connection");
        }
    });
    let internal_join = tokio::spawn(async move {
        if let Err(e) = axum::serve(internal_listener, internal)
            .with_graceful_shutdown(internal_token.cancelled_owned())
            .await
        {
            tracing::error!(error = %e, "internal listener stopped with an error");
        }
    });
    let threads = data_plane::thread_count(router.config.data_plane_threads);
    let data_plane = data_plane::start(router.clone(), listener, threads)
        .map_err(|e| ServeError::Setup(format!("cannot start the data-plane threads: {e}")))?;
    tracing::info!(%addr, %internal_addr, source = %source_name, data_plane_threads = threads, "kvroute listening");
    Ok(RouterHandle {
        addr,
        internal_addr,
        router,
        data_plane,
        internal_join,
        peer_source,
        worker_source,
    })
}
