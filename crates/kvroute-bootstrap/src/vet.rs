//! Vetting: the only bridge from a sibling's `/internal/kv_snapshot` response bytes to a
//! snapshot the graft may use.
//!
//! A sibling may run another build, be booting itself, sit behind a proxy that cuts bodies short,
//! or be hostile, so everything it says is judged here, once: [`vet`] takes a whole body,
//! [`vet_stream`] a body still arriving (the fetch's path: decoding overlaps the transfer and the
//! body is never held whole), and both end in the same checks. First decoding in the encoding the
//! fetch negotiated (bounded by [`DecodeLimits`]; the MAC checked before anything is inflated for
//! a whole body, and before anything decoded is used for a stream, see
//! `kvroute_snapshot::stream`), then the header (format, hash scheme, block size), the structure
//! (`kvroute-index`'s own validation: parents precede children, indices in range, no duplicate
//! ranks or cursors), the producer's readiness, and finally the rank table: ranks this replica
//! does not serve are dropped, nodes left without a carrier are pruned unless a kept descendant
//! needs them, and the kept ranks are named by their LOCAL ids.
//!
//! Every refusal is a typed [`Rejection`] with a class: permanent ones (the peer runs an
//! incompatible build or sends a broken body even though its checksum held) mean that peer is
//! never fetched again this boot; transient ones (not ready, cold, knows none of our ranks, a
//! body cut short) mean "ask again later".
//!
//! The per-rank answer is a [`Coverage`], and it is deliberately stingy: a rank is
//! [`Coverage::Covered`] only when it carries nodes AND has a cursor (the watermark the splice is
//! proven against), [`Coverage::Empty`] only when a ready producer lists it in `empty_ranks`,
//! and [`Coverage::Unknown`] otherwise. A rank that carries nothing while the producer does not
//! say it is empty is never taken as covered: the worst failure of the anchor design is a new
//! replica inheriting an empty index from another new replica during a rolling update and
//! reporting success. A covered rank the producer lists in `partial_ranks` is covered with
//! `partial: true`: the producer's view of it does not reach back to the publisher's origin, and
//! whoever grafts it must say so (outcome `warm_partial`) instead of `warm`.

use std::collections::{HashMap, HashSet};

use kvroute_index::{RankId, RestoreError, retain_ranks, validate_snapshot};
use kvroute_snapshot::{
    BINARY_CONTENT_TYPE, Compression, DecodeLimits, JSON_CONTENT_TYPE, SnapshotDecodeError,
    decode_binary, decode_binary_stream, decode_json, decompress_bounded, read_bounded,
};
use kvroute_wire::snapshot::{IndexSnapshot, RankRef};
use thiserror::Error;

/// The media type of a snapshot body, from its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BodyMedia {
    /// The compact binary; compression and MAC live inside its envelope.
    Binary,
    /// The JSON encoding; it carries no MAC.
    Json,
}

/// How a response body is encoded: its media type and the HTTP `Content-Encoding` around it
/// (a producer compresses JSON that way; the binary normally has none, but a proxy may add one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BodyEncoding {
    pub media: BodyMedia,
    pub content_encoding: Compression,
}

impl BodyEncoding {
    /// The binary as the producer sends it: no `Content-Encoding`.
    pub fn binary() -> Self {
        BodyEncoding {
            media: BodyMedia::Binary,
            content_encoding: Compression::None,
        }
    }

    /// JSON under the given `Content-Encoding`.
    pub fn json(content_encoding: Compression) -> Self {
        BodyEncoding {
            media: BodyMedia::Json,
            content_encoding,
        }
    }

    /// Reads the two response headers. Header values are matched case-insensitively and
    /// `Content-Type` parameters (`; charset=...`) are ignored.
    pub fn from_headers(
        content_type: Option<&str>,
        content_encoding: Option<&str>,
    ) -> Result<Self, Rejection> {
        let media_raw = content_type
            .and_then(|t| t.split(';').next())
            .unwrap_or("")
            .trim();
        let media = if media_raw.eq_ignore_ascii_case(BINARY_CONTENT_TYPE) {
            BodyMedia::Binary
        } else if media_raw.eq_ignore_ascii_case(JSON_CONTENT_TYPE) {
            BodyMedia::Json
        } else {
            return Err(Rejection::UnexpectedMedia {
                content_type: truncated(media_raw),
            });
        };
        let encoding_raw = content_encoding.unwrap_or("").trim();
        let content_encoding =
            if encoding_raw.is_empty() || encoding_raw.eq_ignore_ascii_case("identity") {
                Compression::None
            } else if encoding_raw.eq_ignore_ascii_case("gzip")
                || encoding_raw.eq_ignore_ascii_case("x-gzip")
            {
                Compression::Gzip
            } else if encoding_raw.eq_ignore_ascii_case("zstd") {
                Compression::Zstd
            } else {
                return Err(Rejection::UnsupportedContentEncoding {
                    content_encoding: truncated(encoding_raw),
                });
            };
        Ok(BodyEncoding {
            media,
            content_encoding,
        })
    }
}

/// Longest header value echoed back inside a [`Rejection`], so a hostile header cannot make an
/// error (and the log line it ends up in) arbitrarily large.
pub const REJECTION_ECHO_MAX_BYTES: usize = 128;

