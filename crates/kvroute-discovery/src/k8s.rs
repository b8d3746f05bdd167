//! Kubernetes peer source: a kube-rs `watcher` on `discovery.k8s.io/v1` EndpointSlices.
//!
//! The siblings are the ready endpoints of the slices selected by `--kv-peer-selector`
//! (normally `kubernetes.io/service-name=<headless internal Service>`) in this pod's
//! namespace. Why it is shaped this way:
//! - EndpointSlices, not Pods: the endpoints controller already folds readiness and
//!   termination into `conditions`, and the Service's port names tell us which port is the
//!   internal listener.
//! - The whole answer is recomputed from all known slices on every event and handed to
//!   [`PeerRegistry::replace`], so the registry only ever sees complete sets.
//! - A relist (start, or after a 410 Gone) is buffered from `Init` to `InitDone` and swapped
//!   in at once: publishing while the relist is half read would show a transient, too-small or
//!   empty set, which a booting replica could take for "I am alone".
//! - A pod is one peer however many slices list it (dual-stack slices, controller
//!   rebalancing): endpoints are keyed by their targetRef pod, IPv4 preferred.
//! - Errors are left to the watcher's default backoff; the last good set stays published.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio_util::sync::CancellationToken;

use crate::config::{KubeClientError, KubernetesPeers};
use crate::peer_url::PeerUrl;
use crate::registry::PeerRegistry;

/// Slices tracked at most; beyond this a selector is certainly wrong, and we refuse to grow.
pub const TRACKED_ENDPOINT_SLICES_MAX: usize = 4096;

/// One sibling as a slice lists it: `backend` identifies the pod across slices (dual-stack
/// slices, or a pod briefly listed in two slices while the controller rebalances).
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlicePeer {
    backend: String,
    url: PeerUrl,
}

/// The client configuration: an explicit API server URL (tests), else in-cluster/kubeconfig.
/// Shared by the peer source and the engine discovery source ([`crate::engines`]).
pub(crate) async fn kube_config(
    api_server_url: Option<&str>,
) -> Result<kube::Config, KubeClientError> {
    match api_server_url {
        Some(url) => {
            let uri = url
                .parse()
                .map_err(|_| KubeClientError::InvalidApiServerUrl(url.to_string()))?;
            Ok(kube::Config::new(uri))
        }
        None => Ok(kube::Config::infer().await?),
    }
}

/// Builds the client and resolves the namespace to watch.
pub(crate) async fn kube_client(
    cfg: &KubernetesPeers,
) -> Result<(kube::Client, String), KubeClientError> {
    let config = kube_config(cfg.api_server_url.as_deref()).await?;
    let namespace = cfg
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    Ok((kube::Client::try_from(config)?, namespace))
}

/// The sibling URLs one slice contributes under `cfg` (self and unready endpoints removed).
pub fn peers_from_slice(slice: &EndpointSlice, cfg: &KubernetesPeers) -> Vec<PeerUrl> {
    slice_peers(slice, cfg).into_iter().map(|p| p.url).collect()
}

fn slice_peers(slice: &EndpointSlice, cfg: &KubernetesPeers) -> Vec<SlicePeer> {
    let Some(port) = slice_port(slice, &cfg.port_name) else {
        tracing::warn!(
            slice = slice.metadata.name.as_deref().unwrap_or("<unnamed>"),
            "EndpointSlice has no numbered port; ignoring it for peer discovery"
        );
        return Vec::new();
    };
    let namespace = slice
        .metadata
        .namespace
        .as_deref()
        .or(cfg.namespace.as_deref());
    slice
        .endpoints
        .iter()
        .filter(|ep| is_serving_peer(ep))
        .filter(|ep| !is_this_pod(ep, cfg, namespace))
        .filter_map(|ep| {
            let url = endpoint_url(ep, port, cfg.https)?;
            cfg.ip_family.admits(&url).then(|| SlicePeer {
                backend: backend_key(ep, namespace, &url),
                url,
            })
        })
        .collect()
}

/// The pod behind an endpoint (uid, else namespace/name), else its URL when it has no
/// targetRef; the port is part of the key so two listeners of one pod stay distinct.
fn backend_key(ep: &Endpoint, namespace: Option<&str>, url: &PeerUrl) -> String {
    let port = url.port();
    match ep.target_ref.as_ref() {
        Some(t) if t.uid.is_some() => format!("uid:{}:{port}", t.uid.as_deref().unwrap_or("")),
        Some(t) if t.name.is_some() => format!(
            "pod:{}/{}:{port}",
            t.namespace.as_deref().or(namespace).unwrap_or(""),
            t.name.as_deref().unwrap_or("")
        ),
        _ => format!("url:{url}"),
    }
}

