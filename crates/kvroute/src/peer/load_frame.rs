//! The wire format of load sharing between sibling replicas: one frame per line, and the table a
//! follower rebuilds from them. Pure (no I/O, no clock of its own), so every way a frame can be
//! refused and every transition of [`SiblingBookings`] is a unit test.
//!
//! A replica streams its OWN per-rank bookings (requests it routed and has not seen finish, the
//! prompt tokens it sent that have not started answering, and its virtual prefill backlog; see
//! `RankLoad`) to each sibling that subscribes. Never the sums it holds for its siblings: a
//! replica that forwarded what it heard would make every booking count twice.
//!
//! Frames are STATE, not events: a `full` frame lists every rank the sender knows with its
//! current bookings, and a `delta` frame the ranks whose bookings changed since the previous
//! frame, by their index in the last `full` list. A request's booking therefore disappears in the
//! first frame after it finishes, and nothing a follower holds depends on having seen one
//! particular request start or end: there is no per-request message whose loss could leave a
//! phantom booking. The one way to hold stale bookings is a sibling that goes silent, and the
//! follower drops a silent sibling's table after its staleness bound (`--load-share-stale-ms`).
//! Deltas are safe because the stream is one ordered TCP connection: frames carry `seq`, a gap
//! (which only a bug could cause) is refused, and a reconnect starts with a `full` frame.
//!
//! Encoding: one JSON object per line, readable with `curl` (the frames of a handful of ranks
//! are a few hundred bytes; a delta names only what changed):
//!
//! ```text
//! {"seq":1,"full":[["http://engine-0:8000",0,3,1800,5400,90000],["http://engine-0:8000",1,0,0,0,0]]}
//! {"seq":2,"delta":[[1,1,600,1200,1200]]}
//! {"seq":3,"delta":[]}                        <- heartbeat
//! ```
//!
//! A `full` entry is `[worker_url, dp_rank, in_flight, queued_prefill_tokens, prefill_backlog_us,
//! prefill_dispatched_us]`, a delta entry the same from `in_flight` on, after the rank's index.
//! The backlog is sent as time REMAINING at the send, since two replicas' monotonic clocks share
//! no zero. `prefill_dispatched_us` is the prefill work the sender has EVER sent the rank, a
//! counter: the follower queues the difference between two frames behind its own work on the
//! rank's one virtual clock ([`DispatchedWork`]). Summing the senders' backlogs instead would
//! drain the rank N times too fast with N senders (each backlog drains as if the rank worked
//! for its sender alone). A counter, not "work since the last frame", so a lost frame loses
//! nothing. Entries of the older five-field form (no counter) are refused as malformed: a
//! follower that cannot place a sibling's work on the rank's clock would underestimate it.
//! A frame may also carry `prefixes`, conversation prefixes the sender's tokenizers rendered
//! (`[tokenizer, key, rendered_len, rendered_hash, [token ids]]`, see
//! `routing::tokenize::SharedPrefix`), but only on a stream whose follower asked for them: the
//! decoder refuses unknown fields, so a follower older than them would refuse every such frame.
//! With `--internal-auth-token-file`, each line is prefixed by the HMAC-SHA256 of its JSON under
//! the token (64 hex digits and a space), like the binary snapshot: a frame is authenticated even
//! if a proxy in between terminates TLS, and a follower with a token refuses unsigned lines.

use std::collections::HashMap;
use std::hash::Hash;

use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Longest frame line accepted (MAC and newline included). A full frame costs about 50 bytes
/// per rank, so this holds some 20,000 ranks.
pub const LOAD_FRAME_MAX_BYTES: usize = 1024 * 1024;
/// Most ranks one frame may list.
pub const LOAD_FRAME_RANKS_MAX: usize = 16_384;
/// Longest worker URL a frame may name.
pub const LOAD_FRAME_URL_MAX_BYTES: usize = 2_048;
/// Largest in-flight count or queued-token count taken from a sibling (a larger figure is
/// clamped to it, so a wrong or hostile sibling cannot overflow the sums).
pub const LOAD_FRAME_COUNT_MAX: u64 = 1 << 32;
/// Largest prefill backlog taken from a sibling: an hour of queued prefill is no estimate.
pub const LOAD_FRAME_BACKLOG_US_MAX: u64 = 3_600_000_000;

/// Most shared pending prefixes one frame may carry.
pub const LOAD_FRAME_PENDING_MAX: usize = 4_096;
/// Most block hashes one shared pending prefix may list (a routed request records at most as
/// many, see `routing::pending`).
pub const LOAD_FRAME_PENDING_BLOCKS_MAX: usize = 4_096;
/// Longest model name a shared pending prefix may carry.
pub const LOAD_FRAME_MODEL_MAX_BYTES: usize = 1_024;

/// Most shared rendered prefixes one frame may carry (`routing::tokenize::SharedPrefix`).
pub const LOAD_FRAME_PREFIXES_MAX: usize = 1_024;
/// Most tokens the shared prefixes of one frame may carry in all: at most about 7 bytes each on
/// the wire, so they fill at most about half of [`LOAD_FRAME_MAX_BYTES`] (a frame that would
/// still be too long with its ranks is sent without them).
pub const LOAD_FRAME_PREFIX_TOKENS_MAX: usize = 65_536;

/// A conversation prefix a replica's tokenizer rendered, as a frame carries it to the siblings
/// (`routing::tokenize` makes and adopts them; the type lives here because this file is also
/// compiled alone by the fuzz crate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPrefix {
    /// The fingerprint of the tokenizer and chat template that made it
    /// (`ModelTokenizer::fingerprint`).
    pub tokenizer: u64,
    /// The chained key of the prefix's messages.
    pub key: u64,
    /// Length and hash of the prefix's rendering, checked against the adopter's own rendering.
    pub rendered_len: u64,
    pub rendered_hash: u64,
    /// The tokens of the segment the prefix's last message added.
    pub tokens: Arc<[u32]>,
}

/// Hex digits of a frame's MAC prefix.
const MAC_HEX_LEN: usize = 64;

type HmacSha256 = Hmac<Sha256>;

