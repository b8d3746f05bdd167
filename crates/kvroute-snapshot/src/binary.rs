//! The compact binary snapshot: a small envelope around a columnar, checksummed body.
//!
//! Layout (all integers little-endian; "varint" is unsigned LEB128):
//!
//! ```text
//! envelope: "KVSN" | version u8 (1 or 2) | flags u8 | payload | [HMAC-SHA256 tag, 32 bytes]
//!   flags: bits 0-1 compression (0 none, 1 gzip, 2 zstd), bit 2 MAC present, others zero
//!   payload: the body, compressed as the flags say
//!   tag: HMAC-SHA256(key, every envelope byte before the tag)
//! body:
//!   format varint | hash_scheme (len varint, UTF-8) | block_size varint | producer_ready u8
//!   ranks: count, then per rank: worker_url (len, UTF-8), dp_rank varint
//!   cursors: count, then per cursor: rank varint, seq zigzag varint, ts f64 bits (8 bytes)
//!   empty_ranks: count, then rank varints
//!   partial_ranks (version 2 only): count, then rank varints
//!   node_count varint | carrier_count varint
//!   parents:        per node, 0 for a root else (node index - parent index)
//!   content hashes: per node, 8 raw bytes
//!   shapes:         per node, varint: bit 0 = all carriers share one engine hash,
//!                   bit 1 = same rank list as the parent, bits 2.. = carrier count (0 if bit 1)
//!   carrier ranks:  per node without bit 1: first rank varint, then zigzag deltas to the previous
//!   tiers:          runs of (tier u8, run length varint) covering every carrier in order
//!   engine hashes:  per node with carriers: 8 bytes if bit 0, else 8 bytes per carrier
//!   checksum:       xxh3-64 of every body byte before it, 8 bytes
//! ```
//!
//! Why this shape: columns group alike bytes so zstd squeezes the structural ones (parent deltas
//! are nearly all 1 in DFS order, shapes repeat, tiers are one long run) to almost nothing, and
//! leaves the random 64-bit hashes, which no codec can shrink, as contiguous raw runs it skips
//! fast. The two per-node flags are where the real savings are: a shared system-prompt block
//! carried by dozens of ranks costs one shape byte instead of a rank list, and in SGLang-style
//! fleets, where equal content gives equal engine hashes on every rank, one engine hash instead of
//! dozens. Content hashes are chained over tokens, so a consumer cannot recompute them: they stay.
//!
//! The MAC covers the compressed envelope and is checked before anything is inflated or parsed,
//! so an unauthenticated sender cannot even reach the decompressor. The checksum lives inside the
//! body so it also catches encoder/decoder disagreements, not only transport corruption.
//! Versions: a snapshot that names no partial rank is written as version 1, byte for byte what
//! producers wrote before `partial_ranks` existed, so a consumer that predates it still reads
//! every snapshot of a fully warm fleet; only a snapshot with something to say about partial
//! histories is version 2, which such a consumer refuses rather than graft as complete. A version
//! 1 snapshot decodes with no partial rank.
//!
//! Encoding streams: the body is produced in [`BODY_CHUNK_BYTES`] chunks straight into the
//! compressor and the caller's writer.

use std::io::Write;

use hmac::{Hmac, KeyInit, Mac};
use kvroute_wire::snapshot::{IndexSnapshot, NO_PARENT, RankCursor, RankRef, SnapshotNodes};
use sha2::Sha256;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::compress::{CompressingWriter, Compression, decompress_bounded};
use crate::error::{SnapshotDecodeError, SnapshotEncodeError};
use crate::limits::{DecodeLimits, HASH_SCHEME_MAX_BYTES, MAC_KEY_MIN_BYTES, WORKER_URL_MAX_BYTES};
use crate::varint::{FieldSource, Reader, put_varint, unzigzag, zigzag};

/// First four bytes of every binary snapshot.
pub const BINARY_MAGIC: [u8; 4] = *b"KVSN";
/// Version of the envelope and body layout described in the module doc, without
/// `partial_ranks`: what is written when no rank is partial.
pub const BINARY_VERSION: u8 = 1;
/// The same layout with the `partial_ranks` list after `empty_ranks`.
pub const BINARY_VERSION_PARTIAL: u8 = 2;

