//! The bootstrap phases of [`RankMachine`]: holding, graft and splice, gap healing and the one
//! retry, the deferred proof (engine replay and sibling probes), rebuild from the engine's replay,
//! and the outcome each path reports. Batches are named markers; a name stands in for the
//! batch's `ts`, so two names at one seq are two publishers.

use super::*;

type M = RankMachine<&'static str>;
type Out = Vec<Action<&'static str>>;

/// A batch whose name starts with "heavy" costs a quarter of the byte bound, so four fill the
/// hold exactly and a fifth overflows it; any other costs one byte.
impl HeldCost for &'static str {
    fn held_bytes(&self) -> u64 {
        if self.starts_with("heavy") {
            BOOTSTRAP_HELD_BYTES_MAX / 4
        } else {
            1
        }
    }
}

fn boot(has_replay: bool) -> M {
    M::new_bootstrapping(has_replay)
}

fn live(m: &mut M, seq: i64, b: &'static str) -> Out {
    let mut out = Vec::new();
    m.on_live_batch(seq, b, &mut out);
    out
}

fn hold(m: &mut M, batches: &[(i64, &'static str)]) {
    for &(seq, b) in batches {
        assert_eq!(live(m, seq, b), vec![], "batch {seq} should be held");
    }
}

/// The watermark of a snapshot whose cursor is batch `seq` named `name`.
fn mark(seq: i64, name: &'static str) -> Witness {
    (seq, name.ts())
}

fn graft(m: &mut M, seq: i64, name: &'static str) -> (bool, Out) {
    let mut out = Vec::new();
    let took = m.on_graft(mark(seq, name), GraftHistory::Complete, &mut out);
    (took, out)
}

fn replay(m: &mut M, generation: u64, batches: Vec<(i64, &'static str)>) -> Out {
    let mut out = Vec::new();
    m.on_replay_answer(generation, ReplayAnswer::Batches(batches), &mut out);
    out
}

fn probe(m: &mut M, generation: u64, highest: Option<i64>) -> Out {
    let mut out = Vec::new();
    m.on_probe_answer(generation, highest, &mut out);
    out
}

fn apply(seq: i64, batch: &'static str) -> Action<&'static str> {
    Action::Apply { seq, batch }
}

fn done(outcome: BootstrapOutcome) -> Action<&'static str> {
    Action::BootstrapFinished { outcome }
}

fn applied(out: &Out) -> Vec<i64> {
    out.iter()
        .filter_map(|a| match a {
            Action::Apply { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect()
}

fn outcomes(out: &Out) -> Vec<BootstrapOutcome> {
    out.iter()
        .filter_map(|a| match a {
            Action::BootstrapFinished { outcome } => Some(*outcome),
            _ => None,
        })
        .collect()
}

fn probe_generation(out: &Out) -> u64 {
    out.iter()
        .find_map(|a| match a {
            Action::ProbeSiblings { generation, .. } => Some(*generation),
            _ => None,
        })
        .expect("a ProbeSiblings action")
}

// ---- holding ----

#[test]
fn bootstrapping_rank_holds_live_batches_and_applies_nothing() {
    let mut m = boot(true);
    hold(&mut m, &[(4, "b4"), (5, "b5")]);
    assert_eq!(m.held_len(), 2);
    assert_eq!(m.held_bytes(), 2);
    assert_eq!(m.cursor(), None);
    assert!(m.is_bootstrapping());
    assert_eq!(m.outcome(), None);
}

#[test]
fn first_live_batch_at_seq_zero_resolves_from_origin_and_applies_it() {
    let mut m = boot(true);
    assert_eq!(
        live(&mut m, 0, "b0"),
        vec![done(BootstrapOutcome::FromOrigin), apply(0, "b0")]
    );
    assert!(matches!(m.phase(), Phase::Live));
    assert_eq!(m.outcome(), Some(BootstrapOutcome::FromOrigin));
    assert_eq!(live(&mut m, 1, "b1"), vec![apply(1, "b1")]);
}

#[test]
fn duplicate_live_batch_while_holding_is_not_held_twice() {
    let mut m = boot(false);
    hold(&mut m, &[(4, "b4")]);
    assert_eq!(live(&mut m, 4, "b4"), vec![Action::Duplicate { seq: 4 }]);
    assert_eq!(m.held_len(), 1);
    assert_eq!(m.counters().duplicate_batches, 1);
}

#[test]
fn hold_overflows_by_count_one_past_the_batch_limit_and_runs_cold() {
    let mut m = boot(true);
    for seq in 1..=BOOTSTRAP_HELD_BATCHES_MAX as i64 {
        assert_eq!(live(&mut m, seq, "x"), vec![]);
    }
    assert_eq!(m.held_len(), BOOTSTRAP_HELD_BATCHES_MAX);
    let last = BOOTSTRAP_HELD_BATCHES_MAX as i64 + 1;
    let out = live(&mut m, last, "x");
    assert_eq!(out[0], done(BootstrapOutcome::Overflow));
    assert_eq!(applied(&out), (1..=last).collect::<Vec<_>>());
    assert_eq!(
        m.counters().lost_batches,
        0,
        "cold start counts nothing lost"
    );
    assert!(matches!(m.phase(), Phase::Live));
    assert_eq!(m.held_bytes(), 0);
}

#[test]
fn hold_overflows_by_bytes_one_batch_past_the_byte_limit_and_runs_cold() {
    let mut m = boot(false);
    hold(
        &mut m,
        &[(1, "heavy1"), (2, "heavy2"), (3, "heavy3"), (4, "heavy4")],
    );
    assert_eq!(
        m.held_bytes(),
        BOOTSTRAP_HELD_BYTES_MAX,
        "exactly full holds"
    );
    let out = live(&mut m, 5, "heavy5");
    assert_eq!(
        out,
        vec![
            done(BootstrapOutcome::Overflow),
            apply(1, "heavy1"),
            apply(2, "heavy2"),
            apply(3, "heavy3"),
            apply(4, "heavy4"),
            apply(5, "heavy5"),
        ]
    );
}

#[test]
fn restart_to_seq_zero_while_holding_drops_the_old_publishers_batches() {
    let mut m = boot(true);
    hold(&mut m, &[(7, "old7"), (8, "old8")]);
    assert_eq!(
        live(&mut m, 0, "new0"),
        vec![
            Action::PublisherRestarted,
            Action::ClearRank,
            done(BootstrapOutcome::FromOrigin),
            apply(0, "new0")
        ]
    );
    assert_eq!(m.cursor(), Some(0));
    assert_eq!(m.counters().publisher_restarts, 1);
}

#[test]
fn restart_past_zero_while_holding_is_a_publisher_reset_that_replays_the_new_origin() {
    let mut m = boot(true);
    hold(&mut m, &[(7, "old7"), (8, "old8")]);
    let out = live(&mut m, 3, "new3");
    assert_eq!(
        out,
        vec![
            Action::PublisherRestarted,
            Action::ClearRank,
            done(BootstrapOutcome::PublisherReset),
            Action::StartReplay {
                generation: 0,
                from_seq: 0,
                stop_before: Some(3)
            }
        ]
    );
    assert!(matches!(m.phase(), Phase::Replaying { .. }));
}

#[test]
fn release_applies_held_in_order_with_the_callers_outcome() {
    let mut m = boot(true);
    hold(&mut m, &[(4, "b4"), (5, "b5")]);
    let mut out = Vec::new();
    assert!(m.on_release(BootstrapOutcome::Abandoned, &mut out));
    assert_eq!(
        out,
        vec![
            done(BootstrapOutcome::Abandoned),
            apply(4, "b4"),
            apply(5, "b5")
        ]
    );
    assert_eq!(m.outcome(), Some(BootstrapOutcome::Abandoned));
    let mut again = Vec::new();
    assert!(!m.on_release(BootstrapOutcome::Uncovered, &mut again));
    assert!(again.is_empty(), "a settled rank is released once");
}

#[test]
fn release_of_a_rank_proving_its_graft_is_refused() {
    let mut m = boot(false);
    graft(&mut m, 5, "b5");
    let mut out = Vec::new();
    assert!(!m.on_release(BootstrapOutcome::Abandoned, &mut out));
    assert!(out.is_empty());
    assert!(matches!(m.phase(), Phase::Proving { .. }));
}

#[test]
fn a_rank_registered_without_bootstrap_never_holds() {
    let mut m = M::new(true);
    assert!(!m.is_bootstrapping());
    // Past ORIGIN_REPLAY_FIRST_SEQ_MAX, so the first batch applies at once.
    assert_eq!(live(&mut m, 70, "b70"), vec![apply(70, "b70")]);
    let (took, out) = graft(&mut m, 72, "b72");
    assert!(!took);
    assert!(out.is_empty());
}

// ---- graft on the held path ----

#[test]
fn graft_at_cursor_five_splices_a_first_held_batch_six() {
    let mut m = boot(false);
    hold(&mut m, &[(4, "b4"), (5, "b5"), (6, "b6"), (7, "b7")]);
    let (took, out) = graft(&mut m, 5, "b5");
    assert!(took);
    assert_eq!(
        out,
        vec![
            Action::Graft {
                watermark: mark(5, "b5")
            },
            done(BootstrapOutcome::Warm),
            apply(6, "b6"),
            apply(7, "b7")
        ]
    );
    assert_eq!(m.counters().reflected_batches, 2);
    assert_eq!(m.cursor(), Some(7));
    assert_eq!(m.counters().lost_batches, 0);
}

#[test]
fn graft_at_cursor_five_with_first_held_seven_is_a_gap() {
    let mut m = boot(false);
    hold(&mut m, &[(7, "b7"), (8, "b8")]);
    let (took, out) = graft(&mut m, 5, "b5");
    assert!(took);
    assert_eq!(
        out,
        vec![
            Action::Graft {
                watermark: mark(5, "b5")
            },
            Action::DiscardGraft,
            Action::RequestFreshSnapshot { min_cursor: 6 }
        ]
    );
    assert!(matches!(
        m.phase(),
        Phase::Holding {
            min_cursor: Some(6),
            ..
        }
    ));
    assert_eq!(m.held_len(), 2, "held batches are kept for the retry");
    assert_eq!(m.cursor(), None, "the discarded graft leaves no cursor");
}

#[test]
fn graft_action_precedes_the_apply_of_a_held_removal() {
    // Held: 6 stores X, 7 removes X. The snapshot (cursor 5) holds X. The removal must be applied
    // after the graft, so the pump's graft cannot bring X back.
    let mut m = boot(false);
    hold(&mut m, &[(6, "store-x"), (7, "remove-x")]);
    let (_, out) = graft(&mut m, 5, "b5");
    let graft_at = out
        .iter()
        .position(|a| matches!(a, Action::Graft { .. }))
        .expect("graft action");
    let removal_at = out
        .iter()
        .position(|a| *a == apply(7, "remove-x"))
        .expect("removal applied");
    assert!(graft_at < removal_at, "{out:?}");
    assert_eq!(graft_at, 0, "nothing of the rank may run before its graft");
}

#[test]
fn graft_delivered_twice_is_ignored() {
    let mut m = boot(false);
    hold(&mut m, &[(6, "b6")]);
    assert!(graft(&mut m, 5, "b5").0);
    let (took, out) = graft(&mut m, 5, "b5");
    assert!(!took);
    assert!(out.is_empty());
    assert_eq!(m.cursor(), Some(6));
}

#[test]
fn gap_is_healed_exactly_from_replay_asked_from_the_watermark() {
    let mut m = boot(true);
    hold(&mut m, &[(8, "b8"), (9, "b9")]);
    let (_, out) = graft(&mut m, 5, "b5");
    assert_eq!(
        out[1],
        Action::StartReplay {
            generation: 0,
            from_seq: 5,
            stop_before: Some(8)
        }
    );
    assert!(matches!(m.phase(), Phase::Healing { .. }));
    let out = replay(&mut m, 0, vec![(5, "b5"), (6, "b6"), (7, "b7")]);
    assert_eq!(
        out,
        vec![
            done(BootstrapOutcome::Warm),
            apply(6, "b6"),
            apply(7, "b7"),
            apply(8, "b8"),
            apply(9, "b9")
        ]
    );
    assert_eq!(m.counters().lost_batches, 0);
}

#[test]
fn heal_answer_without_the_watermark_batch_still_splices_when_the_gap_is_whole() {
    let mut m = boot(true);
    hold(&mut m, &[(7, "b7")]);
    graft(&mut m, 5, "b5");
    let out = replay(&mut m, 0, vec![(6, "b6")]);
    assert_eq!(applied(&out), vec![6, 7]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::Warm]);
}

#[test]
fn incomplete_heal_asks_once_for_a_fresher_snapshot_keeping_held_batches() {
    let mut m = boot(true);
    hold(&mut m, &[(9, "b9")]);
    graft(&mut m, 5, "b5");
    // 6 and 7 are gone from the engine's buffer.
    let out = replay(&mut m, 0, vec![(8, "b8")]);
    assert_eq!(
        out,
        vec![
            Action::DiscardGraft,
            Action::RequestFreshSnapshot { min_cursor: 8 }
        ]
    );
    assert_eq!(m.held_len(), 1);
    assert_eq!(m.cursor(), None);
    assert_eq!(m.outcome(), None, "a retry is not terminal");
}

#[test]
fn failed_heal_falls_back_to_the_retry() {
    let mut m = boot(true);
    hold(&mut m, &[(9, "b9")]);
    graft(&mut m, 5, "b5");
    let mut out = Vec::new();
    m.on_replay_answer(0, ReplayAnswer::Failed, &mut out);
    assert_eq!(
        out,
        vec![
            Action::DiscardGraft,
            Action::RequestFreshSnapshot { min_cursor: 8 }
        ]
    );
}

#[test]
fn retry_graft_that_splices_the_kept_held_batches_is_warm() {
    let mut m = boot(false);
    hold(&mut m, &[(7, "b7"), (8, "b8")]);
    graft(&mut m, 5, "b5");
    let (took, out) = graft(&mut m, 7, "b7");
    assert!(took);
    assert_eq!(
        out,
        vec![
            Action::Graft {
                watermark: mark(7, "b7")
            },
            done(BootstrapOutcome::Warm),
            apply(8, "b8")
        ]
    );
}

#[test]
fn second_gap_after_the_retry_discards_the_graft_and_runs_cold() {
    let mut m = boot(false);
    hold(&mut m, &[(9, "b9")]);
    graft(&mut m, 5, "b5");
    hold(&mut m, &[(12, "b12")]);
    hold(&mut m, &[(13, "b13")]);
    // A fresher snapshot that still does not reach the held queue's hole (10, 11 missed).
    let (_, out) = graft(&mut m, 9, "b9");
    assert_eq!(
        out,
        vec![
            Action::Graft {
                watermark: mark(9, "b9")
            },
            Action::DiscardGraft,
            done(BootstrapOutcome::Gap),
            apply(12, "b12"),
            apply(13, "b13")
        ]
    );
    assert_eq!(m.cursor(), Some(13));
    assert_eq!(
        m.counters().lost_batches,
        0,
        "a cold start counts nothing lost"
    );
}

#[test]
fn graft_older_than_the_retrys_demand_is_ignored() {
    let mut m = boot(false);
    hold(&mut m, &[(9, "b9")]);
    graft(&mut m, 5, "b5");
    let (took, out) = graft(&mut m, 7, "b7");
    assert!(!took, "cursor 7 is below the demanded 8");
    assert!(out.is_empty());
    assert!(graft(&mut m, 8, "b8").0);
}

#[test]
fn heal_answer_with_another_batch_at_the_watermark_is_a_publisher_reset() {
    let mut m = boot(true);
    hold(&mut m, &[(8, "n8")]);
    graft(&mut m, 5, "b5");
    let out = replay(&mut m, 0, vec![(5, "n5"), (6, "n6"), (7, "n7")]);
    assert_eq!(
        out,
        vec![
            Action::PublisherRestarted,
            Action::ClearRank,
            done(BootstrapOutcome::PublisherReset),
            Action::StartReplay {
                generation: 1,
                from_seq: 0,
                stop_before: Some(8)
            }
        ]
    );
    assert_eq!(
        m.held_len(),
        1,
        "the new publisher's batch waits for its origin"
    );
}

#[test]
fn live_batches_during_a_heal_are_held_and_applied_after_the_fill() {
    let mut m = boot(true);
    hold(&mut m, &[(7, "b7")]);
    graft(&mut m, 5, "b5");
    assert_eq!(live(&mut m, 8, "b8"), vec![]);
    assert_eq!(live(&mut m, 8, "b8"), vec![Action::Duplicate { seq: 8 }]);
    let out = replay(&mut m, 0, vec![(5, "b5"), (6, "b6")]);
    assert_eq!(applied(&out), vec![6, 7, 8]);
}

#[test]
fn overflow_while_healing_discards_the_graft_and_runs_cold() {
    let mut m = boot(true);
    hold(&mut m, &[(7, "heavy7")]);
    graft(&mut m, 5, "b5");
    hold(&mut m, &[(8, "heavy8"), (9, "heavy9"), (10, "heavy10")]);
    let out = live(&mut m, 11, "heavy11");
    assert_eq!(out[0], Action::DiscardGraft);
    assert_eq!(out[1], done(BootstrapOutcome::Overflow));
    assert_eq!(applied(&out), vec![7, 8, 9, 10, 11]);
    // The heal's late answer must not apply anything.
    assert!(replay(&mut m, 0, vec![(6, "b6")]).is_empty());
}

// ---- deferred proof ----

#[test]
fn deferred_proof_first_live_batch_six_after_cursor_five_splices() {
    let mut m = boot(false);
    hold(&mut m, &[(3, "b3")]);
    let (_, out) = graft(&mut m, 5, "b5");
    assert_eq!(
        out,
        vec![
            Action::Graft {
                watermark: mark(5, "b5")
            },
            Action::ProbeSiblings {
                generation: 0,
                watermark: mark(5, "b5")
            }
        ]
    );
    assert!(matches!(m.phase(), Phase::Proving { .. }));
    assert_eq!(
        live(&mut m, 6, "b6"),
        vec![done(BootstrapOutcome::Warm), apply(6, "b6")]
    );
    assert!(
        probe(&mut m, 0, Some(9)).is_empty(),
        "the probe is moot now"
    );
}

#[test]
fn deferred_proof_first_live_batch_seven_after_cursor_five_is_a_gap() {
    let mut m = boot(false);
    graft(&mut m, 5, "b5");
    assert_eq!(
        live(&mut m, 7, "b7"),
        vec![
            Action::DiscardGraft,
            Action::RequestFreshSnapshot { min_cursor: 6 }
        ]
    );
    assert_eq!(m.held_len(), 1);
}

#[test]
fn deferred_proof_live_batch_at_or_below_the_watermark_is_a_duplicate() {
    let mut m = boot(false);
    graft(&mut m, 5, "b5");
    assert_eq!(live(&mut m, 4, "b4"), vec![Action::Duplicate { seq: 4 }]);
    assert_eq!(live(&mut m, 5, "b5"), vec![Action::Duplicate { seq: 5 }]);
    assert!(matches!(m.phase(), Phase::Proving { .. }));
}

#[test]
fn deferred_proof_with_replay_asks_from_the_watermark_and_an_answer_ending_there_is_warm() {
    let mut m = boot(true);
    let (_, out) = graft(&mut m, 5, "b5");
    assert_eq!(
        out[1],
        Action::StartReplay {
            generation: 0,
            from_seq: 5,
            stop_before: None
        }
    );
    assert_eq!(
        replay(&mut m, 0, vec![(5, "b5")]),
        vec![done(BootstrapOutcome::Warm)]
    );
    assert_eq!(m.cursor(), Some(5));
}

#[test]
fn deferred_proof_replay_with_later_batches_applies_them_in_order() {
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    let out = replay(&mut m, 0, vec![(7, "b7"), (5, "b5"), (6, "b6")]);
    assert_eq!(
        out,
        vec![done(BootstrapOutcome::Warm), apply(6, "b6"), apply(7, "b7")]
    );
}

#[test]
fn deferred_proof_replay_without_the_watermark_batch_but_later_ones_is_a_gap() {
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    let out = replay(&mut m, 0, vec![(6, "b6"), (7, "b7")]);
    assert_eq!(
        out,
        vec![
            Action::DiscardGraft,
            Action::RequestFreshSnapshot { min_cursor: 7 }
        ]
    );
    assert_eq!(m.held_len(), 2);
}

#[test]
fn deferred_proof_replay_with_a_hole_after_the_watermark_is_a_gap() {
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    let out = replay(&mut m, 0, vec![(5, "b5"), (7, "b7")]);
    assert_eq!(
        out,
        vec![
            Action::DiscardGraft,
            Action::RequestFreshSnapshot { min_cursor: 6 }
        ]
    );
}

#[test]
fn deferred_proof_replay_with_another_ts_at_the_watermark_is_a_publisher_reset() {
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    let out = replay(&mut m, 0, vec![(5, "n5"), (6, "n6")]);
    assert_eq!(
        out,
        vec![
            Action::PublisherRestarted,
            Action::ClearRank,
            done(BootstrapOutcome::PublisherReset),
            Action::StartReplay {
                generation: 1,
                from_seq: 0,
                stop_before: None
            }
        ]
    );
}

#[test]
fn deferred_proof_empty_replay_means_the_engine_never_reached_the_cursor() {
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    let out = replay(&mut m, 0, vec![]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::PublisherReset]);
    assert_eq!(out[1], Action::ClearRank);
}

#[test]
fn deferred_proof_failed_replay_falls_back_to_probing_siblings() {
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    let mut out = Vec::new();
    m.on_replay_answer(0, ReplayAnswer::Failed, &mut out);
    assert_eq!(
        out,
        vec![Action::ProbeSiblings {
            generation: 1,
            watermark: mark(5, "b5")
        }]
    );
    assert_eq!(
        probe(&mut m, 1, Some(5)),
        vec![done(BootstrapOutcome::Warm)]
    );
}

#[test]
fn sibling_cursor_above_the_watermark_is_a_gap() {
    let mut m = boot(false);
    let (_, out) = graft(&mut m, 5, "b5");
    let g = probe_generation(&out);
    assert_eq!(
        probe(&mut m, g, Some(6)),
        vec![
            Action::DiscardGraft,
            Action::RequestFreshSnapshot { min_cursor: 6 }
        ]
    );
    assert_eq!(m.held_len(), 0);
}

#[test]
fn sibling_cursor_at_the_watermark_proves_the_splice() {
    let mut m = boot(false);
    let (_, out) = graft(&mut m, 5, "b5");
    let g = probe_generation(&out);
    assert_eq!(
        probe(&mut m, g, Some(5)),
        vec![done(BootstrapOutcome::Warm)]
    );
    assert_eq!(m.cursor(), Some(5));
}

#[test]
fn silent_probe_rounds_rearm_then_keep_the_graft_unwitnessed() {
    let mut m = boot(false);
    let (_, out) = graft(&mut m, 5, "b5");
    let mut g = probe_generation(&out);
    for round in 1..SPLICE_PROBE_ROUNDS_MAX {
        // A sibling below the watermark witnesses nothing either.
        let answer = if round % 2 == 0 { None } else { Some(4) };
        let out = probe(&mut m, g, answer);
        let next = probe_generation(&out);
        assert!(next > g, "each round is a new generation");
        assert!(probe(&mut m, g, Some(9)).is_empty(), "old rounds are stale");
        g = next;
    }
    assert_eq!(
        probe(&mut m, g, None),
        vec![done(BootstrapOutcome::WarmUnwitnessed)]
    );
    assert_eq!(m.cursor(), Some(5));
    assert_eq!(live(&mut m, 6, "b6"), vec![apply(6, "b6")]);
}

#[test]
fn stale_probe_answer_after_batch_zero_replaced_the_graft_is_ignored() {
    let mut m = boot(false);
    let (_, out) = graft(&mut m, 5, "b5");
    let g = probe_generation(&out);
    assert_eq!(
        live(&mut m, 0, "new0"),
        vec![
            Action::PublisherRestarted,
            Action::ClearRank,
            done(BootstrapOutcome::FromOrigin),
            apply(0, "new0")
        ]
    );
    assert!(probe(&mut m, g, Some(9)).is_empty());
    assert_eq!(m.cursor(), Some(0));
}

#[test]
fn another_batch_at_the_watermark_on_the_live_stream_is_a_publisher_reset() {
    let mut m = boot(false);
    graft(&mut m, 5, "b5");
    let out = live(&mut m, 5, "n5");
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::PublisherReset]);
    assert_eq!(out[..2], [Action::PublisherRestarted, Action::ClearRank]);
}

#[test]
fn stale_replay_answer_after_the_first_live_batch_decided_is_ignored() {
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    live(&mut m, 6, "b6");
    assert!(replay(&mut m, 0, vec![(5, "other")]).is_empty());
    assert_eq!(m.cursor(), Some(6));
}

#[test]
fn live_gap_during_the_proof_replay_is_healed_by_that_same_replay() {
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    assert_eq!(live(&mut m, 8, "b8"), vec![], "held, no second replay");
    assert_eq!(m.counters().replays_started, 1);
    let out = replay(&mut m, 0, vec![(5, "b5"), (6, "b6"), (7, "b7"), (8, "b8")]);
    assert_eq!(
        out,
        vec![
            done(BootstrapOutcome::Warm),
            apply(6, "b6"),
            apply(7, "b7"),
            apply(8, "b8")
        ]
    );
}

#[test]
fn graft_at_the_largest_seq_can_never_splice() {
    let mut m = boot(false);
    hold(&mut m, &[(3, "b3")]);
    graft(&mut m, i64::MAX, "bmax");
    assert!(matches!(m.phase(), Phase::Proving { .. }));
    assert_eq!(
        live(&mut m, 9, "b9"),
        vec![Action::Duplicate { seq: 9 }],
        "no overflow: everything is at or below the watermark"
    );
}

// ---- rebuild from the engine's replay ----

#[test]
fn engine_replay_from_origin_contiguous_to_the_held_queue_rebuilds_the_rank() {
    let mut m = boot(true);
    hold(&mut m, &[(3, "b3"), (4, "b4")]);
    let mut out = Vec::new();
    assert!(m.on_engine_rebuild(BootstrapOutcome::Abandoned, &mut out));
    assert_eq!(
        out,
        vec![Action::StartReplay {
            generation: 0,
            from_seq: 0,
            stop_before: Some(3)
        }]
    );
    hold(&mut m, &[(5, "b5")]);
    let out = replay(&mut m, 0, vec![(0, "b0"), (1, "b1"), (2, "b2"), (3, "b3")]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::FromEngineReplay]);
    assert_eq!(applied(&out), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(m.counters().lost_batches, 0);
}

#[test]
fn engine_replay_not_reaching_origin_releases_with_the_fallback() {
    let mut m = boot(true);
    hold(&mut m, &[(30, "b30")]);
    let mut out = Vec::new();
    m.on_engine_rebuild(BootstrapOutcome::Abandoned, &mut out);
    let out = replay(&mut m, 0, vec![(20, "b20"), (21, "b21")]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::Abandoned]);
    assert_eq!(applied(&out), vec![20, 21, 30]);
    // And a failed replay is the same release.
    let mut m = boot(true);
    hold(&mut m, &[(30, "b30")]);
    let mut started = Vec::new();
    m.on_engine_rebuild(BootstrapOutcome::Uncovered, &mut started);
    let mut out = Vec::new();
    m.on_replay_answer(0, ReplayAnswer::Failed, &mut out);
    assert_eq!(
        out,
        vec![done(BootstrapOutcome::Uncovered), apply(30, "b30")]
    );
}

/// The siblings' "empty" is only their view: a sibling that holds the rank itself while it
/// bootstraps carries nothing for it either. The engine's replay decides: batches from seq 0 are
/// a rebuild (the rank was NOT empty), an empty buffer confirms `empty`.
#[test]
fn a_rank_the_siblings_call_empty_is_rebuilt_when_the_engine_replays_from_origin() {
    let mut m = boot(true);
    let mut out = Vec::new();
    assert!(m.on_engine_rebuild(BootstrapOutcome::Empty, &mut out));
    let out = replay(&mut m, 0, vec![(0, "b0"), (1, "b1")]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::FromEngineReplay]);
    assert_eq!(applied(&out), vec![0, 1]);

    let mut m = boot(true);
    let mut out = Vec::new();
    assert!(m.on_engine_rebuild(BootstrapOutcome::Empty, &mut out));
    let out = replay(&mut m, 0, vec![]);
    assert_eq!(
        outcomes(&out),
        vec![BootstrapOutcome::Empty],
        "an engine that published nothing confirms the siblings' empty"
    );
    // Batches the engine cannot rebuild from (its buffer no longer reaches seq 0): the rank
    // holds blocks nobody can recover, which is `abandoned`, never `empty`.
    let mut m = boot(true);
    let mut out = Vec::new();
    m.on_engine_rebuild(BootstrapOutcome::Empty, &mut out);
    let out = replay(&mut m, 0, vec![(6, "b6"), (7, "b7")]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::Abandoned]);
    assert_eq!(applied(&out), vec![6, 7]);
    // With another fallback an empty buffer is the engine's own word that the rank holds
    // nothing: `empty` too (see the test after the history tests below).
    let mut m = boot(true);
    let mut out = Vec::new();
    m.on_engine_rebuild(BootstrapOutcome::Abandoned, &mut out);
    let out = replay(&mut m, 0, vec![]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::Empty]);
}

