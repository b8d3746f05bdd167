//! The coordinator's bookkeeping: one sweep in flight, merging, deferral of gap retries,
//! hand-backs, and how every held obligation is released.

mod common;

use std::collections::BTreeSet;

use common::{body, body_listing, ob, order_for, rejected, view};
use kvroute_bootstrap::{
    Admission, Coordinator, Disposition, FetchResult, LateJoin, Obligation, Outcome, PeerBook,
    Rejection, Release, Tick, VerdictKind,
};
use kvroute_index::RankId;

type Peer = &'static str;

const DEADLINE_MS: u64 = 10_000;

fn all_owed(_: &Obligation) -> bool {
    true
}

fn released(t: &Tick<Peer>) -> Vec<(u32, Disposition)> {
    t.released
        .iter()
        .map(|r| (r.obligation.rank.0, r.disposition))
        .collect()
}

#[test]
fn ranks_queued_while_idle_share_one_sweep_asking_with_the_strictest_floor() {
    let book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    assert_eq!(
        c.submit(ob(0, 1, 100), LateJoin::Permitted),
        Admission::Queued
    );
    assert_eq!(
        c.submit(ob(1, 1, 300), LateJoin::Permitted),
        Admission::Queued
    );
    let t = c.poll(&view(&["a"]), &book, 1_000, DEADLINE_MS, all_owed);
    assert_eq!(t.fetch.len(), 1, "one fleet-wide fetch for both ranks");
    assert_eq!(t.fetch[0].max_age_ms, 700, "the newest floor wins");
    assert_eq!(c.in_flight().map(|s| s.floor_ms()), Some(300));
    assert_eq!(c.held(), 2);
}

#[test]
fn a_rank_discovered_during_a_sweep_merges_into_its_delivery() {
    let mut book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    let peers = ["a"];
    c.submit(ob(0, 1, 100), LateJoin::Permitted);
    c.poll(&view(&peers), &book, 1_000, DEADLINE_MS, all_owed);
    assert_eq!(
        c.submit(ob(2, 1, 900), LateJoin::Permitted),
        Admission::Merged,
        "discovery rides the in-flight sweep even with a newer floor"
    );
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        body(&[0, 2], &[], 1_100),
        &view(&peers),
        &mut book,
        1_100,
        all_owed,
    );
    assert_eq!(
        released(&t),
        [(0, Disposition::Graft), (2, Disposition::Graft)]
    );
    let d = t.delivery.expect("a delivery");
    assert_eq!(d.verdict, VerdictKind::Found);
    assert_eq!(d.peer, Some("a"));
    assert_eq!(
        d.graft.expect("a graft").local_ids(),
        &[RankId(0), RankId(2)]
    );
    assert!(c.is_idle());
}

#[test]
fn a_gap_retry_newer_than_the_in_flight_floor_waits_for_its_own_sweep() {
    let mut book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    let peers = ["a"];
    c.submit(ob(0, 1, 300), LateJoin::Permitted);
    c.poll(&view(&peers), &book, 1_000, DEADLINE_MS, all_owed);
    assert_eq!(
        c.submit(ob(5, 1, 800), LateJoin::Refused),
        Admission::Queued
    );
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        body(&[0, 5], &[], 1_100),
        &view(&peers),
        &mut book,
        1_100,
        all_owed,
    );
    assert_eq!(
        released(&t),
        [(0, Disposition::Graft)],
        "5 is not adjudicated against the older export"
    );
    assert_eq!(
        t.wait_until_ms,
        Some(1_100),
        "the deferred rank's sweep is due"
    );
    let t = c.poll(&view(&peers), &book, 2_000, DEADLINE_MS, all_owed);
    assert_eq!(c.in_flight().map(|s| s.floor_ms()), Some(800));
    assert_eq!(
        t.fetch[0].max_age_ms,
        2_000 - 1_101,
        "newer than the gap and than a's last export"
    );
}

#[test]
fn a_gap_retry_no_newer_than_the_in_flight_floor_rides_it() {
    let book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    c.submit(ob(0, 1, 300), LateJoin::Permitted);
    c.poll(&view(&["a"]), &book, 1_000, DEADLINE_MS, all_owed);
    assert_eq!(
        c.submit(ob(5, 1, 300), LateJoin::Refused),
        Admission::Merged
    );
}

