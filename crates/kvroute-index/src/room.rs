//! Index storage made ready for a graft on another thread while the writer grafts.
//!
//! A booting replica grafts its whole index into memory the process has never touched, and the
//! first write to each page of it is a page fault in which the kernel zeroes the page (2 MiB at
//! a time on transparent huge pages). On this project's machines, in the host's slow phases,
//! those faults were about 40 % of the pump's time during the graft of `time_to_warm`
//! (docs/BENCHMARKS.md): where the shards' node slabs grew, one chunk of [`SLAB_CHUNK_NODES`]
//! nodes at a time, where a node several ranks share got its carrier list, and where each rank's
//! side map was built, all allocated and first written on the pump while the second core was
//! partly idle.
//!
//! A [`GraftRoom`] moves that work off the writer. The plan, once laid out for an index
//! ([`crate::GraftPlan::lay_out_for`]), knows how many nodes each shard receives, which nodes
//! have several carriers and how many carriers each rank has, so how much storage the graft can
//! need at most. [`GraftRoom::prepare`] runs on a helper thread and makes it, each piece written
//! once so its pages are resident, in the order the writer will want it: the slab chunks and the
//! carrier lists of shared nodes interleaved by their place in the snapshot (the node stage), then
//! each rank's side table in filing order (the side-map stage). The writer takes a ready chunk
//! when a shard's slab is about to grow, a ready list when it gives a node its carriers at once,
//! and a ready table when it files a rank. It never waits for any: when none is ready it
//! allocates its own, as it always did; a chunk it made itself counts against the same bound, so
//! the two together never make more chunks than the plan can fill, and the helper skips the lists
//! of nodes and the tables of ranks the writer has already passed.
//!
//! Nothing the writer reads depends on the helper: a chunk or a table is empty storage, and which
//! one a slab or a side map grows into changes no node, no entry and no answer. The helper stops
//! when everything is made or when nobody else holds the room any more (the plan or its job was
//! dropped, which a finished or abandoned graft does), and whatever is still waiting is freed
//! with the room.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

use hashbrown::HashTable;
use parking_lot::Mutex;

use crate::index::{CarrierList, Node, SLAB_CHUNK_NODES, Slab};

/// Storage for one graft, made on a helper thread (see the module doc).
pub struct GraftRoom {
    chunks: Mutex<Vec<Vec<Node>>>,
    /// The most chunks the plan's nodes can fill: the bound on what the helper and the writer
    /// make together.
    chunks_max: usize,
    /// Chunks made so far by the helper, plus the ones the writer found none ready for.
    chunks_claimed: AtomicUsize,
    /// Snapshot nodes in the plan: where chunk `k` falls in the node order is
    /// `k * nodes / chunks_max`, which interleaves chunks with lists.
    nodes: usize,
    /// The plan's nodes with two or more carriers, in snapshot order, with their carrier counts.
    shared_nodes: Vec<(u32, u32)>,
    /// Lists made and not yet taken, in snapshot order of their nodes.
    lists: Mutex<VecDeque<(u32, CarrierList)>>,
    /// The next snapshot node the writer will visit (`nodes` once the node stage is over).
    writer_node: AtomicUsize,
    /// Per snapshot rank, the entries its side map can receive (its carriers in the plan).
    side_entries: Vec<usize>,
    /// Per snapshot rank, its side table once made and until taken.
    sides: Mutex<Vec<Option<HashTable<u32>>>>,
    /// The first snapshot rank whose side map the writer has not filed yet.
    sides_from: AtomicUsize,
}

/// What [`GraftRoom::prepare`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GraftRoomReport {
    pub chunks_made: usize,
    pub lists_made: usize,
    pub side_tables_made: usize,
    /// Bytes of the chunks, lists and tables made.
    pub bytes_made: usize,
    /// The graft was over (or dropped) before the helper had made everything it could.
    pub stopped_early: bool,
    pub seconds: f64,
}

impl GraftRoom {
    /// `chunks_max` slab chunks for `nodes` snapshot nodes, a list for each of `shared_nodes`
    /// (node, carriers), and a side table for each rank with its entry count.
    pub(crate) fn new(
        chunks_max: usize,
        nodes: usize,
        shared_nodes: Vec<(u32, u32)>,
        side_entries: Vec<usize>,
    ) -> GraftRoom {
        GraftRoom {
            chunks: Mutex::new(Vec::new()),
            chunks_max,
            chunks_claimed: AtomicUsize::new(0),
            nodes,
            shared_nodes,
            lists: Mutex::new(VecDeque::new()),
            writer_node: AtomicUsize::new(0),
            sides: Mutex::new(side_entries.iter().map(|_| None).collect()),
            side_entries,
            sides_from: AtomicUsize::new(0),
        }
    }