#[test]
fn engine_replay_with_a_hole_is_not_a_rebuild() {
    let mut m = boot(true);
    hold(&mut m, &[(4, "b4")]);
    let mut out = Vec::new();
    m.on_engine_rebuild(BootstrapOutcome::Abandoned, &mut out);
    let out = replay(&mut m, 0, vec![(0, "b0"), (1, "b1"), (3, "b3")]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::Abandoned]);
}

#[test]
fn engine_rebuild_needs_a_holding_rank_with_a_replay_socket() {
    let mut m = boot(false);
    let mut out = Vec::new();
    assert!(!m.on_engine_rebuild(BootstrapOutcome::Abandoned, &mut out));
    assert!(out.is_empty());
    let mut m = boot(true);
    graft(&mut m, 5, "b5");
    assert!(!m.on_engine_rebuild(BootstrapOutcome::Abandoned, &mut out));
}

#[test]
fn release_while_rebuilding_abandons_the_replay() {
    let mut m = boot(true);
    hold(&mut m, &[(4, "b4")]);
    let mut out = Vec::new();
    m.on_engine_rebuild(BootstrapOutcome::Abandoned, &mut out);
    let mut out = Vec::new();
    assert!(m.on_release(BootstrapOutcome::Empty, &mut out));
    assert_eq!(out, vec![done(BootstrapOutcome::Empty), apply(4, "b4")]);
    assert!(replay(&mut m, 0, vec![(0, "b0")]).is_empty());
}

