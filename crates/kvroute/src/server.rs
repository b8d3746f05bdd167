//! HTTP routes: the proxied inference APIs, the admin API, debug and operations endpoints.
//!
//! Handlers are thin: they read the body under the size limit, turn the JSON into a prepared
//! request (model group + tokens, body rewritten to carry token ids where the engine API accepts
//! them), ask the router for a plan, and hand it to the proxy. Every error leaves through
//! `ApiError`, so clients always get the OpenAI error shape and a status from one table.

use std::sync::Arc;
use std::time::Instant;

use axum::Router as AxumRouter;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use http_body_util::BodyExt;
use serde_json::{Map, Value, json};

use crate::config::WorkerSpec;
use crate::error::ApiError;
use crate::proxy::{self, Endpoint, Forward, REQUEST_ID_HEADER};
use crate::readiness::{self, ReadinessGate};
use crate::registry::ModelGroup;
use crate::router::{RegisterError, RoutePlan, Router};
use crate::upstream::UpstreamClient;

/// Bodies up to this size are prepared (parsed, tokenized) on the async worker; larger ones on
/// the blocking pool, so tokenizing a huge prompt cannot stall other connections.
pub const INLINE_PREPARE_MAX_BYTES: usize = 32 * 1024;
/// Largest admin API body.
pub const ADMIN_BODY_MAX_BYTES: usize = 64 * 1024;

#[derive(Clone)]
pub struct AppState {
    pub router: Arc<Router>,
    pub gates: Arc<Vec<Arc<dyn ReadinessGate>>>,
    /// The serving thread's own upstream pool (see [`crate::data_plane`]).
    pub upstream: UpstreamClient,
}

/// Built-in readiness gate: at least one healthy worker is registered.
pub struct HealthyWorkerGate(pub Arc<Router>);

impl ReadinessGate for HealthyWorkerGate {
    fn name(&self) -> &str {
        "healthy_worker"
    }
    fn check(&self) -> Result<(), String> {
        match self.0.registry.healthy_count() {
            0 => Err(format!(
                "0 of {} registered workers are healthy",
                self.0.registry.workers().len()
            )),
            _ => Ok(()),
        }
    }
}

/// The built-in gates followed by the configured extra ones; shared by `/readyz` and the
/// internal listener's `producer_ready`.
pub fn readiness_gates(router: &Arc<Router>) -> Arc<Vec<Arc<dyn ReadinessGate>>> {
    let mut gates: Vec<Arc<dyn ReadinessGate>> = vec![Arc::new(HealthyWorkerGate(router.clone()))];
    gates.extend(router.config.extra_readiness_gates.iter().cloned());
    Arc::new(gates)
}

/// The public listener's routes for one data-plane thread, whose upstream pool is `upstream`.
///
/// The inference routes and `/healthz` run on the serving thread. Every other route reads or
/// changes control-plane state, and registering a worker spawns its KV subscribers: those
/// handlers run on the control runtime ([`on_control_runtime`]), so nothing long-lived is ever
/// spawned on a data-plane thread and the data plane stays free of control work.
pub fn app(router: Arc<Router>, upstream: UpstreamClient) -> AxumRouter {
    let state = AppState {
        gates: readiness_gates(&router),
        router,
        upstream,
    };
    let control = AxumRouter::new()
        .route("/v1/models", get(models))
        .route("/debug/route", post(debug_route))
        .route("/workers", get(list_workers).post(add_worker))
        .route("/workers/{id}", delete(remove_worker))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route_layer(axum::middleware::from_fn_with_state(
            state.router.control.clone(),
            on_control_runtime,
        ));
    AxumRouter::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/generate", post(generate))
        .route("/healthz", get(|| async { "ok" }))
        .merge(control)
        .fallback(|| async { ApiError::BadRequest("unknown route".into()).into_response() })
        .with_state(state)
}

