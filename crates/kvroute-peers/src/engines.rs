//! Kubernetes discovery of engine pods: a kube-rs `watcher` on Pods selected by label, turned
//! into a stream of worker additions and removals for the router's worker registry.
//!
//! Why it is shaped this way:
//! - Pods, not EndpointSlices: engines are often deployed without a Service, and the pod's own
//!   labels and annotations carry what the router needs (the served model, a non-default port).
//!   A pod is a worker only while it is `Running`, has a pod IP, has its `Ready` condition
//!   `True` and carries no `deletionTimestamp`: a pod being deleted keeps `Ready` for a while,
//!   but it is draining and must get no new requests.
//! - The output is a bounded stream of [`EngineEvent`] edits rather than complete sets, because
//!   the router's registry is edited worker by worker (the same way the admin API and the
//!   static `--worker-urls` list add workers); the source keeps the last published set itself
//!   and emits only differences against it.
//! - A relist (start-up, or after a 410 Gone) is buffered from `Init` to `InitDone` and then
//!   diffed against the published set, so a relist emits only what really changed while the
//!   watch was down; unchanged pods are never removed and re-added (which would reset their
//!   health and KV attachment in the router).
//! - Only the derived (url, model) of worker pods is kept, never whole Pod objects, so memory is
//!   bounded by [`MAX_TRACKED_ENGINE_PODS`] small entries.
//! - Errors are left to the watcher's default backoff; the last published set stays in force
//!   (an API server outage must not look like "every engine is gone").

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::source::PeerSourceError;

/// Engine HTTP port used when a pod has no [`ENGINE_PORT_ANNOTATION`].
pub const DEFAULT_ENGINE_PORT: u16 = 8000;
/// Pod annotation whose value overrides the engine HTTP port for that pod.
pub const ENGINE_PORT_ANNOTATION: &str = "kvroute.io/port";
/// Namespace watched when neither the flag nor `POD_NAMESPACE` names one.
pub const DEFAULT_ENGINE_NAMESPACE: &str = "default";
/// Events buffered between the source and the router before the source waits (backpressure,
/// never loss: a dropped `Removed` would leave a dead worker routable).
pub const ENGINE_EVENT_CHANNEL_CAPACITY: usize = 1024;
/// Worker pods tracked at most; beyond this a selector is certainly wrong, and we refuse to grow.
pub const MAX_TRACKED_ENGINE_PODS: usize = 4096;
/// Terms accepted in `--selector`.
pub const MAX_SELECTOR_TERMS: usize = 32;
/// Longest label name part / label value Kubernetes accepts.
pub const MAX_LABEL_NAME_BYTES: usize = 63;
/// Longest label key prefix (a DNS subdomain) Kubernetes accepts.
pub const MAX_LABEL_PREFIX_BYTES: usize = 253;
/// Longest namespace name (a DNS label).
pub const MAX_NAMESPACE_BYTES: usize = 63;
/// Longest piece of bad input echoed back in an error or a log line.
const MAX_ECHOED_INPUT_CHARS: usize = 300;

/// Engine discovery flags (`#[command(flatten)]` them into the router's arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct EngineDiscoveryArgs {
    /// Discover engine pods through the Kubernetes API (needs `--selector`).
    #[arg(long = "service-discovery", env = "KVROUTE_SERVICE_DISCOVERY")]
    pub service_discovery: bool,
    /// Label selector of the engine pods, `k=v` (also `k!=v`, `k`, `!k`); repeat the flag or
    /// separate terms with commas; all terms must hold.
    #[arg(long = "selector", env = "KVROUTE_SELECTOR", value_delimiter = ',')]
    pub selector: Vec<String>,
    /// Namespace whose pods are watched.
    #[arg(
        long = "service-discovery-namespace",
        env = "POD_NAMESPACE",
        default_value = DEFAULT_ENGINE_NAMESPACE
    )]
    pub service_discovery_namespace: String,
    /// Engine HTTP port; a pod's `kvroute.io/port` annotation overrides it.
    #[arg(
        long = "service-discovery-port",
        env = "KVROUTE_SERVICE_DISCOVERY_PORT",
        default_value_t = DEFAULT_ENGINE_PORT
    )]
    pub service_discovery_port: u16,
    /// Pod label whose value is the served model; without it the router asks each engine.
    #[arg(
        long = "service-discovery-model-label",
        env = "KVROUTE_SERVICE_DISCOVERY_MODEL_LABEL"
    )]
    pub service_discovery_model_label: Option<String>,
}

