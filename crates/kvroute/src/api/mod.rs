//! The HTTP route table of the public listener, served by hyper: the fallback for proxied
//! requests the hand-written connection server does not take, the operations endpoints
//! (`/healthz`, `/readyz`, `/metrics`, `/v1/models`) and the admin API ([`admin`]).
//!
//! Handlers are thin. The proxied routes read the body under the size limit and hand it to
//! [`crate::data_plane::request::route_request`], the same code the fast path uses. Routes that
//! read or change control-plane state run on the control runtime ([`on_control_runtime`]).

pub mod admin;

use std::sync::Arc;

use axum::Router as AxumRouter;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::config::RouterConfig;
use crate::control::gates::readiness_gates;
use crate::control::readiness::{self, ReadinessGate};
use crate::control::router::Router;
use crate::data_plane::forward::{Endpoint, REQUEST_ID_HEADER};
use crate::data_plane::request::{count_request, log_failure, new_request_id, route_request};
use crate::error::ApiError;
use kvroute_http1::client::UpstreamClient;

#[derive(Clone)]
pub struct AppState {
    pub router: Arc<Router>,
    pub gates: Arc<Vec<Arc<dyn ReadinessGate>>>,
    /// The serving thread's own upstream pool (see [`crate::data_plane`]).
    pub upstream: UpstreamClient,
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
    let access = AdminAccess::for_public_listener(&state.router.config);
    let guard = axum::middleware::from_fn_with_state(access, require_admin);
    let control = AxumRouter::new()
        .route("/v1/models", get(models))
        .route(
            "/debug/route",
            post(admin::debug_route).route_layer(guard.clone()),
        )
        .route(
            "/workers",
            get(admin::list_workers).merge(post(admin::add_worker).route_layer(guard.clone())),
        )
        .route(
            "/workers/{id}",
            delete(admin::remove_worker).route_layer(guard),
        )
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
        .fallback(|| async { ApiError::UnknownRoute.into_response() })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed.into_response() })
        .with_state(state)
        .layer(axum::middleware::from_fn(require_host))
}

/// RFC 9112 section 3.2: an HTTP/1.1 request without `Host` is answered 400. hyper does not
/// check it; the hand-written path hands such a request here (`classify_request`), so both
/// servers answer it alike.
async fn require_host(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if request.version() == axum::http::Version::HTTP_11
        && !request.headers().contains_key(axum::http::header::HOST)
    {
        return ApiError::BadRequest("an HTTP/1.1 request needs a Host header".into())
            .into_response();
    }
    next.run(request).await
}

/// The admin API as the internal listener serves it: every admin route, unguarded here (the
/// internal listener puts its own bearer-token check in front of everything it serves).
pub fn internal_admin_app(router: Arc<Router>, upstream: UpstreamClient) -> AxumRouter {
    let state = AppState {
        gates: readiness_gates(&router),
        router,
        upstream,
    };
    AxumRouter::new()
        .route("/debug/route", post(admin::debug_route))
        .route("/workers", get(admin::list_workers).post(admin::add_worker))
        .route("/workers/{id}", delete(admin::remove_worker))
        .route_layer(axum::middleware::from_fn_with_state(
            state.router.control.clone(),
            on_control_runtime,
        ))
        .with_state(state)
}

/// Who may call the admin API's mutating routes (`POST /workers`, `DELETE /workers/{id}`,
/// `POST /debug/route`) on the public listener, decided once at start-up.
///
/// Why these rules: whoever can register a worker receives every user's prompts, and whoever
/// can remove workers can take the service down, so on a listener the world may reach these
/// routes need a credential. A loopback-bound listener (a developer's machine, the tests) is
/// reachable only from the host itself and stays open; the internal listener always serves
/// them, behind its own token.
#[derive(Clone)]
pub enum AdminAccess {
    /// `--admin-auth-token-file`: `Authorization: Bearer <token>` or 401.
    Bearer(Arc<[u8]>),
    /// Loopback listener, or `--allow-unauthenticated-admin`.
    Open,
    /// Non-loopback listener without a token: 403, pointing at the two ways to enable them.
    Refused,
}

impl AdminAccess {
    pub fn for_public_listener(config: &RouterConfig) -> Self {
        match &config.admin_auth_token {
            Some(token) => AdminAccess::Bearer(token.clone()),
            None if config.listen.ip().is_loopback() || config.allow_unauthenticated_admin => {
                AdminAccess::Open
            }
            None => AdminAccess::Refused,
        }
    }
}

async fn require_admin(
    State(access): State<AdminAccess>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match &access {
        AdminAccess::Open => next.run(request).await,
        AdminAccess::Bearer(expected) => {
            let presented = request
                .headers()
                .get(axum::http::header::AUTHORIZATION)
                .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
            if presented.is_some_and(|p| crate::peer::internal::constant_time_eq(p, expected)) {
                next.run(request).await
            } else {
                let mut resp = ApiError::Unauthorized.into_response();
                resp.headers_mut().insert(
                    axum::http::header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer"),
                );
                resp
            }
        }
        AdminAccess::Refused => ApiError::Forbidden(
            "the admin API's mutating routes are not served on a non-loopback public listener \
             without --admin-auth-token-file; use the internal listener, set the token, or start \
             with --allow-unauthenticated-admin"
                .into(),
        )
        .into_response(),
    }
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
        .and_then(|v| kvroute_http1::framing::usable_request_id(v.as_bytes()))
        .map(str::to_string)
        .unwrap_or_else(new_request_id)
}

async fn proxied(s: AppState, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let router = s.router.clone();
    let rid = request_id(&headers);
    let result = async {
        let bytes = read_body(body, &router.config).await?;
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

/// Reads a request body on the hyper path under the body size limit and the body receive
/// deadline, the same two limits the hand-written path applies.
pub async fn read_body(body: Body, config: &RouterConfig) -> Result<bytes::Bytes, ApiError> {
    read_body_limited(
        body,
        config.max_body_bytes,
        config.client_limits.body_timeout_ms,
    )
    .await
}

pub async fn read_body_limited(
    body: Body,
    limit_bytes: usize,
    timeout_ms: u64,
) -> Result<bytes::Bytes, ApiError> {
    let collect = http_body_util::Limited::new(body, limit_bytes).collect();
    let collected = tokio::time::timeout(std::time::Duration::from_millis(timeout_ms), collect)
        .await
        .map_err(|_| ApiError::RequestTimeout {
            what: "request body",
            limit_ms: timeout_ms,
        })?;
    match collected {
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
