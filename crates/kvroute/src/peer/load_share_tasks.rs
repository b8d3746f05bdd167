//! The tasks of load sharing (`crate::peer::load_share` explains the design): the stream this
//! replica serves each sibling, and the follower side, one reader per sibling and the aggregator
//! that writes the sums. Kept apart from the state they work on so the router, which owns that
//! state, does not depend on the tasks that need the router.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use kvroute_discovery::PeerUrl;
use tokio_util::sync::CancellationToken;

use crate::control::registry::{RankLoad, Worker, clock_us};
use crate::control::router::Router;
use crate::peer::load_frame::{
    DispatchedWork, FrameSender, LOAD_FRAME_MAX_BYTES, LOAD_FRAME_PENDING_MAX,
    LOAD_FRAME_PREFIX_TOKENS_MAX, LOAD_FRAME_PREFIXES_MAX, OwnRank, RankKey, SharedPending,
    SharedPrefix, decode_line, encode_line,
};
use crate::peer::load_share::{
    LOAD_BOOKINGS_CONTENT_TYPE, LOAD_BOOKINGS_PATH, LOAD_SHARE_CONNECT_TIMEOUT_MS,
    LOAD_SHARE_HEARTBEAT_MS, LOAD_SHARE_RECONNECT_BACKOFF_MAX_MS,
    LOAD_SHARE_RECONNECT_BACKOFF_MIN_MS,
};

/// This replica's own ranks as a frame lists them, sorted by key (the sender diffs by position).
fn own_ranks(workers: &[Arc<Worker>]) -> Vec<OwnRank> {
    let mut ranks = Vec::with_capacity(workers.len() * 2);
    for w in workers {
        let url: Arc<str> = w.url.as_str().into();
        for (dp, load) in w.ranks.iter().enumerate() {
            ranks.push(OwnRank {
                key: RankKey {
                    worker_url: url.clone(),
                    dp_rank: dp as u32,
                },
                in_flight: load.in_flight.load(Ordering::Relaxed).max(0) as u64,
                queued_prefill_tokens: load.queued_prefill_tokens.load(Ordering::Relaxed).max(0)
                    as u64,
                prefill_busy_until_us: load.prefill_busy_until_us.load(Ordering::Relaxed),
                prefill_dispatched_us: load.prefill_dispatched_us.load(Ordering::Relaxed),
            });
        }
    }
    ranks.sort_by(|a, b| a.key.cmp(&b.key));
    ranks
}

/// Query of a subscription that also wants this replica's rendered prefixes (see
/// `routing::tokenize`): a follower older than them refuses frames that carry them, so they go
/// only to one that asks.
pub const WANT_PREFIXES_QUERY: &str = "prefixes=1";

/// The rendered prefixes one stream has not sent yet: the broadcast receiver, and the one
/// prefix that did not fit the previous frame's token budget.
struct PrefixOutbox {
    receiver: tokio::sync::broadcast::Receiver<Arc<SharedPrefix>>,
    carried: Option<Arc<SharedPrefix>>,
}

