//! Golden tests against bytes the engines' own serializer wrote.
//!
//! `tests/fixtures/*.msgpack` come from `scripts/gen_wire_fixtures.py`, which mirrors each engine
//! generation's msgspec Structs and encodes with real msgspec 0.23; `manifest.json` beside them
//! carries what each payload means, computed on the Python side. Every fixture must decode to its
//! manifest values, and every fixture marked `reencodes_as` must come back byte for byte from
//! `encode_batch`: that is what proves the simulated engine publishes real engine bytes.
//!
//! The last test goes further when Python is available: random batches encoded here are decoded
//! by msgspec into the typed mirrors and re-encoded, and must come out identical.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kvroute_wire::{
    BlockRemoved, BlockStored, Encoding, EngineHash, EventBatch, KvEvent, LoadStat, Medium,
    decode_batch, decode_load_stat, encode_batch, encode_load_stat, engine_hash_bytes32,
};
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn manifest() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures_dir().join("manifest.json"))
        .expect("tests/fixtures/manifest.json is committed");
    let v: Value = serde_json::from_str(&text).expect("manifest.json parses");
    v["fixtures"].as_array().expect("fixtures array").clone()
}

fn fixture_bytes(entry: &Value) -> Vec<u8> {
    let file = entry["file"].as_str().expect("file name");
    std::fs::read(fixtures_dir().join(file)).unwrap_or_else(|e| panic!("read {file}: {e}"))
}

fn hash_of(v: &Value) -> EngineHash {
    if let Some(hex) = v.get("bytes").and_then(Value::as_str) {
        return EngineHash::from_bytes(&unhex(hex));
    }
    let n = &v["int"];
    if let Some(u) = n.as_u64() {
        EngineHash(u)
    } else {
        EngineHash::from_i64(n.as_i64().expect("hash int fits i64 or u64"))
    }
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

fn medium_of(v: &Value) -> Option<Medium> {
    v.as_str().map(|m| match m {
        "Device" => Medium::Device,
        "Host" => Medium::Host,
        "Disk" => Medium::Disk,
        "External" => Medium::External,
        "Unknown" => Medium::Unknown,
        other => panic!("manifest names medium {other}"),
    })
}

fn opt_i64(v: &Value) -> Option<i64> {
    v.as_i64()
}

fn expected_batch(v: &Value) -> EventBatch {
    let events = v["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| match e["type"].as_str().expect("type") {
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: e["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(hash_of)
                    .collect(),
                medium: medium_of(&e["medium"]),
                group_idx: opt_i64(&e["group_idx"]),
            }),
            "BlockStored" => KvEvent::BlockStored(BlockStored {
                block_hashes: e["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(hash_of)
                    .collect(),
                parent_block_hash: (!e["parent_block_hash"].is_null())
                    .then(|| hash_of(&e["parent_block_hash"])),
                token_ids: e["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
                    .collect(),
                block_size: e["block_size"].as_u64().unwrap() as u32,
                lora_id: opt_i64(&e["lora_id"]),
                lora_name: e["lora_name"].as_str().map(str::to_owned),
                medium: medium_of(&e["medium"]),
                extra_keys: e["extra_keys"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|k| k.as_str().map(|hex| xxh3_64(&unhex(hex))))
                    .collect(),
                group_idx: opt_i64(&e["group_idx"]),
            }),
            other => panic!("manifest names event type {other}"),
        })
        .collect();
    EventBatch {
        ts: v["ts"].as_f64().expect("ts"),
        events,
        dp_rank: v["dp_rank"].as_u64().map(|r| r as u32),
    }
}

fn expected_load_stat(v: &Value) -> LoadStat {
    LoadStat {
        num_running_reqs: v["num_running_reqs"].as_u64().unwrap(),
        num_waiting_reqs: v["num_waiting_reqs"].as_u64().unwrap(),
        num_tokens: v["num_tokens"].as_u64().unwrap(),
        max_total_num_tokens: v["max_total_num_tokens"].as_u64().unwrap(),
        dp_rank: v["dp_rank"].as_u64().map(|r| r as u32),
    }
}

fn encoding_named(name: &str) -> Encoding {
    match name {
        "Sglang" => Encoding::Sglang,
        "Vllm" => Encoding::Vllm,
        "VllmBytes" => Encoding::VllmBytes,
        "VllmMap" => Encoding::VllmMap,
        "Legacy" => Encoding::Legacy,
        other => panic!("manifest names encoding {other}"),
    }
}

#[test]
fn every_fixture_decodes_to_the_values_msgspec_encoded() {
    let entries = manifest();
    assert!(
        entries.len() >= 25,
        "manifest lists {} fixtures",
        entries.len()
    );
    for entry in &entries {
        let name = entry["name"].as_str().unwrap();
        let bytes = fixture_bytes(entry);
        assert_eq!(
            bytes.len() as u64,
            entry["len_bytes"].as_u64().unwrap(),
            "{name}: file length differs from manifest"
        );
        match entry["kind"].as_str().unwrap() {
            "batch" => {
                let got = decode_batch(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(got, expected_batch(&entry["expected"]), "{name}");
            }
            "load_stat" => {
                let got = decode_load_stat(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(got, expected_load_stat(&entry["expected"]), "{name}");
            }
            other => panic!("{name}: unknown kind {other}"),
        }
    }
}

#[test]
fn encoder_reproduces_every_claimed_fixture_byte_for_byte() {
    let mut claimed = 0;
    for entry in manifest() {
        let Some(enc) = entry["reencodes_as"].as_str() else {
            continue;
        };
        claimed += 1;
        let name = entry["name"].as_str().unwrap();
        let bytes = fixture_bytes(&entry);
        let again = if enc == "LoadStat" {
            encode_load_stat(&decode_load_stat(&bytes).unwrap())
        } else {
            encode_batch(&decode_batch(&bytes).unwrap(), encoding_named(enc))
        };
        assert_eq!(
            hex(&again),
            hex(&bytes),
            "{name}: encode_batch({enc}) differs from msgspec"
        );
    }
    assert!(claimed >= 18, "only {claimed} fixtures claim byte equality");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn sglang_negative_hash_and_device_medium_read_as_documented() {
    let bytes = std::fs::read(fixtures_dir().join("sglang_stored_negative_hash.msgpack")).unwrap();
    let batch = decode_batch(&bytes).unwrap();
    assert_eq!(batch.dp_rank, Some(0));
    let KvEvent::BlockStored(s) = &batch.events[0] else {
        panic!("expected BlockStored, got {:?}", batch.events[0]);
    };
    assert_eq!(
        s.block_hashes,
        vec![EngineHash((-521283848079677608i64) as u64)]
    );
    assert_eq!(s.parent_block_hash, Some(EngineHash::from_i64(-5)));
    assert_eq!(s.token_ids, vec![1000, 1001, 1002, 1003]);
    assert_eq!(s.medium, Some(Medium::Device));
    assert_eq!(s.lora_name, None);
}

#[test]
fn encoder_writes_extra_keys_entries_as_msgspec_writes_one_int_tuples() {
    let bytes = std::fs::read(fixtures_dir().join("vllm_extra_keys_int_tuples.msgpack")).unwrap();
    let batch = EventBatch {
        ts: 1764467272.5,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(1), EngineHash(2)],
            parent_block_hash: Some(EngineHash(0)),
            token_ids: (0..8).collect(),
            block_size: 4,
            lora_id: None,
            lora_name: Some("l".to_owned()),
            medium: Some(Medium::Device),
            extra_keys: vec![Some(14799765119358052597), None],
            group_idx: None,
        })],
        dp_rank: Some(0),
    };
    assert_eq!(hex(&encode_batch(&batch, Encoding::Vllm)), hex(&bytes));
    let KvEvent::BlockStored(decoded) = &decode_batch(&bytes).unwrap().events[0] else {
        panic!("expected BlockStored");
    };
    assert_eq!(
        decoded.extra_keys,
        vec![
            Some(kvroute_wire::encoded_extra_key_digest(14799765119358052597)),
            None
        ]
    );
}

