//! The JSON snapshot: the same data for humans, curl and scripts.
//!
//! Shape (one object; `nodes` in snapshot order, so a parent always precedes its children):
//!
//! ```json
//! {"json_version":1,"format":1,"hash_scheme":"kvroute-xxh3-chain-v1","block_size":16,
//!  "producer_ready":true,
//!  "ranks":[{"worker_url":"http://10.0.0.5:8000","dp_rank":0}],
//!  "cursors":[{"rank":0,"seq":41,"ts":1764467000.25}],
//!  "empty_ranks":[],
//!  "partial_ranks":[1],   (only when some rank's history is partial; absent means none)
//!  "node_count":2,"carried_blocks":2,
//!  "nodes":[{"parent":null,"hash":"9e3779b97f4a7c15","carriers":[{"rank":0,"tiers":1,"engine_hash":"00000000000004d2"}]},
//!           {"parent":0,"hash":"...","carriers":[...]}]}
//! ```
//!
//! Every 64-bit hash is a string of exactly 16 lowercase hex digits (zero-padded, no `0x`),
//! because JavaScript numbers lose 64-bit integers above 2^53; a JS reader does
//! `BigInt("0x" + h)`. Hex rather than decimal so the width is fixed and equal hashes are easy to
//! spot by eye. Rank indices, dp ranks, seqs and tiers stay numbers (engine sequence counters
//! stay far below 2^53, so JavaScript reads them exactly); `ts` is an
//! f64 as the engines sent it (it must be finite: JSON has no NaN). Nodes are records rather than
//! the model's columns because this encoding is for reading; `node_count` and `carried_blocks`
//! are informational and ignored on decode.
//!
//! Serialisation borrows the snapshot and streams into any `Write` (no intermediate tree).
//! Decoding enforces the same limits and invariants as the binary decoder.

use std::io::Write;

use kvroute_wire::snapshot::{IndexSnapshot, NO_PARENT, RankCursor, RankRef, SnapshotNodes};
use serde::de::{self, Deserializer, Visitor};
use serde::ser::{SerializeSeq, SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};

use crate::binary::check_encodable;
use crate::error::{SnapshotDecodeError, SnapshotEncodeError};
use crate::limits::{DecodeLimits, HASH_SCHEME_MAX_BYTES, WORKER_URL_MAX_BYTES};

/// Version of the JSON shape above.
pub const JSON_VERSION: u32 = 1;
/// `Content-Type` of the JSON snapshot.
pub const JSON_CONTENT_TYPE: &str = "application/json";

/// Streams `snapshot` as JSON into `out`. Wrap `out` in a `BufWriter` (or a
/// [`crate::CompressingWriter`], which buffers) when it is a socket: serde_json writes small
/// pieces.
pub fn encode_json<W: Write>(snapshot: &IndexSnapshot, out: W) -> Result<(), SnapshotEncodeError> {
    check_encodable(&snapshot.nodes)?;
    if let Some(cursor) = snapshot.cursors.iter().find(|c| !c.ts.is_finite()) {
        return Err(SnapshotEncodeError::NonFiniteTs { rank: cursor.rank });
    }
    let view = SnapshotView {
        json_version: JSON_VERSION,
        format: snapshot.format,
        hash_scheme: &snapshot.hash_scheme,
        block_size: snapshot.block_size,
        producer_ready: snapshot.producer_ready,
        ranks: &snapshot.ranks,
        cursors: &snapshot.cursors,
        empty_ranks: &snapshot.empty_ranks,
        partial_ranks: &snapshot.partial_ranks,
        node_count: snapshot.nodes.len(),
        carried_blocks: snapshot.nodes.carried_blocks(),
        nodes: NodesView(&snapshot.nodes),
    };
    serde_json::to_writer(out, &view).map_err(|e| match e.io_error_kind() {
        Some(kind) => SnapshotEncodeError::Io(std::io::Error::new(kind, e.to_string())),
        None => SnapshotEncodeError::Io(std::io::Error::other(e.to_string())),
    })
}

/// [`encode_json`] into a fresh `Vec`.
pub fn encode_json_to_vec(snapshot: &IndexSnapshot) -> Result<Vec<u8>, SnapshotEncodeError> {
    let mut out = Vec::new();
    encode_json(snapshot, &mut out)?;
    Ok(out)
}