fn truncated(s: &str) -> String {
    let mut end = s.len().min(REJECTION_ECHO_MAX_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// What the consumer expects of a snapshot.
#[derive(Debug, Clone, Copy)]
pub struct Expectations<'a> {
    /// This replica's block size; any other is refused (hashes of other block sizes never
    /// match ours).
    pub block_size: u32,
    /// The ranks this replica serves right now, with their local ids. Ranks of the snapshot not
    /// in this list are dropped.
    pub live: &'a [(RankRef, RankId)],
    /// The internal auth token: with it, only a binary body whose MAC verifies is accepted.
    pub mac_key: Option<&'a [u8]>,
    pub limits: DecodeLimits,
}

/// Why a snapshot was refused. [`Rejection::is_permanent`] says whether the peer that sent it
/// may be asked again this boot.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Rejection {
    #[error("unexpected Content-Type {content_type:?}")]
    UnexpectedMedia { content_type: String },
    #[error("unsupported Content-Encoding {content_encoding:?}")]
    UnsupportedContentEncoding { content_encoding: String },
    #[error("not a snapshot envelope this build reads: {0}")]
    Encoding(SnapshotDecodeError),
    #[error("the body is damaged (cut short or corrupted in transit): {0}")]
    Damaged(SnapshotDecodeError),
    #[error("the body breaks its encoding's rules: {0}")]
    Malformed(SnapshotDecodeError),
    #[error("the snapshot is over the decode limit of {limit_bytes} bytes")]
    TooLarge { limit_bytes: usize },
    #[error("the snapshot's MAC is refused: {0}")]
    Mac(SnapshotDecodeError),
    #[error("a JSON snapshot carries no MAC, but a key is configured")]
    Unauthenticated,
    #[error("snapshot format {found}, this build reads {expected}")]
    Format { found: u32, expected: u32 },
    #[error("snapshot hash scheme {found:?}, this build uses {expected:?}")]
    HashScheme { found: String, expected: String },
    #[error("snapshot block size {found}, this replica uses {expected}")]
    BlockSize { found: u32, expected: u32 },
    #[error("the snapshot's structure is invalid: {0}")]
    Structure(RestoreError),
    #[error("the cursor of snapshot rank {rank} has negative seq {seq}")]
    NegativeCursor { rank: u32, seq: i64 },
    #[error("the producer is not ready (its own index is not trustworthy yet)")]
    NotReady,
    #[error("the producer is cold: no nodes and no rank it can vouch is empty")]
    Cold,
    #[error("the snapshot says nothing about any rank this replica serves")]
    CoversNothing,
    /// Not a body at all: the peer was misaddressed (it refused this replica's token, or the URL
    /// is a replica's public listener); `reason` says which and what to fix.
    #[error("{reason}")]
    Misdirected { reason: String },
}

impl Rejection {
    /// Permanent: the peer runs an incompatible build, signs with another key, or sent a body
    /// that decoded past its checksum yet breaks the rules, so asking again would get the same
    /// answer. Transient: the peer may have something later, or the body was cut short.
    ///
    /// A body over our decode limit is permanent: the peer's index is bigger than this replica
    /// accepts, and re-downloading it every sit-out would load the peer for nothing. So is a
    /// misaddressed peer: both replicas read their tokens and ports once, at start-up.
    pub fn is_permanent(&self) -> bool {
        match self {
            Rejection::UnexpectedMedia { .. }
            | Rejection::UnsupportedContentEncoding { .. }
            | Rejection::Encoding(_)
            | Rejection::Malformed(_)
            | Rejection::TooLarge { .. }
            | Rejection::Mac(_)
            | Rejection::Unauthenticated
            | Rejection::Format { .. }
            | Rejection::HashScheme { .. }
            | Rejection::BlockSize { .. }
            | Rejection::Structure(_)
            | Rejection::NegativeCursor { .. }
            | Rejection::Misdirected { .. } => true,
            Rejection::Damaged(_)
            | Rejection::NotReady
            | Rejection::Cold
            | Rejection::CoversNothing => false,
        }
    }

    /// Short stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Rejection::UnexpectedMedia { .. } => "unexpected_media",
            Rejection::UnsupportedContentEncoding { .. } => "unsupported_content_encoding",
            Rejection::Encoding(_) => "encoding",
            Rejection::Damaged(_) => "damaged",
            Rejection::Malformed(_) => "malformed",
            Rejection::TooLarge { .. } => "too_large",
            Rejection::Mac(_) => "mac",
            Rejection::Unauthenticated => "unauthenticated",
            Rejection::Format { .. } => "format",
            Rejection::HashScheme { .. } => "hash_scheme",
            Rejection::BlockSize { .. } => "block_size",
            Rejection::Structure(_) => "structure",
            Rejection::NegativeCursor { .. } => "negative_cursor",
            Rejection::NotReady => "not_ready",
            Rejection::Cold => "cold",
            Rejection::CoversNothing => "covers_nothing",
            Rejection::Misdirected { .. } => "misdirected",
        }
    }
}

fn decode_rejection(e: SnapshotDecodeError) -> Rejection {
    match e {
        SnapshotDecodeError::InputTooLarge { limit_bytes, .. }
        | SnapshotDecodeError::TooLarge { limit_bytes } => Rejection::TooLarge { limit_bytes },
        SnapshotDecodeError::MacMissing
        | SnapshotDecodeError::MacMismatch
        | SnapshotDecodeError::MacKeyTooShort { .. } => Rejection::Mac(e),
        SnapshotDecodeError::BadMagic
        | SnapshotDecodeError::UnsupportedVersion { .. }
        | SnapshotDecodeError::UnknownFlags { .. }
        | SnapshotDecodeError::UnknownCompression { .. } => Rejection::Encoding(e),
        // JSON has no checksum, so a syntax error is what a body cut short looks like.
        SnapshotDecodeError::Truncated { .. }
        | SnapshotDecodeError::ChecksumMismatch { .. }
        | SnapshotDecodeError::Decompress { .. }
        | SnapshotDecodeError::Json { .. } => Rejection::Damaged(e),
        SnapshotDecodeError::VarintOverflow { .. }
        | SnapshotDecodeError::CountOverLimit { .. }
        | SnapshotDecodeError::OutOfRange { .. }
        | SnapshotDecodeError::BadUtf8 { .. }
        | SnapshotDecodeError::SameAsParentOnRoot { .. }
        | SnapshotDecodeError::RankOutOfRange { .. }
        | SnapshotDecodeError::CountMismatch { .. }
        | SnapshotDecodeError::TrailingBytes { .. } => Rejection::Malformed(e),
    }
}

fn restore_rejection(e: RestoreError) -> Rejection {
    match e {
        RestoreError::Format { found, expected } => Rejection::Format { found, expected },
        RestoreError::HashScheme { found, expected } => Rejection::HashScheme { found, expected },
        RestoreError::BlockSize { found, expected } => Rejection::BlockSize { found, expected },
        other => Rejection::Structure(other),
    }
}

