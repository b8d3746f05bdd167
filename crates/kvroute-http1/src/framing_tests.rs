//! Unit and property tests of the HTTP/1.1 framing rules in `h1.rs`: which request heads the
//! fast path takes, how an engine's response head is framed, the chunked decoder's state
//! machine (every transition and every limit), and that what the encoders write is read back by
//! an independent parser (httparse) and by our own.
//!
//! The decoder is checked against split-invariance: bytes arrive from a socket in arbitrary
//! pieces, so the result of decoding must never depend on where the reads happened to split.

use super::*;
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// helpers

const ROUTES: [(&str, FastRoute); 3] = [
    ("/v1/completions", FastRoute::Completions),
    ("/v1/chat/completions", FastRoute::ChatCompletions),
    ("/generate", FastRoute::Generate),
];

/// A `POST path HTTP/1.1` head with a host header and the given extra header lines (each
/// ending in CRLF).
fn post(path: &str, headers: &str) -> Vec<u8> {
    format!("POST {path} HTTP/1.1\r\nhost: router\r\n{headers}\r\n").into_bytes()
}

fn fast(buf: &[u8]) -> FastRequest {
    match classify_request(buf) {
        RequestHead::Fast(f) => f,
        other => panic!(
            "expected Fast for {:?}, got {other:?}",
            String::from_utf8_lossy(buf)
        ),
    }
}

fn assert_other(buf: &[u8]) {
    let got = classify_request(buf);
    assert_eq!(
        got,
        RequestHead::Other,
        "expected Other for {:?}",
        String::from_utf8_lossy(buf)
    );
}

/// A response head: status line (without CRLF) and header lines (each ending in CRLF).
fn response(status_line: &str, headers: &str) -> Vec<u8> {
    format!("{status_line}\r\n{headers}\r\n").into_bytes()
}

fn head(buf: &[u8]) -> ResponseHead {
    match parse_response_head(buf) {
        Ok(Some(h)) => h,
        other => panic!(
            "expected a complete head for {:?}, got {other:?}",
            String::from_utf8_lossy(buf)
        ),
    }
}

fn head_err(buf: &[u8]) -> FramingError {
    match parse_response_head(buf) {
        Err(e) => e,
        other => panic!(
            "expected an error for {:?}, got {other:?}",
            String::from_utf8_lossy(buf)
        ),
    }
}

/// How decoding a byte stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// All input was fed and the decoder still wants more.
    NeedMore,
    /// End was reached; `rest` is what was left unconsumed (in the buffer or not yet fed).
    End {
        rest: Vec<u8>,
    },
    Error(FramingError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Decoded {
    data: Vec<u8>,
    outcome: Outcome,
}

/// Feeds `input` to a fresh decoder in pieces of the given sizes (cycled), decoding until
/// `NeedMore` after each piece, as a connection reading from a socket would.
fn decode_in_pieces(input: &[u8], piece_sizes: &[usize]) -> Decoded {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::new();
    let mut data = Vec::new();
    let mut fed = 0;
    let mut piece = 0;
    loop {
        loop {
            match decoder.decode(&mut buf) {
                Ok(Chunk::Data(d)) => {
                    assert!(!d.is_empty(), "the decoder handed out an empty Data");
                    data.extend_from_slice(&d);
                }
                Ok(Chunk::NeedMore) => break,
                Ok(Chunk::End) => {
                    assert!(decoder.is_done(), "End returned but is_done() is false");
                    let mut rest = buf.to_vec();
                    rest.extend_from_slice(&input[fed..]);
                    return Decoded {
                        data,
                        outcome: Outcome::End { rest },
                    };
                }
                Err(e) => {
                    return Decoded {
                        data,
                        outcome: Outcome::Error(e),
                    };
                }
            }
        }
        assert!(
            !decoder.is_done(),
            "is_done() true but decode said NeedMore"
        );
        if fed == input.len() {
            return Decoded {
                data,
                outcome: Outcome::NeedMore,
            };
        }
        let size = piece_sizes
            .get(piece % piece_sizes.len().max(1))
            .copied()
            .unwrap_or(1)
            .clamp(1, input.len() - fed);
        buf.extend_from_slice(&input[fed..fed + size]);
        fed += size;
        piece += 1;
    }
}

fn decode_whole(input: &[u8]) -> Decoded {
    decode_in_pieces(input, &[input.len().max(1)])
}

fn ended(data: &[u8], rest: &[u8]) -> Decoded {
    Decoded {
        data: data.to_vec(),
        outcome: Outcome::End {
            rest: rest.to_vec(),
        },
    }
}

fn bad_chunk(input: &[u8]) -> &'static str {
    match decode_whole(input).outcome {
        Outcome::Error(FramingError::BadChunk(why)) => why,
        other => panic!(
            "expected BadChunk for {:?}, got {other:?}",
            String::from_utf8_lossy(input)
        ),
    }
}

/// Each input is refused with its reason.
fn assert_bad_chunks(cases: &[(&[u8], &str)]) {
    for &(input, why) in cases {
        assert_eq!(
            bad_chunk(input),
            why,
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

fn encode_chunks(chunks: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        encode_chunk(&mut out, c);
    }
    out.extend_from_slice(LAST_CHUNK);
    out
}

/// A response head written by `encode_response_head`, parsed by httparse: status, reason,
/// headers (lower-cased names, in order).
fn parse_encoded_response(bytes: &[u8]) -> (u16, String, Vec<(String, String)>) {
    let mut headers = [httparse::EMPTY_HEADER; 16];
    let mut resp = httparse::Response::new(&mut headers);
    let n = match resp.parse(bytes) {
        Ok(httparse::Status::Complete(n)) => n,
        other => panic!(
            "httparse could not read {:?}: {other:?}",
            String::from_utf8_lossy(bytes)
        ),
    };
    assert_eq!(n, bytes.len(), "the head has bytes after its end");
    assert_eq!(resp.version, Some(1), "not HTTP/1.1");
    let headers = resp
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8(h.value.to_vec()).expect("utf-8 header value"),
            )
        })
        .collect();
    (
        resp.code.expect("status"),
        resp.reason.expect("reason").to_string(),
        headers,
    )
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

fn out_head(framing: OutFraming, close: bool) -> ResponseHeadOut<'static> {
    ResponseHeadOut {
        date: b"",
        status: 200,
        content_type: Some(b"application/json"),
        request_id: "req-1",
        decision: Some(b"worker=w1;overlap=3"),
        framing,
        close,
    }
}

// ---------------------------------------------------------------------------------------------
// classify_request

#[test]
fn each_of_the_three_routes_is_fast_with_its_head_len_length_and_keep_alive() {
    for (path, route) in ROUTES {
        let buf = post(
            path,
            "content-type: application/json\r\ncontent-length: 17\r\n",
        );
        let f = fast(&buf);
        assert_eq!(
            f,
            FastRequest {
                route,
                head_len: buf.len(),
                content_length: 17,
                keep_alive: true,
                request_id: None,
            },
            "{path}"
        );
    }
}

#[test]
fn a_query_string_does_not_change_the_fast_route() {
    for (path, route) in ROUTES {
        let buf = post(
            &format!("{path}?stream=true&x=%2F"),
            "content-length: 2\r\n",
        );
        let f = fast(&buf);
        assert_eq!(f.route, route, "{path}");
        assert_eq!(f.head_len, buf.len());
        assert_eq!(f.content_length, 2);
    }
}

#[test]
fn head_len_points_at_the_first_body_byte_when_the_body_is_already_buffered() {
    let head = post("/generate", "content-length: 11\r\n");
    let mut buf = head.clone();
    buf.extend_from_slice(b"{\"text\":1}\n");
    let f = fast(&buf);
    assert_eq!(f.head_len, head.len());
    assert_eq!(&buf[f.head_len..], b"{\"text\":1}\n");
}