/// The version `snapshot` is written as (see the module doc).
fn binary_version_of(snapshot: &IndexSnapshot) -> u8 {
    if snapshot.partial_ranks.is_empty() {
        BINARY_VERSION
    } else {
        BINARY_VERSION_PARTIAL
    }
}
/// `Content-Type` the service should send with a binary snapshot.
pub const BINARY_CONTENT_TYPE: &str = "application/x-kvroute-snapshot";
/// Size of the body chunks handed to the compressor/writer while streaming.
pub const BODY_CHUNK_BYTES: usize = 64 * 1024;
/// Length of the HMAC-SHA256 trailer.
pub const MAC_TAG_BYTES: usize = 32;

pub(crate) const HEADER_BYTES: usize = 6;
pub(crate) const CHECKSUM_BYTES: usize = 8;
const FLAG_COMPRESSION_MASK: u8 = 0b0000_0011;
const FLAG_MAC: u8 = 0b0000_0100;
const SHAPE_SHARED_ENGINE_HASH: u64 = 0b01;
const SHAPE_SAME_RANKS_AS_PARENT: u64 = 0b10;
const SHAPE_COUNT_SHIFT: u32 = 2;
/// Cheapest possible node on the wire: a parent varint, 8 content-hash bytes, a shape varint.
const NODE_MIN_BYTES: usize = 1 + 8 + 1;
/// Cheapest rank-table entry: an empty URL (1 byte) and a dp rank (1 byte).
const RANK_MIN_BYTES: usize = 2;
/// Cheapest cursor: rank, seq, 8-byte ts.
const CURSOR_MIN_BYTES: usize = 1 + 1 + 8;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// How to encode: compression and, when given, the shared secret for the HMAC trailer.
#[derive(Debug, Clone, Copy, Default)]
pub struct EncodeOptions<'k> {
    pub compression: Compression,
    pub mac_key: Option<&'k [u8]>,
}

/// What an encode produced, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeStats {
    /// Uncompressed body bytes, checksum included.
    pub body_bytes: u64,
    /// Bytes written to the caller's writer: envelope, payload and MAC.
    pub wire_bytes: u64,
}

/// Encodes `snapshot` into `out` as it goes, never holding more than one body chunk plus the
/// compressor's window. The snapshot is checked first (column lengths, `carrier_end` monotone,
/// parents precede children), so an invalid export fails before a single byte is written.
pub fn encode_binary<W: Write>(
    snapshot: &IndexSnapshot,
    options: &EncodeOptions<'_>,
    out: W,
) -> Result<EncodeStats, SnapshotEncodeError> {
    check_encodable(&snapshot.nodes)?;
    let mac = match options.mac_key {
        Some(key) => {
            Some(
                new_mac(key).map_err(|len_bytes| SnapshotEncodeError::MacKeyTooShort {
                    len_bytes,
                    min_bytes: MAC_KEY_MIN_BYTES,
                })?,
            )
        }
        None => None,
    };
    let mut tee = MacTee {
        out,
        mac,
        written: 0,
    };
    let mut flags = options.compression.code();
    if tee.mac.is_some() {
        flags |= FLAG_MAC;
    }
    tee.write_all(&BINARY_MAGIC)?;
    tee.write_all(&[binary_version_of(snapshot), flags])?;

    let compressor = CompressingWriter::new(tee, options.compression)?;
    let mut body = BodyWriter {
        buf: Vec::with_capacity(BODY_CHUNK_BYTES + 64),
        hasher: Xxh3::new(),
        out: compressor,
        body_bytes: 0,
    };
    write_body(snapshot, &mut body)?;
    let (compressor, body_bytes) = body.finish()?;
    let mut tee = compressor.finish()?;
    if let Some(mac) = tee.mac.take() {
        let tag = mac.finalize().into_bytes();
        tee.write_all(tag.as_slice())?;
    }
    tee.out.flush()?;
    Ok(EncodeStats {
        body_bytes,
        wire_bytes: tee.written,
    })
}

/// [`encode_binary`] into a fresh `Vec`.
pub fn encode_binary_to_vec(
    snapshot: &IndexSnapshot,
    options: &EncodeOptions<'_>,
) -> Result<Vec<u8>, SnapshotEncodeError> {
    let mut out = Vec::new();
    encode_binary(snapshot, options, &mut out)?;
    Ok(out)
}

