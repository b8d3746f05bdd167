//! HTTP/1.1 message framing for the hand-written data path: reading a request head, reading a
//! response head, decoding a chunked body, and writing heads and chunks. Pure: bytes in, bytes
//! or decisions out, no I/O, so every rule here is unit- and property-tested on its own.
//!
//! Why hand-written (the rest of the router uses hyper): the three proxied inference routes are
//! the latency-bound path, and hyper's server plus a pooled client cost two generic connection
//! state machines, header maps and boxed futures per hop (measured in docs/BENCHMARKS.md). So
//! only the narrow, common case is handled here, and everything else keeps going through hyper:
//! - a request is taken only when [`classify_request`] says so (its doc is THE statement of
//!   what the fast path takes); anything else is [`RequestHead::Other`], and the caller hands
//!   the connection to a general server with the bytes already read.
//! - a response head is accepted in every framing an engine may use (length, chunked, until
//!   close, no body for 204/304; 1xx interim heads are reported so the caller skips them), and
//!   anything it cannot frame safely is an error, never a guess.
//! - every buffer the peer controls has a named limit.

use bytes::{Bytes, BytesMut};

/// Longest request head the fast path parses; a longer one is handed to hyper, whose own
/// limit then applies.
pub const REQUEST_HEAD_MAX_BYTES: usize = 64 * 1024;
/// Longest response head accepted from an engine.
pub const RESPONSE_HEAD_MAX_BYTES: usize = 64 * 1024;
/// Most header lines parsed in one head (request: more means hyper takes it; response: error).
pub const HEADERS_MAX: usize = 64;
/// Longest chunk-size line (size and extensions) in a chunked body.
pub const CHUNK_LINE_MAX_BYTES: usize = 4 * 1024;
/// Most bytes of trailer fields after the last chunk (they are read and dropped).
pub const CHUNK_TRAILERS_MAX_BYTES: usize = 16 * 1024;
/// Longest client request id forwarded as is (longer ones are replaced by a generated one).
pub const REQUEST_ID_MAX_BYTES: usize = 128;

/// The three proxied routes, as the fast path recognises them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastRoute {
    Completions,
    ChatCompletions,
    Generate,
}

/// A request head the fast path serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FastRequest {
    pub route: FastRoute,
    /// Bytes of the head, CRLFCRLF included; the body starts here.
    pub head_len: usize,
    pub content_length: u64,
    /// False when the client asked to close after this response (`Connection: close`).
    pub keep_alive: bool,
    /// The client's `x-request-id` when it is usable as a header value and not too long.
    pub request_id: Option<String>,
}

/// What to do with the bytes at the front of a client connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestHead {
    /// The head is not complete yet.
    Partial,
    Fast(FastRequest),
    /// Not the fast path's case: hand the connection (and these bytes) to the general server.
    Other,
}

fn header_is(name: &str, wanted: &str) -> bool {
    name.eq_ignore_ascii_case(wanted)
}

/// True when the comma-separated `Connection` value has `token`.
fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// A header value as a request id if it would be a valid header value on the way out: visible
/// ASCII, space or tab, non-empty, at most [`REQUEST_ID_MAX_BYTES`].
pub fn usable_request_id(value: &[u8]) -> Option<&str> {
    let ok = !value.is_empty() && value.len() <= REQUEST_ID_MAX_BYTES && is_header_value(value);
    if ok {
        std::str::from_utf8(value).ok()
    } else {
        None
    }
}

/// True when `value` can be written as a header value: visible ASCII, space or tab.
pub fn is_header_value(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| b == b'\t' || (0x20..=0x7e).contains(&b))
}