#[test]
fn every_strict_prefix_of_a_fast_request_head_is_partial() {
    let buf = post(
        "/v1/chat/completions",
        "content-length: 5\r\nx-request-id: abc\r\n",
    );
    for n in 0..buf.len() {
        assert_eq!(
            classify_request(&buf[..n]),
            RequestHead::Partial,
            "prefix of {n} bytes: {:?}",
            String::from_utf8_lossy(&buf[..n])
        );
    }
    fast(&buf);
}

#[test]
fn a_get_request_is_other() {
    assert_other(b"GET /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\n\r\n");
}

#[test]
fn a_method_other_than_upper_case_post_is_other() {
    for method in ["PUT", "post", "Post", "PATCH", "OPTIONS"] {
        assert_other(
            format!("{method} /v1/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n").as_bytes(),
        );
    }
}

#[test]
fn an_http_1_0_request_is_other() {
    assert_other(b"POST /v1/completions HTTP/1.0\r\nhost: r\r\ncontent-length: 2\r\n\r\n");
}

#[test]
fn an_unknown_path_is_other() {
    for path in [
        "/",
        "/v1/models",
        "/v1/completion",
        "/V1/completions",
        "/v1/chat/completions/x",
        "/v1//completions",
        "/generate2",
        "http://router/v1/completions",
        "*",
    ] {
        assert_other(&post(path, "content-length: 2\r\n"));
    }
}

#[test]
fn a_trailing_slash_path_is_other() {
    for path in ["/v1/completions/", "/v1/chat/completions/", "/generate/"] {
        assert_other(&post(path, "content-length: 2\r\n"));
        assert_other(&post(&format!("{path}?a=b"), "content-length: 2\r\n"));
    }
}

#[test]
fn a_request_without_content_length_is_other() {
    assert_other(&post("/v1/completions", ""));
    assert_other(&post(
        "/v1/completions",
        "content-type: application/json\r\n",
    ));
}

#[test]
fn two_content_length_headers_are_other_even_when_equal() {
    assert_other(&post(
        "/v1/completions",
        "content-length: 5\r\ncontent-length: 5\r\n",
    ));
    assert_other(&post(
        "/v1/completions",
        "content-length: 5\r\ncontent-length: 6\r\n",
    ));
}

#[test]
fn a_content_length_that_is_not_plain_digits_is_other() {
    for value in [
        "",
        "abc",
        "+5",
        "-5",
        "5, 5",
        "5,5",
        "5x",
        "0x5",
        "1 5",
        "5.0",
        "1e3",
        // 20 digits: more than any u64 the strict parser accepts.
        "99999999999999999999",
    ] {
        assert_other(&post(
            "/v1/completions",
            &format!("content-length: {value}\r\n"),
        ));
    }
}

#[test]
fn a_plain_digit_content_length_is_taken_with_leading_zeros_and_up_to_nineteen_digits() {
    for (value, want) in [
        ("0", 0),
        ("007", 7),
        ("  42  ", 42),
        ("9999999999999999999", 9_999_999_999_999_999_999),
    ] {
        let f = fast(&post(
            "/v1/completions",
            &format!("content-length: {value}\r\n"),
        ));
        assert_eq!(f.content_length, want, "{value:?}");
    }
}

#[test]
fn a_transfer_encoding_header_makes_a_request_other() {
    for value in ["chunked", "identity", "gzip, chunked"] {
        assert_other(&post(
            "/v1/completions",
            &format!("transfer-encoding: {value}\r\n"),
        ));
        assert_other(&post(
            "/v1/completions",
            &format!("content-length: 5\r\ntransfer-encoding: {value}\r\n"),
        ));
    }
}

#[test]
fn expect_100_continue_makes_a_request_other() {
    assert_other(&post(
        "/v1/completions",
        "content-length: 5\r\nexpect: 100-continue\r\n",
    ));
}

#[test]
fn an_upgrade_header_makes_a_request_other() {
    assert_other(&post(
        "/v1/completions",
        "content-length: 5\r\nupgrade: websocket\r\n",
    ));
}

#[test]
fn a_connection_upgrade_token_makes_a_request_other() {
    for value in [
        "upgrade",
        "Upgrade",
        "keep-alive, Upgrade",
        " close ,upgrade",
    ] {
        assert_other(&post(
            "/v1/completions",
            &format!("content-length: 5\r\nconnection: {value}\r\n"),
        ));
    }
}

#[test]
fn an_http2_prior_knowledge_preface_is_other() {
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    assert_other(preface);
    // With the client's first SETTINGS frame already read behind it.
    let mut with_settings = preface.to_vec();
    with_settings.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    assert_other(&with_settings);
}

#[test]
fn garbage_bytes_are_other() {
    for garbage in [
        &b"\x00\x01\x02\x03\r\n\r\n"[..],
        // A TLS ClientHello's first bytes.
        &b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"[..],
        &b"{\"prompt\": \"hi\"}\r\n\r\n"[..],
        &b"POST /v1/completions HTTP/1.1\r\nbad header\r\n\r\n"[..],
        &b"POST /v1/completions HTTP/1.1\r\ncontent-length: 1\x00\r\n\r\n"[..],
    ] {
        assert_other(garbage);
    }
}

#[test]
fn headers_max_headers_are_fast_and_one_more_is_other() {
    // `post` adds host and content-length: fill up to exactly HEADERS_MAX.
    let filler = |n: usize| {
        (0..n)
            .map(|i| format!("x-filler-{i}: v\r\n"))
            .collect::<String>()
    };
    let at_limit = post(
        "/v1/completions",
        &format!("content-length: 1\r\n{}", filler(HEADERS_MAX - 2)),
    );
    assert_eq!(fast(&at_limit).content_length, 1);
    let over = post(
        "/v1/completions",
        &format!("content-length: 1\r\n{}", filler(HEADERS_MAX - 1)),
    );
    assert_other(&over);
}

#[test]
fn a_close_token_among_other_connection_tokens_clears_keep_alive() {
    for value in [
        "close",
        "Close",
        "keep-alive, close",
        " keep-alive ,CLOSE ",
        "te, close",
    ] {
        let f = fast(&post(
            "/v1/completions",
            &format!("content-length: 1\r\nconnection: {value}\r\n"),
        ));
        assert!(!f.keep_alive, "{value:?}");
    }
}

#[test]
fn connection_keep_alive_or_an_unrelated_token_keeps_the_connection_alive() {
    for value in ["keep-alive", "closed", "te", "x-close"] {
        let f = fast(&post(
            "/v1/completions",
            &format!("content-length: 1\r\nconnection: {value}\r\n"),
        ));
        assert!(f.keep_alive, "{value:?}");
    }
}

#[test]
fn a_valid_request_id_is_kept_as_sent() {
    for id in ["abc", "9f0c-11ee/x_1", "with space and\ttab", "~!@#$%^&*()"] {
        let f = fast(&post(
            "/v1/completions",
            &format!("content-length: 1\r\nx-request-id: {id}\r\n"),
        ));
        assert_eq!(f.request_id.as_deref(), Some(id));
    }
}

#[test]
fn a_request_id_with_a_control_char_is_never_used() {
    for bad in [&b"a\x01b"[..], b"a\x7fb", b"a\rb", b"a\nb", b"\x00"] {
        assert_eq!(usable_request_id(bad), None, "{bad:?}");
    }
    // Through the request parser such a head is refused as a whole, so it goes to hyper,
    // which answers it itself: the fast path never forwards the id.
    let mut buf = b"POST /v1/completions HTTP/1.1\r\ncontent-length: 1\r\nx-request-id: a".to_vec();
    buf.extend_from_slice(b"\x01b\r\n\r\n");
    assert_other(&buf);
}

