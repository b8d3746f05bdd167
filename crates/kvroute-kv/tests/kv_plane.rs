//! The KV plane against real simulated engines (kvroute-sim): real ZMQ PUB/SUB, real replay
//! ROUTER/DEALER, real HTTP `/server_info`. The only test double is the tiny HTTP responder in
//! `fetch_worker_info_replaces_a_wildcard_host`, because the simulator binds loopback and so never
//! advertises a wildcard host; it serves the simulator's own `/server_info` body with the host
//! rewritten to `*`.

use std::time::Duration;

use kvroute_index::PrefixMatch;
use kvroute_index::hash::{hash_token_blocks, namespace_seed};
use kvroute_kv::{
    KvEventsConfig, KvPlane, KvPlaneConfig, KvPlaneError, RankStatus, fetch_worker_info,
    kv_config_from_template,
};
use kvroute_sim::{EngineHandle, Fleet, SimConfig, start_fleet};

const MODEL: &str = "m";
const WAIT_MS: u64 = 10_000;
const POLL_MS: u64 = 10;

/// Polls `check` until it returns `Ok`, failing with what was awaited and the last thing seen.
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

fn status_of(plane: &KvPlane, url: &str, dp_rank: u32) -> Option<RankStatus> {
    plane
        .rank_states()
        .into_iter()
        .find(|s| s.worker_url == url && s.dp_rank == dp_rank)
}

async fn fleet(dp_size: usize, load_publish: bool) -> Fleet {
    let cfg = SimConfig {
        dp_size,
        load_publish,
        load_interval_ms: 20,
        block_size: 4,
        ..SimConfig::for_tests()
    };
    start_fleet(cfg).await.expect("simulated fleet starts")
}

fn new_plane() -> (KvPlane, prometheus::Registry) {
    let registry = prometheus::Registry::new();
    let plane = KvPlane::new(KvPlaneConfig::default(), &registry).expect("plane");
    (plane, registry)
}

/// A plane following `engine` (registered under its own URL) whose rank 0 has applied a batch.
async fn attached_plane(engine: &EngineHandle) -> (KvPlane, prometheus::Registry) {
    let (plane, registry) = new_plane();
    plane
        .add_worker(&engine.http_url(), MODEL, discover(engine).await)
        .await
        .expect("add");
    warm_up(&plane, engine, 0).await;
    (plane, registry)
}

async fn discover(engine: &EngineHandle) -> KvEventsConfig {
    let http = reqwest::Client::new();
    fetch_worker_info(&http, &engine.http_url())
        .await
        .expect("server_info")
        .kv_events
        .expect("the simulator advertises kv_events")
}

/// A chain of `blocks` full blocks of 4 tokens, distinct per `tag`.
fn chain(tag: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 4).map(|i| tag * 10_000 + i).collect()
}

/// Depth to which rank (`url`, `dp_rank`) carries `tokens`, per the model's index.
fn carried_depth(plane: &KvPlane, url: &str, dp_rank: u32, tokens: &[u32]) -> u32 {
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
        .find(|(_, r)| r.worker_url == url && r.dp_rank == dp_rank)
    else {
        return 0;
    };
    let mut out = PrefixMatch::new();
    view.reader.match_prefix(&hashes, &mut out);
    out.get(id).map_or(0, |m| m.matched_blocks)
}

/// Waits until the rank's cursor reaches `seq`.
async fn wait_cursor(plane: &KvPlane, url: &str, dp_rank: u32, seq: i64) -> RankStatus {
    wait_until(
        &format!("cursor of {url} rank {dp_rank} to reach {seq}"),
        || match status_of(plane, url, dp_rank) {
            Some(s) if s.cursor == Some(seq) => Ok(s),
            other => Err(format!("{other:?}")),
        },
    )
    .await
}

/// Gets past the ZMQ slow-joiner window: publishes distinct warm-up chains until one reaches the
/// plane (the first batch a rank ever sees is applied whatever its seq). Returns the seq applied.
async fn warm_up(plane: &KvPlane, engine: &EngineHandle, dp_rank: u32) -> i64 {
    warm_up_as(plane, engine, &engine.http_url(), dp_rank).await
}

