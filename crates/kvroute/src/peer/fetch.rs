//! The client side of peer bootstrap's transport: fetches a sibling's snapshot or cursor table.
//!
//! A sibling may be slow, gone, on another version, behind a misbehaving proxy, or hostile, so
//! every way a fetch can end is one variant of [`FetchOutcome`] and none of them panics or
//! allocates without bound:
//! * three named time budgets: connect, read (between body chunks) and total;
//! * the body is size-checked while it streams (Content-Length first, then every chunk) AND after
//!   decompression ([`kvroute_snapshot::decompress_bounded`] for `Content-Encoding`, the binary
//!   decoder's own bounded inflate for its envelope), both against `--kv-snapshot-max-bytes`;
//! * redirects are not followed (a redirect is a `Status`), so a token never travels to a host
//!   nobody configured;
//! * the bearer token is sent when configured, and the same bytes verify the binary snapshot's
//!   HMAC: a body signed with another key is [`FetchOutcome::MacRefused`].
//!
//! Two ways in: [`PeerFetcher::fetch_snapshot`] decodes (the component tests compare what it
//! returns with the producer's index); and [`PeerFetcher::fetch_snapshot_streamed`], the
//! bootstrap sweep's path, hands the body to a consumer on the blocking pool AS IT ARRIVES (the
//! sweep's consumer decodes with `kvroute_bootstrap::decode_stream` and vets with
//! `vet_decoded`, the only path from a sibling's bytes to a graft). Streaming is
//! what lets a 1,024-rank snapshot be decoded while it is still on the wire and never be held
//! whole: at most [`FETCH_BODY_CHUNKS_IN_FLIGHT_MAX`] chunks wait between the socket and the
//! decoder, and a fault on the wire reaches the decoder as a read error, never as a clean end.
//!
//! It always asks for the compact binary (`Accept: application/x-kvroute-snapshot`) with
//! `Accept-Encoding: zstd, gzip`; it still decodes JSON if a sibling answers with it. Decoding
//! runs on the blocking pool: a large snapshot takes tens of milliseconds of CPU.

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};

use kvroute_snapshot::{
    BINARY_CONTENT_TYPE, Compression, DecodeLimits, SnapshotDecodeError, decode_binary,
    decode_json, decompress_bounded,
};
use kvroute_wire::snapshot::IndexSnapshot;
use reqwest::header;
use tokio::sync::mpsc;

use crate::peer::producer::CursorTable;
use crate::peer::protocol::{KV_CURSORS_PATH, KV_SNAPSHOT_PATH, SNAPSHOT_AGE_HEADER};

/// Default time to establish a connection to a sibling.
pub const FETCH_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// Default longest silence while reading a sibling's response.
pub const FETCH_READ_TIMEOUT_MS: u64 = 5_000;
/// Default budget of one whole fetch, body included.
pub const FETCH_TOTAL_TIMEOUT_MS: u64 = 30_000;
/// Body chunks (as the socket delivers them, typically 16-64 KiB) waiting between a streamed
/// fetch and its consumer; when the consumer falls behind, the fetch stops reading the socket.
pub const FETCH_BODY_CHUNKS_IN_FLIGHT_MAX: usize = 64;
/// Largest cursor table accepted (it is a few dozen bytes per rank).
pub const CURSOR_TABLE_MAX_BYTES: usize = 4 * 1024 * 1024;

/// How the fetch client behaves.
#[derive(Clone)]
pub struct FetchConfig {
    pub connect_timeout_ms: u64,
    pub read_timeout_ms: u64,
    pub total_timeout_ms: u64,
    /// Largest body accepted, on the wire and again after decompression.
    pub max_bytes: usize,
    /// Bearer token sent to siblings; also the HMAC key a binary snapshot must verify under.
    pub auth_token: Option<Arc<[u8]>>,
}

