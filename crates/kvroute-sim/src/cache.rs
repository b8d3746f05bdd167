//! The simulated engine's paged prefix cache for one DP rank, and the KV events it produces.
//!
//! Shaped like SGLang's radix cache with HiCache, because that is what the router must model:
//! * a prompt is cut into full blocks of `block_size` tokens (a trailing partial block is never
//!   cached, as in both engines); block `i` is keyed by the router's chained content hash of
//!   blocks `0..=i`, so one key identifies a whole prefix and the cache is a tree by construction;
//! * each block also gets the ENGINE's hash (seeded, chained over the parent's engine hash), the
//!   opaque value announced on the wire. It deliberately differs from the content hash so a router
//!   that confused the two would fail against this simulator;
//! * eviction is LRU over LEAVES only: a block with a cached child is never evicted first, which
//!   keeps the device set prefix-closed (a child on device implies its parent on device);
//! * with a host tier, an evicted device block is first backed up to host (`BlockStored` with
//!   medium host) then dropped from device (`BlockRemoved` medium device), and a later request that
//!   reaches it promotes it back (`BlockStored` medium device). Host eviction drops leaves too.
//!
//! Pure and synchronous: the engine calls it under its per-rank lock and publishes the returned
//! events as one batch, so event order on the wire is exactly the order of cache mutations.

use std::collections::{BTreeSet, HashMap};

use kvroute_index::hash::{BASE_NAMESPACE, hash_token_blocks};
use kvroute_wire::{BlockRemoved, BlockStored, EngineHash, KvEvent, Medium};
use xxhash_rust::xxh3::Xxh3;

/// Domain separator mixed into every engine block hash so that, even with `--hash-seed 0`, the
/// engine's hash never coincides with the router's content hash of the same tokens.
const ENGINE_HASH_DOMAIN: u64 = 0x5347_4c53_494d_4b56; // "SGLSIMKV"

#[derive(Debug, Clone, Copy)]
pub struct CacheConfig {
    pub block_size: usize,
    pub capacity_blocks: usize,
    /// 0 disables the host tier.
    pub host_capacity_blocks: usize,
    pub hash_seed: u64,
}

#[derive(Debug)]
struct Node {
    parent: Option<u64>,
    engine_hash: u64,
    parent_engine_hash: Option<u64>,
    tokens: Box<[u32]>,
    on_device: bool,
    on_host: bool,
    /// Children that exist in any tier.
    children: u32,
    /// Children currently on device; a device leaf has none.
    device_children: u32,
    last_used: u64,
}

impl Node {
    fn device_evictable(&self) -> bool {
        self.on_device && self.device_children == 0
    }
    /// Dropping the host copy is always fine while the device copy exists; a host-only block
    /// may go only when nothing hangs below it.
    fn host_evictable(&self) -> bool {
        self.on_host && (self.on_device || self.children == 0)
    }
}

/// How much of a prompt the cache already holds, counted in whole blocks from the start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading blocks held in any tier (all count as cached tokens).
    pub cached_blocks: usize,
    /// Of those, blocks held only in the host tier (they cost a load back to device).
    pub host_blocks: usize,
}

#[derive(Debug)]
pub struct PrefixCache {
    cfg: CacheConfig,
    nodes: HashMap<u64, Node>,
    /// (last_used, key) of device leaves: the eviction order.
    device_lru: BTreeSet<(u64, u64)>,
    /// (last_used, key) of host-evictable blocks.
    host_lru: BTreeSet<(u64, u64)>,
    device_used: usize,
    host_used: usize,
    tick: u64,
}