/// One rank's bookings as a frame carries them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankBookings {
    pub in_flight: u64,
    pub queued_prefill_tokens: u64,
    /// Prefill time still queued at the send, by the sender's virtual clock.
    pub prefill_backlog_us: u64,
    /// Prefill work (us) the sender has ever sent the rank (`RankLoad::prefill_dispatched_us`).
    pub prefill_dispatched_us: u64,
}

impl RankBookings {
    fn clamped(self) -> RankBookings {
        RankBookings {
            in_flight: self.in_flight.min(LOAD_FRAME_COUNT_MAX),
            queued_prefill_tokens: self.queued_prefill_tokens.min(LOAD_FRAME_COUNT_MAX),
            prefill_backlog_us: self.prefill_backlog_us.min(LOAD_FRAME_BACKLOG_US_MAX),
            // A counter: only differences are used, and each is clamped where it is taken.
            prefill_dispatched_us: self.prefill_dispatched_us,
        }
    }
}

/// A rank as siblings name it: its worker's URL and DP rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankKey {
    pub worker_url: std::sync::Arc<str>,
    pub dp_rank: u32,
}

/// Blocks the sender just routed to a rank that the rank's KV events have not confirmed yet
/// (its pending prefix, see `routing::pending`): a hint, so a sibling that receives the next
/// request of the same cold prefix sends it after the first one. Unlike bookings these are
/// events, and losing one (a reconnect, a lagging stream) costs only that hint: the KV events
/// bring the same blocks to every replica's index shortly after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPending {
    pub model: String,
    pub rank: RankKey,
    /// The index's block hashes (block order), as the sender recorded them.
    pub hashes: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BookingFrame {
    /// Every rank the sender knows, in an order later deltas index into.
    Full {
        seq: u64,
        ranks: Vec<(RankKey, RankBookings)>,
        pending: Vec<SharedPending>,
        prefixes: Vec<SharedPrefix>,
    },
    /// The ranks whose bookings changed since the previous frame; empty = heartbeat.
    Delta {
        seq: u64,
        changes: Vec<(u32, RankBookings)>,
        pending: Vec<SharedPending>,
        prefixes: Vec<SharedPrefix>,
    },
}

impl BookingFrame {
    pub fn seq(&self) -> u64 {
        match self {
            BookingFrame::Full { seq, .. } | BookingFrame::Delta { seq, .. } => *seq,
        }
    }

    /// Takes the frame's shared rendered prefixes out (they go to the tokenizers, not the
    /// table).
    pub fn take_prefixes(&mut self) -> Vec<SharedPrefix> {
        match self {
            BookingFrame::Full { prefixes, .. } | BookingFrame::Delta { prefixes, .. } => {
                std::mem::take(prefixes)
            }
        }
    }

