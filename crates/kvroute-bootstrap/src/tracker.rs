//! Per-rank bootstrap state: which ranks are still waiting for a snapshot, and what became of
//! each one.
//!
//! One entry per rank, keyed by whatever the caller names ranks with (the local `RankId`, or a
//! (worker url, dp rank) pair). Every registration mints a fresh [`Incarnation`] from one
//! counter that never repeats, and every verdict must name the incarnation it is about: a fetch,
//! graft or probe still in flight for a worker that was removed and added again carries the old
//! incarnation and is ignored, so it can never graft onto, or settle, the new one.
//!
//! The life of an entry is an explicit [`Phase`]:
//!
//! * `register`: (absent or any phase) -> `Pending`, new incarnation, gap retry unspent;
//! * `settle(o)`: `Pending` -> `Settled(o)` for every outcome but `gap`;
//! * `grafted`: `Pending` -> `Grafted` (a graft landed with nothing held; proof deferred);
//! * `settle(o)`: `Grafted` -> `Settled(o)` for `warm`, `warm_unwitnessed` (the proof),
//!   `from_origin` (a restarted engine's batch 0 replaced the graft) and `publisher_reset`;
//! * `on_gap`: `Pending` or `Grafted` -> `Pending` the first time per incarnation (one retry
//!   with a fresher snapshot), -> `Settled(gap)` the second time;
//! * `remove`: gone.
//!
//! `Grafted` is a recovered rank whose splice is not proven yet (nothing was held when the
//! graft landed); it already counts as recovered for readiness, and it ends `warm`,
//! `warm_unwitnessed` or down the gap path. `Settled` is terminal: later verdicts are ignored
//! until the rank is registered again.

use std::collections::HashMap;
use std::hash::Hash;

use thiserror::Error;

/// Names one registration of a rank. Minted from a counter that never repeats within a tracker,
/// so an old incarnation can only miss, never alias the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Incarnation(pub u64);

/// The coarse state of a rank, as exported in the `state` gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RankState {
    /// Waiting for a snapshot; its live batches are held.
    Pending,
    /// Its index is as complete as a warm sibling's (or provably needs nothing).
    Recovered,
    /// It runs cold from its live stream: whatever the engine held before is unknown here.
    Failed,
}

impl RankState {
    pub fn label(self) -> &'static str {
        match self {
            RankState::Pending => "pending",
            RankState::Recovered => "recovered",
            RankState::Failed => "failed",
        }
    }

    /// The gauge value: 0 pending, 1 recovered, 2 failed.
    pub fn gauge(self) -> i64 {
        match self {
            RankState::Pending => 0,
            RankState::Recovered => 1,
            RankState::Failed => 2,
        }
    }
}

/// What became of a rank's bootstrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Recovered: grafted, and the splice between the snapshot's cursor and the live stream
    /// was proven by sequence numbers.
    Warm,
    /// Recovered: grafted, but no batch, replay or sibling could witness the splice within the
    /// bounded number of probes; the graft is kept.
    WarmUnwitnessed,
    /// Recovered, as far as the fleet can: grafted and the splice proven like `warm`, but the
    /// sibling's own view of the rank did not reach back to the publisher's origin (it joined the
    /// stream mid-way or lost batches; its snapshot lists the rank in `partial_ranks`). This
    /// replica now sees what its sibling sees, not everything the engine holds, and will not
    /// name the rank complete to others either.
    WarmPartial,
    /// Failed: the live stream did not join the snapshot's cursor and neither the engine's replay
    /// nor the one fresher snapshot healed it; the graft was discarded.
    Gap,
    /// Failed: no snapshot had a cursor for the rank (the delivered one did not speak for it, or
    /// every sibling that answered knows nothing of it), and its engine could not rebuild it.
    Uncovered,
    /// Failed: the search ended (timed out, no peers, fleet cold) without a snapshot.
    Abandoned,
    /// Failed: the held batches passed their count or byte bound; they were applied cold.
    Overflow,
    /// Failed: the publisher restarted (not at seq 0) while the rank was being bootstrapped.
    PublisherReset,
    /// Failed: the graft itself was refused by the index.
    Rejected,
    /// Recovered: the rank's stream began at seq 0 while we watched, so nothing was missed.
    FromOrigin,
    /// Recovered: the rank holds nothing (a fresh engine): every sibling that holds its whole
    /// history says so, or the engine's replay from seq 0 returned nothing.
    Empty,
    /// Recovered: rebuilt exactly from the engine's replay buffer, which reached back to seq 0.
    FromEngineReplay,
}

