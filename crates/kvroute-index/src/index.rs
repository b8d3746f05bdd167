//! The sharded prefix index: which rank carries which block, keyed by the router's own content hash.
//!
//! Shape and why:
//! * **Flat map per shard, keyed by chained content hash.** Because a block's hash identifies its
//!   whole prefix (see [`crate::hash`]), a request's block `i` is found by a direct lookup instead
//!   of a child walk; the tree structure (parent index, child count) is kept only for pruning
//!   and for exporting parents before children (export orders nodes depth-first from parent
//!   links).
//! * **Chains are followed through the slab.** Nodes created by one store event get consecutive
//!   slab slots (and export's depth-first order makes a restore lay chains out the same way), so
//!   the routing walk first checks whether block `i`'s node is the slab successor of block
//!   `i - 1`'s, confirming with the full 64-bit hash just as a slot hit is confirmed. Along such
//!   a chain it streams node lines that are adjacent in memory and never touches the hash slots
//!   (a random cache line per block); off the chain it falls back to slot lookups requested
//!   [`MATCH_SLOT_LEAD_BLOCKS`] ahead. Both are exact; only the speed depends on the layout
//!   (figures for both in docs/BENCHMARKS.md).
//! * **Shard = chain root.** A node lives in the shard chosen by its chain's ROOT block hash, so a
//!   whole prefix lives in one shard: `match_prefix` takes one read lock for the whole walk and a
//!   store event takes one write lock (per event, never longer), so a reader can never see half of
//!   a store and never waits behind more than one event.
//! * **Compact nodes.** Nodes (32 bytes) sit in a per-shard chunked slab addressed by `u32`;
//!   the map (module `table`) holds 8-byte slots (tag + slab index), kept 64-80 % full, and
//!   lets the routing path prefetch the slots of upcoming blocks. Each node has ONE inline
//!   carrier; only nodes carried by several ranks (shared prefixes) spill to a per-shard list
//!   pool, stored as parallel `words` / `engines` arrays so matching reads 4 bytes per carrier.
//!   A list node keeps an order-independent 64-bit digest of its carrier set in the bytes an
//!   inline carrier's engine hash would use, so the walk tells whether a node continues the
//!   previous node's carrier run from the node line alone: a prefix shared by 64 ranks costs
//!   one node line per block, not a 256-byte list read and comparison.
//! * **Carrier = (rank, tiers, engine hash), and the engine hash is stored ONCE, there.** Export
//!   is then a linear pass over each shard's slab under bounded read locks.
//! * **Index-only side map per rank** (engine hash -> node ref), writer-private: engines announce
//!   parents and removals by their own hash, which the router never interprets. Its buckets hold
//!   only the 4-byte node ref; the key is read back through the node's carrier for that rank, so
//!   the engine hash is not stored a second time. That costs a node read per confirmed lookup
//!   (the node is touched next anyway) and per entry on a rehash (done before taking a shard
//!   write lock, under read guards). Memory target and figures: docs/BENCHMARKS.md.
//! * **One writer, by type.** [`IndexWriter`] is not `Clone` and mutates through `&mut self`;
//!   [`IndexReader`] is a cheap `Arc` clone. No async, no I/O, no threads.
//!
//! Event rules (each covered by a test in `tests/index_behaviour.rs`):
//! * A `BlockStored` whose parent engine hash the rank never announced (or no longer carries)
//!   cannot be placed, because its prefix, hence its content hash, is unknown: its blocks are
//!   dropped and counted in `stored_unknown_parent_blocks`. (Attaching at the root, as one peer
//!   router does, would invent a prefix and produce false hits.)
//! * Token count `block_size * n` is the normal case; exactly twice that is read as speculative
//!   decoding's token pairs `(t_i, t_i+1)` and the first of each pair is hashed; anything else is
//!   counted in `token_mismatch_events` and skipped. Another block size: `block_size_mismatch_events`.
//! * Medium: none -> device; an unknown medium on a store is ignored (counted); on a removal,
//!   none or unknown clears every tier of the carrier (better a missed hit than a false one).
//! * A rank re-announcing the same content under a new engine hash moves the carrier to the new
//!   hash; an engine hash re-used for other content drops the old carrier (it could never be
//!   removed by hash again).
//! * Removal of an unknown engine hash is counted (`removed_unknown_blocks`), not an error. A
//!   node with no carriers and no children is pruned, upward. Removal events hold one shard write
//!   lock per run of blocks in the same shard (bounded by [`BLOCKS_PER_LOCK_MAX`]), so a reader sees
//!   a removed chain whole or gone.
//! * Over `max_carried_blocks`, least-recently-matched leaves lose all their carriers until the
//!   count is at [`EVICT_TARGET_PERCENT`] of the cap (`evicted_carriers`, `eviction_runs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

use hashbrown::{HashMap, HashTable};
use kvroute_wire::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvroute_wire::snapshot::{RankCursor, RankRef};
use parking_lot::{Mutex, RwLock};

use crate::hash::{chain_hash, namespace_seed};
use crate::table::{HashSlots, prefetch_ptr};

/// Tier bits, as in the snapshot format.
pub const TIER_DEVICE: u8 = 1;
pub const TIER_HOST: u8 = 2;
pub const TIER_DISK: u8 = 4;
pub const TIER_EXTERNAL: u8 = 8;
pub const TIER_ALL: u8 = 0x0f;

/// Rank ids share a `u32` with the 4 tier bits inside a carrier, so at most 2^28 - 1 ranks can
/// ever be registered in one index's lifetime (ids are never reused).
pub const RANK_IDS_MAX: u32 = (1 << 28) - 1;
/// Largest shard count accepted (node refs pack the shard into the low bits of a `u32`).
pub const SHARD_COUNT_MAX: usize = 256;
/// Default number of shards.
pub const DEFAULT_SHARD_COUNT: usize = 32;
/// Default cap on carried (rank, block) pairs: ~50 M pairs is a few GB at most.
pub const DEFAULT_CARRIED_BLOCKS_MAX: u64 = 50_000_000;
/// Blocks of one removal event applied under one shard write lock before it is released, which
/// bounds how long a reader can wait behind a huge removal.
pub const BLOCKS_PER_LOCK_MAX: usize = 4096;
/// How many blocks ahead of the block being matched the routing path requests hash slots
/// (and `match_tokens` hashes) while chains are not being followed through the slab; see
/// `match_prefix`.
pub const MATCH_SLOT_LEAD_BLOCKS: usize = 32;
/// Eviction brings the carried count down to this share of the cap so it runs rarely.
pub const EVICT_TARGET_PERCENT: u64 = 95;

const NONE: u32 = u32::MAX;
const EMPTY_CARRIER: u32 = u32::MAX;
/// `Node::parent` of a free slab slot. Never a slab index: see [`NODES_PER_SHARD_MAX`].
pub(crate) const FREE_PARENT: u32 = u32::MAX - 1;
/// Slab slots per shard. Node carrier slots encode a list index in 28 bits (see `Node`), and
/// there are never more lists than nodes; it also keeps [`FREE_PARENT`] out of the index range.
pub const NODES_PER_SHARD_MAX: u32 = (1 << 28) - 2;

/// Dense id of a registered rank. Never reused within one index's lifetime, so a stale id can
/// only miss, never alias another rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankId(pub u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Tokens per block; events with another block size are counted and skipped.
    pub block_size: u32,
    /// Power of two, 1..=[`SHARD_COUNT_MAX`]; other values are rounded up / clamped.
    pub shard_count: usize,
    /// Cap on carried (rank, block) pairs before least-recently-matched leaves are evicted.
    pub max_carried_blocks: u64,
}

impl IndexConfig {
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            shard_count: DEFAULT_SHARD_COUNT,
            max_carried_blocks: DEFAULT_CARRIED_BLOCKS_MAX,
        }
    }
}

/// Per-rank match result: contiguous depth from block 0 in any tier, and on device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankMatch {
    pub rank: RankId,
    pub matched_blocks: u32,
    pub device_blocks: u32,
}

/// Reusable output buffer of [`IndexReader::match_prefix`]; keep one per routing thread.
#[derive(Debug, Default, Clone)]
pub struct PrefixMatch {
    /// Ranks that match at least block 0, in no particular order.
    pub ranks: Vec<RankMatch>,
    /// Scratch: rank id -> position + 1 in `ranks` (0 = absent); all zero between calls.
    slot: Vec<u32>,
}

impl PrefixMatch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, rank: RankId) -> Option<RankMatch> {
        self.ranks.iter().find(|m| m.rank == rank).copied()
    }

    fn reset_slots(&mut self) {
        for m in &self.ranks {
            self.slot[m.rank.0 as usize] = 0;
        }
    }

    pub fn max_matched_blocks(&self) -> u32 {
        self.ranks
            .iter()
            .map(|m| m.matched_blocks)
            .max()
            .unwrap_or(0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankStats {
    /// Carried blocks (any tier).
    pub carried_blocks: u64,
    /// Carried blocks per tier: device, host, disk, external.
    pub tier_blocks: [u64; 4],
    /// Last applied batch; `RankCursor::rank` holds the local [`RankId`].
    pub cursor: Option<RankCursor>,
}

/// Heap bytes of the shards by structure (see [`IndexReader::memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShardMemory {
    pub node_slab_bytes: u64,
    pub hash_slot_bytes: u64,
    pub carrier_list_bytes: u64,
    pub free_list_bytes: u64,
}

/// Monotonic event counters (since creation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexCounters {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared_ranks: u64,
    /// Blocks of a store whose parent engine hash the rank never announced (prefix unknown).
    pub stored_unknown_parent_blocks: u64,
    /// Removals of an engine hash the rank does not carry.
    pub removed_unknown_blocks: u64,
    /// Carriers dropped by the memory cap.
    pub evicted_carriers: u64,
    pub eviction_runs: u64,
    /// Store events whose token count is neither `block_size * n` nor the bigram `2x`.
    pub token_mismatch_events: u64,
    /// Store events whose block size differs from the index's.
    pub block_size_mismatch_events: u64,
    /// Blocks stored in a medium this build does not know (ignored).
    pub unknown_medium_stored_blocks: u64,
    /// Blocks dropped because a shard's slab reached its addressable size.
    pub shard_full_blocks: u64,
    /// Events for a rank id that is not registered.
    pub unknown_rank_events: u64,
}

#[derive(Default)]
struct CounterCells {
    stored_blocks: AtomicU64,
    removed_blocks: AtomicU64,
    cleared_ranks: AtomicU64,
    stored_unknown_parent_blocks: AtomicU64,
    removed_unknown_blocks: AtomicU64,
    evicted_carriers: AtomicU64,
    eviction_runs: AtomicU64,
    token_mismatch_events: AtomicU64,
    block_size_mismatch_events: AtomicU64,
    unknown_medium_stored_blocks: AtomicU64,
    shard_full_blocks: AtomicU64,
    unknown_rank_events: AtomicU64,
}

/// Result of one [`IndexWriter::apply_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ApplyReport {
    pub events: u32,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// Blocks the batch named that the index did not take, by reason.
    pub skipped: SkippedBlocks,
    /// The block size of the last store skipped for [`SkippedBlocks::block_size`]: what the
    /// engine really uses, which the caller can name in its warning.
    pub foreign_block_size: Option<u32>,
    pub evicted_carriers: u64,
}

