//! Writes the committed seed corpora in `fuzz/seeds/<target>/` (run from anywhere:
//! `cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds`).
//!
//! Seeds come from the project's own fixtures wherever they exist, so the fuzzer starts from the
//! shapes real peers send: the engines' golden KV-event payloads
//! (`crates/kvroute-wire/tests/fixtures/*.msgpack`, written by the engines' own serializer),
//! re-encoded by our encoder in every engine encoding, and wrapped in every ZMQ frame shape; the
//! golden snapshot of `crates/kvroute-snapshot/tests/golden.rs` and snapshots shaped like the
//! bootstrap tests' (covered, empty and unknown ranks) plus one exported from a real index, in
//! every encoding a fetch negotiates; the request/response heads, chunked bodies and token-id
//! bodies the unit tests of `kvroute-http1` and `kvroute`'s `token_ids` are built around.
//!
//! Deterministic: the same tree gives the same files, so a regenerated corpus diffs cleanly.
//! It removes nothing: stale seeds are deleted by hand.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use kvroute_fuzz::{
    FrameKind, SNAPSHOT_BLOCK, SNAPSHOT_KEY, SNAPSHOT_LIVE_RANKS, SNAPSHOT_MODES, join_frames,
    live_rank_ref,
};
use kvroute_index::hash::HASH_SCHEME;
use kvroute_index::{IndexConfig, PrefixIndex};
use kvroute_snapshot::{
    CompressingWriter, Compression, EncodeOptions, encode_binary_to_vec, encode_json_to_vec,
};
use kvroute_wire::snapshot::{
    IndexSnapshot, NO_PARENT, RankCursor, RankRef, SNAPSHOT_FORMAT, SnapshotNodes,
};
use kvroute_wire::{
    BlockStored, Encoding, EngineHash, EventBatch, KvEvent, decode_batch, encode_batch,
};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

struct Seeds {
    dir: PathBuf,
    written: usize,
}

impl Seeds {
    fn new(target: &str) -> Seeds {
        let dir = root().join("seeds").join(target);
        fs::create_dir_all(&dir).expect("create the seed directory");
        Seeds { dir, written: 0 }
    }

    fn put(&mut self, name: &str, bytes: &[u8]) {
        fs::write(self.dir.join(name), bytes).expect("write a seed");
        self.written += 1;
    }
}

impl Drop for Seeds {
    fn drop(&mut self) {
        println!("{}: {} seeds", self.dir.display(), self.written);
    }
}

