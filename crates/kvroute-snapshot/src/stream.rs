//! Decoding a binary snapshot while its bytes arrive, never holding the envelope or the
//! decompressed body whole.
//!
//! Why: a booting replica used to receive the whole envelope (0.57 GB at 1,024 ranks x 100,000
//! blocks), verify its MAC, inflate it into a second whole buffer, and only then parse. Reading
//! from any [`Read`] instead lets the fetch hand the decoder each chunk as it comes off the
//! socket: inflating and parsing overlap the transfer, and neither buffer exists. What is held is
//! the decoded columns (what the graft needs anyway), one read chunk and the decompressor's window.
//!
//! The price is the order of checks. The in-memory decode verifies the MAC before it inflates a
//! byte; a stream's tag comes last, so here the MAC is verified at the end, and nothing decoded
//! leaves this module before it verifies. Unauthenticated bytes can still make the decoder work,
//! but only within the same [`DecodeLimits`] (input bytes, decoded bytes, counts) that bound any
//! body. One bound is looser than in memory: a column is preallocated from its declared count,
//! which a whole body caps by the bytes actually present, while a stream's length is unknown, so
//! here the cap is the decoded-byte budget (reserved, not yet touched, memory). And such bytes
//! can never make the decoder answer anything but [`SnapshotDecodeError::MacMismatch`]: when
//! a keyed decode fails for any reason, the rest of the input is read (bounded) and the MAC judged
//! first, so a forged body is reported as forged, exactly as the in-memory decode reports it.
//!
//! The fields are parsed by the same function as the in-memory decode ([`decode_fields`] over a
//! [`FieldSource`]), so the two accept exactly the same bodies; a property test holds them to it.

use std::io::{self, BufRead, BufReader, Read};

use hmac::Mac;
use kvroute_wire::snapshot::IndexSnapshot;
use xxhash_rust::xxh3::Xxh3;

use crate::binary::{CHECKSUM_BYTES, Envelope, HEADER_BYTES, MAC_TAG_BYTES, decode_fields};
use crate::binary::{HmacSha256, read_envelope_header};
use crate::compress::{Compression, ZSTD_WINDOW_LOG_MAX};
use crate::error::SnapshotDecodeError;
use crate::limits::DecodeLimits;
use crate::varint::FieldSource;

/// Bytes pulled from the input, and from the decompressor, per read.
pub const STREAM_READ_CHUNK_BYTES: usize = 64 * 1024;

/// Decodes a binary snapshot from `input` as it is read, under the same rules as
/// [`crate::decode_binary`]: the same limits (`max_bytes` bounds the input and, separately, the
/// decompressed body), the same MAC rule (with `mac_key`, a body without a MAC, or whose MAC does
/// not verify, is refused; without a key a MAC trailer is skipped unverified), the same checksum.
/// An I/O error from `input` ends the decode as [`SnapshotDecodeError::Decompress`] naming it.
pub fn decode_binary_stream<R: Read>(
    input: R,
    limits: &DecodeLimits,
    mac_key: Option<&[u8]>,
) -> Result<IndexSnapshot, SnapshotDecodeError> {
    let mut tail = MacTail::new(input, limits.max_bytes);
    let mut header = [0u8; HEADER_BYTES];
    tail.read_exact_raw(&mut header)?;
    let Envelope {
        version,
        compression,
        has_mac,
        mac,
    } = read_envelope_header(&header, mac_key)?;
    tail.arm(mac, if has_mac { MAC_TAG_BYTES } else { 0 }, &header);

    let decoded = decode_payload(&mut tail, compression, limits, version);
    let authenticated = tail.finish();
    match (decoded, authenticated) {
        (_, Err(TailVerdict::OverLimit { len_bytes })) => Err(SnapshotDecodeError::InputTooLarge {
            len_bytes,
            limit_bytes: limits.max_bytes,
        }),
        // A keyed decode that failed for any reason: the MAC speaks first, as it does when the
        // whole body is in memory.
        (_, Err(TailVerdict::MacShort)) => Err(SnapshotDecodeError::Truncated { field: "MAC tag" }),
        (_, Err(TailVerdict::MacMismatch)) => Err(SnapshotDecodeError::MacMismatch),
        (Err(e), _) => Err(e),
        (Ok(_), Err(TailVerdict::Io(reason))) => Err(SnapshotDecodeError::Decompress { reason }),
        (Ok(snapshot), Ok(())) => Ok(snapshot),
    }
}

