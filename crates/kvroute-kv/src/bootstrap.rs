//! What the KV plane and the service's peer-bootstrap task say to each other.
//!
//! The service finds, fetches and vets a sibling's snapshot (off the pump) and decides when to give
//! up; the pump owns the index and every rank's [`RankMachine`](crate::rank_state::RankMachine),
//! so it alone can graft, splice and prove. Inputs go to the pump as messages through
//! [`KvPlane`](crate::KvPlane) methods, each naming the rank's incarnation so that an answer
//! about a removed or re-added worker is ignored; outputs come back as [`BootstrapEvent`]s on one
//! bounded channel that the service takes once ([`KvPlane::take_bootstrap_events`]).
//!
//! The events channel back-pressures the pump rather than dropping: a lost `Finished` would leave
//! readiness waiting on a rank that settled long ago. Its capacity covers every event a whole
//! fleet's bootstrap can produce at once, so the pump waits only when the service stops draining.
//! The consumer must therefore never wait on the pump (a graft receipt, a full pump channel) in
//! the task that drains the events, or the two can wait on each other.
//!
//! [`KvPlane::take_bootstrap_events`]: crate::KvPlane::take_bootstrap_events

use crate::rank_state::{BootstrapOutcome, Witness};
use crate::status::RankKey;

/// Events buffered for the service before the pumps wait. Each bootstrapping rank emits at most
/// one `Finished`, one `NeedFreshSnapshot` and `SPLICE_PROBE_ROUNDS_MAX` probes, so this covers
/// well over a thousand ranks settling at once.
pub const BOOTSTRAP_EVENTS_CAPACITY: usize = 8192;

/// Default pause before each sibling-cursor probe of a deferred splice proof. A probe asked at
/// once would only restate the snapshot the graft came from; waiting lets a batch published
/// just before the subscription (and missed) show up in the siblings' cursors, and lets a live
/// batch decide the proof instead.
pub const SPLICE_PROBE_INTERVAL_MS: u64 = 5_000;

/// What a bootstrapping rank needs from the service, or how its bootstrap ended.
#[derive(Debug, Clone, PartialEq)]
pub enum BootstrapEvent {
    /// The rank's bootstrap ended; exactly one per bootstrapping registration that was not
    /// removed first. Emitted only once the index reflects the outcome (after the graft, and
    /// before any later batch of the rank is applied).
    Finished {
        key: RankKey,
        incarnation: u64,
        outcome: BootstrapOutcome,
    },
    /// The graft left a gap that the engine could not heal: find one more snapshot, whose cursor
    /// for this rank is at least `min_cursor`, and graft it (the rank holds meanwhile). If none
    /// comes, release the rank.
    NeedFreshSnapshot {
        key: RankKey,
        incarnation: u64,
        min_cursor: i64,
    },
    /// Ask the siblings' cursor tables for this rank and answer with
    /// [`KvPlane::answer_probe`](crate::KvPlane::answer_probe) under `generation` (the pump has
    /// already paced the round).
    ProbeSiblings {
        key: RankKey,
        incarnation: u64,
        generation: u64,
        watermark: Witness,
    },
}

/// A rank a graft is offered to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraftTarget {
    pub key: RankKey,
    pub incarnation: u64,
}

/// What became of a graft offer, per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraftDisposition {
    /// The rank took the graft; its bootstrap continues from the snapshot's cursor.
    Taken,
    /// The plan has no cursor for the rank (it kept holding; release it `uncovered` or search on).
    Uncovered,
    /// The rank is not holding (already settled, proving a graft, rebuilding), or the cursor is
    /// older than its gap retry demands; nothing changed.
    Declined,
    /// The rank is removed, or registered again under another incarnation.
    Stale,
    /// The index refused the snapshot; the rank was released with outcome `rejected`.
    Rejected,
}

/// The answer to [`KvPlane::graft`](crate::KvPlane::graft): one disposition per offered rank,
/// in the order offered.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GraftReceipt {
    pub ranks: Vec<(RankKey, GraftDisposition)>,
}
