//! Forwarding a routed request to its engine rank and streaming the answer back.
//!
//! Shape and why:
//! * [`forward`] returns a [`Routed`] answer: the engine's status and content type, the decision
//!   header, and the engine's body wrapped in [`TrackedBody`]. Both servers stream it: the fast
//!   path ([`crate::data_plane::connection`]) writes it to the socket itself, the general (hyper) server gets
//!   it as an HTTP body ([`Routed::into_response`]). Chunks are handed to the client as they
//!   arrive (no buffering), and when the client goes away the body is dropped, which closes the
//!   engine connection: that is how a client disconnect cancels the engine request.
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
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

use crate::control::registry::{HealthEvent, RankLoad, Worker};
use crate::control::router::Router;
use crate::error::ApiError;
use crate::routing::plan::RoutePlan;
use kvroute_http1::client::{UpstreamBody, UpstreamError};

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
        rank.reserve_prefill(crate::control::registry::clock_us(), prefill_work_us);
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

/// The engine's body, passed through piece by piece, carrying the load guard and, on a
/// cache_aware route, the prediction probe.
pub struct TrackedBody {
    inner: UpstreamBody,
    guard: Option<LoadGuard>,
    probe: Option<Box<PredictionProbe>>,
}

/// What a finished answer is checked against (see [`crate::routing::prediction`]): the depth
/// the index predicted for the chosen rank, and the engine's `cached_tokens` read from the body as it
/// passes. Boxed, so a route without it costs the body one pointer.
pub struct PredictionProbe {
    router: Arc<Router>,
    /// Shared handles, not copies of their names: the probe rides every cache_aware answer.
    model: Arc<crate::control::registry::ModelGroup>,
    worker: Arc<Worker>,
    block_size: usize,
    predicted_tokens: u64,
    scanner: crate::routing::prediction::CachedTokensScanner,
    /// Set only when debug logging is on: the request's log line then carries both counts.
    request_id: Option<String>,
}

impl PredictionProbe {
    /// The body ended: record the comparison when the engine reported a count (an answer
    /// without one, e.g. a stream without a usage chunk, says nothing).
    fn finish(self) {
        let model = self.model.name.as_str();
        let Some(reported) = self.scanner.last() else {
            return;
        };
        use crate::routing::prediction::{CheckTransition, PredictionResult};
        let metrics = &self.router.metrics;
        let result =
            PredictionResult::classify(self.predicted_tokens, reported, self.block_size as u64);
        if let Some(request_id) = &self.request_id {
            tracing::debug!(
                request_id = %request_id,
                model = %model,
                worker = %self.worker.url,
                predicted_cached_tokens = self.predicted_tokens,
                reported_cached_tokens = reported,
                result = result.label(),
                "prediction against the engine's report"
            );
        }
        metrics
            .predictions
            .with_label_values(&[model, &self.worker.url, result.label()])
            .inc();
        metrics
            .prediction_error_tokens
            .with_label_values(&[model])
            .observe(self.predicted_tokens as f64 - reported as f64);
        let transition =
            self.router
                .predictions
                .record(model, self.block_size, self.predicted_tokens, reported);
        match transition {
            Some(CheckTransition::Raised {
                direction,
                predicted,
                reported,
            }) => {
                metrics
                    .prediction_mismatch
                    .with_label_values(&[model, direction.label()])
                    .set(1);
                // A cause the router knows of itself is named instead of the list of guesses.
                let cause = match &self.model.tokenizer {
                    None => {
                        "kvroute has no tokenizer for this model, so it routes every text prompt and chat on load alone and predicts no cached tokens for them while the engines find some; give --tokenizer-path or --model-tokenizer MODEL=PATH (the engines' tokenizer.json)"
                    }
                    Some(t) if !t.has_chat_template() => {
                        "kvroute's tokenizer for this model has no chat template, so it routes every chat on load alone and predicts no cached tokens for them while the engines find some; give a tokenizer.json whose tokenizer_config.json carries the engines' chat_template"
                    }
                    Some(_) => {
                        "the router's token ids for these prompts likely differ from the engines' (another tokenizer or chat template, a BOS token added on one side only, a LoRA adapter or cache salt the engine keys its cache by, or another block size), or this replica's index lacks what the engines cached before it subscribed (a replica started without peer bootstrap only sees blocks stored after it); check --tokenizer-path / --model-tokenizer against the engines' models, and the bootstrap outcomes on /workers"
                    }
                };
                tracing::warn!(
                    model = %model,
                    direction = direction.label(),
                    predicted_cached_tokens = predicted,
                    reported_cached_tokens = reported,
                    window_requests = self.router.config.prediction_check.window_requests,
                    "the engines' reported cached tokens disagree with kvroute's predictions: {cause}"
                );
            }
            Some(CheckTransition::Cleared {
                predicted,
                reported,
            }) => {
                for d in ["over", "under"] {
                    metrics
                        .prediction_mismatch
                        .with_label_values(&[model, d])
                        .set(0);
                }
                tracing::info!(
                    model = %model,
                    predicted_cached_tokens = predicted,
                    reported_cached_tokens = reported,
                    "kvroute's predictions agree with the engines' reports again"
                );
            }
            None => {}
        }
    }
}

