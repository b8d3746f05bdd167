//! The memory a request can make the router hold: eight concurrent maximal bodies (10 MB each, a
//! prompt of about five million one-digit token ids, under the 16 MB body limit) through a real
//! `kvroute` process to a data-parallel engine (the path that adds `data_parallel_rank` to the
//! body). The router's peak resident memory may grow by at most four times the bodies' total
//! size. Measured on the router PROCESS (`/proc/<pid>/status`), so the simulated engines, which
//! run in the test process and parse those bodies too, do not count.
//!
//! The same bound holds for TEXT prompts of that size, which the router would otherwise
//! tokenize at ~170 bytes of memory per byte (8 such bodies took the router to 9 GB): with the
//! model's tokenizer configured they are either refused from their length alone (a prompt-token
//! limit is known, `routing::text_bound`) or, past `--tokenize-text-bytes-max`, routed on load
//! untokenized.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

const BODIES: usize = 8;
const BODY_BYTES: usize = 10 * 1024 * 1024;
const GROWTH_FACTOR_MAX: u64 = 4;

struct RouterProcess(Child);

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `VmRSS` and `VmHWM` (peak) of `pid`, in bytes.
fn rss_and_peak(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// `{"model":"m","prompt":[1,2,...],"max_tokens":1}` of about `bytes` bytes.
fn maximal_body(bytes: usize) -> Vec<u8> {
    let mut body = br#"{"model":"m","max_tokens":1,"prompt":["#.to_vec();
    let mut digit = 0u8;
    while body.len() + 4 < bytes {
        body.push(b'1' + digit % 9);
        body.push(b',');
        digit = digit.wrapping_add(1);
    }
    body.push(b'1');
    body.extend_from_slice(b"]}");
    body
}

/// `{"model":"m","max_tokens":1,"prompt":"ab cd ab cd ..."}` of about `bytes` bytes: the text
/// that costs the tokenizer most per byte (a pre-token every three bytes).
fn maximal_text_body(bytes: usize) -> Vec<u8> {
    let mut body = br#"{"model":"m","max_tokens":1,"prompt":""#.to_vec();
    while body.len() + 8 < bytes {
        body.extend_from_slice(b"ab cd ");
    }
    body.extend_from_slice(b"\"}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_maximal_bodies_grow_the_router_by_at_most_four_times_their_size() {
    eight_concurrent_bodies_within_the_growth_bound(maximal_body(BODY_BYTES), &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_maximal_text_prompts_past_the_tokenizing_cap_are_routed_untokenized_within_the_bound()
 {
    let tokenizer = format!("m={}", common::tokenizer_path().display());
    let answered = eight_concurrent_bodies_within_the_growth_bound(
        maximal_text_body(BODY_BYTES),
        &["--model-tokenizer", &tokenizer],
    )
    .await;
    assert!(
        answered.untokenized >= (BODIES + 1) as u64,
        "every text past the cap is counted untokenized: {answered:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_maximal_text_prompts_over_the_token_limit_are_refused_before_tokenizing() {
    let tokenizer = format!("m={}", common::tokenizer_path().display());
    let answered = eight_concurrent_bodies_within_the_growth_bound(
        maximal_text_body(BODY_BYTES),
        &[
            "--model-tokenizer",
            &tokenizer,
            "--max-prompt-tokens",
            "32768",
        ],
    )
    .await;
    assert_eq!(answered.status, 400, "{answered:?}");
    assert!(
        answered.body.contains("at least") && answered.body.contains("context_length_exceeded"),
        "refused from the text's length, not from a token count: {answered:?}"
    );
    assert_eq!(answered.untokenized, 0, "{answered:?}");
}

#[derive(Debug)]
struct Answered {
    status: u16,
    body: String,
    /// `kvroute_untokenized_prompts_total{reason="text_too_long"}` after the run.
    untokenized: u64,
}

/// Sends `body` once, then eight times at once, to a `kvroute` process started with `extra`
/// flags; asserts every answer has the first one's status and the router's peak RSS grew by
/// at most [`GROWTH_FACTOR_MAX`] times the eight bodies' size.
async fn eight_concurrent_bodies_within_the_growth_bound(
    body: Vec<u8>,
    extra: &[&str],
) -> Answered {
    // The engine takes the whole body (its own limit is raised above it) and refuses the prompt
    // as too long for it: the router does all its work, and every answer is the same.
    let fleet = kvroute_sim::start_fleet(kvroute_sim::SimConfig {
        engines: 1,
        dp_size: 2,
        served_model_name: "m".into(),
        max_body_bytes: 4 * BODY_BYTES,
        ..kvroute_sim::SimConfig::for_tests()
    })
    .await
    .expect("fleet starts");
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "--port",
            &port.to_string(),
            "--internal-port",
            &free_port().to_string(),
            "--worker-urls",
            &format!("{}@m", fleet.engines[0].http_url()),
            "--health-interval-ms",
            "60000",
            "--data-plane-threads",
            "2",
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the kvroute binary starts");
    let router = RouterProcess(child);
    let pid = router.0.id();
    let base = format!("http://127.0.0.1:{port}");
    wait_until(
        "the router to be ready",
        Duration::from_secs(30),
        || async {
            match client().get(format!("{base}/readyz")).send().await {
                Ok(r) if r.status() == 200 => Ok(()),
                Ok(r) => Err(format!("readyz {}", r.status())),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    let body = bytes::Bytes::from(body);
    // One request first, so what the first request allocates once (pools, caches) is in the
    // baseline rather than counted as growth.
    let http = client();
    let warm = http
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .expect("the warm-up request is answered");
    let warm_status = warm.status();
    let warm_body = String::from_utf8_lossy(&warm.bytes().await.unwrap_or_default()).into_owned();
    let (before, peak_before) = rss_and_peak(pid);
    let mut sends = tokio::task::JoinSet::new();
    for _ in 0..BODIES {
        let (http, url, body) = (http.clone(), format!("{base}/v1/completions"), body.clone());
        sends.spawn(async move {
            let resp = http
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let status = resp.status();
            let _ = resp.bytes().await;
            Ok::<_, String>(status)
        });
    }
    let mut statuses = Vec::new();
    while let Some(done) = sends.join_next().await {
        statuses.push(done.expect("task").expect("every body is answered"));
    }
    let (_, peak) = rss_and_peak(pid);
    let growth = peak.saturating_sub(before.max(peak_before));
    let total = (BODIES * body.len()) as u64;
    assert!(
        statuses.iter().all(|s| *s == warm_status),
        "every request answered like the first ({warm_status}): {statuses:?}"
    );
    assert!(
        growth <= GROWTH_FACTOR_MAX * total,
        "peak RSS grew by {} MB for {} MB of bodies (RSS before {} MB, peak before {} MB, peak {} MB)",
        growth >> 20,
        total >> 20,
        before >> 20,
        peak_before >> 20,
        peak >> 20
    );
    println!(
        "router peak RSS growth {} MB for {BODIES} x {} MB bodies ({:.2}x); answered {warm_status}",
        growth >> 20,
        body.len() >> 20,
        growth as f64 / total as f64
    );
    let untokenized = metric_value(&metrics_text(&base).await, UNTOKENIZED_TEXT_TOO_LONG)
        .map_or(0, |v| v.parse::<u64>().expect("a counter"));
    drop(router);
    fleet.shutdown().await;
    Answered {
        status: warm_status.as_u16(),
        body: warm_body,
        untokenized,
    }
}
