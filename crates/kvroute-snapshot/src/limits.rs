//! Decode limits: the ceilings a consumer puts on a body before it allocates for it.
//!
//! They are a parameter, not only constants, because the service sizes them from its own
//! configuration (a replica serving 8 ranks should not accept a 64 M-node body), while the
//! constants give safe defaults sized for the largest fleet we plan for (64 ranks x 1 M blocks)
//! with headroom.

/// Longest `hash_scheme` string accepted.
pub const HASH_SCHEME_MAX_BYTES: usize = 256;
/// Longest worker URL accepted in the rank table.
pub const WORKER_URL_MAX_BYTES: usize = 2048;
/// HMAC keys shorter than this are refused on both sides: a short shared secret is guessable
/// offline from one captured body.
pub const MAC_KEY_MIN_BYTES: usize = 16;

pub const DEFAULT_NODES_MAX: usize = 64 * 1024 * 1024;
pub const DEFAULT_CARRIERS_MAX: usize = 128 * 1024 * 1024;
pub const DEFAULT_RANKS_MAX: usize = 16 * 1024;
pub const DEFAULT_DECODED_MAX_BYTES: usize = 2 * 1024 * 1024 * 1024;

/// Ceilings checked before allocating for a decoded snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Most nodes (distinct blocks) in the snapshot.
    pub max_nodes: usize,
    /// Most carried (rank, block) pairs.
    pub max_carriers: usize,
    /// Most entries in the rank table; also bounds cursors and empty ranks.
    pub max_ranks: usize,
    /// Most bytes of input and, separately, of decompressed body.
    pub max_bytes: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_nodes: DEFAULT_NODES_MAX,
            max_carriers: DEFAULT_CARRIERS_MAX,
            max_ranks: DEFAULT_RANKS_MAX,
            max_bytes: DEFAULT_DECODED_MAX_BYTES,
        }
    }
}
