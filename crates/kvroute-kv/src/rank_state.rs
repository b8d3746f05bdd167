//! The per-rank sequencing state machine of the pump: which batches of one engine rank get applied
//! to the index, in which order, and when a gap must be repaired through the engine's replay socket.
//!
//! It is pure and synchronous (no sockets, no clock, no index): it consumes live batches, replay
//! answers and reconnect notices, and emits [`Action`]s that the pump executes. That keeps every
//! ordering rule testable in isolation, and keeps the one subtle invariant in one place:
//! **a batch is applied at most once and in increasing sequence order within one publisher
//! incarnation** (`cursor` = last applied seq). Applying out of order could re-store a block after
//! its removal and leave a phantom carrier in the index.
//!
//! Restart detection relies on ZMQ's per-connection ordering: one SUB connection delivers a
//! publisher's batches in order, so the *live* stream going backwards (or returning to seq 0 once a
//! cursor is past it) can only mean a new publisher, whose sequence restarted. A live seq at or
//! below the cursor that is not a regression of the live stream itself is a re-delivery of a batch
//! already obtained through replay, hence a duplicate.
//!
//! A publisher restart can also hide behind a reconnect: if the new publisher has already counted
//! past our cursor when the SUB reconnects, its seqs look like a continuation. Replays therefore
//! start AT the cursor when its batch's `ts` is known, and compare: the engine's batch at that seq
//! must be the one we applied (same `ts`), or the publisher is not the one the cursor speaks of.
//!
//! The machine is generic over the batch payload (anything with a [`Stamped::ts`]) so tests can
//! use plain markers.

use std::collections::VecDeque;

use kvroute_wire::EventBatch;

/// A batch's publish timestamp, which (with its seq) identifies it across publisher restarts.
pub trait Stamped {
    fn ts(&self) -> f64;
}

impl Stamped for EventBatch {
    fn ts(&self) -> f64 {
        self.ts
    }
}

/// Live batches held while a replay is in flight. Past this the replay is abandoned: the held
/// batches are applied and the gap counted lost, because holding without bound would let one slow
/// replay socket grow the router's memory and stall the rank indefinitely.
pub const HELD_BATCHES_MAX: usize = 4096;

/// What became of one replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// Every missing batch was obtained.
    Repaired,
    /// The engine answered, but some batches were no longer in its buffer (or the answer was cut
    /// short); the missing ones were counted lost.
    Incomplete,
    /// No usable answer (timeout, socket error, or abandoned because too much was held).
    Failed,
}

impl ReplayOutcome {
    pub fn label(self) -> &'static str {
        match self {
            ReplayOutcome::Repaired => "repaired",
            ReplayOutcome::Incomplete => "incomplete",
            ReplayOutcome::Failed => "failed",
        }
    }
}

/// An engine's answer to one replay request, already decoded by the replay task.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayAnswer<B> {
    /// Batches in the order received (may be empty, partial or overlapping what is already applied).
    Batches(Vec<(i64, B)>),
    Failed,
}

/// What the pump must do, in this order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<B> {
    /// Apply the batch to the index and set the rank's cursor to `seq`.
    Apply {
        seq: i64,
        batch: B,
    },
    /// The engine restarted: drop everything the rank carries, before any later `Apply`.
    ClearRank,
    /// Ask the rank's replay socket for batches `from_seq..`; answers with another generation are
    /// stale. Batches at or after `stop_before` are already held and need not be fetched.
    StartReplay {
        generation: u64,
        from_seq: i64,
        stop_before: Option<i64>,
    },
    Duplicate {
        seq: i64,
    },
    Lost {
        batches: u64,
    },
    PublisherRestarted,
    ReplayFinished {
        outcome: ReplayOutcome,
    },
}

/// `(seq, ts)` of an applied batch that a replay answer must reproduce.
pub type Witness = (i64, f64);

/// Where the rank is in its sequencing.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase<B> {
    /// Batches are applied as they arrive.
    Live,
    /// A replay is in flight; live batches wait in `held` (ascending seq) until it answers.
    Replaying {
        generation: u64,
        from_seq: i64,
        /// `(cursor, ts)` of the applied batch the answer must reproduce, when it is known.
        verify: Option<Witness>,
        held: VecDeque<(i64, B)>,
    },
}