/// Only digits, and a value that fits: the strict form, so a smuggling-shaped length (`+5`,
/// `5, 5`, ` 5x`) is never taken by the fast path.
fn parse_content_length(value: &[u8]) -> Option<u64> {
    let value = value.trim_ascii();
    if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// Classifies the bytes at the front of a client connection. The fast path takes a request only
/// when it is exactly `POST` to one of the three proxied routes, over HTTP/1.1, with a `Host`,
/// framed by a single valid `Content-Length` (digits only), with no `Transfer-Encoding`, `Expect`
/// or `Upgrade`, and a head within [`REQUEST_HEAD_MAX_BYTES`] and [`HEADERS_MAX`]. A query string
/// is accepted and, as on the general server, not forwarded: the engine gets the route's path. Anything else
/// (another route, chunked upload, HTTP/1.0, HTTP/2 prior knowledge, a malformed head) is
/// [`RequestHead::Other`], so a general server answers it exactly as it would have (its own 400s
/// included).
pub fn classify_request(buf: &[u8]) -> RequestHead {
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n <= REQUEST_HEAD_MAX_BYTES => n,
        Ok(httparse::Status::Partial) if buf.len() < REQUEST_HEAD_MAX_BYTES => {
            return RequestHead::Partial;
        }
        // Too long for the fast path (complete or not): hyper's own limit decides.
        Ok(_) | Err(_) => return RequestHead::Other,
    };
    if req.method != Some("POST") || req.version != Some(1) {
        return RequestHead::Other;
    }
    let path = req.path.unwrap_or("");
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    let route = match path {
        "/v1/completions" => FastRoute::Completions,
        "/v1/chat/completions" => FastRoute::ChatCompletions,
        "/generate" => FastRoute::Generate,
        _ => return RequestHead::Other,
    };
    let mut content_length = None;
    let mut keep_alive = true;
    let mut request_id = None;
    let mut request_id_seen = false;
    let mut has_host = false;
    for h in req.headers.iter() {
        if header_is(h.name, "host") {
            has_host = true;
        } else if header_is(h.name, "content-length") {
            if content_length.is_some() {
                return RequestHead::Other;
            }
            match parse_content_length(h.value) {
                Some(n) => content_length = Some(n),
                None => return RequestHead::Other,
            }
        } else if header_is(h.name, "transfer-encoding")
            || header_is(h.name, "expect")
            || header_is(h.name, "upgrade")
        {
            return RequestHead::Other;
        } else if header_is(h.name, "connection") {
            if has_token(h.value, "upgrade") {
                return RequestHead::Other;
            }
            if has_token(h.value, "close") {
                keep_alive = false;
            }
        } else if header_is(h.name, "x-request-id") && !request_id_seen {
            // Only the first one counts, usable or not, as on the general server.
            request_id_seen = true;
            request_id = usable_request_id(h.value).map(str::to_string);
        }
    }
    let Some(content_length) = content_length else {
        return RequestHead::Other;
    };
    // RFC 9112 section 3.2: an HTTP/1.1 request without Host gets a 400. The general server
    // answers it (the router's app refuses it there), so both servers answer alike.
    if !has_host {
        return RequestHead::Other;
    }
    RequestHead::Fast(FastRequest {
        route,
        head_len,
        content_length,
        keep_alive,
        request_id,
    })
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body (204, 304).
    Empty,
    Length(u64),
    Chunked,
    /// Until the engine closes the connection (HTTP/1.0 style); the connection is not reused.
    UntilClose,
}

/// What the proxy needs from an engine's response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub head_len: usize,
    pub content_type: Option<Bytes>,
    pub framing: BodyFraming,
    /// The connection may carry another request after this response's body.
    pub reusable: bool,
}