/// Blocks of a batch the index could not take, by reason. Kept apart because the reasons mean
/// different things to an operator: a foreign block size or token count is a configuration
/// mismatch that leaves the rank blind for good (the caller warns), an unknown parent is the
/// normal lot of a router that started mid-stream, and a full shard or cap is memory pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SkippedBlocks {
    /// Stores whose block size differs from the index's (the engine was configured apart).
    pub block_size: u64,
    /// Stores whose token count is neither `block_size * n` nor the bigram `2x`.
    pub token_count: u64,
    /// Stores whose parent block the rank never announced (the prefix is unknown).
    pub unknown_parent: u64,
    /// Stores in a medium this build does not know.
    pub unknown_medium: u64,
    /// Stores past a shard's addressable size.
    pub shard_full: u64,
    /// Removals of a block the rank does not carry.
    pub unknown_removed: u64,
}

impl SkippedBlocks {
    pub fn total(&self) -> u64 {
        self.by_reason().iter().map(|(_, blocks)| blocks).sum()
    }

    /// `(metric label, count)` per reason, in a fixed order.
    pub fn by_reason(&self) -> [(&'static str, u64); 6] {
        [
            ("block_size", self.block_size),
            ("token_count", self.token_count),
            ("unknown_parent", self.unknown_parent),
            ("unknown_medium", self.unknown_medium),
            ("shard_full", self.shard_full),
            ("unknown_removed", self.unknown_removed),
        ]
    }
}

impl std::ops::AddAssign for SkippedBlocks {
    fn add_assign(&mut self, other: SkippedBlocks) {
        self.block_size += other.block_size;
        self.token_count += other.token_count;
        self.unknown_parent += other.unknown_parent;
        self.unknown_medium += other.unknown_medium;
        self.shard_full += other.shard_full;
        self.unknown_removed += other.unknown_removed;
    }
}

/// A carrier word: `rank << 4 | tiers`. [`EMPTY_CARRIER`] marks an unused inline slot. Words and
/// engine hashes are stored in separate arrays so the routing path, which needs only the words,
/// reads 4 bytes per carrier and can compare two nodes' carrier sets with one slice comparison.
#[inline]
pub(crate) fn word(rank: u32, tiers: u8) -> u32 {
    (rank << 4) | u32::from(tiers & TIER_ALL)
}
#[inline]
pub(crate) fn word_rank(w: u32) -> u32 {
    w >> 4
}
#[inline]
pub(crate) fn word_tiers(w: u32) -> u8 {
    (w & 0x0f) as u8
}

/// One carrier word's share of a [`set_digest`]: a bijective 64-bit mix, so distinct words
/// never share a share.
#[inline]
fn word_share(w: u32) -> u64 {
    mix_engine(u64::from(w))
}

/// The wrapping sum of [`word_share`] over a carrier set: order-independent (a set is a set,
/// whatever order its ranks were added in) and updated in O(1) as words come, go or change
/// tiers. Two different sets share a digest with probability about 2^-64, the same bet the
/// content hash itself makes (equal hash => equal prefix).
fn set_digest(words: &[u32]) -> u64 {
    words
        .iter()
        .fold(0u64, |d, &w| d.wrapping_add(word_share(w)))
}

/// 32 bytes, two per cache line. No depth is stored (export orders by parent links) and
/// the single-carrier word doubles as the list reference, because at 0.6 nodes per carried pair
/// every 4 node bytes cost 2.4 bytes per pair.
pub(crate) struct Node {
    pub(crate) hash: u64,
    /// Engine hash of the inline carrier; when the carriers live in a list, that list's
    /// [`set_digest`], so the routing path can tell two nodes' carrier sets apart without
    /// reading their lists (see `Walk`).
    engine_or_digest: u64,
    /// [`EMPTY_CARRIER`]; or one carrier [`word`] (tier bits never zero); or, with the tier
    /// bits zero, `list << 4`: ALL carriers live in the shard's list pool at index `list`.
    carrier: u32,
    /// Slab index of the parent in the same shard, [`NONE`] for a chain root, or
    /// [`FREE_PARENT`] for a free slab slot.
    pub(crate) parent: u32,
    children: u32,
    /// Clock value of the last match or store touching the node; eviction picks the oldest.
    stamp: AtomicU32,
}

impl Node {
    #[inline]
    pub(crate) fn is_free(&self) -> bool {
        self.parent == FREE_PARENT
    }

    /// The list pool index when the carriers live in a list.
    #[inline]
    fn list(&self) -> Option<usize> {
        (self.carrier != EMPTY_CARRIER && word_tiers(self.carrier) == 0)
            .then_some((self.carrier >> 4) as usize)
    }

    #[inline]
    fn has_carriers(&self) -> bool {
        self.carrier != EMPTY_CARRIER
    }
}

/// `len` zeros, written: `vec![0; len]` takes fresh zero pages from the system (calloc) without
/// touching them, which leaves every first-touch page fault to whoever writes the vector next.
/// Storage made ready off the writer ([`crate::room`]) must have been written, so its faults are
/// taken here, on the thread that makes it.
#[allow(clippy::slow_vector_initialization)]
pub(crate) fn written_zeros<T: Copy + Default>(len: usize) -> Vec<T> {
    let mut column = Vec::with_capacity(len);
    column.resize(len, T::default());
    column
}

/// Carriers of a multi-carrier node, as two parallel arrays.
#[derive(Default)]
pub(crate) struct CarrierList {
    words: Vec<u32>,
    engines: Vec<u64>,
}

impl CarrierList {
    /// An empty list with room for `carriers`, its memory written once (see
    /// [`Slab::touched_chunk`] for why).
    pub(crate) fn touched(carriers: usize) -> CarrierList {
        let mut words = written_zeros(carriers);
        words.clear();
        let mut engines = written_zeros(carriers);
        engines.clear();
        CarrierList { words, engines }
    }

    /// Heap bytes of the list's two arrays.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.words.capacity() * std::mem::size_of::<u32>()
            + self.engines.capacity() * std::mem::size_of::<u64>()
    }
}

/// Carrier words per cache line, and how many lines of a carrier list's words a batched key read
/// hints ahead ([`Shard::prefetch_carrier`]); a longer list's later words are read unhinted.
const WORDS_PER_LINE: usize = 64 / std::mem::size_of::<u32>();
const PREFETCH_WORD_LINES_MAX: usize = 8;

/// Nodes per slab chunk. A shard's slab grows a chunk at a time instead of doubling one `Vec`,
/// so at most one partly used chunk is wasted per shard: root-based sharding makes shards uneven
/// (a popular system prompt pulls all its conversations into one shard), and doubling left up to
/// half of a big shard's slab unused.
pub const SLAB_CHUNK_NODES: usize = 4096;

/// Chunked node storage indexed by `u32` slab index; chunks never move once allocated.
#[derive(Default)]
pub(crate) struct Slab {
    chunks: Vec<Vec<Node>>,
    len: usize,
    /// Empty chunks made ready elsewhere ([`crate::room::GraftRoom`]), taken before allocating.
    spare: Vec<Vec<Node>>,
}

impl Slab {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, node: Node) {
        if self.len.is_multiple_of(SLAB_CHUNK_NODES) {
            let chunk = self
                .spare
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(SLAB_CHUNK_NODES));
            self.chunks.push(chunk);
        }
        if let Some(chunk) = self.chunks.last_mut() {
            chunk.push(node);
            self.len += 1;
        }
    }

    pub(crate) fn get(&self, i: usize) -> Option<&Node> {
        self.chunks
            .get(i / SLAB_CHUNK_NODES)
            .and_then(|c| c.get(i % SLAB_CHUNK_NODES))
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Node> {
        self.chunks.iter().flatten()
    }

    fn capacity_bytes(&self) -> usize {
        (self.chunks.len() + self.spare.len()) * SLAB_CHUNK_NODES * std::mem::size_of::<Node>()
            + (self.chunks.capacity() + self.spare.capacity()) * std::mem::size_of::<Vec<Node>>()
    }

    /// True when pushing `nodes` more would need a chunk the slab has neither begun nor been
    /// given.
    pub(crate) fn needs_chunk_within(&self, nodes: usize) -> bool {
        self.spare.is_empty() && self.chunks.len() * SLAB_CHUNK_NODES - self.len < nodes
    }

    /// Keeps `chunk` for the next growth. Only an empty chunk of the slab's size is kept: the
    /// slab's indexing assumes every chunk holds exactly [`SLAB_CHUNK_NODES`] slots.
    pub(crate) fn give_spare(&mut self, chunk: Vec<Node>) {
        if chunk.is_empty() && chunk.capacity() == SLAB_CHUNK_NODES {
            self.spare.push(chunk);
        }
    }

    /// An empty chunk whose memory has been written once, so that its first-touch page faults
    /// (on fresh memory, zeroing by the kernel) are paid by the thread that calls this, not by
    /// the writer that fills it later. The bytes written are zeros under `MaybeUninit`: the
    /// chunk's length stays 0 and nothing reads them.
    pub(crate) fn touched_chunk() -> Vec<Node> {
        let mut chunk: Vec<Node> = Vec::with_capacity(SLAB_CHUNK_NODES);
        for slot in chunk.spare_capacity_mut() {
            *slot = std::mem::MaybeUninit::zeroed();
        }
        chunk
    }
}

impl std::ops::Index<usize> for Slab {
    type Output = Node;
    #[inline]
    fn index(&self, i: usize) -> &Node {
        &self.chunks[i / SLAB_CHUNK_NODES][i % SLAB_CHUNK_NODES]
    }
}

impl std::ops::IndexMut<usize> for Slab {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut Node {
        &mut self.chunks[i / SLAB_CHUNK_NODES][i % SLAB_CHUNK_NODES]
    }
}

pub(crate) struct Shard {
    pub(crate) nodes: Slab,
    free: Vec<u32>,
    by_hash: HashSlots,
    lists: Vec<CarrierList>,
    free_lists: Vec<u32>,
    /// Bumped by every write, so the exporter can tell whether a shard moved between chunks.
    pub(crate) mutations: u64,
}

/// Index of `made` (empty) in the shard's pool: in a freed slot, whose old list it replaces,
/// else in a new one.
fn adopt_list(lists: &mut Vec<CarrierList>, free_lists: &mut Vec<u32>, made: CarrierList) -> u32 {
    debug_assert!(made.words.is_empty() && made.engines.is_empty());
    if let Some(idx) = free_lists.pop() {
        lists[idx as usize] = made;
        idx
    } else {
        lists.push(made);
        (lists.len() - 1) as u32
    }
}