/// Counters kept per rank for status reporting (the pump mirrors them into metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankCounters {
    pub applied_batches: u64,
    pub duplicate_batches: u64,
    pub lost_batches: u64,
    pub publisher_restarts: u64,
    pub replays_started: u64,
}

#[derive(Debug, Clone)]
pub struct RankMachine<B> {
    cursor: Option<i64>,
    /// `ts` of the batch at `cursor`.
    cursor_ts: Option<f64>,
    /// Last seq received on the live stream (not replay): the restart detector.
    last_live_seq: Option<i64>,
    phase: Phase<B>,
    next_generation: u64,
    has_replay: bool,
    counters: RankCounters,
}

impl<B: Stamped> RankMachine<B> {
    /// A rank that has applied nothing yet. `has_replay`: the rank has a replay endpoint.
    pub fn new(has_replay: bool) -> Self {
        Self {
            cursor: None,
            cursor_ts: None,
            last_live_seq: None,
            phase: Phase::Live,
            next_generation: 0,
            has_replay,
            counters: RankCounters::default(),
        }
    }

    /// Last applied seq; `None` before the first batch. After a restart detected mid-stream it is
    /// -1 ("before the new publisher's origin") until the new stream's first batch is applied.
    pub fn cursor(&self) -> Option<i64> {
        self.cursor
    }

    pub fn phase(&self) -> &Phase<B> {
        &self.phase
    }

    pub fn counters(&self) -> RankCounters {
        self.counters
    }

    pub fn held_len(&self) -> usize {
        match &self.phase {
            Phase::Live => 0,
            Phase::Replaying { held, .. } => held.len(),
        }
    }

    /// A batch from the rank's SUB socket.
    pub fn on_live_batch(&mut self, seq: i64, batch: B, out: &mut Vec<Action<B>>) {
        if self.is_restart(seq, &batch) {
            self.restart(out);
        }
        self.last_live_seq = Some(seq);
        let held = match &mut self.phase {
            Phase::Live => return self.on_live_batch_while_live(seq, batch, out),
            Phase::Replaying { held, .. } => held,
        };
        if self.cursor.is_some_and(|c| seq <= c) || held.back().is_some_and(|(s, _)| seq <= *s) {
            self.counters.duplicate_batches += 1;
            out.push(Action::Duplicate { seq });
            return;
        }
        if held.len() < HELD_BATCHES_MAX {
            held.push_back((seq, batch));
            return;
        }
        // Overflow: give up on the replay rather than hold without bound.
        let (held, _) = self.leave_replaying();
        out.push(Action::ReplayFinished {
            outcome: ReplayOutcome::Failed,
        });
        for (s, b) in held {
            self.apply_in_order(s, b, out);
        }
        self.apply_in_order(seq, batch, out);
    }

    /// The SUB socket (re)connected: batches published while it was away (slow joiner, reconnect)
    /// are invisible to it, so ask replay for everything after the cursor.
    pub fn on_reconnect(&mut self, out: &mut Vec<Action<B>>) {
        if let (Phase::Live, Some(_), true) = (&self.phase, self.cursor, self.has_replay) {
            self.start_replay(None, VecDeque::new(), out);
        }
    }

    /// The answer to the replay of `generation`. Stale answers (the rank restarted or abandoned
    /// that replay meanwhile) are ignored.
    pub fn on_replay_answer(
        &mut self,
        generation: u64,
        answer: ReplayAnswer<B>,
        out: &mut Vec<Action<B>>,
    ) {
        match &self.phase {
            Phase::Replaying { generation: g, .. } if *g == generation => {}
            _ => return,
        }
        let (held, verify) = self.leave_replaying();
        let mut answer = answer;
        if let (Some((at, ts)), ReplayAnswer::Batches(batches)) = (verify, &mut answer)
            && let Some(pos) = batches.iter().position(|(s, _)| *s == at)
        {
            if batches[pos].1.ts() != ts {
                // Another publisher counted past our cursor: everything applied is stale.
                self.restart(out);
                let stop_before = held.front().map(|(s, _)| *s);
                self.start_replay(stop_before, held, out);
                return;
            }
            // The witness is the batch already applied; it is neither new nor a duplicate.
            batches.remove(pos);
        }
        let lost_before = self.counters.lost_batches;
        let first_held = held.front().map(|(s, _)| *s);
        let failed = matches!(answer, ReplayAnswer::Failed);
        if let ReplayAnswer::Batches(mut batches) = answer {
            // The engine sends in order; sorting is cheap insurance for the apply-once invariant.
            batches.sort_by_key(|(s, _)| *s);
            for (s, b) in batches {
                if first_held.is_some_and(|f| s >= f) {
                    break;
                }
                self.apply_in_order(s, b, out);
            }
        }
        for (s, b) in held {
            self.apply_in_order(s, b, out);
        }
        let outcome = if failed {
            ReplayOutcome::Failed
        } else if self.counters.lost_batches == lost_before {
            ReplayOutcome::Repaired
        } else {
            ReplayOutcome::Incomplete
        };
        out.push(Action::ReplayFinished { outcome });
    }