    /// The most chunks this room makes, the writer's own included.
    pub fn chunks_max(&self) -> usize {
        self.chunks_max
    }

    /// Bytes of one slab chunk.
    pub fn chunk_bytes() -> usize {
        SLAB_CHUNK_NODES * std::mem::size_of::<Node>()
    }

    /// Makes the chunks and lists, then the side tables, until done or until nobody but this
    /// caller holds the room. Meant for a helper thread; it never waits on the writer (each lock
    /// it takes is held for one push or one check).
    pub fn prepare(self: &Arc<Self>) -> GraftRoomReport {
        let started = Instant::now();
        let mut report = GraftRoomReport::default();
        let abandoned = |room: &Arc<Self>| Arc::strong_count(room) <= 1;
        let mut next_list = 0usize;
        let mut chunks_left = true;
        while !abandoned(self) {
            let writer_at = self.writer_node.load(Relaxed);
            if writer_at >= self.nodes {
                break;
            }
            while self
                .shared_nodes
                .get(next_list)
                .is_some_and(|&(node, _)| (node as usize) < writer_at)
            {
                next_list += 1;
            }
            let claimed = chunks_left.then(|| self.chunks_claimed.load(Relaxed));
            let list_at = self
                .shared_nodes
                .get(next_list)
                .map(|&(node, _)| node as usize);
            match self.next_piece(claimed, list_at) {
                None => break,
                Some(Piece::Chunk) => {
                    if !self.claim_chunk() {
                        chunks_left = false;
                        continue;
                    }
                    let chunk = Slab::touched_chunk();
                    self.chunks.lock().push(chunk);
                    report.chunks_made += 1;
                    report.bytes_made += Self::chunk_bytes();
                }
                Some(Piece::List) => {
                    let (node, carriers) = self.shared_nodes[next_list];
                    next_list += 1;
                    let list = CarrierList::touched(carriers as usize);
                    report.lists_made += 1;
                    report.bytes_made += list.heap_bytes();
                    self.lists.lock().push_back((node, list));
                }
            }
        }
        for (rank, &entries) in self.side_entries.iter().enumerate() {
            if abandoned(self) {
                break;
            }
            if rank < self.sides_from.load(Relaxed) || entries == 0 {
                continue;
            }
            let table = touched_side_table(entries);
            report.bytes_made += table.allocation_size();
            report.side_tables_made += 1;
            // Checked again under the lock the writer takes to pass ranks: a table for a rank
            // it passed meanwhile is dropped here, not left waiting until the room goes.
            let mut sides = self.sides.lock();
            if rank >= self.sides_from.load(Relaxed) {
                sides[rank] = Some(table);
            }
        }
        report.stopped_early =
            abandoned(self) && self.sides_from.load(Relaxed) < self.side_entries.len();
        report.seconds = started.elapsed().as_secs_f64();
        report
    }

    /// Which piece of the node stage to make next, given the chunks claimed so far (`None` once
    /// the writer claimed the last) and the node of the next list still wanted: the one that
    /// falls earlier in the snapshot, so chunks and lists keep ahead of the writer alike. Chunk
    /// `k` falls at node `k * nodes / chunks_max`: the slabs fill in step with the snapshot.
    fn next_piece(&self, chunks_claimed: Option<usize>, list_at: Option<usize>) -> Option<Piece> {
        let chunk_at = chunks_claimed
            .filter(|&claimed| claimed < self.chunks_max)
            .map(|claimed| claimed.saturating_mul(self.nodes) / self.chunks_max.max(1));
        match (chunk_at, list_at) {
            (None, None) => None,
            (Some(chunk), Some(list)) if list < chunk => Some(Piece::List),
            (Some(_), _) => Some(Piece::Chunk),
            (None, Some(_)) => Some(Piece::List),
        }
    }

    /// A ready chunk for the writer; `None` when none is ready, in which case the writer makes
    /// its own, counted here against the bound.
    pub(crate) fn take_chunk(&self) -> Option<Vec<Node>> {
        let chunk = self.chunks.lock().pop();
        if chunk.is_none() {
            self.claim_chunk();
        }
        chunk
    }

    /// The list made for snapshot node `node`, if it is ready; lists of earlier nodes still
    /// waiting are freed (the writer visits nodes in order and did not want them: their nodes
    /// got fewer than two carriers of the ranks it grafts).
    pub(crate) fn take_list(&self, node: usize) -> Option<CarrierList> {
        self.writer_node.fetch_max(node, Relaxed);
        let mut lists = self.lists.lock();
        while let Some((at, _)) = lists.front() {
            match (*at as usize).cmp(&node) {
                std::cmp::Ordering::Less => {
                    lists.pop_front();
                }
                std::cmp::Ordering::Equal => return lists.pop_front().map(|(_, list)| list),
                std::cmp::Ordering::Greater => break,
            }
        }
        None
    }