impl ResponseHead {
    /// An interim (1xx) head: the final head follows it on the same connection.
    pub fn is_interim(&self) -> bool {
        (100..200).contains(&self.status)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    #[error("malformed response head: {0}")]
    BadHead(String),
    #[error("response head longer than {RESPONSE_HEAD_MAX_BYTES} bytes")]
    HeadTooLarge,
    #[error("conflicting Content-Length values")]
    ConflictingLength,
    #[error("invalid Content-Length")]
    BadLength,
    #[error("switching protocols was not asked for")]
    UnexpectedUpgrade,
    #[error("malformed chunked body: {0}")]
    BadChunk(&'static str),
}

/// Parses an engine's response head at the front of `buf`; `Ok(None)` while it is incomplete.
pub fn parse_response_head(buf: &[u8]) -> Result<Option<ResponseHead>, FramingError> {
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut resp = httparse::Response::new(&mut headers);
    let head_len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= RESPONSE_HEAD_MAX_BYTES => {
            return Err(FramingError::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(FramingError::BadHead(e.to_string())),
    };
    if head_len > RESPONSE_HEAD_MAX_BYTES {
        return Err(FramingError::HeadTooLarge);
    }
    let status = resp.code.unwrap_or(0);
    if !(100..=599).contains(&status) {
        return Err(FramingError::BadHead(format!(
            "status code {status} out of range"
        )));
    }
    if status == 101 {
        return Err(FramingError::UnexpectedUpgrade);
    }
    let mut reusable = resp.version == Some(1);
    let mut content_type = None;
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut transfer_encoded = false;
    for h in resp.headers.iter() {
        if header_is(h.name, "content-length") {
            let n = parse_content_length(h.value).ok_or(FramingError::BadLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(FramingError::ConflictingLength);
            }
            length = Some(n);
        } else if header_is(h.name, "transfer-encoding") {
            transfer_encoded = true;
            // Chunked must be the last coding; only then is the body self-delimiting.
            chunked = h
                .value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if header_is(h.name, "connection") && has_token(h.value, "close") {
            reusable = false;
        } else if header_is(h.name, "content-type") && content_type.is_none() {
            content_type = Some(Bytes::copy_from_slice(h.value));
        }
    }
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        BodyFraming::Empty
    } else if transfer_encoded {
        // Transfer-Encoding overrides Content-Length (RFC 9112 6.3); such a message must not be
        // reused, since the sender may be confused about its framing.
        if length.is_some() {
            reusable = false;
        }
        if chunked {
            BodyFraming::Chunked
        } else {
            BodyFraming::UntilClose
        }
    } else if let Some(n) = length {
        BodyFraming::Length(n)
    } else {
        BodyFraming::UntilClose
    };
    if framing == BodyFraming::UntilClose {
        reusable = false;
    }
    Ok(Some(ResponseHead {
        status,
        head_len,
        content_type,
        framing,
        reusable,
    }))
}

/// One step of decoding a chunked body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Data(Bytes),
    /// `buf` holds no complete next step; read more.
    NeedMore,
    /// The last chunk and the trailers have been consumed.
    End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    Size { value: u64, digits: u8 },
    Extension { value: u64, at: ExtAt },
    SizeLf { value: u64 },
    Data { remaining: u64 },
    DataCr,
    DataLf,
    TrailerLineStart,
    TrailerName,
    TrailerValue,
    TrailerLf,
    FinalLf,
    Done,
}

/// Where the decoder is inside a chunk-size line's extensions, RFC 9112 section 7.1.1:
///
/// ```text
/// chunk-ext      = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] )
/// chunk-ext-name = token
/// chunk-ext-val  = token / quoted-string
/// ```
///
/// So after the size only whitespace then `;` may come (`5 junk` is refused, `5 ; name` is
/// taken), a name is a non-empty token, a value a non-empty token or a quoted string, and
/// whitespace is allowed only where BWS stands: around `;` and `=`, not before the CRLF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExtAt {
    /// Whitespace after the size or after a value: only more whitespace or `;` may follow.
    BeforeSemi,
    /// After `;`: whitespace or the first byte of a name.
    BeforeName,
    /// Inside a name.
    Name,
    /// Whitespace after a name: `=`, `;` or more whitespace.
    AfterName,
    /// After `=`: whitespace or the first byte of a value.
    BeforeValue,
    /// Inside a token value.
    Token,
    /// Inside a quoted-string value.
    Quoted,
    /// After a backslash inside a quoted string.
    QuotedPair,
    /// Right after a quoted string's closing quote.
    AfterQuoted,
}

/// `tchar` of RFC 9110 section 5.6.2: the bytes of a token.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Whitespace where RFC 9110 allows BWS/OWS: space or horizontal tab.
fn is_ws(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// `obs-text` (RFC 9110 section 5.5): bytes 0x80-0xFF, allowed in quoted strings and field
/// values for compatibility.
fn is_obs_text(b: u8) -> bool {
    b >= 0x80
}

/// Incremental decoder of a `Transfer-Encoding: chunked` body. It consumes control bytes from
/// the front of the buffer it is given and hands data out without copying (`split_to`).
#[derive(Debug, Clone)]
pub struct ChunkedDecoder {
    state: ChunkState,
    line_bytes: usize,
    trailer_bytes: usize,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        ChunkedDecoder {
            state: ChunkState::Size {
                value: 0,
                digits: 0,
            },
            line_bytes: 0,
            trailer_bytes: 0,
        }
    }
}

impl ChunkedDecoder {
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Decodes from the front of `buf`: data as soon as any is there, the end once the last
    /// chunk and trailers are consumed, or `NeedMore`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Chunk, FramingError> {
        loop {
            match self.state {
                ChunkState::Done => return Ok(Chunk::End),
                ChunkState::Data { remaining } => {
                    if buf.is_empty() {
                        return Ok(Chunk::NeedMore);
                    }
                    let take = remaining.min(buf.len() as u64) as usize;
                    let left = remaining - take as u64;
                    self.state = if left == 0 {
                        ChunkState::DataCr
                    } else {
                        ChunkState::Data { remaining: left }
                    };
                    return Ok(Chunk::Data(buf.split_to(take).freeze()));
                }
                _ => {
                    let Some(&byte) = buf.first() else {
                        return Ok(Chunk::NeedMore);
                    };
                    let _ = buf.split_to(1);
                    self.state = self.step(byte)?;
                }
            }
        }
    }

