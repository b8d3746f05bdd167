//! The search for a warm sibling, and the bookkeeping around it, as pure state machines.
//!
//! The service moves bytes and keeps timers; everything it DECIDES lives here, over values and
//! caller-supplied `now_ms` (one monotonic millisecond clock of this replica):
//!
//! * [`PeerBook`] remembers, for the whole boot, what each sibling answered: a peer rejected
//!   permanently is never fetched again, a peer that answered "nothing" (cold, not ready, covers
//!   none of the pending ranks, unreachable) sits out passes for [`PEER_SIT_OUT_FIRST_MS`],
//!   doubling per repeat miss up to [`PEER_SIT_OUT_MAX_MS`] (retrying every pass would re-download
//!   a multi-megabyte body from a replica that is serving traffic), and this replica itself is
//!   never a candidate.
//! * [`Sweep`] runs passes every [`PASS_INTERVAL_MS`] until a verdict: `found`, `no_peers`,
//!   `fleet_cold`, `timed_out` or `ranks_resolved`. A body that vets but covers none of the
//!   pending ranks does not end it; a rank no sibling covers settles `empty` mid-sweep once a
//!   sibling names it in `empty_ranks` and every other has answered (a candidate that is itself
//!   cold or not ready abstains, a silent one vetoes), and is handed
//!   to the engine as `unknown to the fleet` once every candidate that answered with a vetted body
//!   lists the rank and knows nothing of it (a booting sibling holding it too, a sibling that
//!   joined its stream mid-way): waiting would only wait for the deadline.
//! * [`Coordinator`] keeps one fleet-wide sweep in flight (one body carries every rank, so N
//!   engines discovered together cost one fetch, not N), folds ranks discovered meanwhile into
//!   it, makes a gap retry whose floor is newer than the in-flight request wait for its own
//!   sweep, hands back ranks a sweep never spoke for, and releases every rank it holds exactly
//!   once (each release is a [`Release`] the pump acts on).
//! * [`fetch_timeout`] and [`ReadinessLatch`] are the deadline math and the `/readyz` rule.
//!
//! Freshness. The producer (`/internal/kv_snapshot`) serves a cached export only while
//! `arrival - stamp <= max_age_ms`, where `stamp` was taken BEFORE sampling and `arrival` is when
//! the request reached it; it reports the served export's age at arrival in the
//! `x-kvroute-snapshot-age-ms` response header. The body itself carries NO export time. So the
//! consumer bounds the export's stamp on its own clock: `stamp <= received_ms - age_ms` (arrival
//! precedes our receipt), or `stamp <= received_ms` when the header is absent (an older
//! producer). A request sent at `now_ms` with `max_age_ms = now_ms - floor_ms` can only be served
//! an export stamped at or after `floor_ms` (its arrival is at or after `now_ms`). The floor of a
//! fetch is the newer of the sweep's freshness floor (when its ranks began holding, or the gap,
//! for a retry) and one millisecond past the newest stamp the same peer already served, so a
//! re-fetch never gets the same cached export again.

use std::collections::{BTreeMap, BTreeSet};

use kvroute_index::RankId;
use thiserror::Error;

use crate::outcome::{Incarnation, Outcome};
use crate::vet::{Coverage, Rejection, VettedSnapshot};

/// Time between the starts of two passes over the siblings.
pub const PASS_INTERVAL_MS: u64 = 250;
/// A peer's first sit-out after answering "nothing": one pass.
pub const PEER_SIT_OUT_FIRST_MS: u64 = PASS_INTERVAL_MS;
/// Longest sit-out; the doubling stops here.
pub const PEER_SIT_OUT_MAX_MS: u64 = 30_000;
/// The per-fetch timeout is at most the bootstrap deadline divided by this, so one hung peer
/// can never use up the whole search (a strict fraction: the divisor is above 1).
pub const FETCH_TIMEOUT_DEADLINE_DIVISOR: u64 = 4;
/// Transfer rate assumed when checking that the per-fetch timeout can carry the expected body:
/// a producer that is serving traffic, over a shared cluster network (about 200 Mbit/s).
pub const FETCH_MIN_TRANSFER_BYTES_PER_S: u64 = 25 * 1024 * 1024;
/// With `--kv-bootstrap-seed-required`, readiness is held after a timed-out sweep for at most
/// this many bootstrap timeouts from the moment the deadline was armed, so a dead fleet cannot
/// hold it forever.
pub const SEED_REQUIRED_HOLD_DEADLINE_FACTOR: u64 = 3;
/// Longest failure reason kept for the `timed_out` verdict's log line.
pub const SWEEP_REASON_MAX_BYTES: usize = 256;

fn bounded_reason(s: &str) -> String {
    let mut end = s.len().min(SWEEP_REASON_MAX_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// A rank a sweep owes a snapshot: which registration, and how fresh the export must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Obligation {
    pub rank: RankId,
    pub incarnation: Incarnation,
    /// The export must be stamped at or after this instant (`now_ms` clock): when the rank began
    /// holding its batches, or the gap, for a gap retry.
    pub floor_ms: u64,
}

impl Obligation {
    fn key(&self) -> (RankId, Incarnation) {
        (self.rank, self.incarnation)
    }
}

/// The sibling set as discovery reports it (`kvroute-peers`' registry snapshot).
#[derive(Debug, Clone, Copy)]
pub struct PeerView<'a, P> {
    pub peers: &'a [P],
    /// A discovery source has delivered at least one complete answer.
    pub synced: bool,
    /// Some answer since start had at least one peer.
    pub ever_had_peers: bool,
}

/// What the consumer knows about when a served export was taken; see the module doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportStamp {
    /// When the response arrived (`now_ms` clock).
    pub received_ms: u64,
    /// The `x-kvroute-snapshot-age-ms` header, if the producer sent it.
    pub age_ms: Option<u64>,
}

impl ExportStamp {
    /// The latest instant the export can have been stamped at.
    pub fn newest_possible_ms(&self) -> u64 {
        self.received_ms.saturating_sub(self.age_ms.unwrap_or(0))
    }
}

