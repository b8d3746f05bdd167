//! The engine's HTTP API, in the shapes SGLang and vLLM serve: OpenAI `/v1/completions` and
//! `/v1/chat/completions` (plain and SSE streaming), SGLang `/generate`, `/v1/models`,
//! `/health`, `/get_load`, `/server_info` (with SGLang's `kv_events` discovery block), vLLM's
//! `/tokenize` and `/v1/chat/completions/render` (routers that tokenize through the engine call
//! them, e.g. vllm-router's cache-aware policies), the simulator's own `/served_stats`
//! (per-rank requests and tokens served, so a benchmark can measure how a router spread load
//! without trusting the router), and the test-only `/control/*` endpoints (mounted only with
//! `--enable-control`; `/control/cache` is the one read-only view of the true caches).
//!
//! Bodies are read as bytes under `--max-body-bytes` and parsed here, not by an extractor, so
//! every failure (oversize, malformed JSON, wrong types, missing fields, bad rank hint) becomes
//! an OpenAI-style error object `{"error": {message, type, param, code}}` with the right status,
//! never an axum plain-text rejection and never a panic. Unknown fields are ignored, as
//! OpenAI-compatible servers do.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::config::{COMPLETION_MAX_TOKENS, PROMPT_MAX_TOKENS};
use crate::engine::{Engine, STORE_CHAINS_MAX};
use crate::tokenizer::ChatMessage;

/// Default completion length when the request names none (OpenAI's legacy default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;
/// Header a router may use to pin the DP rank.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// SSE chunks buffered per streaming response before decode waits for the client.
const STREAM_CHUNKS_MAX: usize = 64;

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

fn body_error(rejection: BytesRejection) -> ApiError {
    let status = rejection.status();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "request body exceeds the server's --max-body-bytes limit".to_string()
    } else {
        rejection.body_text()
    };
    ApiError {
        status,
        message,
        kind: "invalid_request_error",
        param: None,
    }
}

fn parse_json<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(body_error)?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}"), None))
}

pub fn router(engine: Arc<Engine>) -> Router {
    let limit = engine.cfg.max_body_bytes;
    let mut app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/tokenize", post(tokenize))
        .route("/served_stats", get(served_stats))
        .route("/generate", post(generate))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/health_generate", get(health))
        .route("/get_load", get(get_load))
        .route("/metrics", get(prometheus_metrics));
    if !engine.cfg.no_server_info {
        app = app
            .route("/server_info", get(server_info))
            .route("/get_server_info", get(server_info));
    }
    if engine.cfg.enable_control {
        app = app
            .route("/control/store", post(control_store))
            .route("/control/last_seq", get(control_last_seq))
            .route("/control/cache", get(control_cache))
            .route("/control/flush", post(control_flush))
            .route("/control/drop_next", post(control_drop_next))
            .route("/control/stall", post(control_stall))
            .route(
                "/control/restart_publisher",
                post(control_restart_publisher),
            );
    }
    app.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(engine)
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint".into(),
        kind: "not_found_error",
        param: None,
    }
}

async fn method_not_allowed() -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: "method not allowed on this endpoint".into(),
        kind: "invalid_request_error",
        param: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Request shapes

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Option<PromptInput>,
    max_tokens: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    data_parallel_rank: Option<i64>,
    routed_dp_rank: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ChatContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ChatMessageIn {
    role: String,
    content: Option<ChatContent>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Option<Vec<ChatMessageIn>>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    data_parallel_rank: Option<i64>,
    routed_dp_rank: Option<i64>,
}

/// vLLM's `/tokenize`: either a completion-style `prompt` or chat `messages`.
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    prompt: Option<String>,
    messages: Option<Vec<ChatMessageIn>>,
    add_generation_prompt: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TextInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum IdsInput {
    One(Vec<u32>),
    Many(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct SamplingParams {
    max_new_tokens: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct GenerateRequest {
    text: Option<TextInput>,
    input_ids: Option<IdsInput>,
    sampling_params: Option<SamplingParams>,
    stream: Option<bool>,
    data_parallel_rank: Option<i64>,
    routed_dp_rank: Option<i64>,
}

// ---------------------------------------------------------------------------------------------
// Shared request handling

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
    Generate,
}

impl Kind {
    /// The prefix of response ids, as the engines shape them (`cmpl-`, `chatcmpl-`).
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
            Kind::Generate => "gen",
        }
    }
}