// ---- outcomes ----

#[test]
fn every_bootstrap_path_reports_exactly_one_outcome() {
    type Script = fn(&mut M, &mut Out);
    let scripts: Vec<(bool, Script)> = vec![
        (false, |m, o| {
            m.on_live_batch(0, "b0", o);
        }),
        (false, |m, o| {
            m.on_live_batch(6, "b6", o);
            m.on_graft(mark(5, "b5"), GraftHistory::Complete, o);
        }),
        (false, |m, o| {
            m.on_live_batch(9, "b9", o);
            m.on_graft(mark(5, "b5"), GraftHistory::Complete, o);
            m.on_graft(mark(7, "b7"), GraftHistory::Complete, o);
            m.on_graft(mark(8, "b8"), GraftHistory::Complete, o);
        }),
        (false, |m, o| {
            m.on_graft(mark(5, "b5"), GraftHistory::Complete, o);
            for g in 0..SPLICE_PROBE_ROUNDS_MAX as u64 {
                m.on_probe_answer(g, None, o);
            }
            m.on_live_batch(6, "b6", o);
        }),
        (true, |m, o| {
            m.on_graft(mark(5, "b5"), GraftHistory::Complete, o);
            m.on_replay_answer(0, ReplayAnswer::Batches(vec![]), o);
            m.on_live_batch(0, "n0", o);
        }),
        (true, |m, o| {
            m.on_live_batch(4, "b4", o);
            m.on_engine_rebuild(BootstrapOutcome::Abandoned, o);
            m.on_replay_answer(0, ReplayAnswer::Failed, o);
            m.on_release(BootstrapOutcome::Uncovered, o);
        }),
        (true, |m, o| {
            m.on_live_batch(8, "b8", o);
            m.on_graft(mark(5, "b5"), GraftHistory::Complete, o);
            m.on_live_batch(2, "n2", o);
        }),
    ];
    for (i, (has_replay, script)) in scripts.into_iter().enumerate() {
        let mut m = boot(has_replay);
        let mut out = Vec::new();
        script(&mut m, &mut out);
        assert_eq!(outcomes(&out).len(), 1, "script {i}: {out:?}");
        assert_eq!(m.outcome(), outcomes(&out).first().copied(), "script {i}");
        assert!(!m.is_bootstrapping(), "script {i} ends live");
    }
}

