//! Router side of Kubernetes engine discovery: worker edits arriving on a channel are applied to
//! the same registry path as the admin API (registration with model lookup, KV plane attach;
//! removal with KV plane detach), and the `engine_discovery_synced` readiness gate follows the
//! source's first list.
//!
//! The seam is the `mpsc::Receiver<EngineEvent>` (+ sync counter) that `kvroute-discovery`'s pod
//! watcher produces: these tests feed a real channel by hand, against real simulated engines
//! (real HTTP, real ZMQ). The kube watcher itself, which turns Pod list/watch responses into these
//! events, is tested in `kvroute-discovery` against a fake API server; no real API server can run here.

mod common;

use common::*;
use kvroute::control::worker_source::{SYNCED_GATE_NAME, WorkerSource};
use kvroute_discovery::EngineEvent;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

async fn readyz(base: &str) -> (u16, Value) {
    let resp = client().get(format!("{base}/readyz")).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn gate_ok(report: &Value, name: &str) -> Option<bool> {
    report["gates"]
        .as_array()?
        .iter()
        .find(|g| g["name"] == name)
        .and_then(|g| g["ok"].as_bool())
}

fn worker_urls(w: &Value) -> Vec<String> {
    let mut urls: Vec<String> = w["workers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|w| w["url"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    urls.sort();
    urls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovered_engines_are_registered_routed_to_and_detached_when_removed() {
    let fleet = fleet(2, 2, "m").await;
    let (url0, url1) = (fleet.engines[0].http_url(), fleet.engines[1].http_url());
    let (tx, rx) = mpsc::channel(16);
    let (sync_tx, sync_rx) = watch::channel(0u64);
    let source = WorkerSource::from_events("test-channel", vec![], rx, sync_rx);
    let router =
        kvroute::serve_with_workers(router_config(&[]), prometheus::Registry::new(), source)
            .await
            .unwrap();
    let base = router.url();

    let (status, report) = readyz(&base).await;
    assert_eq!(status, 503, "{report}");
    assert_eq!(gate_ok(&report, SYNCED_GATE_NAME), Some(false), "{report}");

    // One engine without a model (the router must ask it), one with the model label's value.
    tx.send(EngineEvent::Added {
        url: url0.clone(),
        model: None,
    })
    .await
    .unwrap();
    tx.send(EngineEvent::Added {
        url: url1.clone(),
        model: Some("m".into()),
    })
    .await
    .unwrap();
    let mut expected = vec![url0.clone(), url1.clone()];
    expected.sort();
    let listed = wait_until(
        "both discovered engines in GET /workers",
        WAIT_DEADLINE,
        || {
            let (base, expected) = (base.clone(), expected.clone());
            async move {
                let w = workers(&base).await;
                if worker_urls(&w) == expected {
                    Ok(w)
                } else {
                    Err(w.to_string())
                }
            }
        },
    )
    .await;
    for w in listed["workers"].as_array().unwrap() {
        assert_eq!(
            w["model"], "m",
            "model asked from the engine or taken from the event: {w}"
        );
        assert_eq!(w["dp_size"], 2, "dp size learned from /server_info: {w}");
    }
    // Workers are in, but the source has not finished its first list: not ready yet.
    let (status, report) = readyz(&base).await;
    assert_eq!(status, 503, "{report}");
    assert_eq!(gate_ok(&report, SYNCED_GATE_NAME), Some(false), "{report}");

    sync_tx.send(1).unwrap();
    wait_until(
        "/readyz to pass once the first list is applied",
        WAIT_DEADLINE,
        || {
            let base = base.clone();
            async move {
                match readyz(&base).await {
                    (200, r) if gate_ok(&r, SYNCED_GATE_NAME) == Some(true) => Ok(()),
                    (s, r) => Err(format!("{s}: {r}")),
                }
            }
        },
    )
    .await;

    // KV plane attached: every rank subscribed, and a prefix stored on engine 1 routes there.
    wait_subscribed(&base, 4).await;
    let block = fleet.engines[1].block_size();
    let prompt: Vec<u32> = (0..(block * 4) as u32).map(|t| 4000 + t).collect();
    store_until_indexed(&base, &fleet.engines[1], 0, &prompt, 4).await;
    let req = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    let (status, body, headers) = post_json(&format!("{base}/v1/completions"), &req).await;
    assert_eq!(status, 200, "{body}");
    let d = decision(&headers);
    assert!(
        d.contains(&format!("url={url1};dp_rank=0;matched_blocks=4")),
        "{d}"
    );
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some((block * 4) as u64),
        "{body}"
    );

    // Removal: once the plane has dropped engine 1's ranks, the registry has dropped the worker
    // too (deregistration removes it from the registry first), and nothing routes there.
    tx.send(EngineEvent::Removed { url: url1.clone() })
        .await
        .unwrap();
    wait_until(
        "engine 1's ranks to leave the KV plane",
        WAIT_DEADLINE,
        || {
            let states = router.router.kv.plane().rank_states();
            let url1 = url1.clone();
            async move {
                let left: Vec<_> = states.iter().filter(|s| s.worker_url == url1).collect();
                if left.is_empty() {
                    Ok(())
                } else {
                    Err(format!("{} ranks of {url1} still in the plane", left.len()))
                }
            }
        },
    )
    .await;
    assert_eq!(worker_urls(&workers(&base).await), vec![url0.clone()]);
    let (_, v, _) = post_json(&format!("{base}/debug/route"), &req).await;
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2, "only engine 0's two ranks remain: {v}");
    assert!(ranks.iter().all(|r| r["url"] == url0.as_str()), "{v}");
    assert_eq!(v["reason"], "cold", "engine 1's blocks left the index: {v}");
    let (status, body, headers) = post_json(&format!("{base}/v1/completions"), &req).await;
    assert_eq!(status, 200, "{body}");
    assert!(decision(&headers).contains(&format!("url={url0};")));

    router.shutdown().await;
    assert!(
        tx.is_closed(),
        "shutdown must stop the consumer of the worker source"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_removed_before_it_ever_answered_is_deregistered_in_event_order() {
    let fleet = fleet(1, 1, "m").await;
    let live = fleet.engines[0].http_url();
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = format!("http://127.0.0.1:{dead_port}");
    let (tx, rx) = mpsc::channel(16);
    let (sync_tx, sync_rx) = watch::channel(0u64);
    let router = kvroute::serve_with_workers(
        router_config(&[]),
        prometheus::Registry::new(),
        WorkerSource::from_events("test-channel", vec![], rx, sync_rx),
    )
    .await
    .unwrap();
    let base = router.url();
    // With a model, an engine that does not answer is registered as pending (as `URL@model` on
    // the command line is), so the removal has something to take out.
    tx.send(EngineEvent::Added {
        url: dead.clone(),
        model: Some("m".into()),
    })
    .await
    .unwrap();
    sync_tx.send(1).unwrap();
    tx.send(EngineEvent::Removed { url: dead.clone() })
        .await
        .unwrap();
    // Edits are applied in order, so once the live engine is listed the removal is done.
    tx.send(EngineEvent::Added {
        url: live.clone(),
        model: None,
    })
    .await
    .unwrap();
    wait_until("the live engine in GET /workers", WAIT_DEADLINE, || {
        let (base, live) = (base.clone(), live.clone());
        async move {
            let w = workers(&base).await;
            if worker_urls(&w).contains(&live) {
                Ok(())
            } else {
                Err(w.to_string())
            }
        }
    })
    .await;
    assert_eq!(worker_urls(&workers(&base).await), vec![live.clone()]);
    // The gate opened after the list although one engine never answered: health is the
    // healthy_worker gate's business, this one only says the list was applied.
    wait_until("/readyz to pass", WAIT_DEADLINE, || {
        let base = base.clone();
        async move {
            match readyz(&base).await {
                (200, _) => Ok(()),
                (s, r) => Err(format!("{s}: {r}")),
            }
        }
    })
    .await;
    router.shutdown().await;
    fleet.shutdown().await;
}
