//! End-to-end: pending prefixes (blocks routed to a rank, not yet confirmed by its KV events)
//! steer same-prefix requests to that rank, expire after their TTL, stay bounded, and are off
//! with a TTL of 0. Real simulated engines over HTTP and ZMQ, the router in-process on port 0.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvroute::routing::pending::{PENDING_BLOCKS_MAX, RankKey};
use serde_json::{Value, json};

/// Per-token prefill time of the slow fleet: a 4-block prompt prefills in ~640 ms, long enough
/// for the test to plan further requests while the first one is still prefilling.
const SLOW_PREFILL_US_PER_TOKEN: u64 = 10_000;

/// One engine with 2 DP ranks whose prefills take real time and run one at a time per rank (so a
/// request queued behind a same-prefix prefill finds its blocks cached).
async fn slow_serial_fleet() -> kvroute_sim::Fleet {
    let cfg = kvroute_sim::SimConfig {
        engines: 1,
        dp_size: 2,
        served_model_name: "m".into(),
        instant: false,
        prefill_serial: true,
        prefill_us_per_token: SLOW_PREFILL_US_PER_TOKEN,
        ..kvroute_sim::SimConfig::for_tests()
    };
    kvroute_sim::start_fleet(cfg).await.expect("fleet starts")
}

/// A router over `fleet` (one engine, 2 DP ranks) with pending prefixes kept `pending_ttl_ms`
/// (`None`: the default), returned once both ranks' KV subscribers are connected.
async fn subscribed_router(
    fleet: &kvroute_sim::Fleet,
    pending_ttl_ms: Option<u64>,
) -> kvroute::RouterHandle {
    let mut cfg = router_config(&urls(fleet));
    if let Some(ttl) = pending_ttl_ms {
        cfg.pending_prefix_ttl_ms = ttl;
    }
    let router = kvroute::serve(cfg).await.expect("router starts");
    wait_subscribed(&router.url(), 2).await;
    router
}

fn prompt(blocks: usize, block: usize, base: u32) -> Vec<u32> {
    (0..(blocks * block) as u32).map(|t| base + t).collect()
}

/// The (url, dp_rank) a `/debug/route` answer shows holding `blocks` pending blocks, if any.
fn pending_rank(v: &Value, blocks: u64) -> Option<(String, u64)> {
    v["ranks"].as_array()?.iter().find_map(|r| {
        (r["pending_blocks"].as_u64() == Some(blocks)).then(|| {
            (
                r["url"].as_str().unwrap_or_default().to_string(),
                r["dp_rank"].as_u64().unwrap_or(u64::MAX),
            )
        })
    })
}

async fn wait_pending(base: &str, tokens: &[u32], blocks: u64) -> (String, u64) {
    let req = json!({"model": "m", "prompt": tokens});
    wait_until(
        "the routed request's blocks to show as pending",
        WAIT_DEADLINE,
        || async {
            let (_, v, _) = post_json(&format!("{base}/debug/route"), &req).await;
            pending_rank(&v, blocks).ok_or_else(|| v.to_string())
        },
    )
    .await
}

fn header_field<'a>(decision: &'a str, key: &str) -> &'a str {
    decision
        .split(';')
        .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or("")
}

/// Waits until `busy` ranks each have exactly one request in flight (and the rest none).
async fn wait_in_flight(base: &str, busy: usize) {
    wait_until(
        "ranks to have a request in flight",
        WAIT_DEADLINE,
        || async {
            let w = workers(base).await;
            let in_flight: Vec<i64> = w["workers"][0]["ranks"]
                .as_array()
                .map(|r| {
                    r.iter()
                        .map(|r| r["in_flight"].as_i64().unwrap_or(-1))
                        .collect()
                })
                .unwrap_or_default();
            if in_flight.iter().filter(|&&n| n == 1).count() == busy
                && in_flight.iter().all(|&n| n == 0 || n == 1)
            {
                Ok(())
            } else {
                Err(format!(
                    "wanted {busy} busy ranks, in flight per rank {in_flight:?}"
                ))
            }
        },
    )
    .await;
}

