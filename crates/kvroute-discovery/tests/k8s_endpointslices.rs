//! The Kubernetes peer source end to end: the real kube-rs client and watcher, our source
//! task and registry, against the fake API server in `support` (NO real API server: none
//! can run on these machines; see `support`'s module doc for what the fake reproduces).
//! Every state change is awaited on the registry's watch channel with a deadline.

#![cfg(feature = "k8s")]

mod support;

use kvroute_discovery::{
    KubernetesPeers, PeerRegistry, PeerSnapshot, PeerSourceConfig, PeerSourceHandle,
    spawn_peer_source,
};
use support::{Ep, FakeApiServer, RequestKind, slice, urls, wait_for_state, wait_until};

const NS: &str = "prod";
const SVC: &str = "kvroute-internal";

fn config(fake: &FakeApiServer) -> KubernetesPeers {
    KubernetesPeers {
        namespace: Some(NS.to_string()),
        pod_name: Some("kvroute-me".to_string()),
        pod_ip: Some("10.0.0.99".parse().unwrap()),
        api_server_url: Some(fake.url.clone()),
        ..KubernetesPeers::new(format!("kubernetes.io/service-name={SVC}"))
    }
}

async fn start(fake: &FakeApiServer) -> (PeerRegistry, PeerSourceHandle) {
    let registry = PeerRegistry::new();
    let handle = spawn_peer_source(PeerSourceConfig::Kubernetes(config(fake)), registry.clone())
        .await
        .expect("kube client against the fake API server");
    (registry, handle)
}

fn peer(ip: &str) -> String {
    format!("http://{ip}:8081")
}

/// Records every state the registry publishes, so a test can prove what was never shown.
fn record_history(registry: &PeerRegistry) -> tokio::sync::watch::Receiver<Vec<PeerSnapshot>> {
    let mut rx = registry.subscribe();
    let (tx, out) = tokio::sync::watch::channel(vec![rx.borrow_and_update().clone()]);
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let s = rx.borrow_and_update().clone();
            tx.send_modify(|h| h.push(s));
        }
    });
    out
}

#[tokio::test]
async fn initial_list_fills_the_registry_and_marks_it_synced() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[Ep::ready("10.0.0.1", "kvroute-a")],
    ));
    fake.apply(&slice(
        NS,
        SVC,
        "s-2",
        &[
            Ep::ready("10.0.0.2", "kvroute-b"),
            Ep::ready("10.0.0.3", "kvroute-c"),
        ],
    ));
    // Slices of another Service and of another namespace must not count.
    fake.apply(&slice(
        NS,
        "engines",
        "e-1",
        &[Ep::ready("10.9.0.1", "engine-a")],
    ));
    fake.apply(&slice(
        "other",
        SVC,
        "s-x",
        &[Ep::ready("10.8.0.1", "kvroute-x")],
    ));
    let registry = PeerRegistry::new();
    assert!(
        !registry.is_synced(),
        "a registry no source has fed is not synced"
    );
    let handle = spawn_peer_source(
        PeerSourceConfig::Kubernetes(config(&fake)),
        registry.clone(),
    )
    .await
    .unwrap();
    let s = wait_for_state(&mut registry.subscribe(), "the initial list", |s| s.synced).await;
    assert_eq!(
        urls(&s),
        [peer("10.0.0.1"), peer("10.0.0.2"), peer("10.0.0.3")]
    );
    assert!(s.ever_had_peers && !s.known_to_have_no_peers());
    let list = &fake.requests()[0];
    assert_eq!(list.0, RequestKind::List);
    assert!(
        list.1
            .contains("labelSelector=kubernetes.io%2Fservice-name%3Dkvroute-internal"),
        "list request did not carry the selector: {}",
        list.1
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn added_modified_and_deleted_slices_update_the_registry() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[Ep::ready("10.0.0.1", "kvroute-a")],
    ));
    let (registry, handle) = start(&fake).await;
    let mut rx = registry.subscribe();
    wait_for_state(&mut rx, "the initial list", |s| s.synced).await;
    wait_until("the watch to be open", || {
        (fake.open_watches() == 0).then(|| "no open watch".to_string())
    })
    .await;

    fake.apply(&slice(
        NS,
        SVC,
        "s-2",
        &[Ep::ready("10.0.0.2", "kvroute-b")],
    ));
    let s = wait_for_state(&mut rx, "ADDED s-2", |s| s.peers.len() == 2).await;
    assert_eq!(urls(&s), [peer("10.0.0.1"), peer("10.0.0.2")]);

    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[
            Ep::ready("10.0.0.1", "kvroute-a"),
            Ep::ready("10.0.0.4", "kvroute-d"),
        ],
    ));
    let s = wait_for_state(&mut rx, "MODIFIED s-1", |s| s.peers.len() == 3).await;
    assert_eq!(
        urls(&s),
        [peer("10.0.0.1"), peer("10.0.0.2"), peer("10.0.0.4")]
    );

    fake.delete(NS, "s-2");
    let s = wait_for_state(&mut rx, "DELETED s-2", |s| s.peers.len() == 2).await;
    assert_eq!(urls(&s), [peer("10.0.0.1"), peer("10.0.0.4")]);
    handle.shutdown().await;
}

