//! Component tests of peer bootstrap's transport over the real thing: a kvroute router (A) whose
//! index is fed by real KV events from simulated engines (ZMQ), serving its snapshot on its
//! internal listener over HTTP, and the fetch client pulling it and restoring it into a fresh
//! standalone index (B).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use kvroute::peer::fetch::{FetchConfig, FetchOutcome, PeerFetcher};
use kvroute::peer::internal::{KV_CURSORS_PATH, KV_SNAPSHOT_PATH};
use kvroute::{PolicyKind, RouterConfig, RouterHandle};
use kvroute_index::hash::{BASE_NAMESPACE, hash_token_blocks};
use kvroute_index::{IndexConfig, IndexReader, PrefixIndex, PrefixMatch};
use kvroute_sim::Fleet;
use kvroute_snapshot::{Compression, DecodeLimits, SnapshotDecodeError};
use kvroute_wire::snapshot::IndexSnapshot;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TOKEN: &[u8] = b"test-internal-token-0123456789";

fn a_reader(router: &RouterHandle) -> IndexReader {
    router
        .router
        .kv
        .plane()
        .model_view("m")
        .expect("model m has an index")
        .reader
}

fn fetcher(token: Option<&[u8]>) -> PeerFetcher {
    PeerFetcher::new(FetchConfig {
        auth_token: token.map(Arc::from),
        ..FetchConfig::from_router_config(&RouterConfig::default())
    })
    .unwrap()
}

/// Per rank (worker url, dp) -> (seq) of the router's index.
fn index_cursors(reader: &IndexReader) -> BTreeMap<(String, u32), i64> {
    reader
        .ranks()
        .into_iter()
        .filter_map(|(id, r)| {
            let c = reader.rank_stats(id)?.cursor?;
            Some(((r.worker_url, r.dp_rank), c.seq))
        })
        .collect()
}

/// Waits until A's cursor of every engine rank equals the engine's last published seq. A batch
/// lost to ZMQ's slow-joiner window is only noticed when a later one arrives, so a lagging rank
/// gets a fresh one-block sentinel each poll (which exposes the gap and triggers replay).
async fn wait_caught_up(router: &RouterHandle, fleet: &Fleet) {
    let reader = a_reader(router);
    let mut attempt = 0u32;
    wait_until(
        "A's cursors to reach every engine rank's last_seq",
        WAIT_DEADLINE,
        || {
            attempt += 1;
            let cursors = index_cursors(&reader);
            let mut lagging = Vec::new();
            for e in &fleet.engines {
                for r in 0..e.dp_size() {
                    let want = e.last_seq(r);
                    let got = cursors.get(&(e.http_url(), r as u32)).copied();
                    if got != Some(want) {
                        lagging.push(format!("{} rank {r}: {got:?} != {want}", e.http_url()));
                        if attempt.is_multiple_of(10) {
                            let bs = e.block_size() as u32;
                            let sentinel: Vec<u32> =
                                (0..bs).map(|t| 900_000 + attempt * 64 + t).collect();
                            e.store_chains(r, &[sentinel]);
                        }
                    }
                }
            }
            async move {
                if lagging.is_empty() {
                    Ok(())
                } else {
                    Err(lagging.join("; "))
                }
            }
        },
    )
    .await;
}

/// Waits until every rank's KV subscriber is connected, so stored chains are not published into
/// the void.
async fn wait_subscribed(router: &RouterHandle, ranks: usize) {
    let plane = router.router.kv.plane();
    wait_until(
        "every rank's KV subscriber to connect",
        WAIT_DEADLINE,
        || {
            let states: Vec<String> = plane
                .rank_states()
                .iter()
                .map(|s| format!("{:?}", s.subscriber).to_lowercase())
                .collect();
            async move {
                if states.len() == ranks && states.iter().all(|s| s == "connected") {
                    Ok(())
                } else {
                    Err(format!("{states:?}"))
                }
            }
        },
    )
    .await;
}

/// Random chains sharing prefixes (system-prompt families), stored on every rank of the fleet.
fn store_random_chains(fleet: &Fleet, rng: &mut StdRng, per_rank: usize) -> Vec<Vec<u32>> {
    let bs = fleet.engines[0].block_size();
    let families: Vec<Vec<u32>> = (0..12)
        .map(|_| {
            let blocks = rng.random_range(1..6);
            (0..blocks * bs)
                .map(|_| rng.random_range(0..50_000))
                .collect()
        })
        .collect();
    let mut stored = Vec::new();
    for e in &fleet.engines {
        for r in 0..e.dp_size() {
            let mut chains = Vec::new();
            for _ in 0..per_rank {
                let mut c = families[rng.random_range(0..families.len())].clone();
                let extra = rng.random_range(0..8) * bs + rng.random_range(0..bs);
                c.extend((0..extra).map(|_| rng.random_range(0..50_000u32)));
                chains.push(c);
            }
            // Several batches per rank, so cursors move more than once.
            for batch in chains.chunks(10) {
                e.store_chains(r, batch);
            }
            stored.extend(chains);
        }
    }
    stored
}