    fn is_restart(&self, seq: i64, batch: &B) -> bool {
        let live_went_back = self.last_live_seq.is_some_and(|last| seq < last);
        let back_to_origin = seq == 0 && self.cursor.is_some_and(|c| c > 0);
        // Same seq as the applied batch but another payload: only a new publisher does that
        // (this catches a restart when the cursor was still 0).
        let other_batch_at_cursor =
            self.cursor == Some(seq) && self.cursor_ts.is_some_and(|ts| ts != batch.ts());
        live_went_back || back_to_origin || other_batch_at_cursor
    }

    fn restart(&mut self, out: &mut Vec<Action<B>>) {
        if matches!(self.phase, Phase::Replaying { .. }) {
            // The held batches belong to the dead publisher; ClearRank wipes what they would add.
            let _ = self.leave_replaying();
            out.push(Action::ReplayFinished {
                outcome: ReplayOutcome::Failed,
            });
        }
        self.counters.publisher_restarts += 1;
        out.push(Action::PublisherRestarted);
        out.push(Action::ClearRank);
        // -1, not None: the new publisher counts from 0, so a first live seq > 0 is a gap that
        // replay can fill from the new publisher's buffer.
        self.cursor = Some(-1);
        self.cursor_ts = None;
    }

    fn on_live_batch_while_live(&mut self, seq: i64, batch: B, out: &mut Vec<Action<B>>) {
        match self.cursor {
            Some(c) if seq > c + 1 && self.has_replay => {
                self.start_replay(Some(seq), VecDeque::from([(seq, batch)]), out);
            }
            _ => self.apply_in_order(seq, batch, out),
        }
    }

    /// Replays from the cursor (to verify it) when its batch's ts is known, else from the cursor
    /// plus one. Only called with a cursor.
    fn start_replay(
        &mut self,
        stop_before: Option<i64>,
        held: VecDeque<(i64, B)>,
        out: &mut Vec<Action<B>>,
    ) {
        let cursor = self.cursor.unwrap_or(-1);
        let verify = match self.cursor_ts {
            Some(ts) if cursor >= 0 => Some((cursor, ts)),
            _ => None,
        };
        let from_seq = if verify.is_some() { cursor } else { cursor + 1 };
        let generation = self.next_generation;
        self.next_generation += 1;
        self.counters.replays_started += 1;
        self.phase = Phase::Replaying {
            generation,
            from_seq,
            verify,
            held,
        };
        out.push(Action::StartReplay {
            generation,
            from_seq,
            stop_before,
        });
    }

    fn leave_replaying(&mut self) -> (VecDeque<(i64, B)>, Option<Witness>) {
        match std::mem::replace(&mut self.phase, Phase::Live) {
            Phase::Live => (VecDeque::new(), None),
            Phase::Replaying { held, verify, .. } => (held, verify),
        }
    }

    /// The cursor filter every applied batch passes through.
    fn apply_in_order(&mut self, seq: i64, batch: B, out: &mut Vec<Action<B>>) {
        if let Some(c) = self.cursor {
            if seq <= c {
                self.counters.duplicate_batches += 1;
                out.push(Action::Duplicate { seq });
                return;
            }
            if seq > c + 1 {
                let missing = (seq - c - 1) as u64;
                self.counters.lost_batches += missing;
                out.push(Action::Lost { batches: missing });
            }
        }
        self.cursor = Some(seq);
        self.cursor_ts = Some(batch.ts());
        self.counters.applied_batches += 1;
        out.push(Action::Apply { seq, batch });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type M = RankMachine<&'static str>;

    /// Test batches are named; the name stands in for the publish time, so two batches with the
    /// same seq but different names come from different publishers.
    impl Stamped for &'static str {
        fn ts(&self) -> f64 {
            self.bytes().fold(0u64, |h, b| h * 31 + u64::from(b)) as f64
        }
    }

