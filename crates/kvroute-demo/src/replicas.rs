//! `kvroute-demo --replica-sweep`: the demo workload through 1, 2 and 4 cache_aware replicas
//! behind a client-side round robin, with load sharing between them off and on.
//!
//! What it answers: does a fleet of router replicas route as well as one router? Each replica
//! sees every engine's KV events, so all of them know the same prefixes, but without sharing each
//! knows only the load IT sent; with `--load-share` each adds its siblings' bookings. Every run is
//! a fresh in-process fleet (the demo's 8 ranks) and fresh replicas that list each other as
//! siblings, started before any request; requests go to the replicas in turn, so one
//! conversation's turns meet different replicas, as behind a Service.
//!
//! Per row, the median over `--replica-rounds` runs of: the engines' hit rate (cached over
//! prompt tokens, from the usage chunks), the client's p90 time to first token, and the busiest
//! rank's share of requests (engine-side counts); and the TTFT mean and p90 pooled over every
//! request of every round ([`Pooled`]: the steadier comparison where a round's p90 sits on a
//! cliff). Rounds differ by the routers' random seeds and by timing; the workload is the demo's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{Value, json};

use kvroute::PolicyKind;
use kvroute::peer::load_share::LoadShareConfig;

use crate::core_wait::{self, Spent, ThreadGroup};

use super::{
    DP_SIZE, DemoArgs, ENGINES, RunResult, drive, fleet_balance, progress_bar, router_config,
    sim_config, summarize, wait_subscribed, workload,
};

/// Most replicas one sweep row may run.
pub const SWEEP_REPLICAS_MAX: usize = 16;
/// Most rounds per row.
pub const SWEEP_ROUNDS_MAX: usize = 50;
/// Longest wait for every replica to hear every sibling before the traffic starts.
const SIBLINGS_HEARD_DEADLINE_MS: u64 = 10_000;

#[derive(Debug, Args, Clone)]
pub struct SweepArgs {
    /// Run the demo workload through several cache_aware replicas behind a client-side round
    /// robin, with load sharing off and on, and print hit rate, p90 TTFT and the busiest
    /// rank's share per replica count.
    #[arg(long)]
    pub replica_sweep: bool,
    /// Replica counts of the sweep (1 runs once: there is nothing to share).
    #[arg(long, value_delimiter = ',', default_values_t = [1u16, 2, 4],
          value_parser = clap::value_parser!(u16).range(1..=SWEEP_REPLICAS_MAX as i64))]
    pub replica_counts: Vec<u16>,
    /// Runs per row; the row shows their median.
    #[arg(long, default_value_t = 5,
          value_parser = clap::value_parser!(u16).range(1..=SWEEP_ROUNDS_MAX as i64))]
    pub replica_rounds: u16,
    /// The replicas' `--load-share-interval-ms` in the sharing rows.
    #[arg(long, default_value_t = kvroute::peer::load_share::DEFAULT_LOAD_SHARE_INTERVAL_MS,
          value_parser = clap::value_parser!(u64).range(1..=kvroute::peer::load_share::LOAD_SHARE_INTERVAL_MS_MAX))]
    pub replica_load_share_interval_ms: u64,
    /// The replicas' `--cold-owner` in the sharing rows (the rows without sharing run with it
    /// off).
    #[arg(long, value_enum, default_value_t = kvroute::config::ColdOwnerScope::Fleet)]
    pub replica_cold_owner: kvroute::config::ColdOwnerScope,
    /// The replicas' `--cold-owner-timeout-ms`.
    #[arg(long, default_value_t = kvroute::config::DEFAULT_COLD_OWNER_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..=kvroute::config::COLD_OWNER_TIMEOUT_MS_MAX))]
    pub replica_cold_owner_timeout_ms: u64,
    /// Also run each replica count (above 1) with every request sent through the first replica:
    /// the CPU cost of N replicas subscribed and indexing, one router's placement. A control
    /// that separates what the extra replicas cost the machine from what they cost routing.
    #[arg(long)]
    pub replica_through_one: bool,
    /// Also write every request of every round to this file, one JSON object per line: the
    /// row, the round, the conversation and its system prompt, the turn, when it was sent, its
    /// TTFT, its prompt and cached tokens (the engine's report) and the router's decision
    /// header (rank, reason, matched blocks, predicted cost). The raw data behind the medians,
    /// for finding where a row's tail comes from (`bench/replica_trace.py` reads it).
    #[arg(long, value_name = "PATH")]
    pub replica_trace_out: Option<std::path::PathBuf>,
    /// Every replica's `--data-plane-threads`, in every row (0 = one per CPU, the router's
    /// default, which assumes the router has the machine to itself; here all the replicas share
    /// it with the simulated fleet and the client).
    #[arg(long, default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=kvroute::data_plane::DATA_PLANE_THREADS_MAX as u64))]
    pub replica_data_plane_threads: u64,
    /// Slow motion: every duration of the simulated engines (overhead, prefill and decode per
    /// token, load reports) and of the routers' clocks (cost model, pending prefixes, load
    /// frames and their staleness, the owner's timeout) times this factor K, in every row. The
    /// routers' and the client's CPU work per request stays what it is, so on this machine it
    /// weighs 1/K as much against the engines' times: a control for what the replicas' share
    /// of two cores costs routing, against what placement by several routers costs it.
    #[arg(long, default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..=SWEEP_TIME_SCALE_MAX))]
    pub replica_time_scale: u64,
}

