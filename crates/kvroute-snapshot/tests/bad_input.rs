//! Hostile and damaged bodies: decoding returns a typed error naming what is wrong, never
//! panics, and never lets a claimed size drive allocation past the caller's limits.

mod common;

use common::{OTHER_KEY, TEST_KEY, gzip_envelope, random_snapshot, random_snapshot_with_nodes};
use kvroute_snapshot::limits::MAC_KEY_MIN_BYTES;
use kvroute_snapshot::{
    BINARY_MAGIC, BINARY_VERSION, Compression, DecodeLimits, EncodeOptions, SnapshotDecodeError,
    SnapshotEncodeError, decode_binary, decode_json, decompress_bounded, encode_binary_to_vec,
    encode_json_to_vec, read_bounded,
};
use kvroute_wire::snapshot::NO_PARENT;
use proptest::prelude::*;

fn small_limits() -> DecodeLimits {
    DecodeLimits {
        max_nodes: 10_000,
        max_carriers: 100_000,
        max_ranks: 64,
        max_bytes: 1 << 20,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn random_bytes_never_panic_either_decoder(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_binary(&bytes, &small_limits(), None);
        let _ = decode_binary(&bytes, &small_limits(), Some(TEST_KEY));
        let _ = decode_json(&bytes, &small_limits());
    }

    #[test]
    fn random_payload_behind_a_valid_header_never_panics(
        flags in 0u8..8,
        payload in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = BINARY_MAGIC.to_vec();
        bytes.extend_from_slice(&[BINARY_VERSION, flags]);
        bytes.extend_from_slice(&payload);
        let _ = decode_binary(&bytes, &small_limits(), None);
    }

    #[test]
    fn any_changed_byte_of_an_uncompressed_body_is_refused(
        seed in any::<u64>(),
        position in any::<prop::sample::Index>(),
        xor in 1u8..=255,
    ) {
        let snapshot = random_snapshot(seed, 40, 4);
        let mut bytes = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
        let at = position.index(bytes.len());
        bytes[at] ^= xor;
        prop_assert!(
            decode_binary(&bytes, &DecodeLimits::default(), None).is_err(),
            "flipping byte {} of {} went unnoticed", at, bytes.len()
        );
    }

    #[test]
    fn any_mutation_of_an_authenticated_body_is_refused(
        seed in any::<u64>(),
        compression in prop::sample::select(Compression::ALL.to_vec()),
        position in any::<prop::sample::Index>(),
        xor in 1u8..=255,
        truncate in any::<bool>(),
    ) {
        let snapshot = random_snapshot(seed, 40, 4);
        let options = EncodeOptions { compression, mac_key: Some(TEST_KEY) };
        let mut bytes = encode_binary_to_vec(&snapshot, &options).unwrap();
        let at = position.index(bytes.len());
        if truncate {
            bytes.truncate(at);
        } else {
            bytes[at] ^= xor;
        }
        prop_assert!(decode_binary(&bytes, &DecodeLimits::default(), Some(TEST_KEY)).is_err());
    }

    #[test]
    fn mutated_compressed_bodies_never_panic(
        seed in any::<u64>(),
        compression in prop::sample::select(Compression::ALL.to_vec()),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let snapshot = random_snapshot(seed, 40, 4);
        let options = EncodeOptions { compression, mac_key: None };
        let mut bytes = encode_binary_to_vec(&snapshot, &options).unwrap();
        for (position, value) in edits {
            let at = position.index(bytes.len());
            bytes[at] = value;
        }
        let _ = decode_binary(&bytes, &small_limits(), None);
    }

    #[test]
    fn mutated_json_never_panics(
        seed in any::<u64>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let snapshot = random_snapshot(seed, 20, 3);
        let mut bytes = encode_json_to_vec(&snapshot).unwrap();
        for (position, value) in edits {
            let at = position.index(bytes.len());
            bytes[at] = value;
        }
        let _ = decode_json(&bytes, &small_limits());
    }
}

#[test]
fn header_faults_are_named() {
    let snapshot = random_snapshot(1, 10, 2);
    let good = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    let limits = DecodeLimits::default();

    let mut bad = good.clone();
    bad[0] = b'X';
    assert_eq!(
        decode_binary(&bad, &limits, None),
        Err(SnapshotDecodeError::BadMagic)
    );

    let mut bad = good.clone();
    bad[4] = 9;
    assert_eq!(
        decode_binary(&bad, &limits, None),
        Err(SnapshotDecodeError::UnsupportedVersion { version: 9 })
    );

    let mut bad = good.clone();
    bad[5] |= 0x40;
    assert_eq!(
        decode_binary(&bad, &limits, None),
        Err(SnapshotDecodeError::UnknownFlags { bits: 0x40 })
    );

    let mut bad = good.clone();
    bad[5] |= 0x03;
    assert_eq!(
        decode_binary(&bad, &limits, None),
        Err(SnapshotDecodeError::UnknownCompression { code: 3 })
    );

    assert_eq!(
        decode_binary(&good[..3], &limits, None),
        Err(SnapshotDecodeError::Truncated { field: "header" })
    );
}

#[test]
fn truncated_body_fails_its_checksum() {
    let snapshot = random_snapshot_with_nodes(2, 50, 3);
    let good = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    let err = decode_binary(&good[..good.len() - 5], &DecodeLimits::default(), None).unwrap_err();
    assert!(
        matches!(err, SnapshotDecodeError::ChecksumMismatch { .. }),
        "expected a checksum mismatch, got {err:?}"
    );
}

#[test]
fn short_mac_keys_are_refused_on_both_sides() {
    let snapshot = random_snapshot(3, 5, 1);
    let short = &TEST_KEY[..MAC_KEY_MIN_BYTES - 1];
    let options = EncodeOptions {
        compression: Compression::None,
        mac_key: Some(short),
    };
    let err = encode_binary_to_vec(&snapshot, &options).unwrap_err();
    assert!(
        matches!(err, SnapshotEncodeError::MacKeyTooShort { len_bytes, .. } if len_bytes == short.len()),
        "got {err:?}"
    );
    let options = EncodeOptions {
        compression: Compression::None,
        mac_key: Some(OTHER_KEY),
    };
    let bytes = encode_binary_to_vec(&snapshot, &options).unwrap();
    assert_eq!(
        decode_binary(&bytes, &DecodeLimits::default(), Some(short)),
        Err(SnapshotDecodeError::MacKeyTooShort {
            len_bytes: short.len(),
            min_bytes: MAC_KEY_MIN_BYTES
        })
    );
}

#[test]
fn counts_over_the_callers_limits_are_refused_before_allocation() {
    let snapshot = random_snapshot_with_nodes(4, 200, 5);
    let bytes = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    let limits = DecodeLimits {
        max_nodes: 100,
        ..DecodeLimits::default()
    };
    assert_eq!(
        decode_binary(&bytes, &limits, None),
        Err(SnapshotDecodeError::CountOverLimit {
            field: "nodes",
            count: 200,
            limit: 100
        })
    );
    let limits = DecodeLimits {
        max_ranks: 4,
        ..DecodeLimits::default()
    };
    assert_eq!(
        decode_binary(&bytes, &limits, None),
        Err(SnapshotDecodeError::CountOverLimit {
            field: "ranks",
            count: 5,
            limit: 4
        })
    );
    let limits = DecodeLimits {
        max_bytes: bytes.len() - 1,
        ..DecodeLimits::default()
    };
    assert_eq!(
        decode_binary(&bytes, &limits, None),
        Err(SnapshotDecodeError::InputTooLarge {
            len_bytes: bytes.len(),
            limit_bytes: bytes.len() - 1
        })
    );
    let json = encode_json_to_vec(&snapshot).unwrap();
    let limits = DecodeLimits {
        max_nodes: 100,
        ..DecodeLimits::default()
    };
    assert_eq!(
        decode_json(&json, &limits),
        Err(SnapshotDecodeError::CountOverLimit {
            field: "nodes",
            count: 200,
            limit: 100
        })
    );
}

#[test]
fn carrier_rank_outside_the_rank_table_is_refused_by_both_decoders() {
    let mut snapshot = random_snapshot_with_nodes(5, 30, 3);
    let Some(first) = snapshot.nodes.carrier_rank.first_mut() else {
        panic!("seed 5 produced no carriers; pick another seed");
    };
    *first = 7;
    let bytes = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    assert_eq!(
        decode_binary(&bytes, &DecodeLimits::default(), None),
        Err(SnapshotDecodeError::RankOutOfRange {
            field: "carrier rank",
            rank: 7,
            ranks: 3
        })
    );
    let json = encode_json_to_vec(&snapshot).unwrap();
    assert_eq!(
        decode_json(&json, &DecodeLimits::default()),
        Err(SnapshotDecodeError::RankOutOfRange {
            field: "carrier rank",
            rank: 7,
            ranks: 3
        })
    );
}

#[test]
fn encoder_refuses_snapshots_that_break_the_model_invariants() {
    let good = random_snapshot_with_nodes(6, 20, 3);

    let mut bad = good.clone();
    bad.nodes.content_hash.pop();
    assert!(matches!(
        encode_binary_to_vec(&bad, &EncodeOptions::default()),
        Err(SnapshotEncodeError::ColumnLength {
            column: "content_hash",
            ..
        })
    ));

    let mut bad = good.clone();
    bad.nodes.parent[3] = 3;
    assert!(matches!(
        encode_binary_to_vec(&bad, &EncodeOptions::default()),
        Err(SnapshotEncodeError::ParentNotBefore { node: 3, parent: 3 })
    ));

    let mut bad = good.clone();
    bad.nodes.parent[0] = NO_PARENT;
    bad.nodes.carrier_end[0] = u32::MAX;
    let err = encode_json_to_vec(&bad).unwrap_err();
    assert!(
        matches!(
            err,
            SnapshotEncodeError::CarrierEndDecreasing { .. }
                | SnapshotEncodeError::ColumnLength { .. }
        ),
        "got {err:?}"
    );

    let mut bad = good;
    if bad.cursors.is_empty() {
        bad.cursors.push(kvroute_wire::snapshot::RankCursor {
            rank: 0,
            seq: 1,
            ts: 0.0,
        });
    }
    bad.cursors[0].ts = f64::NAN;
    assert!(matches!(
        encode_json_to_vec(&bad),
        Err(SnapshotEncodeError::NonFiniteTs { .. })
    ));
}

#[test]
fn json_hash_strings_must_be_sixteen_hex_digits() {
    let snapshot = random_snapshot_with_nodes(9, 3, 1);
    let json = String::from_utf8(encode_json_to_vec(&snapshot).unwrap()).unwrap();
    let hash = format!("\"{:016x}\"", snapshot.nodes.content_hash[0]);
    let short = json.replacen(&hash, "\"abc\"", 1);
    let err = decode_json(short.as_bytes(), &DecodeLimits::default()).unwrap_err();
    assert!(
        matches!(&err, SnapshotDecodeError::Json { reason } if reason.contains("16 hex digits")),
        "got {err:?}"
    );
}

/// zstd decodes concatenated frames as one stream. One frame of 1 MiB of zeros, repeated 100,000
/// times, claims ~100 GiB: if the limit were checked after inflating, this test would exhaust
/// memory or time instead of returning `TooLarge`.
#[test]
fn zstd_bomb_stops_at_the_limit_while_inflating() {
    let frame = zstd::bulk::compress(&vec![0u8; 1 << 20], 1).unwrap();
    let bomb = frame.repeat(100_000);
    let limit = 4 << 20;
    assert_eq!(
        decompress_bounded(&bomb, Compression::Zstd, limit).unwrap_err(),
        SnapshotDecodeError::TooLarge { limit_bytes: limit }
    );
}

#[test]
fn gzip_bomb_inside_an_envelope_is_refused_as_too_large() {
    let bytes = gzip_envelope(&[&vec![0u8; 8 << 20]]);
    let limits = DecodeLimits {
        max_bytes: 1 << 20,
        ..DecodeLimits::default()
    };
    assert_eq!(
        decode_binary(&bytes, &limits, None),
        Err(SnapshotDecodeError::TooLarge {
            limit_bytes: 1 << 20
        })
    );
}

/// An endless stream can only be refused if the limit is enforced while reading.
#[test]
fn bounded_read_of_an_endless_stream_returns_too_large() {
    assert_eq!(
        read_bounded(std::io::repeat(7), 1 << 16).unwrap_err(),
        SnapshotDecodeError::TooLarge {
            limit_bytes: 1 << 16
        }
    );
}
