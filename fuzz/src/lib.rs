//! What the fuzz targets share: how a flat fuzz input is cut into structured input (ZMQ frames, a
//! snapshot body plus the encoding it arrived in), the replica the snapshot target vets against,
//! and the two pure source files that live inside heavy crates.
//!
//! Input layouts are defined here, once, because both the targets (reading inputs) and the seed
//! generator (`examples/gen_seeds.rs`, writing them) must agree on them.
//!
//! Why `#[path]` for three modules: `kvroute-kv`'s frame parsing, `kvroute`'s token-id reader and
//! its load-bookings frame codec are pure code inside crates that link tokio, zeromq, reqwest, axum, hyper, tokenizers and
//! more (about 190 and 290 crates). Building those with sanitizer coverage would take the CI
//! smoke far past its time budget for two functions that depend only on `bytes`, `thiserror`,
//! `serde_json`, `memchr`, `hmac` and `sha2`. So this crate compiles the very same source files; nothing is
//! copied, and a change to either file is fuzzed by the next build. The price: those files must
//! keep using only external crates (no `crate::` paths), and a crate they start using must be
//! added to this crate's manifest too; the fuzz build (and so the CI smoke) fails until it is.

use kvroute_bootstrap::{BodyEncoding, Expectations};
use kvroute_index::RankId;
use kvroute_snapshot::{Compression, DecodeLimits};
use kvroute_wire::snapshot::RankRef;

// Both files carry their home crate's unit tests (proptest); those run there, so the two
// modules are left out of this crate's own test build (`cargo clippy --all-targets`).

/// `kvroute-kv`'s `transport::frames`: the multipart frame checks of live and replay messages.
#[cfg(not(test))]
#[path = "../../crates/kvroute-kv/src/transport/frames.rs"]
pub mod kv_frames;

/// `kvroute`'s `data_plane::token_ids`: the token-id body reader of the proxy's fast path.
#[cfg(not(test))]
#[path = "../../crates/kvroute/src/data_plane/token_ids.rs"]
pub mod token_ids;

/// `kvroute`'s `peer::load_frame`: the load-bookings frame codec and the follower's table.
#[cfg(not(test))]
#[path = "../../crates/kvroute/src/peer/load_frame.rs"]
pub mod load_frame;

// ---------------------------------------------------------------------------------------------
// ZMQ frames

/// Which parser a frames input is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    Live,
    Replay,
}

/// Splits a frames input: byte 0 picks the parser (bit 0), then each frame is a one-byte length
/// followed by that many bytes, except the last frame, which takes whatever is left. A one-byte
/// length keeps frames short enough for the fuzzer to reach every count and width; the payload,
/// which the decoder needs long, is always the last frame.
pub fn split_frames(data: &[u8]) -> Option<(FrameKind, Vec<bytes::Bytes>)> {
    let (&first, mut rest) = data.split_first()?;
    let kind = if first & 1 == 0 {
        FrameKind::Live
    } else {
        FrameKind::Replay
    };
    let count = usize::from((first >> 1) % 8);
    let mut frames = Vec::with_capacity(count);
    for i in 0..count {
        if i + 1 == count {
            frames.push(bytes::Bytes::copy_from_slice(rest));
            rest = &[];
        } else {
            let (&len, tail) = rest.split_first().unwrap_or((&0, &[]));
            let len = usize::from(len).min(tail.len());
            frames.push(bytes::Bytes::copy_from_slice(&tail[..len]));
            rest = &tail[len..];
        }
    }
    Some((kind, frames))
}

