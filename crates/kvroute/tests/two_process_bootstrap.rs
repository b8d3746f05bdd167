//! The scenario peer bootstrap exists for, with real `kvroute` processes: router A serves the two
//! DP ranks of an engine that has stored prefix chains; router B starts later beside it, with
//! `--kv-peers` pointing at A's internal listener, while the engine is quiet (nothing is published
//! after B subscribes). Without bootstrap B would match 0 blocks where A matches them all, and
//! stay blind until the engine publishes again. With it, B settles every rank `warm` and its
//! `/debug/route` matches exactly what A's does. The engines are simulated in the test process
//! (real ZMQ PUB and replay sockets); the routers are the real binary.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// A router process, killed when dropped so a failing test leaves nothing running.
struct RouterProcess {
    child: Child,
    base: String,
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_router(engine_url: &str, extra: &[String]) -> (RouterProcess, u16) {
    let port = free_port();
    let internal = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    cmd.args([
        "--port",
        &port.to_string(),
        "--internal-port",
        &internal.to_string(),
        "--worker-urls",
        &format!("{engine_url}@m"),
        "--health-interval-ms",
        "60000",
    ])
    .args(extra)
    .env("RUST_LOG", "warn")
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let child = cmd.spawn().expect("the kvroute binary starts");
    (
        RouterProcess {
            child,
            base: format!("http://127.0.0.1:{port}"),
        },
        internal,
    )
}

async fn get_json(url: &str) -> Result<Value, String> {
    let resp = client().get(url).send().await.map_err(|e| e.to_string())?;
    resp.json::<Value>().await.map_err(|e| e.to_string())
}

/// Each rank's (dp_rank, matched_blocks) for `prompt`, as the router would route it.
async fn matched(base: &str, prompt: &[u32]) -> Vec<(u64, u64)> {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    let (status, v, _) = post_json(&format!("{base}/debug/route"), &body).await;
    assert_eq!(status, 200, "{v}");
    let mut out: Vec<(u64, u64)> = v["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| {
            (
                r["dp_rank"].as_u64().unwrap(),
                r["index_matched_blocks"].as_u64().unwrap(),
            )
        })
        .collect();
    out.sort_unstable();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_process_started_beside_a_warm_one_matches_like_it_on_a_quiet_engine() {
    let fleet = fleet(1, 2, "m").await;
    let engine = &fleet.engines[0];
    let url = engine.http_url();
    let block = engine.block_size();
    let (a, a_internal) = spawn_router(&url, &[]);
    wait_until("router A to serve", Duration::from_secs(30), || async {
        get_json(&format!("{}/workers", a.base)).await.map(|_| ())
    })
    .await;
    wait_subscribed(&a.base, 2).await;
    // Rank 0 holds a 4-block chain, rank 1 a 2-block chain; A indexes both.
    let prompt: Vec<u32> = (0..(block * 4) as u32).map(|t| 7_000 + t).collect();
    store_until_indexed(&a.base, engine, 0, &prompt, 4).await;
    store_until_indexed(&a.base, engine, 1, &prompt[..block * 2], 2).await;
    let want = matched(&a.base, &prompt).await;
    assert_eq!(want, vec![(0, 4), (1, 2)], "A's view");

    // B starts now; the engine publishes nothing more.
    let (b, _) = spawn_router(
        &url,
        &[
            "--kv-peers".to_string(),
            format!("http://127.0.0.1:{a_internal}"),
        ],
    );
    let outcomes = wait_until(
        "router B to settle both ranks' bootstrap",
        Duration::from_secs(30),
        || async {
            let w = get_json(&format!("{}/workers", b.base)).await?;
            let outcomes: Vec<String> = w["workers"]
                .as_array()
                .ok_or("no workers yet")?
                .iter()
                .flat_map(|w| w["kv_ranks"].as_array().cloned().unwrap_or_default())
                .map(|r| {
                    r["bootstrap"]["outcome"]
                        .as_str()
                        .unwrap_or("-")
                        .to_string()
                })
                .collect();
            if outcomes.len() == 2 && outcomes.iter().all(|o| o != "-") {
                Ok(outcomes)
            } else {
                Err(w.to_string())
            }
        },
    )
    .await;
    assert_eq!(outcomes, ["warm", "warm"], "both splices proven");
    let ready = client()
        .get(format!("{}/readyz", b.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200, "B is ready once both ranks settled");
    assert_eq!(
        matched(&b.base, &prompt).await,
        want,
        "B matches what A matches, without the engine publishing again"
    );
    drop(b);
    drop(a);
    fleet.shutdown().await;
}