struct Job {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    tokens: Vec<u32>,
    max_tokens: usize,
    rank: usize,
    include_usage: bool,
}

impl Job {
    /// A job for an already validated request: a fresh id, the requested model (else the
    /// served one) and a rank picked now, so the least-loaded choice sees the current load.
    fn new(
        engine: &Engine,
        kind: Kind,
        model: Option<String>,
        rank_hint: Option<usize>,
        tokens: Vec<u32>,
        max_tokens: usize,
        include_usage: bool,
    ) -> Job {
        Job {
            kind,
            id: format!(
                "{}-e{}-{}",
                kind.id_prefix(),
                engine.index,
                engine.next_request_id()
            ),
            created: unix_now(),
            model: model.unwrap_or_else(|| engine.cfg.served_model_name.clone()),
            rank: engine.pick_rank(rank_hint),
            tokens,
            max_tokens,
            include_usage,
        }
    }
}

/// OpenAI's `stream_options.include_usage`, off unless asked for.
fn wants_usage(stream_options: Option<StreamOptions>) -> bool {
    stream_options
        .and_then(|o| o.include_usage)
        .unwrap_or(false)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The DP rank hint: body `data_parallel_rank` / `routed_dp_rank`, else the header.
fn rank_hint(
    engine: &Engine,
    body_hints: [Option<i64>; 2],
    headers: &HeaderMap,
) -> Result<Option<usize>, ApiError> {
    let from_header = match headers.get(DP_RANK_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request(
                        format!("{DP_RANK_HEADER} must be an integer"),
                        Some("data_parallel_rank"),
                    )
                })?,
        ),
    };
    let Some(rank) = body_hints[0].or(body_hints[1]).or(from_header) else {
        return Ok(None);
    };
    if rank < 0 || rank as usize >= engine.dp_size() {
        return Err(ApiError::bad_request(
            format!(
                "data_parallel_rank {rank} out of range (dp_size {})",
                engine.dp_size()
            ),
            Some("data_parallel_rank"),
        ));
    }
    Ok(Some(rank as usize))
}

fn check_max_tokens(n: Option<u32>, param: &'static str) -> Result<usize, ApiError> {
    let n = n.unwrap_or(DEFAULT_MAX_TOKENS);
    if n > COMPLETION_MAX_TOKENS {
        return Err(ApiError::bad_request(
            format!("{param} {n} exceeds the limit of {COMPLETION_MAX_TOKENS}"),
            Some(param),
        ));
    }
    Ok(n as usize)
}

fn check_prompt(tokens: Vec<u32>, param: &'static str) -> Result<Vec<u32>, ApiError> {
    if tokens.is_empty() {
        return Err(ApiError::bad_request(
            format!("{param} is empty"),
            Some(param),
        ));
    }
    if tokens.len() > PROMPT_MAX_TOKENS {
        return Err(ApiError::bad_request(
            format!(
                "{param} has {} tokens, more than the limit of {PROMPT_MAX_TOKENS}",
                tokens.len()
            ),
            Some(param),
        ));
    }
    Ok(tokens)
}

fn encode_text(engine: &Engine, text: &str, param: &'static str) -> Result<Vec<u32>, ApiError> {
    check_text_len(text, param)?;
    engine
        .text
        .encode(text)
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize {param}: {e}"), Some(param)))
}

/// A rendered chat's tokens, its earlier messages remembered (`TextModel::encode_chat`).
fn encode_rendered_chat(engine: &Engine, rendered: &str) -> Result<Vec<u32>, ApiError> {
    check_text_len(rendered, "messages")?;
    engine.text.encode_chat(rendered).map_err(|e| {
        ApiError::bad_request(format!("cannot tokenize messages: {e}"), Some("messages"))
    })
}

/// Cheap pre-check so a huge text is refused before tokenizing it (a token is >= 1 byte in a
/// byte-level BPE only loosely, so allow generous headroom).
fn check_text_len(text: &str, param: &'static str) -> Result<(), ApiError> {
    if text.len() > PROMPT_MAX_TOKENS * 16 {
        return Err(ApiError::bad_request(
            format!("{param} is too long"),
            Some(param),
        ));
    }
    Ok(())
}