#[test]
fn all_blocks_cleared_batch_is_35_bytes_in_both_engines() {
    let batch = EventBatch {
        ts: 1764467272.5,
        events: vec![KvEvent::AllBlocksCleared],
        dp_rank: Some(0),
    };
    for enc in [Encoding::Sglang, Encoding::Vllm, Encoding::VllmBytes] {
        assert_eq!(encode_batch(&batch, enc).len(), 35, "{enc:?}");
    }
}

#[test]
fn bytes_mode_fixture_hashes_fold_with_xxh3() {
    let bytes = std::fs::read(fixtures_dir().join("vllm_bytes_mode.msgpack")).unwrap();
    let batch = decode_batch(&bytes).unwrap();
    let digest: Vec<u8> = (0u8..32).collect();
    let KvEvent::BlockRemoved(r) = &batch.events[1] else {
        panic!("expected BlockRemoved, got {:?}", batch.events[1]);
    };
    assert_eq!(r.block_hashes, vec![EngineHash(xxh3_64(&digest))]);
}

#[test]
fn bytes_mode_expansion_ends_with_the_hash_big_endian() {
    let h = EngineHash(0x0123_4567_89ab_cdef);
    let b = engine_hash_bytes32(h);
    assert_eq!(&b[24..], &h.0.to_be_bytes());
    assert_ne!(
        engine_hash_bytes32(EngineHash(1)),
        engine_hash_bytes32(EngineHash(2))
    );
    assert_eq!(b, engine_hash_bytes32(h), "expansion is deterministic");
}

