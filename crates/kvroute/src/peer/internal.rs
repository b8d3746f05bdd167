//! The internal listener: endpoints sibling router replicas call, never clients.
//!
//! They live on their own listener (`--internal-port`, default main port + 1, bind address
//! `--internal-bind`) so the public API port never exposes them and a NetworkPolicy can open
//! the internal port to siblings only. With `--internal-auth-token-file`, every request needs
//! `Authorization: Bearer <token>` (compared in constant time; 401 otherwise), and the same token
//! bytes key the binary snapshot's HMAC, so a compact snapshot is authenticated even if a proxy
//! in between terminates the connection. A snapshot holds block hashes, tiers and worker
//! addresses, never prompt text, which is why hashes-only is enough for bootstrap.
//!
//! * `GET /internal/kv_snapshot[?model=NAME][&max_age_ms=N]`: the model's index
//!   ([`crate::peer::producer`] explains caching, single flight and consistency). Format by
//!   `Accept`: `application/x-kvroute-snapshot` gets the compact binary (what the fetch client
//!   always asks for); no `Accept`, `*/*` or `application/json` gets JSON, so `curl` shows
//!   something readable. Compression by `Accept-Encoding`: zstd preferred over gzip, identity
//!   otherwise. JSON is compressed as HTTP `Content-Encoding`; the binary compresses INSIDE its
//!   envelope (header `x-kvroute-snapshot-compression` names it, no `Content-Encoding`), because
//!   its HMAC is then verified before a single byte is decompressed.
//! * `GET /internal/kv_cursors[?model=NAME]`: the rank table and cursors, never cached.
//! * `GET /internal/load_bookings`: an endless stream of this replica's own per-rank load
//!   bookings, for siblings' cost models ([`crate::peer::load_share`]).
//! * `POST /internal/cold_place`: this replica places a sibling's cold prompt as the owner of
//!   its prefix and names the rank ([`crate::peer::cold_owner`]).
//!
//! Both answer 404 when this replica keeps no index for the model (policy not cache-aware, no
//! worker publishing events, unknown model), 400 when several models have indexes and none was
//! named, and 503 while the index has no cursor at all (it has not applied one batch yet).
//! Unknown query parameters are ignored.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router as AxumRouter;
use axum::body::Body;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kvroute_snapshot::{BINARY_CONTENT_TYPE, Compression, JSON_CONTENT_TYPE};
use serde_json::json;

use crate::control::readiness::{self, ReadinessGate};
use crate::control::router::Router;
use crate::peer::producer::{
    ExportRequest, PRODUCER_CACHE_TTL_MS, PRODUCER_MAX_AGE_MS_MAX, ProduceError,
    SNAPSHOT_BUSY_RETRY_AFTER_S, SnapshotFormat, cursor_table, index_has_cursor,
};

/// Largest `--internal-auth-token-file` read; a token is a short secret, not a document.
pub const INTERNAL_AUTH_TOKEN_FILE_MAX_BYTES: u64 = 4096;

/// Reads an internal auth token file (see [`read_token_file`]).
pub fn read_internal_auth_token(path: &std::path::Path) -> Result<Arc<[u8]>, String> {
    read_token_file(path, "--internal-auth-token-file")
}

/// Reads a bearer token file named by `flag`: bounded, trailing whitespace (the newline `echo`
/// and editors add) trimmed, long enough to key the snapshot HMAC (and to resist guessing), and
/// printable ASCII so it can travel in an `Authorization` header.
pub fn read_token_file(path: &std::path::Path, flag: &str) -> Result<Arc<[u8]>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| format!("cannot open {flag} {}: {e}", path.display()))?;
    let mut raw = Vec::new();
    file.take(INTERNAL_AUTH_TOKEN_FILE_MAX_BYTES + 1)
        .read_to_end(&mut raw)
        .map_err(|e| format!("cannot read {flag} {}: {e}", path.display()))?;
    if raw.len() as u64 > INTERNAL_AUTH_TOKEN_FILE_MAX_BYTES {
        return Err(format!(
            "{flag} is larger than {INTERNAL_AUTH_TOKEN_FILE_MAX_BYTES} bytes"
        ));
    }
    let end = raw
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    raw.truncate(end);
    if raw.len() < kvroute_snapshot::limits::MAC_KEY_MIN_BYTES {
        return Err(format!(
            "{flag} holds {} bytes; at least {} are needed",
            raw.len(),
            kvroute_snapshot::limits::MAC_KEY_MIN_BYTES
        ));
    }
    if raw.iter().any(|b| !b.is_ascii_graphic()) {
        return Err(format!(
            "{flag} must hold printable ASCII without spaces (it is sent as a bearer token)"
        ));
    }
    Ok(Arc::from(raw))
}

