//! Siblings that cannot seed a booting replica (issue 16), each with the outcome and `/readyz`
//! behaviour issue 14 specifies. The engine's replay buffer is kept SHORT of seq 0 here, so a
//! rank nobody seeds cannot be rebuilt from the engine either and settles `abandoned` (cold):
//! the outcome then shows exactly what the siblings gave.
//!
//! - a sibling that accepts the connection and never answers: every fetch times out, the sweep
//!   ends `timed_out` over a non-empty sibling set, which is the one case that may hold
//!   `/readyz`: it is held until the deadline, then the replica serves;
//! - one that answers garbage, one with another block size (a real replica on a real engine with
//!   32-token blocks), one still bootstrapping itself (a real replica holding its ranks): each is
//!   refused, the sweep ends `fleet_cold`, which never holds readiness, so the replica is ready
//!   long before its deadline.
//!
//! The silent and garbage siblings are the only test doubles (`kvroute_fleet::fakes`): a real
//! replica cannot be made to hang or to send a body that is not a snapshot.

use std::time::Duration;

use kvroute_fleet::fakes::FakeSibling;
use kvroute_fleet::traffic::chain;
use kvroute_fleet::{RouterOptions, RouterProcess, SimOptions, SimProcess, scenario_lock};

/// Deadline of the scenario where the deadline is what ends the search.
const SHORT_TIMEOUT_MS: u64 = 3_000;
/// Deadline of the scenarios that must end long before theirs.
const LONG_TIMEOUT_MS: u64 = 30_000;
/// "Promptly": a fleet-cold verdict comes after a pass or two, far below the long deadline.
const PROMPT_READY_MAX_MS: u64 = 8_000;
/// Margin above the deadline within which a held replica must turn ready.
const AFTER_DEADLINE_SLACK_MS: u64 = 5_000;
const READY_LIMIT_MS: u64 = 40_000;
/// Replay buffer per rank, and batches stored per rank before the replica starts: more, so the
/// buffer no longer reaches seq 0.
const REPLAY_BUFFER_BATCHES: usize = 4;
const PRELOAD_BATCHES_PER_RANK: u64 = 10;

async fn engine_past_its_origin(seed: u64, block_size: usize) -> SimProcess {
    let sim = SimProcess::start(SimOptions {
        replay_buffer_batches: REPLAY_BUFFER_BATCHES,
        hash_seed: seed,
        block_size,
        ..SimOptions::default()
    })
    .await;
    for i in 0..PRELOAD_BATCHES_PER_RANK * 2 {
        sim.store(0, (i % 2) as usize, &[chain(i, 7, block_size)])
            .await;
    }
    sim
}