/// How one fetch from one peer ended, as the service reports it.
#[derive(Debug, Clone)]
pub enum FetchResult {
    /// A 200 with a body, and what [`crate::vet::vet`] made of it.
    Body {
        vetted: Result<VettedSnapshot, Rejection>,
        stamp: ExportStamp,
    },
    /// The peer says it has nothing to serve: 404 (no index for the model, or an older build
    /// without the endpoint) or 503 `index_not_ready` (it has not applied one batch yet).
    NoSnapshot,
    /// The peer is warm but refused for now: 503 `busy`, 429.
    Busy,
    /// Connect failure, timeout, broken body, or any other status.
    Unreachable { reason: String },
}

/// Names the pass a fetch was ordered by. An answer is accepted only by the pass that ordered
/// it: a slow answer to an earlier pass (or an earlier sweep, asked with an older freshness
/// floor) must never be taken as fresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    pub sweep: u64,
    pub pass: u64,
}

/// One fetch the service should start now; hand it back with the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchOrder<P> {
    pub ticket: Ticket,
    pub peer: P,
    /// The `max_age_ms` query parameter.
    pub max_age_ms: u64,
    /// The fetch's total timeout: the per-fetch timeout, cut to what is left of the deadline.
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Default)]
struct PeerRecord {
    misses: u32,
    sit_out_until_ms: u64,
    rejected: bool,
    newest_export_ms: Option<u64>,
}

/// What this boot has learned about each sibling; lives as long as the boot, across sweeps.
#[derive(Debug, Clone)]
pub struct PeerBook<P> {
    self_id: Option<P>,
    peers: BTreeMap<P, PeerRecord>,
}

impl<P: Ord + Clone> PeerBook<P> {
    /// `self_id` is this replica's own address as siblings would list it; it is never fetched.
    pub fn new(self_id: Option<P>) -> Self {
        PeerBook {
            self_id,
            peers: BTreeMap::new(),
        }
    }

    pub fn is_self(&self, peer: &P) -> bool {
        self.self_id.as_ref() == Some(peer)
    }

    pub fn is_rejected(&self, peer: &P) -> bool {
        self.peers.get(peer).is_some_and(|r| r.rejected)
    }

    pub fn sitting_out(&self, peer: &P, now_ms: u64) -> bool {
        self.peers
            .get(peer)
            .is_some_and(|r| now_ms < r.sit_out_until_ms)
    }

    /// Not self, not rejected permanently, not sitting out.
    pub fn may_fetch(&self, peer: &P, now_ms: u64) -> bool {
        !self.is_self(peer) && !self.is_rejected(peer) && !self.sitting_out(peer, now_ms)
    }

    /// The peer answered nothing usable: it sits out, twice as long as last time, capped.
    /// Returns the sit-out.
    pub fn record_miss(&mut self, peer: &P, now_ms: u64) -> u64 {
        let r = self.peers.entry(peer.clone()).or_default();
        r.misses = r.misses.saturating_add(1);
        let sit_out = 2u64
            .checked_pow(r.misses - 1)
            .and_then(|factor| PEER_SIT_OUT_FIRST_MS.checked_mul(factor))
            .map_or(PEER_SIT_OUT_MAX_MS, |ms| ms.min(PEER_SIT_OUT_MAX_MS));
        r.sit_out_until_ms = now_ms.saturating_add(sit_out);
        sit_out
    }

    /// The peer answered with a snapshot that covers a pending rank: its miss streak ends.
    pub fn record_useful(&mut self, peer: &P) {
        let r = self.peers.entry(peer.clone()).or_default();
        r.misses = 0;
        r.sit_out_until_ms = 0;
    }

    /// The peer is never fetched again this boot.
    pub fn record_rejected(&mut self, peer: &P) {
        self.peers.entry(peer.clone()).or_default().rejected = true;
    }

    /// Remembers the newest export the peer has served, so a re-fetch demands a newer one.
    pub fn record_export(&mut self, peer: &P, stamp: ExportStamp) {
        let r = self.peers.entry(peer.clone()).or_default();
        let t = stamp.newest_possible_ms();
        r.newest_export_ms = Some(r.newest_export_ms.map_or(t, |old| old.max(t)));
    }

    /// The `max_age_ms` for a fetch from `peer` sent at `now_ms` that must be served an export
    /// stamped at or after `floor_ms` AND newer than anything the peer served before.
    pub fn max_age_ms(&self, peer: &P, floor_ms: u64, now_ms: u64) -> u64 {
        let seen = self
            .peers
            .get(peer)
            .and_then(|r| r.newest_export_ms)
            .map_or(0, |t| t.saturating_add(1));
        now_ms.saturating_sub(floor_ms.max(seen))
    }
}

/// How a sweep ended.
#[derive(Debug, Clone)]
pub enum Verdict<P> {
    /// A vetted snapshot from `peer` covers at least one pending rank.
    Found { peer: P, snapshot: VettedSnapshot },
    /// Discovery is synced, has no sibling and never had one: this is the first replica.
    NoPeers,
    /// Every candidate is cold or rejected permanently, over one unchanged candidate set.
    FleetCold { siblings: usize },
    /// The deadline passed.
    TimedOut {
        peers_tried: usize,
        siblings: usize,
        last_reason: Option<String>,
    },
    /// Every rank left `Pending` by other means (or settled `empty` in the sweep).
    RanksResolved,
}

/// A verdict without its payload, for metrics and the readiness rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VerdictKind {
    Found,
    NoPeers,
    FleetCold,
    TimedOut,
    RanksResolved,
}

impl VerdictKind {
    pub fn label(self) -> &'static str {
        match self {
            VerdictKind::Found => "found",
            VerdictKind::NoPeers => "no_peers",
            VerdictKind::FleetCold => "fleet_cold",
            VerdictKind::TimedOut => "timed_out",
            VerdictKind::RanksResolved => "ranks_resolved",
        }
    }
}

