//! Shared helpers for kvroute-sim's socket-level tests: starting a fleet, HTTP calls, a ZMQ SUB
//! whose subscription is proven live before the test starts counting, and replay over a DEALER.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_sim::{EngineHandle, Fleet, SimConfig, start_fleet};
use kvroute_wire::{EngineHash, EventBatch, KvEvent, Medium, decode_batch};
use serde_json::Value;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Upper bound on any single wait in these tests; generous for a loaded 2-core machine.
pub const WAIT_MS: u64 = 10_000;

pub async fn fleet(cfg: SimConfig) -> Fleet {
    start_fleet(cfg).await.expect("fleet starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(WAIT_MS))
        .build()
        .expect("client")
}

pub async fn post(e: &EngineHandle, path: &str, body: &Value) -> (u16, Value) {
    let resp = client()
        .post(format!("{}{path}", e.http_url()))
        .json(body)
        .send()
        .await
        .expect("request sent");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub async fn post_raw(e: &EngineHandle, path: &str, body: Vec<u8>) -> (u16, Value) {
    let resp = client()
        .post(format!("{}{path}", e.http_url()))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("request sent");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub async fn get(e: &EngineHandle, path: &str) -> (u16, Value) {
    let resp = client()
        .get(format!("{}{path}", e.http_url()))
        .send()
        .await
        .expect("request sent");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Polls `cond` until it holds or the deadline passes; panics naming what was awaited and the
/// last value seen.
pub async fn wait_until<T: std::fmt::Debug>(
    what: &str,
    mut probe: impl AsyncFnMut() -> T,
    cond: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + Duration::from_millis(WAIT_MS);
    loop {
        let seen = probe().await;
        if cond(&seen) {
            return seen;
        }
        if Instant::now() > deadline {
            panic!("timed out after {WAIT_MS} ms waiting for {what}; last seen: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One received KV message, decoded.
#[derive(Debug)]
pub struct Received {
    pub topic: Bytes,
    pub seq: i64,
    pub batch: EventBatch,
}

pub fn seq_of(frame: &[u8]) -> i64 {
    i64::from_be_bytes(frame.try_into().expect("8-byte seq frame"))
}

/// Receives one message or `None` after `within`.
pub async fn recv_within(sub: &mut SubSocket, within: Duration) -> Option<ZmqMessage> {
    tokio::time::timeout(within, sub.recv())
        .await
        .ok()
        .map(|m| m.expect("SUB recv"))
}

pub async fn recv_kv(sub: &mut SubSocket) -> Received {
    let msg = recv_within(sub, Duration::from_millis(WAIT_MS))
        .await
        .unwrap_or_else(|| panic!("no KV message within {WAIT_MS} ms"));
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "KV messages are [topic, seq, payload]");
    Received {
        topic: frames[0].clone(),
        seq: seq_of(&frames[1]),
        batch: decode_batch(&frames[2]).expect("payload decodes"),
    }
}

/// A SUB on rank `rank` whose subscription has provably reached the PUB: warm-up chains are
/// stored until one arrives (no sleep-and-hope for the slow joiner), then the publisher is
/// restarted so the test sees a fresh stream from seq 0 and an empty cache.
pub async fn confirmed_sub(e: &EngineHandle, rank: usize) -> SubSocket {
    let mut sub = SubSocket::new();
    sub.connect(&e.kv_endpoint(rank))
        .await
        .expect("SUB connects");
    sub.subscribe("").await.expect("subscribe");
    let deadline = Instant::now() + Duration::from_millis(WAIT_MS);
    let bs = e.block_size() as u32;
    let mut i = 0u32;
    loop {
        i += 1;
        e.store_chains(rank, &[(0..bs).map(|t| 900_000 + i * bs + t).collect()]);
        if recv_within(&mut sub, Duration::from_millis(50))
            .await
            .is_some()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "subscription to {} never became live ({i} warm-up batches unseen)",
            e.kv_endpoint(rank)
        );
    }
    e.restart_publisher(rank);
    // Warm-up batches published between the first receipt and the restart are still queued.
    while recv_within(&mut sub, Duration::from_millis(50))
        .await
        .is_some()
    {}
    sub
}

/// Flattens a batch's events into per-block records (hash, parent, tokens, medium) so tests
/// compare the same things whether the encoding groups blocks per event or not.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockEvent {
    Stored {
        hash: EngineHash,
        parent: Option<EngineHash>,
        tokens: Vec<u32>,
        medium: Option<Medium>,
    },
    Removed {
        hash: EngineHash,
        medium: Option<Medium>,
    },
    Cleared,
}

pub fn blocks(batch: &EventBatch) -> Vec<BlockEvent> {
    let mut out = Vec::new();
    for ev in &batch.events {
        match ev {
            KvEvent::BlockStored(s) => {
                let bs = s.block_size as usize;
                let mut parent = s.parent_block_hash;
                for (i, h) in s.block_hashes.iter().enumerate() {
                    out.push(BlockEvent::Stored {
                        hash: *h,
                        parent,
                        tokens: s.token_ids[i * bs..(i + 1) * bs].to_vec(),
                        medium: s.medium,
                    });
                    parent = Some(*h);
                }
            }
            KvEvent::BlockRemoved(r) => {
                for h in &r.block_hashes {
                    out.push(BlockEvent::Removed {
                        hash: *h,
                        medium: r.medium,
                    });
                }
            }
            KvEvent::AllBlocksCleared => out.push(BlockEvent::Cleared),
        }
    }
    out
}

/// Replays from `start` over a fresh DEALER: returns (seq, payload) per batch, having checked
/// the reply framing and that the stream ended with the -1 marker.
pub async fn replay(endpoint: &str, start: i64) -> Vec<(i64, Bytes)> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.expect("DEALER connects");
    let mut req = ZmqMessage::from(Bytes::new());
    req.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    dealer.send(req).await.expect("replay request sent");
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_millis(WAIT_MS), dealer.recv())
            .await
            .unwrap_or_else(|_| panic!("replay from {start}: no end marker after {out:?}"))
            .expect("DEALER recv");
        let frames = msg.into_vec();
        assert!(
            frames.len() == 4 || frames.len() == 3,
            "replay frames: {frames:?}"
        );
        assert!(
            frames[0].is_empty(),
            "replay replies start with an empty frame"
        );
        let (seq, payload) = (
            seq_of(&frames[frames.len() - 2]),
            frames[frames.len() - 1].clone(),
        );
        if seq == -1 {
            assert!(payload.is_empty(), "end marker carries an empty payload");
            return out;
        }
        out.push((seq, payload));
    }
}

/// `n` tokens starting at `start` (all below the shipped vocabulary size).
pub fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}
