//! Command-line flags for peer discovery, ready to be flattened into the router's CLI.
//!
//! The flags select at most one source; the downward-API variables (`POD_NAME`,
//! `POD_NAMESPACE`, `POD_IP`) are read from the environment because that is how a pod learns
//! its own identity, which every source needs to leave itself out of its sibling set.
//! Validation is a separate typed step ([`PeerDiscoveryArgs::to_config`]) so that a struct
//! built in code gets the same checks as one parsed by clap.

use std::net::IpAddr;

use crate::config::{
    DEFAULT_PEER_PORT_NAME, DnsPeers, DnsTarget, KubernetesPeers, PeerConfigError, PeerIpFamily,
    PeerSourceConfig, StaticPeers,
};
use crate::peer_url::PeerUrl;
use crate::registry::PEERS_MAX;
use crate::source::DNS_REFRESH_INTERVAL_MS;

/// Peer discovery flags (`#[command(flatten)]` them into the router's arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct PeerDiscoveryArgs {
    /// Static sibling list: base URLs of the siblings' internal listeners, comma separated.
    #[arg(long = "kv-peers", env = "KVROUTE_KV_PEERS", value_delimiter = ',')]
    pub kv_peers: Vec<String>,
    /// Headless Service `NAME:PORT` whose A/AAAA records are the siblings.
    #[arg(long = "kv-peer-dns", env = "KVROUTE_KV_PEER_DNS")]
    pub kv_peer_dns: Option<String>,
    /// Label selector for the siblings' EndpointSlices, e.g.
    /// `kubernetes.io/service-name=kvroute-internal`.
    #[arg(long = "kv-peer-selector", env = "KVROUTE_KV_PEER_SELECTOR")]
    pub kv_peer_selector: Option<String>,
    /// EndpointSlice port name of the siblings' internal listener.
    #[arg(long = "kv-peer-port-name", env = "KVROUTE_KV_PEER_PORT_NAME", default_value = DEFAULT_PEER_PORT_NAME)]
    pub kv_peer_port_name: String,
    /// Address families siblings are dialled on: any, ipv4 or ipv6 (match the family the
    /// internal listener binds; restrict it for DNS in dual-stack clusters).
    #[arg(
        long = "kv-peer-ip-family",
        env = "KVROUTE_KV_PEER_IP_FAMILY",
        value_enum,
        default_value = "any"
    )]
    pub kv_peer_ip_family: PeerIpFamily,
    /// This replica's own internal base URL as siblings see it; excluded from the peer set.
    /// Its scheme (http/https) is also the scheme used to reach siblings.
    #[arg(long = "advertise-url", env = "KVROUTE_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Downward API: this pod's name (self-exclusion by EndpointSlice targetRef); falls back
    /// to `HOSTNAME`, which Kubernetes sets to the pod name.
    #[arg(long = "pod-name", env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Downward API: this pod's namespace (the namespace whose EndpointSlices are watched).
    #[arg(long = "pod-namespace", env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
    /// Downward API: this pod's IP (self-exclusion by address).
    #[arg(long = "pod-ip", env = "POD_IP")]
    pub pod_ip: Option<IpAddr>,
}

