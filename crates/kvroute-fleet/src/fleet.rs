//! A fleet: the sim processes, the router replicas, and the two things every scenario ends
//! with: settling (every replica's cursor provably at each engine's `last_seq`, then canonical
//! views compared with the engines' true caches) and the surge-only rolling update.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::engine::{SimProcess, Truth};
use crate::router::{ROUTER_EXIT_LIMIT_MS, RouterOptions, RouterProcess};
use crate::traffic::Rotation;
use crate::view::IndexView;
use crate::wait::try_wait_until;

/// How long every replica may take to catch up with the engines once the drivers stopped.
pub const SETTLE_LIMIT_MS: u64 = 20_000;
/// How long a replica started by the rolling update may take to become ready.
pub const ROLLOUT_READY_LIMIT_MS: u64 = 30_000;

/// Serialises the scenarios of one test process (see the crate doc: timing bounds on two cores).
/// An async mutex because the guard is held across the whole scenario; it has no poisoning, so
/// a failed scenario does not fail the next one for a second reason.
pub async fn scenario_lock() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// One replaced replica of a rolling update.
#[derive(Debug, Clone)]
pub struct RolloutStep {
    pub old: String,
    pub new: String,
    /// From the new replica's spawn to its `/readyz` 200.
    pub new_ready_after: Duration,
}

#[derive(Default)]
pub struct Fleet {
    pub sims: Vec<Arc<SimProcess>>,
    pub routers: Vec<RouterProcess>,
}

impl Fleet {
    pub fn new() -> Fleet {
        Fleet::default()
    }

    /// `--worker-urls` of every engine of every sim process.
    pub fn worker_specs(&self) -> Vec<String> {
        self.sims.iter().flat_map(|s| s.worker_specs()).collect()
    }

    /// Every engine rank.
    pub fn rank_count(&self) -> usize {
        self.sims
            .iter()
            .map(|s| s.engines.len() * s.options.dp_size)
            .sum()
    }

    /// Internal URLs of the running replicas, for a new replica's `--kv-peers`.
    pub fn peer_urls(&self) -> Vec<String> {
        self.routers.iter().map(|r| r.internal.clone()).collect()
    }

    pub async fn truth(&self) -> Truth {
        let mut t = Truth::default();
        for s in &self.sims {
            t.merge(s.truth().await);
        }
        t
    }

    /// Rule 2 of the crate doc: with every driver stopped, reads the truth, waits until every
    /// replica's cursor equals each engine rank's `last_seq`, reads the truth again (it must not
    /// have moved: nothing was in flight) and returns it.
    pub async fn settle(&self) -> Truth {
        let truth = self.truth().await;
        for r in &self.routers {
            wait_caught_up(r, &truth).await;
        }
        let again = self.truth().await;
        assert_eq!(
            again.last_seq, truth.last_seq,
            "the engines published while the fleet settled: a driver is still running"
        );
        truth
    }

    /// Settles, then asserts every replica's view equals the engines' caches (restricted to
    /// `urls` when given: ranks deliberately left cold are not compared).
    pub async fn assert_views_equal_truth(&self, urls: Option<&[String]>) -> Truth {
        let truth = self.settle().await;
        let want = match urls {
            Some(u) => truth.view.restricted_to(u),
            None => truth.view.clone(),
        };
        assert!(
            want.carried() > 0,
            "a comparison of empty views proves nothing"
        );
        for r in &self.routers {
            let mut have = r.view().await.unwrap_or_else(|e| panic!("{e}"));
            if let Some(u) = urls {
                have = have.restricted_to(u);
            }
            let diff = have.diff(&want);
            assert!(
                diff.is_empty(),
                "{}'s index differs from the engines' caches:\n{diff}\n{}",
                r.name,
                r.log_tail()
            );
        }
        truth
    }

    /// Surge-only rolling update (a Deployment with maxSurge 1, maxUnavailable 0): for each
    /// replica running now, start a new one (options from `make`, given the internal URLs of
    /// every replica running at that moment), wait for its `/readyz`, put it in `rotation`, take
    /// the old one out of `rotation`, SIGTERM it and wait until it exited.
    pub async fn rolling_update(
        &mut self,
        rotation: Option<&Rotation>,
        mut make: impl FnMut(usize, Vec<String>) -> RouterOptions,
    ) -> Vec<RolloutStep> {
        let olds: Vec<String> = self.routers.iter().map(|r| r.name.clone()).collect();
        let mut steps = Vec::new();
        for (i, old) in olds.into_iter().enumerate() {
            let opts = make(i, self.peer_urls());
            let new = RouterProcess::start(opts).await;
            let ready = new.wait_ready(ROLLOUT_READY_LIMIT_MS).await;
            if let Some(rot) = rotation {
                rot.add(&new.base);
            }
            let new_name = new.name.clone();
            self.routers.push(new);
            let pos = self
                .routers
                .iter()
                .position(|r| r.name == old)
                .expect("the old replica is still in the fleet");
            let mut gone = self.routers.remove(pos);
            if let Some(rot) = rotation {
                rot.retire(&gone.base).await;
            }
            gone.sigterm();
            let status = gone.wait_exit(ROUTER_EXIT_LIMIT_MS).await;
            assert!(
                status.success(),
                "{old} exited with {status} after SIGTERM\n{}",
                gone.log_tail()
            );
            steps.push(RolloutStep {
                old,
                new: new_name,
                new_ready_after: ready,
            });
        }
        steps
    }

