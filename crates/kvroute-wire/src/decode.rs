//! Decoder for every msgpack shape SGLang and vLLM publish on their KV-event and load topics.
//!
//! It walks the payload with a byte cursor and `rmp`'s marker classification instead of building
//! a generic value tree (`rmpv`, `rmp-serde`): the router decodes every batch of every engine on
//! its hot path, and a tree costs one allocation per node while this costs only the `Vec`s of the
//! output. Walking by hand is also what lets the decoder accept all engine generations at once
//! (array or map batch, map- or array-tagged events, keys in any order, int or byte hashes) and
//! hash the *exact* bytes of each `extra_keys` entry.
//!
//! Hostile input: every declared length is checked against a named limit and against the bytes
//! actually left before anything is reserved for it, skipped values are bounded in nesting depth,
//! and every failure is a [`DecodeError`] that says what was wrong and where.

use std::fmt;

use rmp::Marker;
use xxhash_rust::xxh3::xxh3_64;

use crate::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, LoadStat, Medium};

/// Largest event payload frame accepted from an engine, checked by the subscriber before the
/// frame is decoded and again by the decoder. A batch is a few KiB to a few MiB (vLLM sends token
/// ids for every stored block); anything larger is a runaway frame and is refused.
pub const PAYLOAD_MAX_BYTES: usize = 32 * 1024 * 1024;
/// Events in one batch (engines flush every scheduler step, so real batches hold tens).
pub const EVENTS_PER_BATCH_MAX: usize = 65_536;
/// Block hashes in one event (also bounds `extra_keys`, which has one entry per block).
pub const HASHES_PER_EVENT_MAX: usize = 65_536;
/// Token ids in one `BlockStored` event.
pub const TOKENS_PER_EVENT_MAX: usize = 1_048_576;
/// Containers nested inside one skipped value (unknown keys, `extra_keys` entries).
pub const NESTING_DEPTH_MAX: usize = 32;
/// Longest string or byte string read as a field (tags, medium, `lora_name`, byte hashes).
pub const STRING_MAX_BYTES: usize = 4_096;

/// Where in the payload a problem was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// A field of the batch envelope.
    Batch { field: &'static str },
    /// A field of the event at `index` in the batch's `events`.
    Event { index: usize, field: &'static str },
    /// A field of a `LoadStat` record.
    LoadStat { field: &'static str },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Batch { field } => write!(f, "batch field `{field}`"),
            Location::Event { index, field } => write!(f, "event {index} field `{field}`"),
            Location::LoadStat { field } => write!(f, "LoadStat field `{field}`"),
        }
    }
}

/// Why a payload was rejected. Offsets are byte positions in the payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("empty payload")]
    EmptyPayload,
    #[error("payload is {len_bytes} bytes, over PAYLOAD_MAX_BYTES ({max_bytes})")]
    PayloadTooLarge { len_bytes: usize, max_bytes: usize },
    #[error("{at}: payload ends at byte {offset} inside a value")]
    Truncated { at: Location, offset: usize },
    #[error("{at}: expected {expected}, found {found} at byte {offset}")]
    UnexpectedType {
        at: Location,
        expected: &'static str,
        found: &'static str,
        offset: usize,
    },
    #[error("{at}: {len} items declared, over the limit {max}")]
    TooManyItems {
        at: Location,
        len: usize,
        max: usize,
    },
    #[error("{at}: string of {len_bytes} bytes, over STRING_MAX_BYTES ({max_bytes})")]
    StringTooLong {
        at: Location,
        len_bytes: usize,
        max_bytes: usize,
    },
    #[error("{at}: string at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { at: Location, offset: usize },
    #[error("{at}: integer {value} does not fit {range}")]
    IntegerOutOfRange {
        at: Location,
        value: i128,
        range: &'static str,
    },
    #[error("{at}: value nested deeper than NESTING_DEPTH_MAX ({max_depth})")]
    NestingTooDeep { at: Location, max_depth: usize },
    #[error("{at}: reserved msgpack marker 0xc1 at byte {offset}")]
    ReservedMarker { at: Location, offset: usize },
    #[error("{at}: required field missing")]
    MissingField { at: Location },
    #[error("{at}: unknown tag {tag:?}")]
    UnknownTag { at: Location, tag: String },
    #[error("{at}: array of {len} elements, at least {min} required")]
    ArrayTooShort {
        at: Location,
        len: usize,
        min: usize,
    },
    #[error("{trailing_bytes} trailing bytes after the value ending at byte {offset}")]
    TrailingBytes {
        offset: usize,
        trailing_bytes: usize,
    },
}

type Result<T> = std::result::Result<T, DecodeError>;

/// Decodes one KV-event batch payload (the third frame of a `[topic, seq, payload]` message).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch> {
    let mut rd = Reader::new(payload)?;
    let batch = rd.batch()?;
    rd.finish()?;
    Ok(batch)
}

/// Decodes one SGLang `load` topic payload:
/// `["LoadStat", running, waiting, tokens, max_total_tokens, dp_rank?, ...]`.
pub fn decode_load_stat(payload: &[u8]) -> Result<LoadStat> {
    let mut rd = Reader::new(payload)?;
    let stat = rd.load_stat()?;
    rd.finish()?;
    Ok(stat)
}

