//! Peer sources: the three ways a replica learns its siblings, each a task feeding the
//! [`PeerRegistry`].
//!
//! Exactly one source runs per process. Each delivers *complete* answers through
//! [`PeerRegistry::replace`], never incremental edits, so the registry never has to reconcile
//! two writers and a partial answer can never be published. The sources differ in what
//! "complete" and "failure" mean:
//! - static list: complete at once, never changes;
//! - DNS: every successful lookup is complete; a failed lookup keeps the last answer, because
//!   a resolver hiccup must not look like "the fleet vanished". One failure is an answer: a
//!   name without address records (NXDOMAIN), which is how Kubernetes' DNS answers for a
//!   headless Service with no ready endpoint (the DNS spec, kubernetes/dns#245). Before any
//!   other answer it means "no siblings yet" and syncs the registry empty, so the first
//!   replicas of a fleet (whose Service publishes only ready addresses) do not hold readiness
//!   for a whole bootstrap deadline waiting on each other; after one, it keeps the last set
//!   like any failure (a resolver's transient NXDOMAIN must not empty a known fleet);
//! - Kubernetes: a relist is complete only at `InitDone` (the `k8s` module).

use std::collections::BTreeSet;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{DnsPeers, DnsTarget, KubeClientError, PeerSourceConfig, StaticPeers};
use crate::peer_url::PeerUrl;
use crate::registry::{PEERS_MAX, PeerRegistry};

/// How often the DNS source re-resolves the headless Service. Short enough that a new
/// sibling is seen well within a bootstrap deadline, long enough not to load the resolver.
pub const DNS_REFRESH_INTERVAL_MS: u64 = 5_000;
/// Upper bound on one DNS lookup, so a hung resolver delays a refresh instead of stopping it.
pub const DNS_LOOKUP_TIMEOUT_MS: u64 = 5_000;
/// During an outage, one warning per this many failed lookups in a row.
const DNS_FAILURE_LOG_EVERY: u64 = 100;

/// A running source. Dropping it stops the task too; [`Self::shutdown`] also waits for it.
#[derive(Debug)]
pub struct PeerSourceHandle {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl PeerSourceHandle {
    fn new(cancel: CancellationToken, task: JoinHandle<()>) -> Self {
        Self {
            cancel,
            task: Some(task),
        }
    }

    /// Stops the source and waits until it no longer writes the registry.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "peer source task ended abnormally");
        }
    }

    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for PeerSourceHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Starts `config`'s source feeding `registry`. Configuration problems that can be seen
/// before any I/O (bad Kubernetes config) are returned here so start-up fails loudly.
pub async fn spawn_peer_source(
    config: PeerSourceConfig,
    registry: PeerRegistry,
) -> Result<PeerSourceHandle, KubeClientError> {
    let cancel = CancellationToken::new();
    let task = match config {
        PeerSourceConfig::Static(cfg) => {
            registry.replace(static_peer_set(&cfg));
            tokio::spawn(async {})
        }
        PeerSourceConfig::Dns(cfg) => tokio::spawn(run_dns(cfg, registry, cancel.clone())),
        #[cfg(feature = "k8s")]
        PeerSourceConfig::Kubernetes(cfg) => {
            let (client, namespace) = crate::k8s::kube_client(&cfg).await?;
            tokio::spawn(crate::k8s::run_endpointslice_watch(
                client,
                namespace,
                cfg,
                registry,
                cancel.clone(),
            ))
        }
        #[cfg(not(feature = "k8s"))]
        PeerSourceConfig::Kubernetes(_) => return Err(KubeClientError::NotBuiltIn),
    };
    Ok(PeerSourceHandle::new(cancel, task))
}

/// The static list minus this replica.
pub fn static_peer_set(cfg: &StaticPeers) -> Vec<PeerUrl> {
    cfg.peers
        .iter()
        .filter(|p| Some(*p) != cfg.advertise_url.as_ref())
        .cloned()
        .collect()
}

/// Boxed future of one DNS answer; a seam so the failure path ("keep the last set")
/// can be driven in a unit test, since a real resolver cannot be made to fail on demand here.
type LookupFuture = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send>>;

