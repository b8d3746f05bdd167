//! Endpoints that exist for routers and benchmarks rather than for clients, over real sockets:
//! vLLM's `/tokenize` and `/v1/chat/completions/render` (routers that tokenize through the
//! engine must get exactly the ids the engine then prefills and caches, or their prefix
//! matching is wrong), and the simulator's `/served_stats` per-rank counters.

mod common;

use common::*;
use kvroute_sim::SimConfig;
use serde_json::{Value, json};

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected an id array, got {v}"))
        .iter()
        .map(|x| x.as_u64().expect("ids are unsigned integers"))
        .collect()
}

fn messages() -> Value {
    json!([
        {"role": "system", "content": "You are a careful assistant that answers questions about routers, caches and blocks of tokens."},
        {"role": "user", "content": "Why does a cache aware router keep a prefix tree?"}
    ])
}

#[tokio::test]
async fn tokenize_and_render_return_exactly_the_ids_the_chat_endpoint_prefills() {
    let fleet = fleet(SimConfig::for_tests()).await;
    let e = &fleet.engines[0];

    let (status, tok) = post(
        e,
        "/tokenize",
        &json!({"model": "kvroute-sim", "messages": messages()}),
    )
    .await;
    assert_eq!(status, 200, "{tok}");
    let tokens = ids(&tok["tokens"]);
    assert_eq!(tok["count"].as_u64(), Some(tokens.len() as u64), "{tok}");
    assert!(tok["max_model_len"].as_u64().unwrap() > 0, "{tok}");

    let (status, rendered) = post(
        e,
        "/v1/chat/completions/render",
        &json!({"model": "kvroute-sim", "messages": messages(), "stream": true}),
    )
    .await;
    assert_eq!(status, 200, "{rendered}");
    assert_eq!(
        ids(&rendered["token_ids"]),
        tokens,
        "render and tokenize agree"
    );
    assert_eq!(rendered["model"], "kvroute-sim");

    let (status, chat) = post(
        e,
        "/v1/chat/completions",
        &json!({"messages": messages(), "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{chat}");
    assert_eq!(
        chat["usage"]["prompt_tokens"].as_u64(),
        Some(tokens.len() as u64),
        "the chat endpoint prefills as many tokens as /tokenize returned"
    );
    // Same ids, not just the same count: sending them as a token prompt hits every full block
    // the chat request just cached.
    let (_, again) = post(
        e,
        "/v1/completions",
        &json!({"prompt": tokens, "max_tokens": 1}),
    )
    .await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(tokens.len() as u64 / 16 * 16),
        "{again}"
    );

    // Without the assistant header the prompt is a strict prefix of the one with it.
    let (_, bare) = post(
        e,
        "/tokenize",
        &json!({"messages": messages(), "add_generation_prompt": false}),
    )
    .await;
    let bare = ids(&bare["tokens"]);
    assert!(
        bare.len() < tokens.len() && tokens.starts_with(&bare),
        "{bare:?} vs {tokens:?}"
    );

    // A completion-style prompt is tokenized as the completions endpoint would.
    let (status, plain) = post(e, "/tokenize", &json!({"prompt": "hello router"})).await;
    assert_eq!(status, 200, "{plain}");
    let (_, done) = post(
        e,
        "/v1/completions",
        &json!({"prompt": "hello router", "max_tokens": 1}),
    )
    .await;
    assert_eq!(
        plain["count"], done["usage"]["prompt_tokens"],
        "{plain} {done}"
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn tokenize_and_render_refuse_bad_input_with_typed_400s() {
    let fleet = fleet(SimConfig {
        max_body_bytes: 4096,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> =
        vec![
        ("/tokenize", b"{not json".to_vec(), 400, None),
        ("/tokenize", br#"{}"#.to_vec(), 400, Some("prompt")),
        (
            "/tokenize",
            br#"{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        ("/tokenize", br#"{"prompt": ""}"#.to_vec(), 400, Some("prompt")),
        ("/tokenize", br#"{"prompt": 42}"#.to_vec(), 400, None),
        ("/tokenize", br#"{"messages": []}"#.to_vec(), 400, Some("messages")),
        (
            "/tokenize",
            br#"{"messages": [{"role": "user", "content": "y"}], "add_generation_prompt": "yes"}"#
                .to_vec(),
            400,
            None,
        ),
        (
            "/tokenize",
            format!(r#"{{"prompt": "{}"}}"#, "a".repeat(5000)).into_bytes(),
            413,
            None,
        ),
        ("/v1/chat/completions/render", br#"{"model": "m"}"#.to_vec(), 400, Some("messages")),
        ("/v1/chat/completions/render", b"[1, 2]".to_vec(), 400, None),
    ];
    for (path, body, want, param) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(60)]).to_string();
        let (status, err) = post_raw(e, path, body).await;
        assert_eq!(status, want, "{path} {shown}: {err}");
        let obj = &err["error"];
        assert!(obj["message"].is_string(), "{path} {shown}: {err}");
        assert_eq!(
            obj["type"], "invalid_request_error",
            "{path} {shown}: {err}"
        );
        assert_eq!(obj["code"], want, "{err}");
        if let Some(p) = param {
            assert_eq!(obj["param"], p, "{path} {shown}: {err}");
        }
    }
    let (status, _) = get(e, "/tokenize").await;
    assert_eq!(status, 405, "tokenize is POST only");
    fleet.shutdown().await;
}

#[tokio::test]
async fn served_stats_count_requests_and_tokens_on_the_rank_that_served_them() {
    let fleet = fleet(SimConfig {
        dp_size: 2,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let (status, before) = get(e, "/served_stats").await;
    assert_eq!(status, 200, "{before}");
    assert_eq!(before["engine"], 0);
    for r in before["ranks"].as_array().expect("ranks array") {
        assert_eq!(r["requests"], 0, "fresh engine: {before}");
    }

    let prompt = toks(1, 40);
    for rank in [1, 1, 0] {
        let (status, body) = post(
            e,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1, "data_parallel_rank": rank}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let (_, after) = get(e, "/served_stats").await;
    let ranks = after["ranks"].as_array().expect("ranks array");
    assert_eq!(ranks.len(), 2, "{after}");
    let r0 = &ranks[0];
    let r1 = &ranks[1];
    assert_eq!(
        (r0["dp_rank"].as_u64(), r1["dp_rank"].as_u64()),
        (Some(0), Some(1))
    );
    assert_eq!(
        (r0["requests"].as_u64(), r1["requests"].as_u64()),
        (Some(1), Some(2)),
        "{after}"
    );
    assert_eq!(r1["prompt_tokens"], 80, "{after}");
    // Rank 1's second request reuses the first's two full blocks; rank 0 starts cold.
    assert_eq!(
        (r0["cached_tokens"].as_u64(), r1["cached_tokens"].as_u64()),
        (Some(0), Some(32)),
        "{after}"
    );
    fleet.shutdown().await;
}
