//! The engine side of the data path's hand-written HTTP/1.1: `parse_response_head` and the
//! incremental `ChunkedDecoder`.
//!
//! Byte 0 of the input picks the mode: even, the rest is a whole engine response (a head, and
//! when the head says chunked, the body after it goes through the decoder); odd, the rest is a
//! chunked body alone, so the fuzzer does not have to find a valid head to reach the decoder.
//!
//! Properties: no panic; a parsed head lies within the buffer and `RESPONSE_HEAD_MAX_BYTES` and
//! parses the same without what follows it; the decoder's output (data, end, error, and the
//! bytes it leaves for the next response) does not depend on how the input is split into reads,
//! it never hands out more data than it was given, it consumes every control byte it is shown
//! before asking for more, and the size-line and trailer limits bound how far it reads.
#![no_main]

use bytes::BytesMut;
use kvroute_fuzz::piece_sizes;
use kvroute_http1::framing::{
    BodyFraming, Chunk, ChunkedDecoder, FramingError, RESPONSE_HEAD_MAX_BYTES, parse_response_head,
};
use libfuzzer_sys::fuzz_target;

/// The data, how it ended, and the bytes left unread after the end.
#[derive(Debug, PartialEq)]
struct Decoded {
    data: Vec<u8>,
    outcome: Result<bool, FramingError>,
    rest: Vec<u8>,
}

/// Feeds `input` to a decoder in pieces of the given sizes (an empty buffer is never fed twice
/// in a row: the decoder must ask for more).
fn decode(input: &[u8], mut pieces: impl Iterator<Item = usize>) -> Decoded {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::new();
    let mut fed = 0;
    let mut data = Vec::new();
    loop {
        match decoder.decode(&mut buf) {
            Ok(Chunk::Data(d)) => {
                assert!(!d.is_empty(), "an empty data chunk");
                data.extend_from_slice(&d);
            }
            Ok(Chunk::End) => {
                let mut rest = buf.to_vec();
                rest.extend_from_slice(&input[fed..]);
                return Decoded {
                    data,
                    outcome: Ok(true),
                    rest,
                };
            }
            Ok(Chunk::NeedMore) => {
                assert!(buf.is_empty(), "asked for more with bytes buffered");
                if fed == input.len() {
                    return Decoded {
                        data,
                        outcome: Ok(false),
                        rest: Vec::new(),
                    };
                }
                let n = pieces.next().unwrap_or(1).min(input.len() - fed);
                buf.extend_from_slice(&input[fed..fed + n]);
                fed += n;
            }
            Err(e) => {
                return Decoded {
                    data,
                    outcome: Err(e),
                    rest: Vec::new(),
                };
            }
        }
    }
}

fn check_chunked(body: &[u8]) {
    let whole = decode(body, std::iter::repeat(body.len().max(1)));
    assert!(whole.data.len() <= body.len());
    let split = decode(body, piece_sizes(body));
    assert_eq!(whole, split);
    let bytewise = decode(body, std::iter::repeat(1));
    assert_eq!(whole, bytewise);
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    if mode & 1 == 1 {
        check_chunked(input);
        return;
    }
    let Ok(Some(head)) = parse_response_head(input) else {
        return;
    };
    assert!(head.head_len <= input.len() && head.head_len <= RESPONSE_HEAD_MAX_BYTES);
    assert_eq!(
        parse_response_head(&input[..head.head_len]),
        Ok(Some(head.clone()))
    );
    if head.framing == BodyFraming::Chunked {
        check_chunked(&input[head.head_len..]);
    }
});