    /// The state after one control byte.
    fn step(&mut self, byte: u8) -> Result<ChunkState, FramingError> {
        use ChunkState::*;
        let bad = |why| Err(FramingError::BadChunk(why));
        match self.state {
            Size { value, digits } => {
                if byte != b'\r' {
                    self.count_line_byte()?;
                }
                if let Some(d) = (byte as char).to_digit(16) {
                    // 15 hex digits (2^60 bytes) is far beyond any body; more is an attack or
                    // garbage, and it keeps the arithmetic from overflowing.
                    if digits >= 15 {
                        return bad("chunk size too large");
                    }
                    Ok(Size {
                        value: value * 16 + u64::from(d),
                        digits: digits + 1,
                    })
                } else if digits == 0 {
                    bad("missing chunk size")
                } else if byte == b';' {
                    Ok(Extension {
                        value,
                        at: ExtAt::BeforeName,
                    })
                } else if is_ws(byte) {
                    Ok(Extension {
                        value,
                        at: ExtAt::BeforeSemi,
                    })
                } else if byte == b'\r' {
                    Ok(SizeLf { value })
                } else {
                    bad("invalid byte in chunk size")
                }
            }
            Extension { value, at } => {
                if byte != b'\r' {
                    self.count_line_byte()?;
                }
                if byte == b'\n' {
                    // Strict on purpose: RFC 9112 section 7.1 ends every chunk line with CRLF,
                    // and no engine needs leniency here. SGLang and vLLM serve through uvicorn,
                    // whose two HTTP implementations (httptools and h11, checked in uvicorn
                    // 0.54 / h11 0.16) write `%x\r\n` size lines without extensions and CRLF
                    // after data and trailers; the simulated engine (hyper) does the same.
                    return bad("bare LF in chunk extension");
                }
                Self::extension_step(value, at, byte)
            }
            SizeLf { value } => {
                if byte != b'\n' {
                    return bad("chunk size line not ended by CRLF");
                }
                self.line_bytes = 0;
                Ok(if value == 0 {
                    TrailerLineStart
                } else {
                    Data { remaining: value }
                })
            }
            DataCr if byte == b'\r' => Ok(DataLf),
            DataLf if byte == b'\n' => Ok(Size {
                value: 0,
                digits: 0,
            }),
            DataCr | DataLf => bad("chunk data not ended by CRLF"),
            TrailerLineStart if byte == b'\r' => Ok(FinalLf),
            TrailerLineStart | TrailerName | TrailerValue => {
                // Field bytes count against the limit; the line ends (CRLF) do not.
                if byte != b'\r' {
                    self.trailer_bytes += 1;
                }
                if self.trailer_bytes > CHUNK_TRAILERS_MAX_BYTES {
                    return bad("trailers too long");
                }
                Self::trailer_step(self.state, byte)
            }
            TrailerLf if byte == b'\n' => Ok(TrailerLineStart),
            FinalLf if byte == b'\n' => Ok(Done),
            TrailerLf | FinalLf => bad("trailer line not ended by CRLF"),
            // `decode` handles these two without calling `step`.
            Data { .. } | Done => Ok(self.state),
        }
    }

