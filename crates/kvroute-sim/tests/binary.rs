//! The `kvroute-sim` binary as a real process: it prints where it listens, serves, and on
//! SIGTERM finishes the request in flight before exiting 0.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{WAIT_MS, client};
use serde_json::json;

#[tokio::test]
async fn binary_serves_and_drains_in_flight_requests_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args([
            "--port",
            "0",
            "--kv-port-base",
            "0",
            "--replay-port-base",
            "0",
            "--dp-size",
            "2",
            "--decode-us-per-token",
            "30000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("binary starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("address line");
    let url = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http="))
        .unwrap_or_else(|| panic!("no http= in {line:?}"))
        .to_string();
    assert!(line.contains("kv=tcp://127.0.0.1:"), "{line}");

    let (status, info) = {
        let r = client()
            .get(format!("{url}/server_info"))
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().await.unwrap(),
        )
    };
    assert_eq!(
        (status, info["kv_events"]["dp_size"].clone()),
        (200, json!(2))
    );

    // 10 tokens at 30 ms each: ~300 ms in flight when SIGTERM arrives.
    let slow = tokio::spawn({
        let url = url.clone();
        async move {
            client()
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": "drain me", "max_tokens": 10}))
                .send()
                .await
                .map(|r| r.status().as_u16())
        }
    });
    // SIGTERM only once the engine reports the request running (SGLang's /get_load).
    let running = async || {
        let Ok(r) = client().get(format!("{url}/get_load")).send().await else {
            return 0;
        };
        let load: serde_json::Value = r.json().await.unwrap_or_default();
        load.as_array()
            .map(|ranks| {
                ranks
                    .iter()
                    .filter_map(|r| r["num_reqs"].as_u64())
                    .sum::<u64>()
            })
            .unwrap_or(0)
    };
    common::wait_until("the slow request to be running", running, |n| *n == 1).await;
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let answered = tokio::time::timeout(Duration::from_millis(WAIT_MS), slow)
        .await
        .expect("in-flight request answered")
        .unwrap();
    assert_eq!(answered.expect("not cut off"), 200);
    let deadline = std::time::Instant::now() + Duration::from_millis(WAIT_MS);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "binary did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(status.success(), "exit status {status}");
}
