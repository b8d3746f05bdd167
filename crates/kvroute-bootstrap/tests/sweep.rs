//! The sweep's rules, one property per test: candidates and self exclusion, sit-outs, freshness
//! floors, every verdict and its guards, `empty` settlement and ranks unknown to the fleet.
//! Where a test needs the search to go on after a warm answer, that answer comes from a producer
//! that has not registered the pending rank's worker (`body_listing`): a producer that lists the
//! rank and knows nothing of it would end the search for it (`unknown_to_fleet`).

mod common;

use common::{body, body_listing, body_partial, ob, order_for, rejected, view};
use kvroute_bootstrap::sweep::{PASS_INTERVAL_MS, PEER_SIT_OUT_MAX_MS};
use kvroute_bootstrap::{
    ExportStamp, FetchResult, PeerBook, PeerView, Rejection, Sweep, Verdict, VerdictKind,
};
use kvroute_index::RankId;

type Peer = &'static str;

fn sweep(ranks: &[u32], floor_ms: u64, deadline_ms: u64) -> Sweep<Peer> {
    Sweep::new(
        7,
        ranks.iter().map(|&r| ob(r, 1, floor_ms)).collect(),
        deadline_ms,
        2_000,
    )
}

fn asked(p: &kvroute_bootstrap::Progress<Peer>) -> Vec<Peer> {
    p.fetch.iter().map(|o| o.peer).collect()
}

fn unreachable() -> FetchResult {
    FetchResult::Unreachable {
        reason: "connection refused".into(),
    }
}

#[test]
fn a_pass_asks_every_candidate_except_this_replica() {
    let book = PeerBook::new(Some("self"));
    let mut s = sweep(&[0], 100, 10_000);
    let p = s.poll(&view(&["b", "self", "a"]), &book, 1_000);
    assert_eq!(asked(&p), ["a", "b"]);
    assert!(p.fetch.iter().all(|o| o.max_age_ms == 900), "{p:?}");
    assert!(p.fetch.iter().all(|o| o.timeout_ms == 2_000));
    assert_eq!(
        p.wait_until_ms,
        Some(3_000),
        "answers drive an open pass, until its fetch timeout"
    );
    assert!(p.verdict.is_none());
}

#[test]
fn a_replica_alone_with_itself_in_the_list_is_never_fetched() {
    let book = PeerBook::new(Some("self"));
    let mut s = sweep(&[0], 0, 10_000);
    let v = PeerView {
        peers: &["self"],
        synced: true,
        ever_had_peers: false,
    };
    let p = s.poll(&v, &book, 1_000);
    assert!(p.fetch.is_empty());
    assert_eq!(p.verdict.map(|v| v.kind()), Some(VerdictKind::NoPeers));
}

#[test]
fn a_covering_answer_ends_the_sweep_found() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[1], &[], 1_050),
        &view(&peers),
        &mut book,
        1_050,
    );
    let Some(Verdict::Found { peer, snapshot }) = p.verdict else {
        panic!("expected found, got {:?}", p.verdict);
    };
    assert_eq!(peer, "a");
    assert!(snapshot.covers_any([RankId(1)]));
    assert!(s.is_finished());
    assert!(p.wait_until_ms.is_none());
    let later = s.on_answer(
        &order_for(Some(&s), "b"),
        body(&[0], &[], 1_060),
        &view(&peers),
        &mut book,
        1_060,
    );
    assert!(later.verdict.is_none(), "one verdict per sweep");
    assert!(s.poll(&view(&peers), &book, 2_000).verdict.is_none());
}

#[test]
fn a_partial_cover_waits_for_the_pass_and_loses_to_a_sibling_with_the_whole_history() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body_partial(&[0, 1], &[1], 1_050),
        &view(&peers),
        &mut book,
        1_050,
    );
    assert!(
        p.verdict.is_none(),
        "a body that would graft rank 1 partially must not end the pass while b may answer: {:?}",
        p.verdict.map(|v| v.kind())
    );
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        body(&[0, 1], &[], 1_060),
        &view(&peers),
        &mut book,
        1_060,
    );
    let Some(Verdict::Found { peer, snapshot }) = p.verdict else {
        panic!("expected found, got {:?}", p.verdict.map(|v| v.kind()));
    };
    assert_eq!(peer, "b", "the whole history wins");
    assert!(snapshot.coverage(RankId(1)).is_complete_cover());
}