impl Default for SweepArgs {
    fn default() -> Self {
        SweepArgs {
            replica_sweep: false,
            replica_counts: vec![1, 2, 4],
            replica_rounds: 5,
            replica_load_share_interval_ms:
                kvroute::peer::load_share::DEFAULT_LOAD_SHARE_INTERVAL_MS,
            replica_cold_owner: kvroute::config::ColdOwnerScope::Fleet,
            replica_cold_owner_timeout_ms: kvroute::config::DEFAULT_COLD_OWNER_TIMEOUT_MS,
            replica_through_one: false,
            replica_trace_out: None,
            replica_data_plane_threads: 0,
            replica_time_scale: 1,
        }
    }
}

/// Largest `--replica-time-scale`: 16 x the demo's engine times keeps a sweep of 20 rounds under
/// an hour here.
pub const SWEEP_TIME_SCALE_MAX: u64 = 16;

/// Slows one row's simulated engines down by `scale` (`--replica-time-scale`); its routers get
/// the same factor from [`slow_down_router`].
fn slow_down_engines(scale: u64, sim: &mut kvroute_sim::SimConfig) {
    // `speed` divides every simulated duration: overhead, prefill, host-tier loads, decode.
    sim.speed /= scale as f64;
    sim.load_interval_ms *= scale;
}

/// Slows one router's clocks down by `scale`, with its engines ([`slow_down_engines`]).
///
/// Every time constant the routing depends on is scaled, or the slowed run would compare a
/// different policy: the cost model's per-token and per-request prices (its costs are in
/// engine time), how long a pending prefix counts, how often bookings are shared and when a
/// silent sibling's are dropped, how long an asker waits for the owner. Limits the routers
/// enforce still hold: a scaled value past one is an error naming the flag, not a clamp that
/// would silently change the policy.
fn slow_down_router(scale: u64, router: &mut kvroute::RouterConfig) -> Result<(), String> {
    use kvroute::config::{COLD_OWNER_TIMEOUT_MS_MAX, LOAD_SHARE_INTERVAL_MS_MAX};
    let weights = &mut router.weights;
    weights.prefill_cost_us_per_token *= scale as f64;
    weights.decode_penalty_us_per_request *= scale as f64;
    weights.temperature_ms *= scale as f64;
    router.pending_prefix_ttl_ms *= scale;
    router.engine_metrics_interval_ms *= scale;
    let share = &mut router.load_share;
    share.stale_ms *= scale;
    for (flag, value, max) in [
        (
            "--replica-load-share-interval-ms",
            &mut share.interval_ms,
            LOAD_SHARE_INTERVAL_MS_MAX,
        ),
        (
            "--replica-cold-owner-timeout-ms",
            &mut share.cold_owner_timeout_ms,
            COLD_OWNER_TIMEOUT_MS_MAX,
        ),
    ] {
        let scaled = *value * scale;
        if scaled > max {
            return Err(format!(
                "--replica-time-scale {scale} takes {flag} {value} to {scaled} ms, over the \
                 routers' limit of {max} ms"
            ));
        }
        *value = scaled;
    }
    Ok(())
}

/// One row: a replica count, sharing on or off, whether every request goes through the first
/// replica (the control), and every round's figures.
#[derive(Debug)]
pub struct SweepRow {
    pub replicas: usize,
    pub sharing: bool,
    pub through_one: bool,
    pub rounds: Vec<SweepRun>,
}

/// One run of a row: the demo's figures, and the p90 TTFT of first turns and of later turns
/// apart (the first turns include the workload's opening burst, every conversation of the
/// first wave starting at once, which several replicas must place at the same instant).
#[derive(Debug)]
pub struct SweepRun {
    pub run: RunResult,
    pub first_turns_ttft_p90_ms: f64,
    pub later_turns_ttft_p90_ms: f64,
    /// Every request's TTFT, for the figures pooled over the rounds ([`Pooled`]).
    pub ttfts_ms: Vec<f64>,
    /// Cold prompts the replicas placed through their owner, summed over the replicas, by
    /// outcome ([`COLD_OUTCOMES`]).
    pub cold_placements: [u64; COLD_OUTCOMES.len()],
    /// Seconds the replicas waited for owners' answers, summed (with `cold_placements`' total,
    /// the mean wait).
    pub cold_wait_s: f64,
    /// What the process's threads spent on a core and waiting for one while the round's
    /// requests ran, by group (`None` without procfs).
    pub thread_times: Option<HashMap<ThreadGroup, Spent>>,
    /// What the replicas' tokenizers did for the round's requests, summed over the replicas.
    pub tokenizing: Tokenizing,
}

/// The replicas' tokenization of one round, from their metrics: the time spent tokenizing on
/// the requests' paths (`kvroute_tokenize_seconds`), chat segments by outcome
/// (`kvroute_tokenizer_cache_total`: [`SEGMENT_OUTCOMES`]) and the conversation prefixes
/// adopted from siblings (`kvroute_shared_prefixes_total{result="adopted"}`). Why the sweep
/// prints it: a long conversation's body is prepared on the blocking pool, so the data planes'
/// thread times do not show what its turn costs a replica that did not tokenize its history.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tokenizing {
    pub on_path_s: f64,
    pub segments: [u64; SEGMENT_OUTCOMES.len()],
    pub prefixes_adopted: u64,
}

