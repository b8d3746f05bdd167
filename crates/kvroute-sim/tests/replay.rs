//! Replay over a real DEALER against the simulator's ROUTER: suffix replay with the end marker,
//! a deliberately created gap healed by replay, and a publisher restart back to seq 0.

mod common;

use common::*;
use kvroute_sim::SimConfig;
use kvroute_wire::decode_batch;
use serde_json::json;

#[tokio::test]
async fn replay_from_k_returns_k_through_last_then_the_end_marker() {
    let fleet = fleet(SimConfig {
        block_size: 4,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    for i in 0..5 {
        e.store_chains(0, &[toks(i * 100, 4)]);
    }
    assert_eq!(e.last_seq(0), 4);
    let got = replay(&e.replay_endpoint(0), 2).await;
    let seqs: Vec<i64> = got.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![2, 3, 4]);
    for (seq, payload) in &got {
        let batch = decode_batch(payload).expect("replayed payload decodes");
        let stored = blocks(&batch);
        assert!(
            matches!(&stored[0], BlockEvent::Stored { tokens, .. } if tokens[0] == *seq as u32 * 100),
            "batch {seq} is the one published with that seq: {stored:?}"
        );
    }
    assert!(
        replay(&e.replay_endpoint(0), 5).await.is_empty(),
        "nothing after last"
    );
    assert_eq!(replay(&e.replay_endpoint(0), 0).await.len(), 5);
    fleet.shutdown().await;
}

#[tokio::test]
async fn replay_buffer_keeps_only_the_configured_number_of_batches() {
    let fleet = fleet(SimConfig {
        block_size: 4,
        replay_buffer_batches: 3,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    for i in 0..6 {
        e.store_chains(0, &[toks(i * 100, 4)]);
    }
    let seqs: Vec<i64> = replay(&e.replay_endpoint(0), 0)
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(seqs, vec![3, 4, 5]);
    fleet.shutdown().await;
}

#[tokio::test]
async fn drop_next_creates_a_gap_on_the_pub_that_replay_fills() {
    let fleet = fleet(SimConfig {
        block_size: 4,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let mut sub = confirmed_sub(e, 0).await;
    e.store_chains(0, &[toks(0, 4)]); // seq 0, seen
    assert_eq!(recv_kv(&mut sub).await.seq, 0);
    let (status, _) = post(
        e,
        "/control/drop_next",
        &json!({"dp_rank": 0, "batches": 2}),
    )
    .await;
    assert_eq!(status, 200);
    e.store_chains(0, &[toks(100, 4)]); // seq 1, withheld
    e.store_chains(0, &[toks(200, 4)]); // seq 2, withheld
    e.store_chains(0, &[toks(300, 4)]); // seq 3, seen
    let next = recv_kv(&mut sub).await;
    assert_eq!(next.seq, 3, "seqs 1 and 2 never reached the SUB");
    // The subscriber sees the gap (0 -> 3) and asks for last_seen + 1.
    let filled = replay(&e.replay_endpoint(0), 1).await;
    let seqs: Vec<i64> = filled.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![1, 2, 3]);
    let tokens_of_1 = blocks(&decode_batch(&filled[0].1).unwrap());
    assert!(matches!(&tokens_of_1[0], BlockEvent::Stored { tokens, .. } if tokens[0] == 100));
    fleet.shutdown().await;
}

#[tokio::test]
async fn restart_publisher_starts_again_at_seq_zero_with_an_empty_cache_and_buffer() {
    let fleet = fleet(SimConfig {
        block_size: 4,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let prompt = toks(0, 8);
    post(
        e,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    post(
        e,
        "/v1/completions",
        &json!({"prompt": toks(50, 8), "max_tokens": 1}),
    )
    .await;
    let (_, seqs) = get(e, "/control/last_seq").await;
    assert_eq!(seqs["last_seq"], json!([1]));
    let (status, body) = post(e, "/control/restart_publisher", &json!({"dp_rank": 0})).await;
    assert_eq!((status, &body["last_seq"]), (200, &json!(-1)));
    assert!(replay(&e.replay_endpoint(0), 0).await.is_empty());
    let mut sub = confirmed_sub(e, 0).await; // restarts once more, harmlessly
    let (_, body) = post(
        e,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "a restarted engine has an empty cache"
    );
    assert_eq!(recv_kv(&mut sub).await.seq, 0);
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_malformed_replay_request_gets_just_the_end_marker() {
    use bytes::Bytes;
    use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};
    let fleet = fleet(SimConfig::for_tests()).await;
    let e = &fleet.engines[0];
    e.store_chains(0, &[toks(0, 16)]);
    let mut dealer = DealerSocket::new();
    dealer.connect(&e.replay_endpoint(0)).await.unwrap();
    let mut req = ZmqMessage::from(Bytes::new());
    req.push_back(Bytes::from_static(b"abc")); // not an 8-byte seq
    dealer.send(req).await.unwrap();
    let reply = tokio::time::timeout(std::time::Duration::from_millis(WAIT_MS), dealer.recv())
        .await
        .expect("a reply")
        .unwrap()
        .into_vec();
    assert_eq!(seq_of(&reply[reply.len() - 2]), -1, "{reply:?}");
    fleet.shutdown().await;
}