pub(crate) trait Resolve: Send + Sync + 'static {
    fn lookup(&self, name: &str, port: u16) -> LookupFuture;
}

/// The system resolver (getaddrinfo via tokio), as a pod would use for a headless Service.
struct SystemResolver;

impl Resolve for SystemResolver {
    fn lookup(&self, name: &str, port: u16) -> LookupFuture {
        let name = name.to_string();
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((name.as_str(), port))
                .await
                .map_err(|e| {
                    if names_no_address(&e) {
                        io::Error::other(NoAddressRecords(e.to_string()))
                    } else {
                        e
                    }
                })?;
            // The registry keeps at most PEERS_MAX; taking one more lets it log the overflow.
            Ok(addrs.take(PEERS_MAX + 1).collect())
        })
    }
}

/// What getaddrinfo says of a name that has no address records (`EAI_NONAME`, `EAI_NODATA`), in
/// glibc's and musl's words: std keeps only this text of the code (`gai_strerror`), and the
/// image's distroless glibc base has no locale that would translate it. A wording not listed
/// here leaves the failure a plain one (the last set kept), never a wrong "no siblings".
const NO_ADDRESS_RECORDS_TEXTS: [&str; 4] = [
    "Name or service not known",
    "No address associated with hostname",
    "Name does not resolve",
    "Name has no usable address",
];

/// A lookup's answer that the name has no address records, carried inside the `io::Error` the
/// resolver seam returns. Its own type rather than an `ErrorKind`: `NotFound` could also be a
/// system error (`EAI_SYSTEM` with `ENOENT`), which must stay a plain failure.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct NoAddressRecords(String);

fn is_no_address_records(e: &io::Error) -> bool {
    e.get_ref()
        .is_some_and(|inner| inner.is::<NoAddressRecords>())
}

fn names_no_address(e: &io::Error) -> bool {
    let text = e.to_string();
    NO_ADDRESS_RECORDS_TEXTS.iter().any(|t| text.contains(t))
}

async fn run_dns(cfg: DnsPeers, registry: PeerRegistry, cancel: CancellationToken) {
    run_dns_with(SystemResolver, cfg, registry, cancel).await
}

