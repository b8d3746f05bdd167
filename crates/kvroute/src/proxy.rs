//! Forwarding a routed request to its engine rank and streaming the answer back.
//!
//! Shape and why:
//! * The response body is the upstream body stream wrapped in [`TrackedBody`]; chunks are
//!   handed to the client as they arrive (no buffering), and when the client goes away hyper drops
//!   the body, which drops the upstream response and closes its connection: that is how a client
//!   disconnect cancels the engine request.
//! * The wrapper owns the rank's load accounting: in-flight is decremented when the stream ends or
//!   is dropped (never leaked on an error path), and the request's queued-prefill estimate is
//!   removed at the first chunk, when the engine has finished prefill.
//! * Retries happen only when the connection could not be made (no byte was sent upstream, and
//!   therefore none to the client), at most `max_retries` times, to the next rank in the policy's
//!   order. A timeout or an error after the request was sent is not retried: the engine may be
//!   working on it.
//! * `request_timeout_ms` bounds the wait for the response HEADERS. A streamed generation may
//!   legitimately run longer than any sensible timeout, so the body is not cut by it.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};

use crate::error::ApiError;
use crate::registry::{HealthEvent, RankLoad, Worker};
use crate::router::{RoutePlan, Router};

pub const REQUEST_ID_HEADER: &str = "x-request-id";
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
pub const DECISION_HEADER: &str = "x-kvroute-decision";

/// Router-side load of one dispatched request, released exactly once.
pub struct LoadGuard {
    rank: Arc<RankLoad>,
    gauge: prometheus::IntGauge,
    prefill_tokens: i64,
    prefill_pending: bool,
}

impl LoadGuard {
    /// `prefill_work_us` is the cost model's estimate of the request's prefill time on the rank
    /// (its uncached tokens at the configured per-token cost).
    pub fn acquire(
        rank: Arc<RankLoad>,
        gauge: prometheus::IntGauge,
        prefill_tokens: i64,
        prefill_work_us: u64,
    ) -> LoadGuard {
        rank.reserve_prefill(crate::registry::clock_us(), prefill_work_us);
        rank.in_flight.fetch_add(1, Ordering::Relaxed);
        rank.queued_prefill_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        rank.dispatched_total.fetch_add(1, Ordering::Relaxed);
        gauge.inc();
        LoadGuard {
            rank,
            gauge,
            prefill_tokens,
            prefill_pending: true,
        }
    }

    pub fn prefill_done(&mut self) {
        if std::mem::take(&mut self.prefill_pending) {
            self.rank
                .queued_prefill_tokens
                .fetch_sub(self.prefill_tokens, Ordering::Relaxed);
        }
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.prefill_done();
        self.rank.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.gauge.dec();
    }
}

/// The upstream body, passed through frame by frame, carrying the load guard. It keeps the
/// upstream's size hint, so a body the engine framed by length reaches the client framed by
/// length (one write) rather than chunked.
pub struct TrackedBody {
    inner: Incoming,
    guard: Option<LoadGuard>,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) => {
                if let Some(g) = self.guard.as_mut() {
                    g.prefill_done();
                }
                if self.inner.is_end_stream() {
                    self.guard = None;
                }
            }
            // End or error: release the rank now rather than when hyper drops the body.
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.guard = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Which engine API a request came in on; the path it is forwarded to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
    Generate,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Generate => "/generate",
        }
    }
}

pub struct Forward<'a> {
    pub endpoint: Endpoint,
    /// The parsed body; `None` when it was never materialised, and then `original` is the body.
    pub body: Option<serde_json::Map<String, serde_json::Value>>,
    /// The client's bytes, forwarded as they are when the router changed nothing (saves a
    /// serialization on the hot path); `None` when `body` was rewritten.
    pub original: Option<bytes::Bytes>,
    pub request_id: &'a str,
    pub plan: &'a RoutePlan,
    /// The calling data-plane thread's own pool (see [`crate::data_plane`]).
    pub upstream: &'a crate::upstream::UpstreamClient,
}

fn upstream_body(fwd: &Forward<'_>, worker: &Worker, dp_rank: u32) -> Result<Bytes, ApiError> {
    encode_upstream_body(
        fwd.body.as_ref(),
        fwd.original.as_ref(),
        worker.dp_size,
        dp_rank,
    )
}

fn encode_upstream_body(
    body: Option<&serde_json::Map<String, serde_json::Value>>,
    original: Option<&Bytes>,
    dp_size: u32,
    dp_rank: u32,
) -> Result<Bytes, ApiError> {
    let encode_err =
        |e: serde_json::Error| ApiError::Internal(format!("cannot encode upstream body: {e}"));
    // Only DP engines get the field: an engine without DP may reject an unknown field.
    if dp_size > 1 {
        let mut body = match (body, original) {
            (Some(b), _) => b.clone(),
            // The fast path skipped materialising the body; DP engines are the rare case.
            (None, Some(o)) => serde_json::from_slice(o).map_err(encode_err)?,
            (None, None) => return Err(ApiError::Internal("no upstream body".into())),
        };
        body.insert("data_parallel_rank".into(), dp_rank.into());
        return serde_json::to_vec(&body)
            .map(Bytes::from)
            .map_err(encode_err);
    }
    match (body, original) {
        (_, Some(original)) => Ok(original.clone()),
        (Some(body), None) => serde_json::to_vec(body)
            .map(Bytes::from)
            .map_err(encode_err),
        (None, None) => Err(ApiError::Internal("no upstream body".into())),
    }
}