/// Decodes a JSON snapshot (already decompressed by the HTTP layer, or via
/// [`crate::decompress_bounded`]). The input length is checked against `limits.max_bytes` first,
/// so parsing allocates in proportion to bytes the caller already accepted; counts, parents and
/// rank indices are then checked like the binary decoder does.
pub fn decode_json(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<IndexSnapshot, SnapshotDecodeError> {
    if bytes.len() > limits.max_bytes {
        return Err(SnapshotDecodeError::InputTooLarge {
            len_bytes: bytes.len(),
            limit_bytes: limits.max_bytes,
        });
    }
    let owned: SnapshotOwned =
        serde_json::from_slice(bytes).map_err(|e| SnapshotDecodeError::Json {
            reason: e.to_string(),
        })?;
    if owned.json_version != JSON_VERSION {
        return Err(SnapshotDecodeError::OutOfRange {
            field: "json_version",
            value: u64::from(owned.json_version),
        });
    }
    let over = |field: &'static str, count: usize, limit: usize| {
        if count > limit {
            Err(SnapshotDecodeError::CountOverLimit {
                field,
                count: count as u64,
                limit: limit as u64,
            })
        } else {
            Ok(())
        }
    };
    over(
        "hash_scheme",
        owned.hash_scheme.len(),
        HASH_SCHEME_MAX_BYTES,
    )?;
    over("ranks", owned.ranks.len(), limits.max_ranks)?;
    over("cursors", owned.cursors.len(), limits.max_ranks)?;
    over("empty_ranks", owned.empty_ranks.len(), limits.max_ranks)?;
    over("partial_ranks", owned.partial_ranks.len(), limits.max_ranks)?;
    over("nodes", owned.nodes.len(), limits.max_nodes)?;
    for rank in &owned.ranks {
        over("worker_url", rank.worker_url.len(), WORKER_URL_MAX_BYTES)?;
    }
    let rank_count = owned.ranks.len() as u64;
    let check_rank = |field: &'static str, rank: u32| {
        if u64::from(rank) < rank_count {
            Ok(rank)
        } else {
            Err(SnapshotDecodeError::RankOutOfRange {
                field,
                rank: u64::from(rank),
                ranks: rank_count,
            })
        }
    };
    for cursor in &owned.cursors {
        check_rank("cursor rank", cursor.rank)?;
    }
    for &rank in &owned.empty_ranks {
        check_rank("empty rank", rank)?;
    }
    for &rank in &owned.partial_ranks {
        check_rank("partial rank", rank)?;
    }
    let carriers: usize = owned.nodes.iter().map(|n| n.carriers.len()).sum();
    over(
        "carriers",
        carriers,
        limits.max_carriers.min(u32::MAX as usize),
    )?;

    let mut nodes = SnapshotNodes {
        parent: Vec::with_capacity(owned.nodes.len()),
        content_hash: Vec::with_capacity(owned.nodes.len()),
        carrier_end: Vec::with_capacity(owned.nodes.len()),
        carrier_rank: Vec::with_capacity(carriers),
        carrier_tiers: Vec::with_capacity(carriers),
        carrier_engine_hash: Vec::with_capacity(carriers),
    };
    for (index, node) in owned.nodes.into_iter().enumerate() {
        let parent = match node.parent {
            None => NO_PARENT,
            Some(p) if (p as usize) < index => p,
            Some(p) => {
                return Err(SnapshotDecodeError::OutOfRange {
                    field: "parent",
                    value: u64::from(p),
                });
            }
        };
        nodes.parent.push(parent);
        nodes.content_hash.push(node.hash.0);
        for carrier in node.carriers {
            nodes
                .carrier_rank
                .push(check_rank("carrier rank", carrier.rank)?);
            nodes.carrier_tiers.push(carrier.tiers);
            nodes.carrier_engine_hash.push(carrier.engine_hash.0);
        }
        nodes.carrier_end.push(nodes.carrier_rank.len() as u32);
    }
    Ok(IndexSnapshot {
        format: owned.format,
        hash_scheme: owned.hash_scheme,
        block_size: owned.block_size,
        producer_ready: owned.producer_ready,
        ranks: owned.ranks,
        cursors: owned.cursors,
        empty_ranks: owned.empty_ranks,
        partial_ranks: owned.partial_ranks,
        nodes,
    })
}

