//! The data-path HTTP client: carries routed requests to engines over pooled keep-alive
//! HTTP/1.1 connections, with the framing of [`crate::framing`].
//!
//! Why hand-written (reqwest stays for the control plane: discovery, health checks, peer
//! snapshot fetches; hyper stays for the general server): on the proxy path every microsecond is
//! added latency. reqwest parses each URL with the WHATWG parser and runs its redirect and
//! timeout layers; a generic pooled client (hyper_util's) costs a connection task per
//! connection, a channel hop between the caller and that task, and header maps both ways. Here
//! the caller's own task writes the request and reads the response on the socket directly, so a
//! request through the pool is one `write` and as many `read`s as the response needs, with no
//! task or channel in between (measured in docs/BENCHMARKS.md).
//!
//! Invariants:
//! - One client per data-plane thread (the router's data plane): its connections are driven by
//!   the task that uses them, on that thread. The pool is a mutex only so the type is `Send`
//!   (axum's bodies must be); it is never contended.
//! - A connection goes back to the pool only after its response body was read to its exact end
//!   with no stray byte after it, and only when the engine allows reuse (HTTP/1.1, no
//!   `Connection: close`, self-delimited body). A body dropped early drops (closes) its
//!   connection: that is how a client's disconnect cancels the engine's work.
//! - A pooled connection the engine has closed while it idled is discarded at checkout when the
//!   close is visible, and no connection idles in the pool longer than
//!   [`UPSTREAM_IDLE_TIMEOUT_MS`], which is below the engines' own keep-alive cut (uvicorn's
//!   default, which SGLang and vLLM use, is 5 s), so a close racing a request is rare.
//! - When it races anyway, the request is re-sent (once, on a fresh connection to the same
//!   engine) only if the engine provably did not take it, because a generation must never run
//!   twice (RFC 9110 section 9.2.2 on non-idempotent requests): the write itself failed (the
//!   engine has at most part of the request, which it cannot act on), or the connection was
//!   RESET before any response byte (a socket closed with our request unread in its buffer
//!   answers data with a reset; an engine that had read the request and then died closes with
//!   a FIN instead). A plain end of stream after the whole request was written is ambiguous
//!   and is NOT re-sent: it becomes the caller's 502. A fresh connection's failures are never
//!   retried here: the caller decides (connect failures go to the next rank, anything later is
//!   a 502).

use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::framing::{self, BodyFraming, Chunk, ChunkedDecoder};

/// Idle keep-alive connections kept per engine; beyond it, finished connections are closed.
pub const UPSTREAM_IDLE_CONNECTIONS_MAX: usize = 256;
/// Idle pooled connections are closed after this long: below the 5 s keep-alive timeout of
/// uvicorn, the HTTP server of SGLang and vLLM, so the pool never offers a connection the engine
/// is about to close (see the module doc on re-sending).
pub const UPSTREAM_IDLE_TIMEOUT_MS: u64 = 4_000;
/// How often the whole pool is swept for idle-expired connections (at a checkout).
const POOL_SWEEP_INTERVAL_MS: u64 = 1_000;
/// Read buffer reserved per read from an engine.
const UPSTREAM_READ_CHUNK_BYTES: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("invalid upstream URL {url}: {reason}")]
    BadUrl { url: String, reason: String },
    /// No connection could be made: nothing was sent, so another rank may be tried.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The request may have reached the engine.
    #[error("{0}")]
    Send(String),
    /// The engine's response is not valid HTTP/1.1 framing.
    #[error("bad response from engine: {0}")]
    Framing(#[from] framing::FramingError),
    /// The engine closed or reset the connection in the middle of the response body.
    #[error("response body cut: {0}")]
    BodyCut(String),
}

impl UpstreamError {
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }
}

/// Where a worker's base URL sends requests: `http://authority[/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target<'a> {
    authority: &'a str,
    prefix: &'a str,
}