/// The first prompt of a batch of token-id lists: the simulator serves a batch's first element
/// only (documented); an empty batch is an empty prompt, which `check_prompt` then refuses.
fn first_ids(mut batch: Vec<Vec<u32>>) -> Vec<u32> {
    if batch.is_empty() {
        Vec::new()
    } else {
        batch.swap_remove(0)
    }
}

/// The tokens of the first prompt of a batch of texts (see `first_ids`).
fn first_text_tokens(
    engine: &Engine,
    batch: &[String],
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    match batch.first() {
        Some(t) => encode_text(engine, t, param),
        None => Ok(Vec::new()),
    }
}

fn usage(job: &Job, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": job.tokens.len(),
        "completion_tokens": completion_tokens,
        "total_tokens": job.tokens.len() + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// Runs a job to completion (non-streaming): prefill, then the whole decode time, then reply.
async fn run_blocking(engine: Arc<Engine>, job: Job) -> Response {
    let started = std::time::Instant::now();
    let pre = engine.prefill(job.rank, &job.tokens).await;
    let pieces = engine.text.complete(&job.tokens, job.max_tokens);
    if let Some(d) = engine.delay(engine.cfg.decode_us_per_token * pieces.len() as u64) {
        tokio::time::sleep(d).await;
    }
    drop(pre.slot);
    let text: String = pieces.iter().map(|(_, t)| *t).collect();
    let n = pieces.len();
    let body = match job.kind {
        Kind::Completion => json!({
            "id": job.id, "object": "text_completion", "created": job.created,
            "model": job.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
            "usage": usage(&job, n, pre.cached_tokens),
        }),
        Kind::Chat => json!({
            "id": job.id, "object": "chat.completion", "created": job.created,
            "model": job.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": "length"}],
            "usage": usage(&job, n, pre.cached_tokens),
        }),
        Kind::Generate => json!({
            "text": text,
            "output_ids": pieces.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            "meta_info": generate_meta(&job, n, pre.cached_tokens, pre.rank, started, true),
        }),
    };
    axum::Json(body).into_response()
}

fn generate_meta(
    job: &Job,
    completion_tokens: usize,
    cached_tokens: usize,
    rank: usize,
    started: std::time::Instant,
    finished: bool,
) -> Value {
    json!({
        "id": job.id,
        "finish_reason": if finished {
            json!({"type": "length", "length": completion_tokens})
        } else {
            Value::Null
        },
        "prompt_tokens": job.tokens.len(),
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "dp_rank": rank,
        "e2e_latency": started.elapsed().as_secs_f64(),
    })
}

/// Runs a job as an SSE stream: a task produces chunks at decode pace; if the client goes
/// away the channel closes, the task stops and its running slot is released.
fn run_streaming(engine: Arc<Engine>, job: Job) -> Response {
    let (tx, rx) = mpsc::channel::<String>(STREAM_CHUNKS_MAX);
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let pre = engine.prefill(job.rank, &job.tokens).await;
        let pieces = engine.text.complete(&job.tokens, job.max_tokens);
        let n = pieces.len();
        if job.kind == Kind::Chat {
            let first = json!({
                "id": job.id, "object": "chat.completion.chunk", "created": job.created,
                "model": job.model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": null, "finish_reason": null}],
            });
            if tx.send(first.to_string()).await.is_err() {
                return;
            }
        }
        let mut text = String::new();
        let mut ids = Vec::with_capacity(n);
        // With no tokens to generate, one final empty chunk still carries the finish reason.
        let steps: Vec<Option<(u32, &str)>> = if n == 0 {
            vec![None]
        } else {
            pieces.iter().copied().map(Some).collect()
        };
        let last = steps.len() - 1;
        for (i, step) in steps.into_iter().enumerate() {
            if step.is_some()
                && let Some(d) = engine.delay(engine.cfg.decode_us_per_token)
            {
                tokio::time::sleep(d).await;
            }
            let (piece_id, piece) = step.unwrap_or((0, ""));
            if step.is_some() {
                text.push_str(piece);
                ids.push(piece_id);
            }
            let finish = if i == last {
                json!("length")
            } else {
                Value::Null
            };
            let chunk = match job.kind {
                Kind::Completion => json!({
                    "id": job.id, "object": "text_completion", "created": job.created,
                    "model": job.model,
                    "choices": [{"index": 0, "text": piece, "logprobs": null,
                                 "finish_reason": finish}],
                }),
                Kind::Chat => json!({
                    "id": job.id, "object": "chat.completion.chunk", "created": job.created,
                    "model": job.model,
                    "choices": [{"index": 0,
                                 "delta": if step.is_some() { json!({"content": piece}) } else { json!({}) },
                                 "logprobs": null, "finish_reason": finish}],
                }),
                // SGLang streams the cumulative text and output ids.
                Kind::Generate => json!({
                    "text": text, "output_ids": ids,
                    "meta_info": generate_meta(&job, ids.len(), pre.cached_tokens, pre.rank,
                                               started, i == last),
                }),
            };
            if tx.send(chunk.to_string()).await.is_err() {
                return;
            }
            if i == 0
                && let Some(stall) = engine.faults.take_body()
            {
                tokio::time::sleep(stall).await;
            }
        }
        drop(pre.slot);
        if job.include_usage && job.kind != Kind::Generate {
            let object = if job.kind == Kind::Chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let chunk = json!({
                "id": job.id, "object": object, "created": job.created, "model": job.model,
                "choices": [], "usage": usage(&job, n, pre.cached_tokens),
            });
            if tx.send(chunk.to_string()).await.is_err() {
                return;
            }
        }
        let _ = tx.send("[DONE]".to_string()).await;
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|data| (Ok::<_, Infallible>(Event::default().data(data)), rx))
    });
    Sse::new(stream).into_response()
}