impl PrefixCache {
    pub fn new(cfg: CacheConfig) -> Self {
        PrefixCache {
            cfg,
            nodes: HashMap::new(),
            device_lru: BTreeSet::new(),
            host_lru: BTreeSet::new(),
            device_used: 0,
            host_used: 0,
            tick: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    pub fn device_blocks(&self) -> usize {
        self.device_used
    }
    pub fn host_blocks(&self) -> usize {
        self.host_used
    }
    pub fn capacity_blocks(&self) -> usize {
        self.cfg.capacity_blocks
    }

    /// Content keys of the full blocks of `tokens` (see [`block_keys`]).
    pub fn block_keys(&self, tokens: &[u32]) -> Vec<u64> {
        block_keys(tokens, self.cfg.block_size)
    }

    /// The engine hash of `key`, if that block is cached in some tier.
    pub fn engine_hash_of(&self, key: u64) -> Option<u64> {
        self.nodes.get(&key).map(|n| n.engine_hash)
    }

    /// Whether `key` is on device / on host.
    pub fn tiers_of(&self, key: u64) -> Option<(bool, bool)> {
        self.nodes.get(&key).map(|n| (n.on_device, n.on_host))
    }

    /// Every cached block as (content key, parent's content key, engine hash, on device, on host),
    /// in no particular order: read-only, so a test can compare a router's index with what the
    /// engine really holds (`GET /control/cache`).
    pub fn blocks(&self) -> impl Iterator<Item = (u64, Option<u64>, u64, bool, bool)> + '_ {
        self.nodes
            .iter()
            .map(|(&k, n)| (k, n.parent, n.engine_hash, n.on_device, n.on_host))
    }

    /// Counts the cached leading blocks and marks them used, so they are the last to be evicted
    /// while this request prefills.
    pub fn match_prefix(&mut self, keys: &[u64]) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        for &key in keys {
            let Some(node) = self.nodes.get(&key) else {
                break;
            };
            m.cached_blocks += 1;
            if !node.on_device {
                m.host_blocks += 1;
            }
            self.touch(key);
        }
        m
    }

    /// Caches every full block of `tokens` (as a finished prefill does) and appends the events
    /// this causes, in order. Blocks already on device are only touched; host-only blocks are
    /// promoted. Returns how many blocks ended up on device for this prompt; fewer than the
    /// prompt has when the device cannot hold them without evicting the prompt's own path.
    pub fn insert(&mut self, tokens: &[u32], keys: &[u64], events: &mut Vec<KvEvent>) -> usize {
        let bs = self.cfg.block_size;
        // Pin the prompt's already-cached blocks (touching them gives them ticks from here on)
        // so that making room, in either tier, never evicts the path being inserted.
        let first_tick_of_path = self.tick + 1;
        for &key in keys {
            if !self.nodes.contains_key(&key) {
                break;
            }
            self.touch(key);
        }
        let mut parent: Option<u64> = None;
        for (i, &key) in keys.iter().enumerate() {
            match self.nodes.get(&key).map(|n| n.on_device) {
                Some(true) => self.touch(key),
                Some(false) => {
                    if !self.make_device_room(first_tick_of_path, events) {
                        return i;
                    }
                    self.set_on_device(key, true);
                    self.touch(key);
                    events.push(self.stored_event(key, Medium::Device));
                }
                None => {
                    if !self.make_device_room(first_tick_of_path, events) {
                        return i;
                    }
                    let block = &tokens[i * bs..(i + 1) * bs];
                    let parent_engine_hash = parent.and_then(|p| self.engine_hash_of(p));
                    let engine_hash =
                        engine_block_hash(self.cfg.hash_seed, parent_engine_hash, block);
                    self.tick += 1;
                    self.nodes.insert(
                        key,
                        Node {
                            parent,
                            engine_hash,
                            parent_engine_hash,
                            tokens: block.into(),
                            on_device: true,
                            on_host: false,
                            children: 0,
                            device_children: 0,
                            last_used: self.tick,
                        },
                    );
                    self.device_used += 1;
                    self.index(key);
                    if let Some(p) = parent {
                        self.update(p, |n| {
                            n.children += 1;
                            n.device_children += 1;
                        });
                    }
                    events.push(self.stored_event(key, Medium::Device));
                }
            }
            parent = Some(key);
        }
        keys.len()
    }

    /// Empties every tier and reports it as one `AllBlocksCleared` (a cache flush).
    pub fn clear(&mut self, events: &mut Vec<KvEvent>) {
        self.reset();
        events.push(KvEvent::AllBlocksCleared);
    }