#[test]
fn the_same_obligation_is_never_held_twice() {
    let book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    assert_eq!(
        c.submit(ob(0, 1, 0), LateJoin::Permitted),
        Admission::Queued
    );
    assert_eq!(
        c.submit(ob(0, 1, 50), LateJoin::Permitted),
        Admission::Duplicate
    );
    c.poll(&view(&["a"]), &book, 1_000, DEADLINE_MS, all_owed);
    assert_eq!(
        c.submit(ob(0, 1, 0), LateJoin::Refused),
        Admission::Duplicate
    );
    assert_eq!(
        c.submit(ob(0, 2, 0), LateJoin::Permitted),
        Admission::Merged,
        "a new incarnation is another obligation"
    );
    assert_eq!(c.held(), 2);
}

#[test]
fn ranks_a_found_snapshot_never_spoke_for_are_handed_back_once_then_uncovered() {
    let mut book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    let peers = ["a"];
    c.submit(ob(0, 1, 0), LateJoin::Permitted);
    c.submit(ob(1, 1, 0), LateJoin::Permitted);
    c.poll(&view(&peers), &book, 1_000, DEADLINE_MS, all_owed);
    // The producer has not registered rank 1's worker yet: its snapshot cannot speak for it.
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        body_listing(&[0, 3], &[0], &[], 1_010),
        &view(&peers),
        &mut book,
        1_010,
        all_owed,
    );
    assert_eq!(released(&t), [(0, Disposition::Graft)]);
    assert_eq!(c.held(), 1, "rank 1 handed back, still held");
    c.poll(&view(&peers), &book, 2_000, DEADLINE_MS, all_owed);
    c.submit(ob(3, 1, 0), LateJoin::Permitted);
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        body_listing(&[0, 3], &[3], &[], 2_010),
        &view(&peers),
        &mut book,
        2_010,
        all_owed,
    );
    assert_eq!(
        released(&t),
        [
            (1, Disposition::Settle(Outcome::Uncovered)),
            (3, Disposition::Graft)
        ]
    );
    assert!(c.is_idle());
}

#[test]
fn every_search_failure_abandons_each_rank_still_owed() {
    // timed out
    let book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    c.submit(ob(0, 1, 0), LateJoin::Permitted);
    c.submit(ob(1, 1, 0), LateJoin::Permitted);
    c.poll(&view(&["a"]), &book, 1_000, 1_500, all_owed);
    let t = c.poll(&view(&["a"]), &book, 1_500, 1_500, |o| o.rank != RankId(1));
    assert_eq!(
        released(&t),
        [
            (1, Disposition::NotOwed),
            (0, Disposition::Settle(Outcome::Abandoned))
        ]
    );
    assert_eq!(t.delivery.map(|d| d.verdict), Some(VerdictKind::TimedOut));
    // no peers
    let mut c = Coordinator::<Peer>::new(2_000);
    c.submit(ob(0, 1, 0), LateJoin::Permitted);
    let t = c.poll(&view(&[]), &book, 1_000, DEADLINE_MS, all_owed);
    assert_eq!(released(&t), [(0, Disposition::Settle(Outcome::Abandoned))]);
    assert_eq!(t.delivery.map(|d| d.verdict), Some(VerdictKind::NoPeers));
    // fleet cold
    let mut book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    c.submit(ob(0, 1, 0), LateJoin::Permitted);
    c.poll(&view(&["a"]), &book, 1_000, DEADLINE_MS, all_owed);
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        rejected(Rejection::NotReady, 1_010),
        &view(&["a"]),
        &mut book,
        1_010,
        all_owed,
    );
    assert_eq!(released(&t), [(0, Disposition::Settle(Outcome::Abandoned))]);
    let d = t.delivery.expect("a delivery");
    assert_eq!((d.verdict, d.siblings), (VerdictKind::FleetCold, 1));
}

#[test]
fn obligations_no_longer_owed_are_released_as_such_before_a_sweep_starts() {
    let book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    c.submit(ob(0, 1, 0), LateJoin::Permitted);
    let t = c.poll(&view(&["a"]), &book, 1_000, DEADLINE_MS, |_| false);
    assert_eq!(released(&t), [(0, Disposition::NotOwed)]);
    assert!(t.fetch.is_empty());
    assert!(c.is_idle());
}

#[test]
fn a_rank_every_candidate_names_empty_is_released_empty_mid_sweep() {
    let mut book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    c.submit(ob(0, 1, 0), LateJoin::Permitted);
    c.submit(ob(1, 1, 0), LateJoin::Permitted);
    c.poll(&view(&["a"]), &book, 1_000, DEADLINE_MS, all_owed);
    // Rank 0's worker is not in the producer's table yet, so it is still searched for.
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        body_listing(&[1, 6], &[6], &[1], 1_010),
        &view(&["a"]),
        &mut book,
        1_010,
        all_owed,
    );
    assert_eq!(released(&t), [(1, Disposition::Settle(Outcome::Empty))]);
    assert!(t.delivery.is_none(), "rank 0 is still searched for");
    assert_eq!(c.held(), 1);
}

