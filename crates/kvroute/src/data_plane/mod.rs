//! The data plane: the public listener's connections served on dedicated threads, each running
//! its own single-threaded tokio runtime with its own upstream connection pool.
//!
//! Why not the shared work-stealing runtime: at moderate load (the 1,000 req/s the latency
//! target is set at) a request through a multi-threaded runtime crosses threads several times:
//! the client connection's task wakes on one worker, the pooled upstream connection's task may
//! live on the other, and the scheduler wakes an idle worker to look for work whenever one
//! becomes runnable. Each crossing is a futex wake of a parked thread, which on a virtual
//! machine's idle vCPU costs tens of microseconds; `strace -c` showed two futex calls per
//! request through the shared runtime and none here (docs/BENCHMARKS.md). Here a connection lives its
//! whole life on one thread, and the upstream connections its requests use were opened, and
//! are driven, by that same thread, so a request makes no cross-thread hop at all.
//!
//! Shape:
//! - One acceptor task on the control runtime owns the listening socket and deals accepted
//!   connections round-robin to the threads (exact balance, unlike `SO_REUSEPORT` hashing,
//!   and a second process cannot silently join the port). It sets `TCP_NODELAY` on each: a
//!   response must never wait on Nagle for the previous segment's ACK. A hand-off costs one
//!   cross-thread wake per CONNECTION, not per request.
//! - Each thread takes connections from its [`HandoffListener`] (the receiving end of its
//!   bounded hand-off queue) and serves each with [`crate::data_plane::connection::serve_connection`]: the
//!   proxied routes by hand, everything else through hyper with an axum app whose state carries
//!   the thread's own [`UpstreamClient`]. Routes that change or read control-plane state (admin, metrics,
//!   readiness, model listing) are still served here but their handlers run on the control
//!   runtime (see `api::on_control_runtime`), so tasks they spawn (KV subscribers, retries)
//!   never land on a data-plane thread.
//! - Shutdown: the router's shutdown token stops the acceptor and starts every thread's
//!   graceful shutdown; `hard_stop` (cancelled by `RouterHandle::shutdown` when the grace period
//!   runs out) makes each thread return from `block_on`, which drops its runtime and with it
//!   every connection still open.

pub mod connection;
pub mod forward;
pub mod limits;
pub mod request;
pub mod token_ids;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::control::router::Router;
use crate::data_plane::connection::{ConnectionContext, serve_connection};
use kvroute_http1::client::UpstreamClient;

/// Accepted connections waiting for their thread; beyond it the acceptor waits (back-pressure
/// on accept instead of an unbounded queue).
pub const DATA_PLANE_HANDOFF_QUEUE_MAX: usize = 1_024;
/// Largest number of data-plane threads (a typo such as `--data-plane-threads 10000` is refused).
pub const DATA_PLANE_THREADS_MAX: usize = 256;

/// How many threads to run for a configured count: 0 means one per available CPU.
pub fn thread_count(configured: usize) -> usize {
    if configured == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(DATA_PLANE_THREADS_MAX)
    } else {
        configured.min(DATA_PLANE_THREADS_MAX)
    }
}

/// One open client connection, counted against `--client-connections-max` from accept until
/// its task ends (the slot travels with the socket and is released on drop, on every path).
pub struct ConnectionSlot {
    open: Arc<AtomicUsize>,
    gauge: prometheus::IntGauge,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        self.gauge.dec();
    }
}

/// The receiving end of one thread's hand-off queue.
pub struct HandoffListener {
    rx: mpsc::Receiver<(std::net::TcpStream, ConnectionSlot)>,
}

impl HandoffListener {
    /// The next connection dealt to this thread, registered with this thread's reactor;
    /// `None` once the acceptor is gone (shutdown).
    async fn next_connection(&mut self) -> Option<(tokio::net::TcpStream, ConnectionSlot)> {
        loop {
            let (std_stream, slot) = self.rx.recv().await?;
            // Registers the socket with THIS thread's reactor; it was deregistered from the
            // acceptor's when it was converted to a std stream.
            match tokio::net::TcpStream::from_std(std_stream) {
                Ok(stream) => return Some((stream, slot)),
                Err(e) => tracing::warn!(error = %e, "cannot adopt an accepted connection"),
            }
        }
    }
}