    /// Takes the frame's shared pending prefixes out (they are applied apart from the table).
    pub fn take_pending(&mut self) -> Vec<SharedPending> {
        match self {
            BookingFrame::Full { pending, .. } | BookingFrame::Delta { pending, .. } => {
                std::mem::take(pending)
            }
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame line is over {limit_bytes} bytes")]
    TooLarge { limit_bytes: usize },
    #[error("frame line has no MAC, and this replica requires one (an internal token is set)")]
    MacMissing,
    #[error("frame MAC does not verify under this replica's internal token")]
    MacRefused,
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("frame lists {count} ranks; at most {LOAD_FRAME_RANKS_MAX} are accepted")]
    TooManyRanks { count: usize },
}

/// A full frame's entry on the wire:
/// `[worker_url, dp_rank, in_flight, queued, backlog_us, dispatched_us]`.
type WireRank = (String, u32, u64, u64, u64, u64);
/// A delta entry: `[index, in_flight, queued, backlog_us, dispatched_us]`.
type WireChange = (u32, u64, u64, u64, u64);
/// A shared pending prefix: `[model, worker_url, dp_rank, [block hashes]]`.
type WirePending = (String, String, u32, Vec<u64>);
/// A shared rendered prefix: `[tokenizer, key, rendered_len, rendered_hash, [token ids]]`.
type WirePrefix = (u64, u64, u64, u64, Vec<u32>);

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WireFrame {
    seq: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    full: Option<Vec<WireRank>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    delta: Option<Vec<WireChange>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pending: Vec<WirePending>,
    /// Sent only to a follower that asked for them (`?prefixes=1`): a follower older than the
    /// field refuses unknown fields.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    prefixes: Vec<WirePrefix>,
}

fn prefixes_to_wire(prefixes: &[SharedPrefix]) -> Vec<WirePrefix> {
    prefixes
        .iter()
        .map(|p| {
            (
                p.tokenizer,
                p.key,
                p.rendered_len,
                p.rendered_hash,
                p.tokens.to_vec(),
            )
        })
        .collect()
}

fn prefixes_from_wire(wire: Vec<WirePrefix>) -> Result<Vec<SharedPrefix>, FrameError> {
    if wire.len() > LOAD_FRAME_PREFIXES_MAX {
        return Err(FrameError::Malformed(format!(
            "over {LOAD_FRAME_PREFIXES_MAX} shared prefixes in one frame"
        )));
    }
    let tokens: usize = wire.iter().map(|p| p.4.len()).sum();
    if tokens > LOAD_FRAME_PREFIX_TOKENS_MAX {
        return Err(FrameError::Malformed(format!(
            "shared prefixes carry over {LOAD_FRAME_PREFIX_TOKENS_MAX} tokens in one frame"
        )));
    }
    Ok(wire
        .into_iter()
        .map(
            |(tokenizer, key, rendered_len, rendered_hash, tokens)| SharedPrefix {
                tokenizer,
                key,
                rendered_len,
                rendered_hash,
                tokens: tokens.into(),
            },
        )
        .collect())
}

fn pending_to_wire(pending: &[SharedPending]) -> Vec<WirePending> {
    pending
        .iter()
        .map(|p| {
            (
                p.model.clone(),
                p.rank.worker_url.to_string(),
                p.rank.dp_rank,
                p.hashes.clone(),
            )
        })
        .collect()
}

fn pending_from_wire(wire: Vec<WirePending>) -> Result<Vec<SharedPending>, FrameError> {
    if wire.len() > LOAD_FRAME_PENDING_MAX {
        return Err(FrameError::Malformed(format!(
            "over {LOAD_FRAME_PENDING_MAX} pending prefixes in one frame"
        )));
    }
    wire.into_iter()
        .map(|(model, url, dp_rank, hashes)| {
            if model.is_empty() || model.len() > LOAD_FRAME_MODEL_MAX_BYTES {
                return Err(FrameError::Malformed(format!(
                    "a model name must hold 1..={LOAD_FRAME_MODEL_MAX_BYTES} bytes"
                )));
            }
            check_url(&url)?;
            if hashes.len() > LOAD_FRAME_PENDING_BLOCKS_MAX {
                return Err(FrameError::Malformed(format!(
                    "a pending prefix lists over {LOAD_FRAME_PENDING_BLOCKS_MAX} blocks"
                )));
            }
            Ok(SharedPending {
                model,
                rank: RankKey {
                    worker_url: url.into(),
                    dp_rank,
                },
                hashes,
            })
        })
        .collect()
}

fn check_url(url: &str) -> Result<(), FrameError> {
    if url.is_empty() || url.len() > LOAD_FRAME_URL_MAX_BYTES {
        return Err(FrameError::Malformed(format!(
            "a worker URL must hold 1..={LOAD_FRAME_URL_MAX_BYTES} bytes"
        )));
    }
    Ok(())
}

/// One frame as a line (newline included), MAC-prefixed when `mac_key` is set.
pub fn encode_line(frame: &BookingFrame, mac_key: Option<&[u8]>) -> Vec<u8> {
    let wire = match frame {
        BookingFrame::Full {
            seq,
            ranks,
            pending,
            prefixes,
        } => WireFrame {
            seq: *seq,
            full: Some(
                ranks
                    .iter()
                    .map(|(k, b)| {
                        (
                            k.worker_url.to_string(),
                            k.dp_rank,
                            b.in_flight,
                            b.queued_prefill_tokens,
                            b.prefill_backlog_us,
                            b.prefill_dispatched_us,
                        )
                    })
                    .collect(),
            ),
            delta: None,
            pending: pending_to_wire(pending),
            prefixes: prefixes_to_wire(prefixes),
        },
        BookingFrame::Delta {
            seq,
            changes,
            pending,
            prefixes,
        } => WireFrame {
            seq: *seq,
            full: None,
            pending: pending_to_wire(pending),
            prefixes: prefixes_to_wire(prefixes),
            delta: Some(
                changes
                    .iter()
                    .map(|(i, b)| {
                        (
                            *i,
                            b.in_flight,
                            b.queued_prefill_tokens,
                            b.prefill_backlog_us,
                            b.prefill_dispatched_us,
                        )
                    })
                    .collect(),
            ),
        },
    };
    // Serialising plain integers, strings and tuples cannot fail.
    let json = serde_json::to_vec(&wire).unwrap_or_default();
    let mut line = Vec::with_capacity(json.len() + MAC_HEX_LEN + 2);
    if let Some(key) = mac_key {
        line.extend_from_slice(&mac_hex(key, &json));
        line.push(b' ');
    }
    line.extend_from_slice(&json);
    line.push(b'\n');
    line
}

fn new_mac(key: &[u8]) -> HmacSha256 {
    // HMAC takes a key of any length.
    <HmacSha256 as KeyInit>::new_from_slice(key).expect("HMAC accepts keys of any length")
}

fn mac_hex(key: &[u8], json: &[u8]) -> [u8; MAC_HEX_LEN] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut mac = new_mac(key);
    mac.update(json);
    let tag = mac.finalize().into_bytes();
    let mut out = [0u8; MAC_HEX_LEN];
    for (i, b) in tag.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0x0f)];
    }
    out
}

fn unhex(hex: &[u8]) -> Option<Vec<u8>> {
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(*pair.get(1)?)?))
        .collect()
}

/// Reads one line (without its newline). With `mac_key`, the line must carry a MAC that
/// verifies (checked before the JSON is parsed); without, a MAC prefix is ignored, so a replica
/// without a token still reads a signing sibling (it trusts its network, as it was told to).
pub fn decode_line(line: &[u8], mac_key: Option<&[u8]>) -> Result<BookingFrame, FrameError> {
    if line.len() > LOAD_FRAME_MAX_BYTES {
        return Err(FrameError::TooLarge {
            limit_bytes: LOAD_FRAME_MAX_BYTES,
        });
    }
    let (mac, json) = match line.first() {
        Some(b'{') => (None, line),
        _ if line.len() > MAC_HEX_LEN && line[MAC_HEX_LEN] == b' ' => {
            (Some(&line[..MAC_HEX_LEN]), &line[MAC_HEX_LEN + 1..])
        }
        _ => {
            return Err(FrameError::Malformed(
                "neither JSON nor a MAC prefix".into(),
            ));
        }
    };
    if let Some(key) = mac_key {
        let presented = unhex(mac.ok_or(FrameError::MacMissing)?).ok_or(FrameError::MacRefused)?;
        let mut check = new_mac(key);
        check.update(json);
        check
            .verify_slice(&presented)
            .map_err(|_| FrameError::MacRefused)?;
    }
    let wire: WireFrame =
        serde_json::from_slice(json).map_err(|e| FrameError::Malformed(e.to_string()))?;
    let pending = pending_from_wire(wire.pending)?;
    let prefixes = prefixes_from_wire(wire.prefixes)?;
    match (wire.full, wire.delta) {
        (Some(full), None) => {
            if full.len() > LOAD_FRAME_RANKS_MAX {
                return Err(FrameError::TooManyRanks { count: full.len() });
            }
            let mut ranks = Vec::with_capacity(full.len());
            for (url, dp_rank, in_flight, queued, backlog, dispatched) in full {
                check_url(&url)?;
                let bookings = RankBookings {
                    in_flight,
                    queued_prefill_tokens: queued,
                    prefill_backlog_us: backlog,
                    prefill_dispatched_us: dispatched,
                };
                ranks.push((
                    RankKey {
                        worker_url: url.into(),
                        dp_rank,
                    },
                    bookings.clamped(),
                ));
            }
            Ok(BookingFrame::Full {
                seq: wire.seq,
                ranks,
                pending,
                prefixes,
            })
        }
        (None, Some(delta)) => {
            if delta.len() > LOAD_FRAME_RANKS_MAX {
                return Err(FrameError::TooManyRanks { count: delta.len() });
            }
            Ok(BookingFrame::Delta {
                seq: wire.seq,
                changes: delta
                    .into_iter()
                    .map(|(i, in_flight, queued, backlog, dispatched)| {
                        let bookings = RankBookings {
                            in_flight,
                            queued_prefill_tokens: queued,
                            prefill_backlog_us: backlog,
                            prefill_dispatched_us: dispatched,
                        };
                        (i, bookings.clamped())
                    })
                    .collect(),
                pending,
                prefixes,
            })
        }
        _ => Err(FrameError::Malformed(
            "a frame holds exactly one of 'full' and 'delta'".into(),
        )),
    }
}