/// One flag per rank, set for each rank `indices` names (an index past `ranks` is ignored).
fn marked(ranks: usize, indices: &[u32]) -> Vec<bool> {
    let mut flags = vec![false; ranks];
    for &r in indices {
        if let Some(slot) = flags.get_mut(r as usize) {
            *slot = true;
        }
    }
    flags
}

/// What a vetted snapshot says about one local rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Coverage {
    /// The rank carries nodes and has a cursor `(seq, ts)`: the graft's watermark. `partial`:
    /// the producer lists it in `partial_ranks`, so its history there does not reach back to the
    /// publisher's seq 0 and a graft of it is only as complete as the producer's view.
    Covered { cursor: (i64, f64), partial: bool },
    /// A ready producer lists the rank in `empty_ranks` (and not in `partial_ranks`, which would
    /// contradict it): it holds nothing for it.
    Empty,
    /// Anything else: not in the snapshot, carries nothing without being listed empty, or
    /// carries nodes but has no cursor (its stream restarted during the producer's walk).
    Unknown,
}

impl Coverage {
    pub fn is_covered(&self) -> bool {
        matches!(self, Coverage::Covered { .. })
    }

    /// Covered, with the producer's whole history of the rank.
    pub fn is_complete_cover(&self) -> bool {
        matches!(self, Coverage::Covered { partial: false, .. })
    }
}

/// A snapshot that passed [`vet`]: only this replica's live ranks remain, and
/// [`VettedSnapshot::local_ids`] names each of them (parallel to `snapshot().ranks`).
#[derive(Debug, Clone, PartialEq)]
pub struct VettedSnapshot {
    /// Boxed so the verdicts and answers that carry a vetted snapshot stay small to move.
    snapshot: Box<IndexSnapshot>,
    local: Vec<RankId>,
    coverage: Vec<Coverage>,
    /// (local id, position in `local`), sorted by id.
    by_local: Vec<(RankId, u32)>,
    dropped_ranks: usize,
    pruned_nodes: usize,
}

/// Decodes `body` as `encoding` says and vets it against `expect`; see the module doc for the
/// checks and their order (permanent checks before transient ones, so an incompatible peer is
/// recognised as such even while it is not ready).
pub fn vet(
    body: &[u8],
    encoding: BodyEncoding,
    expect: &Expectations<'_>,
) -> Result<VettedSnapshot, Rejection> {
    let snapshot = decode(body, encoding, expect)?;
    vet_decoded(snapshot, expect)
}

/// [`vet`] for a body read from `body` as it arrives: [`decode_stream`], then [`vet_decoded`].
pub fn vet_stream<R: std::io::Read>(
    body: R,
    encoding: BodyEncoding,
    expect: &Expectations<'_>,
) -> Result<VettedSnapshot, Rejection> {
    let snapshot = decode_stream(body, encoding, &expect.limits, expect.mac_key)?;
    vet_decoded(snapshot, expect)
}

/// The decoding half of [`vet_stream`], for a caller that must read this replica's live ranks
/// only once the body has arrived (ranks register while a large body is on the wire): decode
/// here, then hand the result to [`vet_decoded`] with the live set read at that moment. A binary
/// body without `Content-Encoding` (what producers send) is decoded while it is read; any other
/// body is first read whole, within the same byte limit, and decoded as [`vet`] does. An I/O
/// error from `body` is a transient rejection naming it (the fetch that feeds `body` usually
/// knows the cause better and reports that instead).
pub fn decode_stream<R: std::io::Read>(
    body: R,
    encoding: BodyEncoding,
    limits: &DecodeLimits,
    mac_key: Option<&[u8]>,
) -> Result<IndexSnapshot, Rejection> {
    if encoding.media == BodyMedia::Binary && encoding.content_encoding == Compression::None {
        decode_binary_stream(body, limits, mac_key).map_err(decode_rejection)
    } else {
        let whole = read_bounded(body, limits.max_bytes).map_err(decode_rejection)?;
        let expect = Expectations {
            block_size: 0,
            live: &[],
            mac_key,
            limits: *limits,
        };
        decode(&whole, encoding, &expect)
    }
}

fn decode(
    body: &[u8],
    encoding: BodyEncoding,
    expect: &Expectations<'_>,
) -> Result<IndexSnapshot, Rejection> {
    if encoding.media == BodyMedia::Json && expect.mac_key.is_some() {
        return Err(Rejection::Unauthenticated);
    }
    let plain = decompress_bounded(body, encoding.content_encoding, expect.limits.max_bytes)
        .map_err(decode_rejection)?;
    match encoding.media {
        BodyMedia::Binary => decode_binary(&plain, &expect.limits, expect.mac_key),
        BodyMedia::Json => decode_json(&plain, &expect.limits),
    }
    .map_err(decode_rejection)
}

/// Every check [`vet`] makes after decoding; only for a snapshot that [`decode_stream`] (or
/// [`vet`]'s own decode) produced from a sibling's bytes.
pub fn vet_decoded(
    mut snapshot: IndexSnapshot,
    expect: &Expectations<'_>,
) -> Result<VettedSnapshot, Rejection> {
    validate_snapshot(&snapshot, expect.block_size).map_err(restore_rejection)?;
    if let Some(c) = snapshot.cursors.iter().find(|c| c.seq < 0) {
        return Err(Rejection::NegativeCursor {
            rank: c.rank,
            seq: c.seq,
        });
    }
    if !snapshot.producer_ready {
        return Err(Rejection::NotReady);
    }
    if snapshot.nodes.is_empty() && snapshot.empty_ranks.is_empty() {
        return Err(Rejection::Cold);
    }
    let live: HashMap<&RankRef, RankId> = expect.live.iter().map(|(r, id)| (r, *id)).collect();
    // retain_ranks keeps ranks in table order, so the kept ranks' local ids, read in the same
    // order beforehand, line up with the retained table.
    let local: Vec<RankId> = snapshot
        .ranks
        .iter()
        .filter_map(|r| live.get(r).copied())
        .collect();
    let ranks_before = snapshot.ranks.len();
    let nodes_before = snapshot.nodes.len();
    retain_ranks(&mut snapshot, |r| live.contains_key(r)).map_err(restore_rejection)?;
    let dropped_ranks = ranks_before - snapshot.ranks.len();
    let pruned_nodes = nodes_before - snapshot.nodes.len();
    let vetted =
        VettedSnapshot::from_retained(Box::new(snapshot), local, dropped_ranks, pruned_nodes)?;
    if !vetted
        .coverage
        .iter()
        .any(|c| !matches!(c, Coverage::Unknown))
    {
        return Err(Rejection::CoversNothing);
    }
    Ok(vetted)
}