    /// Empties every tier silently (an engine restart: the new process starts empty and says
    /// nothing about the old one's blocks).
    pub fn reset(&mut self) {
        self.nodes.clear();
        self.device_lru.clear();
        self.host_lru.clear();
        self.device_used = 0;
        self.host_used = 0;
    }

    fn stored_event(&self, key: u64, medium: Medium) -> KvEvent {
        let n = &self.nodes[&key];
        KvEvent::BlockStored(BlockStored {
            medium: Some(medium),
            ..BlockStored::new(
                vec![EngineHash(n.engine_hash)],
                n.parent_engine_hash.map(EngineHash),
                n.tokens.to_vec(),
                self.cfg.block_size as u32,
            )
        })
    }

    fn removed_event(&self, key: u64, medium: Medium) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(self.nodes[&key].engine_hash)],
            medium: Some(medium),
            group_idx: None,
        })
    }

    fn touch(&mut self, key: u64) {
        self.tick += 1;
        let tick = self.tick;
        self.update(key, |n| n.last_used = tick);
    }

    /// Applies `f` to a node while keeping both eviction sets consistent with it.
    fn update(&mut self, key: u64, f: impl FnOnce(&mut Node)) {
        self.unindex(key);
        if let Some(n) = self.nodes.get_mut(&key) {
            f(n);
        }
        self.index(key);
    }

    fn unindex(&mut self, key: u64) {
        if let Some(n) = self.nodes.get(&key) {
            self.device_lru.remove(&(n.last_used, key));
            self.host_lru.remove(&(n.last_used, key));
        }
    }

    fn index(&mut self, key: u64) {
        if let Some(n) = self.nodes.get(&key) {
            if n.device_evictable() {
                self.device_lru.insert((n.last_used, key));
            }
            if n.host_evictable() {
                self.host_lru.insert((n.last_used, key));
            }
        }
    }

    fn set_on_device(&mut self, key: u64, on: bool) {
        let Some(n) = self.nodes.get(&key) else {
            return;
        };
        if n.on_device == on {
            return;
        }
        let parent = n.parent;
        self.update(key, |n| n.on_device = on);
        if on {
            self.device_used += 1;
        } else {
            self.device_used -= 1;
        }
        if let Some(p) = parent {
            self.update(p, |n| {
                if on {
                    n.device_children += 1;
                } else {
                    n.device_children -= 1;
                }
            });
        }
    }

    /// Frees one device slot if the device is full. Blocks touched since `pinned_from_tick`
    /// belong to the prompt being inserted and are never evicted for it; `false` when only such
    /// blocks remain.
    fn make_device_room(&mut self, pinned_from_tick: u64, events: &mut Vec<KvEvent>) -> bool {
        while self.device_used >= self.cfg.capacity_blocks {
            let Some(&(tick, key)) = self.device_lru.first() else {
                return false;
            };
            if tick >= pinned_from_tick {
                return false;
            }
            self.evict_from_device(key, pinned_from_tick, events);
        }
        true
    }

    fn evict_from_device(&mut self, key: u64, pinned_from_tick: u64, events: &mut Vec<KvEvent>) {
        let host_tier = self.cfg.host_capacity_blocks > 0;
        // Without host room (every host block is on the path being inserted) the block is
        // simply dropped. It then has no children: a host-only descendant would have an
        // unpinned host-only leaf, which would have been evictable.
        if host_tier && !self.nodes[&key].on_host && self.make_host_room(pinned_from_tick, events) {
            self.update(key, |n| n.on_host = true);
            self.host_used += 1;
            events.push(self.stored_event(key, Medium::Host));
        }
        events.push(self.removed_event(key, Medium::Device));
        self.set_on_device(key, false);
        self.drop_if_unheld(key);
    }

    /// Frees one host slot if the host tier is full, never evicting blocks touched since
    /// `pinned_from_tick`; `false` when it cannot.
    fn make_host_room(&mut self, pinned_from_tick: u64, events: &mut Vec<KvEvent>) -> bool {
        while self.host_used >= self.cfg.host_capacity_blocks {
            let Some(&(tick, key)) = self.host_lru.first() else {
                return false;
            };
            if tick >= pinned_from_tick {
                return false;
            }
            events.push(self.removed_event(key, Medium::Host));
            self.update(key, |n| n.on_host = false);
            self.host_used -= 1;
            self.drop_if_unheld(key);
        }
        true
    }

    /// Forgets a block that is in no tier any more (it has no children by the leaf rules).
    fn drop_if_unheld(&mut self, key: u64) {
        let gone = matches!(self.nodes.get(&key), Some(n) if !n.on_device && !n.on_host);
        if !gone {
            return;
        }
        self.unindex(key);
        if let Some(node) = self.nodes.remove(&key)
            && let Some(p) = node.parent
        {
            self.update(p, |n| n.children -= 1);
        }
    }
}