/// Serves one sibling's subscription: the stream of this replica's own bookings, and with
/// `want_prefixes` the conversation prefixes its tokenizers render.
pub fn bookings_stream_response(router: &Arc<Router>, want_prefixes: bool) -> Response {
    let Ok(permit) = router.load_share.subscribers.clone().try_acquire_owned() else {
        let mut resp = (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"error": {"code": "busy",
                "message": "this replica serves the most load-bookings streams it may"}})),
        )
            .into_response();
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return resp;
    };
    let interval = Duration::from_millis(router.config.load_share.interval_ms.max(1));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let outbox = router.load_share.pending_out.subscribe();
    let prefix_outbox = want_prefixes.then(|| PrefixOutbox {
        receiver: router.tokenizers.subscribe_shared(),
        carried: None,
    });
    let state = (
        router.clone(),
        FrameSender::default(),
        ticker,
        (permit, outbox, prefix_outbox),
    );
    let frames = futures::stream::unfold(
        state,
        |(router, mut sender, mut ticker, (permit, mut outbox, mut prefix_outbox))| async move {
            loop {
                tokio::select! {
                    _ = router.shutdown.cancelled() => return None,
                    _ = ticker.tick() => {}
                }
                let ranks = own_ranks(&router.registry.workers());
                let pending = drain_outbox(&router, &mut outbox);
                let prefixes = prefix_outbox
                    .as_mut()
                    .map(|o| drain_prefixes(&router, o))
                    .unwrap_or_default();
                let now = clock_us();
                if let Some(mut frame) = sender.next_frame(
                    &ranks,
                    now,
                    LOAD_SHARE_HEARTBEAT_MS * 1_000,
                    pending,
                    prefixes,
                ) {
                    let key = router.config.internal_auth_token.as_deref();
                    let mut line = encode_line(&frame, key);
                    let prefixes_sent = frame.take_prefixes().len();
                    if line.len() > LOAD_FRAME_MAX_BYTES && prefixes_sent > 0 {
                        // A frame of many ranks plus its prefixes would be refused by the
                        // follower; the prefixes are hints, the bookings are not.
                        line = encode_line(&frame, key);
                        prefix_count(&router, "lost", prefixes_sent);
                    } else {
                        prefix_count(&router, "sent", prefixes_sent);
                    }
                    router
                        .metrics
                        .load_share_frames
                        .with_label_values(&["sent"])
                        .inc();
                    return Some((
                        Ok::<_, std::convert::Infallible>(bytes::Bytes::from(line)),
                        (router, sender, ticker, (permit, outbox, prefix_outbox)),
                    ));
                }
            }
        },
    );
    let mut resp = Response::new(Body::from_stream(frames));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(LOAD_BOOKINGS_CONTENT_TYPE),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The pending prefixes routed since the stream's last frame, at most a frame's worth; a
/// stream that fell more than the outbox behind loses the oldest (they are hints, and the KV
/// events carry the same blocks soon after).
fn drain_outbox(
    router: &Router,
    outbox: &mut tokio::sync::broadcast::Receiver<Arc<SharedPending>>,
) -> Vec<SharedPending> {
    use tokio::sync::broadcast::error::TryRecvError;
    let mut pending = Vec::new();
    while pending.len() < LOAD_FRAME_PENDING_MAX {
        match outbox.try_recv() {
            Ok(p) => pending.push((*p).clone()),
            Err(TryRecvError::Lagged(lost)) => router
                .metrics
                .load_share_frames
                .with_label_values(&["pending_lost"])
                .inc_by(lost),
            Err(TryRecvError::Empty | TryRecvError::Closed) => break,
        }
    }
    pending
}

/// The rendered prefixes offered since the stream's last frame, within one frame's budget
/// ([`LOAD_FRAME_PREFIXES_MAX`], [`LOAD_FRAME_PREFIX_TOKENS_MAX`]); the first one past the
/// token budget waits for the next frame. A stream that fell more than the ring behind loses
/// the oldest (the sibling then renders them itself).
fn drain_prefixes(router: &Router, outbox: &mut PrefixOutbox) -> Vec<SharedPrefix> {
    // A carried prefix always fits an empty frame, so none can hold the outbox up for good.
    const { assert!(crate::routing::tokenize::SHARED_PREFIX_TOKENS_MAX <= LOAD_FRAME_PREFIX_TOKENS_MAX) };
    use tokio::sync::broadcast::error::TryRecvError;
    let mut prefixes: Vec<SharedPrefix> = Vec::new();
    let mut tokens = 0usize;
    while prefixes.len() < LOAD_FRAME_PREFIXES_MAX {
        let next = match outbox.carried.take() {
            Some(p) => p,
            None => match outbox.receiver.try_recv() {
                Ok(p) => p,
                Err(TryRecvError::Lagged(lost)) => {
                    prefix_count(router, "lost", lost as usize);
                    continue;
                }
                Err(TryRecvError::Empty | TryRecvError::Closed) => break,
            },
        };
        if tokens + next.tokens.len() > LOAD_FRAME_PREFIX_TOKENS_MAX {
            outbox.carried = Some(next);
            break;
        }
        tokens += next.tokens.len();
        prefixes.push((*next).clone());
    }
    prefixes
}

