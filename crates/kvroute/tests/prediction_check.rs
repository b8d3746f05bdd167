//! The prediction check end to end: a real router in front of simulated engines over real HTTP
//! and ZMQ. An engine that tokenizes chats like the router never raises the check over a long
//! run; an engine with another chat template (so its token ids, and with them its KV events,
//! never match the router's) raises it, `under`, on `/workers` and on the gauge. A router with no
//! tokenizer, or one without a chat template, routes that text blind to the caches: it says so on
//! `/workers` and in `kvroute_untokenized_prompts_total`, and the check raises `under` from the
//! engines' reports alone. Streamed answers are read to the end, so the usage chunk is scanned as
//! it passes through.

mod common;

use common::*;
use kvroute::RouterConfig;
use kvroute::routing::prediction::PredictionCheckConfig;
use kvroute_sim::SimConfig;
use serde_json::{Value, json};

/// The check's window in these tests: small, so a short run fills it several times.
const WINDOW_REQUESTS: usize = 20;
/// Requests of one run: six windows.
const REQUESTS: usize = 120;
/// Distinct system prompts, long enough for several blocks each.
const SYSTEM_PROMPTS: usize = 3;

fn system_prompt(i: usize) -> String {
    let words = [
        "cache", "router", "engine", "block", "prefix", "token", "rank",
    ];
    let body: Vec<&str> = (0..120)
        .map(|k| words[(k * 7 + i * 3) % words.len()])
        .collect();
    format!("You are assistant {i}. {}", body.join(" "))
}

async fn start(sim_tokenizer: std::path::PathBuf) -> (kvroute_sim::Fleet, kvroute::RouterHandle) {
    start_with_router_tokenizer(sim_tokenizer, Some(tokenizer_path())).await
}

async fn start_with_router_tokenizer(
    sim_tokenizer: std::path::PathBuf,
    router_tokenizer: Option<std::path::PathBuf>,
) -> (kvroute_sim::Fleet, kvroute::RouterHandle) {
    let fleet = kvroute_sim::start_fleet(SimConfig {
        engines: 1,
        dp_size: 2,
        served_model_name: "m".into(),
        tokenizer_path: sim_tokenizer,
        ..SimConfig::for_tests()
    })
    .await
    .expect("fleet starts");
    let router = kvroute::serve(RouterConfig {
        prediction_check: PredictionCheckConfig {
            window_requests: WINDOW_REQUESTS,
            tolerance: 0.5,
        },
        tokenizer_path: router_tokenizer,
        ..router_config(&urls(&fleet))
    })
    .await
    .expect("router starts");
    wait_subscribed(&router.url(), 2).await;
    (fleet, router)
}

/// Sends the run's chats (every third streamed with a usage chunk, read to its end).
async fn drive(base: &str) {
    let http = client();
    for i in 0..REQUESTS {
        let stream = i % 3 == 0;
        let body = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system_prompt(i % SYSTEM_PROMPTS)},
                {"role": "user", "content": format!("question number {}", i / SYSTEM_PROMPTS)},
            ],
            "max_tokens": 2,
            "stream": stream,
            "stream_options": {"include_usage": true},
        });
        let resp = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .expect("request sent");
        assert_eq!(resp.status(), 200, "request {i}");
        let text = resp.text().await.expect("the whole answer");
        assert!(
            text.contains("cached_tokens"),
            "request {i}: the engine reports cached tokens: {text}"
        );
    }
}

/// A fresh directory holding the shipped `tokenizer.json` alone (no `tokenizer_config.json`).
fn dir_with_the_shipped_vocabulary(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::copy(tokenizer_path(), dir.join("tokenizer.json")).expect("tokenizer copied");
    dir
}