    /// One byte of a chunk-size line's extensions (see [`ExtAt`] for the grammar). A CR ends
    /// the line wherever the grammar may end: after a name, a token value or a quoted string.
    fn extension_step(value: u64, at: ExtAt, byte: u8) -> Result<ChunkState, FramingError> {
        use ExtAt::*;
        let next = |at| Ok(ChunkState::Extension { value, at });
        let end = || Ok(ChunkState::SizeLf { value });
        let bad = |why| Err(FramingError::BadChunk(why));
        match (at, byte) {
            (BeforeSemi | Name | AfterName | Token | AfterQuoted, b';') => next(BeforeName),
            (BeforeSemi | AfterName, b'\r') => {
                bad("whitespace before the end of a chunk size line")
            }
            (BeforeSemi, b) if is_ws(b) => next(BeforeSemi),
            (BeforeSemi, _) => bad("chunk extension not started by ';'"),
            (BeforeName, b) if is_ws(b) => next(BeforeName),
            (BeforeName | Name, b) if is_tchar(b) => next(Name),
            (BeforeName, _) => bad("chunk extension without a name"),
            (Name | Token | AfterQuoted, b'\r') => end(),
            (Name | AfterName, b'=') => next(BeforeValue),
            (Name | AfterName, b) if is_ws(b) => next(AfterName),
            (Name | AfterName, _) => bad("invalid byte in chunk extension name"),
            (BeforeValue, b) if is_ws(b) => next(BeforeValue),
            (BeforeValue | Token, b) if is_tchar(b) => next(Token),
            (BeforeValue, b'"') => next(Quoted),
            (BeforeValue, _) => bad("chunk extension without a value"),
            (Token | AfterQuoted, b) if is_ws(b) => next(BeforeSemi),
            (Token, _) => bad("invalid byte in chunk extension value"),
            (AfterQuoted, _) => bad("invalid byte after a quoted chunk extension value"),
            (Quoted, b'"') => next(AfterQuoted),
            (Quoted, b'\\') => next(QuotedPair),
            // qdtext: HTAB, SP, %x21, %x23-5B, %x5D-7E, obs-text.
            (Quoted, b) if is_ws(b) || (0x21..=0x7e).contains(&b) || is_obs_text(b) => next(Quoted),
            // quoted-pair: "\" ( HTAB / SP / VCHAR / obs-text ).
            (QuotedPair, b) if is_ws(b) || (0x21..=0x7e).contains(&b) || is_obs_text(b) => {
                next(Quoted)
            }
            (Quoted | QuotedPair, _) => bad("invalid byte in a quoted chunk extension value"),
        }
    }

    /// One byte of a trailer field line, `field-name ":" OWS field-value OWS` (RFC 9112
    /// section 5): a non-empty token, a colon, then visible bytes, whitespace and obs-text up to
    /// the CRLF. A bare LF or any other control byte in the line is refused, and so is a line
    /// starting with whitespace (obsolete line folding).
    fn trailer_step(state: ChunkState, byte: u8) -> Result<ChunkState, FramingError> {
        use ChunkState::*;
        let bad = |why| Err(FramingError::BadChunk(why));
        match (state, byte) {
            (TrailerLineStart | TrailerName, b) if is_tchar(b) => Ok(TrailerName),
            (TrailerName, b':') => Ok(TrailerValue),
            (TrailerValue, b'\r') => Ok(TrailerLf),
            // Strict on purpose, as for chunk lines (see the size-line LF above).
            (TrailerLineStart | TrailerName | TrailerValue, b'\n') => {
                bad("bare LF in a trailer line")
            }
            (TrailerValue, b) if is_ws(b) || (0x21..=0x7e).contains(&b) || is_obs_text(b) => {
                Ok(TrailerValue)
            }
            (TrailerValue, _) => bad("invalid byte in a trailer field value"),
            _ => bad("invalid trailer field name"),
        }
    }

    fn count_line_byte(&mut self) -> Result<(), FramingError> {
        self.line_bytes += 1;
        if self.line_bytes > CHUNK_LINE_MAX_BYTES {
            return Err(FramingError::BadChunk("chunk size line too long"));
        }
        Ok(())
    }
}