fn prefix_count(router: &Router, result: &str, n: usize) {
    if n > 0 {
        router
            .metrics
            .shared_prefixes
            .with_label_values(&[result])
            .inc_by(n as u64);
    }
}

/// Starts the follower side: a supervisor that keeps one reader per sibling in `router.peers`,
/// and the aggregator. Both stop on `router.shutdown`.
pub fn start_following(router: &Arc<Router>) {
    if !router.config.load_share.enabled {
        return;
    }
    tokio::spawn(aggregate(router.clone()));
    tokio::spawn(supervise(router.clone()));
}

async fn supervise(router: Arc<Router>) {
    let mut peers = router.peers.subscribe();
    let mut readers: HashMap<PeerUrl, CancellationToken> = HashMap::new();
    loop {
        let current: Vec<PeerUrl> = peers.borrow_and_update().peers.clone();
        readers.retain(|peer, stop| {
            let keep = current.contains(peer);
            if !keep {
                stop.cancel();
            }
            keep
        });
        for peer in current {
            readers.entry(peer.clone()).or_insert_with(|| {
                let stop = router.shutdown.child_token();
                tokio::spawn(follow(router.clone(), peer, stop.clone()));
                stop
            });
        }
        tokio::select! {
            _ = router.shutdown.cancelled() => return,
            changed = peers.changed() => if changed.is_err() { return },
        }
    }
}

/// Follows one sibling until `stop`: connect, read frames into its table, reconnect on failure.
async fn follow(router: Arc<Router>, peer: PeerUrl, stop: CancellationToken) {
    let share = &router.load_share;
    let mut backoff_ms = LOAD_SHARE_RECONNECT_BACKOFF_MIN_MS;
    // A misaddressed sibling (refused token, public port) is a misconfiguration, not a passing
    // fault: said once at warn, not at every reconnect.
    let mut misdirection_told = false;
    while !stop.is_cancelled() {
        let outcome = tokio::select! {
            _ = stop.cancelled() => break,
            outcome = read_stream(&router, &peer) => outcome,
        };
        if let Some(t) = share.tables.lock().get_mut(&peer) {
            t.restart_stream();
        }
        match outcome {
            StreamEnd::AfterFrames => backoff_ms = LOAD_SHARE_RECONNECT_BACKOFF_MIN_MS,
            StreamEnd::Misdirected(m) => {
                if !misdirection_told {
                    tracing::warn!(sibling = %peer, reason = %m,
                        "this replica cannot follow the sibling's load bookings");
                    misdirection_told = true;
                }
                backoff_ms = LOAD_SHARE_RECONNECT_BACKOFF_MAX_MS;
            }
            StreamEnd::Failed(reason) => {
                tracing::debug!(sibling = %peer, %reason, "load-bookings stream failed; reconnecting");
                backoff_ms = (backoff_ms * 2).min(LOAD_SHARE_RECONNECT_BACKOFF_MAX_MS);
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_millis(backoff_ms)) => {}
        }
    }
    share.tables.lock().remove(&peer);
    share.changed.notify_one();
}

enum StreamEnd {
    /// The stream delivered frames, then ended (reconnect promptly).
    AfterFrames,
    /// It could not be opened or broke before its first frame, or a frame was refused.
    Failed(String),
    /// The sibling was misaddressed (`fetch::Misdirected`).
    Misdirected(crate::peer::fetch::Misdirected),
}

