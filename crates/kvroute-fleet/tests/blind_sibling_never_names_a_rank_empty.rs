//! A ready replica that joined an engine's stream mid-way is blind to what that engine stored
//! before: a rank that has been quiet since carries nothing in its index although the engine
//! holds blocks for it. Such a replica must not name the rank in its snapshot's `empty_ranks`
//! (issue 14: "a snapshot whose rank carries nothing while the producer does not list it in
//! `empty_ranks` is never taken as warm"; the converse, a blind producer listing it, would make
//! a booting sibling settle `empty` on its word). The booting sibling must instead find that no
//! sibling knows the rank, hand it to the engine at once (not at the deadline), and, since the
//! engine's small replay buffer no longer reaches seq 0, run it cold as `uncovered`.
//!
//! The rank that keeps publishing is covered by the blind replica's live view, but only from the
//! point it joined: its snapshot lists that rank in `partial_ranks`, so the booting sibling
//! settles it `warm_partial`, never `warm`, and lists it partial in turn (blindness is not
//! laundered into a whole history by one graft). A replica that saw both streams from seq 0
//! outranks the blind one: a sibling given both settles both ranks `warm` from it. And where
//! the engine's buffer still reaches seq 0, the engine outranks the blind sibling: the partial
//! graft is replaced by the engine's whole stream (`from_engine_replay`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use kvroute_fleet::router::{RouterOptions, RouterProcess};
use kvroute_fleet::traffic::chain;
use kvroute_fleet::view::RankName;
use kvroute_fleet::{Fleet, SimOptions, SimProcess, scenario_lock};

/// Long on purpose: a rank settled near it would be the search waiting for nothing.
const BOOTSTRAP_TIMEOUT_MS: u64 = 30_000;
/// The booting replica's ranks must all settle within this, from its start.
const SETTLE_MAX_MS: u64 = 8_000;
const READY_LIMIT_MS: u64 = 40_000;
/// Batches published on each rank before the blind replica starts: past the window in which a
/// router asks the engine's replay from seq 0 for a stream it saw first (16), and past the
/// engine's replay buffer, so nothing can recover them.
const EARLY_BATCHES: usize = 24;
const REPLAY_BUFFER_BATCHES: usize = 8;

/// Publishes the batches both ranks hold before the blind replica starts.
async fn publish_early_history(sim: &SimProcess) {
    for i in 0..EARLY_BATCHES {
        sim.store(0, 0, &[chain(i as u64, 2, 16)]).await;
        sim.store(0, 1, &[chain(100 + i as u64, 2, 16)]).await;
    }
}

/// A replica with no peers (no bootstrap), ready and subscribed to both ranks.
async fn start_without_peers(name: &str, workers: &[String]) -> RouterProcess {
    let router =
        RouterProcess::start(RouterOptions::new(name, workers, BOOTSTRAP_TIMEOUT_MS)).await;
    router.wait_ready(READY_LIMIT_MS).await;
    router.wait_subscribed(2, READY_LIMIT_MS).await;
    router
}