async fn dispatch(engine: Arc<Engine>, job: Job, stream: bool) -> Response {
    if let Some(stall) = engine.faults.take_head() {
        tokio::time::sleep(stall).await;
    }
    if stream {
        run_streaming(engine, job)
    } else {
        run_blocking(engine, job).await
    }
}

// ---------------------------------------------------------------------------------------------
// Handlers

async fn completions(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    let rank = rank_hint(
        &engine,
        [req.data_parallel_rank, req.routed_dp_rank],
        &headers,
    )?;
    let max_tokens = check_max_tokens(req.max_tokens, "max_tokens")?;
    // A list prompt is a batch; the simulator serves its first element only (documented).
    let tokens = match req.prompt {
        None => return Err(ApiError::bad_request("prompt is required", Some("prompt"))),
        Some(PromptInput::Text(t)) => encode_text(&engine, &t, "prompt")?,
        Some(PromptInput::Ids(ids)) => ids,
        Some(PromptInput::Texts(ts)) => first_text_tokens(&engine, &ts, "prompt")?,
        Some(PromptInput::IdLists(ls)) => first_ids(ls),
    };
    let tokens = check_prompt(tokens, "prompt")?;
    let job = Job::new(
        &engine,
        Kind::Completion,
        req.model,
        rank,
        tokens,
        max_tokens,
        wants_usage(req.stream_options),
    );
    Ok(dispatch(engine, job, req.stream.unwrap_or(false)).await)
}

async fn chat_completions(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_json(body)?;
    let rank = rank_hint(
        &engine,
        [req.data_parallel_rank, req.routed_dp_rank],
        &headers,
    )?;
    let max_tokens = check_max_tokens(req.max_completion_tokens.or(req.max_tokens), "max_tokens")?;
    let tokens = chat_tokens(&engine, req.messages, true)?;
    let job = Job::new(
        &engine,
        Kind::Chat,
        req.model,
        rank,
        tokens,
        max_tokens,
        wants_usage(req.stream_options),
    );
    Ok(dispatch(engine, job, req.stream.unwrap_or(false)).await)
}

/// The prompt tokens of a chat request: the chat template rendered (with the assistant header
/// when `add_generation_prompt`) and tokenized, exactly as the chat endpoint prefills them, so
/// `/tokenize` and `/v1/chat/completions/render` agree with what the engine caches.
fn chat_tokens(
    engine: &Engine,
    messages: Option<Vec<ChatMessageIn>>,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let messages = match messages {
        Some(m) if !m.is_empty() => m,
        _ => {
            return Err(ApiError::bad_request(
                "messages is required and must not be empty",
                Some("messages"),
            ));
        }
    };
    let messages: Vec<ChatMessage> = messages
        .into_iter()
        .map(|m| ChatMessage {
            role: m.role,
            content: match m.content {
                None => String::new(),
                Some(ChatContent::Text(t)) => t,
                // Non-text parts (images ...) carry nothing the simulator can tokenize.
                Some(ChatContent::Parts(parts)) => parts
                    .into_iter()
                    .filter(|p| p.kind == "text")
                    .filter_map(|p| p.text)
                    .collect::<Vec<_>>()
                    .join(""),
            },
        })
        .collect();
    let rendered = engine
        .text
        .render_chat_with(&messages, add_generation_prompt)
        .map_err(|e| ApiError::bad_request(format!("chat template: {e}"), Some("messages")))?;
    check_prompt(encode_rendered_chat(engine, &rendered)?, "messages")
}

