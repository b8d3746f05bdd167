//! End-to-end: engine KV events -> KV plane -> index -> the router's choice, over real ZMQ and
//! HTTP against the simulated fleet.

mod common;

use common::*;
use serde_json::json;

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
    store_until_indexed(&base, &fleet.engines[1], 1, &prompt[..block * 5], 5).await;
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
        // An idle fleet: no rank is over the bounded-load guard.
        assert_eq!(r["within_load_bound"], true, "{r}");
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

/// Device blocks per rank of the fleets in the free-room tests.
const ROOM_TEST_CAPACITY_BLOCKS: usize = 128;

/// The cost model's free cache room end to end: the engine names its capacity (SGLang's load
/// feed), the pump counts each rank's blocks, and a new prompt goes to the idle, empty rank
/// rather than to the full one that holds its opening (`routing::policy::score_in_fleet`). With
/// every rank's room unknown the opening would win (the policy's unit tests pin both sides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_prompt_fills_an_empty_rank_rather_than_displacing_a_full_ranks_cache() {
    let fleet = kvroute_sim::start_fleet(kvroute_sim::config::SimConfig {
        engines: 1,
        dp_size: 2,
        served_model_name: "m".to_string(),
        capacity_blocks: ROOM_TEST_CAPACITY_BLOCKS,
        load_publish: true,
        ..kvroute_sim::config::SimConfig::for_tests()
    })
    .await
    .expect("fleet starts");
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    new_prompt_fills_the_empty_rank(&fleet, &router).await;
    router.shutdown().await;
    fleet.shutdown().await;
}

/// The same with a vLLM engine, which has no load feed: the router reads its capacity from
/// `vllm:cache_config_info` on its `/metrics` (`control::engine_metrics`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_engines_capacity_from_its_metrics_lets_a_new_prompt_fill_an_empty_rank() {
    let fleet = kvroute_sim::start_fleet(kvroute_sim::SimConfig {
        dp_size: 2,
        served_model_name: "m".to_string(),
        kv_encoding: kvroute_sim::config::KvEncodingArg::Vllm,
        no_server_info: true,
        capacity_blocks: ROOM_TEST_CAPACITY_BLOCKS,
        ..kvroute_sim::SimConfig::for_tests()
    })
    .await
    .expect("fleet starts");
    let router = kvroute::serve(kvroute::RouterConfig {
        engine_metrics_interval_ms: 100,
        ..router_config_by_flags(&fleet.engines[0], 2, None)
    })
    .await
    .unwrap();
    new_prompt_fills_the_empty_rank(&fleet, &router).await;
    router.shutdown().await;
    fleet.shutdown().await;
}