    /// The writer has visited every node before `node` (`nodes` when the node stage is over):
    /// the helper makes nothing for them any more.
    pub(crate) fn writer_at_node(&self, node: usize) {
        self.writer_node.fetch_max(node, Relaxed);
        if node >= self.nodes {
            // Nothing more of the node stage will be taken: free it now rather than with the room.
            self.chunks.lock().clear();
            self.lists.lock().clear();
        }
    }

    /// Snapshot rank `rank`'s side table, if it is ready; from now on the helper makes none for
    /// this rank or an earlier one (the writer files ranks in order).
    pub(crate) fn take_side_table(&self, rank: usize) -> Option<HashTable<u32>> {
        let mut sides = self.sides.lock();
        let passed_from = self.sides_from.fetch_max(rank + 1, Relaxed);
        // Tables of ranks the writer went past since its last call (it skips ranks with nothing
        // to file) are freed; earlier ones were freed by earlier calls.
        for passed in sides.iter_mut().take(rank).skip(passed_from) {
            *passed = None;
        }
        sides.get_mut(rank).and_then(Option::take)
    }

    /// Chunks ready and not yet taken.
    pub fn ready_chunks(&self) -> usize {
        self.chunks.lock().len()
    }

    /// Lists ready and not yet taken.
    pub fn ready_lists(&self) -> usize {
        self.lists.lock().len()
    }

    /// Side tables ready and not yet taken.
    pub fn ready_side_tables(&self) -> usize {
        self.sides.lock().iter().flatten().count()
    }

    /// Counts one more chunk against the bound; false when the bound was already reached.
    fn claim_chunk(&self) -> bool {
        self.chunks_claimed
            .fetch_update(Relaxed, Relaxed, |c| (c < self.chunks_max).then_some(c + 1))
            .is_ok()
    }
}

/// A piece of the node stage's storage (see [`GraftRoom::next_piece`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Piece {
    Chunk,
    List,
}

/// An empty side table with room for `entries`, whose memory has been written once: filled with
/// as many placeholder entries and cleared, which leaves the allocation (and its resident pages)
/// and only marks every slot empty again.
fn touched_side_table(entries: usize) -> HashTable<u32> {
    let mut table: HashTable<u32> = HashTable::with_capacity(entries);
    // A distinct, well-spread hash per placeholder, so the placeholders cover the table; the
    // placeholder's value is its own index, so the hash can be recomputed from it (the table
    // never grows here: there are exactly as many as it has room for).
    let placeholder_hash = |i: u32| u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let room = u32::try_from(table.capacity()).unwrap_or(u32::MAX);
    for i in 0..room {
        table.insert_unique(placeholder_hash(i), i, |&v| placeholder_hash(v));
    }
    table.clear();
    table
}