/// The engines' golden payloads, by file stem, sorted.
fn wire_fixtures() -> Vec<(String, Vec<u8>)> {
    let dir = root().join("../crates/kvroute-wire/tests/fixtures");
    let mut out: Vec<(String, Vec<u8>)> = fs::read_dir(&dir)
        .expect("the wire fixtures")
        .map(|e| e.expect("a fixture entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "msgpack"))
        .map(|p| {
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            (stem, fs::read(&p).expect("read a fixture"))
        })
        .collect();
    out.sort();
    out
}

fn wire_seeds() {
    let mut s = Seeds::new("wire_payload");
    for (name, bytes) in wire_fixtures() {
        s.put(&format!("golden_{name}"), &bytes);
        if let Ok(batch) = decode_batch(&bytes) {
            for enc in Encoding::ALL {
                let again = encode_batch(&batch, enc);
                if again != bytes {
                    s.put(&format!("reencoded_{name}_{enc:?}"), &again);
                }
            }
        }
    }
}

fn frame_seeds() {
    let mut s = Seeds::new("zmq_frames");
    for (name, payload) in wire_fixtures().into_iter().take(6) {
        let seq = 41i64.to_be_bytes();
        s.put(
            &format!("live_{name}"),
            &join_frames(FrameKind::Live, &[b"kv", &seq, &payload]),
        );
        s.put(
            &format!("replay_topic_{name}"),
            &join_frames(FrameKind::Replay, &[b"", b"kv", &seq, &payload]),
        );
        s.put(
            &format!("replay_no_topic_{name}"),
            &join_frames(FrameKind::Replay, &[b"", &seq, &payload]),
        );
    }
    let end = (-1i64).to_be_bytes();
    s.put(
        "replay_end_marker",
        &join_frames(FrameKind::Replay, &[b"", b"", &end, b""]),
    );
    s.put(
        "live_two_frames",
        &join_frames(FrameKind::Live, &[b"kv", b"p"]),
    );
    s.put(
        "live_short_seq",
        &join_frames(FrameKind::Live, &[b"", &[1, 2, 3], b"p"]),
    );
    s.put("replay_one_frame", &join_frames(FrameKind::Replay, &[b""]));
}

/// The golden snapshot of `kvroute-snapshot`'s golden test (its hash scheme is not ours, so it
/// exercises the decoders and the header check).
fn golden_tiny() -> IndexSnapshot {
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

/// Shaped like the bootstrap tests' snapshots: each covered rank carries a two-block chain and
/// has a cursor, a shared root carried by two ranks, empty ranks listed, and one rank this
/// replica does not serve (dropped by vetting).
fn bootstrap_shaped(covered: &[u32], empty: &[u32]) -> IndexSnapshot {
    let mut ranks: Vec<RankRef> = (0..SNAPSHOT_LIVE_RANKS).map(live_rank_ref).collect();
    ranks.push(RankRef {
        worker_url: "http://unknown:1".into(),
        dp_rank: 0,
    });
    let unknown = ranks.len() as u32 - 1;
    let mut nodes = SnapshotNodes::default();
    // A shared root carried by the first covered rank and the unknown one.
    nodes.parent.push(NO_PARENT);
    nodes.content_hash.push(0x5151);
    for r in covered.iter().take(1).chain([&unknown]) {
        nodes.carrier_rank.push(*r);
        nodes.carrier_tiers.push(1);
        nodes.carrier_engine_hash.push(0x7777);
    }
    nodes.carrier_end.push(nodes.carrier_rank.len() as u32);
    for &r in covered {
        let root = nodes.parent.len() as u32;
        for (i, parent) in [NO_PARENT, root].into_iter().enumerate() {
            let hash = (u64::from(r) << 8) | i as u64;
            nodes.parent.push(parent);
            nodes.content_hash.push(hash);
            nodes.carrier_rank.push(r);
            nodes.carrier_tiers.push(if i == 0 { 1 } else { 2 });
            nodes.carrier_engine_hash.push(!hash);
            nodes.carrier_end.push(nodes.carrier_rank.len() as u32);
        }
    }
    IndexSnapshot {
        format: SNAPSHOT_FORMAT,
        hash_scheme: HASH_SCHEME.to_string(),
        block_size: SNAPSHOT_BLOCK,
        producer_ready: true,
        ranks,
        cursors: covered
            .iter()
            .map(|&r| RankCursor {
                rank: r,
                seq: 10 + i64::from(r),
                ts: 0.5,
            })
            .collect(),
        empty_ranks: empty.to_vec(),
        partial_ranks: vec![],
        nodes,
    }
}

/// Exported from a real index: three live ranks, each storing one chain of four blocks that
/// shares its first two blocks with the others.
fn exported() -> IndexSnapshot {
    let (mut w, r) = PrefixIndex::new(IndexConfig {
        block_size: SNAPSHOT_BLOCK,
        shard_count: 4,
        max_carried_blocks: 1 << 20,
    });
    for rank in 0..3u32 {
        let id = w.add_rank(live_rank_ref(rank));
        let mut tokens: Vec<u32> = (0..2 * SNAPSHOT_BLOCK).collect();
        tokens.extend((0..2 * SNAPSHOT_BLOCK).map(|t| 1000 * (rank + 1) + t));
        let hashes = (0..4u64)
            .map(|b| EngineHash(u64::from(rank) << 32 | b))
            .collect();
        let stored = BlockStored::new(hashes, None, tokens, SNAPSHOT_BLOCK);
        let batch = EventBatch {
            ts: 1.25,
            events: vec![KvEvent::BlockStored(stored)],
            dp_rank: None,
        };
        w.apply_batch(id, 7, &batch);
    }
    r.export_snapshot()
}

fn compressed(plain: &[u8], c: Compression) -> Vec<u8> {
    let mut w = CompressingWriter::new(Vec::new(), c).expect("a compressor");
    w.write_all(plain).expect("compress");
    w.finish().expect("finish compressing")
}

fn snapshot_seeds() {
    let mut s = Seeds::new("snapshot_vet_graft");
    let snapshots = [
        ("golden_tiny", golden_tiny()),
        ("covered_and_empty", bootstrap_shaped(&[0, 3, 5], &[6])),
        ("cold_ready_empty", bootstrap_shaped(&[], &[1, 2])),
        ("exported_index", exported()),
    ];
    for (name, snap) in &snapshots {
        for (mode, (encoding, keyed)) in SNAPSHOT_MODES.iter().enumerate() {
            let body = match encoding.media {
                kvroute_bootstrap::BodyMedia::Binary => {
                    // The envelope's own compression: none for mode 0, each kind for the keyed
                    // mode; a proxy's Content-Encoding wraps an uncompressed envelope.
                    let inner = if *keyed {
                        Compression::Zstd
                    } else {
                        Compression::None
                    };
                    let options = EncodeOptions {
                        compression: inner,
                        mac_key: keyed.then_some(SNAPSHOT_KEY),
                    };
                    let bin = encode_binary_to_vec(snap, &options).expect("encode binary");
                    compressed(&bin, encoding.content_encoding)
                }
                kvroute_bootstrap::BodyMedia::Json => compressed(
                    &encode_json_to_vec(snap).expect("encode json"),
                    encoding.content_encoding,
                ),
            };
            let mut input = vec![mode as u8];
            input.extend_from_slice(&body);
            s.put(&format!("{name}_mode{mode}"), &input);
        }
        // The envelope compressions without a proxy around them.
        for c in [Compression::Gzip, Compression::Zstd] {
            let options = EncodeOptions {
                compression: c,
                mac_key: None,
            };
            let mut input = vec![0u8];
            input.extend_from_slice(&encode_binary_to_vec(snap, &options).expect("encode"));
            s.put(&format!("{name}_envelope_{c:?}"), &input);
        }
    }
}

fn request_seeds() {
    let mut s = Seeds::new("http1_request");
    let body = br#"{"model":"m","prompt":[1,2,3],"max_tokens":4}"#;
    let with = |path: &str, headers: &str| {
        let mut out = format!(
            "POST {path} HTTP/1.1\r\nhost: router:8080\r\ncontent-type: application/json\r\n{headers}content-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        out.extend_from_slice(body);
        out
    };
    s.put("completions", &with("/v1/completions", ""));
    s.put(
        "chat",
        &with("/v1/chat/completions", "x-request-id: abc-123\r\n"),
    );
    s.put(
        "generate_close",
        &with("/generate?x=1", "connection: keep-alive, close\r\n"),
    );
    s.put(
        "chunked_upload",
        &with("/v1/completions", "transfer-encoding: chunked\r\n"),
    );
    s.put(
        "expect",
        &with("/v1/completions", "Expect: 100-continue\r\n"),
    );
    s.put(
        "upgrade",
        &with("/generate", "connection: upgrade\r\nupgrade: h2c\r\n"),
    );
    s.put("two_lengths", &with("/generate", "content-length: 3\r\n"));
    s.put("get_health", b"GET /healthz HTTP/1.1\r\nhost: r\r\n\r\n");
    s.put(
        "http10",
        b"POST /v1/completions HTTP/1.0\r\ncontent-length: 2\r\n\r\n{}",
    );
    s.put("h2_preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    s.put(
        "bare_lf_head",
        b"POST /generate HTTP/1.1\nhost: r\ncontent-length: 0\n\n",
    );
    s.put(
        "plus_length",
        b"POST /generate HTTP/1.1\r\ncontent-length: +5\r\n\r\nhello",
    );
    s.put(
        "partial",
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-le",
    );
}

fn response_seeds() {
    let mut s = Seeds::new("http1_response_chunked");
    let mut put_response = |name: &str, bytes: &[u8]| {
        let mut input = vec![0u8];
        input.extend_from_slice(bytes);
        s.put(&format!("response_{name}"), &input);
    };
    put_response(
        "sse_chunked",
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n\
          e\r\ndata: {\"a\":1}\n\n\r\n6\r\ndata: \r\n0\r\n\r\n",
    );
    put_response(
        "length",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
    );
    put_response(
        "interim_then_final",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n",
    );
    put_response(
        "te_and_length",
        b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\ntransfer-encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    );
    put_response(
        "no_content",
        b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
    );
    put_response(
        "http10_close",
        b"HTTP/1.0 200 OK\r\nconnection: close\r\n\r\nbody",
    );
    put_response(
        "conflicting",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
    );
    put_response(
        "switching",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
    );
    let mut put_chunked = |name: &str, bytes: &[u8]| {
        let mut input = vec![1u8];
        input.extend_from_slice(bytes);
        s.put(&format!("chunked_{name}"), &input);
    };
    put_chunked("simple", b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
    put_chunked(
        "extensions",
        b"5;name=value\r\nhello\r\n1 ;a=\"b \\\"c\";d\r\n!\r\n0;last\r\n\r\n",
    );
    put_chunked(
        "trailers",
        b"4\r\ndata\r\n0\r\nx-checksum: 1234\r\nx-other: a b\r\n\r\n",
    );
    put_chunked(
        "pipelined_next",
        b"2\r\nhi\r\n0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    );
    put_chunked("upper_hex", b"A\r\n0123456789\r\n000\r\n\r\n");
    put_chunked("size_junk", b"5 junk\r\nhello\r\n0\r\n\r\n");
    put_chunked("trailer_bare_lf", b"0\r\nx: a\nb\r\n\r\n");
    put_chunked("huge_size", b"fffffffffffffff\r\nab");
}

fn token_id_seeds() {
    let mut s = Seeds::new("token_ids");
    let mut put = |name: &str, key: u8, body: &[u8]| {
        let mut input = vec![key];
        input.extend_from_slice(body);
        s.put(name, &input);
    };
    put(
        "completions",
        0,
        br#"{"model":"m-1","prompt":[0,1,2,4294967295],"max_tokens":16,"stream":true}"#,
    );
    put(
        "skipped_values",
        0,
        br#" { "x" : {"y":[null, "a\"b", -1.5e3, true]}, "model":"m",
            "prompt" : [ 0, 1,2 ,3 ] ,"s":"\u00e9"} "#,
    );
    put(
        "generate",
        1,
        br#"{"input_ids":[7,8,9],"model":null,"sampling_params":{"max_new_tokens":8}}"#,
    );
    put("empty_ids", 1, br#"{"input_ids":[]}"#);
    put("escaped_model", 0, br#"{"prompt":[1],"model":"m\u0031"}"#);
    put("duplicate_prompt", 0, br#"{"prompt":[1],"prompt":[2]}"#);
    put("too_big", 0, br#"{"prompt":[4294967296]}"#);
    put("leading_zero", 0, br#"{"prompt":[01]}"#);
    put("text_prompt", 0, br#"{"prompt":"hello","model":"m"}"#);
    put("batch", 1, br#"{"input_ids":[[1],[2]]}"#);
    put("trailing", 0, br#"{"prompt":[1]} x"#);
    let deep = format!(
        r#"{{"prompt":[1],"x":{}0{}}}"#,
        "[".repeat(127),
        "]".repeat(127)
    );
    put("deep_value", 0, deep.as_bytes());
    // Divergences the long runs found (fuzz/README.md, "Findings"), kept as regressions.
    put(
        "regression_invalid_utf8_in_a_skipped_string",
        0,
        b"{\"prompt\":[1],\"x\":\"\xff\"}",
    );
    put(
        "regression_invalid_utf8_in_a_skipped_key",
        1,
        b"{\"input_ids\":[7],\"sampling_params\":{\"max_new\xf6tokens\":8}}",
    );
    put(
        "regression_float_out_of_range_in_a_skipped_value",
        0,
        br#"{"prompt":[1],"x":1e400}"#,
    );
}

fn load_frame_seeds() {
    use kvroute_fuzz::load_frame::{
        BookingFrame, RankBookings, RankKey, SharedPending, SharedPrefix, encode_line,
    };
    let mut s = Seeds::new("load_frame");
    let key: &[u8] = b"kvroute-fuzz-shared-secret-0001";
    let rank = |url: &str, dp: u32| RankKey {
        worker_url: url.into(),
        dp_rank: dp,
    };
    let busy = RankBookings {
        in_flight: 3,
        queued_prefill_tokens: 1_800,
        prefill_backlog_us: 5_400,
        prefill_dispatched_us: 90_000,
    };
    let full = BookingFrame::Full {
        seq: 1,
        ranks: vec![
            (rank("http://10.0.0.1:8000", 0), busy),
            (rank("http://10.0.0.1:8000", 1), RankBookings::default()),
        ],
        pending: vec![],
        prefixes: vec![],
    };
    let delta = BookingFrame::Delta {
        seq: 2,
        changes: vec![(1, busy)],
        pending: vec![SharedPending {
            model: "m".into(),
            rank: rank("http://10.0.0.1:8000", 1),
            hashes: vec![0, 1, u64::MAX],
        }],
        prefixes: vec![],
    };
    let with_prefixes = BookingFrame::Delta {
        seq: 4,
        changes: vec![],
        pending: vec![],
        prefixes: vec![SharedPrefix {
            tokenizer: u64::MAX,
            key: 7,
            rendered_len: 12,
            rendered_hash: 1 << 63,
            tokens: vec![0u32, 151_643, u32::MAX].into(),
        }],
    };
    let heartbeat = BookingFrame::Delta {
        seq: 3,
        changes: vec![],
        pending: vec![],
        prefixes: vec![],
    };
    for (name, frame) in [
        ("full", &full),
        ("delta_with_pending", &delta),
        ("heartbeat", &heartbeat),
        ("delta_with_prefixes", &with_prefixes),
    ] {
        for (mode, suffix, mac) in [(0u8, "plain", None), (1u8, "signed", Some(key))] {
            let line = encode_line(frame, mac);
            let mut input = vec![mode];
            input.extend_from_slice(&line[..line.len() - 1]);
            s.put(&format!("{name}_{suffix}"), &input);
        }
    }
    // Shapes the decoder must refuse: an unsigned line to a keyed follower, both kinds at
    // once, an index past the table, a URL and counts past their bounds.
    let unsigned = encode_line(&heartbeat, None);
    let mut input = vec![1u8];
    input.extend_from_slice(&unsigned[..unsigned.len() - 1]);
    s.put("unsigned_to_keyed", &input);
    s.put("both_kinds", b"\x00{\"seq\":1,\"full\":[],\"delta\":[]}");
    s.put("index_past_table", b"\x00{\"seq\":2,\"delta\":[[9,1,1,1,1]]}");
    // Refused as malformed: the entries before the dispatched-work counter.
    s.put(
        "older_five_field_form",
        b"\x00{\"seq\":1,\"full\":[[\"http://10.0.0.1:8000\",0,3,1800,5400]]}",
    );
    // Found by the first smoke run (fuzz/README.md, finding 5): seq 0 after seq u64::MAX.
    s.put(
        "regression_seq_after_u64_max",
        b"\x00{\"seq\":0,\"delta\":[]}",
    );
    s.put("huge_counts", b"\x00{\"seq\":1,\"full\":[[\"http://e\",0,18446744073709551615,18446744073709551615,18446744073709551615,18446744073709551615]]}");
}

fn main() {
    load_frame_seeds();
    wire_seeds();
    frame_seeds();
    snapshot_seeds();
    request_seeds();
    response_seeds();
    token_id_seeds();
}