/// Content keys of the full blocks of `tokens`: the router's chained hash, reused so that the
/// cache's tree is keyed exactly like the router's index (and computable outside the lock).
pub fn block_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::new();
    hash_token_blocks(tokens, block_size, BASE_NAMESPACE, &mut out);
    out
}

/// The engine's own chained block hash: xxh3 over the parent's engine hash and the block's
/// tokens, seeded per engine. Opaque to the router by design.
pub fn engine_block_hash(seed: u64, parent: Option<u64>, block_tokens: &[u32]) -> u64 {
    let mut h = Xxh3::with_seed(seed ^ ENGINE_HASH_DOMAIN);
    h.update(&parent.unwrap_or(!ENGINE_HASH_DOMAIN).to_le_bytes());
    for t in block_tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(capacity: usize, host: usize) -> PrefixCache {
        PrefixCache::new(CacheConfig {
            block_size: 4,
            capacity_blocks: capacity,
            host_capacity_blocks: host,
            hash_seed: 7,
        })
    }

    fn prompt(start: u32, blocks: u32) -> Vec<u32> {
        (start..start + blocks * 4).collect()
    }

    fn insert(c: &mut PrefixCache, tokens: &[u32]) -> Vec<KvEvent> {
        let keys = c.block_keys(tokens);
        let mut ev = Vec::new();
        c.match_prefix(&keys);
        c.insert(tokens, &keys, &mut ev);
        ev
    }

    fn stored(ev: &[KvEvent]) -> Vec<(u64, Option<u64>, Option<Medium>)> {
        ev.iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) => Some((
                    s.block_hashes[0].0,
                    s.parent_block_hash.map(|h| h.0),
                    s.medium,
                )),
                _ => None,
            })
            .collect()
    }

    fn removed(ev: &[KvEvent]) -> Vec<(u64, Option<Medium>)> {
        ev.iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved(r) => Some((r.block_hashes[0].0, r.medium)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn stored_blocks_chain_by_engine_hash_and_a_partial_block_is_not_cached() {
        let mut c = cache(16, 0);
        let mut tokens = prompt(100, 3);
        tokens.push(1); // partial trailing block
        let ev = insert(&mut c, &tokens);
        let s = stored(&ev);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].1, None);
        assert_eq!(s[1].1, Some(s[0].0));
        assert_eq!(s[2].1, Some(s[1].0));
        assert_eq!(c.device_blocks(), 3);
    }

    #[test]
    fn engine_hash_differs_from_the_router_content_hash() {
        let mut c = cache(16, 0);
        let tokens = prompt(0, 2);
        let keys = c.block_keys(&tokens);
        insert(&mut c, &tokens);
        for k in keys {
            assert_ne!(c.engine_hash_of(k), Some(k));
        }
    }

    #[test]
    fn a_repeated_prompt_matches_all_its_blocks_and_emits_nothing_new() {
        let mut c = cache(16, 0);
        let tokens = prompt(0, 3);
        insert(&mut c, &tokens);
        let keys = c.block_keys(&tokens);
        assert_eq!(c.match_prefix(&keys).cached_blocks, 3);
        let mut ev = Vec::new();
        c.insert(&tokens, &keys, &mut ev);
        assert!(ev.is_empty(), "{ev:?}");
    }

    #[test]
    fn eviction_takes_the_least_recent_leaf_never_a_parent_with_children() {
        let mut c = cache(4, 0);
        let a = prompt(0, 3); // a0 a1 a2
        insert(&mut c, &a);
        let b = prompt(1000, 1); // b0, cache now full
        insert(&mut c, &b);
        let ka = c.block_keys(&a);
        // a2 is the oldest LEAF (a0 is older but has a child), so it goes first.
        let ev = insert(&mut c, &prompt(2000, 1));
        assert_eq!(removed(&ev), vec![(c_hash(&a, 2), Some(Medium::Device))]);
        assert!(c.tiers_of(ka[2]).is_none());
        assert!(c.tiers_of(ka[0]).is_some());
    }

    fn c_hash(tokens: &[u32], block: usize) -> u64 {
        let mut parent = None;
        let mut h = 0;
        for b in 0..=block {
            h = engine_block_hash(7, parent, &tokens[b * 4..(b + 1) * 4]);
            parent = Some(h);
        }
        h
    }

    #[test]
    fn a_prompt_longer_than_the_cache_keeps_its_head_and_never_evicts_its_own_path() {
        let mut c = cache(2, 0);
        let tokens = prompt(0, 5);
        let keys = c.block_keys(&tokens);
        let mut ev = Vec::new();
        assert_eq!(c.insert(&tokens, &keys, &mut ev), 2);
        assert!(removed(&ev).is_empty());
        assert_eq!(c.device_blocks(), 2);
    }

    #[test]
    fn host_tier_backs_up_evicted_blocks_and_promotes_them_on_reuse() {
        let mut c = cache(2, 4);
        let a = prompt(0, 2);
        insert(&mut c, &a);
        let ev = insert(&mut c, &prompt(500, 2));
        // both a blocks moved to host: stored(host) then removed(device), leaf first
        assert_eq!(
            stored(&ev)
                .iter()
                .filter(|s| s.2 == Some(Medium::Host))
                .count(),
            2
        );
        assert_eq!(
            removed(&ev),
            vec![
                (c_hash(&a, 1), Some(Medium::Device)),
                (c_hash(&a, 0), Some(Medium::Device))
            ]
        );
        assert_eq!(c.host_blocks(), 2);
        let keys = c.block_keys(&a);
        assert_eq!(
            c.match_prefix(&keys),
            PrefixMatch {
                cached_blocks: 2,
                host_blocks: 2
            }
        );
        let mut ev = Vec::new();
        c.insert(&a, &keys, &mut ev);
        let promoted: Vec<_> = stored(&ev)
            .into_iter()
            .filter(|s| s.2 == Some(Medium::Device))
            .map(|s| s.0)
            .collect();
        assert_eq!(promoted, vec![c_hash(&a, 0), c_hash(&a, 1)]);
        assert_eq!(c.tiers_of(keys[0]), Some((true, true)));
    }

    #[test]
    fn host_eviction_drops_leaves_and_forgets_blocks_in_no_tier() {
        let mut c = cache(1, 1);
        insert(&mut c, &prompt(0, 1)); // x on device
        insert(&mut c, &prompt(100, 1)); // x -> host, y on device
        let ev = insert(&mut c, &prompt(200, 1)); // y -> host evicts x from host
        assert!(removed(&ev).contains(&(c_hash(&prompt(0, 1), 0), Some(Medium::Host))));
        assert!(c.tiers_of(c.block_keys(&prompt(0, 1))[0]).is_none());
        assert_eq!((c.device_blocks(), c.host_blocks()), (1, 1));
    }

    #[test]
    fn promoting_a_host_block_never_evicts_that_block_to_make_host_room() {
        // Found by the model test: the host tier is full with exactly the block being promoted,
        // and making device room pushes another block to host.
        let mut c = cache(2, 1);
        let a = prompt(0, 5);
        insert(&mut c, &a); // a0 a1 cached (capacity 2)
        insert(&mut c, &prompt(100, 1)); // a1 -> host
        insert(&mut c, &prompt(200, 1)); // a0 -> host, a1 dropped from host
        let ev = insert(&mut c, &a); // promote a0 while host is full with a0
        let a0 = c.block_keys(&a)[0];
        assert_eq!(c.tiers_of(a0), Some((true, true)), "{ev:?}");
        assert!(stored(&ev).contains(&(c_hash(&a, 0), None, Some(Medium::Device))));
    }

    #[test]
    fn clear_empties_every_tier_and_reports_all_blocks_cleared() {
        let mut c = cache(2, 2);
        insert(&mut c, &prompt(0, 3));
        let mut ev = Vec::new();
        c.clear(&mut ev);
        assert_eq!(ev, vec![KvEvent::AllBlocksCleared]);
        assert_eq!((c.device_blocks(), c.host_blocks()), (0, 0));
    }
}

