//! A `kvroute-sim` process (one or more engines of one encoding) and its test-only control API.
//!
//! Engines run as their own process, not in the test's, for the same reason the routers do: the
//! scenarios are about processes that start, stop and restart independently, and one process per
//! encoding is how a mixed fleet (SGLang and vLLM engines side by side) looks. Every port is
//! OS-assigned; the harness learns the engines' URLs from the lines the binary prints at start.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::bins::binaries;
use crate::http::{get_json, post_json};
use crate::logs::{log_file, tail};
use crate::view::IndexView;

/// How long a sim process may take to print its engines' addresses.
pub const SIM_START_LIMIT_MS: u64 = 20_000;

/// What to start.
#[derive(Debug, Clone)]
pub struct SimOptions {
    pub engines: usize,
    pub dp_size: usize,
    /// `--kv-encoding`: sglang, vllm, vllm-map or legacy (hash-bytes modes fold hashes, so the
    /// engine hash in a router's view would not be the engine's own; the harness avoids them).
    pub encoding: &'static str,
    pub block_size: usize,
    /// Device blocks per rank: small values make the engine evict, so views carry removals.
    pub capacity_blocks: usize,
    /// Batches each rank keeps for replay: reaching back to seq 0 or not decides whether a
    /// router can rebuild the rank from the engine (`from_engine_replay`).
    pub replay_buffer_batches: usize,
    pub model: String,
    /// Different seeds per process keep engine hashes of two processes apart.
    pub hash_seed: u64,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            engines: 1,
            dp_size: 2,
            encoding: "sglang",
            block_size: 16,
            capacity_blocks: 4096,
            replay_buffer_batches: 10_000,
            model: "m".into(),
            hash_seed: 0,
        }
    }
}

/// A running sim process; killed when dropped.
pub struct SimProcess {
    child: Child,
    /// Each engine's HTTP base URL, in engine order.
    pub engines: Vec<String>,
    pub options: SimOptions,
    pub log: PathBuf,
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl SimProcess {
    pub async fn start(options: SimOptions) -> SimProcess {
        let log = log_file(&format!("sim-{}", options.encoding));
        let stderr = std::fs::File::create(&log).expect("the sim log can be created");
        let mut child = Command::new(&binaries().sim)
            .args([
                "--engines",
                &options.engines.to_string(),
                "--dp-size",
                &options.dp_size.to_string(),
                "--port",
                "0",
                "--kv-port-base",
                "0",
                "--replay-port-base",
                "0",
                "--kv-encoding",
                options.encoding,
                "--block-size",
                &options.block_size.to_string(),
                "--capacity-blocks",
                &options.capacity_blocks.to_string(),
                "--replay-buffer-batches",
                &options.replay_buffer_batches.to_string(),
                "--served-model-name",
                &options.model,
                "--hash-seed",
                &options.hash_seed.to_string(),
                "--instant",
                "--enable-control",
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("the kvroute-sim binary starts");
        let stdout = child.stdout.take().expect("stdout is piped");
        // The binary prints one `engine <i> http=<url> ...` line per engine, then serves; a
        // thread reads them because the pipe is blocking.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut engines = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(SIM_START_LIMIT_MS);
        while engines.len() < options.engines {
            let line = tokio::time::timeout_at(deadline, rx.recv()).await;
            match line {
                Ok(Some(line)) => {
                    if let Some(url) = line
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("http="))
                    {
                        engines.push(url.to_string());
                    }
                }
                _ => panic!(
                    "kvroute-sim did not print its {} engines within {SIM_START_LIMIT_MS} ms \
                     (got {engines:?}); log:\n{}",
                    options.engines,
                    tail(&log)
                ),
            }
        }
        SimProcess {
            child,
            engines,
            options,
            log,
        }
    }

    /// `URL@model` of every engine, for `--worker-urls`.
    pub fn worker_specs(&self) -> Vec<String> {
        self.engines
            .iter()
            .map(|u| format!("{u}@{}", self.options.model))
            .collect()
    }

    /// Stores `chains` on `engine`'s `rank` as if prefilled: one batch; returns its seq.
    pub async fn store(&self, engine: usize, rank: usize, chains: &[Vec<u32>]) -> i64 {
        let url = format!("{}/control/store", self.engines[engine]);
        let (status, v) = post_json(&url, &json!({"chains": chains, "dp_rank": rank}))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, 200, "POST {url}: {v}");
        v["last_seq"].as_i64().expect("last_seq")
    }

    /// Withholds the next `batches` batches of `engine`'s `rank` from its PUB (still replayable).
    pub async fn drop_next(&self, engine: usize, rank: usize, batches: u64) {
        let url = format!("{}/control/drop_next", self.engines[engine]);
        let (status, v) = post_json(&url, &json!({"dp_rank": rank, "batches": batches}))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, 200, "POST {url}: {v}");
    }

    /// Arms `requests` stalls of `stall_ms` on `engine` (`at` = `head` or `body`, see
    /// `kvroute_sim::faults`).
    pub async fn stall(&self, engine: usize, at: &str, requests: u64, stall_ms: u64) {
        let url = format!("{}/control/stall", self.engines[engine]);
        let (status, v) = post_json(
            &url,
            &json!({"at": at, "requests": requests, "stall_ms": stall_ms}),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, 200, "POST {url}: {v}");
    }

    /// `engine`'s fault counters from `/served_stats` (`head_stalls_applied`, ...).
    pub async fn fault_counts(&self, engine: usize) -> Value {
        let url = format!("{}/served_stats", self.engines[engine]);
        get_json(&url).await.unwrap_or_else(|e| panic!("{e}"))["faults"].clone()
    }

    /// An engine restart on one rank: empty cache, seq from 0, empty replay buffer.
    pub async fn restart_publisher(&self, engine: usize, rank: usize) {
        let url = format!("{}/control/restart_publisher", self.engines[engine]);
        let (status, v) = post_json(&url, &json!({"dp_rank": rank}))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, 200, "POST {url}: {v}");
    }

    /// Each engine's `GET /control/cache`: blocks and `last_seq` per rank, read under each
    /// rank's lock.
    pub async fn truth(&self) -> Truth {
        let mut t = Truth::default();
        for url in &self.engines {
            let v = get_json(&format!("{url}/control/cache"))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            t.add_engine(url, &v);
        }
        t
    }
}

/// The engines' true caches and how far each rank's stream has gone.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Truth {
    pub view: IndexView,
    /// `(worker_url, dp_rank) -> last_seq` (-1 before the first batch).
    pub last_seq: std::collections::BTreeMap<(String, u32), i64>,
}

impl Truth {
    fn add_engine(&mut self, url: &str, v: &Value) {
        for r in v["ranks"].as_array().expect("ranks") {
            let rank = r["dp_rank"].as_u64().expect("dp_rank") as u32;
            self.last_seq.insert(
                (url.to_string(), rank),
                r["last_seq"].as_i64().expect("last_seq"),
            );
            self.view
                .add_truth_rank(url, rank, r["blocks"].as_array().expect("blocks"));
        }
    }

    pub fn merge(&mut self, other: Truth) {
        self.last_seq.extend(other.last_seq);
        self.view.merge(other.view);
    }

    /// Only the ranks of the workers in `urls`.
    pub fn restricted_to(&self, urls: &[String]) -> Truth {
        Truth {
            view: self.view.restricted_to(urls),
            last_seq: self
                .last_seq
                .iter()
                .filter(|((u, _), _)| urls.contains(u))
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
        }
    }
}