/// The inverse of [`split_frames`] for frames whose non-last members are at most 255 bytes.
pub fn join_frames(kind: FrameKind, frames: &[&[u8]]) -> Vec<u8> {
    assert!(frames.len() < 8, "at most 7 frames");
    let mut out = vec![(frames.len() as u8) << 1 | u8::from(kind == FrameKind::Replay)];
    for (i, f) in frames.iter().enumerate() {
        if i + 1 < frames.len() {
            out.push(u8::try_from(f.len()).expect("a non-last frame of at most 255 bytes"));
        }
        out.extend_from_slice(f);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// snapshots

/// Block size of the replica the snapshot target vets for.
pub const SNAPSHOT_BLOCK: u32 = 16;
/// Ranks that replica serves: local id `i` is [`live_rank_ref`]`(i)`.
pub const SNAPSHOT_LIVE_RANKS: u32 = 8;
/// The internal auth token of the keyed modes (at least the 16 bytes the codec requires).
pub const SNAPSHOT_KEY: &[u8] = b"kvroute-fuzz-shared-secret-0001";
/// Decode limits far under the service's defaults, so one input cannot spend more than a few MB
/// or milliseconds (the defaults are sized for 64 M nodes; the bounds themselves are what the
/// codec's own tests check at full size).
pub const SNAPSHOT_LIMITS: DecodeLimits = DecodeLimits {
    max_nodes: 4_096,
    max_carriers: 16_384,
    max_ranks: 256,
    max_bytes: 1 << 20,
};

/// The worker of live rank `i` (two dp ranks per worker).
pub fn live_rank_ref(i: u32) -> RankRef {
    RankRef {
        worker_url: format!("http://10.1.0.{}:8000", i / 2),
        dp_rank: i % 2,
    }
}

/// The live rank table of the vetting replica.
pub fn live_ranks() -> Vec<(RankRef, RankId)> {
    (0..SNAPSHOT_LIVE_RANKS)
        .map(|i| (live_rank_ref(i), RankId(i)))
        .collect()
}

/// Every way a fetch can receive a snapshot body: the media type, the HTTP `Content-Encoding`
/// around it, and whether the MAC key is configured. Byte 0 of a snapshot input picks one.
pub const SNAPSHOT_MODES: [(BodyEncoding, bool); 8] = [
    (binary(Compression::None), false),
    (binary(Compression::None), true),
    (binary(Compression::Gzip), false),
    (binary(Compression::Zstd), false),
    (json(Compression::None), false),
    (json(Compression::Gzip), false),
    (json(Compression::Zstd), false),
    // A JSON body while a key is configured: refused as unauthenticated, whatever it holds.
    (json(Compression::None), true),
];

const fn binary(content_encoding: Compression) -> BodyEncoding {
    BodyEncoding {
        media: kvroute_bootstrap::BodyMedia::Binary,
        content_encoding,
    }
}

const fn json(content_encoding: Compression) -> BodyEncoding {
    BodyEncoding {
        media: kvroute_bootstrap::BodyMedia::Json,
        content_encoding,
    }
}

/// Splits a snapshot input into (body encoding, keyed, body).
pub fn split_snapshot_input(data: &[u8]) -> Option<(BodyEncoding, bool, &[u8])> {
    let (&first, body) = data.split_first()?;
    let (encoding, keyed) = SNAPSHOT_MODES[usize::from(first) % SNAPSHOT_MODES.len()];
    Some((encoding, keyed, body))
}

/// The expectations of the vetting replica.
pub fn snapshot_expectations<'a>(live: &'a [(RankRef, RankId)], keyed: bool) -> Expectations<'a> {
    Expectations {
        block_size: SNAPSHOT_BLOCK,
        live,
        mac_key: keyed.then_some(SNAPSHOT_KEY),
        limits: SNAPSHOT_LIMITS,
    }
}

// ---------------------------------------------------------------------------------------------
// chunked bodies

/// Piece sizes for feeding a byte string to an incremental decoder, derived from the input
/// itself so a crash reproduces from the input file alone: 1 to 16 bytes, cycling.
pub fn piece_sizes(seed: &[u8]) -> impl Iterator<Item = usize> + '_ {
    let fallback: &[u8] = &[1];
    let seed = if seed.is_empty() { fallback } else { seed };
    seed.iter().cycle().map(|b| 1 + usize::from(b % 16))
}
