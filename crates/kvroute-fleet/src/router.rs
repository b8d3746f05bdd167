//! A `kvroute` replica as an OS process, and the views a scenario reads from it.
//!
//! Each replica gets its own public and internal port on loopback and advertises its internal
//! URL (`--advertise-url`), so a static sibling list can be the same for every replica and
//! self-exclusion is the router's own rule. Only the public surfaces are read: `/readyz`,
//! `/workers` (per-rank bootstrap state and outcome), `/metrics`, and the internal listener's
//! `/internal/kv_cursors` and `/internal/kv_snapshot` (the index itself, as JSON with
//! `max_age_ms=0`, so the view is never a cached export).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvroute_snapshot::DecodeLimits;
use kvroute_wire::snapshot::IndexSnapshot;
use serde_json::{Value, json};

use crate::bins::binaries;
use crate::http::{client, get_json, get_status, get_text, post_json};
use crate::logs::{log_file, tail};
use crate::view::{IndexView, RankName};
use crate::wait::try_wait_until;

/// How long a replica may take to answer `/healthz` after it was spawned.
pub const ROUTER_START_LIMIT_MS: u64 = 20_000;
/// Spawn attempts when the OS hands the picked port to someone else in between (other tests
/// on this machine pick ports too).
pub const ROUTER_SPAWN_ATTEMPTS_MAX: usize = 3;
/// How long a SIGTERM'd replica may take to drain and exit.
pub const ROUTER_EXIT_LIMIT_MS: u64 = 15_000;
/// `--health-interval-ms` of every replica: health checks are not what these scenarios test,
/// and a probe of a busy engine on a loaded 2-core machine must not eject it mid-scenario.
pub const HEALTH_INTERVAL_MS: u64 = 60_000;

/// Lowest port [`free_port`] picks.
pub const FREE_PORT_LOW: u16 = 10_000;
/// [`free_port`] picks below this, the start of Linux's ephemeral range: a port the OS hands out
/// for port 0 is also one it hands to the next outgoing connection, so a port picked there for a
/// replica started later (a static peer list names every replica before any starts) was taken in
/// between by another test's connection often enough to fail CI runs. Below it only listeners
/// hold ports (the simulator probes there for the same reason: `kvroute_sim::publish`).
pub const FREE_PORT_HIGH: u16 = 32_768;
/// Random ports tried before letting the OS choose one.
pub const FREE_PORT_ATTEMPTS_MAX: usize = 64;

/// A port that was free a moment ago (bound and released), picked at random below the ephemeral
/// range; the OS's own choice when none there was free.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    for _ in 0..FREE_PORT_ATTEMPTS_MAX {
        // Each `RandomState` is freshly keyed: a random number without a dependency.
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let span = u64::from(FREE_PORT_HIGH - FREE_PORT_LOW);
        let port = FREE_PORT_LOW + (random % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// How to start a replica.
#[derive(Debug, Clone, Default)]
pub struct RouterOptions {
    /// For log file names and messages.
    pub name: String,
    /// `--worker-urls` (`URL@model`).
    pub workers: Vec<String>,
    /// `--kv-peers`: siblings' internal base URLs (this replica's own is excluded by the router).
    pub peers: Vec<String>,
    /// `--kv-peer-dns NAME:PORT` instead of a static list.
    pub peer_dns: Option<String>,
    /// `--kv-bootstrap-timeout-ms`.
    pub bootstrap_timeout_ms: u64,
    /// `--kv-bootstrap-seed-required`.
    pub seed_required: bool,
    /// Fixed (public, internal) ports, for fleets whose static lists must name replicas that are
    /// not started yet; `None` picks free ones.
    pub ports: Option<(u16, u16)>,
    pub extra_args: Vec<String>,
}

impl RouterOptions {
    pub fn new(name: &str, workers: &[String], bootstrap_timeout_ms: u64) -> RouterOptions {
        RouterOptions {
            name: name.to_string(),
            workers: workers.to_vec(),
            bootstrap_timeout_ms,
            ..RouterOptions::default()
        }
    }

    pub fn with_peers(mut self, peers: Vec<String>) -> RouterOptions {
        self.peers = peers;
        self
    }

    /// The DNS source instead of a static list. The replica then advertises no URL: the DNS
    /// source excludes its own IP, and on loopback every sibling shares 127.0.0.1, so an
    /// advertised URL would exclude them all. (The name's port is the sibling's, never this
    /// replica's, so it cannot find itself.)
    pub fn with_peer_dns(mut self, name_port: String) -> RouterOptions {
        self.peer_dns = Some(name_port);
        self
    }

    pub fn with_seed_required(mut self) -> RouterOptions {
        self.seed_required = true;
        self
    }

    pub fn with_ports(mut self, public: u16, internal: u16) -> RouterOptions {
        self.ports = Some((public, internal));
        self
    }
}

/// One rank's row of `/workers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankStatus {
    pub url: String,
    pub dp_rank: u32,
    /// `off`, `holding`, `grafting`, `healing`, `proving`, `rebuilding`, `settled`.
    pub state: String,
    pub outcome: Option<String>,
    pub cursor: Option<i64>,
    pub subscriber: String,
    pub held_batches: u64,
    pub lost_batches: u64,
    pub replays: u64,
    pub publisher_restarts: u64,
    /// The router holds the rank's whole stream since its publisher's seq 0.
    pub history_complete: bool,
}