#[test]
fn a_request_id_with_non_ascii_bytes_is_dropped_but_the_request_stays_fast() {
    let mut buf =
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 1\r\nx-request-id: caf"
            .to_vec();
    buf.extend_from_slice(b"\xc3\xa9\r\n\r\n");
    assert_eq!(fast(&buf).request_id, None);
    assert_eq!(usable_request_id("café".as_bytes()), None);
}

#[test]
fn an_http_1_1_request_without_host_goes_to_the_general_server_which_refuses_it() {
    let without = b"POST /v1/completions HTTP/1.1\r\ncontent-length: 1\r\n\r\n";
    assert_eq!(classify_request(without), RequestHead::Other);
    let with = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\ncontent-length: 1\r\n\r\n";
    assert!(matches!(classify_request(with), RequestHead::Fast(_)));
}

#[test]
fn a_response_head_carries_the_date_and_the_date_is_an_imf_fixdate() {
    let date = http_date_now();
    let text = std::str::from_utf8(&date).unwrap();
    assert!(httpdate::parse_http_date(text).is_ok(), "{text}");
    let mut out = Vec::new();
    encode_response_head(
        &mut out,
        &ResponseHeadOut {
            date: &date,
            status: 200,
            content_type: None,
            request_id: "r",
            decision: None,
            framing: OutFraming::Length(0),
            close: false,
        },
    );
    let head = String::from_utf8(out).unwrap();
    assert!(head.contains(&format!("\r\ndate: {text}\r\n")), "{head}");
}

#[test]
fn an_empty_request_id_is_dropped() {
    let f = fast(&post(
        "/v1/completions",
        "content-length: 1\r\nx-request-id:\r\n",
    ));
    assert_eq!(f.request_id, None);
    let f = fast(&post(
        "/v1/completions",
        "content-length: 1\r\nx-request-id:    \r\n",
    ));
    assert_eq!(f.request_id, None);
    assert_eq!(usable_request_id(b""), None);
}

#[test]
fn a_request_id_of_request_id_max_bytes_is_kept_and_one_byte_more_is_dropped() {
    let at_limit = "r".repeat(REQUEST_ID_MAX_BYTES);
    let f = fast(&post(
        "/v1/completions",
        &format!("content-length: 1\r\nx-request-id: {at_limit}\r\n"),
    ));
    assert_eq!(f.request_id.as_deref(), Some(at_limit.as_str()));
    let over = "r".repeat(REQUEST_ID_MAX_BYTES + 1);
    let f = fast(&post(
        "/v1/completions",
        &format!("content-length: 1\r\nx-request-id: {over}\r\n"),
    ));
    assert_eq!(f.request_id, None);
}

#[test]
fn only_the_first_of_two_valid_request_ids_is_used() {
    let f = fast(&post(
        "/v1/completions",
        "content-length: 1\r\nx-request-id: first\r\nx-request-id: second\r\n",
    ));
    assert_eq!(f.request_id.as_deref(), Some("first"));
}

#[test]
fn a_second_request_id_is_not_used_when_the_first_is_unusable() {
    let too_long = "r".repeat(REQUEST_ID_MAX_BYTES + 1);
    let f = fast(&post(
        "/v1/completions",
        &format!("content-length: 1\r\nx-request-id: {too_long}\r\nx-request-id: second\r\n"),
    ));
    assert_eq!(f.request_id, None);
}

#[test]
fn request_header_names_are_matched_case_insensitively() {
    let f = fast(&post(
        "/v1/completions",
        "CONTENT-LENGTH: 9\r\nConnection: Close\r\nX-Request-ID: Abc\r\n",
    ));
    assert_eq!(f.content_length, 9);
    assert!(!f.keep_alive);
    assert_eq!(f.request_id.as_deref(), Some("Abc"));
    assert_other(&post(
        "/v1/completions",
        "Content-Length: 9\r\nTRANSFER-ENCODING: chunked\r\n",
    ));
    assert_other(&post(
        "/v1/completions",
        "Content-Length: 9\r\nExpect: 100-continue\r\n",
    ));
    assert_other(&post(
        "/v1/completions",
        "Content-Length: 9\r\nUPGRADE: h2c\r\n",
    ));
    assert_other(&post(
        "/v1/completions",
        "Content-Length: 9\r\ncontent-LENGTH: 9\r\n",
    ));
}

#[test]
fn a_complete_request_head_longer_than_request_head_max_bytes_is_other() {
    let pad = "p".repeat(REQUEST_HEAD_MAX_BYTES);
    let buf = post(
        "/v1/completions",
        &format!("content-length: 1\r\nx-pad: {pad}\r\n"),
    );
    assert!(buf.len() > REQUEST_HEAD_MAX_BYTES);
    assert_other(&buf);
}

#[test]
fn an_incomplete_request_head_of_request_head_max_bytes_is_other() {
    let mut buf = b"POST /v1/completions HTTP/1.1\r\ncontent-length: 1\r\nx-pad: ".to_vec();
    buf.resize(REQUEST_HEAD_MAX_BYTES, b'p');
    assert_other(&buf);
}

// ---------------------------------------------------------------------------------------------
// parse_response_head

#[test]
fn a_content_length_response_is_length_framed_and_reusable() {
    let buf = response(
        "HTTP/1.1 200 OK",
        "content-type: application/json\r\ncontent-length: 12\r\n",
    );
    assert_eq!(
        head(&buf),
        ResponseHead {
            status: 200,
            head_len: buf.len(),
            content_type: Some(Bytes::from_static(b"application/json")),
            framing: BodyFraming::Length(12),
            reusable: true,
        }
    );
}

#[test]
fn response_head_len_points_at_the_first_body_byte() {
    let head_bytes = response("HTTP/1.1 200 OK", "content-length: 5\r\n");
    let mut buf = head_bytes.clone();
    buf.extend_from_slice(b"hello");
    let h = head(&buf);
    assert_eq!(h.head_len, head_bytes.len());
    assert_eq!(&buf[h.head_len..], b"hello");
}

#[test]
fn a_chunked_response_is_chunked_and_reusable() {
    for value in ["chunked", "Chunked", "gzip, chunked", "gzip,chunked "] {
        let h = head(&response(
            "HTTP/1.1 200 OK",
            &format!("transfer-encoding: {value}\r\n"),
        ));
        assert_eq!(h.framing, BodyFraming::Chunked, "{value:?}");
        assert!(h.reusable, "{value:?}");
    }
}

#[test]
fn a_response_without_length_or_chunked_is_read_until_close_and_not_reusable() {
    let h = head(&response("HTTP/1.1 200 OK", "content-type: text/plain\r\n"));
    assert_eq!(h.framing, BodyFraming::UntilClose);
    assert!(!h.reusable);
}

#[test]
fn a_transfer_encoding_not_ending_in_chunked_is_read_until_close() {
    for value in ["gzip", "chunked, gzip", "identity"] {
        let h = head(&response(
            "HTTP/1.1 200 OK",
            &format!("transfer-encoding: {value}\r\n"),
        ));
        assert_eq!(h.framing, BodyFraming::UntilClose, "{value:?}");
        assert!(!h.reusable, "{value:?}");
    }
}

#[test]
fn the_last_transfer_encoding_line_decides_whether_the_body_is_chunked() {
    let h = head(&response(
        "HTTP/1.1 200 OK",
        "transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
    ));
    assert_eq!(h.framing, BodyFraming::Chunked);
    let h = head(&response(
        "HTTP/1.1 200 OK",
        "transfer-encoding: chunked\r\ntransfer-encoding: gzip\r\n",
    ));
    assert_eq!(h.framing, BodyFraming::UntilClose);
}

#[test]
fn status_204_and_304_have_no_body_even_with_framing_headers() {
    for status in ["204 No Content", "304 Not Modified"] {
        for headers in [
            "",
            "content-length: 10\r\n",
            "transfer-encoding: chunked\r\n",
        ] {
            let h = head(&response(&format!("HTTP/1.1 {status}"), headers));
            assert_eq!(h.framing, BodyFraming::Empty, "{status} {headers:?}");
            assert!(h.reusable, "{status} {headers:?}");
            assert!(!h.is_interim());
        }
    }
}