/// How a fetch ended.
#[derive(Debug)]
pub enum FetchOutcome<T> {
    Body(T),
    /// Connect failure, timeout, or the connection broke mid-body.
    Unreachable(String),
    /// Any status other than 200 (redirects included: they are not followed).
    Status(u16),
    /// The body, or its decompression, passed `max_bytes`.
    TooLarge {
        limit_bytes: usize,
    },
    /// The body is not a snapshot this build can read (bad encoding, checksum, limits, format).
    Undecodable(String),
    /// The binary snapshot's MAC is missing or does not verify under our key.
    MacRefused(String),
}

impl<T> FetchOutcome<T> {
    /// Short stable label for logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            FetchOutcome::Body(_) => "ok",
            FetchOutcome::Unreachable(_) => "unreachable",
            FetchOutcome::Status(_) => "status",
            FetchOutcome::TooLarge { .. } => "too_large",
            FetchOutcome::Undecodable(_) => "undecodable",
            FetchOutcome::MacRefused(_) => "mac_refused",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FetchSetupError {
    #[error("building the HTTP client failed: {0}")]
    Client(String),
    #[error("the auth token is not a valid header value")]
    BadToken,
}

/// Fetches from siblings' internal listeners; cheap to clone (one connection pool).
#[derive(Clone)]
pub struct PeerFetcher {
    http: reqwest::Client,
    cfg: FetchConfig,
    authorization: Option<header::HeaderValue>,
}

struct RawBody {
    bytes: Vec<u8>,
    head: SnapshotHead,
}

/// A snapshot request that got no 200, in the sweep's terms.
enum NotServed {
    NoSnapshot,
    Busy,
    Misdirected(Misdirected),
    Unreachable(String),
}

/// A sibling's answer that says the request was misaddressed, a configuration fault that asking
/// again cannot mend (both replicas read their tokens and ports once, at start-up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Misdirected {
    /// 401 or 403: the sibling refused this replica's internal token.
    #[error(
        "the sibling refused this replica's internal token (HTTP {status}): every replica needs the same --internal-auth-token-file"
    )]
    TokenRefused { status: u16 },
    /// A 404 `unknown_route` in kvroute's error shape: the URL is a kvroute replica's PUBLIC
    /// listener, which serves no `/internal/*` route.
    #[error(
        "the sibling URL is a kvroute replica's public listener, not its internal one: name its internal port (--internal-port, by default --port + 1)"
    )]
    PublicListener,
}

impl Misdirected {
    /// Reads a sibling's non-200 answer to an internal route: `Some` when its status or its
    /// body says the request was misaddressed. Reads at most [`REFUSAL_BODY_MAX_BYTES`].
    pub async fn of(resp: reqwest::Response) -> Option<Misdirected> {
        match resp.status().as_u16() {
            status @ (401 | 403) => Some(Misdirected::TokenRefused { status }),
            404 => (refusal_code(resp).await.as_deref() == Some(PUBLIC_UNKNOWN_ROUTE_CODE))
                .then_some(Misdirected::PublicListener),
            _ => None,
        }
    }
}

/// The error code of the public listener's 404 (`ApiError::UnknownRoute`); the internal
/// listener answers its own 404s with other codes (`no_index`, `not_found`).
const PUBLIC_UNKNOWN_ROUTE_CODE: &str = "unknown_route";

/// The headers of a 200 snapshot answer, handed to a streamed fetch's consumer with the body.
#[derive(Debug, Clone)]
pub struct SnapshotHead {
    pub content_type: String,
    pub content_encoding: Option<String>,
    /// The producer's `x-kvroute-snapshot-age-ms`: how old its export was when sent. The body
    /// carries no export time, so this is what a freshness floor is checked against.
    pub age_ms: Option<u64>,
}