/// One rank's bookings as a follower holds them: the backlog turned into a finish time on the
/// FOLLOWER's clock, so it keeps decaying between frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeldBookings {
    pub in_flight: u64,
    pub queued_prefill_tokens: u64,
    pub prefill_busy_until_us: u64,
    pub prefill_dispatched_us: u64,
}

impl HeldBookings {
    fn at(b: RankBookings, received_us: u64) -> HeldBookings {
        HeldBookings {
            in_flight: b.in_flight,
            queued_prefill_tokens: b.queued_prefill_tokens,
            prefill_busy_until_us: received_us.saturating_add(b.prefill_backlog_us),
            prefill_dispatched_us: b.prefill_dispatched_us,
        }
    }
}

/// Why a frame could not be applied: each means the stream is out of step, and the follower
/// reconnects (a new stream starts with a `full` frame).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApplyError {
    #[error("a delta arrived before any full frame")]
    DeltaBeforeFull,
    #[error("frame seq {got} after {last}: frames were lost or reordered")]
    SeqGap { last: u64, got: u64 },
    #[error("delta names rank index {index}; the full frame listed {ranks}")]
    IndexOutOfRange { index: u32, ranks: usize },
}

/// The follower's table of one sibling: built by its first `full` frame, patched by deltas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SiblingBookings {
    pub ranks: Vec<(RankKey, HeldBookings)>,
    /// Seq of the last applied frame; `None` before the first full frame.
    pub last_seq: Option<u64>,
    /// When (follower clock, us) the last frame arrived: what staleness is measured from.
    pub heard_at_us: u64,
}

impl SiblingBookings {
    /// Applies `frame`, received at `now_us`. A refused frame leaves the table as it was.
    pub fn apply(&mut self, frame: BookingFrame, now_us: u64) -> Result<(), ApplyError> {
        match frame {
            BookingFrame::Full { seq, ranks, .. } => {
                // A seq at u64::MAX has no successor: the next frame is a gap, never a wrap.
                if let Some(last) = self.last_seq
                    && last.checked_add(1) != Some(seq)
                {
                    return Err(ApplyError::SeqGap { last, got: seq });
                }
                self.ranks = ranks
                    .into_iter()
                    .map(|(k, b)| (k, HeldBookings::at(b, now_us)))
                    .collect();
                self.last_seq = Some(seq);
            }
            BookingFrame::Delta { seq, changes, .. } => {
                let last = self.last_seq.ok_or(ApplyError::DeltaBeforeFull)?;
                if last.checked_add(1) != Some(seq) {
                    return Err(ApplyError::SeqGap { last, got: seq });
                }
                if let Some(&(index, _)) = changes
                    .iter()
                    .find(|(i, _)| *i as usize >= self.ranks.len())
                {
                    return Err(ApplyError::IndexOutOfRange {
                        index,
                        ranks: self.ranks.len(),
                    });
                }
                for (i, b) in changes {
                    self.ranks[i as usize].1 = HeldBookings::at(b, now_us);
                }
                self.last_seq = Some(seq);
            }
        }
        self.heard_at_us = now_us;
        Ok(())
    }

    /// A new stream (after a reconnect) starts its own sequence: forget where the old one was,
    /// keeping the bookings until the new stream's full frame replaces them or they go stale.
    pub fn restart_stream(&mut self) {
        self.last_seq = None;
    }

    /// Heard from within `stale_us` of `now_us`.
    pub fn is_fresh(&self, now_us: u64, stale_us: u64) -> bool {
        now_us.saturating_sub(self.heard_at_us) <= stale_us
    }
}

/// The follower's reading of its siblings' dispatched counters: the prefill work each sibling
/// added on each rank since the previous reading, for the aggregator to queue behind the work
/// already on that rank's one virtual clock (`RankLoad::queue_sibling_prefill`). Generic over
/// how a sibling is named (the service uses its peer URL), so this module needs no other crate.
#[derive(Debug)]
pub struct DispatchedWork<Sibling> {
    /// Per sibling and rank: the counter last read, and the reading that read it. Nested by
    /// sibling so a reading looks entries up by reference and allocates only for a rank it has
    /// not seen before (the aggregator reads on every frame of every sibling).
    read: HashMap<Sibling, HashMap<RankKey, (u64, u64)>>,
    reading: u64,
}

impl<Sibling> Default for DispatchedWork<Sibling> {
    fn default() -> Self {
        DispatchedWork {
            read: HashMap::new(),
            reading: 0,
        }
    }
}