    fn live(m: &mut M, seq: i64, b: &'static str) -> Vec<Action<&'static str>> {
        let mut out = Vec::new();
        m.on_live_batch(seq, b, &mut out);
        out
    }

    fn apply(seq: i64, batch: &'static str) -> Action<&'static str> {
        Action::Apply { seq, batch }
    }

    fn replaying_generation(m: &M) -> u64 {
        match m.phase() {
            Phase::Replaying { generation, .. } => *generation,
            Phase::Live => panic!("expected Replaying, machine is Live"),
        }
    }

    #[test]
    fn first_batch_ever_is_applied_whatever_its_seq() {
        let mut m = M::new(true);
        assert_eq!(live(&mut m, 41, "a"), vec![apply(41, "a")]);
        assert_eq!(m.cursor(), Some(41));
    }

    #[test]
    fn consecutive_batches_are_applied_and_advance_the_cursor() {
        let mut m = M::new(true);
        live(&mut m, 0, "a");
        assert_eq!(live(&mut m, 1, "b"), vec![apply(1, "b")]);
        assert_eq!(m.cursor(), Some(1));
        assert_eq!(m.counters().applied_batches, 2);
    }

    #[test]
    fn batch_at_or_below_the_cursor_is_a_counted_duplicate() {
        let mut m = M::new(true);
        live(&mut m, 5, "a");
        live(&mut m, 6, "b");
        // A re-delivery equal to the cursor, with the live stream not going backwards.
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        let g = replaying_generation(&m);
        m.on_replay_answer(g, ReplayAnswer::Batches(vec![(7, "c"), (8, "d")]), &mut out);
        assert_eq!(m.cursor(), Some(8));
        assert_eq!(live(&mut m, 7, "c"), vec![Action::Duplicate { seq: 7 }]);
        assert_eq!(live(&mut m, 8, "d"), vec![Action::Duplicate { seq: 8 }]);
        assert_eq!(m.counters().duplicate_batches, 2);
        assert_eq!(m.cursor(), Some(8));
    }

    #[test]
    fn seq_zero_after_a_cursor_past_zero_is_a_restart_that_clears_then_applies() {
        let mut m = M::new(true);
        live(&mut m, 9, "a");
        let out = live(&mut m, 0, "new");
        assert_eq!(
            out,
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                apply(0, "new")
            ]
        );
        assert_eq!(m.cursor(), Some(0));
        assert_eq!(m.counters().publisher_restarts, 1);
    }

    #[test]
    fn a_different_batch_at_the_cursor_seq_is_a_restart_even_at_seq_zero() {
        let mut m = M::new(true);
        live(&mut m, 0, "a");
        assert_eq!(
            live(&mut m, 0, "other"),
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                apply(0, "other")
            ]
        );
        // The very same batch again is only a duplicate.
        assert_eq!(live(&mut m, 0, "other"), vec![Action::Duplicate { seq: 0 }]);
    }

    #[test]
    fn live_stream_going_backwards_is_a_restart_and_replays_the_new_origin() {
        let mut m = M::new(true);
        live(&mut m, 500, "a");
        // The new publisher's batch 0 and 1 were lost to the slow joiner.
        let out = live(&mut m, 2, "n2");
        assert_eq!(
            out,
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                Action::StartReplay {
                    generation: 0,
                    from_seq: 0,
                    stop_before: Some(2)
                }
            ]
        );
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(0, "n0"), (1, "n1"), (2, "n2")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(0, "n0"),
                apply(1, "n1"),
                apply(2, "n2"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
    }