/// How a streamed snapshot fetch ended, in the terms the bootstrap sweep decides on.
#[derive(Debug)]
pub enum StreamedAnswer<T> {
    /// A 200 whose whole body reached the consumer (or the consumer stopped reading early, having
    /// decided): its verdict, the headers, and when the last byte was received.
    Consumed {
        value: T,
        head: SnapshotHead,
        body_done: Instant,
    },
    /// The sibling has nothing to serve: 404 (no index, or a build without the endpoint) or 503
    /// `index_not_ready` (it has applied no KV event yet).
    NoSnapshot,
    /// The sibling is warm but refused for now: 503 `busy` or 429.
    Busy,
    /// The sibling was misaddressed (a refused token, its public port): it will answer the
    /// same on every ask.
    Misdirected(Misdirected),
    /// The body passed the byte limit on the wire (Content-Length or counted chunks).
    TooLarge { limit_bytes: usize },
    /// Connect failure, timeout, broken body, any other status, or a consumer that panicked.
    Unreachable(String),
}

/// A 200's body as its consumer reads it on the blocking pool: the chunks the fetch forwards, a
/// fault on the wire as a read error, the end of the body as end of file. Dropping the fetch
/// (its task cancelled) also ends the file, early; the consumer then sees a short body.
pub struct BodyReader {
    chunks: mpsc::Receiver<Result<Bytes, String>>,
    current: Bytes,
}

impl Read for BodyReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if !self.current.is_empty() {
                let n = self.current.len().min(out.len());
                out[..n].copy_from_slice(&self.current[..n]);
                self.current.advance(n);
                return Ok(n);
            }
            match self.chunks.blocking_recv() {
                Some(Ok(chunk)) => self.current = chunk,
                Some(Err(fault)) => return Err(std::io::Error::other(fault)),
                None => return Ok(0),
            }
        }
    }
}

/// Bytes of a refusal's JSON body read to learn its error code.
pub const REFUSAL_BODY_MAX_BYTES: usize = 4 * 1024;

