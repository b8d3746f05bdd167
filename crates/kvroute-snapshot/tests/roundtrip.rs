//! Encode -> decode must give back exactly the snapshot that went in, in both encodings, with
//! every compression, with and without a MAC; and a MAC under another key must be refused.

mod common;

use common::{
    OTHER_KEY, TEST_KEY, compression_strategy, random_snapshot, random_snapshot_with_nodes,
};
use kvroute_snapshot::{
    BINARY_VERSION, BINARY_VERSION_PARTIAL, Compression, DecodeLimits, EncodeOptions,
    SnapshotDecodeError, decode_binary, decode_json, decompress_bounded, encode_binary,
    encode_binary_to_vec, encode_json_to_vec,
};
use kvroute_wire::snapshot::IndexSnapshot;
use proptest::prelude::*;
use std::io::Write;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn binary_round_trips_random_valid_snapshots_exactly(
        seed in any::<u64>(),
        rank_count in 1usize..7,
        compression in compression_strategy(),
        with_mac in any::<bool>(),
    ) {
        let snapshot = random_snapshot(seed, 60, rank_count);
        let key = with_mac.then_some(TEST_KEY);
        let options = EncodeOptions { compression, mac_key: key };
        let bytes = encode_binary_to_vec(&snapshot, &options).unwrap();
        let decoded = decode_binary(&bytes, &DecodeLimits::default(), key).unwrap();
        prop_assert_eq!(cursor_ts_bits(&decoded), cursor_ts_bits(&snapshot));
        prop_assert_eq!(decoded, snapshot);
    }

    #[test]
    fn binary_mac_under_another_key_is_refused(
        seed in any::<u64>(),
        compression in compression_strategy(),
    ) {
        let snapshot = random_snapshot(seed, 30, 3);
        let options = EncodeOptions { compression, mac_key: Some(TEST_KEY) };
        let bytes = encode_binary_to_vec(&snapshot, &options).unwrap();
        let err = decode_binary(&bytes, &DecodeLimits::default(), Some(OTHER_KEY)).unwrap_err();
        prop_assert_eq!(err, SnapshotDecodeError::MacMismatch);
    }

    #[test]
    fn json_round_trips_random_valid_snapshots_exactly(
        seed in any::<u64>(),
        rank_count in 1usize..7,
        compression in compression_strategy(),
    ) {
        let snapshot = random_snapshot(seed, 60, rank_count);
        let json = encode_json_to_vec(&snapshot).unwrap();
        let mut writer = kvroute_snapshot::CompressingWriter::new(Vec::new(), compression).unwrap();
        writer.write_all(&json).unwrap();
        let wire = writer.finish().unwrap();
        let inflated = decompress_bounded(&wire, compression, 1 << 24).unwrap();
        let decoded = decode_json(&inflated, &DecodeLimits::default()).unwrap();
        prop_assert_eq!(cursor_ts_bits(&decoded), cursor_ts_bits(&snapshot));
        prop_assert_eq!(decoded, snapshot);
    }
}

fn cursor_ts_bits(snapshot: &IndexSnapshot) -> Vec<u64> {
    snapshot.cursors.iter().map(|c| c.ts.to_bits()).collect()
}

/// A fleet with no partial rank writes exactly the version-1 bytes a consumer that predates
/// `partial_ranks` reads; naming a partial rank switches to version 2, and both decode back.
#[test]
fn a_snapshot_names_its_partial_ranks_in_version_2_and_is_version_1_without_any() {
    let mut snapshot = random_snapshot(21, 30, 3);
    snapshot.partial_ranks.clear();
    let complete = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    assert_eq!(complete[4], BINARY_VERSION);
    let decoded = decode_binary(&complete, &DecodeLimits::default(), None).unwrap();
    assert!(decoded.partial_ranks.is_empty());
    let json: serde_json::Value =
        serde_json::from_slice(&encode_json_to_vec(&snapshot).unwrap()).unwrap();
    assert!(
        json.get("partial_ranks").is_none(),
        "an empty list is omitted from the JSON: {json}"
    );

    snapshot.partial_ranks = vec![2, 0];
    let partial = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    assert_eq!(partial[4], BINARY_VERSION_PARTIAL);
    let decoded = decode_binary(&partial, &DecodeLimits::default(), None).unwrap();
    assert_eq!(decoded.partial_ranks, vec![2, 0]);
    let json = decode_json(
        &encode_json_to_vec(&snapshot).unwrap(),
        &DecodeLimits::default(),
    );
    assert_eq!(json.unwrap().partial_ranks, vec![2, 0]);
}