async fn read_stream(router: &Router, peer: &PeerUrl) -> StreamEnd {
    let share = &router.load_share;
    let token = router.config.internal_auth_token.as_deref();
    let stale = Duration::from_millis(router.config.load_share.stale_ms);
    let mut req = router.http.get(format!(
        "{}{LOAD_BOOKINGS_PATH}?{WANT_PREFIXES_QUERY}",
        peer.as_str().trim_end_matches('/')
    ));
    if let Some(t) = token {
        req = req.bearer_auth(String::from_utf8_lossy(t));
    }
    let resp = match tokio::time::timeout(
        Duration::from_millis(LOAD_SHARE_CONNECT_TIMEOUT_MS).max(stale),
        req.send(),
    )
    .await
    {
        Err(_) => return StreamEnd::Failed("no answer within the staleness bound".into()),
        Ok(Err(e)) => return StreamEnd::Failed(e.to_string()),
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    if status != reqwest::StatusCode::OK {
        return match crate::peer::fetch::Misdirected::of(resp).await {
            Some(m) => StreamEnd::Misdirected(m),
            None => StreamEnd::Failed(format!("HTTP {status}")),
        };
    }
    let mut body = resp.bytes_stream();
    let mut line: Vec<u8> = Vec::new();
    let mut frames = 0u64;
    loop {
        // Heartbeats arrive every LOAD_SHARE_HEARTBEAT_MS; silence past the staleness bound is
        // a dead sibling or a stuck connection.
        let chunk = match tokio::time::timeout(stale, body.next()).await {
            Err(_) => return StreamEnd::Failed("stream silent past the staleness bound".into()),
            Ok(None) => break,
            Ok(Some(Err(e))) => return StreamEnd::Failed(e.to_string()),
            Ok(Some(Ok(c))) => c,
        };
        let mut rest = &chunk[..];
        while !rest.is_empty() {
            let (piece, complete) = match memchr::memchr(b'\n', rest) {
                Some(end) => (&rest[..end], true),
                None => (rest, false),
            };
            rest = if complete {
                &rest[piece.len() + 1..]
            } else {
                &[]
            };
            if line.len() + piece.len() > LOAD_FRAME_MAX_BYTES {
                refused(router);
                return StreamEnd::Failed(format!(
                    "a frame line is over {LOAD_FRAME_MAX_BYTES} bytes"
                ));
            }
            line.extend_from_slice(piece);
            if !complete {
                continue;
            }
            let applied = decode_line(&line, token)
                .map_err(|e| e.to_string())
                .and_then(|mut frame| {
                    adopt_pending(router, frame.take_pending());
                    adopt_prefixes(router, frame.take_prefixes());
                    let mut tables = share.tables.lock();
                    let table = tables.entry(peer.clone()).or_default();
                    table.apply(frame, clock_us()).map_err(|e| e.to_string())
                });
            line.clear();
            if let Err(reason) = applied {
                refused(router);
                return StreamEnd::Failed(reason);
            }
            frames += 1;
            router
                .metrics
                .load_share_frames
                .with_label_values(&["applied"])
                .inc();
            share.changed.notify_one();
        }
    }
    if frames > 0 {
        StreamEnd::AfterFrames
    } else {
        StreamEnd::Failed("the stream ended before its first frame".into())
    }
}

/// Records a sibling's pending prefixes as if this replica had routed them (on the ranks it
/// shares with the sibling; the rest are ignored), so the next request of the same cold
/// prefix follows the first whichever replica it reaches.
fn adopt_pending(router: &Router, pending: Vec<SharedPending>) {
    if pending.is_empty() || !router.pending.enabled() {
        return;
    }
    let now = std::time::Instant::now();
    for p in pending {
        let Some(worker) = router.registry.by_url(&p.rank.worker_url) else {
            continue;
        };
        if p.rank.dp_rank >= worker.dp_size {
            continue;
        }
        let rank = crate::routing::pending::RankKey {
            worker: worker.id,
            dp_rank: p.rank.dp_rank,
        };
        router
            .pending
            .record(&p.model, &p.hashes, 0, rank, now, false);
    }
}

/// Gives a sibling's rendered prefixes to this replica's tokenizer of the same fingerprint;
/// those made with a tokenizer this replica does not have, or that it refuses, are counted.
fn adopt_prefixes(router: &Router, prefixes: Vec<SharedPrefix>) {
    let (mut adopted, mut refused) = (0, 0);
    for p in &prefixes {
        match router.tokenizers.by_fingerprint(p.tokenizer) {
            Some(t) if t.adopt_shared_prefix(p) => adopted += 1,
            _ => refused += 1,
        }
    }
    prefix_count(router, "adopted", adopted);
    prefix_count(router, "refused", refused);
}

fn refused(router: &Router) {
    router
        .metrics
        .load_share_frames
        .with_label_values(&["refused"])
        .inc();
}

/// The one writer of every rank's `sibling_*` load: recomputes the sums from the fresh tables
/// when a reader changed one, and at least every quarter of the staleness bound (so a silent
/// sibling's bookings leave the sums on time); and the one that queues the siblings' new
/// prefill work on each rank's merged clock (a silent sibling's queued work then drains there
/// like any other).
async fn aggregate(router: Arc<Router>) {
    let share = &router.load_share;
    let stale_us = router.config.load_share.stale_ms * 1_000;
    let mut tick = tokio::time::interval(Duration::from_millis(
        (router.config.load_share.stale_ms / 4).max(1),
    ));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut dispatched = DispatchedWork::default();
    loop {
        tokio::select! {
            _ = router.shutdown.cancelled() => return,
            _ = share.changed.notified() => {}
            _ = tick.tick() => {}
        }
        let now = clock_us();
        let mut fresh_siblings = 0i64;
        {
            let tables = share.tables.lock();
            let fresh = || tables.iter().filter(|(_, t)| t.is_fresh(now, stale_us));
            let added = dispatched.take(fresh(), now);
            // Per rank: the siblings' in-flight requests, queued prefill tokens, and prefill
            // work new since the last aggregation.
            let mut sums: HashMap<(&str, u32), (u64, u64, u64)> = HashMap::new();
            for (_, table) in fresh() {
                fresh_siblings += 1;
                for (key, held) in &table.ranks {
                    let entry = sums.entry((&*key.worker_url, key.dp_rank)).or_default();
                    entry.0 = entry.0.saturating_add(held.in_flight);
                    entry.1 = entry.1.saturating_add(held.queued_prefill_tokens);
                }
            }
            for (key, &work_us) in &added {
                sums.entry((&*key.worker_url, key.dp_rank)).or_default().2 = work_us;
            }
            for w in router.registry.workers() {
                for (dp, load) in w.ranks.iter().enumerate() {
                    let (in_flight, queued, new_work_us) = sums
                        .get(&(w.url.as_str(), dp as u32))
                        .copied()
                        .unwrap_or_default();
                    store_sibling_load(load, in_flight, queued);
                    if new_work_us > 0 {
                        load.queue_sibling_prefill(now, new_work_us);
                    }
                }
            }
        }
        router.metrics.load_share_siblings.set(fresh_siblings);
    }
}

/// Writes a rank's new sibling sums, and hands over to them the owner's placed bookings
/// (`crate::peer::cold_owner::book_placed`) that they now cover: a rise of the siblings'
/// in-flight requests and queued tokens on the rank is, first of all, the arrival of the
/// bookings of requests this replica placed for them. Without the hand-over a placed request
/// was counted twice, once placed and once shared, until its hold ran out, and the owner's own
/// copy of a cold prompt could then find the prompt's rank over the load bound and start it
/// on a second rank. A rise that belongs to another request releases a placed booking early,
/// which under-counts that rank only until the placed request's own booking arrives.
fn store_sibling_load(load: &RankLoad, in_flight: u64, queued: u64) {
    let in_flight = in_flight.min(i64::MAX as u64) as i64;
    let queued = queued.min(i64::MAX as u64) as i64;
    let in_flight_before = load.sibling_in_flight.swap(in_flight, Ordering::Relaxed);
    let queued_before = load
        .sibling_queued_prefill_tokens
        .swap(queued, Ordering::Relaxed);
    crate::peer::cold_owner::hand_over_placed(
        &load.placed_in_flight,
        in_flight.saturating_sub(in_flight_before),
    );
    crate::peer::cold_owner::hand_over_placed(
        &load.placed_queued_prefill_tokens,
        queued.saturating_sub(queued_before),
    );
}
