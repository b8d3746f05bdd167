//! KV events over real ZeroMQ sockets: what a router's SUB receives from the simulator, decoded
//! with kvroute-wire, for every encoding the simulator can speak.

mod common;

use std::time::Duration;

use common::*;
use kvroute_sim::{KvEncodingArg, SimConfig};
use kvroute_wire::{EngineHash, Medium, decode_load_stat};
use serde_json::json;
use zeromq::{Socket, SocketRecv, SubSocket};

const ALL_ENCODINGS: [KvEncodingArg; 5] = [
    KvEncodingArg::Sglang,
    KvEncodingArg::Vllm,
    KvEncodingArg::VllmBytes,
    KvEncodingArg::VllmMap,
    KvEncodingArg::Legacy,
];

fn stored_of(events: &[BlockEvent]) -> Vec<(EngineHash, Option<EngineHash>, Vec<u32>)> {
    events
        .iter()
        .filter_map(|b| match b {
            BlockEvent::Stored {
                hash,
                parent,
                tokens,
                ..
            } => Some((*hash, *parent, tokens.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn every_encoding_publishes_sequenced_batches_of_chained_blocks_matching_the_prompt() {
    for encoding in ALL_ENCODINGS {
        let fleet = fleet(SimConfig {
            kv_encoding: encoding,
            block_size: 4,
            topic: "kv".into(),
            ..SimConfig::for_tests()
        })
        .await;
        let e = &fleet.engines[0];
        let mut sub = confirmed_sub(e, 0).await;

        // Request 1: 10 tokens -> 2 full blocks cached (the partial third is not).
        let p1 = toks(100, 10);
        let (status, _) = post(
            e,
            "/v1/completions",
            &json!({"prompt": p1, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200);
        let r0 = recv_kv(&mut sub).await;
        assert_eq!((r0.seq, &r0.topic[..]), (0, &b"kv"[..]), "{encoding:?}");
        assert_eq!(r0.batch.dp_rank, Some(0));
        let s0 = stored_of(&blocks(&r0.batch));
        assert_eq!(s0.len(), 2, "{encoding:?}: {s0:?}");
        assert_eq!(s0[0].1, None, "{encoding:?}: first block has no parent");
        assert_eq!(s0[1].1, Some(s0[0].0), "{encoding:?}: blocks chain");
        assert_eq!(s0[0].2, p1[0..4]);
        assert_eq!(s0[1].2, p1[4..8]);
        if matches!(
            encoding,
            KvEncodingArg::Vllm | KvEncodingArg::VllmBytes | KvEncodingArg::VllmMap
        ) {
            assert_eq!(
                r0.batch.events.len(),
                1,
                "{encoding:?}: vLLM groups a run in one event"
            );
        } else {
            assert_eq!(
                r0.batch.events.len(),
                2,
                "{encoding:?}: one block per event"
            );
        }

        // Request 2 extends the cached prefix by one block: only that block is announced, and
        // its parent is the last block of request 1.
        let p2 = toks(100, 12);
        let (status, body) = post(
            e,
            "/v1/completions",
            &json!({"prompt": p2, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        let r1 = recv_kv(&mut sub).await;
        assert_eq!(r1.seq, 1, "{encoding:?}");
        let s1 = stored_of(&blocks(&r1.batch));
        assert_eq!(
            s1,
            vec![(s1[0].0, Some(s0[1].0), p2[8..12].to_vec())],
            "{encoding:?}"
        );

        // A control store is one more batch, seq 2.
        assert_eq!(e.store_chains(0, &[toks(5000, 4)]), 2);
        assert_eq!(recv_kv(&mut sub).await.seq, 2, "{encoding:?}");
        assert_eq!(e.last_seq(0), 2);
        fleet.shutdown().await;
    }
}

#[tokio::test]
async fn engine_hashes_are_stable_for_equal_content_and_not_the_router_content_hash() {
    let fleet = fleet(SimConfig {
        block_size: 4,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let mut sub = confirmed_sub(e, 0).await;
    e.store_chains(0, &[toks(1, 8)]);
    let first = stored_of(&blocks(&recv_kv(&mut sub).await.batch));
    e.flush(0);
    recv_kv(&mut sub).await;
    e.store_chains(0, &[toks(1, 8)]);
    let again = stored_of(&blocks(&recv_kv(&mut sub).await.batch));
    assert_eq!(
        first, again,
        "same tokens, same engine hashes after a flush"
    );
    let mut router_hashes = Vec::new();
    kvroute_index::hash::hash_token_blocks(
        &toks(1, 8),
        4,
        kvroute_index::hash::BASE_NAMESPACE,
        &mut router_hashes,
    );
    for ((h, _, _), r) in first.iter().zip(router_hashes) {
        assert_ne!(
            h.0, r,
            "engine hash must not equal the router's content hash"
        );
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn eviction_announces_block_removed_for_a_previously_stored_block() {
    let fleet = fleet(SimConfig {
        block_size: 4,
        capacity_blocks: 3,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let mut sub = confirmed_sub(e, 0).await;
    e.store_chains(0, &[toks(0, 8)]); // 2 blocks
    let stored = stored_of(&blocks(&recv_kv(&mut sub).await.batch));
    e.store_chains(0, &[toks(100, 8)]); // 2 more: the second one needs room
    let ev = blocks(&recv_kv(&mut sub).await.batch);
    let new = stored_of(&ev);
    assert_eq!(new.len(), 2, "{ev:?}");
    assert_eq!(
        ev[1],
        BlockEvent::Removed {
            hash: stored[1].0,
            medium: Some(Medium::Device)
        },
        "the leaf of the older chain is evicted (not its parent), right before the store that \
         needed the room: {ev:?}"
    );
    assert!(matches!(&ev[2], BlockEvent::Stored { hash, .. } if *hash == new[1].0));
    assert_eq!(stored_of(&ev).len(), 2);
    fleet.shutdown().await;
}

#[tokio::test]
async fn flush_announces_all_blocks_cleared_and_empties_the_cache() {
    let fleet = fleet(SimConfig::for_tests()).await;
    let e = &fleet.engines[0];
    let mut sub = confirmed_sub(e, 0).await;
    let prompt = toks(10, 32);
    post(
        e,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    recv_kv(&mut sub).await;
    let (status, body) = post(e, "/control/flush", &json!({})).await;
    assert_eq!(status, 200, "{body}");
    let r = recv_kv(&mut sub).await;
    assert_eq!(blocks(&r.batch), vec![BlockEvent::Cleared]);
    assert_eq!(body["last_seq"], json!([r.seq]));
    let (_, body) = post(
        e,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    fleet.shutdown().await;
}

#[tokio::test]
async fn host_tier_backs_up_evicted_blocks_with_their_medium_and_promotes_them_back() {
    for encoding in [KvEncodingArg::Sglang, KvEncodingArg::Vllm] {
        let fleet = fleet(SimConfig {
            kv_encoding: encoding,
            block_size: 4,
            capacity_blocks: 2,
            host_capacity_blocks: 8,
            ..SimConfig::for_tests()
        })
        .await;
        let e = &fleet.engines[0];
        let mut sub = confirmed_sub(e, 0).await;
        let a = toks(0, 8);
        post(e, "/v1/completions", &json!({"prompt": a, "max_tokens": 1})).await;
        let a_blocks = stored_of(&blocks(&recv_kv(&mut sub).await.batch));
        post(
            e,
            "/v1/completions",
            &json!({"prompt": toks(500, 8), "max_tokens": 1}),
        )
        .await;
        let ev = blocks(&recv_kv(&mut sub).await.batch);
        for (hash, _, _) in &a_blocks {
            assert!(
                ev.iter().any(|b| matches!(b, BlockEvent::Stored { hash: h, medium: Some(Medium::Host), .. } if h == hash)),
                "{encoding:?}: host copy of {hash:?} announced: {ev:?}"
            );
            assert!(
                ev.contains(&BlockEvent::Removed {
                    hash: *hash,
                    medium: Some(Medium::Device)
                }),
                "{encoding:?}: device copy of {hash:?} removed: {ev:?}"
            );
        }
        // Reuse: the host blocks count as cached and come back to the device.
        let (_, body) = post(e, "/v1/completions", &json!({"prompt": a, "max_tokens": 1})).await;
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        let ev = blocks(&recv_kv(&mut sub).await.batch);
        let promoted: Vec<EngineHash> = ev
            .iter()
            .filter_map(|b| match b {
                BlockEvent::Stored {
                    hash,
                    medium: Some(Medium::Device),
                    ..
                } => Some(*hash),
                _ => None,
            })
            .collect();
        assert_eq!(
            promoted,
            vec![a_blocks[0].0, a_blocks[1].0],
            "{encoding:?}: {ev:?}"
        );
        fleet.shutdown().await;
    }
}

#[tokio::test]
async fn each_dp_rank_publishes_its_own_stream_and_the_rank_hint_picks_it() {
    let fleet = fleet(SimConfig {
        dp_size: 2,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    assert_eq!(
        e.kv_endpoint(1)
            .rsplit(':')
            .next()
            .unwrap()
            .parse::<u32>()
            .unwrap(),
        e.kv_endpoint(0)
            .rsplit(':')
            .next()
            .unwrap()
            .parse::<u32>()
            .unwrap()
            + 1,
        "rank ports are consecutive even when OS-assigned"
    );
    let mut sub1 = confirmed_sub(e, 1).await;
    let (status, body) = post(
        e,
        "/v1/completions",
        &json!({"prompt": toks(7, 16), "max_tokens": 1, "data_parallel_rank": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let r = recv_kv(&mut sub1).await;
    assert_eq!((r.seq, r.batch.dp_rank), (0, Some(1)));
    assert_eq!(e.last_seq(0), -1, "rank 0 published nothing");
    fleet.shutdown().await;
}

#[tokio::test]
async fn load_publisher_sends_load_stats_on_the_load_topic() {
    let fleet = fleet(SimConfig {
        load_publish: true,
        load_interval_ms: 20,
        block_size: 4,
        capacity_blocks: 100,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let mut sub = SubSocket::new();
    sub.connect(&e.load_endpoint(0).expect("load endpoint"))
        .await
        .unwrap();
    sub.subscribe("load").await.unwrap();
    e.store_chains(0, &[toks(0, 12)]);
    // Periodic publishing means no warm-up is needed: wait for a stat that reflects the store.
    let deadline = std::time::Instant::now() + Duration::from_millis(WAIT_MS);
    loop {
        let msg = tokio::time::timeout(Duration::from_millis(WAIT_MS), sub.recv())
            .await
            .expect("a load message")
            .unwrap();
        let frames = msg.into_vec();
        assert_eq!(&frames[0][..], b"load");
        let stat = decode_load_stat(&frames[2]).expect("LoadStat decodes");
        assert_eq!(stat.max_total_num_tokens, 400);
        assert_eq!(stat.dp_rank, Some(0));
        if stat.num_tokens == 12 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "last stat {stat:?}");
    }
    fleet.shutdown().await;
}
