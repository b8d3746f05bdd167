//! Engine pod discovery end to end: the real kube-rs client and watcher and our source task,
//! against the fake API server in `support` serving `/api/v1/namespaces/{ns}/pods`.
//!
//! NO REAL API SERVER IS USED: none can run on these machines (see `support`'s module doc for
//! what the fake reproduces and what it leaves out). There is no kubelet either, so each test
//! writes the pod status (phase, IP, Ready condition) a kubelet would report.
//!
//! "Nothing else was emitted" is proven without sleeping: the source bumps its sync counter
//! only after queueing every edit a (re)list caused, and a live watch delivers events in
//! order, so an event for a later "sentinel" pod proves no event came for the earlier change.

#![cfg(feature = "k8s")]

mod support;

use std::time::Duration;

use kvroute_discovery::{
    DEFAULT_ENGINE_PORT, ENGINE_PORT_ANNOTATION, EngineDiscoveryConfig, EngineDiscoveryHandle,
    EngineEvent, engine_discovery_client, spawn_engine_discovery,
};
use support::{
    FakeApiServer, RequestKind, annotated, deleting, engine_pod, labelled, not_ready, pending,
    wait_until,
};
use tokio::sync::mpsc::Receiver;
use tokio::sync::mpsc::error::TryRecvError;

const NS: &str = "inference";
const APP: (&str, &str) = ("app", "llm-engine");
const MODEL_LABEL: &str = "kvroute.io/model";
const WAIT_DEADLINE_MS: u64 = 15_000;

fn config() -> EngineDiscoveryConfig {
    EngineDiscoveryConfig {
        label_selector: "app=llm-engine".to_string(),
        namespace: NS.to_string(),
        default_port: DEFAULT_ENGINE_PORT,
        model_label: None,
    }
}

async fn start(
    fake: &FakeApiServer,
    cfg: EngineDiscoveryConfig,
) -> (EngineDiscoveryHandle, Receiver<EngineEvent>) {
    let client = engine_discovery_client(Some(&fake.url))
        .await
        .expect("kube client against the fake API server");
    spawn_engine_discovery(cfg, client)
}

fn url(ip: &str) -> String {
    format!("http://{ip}:{DEFAULT_ENGINE_PORT}")
}

fn added(ip: &str) -> EngineEvent {
    EngineEvent::Added {
        url: url(ip),
        model: None,
    }
}

fn removed(ip: &str) -> EngineEvent {
    EngineEvent::Removed { url: url(ip) }
}

/// Waits until the source has completed at least `n` (re)lists.
async fn wait_syncs(handle: &EngineDiscoveryHandle, n: u64, what: &str) {
    let mut syncs = handle.syncs();
    let outcome = tokio::time::timeout(
        Duration::from_millis(WAIT_DEADLINE_MS),
        syncs.wait_for(|s| *s >= n),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    if !outcome {
        panic!(
            "timed out after {WAIT_DEADLINE_MS} ms waiting for {what} ({n} completed lists); saw {}",
            *syncs.borrow()
        );
    }
}

/// Everything queued right now.
fn drain(rx: &mut Receiver<EngineEvent>) -> Vec<EngineEvent> {
    let mut out = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(e) => out.push(e),
            Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return out,
        }
    }
}

async fn next_event(rx: &mut Receiver<EngineEvent>, what: &str) -> EngineEvent {
    match tokio::time::timeout(Duration::from_millis(WAIT_DEADLINE_MS), rx.recv()).await {
        Ok(Some(e)) => e,
        Ok(None) => panic!("waiting for {what}: the event stream ended"),
        Err(_) => panic!("timed out after {WAIT_DEADLINE_MS} ms waiting for {what}; no event"),
    }
}

async fn wait_watch_open(fake: &FakeApiServer, watches_before: usize) {
    wait_until("a (new) pod watch to be open", || {
        let n = fake.request_count(RequestKind::Watch);
        (n <= watches_before || fake.open_watches() == 0).then(|| {
            format!(
                "{n} watch requests (need > {watches_before}), {} open",
                fake.open_watches()
            )
        })
    })
    .await;
}

