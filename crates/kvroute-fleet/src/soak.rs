//! The soak: one router in front of 16 simulated engine ranks (two processes, two encodings,
//! small caches that evict all the time), an open-loop client at a fixed rate, and a chaos
//! driver, for a fixed time (`scripts/soak.sh`: 10 minutes; 2 in CI). It ends with the checks a
//! long-running deployment needs to pass:
//!
//! * no panic in any process's log;
//! * the router's RSS at the end within 10 % of its value at the reference point (minute 2, or
//!   half-way through a shorter run): memory stays flat. The report keeps the curve (a sample
//!   every 5 s), so a failed bound can be read as a step, a climb or a high-water mark;
//! * the router's view equals the engines' caches, once settled (the harness's rule 2);
//! * every request got a response: a success, or a proper error status (the only errors the
//!   chaos can cause are 504s from requests stalled before their head, and there must be
//!   exactly as many of those as the engines applied head stalls);
//! * the event faults are accounted for: no batch lost, one replay per withheld-batch episode
//!   on the rank it hit, one publisher restart per restart on the rank it hit.
//!
//! The chaos driver's faults, in turn, one every `chaos_period_ms`, each on the next rank or
//! engine in a fixed rotation (so a run is reproducible and each episode is alone on its rank
//! long enough to be seen): an engine restart on one rank (`/control/restart_publisher`: the
//! simulator's restart, cache emptied and seq from 0; the process keeps its ports), withheld
//! batches (`/control/drop_next`, 1-4 batches), a hang in the middle of streamed answers
//! (`/control/stall` at `body`, taken by streamed answers only, shorter than the client's
//! timeout: the stream must resume, and the other requests must not wait for it), and requests accepted and never answered
//! (`/control/stall` at `head`, longer than the router's `--request-timeout-ms`: a 504).
//!
//! Why a fixed rotation and not random faults: the checks compare exact counts per rank, which
//! needs each fault alone on its rank until the next batch reveals it; a rotation over 16 ranks
//! every few seconds guarantees that, and the traffic makes every rank publish continuously.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::engine::{SimOptions, SimProcess};
use crate::fleet::Fleet;
use crate::router::{RouterOptions, RouterProcess};
use crate::traffic::chain;

/// The router's wait for a response head; head stalls are longer, so they end in a 504.
pub const SOAK_ROUTER_REQUEST_TIMEOUT_MS: u64 = 2_000;
/// A head stall: accepted, then nothing for this long.
pub const HEAD_STALL_MS: u64 = 4_000;
/// A mid-stream hang; shorter than the client's timeout, so the stream must resume.
pub const BODY_STALL_MS: u64 = 3_000;
/// The client's limit on one request, far above every stall.
pub const CLIENT_REQUEST_TIMEOUT_MS: u64 = 30_000;
/// Requests the client keeps in flight at most (open loop: beyond it a tick is counted as
/// shed instead of queueing without bound).
pub const CLIENT_IN_FLIGHT_MAX: usize = 4_096;
/// Most batches one withholding episode withholds.
pub const DROP_BATCHES_MAX: u64 = 4;
/// Requests of one chaos episode (stalls).
pub const STALLED_REQUESTS_PER_EPISODE: u64 = 2;
/// How long the end-of-run wait for the in-flight requests may take.
pub const DRAIN_LIMIT_MS: u64 = 60_000;
/// RSS growth allowed between the reference point and the end.
pub const RSS_GROWTH_MAX_FRACTION: f64 = 0.10;
/// The reference point for RSS: minute 2, or half-way through a shorter run.
pub const RSS_REFERENCE_MAX_S: f64 = 120.0;
/// Period of the RSS samples kept in the report (the check samples once a second).
pub const RSS_REPORT_SAMPLE_PERIOD_S: f64 = 5.0;

