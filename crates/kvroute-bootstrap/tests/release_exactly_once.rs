//! The coordinator's central promise, as a property: over any interleaving of registrations,
//! gap retries, removals, timer ticks, peer answers and sibling-set changes, every obligation it
//! accepts is released exactly once (never twice, never while not held), nothing is left held
//! once every rank stops being owed, and this replica never fetches from itself.

mod common;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use common::{body, ob, order_for, rejected};
use kvroute_bootstrap::{
    Admission, Coordinator, FetchResult, LateJoin, Obligation, PeerBook, PeerView, Rejection, Tick,
};
use proptest::prelude::*;

type Peer = &'static str;

const PEERS: [Peer; 3] = ["self", "p1", "p2"];
const DEADLINE_MS: u64 = 4_000;
const RANKS: u32 = 4;

#[derive(Debug, Clone)]
enum Op {
    Submit {
        rank: u32,
        inc: u64,
        floor_ms: u64,
        gap_retry: bool,
    },
    Forget {
        rank: u32,
        inc: u64,
    },
    Tick {
        advance_ms: u64,
    },
    Answer {
        peer: usize,
        stale: bool,
        kind: u8,
        covered: u8,
        empty: u8,
    },
    Peers {
        mask: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..RANKS, 1u64..3, 0u64..3_000, any::<bool>()).prop_map(
            |(rank, inc, floor_ms, gap_retry)| Op::Submit {
                rank,
                inc,
                floor_ms,
                gap_retry
            }
        ),
        1 => (0..RANKS, 1u64..3).prop_map(|(rank, inc)| Op::Forget { rank, inc }),
        3 => (0u64..700).prop_map(|advance_ms| Op::Tick { advance_ms }),
        6 => (0usize..3, any::<bool>(), 0u8..6, any::<u8>(), any::<u8>()).prop_map(
            |(peer, stale, kind, covered, empty)| Op::Answer {
                peer,
                stale,
                kind,
                covered,
                empty,
            }
        ),
        1 => (0u8..8).prop_map(|mask| Op::Peers { mask }),
    ]
}

fn ranks_of(mask: u8) -> Vec<u32> {
    (0..RANKS).filter(|r| mask & (1 << r) != 0).collect()
}

fn result(kind: u8, covered: u8, empty: u8, now_ms: u64) -> FetchResult {
    match kind {
        0 if covered & 0xf != 0 || empty & 0xf != 0 => {
            body(&ranks_of(covered), &ranks_of(empty), now_ms)
        }
        0 | 1 => FetchResult::Unreachable {
            reason: "reset".into(),
        },
        2 => FetchResult::NoSnapshot,
        3 => FetchResult::Busy,
        4 => rejected(
            Rejection::BlockSize {
                found: 1,
                expected: 16,
            },
            now_ms,
        ),
        _ => rejected(Rejection::NotReady, now_ms),
    }
}

struct Model {
    held: BTreeMap<(u32, u64), usize>,
    accepted: usize,
    released: usize,
}

impl Model {
    fn account(&mut self, t: &Tick<Peer>) {
        for r in &t.released {
            let key = (r.obligation.rank.0, r.obligation.incarnation.0);
            assert!(
                self.held.remove(&key).is_some(),
                "released while not held: {:?}",
                r
            );
            self.released += 1;
        }
        assert!(
            t.fetch.iter().all(|o| o.peer != "self"),
            "fetched from itself"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_accepted_obligation_is_released_exactly_once(ops in proptest::collection::vec(op(), 1..80)) {
        let mut c = Coordinator::<Peer>::new(1_000);
        let mut book = PeerBook::new(Some("self"));
        let forgotten: RefCell<BTreeSet<(u32, u64)>> = RefCell::new(BTreeSet::new());
        let owed = |o: &Obligation| !forgotten.borrow().contains(&(o.rank.0, o.incarnation.0));
        let mut model = Model { held: BTreeMap::new(), accepted: 0, released: 0 };
        let mut now = 1_000u64;
        let mut mask = 0b111u8;
        for op in ops {
            let peers: Vec<Peer> = PEERS
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, p)| *p)
                .collect();
            let view = PeerView { peers: &peers, synced: true, ever_had_peers: true };
            match op {
                Op::Submit { rank, inc, floor_ms, gap_retry } => {
                    forgotten.borrow_mut().remove(&(rank, inc));
                    let late = if gap_retry { LateJoin::Refused } else { LateJoin::Permitted };
                    let key = (rank, inc);
                    match c.submit(ob(rank, inc, floor_ms.min(now)), late) {
                        Admission::Duplicate => prop_assert!(model.held.contains_key(&key)),
                        Admission::Merged | Admission::Queued => {
                            prop_assert!(!model.held.contains_key(&key), "accepted twice");
                            model.held.insert(key, 1);
                            model.accepted += 1;
                        }
                    }
                }
                Op::Forget { rank, inc } => {
                    forgotten.borrow_mut().insert((rank, inc));
                }
                Op::Tick { advance_ms } => {
                    now += advance_ms;
                    let t = c.poll(&view, &book, now, DEADLINE_MS, owed);
                    model.account(&t);
                }
                Op::Answer { peer, stale, kind, covered, empty } => {
                    let r = result(kind, covered, empty, now);
                    let mut order = order_for(c.in_flight(), PEERS[peer]);
                    if stale {
                        order.ticket.pass = order.ticket.pass.wrapping_sub(1);
                    }
                    let t = c.on_answer(&order, r, &view, &mut book, now, owed);
                    model.account(&t);
                }
                Op::Peers { mask: m } => mask = m,
            }
            prop_assert_eq!(model.held.len(), c.held(), "the coordinator's count agrees");
        }
        // Every rank stops being owed: whatever is held must come out, once.
        for rank in 0..RANKS {
            for inc in 1..3 {
                forgotten.borrow_mut().insert((rank, inc));
            }
        }
        let view = PeerView { peers: &PEERS, synced: true, ever_had_peers: true };
        for _ in 0..4 {
            now += 1;
            let t = c.poll(&view, &book, now, DEADLINE_MS, owed);
            model.account(&t);
        }
        prop_assert!(c.is_idle());
        prop_assert!(model.held.is_empty(), "left held: {:?}", model.held);
        prop_assert_eq!(model.accepted, model.released);
    }
}
