//! The data-plane connection server: the three proxied inference routes served by hand over
//! HTTP/1.1, every other request handed to hyper with the axum app.
//!
//! Why: the proxied routes are the latency-bound path, and a request through hyper's server
//! costs a generic connection state machine, header maps and boxed service futures on top of
//! the routing work (measured in docs/BENCHMARKS.md). Here the connection's task frames the
//! head ([`h1::classify_request`], which states what the fast path takes), reads the body into
//! one buffer, prepares, routes and forwards it with the same code as the hyper handlers
//! ([`request::route_request`]) and writes the engine's answer straight to the socket.
//!
//! Invariants:
//! - At the first request the fast path does not take, the connection goes to hyper for the rest
//!   of its life, with the bytes already read replayed first ([`Rewind`]), so hyper sees the
//!   exact byte stream the client sent and answers as it always did.
//! - Same rules as the hyper handlers: body limit (413, then the connection is closed since the
//!   body was not read), request id propagated or generated and returned on every response,
//!   OpenAI-shaped errors, `requests_total{route,status}` counted once per answered request.
//! - A client that goes away cancels its request: while the router waits for the engine and
//!   while it streams the answer, the client socket is watched; EOF or an error drops the
//!   in-flight engine request, which closes the engine connection. Bytes a client pipelines
//!   meanwhile are kept (up to [`PIPELINED_BYTES_MAX`]) for the next request.
//! - Graceful shutdown: an idle connection closes at once; a request in flight is answered
//!   (with `connection: close`) and then the connection closes. Connections handed to hyper get
//!   hyper's graceful shutdown.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::control::router::Router;
use crate::data_plane::forward::Endpoint;
use crate::data_plane::request;
use crate::error::ApiError;
use kvroute_http1::client::UpstreamClient;
use kvroute_http1::framing::{self as h1, FastRoute, OutFraming, RequestHead, ResponseHeadOut};

/// Read buffer reserved per read from a client.
pub const CLIENT_READ_CHUNK_BYTES: usize = 16 * 1024;
/// Bytes a client may send ahead (its next pipelined request) while its current one is being
/// answered; beyond it the router stops reading that client until the answer is written.
pub const PIPELINED_BYTES_MAX: usize = 256 * 1024;

/// What every connection of one data-plane thread shares.
pub struct ConnectionContext {
    pub router: Arc<Router>,
    /// The thread's own engine connection pool.
    pub upstream: UpstreamClient,
    /// The full route table, for requests the fast path does not take.
    pub app: axum::Router,
    pub shutdown: CancellationToken,
}

fn endpoint_of(route: FastRoute) -> Endpoint {
    match route {
        FastRoute::Completions => Endpoint::Completions,
        FastRoute::ChatCompletions => Endpoint::ChatCompletions,
        FastRoute::Generate => Endpoint::Generate,
    }
}

/// How one request on a connection ended, for the connection loop.
enum After {
    /// Answered; the connection may carry the next request.
    KeepAlive,
    /// Close the connection (client asked, shutdown, error, or the client is gone).
    Close,
}

/// Serves one client connection until it closes.
pub async fn serve_connection(ctx: Arc<ConnectionContext>, mut stream: TcpStream) {
    let mut buf = BytesMut::with_capacity(CLIENT_READ_CHUNK_BYTES);
    loop {
        let head = match read_head(&ctx, &mut stream, &mut buf).await {
            HeadRead::Fast(head) => head,
            HeadRead::Other => return hand_to_hyper(&ctx, stream, buf.freeze()).await,
            HeadRead::Closed => return,
            HeadRead::TimedOut { idle } => {
                let limits = &ctx.router.config.client_limits;
                if idle {
                    closed_by_limit(&ctx, "idle");
                } else {
                    // Part of a head arrived: the client is owed an answer (RFC 9110 408).
                    closed_by_limit(&ctx, "head_timeout");
                    let e = ApiError::RequestTimeout {
                        what: "request head",
                        limit_ms: limits.head_timeout_ms,
                    };
                    write_timeout_answer(&ctx, &mut stream, &e).await;
                }
                return;
            }
        };
        match serve_request(&ctx, &mut stream, &mut buf, head).await {
            After::KeepAlive if !ctx.shutdown.is_cancelled() => {}
            _ => return,
        }
    }
}

enum HeadRead {
    Fast(h1::FastRequest),
    Other,
    Closed,
    /// No complete head in time: `idle` when not a byte of it had arrived.
    TimedOut {
        idle: bool,
    },
}

