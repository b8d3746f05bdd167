//! kvroute-snapshot: the bytes of `GET /internal/kv_snapshot`.
//!
//! A warm router replica serves its whole prefix index ([`IndexSnapshot`], defined in
//! `kvroute-wire`) and a booting sibling grafts it. This crate only turns that model into bytes
//! and back, with no I/O or async of its own, so every encoding can be property-tested and
//! benchmarked on bytes alone and the service decides how to move them:
//!
//! * [`encode_json`] / [`decode_json`]: for humans and curl; hashes are hex strings so JavaScript
//!   readers keep all 64 bits ([`json`] documents the shape);
//! * [`encode_binary`] / [`decode_binary`]: compact columnar body, xxh3 checksum, optional zstd
//!   or gzip ([`Compression`]) and optional HMAC-SHA256 authentication ([`binary`] documents the
//!   layout). The encoder streams into any `std::io::Write`; the decoder takes the size-bounded
//!   bytes the fetch client buffered.
//!
//! Decoding never panics and never allocates past [`DecodeLimits`]: every count is checked
//! against a limit and against what the remaining input could hold before anything is reserved,
//! and decompression stops as soon as its output passes `max_bytes`.
//!
//! [`IndexSnapshot`]: kvroute_wire::snapshot::IndexSnapshot

pub mod binary;
pub mod compress;
pub mod error;
pub mod json;
pub mod limits;
pub mod stream;
mod varint;

pub use binary::{
    BINARY_CONTENT_TYPE, BINARY_MAGIC, BINARY_VERSION, BINARY_VERSION_PARTIAL, EncodeOptions,
    EncodeStats, decode_binary, encode_binary, encode_binary_to_vec,
};
pub use compress::{CompressingWriter, Compression, decompress_bounded, read_bounded};
pub use error::{SnapshotDecodeError, SnapshotEncodeError};
pub use json::{JSON_CONTENT_TYPE, decode_json, encode_json, encode_json_to_vec};
pub use limits::DecodeLimits;
pub use stream::{STREAM_READ_CHUNK_BYTES, decode_binary_stream};