/// A running data plane.
pub struct DataPlane {
    /// Resolves when every data-plane thread has returned.
    pub done: tokio::task::JoinHandle<()>,
    /// Cancelled to make every thread return and drop its runtime (and its open connections).
    pub hard_stop: CancellationToken,
}

/// Starts `threads` data-plane threads serving `listener`'s connections, and the acceptor on
/// the current (control) runtime.
pub fn start(
    router: Arc<Router>,
    listener: tokio::net::TcpListener,
    threads: usize,
) -> std::io::Result<DataPlane> {
    let threads = threads.clamp(1, DATA_PLANE_THREADS_MAX);
    let hard_stop = CancellationToken::new();
    // The threads stop when this sender goes away: on a hard stop, and also when the control
    // runtime itself is dropped without a shutdown (a test that drops its handle), so a data
    // plane never outlives the control plane it hands admin calls to.
    let (lifeline, _) = tokio::sync::watch::channel(());
    // Every thread holds a clone and drops it when it returns; `done` resolves when all have.
    // (Not `spawn_blocking` + `join`: a runtime being dropped waits for its blocking tasks,
    // so a blocked joiner would hang the control runtime's drop.)
    let (exited_tx, mut exited_rx) = mpsc::channel::<()>(1);
    let mut handoffs = Vec::with_capacity(threads);
    for thread_index in 0..threads {
        let (tx, rx) = mpsc::channel(DATA_PLANE_HANDOFF_QUEUE_MAX);
        let connections = router
            .metrics
            .data_plane_connections
            .with_label_values(&[&thread_index.to_string()]);
        handoffs.push(Handoff { tx, connections });
        let router = router.clone();
        let lifeline = lifeline.subscribe();
        let exited = exited_tx.clone();
        let listener = HandoffListener { rx };
        std::thread::Builder::new()
            .name(format!("kvroute-data-{thread_index}"))
            .spawn(move || {
                run_thread(router, listener, lifeline);
                drop(exited);
            })?;
    }
    drop(exited_tx);
    tokio::spawn(accept_loop(listener, handoffs, router.clone()));
    let hard_stop_task = hard_stop.clone();
    tokio::spawn(async move {
        let _lifeline = lifeline;
        hard_stop_task.cancelled().await;
    });
    let done = tokio::spawn(async move {
        // Nothing is ever sent: `None` means every thread has dropped its sender.
        let _ = exited_rx.recv().await;
    });
    Ok(DataPlane { done, hard_stop })
}

fn run_thread(
    router: Arc<Router>,
    listener: HandoffListener,
    mut lifeline: tokio::sync::watch::Receiver<()>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start a data-plane runtime");
            return;
        }
    };
    runtime.block_on(async move {
        // Built inside the runtime so the pool's connections are driven here.
        let upstream = UpstreamClient::new(router.upstream_connect_timeout_ms());
        let ctx = Arc::new(ConnectionContext {
            app: crate::api::app(router.clone(), upstream.clone()),
            upstream,
            shutdown: router.shutdown.clone(),
            router,
        });
        tokio::spawn(anchor_the_timer_wheel());
        tokio::select! {
            _ = serve_connections(listener, ctx) => {}
            // `changed` fails once the sender is gone (hard stop or control runtime dropped).
            _ = async { while lifeline.changed().await.is_ok() {} } => {}
        }
    });
    // Dropping the runtime here drops every connection task still open (hard stop).
}

/// Keeps a timer armed on this thread's driver at all times, a tick at most
/// [`TIMER_ANCHOR_INTERVAL_MS`] away.
///
/// Why: tokio wakes a parked driver through its eventfd whenever a timer is armed with a
/// deadline EARLIER than the driver's next planned wake, so that the new deadline is not
/// overslept; with no timer armed, every new timer qualifies. Each proxied request arms one
/// (its response-head timeout), so an idle-between-requests thread paid one eventfd `write`
/// plus a spurious wake per request (`strace`, docs/BENCHMARKS.md). With this tick armed, a
/// request timeout (seconds to minutes away) is never the earliest deadline and arms silently.
/// The price is one wake per interval per thread.
async fn anchor_the_timer_wheel() {
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(TIMER_ANCHOR_INTERVAL_MS)).await;
    }
}