impl<P> Verdict<P> {
    pub fn kind(&self) -> VerdictKind {
        match self {
            Verdict::Found { .. } => VerdictKind::Found,
            Verdict::NoPeers => VerdictKind::NoPeers,
            Verdict::FleetCold { .. } => VerdictKind::FleetCold,
            Verdict::TimedOut { .. } => VerdictKind::TimedOut,
            Verdict::RanksResolved => VerdictKind::RanksResolved,
        }
    }
}

/// What a sweep step produced.
#[derive(Debug, Clone)]
pub struct Progress<P> {
    /// Fetches to start now.
    pub fetch: Vec<FetchOrder<P>>,
    /// When to call `poll` next (unless an answer arrives first); `None` once finished.
    pub wait_until_ms: Option<u64>,
    /// Ranks every candidate names in `empty_ranks`: settle them `empty` now.
    pub settled_empty: Vec<Obligation>,
    /// Ranks no candidate knows (see [`Sweep::settle_by_witnesses`]): release them now.
    pub unknown_to_fleet: Vec<Obligation>,
    pub verdict: Option<Verdict<P>>,
}

impl<P> Default for Progress<P> {
    fn default() -> Self {
        Progress {
            fetch: Vec::new(),
            wait_until_ms: None,
            settled_empty: Vec::new(),
            unknown_to_fleet: Vec::new(),
            verdict: None,
        }
    }
}

/// A peer's latest answer in this sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Standing {
    /// Not ready, no nodes, or no snapshot at all.
    Cold,
    Rejected,
    /// Vetted, but covers none of the pending ranks.
    CoversNone,
    /// Unreachable, busy, or a damaged body: says nothing.
    #[default]
    Silent,
    Useful,
}

#[derive(Debug, Clone, Default)]
struct Testimony {
    standing: Standing,
    /// Ranks its latest vetted snapshot names empty; erased by any later non-vetted answer.
    empty: BTreeSet<RankId>,
    /// Ranks its latest vetted snapshot lists in its rank table (the producer knows the worker).
    listed: BTreeSet<RankId>,
    /// Listed ranks it covers (nodes and a cursor).
    covered: BTreeSet<RankId>,
}

impl Testimony {
    fn of(standing: Standing) -> Testimony {
        Testimony {
            standing,
            ..Testimony::default()
        }
    }

    fn vetted(standing: Standing, snapshot: &VettedSnapshot) -> Testimony {
        let mut t = Testimony::of(standing);
        for (rank, coverage) in snapshot.ranks() {
            t.listed.insert(rank);
            match coverage {
                Coverage::Empty => {
                    t.empty.insert(rank);
                }
                Coverage::Covered { .. } => {
                    t.covered.insert(rank);
                }
                Coverage::Unknown => {}
            }
        }
        t
    }
}

#[derive(Debug, Clone)]
struct Pass<P> {
    seq: u64,
    candidates: Vec<P>,
    outstanding: BTreeSet<P>,
    /// Every order's timeout has passed: an answer still missing will never come.
    expires_ms: u64,
    /// The earliest start of the pass after this one.
    next_pass_ms: u64,
    /// The best body of this pass that covers some pending rank only partially (its producer
    /// joined that rank's stream mid-way), kept while other siblings may still answer with
    /// the whole history; delivered when the pass ends without one.
    partial_offer: Option<PartialOffer<P>>,
}

/// A body that would do, but that a sibling with the whole history could beat.
#[derive(Debug, Clone)]
struct PartialOffer<P> {
    peer: P,
    snapshot: VettedSnapshot,
    /// (pending ranks covered with their whole history, pending ranks covered at all).
    score: (usize, usize),
}

/// Where a sweep is in its life:
///
/// * `Waiting` -> `Open`: `poll` at or after `next_pass_ms` orders fetches;
/// * `Waiting` -> `Waiting`: the registry is not synced yet, or a pass had nobody to ask;
/// * `Open` -> `Waiting`: the pass's last answer arrived, or its fetch timeout passed;
/// * `Waiting` | `Open` -> `Finished`: a verdict (found, no peers, fleet cold, timed out,
///   ranks resolved). Nothing leaves `Finished`.
#[derive(Debug, Clone)]
enum SweepPhase<P> {
    Waiting { next_pass_ms: u64 },
    Open(Pass<P>),
    Finished,
}

/// One fleet-wide search for a snapshot; see the module doc. Yields exactly one verdict; every
/// call after it returns an empty [`Progress`].
#[derive(Debug, Clone)]
pub struct Sweep<P> {
    id: u64,
    passes: u64,
    obligations: BTreeMap<(RankId, Incarnation), Obligation>,
    floor_ms: u64,
    deadline_ms: u64,
    fetch_timeout_ms: u64,
    testimony: BTreeMap<P, Testimony>,
    tried: BTreeSet<P>,
    phase: SweepPhase<P>,
    last_reason: Option<String>,
}

impl<P: Ord + Clone> Sweep<P> {
    /// A sweep for `obligations`, asking with the strictest (newest) of their floors, giving up
    /// at `deadline_ms`. Its first pass may start at once. `id` goes into every [`Ticket`]; give
    /// each sweep of a boot its own.
    pub fn new(
        id: u64,
        obligations: Vec<Obligation>,
        deadline_ms: u64,
        fetch_timeout_ms: u64,
    ) -> Self {
        let floor_ms = obligations.iter().map(|o| o.floor_ms).max().unwrap_or(0);
        Sweep {
            id,
            passes: 0,
            obligations: obligations.into_iter().map(|o| (o.key(), o)).collect(),
            floor_ms,
            deadline_ms,
            fetch_timeout_ms,
            testimony: BTreeMap::new(),
            tried: BTreeSet::new(),
            phase: SweepPhase::Waiting { next_pass_ms: 0 },
            last_reason: None,
        }
    }

    /// The freshness floor every fetch of this sweep asks with; fixed at the start.
    pub fn floor_ms(&self) -> u64 {
        self.floor_ms
    }