/// Waits until `router`'s cursors satisfy `reached` (described by `want`).
async fn wait_cursors(
    router: &RouterProcess,
    want: &str,
    reached: impl Fn(&BTreeMap<RankName, i64>) -> bool,
) {
    let mut probe = || async {
        let cursors = router.cursors().await?;
        if reached(&cursors) {
            Ok(())
        } else {
            Err(format!("cursors {cursors:?}, want {want}"))
        }
    };
    kvroute_fleet::wait::try_wait_until(READY_LIMIT_MS, &mut probe)
        .await
        .unwrap_or_else(|seen| panic!("{} never applied the batches: {seen}", router.name));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_joined_mid_stream_never_names_a_quiet_rank_empty() {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    let sim = Arc::new(
        SimProcess::start(SimOptions {
            replay_buffer_batches: REPLAY_BUFFER_BATCHES,
            ..SimOptions::default()
        })
        .await,
    );
    fleet.sims.push(sim.clone());
    let workers = fleet.worker_specs();
    // Started before the engine's first batch: it holds both ranks' whole histories.
    let whole = start_without_peers("whole", &workers).await;
    publish_early_history(&sim).await;
    // No peers: no bootstrap, so this replica is blind to the 24 batches of each rank.
    let blind = start_without_peers("blind", &workers).await;
    // Rank 0 keeps publishing (the blind replica gets a cursor and serves snapshots); rank 1
    // stays quiet. Another salt gives these chains their own family prefix: a chain under a
    // prefix stored before the blind replica joined would hang from blocks it never saw.
    let mut last_seq = 0;
    for i in 0..4u64 {
        last_seq = sim.store(0, 0, &[chain(200 + i, 9, 16)]).await;
    }
    for router in [&blind, &whole] {
        wait_cursors(router, &format!("rank 0 at {last_seq}"), |c| {
            c.values().any(|&seq| seq == last_seq)
        })
        .await;
    }

    let snapshot = blind
        .snapshot()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the blind replica has a cursor, so it serves a snapshot");
    let named: Vec<_> = snapshot
        .empty_ranks
        .iter()
        .map(|&r| &snapshot.ranks[r as usize])
        .collect();
    assert!(
        named.is_empty(),
        "a replica that joined mid-stream named ranks empty: {named:?}"
    );
    let statuses = blind.rank_statuses().await.unwrap();
    assert!(
        statuses.iter().all(|s| !s.history_complete),
        "joined mid-stream, yet claims a whole history: {statuses:?}"
    );
    let partial = |s: &kvroute_wire::snapshot::IndexSnapshot| -> Vec<String> {
        s.partial_ranks
            .iter()
            .map(|&r| format!("dp{}", s.ranks[r as usize].dp_rank))
            .collect()
    };
    assert_eq!(
        partial(&snapshot),
        ["dp0"],
        "the blind replica's cursor on rank 0 covers only what it saw"
    );

    let started = Instant::now();
    let booting = RouterProcess::start(
        RouterOptions::new("booting", &workers, BOOTSTRAP_TIMEOUT_MS)
            .with_peers(vec![blind.internal.clone()]),
    )
    .await;
    let ranks = booting.wait_settled(2, SETTLE_MAX_MS).await;
    eprintln!("booting settled in {:?}: {ranks:?}", started.elapsed());
    assert_eq!(
        ranks[0].outcome.as_deref(),
        Some("warm_partial"),
        "rank 0 is covered by the blind replica's live view, and only since it joined\n{}",
        booting.log_tail()
    );
    assert_eq!(
        ranks[1].outcome.as_deref(),
        Some("uncovered"),
        "rank 1: no sibling knows it and the engine's buffer cannot rebuild it\n{}",
        booting.log_tail()
    );
    let handed_on = booting
        .snapshot()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the booting replica has a cursor on rank 0");
    assert_eq!(
        partial(&handed_on),
        ["dp0", "dp1"],
        "a partial graft is handed on as partial, and so is the rank it runs cold"
    );

    // Given the blind replica and one with both whole histories, the whole one wins.
    let choosing = RouterProcess::start(
        RouterOptions::new("choosing", &workers, BOOTSTRAP_TIMEOUT_MS)
            .with_peers(vec![blind.internal.clone(), whole.internal.clone()]),
    )
    .await;
    let ranks = choosing.wait_settled(2, SETTLE_MAX_MS).await;
    let outcomes: Vec<_> = ranks.iter().map(|r| r.outcome.as_deref()).collect();
    assert_eq!(
        outcomes,
        [Some("warm"), Some("warm")],
        "the sibling with both whole histories is preferred\n{}",
        choosing.log_tail()
    );
    fleet.routers.push(whole);
    fleet.routers.push(blind);
    fleet.routers.push(booting);
    fleet.routers.push(choosing);
}

/// The same blind sibling, but the engine's replay buffer still reaches back to its first batch:
/// the booting replica grafts the blind view (the only one on offer), proves the splice, and
/// then asks the engine for its stream from seq 0, which is the rank's whole history where the
/// graft is only what the blind sibling saw. Both ranks settle `from_engine_replay`, the booting
/// replica's index equals the engine's cache exactly (the blind sibling's does not), and what it
/// hands on is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_graft_gives_way_to_the_engines_stream_while_its_buffer_reaches_seq_zero() {
    let _serial = scenario_lock().await;
    let mut fleet = Fleet::new();
    let sim = Arc::new(SimProcess::start(SimOptions::default()).await);
    fleet.sims.push(sim.clone());
    let workers = fleet.worker_specs();
    publish_early_history(&sim).await;
    let blind = start_without_peers("blind", &workers).await;
    let mut last_seq = 0;
    for i in 0..4u64 {
        last_seq = sim.store(0, 0, &[chain(200 + i, 9, 16)]).await;
        sim.store(0, 1, &[chain(300 + i, 9, 16)]).await;
    }
    wait_cursors(&blind, &format!("both ranks at {last_seq}"), |c| {
        c.len() == 2 && c.values().all(|&seq| seq == last_seq)
    })
    .await;
    let blind_snapshot = blind
        .snapshot()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the blind replica has cursors, so it serves a snapshot");
    assert_eq!(
        blind_snapshot.partial_ranks.len(),
        2,
        "the blind replica saw neither rank from seq 0: {:?}",
        blind_snapshot.partial_ranks
    );

    let booting = RouterProcess::start(
        RouterOptions::new("booting", &workers, BOOTSTRAP_TIMEOUT_MS)
            .with_peers(vec![blind.internal.clone()]),
    )
    .await;
    let ranks = booting.wait_settled(2, SETTLE_MAX_MS).await;
    for r in &ranks {
        assert_eq!(
            r.outcome.as_deref(),
            Some("from_engine_replay"),
            "dp{}: the engine's whole stream replaces the blind sibling's partial view: \
             {ranks:?}\n{}",
            r.dp_rank,
            booting.log_tail()
        );
    }
    assert!(
        booting.log_tail().contains("graft completed"),
        "the partial view was grafted before the engine replaced it\n{}",
        booting.log_tail()
    );
    let handed_on = booting
        .snapshot()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the booting replica has cursors");
    assert!(
        handed_on.partial_ranks.is_empty(),
        "the rebuilt ranks are handed on whole: {:?}",
        handed_on.partial_ranks
    );
    // Only the booting replica is compared: the blind one is meant to differ.
    fleet.routers.push(booting);
    fleet.assert_views_equal_truth(None).await;
    fleet.routers.push(blind);
}
