//! LEB128 varints and a bounds-checked byte reader for the binary body.
//!
//! Every read names the field it is reading so a short or corrupt body is reported as
//! "truncated while reading carrier ranks", not as a bare index error; nothing here can panic on
//! any input.

use crate::error::SnapshotDecodeError;

/// Longest LEB128 encoding of a u64.
const VARINT_MAX_BYTES: usize = 10;

#[inline]
pub(crate) fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

#[inline]
pub(crate) fn zigzag(value: i64) -> u64 {
    ((value << 1) ^ (value >> 63)) as u64
}

#[inline]
pub(crate) fn unzigzag(value: u64) -> i64 {
    ((value >> 1) as i64) ^ -((value & 1) as i64)
}

/// What the body's field parser reads from: a whole body in memory ([`Reader`]) or one arriving
/// as a stream ([`crate::stream`]'s source). One parser serves both, so a streamed decode can
/// never accept a body the in-memory decode refuses, or the other way round.
pub(crate) trait FieldSource {
    fn u8(&mut self, field: &'static str) -> Result<u8, SnapshotDecodeError>;

    fn u64_le(&mut self, field: &'static str) -> Result<u64, SnapshotDecodeError>;

    /// Appends `count` little-endian u64s to `out`.
    fn extend_u64_le(
        &mut self,
        count: usize,
        field: &'static str,
        out: &mut Vec<u64>,
    ) -> Result<(), SnapshotDecodeError>;

    /// `len` raw bytes (only ever called with a length already bounded by a limit).
    fn byte_vec(&mut self, len: usize, field: &'static str)
    -> Result<Vec<u8>, SnapshotDecodeError>;

    /// An upper bound on the body bytes still to come: what is left of a whole body, or of the
    /// decoded-size budget of a stream.
    fn room_bytes(&self) -> usize;

    #[inline]
    fn varint(&mut self, field: &'static str) -> Result<u64, SnapshotDecodeError> {
        let mut value = 0u64;
        for index in 0..VARINT_MAX_BYTES {
            let byte = self.u8(field)?;
            let payload = u64::from(byte & 0x7f);
            if index == VARINT_MAX_BYTES - 1 && byte > 1 {
                return Err(SnapshotDecodeError::VarintOverflow { field });
            }
            value |= payload << (7 * index);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(SnapshotDecodeError::VarintOverflow { field })
    }

    /// A varint that must fit a u32 (rank indices, dp ranks, block size, format).
    #[inline]
    fn varint_u32(&mut self, field: &'static str) -> Result<u32, SnapshotDecodeError> {
        let value = self.varint(field)?;
        u32::try_from(value).map_err(|_| SnapshotDecodeError::OutOfRange { field, value })
    }

    /// A count that must not exceed `limit`, nor what the remaining bytes could possibly hold
    /// at `min_bytes_each` bytes per entry: the second bound keeps preallocation proportional to
    /// the input actually received (for a stream, to its decoded-size budget).
    fn count(
        &mut self,
        field: &'static str,
        limit: usize,
        min_bytes_each: usize,
    ) -> Result<usize, SnapshotDecodeError> {
        let count = self.varint(field)?;
        if count > limit as u64 {
            return Err(SnapshotDecodeError::CountOverLimit {
                field,
                count,
                limit: limit as u64,
            });
        }
        let count = count as usize;
        if min_bytes_each > 0 && count > self.room_bytes() / min_bytes_each {
            return Err(SnapshotDecodeError::Truncated { field });
        }
        Ok(count)
    }

    /// A length-prefixed UTF-8 string of at most `max_bytes`.
    fn string(
        &mut self,
        field: &'static str,
        max_bytes: usize,
    ) -> Result<String, SnapshotDecodeError> {
        let len = self.count(field, max_bytes, 1)?;
        let raw = self.byte_vec(len, field)?;
        String::from_utf8(raw).map_err(|_| SnapshotDecodeError::BadUtf8 { field })
    }
}

/// A [`FieldSource`] over a whole body in memory.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    fn bytes(&mut self, len: usize, field: &'static str) -> Result<&'a [u8], SnapshotDecodeError> {
        if len > self.remaining() {
            return Err(SnapshotDecodeError::Truncated { field });
        }
        let out = &self.buf[self.pos..self.pos + len];
        self.pos += len;
        Ok(out)
    }
}

impl FieldSource for Reader<'_> {
    #[inline]
    fn u8(&mut self, field: &'static str) -> Result<u8, SnapshotDecodeError> {
        let byte = *self
            .buf
            .get(self.pos)
            .ok_or(SnapshotDecodeError::Truncated { field })?;
        self.pos += 1;
        Ok(byte)
    }

    #[inline]
    fn u64_le(&mut self, field: &'static str) -> Result<u64, SnapshotDecodeError> {
        let raw = self.bytes(8, field)?;
        let mut word = [0u8; 8];
        word.copy_from_slice(raw);
        Ok(u64::from_le_bytes(word))
    }

    fn extend_u64_le(
        &mut self,
        count: usize,
        field: &'static str,
        out: &mut Vec<u64>,
    ) -> Result<(), SnapshotDecodeError> {
        let len = count
            .checked_mul(8)
            .ok_or(SnapshotDecodeError::Truncated { field })?;
        let raw = self.bytes(len, field)?;
        out.extend(raw.chunks_exact(8).map(le_u64));
        Ok(())
    }

    fn byte_vec(
        &mut self,
        len: usize,
        field: &'static str,
    ) -> Result<Vec<u8>, SnapshotDecodeError> {
        Ok(self.bytes(len, field)?.to_vec())
    }

    fn room_bytes(&self) -> usize {
        self.remaining()
    }
}

#[inline]
pub(crate) fn le_u64(chunk: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(chunk);
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_at_every_length_boundary() {
        let values = [
            0u64,
            1,
            127,
            128,
            16383,
            16384,
            u32::MAX as u64,
            u64::MAX - 1,
            u64::MAX,
        ];
        for value in values {
            let mut out = Vec::new();
            put_varint(&mut out, value);
            let mut reader = Reader::new(&out);
            assert_eq!(reader.varint("test").unwrap(), value);
            assert_eq!(reader.remaining(), 0, "value {value} left bytes behind");
        }
    }

    #[test]
    fn eleven_byte_varint_is_an_overflow_not_a_wrap() {
        let bytes = [0xffu8; 11];
        let err = Reader::new(&bytes).varint("field").unwrap_err();
        assert_eq!(err, SnapshotDecodeError::VarintOverflow { field: "field" });
        let mut ten = [0xffu8; 10];
        ten[9] = 0x02;
        let err = Reader::new(&ten).varint("field").unwrap_err();
        assert_eq!(err, SnapshotDecodeError::VarintOverflow { field: "field" });
    }

    #[test]
    fn zigzag_round_trips_extremes() {
        for value in [0i64, -1, 1, i64::MIN, i64::MAX, -12345] {
            assert_eq!(unzigzag(zigzag(value)), value);
        }
    }
}