/// Runs the rest of the request (the handler) as a task on the control runtime and waits for
/// it. The request and response cross threads once each; these routes are not latency-bound.
pub async fn on_control_runtime(
    State(control): State<tokio::runtime::Handle>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match control.spawn(next.run(request)).await {
        Ok(response) => response,
        Err(e) => ApiError::Internal(format!("control-plane handler failed: {e}")).into_response(),
    }
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    proxied(s, Endpoint::Completions, headers, body).await
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    proxied(s, Endpoint::ChatCompletions, headers, body).await
}

async fn generate(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    proxied(s, Endpoint::Generate, headers, body).await
}

fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID_HEADER)
        .and_then(|v| crate::h1::usable_request_id(v.as_bytes()))
        .map(str::to_string)
        .unwrap_or_else(new_request_id)
}

/// A request id for a request that came without a usable one.
pub fn new_request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Counts one answered proxied request (`requests_total{route,status}`), for both servers.
pub fn count_request(router: &Router, endpoint: Endpoint, status: StatusCode) {
    router
        .metrics
        .requests
        .with_label_values(&[endpoint.path(), status.as_str()])
        .inc();
}

/// Everything between a read body and the engine's answer, shared by both servers (the fast
/// path and this one): prepare (parse, tokenize), plan, record the decision, forward.
pub async fn route_request(
    router: &Arc<Router>,
    endpoint: Endpoint,
    bytes: bytes::Bytes,
    request_id: &str,
    upstream: &UpstreamClient,
) -> Result<proxy::Routed, ApiError> {
    let prepared = if bytes.len() <= INLINE_PREPARE_MAX_BYTES {
        prepare(router, endpoint, &bytes)?
    } else {
        let (r, b) = (router.clone(), bytes.clone());
        tokio::task::spawn_blocking(move || prepare(&r, endpoint, &b))
            .await
            .map_err(|e| ApiError::Internal(format!("request preparation failed: {e}")))??
    };
    let plan = router.plan(prepared.group, &prepared.tokens)?;
    router.record_decision(&plan);
    proxy::forward(
        router,
        Forward {
            endpoint,
            original: (!prepared.rewritten).then_some(bytes),
            body: prepared.body,
            request_id,
            plan: &plan,
            upstream,
        },
    )
    .await
}

/// Logs a failed proxied request the way both servers do: server-side failures only.
pub fn log_failure(e: &ApiError, request_id: &str, endpoint: Endpoint) {
    if e.status().is_server_error() {
        tracing::warn!(request_id = %request_id, route = endpoint.path(), error = %e, "request failed");
    }
}

async fn proxied(s: AppState, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let router = s.router.clone();
    let rid = request_id(&headers);
    let result = async {
        let bytes = read_body(body, router.config.max_body_bytes).await?;
        route_request(&router, endpoint, bytes, &rid, &s.upstream).await
    }
    .await;
    let mut resp = match result {
        Ok(r) => r.into_response(),
        Err(e) => {
            log_failure(&e, &rid, endpoint);
            e.into_response()
        }
    };
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    count_request(&router, endpoint, resp.status());
    resp
}

pub async fn read_body(body: Body, limit_bytes: usize) -> Result<bytes::Bytes, ApiError> {
    match http_body_util::Limited::new(body, limit_bytes)
        .collect()
        .await
    {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::BodyTooLarge { limit_bytes })
        }
        Err(e) => Err(ApiError::BadRequest(format!(
            "cannot read request body: {e}"
        ))),
    }
}

/// A request ready to route: its model group, the tokens to hash, the body to forward.
pub struct Prepared {
    pub group: Arc<ModelGroup>,
    pub tokens: Vec<u32>,
    /// `None` when the body was never materialised (token-id fast path): it is then exactly the
    /// client's bytes, and the proxy parses them only if it must add a field.
    pub body: Option<Map<String, Value>>,
    /// True when `body` differs from the client's bytes (text replaced by token ids).
    pub rewritten: bool,
}

/// Tokens and model of a body the generic path would route on its token ids unchanged, or `None`
/// to take the generic path (which also produces every error message). The reader
/// ([`crate::fast_ids`]) accepts a strict subset of what the generic path accepts.
fn token_ids_fast_path(endpoint: Endpoint, bytes: &[u8]) -> Option<(Option<String>, Vec<u32>)> {
    let ids_key = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Generate => "input_ids",
        Endpoint::ChatCompletions => return None,
    };
    let body = crate::fast_ids::read_token_ids_body(bytes, ids_key)?;
    Some((body.model, body.tokens))
}

