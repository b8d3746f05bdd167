//! Load sharing between sibling replicas: each replica streams its own per-rank bookings and the
//! cold prefixes it just routed to its siblings, and adds theirs to its own cost model and
//! pending table. This module is the state the `Router` owns (the followed tables, the outbox of
//! pending prefixes, the stream cap); the tasks that fill and serve it are in
//! `peer::load_share_tasks`, apart so the router does not depend on tasks that need the router.
//!
//! Why: every replica sees the same prefix state (each subscribes to every engine), but only
//! the requests IT routed. Behind a Service spreading clients over N replicas, each one
//! underestimates every rank's load about N times, all in the same direction, so they herd onto
//! the same warm rank; and a prefix one replica just sent to a rank is pending only in ITS table,
//! so the next request of that prefix, reaching another replica, is placed elsewhere and the
//! prefix is prefilled twice. The fix is to let each replica see what its siblings have in
//! flight and where they just sent new prefixes.
//!
//! Shape:
//! * Producer: `GET /internal/load_bookings` on the internal listener (behind its bearer token)
//!   answers with an endless stream of [`crate::peer::load_frame`] lines, one every
//!   `--load-share-interval-ms` at most, and only when a booking changed or a heartbeat is due
//!   ([`LOAD_SHARE_HEARTBEAT_MS`]). A push stream, not polling: a booking reaches the siblings
//!   one interval after it is made, with no request per update. The stream is pulled by the
//!   HTTP layer, so a sibling that stops reading costs one pending frame, never a queue; at
//!   most [`LOAD_SHARE_SUBSCRIBERS_MAX`] streams are served at once (503 beyond). A follower
//!   that asks (`?prefixes=1`) also gets the conversation prefixes this replica's tokenizers
//!   render, so a conversation's next turn reaching it is not rendered and tokenized again
//!   (`routing::tokenize`).
//! * Followers: one task per sibling in the peer registry (the registry sibling discovery
//!   fills; the same siblings the bootstrap asks) reads that sibling's stream into its
//!   [`SiblingBookings`], reconnecting with a bounded backoff. Readers only PUBLISH their table;
//! * the aggregator, the single writer of every rank's `sibling_*` atomics (`RankLoad`), sums the
//!   fresh tables whenever one changes and on a tick, so a silent sibling's bookings leave the
//!   sums `--load-share-stale-ms` after its last frame. The hot path reads three more atomics
//!   per rank and takes no lock.
//!
//! A booking is keyed by (worker URL, DP rank), so replicas share load on the engines they have
//! in common and ignore the rest. Bookings are state, not events (see `load_frame`): a request
//! that finished is gone from the sibling's next frame, and no lost message can leave a phantom.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_discovery::PeerUrl;
use parking_lot::Mutex;
use tokio::sync::Notify;

pub use crate::config::{
    DEFAULT_LOAD_SHARE_INTERVAL_MS, DEFAULT_LOAD_SHARE_STALE_MS, LOAD_SHARE_HEARTBEAT_MS,
    LOAD_SHARE_INTERVAL_MS_MAX, LOAD_SHARE_STALE_MS_MAX, LOAD_SHARE_STALE_MS_MIN, LoadShareConfig,
};
use crate::control::registry::clock_us;
use crate::peer::load_frame::{
    LOAD_FRAME_PENDING_BLOCKS_MAX, RankKey, SharedPending, SiblingBookings,
};

/// Path of the bookings stream.
pub const LOAD_BOOKINGS_PATH: &str = "/internal/load_bookings";
/// Media type of the bookings stream (newline-delimited frames).
pub const LOAD_BOOKINGS_CONTENT_TYPE: &str = "application/x-kvroute-load-bookings";
/// Pending prefixes held for the streams between two frames (a broadcast ring: a stream that
/// falls this far behind loses the oldest).
pub const LOAD_SHARE_PENDING_QUEUE_MAX: usize = 4_096;
/// Most bookings streams this replica serves at once (a fleet is a handful of replicas).
pub const LOAD_SHARE_SUBSCRIBERS_MAX: usize = 64;
/// Time to establish a connection to a sibling's internal listener.
pub const LOAD_SHARE_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// First and largest pause before reconnecting to a sibling whose stream failed.
pub const LOAD_SHARE_RECONNECT_BACKOFF_MIN_MS: u64 = 50;
pub const LOAD_SHARE_RECONNECT_BACKOFF_MAX_MS: u64 = 2_000;

/// What the follower side shares between its reader tasks and the aggregator, and the outbox
/// of pending prefixes the producer streams.
pub struct LoadShare {
    /// The latest table of every followed sibling, written by its reader.
    pub(crate) tables: Mutex<HashMap<PeerUrl, SiblingBookings>>,
    /// Woken by a reader after it changed a table.
    pub(crate) changed: Notify,
    /// Bounds the streams this replica serves (see `load_share_tasks::bookings_stream_response`).
    pub(crate) subscribers: Arc<tokio::sync::Semaphore>,
    /// Pending prefixes this replica routed, for every stream it serves (bounded: a stream
    /// that lags loses the oldest).
    pub(crate) pending_out: tokio::sync::broadcast::Sender<Arc<SharedPending>>,
}

impl Default for LoadShare {
    fn default() -> Self {
        LoadShare {
            tables: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            subscribers: Arc::new(tokio::sync::Semaphore::new(LOAD_SHARE_SUBSCRIBERS_MAX)),
            pending_out: tokio::sync::broadcast::channel(LOAD_SHARE_PENDING_QUEUE_MAX).0,
        }
    }
}

/// One followed sibling as `/workers` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SiblingStatus {
    pub sibling: String,
    pub fresh: bool,
    pub heard_ms_ago: u64,
    pub ranks: usize,
    pub in_flight: u64,
}

impl LoadShare {
    /// Offers a routed request's new pending blocks (`hashes`, already cut to the ones the rank
    /// does not hold) to the siblings' streams; free when no sibling subscribes.
    pub fn publish_pending(&self, model: &str, worker_url: &str, dp_rank: u32, hashes: &[u64]) {
        if hashes.is_empty() || self.pending_out.receiver_count() == 0 {
            return;
        }
        let _ = self.pending_out.send(Arc::new(SharedPending {
            model: model.to_string(),
            rank: RankKey {
                worker_url: worker_url.into(),
                dp_rank,
            },
            hashes: hashes[..hashes.len().min(LOAD_FRAME_PENDING_BLOCKS_MAX)].to_vec(),
        }));
    }

    /// The followed siblings and what they book, for `/workers`.
    pub fn siblings(&self, stale_ms: u64) -> Vec<SiblingStatus> {
        let now = clock_us();
        let mut out: Vec<SiblingStatus> = self
            .tables
            .lock()
            .iter()
            .map(|(peer, t)| SiblingStatus {
                sibling: peer.to_string(),
                fresh: t.is_fresh(now, stale_ms * 1_000),
                heard_ms_ago: now.saturating_sub(t.heard_at_us) / 1_000,
                ranks: t.ranks.len(),
                in_flight: t.ranks.iter().map(|(_, b)| b.in_flight).sum(),
            })
            .collect();
        out.sort_by(|a, b| a.sibling.cmp(&b.sibling));
        out
    }
}
