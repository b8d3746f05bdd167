//! Discovery: the sibling router replicas (for peer bootstrap) and the engine pods (the workers
//! requests go to).
//!
//! A booting router replica pulls an index snapshot from a warm sibling; this crate only finds
//! the siblings. It is split so the part everyone reads is trivial and I/O-free:
//! [`PeerRegistry`] holds the current sibling set and its `synced` / `ever_had_peers` facts,
//! and exactly one source task ([`spawn_peer_source`]) writes complete answers into it:
//! a static `--kv-peers` list, a headless Service's DNS records (`--kv-peer-dns`), or a
//! Kubernetes EndpointSlice watch (`--kv-peer-selector`). Every source normalises peers to
//! [`PeerUrl`] and leaves this replica out, so consumers never see themselves.
//!
//! The same crate also discovers the *engines* the router sends requests to
//! ([`engines`]: `--service-discovery --selector k=v`), because it shares the Kubernetes
//! client set-up and the list/watch handling with the EndpointSlice peer source.
//!
//! Everything that talks to the Kubernetes API (`k8s`, `engine_pods`) needs the `k8s` cargo
//! feature (on by default). Without it the flags still parse and validate, and starting a
//! Kubernetes source is a typed error ([`KubeClientError::NotBuiltIn`]): a build that does not
//! discover through Kubernetes (the demo) does not compile the client. Engines are
//! delivered differently from peers: as a bounded stream of [`EngineEvent`] edits that the
//! router applies to its worker registry, the same registry the static worker list fills.

mod args;
pub mod config;
#[cfg(feature = "k8s")]
pub mod engine_pods;
pub mod engines;
#[cfg(feature = "k8s")]
pub mod k8s;
mod peer_url;
mod registry;
mod source;

pub use args::PeerDiscoveryArgs;
pub use config::{
    DEFAULT_PEER_PORT_NAME, DNS_NAME_MAX_BYTES, DnsPeers, DnsTarget, KubeClientError,
    KubernetesPeers, PeerConfigError, PeerIpFamily, PeerSourceConfig, StaticPeers,
};
#[cfg(feature = "k8s")]
pub use engine_pods::{engine_discovery_client, engine_of_pod, spawn_engine_discovery};
pub use engines::{
    DEFAULT_ENGINE_NAMESPACE, DEFAULT_ENGINE_PORT, DiscoveredEngine, ENGINE_EVENT_CHANNEL_CAPACITY,
    ENGINE_PORT_ANNOTATION, EngineDiscoveryArgs, EngineDiscoveryConfig, EngineDiscoveryConfigError,
    EngineDiscoveryHandle, EngineEvent, SELECTOR_TERMS_MAX, TRACKED_ENGINE_PODS_MAX,
};
#[cfg(feature = "k8s")]
pub use k8s::{TRACKED_ENDPOINT_SLICES_MAX, peers_from_slice};
pub use peer_url::{PEER_URL_MAX_BYTES, PeerUrl, PeerUrlError};
pub use registry::{PEERS_MAX, PeerRegistry, PeerSnapshot};
pub use source::{
    DNS_LOOKUP_TIMEOUT_MS, DNS_REFRESH_INTERVAL_MS, PeerSourceHandle, spawn_peer_source,
    static_peer_set,
};

/// Starts watching engine pods (in-cluster or kubeconfig settings; `api_server_url` overrides
/// them, for tests); the receiver yields worker edits until the handle is dropped or shut down.
/// Must be called inside a tokio runtime. Without the `k8s` feature this is an error, so a
/// configuration asking for engine discovery is refused at start-up.
pub async fn start_engine_discovery(
    config: engines::EngineDiscoveryConfig,
    api_server_url: Option<&str>,
) -> Result<
    (
        engines::EngineDiscoveryHandle,
        tokio::sync::mpsc::Receiver<engines::EngineEvent>,
    ),
    KubeClientError,
> {
    #[cfg(feature = "k8s")]
    {
        let client = crate::engine_pods::engine_discovery_client(api_server_url).await?;
        Ok(crate::engine_pods::spawn_engine_discovery(config, client))
    }
    #[cfg(not(feature = "k8s"))]
    {
        let _ = (config, api_server_url);
        Err(KubeClientError::NotBuiltIn)
    }
}
