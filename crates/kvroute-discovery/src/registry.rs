//! `PeerRegistry`: the current set of sibling routers, shared by the discovery source that
//! writes it and the bootstrap sweep that reads it.
//!
//! It is synchronous and does no I/O so the sweep can read it from anywhere. State lives in a
//! `tokio::sync::watch` channel: readers take cheap snapshots, and a consumer that must wait
//! for "discovery has spoken" awaits a change instead of polling. Three facts are kept apart
//! because the bootstrap verdict depends on them: `synced` (a source has delivered at least
//! one complete answer), the current `peers`, and `ever_had_peers`. "Synced, empty, never had
//! peers" is the only state that means "I am the first replica"; an unsynced registry or a
//! transiently empty one is not conclusive. Each publication carries a `version` so an observer
//! can prove it saw every published state (no gaps in versions), not just the latest.

use std::collections::BTreeSet;
use std::sync::Arc;

use prometheus::IntGauge;
use rand::seq::SliceRandom;
use tokio::sync::watch;

use crate::peer_url::PeerUrl;

/// Most siblings one registry holds. A router fleet is a handful of replicas; a larger answer
/// means a wrong selector or DNS name, and holding it would only slow every sweep down.
pub const PEERS_MAX: usize = 1024;

/// One published state of the registry.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PeerSnapshot {
    /// Sorted, deduplicated sibling base URLs (self already excluded by the source).
    pub peers: Vec<PeerUrl>,
    /// A source has delivered at least one complete answer.
    pub synced: bool,
    /// Some publication since start had at least one peer.
    pub ever_had_peers: bool,
    /// Number of publications so far; the initial unsynced state is version 0.
    pub version: u64,
}

impl PeerSnapshot {
    /// Discovery is authoritative that this replica is alone and always was: the only state in
    /// which a booting replica may stop looking for a warm sibling.
    pub fn known_to_have_no_peers(&self) -> bool {
        self.synced && self.peers.is_empty() && !self.ever_had_peers
    }
}

#[derive(Debug)]
struct Gauges {
    peers: IntGauge,
    synced: IntGauge,
}

#[derive(Debug)]
struct Inner {
    state: watch::Sender<PeerSnapshot>,
    gauges: Option<Gauges>,
}

/// Cheaply cloneable handle to the sibling set.
#[derive(Debug, Clone)]
pub struct PeerRegistry {
    inner: Arc<Inner>,
}

impl Default for PeerRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl PeerRegistry {
    /// A registry without metrics (tests, tools).
    pub fn new() -> Self {
        Self::build(None)
    }

    /// A registry exporting `kvroute_peers` and `kvroute_peers_synced` on `metrics`.
    pub fn with_metrics(metrics: &prometheus::Registry) -> Result<Self, prometheus::Error> {
        let peers = IntGauge::new(
            "kvroute_peers",
            "Sibling routers currently known to peer discovery (self excluded).",
        )?;
        let synced = IntGauge::new(
            "kvroute_peers_synced",
            "1 once peer discovery has delivered a complete answer; 0 while never synced.",
        )?;
        metrics.register(Box::new(peers.clone()))?;
        metrics.register(Box::new(synced.clone()))?;
        Ok(Self::build(Some(Gauges { peers, synced })))
    }

    fn build(gauges: Option<Gauges>) -> Self {
        let (state, _) = watch::channel(PeerSnapshot::default());
        Self {
            inner: Arc::new(Inner { state, gauges }),
        }
    }

    /// Installs a complete answer from a source. Marks the registry synced. Publishes (and
    /// bumps `version`) only when something observable changed, so consumers wake on news.
    /// Beyond [`PEERS_MAX`] the lowest URLs are kept, deterministically. Returns whether a
    /// new state was published.
    pub fn replace(&self, peers: impl IntoIterator<Item = PeerUrl>) -> bool {
        let mut set: BTreeSet<PeerUrl> = BTreeSet::new();
        let mut dropped_over_limit = 0usize;
        for peer in peers {
            if set.len() < PEERS_MAX || set.contains(&peer) {
                set.insert(peer);
            } else if let Some(last) = set.last().cloned() {
                dropped_over_limit += 1;
                if peer < last {
                    set.remove(&last);
                    set.insert(peer);
                }
            }
        }
        if dropped_over_limit > 0 {
            tracing::warn!(
                dropped_over_limit,
                limit = PEERS_MAX,
                "peer discovery answered more siblings than the limit; keeping the lowest URLs"
            );
        }
        let peers: Vec<PeerUrl> = set.into_iter().collect();
        let published = self.inner.state.send_if_modified(|s| {
            if s.synced && s.peers == peers {
                return false;
            }
            s.ever_had_peers |= !peers.is_empty();
            s.peers = peers;
            s.synced = true;
            s.version += 1;
            true
        });
        if let Some(g) = &self.inner.gauges {
            let s = self.inner.state.borrow();
            g.peers.set(s.peers.len() as i64);
            g.synced.set(i64::from(s.synced));
        }
        published
    }

    /// A consistent copy of the current state.
    pub fn snapshot(&self) -> PeerSnapshot {
        self.inner.state.borrow().clone()
    }

    /// The current peers in random order, so replicas booting together spread their snapshot
    /// fetches over the fleet instead of all hitting the lowest URL.
    pub fn candidates(&self) -> Vec<PeerUrl> {
        let mut peers = self.inner.state.borrow().peers.clone();
        peers.shuffle(&mut rand::rng());
        peers
    }