fn slice_port(slice: &EndpointSlice, port_name: &str) -> Option<u16> {
    let ports = slice.ports.as_deref()?;
    let chosen = ports
        .iter()
        .find(|p| p.name.as_deref() == Some(port_name))
        .or_else(|| ports.first())?;
    chosen
        .port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
}

/// Ready unless explicitly not ready (the API documents nil as "unknown, treat as ready"),
/// and not terminating: a draining sibling is about to lose its index.
fn is_serving_peer(ep: &Endpoint) -> bool {
    let conditions = ep.conditions.as_ref();
    let ready = conditions.and_then(|c| c.ready) != Some(false);
    let terminating = conditions.and_then(|c| c.terminating) == Some(true);
    ready && !terminating
}

fn is_this_pod(ep: &Endpoint, cfg: &KubernetesPeers, own_namespace: Option<&str>) -> bool {
    if let (Some(target), Some(pod_name)) = (ep.target_ref.as_ref(), cfg.pod_name.as_deref()) {
        let same_name = target.name.as_deref() == Some(pod_name);
        let same_namespace = match (target.namespace.as_deref(), own_namespace) {
            (Some(theirs), Some(ours)) => theirs == ours,
            _ => true,
        };
        if same_name && same_namespace {
            return true;
        }
    }
    match (cfg.pod_ip, ep.addresses.first()) {
        (Some(own), Some(addr)) => addr
            .parse::<IpAddr>()
            .is_ok_and(|a| a.to_canonical() == own.to_canonical()),
        _ => false,
    }
}

/// The first address is the one consumers use (the API requires the rest to be fungible).
fn endpoint_url(ep: &Endpoint, port: u16, https: bool) -> Option<PeerUrl> {
    let addr = ep.addresses.first()?;
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return Some(PeerUrl::from_socket_addr(https, SocketAddr::new(ip, port)));
    }
    let scheme = if https { "https" } else { "http" };
    PeerUrl::parse(&format!("{scheme}://{addr}:{port}")).ok()
}

/// The slices currently believed to exist and the relist being read, if any.
#[derive(Debug, Default)]
struct SliceSet {
    live: HashMap<String, Vec<SlicePeer>>,
    relist: Option<HashMap<String, Vec<SlicePeer>>>,
}

impl SliceSet {
    fn insert(map: &mut HashMap<String, Vec<SlicePeer>>, name: String, peers: Vec<SlicePeer>) {
        if map.len() >= TRACKED_ENDPOINT_SLICES_MAX && !map.contains_key(&name) {
            tracing::warn!(
                limit = TRACKED_ENDPOINT_SLICES_MAX,
                slice = %name,
                "too many EndpointSlices match the peer selector; ignoring this one"
            );
            return;
        }
        map.insert(name, peers);
    }

    /// One URL per backend: IPv4 before IPv6, then the lowest URL, so the choice does not
    /// depend on which slice was seen first.
    fn peers(&self) -> BTreeSet<PeerUrl> {
        let mut chosen: HashMap<&str, &PeerUrl> = HashMap::new();
        for peer in self.live.values().flatten() {
            let rank = |u: &PeerUrl| (u.ip().is_some_and(|ip| ip.is_ipv6()), u.clone());
            chosen
                .entry(peer.backend.as_str())
                .and_modify(|current| {
                    if rank(&peer.url) < rank(current) {
                        *current = &peer.url;
                    }
                })
                .or_insert(&peer.url);
        }
        chosen.into_values().cloned().collect()
    }
}

/// The watch loop: runs until `cancel`, publishing complete peer sets into `registry`.
pub(crate) async fn run_endpointslice_watch(
    client: kube::Client,
    namespace: String,
    cfg: KubernetesPeers,
    registry: PeerRegistry,
    cancel: CancellationToken,
) {
    let api: Api<EndpointSlice> = Api::namespaced(client, &namespace);
    let wc = watcher::Config::default().labels(&cfg.label_selector);
    let mut events = watcher::watcher(api, wc).default_backoff().boxed();
    let mut slices = SliceSet::default();
    tracing::info!(selector = %cfg.label_selector, %namespace, "watching EndpointSlices for peers");
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.next() => event,
        };
        let Some(event) = event else {
            tracing::warn!("peer EndpointSlice watcher stream ended");
            return;
        };
        match event {
            Ok(event) => {
                if apply_event(&mut slices, event, &cfg) {
                    publish(&slices, &registry);
                }
            }
            // 410 Gone is the protocol's normal "history compacted, relist" signal.
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                tracing::info!(error = %status, "peer EndpointSlice watch expired; relisting")
            }
            Err(e) => {
                tracing::warn!(error = %e, "peer EndpointSlice watch error; retrying with backoff")
            }
        }
    }
}