async fn read_head(
    ctx: &ConnectionContext,
    stream: &mut TcpStream,
    buf: &mut BytesMut,
) -> HeadRead {
    let limits = &ctx.router.config.client_limits;
    let mut head_deadline = None;
    loop {
        match h1::classify_request(buf) {
            RequestHead::Fast(head) => return HeadRead::Fast(head),
            RequestHead::Other => return HeadRead::Other,
            RequestHead::Partial => {}
        }
        buf.reserve(CLIENT_READ_CHUNK_BYTES);
        let read = if buf.is_empty() {
            // Idle between requests: bounded by the idle timeout, and a shutdown closes it.
            let idle_deadline = deadline_in(limits.idle_timeout_ms);
            tokio::select! {
                biased;
                read = tokio::time::timeout_at(idle_deadline, stream.read_buf(buf)) => match read {
                    Ok(read) => read,
                    Err(_) => return HeadRead::TimedOut { idle: true },
                },
                _ = ctx.shutdown.cancelled() => return HeadRead::Closed,
            }
        } else {
            // The head's clock starts at its first byte, not at each read, so a client that
            // trickles one byte at a time cannot extend it.
            let deadline =
                *head_deadline.get_or_insert_with(|| deadline_in(limits.head_timeout_ms));
            match tokio::time::timeout_at(deadline, stream.read_buf(buf)).await {
                Ok(read) => read,
                Err(_) => return HeadRead::TimedOut { idle: false },
            }
        };
        match read {
            Ok(0) | Err(_) => return HeadRead::Closed,
            Ok(_) => {}
        }
    }
}

fn deadline_in(ms: u64) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_millis(ms)
}

fn closed_by_limit(ctx: &ConnectionContext, reason: &str) {
    ctx.router
        .metrics
        .client_connections_closed
        .with_label_values(&[reason])
        .inc();
}

/// Writes a 408 and closes, within the write timeout; the request was never routed, so it is
/// counted on no route (`requests_total` counts routed requests by their route).
async fn write_timeout_answer(ctx: &ConnectionContext, stream: &mut TcpStream, e: &ApiError) {
    let body = serde_json::to_vec(&e.body()).unwrap_or_default();
    let mut out = Vec::with_capacity(256 + body.len());
    h1::encode_response_head(
        &mut out,
        &ResponseHeadOut {
            date: &h1::http_date_now(),
            status: e.status().as_u16(),
            content_type: Some(b"application/json"),
            request_id: &request::new_request_id(),
            decision: None,
            framing: OutFraming::Length(body.len() as u64),
            close: true,
        },
    );
    out.extend_from_slice(&body);
    let _ = write_bounded(ctx, stream, &out).await;
}

/// `write_all` that gives up after the write timeout: a client that stopped reading cannot
/// hold the connection (and the engine request and load booking behind it) forever. Counted
/// as `write_timeout` when it gives up.
async fn write_bounded(ctx: &ConnectionContext, stream: &mut TcpStream, bytes: &[u8]) -> bool {
    let limit_ms = ctx.router.config.client_limits.write_timeout_ms;
    match tokio::time::timeout(Duration::from_millis(limit_ms), stream.write_all(bytes)).await {
        Ok(written) => written.is_ok(),
        Err(_) => {
            closed_by_limit(ctx, "write_timeout");
            false
        }
    }
}