fn token_array(v: &Value) -> Option<Vec<u32>> {
    let arr = v.as_array()?;
    arr.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

fn missing(field: &str, msg: &str) -> ApiError {
    ApiError::MissingField {
        message: msg.to_string(),
        param: field.to_string(),
    }
}

pub fn prepare(router: &Router, endpoint: Endpoint, bytes: &[u8]) -> Result<Prepared, ApiError> {
    if let Some((model, tokens)) = token_ids_fast_path(endpoint, bytes) {
        let group = router.resolve_model(model.as_deref())?;
        return Ok(Prepared {
            group,
            tokens,
            body: None,
            rewritten: false,
        });
    }
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let Value::Object(mut body) = value else {
        return Err(bad("request body must be a JSON object"));
    };
    let model = match body.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err(bad("'model' must be a string")),
    };
    let group = router.resolve_model(model.as_deref())?;
    let tok = group.tokenizer.clone();
    let mut rewritten = false;
    let tokens = match endpoint {
        Endpoint::Generate => match (body.get("input_ids"), body.get("text")) {
            (Some(ids), _) if !ids.is_null() => match token_array(ids) {
                Some(t) => t,
                // A batch (list of lists) is forwarded untouched and routed on load.
                None if ids
                    .as_array()
                    .is_some_and(|a| a.iter().all(Value::is_array)) =>
                {
                    Vec::new()
                }
                None => return Err(bad("'input_ids' must be an array of token ids (u32)")),
            },
            (_, Some(Value::String(text))) => match &tok {
                Some(t) => {
                    let ids = t.encode_prompt(text).map_err(|e| bad(e.to_string()))?;
                    body.remove("text");
                    rewritten = true;
                    body.insert(
                        "input_ids".into(),
                        ids.iter().copied().map(Value::from).collect(),
                    );
                    ids
                }
                None => Vec::new(),
            },
            (_, Some(Value::Array(_))) => Vec::new(),
            (_, Some(_)) => return Err(bad("'text' must be a string or an array of strings")),
            (_, None) => return Err(missing("text", "one of 'text' or 'input_ids' is required")),
        },
        Endpoint::Completions => match body.get("prompt") {
            None | Some(Value::Null) => return Err(missing("prompt", "'prompt' is required")),
            Some(Value::String(text)) => match &tok {
                Some(t) => {
                    let ids = t.encode_prompt(text).map_err(|e| bad(e.to_string()))?;
                    rewritten = true;
                    body.insert(
                        "prompt".into(),
                        ids.iter().copied().map(Value::from).collect(),
                    );
                    ids
                }
                None => Vec::new(),
            },
            Some(p @ Value::Array(items)) => match token_array(p) {
                Some(t) => t,
                None if items.iter().all(|i| i.is_string() || i.is_array()) => Vec::new(),
                None => {
                    return Err(bad(
                        "'prompt' must be a string, an array of token ids or a batch",
                    ));
                }
            },
            Some(_) => return Err(bad("'prompt' must be a string or an array")),
        },
        Endpoint::ChatCompletions => {
            let messages = match body.get("messages") {
                None | Some(Value::Null) => {
                    return Err(missing("messages", "'messages' is required"));
                }
                Some(Value::Array(m)) => m,
                Some(_) => return Err(bad("'messages' must be an array")),
            };
            match &tok {
                Some(t) if t.has_chat_template() => {
                    let normalized = crate::tokenize::normalize_messages(messages);
                    match t.encode_chat(&normalized) {
                        Ok((ids, how)) => {
                            if let crate::tokenize::ChatTokenization::Segmented {
                                cached_segments,
                                fresh_segments,
                            } = how
                            {
                                let m = &router.metrics.tokenizer_cache;
                                m.with_label_values(&["hit"]).inc_by(cached_segments as u64);
                                m.with_label_values(&["miss"]).inc_by(fresh_segments as u64);
                            } else {
                                router
                                    .metrics
                                    .tokenizer_cache
                                    .with_label_values(&["whole"])
                                    .inc();
                            }
                            ids
                        }
                        Err(crate::tokenize::TokenizeError::BadMessages(m)) => return Err(bad(m)),
                        Err(e) => {
                            tracing::debug!(error = %e, "chat not tokenized; routing on load");
                            Vec::new()
                        }
                    }
                }
                _ => Vec::new(),
            }
        }
    };
    Ok(Prepared {
        rewritten,
        group,
        tokens,
        body: Some(body),
    })
}