/// Which event a tag names.
#[derive(Clone, Copy)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

const fn batch(field: &'static str) -> Location {
    Location::Batch { field }
}

const fn event(index: usize, field: &'static str) -> Location {
    Location::Event { index, field }
}

fn marker_kind(m: Marker) -> &'static str {
    match m {
        Marker::FixPos(_)
        | Marker::FixNeg(_)
        | Marker::U8
        | Marker::U16
        | Marker::U32
        | Marker::U64
        | Marker::I8
        | Marker::I16
        | Marker::I32
        | Marker::I64 => "integer",
        Marker::Null => "nil",
        Marker::True | Marker::False => "bool",
        Marker::F32 | Marker::F64 => "float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "string",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "binary",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "map",
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => "extension",
        Marker::Reserved => "reserved marker",
    }
}

/// A cursor over one payload. `pos` never exceeds `buf.len()`.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Result<Self> {
        if buf.is_empty() {
            return Err(DecodeError::EmptyPayload);
        }
        if buf.len() > PAYLOAD_MAX_BYTES {
            return Err(DecodeError::PayloadTooLarge {
                len_bytes: buf.len(),
                max_bytes: PAYLOAD_MAX_BYTES,
            });
        }
        Ok(Reader { buf, pos: 0 })
    }

    fn finish(&self) -> Result<()> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes {
                offset: self.pos,
                trailing_bytes: self.buf.len() - self.pos,
            })
        }
    }

    #[inline]
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    fn truncated(&self, at: Location) -> DecodeError {
        DecodeError::Truncated {
            at,
            offset: self.buf.len(),
        }
    }

    #[inline]
    fn byte(&mut self, at: Location) -> Result<u8> {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => Err(self.truncated(at)),
        }
    }

    #[inline]
    fn peek(&self, at: Location) -> Result<u8> {
        self.buf.get(self.pos).copied().ok_or(self.truncated(at))
    }

    #[inline]
    fn take(&mut self, n: usize, at: Location) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.truncated(at));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    fn be<const N: usize>(&mut self, at: Location) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, at)?);
        Ok(out)
    }

    #[inline]
    fn be_u16(&mut self, at: Location) -> Result<u16> {
        Ok(u16::from_be_bytes(self.be(at)?))
    }

    #[inline]
    fn be_u32(&mut self, at: Location) -> Result<u32> {
        Ok(u32::from_be_bytes(self.be(at)?))
    }

    #[inline]
    fn be_u64(&mut self, at: Location) -> Result<u64> {
        Ok(u64::from_be_bytes(self.be(at)?))
    }

    #[inline]
    fn marker(&mut self, at: Location) -> Result<(Marker, usize)> {
        let offset = self.pos;
        Ok((Marker::from_u8(self.byte(at)?), offset))
    }

    fn unexpected(m: Marker, offset: usize, at: Location, expected: &'static str) -> DecodeError {
        if m == Marker::Reserved {
            return DecodeError::ReservedMarker { at, offset };
        }
        DecodeError::UnexpectedType {
            at,
            expected,
            found: marker_kind(m),
            offset,
        }
    }

    /// The integer that follows marker `m`, widened so every msgpack integer fits.
    #[inline]
    fn int_after(
        &mut self,
        m: Marker,
        offset: usize,
        at: Location,
        expected: &'static str,
    ) -> Result<i128> {
        Ok(match m {
            Marker::FixPos(v) => v.into(),
            Marker::FixNeg(v) => v.into(),
            Marker::U8 => self.byte(at)?.into(),
            Marker::U16 => self.be_u16(at)?.into(),
            Marker::U32 => self.be_u32(at)?.into(),
            Marker::U64 => self.be_u64(at)?.into(),
            Marker::I8 => (self.byte(at)? as i8).into(),
            Marker::I16 => (self.be_u16(at)? as i16).into(),
            Marker::I32 => (self.be_u32(at)? as i32).into(),
            Marker::I64 => (self.be_u64(at)? as i64).into(),
            other => return Err(Self::unexpected(other, offset, at, expected)),
        })
    }

    fn u64_value(&mut self, at: Location) -> Result<u64> {
        let (m, offset) = self.marker(at)?;
        let v = self.int_after(m, offset, at, "integer")?;
        u64::try_from(v).map_err(|_| DecodeError::IntegerOutOfRange {
            at,
            value: v,
            range: "u64",
        })
    }

    fn u32_value(&mut self, at: Location) -> Result<u32> {
        let (m, offset) = self.marker(at)?;
        let v = self.int_after(m, offset, at, "integer")?;
        u32::try_from(v).map_err(|_| DecodeError::IntegerOutOfRange {
            at,
            value: v,
            range: "u32",
        })
    }

    fn opt_u32(&mut self, at: Location) -> Result<Option<u32>> {
        if self.peek(at)? == 0xc0 {
            self.pos += 1;
            return Ok(None);
        }
        self.u32_value(at).map(Some)
    }

    fn opt_i64(&mut self, at: Location) -> Result<Option<i64>> {
        let (m, offset) = self.marker(at)?;
        if m == Marker::Null {
            return Ok(None);
        }
        let v = self.int_after(m, offset, at, "integer or nil")?;
        i64::try_from(v)
            .map(Some)
            .map_err(|_| DecodeError::IntegerOutOfRange {
                at,
                value: v,
                range: "i64",
            })
    }

    fn float(&mut self, at: Location) -> Result<f64> {
        let (m, offset) = self.marker(at)?;
        match m {
            Marker::F64 => Ok(f64::from_bits(self.be_u64(at)?)),
            Marker::F32 => Ok(f32::from_bits(self.be_u32(at)?).into()),
            other => Ok(self.int_after(other, offset, at, "float or integer")? as f64),
        }
    }

    /// Length of the string or binary that follows `m`, or `None` if `m` is neither.
    #[inline]
    fn bytes_len_after(&mut self, m: Marker, at: Location) -> Result<Option<usize>> {
        Ok(Some(match m {
            Marker::FixStr(n) => n.into(),
            Marker::Str8 | Marker::Bin8 => self.byte(at)?.into(),
            Marker::Str16 | Marker::Bin16 => self.be_u16(at)?.into(),
            Marker::Str32 | Marker::Bin32 => self.be_u32(at)? as usize,
            _ => return Ok(None),
        }))
    }

    /// A string's bytes (not validated as UTF-8), bounded by [`STRING_MAX_BYTES`].
    #[inline(always)]
    fn str_bytes(&mut self, at: Location) -> Result<(&'a [u8], usize)> {
        // Keys, tags and medium names are fixstr: take them without the general path.
        let offset = self.pos;
        if let Some(&b) = self.buf.get(offset)
            && b & 0xe0 == 0xa0
        {
            let end = offset + 1 + usize::from(b & 0x1f);
            if end <= self.buf.len() {
                self.pos = end;
                return Ok((&self.buf[offset + 1..end], offset));
            }
        }
        self.str_bytes_general(at)
    }

    fn str_bytes_general(&mut self, at: Location) -> Result<(&'a [u8], usize)> {
        let (m, offset) = self.marker(at)?;
        let is_str = matches!(
            m,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32
        );
        if !is_str {
            return Err(Self::unexpected(m, offset, at, "string"));
        }
        let len = self.bytes_len_after(m, at)?.unwrap_or(0);
        if len > STRING_MAX_BYTES {
            return Err(DecodeError::StringTooLong {
                at,
                len_bytes: len,
                max_bytes: STRING_MAX_BYTES,
            });
        }
        Ok((self.take(len, at)?, offset))
    }

    fn opt_string(&mut self, at: Location) -> Result<Option<String>> {
        if self.peek(at)? == 0xc0 {
            self.pos += 1;
            return Ok(None);
        }
        let (bytes, offset) = self.str_bytes(at)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Some(s.to_owned())),
            Err(_) => Err(DecodeError::InvalidUtf8 { at, offset }),
        }
    }

    fn opt_medium(&mut self, at: Location) -> Result<Option<Medium>> {
        if self.peek(at)? == 0xc0 {
            self.pos += 1;
            return Ok(None);
        }
        let (bytes, _) = self.str_bytes(at)?;
        Ok(Some(Medium::from_wire(bytes)))
    }

    #[inline]
    fn hash(&mut self, at: Location) -> Result<EngineHash> {
        let (m, offset) = self.marker(at)?;
        match m {
            // The common cases first: SGLang and vLLM int mode.
            Marker::FixPos(v) => Ok(EngineHash(v.into())),
            Marker::U64 => Ok(EngineHash(self.be_u64(at)?)),
            Marker::I64 => Ok(EngineHash(self.be_u64(at)?)),
            _ => {
                if let Some(len) = self.bytes_len_after(m, at)? {
                    if len > STRING_MAX_BYTES {
                        return Err(DecodeError::StringTooLong {
                            at,
                            len_bytes: len,
                            max_bytes: STRING_MAX_BYTES,
                        });
                    }
                    return Ok(EngineHash::from_bytes(self.take(len, at)?));
                }
                let v = self.int_after(m, offset, at, "integer, binary or string hash")?;
                // Every msgpack integer is in i64 ∪ u64; both keep their 64 bits.
                Ok(EngineHash(v as u64))
            }
        }
    }

    fn opt_hash(&mut self, at: Location) -> Result<Option<EngineHash>> {
        if self.peek(at)? == 0xc0 {
            self.pos += 1;
            return Ok(None);
        }
        self.hash(at).map(Some)
    }

    /// Reads an array header; the declared length is checked against `max` and against the
    /// bytes left (each element takes at least one byte), so the caller may reserve it.
    fn array_len(&mut self, at: Location, max: usize) -> Result<usize> {
        let (m, offset) = self.marker(at)?;
        let len = match m {
            Marker::FixArray(n) => n.into(),
            Marker::Array16 => self.be_u16(at)?.into(),
            Marker::Array32 => self.be_u32(at)? as usize,
            other => return Err(Self::unexpected(other, offset, at, "array")),
        };
        if len > max {
            return Err(DecodeError::TooManyItems { at, len, max });
        }
        if len > self.remaining() {
            return Err(self.truncated(at));
        }
        Ok(len)
    }

    fn map_len_after(&mut self, m: Marker, at: Location) -> Result<Option<usize>> {
        Ok(Some(match m {
            Marker::FixMap(n) => n.into(),
            Marker::Map16 => self.be_u16(at)?.into(),
            Marker::Map32 => self.be_u32(at)? as usize,
            _ => return Ok(None),
        }))
    }

    fn hash_list(&mut self, at: Location) -> Result<Vec<EngineHash>> {
        let len = self.array_len(at, HASHES_PER_EVENT_MAX)?;
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            out.push(self.hash(at)?);
        }
        Ok(out)
    }

    fn token_list(&mut self, at: Location) -> Result<Vec<u32>> {
        let len = self.array_len(at, TOKENS_PER_EVENT_MAX)?;
        let mut out = Vec::with_capacity(len);
        // The hot loop of the whole decoder: complete unsigned forms are read straight from the
        // slice; anything else (including every error) goes through the general path.
        let buf = self.buf;
        let mut pos = self.pos;
        for _ in 0..len {
            let rest = &buf[pos.min(buf.len())..];
            let token = match *rest {
                [b @ 0x00..=0x7f, ..] => {
                    pos += 1;
                    u32::from(b)
                }
                [0xcd, a, b, ..] => {
                    pos += 3;
                    u32::from(u16::from_be_bytes([a, b]))
                }
                [0xcc, v, ..] => {
                    pos += 2;
                    u32::from(v)
                }
                [0xce, a, b, c, d, ..] => {
                    pos += 5;
                    u32::from_be_bytes([a, b, c, d])
                }
                [0x90..=0x9f | 0xdc | 0xdd, ..] => {
                    // SGLang with bigram/EAGLE speculative decoding may send each position as a
                    // `[token, next_token]` pair; flattened, that is the form it otherwise sends.
                    self.pos = pos;
                    let inner = self.array_len(at, TOKENS_PER_EVENT_MAX)?;
                    if out.len() + inner > TOKENS_PER_EVENT_MAX {
                        return Err(DecodeError::TooManyItems {
                            at,
                            len: out.len() + inner,
                            max: TOKENS_PER_EVENT_MAX,
                        });
                    }
                    for _ in 0..inner {
                        out.push(self.u32_value(at)?);
                    }
                    pos = self.pos;
                    continue;
                }
                _ => {
                    self.pos = pos;
                    let token = self.u32_value(at)?;
                    pos = self.pos;
                    token
                }
            };
            out.push(token);
        }
        self.pos = pos;
        Ok(out)
    }

    /// One digest per entry: xxh3 of the entry's exact encoded bytes, `None` for a nil entry.
    fn extra_keys(&mut self, at: Location) -> Result<Vec<Option<u64>>> {
        if self.peek(at)? == 0xc0 {
            self.pos += 1;
            return Ok(Vec::new());
        }
        let len = self.array_len(at, HASHES_PER_EVENT_MAX)?;
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            if self.peek(at)? == 0xc0 {
                self.pos += 1;
                out.push(None);
                continue;
            }
            let start = self.pos;
            self.skip(at, 0)?;
            out.push(Some(xxh3_64(&self.buf[start..self.pos])));
        }
        Ok(out)
    }

    /// Skips one value of any shape without allocating. `depth` counts the containers already
    /// entered within the skipped value; time is bounded by the payload length because every
    /// element consumes at least one byte.
    fn skip(&mut self, at: Location, depth: usize) -> Result<()> {
        let (m, offset) = self.marker(at)?;
        let fixed: usize = match m {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                0
            }
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => usize::from(self.byte(at)?) + 1,
            Marker::Ext16 => usize::from(self.be_u16(at)?) + 1,
            Marker::Ext32 => self.be_u32(at)? as usize + 1,
            Marker::FixStr(_)
            | Marker::Str8
            | Marker::Str16
            | Marker::Str32
            | Marker::Bin8
            | Marker::Bin16
            | Marker::Bin32 => self.bytes_len_after(m, at)?.unwrap_or(0),
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let len = match m {
                    Marker::FixArray(n) => n.into(),
                    Marker::Array16 => self.be_u16(at)?.into(),
                    _ => self.be_u32(at)? as usize,
                };
                return self.skip_items(len, at, depth);
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let len = self.map_len_after(m, at)?.unwrap_or(0);
                return self.skip_items(len.saturating_mul(2), at, depth);
            }
            Marker::Reserved => return Err(DecodeError::ReservedMarker { at, offset }),
        };
        self.take(fixed, at).map(|_| ())
    }

    fn skip_items(&mut self, items: usize, at: Location, depth: usize) -> Result<()> {
        if depth + 1 > NESTING_DEPTH_MAX {
            return Err(DecodeError::NestingTooDeep {
                at,
                max_depth: NESTING_DEPTH_MAX,
            });
        }
        if items > self.remaining() {
            return Err(self.truncated(at));
        }
        for _ in 0..items {
            self.skip(at, depth + 1)?;
        }
        Ok(())
    }

    fn tag(&mut self, at: Location) -> Result<Tag> {
        let (bytes, _) = self.str_bytes(at)?;
        match bytes {
            b"BlockStored" => Ok(Tag::Stored),
            b"BlockRemoved" => Ok(Tag::Removed),
            b"AllBlocksCleared" => Ok(Tag::Cleared),
            other => Err(DecodeError::UnknownTag {
                at,
                tag: String::from_utf8_lossy(&other[..other.len().min(64)]).into_owned(),
            }),
        }
    }

    fn batch(&mut self) -> Result<EventBatch> {
        let at = batch("batch");
        let (m, offset) = self.marker(at)?;
        match m {
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                self.pos = offset;
                let len = self.array_len(at, usize::MAX)?;
                if len < 2 {
                    return Err(DecodeError::ArrayTooShort { at, len, min: 2 });
                }
                let ts = self.float(batch("ts"))?;
                let events = self.events()?;
                let mut dp_rank = None;
                if len >= 3 {
                    dp_rank = self.opt_u32(batch("dp_rank"))?;
                }
                for _ in 3..len {
                    self.skip(batch("trailing element"), 0)?;
                }
                Ok(EventBatch {
                    ts,
                    events,
                    dp_rank,
                })
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let len = self.map_len_after(m, at)?.unwrap_or(0);
                let (mut ts, mut events, mut dp_rank) = (None, None, None);
                for _ in 0..len {
                    if !self.peek_is_str(at)? {
                        self.skip(batch("non-string key"), 0)?;
                        self.skip(batch("non-string key"), 0)?;
                        continue;
                    }
                    let (key, _) = self.str_bytes(batch("key"))?;
                    match key {
                        b"ts" => ts = Some(self.float(batch("ts"))?),
                        b"events" => events = Some(self.events()?),
                        b"data_parallel_rank" => {
                            dp_rank = self.opt_u32(batch("data_parallel_rank"))?
                        }
                        b"attn_dp_rank" => dp_rank = self.opt_u32(batch("attn_dp_rank"))?,
                        _ => self.skip(batch("unknown key"), 0)?,
                    }
                }
                Ok(EventBatch {
                    ts: ts.ok_or(DecodeError::MissingField { at: batch("ts") })?,
                    events: events.ok_or(DecodeError::MissingField {
                        at: batch("events"),
                    })?,
                    dp_rank,
                })
            }
            other => Err(Self::unexpected(other, offset, at, "array or map batch")),
        }
    }

    fn peek_is_str(&self, at: Location) -> Result<bool> {
        let b = self.peek(at)?;
        Ok(matches!(b, 0xa0..=0xbf | 0xd9 | 0xda | 0xdb))
    }

    fn events(&mut self) -> Result<Vec<KvEvent>> {
        let len = self.array_len(batch("events"), EVENTS_PER_BATCH_MAX)?;
        let mut out = Vec::with_capacity(len);
        for index in 0..len {
            out.push(self.event(index)?);
        }
        Ok(out)
    }

    fn event(&mut self, index: usize) -> Result<KvEvent> {
        let at = event(index, "event");
        let (m, offset) = self.marker(at)?;
        if let Some(len) = self.map_len_after(m, at)? {
            return self.map_event(index, len);
        }
        let len = match m {
            Marker::FixArray(n) => n.into(),
            Marker::Array16 => self.be_u16(at)?.into(),
            Marker::Array32 => self.be_u32(at)? as usize,
            other => return Err(Self::unexpected(other, offset, at, "map or array event")),
        };
        self.array_event(index, len)
    }

    fn map_event(&mut self, index: usize, len: usize) -> Result<KvEvent> {
        let mut tag = None;
        let mut f = Fields::default();
        for _ in 0..len {
            if !self.peek_is_str(event(index, "key"))? {
                self.skip(event(index, "non-string key"), 0)?;
                self.skip(event(index, "non-string key"), 0)?;
                continue;
            }
            let (key, _) = self.str_bytes(event(index, "key"))?;
            match key {
                b"type" => tag = Some(self.tag(event(index, "type"))?),
                b"block_hashes" => {
                    f.block_hashes = Some(self.hash_list(event(index, "block_hashes"))?)
                }
                b"parent_block_hash" => {
                    f.parent_block_hash = self.opt_hash(event(index, "parent_block_hash"))?
                }
                b"token_ids" => f.token_ids = Some(self.token_list(event(index, "token_ids"))?),
                b"block_size" => f.block_size = Some(self.u32_value(event(index, "block_size"))?),
                b"lora_id" => f.lora_id = self.opt_i64(event(index, "lora_id"))?,
                b"lora_name" => f.lora_name = self.opt_string(event(index, "lora_name"))?,
                b"medium" => f.medium = self.opt_medium(event(index, "medium"))?,
                b"extra_keys" => f.extra_keys = self.extra_keys(event(index, "extra_keys"))?,
                b"group_idx" => f.group_idx = self.opt_i64(event(index, "group_idx"))?,
                _ => self.skip(event(index, "unknown key"), 0)?,
            }
        }
        let tag = tag.ok_or(DecodeError::MissingField {
            at: event(index, "type"),
        })?;
        f.build(tag, index)
    }

    /// `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, ...]`,
    /// `["BlockRemoved", block_hashes, medium, ...]`, `["AllBlocksCleared", ...]`. Positions past
    /// `medium` are skipped: engines put different things there (SGLang a metadata map).
    fn array_event(&mut self, index: usize, len: usize) -> Result<KvEvent> {
        if len == 0 {
            return Err(DecodeError::MissingField {
                at: event(index, "type"),
            });
        }
        if len > self.remaining() {
            return Err(self.truncated(event(index, "event")));
        }
        let tag = self.tag(event(index, "type"))?;
        let mut f = Fields::default();
        for pos in 1..len {
            match (tag, pos) {
                (Tag::Stored | Tag::Removed, 1) => {
                    f.block_hashes = Some(self.hash_list(event(index, "block_hashes"))?)
                }
                (Tag::Stored, 2) => {
                    f.parent_block_hash = self.opt_hash(event(index, "parent_block_hash"))?
                }
                (Tag::Stored, 3) => f.token_ids = Some(self.token_list(event(index, "token_ids"))?),
                (Tag::Stored, 4) => {
                    f.block_size = Some(self.u32_value(event(index, "block_size"))?)
                }
                (Tag::Stored, 5) => f.lora_id = self.opt_i64(event(index, "lora_id"))?,
                (Tag::Stored, 6) | (Tag::Removed, 2) => {
                    f.medium = self.opt_medium(event(index, "medium"))?
                }
                _ => self.skip(event(index, "trailing element"), 0)?,
            }
        }
        f.build(tag, index)
    }

    fn load_stat(&mut self) -> Result<LoadStat> {
        let at = Location::LoadStat { field: "record" };
        let len = self.array_len(at, usize::MAX)?;
        if len < 5 {
            return Err(DecodeError::ArrayTooShort { at, len, min: 5 });
        }
        let (tag, _) = self.str_bytes(Location::LoadStat { field: "type" })?;
        if tag != b"LoadStat" {
            return Err(DecodeError::UnknownTag {
                at: Location::LoadStat { field: "type" },
                tag: String::from_utf8_lossy(&tag[..tag.len().min(64)]).into_owned(),
            });
        }
        let num_running_reqs = self.u64_value(Location::LoadStat {
            field: "num_running_reqs",
        })?;
        let num_waiting_reqs = self.u64_value(Location::LoadStat {
            field: "num_waiting_reqs",
        })?;
        let num_tokens = self.u64_value(Location::LoadStat {
            field: "num_tokens",
        })?;
        let max_total_num_tokens = self.u64_value(Location::LoadStat {
            field: "max_total_num_tokens",
        })?;
        let mut dp_rank = None;
        if len >= 6 {
            dp_rank = self.opt_u32(Location::LoadStat {
                field: "attn_dp_rank",
            })?;
        }
        for _ in 6..len {
            self.skip(
                Location::LoadStat {
                    field: "trailing element",
                },
                0,
            )?;
        }
        Ok(LoadStat {
            num_running_reqs,
            num_waiting_reqs,
            num_tokens,
            max_total_num_tokens,
            dp_rank,
        })
    }
}

