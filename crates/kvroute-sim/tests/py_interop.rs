//! Interop proof against the engines' serializer: a Python process using msgspec + pyzmq with
//! mirrors of SGLang's and vLLM's event classes publishes one batch per engine encoding over a
//! real PUB and serves replay on a ROUTER; this test subscribes with the pure-Rust zeromq SUB,
//! decodes with kvroute_wire::decode_batch, checks every value, and replays over a DEALER.
//!
//! The interpreter comes from `KVROUTE_PYTHON` (set by scripts/test.sh), else from
//! scripts/python-env.sh, which creates the project venv on first use.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvroute_wire::{EngineHash, EventBatch, KvEvent, Medium, decode_batch};
use zeromq::{Socket, SubSocket};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> String {
    if let Ok(p) = std::env::var("KVROUTE_PYTHON")
        && !p.is_empty()
    {
        return p;
    }
    let out = Command::new(repo_root().join("scripts/python-env.sh"))
        .output()
        .expect("scripts/python-env.sh runs");
    assert!(
        out.status.success(),
        "python-env.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Kills the publisher if the test panics half-way.
struct Publisher(Child);
impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn stored(ev: &KvEvent) -> &kvroute_wire::BlockStored {
    match ev {
        KvEvent::BlockStored(s) => s,
        other => panic!("expected BlockStored, got {other:?}"),
    }
}

fn removed(ev: &KvEvent) -> &kvroute_wire::BlockRemoved {
    match ev {
        KvEvent::BlockRemoved(r) => r,
        other => panic!("expected BlockRemoved, got {other:?}"),
    }
}

fn check_batch(seq: i64, b: &EventBatch) {
    assert_eq!(b.ts, 1764460800.25, "batch {seq}");
    match seq {
        0 => {
            // SGLang: array batch, map events, signed hashes, one block per event.
            assert_eq!(b.dp_rank, Some(0));
            assert_eq!(b.events.len(), 4);
            let s0 = stored(&b.events[0]);
            assert_eq!(
                s0.block_hashes,
                vec![EngineHash::from_i64(-521283848079677608)]
            );
            assert_eq!(s0.parent_block_hash, None);
            assert_eq!(s0.token_ids, vec![1000, 1001, 1002, 1003]);
            assert_eq!(
                (s0.block_size, s0.lora_id, s0.medium),
                (4, None, Some(Medium::Device))
            );
            assert_eq!(
                s0.lora_name, None,
                "SGLang omits lora_name; absent reads as None"
            );
            let s1 = stored(&b.events[1]);
            assert_eq!(
                s1.parent_block_hash,
                Some(EngineHash::from_i64(-521283848079677608))
            );
            assert_eq!(s1.block_hashes, vec![EngineHash(7)]);
            let r = removed(&b.events[2]);
            assert_eq!(
                r.block_hashes,
                vec![EngineHash::from_i64(-521283848079677608)]
            );
            assert_eq!(r.medium, Some(Medium::Device));
            assert_eq!(b.events[3], KvEvent::AllBlocksCleared);
        }
        1 => {
            // vLLM 0.33 int mode: u64 hashes past i64::MAX, two blocks in one event.
            assert_eq!(b.dp_rank, Some(1));
            let s = stored(&b.events[0]);
            assert_eq!(
                s.block_hashes,
                vec![
                    EngineHash(2465420568987988355),
                    EngineHash(14799765119358052597)
                ]
            );
            assert_eq!(s.token_ids, (1000..1008).collect::<Vec<u32>>());
            assert_eq!(s.group_idx, Some(0));
            assert_eq!(s.lora_name, None);
            let r = removed(&b.events[1]);
            assert_eq!(r.block_hashes, vec![EngineHash(14799765119358052597)]);
            assert_eq!(r.group_idx, Some(0));
        }
        2 => {
            // vLLM bytes mode.
            let s = stored(&b.events[0]);
            let h: Vec<u8> = (0..32).collect();
            let p: Vec<u8> = (1..33).collect();
            assert_eq!(s.block_hashes, vec![EngineHash::from_bytes(&h)]);
            assert_eq!(s.parent_block_hash, Some(EngineHash::from_bytes(&p)));
            assert_eq!(s.medium, Some(Medium::Host));
            assert_eq!(s.lora_name.as_deref(), Some("adapter-a"));
        }
        3 => {
            // Map batch.
            assert_eq!(b.dp_rank, Some(2));
            let s = stored(&b.events[0]);
            assert_eq!(
                (s.block_hashes.clone(), s.lora_id),
                (vec![EngineHash(42)], Some(3))
            );
            assert_eq!(s.medium, None, "nil medium reads as absent");
            assert_eq!(b.events[1], KvEvent::AllBlocksCleared);
        }
        4 => {
            // Legacy tagged arrays.
            assert_eq!(b.dp_rank, None);
            let s = stored(&b.events[0]);
            assert_eq!(
                s.block_hashes,
                vec![EngineHash::from_i64(-5), EngineHash(6)]
            );
            assert_eq!(s.medium, Some(Medium::Host));
            let r = removed(&b.events[1]);
            assert_eq!(
                (r.block_hashes.clone(), r.medium),
                (vec![EngineHash(6)], None)
            );
        }
        other => panic!("unexpected seq {other}"),
    }
}

#[tokio::test]
async fn batches_from_python_engine_serializers_decode_over_real_sockets_and_replay() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/py_engine_publisher.py");
    let child = Command::new(python())
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python publisher starts");
    let mut publisher = Publisher(child);
    let mut stdin = publisher.0.stdin.take().unwrap();
    let mut stdout = BufReader::new(publisher.0.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).expect("ports line");
    let ports: serde_json::Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("publisher's first line {line:?}: {e}"));
    let pub_ep = format!("tcp://127.0.0.1:{}", ports["pub"]);
    let replay_ep = format!("tcp://127.0.0.1:{}", ports["replay"]);

    let mut sub = SubSocket::new();
    sub.connect(&pub_ep).await.expect("SUB connects");
    sub.subscribe("").await.unwrap();
    // Slow joiner: wait until a probe arrives, which proves the subscription is live.
    let deadline = Instant::now() + Duration::from_millis(WAIT_MS);
    loop {
        if let Some(m) = recv_within(&mut sub, Duration::from_millis(100)).await
            && &m.get(0).unwrap()[..] == b"probe"
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no probe from the Python publisher"
        );
    }
    writeln!(stdin, "go").unwrap();
    stdin.flush().unwrap();

    let mut seen = Vec::new();
    while seen.len() < 5 {
        let msg = recv_within(&mut sub, Duration::from_millis(WAIT_MS))
            .await
            .unwrap_or_else(|| panic!("only {} of 5 batches arrived", seen.len()));
        let frames = msg.into_vec();
        if &frames[0][..] == b"probe" {
            continue; // probes already in flight before "go"
        }
        assert_eq!((frames.len(), &frames[0][..]), (3, &b"kv"[..]));
        let seq = seq_of(&frames[1]);
        let batch = decode_batch(&frames[2])
            .unwrap_or_else(|e| panic!("batch {seq} does not decode: {e:?}"));
        check_batch(seq, &batch);
        seen.push(seq);
    }
    assert_eq!(seen, vec![0, 1, 2, 3, 4]);

    let mut done = String::new();
    stdout.read_line(&mut done).unwrap();
    assert!(done.contains("\"published\": 5"), "{done:?}");

    let replayed = replay(&replay_ep, 2).await;
    let seqs: Vec<i64> = replayed.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![2, 3, 4]);
    for (seq, payload) in &replayed {
        check_batch(
            *seq,
            &decode_batch(payload).expect("replayed batch decodes"),
        );
    }
    writeln!(stdin, "quit").unwrap();
    drop(stdin);
    let status = publisher.0.wait().expect("publisher exits");
    assert!(status.success(), "publisher exit status {status}");
}