/// Whether the data path can send to a worker at `url`: a worker is refused when it is
/// registered, not at its first request (where every request would fail the same way).
pub fn check_base_url(url: &str) -> Result<(), UpstreamError> {
    parse_base_url(url).map(|_| ())
}

fn parse_base_url(url: &str) -> Result<Target<'_>, UpstreamError> {
    let bad = |reason: &str| UpstreamError::BadUrl {
        url: url.to_string(),
        reason: reason.to_string(),
    };
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| {
            bad("only http:// engines are supported: the data path speaks plain HTTP/1.1 to the engines (terminate TLS in front of the router, not between it and them)")
        })?;
    let (authority, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty()
        || !authority
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_:[]%".contains(&b))
    {
        return Err(bad(
            "the host is empty or has characters a host cannot have",
        ));
    }
    if prefix
        .bytes()
        .any(|b| b.is_ascii_control() || b == b' ' || b == b'?' || b == b'#')
    {
        return Err(bad("the path has characters a request target cannot have"));
    }
    Ok(Target { authority, prefix })
}

struct IdleConnection {
    stream: TcpStream,
    idle_since: Instant,
}

struct Pool {
    /// Per worker base URL, oldest first: checkout takes the newest (warmest) and expiry trims
    /// from the front.
    idle: HashMap<String, VecDeque<IdleConnection>>,
    last_sweep: Instant,
}

struct ClientInner {
    connect_timeout: Duration,
    pool: Mutex<Pool>,
}

impl ClientInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        // A poisoned pool only means a panic elsewhere while it was held; its data is a cache.
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The newest idle connection to `key` that still looks open.
    fn checkout(&self, key: &str) -> Option<TcpStream> {
        let now = Instant::now();
        let idle_timeout = Duration::from_millis(UPSTREAM_IDLE_TIMEOUT_MS);
        let mut pool = self.lock();
        if now.duration_since(pool.last_sweep) >= Duration::from_millis(POOL_SWEEP_INTERVAL_MS) {
            pool.last_sweep = now;
            pool.idle.retain(|_, conns| {
                conns.retain(|c| now.duration_since(c.idle_since) < idle_timeout);
                !conns.is_empty()
            });
        }
        let conns = pool.idle.get_mut(key)?;
        while let Some(conn) = conns.pop_back() {
            if now.duration_since(conn.idle_since) >= idle_timeout {
                continue;
            }
            // An idle connection must have nothing to read: EOF means the engine closed it,
            // bytes mean it broke the protocol. Either way it is dropped. While nothing has
            // arrived since the response was read, tokio answers this from its cached
            // readiness without a syscall (see `poll_read_some`); a close that races the
            // checkout is caught by the one retry in `post_json`.
            let mut probe = [0u8; 1];
            match conn.stream.try_read(&mut probe) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(conn.stream),
                _ => continue,
            }
        }
        None
    }

    fn checkin(&self, key: &str, stream: TcpStream) {
        let mut pool = self.lock();
        let conns = match pool.idle.get_mut(key) {
            Some(c) => c,
            None => pool.idle.entry(key.to_string()).or_default(),
        };
        if conns.len() >= UPSTREAM_IDLE_CONNECTIONS_MAX {
            conns.pop_front();
        }
        conns.push_back(IdleConnection {
            stream,
            idle_since: Instant::now(),
        });
    }
}

/// A pooled HTTP/1.1 client for one data-plane thread.
#[derive(Clone)]
pub struct UpstreamClient {
    inner: Arc<ClientInner>,
}

/// An engine's response head and its streaming body.
pub struct UpstreamResponse {
    pub status: u16,
    pub content_type: Option<Bytes>,
    pub body: UpstreamBody,
}

impl UpstreamClient {
    pub fn new(connect_timeout_ms: u64) -> UpstreamClient {
        UpstreamClient {
            inner: Arc::new(ClientInner {
                connect_timeout: Duration::from_millis(connect_timeout_ms),
                pool: Mutex::new(Pool {
                    idle: HashMap::new(),
                    last_sweep: Instant::now(),
                }),
            }),
        }
    }

