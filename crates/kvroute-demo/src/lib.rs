//! `kvroute-demo`: the README's main command. It shows, on this machine and with nothing else
//! running, what cache-aware routing buys over load-only policies.
//!
//! For each policy it starts a FRESH simulated fleet in-process (so every policy starts with
//! equally cold caches): 4 engines x 2 DP ranks = 8 ranks with a deliberately small prefix cache
//! per rank and realistic prefill/decode timing, plus a router on port 0 pointed at it. It waits
//! until every rank's KV subscriber is connected, then drives the same deterministic multi-turn
//! chat workload (conversations sharing a few long system prompts, each turn resending the whole
//! history, like chat clients do) at a fixed concurrency.
//!
//! The default workload is a MIXED load, the regime in which routers differ: the prompts'
//! popularity is skewed (Zipf 1.2: one tenant opens ~43 % of the conversations), the hot
//! tenant's working set exceeds one rank's cache, and each rank prefills one prompt at a time
//! (`--fleet-prefill serial`, a compute-bound GPU), so piling a tenant onto one rank queues its
//! prompts and evicts its histories. With uniform popularity and parallel prefill (available
//! through the flags) any sticky router spreads 8 prompts over 8 ranks
//! by itself and load never delays a prompt, so every cache-aware router ties at the ceiling.
//!
//! Streaming responses are used so the time to first token is measured at the client as the
//! arrival of the first chunk; the cache hit rate is the engines' own
//! `cached_tokens / prompt_tokens` from the usage chunk.
//!
//! The `oracle` row is `cache_aware` with one change: the per-rank matched prefix is read from
//! the simulated engines' ACTUAL caches at decision time ([`SimCacheOracle`], plugged in through
//! [`kvroute::routing::kv::PrefixOracle`]) instead of from the router's event-built index. Same cost model,
//! same load signals, so `cache_aware / oracle` isolates what the index's lag and event losses
//! cost; the quality target is a ratio of at least 95%.
//!
//! `--router-url` drives the SAME workload (same conversations, seed, concurrency, request
//! shape and measurement) once through an external router instead, with no in-process fleet or
//! router: this is how kvroute is compared with other routers in front of `kvroute-sim`
//! processes configured like the fleet here (`bench/quality_vs_peers.sh`). The driver code is
//! shared, not forked, so an external row and an in-process row measure the same thing.
//!
//! Every row also reports how the load was spread: requests per (engine, DP rank), read from
//! the engines' own counters (`/served_stats`, or the in-process engines directly), never from
//! the router, and reduced to the share served by the busiest rank and by the busiest engine.

use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use kvroute::routing::kv::{PrefixOracle, RankHit};
use kvroute::routing::policy::CostWeights;
use kvroute::{PolicyKind, RouterConfig, WorkerSpec};

pub mod args;
pub mod chart;
pub mod core_wait;
pub mod long_conversations;
pub mod replicas;
pub mod rolling;

pub use args::{DemoArgs, FleetPrefill, Workload};

const ENGINES: usize = 4;
const DP_SIZE: usize = 2;
const BLOCK_SIZE_TOKENS: usize = 16;
/// Device blocks per rank: room for a couple of system prompts and their conversations, not all.
pub(crate) const CAPACITY_BLOCKS: usize = 320;
const SYSTEM_PROMPT_WORDS: usize = 700;
const REPLY_TOKENS_MAX: u32 = 24;
const MODEL: &str = "demo-model";
/// Longest wait for the router to be subscribed to every rank.
const SUBSCRIBE_DEADLINE_MS: u64 = 15_000;
/// Longest a single demo request may take before the demo reports a failure.
const DEMO_REQUEST_TIMEOUT_MS: u64 = 30_000;
/// Longest wait for one engine's `/served_stats` answer in external mode.
const SERVED_STATS_TIMEOUT_MS: u64 = 5_000;
/// Largest `/served_stats` body read (a few hundred bytes per rank is the real size).
const SERVED_STATS_MAX_BYTES: usize = 256 * 1024;

/// Largest Zipf exponent accepted for a popularity skew (prompts, sessions): beyond it
/// everything goes to the first item anyway. Shared by the flag modules, hence here.
pub const SYSTEM_PROMPT_SKEW_MAX: f64 = 16.0;

pub(crate) fn parse_skew(raw: &str) -> Result<f64, String> {
    parse_within(raw, SYSTEM_PROMPT_SKEW_MAX)
}

pub(crate) fn parse_eviction_cost_fraction(raw: &str) -> Result<f64, String> {
    parse_within(raw, kvroute::routing::policy::EVICTION_COST_FRACTION_MAX)
}

/// A number within `0..=max` (NaN is refused: it is within no range).
fn parse_within(raw: &str, max: f64) -> Result<f64, String> {
    let v: f64 = raw.parse().map_err(|e| format!("not a number: {e}"))?;
    if !(0.0..=max).contains(&v) {
        return Err(format!("must be within 0..={max}"));
    }
    Ok(v)
}

const WORDS: &[&str] = &[
    "cache", "router", "token", "engine", "prefix", "block", "latency", "request", "model",
    "policy", "shard", "replica", "queue", "stream", "batch", "decode", "prefill", "memory",
    "tensor", "kernel", "the", "a", "of", "and", "to", "in", "is", "that", "for", "with", "as",
    "on", "by", "when", "answer", "question", "careful", "precise", "customer", "invoice",
    "weather", "travel", "recipe", "contract", "clause", "patient", "symptom", "lesson", "student",
    "garden", "planet", "orbit",
];

pub(crate) fn words(rng: &mut StdRng, n: usize) -> String {
    (0..n)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) struct Conversation {
    system: Arc<String>,
    user_turns: Vec<String>,
    /// When the conversation starts, from the start of the run (0: at once, as a slot frees).
    start_after: Duration,
    /// Think time before each user turn (the first is 0); all 0 in the chat workload.
    think_before: Vec<Duration>,
}