async fn serve_request(
    ctx: &ConnectionContext,
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    head: h1::FastRequest,
) -> After {
    let router = &ctx.router;
    let endpoint = endpoint_of(head.route);
    let request_id = head.request_id.unwrap_or_else(request::new_request_id);
    let limit_bytes = router.config.max_body_bytes;
    if head.content_length > limit_bytes as u64 {
        // The body is not read, so the connection cannot carry another request.
        let e = ApiError::BodyTooLarge { limit_bytes };
        if write_error(ctx, stream, endpoint, &request_id, &e, true).await {
            let announced = head.head_len as u64 + head.content_length;
            linger_before_close(stream, announced.saturating_sub(buf.len() as u64)).await;
        }
        return After::Close;
    }
    let total = head.head_len + head.content_length as usize;
    let mut deadline = None;
    while buf.len() < total {
        buf.reserve(total - buf.len());
        let limit_ms = router.config.client_limits.body_timeout_ms;
        let deadline = *deadline.get_or_insert_with(|| deadline_in(limit_ms));
        match tokio::time::timeout_at(deadline, stream.read_buf(buf)).await {
            Ok(Ok(n)) if n > 0 => {}
            Ok(_) => return After::Close,
            Err(_) => {
                closed_by_limit(ctx, "body_timeout");
                let e = ApiError::RequestTimeout {
                    what: "request body",
                    limit_ms,
                };
                write_error(ctx, stream, endpoint, &request_id, &e, true).await;
                return After::Close;
            }
        }
    }
    let mut message = buf.split_to(total);
    let body = message.split_off(head.head_len).freeze();
    drop(message);

    let routed = tokio::select! {
        biased;
        routed = request::route_request(router, endpoint, body, &request_id, &ctx.upstream) => routed,
        // Dropping the routing future drops the engine request in flight (its connection
        // closes), which is how the engine learns to stop.
        _ = client_gone(stream, buf) => return After::Close,
    };
    let close = !head.keep_alive || ctx.shutdown.is_cancelled();
    let mut routed = match routed {
        Ok(r) => r,
        Err(e) => {
            request::log_failure(&e, &request_id, endpoint);
            return if write_error(ctx, stream, endpoint, &request_id, &e, close).await && !close {
                After::KeepAlive
            } else {
                After::Close
            };
        }
    };

    // The first piece of the body is usually already read with the head (a non-streamed
    // answer): then head and body leave in one write.
    let first = std::future::poll_fn(|cx| Poll::Ready(routed.body.poll_chunk(cx))).await;
    let first = match first {
        Poll::Ready(Err(e)) => {
            let e = ApiError::Upstream(e.to_string());
            request::log_failure(&e, &request_id, endpoint);
            write_error(ctx, stream, endpoint, &request_id, &e, true).await;
            return After::Close;
        }
        Poll::Ready(Ok(piece)) => Some(piece),
        Poll::Pending => None,
    };
    let framing = OutFraming::for_status(routed.status, routed.body.exact_length());
    let decision = routed
        .decision
        .as_deref()
        .map(str::as_bytes)
        .filter(|d| h1::is_header_value(d));
    let mut out = Vec::with_capacity(512);
    h1::encode_response_head(
        &mut out,
        &ResponseHeadOut {
            date: &h1::http_date_now(),
            status: routed.status,
            content_type: routed.content_type.as_deref(),
            request_id: &request_id,
            decision,
            framing,
            close,
        },
    );
    count_request(router, endpoint, routed.status);
    // Nothing may follow a no-body head; an engine body sent against the rules is not passed
    // on (and its connection is not reused).
    let mut ended = framing == OutFraming::NoBody;
    match first {
        _ if ended => {}
        Some(Some(piece)) => push_piece(&mut out, framing, &piece),
        Some(None) => {
            ended = true;
            if framing == OutFraming::Chunked {
                out.extend_from_slice(h1::LAST_CHUNK);
            }
        }
        None => {}
    }
    if !write_bounded(ctx, stream, &out).await {
        return After::Close;
    }
    while !ended {
        let next = tokio::select! {
            biased;
            next = routed.body.next_chunk() => next,
            _ = client_gone(stream, buf) => return After::Close,
        };
        match next {
            Ok(Some(piece)) => {
                // A length-framed piece goes out as it is; a chunk needs its size line.
                let bytes: &[u8] = if framing == OutFraming::Chunked {
                    out.clear();
                    push_piece(&mut out, framing, &piece);
                    &out
                } else {
                    &piece
                };
                if !bytes.is_empty() && !write_bounded(ctx, stream, bytes).await {
                    return After::Close;
                }
            }
            Ok(None) => {
                ended = true;
                if framing == OutFraming::Chunked
                    && !write_bounded(ctx, stream, h1::LAST_CHUNK).await
                {
                    return After::Close;
                }
            }
            Err(e) => {
                // The head is out: the only honest signal left is to cut the connection, so
                // the client sees an incomplete body rather than a complete-looking one.
                tracing::warn!(request_id = %request_id, route = endpoint.path(), error = %e, "engine response cut");
                return After::Close;
            }
        }
    }
    if close {
        After::Close
    } else {
        After::KeepAlive
    }
}

fn push_piece(out: &mut Vec<u8>, framing: OutFraming, piece: &[u8]) {
    if piece.is_empty() {
        return;
    }
    match framing {
        OutFraming::Chunked => h1::encode_chunk(out, piece),
        OutFraming::Length(_) => out.extend_from_slice(piece),
        OutFraming::NoBody => {}
    }
}

