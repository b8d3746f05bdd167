//! The simulator's HTTP API over real sockets: every endpoint's shape, SSE streaming, prefix
//! reuse reported as cached tokens, timing, and bad input mapped to OpenAI error objects.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvroute_sim::SimConfig;
use serde_json::{Value, json};

async fn sse_events(url: String, body: Value) -> Vec<String> {
    let resp = client().post(url).json(&body).send().await.expect("sent");
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = resp.text().await.expect("stream read to its end");
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "stream must end in [DONE]: {text:?}"
    );
    text.split("\n\n")
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("every SSE event is a data line: {s:?}"))
                .to_string()
        })
        .collect()
}

#[tokio::test]
async fn completions_accept_text_ids_and_lists_and_report_usage() {
    let fleet = fleet(SimConfig::for_tests()).await;
    let e = &fleet.engines[0];
    for prompt in [
        json!("The router keeps a radix tree"),
        json!([5, 6, 7, 8]),
        json!(["The router keeps a radix tree", "ignored second prompt"]),
        json!([[5, 6, 7, 8]]),
    ] {
        let (status, body) = post(
            e,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 5}),
        )
        .await;
        assert_eq!(status, 200, "{prompt}: {body}");
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        let text = body["choices"][0]["text"].as_str().unwrap();
        assert_eq!(
            text.split_whitespace().count(),
            5,
            "5 word tokens: {text:?}"
        );
        let u = &body["usage"];
        assert_eq!(u["completion_tokens"], 5);
        assert_eq!(
            u["total_tokens"].as_u64().unwrap(),
            u["prompt_tokens"].as_u64().unwrap() + 5
        );
        assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
    }
    let (_, body) = post(e, "/v1/completions", &json!({"prompt": [5, 6, 7, 8]})).await;
    assert_eq!(
        body["usage"]["completion_tokens"], 16,
        "max_tokens defaults to 16"
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn output_is_deterministic_for_a_prompt() {
    let fleet = fleet(SimConfig {
        engines: 2,
        ..SimConfig::for_tests()
    })
    .await;
    let req = json!({"prompt": "same prompt", "max_tokens": 8});
    let (_, a) = post(&fleet.engines[0], "/v1/completions", &req).await;
    let (_, b) = post(&fleet.engines[1], "/v1/completions", &req).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    fleet.shutdown().await;
}

#[tokio::test]
async fn cached_tokens_grow_when_a_prompt_repeats_or_extends() {
    let fleet = fleet(SimConfig::for_tests()).await; // block size 16
    let e = &fleet.engines[0];
    let cached = |body: &Value| body["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let p = toks(1, 40);
    let (_, first) = post(e, "/v1/completions", &json!({"prompt": p, "max_tokens": 1})).await;
    assert_eq!(cached(&first), 0);
    let (_, again) = post(e, "/v1/completions", &json!({"prompt": p, "max_tokens": 1})).await;
    assert_eq!(cached(&again), 32, "two full blocks of 16 are reused");
    let longer = toks(1, 70);
    let (_, ext) = post(
        e,
        "/v1/completions",
        &json!({"prompt": longer, "max_tokens": 1}),
    )
    .await;
    assert_eq!(cached(&ext), 32);
    let (_, ext2) = post(
        e,
        "/v1/completions",
        &json!({"prompt": longer, "max_tokens": 1}),
    )
    .await;
    assert_eq!(cached(&ext2), 64);
    fleet.shutdown().await;
}

#[tokio::test]
async fn chat_renders_the_template_and_repeated_conversations_hit_the_cache() {
    let fleet = fleet(SimConfig::for_tests()).await;
    let e = &fleet.engines[0];
    let req = json!({
        "model": "kvroute-sim",
        "messages": [
            {"role": "system", "content": "You are a careful assistant that answers questions about routers and caches."},
            {"role": "user", "content": [{"type": "text", "text": "Why does a cache aware router keep a prefix tree of blocks?"}]}
        ],
        "max_completion_tokens": 3
    });
    let (status, first) = post(e, "/v1/chat/completions", &req).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["choices"][0]["message"]["role"], "assistant");
    assert_eq!(first["usage"]["completion_tokens"], 3);
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 16, "{first}");
    let (_, second) = post(e, "/v1/chat/completions", &req).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        prompt_tokens / 16 * 16
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn streaming_completions_and_chat_send_sse_chunks_ending_in_done() {
    let fleet = fleet(SimConfig::for_tests()).await;
    let e = &fleet.engines[0];
    let events = sse_events(
        format!("{}/v1/completions", e.http_url()),
        json!({"prompt": "stream me", "max_tokens": 4, "stream": true,
               "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    assert_eq!(chunks.len(), 5, "4 tokens + usage: {chunks:?}");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 4);
    let streamed: String = chunks[..4]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    let (_, plain) = post(
        e,
        "/v1/completions",
        &json!({"prompt": "stream me", "max_tokens": 4}),
    )
    .await;
    assert_eq!(streamed, plain["choices"][0]["text"].as_str().unwrap());

    let events = sse_events(
        format!("{}/v1/chat/completions", e.http_url()),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true}),
    )
    .await;
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        events.len(),
        1 + 2 + 1,
        "role chunk, 2 tokens, [DONE]: {events:?}"
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn generate_serves_sglang_shapes_plain_and_streaming() {
    let fleet = fleet(SimConfig::for_tests()).await;
    let e = &fleet.engines[0];
    let (status, body) = post(
        e,
        "/generate",
        &json!({"text": "hello engine", "sampling_params": {"max_new_tokens": 3}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["output_ids"].as_array().unwrap().len(), 3);
    assert_eq!(body["meta_info"]["completion_tokens"], 3);
    assert_eq!(body["meta_info"]["finish_reason"]["type"], "length");
    let (_, by_ids) = post(
        e,
        "/generate",
        &json!({"input_ids": toks(3, 20), "sampling_params": {"max_new_tokens": 0}}),
    )
    .await;
    assert_eq!(by_ids["meta_info"]["prompt_tokens"], 20);
    assert_eq!(by_ids["text"], "");
    let events = sse_events(
        format!("{}/generate", e.http_url()),
        json!({"input_ids": toks(3, 20), "sampling_params": {"max_new_tokens": 3}, "stream": true}),
    )
    .await;
    assert_eq!(events.len(), 4, "{events:?}");
    let last: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(
        last["output_ids"].as_array().unwrap().len(),
        3,
        "cumulative output"
    );
    assert_eq!(last["meta_info"]["cached_tokens"], 16);
    fleet.shutdown().await;
}

#[tokio::test]
async fn models_health_and_server_info_describe_the_engine() {
    let fleet = fleet(SimConfig {
        dp_size: 2,
        load_publish: true,
        topic: "kv".into(),
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let (status, _) = get(e, "/health").await;
    assert_eq!(status, 200);
    let (_, models) = get(e, "/v1/models").await;
    assert_eq!(models["data"][0]["id"], "kvroute-sim");
    let (_, info) = get(e, "/server_info").await;
    let kv = &info["kv_events"];
    let port = |ep: String| ep.rsplit(':').next().unwrap().parse::<u64>().unwrap();
    assert_eq!(kv["publisher"], "zmq");
    assert_eq!(kv["endpoint_host"], "127.0.0.1");
    assert_eq!(
        kv["endpoint_port_base"].as_u64().unwrap(),
        port(e.kv_endpoint(0))
    );
    assert_eq!(
        kv["replay_endpoint_port_base"].as_u64().unwrap(),
        port(e.replay_endpoint(0))
    );
    assert_eq!(
        kv["load_endpoint_port_base"].as_u64().unwrap(),
        port(e.load_endpoint(0).unwrap())
    );
    assert_eq!(kv["load_topic"], "load");
    assert_eq!(kv["topic"], "kv");
    assert_eq!(kv["block_size"], 16);
    assert_eq!(kv["dp_size"], 2);
    assert_eq!(info["served_model_name"], "kvroute-sim");
    fleet.shutdown().await;
}

#[tokio::test]
async fn bad_input_gets_openai_errors_with_the_right_status() {
    let fleet = fleet(SimConfig {
        max_body_bytes: 4096,
        dp_size: 2,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> = vec![
        ("/v1/completions", b"{not json".to_vec(), 400, None),
        (
            "/v1/completions",
            br#"{"max_tokens": 4}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        ("/v1/completions", br#"{"prompt": 42}"#.to_vec(), 400, None),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": "many"}"#.to_vec(),
            400,
            None,
        ),
        (
            "/v1/completions",
            br#"{"prompt": [-1, 2]}"#.to_vec(),
            400,
            None,
        ),
        (
            "/v1/completions",
            br#"{"prompt": ""}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": 100000000}"#.to_vec(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "data_parallel_rank": 2}"#.to_vec(),
            400,
            Some("data_parallel_rank"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": []}"#.to_vec(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": 1}]}"#.to_vec(),
            400,
            None,
        ),
        (
            "/generate",
            br#"{"sampling_params": {}}"#.to_vec(),
            400,
            Some("text"),
        ),
        (
            "/v1/completions",
            format!(r#"{{"prompt": "{}"}}"#, "a".repeat(5000)).into_bytes(),
            413,
            None,
        ),
    ];
    for (path, body, want, param) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(60)]).to_string();
        let (status, err) = post_raw(e, path, body).await;
        assert_eq!(status, want, "{path} {shown}: {err}");
        let obj = &err["error"];
        assert!(obj["message"].is_string(), "{path} {shown}: {err}");
        assert!(obj["type"].is_string(), "{err}");
        assert_eq!(obj["code"], want, "{err}");
        if let Some(p) = param {
            assert_eq!(obj["param"], p, "{path} {shown}: {err}");
        }
    }
    // Unknown endpoints and wrong methods get error objects too.
    let (status, err) = get(e, "/v1/nope").await;
    assert_eq!(
        (status, err["error"]["type"].as_str()),
        (404, Some("not_found_error"))
    );
    let (status, err) = get(e, "/v1/completions").await;
    assert_eq!((status, err["error"]["code"].as_u64()), (405, Some(405)));
    // Unknown fields are ignored, as OpenAI-compatible servers do.
    let (status, _) = post(
        e,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1, "frobnicate": true}),
    )
    .await;
    assert_eq!(status, 200);
    // A bad rank header is refused too.
    let resp = client()
        .post(format!("{}/v1/completions", e.http_url()))
        .header("x-data-parallel-rank", "one")
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    fleet.shutdown().await;
}

#[tokio::test]
async fn rank_header_routes_to_that_rank() {
    let fleet = fleet(SimConfig {
        dp_size: 2,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let resp = client()
        .post(format!("{}/generate", e.http_url()))
        .header("x-data-parallel-rank", "1")
        .json(&json!({"input_ids": toks(1, 16), "sampling_params": {"max_new_tokens": 1}}))
        .send()
        .await
        .unwrap();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["meta_info"]["dp_rank"], 1);
    assert_eq!((e.last_seq(0), e.last_seq(1)), (-1, 0));
    fleet.shutdown().await;
}

#[tokio::test]
async fn control_endpoints_do_not_exist_unless_enabled() {
    let fleet = fleet(SimConfig {
        enable_control: false,
        ..SimConfig::for_tests()
    })
    .await;
    let (status, body) = post(&fleet.engines[0], "/control/flush", &json!({})).await;
    assert_eq!(status, 404, "{body}");
    fleet.shutdown().await;
}

#[tokio::test]
async fn uncached_prefill_takes_longer_than_a_cached_one() {
    // Timing model: 100 us per uncached token makes a 512-token prefill ~51 ms; the cached
    // repeat pays only the overhead. Compared with each other, not with a fixed bound.
    let fleet = fleet(SimConfig {
        instant: false,
        overhead_us: 1000,
        prefill_us_per_token: 100,
        decode_us_per_token: 0,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let req = json!({"prompt": toks(1, 512), "max_tokens": 1});
    let t0 = Instant::now();
    post(e, "/v1/completions", &req).await;
    let cold = t0.elapsed();
    let t1 = Instant::now();
    let (_, body) = post(e, "/v1/completions", &req).await;
    let warm = t1.elapsed();
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 512);
    assert!(cold >= Duration::from_millis(50), "cold prefill {cold:?}");
    assert!(warm < cold, "warm {warm:?} vs cold {cold:?}");
    fleet.shutdown().await;
}

#[tokio::test]
async fn shutdown_drains_an_in_flight_request() {
    let fleet = fleet(SimConfig {
        instant: false,
        overhead_us: 0,
        prefill_us_per_token: 0,
        decode_us_per_token: 20_000,
        ..SimConfig::for_tests()
    })
    .await;
    let url = format!("{}/v1/completions", fleet.engines[0].http_url());
    let in_flight = tokio::spawn(async move {
        client()
            .post(url)
            .json(&json!({"prompt": "slow", "max_tokens": 10}))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    let e = &fleet.engines[0];
    wait_until(
        "the request to be running",
        async || e.engine().load_stat(0).num_running_reqs,
        |n| *n == 1,
    )
    .await;
    fleet.shutdown().await;
    assert_eq!(
        in_flight.await.unwrap().expect("answered, not cut off"),
        200
    );
}

#[tokio::test]
async fn control_store_caches_chains_and_reports_the_published_seq() {
    let fleet = fleet(SimConfig {
        dp_size: 2,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let (_, before) = get(e, "/control/last_seq").await;
    assert_eq!(before["last_seq"], json!([-1, -1]));
    let chain = toks(40, 32);
    let (status, body) = post(
        e,
        "/control/store",
        &json!({"chains": [chain, toks(900, 16)], "dp_rank": 1}),
    )
    .await;
    assert_eq!((status, &body["last_seq"]), (200, &json!(0)), "{body}");
    let (_, after) = get(e, "/control/last_seq").await;
    assert_eq!(after["last_seq"], json!([-1, 0]));
    // The stored chain is a cache hit for a request pinned to that rank.
    let (_, hit) = post(
        e,
        "/v1/completions",
        &json!({"prompt": chain, "max_tokens": 1, "data_parallel_rank": 1}),
    )
    .await;
    assert_eq!(hit["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    let (status, _) = post(e, "/control/store", &json!({"chains": [[1]], "dp_rank": 5})).await;
    assert_eq!(status, 400);
    fleet.shutdown().await;
}

/// `/control/stall` at `body`: a streamed answer's first chunk arrives, then nothing for at
/// least the stall, then the rest; at `head`: nothing at all for at least the stall. Each fires
/// once and `/served_stats` counts it. (Lower bounds only: a sleep never ends early.)
#[tokio::test]
async fn armed_stalls_hold_a_stream_after_its_first_chunk_or_before_its_head_once_each() {
    use futures::StreamExt;
    const STALL_MS: u64 = 300;
    let fleet = fleet(SimConfig::for_tests()).await;
    let e = &fleet.engines[0];
    let req =
        json!({"model": "kvroute-sim", "prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": true});
    let (status, _) = post(
        e,
        "/control/stall",
        &json!({"at": "body", "requests": 1, "stall_ms": STALL_MS}),
    )
    .await;
    assert_eq!(status, 200);
    // Timed from before the request leaves: the engine writes the chunk after the pause at least
    // STALL_MS after it received the request, so that chunk cannot be read earlier. (A gap
    // between two reads is not a sound bound: the first chunk may sit in the client's buffer,
    // read late, and the gap then looks shorter than the pause; it was once read 2.8 ms short.)
    let started = std::time::Instant::now();
    let resp = client()
        .post(format!("{}/v1/completions", e.http_url()))
        .json(&req)
        .send()
        .await
        .expect("stream starts");
    assert_eq!(resp.status(), 200);
    let mut chunks = resp.bytes_stream();
    let mut arrivals = Vec::new();
    while let Some(c) = chunks.next().await {
        c.expect("chunk");
        arrivals.push(started.elapsed());
    }
    assert!(arrivals.len() >= 2, "more than one chunk: {arrivals:?}");
    assert!(
        arrivals[arrivals.len() - 1] >= std::time::Duration::from_millis(STALL_MS),
        "the stream ended before a pause of {STALL_MS} ms: {arrivals:?}"
    );
    let (_, stats) = get(e, "/served_stats").await;
    assert_eq!(stats["faults"]["body_stalls_applied"], 1, "{stats}");

    let (status, _) = post(
        e,
        "/control/stall",
        &json!({"at": "head", "requests": 1, "stall_ms": STALL_MS}),
    )
    .await;
    assert_eq!(status, 200);
    let started = std::time::Instant::now();
    let (status, _) = post(
        e,
        "/v1/completions",
        &json!({"model": "kvroute-sim", "prompt": [1, 2], "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(started.elapsed() >= std::time::Duration::from_millis(STALL_MS));
    let (status, _) = post(
        e,
        "/v1/completions",
        &json!({"model": "kvroute-sim", "prompt": [1, 2], "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    let (_, stats) = get(e, "/served_stats").await;
    assert_eq!(
        stats["faults"]["head_stalls_applied"], 1,
        "the second request took no stall: {stats}"
    );
    assert_eq!(stats["faults"]["head_stalls_armed"], 0, "{stats}");
    fleet.shutdown().await;
}

/// The end of a TCP connection in this process whose local port is `local_port` and whose peer
/// port is `peer_port`, found among this process's open file descriptors (the server and the
/// client of these tests share the process).
fn tcp_fd_in_this_process(local_port: u16, peer_port: u16) -> Option<i32> {
    fn port_of(fd: i32, peer: bool) -> Option<u16> {
        // SAFETY: `addr` is a zeroed sockaddr_storage, large enough for any address, and `len`
        // holds its size; the calls write at most `len` bytes and fail harmlessly (ENOTSOCK,
        // EBADF) on a descriptor that is not a socket or was closed meanwhile.
        unsafe {
            let mut addr: libc::sockaddr_storage = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            let addr_ptr = &mut addr as *mut libc::sockaddr_storage as *mut libc::sockaddr;
            let rc = if peer {
                libc::getpeername(fd, addr_ptr, &mut len)
            } else {
                libc::getsockname(fd, addr_ptr, &mut len)
            };
            if rc != 0 || addr.ss_family as i32 != libc::AF_INET {
                return None;
            }
            let v4 = &*(addr_ptr as *const libc::sockaddr_in);
            Some(u16::from_be(v4.sin_port))
        }
    }
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd lists this process's descriptors")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|&fd| port_of(fd, false) == Some(local_port) && port_of(fd, true) == Some(peer_port))
}

fn nodelay_of(fd: i32) -> bool {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` is a c_int and `len` its size, as TCP_NODELAY's getsockopt expects.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            &mut value as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    assert_eq!(rc, 0, "getsockopt(TCP_NODELAY) on fd {fd}");
    value != 0
}

/// Largest response head the Nagle test reads from `/health` (a status line and a few headers).
const HEALTH_HEAD_BYTES_MAX: usize = 16 * 1024;

/// SGLang and vLLM serve HTTP through uvicorn on asyncio (or uvloop), which turns Nagle off on
/// every TCP connection. With Nagle on, a streamed answer's first chunk, written after a prefill
/// shorter than the client's delayed ACK, waits for the ACK of the response head written before
/// the prefill: up to 40 ms added to every short prefill's time to first token, which the demo's
/// later turns measured as ~46 ms for an 11 ms prefill. The simulator must answer like the
/// engines it stands in for.
// Multi-threaded: the test's blocking socket calls must not stall the server's runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_http_connections_send_without_nagle_as_the_engines_do() {
    use std::io::{Read, Write};
    let fleet = fleet(SimConfig::for_tests()).await;
    let server_port = fleet.engines[0].ports().http;
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", server_port)).expect("connect");
    let client_port = conn.local_addr().expect("client address").port();
    conn.set_read_timeout(Some(Duration::from_millis(WAIT_MS)))
        .expect("read timeout set");
    // A served request proves the server has accepted the connection (and tuned it). The
    // connection is kept alive, so the server's end is still open when it is looked up.
    conn.write_all(b"GET /health HTTP/1.1\r\nhost: sim\r\n\r\n")
        .expect("request written");
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        assert!(
            answer.len() <= HEALTH_HEAD_BYTES_MAX,
            "no end of head in {HEALTH_HEAD_BYTES_MAX} bytes: {answer:?}"
        );
        let n = conn
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("answer's head within {WAIT_MS} ms: {e}; read {answer:?}"));
        assert!(
            n > 0,
            "connection closed before the answer's head: {answer:?}"
        );
        answer.extend_from_slice(&buf[..n]);
    }
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "health answered: {:?}",
        String::from_utf8_lossy(&answer)
    );
    let server_end = tcp_fd_in_this_process(server_port, client_port).unwrap_or_else(|| {
        panic!(
            "the server's end of 127.0.0.1:{client_port} -> :{server_port} is open in this process"
        )
    });
    assert!(
        nodelay_of(server_end),
        "the simulator's accepted connection must have TCP_NODELAY set"
    );
    // The control: the client's end, which nothing tuned, has Nagle on, so the check can fail.
    let client_end = tcp_fd_in_this_process(client_port, server_port).expect("client's end");
    assert!(
        !nodelay_of(client_end),
        "an untuned socket reports Nagle on"
    );
}