#[test]
fn the_best_partial_cover_is_delivered_when_the_pass_ends_without_a_whole_history() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a", "b", "c"];
    s.poll(&view(&peers), &book, 1_000);
    let answers = [
        ("a", body_partial(&[0, 1], &[0, 1], 1_050)),
        ("b", body_partial(&[0, 1], &[1], 1_055)),
        ("c", unreachable()),
    ];
    let mut verdict = None;
    for (i, (peer, answer)) in answers.into_iter().enumerate() {
        let p = s.on_answer(
            &order_for(Some(&s), peer),
            answer,
            &view(&peers),
            &mut book,
            1_050 + i as u64,
        );
        if i < 2 {
            assert!(p.verdict.is_none(), "answer {i} ended the pass early");
        }
        verdict = p.verdict;
    }
    let Some(Verdict::Found { peer, snapshot }) = verdict else {
        panic!(
            "expected found at the pass's end, got {:?}",
            verdict.map(|v| v.kind())
        );
    };
    assert_eq!(
        peer, "b",
        "b covers rank 0 with its whole history, a covers none so"
    );
    assert!(snapshot.coverage(RankId(0)).is_complete_cover());
    assert!(snapshot.coverage(RankId(1)).is_covered());
    assert!(!snapshot.coverage(RankId(1)).is_complete_cover());
}

#[test]
fn a_partial_cover_is_delivered_when_its_pass_times_out_on_a_silent_sibling() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body_partial(&[0], &[0], 1_050),
        &view(&peers),
        &mut book,
        1_050,
    );
    assert!(p.verdict.is_none());
    // b never answers; the pass closes at its fetch timeout (2 s after it opened).
    let p = s.poll(&view(&peers), &book, 2_999);
    assert!(p.verdict.is_none(), "the pass is still open");
    let p = s.poll(&view(&peers), &book, 3_000);
    assert!(
        matches!(p.verdict, Some(Verdict::Found { peer: "a", .. })),
        "got {:?}",
        p.verdict.map(|v| v.kind())
    );
}

#[test]
fn a_partial_cover_in_hand_at_the_deadline_is_delivered_not_timed_out() {
    let mut book = PeerBook::new(None);
    // The pass opens at 1,000 with 500 ms left, so its fetches expire at the deadline itself.
    let mut s = sweep(&[0], 0, 1_500);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body_partial(&[0], &[0], 1_050),
        &view(&peers),
        &mut book,
        1_050,
    );
    assert!(p.verdict.is_none());
    let p = s.poll(&view(&peers), &book, 1_500);
    assert!(
        matches!(p.verdict, Some(Verdict::Found { peer: "a", .. })),
        "got {:?}",
        p.verdict.map(|v| v.kind())
    );
}

#[test]
fn a_body_that_covers_none_of_the_pending_ranks_does_not_end_the_sweep() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[3], &[], 1_050),
        &view(&peers),
        &mut book,
        1_050,
    );
    assert!(p.verdict.is_none());
    assert!(book.sitting_out(&"a", 1_100), "a useless answer is a miss");
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        body(&[0], &[], 1_060),
        &view(&peers),
        &mut book,
        1_060,
    );
    assert!(matches!(p.verdict, Some(Verdict::Found { peer: "b", .. })));
}

