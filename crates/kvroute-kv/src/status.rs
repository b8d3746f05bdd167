//! The per-rank status table that `KvPlane::rank_states` reads.
//!
//! Two writers feed it (the rank's subscriber task: connection state; the pump: cursor, counters,
//! replaying, bootstrap state and held amounts) and the router's admin endpoints read it; a small lock is enough because updates are
//! per batch at most and never held across an await. Every update names the incarnation it speaks
//! for, so a subscriber of a removed registration cannot resurrect or overwrite a newer one.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_index::SkippedBlocks;
use parking_lot::RwLock;

use crate::metrics::KvMetrics;
use crate::rank_state::{BootstrapOutcome, RankCounters};

/// Where a rank's bootstrap is, for status pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootstrapState {
    /// The rank was registered without bootstrap.
    Off,
    /// Live batches are held until a graft or a release.
    Holding,
    /// A graft for the rank is running in slices; its later actions wait behind it.
    Grafting,
    /// Grafted; the gap to the held batches is being healed from the engine's replay.
    Healing,
    /// Grafted with nothing held; the splice proof is deferred.
    Proving,
    /// Being rebuilt from the engine's replay buffer.
    Rebuilding,
    /// Ended with this outcome.
    Settled(BootstrapOutcome),
}

impl BootstrapState {
    pub fn label(self) -> &'static str {
        match self {
            BootstrapState::Off => "off",
            BootstrapState::Holding => "holding",
            BootstrapState::Grafting => "grafting",
            BootstrapState::Healing => "healing",
            BootstrapState::Proving => "proving",
            BootstrapState::Rebuilding => "rebuilding",
            BootstrapState::Settled(_) => "settled",
        }
    }

    pub fn outcome(self) -> Option<BootstrapOutcome> {
        match self {
            BootstrapState::Settled(o) => Some(o),
            _ => None,
        }
    }
}

/// Identifies a rank across the plane.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankKey {
    pub url: Arc<str>,
    pub dp_rank: u32,
}

/// The subscriber's view of its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscriberState {
    /// Dialling the engine (it may not be up yet).
    Connecting,
    Connected,
    /// Lost the peer; the socket is reconnecting by itself.
    Disconnected,
    /// Connected, and a replay is filling a gap (live batches are held meanwhile).
    Replaying,
    Stopped,
}

impl SubscriberState {
    pub fn gauge_value(self) -> i64 {
        match self {
            SubscriberState::Connecting => 0,
            SubscriberState::Connected => 1,
            SubscriberState::Disconnected => 2,
            SubscriberState::Replaying => 3,
            SubscriberState::Stopped => 4,
        }
    }
}

/// What the pump reports of a rank's sequencing after each step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SequencingProgress {
    pub cursor: Option<i64>,
    pub history_complete: bool,
    pub counters: RankCounters,
    pub replaying: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RankStatus {
    pub worker_url: String,
    pub dp_rank: u32,
    pub model: String,
    pub incarnation: u64,
    /// Last applied seq (`None` before the first batch).
    pub cursor: Option<i64>,
    pub subscriber: SubscriberState,
    pub applied_batches: u64,
    pub duplicate_batches: u64,
    pub lost_batches: u64,
    pub replays: u64,
    pub publisher_restarts: u64,
    /// The index holds the publisher's whole stream since its seq 0 (see
    /// [`RankMachine::history_complete`](crate::rank_state::RankMachine::history_complete)):
    /// only such a rank may be named empty to a sibling.
    pub history_complete: bool,
    /// Where the rank's peer bootstrap is (`Off` when registered without one).
    pub bootstrap: BootstrapState,
    /// Batches (and their estimated bytes) the bootstrap holds back from the index: held by the
    /// rank's machine, or queued behind its running graft.
    pub held_batches: u64,
    pub held_bytes: u64,
    /// Blocks this incarnation's events named that the index did not take, by reason.
    pub skipped_blocks: SkippedBlocks,
    /// The block size the rank's events use, when it is not the model's (the last one seen):
    /// the rank is then blind to its cache until the router or the engine is reconfigured.
    pub foreign_block_size: Option<u32>,
}

struct Entry {
    status: RankStatus,
    socket: SubscriberState,
    replaying: bool,
}

impl Entry {
    fn effective(&self) -> SubscriberState {
        if self.replaying && self.socket == SubscriberState::Connected {
            SubscriberState::Replaying
        } else {
            self.socket
        }
    }
}