/// The selected workload's conversations, the same for every row of a run.
fn workload(args: &DemoArgs) -> Vec<Conversation> {
    match args.workload {
        Workload::Chat => chat_workload(args),
        Workload::LongConversations => long_conversations::conversations(&args.long, args.seed),
    }
}

fn chat_workload(args: &DemoArgs) -> Vec<Conversation> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let systems: Vec<Arc<String>> = (0..args.system_prompts.max(1))
        .map(|i| {
            Arc::new(format!(
                "You are assistant #{i}. {}",
                words(&mut rng, SYSTEM_PROMPT_WORDS)
            ))
        })
        .collect();
    // Zipf popularity over the system prompts (prompt i weighs 1/(i+1)^skew). Skew 0 keeps
    // the uniform draw, and with it the exact conversations of earlier runs for the same seed.
    let popularity = (args.system_prompt_skew > 0.0).then(|| {
        let weights =
            (0..systems.len()).map(|i| 1.0 / ((i + 1) as f64).powf(args.system_prompt_skew));
        rand::distr::weighted::WeightedIndex::new(weights)
            .expect("finite positive weights over at least one prompt")
    });
    (0..args.conversations)
        .map(|_| Conversation {
            system: systems[match &popularity {
                Some(p) => rng.sample(p),
                None => rng.random_range(0..systems.len()),
            }]
            .clone(),
            user_turns: (0..args.turns.max(1))
                .map(|_| {
                    let n = rng.random_range(20..60);
                    words(&mut rng, n)
                })
                .collect(),
            start_after: Duration::ZERO,
            think_before: vec![Duration::ZERO; args.turns.max(1)],
        })
        .collect()
}

#[derive(Default)]
pub(crate) struct Sample {
    /// Which conversation of the workload (its index) this turn belongs to.
    conversation: usize,
    /// When the client sent it, from the start of the run.
    sent_at: Duration,
    ttft: Duration,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// The router's `x-kvroute-decision` header, when it sends one.
    decision: Option<String>,
    /// Which turn of its conversation this was (0 = the first, whose prompt is the system
    /// prompt and one question).
    turn: usize,
    /// For a later turn routed by a router that names its choice (the decision header): whether
    /// it went to another rank than the conversation's previous turn.
    moved: Option<bool>,
}

impl Sample {
    fn ttft_ms(&self) -> f64 {
        self.ttft.as_secs_f64() * 1000.0
    }
}

/// `(url, dp_rank)` and the reason named by an `x-kvroute-decision` value.
fn decision_rank_and_reason(decision: &str) -> Option<(String, String)> {
    let field = |name| decision_field(decision, name);
    Some((
        format!("{}#{}", field("url")?, field("dp_rank")?),
        field("reason")?.to_string(),
    ))
}

/// The value of `name` in an `x-kvroute-decision` value (`name=value;...`).
pub(crate) fn decision_field<'a>(decision: &'a str, name: &str) -> Option<&'a str> {
    decision
        .split(';')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

/// Where a router sent conversations' later turns, from its decision headers: the decision trace
/// behind a hit rate (a continuation sent to another rank than its history's pays its whole
/// prefill again).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContinuationTrace {
    /// Later turns whose rank and whose previous turn's rank are both known.
    pub routed: u64,
    /// Of those, sent to another rank than the previous turn's.
    pub moved: u64,
    /// The decision reasons of the moved ones.
    pub moved_by_reason: std::collections::BTreeMap<String, u64>,
}

/// The decision trace of a run's slowest tenth of requests (by time to first token).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlowestDecile {
    pub requests: u64,
    /// Of those, first turns of their conversation.
    pub first_turns: u64,
    pub by_reason: std::collections::BTreeMap<String, u64>,
}

impl SlowestDecile {
    fn of(samples: &[Sample]) -> SlowestDecile {
        let mut by_ttft: Vec<&Sample> = samples.iter().collect();
        by_ttft.sort_by_key(|s| std::cmp::Reverse(s.ttft));
        let mut d = SlowestDecile::default();
        for s in by_ttft.iter().take(samples.len().div_ceil(10)) {
            d.requests += 1;
            d.first_turns += u64::from(s.turn == 0);
            if let Some((_, reason)) = s.decision.as_deref().and_then(decision_rank_and_reason) {
                *d.by_reason.entry(reason).or_default() += 1;
            }
        }
        d
    }
}

impl ContinuationTrace {
    fn of(samples: &[Sample]) -> Option<ContinuationTrace> {
        let mut t = ContinuationTrace::default();
        for s in samples {
            let Some(moved) = s.moved else { continue };
            t.routed += 1;
            if moved {
                t.moved += 1;
                let reason = s
                    .decision
                    .as_deref()
                    .and_then(decision_rank_and_reason)
                    .map_or_else(|| "?".to_string(), |(_, r)| r);
                *t.moved_by_reason.entry(reason).or_default() += 1;
            }
        }
        (t.routed > 0).then_some(t)
    }
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

/// What one (engine, DP rank) served during a run, from the engine's own counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankServed {
    /// The engine's HTTP base URL.
    pub engine: String,
    pub dp_rank: u32,
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// How a run's requests were spread over the fleet (engine-side counts).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Balance {
    pub ranks: Vec<RankServed>,
}

impl Balance {
    fn total_requests(&self) -> u64 {
        self.ranks.iter().map(|r| r.requests).sum()
    }

    /// Share of all requests served by the busiest rank (1/8 is perfect on 8 ranks).
    pub fn busiest_rank_share(&self) -> f64 {
        let busiest = self.ranks.iter().map(|r| r.requests).max().unwrap_or(0);
        share(busiest, self.total_requests())
    }

