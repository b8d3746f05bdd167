//! The static and DNS peer sources through `spawn_peer_source`, with the real system
//! resolver: `localhost` stands in for a headless Service name (it resolves to 127.0.0.1 and,
//! where configured, ::1), so no DNS server or /etc/hosts edit is needed.

mod support;

use std::net::{IpAddr, Ipv4Addr};

use kvroute_discovery::{
    DnsPeers, DnsTarget, PeerDiscoveryArgs, PeerIpFamily, PeerRegistry, PeerSourceConfig, PeerUrl,
    StaticPeers, spawn_peer_source,
};
use support::{urls, wait_for_state};

#[tokio::test]
async fn static_list_is_synced_at_once_without_this_replica() {
    let registry = PeerRegistry::new();
    let cfg = StaticPeers {
        peers: [
            "http://10.0.0.1:8081",
            "HTTP://10.0.0.2:8081/",
            "10.0.0.3:8081",
        ]
        .iter()
        .map(|u| PeerUrl::parse(u).unwrap())
        .collect(),
        advertise_url: Some(PeerUrl::parse("http://10.0.0.2:8081").unwrap()),
    };
    let handle = spawn_peer_source(PeerSourceConfig::Static(cfg), registry.clone())
        .await
        .unwrap();
    let s = registry.snapshot();
    assert!(
        s.synced,
        "a static list is complete as soon as the source starts"
    );
    assert_eq!(urls(&s), ["http://10.0.0.1:8081", "http://10.0.0.3:8081"]);
    handle.shutdown().await;
}

#[tokio::test]
async fn static_list_of_only_this_replica_means_alone() {
    let registry = PeerRegistry::new();
    let me = PeerUrl::parse("http://10.0.0.2:8081").unwrap();
    let cfg = StaticPeers {
        peers: vec![me.clone()],
        advertise_url: Some(me),
    };
    let handle = spawn_peer_source(PeerSourceConfig::Static(cfg), registry.clone())
        .await
        .unwrap();
    assert!(registry.known_to_have_no_peers());
    handle.shutdown().await;
}

fn dns_config(exclude_ips: Vec<IpAddr>) -> DnsPeers {
    DnsPeers {
        target: DnsTarget::parse("localhost:18081").unwrap(),
        https: false,
        exclude_ips,
        ip_family: PeerIpFamily::Any,
        refresh_interval_ms: 20,
    }
}

#[tokio::test]
async fn dns_source_resolves_the_name_to_peer_urls_on_the_port() {
    let registry = PeerRegistry::new();
    let handle = spawn_peer_source(
        PeerSourceConfig::Dns(dns_config(Vec::new())),
        registry.clone(),
    )
    .await
    .unwrap();
    let s = wait_for_state(&mut registry.subscribe(), "localhost to resolve", |s| {
        s.synced
    })
    .await;
    let peers = urls(&s);
    assert!(
        peers.contains(&"http://127.0.0.1:18081".to_string()),
        "localhost did not give 127.0.0.1: {peers:?}"
    );
    assert!(
        s.peers
            .iter()
            .all(|p| p.ip().is_some_and(|ip| ip.is_loopback())),
        "localhost gave a non-loopback peer: {peers:?}"
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn dns_source_leaves_out_this_pods_ip() {
    let registry = PeerRegistry::new();
    let cfg = dns_config(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    let handle = spawn_peer_source(PeerSourceConfig::Dns(cfg), registry.clone())
        .await
        .unwrap();
    let s = wait_for_state(&mut registry.subscribe(), "localhost to resolve", |s| {
        s.synced
    })
    .await;
    assert!(
        !urls(&s).contains(&"http://127.0.0.1:18081".to_string()),
        "own IP was not excluded: {:?}",
        urls(&s)
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn dns_source_is_reachable_from_the_cli_flags() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        peers: PeerDiscoveryArgs,
    }
    let cli = Cli::try_parse_from([
        "kvroute",
        "--kv-peer-dns",
        "localhost:18082",
        "--pod-ip",
        "127.0.0.1",
    ])
    .unwrap();
    let cfg = cli.peers.to_config().unwrap().expect("a DNS source");
    let registry = PeerRegistry::new();
    let handle = spawn_peer_source(cfg, registry.clone()).await.unwrap();
    let s = wait_for_state(&mut registry.subscribe(), "localhost to resolve", |s| {
        s.synced
    })
    .await;
    assert!(
        s.peers
            .iter()
            .all(|p| p.port() == 18082 && p.ip() != Some(IpAddr::V4(Ipv4Addr::LOCALHOST)))
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn dns_source_restricted_to_ipv4_never_yields_an_ipv6_peer() {
    let registry = PeerRegistry::new();
    let cfg = DnsPeers {
        ip_family: PeerIpFamily::V4Only,
        ..dns_config(Vec::new())
    };
    let handle = spawn_peer_source(PeerSourceConfig::Dns(cfg), registry.clone())
        .await
        .unwrap();
    let s = wait_for_state(&mut registry.subscribe(), "localhost to resolve", |s| {
        s.synced
    })
    .await;
    assert_eq!(urls(&s), ["http://127.0.0.1:18081"]);
    handle.shutdown().await;
}