/// The outcomes of `kvroute_tokenizer_cache_total` the sweep reports, in its print order.
pub const SEGMENT_OUTCOMES: [&str; 4] = ["hit", "miss", "head", "whole"];

impl Tokenizing {
    fn of(m: &kvroute::control::metrics::Metrics) -> Tokenizing {
        Tokenizing {
            on_path_s: ["chat", "prompt"]
                .iter()
                .map(|kind| {
                    m.tokenize_latency
                        .with_label_values(&[kind])
                        .get_sample_sum()
                })
                .sum(),
            segments: SEGMENT_OUTCOMES
                .map(|outcome| m.tokenizer_cache.with_label_values(&[outcome]).get()),
            prefixes_adopted: m.shared_prefixes.with_label_values(&["adopted"]).get(),
        }
    }

    fn plus(self, other: Tokenizing) -> Tokenizing {
        Tokenizing {
            on_path_s: self.on_path_s + other.on_path_s,
            segments: std::array::from_fn(|i| self.segments[i] + other.segments[i]),
            prefixes_adopted: self.prefixes_adopted + other.prefixes_adopted,
        }
    }
}

/// The outcomes of `kvroute_cold_placements_total` the sweep reports, in its column order.
pub const COLD_OUTCOMES: [&str; 3] = ["owner_chose", "owner_failed", "owner_rank_unknown"];

fn p90_ms<'a>(samples: impl Iterator<Item = &'a super::Sample>) -> f64 {
    super::p90(samples.map(super::Sample::ttft_ms).collect())
}

/// A row's TTFT over every request of every round. Why beside the medians of the rounds: on
/// the demo workload about a tenth of a round's requests wait behind a system prompt's first
/// prefill, so a round's p90 falls on either side of that cliff by a request or two, and the
/// median of twenty such p90s says which side the middle rounds fell on. The pooled mean moves
/// with every request and is the steadier comparison between rows (docs/BENCHMARKS.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pooled {
    pub requests: usize,
    pub ttft_mean_ms: f64,
    pub ttft_p90_ms: f64,
}

