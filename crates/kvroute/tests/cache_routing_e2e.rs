//! End-to-end: engine KV events -> KV plane -> index -> the router's choice, over real ZMQ and
//! HTTP against the simulated fleet.

mod common;

use common::*;
use serde_json::{Value, json};

async fn workers(base: &str) -> Value {
    client()
        .get(format!("{base}/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Waits until every rank of every worker has a connected KV subscriber.
async fn wait_subscribed(base: &str, ranks: usize) {
    wait_until(
        "every rank's KV subscriber to connect",
        WAIT_DEADLINE,
        || async {
            let w = workers(base).await;
            let states: Vec<String> = w["workers"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|w| w["kv_ranks"].as_array().cloned().unwrap_or_default())
                .map(|r| r["subscriber"].as_str().unwrap_or("?").to_string())
                .collect();
            if states.len() == ranks && states.iter().all(|s| s == "connected") {
                Ok(())
            } else {
                Err(format!("{states:?}"))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_whose_prefix_is_stored_on_a_rank_is_routed_to_that_rank() {
    let fleet = fleet(2, 2, "m").await;
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    let base = router.url();
    wait_subscribed(&base, 4).await;
    let block = fleet.engines[0].block_size();
    let prompt: Vec<u32> = (0..(block * 6) as u32).map(|t| 1000 + t).collect();
    // Engine 1, DP rank 1 caches the first 5 blocks of the prompt and announces them.
    let target_url = fleet.engines[1].http_url();
    fleet.engines[1].store_chains(1, &[prompt[..block * 5].to_vec()]);
    let route_req = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    let scored = wait_until(
        "the stored prefix to reach the router's index",
        WAIT_DEADLINE,
        || async {
            let (_, v, _) = post_json(&format!("{base}/debug/route"), &route_req).await;
            let hit = v["ranks"].as_array().and_then(|r| {
                r.iter().find(|r| {
                    r["url"] == target_url.as_str() && r["dp_rank"] == 1 && r["matched_blocks"] == 5
                })
            });
            match hit {
                Some(_) => Ok(v.clone()),
                None => Err(v.to_string()),
            }
        },
    )
    .await;
    assert_eq!(scored["reason"], "cache_hit", "{scored}");
    for r in scored["ranks"].as_array().unwrap() {
        if !(r["url"] == target_url.as_str() && r["dp_rank"] == 1) {
            assert_eq!(
                r["matched_blocks"], 0,
                "only the storing rank holds the prefix: {r}"
            );
        }
    }
    let (status, body, headers) = post_json(&format!("{base}/v1/completions"), &route_req).await;
    assert_eq!(status, 200, "{body}");
    let d = decision(&headers);
    assert!(
        d.contains(&format!("url={target_url};dp_rank=1;matched_blocks=5")),
        "{d}"
    );
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some((block * 5) as u64),
        "the engine must confirm the cache hit: {body}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_worker_drops_its_ranks_from_routing_and_the_index() {
    let fleet = fleet(2, 1, "m").await;
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    let base = router.url();
    wait_subscribed(&base, 2).await;
    let block = fleet.engines[0].block_size();
    let prompt: Vec<u32> = (0..(block * 4) as u32).map(|t| 7000 + t).collect();
    let gone_url = fleet.engines[0].http_url();
    fleet.engines[0].store_chains(0, std::slice::from_ref(&prompt));
    let req = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    wait_until(
        "the stored prefix to reach the index",
        WAIT_DEADLINE,
        || async {
            let (_, v, _) = post_json(&format!("{base}/debug/route"), &req).await;
            if v["chosen"]["url"] == gone_url.as_str() && v["reason"] == "cache_hit" {
                Ok(())
            } else {
                Err(v.to_string())
            }
        },
    )
    .await;
    let w = workers(&base).await;
    let id = w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == gone_url.as_str())
        .unwrap()["id"]
        .as_u64()
        .unwrap();
    let resp = client()
        .delete(format!("{base}/workers/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    // Removal completes synchronously: the very next decision must not see the removed ranks.
    let (_, v, _) = post_json(&format!("{base}/debug/route"), &req).await;
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 1, "{v}");
    assert_ne!(ranks[0]["url"], gone_url.as_str());
    assert_eq!(ranks[0]["matched_blocks"], 0);
    assert_eq!(v["reason"], "cold");
    router.shutdown().await;
    fleet.shutdown().await;
}