/// `[seconds, KiB]` pairs, the first sample of every `period_s` window.
fn rss_curve(samples: &[(f64, u64)], period_s: f64) -> Vec<[u64; 2]> {
    let mut next_s = 0.0;
    let mut curve = Vec::new();
    for &(t, kib) in samples {
        if t >= next_s {
            curve.push([t.round() as u64, kib]);
            next_s = (t / period_s).floor() * period_s + period_s;
        }
    }
    curve
}
/// Distinct prompts the client cycles through (chains of 4 blocks over 8 shared prefixes).
const PROMPTS_MAX: u64 = 4_096;
/// Device blocks per rank: ~64 chains, so the cycling prompts evict all the time.
const SOAK_CAPACITY_BLOCKS: usize = 256;

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    pub duration_s: f64,
    pub rate_per_s: f64,
    pub chaos_period_ms: u64,
}

/// The client's tally.
#[derive(Debug, Default)]
struct Tally {
    ok: AtomicU64,
    sent: AtomicU64,
    shed: AtomicU64,
    /// status -> count, for every non-200 answer.
    statuses: std::sync::Mutex<BTreeMap<u16, u64>>,
    /// Requests that got no response (transport error, timeout, a stream cut short), with a
    /// few examples.
    no_response: AtomicU64,
    examples: std::sync::Mutex<Vec<String>>,
}

/// Examples of failures kept for the report.
const FAILURE_EXAMPLES_MAX: usize = 10;

impl Tally {
    fn failure(&self, what: String) {
        self.no_response.fetch_add(1, Ordering::Relaxed);
        let mut ex = self.examples.lock().unwrap_or_else(|e| e.into_inner());
        if ex.len() < FAILURE_EXAMPLES_MAX {
            ex.push(what);
        }
    }
}

/// What the chaos driver did, per rank `(engine url, dp_rank)`.
#[derive(Debug, Default, Clone)]
struct ChaosLog {
    restarts: BTreeMap<(String, u32), u64>,
    drop_episodes: BTreeMap<(String, u32), u64>,
    dropped_batches: u64,
    body_stall_episodes: u64,
    head_stall_episodes: u64,
}

/// The soak's end-of-run report; `failed_checks` empty means it passed.
#[derive(Debug)]
pub struct SoakReport {
    pub json: Value,
    pub failed_checks: Vec<String>,
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// One request of the client: a completion on the `i`-th prompt, every fourth one streamed.
async fn one_request(http: reqwest::Client, base: String, i: u64, tally: Arc<Tally>) {
    let stream = i.is_multiple_of(4);
    let body = json!({
        "model": "m",
        "prompt": chain(i % PROMPTS_MAX, 5, 16),
        "max_tokens": 4,
        "stream": stream,
    });
    let resp = match http
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return tally.failure(format!("request {i}: {e}")),
    };
    let status = resp.status().as_u16();
    let text = match resp.text().await {
        Ok(t) => t,
        Err(e) => return tally.failure(format!("request {i} ({status}): body: {e}")),
    };
    if status != 200 {
        // A proper error is a JSON error object; anything else is not a response a client
        // can act on.
        if serde_json::from_str::<Value>(&text).is_ok_and(|v| v.get("error").is_some()) {
            *tally
                .statuses
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(status)
                .or_default() += 1;
        } else {
            tally.failure(format!(
                "request {i}: {status} without an error object: {text}"
            ));
        }
        return;
    }
    if stream && !text.trim_end().ends_with("data: [DONE]") {
        return tally.failure(format!("request {i}: stream cut short"));
    }
    tally.ok.fetch_add(1, Ordering::Relaxed);
}