/// vLLM's `/tokenize`: `{"count", "max_model_len", "tokens"}` for a `prompt` string or chat
/// `messages` (exactly one of them).
async fn tokenize(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: TokenizeRequest = parse_json(body)?;
    let tokens = match (req.prompt, req.messages) {
        (Some(prompt), None) => check_prompt(encode_text(&engine, &prompt, "prompt")?, "prompt")?,
        (None, Some(messages)) => chat_tokens(
            &engine,
            Some(messages),
            req.add_generation_prompt.unwrap_or(true),
        )?,
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "give either prompt or messages, not both",
                Some("prompt"),
            ));
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "either prompt or messages is required",
                Some("prompt"),
            ));
        }
    };
    Ok(axum::Json(json!({
        "count": tokens.len(),
        "max_model_len": PROMPT_MAX_TOKENS,
        "tokens": tokens,
    })))
}

/// vLLM's `/v1/chat/completions/render`: the chat request's prompt token ids, without running
/// it. Only `token_ids` (and `model`) are modelled; the simulator has no multimodal features.
async fn render_chat(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: ChatRequest = parse_json(body)?;
    let tokens = chat_tokens(&engine, req.messages, true)?;
    Ok(axum::Json(json!({
        "model": req.model.unwrap_or_else(|| engine.cfg.served_model_name.clone()),
        "token_ids": tokens,
        "features": null,
    })))
}

/// Per-rank requests prefilled and their prompt / cached tokens since start.
async fn served_stats(State(engine): State<Arc<Engine>>) -> axum::Json<Value> {
    let ranks: Vec<Value> = (0..engine.dp_size())
        .map(|r| {
            let s = engine.served_stat(r);
            json!({
                "dp_rank": r,
                "requests": s.requests,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
            })
        })
        .collect();
    axum::Json(json!({"engine": engine.index, "ranks": ranks, "faults": engine.faults.counts()}))
}

async fn generate(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: GenerateRequest = parse_json(body)?;
    let rank = rank_hint(
        &engine,
        [req.data_parallel_rank, req.routed_dp_rank],
        &headers,
    )?;
    let max_tokens = check_max_tokens(
        req.sampling_params.and_then(|s| s.max_new_tokens),
        "max_new_tokens",
    )?;
    let tokens = match (req.input_ids, req.text) {
        (Some(IdsInput::One(ids)), _) => ids,
        (Some(IdsInput::Many(ls)), _) => first_ids(ls),
        (None, Some(TextInput::One(t))) => encode_text(&engine, &t, "text")?,
        (None, Some(TextInput::Many(ts))) => first_text_tokens(&engine, &ts, "text")?,
        (None, None) => {
            return Err(ApiError::bad_request(
                "either text or input_ids is required",
                Some("text"),
            ));
        }
    };
    let tokens = check_prompt(tokens, "text")?;
    // SGLang's `/generate` names no model and has no usage chunk.
    let job = Job::new(
        &engine,
        Kind::Generate,
        None,
        rank,
        tokens,
        max_tokens,
        false,
    );
    Ok(dispatch(engine, job, req.stream.unwrap_or(false)).await)
}

async fn models(State(engine): State<Arc<Engine>>) -> axum::Json<Value> {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": engine.cfg.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvroute-sim",
            "root": engine.cfg.served_model_name,
            "max_model_len": PROMPT_MAX_TOKENS,
        }],
    }))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

