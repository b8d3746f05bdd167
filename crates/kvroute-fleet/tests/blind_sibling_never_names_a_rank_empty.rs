//! A ready replica that joined an engine's stream mid-way is blind to what that engine stored
//! before: a rank that has been quiet since carries nothing in its index although the engine
//! holds blocks for it. Such a replica must not name the rank in its snapshot's `empty_ranks`
//! (issue 14: "a snapshot whose rank carries nothing while the producer does not list it in
//! `empty_ranks` is never taken as warm"; the converse, a blind producer listing it, would make
//! a booting sibling settle `empty` on its word). The booting sibling must instead find that no
//! sibling knows the rank, hand it to the engine at once (not at the deadline), and, since the
//! engine's small replay buffer no longer reaches seq 0, run it cold as `uncovered`.

use std::sync::Arc;
use std::time::Instant;

use kvroute_fleet::router::{RouterOptions, RouterProcess};
use kvroute_fleet::traffic::chain;
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
    for i in 0..EARLY_BATCHES {
        sim.store(0, 0, &[chain(i as u64, 2, 16)]).await;
        sim.store(0, 1, &[chain(100 + i as u64, 2, 16)]).await;
    }
    let workers = fleet.worker_specs();
    // No peers: no bootstrap, so this replica is blind to the 24 batches of each rank.
    let blind =
        RouterProcess::start(RouterOptions::new("blind", &workers, BOOTSTRAP_TIMEOUT_MS)).await;
    blind.wait_ready(READY_LIMIT_MS).await;
    blind.wait_subscribed(2, READY_LIMIT_MS).await;
    // Rank 0 keeps publishing (the blind replica gets a cursor and serves snapshots); rank 1
    // stays quiet. Another salt gives these chains their own family prefix: a chain under a
    // prefix stored before the blind replica joined would hang from blocks it never saw.
    let mut last_seq = 0;
    for i in 0..4u64 {
        last_seq = sim.store(0, 0, &[chain(200 + i, 9, 16)]).await;
    }
    let mut probe = || async {
        let cursors = blind.cursors().await?;
        if cursors.values().any(|&c| c == last_seq) {
            Ok(())
        } else {
            Err(format!("cursors {cursors:?}, want rank 0 at {last_seq}"))
        }
    };
    kvroute_fleet::wait::try_wait_until(READY_LIMIT_MS, &mut probe)
        .await
        .unwrap_or_else(|seen| panic!("the blind replica never applied rank 0's batches: {seen}"));

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
        Some("warm"),
        "rank 0 is covered by the blind replica's live view\n{}",
        booting.log_tail()
    );
    assert_eq!(
        ranks[1].outcome.as_deref(),
        Some("uncovered"),
        "rank 1: no sibling knows it and the engine's buffer cannot rebuild it\n{}",
        booting.log_tail()
    );
    fleet.routers.push(blind);
    fleet.routers.push(booting);
}