pub use crate::peer::protocol::{
    KV_CURSORS_PATH, KV_SNAPSHOT_PATH, SNAPSHOT_AGE_HEADER, SNAPSHOT_COMPRESSION_HEADER,
};

#[derive(Clone)]
struct InternalState {
    router: Arc<Router>,
    gates: Arc<Vec<Arc<dyn ReadinessGate>>>,
}

/// The internal listener's routes, behind the bearer-token check when a token is configured.
/// `admin` is the admin API's route table (`api::internal_admin_app`), served here for
/// operators who keep it off the public listener; it sits behind the same token check.
pub fn internal_app(
    router: Arc<Router>,
    gates: Arc<Vec<Arc<dyn ReadinessGate>>>,
    admin: AxumRouter,
) -> AxumRouter {
    let token = router.config.internal_auth_token.clone();
    let state = InternalState { router, gates };
    AxumRouter::new()
        .route(KV_SNAPSHOT_PATH, get(kv_snapshot))
        .route(KV_CURSORS_PATH, get(kv_cursors))
        .route(
            crate::peer::load_share::LOAD_BOOKINGS_PATH,
            get(
                |State(s): State<InternalState>,
                 axum::extract::RawQuery(query): axum::extract::RawQuery| async move {
                    let want_prefixes = query.as_deref().is_some_and(|q| {
                        q.split('&')
                            .any(|p| p == crate::peer::load_share_tasks::WANT_PREFIXES_QUERY)
                    });
                    crate::peer::load_share_tasks::bookings_stream_response(
                        &s.router,
                        want_prefixes,
                    )
                },
            ),
        )
        .route(
            crate::peer::cold_owner::COLD_PLACE_PATH,
            axum::routing::post(cold_place).layer(axum::extract::DefaultBodyLimit::max(
                crate::peer::cold_owner::COLD_PLACE_BODY_MAX_BYTES,
            )),
        )
        .fallback(|| async { refuse(StatusCode::NOT_FOUND, "not_found", "unknown internal route") })
        .with_state(state)
        .merge(admin)
        .layer(axum::middleware::from_fn_with_state(token, require_token))
}

async fn require_token(
    State(token): State<Option<Arc<[u8]>>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(expected) = &token {
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
        if !presented.is_some_and(|p| constant_time_eq(p, expected)) {
            let mut resp = refuse(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid bearer token is required on the internal listener",
            );
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return resp;
        }
    }
    next.run(req).await
}

/// Compares a presented token with the expected one in constant time (`subtle`), so response
/// timing does not reveal how much of a guessed token was right. The length is not secret.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

fn refuse(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"code": code, "message": message}})),
    )
        .into_response()
}

fn busy(message: &str) -> Response {
    let mut resp = refuse(StatusCode::SERVICE_UNAVAILABLE, "busy", message);
    resp.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(SNAPSHOT_BUSY_RETRY_AFTER_S),
    );
    resp
}