/// Decodes a whole binary snapshot. With `mac_key`, the body must carry a MAC that verifies under
/// that key ([`SnapshotDecodeError::MacMissing`] / [`SnapshotDecodeError::MacMismatch`]), checked
/// before decompression. Without a key, a MAC trailer is skipped unverified.
///
/// The snapshot's `format` is carried, not judged: refusing an unknown format is the consumer's
/// decision, next to `hash_scheme`.
pub fn decode_binary(
    bytes: &[u8],
    limits: &DecodeLimits,
    mac_key: Option<&[u8]>,
) -> Result<IndexSnapshot, SnapshotDecodeError> {
    if bytes.len() > limits.max_bytes {
        return Err(SnapshotDecodeError::InputTooLarge {
            len_bytes: bytes.len(),
            limit_bytes: limits.max_bytes,
        });
    }
    if bytes.len() < HEADER_BYTES {
        return Err(SnapshotDecodeError::Truncated { field: "header" });
    }
    let mut header = [0u8; HEADER_BYTES];
    header.copy_from_slice(&bytes[..HEADER_BYTES]);
    let Envelope {
        version,
        compression,
        has_mac,
        mut mac,
    } = read_envelope_header(&header, mac_key)?;
    let payload_end = if has_mac {
        if bytes.len() < HEADER_BYTES + MAC_TAG_BYTES {
            return Err(SnapshotDecodeError::Truncated { field: "MAC tag" });
        }
        bytes.len() - MAC_TAG_BYTES
    } else {
        bytes.len()
    };
    if let Some(mac) = mac.take() {
        let mut mac = mac;
        mac.update(&bytes[..payload_end]);
        mac.verify_slice(&bytes[payload_end..])
            .map_err(|_| SnapshotDecodeError::MacMismatch)?;
    }
    let body = decompress_bounded(
        &bytes[HEADER_BYTES..payload_end],
        compression,
        limits.max_bytes,
    )?;
    decode_body(&body, limits, version)
}

/// What the six header bytes say, checked, and a fresh MAC (when keyed) that has seen nothing
/// yet: the caller feeds it every envelope byte before the tag, header included.
pub(crate) struct Envelope {
    pub(crate) version: u8,
    pub(crate) compression: Compression,
    pub(crate) has_mac: bool,
    pub(crate) mac: Option<HmacSha256>,
}

pub(crate) fn read_envelope_header(
    header: &[u8; HEADER_BYTES],
    mac_key: Option<&[u8]>,
) -> Result<Envelope, SnapshotDecodeError> {
    if header[..4] != BINARY_MAGIC {
        return Err(SnapshotDecodeError::BadMagic);
    }
    let version = header[4];
    if version != BINARY_VERSION && version != BINARY_VERSION_PARTIAL {
        return Err(SnapshotDecodeError::UnsupportedVersion { version });
    }
    let flags = header[5];
    if flags & !(FLAG_COMPRESSION_MASK | FLAG_MAC) != 0 {
        return Err(SnapshotDecodeError::UnknownFlags {
            bits: flags & !(FLAG_COMPRESSION_MASK | FLAG_MAC),
        });
    }
    let compression = Compression::from_code(flags & FLAG_COMPRESSION_MASK).ok_or(
        SnapshotDecodeError::UnknownCompression {
            code: flags & FLAG_COMPRESSION_MASK,
        },
    )?;
    let has_mac = flags & FLAG_MAC != 0;
    let mac = match mac_key {
        Some(key) => {
            Some(
                new_mac(key).map_err(|len_bytes| SnapshotDecodeError::MacKeyTooShort {
                    len_bytes,
                    min_bytes: MAC_KEY_MIN_BYTES,
                })?,
            )
        }
        None => None,
    };
    if mac.is_some() && !has_mac {
        return Err(SnapshotDecodeError::MacMissing);
    }
    Ok(Envelope {
        version,
        compression,
        has_mac,
        mac,
    })
}

/// Hands body bytes to the compressor in chunks while hashing them for the trailing checksum.
struct BodyWriter<W: Write> {
    buf: Vec<u8>,
    hasher: Xxh3,
    out: W,
    body_bytes: u64,
}

