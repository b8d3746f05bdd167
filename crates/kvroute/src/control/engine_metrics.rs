//! Engine load from vLLM's Prometheus `/metrics`: the second engine-load source, beside the
//! ZMQ load feed SGLang publishes.
//!
//! Why: the router's own count of a rank's requests misses everything other clients (other
//! routers, batch jobs, health probes that generate) send to the engine. SGLang publishes its
//! running and waiting requests on a ZMQ topic the KV plane already reads; vLLM has no such
//! feed, but its `/metrics` carries the same two gauges per data-parallel engine core:
//! `vllm:num_requests_running` and `vllm:num_requests_waiting`, labelled `engine="N"` (the DP
//! rank; a single-rank server may omit it). One task scrapes every worker that has no ZMQ load
//! feed every `--engine-metrics-interval-ms`, at most [`ENGINE_METRICS_CONCURRENT_MAX`] at a
//! time, each bounded in time and bytes, and stores the figures in the rank's `RankLoad`; the
//! planner takes them while they are younger than [`ENGINE_METRICS_FRESH_INTERVALS`] intervals.
//! A worker whose `/metrics` has neither gauge (an SGLang engine, or no metrics at all) is asked
//! again only every [`ENGINE_METRICS_ABSENT_RECHECK_MS`].
//!
//! The same body names each rank's KV cache capacity (`vllm:cache_config_info`, whose labels
//! carry `num_gpu_blocks` and `block_size`): the cost model's free room needs it, and vLLM has
//! no load feed to name it as SGLang's does (`max_total_num_tokens`).
//!
//! The parser is hand-written on purpose: it reads three series from a line-based format (name,
//! optional `{labels}`, value), and the Prometheus parsing crates bring a regex engine and a date
//! library for the rest of the format, which this never needs. It allocates nothing per line and
//! ignores every line it does not recognise, so a body it half understands yields what it does.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::control::registry::{RankLoad, Worker, clock_us};
use crate::control::router::Router;

pub use crate::config::{DEFAULT_ENGINE_METRICS_INTERVAL_MS, ENGINE_METRICS_INTERVAL_MS_MAX};
/// Longest wait for one `/metrics` answer, body included.
pub const ENGINE_METRICS_TIMEOUT_MS: u64 = 2_000;
/// Largest `/metrics` body read (vLLM's, histograms included, is tens of kilobytes per engine).
pub const ENGINE_METRICS_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Scrapes in flight at once.
pub const ENGINE_METRICS_CONCURRENT_MAX: usize = 16;
/// A scraped figure counts for this many intervals, then the rank has no engine load again
/// (an engine whose metrics stopped answering must not keep steering with old numbers).
pub const ENGINE_METRICS_FRESH_INTERVALS: u64 = 3;
/// How often a worker without vLLM gauges is asked again.
pub const ENGINE_METRICS_ABSENT_RECHECK_MS: u64 = 60_000;
/// Highest DP rank label taken from a body (ranks beyond a worker's `dp_size` are ignored too).
pub const ENGINE_METRICS_DP_RANK_MAX: u32 = 4_096;

const RUNNING: &str = "vllm:num_requests_running";
const WAITING: &str = "vllm:num_requests_waiting";
const CACHE_CONFIG: &str = "vllm:cache_config_info";
/// Largest capacity taken from a body, in tokens (far past any GPU's KV cache; a label beyond it
/// is not believed).
pub const ENGINE_CAPACITY_TOKENS_MAX: u64 = 1 << 40;

/// Running and waiting requests per DP rank, as one `/metrics` body states them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScrapedLoad {
    pub running: u64,
    pub waiting: u64,
}

/// Reads vLLM's scheduler gauges from a Prometheus text body: DP rank -> load. Empty when the
/// body has neither gauge. Several series of one rank (other labels differing, e.g. several
/// models) are summed, as the engine's total is what queues a new request.
pub fn parse_vllm_load(body: &str) -> HashMap<u32, ScrapedLoad> {
    let mut out: HashMap<u32, ScrapedLoad> = HashMap::new();
    for line in body.lines() {
        let line = line.trim_start();
        let (is_running, rest) = if let Some(rest) = line.strip_prefix(RUNNING) {
            (true, rest)
        } else if let Some(rest) = line.strip_prefix(WAITING) {
            (false, rest)
        } else {
            continue;
        };
        let (labels, value) = match rest.as_bytes().first() {
            Some(b'{') => match rest.find('}') {
                Some(end) => (&rest[1..end], &rest[end + 1..]),
                None => continue,
            },
            Some(b' ' | b'\t') => ("", rest),
            // `vllm:num_requests_running_total` and the like: another metric.
            _ => continue,
        };
        let Some(value) = value.split_whitespace().next() else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        if !value.is_finite() || value < 0.0 {
            continue;
        }
        let Some(rank) = engine_label(labels) else {
            continue;
        };
        let entry = out.entry(rank).or_default();
        let count = value.min(u32::MAX as f64) as u64;
        if is_running {
            entry.running = entry.running.saturating_add(count);
        } else {
            entry.waiting = entry.waiting.saturating_add(count);
        }
    }
    out
}