impl Outcome {
    pub const ALL: [Outcome; 12] = [
        Outcome::Warm,
        Outcome::WarmUnwitnessed,
        Outcome::WarmPartial,
        Outcome::Gap,
        Outcome::Uncovered,
        Outcome::Abandoned,
        Outcome::Overflow,
        Outcome::PublisherReset,
        Outcome::Rejected,
        Outcome::FromOrigin,
        Outcome::Empty,
        Outcome::FromEngineReplay,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Warm => "warm",
            Outcome::WarmUnwitnessed => "warm_unwitnessed",
            Outcome::WarmPartial => "warm_partial",
            Outcome::Gap => "gap",
            Outcome::Uncovered => "uncovered",
            Outcome::Abandoned => "abandoned",
            Outcome::Overflow => "overflow",
            Outcome::PublisherReset => "publisher_reset",
            Outcome::Rejected => "rejected",
            Outcome::FromOrigin => "from_origin",
            Outcome::Empty => "empty",
            Outcome::FromEngineReplay => "from_engine_replay",
        }
    }

    /// The state a rank settled with this outcome is in.
    pub fn state(self) -> RankState {
        match self {
            Outcome::Warm
            | Outcome::WarmUnwitnessed
            | Outcome::WarmPartial
            | Outcome::FromOrigin
            | Outcome::Empty
            | Outcome::FromEngineReplay => RankState::Recovered,
            Outcome::Gap
            | Outcome::Uncovered
            | Outcome::Abandoned
            | Outcome::Overflow
            | Outcome::PublisherReset
            | Outcome::Rejected => RankState::Failed,
        }
    }

    /// Position in [`Outcome::ALL`] (declaration order).
    fn index(self) -> usize {
        self as usize
    }
}

/// Where an entry is in its life; see the module doc for the transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Pending,
    /// Grafted with nothing held: recovered, splice proof outstanding.
    Grafted,
    Settled(Outcome),
}

impl Phase {
    pub fn state(self) -> RankState {
        match self {
            Phase::Pending => RankState::Pending,
            Phase::Grafted => RankState::Recovered,
            Phase::Settled(o) => o.state(),
        }
    }
}

/// One rank's entry, as read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankStatus {
    pub incarnation: Incarnation,
    pub phase: Phase,
    /// The one gap retry of this incarnation has been spent.
    pub gap_retried: bool,
}

/// Why a verdict changed nothing. The caller logs it at debug and moves on: every one of these
/// is a normal race (a verdict arriving after the rank was removed, re-added or settled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Ignored {
    #[error("the rank is not registered")]
    UnknownRank,
    #[error("the verdict is about incarnation {got:?}, the rank is now {current:?}")]
    StaleIncarnation {
        got: Incarnation,
        current: Incarnation,
    },
    #[error("the rank already settled as {0:?}")]
    AlreadySettled(Outcome),
    #[error("outcome {outcome:?} cannot follow phase {phase:?}")]
    NotAllowed { phase: Phase, outcome: Outcome },
}

/// What a gap led to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapDecision {
    /// First gap of this incarnation: the rank is Pending again and must be swept with a
    /// freshness floor newer than the gap (its held batches are kept).
    Retry,
    /// The retry was spent: the rank settled `gap`.
    Settled,
}

