//! vLLM's own load from its `/metrics`, end to end: a simulated vLLM engine (vLLM KV encoding,
//! no ZMQ load feed, `/metrics` with `vllm:num_requests_running{engine="N"}`) is loaded by
//! requests the router never saw (sent to the engine directly, pinned to DP rank 0). A router
//! that scrapes `/metrics` sees that load and sends new prompts to rank 1; a router that does
//! not scrape sees two idle ranks.

mod common;

use common::*;
use kvroute::RouterConfig;
use kvroute_sim::SimConfig;
use kvroute_sim::config::KvEncodingArg;
use serde_json::json;

/// Requests held on rank 0 behind the router's back.
const OUTSIDE_REQUESTS: u64 = 3;
/// Their length: each decodes this many tokens at [`DECODE_US_PER_TOKEN`].
const OUTSIDE_REPLY_TOKENS: u64 = 40;
const DECODE_US_PER_TOKEN: u64 = 100_000;
const SCRAPE_INTERVAL_MS: u64 = 100;

async fn vllm_fleet() -> kvroute_sim::Fleet {
    kvroute_sim::start_fleet(SimConfig {
        engines: 1,
        dp_size: 2,
        served_model_name: "m".into(),
        kv_encoding: KvEncodingArg::Vllm,
        load_publish: false,
        instant: false,
        overhead_us: 0,
        prefill_us_per_token: 1,
        decode_us_per_token: DECODE_US_PER_TOKEN,
        ..SimConfig::for_tests()
    })
    .await
    .expect("fleet starts")
}

fn load_outside_the_router(engine: &str) -> Vec<tokio::task::JoinHandle<()>> {
    (0..OUTSIDE_REQUESTS)
        .map(|i| {
            let url = format!("{engine}/v1/completions");
            tokio::spawn(async move {
                let _ = client()
                    .post(url)
                    .json(&json!({"model": "m", "prompt": format!("outside {i}"),
                        "max_tokens": OUTSIDE_REPLY_TOKENS, "data_parallel_rank": 0}))
                    .send()
                    .await;
            })
        })
        .collect()
}

fn rank0_engine_load(w: &serde_json::Value) -> Option<u64> {
    let load = &w["workers"][0]["ranks"][0]["engine_load"];
    Some(load["running"].as_u64()? + load["waiting"].as_u64()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_reading_vllm_metrics_steers_around_load_it_did_not_send() {
    let fleet = vllm_fleet().await;
    let urls = urls(&fleet);
    for scrape in [true, false] {
        let router = kvroute::serve(RouterConfig {
            engine_metrics_interval_ms: if scrape { SCRAPE_INTERVAL_MS } else { 0 },
            ..router_config(&urls)
        })
        .await
        .expect("router");
        let base = router.url();
        let outside = load_outside_the_router(&urls[0]);
        if scrape {
            wait_until(
                "the router to read rank 0's outside load from /metrics",
                WAIT_DEADLINE,
                || async {
                    let w = workers(&base).await;
                    match rank0_engine_load(&w) {
                        Some(n) if n == OUTSIDE_REQUESTS => Ok(()),
                        _ => Err(w["workers"][0]["ranks"].to_string()),
                    }
                },
            )
            .await;
        } else {
            // The engine is loaded (its own /metrics says so) while the router sees nothing.
            wait_until(
                "the engine to run the outside requests",
                WAIT_DEADLINE,
                || async {
                    let text = client()
                        .get(format!("{}/metrics", urls[0]))
                        .send()
                        .await
                        .map_err(|e| e.to_string())?
                        .text()
                        .await
                        .map_err(|e| e.to_string())?;
                    if text.contains(&format!(
                    "vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {OUTSIDE_REQUESTS}"
                )) {
                    Ok(())
                } else {
                    Err(text)
                }
                },
            )
            .await;
            assert_eq!(
                rank0_engine_load(&workers(&base).await),
                None,
                "without scraping the router knows no engine load"
            );
        }
        let mut to_rank0 = 0;
        for i in 0..8 {
            let (status, body, headers) = post_json(
                &format!("{base}/v1/completions"),
                &json!({"model": "m", "prompt": format!("a new prompt {i}"), "max_tokens": 1}),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            if decision(&headers).contains("dp_rank=0;") {
                to_rank0 += 1;
            }
        }
        if scrape {
            assert_eq!(to_rank0, 0, "the scraped load keeps new prompts off rank 0");
        } else {
            assert!(
                to_rank0 > 0,
                "blind to the outside load, the router uses both ranks (control)"
            );
        }
        let m = metrics_text(&base).await;
        let scrapes_ok = m
            .lines()
            .any(|l| l.starts_with("kvroute_engine_metrics_scrapes_total{result=\"ok\"}"));
        assert_eq!(
            scrapes_ok, scrape,
            "scrape counter present iff scraping:\n{m}"
        );
        router.shutdown().await;
        for t in outside {
            t.await.unwrap();
        }
    }
}
