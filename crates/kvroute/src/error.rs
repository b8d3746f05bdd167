//! Errors returned to clients, in the OpenAI error shape.
//!
//! Every failure a client can see goes through [`ApiError`], so the status code and the JSON body
//! `{"error":{"message","type","param","code"}}` are decided in one place and no handler can leak
//! a panic or a bare text body.

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
    #[error("model '{0}' not found")]
    UnknownModel(String),
    #[error("worker {0} not found")]
    UnknownWorker(String),
    #[error("{0}")]
    Conflict(String),
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
            ApiError::UnknownModel(_) | ApiError::UnknownWorker(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
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
            ApiError::UnknownModel(_) => ("invalid_request_error", "model_not_found"),
            ApiError::UnknownWorker(_) => ("invalid_request_error", "worker_not_found"),
            ApiError::Conflict(_) => ("invalid_request_error", "conflict"),
            ApiError::NoHealthyWorker(_) => ("service_unavailable", "no_healthy_worker"),
            ApiError::Upstream(_) => ("upstream_error", "bad_gateway"),
            ApiError::UpstreamTimeout(_) => ("upstream_error", "gateway_timeout"),
            ApiError::Internal(_) => ("internal_error", "internal_error"),
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
            "error": {"message": self.to_string(), "type": kind, "param": param, "code": code}
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
}