/// Each rank's KV cache capacity in tokens, from `vllm:cache_config_info` (labels
/// `num_gpu_blocks`, `block_size`, and `engine` for the DP rank). A series missing either size,
/// or naming 0 blocks (vLLM's value before its profiling run), says nothing.
pub fn parse_vllm_capacity(body: &str) -> HashMap<u32, u64> {
    let mut out = HashMap::new();
    for line in body.lines() {
        let Some(rest) = line.trim_start().strip_prefix(CACHE_CONFIG) else {
            continue;
        };
        let Some(labels) = rest.strip_prefix('{').and_then(|r| r.split('}').next()) else {
            continue;
        };
        let number = |name: &str| {
            label_value(labels, name)
                .ok()
                .flatten()
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&n| n > 0)
        };
        let (Some(blocks), Some(block_size), Some(rank)) = (
            number("num_gpu_blocks"),
            number("block_size"),
            engine_label(labels),
        ) else {
            continue;
        };
        if let Some(tokens) = blocks
            .checked_mul(block_size)
            .filter(|&t| t <= ENGINE_CAPACITY_TOKENS_MAX)
        {
            out.insert(rank, tokens);
        }
    }
    out
}

/// The DP rank a series belongs to: its `engine` label, 0 without one; `None` for a label that
/// is not a small number.
fn engine_label(labels: &str) -> Option<u32> {
    match label_value(labels, "engine").ok()? {
        Some(value) => value
            .parse::<u32>()
            .ok()
            .filter(|&r| r <= ENGINE_METRICS_DP_RANK_MAX),
        None => Some(0),
    }
}

/// The value of label `wanted` in a series' `name="value",...` list: `Ok(None)` when the series
/// has no such label, `Err` when the list is malformed before it is found.
fn label_value<'a>(labels: &'a str, wanted: &str) -> Result<Option<&'a str>, ()> {
    let mut rest = labels;
    while let Some(eq) = rest.find('=') {
        let name = rest[..eq].trim().trim_start_matches(',').trim();
        let after = &rest[eq + 1..];
        let quoted = after.strip_prefix('"').ok_or(())?;
        let close = quoted.find('"').ok_or(())?;
        if name == wanted {
            return Ok(Some(&quoted[..close]));
        }
        rest = &quoted[close + 1..];
    }
    Ok(None)
}

/// The engine's own report of a rank's running and waiting requests: its ZMQ load feed
/// (SGLang) when it has one, else the last fresh scrape of its `/metrics` (vLLM).
pub fn engine_load(
    router: &Router,
    worker: &Worker,
    dp_rank: u32,
    now_us: u64,
) -> Option<crate::routing::policy::EngineLoad> {
    engine_load_given(
        router,
        worker,
        dp_rank,
        now_us,
        router.kv.engine_load(&worker.url, dp_rank),
    )
}

/// [`engine_load`] with the rank's load-feed report already read (`pushed`): the routing path
/// reads a worker's whole feed under one lock and then asks this per rank.
pub fn engine_load_given(
    router: &Router,
    worker: &Worker,
    dp_rank: u32,
    now_us: u64,
    pushed: Option<crate::routing::policy::EngineLoad>,
) -> Option<crate::routing::policy::EngineLoad> {
    if pushed.is_some() {
        return pushed;
    }
    let fresh_us = router
        .config
        .engine_metrics_interval_ms
        .saturating_mul(ENGINE_METRICS_FRESH_INTERVALS)
        .saturating_mul(1_000);
    let scraped = worker
        .ranks
        .get(dp_rank as usize)?
        .scraped_engine_load(now_us, fresh_us)?;
    Some(crate::routing::policy::EngineLoad {
        running: scraped.running,
        waiting: scraped.waiting,
    })
}

