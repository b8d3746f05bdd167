//! `kvroute demo`: the README's main command. It shows, on this machine and with nothing else
//! running, what cache-aware routing buys over load-only policies.
//!
//! For each policy it starts a FRESH simulated fleet in-process (so every policy starts with
//! equally cold caches): 4 engines x 2 DP ranks = 8 ranks with a deliberately small prefix cache
//! per rank and realistic prefill/decode timing, plus a router on port 0 pointed at it. It waits
//! until every rank's KV subscriber is connected, then drives the same deterministic multi-turn
//! chat workload (conversations sharing a few long system prompts, each turn resending the whole
//! history, like chat clients do) at a fixed concurrency. Streaming responses are used so the
//! time to first token is measured at the client as the arrival of the first chunk; the cache
//! hit rate is the engines' own `cached_tokens / prompt_tokens` from the usage chunk.
//!
//! The `oracle` row is `cache_aware` with one change: the per-rank matched prefix is read from
//! the simulated engines' ACTUAL caches at decision time ([`SimCacheOracle`], plugged in through
//! [`crate::kv::PrefixOracle`]) instead of from the router's event-built index. Same cost model,
//! same load signals, so `cache_aware / oracle` isolates what the index's lag and event losses
//! cost; the quality target is a ratio of at least 95%.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::config::{DemoArgs, PolicyKind, RouterConfig, WorkerSpec};
use crate::kv::{PrefixOracle, RankHit};

const ENGINES: usize = 4;
const DP_SIZE: usize = 2;
const BLOCK_SIZE_TOKENS: usize = 16;
/// Device blocks per rank: room for a couple of system prompts and their conversations, not all.
const CAPACITY_BLOCKS: usize = 320;
const SYSTEM_PROMPT_WORDS: usize = 700;
const REPLY_TOKENS_MAX: u32 = 24;
const MODEL: &str = "demo-model";
/// Longest wait for the router to be subscribed to every rank.
const SUBSCRIBE_DEADLINE_MS: u64 = 15_000;
/// Longest a single demo request may take before the demo reports a failure.
const DEMO_REQUEST_TIMEOUT_MS: u64 = 30_000;

const WORDS: &[&str] = &[
    "cache", "router", "token", "engine", "prefix", "block", "latency", "request", "model",
    "policy", "shard", "replica", "queue", "stream", "batch", "decode", "prefill", "memory",
    "tensor", "kernel", "the", "a", "of", "and", "to", "in", "is", "that", "for", "with", "as",
    "on", "by", "when", "answer", "question", "careful", "precise", "customer", "invoice",
    "weather", "travel", "recipe", "contract", "clause", "patient", "symptom", "lesson", "student",
    "garden", "planet", "orbit",
];

fn words(rng: &mut StdRng, n: usize) -> String {
    (0..n)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

struct Conversation {
    system: Arc<String>,
    user_turns: Vec<String>,
}

fn workload(args: &DemoArgs) -> Vec<Conversation> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let systems: Vec<Arc<String>> = (0..args.system_prompts.max(1))
        .map(|i| {
            Arc::new(format!(
                "You are assistant #{i}. {}",
                words(&mut rng, SYSTEM_PROMPT_WORDS)
            ))
        })
        .collect();
    (0..args.conversations)
        .map(|_| Conversation {
            system: systems[rng.random_range(0..systems.len())].clone(),
            user_turns: (0..args.turns.max(1))
                .map(|_| {
                    let n = rng.random_range(20..60);
                    words(&mut rng, n)
                })
                .collect(),
        })
        .collect()
}