#[test]
fn a_peer_that_answered_nothing_sits_out_doubling_up_to_the_cap() {
    let mut book = PeerBook::new(None);
    let sit: Vec<u64> = (0..10).map(|_| book.record_miss(&"a", 0)).collect();
    assert_eq!(
        sit,
        [
            250, 500, 1_000, 2_000, 4_000, 8_000, 16_000, 30_000, 30_000, 30_000
        ]
    );
    assert_eq!(sit[0], PASS_INTERVAL_MS);
    assert!(book.sitting_out(&"a", PEER_SIT_OUT_MAX_MS - 1));
    assert!(book.may_fetch(&"a", PEER_SIT_OUT_MAX_MS));
    for _ in 0..100 {
        book.record_miss(&"a", 0);
    }
    assert!(
        book.may_fetch(&"a", PEER_SIT_OUT_MAX_MS),
        "the cap holds after many misses"
    );
    book.record_useful(&"a");
    assert!(book.may_fetch(&"a", 0));
    assert_eq!(book.record_miss(&"a", 0), 250, "a useful answer resets");
}

#[test]
fn passes_are_spaced_by_the_interval_and_a_missing_peer_sits_one_out() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a"];
    assert_eq!(asked(&s.poll(&view(&peers), &book, 1_000)), ["a"]);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body_listing(&[3], &[3], &[], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert_eq!(p.wait_until_ms, Some(1_250));
    let p = s.poll(&view(&peers), &book, 1_100);
    assert!(p.fetch.is_empty());
    assert_eq!(p.wait_until_ms, Some(1_250));
    let p = s.poll(&view(&peers), &book, 1_250);
    assert!(p.fetch.is_empty(), "a sits out until 1260");
    assert!(p.verdict.is_none(), "a warm peer vetoes fleet_cold");
    assert_eq!(p.wait_until_ms, Some(1_500));
    assert_eq!(asked(&s.poll(&view(&peers), &book, 1_500)), ["a"]);
}

#[test]
fn a_permanently_rejected_peer_is_never_fetched_again_this_boot() {
    let mut book = PeerBook::new(None);
    let peers = ["a"];
    let mut s = sweep(&[0], 0, 10_000);
    s.poll(&view(&peers), &book, 1_000);
    let r = Rejection::BlockSize {
        found: 32,
        expected: 16,
    };
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        rejected(r, 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(book.is_rejected(&"a"));
    assert_eq!(
        p.verdict.map(|v| v.kind()),
        Some(VerdictKind::FleetCold),
        "every candidate rejected"
    );
    let mut next = sweep(&[1], 0, 100_000);
    let p = next.poll(&view(&peers), &book, 60_000);
    assert!(p.fetch.is_empty(), "not even in a later sweep");
}

#[test]
fn a_refetch_demands_an_export_newer_than_the_peers_last_answer() {
    let mut book = PeerBook::new(None);
    // Served 1200 ms old, received at 5000: stamped at 3800 at the latest.
    book.record_export(
        &"a",
        ExportStamp {
            received_ms: 5_000,
            age_ms: Some(1_200),
        },
    );
    assert_eq!(book.max_age_ms(&"a", 1_000, 6_000), 6_000 - 3_801);
    assert_eq!(
        book.max_age_ms(&"a", 5_500, 6_000),
        500,
        "a newer floor dominates"
    );
    book.record_export(
        &"a",
        ExportStamp {
            received_ms: 3_500,
            age_ms: Some(0),
        },
    );
    assert_eq!(
        book.max_age_ms(&"a", 1_000, 6_000),
        6_000 - 3_801,
        "an older answer never lowers the bar"
    );
    book.record_export(
        &"b",
        ExportStamp {
            received_ms: 5_000,
            age_ms: None,
        },
    );
    assert_eq!(
        book.max_age_ms(&"b", 0, 6_000),
        999,
        "without the age header the receipt time bounds the stamp"
    );
    assert_eq!(book.max_age_ms(&"c", 7_000, 6_000), 0, "never negative");
}

#[test]
fn the_second_pass_asks_the_same_peer_for_a_newer_export() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 100, 10_000);
    let peers = ["a"];
    let p = s.poll(&view(&peers), &book, 1_000);
    assert_eq!(p.fetch[0].max_age_ms, 900, "the sweep's floor");
    s.on_answer(
        &order_for(Some(&s), "a"),
        body_listing(&[3], &[3], &[], 1_100),
        &view(&peers),
        &mut book,
        1_100,
    );
    s.poll(&view(&peers), &book, 1_250);
    let p = s.poll(&view(&peers), &book, 1_500);
    assert_eq!(p.fetch[0].max_age_ms, 1_500 - 1_101);
}

