//! Builders shared by the integration tests: snapshots whose per-rank coverage is chosen by the
//! test, passed through the real encoder and the real `vet`, so the sweep is exercised on the
//! same values the service will hand it.

#![allow(dead_code)]

use kvroute_bootstrap::{
    BodyEncoding, Expectations, ExportStamp, FetchOrder, FetchResult, Incarnation, Obligation,
    PeerView, Sweep, Ticket, VettedSnapshot, vet,
};
use kvroute_index::RankId;
use kvroute_index::hash::HASH_SCHEME;
use kvroute_snapshot::{DecodeLimits, EncodeOptions, encode_binary_to_vec};
use kvroute_wire::snapshot::{
    IndexSnapshot, NO_PARENT, RankCursor, RankRef, SNAPSHOT_FORMAT, SnapshotNodes,
};

pub const BLOCK: u32 = 16;
/// Ranks every test replica serves: local id i is `rank_ref(i)`.
pub const LIVE_RANKS: u32 = 8;

pub fn rank_ref(i: u32) -> RankRef {
    RankRef {
        worker_url: format!("http://10.1.0.{}:8000", i / 2),
        dp_rank: i % 2,
    }
}

pub fn live() -> Vec<(RankRef, RankId)> {
    (0..LIVE_RANKS).map(|i| (rank_ref(i), RankId(i))).collect()
}

/// A ready snapshot over ranks `0..LIVE_RANKS`: each `covered` rank carries a two-block chain
/// and has cursor `(10 + rank, 0.5)`; each `empty` rank is listed in `empty_ranks`.
pub fn snapshot(covered: &[u32], empty: &[u32]) -> IndexSnapshot {
    let all: Vec<u32> = (0..LIVE_RANKS).collect();
    snapshot_listing(&all, covered, empty)
}

/// As [`snapshot`], but the producer's rank table lists only `listed` (it has not registered
/// the other workers); `covered` and `empty` must be among them.
pub fn snapshot_listing(listed: &[u32], covered: &[u32], empty: &[u32]) -> IndexSnapshot {
    let pos = |r: u32| listed.iter().position(|&l| l == r).expect("listed") as u32;
    let mut nodes = SnapshotNodes::default();
    for &r in covered {
        let root = nodes.parent.len() as u32;
        for (i, parent) in [NO_PARENT, root].into_iter().enumerate() {
            let hash = (u64::from(r) << 8) | i as u64;
            nodes.parent.push(parent);
            nodes.content_hash.push(hash);
            nodes.carrier_rank.push(pos(r));
            nodes.carrier_tiers.push(1);
            nodes.carrier_engine_hash.push(!hash);
            nodes.carrier_end.push(nodes.carrier_rank.len() as u32);
        }
    }
    IndexSnapshot {
        format: SNAPSHOT_FORMAT,
        hash_scheme: HASH_SCHEME.to_string(),
        block_size: BLOCK,
        producer_ready: true,
        ranks: listed.iter().map(|&r| rank_ref(r)).collect(),
        cursors: covered
            .iter()
            .map(|&r| RankCursor {
                rank: pos(r),
                seq: 10 + i64::from(r),
                ts: 0.5,
            })
            .collect(),
        empty_ranks: empty.iter().map(|&r| pos(r)).collect(),
        partial_ranks: vec![],
        nodes,
    }
}

pub fn vetted(covered: &[u32], empty: &[u32]) -> VettedSnapshot {
    vet_snapshot(&snapshot(covered, empty))
}

fn vet_snapshot(snapshot: &IndexSnapshot) -> VettedSnapshot {
    let live = live();
    let body = encode_binary_to_vec(snapshot, &EncodeOptions::default()).unwrap();
    vet(
        &body,
        BodyEncoding::binary(),
        &Expectations {
            block_size: BLOCK,
            live: &live,
            mac_key: None,
            limits: DecodeLimits::default(),
        },
    )
    .unwrap()
}

/// A 200 answer whose snapshot covers `covered` and names `empty`, received at `received_ms`.
pub fn body(covered: &[u32], empty: &[u32], received_ms: u64) -> FetchResult {
    FetchResult::Body {
        vetted: Ok(vetted(covered, empty)),
        stamp: ExportStamp {
            received_ms,
            age_ms: Some(0),
        },
    }
}

/// As [`body`], from a producer whose history of the `partial` ranks (among `covered`) does
/// not reach back to their publishers' origin: it lists them in `partial_ranks`.
pub fn body_partial(covered: &[u32], partial: &[u32], received_ms: u64) -> FetchResult {
    let mut s = snapshot(covered, &[]);
    s.partial_ranks = partial.to_vec();
    FetchResult::Body {
        vetted: Ok(vet_snapshot(&s)),
        stamp: ExportStamp {
            received_ms,
            age_ms: Some(0),
        },
    }
}

/// A 200 answer from a producer whose rank table lists only `listed`; see [`snapshot_listing`].
pub fn body_listing(
    listed: &[u32],
    covered: &[u32],
    empty: &[u32],
    received_ms: u64,
) -> FetchResult {
    FetchResult::Body {
        vetted: Ok(vet_snapshot(&snapshot_listing(listed, covered, empty))),
        stamp: ExportStamp {
            received_ms,
            age_ms: Some(0),
        },
    }
}

pub fn rejected(r: kvroute_bootstrap::Rejection, received_ms: u64) -> FetchResult {
    FetchResult::Body {
        vetted: Err(r),
        stamp: ExportStamp {
            received_ms,
            age_ms: None,
        },
    }
}

pub fn ob(rank: u32, inc: u64, floor_ms: u64) -> Obligation {
    Obligation {
        rank: RankId(rank),
        incarnation: Incarnation(inc),
        floor_ms,
    }
}

pub fn view<'a>(peers: &'a [&'static str]) -> PeerView<'a, &'static str> {
    PeerView {
        peers,
        synced: true,
        ever_had_peers: !peers.is_empty(),
    }
}

/// The order a test answers for `peer`: stamped with the sweep's open pass (or with a ticket no
/// pass accepts when none is open).
pub fn order_for(
    sweep: Option<&Sweep<&'static str>>,
    peer: &'static str,
) -> FetchOrder<&'static str> {
    FetchOrder {
        ticket: sweep
            .and_then(|s| s.current_ticket())
            .unwrap_or(Ticket { sweep: 0, pass: 0 }),
        peer,
        max_age_ms: 0,
        timeout_ms: 0,
    }
}