/// Index of an empty list in the shard's pool: a freed one reused, else a new one.
fn empty_list(lists: &mut Vec<CarrierList>, free_lists: &mut Vec<u32>) -> u32 {
    let idx = free_lists.pop().unwrap_or_else(|| {
        lists.push(CarrierList::default());
        (lists.len() - 1) as u32
    });
    let list = &mut lists[idx as usize];
    list.words.clear();
    list.engines.clear();
    idx
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CarrierChange {
    Added,
    TiersAdded,
    Unchanged,
}

impl Shard {
    fn new() -> Self {
        Self {
            nodes: Slab::default(),
            free: Vec::new(),
            by_hash: HashSlots::default(),
            lists: Vec::new(),
            free_lists: Vec::new(),
            mutations: 0,
        }
    }

    pub(crate) fn reserve_nodes(&mut self, additional: usize) {
        self.by_hash.reserve(additional);
    }

    /// Room for `nodes` more nodes in the table and `lists` more carrier lists in the pool. A
    /// shard whose table holds nothing takes `table` (empty, with room for `nodes`, built off the
    /// writer) instead of writing a table of that size here, under the shard's write lock.
    pub(crate) fn reserve_for_graft(&mut self, nodes: usize, lists: usize, table: HashSlots) {
        if self.by_hash.is_empty() && table.allocated_bytes() > 0 {
            self.by_hash = table;
        } else {
            self.by_hash.reserve(nodes);
        }
        self.lists
            .reserve(lists.saturating_sub(self.free_lists.len()));
    }

    /// Hints the CPU to load the table slots a lookup of `hash` reads first.
    #[inline]
    pub(crate) fn prefetch_slot(&self, hash: u64) {
        self.by_hash.prefetch(hash);
    }

    #[inline]
    pub(crate) fn find(&self, hash: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.by_hash.find(hash, |i| nodes[i as usize].hash)
    }

    /// The node's carrier words (see [`word`]).
    #[inline]
    pub(crate) fn words<'a>(&'a self, node: &'a Node) -> &'a [u32] {
        if let Some(l) = node.list() {
            &self.lists[l].words
        } else if node.carrier != EMPTY_CARRIER {
            std::slice::from_ref(&node.carrier)
        } else {
            &[]
        }
    }

    /// The node's carrier words and engine hashes, index-aligned.
    #[inline]
    pub(crate) fn carriers<'a>(&'a self, node: &'a Node) -> (&'a [u32], &'a [u64]) {
        if let Some(l) = node.list() {
            let l = &self.lists[l];
            (&l.words, &l.engines)
        } else if node.carrier != EMPTY_CARRIER {
            (
                std::slice::from_ref(&node.carrier),
                std::slice::from_ref(&node.engine_or_digest),
            )
        } else {
            (&[], &[])
        }
    }

    /// Hints the CPU to load what [`Shard::carrier_engine`] will read for `rank`'s carrier at
    /// slab index `idx`, one link of that read's chain of loads per call: `step` 0 is the node,
    /// 1 the carrier list's header (for a node whose carriers live in a list), 2 the list's
    /// words (at most [`PREFETCH_WORD_LINES_MAX`] cache lines), 3 the engine hash at `rank`'s
    /// position. Each step reads only what the step before brought in, so a caller that runs one
    /// step over a batch of entries before the next keeps a batch of independent misses in
    /// flight instead of one at a time.
    fn prefetch_carrier(&self, idx: u32, rank: u32, step: u8) {
        let Some(node) = self.nodes.get(idx as usize) else {
            return;
        };
        if step == 0 {
            prefetch_ptr(node);
            return;
        }
        let Some(list) = node.list().and_then(|l| self.lists.get(l)) else {
            return;
        };
        match step {
            1 => prefetch_ptr(list),
            2 => {
                for line in list
                    .words
                    .chunks(WORDS_PER_LINE)
                    .take(PREFETCH_WORD_LINES_MAX)
                {
                    prefetch_ptr(&line[0]);
                }
            }
            _ => {
                if let Some(e) = list
                    .words
                    .iter()
                    .position(|&w| word_rank(w) == rank)
                    .and_then(|pos| list.engines.get(pos))
                {
                    prefetch_ptr(e);
                }
            }
        }
    }

    /// The engine hash of `rank`'s carrier at slab index `idx`, if it has one.
    fn carrier_engine(&self, idx: u32, rank: u32) -> Option<u64> {
        let node = self.nodes.get(idx as usize)?;
        if node.is_free() {
            return None;
        }
        let (words, engines) = self.carriers(node);
        let pos = words.iter().position(|&w| word_rank(w) == rank)?;
        engines.get(pos).copied()
    }

    /// Finds or creates the node for `hash` under `parent`; `None` when the slab is full.
    fn find_or_create(
        &mut self,
        hash: u64,
        parent: u32,
        max_nodes: u32,
        clock: u32,
    ) -> Option<u32> {
        if let Some(i) = self.find(hash) {
            return Some(i);
        }
        let node = Node {
            hash,
            engine_or_digest: 0,
            carrier: EMPTY_CARRIER,
            parent,
            children: 0,
            stamp: AtomicU32::new(clock),
        };
        let idx = if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            i
        } else {
            if self.nodes.len() >= max_nodes as usize {
                return None;
            }
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        };
        if parent != NONE {
            self.nodes[parent as usize].children += 1;
        }
        self.by_hash.insert_unique(hash, idx);
        Some(idx)
    }

    /// Adds `tiers` for `rank`; returns the change, the tiers before, and the carrier's previous
    /// engine hash when it differed (the engine re-announced the same content under a new hash).
    fn add_carrier(
        &mut self,
        idx: u32,
        rank: u32,
        tiers: u8,
        engine: u64,
    ) -> (CarrierChange, u8, Option<u64>) {
        let node = &mut self.nodes[idx as usize];
        let Some(list_idx) = node.list() else {
            if node.carrier == EMPTY_CARRIER {
                node.carrier = word(rank, tiers);
                node.engine_or_digest = engine;
                return (CarrierChange::Added, 0, None);
            }
            if word_rank(node.carrier) == rank {
                return update_carrier(
                    &mut node.carrier,
                    &mut node.engine_or_digest,
                    tiers,
                    engine,
                );
            }
            let (first_word, first_engine) = (node.carrier, node.engine_or_digest);
            let list_idx = empty_list(&mut self.lists, &mut self.free_lists);
            let list = &mut self.lists[list_idx as usize];
            list.words.extend([first_word, word(rank, tiers)]);
            list.engines.extend([first_engine, engine]);
            node.engine_or_digest = set_digest(&list.words);
            node.carrier = list_idx << 4;
            return (CarrierChange::Added, 0, None);
        };
        let list = &mut self.lists[list_idx];
        let result = if let Some(pos) = list.words.iter().position(|&w| word_rank(w) == rank) {
            let old = list.words[pos];
            let result =
                update_carrier(&mut list.words[pos], &mut list.engines[pos], tiers, engine);
            node.engine_or_digest = node
                .engine_or_digest
                .wrapping_sub(word_share(old))
                .wrapping_add(word_share(list.words[pos]));
            result
        } else {
            let w = word(rank, tiers);
            list.words.push(w);
            list.engines.push(engine);
            node.engine_or_digest = node.engine_or_digest.wrapping_add(word_share(w));
            (CarrierChange::Added, 0, None)
        };
        debug_assert_eq!(node.engine_or_digest, set_digest(&list.words));
        result
    }

    /// Whether the node at `idx` carries nothing (a node just created, or one whose carriers all
    /// went).
    #[inline]
    pub(crate) fn carries_nothing(&self, idx: u32) -> bool {
        self.nodes
            .get(idx as usize)
            .is_some_and(|n| n.carrier == EMPTY_CARRIER)
    }

    /// Gives the node at `idx`, which carries nothing, every carrier in `words` (two or more, of
    /// pairwise distinct ranks, tier bits non-zero) with the index-aligned `engines`, in one list
    /// allocated at its final size. The result equals `add_carrier` once per word; a graft's
    /// shared prefixes pay that way a rank scan per carrier (quadratic in the carriers) and a
    /// list growth step each time the count doubles.
    ///
    /// `made` is an empty list made ready elsewhere ([`crate::room`]), used when it has room
    /// for every carrier, so the list's memory is not first touched here.
    pub(crate) fn set_carriers_of_bare_node(
        &mut self,
        idx: u32,
        words: &[u32],
        engines: &[u64],
        made: Option<CarrierList>,
    ) {
        debug_assert!(words.len() >= 2 && words.len() == engines.len());
        debug_assert!(self.carries_nothing(idx));
        let list_idx = match made {
            Some(made)
                if made.words.is_empty()
                    && made.words.capacity() >= words.len()
                    && made.engines.capacity() >= engines.len() =>
            {
                adopt_list(&mut self.lists, &mut self.free_lists, made)
            }
            _ => empty_list(&mut self.lists, &mut self.free_lists),
        };
        let list = &mut self.lists[list_idx as usize];
        list.words.extend_from_slice(words);
        list.engines.extend_from_slice(engines);
        let node = &mut self.nodes[idx as usize];
        node.engine_or_digest = set_digest(words);
        node.carrier = list_idx << 4;
    }

    /// Clears `mask` from `rank`'s carrier (if its engine hash is `engine`, when given). Returns
    /// the carrier's tiers before and after and its engine hash, or `None` when the rank does
    /// not carry the node.
    fn clear_carrier(
        &mut self,
        idx: u32,
        rank: u32,
        mask: u8,
        engine: Option<u64>,
    ) -> Option<(u8, u8, u64)> {
        let node = &mut self.nodes[idx as usize];
        if node.is_free() {
            return None;
        }
        let Some(list_idx) = node.list() else {
            if node.carrier == EMPTY_CARRIER
                || word_rank(node.carrier) != rank
                || engine.is_some_and(|e| e != node.engine_or_digest)
            {
                return None;
            }
            let before = word_tiers(node.carrier);
            let after = before & !mask;
            let eng = node.engine_or_digest;
            if after == 0 {
                node.carrier = EMPTY_CARRIER;
                node.engine_or_digest = 0;
            } else {
                node.carrier = word(rank, after);
            }
            return Some((before, after, eng));
        };
        let list = &mut self.lists[list_idx];
        let pos = list
            .words
            .iter()
            .zip(&list.engines)
            .position(|(&w, &e)| word_rank(w) == rank && engine.is_none_or(|x| x == e))?;
        let old_word = list.words[pos];
        let before = word_tiers(old_word);
        let after = before & !mask;
        let eng = list.engines[pos];
        node.engine_or_digest = node.engine_or_digest.wrapping_sub(word_share(old_word));
        if after != 0 {
            list.words[pos] = word(rank, after);
            node.engine_or_digest = node
                .engine_or_digest
                .wrapping_add(word_share(list.words[pos]));
            debug_assert_eq!(node.engine_or_digest, set_digest(&list.words));
            return Some((before, after, eng));
        }
        list.words.remove(pos);
        list.engines.remove(pos);
        debug_assert_eq!(node.engine_or_digest, set_digest(&list.words));
        if list.words.len() <= 1 {
            node.carrier = list.words.pop().unwrap_or(EMPTY_CARRIER);
            node.engine_or_digest = list.engines.pop().unwrap_or(0);
            if list.words.capacity() > 8 {
                *list = CarrierList::default();
            }
            self.free_lists.push(list_idx as u32);
        }
        Some((before, after, eng))
    }

    /// Removes nodes with no carriers and no children, walking up from `idx`.
    fn prune(&mut self, mut idx: u32) {
        loop {
            let node = &self.nodes[idx as usize];
            if node.is_free() || node.children != 0 || node.has_carriers() {
                return;
            }
            let (hash, parent) = (node.hash, node.parent);
            let nodes = &self.nodes;
            self.by_hash.remove(hash, |i| nodes[i as usize].hash);
            let node = &mut self.nodes[idx as usize];
            node.parent = FREE_PARENT;
            self.free.push(idx);
            if parent == NONE {
                return;
            }
            self.nodes[parent as usize].children -= 1;
            idx = parent;
        }
    }
}