#[test]
fn no_peers_needs_a_synced_registry_that_never_had_a_peer() {
    let book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let unsynced = PeerView::<Peer> {
        peers: &[],
        synced: false,
        ever_had_peers: false,
    };
    let p = s.poll(&unsynced, &book, 1_000);
    assert!(p.verdict.is_none(), "discovery has not spoken yet");
    assert_eq!(p.wait_until_ms, Some(1_250));
    let transient = PeerView::<Peer> {
        peers: &[],
        synced: true,
        ever_had_peers: true,
    };
    assert!(s.poll(&transient, &book, 1_250).verdict.is_none());
    let alone = PeerView::<Peer> {
        peers: &[],
        synced: true,
        ever_had_peers: false,
    };
    let p = s.poll(&alone, &book, 1_500);
    assert_eq!(p.verdict.map(|v| v.kind()), Some(VerdictKind::NoPeers));
}

#[test]
fn a_transiently_empty_registry_times_out_with_no_peer_tried() {
    let book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 2_000);
    let transient = PeerView::<Peer> {
        peers: &[],
        synced: true,
        ever_had_peers: true,
    };
    assert!(s.poll(&transient, &book, 1_000).verdict.is_none());
    let p = s.poll(&transient, &book, 2_000);
    let Some(Verdict::TimedOut {
        peers_tried,
        siblings,
        ..
    }) = p.verdict
    else {
        panic!("expected timed_out, got {:?}", p.verdict);
    };
    assert_eq!((peers_tried, siblings), (0, 0));
}

#[test]
fn the_sweep_times_out_at_its_deadline_with_the_peers_tried_and_last_reason() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 2_000);
    let peers = ["a"];
    s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &order_for(Some(&s), "a"),
        unreachable(),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(s.poll(&view(&peers), &book, 1_999).verdict.is_none());
    let p = s.poll(&view(&peers), &book, 2_000);
    let Some(Verdict::TimedOut {
        peers_tried,
        siblings,
        last_reason,
    }) = p.verdict
    else {
        panic!("expected timed_out, got {:?}", p.verdict);
    };
    assert_eq!((peers_tried, siblings), (1, 1));
    assert_eq!(last_reason.as_deref(), Some("connection refused"));
}

#[test]
fn a_fetch_timeout_never_outlasts_the_deadline() {
    let book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 1_500);
    let p = s.poll(&view(&["a"]), &book, 1_000);
    assert_eq!(p.fetch[0].timeout_ms, 500);
}

#[test]
fn fleet_cold_when_every_candidate_is_cold_or_rejected() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a", "b", "c"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        rejected(Rejection::NotReady, 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(p.verdict.is_none(), "the pass is still open");
    s.on_answer(
        &order_for(Some(&s), "b"),
        FetchResult::NoSnapshot,
        &view(&peers),
        &mut book,
        1_020,
    );
    let r = Rejection::HashScheme {
        found: "x".into(),
        expected: "y".into(),
    };
    let p = s.on_answer(
        &order_for(Some(&s), "c"),
        rejected(r, 1_030),
        &view(&peers),
        &mut book,
        1_030,
    );
    let Some(Verdict::FleetCold { siblings }) = p.verdict else {
        panic!("expected fleet_cold, got {:?}", p.verdict);
    };
    assert_eq!(siblings, 3);
}

#[test]
fn fleet_cold_is_void_when_the_candidate_set_changed_during_the_pass() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    s.poll(&view(&["a"]), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        rejected(Rejection::Cold, 1_010),
        &view(&["a", "c"]),
        &mut book,
        1_010,
    );
    assert!(p.verdict.is_none(), "c joined and was never asked");
    // Every remaining candidate answered cold, but c left during the pass: still void.
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let before = ["a", "b", "c"];
    s.poll(&view(&before), &book, 2_000);
    for p in ["a", "c"] {
        s.on_answer(
            &order_for(Some(&s), p),
            rejected(Rejection::Cold, 2_010),
            &view(&before),
            &mut book,
            2_010,
        );
    }
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        rejected(Rejection::Cold, 2_020),
        &view(&["a", "b"]),
        &mut book,
        2_020,
    );
    assert!(p.verdict.is_none(), "{:?}", p.verdict);
}