#[test]
fn interim_1xx_heads_have_no_body_and_are_interim() {
    for status in ["100 Continue", "102 Processing", "103 Early Hints"] {
        let h = head(&response(
            &format!("HTTP/1.1 {status}"),
            "link: </a.css>; rel=preload\r\n",
        ));
        assert_eq!(h.framing, BodyFraming::Empty, "{status}");
        assert!(h.is_interim(), "{status}");
    }
    let h = head(&response("HTTP/1.1 200 OK", "content-length: 0\r\n"));
    assert!(!h.is_interim());
    let h = head(&response("HTTP/1.1 199 Whatever", ""));
    assert!(h.is_interim());
}

#[test]
fn a_final_head_is_read_right_after_an_interim_one() {
    let mut buf = response("HTTP/1.1 100 Continue", "");
    let first_len = buf.len();
    buf.extend_from_slice(&response("HTTP/1.1 201 Created", "content-length: 2\r\n"));
    let interim = head(&buf);
    assert!(interim.is_interim());
    assert_eq!(interim.head_len, first_len);
    let fin = head(&buf[interim.head_len..]);
    assert_eq!(fin.status, 201);
    assert_eq!(fin.framing, BodyFraming::Length(2));
}

#[test]
fn transfer_encoding_with_content_length_is_chunked_and_not_reusable() {
    for headers in [
        "transfer-encoding: chunked\r\ncontent-length: 10\r\n",
        "content-length: 10\r\ntransfer-encoding: chunked\r\n",
    ] {
        let h = head(&response("HTTP/1.1 200 OK", headers));
        assert_eq!(h.framing, BodyFraming::Chunked, "{headers:?}");
        assert!(!h.reusable, "{headers:?}");
    }
}

#[test]
fn an_http_1_0_response_is_not_reusable_even_with_keep_alive() {
    for headers in [
        "content-length: 3\r\n",
        "content-length: 3\r\nconnection: keep-alive\r\n",
    ] {
        let h = head(&response("HTTP/1.0 200 OK", headers));
        assert_eq!(h.framing, BodyFraming::Length(3));
        assert!(!h.reusable, "{headers:?}");
    }
}

#[test]
fn a_connection_close_token_makes_a_response_not_reusable() {
    for value in ["close", "CLOSE", "keep-alive, close"] {
        let h = head(&response(
            "HTTP/1.1 200 OK",
            &format!("content-length: 3\r\nConnection: {value}\r\n"),
        ));
        assert_eq!(h.framing, BodyFraming::Length(3));
        assert!(!h.reusable, "{value:?}");
    }
    let h = head(&response(
        "HTTP/1.1 200 OK",
        "content-length: 3\r\nconnection: keep-alive\r\n",
    ));
    assert!(h.reusable);
}

#[test]
fn conflicting_content_lengths_are_an_error() {
    assert_eq!(
        head_err(&response(
            "HTTP/1.1 200 OK",
            "content-length: 3\r\ncontent-length: 4\r\n"
        )),
        FramingError::ConflictingLength
    );
}

#[test]
fn identical_duplicate_content_lengths_are_accepted() {
    let h = head(&response(
        "HTTP/1.1 200 OK",
        "content-length: 3\r\nContent-Length: 003\r\n",
    ));
    assert_eq!(h.framing, BodyFraming::Length(3));
    assert!(h.reusable);
}

#[test]
fn a_content_length_that_is_not_plain_digits_is_a_bad_length() {
    for value in [
        "",
        "abc",
        "+5",
        "-1",
        "5, 5",
        "0x10",
        "5 5",
        "99999999999999999999",
    ] {
        assert_eq!(
            head_err(&response(
                "HTTP/1.1 200 OK",
                &format!("content-length: {value}\r\n")
            )),
            FramingError::BadLength,
            "{value:?}"
        );
    }
}

#[test]
fn status_101_is_an_unexpected_upgrade() {
    assert_eq!(
        head_err(&response(
            "HTTP/1.1 101 Switching Protocols",
            "upgrade: websocket\r\nconnection: upgrade\r\n"
        )),
        FramingError::UnexpectedUpgrade
    );
}

#[test]
fn every_strict_prefix_of_a_response_head_is_incomplete() {
    let buf = response(
        "HTTP/1.1 200 OK",
        "content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n",
    );
    for n in 0..buf.len() {
        assert_eq!(
            parse_response_head(&buf[..n]),
            Ok(None),
            "prefix of {n} bytes: {:?}",
            String::from_utf8_lossy(&buf[..n])
        );
    }
    assert_eq!(head(&buf).framing, BodyFraming::Chunked);
}

#[test]
fn an_incomplete_head_of_response_head_max_bytes_is_too_large_and_one_byte_less_waits() {
    let mut buf = b"HTTP/1.1 200 OK\r\nx-pad: ".to_vec();
    buf.resize(RESPONSE_HEAD_MAX_BYTES - 1, b'p');
    assert_eq!(parse_response_head(&buf), Ok(None));
    buf.push(b'p');
    assert_eq!(parse_response_head(&buf), Err(FramingError::HeadTooLarge));
    buf.extend_from_slice(b"ppp");
    assert_eq!(parse_response_head(&buf), Err(FramingError::HeadTooLarge));
}

#[test]
fn a_complete_head_of_response_head_max_bytes_is_accepted_and_one_byte_more_is_too_large() {
    let build = |total: usize| {
        let prefix = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nx-pad: ";
        let mut buf = prefix.to_vec();
        buf.resize(total - 4, b'p');
        buf.extend_from_slice(b"\r\n\r\n");
        assert_eq!(buf.len(), total);
        buf
    };
    let at_limit = build(RESPONSE_HEAD_MAX_BYTES);
    assert_eq!(head(&at_limit).head_len, RESPONSE_HEAD_MAX_BYTES);
    assert_eq!(
        parse_response_head(&build(RESPONSE_HEAD_MAX_BYTES + 1)),
        Err(FramingError::HeadTooLarge)
    );
}

#[test]
fn garbage_response_bytes_are_a_bad_head() {
    for garbage in [
        &b"\x00\x01\x02\x03\r\n\r\n"[..],
        b"<html>\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    ] {
        assert!(
            matches!(head_err(garbage), FramingError::BadHead(_)),
            "{:?}",
            String::from_utf8_lossy(garbage)
        );
    }
}

#[test]
fn a_response_with_more_than_headers_max_headers_is_a_bad_head() {
    let filler = |n: usize| {
        (0..n)
            .map(|i| format!("x-filler-{i}: v\r\n"))
            .collect::<String>()
    };
    let at_limit = response(
        "HTTP/1.1 200 OK",
        &format!("content-length: 0\r\n{}", filler(HEADERS_MAX - 1)),
    );
    assert_eq!(head(&at_limit).framing, BodyFraming::Length(0));
    let over = response(
        "HTTP/1.1 200 OK",
        &format!("content-length: 0\r\n{}", filler(HEADERS_MAX)),
    );
    assert!(matches!(head_err(&over), FramingError::BadHead(_)));
}

#[test]
fn the_first_content_type_is_captured_and_its_absence_is_none() {
    let h = head(&response(
        "HTTP/1.1 200 OK",
        "Content-Type: text/event-stream; charset=utf-8\r\ncontent-type: text/html\r\ncontent-length: 0\r\n",
    ));
    assert_eq!(
        h.content_type,
        Some(Bytes::from_static(b"text/event-stream; charset=utf-8"))
    );
    let h = head(&response("HTTP/1.1 200 OK", "content-length: 0\r\n"));
    assert_eq!(h.content_type, None);
}