    pub fn is_synced(&self) -> bool {
        self.inner.state.borrow().synced
    }

    pub fn len(&self) -> usize {
        self.inner.state.borrow().peers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn known_to_have_no_peers(&self) -> bool {
        self.inner.state.borrow().known_to_have_no_peers()
    }

    /// Waits until a source has delivered its first complete answer; returns that state.
    /// Callers bound it with their own deadline (`tokio::time::timeout`).
    pub async fn wait_synced(&self) -> PeerSnapshot {
        let mut rx = self.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        match rx.wait_for(|s| s.synced).await {
            Ok(s) => s.clone(),
            Err(_) => self.snapshot(),
        }
    }

    /// A receiver that wakes on every publication (see [`PeerSnapshot::version`]).
    pub fn subscribe(&self) -> watch::Receiver<PeerSnapshot> {
        self.inner.state.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(list: &[&str]) -> Vec<PeerUrl> {
        list.iter().map(|u| PeerUrl::parse(u).unwrap()).collect()
    }

    #[test]
    fn new_registry_is_unsynced_and_not_conclusively_alone() {
        let r = PeerRegistry::new();
        let s = r.snapshot();
        assert!(!s.synced);
        assert!(s.peers.is_empty());
        assert!(!s.known_to_have_no_peers());
        assert_eq!(s.version, 0);
    }

    #[test]
    fn synced_empty_means_alone_only_if_never_had_peers() {
        let r = PeerRegistry::new();
        assert!(r.replace(Vec::new()));
        assert!(r.is_synced());
        assert!(r.known_to_have_no_peers());
        assert!(r.replace(urls(&["http://a:1"])));
        assert!(!r.known_to_have_no_peers());
        assert!(r.replace(Vec::new()));
        let s = r.snapshot();
        assert!(s.synced && s.peers.is_empty() && s.ever_had_peers);
        assert!(
            !s.known_to_have_no_peers(),
            "a transient empty set after having peers is not conclusive"
        );
    }

    #[test]
    fn replace_dedupes_sorts_and_publishes_only_changes() {
        let r = PeerRegistry::new();
        assert!(r.replace(urls(&["http://b:1", "http://a:1", "http://b:1/"])));
        let s = r.snapshot();
        assert_eq!(s.peers, urls(&["http://a:1", "http://b:1"]));
        assert_eq!(s.version, 1);
        assert!(!r.replace(urls(&["http://a:1", "http://b:1"])));
        assert_eq!(r.snapshot().version, 1);
        assert!(r.replace(urls(&["http://a:1"])));
        assert_eq!(r.snapshot().version, 2);
    }

    #[test]
    fn candidates_are_a_permutation_of_the_peers() {
        let r = PeerRegistry::new();
        let all: Vec<String> = (0..32).map(|i| format!("http://10.0.0.{i}:8081")).collect();
        r.replace(all.iter().map(|u| PeerUrl::parse(u).unwrap()));
        let mut orders = BTreeSet::new();
        for _ in 0..20 {
            let mut c = r.candidates();
            orders.insert(c.clone());
            c.sort();
            assert_eq!(c, r.snapshot().peers);
        }
        assert!(orders.len() > 1, "20 shuffles of 32 peers gave one order");
    }

    #[test]
    fn replace_caps_the_set_at_max_peers_keeping_the_lowest() {
        let r = PeerRegistry::new();
        let many: Vec<PeerUrl> = (0..PEERS_MAX + 10)
            .rev()
            .map(|i| PeerUrl::parse(&format!("http://h{i:05}:1")).unwrap())
            .collect();
        r.replace(many);
        let s = r.snapshot();
        assert_eq!(s.peers.len(), PEERS_MAX);
        assert_eq!(s.peers[0].as_str(), "http://h00000:1");
        assert_eq!(
            s.peers[PEERS_MAX - 1].as_str(),
            format!("http://h{:05}:1", PEERS_MAX - 1)
        );
    }

    #[test]
    fn gauges_follow_the_registry() {
        let metrics = prometheus::Registry::new();
        let r = PeerRegistry::with_metrics(&metrics).unwrap();
        let read = |name: &str| {
            metrics
                .gather()
                .iter()
                .find(|f| f.name() == name)
                .map(|f| f.get_metric()[0].get_gauge().get_value())
        };
        assert_eq!(read("kvroute_peers_synced"), Some(0.0));
        r.replace(urls(&["http://a:1", "http://b:1"]));
        assert_eq!(read("kvroute_peers"), Some(2.0));
        assert_eq!(read("kvroute_peers_synced"), Some(1.0));
        assert!(
            PeerRegistry::with_metrics(&metrics).is_err(),
            "a second registration of the same names must fail, not double count"
        );
    }

    #[tokio::test]
    async fn subscribers_wake_on_publication() {
        let r = PeerRegistry::new();
        let mut rx = r.subscribe();
        let writer = r.clone();
        tokio::spawn(async move { writer.replace(urls(&["http://a:1"])) });
        let s = tokio::time::timeout(std::time::Duration::from_secs(5), rx.wait_for(|s| s.synced))
            .await
            .expect("waiting for the registry to publish a synced state")
            .unwrap()
            .clone();
        assert_eq!(s.peers, urls(&["http://a:1"]));
    }
}
