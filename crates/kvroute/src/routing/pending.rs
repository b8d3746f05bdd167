//! Pending prefixes: blocks the router has routed to a rank but the rank's KV events have not
//! confirmed yet.
//!
//! Why: the index learns a prefix only from the engine's KV events, i.e. after the first prefill
//! of that prefix has finished. Requests that share a not-yet-cached prefix and arrive while that
//! first prefill runs (the cold burst of a popular system prompt) would otherwise all look cold
//! and be spread by load, each paying the full prefill somewhere else. Remembering, right after a
//! `cache_aware` decision, that the chosen rank is about to hold the prompt's blocks lets those
//! requests follow the first one; the cost model still charges the rank's queued prefill, so
//! affinity never overrides load blindly.
//!
//! Shape:
//! * One [`ModelPending`] table per model group (block hashes are only comparable within a
//!   model): block content hash -> up to [`PENDING_RANKS_PER_BLOCK_MAX`] (rank, expiry) holders.
//!   The hashes are the index's own (`kvroute_index::hash::hash_token_blocks`, base namespace,
//!   the model's block size), so a pending block and an indexed block are the same key.
//! * Entries expire after `--pending-prefix-ttl-ms`: by then the KV events have either confirmed
//!   the blocks (the index covers them) or the request went wrong (failed, cancelled, evicted),
//!   and either way the entry must stop steering requests. Expiry is lazy (a lookup ignores an
//!   expired holder) plus a FIFO of insertions that the writer trims from the front; the same
//!   FIFO bounds the table at [`PENDING_BLOCKS_MAX`] entries, dropping the oldest first. Holders
//!   refreshed by a later request leave a stale FIFO item behind, which is recognised (expiry
//!   differs) and skipped when it reaches the front, so the FIFO length bounds everything.
//! * Only blocks the chosen rank neither holds in the index nor has pending are recorded (the
//!   index is the truth for the rest, and a pending entry expires on its creator's clock), so a
//!   warm conversation adds only its new turn's blocks, and a prefix that is never confirmed
//!   cannot be kept alive by the requests it attracts.
//! * The index stays event-only and single-writer: nothing here writes to it. The walk combines
//!   both sources per rank: a block counts when the index holds it on that rank OR it is pending
//!   there, and depth is contiguous from block 0.
//! * Concurrency: routing runs on many tasks; each table is one `parking_lot::Mutex` held for a
//!   walk (one hash probe per block actually decided) or a record (one probe + one FIFO push per
//!   new block). Nothing is allocated under the lock except the amortised growth of the map and
//!   FIFO, which stop growing at the cap.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts};

use crate::control::registry::WorkerId;