fn queries(stored: &[Vec<u32>], rng: &mut StdRng, count: usize, bs: usize) -> Vec<Vec<u32>> {
    (0..count)
        .map(|i| {
            if i % 4 == 3 {
                let len = rng.random_range(0..12 * bs);
                (0..len).map(|_| rng.random_range(0..50_000u32)).collect()
            } else {
                let c = &stored[rng.random_range(0..stored.len())];
                c[..rng.random_range(0..=c.len())].to_vec()
            }
        })
        .collect()
}

type RankView = BTreeMap<(String, u32), (u32, u32)>;

fn match_view(reader: &IndexReader, tokens: &[u32], bs: usize) -> RankView {
    let names: BTreeMap<u32, (String, u32)> = reader
        .ranks()
        .into_iter()
        .map(|(id, r)| (id.0, (r.worker_url, r.dp_rank)))
        .collect();
    let mut hashes = Vec::new();
    hash_token_blocks(tokens, bs, BASE_NAMESPACE, &mut hashes);
    let mut out = PrefixMatch::new();
    reader.match_prefix(&hashes, &mut out);
    out.ranks
        .iter()
        .map(|m| {
            (
                names[&m.rank.0].clone(),
                (m.matched_blocks, m.device_blocks),
            )
        })
        .collect()
}

/// Restores `snap` into a fresh index and checks every query matches there exactly as in A.
/// Returns how many queries hit at least one rank (so the comparison is not vacuous).
fn assert_same_matches(
    a: &IndexReader,
    snap: &IndexSnapshot,
    qs: &[Vec<u32>],
    what: &str,
) -> usize {
    let bs = a.config().block_size;
    let (mut bw, b) = PrefixIndex::new(IndexConfig::new(bs));
    bw.restore_snapshot(snap)
        .unwrap_or_else(|e| panic!("{what}: restore failed: {e}"));
    assert_eq!(b.node_count(), a.node_count(), "{what}: node count");
    assert_eq!(
        b.total_carried(),
        a.total_carried(),
        "{what}: carried blocks"
    );
    let mut hits = 0;
    for (i, q) in qs.iter().enumerate() {
        let va = match_view(a, q, bs as usize);
        let vb = match_view(&b, q, bs as usize);
        assert_eq!(va, vb, "{what}: query {i} ({} tokens) differs", q.len());
        hits += usize::from(!va.is_empty());
    }
    hits
}

async fn raw_get(
    url: &str,
    accept: Option<&str>,
    accept_encoding: Option<&str>,
    token: Option<&[u8]>,
) -> reqwest::Response {
    let mut req = client().get(url);
    if let Some(a) = accept {
        req = req.header("accept", a);
    }
    if let Some(e) = accept_encoding {
        req = req.header("accept-encoding", e);
    }
    if let Some(t) = token {
        req = req.header(
            "authorization",
            format!("Bearer {}", std::str::from_utf8(t).unwrap()),
        );
    }
    req.send().await.expect("request sent")
}

/// GETs the snapshot with explicit negotiation headers and decodes it the way the headers say.
async fn get_snapshot_variant(
    base: &str,
    accept: Option<&str>,
    accept_encoding: Option<&str>,
) -> (IndexSnapshot, String, Option<String>, Option<String>) {
    let resp = raw_get(
        &format!("{base}{KV_SNAPSHOT_PATH}"),
        accept,
        accept_encoding,
        None,
    )
    .await;
    assert_eq!(resp.status(), 200, "snapshot status");
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let ctype = h("content-type").unwrap_or_default();
    let cenc = h("content-encoding");
    let inner = h("x-kvroute-snapshot-compression");
    let body = resp.bytes().await.unwrap();
    let compression = match cenc.as_deref() {
        Some("zstd") => Compression::Zstd,
        Some("gzip") => Compression::Gzip,
        None => Compression::None,
        Some(other) => panic!("unexpected content-encoding {other}"),
    };
    let plain = kvroute_snapshot::decompress_bounded(&body, compression, 1 << 30).unwrap();
    let limits = DecodeLimits::default();
    let snap = if ctype == kvroute_snapshot::BINARY_CONTENT_TYPE {
        kvroute_snapshot::decode_binary(&plain, &limits, None).unwrap()
    } else {
        kvroute_snapshot::decode_json(&plain, &limits).unwrap()
    };
    (snap, ctype, cenc, inner)
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} not found in:\n{text}"))
}

