//! Rolling update (issue 16): every replica of a 3-replica fleet is replaced one by one,
//! surge-only (start the new one, wait for its `/readyz`, take the old one out of the client's
//! rotation, SIGTERM it, wait for its exit), while the engines keep publishing and a client
//! keeps sending completions through the rotation. At the end every replica's view must equal
//! the engines' caches, and no new replica may have settled a rank on anything but a proven
//! graft: during a rollout the anchor's worst failure is a new replica inheriting an EMPTY index
//! from another new replica and calling it warm. On the legacy-encoding engine most blocks are
//! stored before the rollout and stay cached, so an empty graft would leave them missing from
//! the final view; the SGLang engine's cache is small (`EVICTING_CAPACITY_BLOCKS`), so it evicts
//! all the time and removals race with every export, hold and graft of the rollout.

use std::sync::Arc;

use kvroute_fleet::traffic::{Client, EventDriver, Rotation};
use kvroute_fleet::{Fleet, RouterOptions, RouterProcess, SimOptions, SimProcess, scenario_lock};

const BOOTSTRAP_TIMEOUT_MS: u64 = 15_000;
const READY_LIMIT_MS: u64 = 20_000;
const EVENT_PERIOD_MS: u64 = 10;
const CLIENT_PERIOD_MS: u64 = 10;
const PRELOAD_BATCHES: u64 = 60;
const REPLICAS: usize = 3;
/// Device blocks of the evicting engine's ranks: a dozen chains, so the driver's stores evict.
const EVICTING_CAPACITY_BLOCKS: usize = 48;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_surge_only_rollout_under_traffic_ends_with_every_view_equal_to_the_engines() {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    fleet.sims.push(Arc::new(
        SimProcess::start(SimOptions {
            encoding: "sglang",
            capacity_blocks: EVICTING_CAPACITY_BLOCKS,
            ..SimOptions::default()
        })
        .await,
    ));
    fleet.sims.push(Arc::new(
        SimProcess::start(SimOptions {
            encoding: "legacy",
            hash_seed: 2_000,
            ..SimOptions::default()
        })
        .await,
    ));
    let workers = fleet.worker_specs();
    let ranks = fleet.rank_count();
    let block_size = fleet.sims[0].options.block_size;

    // The initial fleet: old-0 first, each next one bootstrapping from those before it.
    for i in 0..REPLICAS {
        let r = RouterProcess::start(
            RouterOptions::new(&format!("old-{i}"), &workers, BOOTSTRAP_TIMEOUT_MS)
                .with_peers(fleet.peer_urls()),
        )
        .await;
        r.wait_ready(READY_LIMIT_MS).await;
        r.wait_subscribed(ranks, READY_LIMIT_MS).await;
        fleet.routers.push(r);
    }
    let driver = EventDriver::start(fleet.sims.clone(), 2, EVENT_PERIOD_MS);
    kvroute_fleet::wait_until("the preload batches", READY_LIMIT_MS, || async {
        if driver.published() >= PRELOAD_BATCHES {
            Ok(())
        } else {
            Err(format!("{} published", driver.published()))
        }
    })
    .await;
    let rotation = Rotation::default();
    for r in &fleet.routers {
        rotation.add(&r.base);
    }
    let client = Client::start(rotation.clone(), "m", block_size, CLIENT_PERIOD_MS);

    let steps = fleet
        .rolling_update(Some(&rotation), |i, peers| {
            RouterOptions::new(&format!("new-{i}"), &workers, BOOTSTRAP_TIMEOUT_MS)
                .with_peers(peers)
        })
        .await;
    let report = client.stop().await;
    let published = driver.stop().await;
    for s in &steps {
        eprintln!(
            "{} replaced {} (ready {:?} after spawn)",
            s.new, s.old, s.new_ready_after
        );
    }
    assert!(
        report.failures.is_empty(),
        "client requests failed during the rollout ({} ok): {:?}",
        report.ok,
        report.failures
    );
    assert!(report.ok > 0, "the client sent requests during the rollout");

    for r in &fleet.routers {
        let outcomes = r.wait_settled(ranks, READY_LIMIT_MS).await;
        assert!(
            outcomes
                .iter()
                .all(|s| s.outcome.as_deref() == Some("warm")),
            "{} settled a rank on something other than a proven graft: {outcomes:?}\n{}",
            r.name,
            r.log_tail()
        );
    }
    let truth = fleet.assert_views_equal_truth(None).await;
    eprintln!(
        "after the rollout, {} replicas equal the engines: {} blocks, {published} batches, {} requests",
        fleet.routers.len(),
        truth.view.carried(),
        report.ok
    );
}