async fn models(State(s): State<AppState>) -> Response {
    let data: Vec<Value> = s
        .router
        .registry
        .models()
        .iter()
        .map(|g| {
            json!({"id": g.name, "object": "model", "created": 0, "owned_by": "kvroute",
            "workers": g.workers.len()})
        })
        .collect();
    let resp = axum::Json(json!({"object": "list", "data": data})).into_response();
    s.router
        .metrics
        .requests
        .with_label_values(&["/v1/models", "200"])
        .inc();
    resp
}

fn plan_json(router: &Router, plan: &RoutePlan) -> Value {
    let ranks: Vec<Value> = plan
        .candidates
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let s = plan.decision.scores[i];
            json!({
                "worker_id": c.worker.id, "url": c.worker.url, "dp_rank": c.dp_rank,
                "matched_blocks": c.input.matched_blocks, "device_blocks": c.input.device_blocks,
                "pending_blocks": c.input.pending_blocks,
                "index_matched_blocks": c.input.matched_blocks - c.input.pending_blocks,
                "in_flight": c.input.in_flight, "queued_prefill_tokens": c.input.queued_prefill_tokens,
                "engine_load": c.input.engine, "uncached_tokens": s.uncached_tokens,
                "cost_ms": s.cost_ms, "probability": s.probability,
                "within_load_bound": s.within_load_bound,
                "order": plan.decision.order.iter().position(|&o| o == i),
            })
        })
        .collect();
    let chosen = plan.chosen();
    json!({
        "model": plan.model.name, "policy": router.policy.kind.as_str(), "reason": plan.decision.reason,
        "prompt_tokens": plan.prompt_tokens, "block_size": plan.model.block_size, "indexed": plan.indexed,
        "pending_prefix_ttl_ms": router.pending.ttl_ms(),
        "chosen": {"worker_id": chosen.worker.id, "url": chosen.worker.url, "dp_rank": chosen.dp_rank},
        "ranks": ranks,
    })
}

async fn debug_route(State(s): State<AppState>, body: Body) -> Response {
    let router = &s.router;
    let result = async {
        let bytes = read_body(body, router.config.max_body_bytes).await?;
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
        let endpoint = if v.get("messages").is_some() {
            Endpoint::ChatCompletions
        } else if v.get("input_ids").is_some() || v.get("text").is_some() {
            Endpoint::Generate
        } else {
            Endpoint::Completions
        };
        let prepared = prepare(router, endpoint, &bytes)?;
        let plan = router.plan_preview(prepared.group, &prepared.tokens)?;
        Ok::<_, ApiError>(plan_json(router, &plan))
    }
    .await;
    let resp = match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    };
    router
        .metrics
        .requests
        .with_label_values(&["/debug/route", resp.status().as_str()])
        .inc();
    resp
}

fn worker_json(router: &Router, w: &crate::registry::Worker) -> Value {
    let now = Instant::now();
    let (health, failures) = {
        let h = w.health.lock();
        (h.label(now), h.consecutive_failures)
    };
    let ranks: Vec<Value> = w
        .ranks
        .iter()
        .enumerate()
        .map(|(r, l)| {
            use std::sync::atomic::Ordering::Relaxed;
            json!({"dp_rank": r, "in_flight": l.in_flight.load(Relaxed),
                "queued_prefill_tokens": l.queued_prefill_tokens.load(Relaxed),
                "dispatched_total": l.dispatched_total.load(Relaxed),
                "engine_load": router.kv.engine_load(&w.url, r as u32)})
        })
        .collect();
    json!({"id": w.id, "url": w.url, "model": w.model, "dp_size": w.dp_size, "health": health,
        "consecutive_failures": failures, "kv_source": w.kv_source,
        "kv_attach_error": *w.kv_attach_error.lock(), "ranks": ranks,
        "kv_ranks": router.kv.rank_states(&w.url)})
}

