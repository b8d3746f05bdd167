//! The admin API: list, add and remove workers, and `/debug/route` (how the router would route a
//! body, without routing it or recording anything).
//!
//! Every handler here runs on the control runtime (registering a worker spawns its KV
//! subscribers). Registration goes through `Router::register`, the same path the static worker
//! list and Kubernetes engine discovery use.

use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{AppState, read_body, read_body_limited};
use crate::config::WorkerSpec;
use crate::control::router::{RegisterError, Router};
use crate::data_plane::forward::Endpoint;
use crate::data_plane::request::{bad, missing, prepare};
use crate::error::ApiError;
use crate::routing::plan::RoutePlan;

/// Largest admin API body.
pub const ADMIN_BODY_MAX_BYTES: usize = 64 * 1024;

fn plan_json(router: &Router, plan: &RoutePlan) -> Value {
    let fleet_matched_blocks = plan
        .candidates
        .iter()
        .map(|c| c.input.matched_blocks)
        .max()
        .unwrap_or(0);
    let ranks: Vec<Value> = plan
        .candidates
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let s = plan.decision.scores[i];
            let worker = plan.worker(c);
            json!({
                "worker_id": worker.id, "url": worker.url, "dp_rank": c.dp_rank,
                "matched_blocks": c.input.matched_blocks, "device_blocks": c.input.device_blocks,
                "pending_blocks": c.input.pending_blocks,
                "index_matched_blocks": c.input.matched_blocks - c.input.pending_blocks,
                "in_flight": c.input.in_flight, "queued_prefill_tokens": c.input.queued_prefill_tokens,
                "engine_load": c.input.engine, "uncached_tokens": s.uncached_tokens,
                "cache_room_tokens": c.input.cache_room_tokens.get(),
                "displaced_tokens": crate::routing::policy::displaced_tokens(
                    &c.input, plan.prompt_tokens, plan.model.block_size,
                    fleet_matched_blocks, s.uncached_tokens,
                ),
                "cost_ms": s.cost_ms, "probability": s.probability,
                "within_load_bound": s.within_load_bound,
                "order": plan.decision.order.iter().position(|&o| o == i),
            })
        })
        .collect();
    let chosen = plan.chosen();
    let chosen_worker = plan.worker(chosen);
    json!({
        "model": plan.model.name, "policy": router.policy.kind.as_str(), "reason": plan.decision.reason,
        "prompt_tokens": plan.prompt_tokens, "block_size": plan.model.block_size, "indexed": plan.indexed,
        "pending_prefix_ttl_ms": router.pending.ttl_ms(),
        "chosen": {"worker_id": chosen_worker.id, "url": chosen_worker.url, "dp_rank": chosen.dp_rank},
        "ranks": ranks,
    })
}

pub(super) async fn debug_route(State(s): State<AppState>, body: Body) -> Response {
    let router = &s.router;
    let result = async {
        let bytes = read_body(body, &router.config).await?;
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
        let plan =
            router.plan_preview_sized(prepared.group, &prepared.tokens, prepared.prompt_tokens)?;
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

fn worker_json(router: &Router, w: &crate::control::registry::Worker) -> Value {
    let now = Instant::now();
    let (health, failures) = {
        let h = w.health.lock();
        (h.label(now), h.consecutive_failures)
    };
    let now_us = crate::control::registry::clock_us();
    let ranks: Vec<Value> = w
        .ranks
        .iter()
        .enumerate()
        .map(|(r, l)| {
            use std::sync::atomic::Ordering::Relaxed;
            json!({"dp_rank": r, "in_flight": l.in_flight.load(Relaxed),
                "queued_prefill_tokens": l.queued_prefill_tokens.load(Relaxed),
                "dispatched_total": l.dispatched_total.load(Relaxed),
                "sibling_in_flight": l.sibling_in_flight.load(Relaxed),
                "sibling_queued_prefill_tokens": l.sibling_queued_prefill_tokens.load(Relaxed),
                "prefill_backlog_us": l.fleet_prefill_backlog_us(now_us),
                "engine_load": crate::control::engine_metrics::engine_load(
                    router, w, r as u32, now_us)})
        })
        .collect();
    json!({"id": w.id, "url": w.url, "model": w.model, "dp_size": w.dp_size, "health": health,
        "consecutive_failures": failures, "kv_source": w.kv_source,
        "kv_attach_error": *w.kv_attach_error.lock(), "ranks": ranks,
        "kv_ranks": router.kv.rank_states(&w.url)})
}

pub(super) async fn list_workers(State(s): State<AppState>) -> Response {
    let workers: Vec<Value> = s
        .router
        .registry
        .workers()
        .iter()
        .map(|w| worker_json(&s.router, w))
        .collect();
    let checks: Vec<Value> = s
        .router
        .predictions
        .states()
        .into_iter()
        .map(|c| {
            json!({"model": c.model, "mismatch": c.mismatch.map(|m| m.label()),
                "window_requests": c.requests, "predicted_cached_tokens": c.predicted_tokens,
                "reported_cached_tokens": c.reported_tokens})
        })
        .collect();
    let load_share = json!({"enabled": s.router.config.load_share.enabled,
        "siblings": s.router.load_share.siblings(s.router.config.load_share.stale_ms),
        "cold_owners_failing": s.router.cold_owner_standings.lock()
            .view(crate::control::registry::clock_us())});
    // How the router sees each model's text: without a tokenizer (or a chat template), its text
    // requests are routed on load alone, which no other field would show.
    let models: Vec<Value> = s
        .router
        .registry
        .models()
        .iter()
        .map(|g| {
            json!({"model": g.name, "block_size": g.block_size, "workers": g.workers.len(),
                "tokenizer": g.tokenizer.is_some(),
                "chat_template": g.tokenizer.as_ref().is_some_and(|t| t.has_chat_template()),
                "prompt_tokens_max": g.prompt_tokens_max.map(|m| m.tokens)})
        })
        .collect();
    axum::Json(json!({"workers": workers, "models": models,
        "registering": s.router.registrations_retrying.list(),
        "prediction_checks": checks, "load_share": load_share}))
    .into_response()
}

pub(super) async fn add_worker(State(s): State<AppState>, body: Body) -> Response {
    let router = &s.router;
    let result = async {
        let bytes = read_body_limited(
            body,
            ADMIN_BODY_MAX_BYTES,
            s.router.config.client_limits.body_timeout_ms,
        )
        .await?;
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

pub(super) async fn remove_worker(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return bad("worker id must be an integer (see GET /workers)").into_response();
    };
    match s.router.deregister(id).await {
        Some(w) => axum::Json(json!({"removed": {"id": w.id, "url": w.url, "model": w.model}}))
            .into_response(),
        None => ApiError::UnknownWorker(id.to_string()).into_response(),
    }
}