impl RankLoad {
    /// The engine load last scraped from `/metrics`, when younger than `fresh_us`.
    pub fn scraped_engine_load(&self, now_us: u64, fresh_us: u64) -> Option<ScrapedLoad> {
        let at = self.engine_metrics_at_us.load(Ordering::Relaxed);
        (at != 0 && now_us.saturating_sub(at) <= fresh_us).then(|| ScrapedLoad {
            running: self.engine_metrics_running.load(Ordering::Relaxed),
            waiting: self.engine_metrics_waiting.load(Ordering::Relaxed),
        })
    }
}

/// Starts the scrape loop (nothing when `--engine-metrics-interval-ms` is 0). Stops on
/// `router.shutdown`.
pub fn start(router: &Arc<Router>) {
    if router.config.engine_metrics_interval_ms == 0 {
        return;
    }
    tokio::spawn(scrape_loop(router.clone()));
}

async fn scrape_loop(router: Arc<Router>) {
    let interval = Duration::from_millis(router.config.engine_metrics_interval_ms);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Workers found without vLLM gauges, and when to ask them again.
    let mut absent_until: HashMap<String, Instant> = HashMap::new();
    loop {
        tokio::select! {
            _ = router.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let due: Vec<Arc<Worker>> = router
            .registry
            .workers()
            .into_iter()
            // A ZMQ load feed is the engine's own push: it stays the ground truth.
            .filter(|w| (0..w.dp_size).all(|r| router.kv.engine_load(&w.url, r).is_none()))
            .filter(|w| absent_until.get(&w.url).is_none_or(|&t| now >= t))
            .collect();
        let results: Vec<(String, bool)> = futures::stream::iter(due)
            .map(|w| {
                let router = router.clone();
                async move {
                    let found = scrape_one(&router, &w).await;
                    (w.url.clone(), found)
                }
            })
            .buffer_unordered(ENGINE_METRICS_CONCURRENT_MAX)
            .collect()
            .await;
        for (url, found) in results {
            if found {
                absent_until.remove(&url);
            } else {
                absent_until.insert(
                    url,
                    now + Duration::from_millis(ENGINE_METRICS_ABSENT_RECHECK_MS),
                );
            }
        }
        let known: std::collections::HashSet<String> = router
            .registry
            .workers()
            .iter()
            .map(|w| w.url.clone())
            .collect();
        absent_until.retain(|url, _| known.contains(url));
    }
}

/// Scrapes one worker; true when its body had vLLM's gauges (then stored on its ranks).
async fn scrape_one(router: &Router, worker: &Worker) -> bool {
    let url = format!("{}/metrics", worker.url.trim_end_matches('/'));
    let fetch = async {
        // reqwest's timeout covers the body too; `read_capped` bounds its size.
        let resp = router
            .http
            .get(&url)
            .timeout(Duration::from_millis(ENGINE_METRICS_TIMEOUT_MS))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status()));
        }
        crate::routing::kv::read_capped(resp, ENGINE_METRICS_MAX_BYTES).await
    };
    let body = match fetch.await {
        Ok(body) => body,
        Err(_) => {
            router
                .metrics
                .engine_metrics_scrapes
                .with_label_values(&["failed"])
                .inc();
            return false;
        }
    };
    let body = String::from_utf8_lossy(&body);
    for (dp, tokens) in parse_vllm_capacity(&body) {
        if let Some(load) = worker.ranks.get(dp as usize) {
            load.engine_metrics_capacity_tokens
                .store(tokens, Ordering::Relaxed);
        }
    }
    let loads = parse_vllm_load(&body);
    if loads.is_empty() {
        router
            .metrics
            .engine_metrics_scrapes
            .with_label_values(&["no_vllm_gauges"])
            .inc();
        return false;
    }
    let now = clock_us().max(1);
    for (dp, load) in worker.ranks.iter().enumerate() {
        let Some(scraped) = loads.get(&(dp as u32)) else {
            continue;
        };
        load.engine_metrics_running
            .store(scraped.running, Ordering::Relaxed);
        load.engine_metrics_waiting
            .store(scraped.waiting, Ordering::Relaxed);
        load.engine_metrics_at_us.store(now, Ordering::Relaxed);
    }
    router
        .metrics
        .engine_metrics_scrapes
        .with_label_values(&["ok"])
        .inc();
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_capacity_is_its_gpu_blocks_times_the_block_size() {
        let body = "# TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"4096\"} 1.0\n\
            vllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"2048\",block_size=\"32\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1.0\n";
        let capacity = parse_vllm_capacity(body);
        assert_eq!(capacity.get(&1), Some(&65_536), "labels in any order");
        assert_eq!(
            capacity.get(&0),
            Some(&1_600),
            "no engine label: rank 0, the later line"
        );
        assert_eq!(capacity.len(), 2);
    }

    #[test]
    fn a_capacity_series_missing_a_size_or_naming_nonsense_says_nothing() {
        for body in [
            "vllm:cache_config_info{block_size=\"16\",engine=\"0\"} 1.0",
            "vllm:cache_config_info{num_gpu_blocks=\"None\",block_size=\"16\"} 1.0",
            "vllm:cache_config_info{num_gpu_blocks=\"0\",block_size=\"16\"} 1.0",
            "vllm:cache_config_info{num_gpu_blocks=\"18446744073709551615\",block_size=\"16\"} 1.0",
            "vllm:cache_config_info{num_gpu_blocks=\"4096\",block_size=\"16\",engine=\"x\"} 1.0",
            "vllm:cache_config_info{num_gpu_blocks=4096,block_size=\"16\"} 1.0",
            "vllm:cache_config_info_total{num_gpu_blocks=\"4096\",block_size=\"16\"} 1.0",
            "vllm:cache_config_info 1.0",
        ] {
            assert!(parse_vllm_capacity(body).is_empty(), "{body}");
        }
    }

    #[test]
    fn both_gauges_are_read_per_engine_label() {
        let body = "# HELP vllm:num_requests_running Requests running.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 1\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0\n";
        let loads = parse_vllm_load(body);
        assert_eq!(
            loads.get(&0),
            Some(&ScrapedLoad {
                running: 3,
                waiting: 2
            })
        );
        assert_eq!(
            loads.get(&1),
            Some(&ScrapedLoad {
                running: 1,
                waiting: 0
            })
        );
    }

    #[test]
    fn a_series_without_an_engine_label_is_rank_zero_and_series_of_one_rank_add_up() {
        let body = "vllm:num_requests_running{model_name=\"a\"} 2\n\
            vllm:num_requests_running{model_name=\"b\"} 5\n\
            vllm:num_requests_waiting 4\n";
        assert_eq!(
            parse_vllm_load(body).get(&0),
            Some(&ScrapedLoad {
                running: 7,
                waiting: 4
            })
        );
    }

    #[test]
    fn sglang_gauges_other_metrics_and_garbage_yield_nothing() {
        let body = "sglang:num_running_reqs{dp_rank=\"0\"} 3.0\n\
            vllm:num_requests_running_total{engine=\"0\"} 9\n\
            vllm:num_requests_running{engine=\"0\" 3\n\
            vllm:num_requests_running{engine=\"x\"} 3\n\
            vllm:num_requests_running{engine=\"99999999\"} 3\n\
            vllm:num_requests_waiting{engine=\"0\"} -1\n\
            vllm:num_requests_waiting{engine=\"0\"} NaN\n\
            vllm:num_requests_waiting{engine=\"0\"} many\n\
            \u{0}\u{1}binary";
        assert!(
            parse_vllm_load(body).is_empty(),
            "{:?}",
            parse_vllm_load(body)
        );
    }

    #[test]
    fn huge_figures_are_clamped_not_overflowed() {
        let body = "vllm:num_requests_running{engine=\"0\"} 1e300\n\
            vllm:num_requests_running{engine=\"0\",x=\"y\"} 1e300\n";
        let load = parse_vllm_load(body)[&0];
        assert_eq!(load.running, 2 * u64::from(u32::MAX));
    }

    #[test]
    fn a_scraped_load_counts_only_while_fresh() {
        let load = RankLoad::default();
        assert_eq!(load.scraped_engine_load(1_000, 500), None, "never scraped");
        load.engine_metrics_running.store(4, Ordering::Relaxed);
        load.engine_metrics_at_us.store(1_000, Ordering::Relaxed);
        assert_eq!(
            load.scraped_engine_load(1_500, 500),
            Some(ScrapedLoad {
                running: 4,
                waiting: 0
            })
        );
        assert_eq!(load.scraped_engine_load(1_501, 500), None, "stale");
    }
}
