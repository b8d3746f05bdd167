//! Errors returned to clients, in the OpenAI error shape.
//!
//! Every failure a client can see goes through [`ApiError`], so the status code and the JSON body
//! `{"error":{"message","type","param","code"}}` are decided in one place and no handler can leak
//! a panic or a bare text body.
//!
//! What a client is told is not what the log is told: an upstream failure's detail names engine
//! URLs and OS errors (topology a public client must not learn), so the body of a 502 or a 500
//! carries a generic message, and the detail goes to the router's log under the request id the
//! client also receives (`x-request-id`), which is how an operator connects the two.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{message}")]
    MissingField { message: String, param: String },
    #[error("request body exceeds {limit_bytes} bytes")]
    BodyTooLarge { limit_bytes: usize },
    #[error(
        "the prompt has {tokens} tokens, more than this model's limit of {limit} (from {limit_source})"
    )]
    PromptTooLong {
        tokens: usize,
        limit: usize,
        limit_source: &'static str,
    },
    /// Refused before tokenizing: the text's bytes alone prove it longer than the limit (see
    /// `routing::text_bound`), so the count is a lower bound.
    #[error(
        "the prompt has at least {tokens_at_least} tokens ({text_bytes} bytes of text), more than \
         this model's limit of {limit} (from {limit_source})"
    )]
    PromptTextTooLong {
        text_bytes: usize,
        tokens_at_least: usize,
        limit: usize,
        limit_source: &'static str,
    },
    /// Large bodies already being prepared fill the router's budget for them.
    #[error("the router is busy preparing other large requests; retry later")]
    PrepareBusy,
    #[error("the {what} did not arrive within {limit_ms} ms")]
    RequestTimeout { what: &'static str, limit_ms: u64 },
    #[error(
        "no such route; the API serves POST /v1/completions, /v1/chat/completions and /generate"
    )]
    UnknownRoute,
    #[error("this route does not accept that method")]
    MethodNotAllowed,
    #[error("model '{0}' not found")]
    UnknownModel(String),
    #[error("worker {0} not found")]
    UnknownWorker(String),
    #[error("{0}")]
    Conflict(String),
    #[error("a valid bearer token is required")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NoHealthyWorker(String),
    #[error("upstream failure: {0}")]
    Upstream(String),
    #[error("upstream timed out after {0} ms")]
    UpstreamTimeout(u64),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) | ApiError::MissingField { .. } => StatusCode::BAD_REQUEST,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::PromptTooLong { .. } | ApiError::PromptTextTooLong { .. } => {
                StatusCode::BAD_REQUEST
            }
            ApiError::PrepareBusy => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::UnknownRoute | ApiError::UnknownModel(_) | ApiError::UnknownWorker(_) => {
                StatusCode::NOT_FOUND
            }
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NoHealthyWorker(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ApiError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind_and_code(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::BadRequest(_) => ("invalid_request_error", "invalid_request"),
            ApiError::MissingField { .. } => ("invalid_request_error", "missing_field"),
            ApiError::BodyTooLarge { .. } => ("invalid_request_error", "body_too_large"),
            ApiError::RequestTimeout { .. } => ("invalid_request_error", "request_timeout"),
            ApiError::PromptTooLong { .. } | ApiError::PromptTextTooLong { .. } => {
                ("invalid_request_error", "context_length_exceeded")
            }
            ApiError::PrepareBusy => ("service_unavailable", "router_busy"),
            ApiError::UnknownRoute => ("invalid_request_error", "unknown_route"),
            ApiError::MethodNotAllowed => ("invalid_request_error", "method_not_allowed"),
            ApiError::UnknownModel(_) => ("invalid_request_error", "model_not_found"),
            ApiError::UnknownWorker(_) => ("invalid_request_error", "worker_not_found"),
            ApiError::Conflict(_) => ("invalid_request_error", "conflict"),
            ApiError::Unauthorized => ("authentication_error", "unauthorized"),
            ApiError::Forbidden(_) => ("permission_error", "forbidden"),
            ApiError::NoHealthyWorker(_) => ("service_unavailable", "no_healthy_worker"),
            ApiError::Upstream(_) => ("upstream_error", "bad_gateway"),
            ApiError::UpstreamTimeout(_) => ("upstream_error", "gateway_timeout"),
            ApiError::Internal(_) => ("internal_error", "internal_error"),
        }
    }

    /// The message a client sees: the error's own text, except where that text describes the
    /// router's internals (see the module doc).
    pub fn public_message(&self) -> String {
        match self {
            ApiError::Upstream(_) => {
                "the engine did not answer properly; details are in the router's log under this \
                 request's x-request-id"
                    .into()
            }
            ApiError::Internal(_) => {
                "internal error; details are in the router's log under this request's x-request-id"
                    .into()
            }
            other => other.to_string(),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        let (kind, code) = self.kind_and_code();
        let param = match self {
            ApiError::MissingField { param, .. } => serde_json::Value::String(param.clone()),
            ApiError::UnknownModel(_) => serde_json::Value::String("model".into()),
            _ => serde_json::Value::Null,
        };
        serde_json::json!({
            "error": {"message": self.public_message(), "type": kind, "param": param, "code": code}
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_the_openai_shape_and_its_status() {
        let e = ApiError::UnknownModel("x".into());
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        let b = e.body();
        assert_eq!(b["error"]["code"], "model_not_found");
        assert_eq!(b["error"]["param"], "model");
        assert!(b["error"]["message"].as_str().unwrap().contains("'x'"));
        assert_eq!(
            ApiError::BodyTooLarge { limit_bytes: 1 }.status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(
            ApiError::UpstreamTimeout(5).status(),
            StatusCode::GATEWAY_TIMEOUT
        );
    }

    #[test]
    fn an_upstream_or_internal_failure_tells_the_client_nothing_of_engine_urls_or_os_errors() {
        for e in [
            ApiError::Upstream(
                "http://10.0.0.7:30001: connect: Connection refused (os error 111)".into(),
            ),
            ApiError::Internal("cannot reach http://10.0.0.7:30001/server_info".into()),
        ] {
            let message = e.body()["error"]["message"].as_str().unwrap().to_string();
            assert!(
                !message.contains("10.0.0.7") && !message.contains("os error"),
                "{message}"
            );
            assert!(message.contains("x-request-id"), "{message}");
            // The log still has the detail.
            assert!(e.to_string().contains("10.0.0.7"));
        }
    }
}