    /// Share of all requests served by the busiest engine (all its ranks together).
    pub fn busiest_engine_share(&self) -> f64 {
        let mut per_engine: Vec<(&str, u64)> = Vec::new();
        for r in &self.ranks {
            match per_engine.iter_mut().find(|(e, _)| *e == r.engine) {
                Some((_, n)) => *n += r.requests,
                None => per_engine.push((&r.engine, r.requests)),
            }
        }
        let busiest = per_engine.iter().map(|(_, n)| *n).max().unwrap_or(0);
        share(busiest, self.total_requests())
    }

    /// `cached / prompt` tokens as the engines counted them (a cross-check of the client's
    /// figure from the usage chunks; the two differ only by failed requests).
    pub fn engine_hit_rate(&self) -> f64 {
        let prompt: u64 = self.ranks.iter().map(|r| r.prompt_tokens).sum();
        let cached: u64 = self.ranks.iter().map(|r| r.cached_tokens).sum();
        share(cached, prompt)
    }

    /// Per-rank difference `self - before` (engines and ranks matched by name), so counts from
    /// long-running engines cover exactly one run.
    fn since(&self, before: &Balance) -> Balance {
        let ranks = self
            .ranks
            .iter()
            .map(|r| {
                let b = before
                    .ranks
                    .iter()
                    .find(|b| b.engine == r.engine && b.dp_rank == r.dp_rank);
                let minus = |f: fn(&RankServed) -> u64| f(r).saturating_sub(b.map_or(0, f));
                RankServed {
                    engine: r.engine.clone(),
                    dp_rank: r.dp_rank,
                    requests: minus(|x| x.requests),
                    prompt_tokens: minus(|x| x.prompt_tokens),
                    cached_tokens: minus(|x| x.cached_tokens),
                }
            })
            .collect();
        Balance { ranks }
    }
}

/// The 90th percentile (nearest rank) of ascending `sorted`; 0 when empty.
fn p90_of_sorted(sorted: &[f64]) -> f64 {
    sorted
        .get(((sorted.len() as f64 * 0.9).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(0.0)
}

/// Mean, median and 90th percentile (nearest rank) of some requests' TTFTs; zeros when there
/// are none.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TtftFigures {
    mean_ms: f64,
    p50_ms: f64,
    p90_ms: f64,
}

impl TtftFigures {
    /// The figures of `ttft_ms`, in any order.
    fn of(mut ttft_ms: Vec<f64>) -> TtftFigures {
        ttft_ms.sort_by(f64::total_cmp);
        let mean_ms = if ttft_ms.is_empty() {
            0.0
        } else {
            ttft_ms.iter().sum::<f64>() / ttft_ms.len() as f64
        };
        TtftFigures {
            mean_ms,
            p50_ms: ttft_ms.get(ttft_ms.len() / 2).copied().unwrap_or(0.0),
            p90_ms: p90_of_sorted(&ttft_ms),
        }
    }
}

/// The 90th percentile (nearest rank) of `values` in any order; 0 when empty.
fn p90(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    p90_of_sorted(&values)
}

fn share(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        part as f64 / total as f64
    }
}

/// One run of the workload through one router: what the client measured, and the balance.
#[derive(Debug)]
pub struct RunResult {
    /// Row label: the policy, `oracle`, or `--label` for an external router.
    pub label: String,
    pub requests: usize,
    pub failures: usize,
    pub hit_rate: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub throughput_rps: f64,
    pub wall: Duration,
    /// Where later turns went (`None` when the router names no decisions).
    pub continuations: Option<ContinuationTrace>,
    /// The slowest tenth of the requests by TTFT: how many were first turns, and the decision
    /// reasons the router named for them (empty when it names none).
    pub slowest_decile: SlowestDecile,
    /// `None` when no engine counters were available (external mode without `--engine-urls`).
    pub balance: Option<Balance>,
    /// How the router's predictions compared with the engines' reports (in-process
    /// `cache_aware` rows; `None` where the router made none).
    pub predictions: Option<PredictionCounts>,
}

/// Finished requests by how the index's predicted cached tokens compared with the engine's
/// report (`kvroute_predictions_total`): within a block, a block or more over, under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PredictionCounts {
    pub exact: u64,
    pub over: u64,
    pub under: u64,
}

impl PredictionCounts {
    pub fn total(&self) -> u64 {
        self.exact + self.over + self.under
    }

    /// Reads a router's `kvroute_predictions_total` over every model and worker.
    fn of(router: &kvroute::Router) -> Option<PredictionCounts> {
        use prometheus::core::Collector;
        let mut c = PredictionCounts::default();
        for family in router.metrics.predictions.collect() {
            for m in family.get_metric() {
                let n = m.get_counter().get_value() as u64;
                match m
                    .get_label()
                    .iter()
                    .find(|l| l.name() == "result")
                    .map(|l| l.value())
                {
                    Some("exact") => c.exact += n,
                    Some("over") => c.over += n,
                    Some("under") => c.under += n,
                    _ => {}
                }
            }
        }
        (c.total() > 0).then_some(c)
    }
}

/// An in-process row: which kvroute policy produced the [`RunResult`] it dereferences to (the
/// measurement fields are shared with external rows, so both are computed by the same code).
#[derive(Debug)]
pub struct PolicyResult {
    pub policy: PolicyKind,
    /// `cache_aware` driven by [`SimCacheOracle`] instead of the index.
    pub oracle: bool,
    pub run: RunResult,
}

