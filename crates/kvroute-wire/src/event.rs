//! The typed form of one engine KV-event batch, independent of how it was encoded.
//!
//! Block hashes are normalised into one opaque [`EngineHash`]: engines disagree on their type
//! (SGLang signed i64, vLLM unsigned u64 or 32-byte digests) and kvroute never interprets them;
//! it only needs "equal on the wire implies equal here" to apply `BlockRemoved` through a
//! per-rank side map.

/// An engine's block hash, normalised. Integers keep their 64 bits (an i64 is reinterpreted as
/// u64, so -1 and 2^64-1 from two different engines collide, which is harmless: side maps are
/// per rank and one engine uses one form). Byte hashes are folded with xxh3-64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// A byte-string hash (vLLM bytes mode sends 32-byte SHA-256 digests) folded to 64 bits.
    /// Folding keeps the index's per-rank side maps at one machine word per entry; a collision
    /// needs two live blocks of one rank to agree on 64 bits of xxh3, which is negligible.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        EngineHash(xxhash_rust::xxh3::xxh3_64(bytes))
    }

    /// A signed engine hash (SGLang's int64), kept bit for bit.
    pub fn from_i64(value: i64) -> Self {
        EngineHash(value as u64)
    }
}

/// The 32 bytes the encoder writes for `h` in [`crate::Encoding::VllmBytes`] mode.
///
/// The expansion is deterministic, so a simulated engine in bytes mode names each block the same
/// way every time. Decoding those bytes yields `EngineHash::from_bytes(&engine_hash_bytes32(h))`,
/// not `h`: identity is preserved consistently (equal in, equal out), which is all a router needs
/// because it never interprets engine hashes. The last 8 bytes are `h` big-endian, so vLLM's own
/// rule for its integer mode (the low 64 bits of the digest read big-endian) maps them back to `h`.
pub fn engine_hash_bytes32(h: EngineHash) -> [u8; 32] {
    let mut out = [0u8; 32];
    let seed_bytes = h.0.to_le_bytes();
    for (i, chunk) in out[..24].chunks_exact_mut(8).enumerate() {
        let word = xxhash_rust::xxh3::xxh3_64_with_seed(&seed_bytes, i as u64);
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out[24..].copy_from_slice(&h.0.to_be_bytes());
    out
}

/// Storage medium of a block, as named by the engine's `medium` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// "GPU" / "DEVICE", and the meaning of an absent medium on a store.
    Device,
    /// "CPU" / "CPU_PINNED" / "CPU_TIER1".
    Host,
    /// "DISK" / "CPU_TIER2" / "NVME" / "STORAGE".
    Disk,
    /// "EXTERNAL" / "NETWORK" / "REMOTE" / "SHARED".
    External,
    /// A medium string this build does not know. A store in it is ignored by the index; a removal
    /// in it clears every tier (the conservative reading: better a missed hit than a false one).
    Unknown,
}

impl Medium {
    /// Reads an engine's medium string. Matching is exact (engines write upper case); anything
    /// else is [`Medium::Unknown`] rather than an error, so a new tier name in an engine release
    /// degrades one event instead of the whole stream.
    pub fn from_wire(name: &[u8]) -> Self {
        match name {
            b"GPU" | b"DEVICE" => Medium::Device,
            b"CPU" | b"CPU_PINNED" | b"CPU_TIER1" => Medium::Host,
            b"CPU_TIER2" | b"DISK" | b"NVME" | b"STORAGE" => Medium::Disk,
            b"EXTERNAL" | b"NETWORK" | b"REMOTE" | b"SHARED" => Medium::External,
            _ => Medium::Unknown,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    pub parent_block_hash: Option<EngineHash>,
    /// Flat tokens of all blocks: `block_size * block_hashes.len()` in the normal case.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    /// `None` when the key was absent (read as device by the index).
    pub medium: Option<Medium>,
    /// One digest per block of that block's `extra_keys` entry (multimodal ids, cache salt ...),
    /// `None` for a block whose entry was nil. Empty when the engine sent no `extra_keys`.
    pub extra_keys: Vec<Option<u64>>,
    pub group_idx: Option<i64>,
}

impl BlockStored {
    /// A store of `block_hashes` (chained under `parent`) with no LoRA, no medium (read as
    /// device), no extra keys and no group: what producers and tests build most; set the other
    /// fields with struct update syntax.
    pub fn new(
        block_hashes: Vec<EngineHash>,
        parent_block_hash: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> BlockStored {
        BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            lora_name: None,
            medium: None,
            extra_keys: Vec::new(),
            group_idx: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineHash>,
    /// `None` when absent: the removal applies to every tier.
    pub medium: Option<Medium>,
    pub group_idx: Option<i64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

/// One published batch: the payload frame of a `[topic, seq, payload]` message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// `data_parallel_rank` (vLLM) or `attn_dp_rank` (SGLang); absent or nil reads as `None`.
    pub dp_rank: Option<u32>,
}

/// SGLang's `load` topic record: `["LoadStat", running, waiting, tokens, max_total_tokens, dp_rank]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadStat {
    pub num_running_reqs: u64,
    pub num_waiting_reqs: u64,
    pub num_tokens: u64,
    pub max_total_num_tokens: u64,
    pub dp_rank: Option<u32>,
}