#[test]
fn outcome_labels_are_the_metric_names() {
    let all = [
        (BootstrapOutcome::Warm, "warm"),
        (BootstrapOutcome::WarmUnwitnessed, "warm_unwitnessed"),
        (BootstrapOutcome::WarmPartial, "warm_partial"),
        (BootstrapOutcome::Gap, "gap"),
        (BootstrapOutcome::Uncovered, "uncovered"),
        (BootstrapOutcome::Abandoned, "abandoned"),
        (BootstrapOutcome::Overflow, "overflow"),
        (BootstrapOutcome::PublisherReset, "publisher_reset"),
        (BootstrapOutcome::Rejected, "rejected"),
        (BootstrapOutcome::FromOrigin, "from_origin"),
        (BootstrapOutcome::Empty, "empty"),
        (BootstrapOutcome::FromEngineReplay, "from_engine_replay"),
    ];
    for (outcome, label) in all {
        assert_eq!(outcome.label(), label);
    }
}

// ---- what the rank may tell a sibling: is its history complete since the origin? ----

#[test]
fn a_proven_splice_completes_the_history_and_an_unwitnessed_graft_does_not() {
    let mut m = boot(false);
    hold(&mut m, &[(6, "b6")]);
    assert!(!m.history_complete(), "holding knows nothing yet");
    graft(&mut m, 5, "b5");
    assert_eq!(m.outcome(), Some(BootstrapOutcome::Warm));
    assert!(m.history_complete());

    let mut m = boot(false);
    let (_, out) = graft(&mut m, 5, "b5");
    assert!(
        !m.history_complete(),
        "a deferred proof is still bootstrapping"
    );
    let mut g = probe_generation(&out);
    for _ in 1..SPLICE_PROBE_ROUNDS_MAX {
        g = probe_generation(&probe(&mut m, g, None));
    }
    probe(&mut m, g, None);
    assert_eq!(m.outcome(), Some(BootstrapOutcome::WarmUnwitnessed));
    assert!(!m.history_complete());
}

