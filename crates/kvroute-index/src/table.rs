//! A shard's content-hash -> slab-index table: open addressing, linear probing, 8-byte slots.
//!
//! Why not `hashbrown`: the routing path looks up hundreds of chained hashes per request in a
//! table far larger than cache, and the hashes are all known up front. Here the slot of a hash is
//! a pure function of the hash (its top bits), so `match_prefix` can PREFETCH the slots of the
//! next blocks while it processes the current ones; hashbrown's layout is private, so it cannot.
//! Content hashes are uniform already, so no hasher runs at all.
//!
//! A slot packs a 32-bit tag (the hash's low half) with the node's slab index, so probing past a
//! colliding slot never touches the node; a tag hit is confirmed against the node's full hash.
//! Deletion shifts later entries back (no tombstones), so probe lengths never degrade with churn.

const EMPTY: u64 = u64::MAX;
/// Growth threshold: at most 3/4 of the slots in use keeps linear-probe runs short.
const MAX_LOAD_NUM: usize = 3;
const MAX_LOAD_DEN: usize = 4;
const MIN_SLOTS: usize = 16;

#[inline]
fn pack(hash: u64, idx: u32) -> u64 {
    ((hash as u32 as u64) << 32) | u64::from(idx)
}

#[inline]
fn tag_of(slot: u64) -> u32 {
    (slot >> 32) as u32
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

#[derive(Default)]
pub(crate) struct HashSlots {
    slots: Vec<u64>,
    shift: u32,
    len: usize,
}

impl HashSlots {
    #[inline]
    fn home(&self, hash: u64) -> usize {
        (hash >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    pub(crate) fn allocated_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<u64>()
    }

    /// Hints the CPU to load the slot `hash` starts probing at.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        if let Some(slot) = self.slots.get(self.home(hash)) {
            prefetch_ptr(slot);
        }
    }

    /// The slab index stored for `hash`; `hash_at(idx)` yields a stored node's full hash.
    #[inline]
    pub(crate) fn find(&self, hash: u64, hash_at: impl Fn(u32) -> u64) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let tag = hash as u32;
        let mask = self.mask();
        let mut pos = self.home(hash);
        loop {
            let s = self.slots[pos];
            if s == EMPTY {
                return None;
            }
            if tag_of(s) == tag && hash_at(idx_of(s)) == hash {
                return Some(idx_of(s));
            }
            pos = (pos + 1) & mask;
        }
    }

    /// Inserts `hash -> idx`; the caller guarantees `hash` is absent.
    pub(crate) fn insert_unique(&mut self, hash: u64, idx: u32, hash_at: impl Fn(u32) -> u64) {
        self.reserve(1, &hash_at);
        self.place(pack(hash, idx), hash);
        self.len += 1;
    }

    fn place(&mut self, slot: u64, hash: u64) {
        let mask = self.mask();
        let mut pos = self.home(hash);
        while self.slots[pos] != EMPTY {
            pos = (pos + 1) & mask;
        }
        self.slots[pos] = slot;
    }

    /// Removes `hash` if present.
    pub(crate) fn remove(&mut self, hash: u64, hash_at: impl Fn(u32) -> u64) {
        if self.len == 0 {
            return;
        }
        let tag = hash as u32;
        let mask = self.mask();
        let mut pos = self.home(hash);
        loop {
            let s = self.slots[pos];
            if s == EMPTY {
                return;
            }
            if tag_of(s) == tag && hash_at(idx_of(s)) == hash {
                break;
            }
            pos = (pos + 1) & mask;
        }
        // Backward-shift deletion: move later members of the run into the hole when their home
        // does not lie cyclically in (hole, current].
        let mut hole = pos;
        let mut cur = (pos + 1) & mask;
        loop {
            let s = self.slots[cur];
            if s == EMPTY {
                break;
            }
            let home = self.home(hash_at(idx_of(s)));
            let dist_cur = cur.wrapping_sub(home) & mask;
            let dist_hole = hole.wrapping_sub(home) & mask;
            if dist_hole < dist_cur {
                self.slots[hole] = s;
                hole = cur;
            }
            cur = (cur + 1) & mask;
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
    }

    /// Ensures room for `additional` more entries without exceeding the load threshold.
    pub(crate) fn reserve(&mut self, additional: usize, hash_at: impl Fn(u32) -> u64) {
        let need = self.len + additional;
        if need * MAX_LOAD_DEN <= self.slots.len() * MAX_LOAD_NUM {
            return;
        }
        let mut cap = self.slots.len().max(MIN_SLOTS);
        while need * MAX_LOAD_DEN > cap * MAX_LOAD_NUM {
            cap *= 2;
        }
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; cap]);
        self.shift = 64 - cap.trailing_zeros();
        for s in old {
            if s != EMPTY {
                let h = hash_at(idx_of(s));
                self.place(s, h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn inserts_finds_and_removes_agree_with_a_map_under_collisions() {
        // Hashes sharing their top bits collide on the home slot, exercising probe runs and the
        // backward shift across the wrap-around.
        let hashes: Vec<u64> = (0..2_000u64)
            .map(|i| (i % 7) << 61 | i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 3)
            .collect();
        let at = |i: u32| hashes[i as usize];
        let mut t = HashSlots::default();
        let mut model = HashMap::new();
        for (i, &h) in hashes.iter().enumerate() {
            t.insert_unique(h, i as u32, at);
            model.insert(h, i as u32);
        }
        for (i, &h) in hashes.iter().enumerate() {
            if i % 3 == 0 {
                t.remove(h, at);
                model.remove(&h);
            }
        }
        for &h in &hashes {
            assert_eq!(t.find(h, at), model.get(&h).copied(), "hash {h:#x}");
        }
        assert_eq!(t.find(12345, at), None);
        assert_eq!(t.len, model.len());
    }
}