fn update_carrier(
    w: &mut u32,
    e: &mut u64,
    tiers: u8,
    engine: u64,
) -> (CarrierChange, u8, Option<u64>) {
    let before = word_tiers(*w);
    let old_engine = *e;
    *w = word(word_rank(*w), before | tiers);
    *e = engine;
    let change = if before | tiers != before {
        CarrierChange::TiersAdded
    } else {
        CarrierChange::Unchanged
    };
    (change, before, (old_engine != engine).then_some(old_engine))
}

pub(crate) struct RankShared {
    pub(crate) rank_ref: RankRef,
    carried: AtomicU64,
    tiers: [AtomicU64; 4],
    cursor: Mutex<CursorCell>,
}

/// A rank's cursor and the epoch of the stream it belongs to.
///
/// The epoch counts every cursor change that is not a forward step of one publisher's stream
/// (`None` -> `Some`, `Some` -> `None`, or a lower `seq`: a publisher reset, a discarded graft, a
/// restore). An exporter that reads the cursor before and after its walk claims the earlier one
/// only if the epoch is unchanged, so it never pairs a watermark with another stream's events.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CursorCell {
    pub(crate) value: Option<(i64, f64)>,
    pub(crate) stream_epoch: u64,
}

impl RankShared {
    pub(crate) fn cursor(&self) -> Option<(i64, f64)> {
        self.cursor.lock().value
    }

    pub(crate) fn cursor_cell(&self) -> CursorCell {
        *self.cursor.lock()
    }
}

pub(crate) struct Shared {
    pub(crate) cfg: IndexConfig,
    shard_shift: u32,
    shard_bits: u32,
    max_nodes_per_shard: u32,
    pub(crate) shards: Box<[RwLock<Shard>]>,
    pub(crate) ranks: RwLock<Vec<Option<Arc<RankShared>>>>,
    total_carried: AtomicU64,
    clock: AtomicU32,
    counters: CounterCells,
}

impl Shared {
    /// Fibonacci hashing of the root block's content hash picks the shard.
    #[inline]
    pub(crate) fn shard_of_root(&self, root_hash: u64) -> usize {
        if self.shard_bits == 0 {
            0
        } else {
            (root_hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shard_shift) as usize
        }
    }
    pub(crate) fn total_carried_hint(&self) -> u64 {
        self.total_carried.load(Relaxed)
    }
    #[inline]
    pub(crate) fn node_ref(&self, shard: usize, idx: u32) -> u32 {
        (idx << self.shard_bits) | shard as u32
    }
    #[inline]
    pub(crate) fn split_ref(&self, node_ref: u32) -> (usize, u32) {
        (
            (node_ref & ((1 << self.shard_bits) - 1)) as usize,
            node_ref >> self.shard_bits,
        )
    }

    /// Read guards on every shard, for the writer to resolve many side map keys (a side map
    /// rehash) without a lock round trip per key. Readers are not blocked by them; only the
    /// caller (the writer) must not take a write lock while they live.
    fn read_all(&self) -> Vec<parking_lot::RwLockReadGuard<'_, Shard>> {
        self.shards.iter().map(|s| s.read()).collect()
    }

    /// The engine hash of `rank`'s carrier at `node_ref`: how the writer reads a side map key.
    /// `held` is the shard whose write guard the caller holds (read through the guard: taking
    /// its read lock on the same thread would deadlock); any other shard is read-locked briefly.
    fn engine_at(&self, node_ref: u32, rank: u32, held: Option<(usize, &Shard)>) -> Option<u64> {
        let (s, idx) = self.split_ref(node_ref);
        match held {
            Some((h, shard)) if h == s => shard.carrier_engine(idx, rank),
            _ => self.shards.get(s)?.read().carrier_engine(idx, rank),
        }
    }
}

/// The single writer. Not `Clone`; every mutation takes `&mut self`.
pub struct IndexWriter {
    pub(crate) shared: Arc<Shared>,
    ranks: Vec<Option<WriterRank>>,
    by_ref: HashMap<RankRef, RankId>,
    token_scratch: Vec<u32>,
}

struct WriterRank {
    /// Index-only side map: each slot is a packed node ref; the key (the engine hash) is NOT
    /// stored here but read back through the node's carrier for this rank (see `side_get`).
    side: HashTable<u32>,
    stats: Arc<RankShared>,
}

/// Engine hashes need not be uniform (a simulator may count 1, 2, 3): mix before bucketing.
#[inline]
fn mix_engine(h: u64) -> u64 {
    let mut z = h.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

// Side map invariant (what makes an index-only map sound): an entry `r` filed under engine hash
// `e` exists only while rank's carrier at node `r` holds engine hash `e`, and a node has at most
// one entry per rank. Every operation that can rehash (`side_put`, `reserve`) runs only while the
// invariant holds; a carrier whose engine hash changes has its entry removed (by node ref, which
// needs no key) before the next insert.

/// The node ref filed under `engine`; `engine_of` reads a candidate node's carrier engine hash.
/// Hashbrown's 7-bit control tags mean a miss almost never reads a node.
fn side_get(
    side: &HashTable<u32>,
    engine: u64,
    engine_of: impl Fn(u32) -> Option<u64>,
) -> Option<u32> {
    side.find(mix_engine(engine), |&r| engine_of(r) == Some(engine))
        .copied()
}

/// Files `node_ref` under `engine` (whose carrier must already hold `engine`); returns the node
/// ref it replaced.
/// Whether entries filed in bulk into a side map are known to have pairwise distinct keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryKeys {
    /// Proven distinct (a graft plan checks one engine hash per rank): an empty map takes them
    /// without comparing keys.
    Distinct,
    /// Not proven: each entry is matched against the map, a later one replacing an earlier one.
    Unchecked,
}

fn side_put(
    side: &mut HashTable<u32>,
    engine: u64,
    node_ref: u32,
    engine_of: impl Fn(u32) -> Option<u64>,
) -> Option<u32> {
    match side.entry(
        mix_engine(engine),
        |&r| engine_of(r) == Some(engine),
        |&r| mix_engine(engine_of(r).unwrap_or(0)),
    ) {
        hashbrown::hash_table::Entry::Occupied(mut o) => {
            let old = *o.get();
            *o.get_mut() = node_ref;
            Some(old)
        }
        hashbrown::hash_table::Entry::Vacant(v) => {
            v.insert(node_ref);
            None
        }
    }
}

/// Side maps with at least this many entries grow by [`side_grow_batched`]. A smaller map's
/// nodes are few enough to stay in cache, where hashbrown's own resize is as fast.
const SIDE_GROW_BATCHED_ENTRIES_MIN: usize = 4_096;
/// Entries whose keys [`side_grow_batched`] reads together: enough loads in flight to overlap
/// the memory misses, few enough that what the first step brought in is still cached at the last.
const SIDE_GROW_BATCH_ENTRIES: usize = 16;

/// Makes room for `additional` inserts. A rehash reads every entry's key from its node, so it
/// runs under read guards on all shards taken once (the caller holds no shard lock).
fn side_reserve(side: &mut HashTable<u32>, additional: usize, shared: &Shared, rank: u32) {
    if side.capacity() - side.len() >= additional {
        return;
    }
    let guards = shared.read_all();
    if side.len() < SIDE_GROW_BATCHED_ENTRIES_MIN {
        side.reserve(additional, |&r| {
            mix_engine(engine_in(shared, &guards, r, rank).unwrap_or(0))
        });
        return;
    }
    side_grow_batched(side, additional, shared, &guards, rank);
}