/// A fleet, a router A over it, and random chains stored and indexed.
async fn warm_router(
    engines: usize,
    dp: usize,
    per_rank: usize,
    config: impl FnOnce(&mut RouterConfig),
) -> (Fleet, RouterHandle, Vec<Vec<u32>>) {
    let fleet = fleet(engines, dp, "m").await;
    let mut cfg = router_config(&urls(&fleet));
    config(&mut cfg);
    let router = kvroute::serve(cfg).await.unwrap();
    wait_subscribed(&router, engines * dp).await;
    let mut rng = StdRng::seed_from_u64(5);
    let stored = store_random_chains(&fleet, &mut rng, per_rank);
    wait_caught_up(&router, &fleet).await;
    (fleet, router, stored)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_snapshot_matches_the_producer_index_in_every_encoding() {
    let (fleet, router, stored) = warm_router(2, 2, 60, |_| {}).await;
    let a = a_reader(&router);
    let bs = a.config().block_size as usize;
    let mut rng = StdRng::seed_from_u64(9);
    let qs = queries(&stored, &mut rng, 2_000, bs);
    let base = router.internal_url();

    // The fetch client: binary, zstd inside the envelope.
    let snap = match fetcher(None).fetch_snapshot(&base, Some("m"), None).await {
        FetchOutcome::Body(s) => s,
        other => panic!("fetch failed: {other:?}"),
    };
    assert!(snap.producer_ready, "A is ready and has cursors");
    assert_eq!(snap.cursors.len(), 4, "every rank has a cursor");
    assert_eq!(snap.block_size as usize, bs);
    let hits = assert_same_matches(&a, &snap, &qs, "fetch client (binary+zstd)");
    assert!(
        hits > 1_000,
        "only {hits} of 2000 queries hit; the comparison is too weak"
    );

    for (accept, enc, want_ctype, want_cenc, want_inner) in [
        (
            Some("application/x-kvroute-snapshot"),
            Some("gzip"),
            "application/x-kvroute-snapshot",
            None,
            Some("gzip"),
        ),
        (
            Some("application/x-kvroute-snapshot"),
            None,
            "application/x-kvroute-snapshot",
            None,
            Some("identity"),
        ),
        (None, None, "application/json", None, None),
        (
            Some("*/*"),
            Some("gzip, zstd"),
            "application/json",
            Some("zstd"),
            None,
        ),
        (
            Some("application/json"),
            Some("gzip"),
            "application/json",
            Some("gzip"),
            None,
        ),
    ] {
        let (snap, ctype, cenc, inner) = get_snapshot_variant(&base, accept, enc).await;
        let what = format!("accept {accept:?} accept-encoding {enc:?}");
        assert_eq!(ctype, want_ctype, "{what}");
        assert_eq!(cenc.as_deref(), want_cenc, "{what}");
        assert_eq!(inner.as_deref(), want_inner, "{what}");
        assert_same_matches(&a, &snap, &qs, &what);
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_internal_token_is_required_and_a_foreign_mac_key_is_refused() {
    let (fleet, router, _) = warm_router(1, 2, 10, |c| {
        c.internal_auth_token = Some(Arc::from(TOKEN));
    })
    .await;
    let url = format!("{}{KV_SNAPSHOT_PATH}", router.internal_url());
    let bin = Some("application/x-kvroute-snapshot");
    assert_eq!(raw_get(&url, bin, None, None).await.status(), 401);
    assert_eq!(
        raw_get(&url, bin, None, Some(b"test-internal-token-0123456780"))
            .await
            .status(),
        401
    );
    let cursors_url = format!("{}{KV_CURSORS_PATH}", router.internal_url());
    assert_eq!(raw_get(&cursors_url, None, None, None).await.status(), 401);
    let ok = raw_get(&url, bin, Some("zstd"), Some(TOKEN)).await;
    assert_eq!(ok.status(), 200);
    let body = ok.bytes().await.unwrap();
    // Signed with the token: verifies under it, refused under any other key.
    let limits = DecodeLimits::default();
    assert!(kvroute_snapshot::decode_binary(&body, &limits, Some(TOKEN)).is_ok());
    assert_eq!(
        kvroute_snapshot::decode_binary(&body, &limits, Some(b"another-key-0123456789"))
            .unwrap_err(),
        SnapshotDecodeError::MacMismatch
    );
    match fetcher(Some(TOKEN))
        .fetch_snapshot(&router.internal_url(), None, None)
        .await
    {
        FetchOutcome::Body(s) => assert!(!s.nodes.is_empty()),
        other => panic!("authorised fetch failed: {other:?}"),
    }
    match fetcher(Some(b"another-key-0123456789"))
        .fetch_snapshot(&router.internal_url(), None, None)
        .await
    {
        FetchOutcome::Status(401) => {}
        other => panic!("a wrong token must be a 401, got {other:?}"),
    }
    // The public port does not serve the internal endpoints, token or not.
    for path in [KV_SNAPSHOT_PATH, KV_CURSORS_PATH] {
        let public = raw_get(&format!("{}{path}", router.url()), bin, None, Some(TOKEN)).await;
        assert!(
            public.status().is_client_error(),
            "public port answered {} for {path}",
            public.status()
        );
        assert_ne!(
            public
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("application/x-kvroute-snapshot")
        );
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_with_a_key_refuses_an_unsigned_snapshot() {
    let (fleet, router, _) = warm_router(1, 1, 5, |_| {}).await;
    match fetcher(Some(TOKEN))
        .fetch_snapshot(&router.internal_url(), None, None)
        .await
    {
        FetchOutcome::MacRefused(reason) => assert!(reason.contains("no MAC"), "{reason}"),
        other => panic!("an unsigned snapshot must be refused, got {other:?}"),
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cursor_table_reports_every_ranks_last_applied_batch() {
    let (fleet, router, _) = warm_router(2, 2, 5, |_| {}).await;
    let table = match fetcher(None)
        .fetch_cursors(&router.internal_url(), Some("m"))
        .await
    {
        FetchOutcome::Body(t) => t,
        other => panic!("cursor fetch failed: {other:?}"),
    };
    assert_eq!(table.ranks.len(), 4);
    assert_eq!(table.cursors.len(), 4);
    for c in &table.cursors {
        let r = &table.ranks[c.rank as usize];
        let engine = fleet
            .engines
            .iter()
            .find(|e| e.http_url() == r.worker_url)
            .expect("rank names a fleet engine");
        assert_eq!(c.seq, engine.last_seq(r.dp_rank as usize), "{r:?}");
    }
    // An unknown model is a 404, unknown query parameters are ignored.
    match fetcher(None)
        .fetch_cursors(&router.internal_url(), Some("nope"))
        .await
    {
        FetchOutcome::Status(404) => {}
        other => panic!("unknown model must be 404, got {other:?}"),
    }
    let resp = raw_get(
        &format!(
            "{}{KV_CURSORS_PATH}?model=m&whatever=1",
            router.internal_url()
        ),
        None,
        None,
        None,
    )
    .await;
    assert_eq!(resp.status(), 200);
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_export_is_reused_within_max_age_and_rebuilt_past_it() {
    let (fleet, router, _) = warm_router(1, 2, 5, |_| {}).await;
    let base = router.internal_url();
    let builds = |t: &str| metric(t, "kvroute_snapshot_builds_total");
    assert_eq!(builds(&metrics_text(&router.url()).await), 0.0);
    let f = fetcher(None);
    assert!(matches!(
        f.fetch_snapshot(&base, None, None).await,
        FetchOutcome::Body(_)
    ));
    assert_eq!(builds(&metrics_text(&router.url()).await), 1.0);
    // Default max age (2 s) and an absurd one both reuse the export just built.
    assert!(matches!(
        f.fetch_snapshot(&base, None, None).await,
        FetchOutcome::Body(_)
    ));
    assert!(matches!(
        f.fetch_snapshot(&base, None, Some(u64::MAX)).await,
        FetchOutcome::Body(_)
    ));
    let text = metrics_text(&router.url()).await;
    assert_eq!(builds(&text), 1.0);
    assert_eq!(metric(&text, "kvroute_snapshot_cache_hits_total"), 2.0);
    // max_age_ms=0 needs data sampled after the request arrived: a rebuild.
    assert!(matches!(
        f.fetch_snapshot(&base, None, Some(0)).await,
        FetchOutcome::Body(_)
    ));
    assert_eq!(builds(&metrics_text(&router.url()).await), 2.0);
    // Unknown parameters are ignored; a malformed max_age_ms is a 400.
    let url = format!("{base}{KV_SNAPSHOT_PATH}?foo=bar&max_age_ms=60000");
    assert_eq!(raw_get(&url, None, None, None).await.status(), 200);
    let url = format!("{base}{KV_SNAPSHOT_PATH}?max_age_ms=-5");
    assert_eq!(raw_get(&url, None, None, None).await.status(), 400);
    assert_eq!(builds(&metrics_text(&router.url()).await), 2.0);
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_one_build_and_one_encoding() {
    let (fleet, router, _) = warm_router(1, 2, 30, |_| {}).await;
    let base = router.internal_url();
    let f = fetcher(None);
    let results =
        futures::future::join_all((0..8).map(|_| f.fetch_snapshot(&base, None, None))).await;
    for r in &results {
        assert!(matches!(r, FetchOutcome::Body(_)), "{r:?}");
    }
    let text = metrics_text(&router.url()).await;
    assert_eq!(metric(&text, "kvroute_snapshot_builds_total"), 1.0);
    assert_eq!(metric(&text, "kvroute_snapshot_cache_hits_total"), 7.0);
    // The body is small: the other seven join the one encoding, running or kept whole.
    assert_eq!(
        metric(
            &text,
            "kvroute_snapshot_export_duration_seconds_count{stage=\"encode\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&text, "kvroute_snapshot_encodings_joined_total"),
        7.0
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_index_is_404_and_an_index_without_any_cursor_is_503() {
    let fleet = fleet(1, 1, "m").await;
    // Not cache-aware: this replica keeps no index to share.
    let rr = kvroute::serve(RouterConfig {
        policy: PolicyKind::RoundRobin,
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    match fetcher(None)
        .fetch_snapshot(&rr.internal_url(), None, None)
        .await
    {
        FetchOutcome::Status(404) => {}
        other => panic!("expected 404, got {other:?}"),
    }
    rr.shutdown().await;
    // Cache-aware, subscribed, but no engine has published anything: not ready.
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    wait_subscribed(&router, 1).await;
    let resp = raw_get(
        &format!("{}{KV_SNAPSHOT_PATH}", router.internal_url()),
        None,
        None,
        None,
    )
    .await;
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().get("retry-after").is_some());
    match fetcher(None)
        .fetch_cursors(&router.internal_url(), None)
        .await
    {
        FetchOutcome::Status(503) => {}
        other => panic!("expected 503, got {other:?}"),
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_over_the_byte_limit_is_refused_with_507() {
    let (fleet, router, _) = warm_router(1, 1, 20, |c| c.kv_snapshot_max_bytes = 256).await;
    let url = format!("{}{KV_SNAPSHOT_PATH}", router.internal_url());
    for accept in [None, Some("application/x-kvroute-snapshot")] {
        let resp = raw_get(&url, accept, None, None).await;
        assert_eq!(resp.status(), 507, "accept {accept:?}");
    }
    let text = metrics_text(&router.url()).await;
    assert!(
        text.contains("kvroute_snapshot_refused_total{reason=\"too_large\"} 2"),
        "{text}"
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

/// The limit is found only after the first chunk left, with the status line: the transfer is
/// broken off (a client never takes the prefix for a body), and the export remembers the
/// verdict, so the next request is a plain 507.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_passes_the_byte_limit_midway_is_broken_off_then_refused_with_507() {
    use kvroute::peer::producer::SNAPSHOT_STREAM_CHUNK_BYTES;
    let limit_bytes = SNAPSHOT_STREAM_CHUNK_BYTES + 1;
    let (fleet, router, _) =
        warm_router(2, 2, 300, |c| c.kv_snapshot_max_bytes = limit_bytes).await;
    let url = format!(
        "{}{KV_SNAPSHOT_PATH}?max_age_ms=60000",
        router.internal_url()
    );
    // The cut can come before hyper flushed the status line (the request fails) or after (the
    // body does); either way the client must not receive a clean end.
    let first = client()
        .get(&url)
        .header("accept", "application/json")
        .send()
        .await;
    match first {
        Err(e) => assert!(e.is_request(), "{e:?}"),
        Ok(resp) => {
            assert_eq!(resp.status(), 200, "the first chunk fits the limit");
            match resp.bytes().await {
                Err(e) => assert!(e.is_body() || e.is_decode(), "{e:?}"),
                Ok(body) => panic!(
                    "a body past the limit must not end cleanly; got {} bytes whole",
                    body.len()
                ),
            }
        }
    }
    let again = raw_get(&url, Some("application/json"), None, None).await;
    assert_eq!(again.status(), 507);
    let text = metrics_text(&router.url()).await;
    assert_eq!(
        metric(
            &text,
            "kvroute_snapshot_streams_cut_total{reason=\"too_large\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "kvroute_snapshot_refused_total{reason=\"too_large\"}"
        ),
        1.0
    );
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_peer_list_without_self_appears_in_metrics() {
    use clap::Parser;
    let cli = kvroute::cli::Cli::parse_from([
        "kvroute",
        "--port",
        "0",
        "--kv-peers",
        "http://10.0.0.1:8081,http://10.0.0.2:8081,http://10.0.0.3:8081",
        "--advertise-url",
        "http://10.0.0.2:8081",
    ]);
    let cfg = cli.serve.into_config().unwrap();
    let router = kvroute::serve(cfg).await.unwrap();
    let text = metrics_text(&router.url()).await;
    assert_eq!(metric(&text, "kvroute_peers"), 2.0);
    assert_eq!(metric(&text, "kvroute_peers_synced"), 1.0);
    let peers: Vec<String> = router
        .router
        .peers
        .candidates()
        .iter()
        .map(|p| p.as_str().to_string())
        .collect();
    assert!(!peers.iter().any(|p| p.contains("10.0.0.2")), "{peers:?}");
    assert_ne!(router.internal_addr, router.addr);
    router.shutdown().await;
}

struct ClosedGate;
impl kvroute::control::readiness::ReadinessGate for ClosedGate {
    fn name(&self) -> &str {
        "closed_for_test"
    }
    fn check(&self) -> Result<(), String> {
        Err("closed".into())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_ready_is_false_while_the_replica_is_not_ready() {
    let (fleet, router, _) = warm_router(1, 1, 5, |c| {
        c.extra_readiness_gates = vec![Arc::new(ClosedGate)];
    })
    .await;
    match fetcher(None)
        .fetch_snapshot(&router.internal_url(), None, None)
        .await
    {
        FetchOutcome::Body(s) => {
            assert!(
                !s.producer_ready,
                "a not-ready replica claimed producer_ready"
            );
            assert_eq!(s.cursors.len(), 1, "the index itself has its cursor");
        }
        other => panic!("fetch failed: {other:?}"),
    }
    router.shutdown().await;
    fleet.shutdown().await;
}

/// The bootstrap sweep's path over the real transport: a warm producer's body, vetted as it
/// arrives (`kvroute_bootstrap::vet_stream`, the only bridge from a sibling's bytes to a graft),
/// gives a `Covered` watermark for every live rank, equal to the producer's own cursor; a rank
/// this replica does not serve is dropped; and the two "nothing to serve" answers are told
/// apart from a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeps_streamed_answer_vets_into_the_producers_cursor_for_every_live_rank() {
    use kvroute::peer::fetch::StreamedAnswer;
    use kvroute_bootstrap::{BodyEncoding, Coverage, Expectations, vet_stream};
    use kvroute_index::RankId;

    let (fleet, router, _) = warm_router(2, 2, 30, |_| {}).await;
    let a = a_reader(&router);
    let want = index_cursors(&a);
    assert_eq!(want.len(), 4, "every rank of A has a cursor: {want:?}");
    // This replica serves three of A's four ranks, under local ids of its own.
    let ranks: Vec<(String, u32)> = want.keys().cloned().collect();
    let live: Vec<(kvroute_wire::snapshot::RankRef, RankId)> = ranks[..3]
        .iter()
        .enumerate()
        .map(|(i, (url, dp))| {
            (
                kvroute_wire::snapshot::RankRef {
                    worker_url: url.clone(),
                    dp_rank: *dp,
                },
                RankId(100 + i as u32),
            )
        })
        .collect();
    let block_size = a.config().block_size;
    let answer = fetcher(None)
        .fetch_snapshot_streamed(
            &router.internal_url(),
            Some("m"),
            None,
            Some(10_000),
            move |head, body| {
                let encoding = BodyEncoding::from_headers(
                    Some(head.content_type.as_str()),
                    head.content_encoding.as_deref(),
                )
                .expect("the producer answers in an encoding vet reads");
                vet_stream(
                    body,
                    encoding,
                    &Expectations {
                        block_size,
                        live: &live,
                        mac_key: None,
                        limits: DecodeLimits::default(),
                    },
                )
            },
        )
        .await;
    let StreamedAnswer::Consumed { value, head, .. } = answer else {
        panic!("expected a snapshot body, got {answer:?}");
    };
    assert!(head.age_ms.is_some(), "the producer sends the export's age");
    let vetted = value.expect("a warm, ready producer's snapshot vets");
    assert_eq!(
        vetted.dropped_ranks(),
        1,
        "the rank this replica does not serve"
    );
    for (i, key) in ranks[..3].iter().enumerate() {
        match vetted.coverage(RankId(100 + i as u32)) {
            Coverage::Covered { cursor, .. } => {
                assert_eq!(cursor.0, want[key], "watermark of {key:?} is A's cursor")
            }
            other => panic!("{key:?} not covered: {other:?}"),
        }
    }
    router.shutdown().await;

    // Nothing to serve: a replica without an index (404), and one whose index has applied no
    // event yet (503 index_not_ready). The consumer is never reached.
    let ask = |base: String, timeout_ms: Option<u64>| async move {
        fetcher(None)
            .fetch_snapshot_streamed(&base, None, None, timeout_ms, |_, _| {
                panic!("no body was expected")
            })
            .await
    };
    let rr = kvroute::serve(RouterConfig {
        policy: PolicyKind::RoundRobin,
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    let answer: StreamedAnswer<()> = ask(rr.internal_url(), None).await;
    assert!(matches!(answer, StreamedAnswer::NoSnapshot), "{answer:?}");
    rr.shutdown().await;
    fleet.shutdown().await;
    let quiet = common::fleet(1, 1, "m").await;
    let cold = kvroute::serve(router_config(&urls(&quiet))).await.unwrap();
    wait_subscribed(&cold, 1).await;
    let answer: StreamedAnswer<()> = ask(cold.internal_url(), None).await;
    assert!(matches!(answer, StreamedAnswer::NoSnapshot), "{answer:?}");
    // A sibling that is not there at all is a failure, not "nothing to serve".
    let answer: StreamedAnswer<()> = ask("http://127.0.0.1:9".to_string(), Some(2_000)).await;
    assert!(
        matches!(answer, StreamedAnswer::Unreachable(_)),
        "{answer:?}"
    );
    cold.shutdown().await;
    quiet.shutdown().await;
}

/// All of peer bootstrap over the real transport: a replica B started beside a warm replica A
/// (real KV events from simulated engines, the engines quiet by the time B starts) pulls A's
/// snapshot, vets it, grafts it under its live stream and proves each rank's splice through the
/// engine's replay socket; `/readyz` holds until that settles; afterwards B answers every query
/// like A, and keeps up with events published after the graft (the snapshot was spliced UNDER
/// the live stream, not substituted for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_beside_a_warm_one_grafts_its_index_and_answers_like_it() {
    let (fleet, a, stored) = warm_router(2, 2, 40, |_| {}).await;
    let bs = a_reader(&a).config().block_size as usize;
    let peer = kvroute_discovery::PeerUrl::parse(&a.internal_url()).unwrap();
    let b = kvroute::serve(RouterConfig {
        peer_source: Some(kvroute_discovery::PeerSourceConfig::Static(
            kvroute_discovery::StaticPeers {
                peers: vec![peer],
                advertise_url: None,
            },
        )),
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    let base = b.url();
    // Every rank settles, and settles warm: its splice was proven.
    let outcomes = wait_bootstrap_settled(&base, 4).await;
    assert!(
        outcomes.iter().all(|o| o == "warm"),
        "every rank's splice must be proven: {outcomes:?}"
    );
    let ready = client().get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "B is ready once every rank settled");
    // B answers like A, although the engines published nothing since B subscribed.
    let reader_a = a_reader(&a);
    let reader_b = a_reader(&b);
    let mut rng = StdRng::seed_from_u64(13);
    let qs = queries(&stored, &mut rng, 1_000, bs);
    let mut hits = 0;
    for (i, q) in qs.iter().enumerate() {
        let va = match_view(&reader_a, q, bs);
        let vb = match_view(&reader_b, q, bs);
        assert_eq!(va, vb, "query {i} ({} tokens): B differs from A", q.len());
        hits += usize::from(!va.is_empty());
    }
    assert!(hits > 500, "only {hits} of 1000 queries hit; too weak");
    assert_eq!(reader_b.total_carried(), reader_a.total_carried());
    // The live stream continues on top of the graft.
    let more = store_random_chains(&fleet, &mut rng, 5);
    wait_caught_up(&a, &fleet).await;
    wait_caught_up(&b, &fleet).await;
    for q in queries(&more, &mut rng, 200, bs) {
        assert_eq!(match_view(&reader_a, &q, bs), match_view(&reader_b, &q, bs));
    }
    b.shutdown().await;
    a.shutdown().await;
    fleet.shutdown().await;
}

/// The anchors' worst failure, refused: during a rolling update a new replica must not inherit an
/// empty or partial index from another new replica and call itself warm. Sibling A is itself
/// still bootstrapping (its only sibling is unreachable, so its `/readyz` and `producer_ready`
/// hold), and the engine is young (its stream starts at seq 0): B never takes A's snapshot as
/// warm; when its search ends it rebuilds each rank exactly from the engine's replay buffer
/// instead (`from_engine_replay` for rank 0, which holds a chain; `empty` for rank 1, whose
/// engine replays nothing), and answers like the engine's cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_still_bootstrapping_is_never_taken_as_warm() {
    let fleet = fleet(1, 2, "m").await;
    let engine = &fleet.engines[0];
    let bs = engine.block_size();
    let unreachable = kvroute_discovery::PeerUrl::parse("http://127.0.0.1:9").unwrap();
    let peers = |p: kvroute_discovery::PeerUrl| {
        Some(kvroute_discovery::PeerSourceConfig::Static(
            kvroute_discovery::StaticPeers {
                peers: vec![p],
                advertise_url: None,
            },
        ))
    };
    let a = kvroute::serve(RouterConfig {
        peer_source: peers(unreachable),
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    wait_subscribed(&a, 2).await;
    let prompt: Vec<u32> = (0..(bs * 3) as u32).map(|t| 40_000 + t).collect();
    engine.store_chains(0, std::slice::from_ref(&prompt));
    let not_ready = client()
        .get(format!("{}/readyz", a.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(not_ready.status(), 503, "A is still bootstrapping");
    let b = kvroute::serve(RouterConfig {
        peer_source: peers(kvroute_discovery::PeerUrl::parse(&a.internal_url()).unwrap()),
        bootstrap: kvroute::peer::bootstrap::BootstrapConfig {
            timeout_ms: 2_000,
            ..Default::default()
        },
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    let base = b.url();
    let outcomes = wait_bootstrap_settled(&base, 2).await;
    assert_eq!(
        outcomes,
        ["from_engine_replay", "empty"],
        "an unready sibling is never a seed; the young engine's replay is"
    );
    let metrics = metrics_text(&base).await;
    assert!(
        !metrics.contains("kvroute_bootstrap_sweeps_total{verdict=\"found\"}"),
        "no sweep may have found a snapshot:\n{metrics}"
    );
    // B holds what the engine holds: the 3-block chain on rank 0.
    let view = match_view(&a_reader(&b), &prompt, bs);
    assert_eq!(
        view.get(&(engine.http_url(), 0)).map(|m| m.0),
        Some(3),
        "{view:?}"
    );
    b.shutdown().await;
    a.shutdown().await;
    fleet.shutdown().await;
}

/// Waits until all `ranks` KV ranks listed on `base`'s `/workers` have settled their bootstrap,
/// and returns their outcomes.
async fn wait_bootstrap_settled(base: &str, ranks: usize) -> Vec<String> {
    wait_until(
        "every rank to settle its bootstrap",
        std::time::Duration::from_secs(30),
        || async {
            let w = workers(base).await;
            let outcomes: Vec<String> = w["workers"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|w| w["kv_ranks"].as_array().cloned().unwrap_or_default())
                .map(|r| {
                    r["bootstrap"]["outcome"]
                        .as_str()
                        .unwrap_or("-")
                        .to_string()
                })
                .collect();
            if outcomes.len() == ranks && outcomes.iter().all(|o| o != "-") {
                Ok(outcomes)
            } else {
                Err(w.to_string())
            }
        },
    )
    .await
}

/// The search ended fleet-cold (its metrics text is `text`) and did not hold `/readyz`.
async fn assert_ended_fleet_cold_and_ready(router: &RouterHandle, text: &str) {
    assert!(
        text.contains("kvroute_bootstrap_sweeps_total{verdict=\"fleet_cold\"}"),
        "{text}"
    );
    let ready = client()
        .get(format!("{}/readyz", router.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200, "fleet cold never holds readiness");
}

fn static_peers(urls: &[String]) -> Option<kvroute_discovery::PeerSourceConfig> {
    Some(kvroute_discovery::PeerSourceConfig::Static(
        kvroute_discovery::StaticPeers {
            peers: urls
                .iter()
                .map(|u| kvroute_discovery::PeerUrl::parse(u).unwrap())
                .collect(),
            advertise_url: None,
        },
    ))
}

/// A replica whose sibling list names only itself never fetches from itself: no snapshot fetch
/// is made at all, and its ranks settle from the engine when the search ends: a young engine that
/// has published nothing replays nothing, which settles the rank `empty`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_never_fetches_its_own_snapshot() {
    let fleet = fleet(1, 1, "m").await;
    let internal_port = free_port();
    let b = kvroute::serve(RouterConfig {
        internal_port: Some(internal_port),
        peer_source: static_peers(&[format!("http://127.0.0.1:{internal_port}")]),
        bootstrap: kvroute::peer::bootstrap::BootstrapConfig {
            timeout_ms: 1_000,
            ..Default::default()
        },
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    let outcomes = wait_bootstrap_settled(&b.url(), 1).await;
    assert_eq!(outcomes, ["empty"]);
    let text = metrics_text(&b.url()).await;
    assert!(
        !text.contains("kvroute_bootstrap_snapshot_fetches_total{"),
        "no fetch may have been made, to itself or anyone:\n{text}"
    );
    b.shutdown().await;
    fleet.shutdown().await;
}

/// A sibling without the snapshot endpoint (an older build, or not a kvroute at all: here an
/// engine's HTTP port, which answers 404) is "nothing to serve", not a failure that holds
/// readiness: the search ends fleet-cold at once and the replica serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_endpoint_is_cold_and_never_holds_readiness() {
    let fleet = fleet(1, 1, "m").await;
    let not_a_router = fleet.engines[0].http_url();
    let b = kvroute::serve(RouterConfig {
        peer_source: static_peers(&[not_a_router]),
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    let outcomes = wait_bootstrap_settled(&b.url(), 1).await;
    assert_ne!(outcomes, ["warm"], "nothing was there to graft");
    let text = metrics_text(&b.url()).await;
    assert!(
        text.contains("kvroute_bootstrap_snapshot_fetches_total{result=\"no_snapshot\"}"),
        "{text}"
    );
    assert_ended_fleet_cold_and_ready(&b, &text).await;
    b.shutdown().await;
    fleet.shutdown().await;
}

/// A misaddressed sibling answers the same on every ask: here one that refuses this replica's
/// internal token (replicas started with different `--internal-auth-token-file`s), and below a
/// sibling named by its PUBLIC port. Either is asked once, rejected for the boot, and the search
/// ends fleet-cold at once instead of holding `/readyz` for the whole bootstrap timeout (60 s by
/// default, past this test's 30 s wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_that_refuses_our_token_is_asked_once_and_never_holds_readiness() {
    misdirected_sibling_case(
        |a| a.internal_auth_token = Some(Arc::from(TOKEN)),
        |a, b| {
            b.internal_auth_token = Some(Arc::from(&b"another-internal-token-0123456789"[..]));
            b.peer_source = static_peers(&[a.internal_url()]);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_named_by_its_public_port_is_asked_once_and_never_holds_readiness() {
    misdirected_sibling_case(|_| {}, |a, b| b.peer_source = static_peers(&[a.url()])).await;
}

/// A warm replica A (configured by `configure_a`) and a replica B beside it whose only sibling
/// is A, misaddressed by `misaddress_b`.
async fn misdirected_sibling_case(
    configure_a: impl FnOnce(&mut RouterConfig),
    misaddress_b: impl FnOnce(&RouterHandle, &mut RouterConfig),
) {
    let (fleet, a, _) = warm_router(1, 2, 10, configure_a).await;
    let mut b_config = router_config(&urls(&fleet));
    misaddress_b(&a, &mut b_config);
    let b = kvroute::serve(b_config).await.unwrap();
    assert_misdirected_sibling_rejected_once(&b).await;
    b.shutdown().await;
    a.shutdown().await;
    fleet.shutdown().await;
}

/// `router`'s only sibling was misaddressed: its two ranks settled without a graft, the sibling
/// was asked exactly once, and the search ended fleet-cold without holding `/readyz`.
async fn assert_misdirected_sibling_rejected_once(router: &RouterHandle) {
    let outcomes = wait_bootstrap_settled(&router.url(), 2).await;
    assert!(
        outcomes.iter().all(|o| o != "warm"),
        "nothing was grafted: {outcomes:?}"
    );
    let text = metrics_text(&router.url()).await;
    assert_eq!(
        metric(
            &text,
            "kvroute_bootstrap_snapshot_fetches_total{result=\"rejected\"}"
        ),
        1.0,
        "asked once, rejected for the boot:\n{text}"
    );
    assert_ended_fleet_cold_and_ready(router, &text).await;
}

/// `--kv-bootstrap-seed-required`: a search that timed out over siblings it tried, without a
/// seed, keeps `/readyz` at 503 after every rank has settled, but only up to 3x the bootstrap
/// timeout, so a dead fleet cannot hold a replica unready forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_required_holds_readiness_after_a_failed_search_but_not_forever() {
    let fleet = fleet(1, 1, "m").await;
    let b = kvroute::serve(RouterConfig {
        peer_source: static_peers(&["http://127.0.0.1:9".to_string()]),
        bootstrap: kvroute::peer::bootstrap::BootstrapConfig {
            timeout_ms: 1_000,
            seed_required: true,
            ..Default::default()
        },
        ..router_config(&urls(&fleet))
    })
    .await
    .unwrap();
    let base = b.url();
    wait_bootstrap_settled(&base, 1).await;
    let readyz = || async {
        client()
            .get(format!("{base}/readyz"))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .map_err(|e| e.to_string())
    };
    wait_until(
        "/readyz to be held for the missing seed",
        std::time::Duration::from_secs(10),
        || async {
            let text = metrics_text(&base).await;
            match readyz().await? {
                503 if text.contains("kvroute_bootstrap_seed_failed 1") => Ok(()),
                other => Err(format!("status {other}")),
            }
        },
    )
    .await;
    wait_until(
        "/readyz to open after 3x the timeout",
        std::time::Duration::from_secs(15),
        || async {
            match readyz().await? {
                200 => Ok(()),
                other => Err(format!("status {other}")),
            }
        },
    )
    .await;
    b.shutdown().await;
    fleet.shutdown().await;
}