    pub fn deadline_ms(&self) -> u64 {
        self.deadline_ms
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.phase, SweepPhase::Finished)
    }

    pub fn obligations(&self) -> impl Iterator<Item = &Obligation> + '_ {
        self.obligations.values()
    }

    /// The ticket of the pass whose answers are awaited, if one is open.
    pub fn current_ticket(&self) -> Option<Ticket> {
        match &self.phase {
            SweepPhase::Open(p) => Some(Ticket {
                sweep: self.id,
                pass: p.seq,
            }),
            _ => None,
        }
    }

    pub fn holds(&self, rank: RankId, incarnation: Incarnation) -> bool {
        self.obligations.contains_key(&(rank, incarnation))
    }

    /// Adds an obligation discovered while the sweep runs; it shares the sweep's delivery.
    /// False if already held.
    pub fn admit(&mut self, ob: Obligation) -> bool {
        if self.is_finished() || self.obligations.contains_key(&ob.key()) {
            return false;
        }
        self.obligations.insert(ob.key(), ob);
        true
    }

    /// Drops obligations no longer owed (the rank left `Pending` by other means, or was
    /// re-registered) and returns them.
    pub fn retain_owed(&mut self, owed: impl Fn(&Obligation) -> bool) -> Vec<Obligation> {
        let gone: Vec<Obligation> = self
            .obligations
            .values()
            .filter(|o| !owed(o))
            .copied()
            .collect();
        for o in &gone {
            self.obligations.remove(&o.key());
        }
        gone
    }

    fn into_obligations(self) -> Vec<Obligation> {
        self.obligations.into_values().collect()
    }

    fn candidates(&self, view: &PeerView<'_, P>, book: &PeerBook<P>) -> Vec<P> {
        let set: BTreeSet<&P> = view.peers.iter().filter(|p| !book.is_self(p)).collect();
        set.into_iter().cloned().collect()
    }

    fn finish(&mut self, out: &mut Progress<P>, verdict: Verdict<P>) {
        self.phase = SweepPhase::Finished;
        out.fetch.clear();
        out.wait_until_ms = None;
        out.verdict = Some(verdict);
    }

    fn set_wait(&self, out: &mut Progress<P>) {
        out.wait_until_ms = match &self.phase {
            SweepPhase::Finished => None,
            SweepPhase::Open(pass) => Some(pass.expires_ms.min(self.deadline_ms)),
            SweepPhase::Waiting { next_pass_ms } => Some((*next_pass_ms).min(self.deadline_ms)),
        };
    }

    /// Timer tick: ends the sweep if it is over, else starts a pass when one is due.
    pub fn poll(&mut self, view: &PeerView<'_, P>, book: &PeerBook<P>, now_ms: u64) -> Progress<P> {
        let mut out = Progress::default();
        if self.is_finished() {
            return out;
        }
        if self.obligations.is_empty() {
            self.finish(&mut out, Verdict::RanksResolved);
            return out;
        }
        if now_ms >= self.deadline_ms {
            // A partial cover kept while the last pass waited is still a seed: deliver it
            // rather than time out with it in hand.
            if matches!(&self.phase, SweepPhase::Open(p) if p.partial_offer.is_some()) {
                self.end_pass(view, book, &mut out);
                if self.is_finished() {
                    return out;
                }
            }
            let verdict = Verdict::TimedOut {
                peers_tried: self.tried.len(),
                siblings: self.candidates(view, book).len(),
                last_reason: self.last_reason.clone(),
            };
            self.finish(&mut out, verdict);
            return out;
        }
        if let SweepPhase::Open(pass) = &mut self.phase {
            if now_ms < pass.expires_ms {
                self.set_wait(&mut out);
                return out;
            }
            // A fetch that never reported back (its task died) must not hold the pass open
            // until the deadline: it counts as a silent answer.
            let overdue = std::mem::take(&mut pass.outstanding);
            for peer in overdue {
                self.tried.insert(peer.clone());
                self.testimony.insert(peer, Testimony::of(Standing::Silent));
                self.last_reason = Some("a fetch never reported back".into());
            }
            self.end_pass(view, book, &mut out);
            if self.is_finished() {
                return out;
            }
        }
        let SweepPhase::Waiting { next_pass_ms } = self.phase else {
            return out;
        };
        if now_ms < next_pass_ms {
            self.set_wait(&mut out);
            return out;
        }
        let candidates = self.candidates(view, book);
        if view.synced && candidates.is_empty() && !view.ever_had_peers {
            self.finish(&mut out, Verdict::NoPeers);
            return out;
        }
        let next_pass_ms = now_ms.saturating_add(PASS_INTERVAL_MS);
        if !view.synced {
            self.phase = SweepPhase::Waiting { next_pass_ms };
            self.set_wait(&mut out);
            return out;
        }
        let timeout_ms = self
            .fetch_timeout_ms
            .min(self.deadline_ms.saturating_sub(now_ms));
        self.passes += 1;
        let ticket = Ticket {
            sweep: self.id,
            pass: self.passes,
        };
        let orders: Vec<FetchOrder<P>> = candidates
            .iter()
            .filter(|p| book.may_fetch(p, now_ms))
            .map(|p| FetchOrder {
                ticket,
                peer: p.clone(),
                max_age_ms: book.max_age_ms(p, self.floor_ms, now_ms),
                timeout_ms,
            })
            .collect();
        self.phase = SweepPhase::Open(Pass {
            seq: self.passes,
            candidates,
            outstanding: orders.iter().map(|o| o.peer.clone()).collect(),
            expires_ms: now_ms.saturating_add(timeout_ms),
            next_pass_ms,
            partial_offer: None,
        });
        if orders.is_empty() {
            self.end_pass(view, book, &mut out);
        } else {
            out.fetch = orders;
        }
        self.set_wait(&mut out);
        out
    }

    /// The fetch `order` ended with `result`. Answers to orders of another sweep or pass, or
    /// from a peer that already answered, are ignored.
    pub fn on_answer(
        &mut self,
        order: &FetchOrder<P>,
        result: FetchResult,
        view: &PeerView<'_, P>,
        book: &mut PeerBook<P>,
        now_ms: u64,
    ) -> Progress<P> {
        let mut out = Progress::default();
        let peer = &order.peer;
        let SweepPhase::Open(pass) = &mut self.phase else {
            return out;
        };
        let current = order.ticket
            == Ticket {
                sweep: self.id,
                pass: pass.seq,
            };
        if !current || !pass.outstanding.remove(peer) {
            self.set_wait(&mut out);
            return out;
        }
        self.tried.insert(peer.clone());
        let mut found = None;
        let testimony = match result {
            FetchResult::Body {
                vetted: Ok(snapshot),
                stamp,
            } => {
                book.record_export(peer, stamp);
                let (complete, covered) = self.obligations.keys().fold((0, 0), |(c, a), (r, _)| {
                    let coverage = snapshot.coverage(*r);
                    (
                        c + usize::from(coverage.is_complete_cover()),
                        a + usize::from(coverage.is_covered()),
                    )
                });
                if covered > 0 {
                    book.record_useful(peer);
                    let t = Testimony::vetted(Standing::Useful, &snapshot);
                    if complete == covered {
                        found = Some(snapshot);
                    } else {
                        // Some rank would be inherited partial: let the rest of the pass
                        // answer first, in case a sibling holds its whole history.
                        let score = (complete, covered);
                        if pass.partial_offer.as_ref().is_none_or(|o| score > o.score) {
                            pass.partial_offer = Some(PartialOffer {
                                peer: peer.clone(),
                                snapshot,
                                score,
                            });
                        }
                    }
                    t
                } else {
                    book.record_miss(peer, now_ms);
                    self.last_reason = Some("the snapshot covers none of the pending ranks".into());
                    Testimony::vetted(Standing::CoversNone, &snapshot)
                }
            }
            FetchResult::Body {
                vetted: Err(rejection),
                stamp,
            } => {
                book.record_export(peer, stamp);
                let standing = if rejection.is_permanent() {
                    book.record_rejected(peer);
                    Standing::Rejected
                } else {
                    book.record_miss(peer, now_ms);
                    match rejection {
                        Rejection::NotReady | Rejection::Cold => Standing::Cold,
                        Rejection::CoversNothing => Standing::CoversNone,
                        _ => Standing::Silent,
                    }
                };
                self.last_reason = Some(bounded_reason(&rejection.to_string()));
                Testimony::of(standing)
            }
            FetchResult::NoSnapshot => {
                book.record_miss(peer, now_ms);
                self.last_reason = Some("the peer has no snapshot to serve".into());
                Testimony::of(Standing::Cold)
            }
            FetchResult::Busy => {
                book.record_miss(peer, now_ms);
                self.last_reason = Some("the peer is busy".into());
                Testimony::of(Standing::Silent)
            }
            FetchResult::Unreachable { reason } => {
                book.record_miss(peer, now_ms);
                self.last_reason = Some(bounded_reason(&reason));
                Testimony::of(Standing::Silent)
            }
        };
        self.testimony.insert(peer.clone(), testimony);
        if let Some(snapshot) = found {
            let candidates = self.candidates(view, book);
            self.settle_by_witnesses(&candidates, book, &mut out);
            self.finish(
                &mut out,
                Verdict::Found {
                    peer: peer.clone(),
                    snapshot,
                },
            );
            return out;
        }
        if matches!(&self.phase, SweepPhase::Open(p) if p.outstanding.is_empty()) {
            self.end_pass(view, book, &mut out);
        }
        self.set_wait(&mut out);
        out
    }

    /// Settles what the siblings' testimony decides about each obligation, once every
    /// non-rejected candidate has answered. A candidate whose latest answer was cold (not ready,
    /// an empty index, no snapshot) abstains: it has no view of the rank to testify with, and
    /// counting its silence as a veto made a replica of a staggered whole-fleet restart wait its
    /// full deadline on a fresh engine while its booting siblings said nothing. A silent
    /// candidate (unreachable, busy, a damaged body) vetoes both rules below: it may be the one
    /// replica that holds the rank. Among the remaining witnesses, for a rank no witness covers:
    ///
    /// * `empty` when at least one names it in `empty_ranks`. A producer names a rank empty only
    ///   when it holds the rank's whole history since its publisher's origin, so one such word
    ///   is proof; a sibling that merely knows nothing of the rank (it joined the stream
    ///   mid-way) cannot contradict it. (The engine is asked first anyway, where it has a replay
    ///   socket.)
    /// * `unknown to the fleet` when none names it empty and every one lists the rank: every
    ///   sibling is as blind to it as this replica (they all hold it in their own bootstrap, or
    ///   joined its stream mid-way), so no later pass can bring a snapshot of it and only its
    ///   engine can. A witness that does not list the rank (its producer has not registered the
    ///   worker yet) keeps the search going.
    ///
    /// A rank some witness covers is left to the snapshot that covers it.
    fn settle_by_witnesses(&mut self, candidates: &[P], book: &PeerBook<P>, out: &mut Progress<P>) {
        let answered: Option<Vec<&Testimony>> = candidates
            .iter()
            .filter(|p| !book.is_rejected(p))
            .map(|p| self.testimony.get(p))
            .collect();
        let witnesses: Vec<&Testimony> = answered
            .unwrap_or_default()
            .into_iter()
            .filter(|t| t.standing != Standing::Cold)
            .collect();
        let all_vetted = witnesses
            .iter()
            .all(|t| matches!(t.standing, Standing::Useful | Standing::CoversNone));
        if witnesses.is_empty() || !all_vetted {
            return;
        }
        let mut settled = Vec::new();
        let mut unknown = Vec::new();
        for o in self.obligations.values() {
            let r = &o.rank;
            let covered = witnesses.iter().any(|t| t.covered.contains(r));
            if covered {
                continue;
            }
            if witnesses.iter().any(|t| t.empty.contains(r)) {
                settled.push(*o);
            } else if witnesses.iter().all(|t| t.listed.contains(r)) {
                unknown.push(*o);
            }
        }
        for o in settled {
            self.obligations.remove(&o.key());
            out.settled_empty.push(o);
        }
        for o in unknown {
            self.obligations.remove(&o.key());
            out.unknown_to_fleet.push(o);
        }
    }

    fn end_pass(&mut self, view: &PeerView<'_, P>, book: &PeerBook<P>, out: &mut Progress<P>) {
        let placeholder = SweepPhase::Waiting { next_pass_ms: 0 };
        let pass = match std::mem::replace(&mut self.phase, placeholder) {
            SweepPhase::Open(pass) => pass,
            other => {
                self.phase = other;
                return;
            }
        };
        self.phase = SweepPhase::Waiting {
            next_pass_ms: pass.next_pass_ms,
        };
        let now_candidates = self.candidates(view, book);
        self.settle_by_witnesses(&now_candidates, book, out);
        if let Some(offer) = pass.partial_offer {
            // No sibling of this pass had the whole history of every rank the offer covers:
            // inheriting a sibling's partial view still beats starting blind (its ranks settle
            // `warm_partial`, not `warm`).
            self.finish(
                out,
                Verdict::Found {
                    peer: offer.peer,
                    snapshot: offer.snapshot,
                },
            );
            return;
        }
        if self.obligations.is_empty() {
            self.finish(out, Verdict::RanksResolved);
            return;
        }
        // A candidate that joined or left during the pass was not consulted on equal terms;
        // its state (unlike events after subscription) cannot be recovered later, so a cold
        // verdict over a changed set is void.
        let cold = !now_candidates.is_empty()
            && pass.candidates == now_candidates
            && now_candidates.iter().all(|p| {
                book.is_rejected(p)
                    || self
                        .testimony
                        .get(p)
                        .is_some_and(|t| matches!(t.standing, Standing::Cold | Standing::Rejected))
            });
        if cold {
            self.finish(
                out,
                Verdict::FleetCold {
                    siblings: now_candidates.len(),
                },
            );
        }
    }
}