impl TrackedBody {
    /// The body's length when the engine framed it by length.
    pub fn exact_length(&self) -> Option<u64> {
        self.inner.exact_length()
    }

    /// The next piece of the body (`None` at its end). The first piece releases the request's
    /// prefill estimate (the engine has finished prefill); the end or an error releases the
    /// rank at once rather than when the body is dropped.
    pub fn poll_chunk(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Bytes>, UpstreamError>> {
        let polled = self.inner.poll_chunk(cx);
        match &polled {
            Poll::Ready(Ok(Some(piece))) => {
                if let Some(g) = self.guard.as_mut() {
                    g.prefill_done();
                }
                if let Some(p) = self.probe.as_mut() {
                    p.scanner.feed(piece);
                }
                if self.inner.is_done() {
                    self.guard = None;
                    if let Some(p) = self.probe.take() {
                        p.finish();
                    }
                }
            }
            Poll::Ready(Ok(None)) => {
                self.guard = None;
                if let Some(p) = self.probe.take() {
                    p.finish();
                }
            }
            // A body cut short is not compared: its count, if any, may not be the final one.
            Poll::Ready(Err(_)) => {
                self.guard = None;
                self.probe = None;
            }
            Poll::Pending => {}
        }
        polled
    }

    pub async fn next_chunk(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        std::future::poll_fn(|cx| self.poll_chunk(cx)).await
    }
}

/// For the general server: the body as an HTTP body. It keeps the engine's exact length, so a
/// body the engine framed by length reaches the client framed by length rather than chunked.
impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        match ready!(self.poll_chunk(cx)) {
            Ok(Some(piece)) => Poll::Ready(Some(Ok(Frame::data(piece)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.inner.exact_length() {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

/// An engine's answer to a routed request, ready to stream to the client.
pub struct Routed {
    pub status: u16,
    pub content_type: Option<Bytes>,
    /// The `x-kvroute-decision` value, when the header is enabled.
    pub decision: Option<String>,
    pub body: TrackedBody,
}

impl Routed {
    /// The answer as a response of the general server (the request id is added by the caller).
    pub fn into_response(self) -> Response {
        let mut headers = HeaderMap::new();
        if let Some(ct) = self
            .content_type
            .as_ref()
            .and_then(|ct| HeaderValue::from_bytes(ct).ok())
        {
            headers.insert("content-type", ct);
        }
        if let Some(v) = self
            .decision
            .as_deref()
            .and_then(|d| HeaderValue::from_str(d).ok())
        {
            headers.insert(HeaderName::from_static(DECISION_HEADER), v);
        }
        let mut response = Response::new(Body::new(self.body));
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_GATEWAY);
        *response.headers_mut() = headers;
        response
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
    pub upstream: &'a kvroute_http1::client::UpstreamClient,
    /// Why the request's text was routed without its tokens, if it was.
    pub untokenized: Option<crate::routing::tokenize::Untokenized>,
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
        if let (None, Some(o)) = (body, original)
            && let Some(spliced) = with_dp_rank_appended(o, dp_rank)
        {
            return Ok(spliced);
        }
        let mut body = match (body, original) {
            (Some(b), _) => b.clone(),
            // These are the client's bytes: a parse failure is the client's mistake (a 400),
            // never a router fault.
            (None, Some(o)) => serde_json::from_slice(o)
                .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))?,
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

/// The client's JSON object (already validated by the token-id reader) with
/// `"data_parallel_rank":N` appended as its LAST member, without parsing it into values: a
/// 2,048-id prompt re-serialized through `serde_json::Value` costs more than the rest of the
/// request, and a maximal body (millions of ids) would take tens of bytes of memory per id.
/// Last, because the engines' JSON readers (Python's `json`, which FastAPI and pydantic use)
/// keep the last of duplicate keys, so the router's rank wins over one a client sent. `None`
/// when the bytes are not shaped `{ ... }`, and the caller parses them instead.
fn with_dp_rank_appended(original: &[u8], dp_rank: u32) -> Option<Bytes> {
    let ws = |b: &u8| matches!(b, b' ' | b'\n' | b'\t' | b'\r');
    let open = original.iter().position(|b| !ws(b))?;
    let close = original.iter().rposition(|b| !ws(b))?;
    if original[open] != b'{' || original[close] != b'}' || close <= open {
        return None;
    }
    let empty = original[open + 1..close].iter().all(ws);
    let member = format!(
        "{}\"data_parallel_rank\":{dp_rank}",
        if empty { "" } else { "," }
    );
    let mut out = Vec::with_capacity(original.len() + member.len());
    out.extend_from_slice(&original[..close]);
    out.extend_from_slice(member.as_bytes());
    out.extend_from_slice(&original[close..]);
    Some(Bytes::from(out))
}

/// Sends the request to the plan's ranks in order until one answers; returns the streaming
/// answer.
pub async fn forward(router: &Arc<Router>, fwd: Forward<'_>) -> Result<Routed, ApiError> {
    let plan = fwd.plan;
    let attempts = plan
        .decision
        .order
        .len()
        .min(router.config.max_retries as usize + 1);
    let timeout = Duration::from_millis(router.config.request_timeout_ms);
    let mut last_error = String::new();
    // Checked once for every attempt; an id that is not a valid header value is not forwarded.
    let request_id_header = kvroute_http1::framing::usable_request_id(fwd.request_id.as_bytes());
    for (attempt, &idx) in plan.decision.order.iter().take(attempts).enumerate() {
        let cand = &plan.candidates[idx];
        let worker = plan.worker(cand);
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
        // A cold prompt's owner queued this prefill on its own clock (`peer::cold_owner`).
        let prefill_work_us = if plan.prefill_booked_by_owner == Some(idx) {
            0
        } else {
            router.policy.prefill_work_us(uncached)
        };
        let guard = LoadGuard::acquire(rank.clone(), gauge, uncached, prefill_work_us);
        let dp_rank_text = cand.dp_rank.to_string();
        let mut upstream_headers = vec![(DP_RANK_HEADER, dp_rank_text.as_str())];
        upstream_headers.extend(request_id_header.map(|v| (REQUEST_ID_HEADER, v)));
        let send =
            fwd.upstream
                .post_json(&worker.url, fwd.endpoint.path(), &upstream_headers, &body);
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
                let status = resp.status;
                let server_error = (500..600).contains(&status);
                router.health_event(
                    worker,
                    if server_error {
                        HealthEvent::RequestFailed
                    } else {
                        HealthEvent::RequestOk
                    },
                );
                if server_error {
                    router
                        .metrics
                        .upstream_failures
                        .with_label_values(&["status_5xx"])
                        .inc();
                }
                // The request id is added by the caller, to every response including errors.
                let decision = router
                    .config
                    .decision_header
                    .then(|| plan.header_value(router.policy.kind.as_str(), idx));
                // Only answers to indexed (cache_aware) plans carry a prediction worth checking,
                // and only successful ones report a count. A cache_aware router that cannot
                // tokenize any text of the model (no tokenizer, no chat template) predicts no
                // cached tokens for it: checked too, since the engines' reports are then the only
                // sign of the hits it is routing away from.
                let blind_to_text = fwd.untokenized.is_some_and(|u| u.is_configuration())
                    && router.policy.kind == crate::routing::policy::PolicyKind::CacheAware;
                let probe = ((plan.indexed || blind_to_text)
                    && status == 200
                    && router.config.prediction_check.window_requests > 0)
                    .then(|| {
                        // The depth the INDEX vouches for (the engines' own events): pending
                        // blocks are the router's own guesses, and counting them would make a
                        // router that hashes other tokens than the engine look right (its
                        // pending entries match its own next requests).
                        let block_size = plan.model.block_size;
                        let indexed_blocks = cand
                            .input
                            .matched_blocks
                            .saturating_sub(cand.input.pending_blocks);
                        let predicted = (u64::from(indexed_blocks) * block_size as u64)
                            .min(plan.prompt_tokens as u64);
                        Box::new(PredictionProbe {
                            router: router.clone(),
                            model: plan.model.clone(),
                            worker: worker.clone(),
                            block_size,
                            predicted_tokens: predicted,
                            scanner: Default::default(),
                            request_id: tracing::enabled!(tracing::Level::DEBUG)
                                .then(|| fwd.request_id.to_string()),
                        })
                    });
                return Ok(Routed {
                    status,
                    content_type: resp.content_type,
                    decision,
                    body: TrackedBody {
                        inner: resp.body,
                        guard: Some(guard),
                        probe,
                    },
                });
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

    #[test]
    fn the_dp_rank_is_appended_last_so_it_wins_over_one_the_client_sent() {
        for (client, want_prompt) in [
            (&br#"  {"prompt":[1],"data_parallel_rank":7} "#[..], true),
            (br#"{}"#, false),
            (b"{ \n }", false),
        ] {
            let out = encode_upstream_body(None, Some(&Bytes::from_static(client)), 4, 2)
                .expect("encodes");
            // serde_json, like Python's json, keeps the last of duplicate keys.
            let v: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
            assert_eq!(
                v["data_parallel_rank"],
                2,
                "{}",
                String::from_utf8_lossy(&out)
            );
            assert_eq!(v.get("prompt").is_some(), want_prompt);
        }
    }

    #[test]
    fn client_bytes_that_cannot_be_reparsed_for_a_dp_engine_are_a_400_not_a_500() {
        // Not shaped `{ ... }`, so not spliced, and not JSON either.
        let cut = Bytes::from_static(br#"{"prompt":[1],"x":[[["#);
        let err = encode_upstream_body(None, Some(&cut), 2, 0).unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST, "{err}");
    }
}