impl<Sibling: Eq + Hash + Clone> DispatchedWork<Sibling> {
    /// Work (us) each rank gained from the siblings in `tables` since the previous call (ranks
    /// that gained none are left out).
    ///
    /// A (sibling, rank) read for the first time contributes its REMAINING backlog at `now_us`,
    /// not its counter: what it sent before is drained or still in that backlog. That covers a
    /// new sibling, one back from silence (pairs absent from a call are forgotten) and one that
    /// restarted (its counter went back). Each contribution is clamped to
    /// [`LOAD_FRAME_BACKLOG_US_MAX`], so a hostile counter cannot park a rank for ever.
    pub fn take<'a>(
        &mut self,
        tables: impl IntoIterator<Item = (&'a Sibling, &'a SiblingBookings)>,
        now_us: u64,
    ) -> HashMap<RankKey, u64>
    where
        Sibling: 'a,
    {
        self.reading = self.reading.wrapping_add(1);
        let reading = self.reading;
        let mut added: HashMap<RankKey, u64> = HashMap::new();
        for (sibling, table) in tables {
            if !self.read.contains_key(sibling) {
                self.read.insert(sibling.clone(), HashMap::new());
            }
            let Some(last) = self.read.get_mut(sibling) else {
                continue;
            };
            for (key, held) in &table.ranks {
                let counter = held.prefill_dispatched_us;
                let first_sight = || held.prefill_busy_until_us.saturating_sub(now_us);
                let work = match last.get_mut(key) {
                    Some(entry) => {
                        let work = counter.checked_sub(entry.0).unwrap_or_else(first_sight);
                        *entry = (counter, reading);
                        work
                    }
                    None => {
                        last.insert(key.clone(), (counter, reading));
                        first_sight()
                    }
                };
                if work > 0 {
                    let sum = added.entry(key.clone()).or_default();
                    *sum = sum.saturating_add(work.min(LOAD_FRAME_BACKLOG_US_MAX));
                }
            }
        }
        // Forget what this reading did not see, so it counts as new when it is back.
        self.read.retain(|_, ranks| {
            ranks.retain(|_, &mut (_, seen)| seen == reading);
            !ranks.is_empty()
        });
        added
    }
}

/// What the sender remembers between frames to emit deltas (see [`FrameSender::next_frame`]).
#[derive(Debug, Default)]
pub struct FrameSender {
    keys: Vec<RankKey>,
    /// Per rank: in-flight, queued tokens, the sender-clock virtual finish time and the
    /// dispatched counter, the values whose change makes a rank part of the next delta (the
    /// backlog itself decays every microsecond, so comparing it would send every rank every
    /// time).
    sent: Vec<(u64, u64, u64, u64)>,
    next_seq: u64,
    last_sent_us: Option<u64>,
}

/// One own rank as the sender reads it at a tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnRank {
    pub key: RankKey,
    pub in_flight: u64,
    pub queued_prefill_tokens: u64,
    /// Virtual prefill finish time on the sender's clock.
    pub prefill_busy_until_us: u64,
    /// Prefill work ever sent to the rank (`RankLoad::prefill_dispatched_us`).
    pub prefill_dispatched_us: u64,
}

impl OwnRank {
    /// The values a delta is sent for when they change.
    fn compared(&self) -> (u64, u64, u64, u64) {
        (
            self.in_flight,
            self.queued_prefill_tokens,
            self.prefill_busy_until_us,
            self.prefill_dispatched_us,
        )
    }
}