    #[test]
    fn restart_without_replay_counts_the_new_streams_missed_batches_lost() {
        let mut m = M::new(false);
        live(&mut m, 100, "a");
        let out = live(&mut m, 3, "n3");
        assert_eq!(
            out,
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                Action::Lost { batches: 3 },
                apply(3, "n3")
            ]
        );
    }

    #[test]
    fn batch_at_cursor_plus_two_starts_a_replay_and_holds_live_batches() {
        let mut m = M::new(true);
        live(&mut m, 3, "a");
        let out = live(&mut m, 5, "c");
        // From the cursor itself: the engine's batch 3 is the witness that it is the same publisher.
        assert_eq!(
            out,
            vec![Action::StartReplay {
                generation: 0,
                from_seq: 3,
                stop_before: Some(5)
            }]
        );
        assert_eq!(live(&mut m, 6, "d"), vec![]);
        assert_eq!(m.held_len(), 2);
        assert_eq!(m.cursor(), Some(3), "nothing applied while replaying");
    }

    #[test]
    fn replay_answer_fills_the_gap_then_applies_held_batches_once_in_order() {
        let mut m = M::new(true);
        live(&mut m, 3, "a");
        live(&mut m, 5, "c");
        live(&mut m, 6, "d");
        let mut out = Vec::new();
        // The engine also returns 5 and 6, which are held: each must be applied exactly once.
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(4, "b"), (5, "c"), (6, "d")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(4, "b"),
                apply(5, "c"),
                apply(6, "d"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
        assert_eq!(m.cursor(), Some(6));
        assert!(matches!(m.phase(), Phase::Live));
        assert_eq!(m.counters().lost_batches, 0);
    }

    #[test]
    fn replay_missing_part_of_the_gap_is_incomplete_and_counts_the_rest_lost() {
        let mut m = M::new(true);
        live(&mut m, 3, "a");
        live(&mut m, 8, "h");
        let mut out = Vec::new();
        // Buffer no longer has 4 and 5.
        m.on_replay_answer(0, ReplayAnswer::Batches(vec![(6, "f"), (7, "g")]), &mut out);
        assert_eq!(
            out,
            vec![
                Action::Lost { batches: 2 },
                apply(6, "f"),
                apply(7, "g"),
                apply(8, "h"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Incomplete
                }
            ]
        );
        assert_eq!(m.counters().lost_batches, 2);
    }

    #[test]
    fn failed_replay_counts_the_gap_lost_and_continues_from_the_live_stream() {
        let mut m = M::new(true);
        live(&mut m, 3, "a");
        live(&mut m, 6, "d");
        live(&mut m, 7, "e");
        let mut out = Vec::new();
        m.on_replay_answer(0, ReplayAnswer::Failed, &mut out);
        assert_eq!(
            out,
            vec![
                Action::Lost { batches: 2 },
                apply(6, "d"),
                apply(7, "e"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Failed
                }
            ]
        );
    }

    #[test]
    fn gap_without_a_replay_endpoint_counts_lost_and_applies() {
        let mut m = M::new(false);
        live(&mut m, 3, "a");
        assert_eq!(
            live(&mut m, 7, "e"),
            vec![Action::Lost { batches: 3 }, apply(7, "e")]
        );
        assert_eq!(m.counters().lost_batches, 3);
    }

    #[test]
    fn stale_replay_answer_is_ignored() {
        let mut m = M::new(true);
        live(&mut m, 3, "a");
        live(&mut m, 5, "c");
        let mut out = Vec::new();
        m.on_replay_answer(7, ReplayAnswer::Batches(vec![(4, "b")]), &mut out);
        assert!(out.is_empty());
        assert_eq!(m.held_len(), 1);
    }

    #[test]
    fn overflowing_the_hold_abandons_the_replay_and_applies_held_in_order() {
        let mut m = M::new(true);
        live(&mut m, 0, "a");
        live(&mut m, 2, "x");
        for seq in 3..(2 + HELD_BATCHES_MAX as i64) {
            assert_eq!(live(&mut m, seq, "x"), vec![]);
        }
        assert_eq!(m.held_len(), HELD_BATCHES_MAX);
        let overflow_seq = 2 + HELD_BATCHES_MAX as i64;
        let out = live(&mut m, overflow_seq, "last");
        assert_eq!(
            out[0],
            Action::ReplayFinished {
                outcome: ReplayOutcome::Failed
            }
        );
        assert_eq!(out[1], Action::Lost { batches: 1 });
        let applied: Vec<i64> = out
            .iter()
            .filter_map(|a| match a {
                Action::Apply { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect();
        let expected: Vec<i64> = (2..=overflow_seq).collect();
        assert_eq!(applied, expected);
        assert!(matches!(m.phase(), Phase::Live));
        // The late answer of the abandoned replay must not apply anything.
        let mut late = Vec::new();
        m.on_replay_answer(0, ReplayAnswer::Batches(vec![(1, "b")]), &mut late);
        assert!(late.is_empty());
    }

    #[test]
    fn restart_while_replaying_drops_held_batches_and_the_old_replay() {
        let mut m = M::new(true);
        live(&mut m, 10, "a");
        live(&mut m, 12, "c");
        let out = live(&mut m, 0, "n0");
        assert_eq!(
            out,
            vec![
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Failed
                },
                Action::PublisherRestarted,
                Action::ClearRank,
                apply(0, "n0")
            ]
        );
        let mut late = Vec::new();
        m.on_replay_answer(0, ReplayAnswer::Batches(vec![(11, "b")]), &mut late);
        assert!(late.is_empty(), "old replay answer applied: {late:?}");
        assert_eq!(m.cursor(), Some(0));
    }

    #[test]
    fn duplicate_live_batch_while_replaying_is_not_held_twice() {
        let mut m = M::new(true);
        live(&mut m, 1, "a");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        assert_eq!(live(&mut m, 1, "a"), vec![Action::Duplicate { seq: 1 }]);
        assert_eq!(m.held_len(), 0);
    }

    #[test]
    fn reconnect_with_a_cursor_replays_from_the_cursor_to_verify_it() {
        let mut m = M::new(true);
        live(&mut m, 4, "a");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        assert_eq!(
            out,
            vec![Action::StartReplay {
                generation: 0,
                from_seq: 4,
                stop_before: None
            }]
        );
        // Live batches that arrive meanwhile are held; the replay brings the one the SUB missed.
        assert_eq!(live(&mut m, 6, "c"), vec![]);
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(4, "a"), (5, "b"), (6, "c")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(5, "b"),
                apply(6, "c"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
    }

    #[test]
    fn reconnect_without_cursor_or_replay_endpoint_does_nothing() {
        let mut fresh = M::new(true);
        let mut out = Vec::new();
        fresh.on_reconnect(&mut out);
        assert!(out.is_empty());
        let mut no_replay = M::new(false);
        live(&mut no_replay, 1, "a");
        no_replay.on_reconnect(&mut out);
        assert!(out.is_empty());
        assert!(matches!(no_replay.phase(), Phase::Live));
    }

    #[test]
    fn reconnect_while_already_replaying_starts_no_second_replay() {
        let mut m = M::new(true);
        live(&mut m, 1, "a");
        live(&mut m, 3, "c");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        assert!(out.is_empty());
        assert_eq!(m.counters().replays_started, 1);
    }

    #[test]
    fn replayed_batches_never_reapply_below_the_cursor() {
        let mut m = M::new(true);
        live(&mut m, 4, "a");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        out.clear();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(2, "old"), (3, "old"), (5, "b")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                Action::Duplicate { seq: 2 },
                Action::Duplicate { seq: 3 },
                apply(5, "b"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
    }

    #[test]
    fn replay_witness_at_the_cursor_is_neither_applied_nor_a_duplicate() {
        let mut m = M::new(true);
        live(&mut m, 3, "a");
        live(&mut m, 5, "c");
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(3, "a"), (4, "b"), (5, "c")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(4, "b"),
                apply(5, "c"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
        assert_eq!(m.counters().duplicate_batches, 0);
    }

    #[test]
    fn replay_whose_cursor_batch_differs_is_a_restart_and_replays_from_origin() {
        let mut m = M::new(true);
        live(&mut m, 3, "old3");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        // A new publisher has already counted past 3 while the SUB was away.
        assert_eq!(live(&mut m, 6, "new6"), vec![]);
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(3, "new3"), (4, "new4"), (5, "new5")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                Action::StartReplay {
                    generation: 1,
                    from_seq: 0,
                    stop_before: Some(6)
                }
            ]
        );
        assert_eq!(m.held_len(), 1, "the new publisher's live batch stays held");
        let mut out = Vec::new();
        let fresh: Vec<(i64, &'static str)> = vec![
            (0, "n0"),
            (1, "n1"),
            (2, "n2"),
            (3, "new3"),
            (4, "new4"),
            (5, "new5"),
        ];
        m.on_replay_answer(1, ReplayAnswer::Batches(fresh), &mut out);
        let applied: Vec<i64> = out
            .iter()
            .filter_map(|a| match a {
                Action::Apply { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect();
        assert_eq!(applied, vec![0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(m.counters().publisher_restarts, 1);
        assert_eq!(m.counters().lost_batches, 0);
    }
}