fn assert_outcomes(r: &RouterProcess, ranks: &[kvroute_fleet::RankStatus], want: &str) {
    assert!(
        ranks.iter().all(|s| s.outcome.as_deref() == Some(want)),
        "{}: want every rank {want}: {ranks:?}\n{}",
        r.name,
        r.log_tail()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_that_never_answers_holds_readiness_until_the_deadline_then_the_rank_is_abandoned()
 {
    let _serial = scenario_lock().await;
    let sim = engine_past_its_origin(10, 16).await;
    let silent = FakeSibling::silent().await;
    let r = RouterProcess::start(
        RouterOptions::new("r", &sim.worker_specs(), SHORT_TIMEOUT_MS)
            .with_peers(vec![silent.url()]),
    )
    .await;
    let ready = r.wait_ready(READY_LIMIT_MS).await;
    assert!(
        ready >= Duration::from_millis(SHORT_TIMEOUT_MS)
            && ready <= Duration::from_millis(SHORT_TIMEOUT_MS + AFTER_DEADLINE_SLACK_MS),
        "{}: ready {ready:?} after spawn; the deadline is {SHORT_TIMEOUT_MS} ms\n{}",
        r.name,
        r.log_tail()
    );
    let ranks = r.wait_settled(2, READY_LIMIT_MS).await;
    assert_outcomes(&r, &ranks, "abandoned");
    assert_eq!(
        r.metric("kvroute_bootstrap_sweeps_total{verdict=\"timed_out\"}")
            .await,
        1.0
    );
    assert!(
        r.metric("kvroute_bootstrap_snapshot_fetches_total{result=\"unreachable\"}")
            .await
            >= 1.0
    );
}

/// A refusing sibling: the replica must be ready long before its deadline, every rank
/// `abandoned`, the sweep `fleet_cold`, and the fetch counted as `result`.
async fn refused_promptly(r: &RouterProcess, result: &str) {
    let ready = r.wait_ready(READY_LIMIT_MS).await;
    assert!(
        ready <= Duration::from_millis(PROMPT_READY_MAX_MS),
        "{}: ready only {ready:?} after spawn (deadline {LONG_TIMEOUT_MS} ms)\n{}",
        r.name,
        r.log_tail()
    );
    let ranks = r.wait_settled(2, READY_LIMIT_MS).await;
    assert_outcomes(r, &ranks, "abandoned");
    assert_eq!(
        r.metric("kvroute_bootstrap_sweeps_total{verdict=\"fleet_cold\"}")
            .await,
        1.0,
        "{}",
        r.log_tail()
    );
    let series = format!("kvroute_bootstrap_snapshot_fetches_total{{result=\"{result}\"}}");
    assert!(r.metric(&series).await >= 1.0, "{series}\n{}", r.log_tail());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_that_answers_garbage_is_rejected_and_never_holds_readiness() {
    let _serial = scenario_lock().await;
    let sim = engine_past_its_origin(20, 16).await;
    let garbage = FakeSibling::garbage().await;
    let r = RouterProcess::start(
        RouterOptions::new("r", &sim.worker_specs(), LONG_TIMEOUT_MS)
            .with_peers(vec![garbage.url()]),
    )
    .await;
    refused_promptly(&r, "rejected").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_with_another_block_size_is_rejected_and_never_holds_readiness() {
    let _serial = scenario_lock().await;
    let sim = engine_past_its_origin(30, 16).await;
    // A real replica of another fleet: 32-token blocks, with an index that has cursors.
    let other = engine_past_its_origin(31, 32).await;
    let wide = RouterProcess::start(RouterOptions::new(
        "wide",
        &other.worker_specs(),
        LONG_TIMEOUT_MS,
    ))
    .await;
    wide.wait_ready(READY_LIMIT_MS).await;
    wide.wait_subscribed(2, READY_LIMIT_MS).await;
    for i in 0..2 {
        other.store(0, i, &[chain(100 + i as u64, 8, 32)]).await;
    }
    let t = other.truth().await;
    kvroute_fleet::wait_until(
        "the 32-token replica to have cursors",
        READY_LIMIT_MS,
        || async {
            let c = wide.cursors().await?;
            if t.last_seq.iter().all(|(k, s)| c.get(k) == Some(s)) {
                Ok(())
            } else {
                Err(format!("{c:?} vs {:?}", t.last_seq))
            }
        },
    )
    .await;
    let r = RouterProcess::start(
        RouterOptions::new("r", &sim.worker_specs(), LONG_TIMEOUT_MS)
            .with_peers(vec![wide.internal.clone()]),
    )
    .await;
    refused_promptly(&r, "rejected").await;
    let log = std::fs::read_to_string(&r.log).unwrap_or_default();
    assert!(
        log.contains("block size 32"),
        "the refusal names the block size:\n{}",
        r.log_tail()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_still_bootstrapping_is_not_taken_as_warm_and_never_holds_readiness() {
    let _serial = scenario_lock().await;
    let sim = engine_past_its_origin(40, 16).await;
    // A fresh engine beside it: its first batch (seq 0) settles that rank `from_origin` on the
    // bootstrapping sibling, so the sibling HAS a cursor and serves a snapshot, marked not ready.
    let fresh = SimProcess::start(SimOptions {
        hash_seed: 41,
        ..SimOptions::default()
    })
    .await;
    let mut workers = sim.worker_specs();
    workers.extend(fresh.worker_specs());
    let silent = FakeSibling::silent().await;
    let booting = RouterProcess::start(
        RouterOptions::new("booting", &workers, LONG_TIMEOUT_MS).with_peers(vec![silent.url()]),
    )
    .await;
    booting.wait_subscribed(4, READY_LIMIT_MS).await;
    kvroute_fleet::wait_until(
        "the bootstrapping sibling to have a cursor (a from_origin rank)",
        READY_LIMIT_MS,
        || async {
            // A batch 0 each attempt (a restarted publisher counts from 0 again), so a first
            // one lost to the SUB's slow join is simply sent again.
            fresh.restart_publisher(0, 0).await;
            fresh.store(0, 0, &[chain(0, 9, 16)]).await;
            let c = booting.cursors().await?;
            if c.is_empty() {
                Err("no cursor yet".into())
            } else {
                Ok(())
            }
        },
    )
    .await;
    assert_eq!(
        booting.readyz().await,
        Ok(503),
        "the sibling is still bootstrapping"
    );

    let r = RouterProcess::start(
        RouterOptions::new("r", &sim.worker_specs(), LONG_TIMEOUT_MS)
            .with_peers(vec![booting.internal.clone()]),
    )
    .await;
    refused_promptly(&r, "refused_for_now").await;
    assert_eq!(
        booting.readyz().await,
        Ok(503),
        "the sibling was still bootstrapping while it was refused"
    );
}
