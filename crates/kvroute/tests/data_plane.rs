//! The data plane's contract over real sockets: client connections are dealt evenly to the
//! data-plane threads, admin calls made through a data-plane thread still work, a request in
//! flight at shutdown finishes within the grace period, and a stream still open when the grace
//! period ends is cut off so shutdown cannot hang.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// One raw HTTP/1.1 request on a NEW connection (the acceptor deals connections, not
/// requests, so each call is one hand-off).
fn get_on_new_connection(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
}

#[tokio::test]
async fn connections_are_dealt_evenly_across_data_plane_threads() {
    let fleet = fleet(1, 1, "m").await;
    let cfg = kvroute::RouterConfig {
        data_plane_threads: 3,
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(cfg).await.expect("router starts");
    let addr = router.addr;
    for _ in 0..6 {
        let response = tokio::task::spawn_blocking(move || get_on_new_connection(addr, "/healthz"))
            .await
            .expect("join");
        assert!(response.starts_with("HTTP/1.1 200"), "got {response}");
    }
    let text = metrics_text(&router.url()).await;
    let mut per_thread: Vec<(String, f64)> = text
        .lines()
        .filter(|l| l.starts_with("kvroute_data_plane_connections_total{"))
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("sample line");
            (series.to_string(), value.parse().expect("number"))
        })
        .collect();
    per_thread.sort_by(|a, b| a.0.cmp(&b.0));
    // The metrics request itself is a seventh connection, counted before it is served.
    let total: f64 = per_thread.iter().map(|(_, v)| v).sum();
    assert_eq!(per_thread.len(), 3, "one series per thread: {per_thread:?}");
    assert_eq!(total, 7.0, "every connection counted once: {per_thread:?}");
    for (series, v) in &per_thread {
        assert!(
            (2.0..=3.0).contains(v),
            "round-robin dealing gives each of 3 threads 2 or 3 of 7 connections; {series} got {v}"
        );
    }
    router.shutdown().await;
}

#[tokio::test]
async fn an_admin_call_through_a_data_plane_thread_registers_a_live_worker() {
    // POST /workers runs on the control runtime (it spawns the worker's KV subscribers there);
    // the worker must end up registered, subscribed and routable.
    let fleet = fleet(1, 1, "m").await;
    let cfg = kvroute::RouterConfig {
        workers: Vec::new(),
        data_plane_threads: 2,
        ..router_config(&[])
    };
    let router = kvroute::serve(cfg).await.expect("router starts");
    let base = router.url();
    let resp = client()
        .post(format!("{base}/workers"))
        .json(&json!({ "url": fleet.engines[0].http_url() }))
        .send()
        .await
        .expect("admin call");
    assert!(
        resp.status().is_success(),
        "POST /workers answered {}",
        resp.status()
    );
    wait_subscribed(&base, 1).await;
    let (status, body, _) = post_json(
        &format!("{base}/v1/completions"),
        &json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "routed through the new worker: {body}");
    router.shutdown().await;
}

#[tokio::test]
async fn a_request_in_flight_at_shutdown_finishes_and_a_stream_past_the_grace_is_cut() {
    // Decoding takes 100 ms per token: a 3-token request is in flight for ~300 ms, a
    // 4,000-token stream would take ~7 minutes.
    let cfg = kvroute_sim::SimConfig {
        engines: 1,
        dp_size: 1,
        served_model_name: "m".into(),
        decode_us_per_token: 100_000,
        instant: false,
        ..kvroute_sim::SimConfig::for_tests()
    };
    let fleet = kvroute_sim::start_fleet(cfg).await.expect("fleet starts");
    let grace_ms = 1_500;
    let router_cfg = kvroute::RouterConfig {
        shutdown_grace_ms: grace_ms,
        data_plane_threads: 2,
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(router_cfg).await.expect("router starts");
    let base = router.url();

    let endless = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4_000, "stream": true}))
        .send()
        .await
        .expect("stream starts");
    assert_eq!(endless.status(), 200);
    let short = tokio::spawn(post_json_owned(
        format!("{base}/v1/completions"),
        json!({"model": "m", "prompt": [4, 5, 6], "max_tokens": 3}),
    ));
    let engine = fleet.engines[0].engine().clone();
    wait_until(
        "both requests in flight at the engine",
        WAIT_DEADLINE,
        || {
            let engine = engine.clone();
            async move {
                let running: u64 = (0..engine.dp_size())
                    .map(|r| engine.load_stat(r).num_running_reqs)
                    .sum();
                if running >= 2 {
                    Ok(())
                } else {
                    Err(format!("{running} running"))
                }
            }
        },
    )
    .await;

    let started = Instant::now();
    tokio::time::timeout(Duration::from_millis(grace_ms + 10_000), router.shutdown())
        .await
        .expect("shutdown returns soon after its grace period even with a stream still open");
    let took = started.elapsed();
    let (status, body) = short.await.expect("join");
    assert_eq!(
        status, 200,
        "a request in flight when shutdown began finishes: {body}"
    );
    assert!(
        took >= Duration::from_millis(grace_ms) && took < Duration::from_millis(grace_ms + 5_000),
        "shutdown waits out the grace period for the open stream, then cuts it: took {took:?}"
    );
    let rest = tokio::time::timeout(Duration::from_secs(5), endless.bytes()).await;
    match rest {
        Ok(Ok(bytes)) => {
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                !text.contains("[DONE]"),
                "the endless stream cannot have finished normally"
            );
        }
        Ok(Err(_)) => {} // cut mid-body: the expected outcome
        Err(_) => panic!("the stream is still open 5 s after shutdown returned"),
    }
}

async fn post_json_owned(url: String, body: serde_json::Value) -> (u16, serde_json::Value) {
    let (status, body, _) = post_json(&url, &body).await;
    (status, body)
}