/// Whether an obligation submitted while a sweep is in flight may ride it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateJoin {
    /// Discovery: merge into the in-flight sweep even if its floor is older (the per-rank
    /// watermark check still adjudicates the splice).
    Permitted,
    /// A gap retry: it needs an export newer than the gap, so it waits for its own sweep unless
    /// the in-flight request is already at least that fresh.
    Refused,
}

/// What [`Coordinator::submit`] did with an obligation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Folded into the in-flight sweep.
    Merged,
    /// Waits for the next sweep.
    Queued,
    /// The same (rank, incarnation) is already held; nothing changed.
    Duplicate,
}

/// How a held obligation is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Graft the delivery's snapshot for this rank (its splice is then adjudicated).
    Graft,
    /// Settle the rank with this outcome (`empty`, `uncovered`, `abandoned`, `rejected`).
    Settle(Outcome),
    /// The rank no longer owes anything (left `Pending`, or re-registered): nothing to do.
    NotOwed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    pub obligation: Obligation,
    pub disposition: Disposition,
}

/// A finished sweep's summary, for the pump (the graft) and for metrics and logs.
#[derive(Debug, Clone)]
pub struct Delivery<P> {
    pub verdict: VerdictKind,
    pub peer: Option<P>,
    /// The snapshot reduced to the ranks released with [`Disposition::Graft`].
    pub graft: Option<VettedSnapshot>,
    pub peers_tried: usize,
    pub siblings: usize,
    pub last_reason: Option<String>,
}

