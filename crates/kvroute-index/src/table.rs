//! A shard's content-hash -> slab-index table: open addressing, linear probing, 8-byte slots.
//!
//! Why not `hashbrown`: the routing path may look up hundreds of chained hashes per request in a
//! table far larger than cache (every block the walk cannot reach as its predecessor's slab
//! successor, see `index`), and the hashes are all known up front. Here the slot of a hash is a
//! pure function of the hash (its top bits), so `match_prefix` can PREFETCH the slots of the
//! next blocks while it processes the current ones; hashbrown's layout is private, so it cannot.
//! Content hashes are uniform already, so no hasher runs at all.
//!
//! A slot packs the hash's TOP 32 bits (the tag) with the node's slab index. A tag hit is
//! confirmed against the node's full hash. Because the home slot is a monotone function of the
//! tag (`tag * homes >> 32`, so any table size works, not just powers of two), the table keeps
//! every run of occupied slots SORTED by tag. That buys three things:
//! * a miss stops at the first larger tag instead of at the end of the run, so the table can
//!   be kept 64-80 % full at ALL times (memory is the index's tightest budget) without long miss
//!   probes;
//! * growth and deletion compute every entry's home from its slot alone, never touching nodes;
//! * growth is a single linear merge pass, so the table can grow in small steps (x1.25).
//!
//! Runs never wrap around: spare tail slots (at least `TAIL_SLOTS_MIN`) follow the last home, the
//! last slot is always empty (it ends every probe), and an insert that would fill it doubles the
//! tail. The tail, not the home count, grows there: hashes crafted to share one tag pile onto one
//! home however many homes there are, so only a longer tail is sure to make room.

const EMPTY: u64 = u64::MAX;
const TAG_MASK: u64 = 0xFFFF_FFFF_0000_0000;
/// Growth threshold: at most 4/5 of the homes in use. Memory alone would say 9/10 (sorted runs
/// keep misses short even then), but side-by-side runs of the cold routing bench measured p50
/// clearly slower at 0.9 than at 0.75: entries sit further from their prefetched home, often in
/// the next cache line. 0.8 is the lowest cap that keeps the index within its 40 B per carried
/// pair budget (0.75 with the same growth step measured 40.1 B; see docs/BENCHMARKS.md).
const LOAD_NUM_MAX: usize = 4;
const LOAD_DEN_MAX: usize = 5;
/// Each growth step multiplies the home count by 5/4, which keeps the load between 0.64 and 0.8
/// (doubling would let it fall to 0.4 right after a step).
const GROWTH_NUM: usize = 5;
const GROWTH_DEN: usize = 4;
const HOMES_MIN: usize = 16;
/// Spare slots past the last home, so the runs of the highest homes never need to wrap.
const TAIL_SLOTS_MIN: usize = 64;

#[inline]
fn pack(hash: u64, idx: u32) -> u64 {
    (hash & TAG_MASK) | u64::from(idx)
}

#[inline]
fn idx_of(slot: u64) -> u32 {
    slot as u32
}