/// Parses `max_age_ms`: absent -> the default, digits beyond [`PRODUCER_MAX_AGE_MS_MAX`] (or
/// beyond u64) saturate, anything else is a 400.
pub fn parse_max_age(raw: Option<&str>) -> Result<Duration, String> {
    let Some(raw) = raw else {
        return Ok(Duration::from_millis(PRODUCER_CACHE_TTL_MS));
    };
    let raw = raw.trim();
    if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "max_age_ms must be a non-negative integer, got {raw:?}"
        ));
    }
    let ms = raw.parse::<u64>().unwrap_or(u64::MAX);
    Ok(Duration::from_millis(ms.min(PRODUCER_MAX_AGE_MS_MAX)))
}

/// Media type from `Accept`: binary only when asked for by name (with q > 0).
pub fn negotiate_format(headers: &HeaderMap) -> SnapshotFormat {
    let accepts_binary = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let (name, q) = media_and_q(item);
            name.eq_ignore_ascii_case(BINARY_CONTENT_TYPE) && q > 0.0
        });
    if accepts_binary {
        SnapshotFormat::Binary
    } else {
        SnapshotFormat::Json
    }
}

/// Compression from `Accept-Encoding`: zstd if accepted, else gzip, else identity.
pub fn negotiate_compression(headers: &HeaderMap) -> Compression {
    let mut zstd = false;
    let mut gzip = false;
    for item in headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
    {
        let (name, q) = media_and_q(item);
        if q <= 0.0 {
            continue;
        }
        if name.eq_ignore_ascii_case("zstd") {
            zstd = true;
        } else if name.eq_ignore_ascii_case("gzip") || name.eq_ignore_ascii_case("x-gzip") {
            gzip = true;
        }
    }
    if zstd {
        Compression::Zstd
    } else if gzip {
        Compression::Gzip
    } else {
        Compression::None
    }
}

fn media_and_q(item: &str) -> (&str, f32) {
    let mut parts = item.split(';');
    let name = parts.next().unwrap_or("").trim();
    let q = parts
        .filter_map(|p| p.trim().strip_prefix("q="))
        .filter_map(|q| q.trim().parse::<f32>().ok())
        .next()
        .unwrap_or(1.0);
    (name, q)
}

/// Why a request names no usable index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexRefusal {
    /// Not cache-aware, unknown model, or no worker of the model publishes KV events.
    NoIndex,
    /// Several models have indexes and the request named none of them.
    ModelRequired { models: Vec<String> },
}

impl IntoResponse for IndexRefusal {
    fn into_response(self) -> Response {
        match self {
            IndexRefusal::NoIndex => refuse(
                StatusCode::NOT_FOUND,
                "no_index",
                "this replica keeps no prefix index for that model",
            ),
            IndexRefusal::ModelRequired { models } => refuse(
                StatusCode::BAD_REQUEST,
                "model_required",
                &format!(
                    "several models have indexes ({}); add ?model=NAME",
                    models.join(", ")
                ),
            ),
        }
    }
}

/// The model whose index a request targets.
fn resolve_index(
    router: &Router,
    model: Option<&str>,
) -> Result<(String, kvroute_kv::ModelView), IndexRefusal> {
    if router.config.policy != crate::routing::policy::PolicyKind::CacheAware {
        return Err(IndexRefusal::NoIndex);
    }
    let plane = router.kv.plane();
    match model {
        Some(m) => plane
            .model_view(m)
            .map(|v| (m.to_string(), v))
            .ok_or(IndexRefusal::NoIndex),
        None => {
            let mut indexed: Vec<(String, kvroute_kv::ModelView)> = router
                .registry
                .models()
                .iter()
                .filter_map(|g| plane.model_view(&g.name).map(|v| (g.name.clone(), v)))
                .collect();
            match indexed.len() {
                0 => Err(IndexRefusal::NoIndex),
                1 => Ok(indexed.remove(0)),
                _ => {
                    let mut models: Vec<String> = indexed.into_iter().map(|(n, _)| n).collect();
                    models.sort_unstable();
                    Err(IndexRefusal::ModelRequired { models })
                }
            }
        }
    }
}

fn not_ready() -> Response {
    let mut resp = refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        "index_not_ready",
        "this replica's index has not applied any KV event yet",
    );
    resp.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(SNAPSHOT_BUSY_RETRY_AFTER_S),
    );
    resp
}