/// The engine's Prometheus `/metrics`, its scheduler gauges only, named as the engine the
/// simulator speaks for names them: vLLM (V1) labels each data-parallel engine core
/// `engine="N"`; SGLang names its gauges `sglang:num_running_reqs` / `sglang:num_queue_reqs`
/// with a `dp_rank` label. A router that reads vLLM's load from here must find nothing it
/// recognises on an SGLang engine.
async fn prometheus_metrics(State(engine): State<Arc<Engine>>) -> Response {
    use std::fmt::Write;
    let vllm = !matches!(engine.cfg.encoding(), kvroute_wire::Encoding::Sglang);
    let model = &engine.cfg.served_model_name;
    let (running, waiting, rank_label) = if vllm {
        (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "engine",
        )
    } else {
        (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "dp_rank",
        )
    };
    let mut text = String::new();
    for (name, help, is_running) in [
        (running, "Requests running.", true),
        (waiting, "Requests waiting.", false),
    ] {
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} gauge");
        for r in 0..engine.dp_size() {
            let s = engine.load_stat(r);
            let value = if is_running {
                s.num_running_reqs
            } else {
                s.num_waiting_reqs
            };
            let _ = writeln!(
                text,
                "{name}{{{rank_label}=\"{r}\",model_name=\"{model}\"}} {value}.0"
            );
        }
    }
    if vllm {
        // vLLM's cache configuration as an info gauge, one series per engine core.
        let name = "vllm:cache_config_info";
        let _ = writeln!(
            text,
            "# HELP {name} Information of the LLMEngine CacheConfig\n# TYPE {name} gauge"
        );
        let bs = engine.cfg.block_size;
        for r in 0..engine.dp_size() {
            let blocks = engine.load_stat(r).max_total_num_tokens / bs as u64;
            let _ = writeln!(
                text,
                "{name}{{block_size=\"{bs}\",engine=\"{r}\",model_name=\"{model}\",num_gpu_blocks=\"{blocks}\"}} 1.0"
            );
        }
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// SGLang's `/get_load`: per-rank running and waiting requests and cached tokens.
async fn get_load(State(engine): State<Arc<Engine>>) -> axum::Json<Value> {
    let ranks: Vec<Value> = (0..engine.dp_size())
        .map(|r| {
            let s = engine.load_stat(r);
            json!({
                "dp_rank": r,
                "num_reqs": s.num_running_reqs,
                "num_waiting_reqs": s.num_waiting_reqs,
                "num_tokens": s.num_tokens,
                "max_total_num_tokens": s.max_total_num_tokens,
            })
        })
        .collect();
    axum::Json(Value::Array(ranks))
}

/// SGLang's `/server_info`, including the `kv_events` block routers discover publishers from.
pub fn server_info_json(engine: &Engine) -> Value {
    let cfg = &engine.cfg;
    let ports = *engine.ports.lock();
    let mut kv = json!({
        "publisher": "zmq",
        "endpoint_host": cfg.host,
        "endpoint_port_base": ports.kv_base,
        "topic": cfg.topic,
        "block_size": cfg.block_size,
        "dp_size": engine.dp_size(),
        "replay_endpoint_port_base": ports.replay_base,
        "replay_buffer_steps": cfg.replay_buffer_batches,
    });
    if let Some(load) = ports.load_base {
        kv["load_endpoint_port_base"] = json!(load);
        kv["load_topic"] = json!(crate::publish::LOAD_TOPIC);
    }
    json!({
        "served_model_name": cfg.served_model_name,
        "model_path": cfg.served_model_name,
        "tokenizer_path": cfg.tokenizer_path,
        "version": concat!("kvroute-sim ", env!("CARGO_PKG_VERSION")),
        "dp_size": engine.dp_size(),
        "page_size": cfg.block_size,
        "max_running_requests": cfg.max_running,
        "max_total_num_tokens": cfg.capacity_blocks * cfg.block_size,
        "speculative_algorithm": null,
        "kv_events": kv,
        "kv_encoding": format!("{:?}", cfg.encoding()),
    })
}

async fn server_info(State(engine): State<Arc<Engine>>) -> axum::Json<Value> {
    axum::Json(server_info_json(&engine))
}

// ---------------------------------------------------------------------------------------------
// Test-only control endpoints

fn control_rank(engine: &Engine, rank: Option<usize>) -> Result<usize, ApiError> {
    let rank = rank.unwrap_or(0);
    if rank >= engine.dp_size() {
        return Err(ApiError::bad_request(
            format!("dp_rank {rank} out of range"),
            Some("dp_rank"),
        ));
    }
    Ok(rank)
}

/// Control bodies may be empty (`{}` implied).
fn parse_control<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    match body {
        Ok(b) if b.iter().all(|c| c.is_ascii_whitespace()) => {
            parse_json(Ok(Bytes::from_static(b"{}")))
        }
        other => parse_json(other),
    }
}