#[derive(Default)]
pub struct StatusTable {
    entries: RwLock<HashMap<RankKey, Entry>>,
}

impl StatusTable {
    pub fn insert(&self, key: RankKey, model: &str, incarnation: u64) {
        let status = RankStatus {
            worker_url: key.url.to_string(),
            dp_rank: key.dp_rank,
            model: model.to_string(),
            incarnation,
            cursor: None,
            subscriber: SubscriberState::Connecting,
            applied_batches: 0,
            duplicate_batches: 0,
            lost_batches: 0,
            replays: 0,
            publisher_restarts: 0,
            history_complete: false,
            bootstrap: BootstrapState::Off,
            held_batches: 0,
            held_bytes: 0,
            skipped_blocks: SkippedBlocks::default(),
            foreign_block_size: None,
        };
        self.entries.write().insert(
            key,
            Entry {
                status,
                socket: SubscriberState::Connecting,
                replaying: false,
            },
        );
    }

    pub fn remove(&self, key: &RankKey) {
        self.entries.write().remove(key);
    }

    pub fn set_socket_state(
        &self,
        key: &RankKey,
        incarnation: u64,
        state: SubscriberState,
        metrics: &KvMetrics,
    ) {
        self.update_current(key, incarnation, |e| {
            e.socket = state;
            Self::publish(key, e, metrics);
        });
    }

    pub fn update_from_pump(
        &self,
        key: &RankKey,
        incarnation: u64,
        progress: SequencingProgress,
        metrics: &KvMetrics,
    ) {
        let SequencingProgress {
            cursor,
            history_complete,
            counters,
            replaying,
        } = progress;
        self.update_current(key, incarnation, |e| {
            e.status.cursor = cursor;
            e.status.history_complete = history_complete;
            e.status.applied_batches = counters.applied_batches;
            e.status.duplicate_batches = counters.duplicate_batches;
            e.status.lost_batches = counters.lost_batches;
            e.status.replays = counters.replays_started;
            e.status.publisher_restarts = counters.publisher_restarts;
            let changed = e.replaying != replaying;
            e.replaying = replaying;
            if changed {
                Self::publish(key, e, metrics);
            }
        });
    }

    /// The pump's view of the rank's bootstrap.
    pub fn set_bootstrap(
        &self,
        key: &RankKey,
        incarnation: u64,
        state: BootstrapState,
        held_batches: u64,
        held_bytes: u64,
    ) {
        self.update_current(key, incarnation, |e| {
            e.status.bootstrap = state;
            e.status.held_batches = held_batches;
            e.status.held_bytes = held_bytes;
        });
    }

    /// The pump's running totals of what the index did not take from the rank's events.
    pub fn set_skipped(
        &self,
        key: &RankKey,
        incarnation: u64,
        skipped: SkippedBlocks,
        foreign_block_size: Option<u32>,
    ) {
        self.update_current(key, incarnation, |e| {
            e.status.skipped_blocks = skipped;
            if foreign_block_size.is_some() {
                e.status.foreign_block_size = foreign_block_size;
            }
        });
    }

    /// The model a registered rank belongs to.
    pub fn model_of(&self, key: &RankKey) -> Option<String> {
        self.entries.read().get(key).map(|e| e.status.model.clone())
    }

    /// Applies `update` to the entry of `key` only while it still belongs to `incarnation`, so a
    /// writer of a removed (or re-added) registration is ignored instead of overwriting the
    /// newer one. The write lock is held across `update` so the entry and its gauge change
    /// together.
    fn update_current(&self, key: &RankKey, incarnation: u64, update: impl FnOnce(&mut Entry)) {
        let mut entries = self.entries.write();
        if let Some(e) = entries
            .get_mut(key)
            .filter(|e| e.status.incarnation == incarnation)
        {
            update(e);
        }
    }

    fn publish(key: &RankKey, e: &mut Entry, metrics: &KvMetrics) {
        e.status.subscriber = e.effective();
        metrics
            .subscriber_state
            .with_label_values(&[&*key.url, key.dp_rank.to_string().as_str()])
            .set(e.status.subscriber.gauge_value());
    }

    pub fn snapshot(&self) -> Vec<RankStatus> {
        let mut out: Vec<RankStatus> = self
            .entries
            .read()
            .values()
            .map(|e| e.status.clone())
            .collect();
        out.sort_by(|a, b| (&a.worker_url, a.dp_rank).cmp(&(&b.worker_url, b.dp_rank)));
        out
    }
}