    async fn connect(&self, authority: &str) -> Result<TcpStream, UpstreamError> {
        let connect = TcpStream::connect(authority);
        let stream = match tokio::time::timeout(self.inner.connect_timeout, connect).await {
            Err(_) => {
                return Err(UpstreamError::Connect(format!(
                    "{authority}: no connection within {} ms",
                    self.inner.connect_timeout.as_millis()
                )));
            }
            Ok(Err(e)) => return Err(UpstreamError::Connect(format!("{authority}: {e}"))),
            Ok(Ok(s)) => s,
        };
        // A request is one write; it must not wait on Nagle for an earlier segment's ACK.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on an upstream connection");
        }
        Ok(stream)
    }

    /// POSTs `body` as JSON to `base_url` + `path` with `headers` (names and values already
    /// valid); resolves at the final response head.
    pub async fn post_json(
        &self,
        base_url: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<UpstreamResponse, UpstreamError> {
        let target = parse_base_url(base_url)?;
        let mut head = Vec::with_capacity(256);
        let target_path;
        let request_target = if target.prefix.is_empty() {
            path
        } else {
            target_path = format!("{}{path}", target.prefix);
            &target_path
        };
        framing::encode_request_head(
            &mut head,
            request_target,
            target.authority,
            body.len(),
            headers,
        );

        let mut pooled = self.inner.checkout(base_url);
        loop {
            let reused = pooled.is_some();
            let mut stream = match pooled.take() {
                Some(s) => s,
                None => self.connect(target.authority).await?,
            };
            match exchange(&mut stream, &head, body).await {
                Ok((head, buf)) => {
                    let framing = match head.framing {
                        BodyFraming::Empty => BodyState::Done,
                        BodyFraming::Length(0) => BodyState::Done,
                        BodyFraming::Length(n) => BodyState::Length { remaining: n },
                        BodyFraming::Chunked => BodyState::Chunked(ChunkedDecoder::default()),
                        BodyFraming::UntilClose => BodyState::UntilClose,
                    };
                    let mut body = UpstreamBody {
                        stream: Some(stream),
                        buf,
                        state: framing,
                        exact_length: match head.framing {
                            BodyFraming::Length(n) => Some(n),
                            BodyFraming::Empty => Some(0),
                            _ => None,
                        },
                        return_to: head.reusable.then(|| ReturnTo {
                            client: self.inner.clone(),
                            key: base_url.to_string(),
                        }),
                    };
                    if matches!(body.state, BodyState::Done) {
                        body.finish();
                    }
                    return Ok(UpstreamResponse {
                        status: head.status,
                        content_type: head.content_type,
                        body,
                    });
                }
                // The engine closed a kept-alive connection as we used it, and provably did not
                // take the request: try once on a new connection.
                Err(ExchangeError::NotTaken(_)) if reused => continue,
                Err(ExchangeError::NotTaken(e)) => {
                    return Err(UpstreamError::Send(format!(
                        "{}: connection closed before a response: {e}",
                        target.authority
                    )));
                }
                Err(ExchangeError::SentNoAnswer(e)) => {
                    return Err(UpstreamError::Send(format!(
                        "{}: connection closed after the request was sent and before any \
                         answer ({e}); not re-sent, since the engine may have taken it",
                        target.authority
                    )));
                }
                Err(ExchangeError::Framing(e)) => return Err(UpstreamError::Framing(e)),
                Err(ExchangeError::Io(e)) => {
                    return Err(UpstreamError::Send(format!("{}: {e}", target.authority)));
                }
            }
        }
    }
}

enum ExchangeError {
    /// The engine provably did not take the request: the write failed, or the connection was
    /// reset before the first response byte.
    NotTaken(String),
    /// End of stream before the first response byte, after the whole request was written: the
    /// engine may have taken it.
    SentNoAnswer(String),
    /// Failed after at least one response byte.
    Io(std::io::Error),
    Framing(framing::FramingError),
}

