//! The `/readyz` bootstrap rule and the per-fetch timeout math.

use kvroute_bootstrap::sweep::{
    FETCH_MIN_TRANSFER_BYTES_PER_S, FETCH_TIMEOUT_DEADLINE_DIVISOR, ReadinessHold,
};
use kvroute_bootstrap::{
    ReadinessInputs, ReadinessLatch, VerdictKind, fetch_timeout, readiness_hold,
};

const TIMEOUT_MS: u64 = 10_000;

fn inputs(now_ms: u64) -> ReadinessInputs {
    ReadinessInputs {
        now_ms,
        armed_at_ms: 1_000,
        timeout_ms: TIMEOUT_MS,
        any_pending: true,
        latest_verdict: None,
        timed_out_peers_tried: 0,
        seeded: false,
        seed_required: false,
    }
}

#[test]
fn readiness_is_held_while_a_rank_is_pending_and_the_deadline_has_not_passed() {
    assert_eq!(
        readiness_hold(&inputs(10_999)),
        Some(ReadinessHold::BootstrapPending)
    );
    assert_eq!(readiness_hold(&inputs(11_000)), None, "deadline passed");
    let settled = ReadinessInputs {
        any_pending: false,
        ..inputs(2_000)
    };
    assert_eq!(readiness_hold(&settled), None);
}

#[test]
fn no_peers_and_fleet_cold_never_hold_readiness_even_with_seed_required() {
    for v in [VerdictKind::NoPeers, VerdictKind::FleetCold] {
        let i = ReadinessInputs {
            latest_verdict: Some(v),
            seed_required: true,
            ..inputs(2_000)
        };
        assert_eq!(readiness_hold(&i), None, "{v:?}");
    }
}

#[test]
fn seed_required_holds_after_a_timeout_over_tried_peers_until_three_deadlines() {
    let timed_out = |now| ReadinessInputs {
        any_pending: false,
        latest_verdict: Some(VerdictKind::TimedOut),
        timed_out_peers_tried: 2,
        seed_required: true,
        ..inputs(now)
    };
    assert_eq!(
        readiness_hold(&timed_out(20_000)),
        Some(ReadinessHold::SeedMissing)
    );
    assert_eq!(
        readiness_hold(&timed_out(30_999)),
        Some(ReadinessHold::SeedMissing)
    );
    assert_eq!(
        readiness_hold(&timed_out(31_000)),
        None,
        "3 x the timeout after arming bounds the hold"
    );
    let without_flag = ReadinessInputs {
        seed_required: false,
        ..timed_out(20_000)
    };
    assert_eq!(readiness_hold(&without_flag), None);
}

/// Between the deadline and the sweep's `timed_out` verdict (its next poll, up to a pass later)
/// no verdict is in yet. With seed_required, answering ready there would latch and skip the
/// seed hold altogether (seen on real processes: a replica cut off from every sibling turned
/// ready at the deadline instead of at 3x it), so the rule waits for the verdict, still bounded.
#[test]
fn with_seed_required_the_gap_between_the_deadline_and_the_verdict_does_not_turn_ready() {
    let pending_past_deadline = |now| ReadinessInputs {
        seed_required: true,
        ..inputs(now)
    };
    assert_eq!(
        readiness_hold(&pending_past_deadline(11_000)),
        Some(ReadinessHold::BootstrapPending)
    );
    assert_eq!(
        readiness_hold(&pending_past_deadline(31_000)),
        None,
        "still bounded by three deadlines"
    );
    for v in [VerdictKind::FleetCold, VerdictKind::NoPeers] {
        let decided = ReadinessInputs {
            latest_verdict: Some(v),
            ..pending_past_deadline(11_000)
        };
        assert_eq!(readiness_hold(&decided), None, "{v:?} never holds");
    }
    let without = ReadinessInputs {
        seed_required: false,
        ..inputs(11_000)
    };
    assert_eq!(readiness_hold(&without), None, "only seed_required waits");
}

#[test]
fn a_timeout_with_no_peer_tried_never_holds_readiness() {
    let i = ReadinessInputs {
        any_pending: false,
        latest_verdict: Some(VerdictKind::TimedOut),
        timed_out_peers_tried: 0,
        seed_required: true,
        ..inputs(20_000)
    };
    assert_eq!(readiness_hold(&i), None);
}

#[test]
fn a_seed_received_this_boot_lifts_the_seed_hold() {
    let i = ReadinessInputs {
        any_pending: false,
        latest_verdict: Some(VerdictKind::TimedOut),
        timed_out_peers_tried: 1,
        seed_required: true,
        seeded: true,
        ..inputs(20_000)
    };
    assert_eq!(readiness_hold(&i), None);
}

#[test]
fn readiness_latches_once_served_ready() {
    let mut latch = ReadinessLatch::new();
    assert_eq!(
        latch.admit(&inputs(2_000)),
        Some(ReadinessHold::BootstrapPending)
    );
    assert!(!latch.latched());
    let settled = ReadinessInputs {
        any_pending: false,
        ..inputs(3_000)
    };
    assert_eq!(latch.admit(&settled), None);
    assert!(latch.latched());
    assert_eq!(
        latch.admit(&inputs(4_000)),
        None,
        "a new pending rank does not unready a serving replica"
    );
}

#[test]
fn the_fetch_timeout_is_a_strict_fraction_of_the_deadline() {
    let t = fetch_timeout(600_000, 300_000, 0);
    assert_eq!(t.timeout_ms, 600_000 / FETCH_TIMEOUT_DEADLINE_DIVISOR);
    assert!(t.timeout_ms < 600_000);
    assert!(t.warning.is_none());
    assert_eq!(fetch_timeout(0, 300_000, 0).timeout_ms, 0);
}

#[test]
fn the_fetch_timeout_is_capped() {
    assert_eq!(fetch_timeout(600_000, 30_000, 0).timeout_ms, 30_000);
}

#[test]
fn a_fetch_timeout_below_what_the_expected_body_needs_warns() {
    let bytes = 100 * FETCH_MIN_TRANSFER_BYTES_PER_S;
    let t = fetch_timeout(200_000, 300_000, bytes);
    assert_eq!(t.timeout_ms, 50_000);
    let w = t.warning.expect("50 s cannot carry a 100 s body");
    assert_eq!(w.needed_ms, 100_000);
    assert!(
        w.to_string()
            .contains("--kv-bootstrap-fetch-timeout-cap-ms")
    );
    assert!(fetch_timeout(400_000, 300_000, bytes).warning.is_none());
    let huge = fetch_timeout(1_000, u64::MAX, u64::MAX);
    assert!(huge.warning.is_some(), "no overflow on absurd inputs");
}