/// A side map's growth with its keys read in batches. hashbrown's resize asks for one entry's
/// key at a time, and a key is a read through the entry's node (and, for a node several ranks
/// carry, through its carrier list): a chain of dependent memory misses per entry, about 400 ns
/// each on a fleet-sized index, during which the writer applies nothing else. Here the entries
/// are taken [`SIDE_GROW_BATCH_ENTRIES`] at a time and each load of the chain is hinted for the
/// whole batch before the next (see [`Shard::prefetch_carrier`]), so the misses overlap.
///
/// The new table is sized as hashbrown's `reserve` would size it (same bucket count when the
/// entries and the request fit in half of it, which drops tombstones; else at least double), so
/// growth stays amortised and memory the same. hashbrown does not expose its bucket count; its
/// allocation is one slot plus one control byte per bucket, plus one group of trailing control
/// bytes and alignment, so rounding the allocation down to a power of two recovers it. A wrong
/// figure could only change the size chosen, never which entries the map holds.
fn side_grow_batched(
    side: &mut HashTable<u32>,
    additional: usize,
    shared: &Shared,
    guards: &[parking_lot::RwLockReadGuard<'_, Shard>],
    rank: u32,
) {
    let key_of = |r: u32| mix_engine(engine_in(shared, guards, r, rank).unwrap_or(0));
    let buckets = (side.allocation_size() / (std::mem::size_of::<u32>() + 1))
        .checked_ilog2()
        .map_or(0, |bits| 1usize << bits);
    let full_capacity = buckets / 8 * 7;
    let wanted = side.len().saturating_add(additional);
    let capacity = if wanted <= full_capacity / 2 {
        full_capacity
    } else {
        wanted.max(full_capacity + 1)
    };
    let mut grown: HashTable<u32> = HashTable::with_capacity(capacity);
    let mut batch = [0u32; SIDE_GROW_BATCH_ENTRIES];
    let mut filled = 0;
    let file = |grown: &mut HashTable<u32>, refs: &[u32]| {
        for step in 0..4 {
            for &r in refs {
                let (s, idx) = shared.split_ref(r);
                if let Some(g) = guards.get(s) {
                    g.prefetch_carrier(idx, rank, step);
                }
            }
        }
        for &r in refs {
            // Sized above for every entry, so the hasher is never called; it is the real one
            // all the same.
            grown.insert_unique(key_of(r), r, |&x| key_of(x));
        }
    };
    for &r in side.iter() {
        batch[filled] = r;
        filled += 1;
        if filled == SIDE_GROW_BATCH_ENTRIES {
            file(&mut grown, &batch);
            filled = 0;
        }
    }
    file(&mut grown, &batch[..filled]);
    *side = grown;
}

/// [`Shared::engine_at`] through guards from [`Shared::read_all`].
fn engine_in(
    shared: &Shared,
    guards: &[parking_lot::RwLockReadGuard<'_, Shard>],
    node_ref: u32,
    rank: u32,
) -> Option<u64> {
    let (s, idx) = shared.split_ref(node_ref);
    guards.get(s)?.carrier_engine(idx, rank)
}

/// Removes `node_ref`'s entry filed under `engine`. Matching by node ref alone is exact because a
/// node has at most one entry per rank, and it needs no node read (the carrier may already be
/// gone or hold a new engine hash).
fn side_remove_if(side: &mut HashTable<u32>, engine: u64, node_ref: u32) {
    if let Ok(o) = side.find_entry(mix_engine(engine), |&r| r == node_ref) {
        o.remove();
    }
}

/// Pending per-rank stat deltas, flushed once per event to keep atomics off the per-block path.
#[derive(Default)]
struct Delta {
    carried: i64,
    tiers: [i64; 4],
}

impl Delta {
    fn record(&mut self, before: u8, after: u8) {
        if before == 0 && after != 0 {
            self.carried += 1;
        } else if before != 0 && after == 0 {
            self.carried -= 1;
        }
        for (b, t) in self.tiers.iter_mut().enumerate() {
            let bit = 1u8 << b;
            match (before & bit != 0, after & bit != 0) {
                (false, true) => *t += 1,
                (true, false) => *t -= 1,
                _ => {}
            }
        }
    }
    fn flush(&mut self, rank: &RankShared, total: &AtomicU64) {
        add_signed(&rank.carried, self.carried);
        add_signed(total, self.carried);
        for (cell, d) in rank.tiers.iter().zip(self.tiers) {
            add_signed(cell, d);
        }
        *self = Delta::default();
    }
}

fn add_signed(cell: &AtomicU64, d: i64) {
    if d > 0 {
        cell.fetch_add(d as u64, Relaxed);
    } else if d < 0 {
        cell.fetch_sub(d.unsigned_abs(), Relaxed);
    }
}

fn medium_bit(m: Option<Medium>) -> Option<u8> {
    match m {
        None | Some(Medium::Device) => Some(TIER_DEVICE),
        Some(Medium::Host) => Some(TIER_HOST),
        Some(Medium::Disk) => Some(TIER_DISK),
        Some(Medium::External) => Some(TIER_EXTERNAL),
        Some(Medium::Unknown) => None,
    }
}

/// Read-only handle for routing and export. Clone freely.
#[derive(Clone)]
pub struct IndexReader {
    pub(crate) shared: Arc<Shared>,
}

/// Entry point: builds an empty index and its two handles.
pub struct PrefixIndex;

impl PrefixIndex {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(cfg: IndexConfig) -> (IndexWriter, IndexReader) {
        let shard_count = cfg
            .shard_count
            .clamp(1, SHARD_COUNT_MAX)
            .next_power_of_two();
        let shard_bits = shard_count.trailing_zeros();
        let cfg = IndexConfig { shard_count, ..cfg };
        let shared = Arc::new(Shared {
            cfg,
            shard_shift: 64 - shard_bits,
            shard_bits,
            max_nodes_per_shard: (((1u64 << (32 - shard_bits)) - 1) as u32)
                .min(NODES_PER_SHARD_MAX),
            shards: (0..shard_count)
                .map(|_| RwLock::new(Shard::new()))
                .collect(),
            ranks: RwLock::new(Vec::new()),
            total_carried: AtomicU64::new(0),
            clock: AtomicU32::new(1),
            counters: CounterCells::default(),
        });
        (
            IndexWriter {
                shared: shared.clone(),
                ranks: Vec::new(),
                by_ref: HashMap::new(),
                token_scratch: Vec::new(),
            },
            IndexReader { shared },
        )
    }
}

impl IndexWriter {
    pub fn reader(&self) -> IndexReader {
        IndexReader {
            shared: self.shared.clone(),
        }
    }

    pub fn config(&self) -> IndexConfig {
        self.shared.cfg
    }

    /// Registers `rank_ref` (idempotent: the same ref returns the same id while registered).
    pub fn add_rank(&mut self, rank_ref: RankRef) -> RankId {
        if let Some(&id) = self.by_ref.get(&rank_ref) {
            return id;
        }
        // Beyond RANK_IDS_MAX registrations (2^28) ids would collide with the tier bits; that
        // many registrations in one process is not a realistic input, so it saturates loudly in
        // debug builds only.
        debug_assert!((self.ranks.len() as u32) < RANK_IDS_MAX);
        let id = RankId(self.ranks.len() as u32);
        let stats = Arc::new(RankShared {
            rank_ref: rank_ref.clone(),
            carried: AtomicU64::new(0),
            tiers: Default::default(),
            cursor: Mutex::new(CursorCell::default()),
        });
        self.ranks.push(Some(WriterRank {
            side: HashTable::new(),
            stats: stats.clone(),
        }));
        self.shared.ranks.write().push(Some(stats));
        self.by_ref.insert(rank_ref, id);
        id
    }

    /// Heap bytes held by the per-rank side maps (engine hash -> node): buckets of a 4-byte node
    /// ref plus hashbrown's 1-byte control tag.
    pub fn side_map_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .flatten()
            .map(|r| {
                let buckets = if r.side.capacity() == 0 {
                    0
                } else {
                    (r.side.capacity() * 8 / 7).next_power_of_two()
                };
                (buckets * (std::mem::size_of::<u32>() + 1)) as u64
            })
            .sum()
    }

    pub fn rank_id(&self, rank_ref: &RankRef) -> Option<RankId> {
        self.by_ref.get(rank_ref).copied()
    }

    /// Drops every carrier of `rank` (AllBlocksCleared, publisher reset). Keeps its cursor.
    pub fn clear_rank(&mut self, rank: RankId) {
        if self.drop_carriers(rank) {
            self.shared.counters.cleared_ranks.fetch_add(1, Relaxed);
        }
    }

    /// Drops every carrier of `rank` and empties its side map; false if the rank is unknown.
    fn drop_carriers(&mut self, rank: RankId) -> bool {
        let Some(Some(wr)) = self.ranks.get_mut(rank.0 as usize) else {
            return false;
        };
        let mut entries: Vec<u32> = wr.side.drain().collect();
        let stats = wr.stats.clone();
        // Grouped by shard so each shard's write lock is taken a bounded number of times.
        entries.sort_unstable_by_key(|r| r & ((1 << self.shared.shard_bits) - 1));
        let mut delta = Delta::default();
        const CLEAR_CHUNK_BLOCKS: usize = 1024;
        for chunk in entries.chunks(CLEAR_CHUNK_BLOCKS) {
            let mut i = 0;
            while i < chunk.len() {
                let (shard_idx, _) = self.shared.split_ref(chunk[i]);
                let mut shard = self.shared.shards[shard_idx].write();
                shard.mutations += 1;
                while i < chunk.len() {
                    let (s, idx) = self.shared.split_ref(chunk[i]);
                    if s != shard_idx {
                        break;
                    }
                    // A node has at most one entry per rank, so no engine hash check is needed.
                    if let Some((before, after, _)) =
                        shard.clear_carrier(idx, rank.0, TIER_ALL, None)
                    {
                        delta.record(before, after);
                        shard.prune(idx);
                    }
                    i += 1;
                }
            }
        }
        delta.flush(&stats, &self.shared.total_carried);
        true
    }

    /// Clears the rank and forgets it; its id is never handed out again.
    pub fn remove_rank(&mut self, rank: RankId) {
        if !matches!(self.ranks.get(rank.0 as usize), Some(Some(_))) {
            return;
        }
        self.drop_carriers(rank);
        if let Some(slot) = self.ranks.get_mut(rank.0 as usize)
            && let Some(wr) = slot.take()
        {
            self.by_ref.remove(&wr.stats.rank_ref);
        }
        if let Some(slot) = self.shared.ranks.write().get_mut(rank.0 as usize) {
            *slot = None;
        }
    }

    /// Sets `rank`'s cursor; any change that is not a forward step of the same stream starts a
    /// new stream epoch (see [`CursorCell`]).
    pub fn set_cursor(&mut self, rank: RankId, cursor: Option<(i64, f64)>) {
        if let Some(Some(wr)) = self.ranks.get(rank.0 as usize) {
            let mut cell = wr.stats.cursor.lock();
            let forward =
                matches!((cell.value, cursor), (Some((old, _)), Some((new, _))) if new >= old);
            if !forward {
                cell.stream_epoch += 1;
            }
            cell.value = cursor;
        }
    }

    /// `(room, entries)` of `rank`'s side map: inserts it takes before its next growth step, and
    /// entries it holds. `None` for an unknown rank.
    pub fn side_map_room(&self, rank: RankId) -> Option<(usize, usize)> {
        let wr = self.ranks.get(rank.0 as usize)?.as_ref()?;
        Some((wr.side.capacity() - wr.side.len(), wr.side.len()))
    }

    /// Takes `rank`'s next side-map growth step now. A step rehashes every entry by reading its
    /// node (the key lives there), which costs milliseconds for a large rank; the step would
    /// otherwise run inside whichever `apply_batch` crosses the threshold, and ranks of one size
    /// fed at one rate cross it together, stalling the writer for several steps in a row. This
    /// lets the writer's owner run them one at a time, ahead of need.
    pub fn grow_side_map(&mut self, rank: RankId) {
        let shared = self.shared.clone();
        if let Some(Some(wr)) = self.ranks.get_mut(rank.0 as usize) {
            let room = wr.side.capacity() - wr.side.len();
            side_reserve(&mut wr.side, room + 1, &shared, rank.0);
        }
    }

    /// Applies every event, evicts if over the cap, then records `(seq, batch.ts)` as the rank's
    /// cursor (last, so an exporter that sees the new cursor also sees the events' effects).
    pub fn apply_batch(&mut self, rank: RankId, seq: i64, batch: &EventBatch) -> ApplyReport {
        let mut report = ApplyReport::default();
        for ev in &batch.events {
            self.apply_event_inner(rank, ev, &mut report);
        }
        report.evicted_carriers = self.enforce_cap();
        self.set_cursor(rank, Some((seq, batch.ts)));
        report
    }

    pub fn apply_event(&mut self, rank: RankId, event: &KvEvent) -> ApplyReport {
        let mut report = ApplyReport::default();
        self.apply_event_inner(rank, event, &mut report);
        report.evicted_carriers = self.enforce_cap();
        report
    }

    fn apply_event_inner(&mut self, rank: RankId, event: &KvEvent, report: &mut ApplyReport) {
        report.events += 1;
        if !matches!(self.ranks.get(rank.0 as usize), Some(Some(_))) {
            self.shared
                .counters
                .unknown_rank_events
                .fetch_add(1, Relaxed);
            return;
        }
        self.shared.clock.fetch_add(1, Relaxed);
        match event {
            KvEvent::BlockStored(s) => self.store(rank, s, report),
            KvEvent::BlockRemoved(r) => self.remove(rank, r, report),
            KvEvent::AllBlocksCleared => self.clear_rank(rank),
        }
    }

    fn store(&mut self, rank: RankId, s: &BlockStored, report: &mut ApplyReport) {
        let n = s.block_hashes.len();
        if n == 0 {
            return;
        }
        let c = &self.shared.counters;
        let bs = self.shared.cfg.block_size as usize;
        if s.block_size as usize != bs || bs == 0 {
            c.block_size_mismatch_events.fetch_add(1, Relaxed);
            report.skipped.block_size += n as u64;
            report.foreign_block_size = Some(s.block_size);
            return;
        }
        let Some(tier) = medium_bit(s.medium) else {
            c.unknown_medium_stored_blocks.fetch_add(n as u64, Relaxed);
            report.skipped.unknown_medium += n as u64;
            return;
        };
        let want = bs.checked_mul(n);
        let mut tokens = std::mem::take(&mut self.token_scratch);
        tokens.clear();
        let token_ids: &[u32] = if Some(s.token_ids.len()) == want {
            &s.token_ids
        } else if want.and_then(|w| w.checked_mul(2)) == Some(s.token_ids.len()) {
            // Speculative-decoding engines (SGLang EAGLE bigram) send (t_i, t_{i+1}) pairs; the
            // first element of each pair is the block's own token sequence.
            tokens.extend(s.token_ids.iter().step_by(2));
            &tokens
        } else {
            c.token_mismatch_events.fetch_add(1, Relaxed);
            report.skipped.token_count += n as u64;
            self.token_scratch = tokens;
            return;
        };

        let shared = self.shared.clone();
        let Some(Some(wr)) = self.ranks.get_mut(rank.0 as usize) else {
            self.token_scratch = tokens;
            return;
        };
        let (shard_idx, mut parent_idx) = match s.parent_block_hash {
            None => {
                let seed = namespace_seed(s.lora_name.as_deref(), s.lora_id);
                let h0 = chain_hash(seed, &token_ids[..bs], extra_at(&s.extra_keys, 0));
                (shared.shard_of_root(h0), NONE)
            }
            Some(p) => match side_get(&wr.side, p.0, |r| shared.engine_at(r, rank.0, None)) {
                Some(r) => shared.split_ref(r),
                None => {
                    c.stored_unknown_parent_blocks.fetch_add(n as u64, Relaxed);
                    report.skipped.unknown_parent += n as u64;
                    self.token_scratch = tokens;
                    return;
                }
            },
        };
        // Grow the side map BEFORE the shard write lock: a rehash reads every entry's node
        // (the key lives there), which must not stretch the time readers wait on the lock.
        side_reserve(&mut wr.side, n, &shared, rank.0);
        let clock = shared.clock.load(Relaxed);
        let mut delta = Delta::default();
        let mut displaced: Vec<(u64, u32)> = Vec::new();
        let mut stored = 0u64;
        {
            let mut shard = shared.shards[shard_idx].write();
            shard.mutations += 1;
            let mut parent_hash = if parent_idx == NONE {
                namespace_seed(s.lora_name.as_deref(), s.lora_id)
            } else {
                match shard.nodes.get(parent_idx as usize) {
                    Some(p) if !p.is_free() => p.hash,
                    _ => {
                        // Side maps never point at freed nodes; stay safe if that ever breaks.
                        c.stored_unknown_parent_blocks.fetch_add(n as u64, Relaxed);
                        report.skipped.unknown_parent += n as u64;
                        drop(shard);
                        self.token_scratch = tokens;
                        return;
                    }
                }
            };
            for (i, (engine, block)) in s
                .block_hashes
                .iter()
                .zip(token_ids.chunks_exact(bs))
                .enumerate()
            {
                let h = chain_hash(parent_hash, block, extra_at(&s.extra_keys, i));
                let Some(idx) =
                    shard.find_or_create(h, parent_idx, shared.max_nodes_per_shard, clock)
                else {
                    c.shard_full_blocks.fetch_add((n - i) as u64, Relaxed);
                    report.skipped.shard_full += (n - i) as u64;
                    break;
                };
                shard.nodes[idx as usize].stamp.store(clock, Relaxed);
                let (change, before, old_engine) = shard.add_carrier(idx, rank.0, tier, engine.0);
                if change != CarrierChange::Unchanged {
                    delta.record(before, before | tier);
                }
                let node_ref = shared.node_ref(shard_idx, idx);
                if let Some(old) = old_engine {
                    // Same content, new engine hash: the old hash no longer names this carrier.
                    side_remove_if(&mut wr.side, old, node_ref);
                }
                let held = Some((shard_idx, &*shard));
                if let Some(prev) = side_put(&mut wr.side, engine.0, node_ref, |r| {
                    shared.engine_at(r, rank.0, held)
                }) && prev != node_ref
                {
                    displaced.push((engine.0, prev));
                }
                stored += 1;
                parent_hash = h;
                parent_idx = idx;
            }
        }
        // The engine reused a hash for other content: its old carrier can no longer be removed
        // by hash, so drop it now rather than leak it until eviction.
        for (engine, prev) in displaced {
            let (s_idx, idx) = shared.split_ref(prev);
            let mut shard = shared.shards[s_idx].write();
            shard.mutations += 1;
            if let Some((before, after, _)) =
                shard.clear_carrier(idx, rank.0, TIER_ALL, Some(engine))
            {
                delta.record(before, after);
                shard.prune(idx);
            }
        }
        delta.flush(&wr.stats, &shared.total_carried);
        c.stored_blocks.fetch_add(stored, Relaxed);
        report.stored_blocks += stored;
        self.token_scratch = tokens;
    }

    fn remove(&mut self, rank: RankId, r: &BlockRemoved, report: &mut ApplyReport) {
        let shared = self.shared.clone();
        let Some(Some(wr)) = self.ranks.get_mut(rank.0 as usize) else {
            return;
        };
        let mask = match r.medium {
            None | Some(Medium::Unknown) => TIER_ALL,
            Some(m) => medium_bit(Some(m)).unwrap_or(TIER_ALL),
        };
        let mut delta = Delta::default();
        let (mut removed, mut unknown) = (0u64, 0u64);
        // One write lock per run of blocks in the same shard (a chain lives in one shard), so a
        // reader sees a removal event's chain either whole or gone, never half removed.
        let mut held: Option<(usize, parking_lot::RwLockWriteGuard<'_, Shard>, usize)> = None;
        for engine in &r.block_hashes {
            let guard = held.as_ref().map(|(s, g, _)| (*s, &**g));
            let Some(node_ref) =
                side_get(&wr.side, engine.0, |r| shared.engine_at(r, rank.0, guard))
            else {
                unknown += 1;
                continue;
            };
            let (s_idx, idx) = shared.split_ref(node_ref);
            let reuse = matches!(&held, Some((s, _, n)) if *s == s_idx && *n < BLOCKS_PER_LOCK_MAX);
            if !reuse {
                drop(held.take());
                let mut g = shared.shards[s_idx].write();
                g.mutations += 1;
                held = Some((s_idx, g, 0));
            }
            let Some((_, shard, n)) = held.as_mut() else {
                continue;
            };
            *n += 1;
            match shard.clear_carrier(idx, rank.0, mask, Some(engine.0)) {
                Some((before, after, _)) => {
                    delta.record(before, after);
                    removed += 1;
                    if after == 0 {
                        shard.prune(idx);
                        side_remove_if(&mut wr.side, engine.0, node_ref);
                    }
                }
                None => {
                    // Defensive: a side entry without its carrier is stale; drop it.
                    side_remove_if(&mut wr.side, engine.0, node_ref);
                    unknown += 1;
                }
            }
        }
        drop(held);
        delta.flush(&wr.stats, &shared.total_carried);
        shared.counters.removed_blocks.fetch_add(removed, Relaxed);
        shared
            .counters
            .removed_unknown_blocks
            .fetch_add(unknown, Relaxed);
        report.removed_blocks += removed;
        report.skipped.unknown_removed += unknown;
    }

    /// Evicts least-recently-matched leaf carriers while over the cap; returns carriers evicted.
    pub fn enforce_cap(&mut self) -> u64 {
        let cap = self.shared.cfg.max_carried_blocks;
        if self.shared.total_carried.load(Relaxed) <= cap {
            return 0;
        }
        let target = (cap / 100).saturating_mul(EVICT_TARGET_PERCENT)
            + (cap % 100) * EVICT_TARGET_PERCENT / 100;
        self.shared.counters.eviction_runs.fetch_add(1, Relaxed);
        let shared = self.shared.clone();
        let mut evicted = 0u64;
        while shared.total_carried.load(Relaxed) > target {
            // (stamp, shard, idx) of every leaf that has carriers.
            let mut leaves: Vec<(u32, u32, u32)> = Vec::new();
            for (s_idx, lock) in shared.shards.iter().enumerate() {
                let shard = lock.read();
                for (i, node) in shard.nodes.iter().enumerate() {
                    if !node.is_free() && node.children == 0 && !shard.words(node).is_empty() {
                        leaves.push((node.stamp.load(Relaxed), s_idx as u32, i as u32));
                    }
                }
            }
            if leaves.is_empty() {
                break;
            }
            leaves.sort_unstable();
            let mut progressed = false;
            for (_, s_idx, idx) in leaves {
                if shared.total_carried.load(Relaxed) <= target {
                    break;
                }
                let mut shard = shared.shards[s_idx as usize].write();
                shard.mutations += 1;
                let node = &shard.nodes[idx as usize];
                let carriers: Vec<u32> = shard.words(node).to_vec();
                let node_ref = shared.node_ref(s_idx as usize, idx);
                for w in carriers {
                    let rank = word_rank(w);
                    if let Some((before, after, eng)) =
                        shard.clear_carrier(idx, rank, TIER_ALL, None)
                        && let Some(Some(wr)) = self.ranks.get_mut(rank as usize)
                    {
                        side_remove_if(&mut wr.side, eng, node_ref);
                        let mut d = Delta::default();
                        d.record(before, after);
                        d.flush(&wr.stats, &shared.total_carried);
                        evicted += 1;
                        progressed = true;
                    }
                }
                shard.prune(idx);
            }
            if !progressed {
                break;
            }
        }
        shared.counters.evicted_carriers.fetch_add(evicted, Relaxed);
        evicted
    }

    /// Adds a carrier during restore; `parent` is a node ref or `None` for a root.
    /// Adds a carrier during restore. Side maps are filled afterwards, rank by rank
    /// ([`IndexWriter::restore_side_entries`]), so each rank's map stays cache-resident while it
    /// is built; an engine hash this carrier replaced is queued in `displaced`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn restore_carrier(
        &self,
        rank: RankId,
        node_ref: u32,
        tiers: u8,
        engine: u64,
        shard: &mut Shard,
        delta_tiers: &mut RestoreDelta,
        displaced: &mut Vec<(RankId, u64, u32)>,
    ) {
        let (_, idx) = self.shared.split_ref(node_ref);
        let (change, before, old_engine) = shard.add_carrier(idx, rank.0, tiers, engine);
        if change != CarrierChange::Unchanged {
            delta_tiers.record(rank, before, before | tiers);
        }
        if let Some(old) = old_engine {
            displaced.push((rank, old, node_ref));
        }
    }

    /// Gives the node at `idx`, which carries nothing, all of `words`' carriers at once (the
    /// preconditions of [`Shard::set_carriers_of_bare_node`]): `restore_carrier` once per word,
    /// without the per-carrier work. Nothing is displaced, since the node carried nothing.
    pub(crate) fn restore_bare_carriers(
        &self,
        shard: &mut Shard,
        idx: u32,
        words: &[u32],
        engines: &[u64],
        delta_tiers: &mut RestoreDelta,
        made: Option<CarrierList>,
    ) {
        shard.set_carriers_of_bare_node(idx, words, engines, made);
        for &w in words {
            delta_tiers.record(RankId(word_rank(w)), 0, word_tiers(w));
        }
    }

    /// Drops side entries of replaced engine hashes, then inserts `(engine, node_ref)` pairs.
    /// `keys` says whether the caller proved the entries' engine hashes pairwise distinct.
    /// `made` is an empty table made ready elsewhere ([`crate::room`]): an empty side map
    /// with less room than the entries takes it instead of allocating its own.
    pub(crate) fn restore_side_entries(
        &mut self,
        rank: RankId,
        displaced: &[(u64, u32)],
        entries: &[(u64, u32)],
        keys: EntryKeys,
        made: Option<HashTable<u32>>,
    ) {
        let Some(Some(wr)) = self.ranks.get_mut(rank.0 as usize) else {
            return;
        };
        if let Some(made) = made
            && made.is_empty()
            && wr.side.is_empty()
            && wr.side.capacity() < entries.len()
            && made.capacity() >= entries.len()
        {
            wr.side = made;
        }
        for &(old, node_ref) in displaced {
            side_remove_if(&mut wr.side, old, node_ref);
        }
        let shared = &self.shared;
        side_reserve(&mut wr.side, entries.len(), shared, rank.0);
        // Keys are read through nodes; one set of guards for the whole rank saves a lock round
        // trip per read (the restore holds no shard lock here).
        let guards = shared.read_all();
        let engine_of = |r: u32| engine_in(shared, &guards, r, rank.0);
        if keys == EntryKeys::Distinct && displaced.is_empty() && wr.side.is_empty() {
            // Nothing to collide with and nothing to replace: every entry is new, so none needs
            // the key comparison, which reads the entry's node (a cache miss per probe; the bulk
            // of a graft's side-map stage). After the reserve above the rehash closure never
            // runs; it is the real one all the same.
            for &(engine, node_ref) in entries {
                wr.side.insert_unique(mix_engine(engine), node_ref, |&r| {
                    mix_engine(engine_of(r).unwrap_or(0))
                });
            }
            return;
        }
        // A node whose carrier changed engine hash during this restore (listed in `displaced`)
        // may hold a later hash than an entry names; filing it under a stale hash would break
        // the side map invariant, so those entries are checked against the carrier first.
        let changed: hashbrown::HashSet<u32> = displaced.iter().map(|&(_, r)| r).collect();
        for &(engine, node_ref) in entries {
            if changed.contains(&node_ref) && engine_of(node_ref) != Some(engine) {
                continue;
            }
            side_put(&mut wr.side, engine, node_ref, engine_of);
        }
    }

    pub(crate) fn flush_restore_delta(&mut self, d: &mut RestoreDelta) {
        for (rank, delta) in d.per_rank.iter_mut().enumerate() {
            if let Some(Some(wr)) = self.ranks.get(rank) {
                delta.flush(&wr.stats, &self.shared.total_carried);
            }
        }
        d.per_rank.clear();
    }

    /// Pre-sizes every shard for a restore of `nodes` nodes so the bulk insert does not rehash
    /// repeatedly.
    pub(crate) fn reserve_for_restore(&mut self, nodes: usize) {
        let per_shard = nodes / self.shared.shards.len() + nodes / self.shared.shards.len() / 8;
        for s in self.shared.shards.iter() {
            s.write().reserve_nodes(per_shard);
        }
    }

    pub(crate) fn find_or_create_in(
        &self,
        shard: &mut Shard,
        hash: u64,
        parent: u32,
    ) -> Option<u32> {
        let clock = self.shared.clock.load(Relaxed);
        shard.find_or_create(hash, parent, self.shared.max_nodes_per_shard, clock)
    }

    pub(crate) fn count_shard_full(&self, blocks: u64) {
        self.shared
            .counters
            .shard_full_blocks
            .fetch_add(blocks, Relaxed);
    }

    pub(crate) fn cursor_of(&self, rank: RankId) -> Option<(i64, f64)> {
        match self.ranks.get(rank.0 as usize) {
            Some(Some(wr)) => wr.stats.cursor(),
            _ => None,
        }
    }
}

/// Per-rank stat deltas of a restore, indexed by rank id, flushed once at the end.
#[derive(Default)]
pub(crate) struct RestoreDelta {
    per_rank: Vec<Delta>,
}

impl RestoreDelta {
    fn record(&mut self, rank: RankId, before: u8, after: u8) {
        let i = rank.0 as usize;
        if self.per_rank.len() <= i {
            self.per_rank.resize_with(i + 1, Delta::default);
        }
        self.per_rank[i].record(before, after);
    }
}

/// State of one prefix walk under a shard read lock.
///
/// Run compression: along a shared prefix consecutive nodes usually have the very same carrier
/// set (same ranks, same tiers). When the previous node advanced ALL its carriers and this
/// node's set is equal, every one of them advances again, so only a counter moves; the per-rank
/// update is applied once when the run ends. Set equality is decided from the node alone (its
/// [`SetKey`]), so a run of nodes shared by 64 ranks reads one node line per block, not the
/// node's 256-byte carrier list.
///
/// Lookup ([`Walk::locate`]): the slab successor of the previous block's node when it has the
/// block's hash, else the hash slots. Off the slab order each block's lookup does not depend on
/// the previous one, so with the slots requested ahead the CPU overlaps their cache misses
/// instead of paying them one after another (the index is far larger than cache).
struct Walk<'a> {
    shard: &'a Shard,
    clock: u32,
    /// Slab index of the previous block's node ([`NONE`] before the first).
    prev_idx: u32,
    /// Whether the previous block's node was found as its predecessor's slab successor.
    following: bool,
    /// Words of the node that started the current run (read once per run).
    prev_words: &'a [u32],
    prev_key: Option<SetKey>,
    prev_full: bool,
    pending: u32,
}