/// Folds one watcher event into `slices`; returns whether the live set may have changed.
fn apply_event(slices: &mut SliceSet, event: Event<EndpointSlice>, cfg: &KubernetesPeers) -> bool {
    match event {
        Event::Init => {
            slices.relist = Some(HashMap::new());
            false
        }
        Event::InitApply(slice) => {
            let Some(name) = slice.metadata.name.clone() else {
                return false;
            };
            let peers = slice_peers(&slice, cfg);
            match slices.relist.as_mut() {
                Some(buffer) => {
                    SliceSet::insert(buffer, name, peers);
                    false
                }
                None => {
                    SliceSet::insert(&mut slices.live, name, peers);
                    true
                }
            }
        }
        Event::InitDone => {
            slices.live = slices.relist.take().unwrap_or_default();
            if slices.live.is_empty() {
                tracing::warn!(
                    selector = %cfg.label_selector,
                    "peer selector matches no EndpointSlices; check --kv-peer-selector and RBAC"
                );
            }
            true
        }
        Event::Apply(slice) => {
            let Some(name) = slice.metadata.name.clone() else {
                return false;
            };
            let peers = slice_peers(&slice, cfg);
            SliceSet::insert(&mut slices.live, name, peers);
            true
        }
        Event::Delete(slice) => match slice.metadata.name.as_deref() {
            Some(name) => slices.live.remove(name).is_some(),
            None => false,
        },
    }
}