#[tokio::test]
async fn not_ready_and_terminating_endpoints_are_not_peers() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[
            Ep::ready("10.0.0.1", "kvroute-a"),
            Ep::ready("10.0.0.2", "kvroute-b").not_ready(),
            Ep::ready("10.0.0.3", "kvroute-c").terminating(),
        ],
    ));
    let (registry, handle) = start(&fake).await;
    let mut rx = registry.subscribe();
    let s = wait_for_state(&mut rx, "the initial list", |s| s.synced).await;
    assert_eq!(urls(&s), [peer("10.0.0.1")]);

    // b becomes ready, a starts terminating (a rolling update): the set follows.
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[
            Ep::ready("10.0.0.1", "kvroute-a").terminating(),
            Ep::ready("10.0.0.2", "kvroute-b"),
            Ep::ready("10.0.0.3", "kvroute-c").terminating(),
        ],
    ));
    let s = wait_for_state(&mut rx, "b ready and a terminating", |s| {
        s.peers.iter().any(|p| p.as_str() == "http://10.0.0.2:8081")
    })
    .await;
    assert_eq!(urls(&s), [peer("10.0.0.2")]);
    handle.shutdown().await;
}

#[tokio::test]
async fn this_pod_is_excluded_by_target_ref_and_by_pod_ip() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[
            Ep::ready("10.0.0.1", "kvroute-a"),
            Ep::ready("10.0.0.50", "kvroute-me"),
            Ep::ready("10.0.0.99", "renamed-but-same-ip"),
        ],
    ));
    let (registry, handle) = start(&fake).await;
    let s = wait_for_state(&mut registry.subscribe(), "the initial list", |s| s.synced).await;
    assert_eq!(urls(&s), [peer("10.0.0.1")]);
    handle.shutdown().await;
}

#[tokio::test]
async fn gone_410_relists_without_ever_publishing_a_partial_or_empty_set() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[Ep::ready("10.0.0.1", "kvroute-a")],
    ));
    fake.apply(&slice(
        NS,
        SVC,
        "s-2",
        &[Ep::ready("10.0.0.2", "kvroute-b")],
    ));
    let (registry, handle) = start(&fake).await;
    let history = record_history(&registry);
    let mut rx = registry.subscribe();
    let before = wait_for_state(&mut rx, "the initial list", |s| s.synced).await;
    assert_eq!(urls(&before), [peer("10.0.0.1"), peer("10.0.0.2")]);
    wait_until("the watch to be open", || {
        (fake.open_watches() == 0).then(|| "no open watch".to_string())
    })
    .await;
    let lists_before = fake.request_count(RequestKind::List);

    // While the watch "misses" them: s-1 goes away, s-2 changes, s-3 appears; history is
    // compacted so they cannot be replayed, and the open watch gets ERROR 410.
    fake.delete_unheard(NS, "s-1");
    fake.apply_unheard(&slice(
        NS,
        SVC,
        "s-2",
        &[
            Ep::ready("10.0.0.2", "kvroute-b"),
            Ep::ready("10.0.0.5", "kvroute-e"),
        ],
    ));
    fake.apply_unheard(&slice(
        NS,
        SVC,
        "s-3",
        &[Ep::ready("10.0.0.6", "kvroute-f")],
    ));
    fake.compact();
    fake.expire_watches();

    let after = [peer("10.0.0.2"), peer("10.0.0.5"), peer("10.0.0.6")];
    let s = wait_for_state(&mut rx, "the relisted set", |s| urls(s) == after).await;
    assert!(
        fake.request_count(RequestKind::List) > lists_before,
        "410 must force a relist"
    );

    // The recorder may lag the registry by a wake-up; wait until it has seen the final state.
    let mut history = history;
    let seen = tokio::time::timeout(
        std::time::Duration::from_secs(15),
        history.wait_for(|h| h.last().is_some_and(|l| l.version == s.version)),
    )
    .await
    .expect("recorder to catch up with the registry")
    .unwrap()
    .clone();
    let versions: Vec<u64> = seen.iter().map(|s| s.version).collect();
    let contiguous = versions.windows(2).all(|w| w[1] == w[0] + 1);
    assert!(
        contiguous,
        "recorder missed publications: versions {versions:?}"
    );
    for state in seen.iter().filter(|s| s.synced) {
        let u = urls(state);
        assert!(
            u == urls(&before) || u == after,
            "the registry published an intermediate set during the relist: {u:?} (all: {seen:?})"
        );
        assert!(
            !state.peers.is_empty(),
            "the registry published an empty set"
        );
    }
    handle.shutdown().await;
}

