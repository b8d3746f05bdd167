//! Optional compression of an encoded snapshot, and bounded decompression.
//!
//! Compression is the caller's choice per request ([`Compression`]): zstd is the default for
//! replica-to-replica bootstrap (fast at a good ratio), gzip is there for curl and browsers via
//! `Content-Encoding`. Both sides stream: the encoder pushes through a [`CompressingWriter`] so
//! the service never holds a whole compressed body, and the decoder inflates through
//! [`decompress_bounded`], which stops the moment output passes the caller's byte limit — a
//! decompression bomb costs at most `max_bytes` of memory, never its claimed size.

use std::borrow::Cow;
use std::io::{self, Read, Write};

use crate::error::SnapshotDecodeError;

/// zstd level used when encoding. Measured on the benchmark shape (BENCHMARKS.md): the body is
/// dominated by random 8-byte hashes, so levels 1, 3 and 6 all land within 0.2% of each other
/// in size while level 1 is 3.6x faster than 3; the structural columns compress to near nothing
/// at any level.
pub const ZSTD_LEVEL: i32 = 1;
/// gzip (deflate) level used when encoding: level 1 is 5.5x faster than 6 on the benchmark body
/// for a 0.3% larger result, for the same reason.
pub const GZIP_LEVEL: u32 = 1;
/// Largest zstd window a decoder accepts (2^23 = 8 MiB). Our encoder's level-1 window is 2^19;
/// the bound stops a hostile frame header from making the decoder allocate a 2 GiB window.
pub const ZSTD_WINDOW_LOG_MAX: u32 = 23;

/// How an encoded snapshot is compressed. The binary envelope records it; for JSON the service
/// sends it as `Content-Encoding` ([`Compression::content_encoding`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Compression {
    #[default]
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub const ALL: [Compression; 3] = [Compression::None, Compression::Gzip, Compression::Zstd];

    /// The code stored in the binary envelope's flag byte.
    pub fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Gzip => 1,
            Compression::Zstd => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Compression> {
        match code {
            0 => Some(Compression::None),
            1 => Some(Compression::Gzip),
            2 => Some(Compression::Zstd),
            _ => None,
        }
    }

    /// The HTTP `Content-Encoding` token, `None` for identity.
    pub fn content_encoding(self) -> Option<&'static str> {
        match self {
            Compression::None => None,
            Compression::Gzip => Some("gzip"),
            Compression::Zstd => Some("zstd"),
        }
    }
}

enum Stage<W: Write> {
    Plain(W),
    Gzip(flate2::write::GzEncoder<W>),
    Zstd(zstd::stream::write::Encoder<'static, W>),
}

/// A `Write` that compresses into `W` as bytes arrive. Call [`CompressingWriter::finish`] to
/// write the compressor's trailer; dropping it without finishing leaves a truncated stream.
pub struct CompressingWriter<W: Write> {
    stage: Stage<W>,
}

impl<W: Write> CompressingWriter<W> {
    pub fn new(out: W, compression: Compression) -> io::Result<Self> {
        let stage = match compression {
            Compression::None => Stage::Plain(out),
            Compression::Gzip => Stage::Gzip(flate2::write::GzEncoder::new(
                out,
                flate2::Compression::new(GZIP_LEVEL),
            )),
            Compression::Zstd => Stage::Zstd(zstd::stream::write::Encoder::new(out, ZSTD_LEVEL)?),
        };
        Ok(CompressingWriter { stage })
    }

    /// Ends the compressed stream and hands back the underlying writer.
    pub fn finish(self) -> io::Result<W> {
        match self.stage {
            Stage::Plain(mut w) => {
                w.flush()?;
                Ok(w)
            }
            Stage::Gzip(g) => g.finish(),
            Stage::Zstd(z) => z.finish(),
        }
    }
}

impl<W: Write> Write for CompressingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.stage {
            Stage::Plain(w) => w.write(buf),
            Stage::Gzip(g) => g.write(buf),
            Stage::Zstd(z) => z.write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match &mut self.stage {
            Stage::Plain(w) => w.write_all(buf),
            Stage::Gzip(g) => g.write_all(buf),
            Stage::Zstd(z) => z.write_all(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match &mut self.stage {
            Stage::Plain(w) => w.flush(),
            Stage::Gzip(g) => g.flush(),
            Stage::Zstd(z) => z.flush(),
        }
    }
}

/// Inflates `input` compressed with `compression`, refusing with
/// [`SnapshotDecodeError::TooLarge`] as soon as the output would pass `max_bytes`. Identity input
/// is borrowed, not copied. A gzip stream must be exactly one member with nothing after it.
pub fn decompress_bounded(
    input: &[u8],
    compression: Compression,
    max_bytes: usize,
) -> Result<Cow<'_, [u8]>, SnapshotDecodeError> {
    match compression {
        Compression::None => {
            if input.len() > max_bytes {
                return Err(SnapshotDecodeError::TooLarge {
                    limit_bytes: max_bytes,
                });
            }
            Ok(Cow::Borrowed(input))
        }
        Compression::Gzip => {
            let mut decoder = flate2::bufread::GzDecoder::new(input);
            let out = read_bounded(&mut decoder, max_bytes)?;
            let rest = decoder.into_inner();
            if !rest.is_empty() {
                return Err(SnapshotDecodeError::TrailingBytes {
                    trailing_bytes: rest.len(),
                });
            }
            Ok(Cow::Owned(out))
        }
        Compression::Zstd => {
            let mut decoder =
                zstd::stream::read::Decoder::with_buffer(input).map_err(decompress_error)?;
            decoder
                .window_log_max(ZSTD_WINDOW_LOG_MAX)
                .map_err(decompress_error)?;
            Ok(Cow::Owned(read_bounded(&mut decoder, max_bytes)?))
        }
    }
}

/// Reads `reader` to its end, failing once more than `max_bytes` have come out. The `take`
/// makes the limit hold during reading: at most `max_bytes + 1` bytes are ever pulled, whatever
/// the stream claims.
pub fn read_bounded<R: Read>(reader: R, max_bytes: usize) -> Result<Vec<u8>, SnapshotDecodeError> {
    let mut out = Vec::new();
    let cap = u64::try_from(max_bytes)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    reader
        .take(cap)
        .read_to_end(&mut out)
        .map_err(decompress_error)?;
    if out.len() > max_bytes {
        return Err(SnapshotDecodeError::TooLarge {
            limit_bytes: max_bytes,
        });
    }
    Ok(out)
}

fn decompress_error(e: io::Error) -> SnapshotDecodeError {
    SnapshotDecodeError::Decompress {
        reason: e.to_string(),
    }
}
