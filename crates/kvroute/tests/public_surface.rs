//! The public listener's protections, each proved over a real socket against a router started
//! in-process: idle, head and body deadlines (on the hand-written path and on the hyper
//! fallback), the connection cap, the linger bound after a refused body, who may call the admin
//! API, the internal listener's start-up rule, and what a 502 tells a client.
//!
//! Every limit is set small here so a test takes a fraction of a second; each test fails if its
//! limit is removed (the connection would stay open, or the request would be served).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvroute::RouterConfig;
use kvroute::data_plane::limits::ClientLimits;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest any test waits for the router to act on a limit of a few hundred ms.
const LIMIT_ACTS_WITHIN: Duration = Duration::from_secs(5);
const SHORT_LIMIT_MS: u64 = 300;

fn limits() -> ClientLimits {
    ClientLimits {
        idle_timeout_ms: SHORT_LIMIT_MS,
        head_timeout_ms: SHORT_LIMIT_MS,
        body_timeout_ms: SHORT_LIMIT_MS,
        write_timeout_ms: SHORT_LIMIT_MS,
        connections_max: 10_000,
    }
}

async fn router_with(cfg: RouterConfig) -> kvroute::RouterHandle {
    kvroute::serve(cfg).await.expect("router starts")
}

fn no_workers() -> RouterConfig {
    RouterConfig {
        client_limits: limits(),
        ..router_config(&[])
    }
}