/// A validated engine discovery configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDiscoveryConfig {
    /// Normalised `labelSelector` (terms trimmed, comma joined), never empty.
    pub label_selector: String,
    pub namespace: String,
    pub default_port: u16,
    pub model_label: Option<String>,
}

/// An engine discovery configuration that cannot work.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EngineDiscoveryConfigError {
    #[error(
        "--service-discovery needs at least one --selector term: without one every pod in the \
         namespace would become a worker"
    )]
    MissingSelector,
    #[error("{0} given without --service-discovery")]
    DiscoveryOff(&'static str),
    #[error("--selector term {term:?}: {why}")]
    InvalidSelectorTerm { term: String, why: &'static str },
    #[error("--selector has {count} terms, over the limit of {MAX_SELECTOR_TERMS}")]
    TooManySelectorTerms { count: usize },
    #[error("--service-discovery-namespace {namespace:?} is not a valid namespace name")]
    InvalidNamespace { namespace: String },
    #[error("--service-discovery-port must be in 1..=65535")]
    ZeroPort,
    #[error("--service-discovery-model-label {label:?}: {why}")]
    InvalidModelLabel { label: String, why: &'static str },
}

fn echo(raw: &str) -> String {
    raw.chars().take(MAX_ECHOED_INPUT_CHARS).collect()
}

impl EngineDiscoveryArgs {
    /// The validated configuration, `None` when discovery is off.
    pub fn to_config(&self) -> Result<Option<EngineDiscoveryConfig>, EngineDiscoveryConfigError> {
        let terms: Vec<&str> = self
            .selector
            .iter()
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
            .collect();
        if !self.service_discovery {
            if !terms.is_empty() {
                return Err(EngineDiscoveryConfigError::DiscoveryOff("--selector"));
            }
            if self.service_discovery_model_label.is_some() {
                return Err(EngineDiscoveryConfigError::DiscoveryOff(
                    "--service-discovery-model-label",
                ));
            }
            return Ok(None);
        }
        if terms.is_empty() {
            return Err(EngineDiscoveryConfigError::MissingSelector);
        }
        if terms.len() > MAX_SELECTOR_TERMS {
            return Err(EngineDiscoveryConfigError::TooManySelectorTerms { count: terms.len() });
        }
        for term in &terms {
            validate_selector_term(term).map_err(|why| {
                EngineDiscoveryConfigError::InvalidSelectorTerm {
                    term: echo(term),
                    why,
                }
            })?;
        }
        // An empty POD_NAMESPACE (a downward-API typo) means "not set", as for an absent one.
        let namespace = match self.service_discovery_namespace.trim() {
            "" => DEFAULT_ENGINE_NAMESPACE,
            namespace => namespace,
        };
        if !is_dns_label(namespace, MAX_NAMESPACE_BYTES) {
            return Err(EngineDiscoveryConfigError::InvalidNamespace {
                namespace: echo(namespace),
            });
        }
        if self.service_discovery_port == 0 {
            return Err(EngineDiscoveryConfigError::ZeroPort);
        }
        let model_label = match self.service_discovery_model_label.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(label) => {
                validate_label_key(label).map_err(|why| {
                    EngineDiscoveryConfigError::InvalidModelLabel {
                        label: echo(label),
                        why,
                    }
                })?;
                Some(label.to_string())
            }
        };
        Ok(Some(EngineDiscoveryConfig {
            label_selector: terms.join(","),
            namespace: namespace.to_string(),
            default_port: self.service_discovery_port,
            model_label,
        }))
    }
}

/// Equality-based terms only: set-based ones (`k in (a,b)`) contain commas, which the flag
/// already uses to separate terms.
fn validate_selector_term(term: &str) -> Result<(), &'static str> {
    if let Some((key, value)) = term.split_once("!=") {
        validate_label_key(key.trim())?;
        return validate_label_value(value.trim());
    }
    if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
        validate_label_key(key.trim())?;
        return validate_label_value(value.trim());
    }
    if let Some(key) = term.strip_prefix('!') {
        return validate_label_key(key.trim());
    }
    if term.contains(' ') || term.contains('(') {
        return Err("set-based terms (in, notin) are not supported; use k=v, k!=v, k or !k");
    }
    validate_label_key(term)
}