impl PeerFetcher {
    pub fn new(cfg: FetchConfig) -> Result<Self, FetchSetupError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(cfg.connect_timeout_ms))
            .read_timeout(Duration::from_millis(cfg.read_timeout_ms))
            .timeout(Duration::from_millis(cfg.total_timeout_ms))
            .redirect(reqwest::redirect::Policy::none())
            .tcp_nodelay(true)
            .build()
            .map_err(|e| FetchSetupError::Client(e.to_string()))?;
        let authorization = match &cfg.auth_token {
            Some(t) => {
                let mut v = b"Bearer ".to_vec();
                v.extend_from_slice(t);
                let mut v =
                    header::HeaderValue::from_bytes(&v).map_err(|_| FetchSetupError::BadToken)?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        Ok(PeerFetcher {
            http,
            cfg,
            authorization,
        })
    }

    pub fn config(&self) -> &FetchConfig {
        &self.cfg
    }

    /// `GET {base}/internal/kv_snapshot`, decoded and (for binary with a token) authenticated.
    /// The snapshot is returned as sent: judging its format, hash scheme and block size is the
    /// consumer's decision.
    pub async fn fetch_snapshot(
        &self,
        base_url: &str,
        model: Option<&str>,
        max_age_ms: Option<u64>,
    ) -> FetchOutcome<IndexSnapshot> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(m) = model {
            query.push(("model", m.to_string()));
        }
        if let Some(a) = max_age_ms {
            query.push(("max_age_ms", a.to_string()));
        }
        let raw = match self
            .get(
                base_url,
                KV_SNAPSHOT_PATH,
                &query,
                BINARY_CONTENT_TYPE,
                self.cfg.max_bytes,
            )
            .await
        {
            Ok(raw) => raw,
            Err(outcome) => return outcome,
        };
        let max_bytes = self.cfg.max_bytes;
        let mac_key = self.cfg.auth_token.clone();
        let decoded =
            tokio::task::spawn_blocking(move || decode_snapshot(raw, max_bytes, mac_key)).await;
        match decoded {
            Ok(outcome) => outcome,
            Err(e) => FetchOutcome::Undecodable(format!("decode task failed: {e}")),
        }
    }

    /// `GET {base}/internal/kv_cursors`.
    pub async fn fetch_cursors(
        &self,
        base_url: &str,
        model: Option<&str>,
    ) -> FetchOutcome<CursorTable> {
        let query: Vec<(&str, String)> = model
            .map(|m| ("model", m.to_string()))
            .into_iter()
            .collect();
        let limit = CURSOR_TABLE_MAX_BYTES.min(self.cfg.max_bytes);
        let raw = match self
            .get(base_url, KV_CURSORS_PATH, &query, "application/json", limit)
            .await
        {
            Ok(raw) => raw,
            Err(outcome) => return outcome,
        };
        let body = match decompress(&raw, limit) {
            Ok(b) => b,
            Err(outcome) => return outcome,
        };
        match serde_json::from_slice::<CursorTable>(&body) {
            Ok(t) => FetchOutcome::Body(t),
            Err(e) => FetchOutcome::Undecodable(format!("cursor table: {e}")),
        }
    }

    /// Sends the snapshot request; a 200 comes back with its response, anything else as what it
    /// means to the sweep.
    async fn snapshot_request(
        &self,
        base_url: &str,
        model: Option<&str>,
        max_age_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<(reqwest::Url, reqwest::Response), NotServed> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(m) = model {
            query.push(("model", m.to_string()));
        }
        if let Some(a) = max_age_ms {
            query.push(("max_age_ms", a.to_string()));
        }
        let (url, resp) = self
            .send(
                base_url,
                KV_SNAPSHOT_PATH,
                &query,
                BINARY_CONTENT_TYPE,
                timeout_ms,
            )
            .await
            .map_err(NotServed::Unreachable)?;
        match resp.status().as_u16() {
            200 => Ok((url, resp)),
            401 | 403 | 404 => Err(match Misdirected::of(resp).await {
                Some(m) => NotServed::Misdirected(m),
                None => NotServed::NoSnapshot,
            }),
            429 => Err(NotServed::Busy),
            503 => Err(match refusal_code(resp).await.as_deref() {
                Some("index_not_ready") => NotServed::NoSnapshot,
                Some("busy") => NotServed::Busy,
                code => NotServed::Unreachable(format!(
                    "{url}: 503 {}",
                    code.unwrap_or("without an error code")
                )),
            }),
            status => Err(NotServed::Unreachable(format!("{url}: status {status}"))),
        }
    }

    /// `GET {base}/internal/kv_snapshot` for the bootstrap sweep, with the body handed to
    /// `consume` on the blocking pool as it arrives (see the module doc). `consume` gets the
    /// headers first and may return before reading everything; the fetch then stops reading. A
    /// fault on the wire (timeout, reset, the byte limit passed) is reported as such whatever the
    /// consumer concluded from the short body it saw.
    pub async fn fetch_snapshot_streamed<T, F>(
        &self,
        base_url: &str,
        model: Option<&str>,
        max_age_ms: Option<u64>,
        timeout_ms: Option<u64>,
        consume: F,
    ) -> StreamedAnswer<T>
    where
        T: Send + 'static,
        F: FnOnce(SnapshotHead, BodyReader) -> T + Send + 'static,
    {
        let (url, mut resp) = match self
            .snapshot_request(base_url, model, max_age_ms, timeout_ms)
            .await
        {
            Ok(ok) => ok,
            Err(NotServed::NoSnapshot) => return StreamedAnswer::NoSnapshot,
            Err(NotServed::Busy) => return StreamedAnswer::Busy,
            Err(NotServed::Misdirected(m)) => return StreamedAnswer::Misdirected(m),
            Err(NotServed::Unreachable(reason)) => return StreamedAnswer::Unreachable(reason),
        };
        let max_bytes = self.cfg.max_bytes;
        if resp
            .content_length()
            .is_some_and(|len| len > max_bytes as u64)
        {
            return StreamedAnswer::TooLarge {
                limit_bytes: max_bytes,
            };
        }
        let head = snapshot_head(&resp);
        let (chunks_tx, chunks_rx) = mpsc::channel(FETCH_BODY_CHUNKS_IN_FLIGHT_MAX);
        let consumer = tokio::task::spawn_blocking({
            let head = head.clone();
            move || {
                consume(
                    head,
                    BodyReader {
                        chunks: chunks_rx,
                        current: Bytes::new(),
                    },
                )
            }
        });
        let mut received_bytes = 0usize;
        let fault = loop {
            match resp.chunk().await {
                Ok(Some(chunk)) => {
                    received_bytes = received_bytes.saturating_add(chunk.len());
                    if received_bytes > max_bytes {
                        break Some(StreamedAnswer::TooLarge {
                            limit_bytes: max_bytes,
                        });
                    }
                    if chunks_tx.send(Ok(chunk)).await.is_err() {
                        // The consumer has decided and stopped reading.
                        break None;
                    }
                }
                Ok(None) => break None,
                Err(e) => break Some(StreamedAnswer::Unreachable(format!("{url}: body: {e}"))),
            }
        };
        let body_done = Instant::now();
        if let Some(fault) = &fault {
            // A read error, never a clean end of file: a cut body must not look complete.
            let reason = match fault {
                StreamedAnswer::TooLarge { limit_bytes } => {
                    format!("the body passed {limit_bytes} bytes")
                }
                StreamedAnswer::Unreachable(reason) => reason.clone(),
                _ => "the fetch failed".to_string(),
            };
            let _ = chunks_tx.send(Err(reason)).await;
        }
        drop(chunks_tx);
        let verdict = consumer.await;
        match (fault, verdict) {
            (Some(fault), _) => fault,
            (None, Ok(value)) => StreamedAnswer::Consumed {
                value,
                head,
                body_done,
            },
            (None, Err(e)) => {
                StreamedAnswer::Unreachable(format!("{url}: the body's consumer failed: {e}"))
            }
        }
    }

    async fn send(
        &self,
        base_url: &str,
        path: &str,
        query: &[(&str, String)],
        accept: &str,
        timeout_ms: Option<u64>,
    ) -> Result<(reqwest::Url, reqwest::Response), String> {
        let raw_url = format!("{}{path}", base_url.trim_end_matches('/'));
        let mut url =
            reqwest::Url::parse(&raw_url).map_err(|e| format!("bad peer URL {raw_url}: {e}"))?;
        if !query.is_empty() {
            let mut pairs = url.query_pairs_mut();
            for (k, v) in query {
                pairs.append_pair(k, v);
            }
        }
        let mut req = self
            .http
            .get(url.clone())
            .header(header::ACCEPT, accept)
            .header(header::ACCEPT_ENCODING, "zstd, gzip");
        if let Some(ms) = timeout_ms {
            req = req.timeout(Duration::from_millis(ms));
        }
        if let Some(auth) = &self.authorization {
            req = req.header(header::AUTHORIZATION, auth.clone());
        }
        let resp = req.send().await.map_err(|e| format!("{url}: {e}"))?;
        Ok((url, resp))
    }

    async fn get<T>(
        &self,
        base_url: &str,
        path: &str,
        query: &[(&str, String)],
        accept: &str,
        max_bytes: usize,
    ) -> Result<RawBody, FetchOutcome<T>> {
        let (url, resp) = self
            .send(base_url, path, query, accept, None)
            .await
            .map_err(FetchOutcome::Unreachable)?;
        if resp.status() != reqwest::StatusCode::OK {
            return Err(FetchOutcome::Status(resp.status().as_u16()));
        }
        read_body(&url, resp, max_bytes).await
    }
}