/// Writes the request (head and body in one vectored write, so the body is never copied) and
/// reads up to the end of the final (non-1xx) response head; returns the head and the bytes
/// read past it.
async fn exchange(
    stream: &mut TcpStream,
    head: &[u8],
    body: &[u8],
) -> Result<(framing::ResponseHead, BytesMut), ExchangeError> {
    if let Err(e) = write_all_vectored(stream, head, body).await {
        return Err(ExchangeError::NotTaken(e.to_string()));
    }
    let mut buf = BytesMut::with_capacity(UPSTREAM_READ_CHUNK_BYTES);
    let mut any_byte = false;
    loop {
        match framing::parse_response_head(&buf).map_err(ExchangeError::Framing)? {
            Some(head) if head.is_interim() => {
                let _ = buf.split_to(head.head_len);
                continue;
            }
            Some(head) => {
                let _ = buf.split_to(head.head_len);
                return Ok((head, buf));
            }
            None => {}
        }
        buf.reserve(UPSTREAM_READ_CHUNK_BYTES);
        // `read_buf` is `AsyncRead` too, for the reason `poll_read_some` gives.
        match stream.read_buf(&mut buf).await {
            Ok(0) if !any_byte => {
                return Err(ExchangeError::SentNoAnswer("end of stream".to_string()));
            }
            Ok(0) => {
                return Err(ExchangeError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed inside the response head",
                )));
            }
            Ok(_) => any_byte = true,
            Err(e) if !any_byte && e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(ExchangeError::NotTaken(e.to_string()));
            }
            Err(e) if !any_byte => return Err(ExchangeError::SentNoAnswer(e.to_string())),
            Err(e) => return Err(ExchangeError::Io(e)),
        }
    }
}

async fn write_all_vectored(
    stream: &mut TcpStream,
    head: &[u8],
    body: &[u8],
) -> std::io::Result<()> {
    let mut slices = [std::io::IoSlice::new(head), std::io::IoSlice::new(body)];
    let mut remaining: &mut [std::io::IoSlice<'_>] = &mut slices;
    while !remaining.is_empty() {
        let written = stream.write_vectored(remaining).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut remaining, written);
    }
    Ok(())
}