#[test]
fn response_header_names_are_matched_case_insensitively() {
    let h = head(&response(
        "HTTP/1.1 500 Internal Server Error",
        "CONTENT-LENGTH: 7\r\nCONNECTION: CLOSE\r\n",
    ));
    assert_eq!(h.status, 500);
    assert_eq!(h.framing, BodyFraming::Length(7));
    assert!(!h.reusable);
    let h = head(&response(
        "HTTP/1.1 200 OK",
        "Transfer-Encoding: CHUNKED\r\n",
    ));
    assert_eq!(h.framing, BodyFraming::Chunked);
}

// ---------------------------------------------------------------------------------------------
// ChunkedDecoder

#[test]
fn a_simple_chunked_body_decodes_to_its_data_and_ends() {
    let input = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";
    assert_eq!(decode_whole(input), ended(b"hello world", b""));
}

#[test]
fn an_empty_chunked_body_ends_without_data() {
    assert_eq!(decode_whole(LAST_CHUNK), ended(b"", b""));
    assert_eq!(decode_whole(b"000\r\n\r\n"), ended(b"", b""));
}

#[test]
fn chunk_extensions_are_skipped() {
    let input = b"5;name=value\r\nhello\r\n1 ;a=\"b c\";d\r\n!\r\n0;last\r\n\r\n";
    assert_eq!(decode_whole(input), ended(b"hello!", b""));
    let input = b"3\t;x\r\nabc\r\n0\r\n\r\n";
    assert_eq!(decode_whole(input), ended(b"abc", b""));
}

#[test]
fn trailers_are_consumed_and_dropped() {
    let input = b"4\r\ndata\r\n0\r\nx-checksum: 1234\r\nx-other: a b\r\n\r\n";
    assert_eq!(decode_whole(input), ended(b"data", b""));
}

#[test]
fn upper_and_lower_case_hex_sizes_mean_the_same_length() {
    let data: Vec<u8> = (0..0xAB_u8).collect();
    for size in ["AB", "ab", "aB", "00Ab"] {
        let mut input = format!("{size}\r\n").into_bytes();
        input.extend_from_slice(&data);
        input.extend_from_slice(b"\r\n0\r\n\r\n");
        assert_eq!(decode_whole(&input), ended(&data, b""), "{size}");
    }
}