thread_local! {
    /// Per routing thread: the ranks a pending walk still follows, reused across requests.
    static OPEN_WALKS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Default lifetime of a pending entry, in milliseconds. The demo fleet (kvroute-sim as the demo
/// and `bench/quality_vs_peers.sh` configure it) prefills a cold ~1,000-token prompt in ~60 ms
/// (2 ms overhead + 60 us per token); with prefills serialised per rank a request can queue
/// behind ~4 others (~250 ms) before its blocks are inserted and announced, and event delivery
/// adds about a millisecond. 500 ms covers that twice over, while keeping short the window in
/// which an entry can claim blocks the engine has already evicted again. Engines with longer
/// prompts or deeper queues should raise it to their routing-to-KV-event p99.
pub const DEFAULT_PENDING_PREFIX_TTL_MS: u64 = 500;
/// Most pending (block, rank) entries one model keeps; the oldest are dropped first. At ~100
/// bytes per entry (map slot + FIFO item) this caps a model's table at ~7 MB.
pub const PENDING_BLOCKS_MAX: usize = 65_536;
/// Most blocks one routed request records: a huge prompt must not flush everyone else's entries
/// or hold the lock for long.
pub const PENDING_BLOCKS_PER_REQUEST_MAX: usize = 4_096;
/// Most ranks a block can be pending on at once; a further rank replaces the holder that
/// expires first. Memory is bounded by [`PENDING_BLOCKS_MAX`] whatever this is; it bounds the
/// scan of one block's holders.
pub const PENDING_RANKS_PER_BLOCK_MAX: usize = 64;
/// Holders stored inside the map slot before a block's holder list spills to the heap.
pub const PENDING_RANKS_INLINE: usize = 4;

/// One engine rank, as the router identifies it. Worker ids are never reused, so an entry of a
/// removed worker can never be mistaken for a re-added one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankKey {
    pub worker: WorkerId,
    pub dp_rank: u32,
}

/// Per-rank state of one walk: the index's depths in, the combined depths out.
#[derive(Debug, Clone, Copy, Default)]
pub struct RankWalk {
    pub rank: RankKey,
    /// Contiguous blocks the index holds on this rank (any tier).
    pub index_blocks: u32,
    /// Contiguous blocks the index holds on this rank's device tier (<= `index_blocks`).
    pub index_device_blocks: u32,
    /// Out: contiguous blocks held by the index or pending (>= `index_blocks`).
    pub blocks: u32,
    /// Out: contiguous blocks on the device tier or pending (pending blocks are being prefilled
    /// into device memory).
    pub device_blocks: u32,
    // Walk state: whether `blocks` / `device_blocks` can still grow.
    blocks_open: bool,
    device_open: bool,
}

impl RankWalk {
    pub fn new(rank: RankKey, index_blocks: u32, index_device_blocks: u32) -> RankWalk {
        RankWalk {
            rank,
            index_blocks,
            index_device_blocks: index_device_blocks.min(index_blocks),
            ..RankWalk::default()
        }
    }

    /// Blocks the pending entries add beyond the index.
    pub fn pending_blocks(&self) -> u32 {
        self.blocks - self.index_blocks
    }
}

/// Block hashes are the index's content hashes, uniform already: keyed as they are.
type BlockMap<V> = HashMap<u64, V, kvroute_index::hash::ContentHashBuilder>;

#[derive(Debug, Clone, Copy, Default)]
struct Holder {
    rank: RankKey,
    expires_ms: u64,
}

/// The ranks one block is pending on. The first [`PENDING_RANKS_INLINE`] live inline, so
/// recording a block allocates nothing of its own beyond the map's amortised growth; only a
/// block pending on more ranks at once (a prefix every request shares, such as a chat
/// template's header, during a cold start) spills to a vector. Losing such a shared block 0 on a
/// rank would cut that rank's whole contiguous pending run, hence the generous per-block cap.
#[derive(Debug, Default)]
struct Slot {
    inline: [Holder; PENDING_RANKS_INLINE],
    len: u8,
    spill: Vec<Holder>,
}

impl Slot {
    fn holders(&self) -> impl Iterator<Item = &Holder> {
        self.inline[..self.len as usize]
            .iter()
            .chain(self.spill.iter())
    }

    fn count(&self) -> usize {
        self.len as usize + self.spill.len()
    }

    fn holds(&self, rank: RankKey, now_ms: u64) -> bool {
        self.holders()
            .any(|h| h.rank == rank && h.expires_ms > now_ms)
    }

    /// Returns true when a new holder was added (false: refreshed or replaced one).
    fn put(&mut self, rank: RankKey, expires_ms: u64) -> bool {
        let len = self.len as usize;
        if let Some(h) = self.inline[..len]
            .iter_mut()
            .chain(self.spill.iter_mut())
            .find(|h| h.rank == rank)
        {
            h.expires_ms = expires_ms;
            return false;
        }
        let holder = Holder { rank, expires_ms };
        if len < PENDING_RANKS_INLINE {
            self.inline[len] = holder;
            self.len += 1;
            return true;
        }
        if self.count() < PENDING_RANKS_PER_BLOCK_MAX {
            self.spill.push(holder);
            return true;
        }
        // Full: replace the holder that expires first (its FIFO item becomes stale).
        if let Some(h) = self
            .inline
            .iter_mut()
            .chain(self.spill.iter_mut())
            .min_by_key(|h| h.expires_ms)
        {
            *h = holder;
        }
        false
    }

    /// Removes `rank`'s holder if it is still the one the FIFO item recorded.
    fn remove_if(&mut self, rank: RankKey, expires_ms: u64) -> bool {
        let is_it = |h: &Holder| h.rank == rank && h.expires_ms == expires_ms;
        let len = self.len as usize;
        if let Some(i) = self.inline[..len].iter().position(is_it) {
            self.inline.copy_within(i + 1..len, i);
            self.len -= 1;
            // Keep the inline part dense: refill it from the spill.
            if let Some(h) = self.spill.pop() {
                self.inline[self.len as usize] = h;
                self.len += 1;
            }
            return true;
        }
        match self.spill.iter().position(is_it) {
            Some(i) => {
                self.spill.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct FifoItem {
    hash: u64,
    rank: RankKey,
    expires_ms: u64,
}

#[derive(Default)]
struct Table {
    slots: BlockMap<Slot>,
    /// Every insertion or refresh, oldest first; its length bounds the table.
    fifo: VecDeque<FifoItem>,
    /// Live holders across all slots (what the gauge shows).
    holders: usize,
}

impl Table {
    fn pop_front(&mut self) {
        let Some(item) = self.fifo.pop_front() else {
            return;
        };
        if let Some(slot) = self.slots.get_mut(&item.hash)
            && slot.remove_if(item.rank, item.expires_ms)
        {
            self.holders -= 1;
            if slot.count() == 0 {
                self.slots.remove(&item.hash);
            }
        }
    }

    fn drop_expired(&mut self, now_ms: u64) {
        // With one TTL per table, expiry is monotonic in insertion order, so the expired items
        // are exactly a prefix of the FIFO.
        while self.fifo.front().is_some_and(|f| f.expires_ms <= now_ms) {
            self.pop_front();
        }
    }
}

/// The pending blocks of one model group.
pub struct ModelPending {
    table: Mutex<Table>,
    /// Mirror of `Table::holders` readable without the lock (lets a walk skip an empty table).
    held: AtomicUsize,
    /// Latest expiry ever recorded: past it every entry is expired, so a walk skips the lock
    /// even before the next record purges them.
    live_until_ms: AtomicU64,
    gauge: IntGauge,
    hits: IntCounter,
}

impl ModelPending {
    fn new(gauge: IntGauge, hits: IntCounter) -> ModelPending {
        ModelPending {
            table: Mutex::new(Table::default()),
            held: AtomicUsize::new(0),
            live_until_ms: AtomicU64::new(0),
            gauge,
            hits,
        }
    }

    /// Live-or-not-yet-purged entries (expired ones leave at the next record).
    pub fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Extends every rank's index depths with its unexpired pending blocks of `hashes` (the
    /// request's block hashes, block 0 first). Probes the table only at blocks some rank's depth
    /// actually depends on, so a rank the index already covers costs nothing.
    pub fn extend(&self, hashes: &[u64], now_ms: u64, ranks: &mut [RankWalk]) {
        init_walks(ranks, hashes.len());
        if self.is_empty() || now_ms >= self.live_until_ms.load(Ordering::Relaxed) {
            return;
        }
        let table = self.table.lock();
        OPEN_WALKS.with(|open| {
            let open = &mut *open.borrow_mut();
            // Only the ranks that can still grow are visited, and a rank leaves the list at the
            // first block it does not hold pending. Scanning every rank at every probed block
            // made this O(blocks x ranks): 0.5 ms per request in a 1,024-rank fleet.
            open.clear();
            open.extend(
                (0..ranks.len() as u32)
                    .filter(|&i| ranks[i as usize].blocks_open || ranks[i as usize].device_open),
            );
            while !open.is_empty() {
                // The next block whose pending status decides some rank's depth.
                let mut k = usize::MAX;
                for &i in open.iter() {
                    let r = &ranks[i as usize];
                    if r.blocks_open {
                        k = k.min(r.blocks as usize);
                    }
                    if r.device_open {
                        k = k.min(r.device_blocks as usize);
                    }
                }
                if k >= hashes.len() {
                    break;
                }
                let slot = table.slots.get(&hashes[k]);
                for &i in open.iter() {
                    let r = &mut ranks[i as usize];
                    let decides_blocks = r.blocks_open && r.blocks as usize == k;
                    let decides_device = r.device_open && r.device_blocks as usize == k;
                    if !(decides_blocks || decides_device) {
                        continue;
                    }
                    let pending = slot.is_some_and(|s| s.holds(r.rank, now_ms));
                    if decides_blocks {
                        if pending {
                            r.blocks += 1;
                        } else {
                            r.blocks_open = false;
                        }
                    }
                    if decides_device {
                        if pending {
                            r.device_blocks += 1;
                        } else {
                            r.device_open = false;
                        }
                    }
                }
                open.retain(|&i| {
                    let r = &ranks[i as usize];
                    r.blocks_open || r.device_open
                });
            }
        });
    }

    /// Records `hashes[from..]` (at most [`PENDING_BLOCKS_PER_REQUEST_MAX`] of them) as pending on
    /// `rank` until `now_ms + ttl_ms`, first dropping expired entries and then, at the cap, the
    /// oldest.
    pub fn record(&self, hashes: &[u64], from: usize, rank: RankKey, now_ms: u64, ttl_ms: u64) {
        if from >= hashes.len() {
            return;
        }
        let end = hashes.len().min(from + PENDING_BLOCKS_PER_REQUEST_MAX);
        let expires_ms = now_ms + ttl_ms;
        let mut table = self.table.lock();
        table.drop_expired(now_ms);
        for &hash in &hashes[from..end] {
            if table.fifo.len() >= PENDING_BLOCKS_MAX {
                table.pop_front();
            }
            let added = table.slots.entry(hash).or_default().put(rank, expires_ms);
            if added {
                table.holders += 1;
            }
            table.fifo.push_back(FifoItem {
                hash,
                rank,
                expires_ms,
            });
        }
        let held = table.holders;
        drop(table);
        self.held.store(held, Ordering::Relaxed);
        self.live_until_ms.fetch_max(expires_ms, Ordering::Relaxed);
        self.gauge.set(held as i64);
    }

    /// FIFO items held (live entries plus stale refresh records); never above
    /// [`PENDING_BLOCKS_MAX`].
    pub fn fifo_len(&self) -> usize {
        self.table.lock().fifo.len()
    }
}

fn init_walks(ranks: &mut [RankWalk], blocks: usize) {
    for r in ranks.iter_mut() {
        r.blocks = r.index_blocks;
        r.device_blocks = r.index_device_blocks;
        r.blocks_open = (r.blocks as usize) < blocks;
        r.device_open = (r.device_blocks as usize) < blocks;
    }
}

/// All models' pending tables plus the feature's switch and metrics.
pub struct PendingPrefixes {
    ttl_ms: u64,
    epoch: Instant,
    models: RwLock<HashMap<String, Arc<ModelPending>>>,
    gauge: IntGaugeVec,
    hits: IntCounterVec,
}

impl PendingPrefixes {
    /// `ttl_ms == 0` disables the feature: nothing is recorded, walks leave the index depths.
    pub fn new(ttl_ms: u64, registry: &prometheus::Registry) -> Result<Self, prometheus::Error> {
        let gauge = IntGaugeVec::new(
            Opts::new(
                "kvroute_pending_prefix_blocks",
                "Pending (routed, not yet confirmed by KV events) block entries per model",
            ),
            &["model"],
        )?;
        let hits = IntCounterVec::new(
            Opts::new(
                "kvroute_pending_prefix_hits_total",
                "Routed cache_aware decisions whose chosen rank matched deeper thanks to pending blocks",
            ),
            &["model"],
        )?;
        registry.register(Box::new(gauge.clone()))?;
        registry.register(Box::new(hits.clone()))?;
        Ok(PendingPrefixes {
            ttl_ms,
            epoch: Instant::now(),
            models: RwLock::new(HashMap::new()),
            gauge,
            hits,
        })
    }

    pub fn enabled(&self) -> bool {
        self.ttl_ms > 0
    }

    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// Milliseconds since this table set was created: the clock of every expiry.
    pub fn now_ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// The model's table if anything was ever recorded for it.
    pub fn model(&self, model: &str) -> Option<Arc<ModelPending>> {
        self.models.read().get(model).cloned()
    }

    fn model_or_create(&self, model: &str) -> Arc<ModelPending> {
        if let Some(m) = self.model(model) {
            return m;
        }
        self.models
            .write()
            .entry(model.to_string())
            .or_insert_with(|| {
                Arc::new(ModelPending::new(
                    self.gauge.with_label_values(&[model]),
                    self.hits.with_label_values(&[model]),
                ))
            })
            .clone()
    }

    /// Records a routed decision: `hashes[from..]` pending on `rank`; counts a pending hit when
    /// the pending blocks deepened the chosen rank's match.
    pub fn record(
        &self,
        model: &str,
        hashes: &[u64],
        from: usize,
        rank: RankKey,
        now: Instant,
        pending_hit: bool,
    ) {
        if !self.enabled() || (from >= hashes.len() && !pending_hit) {
            return;
        }
        let table = self.model_or_create(model);
        if pending_hit {
            table.hits.inc();
        }
        // The clock counts whole milliseconds, rounded down; an entry recorded 0.9 ms into a
        // millisecond would otherwise expire up to 1 ms before its TTL has passed. Lengthening
        // its TTL by the rounding keeps the promise `never before recorded + ttl`.
        let since_epoch = now.saturating_duration_since(self.epoch);
        let rounding_ms = u64::from(!since_epoch.subsec_nanos().is_multiple_of(1_000_000));
        table.record(
            hashes,
            from,
            rank,
            self.now_ms(now),
            self.ttl_ms + rounding_ms,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> ModelPending {
        ModelPending::new(
            IntGauge::new("g", "g").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        )
    }

    fn rank(worker: u64, dp_rank: u32) -> RankKey {
        RankKey { worker, dp_rank }
    }

    fn hashes(n: u64, base: u64) -> Vec<u64> {
        (0..n).map(|i| base + i).collect()
    }

    fn walk(
        t: &ModelPending,
        h: &[u64],
        now_ms: u64,
        ranks: &[(RankKey, u32, u32)],
    ) -> Vec<(u32, u32)> {
        let mut w: Vec<RankWalk> = ranks
            .iter()
            .map(|&(r, m, d)| RankWalk::new(r, m, d))
            .collect();
        t.extend(h, now_ms, &mut w);
        w.iter().map(|w| (w.blocks, w.device_blocks)).collect()
    }

    /// The walk as it was first written: every rank scanned at every probed block. The
    /// worklist must give exactly its depths.
    fn reference_walk(
        t: &ModelPending,
        h: &[u64],
        now_ms: u64,
        ranks: &[(RankKey, u32, u32)],
    ) -> Vec<(u32, u32)> {
        let mut w: Vec<RankWalk> = ranks
            .iter()
            .map(|&(r, m, d)| RankWalk::new(r, m, d))
            .collect();
        init_walks(&mut w, h.len());
        let table = t.table.lock();
        loop {
            let mut k = usize::MAX;
            for r in &w {
                if r.blocks_open {
                    k = k.min(r.blocks as usize);
                }
                if r.device_open {
                    k = k.min(r.device_blocks as usize);
                }
            }
            if k >= h.len() {
                break;
            }
            let slot = table.slots.get(&h[k]);
            for r in w.iter_mut() {
                let decides_blocks = r.blocks_open && r.blocks as usize == k;
                let decides_device = r.device_open && r.device_blocks as usize == k;
                let pending = slot.is_some_and(|s| s.holds(r.rank, now_ms));
                if decides_blocks {
                    r.blocks_open = pending;
                    r.blocks += u32::from(pending);
                }
                if decides_device {
                    r.device_open = pending;
                    r.device_blocks += u32::from(pending);
                }
            }
        }
        w.iter().map(|w| (w.blocks, w.device_blocks)).collect()
    }

    proptest::proptest! {
        #[test]
        fn the_worklist_walk_finds_the_depths_a_scan_of_every_rank_finds(
            records in proptest::collection::vec((0u64..6, 0usize..12, 0u64..3), 0..24),
            depths in proptest::collection::vec((0u32..14, 0u32..14), 1..24),
            now_ms in 0u64..2_000,
        ) {
            let t = table();
            let h = hashes(12, 500);
            for &(worker, from, ttl_step) in &records {
                t.record(&h, from, rank(worker, 0), 0, 500 + ttl_step * 700);
            }
            let ranks: Vec<(RankKey, u32, u32)> = depths
                .iter()
                .enumerate()
                .map(|(i, &(m, d))| (rank(i as u64 % 6, (i / 6) as u32), m.min(12), d.min(m).min(12)))
                .collect();
            proptest::prop_assert_eq!(
                walk(&t, &h, now_ms, &ranks),
                reference_walk(&t, &h, now_ms, &ranks)
            );
        }
    }

    #[test]
    fn pending_depth_counts_only_blocks_contiguous_from_block_zero() {
        let t = table();
        let h = hashes(6, 100);
        // Blocks 1..6 pending, block 0 not: nothing counts.
        t.record(&h, 1, rank(1, 0), 0, 1_000);
        assert_eq!(walk(&t, &h, 10, &[(rank(1, 0), 0, 0)]), vec![(0, 0)]);
        // With block 0 in the index, the pending blocks continue the index's depth.
        assert_eq!(walk(&t, &h, 10, &[(rank(1, 0), 1, 1)]), vec![(6, 6)]);
        // A prompt diverging after block 3 keeps the common part only.
        let mut other = h.clone();
        other[3] = 9_999;
        assert_eq!(walk(&t, &other, 10, &[(rank(1, 0), 1, 1)]), vec![(3, 3)]);
    }

    #[test]
    fn pending_blocks_belong_to_the_rank_they_were_routed_to() {
        let t = table();
        let h = hashes(4, 200);
        t.record(&h, 0, rank(1, 1), 0, 1_000);
        let got = walk(
            &t,
            &h,
            5,
            &[(rank(1, 0), 0, 0), (rank(1, 1), 0, 0), (rank(2, 1), 0, 0)],
        );
        assert_eq!(got, vec![(0, 0), (4, 4), (0, 0)]);
    }

    #[test]
    fn an_entry_stops_counting_at_its_expiry_and_leaves_at_the_next_record() {
        let t = table();
        let h = hashes(3, 300);
        t.record(&h, 0, rank(1, 0), 100, 50);
        assert_eq!(walk(&t, &h, 149, &[(rank(1, 0), 0, 0)]), vec![(3, 3)]);
        assert_eq!(walk(&t, &h, 150, &[(rank(1, 0), 0, 0)]), vec![(0, 0)]);
        assert_eq!(t.len(), 3, "expiry is lazy until the next write");
        t.record(&hashes(1, 900), 0, rank(2, 0), 150, 50);
        assert_eq!(t.len(), 1, "the next record purges the expired entries");
        assert_eq!(t.fifo_len(), 1);
    }

    #[test]
    fn index_depth_wins_where_it_is_deeper_and_device_depth_extends_through_pending() {
        let t = table();
        let h = hashes(8, 400);
        t.record(&h, 0, rank(1, 0), 0, 1_000);
        // Index: 6 blocks, the last 3 only on the host tier. Pending covers 0..8.
        assert_eq!(walk(&t, &h, 1, &[(rank(1, 0), 6, 3)]), vec![(8, 8)]);
        // No pending on this rank: the index's depths stay as they are.
        assert_eq!(walk(&t, &h, 1, &[(rank(2, 0), 6, 3)]), vec![(6, 3)]);
    }

    #[test]
    fn the_table_never_exceeds_its_cap_and_drops_the_oldest_first() {
        let t = table();
        let per = PENDING_BLOCKS_PER_REQUEST_MAX as u64;
        let requests = (PENDING_BLOCKS_MAX as u64 / per) + 3;
        for i in 0..requests {
            t.record(&hashes(per, i * per), 0, rank(1, 0), 0, 1_000_000);
            assert!(t.fifo_len() <= PENDING_BLOCKS_MAX);
            assert!(t.len() <= PENDING_BLOCKS_MAX);
        }
        assert_eq!(t.len(), PENDING_BLOCKS_MAX);
        let oldest = hashes(per, 0);
        let newest = hashes(per, (requests - 1) * per);
        assert_eq!(walk(&t, &oldest, 1, &[(rank(1, 0), 0, 0)]), vec![(0, 0)]);
        assert_eq!(
            walk(&t, &newest, 1, &[(rank(1, 0), 0, 0)]),
            vec![(per as u32, per as u32)]
        );
    }

    #[test]
    fn one_request_records_at_most_the_per_request_cap() {
        let t = table();
        let h = hashes(PENDING_BLOCKS_PER_REQUEST_MAX as u64 + 10, 0);
        t.record(&h, 0, rank(1, 0), 0, 1_000);
        assert_eq!(t.len(), PENDING_BLOCKS_PER_REQUEST_MAX);
    }

    #[test]
    fn refreshing_an_entry_keeps_it_alive_past_its_first_expiry_without_growing_the_count() {
        let t = table();
        let h = hashes(2, 500);
        t.record(&h, 0, rank(1, 0), 0, 100);
        t.record(&h, 0, rank(1, 0), 80, 100);
        assert_eq!(t.len(), 2, "a refresh is not a new entry");
        // The first records' FIFO items expire at 100 but are stale; the entries live to 180.
        t.record(&hashes(1, 9_000), 0, rank(2, 0), 120, 100);
        assert_eq!(walk(&t, &h, 150, &[(rank(1, 0), 0, 0)]), vec![(2, 2)]);
        assert_eq!(walk(&t, &h, 180, &[(rank(1, 0), 0, 0)]), vec![(0, 0)]);
    }

    #[test]
    fn a_block_holds_at_most_the_per_block_rank_cap_replacing_the_soonest_to_expire() {
        let t = table();
        let h = hashes(1, 600);
        let n = PENDING_RANKS_PER_BLOCK_MAX as u64 + 1;
        for w in 0..n {
            t.record(&h, 0, rank(w, 0), w * 10, 1_000);
        }
        assert_eq!(t.len(), PENDING_RANKS_PER_BLOCK_MAX);
        let ranks: Vec<(RankKey, u32, u32)> = (0..n).map(|w| (rank(w, 0), 0, 0)).collect();
        let got = walk(&t, &h, 50, &ranks);
        assert_eq!(
            got[0],
            (0, 0),
            "the first holder expired soonest and was replaced"
        );
        assert!(got[1..].iter().all(|&d| d == (1, 1)), "{got:?}");
    }

    #[test]
    fn a_shared_first_block_pending_on_many_ranks_keeps_every_ranks_run() {
        let t = table();
        let ranks = 3 * PENDING_RANKS_INLINE as u64;
        // Every prompt starts with the same block (a chat template's header), then diverges.
        let prompt =
            |w: u64| -> Vec<u64> { [7].into_iter().chain(hashes(5, 1_000 * (w + 1))).collect() };
        for w in 0..ranks {
            t.record(&prompt(w), 0, rank(w, 0), w, 1_000);
        }
        for w in 0..ranks {
            assert_eq!(
                walk(&t, &prompt(w), 100, &[(rank(w, 0), 0, 0)]),
                vec![(6, 6)],
                "rank {w}"
            );
        }
        // Expiring them one by one empties the shared slot without losing track of anyone.
        t.record(&hashes(1, 99_999), 0, rank(99, 0), 2_000, 1_000);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn an_entry_recorded_mid_millisecond_never_expires_before_its_ttl() {
        use std::time::Duration;
        let reg = prometheus::Registry::new();
        let p = PendingPrefixes::new(1_000, &reg).unwrap();
        // 0.9 ms into millisecond 100: the whole-millisecond clock reads 100.
        let recorded = p.epoch + Duration::from_micros(100_900);
        p.record("m", &hashes(2, 0), 0, rank(1, 0), recorded, false);
        let table = p.model("m").unwrap();
        // 999.2 ms later the clock reads 1,100 = 100 + TTL; the entry must still hold.
        let almost = recorded + Duration::from_micros(999_200);
        assert_eq!(
            walk(
                &table,
                &hashes(2, 0),
                p.now_ms(almost),
                &[(rank(1, 0), 0, 0)]
            ),
            vec![(2, 2)],
            "expired {:?} after recording, before the 1,000 ms TTL",
            almost - recorded
        );
        let past = recorded + Duration::from_millis(1_001);
        assert_eq!(
            walk(&table, &hashes(2, 0), p.now_ms(past), &[(rank(1, 0), 0, 0)]),
            vec![(0, 0)],
            "still held 1,001 ms after recording"
        );
    }

    #[test]
    fn disabled_pending_records_nothing() {
        let reg = prometheus::Registry::new();
        let p = PendingPrefixes::new(0, &reg).unwrap();
        assert!(!p.enabled());
        p.record("m", &hashes(4, 0), 0, rank(1, 0), Instant::now(), false);
        assert!(p.model("m").is_none());
    }
}
