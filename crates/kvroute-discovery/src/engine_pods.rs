//! The Pod watch behind engine discovery (needs the `k8s` feature): which pod is a worker
//! ([`engine_of_pod`]), the relist-buffering set that turns watch events into worker edits, and
//! the task that runs the kube-rs watcher. The rules it applies are stated in [`crate::engines`].

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::config::KubeClientError;
use crate::engines::{
    DiscoveredEngine, ENGINE_EVENT_CHANNEL_CAPACITY, ENGINE_PORT_ANNOTATION, EngineDiscoveryConfig,
    EngineDiscoveryHandle, EngineEvent, TRACKED_ENGINE_PODS_MAX, echo,
};

/// The worker `pod` is under `cfg`, or `None` when it must not receive requests.
pub fn engine_of_pod(pod: &Pod, cfg: &EngineDiscoveryConfig) -> Option<DiscoveredEngine> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.trim().parse().ok()?;
    let port = pod_port(pod, cfg.default_port)?;
    let model = cfg.model_label.as_deref().and_then(|key| {
        pod.metadata
            .labels
            .as_ref()?
            .get(key)
            .filter(|v| !v.is_empty())
            .cloned()
    });
    Some(DiscoveredEngine {
        url: format!("http://{}", SocketAddr::new(ip.to_canonical(), port)),
        model,
    })
}

/// The annotation's port, else the default. A malformed annotation makes the pod no worker:
/// guessing the default port would route to whatever happens to listen there.
fn pod_port(pod: &Pod, default_port: u16) -> Option<u16> {
    let Some(raw) = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ENGINE_PORT_ANNOTATION))
    else {
        return Some(default_port);
    };
    match raw.trim().parse::<u16>() {
        Ok(port) if port != 0 => Some(port),
        _ => {
            tracing::warn!(
                pod = pod.metadata.name.as_deref().unwrap_or("<unnamed>"),
                annotation = ENGINE_PORT_ANNOTATION,
                value = %echo(raw),
                "engine pod has an invalid port annotation; not using it as a worker"
            );
            None
        }
    }
}

/// The worker pods believed to exist, the relist being read, and what was last published.
#[derive(Debug, Default)]
struct EngineSet {
    /// Pod name -> its worker; pods that are not workers are absent.
    live: BTreeMap<String, DiscoveredEngine>,
    relist: Option<BTreeMap<String, DiscoveredEngine>>,
    /// url -> model, as the consumer has been told.
    published: BTreeMap<String, Option<String>>,
}

impl EngineSet {
    fn update(
        map: &mut BTreeMap<String, DiscoveredEngine>,
        pod: &Pod,
        cfg: &EngineDiscoveryConfig,
    ) {
        let Some(name) = pod.metadata.name.clone() else {
            return;
        };
        match engine_of_pod(pod, cfg) {
            Some(engine) => {
                if map.len() >= TRACKED_ENGINE_PODS_MAX && !map.contains_key(&name) {
                    tracing::warn!(
                        limit = TRACKED_ENGINE_PODS_MAX,
                        pod = %name,
                        "too many engine pods match the selector; ignoring this one"
                    );
                    return;
                }
                map.insert(name, engine);
            }
            None => {
                map.remove(&name);
            }
        }
    }

    /// Folds one watcher event in and returns the edits that bring the consumer up to date.
    fn apply(&mut self, event: Event<Pod>, cfg: &EngineDiscoveryConfig) -> Vec<EngineEvent> {
        match event {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                return Vec::new();
            }
            Event::InitApply(pod) => match self.relist.as_mut() {
                Some(buffer) => {
                    Self::update(buffer, &pod, cfg);
                    return Vec::new();
                }
                None => Self::update(&mut self.live, &pod, cfg),
            },
            Event::InitDone => {
                self.live = self.relist.take().unwrap_or_default();
                if self.live.is_empty() {
                    tracing::warn!(
                        selector = %cfg.label_selector,
                        namespace = %cfg.namespace,
                        "engine selector matches no ready pods; check --selector, the namespace and RBAC"
                    );
                }
            }
            Event::Apply(pod) => Self::update(&mut self.live, &pod, cfg),
            Event::Delete(pod) => {
                if let Some(name) = pod.metadata.name.as_deref() {
                    self.live.remove(name);
                }
            }
        }
        self.diff()
    }

    /// Removals first, so a consumer with a worker cap frees room before it is asked to add;
    /// a URL whose model changed is removed and re-added (the model group changes).
    fn diff(&mut self) -> Vec<EngineEvent> {
        let mut desired: BTreeMap<String, Option<String>> = BTreeMap::new();
        // Two pods on one URL (host networking) are one worker; the first pod by name wins, so
        // the answer does not depend on event order.
        for engine in self.live.values() {
            desired
                .entry(engine.url.clone())
                .or_insert_with(|| engine.model.clone());
        }
        let mut events = Vec::new();
        for (url, model) in &self.published {
            if desired.get(url) != Some(model) {
                events.push(EngineEvent::Removed { url: url.clone() });
            }
        }
        for (url, model) in &desired {
            if self.published.get(url) != Some(model) {
                events.push(EngineEvent::Added {
                    url: url.clone(),
                    model: model.clone(),
                });
            }
        }
        self.published = desired;
        events
    }
}

