//! A long new document routed on its head (`routing::tokenize`, `encode_chat_head`), end to
//! end: real routers in-process in front of simulated engines (real HTTP, real ZMQ).

mod common;

use std::sync::Arc;

use common::*;
use kvroute::routing::tokenize::ModelTokenizer;
use serde_json::{Value, json};

/// About 8,000 words (over `ROUTING_HEAD_SEGMENT_BYTES_MIN` of text, under the segment cache's
/// token limit), different for each `tag`.
fn document(tag: &str) -> String {
    (0..8_000)
        .map(|i| format!("w{}{tag}", (i * 7_919) % 1_009))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A chat of a short system message and [`document`]`(tag)`, and the tokens the whole chat
/// becomes (for the assertions).
fn document_chat(tag: &str) -> (Value, Vec<u32>) {
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": document(tag)},
    ]);
    let reference = Arc::new(ModelTokenizer::load(&tokenizer_path(), 64).unwrap());
    let whole = reference
        .encode_chat_whole(messages.as_array().unwrap())
        .unwrap();
    (messages, whole)
}

/// Sends one chat through `base`; returns the decision header's fields by name.
async fn chat(base: &str, messages: &Value) -> std::collections::HashMap<String, String> {
    let (status, body, headers) = post_json(
        &format!("{base}/v1/chat/completions"),
        &json!({"model": "m", "max_tokens": 2, "messages": messages}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    decision(&headers)
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn number(fields: &std::collections::HashMap<String, String>, name: &str) -> usize {
    fields
        .get(name)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the decision: {fields:?}"))
}

fn tokenizer_outcome(metrics: &str, outcome: &str) -> f64 {
    metric_value(
        metrics,
        &format!(r#"kvroute_tokenizer_cache_total{{outcome="{outcome}"}}"#),
    )
    .and_then(|v| v.parse().ok())
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_document_routes_on_its_head_and_a_router_that_sees_it_held_tokenizes_it_whole() {
    let fleet = fleet(2, 2, "m").await;
    let urls = urls(&fleet);
    let a = kvroute::serve(router_config(&urls)).await.unwrap();
    // B runs from the start (a router hears only the KV events published after it subscribes)
    // but is asked only later.
    let b = kvroute::serve(router_config(&urls)).await.unwrap();
    wait_subscribed(&a.url(), 4).await;
    wait_subscribed(&b.url(), 4).await;
    let (messages, whole) = document_chat("d");
    let block = fleet.engines[0].block_size();

    // Router A has never seen the document: it routes on the head, with the length estimated.
    let first = chat(&a.url(), &messages).await;
    let m = metrics_text(&a.url()).await;
    assert_eq!(tokenizer_outcome(&m, "head"), 1.0, "{m}");
    assert_eq!(tokenizer_outcome(&m, "whole"), 0.0, "{m}");
    let estimate = number(&first, "prompt_tokens");
    assert!(
        estimate.abs_diff(whole.len()) * 5 < whole.len(),
        "estimated {estimate} tokens for a chat of {}",
        whole.len()
    );
    // The rest is tokenized aside, for the next turn.
    let tok = a
        .router
        .registry
        .model("m")
        .unwrap()
        .tokenizer
        .clone()
        .unwrap();
    wait_until(
        "router A to complete the head's chat aside",
        WAIT_DEADLINE,
        || async {
            match tok.completions_done() {
                0 => Err("no completion yet".to_string()),
                _ => Ok(()),
            }
        },
    )
    .await;
    assert!(tok.heads_enabled(), "the head was the chat's beginning");

    // Router B has not been asked about the document, but the engine now holds all of it: B's
    // head reaches a rank's match, so B tokenizes the chat whole and follows the document.
    let group = b.router.registry.model("m").unwrap();
    let held_blocks = whole.len() / block;
    wait_until(
        "router B's index to hold the whole document on one rank",
        WAIT_DEADLINE,
        || async {
            let plan = b.router.plan_preview(group.clone(), &whole).unwrap();
            let deepest = plan
                .candidates
                .iter()
                .map(|c| c.input.matched_blocks as usize)
                .max()
                .unwrap_or(0);
            if deepest + 1 >= held_blocks {
                Ok(())
            } else {
                Err(format!("deepest match {deepest} of {held_blocks} blocks"))
            }
        },
    )
    .await;
    let followed = chat(&b.url(), &messages).await;
    let m = metrics_text(&b.url()).await;
    assert_eq!(tokenizer_outcome(&m, "head"), 0.0, "{m}");
    assert_eq!(
        (&followed["url"], &followed["dp_rank"]),
        (&first["url"], &first["dp_rank"]),
        "B follows the document to the rank A started it on"
    );
    assert!(
        number(&followed, "matched_blocks") + 1 >= held_blocks,
        "B matched the whole document: {followed:?} of {held_blocks} blocks"
    );
    assert_eq!(number(&followed, "prompt_tokens"), whole.len());

    // The conversation's next turn through A: the document comes from A's cache, whole.
    let mut next = messages.as_array().unwrap().clone();
    next.push(json!({"role": "assistant", "content": "noted"}));
    next.push(json!({"role": "user", "content": "and then?"}));
    let later = chat(&a.url(), &Value::Array(next)).await;
    let m = metrics_text(&a.url()).await;
    assert_eq!(tokenizer_outcome(&m, "head"), 1.0, "no second head: {m}");
    assert_eq!(
        (&later["url"], &later["dp_rank"]),
        (&first["url"], &first["dp_rank"])
    );
    assert!(
        number(&later, "matched_blocks") + 1 >= held_blocks,
        "the next turn matched the whole document: {later:?}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// Once a head's chat is tokenized aside, the blocks past the head become pending on the rank
/// the chat went to, so a copy of the same document sent while the first one's prefill still
/// runs follows it there instead of computing it again elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_new_document_sent_during_its_first_prefill_follows_it() {
    let sim = kvroute_sim::config::SimConfig {
        engines: 2,
        dp_size: 2,
        served_model_name: "m".into(),
        instant: false,
        // A prefill of a few seconds: the copy is routed while it runs, before any KV event.
        prefill_us_per_token: 150,
        ..kvroute_sim::config::SimConfig::for_tests()
    };
    let fleet = kvroute_sim::start_fleet(sim).await.expect("fleet starts");
    let router = kvroute::serve(kvroute::RouterConfig {
        // Pending blocks outlive the test (the default TTL is shorter than a debug build's
        // tokenizing of the copy).
        pending_prefix_ttl_ms: 30_000,
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    wait_subscribed(&router.url(), 4).await;
    let (messages, whole) = document_chat("c");
    let whole_blocks = whole.len() / fleet.engines[0].block_size();
    let base = router.url();
    let first = tokio::spawn({
        let (base, messages) = (base.clone(), messages.clone());
        async move { chat(&base, &messages).await }
    });
    let group = router.router.registry.model("m").unwrap();
    wait_until(
        "the whole document to be pending on one rank (the head's completion extends it)",
        WAIT_DEADLINE,
        || async {
            let plan = router.router.plan_preview(group.clone(), &whole).unwrap();
            let deepest = plan
                .candidates
                .iter()
                .map(|c| (c.input.matched_blocks as usize, c.input.pending_blocks))
                .max()
                .unwrap_or_default();
            if deepest.0 + 1 >= whole_blocks && deepest.1 > 0 {
                Ok(())
            } else {
                Err(format!(
                    "deepest (matched, pending) {deepest:?} of {whole_blocks} blocks"
                ))
            }
        },
    )
    .await;
    let copy = chat(&base, &messages).await;
    let first = first.await.expect("first chat");
    assert_eq!(
        (&copy["url"], &copy["dp_rank"]),
        (&first["url"], &first["dp_rank"]),
        "the copy follows the first prefill: {copy:?}"
    );
    assert!(
        number(&copy, "matched_blocks") + 1 >= whole_blocks,
        "the copy matched the whole document as pending: {copy:?}"
    );
    router.shutdown().await;
}