#[test]
fn data_is_handed_out_before_the_rest_of_its_chunk_arrives() {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::from(&b"a\r\nhel"[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Ok(Chunk::Data(Bytes::from_static(b"hel")))
    );
    assert_eq!(decoder.decode(&mut buf), Ok(Chunk::NeedMore));
    buf.extend_from_slice(b"lo worl");
    assert_eq!(
        decoder.decode(&mut buf),
        Ok(Chunk::Data(Bytes::from_static(b"lo worl")))
    );
    assert_eq!(decoder.decode(&mut buf), Ok(Chunk::NeedMore));
    assert!(!decoder.is_done());
    buf.extend_from_slice(b"\r\n0\r\n\r\n");
    assert_eq!(decoder.decode(&mut buf), Ok(Chunk::End));
    assert!(decoder.is_done());
    assert!(buf.is_empty());
}

#[test]
fn a_chunk_is_not_handed_out_past_its_size_when_the_next_one_is_buffered() {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::from(&b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Ok(Chunk::Data(Bytes::from_static(b"abc")))
    );
    assert_eq!(
        decoder.decode(&mut buf),
        Ok(Chunk::Data(Bytes::from_static(b"de")))
    );
    assert_eq!(decoder.decode(&mut buf), Ok(Chunk::End));
}

#[test]
fn empty_input_needs_more_in_every_state() {
    // Cut a body with extension and trailer after every byte: each cut point leaves the
    // decoder in some state, and an empty buffer there must be NeedMore, not an error.
    let input = b"5;e=1\r\nhello\r\n0\r\nx: y\r\n\r\n";
    for cut in 0..input.len() {
        let mut decoder = ChunkedDecoder::default();
        let mut buf = BytesMut::from(&input[..cut]);
        loop {
            match decoder.decode(&mut buf) {
                Ok(Chunk::Data(_)) => continue,
                Ok(Chunk::NeedMore) => break,
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        assert!(
            buf.is_empty(),
            "cut at {cut}: control bytes left unconsumed"
        );
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Chunk::NeedMore),
            "cut at {cut}"
        );
    }
}

#[test]
fn the_end_is_sticky_and_leaves_later_bytes_alone() {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::from(&b"0\r\n\r\n"[..]);
    assert_eq!(decoder.decode(&mut buf), Ok(Chunk::End));
    buf.extend_from_slice(b"5\r\nhello\r\n");
    for _ in 0..3 {
        assert_eq!(decoder.decode(&mut buf), Ok(Chunk::End));
        assert!(decoder.is_done());
    }
    assert_eq!(&buf[..], b"5\r\nhello\r\n");
}

#[test]
fn bytes_after_the_last_chunk_are_left_for_the_next_pipelined_response() {
    let next = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
    let mut input = b"2\r\nhi\r\n0\r\nx-t: 1\r\n\r\n".to_vec();
    input.extend_from_slice(next);
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::from(&input[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Ok(Chunk::Data(Bytes::from_static(b"hi")))
    );
    assert_eq!(decoder.decode(&mut buf), Ok(Chunk::End));
    assert_eq!(&buf[..], next);
}

#[test]
fn a_size_line_without_digits_is_missing_its_size() {
    for input in [&b"\r\n"[..], b";ext\r\n", b" 5\r\n", b"x\r\n"] {
        assert_eq!(bad_chunk(input), "missing chunk size", "{input:?}");
    }
    // A missing size for a later chunk too.
    assert_eq!(bad_chunk(b"1\r\na\r\n\r\n"), "missing chunk size");
}

#[test]
fn an_invalid_byte_after_the_size_digits_is_an_error() {
    for input in [&b"5x\r\n"[..], b"5\n", b"5-\r\n", b"5,5\r\n"] {
        assert_eq!(bad_chunk(input), "invalid byte in chunk size", "{input:?}");
    }
}

#[test]
fn fifteen_hex_digits_are_accepted_and_sixteen_are_too_large() {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::from(&b"fffffffffffffff\r\nab"[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Ok(Chunk::Data(Bytes::from_static(b"ab")))
    );
    assert_eq!(bad_chunk(b"1000000000000000\r\n"), "chunk size too large");
    // Leading zeros count: they are digits the peer chose to send.
    assert_eq!(bad_chunk(b"0000000000000005\r\n"), "chunk size too large");
}

#[test]
fn a_size_line_cr_not_followed_by_lf_is_an_error() {
    assert_eq!(bad_chunk(b"5\rX"), "chunk size line not ended by CRLF");
    assert_eq!(bad_chunk(b"5;e\r\r\n"), "chunk size line not ended by CRLF");
}

#[test]
fn chunk_data_not_followed_by_crlf_is_an_error() {
    for input in [
        &b"5\r\nhelloX"[..],
        b"5\r\nhello\rX",
        b"5\r\nhello\n",
        b"5\r\nhello world\r\n",
    ] {
        assert_eq!(
            bad_chunk(input),
            "chunk data not ended by CRLF",
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

#[test]
fn a_bare_lf_in_a_chunk_extension_is_an_error() {
    assert_eq!(bad_chunk(b"5;a=b\nhello"), "bare LF in chunk extension");
}

#[test]
fn a_trailer_line_or_the_final_line_not_ended_by_crlf_is_an_error() {
    assert_eq!(bad_chunk(b"0\r\nx: y\rX"), "trailer line not ended by CRLF");
    assert_eq!(bad_chunk(b"0\r\n\rX"), "trailer line not ended by CRLF");
}

// Chunk extensions and trailers follow RFC 9112 sections 7.1.1 and 5 strictly: what the grammar
// does not produce is refused, whatever the engine meant by it.

#[test]
fn a_chunk_size_followed_by_junk_is_refused() {
    for input in [
        &b"5 junk\r\nhello\r\n0\r\n\r\n"[..],
        b"5\tjunk\r\nhello\r\n0\r\n\r\n",
        b"5  x;a\r\nhello\r\n0\r\n\r\n",
    ] {
        assert_eq!(
            bad_chunk(input),
            "chunk extension not started by ';'",
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

#[test]
fn whitespace_after_the_size_is_refused_unless_an_extension_follows() {
    assert_eq!(
        bad_chunk(b"5 \r\nhello\r\n0\r\n\r\n"),
        "whitespace before the end of a chunk size line"
    );
    assert_eq!(
        bad_chunk(b"0\t\r\n\r\n"),
        "whitespace before the end of a chunk size line"
    );
}

#[test]
fn whitespace_is_taken_around_semicolons_and_equals_signs() {
    let input = b"5 ; name\r\nhello\r\n1\t;\ta = b ; c= \"d\" ;e\r\n!\r\n0 ;last\r\n\r\n";
    assert_eq!(decode_whole(input), ended(b"hello!", b""));
}

#[test]
fn whitespace_right_before_the_crlf_of_an_extension_is_refused() {
    assert_bad_chunks(&[
        (
            &b"5;a \r\nhello\r\n0\r\n\r\n"[..],
            "whitespace before the end of a chunk size line",
        ),
        (
            b"5;a=b \r\nhello\r\n0\r\n\r\n",
            "whitespace before the end of a chunk size line",
        ),
        (
            b"5;a=\"b\" \r\nhello\r\n0\r\n\r\n",
            "whitespace before the end of a chunk size line",
        ),
        (
            b"5; \r\nhello\r\n0\r\n\r\n",
            "chunk extension without a name",
        ),
    ]);
}

#[test]
fn a_chunk_extension_without_a_name_or_without_a_value_after_equals_is_refused() {
    assert_bad_chunks(&[
        (
            &b"5;\r\nhello\r\n0\r\n\r\n"[..],
            "chunk extension without a name",
        ),
        (
            b"5;;a\r\nhello\r\n0\r\n\r\n",
            "chunk extension without a name",
        ),
        (
            b"5;=v\r\nhello\r\n0\r\n\r\n",
            "chunk extension without a name",
        ),
        (
            b"5;a=\r\nhello\r\n0\r\n\r\n",
            "chunk extension without a value",
        ),
        (
            b"5;a=;b\r\nhello\r\n0\r\n\r\n",
            "chunk extension without a value",
        ),
    ]);
}

#[test]
fn a_non_token_byte_in_an_extension_name_or_token_value_is_refused() {
    assert_bad_chunks(&[
        (
            &b"5;a/b\r\nhello\r\n0\r\n\r\n"[..],
            "invalid byte in chunk extension name",
        ),
        (
            b"5;a b\r\nhello\r\n0\r\n\r\n",
            "invalid byte in chunk extension name",
        ),
        (
            b"5;a=b/c\r\nhello\r\n0\r\n\r\n",
            "invalid byte in chunk extension value",
        ),
        (
            b"5;a=b\x00\r\nhello\r\n0\r\n\r\n",
            "invalid byte in chunk extension value",
        ),
        (
            b"5;a=\x80\r\nhello\r\n0\r\n\r\n",
            "chunk extension without a value",
        ),
    ]);
}

#[test]
fn a_quoted_extension_value_may_hold_separators_escapes_and_obs_text() {
    let input = b"5;a=\"b; c=d \\\"e\\\\ \x80\xff\"\r\nhello\r\n0;x=\"\"\r\n\r\n";
    assert_eq!(decode_whole(input), ended(b"hello", b""));
}

#[test]
fn a_quoted_extension_value_with_a_control_byte_left_open_or_followed_by_junk_is_refused() {
    assert_bad_chunks(&[
        (
            &b"5;a=\"b\x01\"\r\nhello\r\n0\r\n\r\n"[..],
            "invalid byte in a quoted chunk extension value",
        ),
        (
            b"5;a=\"b\\\x01\"\r\nhello\r\n0\r\n\r\n",
            "invalid byte in a quoted chunk extension value",
        ),
        (
            b"5;a=\"b\r\nhello\r\n0\r\n\r\n",
            "invalid byte in a quoted chunk extension value",
        ),
        (
            b"5;a=\"b\"c\r\nhello\r\n0\r\n\r\n",
            "invalid byte after a quoted chunk extension value",
        ),
    ]);
}

#[test]
fn a_bare_lf_inside_a_trailer_line_is_refused() {
    for input in [
        &b"0\r\nx: a\nb\r\n\r\n"[..],
        b"4\r\ndata\r\n0\r\nx-checksum: 1\nx-other: 2\r\n\r\n",
        b"0\r\nx\n: y\r\n\r\n",
        b"0\r\n\n",
    ] {
        assert_eq!(
            bad_chunk(input),
            "bare LF in a trailer line",
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

#[test]
fn a_trailer_line_that_is_not_a_name_a_colon_and_a_value_is_refused() {
    for input in [
        &b"0\r\n: v\r\n\r\n"[..],
        b"0\r\nno-colon\r\n\r\n",
        b"0\r\nx y: v\r\n\r\n",
        // Obsolete line folding: a continuation line starting with whitespace.
        b"0\r\nx: a\r\n b\r\n\r\n",
    ] {
        assert_eq!(
            bad_chunk(input),
            "invalid trailer field name",
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

#[test]
fn a_control_byte_in_a_trailer_value_is_refused() {
    for input in [&b"0\r\nx: a\x00b\r\n\r\n"[..], b"0\r\nx: a\x7fb\r\n\r\n"] {
        assert_eq!(
            bad_chunk(input),
            "invalid byte in a trailer field value",
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

#[test]
fn trailer_values_may_be_empty_or_hold_tabs_and_obs_text() {
    let input = b"1\r\nX\r\n0\r\nx-empty:\r\nx-t:\ta\x80b \r\n\r\n";
    assert_eq!(decode_whole(input), ended(b"X", b""));
}

/// A size line of `n` bytes of size and extensions (CRLF not counted), then one data byte.
fn size_line_of(n: usize) -> Vec<u8> {
    let mut input = b"1;".to_vec();
    input.resize(n, b'e');
    input.extend_from_slice(b"\r\nX\r\n0\r\n\r\n");
    input
}

#[test]
fn a_size_line_one_byte_under_the_limit_is_accepted() {
    assert_eq!(
        decode_whole(&size_line_of(CHUNK_LINE_MAX_BYTES - 1)),
        ended(b"X", b"")
    );
}

#[test]
fn a_size_line_of_exactly_chunk_line_max_bytes_is_accepted() {
    assert_eq!(
        decode_whole(&size_line_of(CHUNK_LINE_MAX_BYTES)),
        ended(b"X", b"")
    );
}

#[test]
fn a_size_line_longer_than_chunk_line_max_bytes_is_an_error() {
    assert_eq!(
        bad_chunk(&size_line_of(CHUNK_LINE_MAX_BYTES + 1)),
        "chunk size line too long"
    );
}

#[test]
fn an_endless_size_line_is_refused_after_at_most_chunk_line_max_bytes_plus_one() {
    let mut decoder = ChunkedDecoder::default();
    let mut input = b"1;".to_vec();
    input.resize(4 * CHUNK_LINE_MAX_BYTES, b'e');
    let mut buf = BytesMut::from(&input[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Err(FramingError::BadChunk("chunk size line too long"))
    );
    let consumed = input.len() - buf.len();
    assert!(
        consumed <= CHUNK_LINE_MAX_BYTES + 1,
        "consumed {consumed} bytes before refusing"
    );
}

#[test]
fn the_size_line_limit_applies_to_each_line_not_to_the_body() {
    // Many chunks whose size lines together far exceed the limit.
    let mut input = Vec::new();
    let ext = ";".to_string() + &"e".repeat(CHUNK_LINE_MAX_BYTES / 2);
    for _ in 0..8 {
        input.extend_from_slice(format!("1{ext}\r\nX\r\n").as_bytes());
    }
    input.extend_from_slice(LAST_CHUNK);
    assert_eq!(decode_whole(&input), ended(b"XXXXXXXX", b""));
}

/// Trailer lines (each `x-t: ` plus padding and CRLF) carrying `n` bytes of fields in total,
/// CRLFs not counted.
fn trailers_of(n: usize) -> Vec<u8> {
    let mut input = b"1\r\nX\r\n0\r\n".to_vec();
    let mut left = n;
    while left > 0 {
        let line = left.min(1000);
        let mut field = b"x-t: ".to_vec();
        field.resize(line.max(field.len()), b'v');
        field.truncate(line);
        input.extend_from_slice(&field);
        input.extend_from_slice(b"\r\n");
        left -= line;
    }
    input.extend_from_slice(b"\r\n");
    input
}

#[test]
fn trailers_well_under_the_limit_are_accepted() {
    assert_eq!(
        decode_whole(&trailers_of(CHUNK_TRAILERS_MAX_BYTES / 2)),
        ended(b"X", b"")
    );
}

#[test]
fn trailers_longer_than_chunk_trailers_max_bytes_are_an_error() {
    assert_eq!(
        bad_chunk(&trailers_of(CHUNK_TRAILERS_MAX_BYTES + 1)),
        "trailers too long"
    );
    // An endless trailer line is refused without reading it all.
    let mut input = b"0\r\nx-t: ".to_vec();
    input.resize(4 * CHUNK_TRAILERS_MAX_BYTES, b'v');
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::from(&input[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Err(FramingError::BadChunk("trailers too long"))
    );
    assert!(input.len() - buf.len() <= CHUNK_TRAILERS_MAX_BYTES + 8);
}

#[test]
fn trailers_of_exactly_chunk_trailers_max_bytes_in_one_field_are_accepted() {
    let mut input = b"0\r\nx-t: ".to_vec();
    input.resize(3 + CHUNK_TRAILERS_MAX_BYTES, b'v');
    input.extend_from_slice(b"\r\n\r\n");
    assert_eq!(decode_whole(&input), ended(b"", b""));
}

// ---------------------------------------------------------------------------------------------
// encoders

#[test]
fn a_length_framed_response_head_parses_back_with_every_header() {
    let mut out = Vec::new();
    encode_response_head(&mut out, &out_head(OutFraming::Length(1234), false));
    let (status, reason, headers) = parse_encoded_response(&out);
    assert_eq!(status, 200);
    assert_eq!(reason, "OK");
    assert_eq!(
        headers,
        vec![
            ("content-type".into(), "application/json".into()),
            ("x-request-id".into(), "req-1".into()),
            ("x-kvroute-decision".into(), "worker=w1;overlap=3".into()),
            ("content-length".into(), "1234".into()),
        ]
    );
}

#[test]
fn a_chunked_response_head_has_transfer_encoding_and_no_content_length() {
    let mut out = Vec::new();
    encode_response_head(&mut out, &out_head(OutFraming::Chunked, false));
    let (_, _, headers) = parse_encoded_response(&out);
    assert_eq!(header(&headers, "transfer-encoding"), Some("chunked"));
    assert_eq!(header(&headers, "content-length"), None);
}

#[test]
fn connection_close_is_written_only_when_closing() {
    for framing in [OutFraming::Length(0), OutFraming::Chunked] {
        let mut out = Vec::new();
        encode_response_head(&mut out, &out_head(framing, true));
        let (_, _, headers) = parse_encoded_response(&out);
        assert_eq!(header(&headers, "connection"), Some("close"));
        let mut out = Vec::new();
        encode_response_head(&mut out, &out_head(framing, false));
        let (_, _, headers) = parse_encoded_response(&out);
        assert_eq!(header(&headers, "connection"), None);
    }
}

#[test]
fn decision_and_content_type_headers_are_written_only_when_given() {
    let mut out = Vec::new();
    encode_response_head(
        &mut out,
        &ResponseHeadOut {
            date: b"",
            status: 503,
            content_type: None,
            request_id: "generated-7",
            decision: None,
            framing: OutFraming::Length(0),
            close: false,
        },
    );
    let (status, reason, headers) = parse_encoded_response(&out);
    assert_eq!(status, 503);
    assert_eq!(reason, "Service Unavailable");
    assert_eq!(
        headers,
        vec![
            ("x-request-id".into(), "generated-7".into()),
            ("content-length".into(), "0".into()),
        ]
    );
}

#[test]
fn a_status_without_a_canonical_reason_is_written_as_unknown() {
    let mut out = Vec::new();
    let mut h = out_head(OutFraming::Length(0), false);
    h.status = 599;
    encode_response_head(&mut out, &h);
    let (status, reason, _) = parse_encoded_response(&out);
    assert_eq!(status, 599);
    assert_eq!(reason, "Unknown");
}

#[test]
fn content_length_decimals_are_written_exactly_up_to_u64_max() {
    for n in [0, 9, 10, 99, 100, 1_000_000, u64::MAX] {
        let mut out = Vec::new();
        encode_response_head(&mut out, &out_head(OutFraming::Length(n), false));
        let (_, _, headers) = parse_encoded_response(&out);
        let expected = n.to_string();
        assert_eq!(header(&headers, "content-length"), Some(expected.as_str()));
    }
}

#[test]
fn a_request_head_parses_back_with_target_host_length_and_extra_headers_in_order() {
    let mut out = Vec::new();
    encode_request_head(
        &mut out,
        "/v1/chat/completions?x=1",
        "10.0.0.7:8000",
        4321,
        &[("x-request-id", "abc"), ("traceparent", "00-01-02-01")],
    );
    let mut headers = [httparse::EMPTY_HEADER; 16];
    let mut req = httparse::Request::new(&mut headers);
    assert_eq!(req.parse(&out), Ok(httparse::Status::Complete(out.len())));
    assert_eq!(req.method, Some("POST"));
    assert_eq!(req.path, Some("/v1/chat/completions?x=1"));
    assert_eq!(req.version, Some(1));
    let got: Vec<(&str, &[u8])> = req.headers.iter().map(|h| (h.name, h.value)).collect();
    assert_eq!(
        got,
        vec![
            ("host", &b"10.0.0.7:8000"[..]),
            ("content-type", &b"application/json"[..]),
            ("content-length", &b"4321"[..]),
            ("x-request-id", &b"abc"[..]),
            ("traceparent", &b"00-01-02-01"[..]),
        ]
    );
}

#[test]
fn a_request_head_writes_usize_max_as_its_exact_decimal() {
    let mut out = Vec::new();
    encode_request_head(&mut out, "/generate", "h", usize::MAX, &[]);
    let text = String::from_utf8(out).expect("ascii head");
    assert!(
        text.contains(&format!("\r\ncontent-length: {}\r\n", usize::MAX)),
        "{text:?}"
    );
}

#[test]
fn an_encoded_chunk_has_its_length_in_lower_case_hex() {
    for len in [
        1usize,
        9,
        10,
        15,
        16,
        255,
        256,
        4095,
        4096,
        65535,
        65536,
        1 << 20,
    ] {
        let data = vec![b'z'; len];
        let mut out = Vec::new();
        encode_chunk(&mut out, &data);
        let line = format!("{len:x}\r\n");
        assert!(out.starts_with(line.as_bytes()), "{len}: size line");
        assert_eq!(&out[line.len()..line.len() + len], &data[..]);
        assert_eq!(&out[line.len() + len..], b"\r\n");
    }
    let mut out = Vec::new();
    encode_chunk(&mut out, &[7u8; 255]);
    assert_eq!(&out[..4], b"ff\r\n");
}

#[test]
fn encode_chunk_appends_to_what_is_already_in_the_buffer() {
    let mut out = b"prefix".to_vec();
    encode_chunk(&mut out, b"ab");
    assert_eq!(out, b"prefix2\r\nab\r\n");
}

// ---------------------------------------------------------------------------------------------
// properties

fn chunk_lists() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec(prop::collection::vec(any::<u8>(), 1..600), 0..12)
}

fn piece_sizes() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..64, 1..32)
}

/// Chunk extensions as RFC 9112 section 7.1.1 writes them: whitespace around `;` and `=`,
/// token names, token or quoted-string values (with quoted pairs).
fn chunk_extensions() -> impl Strategy<Value = String> {
    r#"([ \t]?;[ \t]?[a-z0-9!#$%&'*+.^_`|~-]{1,8}([ \t]?=[ \t]?([a-z0-9]{1,6}|"([a-z0-9 ;=]|\\[a-z"\\]){0,6}"))?){0,3}"#
}

/// Bytes biased towards the decoder's control alphabet so that arbitrary input reaches the
/// deeper states (data, trailers) and not only "missing chunk size".
fn chunked_ish_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![
            3 => prop::sample::select(b"0123456789abcdefABCDEF;=\r\n \tx:".to_vec()),
            1 => any::<u8>(),
        ],
        0..400,
    )
}

proptest! {
    #[test]
    fn encoded_chunks_split_at_arbitrary_points_decode_to_their_concatenation_and_end(
        chunks in chunk_lists(),
        pieces in piece_sizes(),
        next_response in prop::collection::vec(any::<u8>(), 0..32),
    ) {
        let mut input = encode_chunks(&chunks);
        input.extend_from_slice(&next_response);
        let got = decode_in_pieces(&input, &pieces);
        prop_assert_eq!(got, ended(&chunks.concat(), &next_response));
    }

    #[test]
    fn chunks_with_extensions_and_trailers_split_anywhere_decode_to_their_data(
        chunks in prop::collection::vec(
            (prop::collection::vec(any::<u8>(), 1..300), chunk_extensions()),
            0..8,
        ),
        trailers in prop::collection::vec("[a-z-]{1,10}: [ -~]{0,30}", 0..4),
        upper_case in any::<bool>(),
        pieces in piece_sizes(),
    ) {
        let mut input = Vec::new();
        for (data, ext) in &chunks {
            let size = if upper_case {
                format!("{:X}", data.len())
            } else {
                format!("{:x}", data.len())
            };
            input.extend_from_slice(format!("{size}{ext}\r\n").as_bytes());
            input.extend_from_slice(data);
            input.extend_from_slice(b"\r\n");
        }
        input.extend_from_slice(b"0\r\n");
        for t in &trailers {
            input.extend_from_slice(format!("{t}\r\n").as_bytes());
        }
        input.extend_from_slice(b"\r\n");
        let data: Vec<u8> = chunks.iter().flat_map(|(d, _)| d.clone()).collect();
        prop_assert_eq!(decode_in_pieces(&input, &pieces), ended(&data, b""));
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics_and_does_not_depend_on_the_splits(
        input in chunked_ish_bytes(),
        pieces in piece_sizes(),
    ) {
        prop_assert_eq!(decode_in_pieces(&input, &pieces), decode_whole(&input));
    }

    #[test]
    fn decoding_uniformly_random_bytes_never_panics_and_does_not_depend_on_the_splits(
        input in prop::collection::vec(any::<u8>(), 0..400),
        pieces in piece_sizes(),
    ) {
        prop_assert_eq!(decode_in_pieces(&input, &pieces), decode_whole(&input));
    }

    #[test]
    fn classify_request_never_panics_and_a_fast_head_lies_within_the_buffer(
        input in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        if let RequestHead::Fast(f) = classify_request(&input) {
            prop_assert!(f.head_len <= input.len());
        }
    }

    #[test]
    fn parse_response_head_never_panics_and_a_head_lies_within_the_buffer(
        input in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        if let Ok(Some(h)) = parse_response_head(&input) {
            prop_assert!(h.head_len <= input.len());
        }
    }

    #[test]
    fn an_encoded_request_head_is_classified_fast_with_its_length_whatever_body_follows(
        route in 0usize..3,
        query in "(\\?[a-z=&]{0,10})?",
        content_length in 0usize..=9_999_999_999_999_999_999,
        body in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let (path, want_route) = ROUTES[route];
        let mut out = Vec::new();
        encode_request_head(
            &mut out,
            &format!("{path}{query}"),
            "127.0.0.1:1",
            content_length,
            &[("x-request-id", "rid")],
        );
        let head_len = out.len();
        out.extend_from_slice(&body);
        prop_assert_eq!(
            classify_request(&out),
            RequestHead::Fast(FastRequest {
                route: want_route,
                head_len,
                content_length: content_length as u64,
                keep_alive: true,
                request_id: Some("rid".to_string()),
            })
        );
    }

    #[test]
    fn an_encoded_response_head_is_read_back_by_parse_response_head(
        status in (200u16..600).prop_filter("no-body statuses", |s| *s != 204 && *s != 304),
        length in prop::option::of(any::<u64>()),
        close in any::<bool>(),
        with_content_type in any::<bool>(),
    ) {
        let framing = length.map_or(OutFraming::Chunked, OutFraming::Length);
        let content_type: &[u8] = b"text/event-stream";
        let mut out = Vec::new();
        encode_response_head(&mut out, &ResponseHeadOut {
            date: b"",
            status,
            content_type: with_content_type.then_some(content_type),
            request_id: "r",
            decision: Some(b"d"),
            framing,
            close,
        });
        let h = parse_response_head(&out);
        // u64 values of 20 digits are beyond the strict 19-digit parser.
        if length.is_some_and(|n| n > 9_999_999_999_999_999_999) {
            prop_assert_eq!(h, Err(FramingError::BadLength));
        } else {
            prop_assert_eq!(h, Ok(Some(ResponseHead {
                status,
                head_len: out.len(),
                content_type: with_content_type.then_some(Bytes::from_static(b"text/event-stream")),
                framing: length.map_or(BodyFraming::Chunked, BodyFraming::Length),
                reusable: !close,
            })));
        }
    }
}

#[test]
fn a_status_code_outside_100_to_599_is_a_bad_head() {
    for head in [
        &b"HTTP/1.1 099 Odd\r\ncontent-length: 0\r\n\r\n"[..],
        &b"HTTP/1.1 600 Odd\r\ncontent-length: 0\r\n\r\n"[..],
    ] {
        assert!(
            matches!(parse_response_head(head), Err(FramingError::BadHead(_))),
            "{:?} must be refused",
            String::from_utf8_lossy(head)
        );
    }
    assert!(parse_response_head(b"HTTP/1.1 599 Odd\r\ncontent-length: 0\r\n\r\n").is_ok());
}

#[test]
fn statuses_without_a_body_get_no_framing_header() {
    for status in [204, 304] {
        assert_eq!(OutFraming::for_status(status, Some(0)), OutFraming::NoBody);
        let mut out = Vec::new();
        encode_response_head(
            &mut out,
            &ResponseHeadOut {
                date: b"",
                status,
                content_type: None,
                request_id: "r",
                decision: None,
                framing: OutFraming::NoBody,
                close: false,
            },
        );
        let text = String::from_utf8(out).unwrap();
        assert!(
            !text.contains("content-length") && !text.contains("transfer-encoding"),
            "{text}"
        );
    }
    assert_eq!(OutFraming::for_status(200, Some(7)), OutFraming::Length(7));
    assert_eq!(OutFraming::for_status(200, None), OutFraming::Chunked);
}