#[tokio::test]
async fn closed_watch_stream_is_rewatched_from_the_last_version_without_relisting() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[Ep::ready("10.0.0.1", "kvroute-a")],
    ));
    let (registry, handle) = start(&fake).await;
    let mut rx = registry.subscribe();
    wait_for_state(&mut rx, "the initial list", |s| s.synced).await;
    wait_until("the first watch", || {
        let n = fake.request_count(RequestKind::Watch);
        (n < 1 || fake.open_watches() == 0).then(|| format!("{n} watch requests"))
    })
    .await;

    fake.close_watches();
    wait_until("a second watch request", || {
        let n = fake.request_count(RequestKind::Watch);
        (n < 2 || fake.open_watches() == 0).then(|| format!("{n} watch requests"))
    })
    .await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-2",
        &[Ep::ready("10.0.0.2", "kvroute-b")],
    ));
    let s = wait_for_state(&mut rx, "ADDED after the re-watch", |s| s.peers.len() == 2).await;
    assert_eq!(urls(&s), [peer("10.0.0.1"), peer("10.0.0.2")]);
    assert_eq!(
        fake.request_count(RequestKind::List),
        1,
        "a cleanly closed watch must resume, not relist: {:?}",
        fake.requests()
    );
    let rewatch = fake
        .requests()
        .into_iter()
        .filter(|(k, _)| *k == RequestKind::Watch)
        .nth(1)
        .unwrap()
        .1;
    assert!(
        rewatch.contains("resourceVersion=") && !rewatch.contains("resourceVersion=0&"),
        "re-watch must resume from the last version: {rewatch}"
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn bookmarks_move_the_resume_point_without_changing_the_set() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[Ep::ready("10.0.0.1", "kvroute-a")],
    ));
    let (registry, handle) = start(&fake).await;
    let mut rx = registry.subscribe();
    let first = wait_for_state(&mut rx, "the initial list", |s| s.synced).await;
    wait_until("the watch to be open", || {
        (fake.open_watches() == 0).then(|| "no open watch".to_string())
    })
    .await;
    // An unrelated Service's slice moves the store's version; a bookmark reports it.
    fake.apply(&slice(
        NS,
        "engines",
        "e-1",
        &[Ep::ready("10.9.0.1", "engine-a")],
    ));
    fake.bookmark();
    fake.compact();
    fake.close_watches();
    // The re-watch starts from the bookmarked version, which is not compacted: no relist.
    fake.apply(&slice(
        NS,
        SVC,
        "s-2",
        &[Ep::ready("10.0.0.2", "kvroute-b")],
    ));
    let s = wait_for_state(&mut rx, "ADDED after a bookmarked re-watch", |s| {
        s.peers.len() == 2
    })
    .await;
    assert_eq!(s.version, first.version + 1);
    assert_eq!(
        fake.request_count(RequestKind::List),
        1,
        "resuming from a bookmark must not relist: {:?}",
        fake.requests()
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn selector_matching_nothing_is_synced_and_alone_until_a_sibling_appears() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        "engines",
        "e-1",
        &[Ep::ready("10.9.0.1", "engine-a")],
    ));
    fake.apply(&slice(
        NS,
        SVC,
        "s-me",
        &[Ep::ready("10.0.0.99", "kvroute-me")],
    ));
    let (registry, handle) = start(&fake).await;
    let mut rx = registry.subscribe();
    let s = wait_for_state(&mut rx, "the initial list", |s| s.synced).await;
    assert!(
        s.known_to_have_no_peers(),
        "only this pod is selected: synced, empty, never had peers: {s:?}"
    );
    wait_until("the watch to be open", || {
        (fake.open_watches() == 0).then(|| "no open watch".to_string())
    })
    .await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-2",
        &[Ep::ready("10.0.0.2", "kvroute-b")],
    ));
    wait_for_state(&mut rx, "a sibling to appear", |s| s.peers.len() == 1).await;
    fake.delete(NS, "s-2");
    let s = wait_for_state(&mut rx, "the sibling to leave", |s| s.peers.is_empty()).await;
    assert!(s.synced && s.ever_had_peers);
    assert!(
        !s.known_to_have_no_peers(),
        "empty after having had peers is not conclusive"
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn forbidden_lists_leave_the_registry_unsynced_and_the_source_retrying() {
    let fake = FakeApiServer::start().await;
    fake.apply(&slice(
        NS,
        SVC,
        "s-1",
        &[Ep::ready("10.0.0.1", "kvroute-a")],
    ));
    fake.set_forbidden(true);
    let (registry, handle) = start(&fake).await;
    wait_until("the source to retry a forbidden list", || {
        let n = fake.request_count(RequestKind::List);
        (n < 2).then(|| format!("{n} list requests"))
    })
    .await;
    assert!(
        !registry.is_synced(),
        "403 answers must not look like an empty fleet"
    );
    // Once RBAC is fixed the same source recovers by itself.
    fake.set_forbidden(false);
    let s = wait_for_state(&mut registry.subscribe(), "recovery after 403", |s| {
        s.synced
    })
    .await;
    assert_eq!(urls(&s), [peer("10.0.0.1")]);
    handle.shutdown().await;
}