/// Fills rank 0 of the fleet's one engine with the prompt's opening and other content, leaves
/// rank 1 empty, and checks that the router sends a new prompt to rank 1 for its room.
async fn new_prompt_fills_the_empty_rank(
    fleet: &kvroute_sim::Fleet,
    router: &kvroute::RouterHandle,
) {
    let base = router.url();
    wait_subscribed(&base, 2).await;
    let engine = &fleet.engines[0];
    let block = engine.block_size();
    // Rank 0 holds the prompt's 4-block opening, then 96 blocks of other content: with the
    // sentinels the helper stores, at most 28 blocks of its 128 are free.
    let opening: Vec<u32> = (0..(block * 4) as u32).map(|t| 1_000 + t).collect();
    store_until_indexed(&base, engine, 0, &opening, 4).await;
    let other: Vec<u32> = (0..(block * (ROOM_TEST_CAPACITY_BLOCKS - 32)) as u32)
        .map(|t| 20_000 + t)
        .collect();
    engine.store_chains(0, &[other]);
    let mut prompt = opening.clone();
    prompt.extend((0..(block * 60) as u32).map(|t| 5_000 + t));
    let req = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    let opening_tokens = (block * 4) as f64;
    let scored = wait_until(
        "rank 0 mostly full and both ranks' rooms known to the router",
        WAIT_DEADLINE,
        || async {
            let (_, v, _) = post_json(&format!("{base}/debug/route"), &req).await;
            let rank = |dp: u64| {
                v["ranks"]
                    .as_array()
                    .and_then(|rs| rs.iter().find(|r| r["dp_rank"] == dp))
                    .cloned()
                    .unwrap_or_default()
            };
            let (full, empty) = (rank(0), rank(1));
            let full_room = full["cache_room_tokens"].as_f64();
            let ready = full["matched_blocks"] == 4
                && full_room.is_some_and(|room| room <= (28 * block) as f64)
                && empty["cache_room_tokens"].as_f64()
                    == Some((ROOM_TEST_CAPACITY_BLOCKS * block) as f64);
            if ready {
                Ok(v.clone())
            } else {
                Err(v.to_string())
            }
        },
    )
    .await;
    let ranks = scored["ranks"].as_array().unwrap();
    let empty = ranks.iter().find(|r| r["dp_rank"] == 1).unwrap();
    assert_eq!(
        empty["displaced_tokens"].as_f64(),
        Some(opening_tokens),
        "only the copy of the opening rank 0 holds is charged on the empty rank: {empty}"
    );
    assert_eq!(scored["chosen"]["dp_rank"], 1, "{scored}");
    assert_eq!(scored["reason"], "room_over_cache", "{scored}");
    let (status, body, headers) = post_json(&format!("{base}/v1/completions"), &req).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        decision(&headers).contains("reason=room_over_cache;"),
        "{}",
        decision(&headers)
    );
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
    store_until_indexed(&base, &fleet.engines[0], 0, &prompt, 4).await;
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
    // Without a peer source nothing bootstraps: every rank says so on /workers.
    let mut ranks_seen = 0;
    for worker in w["workers"].as_array().unwrap() {
        for rank in worker["kv_ranks"].as_array().unwrap() {
            assert_eq!(rank["bootstrap"]["state"], "off", "{rank}");
            assert_eq!(rank["bootstrap"]["held_batches"], 0, "{rank}");
            ranks_seen += 1;
        }
    }
    assert!(ranks_seen > 0, "no KV rank listed on /workers: {w}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_registered_while_down_gets_its_kv_events_once_it_answers() {
    // Reserve a port, free it, register URL@model there while nothing listens.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let cfg = kvroute::RouterConfig {
        workers: vec![kvroute::WorkerSpec::parse(&format!("{url}@m")).unwrap()],
        health_interval_ms: 50,
        health_timeout_ms: 200,
        ..router_config(&[])
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let base = router.url();
    let w = workers(&base).await;
    let h = w["workers"][0]["health"].as_str().unwrap().to_string();
    assert!(
        h == "pending" || h == "down",
        "an unreachable worker must not be routable: {w}"
    );
    let fleet = kvroute_sim::start_fleet(kvroute_sim::SimConfig {
        port,
        served_model_name: "m".into(),
        ..kvroute_sim::SimConfig::for_tests()
    })
    .await
    .unwrap();
    wait_subscribed(&base, 1).await;
    let block = fleet.engines[0].block_size();
    let prompt: Vec<u32> = (0..(block * 3) as u32).map(|t| 300 + t).collect();
    store_until_indexed(&base, &fleet.engines[0], 0, &prompt, 3).await;
    let req = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    wait_until(
        "the late-discovered worker's blocks to reach the index",
        WAIT_DEADLINE,
        || async {
            let (_, v, _) = post_json(&format!("{base}/debug/route"), &req).await;
            if v["ranks"][0]["matched_blocks"] == 3 {
                Ok(())
            } else {
                Err(v.to_string())
            }
        },
    )
    .await;
    router.shutdown().await;
    fleet.shutdown().await;
}

