//! Sibling router discovery for peer bootstrap.
//!
//! A booting router replica will pull an index snapshot from a warm sibling; this crate only
//! finds the siblings. It is split so the part everyone reads is trivial and I/O-free:
//! [`PeerRegistry`] holds the current sibling set and its `synced` / `ever_had_peers` facts,
//! and exactly one source task ([`spawn_peer_source`]) writes complete answers into it:
//! a static `--kv-peers` list, a headless Service's DNS records (`--kv-peer-dns`), or a
//! Kubernetes EndpointSlice watch (`--kv-peer-selector`). Every source normalises peers to
//! [`PeerUrl`] and leaves this replica out, so consumers never see themselves.
//!
//! The same crate also discovers the *engines* the router sends requests to
//! ([`engines`]: `--service-discovery --selector k=v`), because it shares the Kubernetes
//! client set-up and the list/watch handling with the EndpointSlice peer source. Engines are
//! delivered differently from peers: as a bounded stream of [`EngineEvent`] edits that the
//! router applies to its worker registry, the same registry the static worker list fills.

mod args;
pub mod engines;
pub mod k8s;
mod peer_url;
mod registry;
mod source;

pub use args::PeerDiscoveryArgs;
pub use engines::{
    DEFAULT_ENGINE_NAMESPACE, DEFAULT_ENGINE_PORT, DiscoveredEngine, ENGINE_EVENT_CHANNEL_CAPACITY,
    ENGINE_PORT_ANNOTATION, EngineDiscoveryArgs, EngineDiscoveryConfig, EngineDiscoveryConfigError,
    EngineDiscoveryHandle, EngineEvent, MAX_SELECTOR_TERMS, MAX_TRACKED_ENGINE_PODS,
    engine_discovery_client, engine_of_pod, spawn_engine_discovery,
};
pub use k8s::{
    DEFAULT_PEER_PORT_NAME, KubernetesPeers, MAX_TRACKED_ENDPOINT_SLICES, PeerIpFamily,
    peers_from_slice,
};
pub use peer_url::{MAX_PEER_URL_BYTES, PeerUrl, PeerUrlError};
pub use registry::{MAX_PEERS, PeerRegistry, PeerSnapshot};
pub use source::{
    DNS_LOOKUP_TIMEOUT_MS, DNS_REFRESH_INTERVAL_MS, DnsPeers, DnsTarget, MAX_DNS_NAME_BYTES,
    PeerConfigError, PeerSourceConfig, PeerSourceError, PeerSourceHandle, StaticPeers,
    spawn_peer_source, static_peer_set,
};