fn count_request(router: &Router, endpoint: Endpoint, status: u16) {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    request::count_request(router, endpoint, status);
}

/// Writes an error answer; false when the client could not be written to.
async fn write_error(
    ctx: &ConnectionContext,
    stream: &mut TcpStream,
    endpoint: Endpoint,
    request_id: &str,
    e: &ApiError,
    close: bool,
) -> bool {
    let body = serde_json::to_vec(&e.body()).unwrap_or_default();
    let status = e.status().as_u16();
    let mut out = Vec::with_capacity(256 + body.len());
    h1::encode_response_head(
        &mut out,
        &ResponseHeadOut {
            date: &h1::http_date_now(),
            status,
            content_type: Some(b"application/json"),
            request_id,
            decision: None,
            framing: OutFraming::Length(body.len() as u64),
            close,
        },
    );
    out.extend_from_slice(&body);
    count_request(&ctx.router, endpoint, status);
    write_bounded(ctx, stream, &out).await
}

/// Reads and drops what a client is still sending of a refused body (at most
/// [`LINGER_DRAIN_MAX_BYTES`], for at most [`LINGER_MAX_MS`]) before the connection is closed.
///
/// Why: closing a socket that still has unread input makes the kernel send a reset, and a
/// reset can destroy the 413 in flight before the client reads it, so a client that is still
/// uploading would see a broken connection instead of the answer (a lingering close, as nginx
/// does). Bounded both ways, so a client cannot hold the connection open by sending forever.
async fn linger_before_close(stream: &mut TcpStream, remaining_bytes: u64) {
    let mut left = remaining_bytes.min(LINGER_DRAIN_MAX_BYTES);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(LINGER_MAX_MS);
    let mut sink = vec![0u8; CLIENT_READ_CHUNK_BYTES];
    while left > 0 {
        match tokio::time::timeout_at(deadline, stream.read(&mut sink)).await {
            Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n as u64),
            _ => return,
        }
    }
}

/// Most bytes of a refused body read (and dropped) before the connection is closed.
pub const LINGER_DRAIN_MAX_BYTES: u64 = 16 * 1024 * 1024;
/// Longest wait for the rest of a refused body before the connection is closed anyway.
pub const LINGER_MAX_MS: u64 = 2_000;

/// Resolves when the client has closed or reset its connection. Bytes it sends meanwhile (a
/// pipelined next request) are appended to `buf`; past [`PIPELINED_BYTES_MAX`] the client is no
/// longer read (nor watched) until the current answer is written.
async fn client_gone(stream: &TcpStream, buf: &mut BytesMut) {
    loop {
        if buf.len() >= PIPELINED_BYTES_MAX {
            return std::future::pending().await;
        }
        if stream.readable().await.is_err() {
            return;
        }
        buf.reserve(CLIENT_READ_CHUNK_BYTES);
        match stream.try_read_buf(buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// Serves the rest of a connection with hyper and the full route table, replaying `read` (the
/// bytes the fast path already took from the socket) first.
async fn hand_to_hyper(ctx: &ConnectionContext, stream: TcpStream, read: Bytes) {
    let io = hyper_util::rt::TokioIo::new(Rewind {
        prefix: read,
        inner: stream,
    });
    let service = hyper_util::service::TowerToHyperService::new(ctx.app.clone());
    let limits = &ctx.router.config.client_limits;
    let mut builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    // Without a timer hyper silently skips its header-read timeout. With one, the head must
    // arrive within the same deadline as on the hand-written path; hyper's clock for it also
    // runs while a keep-alive connection waits for its next request, so an idle connection
    // here is closed after the head timeout (shorter than the idle timeout, never longer).
    // Bodies are read under `--request-body-timeout-ms` by the handlers (`api::read_body`).
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_millis(limits.head_timeout_ms));
    let conn = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(conn);
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                tracing::debug!(error = %e, "connection served by hyper ended with an error");
            }
            return;
        }
        _ = ctx.shutdown.cancelled() => {}
    }
    conn.as_mut().graceful_shutdown();
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "connection served by hyper ended with an error");
    }
}

/// A client socket whose first bytes were already read: they are read again first.
struct Rewind {
    prefix: Bytes,
    inner: TcpStream,
}

impl AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(out.remaining());
            out.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, out)
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
