//! Where a worker publishes its KV events: read from SGLang's `GET /server_info`, or built from a
//! router-side template for engines that advertise nothing (vLLM).
//!
//! The result is always a fully resolved [`KvEventsConfig`]: wildcard bind hosts (`*`, `0.0.0.0`,
//! `::`) are replaced by the worker URL's own host here, once, so nothing downstream ever dials a
//! wildcard. The HTTP fetch is bounded in body size, time and attempts because discovery runs on
//! the worker-registration path and a misbehaving worker must not stall or exhaust the router.

use std::time::Duration;

use serde::Deserialize;

/// Largest `/server_info` body we read; SGLang's is a few KiB, so this only stops a hostile or
/// broken worker from streaming an unbounded body into memory.
pub const SERVER_INFO_MAX_BYTES: usize = 1024 * 1024;
/// Time budget of one `/server_info` attempt (connect + body).
pub const SERVER_INFO_TIMEOUT_MS: u64 = 2_000;
/// Attempts before discovery gives up on a worker.
pub const SERVER_INFO_ATTEMPTS_MAX: u32 = 3;
/// Delay before the second attempt; it doubles for each further one.
pub const SERVER_INFO_BACKOFF_INITIAL_MS: u64 = 100;
/// Largest data-parallel size we accept from a worker: every rank costs a subscriber task and two
/// sockets, so an absurd value from a broken worker must not fan out.
pub const DP_SIZE_MAX: u32 = 1024;

/// Where and how one worker publishes KV events. Ports are per-rank bases: rank `r` uses
/// `base + r`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub endpoint_host: String,
    pub endpoint_port_base: u16,
    pub topic: String,
    pub block_size: Option<u32>,
    pub dp_size: u32,
    pub replay_port_base: Option<u16>,
    /// Host of the replay ROUTER; `None` means the event endpoint's host.
    pub replay_host: Option<String>,
    pub load_port_base: Option<u16>,
    pub load_topic: Option<String>,
}

impl KvEventsConfig {
    /// The ZMQ endpoint of rank `dp_rank`'s event PUB socket.
    pub fn kv_endpoint(&self, dp_rank: u32) -> Result<String, DiscoveryError> {
        Ok(tcp_endpoint(
            &self.endpoint_host,
            offset_port(self.endpoint_port_base, dp_rank)?,
        ))
    }

    /// The replay ROUTER endpoint of rank `dp_rank`, if the worker has one.
    pub fn replay_endpoint(&self, dp_rank: u32) -> Result<Option<String>, DiscoveryError> {
        let Some(base) = self.replay_port_base else {
            return Ok(None);
        };
        let host = self.replay_host.as_deref().unwrap_or(&self.endpoint_host);
        Ok(Some(tcp_endpoint(host, offset_port(base, dp_rank)?)))
    }

    /// The load-stat PUB endpoint and topic of rank `dp_rank`; both the port base and the topic
    /// must be known (an engine that sends only one of them is not publishing load).
    pub fn load_endpoint(&self, dp_rank: u32) -> Result<Option<(String, String)>, DiscoveryError> {
        let (Some(base), Some(topic)) = (self.load_port_base, self.load_topic.as_ref()) else {
            return Ok(None);
        };
        Ok(Some((
            tcp_endpoint(&self.endpoint_host, offset_port(base, dp_rank)?),
            topic.clone(),
        )))
    }
}

/// What the router learns about a worker from `/server_info`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkerInfo {
    pub served_model_name: Option<String>,
    /// `None` when the worker does not publish KV events.
    pub kv_events: Option<KvEventsConfig>,
    /// The model's context length as the engine states it (SGLang's `context_length`, or
    /// `max_model_len`): no prompt longer than this can be served.
    pub context_length: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("worker url {url:?} is not a usable http(s) url with a host")]
    BadWorkerUrl { url: String },
    #[error("endpoint template {template:?} is not of the form tcp://HOST:PORT: {reason}")]
    BadTemplate { template: String, reason: String },
    #[error("GET {url} failed after {attempts} attempts: {last_error}")]
    Unreachable {
        url: String,
        attempts: u32,
        last_error: String,
    },
    #[error("GET {url} answered HTTP {status}")]
    HttpStatus { url: String, status: u16 },
    #[error("server_info body exceeds {limit_bytes} bytes")]
    BodyTooLarge { limit_bytes: usize },
    #[error("server_info is not valid JSON: {0}")]
    BadJson(String),
    #[error("kv_events block is unusable: {0}")]
    BadKvEvents(String),
    #[error("port base {base} + dp rank {dp_rank} overflows a TCP port")]
    PortOverflow { base: u16, dp_rank: u32 },
}