fn partial_graft(m: &mut M, seq: i64, name: &'static str) -> Out {
    let mut out = Vec::new();
    assert!(m.on_graft(mark(seq, name), GraftHistory::Partial, &mut out));
    out
}

#[test]
fn a_proven_splice_of_a_partial_graft_settles_warm_partial_on_the_held_and_the_deferred_path() {
    // Held path: cursor 5, first held 6.
    let mut m = boot(false);
    hold(&mut m, &[(6, "b6")]);
    let out = partial_graft(&mut m, 5, "b5");
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::WarmPartial]);
    assert_eq!(applied(&out), vec![6]);
    assert!(
        !m.history_complete(),
        "a sibling's partial view proves no whole history"
    );

    // Deferred path: nothing held at the graft, the proof is the first live batch, 6.
    let mut m = boot(false);
    partial_graft(&mut m, 5, "b5");
    let out = live(&mut m, 6, "b6");
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::WarmPartial]);
    assert!(!m.history_complete());

    // The splice rule itself is unchanged: 7 after cursor 5 is a gap, partial or not.
    let mut m = boot(false);
    hold(&mut m, &[(7, "b7")]);
    let out = partial_graft(&mut m, 5, "b5");
    assert!(
        !outcomes(&out).contains(&BootstrapOutcome::WarmPartial),
        "a gap is not a splice: {out:?}"
    );
}