impl Deref for PolicyResult {
    type Target = RunResult;
    fn deref(&self) -> &RunResult {
        &self.run
    }
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
    let mut sample = Sample {
        decision: resp
            .headers()
            .get(kvroute::data_plane::forward::DECISION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        ..Sample::default()
    };
    let mut stream = resp.bytes_stream();
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

fn sim_config(prefill: FleetPrefill, capacity_blocks: usize) -> kvroute_sim::SimConfig {
    kvroute_sim::SimConfig {
        engines: ENGINES,
        dp_size: DP_SIZE,
        port: 0,
        kv_port_base: 0,
        replay_port_base: 0,
        load_port_base: 0,
        load_publish: true,
        block_size: BLOCK_SIZE_TOKENS,
        capacity_blocks,
        overhead_us: 2_000,
        prefill_us_per_token: 60,
        decode_us_per_token: 1_000,
        prefill_serial: prefill == FleetPrefill::Serial,
        served_model_name: MODEL.into(),
        ..kvroute_sim::SimConfig::default()
    }
}

async fn wait_subscribed(router: &kvroute::Router, ranks: usize) -> Result<(), String> {
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
    pub fn name(&self) -> &str {
        &self.run.label
    }
}

/// The client side of one run: samples of the successful turns, failures, wall time.
struct Driven {
    samples: Vec<Sample>,
    failures: usize,
    wall: Duration,
}

/// Drives the whole workload through the routers at `router_bases` (`http://host:port`) at the
/// configured concurrency: one task per conversation, its turns in order, each turn resending
/// the history with the previous reply appended. With several routers, each request goes to the
/// next one in turn (a client-side round robin, as a Service spreads connections), so one
/// conversation's turns meet different replicas.
async fn drive(
    router_bases: &[String],
    args: &DemoArgs,
    conversations: &Arc<Vec<Conversation>>,
    bar: &ProgressBar,
) -> Result<Driven, String> {
    if router_bases.is_empty() {
        return Err("no router to drive".into());
    }
    let urls: Arc<Vec<String>> = Arc::new(
        router_bases
            .iter()
            .map(|b| format!("{}/v1/chat/completions", b.trim_end_matches('/')))
            .collect(),
    );
    let next_router = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency_limit() * 2)
        .build()
        .map_err(|e| e.to_string())?;
    let permits = Arc::new(tokio::sync::Semaphore::new(args.concurrency_limit()));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..conversations.len() {
        let (convs, http, urls, next_router, permits, bar) = (
            conversations.clone(),
            http.clone(),
            urls.clone(),
            next_router.clone(),
            permits.clone(),
            bar.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let conv = &convs[i];
            tokio::time::sleep(conv.start_after).await;
            let _permit = permits.acquire_owned().await.map_err(|e| e.to_string())?;
            let mut messages = vec![json!({"role": "system", "content": conv.system.as_str()})];
            let mut samples = Vec::new();
            let mut failures = 0usize;
            let mut previous_rank: Option<String> = None;
            for (turn_index, turn) in conv.user_turns.iter().enumerate() {
                let think = conv.think_before.get(turn_index).copied();
                if let Some(think) = think.filter(|t| !t.is_zero()) {
                    tokio::time::sleep(think).await;
                }
                messages.push(json!({"role": "user", "content": turn}));
                let url = &urls
                    [next_router.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % urls.len()];
                let sent_at = started.elapsed();
                match chat_turn(&http, url, &messages).await {
                    Ok((mut s, reply)) => {
                        s.turn = turn_index;
                        s.conversation = i;
                        s.sent_at = sent_at;
                        let rank = s
                            .decision
                            .as_deref()
                            .and_then(decision_rank_and_reason)
                            .map(|(rank, _)| rank);
                        s.moved = match (&previous_rank, &rank) {
                            (Some(before), Some(now)) => Some(before != now),
                            _ => None,
                        };
                        previous_rank = rank;
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
    Ok(Driven {
        samples,
        failures,
        wall: started.elapsed(),
    })
}

/// The row's figures from the client's samples (hit rate from the usage chunks, TTFT from the
/// first chunk) and the engines' balance.
fn summarize(
    label: String,
    driven: Driven,
    balance: Option<Balance>,
    predictions: Option<PredictionCounts>,
) -> RunResult {
    let samples = &driven.samples;
    let prompt: u64 = samples.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = samples.iter().map(|s| s.cached_tokens).sum();
    let ttft = TtftFigures::of(samples.iter().map(|s| s.ttft_ms()).collect());
    RunResult {
        label,
        requests: samples.len(),
        failures: driven.failures,
        hit_rate: share(cached, prompt),
        ttft_mean_ms: ttft.mean_ms,
        ttft_p50_ms: ttft.p50_ms,
        ttft_p90_ms: ttft.p90_ms,
        throughput_rps: samples.len() as f64 / driven.wall.as_secs_f64(),
        wall: driven.wall,
        continuations: ContinuationTrace::of(samples),
        slowest_decile: SlowestDecile::of(samples),
        balance,
        predictions,
    }
}

/// Per-rank served counts of the in-process engines (fresh per run, so no baseline needed).
fn fleet_balance(fleet: &kvroute_sim::Fleet) -> Balance {
    let mut ranks = Vec::new();
    for e in &fleet.engines {
        for r in 0..e.dp_size() {
            let s = e.engine().served_stat(r);
            ranks.push(RankServed {
                engine: e.http_url(),
                dp_rank: r as u32,
                requests: s.requests,
                prompt_tokens: s.prompt_tokens,
                cached_tokens: s.cached_tokens,
            });
        }
    }
    Balance { ranks }
}

#[derive(serde::Deserialize)]
struct ServedStatsBody {
    ranks: Vec<ServedStatsRank>,
}

#[derive(serde::Deserialize)]
struct ServedStatsRank {
    dp_rank: u32,
    requests: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Reads every engine's `/served_stats` (kvroute-sim's per-rank counters).
async fn read_served_stats(http: &reqwest::Client, engines: &[String]) -> Result<Balance, String> {
    let mut ranks = Vec::new();
    for base in engines {
        let base = base.trim_end_matches('/');
        let resp = http
            .get(format!("{base}/served_stats"))
            .timeout(Duration::from_millis(SERVED_STATS_TIMEOUT_MS))
            .send()
            .await
            .map_err(|e| format!("{base}/served_stats: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{base}/served_stats: HTTP {}", resp.status()));
        }
        let body = resp
            .bytes()
            .await
            .map_err(|e| format!("{base}/served_stats: {e}"))?;
        if body.len() > SERVED_STATS_MAX_BYTES {
            return Err(format!(
                "{base}/served_stats: body over {SERVED_STATS_MAX_BYTES} bytes"
            ));
        }
        let parsed: ServedStatsBody = serde_json::from_slice(&body)
            .map_err(|e| format!("{base}/served_stats: unexpected body: {e}"))?;
        ranks.extend(parsed.ranks.into_iter().map(|r| RankServed {
            engine: base.to_string(),
            dp_rank: r.dp_rank,
            requests: r.requests,
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
        }));
    }
    Ok(Balance { ranks })
}

/// Drives the demo workload once through the external router at `router_url` (nothing is
/// started in-process). With `engine_urls`, the engines' counters are read before and after,
/// so the balance covers exactly this run.
pub async fn run_external(
    router_url: &str,
    engine_urls: &[String],
    label: &str,
    args: &DemoArgs,
) -> Result<RunResult, String> {
    let conversations = Arc::new(workload(args));
    let total = conversations
        .iter()
        .map(|c| c.user_turns.len())
        .sum::<usize>();
    let bar = progress_bar(total)?;
    bar.set_message(label.to_string());
    let http = reqwest::Client::new();
    let before = if engine_urls.is_empty() {
        None
    } else {
        Some(read_served_stats(&http, engine_urls).await?)
    };
    let driven = drive(&[router_url.to_string()], args, &conversations, &bar).await?;
    bar.finish_and_clear();
    let balance = match before {
        None => None,
        Some(before) => Some(read_served_stats(&http, engine_urls).await?.since(&before)),
    };
    Ok(summarize(label.to_string(), driven, balance, None))
}

fn progress_bar(len: usize) -> Result<ProgressBar, String> {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests {msg}",
        )
        .map_err(|e| e.to_string())?,
    );
    Ok(bar)
}

/// The router the in-process rows run: the demo fleet's engines, the policy, and the cost
/// model's prefill weight matched to the simulated prefill cost (60 us per token).
fn router_config(
    fleet: &kvroute_sim::Fleet,
    policy: PolicyKind,
    oracle: bool,
    seed: u64,
    eviction_cost_fraction: f64,
) -> RouterConfig {
    RouterConfig {
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
            .then(|| Arc::new(SimCacheOracle::new(MODEL, fleet)) as Arc<dyn PrefixOracle>),
        tokenizer_path: Some(kvroute_sim::config::default_tokenizer_path()),
        rng_seed: Some(seed),
        // The demo reads each answer's decision to trace where later turns went.
        decision_header: true,
        weights: CostWeights {
            prefill_cost_us_per_token: 60.0,
            eviction_cost_fraction,
            ..Default::default()
        },
        ..RouterConfig::default()
    }
}

async fn run_policy(
    policy: PolicyKind,
    oracle: bool,
    args: &DemoArgs,
    conversations: &Arc<Vec<Conversation>>,
    bar: &ProgressBar,
) -> Result<PolicyResult, String> {
    let fleet = kvroute_sim::start_fleet(sim_config(args.fleet_prefill, args.capacity_blocks()))
        .await
        .map_err(|e| e.to_string())?;
    let config = router_config(
        &fleet,
        policy,
        oracle,
        args.seed,
        args.eviction_cost_fraction,
    );
    let router = kvroute::serve(config).await.map_err(|e| e.to_string())?;
    wait_subscribed(&router.router, ENGINES * DP_SIZE).await?;
    let driven = drive(&[router.url()], args, conversations, bar).await;
    let predictions = PredictionCounts::of(&router.router);
    router.shutdown().await;
    let balance = fleet_balance(&fleet);
    fleet.shutdown().await;
    let label = if oracle { "oracle" } else { policy.as_str() };
    Ok(PolicyResult {
        policy,
        oracle,
        run: summarize(label.to_string(), driven?, Some(balance), predictions),
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
    let bar = progress_bar(per_policy * policies.len())?;
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

/// The workload's parameters and the in-process fleet's shape, as printed and put in JSON.
/// One line describing the workload, printed above both the in-process and the external table.
fn workload_summary(args: &DemoArgs) -> String {
    if args.workload == Workload::LongConversations {
        let l = &args.long;
        return format!(
            "long conversations: {} sessions (a {}-word shared system block, a ~{}-word first \
             turn each), up to {} follow-ups (popularity Zipf {}), arrivals every ~{} ms, think \
             {}-{} ms, {} device blocks per rank, seed {}",
            l.sessions,
            l.system_block_words,
            l.context_words,
            l.session_extra_turns_max,
            l.session_skew,
            l.session_arrival_ms,
            l.think_min_ms,
            l.think_max_ms,
            l.long_capacity_blocks,
            args.seed
        );
    }
    format!(
        "{} conversations over {} system prompts (popularity Zipf {}), {} turns each, \
         concurrency {}, seed {}",
        args.conversations,
        args.system_prompts,
        args.system_prompt_skew,
        args.turns,
        args.concurrency,
        args.seed
    )
}

fn workload_json(args: &DemoArgs) -> Value {
    let mut doc = match args.workload {
        Workload::Chat => json!({
            "conversations": args.conversations,
            "system_prompts": args.system_prompts,
            "turns": args.turns,
            "system_prompt_skew": args.system_prompt_skew,
            "concurrency": args.concurrency,
        }),
        Workload::LongConversations => {
            let l = &args.long;
            json!({
                "sessions": l.sessions,
                "system_block_words": l.system_block_words,
                "context_words": l.context_words,
                "session_extra_turns_max": l.session_extra_turns_max,
                "session_skew": l.session_skew,
                "session_arrival_ms": l.session_arrival_ms,
                "think_ms": [l.think_min_ms, l.think_max_ms],
            })
        }
    };
    let shared = json!({
        "workload": args.workload,
        "fleet_prefill": args.fleet_prefill,
        "seed": args.seed,
        "max_tokens": REPLY_TOKENS_MAX,
        "model": MODEL,
        "in_process_fleet": {
            "engines": ENGINES,
            "dp_size": DP_SIZE,
            "block_size": BLOCK_SIZE_TOKENS,
            "capacity_blocks": args.capacity_blocks(),
        },
    });
    if let (Some(fields), Value::Object(common)) = (doc.as_object_mut(), shared) {
        fields.extend(common);
    }
    doc
}

/// One row as JSON (`--json`): the table's figures plus the per-rank balance.
pub fn run_json(r: &RunResult) -> Value {
    let balance = r.balance.as_ref().map(|b| {
        json!({
            "busiest_rank_share": b.busiest_rank_share(),
            "busiest_engine_share": b.busiest_engine_share(),
            "engine_hit_rate": b.engine_hit_rate(),
            "ranks": b.ranks.iter().map(|x| json!({
                "engine": x.engine,
                "dp_rank": x.dp_rank,
                "requests": x.requests,
                "prompt_tokens": x.prompt_tokens,
                "cached_tokens": x.cached_tokens,
            })).collect::<Vec<_>>(),
        })
    });
    json!({
        "name": r.label,
        "requests": r.requests,
        "failures": r.failures,
        "hit_rate": r.hit_rate,
        "ttft_mean_ms": r.ttft_mean_ms,
        "ttft_p50_ms": r.ttft_p50_ms,
        "ttft_p90_ms": r.ttft_p90_ms,
        "throughput_rps": r.throughput_rps,
        "wall_s": r.wall.as_secs_f64(),
        "balance": balance,
        "continuations": r.continuations.as_ref().map(|c| json!({
            "routed": c.routed, "moved": c.moved, "moved_by_reason": c.moved_by_reason,
        })),
        "slowest_decile": {
            "requests": r.slowest_decile.requests,
            "first_turns": r.slowest_decile.first_turns,
            "by_reason": r.slowest_decile.by_reason,
        },
        "predictions": r.predictions.map(|p| json!({
            "exact": p.exact, "over": p.over, "under": p.under,
        })),
    })
}

/// Runs the demo and prints one line per policy (or, with `--json`, one JSON document). With
/// `--router-url`, drives that router once instead of the in-process fleet.
pub async fn run(args: DemoArgs) -> Result<(), String> {
    if args.rolling.rolling_update {
        if args.router_url.is_some() || !args.policies.is_empty() {
            return Err("--rolling-update runs its own fleet of cache_aware replicas; it takes neither --router-url nor --policies".into());
        }
        return rolling::run_and_report(&args).await;
    }
    if args.sweep.replica_sweep {
        if args.router_url.is_some() || !args.policies.is_empty() {
            return Err("--replica-sweep runs its own fleet of cache_aware replicas; it takes neither --router-url nor --policies".into());
        }
        return replicas::run_and_report(&args).await;
    }
    if let Some(router_url) = args.router_url.clone() {
        return run_external_and_print(&router_url, &args).await;
    }
    if !args.engine_urls.is_empty() {
        return Err(
            "--engine-urls needs --router-url (the in-process fleet is counted directly)".into(),
        );
    }
    if args.json {
        let total_started = Instant::now();
        let results = run_policies(&args).await?;
        let doc = json!({
            "mode": "in_process",
            "workload": workload_json(&args),
            "rows": results.iter().map(|r| run_json(r)).collect::<Vec<_>>(),
            "cache_aware_to_oracle_hit_rate": cache_aware_to_oracle_hit_rate(&results),
            "total_wall_s": total_started.elapsed().as_secs_f64(),
        });
        println!("{doc}");
        if results.iter().any(|r| r.failures > 0) {
            return Err("some demo requests failed (see warnings above)".into());
        }
        return Ok(());
    }
    println!(
        "kvroute demo: {} engines x {} DP ranks (block {} tokens, {} device blocks per rank, \
         {:?} prefill), {}",
        ENGINES,
        DP_SIZE,
        BLOCK_SIZE_TOKENS,
        args.capacity_blocks(),
        args.fleet_prefill,
        workload_summary(&args)
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
    for r in results.iter().filter(|r| !r.oracle) {
        if let Some(p) = r.predictions {
            let pct = |n: u64| n as f64 * 100.0 / p.total() as f64;
            println!(
                "{} predictions against the engines' reported cached tokens: {:.1}% within a block, {:.1}% over, {:.1}% under ({} answers)",
                r.name(),
                pct(p.exact),
                pct(p.over),
                pct(p.under),
                p.total()
            );
        }
    }
    for r in &results {
        print_continuations(r.name(), r.continuations.as_ref());
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

/// One line on where `row` sent conversations' later turns, when its decisions are known.
fn print_continuations(row: &str, trace: Option<&ContinuationTrace>) {
    let Some(t) = trace else { return };
    let reasons: Vec<String> = t
        .moved_by_reason
        .iter()
        .map(|(reason, n)| format!("{reason} {n}"))
        .collect();
    println!(
        "{row}: {} of {} later turns went to another rank than their previous turn ({})",
        t.moved,
        t.routed,
        if reasons.is_empty() {
            "none".to_string()
        } else {
            reasons.join(", ")
        }
    );
}

async fn run_external_and_print(router_url: &str, args: &DemoArgs) -> Result<(), String> {
    if !args.policies.is_empty() {
        return Err("--policies selects in-process kvroute policies; with --router-url the external router's own policy is measured".into());
    }
    let r = run_external(router_url, &args.engine_urls, &args.label, args).await?;
    if args.json {
        let doc = json!({
            "mode": "external",
            "router_url": router_url,
            "engine_urls": args.engine_urls,
            "workload": workload_json(args),
            "rows": [run_json(&r)],
        });
        println!("{doc}");
    } else {
        println!(
            "kvroute demo workload through {router_url}: {}",
            workload_summary(args)
        );
        println!(
            "{:<20} {:>9} {:>14} {:>13} {:>10} {:>9} {:>8} {:>13} {:>15}",
            "router",
            "hit_rate",
            "ttft_mean_ms",
            "ttft_p90_ms",
            "req/s",
            "requests",
            "failed",
            "busiest_rank",
            "busiest_engine"
        );
        let pct = |f: Option<f64>| f.map_or("-".to_string(), |v| format!("{:.1}%", v * 100.0));
        println!(
            "{:<20} {:>8.1}% {:>14.1} {:>13.1} {:>10.1} {:>9} {:>8} {:>13} {:>15}",
            r.label,
            r.hit_rate * 100.0,
            r.ttft_mean_ms,
            r.ttft_p90_ms,
            r.throughput_rps,
            r.requests,
            r.failures,
            pct(r.balance.as_ref().map(Balance::busiest_rank_share)),
            pct(r.balance.as_ref().map(Balance::busiest_engine_share)),
        );
        print_continuations(&r.label, r.continuations.as_ref());
    }
    if r.failures > 0 {
        return Err(format!(
            "{} of the workload's requests failed (see warnings above)",
            r.failures
        ));
    }
    Ok(())
}

/// A workload small enough for a test to run every policy in seconds (4 two-turn conversations
/// over 2 system prompts, concurrency 2); the in-process fleet, router and accounting are the
/// demo's own.
pub fn tiny_workload_args() -> DemoArgs {
    DemoArgs {
        workload: Workload::Chat,
        long: long_conversations::LongArgs::default(),
        conversations: 4,
        system_prompts: 2,
        turns: 2,
        system_prompt_skew: 0.0,
        fleet_prefill: FleetPrefill::Serial,
        eviction_cost_fraction: kvroute::routing::policy::DEFAULT_EVICTION_COST_FRACTION,
        concurrency: 2,
        seed: 3,
        policies: vec![],
        router_url: None,
        engine_urls: vec![],
        label: "external".into(),
        json: false,
        rolling: rolling::RollingArgs::default(),
        sweep: replicas::SweepArgs::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(engine: &str, dp_rank: u32, requests: u64) -> RankServed {
        RankServed {
            engine: engine.into(),
            dp_rank,
            requests,
            prompt_tokens: requests * 100,
            cached_tokens: requests * 50,
        }
    }

    #[test]
    fn balance_shares_name_the_busiest_rank_and_the_busiest_engine() {
        // Engine a: 30 + 10 = 40 of 100; engine b: 35 + 25 = 60; busiest rank b/0 with 35.
        let b = Balance {
            ranks: vec![
                rank("a", 0, 30),
                rank("a", 1, 10),
                rank("b", 0, 35),
                rank("b", 1, 25),
            ],
        };
        assert!((b.busiest_rank_share() - 0.35).abs() < 1e-9, "{b:?}");
        assert!((b.busiest_engine_share() - 0.60).abs() < 1e-9, "{b:?}");
        assert!((b.engine_hit_rate() - 0.5).abs() < 1e-9, "{b:?}");
        assert_eq!(Balance::default().busiest_rank_share(), 0.0);
    }

    /// Conversations opened per system prompt (ordered by the prompt's index) when 960
    /// conversations draw from 8 prompts with popularity skew `skew`.
    fn prompt_shares(skew: f64) -> Vec<usize> {
        let args = DemoArgs {
            conversations: 960,
            system_prompts: 8,
            system_prompt_skew: skew,
            ..tiny_args()
        };
        let convs = workload(&args);
        let mut prompts: Vec<Arc<String>> = Vec::new();
        let mut counts: Vec<usize> = Vec::new();
        for c in &convs {
            match prompts.iter().position(|p| Arc::ptr_eq(p, &c.system)) {
                Some(i) => counts[i] += 1,
                None => {
                    prompts.push(c.system.clone());
                    counts.push(1);
                }
            }
        }
        // Order by the prompt's own index ("You are assistant #i.").
        let mut indexed: Vec<(usize, usize)> = prompts
            .iter()
            .zip(&counts)
            .map(|(p, &n)| {
                let i: usize = p["You are assistant #".len()..]
                    .split('.')
                    .next()
                    .and_then(|d| d.parse().ok())
                    .expect("prompt starts with its index");
                (i, n)
            })
            .collect();
        indexed.sort();
        indexed.into_iter().map(|(_, n)| n).collect()
    }

    #[test]
    fn skewed_popularity_gives_the_first_prompt_the_largest_share() {
        let shares = prompt_shares(1.2);
        let first = shares[0] as f64 / 960.0;
        // Zipf 1.2 over 8 prompts: the first weighs 1 / sum(1/k^1.2) = 0.43.
        assert!(
            (0.36..=0.50).contains(&first),
            "first prompt opened {first:.2} of the conversations (expected ~0.43): {shares:?}"
        );
        assert!(
            shares.windows(2).filter(|w| w[0] < w[1]).count() <= 2,
            "shares fall (up to sampling noise) with the prompt's rank: {shares:?}"
        );
    }

    #[test]
    fn zero_skew_draws_prompts_uniformly() {
        let shares = prompt_shares(0.0);
        assert_eq!(shares.len(), 8, "every prompt used: {shares:?}");
        for n in &shares {
            assert!(
                (80..=160).contains(n),
                "uniform draw gives each of 8 prompts ~120 of 960: {shares:?}"
            );
        }
    }

    #[test]
    fn balance_since_counts_only_what_was_served_after_the_baseline() {
        let before = Balance {
            ranks: vec![rank("a", 0, 5), rank("a", 1, 0)],
        };
        let after = Balance {
            ranks: vec![rank("a", 0, 7), rank("a", 1, 4), rank("b", 0, 1)],
        };
        let d = after.since(&before);
        let got: Vec<(String, u32, u64)> = d
            .ranks
            .iter()
            .map(|r| (r.engine.clone(), r.dp_rank, r.requests))
            .collect();
        assert_eq!(
            got,
            vec![("a".into(), 0, 2), ("a".into(), 1, 4), ("b".into(), 0, 1)]
        );
    }

    fn routed(ttft_ms: u64, turn: usize, rank: u32, reason: &str, moved: Option<bool>) -> Sample {
        Sample {
            ttft: Duration::from_millis(ttft_ms),
            decision: Some(format!(
                "policy=cache_aware;reason={reason};worker=1;url=http://e:1;dp_rank={rank};matched_blocks=3"
            )),
            turn,
            moved,
            ..Sample::default()
        }
    }

    #[test]
    fn the_decision_header_names_the_rank_and_the_reason() {
        let h =
            "policy=cache_aware;reason=load_bound;worker=2;url=http://e:7;dp_rank=1;cost_ms=3.0";
        assert_eq!(
            decision_rank_and_reason(h),
            Some(("http://e:7#1".to_string(), "load_bound".to_string()))
        );
        assert_eq!(decision_rank_and_reason("policy=round_robin"), None);
    }

    #[test]
    fn continuations_count_only_later_turns_whose_ranks_are_known_and_name_why_they_moved() {
        let samples = vec![
            routed(10, 0, 0, "cold", None),
            routed(10, 1, 0, "cache_hit", Some(false)),
            routed(10, 2, 1, "load_over_cache", Some(true)),
            routed(10, 3, 2, "cache_hit", Some(true)),
        ];
        let t = ContinuationTrace::of(&samples).expect("three later turns are known");
        assert_eq!((t.routed, t.moved), (3, 2));
        assert_eq!(t.moved_by_reason.get("load_over_cache"), Some(&1));
        assert_eq!(t.moved_by_reason.get("cache_hit"), Some(&1));
        assert_eq!(ContinuationTrace::of(&samples[..1]), None, "no later turn");
    }

    #[test]
    fn the_slowest_decile_is_the_slowest_tenth_rounded_up_with_its_reasons() {
        let mut samples: Vec<Sample> = (0..19)
            .map(|i| routed(10 + i, 1, 0, "cache_hit", Some(false)))
            .collect();
        samples.push(routed(500, 0, 1, "load_bound", None));
        samples.push(routed(400, 0, 2, "cold", None));
        let d = SlowestDecile::of(&samples);
        assert_eq!(d.requests, 3, "a tenth of 21, rounded up");
        assert_eq!(d.first_turns, 2);
        assert_eq!(d.by_reason.get("load_bound"), Some(&1));
        assert_eq!(d.by_reason.get("cold"), Some(&1));
        assert_eq!(
            d.by_reason.get("cache_hit"),
            Some(&1),
            "the slowest later turn, 28 ms"
        );
    }

    fn tiny_args() -> DemoArgs {
        super::tiny_workload_args()
    }

    /// The external mode drives a router it did not start: here a real kvroute (cache_aware)
    /// on port 0 in front of a real in-process demo fleet, reached only through their URLs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn external_mode_drives_a_running_router_and_counts_balance_on_the_engines() {
        let fleet = kvroute_sim::start_fleet(sim_config(FleetPrefill::Serial, CAPACITY_BLOCKS))
            .await
            .expect("fleet starts");
        let router = kvroute::serve(router_config(
            &fleet,
            PolicyKind::CacheAware,
            false,
            3,
            kvroute::routing::policy::DEFAULT_EVICTION_COST_FRACTION,
        ))
        .await
        .expect("router starts");
        wait_subscribed(&router.router, ENGINES * DP_SIZE)
            .await
            .expect("router subscribed to every rank");
        let engines: Vec<String> = fleet.engines.iter().map(|e| e.http_url()).collect();
        // Traffic before the run must not count towards its balance.
        let warm = reqwest::Client::new()
            .post(format!("{}/v1/completions", engines[0]))
            .json(&json!({"prompt": [5, 6, 7, 8], "max_tokens": 1}))
            .send()
            .await
            .expect("warm-up request");
        assert!(warm.status().is_success());

        let args = tiny_args();
        let r = run_external(&router.url(), &engines, "kvroute under test", &args)
            .await
            .expect("external run");
        router.shutdown().await;
        fleet.shutdown().await;

        assert_eq!(r.label, "kvroute under test");
        assert_eq!(r.failures, 0, "{r:?}");
        assert_eq!(r.requests, 8, "4 conversations x 2 turns: {r:?}");
        assert!(
            r.ttft_mean_ms > 0.0 && r.ttft_p90_ms >= r.ttft_mean_ms * 0.5,
            "{r:?}"
        );
        // Second turns resend the first turn's prompt: the engines must report reuse.
        assert!(r.hit_rate > 0.3, "{r:?}");
        let b = r
            .balance
            .as_ref()
            .expect("engine URLs given, so balance is known");
        assert_eq!(b.ranks.len(), ENGINES * DP_SIZE, "{b:?}");
        assert_eq!(
            b.total_requests(),
            8,
            "engine counters cover exactly the run's requests, not the warm-up: {b:?}"
        );
        assert!(b.busiest_rank_share() > 0.0 && b.busiest_rank_share() <= 1.0);
        assert!(b.busiest_engine_share() >= b.busiest_rank_share());
        assert!(
            (b.engine_hit_rate() - r.hit_rate).abs() < 1e-9,
            "client and engines count the same tokens when nothing failed: {r:?}"
        );
    }

    #[tokio::test]
    async fn external_mode_reports_an_unreachable_engine_instead_of_guessing_balance() {
        let args = tiny_args();
        // Port 9 (discard) on loopback: nothing listens there in the test environment.
        let err = run_external(
            "http://127.0.0.1:9",
            &["http://127.0.0.1:9".to_string()],
            "x",
            &args,
        )
        .await
        .expect_err("no engine to read");
        assert!(err.contains("/served_stats"), "{err}");
    }
}