async fn list_workers(State(s): State<AppState>) -> Response {
    let workers: Vec<Value> = s
        .router
        .registry
        .workers()
        .iter()
        .map(|w| worker_json(&s.router, w))
        .collect();
    axum::Json(json!({"workers": workers})).into_response()
}

async fn add_worker(State(s): State<AppState>, body: Body) -> Response {
    let router = &s.router;
    let result = async {
        let bytes = read_body(body, ADMIN_BODY_MAX_BYTES).await?;
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
        let url = v
            .get("url")
            .and_then(Value::as_str)
            .ok_or_else(|| missing("url", "'url' (string) is required"))?;
        let model = match v.get("model") {
            None | Some(Value::Null) => None,
            Some(Value::String(m)) if !m.is_empty() => Some(m.clone()),
            Some(_) => return Err(bad("'model' must be a non-empty string")),
        };
        let mut spec = WorkerSpec::parse(url).map_err(bad)?;
        if model.is_some() {
            spec.model = model;
        }
        let worker = router.register(&spec).await.map_err(|e| match e {
            RegisterError::Registry(e) => ApiError::Conflict(e.to_string()),
            RegisterError::Kv(e) => ApiError::Upstream(e.to_string()),
        })?;
        Ok::<_, ApiError>(worker_json(router, &worker))
    }
    .await;
    match result {
        Ok(v) => (StatusCode::CREATED, axum::Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn remove_worker(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return bad("worker id must be an integer (see GET /workers)").into_response();
    };
    match s.router.deregister(id).await {
        Some(w) => axum::Json(json!({"removed": {"id": w.id, "url": w.url, "model": w.model}}))
            .into_response(),
        None => ApiError::UnknownWorker(id.to_string()).into_response(),
    }
}

async fn readyz(State(s): State<AppState>) -> Response {
    let report = readiness::evaluate(&s.gates);
    let status = if report.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(report)).into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        s.router.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_fast_path_reads_ids_and_model_of_objects_only() {
        let body = br#" {"model":"m1","prompt":[1,2,4294967295],"max_tokens":1,"x":{"y":[null]}}"#;
        let (model, tokens) = token_ids_fast_path(Endpoint::Completions, body)
            .expect("token-id body takes the fast path");
        assert_eq!(model.as_deref(), Some("m1"));
        assert_eq!(tokens, vec![1, 2, u32::MAX]);
        let (model, tokens) =
            token_ids_fast_path(Endpoint::Generate, br#"{"input_ids":[7],"text":"t"}"#)
                .expect("generate with input_ids takes the fast path");
        assert_eq!((model, tokens), (None, vec![7]));
    }

    #[test]
    fn token_ids_fast_path_leaves_every_other_shape_to_the_generic_path() {
        for (endpoint, body) in [
            (Endpoint::Completions, &br#"["m",[1,2]]"#[..]),
            (Endpoint::Completions, br#"{"prompt":"text"}"#),
            (Endpoint::Completions, br#"{"prompt":[1,-2]}"#),
            (Endpoint::Completions, br#"{"prompt":[4294967296]}"#),
            (Endpoint::Completions, br#"{"prompt":[1],"prompt":[2]}"#),
            (Endpoint::Completions, br#"{"prompt":[1],"model":3}"#),
            (Endpoint::Completions, br#"{"prompt":[1]} trailing"#),
            (Endpoint::Generate, br#"{"input_ids":null,"text":"t"}"#),
            (Endpoint::Generate, br#"{"input_ids":[[1],[2]]}"#),
            (
                Endpoint::ChatCompletions,
                br#"{"prompt":[1],"messages":[]}"#,
            ),
        ] {
            assert!(
                token_ids_fast_path(endpoint, body).is_none(),
                "{endpoint:?} {} must fall back",
                String::from_utf8_lossy(body)
            );
        }
    }
}