fn pooled<'a>(rounds: impl Iterator<Item = &'a [f64]>) -> Pooled {
    let all: Vec<f64> = rounds.flatten().copied().collect();
    let requests = all.len();
    let ttft = super::TtftFigures::of(all);
    Pooled {
        requests,
        ttft_mean_ms: ttft.mean_ms,
        ttft_p90_ms: ttft.p90_ms,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

impl SweepRow {
    pub fn label(&self) -> String {
        match (self.replicas, self.sharing) {
            (1, _) => "1 replica".to_string(),
            (n, _) if self.through_one => format!("{n} replicas, all via one"),
            (n, true) => format!("{n} replicas, sharing"),
            (n, false) => format!("{n} replicas, no sharing"),
        }
    }
    pub fn hit_rate(&self) -> f64 {
        median(self.rounds.iter().map(|r| r.run.hit_rate).collect())
    }
    pub fn pooled(&self) -> Pooled {
        pooled(self.rounds.iter().map(|r| r.ttfts_ms.as_slice()))
    }
    pub fn ttft_p90_ms(&self) -> f64 {
        median(self.rounds.iter().map(|r| r.run.ttft_p90_ms).collect())
    }
    pub fn first_turns_ttft_p90_ms(&self) -> f64 {
        median(
            self.rounds
                .iter()
                .map(|r| r.first_turns_ttft_p90_ms)
                .collect(),
        )
    }
    pub fn later_turns_ttft_p90_ms(&self) -> f64 {
        median(
            self.rounds
                .iter()
                .map(|r| r.later_turns_ttft_p90_ms)
                .collect(),
        )
    }
    pub fn busiest_rank_share(&self) -> f64 {
        median(
            self.rounds
                .iter()
                .filter_map(|r| r.run.balance.as_ref().map(|b| b.busiest_rank_share()))
                .collect(),
        )
    }
    /// Mean wait for an owner's answer over every asked placement of every round.
    fn cold_wait_mean_ms(&self) -> f64 {
        let asked: u64 = self
            .rounds
            .iter()
            .map(|r| r.cold_placements.iter().sum::<u64>())
            .sum();
        let waited: f64 = self.rounds.iter().map(|r| r.cold_wait_s).sum();
        waited * 1000.0 / asked.max(1) as f64
    }
    /// Mean cold placements per round, by outcome ([`COLD_OUTCOMES`]).
    fn cold_placed(&self) -> [f64; COLD_OUTCOMES.len()] {
        let rounds = self.rounds.len().max(1) as f64;
        std::array::from_fn(|i| {
            self.rounds
                .iter()
                .map(|r| r.cold_placements[i] as f64)
                .sum::<f64>()
                / rounds
        })
    }
    /// Mean milliseconds per request that `group`'s threads spent on a core and waiting for
    /// one, over every round; `None` when no round could read its threads.
    fn thread_ms_per_request(&self, group: ThreadGroup) -> Option<(f64, f64)> {
        let read: Vec<&SweepRun> = self
            .rounds
            .iter()
            .filter(|r| r.thread_times.is_some())
            .collect();
        let requests: usize = read.iter().map(|r| r.run.requests).sum();
        if requests == 0 {
            return None;
        }
        let spent = read
            .iter()
            .filter_map(|r| r.thread_times.as_ref()?.get(&group).copied())
            .fold(Spent::default(), |sum, s| Spent {
                on_cpu_ns: sum.on_cpu_ns + s.on_cpu_ns,
                runqueue_wait_ns: sum.runqueue_wait_ns + s.runqueue_wait_ns,
            });
        let per_request_ms = |ns: u64| ns as f64 / 1e6 / requests as f64;
        Some((
            per_request_ms(spent.on_cpu_ns),
            per_request_ms(spent.runqueue_wait_ns),
        ))
    }
    /// Milliseconds tokenizing on the path per request, and per round the segments by outcome
    /// ([`SEGMENT_OUTCOMES`]) and the prefixes adopted from siblings, over every round.
    fn tokenizing_per_request_and_round(&self) -> (f64, [f64; SEGMENT_OUTCOMES.len()], f64) {
        let sum = self
            .rounds
            .iter()
            .map(|r| r.tokenizing)
            .fold(Tokenizing::default(), Tokenizing::plus);
        let requests = self
            .rounds
            .iter()
            .map(|r| r.run.requests)
            .sum::<usize>()
            .max(1) as f64;
        let rounds = self.rounds.len().max(1) as f64;
        (
            sum.on_path_s * 1000.0 / requests,
            sum.segments.map(|n| n as f64 / rounds),
            sum.prefixes_adopted as f64 / rounds,
        )
    }
    fn failures(&self) -> usize {
        self.rounds.iter().map(|r| r.run.failures).sum()
    }
}

/// Waits until every replica counts each of its siblings as heard (load sharing on).
async fn wait_siblings_heard(replicas: &[&kvroute::RouterHandle]) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_millis(SIBLINGS_HEARD_DEADLINE_MS);
    loop {
        let heard: Vec<usize> = replicas
            .iter()
            .map(|r| {
                let stale = r.router.config.load_share.stale_ms;
                r.router
                    .load_share
                    .siblings(stale)
                    .iter()
                    .filter(|s| s.fresh)
                    .count()
            })
            .collect();
        if heard.iter().all(|&n| n + 1 == replicas.len()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "replicas heard {heard:?} siblings, expected {} each",
                replicas.len() - 1
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One replica of a round, its control plane on a runtime of its own, as in its own process.
///
/// Why not the demo's runtime: a replica's control plane (pump, subscribers, sibling streams,
/// the internal listener that answers cold placements) shares its runtime with nothing but
/// itself in a deployment. On the demo's runtime, four replicas' control tasks queued behind
/// one another and behind the simulated engines and the client on the same two workers,
/// without preemption: a sibling's cold placement waited for unrelated replicas' tasks, and
/// the engines' clocks for the routers'. That is a cost of the in-process harness, not of
/// replicas (docs/BENCHMARKS.md, "Several replicas behind one Service"). The data planes
/// already run on threads of their own.
struct Replica {
    handle: kvroute::RouterHandle,
    runtime: ControlRuntime,
}

/// A replica's control runtime, stopped in the background when dropped: a round ended early by
/// an error drops it inside the demo's async context, where a runtime's blocking drop panics.
struct ControlRuntime(Option<tokio::runtime::Runtime>);

impl Drop for ControlRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl Replica {
    /// Worker threads per replica's control runtime: what `#[tokio::main]` gives the router's
    /// own binary on this machine (one per CPU).
    fn control_threads() -> usize {
        std::thread::available_parallelism().map_or(1, usize::from)
    }

    async fn start(index: usize, config: kvroute::RouterConfig) -> Result<Replica, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(Self::control_threads())
            .thread_name(format!("replica-{index}-control"))
            .enable_all()
            .build()
            .map_err(|e| format!("replica {index}: cannot start its control runtime: {e}"))?;
        // Spawned, not awaited here: `serve` takes the runtime it runs on as the router's
        // control runtime (`Router::control`).
        let handle = runtime
            .spawn(kvroute::serve(config))
            .await
            .map_err(|e| format!("replica {index}: start-up task failed: {e}"))?
            .map_err(|e| format!("replica {index}: {e}"))?;
        Ok(Replica {
            handle,
            runtime: ControlRuntime(Some(runtime)),
        })
    }

    /// Shuts the router down on its own runtime, then the runtime.
    async fn shutdown(self) {
        let Replica { handle, runtime } = self;
        if let Some(rt) = runtime.0.as_ref()
            && let Err(e) = rt.spawn(handle.shutdown()).await
        {
            eprintln!("a replica's shutdown task failed: {e}");
        }
    }
}

async fn run_once(
    args: &DemoArgs,
    conversations: &Arc<Vec<super::Conversation>>,
    replicas: usize,
    sharing: bool,
    through_one: bool,
    round: u64,
    bar: &indicatif::ProgressBar,
) -> Result<SweepRun, String> {
    let scale = args.sweep.replica_time_scale;
    let mut sim = sim_config(args.fleet_prefill, args.capacity_blocks());
    slow_down_engines(scale, &mut sim);
    let fleet = kvroute_sim::start_fleet(sim)
        .await
        .map_err(|e| e.to_string())?;
    let mut replicas_started = Vec::with_capacity(replicas);
    for i in 0..replicas {
        let seed = args.seed + 1_000 * round + i as u64;
        let mut config = kvroute::RouterConfig {
            load_share: LoadShareConfig {
                enabled: sharing,
                interval_ms: args.sweep.replica_load_share_interval_ms,
                cold_owner: if sharing {
                    args.sweep.replica_cold_owner
                } else {
                    kvroute::config::ColdOwnerScope::Off
                },
                cold_owner_timeout_ms: args.sweep.replica_cold_owner_timeout_ms,
                ..LoadShareConfig::default()
            },
            data_plane_threads: args.sweep.replica_data_plane_threads as usize,
            ..router_config(
                &fleet,
                PolicyKind::CacheAware,
                false,
                seed,
                args.eviction_cost_fraction,
            )
        };
        slow_down_router(scale, &mut config)?;
        replicas_started.push(Replica::start(i, config).await?);
    }
    let handles: Vec<&kvroute::RouterHandle> = replicas_started.iter().map(|r| &r.handle).collect();
    for (i, h) in handles.iter().enumerate() {
        let siblings = handles
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, s)| kvroute_discovery::PeerUrl::parse(&s.internal_url()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        h.router.peers.replace(siblings);
        wait_subscribed(&h.router, ENGINES * DP_SIZE).await?;
    }
    if sharing {
        wait_siblings_heard(&handles).await?;
    }
    let entries = if through_one { 1 } else { handles.len() };
    let urls: Vec<String> = handles[..entries].iter().map(|h| h.url()).collect();
    // Read around the traffic alone, with every replica and engine thread of the round alive
    // at both reads: their startup and shutdown are not the requests' cost.
    let threads_before = core_wait::snapshot();
    let driven = drive(&urls, args, conversations, bar).await;
    let thread_times = threads_before
        .zip(core_wait::snapshot())
        .map(|(before, after)| core_wait::spent_between(&before, &after));
    let cold_placements = COLD_OUTCOMES.map(|outcome| {
        handles
            .iter()
            .map(|h| {
                h.router
                    .metrics
                    .cold_placements
                    .with_label_values(&[outcome])
                    .get()
            })
            .sum::<u64>()
    });
    let cold_wait_s = handles
        .iter()
        .map(|h| h.router.metrics.cold_placement_wait.get_sample_sum())
        .sum::<f64>();
    let tokenizing = handles
        .iter()
        .map(|h| Tokenizing::of(&h.router.metrics))
        .fold(Tokenizing::default(), Tokenizing::plus);
    drop(handles);
    for replica in replicas_started {
        replica.shutdown().await;
    }
    let balance = fleet_balance(&fleet);
    fleet.shutdown().await;
    let label = match (through_one, sharing) {
        (true, _) => format!("{replicas}x via one"),
        (false, true) => format!("{replicas}x shared"),
        (false, false) => format!("{replicas}x unshared"),
    };
    let driven = driven?;
    if let Some(path) = &args.sweep.replica_trace_out {
        append_trace(path, &label, round, conversations, &driven.samples)?;
    }
    let first_turns_ttft_p90_ms = p90_ms(driven.samples.iter().filter(|s| s.turn == 0));
    let later_turns_ttft_p90_ms = p90_ms(driven.samples.iter().filter(|s| s.turn > 0));
    let ttfts_ms = driven.samples.iter().map(super::Sample::ttft_ms).collect();
    Ok(SweepRun {
        run: summarize(label, driven, Some(balance), None),
        first_turns_ttft_p90_ms,
        later_turns_ttft_p90_ms,
        ttfts_ms,
        cold_placements,
        cold_wait_s,
        thread_times,
        tokenizing,
    })
}

/// Appends one round's requests to the trace file, one JSON object per line. A conversation's
/// system prompt is named by its place among the workload's distinct system prompts (its
/// tenant), so rows and rounds compare.
fn append_trace(
    path: &std::path::Path,
    label: &str,
    round: u64,
    conversations: &[super::Conversation],
    samples: &[super::Sample],
) -> Result<(), String> {
    use std::io::Write;
    let mut tenants: Vec<&str> = Vec::new();
    let tenant_of: Vec<usize> = conversations
        .iter()
        .map(
            |c| match tenants.iter().position(|t| *t == c.system.as_str()) {
                Some(t) => t,
                None => {
                    tenants.push(c.system.as_str());
                    tenants.len() - 1
                }
            },
        )
        .collect();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("--replica-trace-out {}: {e}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for s in samples {
        let line = json!({
            "row": label,
            "round": round,
            "conversation": s.conversation,
            "tenant": tenant_of.get(s.conversation),
            "turn": s.turn,
            "sent_ms": s.sent_at.as_secs_f64() * 1000.0,
            "ttft_ms": s.ttft_ms(),
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "decision": s.decision,
        });
        writeln!(out, "{line}").map_err(|e| format!("--replica-trace-out: {e}"))?;
    }
    out.flush().map_err(|e| format!("--replica-trace-out: {e}"))
}

/// Runs every row of the sweep.
pub async fn run_sweep(args: &DemoArgs) -> Result<Vec<SweepRow>, String> {
    let sweep = &args.sweep;
    let mut shapes: Vec<(usize, bool, bool)> = Vec::new();
    for &n in &sweep.replica_counts {
        let n = n as usize;
        if n == 1 {
            shapes.push((1, false, false));
        } else {
            shapes.push((n, false, false));
            shapes.push((n, true, false));
            if sweep.replica_through_one {
                shapes.push((n, false, true));
            }
        }
    }
    if let Some(path) = &sweep.replica_trace_out {
        // One sweep per file: the rounds append to it.
        std::fs::File::create(path)
            .map_err(|e| format!("--replica-trace-out {}: {e}", path.display()))?;
    }
    let conversations = Arc::new(workload(args));
    let per_run = conversations
        .iter()
        .map(|c| c.user_turns.len())
        .sum::<usize>();
    let rounds = sweep.replica_rounds as u64;
    let bar = progress_bar(per_run * shapes.len() * rounds as usize)?;
    let mut rows: Vec<SweepRow> = shapes
        .iter()
        .map(|&(replicas, sharing, through_one)| SweepRow {
            replicas,
            sharing,
            through_one,
            rounds: Vec::new(),
        })
        .collect();
    // Rounds outermost, so a slow stretch of the machine touches every row alike.
    for round in 0..rounds {
        for row in rows.iter_mut() {
            bar.set_message(format!("round {} / {rounds}: {}", round + 1, row.label()));
            let run = run_once(
                args,
                &conversations,
                row.replicas,
                row.sharing,
                row.through_one,
                round,
                &bar,
            )
            .await?;
            row.rounds.push(run);
        }
    }
    bar.finish_and_clear();
    Ok(rows)
}

fn row_json(row: &SweepRow) -> Value {
    let (tokenize_ms, segments, adopted) = row.tokenizing_per_request_and_round();
    let pooled = row.pooled();
    let thread_ms: serde_json::Map<String, Value> = [
        (ThreadGroup::ReplicaDataPlanes, "replica_data_planes"),
        (ThreadGroup::Rest, "rest"),
    ]
    .into_iter()
    .filter_map(|(group, key)| {
        let (cpu, wait) = row.thread_ms_per_request(group)?;
        Some((
            key.to_string(),
            json!({"on_cpu": cpu, "waiting_for_cpu": wait}),
        ))
    })
    .collect();
    json!({
        "replicas": row.replicas,
        "load_sharing": row.sharing,
        "all_via_one_replica": row.through_one,
        "hit_rate_median": row.hit_rate(),
        "ttft_p90_ms_median": row.ttft_p90_ms(),
        "first_turns_ttft_p90_ms_median": row.first_turns_ttft_p90_ms(),
        "later_turns_ttft_p90_ms_median": row.later_turns_ttft_p90_ms(),
        "busiest_rank_share_median": row.busiest_rank_share(),
        "pooled": {
            "requests": pooled.requests,
            "ttft_mean_ms": pooled.ttft_mean_ms,
            "ttft_p90_ms": pooled.ttft_p90_ms,
        },
        "thread_ms_per_request": thread_ms,
        "tokenizing": {
            "on_path_ms_per_request": tokenize_ms,
            "segments_per_round": SEGMENT_OUTCOMES.iter().zip(segments)
                .map(|(o, n)| (o.to_string(), json!(n)))
                .collect::<serde_json::Map<_, _>>(),
            "prefixes_adopted_per_round": adopted,
        },
        "rounds": row.rounds.iter().map(|r| json!({
            "hit_rate": r.run.hit_rate,
            "ttft_p90_ms": r.run.ttft_p90_ms,
            "first_turns_ttft_p90_ms": r.first_turns_ttft_p90_ms,
            "later_turns_ttft_p90_ms": r.later_turns_ttft_p90_ms,
            "ttft_mean_ms": r.run.ttft_mean_ms,
            "busiest_rank_share": r.run.balance.as_ref().map(|b| b.busiest_rank_share()),
            "cold_placements": COLD_OUTCOMES.iter().zip(r.cold_placements)
                .map(|(o, n)| (o.to_string(), json!(n)))
                .collect::<serde_json::Map<_, _>>(),
            "requests": r.run.requests,
            "failures": r.run.failures,
        })).collect::<Vec<_>>(),
    })
}

/// Runs the sweep and prints it (a table, or JSON with `--json`).
pub async fn run_and_report(args: &DemoArgs) -> Result<(), String> {
    let started = Instant::now();
    let rows = run_sweep(args).await?;
    let single = rows.iter().find(|r| r.replicas == 1);
    if args.json {
        println!(
            "{}",
            json!({
                "mode": "replica_sweep",
                "workload": super::workload_json(args),
                "rounds": args.sweep.replica_rounds,
                "time_scale": args.sweep.replica_time_scale,
                "rows": rows.iter().map(row_json).collect::<Vec<_>>(),
                "total_wall_s": started.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!(
            "kvroute replica sweep: {} engines x {} DP ranks, cache_aware, {}; data-plane threads per replica {}; median of {} rounds",
            ENGINES,
            DP_SIZE,
            super::workload_summary(args),
            kvroute::data_plane::thread_count(args.sweep.replica_data_plane_threads as usize),
            args.sweep.replica_rounds
        );
        if args.sweep.replica_time_scale > 1 {
            println!(
                "slow motion: engines and routers' clocks {}x slower (times below are in slowed milliseconds)",
                args.sweep.replica_time_scale
            );
        }
        println!(
            "{:<26} {:>9} {:>12} {:>12} {:>12} {:>13} {:>16}",
            "replicas",
            "hit_rate",
            "ttft_p90_ms",
            "1st_turn_p90",
            "later_p90",
            "busiest_rank",
            "vs 1 replica"
        );
        for row in &rows {
            let versus = match single {
                Some(s) if row.replicas > 1 => format!(
                    "{:+.1} pts {:+.0}%",
                    (row.hit_rate() - s.hit_rate()) * 100.0,
                    (row.ttft_p90_ms() / s.ttft_p90_ms() - 1.0) * 100.0
                ),
                _ => String::new(),
            };
            println!(
                "{:<26} {:>8.1}% {:>12.1} {:>12.1} {:>12.1} {:>12.1}% {:>16}",
                row.label(),
                row.hit_rate() * 100.0,
                row.ttft_p90_ms(),
                row.first_turns_ttft_p90_ms(),
                row.later_turns_ttft_p90_ms(),
                row.busiest_rank_share() * 100.0,
                versus
            );
        }
        for row in &rows {
            let pooled = row.pooled();
            let versus = match single {
                Some(s) if row.replicas > 1 => {
                    let one = s.pooled();
                    format!(
                        " (vs 1 replica: mean {:+.0}%, p90 {:+.0}%)",
                        (pooled.ttft_mean_ms / one.ttft_mean_ms - 1.0) * 100.0,
                        (pooled.ttft_p90_ms / one.ttft_p90_ms - 1.0) * 100.0
                    )
                }
                _ => String::new(),
            };
            println!(
                "{}: pooled over its {} requests, TTFT mean {:.1} ms, p90 {:.1} ms{}",
                row.label(),
                pooled.requests,
                pooled.ttft_mean_ms,
                pooled.ttft_p90_ms,
                versus
            );
        }
        for row in rows
            .iter()
            .filter(|r| r.cold_placed().iter().any(|&n| n > 0.0))
        {
            let per_round = row.cold_placed();
            println!(
                "{}: cold prompts per round placed by their owner {:.1}, owner failed {:.1}, owner's rank unknown {:.1}; mean wait for the owner {:.2} ms",
                row.label(),
                per_round[0],
                per_round[1],
                per_round[2],
                row.cold_wait_mean_ms()
            );
        }
        for row in &rows {
            let (Some((plane_cpu, plane_wait)), Some((rest_cpu, rest_wait))) = (
                row.thread_ms_per_request(ThreadGroup::ReplicaDataPlanes),
                row.thread_ms_per_request(ThreadGroup::Rest),
            ) else {
                continue;
            };
            println!(
                "{}: per request, threads on a core / waiting for one: replicas' data planes {:.2} / {:.2} ms, the rest (engines, client, pumps) {:.2} / {:.2} ms",
                row.label(),
                plane_cpu,
                plane_wait,
                rest_cpu,
                rest_wait
            );
        }
        for row in &rows {
            let (on_path_ms, segments, adopted) = row.tokenizing_per_request_and_round();
            println!(
                "{}: tokenizing on the path {:.2} ms per request; per round, chat segments found cached {:.0}, tokenized {:.0}, chats routed on their head {:.1}, tokenized whole {:.1}; prefixes adopted from siblings {:.0}",
                row.label(),
                on_path_ms,
                segments[0],
                segments[1],
                segments[2],
                segments[3],
                adopted
            );
        }
        println!("total wall time {:.1} s", started.elapsed().as_secs_f64());
    }
    if rows.iter().any(|r| r.failures() > 0) {
        return Err("some sweep requests failed (see warnings above)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_motion_scales_every_engine_and_router_clock_and_nothing_else() {
        let (mut sim, mut router) = (
            kvroute_sim::SimConfig::default(),
            kvroute::RouterConfig::default(),
        );
        router.weights.temperature_ms = 1.5;
        let (sim_before, router_before) = (sim.clone(), router.clone());
        slow_down_engines(4, &mut sim);
        slow_down_router(4, &mut router).expect("the defaults times 4 are within the limits");
        assert_eq!(sim.speed, sim_before.speed / 4.0);
        assert_eq!(sim.load_interval_ms, sim_before.load_interval_ms * 4);
        // The per-token costs are left to `speed`, so they are not scaled twice.
        assert_eq!(sim.prefill_us_per_token, sim_before.prefill_us_per_token);
        let (w, w0) = (&router.weights, &router_before.weights);
        assert_eq!(
            w.prefill_cost_us_per_token,
            w0.prefill_cost_us_per_token * 4.0
        );
        assert_eq!(
            w.decode_penalty_us_per_request,
            w0.decode_penalty_us_per_request * 4.0
        );
        assert_eq!(w.temperature_ms, 6.0);
        // Counts of requests are not times: the load guard is the same policy slowed or not.
        assert_eq!(w.load_bound_factor, w0.load_bound_factor);
        assert_eq!(w.load_bound_slack_requests, w0.load_bound_slack_requests);
        assert_eq!(
            router.pending_prefix_ttl_ms,
            router_before.pending_prefix_ttl_ms * 4
        );
        assert_eq!(
            router.engine_metrics_interval_ms,
            router_before.engine_metrics_interval_ms * 4
        );
        let (l, l0) = (&router.load_share, &router_before.load_share);
        assert_eq!(l.interval_ms, l0.interval_ms * 4);
        assert_eq!(l.stale_ms, l0.stale_ms * 4);
        assert_eq!(l.cold_owner_timeout_ms, l0.cold_owner_timeout_ms * 4);
    }

    #[test]
    fn slow_motion_past_a_routers_limit_is_refused_naming_the_flag() {
        let mut router = kvroute::RouterConfig::default();
        router.load_share.cold_owner_timeout_ms = 100;
        let err = slow_down_router(SWEEP_TIME_SCALE_MAX, &mut router).unwrap_err();
        assert!(err.contains("--replica-cold-owner-timeout-ms 100"), "{err}");
        assert!(err.contains("1000 ms"), "{err}");
    }

    #[test]
    fn a_rounds_tokenizing_is_read_from_each_replicas_metrics_and_summed() {
        let replica = |hits: u64, heads: u64, chat_s: f64, adopted: u64| {
            let m = kvroute::control::metrics::Metrics::new(prometheus::Registry::new())
                .expect("metrics register");
            m.tokenizer_cache.with_label_values(&["hit"]).inc_by(hits);
            m.tokenizer_cache.with_label_values(&["head"]).inc_by(heads);
            m.tokenizer_cache
                .with_label_values(&["other"])
                .inc_by(1_000);
            m.tokenize_latency
                .with_label_values(&["chat"])
                .observe(chat_s);
            m.tokenize_latency
                .with_label_values(&["prompt"])
                .observe(0.001);
            m.shared_prefixes
                .with_label_values(&["adopted"])
                .inc_by(adopted);
            m.shared_prefixes.with_label_values(&["sent"]).inc_by(1_000);
            Tokenizing::of(&m)
        };
        let round = replica(5, 1, 0.010, 7).plus(replica(2, 0, 0.004, 3));
        assert_eq!(round.segments, [7, 0, 1, 0], "hit, miss, head, whole");
        assert_eq!(round.prefixes_adopted, 10, "adopted only, not sent");
        assert!(
            (round.on_path_s - 0.016).abs() < 1e-9,
            "chat and prompt time of both replicas: {}",
            round.on_path_s
        );
    }

    #[test]
    fn pooled_figures_weigh_every_request_of_every_round_alike() {
        // Two rounds whose own p90s are 3 and 20 ms: pooled, the p90 is the 5th of 5 requests
        // (nearest rank) and the mean is over all five, not the mean of the rounds' means.
        let rounds = [vec![1.0, 2.0, 3.0], vec![10.0, 20.0]];
        let p = pooled(rounds.iter().map(Vec::as_slice));
        assert_eq!(p.requests, 5);
        assert_eq!(p.ttft_mean_ms, 36.0 / 5.0);
        assert_eq!(p.ttft_p90_ms, 20.0);
        let none = pooled(std::iter::empty());
        assert_eq!(
            (none.requests, none.ttft_mean_ms, none.ttft_p90_ms),
            (0, 0.0, 0.0)
        );
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![]), 0.0);
    }

    #[test]
    fn the_trace_has_a_line_per_request_naming_its_conversation_tenant_and_decision() {
        let conversation = |system: &Arc<String>| super::super::Conversation {
            system: system.clone(),
            user_turns: vec!["q".into(), "q2".into()],
            start_after: Duration::ZERO,
            think_before: vec![Duration::ZERO; 2],
        };
        let (a, b) = (Arc::new("A".to_string()), Arc::new("B".to_string()));
        // Conversations 0 and 2 share a system prompt: one tenant.
        let conversations = [conversation(&a), conversation(&b), conversation(&a)];
        let sample = |conversation, turn, cached| super::super::Sample {
            conversation,
            turn,
            sent_at: Duration::from_millis(5),
            ttft: Duration::from_millis(40),
            prompt_tokens: 100,
            cached_tokens: cached,
            decision: Some("reason=cache_hit;dp_rank=1".into()),
            ..Default::default()
        };
        let samples = [sample(2, 1, 80), sample(1, 0, 0)];
        let path = std::env::temp_dir().join(format!(
            "kvroute-demo-trace-{}-{:?}.jsonl",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_file(&path);
        append_trace(&path, "4x shared", 3, &conversations, &samples).expect("written");
        append_trace(&path, "1x unshared", 4, &conversations, &samples[..1]).expect("appended");
        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .expect("read back")
            .lines()
            .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
            .collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[0]["row"], "4x shared");
        assert_eq!(lines[0]["round"], 3);
        assert_eq!(lines[0]["conversation"], 2);
        assert_eq!(
            lines[0]["tenant"], 0,
            "conversation 2 shares conversation 0's prompt"
        );
        assert_eq!(lines[1]["tenant"], 1);
        assert_eq!(lines[0]["cached_tokens"], 80);
        assert_eq!(lines[0]["sent_ms"], 5.0);
        assert_eq!(lines[0]["decision"], "reason=cache_hit;dp_rank=1");
        assert_eq!(lines[2]["row"], "1x unshared", "a later round appends");
        std::fs::remove_file(&path).expect("removed");
        let missing = path.join("no/such/dir/trace.jsonl");
        let err = append_trace(&missing, "x", 0, &conversations, &samples).unwrap_err();
        assert!(err.contains("--replica-trace-out"), "{err}");
    }
}