/// Period of the tick that keeps each data-plane thread's timer wheel anchored.
pub const TIMER_ANCHOR_INTERVAL_MS: u64 = 1_000;

/// Serves every connection dealt to this thread until shutdown, then waits for the open ones to
/// finish (each closes once idle or after its request in flight).
async fn serve_connections(mut listener: HandoffListener, ctx: Arc<ConnectionContext>) {
    // Every connection task holds a clone; `recv` returns `None` once all have ended.
    let (open_tx, mut open_rx) = mpsc::channel::<()>(1);
    loop {
        let (stream, slot) = tokio::select! {
            _ = ctx.shutdown.cancelled() => break,
            stream = listener.next_connection() => match stream {
                Some(s) => s,
                None => break,
            },
        };
        let ctx = ctx.clone();
        let open = open_tx.clone();
        tokio::spawn(async move {
            serve_connection(ctx, stream).await;
            drop(slot);
            drop(open);
        });
    }
    drop(open_tx);
    let _ = open_rx.recv().await;
}

/// The acceptor's side of one data-plane thread.
struct Handoff {
    tx: mpsc::Sender<(std::net::TcpStream, ConnectionSlot)>,
    /// `kvroute_data_plane_connections_total{thread}` of this thread.
    connections: prometheus::IntCounter,
}

/// What a connection past `--client-connections-max` is told before it is closed. Sent without
/// reading the request (RFC 9110 allows answering early; `connection: close` says nothing more
/// will be read), in one non-blocking write: a client that is not reading gets only the close.
static OVER_CAPACITY_RESPONSE: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let body = r#"{"error":{"message":"too many open connections; retry later","type":"service_unavailable","param":null,"code":"overloaded"}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

async fn accept_loop(
    listener: tokio::net::TcpListener,
    handoffs: Vec<Handoff>,
    router: Arc<Router>,
) {
    let shutdown = router.shutdown.clone();
    let connections_max = router.config.client_limits.connections_max;
    let open = Arc::new(AtomicUsize::new(0));
    let gauge = router.metrics.client_connections_open.clone();
    let refused = router
        .metrics
        .client_connections_closed
        .with_label_values(&["cap"]);
    let mut next = 0usize;
    let mut backoff_ms = ACCEPT_ERROR_BACKOFF_MS;
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff_ms = ACCEPT_ERROR_BACKOFF_MS;
                stream
            }
            Err(e) => {
                // EMFILE and friends: the kernel keeps the connection queued. Back off,
                // doubling up to a cap, instead of spinning on the error; the connection cap
                // exists so that this is reached only when it is set above the fd limit.
                tracing::warn!(error = %e, retry_in_ms = backoff_ms, "accept failed");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(std::time::Duration::from_millis(backoff_ms)) => {}
                }
                backoff_ms = (backoff_ms * 2).min(ACCEPT_ERROR_BACKOFF_MAX_MS);
                continue;
            }
        };
        if open.load(Ordering::Acquire) >= connections_max {
            refused.inc();
            let _ = stream.try_write(&OVER_CAPACITY_RESPONSE);
            // Half-close first so the 503 is not destroyed by a reset if the client's request
            // bytes are still unread when the socket closes.
            let mut stream = stream;
            let _ = stream.shutdown().await;
            continue;
        }
        open.fetch_add(1, Ordering::AcqRel);
        gauge.inc();
        let slot = ConnectionSlot {
            open: open.clone(),
            gauge: gauge.clone(),
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
        }
        let std_stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot hand an accepted connection over");
                continue;
            }
        };
        let handoff = &handoffs[next % handoffs.len()];
        next = next.wrapping_add(1);
        handoff.connections.inc();
        tokio::select! {
            _ = shutdown.cancelled() => return,
            sent = handoff.tx.send((std_stream, slot)) => {
                if sent.is_err() {
                    // That thread has stopped (it only does at shutdown or on a runtime build
                    // failure, which it logged); the connection is closed by the drop.
                    tracing::warn!("a data-plane thread is gone; connection dropped");
                }
            }
        }
    }
}

/// First pause after a failed `accept` before trying again; it doubles per failure in a row.
const ACCEPT_ERROR_BACKOFF_MS: u64 = 10;
/// Longest pause after failed `accept`s in a row.
const ACCEPT_ERROR_BACKOFF_MAX_MS: u64 = 1_000;