pub(crate) async fn run_dns_with(
    resolver: impl Resolve,
    cfg: DnsPeers,
    registry: PeerRegistry,
    cancel: CancellationToken,
) {
    let exclude: BTreeSet<IpAddr> = cfg.exclude_ips.iter().map(IpAddr::to_canonical).collect();
    let interval = Duration::from_millis(cfg.refresh_interval_ms.max(1));
    let mut failures_in_a_row: u64 = 0;
    loop {
        let lookup = tokio::time::timeout(
            Duration::from_millis(DNS_LOOKUP_TIMEOUT_MS),
            resolver.lookup(&cfg.target.name, cfg.target.port),
        );
        let outcome = tokio::select! {
            _ = cancel.cancelled() => return,
            outcome = lookup => outcome,
        };
        match outcome {
            Ok(Ok(addrs)) => {
                failures_in_a_row = 0;
                let peers: Vec<PeerUrl> = addrs
                    .into_iter()
                    .filter(|a| !exclude.contains(&a.ip().to_canonical()))
                    .map(|a| PeerUrl::from_socket_addr(cfg.https, a))
                    .filter(|u| cfg.ip_family.admits(u))
                    .collect();
                if registry.replace(peers) {
                    tracing::info!(
                        name = %cfg.target.name,
                        peers = registry.len(),
                        "peer set changed (DNS)"
                    );
                }
            }
            Ok(Err(e)) if is_no_address_records(&e) && !registry.is_synced() => {
                failures_in_a_row = 0;
                registry.replace(Vec::new());
                tracing::info!(
                    name = %cfg.target.name,
                    error = %e,
                    "the siblings' DNS name has no address yet (a headless Service with no ready endpoint): no siblings"
                );
            }
            Ok(Err(e)) => {
                failures_in_a_row += 1;
                log_dns_failure(&cfg.target, failures_in_a_row, &e.to_string());
            }
            Err(_) => {
                failures_in_a_row += 1;
                log_dns_failure(&cfg.target, failures_in_a_row, "lookup timed out");
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// Logs the first failure and then every 100th , so a long outage does not flood the log.
fn log_dns_failure(target: &DnsTarget, failures_in_a_row: u64, error: &str) {
    if failures_in_a_row == 1 || failures_in_a_row.is_multiple_of(DNS_FAILURE_LOG_EVERY) {
        tracing::warn!(
            name = %target.name,
            port = target.port,
            failures_in_a_row,
            error,
            "peer DNS lookup failed; keeping the last peer set"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DNS_NAME_MAX_BYTES, PeerConfigError, PeerIpFamily};

    #[test]
    fn dns_target_parses_name_and_port() {
        assert_eq!(
            DnsTarget::parse("KVRoute-Internal.ns.svc:8081").unwrap(),
            DnsTarget {
                name: "kvroute-internal.ns.svc".into(),
                port: 8081
            }
        );
        for bad in [
            "router",
            "router:",
            ":8081",
            "router:0",
            "router:70000",
            "a b:1",
        ] {
            assert!(
                matches!(
                    DnsTarget::parse(bad),
                    Err(PeerConfigError::InvalidDnsTarget { .. })
                ),
                "{bad:?} was accepted"
            );
        }
        let long = format!("{}:1", "a".repeat(DNS_NAME_MAX_BYTES + 1));
        assert!(DnsTarget::parse(&long).is_err());
    }

    #[test]
    fn static_set_excludes_self_by_normalised_url() {
        let cfg = StaticPeers {
            peers: ["http://10.0.0.1:8081", "http://10.0.0.2:8081/"]
                .iter()
                .map(|u| PeerUrl::parse(u).unwrap())
                .collect(),
            advertise_url: Some(PeerUrl::parse("HTTP://10.0.0.2:8081").unwrap()),
        };
        assert_eq!(
            static_peer_set(&cfg),
            vec![PeerUrl::parse("http://10.0.0.1:8081").unwrap()]
        );
    }

    /// Scripted answers in order; after the script runs out every lookup fails. Counts calls
    /// so the test can wait until the failures have really been seen.
    struct ScriptedResolver {
        answers: parking_lot::Mutex<std::collections::VecDeque<io::Result<Vec<SocketAddr>>>>,
        calls: tokio::sync::watch::Sender<u64>,
    }

    impl Resolve for std::sync::Arc<ScriptedResolver> {
        fn lookup(&self, _name: &str, _port: u16) -> LookupFuture {
            self.calls.send_modify(|c| *c += 1);
            let answer = self
                .answers
                .lock()
                .pop_front()
                .unwrap_or_else(|| Err(io::Error::other("scripted SERVFAIL")));
            Box::pin(async move { answer })
        }
    }

    #[tokio::test]
    async fn dns_failure_keeps_the_last_peer_set_and_excludes_self() {
        let a: SocketAddr = "10.0.0.1:8081".parse().unwrap();
        let me: SocketAddr = "10.0.0.2:8081".parse().unwrap();
        let b: SocketAddr = "[fd00::3]:8081".parse().unwrap();
        let (calls, mut seen_calls) = tokio::sync::watch::channel(0u64);
        let resolver = std::sync::Arc::new(ScriptedResolver {
            answers: parking_lot::Mutex::new(
                [Err(io::Error::other("not yet")), Ok(vec![a, me, b])].into(),
            ),
            calls,
        });
        let registry = PeerRegistry::new();
        let cfg = DnsPeers {
            target: DnsTarget::parse("kvroute-internal:8081").unwrap(),
            https: false,
            exclude_ips: vec![me.ip()],
            ip_family: PeerIpFamily::Any,
            refresh_interval_ms: 5,
        };
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run_dns_with(
            resolver.clone(),
            cfg,
            registry.clone(),
            cancel.clone(),
        ));
        // Lookup 1 fails, 2 succeeds, 3.. all fail: wait until several failures have happened.
        let waited =
            tokio::time::timeout(Duration::from_secs(10), seen_calls.wait_for(|c| *c >= 6))
                .await
                .is_ok_and(|r| r.is_ok());
        assert!(
            waited,
            "waiting for 6 lookups, saw {}",
            *seen_calls.borrow()
        );
        let s = registry.snapshot();
        cancel.cancel();
        task.await.unwrap();
        assert!(s.synced, "one successful lookup must sync the registry");
        assert_eq!(
            s.peers.iter().map(PeerUrl::as_str).collect::<Vec<_>>(),
            ["http://10.0.0.1:8081", "http://[fd00::3]:8081"],
            "failed lookups after a success must keep the last set (and self stays out)"
        );
        assert_eq!(s.version, 1, "failures must not publish anything");
    }

    #[test]
    fn getaddrinfos_no_such_name_texts_are_told_from_other_failures() {
        for text in [
            "failed to lookup address information: Name or service not known",
            "failed to lookup address information: No address associated with hostname",
            "failed to lookup address information: Name does not resolve",
        ] {
            assert!(names_no_address(&io::Error::other(text)), "{text}");
        }
        for text in [
            "failed to lookup address information: Temporary failure in name resolution",
            "failed to lookup address information: Try again",
            "connection refused",
        ] {
            assert!(!names_no_address(&io::Error::other(text)), "{text}");
        }
        // A system error of kind NotFound (EAI_SYSTEM with ENOENT) is not an answer.
        assert!(!is_no_address_records(&io::Error::from(
            io::ErrorKind::NotFound
        )));
        assert!(is_no_address_records(&io::Error::other(NoAddressRecords(
            "Name or service not known".into()
        ))));
    }

    fn no_such_name() -> io::Result<Vec<SocketAddr>> {
        Err(io::Error::other(NoAddressRecords(
            "scripted NXDOMAIN".into(),
        )))
    }

    fn dns_peers(refresh_interval_ms: u64) -> DnsPeers {
        DnsPeers {
            target: DnsTarget::parse("kvroute-internal:8081").unwrap(),
            https: false,
            exclude_ips: Vec::new(),
            ip_family: PeerIpFamily::Any,
            refresh_interval_ms,
        }
    }

    /// Runs the DNS source over `answers` (then failures) until it has made `lookups` lookups;
    /// returns the registry's snapshot then.
    async fn after_lookups(
        answers: Vec<io::Result<Vec<SocketAddr>>>,
        lookups: u64,
    ) -> crate::registry::PeerSnapshot {
        let (calls, mut seen_calls) = tokio::sync::watch::channel(0u64);
        let resolver = std::sync::Arc::new(ScriptedResolver {
            answers: parking_lot::Mutex::new(answers.into()),
            calls,
        });
        let registry = PeerRegistry::new();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run_dns_with(
            resolver,
            dns_peers(5),
            registry.clone(),
            cancel.clone(),
        ));
        tokio::time::timeout(
            Duration::from_secs(10),
            seen_calls.wait_for(|c| *c >= lookups),
        )
        .await
        .unwrap_or_else(|_| panic!("waiting for {lookups} lookups"))
        .unwrap();
        let snapshot = registry.snapshot();
        cancel.cancel();
        task.await.unwrap();
        snapshot
    }

    #[tokio::test]
    async fn a_name_without_addresses_before_any_answer_syncs_the_registry_empty() {
        let s = after_lookups(vec![no_such_name(), no_such_name()], 2).await;
        assert!(
            s.synced,
            "NXDOMAIN is Kubernetes' answer for no ready sibling"
        );
        assert!(s.peers.is_empty(), "{:?}", s.peers);
    }

    #[tokio::test]
    async fn a_name_without_addresses_after_an_answer_keeps_the_last_set() {
        let a: SocketAddr = "10.0.0.1:8081".parse().unwrap();
        let s = after_lookups(vec![Ok(vec![a]), no_such_name(), no_such_name()], 4).await;
        assert_eq!(
            s.peers.iter().map(PeerUrl::as_str).collect::<Vec<_>>(),
            ["http://10.0.0.1:8081"],
            "a transient NXDOMAIN must not empty a known fleet"
        );
    }

    #[tokio::test]
    async fn dns_failures_from_the_start_leave_the_registry_unsynced() {
        // No scripted answer: every lookup fails as a resolver outage would (not NXDOMAIN).
        let s = after_lookups(Vec::new(), 3).await;
        assert!(
            !s.synced,
            "a never-resolved name is not \"synced and alone\""
        );
    }
}