fn replay_start(out: &Out) -> (u64, i64, Option<i64>) {
    out.iter()
        .find_map(|a| match a {
            Action::StartReplay {
                generation,
                from_seq,
                stop_before,
            } => Some((*generation, *from_seq, *stop_before)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("a StartReplay action in {out:?}"))
}

/// Held 6, partial graft at 5, with a replay socket: the proven splice asks the engine for its
/// stream from seq 0 before it settles.
fn partial_splice_awaiting_rebuild() -> (M, u64) {
    let mut m = boot(true);
    hold(&mut m, &[(6, "b6")]);
    let out = partial_graft(&mut m, 5, "b5");
    assert_eq!(
        outcomes(&out),
        vec![],
        "not settled before the engine answers"
    );
    let (generation, from_seq, stop_before) = replay_start(&out);
    assert_eq!((from_seq, stop_before), (0, Some(6)));
    assert!(m.is_bootstrapping());
    (m, generation)
}

#[test]
fn a_partial_splice_is_rebuilt_from_the_engine_when_its_replay_reaches_seq_zero() {
    let (mut m, generation) = partial_splice_awaiting_rebuild();
    let out = replay(&mut m, generation, engine_stream(5));
    let clear = out.iter().position(|a| matches!(a, Action::ClearRank));
    let first_apply = out.iter().position(|a| matches!(a, Action::Apply { .. }));
    assert!(
        clear.is_some() && clear < first_apply,
        "the producer's partial view is cleared before the engine's stream applies: {out:?}"
    );
    assert_eq!(applied(&out), vec![0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::FromEngineReplay]);
    assert!(
        m.history_complete(),
        "the engine's whole stream is the history"
    );
    assert_eq!(m.cursor(), Some(6));
}

#[test]
fn a_partial_splice_keeps_its_graft_as_warm_partial_when_the_engine_buffer_was_trimmed() {
    let (mut m, generation) = partial_splice_awaiting_rebuild();
    let out = replay(&mut m, generation, vec![(3, "b3"), (4, "b4"), (5, "b5")]);
    assert!(
        !out.iter()
            .any(|a| matches!(a, Action::ClearRank | Action::DiscardGraft))
    );
    assert_eq!(
        applied(&out),
        vec![6],
        "the held batch applies on the graft"
    );
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::WarmPartial]);
    assert!(!m.history_complete());

    // An engine that cannot answer leaves the graft too.
    let (mut m, generation) = partial_splice_awaiting_rebuild();
    let mut out = Vec::new();
    m.on_replay_answer(generation, ReplayAnswer::Failed, &mut out);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::WarmPartial]);
    assert_eq!(applied(&out), vec![6]);
}