#[test]
fn an_unreachable_busy_or_warm_peer_vetoes_fleet_cold() {
    for other in [
        unreachable(),
        FetchResult::Busy,
        body_listing(&[5], &[5], &[], 1_020),
        rejected(Rejection::CoversNothing, 1_020),
    ] {
        let mut book = PeerBook::new(None);
        let mut s = sweep(&[0], 0, 10_000);
        let peers = ["a", "b"];
        s.poll(&view(&peers), &book, 1_000);
        s.on_answer(
            &order_for(Some(&s), "a"),
            rejected(Rejection::Cold, 1_010),
            &view(&peers),
            &mut book,
            1_010,
        );
        let p = s.on_answer(
            &order_for(Some(&s), "b"),
            other,
            &view(&peers),
            &mut book,
            1_020,
        );
        assert!(p.verdict.is_none(), "{:?}", p.verdict);
    }
}

#[test]
fn a_rank_settles_empty_once_every_candidate_names_it() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body_listing(&[1, 5], &[5], &[1], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(p.settled_empty.is_empty(), "b has not spoken");
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        body_listing(&[1, 6], &[6], &[1], 1_020),
        &view(&peers),
        &mut book,
        1_020,
    );
    assert_eq!(p.settled_empty, vec![ob(1, 1, 0)]);
    assert!(p.verdict.is_none(), "rank 0 is still searched for");
    assert!(!s.holds(RankId(1), kvroute_bootstrap::Incarnation(1)));
    assert!(s.holds(RankId(0), kvroute_bootstrap::Incarnation(1)));
}

#[test]
fn when_every_rank_settles_empty_the_sweep_ends_ranks_resolved() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[1], 0, 10_000);
    let peers = ["a"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[5], &[1], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert_eq!(p.settled_empty, vec![ob(1, 1, 0)]);
    assert_eq!(
        p.verdict.map(|v| v.kind()),
        Some(VerdictKind::RanksResolved)
    );
}

#[test]
fn a_silent_peer_vetoes_empty_and_a_rejected_one_does_not() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[5], &[1], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        unreachable(),
        &view(&peers),
        &mut book,
        1_020,
    );
    assert!(p.settled_empty.is_empty());

    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[5], &[1], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    let r = Rejection::Format {
        found: 2,
        expected: 1,
    };
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        rejected(r, 1_020),
        &view(&peers),
        &mut book,
        1_020,
    );
    assert_eq!(p.settled_empty, vec![ob(1, 1, 0)]);
}

#[test]
fn a_not_ready_sibling_abstains_so_a_ready_one_alone_settles_a_rank_empty() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &order_for(Some(&s), "b"),
        rejected(Rejection::NotReady, 1_005),
        &view(&peers),
        &mut book,
        1_005,
    );
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body_listing(&[1, 5], &[5], &[1], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert_eq!(
        p.settled_empty,
        vec![ob(1, 1, 0)],
        "b, still booting, abstains"
    );
    assert!(s.holds(RankId(0), kvroute_bootstrap::Incarnation(1)));
}

#[test]
fn siblings_that_are_all_cold_or_not_ready_settle_nothing_empty() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        rejected(Rejection::NotReady, 1_005),
        &view(&peers),
        &mut book,
        1_005,
    );
    assert!(p.settled_empty.is_empty());
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        rejected(Rejection::Cold, 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(
        p.settled_empty.is_empty(),
        "abstention alone settles nothing"
    );
    assert_eq!(p.verdict.map(|v| v.kind()), Some(VerdictKind::FleetCold));
}