/// Inflates and parses the payload, then checks the checksum and that nothing follows it.
fn decode_payload<R: Read>(
    tail: &mut MacTail<R>,
    compression: Compression,
    limits: &DecodeLimits,
    version: u8,
) -> Result<IndexSnapshot, SnapshotDecodeError> {
    match compression {
        Compression::None => parse_body(&mut *tail, limits, version).map(|(snapshot, _)| snapshot),
        Compression::Gzip => {
            let decoder = flate2::bufread::GzDecoder::new(BufReader::with_capacity(
                STREAM_READ_CHUNK_BYTES,
                &mut *tail,
            ));
            let (snapshot, decoder) = parse_body(decoder, limits, version)?;
            // One gzip member and nothing after it, as the in-memory decode demands.
            let mut rest = decoder.into_inner();
            let buffered = rest.buffer().len();
            rest.consume(buffered);
            let after = drain(rest.into_inner())?;
            match buffered + after {
                0 => Ok(snapshot),
                trailing_bytes => Err(SnapshotDecodeError::TrailingBytes { trailing_bytes }),
            }
        }
        Compression::Zstd => {
            let mut decoder = zstd::stream::read::Decoder::with_buffer(BufReader::with_capacity(
                STREAM_READ_CHUNK_BYTES,
                &mut *tail,
            ))
            .map_err(io_error)?;
            decoder
                .window_log_max(ZSTD_WINDOW_LOG_MAX)
                .map_err(io_error)?;
            // Frames are read until the input ends (the parser's end-of-body check pulls the
            // decoder to its end), so garbage after the payload is a decompression error here
            // as in memory.
            parse_body(decoder, limits, version).map(|(snapshot, _)| snapshot)
        }
    }
}

/// Parses the decompressed body read from `body` and judges it as the in-memory decode does:
/// the body's last 8 bytes are the checksum of everything before them, and that is judged
/// before any fault in the fields is believed (a body damaged in transit is `ChecksumMismatch`,
/// transient, never a malformed field, which would bar the peer for the rest of the boot); the
/// fields must then end exactly where the checksum begins. Gives `body` back so the caller can
/// judge what followed the compressed payload.
fn parse_body<B: Read>(
    body: B,
    limits: &DecodeLimits,
    version: u8,
) -> Result<(IndexSnapshot, B), SnapshotDecodeError> {
    let mut source = StreamSource::new(body, limits.max_bytes);
    let parsed = decode_fields(&mut source, limits, version);
    if let Err(
        e @ (SnapshotDecodeError::TooLarge { .. } | SnapshotDecodeError::Decompress { .. }),
    ) = &parsed
    {
        return Err(e.clone());
    }
    let after_fields = source.read_to_end()?;
    if source.read_bytes < CHECKSUM_BYTES {
        return Err(SnapshotDecodeError::Truncated { field: "checksum" });
    }
    let stored = u64::from_le_bytes(source.lag);
    let computed = source.hasher.digest();
    if stored != computed {
        return Err(SnapshotDecodeError::ChecksumMismatch { stored, computed });
    }
    let snapshot = parsed?;
    match after_fields.checked_sub(CHECKSUM_BYTES) {
        Some(0) => Ok((snapshot, source.inner)),
        Some(trailing_bytes) => Err(SnapshotDecodeError::TrailingBytes { trailing_bytes }),
        // The fields ran into the checksum's bytes: the content alone ends mid-field.
        None => Err(SnapshotDecodeError::Truncated { field: "checksum" }),
    }
}

/// Reads `reader` to its end, counting the bytes.
fn drain<R: Read>(mut reader: R) -> Result<usize, SnapshotDecodeError> {
    io::copy(&mut reader, &mut io::sink())
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
        .map_err(io_error)
}

fn io_error(e: io::Error) -> SnapshotDecodeError {
    SnapshotDecodeError::Decompress {
        reason: e.to_string(),
    }
}

/// How the envelope's end was judged.
#[derive(Debug)]
enum TailVerdict {
    OverLimit { len_bytes: usize },
    MacShort,
    MacMismatch,
    Io(String),
}

/// The raw envelope: counts input bytes against the limit, feeds every byte before the tag to the
/// MAC, and holds the last `tag_len` bytes back from its reader, since only the input's end says
/// which bytes are the tag.
struct MacTail<R: Read> {
    inner: R,
    mac: Option<HmacSha256>,
    tag_len: usize,
    /// Bytes read from `inner` and not yet handed on; the last `tag_len` of them may be the tag.
    pending: Vec<u8>,
    pending_start: usize,
    input_bytes: usize,
    max_input_bytes: usize,
    ended: bool,
    over_limit: bool,
}