#[test]
fn a_rank_no_sibling_knows_is_released_uncovered_for_its_engine_mid_sweep() {
    let mut book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    c.submit(ob(0, 1, 0), LateJoin::Permitted);
    c.submit(ob(1, 1, 0), LateJoin::Permitted);
    c.poll(&view(&["a"]), &book, 1_000, DEADLINE_MS, all_owed);
    // `a` lists both ranks and knows neither (it holds them in its own bootstrap).
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        body(&[6], &[], 1_010),
        &view(&["a"]),
        &mut book,
        1_010,
        all_owed,
    );
    assert_eq!(
        released(&t),
        [
            (0, Disposition::Settle(Outcome::Uncovered)),
            (1, Disposition::Settle(Outcome::Uncovered))
        ]
    );
    assert!(c.is_idle(), "nothing is left to search for");
}

#[test]
fn a_sweep_whose_ranks_all_left_pending_ends_ranks_resolved_and_the_queue_gets_its_own() {
    let mut book = PeerBook::new(None);
    let mut c = Coordinator::<Peer>::new(2_000);
    c.submit(ob(0, 1, 0), LateJoin::Permitted);
    c.poll(&view(&["a"]), &book, 1_000, DEADLINE_MS, all_owed);
    c.submit(ob(7, 1, 5_000), LateJoin::Refused);
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        FetchResult::Busy,
        &view(&["a"]),
        &mut book,
        1_010,
        |o| o.rank != RankId(0),
    );
    assert_eq!(released(&t), [(0, Disposition::NotOwed)]);
    assert_eq!(
        t.delivery.map(|d| d.verdict),
        Some(VerdictKind::RanksResolved)
    );
    assert_eq!(
        t.wait_until_ms,
        Some(1_010),
        "the queued retry is due at once"
    );
    c.poll(&view(&["a"]), &book, 1_100, DEADLINE_MS, all_owed);
    assert_eq!(c.in_flight().map(|s| s.floor_ms()), Some(5_000));
}

/// Applies a tick's releases to a model of what is held, failing on any release of something
/// not held.
fn account(held: &mut BTreeSet<(u32, u64)>, t: &Tick<Peer>) {
    for Release { obligation: o, .. } in &t.released {
        assert!(
            held.remove(&(o.rank.0, o.incarnation.0)),
            "released twice or never held: {o:?}"
        );
    }
}

#[test]
fn a_full_boot_releases_every_held_rank_exactly_once() {
    let mut book = PeerBook::new(Some("self"));
    let mut c = Coordinator::<Peer>::new(2_000);
    let mut held = BTreeSet::new();
    let peers = ["self", "a", "b"];
    for r in 0..4 {
        assert_ne!(
            c.submit(ob(r, 1, 0), LateJoin::Permitted),
            Admission::Duplicate
        );
        held.insert((r, 1));
    }
    let t = c.poll(&view(&peers), &book, 1_000, DEADLINE_MS, all_owed);
    account(&mut held, &t);
    assert!(t.fetch.iter().all(|o| o.peer != "self"));
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        body(&[0], &[3], 1_010),
        &view(&peers),
        &mut book,
        1_010,
        all_owed,
    );
    account(&mut held, &t);
    assert_eq!(released(&t), [(0, Disposition::Graft)]);
    assert_eq!(
        held.len(),
        3,
        "1, 2 (unknown to a) and 3 (only a says empty) handed back"
    );
    let t = c.poll(&view(&peers), &book, 2_000, DEADLINE_MS, all_owed);
    account(&mut held, &t);
    assert_eq!(t.fetch.len(), 2);
    let t = c.on_answer(
        &order_for(c.in_flight(), "a"),
        body(&[5], &[3], 2_010),
        &view(&peers),
        &mut book,
        2_010,
        all_owed,
    );
    account(&mut held, &t);
    let t = c.on_answer(
        &order_for(c.in_flight(), "b"),
        body(&[1], &[3], 2_020),
        &view(&peers),
        &mut book,
        2_020,
        all_owed,
    );
    account(&mut held, &t);
    assert_eq!(
        released(&t),
        [
            (3, Disposition::Settle(Outcome::Empty)),
            (2, Disposition::Settle(Outcome::Uncovered)),
            (1, Disposition::Graft),
        ]
    );
    assert!(held.is_empty(), "{held:?} still held after the boot");
    assert!(c.is_idle());
}