/// Reads a 200's body, size-checked on Content-Length and on every chunk.
async fn read_body<T>(
    url: &reqwest::Url,
    mut resp: reqwest::Response,
    max_bytes: usize,
) -> Result<RawBody, FetchOutcome<T>> {
    if resp
        .content_length()
        .is_some_and(|len| len > max_bytes as u64)
    {
        return Err(FetchOutcome::TooLarge {
            limit_bytes: max_bytes,
        });
    }
    let head = snapshot_head(&resp);
    let mut bytes = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if bytes.len().saturating_add(chunk.len()) > max_bytes {
                    return Err(FetchOutcome::TooLarge {
                        limit_bytes: max_bytes,
                    });
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(e) => return Err(FetchOutcome::Unreachable(format!("{url}: body: {e}"))),
        }
    }
    Ok(RawBody { bytes, head })
}

/// The headers a snapshot's reader needs, normalised (trimmed, lower case).
fn snapshot_head(resp: &reqwest::Response) -> SnapshotHead {
    let header_str = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_ascii_lowercase())
    };
    SnapshotHead {
        content_type: header_str(header::CONTENT_TYPE.as_str()).unwrap_or_default(),
        content_encoding: header_str(header::CONTENT_ENCODING.as_str()),
        age_ms: header_str(SNAPSHOT_AGE_HEADER).and_then(|v| v.parse().ok()),
    }
}