#[test]
fn a_failed_answer_erases_the_peers_earlier_empty_testimony() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[5], &[1], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    s.on_answer(
        &order_for(Some(&s), "b"),
        unreachable(),
        &view(&peers),
        &mut book,
        1_020,
    );
    s.poll(&view(&peers), &book, 1_250);
    let p = s.poll(&view(&peers), &book, 1_500);
    assert_eq!(asked(&p), ["a", "b"]);
    s.on_answer(
        &order_for(Some(&s), "a"),
        unreachable(),
        &view(&peers),
        &mut book,
        1_510,
    );
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        body(&[6], &[1], 1_520),
        &view(&peers),
        &mut book,
        1_520,
    );
    assert!(p.settled_empty.is_empty(), "a's old testimony was erased");
}

#[test]
fn a_found_answer_also_settles_ranks_every_candidate_names_empty() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[0], &[1], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert_eq!(p.settled_empty, vec![ob(1, 1, 0)]);
    assert_eq!(p.verdict.map(|v| v.kind()), Some(VerdictKind::Found));
}

#[test]
fn ranks_resolved_when_every_rank_left_pending_by_other_means() {
    let book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let gone = s.retain_owed(|o| o.rank != RankId(0));
    assert_eq!(gone, vec![ob(0, 1, 0)]);
    assert!(s.poll(&view(&["a"]), &book, 1_000).verdict.is_none());
    let gone = s.retain_owed(|_| false);
    assert_eq!(gone, vec![ob(1, 1, 0)]);
    let p = s.poll(&view(&["a"]), &book, 1_100);
    assert_eq!(
        p.verdict.map(|v| v.kind()),
        Some(VerdictKind::RanksResolved)
    );
}

#[test]
fn answers_from_peers_not_asked_or_already_answered_are_ignored() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "z"),
        body(&[0], &[], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(p.verdict.is_none());
    s.on_answer(
        &order_for(Some(&s), "a"),
        unreachable(),
        &view(&peers),
        &mut book,
        1_020,
    );
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[0], &[], 1_030),
        &view(&peers),
        &mut book,
        1_030,
    );
    assert!(p.verdict.is_none(), "a already answered this pass");
}

#[test]
fn a_merged_rank_joins_the_pending_set_the_sweep_searches_for() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a"];
    s.poll(&view(&peers), &book, 1_000);
    assert!(s.admit(ob(4, 2, 900)));
    assert!(!s.admit(ob(4, 2, 900)), "held once");
    assert_eq!(s.floor_ms(), 0, "merging does not move the request's floor");
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[4], &[], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert_eq!(p.verdict.map(|v| v.kind()), Some(VerdictKind::Found));
}

#[test]
fn an_answer_to_an_earlier_pass_is_never_taken_as_fresh() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a", "b"];
    let first = s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &first.fetch[1],
        unreachable(),
        &view(&peers),
        &mut book,
        1_010,
    );
    s.on_answer(
        &first.fetch[0],
        FetchResult::Busy,
        &view(&peers),
        &mut book,
        1_020,
    );
    s.poll(&view(&peers), &book, 1_250);
    let second = s.poll(&view(&peers), &book, 1_500);
    assert_eq!(asked(&second), ["a", "b"]);
    assert_ne!(second.fetch[0].ticket, first.fetch[0].ticket);
    // A late duplicate of the first pass's answer, asked with an older floor, arrives now.
    let p = s.on_answer(
        &first.fetch[0],
        body(&[0], &[], 1_510),
        &view(&peers),
        &mut book,
        1_510,
    );
    assert!(p.verdict.is_none(), "stale answer ignored");
    let p = s.on_answer(
        &second.fetch[0],
        body(&[0], &[], 1_520),
        &view(&peers),
        &mut book,
        1_520,
    );
    assert_eq!(p.verdict.map(|v| v.kind()), Some(VerdictKind::Found));
}

#[test]
fn a_pass_whose_answer_never_arrives_closes_after_the_fetch_timeout() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a", "b"];
    let first = s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &first.fetch[0],
        rejected(Rejection::Cold, 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    let p = s.poll(&view(&peers), &book, 2_999);
    assert!(p.fetch.is_empty(), "b's fetch may still report");
    let p = s.poll(&view(&peers), &book, 3_000);
    assert!(p.verdict.is_none(), "a silent peer vetoes fleet_cold");
    assert_eq!(asked(&p), ["a", "b"], "the next pass starts at once");
}