/// The project venv's interpreter, or `None` (with a note) when it cannot be had here.
fn python() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KVROUTE_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(root.join("scripts/python-env.sh"))
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "python-env.sh failed; skipping msgspec re-encode check: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    Some(PathBuf::from(String::from_utf8(out.stdout).ok()?.trim()))
}

/// Deterministic spread of batches covering every field each encoding can carry.
fn sample_batches(enc: Encoding) -> Vec<EventBatch> {
    let mut out = Vec::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ enc as u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mediums = [
        None,
        Some(Medium::Device),
        Some(Medium::Host),
        Some(Medium::Disk),
        Some(Medium::External),
        Some(Medium::Unknown),
    ];
    for i in 0..40u64 {
        let mut events = Vec::new();
        for j in 0..(i % 7) {
            let r = next();
            let blocks = 1 + (r % 20) as usize;
            let hashes: Vec<EngineHash> = (0..blocks)
                .map(|_| EngineHash(next() >> (r % 64)))
                .collect();
            let full = !matches!(enc, Encoding::Sglang | Encoding::Legacy);
            let ev = match (r >> 8) % 3 {
                0 => KvEvent::BlockStored(BlockStored {
                    token_ids: (0..blocks * 4)
                        .map(|_| (next() >> (next() % 64)) as u32)
                        .collect(),
                    block_hashes: hashes,
                    parent_block_hash: (j % 2 == 0).then(|| EngineHash(next())),
                    block_size: 4,
                    lora_id: (r % 5 == 0).then(|| next() as i64 >> 3),
                    lora_name: (enc != Encoding::Legacy && r % 3 == 0)
                        .then(|| "x".repeat((r % 40) as usize)),
                    medium: mediums[(r % 6) as usize],
                    extra_keys: if full && r % 4 == 0 {
                        (0..blocks).map(|k| (k % 2 == 0).then(&mut next)).collect()
                    } else {
                        Vec::new()
                    },
                    group_idx: (full && r % 2 == 0).then(|| (next() % 8) as i64),
                }),
                1 => KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: hashes,
                    medium: mediums[(r % 6) as usize],
                    group_idx: (full && r % 2 == 0).then(|| (next() % 8) as i64),
                }),
                _ => KvEvent::AllBlocksCleared,
            };
            events.push(ev);
        }
        out.push(EventBatch {
            ts: 1.7e9 + i as f64 * 0.125,
            events,
            dp_rank: (i % 3 != 0).then_some((i % 9) as u32),
        });
    }
    out
}

#[test]
fn msgspec_reencodes_our_output_byte_for_byte() {
    let Some(py) = python() else {
        eprintln!("NOTE: no Python venv here; the msgspec re-encode check did not run");
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gen_wire_fixtures.py");
    let mut child = Command::new(&py)
        .arg(&script)
        .arg("--reencode")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", py.display()));
    let mut cases = Vec::new();
    for enc in Encoding::ALL {
        for batch in sample_batches(enc) {
            cases.push((format!("{enc:?}"), encode_batch(&batch, enc)));
        }
    }
    for i in 0..10u64 {
        let stat = LoadStat {
            num_running_reqs: i,
            num_waiting_reqs: i * 1000,
            num_tokens: i << 40,
            max_total_num_tokens: u64::MAX >> i,
            dp_rank: (i % 2 == 0).then_some(i as u32),
        };
        cases.push(("LoadStat".to_owned(), encode_load_stat(&stat)));
    }
    // Written from another thread: replies can be long (a differing payload comes back in
    // full), and a child blocked on a full stdout pipe would stop reading our stdin.
    let lines: Vec<String> = cases
        .iter()
        .map(|(enc, payload)| format!("{enc} {}\n", hex(payload)))
        .collect();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        for line in lines {
            stdin.write_all(line.as_bytes())?;
        }
        Ok::<(), std::io::Error>(())
    });
    let replies: Vec<String> = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map(|l| l.unwrap())
        .collect();
    writer
        .join()
        .expect("stdin writer thread")
        .expect("write cases to the re-encoder");
    let status = child.wait().unwrap();
    assert!(status.success(), "re-encoder exited with {status}");
    assert_eq!(replies.len(), cases.len(), "one reply per case");
    for ((enc, payload), reply) in cases.iter().zip(&replies) {
        assert_eq!(
            reply,
            "same",
            "{enc}: msgspec re-encoded differently\nours:    {}",
            hex(payload)
        );
    }
}

#[test]
fn committed_fixtures_match_what_the_generator_writes() {
    let Some(py) = python() else {
        eprintln!("NOTE: no Python venv here; the fixture freshness check did not run");
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gen_wire_fixtures.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg("--check")
        .arg(fixtures_dir())
        .output()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", py.display()));
    assert!(
        out.status.success(),
        "fixtures are stale; rerun scripts/gen_wire_fixtures.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