impl PeerDiscoveryArgs {
    /// The configured source, `None` when peer discovery is off.
    pub fn to_config(&self) -> Result<Option<PeerSourceConfig>, PeerConfigError> {
        let given: Vec<&str> = [
            (!self.kv_peers.is_empty()).then_some("--kv-peers"),
            self.kv_peer_dns.is_some().then_some("--kv-peer-dns"),
            self.kv_peer_selector
                .is_some()
                .then_some("--kv-peer-selector"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if given.len() > 1 {
            return Err(PeerConfigError::ConflictingSources(given.join(", ")));
        }
        let advertise_url = self
            .advertise_url
            .as_deref()
            .map(PeerUrl::parse)
            .transpose()
            .map_err(PeerConfigError::InvalidAdvertiseUrl)?;
        let https = advertise_url
            .as_ref()
            .is_some_and(|u| u.as_str().starts_with("https://"));
        if !self.kv_peers.is_empty() {
            if self.kv_peers.len() > PEERS_MAX {
                return Err(PeerConfigError::TooManyPeers {
                    count: self.kv_peers.len(),
                });
            }
            let peers = self
                .kv_peers
                .iter()
                .filter(|p| !p.trim().is_empty())
                .map(|p| PeerUrl::parse(p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(PeerConfigError::InvalidPeerUrl)?;
            return Ok(Some(PeerSourceConfig::Static(StaticPeers {
                peers,
                advertise_url,
            })));
        }
        if let Some(raw) = &self.kv_peer_dns {
            let target = DnsTarget::parse(raw)?;
            let exclude_ips = self
                .pod_ip
                .into_iter()
                .chain(advertise_url.as_ref().and_then(PeerUrl::ip))
                .collect();
            return Ok(Some(PeerSourceConfig::Dns(DnsPeers {
                target,
                https,
                exclude_ips,
                ip_family: self.kv_peer_ip_family,
                refresh_interval_ms: DNS_REFRESH_INTERVAL_MS,
            })));
        }
        if let Some(selector) = &self.kv_peer_selector {
            if selector.trim().is_empty() {
                return Err(PeerConfigError::EmptySelector);
            }
            return Ok(Some(PeerSourceConfig::Kubernetes(KubernetesPeers {
                label_selector: selector.trim().to_string(),
                namespace: self.pod_namespace.clone(),
                // Kubernetes sets HOSTNAME to the pod name unless the spec overrides it.
                pod_name: self
                    .pod_name
                    .clone()
                    .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty())),
                pod_ip: self
                    .pod_ip
                    .or_else(|| advertise_url.as_ref().and_then(PeerUrl::ip)),
                port_name: self.kv_peer_port_name.clone(),
                https,
                ip_family: self.kv_peer_ip_family,
                api_server_url: None,
            })));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        peers: PeerDiscoveryArgs,
    }

    fn parse(args: &[&str]) -> PeerDiscoveryArgs {
        let mut argv = vec!["kvroute"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().peers
    }

    #[test]
    fn static_list_is_parsed_and_normalised() {
        let a = parse(&[
            "--kv-peers",
            "http://10.0.0.1:8081/,10.0.0.2:8081",
            "--advertise-url",
            "http://10.0.0.2:8081",
        ]);
        let Some(PeerSourceConfig::Static(s)) = a.to_config().unwrap() else {
            panic!("expected a static source");
        };
        assert_eq!(s.peers.len(), 2);
        assert_eq!(s.advertise_url.unwrap().as_str(), "http://10.0.0.2:8081");
    }

    #[test]
    fn two_sources_are_a_typed_conflict() {
        let a = parse(&["--kv-peers", "http://a:1", "--kv-peer-dns", "svc:8081"]);
        assert!(matches!(
            a.to_config(),
            Err(PeerConfigError::ConflictingSources(_))
        ));
    }

    #[test]
    fn dns_source_excludes_pod_ip_and_advertised_ip() {
        let a = parse(&[
            "--kv-peer-dns",
            "kvroute-internal:8081",
            "--pod-ip",
            "10.0.0.7",
            "--advertise-url",
            "https://10.0.0.8:8081",
        ]);
        let Some(PeerSourceConfig::Dns(d)) = a.to_config().unwrap() else {
            panic!("expected a DNS source");
        };
        assert!(d.https);
        assert_eq!(d.ip_family, PeerIpFamily::Any);
        assert_eq!(
            d.exclude_ips,
            vec![
                "10.0.0.7".parse::<IpAddr>().unwrap(),
                "10.0.0.8".parse::<IpAddr>().unwrap()
            ]
        );
        assert_eq!(d.refresh_interval_ms, DNS_REFRESH_INTERVAL_MS);
    }

    #[test]
    fn selector_source_carries_pod_identity_and_port_name() {
        let a = parse(&[
            "--kv-peer-selector",
            "kubernetes.io/service-name=kvroute-internal",
            "--pod-name",
            "kvroute-0",
            "--pod-namespace",
            "prod",
            "--kv-peer-ip-family",
            "ipv6",
        ]);
        let Some(PeerSourceConfig::Kubernetes(k)) = a.to_config().unwrap() else {
            panic!("expected a kubernetes source");
        };
        assert_eq!(k.port_name, "internal");
        assert_eq!(k.pod_name.as_deref(), Some("kvroute-0"));
        assert_eq!(k.namespace.as_deref(), Some("prod"));
        assert_eq!(k.ip_family, PeerIpFamily::V6Only);
        assert!(matches!(
            parse(&["--kv-peer-selector", " "]).to_config(),
            Err(PeerConfigError::EmptySelector)
        ));
    }

    #[test]
    fn bad_values_are_typed_errors() {
        assert!(matches!(
            parse(&["--kv-peers", "ftp://x"]).to_config(),
            Err(PeerConfigError::InvalidPeerUrl(_))
        ));
        assert!(matches!(
            parse(&["--kv-peer-dns", "nope"]).to_config(),
            Err(PeerConfigError::InvalidDnsTarget { .. })
        ));
        assert!(matches!(
            parse(&["--kv-peers", "http://a:1", "--advertise-url", "x?y"]).to_config(),
            Err(PeerConfigError::InvalidAdvertiseUrl(_))
        ));
    }
}