#[derive(Default)]
struct Sample {
    ttft: Duration,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Matches prefixes against the in-process simulated engines' caches. It reads with
/// `tiers_of`, which does not touch the LRU order, so asking never changes what the engines
/// will evict (a `match_prefix` on the cache would).
pub struct SimCacheOracle {
    model: String,
    block_size: usize,
    engines: Vec<(String, Arc<kvroute_sim::Engine>)>,
}

impl SimCacheOracle {
    pub fn new(model: &str, fleet: &kvroute_sim::Fleet) -> SimCacheOracle {
        SimCacheOracle {
            model: model.to_string(),
            block_size: fleet
                .engines
                .first()
                .map_or(BLOCK_SIZE_TOKENS, |e| e.block_size()),
            engines: fleet
                .engines
                .iter()
                .map(|e| (e.http_url(), e.engine().clone()))
                .collect(),
        }
    }
}

impl PrefixOracle for SimCacheOracle {
    fn match_prefix(
        &self,
        model: &str,
        tokens: &[u32],
        visit: &mut dyn FnMut(&str, u32, RankHit),
    ) -> Option<usize> {
        if model != self.model {
            return None;
        }
        let keys = kvroute_sim::cache::block_keys(tokens, self.block_size);
        for (url, engine) in &self.engines {
            for (r, rank) in engine.ranks.iter().enumerate() {
                let mut hit = RankHit::default();
                {
                    let state = rank.state.lock();
                    for &key in &keys {
                        let Some((on_device, _)) = state.cache.tiers_of(key) else {
                            break;
                        };
                        hit.matched_blocks += 1;
                        hit.device_blocks += u32::from(on_device);
                    }
                }
                if hit.matched_blocks > 0 {
                    visit(url, r as u32, hit);
                }
            }
        }
        Some(self.block_size)
    }
}

#[derive(Debug)]
pub struct PolicyResult {
    pub policy: PolicyKind,
    /// `cache_aware` driven by [`SimCacheOracle`] instead of the index.
    pub oracle: bool,
    pub requests: usize,
    pub failures: usize,
    pub hit_rate: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p90_ms: f64,
    pub throughput_rps: f64,
    pub wall: Duration,
}

/// One streamed chat turn: returns the sample and the assistant's reply text.
async fn chat_turn(
    http: &reqwest::Client,
    url: &str,
    messages: &[Value],
) -> Result<(Sample, String), String> {
    let started = Instant::now();
    let resp = http
        .post(url)
        .json(&json!({"model": MODEL, "messages": messages, "max_tokens": REPLY_TOKENS_MAX, "stream": true,
            "stream_options": {"include_usage": true}}))
        .timeout(Duration::from_millis(DEMO_REQUEST_TIMEOUT_MS))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        let status = resp.status();
        return Err(format!(
            "{status}: {}",
            resp.text().await.unwrap_or_default()
        ));
    }
    let mut stream = resp.bytes_stream();
    let mut sample = Sample::default();
    let mut first = true;
    let mut buf = String::new();
    let mut reply = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if first {
            sample.ttft = started.elapsed();
            first = false;
        }
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                    reply.push_str(t);
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    sample.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                    sample.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0);
                }
            }
        }
    }
    Ok((sample, reply))
}

fn sim_config() -> kvroute_sim::SimConfig {
    kvroute_sim::SimConfig {
        engines: ENGINES,
        dp_size: DP_SIZE,
        port: 0,
        kv_port_base: 0,
        replay_port_base: 0,
        load_port_base: 0,
        load_publish: true,
        block_size: BLOCK_SIZE_TOKENS,
        capacity_blocks: CAPACITY_BLOCKS,
        overhead_us: 2_000,
        prefill_us_per_token: 60,
        decode_us_per_token: 1_000,
        served_model_name: MODEL.into(),
        ..kvroute_sim::SimConfig::default()
    }
}

