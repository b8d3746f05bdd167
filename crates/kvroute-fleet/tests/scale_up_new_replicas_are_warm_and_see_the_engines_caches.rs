//! Scale-up (issue 16): two warm replicas serve two engines of different encodings (SGLang and
//! vLLM, one with a small cache so evictions put removals in the stream) while the harness keeps
//! engines publishing; two replicas are added, one finding its siblings through the static list
//! and one through the DNS source. Both must settle `warm` on every rank (the snapshot spliced
//! UNDER the live stream, proven by sequence numbers), and once every cursor has reached every
//! engine's `last_seq`, all four views must equal the engines' true caches.

use std::sync::Arc;

use kvroute_fleet::traffic::EventDriver;
use kvroute_fleet::{Fleet, RouterOptions, RouterProcess, SimOptions, SimProcess, scenario_lock};

/// The new replicas must not need it: they find a warm sibling on the first pass.
const BOOTSTRAP_TIMEOUT_MS: u64 = 15_000;
const READY_LIMIT_MS: u64 = 20_000;
/// Spacing of the event driver's control requests.
const EVENT_PERIOD_MS: u64 = 5;
/// Batches stored before the new replicas start, so there is a warm index to inherit.
const PRELOAD_BATCHES: u64 = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_added_to_a_warm_fleet_settle_warm_and_match_the_engines() {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    fleet.sims.push(Arc::new(
        SimProcess::start(SimOptions {
            encoding: "sglang",
            capacity_blocks: 48,
            ..SimOptions::default()
        })
        .await,
    ));
    fleet.sims.push(Arc::new(
        SimProcess::start(SimOptions {
            encoding: "vllm",
            hash_seed: 1_000,
            ..SimOptions::default()
        })
        .await,
    ));
    let workers = fleet.worker_specs();
    let ranks = fleet.rank_count();

    // The warm fleet: r1 is the first replica (no peers), r2 bootstraps from it.
    let r1 = RouterProcess::start(RouterOptions::new("r1", &workers, BOOTSTRAP_TIMEOUT_MS)).await;
    r1.wait_ready(READY_LIMIT_MS).await;
    r1.wait_subscribed(ranks, READY_LIMIT_MS).await;
    let r2 = RouterProcess::start(
        RouterOptions::new("r2", &workers, BOOTSTRAP_TIMEOUT_MS)
            .with_peers(vec![r1.internal.clone()]),
    )
    .await;
    let r1_dns = format!("localhost:{}", r1.internal_port);
    fleet.routers.push(r1);
    fleet.routers.push(r2);
    fleet.routers[1].wait_ready(READY_LIMIT_MS).await;

    let driver = EventDriver::start(fleet.sims.clone(), 1, EVENT_PERIOD_MS);
    kvroute_fleet::wait_until("the preload batches", READY_LIMIT_MS, || async {
        if driver.published() >= PRELOAD_BATCHES {
            Ok(())
        } else {
            Err(format!("{} published", driver.published()))
        }
    })
    .await;

    // Scale up while the engines keep publishing.
    let peers = fleet.peer_urls();
    let r3 = RouterProcess::start(
        RouterOptions::new("r3", &workers, BOOTSTRAP_TIMEOUT_MS).with_peers(peers),
    )
    .await;
    let r4 = RouterProcess::start(
        RouterOptions::new("r4", &workers, BOOTSTRAP_TIMEOUT_MS).with_peer_dns(r1_dns),
    )
    .await;
    for r in [&r3, &r4] {
        let outcomes = r.wait_settled(ranks, READY_LIMIT_MS).await;
        assert!(
            outcomes
                .iter()
                .all(|s| s.outcome.as_deref() == Some("warm")),
            "{} did not settle warm on every rank: {outcomes:?}\n{}",
            r.name,
            r.log_tail()
        );
        let ready = r.wait_ready(READY_LIMIT_MS).await;
        eprintln!("{} ready {ready:?} after spawn", r.name);
    }
    let published = driver.stop().await;
    assert!(
        published > PRELOAD_BATCHES,
        "events flowed during the bootstrap"
    );
    fleet.routers.push(r3);
    fleet.routers.push(r4);

    let truth = fleet.assert_views_equal_truth(None).await;
    eprintln!(
        "4 replicas equal the engines' caches: {} blocks carried over {} ranks, {published} batches",
        truth.view.carried(),
        truth.view.ranks.len()
    );
}