/// Identifies a node's carrier set without reading a carrier list: an inline carrier's word
/// itself (exact), or a list's [`set_digest`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum SetKey {
    Inline(u32),
    List(u64),
}

impl Node {
    #[inline]
    fn set_key(&self) -> Option<SetKey> {
        if self.carrier == EMPTY_CARRIER {
            None
        } else if word_tiers(self.carrier) == 0 {
            Some(SetKey::List(self.engine_or_digest))
        } else {
            Some(SetKey::Inline(self.carrier))
        }
    }
}

impl<'a> Walk<'a> {
    fn new(shard: &'a Shard, clock: u32) -> Self {
        Self {
            shard,
            clock,
            prev_idx: NONE,
            following: false,
            prev_words: &[],
            prev_key: None,
            prev_full: false,
            pending: 0,
        }
    }

    /// The node of the next block, whose chained hash is `hash`: the previous block's slab
    /// successor when that node has this hash (a node is the only live one with its hash, so
    /// the full-hash comparison is the same confirmation a slot hit gets), else the one the
    /// hash slots name.
    #[inline]
    fn locate(&mut self, hash: u64) -> Option<&'a Node> {
        let shard = self.shard;
        let guess = self.prev_idx.wrapping_add(1);
        if let Some(node) = shard.nodes.get(guess as usize)
            && node.hash == hash
            && !node.is_free()
        {
            self.prev_idx = guess;
            self.following = true;
            return Some(node);
        }
        let idx = shard.find(hash)?;
        self.prev_idx = idx;
        self.following = false;
        Some(&shard.nodes[idx as usize])
    }

    /// Advances the ranks that carry block `i`'s node; false once no rank advanced.
    #[inline]
    fn step(&mut self, i: u32, node: &'a Node, out: &mut PrefixMatch) -> bool {
        // Only write when the stamp changes so hot shared prefixes do not bounce a cache
        // line between routing threads on every request.
        if node.stamp.load(Relaxed) != self.clock {
            node.stamp.store(self.clock, Relaxed);
        }
        let key = node.set_key();
        if self.prev_full && key == self.prev_key {
            self.pending += 1;
            return true;
        }
        flush_run(out, self.prev_words, &mut self.pending);
        let words = self.shard.words(node);
        let mut advanced = 0usize;
        for &w in words {
            let rank = word_rank(w) as usize;
            let device = word_tiers(w) & TIER_DEVICE != 0;
            if i == 0 {
                if out.slot.len() <= rank {
                    out.slot.resize(rank + 1, 0);
                }
                out.ranks.push(RankMatch {
                    rank: RankId(rank as u32),
                    matched_blocks: 1,
                    device_blocks: u32::from(device),
                });
                out.slot[rank] = out.ranks.len() as u32;
                advanced += 1;
            } else if let Some(&pos) = out.slot.get(rank)
                && pos != 0
            {
                let m = &mut out.ranks[pos as usize - 1];
                if m.matched_blocks == i {
                    m.matched_blocks = i + 1;
                    advanced += 1;
                    if device && m.device_blocks == i {
                        m.device_blocks = i + 1;
                    }
                }
            }
        }
        if advanced == 0 {
            return false;
        }
        self.prev_full = advanced == words.len();
        self.prev_words = words;
        self.prev_key = key;
        true
    }

    fn finish(mut self, out: &mut PrefixMatch) {
        flush_run(out, self.prev_words, &mut self.pending);
    }
}