impl std::fmt::Debug for GraftRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraftRoom")
            .field("chunks_max", &self.chunks_max)
            .field("chunks_claimed", &self.chunks_claimed.load(Relaxed))
            .field("side_ranks", &self.side_entries.len())
            .field("sides_from", &self.sides_from.load(Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helper_makes_at_most_the_bound_and_stops_there() {
        let room = Arc::new(GraftRoom::new(
            3,
            100,
            vec![(5, 2), (50, 64)],
            vec![10, 0, 100],
        ));
        let holder = room.clone();
        let report = room.prepare();
        assert_eq!(report.chunks_made, 3, "{report:?}");
        assert_eq!(report.lists_made, 2, "{report:?}");
        assert_eq!(
            report.side_tables_made, 2,
            "a rank with no entries gets none: {report:?}"
        );
        assert!(!report.stopped_early, "{report:?}");
        assert!(report.bytes_made >= 3 * GraftRoom::chunk_bytes());
        assert_eq!(room.ready_chunks(), 3);
        assert_eq!(room.ready_side_tables(), 2);
        assert_eq!(room.prepare().chunks_made, 0, "no chunk past the bound");
        drop(holder);
    }

    #[test]
    fn chunks_the_writer_found_none_ready_for_count_against_the_bound() {
        let room = Arc::new(GraftRoom::new(3, 100, Vec::new(), Vec::new()));
        let holder = room.clone();
        assert!(room.take_chunk().is_none());
        assert!(room.take_chunk().is_none());
        assert_eq!(
            room.prepare().chunks_made,
            1,
            "two of three were the writer's"
        );
        let chunk = room.take_chunk().expect("the one made is ready");
        assert!(chunk.is_empty() && chunk.capacity() == SLAB_CHUNK_NODES);
        assert!(room.take_chunk().is_none());
        drop(holder);
    }

    #[test]
    fn a_side_table_has_room_for_its_rank_and_holds_nothing() {
        let room = Arc::new(GraftRoom::new(0, 0, Vec::new(), vec![1_000, 5]));
        let holder = room.clone();
        room.prepare();
        let table = room.take_side_table(0).expect("made");
        assert!(table.is_empty());
        assert!(table.capacity() >= 1_000, "capacity {}", table.capacity());
        assert!(room.take_side_table(0).is_none(), "taken once");
        drop(holder);
    }

    #[test]
    fn the_helper_skips_the_tables_of_ranks_the_writer_has_filed() {
        let room = Arc::new(GraftRoom::new(0, 0, Vec::new(), vec![10, 10, 10]));
        let holder = room.clone();
        assert!(
            room.take_side_table(1).is_none(),
            "the writer filed ranks 0 and 1 itself"
        );
        let report = room.prepare();
        assert_eq!(report.side_tables_made, 1, "{report:?}");
        assert!(room.take_side_table(2).is_some());
        drop(holder);
    }

    #[test]
    fn tables_of_ranks_the_writer_went_past_are_freed() {
        let room = Arc::new(GraftRoom::new(0, 0, Vec::new(), vec![10, 10, 10]));
        let holder = room.clone();
        room.prepare();
        assert_eq!(room.ready_side_tables(), 3);
        assert!(room.take_side_table(2).is_some());
        assert_eq!(room.ready_side_tables(), 0, "ranks 0 and 1 were passed");
        drop(holder);
    }

    #[test]
    fn the_helper_stops_once_nobody_else_holds_the_room() {
        let room = Arc::new(GraftRoom::new(1_000, 100_000, vec![(1, 2)], vec![100_000]));
        // The helper's own handle is the only one: the plan or job it was for is gone.
        let report = room.prepare();
        assert_eq!(report.chunks_made, 0, "{report:?}");
        assert_eq!(report.lists_made, 0, "{report:?}");
        assert_eq!(report.side_tables_made, 0, "{report:?}");
        assert!(report.stopped_early, "{report:?}");
    }

    #[test]
    fn lists_come_in_node_order_and_those_of_passed_nodes_are_freed() {
        let room = Arc::new(GraftRoom::new(
            0,
            100,
            vec![(3, 2), (7, 5), (9, 64)],
            Vec::new(),
        ));
        let holder = room.clone();
        room.prepare();
        assert_eq!(room.ready_lists(), 3);
        assert!(
            room.take_list(5).is_none(),
            "no node 5 list; node 3's is dropped"
        );
        let list = room.take_list(7).expect("node 7's");
        assert!(list.heap_bytes() >= 5 * 12, "room for 5 carriers");
        assert_eq!(room.ready_lists(), 1);
        room.writer_at_node(100);
        assert_eq!(room.ready_lists(), 0, "the node stage is over");
        drop(holder);
    }

    #[test]
    fn the_helper_makes_nothing_for_nodes_the_writer_has_passed() {
        let room = Arc::new(GraftRoom::new(8, 1_000, vec![(10, 2), (900, 2)], vec![4]));
        let holder = room.clone();
        room.writer_at_node(500);
        let report = room.prepare();
        assert_eq!(report.lists_made, 1, "only node 900's: {report:?}");
        assert!(room.take_list(900).is_some());
        room.writer_at_node(1_000);
        assert_eq!(
            room.prepare().chunks_made,
            0,
            "no chunk once the node stage is over"
        );
        drop(holder);
    }

    #[test]
    fn chunks_and_lists_are_made_in_snapshot_order() {
        // Two chunks, falling at nodes 0 and 50; lists at nodes 10, 50 and 60.
        let room = GraftRoom::new(2, 100, Vec::new(), Vec::new());
        let mut order = Vec::new();
        let (mut claimed, mut lists) = (0, vec![10, 50, 60].into_iter().peekable());
        while let Some(piece) = room.next_piece(Some(claimed), lists.peek().copied()) {
            order.push(match piece {
                Piece::Chunk => {
                    claimed += 1;
                    format!("chunk {}", claimed - 1)
                }
                Piece::List => format!("list {}", lists.next().expect("a list is next")),
            });
        }
        assert_eq!(
            order,
            ["chunk 0", "list 10", "chunk 1", "list 50", "list 60"]
        );
        assert_eq!(
            room.next_piece(None, Some(70)),
            Some(Piece::List),
            "no chunks left"
        );
        assert_eq!(room.next_piece(Some(2), None), None, "both done");
    }

    #[test]
    fn the_helper_makes_every_piece_of_the_plan() {
        let room = Arc::new(GraftRoom::new(2, 100, vec![(10, 2), (60, 3)], vec![7]));
        let holder = room.clone();
        let report = room.prepare();
        assert_eq!(
            (
                report.chunks_made,
                report.lists_made,
                report.side_tables_made
            ),
            (2, 2, 1),
            "{report:?}"
        );
        drop(holder);
    }
}