/// What one coordinator step produced.
#[derive(Debug, Clone)]
pub struct Tick<P> {
    pub fetch: Vec<FetchOrder<P>>,
    pub wait_until_ms: Option<u64>,
    pub released: Vec<Release>,
    pub delivery: Option<Delivery<P>>,
}

impl<P> Default for Tick<P> {
    fn default() -> Self {
        Tick {
            fetch: Vec::new(),
            wait_until_ms: None,
            released: Vec::new(),
            delivery: None,
        }
    }
}

/// One fleet-wide sweep at a time, and exact accounting of the obligations it holds.
///
/// Every obligation accepted by [`Coordinator::submit`] is held (queued or in the sweep) until
/// it leaves in exactly one [`Release`]; a hand-back (a rank the sweep never spoke for) keeps it
/// held for the next sweep.
#[derive(Debug, Clone)]
pub struct Coordinator<P> {
    sweeps_started: u64,
    queue: BTreeMap<(RankId, Incarnation), Obligation>,
    sweep: Option<Sweep<P>>,
    coverage_requeued: BTreeSet<(RankId, Incarnation)>,
    fetch_timeout_ms: u64,
}

impl<P: Ord + Clone> Coordinator<P> {
    pub fn new(fetch_timeout_ms: u64) -> Self {
        Coordinator {
            sweeps_started: 0,
            queue: BTreeMap::new(),
            sweep: None,
            coverage_requeued: BTreeSet::new(),
            fetch_timeout_ms,
        }
    }

