//! The configuration of peer discovery: which source feeds the registry and what each needs to
//! leave this replica out. Plain data, compiled with or without Kubernetes support, so the flags
//! parse and validate the same in every build; [`crate::source`] runs the chosen source.

use std::net::IpAddr;

use thiserror::Error;

use crate::peer_url::{PeerUrl, PeerUrlError};
use crate::registry::PEERS_MAX;

/// Longest DNS name accepted (the DNS limit for a full name).
pub const DNS_NAME_MAX_BYTES: usize = 253;
/// Which source feeds the registry, with everything it needs to exclude this replica.
#[derive(Debug, Clone)]
pub enum PeerSourceConfig {
    Static(StaticPeers),
    Dns(DnsPeers),
    Kubernetes(KubernetesPeers),
}

/// `--kv-peers`: a fixed list; this replica's own `--advertise-url` is removed from it.
#[derive(Debug, Clone)]
pub struct StaticPeers {
    pub peers: Vec<PeerUrl>,
    pub advertise_url: Option<PeerUrl>,
}

/// `--kv-peer-dns NAME:PORT`: the A/AAAA records of a headless Service.
#[derive(Debug, Clone)]
pub struct DnsPeers {
    pub target: DnsTarget,
    /// Peers are dialled with `https://` instead of `http://`.
    pub https: bool,
    /// Addresses that are this replica (`POD_IP`, the advertise URL's host when it is an IP).
    pub exclude_ips: Vec<IpAddr>,
    /// Families kept from the answer. DNS cannot tell that an A and an AAAA record are one
    /// dual-stack pod, so in a dual-stack cluster restrict this to one family.
    pub ip_family: PeerIpFamily,
    pub refresh_interval_ms: u64,
}

/// A validated `NAME:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsTarget {
    pub name: String,
    pub port: u16,
}

impl DnsTarget {
    pub fn parse(raw: &str) -> Result<Self, PeerConfigError> {
        let bad = |why: &'static str| PeerConfigError::InvalidDnsTarget {
            raw: raw.chars().take(DNS_NAME_MAX_BYTES + 8).collect(),
            why,
        };
        let (name, port) = raw
            .trim()
            .rsplit_once(':')
            .ok_or_else(|| bad("expected NAME:PORT"))?;
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("port must be 1..=65535"))?;
        if name.is_empty() {
            return Err(bad("empty name"));
        }
        if name.len() > DNS_NAME_MAX_BYTES {
            return Err(bad("name longer than 253 bytes"));
        }
        let valid = name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
        if !valid {
            return Err(bad("name has characters a DNS name cannot have"));
        }
        Ok(Self {
            name: name.to_ascii_lowercase(),
            port,
        })
    }
}

/// A peer discovery configuration that cannot work.
#[derive(Debug, Error)]
pub enum PeerConfigError {
    #[error("invalid --kv-peers entry: {0}")]
    InvalidPeerUrl(#[source] PeerUrlError),
    #[error("invalid --advertise-url: {0}")]
    InvalidAdvertiseUrl(#[source] PeerUrlError),
    #[error("--kv-peers lists {count} peers, over the limit of {PEERS_MAX}")]
    TooManyPeers { count: usize },
    #[error("invalid --kv-peer-dns {raw:?}: {why}")]
    InvalidDnsTarget { raw: String, why: &'static str },
    #[error("--kv-peer-selector is empty")]
    EmptySelector,
    #[error("only one peer source may be given; got {0}")]
    ConflictingSources(String),
}

/// Port name preferred among a slice's ports when none is configured.
pub const DEFAULT_PEER_PORT_NAME: &str = "internal";

/// `--kv-peer-selector` and this pod's identity, for self-exclusion.
#[derive(Debug, Clone)]
pub struct KubernetesPeers {
    pub label_selector: String,
    /// `POD_NAMESPACE`; `None` uses the namespace of the inferred kube config.
    pub namespace: Option<String>,
    /// `POD_NAME`: endpoints whose `targetRef` names this pod are us.
    pub pod_name: Option<String>,
    /// `POD_IP`: endpoints with this address are us (also the fallback without a targetRef).
    pub pod_ip: Option<IpAddr>,
    /// The slice port whose name equals this is the internal listener (else the first port).
    pub port_name: String,
    /// Peers are dialled with `https://` instead of `http://`.
    pub https: bool,
    /// Which address families may be dialled (follow the family the internal listener binds).
    pub ip_family: PeerIpFamily,
    /// Talk to this API server instead of inferring in-cluster/kubeconfig settings (tests).
    pub api_server_url: Option<String>,
}

impl KubernetesPeers {
    pub fn new(label_selector: impl Into<String>) -> Self {
        Self {
            label_selector: label_selector.into(),
            namespace: None,
            pod_name: None,
            pod_ip: None,
            port_name: DEFAULT_PEER_PORT_NAME.to_string(),
            https: false,
            ip_family: PeerIpFamily::Any,
            api_server_url: None,
        }
    }
}

/// Address families a sibling may be reached on. In a dual-stack cluster a Service has one
/// slice per family listing the same pods; with `Any`, each pod is still one peer (its IPv4
/// address preferred), so a sibling is never counted or fetched from twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PeerIpFamily {
    /// Both families; one peer per pod where the source can tell (EndpointSlices).
    #[default]
    Any,
    /// IPv4 addresses only.
    #[value(name = "ipv4")]
    V4Only,
    /// IPv6 addresses only.
    #[value(name = "ipv6")]
    V6Only,
}

impl PeerIpFamily {
    pub fn admits(self, url: &PeerUrl) -> bool {
        match (self, url.ip()) {
            (Self::Any, _) => true,
            (Self::V4Only, Some(ip)) => ip.is_ipv4(),
            (Self::V6Only, Some(ip)) => ip.is_ipv6(),
            // A hostname (FQDN slice) is resolved at dial time; the family is not ours to judge.
            (_, None) => true,
        }
    }
}

/// Building a Kubernetes client failed (peer or engine discovery cannot start).
#[derive(Debug, Error)]
pub enum KubeClientError {
    #[error("kubernetes API server URL {0:?} is not a valid URI")]
    InvalidApiServerUrl(String),
    #[cfg(feature = "k8s")]
    #[error("no kubernetes configuration (in-cluster or kubeconfig): {0}")]
    KubeConfig(#[from] kube::config::InferConfigError),
    #[cfg(feature = "k8s")]
    #[error("building the kubernetes client failed: {0}")]
    KubeClient(#[from] kube::Error),
    /// The binary was built without the `k8s` feature (e.g. the demo): a configuration that
    /// asks for Kubernetes discovery is refused at start-up rather than silently ignored.
    #[cfg(not(feature = "k8s"))]
    #[error("this build has no Kubernetes support (built without the `k8s` feature)")]
    NotBuiltIn,
}