// ---- ranks no sibling knows ----

#[test]
fn a_rank_every_witness_lists_and_none_knows_is_unknown_to_the_fleet_once_all_answered() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[5], &[], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(p.unknown_to_fleet.is_empty(), "b has not spoken");
    // b knows rank 1 (covers it), so only rank 0 is unknown to every witness.
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        body(&[1], &[], 1_020),
        &view(&peers),
        &mut book,
        1_020,
    );
    assert_eq!(p.unknown_to_fleet, vec![ob(0, 1, 0)]);
    assert!(matches!(p.verdict, Some(Verdict::Found { peer: "b", .. })));
}

#[test]
fn a_silent_sibling_keeps_a_rank_the_others_do_not_know_searched_for() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[5], &[], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        unreachable(),
        &view(&peers),
        &mut book,
        1_020,
    );
    assert!(p.unknown_to_fleet.is_empty(), "b may be the one that knows");
    assert!(p.verdict.is_none());
    assert!(s.holds(RankId(0), kvroute_bootstrap::Incarnation(1)));
}

#[test]
fn a_witness_whose_table_lacks_the_rank_keeps_it_searched_for() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a"];
    s.poll(&view(&peers), &book, 1_000);
    let p = s.on_answer(
        &order_for(Some(&s), "a"),
        body_listing(&[5], &[5], &[], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(p.unknown_to_fleet.is_empty(), "a has not registered rank 0");
    assert!(p.verdict.is_none());
}

#[test]
fn a_not_ready_sibling_abstains_from_the_unknown_rule_like_from_the_empty_one() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &order_for(Some(&s), "a"),
        FetchResult::NoSnapshot,
        &view(&peers),
        &mut book,
        1_010,
    );
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        body(&[5], &[], 1_020),
        &view(&peers),
        &mut book,
        1_020,
    );
    assert_eq!(p.unknown_to_fleet, vec![ob(0, 1, 0)]);
    assert_eq!(
        p.verdict.map(|v| v.kind()),
        Some(VerdictKind::RanksResolved)
    );
}

#[test]
fn one_sibling_with_the_whole_history_naming_a_rank_empty_outweighs_one_blind_to_it() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[0, 1], 0, 10_000);
    let peers = ["blind", "whole"];
    s.poll(&view(&peers), &book, 1_000);
    // `blind` lists rank 1 and knows nothing of it; `whole` names it empty.
    let p = s.on_answer(
        &order_for(Some(&s), "blind"),
        body(&[5], &[], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    assert!(p.settled_empty.is_empty(), "`whole` has not spoken");
    let p = s.on_answer(
        &order_for(Some(&s), "whole"),
        body(&[6], &[1], 1_020),
        &view(&peers),
        &mut book,
        1_020,
    );
    assert_eq!(p.settled_empty, vec![ob(1, 1, 0)]);
    assert_eq!(p.unknown_to_fleet, vec![ob(0, 1, 0)], "nobody knows rank 0");
}

#[test]
fn a_rank_one_sibling_covers_is_neither_empty_nor_unknown_whatever_the_others_say() {
    let mut book = PeerBook::new(None);
    let mut s = sweep(&[1], 0, 10_000);
    let peers = ["a", "b"];
    s.poll(&view(&peers), &book, 1_000);
    s.on_answer(
        &order_for(Some(&s), "a"),
        body(&[5], &[1], 1_010),
        &view(&peers),
        &mut book,
        1_010,
    );
    let p = s.on_answer(
        &order_for(Some(&s), "b"),
        body(&[1], &[], 1_020),
        &view(&peers),
        &mut book,
        1_020,
    );
    assert!(p.settled_empty.is_empty() && p.unknown_to_fleet.is_empty());
    assert!(matches!(p.verdict, Some(Verdict::Found { peer: "b", .. })));
}