impl RankStatus {
    /// No longer bootstrapping: settled with an outcome, or registered without bootstrap.
    pub fn terminal(&self) -> bool {
        self.state == "off" || self.outcome.is_some()
    }
}

/// A running replica; killed (SIGKILL) when dropped if it is still running.
pub struct RouterProcess {
    child: Option<Child>,
    pub name: String,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// `http://127.0.0.1:<internal port>`, what siblings list.
    pub internal: String,
    pub internal_port: u16,
    pub options: RouterOptions,
    pub log: PathBuf,
    pub spawned_at: Instant,
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl RouterProcess {
    /// Internal base URL a replica on `internal_port` advertises.
    pub fn internal_url(internal_port: u16) -> String {
        format!("http://127.0.0.1:{internal_port}")
    }

    /// Starts a replica and waits until it answers `/healthz` (not `/readyz`: readiness is what
    /// the scenarios observe).
    pub async fn start(options: RouterOptions) -> RouterProcess {
        let mut last = String::new();
        for _ in 0..ROUTER_SPAWN_ATTEMPTS_MAX {
            let (port, internal_port) = options.ports.unwrap_or_else(|| (free_port(), free_port()));
            let mut r = Self::spawn(&options, port, internal_port);
            let base = r.base.clone();
            let mut probe = || {
                let exited = r.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                let base = base.clone();
                async move {
                    if let Some(status) = exited {
                        return Ok(Some(status));
                    }
                    match get_status(&format!("{base}/healthz")).await {
                        Ok(200) => Ok(None),
                        Ok(s) => Err(format!("/healthz {s}")),
                        Err(e) => Err(e),
                    }
                }
            };
            match try_wait_until(ROUTER_START_LIMIT_MS, &mut probe).await {
                Ok(None) => return r,
                Ok(Some(status)) => {
                    last = format!("exited {status}: {}", tail(&r.log));
                    r.child = None;
                    if options.ports.is_some() {
                        break;
                    }
                }
                Err(seen) => {
                    last = format!("no /healthz: {seen}; log:\n{}", tail(&r.log));
                    break;
                }
            }
        }
        panic!("router {} did not start: {last}", options.name);
    }

    fn spawn(options: &RouterOptions, port: u16, internal_port: u16) -> RouterProcess {
        let log = log_file(&format!("router-{}", options.name));
        let stderr = std::fs::File::create(&log).expect("the router log can be created");
        let internal = Self::internal_url(internal_port);
        let mut cmd = Command::new(&binaries().kvroute);
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--internal-port", &internal_port.to_string()])
            .args(["--health-interval-ms", &HEALTH_INTERVAL_MS.to_string()])
            // Many processes share two cores: one data-plane thread each is plenty.
            .args(["--data-plane-threads", "1"])
            .args([
                "--kv-bootstrap-timeout-ms",
                &options.bootstrap_timeout_ms.to_string(),
            ]);
        if options.peer_dns.is_none() {
            cmd.args(["--advertise-url", &internal]);
        }
        if !options.workers.is_empty() {
            cmd.arg("--worker-urls").args(&options.workers);
        }
        if !options.peers.is_empty() {
            cmd.args(["--kv-peers", &options.peers.join(",")]);
        }
        if let Some(dns) = &options.peer_dns {
            cmd.args(["--kv-peer-dns", dns]);
        }
        if options.seed_required {
            cmd.arg("--kv-bootstrap-seed-required");
        }
        cmd.args(&options.extra_args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            // The router logs to stdout; both streams go to the one log file.
            .stdout(stderr.try_clone().expect("the log file handle clones"))
            .stderr(stderr);
        let child = cmd.spawn().expect("the kvroute binary starts");
        RouterProcess {
            child: Some(child),
            name: options.name.clone(),
            base: format!("http://127.0.0.1:{port}"),
            internal,
            internal_port,
            options: options.clone(),
            log,
            spawned_at: Instant::now(),
        }
    }

    /// The tail of this replica's log, for failure messages.
    pub fn log_tail(&self) -> String {
        format!(
            "--- {} ({}) ---\n{}",
            self.name,
            self.log.display(),
            tail(&self.log)
        )
    }

    pub async fn readyz(&self) -> Result<u16, String> {
        get_status(&format!("{}/readyz", self.base)).await
    }

    /// Waits for `/readyz` 200; returns the time since spawn.
    pub async fn wait_ready(&self, limit_ms: u64) -> Duration {
        let mut probe = || async {
            match self.readyz().await {
                Ok(200) => Ok(()),
                Ok(s) => Err(format!("/readyz {s}")),
                Err(e) => Err(e),
            }
        };
        if let Err(seen) = try_wait_until(limit_ms, &mut probe).await {
            panic!(
                "timed out after {limit_ms} ms waiting for {} to be ready; last seen: {seen}; \
                 ranks: {:?}\n{}",
                self.name,
                self.rank_statuses().await,
                self.log_tail()
            );
        }
        self.spawned_at.elapsed()
    }

    /// Every rank of every worker, from `/workers`, sorted by (url, dp_rank).
    pub async fn rank_statuses(&self) -> Result<Vec<RankStatus>, String> {
        let w = get_json(&format!("{}/workers", self.base)).await?;
        let mut out = Vec::new();
        for worker in w["workers"].as_array().ok_or("no workers array")? {
            let url = worker["url"].as_str().unwrap_or_default().to_string();
            for r in worker["kv_ranks"].as_array().cloned().unwrap_or_default() {
                let u = |k: &str| r[k].as_u64().unwrap_or(0);
                out.push(RankStatus {
                    url: url.clone(),
                    dp_rank: u("dp_rank") as u32,
                    state: r["bootstrap"]["state"].as_str().unwrap_or("?").into(),
                    outcome: r["bootstrap"]["outcome"].as_str().map(String::from),
                    cursor: r["cursor"].as_i64(),
                    subscriber: r["subscriber"].as_str().unwrap_or("?").into(),
                    held_batches: r["bootstrap"]["held_batches"].as_u64().unwrap_or(0),
                    lost_batches: u("lost_batches"),
                    replays: u("replays"),
                    publisher_restarts: u("publisher_restarts"),
                    history_complete: r["history_complete"].as_bool().unwrap_or(false),
                });
            }
        }
        out.sort_by(|a, b| (&a.url, a.dp_rank).cmp(&(&b.url, b.dp_rank)));
        Ok(out)
    }

    /// Waits until `ranks` ranks are listed and every one is terminal; returns them.
    pub async fn wait_settled(&self, ranks: usize, limit_ms: u64) -> Vec<RankStatus> {
        let mut probe = || async {
            let s = self.rank_statuses().await?;
            if s.len() == ranks && s.iter().all(RankStatus::terminal) {
                Ok(s)
            } else {
                Err(format!("{s:?}"))
            }
        };
        match try_wait_until(limit_ms, &mut probe).await {
            Ok(s) => s,
            Err(seen) => panic!(
                "timed out after {limit_ms} ms waiting for {}'s {ranks} ranks to settle; \
                 last seen: {seen}\n{}",
                self.name,
                self.log_tail()
            ),
        }
    }

    /// Waits until `ranks` ranks are listed with a connected KV subscriber.
    pub async fn wait_subscribed(&self, ranks: usize, limit_ms: u64) {
        let mut probe = || async {
            let s = self.rank_statuses().await?;
            if s.len() == ranks && s.iter().all(|r| r.subscriber == "connected") {
                Ok(())
            } else {
                Err(format!("{s:?}"))
            }
        };
        if let Err(seen) = try_wait_until(limit_ms, &mut probe).await {
            panic!(
                "timed out after {limit_ms} ms waiting for {}'s subscribers; last seen: {seen}",
                self.name
            );
        }
    }

    /// The index's cursors (`/internal/kv_cursors`); empty while it has none (503).
    pub async fn cursors(&self) -> Result<BTreeMap<RankName, i64>, String> {
        let url = format!("{}/internal/kv_cursors", self.internal);
        let resp = client()
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        if resp.status().as_u16() == 503 {
            return Ok(BTreeMap::new());
        }
        let v: Value = resp.json().await.map_err(|e| format!("GET {url}: {e}"))?;
        let ranks = v["ranks"].as_array().ok_or("no ranks")?;
        let mut out = BTreeMap::new();
        for c in v["cursors"].as_array().ok_or("no cursors")? {
            let r = &ranks[c["rank"].as_u64().ok_or("rank")? as usize];
            out.insert(
                (
                    r["worker_url"].as_str().unwrap_or_default().to_string(),
                    r["dp_rank"].as_u64().unwrap_or(0) as u32,
                ),
                c["seq"].as_i64().ok_or("seq")?,
            );
        }
        Ok(out)
    }

    /// The replica's whole index, freshly exported, as a canonical view.
    pub async fn view(&self) -> Result<IndexView, String> {
        // No cursor yet: an index that has applied nothing holds nothing.
        Ok(self
            .snapshot()
            .await?
            .map_or_else(IndexView::default, |s| IndexView::from_snapshot(&s)))
    }

    /// The replica's snapshot as a sibling would receive it (a fresh export, JSON); `None` while
    /// its index has no cursor (503).
    pub async fn snapshot(&self) -> Result<Option<IndexSnapshot>, String> {
        let url = format!("{}/internal/kv_snapshot?max_age_ms=0", self.internal);
        let resp = client()
            .get(&url)
            .header("accept", "application/json")
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(|e| format!("GET {url}: {e}"))?;
        if status == 503 {
            return Ok(None);
        }
        if status != 200 {
            return Err(format!(
                "GET {url}: {status}: {}",
                String::from_utf8_lossy(&bytes)
            ));
        }
        kvroute_snapshot::decode_json(&bytes, &DecodeLimits::default())
            .map(Some)
            .map_err(|e| format!("GET {url}: undecodable snapshot: {e}"))
    }

    pub async fn metrics(&self) -> String {
        get_text(&format!("{}/metrics", self.base))
            .await
            .unwrap_or_default()
    }

    /// The value of the metric line starting with `series` (e.g.
    /// `kvroute_bootstrap_sweeps_total{verdict="fleet_cold"}`), 0 when absent.
    pub async fn metric(&self, series: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(series).map(str::trim))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }

    /// `POST /workers` (registration at run time, with bootstrap when a peer source is set).
    pub async fn register_worker(&self, spec: &str) {
        let url = format!("{}/workers", self.base);
        let (status, v) = post_json(&url, &json!({"url": spec}))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, 201, "POST {url}: {v}");
    }