/// Applies `pending` extra blocks to every rank of a run (see `match_prefix`): each advances its
/// any-tier depth, and its device depth too when that was still contiguous and the rank's word
/// has the device bit (words are identical along the run, so the tiers are too).
#[inline]
fn flush_run(out: &mut PrefixMatch, words: &[u32], pending: &mut u32) {
    if *pending == 0 {
        return;
    }
    for &w in words {
        let pos = out.slot[word_rank(w) as usize];
        let m = &mut out.ranks[pos as usize - 1];
        if word_tiers(w) & TIER_DEVICE != 0 && m.device_blocks == m.matched_blocks {
            m.device_blocks += *pending;
        }
        m.matched_blocks += *pending;
    }
    *pending = 0;
}

#[inline]
fn extra_at(extra: &[Option<u64>], i: usize) -> Option<u64> {
    extra.get(i).copied().flatten()
}

impl IndexReader {
    pub fn config(&self) -> IndexConfig {
        self.shared.cfg
    }

    /// Per rank, the contiguous depth from block 0 carried in any tier and on device, for the
    /// request's chained block hashes. One shard read lock for the whole walk.
    ///
    /// Each block's node is found by `Walk::locate`: first as the slab successor of the
    /// previous block's node (chains are usually laid out in order, see `Walk`), else through
    /// the hash slots. While the walk is off the slab order it requests the slots of the block
    /// [`MATCH_SLOT_LEAD_BLOCKS`] ahead, so those lookups overlap instead of paying a cache miss
    /// each; while it follows the slab it does not, because those requests would only compete
    /// with the node lines it is streaming.
    pub fn match_prefix(&self, hashes: &[u64], out: &mut PrefixMatch) {
        out.ranks.clear();
        let Some(&first) = hashes.first() else {
            return;
        };
        let clock = self.shared.clock.load(Relaxed);
        let shard = self.shared.shards[self.shared.shard_of_root(first)].read();
        for &h in hashes.iter().take(MATCH_SLOT_LEAD_BLOCKS) {
            shard.by_hash.prefetch(h);
        }
        let mut walk = Walk::new(&shard, clock);
        for (i, &h) in hashes.iter().enumerate() {
            if !walk.following
                && let Some(&ahead) = hashes.get(i + MATCH_SLOT_LEAD_BLOCKS)
            {
                shard.by_hash.prefetch(ahead);
            }
            let Some(node) = walk.locate(h) else {
                break;
            };
            if !walk.step(i as u32, node, out) {
                break;
            }
        }
        walk.finish(out);
        drop(shard);
        out.reset_slots();
    }

