//! The client side of the data path's hand-written HTTP/1.1: `classify_request`, which reads a
//! request head at the front of a connection's buffer and decides whether the fast path takes it
//! and how its body is framed (one plain-digit `Content-Length`).
//!
//! Properties: no panic; a fast head lies within the buffer and within
//! `REQUEST_HEAD_MAX_BYTES`; the decision depends only on the head (the same bytes without what
//! follows classify the same), and a head cut one byte short is still incomplete (`Partial`),
//! so the caller never frames a body from a half-read head; an incomplete head is reported only
//! while the buffer is under the limit (a peer cannot make the fast path wait forever).
#![no_main]

use kvroute_http1::framing::{
    REQUEST_HEAD_MAX_BYTES, REQUEST_ID_MAX_BYTES, RequestHead, classify_request, is_header_value,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match classify_request(data) {
        RequestHead::Fast(f) => {
            assert!(f.head_len <= data.len() && f.head_len <= REQUEST_HEAD_MAX_BYTES);
            assert!(
                data[..f.head_len].ends_with(b"\n"),
                "a head ends at its blank line"
            );
            let head = &data[..f.head_len];
            assert_eq!(classify_request(head), RequestHead::Fast(f.clone()));
            assert_eq!(
                classify_request(&head[..f.head_len - 1]),
                RequestHead::Partial
            );
            if let Some(id) = &f.request_id {
                assert!(!id.is_empty() && id.len() <= REQUEST_ID_MAX_BYTES);
                assert!(is_header_value(id.as_bytes()));
            }
        }
        RequestHead::Partial => assert!(data.len() < REQUEST_HEAD_MAX_BYTES),
        RequestHead::Other => {}
    }
});