    /// Starts `count` replicas (`r0`, `r1`, ...) on fixed ports, each listing all of them as
    /// `--kv-peers` (itself included: a replica never fetches from itself), so every one runs
    /// the bootstrap for every registration; waits until each is ready and subscribed to every
    /// engine rank.
    pub async fn start_replicas_listing_each_other(
        &mut self,
        count: usize,
        bootstrap_timeout_ms: u64,
        ready_limit_ms: u64,
    ) {
        let workers = self.worker_specs();
        let ports: Vec<(u16, u16)> = (0..count)
            .map(|_| (crate::router::free_port(), crate::router::free_port()))
            .collect();
        let peers: Vec<String> = ports
            .iter()
            .map(|p| RouterProcess::internal_url(p.1))
            .collect();
        for (i, (public, internal)) in ports.iter().enumerate() {
            let r = RouterProcess::start(
                RouterOptions::new(&format!("r{i}"), &workers, bootstrap_timeout_ms)
                    .with_peers(peers.clone())
                    .with_ports(*public, *internal),
            )
            .await;
            self.routers.push(r);
        }
        let ranks = self.rank_count();
        for r in &self.routers {
            r.wait_ready(ready_limit_ms).await;
            r.wait_subscribed(ranks, ready_limit_ms).await;
        }
    }

    /// The router named `name`.
    pub fn router(&self, name: &str) -> &RouterProcess {
        self.routers
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("no router named {name}"))
    }
}

/// Waits until `r`'s cursor for every engine rank equals `truth`'s `last_seq` (a rank that never
/// published has no cursor).
pub async fn wait_caught_up(r: &RouterProcess, truth: &Truth) {
    let started = Instant::now();
    let mut probe = || async {
        let cursors = r.cursors().await?;
        let behind: Vec<String> = truth
            .last_seq
            .iter()
            .filter(|(k, seq)| **seq >= 0 && cursors.get(*k) != Some(*seq))
            .map(|((u, d), seq)| {
                format!(
                    "{u}#{d}: at {:?}, engine at {seq}",
                    cursors.get(&(u.clone(), *d))
                )
            })
            .collect();
        if behind.is_empty() {
            Ok(())
        } else {
            Err(behind.join("; "))
        }
    };
    if let Err(seen) = try_wait_until(SETTLE_LIMIT_MS, &mut probe).await {
        panic!(
            "{} did not catch up with the engines within {SETTLE_LIMIT_MS} ms ({:?}): {seen}\n\
             ranks: {:?}\n{}",
            r.name,
            started.elapsed(),
            r.rank_statuses().await,
            r.log_tail()
        );
    }
}

/// Asserts that every replica in `names` has the same view (after [`Fleet::settle`]).
pub async fn assert_same_views(routers: &[&RouterProcess]) -> IndexView {
    let first = routers[0].view().await.unwrap_or_else(|e| panic!("{e}"));
    for r in &routers[1..] {
        let v = r.view().await.unwrap_or_else(|e| panic!("{e}"));
        let diff = v.diff(&first);
        assert!(
            diff.is_empty(),
            "{} and {} see different indexes:\n{diff}",
            r.name,
            routers[0].name
        );
    }
    first
}

/// Waits until every replica in `routers` answers `/readyz` 200, polling them all together so
/// each one's time is when IT first turned ready (readiness latches); returns, per replica, the
/// time from its spawn to that first 200.
pub async fn wait_all_ready(routers: &[&RouterProcess], limit_ms: u64) -> Vec<Duration> {
    let ready: Mutex<Vec<Option<Duration>>> = Mutex::new(vec![None; routers.len()]);
    let ready = &ready;
    let mut probe = || async move {
        let mut waiting = Vec::new();
        for (i, r) in routers.iter().enumerate() {
            if ready.lock().unwrap_or_else(|e| e.into_inner())[i].is_some() {
                continue;
            }
            match r.readyz().await {
                Ok(200) => {
                    ready.lock().unwrap_or_else(|e| e.into_inner())[i] =
                        Some(r.spawned_at.elapsed())
                }
                other => waiting.push(format!("{}: {other:?}", r.name)),
            }
        }
        if waiting.is_empty() {
            let v = ready.lock().unwrap_or_else(|e| e.into_inner());
            Ok(v.iter().map(|d| d.unwrap_or_default()).collect())
        } else {
            Err(waiting.join("; "))
        }
    };
    match try_wait_until(limit_ms, &mut probe).await {
        Ok(v) => v,
        Err(seen) => {
            panic!("timed out after {limit_ms} ms waiting for every replica to be ready: {seen}")
        }
    }
}
