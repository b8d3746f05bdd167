//! End-to-end tests of the router's proxy path against a simulated fleet over real sockets.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use kvroute::PolicyKind;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_is_a_404_in_the_openai_error_shape() {
    let fleet = fleet(1, 1, "m").await;
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    let (status, body, _) = post_json(
        &format!("{}/v1/completions", router.url()),
        &json!({"model": "nope", "prompt": "hi"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(body["error"]["param"], "model");
    assert!(body["error"]["type"].is_string() && body["error"]["message"].is_string());
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_requests_get_400_and_413() {
    let fleet = fleet(1, 1, "m").await;
    let cfg = kvroute::RouterConfig {
        max_body_bytes: 4096,
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let base = router.url();
    let http = client();
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (
            "/v1/completions",
            "{not json".into(),
            400,
            "invalid_request",
        ),
        ("/v1/completions", "[1,2]".into(), 400, "invalid_request"),
        (
            "/v1/completions",
            json!({"model": "m"}).to_string(),
            400,
            "missing_field",
        ),
        (
            "/v1/completions",
            json!({"model": 5, "prompt": "x"}).to_string(),
            400,
            "invalid_request",
        ),
        (
            "/v1/completions",
            json!({"model": "m", "prompt": {"a": 1}}).to_string(),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m"}).to_string(),
            400,
            "missing_field",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": "hi"}).to_string(),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"content": "x"}]}).to_string(),
            400,
            "invalid_request",
        ),
        (
            "/generate",
            json!({"input_ids": [1, -2]}).to_string(),
            400,
            "invalid_request",
        ),
        (
            "/generate",
            json!({"sampling_params": {}}).to_string(),
            400,
            "missing_field",
        ),
        (
            "/v1/completions",
            json!({"model": "m", "prompt": "x".repeat(5000)}).to_string(),
            413,
            "body_too_large",
        ),
        // Nested past serde's depth limit under a key the router does not read: a client
        // mistake (400), never an internal error.
        (
            "/v1/completions",
            format!(
                r#"{{"model":"m","prompt":[1],"x":{}{}}}"#,
                "[".repeat(1_000),
                "]".repeat(1_000)
            ),
            400,
            "invalid_request",
        ),
    ];
    for (path, body, want, code) in cases {
        let resp = http
            .post(format!("{base}{path}"))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let got: Value = resp.json().await.unwrap();
        assert_eq!(status, want, "{path} {body:.80} -> {got}");
        assert_eq!(got["error"]["code"], code, "{path} {body:.80} -> {got}");
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_with_no_reachable_worker_answers_503_and_the_router_is_not_ready() {
    // Nothing listens on port 9 (discard) on loopback here; the worker stays pending.
    let cfg = kvroute::RouterConfig {
        workers: vec![kvroute::WorkerSpec::parse("http://127.0.0.1:9@m").unwrap()],
        ..kvroute::RouterConfig::default()
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let (status, body, _) = post_json(
        &format!("{}/v1/completions", router.url()),
        &json!({"model": "m", "prompt": [1, 2, 3]}),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "no_healthy_worker");
    let ready = client()
        .get(format!("{}/readyz", router.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status().as_u16(), 503);
    let live = client()
        .get(format!("{}/healthz", router.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status().as_u16(), 200);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_and_chat_prompts_are_tokenized_like_the_engine_does() {
    let fleet = fleet(1, 1, "m").await;
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    let base = router.url();
    let chat = json!({"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "How do routers pick a backend?"}]});
    let (_, dbg, _) = post_json(&format!("{base}/debug/route"), &chat).await;
    let (status, resp, _) = post_json(&format!("{base}/v1/chat/completions"), &chat).await;
    assert_eq!(status, 200, "{resp}");
    assert!(dbg["prompt_tokens"].as_u64().unwrap() > 10);
    assert_eq!(
        dbg["prompt_tokens"], resp["usage"]["prompt_tokens"],
        "router and engine must see the same chat token sequence"
    );
    // A text /generate is forwarded as input_ids; the engine's count matches the router's.
    let gen_req = json!({"text": "The quick brown fox jumps over the lazy dog", "sampling_params": {"max_new_tokens": 2}});
    let (_, dbg, _) = post_json(&format!("{base}/debug/route"), &gen_req).await;
    let (status, resp, _) = post_json(&format!("{base}/generate"), &gen_req).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(dbg["prompt_tokens"], resp["meta_info"]["prompt_tokens"]);
    // A request without `model` goes to the only model.
    let (status, resp, _) = post_json(
        &format!("{base}/v1/completions"),
        &json!({"prompt": [5, 6, 7], "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{resp}");
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_chunks_reach_the_client_before_the_engine_finishes() {
    let cfg = kvroute_sim::SimConfig {
        instant: false,
        overhead_us: 0,
        prefill_us_per_token: 0,
        decode_us_per_token: 40_000,
        served_model_name: "m".into(),
        ..kvroute_sim::SimConfig::for_tests()
    };
    let fleet = kvroute_sim::start_fleet(cfg).await.unwrap();
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    let started = Instant::now();
    let resp = client()
        .post(format!("{}/v1/completions", router.url()))
        .header("x-request-id", "abc-123")
        .json(&json!({"model": "m", "prompt": "stream me", "max_tokens": 25, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(
        resp.headers()["x-request-id"],
        "abc-123",
        "request id must be propagated"
    );
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.expect("a chunk").unwrap();
    let first_at = started.elapsed();
    assert!(!first.is_empty());
    let mut chunks = 1;
    while let Some(c) = stream.next().await {
        c.unwrap();
        chunks += 1;
    }
    let done_at = started.elapsed();
    // 25 tokens at 40 ms each: the engine needs ~1 s; a buffering proxy would deliver the first
    // chunk only at the end.
    assert!(chunks > 3, "expected many chunks, got {chunks}");
    assert!(
        first_at * 3 < done_at,
        "first chunk at {first_at:?} but stream ended at {done_at:?}: the proxy buffered"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_is_retried_on_the_next_rank_and_then_ejected() {
    let fleet = fleet(2, 1, "m").await;
    let cfg = kvroute::RouterConfig {
        policy: PolicyKind::RoundRobin,
        eject_after_failures: 2,
        eject_cooldown_ms: 60_000,
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let dead_url = fleet.engines[0].http_url();
    fleet.engines[0].shutdown().await;
    for i in 0..4 {
        let (status, body, headers) = post_json(
            &format!("{}/v1/completions", router.url()),
            &json!({"model": "m", "prompt": [1, 2, 3, i], "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "request {i}: {body}");
        assert!(
            !decision(&headers).contains(&dead_url),
            "served by the dead engine? {}",
            decision(&headers)
        );
    }
    let metrics = metrics_text(&router.url()).await;
    assert!(
        metrics.contains("kvroute_retries_total"),
        "no retry recorded:\n{metrics}"
    );
    let workers: Value = client()
        .get(format!("{}/workers", router.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let dead = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == dead_url.as_str())
        .unwrap();
    assert_eq!(dead["health"], "ejected", "{dead}");
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn active_health_checks_take_a_stopped_engine_down_and_a_restarted_one_back() {
    let fleet1 = fleet(1, 1, "m").await;
    let port = fleet1.engines[0].ports().http;
    let cfg = kvroute::RouterConfig {
        health_interval_ms: 50,
        health_timeout_ms: 200,
        ..router_config(&urls(&fleet1))
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let workers_url = format!("{}/workers", router.url());
    let health = || async {
        let v: Value = client()
            .get(&workers_url)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        Ok::<String, String>(
            v["workers"][0]["health"]
                .as_str()
                .unwrap_or("?")
                .to_string(),
        )
    };
    fleet1.shutdown().await;
    wait_until(
        "the stopped engine to be marked down",
        WAIT_DEADLINE,
        || async {
            let h = health().await?;
            if h == "down" { Ok(()) } else { Err(h) }
        },
    )
    .await;
    let (status, _, _) = post_json(
        &format!("{}/v1/completions", router.url()),
        &json!({"model": "m", "prompt": [1], "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 503);
    let cfg = kvroute_sim::SimConfig {
        port,
        served_model_name: "m".into(),
        ..kvroute_sim::SimConfig::for_tests()
    };
    let fleet2 = kvroute_sim::start_fleet(cfg).await.unwrap();
    wait_until(
        "the restarted engine to be healthy again",
        WAIT_DEADLINE,
        || async {
            let h = health().await?;
            if h == "healthy" { Ok(()) } else { Err(h) }
        },
    )
    .await;
    let (status, body, _) = post_json(
        &format!("{}/v1/completions", router.url()),
        &json!({"model": "m", "prompt": [1], "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    router.shutdown().await;
    fleet2.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_added_and_removed_through_the_admin_api_are_routed_to_accordingly() {
    let fleet = fleet(2, 1, "m").await;
    let u = urls(&fleet);
    let router = kvroute::serve(router_config(&u[..1])).await.unwrap();
    let base = router.url();
    let (status, added, _) = post_json(&format!("{base}/workers"), &json!({"url": u[1]})).await;
    assert_eq!(status, 201, "{added}");
    assert_eq!(added["model"], "m", "model learned from /server_info");
    let (status, _, _) = post_json(&format!("{base}/workers"), &json!({"url": u[1]})).await;
    assert_eq!(status, 409, "a duplicate registration must be refused");
    let (status, _, _) = post_json(&format!("{base}/workers"), &json!({"model": "m"})).await;
    assert_eq!(status, 400);
    let listed: Value = client()
        .get(format!("{base}/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["workers"].as_array().unwrap().len(), 2);
    let first_id = listed["workers"][0]["id"].as_u64().unwrap();
    let resp = client()
        .delete(format!("{base}/workers/{first_id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let resp = client()
        .delete(format!("{base}/workers/{first_id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    for i in 0..6 {
        let (status, body, headers) = post_json(
            &format!("{base}/v1/completions"),
            &json!({"model": "m", "prompt": [i, 1, 2], "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert!(
            decision(&headers).contains(&format!("url={};", u[1])),
            "{}",
            decision(&headers)
        );
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_is_served_by_its_own_worker_group() {
    let fleet_a = fleet(1, 1, "alpha").await;
    let fleet_b = fleet(1, 2, "beta").await;
    let all: Vec<String> = urls(&fleet_a).into_iter().chain(urls(&fleet_b)).collect();
    let router = kvroute::serve(router_config(&all)).await.unwrap();
    let base = router.url();
    let models: Value = client()
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, vec!["alpha", "beta"]);
    for (model, url) in [("alpha", &all[0]), ("beta", &all[1])] {
        for i in 0..3 {
            let (status, body, headers) = post_json(
                &format!("{base}/v1/completions"),
                &json!({"model": model, "prompt": [i, 9, 9], "max_tokens": 1}),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            assert!(
                decision(&headers).contains(&format!("url={url};")),
                "{model}: {}",
                decision(&headers)
            );
        }
    }
    // Several models and no `model`: the router cannot guess.
    let (status, body, _) =
        post_json(&format!("{base}/v1/completions"), &json!({"prompt": [1]})).await;
    assert_eq!(status, 400, "{body}");
    router.shutdown().await;
    fleet_a.shutdown().await;
    fleet_b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chosen_dp_rank_is_sent_to_the_engine_and_honoured() {
    let fleet = fleet(1, 4, "m").await;
    let cfg = kvroute::RouterConfig {
        policy: PolicyKind::RoundRobin,
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..8 {
        let (status, body, headers) = post_json(
            &format!("{}/generate", router.url()),
            &json!({"input_ids": [i, 2, 3], "sampling_params": {"max_new_tokens": 1}}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let d = decision(&headers);
        let routed: u64 = d
            .split("dp_rank=")
            .nth(1)
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            body["meta_info"]["dp_rank"].as_u64(),
            Some(routed),
            "engine ran on another rank: {d}"
        );
        seen.insert(routed);
    }
    assert_eq!(seen.len(), 4, "round robin must reach every rank: {seen:?}");
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_route_scores_every_rank_without_forwarding() {
    let fleet = fleet(2, 2, "m").await;
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    let (status, v, _) = post_json(
        &format!("{}/debug/route", router.url()),
        &json!({"model": "m", "prompt": "hello there, router"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    assert_eq!(v["policy"], "cache_aware");
    assert!(ranks.iter().all(|r| r["cost_ms"].as_f64().unwrap() > 0.0));
    let chosen = &v["chosen"];
    assert!(ranks.iter().any(|r| r["order"] == 0
        && r["url"] == chosen["url"]
        && r["dp_rank"] == chosen["dp_rank"]));
    let workers: Value = client()
        .get(format!("{}/workers", router.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let dispatched: u64 = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| {
            w["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["dispatched_total"].as_u64().unwrap())
        })
        .sum();
    assert_eq!(dispatched, 0, "/debug/route must not forward");
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_expose_requests_decisions_latency_matches_and_in_flight() {
    let fleet = fleet(1, 1, "m").await;
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    let (status, _, _) = post_json(
        &format!("{}/v1/completions", router.url()),
        &json!({"model": "m", "prompt": "x y z", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _, _) = post_json(
        &format!("{}/v1/chat/completions", router.url()),
        &json!({"model": "m", "max_tokens": 1,
            "messages": [{"role": "user", "content": "x y z"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let text = metrics_text(&router.url()).await;
    for series in [
        "kvroute_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
        "kvroute_routing_decisions_total{policy=\"cache_aware\"",
        "kvroute_routing_latency_seconds_bucket",
        // One text prompt and one chat tokenized, each timed once under its kind.
        "kvroute_tokenize_seconds_count{kind=\"prompt\"} 1",
        "kvroute_tokenize_seconds_count{kind=\"chat\"} 1",
        "kvroute_matched_blocks_bucket",
        "kvroute_in_flight_requests{",
    ] {
        assert!(text.contains(series), "missing {series} in:\n{text}");
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

/// Waits (5 s at most) until `count` reads 0, naming `what` and the last count on failure.
async fn wait_until_zero(what: &str, count: impl Fn() -> u64) {
    wait_until(what, Duration::from_secs(5), || {
        let n = count();
        async move {
            if n == 0 {
                Ok(())
            } else {
                Err(format!("count={n}"))
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_cancels_the_engine_request_and_releases_the_rank() {
    let cfg = kvroute_sim::SimConfig {
        instant: false,
        overhead_us: 0,
        prefill_us_per_token: 0,
        decode_us_per_token: 50_000,
        served_model_name: "m".into(),
        ..kvroute_sim::SimConfig::for_tests()
    };
    let fleet = kvroute_sim::start_fleet(cfg).await.unwrap();
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    let in_flight = |r: &kvroute::Router| -> i64 {
        r.registry.workers()[0].ranks[0]
            .in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let resp = client()
        .post(format!("{}/v1/completions", router.url()))
        .json(&json!({"model": "m", "prompt": "long one", "max_tokens": 200, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    assert_eq!(in_flight(&router.router), 1);
    let engine = fleet.engines[0].engine().clone();
    let engine_running = |e: &kvroute_sim::Engine| -> u64 {
        (0..e.dp_size())
            .map(|r| e.load_stat(r).num_running_reqs)
            .sum()
    };
    assert_eq!(
        engine_running(&engine),
        1,
        "the engine runs the request while the client streams"
    );
    drop(stream);
    let r = router.router.clone();
    wait_until_zero("in-flight to return to 0 after the client hung up", || {
        in_flight(&r) as u64
    })
    .await;
    // The engine side: the generation (200 tokens x 50 ms = 10 s) must stop long before it
    // would finish, i.e. the router closed the upstream request when its client went away.
    wait_until_zero(
        "the engine's running request to be cancelled after the client hung up",
        || engine_running(&engine),
    )
    .await;
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_engine_answers_504_after_the_request_timeout() {
    let cfg = kvroute_sim::SimConfig {
        instant: false,
        overhead_us: 0,
        prefill_us_per_token: 0,
        decode_us_per_token: 100_000,
        served_model_name: "m".into(),
        ..kvroute_sim::SimConfig::for_tests()
    };
    let fleet = kvroute_sim::start_fleet(cfg).await.unwrap();
    let router_cfg = kvroute::RouterConfig {
        request_timeout_ms: 200,
        decision_header: false,
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(router_cfg).await.unwrap();
    // Non-streaming: headers come only when all 50 tokens (5 s) are decoded.
    let (status, body, headers) = post_json(
        &format!("{}/v1/completions", router.url()),
        &json!({"model": "m", "prompt": [1, 2], "max_tokens": 50}),
    )
    .await;
    assert_eq!(status, 504, "{body}");
    assert_eq!(body["error"]["code"], "gateway_timeout");
    assert!(
        headers.get("x-request-id").is_some(),
        "a request id is generated when absent"
    );
    // A fast request works, and the decision header stays off unless enabled.
    let (status, _, headers) = post_json(
        &format!("{}/v1/completions", router.url()),
        &json!({"model": "m", "prompt": [1, 2], "max_tokens": 0}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(headers.get("x-kvroute-decision").is_none());
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_rank_is_unreachable_the_client_gets_a_502() {
    let fleet = fleet(2, 1, "m").await;
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    fleet.shutdown().await;
    let (status, body, _) = post_json(
        &format!("{}/v1/completions", router.url()),
        &json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "bad_gateway");
    router.shutdown().await;
}