impl DiscoveryError {
    /// Errors that another attempt might not repeat (network, 5xx); a 4xx or a malformed body will.
    fn is_retryable(&self) -> bool {
        match self {
            DiscoveryError::Unreachable { .. } => true,
            DiscoveryError::HttpStatus { status, .. } => *status >= 500,
            _ => false,
        }
    }
}

fn offset_port(base: u16, dp_rank: u32) -> Result<u16, DiscoveryError> {
    u32::from(base)
        .checked_add(dp_rank)
        .and_then(|p| u16::try_from(p).ok())
        .ok_or(DiscoveryError::PortOverflow { base, dp_rank })
}

fn tcp_endpoint(host: &str, port: u16) -> String {
    // A bare IPv6 literal must be bracketed in an endpoint; `Url::host_str` already brackets.
    if host.contains(':') && !host.starts_with('[') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

fn is_wildcard_host(host: &str) -> bool {
    matches!(host, "*" | "0.0.0.0" | "::" | "[::]" | "")
}

/// The host of `worker_url`, as it should appear in a ZMQ endpoint.
fn worker_host(worker_url: &str) -> Result<String, DiscoveryError> {
    let bad = || DiscoveryError::BadWorkerUrl {
        url: worker_url.to_string(),
    };
    let url = reqwest::Url::parse(worker_url).map_err(|_| bad())?;
    let host = url.host_str().ok_or_else(bad)?;
    Ok(host.to_string())
}

fn resolve_host(advertised: Option<&str>, worker_host: &str) -> String {
    match advertised {
        Some(h) if !is_wildcard_host(h) => h.to_string(),
        _ => worker_host.to_string(),
    }
}

/// Splits `tcp://HOST:PORT` (HOST may be a bracketed IPv6 literal).
fn split_tcp_endpoint(endpoint: &str) -> Result<(String, u16), String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| "only tcp:// endpoints can be dialled across hosts".to_string())?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| "missing :PORT".to_string())?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("port {port:?} is not a u16"))?;
    if host.is_empty() {
        return Err("empty host".to_string());
    }
    Ok((host.to_string(), port))
}