impl VettedSnapshot {
    fn from_retained(
        snapshot: Box<IndexSnapshot>,
        local: Vec<RankId>,
        dropped_ranks: usize,
        pruned_nodes: usize,
    ) -> Result<Self, Rejection> {
        let ranks = snapshot.ranks.len();
        if local.len() != ranks {
            return Err(Rejection::Structure(RestoreError::ColumnLength {
                column: "ranks",
                len: local.len(),
                expected: ranks,
            }));
        }
        // Indices below were validated by validate_structure (run again by retain_ranks), so
        // `get_mut` never misses; it is used anyway so a broken invariant cannot panic.
        let carries = marked(ranks, &snapshot.nodes.carrier_rank);
        let mut cursor = vec![None; ranks];
        for c in &snapshot.cursors {
            if let Some(slot) = cursor.get_mut(c.rank as usize) {
                *slot = Some((c.seq, c.ts));
            }
        }
        let listed_empty = marked(ranks, &snapshot.empty_ranks);
        let listed_partial = marked(ranks, &snapshot.partial_ranks);
        let coverage: Vec<Coverage> = (0..ranks)
            .map(|i| match (carries[i], cursor[i], listed_empty[i]) {
                (true, Some(cursor), _) => Coverage::Covered {
                    cursor,
                    partial: listed_partial[i],
                },
                (true, None, _) => Coverage::Unknown,
                // "Empty" is a claim about the whole history; a producer that also calls that
                // history partial contradicts itself and is believed in neither.
                (false, _, true) if !listed_partial[i] => Coverage::Empty,
                (false, _, _) => Coverage::Unknown,
            })
            .collect();
        let mut by_local: Vec<(RankId, u32)> = local
            .iter()
            .enumerate()
            .map(|(i, id)| (*id, i as u32))
            .collect();
        by_local.sort_unstable();
        Ok(VettedSnapshot {
            snapshot,
            local,
            coverage,
            by_local,
            dropped_ranks,
            pruned_nodes,
        })
    }

    /// What the snapshot says about local rank `rank`.
    pub fn coverage(&self, rank: RankId) -> Coverage {
        match self.by_local.binary_search_by_key(&rank, |(id, _)| *id) {
            Ok(pos) => self.coverage[self.by_local[pos].1 as usize],
            Err(_) => Coverage::Unknown,
        }
    }