    /// The process id while the replica runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends SIGTERM (the kubelet's stop signal): the replica drains and exits.
    pub fn sigterm(&self) {
        if let Some(c) = &self.child {
            let pid = c.id() as libc::pid_t;
            // SAFETY: kill(2) with a pid this process spawned and has not reaped (the child is
            // waited only in `wait_exit` or Drop, which take it), so it cannot name a recycled pid.
            let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
            assert_eq!(rc, 0, "kill -TERM {pid}");
        }
    }

    /// Waits until the process exits; returns its status.
    pub async fn wait_exit(&mut self, limit_ms: u64) -> ExitStatus {
        let mut child = self.child.take().expect("the replica is running");
        let mut probe = || {
            let r = child.try_wait();
            async move {
                match r {
                    Ok(Some(s)) => Ok(s),
                    Ok(None) => Err("still running".to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
        };
        match try_wait_until(limit_ms, &mut probe).await {
            Ok(s) => s,
            Err(seen) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{} did not exit within {limit_ms} ms: {seen}\n{}",
                    self.name,
                    self.log_tail()
                )
            }
        }
    }

    /// SIGKILL now (a crash, or the whole fleet going down at once).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..8).map(|_| free_port()).collect();
        for &port in &ports {
            assert!(
                (FREE_PORT_LOW..FREE_PORT_HIGH).contains(&port),
                "{port} outside {FREE_PORT_LOW}..{FREE_PORT_HIGH}: {ports:?}"
            );
            std::net::TcpListener::bind(("127.0.0.1", port)).expect("still free");
        }
        let distinct: std::collections::HashSet<_> = ports.iter().collect();
        assert!(distinct.len() > 1, "picked at random: {ports:?}");
    }
}