/// SGLang's `kv_events` block. Every field is optional on the wire; which ones are required is
/// decided in [`resolve_kv_block`], so a missing one becomes a precise error, not a serde message.
#[derive(Debug, Deserialize, Default)]
struct KvEventsBlock {
    publisher: Option<String>,
    endpoint_host: Option<String>,
    endpoint_port_base: Option<u32>,
    /// Some builds advertise the raw configured endpoint instead of host + port base.
    endpoint: Option<String>,
    topic: Option<String>,
    block_size: Option<i64>,
    dp_size: Option<i64>,
    replay_endpoint_port_base: Option<u32>,
    replay_endpoint_host: Option<String>,
    load_endpoint_port_base: Option<u32>,
    load_topic: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
struct ServerInfoBody {
    served_model_name: Option<serde_json::Value>,
    kv_events: Option<KvEventsBlock>,
    context_length: Option<serde_json::Value>,
    max_model_len: Option<serde_json::Value>,
}

fn port_field(name: &str, value: Option<u32>) -> Result<Option<u16>, DiscoveryError> {
    value
        .map(|v| {
            u16::try_from(v).map_err(|_| DiscoveryError::BadKvEvents(format!("{name} {v} > 65535")))
        })
        .transpose()
}

fn resolve_kv_block(
    block: KvEventsBlock,
    worker_host: &str,
) -> Result<Option<KvEventsConfig>, DiscoveryError> {
    if let Some(p) = &block.publisher
        && p != "zmq"
    {
        // "null" (or any non-ZMQ publisher) means the engine publishes nothing we can subscribe to.
        return Ok(None);
    }
    let (host, port) = match (block.endpoint_port_base, block.endpoint.as_deref()) {
        (Some(port), _) => (
            block.endpoint_host.clone(),
            port_field("endpoint_port_base", Some(port))?.unwrap_or_default(),
        ),
        (None, Some(endpoint)) => {
            let (h, p) = split_tcp_endpoint(endpoint)
                .map_err(|e| DiscoveryError::BadKvEvents(format!("endpoint {endpoint:?}: {e}")))?;
            (Some(h), p)
        }
        (None, None) => {
            return Err(DiscoveryError::BadKvEvents(
                "neither endpoint_port_base nor endpoint given".to_string(),
            ));
        }
    };
    let dp_size = match block.dp_size {
        None => 1,
        Some(n) if n >= 1 && n <= i64::from(DP_SIZE_MAX) => n as u32,
        Some(n) => {
            return Err(DiscoveryError::BadKvEvents(format!(
                "dp_size {n} outside 1..={DP_SIZE_MAX}"
            )));
        }
    };
    let block_size = match block.block_size {
        Some(n) if n > 0 => Some(u32::try_from(n).map_err(|_| {
            DiscoveryError::BadKvEvents(format!("block_size {n} does not fit u32"))
        })?),
        // The engine reports None (or <= 0) when its page size is unknown to it.
        _ => None,
    };
    let endpoint_host = resolve_host(host.as_deref(), worker_host);
    let replay_port_base =
        port_field("replay_endpoint_port_base", block.replay_endpoint_port_base)?;
    // SGLang 0.5.23 sends no replay host: the ROUTER lives on the worker's own host.
    let replay_host =
        replay_port_base.map(|_| resolve_host(block.replay_endpoint_host.as_deref(), worker_host));
    let cfg = KvEventsConfig {
        endpoint_host,
        endpoint_port_base: port,
        topic: block.topic.unwrap_or_default(),
        block_size,
        dp_size,
        replay_port_base,
        replay_host,
        load_port_base: port_field("load_endpoint_port_base", block.load_endpoint_port_base)?,
        load_topic: block.load_topic,
    };
    // Reject now rather than at subscription time: a rank whose port overflows is unreachable.
    let last_rank = cfg.dp_size - 1;
    cfg.kv_endpoint(last_rank)?;
    cfg.replay_endpoint(last_rank)?;
    cfg.load_endpoint(last_rank)?;
    Ok(Some(cfg))
}

/// Parses a `/server_info` body. Public so the body format can be tested without HTTP.
pub fn parse_server_info(body: &[u8], worker_url: &str) -> Result<WorkerInfo, DiscoveryError> {
    let host = worker_host(worker_url)?;
    let parsed: ServerInfoBody =
        serde_json::from_slice(body).map_err(|e| DiscoveryError::BadJson(e.to_string()))?;
    let served_model_name = match parsed.served_model_name {
        Some(serde_json::Value::String(s)) => Some(s),
        // Some engines report a list of aliases; the first is the canonical name.
        Some(serde_json::Value::Array(items)) => items
            .into_iter()
            .find_map(|v| v.as_str().map(str::to_string)),
        _ => None,
    };
    let kv_events = match parsed.kv_events {
        Some(block) => resolve_kv_block(block, &host)?,
        None => None,
    };
    // A positive integer only: anything else says nothing (an engine that reports a float or
    // a string here is not trusted with a limit that refuses requests).
    let context_length = [parsed.context_length, parsed.max_model_len]
        .into_iter()
        .flatten()
        .find_map(|v| v.as_u64().filter(|&n| n > 0));
    Ok(WorkerInfo {
        served_model_name,
        kv_events,
        context_length,
    })
}

async fn fetch_once(http: &reqwest::Client, url: &str) -> Result<Vec<u8>, DiscoveryError> {
    let unreachable = |e: reqwest::Error| DiscoveryError::Unreachable {
        url: url.to_string(),
        attempts: 1,
        last_error: e.to_string(),
    };
    let mut resp = http
        .get(url)
        .timeout(Duration::from_millis(SERVER_INFO_TIMEOUT_MS))
        .send()
        .await
        .map_err(unreachable)?;
    let status = resp.status();
    if !status.is_success() {
        return Err(DiscoveryError::HttpStatus {
            url: url.to_string(),
            status: status.as_u16(),
        });
    }
    if resp
        .content_length()
        .is_some_and(|n| n > SERVER_INFO_MAX_BYTES as u64)
    {
        return Err(DiscoveryError::BodyTooLarge {
            limit_bytes: SERVER_INFO_MAX_BYTES,
        });
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(unreachable)? {
        if body.len() + chunk.len() > SERVER_INFO_MAX_BYTES {
            return Err(DiscoveryError::BodyTooLarge {
                limit_bytes: SERVER_INFO_MAX_BYTES,
            });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// `GET {worker_url}/server_info` and parse its `kv_events` block (see the module doc).
pub async fn fetch_worker_info(
    http: &reqwest::Client,
    worker_url: &str,
) -> Result<WorkerInfo, DiscoveryError> {
    worker_host(worker_url)?;
    let url = format!("{}/server_info", worker_url.trim_end_matches('/'));
    let mut backoff_ms = SERVER_INFO_BACKOFF_INITIAL_MS;
    let mut attempt = 1;
    loop {
        match fetch_once(http, &url).await {
            Ok(body) => return parse_server_info(&body, worker_url),
            Err(e) if e.is_retryable() && attempt < SERVER_INFO_ATTEMPTS_MAX => {
                tracing::debug!(%url, attempt, error = %e, "server_info attempt failed; retrying");
                tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
                backoff_ms *= 2;
                attempt += 1;
            }
            Err(DiscoveryError::Unreachable { last_error, .. }) => {
                return Err(DiscoveryError::Unreachable {
                    url,
                    attempts: attempt,
                    last_error,
                });
            }
            Err(e) => return Err(e),
        }
    }
}

/// Builds a worker's config from a router-side template such as `tcp://{host}:5557` (`{host}` is
/// the worker URL's host), for engines that do not advertise their publisher (vLLM).
pub fn kv_config_from_template(
    worker_url: &str,
    endpoint_template: &str,
    replay_port_base: Option<u16>,
    block_size: Option<u32>,
    dp_size: u32,
) -> Result<KvEventsConfig, DiscoveryError> {
    let host = worker_host(worker_url)?;
    let bad = |reason: String| DiscoveryError::BadTemplate {
        template: endpoint_template.to_string(),
        reason,
    };
    if dp_size == 0 || dp_size > DP_SIZE_MAX {
        return Err(bad(format!("dp_size {dp_size} outside 1..={DP_SIZE_MAX}")));
    }
    let endpoint = endpoint_template.replace("{host}", &host);
    let (endpoint_host, port) = split_tcp_endpoint(&endpoint).map_err(bad)?;
    let endpoint_host = resolve_host(Some(&endpoint_host), &host);
    let cfg = KvEventsConfig {
        endpoint_host,
        endpoint_port_base: port,
        topic: String::new(),
        block_size: block_size.filter(|b| *b > 0),
        dp_size,
        replay_port_base,
        replay_host: replay_port_base.map(|_| host.clone()),
        load_port_base: None,
        load_topic: None,
    };
    cfg.kv_endpoint(dp_size - 1)?;
    cfg.replay_endpoint(dp_size - 1)?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_hosts_are_replaced_by_the_worker_host() {
        for wildcard in ["*", "0.0.0.0", "::", "[::]"] {
            let body = serde_json::json!({
                "served_model_name": "m",
                "kv_events": {"publisher": "zmq", "endpoint_host": wildcard,
                    "endpoint_port_base": 5557, "topic": "kv", "block_size": 16, "dp_size": 2,
                    "replay_endpoint_port_base": 5600}
            });
            let info =
                parse_server_info(body.to_string().as_bytes(), "http://10.1.2.3:8000").unwrap();
            let kv = info.kv_events.unwrap();
            assert_eq!(kv.endpoint_host, "10.1.2.3", "wildcard {wildcard}");
            assert_eq!(kv.kv_endpoint(1).unwrap(), "tcp://10.1.2.3:5558");
            assert_eq!(
                kv.replay_endpoint(1).unwrap().as_deref(),
                Some("tcp://10.1.2.3:5601")
            );
            assert_eq!(info.served_model_name.as_deref(), Some("m"));
        }
    }

    #[test]
    fn an_explicit_host_is_kept_and_replay_defaults_to_the_worker_host() {
        let body = br#"{"kv_events":{"endpoint_host":"192.168.0.9","endpoint_port_base":7000,
            "replay_endpoint_port_base":7100,"load_endpoint_port_base":7200,"load_topic":"load"}}"#;
        let kv = parse_server_info(body, "http://[::1]:8000")
            .unwrap()
            .kv_events
            .unwrap();
        assert_eq!(kv.kv_endpoint(0).unwrap(), "tcp://192.168.0.9:7000");
        assert_eq!(
            kv.replay_endpoint(0).unwrap().as_deref(),
            Some("tcp://[::1]:7100")
        );
        assert_eq!(
            kv.load_endpoint(0).unwrap(),
            Some(("tcp://192.168.0.9:7200".to_string(), "load".to_string()))
        );
        assert_eq!(kv.dp_size, 1);
        assert_eq!(kv.block_size, None);
    }

    #[test]
    fn the_context_length_is_read_from_either_name_and_only_as_a_positive_integer() {
        let ctx = |body: &str| {
            parse_server_info(body.as_bytes(), "http://h:1")
                .unwrap()
                .context_length
        };
        assert_eq!(ctx(r#"{"context_length":32768}"#), Some(32_768));
        assert_eq!(ctx(r#"{"max_model_len":4096}"#), Some(4_096));
        assert_eq!(ctx(r#"{"context_length":0,"max_model_len":8}"#), Some(8));
        for unusable in [
            r#"{"context_length":"32k"}"#,
            r#"{"context_length":-1}"#,
            "{}",
        ] {
            assert_eq!(ctx(unusable), None, "{unusable}");
        }
    }

    #[test]
    fn a_worker_without_kv_events_or_with_a_null_publisher_has_none() {
        let none = parse_server_info(br#"{"served_model_name":"x"}"#, "http://h:1").unwrap();
        assert_eq!(none.kv_events, None);
        let null = parse_server_info(
            br#"{"kv_events":{"publisher":"null","endpoint_port_base":1}}"#,
            "http://h:1",
        )
        .unwrap();
        assert_eq!(null.kv_events, None);
    }

    #[test]
    fn bad_kv_blocks_are_typed_errors() {
        let cases: [&[u8]; 4] = [
            br#"{"kv_events":{"endpoint_host":"*"}}"#,
            br#"{"kv_events":{"endpoint_port_base":70000}}"#,
            br#"{"kv_events":{"endpoint_port_base":65535,"dp_size":2}}"#,
            br#"{"kv_events":{"endpoint_port_base":5557,"dp_size":100000}}"#,
        ];
        for body in cases {
            let err = parse_server_info(body, "http://h:1").unwrap_err();
            assert!(
                matches!(
                    err,
                    DiscoveryError::BadKvEvents(_) | DiscoveryError::PortOverflow { .. }
                ),
                "{err:?}"
            );
        }
        assert!(matches!(
            parse_server_info(b"not json", "http://h:1"),
            Err(DiscoveryError::BadJson(_))
        ));
    }

    #[test]
    fn a_raw_endpoint_is_accepted_in_place_of_host_and_port() {
        let kv = parse_server_info(
            br#"{"kv_events":{"endpoint":"tcp://*:5557"}}"#,
            "http://w1:30000",
        )
        .unwrap()
        .kv_events
        .unwrap();
        assert_eq!(kv.kv_endpoint(0).unwrap(), "tcp://w1:5557");
    }

    #[test]
    fn templates_substitute_the_worker_host() {
        let kv = kv_config_from_template(
            "http://w7:8000/",
            "tcp://{host}:5557",
            Some(5600),
            Some(16),
            2,
        )
        .unwrap();
        assert_eq!(kv.kv_endpoint(1).unwrap(), "tcp://w7:5558");
        assert_eq!(
            kv.replay_endpoint(1).unwrap().as_deref(),
            Some("tcp://w7:5601")
        );
        assert_eq!(kv.block_size, Some(16));
        assert!(matches!(
            kv_config_from_template("http://w7:8000", "ipc:///tmp/x", None, None, 1),
            Err(DiscoveryError::BadTemplate { .. })
        ));
        assert!(matches!(
            kv_config_from_template("not a url", "tcp://{host}:1", None, None, 1),
            Err(DiscoveryError::BadWorkerUrl { .. })
        ));
    }
}