fn publish(slices: &SliceSet, registry: &PeerRegistry) {
    let peers = slices.peers();
    let count = peers.len();
    if registry.replace(peers) {
        tracing::info!(peers = count, "peer set changed (EndpointSlices)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PeerIpFamily;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointPort};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn ep(addr: &str, pod: &str, ready: Option<bool>, terminating: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![addr.to_string()],
            conditions: Some(EndpointConditions {
                ready,
                serving: ready,
                terminating,
            }),
            target_ref: Some(ObjectReference {
                kind: Some("Pod".into()),
                name: Some(pod.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn slice(name: &str, ports: &[(&str, i32)], endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints,
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p)| EndpointPort {
                        name: Some(n.to_string()),
                        port: Some(*p),
                        protocol: Some("TCP".into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
        }
    }

    fn cfg() -> KubernetesPeers {
        KubernetesPeers {
            namespace: Some("ns".into()),
            pod_name: Some("me".into()),
            pod_ip: Some("10.0.0.9".parse().unwrap()),
            ..KubernetesPeers::new("kubernetes.io/service-name=kvroute-internal")
        }
    }

    fn strs(peers: &[PeerUrl]) -> Vec<&str> {
        peers.iter().map(PeerUrl::as_str).collect()
    }

    #[test]
    fn named_internal_port_is_preferred_over_the_first_port() {
        let s = slice(
            "a",
            &[("http", 8080), ("internal", 8081)],
            vec![ep("10.0.0.1", "p1", Some(true), Some(false))],
        );
        assert_eq!(
            strs(&peers_from_slice(&s, &cfg())),
            ["http://10.0.0.1:8081"]
        );
        let s = slice(
            "a",
            &[("other", 9000), ("http", 8080)],
            vec![ep("10.0.0.1", "p1", Some(true), None)],
        );
        assert_eq!(
            strs(&peers_from_slice(&s, &cfg())),
            ["http://10.0.0.1:9000"]
        );
    }

    #[test]
    fn unready_and_terminating_endpoints_are_not_peers_but_unknown_readiness_is() {
        let s = slice(
            "a",
            &[("internal", 8081)],
            vec![
                ep("10.0.0.1", "p1", Some(false), None),
                ep("10.0.0.2", "p2", Some(true), Some(true)),
                ep("10.0.0.3", "p3", None, None),
                ep("10.0.0.4", "p4", Some(true), Some(false)),
            ],
        );
        assert_eq!(
            strs(&peers_from_slice(&s, &cfg())),
            ["http://10.0.0.3:8081", "http://10.0.0.4:8081"]
        );
    }

    #[test]
    fn this_pod_is_excluded_by_target_ref_or_by_ip() {
        let mut by_ip = ep("10.0.0.9", "someone", Some(true), None);
        by_ip.target_ref = None;
        let other_ns = {
            let mut e = ep("10.0.0.5", "me", Some(true), None);
            e.target_ref.as_mut().unwrap().namespace = Some("elsewhere".into());
            e
        };
        let s = slice(
            "a",
            &[("internal", 8081)],
            vec![ep("10.0.0.1", "me", Some(true), None), by_ip, other_ns],
        );
        assert_eq!(
            strs(&peers_from_slice(&s, &cfg())),
            ["http://10.0.0.5:8081"],
            "same pod name in another namespace is a different pod"
        );
    }

    #[test]
    fn slice_without_numbered_port_contributes_nothing() {
        let mut s = slice("a", &[], vec![ep("10.0.0.1", "p1", Some(true), None)]);
        s.ports = None;
        assert!(peers_from_slice(&s, &cfg()).is_empty());
    }

    #[test]
    fn relist_is_invisible_until_init_done() {
        let cfg = cfg();
        let mut set = SliceSet::default();
        let a = slice(
            "a",
            &[("internal", 8081)],
            vec![ep("10.0.0.1", "p1", None, None)],
        );
        let b = slice(
            "b",
            &[("internal", 8081)],
            vec![ep("10.0.0.2", "p2", None, None)],
        );
        assert!(!apply_event(&mut set, Event::Init, &cfg));
        assert!(!apply_event(&mut set, Event::InitApply(a.clone()), &cfg));
        assert!(
            set.peers().is_empty(),
            "buffered relist leaked before InitDone"
        );
        assert!(apply_event(&mut set, Event::InitDone, &cfg));
        assert_eq!(set.peers().len(), 1);
        assert!(apply_event(&mut set, Event::Apply(b.clone()), &cfg));
        assert_eq!(set.peers().len(), 2);
        // A relist that no longer contains `a` keeps showing a and b until it completes.
        assert!(!apply_event(&mut set, Event::Init, &cfg));
        assert!(!apply_event(&mut set, Event::InitApply(b.clone()), &cfg));
        assert_eq!(set.peers().len(), 2);
        assert!(apply_event(&mut set, Event::InitDone, &cfg));
        assert_eq!(
            set.peers()
                .into_iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>(),
            ["http://10.0.0.2:8081"]
        );
        assert!(apply_event(&mut set, Event::Delete(b), &cfg));
        assert!(set.peers().is_empty());
    }

    #[test]
    fn the_same_endpoint_in_two_slices_is_one_peer() {
        let cfg = cfg();
        let mut set = SliceSet::default();
        let a = slice(
            "a",
            &[("internal", 8081)],
            vec![ep("10.0.0.1", "p1", None, None)],
        );
        let b = slice(
            "b",
            &[("internal", 8081)],
            vec![ep("10.0.0.1", "p1", None, None)],
        );
        apply_event(&mut set, Event::Apply(a), &cfg);
        apply_event(&mut set, Event::Apply(b), &cfg);
        assert_eq!(set.peers().len(), 1);
    }

    #[test]
    fn a_dual_stack_pod_is_one_peer_preferring_ipv4_unless_restricted() {
        let mut v6 = slice(
            "a-v6",
            &[("internal", 8081)],
            vec![ep("fd00::1", "p1", Some(true), None)],
        );
        v6.address_type = "IPv6".into();
        let v4 = slice(
            "a-v4",
            &[("internal", 8081)],
            vec![ep("10.0.0.1", "p1", Some(true), None)],
        );
        let run = |family: PeerIpFamily| {
            let cfg = KubernetesPeers {
                ip_family: family,
                ..cfg()
            };
            let mut set = SliceSet::default();
            apply_event(&mut set, Event::Apply(v6.clone()), &cfg);
            apply_event(&mut set, Event::Apply(v4.clone()), &cfg);
            set.peers()
                .into_iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(PeerIpFamily::Any), ["http://10.0.0.1:8081"]);
        assert_eq!(run(PeerIpFamily::V4Only), ["http://10.0.0.1:8081"]);
        assert_eq!(run(PeerIpFamily::V6Only), ["http://[fd00::1]:8081"]);
    }
}