impl<W: Write> BodyWriter<W> {
    #[inline]
    fn spill_if_full(&mut self) -> std::io::Result<()> {
        if self.buf.len() >= BODY_CHUNK_BYTES {
            self.spill()?;
        }
        Ok(())
    }

    fn spill(&mut self) -> std::io::Result<()> {
        self.hasher.update(&self.buf);
        self.out.write_all(&self.buf)?;
        self.body_bytes += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }

    #[inline]
    fn varint(&mut self, value: u64) -> std::io::Result<()> {
        put_varint(&mut self.buf, value);
        self.spill_if_full()
    }

    #[inline]
    fn raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.buf.extend_from_slice(bytes);
        self.spill_if_full()
    }

    fn string(&mut self, text: &str) -> std::io::Result<()> {
        self.varint(text.len() as u64)?;
        self.raw(text.as_bytes())
    }

    fn finish(mut self) -> std::io::Result<(W, u64)> {
        self.spill()?;
        let checksum = self.hasher.digest();
        self.out.write_all(&checksum.to_le_bytes())?;
        Ok((self.out, self.body_bytes + CHECKSUM_BYTES as u64))
    }
}

/// Feeds every envelope byte to the HMAC (when keyed) on its way to the caller's writer.
struct MacTee<W: Write> {
    out: W,
    mac: Option<HmacSha256>,
    written: u64,
}

impl<W: Write> Write for MacTee<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        if let Some(mac) = &mut self.mac {
            mac.update(&buf[..n]);
        }
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// Errors with the key length when the key is too short to be a real secret.
fn new_mac(key: &[u8]) -> Result<HmacSha256, usize> {
    if key.len() < MAC_KEY_MIN_BYTES {
        return Err(key.len());
    }
    HmacSha256::new_from_slice(key).map_err(|_| key.len())
}

pub(crate) fn check_encodable(nodes: &SnapshotNodes) -> Result<(), SnapshotEncodeError> {
    let node_count = nodes.parent.len();
    let column = |column: &'static str, len: usize, expected: usize| {
        if len == expected {
            Ok(())
        } else {
            Err(SnapshotEncodeError::ColumnLength {
                column,
                len,
                expected,
            })
        }
    };
    column("content_hash", nodes.content_hash.len(), node_count)?;
    column("carrier_end", nodes.carrier_end.len(), node_count)?;
    let carriers = nodes.carrier_rank.len();
    column("carrier_tiers", nodes.carrier_tiers.len(), carriers)?;
    column(
        "carrier_engine_hash",
        nodes.carrier_engine_hash.len(),
        carriers,
    )?;
    let mut previous_end = 0u32;
    for (node, (&end, &parent)) in nodes.carrier_end.iter().zip(&nodes.parent).enumerate() {
        if end < previous_end {
            return Err(SnapshotEncodeError::CarrierEndDecreasing { node });
        }
        previous_end = end;
        if parent != NO_PARENT && parent as usize >= node {
            return Err(SnapshotEncodeError::ParentNotBefore { node, parent });
        }
    }
    column("carrier_end (last value)", previous_end as usize, carriers)
}

#[inline]
fn carrier_range(carrier_end: &[u32], node: usize) -> std::ops::Range<usize> {
    let start = if node == 0 {
        0
    } else {
        carrier_end[node - 1] as usize
    };
    start..carrier_end[node] as usize
}