async fn wait_subscribed(router: &crate::Router, ranks: usize) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_millis(SUBSCRIBE_DEADLINE_MS);
    loop {
        let states = router.kv.plane().rank_states();
        let connected = states
            .iter()
            .filter(|s| s.subscriber == kvroute_kv::SubscriberState::Connected)
            .count();
        if connected >= ranks {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "only {connected} of {ranks} rank subscribers connected"
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl PolicyResult {
    /// Row label: the policy, or `oracle`.
    pub fn name(&self) -> &'static str {
        if self.oracle {
            "oracle"
        } else {
            self.policy.as_str()
        }
    }
}

async fn run_policy(
    policy: PolicyKind,
    oracle: bool,
    args: &DemoArgs,
    conversations: &Arc<Vec<Conversation>>,
    bar: &ProgressBar,
) -> Result<PolicyResult, String> {
    let fleet = kvroute_sim::start_fleet(sim_config())
        .await
        .map_err(|e| e.to_string())?;
    let config = RouterConfig {
        workers: fleet
            .engines
            .iter()
            .map(|e| WorkerSpec {
                url: e.http_url(),
                model: None,
            })
            .collect(),
        policy,
        prefix_oracle: oracle
            .then(|| Arc::new(SimCacheOracle::new(MODEL, &fleet)) as Arc<dyn PrefixOracle>),
        tokenizer_path: Some(kvroute_sim::config::default_tokenizer_path()),
        rng_seed: Some(args.seed),
        weights: crate::config::CostWeights {
            prefill_cost_us_per_token: 60.0,
            ..Default::default()
        },
        ..RouterConfig::default()
    };
    let router = crate::serve(config).await.map_err(|e| e.to_string())?;
    wait_subscribed(&router.router, ENGINES * DP_SIZE).await?;
    let url = format!("{}/v1/chat/completions", router.url());
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency * 2)
        .build()
        .map_err(|e| e.to_string())?;
    let permits = Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..conversations.len() {
        let (convs, http, url, permits, bar) = (
            conversations.clone(),
            http.clone(),
            url.clone(),
            permits.clone(),
            bar.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let _permit = permits.acquire_owned().await.map_err(|e| e.to_string())?;
            let conv = &convs[i];
            let mut messages = vec![json!({"role": "system", "content": conv.system.as_str()})];
            let mut samples = Vec::new();
            let mut failures = 0usize;
            for turn in &conv.user_turns {
                messages.push(json!({"role": "user", "content": turn}));
                match chat_turn(&http, &url, &messages).await {
                    Ok((s, reply)) => {
                        samples.push(s);
                        messages.push(json!({"role": "assistant", "content": reply}));
                    }
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(error = %e, "demo request failed");
                        messages.push(json!({"role": "assistant", "content": ""}));
                    }
                }
                bar.inc(1);
            }
            Ok::<_, String>((samples, failures))
        }));
    }
    let mut samples = Vec::new();
    let mut failures = 0;
    for t in tasks {
        let (s, f) = t.await.map_err(|e| e.to_string())??;
        samples.extend(s);
        failures += f;
    }
    let wall = started.elapsed();
    router.shutdown().await;
    fleet.shutdown().await;
    let prompt: u64 = samples.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = samples.iter().map(|s| s.cached_tokens).sum();
    let mut ttft_ms: Vec<f64> = samples
        .iter()
        .map(|s| s.ttft.as_secs_f64() * 1000.0)
        .collect();
    ttft_ms.sort_by(f64::total_cmp);
    let mean = if ttft_ms.is_empty() {
        0.0
    } else {
        ttft_ms.iter().sum::<f64>() / ttft_ms.len() as f64
    };
    let p90 = ttft_ms
        .get(((ttft_ms.len() as f64 * 0.9).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(0.0);
    Ok(PolicyResult {
        policy,
        oracle,
        requests: samples.len(),
        failures,
        hit_rate: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        ttft_mean_ms: mean,
        ttft_p90_ms: p90,
        throughput_rps: samples.len() as f64 / wall.as_secs_f64(),
        wall,
    })
}

/// Runs every selected policy on a fresh fleet and returns the results (no printing but the
/// progress bar, which is hidden when stderr is not a terminal). When `cache_aware` is
/// selected, an `oracle` run follows it.
pub async fn run_policies(args: &DemoArgs) -> Result<Vec<PolicyResult>, String> {
    let selected: Vec<PolicyKind> = if args.policies.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        args.policies.clone()
    };
    let policies: Vec<(PolicyKind, bool)> = selected
        .iter()
        .flat_map(|&p| {
            let oracle = (p == PolicyKind::CacheAware).then_some((p, true));
            std::iter::once((p, false)).chain(oracle)
        })
        .collect();
    let conversations = Arc::new(workload(args));
    let per_policy = conversations
        .iter()
        .map(|c| c.user_turns.len())
        .sum::<usize>();
    let bar = ProgressBar::new((per_policy * policies.len()) as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests {msg}",
        )
        .map_err(|e| e.to_string())?,
    );
    let mut results = Vec::new();
    for &(p, oracle) in &policies {
        bar.set_message(if oracle { "oracle" } else { p.as_str() });
        results.push(run_policy(p, oracle, args, &conversations, &bar).await?);
    }
    bar.finish_and_clear();
    Ok(results)
}

/// `cache_aware`'s hit rate as a fraction of the oracle's, when both ran.
pub fn cache_aware_to_oracle_hit_rate(results: &[PolicyResult]) -> Option<f64> {
    let find = |oracle: bool| {
        results
            .iter()
            .find(|r| r.policy == PolicyKind::CacheAware && r.oracle == oracle)
    };
    let (index, oracle) = (find(false)?, find(true)?);
    (oracle.hit_rate > 0.0).then(|| index.hit_rate / oracle.hit_rate)
}

/// Runs the demo and prints one line per policy.
pub async fn run(args: DemoArgs) -> Result<(), String> {
    println!(
        "kvroute demo: {} engines x {} DP ranks (block {} tokens, {} device blocks per rank), \
         {} conversations over {} system prompts, {} turns each, concurrency {}, seed {}",
        ENGINES,
        DP_SIZE,
        BLOCK_SIZE_TOKENS,
        CAPACITY_BLOCKS,
        args.conversations,
        args.system_prompts,
        args.turns,
        args.concurrency,
        args.seed
    );
    let total_started = Instant::now();
    let results = run_policies(&args).await?;
    println!(
        "{:<14} {:>9} {:>14} {:>13} {:>10} {:>9} {:>8}",
        "policy", "hit_rate", "ttft_mean_ms", "ttft_p90_ms", "req/s", "requests", "failed"
    );
    for r in &results {
        println!(
            "{:<14} {:>8.1}% {:>14.1} {:>13.1} {:>10.1} {:>9} {:>8}",
            r.name(),
            r.hit_rate * 100.0,
            r.ttft_mean_ms,
            r.ttft_p90_ms,
            r.throughput_rps,
            r.requests,
            r.failures
        );
    }
    if let Some(ratio) = cache_aware_to_oracle_hit_rate(&results) {
        println!(
            "cache_aware / oracle hit rate: {:.1}% (quality target >= 95%)",
            ratio * 100.0
        );
    }
    println!(
        "total wall time {:.1} s",
        total_started.elapsed().as_secs_f64()
    );
    if results.iter().any(|r| r.failures > 0) {
        return Err("some demo requests failed (see warnings above)".into());
    }
    Ok(())
}