/// Reads what the engine has sent so far into `buf`.
///
/// Through tokio's `AsyncRead`, not `try_read_buf`: on a short read (fewer bytes than `buf` had
/// room for) `AsyncRead` clears the socket's cached readiness, since under edge-triggered epoll a
/// short read means the kernel's buffer is drained. So an exactly-read response leaves the
/// connection marked not-readable, and the liveness probe at its next checkout is answered from
/// that cached state instead of costing a `recvfrom` on the next request's critical path. A FIN
/// or stray bytes arriving later raise a new edge, which marks it readable again.
fn poll_read_some(
    stream: &mut TcpStream,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<std::io::Result<usize>> {
    tokio_util::io::poll_read_buf(std::pin::Pin::new(stream), cx, buf)
}

struct ReturnTo {
    client: Arc<ClientInner>,
    key: String,
}

enum BodyState {
    Length { remaining: u64 },
    Chunked(ChunkedDecoder),
    UntilClose,
    Done,
}

/// A response body read straight from the engine's connection, chunk by chunk as it arrives.
/// At its exact end the connection goes back to the pool (when reusable); dropped earlier, the
/// connection is closed.
pub struct UpstreamBody {
    stream: Option<TcpStream>,
    buf: BytesMut,
    state: BodyState,
    exact_length: Option<u64>,
    return_to: Option<ReturnTo>,
}

impl UpstreamBody {
    /// The body's length when the engine framed it by length (or it has none).
    pub fn exact_length(&self) -> Option<u64> {
        self.exact_length
    }

    pub fn is_done(&self) -> bool {
        matches!(self.state, BodyState::Done)
    }

    /// Ends the body: the connection goes back to the pool if it may be reused and nothing
    /// unexpected follows the body.
    fn finish(&mut self) {
        self.state = BodyState::Done;
        let stream = self.stream.take();
        if let (Some(stream), Some(to)) = (stream, self.return_to.take())
            && self.buf.is_empty()
        {
            to.client.checkin(&to.key, stream);
        }
    }

    fn cut(&mut self, why: impl Into<String>) -> UpstreamError {
        self.state = BodyState::Done;
        self.stream = None;
        self.return_to = None;
        UpstreamError::BodyCut(why.into())
    }

    /// The next piece of the body (`None` at its end).
    pub fn poll_chunk(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Bytes>, UpstreamError>> {
        loop {
            match &mut self.state {
                BodyState::Done => return Poll::Ready(Ok(None)),
                BodyState::Length { remaining } => {
                    if !self.buf.is_empty() {
                        let take = (*remaining).min(self.buf.len() as u64) as usize;
                        *remaining -= take as u64;
                        let piece = self.buf.split_to(take).freeze();
                        if *remaining == 0 {
                            self.finish();
                        }
                        return Poll::Ready(Ok(Some(piece)));
                    }
                }
                BodyState::Chunked(decoder) => match decoder.decode(&mut self.buf) {
                    Ok(Chunk::Data(piece)) => return Poll::Ready(Ok(Some(piece))),
                    Ok(Chunk::End) => {
                        self.finish();
                        return Poll::Ready(Ok(None));
                    }
                    Ok(Chunk::NeedMore) => {}
                    Err(e) => return Poll::Ready(Err(self.cut(e.to_string()))),
                },
                BodyState::UntilClose => {
                    if !self.buf.is_empty() {
                        return Poll::Ready(Ok(Some(self.buf.split().freeze())));
                    }
                }
            }
            let Some(stream) = self.stream.as_mut() else {
                return Poll::Ready(Err(self.cut("connection already gone")));
            };
            self.buf.reserve(UPSTREAM_READ_CHUNK_BYTES);
            match ready!(poll_read_some(stream, cx, &mut self.buf)) {
                Ok(0) if matches!(self.state, BodyState::UntilClose) => {
                    self.state = BodyState::Done;
                    self.stream = None;
                    return Poll::Ready(Ok(None));
                }
                Ok(0) => return Poll::Ready(Err(self.cut("engine closed the connection"))),
                Ok(_) => {}
                Err(e) => return Poll::Ready(Err(self.cut(e.to_string()))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_split_into_authority_and_path_prefix() {
        assert_eq!(
            parse_base_url("http://10.0.0.1:30000").unwrap(),
            Target {
                authority: "10.0.0.1:30000",
                prefix: ""
            }
        );
        assert_eq!(
            parse_base_url("http://engine-0.svc:8000/v1x/").unwrap(),
            Target {
                authority: "engine-0.svc:8000",
                prefix: "/v1x"
            }
        );
        assert_eq!(
            parse_base_url("http://[::1]:8000").unwrap().authority,
            "[::1]:8000"
        );
        for bad in [
            "https://a:1",
            "a:1",
            "http://",
            "http://exa mple",
            "http://a:1/x y",
        ] {
            assert!(
                matches!(parse_base_url(bad), Err(UpstreamError::BadUrl { .. })),
                "{bad} must be refused"
            );
        }
    }

    #[tokio::test]
    async fn a_closed_port_is_a_connect_error_so_the_next_rank_may_be_tried() {
        // Bind then drop a listener: the port is then (almost surely) closed.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let client = UpstreamClient::new(1_000);
        let err = client
            .post_json(&format!("http://{addr}"), "/v1/completions", &[], b"{}")
            .await
            .err()
            .expect("nothing listens there");
        assert!(err.is_connect(), "expected a connect error, got {err}");
    }

    #[tokio::test]
    async fn a_malformed_base_url_is_a_typed_error_not_a_panic() {
        let client = UpstreamClient::new(1_000);
        let err = client
            .post_json("http://exa mple", "/x", &[], b"")
            .await
            .err()
            .expect("space in host");
        assert!(
            matches!(err, UpstreamError::BadUrl { .. }),
            "expected BadUrl, got {err}"
        );
    }
}
