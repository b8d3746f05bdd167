//! Engine-side faults (issue 16), on real processes:
//!
//! - an engine restarts (its publisher counts from seq 0 again, its cache is empty) while a new
//!   replica is still bootstrapping that rank: the replica must settle it `from_origin` (the
//!   restarted stream begins at 0 while held: nothing before it can matter), settle the other
//!   rank `warm` once its sibling is reachable, and end with the engine's true cache;
//! - a publisher gap (the engine withholds a batch from its PUB, `/control/drop_next`): every
//!   replica heals it from the engine's replay socket, loses nothing, and ends with the true
//!   cache, including the withheld batch's blocks.
//!
//! To catch the replica MID-bootstrap deterministically, its only sibling sits behind a cut
//! proxy (`kvroute_fleet::proxy`) until the restart has been observed; then the proxy is healed.

use std::sync::Arc;

use kvroute_fleet::proxy::{Cut, CutProxy};
use kvroute_fleet::traffic::chain;
use kvroute_fleet::{Fleet, RouterOptions, RouterProcess, SimOptions, SimProcess, scenario_lock};

const BOOTSTRAP_TIMEOUT_MS: u64 = 30_000;
const READY_LIMIT_MS: u64 = 30_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_while_a_replica_bootstraps_settles_from_origin_and_ends_exact() {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    let sim = Arc::new(SimProcess::start(SimOptions::default()).await);
    fleet.sims.push(sim.clone());
    let workers = fleet.worker_specs();
    let r1 = RouterProcess::start(RouterOptions::new("r1", &workers, BOOTSTRAP_TIMEOUT_MS)).await;
    r1.wait_ready(READY_LIMIT_MS).await;
    r1.wait_subscribed(2, READY_LIMIT_MS).await;
    for i in 0..12 {
        sim.store(0, (i % 2) as usize, &[chain(i, 11, 16)]).await;
    }
    let t = fleet.truth().await;
    kvroute_fleet::fleet::wait_caught_up(&r1, &t).await;

    let proxy = CutProxy::start(&r1.internal.replace("http://", "")).await;
    proxy.set(Cut::Reject);
    let r2 = RouterProcess::start(
        RouterOptions::new("r2", &workers, BOOTSTRAP_TIMEOUT_MS).with_peers(vec![proxy.url()]),
    )
    .await;
    r2.wait_subscribed(2, READY_LIMIT_MS).await;
    // Rank 0 must be holding live batches before the engine restarts, so the restart is seen
    // mid-bootstrap (a batch 0 after held ones); each attempt stores a new chain.
    let mut attempt = 0u64;
    kvroute_fleet::wait_until("r2 to hold a live batch of rank 0", READY_LIMIT_MS, || {
        attempt += 1;
        let (sim, r2) = (&sim, &r2);
        async move {
            sim.store(0, 0, &[chain(1_000 + attempt, 11, 16)]).await;
            let s = r2.rank_statuses().await?;
            match s.iter().find(|s| s.dp_rank == 0) {
                Some(s) if s.state == "holding" && s.held_batches > 0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    sim.restart_publisher(0, 0).await;
    sim.store(0, 0, &[chain(2_000, 11, 16)]).await;
    let restarted = kvroute_fleet::wait_until("r2's rank 0 to settle", READY_LIMIT_MS, || async {
        let s = r2.rank_statuses().await?;
        match s.iter().find(|s| s.dp_rank == 0) {
            Some(s) if s.outcome.is_some() => Ok(s.clone()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        restarted.outcome.as_deref(),
        Some("from_origin"),
        "{restarted:?}\n{}",
        r2.log_tail()
    );
    assert_eq!(r2.readyz().await, Ok(503), "rank 1 is still bootstrapping");
    proxy.set(Cut::Open);
    let ranks = r2.wait_settled(2, READY_LIMIT_MS).await;
    assert_eq!(
        ranks[1].outcome.as_deref(),
        Some("warm"),
        "{ranks:?}\n{}",
        r2.log_tail()
    );
    r2.wait_ready(READY_LIMIT_MS).await;
    fleet.routers.push(r1);
    fleet.routers.push(r2);
    sim.store(0, 1, &[chain(3_000, 11, 16)]).await;
    fleet.assert_views_equal_truth(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_gap_is_healed_from_the_engine_replay_on_every_replica() {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    let sim = Arc::new(
        SimProcess::start(SimOptions {
            encoding: "vllm-map",
            ..SimOptions::default()
        })
        .await,
    );
    fleet.sims.push(sim.clone());
    let workers = fleet.worker_specs();
    let r1 = RouterProcess::start(RouterOptions::new("r1", &workers, BOOTSTRAP_TIMEOUT_MS)).await;
    r1.wait_ready(READY_LIMIT_MS).await;
    r1.wait_subscribed(2, READY_LIMIT_MS).await;
    let peers = vec![r1.internal.clone()];
    fleet.routers.push(r1);
    let r2 = RouterProcess::start(
        RouterOptions::new("r2", &workers, BOOTSTRAP_TIMEOUT_MS).with_peers(peers),
    )
    .await;
    r2.wait_ready(READY_LIMIT_MS).await;
    r2.wait_subscribed(2, READY_LIMIT_MS).await;
    fleet.routers.push(r2);
    for i in 0..6 {
        sim.store(0, (i % 2) as usize, &[chain(i, 12, 16)]).await;
    }
    let before: Vec<u64> = {
        let mut v = Vec::new();
        for r in &fleet.routers {
            v.push(r.rank_statuses().await.expect("statuses")[0].replays);
        }
        v
    };
    // The withheld batch gets its seq and sits in the replay buffer; the next one reveals the
    // gap to every subscriber.
    sim.drop_next(0, 0, 1).await;
    sim.store(0, 0, &[chain(100, 12, 16)]).await;
    sim.store(0, 0, &[chain(101, 12, 16)]).await;
    fleet.assert_views_equal_truth(None).await;
    for (r, before) in fleet.routers.iter().zip(before) {
        let s = r.rank_statuses().await.expect("statuses");
        assert!(
            s[0].replays > before && s[0].lost_batches == 0,
            "{}: the gap was healed by a replay, nothing lost: {s:?}",
            r.name
        );
    }
}
