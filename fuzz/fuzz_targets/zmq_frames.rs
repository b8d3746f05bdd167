//! The ZMQ frame layer of engine KV events: live `[topic, seq, payload]` messages and replay
//! answers (`["", topic, seq, payload]` or `["", seq, payload]`), then the payload decode the
//! subscriber runs on what the frame layer hands it.
//!
//! Properties: no panic; each parser agrees with the message shapes written out independently
//! below (frame count, topic bound, 8-byte big-endian seq), and hands out exactly the last frame
//! as the payload.
#![no_main]

use bytes::Bytes;
use kvroute_fuzz::kv_frames::{TOPIC_MAX_BYTES, parse_live_frames, parse_replay_frames};
use kvroute_fuzz::{FrameKind, split_frames};
use libfuzzer_sys::fuzz_target;

fn seq_of(frame: &Bytes) -> Option<i64> {
    Some(i64::from_be_bytes(frame.as_ref().try_into().ok()?))
}

/// What a live message must give: exactly three frames, a short topic, an 8-byte seq.
fn live_spec(frames: &[Bytes]) -> Option<(i64, Bytes)> {
    match frames {
        [topic, seq, payload] if topic.len() <= TOPIC_MAX_BYTES => {
            Some((seq_of(seq)?, payload.clone()))
        }
        _ => None,
    }
}

/// What a replay answer must give: an optional empty delimiter first (only when at least three
/// frames), then `[topic, seq, payload]` or `[seq, payload]`.
fn replay_spec(frames: &[Bytes]) -> Option<(i64, Bytes)> {
    let frames = match frames {
        [first, rest @ ..] if first.is_empty() && frames.len() >= 3 => rest,
        _ => frames,
    };
    match frames {
        [topic, seq, payload] if topic.len() <= TOPIC_MAX_BYTES => {
            Some((seq_of(seq)?, payload.clone()))
        }
        [seq, payload] => Some((seq_of(seq)?, payload.clone())),
        _ => None,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((kind, frames)) = split_frames(data) else {
        return;
    };
    let (got, want) = match kind {
        FrameKind::Live => (parse_live_frames(&frames), live_spec(&frames)),
        FrameKind::Replay => (parse_replay_frames(&frames), replay_spec(&frames)),
    };
    assert_eq!(got.clone().ok(), want, "{kind:?} {frames:?}: {got:?}");
    if let Ok((_, payload)) = got {
        let _ = kvroute_wire::decode_batch(&payload);
    }
});