    pub fn in_flight(&self) -> Option<&Sweep<P>> {
        self.sweep.as_ref()
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Obligations held, queued or in flight.
    pub fn held(&self) -> usize {
        self.queue.len() + self.sweep.as_ref().map_or(0, |s| s.obligations.len())
    }

    pub fn is_idle(&self) -> bool {
        self.sweep.is_none() && self.queue.is_empty()
    }

    /// Takes an obligation: folded into the in-flight sweep when allowed (see [`LateJoin`]),
    /// else queued for the next one.
    pub fn submit(&mut self, ob: Obligation, late_join: LateJoin) -> Admission {
        let key = ob.key();
        if self.queue.contains_key(&key)
            || self
                .sweep
                .as_ref()
                .is_some_and(|s| s.obligations.contains_key(&key))
        {
            return Admission::Duplicate;
        }
        if let Some(sweep) = self.sweep.as_mut()
            && (late_join == LateJoin::Permitted || ob.floor_ms <= sweep.floor_ms)
            && sweep.admit(ob)
        {
            return Admission::Merged;
        }
        self.queue.insert(key, ob);
        Admission::Queued
    }

    /// Timer tick. Starts a sweep over everything queued when none is in flight (`deadline_ms`
    /// bounds it), releases what is no longer owed, and advances the sweep.
    pub fn poll(
        &mut self,
        view: &PeerView<'_, P>,
        book: &PeerBook<P>,
        now_ms: u64,
        deadline_ms: u64,
        owed: impl Fn(&Obligation) -> bool,
    ) -> Tick<P> {
        let mut tick = Tick::default();
        if self.sweep.is_none() {
            self.start(deadline_ms, &owed, &mut tick);
        }
        if let Some(sweep) = self.sweep.as_mut() {
            release_not_owed(sweep, &owed, &mut tick);
            let progress = sweep.poll(view, book, now_ms);
            self.absorb(progress, &owed, now_ms, &mut tick);
        }
        tick
    }

    /// One fetch ended; see [`Sweep::on_answer`].
    pub fn on_answer(
        &mut self,
        order: &FetchOrder<P>,
        result: FetchResult,
        view: &PeerView<'_, P>,
        book: &mut PeerBook<P>,
        now_ms: u64,
        owed: impl Fn(&Obligation) -> bool,
    ) -> Tick<P> {
        let mut tick = Tick::default();
        if let Some(sweep) = self.sweep.as_mut() {
            release_not_owed(sweep, &owed, &mut tick);
            let progress = sweep.on_answer(order, result, view, book, now_ms);
            self.absorb(progress, &owed, now_ms, &mut tick);
        }
        tick
    }

    fn start(&mut self, deadline_ms: u64, owed: &impl Fn(&Obligation) -> bool, tick: &mut Tick<P>) {
        let mut kept = Vec::new();
        for ob in std::mem::take(&mut self.queue).into_values() {
            if owed(&ob) {
                kept.push(ob);
            } else {
                tick.released.push(Release {
                    obligation: ob,
                    disposition: Disposition::NotOwed,
                });
            }
        }
        if !kept.is_empty() {
            self.sweeps_started += 1;
            self.sweep = Some(Sweep::new(
                self.sweeps_started,
                kept,
                deadline_ms,
                self.fetch_timeout_ms,
            ));
        }
    }

    fn absorb(
        &mut self,
        progress: Progress<P>,
        owed: &impl Fn(&Obligation) -> bool,
        now_ms: u64,
        tick: &mut Tick<P>,
    ) {
        tick.fetch = progress.fetch;
        tick.wait_until_ms = progress.wait_until_ms;
        for ob in progress.settled_empty {
            tick.released.push(Release {
                obligation: ob,
                disposition: Disposition::Settle(Outcome::Empty),
            });
        }
        for ob in progress.unknown_to_fleet {
            tick.released.push(Release {
                obligation: ob,
                disposition: Disposition::Settle(Outcome::Uncovered),
            });
        }
        let Some(verdict) = progress.verdict else {
            return;
        };
        let Some(sweep) = self.sweep.take() else {
            return;
        };
        let siblings = match &verdict {
            Verdict::FleetCold { siblings } | Verdict::TimedOut { siblings, .. } => *siblings,
            _ => 0,
        };
        let mut delivery = Delivery {
            verdict: verdict.kind(),
            peer: None,
            graft: None,
            peers_tried: sweep.tried.len(),
            siblings,
            last_reason: sweep.last_reason.clone(),
        };
        let held = sweep.into_obligations();
        match verdict {
            Verdict::Found { peer, snapshot } => {
                delivery.peer = Some(peer);
                let mut graft = Vec::new();
                for ob in held {
                    if !owed(&ob) {
                        release(tick, ob, Disposition::NotOwed);
                    } else if snapshot.coverage(ob.rank).is_covered() {
                        graft.push(ob);
                    } else if self.coverage_requeued.insert(ob.key()) {
                        // The snapshot never spoke for this rank (its producer did not know
                        // the worker yet, say): one more sweep of its own.
                        self.queue.insert(ob.key(), ob);
                    } else {
                        release(tick, ob, Disposition::Settle(Outcome::Uncovered));
                    }
                }
                let ranks: Vec<RankId> = graft.iter().map(|o| o.rank).collect();
                match snapshot.into_graft(&ranks) {
                    Ok(g) => {
                        delivery.graft = Some(g);
                        for ob in graft {
                            release(tick, ob, Disposition::Graft);
                        }
                    }
                    Err(_) => {
                        for ob in graft {
                            release(tick, ob, Disposition::Settle(Outcome::Rejected));
                        }
                    }
                }
            }
            Verdict::NoPeers | Verdict::FleetCold { .. } | Verdict::TimedOut { .. } => {
                for ob in held {
                    let d = if owed(&ob) {
                        Disposition::Settle(Outcome::Abandoned)
                    } else {
                        Disposition::NotOwed
                    };
                    release(tick, ob, d);
                }
            }
            Verdict::RanksResolved => {
                for ob in held {
                    if owed(&ob) {
                        self.queue.insert(ob.key(), ob);
                    } else {
                        release(tick, ob, Disposition::NotOwed);
                    }
                }
            }
        }
        tick.delivery = Some(delivery);
        if !self.queue.is_empty() {
            // Deferred gap retries and hand-backs start their own sweep at the next poll.
            tick.wait_until_ms = Some(now_ms);
        }
    }
}

fn release<P>(tick: &mut Tick<P>, obligation: Obligation, disposition: Disposition) {
    tick.released.push(Release {
        obligation,
        disposition,
    });
}

fn release_not_owed<P: Ord + Clone>(
    sweep: &mut Sweep<P>,
    owed: &impl Fn(&Obligation) -> bool,
    tick: &mut Tick<P>,
) {
    for ob in sweep.retain_owed(owed) {
        release(tick, ob, Disposition::NotOwed);
    }
}

/// The per-fetch timeout, and whether it is too short for the body expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchTimeout {
    pub timeout_ms: u64,
    /// Set when `timeout_ms` is below what the expected body needs at
    /// [`FETCH_MIN_TRANSFER_BYTES_PER_S`]: log it at startup, since otherwise every peer just
    /// looks unreachable.
    pub warning: Option<FetchTimeoutWarning>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error(
    "the per-fetch snapshot timeout of {timeout_ms} ms is below the {needed_ms} ms a \
     {expected_body_bytes}-byte body needs at {FETCH_MIN_TRANSFER_BYTES_PER_S} bytes/s; raise \
     --kv-bootstrap-timeout-ms or --kv-bootstrap-fetch-timeout-cap-ms"
)]
pub struct FetchTimeoutWarning {
    pub timeout_ms: u64,
    pub needed_ms: u64,
    pub expected_body_bytes: u64,
}

