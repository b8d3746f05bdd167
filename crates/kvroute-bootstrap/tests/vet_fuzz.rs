//! `vet` never panics, whatever the bytes, and whatever it accepts upholds the vetted
//! invariants: random bytes, byte-level mutations of valid encodings in every encoding the fetch
//! can negotiate, and structural mutations of valid snapshots.

mod common;

use common::{BLOCK, LIVE_RANKS, live, rank_ref};
use kvroute_bootstrap::{BodyEncoding, BodyMedia, Coverage, Expectations, Rejection, vet};
use kvroute_index::hash::HASH_SCHEME;
use kvroute_index::snapshot::validate_structure;
use kvroute_snapshot::{
    CompressingWriter, Compression, DecodeLimits, EncodeOptions, encode_binary_to_vec,
    encode_json_to_vec,
};
use kvroute_wire::snapshot::{
    IndexSnapshot, NO_PARENT, RankCursor, RankRef, SNAPSHOT_FORMAT, SnapshotNodes,
};
use proptest::prelude::*;

const KEY: &[u8] = b"bootstrap-fuzz-shared-secret-001";
/// Small decode limits so a mutated count cannot make a case slow.
const LIMITS: DecodeLimits = DecodeLimits {
    max_nodes: 4_096,
    max_carriers: 16_384,
    max_ranks: 256,
    max_bytes: 1 << 20,
};

struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A valid snapshot whose rank table mixes ranks this replica serves with unknown ones, and
/// whose header usually (not always) matches.
fn random_snapshot(seed: u64) -> IndexSnapshot {
    let mut rng = SplitMix(seed);
    let rank_count = 1 + rng.below(6) as u32;
    let ranks: Vec<RankRef> = (0..rank_count)
        .map(|i| {
            if rng.chance(60) {
                rank_ref((i * 3 + rng.below(2) as u32) % LIVE_RANKS)
            } else {
                RankRef {
                    worker_url: format!("http://unknown-{i}:1"),
                    dp_rank: 0,
                }
            }
        })
        .collect();
    // The table must not repeat a rank; repeats are renamed so the snapshot stays valid.
    let mut ranks_dedup: Vec<RankRef> = Vec::new();
    for (i, r) in ranks.into_iter().enumerate() {
        if ranks_dedup.contains(&r) {
            ranks_dedup.push(RankRef {
                worker_url: format!("http://renamed-{i}:1"),
                dp_rank: 1,
            });
        } else {
            ranks_dedup.push(r);
        }
    }
    let mut nodes = SnapshotNodes::default();
    let node_count = rng.below(40) as usize;
    for i in 0..node_count {
        let parent = if i == 0 || rng.chance(25) {
            NO_PARENT
        } else {
            rng.below(i as u64) as u32
        };
        nodes.parent.push(parent);
        nodes.content_hash.push(rng.next());
        for _ in 0..rng.below(3) {
            nodes
                .carrier_rank
                .push(rng.below(u64::from(rank_count)) as u32);
            nodes
                .carrier_tiers
                .push([1u8, 2, 3, 8][rng.below(4) as usize]);
            nodes.carrier_engine_hash.push(rng.next());
        }
        nodes.carrier_end.push(nodes.carrier_rank.len() as u32);
    }
    let mut cursors = Vec::new();
    for rank in 0..rank_count {
        if rng.chance(70) {
            cursors.push(RankCursor {
                rank,
                seq: rng.below(1_000) as i64,
                ts: rng.below(1_000) as f64 / 8.0,
            });
        }
    }
    IndexSnapshot {
        format: if rng.chance(95) {
            SNAPSHOT_FORMAT
        } else {
            SNAPSHOT_FORMAT + 1
        },
        hash_scheme: if rng.chance(95) {
            HASH_SCHEME.to_string()
        } else {
            "other".into()
        },
        block_size: if rng.chance(95) { BLOCK } else { BLOCK * 2 },
        producer_ready: rng.chance(85),
        cursors,
        empty_ranks: (0..rank_count).filter(|_| rng.chance(20)).collect(),
        partial_ranks: vec![],
        ranks: ranks_dedup,
        nodes,
    }
}

/// The seven ways a fetch can receive a snapshot, and whether the MAC key is configured.
fn encode(s: &IndexSnapshot, which: u8) -> Option<(Vec<u8>, BodyEncoding, bool)> {
    let binary = |compression, mac_key| {
        encode_binary_to_vec(
            s,
            &EncodeOptions {
                compression,
                mac_key,
            },
        )
        .ok()
    };
    let json = |c: Compression| {
        let plain = encode_json_to_vec(s).ok()?;
        let mut w = CompressingWriter::new(Vec::new(), c).ok()?;
        std::io::Write::write_all(&mut w, &plain).ok()?;
        w.finish().ok()
    };
    Some(match which % 7 {
        0 => (
            binary(Compression::None, None)?,
            BodyEncoding::binary(),
            false,
        ),
        1 => (
            binary(Compression::Zstd, None)?,
            BodyEncoding::binary(),
            false,
        ),
        2 => (
            binary(Compression::Gzip, None)?,
            BodyEncoding::binary(),
            false,
        ),
        3 => (
            binary(Compression::Zstd, Some(KEY))?,
            BodyEncoding::binary(),
            true,
        ),
        4 => (
            json(Compression::None)?,
            BodyEncoding::json(Compression::None),
            false,
        ),
        5 => (
            json(Compression::Gzip)?,
            BodyEncoding::json(Compression::Gzip),
            false,
        ),
        _ => (
            json(Compression::Zstd)?,
            BodyEncoding::json(Compression::Zstd),
            false,
        ),
    })
}