/// Hints the CPU to bring `*p`'s cache line in; never faults, never changes program state.
#[inline]
pub(crate) fn prefetch_ptr<T>(p: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is only a hint and `p` is a valid reference.
    unsafe {
        core::arch::x86_64::_mm_prefetch(
            (p as *const T).cast::<i8>(),
            core::arch::x86_64::_MM_HINT_T0,
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[derive(Default, Clone)]
pub(crate) struct HashSlots {
    /// `homes + tail` slots (or none before the first insert).
    slots: Vec<u64>,
    homes: usize,
    tail: usize,
    len: usize,
}

impl HashSlots {
    /// Home slot of a hash or of a packed slot (only the top 32 bits are read).
    #[inline]
    fn home(&self, hash_or_slot: u64) -> usize {
        (((hash_or_slot >> 32) * self.homes as u64) >> 32) as usize
    }

    pub(crate) fn allocated_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<u64>()
    }

    /// An empty table with room for `entries` entries, laid out as `reserve` on an empty table
    /// would lay it out; no entries, no allocation.
    pub(crate) fn with_room(entries: usize) -> HashSlots {
        let mut table = HashSlots::default();
        if entries > 0 {
            table.reserve(entries);
        }
        table
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Hints the CPU to load the slots `hash` probes first: the home slot and the 7 after it,
    /// which straddle a second cache line unless the home starts its line. At this load an entry
    /// sits a slot or two past its home on average, so without the second hint about one lookup
    /// in six takes an unhidden miss. (Measured gain: small, within this host's noise.)
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        let home = self.home(hash);
        if let Some(slot) = self.slots.get(home) {
            prefetch_ptr(slot);
        }
        if let Some(slot) = self.slots.get(home + 7) {
            prefetch_ptr(slot);
        }
    }

    /// Position of `hash`'s slot; `hash_at(idx)` yields a stored node's full hash.
    #[inline]
    fn position(&self, hash: u64, hash_at: impl Fn(u32) -> u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        // Slot values sort like their tags, so the slots with this tag are exactly those in
        // `lo..=hi`; smaller ones are skipped with one comparison each (EMPTY is above any hi
        // except the all-ones tag's, hence its own check).
        let lo = hash & TAG_MASK;
        let hi = lo | !TAG_MASK;
        let mut pos = self.home(hash);
        loop {
            let s = *self.slots.get(pos)?;
            if s >= lo {
                break;
            }
            pos += 1;
        }
        loop {
            let s = *self.slots.get(pos)?;
            if s > hi || s == EMPTY {
                return None;
            }
            if hash_at(idx_of(s)) == hash {
                return Some(pos);
            }
            pos += 1;
        }
    }

    /// The slab index stored for `hash`; `hash_at(idx)` yields a stored node's full hash.
    #[inline]
    pub(crate) fn find(&self, hash: u64, hash_at: impl Fn(u32) -> u64) -> Option<u32> {
        self.position(hash, hash_at)
            .map(|pos| idx_of(self.slots[pos]))
    }

    /// Inserts `hash -> idx`; the caller guarantees `hash` is absent.
    pub(crate) fn insert_unique(&mut self, hash: u64, idx: u32) {
        self.reserve(1);
        let slot = pack(hash, idx);
        while !self.try_place(slot) {
            self.rebuild(self.homes, self.tail.max(TAIL_SLOTS_MIN) * 2);
        }
        self.len += 1;
    }

    /// Places `slot` in tag order within its run; false (table unchanged) when the run would
    /// reach the last slot, which must stay empty.
    fn try_place(&mut self, slot: u64) -> bool {
        let key = slot & TAG_MASK;
        let n = self.slots.len();
        let mut pos = self.home(slot);
        while pos < n && self.slots[pos] != EMPTY && self.slots[pos] & TAG_MASK <= key {
            pos += 1;
        }
        let mut end = pos;
        while end < n && self.slots[end] != EMPTY {
            end += 1;
        }
        if end + 1 >= n {
            return false;
        }
        self.slots.copy_within(pos..end, pos + 1);
        self.slots[pos] = slot;
        true
    }

    /// Removes `hash` if present.
    pub(crate) fn remove(&mut self, hash: u64, hash_at: impl Fn(u32) -> u64) {
        let Some(mut hole) = self.position(hash, hash_at) else {
            return;
        };
        // Backward shift: a later member of the run moves into the hole unless that would put it
        // before its home. Order is preserved, and no tombstones degrade later probes.
        while let Some(&s) = self.slots.get(hole + 1) {
            if s == EMPTY || self.home(s) > hole {
                break;
            }
            self.slots[hole] = s;
            hole += 1;
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
    }

    fn grown_homes(&self, homes: usize) -> usize {
        (homes.max(HOMES_MIN) * GROWTH_NUM).div_ceil(GROWTH_DEN)
    }

    /// Ensures room for `additional` more entries without exceeding the load threshold.
    pub(crate) fn reserve(&mut self, additional: usize) {
        let need = self.len + additional;
        if !self.slots.is_empty() && need * LOAD_DEN_MAX <= self.homes * LOAD_NUM_MAX {
            return;
        }
        let mut homes = self.homes.max(HOMES_MIN);
        while need * LOAD_DEN_MAX > homes * LOAD_NUM_MAX {
            homes = self.grown_homes(homes);
        }
        self.rebuild(homes, self.tail);
    }

    /// Re-lays the entries out over `homes` homes and at least `tail` tail slots (doubling the
    /// tail until every entry fits, which it does once the tail exceeds the entry count).
    /// Entries are read in slot order, which is tag order, so each lands at or after the previous
    /// one and no run ever needs shifting.
    fn rebuild(&mut self, homes: usize, tail: usize) {
        let old = std::mem::take(&mut self.slots);
        self.homes = homes;
        self.tail = tail.max(TAIL_SLOTS_MIN);
        loop {
            let n = homes + self.tail;
            let mut slots = vec![EMPTY; n];
            let mut next = 0usize;
            let mut fits = true;
            for &s in old.iter().filter(|&&s| s != EMPTY) {
                let pos = self.home(s).max(next);
                if pos + 1 >= n {
                    fits = false;
                    break;
                }
                slots[pos] = s;
                next = pos + 1;
            }
            if fits {
                self.slots = slots;
                return;
            }
            self.tail *= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Every run is sorted by tag and every entry sits at or after its home: the two facts the
    /// early-stopping miss relies on.
    fn assert_layout(t: &HashSlots) {
        let mut prev_tag = 0u64;
        for (pos, &s) in t.slots.iter().enumerate() {
            if s == EMPTY {
                continue;
            }
            assert!(
                t.home(s) <= pos,
                "entry at {pos} sits before its home {}",
                t.home(s)
            );
            assert!(s & TAG_MASK >= prev_tag, "tags out of order at {pos}");
            prev_tag = s & TAG_MASK;
        }
        assert_eq!(
            t.slots.last(),
            Some(&EMPTY),
            "the last slot must stay empty"
        );
    }

    #[test]
    fn inserts_finds_and_removes_agree_with_a_map_under_collisions() {
        // Hashes sharing their top bits (tags) collide on the home slot, and many share the
        // whole tag, exercising full-hash confirmation, long runs and the tail past the last home.
        let hashes: Vec<u64> = (0..2_000u64)
            .map(|i| (i % 7) << 61 | (i % 5) << 32 | i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 34)
            .chain((0..300u64).map(|i| u64::MAX - i))
            .collect();
        let at = |i: u32| hashes[i as usize];
        let mut t = HashSlots::default();
        let mut model = HashMap::new();
        for (i, &h) in hashes.iter().enumerate() {
            t.insert_unique(h, i as u32);
            model.insert(h, i as u32);
        }
        assert_layout(&t);
        for (i, &h) in hashes.iter().enumerate() {
            if i % 3 == 0 {
                t.remove(h, at);
                model.remove(&h);
            }
        }
        assert_layout(&t);
        for &h in &hashes {
            assert_eq!(t.find(h, at), model.get(&h).copied(), "hash {h:#x}");
        }
        assert_eq!(t.find(12345, at), None);
        assert_eq!(t.len, model.len());
    }

    #[test]
    fn uniform_hashes_keep_the_table_between_the_growth_step_and_the_load_cap() {
        let mut t = HashSlots::default();
        let mut x = 0x1234_5678_9abc_def0u64;
        for i in 0..100_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            t.insert_unique(x, i);
            if i > 1_000 {
                let load = t.len as f64 / t.homes as f64;
                assert!(
                    (0.63..=0.8).contains(&load),
                    "load {load} after {} entries over {} homes",
                    t.len,
                    t.homes
                );
            }
        }
        assert_layout(&t);
    }
}