async fn kv_snapshot(
    State(s): State<InternalState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let arrival = Instant::now();
    let producer = &s.router.snapshots;
    let max_age = match parse_max_age(query.get("max_age_ms").map(String::as_str)) {
        Ok(d) => d,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, "bad_max_age_ms", &e),
    };
    let (model, view) = match resolve_index(&s.router, query.get("model").map(String::as_str)) {
        Ok(v) => v,
        Err(refusal) => {
            producer
                .metrics
                .refused
                .with_label_values(&["no_index"])
                .inc();
            return refusal.into_response();
        }
    };
    if !index_has_cursor(&view.reader) {
        producer
            .metrics
            .refused
            .with_label_values(&["not_ready"])
            .inc();
        return not_ready();
    }
    let format = negotiate_format(&headers);
    let compression = negotiate_compression(&headers);
    let gates = s.gates.clone();
    let produced = async {
        let (export, _) = producer
            .export(
                &model,
                &view.reader,
                ExportRequest { arrival, max_age },
                move || readiness::evaluate(&gates).ready,
                {
                    let router = s.router.clone();
                    let model = model.clone();
                    move || router.kv.ranks_with_complete_history(&model)
                },
            )
            .await?;
        let body = producer
            .stream_encoded(&export, format, compression)
            .await?;
        Ok::<_, ProduceError>((export, body))
    }
    .await;
    let (export, body) = match produced {
        Ok(v) => v,
        Err(ProduceError::Busy) => {
            producer.metrics.refused.with_label_values(&["busy"]).inc();
            return busy("every snapshot export slot is busy");
        }
        Err(ProduceError::TooLarge { limit_bytes }) => {
            producer
                .metrics
                .refused
                .with_label_values(&["too_large"])
                .inc();
            tracing::warn!(
                model = %model,
                format = format.label(),
                limit_bytes,
                "snapshot refused: the encoded export exceeds --kv-snapshot-max-bytes"
            );
            return refuse(
                StatusCode::INSUFFICIENT_STORAGE,
                "snapshot_too_large",
                &format!("the encoded snapshot exceeds {limit_bytes} bytes"),
            );
        }
        Err(e) => {
            producer.metrics.refused.with_label_values(&["error"]).inc();
            tracing::error!(model = %model, error = %e, "snapshot export failed");
            return refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                "export_failed",
                &e.to_string(),
            );
        }
    };
    let compression_label = compression.content_encoding().unwrap_or("identity");
    let bytes_served = producer
        .metrics
        .bytes_served
        .with_label_values(&[format.label(), compression_label]);
    let body = futures::StreamExt::inspect(body.into_stream(), move |piece| {
        if let Ok(chunk) = piece {
            bytes_served.inc_by(chunk.len() as u64);
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(match format {
            SnapshotFormat::Binary => BINARY_CONTENT_TYPE,
            SnapshotFormat::Json => JSON_CONTENT_TYPE,
        }),
    );
    h.insert(
        header::VARY,
        HeaderValue::from_static("accept, accept-encoding"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        SNAPSHOT_AGE_HEADER,
        HeaderValue::from(export.age_at(arrival).as_millis() as u64),
    );
    match format {
        SnapshotFormat::Json => {
            if let Some(enc) = compression.content_encoding() {
                h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(enc));
            }
        }
        SnapshotFormat::Binary => {
            h.insert(
                SNAPSHOT_COMPRESSION_HEADER,
                HeaderValue::from_static(compression_label),
            );
        }
    }
    resp
}

async fn kv_cursors(
    State(s): State<InternalState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let (_, view) = match resolve_index(&s.router, query.get("model").map(String::as_str)) {
        Ok(v) => v,
        Err(refusal) => return refusal.into_response(),
    };
    if !index_has_cursor(&view.reader) {
        return not_ready();
    }
    let mut resp = axum::Json(cursor_table(&view.reader)).into_response();
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// Places a sibling's cold prompt as the owner of its prefix (`crate::peer::cold_owner`): the
/// body is the prompt's token ids (little-endian `u32`), the model is named by a header. 400 for
/// a body that is not token ids, 413 past the cap, 404 for a model this replica does not serve,
/// 503 when it has no healthy rank for it.
async fn cold_place(
    State(s): State<InternalState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    use crate::peer::cold_owner::{COLD_PLACE_MODEL_HEADER, ColdPlaceError, read_token_ids};
    let tokens = match read_token_ids(&body) {
        Ok(t) => t,
        Err(e @ ColdPlaceError::TooLarge) => {
            return refuse(StatusCode::PAYLOAD_TOO_LARGE, "too_large", &e.to_string());
        }
        Err(e) => return refuse(StatusCode::BAD_REQUEST, "bad_body", &e.to_string()),
    };
    let model = headers
        .get(COLD_PLACE_MODEL_HEADER)
        .and_then(|v| v.to_str().ok());
    // The prompt's whole length when the asker sent only its head (a chat tokenized in its
    // head); never fewer tokens than the body holds, never more than a body could.
    let prompt_tokens = headers
        .get(crate::peer::cold_owner::COLD_PLACE_PROMPT_TOKENS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0)
        .clamp(tokens.len(), crate::peer::cold_owner::COLD_PLACE_TOKENS_MAX);
    let placed = s
        .router
        .resolve_model(model)
        .and_then(|group| s.router.plan_as_owner(group, &tokens, prompt_tokens));
    match placed {
        Ok(placement) => {
            s.router
                .metrics
                .cold_placements
                .with_label_values(&["served"])
                .inc();
            let mut resp = axum::Json(placement).into_response();
            resp.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        }
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
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

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn binary_only_when_named_and_json_for_curl_defaults() {
        assert_eq!(negotiate_format(&headers(&[])), SnapshotFormat::Json);
        assert_eq!(
            negotiate_format(&headers(&[("accept", "*/*")])),
            SnapshotFormat::Json
        );
        assert_eq!(
            negotiate_format(&headers(&[(
                "accept",
                "application/json, application/x-kvroute-snapshot"
            )])),
            SnapshotFormat::Binary
        );
        assert_eq!(
            negotiate_format(&headers(&[(
                "accept",
                "application/x-kvroute-snapshot;q=0"
            )])),
            SnapshotFormat::Json
        );
    }

    #[test]
    fn zstd_is_preferred_over_gzip_and_q_zero_refuses() {
        assert_eq!(
            negotiate_compression(&headers(&[("accept-encoding", "gzip, zstd")])),
            Compression::Zstd
        );
        assert_eq!(
            negotiate_compression(&headers(&[("accept-encoding", "gzip;q=0.5, zstd;q=0")])),
            Compression::Gzip
        );
        assert_eq!(
            negotiate_compression(&headers(&[("accept-encoding", "br, deflate")])),
            Compression::None
        );
        assert_eq!(negotiate_compression(&headers(&[])), Compression::None);
    }

    #[test]
    fn max_age_defaults_saturates_and_refuses_garbage() {
        assert_eq!(
            parse_max_age(None).unwrap(),
            Duration::from_millis(PRODUCER_CACHE_TTL_MS)
        );
        assert_eq!(parse_max_age(Some("0")).unwrap(), Duration::ZERO);
        assert_eq!(
            parse_max_age(Some("99999999999999999999999999")).unwrap(),
            Duration::from_millis(PRODUCER_MAX_AGE_MS_MAX)
        );
        assert!(parse_max_age(Some("-1")).is_err());
        assert!(parse_max_age(Some("soon")).is_err());
    }

    #[test]
    fn token_compare_needs_equal_bytes_and_length() {
        assert!(constant_time_eq(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!constant_time_eq(b"0123456789abcdeF", b"0123456789abcdef"));
        assert!(!constant_time_eq(b"0123456789abcde", b"0123456789abcdef"));
    }
}