/// Counts for metrics: ranks per state and per outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TrackerCounts {
    pub pending: usize,
    pub recovered: usize,
    pub failed: usize,
    /// Recovered ranks whose splice proof is still outstanding (included in `recovered`).
    pub grafted: usize,
    /// Settled ranks per outcome, indexed like [`Outcome::ALL`].
    pub outcomes: [usize; 11],
}

impl TrackerCounts {
    pub fn outcome(&self, o: Outcome) -> usize {
        self.outcomes[o.index()]
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    incarnation: Incarnation,
    phase: Phase,
    gap_retried: bool,
}

/// The per-rank bootstrap tracker. Not thread-safe by design: the service keeps it behind the
/// same owner that applies verdicts (the pump), so every transition is ordered.
#[derive(Debug, Clone)]
pub struct BootstrapTracker<K> {
    entries: HashMap<K, Entry>,
    next_incarnation: u64,
}

impl<K: Eq + Hash + Clone> Default for BootstrapTracker<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Eq + Hash + Clone> BootstrapTracker<K> {
    pub fn new() -> Self {
        BootstrapTracker {
            entries: HashMap::new(),
            next_incarnation: 1,
        }
    }

    /// Registers `key` (again): a fresh incarnation, `Pending`, gap retry unspent. Anything
    /// still in flight for a previous registration becomes stale.
    pub fn register(&mut self, key: K) -> Incarnation {
        let incarnation = Incarnation(self.next_incarnation);
        self.next_incarnation += 1;
        self.entries.insert(
            key,
            Entry {
                incarnation,
                phase: Phase::Pending,
                gap_retried: false,
            },
        );
        incarnation
    }

    /// Forgets `key`; returns the incarnation it had.
    pub fn remove(&mut self, key: &K) -> Option<Incarnation> {
        self.entries.remove(key).map(|e| e.incarnation)
    }

    pub fn status(&self, key: &K) -> Option<RankStatus> {
        self.entries.get(key).map(|e| RankStatus {
            incarnation: e.incarnation,
            phase: e.phase,
            gap_retried: e.gap_retried,
        })
    }