/// The per-fetch timeout: `bootstrap_timeout_ms / FETCH_TIMEOUT_DEADLINE_DIVISOR`, capped by
/// `cap_ms`, with a warning when it cannot carry `expected_body_bytes`.
pub fn fetch_timeout(
    bootstrap_timeout_ms: u64,
    cap_ms: u64,
    expected_body_bytes: u64,
) -> FetchTimeout {
    let timeout_ms = (bootstrap_timeout_ms / FETCH_TIMEOUT_DEADLINE_DIVISOR).min(cap_ms);
    let needed = (u128::from(expected_body_bytes) * 1000)
        .div_ceil(u128::from(FETCH_MIN_TRANSFER_BYTES_PER_S));
    let needed_ms = u64::try_from(needed).unwrap_or(u64::MAX);
    let warning = (timeout_ms < needed_ms).then_some(FetchTimeoutWarning {
        timeout_ms,
        needed_ms,
        expected_body_bytes,
    });
    FetchTimeout {
        timeout_ms,
        warning,
    }
}

/// Everything the `/readyz` bootstrap rule looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadinessInputs {
    pub now_ms: u64,
    /// When the bootstrap deadline was armed (at the first registration).
    pub armed_at_ms: u64,
    /// `--kv-bootstrap-timeout-ms`.
    pub timeout_ms: u64,
    /// Some rank is `Pending`.
    pub any_pending: bool,
    /// The verdict of the latest finished sweep, if any.
    pub latest_verdict: Option<VerdictKind>,
    /// Peers tried by the latest sweep, when it timed out.
    pub timed_out_peers_tried: usize,
    /// Some sweep delivered a snapshot (`found`) this boot.
    pub seeded: bool,
    /// `--kv-bootstrap-seed-required`.
    pub seed_required: bool,
}

/// Why readiness is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadinessHold {
    /// Some rank is still `Pending` and the deadline has not passed.
    BootstrapPending,
    /// Seed required: the sweep timed out over siblings it tried, and no snapshot came.
    SeedMissing,
}

impl ReadinessHold {
    pub fn label(self) -> &'static str {
        match self {
            ReadinessHold::BootstrapPending => "bootstrap_pending",
            ReadinessHold::SeedMissing => "seed_missing",
        }
    }
}

/// The bootstrap rule of `/readyz`, unlatched: `Some(reason)` while readiness must be held.
///
/// Held while some rank is `Pending` and the deadline has not passed, unless the latest verdict
/// is `no_peers` or `fleet_cold`: an unready pod leaves its own EndpointSlice, so a fleet whose
/// replicas wait on each other would never become ready. Past that, only with `seed_required`
/// and only a timeout over a NON-EMPTY sibling set (peers were tried) holds it, until
/// [`SEED_REQUIRED_HOLD_DEADLINE_FACTOR`] timeouts after arming; with `seed_required`, ranks
/// still pending past the deadline before ANY verdict is in are held too (the verdict decides,
/// and it is one pass away).
pub fn readiness_hold(i: &ReadinessInputs) -> Option<ReadinessHold> {
    let deadline = i.armed_at_ms.saturating_add(i.timeout_ms);
    let never_holds = matches!(
        i.latest_verdict,
        Some(VerdictKind::NoPeers | VerdictKind::FleetCold)
    );
    if i.any_pending && i.now_ms < deadline && !never_holds {
        return Some(ReadinessHold::BootstrapPending);
    }
    let hard_limit = i.armed_at_ms.saturating_add(
        i.timeout_ms
            .saturating_mul(SEED_REQUIRED_HOLD_DEADLINE_FACTOR),
    );
    // Past the deadline the sweep's verdict lands only at its next poll (up to a pass later).
    // Until then seed_required cannot tell a timeout over tried peers from a cold fleet, and a
    // ready answer in between would LATCH and skip the seed hold altogether: wait for it.
    if i.seed_required
        && !i.seeded
        && i.any_pending
        && i.latest_verdict.is_none()
        && i.now_ms < hard_limit
    {
        return Some(ReadinessHold::BootstrapPending);
    }
    if i.seed_required
        && !i.seeded
        && i.latest_verdict == Some(VerdictKind::TimedOut)
        && i.timed_out_peers_tried > 0
        && i.now_ms < hard_limit
    {
        return Some(ReadinessHold::SeedMissing);
    }
    None
}

/// Readiness that latches: once `/readyz` has answered ready, bootstrap never makes it unready
/// again (a later failed sweep for a new worker must not pull a serving replica out of its
/// Service).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadinessLatch {
    served_ready: bool,
}

impl ReadinessLatch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Call when answering `/readyz`: `None` = ready (and latched), else the hold.
    pub fn admit(&mut self, inputs: &ReadinessInputs) -> Option<ReadinessHold> {
        if self.served_ready {
            return None;
        }
        let hold = readiness_hold(inputs);
        if hold.is_none() {
            self.served_ready = true;
        }
        hold
    }

    pub fn latched(&self) -> bool {
        self.served_ready
    }
}
