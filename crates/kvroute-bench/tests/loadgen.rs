//! End-to-end properties of the load generator against a real HTTP/1.1 server on loopback (an
//! in-process hyper server whose behaviour each test chooses: the status, and one deliberate
//! stall, which stands in for a server hiccup).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kvroute_bench::load::{self, LoadConfig, LoadError, Mode, Target};
use tokio::net::TcpListener;

#[derive(Clone, Copy)]
struct Behaviour {
    status: StatusCode,
    /// The request with this number (0-based, counted by the server) is answered late.
    stall_request: Option<u64>,
    stall: Duration,
}

/// Starts the server; returns its address and the number of bodies it has fully received.
async fn server(b: Behaviour) -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(AtomicU64::new(0));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let seen = seen2.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let _ = req.into_body().collect().await;
                        let n = seen.fetch_add(1, Ordering::SeqCst);
                        if b.stall_request == Some(n) {
                            tokio::time::sleep(b.stall).await;
                        }
                        let mut resp = Response::new(Full::new(Bytes::from_static(b"{}")));
                        *resp.status_mut() = b.status;
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

fn config(addr: &str, mode: Mode, connections: usize, duration: Duration) -> LoadConfig {
    LoadConfig {
        target: Target::parse(&format!("http://{addr}/v1/completions")).unwrap(),
        body: Bytes::from_static(br#"{"prompt":[1,2,3]}"#),
        headers: vec![],
        mode,
        connections,
        duration,
        max_requests: None,
        warmup: Duration::ZERO,
        request_timeout_ms: 5_000,
    }
}

const OK: Behaviour = Behaviour {
    status: StatusCode::OK,
    stall_request: None,
    stall: Duration::ZERO,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_sends_exactly_the_scheduled_requests() {
    let (addr, seen) = server(OK).await;
    let cfg = config(
        &addr,
        Mode::Open { rate_per_s: 200.0 },
        4,
        Duration::from_secs(1),
    );
    let r = load::run(cfg).await.unwrap();
    assert_eq!(r.recorded, 200, "report: {r:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 200, "server-side count");
    assert_eq!(
        r.not_sent + r.errors_io + r.errors_status + r.errors_timeout,
        0
    );
    // 200 requests spread over the schedule: the first is due at 0 and the last at 0.995 s.
    assert!(
        r.measured_window_s >= 0.99,
        "requests must follow the clock, window {}",
        r.measured_window_s
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stall_is_charged_to_every_request_it_delayed() {
    // One connection at 100 req/s; request 20 is answered 300 ms late. Every request due during
    // the stall waits behind it, so ~30 of 100 requests are late by 10-300 ms. A generator that
    // timed from the actual send would show only one slow request (coordinated omission).
    let (addr, _) = server(Behaviour {
        status: StatusCode::OK,
        stall_request: Some(20),
        stall: Duration::from_millis(300),
    })
    .await;
    let cfg = config(
        &addr,
        Mode::Open { rate_per_s: 100.0 },
        1,
        Duration::from_secs(1),
    );
    let r = load::run(cfg).await.unwrap();
    assert_eq!(r.recorded, 100, "report: {r:?}");
    assert!(
        r.latency_us.p90 >= 100_000.0,
        "the p90 must include the queue behind the stall: {:?}",
        r.latency_us
    );
    assert!(
        r.latency_us.max >= 300_000.0,
        "the stalled request itself: {:?}",
        r.latency_us
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_counts_non_2xx_answers_as_errors_not_latency() {
    let (addr, seen) = server(Behaviour {
        status: StatusCode::SERVICE_UNAVAILABLE,
        ..OK
    })
    .await;
    let mut cfg = config(&addr, Mode::Closed, 2, Duration::ZERO);
    cfg.max_requests = Some(50);
    let r = load::run(cfg).await.unwrap();
    assert_eq!(r.recorded, 0, "report: {r:?}");
    assert_eq!(r.errors_status, 50, "report: {r:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 50);
    assert_eq!(r.first_error.as_deref(), Some("HTTP 503"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_with_a_request_count_stops_at_the_count() {
    let (addr, seen) = server(OK).await;
    let mut cfg = config(&addr, Mode::Closed, 8, Duration::ZERO);
    cfg.max_requests = Some(1_000);
    let r = load::run(cfg).await.unwrap();
    assert_eq!(r.recorded, 1_000, "report: {r:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 1_000);
    assert!(r.req_per_s > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_target_fails_before_the_clock_starts() {
    // Bind then drop a listener so the port is (very likely) closed.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = config(
        &format!("127.0.0.1:{port}"),
        Mode::Closed,
        1,
        Duration::from_secs(1),
    );
    match load::run(cfg).await {
        Err(LoadError::Connect { .. }) => {}
        other => panic!("expected a connect error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_rates_and_connection_counts_are_refused() {
    let (addr, _) = server(OK).await;
    let bad_rate = config(
        &addr,
        Mode::Open { rate_per_s: 0.0 },
        1,
        Duration::from_secs(1),
    );
    assert!(matches!(
        load::run(bad_rate).await,
        Err(LoadError::BadRate(_))
    ));
    let bad_conns = config(&addr, Mode::Closed, 0, Duration::from_secs(1));
    assert!(matches!(
        load::run(bad_conns).await,
        Err(LoadError::BadConnections(0))
    ));
}