/// Runs the soak; panics only where the harness does (a process that cannot start).
pub async fn run(config: SoakConfig) -> SoakReport {
    let mut fleet = Fleet::new();
    for (encoding, hash_seed) in [("sglang", 0), ("vllm-map", 5_000)] {
        fleet.sims.push(Arc::new(
            SimProcess::start(SimOptions {
                engines: 4,
                dp_size: 2,
                encoding,
                capacity_blocks: SOAK_CAPACITY_BLOCKS,
                hash_seed,
                ..SimOptions::default()
            })
            .await,
        ));
    }
    let workers = fleet.worker_specs();
    let ranks = fleet.rank_count();
    let mut options = RouterOptions::new("soak", &workers, 10_000);
    options.extra_args = vec![
        "--request-timeout-ms".into(),
        SOAK_ROUTER_REQUEST_TIMEOUT_MS.to_string(),
    ];
    let router = RouterProcess::start(options).await;
    router.wait_ready(30_000).await;
    router.wait_subscribed(ranks, 30_000).await;
    let pid = router.pid().expect("the router runs");
    let base = router.base.clone();
    fleet.routers.push(router);

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(CLIENT_REQUEST_TIMEOUT_MS))
        .pool_max_idle_per_host(CLIENT_IN_FLIGHT_MAX)
        .build()
        .expect("the client builds");
    let in_flight = Arc::new(tokio::sync::Semaphore::new(CLIENT_IN_FLIGHT_MAX));
    let client = {
        let (stop, tally, in_flight, base) =
            (stop.clone(), tally.clone(), in_flight.clone(), base.clone());
        tokio::spawn(async move {
            let period = Duration::from_secs_f64(1.0 / config.rate_per_s.max(1.0));
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut tasks = tokio::task::JoinSet::new();
            let mut i: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                tally.sent.fetch_add(1, Ordering::Relaxed);
                let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                    tally.shed.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let (http, base, tally) = (http.clone(), base.clone(), tally.clone());
                tasks.spawn(async move {
                    one_request(http, base, i, tally).await;
                    drop(permit);
                });
                i += 1;
                while tasks.try_join_next().is_some() {}
            }
            let drain = tokio::time::timeout(Duration::from_millis(DRAIN_LIMIT_MS), async {
                while tasks.join_next().await.is_some() {}
            });
            drain.await.is_ok()
        })
    };

    // RSS samples, one a second.
    let rss_samples = Arc::new(std::sync::Mutex::new(Vec::<(f64, u64)>::new()));
    let sampler = {
        let (stop, samples) = (stop.clone(), rss_samples.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                if let Some(kib) = rss_kib(pid) {
                    samples
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((started.elapsed().as_secs_f64(), kib));
                }
            }
        })
    };

    // The chaos driver runs in this task until the end.
    let targets: Vec<(usize, usize, usize)> = fleet
        .sims
        .iter()
        .enumerate()
        .flat_map(|(si, s)| {
            (0..s.engines.len()).flat_map(move |e| (0..s.options.dp_size).map(move |r| (si, e, r)))
        })
        .collect();
    let mut chaos = ChaosLog::default();
    let deadline = started + Duration::from_secs_f64(config.duration_s);
    let mut episode: usize = 0;
    let mut next_target: usize = 0;
    while Instant::now() + Duration::from_millis(config.chaos_period_ms) < deadline {
        tokio::time::sleep(Duration::from_millis(config.chaos_period_ms)).await;
        // Rank for this episode: a stride of 5 over the 16 ranks (every rank, never the same
        // one twice in a row), skipping ranks the router has heard nothing from yet: a restart
        // or a withheld batch before a rank's first batch is invisible to any subscriber.
        let heard: Vec<(String, u32)> = fleet.routers[0]
            .rank_statuses()
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.cursor.is_some_and(|c| c >= 0))
            .map(|s| (s.url, s.dp_rank))
            .collect();
        let Some((step, (si, e, r))) = (next_target..next_target + targets.len())
            .map(|step| (step, targets[(step * 5) % targets.len()]))
            .find(|(_, (si, e, r))| {
                heard.contains(&(fleet.sims[*si].engines[*e].clone(), *r as u32))
            })
        else {
            continue;
        };
        next_target = step + 1;
        let sim = &fleet.sims[si];
        let key = (sim.engines[e].clone(), r as u32);
        match episode % 4 {
            0 => {
                sim.restart_publisher(e, r).await;
                *chaos.restarts.entry(key).or_default() += 1;
            }
            1 => {
                let batches = 1 + (episode as u64 / 4) % DROP_BATCHES_MAX;
                sim.drop_next(e, r, batches).await;
                *chaos.drop_episodes.entry(key).or_default() += 1;
                chaos.dropped_batches += batches;
            }
            2 => {
                sim.stall(e, "body", STALLED_REQUESTS_PER_EPISODE, BODY_STALL_MS)
                    .await;
                chaos.body_stall_episodes += 1;
            }
            _ => {
                sim.stall(e, "head", STALLED_REQUESTS_PER_EPISODE, HEAD_STALL_MS)
                    .await;
                chaos.head_stall_episodes += 1;
            }
        }
        episode += 1;
    }
    if let Some(rest) = deadline.checked_duration_since(Instant::now()) {
        tokio::time::sleep(rest).await;
    }
    let load_s = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let drained = client.await.expect("the client does not panic");
    let _ = sampler.await;

    // A withheld batch is only seen as a gap when a later batch arrives: more batches on every
    // rank than an episode withholds reveal any episode the traffic did not.
    for (k, (si, e, r)) in targets.iter().enumerate() {
        let sim = &fleet.sims[*si];
        for b in 0..=DROP_BATCHES_MAX {
            sim.store(*e, *r, &[chain(1_000_000 + (k as u64) * 16 + b, 9, 16)])
                .await;
        }
    }
    let truth = fleet.settle().await;
    let router = &fleet.routers[0];
    let view_diff = match router.view().await {
        Ok(v) => v.diff(&truth.view),
        Err(e) => format!("cannot read the router's view: {e}"),
    };
    let statuses = router.rank_statuses().await.unwrap_or_default();

    let mut head_applied = 0u64;
    let mut body_applied = 0u64;
    for sim in &fleet.sims {
        for e in 0..sim.engines.len() {
            let f = sim.fault_counts(e).await;
            head_applied += f["head_stalls_applied"].as_u64().unwrap_or(0);
            body_applied += f["body_stalls_applied"].as_u64().unwrap_or(0);
        }
    }

    let mut failed = Vec::new();
    let mut panics = Vec::new();
    let mut logs: Vec<std::path::PathBuf> = fleet.sims.iter().map(|s| s.log.clone()).collect();
    logs.push(router.log.clone());
    for log in &logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("panicked")) {
            panics.push(format!("{}: {line}", log.display()));
        }
    }
    if !panics.is_empty() {
        failed.push(format!("panics: {panics:?}"));
    }

    let samples = rss_samples
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let reference_s = RSS_REFERENCE_MAX_S.min(load_s / 2.0);
    let rss_reference = samples
        .iter()
        .find(|(t, _)| *t >= reference_s)
        .map(|(_, k)| *k);
    let rss_end = samples.last().map(|(_, k)| *k);
    let rss_peak = samples.iter().map(|(_, k)| *k).max();
    match (rss_reference, rss_end) {
        (Some(r), Some(e)) if (e as f64) > (r as f64) * (1.0 + RSS_GROWTH_MAX_FRACTION) => failed
            .push(format!(
                "RSS grew from {r} KiB at {reference_s:.0} s to {e} KiB at the end"
            )),
        (Some(_), Some(_)) => {}
        _ => failed.push("no RSS samples".into()),
    }

    if !view_diff.is_empty() {
        failed.push(format!(
            "the router's view differs from the engines' caches: {view_diff}"
        ));
    }

    let statuses_map = tally
        .statuses
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let no_response = tally.no_response.load(Ordering::Relaxed);
    if no_response > 0 {
        failed.push(format!(
            "{no_response} requests got no response: {:?}",
            tally.examples.lock().unwrap_or_else(|e| e.into_inner())
        ));
    }
    if !drained {
        failed.push(format!(
            "requests still in flight {DRAIN_LIMIT_MS} ms after the end"
        ));
    }
    let timeouts = statuses_map.get(&504).copied().unwrap_or(0);
    let other_errors: u64 = statuses_map
        .iter()
        .filter(|(s, _)| **s != 504)
        .map(|(_, n)| n)
        .sum();
    if timeouts != head_applied {
        failed.push(format!(
            "{timeouts} 504s for {head_applied} head stalls the engines applied"
        ));
    }
    if other_errors > 0 {
        failed.push(format!(
            "error statuses the chaos cannot explain: {statuses_map:?}"
        ));
    }
    if tally.shed.load(Ordering::Relaxed) > 0 {
        failed.push(format!(
            "{} ticks shed at {CLIENT_IN_FLIGHT_MAX} in flight",
            tally.shed.load(Ordering::Relaxed)
        ));
    }

    let mut rank_rows = Vec::new();
    for s in &statuses {
        let key = (s.url.clone(), s.dp_rank);
        let drops = chaos.drop_episodes.get(&key).copied().unwrap_or(0);
        let restarts = chaos.restarts.get(&key).copied().unwrap_or(0);
        if s.lost_batches != 0 || s.replays != drops || s.publisher_restarts != restarts {
            failed.push(format!(
                "{}#{}: lost {} (want 0), replays {} (want {drops}), publisher restarts {} (want {restarts})",
                s.url, s.dp_rank, s.lost_batches, s.replays, s.publisher_restarts
            ));
        }
        rank_rows.push(json!({
            "worker": s.url, "dp_rank": s.dp_rank,
            "lost_batches": s.lost_batches, "replays": s.replays, "drop_episodes": drops,
            "publisher_restarts": s.publisher_restarts, "restarts": restarts,
            "cursor": s.cursor, "engine_last_seq": truth.last_seq.get(&key),
        }));
    }

    let json = json!({
        "duration_s": load_s,
        "rate_per_s": config.rate_per_s,
        "ranks": ranks,
        "requests": {
            "sent": tally.sent.load(Ordering::Relaxed),
            "ok": tally.ok.load(Ordering::Relaxed),
            "error_statuses": statuses_map.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "no_response": no_response,
            "shed": tally.shed.load(Ordering::Relaxed),
        },
        "chaos": {
            "engine_restarts": chaos.restarts.values().sum::<u64>(),
            "drop_episodes": chaos.drop_episodes.values().sum::<u64>(),
            "dropped_batches": chaos.dropped_batches,
            "body_stall_episodes": chaos.body_stall_episodes,
            "head_stall_episodes": chaos.head_stall_episodes,
            "body_stalls_applied": body_applied,
            "head_stalls_applied": head_applied,
        },
        "router_rss_kib": {
            "reference_at_s": reference_s,
            "reference": rss_reference,
            "end": rss_end,
            "peak": rss_peak,
            // The curve, so a failed bound can be told apart (a step at one fault, a steady
            // climb, a high-water mark under CPU starvation) from the report alone.
            "samples_every_5_s": rss_curve(&samples, RSS_REPORT_SAMPLE_PERIOD_S),
        },
        "view": {
            "blocks": truth.view.carried(),
            "equal_to_engines": view_diff.is_empty(),
        },
        "ranks_detail": rank_rows,
        "panics": panics,
        "failed_checks": failed,
    });
    SoakReport {
        json,
        failed_checks: failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reported_rss_curve_keeps_one_sample_per_period_and_the_first_one() {
        let samples: Vec<(f64, u64)> = (0..23).map(|i| (0.4 + i as f64, 1_000 + i)).collect();
        assert_eq!(
            rss_curve(&samples, 5.0),
            vec![
                [0, 1_000],
                [5, 1_005],
                [10, 1_010],
                [15, 1_015],
                [20, 1_020]
            ]
        );
        assert!(rss_curve(&[], 5.0).is_empty());
    }
}
