//! The wire layout is a contract between replicas of different builds: these bytes were written
//! by hand from the layout in `binary.rs`'s module doc and the shape in `json.rs`'s, so a change
//! to either encoding that forgets to bump its version fails here.

use kvroute_snapshot::{
    DecodeLimits, EncodeOptions, decode_binary, decode_json, encode_binary_to_vec,
    encode_json_to_vec,
};
use kvroute_wire::snapshot::{IndexSnapshot, NO_PARENT, RankCursor, RankRef, SnapshotNodes};
use xxhash_rust::xxh3::xxh3_64;

fn tiny() -> IndexSnapshot {
    IndexSnapshot {
        format: 1,
        hash_scheme: "s".into(),
        block_size: 16,
        producer_ready: true,
        ranks: vec![RankRef {
            worker_url: "http://a".into(),
            dp_rank: 0,
        }],
        cursors: vec![RankCursor {
            rank: 0,
            seq: -1,
            ts: 1.5,
        }],
        empty_ranks: vec![],
        partial_ranks: vec![],
        nodes: SnapshotNodes {
            parent: vec![NO_PARENT, 0],
            content_hash: vec![0x0102_0304_0506_0708, 0x1112_1314_1516_1718],
            carrier_end: vec![1, 2],
            carrier_rank: vec![0, 0],
            carrier_tiers: vec![1, 1],
            carrier_engine_hash: vec![0xaaaa_aaaa_aaaa_aaaa, 0xbbbb_bbbb_bbbb_bbbb],
        },
    }
}

#[test]
fn binary_layout_matches_the_documented_bytes() {
    let mut body: Vec<u8> = vec![
        0x01, // format
        0x01, b's', // hash_scheme
        0x10, // block_size 16
        0x01, // producer_ready
        0x01, 0x08, b'h', b't', b't', b'p', b':', b'/', b'/', b'a', 0x00, // one rank, dp 0
        0x01, 0x00, 0x01, // one cursor: rank 0, seq zigzag(-1) = 1
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x3f, // ts 1.5
        0x00, // no empty ranks
        0x02, 0x02, // 2 nodes, 2 carriers
        0x00, 0x01, // parents: root, then 1 back
        0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // content hash 0
        0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, // content hash 1
        0x05, // node 0: 1 carrier, shared engine hash
        0x03, // node 1: parent's rank list, shared engine hash
        0x00, // node 0's rank list: rank 0
        0x01, 0x02, // tiers: device x 2
    ];
    body.extend_from_slice(&[0xaa; 8]);
    body.extend_from_slice(&[0xbb; 8]);
    let checksum = xxh3_64(&body);
    body.extend_from_slice(&checksum.to_le_bytes());
    let mut expected = b"KVSN\x01\x00".to_vec();
    expected.extend_from_slice(&body);

    let encoded = encode_binary_to_vec(&tiny(), &EncodeOptions::default()).unwrap();
    assert_eq!(encoded, expected);
    assert_eq!(
        decode_binary(&expected, &DecodeLimits::default(), None).unwrap(),
        tiny()
    );
}

#[test]
fn json_shape_matches_the_documented_text() {
    let expected = concat!(
        r#"{"json_version":1,"format":1,"hash_scheme":"s","block_size":16,"producer_ready":true,"#,
        r#""ranks":[{"worker_url":"http://a","dp_rank":0}],"#,
        r#""cursors":[{"rank":0,"seq":-1,"ts":1.5}],"empty_ranks":[],"#,
        r#""node_count":2,"carried_blocks":2,"nodes":["#,
        r#"{"parent":null,"hash":"0102030405060708","carriers":[{"rank":0,"tiers":1,"engine_hash":"aaaaaaaaaaaaaaaa"}]},"#,
        r#"{"parent":0,"hash":"1112131415161718","carriers":[{"rank":0,"tiers":1,"engine_hash":"bbbbbbbbbbbbbbbb"}]}]}"#
    );
    let encoded = String::from_utf8(encode_json_to_vec(&tiny()).unwrap()).unwrap();
    assert_eq!(encoded, expected);
    assert_eq!(
        decode_json(expected.as_bytes(), &DecodeLimits::default()).unwrap(),
        tiny()
    );
}
