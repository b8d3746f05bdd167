//! The router's own content hash of token blocks.
//!
//! kvroute keys its index by a hash it computes itself from token content, never by the engine's
//! block hash: engines disagree on the function (SGLang chains SHA-256, vLLM hashes CBOR with a
//! seed that used to be random per process), and a request arriving at the router has tokens, not
//! engine hashes. The engine hash is kept only as a per-rank side key so `BlockRemoved` can be
//! applied.
//!
//! The hash of block `i` is chained: `h_i = xxh3_64_with_seed(tokens_i, mix(h_{i-1}, extra_i))`
//! with `h_{-1}` = the namespace seed (LoRA adapter). Chaining makes a block's hash identify its
//! whole prefix, so equal hashes mean equal prefixes (up to 64-bit collisions), which is what lets
//! the index look a block up directly instead of walking from the root. Only FULL blocks are
//! hashed: engines cache and announce whole pages only.
//!
//! Changing anything here changes [`HASH_SCHEME`], which snapshots carry so that a replica built
//! with a different function refuses them instead of grafting hashes it would never reproduce.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Names this module's function and parameters in snapshots. Bump it on any change.
pub const HASH_SCHEME: &str = "kvroute-xxh3-chain-v1";

/// The namespace seed of requests with no LoRA adapter and no cache salt.
pub const BASE_NAMESPACE: u64 = 0x6b76_726f_7574_6531; // "kvroute1"

/// Odd multiplier (2^64 / golden ratio) used to spread a block's extra-key digest before it is
/// mixed into the seed, so a small digest cannot cancel the parent's bits.
const EXTRA_SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

/// The seed of a request's first block. LoRA adapters (by name when the engine sends one, else by
/// id) and cache salts get separate namespaces, because an engine never shares KV across them.
pub fn namespace_seed(lora_name: Option<&str>, lora_id: Option<i64>) -> u64 {
    match (lora_name, lora_id) {
        (Some(name), _) if !name.is_empty() => xxh3_64_with_seed(name.as_bytes(), BASE_NAMESPACE),
        (_, Some(id)) => xxh3_64_with_seed(&id.to_le_bytes(), BASE_NAMESPACE ^ 1),
        _ => BASE_NAMESPACE,
    }
}

/// Digest of an opaque per-block extra key (e.g. the msgpack bytes of vLLM's `extra_keys` entry).
pub fn extra_key_digest(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Hash of one block given its parent's hash (or the namespace seed for the first block).
#[inline]
pub fn chain_hash(parent: u64, block_tokens: &[u32], block_extra: Option<u64>) -> u64 {
    let seed = match block_extra {
        Some(extra) => parent ^ extra.wrapping_mul(EXTRA_SPREAD).rotate_left(29),
        None => parent,
    };
    hash_token_bytes(block_tokens, seed)
}

/// xxh3 of the tokens' little-endian bytes. On little-endian targets that is the token memory
/// itself, hashed in place: copying every block into a zeroed stack buffer first was about half
/// the cost of hashing an 8k-token prompt.
#[cfg(target_endian = "little")]
#[inline]
fn hash_token_bytes(tokens: &[u32], seed: u64) -> u64 {
    // SAFETY: `u8` has alignment 1 and `u32` has no padding, so the `4 * len` bytes starting at
    // `tokens` are initialised, in bounds and live as long as `tokens`; on a little-endian target
    // they are exactly each token's `to_le_bytes()`.
    let bytes = unsafe {
        std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
    };
    xxh3_64_with_seed(bytes, seed)
}

/// Big-endian targets must re-encode: on the stack for ordinary page sizes, so no allocation on
/// the routing path.
#[cfg(not(target_endian = "little"))]
fn hash_token_bytes(tokens: &[u32], seed: u64) -> u64 {
    let mut buf = [0u8; 1024];
    if tokens.len() * 4 <= buf.len() {
        for (dst, t) in buf.chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..tokens.len() * 4], seed)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

/// Hashes the full blocks of `tokens` (a trailing partial block is ignored) into `out`, which is
/// cleared first so callers can reuse one buffer per thread.
pub fn hash_token_blocks(tokens: &[u32], block_size: usize, namespace: u64, out: &mut Vec<u64>) {
    out.clear();
    if block_size == 0 {
        return;
    }
    out.reserve(tokens.len() / block_size);
    let mut parent = namespace;
    for block in tokens.chunks_exact(block_size) {
        parent = chain_hash(parent, block, None);
        out.push(parent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_hash_equal_and_diverge_after_the_first_differing_block() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 9999; // inside block 2 (tokens 32..48) with block size 16
        let (mut ha, mut hb) = (Vec::new(), Vec::new());
        hash_token_blocks(&a, 16, BASE_NAMESPACE, &mut ha);
        hash_token_blocks(&b, 16, BASE_NAMESPACE, &mut hb);
        assert_eq!(ha.len(), 4);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        assert_ne!(
            ha[3], hb[3],
            "a chained hash must carry the divergence forward"
        );
    }

    #[test]
    fn a_trailing_partial_block_is_not_hashed() {
        let mut out = vec![1, 2, 3];
        hash_token_blocks(&(0..47).collect::<Vec<u32>>(), 16, BASE_NAMESPACE, &mut out);
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn lora_namespaces_never_share_a_block_hash() {
        let tokens: Vec<u32> = (0..16).collect();
        let base = chain_hash(namespace_seed(None, None), &tokens, None);
        let by_name = chain_hash(namespace_seed(Some("adapter-a"), None), &tokens, None);
        let by_id = chain_hash(namespace_seed(None, Some(7)), &tokens, None);
        assert_ne!(base, by_name);
        assert_ne!(base, by_id);
        assert_ne!(by_name, by_id);
    }

    #[test]
    fn an_extra_key_changes_the_block_hash() {
        let tokens: Vec<u32> = (0..16).collect();
        assert_ne!(
            chain_hash(BASE_NAMESPACE, &tokens, None),
            chain_hash(BASE_NAMESPACE, &tokens, Some(extra_key_digest(b"image-1")))
        );
    }

    #[test]
    fn a_block_hashes_as_xxh3_of_its_little_endian_token_bytes() {
        let tokens: Vec<u32> = (0..16).map(|i| 0x0102_0304 * (i + 1)).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(chain_hash(9, &tokens, None), xxh3_64_with_seed(&bytes, 9));
    }

    #[test]
    fn blocks_larger_than_the_stack_buffer_hash_like_small_ones_would() {
        let tokens: Vec<u32> = (0..600).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(chain_hash(5, &tokens, None), xxh3_64_with_seed(&bytes, 5));
    }
}

/// A `Hasher` for keys that ARE content hashes ([`chain_hash`] values): they are uniform 64-bit
/// values already, so a map keyed by them uses the key itself instead of hashing it again.
/// Other writes (not expected) are folded in so it stays a valid, if weak, hasher.
#[derive(Default)]
pub struct ContentHashHasher(u64);

impl std::hash::Hasher for ContentHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// `BuildHasher` for maps keyed by content hashes (see [`ContentHashHasher`]).
pub type ContentHashBuilder = std::hash::BuildHasherDefault<ContentHashHasher>;