#[test]
fn a_partial_rank_index_past_the_rank_table_is_refused_by_both_decoders() {
    let mut snapshot = random_snapshot(22, 10, 2);
    snapshot.partial_ranks = vec![5];
    let binary = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    let err = decode_binary(&binary, &DecodeLimits::default(), None).unwrap_err();
    assert!(
        matches!(err, SnapshotDecodeError::RankOutOfRange { .. }),
        "binary: {err:?}"
    );
    let json = encode_json_to_vec(&snapshot).unwrap();
    let err = decode_json(&json, &DecodeLimits::default()).unwrap_err();
    assert!(
        matches!(err, SnapshotDecodeError::RankOutOfRange { .. }),
        "json: {err:?}"
    );
}

#[test]
fn unauthenticated_body_is_refused_when_a_key_is_configured() {
    let snapshot = random_snapshot(7, 20, 2);
    let bytes = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    let err = decode_binary(&bytes, &DecodeLimits::default(), Some(TEST_KEY)).unwrap_err();
    assert_eq!(err, SnapshotDecodeError::MacMissing);
}

#[test]
fn authenticated_body_decodes_without_a_key_by_skipping_the_tag() {
    let snapshot = random_snapshot(8, 20, 2);
    let options = EncodeOptions {
        compression: Compression::Zstd,
        mac_key: Some(TEST_KEY),
    };
    let bytes = encode_binary_to_vec(&snapshot, &options).unwrap();
    assert_eq!(
        decode_binary(&bytes, &DecodeLimits::default(), None).unwrap(),
        snapshot
    );
}

#[test]
fn json_hashes_are_sixteen_hex_digit_strings() {
    let snapshot = random_snapshot(11, 10, 2);
    assert!(
        snapshot.nodes.carried_blocks() > 0,
        "generator gave no carriers for seed 11"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&encode_json_to_vec(&snapshot).unwrap()).unwrap();
    let node = &json["nodes"][0];
    let expected = format!("{:016x}", snapshot.nodes.content_hash[0]);
    assert_eq!(node["hash"].as_str(), Some(expected.as_str()));
    let first_carried = json["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|n| n["carriers"].as_array().and_then(|c| c.first().cloned()))
        .unwrap();
    let engine = first_carried["engine_hash"].as_str().unwrap();
    assert_eq!(engine.len(), 16);
    assert_eq!(
        engine,
        format!("{:016x}", snapshot.nodes.carrier_engine_hash[0])
    );
}

/// A writer that records how the encoder fed it, to prove the body is streamed in chunks rather
/// than built whole and written once.
struct RecordingWriter {
    writes: Vec<usize>,
}

impl Write for RecordingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.writes.push(buf.len());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn binary_encoder_streams_the_body_in_bounded_chunks() {
    let snapshot = random_snapshot_with_nodes(3, 40_000, 8);
    let mut sink = RecordingWriter { writes: Vec::new() };
    let stats = encode_binary(&snapshot, &EncodeOptions::default(), &mut sink).unwrap();
    let largest = sink.writes.iter().copied().max().unwrap();
    assert!(
        stats.body_bytes > 4 * kvroute_snapshot::binary::BODY_CHUNK_BYTES as u64,
        "snapshot too small to show streaming: {} body bytes",
        stats.body_bytes
    );
    assert!(
        largest <= kvroute_snapshot::binary::BODY_CHUNK_BYTES + 64,
        "one write of {largest} bytes: the body was not streamed in chunks"
    );
    assert_eq!(sink.writes.iter().sum::<usize>() as u64, stats.wire_bytes);
}