/// A worker whose model must be read from its engine cannot register while the engine is down:
/// until it does, `/workers` lists it under `registering` with its last error, and `/readyz`
/// names it, instead of both showing an empty fleet; once the engine answers it registers and
/// leaves the list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_register_yet_is_listed_with_its_error_until_it_registers() {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let router = kvroute::serve(router_config(std::slice::from_ref(&url)))
        .await
        .unwrap();
    let base = router.url();
    let retrying = wait_until(
        "the unreachable worker listed under registering",
        WAIT_DEADLINE,
        || async {
            let w = workers(&base).await;
            match w["registering"].as_array() {
                Some(r) if r.len() == 1 && r[0]["failed_attempts"].as_u64() >= Some(1) => {
                    Ok(r[0].clone())
                }
                _ => Err(w.to_string()),
            }
        },
    )
    .await;
    assert_eq!(retrying["url"], url.as_str(), "{retrying}");
    assert!(
        retrying["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("server_info")),
        "the error says what failed: {retrying}"
    );
    let ready = client().get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let reason = ready.text().await.unwrap();
    assert!(reason.contains(&url), "/readyz names the worker: {reason}");
    let fleet = kvroute_sim::start_fleet(kvroute_sim::SimConfig {
        port,
        served_model_name: "m".into(),
        ..kvroute_sim::SimConfig::for_tests()
    })
    .await
    .unwrap();
    wait_until(
        "the worker registered and gone from registering",
        WAIT_DEADLINE,
        || async {
            let w = workers(&base).await;
            if w["workers"].as_array().map(Vec::len) == Some(1)
                && w["registering"].as_array().is_some_and(Vec::is_empty)
            {
                Ok(())
            } else {
                Err(w.to_string())
            }
        },
    )
    .await;
    router.shutdown().await;
    fleet.shutdown().await;
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_on_the_same_ports_is_routed_to_and_indexed_again() {
    let (http, kv, replay) = (free_port(), free_port(), free_port());
    let sim = || kvroute_sim::SimConfig {
        port: http,
        kv_port_base: kv,
        replay_port_base: replay,
        served_model_name: "m".into(),
        ..kvroute_sim::SimConfig::for_tests()
    };
    let fleet1 = kvroute_sim::start_fleet(sim()).await.unwrap();
    let cfg = kvroute::RouterConfig {
        health_interval_ms: 50,
        health_timeout_ms: 200,
        ..router_config(&urls(&fleet1))
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let base = router.url();
    wait_subscribed(&base, 1).await;
    let block = fleet1.engines[0].block_size();
    let before: Vec<u32> = (0..(block * 2) as u32).map(|t| 500 + t).collect();
    store_until_indexed(&base, &fleet1.engines[0], 0, &before, 2).await;
    let matched = |prompt: Vec<u32>| {
        let base = base.clone();
        async move {
            let (_, v, _) = post_json(
                &format!("{base}/debug/route"),
                &json!({"model": "m", "prompt": prompt}),
            )
            .await;
            v["ranks"][0]["matched_blocks"]
                .as_u64()
                .ok_or_else(|| v.to_string())
        }
    };
    wait_until(
        "the first incarnation's blocks in the index",
        WAIT_DEADLINE,
        || async {
            match matched(before.clone()).await? {
                2 => Ok(()),
                n => Err(format!("matched {n}")),
            }
        },
    )
    .await;
    fleet1.shutdown().await;
    let fleet2 = kvroute_sim::start_fleet(sim()).await.unwrap();
    let after: Vec<u32> = (0..(block * 3) as u32).map(|t| 900 + t).collect();
    // The restarted engine publishes from seq 0 again; its first batches may reach the
    // subscriber before it has reconnected, which the helper's sentinels expose and repair.
    store_until_indexed(&base, &fleet2.engines[0], 0, &after, 3).await;
    wait_until(
        "the restarted engine to be healthy",
        WAIT_DEADLINE,
        || async {
            let w = workers(&base).await;
            if w["workers"][0]["health"] == "healthy" {
                Ok(())
            } else {
                Err(w.to_string())
            }
        },
    )
    .await;
    let (status, body, _) = post_json(
        &format!("{base}/v1/completions"),
        &json!({"model": "m", "prompt": after, "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some((block * 3) as u64)
    );
    router.shutdown().await;
    fleet2.shutdown().await;
}

/// A fleet of engines that advertise nothing, as vLLM does (no `/server_info`; vLLM's event
/// encoding), each with `dp_size` ranks.
async fn vllm_style_fleet(dp_size: usize) -> kvroute_sim::Fleet {
    let cfg = kvroute_sim::SimConfig {
        dp_size,
        served_model_name: "m".to_string(),
        kv_encoding: kvroute_sim::config::KvEncodingArg::Vllm,
        no_server_info: true,
        ..kvroute_sim::SimConfig::for_tests()
    };
    kvroute_sim::start_fleet(cfg).await.expect("fleet starts")
}

/// A router told the engine's publisher by its flags, as a vLLM fleet needs, with `block_size`
/// as its `--block-size` (`None`: the flag left unset).
fn router_config_by_flags(
    engine: &kvroute_sim::EngineHandle,
    dp_size: u32,
    block_size: Option<usize>,
) -> kvroute::RouterConfig {
    let ports = engine.ports();
    kvroute::RouterConfig {
        kv_defaults: kvroute::routing::kv::KvFlagDefaults {
            events_endpoint_template: Some(format!("tcp://{{host}}:{}", ports.kv_base)),
            replay_port_base: Some(ports.replay_base),
            block_size,
            dp_size: Some(dp_size),
        },
        ..router_config(&[engine.http_url()])
    }
}

/// The rank's entry of `GET /workers`.
fn kv_rank(w: &serde_json::Value, url: &str, dp_rank: u32) -> Option<serde_json::Value> {
    w["workers"].as_array()?.iter().find(|x| x["url"] == url)?["kv_ranks"]
        .as_array()?
        .iter()
        .find(|r| r["dp_rank"] == dp_rank)
        .cloned()
}

/// vLLM advertises nothing: the router learns the publisher from `--kv-events-endpoint-template`,
/// and with `--block-size` unset indexes the events in vLLM's default 16-token blocks (it used
/// to refuse the worker: "no default is configured", routed on load only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_advertises_nothing_is_indexed_from_the_router_flags() {
    let fleet = vllm_style_fleet(2).await;
    let engine = &fleet.engines[0];
    let block = engine.block_size();
    assert_eq!(
        block,
        kvroute::control::router::FALLBACK_BLOCK_SIZE_TOKENS,
        "the engine must use the default the router assumes"
    );
    let router = kvroute::serve(router_config_by_flags(engine, 2, None))
        .await
        .unwrap();
    let base = router.url();
    wait_subscribed(&base, 2).await;
    let w = workers(&base).await;
    assert_eq!(w["workers"][0]["kv_source"], "flags", "{w}");
    let prompt: Vec<u32> = (0..(block * 5) as u32).map(|t| 3000 + t).collect();
    store_until_indexed(&base, engine, 1, &prompt, 5).await;
    let rank = kv_rank(&workers(&base).await, &engine.http_url(), 1).expect("rank 1 listed");
    assert_eq!(
        rank["foreign_block_size"],
        serde_json::Value::Null,
        "{rank}"
    );
    assert_eq!(rank["skipped_blocks"]["block_size"], 0, "{rank}");
    router.shutdown().await;
    fleet.shutdown().await;
}

/// The router hashes prompts in its `--block-size` blocks; an engine storing other ones can never
/// be matched. Its stream still looks healthy (batches arrive and apply), so the router must say
/// so where an operator looks: the rank on `GET /workers` and the skipped-blocks metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_block_size_flag_is_shown_on_the_rank_instead_of_a_silent_zero_hit_rate() {
    let fleet = vllm_style_fleet(1).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let block = engine.block_size();
    let router = kvroute::serve(router_config_by_flags(engine, 1, Some(block * 2)))
        .await
        .unwrap();
    let base = router.url();
    wait_subscribed(&base, 1).await;
    let mut attempt = 0u32;
    let rank = wait_until(
        "the rank to show the engine's foreign block size",
        WAIT_DEADLINE,
        || {
            // Keep storing: the first stores may be published before the subscription joins.
            attempt += 1;
            let chain: Vec<u32> = (0..(block * 2) as u32)
                .map(|t| 70_000 + attempt * 64 + t)
                .collect();
            engine.store_chains(0, &[chain]);
            let (base, url) = (base.clone(), url.clone());
            async move {
                let w = workers(&base).await;
                match kv_rank(&w, &url, 0) {
                    Some(r) if r["foreign_block_size"] == block => Ok(r),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await;
    let skipped = rank["skipped_blocks"]["block_size"].as_u64().unwrap_or(0);
    assert!(skipped >= 2, "{rank}");
    let metrics = metrics_text(&base).await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kvroute_kv_skipped_blocks_total{reason=\"block_size\"}")),
        "{metrics}"
    );
    let (_, scored, _) = post_json(
        &format!("{base}/debug/route"),
        &json!({"model": "m", "prompt": (0..(block * 4) as u32).map(|t| 70_064 + t).collect::<Vec<u32>>()}),
    )
    .await;
    assert!(
        scored["ranks"]
            .as_array()
            .is_some_and(|r| r.iter().all(|r| r["matched_blocks"] == 0)),
        "nothing of a foreign block size may be indexed: {scored}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}