#[tokio::test]
async fn initial_list_adds_only_running_ready_undeleted_selected_pods() {
    let fake = FakeApiServer::start().await;
    fake.apply(&engine_pod(NS, "engine-a", "10.1.0.1", &[APP]));
    fake.apply(&not_ready(engine_pod(NS, "engine-b", "10.1.0.2", &[APP])));
    fake.apply(&pending(engine_pod(NS, "engine-c", "10.1.0.3", &[APP])));
    fake.apply(&deleting(engine_pod(NS, "engine-d", "10.1.0.4", &[APP])));
    fake.apply(&engine_pod(NS, "engine-e", "10.1.0.5", &[APP]));
    // Not selected: another app in the namespace, and the same app in another namespace.
    fake.apply(&engine_pod(
        NS,
        "router-x",
        "10.1.0.8",
        &[("app", "router")],
    ));
    fake.apply(&engine_pod("other", "engine-y", "10.1.0.9", &[APP]));
    let (handle, mut rx) = start(&fake, config()).await;
    wait_syncs(&handle, 1, "the initial list").await;
    assert_eq!(drain(&mut rx), [added("10.1.0.1"), added("10.1.0.5")]);
    let list = &fake.requests()[0];
    assert_eq!(list.0, RequestKind::List);
    assert!(
        list.1.starts_with("/api/v1/namespaces/inference/pods?")
            && list.1.contains("labelSelector=app%3Dllm-engine"),
        "list request did not target the namespace's pods with the selector: {}",
        list.1
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn readiness_changes_add_and_remove_workers_live() {
    let fake = FakeApiServer::start().await;
    fake.apply(&pending(engine_pod(NS, "engine-a", "10.1.0.1", &[APP])));
    let (handle, mut rx) = start(&fake, config()).await;
    wait_syncs(&handle, 1, "the initial list").await;
    assert_eq!(drain(&mut rx), [], "a pending pod is no worker");
    wait_watch_open(&fake, 0).await;

    // Started but the readiness probe has not passed yet: still nothing, then Ready adds it.
    fake.apply(&not_ready(engine_pod(NS, "engine-a", "10.1.0.1", &[APP])));
    fake.apply(&engine_pod(NS, "engine-a", "10.1.0.1", &[APP]));
    assert_eq!(
        next_event(&mut rx, "engine-a to become ready").await,
        added("10.1.0.1")
    );
    fake.apply(&not_ready(engine_pod(NS, "engine-a", "10.1.0.1", &[APP])));
    assert_eq!(
        next_event(&mut rx, "engine-a to fail its probe").await,
        removed("10.1.0.1")
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn deletion_removes_the_worker_once_whether_graceful_or_not() {
    let fake = FakeApiServer::start().await;
    fake.apply(&engine_pod(NS, "engine-a", "10.1.0.1", &[APP]));
    fake.apply(&engine_pod(NS, "engine-b", "10.1.0.2", &[APP]));
    let (handle, mut rx) = start(&fake, config()).await;
    wait_syncs(&handle, 1, "the initial list").await;
    assert_eq!(drain(&mut rx), [added("10.1.0.1"), added("10.1.0.2")]);
    wait_watch_open(&fake, 0).await;

    // Graceful: deletionTimestamp while still Ready removes it; the final DELETED is silent.
    fake.apply(&deleting(engine_pod(NS, "engine-a", "10.1.0.1", &[APP])));
    assert_eq!(
        next_event(&mut rx, "engine-a to start terminating").await,
        removed("10.1.0.1")
    );
    fake.delete_pod(NS, "engine-a");
    // Immediate deletion (no graceful phase seen): DELETED removes it.
    fake.delete_pod(NS, "engine-b");
    assert_eq!(
        next_event(&mut rx, "engine-b to be deleted").await,
        removed("10.1.0.2"),
        "the DELETED of an already removed pod must emit nothing"
    );
    fake.apply(&engine_pod(NS, "engine-z", "10.1.0.26", &[APP]));
    assert_eq!(
        next_event(&mut rx, "the sentinel pod").await,
        added("10.1.0.26")
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn pods_outside_the_selector_or_namespace_are_never_workers() {
    let fake = FakeApiServer::start().await;
    let cfg = EngineDiscoveryConfig {
        label_selector: "app=llm-engine,tier=gpu,!canary".to_string(),
        ..config()
    };
    let (handle, mut rx) = start(&fake, cfg).await;
    wait_syncs(&handle, 1, "the initial (empty) list").await;
    assert_eq!(drain(&mut rx), []);
    wait_watch_open(&fake, 0).await;

    let gpu = [APP, ("tier", "gpu")];
    fake.apply(&engine_pod(
        NS,
        "cpu-engine",
        "10.1.0.1",
        &[APP, ("tier", "cpu")],
    ));
    fake.apply(&labelled(
        engine_pod(NS, "canary-engine", "10.1.0.2", &gpu),
        "canary",
        "true",
    ));
    fake.apply(&engine_pod(NS, "router", "10.1.0.3", &[("app", "router")]));
    fake.apply(&engine_pod("staging", "staging-engine", "10.1.0.4", &gpu));
    fake.apply(&engine_pod(NS, "gpu-engine", "10.1.0.5", &gpu));
    assert_eq!(
        next_event(&mut rx, "the one selected pod").await,
        added("10.1.0.5"),
        "an unselected pod leaked through before the selected one"
    );
    let watch = fake
        .requests()
        .into_iter()
        .find(|(k, _)| *k == RequestKind::Watch)
        .unwrap()
        .1;
    assert!(
        watch.contains("labelSelector=app%3Dllm-engine%2Ctier%3Dgpu%2C%21canary"),
        "watch request did not carry the selector: {watch}"
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn relabelling_a_pod_out_of_the_selector_removes_it_and_back_adds_it() {
    let fake = FakeApiServer::start().await;
    fake.apply(&engine_pod(NS, "engine-a", "10.1.0.1", &[APP]));
    let (handle, mut rx) = start(&fake, config()).await;
    wait_syncs(&handle, 1, "the initial list").await;
    assert_eq!(drain(&mut rx), [added("10.1.0.1")]);
    wait_watch_open(&fake, 0).await;

    // An operator takes the engine out of rotation by changing its app label; the server
    // tells a selector watch about that as DELETED.
    fake.apply(&engine_pod(
        NS,
        "engine-a",
        "10.1.0.1",
        &[("app", "drained")],
    ));
    assert_eq!(
        next_event(&mut rx, "engine-a to leave the selector").await,
        removed("10.1.0.1")
    );
    fake.apply(&engine_pod(NS, "engine-a", "10.1.0.1", &[APP]));
    assert_eq!(
        next_event(&mut rx, "engine-a to re-enter the selector").await,
        added("10.1.0.1")
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn gone_410_relist_emits_only_what_changed_while_the_watch_was_down() {
    let fake = FakeApiServer::start().await;
    for (name, ip) in [
        ("engine-a", "10.1.0.1"),
        ("engine-b", "10.1.0.2"),
        ("engine-c", "10.1.0.3"),
    ] {
        fake.apply(&engine_pod(NS, name, ip, &[APP]));
    }
    let (handle, mut rx) = start(&fake, config()).await;
    wait_syncs(&handle, 1, "the initial list").await;
    assert_eq!(
        drain(&mut rx),
        [added("10.1.0.1"), added("10.1.0.2"), added("10.1.0.3")]
    );
    wait_watch_open(&fake, 0).await;
    let lists_before = fake.request_count(RequestKind::List);

    // Missed while the watch is "down", and compacted away so it cannot be replayed: a gets
    // an unrelated annotation (no change for us), b is deleted, c turns unready, d appears.
    fake.apply_unheard(&annotated(
        engine_pod(NS, "engine-a", "10.1.0.1", &[APP]),
        "checked",
        "yes",
    ));
    fake.delete_pod_unheard(NS, "engine-b");
    fake.apply_unheard(&not_ready(engine_pod(NS, "engine-c", "10.1.0.3", &[APP])));
    fake.apply_unheard(&engine_pod(NS, "engine-d", "10.1.0.4", &[APP]));
    fake.compact();
    let watches_before = fake.request_count(RequestKind::Watch);
    fake.expire_watches();

    wait_syncs(&handle, 2, "the relist after 410").await;
    assert!(
        fake.request_count(RequestKind::List) > lists_before,
        "410 must force a relist: {:?}",
        fake.requests()
    );
    assert_eq!(
        drain(&mut rx),
        [removed("10.1.0.2"), removed("10.1.0.3"), added("10.1.0.4")],
        "a relist must emit exactly the differences (nothing for unchanged engine-a)"
    );

    // A relist that finds nothing changed emits nothing at all.
    wait_watch_open(&fake, watches_before).await;
    fake.compact();
    fake.expire_watches();
    wait_syncs(&handle, 3, "the second relist after 410").await;
    assert_eq!(drain(&mut rx), [], "an unchanged relist emitted edits");
    handle.shutdown().await;
}

#[tokio::test]
async fn port_annotation_and_model_label_shape_the_worker() {
    let fake = FakeApiServer::start().await;
    let cfg = EngineDiscoveryConfig {
        model_label: Some(MODEL_LABEL.to_string()),
        ..config()
    };
    fake.apply(&labelled(
        annotated(
            engine_pod(NS, "engine-a", "10.1.0.1", &[APP]),
            ENGINE_PORT_ANNOTATION,
            "30001",
        ),
        MODEL_LABEL,
        "llama-3-8b",
    ));
    fake.apply(&engine_pod(NS, "engine-b", "fd00::2", &[APP]));
    fake.apply(&annotated(
        engine_pod(NS, "engine-c", "10.1.0.3", &[APP]),
        ENGINE_PORT_ANNOTATION,
        "eighty",
    ));
    let (handle, mut rx) = start(&fake, cfg).await;
    wait_syncs(&handle, 1, "the initial list").await;
    assert_eq!(
        drain(&mut rx),
        [
            EngineEvent::Added {
                url: "http://10.1.0.1:30001".to_string(),
                model: Some("llama-3-8b".to_string()),
            },
            EngineEvent::Added {
                url: "http://[fd00::2]:8000".to_string(),
                model: None,
            },
        ],
        "annotation port, model label, IPv6 brackets; a bad port annotation excludes the pod"
    );
    wait_watch_open(&fake, 0).await;

    // Relabelling a pod to serve another model moves it between model groups.
    fake.apply(&labelled(
        engine_pod(NS, "engine-b", "fd00::2", &[APP]),
        MODEL_LABEL,
        "qwen-7b",
    ));
    assert_eq!(
        next_event(&mut rx, "engine-b's old model to go").await,
        EngineEvent::Removed {
            url: "http://[fd00::2]:8000".to_string()
        }
    );
    assert_eq!(
        next_event(&mut rx, "engine-b under its new model").await,
        EngineEvent::Added {
            url: "http://[fd00::2]:8000".to_string(),
            model: Some("qwen-7b".to_string()),
        }
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn forbidden_lists_emit_nothing_until_rbac_is_fixed() {
    let fake = FakeApiServer::start().await;
    fake.apply(&engine_pod(NS, "engine-a", "10.1.0.1", &[APP]));
    fake.set_forbidden(true);
    let (handle, mut rx) = start(&fake, config()).await;
    wait_until("the source to retry a forbidden list", || {
        let n = fake.request_count(RequestKind::List);
        (n < 2).then(|| format!("{n} list requests"))
    })
    .await;
    assert_eq!(
        *handle.syncs().borrow(),
        0,
        "a 403 list must not count as synced"
    );
    assert_eq!(drain(&mut rx), []);
    fake.set_forbidden(false);
    wait_syncs(&handle, 1, "recovery after 403").await;
    assert_eq!(drain(&mut rx), [added("10.1.0.1")]);
    handle.shutdown().await;
}

#[tokio::test]
async fn shutting_down_the_source_ends_the_event_stream() {
    let fake = FakeApiServer::start().await;
    let (handle, mut rx) = start(&fake, config()).await;
    wait_syncs(&handle, 1, "the initial list").await;
    handle.shutdown().await;
    assert_eq!(
        next_event_or_end(&mut rx).await,
        None,
        "the receiver must see the end of the stream once the source stopped"
    );
}

async fn next_event_or_end(rx: &mut Receiver<EngineEvent>) -> Option<EngineEvent> {
    tokio::time::timeout(Duration::from_millis(WAIT_DEADLINE_MS), rx.recv())
        .await
        .expect("the stream neither ended nor produced an event")
}