    /// True while `key` is registered as `incarnation` and still `Pending`: a sweep owes it a
    /// snapshot.
    pub fn is_owed(&self, key: &K, incarnation: Incarnation) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.incarnation == incarnation && e.phase == Phase::Pending)
    }

    fn entry_for(&mut self, key: &K, incarnation: Incarnation) -> Result<&mut Entry, Ignored> {
        let entry = self.entries.get_mut(key).ok_or(Ignored::UnknownRank)?;
        if entry.incarnation != incarnation {
            return Err(Ignored::StaleIncarnation {
                got: incarnation,
                current: entry.incarnation,
            });
        }
        if let Phase::Settled(o) = entry.phase {
            return Err(Ignored::AlreadySettled(o));
        }
        Ok(entry)
    }

    /// Settles a rank with `outcome`. From `Pending` every outcome but `gap` is allowed (a gap
    /// goes through [`BootstrapTracker::on_gap`], which owns the retry budget). From `Grafted`
    /// only what can follow a graft: the proof's `warm` / `warm_unwitnessed` / `warm_partial`, a
    /// partial graft replaced by the engine's whole stream (`from_engine_replay`), a restarted
    /// engine's `from_origin`, or `publisher_reset`.
    pub fn settle(
        &mut self,
        key: &K,
        incarnation: Incarnation,
        outcome: Outcome,
    ) -> Result<(), Ignored> {
        let entry = self.entry_for(key, incarnation)?;
        let allowed = match entry.phase {
            Phase::Pending => outcome != Outcome::Gap,
            Phase::Grafted => matches!(
                outcome,
                Outcome::Warm
                    | Outcome::WarmUnwitnessed
                    | Outcome::WarmPartial
                    | Outcome::FromEngineReplay
                    | Outcome::FromOrigin
                    | Outcome::PublisherReset
            ),
            Phase::Settled(_) => false,
        };
        if !allowed {
            return Err(Ignored::NotAllowed {
                phase: entry.phase,
                outcome,
            });
        }
        entry.phase = Phase::Settled(outcome);
        Ok(())
    }

    /// A graft landed with nothing held: the rank is recovered, its splice proof outstanding.
    pub fn grafted(&mut self, key: &K, incarnation: Incarnation) -> Result<(), Ignored> {
        let entry = self.entry_for(key, incarnation)?;
        if entry.phase != Phase::Pending {
            return Err(Ignored::NotAllowed {
                phase: entry.phase,
                outcome: Outcome::Warm,
            });
        }
        entry.phase = Phase::Grafted;
        Ok(())
    }

    /// The live stream did not join the graft's cursor and the engine's replay could not cover
    /// the hole. The first time per incarnation the rank goes back to `Pending` for one retry
    /// with a fresher snapshot; the second time it settles `gap`.
    pub fn on_gap(&mut self, key: &K, incarnation: Incarnation) -> Result<GapDecision, Ignored> {
        let entry = self.entry_for(key, incarnation)?;
        if entry.gap_retried {
            entry.phase = Phase::Settled(Outcome::Gap);
            Ok(GapDecision::Settled)
        } else {
            entry.gap_retried = true;
            entry.phase = Phase::Pending;
            Ok(GapDecision::Retry)
        }
    }

    /// Every registered rank has left `Pending` (vacuously true with none registered: holding
    /// readiness until engines are discovered is the engine-discovery gate's job, not this one's).
    pub fn settled(&self) -> bool {
        self.entries.values().all(|e| e.phase != Phase::Pending)
    }

    pub fn any_pending(&self) -> bool {
        !self.settled()
    }

    /// The ranks still `Pending`, with their incarnations.
    pub fn pending(&self) -> impl Iterator<Item = (&K, Incarnation)> + '_ {
        self.entries
            .iter()
            .filter(|(_, e)| e.phase == Phase::Pending)
            .map(|(k, e)| (k, e.incarnation))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn counts(&self) -> TrackerCounts {
        let mut c = TrackerCounts::default();
        for e in self.entries.values() {
            match e.phase.state() {
                RankState::Pending => c.pending += 1,
                RankState::Recovered => c.recovered += 1,
                RankState::Failed => c.failed += 1,
            }
            match e.phase {
                Phase::Grafted => c.grafted += 1,
                Phase::Settled(o) => c.outcomes[o.index()] += 1,
                Phase::Pending => {}
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Tracker = BootstrapTracker<(String, u32)>;

    fn key(i: u32) -> (String, u32) {
        ("http://e:8000".to_string(), i)
    }

    fn phase(t: &Tracker, i: u32) -> Phase {
        t.status(&key(i)).unwrap().phase
    }

    #[test]
    fn registration_starts_pending_with_a_fresh_incarnation() {
        let mut t = Tracker::new();
        let a = t.register(key(0));
        let b = t.register(key(1));
        assert_ne!(a, b);
        assert_eq!(phase(&t, 0), Phase::Pending);
        assert!(t.is_owed(&key(0), a));
        assert!(!t.settled());
    }

    #[test]
    fn re_registration_mints_a_new_incarnation_and_stale_verdicts_are_ignored() {
        let mut t = Tracker::new();
        let old = t.register(key(0));
        let new = t.register(key(0));
        assert_ne!(old, new);
        assert_eq!(
            t.settle(&key(0), old, Outcome::Warm),
            Err(Ignored::StaleIncarnation {
                got: old,
                current: new
            })
        );
        assert_eq!(
            t.grafted(&key(0), old),
            Err(Ignored::StaleIncarnation {
                got: old,
                current: new
            })
        );
        assert!(matches!(
            t.on_gap(&key(0), old),
            Err(Ignored::StaleIncarnation { .. })
        ));
        assert_eq!(phase(&t, 0), Phase::Pending);
        assert!(!t.is_owed(&key(0), old));
    }

    #[test]
    fn a_removed_and_re_added_rank_never_takes_a_verdict_of_its_old_incarnation() {
        let mut t = Tracker::new();
        let old = t.register(key(0));
        assert_eq!(t.remove(&key(0)), Some(old));
        assert_eq!(
            t.settle(&key(0), old, Outcome::Warm),
            Err(Ignored::UnknownRank)
        );
        let new = t.register(key(0));
        assert!(new > old);
        assert!(t.settle(&key(0), old, Outcome::Warm).is_err());
        assert_eq!(phase(&t, 0), Phase::Pending);
    }

    #[test]
    fn every_outcome_but_gap_settles_a_pending_rank_into_its_state() {
        for o in Outcome::ALL {
            let mut t = Tracker::new();
            let inc = t.register(key(0));
            if o == Outcome::Gap {
                assert!(matches!(
                    t.settle(&key(0), inc, o),
                    Err(Ignored::NotAllowed { .. })
                ));
                continue;
            }
            t.settle(&key(0), inc, o).unwrap();
            assert_eq!(phase(&t, 0), Phase::Settled(o));
            assert_eq!(phase(&t, 0).state(), o.state());
            assert!(t.settled());
            assert!(!t.is_owed(&key(0), inc));
        }
    }

    #[test]
    fn recovered_and_failed_outcomes_are_partitioned_as_documented() {
        let recovered: Vec<&str> = Outcome::ALL
            .iter()
            .filter(|o| o.state() == RankState::Recovered)
            .map(|o| o.label())
            .collect();
        assert_eq!(
            recovered,
            [
                "warm",
                "warm_unwitnessed",
                "warm_partial",
                "from_origin",
                "empty",
                "from_engine_replay"
            ]
        );
        assert!(Outcome::ALL.iter().all(|o| o.state() != RankState::Pending));
        let labels: std::collections::HashSet<&str> =
            Outcome::ALL.iter().map(|o| o.label()).collect();
        assert_eq!(labels.len(), Outcome::ALL.len(), "labels are distinct");
    }

    #[test]
    fn a_settled_rank_ignores_later_verdicts() {
        let mut t = Tracker::new();
        let inc = t.register(key(0));
        t.settle(&key(0), inc, Outcome::Abandoned).unwrap();
        assert_eq!(
            t.settle(&key(0), inc, Outcome::Warm),
            Err(Ignored::AlreadySettled(Outcome::Abandoned))
        );
        assert_eq!(
            t.on_gap(&key(0), inc),
            Err(Ignored::AlreadySettled(Outcome::Abandoned))
        );
        assert_eq!(
            t.grafted(&key(0), inc),
            Err(Ignored::AlreadySettled(Outcome::Abandoned))
        );
        assert_eq!(phase(&t, 0), Phase::Settled(Outcome::Abandoned));
    }

    #[test]
    fn a_graft_with_nothing_held_is_recovered_and_settles_on_its_proof_or_the_engines_rebuild() {
        for proof in [
            Outcome::Warm,
            Outcome::WarmUnwitnessed,
            Outcome::WarmPartial,
            Outcome::FromEngineReplay,
        ] {
            let mut t = Tracker::new();
            let inc = t.register(key(0));
            t.grafted(&key(0), inc).unwrap();
            assert_eq!(phase(&t, 0), Phase::Grafted);
            assert_eq!(phase(&t, 0).state(), RankState::Recovered);
            assert!(t.settled(), "a grafted rank no longer holds readiness");
            t.settle(&key(0), inc, proof).unwrap();
            assert_eq!(phase(&t, 0), Phase::Settled(proof));
        }
    }

    #[test]
    fn a_grafted_rank_takes_from_origin_and_publisher_reset_but_not_search_outcomes() {
        for (o, ok) in [
            (Outcome::FromOrigin, true),
            (Outcome::PublisherReset, true),
            (Outcome::Abandoned, false),
            (Outcome::Uncovered, false),
            (Outcome::Empty, false),
            (Outcome::Overflow, false),
            (Outcome::Rejected, false),
            (Outcome::Gap, false),
        ] {
            let mut t = Tracker::new();
            let inc = t.register(key(0));
            t.grafted(&key(0), inc).unwrap();
            assert_eq!(t.settle(&key(0), inc, o).is_ok(), ok, "{o:?}");
            let expected = if ok {
                Phase::Settled(o)
            } else {
                Phase::Grafted
            };
            assert_eq!(phase(&t, 0), expected, "{o:?}");
        }
    }

    #[test]
    fn grafting_twice_is_refused() {
        let mut t = Tracker::new();
        let inc = t.register(key(0));
        t.grafted(&key(0), inc).unwrap();
        assert!(matches!(
            t.grafted(&key(0), inc),
            Err(Ignored::NotAllowed { .. })
        ));
    }

    #[test]
    fn the_first_gap_of_an_incarnation_retries_and_the_second_settles_gap() {
        let mut t = Tracker::new();
        let inc = t.register(key(0));
        assert_eq!(t.on_gap(&key(0), inc), Ok(GapDecision::Retry));
        assert_eq!(phase(&t, 0), Phase::Pending);
        assert!(t.status(&key(0)).unwrap().gap_retried);
        assert!(t.is_owed(&key(0), inc), "back in the sweep's hands");
        assert_eq!(t.on_gap(&key(0), inc), Ok(GapDecision::Settled));
        assert_eq!(phase(&t, 0), Phase::Settled(Outcome::Gap));
        assert_eq!(phase(&t, 0).state(), RankState::Failed);
    }

    #[test]
    fn a_gap_on_the_deferred_proof_path_goes_back_to_pending_once() {
        let mut t = Tracker::new();
        let inc = t.register(key(0));
        t.grafted(&key(0), inc).unwrap();
        assert_eq!(t.on_gap(&key(0), inc), Ok(GapDecision::Retry));
        assert_eq!(phase(&t, 0), Phase::Pending);
        assert!(!t.settled(), "a retry holds readiness again");
        t.grafted(&key(0), inc).unwrap();
        assert_eq!(t.on_gap(&key(0), inc), Ok(GapDecision::Settled));
        assert_eq!(phase(&t, 0), Phase::Settled(Outcome::Gap));
    }

    #[test]
    fn a_new_incarnation_gets_a_new_gap_retry() {
        let mut t = Tracker::new();
        let inc = t.register(key(0));
        assert_eq!(t.on_gap(&key(0), inc), Ok(GapDecision::Retry));
        let inc2 = t.register(key(0));
        assert!(!t.status(&key(0)).unwrap().gap_retried);
        assert_eq!(t.on_gap(&key(0), inc2), Ok(GapDecision::Retry));
    }

    #[test]
    fn settled_means_no_rank_is_pending() {
        let mut t = Tracker::new();
        assert!(t.settled(), "vacuous with no ranks");
        let a = t.register(key(0));
        let b = t.register(key(1));
        t.settle(&key(0), a, Outcome::Warm).unwrap();
        assert!(!t.settled());
        assert_eq!(t.pending().count(), 1);
        t.settle(&key(1), b, Outcome::Overflow).unwrap();
        assert!(t.settled());
        assert!(!t.any_pending());
    }

    #[test]
    fn counts_report_every_state_and_outcome() {
        let mut t = Tracker::new();
        let a = t.register(key(0));
        let b = t.register(key(1));
        let c = t.register(key(2));
        let _d = t.register(key(3));
        t.settle(&key(0), a, Outcome::Warm).unwrap();
        t.settle(&key(1), b, Outcome::Gap).unwrap_err();
        t.settle(&key(1), b, Outcome::Uncovered).unwrap();
        t.grafted(&key(2), c).unwrap();
        let n = t.counts();
        assert_eq!((n.pending, n.recovered, n.failed, n.grafted), (1, 2, 1, 1));
        assert_eq!(n.outcome(Outcome::Warm), 1);
        assert_eq!(n.outcome(Outcome::Uncovered), 1);
        assert_eq!(n.outcomes.iter().sum::<usize>(), 2);
        assert_eq!(t.len(), 4);
    }
}
