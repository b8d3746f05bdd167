//! Peer bootstrap through the `KvPlane` API against a real simulated engine (real ZMQ PUB/SUB and
//! replay): a second replica, registered for bootstrap while a first one is already warm, holds
//! its rank, grafts the first one's exported snapshot and ends up matching what it matches.

use std::time::Duration;

use kvroute_index::hash::{hash_token_blocks, namespace_seed};
use kvroute_index::{GraftPlan, PrefixMatch};
use kvroute_kv::bootstrap::{BootstrapEvent, GraftDisposition, GraftTarget};
use kvroute_kv::rank_state::BootstrapOutcome;
use kvroute_kv::status::BootstrapState;
use kvroute_kv::{
    KvEventsConfig, KvPlane, KvPlaneConfig, KvPlaneError, RankKey, RankStatus, fetch_worker_info,
};
use kvroute_sim::{EngineHandle, SimConfig, start_fleet};

const MODEL: &str = "m";
const WAIT_MS: u64 = 10_000;
const POLL_MS: u64 = 10;

async fn wait_until<T>(what: &str, mut check: impl FnMut() -> Result<T, String>) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(WAIT_MS);
    loop {
        match check() {
            Ok(v) => return v,
            Err(seen) if tokio::time::Instant::now() >= deadline => {
                panic!("timed out after {WAIT_MS} ms waiting for {what}; last seen: {seen}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(POLL_MS)).await,
        }
    }
}

fn status_of(plane: &KvPlane, url: &str) -> Option<RankStatus> {
    plane
        .rank_states()
        .into_iter()
        .find(|s| s.worker_url == url && s.dp_rank == 0)
}

fn new_plane() -> KvPlane {
    KvPlane::new(KvPlaneConfig::default(), &prometheus::Registry::new()).expect("plane")
}

async fn discover(engine: &EngineHandle) -> KvEventsConfig {
    fetch_worker_info(&reqwest::Client::new(), &engine.http_url())
        .await
        .expect("server_info")
        .kv_events
        .expect("the simulator advertises kv_events")
}

fn chain(tag: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 4).map(|i| tag * 10_000 + i).collect()
}

fn carried_depth(plane: &KvPlane, url: &str, tokens: &[u32]) -> u32 {
    let Some(view) = plane.model_view(MODEL) else {
        return 0;
    };
    let mut hashes = Vec::new();
    hash_token_blocks(
        tokens,
        view.block_size as usize,
        namespace_seed(None, None),
        &mut hashes,
    );
    let Some((id, _)) = view
        .reader
        .ranks()
        .into_iter()
        .find(|(_, r)| r.worker_url == url && r.dp_rank == 0)
    else {
        return 0;
    };
    let mut out = PrefixMatch::new();
    view.reader.match_prefix(&hashes, &mut out);
    out.get(id).map_or(0, |m| m.matched_blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_bootstrapping_beside_a_warm_one_grafts_its_snapshot_and_matches_like_it() {
    let fleet = start_fleet(SimConfig {
        block_size: 4,
        ..SimConfig::for_tests()
    })
    .await
    .expect("fleet");
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let warm = new_plane();
    warm.add_worker(&url, MODEL, discover(engine).await)
        .await
        .expect("add");
    // Chains the engine stores before the second replica exists: only a graft can teach them.
    let early: Vec<Vec<u32>> = (1..=3).map(|t| chain(t, 5)).collect();
    let mut tag = 100;
    wait_until("the warm replica to follow the engine", || {
        tag += 1;
        engine.store_chains(0, &[chain(tag, 1)]);
        match status_of(&warm, &url) {
            Some(s) if s.cursor.is_some() => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let mut last = 0;
    for c in &early {
        last = engine.store_chains(0, std::slice::from_ref(c));
    }
    wait_until(
        "the warm replica to apply the early chains",
        || match status_of(&warm, &url) {
            Some(s) if s.cursor == Some(last) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .await;

    let booting = new_plane();
    let refused = booting
        .add_worker_bootstrapping(&url, MODEL, discover(engine).await)
        .await;
    assert!(
        matches!(refused, Err(KvPlaneError::BootstrapEventsNotTaken { .. })),
        "{refused:?}"
    );
    let mut events = booting.take_bootstrap_events().expect("first take");
    assert!(booting.take_bootstrap_events().is_none());
    let incarnation = booting
        .add_worker_bootstrapping(&url, MODEL, discover(engine).await)
        .await
        .expect("add");
    // Past the slow-joiner window: publish until the booting replica holds something.
    wait_until("the booting replica to hold a live batch", || {
        tag += 1;
        engine.store_chains(0, &[chain(tag, 1)]);
        match status_of(&booting, &url) {
            Some(s) if s.held_batches > 0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let status = status_of(&booting, &url).expect("status");
    assert_eq!(status.bootstrap, BootstrapState::Holding);
    assert_eq!(status.cursor, None);
    for c in &early {
        assert_eq!(carried_depth(&booting, &url, c), 0, "held batches applied");
    }

    let view = warm.model_view(MODEL).expect("warm index");
    let mut snapshot = view.reader.export_snapshot();
    snapshot.producer_ready = true;
    let plan = GraftPlan::new(snapshot, view.block_size, |_| true).expect("valid snapshot");
    let key = RankKey {
        url: url.as_str().into(),
        dp_rank: 0,
    };
    let receipt = booting
        .graft(
            MODEL,
            plan,
            vec![GraftTarget {
                key: key.clone(),
                incarnation,
            }],
        )
        .await
        .expect("graft");
    assert_eq!(receipt.ranks, vec![(key.clone(), GraftDisposition::Taken)]);
    let event = tokio::time::timeout(Duration::from_millis(WAIT_MS), events.recv())
        .await
        .expect("an event in time")
        .expect("channel open");
    assert_eq!(
        event,
        BootstrapEvent::Finished {
            key,
            incarnation,
            outcome: BootstrapOutcome::Warm
        }
    );
    let last = engine.store_chains(0, &[chain(999, 2)]);
    wait_until("both replicas to apply the last chain", || {
        match (status_of(&warm, &url), status_of(&booting, &url)) {
            (Some(a), Some(b)) if a.cursor == Some(last) && b.cursor == Some(last) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    for c in early.iter().chain([&chain(999, 2)]) {
        assert_eq!(
            carried_depth(&booting, &url, c),
            carried_depth(&warm, &url, c),
            "chain {:?}",
            &c[..1]
        );
        assert!(carried_depth(&booting, &url, c) > 0);
    }
    let (a, b) = (
        warm.model_view(MODEL).unwrap().reader.total_carried(),
        booting.model_view(MODEL).unwrap().reader.total_carried(),
    );
    assert_eq!(a, b, "the replicas carry different block counts");
    assert_eq!(
        status_of(&booting, &url).unwrap().bootstrap,
        BootstrapState::Settled(BootstrapOutcome::Warm)
    );
    booting.shutdown().await;
    warm.shutdown().await;
    fleet.shutdown().await;
}