    /// Every kept rank with its coverage, in snapshot table order.
    pub fn ranks(&self) -> impl Iterator<Item = (RankId, Coverage)> + '_ {
        self.local
            .iter()
            .copied()
            .zip(self.coverage.iter().copied())
    }

    /// True when at least one of `ranks` is [`Coverage::Covered`].
    pub fn covers_any(&self, ranks: impl IntoIterator<Item = RankId>) -> bool {
        ranks.into_iter().any(|r| self.coverage(r).is_covered())
    }

    /// The snapshot, its rank table reduced to live ranks (`local_ids()[i]` is `ranks[i]`).
    pub fn snapshot(&self) -> &IndexSnapshot {
        &self.snapshot
    }

    pub fn local_ids(&self) -> &[RankId] {
        &self.local
    }

    /// Ranks of the producer's table this replica does not serve, dropped by vetting.
    pub fn dropped_ranks(&self) -> usize {
        self.dropped_ranks
    }

    /// Nodes pruned because only dropped ranks carried them (and no kept descendant needed them).
    pub fn pruned_nodes(&self) -> usize {
        self.pruned_nodes
    }

    pub fn into_parts(self) -> (IndexSnapshot, Vec<RankId>) {
        (*self.snapshot, self.local)
    }

    /// The snapshot reduced to the ranks among `ranks` that it COVERS, for the graft: a rank
    /// without a watermark must not receive nodes, since nothing could prove they still hold.
    /// Nodes left without carriers are pruned as in [`vet`]. Consumes `self`, so a large
    /// snapshot is filtered without a copy.
    pub fn into_graft(self, ranks: &[RankId]) -> Result<VettedSnapshot, Rejection> {
        let wanted: HashSet<RankId> = ranks
            .iter()
            .copied()
            .filter(|r| self.coverage(*r).is_covered())
            .collect();
        if self.local.iter().all(|id| wanted.contains(id)) {
            // Every rank of the snapshot is grafted: nothing to drop, and `vet` already pruned
            // what no rank carries. Skipping the pass matters at scale (a whole-table walk).
            return Ok(self);
        }
        let keep_refs: HashSet<RankRef> = self
            .snapshot
            .ranks
            .iter()
            .zip(&self.local)
            .filter(|(_, id)| wanted.contains(id))
            .map(|(r, _)| r.clone())
            .collect();
        let local: Vec<RankId> = self
            .local
            .iter()
            .copied()
            .filter(|id| wanted.contains(id))
            .collect();
        let VettedSnapshot {
            mut snapshot,
            dropped_ranks,
            pruned_nodes,
            ..
        } = self;
        let ranks_before = snapshot.ranks.len();
        let nodes_before = snapshot.nodes.len();
        retain_ranks(&mut snapshot, |r| keep_refs.contains(r)).map_err(restore_rejection)?;
        let dropped = dropped_ranks + (ranks_before - snapshot.ranks.len());
        let pruned = pruned_nodes + (nodes_before - snapshot.nodes.len());
        VettedSnapshot::from_retained(snapshot, local, dropped, pruned)
    }

    /// [`VettedSnapshot::into_graft`] on a copy, for when the full snapshot is still needed.
    pub fn graft_for(&self, ranks: &[RankId]) -> Result<VettedSnapshot, Rejection> {
        self.clone().into_graft(ranks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_index::hash::HASH_SCHEME;
    use kvroute_snapshot::{EncodeOptions, encode_binary_to_vec, encode_json_to_vec};
    use kvroute_wire::snapshot::{NO_PARENT, RankCursor, SNAPSHOT_FORMAT, SnapshotNodes};

    const BLOCK: u32 = 16;
    const KEY: &[u8] = b"bootstrap-test-shared-secret-01";

    fn rank(i: u32) -> RankRef {
        RankRef {
            worker_url: format!("http://10.0.0.{i}:8000"),
            dp_rank: 0,
        }
    }

    /// Three producer ranks (0, 1, 2). Nodes: 0 root carried by rank 0 and 1; 1 child of 0
    /// carried by rank 2 only; 2 child of 1 carried by rank 0; 3 root carried by rank 2 only.
    /// Cursors for ranks 0 and 2.
    fn snapshot() -> IndexSnapshot {
        let mut nodes = SnapshotNodes::default();
        let mut push = |parent: u32, hash: u64, carriers: &[u32]| {
            nodes.parent.push(parent);
            nodes.content_hash.push(hash);
            for &c in carriers {
                nodes.carrier_rank.push(c);
                nodes.carrier_tiers.push(1);
                nodes.carrier_engine_hash.push(hash ^ u64::from(c));
            }
            nodes.carrier_end.push(nodes.carrier_rank.len() as u32);
        };
        push(NO_PARENT, 0xa0, &[0, 1]);
        push(0, 0xa1, &[2]);
        push(1, 0xa2, &[0]);
        push(NO_PARENT, 0xb0, &[2]);
        IndexSnapshot {
            format: SNAPSHOT_FORMAT,
            hash_scheme: HASH_SCHEME.to_string(),
            block_size: BLOCK,
            producer_ready: true,
            ranks: vec![rank(0), rank(1), rank(2)],
            cursors: vec![
                RankCursor {
                    rank: 0,
                    seq: 5,
                    ts: 1.5,
                },
                RankCursor {
                    rank: 2,
                    seq: 9,
                    ts: 2.5,
                },
            ],
            empty_ranks: vec![],
            partial_ranks: vec![],
            nodes,
        }
    }

    fn live_all() -> Vec<(RankRef, RankId)> {
        vec![
            (rank(0), RankId(10)),
            (rank(1), RankId(11)),
            (rank(2), RankId(12)),
        ]
    }

    fn expect(live: &[(RankRef, RankId)]) -> Expectations<'_> {
        Expectations {
            block_size: BLOCK,
            live,
            mac_key: None,
            limits: DecodeLimits::default(),
        }
    }

    fn binary(s: &IndexSnapshot) -> Vec<u8> {
        encode_binary_to_vec(s, &EncodeOptions::default()).unwrap()
    }

    fn vet_binary(
        s: &IndexSnapshot,
        live: &[(RankRef, RankId)],
    ) -> Result<VettedSnapshot, Rejection> {
        vet(&binary(s), BodyEncoding::binary(), &expect(live))
    }

    #[test]
    fn a_valid_snapshot_vets_with_ranks_named_by_local_id() {
        let v = vet_binary(&snapshot(), &live_all()).unwrap();
        assert_eq!(v.local_ids(), &[RankId(10), RankId(11), RankId(12)]);
        assert_eq!(
            v.coverage(RankId(10)),
            Coverage::Covered {
                cursor: (5, 1.5),
                partial: false
            }
        );
        assert_eq!(
            v.coverage(RankId(12)),
            Coverage::Covered {
                cursor: (9, 2.5),
                partial: false
            }
        );
        assert_eq!(v.snapshot().nodes.len(), 4);
        assert_eq!(v.dropped_ranks(), 0);
        assert_eq!(v.pruned_nodes(), 0);
    }

    #[test]
    fn a_rank_the_producer_lists_partial_is_covered_partially_and_never_empty() {
        let mut s = snapshot();
        // Rank 0 carries and has a cursor; rank 1 is made to carry nothing (its one carrier
        // goes to rank 2) and is listed empty as well as partial.
        s.nodes.carrier_rank[1] = 2;
        s.empty_ranks = vec![1];
        s.partial_ranks = vec![0, 1];
        let v = vet_binary(&s, &live_all()).unwrap();
        assert_eq!(
            v.coverage(RankId(10)),
            Coverage::Covered {
                cursor: (5, 1.5),
                partial: true
            }
        );
        assert!(!v.coverage(RankId(10)).is_complete_cover());
        assert!(v.coverage(RankId(12)).is_complete_cover());
        assert_eq!(
            v.coverage(RankId(11)),
            Coverage::Unknown,
            "empty and partial contradict each other"
        );
        // Remapping to local ids keeps the partial mark on the rank it names.
        let kept = vet_binary(&s, &live_all()[..1]).unwrap();
        assert_eq!(kept.snapshot().partial_ranks, vec![0]);
    }

    #[test]
    fn json_under_every_content_encoding_vets_like_the_binary() {
        let s = snapshot();
        let expected = vet_binary(&s, &live_all()).unwrap();
        let json = encode_json_to_vec(&s).unwrap();
        for c in Compression::ALL {
            let mut w = kvroute_snapshot::CompressingWriter::new(Vec::new(), c).unwrap();
            std::io::Write::write_all(&mut w, &json).unwrap();
            let body = w.finish().unwrap();
            let v = vet(&body, BodyEncoding::json(c), &expect(&live_all())).unwrap();
            assert_eq!(v, expected, "{c:?}");
        }
    }

    #[test]
    fn a_binary_compressed_inside_its_envelope_vets() {
        let s = snapshot();
        for c in Compression::ALL {
            let body = encode_binary_to_vec(
                &s,
                &EncodeOptions {
                    compression: c,
                    mac_key: None,
                },
            )
            .unwrap();
            let v = vet(&body, BodyEncoding::binary(), &expect(&live_all())).unwrap();
            assert!(v.covers_any([RankId(10)]), "{c:?}");
        }
    }

    #[test]
    fn another_format_is_a_permanent_rejection() {
        let mut s = snapshot();
        s.format = SNAPSHOT_FORMAT + 1;
        let r = vet_binary(&s, &live_all()).unwrap_err();
        assert!(matches!(r, Rejection::Format { .. }), "{r:?}");
        assert!(r.is_permanent());
    }

    #[test]
    fn another_hash_scheme_is_a_permanent_rejection() {
        let mut s = snapshot();
        s.hash_scheme = "sha256-chain".into();
        let r = vet_binary(&s, &live_all()).unwrap_err();
        assert!(matches!(r, Rejection::HashScheme { .. }), "{r:?}");
        assert!(r.is_permanent());
    }

    #[test]
    fn another_block_size_is_a_permanent_rejection_even_from_a_producer_not_ready() {
        let mut s = snapshot();
        s.block_size = 32;
        s.producer_ready = false;
        let r = vet_binary(&s, &live_all()).unwrap_err();
        assert_eq!(
            r,
            Rejection::BlockSize {
                found: 32,
                expected: BLOCK
            }
        );
        assert!(r.is_permanent());
    }

    #[test]
    fn a_producer_not_ready_is_a_transient_rejection() {
        let mut s = snapshot();
        s.producer_ready = false;
        let r = vet_binary(&s, &live_all()).unwrap_err();
        assert_eq!(r, Rejection::NotReady);
        assert!(!r.is_permanent());
    }

    #[test]
    fn a_ready_producer_without_nodes_or_empty_ranks_is_cold() {
        let mut s = snapshot();
        s.nodes = SnapshotNodes::default();
        let r = vet_binary(&s, &live_all()).unwrap_err();
        assert_eq!(r, Rejection::Cold);
        assert!(!r.is_permanent());
    }

    #[test]
    fn a_parent_after_its_child_is_a_permanent_structure_rejection() {
        let mut s = snapshot();
        s.nodes.parent[1] = 3;
        // The binary encoder refuses such a snapshot, so it travels as JSON built by hand.
        let json = encode_json_to_vec(&snapshot())
            .map(|b| String::from_utf8(b).unwrap())
            .unwrap()
            .replacen("\"parent\":0", "\"parent\":3", 1);
        let r = vet(
            json.as_bytes(),
            BodyEncoding::json(Compression::None),
            &expect(&live_all()),
        )
        .unwrap_err();
        assert!(r.is_permanent(), "{r:?}");
        assert!(
            matches!(r, Rejection::Structure(_) | Rejection::Malformed(_)),
            "{r:?}"
        );
        let direct = vet_decoded(s, &expect(&live_all())).unwrap_err();
        assert!(
            matches!(
                direct,
                Rejection::Structure(RestoreError::ParentNotBefore { node: 1, parent: 3 })
            ),
            "{direct:?}"
        );
    }

    #[test]
    fn a_carrier_rank_out_of_range_is_a_permanent_rejection() {
        let mut s = snapshot();
        s.nodes.carrier_rank[0] = 7;
        let r = vet_decoded(s, &expect(&live_all())).unwrap_err();
        assert!(
            matches!(
                r,
                Rejection::Structure(RestoreError::CarrierRankOutOfRange { .. })
            ),
            "{r:?}"
        );
        assert!(r.is_permanent());
    }

    #[test]
    fn a_cursor_rank_out_of_range_is_a_permanent_rejection() {
        let mut s = snapshot();
        s.cursors[0].rank = 3;
        let r = vet_decoded(s, &expect(&live_all())).unwrap_err();
        assert!(
            matches!(
                r,
                Rejection::Structure(RestoreError::CursorRankOutOfRange { .. })
            ),
            "{r:?}"
        );
    }

    #[test]
    fn a_duplicate_rank_is_a_permanent_rejection() {
        let mut s = snapshot();
        s.ranks[1] = rank(0);
        let r = vet_binary(&s, &live_all()).unwrap_err();
        assert!(
            matches!(r, Rejection::Structure(RestoreError::DuplicateRank { .. })),
            "{r:?}"
        );
        assert!(r.is_permanent());
    }

    #[test]
    fn a_duplicate_cursor_is_a_permanent_rejection() {
        let mut s = snapshot();
        s.cursors[1].rank = 0;
        let r = vet_binary(&s, &live_all()).unwrap_err();
        assert!(
            matches!(
                r,
                Rejection::Structure(RestoreError::DuplicateCursor { .. })
            ),
            "{r:?}"
        );
    }

    #[test]
    fn a_negative_cursor_is_a_permanent_rejection() {
        let mut s = snapshot();
        s.cursors[0].seq = -1;
        let r = vet_binary(&s, &live_all()).unwrap_err();
        assert_eq!(r, Rejection::NegativeCursor { rank: 0, seq: -1 });
        assert!(r.is_permanent());
    }

    #[test]
    fn ranks_outside_the_live_set_are_dropped_and_nodes_only_they_carried_are_pruned() {
        // Serve ranks 0 and 1 only: node 3 (rank 2 only) goes; node 1 (rank 2 only) stays
        // because node 2 below it is carried by rank 0.
        let live = vec![(rank(0), RankId(20)), (rank(1), RankId(21))];
        let v = vet_binary(&snapshot(), &live).unwrap();
        assert_eq!(v.local_ids(), &[RankId(20), RankId(21)]);
        assert_eq!(v.dropped_ranks(), 1);
        assert_eq!(v.pruned_nodes(), 1);
        let n = &v.snapshot().nodes;
        assert_eq!(n.content_hash, vec![0xa0, 0xa1, 0xa2]);
        assert_eq!(n.parent, vec![NO_PARENT, 0, 1]);
        assert_eq!(n.carrier_end, vec![2, 2, 3], "node 1 kept with no carrier");
        assert_eq!(v.coverage(RankId(12)), Coverage::Unknown, "not ours");
        assert!(v.snapshot().cursors.iter().all(|c| c.rank < 2));
    }

    #[test]
    fn a_rank_carrying_nothing_and_not_listed_empty_is_unknown_even_with_a_cursor() {
        let mut s = snapshot();
        // Rank 1 carries node 0 in the fixture; take that away and give it a cursor.
        s.nodes.carrier_rank.remove(1);
        s.nodes.carrier_tiers.remove(1);
        s.nodes.carrier_engine_hash.remove(1);
        for e in &mut s.nodes.carrier_end {
            *e -= 1;
        }
        s.cursors.push(RankCursor {
            rank: 1,
            seq: 3,
            ts: 0.5,
        });
        let v = vet_binary(&s, &live_all()).unwrap();
        assert_eq!(v.coverage(RankId(11)), Coverage::Unknown);
        assert!(!v.covers_any([RankId(11)]));
    }

    #[test]
    fn a_rank_listed_in_empty_ranks_by_a_ready_producer_is_empty() {
        let mut s = snapshot();
        s.ranks.push(rank(3));
        s.empty_ranks.push(3);
        let mut live = live_all();
        live.push((rank(3), RankId(13)));
        let v = vet_binary(&s, &live).unwrap();
        assert_eq!(v.coverage(RankId(13)), Coverage::Empty);
        assert!(!v.covers_any([RankId(13)]));
    }

    #[test]
    fn only_empty_ranks_and_no_nodes_still_vets_so_the_rank_can_settle_empty() {
        let s = IndexSnapshot {
            nodes: SnapshotNodes::default(),
            cursors: vec![],
            empty_ranks: vec![0],
            partial_ranks: vec![],
            ranks: vec![rank(0)],
            ..snapshot()
        };
        let v = vet_binary(&s, &live_all()).unwrap();
        assert_eq!(v.coverage(RankId(10)), Coverage::Empty);
    }

    #[test]
    fn a_rank_with_nodes_but_no_cursor_is_unknown() {
        let mut s = snapshot();
        s.cursors.retain(|c| c.rank != 0);
        let v = vet_binary(&s, &live_all()).unwrap();
        assert_eq!(v.coverage(RankId(10)), Coverage::Unknown);
    }

    #[test]
    fn a_snapshot_that_knows_none_of_our_ranks_covers_nothing() {
        let live = vec![(rank(9), RankId(1))];
        let r = vet_binary(&snapshot(), &live).unwrap_err();
        assert_eq!(r, Rejection::CoversNothing);
        assert!(!r.is_permanent());
    }

    #[test]
    fn an_unsigned_binary_is_refused_when_a_key_is_configured() {
        let live = live_all();
        let e = Expectations {
            mac_key: Some(KEY),
            ..expect(&live)
        };
        let r = vet(&binary(&snapshot()), BodyEncoding::binary(), &e).unwrap_err();
        assert_eq!(r, Rejection::Mac(SnapshotDecodeError::MacMissing));
        assert!(r.is_permanent());
    }

    #[test]
    fn a_binary_signed_with_another_key_is_refused_and_ours_is_accepted() {
        let live = live_all();
        let e = Expectations {
            mac_key: Some(KEY),
            ..expect(&live)
        };
        let sign = |key: &[u8]| {
            encode_binary_to_vec(
                &snapshot(),
                &EncodeOptions {
                    compression: Compression::Zstd,
                    mac_key: Some(key),
                },
            )
            .unwrap()
        };
        let r = vet(
            &sign(b"another-shared-secret-000000002"),
            BodyEncoding::binary(),
            &e,
        )
        .unwrap_err();
        assert_eq!(r, Rejection::Mac(SnapshotDecodeError::MacMismatch));
        assert!(vet(&sign(KEY), BodyEncoding::binary(), &e).is_ok());
    }

    #[test]
    fn json_is_refused_when_a_key_is_configured() {
        let live = live_all();
        let e = Expectations {
            mac_key: Some(KEY),
            ..expect(&live)
        };
        let body = encode_json_to_vec(&snapshot()).unwrap();
        let r = vet(&body, BodyEncoding::json(Compression::None), &e).unwrap_err();
        assert_eq!(r, Rejection::Unauthenticated);
        assert!(r.is_permanent());
    }

    #[test]
    fn a_body_cut_short_is_damaged_and_transient() {
        let body = binary(&snapshot());
        let r = vet(
            &body[..body.len() - 3],
            BodyEncoding::binary(),
            &expect(&live_all()),
        )
        .unwrap_err();
        assert!(matches!(r, Rejection::Damaged(_)), "{r:?}");
        assert!(!r.is_permanent());
        let json = encode_json_to_vec(&snapshot()).unwrap();
        let r = vet(
            &json[..json.len() / 2],
            BodyEncoding::json(Compression::None),
            &expect(&live_all()),
        )
        .unwrap_err();
        assert!(matches!(r, Rejection::Damaged(_)), "{r:?}");
    }

    /// The fetch's path (`vet_stream`, fed in small reads) and the whole-body path reach the same
    /// verdict, class included, on good, damaged, forged, cold, foreign and JSON bodies.
    #[test]
    fn a_streamed_body_is_judged_exactly_as_the_same_body_whole() {
        struct Dribble<'a>(&'a [u8]);
        impl std::io::Read for Dribble<'_> {
            fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
                let n = out.len().min(self.0.len()).min(7);
                out[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let good = binary(&snapshot());
        let mut flipped = good.clone();
        let middle = flipped.len() / 2;
        flipped[middle] ^= 0x40;
        let signed_by_us = encode_binary_to_vec(
            &snapshot(),
            &EncodeOptions {
                mac_key: Some(KEY),
                ..EncodeOptions::default()
            },
        )
        .unwrap();
        let signed_by_other = encode_binary_to_vec(
            &snapshot(),
            &EncodeOptions {
                mac_key: Some(b"another-shared-secret-of-the-test"),
                ..EncodeOptions::default()
            },
        )
        .unwrap();
        let mut cold = snapshot();
        cold.nodes = SnapshotNodes::default();
        cold.cursors.clear();
        let mut other_block = snapshot();
        other_block.block_size = BLOCK * 2;
        let json = encode_json_to_vec(&snapshot()).unwrap();
        let gzip_json = {
            use std::io::Write;
            let mut gz =
                kvroute_snapshot::CompressingWriter::new(Vec::new(), Compression::Gzip).unwrap();
            gz.write_all(&json).unwrap();
            gz.finish().unwrap()
        };
        let live = live_all();
        let keyed = Expectations {
            mac_key: Some(KEY),
            ..expect(&live)
        };
        let plain = expect(&live);
        let cases: Vec<(&str, Vec<u8>, BodyEncoding, &Expectations<'_>)> = vec![
            ("good", good.clone(), BodyEncoding::binary(), &plain),
            (
                "cut short",
                good[..good.len() - 3].to_vec(),
                BodyEncoding::binary(),
                &plain,
            ),
            ("a flipped byte", flipped, BodyEncoding::binary(), &plain),
            ("signed by us", signed_by_us, BodyEncoding::binary(), &keyed),
            (
                "signed by another",
                signed_by_other,
                BodyEncoding::binary(),
                &keyed,
            ),
            (
                "unsigned, key set",
                good.clone(),
                BodyEncoding::binary(),
                &keyed,
            ),
            ("cold", binary(&cold), BodyEncoding::binary(), &plain),
            (
                "another block size",
                binary(&other_block),
                BodyEncoding::binary(),
                &plain,
            ),
            (
                "not an envelope",
                b"<html>hello</html>".to_vec(),
                BodyEncoding::binary(),
                &plain,
            ),
            ("json", json, BodyEncoding::json(Compression::None), &plain),
            (
                "gzip json",
                gzip_json,
                BodyEncoding::json(Compression::Gzip),
                &plain,
            ),
        ];
        for (name, body, encoding, expectations) in cases {
            let whole = vet(&body, encoding, expectations);
            let streamed = vet_stream(Dribble(&body), encoding, expectations);
            assert_eq!(streamed, whole, "{name}: the streamed verdict differs");
        }
    }

    #[test]
    fn a_body_over_the_decode_limit_is_too_large_and_permanent() {
        let live = live_all();
        let e = Expectations {
            limits: DecodeLimits {
                max_bytes: 16,
                ..DecodeLimits::default()
            },
            ..expect(&live)
        };
        let r = vet(&binary(&snapshot()), BodyEncoding::binary(), &e).unwrap_err();
        assert_eq!(r, Rejection::TooLarge { limit_bytes: 16 });
        assert!(r.is_permanent());
    }

    #[test]
    fn a_body_that_is_not_a_snapshot_envelope_is_a_permanent_encoding_rejection() {
        let r = vet(
            b"<html>hello</html>",
            BodyEncoding::binary(),
            &expect(&live_all()),
        )
        .unwrap_err();
        assert_eq!(r, Rejection::Encoding(SnapshotDecodeError::BadMagic));
        assert!(r.is_permanent());
    }

    #[test]
    fn the_graft_view_keeps_only_requested_ranks_that_are_covered() {
        let v = vet_binary(&snapshot(), &live_all()).unwrap();
        // 11 is requested but has no cursor: it must not receive nodes.
        let g = v.graft_for(&[RankId(10), RankId(11)]).unwrap();
        assert_eq!(g.local_ids(), &[RankId(10)]);
        assert_eq!(g.snapshot().ranks, vec![rank(0)]);
        let n = &g.snapshot().nodes;
        assert_eq!(n.content_hash, vec![0xa0, 0xa1, 0xa2]);
        assert_eq!(n.carrier_rank, vec![0, 0]);
        assert_eq!(
            g.coverage(RankId(10)),
            Coverage::Covered {
                cursor: (5, 1.5),
                partial: false
            }
        );
        assert_eq!(g.coverage(RankId(12)), Coverage::Unknown);
        let all = v.into_graft(&[RankId(10), RankId(12)]).unwrap();
        assert_eq!(all.snapshot().nodes.len(), 4);
    }

    #[test]
    fn a_graft_of_every_covered_rank_keeps_the_vetted_snapshot_whole() {
        let mut s = snapshot();
        s.cursors.push(RankCursor {
            rank: 1,
            seq: 3,
            ts: 0.5,
        });
        let v = vet_binary(&s, &live_all()).unwrap();
        let whole = v.snapshot().clone();
        let g = v.into_graft(&[RankId(10), RankId(11), RankId(12)]).unwrap();
        assert_eq!(g.snapshot(), &whole);
        assert_eq!(g.local_ids(), &[RankId(10), RankId(11), RankId(12)]);
        assert!(g.coverage(RankId(11)).is_complete_cover());
    }

    #[test]
    fn headers_name_the_encoding_and_unknown_ones_are_refused_permanently() {
        assert_eq!(
            BodyEncoding::from_headers(Some("application/x-kvroute-snapshot"), None).unwrap(),
            BodyEncoding::binary()
        );
        assert_eq!(
            BodyEncoding::from_headers(Some("Application/JSON; charset=utf-8"), Some("GZIP"))
                .unwrap(),
            BodyEncoding::json(Compression::Gzip)
        );
        assert_eq!(
            BodyEncoding::from_headers(Some("application/json"), Some("zstd")).unwrap(),
            BodyEncoding::json(Compression::Zstd)
        );
        let r = BodyEncoding::from_headers(Some("text/html"), None).unwrap_err();
        assert!(r.is_permanent() && matches!(r, Rejection::UnexpectedMedia { .. }));
        let r = BodyEncoding::from_headers(Some("application/json"), Some("br")).unwrap_err();
        assert!(r.is_permanent() && matches!(r, Rejection::UnsupportedContentEncoding { .. }));
        let long = "x".repeat(10_000);
        let Err(Rejection::UnexpectedMedia { content_type }) =
            BodyEncoding::from_headers(Some(&long), None)
        else {
            panic!("a long media type must be refused");
        };
        assert_eq!(content_type.len(), REJECTION_ECHO_MAX_BYTES);
    }
}