#[test]
fn a_rebuild_over_a_partial_graft_must_reach_the_watermark_to_replace_it() {
    // Nothing held: the deferred proof (replay from the watermark) proves the splice, then the
    // rebuild from 0 is asked with no stop.
    let mut m = boot(true);
    let out = partial_graft(&mut m, 5, "b5");
    let (proof, from_seq, _) = replay_start(&out);
    assert_eq!(from_seq, 5);
    let out = replay(&mut m, proof, vec![(5, "b5")]);
    assert_eq!(outcomes(&out), vec![]);
    let (rebuild, from_seq, stop_before) = replay_start(&out);
    assert_eq!((from_seq, stop_before), (0, None));
    // Contiguous from 0 but short of the watermark: the engine's buffer is not the stream the
    // graft's cursor describes; the graft stands.
    let out = replay(&mut m, rebuild, engine_stream(2));
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::WarmPartial]);
    assert!(!out.iter().any(|a| matches!(a, Action::ClearRank)));
    assert_eq!(m.cursor(), Some(5));
}

#[test]
fn live_batches_during_a_rebuild_over_a_graft_are_held_and_follow_the_replay() {
    let mut m = boot(true);
    let out = partial_graft(&mut m, 2, "b2");
    let (proof, ..) = replay_start(&out);
    let out = replay(&mut m, proof, vec![(2, "b2")]);
    let (rebuild, ..) = replay_start(&out);
    hold(&mut m, &[(3, "b3"), (4, "b4")]);
    let out = replay(&mut m, rebuild, engine_stream(3));
    assert_eq!(
        applied(&out),
        vec![0, 1, 2, 3, 4],
        "each batch once, in order"
    );
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::FromEngineReplay]);
}

/// The engine's stream of batches `0..=through`, named like the other tests' batches.
fn engine_stream(through: usize) -> Vec<(i64, &'static str)> {
    const NAMES: [&str; 8] = ["b0", "b1", "b2", "b3", "b4", "b5", "b6", "b7"];
    (0..=through).map(|i| (i as i64, NAMES[i])).collect()
}

/// Nothing held at a partial graft at 5: the proof's replay from the watermark is asked, but
/// the live batch 6 proves the splice first, is applied on the graft at once, and the rebuild
/// from seq 0 is asked. Returns the machine and the rebuild's generation; the proof's late
/// answer has been ignored.
fn partial_splice_proven_by_live_batch_six() -> (M, u64) {
    let mut m = boot(true);
    let out = partial_graft(&mut m, 5, "b5");
    let (proof, ..) = replay_start(&out);
    let out = live(&mut m, 6, "b6");
    assert_eq!(applied(&out), vec![6]);
    assert_eq!(outcomes(&out), vec![]);
    let (rebuild, from_seq, stop_before) = replay_start(&out);
    assert_eq!((from_seq, stop_before), (0, None));
    assert_ne!(rebuild, proof);
    // The proof's late answer is for a phase the rank has left.
    assert_eq!(replay(&mut m, proof, vec![(5, "b5")]), vec![]);
    (m, rebuild)
}

