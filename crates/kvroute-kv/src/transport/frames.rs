//! The frame layer of engine KV-event messages: the shape and size checks of a live
//! `[topic, seq, payload]` message and of a replay answer, turned into `(seq, payload)`.
//!
//! A file of its own, with no dependency beyond `bytes`, `thiserror` and `kvroute-wire`'s payload
//! limit, so it stays pure: the fuzz crate (`fuzz/`) compiles this very file with `#[path]` and
//! drives it without building the ZMQ stack, the HTTP client and the metrics around it.
//! [`super`] re-exports everything here, so callers keep naming `transport::parse_live_frames`.

use bytes::Bytes;
use kvroute_wire::PAYLOAD_MAX_BYTES;

/// Largest topic frame accepted (topics are short configured strings).
pub const TOPIC_MAX_BYTES: usize = 1024;

/// Why a message's frames were refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: &'static str, got: usize },
    #[error("seq frame has {got} bytes, expected 8")]
    SeqWidth { got: usize },
    #[error("payload of {got_bytes} bytes exceeds {limit_bytes}")]
    PayloadTooLarge {
        got_bytes: usize,
        limit_bytes: usize,
    },
    #[error("topic of {got_bytes} bytes exceeds {limit_bytes}")]
    TopicTooLarge {
        got_bytes: usize,
        limit_bytes: usize,
    },
}

fn read_seq(frame: &Bytes) -> Result<i64, FrameError> {
    let bytes: [u8; 8] = frame
        .as_ref()
        .try_into()
        .map_err(|_| FrameError::SeqWidth { got: frame.len() })?;
    Ok(i64::from_be_bytes(bytes))
}

fn check_payload(payload: &Bytes) -> Result<(), FrameError> {
    if payload.len() > PAYLOAD_MAX_BYTES {
        return Err(FrameError::PayloadTooLarge {
            got_bytes: payload.len(),
            limit_bytes: PAYLOAD_MAX_BYTES,
        });
    }
    Ok(())
}

fn check_topic(topic: &Bytes) -> Result<(), FrameError> {
    if topic.len() > TOPIC_MAX_BYTES {
        return Err(FrameError::TopicTooLarge {
            got_bytes: topic.len(),
            limit_bytes: TOPIC_MAX_BYTES,
        });
    }
    Ok(())
}

/// A live message: `[topic, seq (8-byte BE), payload]`.
pub fn parse_live_frames(frames: &[Bytes]) -> Result<(i64, Bytes), FrameError> {
    let [topic, seq, payload] = frames else {
        return Err(FrameError::FrameCount {
            expected: "3 (topic, seq, payload)",
            got: frames.len(),
        });
    };
    check_topic(topic)?;
    check_payload(payload)?;
    Ok((read_seq(seq)?, payload.clone()))
}

/// A replay answer message: `["", topic, seq, payload]` or, from older engines, `["", seq,
/// payload]`. The leading empty delimiter is optional here because it is a convention of the
/// engine's ROUTER, not something DEALER enforces.
pub fn parse_replay_frames(frames: &[Bytes]) -> Result<(i64, Bytes), FrameError> {
    let frames = match frames.first() {
        Some(f) if f.is_empty() && frames.len() >= 3 => &frames[1..],
        _ => frames,
    };
    let (seq, payload) = match frames {
        [topic, seq, payload] => {
            check_topic(topic)?;
            (seq, payload)
        }
        [seq, payload] => (seq, payload),
        _ => {
            return Err(FrameError::FrameCount {
                expected: "2 or 3 after the empty delimiter",
                got: frames.len(),
            });
        }
    };
    check_payload(payload)?;
    Ok((read_seq(seq)?, payload.clone()))
}
