//! The streamed decoder against the in-memory one: the same bodies accepted (and decoded to the
//! same snapshot) and refused, whatever sizes the bytes arrive in; a forged body reported as
//! forged even though its tag comes last; the input and decoded limits enforced while reading.

mod common;

use std::io::{self, Read};

use common::{OTHER_KEY, TEST_KEY, compression_strategy, gzip_envelope, random_snapshot};
use kvroute_snapshot::{
    BINARY_MAGIC, BINARY_VERSION, Compression, DecodeLimits, EncodeOptions, SnapshotDecodeError,
    decode_binary, decode_binary_stream, encode_binary_to_vec,
};
use proptest::prelude::*;

/// Hands out `bytes` in chunks whose sizes cycle through `sizes` (a socket's reads).
struct Chunked<'a> {
    bytes: &'a [u8],
    sizes: Vec<usize>,
    next: usize,
}

impl<'a> Chunked<'a> {
    fn new(bytes: &'a [u8], sizes: Vec<usize>) -> Self {
        Chunked {
            bytes,
            sizes,
            next: 0,
        }
    }
}

impl Read for Chunked<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let size = self.sizes[self.next % self.sizes.len()].max(1);
        self.next += 1;
        let n = size.min(out.len()).min(self.bytes.len());
        out[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        Ok(n)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Both decoders accept the same bodies and give the same snapshot; a body damaged in any
    /// byte, cut short, or signed with another key is refused by both, and where the in-memory
    /// decoder says "forged" the streamed one says it too.
    #[test]
    fn the_streamed_decoder_accepts_exactly_what_the_whole_body_decoder_accepts(
        seed in any::<u64>(),
        rank_count in 1usize..6,
        compression in compression_strategy(),
        signed in any::<bool>(),
        checked in any::<bool>(),
        signer_is_other in any::<bool>(),
        damage in 0u8..3,
        position in any::<prop::sample::Index>(),
        xor in 1u8..=255,
        sizes in prop::collection::vec(1usize..5000, 1..6),
    ) {
        let snapshot = random_snapshot(seed, 80, rank_count);
        let signer = if signer_is_other { OTHER_KEY } else { TEST_KEY };
        let options = EncodeOptions { compression, mac_key: signed.then_some(signer) };
        let mut bytes = encode_binary_to_vec(&snapshot, &options).unwrap();
        match damage {
            1 => {
                let at = position.index(bytes.len());
                bytes[at] ^= xor;
            }
            2 => {
                let keep = position.index(bytes.len());
                bytes.truncate(keep);
            }
            _ => {}
        }
        let key = checked.then_some(TEST_KEY);
        let limits = DecodeLimits::default();
        let whole = decode_binary(&bytes, &limits, key);
        let streamed = decode_binary_stream(Chunked::new(&bytes, sizes), &limits, key);
        match (&whole, &streamed) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(a), Err(b)) => prop_assert_eq!(a, b, "the decoders refuse for different reasons"),
            _ => prop_assert!(false, "whole {:?} but streamed {:?}", whole.as_ref().err(), streamed.as_ref().err()),
        }
        if damage == 0 && (!checked || (signed && !signer_is_other)) {
            prop_assert_eq!(streamed.as_ref().ok(), Some(&snapshot));
        }
        if whole == Err(SnapshotDecodeError::MacMismatch) {
            prop_assert_eq!(streamed, Err(SnapshotDecodeError::MacMismatch));
        }
    }
}

/// A forged body that does not even parse is still reported as forged: with a key, the MAC is
/// judged before any other fault is reported, as it is when the body is in memory.
#[test]
fn a_forged_body_that_fails_to_parse_is_reported_as_forged() {
    let mut bytes = BINARY_MAGIC.to_vec();
    bytes.extend_from_slice(&[BINARY_VERSION, Compression::Zstd.code() | 0b100]);
    bytes.extend_from_slice(&[0x55; 300]);
    bytes.extend_from_slice(&[0xAA; 32]);
    let limits = DecodeLimits::default();
    assert_eq!(
        decode_binary(&bytes, &limits, Some(TEST_KEY)),
        Err(SnapshotDecodeError::MacMismatch)
    );
    assert_eq!(
        decode_binary_stream(&bytes[..], &limits, Some(TEST_KEY)),
        Err(SnapshotDecodeError::MacMismatch)
    );
}

/// A valid body followed by an endless input is refused once the input passes its limit, having
/// read at most a couple of chunks past it.
#[test]
fn an_endless_input_is_refused_at_the_input_limit_while_it_streams() {
    struct Counting<R> {
        inner: R,
        read_bytes: usize,
    }
    impl<R: Read> Read for Counting<R> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = self.inner.read(out)?;
            self.read_bytes += n;
            Ok(n)
        }
    }
    let body = encode_binary_to_vec(&random_snapshot(5, 20, 2), &EncodeOptions::default()).unwrap();
    let limit = 1 << 20;
    let limits = DecodeLimits {
        max_bytes: limit,
        ..DecodeLimits::default()
    };
    let mut input = Counting {
        inner: body.as_slice().chain(io::repeat(0)),
        read_bytes: 0,
    };
    let err = decode_binary_stream(&mut input, &limits, None).unwrap_err();
    assert!(
        matches!(err, SnapshotDecodeError::InputTooLarge { limit_bytes, .. } if limit_bytes == limit),
        "an endless body gave {err:?}"
    );
    assert!(
        input.read_bytes <= limit + 2 * kvroute_snapshot::STREAM_READ_CHUNK_BYTES,
        "read {} bytes for a limit of {limit}",
        input.read_bytes
    );
}

/// A compressed payload that inflates past the decoded limit is refused while inflating: here a
/// valid small body followed by 8 MiB of zeros, so every field parses and only the budget can
/// stop the decoder.
#[test]
fn a_gzip_bomb_is_refused_while_it_inflates() {
    let snapshot = random_snapshot(3, 20, 2);
    let plain = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    let bytes = gzip_envelope(&[&plain[6..], &vec![0u8; 8 << 20]]);
    let limits = DecodeLimits {
        max_bytes: 1 << 20,
        ..DecodeLimits::default()
    };
    let too_large = Err(SnapshotDecodeError::TooLarge {
        limit_bytes: 1 << 20,
    });
    assert_eq!(decode_binary(&bytes, &limits, None), too_large);
    assert_eq!(decode_binary_stream(&bytes[..], &limits, None), too_large);
}

/// A read error from the input (the socket the fetch is reading) ends the decode and names it.
#[test]
fn a_read_error_mid_body_ends_the_decode_naming_it() {
    struct Breaks<'a> {
        bytes: &'a [u8],
    }
    impl Read for Breaks<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            if self.bytes.is_empty() {
                return Err(io::Error::other("the sibling hung up"));
            }
            let n = out.len().min(self.bytes.len()).min(100);
            out[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }
    let snapshot = random_snapshot(7, 200, 3);
    let bytes = encode_binary_to_vec(&snapshot, &EncodeOptions::default()).unwrap();
    let half = &bytes[..bytes.len() / 2];
    match decode_binary_stream(Breaks { bytes: half }, &DecodeLimits::default(), None) {
        Err(SnapshotDecodeError::Decompress { reason }) => {
            assert!(reason.contains("hung up"), "reason was {reason:?}")
        }
        other => panic!("a broken input gave {other:?}"),
    }
}
