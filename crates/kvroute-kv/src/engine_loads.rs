//! The engines' own load reports (SGLang's ZMQ load feed), as the router's routing path reads
//! them: one entry per worker URL holding every DP rank's latest report.
//!
//! Why keyed by URL and not by rank: the routing path reads the load of EVERY rank of every
//! routable worker for every request. Keyed by `(url, dp_rank)`, each read built a key (an
//! allocation) and took the lock, a thousand times per request in a 1,024-rank fleet. Keyed by
//! URL, a plan takes the lock once per worker, looks the worker up by `&str` (no key to build)
//! and reads its ranks from a slice. The pump is the only writer; readers never wait on each
//! other.
//!
//! Each report keeps the instant it arrived: the routing path trusts a report's in-flight count
//! over the sibling routers' shared bookings only while it is younger than a sibling's frame
//! could be (an engine that publishes on every change reports a finished request at once, where
//! a sibling's bookings still count it until its next frame).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvroute_wire::LoadStat;
use parking_lot::RwLock;

use crate::status::RankKey;

/// One rank's latest report and when it arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportedLoad {
    pub stat: LoadStat,
    pub received_at: Instant,
}

/// Latest engine-reported load per worker URL, one slot per DP rank.
#[derive(Debug, Default)]
pub struct EngineLoads {
    by_url: RwLock<HashMap<Arc<str>, Vec<Option<ReportedLoad>>>>,
}

impl EngineLoads {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `stat` for a rank. Only the pump calls this, for ranks it has registered, so
    /// `dp_rank` is bounded by the worker's registered DP size.
    pub fn set(&self, key: &RankKey, stat: LoadStat) {
        let reported = ReportedLoad {
            stat,
            received_at: Instant::now(),
        };
        let mut map = self.by_url.write();
        let ranks = map.entry(key.url.clone()).or_default();
        let slot = key.dp_rank as usize;
        if ranks.len() <= slot {
            ranks.resize(slot + 1, None);
        }
        ranks[slot] = Some(reported);
    }

    /// Forgets one rank's report (the worker's entry goes with its last rank).
    pub fn remove_rank(&self, key: &RankKey) {
        let mut map = self.by_url.write();
        if let Some(ranks) = map.get_mut(&*key.url) {
            if let Some(slot) = ranks.get_mut(key.dp_rank as usize) {
                *slot = None;
            }
            if ranks.iter().all(Option::is_none) {
                map.remove(&*key.url);
            }
        }
    }

    /// One rank's latest report.
    pub fn get(&self, url: &str, dp_rank: u32) -> Option<LoadStat> {
        self.by_url
            .read()
            .get(url)
            .and_then(|ranks| ranks.get(dp_rank as usize).copied().flatten())
            .map(|r| r.stat)
    }

    /// Calls `read` with every rank's latest report of the worker at `url` (indexed by DP rank;
    /// empty when the engine reports none), under one read lock.
    pub fn with_worker<R>(&self, url: &str, read: impl FnOnce(&[Option<ReportedLoad>]) -> R) -> R {
        let map = self.by_url.read();
        read(map.get(url).map_or(&[][..], Vec::as_slice))
    }

    pub fn is_empty(&self) -> bool {
        self.by_url.read().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(url: &str, dp_rank: u32) -> RankKey {
        RankKey {
            url: Arc::from(url),
            dp_rank,
        }
    }

    fn stat(running: u64) -> LoadStat {
        LoadStat {
            num_running_reqs: running,
            ..LoadStat::default()
        }
    }

    #[test]
    fn a_rank_reads_back_its_own_report_and_no_other_ranks() {
        let loads = EngineLoads::new();
        let before = Instant::now();
        loads.set(&key("http://a", 2), stat(7));
        assert_eq!(loads.get("http://a", 2), Some(stat(7)));
        assert_eq!(loads.get("http://a", 0), None, "rank 0 never reported");
        assert_eq!(loads.get("http://a", 9), None, "past the known ranks");
        assert_eq!(loads.get("http://b", 2), None, "another worker");
        loads.with_worker("http://a", |ranks| {
            let stats: Vec<Option<LoadStat>> = ranks.iter().map(|r| r.map(|r| r.stat)).collect();
            assert_eq!(stats, [None, None, Some(stat(7))]);
            let arrived = ranks[2].expect("reported").received_at;
            assert!(
                arrived >= before && arrived <= Instant::now(),
                "a report keeps the instant it was recorded"
            );
        });
        loads.with_worker("http://b", |ranks| assert!(ranks.is_empty()));
    }

    #[test]
    fn removing_a_workers_last_reporting_rank_forgets_the_worker() {
        let loads = EngineLoads::new();
        loads.set(&key("http://a", 0), stat(1));
        loads.set(&key("http://a", 1), stat(2));
        loads.remove_rank(&key("http://a", 0));
        assert_eq!(loads.get("http://a", 0), None);
        assert_eq!(loads.get("http://a", 1), Some(stat(2)));
        assert!(!loads.is_empty());
        loads.remove_rank(&key("http://a", 1));
        assert!(loads.is_empty(), "no rank of the worker reports any more");
        loads.remove_rank(&key("http://gone", 0));
        assert!(loads.is_empty());
    }

    #[test]
    fn a_newer_report_replaces_the_older_one() {
        let loads = EngineLoads::new();
        loads.set(&key("http://a", 0), stat(1));
        loads.set(&key("http://a", 0), stat(5));
        assert_eq!(loads.get("http://a", 0), Some(stat(5)));
    }
}
