//! The data-path HTTP client: one pooled hyper client that carries routed requests to engines.
//!
//! Why not reqwest here (reqwest stays for the control plane: discovery, health checks, peer
//! snapshot fetches): on the proxy path every microsecond is added latency, and reqwest's
//! conveniences cost per request: it parses each URL with the WHATWG parser (IDNA included),
//! wraps the body and response in its own types and futures, and runs its redirect and timeout
//! layers. A profile of the router at 1,000 req/s showed URL parsing and reqwest's layers as a
//! visible share of the router's user CPU (docs/BENCHMARKS.md). hyper_util's pooled client is
//! the same engine underneath, so connection reuse, keep-alive and TCP_NODELAY behave as before.
//!
//! The response body is handed back as hyper's `Incoming` untouched, so its exact length (when
//! the engine sent `Content-Length`) reaches the client's framing and streamed bodies stay
//! streamed chunk by chunk.

use std::time::Duration;

use axum::http::{HeaderValue, Request, Response, Uri};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Idle keep-alive connections kept per engine; beyond it, finished connections are closed.
pub const UPSTREAM_IDLE_CONNECTIONS_MAX: usize = 256;
/// Idle pooled connections are closed after this long (engines close theirs too, eventually).
pub const UPSTREAM_IDLE_TIMEOUT_MS: u64 = 90_000;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("invalid upstream URL {url}: {reason}")]
    BadUrl { url: String, reason: String },
    /// No connection could be made: nothing was sent, so another rank may be tried.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The request may have reached the engine.
    #[error("{0}")]
    Send(String),
}

impl UpstreamError {
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }
}

#[derive(Clone)]
pub struct UpstreamClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl UpstreamClient {
    pub fn new(connect_timeout_ms: u64) -> UpstreamClient {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_millis(connect_timeout_ms)));
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(UPSTREAM_IDLE_CONNECTIONS_MAX)
            .pool_idle_timeout(Duration::from_millis(UPSTREAM_IDLE_TIMEOUT_MS))
            .build(connector);
        UpstreamClient { client }
    }

    /// POSTs `body` as JSON to `base_url` + `path` with `headers`; resolves at the response head.
    pub async fn post_json(
        &self,
        base_url: &str,
        path: &str,
        headers: &[(&'static str, HeaderValue)],
        body: Bytes,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let url = format!("{base_url}{path}");
        let uri: Uri =
            url.parse()
                .map_err(|e: axum::http::uri::InvalidUri| UpstreamError::BadUrl {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
        let mut request = Request::post(uri);
        for (name, value) in headers {
            request = request.header(*name, value.clone());
        }
        let request = request
            .header("content-type", HeaderValue::from_static("application/json"))
            .body(Full::new(body))
            .map_err(|e| UpstreamError::BadUrl {
                url: url.clone(),
                reason: e.to_string(),
            })?;
        self.client.request(request).await.map_err(|e| {
            if e.is_connect() {
                UpstreamError::Connect(error_chain(&e))
            } else {
                UpstreamError::Send(error_chain(&e))
            }
        })
    }
}

/// The error and its sources on one line: hyper_util's top-level message alone ("client error
/// (Connect)") does not say what failed.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_closed_port_is_a_connect_error_so_the_next_rank_may_be_tried() {
        // Bind then drop a listener: the port is then (almost surely) closed.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let client = UpstreamClient::new(1_000);
        let err = client
            .post_json(
                &format!("http://{addr}"),
                "/v1/completions",
                &[],
                Bytes::from_static(b"{}"),
            )
            .await
            .expect_err("nothing listens there");
        assert!(err.is_connect(), "expected a connect error, got {err}");
    }

    #[tokio::test]
    async fn a_malformed_base_url_is_a_typed_error_not_a_panic() {
        let client = UpstreamClient::new(1_000);
        let err = client
            .post_json("http://exa mple", "/x", &[], Bytes::new())
            .await
            .expect_err("space in host");
        assert!(
            matches!(err, UpstreamError::BadUrl { .. }),
            "expected BadUrl, got {err}"
        );
    }
}