impl<R: Read> MacTail<R> {
    fn new(inner: R, max_input_bytes: usize) -> Self {
        MacTail {
            inner,
            mac: None,
            tag_len: 0,
            pending: Vec::with_capacity(STREAM_READ_CHUNK_BYTES + MAC_TAG_BYTES),
            pending_start: 0,
            input_bytes: 0,
            max_input_bytes,
            ended: false,
            over_limit: false,
        }
    }

    /// The header, read before anyone knows whether a tag follows.
    fn read_exact_raw(&mut self, out: &mut [u8]) -> Result<(), SnapshotDecodeError> {
        let mut filled = 0;
        while filled < out.len() {
            match self.read(&mut out[filled..]) {
                Ok(0) => return Err(SnapshotDecodeError::Truncated { field: "header" }),
                Ok(n) => filled += n,
                Err(e) if self.over_limit => {
                    let _ = e;
                    return Err(SnapshotDecodeError::InputTooLarge {
                        len_bytes: self.input_bytes,
                        limit_bytes: self.max_input_bytes,
                    });
                }
                Err(e) => return Err(io_error(e)),
            }
        }
        Ok(())
    }

    /// From here on, `tag_len` bytes are held back and the bytes handed on feed `mac`.
    fn arm(&mut self, mac: Option<HmacSha256>, tag_len: usize, header: &[u8]) {
        self.mac = mac;
        if let Some(mac) = &mut self.mac {
            mac.update(header);
        }
        self.tag_len = tag_len;
    }

    /// Reads what is left (bounded by the input limit) and judges the tag: its presence whenever
    /// the header announced one, its value when keyed.
    fn finish(mut self) -> Result<(), TailVerdict> {
        if self.over_limit {
            return Err(TailVerdict::OverLimit {
                len_bytes: self.input_bytes,
            });
        }
        if self.tag_len == 0 {
            return Ok(());
        }
        // Even unkeyed, a body too short to hold its announced tag is refused as such, as the
        // in-memory decode does.
        if let Err(e) = io::copy(&mut self, &mut io::sink()) {
            return Err(if self.over_limit {
                TailVerdict::OverLimit {
                    len_bytes: self.input_bytes,
                }
            } else {
                TailVerdict::Io(e.to_string())
            });
        }
        let tag = &self.pending[self.pending_start..];
        if tag.len() < self.tag_len {
            return Err(TailVerdict::MacShort);
        }
        match self.mac.take() {
            Some(mac) => mac.verify_slice(tag).map_err(|_| TailVerdict::MacMismatch),
            None => Ok(()),
        }
    }
}

impl<R: Read> Read for MacTail<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            let held = self.pending.len() - self.pending_start;
            let releasable = held.saturating_sub(self.tag_len);
            if releasable > 0 && !out.is_empty() {
                let n = releasable.min(out.len());
                let released = &self.pending[self.pending_start..self.pending_start + n];
                out[..n].copy_from_slice(released);
                if let Some(mac) = &mut self.mac {
                    mac.update(released);
                }
                self.pending_start += n;
                return Ok(n);
            }
            if self.ended || out.is_empty() {
                return Ok(0);
            }
            self.pending.drain(..self.pending_start);
            self.pending_start = 0;
            let old_len = self.pending.len();
            self.pending.resize(old_len + STREAM_READ_CHUNK_BYTES, 0);
            let read = loop {
                match self.inner.read(&mut self.pending[old_len..]) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    other => break other,
                }
            };
            let n = match read {
                Ok(n) => n,
                Err(e) => {
                    self.pending.truncate(old_len);
                    return Err(e);
                }
            };
            self.pending.truncate(old_len + n);
            if n == 0 {
                self.ended = true;
                continue;
            }
            self.input_bytes = self.input_bytes.saturating_add(n);
            if self.input_bytes > self.max_input_bytes {
                self.over_limit = true;
                return Err(io::Error::other("snapshot input passes its byte limit"));
            }
        }
    }
}

/// A [`FieldSource`] over a decompressed body arriving from a [`Read`]: one buffer of
/// [`STREAM_READ_CHUNK_BYTES`] and a budget of `max_bytes` decoded bytes. Every byte read is
/// hashed as it arrives except the latest [`CHECKSUM_BYTES`], held in `lag`: at the end of the
/// body `lag` is the stored checksum and `hasher` has seen exactly the content before it, wherever
/// the parser stopped.
struct StreamSource<B: Read> {
    inner: B,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    hasher: Xxh3,
    lag: [u8; CHECKSUM_BYTES],
    /// Bytes taken out of `inner` so far.
    read_bytes: usize,
    max_bytes: usize,
}

