//! The scheduler over real HTTP: queueing beyond `--max-running`, least-loaded rank choice
//! without a hint, and a running slot released when a streaming client goes away.

mod common;

use common::*;
use kvroute_sim::SimConfig;
use serde_json::json;

fn slow() -> SimConfig {
    SimConfig {
        instant: false,
        overhead_us: 0,
        prefill_us_per_token: 0,
        decode_us_per_token: 50_000,
        ..SimConfig::for_tests()
    }
}

fn spawn_completion(url: String, max_tokens: u32) -> tokio::task::JoinHandle<u16> {
    tokio::spawn(async move {
        client()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": "queued", "max_tokens": max_tokens}))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    })
}

#[tokio::test]
async fn requests_beyond_max_running_wait_in_the_queue_then_run() {
    let fleet = fleet(SimConfig {
        max_running: 1,
        ..slow()
    })
    .await;
    let e = &fleet.engines[0];
    let first = spawn_completion(e.http_url(), 4);
    let second = spawn_completion(e.http_url(), 1);
    let stat = wait_until(
        "one running and one waiting",
        async || e.engine().load_stat(0),
        |s| s.num_running_reqs == 1 && s.num_waiting_reqs == 1,
    )
    .await;
    assert_eq!(stat.dp_rank, Some(0));
    assert_eq!((first.await.unwrap(), second.await.unwrap()), (200, 200));
    let idle = e.engine().load_stat(0);
    assert_eq!((idle.num_running_reqs, idle.num_waiting_reqs), (0, 0));
    fleet.shutdown().await;
}

#[tokio::test]
async fn without_a_hint_the_least_loaded_rank_is_chosen() {
    let fleet = fleet(SimConfig {
        dp_size: 2,
        ..slow()
    })
    .await;
    let e = &fleet.engines[0];
    let busy = spawn_completion(e.http_url(), 6);
    let stats = wait_until(
        "one request running on some rank",
        async || (e.engine().load_stat(0), e.engine().load_stat(1)),
        |(a, b)| a.num_running_reqs + b.num_running_reqs == 1,
    )
    .await;
    let idle_rank = if stats.0.num_running_reqs == 1 { 1 } else { 0 };
    let (status, body) = post(
        e,
        "/generate",
        &json!({"input_ids": toks(1, 16), "sampling_params": {"max_new_tokens": 0}}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["meta_info"]["dp_rank"], idle_rank, "{body}");
    assert_eq!(busy.await.unwrap(), 200);
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_streaming_client_that_disconnects_releases_its_running_slot() {
    let fleet = fleet(slow()).await;
    let e = &fleet.engines[0];
    let mut resp = client()
        .post(format!("{}/v1/completions", e.http_url()))
        .json(&json!({"prompt": "abandon me", "max_tokens": 200, "stream": true}))
        .send()
        .await
        .unwrap();
    let first = resp.chunk().await.unwrap().expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    assert_eq!(e.engine().load_stat(0).num_running_reqs, 1);
    drop(resp);
    wait_until(
        "the abandoned stream's slot to be released",
        async || e.engine().load_stat(0).num_running_reqs,
        |n| *n == 0,
    )
    .await;
    fleet.shutdown().await;
}

/// What was seen on one rank while two uncached prompts sent at once were both inside it.
struct Overlap {
    most_prefilling: usize,
    most_running: u64,
    most_waiting: u64,
}

/// Two uncached prompts sent at once to the same rank: with `--prefill-serial` only one is ever
/// in its prefill phase (the other waits for its turn, counted as waiting); without it both
/// prefill, and run, at the same time.
async fn overlap_on_one_rank(prefill_serial: bool) -> Overlap {
    let fleet = fleet(SimConfig {
        instant: false,
        overhead_us: 0,
        prefill_us_per_token: 20_000,
        decode_us_per_token: 0,
        prefill_serial,
        ..SimConfig::for_tests()
    })
    .await;
    let e = &fleet.engines[0];
    let send = |start: u32| {
        let url = e.http_url();
        tokio::spawn(async move {
            client()
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": toks(start, 16), "max_tokens": 1}))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        })
    };
    let (a, b) = (send(1), send(100));
    let in_engine = |s: &kvroute_wire::LoadStat| s.num_running_reqs + s.num_waiting_reqs;
    wait_until(
        "both requests inside the engine (running, or waiting for a slot or their prefill turn)",
        async || e.engine().load_stat(0),
        |s| in_engine(s) == 2,
    )
    .await;
    // Sample while both are inside: 16 tokens x 20 ms = 320 ms of prefill each. (A sampling
    // interval, not a wait for state: the loop ends on the condition.)
    let mut seen = Overlap {
        most_prefilling: 0,
        most_running: 0,
        most_waiting: 0,
    };
    loop {
        let stat = e.engine().load_stat(0);
        if in_engine(&stat) != 2 {
            break;
        }
        seen.most_prefilling = seen.most_prefilling.max(e.engine().prefilling(0));
        seen.most_running = seen.most_running.max(stat.num_running_reqs);
        seen.most_waiting = seen.most_waiting.max(stat.num_waiting_reqs);
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!((a.await.unwrap(), b.await.unwrap()), (200, 200));
    assert_eq!(e.engine().prefilling(0), 0, "every prefill counted out");
    let idle = e.engine().load_stat(0);
    assert_eq!((idle.num_running_reqs, idle.num_waiting_reqs), (0, 0));
    fleet.shutdown().await;
    seen
}

#[tokio::test]
async fn prefill_serial_lets_one_rank_prefill_one_request_at_a_time() {
    assert_eq!(overlap_on_one_rank(true).await.most_prefilling, 1);
}

#[tokio::test]
async fn a_request_waiting_for_its_serial_prefill_turn_is_reported_waiting_not_running() {
    let seen = overlap_on_one_rank(true).await;
    assert_eq!(seen.most_running, 1, "only the prefilling request runs");
    assert_eq!(
        seen.most_waiting, 1,
        "the other is reported waiting for its turn"
    );
}

#[tokio::test]
async fn without_prefill_serial_concurrent_prefills_overlap() {
    let seen = overlap_on_one_rank(false).await;
    assert_eq!(seen.most_prefilling, 2);
    assert_eq!(seen.most_running, 2, "both prefill at once, so both run");
}