/// Reads until EOF (or reset), returning what arrived and how long it took; fails the test if
/// the router keeps the connection open past [`LIMIT_ACTS_WITHIN`].
async fn read_until_closed(stream: &mut TcpStream, what: &str) -> (String, Duration) {
    let started = Instant::now();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = LIMIT_ACTS_WITHIN.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, stream.read(&mut chunk)).await {
            Err(_) => panic!(
                "the router kept the connection open for {LIMIT_ACTS_WITHIN:?} waiting for {what}; \
                 received {:?}",
                String::from_utf8_lossy(&got)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => {
                return (String::from_utf8_lossy(&got).into(), started.elapsed());
            }
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn closed_total(base: &str, reason: &str) -> u64 {
    let text = metrics_text(base).await;
    let needle = format!("kvroute_client_connections_closed_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&needle))
        .map_or(0, |v| v.trim().parse().unwrap_or(0))
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let router = router_with(no_workers()).await;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    let (got, took) = read_until_closed(&mut stream, "the idle close").await;
    assert_eq!(got, "", "an idle close says nothing");
    assert!(
        took >= Duration::from_millis(SHORT_LIMIT_MS - 50),
        "{took:?}"
    );
    assert_eq!(closed_total(&router.url(), "idle").await, 1);
    router.shutdown().await;
}

#[tokio::test]
async fn a_trickled_head_gets_a_408_at_the_head_deadline() {
    let router = router_with(no_workers()).await;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream
        .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let (got, _) = read_until_closed(&mut stream, "a 408 for the unfinished head").await;
    assert!(got.starts_with("HTTP/1.1 408 "), "{got}");
    assert!(got.contains("request_timeout"), "{got}");
    assert_eq!(closed_total(&router.url(), "head_timeout").await, 1);
    router.shutdown().await;
}

#[tokio::test]
async fn a_body_that_stops_arriving_gets_a_408_at_the_body_deadline() {
    let router = router_with(no_workers()).await;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
              content-length: 100\r\n\r\n{\"model\":",
        )
        .await
        .unwrap();
    let (got, _) = read_until_closed(&mut stream, "a 408 for the unfinished body").await;
    assert!(got.starts_with("HTTP/1.1 408 "), "{got}");
    assert_eq!(closed_total(&router.url(), "body_timeout").await, 1);
    router.shutdown().await;
}

#[tokio::test]
async fn the_hyper_fallback_closes_a_trickled_head_at_the_same_deadline() {
    let router = router_with(no_workers()).await;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    // A GET is not the fast path's: the connection goes to hyper for the rest of its life.
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 512];
    let n = tokio::time::timeout(LIMIT_ACTS_WITHIN, stream.read(&mut first))
        .await
        .expect("the health answer")
        .unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nho")
        .await
        .unwrap();
    let (_, took) = read_until_closed(&mut stream, "hyper's header-read timeout").await;
    assert!(took < LIMIT_ACTS_WITHIN, "{took:?}");
    router.shutdown().await;
}

#[tokio::test]
async fn past_the_connection_cap_a_client_gets_a_503_and_a_close() {
    let router = router_with(RouterConfig {
        client_limits: ClientLimits {
            idle_timeout_ms: 60_000,
            connections_max: 2,
            ..limits()
        },
        ..router_config(&[])
    })
    .await;
    let _held: Vec<TcpStream> = vec![
        TcpStream::connect(router.addr).await.unwrap(),
        TcpStream::connect(router.addr).await.unwrap(),
    ];
    wait_until(
        "both held connections to be counted",
        WAIT_DEADLINE,
        || async {
            let text = metrics_text_raw(router.addr).await;
            // The metrics request itself is refused while two are held, so it is read directly.
            if text.contains("503") {
                Ok(())
            } else {
                Err(text)
            }
        },
    )
    .await;
    let mut third = TcpStream::connect(router.addr).await.unwrap();
    let (got, _) = read_until_closed(&mut third, "the over-capacity answer").await;
    assert!(got.starts_with("HTTP/1.1 503 "), "{got}");
    assert!(got.contains("retry-after: 1"), "{got}");
    drop(_held);
    let metrics = wait_until("the cap to free up", WAIT_DEADLINE, || async {
        let text = metrics_text_raw(router.addr).await;
        if text.starts_with("HTTP/1.1 200") {
            Ok(text)
        } else {
            Err(text)
        }
    })
    .await;
    let refused: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvroute_client_connections_closed_total{reason=\"cap\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        refused >= 2,
        "the third connection and at least one probe were refused: {refused}"
    );
    router.shutdown().await;
}

/// One raw `GET /metrics` on a new connection: the whole answer as text (whatever it is).
async fn metrics_text_raw(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(LIMIT_ACTS_WITHIN, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into()
}

#[tokio::test]
async fn a_refused_body_is_drained_for_at_most_the_linger_bound() {
    let router = router_with(RouterConfig {
        max_body_bytes: 1024,
        client_limits: ClientLimits {
            body_timeout_ms: 60_000,
            ..limits()
        },
        ..router_config(&[])
    })
    .await;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000\r\n\r\n",
        )
        .await
        .unwrap();
    // Keep uploading slowly: without the linger bound the router would drain for ever.
    let (mut reader, mut writer) = stream.into_split();
    let uploader = tokio::spawn(async move {
        let chunk = vec![b'x'; 1024];
        loop {
            if writer.write_all(&chunk).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(LIMIT_ACTS_WITHIN, reader.read(&mut buf)).await {
            Err(_) => panic!("the router drained a refused body for over {LIMIT_ACTS_WITHIN:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
    let took = started.elapsed();
    uploader.abort();
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 413 "), "{got}");
    let linger = Duration::from_millis(kvroute::data_plane::connection::LINGER_MAX_MS);
    assert!(
        took >= linger - Duration::from_millis(100),
        "closed after {took:?}"
    );
    router.shutdown().await;
}

fn token_file(name: &str, token: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    std::fs::write(&path, format!("{token}\n")).unwrap();
    path
}

#[tokio::test]
async fn admin_mutations_need_the_bearer_token_when_one_is_set() {
    let token = "admin-token-0123456789";
    let router = router_with(RouterConfig {
        admin_auth_token: Some(Arc::from(token.as_bytes())),
        ..router_config(&[])
    })
    .await;
    let base = router.url();
    let http = client();
    // A URL nothing listens on: with the token the router tries it (and answers with the
    // registration's own error); without it the request never gets that far.
    let body = json!({"url": "http://127.0.0.1:9", "model": "m"});
    for auth in [
        None,
        Some("Bearer wrong-token-0123456789"),
        Some("admin-token-0123456789"),
    ] {
        let mut req = http.post(format!("{base}/workers")).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "auth {auth:?}");
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
    }
    let resp = http
        .delete(format!("{base}/workers/1"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let resp = http
        .post(format!("{base}/debug/route"))
        .json(&json!({"model": "m", "prompt": [1, 2]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let resp = http
        .post(format!("{base}/workers"))
        .header("authorization", format!("Bearer {token}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_ne!(resp.status(), 401, "the right token is let through");
    // Reading stays open.
    let resp = http.get(format!("{base}/workers")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    router.shutdown().await;
}

#[tokio::test]
async fn admin_mutations_are_refused_on_a_non_loopback_public_listener_without_a_token() {
    let router = router_with(RouterConfig {
        listen: "0.0.0.0:0".parse().unwrap(),
        internal_bind: Some("127.0.0.1".parse().unwrap()),
        ..router_config(&[])
    })
    .await;
    let public = format!("http://127.0.0.1:{}", router.addr.port());
    let http = client();
    let body = json!({"url": "http://127.0.0.1:9", "model": "m"});
    let resp = http
        .post(format!("{public}/workers"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let text = resp.text().await.unwrap();
    assert!(text.contains("--admin-auth-token-file"), "{text}");
    // The internal listener serves the admin API (loopback here, so without a token).
    let internal = format!("http://{}", router.internal_addr);
    let resp = http
        .post(format!("{internal}/workers"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_ne!(resp.status(), 403);
    assert_ne!(
        resp.status(),
        404,
        "the internal listener serves POST /workers"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn the_internal_listeners_admin_api_sits_behind_its_token() {
    let token = "internal-token-0123456789";
    let router = router_with(RouterConfig {
        internal_auth_token: Some(Arc::from(token.as_bytes())),
        ..router_config(&[])
    })
    .await;
    let internal = format!("http://{}", router.internal_addr);
    let http = client();
    let resp = http
        .get(format!("{internal}/workers"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let resp = http
        .get(format!("{internal}/workers"))
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    router.shutdown().await;
}

#[tokio::test]
async fn an_internal_listener_on_a_non_loopback_address_without_a_token_refuses_to_start() {
    let refused = kvroute::serve(RouterConfig {
        internal_bind: Some("0.0.0.0".parse().unwrap()),
        ..router_config(&[])
    })
    .await;
    let err = match refused {
        Ok(_) => panic!("a router with an open non-loopback internal listener started"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("--internal-auth-token-file"), "{err}");
    let allowed = kvroute::serve(RouterConfig {
        internal_bind: Some("0.0.0.0".parse().unwrap()),
        allow_unauthenticated_internal: true,
        ..router_config(&[])
    })
    .await
    .expect("the explicit flag allows it");
    allowed.shutdown().await;
}

/// A tokenizer the operator named must load: a router that started without it would route the
/// model's text blind to the engines' caches. Both flags are checked at start-up, each named in
/// the refusal.
#[tokio::test]
async fn a_named_tokenizer_that_cannot_be_loaded_refuses_to_start() {
    let missing = std::env::temp_dir().join("kvroute-no-such-dir/tokenizer.json");
    for config in [
        RouterConfig {
            tokenizer_path: Some(missing.clone()),
            ..router_config(&[])
        },
        RouterConfig {
            model_tokenizers: [("m".to_string(), missing.clone())].into(),
            ..router_config(&[])
        },
    ] {
        let err = match kvroute::serve(config).await {
            Ok(_) => panic!("a router whose tokenizer cannot be loaded started"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("tokenizer") && err.contains("kvroute-no-such-dir"),
            "the refusal names the flag and the path: {err}"
        );
    }
}

#[tokio::test]
async fn a_502_tells_the_client_no_engine_url_or_os_error() {
    let fleet = fleet(1, 1, "m").await;
    let router = router_with(RouterConfig {
        policy: kvroute::routing::policy::PolicyKind::RoundRobin,
        max_retries: 0,
        ..router_config(&urls(&fleet))
    })
    .await;
    // The engine is registered; now it goes away, so the next request finds nobody there.
    fleet.shutdown().await;
    let resp = client()
        .post(format!("{}/v1/completions", router.url()))
        .json(&json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let request_id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 502, "{text}");
    assert!(!text.contains("127.0.0.1"), "{text}");
    assert!(!text.contains("os error"), "{text}");
    assert!(text.contains("x-request-id"), "{text}");
    assert!(!request_id.is_empty());
    router.shutdown().await;
}

#[test]
fn token_files_for_the_admin_api_are_read_like_the_internal_one() {
    let good = token_file("admin-good", "0123456789abcdef-admin");
    assert_eq!(
        &*kvroute::peer::internal::read_token_file(&good, "--admin-auth-token-file").unwrap(),
        b"0123456789abcdef-admin"
    );
    let short = token_file("admin-short", "short");
    let err =
        kvroute::peer::internal::read_token_file(&short, "--admin-auth-token-file").unwrap_err();
    assert!(err.contains("--admin-auth-token-file"), "{err}");
}

#[test]
fn logs_written_to_a_pipe_carry_no_colour_codes() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "--port",
            &port.to_string(),
            "--internal-port",
            &free_port().to_string(),
        ])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the kvroute binary starts");
    let stdout = child.stdout.take().expect("piped stdout");
    // Read lines until the start-up line; the process is killed whatever happens.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            let done = line.contains("kvroute listening");
            if tx.send(line).is_err() || done {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    let deadline = Instant::now() + LIMIT_ACTS_WITHIN * 4;
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        let done = line.contains("kvroute listening");
        seen.push(line);
        if done {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        seen.iter().any(|l| l.contains("kvroute listening")),
        "no start-up line within the deadline; saw {seen:?}"
    );
    assert!(
        seen.iter().all(|l| !l.contains('\u{1b}')),
        "colour codes in piped logs: {seen:?}"
    );
}

#[tokio::test]
async fn a_prompt_over_the_models_token_limit_is_a_400_that_names_the_limit() {
    let fleet = fleet(1, 1, "m").await;
    let router = router_with(RouterConfig {
        prompt_tokens_max: Some(8),
        ..router_config(&urls(&fleet))
    })
    .await;
    let url = format!("{}/v1/completions", router.url());
    // The message of the 400 a prompt gets, after checking its code.
    let refusal = |prompt: serde_json::Value| {
        let url = url.clone();
        async move {
            let resp = client()
                .post(&url)
                .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 400);
            let v: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
            v["error"]["message"].as_str().unwrap().to_string()
        }
    };
    let over: Vec<u32> = (1..=9).collect();
    let message = refusal(json!(over)).await;
    assert!(
        message.contains("9 tokens") && message.contains("limit of 8"),
        "{message}"
    );
    // A short text is tokenized, then held to the same limit with its exact count: 20
    // words are 100 bytes, too few for the length alone to prove more than 8 tokens (the
    // shipped tokenizer's longest token is 14 bytes).
    let message = refusal(json!("word ".repeat(20))).await;
    assert!(
        message.contains("has 2") && !message.contains("at least"),
        "a tokenized count: {message}"
    );
    // A longer one is refused from its length alone, before it is tokenized.
    let message = refusal(json!("word ".repeat(4_000))).await;
    assert!(
        message.contains("at least 1429 tokens (20000 bytes of text)")
            && message.contains("limit of 8"),
        "{message}"
    );
    let at_limit: Vec<u32> = (1..=8).collect();
    let resp = client()
        .post(&url)
        .json(&json!({"model": "m", "prompt": at_limit, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_text_past_the_tokenizing_cap_is_routed_on_load_and_forwarded_as_text() {
    let fleet = fleet(1, 1, "m").await;
    let router = router_with(RouterConfig {
        tokenize_text_bytes_max: 64,
        ..router_config(&urls(&fleet))
    })
    .await;
    let base = router.url();
    let untokenized =
        || async { metric_value(&metrics_text(&base).await, UNTOKENIZED_TEXT_TOO_LONG) };
    for (prompt, counted) in [("word ".repeat(12), None), ("word ".repeat(13), Some("1"))] {
        let resp = client()
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        // The engine answers either way: it tokenizes what it is sent.
        let status = resp.status();
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(status, 200, "{} bytes: {v}", prompt.len());
        assert!(
            v["usage"]["prompt_tokens"].as_u64().unwrap() >= 12,
            "the engine saw the whole prompt: {v}"
        );
        assert_eq!(
            untokenized().await.as_deref(),
            counted,
            "{} bytes against a cap of 64",
            prompt.len()
        );
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_large_body_waits_for_the_prepare_budget_and_is_answered_503_past_the_wait() {
    let fleet = fleet(1, 1, "m").await;
    let router = router_with(RouterConfig {
        tokenize_text_bytes_max: 64 * 1024,
        ..router_config(&urls(&fleet))
    })
    .await;
    // Other large bodies hold the whole budget (taken here directly, as their preparation
    // would), and a new one past the inline size must wait for it.
    let budget = &router.router.prepare_budget;
    let held = budget
        .clone()
        .acquire_many_owned(budget.available_permits() as u32)
        .await
        .unwrap();
    let ids: Vec<u32> = (0..20_000).collect();
    let body = json!({"model": "m", "prompt": ids, "max_tokens": 1});
    let url = format!("{}/v1/completions", router.url());
    let started = std::time::Instant::now();
    let resp = client().post(&url).json(&body).send().await.unwrap();
    let waited = started.elapsed();
    assert_eq!(resp.status(), 503);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "router_busy", "{v}");
    assert!(
        waited >= std::time::Duration::from_millis(kvroute::config::PREPARE_BUDGET_WAIT_MS_MAX),
        "answered after {waited:?}, before the {} ms wait",
        kvroute::config::PREPARE_BUDGET_WAIT_MS_MAX
    );
    // Once the budget is free, the same body is served.
    drop(held);
    let resp = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    router.shutdown().await;
    fleet.shutdown().await;
}

/// Sends `request` on a new connection and returns the answer's head (up to the blank line).
async fn head_of(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout(LIMIT_ACTS_WITHIN, stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&chunk[..n]),
            other => panic!(
                "no complete answer head ({other:?}); got {:?}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    String::from_utf8_lossy(&got).into()
}

#[tokio::test]
async fn both_servers_send_a_date_and_refuse_an_http_1_1_request_without_host() {
    let fleet = fleet(1, 1, "m").await;
    let router = router_with(router_config(&urls(&fleet))).await;
    let body = r#"{"model":"m","prompt":[1,2,3],"max_tokens":1}"#;
    // The hand-written path (a POST it takes) and hyper (a GET).
    let fast = head_of(
        router.addr,
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    let general = head_of(router.addr, b"GET /healthz HTTP/1.1\r\nhost: r\r\n\r\n").await;
    for (path, head) in [("hand-written", &fast), ("hyper", &general)] {
        assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}");
        assert!(
            head.to_ascii_lowercase().contains("\r\ndate: "),
            "{path} sends a Date: {head}"
        );
    }
    let no_host = head_of(
        router.addr,
        format!(
            "POST /v1/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    assert!(no_host.starts_with("HTTP/1.1 400"), "{no_host}");
    router.shutdown().await;
    fleet.shutdown().await;
}

/// While an answer is pending, bytes a client pipelines behind its request are kept for the
/// next request only up to `PIPELINED_BYTES_MAX`; past it the router stops reading, so the
/// client's writes stall on full socket buffers instead of growing the router's memory. The
/// engine holds the first answer (an armed head stall) so the window stays open. Without the
/// bound the router would read all 64 MB at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_pipelined_behind_a_pending_request_are_read_only_up_to_their_bound() {
    const PIPELINED_MB: usize = 64;
    const WRITE_WINDOW: Duration = Duration::from_secs(3);
    let fleet = fleet(1, 1, "m").await;
    let router = router_with(router_config(&urls(&fleet))).await;
    wait_subscribed(&router.url(), 1).await;
    let (status, _) = {
        let r = client()
            .post(format!("{}/control/stall", fleet.engines[0].http_url()))
            .json(&json!({"at": "head", "requests": 1, "stall_ms": 20_000}))
            .send()
            .await
            .expect("stall armed");
        (r.status().as_u16(), ())
    };
    assert_eq!(status, 200);
    let body = json!({"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 1}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let chunk = vec![b'a'; 64 * 1024];
    let mut written = 0usize;
    let started = Instant::now();
    while written < PIPELINED_MB * 1024 * 1024 {
        let left = WRITE_WINDOW.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, stream.write(&chunk)).await {
            Ok(Ok(n)) if n > 0 => written += n,
            Ok(other) => panic!("the router closed or failed the connection: {other:?}"),
            Err(_) => break,
        }
    }
    // What loopback socket buffers absorb (a few MB each way) plus the bound, far below 64 MB.
    assert!(
        written < 32 * 1024 * 1024,
        "the router read {written} pipelined bytes while the first answer was pending"
    );
    drop(stream);
    router.shutdown().await;
    fleet.shutdown().await;
}

/// A path the router does not serve is a 404 and a known path with another method a 405, both
/// in the OpenAI error shape, so a client (or a sibling mistakenly pointed at the public port)
/// is told "not here" rather than "your request is malformed".
#[tokio::test]
async fn an_unknown_route_is_404_and_a_wrong_method_405_in_the_error_shape() {
    let router = router_with(no_workers()).await;
    let base = router.url();
    let http = client();
    for (method, path, status, code) in [
        ("GET", "/internal/kv_snapshot", 404, "unknown_route"),
        ("POST", "/v1/embeddings", 404, "unknown_route"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("DELETE", "/readyz", 405, "method_not_allowed"),
    ] {
        let resp = http
            .request(
                reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
                format!("{base}{path}"),
            )
            .send()
            .await
            .expect("answered");
        assert_eq!(resp.status().as_u16(), status, "{method} {path}");
        let body: serde_json::Value = resp.json().await.expect("a JSON error body");
        assert_eq!(body["error"]["code"], code, "{method} {path}: {body}");
    }
    router.shutdown().await;
}
