//! The whole router fleet restarts at once (issue 16): three replicas that list each other are
//! killed together and started together, so no replica has a warm sibling at first. Every
//! replica must be ready by the bootstrap deadline (never held past it); ranks whose engine's
//! replay buffer still reaches back to seq 0 come back exact (`from_engine_replay`, or `warm`
//! from a sibling that rebuilt them that way first; a sibling caught mid-rebuild hands them on
//! as partial, and the engine's replay then replaces that graft), ranks whose engine has trimmed
//! its buffer come back cold or partial: `abandoned` when no sibling could answer, `uncovered`
//! when a sibling answered and knows nothing of them either (it is as blind to them as this
//! replica), `warm_partial` when a sibling had already applied what the trimmed buffer still
//! held (it knows that tail, and says it is only a tail). Never `empty`: the engine holds blocks
//! for them, and a sibling names a rank empty only when it holds the rank's whole history. Which
//! path a replica takes depends on which sibling answers first, so each is accepted; what is
//! asserted is the bound and the exact views.
//!
//! With `--kv-bootstrap-seed-required` the readiness rule of issue 14 decides: siblings that all
//! answer "cold" make the sweep `fleet_cold`, a sibling that rebuilt from its engine seeds the
//! others (`found`), and neither holds readiness past the deadline. The seed-required HOLD (not
//! ready until 3x the deadline, then ready) applies to a sweep that TIMED OUT over siblings it
//! could not reach; `partitioned_replica_serves_after_the_deadline.rs` proves that bound.

use std::sync::Arc;
use std::time::Duration;

use kvroute_fleet::router::free_port;
use kvroute_fleet::traffic::chain;
use kvroute_fleet::{Fleet, RouterOptions, RouterProcess, SimOptions, SimProcess, scenario_lock};

const BOOTSTRAP_TIMEOUT_MS: u64 = 6_000;
/// From spawn to the armed deadline (registration) plus one readiness poll.
const DEADLINE_SLACK_MS: u64 = 2_000;
const READY_LIMIT_MS: u64 = 30_000;
const REPLICAS: usize = 3;
/// The trimmed engine keeps this many batches per rank and is sent more.
const SHORT_BUFFER_BATCHES: usize = 4;
const BATCHES_PER_RANK: u64 = 8;

async fn restart_whole_fleet(seed_required: bool) {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    let young = Arc::new(SimProcess::start(SimOptions::default()).await);
    let trimmed = Arc::new(
        SimProcess::start(SimOptions {
            encoding: "vllm",
            replay_buffer_batches: SHORT_BUFFER_BATCHES,
            hash_seed: 700,
            ..SimOptions::default()
        })
        .await,
    );
    fleet.sims.push(young.clone());
    fleet.sims.push(trimmed.clone());
    let workers = fleet.worker_specs();
    let ports: Vec<(u16, u16)> = (0..REPLICAS).map(|_| (free_port(), free_port())).collect();
    let peers: Vec<String> = ports
        .iter()
        .map(|p| RouterProcess::internal_url(p.1))
        .collect();
    let options = |generation: &str, i: usize| {
        let o = RouterOptions::new(&format!("{generation}-{i}"), &workers, BOOTSTRAP_TIMEOUT_MS)
            .with_peers(peers.clone())
            .with_ports(ports[i].0, ports[i].1);
        if seed_required {
            o.with_seed_required()
        } else {
            o
        }
    };

    for i in 0..REPLICAS {
        fleet
            .routers
            .push(RouterProcess::start(options("first", i)).await);
    }
    for r in &fleet.routers {
        r.wait_ready(READY_LIMIT_MS).await;
        r.wait_subscribed(4, READY_LIMIT_MS).await;
    }
    for i in 0..BATCHES_PER_RANK * 2 {
        young.store(0, (i % 2) as usize, &[chain(i, 13, 16)]).await;
        trimmed
            .store(0, (i % 2) as usize, &[chain(i, 14, 16)])
            .await;
    }
    fleet.settle().await;

    // Down together, up together, on the same addresses.
    for r in &mut fleet.routers {
        r.kill();
    }
    fleet.routers.clear();
    for i in 0..REPLICAS {
        fleet
            .routers
            .push(RouterProcess::start(options("restarted", i)).await);
    }
    let all: Vec<&RouterProcess> = fleet.routers.iter().collect();
    let ready_after = kvroute_fleet::fleet::wait_all_ready(&all, READY_LIMIT_MS).await;
    for (r, ready) in fleet.routers.iter().zip(ready_after) {
        assert!(
            ready <= Duration::from_millis(BOOTSTRAP_TIMEOUT_MS + DEADLINE_SLACK_MS),
            "{} ready only {ready:?} after spawn (deadline {BOOTSTRAP_TIMEOUT_MS} ms)\n{}",
            r.name,
            r.log_tail()
        );
        let ranks = r.wait_settled(4, READY_LIMIT_MS).await;
        for s in &ranks {
            let want: &[&str] = if young.engines.contains(&s.url) {
                &["from_engine_replay", "warm"]
            } else {
                &["abandoned", "uncovered", "warm_partial"]
            };
            assert!(
                s.outcome.as_deref().is_some_and(|o| want.contains(&o)),
                "{}: want one of {want:?}: {ranks:?}\n{}",
                r.name,
                r.log_tail()
            );
        }
        eprintln!("{} ready {ready:?} after spawn: {ranks:?}", r.name);
    }
    // Warm from the engine where its buffer reached seq 0: exactly the young engine's cache.
    fleet
        .assert_views_equal_truth(Some(&young.engines.clone()))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_fleet_restarted_at_once_is_ready_within_the_deadline_warm_from_engine_replay() {
    restart_whole_fleet(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_seed_required_a_restarted_fleet_that_is_provably_cold_is_not_held() {
    restart_whole_fleet(true).await;
}