fn check_of(workers: &Value) -> Value {
    workers["prediction_checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["model"] == "m").cloned())
        .unwrap_or(Value::Null)
}

/// Asserts the check is raised `under`, on `/workers` and on the gauge; returns the check and
/// the metrics text.
async fn raised_under(base: &str) -> (Value, String) {
    let check = check_of(&workers(base).await);
    assert_eq!(check["mismatch"], "under", "{check}");
    let m = metrics_text(base).await;
    assert_eq!(
        metric(
            &m,
            "kvroute_prediction_mismatch{direction=\"under\",model=\"m\"}"
        ),
        1.0,
        "the gauge is raised:\n{m}"
    );
    (check, m)
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_tokenizes_like_the_router_never_raises_the_check() {
    let (fleet, router) = start(tokenizer_path()).await;
    let base = router.url();
    drive(&base).await;
    let check = check_of(&workers(&base).await);
    assert_eq!(check["window_requests"], WINDOW_REQUESTS, "{check}");
    assert_eq!(check["mismatch"], Value::Null, "{check}");
    assert!(
        check["predicted_cached_tokens"].as_u64() > Some(0),
        "the index predicted hits: {check}"
    );
    let m = metrics_text(&base).await;
    let exact = metric(&m, "kvroute_predictions_total{model=\"m\",result=\"exact\"");
    let all = metric(&m, "kvroute_predictions_total{");
    assert_eq!(all, REQUESTS as f64, "every answer was compared:\n{m}");
    assert!(
        exact >= all * 0.8,
        "{exact} of {all} predictions within a block of the report"
    );
    assert_eq!(
        metric(&m, "kvroute_prediction_mismatch{"),
        0.0,
        "no mismatch gauge raised"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_another_chat_template_raises_the_check_under() {
    // The same vocabulary, another chat template: the engine's token ids for a chat differ
    // from the router's from the first token on.
    let dir = dir_with_the_shipped_vocabulary("template");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec(&json!({
            "add_bos_token": false,
            "chat_template": "{% for message in messages %}{{ '### ' + message['role'] + ':\\n' + message['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
        }))
        .expect("json"),
    )
    .expect("template written");
    let (fleet, router) = start(dir.join("tokenizer.json")).await;
    let base = router.url();
    drive(&base).await;
    let (check, _) = raised_under(&base).await;
    assert_eq!(
        check["predicted_cached_tokens"], 0,
        "the index never matches the router's tokens: {check}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

fn model_of(workers: &Value) -> Value {
    workers["models"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["model"] == "m").cloned())
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_without_a_tokenizer_shows_it_and_the_engines_reports_raise_the_check_under() {
    let (fleet, router) = start_with_router_tokenizer(tokenizer_path(), None).await;
    let base = router.url();
    let model = model_of(&workers(&base).await);
    assert_eq!(model["tokenizer"], false, "/workers says so: {model}");
    assert_eq!(model["chat_template"], false, "{model}");
    drive(&base).await;
    let (check, m) = raised_under(&base).await;
    assert_eq!(check["predicted_cached_tokens"], 0, "{check}");
    assert!(
        check["reported_cached_tokens"].as_u64() > Some(0),
        "the engines found the repeated system prompts: {check}"
    );
    assert_eq!(
        metric(
            &m,
            "kvroute_untokenized_prompts_total{reason=\"no_tokenizer\"}"
        ),
        REQUESTS as f64,
        "every chat counted as untokenized for want of a tokenizer:\n{m}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_without_a_chat_template_leaves_chats_blind_and_prompts_predicted() {
    // The shipped tokenizer.json without its tokenizer_config.json: the vocabulary, no template.
    let dir = dir_with_the_shipped_vocabulary("no-template");
    let (fleet, router) =
        start_with_router_tokenizer(tokenizer_path(), Some(dir.join("tokenizer.json"))).await;
    let base = router.url();
    let model = model_of(&workers(&base).await);
    assert_eq!(model["tokenizer"], true, "{model}");
    assert_eq!(model["chat_template"], false, "/workers says so: {model}");
    // A text completion is still tokenized (and predicted) by the vocabulary alone.
    let (status, _, headers) = post_json(
        &format!("{base}/v1/completions"),
        &json!({"model": "m", "prompt": system_prompt(0), "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    let decision = headers
        .get("x-kvroute-decision")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(
        !decision.contains("no_tokens"),
        "a text prompt is routed on its tokens: {decision}"
    );
    drive(&base).await;
    let (_, m) = raised_under(&base).await;
    assert_eq!(
        metric(
            &m,
            "kvroute_untokenized_prompts_total{reason=\"no_chat_template\"}"
        ),
        REQUESTS as f64,
        "every chat counted as untokenized for want of a template:\n{m}"
    );
    assert_eq!(
        metric(
            &m,
            "kvroute_untokenized_prompts_total{reason=\"no_tokenizer\"}"
        ),
        0.0,
        "{m}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