/// Sends the request to the plan's ranks in order until one answers; returns the streaming
/// response.
pub async fn forward(router: &Arc<Router>, fwd: Forward<'_>) -> Result<Response, ApiError> {
    let plan = fwd.plan;
    let attempts = plan
        .decision
        .order
        .len()
        .min(router.config.max_retries as usize + 1);
    let timeout = Duration::from_millis(router.config.request_timeout_ms);
    let mut last_error = String::new();
    // Parsed once for every attempt; an id that is not a valid header value is not forwarded.
    let request_id_header = HeaderValue::from_str(fwd.request_id).ok();
    for (attempt, &idx) in plan.decision.order.iter().take(attempts).enumerate() {
        let cand = &plan.candidates[idx];
        let worker = &cand.worker;
        if attempt > 0 {
            router
                .metrics
                .retries
                .with_label_values(&[fwd.endpoint.path()])
                .inc();
        }
        let body = upstream_body(&fwd, worker, cand.dp_rank)?;
        let rank = &worker.ranks[cand.dp_rank as usize];
        let gauge = rank
            .in_flight_gauge
            .get_or_init(|| {
                router
                    .metrics
                    .in_flight
                    .with_label_values(&[&worker.url, &cand.dp_rank.to_string()])
            })
            .clone();
        let uncached = plan.decision.scores[idx].uncached_tokens as i64;
        let guard = LoadGuard::acquire(
            rank.clone(),
            gauge,
            uncached,
            (uncached.max(0) as f64 * router.policy.weights.prefill_cost_us_per_token) as u64,
        );
        let dp_header = HeaderValue::from(cand.dp_rank);
        let mut upstream_headers = vec![(DP_RANK_HEADER, dp_header)];
        if let Some(v) = &request_id_header {
            upstream_headers.push((REQUEST_ID_HEADER, v.clone()));
        }
        let send =
            fwd.upstream
                .post_json(&worker.url, fwd.endpoint.path(), &upstream_headers, body);
        match tokio::time::timeout(timeout, send).await {
            Err(_) => {
                router
                    .metrics
                    .upstream_failures
                    .with_label_values(&["timeout"])
                    .inc();
                router.health_event(worker, HealthEvent::RequestFailed);
                return Err(ApiError::UpstreamTimeout(router.config.request_timeout_ms));
            }
            Ok(Err(e)) if e.is_connect() => {
                router
                    .metrics
                    .upstream_failures
                    .with_label_values(&["connect"])
                    .inc();
                router.health_event(worker, HealthEvent::RequestFailed);
                tracing::warn!(url = %worker.url, error = %e, attempt, "upstream connect failed");
                last_error = format!("{}: {e}", worker.url);
                continue;
            }
            Ok(Err(e)) => {
                router
                    .metrics
                    .upstream_failures
                    .with_label_values(&["send"])
                    .inc();
                router.health_event(worker, HealthEvent::RequestFailed);
                return Err(ApiError::Upstream(format!("{}: {e}", worker.url)));
            }
            Ok(Ok(resp)) => {
                let status = resp.status();
                router.health_event(
                    worker,
                    if status.is_server_error() {
                        HealthEvent::RequestFailed
                    } else {
                        HealthEvent::RequestOk
                    },
                );
                if status.is_server_error() {
                    router
                        .metrics
                        .upstream_failures
                        .with_label_values(&["status_5xx"])
                        .inc();
                }
                let mut headers = HeaderMap::new();
                if let Some(ct) = resp.headers().get("content-type") {
                    headers.insert("content-type", ct.clone());
                }
                // The request id is added by the handler, to every response including errors.
                if router.config.decision_header {
                    let text = plan.header_value(router.policy.kind.as_str(), idx);
                    if let Ok(v) = HeaderValue::from_str(&text) {
                        headers.insert(HeaderName::from_static(DECISION_HEADER), v);
                    }
                }
                let body = TrackedBody {
                    inner: resp.into_body(),
                    guard: Some(guard),
                };
                let mut response = Response::new(Body::new(body));
                *response.status_mut() = status;
                *response.headers_mut() = headers;
                return Ok(response);
            }
        }
    }
    Err(ApiError::Upstream(format!(
        "no rank reachable after {attempts} attempts; last: {last_error}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmaterialised_body_gets_the_dp_rank_and_keeps_every_client_field() {
        let original = Bytes::from_static(br#"{"prompt":[1,2],"max_tokens":3}"#);
        let out = encode_upstream_body(None, Some(&original), 2, 1).expect("encodes");
        let v: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
        assert_eq!(
            v,
            serde_json::json!({"prompt": [1, 2], "max_tokens": 3, "data_parallel_rank": 1})
        );
        let plain = encode_upstream_body(None, Some(&original), 1, 0).expect("encodes");
        assert_eq!(
            plain, original,
            "a non-DP engine gets the client's bytes untouched"
        );
    }
}