#[test]
fn a_partial_splice_proven_by_a_live_batch_applies_it_and_the_rebuild_applies_it_again_after_the_clear()
 {
    let (mut m, rebuild) = partial_splice_proven_by_live_batch_six();
    let out = replay(&mut m, rebuild, engine_stream(6));
    let clear = out.iter().position(|a| matches!(a, Action::ClearRank));
    assert_eq!(clear, Some(0), "cleared before anything applies: {out:?}");
    assert_eq!(applied(&out), vec![0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::FromEngineReplay]);
    assert_eq!(m.cursor(), Some(6));
    assert!(m.history_complete());

    // An answer that stops short of the batch applied on the graft would lose it: the graft
    // stands instead.
    let (mut m, rebuild) = partial_splice_proven_by_live_batch_six();
    let out = replay(&mut m, rebuild, engine_stream(5));
    assert!(
        !out.iter().any(|a| matches!(a, Action::ClearRank)),
        "{out:?}"
    );
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::WarmPartial]);
    assert_eq!(m.cursor(), Some(6));
}

#[test]
fn a_release_or_overflow_during_a_rebuild_over_a_graft_settles_the_proven_graft() {
    let (mut m, _) = partial_splice_awaiting_rebuild();
    let mut out = Vec::new();
    assert!(m.on_release(BootstrapOutcome::Abandoned, &mut out));
    assert_eq!(
        outcomes(&out),
        vec![BootstrapOutcome::WarmPartial],
        "the caller's outcome does not override a proven splice"
    );
    assert_eq!(applied(&out), vec![6]);

    let (mut m, _) = partial_splice_awaiting_rebuild();
    let mut out = Vec::new();
    for seq in 7..12 {
        out.extend(live(&mut m, seq, "heavy"));
    }
    assert!(
        !out.iter().any(|a| matches!(a, Action::DiscardGraft)),
        "an overflow keeps the proven graft: {:?}",
        outcomes(&out)
    );
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::WarmPartial]);
    assert!(!m.is_bootstrapping());
}

#[test]
fn a_publisher_restart_during_a_rebuild_over_a_graft_clears_the_graft() {
    let (mut m, generation) = partial_splice_awaiting_rebuild();
    let out = live(&mut m, 0, "new0");
    assert!(out.iter().any(|a| matches!(a, Action::ClearRank)));
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::FromOrigin]);
    // The rebuild's late answer is for a phase the rank has left.
    let out = replay(&mut m, generation, vec![(0, "b0")]);
    assert_eq!(out, vec![]);
}

#[test]
fn a_gap_retry_with_a_complete_snapshot_settles_warm_after_a_partial_first_graft() {
    let mut m = boot(false);
    hold(&mut m, &[(9, "b9")]);
    partial_graft(&mut m, 5, "b5");
    // The retry's snapshot, from a sibling with the whole history, reaches the held batch 9.
    let (took, out) = graft(&mut m, 8, "b8");
    assert!(took, "the retry graft is taken: {out:?}");
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::Warm]);
    assert!(m.history_complete());
}

#[test]
fn a_bootstrap_released_cold_mid_stream_has_no_complete_history() {
    let mut m = boot(false);
    hold(&mut m, &[(40, "b40"), (41, "b41")]);
    let mut out = Vec::new();
    assert!(m.on_release(BootstrapOutcome::Uncovered, &mut out));
    assert_eq!(applied(&out), vec![40, 41]);
    assert!(!m.history_complete());
}

#[test]
fn a_rank_seen_from_its_first_batch_while_holding_has_a_complete_history() {
    let mut m = boot(false);
    live(&mut m, 0, "b0");
    assert_eq!(m.outcome(), Some(BootstrapOutcome::FromOrigin));
    assert!(m.history_complete());
}

#[test]
fn a_discarded_graft_leaves_the_history_incomplete() {
    let mut m = boot(false);
    hold(&mut m, &[(9, "b9")]);
    graft(&mut m, 5, "b5");
    hold(&mut m, &[(12, "b12")]);
    // The retry's snapshot still misses 10 and 11: the graft is discarded, the rank runs cold.
    let (_, out) = graft(&mut m, 9, "b9");
    assert!(out.contains(&Action::DiscardGraft), "second gap: {out:?}");
    assert_eq!(m.outcome(), Some(BootstrapOutcome::Gap));
    assert!(!m.history_complete());
}

#[test]
fn an_engine_rebuild_from_origin_completes_the_history() {
    let mut m = boot(true);
    hold(&mut m, &[(2, "b2")]);
    let mut out = Vec::new();
    assert!(m.on_engine_rebuild(BootstrapOutcome::Uncovered, &mut out));
    let g = match m.phase() {
        Phase::Rebuilding { generation, .. } => *generation,
        other => panic!("expected Rebuilding, machine is {other:?}"),
    };
    replay(&mut m, g, vec![(0, "b0"), (1, "b1")]);
    assert_eq!(m.outcome(), Some(BootstrapOutcome::FromEngineReplay));
    assert!(m.history_complete());
}

#[test]
fn an_engine_replay_from_origin_holding_nothing_settles_empty_whoever_released_the_rank() {
    for fallback in [
        BootstrapOutcome::Uncovered,
        BootstrapOutcome::Abandoned,
        BootstrapOutcome::Empty,
    ] {
        let mut m = boot(true);
        let mut out = Vec::new();
        assert!(m.on_engine_rebuild(fallback, &mut out));
        let out = replay(&mut m, 0, vec![]);
        assert_eq!(
            outcomes(&out),
            vec![BootstrapOutcome::Empty],
            "{fallback:?}"
        );
        assert!(m.history_complete());
    }
    // A batch held live means the engine has published: the rank is not empty, and a replay
    // that does not reach it cannot rebuild it.
    let mut m = boot(true);
    hold(&mut m, &[(1, "b1")]);
    let mut out = Vec::new();
    m.on_engine_rebuild(BootstrapOutcome::Uncovered, &mut out);
    let out = replay(&mut m, 0, vec![]);
    assert_eq!(outcomes(&out), vec![BootstrapOutcome::Uncovered]);
}