/// Starts request 1 (prompt `p`) and a different-prefix request that keeps the other rank busy,
/// waits until both are dispatched (each rank has one request in flight), then sends request 2
/// with the same prompt as request 1. Returns request 1's decision header and request 2's
/// (status, body, decision header).
async fn same_prefix_while_first_prefills(
    base: &str,
    block: usize,
    pending_on: bool,
) -> (String, (u16, Value, String)) {
    let p = prompt(4, block, 1_000);
    let q = prompt(4, block, 20_000);
    let first = {
        let url = format!("{base}/v1/completions");
        let body = json!({"model": "m", "prompt": p, "max_tokens": 1});
        tokio::spawn(async move { post_json(&url, &body).await })
    };
    if pending_on {
        wait_pending(base, &p, 4).await;
    }
    wait_in_flight(base, 1).await;
    let other = {
        let url = format!("{base}/v1/completions");
        let body = json!({"model": "m", "prompt": q, "max_tokens": 1});
        tokio::spawn(async move { post_json(&url, &body).await })
    };
    wait_in_flight(base, 2).await;
    let (status, body, headers) = post_json(
        &format!("{base}/v1/completions"),
        &json!({"model": "m", "prompt": p, "max_tokens": 1}),
    )
    .await;
    let second = (status, body, decision(&headers));
    let (s1, b1, h1) = first.await.unwrap();
    assert_eq!(s1, 200, "{b1}");
    let (s3, b3, _) = other.await.unwrap();
    assert_eq!(s3, 200, "{b3}");
    (decision(&h1), second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_requests_with_the_same_uncached_prefix_go_to_the_same_rank() {
    let fleet = slow_serial_fleet().await;
    let router = subscribed_router(&fleet, None).await;
    let base = router.url();
    let block = fleet.engines[0].block_size();
    let (first, (status, body, second)) =
        same_prefix_while_first_prefills(&base, block, true).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header_field(&first, "reason"), "cold", "{first}");
    assert_eq!(
        (
            header_field(&second, "url"),
            header_field(&second, "dp_rank")
        ),
        (header_field(&first, "url"), header_field(&first, "dp_rank")),
        "the second request must follow the first: {first} / {second}"
    );
    assert_eq!(header_field(&second, "reason"), "pending_hit", "{second}");
    assert_eq!(header_field(&second, "pending_blocks"), "4", "{second}");
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some((4 * block) as u64),
        "queued behind the first prefill on the same rank, the engine must report a full hit: {body}"
    );
    let metrics = metrics_text(&base).await;
    assert!(
        metrics.contains("kvroute_pending_prefix_hits_total{model=\"m\"} 1"),
        "{metrics}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_of_zero_disables_pending_prefixes() {
    let fleet = slow_serial_fleet().await;
    let router = subscribed_router(&fleet, Some(0)).await;
    let base = router.url();
    let block = fleet.engines[0].block_size();
    let (_, (status, body, second)) = same_prefix_while_first_prefills(&base, block, false).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header_field(&second, "reason"), "cold", "{second}");
    assert_eq!(header_field(&second, "pending_blocks"), "0", "{second}");
    assert!(router.router.pending.model("m").is_none());
    let metrics = metrics_text(&base).await;
    assert!(
        !metrics.contains("kvroute_pending_prefix_blocks{"),
        "{metrics}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

/// Records rank 0 as pending for all 6 blocks of a prompt whose first 2 blocks the index puts
/// on rank 1; returns the request that routes that prompt and when the entry was recorded.
async fn index_on_rank_1_pending_on_rank_0(
    router: &kvroute::RouterHandle,
    fleet: &kvroute_sim::Fleet,
) -> (Value, Instant) {
    let base = router.url();
    let block = fleet.engines[0].block_size();
    let p = prompt(6, block, 3_000);
    store_until_indexed(&base, &fleet.engines[0], 1, &p[..2 * block], 2).await;
    let r = &router.router;
    let worker = r.registry.workers()[0].id;
    let mut hashes = Vec::new();
    kvroute::routing::kv::hash_blocks(&p, block, &mut hashes);
    let recorded = Instant::now();
    r.pending.record(
        "m",
        &hashes,
        0,
        RankKey { worker, dp_rank: 0 },
        recorded,
        false,
    );
    (json!({"model": "m", "prompt": p}), recorded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn within_the_ttl_pending_blocks_outrank_the_index() {
    // A TTL no run gets near, so the check holds on every run, however slow the machine.
    const TTL_MS: u64 = 600_000;
    let fleet = fleet(1, 2, "m").await;
    let router = subscribed_router(&fleet, Some(TTL_MS)).await;
    let base = router.url();
    let url = fleet.engines[0].http_url();
    let (req, _) = index_on_rank_1_pending_on_rank_0(&router, &fleet).await;
    let (_, v, _) = post_json(&format!("{base}/debug/route"), &req).await;
    assert_eq!(
        v["chosen"]["dp_rank"], 0,
        "pending blocks outrank the index: {v}"
    );
    assert_eq!(v["reason"], "pending_hit", "{v}");
    assert_eq!(pending_rank(&v, 6), Some((url, 0)), "{v}");
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_ttl_pending_blocks_expire_and_routing_follows_the_index_again() {
    const TTL_MS: u64 = 1_000;
    let fleet = fleet(1, 2, "m").await;
    let router = subscribed_router(&fleet, Some(TTL_MS)).await;
    let base = router.url();
    let (req, recorded) = index_on_rank_1_pending_on_rank_0(&router, &fleet).await;
    // Whether the entry is still visible at the first look depends on how fast this machine
    // is, so nothing is asserted about it here (the test above covers the pending hit); what
    // is asserted is that the entries vanish, and never before the TTL.
    let after = wait_until("the pending blocks to expire", WAIT_DEADLINE, || async {
        let (_, v, _) = post_json(&format!("{base}/debug/route"), &req).await;
        let any_pending = v["ranks"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["pending_blocks"] != 0));
        if any_pending {
            Err(v.to_string())
        } else {
            Ok(v)
        }
    })
    .await;
    assert!(
        recorded.elapsed() >= Duration::from_millis(TTL_MS),
        "entries vanished after {:?}, before the {TTL_MS} ms TTL",
        recorded.elapsed()
    );
    assert_eq!(after["chosen"]["dp_rank"], 1, "index-only choice: {after}");
    assert_eq!(after["reason"], "cache_hit", "{after}");
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_entries_stay_bounded_under_a_stream_of_distinct_long_prompts() {
    let fleet = fleet(1, 2, "m").await;
    let router = subscribed_router(&fleet, None).await;
    let base = router.url();
    let block = fleet.engines[0].block_size();
    let r = router.router.clone();
    let group = r.registry.model("m").unwrap();
    // 1,024 blocks per prompt: 70 prompts are 71,680 blocks, past the cap.
    let prompts = PENDING_BLOCKS_MAX / 1_024 + 6;
    for i in 0..prompts {
        let p = prompt(1_024, block, 100_000 + (i * 1_024 * block) as u32);
        let plan = r.plan(group.clone(), &p).unwrap();
        assert_eq!(plan.decision.reason, "cold");
        let held = r.pending.model("m").map_or(0, |t| t.len());
        assert!(
            held <= PENDING_BLOCKS_MAX,
            "{held} entries after {i} prompts"
        );
    }
    let table = r.pending.model("m").unwrap();
    assert_eq!(table.len(), PENDING_BLOCKS_MAX);
    assert!(table.fifo_len() <= PENDING_BLOCKS_MAX);
    let metrics = metrics_text(&base).await;
    assert!(
        metrics.contains(&format!(
            "kvroute_pending_prefix_blocks{{model=\"m\"}} {PENDING_BLOCKS_MAX}"
        )),
        "{metrics}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}