/// The union of every event's fields, filled in whatever order the payload lists them.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    lora_name: Option<String>,
    medium: Option<Medium>,
    extra_keys: Vec<Option<u64>>,
    group_idx: Option<i64>,
}

impl Fields {
    fn build(self, tag: Tag, index: usize) -> Result<KvEvent> {
        match tag {
            Tag::Cleared => Ok(KvEvent::AllBlocksCleared),
            Tag::Removed => Ok(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.ok_or(DecodeError::MissingField {
                    at: event(index, "block_hashes"),
                })?,
                medium: self.medium,
                group_idx: self.group_idx,
            })),
            Tag::Stored => {
                let block_hashes = self.block_hashes.ok_or(DecodeError::MissingField {
                    at: event(index, "block_hashes"),
                })?;
                let token_ids = self.token_ids.ok_or(DecodeError::MissingField {
                    at: event(index, "token_ids"),
                })?;
                // Every engine sends block_size; should one omit it, the tokens per block is
                // what it would have said in the normal case.
                let block_size = self.block_size.unwrap_or_else(|| {
                    u32::try_from(token_ids.len() / block_hashes.len().max(1)).unwrap_or(u32::MAX)
                });
                Ok(KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash: self.parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id: self.lora_id,
                    lora_name: self.lora_name,
                    medium: self.medium,
                    extra_keys: self.extra_keys,
                    group_idx: self.group_idx,
                }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::{put_array_len, put_f64, put_int, put_map_len, put_str, put_uint};

    /// A batch `[1.0, [<event>], 0]` around a hand-built event.
    fn batch_around(event: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut b = Vec::new();
        put_array_len(&mut b, 3);
        put_f64(&mut b, 1.0);
        put_array_len(&mut b, 1);
        event(&mut b);
        put_uint(&mut b, 0);
        b
    }

    fn stored_map(b: &mut Vec<u8>, skip: &str) {
        let fields = [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
        ];
        put_map_len(b, fields.iter().filter(|f| **f != skip).count());
        for f in fields.into_iter().filter(|f| *f != skip) {
            put_str(b, f);
            match f {
                "type" => put_str(b, "BlockStored"),
                "block_hashes" | "token_ids" => {
                    put_array_len(b, 1);
                    put_uint(b, 7);
                }
                "parent_block_hash" => b.push(0xc0),
                _ => put_uint(b, 1),
            }
        }
    }

    #[test]
    fn empty_payload_is_rejected() {
        assert_eq!(decode_batch(&[]), Err(DecodeError::EmptyPayload));
        assert_eq!(decode_load_stat(&[]), Err(DecodeError::EmptyPayload));
    }

    #[test]
    fn payload_over_the_byte_limit_is_rejected_before_reading() {
        let huge = vec![0x90u8; PAYLOAD_MAX_BYTES + 1];
        assert_eq!(
            decode_batch(&huge),
            Err(DecodeError::PayloadTooLarge {
                len_bytes: PAYLOAD_MAX_BYTES + 1,
                max_bytes: PAYLOAD_MAX_BYTES
            })
        );
    }

    #[test]
    fn trailing_bytes_after_the_batch_are_rejected() {
        let mut b = batch_around(|b| {
            put_map_len(b, 1);
            put_str(b, "type");
            put_str(b, "AllBlocksCleared");
        });
        let end = b.len();
        b.extend_from_slice(&[0xc0, 0xc0]);
        assert_eq!(
            decode_batch(&b),
            Err(DecodeError::TrailingBytes {
                offset: end,
                trailing_bytes: 2
            })
        );
    }

    #[test]
    fn unknown_event_tag_is_named_with_its_event_index() {
        let b = batch_around(|b| {
            put_map_len(b, 1);
            put_str(b, "type");
            put_str(b, "BlockMoved");
        });
        assert_eq!(
            decode_batch(&b),
            Err(DecodeError::UnknownTag {
                at: Location::Event {
                    index: 0,
                    field: "type"
                },
                tag: "BlockMoved".into()
            })
        );
    }

    #[test]
    fn missing_required_fields_are_named() {
        for field in ["type", "block_hashes", "token_ids"] {
            let b = batch_around(|b| stored_map(b, field));
            assert_eq!(
                decode_batch(&b),
                Err(DecodeError::MissingField {
                    at: Location::Event { index: 0, field }
                }),
                "without {field}"
            );
        }
    }

    #[test]
    fn absent_block_size_reads_as_tokens_per_block() {
        let b = batch_around(|b| stored_map(b, "block_size"));
        let KvEvent::BlockStored(s) = &decode_batch(&b).unwrap().events[0] else {
            panic!("expected BlockStored");
        };
        assert_eq!(s.block_size, 1);
    }

    #[test]
    fn token_ids_outside_u32_are_out_of_range() {
        for (value, big) in [(-1i128, false), (1i128 << 32, true)] {
            let b = batch_around(|b| {
                put_map_len(b, 3);
                put_str(b, "type");
                put_str(b, "BlockStored");
                put_str(b, "block_hashes");
                put_array_len(b, 0);
                put_str(b, "token_ids");
                put_array_len(b, 1);
                if big {
                    put_uint(b, 1 << 32);
                } else {
                    put_int(b, -1);
                }
            });
            assert_eq!(
                decode_batch(&b),
                Err(DecodeError::IntegerOutOfRange {
                    at: Location::Event {
                        index: 0,
                        field: "token_ids"
                    },
                    value,
                    range: "u32"
                })
            );
        }
    }

    #[test]
    fn huge_declared_lengths_fail_without_allocating_for_them() {
        // events: array32 of 4 billion entries in a 16-byte payload.
        let mut b = Vec::new();
        put_array_len(&mut b, 3);
        put_f64(&mut b, 1.0);
        b.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(
            decode_batch(&b),
            Err(DecodeError::TooManyItems {
                at: Location::Batch { field: "events" },
                len: u32::MAX as usize,
                max: EVENTS_PER_BATCH_MAX
            })
        );
        // block_hashes: within the limit, but more than the bytes left could hold.
        let b = batch_around(|b| {
            put_map_len(b, 2);
            put_str(b, "type");
            put_str(b, "BlockRemoved");
            put_str(b, "block_hashes");
            b.extend_from_slice(&[0xdc, 0xff, 0x00]);
        });
        assert!(
            matches!(decode_batch(&b), Err(DecodeError::Truncated { .. })),
            "got {:?}",
            decode_batch(&b)
        );
    }

    #[test]
    fn deeply_nested_unknown_values_are_rejected_at_the_depth_limit() {
        let nested = |depth: usize| {
            batch_around(|b| {
                put_map_len(b, 2);
                put_str(b, "type");
                put_str(b, "AllBlocksCleared");
                put_str(b, "future_field");
                for _ in 0..depth {
                    put_array_len(b, 1);
                }
                b.push(0xc0);
            })
        };
        assert!(decode_batch(&nested(NESTING_DEPTH_MAX)).is_ok());
        assert_eq!(
            decode_batch(&nested(NESTING_DEPTH_MAX + 1)),
            Err(DecodeError::NestingTooDeep {
                at: Location::Event {
                    index: 0,
                    field: "unknown key"
                },
                max_depth: NESTING_DEPTH_MAX
            })
        );
    }

    #[test]
    fn token_pairs_are_flattened_in_order() {
        let b = batch_around(|b| {
            put_map_len(b, 3);
            put_str(b, "type");
            put_str(b, "BlockStored");
            put_str(b, "block_hashes");
            put_array_len(b, 1);
            put_uint(b, 1);
            put_str(b, "token_ids");
            put_array_len(b, 2);
            for pair in [[10u64, 11], [11, 70_000]] {
                put_array_len(b, 2);
                put_uint(b, pair[0]);
                put_uint(b, pair[1]);
            }
        });
        let KvEvent::BlockStored(s) = &decode_batch(&b).unwrap().events[0] else {
            panic!("expected BlockStored");
        };
        assert_eq!(s.token_ids, vec![10, 11, 11, 70_000]);
    }

    #[test]
    fn float32_and_integer_timestamps_are_accepted() {
        let mut b = vec![0x92, 0xca];
        b.extend_from_slice(&1.5f32.to_bits().to_be_bytes());
        b.push(0x90);
        assert_eq!(decode_batch(&b).unwrap().ts, 1.5);
        let b = [0x92, 0xcd, 0x01, 0x00, 0x90];
        assert_eq!(decode_batch(&b).unwrap().ts, 256.0);
    }

    #[test]
    fn batch_shapes_missing_ts_or_events_are_rejected() {
        assert_eq!(
            decode_batch(&[0x91, 0x00]),
            Err(DecodeError::ArrayTooShort {
                at: Location::Batch { field: "batch" },
                len: 1,
                min: 2
            })
        );
        let mut b = Vec::new();
        put_map_len(&mut b, 1);
        put_str(&mut b, "events");
        put_array_len(&mut b, 0);
        assert_eq!(
            decode_batch(&b),
            Err(DecodeError::MissingField {
                at: Location::Batch { field: "ts" }
            })
        );
    }

    #[test]
    fn negative_rank_is_out_of_range() {
        let b = [0x93, 0x00, 0x90, 0xff];
        assert_eq!(
            decode_batch(&b),
            Err(DecodeError::IntegerOutOfRange {
                at: Location::Batch { field: "dp_rank" },
                value: -1,
                range: "u32"
            })
        );
    }

    #[test]
    fn signed_and_unsigned_hashes_keep_their_64_bits() {
        let b = batch_around(|b| {
            put_map_len(b, 2);
            put_str(b, "type");
            put_str(b, "BlockRemoved");
            put_str(b, "block_hashes");
            put_array_len(b, 4);
            put_int(b, -1);
            put_uint(b, u64::MAX);
            put_int(b, -200);
            put_str(b, "abc");
        });
        let KvEvent::BlockRemoved(r) = &decode_batch(&b).unwrap().events[0] else {
            panic!("expected BlockRemoved");
        };
        assert_eq!(
            r.block_hashes,
            vec![
                EngineHash(u64::MAX),
                EngineHash(u64::MAX),
                EngineHash::from_i64(-200),
                EngineHash::from_bytes(b"abc")
            ]
        );
    }

    #[test]
    fn medium_names_map_to_tiers() {
        let table: [(&[u8], Medium); 15] = [
            (b"GPU", Medium::Device),
            (b"DEVICE", Medium::Device),
            (b"CPU", Medium::Host),
            (b"CPU_PINNED", Medium::Host),
            (b"CPU_TIER1", Medium::Host),
            (b"CPU_TIER2", Medium::Disk),
            (b"DISK", Medium::Disk),
            (b"NVME", Medium::Disk),
            (b"STORAGE", Medium::Disk),
            (b"EXTERNAL", Medium::External),
            (b"NETWORK", Medium::External),
            (b"REMOTE", Medium::External),
            (b"SHARED", Medium::External),
            (b"gpu", Medium::Unknown),
            (b"TAPE", Medium::Unknown),
        ];
        for (name, want) in table {
            assert_eq!(
                Medium::from_wire(name),
                want,
                "{}",
                String::from_utf8_lossy(name)
            );
        }
    }

    #[test]
    fn load_stat_with_another_tag_or_too_few_fields_is_rejected() {
        let mut b = Vec::new();
        put_array_len(&mut b, 5);
        put_str(&mut b, "Other");
        b.extend_from_slice(&[1, 2, 3, 4]);
        assert_eq!(
            decode_load_stat(&b),
            Err(DecodeError::UnknownTag {
                at: Location::LoadStat { field: "type" },
                tag: "Other".into()
            })
        );
        let mut b = Vec::new();
        put_array_len(&mut b, 4);
        put_str(&mut b, "LoadStat");
        b.extend_from_slice(&[1, 2, 3]);
        assert_eq!(
            decode_load_stat(&b),
            Err(DecodeError::ArrayTooShort {
                at: Location::LoadStat { field: "record" },
                len: 4,
                min: 5
            })
        );
    }

    #[test]
    fn errors_say_where_in_words() {
        let e = DecodeError::MissingField {
            at: Location::Event {
                index: 3,
                field: "token_ids",
            },
        };
        assert_eq!(
            e.to_string(),
            "event 3 field `token_ids`: required field missing"
        );
    }
}