impl FrameSender {
    /// The frame to send at `now_us` for `ranks` (sorted by key), the `pending` prefixes routed
    /// and the `prefixes` rendered since the last frame, or `None` when nothing changed, nothing
    /// is pending or rendered and the last
    /// frame is younger than `heartbeat_us`. The first frame, and the first after the rank set
    /// changed, is `full`.
    pub fn next_frame(
        &mut self,
        ranks: &[OwnRank],
        now_us: u64,
        heartbeat_us: u64,
        pending: Vec<SharedPending>,
        prefixes: Vec<SharedPrefix>,
    ) -> Option<BookingFrame> {
        let values: Vec<(u64, u64, u64, u64)> = ranks.iter().map(OwnRank::compared).collect();
        let bookings = |r: &OwnRank| RankBookings {
            in_flight: r.in_flight,
            queued_prefill_tokens: r.queued_prefill_tokens,
            prefill_backlog_us: r.prefill_busy_until_us.saturating_sub(now_us),
            prefill_dispatched_us: r.prefill_dispatched_us,
        };
        let same_ranks = self.last_sent_us.is_some()
            && self.keys.len() == ranks.len()
            && self.keys.iter().zip(ranks).all(|(k, r)| *k == r.key);
        let seq = self.next_seq.wrapping_add(1);
        let frame = if !same_ranks {
            self.keys = ranks.iter().map(|r| r.key.clone()).collect();
            BookingFrame::Full {
                seq,
                ranks: ranks.iter().map(|r| (r.key.clone(), bookings(r))).collect(),
                pending,
                prefixes,
            }
        } else {
            let changes: Vec<(u32, RankBookings)> = ranks
                .iter()
                .zip(&self.sent)
                .enumerate()
                .filter(|(_, (r, sent))| r.compared() != **sent)
                .map(|(i, (r, _))| (i as u32, bookings(r)))
                .collect();
            let heartbeat_due = self
                .last_sent_us
                .is_none_or(|t| now_us.saturating_sub(t) >= heartbeat_us);
            if changes.is_empty() && pending.is_empty() && prefixes.is_empty() && !heartbeat_due {
                return None;
            }
            BookingFrame::Delta {
                seq,
                changes,
                pending,
                prefixes,
            }
        };
        self.sent = values;
        self.next_seq = seq;
        self.last_sent_us = Some(now_us);
        Some(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(url: &str, dp: u32) -> RankKey {
        RankKey {
            worker_url: url.into(),
            dp_rank: dp,
        }
    }

    fn own(url: &str, dp: u32, in_flight: u64, queued: u64, until: u64) -> OwnRank {
        OwnRank {
            key: key(url, dp),
            in_flight,
            queued_prefill_tokens: queued,
            prefill_busy_until_us: until,
            prefill_dispatched_us: until,
        }
    }

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn frames_round_trip_with_and_without_a_mac() {
        let full = BookingFrame::Full {
            seq: 1,
            ranks: vec![(
                key("http://e0:8000", 1),
                RankBookings {
                    in_flight: 3,
                    queued_prefill_tokens: 1800,
                    prefill_backlog_us: 5400,
                    prefill_dispatched_us: 90_000,
                },
            )],
            pending: vec![],
            prefixes: vec![],
        };
        let delta = BookingFrame::Delta {
            seq: 2,
            changes: vec![(0, RankBookings::default())],
            pending: vec![],
            prefixes: vec![],
        };
        for frame in [full, delta] {
            for key in [None, Some(KEY)] {
                let line = encode_line(&frame, key);
                assert_eq!(line.last(), Some(&b'\n'));
                let back = decode_line(&line[..line.len() - 1], key).expect("decodes");
                assert_eq!(back, frame);
            }
        }
    }

    #[test]
    fn shared_rendered_prefixes_round_trip_and_frames_over_their_limits_are_refused() {
        let prefix = |tokens: usize| SharedPrefix {
            tokenizer: u64::MAX - 1,
            key: 8,
            rendered_len: 9,
            rendered_hash: u64::MAX,
            tokens: vec![151_643u32; tokens].into(),
        };
        let delta = |prefixes: Vec<SharedPrefix>| BookingFrame::Delta {
            seq: 1,
            changes: vec![],
            pending: vec![],
            prefixes,
        };
        let mut frame = delta(vec![prefix(3), prefix(0)]);
        let line = encode_line(&frame, Some(b"k"));
        let mut back = decode_line(&line[..line.len() - 1], Some(b"k")).expect("decodes");
        assert_eq!(
            back.take_prefixes(),
            frame.take_prefixes(),
            "u64s kept exact"
        );
        let plain = encode_line(&delta(vec![]), None);
        assert!(
            !String::from_utf8_lossy(&plain).contains("prefixes"),
            "a frame without prefixes names no such field (older followers refuse it)"
        );
        let half = LOAD_FRAME_PREFIX_TOKENS_MAX / 2;
        for (what, prefixes) in [
            ("too many tokens", vec![prefix(half), prefix(half + 1)]),
            (
                "too many prefixes",
                vec![prefix(0); LOAD_FRAME_PREFIXES_MAX + 1],
            ),
        ] {
            let line = encode_line(&delta(prefixes), None);
            assert!(
                matches!(
                    decode_line(&line[..line.len() - 1], None),
                    Err(FrameError::Malformed(_))
                ),
                "{what}"
            );
        }
        let at_the_limits = encode_line(&delta(vec![prefix(half), prefix(half)]), None);
        assert!(
            at_the_limits.len() < LOAD_FRAME_MAX_BYTES / 2,
            "half a line at most"
        );
        assert!(decode_line(&at_the_limits[..at_the_limits.len() - 1], None).is_ok());
    }

    #[test]
    fn shared_pending_prefixes_round_trip_and_oversized_ones_are_refused() {
        let mut frame = BookingFrame::Delta {
            seq: 4,
            changes: vec![],
            pending: vec![SharedPending {
                model: "m".into(),
                rank: key("http://e1:8000", 0),
                hashes: vec![u64::MAX, 0, 42],
            }],
            prefixes: vec![],
        };
        let line = encode_line(&frame, Some(KEY));
        let mut back = decode_line(line.trim_ascii_end(), Some(KEY)).expect("decodes");
        assert_eq!(back, frame);
        assert_eq!(back.take_pending(), frame.take_pending());
        assert!(back.take_pending().is_empty(), "taken once");
        let too_many_blocks = format!(
            "{{\"seq\":1,\"delta\":[],\"pending\":[[\"m\",\"http://e\",0,[{}]]]}}",
            vec!["1"; LOAD_FRAME_PENDING_BLOCKS_MAX + 1].join(",")
        );
        assert!(matches!(
            decode_line(too_many_blocks.as_bytes(), None),
            Err(FrameError::Malformed(_))
        ));
        let no_model = b"{\"seq\":1,\"delta\":[],\"pending\":[[\"\",\"http://e\",0,[1]]]}";
        assert!(matches!(
            decode_line(no_model, None),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn a_follower_with_a_token_refuses_unsigned_wrongly_signed_and_altered_frames() {
        let frame = BookingFrame::Delta {
            seq: 7,
            changes: vec![],
            pending: vec![],
            prefixes: vec![],
        };
        let unsigned = encode_line(&frame, None);
        assert_eq!(
            decode_line(unsigned.trim_ascii_end(), Some(KEY)),
            Err(FrameError::MacMissing)
        );
        let other_key = encode_line(&frame, Some(b"another-key-another-key-another-k"));
        assert_eq!(
            decode_line(other_key.trim_ascii_end(), Some(KEY)),
            Err(FrameError::MacRefused)
        );
        let mut altered = encode_line(&frame, Some(KEY));
        let seven = altered.iter().rposition(|&b| b == b'7').unwrap();
        altered[seven] = b'8';
        assert_eq!(
            decode_line(altered.trim_ascii_end(), Some(KEY)),
            Err(FrameError::MacRefused)
        );
        let mut bad_hex = encode_line(&frame, Some(KEY));
        bad_hex[0] = b'z';
        assert_eq!(
            decode_line(bad_hex.trim_ascii_end(), Some(KEY)),
            Err(FrameError::MacRefused)
        );
    }

    #[test]
    fn malformed_oversized_and_overfull_frames_are_typed_errors() {
        for bad in [
            &b""[..],
            b"not json",
            b"{\"seq\":1}",
            b"{\"seq\":1,\"full\":[],\"delta\":[]}",
            b"{\"seq\":-1,\"delta\":[]}",
            b"{\"seq\":1,\"delta\":[[0,1,2]]}",
            b"{\"seq\":1,\"full\":[[\"\",0,0,0,0,0]]}",
            // The five-field form of older replicas, without the dispatched counter.
            b"{\"seq\":1,\"full\":[[\"http://a\",0,0,0,0]]}",
            b"{\"seq\":1,\"delta\":[],\"extra\":1}",
        ] {
            assert!(
                matches!(decode_line(bad, None), Err(FrameError::Malformed(_))),
                "{:?} was not refused as malformed",
                String::from_utf8_lossy(bad)
            );
        }
        let huge = vec![b'{'; LOAD_FRAME_MAX_BYTES + 1];
        assert!(matches!(
            decode_line(&huge, None),
            Err(FrameError::TooLarge { .. })
        ));
        let many: Vec<String> = (0..=LOAD_FRAME_RANKS_MAX)
            .map(|i| format!("[{i},0,0,0,0]"))
            .collect();
        let line = format!("{{\"seq\":1,\"delta\":[{}]}}", many.join(","));
        assert_eq!(
            decode_line(line.as_bytes(), None),
            Err(FrameError::TooManyRanks {
                count: LOAD_FRAME_RANKS_MAX + 1
            })
        );
    }

    #[test]
    fn figures_beyond_their_bounds_are_clamped_not_trusted() {
        let line = format!(
            "{{\"seq\":1,\"delta\":[[0,{},{},{},{}]]}}",
            u64::MAX,
            u64::MAX,
            u64::MAX,
            u64::MAX
        );
        let Ok(BookingFrame::Delta { changes, .. }) = decode_line(line.as_bytes(), None) else {
            panic!("decodes");
        };
        assert_eq!(
            changes[0].1,
            RankBookings {
                in_flight: LOAD_FRAME_COUNT_MAX,
                queued_prefill_tokens: LOAD_FRAME_COUNT_MAX,
                prefill_backlog_us: LOAD_FRAME_BACKLOG_US_MAX,
                prefill_dispatched_us: u64::MAX,
            }
        );
    }

    #[test]
    fn a_full_frame_builds_the_table_and_a_delta_patches_only_its_ranks() {
        let mut table = SiblingBookings::default();
        let full = BookingFrame::Full {
            seq: 1,
            ranks: vec![
                (
                    key("http://a", 0),
                    RankBookings {
                        in_flight: 2,
                        queued_prefill_tokens: 100,
                        prefill_backlog_us: 500,
                        prefill_dispatched_us: 700,
                    },
                ),
                (key("http://a", 1), RankBookings::default()),
            ],
            pending: vec![],
            prefixes: vec![],
        };
        table.apply(full, 1_000).unwrap();
        assert_eq!(
            table.ranks[0].1.prefill_busy_until_us, 1_500,
            "backlog on our clock"
        );
        let delta = BookingFrame::Delta {
            seq: 2,
            changes: vec![(
                1,
                RankBookings {
                    in_flight: 1,
                    queued_prefill_tokens: 50,
                    prefill_backlog_us: 10,
                    prefill_dispatched_us: 30,
                },
            )],
            pending: vec![],
            prefixes: vec![],
        };
        table.apply(delta, 2_000).unwrap();
        assert_eq!(table.ranks[0].1.in_flight, 2, "untouched rank kept");
        assert_eq!(
            table.ranks[1].1,
            HeldBookings {
                in_flight: 1,
                queued_prefill_tokens: 50,
                prefill_busy_until_us: 2_010,
                prefill_dispatched_us: 30,
            }
        );
        assert_eq!(table.heard_at_us, 2_000);
    }

    #[test]
    fn a_delta_before_any_full_frame_a_seq_gap_or_a_bad_index_is_refused_and_changes_nothing() {
        let mut table = SiblingBookings::default();
        let heartbeat = |seq| BookingFrame::Delta {
            seq,
            changes: vec![],
            pending: vec![],
            prefixes: vec![],
        };
        assert_eq!(
            table.apply(heartbeat(1), 5),
            Err(ApplyError::DeltaBeforeFull)
        );
        table
            .apply(
                BookingFrame::Full {
                    seq: 1,
                    ranks: vec![(key("http://a", 0), RankBookings::default())],
                    pending: vec![],
                    prefixes: vec![],
                },
                10,
            )
            .unwrap();
        let before = table.clone();
        assert_eq!(
            table.apply(heartbeat(3), 20),
            Err(ApplyError::SeqGap { last: 1, got: 3 })
        );
        let out_of_range = BookingFrame::Delta {
            seq: 2,
            changes: vec![(1, RankBookings::default())],
            pending: vec![],
            prefixes: vec![],
        };
        assert_eq!(
            table.apply(out_of_range, 20),
            Err(ApplyError::IndexOutOfRange { index: 1, ranks: 1 })
        );
        assert_eq!(table, before);
        table.apply(heartbeat(2), 30).unwrap();
        assert_eq!(table.heard_at_us, 30, "a heartbeat refreshes the table");
    }

    #[test]
    fn a_seq_at_its_maximum_has_no_successor_and_never_wraps() {
        let mut table = SiblingBookings::default();
        let full = |seq| BookingFrame::Full {
            seq,
            ranks: vec![],
            pending: vec![],
            prefixes: vec![],
        };
        table.apply(full(u64::MAX), 1).unwrap();
        assert_eq!(
            table.apply(full(0), 2),
            Err(ApplyError::SeqGap {
                last: u64::MAX,
                got: 0
            })
        );
        let heartbeat = BookingFrame::Delta {
            seq: 0,
            changes: vec![],
            pending: vec![],
            prefixes: vec![],
        };
        assert!(table.apply(heartbeat, 3).is_err());
    }

    #[test]
    fn after_a_reconnect_the_new_streams_full_frame_is_taken_whatever_its_seq() {
        let mut table = SiblingBookings::default();
        let full = |seq, in_flight| BookingFrame::Full {
            seq,
            ranks: vec![(
                key("http://a", 0),
                RankBookings {
                    in_flight,
                    ..RankBookings::default()
                },
            )],
            pending: vec![],
            prefixes: vec![],
        };
        table.apply(full(1, 4), 10).unwrap();
        table
            .apply(
                BookingFrame::Delta {
                    seq: 2,
                    changes: vec![],
                    pending: vec![],
                    prefixes: vec![],
                },
                20,
            )
            .unwrap();
        table.restart_stream();
        assert_eq!(
            table.ranks[0].1.in_flight, 4,
            "bookings kept across the reconnect"
        );
        table.apply(full(1, 1), 30).unwrap();
        assert_eq!(table.ranks[0].1.in_flight, 1);
    }

    /// A follower's table of one sibling holding `ranks` as (dp_rank, backlog_us at `now_us`,
    /// dispatched counter).
    fn table_of(ranks: &[(u32, u64, u64)], now_us: u64) -> SiblingBookings {
        let mut table = SiblingBookings::default();
        let full = BookingFrame::Full {
            seq: 1,
            ranks: ranks
                .iter()
                .map(|&(dp, backlog, dispatched)| {
                    (
                        key("http://e", dp),
                        RankBookings {
                            prefill_backlog_us: backlog,
                            prefill_dispatched_us: dispatched,
                            ..RankBookings::default()
                        },
                    )
                })
                .collect(),
            pending: vec![],
            prefixes: vec![],
        };
        table.apply(full, now_us).unwrap();
        table
    }

    fn peer(url: &str) -> String {
        url.to_string()
    }

    #[test]
    fn a_siblings_new_work_is_the_difference_of_its_counter_between_readings() {
        let (a, b) = (peer("http://10.0.0.1:9000"), peer("http://10.0.0.2:9000"));
        let mut work = DispatchedWork::default();
        // First reading: what is still queued, not the whole counter (the rest has drained).
        let first = work.take([(&a, &table_of(&[(0, 4_000, 90_000)], 1_000))], 1_000);
        assert_eq!(first.get(&key("http://e", 0)), Some(&4_000));
        // Its counter grew by 1,500 (even if frames were lost in between): that is the new work.
        let second = work.take([(&a, &table_of(&[(0, 3_000, 91_500)], 2_000))], 2_000);
        assert_eq!(second.get(&key("http://e", 0)), Some(&1_500));
        // No new work: the rank is left out.
        let third = work.take([(&a, &table_of(&[(0, 2_000, 91_500)], 3_000))], 3_000);
        assert!(third.is_empty(), "{third:?}");
        // Two siblings on one rank add up; the second is read for the first time.
        let both = work.take(
            [
                (&a, &table_of(&[(0, 1_000, 92_000)], 4_000)),
                (&b, &table_of(&[(0, 700, 5_000)], 4_000)),
            ],
            4_000,
        );
        assert_eq!(both.get(&key("http://e", 0)), Some(&(500 + 700)));
    }

    #[test]
    fn a_sibling_back_from_silence_or_restarted_counts_its_backlog_not_its_counter() {
        let a = peer("http://10.0.0.1:9000");
        let mut work = DispatchedWork::default();
        work.take([(&a, &table_of(&[(0, 0, 50_000)], 0))], 0);
        // Silent for a reading (left out as stale): forgotten.
        assert!(work.take([], 10_000).is_empty());
        let back = work.take([(&a, &table_of(&[(0, 2_000, 80_000)], 20_000))], 20_000);
        assert_eq!(
            back.get(&key("http://e", 0)),
            Some(&2_000),
            "the 30 ms of work sent while unheard has drained or is in the backlog"
        );
        // Restarted: its counter went back.
        let restarted = work.take([(&a, &table_of(&[(0, 600, 900)], 30_000))], 30_000);
        assert_eq!(restarted.get(&key("http://e", 0)), Some(&600));
    }

    #[test]
    fn a_hostile_counter_jump_is_clamped_to_the_largest_backlog() {
        let a = peer("http://10.0.0.1:9000");
        let mut work = DispatchedWork::default();
        work.take([(&a, &table_of(&[(0, 0, 0)], 0))], 0);
        let jump = work.take([(&a, &table_of(&[(0, 0, u64::MAX)], 10))], 10);
        assert_eq!(
            jump.get(&key("http://e", 0)),
            Some(&LOAD_FRAME_BACKLOG_US_MAX)
        );
    }

    #[test]
    fn a_silent_sibling_goes_stale_after_its_bound() {
        let mut held = SiblingBookings::default();
        held.apply(
            BookingFrame::Full {
                seq: 1,
                ranks: vec![(key("http://a", 0), RankBookings::default())],
                pending: vec![],
                prefixes: vec![],
            },
            1_000,
        )
        .unwrap();
        assert!(held.is_fresh(2_000, 1_000), "heard 1 ms ago");
        assert!(!held.is_fresh(2_001, 1_000), "silent past the bound");
    }

    #[test]
    fn the_sender_sends_full_first_then_only_changes_then_heartbeats() {
        let mut sender = FrameSender::default();
        let ranks = vec![
            own("http://a", 0, 1, 100, 5_000),
            own("http://a", 1, 0, 0, 0),
        ];
        let Some(BookingFrame::Full {
            seq: 1,
            ranks: listed,
            ..
        }) = sender.next_frame(&ranks, 1_000, 200, vec![], vec![])
        else {
            panic!("first frame is full");
        };
        assert_eq!(
            listed[0].1.prefill_backlog_us, 4_000,
            "remaining at the send"
        );
        assert_eq!(
            sender.next_frame(&ranks, 1_050, 200, vec![], vec![]),
            None,
            "nothing changed"
        );
        let mut changed = ranks.clone();
        changed[1].in_flight = 2;
        assert_eq!(
            sender.next_frame(&changed, 1_100, 200, vec![], vec![]),
            Some(BookingFrame::Delta {
                seq: 2,
                changes: vec![(
                    1,
                    RankBookings {
                        in_flight: 2,
                        ..RankBookings::default()
                    }
                )],
                pending: vec![],
                prefixes: vec![]
            })
        );
        assert_eq!(
            sender.next_frame(&changed, 1_300, 200, vec![], vec![]),
            Some(BookingFrame::Delta {
                seq: 3,
                changes: vec![],
                pending: vec![],
                prefixes: vec![]
            }),
            "heartbeat once the last frame is 200 us old"
        );
        let grown = vec![
            changed[0].clone(),
            changed[1].clone(),
            own("http://b", 0, 0, 0, 0),
        ];
        assert!(matches!(
            sender.next_frame(&grown, 1_310, 200, vec![], vec![]),
            Some(BookingFrame::Full { seq: 4, .. })
        ));
    }

    #[test]
    fn a_follower_applying_every_sent_frame_holds_what_the_sender_has() {
        let mut sender = FrameSender::default();
        let mut table = SiblingBookings::default();
        let mut ranks = vec![own("http://a", 0, 0, 0, 0), own("http://a", 1, 0, 0, 0)];
        for step in 0..50u64 {
            let i = (step % 2) as usize;
            ranks[i].in_flight = step % 5;
            ranks[i].queued_prefill_tokens = step * 10;
            let now = step * 100;
            if let Some(frame) = sender.next_frame(&ranks, now, 1_000, vec![], vec![]) {
                let line = encode_line(&frame, Some(KEY));
                table
                    .apply(decode_line(line.trim_ascii_end(), Some(KEY)).unwrap(), now)
                    .unwrap();
            }
            for (r, (k, held)) in ranks.iter().zip(&table.ranks) {
                assert_eq!(&r.key, k);
                assert_eq!(held.in_flight, r.in_flight, "step {step}");
                assert_eq!(
                    held.queued_prefill_tokens, r.queued_prefill_tokens,
                    "step {step}"
                );
            }
        }
    }
}
