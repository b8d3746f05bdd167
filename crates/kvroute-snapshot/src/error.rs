//! Typed errors of the snapshot codecs.
//!
//! A replica fetches snapshots from peers it does not fully trust to be healthy (a half-written
//! body, a proxy that truncates, a peer on another version, or a hostile sender when the MAC is
//! configured), so every way a body can be wrong has its own variant naming the field, the value
//! and the limit involved; callers log it and fall back to cold start instead of panicking.

use thiserror::Error;

/// Why a snapshot body was refused. Decoding never panics and never allocates beyond
/// [`crate::DecodeLimits`]; each refusal lands in exactly one of these.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SnapshotDecodeError {
    #[error("input of {len_bytes} bytes is over the limit of {limit_bytes} bytes")]
    InputTooLarge {
        len_bytes: usize,
        limit_bytes: usize,
    },
    #[error("decompressed body would exceed the limit of {limit_bytes} bytes")]
    TooLarge { limit_bytes: usize },
    #[error("decompression failed: {reason}")]
    Decompress { reason: String },
    #[error("truncated while reading {field}")]
    Truncated { field: &'static str },
    #[error("not a kvroute binary snapshot (bad magic)")]
    BadMagic,
    #[error("unsupported binary snapshot version {version}")]
    UnsupportedVersion { version: u8 },
    #[error("unknown envelope flag bits {bits:#04x}")]
    UnknownFlags { bits: u8 },
    #[error("unknown compression code {code}")]
    UnknownCompression { code: u8 },
    #[error("a MAC key was given but the snapshot carries no MAC")]
    MacMissing,
    #[error("the snapshot's MAC does not verify with our key")]
    MacMismatch,
    #[error("MAC key is {len_bytes} bytes, shorter than the minimum of {min_bytes} bytes")]
    MacKeyTooShort { len_bytes: usize, min_bytes: usize },
    #[error("body checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")]
    ChecksumMismatch { stored: u64, computed: u64 },
    #[error("varint in {field} is longer than 10 bytes or overflows 64 bits")]
    VarintOverflow { field: &'static str },
    #[error("{field} count {count} is over the limit of {limit}")]
    CountOverLimit {
        field: &'static str,
        count: u64,
        limit: u64,
    },
    #[error("{field} has invalid value {value}")]
    OutOfRange { field: &'static str, value: u64 },
    #[error("{field} is not valid UTF-8")]
    BadUtf8 { field: &'static str },
    #[error("node {node} says its carriers equal its parent's, but it has no parent")]
    SameAsParentOnRoot { node: u64 },
    #[error("{field} refers to rank index {rank}, but the rank table has {ranks} entries")]
    RankOutOfRange {
        field: &'static str,
        rank: u64,
        ranks: u64,
    },
    #[error("{field} declared {declared} entries but the data yields {actual}")]
    CountMismatch {
        field: &'static str,
        declared: u64,
        actual: u64,
    },
    #[error("{trailing_bytes} unexpected bytes after the body")]
    TrailingBytes { trailing_bytes: usize },
    #[error("JSON snapshot is malformed: {reason}")]
    Json { reason: String },
}

/// Why a snapshot could not be encoded: the snapshot itself breaks an invariant the encoding
/// relies on (checked up front, so a bad export fails before any byte is sent), the key is
/// unusable, or the writer failed.
#[derive(Debug, Error)]
pub enum SnapshotEncodeError {
    #[error("column {column} has {len} entries, expected {expected}")]
    ColumnLength {
        column: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("carrier_end decreases at node {node}")]
    CarrierEndDecreasing { node: usize },
    #[error("node {node} has parent {parent}, which does not precede it")]
    ParentNotBefore { node: usize, parent: u32 },
    #[error("cursor of rank {rank} has a non-finite ts, which JSON cannot carry")]
    NonFiniteTs { rank: u32 },
    #[error("MAC key is {len_bytes} bytes, shorter than the minimum of {min_bytes} bytes")]
    MacKeyTooShort { len_bytes: usize, min_bytes: usize },
    #[error("writing the snapshot failed: {0}")]
    Io(#[from] std::io::Error),
}
