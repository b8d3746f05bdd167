//! A fresh engine started after the routers (issue 16): two replicas that both bootstrap (each
//! lists the other) serve an engine with content; then a second engine starts, empty, and is
//! registered on both at run time (`POST /workers`, the path engine discovery takes). Its ranks
//! must settle `empty` (every sibling names them empty) or `from_origin` (their stream began at
//! seq 0 while held) within a small fraction of the bootstrap deadline: replicas that waited on
//! each other would sit at the deadline instead. Afterwards the new engine's events flow into
//! both views, which must equal the engines' caches.

use std::sync::Arc;
use std::time::Instant;

use kvroute_fleet::traffic::chain;
use kvroute_fleet::{Fleet, SimOptions, SimProcess, scenario_lock};

/// Long on purpose: settling anywhere near it would be the failure this test exists to catch.
const BOOTSTRAP_TIMEOUT_MS: u64 = 30_000;
/// The bound the fresh engine's ranks must settle within, from its registration.
const FRESH_SETTLE_MAX_MS: u64 = 5_000;
const READY_LIMIT_MS: u64 = 40_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_engine_registered_on_bootstrapping_replicas_settles_promptly() {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    let old = Arc::new(SimProcess::start(SimOptions::default()).await);
    fleet.sims.push(old.clone());
    // Both replicas list each other, so both run the bootstrap for every registration.
    fleet
        .start_replicas_listing_each_other(2, BOOTSTRAP_TIMEOUT_MS, READY_LIMIT_MS)
        .await;
    for i in 0..8 {
        old.store(0, (i % 2) as usize, &[chain(i, 3, 16)]).await;
    }

    let fresh = Arc::new(
        SimProcess::start(SimOptions {
            hash_seed: 5_000,
            ..SimOptions::default()
        })
        .await,
    );
    let spec = fresh.worker_specs().remove(0);
    let registered = Instant::now();
    for r in &fleet.routers {
        r.register_worker(&spec).await;
    }
    for r in &fleet.routers {
        let ranks = r.wait_settled(4, FRESH_SETTLE_MAX_MS).await;
        let took = registered.elapsed();
        let fresh_ranks: Vec<_> = ranks.iter().filter(|s| spec.starts_with(&s.url)).collect();
        assert_eq!(fresh_ranks.len(), 2, "{ranks:?}");
        for s in &fresh_ranks {
            assert!(
                matches!(s.outcome.as_deref(), Some("empty" | "from_origin")),
                "{}: the fresh engine's rank settled {:?}\n{}",
                r.name,
                s.outcome,
                r.log_tail()
            );
        }
        eprintln!(
            "{}: fresh engine settled {took:?} after registration: {fresh_ranks:?}",
            r.name
        );
    }
    fleet.sims.push(fresh.clone());
    for i in 0..8 {
        fresh.store(0, (i % 2) as usize, &[chain(i, 4, 16)]).await;
    }
    fleet.assert_views_equal_truth(None).await;
}

/// The counterpart: an engine that ALREADY holds blocks, registered on both replicas at once.
/// Each replica holds the engine's ranks while it bootstraps them, so neither knows anything
/// about them; a replica that named such a rank "empty" to its sibling would make the sibling
/// settle `empty` and run blind to everything the engine holds, although the engine's replay
/// buffer (reaching back to seq 0) could rebuild it exactly. The ranks must end up with what
/// the engine holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_content_registered_on_bootstrapping_replicas_is_not_taken_as_empty() {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    let old = Arc::new(SimProcess::start(SimOptions::default()).await);
    fleet.sims.push(old.clone());
    fleet
        .start_replicas_listing_each_other(2, BOOTSTRAP_TIMEOUT_MS, READY_LIMIT_MS)
        .await;
    // The first engine's events give both indexes cursors, so each replica serves its sibling
    // a snapshot (a replica without any cursor answers 503 and is simply cold).
    for i in 0..8 {
        old.store(0, (i % 2) as usize, &[chain(i, 3, 16)]).await;
    }
    let first = fleet.truth().await;
    for r in &fleet.routers {
        kvroute_fleet::fleet::wait_caught_up(r, &first).await;
    }
    let late = Arc::new(
        SimProcess::start(SimOptions {
            hash_seed: 6_000,
            ..SimOptions::default()
        })
        .await,
    );
    for i in 0..8 {
        late.store(0, (i % 2) as usize, &[chain(i, 5, 16)]).await;
    }
    let spec = late.worker_specs().remove(0);
    for r in &fleet.routers {
        r.register_worker(&spec).await;
    }
    fleet.sims.push(late.clone());
    for r in &fleet.routers {
        let ranks = r.wait_settled(4, READY_LIMIT_MS).await;
        eprintln!("{}: {ranks:?}", r.name);
        for s in ranks.iter().filter(|s| spec.starts_with(&s.url)) {
            assert_ne!(
                s.outcome.as_deref(),
                Some("empty"),
                "{}: a rank whose engine holds blocks settled `empty`\n{}",
                r.name,
                r.log_tail()
            );
        }
    }
    fleet.assert_views_equal_truth(None).await;
}