/// [`warm_up`] for a worker registered under `url` (which need not be the engine's own).
async fn warm_up_as(plane: &KvPlane, engine: &EngineHandle, url: &str, dp_rank: u32) -> i64 {
    for attempt in 0..200u32 {
        let seq = engine.store_chains(dp_rank as usize, &[chain(90_000 + attempt, 1)]);
        let deadline = tokio::time::Instant::now() + Duration::from_millis(50);
        while tokio::time::Instant::now() < deadline {
            if let Some(s) = status_of(plane, url, dp_rank)
                && s.cursor == Some(seq)
            {
                return seq;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }
    panic!(
        "no warm-up batch reached the plane; status {:?}",
        status_of(plane, url, dp_rank)
    );
}

fn counter(registry: &prometheus::Registry, name: &str, label: Option<(&str, &str)>) -> f64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| {
            label.is_none_or(|(k, v)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == k && l.value() == v)
            })
        })
        .map(|m| m.get_counter().get_value())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_chain_is_carried_by_its_rank_at_full_depth() {
    let fleet = fleet(2, false).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let (plane, registry) = new_plane();
    let kv = discover(engine).await;
    assert_eq!(kv.dp_size, 2);
    plane.add_worker(&url, MODEL, kv).await.expect("add");
    warm_up(&plane, engine, 1).await;

    let tokens = chain(1, 5);
    let seq = engine.store_chains(1, std::slice::from_ref(&tokens));
    wait_cursor(&plane, &url, 1, seq).await;
    assert_eq!(carried_depth(&plane, &url, 1, &tokens), 5);
    assert_eq!(
        carried_depth(&plane, &url, 0, &tokens),
        0,
        "rank 0 never stored it"
    );
    assert!(counter(&registry, "kvroute_kv_batches_applied_total", None) >= 2.0);
    assert!(
        counter(
            &registry,
            "kvroute_kv_events_applied_total",
            Some(("type", "block_stored"))
        ) >= 5.0
    );
    let status = status_of(&plane, &url, 1).expect("rank 1 registered");
    assert_eq!(status.skipped_blocks.total(), 0, "{status:?}");
    assert_eq!(status.foreign_block_size, None, "{status:?}");
    assert_eq!(
        counter(&registry, "kvroute_kv_skipped_blocks_total", None),
        0.0
    );
    plane.shutdown().await;
    fleet.shutdown().await;
}

