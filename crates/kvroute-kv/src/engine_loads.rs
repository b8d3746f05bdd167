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
//!
//! Beside each report sits the rank's cache occupancy as the index knows it: the device blocks
//! the index carries for the rank, published by the pump (the index's only writer) at
//! registration and after each batch it applies, and only while that count can be taken for the
//! engine's whole cache (`RankMachine::counts_whole_cache`: the index holds the rank's history
//! since its publisher's seq 0, or nothing was heard from it since registration); otherwise it
//! misses whatever was cached before this replica listened, and is withheld. The routing path
//! reads it with the report, under the same lock, to price what a prefill displaces against
//! the rank's capacity (the report's `max_total_num_tokens`, or vLLM's `/metrics`). The pump
//! stores it in an atomic under the read lock, so a batch never blocks the routing path; only a
//! rank's first count takes the write lock.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// `RankSlot::cached_device_blocks` when the index's count is withheld.
const DEVICE_BLOCKS_UNKNOWN: u64 = u64::MAX;

/// One DP rank's entry: the engine's latest load report and the index's count of the device
/// blocks the rank holds.
#[derive(Debug)]
pub struct RankSlot {
    load: Option<ReportedLoad>,
    cached_device_blocks: AtomicU64,
}

impl Default for RankSlot {
    fn default() -> Self {
        RankSlot {
            load: None,
            cached_device_blocks: AtomicU64::new(DEVICE_BLOCKS_UNKNOWN),
        }
    }
}

impl RankSlot {
    /// The engine's latest load report, if it sent one.
    pub fn load(&self) -> Option<ReportedLoad> {
        self.load
    }

    /// Device blocks the index carries for the rank, when that count is the engine's whole
    /// cache as far as the pump can tell (see the module comment); `None` otherwise.
    pub fn cached_device_blocks(&self) -> Option<u64> {
        let blocks = self.cached_device_blocks.load(Ordering::Relaxed);
        (blocks != DEVICE_BLOCKS_UNKNOWN).then_some(blocks)
    }

    fn is_empty(&self) -> bool {
        self.load.is_none() && self.cached_device_blocks().is_none()
    }
}

/// Latest engine-reported load and index occupancy per worker URL, one slot per DP rank.
#[derive(Debug, Default)]
pub struct EngineLoads {
    by_url: RwLock<HashMap<Arc<str>, Vec<RankSlot>>>,
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
        slot_of(&mut map, key).load = Some(reported);
    }

    /// Records the device blocks the index carries for a rank (`None`: the index's view of the
    /// rank is incomplete, the count is withheld). Only the pump calls this, at registration
    /// and after a batch.
    pub fn set_cached_device_blocks(&self, key: &RankKey, blocks: Option<u64>) {
        // A count of u64::MAX blocks cannot happen (the index is bounded far below it), so the
        // sentinel never hides a real count.
        let stored = blocks.unwrap_or(DEVICE_BLOCKS_UNKNOWN);
        {
            let map = self.by_url.read();
            if let Some(slot) = map
                .get(&*key.url)
                .and_then(|ranks| ranks.get(key.dp_rank as usize))
            {
                slot.cached_device_blocks.store(stored, Ordering::Relaxed);
                return;
            }
        }
        if blocks.is_none() {
            // Nothing known to withdraw: no slot needed.
            return;
        }
        let mut map = self.by_url.write();
        slot_of(&mut map, key)
            .cached_device_blocks
            .store(stored, Ordering::Relaxed);
    }

    /// Forgets one rank's report and count (the worker's entry goes with its last rank).
    pub fn remove_rank(&self, key: &RankKey) {
        let mut map = self.by_url.write();
        if let Some(ranks) = map.get_mut(&*key.url) {
            if let Some(slot) = ranks.get_mut(key.dp_rank as usize) {
                *slot = RankSlot::default();
            }
            if ranks.iter().all(RankSlot::is_empty) {
                map.remove(&*key.url);
            }
        }
    }

    /// One rank's latest report.
    pub fn get(&self, url: &str, dp_rank: u32) -> Option<LoadStat> {
        self.by_url
            .read()
            .get(url)
            .and_then(|ranks| ranks.get(dp_rank as usize).and_then(RankSlot::load))
            .map(|r| r.stat)
    }

    /// Calls `read` with every rank's slot of the worker at `url` (indexed by DP rank; empty
    /// when nothing was recorded for it), under one read lock.
    pub fn with_worker<R>(&self, url: &str, read: impl FnOnce(&[RankSlot]) -> R) -> R {
        let map = self.by_url.read();
        read(map.get(url).map_or(&[][..], Vec::as_slice))
    }

    pub fn is_empty(&self) -> bool {
        self.by_url.read().is_empty()
    }
}