    /// [`match_prefix`](Self::match_prefix) fused with [`hash_token_blocks`]: hashes `tokens`
    /// (full blocks of the index's block size, namespace `namespace`) as the walk goes,
    /// [`MATCH_SLOT_LEAD_BLOCKS`] ahead of the block being matched, and STOPS hashing once no
    /// rank can match further. On return `hashes` holds the hashes computed: the matched prefix
    /// plus at most `MATCH_SLOT_LEAD_BLOCKS + 1`, not necessarily every block of the prompt.
    ///
    /// [`hash_token_blocks`]: crate::hash::hash_token_blocks
    pub fn match_tokens(
        &self,
        tokens: &[u32],
        namespace: u64,
        hashes: &mut Vec<u64>,
        out: &mut PrefixMatch,
    ) {
        out.ranks.clear();
        hashes.clear();
        let bs = self.shared.cfg.block_size as usize;
        if bs == 0 {
            return;
        }
        let mut blocks = tokens.chunks_exact(bs);
        let mut parent = namespace;
        for block in blocks.by_ref().take(MATCH_SLOT_LEAD_BLOCKS) {
            parent = chain_hash(parent, block, None);
            hashes.push(parent);
        }
        let Some(&first) = hashes.first() else {
            return;
        };
        let clock = self.shared.clock.load(Relaxed);
        let shard = self.shared.shards[self.shared.shard_of_root(first)].read();
        for &h in hashes.iter() {
            shard.by_hash.prefetch(h);
        }
        let mut walk = Walk::new(&shard, clock);
        let mut i = 0;
        while let Some(&h) = hashes.get(i) {
            // Hashing the block a lead ahead does not depend on this block's lookup, so the CPU
            // overlaps the two.
            if let Some(block) = blocks.next() {
                parent = chain_hash(parent, block, None);
                hashes.push(parent);
                if !walk.following {
                    shard.by_hash.prefetch(parent);
                }
            }
            let Some(node) = walk.locate(h) else {
                break;
            };
            if !walk.step(i as u32, node, out) {
                break;
            }
            i += 1;
        }
        walk.finish(out);
        drop(shard);
        out.reset_slots();
    }

    pub fn ranks(&self) -> Vec<(RankId, RankRef)> {
        self.shared
            .ranks
            .read()
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (RankId(i as u32), r.rank_ref.clone())))
            .collect()
    }

    pub fn rank_stats(&self, rank: RankId) -> Option<RankStats> {
        let ranks = self.shared.ranks.read();
        let r = ranks.get(rank.0 as usize)?.as_ref()?;
        Some(RankStats {
            carried_blocks: r.carried.load(Relaxed),
            tier_blocks: std::array::from_fn(|i| r.tiers[i].load(Relaxed)),
            cursor: r.cursor().map(|(seq, ts)| RankCursor {
                rank: rank.0,
                seq,
                ts,
            }),
        })
    }

    pub fn total_carried(&self) -> u64 {
        self.shared.total_carried.load(Relaxed)
    }

    /// Live nodes across shards (for memory accounting and tests).
    pub fn node_count(&self) -> u64 {
        self.shared
            .shards
            .iter()
            .map(|s| {
                let s = s.read();
                (s.nodes.len() - s.free.len()) as u64
            })
            .sum()
    }

    /// Heap bytes held by the shards (capacity, not length), by structure. Side maps are
    /// writer-private: see [`IndexWriter::side_map_bytes`].
    pub fn memory(&self) -> ShardMemory {
        let mut m = ShardMemory::default();
        for s in self.shared.shards.iter() {
            let s = s.read();
            m.node_slab_bytes += s.nodes.capacity_bytes() as u64;
            m.hash_slot_bytes += s.by_hash.allocated_bytes() as u64;
            m.carrier_list_bytes += (s.lists.capacity() * std::mem::size_of::<CarrierList>()
                + s.lists
                    .iter()
                    .map(|l| l.words.capacity() * 4 + l.engines.capacity() * 8)
                    .sum::<usize>()) as u64;
            m.free_list_bytes += ((s.free.capacity() + s.free_lists.capacity()) * 4) as u64;
        }
        m
    }

    pub fn counters(&self) -> IndexCounters {
        let c = &self.shared.counters;
        IndexCounters {
            stored_blocks: c.stored_blocks.load(Relaxed),
            removed_blocks: c.removed_blocks.load(Relaxed),
            cleared_ranks: c.cleared_ranks.load(Relaxed),
            stored_unknown_parent_blocks: c.stored_unknown_parent_blocks.load(Relaxed),
            removed_unknown_blocks: c.removed_unknown_blocks.load(Relaxed),
            evicted_carriers: c.evicted_carriers.load(Relaxed),
            eviction_runs: c.eviction_runs.load(Relaxed),
            token_mismatch_events: c.token_mismatch_events.load(Relaxed),
            block_size_mismatch_events: c.block_size_mismatch_events.load(Relaxed),
            unknown_medium_stored_blocks: c.unknown_medium_stored_blocks.load(Relaxed),
            shard_full_blocks: c.shard_full_blocks.load(Relaxed),
            unknown_rank_events: c.unknown_rank_events.load(Relaxed),
        }
    }
}

// The memory budget per carried pair assumes 32-byte nodes; fail the build if a field creeps in.
const _: () = assert!(std::mem::size_of::<Node>() == 32);

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard that grows into a chunk made ready elsewhere ([`crate::room::GraftRoom`]) holds
    /// its nodes there, counts the chunk as memory while it waits, and still finds every node.
    #[test]
    fn a_slab_grows_into_a_given_chunk_and_counts_it_while_spare() {
        let mut shard = Shard::new();
        assert!(
            shard.nodes.needs_chunk_within(1),
            "an empty slab has no room"
        );
        shard.nodes.give_spare(Slab::touched_chunk());
        assert!(
            !shard.nodes.needs_chunk_within(2 * SLAB_CHUNK_NODES),
            "a spare covers the next growth"
        );
        let chunk_bytes = SLAB_CHUNK_NODES * std::mem::size_of::<Node>();
        assert!(
            shard.nodes.capacity_bytes() >= chunk_bytes,
            "the spare is counted"
        );
        let given = shard.nodes.spare[0].as_ptr();
        let idx = shard
            .find_or_create(0xC000_0000_0000_0003, NONE, u32::MAX, 0)
            .expect("room");
        assert_eq!(
            shard.nodes.chunks[0].as_ptr(),
            given,
            "grew into the given chunk"
        );
        assert!(shard.nodes.spare.is_empty());
        assert_eq!(shard.find(0xC000_0000_0000_0003), Some(idx));
        assert!(shard.nodes.needs_chunk_within(SLAB_CHUNK_NODES));
        assert!(!shard.nodes.needs_chunk_within(SLAB_CHUNK_NODES - 1));
        for h in 1..SLAB_CHUNK_NODES as u64 {
            shard.find_or_create(h, NONE, u32::MAX, 0).expect("room");
        }
        assert!(shard.nodes.needs_chunk_within(1), "the given chunk is full");
        let next = shard.find_or_create(0xD000_0000_0000_0004, NONE, u32::MAX, 0);
        assert_eq!(
            next,
            Some(SLAB_CHUNK_NODES as u32),
            "and the slab grows on its own"
        );
        assert_eq!(shard.nodes.chunks.len(), 2);
    }

    /// Only an empty chunk of the slab's own size is kept as a spare: the slab's indexing
    /// assumes every chunk holds exactly `SLAB_CHUNK_NODES` slots.
    #[test]
    fn a_chunk_of_another_size_or_not_empty_is_not_kept_as_a_spare() {
        let mut slab = Slab::default();
        slab.give_spare(Vec::with_capacity(SLAB_CHUNK_NODES / 2));
        assert!(slab.needs_chunk_within(1));
        let mut used = Slab::touched_chunk();
        used.push(Node {
            hash: 7,
            engine_or_digest: 0,
            carrier: EMPTY_CARRIER,
            parent: NONE,
            children: 0,
            stamp: AtomicU32::new(0),
        });
        slab.give_spare(used);
        assert!(slab.needs_chunk_within(1));
        assert!(slab.spare.is_empty());
    }

    /// A list made ready elsewhere ([`crate::room`]) holds a node's carriers exactly as a list
    /// the shard allocates; it is used only when it has room for all of them, and it takes a
    /// freed slot of the pool when there is one.
    #[test]
    fn a_list_made_elsewhere_holds_what_an_own_list_holds_and_only_when_it_has_room() {
        let mut shard = Shard::new();
        let nodes: Vec<u32> = (1..=4u64)
            .map(|h| shard.find_or_create(h, NONE, u32::MAX, 0).expect("room"))
            .collect();
        let words = [word(1, 1), word(2, 1), word(3, 2)];
        let engines = [10u64, 20, 30];
        shard.set_carriers_of_bare_node(nodes[0], &words, &engines, None);
        shard.set_carriers_of_bare_node(nodes[1], &words, &engines, Some(CarrierList::touched(3)));
        assert_eq!(node_state(&shard, nodes[1]), node_state(&shard, nodes[0]));
        let made_slot = shard.nodes[nodes[1] as usize].list().expect("a list");
        assert!(
            shard.lists[made_slot].words.capacity() == 3,
            "the made list was used"
        );
        shard.set_carriers_of_bare_node(nodes[2], &words, &engines, Some(CarrierList::touched(2)));
        assert_eq!(
            node_state(&shard, nodes[2]),
            node_state(&shard, nodes[0]),
            "too small: own"
        );
        // Free node 0's list (down to one carrier), then a made list takes its slot.
        shard.clear_carrier(nodes[0], 1, u8::MAX, None);
        shard.clear_carrier(nodes[0], 2, u8::MAX, None);
        let freed = *shard.free_lists.last().expect("a freed list");
        shard.set_carriers_of_bare_node(nodes[3], &words, &engines, Some(CarrierList::touched(8)));
        assert_eq!(shard.nodes[nodes[3] as usize].list(), Some(freed as usize));
        assert_eq!(node_state(&shard, nodes[3]), node_state(&shard, nodes[1]));
    }

    fn node_state(shard: &Shard, idx: u32) -> (Vec<u32>, Vec<u64>, u64) {
        let node = &shard.nodes[idx as usize];
        let (words, engines) = shard.carriers(node);
        (words.to_vec(), engines.to_vec(), node.engine_or_digest)
    }

    /// A node given its carriers at once (the graft's path for a node no live rank carries)
    /// holds exactly what adding them one by one gives: the same words and engine hashes in the
    /// same order and the same digest, which the routing walk compares to tell carrier sets
    /// apart. Later changes to either node keep them equal.
    #[test]
    fn carriers_set_at_once_equal_carriers_added_one_by_one() {
        let mut shard = Shard::new();
        let one_by_one = shard
            .find_or_create(0xA000_0000_0000_0001, NONE, u32::MAX, 0)
            .expect("room");
        let at_once = shard
            .find_or_create(0xB000_0000_0000_0002, NONE, u32::MAX, 0)
            .expect("room");
        let carriers = [(3u32, 1u8, 30u64), (0, 2, 10), (7, 3, 70), (1, 1, 11)];
        for &(rank, tiers, engine) in &carriers {
            shard.add_carrier(one_by_one, rank, tiers, engine);
        }
        let words: Vec<u32> = carriers.iter().map(|&(r, t, _)| word(r, t)).collect();
        let engines: Vec<u64> = carriers.iter().map(|c| c.2).collect();
        assert!(shard.carries_nothing(at_once));
        shard.set_carriers_of_bare_node(at_once, &words, &engines, None);
        assert!(!shard.carries_nothing(at_once));
        assert_eq!(node_state(&shard, at_once), node_state(&shard, one_by_one));
        assert_eq!(
            node_state(&shard, at_once).2,
            set_digest(&words),
            "the digest is the carrier set's"
        );
        for idx in [one_by_one, at_once] {
            shard.add_carrier(idx, 7, 4, 71);
            shard.clear_carrier(idx, 0, TIER_ALL, None);
            shard.add_carrier(idx, 9, 1, 90);
        }
        let (words_after, _, digest_after) = node_state(&shard, at_once);
        assert_eq!(node_state(&shard, at_once), node_state(&shard, one_by_one));
        assert_eq!(digest_after, set_digest(&words_after));
        assert_eq!(words_after.len(), 4, "7 changed, 0 went, 9 came");
    }
}
