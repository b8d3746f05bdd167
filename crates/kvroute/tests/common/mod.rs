//! Shared helpers of the router's end-to-end tests: a simulated fleet (real HTTP, real ZMQ) from
//! `kvroute-sim`, a router started in-process on port 0, and condition waits with deadlines.
#![allow(dead_code)]

use std::future::Future;
use std::time::{Duration, Instant};

use kvroute::{RouterConfig, WorkerSpec};
use kvroute_sim::{Fleet, SimConfig};
use serde_json::{Value, json};

pub const WAIT_DEADLINE: Duration = Duration::from_secs(10);

/// Polls `probe` until it returns `Some`, or panics after `deadline` naming what was awaited and
/// the last thing seen.
pub async fn wait_until<T, F, Fut>(what: &str, deadline: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    let mut last;
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(seen) => last = seen,
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for {what}; last seen: {last}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn tokenizer_path() -> std::path::PathBuf {
    kvroute_sim::config::default_tokenizer_path()
}

/// `engines` simulated engines with `dp_size` ranks each, OS-assigned ports, no delays.
pub async fn fleet(engines: usize, dp_size: usize, model: &str) -> Fleet {
    let cfg = SimConfig {
        engines,
        dp_size,
        served_model_name: model.to_string(),
        ..SimConfig::for_tests()
    };
    kvroute_sim::start_fleet(cfg).await.expect("fleet starts")
}

pub fn urls(fleet: &Fleet) -> Vec<String> {
    fleet.engines.iter().map(|e| e.http_url()).collect()
}

/// A router config over `urls` with the repository tokenizer and a fixed seed.
pub fn router_config(urls: &[String]) -> RouterConfig {
    RouterConfig {
        workers: urls.iter().map(|u| WorkerSpec::parse(u).unwrap()).collect(),
        tokenizer_path: Some(tokenizer_path()),
        decision_header: true,
        rng_seed: Some(11),
        health_interval_ms: 60_000,
        ..RouterConfig::default()
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}

pub async fn post_json(url: &str, body: &Value) -> (u16, Value, reqwest::header::HeaderMap) {
    let resp = client()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("request sent");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, body, headers)
}

pub fn decision(headers: &reqwest::header::HeaderMap) -> String {
    headers
        .get("x-kvroute-decision")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

pub async fn workers(base: &str) -> Value {
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
pub async fn wait_subscribed(base: &str, ranks: usize) {
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

/// The router's `/metrics` text.
pub async fn metrics_text(base: &str) -> String {
    client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The counter of text prompts routed untokenized past `--tokenize-text-bytes-max`.
pub const UNTOKENIZED_TEXT_TOO_LONG: &str =
    r#"kvroute_untokenized_prompts_total{reason="text_too_long"}"#;

/// The value of the sample line that starts with `series` (name and labels exactly as the
/// router prints them), `None` when the router printed no such line.
pub fn metric_value(metrics: &str, series: &str) -> Option<String> {
    metrics
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .map(str::to_string)
}

/// Stores a fresh one-block chain (distinct per `attempt`) on the rank: a batch the engine
/// must announce, since it never held those blocks.
fn store_sentinel(engine: &kvroute_sim::EngineHandle, rank: u32, attempt: u32) {
    let sentinel: Vec<u32> = (0..engine.block_size() as u32)
        .map(|t| 60_000 + attempt * 64 + t)
        .collect();
    engine.store_chains(rank as usize, &[sentinel]);
}

/// Stores `chain` on `engine`'s `rank` and waits until the router's index shows `blocks` of it
/// on that rank.
///
/// Two phases, because of ZMQ's slow joiner: events published before the router's
/// subscription reaches the engine's PUB socket are dropped, and an engine never re-announces a
/// block it already holds, so a chain whose one announcement was dropped could never be indexed
/// by storing it again. First, fresh sentinel blocks are stored until the router has APPLIED a
/// batch from this rank (the subscription is live, and the router has a cursor, so any later
/// loss shows as a gap that it replays); only then is the chain stored, once.
pub async fn store_until_indexed(
    base: &str,
    engine: &kvroute_sim::EngineHandle,
    rank: u32,
    chain: &[u32],
    blocks: u64,
) {
    let url = engine.http_url();
    let mut attempt = 0u32;
    wait_until(
        "a batch from the rank to be applied by the router (subscription live)",
        WAIT_DEADLINE,
        || {
            attempt += 1;
            store_sentinel(engine, rank, attempt);
            let (base, url) = (base.to_string(), url.clone());
            async move {
                let w = workers(&base).await;
                let applied = w["workers"]
                    .as_array()
                    .and_then(|ws| ws.iter().find(|x| x["url"] == url.as_str()))
                    .and_then(|x| x["kv_ranks"].as_array())
                    .and_then(|rs| rs.iter().find(|r| r["dp_rank"] == rank))
                    .and_then(|r| r["applied_batches"].as_u64());
                match applied {
                    Some(n) if n > 0 => Ok(()),
                    _ => Err(format!("applied_batches {applied:?}: {w}")),
                }
            }
        },
    )
    .await;
    engine.store_chains(rank as usize, &[chain.to_vec()]);
    wait_until(
        "the stored chain to reach the router's index",
        WAIT_DEADLINE,
        || {
            // A fresh sentinel per poll keeps batches flowing: had the chain's batch been lost
            // after all, the next one shows the router a gap, which it replays.
            attempt += 1;
            store_sentinel(engine, rank, attempt);
            let (base, url, chain) = (base.to_string(), url.clone(), chain.to_vec());
            async move {
                let (_, v, _) = post_json(
                    &format!("{base}/debug/route"),
                    &json!({"model": "m", "prompt": chain}),
                )
                .await;
                let got = v["ranks"]
                    .as_array()
                    .and_then(|r| {
                        r.iter()
                            .find(|r| r["url"] == url.as_str() && r["dp_rank"] == rank)
                    })
                    .and_then(|r| r["matched_blocks"].as_u64());
                if got == Some(blocks) {
                    Ok(())
                } else {
                    Err(format!("matched {got:?}: {v}"))
                }
            }
        },
    )
    .await;
}

/// A port nothing listens on right now (bound and released; a test that starts a server on it
/// right away is racing only other processes of this machine).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `(worker url, dp rank) -> field` over every rank of a `/workers` answer.
pub fn rank_field(workers: &Value, field: &str) -> Vec<(String, u64, i64)> {
    let mut out = Vec::new();
    for w in workers["workers"].as_array().into_iter().flatten() {
        for r in w["ranks"].as_array().into_iter().flatten() {
            out.push((
                w["url"].as_str().unwrap_or_default().to_string(),
                r["dp_rank"].as_u64().unwrap_or(0),
                r[field].as_i64().unwrap_or(-1),
            ));
        }
    }
    out.sort();
    out
}