fn write_body<W: Write>(snapshot: &IndexSnapshot, body: &mut BodyWriter<W>) -> std::io::Result<()> {
    body.varint(u64::from(snapshot.format))?;
    body.string(&snapshot.hash_scheme)?;
    body.varint(u64::from(snapshot.block_size))?;
    body.raw(&[u8::from(snapshot.producer_ready)])?;
    body.varint(snapshot.ranks.len() as u64)?;
    for rank in &snapshot.ranks {
        body.string(&rank.worker_url)?;
        body.varint(u64::from(rank.dp_rank))?;
    }
    body.varint(snapshot.cursors.len() as u64)?;
    for cursor in &snapshot.cursors {
        body.varint(u64::from(cursor.rank))?;
        body.varint(zigzag(cursor.seq))?;
        body.raw(&cursor.ts.to_bits().to_le_bytes())?;
    }
    body.varint(snapshot.empty_ranks.len() as u64)?;
    for &rank in &snapshot.empty_ranks {
        body.varint(u64::from(rank))?;
    }
    if binary_version_of(snapshot) == BINARY_VERSION_PARTIAL {
        body.varint(snapshot.partial_ranks.len() as u64)?;
        for &rank in &snapshot.partial_ranks {
            body.varint(u64::from(rank))?;
        }
    }

    let nodes = &snapshot.nodes;
    let node_count = nodes.len();
    body.varint(node_count as u64)?;
    body.varint(nodes.carried_blocks() as u64)?;

    for (node, &parent) in nodes.parent.iter().enumerate() {
        let delta = if parent == NO_PARENT {
            0
        } else {
            (node - parent as usize) as u64
        };
        body.varint(delta)?;
    }
    for &hash in &nodes.content_hash {
        body.raw(&hash.to_le_bytes())?;
    }

    // Shapes and rank lists need the same per-node decisions; computing them twice is cheaper
    // than buffering a per-node flag column.
    for node in 0..node_count {
        body.varint(node_shape(nodes, node))?;
    }
    for node in 0..node_count {
        if node_shape(nodes, node) & SHAPE_SAME_RANKS_AS_PARENT != 0 {
            continue;
        }
        let mut previous: Option<u32> = None;
        for &rank in &nodes.carrier_rank[carrier_range(&nodes.carrier_end, node)] {
            match previous {
                None => body.varint(u64::from(rank))?,
                Some(prev) => body.varint(zigzag(i64::from(rank) - i64::from(prev)))?,
            }
            previous = Some(rank);
        }
    }

    let mut tiers = nodes.carrier_tiers.iter().copied();
    if let Some(mut run_tier) = tiers.next() {
        let mut run_len = 1u64;
        for tier in tiers {
            if tier == run_tier {
                run_len += 1;
            } else {
                body.raw(&[run_tier])?;
                body.varint(run_len)?;
                run_tier = tier;
                run_len = 1;
            }
        }
        body.raw(&[run_tier])?;
        body.varint(run_len)?;
    }

    for node in 0..node_count {
        let range = carrier_range(&nodes.carrier_end, node);
        if range.is_empty() {
            continue;
        }
        let hashes = &nodes.carrier_engine_hash[range];
        if all_equal(hashes) {
            body.raw(&hashes[0].to_le_bytes())?;
        } else {
            for &hash in hashes {
                body.raw(&hash.to_le_bytes())?;
            }
        }
    }
    Ok(())
}

#[inline]
fn all_equal(values: &[u64]) -> bool {
    match values.split_first() {
        Some((first, rest)) => rest.iter().all(|v| v == first),
        None => false,
    }
}

/// The shape varint of `node` (see the module doc). Only called on snapshots that passed
/// `check_encodable`, so every range is in bounds.
#[inline]
fn node_shape(nodes: &SnapshotNodes, node: usize) -> u64 {
    let range = carrier_range(&nodes.carrier_end, node);
    let mut shape = if all_equal(&nodes.carrier_engine_hash[range.clone()]) {
        SHAPE_SHARED_ENGINE_HASH
    } else {
        0
    };
    let parent = nodes.parent[node];
    let same_as_parent = parent != NO_PARENT && {
        let parent_range = carrier_range(&nodes.carrier_end, parent as usize);
        nodes.carrier_rank[parent_range] == nodes.carrier_rank[range.clone()]
    };
    if same_as_parent {
        shape |= SHAPE_SAME_RANKS_AS_PARENT;
    } else {
        shape |= (range.len() as u64) << SHAPE_COUNT_SHIFT;
    }
    shape
}

/// Parses a decompressed body. Public within the crate so property tests can feed it mutated
/// bodies whose checksum they fixed up, reaching the column parsers behind the checksum.
pub(crate) fn decode_body(
    body: &[u8],
    limits: &DecodeLimits,
    version: u8,
) -> Result<IndexSnapshot, SnapshotDecodeError> {
    if body.len() < CHECKSUM_BYTES {
        return Err(SnapshotDecodeError::Truncated { field: "checksum" });
    }
    let (content, checksum) = body.split_at(body.len() - CHECKSUM_BYTES);
    let mut stored = [0u8; 8];
    stored.copy_from_slice(checksum);
    let stored = u64::from_le_bytes(stored);
    let computed = xxh3_64(content);
    if stored != computed {
        return Err(SnapshotDecodeError::ChecksumMismatch { stored, computed });
    }
    let mut r = Reader::new(content);
    let snapshot = decode_fields(&mut r, limits, version)?;
    if r.remaining() != 0 {
        return Err(SnapshotDecodeError::TrailingBytes {
            trailing_bytes: r.remaining(),
        });
    }
    Ok(snapshot)
}