fn is_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
}

/// A label name part or non-empty value: alphanumeric at both ends, `-_.` inside.
fn is_label_name(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_LABEL_NAME_BYTES
        && bytes.iter().all(|b| is_name_char(*b))
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// A lower-case DNS label (namespace names, prefix parts).
fn is_dns_label(s: &str, max_bytes: usize) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= max_bytes
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first().is_some_and(|b| *b != b'-')
        && bytes.last().is_some_and(|b| *b != b'-')
}

fn validate_label_key(key: &str) -> Result<(), &'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        let valid = prefix.len() <= MAX_LABEL_PREFIX_BYTES
            && prefix
                .split('.')
                .all(|part| is_dns_label(part, MAX_LABEL_NAME_BYTES));
        if !valid {
            return Err("label key prefix must be a lower-case DNS subdomain");
        }
    }
    if !is_label_name(name) {
        return Err("label name must be 1-63 of [A-Za-z0-9-_.], alphanumeric at both ends");
    }
    Ok(())
}

fn validate_label_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() || is_label_name(value) {
        Ok(())
    } else {
        Err("label value must be 0-63 of [A-Za-z0-9-_.], alphanumeric at both ends")
    }
}

/// A change to the set of engine workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// A new worker: `url` is `http://IP:PORT`; `model` comes from the model label, if any.
    Added { url: String, model: Option<String> },
    /// A worker that must get no more requests (pod gone, not ready, or being deleted).
    Removed { url: String },
}

/// What a worker pod contributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredEngine {
    pub url: String,
    pub model: Option<String>,
}

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
                if map.len() >= MAX_TRACKED_ENGINE_PODS && !map.contains_key(&name) {
                    tracing::warn!(
                        limit = MAX_TRACKED_ENGINE_PODS,
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

/// A running engine discovery source. Dropping it stops the task too.
#[derive(Debug)]
pub struct EngineDiscoveryHandle {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
    syncs: watch::Receiver<u64>,
}

impl EngineDiscoveryHandle {
    /// Stops the source and waits until it sends no more events.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "engine discovery task ended abnormally");
        }
    }

    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Completed (re)lists: 0 until the first list is in; each increment happens after every
    /// event that list caused has been queued on the channel. A consumer can wait for `>= 1`
    /// before declaring itself ready, knowing the initial workers are already in its queue.
    pub fn syncs(&self) -> watch::Receiver<u64> {
        self.syncs.clone()
    }
}