/// Appends one chunk of a chunked body (`data` must not be empty: an empty chunk ends a body).
pub fn encode_chunk(out: &mut Vec<u8>, data: &[u8]) {
    debug_assert!(!data.is_empty());
    write_digits(out, data.len() as u64, 16);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The last chunk of a chunked body, without trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Appends `n` in base `radix` (10 or 16, lower-case digits).
fn write_digits(out: &mut Vec<u8>, n: u64, radix: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b"0123456789abcdef"[(n % radix) as usize];
        n /= radix;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// How the body of a response written to a client is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutFraming {
    Length(u64),
    Chunked,
    /// A status that never has a body (204, 304): no framing header at all (RFC 9110 8.6
    /// forbids `Content-Length` on a 204).
    NoBody,
}

impl OutFraming {
    /// The framing of a client response with `status` whose engine body has `exact_length`.
    pub fn for_status(status: u16, exact_length: Option<u64>) -> OutFraming {
        if status == 204 || status == 304 || (100..200).contains(&status) {
            OutFraming::NoBody
        } else {
            match exact_length {
                Some(n) => OutFraming::Length(n),
                None => OutFraming::Chunked,
            }
        }
    }
}

/// A response head for a client. Header values must already be valid (`content_type` came
/// from an engine's parsed head, the request id through [`usable_request_id`] or generated,
/// the decision from the router's own formatting, checked by the caller).
pub struct ResponseHeadOut<'a> {
    pub status: u16,
    /// The `Date` value ([`http_date_now`]): RFC 9110 section 6.6.1 asks a server with a clock,
    /// and a proxy forwarding a response without one, to send it.
    pub date: &'a [u8],
    pub content_type: Option<&'a [u8]>,
    pub request_id: &'a str,
    pub decision: Option<&'a [u8]>,
    pub framing: OutFraming,
    pub close: bool,
}

/// Length of an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
pub const HTTP_DATE_BYTES: usize = 29;

/// The current time as an IMF-fixdate, formatted at most once per second per thread (a response
/// head costs a clock read and a copy, like hyper's own date cache).
pub fn http_date_now() -> [u8; HTTP_DATE_BYTES] {
    use std::cell::Cell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static CACHED: Cell<(u64, [u8; HTTP_DATE_BYTES])> = const { Cell::new((u64::MAX, [0; HTTP_DATE_BYTES])) };
    }
    let now = SystemTime::now();
    let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|cached| {
        let (at, date) = cached.get();
        if at == second {
            return date;
        }
        let mut fresh = [0u8; HTTP_DATE_BYTES];
        let text = httpdate::fmt_http_date(now);
        let n = text.len().min(HTTP_DATE_BYTES);
        fresh[..n].copy_from_slice(&text.as_bytes()[..n]);
        cached.set((second, fresh));
        fresh
    })
}

/// Appends a client response head.
pub fn encode_response_head(out: &mut Vec<u8>, head: &ResponseHeadOut<'_>) {
    out.extend_from_slice(b"HTTP/1.1 ");
    write_digits(out, u64::from(head.status), 10);
    out.push(b' ');
    let reason = http::StatusCode::from_u16(head.status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Unknown");
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(b"\r\n");
    if !head.date.is_empty() {
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(head.date);
        out.extend_from_slice(b"\r\n");
    }
    if let Some(ct) = head.content_type {
        out.extend_from_slice(b"content-type: ");
        out.extend_from_slice(ct);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"x-request-id: ");
    out.extend_from_slice(head.request_id.as_bytes());
    out.extend_from_slice(b"\r\n");
    if let Some(d) = head.decision {
        out.extend_from_slice(b"x-kvroute-decision: ");
        out.extend_from_slice(d);
        out.extend_from_slice(b"\r\n");
    }
    match head.framing {
        OutFraming::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            write_digits(out, n, 10);
            out.extend_from_slice(b"\r\n");
        }
        OutFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        OutFraming::NoBody => {}
    }
    if head.close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends a request head to an engine: `POST target`, JSON body of `content_length` bytes,
/// plus `extra` headers (names and values already valid).
pub fn encode_request_head(
    out: &mut Vec<u8>,
    target: &str,
    authority: &str,
    content_length: usize,
    extra: &[(&str, &str)],
) {
    out.extend_from_slice(b"POST ");
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(authority.as_bytes());
    out.extend_from_slice(b"\r\ncontent-type: application/json\r\ncontent-length: ");
    write_digits(out, content_length as u64, 10);
    out.extend_from_slice(b"\r\n");
    for (name, value) in extra {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
#[path = "framing_tests.rs"]
mod tests;
