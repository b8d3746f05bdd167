//! The load-bookings frame codec (`kvroute`'s `peer::load_frame`): what a sibling's stream line
//! can do to a follower. Bit 0 of byte 0 says whether the follower has a MAC key; the rest is
//! one line.
//!
//! Properties: decoding never panics and never allocates past the line's own size class; a
//! frame that decodes re-encodes (under the same key) to a line that decodes to the same frame;
//! and applying it to a follower table (empty, or holding one full frame) never panics, leaves
//! the table unchanged when refused, and never holds more ranks than a frame may list.
#![no_main]

use kvroute_fuzz::load_frame::{
    BookingFrame, LOAD_FRAME_RANKS_MAX, RankBookings, RankKey, SiblingBookings, decode_line,
    encode_line,
};
use libfuzzer_sys::fuzz_target;

const KEY: &[u8] = b"kvroute-fuzz-shared-secret-0001";

fuzz_target!(|data: &[u8]| {
    let Some((&mode, line)) = data.split_first() else {
        return;
    };
    let key = (mode & 1 == 1).then_some(KEY);
    let Ok(frame) = decode_line(line, key) else {
        return;
    };
    let again = encode_line(&frame, key);
    let back = decode_line(&again[..again.len() - 1], key).expect("a re-encoded frame decodes");
    assert_eq!(back, frame, "re-encoding changed the frame");

    for seeded in [false, true] {
        let mut table = SiblingBookings::default();
        if seeded {
            let full = BookingFrame::Full {
                seq: frame.seq().wrapping_sub(1),
                ranks: vec![(
                    RankKey {
                        worker_url: "http://10.0.0.1:8000".into(),
                        dp_rank: 0,
                    },
                    RankBookings::default(),
                )],
                pending: vec![],
                prefixes: vec![],
            };
            let _ = table.apply(full, 1);
        }
        let before = table.clone();
        match table.apply(frame.clone(), 2) {
            Ok(()) => assert!(table.ranks.len() <= LOAD_FRAME_RANKS_MAX),
            Err(_) => assert_eq!(table, before, "a refused frame changed the table"),
        }
    }
});