/// The slot of `key`, made (with the worker's entry) when missing. `dp_rank` is bounded by the
/// worker's registered DP size: only the pump records, for ranks it has registered.
fn slot_of<'a>(map: &'a mut HashMap<Arc<str>, Vec<RankSlot>>, key: &RankKey) -> &'a mut RankSlot {
    let ranks = map.entry(key.url.clone()).or_default();
    let slot = key.dp_rank as usize;
    if ranks.len() <= slot {
        ranks.resize_with(slot + 1, RankSlot::default);
    }
    &mut ranks[slot]
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
            let stats: Vec<Option<LoadStat>> =
                ranks.iter().map(|r| r.load().map(|r| r.stat)).collect();
            assert_eq!(stats, [None, None, Some(stat(7))]);
            let arrived = ranks[2].load().expect("reported").received_at;
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

    /// The count recorded for rank `dp` of the worker at `url`.
    fn cached(loads: &EngineLoads, url: &str, dp: usize) -> Option<u64> {
        loads.with_worker(url, |ranks| {
            ranks.get(dp).and_then(RankSlot::cached_device_blocks)
        })
    }

    #[test]
    fn a_ranks_cached_blocks_read_back_beside_its_report_and_a_withheld_count_reads_unknown() {
        let loads = EngineLoads::new();
        loads.set_cached_device_blocks(&key("http://a", 1), None);
        assert!(
            loads.is_empty(),
            "withholding an unknown count makes no entry"
        );
        loads.set_cached_device_blocks(&key("http://a", 1), Some(300));
        loads.set(&key("http://a", 0), stat(2));
        loads.with_worker("http://a", |ranks| {
            assert_eq!(ranks.len(), 2);
            assert_eq!(
                ranks[0].cached_device_blocks(),
                None,
                "rank 0 never counted"
            );
            assert_eq!(ranks[1].cached_device_blocks(), Some(300));
            assert_eq!(ranks[1].load(), None, "rank 1 never reported");
        });
        loads.set_cached_device_blocks(&key("http://a", 1), Some(0));
        assert_eq!(
            cached(&loads, "http://a", 1),
            Some(0),
            "empty is known, not unknown"
        );
        loads.set_cached_device_blocks(&key("http://a", 1), None);
        assert_eq!(cached(&loads, "http://a", 1), None, "a withdrawn count");
        loads.remove_rank(&key("http://a", 0));
        assert!(
            loads.is_empty(),
            "no rank of the worker has a report or a count"
        );
    }

    #[test]
    fn removing_a_rank_forgets_its_count_but_keeps_a_sibling_ranks() {
        let loads = EngineLoads::new();
        loads.set_cached_device_blocks(&key("http://a", 0), Some(5));
        loads.set_cached_device_blocks(&key("http://a", 1), Some(6));
        loads.remove_rank(&key("http://a", 0));
        assert_eq!(cached(&loads, "http://a", 0), None);
        assert_eq!(cached(&loads, "http://a", 1), Some(6));
    }

    #[test]
    fn a_newer_report_replaces_the_older_one() {
        let loads = EngineLoads::new();
        loads.set(&key("http://a", 0), stat(1));
        loads.set(&key("http://a", 0), stat(5));
        assert_eq!(loads.get("http://a", 0), Some(stat(5)));
    }
}