/// A client for [`spawn_engine_discovery`]: talks to `api_server_url` when given (tests),
/// else infers the in-cluster / kubeconfig settings.
pub async fn engine_discovery_client(
    api_server_url: Option<&str>,
) -> Result<kube::Client, KubeClientError> {
    let config = crate::k8s::kube_config(api_server_url).await?;
    Ok(kube::Client::try_from(config)?)
}

/// Starts watching engine pods; the receiver yields worker edits until the handle is
/// dropped or shut down. Must be called inside a tokio runtime.
pub fn spawn_engine_discovery(
    config: EngineDiscoveryConfig,
    client: kube::Client,
) -> (EngineDiscoveryHandle, mpsc::Receiver<EngineEvent>) {
    let (tx, rx) = mpsc::channel(ENGINE_EVENT_CHANNEL_CAPACITY);
    let (syncs_tx, syncs) = watch::channel(0);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run_pod_watch(client, config, tx, syncs_tx, cancel.clone()));
    (EngineDiscoveryHandle::new(cancel, task, syncs), rx)
}

async fn run_pod_watch(
    client: kube::Client,
    cfg: EngineDiscoveryConfig,
    tx: mpsc::Sender<EngineEvent>,
    syncs: watch::Sender<u64>,
    cancel: CancellationToken,
) {
    let api: Api<Pod> = Api::namespaced(client, &cfg.namespace);
    let wc = watcher::Config::default().labels(&cfg.label_selector);
    let mut events = watcher::watcher(api, wc).default_backoff().boxed();
    let mut set = EngineSet::default();
    tracing::info!(
        selector = %cfg.label_selector,
        namespace = %cfg.namespace,
        "watching pods for engine workers"
    );
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.next() => event,
        };
        let Some(event) = event else {
            tracing::warn!("engine pod watcher stream ended");
            return;
        };
        let event = match event {
            Ok(event) => event,
            // 410 Gone is the protocol's normal "history compacted, relist" signal.
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                tracing::info!(error = %status, "engine pod watch expired; relisting");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "engine pod watch error; retrying with backoff");
                continue;
            }
        };
        let completes_a_list = matches!(event, Event::InitDone);
        for edit in set.apply(event, &cfg) {
            match &edit {
                EngineEvent::Added { url, model } => {
                    tracing::info!(%url, model = model.as_deref().unwrap_or("<ask engine>"), "engine pod is a worker")
                }
                EngineEvent::Removed { url } => {
                    tracing::info!(%url, "engine pod is no longer a worker")
                }
            }
            let sent = tokio::select! {
                _ = cancel.cancelled() => return,
                sent = tx.send(edit) => sent,
            };
            if sent.is_err() {
                tracing::info!("engine event receiver dropped; stopping engine discovery");
                return;
            }
        }
        if completes_a_list {
            syncs.send_modify(|n| *n += 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::DEFAULT_ENGINE_PORT;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn cfg() -> EngineDiscoveryConfig {
        EngineDiscoveryConfig {
            label_selector: "app=engine".into(),
            namespace: "ns".into(),
            default_port: DEFAULT_ENGINE_PORT,
            model_label: Some("kvroute.io/model".into()),
        }
    }

    fn pod(name: &str, ip: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                labels: Some([("app".to_string(), "engine".to_string())].into()),
                ..Default::default()
            },
            spec: None,
            status: Some(PodStatus {
                phase: Some("Running".into()),
                pod_ip: Some(ip.into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }

    fn with_status(mut p: Pod, f: impl FnOnce(&mut PodStatus)) -> Pod {
        f(p.status.as_mut().unwrap());
        p
    }

    fn with_annotation(mut p: Pod, k: &str, v: &str) -> Pod {
        p.metadata
            .annotations
            .get_or_insert_default()
            .insert(k.into(), v.into());
        p
    }

    fn with_label(mut p: Pod, k: &str, v: &str) -> Pod {
        p.metadata
            .labels
            .get_or_insert_default()
            .insert(k.into(), v.into());
        p
    }

    fn url_of(p: &Pod) -> Option<String> {
        engine_of_pod(p, &cfg()).map(|e| e.url)
    }

    fn added(url: &str, model: Option<&str>) -> EngineEvent {
        EngineEvent::Added {
            url: url.into(),
            model: model.map(str::to_string),
        }
    }

    fn removed(url: &str) -> EngineEvent {
        EngineEvent::Removed { url: url.into() }
    }

    #[test]
    fn a_running_ready_pod_with_an_ip_is_a_worker_on_the_default_port() {
        assert_eq!(
            url_of(&pod("e", "10.0.0.1")).as_deref(),
            Some("http://10.0.0.1:8000")
        );
        assert_eq!(
            url_of(&pod("e", "fd00::1")).as_deref(),
            Some("http://[fd00::1]:8000"),
            "IPv6 pod IPs are bracketed"
        );
    }

    #[test]
    fn pending_unready_ipless_or_deleting_pods_are_not_workers() {
        let cases = [
            (
                "pending",
                with_status(pod("e", "10.0.0.1"), |s| s.phase = Some("Pending".into())),
            ),
            (
                "ready false",
                with_status(pod("e", "10.0.0.1"), |s| {
                    s.conditions.as_mut().unwrap()[0].status = "False".into()
                }),
            ),
            (
                "no conditions",
                with_status(pod("e", "10.0.0.1"), |s| s.conditions = None),
            ),
            (
                "only ContainersReady",
                with_status(pod("e", "10.0.0.1"), |s| {
                    s.conditions.as_mut().unwrap()[0].type_ = "ContainersReady".into()
                }),
            ),
            (
                "no ip",
                with_status(pod("e", "10.0.0.1"), |s| s.pod_ip = None),
            ),
            ("bad ip", pod("e", "not-an-ip")),
            ("no status", {
                let mut p = pod("e", "10.0.0.1");
                p.status = None;
                p
            }),
            ("deleting", {
                let mut p = pod("e", "10.0.0.1");
                p.metadata.deletion_timestamp =
                    Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
                p
            }),
        ];
        for (what, p) in cases {
            assert_eq!(url_of(&p), None, "{what} pod was taken as a worker");
        }
    }

    #[test]
    fn port_annotation_overrides_the_default_and_a_bad_one_excludes_the_pod() {
        let p = with_annotation(pod("e", "10.0.0.1"), ENGINE_PORT_ANNOTATION, " 30001 ");
        assert_eq!(url_of(&p).as_deref(), Some("http://10.0.0.1:30001"));
        for bad in ["0", "70000", "http", ""] {
            let p = with_annotation(pod("e", "10.0.0.1"), ENGINE_PORT_ANNOTATION, bad);
            assert_eq!(url_of(&p), None, "annotation {bad:?} was accepted");
        }
    }

    #[test]
    fn model_comes_from_the_configured_label_only() {
        let p = with_label(pod("e", "10.0.0.1"), "kvroute.io/model", "llama-8b");
        assert_eq!(
            engine_of_pod(&p, &cfg()).unwrap().model.as_deref(),
            Some("llama-8b")
        );
        assert_eq!(
            engine_of_pod(&pod("e", "10.0.0.1"), &cfg()).unwrap().model,
            None
        );
        let no_label_cfg = EngineDiscoveryConfig {
            model_label: None,
            ..cfg()
        };
        assert_eq!(engine_of_pod(&p, &no_label_cfg).unwrap().model, None);
        let empty = with_label(pod("e", "10.0.0.1"), "kvroute.io/model", "");
        assert_eq!(engine_of_pod(&empty, &cfg()).unwrap().model, None);
    }

    #[test]
    fn relist_is_invisible_until_init_done_and_then_emits_only_differences() {
        let cfg = cfg();
        let mut set = EngineSet::default();
        assert!(set.apply(Event::Init, &cfg).is_empty());
        assert!(
            set.apply(Event::InitApply(pod("a", "10.0.0.1")), &cfg)
                .is_empty()
        );
        assert!(
            set.apply(Event::InitApply(pod("b", "10.0.0.2")), &cfg)
                .is_empty()
        );
        assert_eq!(
            set.apply(Event::InitDone, &cfg),
            [
                added("http://10.0.0.1:8000", None),
                added("http://10.0.0.2:8000", None)
            ]
        );
        // Relist: a unchanged, b gone, c new. Nothing until InitDone, then only b and c.
        assert!(set.apply(Event::Init, &cfg).is_empty());
        assert!(
            set.apply(Event::InitApply(pod("a", "10.0.0.1")), &cfg)
                .is_empty()
        );
        assert!(
            set.apply(Event::InitApply(pod("c", "10.0.0.3")), &cfg)
                .is_empty()
        );
        assert_eq!(
            set.apply(Event::InitDone, &cfg),
            [
                removed("http://10.0.0.2:8000"),
                added("http://10.0.0.3:8000", None)
            ]
        );
        // An identical relist emits nothing at all.
        set.apply(Event::Init, &cfg);
        set.apply(Event::InitApply(pod("c", "10.0.0.3")), &cfg);
        set.apply(Event::InitApply(pod("a", "10.0.0.1")), &cfg);
        assert!(set.apply(Event::InitDone, &cfg).is_empty());
    }

    #[test]
    fn live_transitions_add_remove_and_ignore_non_changes() {
        let cfg = cfg();
        let mut set = EngineSet::default();
        set.apply(Event::Init, &cfg);
        assert!(set.apply(Event::InitDone, &cfg).is_empty());
        let unready = with_status(pod("a", "10.0.0.1"), |s| {
            s.conditions.as_mut().unwrap()[0].status = "False".into()
        });
        assert!(set.apply(Event::Apply(unready.clone()), &cfg).is_empty());
        assert_eq!(
            set.apply(Event::Apply(pod("a", "10.0.0.1")), &cfg),
            [added("http://10.0.0.1:8000", None)]
        );
        assert!(
            set.apply(Event::Apply(pod("a", "10.0.0.1")), &cfg)
                .is_empty(),
            "a MODIFIED that changes nothing we use is no event"
        );
        assert_eq!(
            set.apply(Event::Apply(unready), &cfg),
            [removed("http://10.0.0.1:8000")]
        );
        set.apply(Event::Apply(pod("a", "10.0.0.1")), &cfg);
        assert_eq!(
            set.apply(Event::Delete(pod("a", "10.0.0.1")), &cfg),
            [removed("http://10.0.0.1:8000")]
        );
        assert!(
            set.apply(Event::Delete(pod("a", "10.0.0.1")), &cfg)
                .is_empty()
        );
    }

    #[test]
    fn a_model_change_is_a_removal_then_an_addition() {
        let cfg = cfg();
        let mut set = EngineSet::default();
        let v1 = with_label(pod("a", "10.0.0.1"), "kvroute.io/model", "m1");
        let v2 = with_label(pod("a", "10.0.0.1"), "kvroute.io/model", "m2");
        set.apply(Event::Apply(v1), &cfg);
        assert_eq!(
            set.apply(Event::Apply(v2), &cfg),
            [
                removed("http://10.0.0.1:8000"),
                added("http://10.0.0.1:8000", Some("m2"))
            ]
        );
    }

    #[test]
    fn two_pods_on_one_url_are_one_worker_until_both_are_gone() {
        let cfg = cfg();
        let mut set = EngineSet::default();
        assert_eq!(
            set.apply(Event::Apply(pod("a", "10.0.0.1")), &cfg),
            [added("http://10.0.0.1:8000", None)]
        );
        assert!(
            set.apply(Event::Apply(pod("b", "10.0.0.1")), &cfg)
                .is_empty()
        );
        assert!(
            set.apply(Event::Delete(pod("a", "10.0.0.1")), &cfg)
                .is_empty()
        );
        assert_eq!(
            set.apply(Event::Delete(pod("b", "10.0.0.1")), &cfg),
            [removed("http://10.0.0.1:8000")]
        );
    }

    #[test]
    fn tracked_pods_are_capped() {
        let cfg = cfg();
        let mut set = EngineSet::default();
        for i in 0..TRACKED_ENGINE_PODS_MAX + 10 {
            let ip = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
            EngineSet::update(&mut set.live, &pod(&format!("p{i}"), &ip), &cfg);
        }
        assert_eq!(set.live.len(), TRACKED_ENGINE_PODS_MAX);
    }
}