/// The `error.code` of a refusal's JSON body, read under [`REFUSAL_BODY_MAX_BYTES`].
async fn refusal_code(mut resp: reqwest::Response) -> Option<String> {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        let room = REFUSAL_BODY_MAX_BYTES.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= REFUSAL_BODY_MAX_BYTES {
            break;
        }
    }
    let value: serde_json::Value = serde_json::from_slice(&body).ok()?;
    value["error"]["code"].as_str().map(str::to_string)
}

/// Undoes `Content-Encoding` under the byte limit.
fn decompress<T>(
    raw: &RawBody,
    max_bytes: usize,
) -> Result<std::borrow::Cow<'_, [u8]>, FetchOutcome<T>> {
    let compression = match raw.head.content_encoding.as_deref() {
        None | Some("") | Some("identity") => Compression::None,
        Some("gzip") | Some("x-gzip") => Compression::Gzip,
        Some("zstd") => Compression::Zstd,
        Some(other) => {
            return Err(FetchOutcome::Undecodable(format!(
                "unsupported Content-Encoding {other:?}"
            )));
        }
    };
    decompress_bounded(&raw.bytes, compression, max_bytes).map_err(decode_failure)
}

fn decode_snapshot(
    raw: RawBody,
    max_bytes: usize,
    mac_key: Option<Arc<[u8]>>,
) -> FetchOutcome<IndexSnapshot> {
    let body = match decompress(&raw, max_bytes) {
        Ok(b) => b,
        Err(outcome) => return outcome,
    };
    let limits = DecodeLimits {
        max_bytes,
        ..DecodeLimits::default()
    };
    let media = raw.head.content_type.split(';').next().unwrap_or("").trim();
    let decoded = if media == BINARY_CONTENT_TYPE {
        decode_binary(&body, &limits, mac_key.as_deref())
    } else if media == "application/json" {
        // JSON carries no MAC: with a key configured only the authenticated binary is trusted.
        if mac_key.is_some() {
            return FetchOutcome::MacRefused(
                "a JSON snapshot carries no MAC, but a key is configured".into(),
            );
        }
        decode_json(&body, &limits)
    } else {
        return FetchOutcome::Undecodable(format!("unexpected Content-Type {media:?}"));
    };
    match decoded {
        Ok(s) => FetchOutcome::Body(s),
        Err(e) => decode_failure(e),
    }
}

fn decode_failure<T>(e: SnapshotDecodeError) -> FetchOutcome<T> {
    match e {
        SnapshotDecodeError::TooLarge { limit_bytes } => FetchOutcome::TooLarge { limit_bytes },
        SnapshotDecodeError::InputTooLarge { limit_bytes, .. } => {
            FetchOutcome::TooLarge { limit_bytes }
        }
        SnapshotDecodeError::MacMissing
        | SnapshotDecodeError::MacMismatch
        | SnapshotDecodeError::MacKeyTooShort { .. } => FetchOutcome::MacRefused(e.to_string()),
        other => FetchOutcome::Undecodable(other.to_string()),
    }
}