fn vet_with(body: &[u8], encoding: BodyEncoding, keyed: bool) -> Result<(), Rejection> {
    let live = live();
    let expect = Expectations {
        block_size: BLOCK,
        live: &live,
        mac_key: keyed.then_some(KEY),
        limits: LIMITS,
    };
    let v = vet(body, encoding, &expect)?;
    // Whatever is accepted upholds the vetted invariants.
    let s = v.snapshot();
    assert_eq!(validate_structure(s), Ok(()));
    assert_eq!(v.local_ids().len(), s.ranks.len());
    for (r, id) in s.ranks.iter().zip(v.local_ids()) {
        assert!(
            live.contains(&(r.clone(), *id)),
            "{r:?} as {id:?} is not live"
        );
    }
    let mut has_child = vec![false; s.nodes.len()];
    for &p in &s.nodes.parent {
        if p != NO_PARENT {
            has_child[p as usize] = true;
        }
    }
    let mut start = 0;
    for (i, (&end, &parent_of_others)) in s.nodes.carrier_end.iter().zip(&has_child).enumerate() {
        assert!(
            parent_of_others || end > start,
            "node {i} kept with no carrier and no descendant"
        );
        start = end;
    }
    for (pos, (id, c)) in v.ranks().enumerate() {
        if let Coverage::Covered { cursor, .. } = c {
            assert!(s.nodes.carrier_rank.contains(&(pos as u32)), "{id:?}");
            assert!(
                s.cursors
                    .iter()
                    .any(|k| k.rank == pos as u32 && (k.seq, k.ts) == cursor)
            );
        }
    }
    assert!(v.ranks().any(|(_, c)| c != Coverage::Unknown));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn vet_never_panics_on_random_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        json in any::<bool>(),
        content_encoding in 0u8..3,
        keyed in any::<bool>(),
    ) {
        let encoding = BodyEncoding {
            media: if json { BodyMedia::Json } else { BodyMedia::Binary },
            content_encoding: Compression::ALL[content_encoding as usize],
        };
        let _ = vet_with(&bytes, encoding, keyed);
    }

    #[test]
    fn vet_never_panics_on_mutated_valid_encodings(
        seed in any::<u64>(),
        which in 0u8..7,
        mutations in proptest::collection::vec((0u8..4, any::<usize>(), any::<u8>()), 1..6),
    ) {
        let snapshot = random_snapshot(seed);
        let Some((mut body, encoding, keyed)) = encode(&snapshot, which) else {
            return Ok(());
        };
        for (kind, at, byte) in mutations {
            if body.is_empty() {
                break;
            }
            let at = at % body.len();
            match kind {
                0 => body[at] ^= byte | 1,
                1 => body.truncate(at),
                2 => body.insert(at, byte),
                _ => {
                    body.remove(at);
                }
            }
        }
        let _ = vet_with(&body, encoding, keyed);
    }

    #[test]
    fn valid_encodings_vet_or_are_refused_for_what_they_say(seed in any::<u64>(), which in 0u8..7) {
        let snapshot = random_snapshot(seed);
        let Some((body, encoding, keyed)) = encode(&snapshot, which) else {
            return Ok(());
        };
        match vet_with(&body, encoding, keyed) {
            Ok(()) => {}
            Err(r) => prop_assert!(
                matches!(
                    r,
                    Rejection::Format { .. }
                        | Rejection::HashScheme { .. }
                        | Rejection::BlockSize { .. }
                        | Rejection::NotReady
                        | Rejection::Cold
                        | Rejection::CoversNothing
                ),
                "a valid body refused as {r:?}"
            ),
        }
    }

    #[test]
    fn structurally_broken_snapshots_are_refused_without_panicking(
        seed in any::<u64>(),
        field in 0u8..6,
        value in any::<u32>(),
    ) {
        let mut s = random_snapshot(seed);
        s.producer_ready = true;
        match field {
            0 => if let Some(c) = s.cursors.first_mut() { c.rank = value },
            1 => if let Some(c) = s.cursors.first_mut() { c.seq = -i64::from(value) - 1 },
            2 => s.empty_ranks.push(value),
            3 => if let Some(t) = s.nodes.carrier_tiers.first_mut() { *t = (value & 0xf0) as u8 },
            4 => if let Some(r) = s.nodes.carrier_rank.first_mut() { *r = value },
            _ => if let Some(first) = s.ranks.first().cloned() { s.ranks.push(first) },
        }
        for which in 0..7 {
            if let Some((body, encoding, keyed)) = encode(&s, which) {
                let _ = vet_with(&body, encoding, keyed);
            }
        }
    }
}