impl<B: Read> StreamSource<B> {
    fn new(inner: B, max_bytes: usize) -> Self {
        StreamSource {
            inner,
            buf: vec![0u8; STREAM_READ_CHUNK_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            hasher: Xxh3::new(),
            lag: [0u8; CHECKSUM_BYTES],
            read_bytes: 0,
            max_bytes,
        }
    }

    /// Refills the (fully consumed) buffer. `Ok(false)` at the end of the body.
    fn refill(&mut self) -> Result<bool, SnapshotDecodeError> {
        debug_assert_eq!(self.start, self.end);
        self.start = 0;
        self.end = 0;
        let n = loop {
            match self.inner.read(&mut self.buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other.map_err(io_error)?,
            }
        };
        let lagged = self.read_bytes.min(CHECKSUM_BYTES);
        self.read_bytes = self.read_bytes.saturating_add(n);
        if self.read_bytes > self.max_bytes {
            return Err(SnapshotDecodeError::TooLarge {
                limit_bytes: self.max_bytes,
            });
        }
        self.end = n;
        self.hash_with_lag(lagged, n);
        Ok(n > 0)
    }

    /// Moves the bytes that are no longer among the stream's last [`CHECKSUM_BYTES`] into the
    /// hasher: the `lagged` bytes held so far, then the new chunk `buf[..n]`.
    fn hash_with_lag(&mut self, lagged: usize, n: usize) {
        let chunk = &self.buf[..n];
        if n >= CHECKSUM_BYTES {
            self.hasher.update(&self.lag[CHECKSUM_BYTES - lagged..]);
            self.hasher.update(&chunk[..n - CHECKSUM_BYTES]);
            self.lag.copy_from_slice(&chunk[n - CHECKSUM_BYTES..]);
            return;
        }
        // A short read: the held bytes and the chunk together, of which the last (at most)
        // CHECKSUM_BYTES stay held. `lag` is right-aligned: its live bytes are its last ones.
        let mut joined = [0u8; 2 * CHECKSUM_BYTES];
        joined[..lagged].copy_from_slice(&self.lag[CHECKSUM_BYTES - lagged..]);
        joined[lagged..lagged + n].copy_from_slice(chunk);
        let total = lagged + n;
        let keep = total.min(CHECKSUM_BYTES);
        self.hasher.update(&joined[..total - keep]);
        self.lag[CHECKSUM_BYTES - keep..].copy_from_slice(&joined[total - keep..total]);
    }

    /// Reads the body to its end; returns how many bytes followed what the parser consumed.
    fn read_to_end(&mut self) -> Result<usize, SnapshotDecodeError> {
        let mut left = self.end - self.start;
        self.start = self.end;
        while self.refill()? {
            left += self.end;
            self.start = self.end;
        }
        Ok(left)
    }
}

impl<B: Read> FieldSource for StreamSource<B> {
    #[inline]
    fn u8(&mut self, field: &'static str) -> Result<u8, SnapshotDecodeError> {
        if self.start == self.end && !self.refill()? {
            return Err(SnapshotDecodeError::Truncated { field });
        }
        let byte = self.buf[self.start];
        self.start += 1;
        Ok(byte)
    }

    #[inline]
    fn u64_le(&mut self, field: &'static str) -> Result<u64, SnapshotDecodeError> {
        let mut word = [0u8; 8];
        if self.end - self.start >= 8 {
            word.copy_from_slice(&self.buf[self.start..self.start + 8]);
            self.start += 8;
        } else {
            for byte in &mut word {
                *byte = self.u8(field)?;
            }
        }
        Ok(u64::from_le_bytes(word))
    }

    fn extend_u64_le(
        &mut self,
        count: usize,
        field: &'static str,
        out: &mut Vec<u64>,
    ) -> Result<(), SnapshotDecodeError> {
        let mut left = count;
        while left > 0 {
            let whole_words = ((self.end - self.start) / 8).min(left);
            if whole_words == 0 {
                // A word split across two reads, or an empty buffer.
                out.push(self.u64_le(field)?);
                left -= 1;
                continue;
            }
            let bytes = &self.buf[self.start..self.start + whole_words * 8];
            out.extend(bytes.chunks_exact(8).map(crate::varint::le_u64));
            self.start += whole_words * 8;
            left -= whole_words;
        }
        Ok(())
    }

    fn byte_vec(
        &mut self,
        len: usize,
        field: &'static str,
    ) -> Result<Vec<u8>, SnapshotDecodeError> {
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            out.push(self.u8(field)?);
        }
        Ok(out)
    }

    fn room_bytes(&self) -> usize {
        // Consumed so far = read - buffered-but-unconsumed.
        let consumed = self.read_bytes - (self.end - self.start);
        self.max_bytes.saturating_sub(consumed)
    }
}