/// A router told the wrong block size for an engine that advertises none (vLLM with
/// `--kv-events-endpoint-template` and a wrong `--block-size`): the stream looks healthy, batches
/// apply, yet no block can be indexed. The rank must say so instead of routing blind in silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_a_foreign_block_size_are_skipped_counted_and_shown_on_the_rank() {
    let fleet = fleet(1, false).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let (plane, registry) = new_plane();
    let kv = discover(engine).await;
    let engine_block_size = kv
        .block_size
        .expect("the simulator advertises its block size");
    let misconfigured = KvEventsConfig {
        block_size: Some(engine_block_size * 2),
        ..kv
    };
    plane
        .add_worker(&url, MODEL, misconfigured)
        .await
        .expect("add");
    warm_up(&plane, engine, 0).await;

    let tokens = chain(7, 3);
    let seq = engine.store_chains(0, std::slice::from_ref(&tokens));
    let status = wait_cursor(&plane, &url, 0, seq).await;
    assert_eq!(
        status.foreign_block_size,
        Some(engine_block_size),
        "{status:?}"
    );
    // The warm-up chain's block and the three of the chain, all for the same reason.
    assert!(status.skipped_blocks.block_size >= 4, "{status:?}");
    assert_eq!(
        status.skipped_blocks.total(),
        status.skipped_blocks.block_size,
        "{status:?}"
    );
    assert_eq!(
        counter(
            &registry,
            "kvroute_kv_skipped_blocks_total",
            Some(("reason", "block_size"))
        ),
        status.skipped_blocks.block_size as f64
    );
    let view = plane.model_view(MODEL).expect("the model's index");
    assert_eq!(view.reader.total_carried(), 0, "nothing may be indexed");
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_clears_the_rank_and_reapplies_from_origin() {
    let fleet = fleet(1, false).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let (plane, registry) = attached_plane(engine).await;
    let before = chain(1, 3);
    let seq = engine.store_chains(0, std::slice::from_ref(&before));
    wait_cursor(&plane, &url, 0, seq).await;
    assert_eq!(carried_depth(&plane, &url, 0, &before), 3);

    engine.restart_publisher(0);
    let after = chain(2, 2);
    let seq = engine.store_chains(0, std::slice::from_ref(&after));
    assert_eq!(seq, 0, "the restarted publisher counts from 0");
    let status = wait_cursor(&plane, &url, 0, 0).await;
    assert_eq!(status.publisher_restarts, 1);
    assert_eq!(
        carried_depth(&plane, &url, 0, &before),
        0,
        "pre-restart blocks must be gone"
    );
    assert_eq!(carried_depth(&plane, &url, 0, &after), 2);
    assert_eq!(
        counter(&registry, "kvroute_kv_publisher_restarts_total", None),
        1.0
    );
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_batches_are_healed_by_replay_without_loss() {
    let fleet = fleet(1, false).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let (plane, registry) = attached_plane(engine).await;

    engine.drop_next(0, 2);
    let chains: Vec<Vec<u32>> = (1..=3).map(|t| chain(t, 2)).collect();
    let mut last = 0;
    for c in &chains {
        last = engine.store_chains(0, std::slice::from_ref(c));
    }
    let status = wait_cursor(&plane, &url, 0, last).await;
    for c in &chains {
        assert_eq!(
            carried_depth(&plane, &url, 0, c),
            2,
            "chain {:?} missing",
            &c[..2]
        );
    }
    assert_eq!(status.lost_batches, 0, "{status:?}");
    assert!(status.replays >= 1, "{status:?}");
    assert!(
        counter(
            &registry,
            "kvroute_kv_replays_total",
            Some(("outcome", "repaired"))
        ) >= 1.0
    );
    assert_eq!(
        counter(&registry, "kvroute_kv_lost_batches_total", None),
        0.0
    );
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_a_replay_endpoint_counts_lost_batches() {
    let fleet = fleet(1, false).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let (plane, registry) = new_plane();
    // vLLM-style configuration from a template, without a replay port.
    let port = engine.ports().kv_base;
    let kv = kv_config_from_template(
        &url,
        &format!("tcp://{{host}}:{port}"),
        None,
        Some(engine.block_size() as u32),
        1,
    )
    .expect("template");
    plane.add_worker(&url, MODEL, kv).await.expect("add");
    warm_up(&plane, engine, 0).await;

    engine.drop_next(0, 2);
    let dropped: Vec<Vec<u32>> = (1..=2).map(|t| chain(t, 2)).collect();
    for c in &dropped {
        engine.store_chains(0, std::slice::from_ref(c));
    }
    let seen = chain(3, 2);
    let last = engine.store_chains(0, std::slice::from_ref(&seen));
    let status = wait_cursor(&plane, &url, 0, last).await;
    assert_eq!(status.lost_batches, 2, "{status:?}");
    assert_eq!(status.replays, 0);
    assert_eq!(
        counter(&registry, "kvroute_kv_lost_batches_total", None),
        2.0
    );
    assert_eq!(carried_depth(&plane, &url, 0, &seen), 2);
    for c in &dropped {
        assert_eq!(carried_depth(&plane, &url, 0, c), 0);
    }
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_worker_removes_every_rank_before_returning() {
    let fleet = fleet(2, false).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let (plane, _registry) = new_plane();
    plane
        .add_worker(&url, MODEL, discover(engine).await)
        .await
        .expect("add");
    let tokens = chain(1, 3);
    for dp in 0..2 {
        warm_up(&plane, engine, dp).await;
        let seq = engine.store_chains(dp as usize, std::slice::from_ref(&tokens));
        wait_cursor(&plane, &url, dp, seq).await;
        assert_eq!(carried_depth(&plane, &url, dp, &tokens), 3);
    }
    let view = plane.model_view(MODEL).expect("model exists");
    assert_eq!(view.reader.ranks().len(), 2);

    plane.remove_worker(&url).await.expect("remove");
    // No waiting: removal is complete when the call returns.
    assert!(view.reader.ranks().is_empty(), "{:?}", view.reader.ranks());
    assert_eq!(view.reader.total_carried(), 0);
    let mut out = PrefixMatch::new();
    let mut hashes = Vec::new();
    hash_token_blocks(&tokens, 4, namespace_seed(None, None), &mut hashes);
    view.reader.match_prefix(&hashes, &mut out);
    assert!(out.ranks.is_empty(), "{:?}", out.ranks);
    assert!(plane.rank_states().is_empty());
    assert!(matches!(
        plane.remove_worker(&url).await,
        Err(KvPlaneError::WorkerNotFound { .. })
    ));
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readded_worker_gets_a_new_incarnation_and_starts_clean() {
    let fleet = fleet(1, false).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let (plane, _registry) = new_plane();
    let kv = discover(engine).await;
    let first = plane
        .add_worker(&url, MODEL, kv.clone())
        .await
        .expect("add");
    assert!(matches!(
        plane.add_worker(&url, MODEL, kv.clone()).await,
        Err(KvPlaneError::WorkerAlreadyRegistered { .. })
    ));
    warm_up(&plane, engine, 0).await;
    let old = chain(1, 2);
    let seq = engine.store_chains(0, std::slice::from_ref(&old));
    wait_cursor(&plane, &url, 0, seq).await;

    plane.remove_worker(&url).await.expect("remove");
    let second = plane.add_worker(&url, MODEL, kv).await.expect("re-add");
    assert_ne!(first, second);
    let status = status_of(&plane, &url, 0).expect("re-added rank has a status");
    assert_eq!(status.incarnation, second);
    assert_eq!(status.cursor, None, "a re-added rank starts without cursor");
    assert_eq!(
        carried_depth(&plane, &url, 0, &old),
        0,
        "nothing of the old registration survives"
    );
    // The new registration follows the live stream again.
    warm_up(&plane, engine, 0).await;
    let new = chain(2, 2);
    let seq = engine.store_chains(0, std::slice::from_ref(&new));
    wait_cursor(&plane, &url, 0, seq).await;
    assert_eq!(carried_depth(&plane, &url, 0, &new), 2);
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_size_mismatch_is_refused_and_counted() {
    let fleet = fleet(1, false).await;
    let engine = &fleet.engines[0];
    let (plane, registry) = new_plane();
    let kv = discover(engine).await;
    plane
        .add_worker(&engine.http_url(), MODEL, kv.clone())
        .await
        .expect("add");
    let other = KvEventsConfig {
        block_size: Some(kv.block_size.unwrap() * 2),
        ..kv
    };
    let err = plane
        .add_worker("http://127.0.0.1:1", MODEL, other)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            KvPlaneError::BlockSizeMismatch {
                model_block_size: 4,
                worker_block_size: 8,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        counter(&registry, "kvroute_block_size_mismatch_total", None),
        1.0
    );
    assert!(status_of(&plane, "http://127.0.0.1:1", 0).is_none());
    let no_ranks = KvEventsConfig {
        dp_size: 0,
        ..kv_config_from_template("http://127.0.0.1:2", "tcp://{host}:1", None, Some(4), 1).unwrap()
    };
    assert!(matches!(
        plane
            .add_worker("http://127.0.0.1:2", MODEL, no_ranks)
            .await,
        Err(KvPlaneError::Endpoint(_))
    ));
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_load_follows_the_load_topic() {
    let fleet = fleet(1, true).await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let (plane, _registry) = new_plane();
    let kv = discover(engine).await;
    assert!(kv.load_port_base.is_some(), "{kv:?}");
    plane.add_worker(&url, MODEL, kv).await.expect("add");
    let stat = wait_until("a load stat for rank 0", || {
        plane.engine_load(&url, 0).ok_or_else(|| "none".to_string())
    })
    .await;
    assert_eq!(
        stat.max_total_num_tokens,
        engine.engine().load_stat(0).max_total_num_tokens
    );
    plane.remove_worker(&url).await.expect("remove");
    assert_eq!(plane.engine_load(&url, 0), None);
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_worker_info_reads_the_sims_server_info() {
    let fleet = fleet(2, false).await;
    let engine = &fleet.engines[0];
    let http = reqwest::Client::new();
    let info = fetch_worker_info(&http, &engine.http_url())
        .await
        .expect("info");
    assert_eq!(info.served_model_name.as_deref(), Some("kvroute-sim"));
    let kv = info.kv_events.expect("kv_events");
    assert_eq!(kv.kv_endpoint(1).unwrap(), engine.kv_endpoint(1));
    assert_eq!(
        kv.replay_endpoint(1).unwrap(),
        Some(engine.replay_endpoint(1))
    );
    assert_eq!(kv.block_size, Some(4));
    fleet.shutdown().await;
}

/// Serves one fixed HTTP response per connection (the test double named in the module doc).
async fn serve_fixed_body(body: String) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = sock.read(&mut buf).await;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
                body.len(),
                body
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        }
    });
    (format!("http://localhost:{}", addr.port()), task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_worker_info_replaces_a_wildcard_host() {
    let fleet = fleet(1, false).await;
    let engine = &fleet.engines[0];
    let mut body = kvroute_sim::http::server_info_json(engine.engine());
    body["kv_events"]["endpoint_host"] = serde_json::json!("*");
    let (url, server) = serve_fixed_body(body.to_string()).await;
    let http = reqwest::Client::new();
    let kv = fetch_worker_info(&http, &url)
        .await
        .expect("info")
        .kv_events
        .expect("kv_events");
    assert_eq!(kv.endpoint_host, "localhost");
    assert_eq!(
        kv.kv_endpoint(0).unwrap(),
        format!("tcp://localhost:{}", engine.ports().kv_base)
    );
    assert_eq!(
        kv.replay_endpoint(0).unwrap(),
        Some(format!("tcp://localhost:{}", engine.ports().replay_base))
    );
    server.abort();
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_worker_info_refuses_an_oversized_body() {
    let (url, server) =
        serve_fixed_body("x".repeat(kvroute_kv::discovery::SERVER_INFO_MAX_BYTES + 1)).await;
    let http = reqwest::Client::new();
    let err = fetch_worker_info(&http, &url).await.unwrap_err();
    assert!(
        matches!(err, kvroute_kv::DiscoveryError::BodyTooLarge { .. }),
        "{err:?}"
    );
    server.abort();
}

/// Starts a one-engine fleet on fixed KV and replay ports, retrying while the previous owner of
/// those ports is still closing its sockets.
async fn fleet_on_ports(kv_port: u16, replay_port: u16) -> Fleet {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(WAIT_MS);
    loop {
        let cfg = SimConfig {
            block_size: 4,
            kv_port_base: kv_port,
            replay_port_base: replay_port,
            ..SimConfig::for_tests()
        };
        match start_fleet(cfg).await {
            Ok(f) => return f,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                panic!("timed out waiting for ports {kv_port}/{replay_port} to be free: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(POLL_MS)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_process_restart_behind_a_reconnect_is_detected_and_rebuilt() {
    let first = fleet(1, false).await;
    let engine = &first.engines[0];
    let url = engine.http_url();
    let ports = engine.ports();
    let (plane, _registry) = new_plane();
    plane
        .add_worker(&url, MODEL, discover(engine).await)
        .await
        .expect("add");
    warm_up(&plane, engine, 0).await;
    let old: Vec<Vec<u32>> = (1..=2).map(|t| chain(t, 2)).collect();
    let mut seq = 0;
    for c in &old {
        seq = engine.store_chains(0, std::slice::from_ref(c));
    }
    let before = wait_cursor(&plane, &url, 0, seq).await;
    first.shutdown().await;

    // A new engine process on the same ports counts past the old cursor before the SUB is back:
    // by seq alone its batches would look like a continuation of the old stream.
    let second = fleet_on_ports(ports.kv_base, ports.replay_base).await;
    let engine = &second.engines[0];
    let new: Vec<Vec<u32>> = (10..=10 + before.cursor.unwrap() as u32 + 2)
        .map(|t| chain(t, 2))
        .collect();
    let mut last = 0;
    for c in &new {
        last = engine.store_chains(0, std::slice::from_ref(c));
    }
    assert!(last > before.cursor.unwrap());
    let status = wait_until(
        "the plane to rebuild the rank from the new engine",
        || match status_of(&plane, &url, 0) {
            Some(s) if s.cursor == Some(last) && s.publisher_restarts == 1 => Ok(s),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    for c in &old {
        assert_eq!(carried_depth(&plane, &url, 0, c), 0, "stale block survived");
    }
    for c in &new {
        assert_eq!(carried_depth(&plane, &url, 0, c), 2, "new block missing");
    }
    assert_eq!(status.lost_batches, 0, "{status:?}");
    plane.shutdown().await;
    second.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_does_not_wait_for_an_engine_that_is_not_up_yet() {
    // A port nobody listens on yet (the OS picked it free; we release it for the engine).
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = "http://127.0.0.1:9".to_string();
    let kv = kv_config_from_template(&url, &format!("tcp://{{host}}:{port}"), None, Some(4), 1)
        .expect("template");
    let (plane, _registry) = new_plane();
    // Returns although nothing accepts on `port`: connecting happens in the background.
    plane.add_worker(&url, MODEL, kv).await.expect("add");
    let status = status_of(&plane, &url, 0).expect("status");
    assert_eq!(status.subscriber, kvroute_kv::SubscriberState::Connecting);

    let fleet = fleet_on_ports(port, 0).await;
    let engine = &fleet.engines[0];
    wait_until(
        "the subscriber to connect to the late engine",
        || match status_of(&plane, &url, 0) {
            Some(s) if s.subscriber == kvroute_kv::SubscriberState::Connected => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    warm_up_as(&plane, engine, &url, 0).await;
    let tokens = chain(1, 3);
    let seq = engine.store_chains(0, std::slice::from_ref(&tokens));
    wait_cursor(&plane, &url, 0, seq).await;
    assert_eq!(carried_depth(&plane, &url, 0, &tokens), 3);
    plane.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_encoding_is_indexed_at_full_depth() {
    use kvroute_sim::KvEncodingArg;
    for encoding in [
        KvEncodingArg::Sglang,
        KvEncodingArg::Vllm,
        KvEncodingArg::VllmBytes,
        KvEncodingArg::VllmMap,
        KvEncodingArg::Legacy,
    ] {
        let fleet = start_fleet(SimConfig {
            block_size: 4,
            kv_encoding: encoding,
            ..SimConfig::for_tests()
        })
        .await
        .expect("fleet");
        let engine = &fleet.engines[0];
        let url = engine.http_url();
        let (plane, registry) = attached_plane(engine).await;
        let tokens = chain(7, 6);
        let seq = engine.store_chains(0, std::slice::from_ref(&tokens));
        wait_cursor(&plane, &url, 0, seq).await;
        assert_eq!(
            carried_depth(&plane, &url, 0, &tokens),
            6,
            "encoding {encoding:?}"
        );
        assert_eq!(
            counter(&registry, "kvroute_kv_decode_errors_total", None),
            0.0,
            "encoding {encoding:?}"
        );
        plane.shutdown().await;
        fleet.shutdown().await;
    }
}
