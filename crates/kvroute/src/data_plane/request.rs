//! One proxied request, from its body to the engine's answer, shared by both servers (the
//! hand-written connection server and the hyper fallback): prepare (parse, tokenize), plan
//! (routing), record the decision, forward.
//!
//! Preparation turns the JSON body into a [`Prepared`] request: the model group, the tokens to
//! hash, and the body to forward (rewritten to carry token ids where the engine API accepts
//! them). A token-id body is read by [`crate::data_plane::token_ids`] without materialising it;
//! everything else goes through serde, which also writes every error message. Every error leaves
//! through `ApiError`, so clients always get the OpenAI error shape and a status from one table.

use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{Map, Value};

use crate::config::PREPARE_BUDGET_WAIT_MS_MAX;
use crate::control::registry::ModelGroup;
use crate::control::router::Router;
use crate::data_plane::forward::{self, Endpoint, Forward};
use crate::error::ApiError;
use crate::routing::tokenize::{ModelTokenizer, Untokenized};
use kvroute_http1::client::UpstreamClient;

/// Bodies up to this size are prepared (parsed, tokenized) on the async worker; larger ones on
/// the blocking pool, so tokenizing a huge prompt cannot stall other connections.
pub const INLINE_PREPARE_MAX_BYTES: usize = 32 * 1024;

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
) -> Result<forward::Routed, ApiError> {
    let prepared = if bytes.len() <= INLINE_PREPARE_MAX_BYTES {
        prepare(router, endpoint, &bytes)?
    } else {
        // Charged what it can make the tokenizer hold: its text, at most the tokenizing cap.
        let charge = bytes.len().min(router.config.tokenize_text_bytes_max);
        let budget = tokio::time::timeout(
            std::time::Duration::from_millis(PREPARE_BUDGET_WAIT_MS_MAX),
            router
                .prepare_budget
                .clone()
                .acquire_many_owned(u32::try_from(charge).unwrap_or(u32::MAX)),
        )
        .await
        .map_err(|_| ApiError::PrepareBusy)?
        .map_err(|_| ApiError::PrepareBusy)?;
        let (r, b) = (router.clone(), bytes.clone());
        // The permit travels with the work: a client that goes away drops this future, not the
        // tokenizing, which must stay counted until it ends.
        tokio::task::spawn_blocking(move || {
            let prepared = prepare(&r, endpoint, &b);
            drop(budget);
            prepared
        })
        .await
        .map_err(|e| ApiError::Internal(format!("request preparation failed: {e}")))??
    };
    let Prepared {
        group,
        tokens,
        prompt_tokens,
        head_completion,
        body,
        rewritten,
        untokenized,
    } = prepared;
    let mut plan = router.plan_sized(group, &tokens, prompt_tokens)?;
    if let Some(deferral) = &plan.cold_deferral {
        // A cold prompt another replica owns: its placement, or ours past the timeout.
        let asked = std::time::Instant::now();
        let placement = crate::peer::cold_owner::ask_owner(
            router,
            &deferral.owner,
            &plan.model.name,
            &tokens,
            prompt_tokens,
        )
        .await;
        let waited = asked.elapsed();
        router
            .metrics
            .cold_placement_wait
            .observe(waited.as_secs_f64());
        if let Err(e) = &placement {
            tracing::debug!(owner = %deferral.owner, error = %e, "cold placement not used");
        }
        router.settle_cold(&mut plan, placement.as_ref().ok(), waited);
    }
    if let Some(completion) = head_completion {
        // Now that the rank is chosen: the rest of the chat is tokenized aside, and its blocks
        // become pending there.
        let (r, model, chosen) = (router.clone(), plan.model.clone(), plan.chosen().clone());
        completion.start(move |whole| r.extend_pending(&model, &chosen, whole));
    }
    // The ids are not needed past planning, and a maximal body's ids take twice its size: they
    // are freed before the forward, which can take as long as the engine does.
    drop(tokens);
    router.record_decision(&plan);
    forward::forward(
        router,
        Forward {
            endpoint,
            original: (!rewritten).then_some(bytes),
            body,
            request_id,
            plan: &plan,
            upstream,
            untokenized,
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

/// A request ready to route: its model group, the tokens to hash, the body to forward.
pub struct Prepared {
    pub group: Arc<ModelGroup>,
    /// The prompt's tokens, or its first ones when a chat was tokenized only in its head (see
    /// `prompt_tokens`).
    pub tokens: Vec<u32>,
    /// The prompt's length in tokens: `tokens.len()`, or an estimate when `tokens` is a head.
    pub prompt_tokens: usize,
    /// The rest of a chat routed on its head, to tokenize aside once it is routed (dropped
    /// unstarted, it only releases its budget).
    pub head_completion: Option<HeadCompletion>,
    /// `None` when the body was never materialised (token-id fast path): it is then exactly the
    /// client's bytes, and the proxy parses them only if it must add a field.
    pub body: Option<Map<String, Value>>,
    /// True when `body` differs from the client's bytes (text replaced by token ids).
    pub rewritten: bool,
    /// Set when a text prompt or chat is routed on load without its tokens, and why.
    pub untokenized: Option<Untokenized>,
}

/// A chat routed on its head, whose rest is to be tokenized aside
/// (`ModelTokenizer::complete_aside`), holding its share of the prepare budget until then.
pub struct HeadCompletion {
    tokenizer: Arc<ModelTokenizer>,
    messages: Vec<Value>,
    head: Vec<u32>,
    budget: tokio::sync::OwnedSemaphorePermit,
}

impl HeadCompletion {
    /// Tokenizes the rest aside; `then` receives the whole chat's tokens.
    pub fn start(self, then: impl FnOnce(&[u32]) + Send + 'static) {
        self.tokenizer
            .complete_aside(self.messages, self.head, self.budget, then);
    }
}

/// Tokens and model of a body the generic path would route on its token ids unchanged, or `None`
/// to take the generic path (which also produces every error message). The reader
/// ([`crate::data_plane::token_ids`]) accepts a strict subset of what the generic path accepts.
fn token_ids_fast_path(endpoint: Endpoint, bytes: &[u8]) -> Option<(Option<String>, Vec<u32>)> {
    let ids_key = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Generate => "input_ids",
        Endpoint::ChatCompletions => return None,
    };
    let body = crate::data_plane::token_ids::read_token_ids_body(bytes, ids_key)?;
    Some((body.model, body.tokens))
}

fn token_array(v: &Value) -> Option<Vec<u32>> {
    let arr = v.as_array()?;
    arr.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

pub(crate) fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

pub(crate) fn missing(field: &str, msg: &str) -> ApiError {
    ApiError::MissingField {
        message: msg.to_string(),
        param: field.to_string(),
    }
}

/// Refuses a prompt longer than the model group's limit (see `ModelGroup::prompt_tokens_max`):
/// no engine of the group could serve it, so it is neither routed nor forwarded.
fn check_prompt_length(group: &ModelGroup, tokens: &[u32]) -> Result<(), ApiError> {
    match group.prompt_tokens_max {
        Some(max) if tokens.len() > max.tokens => Err(ApiError::PromptTooLong {
            tokens: tokens.len(),
            limit: max.tokens,
            limit_source: max.source,
        }),
        _ => Ok(()),
    }
}

/// Whether the router tokenizes a prompt text of `text_bytes` bytes: `Ok(true)` to tokenize,
/// `Ok(false)` to route it on load and forward it untouched (past `--tokenize-text-bytes-max`:
/// [`Untokenized::TextTooLong`]), or the refusal when its length alone proves it longer than
/// the model's limit (see [`crate::routing::text_bound`]), which spares tokenizing it at all.
fn admit_text(
    router: &Router,
    group: &ModelGroup,
    tokenizer: &ModelTokenizer,
    text_bytes: usize,
) -> Result<bool, ApiError> {
    if let (Some(max), Some(per_token)) = (
        group.prompt_tokens_max,
        tokenizer.text_bytes_per_token_max(),
    ) {
        let tokens_at_least = crate::routing::text_bound::tokens_at_least(text_bytes, per_token);
        if tokens_at_least > max.tokens {
            return Err(ApiError::PromptTextTooLong {
                text_bytes,
                tokens_at_least,
                limit: max.tokens,
                limit_source: max.source,
            });
        }
    }
    Ok(within_tokenize_cap(router, text_bytes))
}

/// True when text of `text_bytes` bytes is within `--tokenize-text-bytes-max`.
fn within_tokenize_cap(router: &Router, text_bytes: usize) -> bool {
    text_bytes <= router.config.tokenize_text_bytes_max
}

/// Runs one tokenization and records its time in `kvroute_tokenize_seconds{kind}`.
fn timed_tokenize<T>(router: &Router, kind: &str, tokenize: impl FnOnce() -> T) -> T {
    let started = std::time::Instant::now();
    let tokens = tokenize();
    router
        .metrics
        .tokenize_latency
        .with_label_values(&[kind])
        .observe(started.elapsed().as_secs_f64());
    tokens
}

pub fn prepare(router: &Router, endpoint: Endpoint, bytes: &[u8]) -> Result<Prepared, ApiError> {
    let prepared = prepare_unchecked(router, endpoint, bytes)?;
    check_prompt_length(&prepared.group, &prepared.tokens)?;
    Ok(prepared)
}

fn prepare_unchecked(
    router: &Router,
    endpoint: Endpoint,
    bytes: &[u8],
) -> Result<Prepared, ApiError> {
    if let Some((model, tokens)) = token_ids_fast_path(endpoint, bytes) {
        let group = router.resolve_model(model.as_deref())?;
        return Ok(Prepared {
            group,
            prompt_tokens: tokens.len(),
            head_completion: None,
            tokens,
            body: None,
            rewritten: false,
            untokenized: None,
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
    let mut head_prompt_tokens = None;
    let mut head_completion = None;
    let mut untokenized = None;
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
                None => {
                    untokenized = Some(Untokenized::NoTokenizer);
                    Vec::new()
                }
                Some(t) if admit_text(router, &group, t, text.len())? => {
                    let ids = timed_tokenize(router, "prompt", || t.encode_prompt(text))
                        .map_err(|e| bad(e.to_string()))?;
                    body.remove("text");
                    rewritten = true;
                    body.insert(
                        "input_ids".into(),
                        ids.iter().copied().map(Value::from).collect(),
                    );
                    ids
                }
                Some(_) => {
                    untokenized = Some(Untokenized::TextTooLong);
                    Vec::new()
                }
            },
            (_, Some(Value::Array(_))) => Vec::new(),
            (_, Some(_)) => return Err(bad("'text' must be a string or an array of strings")),
            (_, None) => return Err(missing("text", "one of 'text' or 'input_ids' is required")),
        },
        Endpoint::Completions => match body.get("prompt") {
            None | Some(Value::Null) => return Err(missing("prompt", "'prompt' is required")),
            Some(Value::String(text)) => match &tok {
                None => {
                    untokenized = Some(Untokenized::NoTokenizer);
                    Vec::new()
                }
                Some(t) if admit_text(router, &group, t, text.len())? => {
                    let ids = timed_tokenize(router, "prompt", || t.encode_prompt(text))
                        .map_err(|e| bad(e.to_string()))?;
                    rewritten = true;
                    body.insert(
                        "prompt".into(),
                        ids.iter().copied().map(Value::from).collect(),
                    );
                    ids
                }
                Some(_) => {
                    untokenized = Some(Untokenized::TextTooLong);
                    Vec::new()
                }
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
                None => {
                    untokenized = Some(Untokenized::NoTokenizer);
                    Vec::new()
                }
                Some(t) if !t.has_chat_template() => {
                    untokenized = Some(Untokenized::NoChatTemplate);
                    Vec::new()
                }
                // A template may drop content, so a chat's text length proves no token count;
                // only the tokenizing cap applies, measured on the whole body (which holds all
                // the template can render).
                Some(_) if !within_tokenize_cap(router, bytes.len()) => {
                    untokenized = Some(Untokenized::TextTooLong);
                    Vec::new()
                }
                Some(t) => {
                    use crate::routing::tokenize::ChatTokenization;
                    let normalized = crate::routing::tokenize::normalize_messages(messages);
                    let mut encoded =
                        timed_tokenize(router, "chat", || t.encode_chat_head(&normalized));
                    if let Ok((
                        head,
                        ChatTokenization::Head {
                            prompt_tokens_estimate,
                            ..
                        },
                    )) = &encoded
                    {
                        if head_decides(router, &group, head, *prompt_tokens_estimate) {
                            head_prompt_tokens = Some(*prompt_tokens_estimate);
                            // Tokenizing the rest aside holds what tokenizing it here would
                            // have, so it is charged to the same budget; when that is spent,
                            // the rest is not tokenized aside (the next turn tokenizes it).
                            let charge = bytes.len().min(router.config.tokenize_text_bytes_max);
                            if let Ok(budget) = router
                                .prepare_budget
                                .clone()
                                .try_acquire_many_owned(u32::try_from(charge).unwrap_or(u32::MAX))
                            {
                                head_completion = Some(HeadCompletion {
                                    tokenizer: t.clone(),
                                    messages: normalized,
                                    head: head.clone(),
                                    budget,
                                });
                            }
                        } else {
                            encoded = timed_tokenize(router, "chat", || t.encode_chat(&normalized));
                        }
                    }
                    match encoded {
                        Ok((ids, how)) => {
                            let m = &router.metrics.tokenizer_cache;
                            match how {
                                ChatTokenization::Segmented {
                                    cached_segments,
                                    fresh_segments,
                                } => {
                                    m.with_label_values(&["hit"]).inc_by(cached_segments as u64);
                                    m.with_label_values(&["miss"]).inc_by(fresh_segments as u64);
                                }
                                ChatTokenization::Head {
                                    cached_segments, ..
                                } => {
                                    m.with_label_values(&["hit"]).inc_by(cached_segments as u64);
                                    m.with_label_values(&["head"]).inc();
                                }
                                ChatTokenization::Whole => m.with_label_values(&["whole"]).inc(),
                            }
                            ids
                        }
                        Err(crate::routing::tokenize::TokenizeError::BadMessages(m)) => {
                            return Err(bad(m));
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "chat not tokenized; routing on load");
                            untokenized = Some(Untokenized::TokenizeFailed);
                            Vec::new()
                        }
                    }
                }
            }
        }
    };
    if let Some(reason) = untokenized {
        router
            .metrics
            .untokenized_prompts
            .with_label_values(&[reason.label()])
            .inc();
    }
    Ok(Prepared {
        rewritten,
        group,
        prompt_tokens: head_prompt_tokens.unwrap_or(tokens.len()),
        head_completion,
        tokens,
        body: Some(body),
        untokenized,
    })
}

/// Whether a chat's head (`ModelTokenizer::encode_chat_head`) is all its routing needs: no
/// rank's match, pending blocks included, reaches the head's last whole block (past a block no
/// rank holds, no later token can change any rank's match), and the estimated length is far
/// enough under the model's limit that counting it exactly could not refuse it.
fn head_decides(
    router: &Router,
    group: &Arc<ModelGroup>,
    head: &[u32],
    prompt_tokens_estimate: usize,
) -> bool {
    if group
        .prompt_tokens_max
        .is_some_and(|max| prompt_tokens_estimate.saturating_mul(2) > max.tokens)
    {
        return false;
    }
    let head_blocks = head.len() / group.block_size.max(1);
    match router.plan_preview_sized(group.clone(), head, prompt_tokens_estimate) {
        Ok(preview) => preview
            .candidates
            .iter()
            .all(|c| (c.input.matched_blocks as usize) < head_blocks),
        Err(_) => false,
    }
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