/// Parses the body's fields, up to (not including) the checksum, from either source: a whole
/// body ([`decode_body`]) or a stream ([`crate::stream`]). What follows the last field is the
/// caller's to judge.
pub(crate) fn decode_fields<S: FieldSource>(
    r: &mut S,
    limits: &DecodeLimits,
    version: u8,
) -> Result<IndexSnapshot, SnapshotDecodeError> {
    let format = r.varint_u32("format")?;
    let hash_scheme = r.string("hash_scheme", HASH_SCHEME_MAX_BYTES)?;
    let block_size = r.varint_u32("block_size")?;
    let producer_ready = match r.u8("producer_ready")? {
        0 => false,
        1 => true,
        other => {
            return Err(SnapshotDecodeError::OutOfRange {
                field: "producer_ready",
                value: u64::from(other),
            });
        }
    };

    let rank_count = r.count("ranks", limits.max_ranks, RANK_MIN_BYTES)?;
    let mut ranks = Vec::with_capacity(rank_count);
    for _ in 0..rank_count {
        let worker_url = r.string("worker_url", WORKER_URL_MAX_BYTES)?;
        let dp_rank = r.varint_u32("dp_rank")?;
        ranks.push(RankRef {
            worker_url,
            dp_rank,
        });
    }
    let rank_index = |field: &'static str, value: u64| -> Result<u32, SnapshotDecodeError> {
        if value < rank_count as u64 {
            Ok(value as u32)
        } else {
            Err(SnapshotDecodeError::RankOutOfRange {
                field,
                rank: value,
                ranks: rank_count as u64,
            })
        }
    };

    let cursor_count = r.count("cursors", limits.max_ranks, CURSOR_MIN_BYTES)?;
    let mut cursors = Vec::with_capacity(cursor_count);
    for _ in 0..cursor_count {
        let rank = rank_index("cursor rank", r.varint("cursor rank")?)?;
        let seq = unzigzag(r.varint("cursor seq")?);
        let ts = f64::from_bits(r.u64_le("cursor ts")?);
        cursors.push(RankCursor { rank, seq, ts });
    }
    let empty_count = r.count("empty_ranks", limits.max_ranks, 1)?;
    let mut empty_ranks = Vec::with_capacity(empty_count);
    for _ in 0..empty_count {
        empty_ranks.push(rank_index("empty rank", r.varint("empty rank")?)?);
    }
    let mut partial_ranks = Vec::new();
    if version == BINARY_VERSION_PARTIAL {
        let partial_count = r.count("partial_ranks", limits.max_ranks, 1)?;
        partial_ranks.reserve_exact(partial_count);
        for _ in 0..partial_count {
            partial_ranks.push(rank_index("partial rank", r.varint("partial rank")?)?);
        }
    }

    let node_count = r.count("nodes", limits.max_nodes, NODE_MIN_BYTES)?;
    let carrier_count = r.count("carriers", limits.max_carriers, 0)?;
    if carrier_count > u32::MAX as usize {
        return Err(SnapshotDecodeError::OutOfRange {
            field: "carriers",
            value: carrier_count as u64,
        });
    }

    let mut parent = Vec::with_capacity(node_count);
    for node in 0..node_count {
        let delta = r.varint("parents")?;
        if delta == 0 {
            parent.push(NO_PARENT);
        } else if delta <= node as u64 {
            parent.push((node as u64 - delta) as u32);
        } else {
            return Err(SnapshotDecodeError::OutOfRange {
                field: "parent delta",
                value: delta,
            });
        }
    }
    let mut content_hash: Vec<u64> = Vec::with_capacity(node_count);
    r.extend_u64_le(node_count, "content hashes", &mut content_hash)?;

    // Shapes fix every node's carrier count, so the carrier columns can then be allocated at
    // their exact, already-limit-checked size.
    let mut shapes = Vec::with_capacity(node_count);
    let mut carrier_end = Vec::with_capacity(node_count);
    let mut total = 0u64;
    for (node, &p) in parent.iter().enumerate() {
        let shape = r.varint("shapes")?;
        let count = if shape & SHAPE_SAME_RANKS_AS_PARENT != 0 {
            if shape >> SHAPE_COUNT_SHIFT != 0 {
                return Err(SnapshotDecodeError::OutOfRange {
                    field: "shape",
                    value: shape,
                });
            }
            if p == NO_PARENT {
                return Err(SnapshotDecodeError::SameAsParentOnRoot { node: node as u64 });
            }
            let range = carrier_range(&carrier_end, p as usize);
            (range.end - range.start) as u64
        } else {
            shape >> SHAPE_COUNT_SHIFT
        };
        total = total.saturating_add(count);
        if total > carrier_count as u64 {
            return Err(SnapshotDecodeError::CountMismatch {
                field: "carriers",
                declared: carrier_count as u64,
                actual: total,
            });
        }
        carrier_end.push(total as u32);
        shapes.push((shape & (SHAPE_SHARED_ENGINE_HASH | SHAPE_SAME_RANKS_AS_PARENT)) as u8);
    }
    if total != carrier_count as u64 {
        return Err(SnapshotDecodeError::CountMismatch {
            field: "carriers",
            declared: carrier_count as u64,
            actual: total,
        });
    }

    let mut carrier_rank: Vec<u32> = Vec::with_capacity(carrier_count);
    for node in 0..node_count {
        let range = carrier_range(&carrier_end, node);
        if u64::from(shapes[node]) & SHAPE_SAME_RANKS_AS_PARENT != 0 {
            let parent_range = carrier_range(&carrier_end, parent[node] as usize);
            carrier_rank.extend_from_within(parent_range);
            continue;
        }
        let mut previous: Option<i64> = None;
        for _ in range {
            let raw = r.varint("carrier ranks")?;
            let rank = match previous {
                None => raw as i64,
                Some(prev) => prev.wrapping_add(unzigzag(raw)),
            };
            if rank < 0 {
                return Err(SnapshotDecodeError::RankOutOfRange {
                    field: "carrier rank",
                    rank: rank as u64,
                    ranks: rank_count as u64,
                });
            }
            carrier_rank.push(rank_index("carrier rank", rank as u64)?);
            previous = Some(rank);
        }
    }

    let mut carrier_tiers: Vec<u8> = Vec::with_capacity(carrier_count);
    while carrier_tiers.len() < carrier_count {
        let tier = r.u8("tiers")?;
        let run = r.varint("tier run length")?;
        let room = (carrier_count - carrier_tiers.len()) as u64;
        if run == 0 || run > room {
            return Err(SnapshotDecodeError::OutOfRange {
                field: "tier run length",
                value: run,
            });
        }
        carrier_tiers.resize(carrier_tiers.len() + run as usize, tier);
    }

    let mut carrier_engine_hash: Vec<u64> = Vec::with_capacity(carrier_count);
    for (node, &shape) in shapes.iter().enumerate() {
        let range = carrier_range(&carrier_end, node);
        if range.is_empty() {
            continue;
        }
        if u64::from(shape) & SHAPE_SHARED_ENGINE_HASH != 0 {
            let hash = r.u64_le("engine hashes")?;
            carrier_engine_hash.resize(carrier_engine_hash.len() + range.len(), hash);
        } else {
            r.extend_u64_le(range.len(), "engine hashes", &mut carrier_engine_hash)?;
        }
    }

    Ok(IndexSnapshot {
        format,
        hash_scheme,
        block_size,
        producer_ready,
        ranks,
        cursors,
        empty_ranks,
        partial_ranks,
        nodes: SnapshotNodes {
            parent,
            content_hash,
            carrier_end,
            carrier_rank,
            carrier_tiers,
            carrier_engine_hash,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_wire::snapshot::SNAPSHOT_FORMAT;
    use proptest::prelude::*;

    /// A chain of `len` nodes, each carried by the same `carriers` ranks; engine hashes shared
    /// per node when `shared_hashes`, else distinct per carrier.
    fn chain(len: usize, carriers: u32, shared_hashes: bool) -> IndexSnapshot {
        let mut nodes = SnapshotNodes::default();
        let mut next_hash = 0x1234_5678_9abc_def0u64;
        let mut fresh = || {
            next_hash = next_hash
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            next_hash
        };
        for i in 0..len {
            nodes
                .parent
                .push(if i == 0 { NO_PARENT } else { i as u32 - 1 });
            nodes.content_hash.push(fresh());
            let shared = fresh();
            for rank in 0..carriers {
                nodes.carrier_rank.push(rank);
                nodes.carrier_tiers.push(if i % 7 == 0 { 2 } else { 1 });
                nodes
                    .carrier_engine_hash
                    .push(if shared_hashes { shared } else { fresh() });
            }
            nodes.carrier_end.push(nodes.carrier_rank.len() as u32);
        }
        IndexSnapshot {
            format: SNAPSHOT_FORMAT,
            hash_scheme: "kvroute-xxh3-chain-v1".into(),
            block_size: 16,
            producer_ready: true,
            ranks: (0..carriers)
                .map(|i| RankRef {
                    worker_url: format!("http://127.0.0.1:{}", 9000 + i),
                    dp_rank: 0,
                })
                .collect(),
            cursors: vec![RankCursor {
                rank: 0,
                seq: -3,
                ts: 12.5,
            }],
            empty_ranks: vec![],
            partial_ranks: vec![],
            nodes,
        }
    }

    fn body_of(snapshot: &IndexSnapshot) -> Vec<u8> {
        let bytes = encode_binary_to_vec(snapshot, &EncodeOptions::default()).unwrap();
        bytes[HEADER_BYTES..].to_vec()
    }

    #[test]
    fn shared_hashes_and_inherited_rank_lists_cost_one_hash_and_one_shape_byte_per_node() {
        let len = 500;
        let body = body_of(&chain(len, 32, true));
        // Per node: parent delta 1 + content hash 8 + shape 1 + one engine hash 8 = 18 bytes;
        // the first node's rank list, the tier runs (a change every 7 nodes) and the header add
        // a bounded amount.
        let per_node_budget = 18 * len;
        let tier_runs_budget = (len / 7 + 1) * 2 * 2 * 3;
        assert!(
            body.len() <= per_node_budget + tier_runs_budget + 512,
            "shared-hash chain took {} body bytes for {len} nodes x 32 carriers",
            body.len()
        );
        let distinct = body_of(&chain(len, 32, false));
        assert!(
            distinct.len() >= len * 32 * 8,
            "per-carrier hashes must all be stored: {} bytes",
            distinct.len()
        );
    }

    fn fix_checksum(body: &mut [u8]) {
        let split = body.len() - CHECKSUM_BYTES;
        let sum = xxh3_64(&body[..split]);
        body[split..].copy_from_slice(&sum.to_le_bytes());
    }

    #[test]
    fn body_decoder_round_trips_the_fixture_before_mutation() {
        for shared in [true, false] {
            let snapshot = chain(40, 5, shared);
            assert_eq!(
                decode_body(
                    &body_of(&snapshot),
                    &DecodeLimits::default(),
                    BINARY_VERSION
                )
                .unwrap(),
                snapshot
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// The checksum stops almost every random change before parsing; fixing it up afterwards
        /// drives the mutations into every column parser instead.
        #[test]
        fn mutated_bodies_with_a_valid_checksum_never_panic(
            shared in any::<bool>(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
            do_cut in any::<bool>(),
        ) {
            let mut body = body_of(&chain(30, 4, shared));
            let limits = DecodeLimits { max_nodes: 1000, max_carriers: 10_000, max_ranks: 16, max_bytes: 1 << 20 };
            let content_len = body.len() - CHECKSUM_BYTES;
            for (position, value) in edits {
                body[position.index(content_len)] = value;
            }
            if do_cut {
                let keep = cut.index(content_len);
                body.drain(keep..content_len);
            }
            fix_checksum(&mut body);
            if let Ok(decoded) = decode_body(&body, &limits, BINARY_VERSION) {
                prop_assert!(decoded.nodes.carried_blocks() <= limits.max_carriers);
                prop_assert_eq!(decoded.nodes.carrier_end.last().copied().unwrap_or(0) as usize,
                    decoded.nodes.carried_blocks());
            }
        }
    }
}