#[cfg(test)]
mod model_tests {
    //! The cache against a model built only from the events it emitted: whatever sequence of
    //! prompts arrives, a router that applies those events must end up with exactly the cache's
    //! tiers, and the cache's own invariants (capacity, prefix-closed device set) must hold.
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// What a router would know: engine hash -> (on device, on host).
    fn apply(model: &mut HashMap<u64, (bool, bool)>, events: &[KvEvent]) {
        for ev in events {
            match ev {
                KvEvent::BlockStored(s) => {
                    for h in &s.block_hashes {
                        let e = model.entry(h.0).or_default();
                        match s.medium {
                            Some(Medium::Host) => e.1 = true,
                            _ => e.0 = true,
                        }
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    for h in &r.block_hashes {
                        if let Some(e) = model.get_mut(&h.0) {
                            match r.medium {
                                Some(Medium::Host) => e.1 = false,
                                Some(Medium::Device) => e.0 = false,
                                _ => *e = (false, false),
                            }
                            if *e == (false, false) {
                                model.remove(&h.0);
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared => model.clear(),
            }
        }
    }

    fn check_invariants(c: &PrefixCache) {
        let device = c.nodes.values().filter(|n| n.on_device).count();
        let host = c.nodes.values().filter(|n| n.on_host).count();
        assert_eq!((device, host), (c.device_used, c.host_used));
        assert!(c.device_used <= c.cfg.capacity_blocks);
        assert!(c.host_used <= c.cfg.host_capacity_blocks);
        for (key, n) in &c.nodes {
            assert!(
                n.on_device || n.on_host,
                "a node in no tier must be forgotten"
            );
            if let Some(p) = n.parent {
                let parent = c.nodes.get(&p).expect("a cached block's parent is cached");
                if n.on_device {
                    assert!(parent.on_device, "device set is prefix-closed ({key})");
                }
            }
            let children = c.nodes.values().filter(|m| m.parent == Some(*key));
            let (all, dev) = children.fold((0, 0), |(a, d), m| (a + 1, d + m.on_device as u32));
            assert_eq!((n.children, n.device_children), (all, dev));
        }
    }

    proptest! {
        #[test]
        fn events_replayed_into_a_model_reproduce_the_cache_tiers(
            prompts in prop::collection::vec((0u32..6, 1u32..6), 1..60),
            capacity in 1usize..10,
            host in 0usize..8,
            clear_at in prop::option::of(0usize..60),
        ) {
            let mut c = PrefixCache::new(CacheConfig {
                block_size: 2,
                capacity_blocks: capacity,
                host_capacity_blocks: host,
                hash_seed: 3,
            });
            let mut model = HashMap::new();
            for (i, (family, blocks)) in prompts.into_iter().enumerate() {
                let mut ev = Vec::new();
                if clear_at == Some(i) {
                    c.clear(&mut ev);
                }
                // Families share their leading tokens, so prompts overlap in prefixes.
                let tokens: Vec<u32> = (0..blocks * 2).map(|t| if t < 2 { family } else { family * 100 + t }).collect();
                let keys = c.block_keys(&tokens);
                c.match_prefix(&keys);
                c.insert(&tokens, &keys, &mut ev);
                apply(&mut model, &ev);
                check_invariants(&c);
                let actual: HashMap<u64, (bool, bool)> = c
                    .nodes
                    .values()
                    .map(|n| (n.engine_hash, (n.on_device, n.on_host)))
                    .collect();
                prop_assert_eq!(&model, &actual);
            }
        }
    }
}