#[derive(Debug, Deserialize)]
struct StoreBody {
    chains: Vec<Vec<u32>>,
    dp_rank: Option<usize>,
}

async fn control_store(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: StoreBody = parse_control(body)?;
    let rank = control_rank(&engine, req.dp_rank)?;
    if req.chains.len() > STORE_CHAINS_MAX || req.chains.iter().any(|c| c.len() > PROMPT_MAX_TOKENS)
    {
        return Err(ApiError::bad_request(
            format!("at most {STORE_CHAINS_MAX} chains of {PROMPT_MAX_TOKENS} tokens"),
            Some("chains"),
        ));
    }
    let last_seq = engine.store_chains(rank, &req.chains);
    Ok(axum::Json(json!({"last_seq": last_seq})))
}

async fn control_last_seq(State(engine): State<Arc<Engine>>) -> axum::Json<Value> {
    let seqs: Vec<i64> = (0..engine.dp_size()).map(|r| engine.last_seq(r)).collect();
    axum::Json(json!({"last_seq": seqs}))
}

/// The engine's true caches, read-only: per rank, its last published seq and every cached block
/// (hashes as 16-digit hex, like the router's JSON snapshot), read under the rank's lock so the
/// blocks are exactly the effect of batches `0..=last_seq`. A test compares a router's index
/// with this, so it never has to trust the router to say what the engine holds.
async fn control_cache(State(engine): State<Arc<Engine>>) -> axum::Json<Value> {
    let hex = |h: u64| format!("{h:016x}");
    let ranks: Vec<Value> = (0..engine.dp_size())
        .map(|r| {
            let st = engine.ranks[r].state.lock();
            let blocks: Vec<Value> = st
                .cache
                .blocks()
                .map(|(key, parent, engine_hash, device, host)| {
                    json!({
                        "hash": hex(key),
                        "parent": parent.map(hex),
                        "engine_hash": hex(engine_hash),
                        "device": device,
                        "host": host,
                    })
                })
                .collect();
            json!({"dp_rank": r, "last_seq": st.publisher.last_seq(), "blocks": blocks})
        })
        .collect();
    axum::Json(json!({
        "block_size": engine.cfg.block_size,
        "ranks": ranks,
    }))
}

#[derive(Debug, Deserialize)]
struct RankBody {
    dp_rank: Option<usize>,
}

async fn control_flush(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: RankBody = parse_control(body)?;
    // Without a rank, flush them all (SGLang's /flush_cache clears the whole engine).
    let ranks: Vec<usize> = match req.dp_rank {
        Some(r) => vec![control_rank(&engine, Some(r))?],
        None => (0..engine.dp_size()).collect(),
    };
    for &r in &ranks {
        engine.flush(r);
    }
    let seqs: Vec<i64> = (0..engine.dp_size()).map(|r| engine.last_seq(r)).collect();
    Ok(axum::Json(json!({"last_seq": seqs})))
}

#[derive(Debug, Deserialize)]
struct DropNextBody {
    dp_rank: Option<usize>,
    batches: u64,
}

async fn control_drop_next(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: DropNextBody = parse_control(body)?;
    let rank = control_rank(&engine, req.dp_rank)?;
    engine.drop_next(rank, req.batches);
    Ok(axum::Json(json!({"dp_rank": rank, "batches": req.batches})))
}

#[derive(Debug, Deserialize)]
struct StallBody {
    at: crate::faults::StallAt,
    requests: u64,
    stall_ms: u64,
}

/// Arms `requests` stalls of `stall_ms` (see [`crate::faults`]).
async fn control_stall(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: StallBody = parse_control(body)?;
    engine.faults.arm(req.at, req.requests, req.stall_ms);
    Ok(axum::Json(json!({"faults": engine.faults.counts()})))
}

async fn control_restart_publisher(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: RankBody = parse_control(body)?;
    let rank = control_rank(&engine, req.dp_rank)?;
    engine.restart_publisher(rank);
    Ok(axum::Json(
        json!({"dp_rank": rank, "last_seq": engine.last_seq(rank)}),
    ))
}