impl Drop for EngineDiscoveryHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A client for [`spawn_engine_discovery`]: talks to `api_server_url` when given (tests),
/// else infers the in-cluster / kubeconfig settings.
pub async fn engine_discovery_client(
    api_server_url: Option<&str>,
) -> Result<kube::Client, PeerSourceError> {
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
    let handle = EngineDiscoveryHandle {
        cancel,
        task: Some(task),
        syncs,
    };
    (handle, rx)
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
    use clap::Parser;
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
        for i in 0..MAX_TRACKED_ENGINE_PODS + 10 {
            let ip = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
            EngineSet::update(&mut set.live, &pod(&format!("p{i}"), &ip), &cfg);
        }
        assert_eq!(set.live.len(), MAX_TRACKED_ENGINE_PODS);
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engines: EngineDiscoveryArgs,
    }

    fn parse(args: &[&str]) -> EngineDiscoveryArgs {
        let mut argv = vec!["kvroute"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().engines
    }

    #[test]
    fn selector_terms_may_be_repeated_or_comma_separated() {
        let c = parse(&[
            "--service-discovery",
            "--selector",
            "app=engine, tier=gpu",
            "--selector",
            "!canary",
            "--service-discovery-namespace",
            "inference",
            "--service-discovery-port",
            "30000",
            "--service-discovery-model-label",
            "kvroute.io/model",
        ])
        .to_config()
        .unwrap()
        .unwrap();
        assert_eq!(c.label_selector, "app=engine,tier=gpu,!canary");
        assert_eq!(c.namespace, "inference");
        assert_eq!(c.default_port, 30000);
        assert_eq!(c.model_label.as_deref(), Some("kvroute.io/model"));
    }

    #[test]
    fn defaults_are_port_8000_and_the_pod_namespace_or_default() {
        let c = parse(&["--service-discovery", "--selector", "app=engine"])
            .to_config()
            .unwrap()
            .unwrap();
        assert_eq!(c.default_port, DEFAULT_ENGINE_PORT);
        let expected_namespace = std::env::var("POD_NAMESPACE")
            .ok()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| DEFAULT_ENGINE_NAMESPACE.to_string());
        assert_eq!(c.namespace, expected_namespace);
        assert_eq!(c.model_label, None);
        assert_eq!(
            parse(&[]).to_config(),
            Ok(None),
            "discovery is off by default"
        );
    }

    #[test]
    fn bad_discovery_flags_are_typed_errors() {
        use EngineDiscoveryConfigError as E;
        let err = |args: &[&str]| parse(args).to_config().unwrap_err();
        assert_eq!(err(&["--service-discovery"]), E::MissingSelector);
        assert_eq!(
            err(&["--service-discovery", "--selector", " , "]),
            E::MissingSelector
        );
        assert_eq!(
            err(&["--selector", "app=engine"]),
            E::DiscoveryOff("--selector")
        );
        for bad in [
            "app in (a,b)",
            "-app=x",
            "app=bad value",
            "UPPER.example/x=y",
            "a/b/c=d",
        ] {
            let flag = format!("--selector={bad}");
            let args = ["--service-discovery", flag.as_str()];
            assert!(
                matches!(parse(&args).to_config(), Err(E::InvalidSelectorTerm { .. })),
                "{bad:?} was accepted"
            );
        }
        let many: Vec<String> = (0..=MAX_SELECTOR_TERMS)
            .map(|i| format!("k{i}=v"))
            .collect();
        let many = many.join(",");
        assert_eq!(
            err(&["--service-discovery", "--selector", &many]),
            E::TooManySelectorTerms {
                count: MAX_SELECTOR_TERMS + 1
            }
        );
        assert!(matches!(
            err(&[
                "--service-discovery",
                "--selector",
                "a=b",
                "--service-discovery-namespace",
                "Bad_NS"
            ]),
            E::InvalidNamespace { .. }
        ));
        assert_eq!(
            err(&[
                "--service-discovery",
                "--selector",
                "a=b",
                "--service-discovery-port",
                "0"
            ]),
            E::ZeroPort
        );
        assert!(matches!(
            err(&[
                "--service-discovery",
                "--selector",
                "a=b",
                "--service-discovery-model-label",
                "model label"
            ]),
            E::InvalidModelLabel { .. }
        ));
    }
}