/// A 64-bit hash as 16 lowercase hex digits.
#[derive(Clone, Copy)]
struct Hex64(u64);

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

impl Serialize for Hex64 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut text = [0u8; 16];
        for (i, digit) in text.iter_mut().enumerate() {
            *digit = HEX_DIGITS[((self.0 >> (60 - 4 * i)) & 0xf) as usize];
        }
        // Only ASCII hex digits were written.
        let text = std::str::from_utf8(&text).map_err(serde::ser::Error::custom)?;
        serializer.serialize_str(text)
    }
}

impl<'de> Deserialize<'de> for Hex64 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HexVisitor;
        impl Visitor<'_> for HexVisitor {
            type Value = Hex64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a 64-bit hash as exactly 16 hex digits")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Hex64, E> {
                if text.len() != 16 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(E::invalid_value(de::Unexpected::Str(text), &self));
                }
                u64::from_str_radix(text, 16)
                    .map(Hex64)
                    .map_err(|_| E::invalid_value(de::Unexpected::Str(text), &self))
            }
        }
        deserializer.deserialize_str(HexVisitor)
    }
}

#[derive(Serialize)]
struct SnapshotView<'a> {
    json_version: u32,
    format: u32,
    hash_scheme: &'a str,
    block_size: u32,
    producer_ready: bool,
    ranks: &'a [RankRef],
    cursors: &'a [RankCursor],
    empty_ranks: &'a [u32],
    /// Omitted when empty, so a fully warm fleet's JSON is what it was before the field.
    #[serde(skip_serializing_if = "<[u32]>::is_empty")]
    partial_ranks: &'a [u32],
    node_count: usize,
    carried_blocks: usize,
    nodes: NodesView<'a>,
}

struct NodesView<'a>(&'a SnapshotNodes);

impl Serialize for NodesView<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let nodes = self.0;
        let mut seq = serializer.serialize_seq(Some(nodes.len()))?;
        let mut start = 0usize;
        for index in 0..nodes.len() {
            let end = nodes.carrier_end[index] as usize;
            seq.serialize_element(&NodeView {
                nodes,
                index,
                carriers: start..end,
            })?;
            start = end;
        }
        seq.end()
    }
}

struct NodeView<'a> {
    nodes: &'a SnapshotNodes,
    index: usize,
    carriers: std::ops::Range<usize>,
}

impl Serialize for NodeView<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let parent = self.nodes.parent[self.index];
        let mut node = serializer.serialize_struct("Node", 3)?;
        node.serialize_field("parent", &(parent != NO_PARENT).then_some(parent))?;
        node.serialize_field("hash", &Hex64(self.nodes.content_hash[self.index]))?;
        node.serialize_field(
            "carriers",
            &CarriersView {
                nodes: self.nodes,
                carriers: self.carriers.clone(),
            },
        )?;
        node.end()
    }
}

struct CarriersView<'a> {
    nodes: &'a SnapshotNodes,
    carriers: std::ops::Range<usize>,
}

impl Serialize for CarriersView<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.carriers.len()))?;
        for i in self.carriers.clone() {
            seq.serialize_element(&CarrierRecord {
                rank: self.nodes.carrier_rank[i],
                tiers: self.nodes.carrier_tiers[i],
                engine_hash: Hex64(self.nodes.carrier_engine_hash[i]),
            })?;
        }
        seq.end()
    }
}

#[derive(Serialize, Deserialize)]
struct CarrierRecord {
    rank: u32,
    tiers: u8,
    engine_hash: Hex64,
}

#[derive(Deserialize)]
struct NodeOwned {
    parent: Option<u32>,
    hash: Hex64,
    carriers: Vec<CarrierRecord>,
}

#[derive(Deserialize)]
struct SnapshotOwned {
    json_version: u32,
    format: u32,
    hash_scheme: String,
    block_size: u32,
    producer_ready: bool,
    ranks: Vec<RankRef>,
    cursors: Vec<RankCursor>,
    empty_ranks: Vec<u32>,
    /// Absent in the JSON of producers that predate it: no partial rank.
    #[serde(default)]
    partial_ranks: Vec<u32>,
    nodes: Vec<NodeOwned>,
}
