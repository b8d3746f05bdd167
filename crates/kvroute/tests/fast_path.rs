//! The hand-written HTTP/1.1 data path (`fast_path`, `h1`, `upstream`) checked at the byte
//! level over real sockets.
//!
//! Why raw sockets: a client library hides exactly what is under test here (pipelining, the
//! hand-off of a connection to hyper mid-life, where a connection closes, how a body is framed),
//! so clients write and read bytes themselves and decode the answer with a small, independent
//! reader below (not the router's own `h1` code, which would check itself).
//!
//! Engines: the simulated engine (`kvroute_sim`) is the fleet wherever a well-behaved engine is
//! enough. Where an engine must misbehave at the byte level (answer chunked with extensions and
//! trailers, frame a body by closing, close an idle kept-alive connection, cut a body, or show
//! the exact request head it received), a tiny raw TCP stand-in ([`StandIn`]) plays the engine:
//! the simulated engine is an axum server whose framing and connection handling are hyper's, so
//! it can do none of these.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use kvroute::RouterConfig;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest wait for any one read from the router before the test fails.
const IO_DEADLINE: Duration = Duration::from_secs(10);
/// Pause between the pieces a stand-in engine writes, so they reach the router as separate
/// reads (the property under test is reassembly across reads). Pacing, not a wait for state.
const PIECE_PAUSE: Duration = Duration::from_millis(10);
/// How long a stand-in engine keeps an idle kept-alive connection before closing it (an
/// engine's keep-alive timeout, much shortened).
const ENGINE_IDLE_CLOSE: Duration = Duration::from_millis(100);
/// A token-id completion body: the router forwards such a body byte for byte to a non-DP engine.
const TOKEN_BODY: &[u8] = br#"{"model":"m","prompt":[1,2,3],"max_tokens":1}"#;
/// A request only the general server (hyper) answers: the fast path hands the connection over.
const HEALTH_GET: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: router\r\n\r\n";

// ---------------------------------------------------------------------------------------------
// Raw client side.

/// A parsed response head.
struct Head {
    status: u16,
    /// Names lowercased, in order.
    headers: Vec<(String, String)>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn header_count(&self, name: &str) -> usize {
        self.headers.iter().filter(|(n, _)| n == name).count()
    }

    fn is_chunked(&self) -> bool {
        self.header("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
    }

    fn says_close(&self) -> bool {
        self.header("connection")
            .is_some_and(|v| v.to_ascii_lowercase().contains("close"))
    }

    fn request_id(&self) -> &str {
        self.header("x-request-id")
            .unwrap_or_else(|| panic!("no x-request-id on the response: {:?}", self.headers))
    }
}

struct Response {
    head: Head,
    body: Vec<u8>,
}

impl Response {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// One client connection to the router, read through a buffer so pipelined answers that arrive
/// together are split correctly.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Conn {
        let stream = TcpStream::connect(addr)
            .await
            .expect("connect to the router");
        Conn {
            stream,
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write to router");
    }

    /// Reads more bytes into the buffer; 0 at EOF. Fails the test after [`IO_DEADLINE`].
    async fn fill(&mut self, what: &str) -> usize {
        let mut chunk = [0u8; 16 * 1024];
        match tokio::time::timeout(IO_DEADLINE, self.stream.read(&mut chunk)).await {
            Err(_) => panic!(
                "nothing from the router within {IO_DEADLINE:?} while waiting for {what}; \
                 buffered: {:?}",
                String::from_utf8_lossy(&self.buf)
            ),
            Ok(Err(e)) => panic!("reading from the router failed while waiting for {what}: {e}"),
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                n
            }
        }
    }

    async fn read_head(&mut self) -> Head {
        loop {
            let parsed = {
                let mut headers = [httparse::EMPTY_HEADER; 64];
                let mut resp = httparse::Response::new(&mut headers);
                match resp.parse(&self.buf) {
                    Ok(httparse::Status::Complete(len)) => Some((
                        len,
                        Head {
                            status: resp.code.unwrap_or(0),
                            headers: resp
                                .headers
                                .iter()
                                .map(|h| {
                                    (
                                        h.name.to_ascii_lowercase(),
                                        String::from_utf8_lossy(h.value).into_owned(),
                                    )
                                })
                                .collect(),
                        },
                    )),
                    Ok(httparse::Status::Partial) => None,
                    Err(e) => panic!(
                        "malformed response head from the router ({e}): {:?}",
                        String::from_utf8_lossy(&self.buf)
                    ),
                }
            };
            if let Some((len, head)) = parsed {
                self.buf.drain(..len);
                return head;
            }
            if self.fill("a response head").await == 0 {
                panic!(
                    "the router closed the connection before a complete response head; got {:?}",
                    String::from_utf8_lossy(&self.buf)
                );
            }
        }
    }

    async fn read_line(&mut self, what: &str) -> Vec<u8> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = self.buf[..i].to_vec();
                self.buf.drain(..i + 2);
                return line;
            }
            if self.fill(what).await == 0 {
                panic!(
                    "connection closed inside {what}; got {:?}",
                    String::from_utf8_lossy(&self.buf)
                );
            }
        }
    }

    async fn read_n(&mut self, n: usize, what: &str) -> Vec<u8> {
        while self.buf.len() < n {
            if self.fill(what).await == 0 {
                panic!(
                    "connection closed inside {what}: {} of {n} bytes: {:?}",
                    self.buf.len(),
                    String::from_utf8_lossy(&self.buf)
                );
            }
        }
        self.buf.drain(..n).collect()
    }

    /// Decodes a chunked body strictly (hex size, optional extension, CRLF after data, trailers).
    async fn read_chunked_body(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line = self.read_line("a chunk-size line").await;
            let size_text = line.split(|&b| b == b';').next().unwrap_or_default();
            let size_text = String::from_utf8_lossy(size_text).trim().to_string();
            let size = usize::from_str_radix(&size_text, 16).unwrap_or_else(|e| {
                panic!(
                    "bad chunk-size line {:?}: {e}",
                    String::from_utf8_lossy(&line)
                )
            });
            if size == 0 {
                while !self.read_line("the trailer section").await.is_empty() {}
                return body;
            }
            body.extend(self.read_n(size, "chunk data").await);
            let end = self.read_n(2, "the CRLF after chunk data").await;
            assert_eq!(end, b"\r\n", "chunk data must end with CRLF");
        }
    }

    /// Everything until the router closes the connection.
    async fn read_to_eof(&mut self, what: &str) -> Vec<u8> {
        while self.fill(what).await > 0 {}
        std::mem::take(&mut self.buf)
    }

    async fn read_body(&mut self, head: &Head) -> Vec<u8> {
        if (100..200).contains(&head.status) || head.status == 204 || head.status == 304 {
            return Vec::new();
        }
        if head.is_chunked() {
            return self.read_chunked_body().await;
        }
        match head.header("content-length") {
            Some(n) => {
                let n: usize = n.trim().parse().expect("numeric content-length");
                self.read_n(n, "a length-framed body").await
            }
            None => self.read_to_eof("a body framed by close").await,
        }
    }

    async fn read_response(&mut self) -> Response {
        let head = self.read_head().await;
        let body = self.read_body(&head).await;
        Response { head, body }
    }

    /// Sends `request` and reads the whole answer to it.
    async fn ask(&mut self, request: &[u8]) -> Response {
        self.send(request).await;
        self.read_response().await
    }

    /// Sends `request` and reads only the head of the answer.
    async fn ask_head(&mut self, request: &[u8]) -> Head {
        self.send(request).await;
        self.read_head().await
    }

    /// The router must close the connection now, with nothing more sent.
    async fn expect_closed(&mut self, after: &str) {
        assert!(
            self.buf.is_empty(),
            "unexpected bytes after {after}: {:?}",
            String::from_utf8_lossy(&self.buf)
        );
        let n = self.fill(&format!("EOF after {after}")).await;
        assert_eq!(
            n,
            0,
            "expected the router to close the connection after {after}, got {:?}",
            String::from_utf8_lossy(&self.buf)
        );
    }
}

/// Checks that `resp` is the 200 answer to the request whose id is `id`, computed from a prompt
/// of `prompt_tokens` tokens (the simulated engine reports the count it saw); `why` says what a
/// mismatch would mean.
fn assert_completion(resp: &Response, id: &str, prompt_tokens: usize, why: &str) {
    assert_eq!(resp.head.status, 200, "{id}: {}", resp.json());
    assert_eq!(resp.head.request_id(), id, "{why}");
    assert_eq!(
        resp.json()["usage"]["prompt_tokens"],
        prompt_tokens,
        "{id}: {why}: {}",
        resp.json()
    );
}

/// A `POST` with a `Content-Length` body and `extra` headers.
fn post(path: &str, extra: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n",
        body.len()
    );
    for (name, value) in extra {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

/// A completion `POST` (length-framed, so the fast path takes it) carrying `id` as its
/// `x-request-id`.
fn completion_post(id: &str, body: &[u8]) -> Vec<u8> {
    post("/v1/completions", &[("x-request-id", id)], body)
}

/// A token-id completion with no extra headers, length-framed so the fast path takes it.
fn token_completion() -> Vec<u8> {
    post("/v1/completions", &[], TOKEN_BODY)
}

/// A `POST` whose body is one chunk: the fast path does not take it, so the general server
/// (hyper) answers; used to compare the two servers on the same engine answer.
fn chunked_post(path: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out.extend_from_slice(b"\r\n0\r\n\r\n");
    out
}

/// The same token-id completion for each of the router's two HTTP/1.1 servers, with the
/// server's name: chunked, so the general server (hyper) takes it, and length-framed, so the
/// fast path does.
fn token_completion_on_both_servers() -> [(&'static str, Vec<u8>); 2] {
    [
        (
            "general server",
            chunked_post("/v1/completions", TOKEN_BODY),
        ),
        ("fast path", token_completion()),
    ]
}

fn completion_body(prompt: &[u32]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1}))
        .expect("encode")
}

// ---------------------------------------------------------------------------------------------
// Raw engine stand-in.

/// What the stand-in does once it has read a POST.
#[derive(Clone)]
struct Answer {
    /// When set, nothing is written until a permit is available (the test decides when the
    /// engine answers).
    gate: Option<Arc<tokio::sync::Semaphore>>,
    /// Written in order, [`PIECE_PAUSE`] apart.
    pieces: Vec<Vec<u8>>,
    then: AfterAnswer,
}

impl Answer {
    /// `pieces` written as soon as the request is read, then `then`.
    fn new(pieces: Vec<Vec<u8>>, then: AfterAnswer) -> Answer {
        Answer {
            gate: None,
            pieces,
            then,
        }
    }
}

#[derive(Clone, Copy)]
enum AfterAnswer {
    /// Wait for the next request on the same connection.
    KeepAlive,
    Close,
    /// Keep the connection open but idle this long, then close it (unless the router sends or
    /// closes first).
    CloseWhenIdleFor(Duration),
    /// Keep the connection open but idle this long, then write bytes nobody asked for and keep
    /// it open (a protocol violation the router must not mistake for the next answer).
    StrayBytesWhenIdleFor(Duration),
    /// Wait for the next request's bytes WITHOUT reading them, then close with them unread and
    /// a zero linger: the router sees a reset, as from an engine whose socket closed under a
    /// request it never read.
    ResetWhenNextRequestArrives,
}

#[derive(Debug, Clone)]
struct SeenRequest {
    /// Which accepted connection (0, 1, ...) carried it.
    conn: usize,
    method: String,
    path: String,
    /// Names lowercased, in order.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl SeenRequest {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn header_count(&self, name: &str) -> usize {
        self.headers.iter().filter(|(n, _)| n == name).count()
    }
}

#[derive(Debug, Clone)]
enum EngineEvent {
    Request(SeenRequest),
    /// The stand-in closed a kept-alive connection the router had left idle.
    ClosedIdle {
        conn: usize,
    },
    /// The stand-in reset a connection with a request unread in it.
    ResetUnread {
        conn: usize,
    },
    /// The stand-in wrote unrequested bytes on a kept-alive connection the router left idle.
    SentStray {
        conn: usize,
    },
    /// The router closed (or reset) the connection.
    RouterClosed {
        conn: usize,
    },
    /// The router sent bytes that are not an HTTP/1.1 request.
    Malformed {
        conn: usize,
        why: String,
    },
}

type AnswerFn = dyn Fn(usize) -> Answer + Send + Sync;

/// A raw TCP engine: `GET`s (the router's discovery: `/server_info`, `/v1/models`) get a 404,
/// so a worker registered as `url@m` is taken with no KV events and routed on load; the n-th
/// `POST` (from 0) gets `answer(n)`. Everything it sees is logged as [`EngineEvent`]s.
struct StandIn {
    url: String,
    authority: String,
    events: Arc<Mutex<Vec<EngineEvent>>>,
    task: tokio::task::JoinHandle<()>,
}

impl StandIn {
    async fn start(answer: impl Fn(usize) -> Answer + Send + Sync + 'static) -> StandIn {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let authority = listener.local_addr().expect("addr").to_string();
        let events = Arc::new(Mutex::new(Vec::new()));
        let answer: Arc<AnswerFn> = Arc::new(answer);
        let posts = Arc::new(AtomicUsize::new(0));
        let log = events.clone();
        let task = tokio::spawn(async move {
            // Connection tasks live in the set, so aborting this task ends them too.
            let mut connections = tokio::task::JoinSet::new();
            for conn in 0.. {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                connections.spawn(serve_engine_connection(
                    conn,
                    stream,
                    answer.clone(),
                    posts.clone(),
                    log.clone(),
                ));
            }
        });
        StandIn {
            url: format!("http://{authority}"),
            authority,
            events,
            task,
        }
    }

    /// The worker spec with a fixed model, so the router needs nothing from `/server_info`.
    fn worker(&self) -> String {
        format!("{}@m", self.url)
    }

    fn events(&self) -> Vec<EngineEvent> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The POSTs seen, with `conn` renumbered 0, 1, ... by first use for a POST, so the
    /// connections of the router's discovery GETs do not count.
    /// Fails the test if the router ever sent the engine bytes that are not HTTP/1.1.
    fn posts(&self) -> Vec<SeenRequest> {
        let events = self.events();
        for e in &events {
            if let EngineEvent::Malformed { conn, why } = e {
                panic!("the router sent a malformed request on engine connection {conn}: {why}");
            }
        }
        let mut order: Vec<usize> = Vec::new();
        events
            .into_iter()
            .filter_map(|e| match e {
                EngineEvent::Request(mut r) if r.method == "POST" => {
                    r.conn = match order.iter().position(|&c| c == r.conn) {
                        Some(i) => i,
                        None => {
                            order.push(r.conn);
                            order.len() - 1
                        }
                    };
                    Some(r)
                }
                _ => None,
            })
            .collect()
    }

    /// Waits (up to [`WAIT_DEADLINE`]) until exactly `count` POSTs have reached the engine.
    async fn wait_for_posts(&self, count: usize, what: &str) {
        wait_until(what, WAIT_DEADLINE, || {
            let posts = self.posts().len();
            async move {
                if posts == count {
                    Ok(())
                } else {
                    Err(format!("{posts} requests at the engine"))
                }
            }
        })
        .await;
    }

    /// Which engine connection (as in [`StandIn::posts`]) carried each POST, and its
    /// `x-request-id`.
    fn post_connections_and_ids(&self) -> Vec<(usize, Option<String>)> {
        self.posts()
            .iter()
            .map(|p| (p.conn, p.header("x-request-id").map(str::to_string)))
            .collect()
    }

    /// The accepted-connection number that carried the first POST.
    fn first_post_connection(&self) -> Option<usize> {
        self.events().into_iter().find_map(|e| match e {
            EngineEvent::Request(r) if r.method == "POST" => Some(r.conn),
            _ => None,
        })
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A parsed request head: method, path, headers, head length.
type RequestHeadParts = (String, String, Vec<(String, String)>, usize);

fn parse_request_head(buf: &[u8]) -> Result<Option<RequestHeadParts>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => Ok(Some((
            req.method.unwrap_or_default().to_string(),
            req.path.unwrap_or_default().to_string(),
            req.headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_ascii_lowercase(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect(),
            len,
        ))),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

async fn serve_engine_connection(
    conn: usize,
    mut stream: TcpStream,
    answer: Arc<AnswerFn>,
    posts: Arc<AtomicUsize>,
    events: Arc<Mutex<Vec<EngineEvent>>>,
) {
    let log = |e: EngineEvent| events.lock().unwrap_or_else(|e| e.into_inner()).push(e);
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let (method, path, headers, head_len) = loop {
            match parse_request_head(&buf) {
                Ok(Some(parts)) => break parts,
                Ok(None) => {}
                Err(why) => return log(EngineEvent::Malformed { conn, why }),
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return log(EngineEvent::RouterClosed { conn }),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let length = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .map(|(_, v)| v.trim().parse::<usize>());
        let length = match length {
            None => 0,
            Some(Ok(n)) => n,
            Some(Err(e)) => {
                let why = format!("bad content-length: {e}");
                return log(EngineEvent::Malformed { conn, why });
            }
        };
        while buf.len() < head_len + length {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return log(EngineEvent::RouterClosed { conn }),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = buf[head_len..head_len + length].to_vec();
        buf.drain(..head_len + length);
        let is_post = method == "POST";
        log(EngineEvent::Request(SeenRequest {
            conn,
            method,
            path,
            headers,
            body,
        }));
        if !is_post {
            let _ = stream
                .write_all(
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                )
                .await;
            return;
        }
        let answer = answer(posts.fetch_add(1, Ordering::SeqCst));
        if let Some(gate) = &answer.gate {
            match gate.acquire().await {
                Ok(permit) => permit.forget(),
                Err(_) => return,
            }
        }
        for (i, piece) in answer.pieces.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(PIECE_PAUSE).await;
            }
            if stream.write_all(piece).await.is_err() {
                return log(EngineEvent::RouterClosed { conn });
            }
        }
        match answer.then {
            AfterAnswer::KeepAlive => {}
            AfterAnswer::Close => return,
            AfterAnswer::CloseWhenIdleFor(idle) => {
                let mut probe = [0u8; 1];
                let read = tokio::select! {
                    read = stream.read(&mut probe) => Some(read),
                    _ = tokio::time::sleep(idle) => None,
                };
                match read {
                    Some(Ok(0)) | Some(Err(_)) => return log(EngineEvent::RouterClosed { conn }),
                    Some(Ok(_)) => buf.push(probe[0]),
                    None => {
                        // Logged only once the socket is closed, so a test that sees the event
                        // knows the FIN is on its way to the router.
                        drop(stream);
                        return log(EngineEvent::ClosedIdle { conn });
                    }
                }
            }
            AfterAnswer::ResetWhenNextRequestArrives => {
                let _ = stream.readable().await;
                let _ = stream.set_zero_linger();
                drop(stream);
                return log(EngineEvent::ResetUnread { conn });
            }
            AfterAnswer::StrayBytesWhenIdleFor(idle) => {
                let mut probe = [0u8; 1];
                let read = tokio::select! {
                    read = stream.read(&mut probe) => Some(read),
                    _ = tokio::time::sleep(idle) => None,
                };
                match read {
                    Some(Ok(0)) | Some(Err(_)) => return log(EngineEvent::RouterClosed { conn }),
                    Some(Ok(_)) => buf.push(probe[0]),
                    None => {
                        if stream.write_all(b"stray").await.is_err() {
                            return log(EngineEvent::RouterClosed { conn });
                        }
                        // Logged after the write, so a test that sees the event knows the bytes
                        // are in the router's receive buffer; then wait for the router to drop
                        // the connection (anything it sends instead is logged as a request).
                        log(EngineEvent::SentStray { conn });
                    }
                }
            }
        }
    }
}

/// A complete length-framed JSON answer.
fn json_answer(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// One data-plane thread: every client connection, and so every engine connection the router
/// pools, lives on the same thread and pool.
fn stand_in_router_config(engine: &StandIn) -> RouterConfig {
    RouterConfig {
        data_plane_threads: 1,
        ..router_config(&[engine.worker()])
    }
}

// ---------------------------------------------------------------------------------------------
// Set-ups shared by the tests, so each test states only what it checks.

/// One simulated engine (model `m`) and a router on it: the fleet wherever a well-behaved
/// engine is enough.
async fn sim_engine_and_router() -> (kvroute_sim::Fleet, kvroute::RouterHandle) {
    let fleet = fleet(1, 1, "m").await;
    let router = kvroute::serve(router_config(&urls(&fleet))).await.unwrap();
    (fleet, router)
}

/// Ends a test on [`sim_engine_and_router`]: the client goes first, so the router's shutdown
/// waits for no open connection.
async fn shut_down(client: Conn, router: kvroute::RouterHandle, fleet: kvroute_sim::Fleet) {
    drop(client);
    router.shutdown().await;
    fleet.shutdown().await;
}

/// A stand-in engine answering the n-th POST with `answer(n)`, and a router on it alone. Keep the
/// engine bound to the end of the test (`_engine` at the least): dropping it stops it.
async fn stand_in_and_router(
    answer: impl Fn(usize) -> Answer + Send + Sync + 'static,
) -> (StandIn, kvroute::RouterHandle) {
    let engine = StandIn::start(answer).await;
    let router = kvroute::serve(stand_in_router_config(&engine))
        .await
        .unwrap();
    (engine, router)
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pipelined_requests_on_one_connection_get_two_answers_in_order() {
    let (fleet, router) = sim_engine_and_router().await;
    let mut client = Conn::open(router.addr).await;
    // Different prompt lengths, so each answer shows which request it belongs to.
    let mut both = completion_post("pipelined-first", &completion_body(&[1, 2, 3]));
    both.extend(completion_post(
        "pipelined-second",
        &completion_body(&[4, 5, 6, 7, 8]),
    ));
    client.send(&both).await;
    for (id, prompt_tokens) in [("pipelined-first", 3), ("pipelined-second", 5)] {
        let resp = client.read_response().await;
        assert_completion(
            &resp,
            id,
            prompt_tokens,
            "answers must come in order, each with its own request's result",
        );
    }
    shut_down(client, router, fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_pipelined_while_the_previous_one_waits_for_the_engine_is_answered_next() {
    // The engine holds its first answer until the test lets it go, so the second request is
    // sent while the router waits for the engine with the client socket watched.
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = release.clone();
    let (engine, router) = stand_in_and_router(move |n| Answer {
        gate: (n == 0).then(|| gate.clone()),
        pieces: vec![json_answer(&format!(r#"{{"answer":{n}}}"#))],
        then: AfterAnswer::KeepAlive,
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    client.send(&completion_post("held", TOKEN_BODY)).await;
    engine
        .wait_for_posts(1, "the first request to reach the engine")
        .await;
    client
        .send(&completion_post("pipelined-behind", TOKEN_BODY))
        .await;
    release.add_permits(1);
    for (id, answer) in [("held", 0), ("pipelined-behind", 1)] {
        let resp = client.read_response().await;
        assert_eq!(resp.head.status, 200, "{id}");
        assert_eq!(resp.head.request_id(), id, "answers in request order");
        assert_eq!(resp.json()["answer"], answer, "{id}");
    }
    let ids: Vec<Option<String>> = engine
        .posts()
        .iter()
        .map(|p| p.header("x-request-id").map(str::to_string))
        .collect();
    assert_eq!(
        ids,
        vec![
            Some("held".to_string()),
            Some("pipelined-behind".to_string())
        ],
        "each request reached the engine once, in order"
    );
    drop(client);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_switches_to_the_general_server_after_a_request_the_fast_path_does_not_take() {
    let (fleet, router) = sim_engine_and_router().await;
    let mut client = Conn::open(router.addr).await;

    let first = client
        .ask(&completion_post(
            "before-switch",
            &completion_body(&[1, 2, 3]),
        ))
        .await;
    assert_eq!(first.head.status, 200, "{}", first.json());
    assert_eq!(first.head.request_id(), "before-switch");
    assert!(!first.head.says_close(), "{:?}", first.head.headers);

    let health = client.ask(HEALTH_GET).await;
    assert_eq!(health.head.status, 200);
    assert_eq!(health.body, b"ok", "the general server's /healthz answer");

    let third = client
        .ask(&completion_post(
            "after-switch",
            &completion_body(&[4, 5, 6, 7]),
        ))
        .await;
    assert_completion(
        &third,
        "after-switch",
        4,
        "a fast-path request after the switch is still answered",
    );
    shut_down(client, router, fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_request_body_is_served_through_the_general_server() {
    let (fleet, router) = sim_engine_and_router().await;
    let mut client = Conn::open(router.addr).await;
    let body = completion_body(&[9, 8, 7, 6, 5, 4]);
    let (a, b) = body.split_at(body.len() / 2);
    let mut request = b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n\
        Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\
        x-request-id: chunked-upload\r\n\r\n"
        .to_vec();
    for part in [a, b] {
        request.extend(format!("{:x}\r\n", part.len()).into_bytes());
        request.extend_from_slice(part);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    let resp = client.ask(&request).await;
    assert_completion(
        &resp,
        "chunked-upload",
        6,
        "the whole chunked body reached the engine",
    );
    shut_down(client, router, fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_request_and_expect_100_continue_are_answered() {
    let (fleet, router) = sim_engine_and_router().await;

    // HTTP/1.0: answered without chunked framing (a 1.0 client cannot decode it), then closed
    // (no keep-alive was asked for).
    let mut client = Conn::open(router.addr).await;
    let body = completion_body(&[1, 2, 3]);
    let mut request = format!(
        "POST /v1/completions HTTP/1.0\r\nHost: router\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nx-request-id: old-client\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let head = client.ask_head(&request).await;
    assert_eq!(head.status, 200, "{:?}", head.headers);
    assert!(
        !head.is_chunked(),
        "an HTTP/1.0 client got a chunked answer: {:?}",
        head.headers
    );
    assert_eq!(head.request_id(), "old-client");
    let body_bytes = client.read_body(&head).await;
    let answer: Value = serde_json::from_slice(&body_bytes).expect("JSON answer");
    assert_eq!(answer["usage"]["prompt_tokens"], 3, "{answer}");
    client.expect_closed("an HTTP/1.0 answer").await;

    // Expect: 100-continue: the interim answer comes before the body is sent.
    let mut client = Conn::open(router.addr).await;
    let head_only = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nExpect: 100-continue\r\nx-request-id: expects\r\n\r\n",
        body.len()
    );
    let interim = client.ask_head(head_only.as_bytes()).await;
    assert_eq!(
        interim.status, 100,
        "the router must invite the body: {:?}",
        interim.headers
    );
    let resp = client.ask(&body).await;
    assert_completion(
        &resp,
        "expects",
        3,
        "the body sent after the 100 reached the engine",
    );
    shut_down(client, router, fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_gets_413_in_the_openai_shape_and_the_connection_closes() {
    let cfg = RouterConfig {
        max_body_bytes: 1024,
        workers: Vec::new(),
        ..router_config(&[])
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let mut client = Conn::open(router.addr).await;
    // Only the head: the router must answer without waiting for a body it will not read.
    let resp = client
        .ask(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
              Content-Length: 1000000\r\nx-request-id: too-big\r\n\r\n",
        )
        .await;
    assert_eq!(resp.head.status, 413, "{:?}", resp.head.headers);
    assert_eq!(resp.head.request_id(), "too-big");
    assert!(
        resp.head
            .header("content-type")
            .is_some_and(|ct| ct.starts_with("application/json")),
        "{:?}",
        resp.head.headers
    );
    let error = resp.json();
    assert_eq!(error["error"]["code"], "body_too_large", "{error}");
    assert!(
        error["error"]["message"].is_string() && error["error"]["type"].is_string(),
        "OpenAI error shape: {error}"
    );
    assert!(
        resp.head.says_close(),
        "the unread body means the connection cannot continue: {:?}",
        resp.head.headers
    );
    client.expect_closed("a 413").await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_close_from_the_client_closes_after_the_answer() {
    let (fleet, router) = sim_engine_and_router().await;
    let mut client = Conn::open(router.addr).await;
    let resp = client
        .ask(&post(
            "/v1/completions",
            &[("Connection", "close")],
            &completion_body(&[1, 2]),
        ))
        .await;
    assert_eq!(resp.head.status, 200, "{}", resp.json());
    assert!(resp.head.says_close(), "{:?}", resp.head.headers);
    assert_eq!(resp.json()["usage"]["prompt_tokens"], 2, "{}", resp.json());
    client
        .expect_closed("an answer to `Connection: close`")
        .await;
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_engine_answer_reaches_the_client_chunked_and_complete() {
    // Chunk boundaries fall mid-line and mid-data; one chunk has an extension; a trailer ends it.
    let (engine, router) = stand_in_and_router(|_| {
        Answer::new(
            vec![
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
              transfer-encoding: chunked\r\n\r\n"
                    .to_vec(),
                b"6;note=first\r\ndata: \r\n".to_vec(),
                b"1".to_vec(),
                b"3\r\nhello, wor".to_vec(),
                b"ld, again\r\n3\r\n!\n\n\r\n0\r\nx-engine-trailer: t\r\n".to_vec(),
                b"\r\n".to_vec(),
            ],
            AfterAnswer::KeepAlive,
        )
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    for attempt in 0..2 {
        let resp = client.ask(&token_completion()).await;
        assert_eq!(resp.head.status, 200, "attempt {attempt}");
        assert!(
            resp.head.is_chunked() && resp.head.header("content-length").is_none(),
            "attempt {attempt}: {:?}",
            resp.head.headers
        );
        assert_eq!(
            resp.head.header("content-type"),
            Some("text/event-stream"),
            "the engine's content type is passed on"
        );
        assert_eq!(
            String::from_utf8_lossy(&resp.body),
            "data: hello, world, again!\n\n",
            "attempt {attempt}: the decoded body is the engine's data"
        );
    }
    let posts = engine.posts();
    assert_eq!(posts.len(), 2, "{posts:?}");
    assert!(
        posts.iter().all(|p| p.conn == 0),
        "the engine connection is reused after a chunked body with trailers (read to its exact \
         end): {:?}",
        posts.iter().map(|p| p.conn).collect::<Vec<_>>()
    );
    drop(client);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_answer_framed_by_close_is_passed_through_whole() {
    let (engine, router) = stand_in_and_router(|_| {
        Answer::new(
            vec![
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n".to_vec(),
                br#"{"part":"one","#.to_vec(),
                br#""rest":"two"}"#.to_vec(),
            ],
            AfterAnswer::Close,
        )
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    for attempt in 0..2 {
        let resp = client.ask(&token_completion()).await;
        assert_eq!(resp.head.status, 200, "attempt {attempt}");
        assert!(
            resp.head.is_chunked(),
            "a body of unknown length reaches the client chunked, so the client connection \
             survives: {:?}",
            resp.head.headers
        );
        assert_eq!(
            String::from_utf8_lossy(&resp.body),
            r#"{"part":"one","rest":"two"}"#,
            "attempt {attempt}"
        );
    }
    let conns: Vec<usize> = engine.posts().iter().map(|p| p.conn).collect();
    assert_eq!(
        conns,
        vec![0, 1],
        "a connection framed by close is never reused"
    );
    drop(client);
    router.shutdown().await;
}

/// Runs the pooled-connection scenario both idle-engine tests share: the stand-in answers the
/// first request and then does `idle_behaviour` on that (pooled, idle) connection; once it logged
/// the event `happened` recognises on that connection, a second request on the same client
/// connection must be answered by the engine on a FRESH engine connection.
async fn second_request_after_an_idle_engine_event_goes_out_fresh(
    idle_behaviour: fn(Duration) -> AfterAnswer,
    event: &str,
    happened: fn(&EngineEvent, usize) -> bool,
) {
    let (engine, router) = stand_in_and_router(move |n| Answer {
        gate: None,
        pieces: vec![json_answer(&format!(r#"{{"answer":{n}}}"#))],
        then: if n == 0 {
            idle_behaviour(ENGINE_IDLE_CLOSE)
        } else {
            AfterAnswer::KeepAlive
        },
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    let first = client
        .ask(&completion_post("before-idle", TOKEN_BODY))
        .await;
    assert_eq!(first.head.status, 200);
    assert_eq!(first.json()["answer"], 0);
    wait_until(
        &format!("the engine to log {event} on the connection the router pooled"),
        WAIT_DEADLINE,
        || {
            let events = engine.events();
            let used = engine.first_post_connection();
            async move {
                assert!(
                    !events.iter().any(
                        |e| matches!(e, EngineEvent::RouterClosed { conn } if Some(*conn) == used)
                    ),
                    "the router closed the engine connection instead of pooling it: {events:?}"
                );
                match used {
                    Some(conn) if events.iter().any(|e| happened(e, conn)) => Ok(()),
                    _ => Err(format!("{events:?}")),
                }
            }
        },
    )
    .await;
    let second = client.ask(&completion_post("after-idle", TOKEN_BODY)).await;
    assert_eq!(
        second.head.status,
        200,
        "after {event}, the pooled connection must not fail the next request: {:?}",
        String::from_utf8_lossy(&second.body)
    );
    assert_eq!(second.json()["answer"], 1);
    assert_eq!(
        engine.post_connections_and_ids(),
        vec![
            (0, Some("before-idle".to_string())),
            (1, Some("after-idle".to_string())),
        ],
        "one engine request per client request, the second on a fresh connection"
    );
    drop(client);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_engine_connection_closed_by_the_engine_is_not_a_client_error() {
    second_request_after_an_idle_engine_event_goes_out_fresh(
        AfterAnswer::CloseWhenIdleFor,
        "ClosedIdle",
        |e, used| matches!(e, EngineEvent::ClosedIdle { conn } if *conn == used),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_an_engine_sends_on_an_idle_pooled_connection_retire_it() {
    // The pooled connection's liveness check is answered from tokio's cached readiness when
    // nothing arrived since the last answer was read; bytes arriving later must still mark it
    // readable, so the check reads them and drops the connection instead of taking them for the
    // next request's answer.
    second_request_after_an_idle_engine_event_goes_out_fresh(
        AfterAnswer::StrayBytesWhenIdleFor,
        "SentStray",
        |e, used| matches!(e, EngineEvent::SentStray { conn } if *conn == used),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_engine_read_and_closed_unanswered_is_not_resent() {
    // The engine reads the request on the pooled connection and closes it without a byte of
    // answer. It may have started the generation, so re-sending could run it twice (RFC 9110
    // 9.2.2): the client gets a 502 and the engine sees the request exactly once.
    let (engine, router) = stand_in_and_router(|n| match n {
        1 => Answer::new(Vec::new(), AfterAnswer::Close),
        _ => Answer::new(
            vec![json_answer(&format!(r#"{{"answer":{n}}}"#))],
            AfterAnswer::KeepAlive,
        ),
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    let warm = client.ask(&completion_post("warm-up", TOKEN_BODY)).await;
    assert_eq!(warm.head.status, 200);
    let dropped = client
        .ask(&completion_post("read-then-dropped", TOKEN_BODY))
        .await;
    assert_eq!(
        dropped.head.status,
        502,
        "{:?}",
        String::from_utf8_lossy(&dropped.body)
    );
    let id = |s: &str| Some(s.to_string());
    assert_eq!(
        engine.post_connections_and_ids(),
        vec![(0, id("warm-up")), (0, id("read-then-dropped"))],
        "the request the engine read is never sent again"
    );
    drop(client);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_idle_past_the_upstream_idle_timeout_is_not_reused() {
    // Engines close idle keep-alive connections after 5 s (uvicorn); a connection the pool kept
    // longer would race that close, so past the pool's idle timeout a request goes out fresh.
    let (engine, router) = stand_in_and_router(|n| {
        Answer::new(
            vec![json_answer(&format!(r#"{{"answer":{n}}}"#))],
            AfterAnswer::KeepAlive,
        )
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    let first = client.ask(&completion_post("first", TOKEN_BODY)).await;
    assert_eq!(first.head.status, 200);
    // The property is about elapsed time itself, so the test lets it elapse.
    tokio::time::sleep(Duration::from_millis(
        kvroute_http1::client::UPSTREAM_IDLE_TIMEOUT_MS + 200,
    ))
    .await;
    let second = client.ask(&completion_post("second", TOKEN_BODY)).await;
    assert_eq!(second.head.status, 200);
    let id = |s: &str| Some(s.to_string());
    assert_eq!(
        engine.post_connections_and_ids(),
        vec![(0, id("first")), (1, id("second"))],
        "the connection idle past the timeout was not reused"
    );
    drop(client);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_reset_unread_on_a_reused_connection_is_resent_on_a_fresh_one() {
    // A reset before any answer byte means the engine's socket closed with the request still
    // unread in it: the engine provably did not take it, so one re-send is safe.
    let (engine, router) = stand_in_and_router(|n| {
        Answer::new(
            vec![json_answer(&format!(r#"{{"answer":{n}}}"#))],
            if n == 0 {
                AfterAnswer::ResetWhenNextRequestArrives
            } else {
                AfterAnswer::KeepAlive
            },
        )
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    for (id, answer) in [("warm-up", 0), ("reset-then-resent", 1)] {
        let resp = client.ask(&completion_post(id, TOKEN_BODY)).await;
        assert_eq!(
            resp.head.status,
            200,
            "{id}: {:?}",
            String::from_utf8_lossy(&resp.body)
        );
        assert_eq!(resp.json()["answer"], answer, "{id}");
    }
    let id = |s: &str| Some(s.to_string());
    assert_eq!(
        engine.post_connections_and_ids(),
        vec![(0, id("warm-up")), (1, id("reset-then-resent"))],
        "the unread request was sent once more, on a fresh connection"
    );
    let pooled = engine.first_post_connection();
    assert!(
        engine
            .events()
            .iter()
            .any(|e| matches!(e, EngineEvent::ResetUnread { conn } if Some(*conn) == pooled)),
        "the pooled connection was reset with the request unread: {:?}",
        engine.events()
    );
    drop(client);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_body_cut_midway_cuts_the_client_connection() {
    // Head and the first 10 of 100 announced bytes in one write, then the engine closes.
    let (_engine, router) = stand_in_and_router(|_| {
        let mut cut = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
            content-length: 100\r\n\r\n"
            .to_vec();
        cut.extend_from_slice(b"0123456789");
        Answer::new(vec![cut], AfterAnswer::Close)
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    let head = client.ask_head(&token_completion()).await;
    assert_eq!(head.status, 200, "{:?}", head.headers);
    assert_eq!(
        head.header("content-length"),
        Some("100"),
        "the engine's length is announced: {:?}",
        head.headers
    );
    let body = client.read_to_eof("the rest of a cut body").await;
    assert_eq!(
        body, b"0123456789",
        "the client gets what the engine sent and then EOF, short of the announced 100 bytes"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_header_that_is_too_long_is_replaced() {
    let (fleet, router) = sim_engine_and_router().await;
    let mut client = Conn::open(router.addr).await;

    let longest = "k".repeat(128);
    let kept = client
        .ask(&completion_post(&longest, &completion_body(&[1])))
        .await;
    assert_eq!(kept.head.status, 200, "{}", kept.json());
    assert_eq!(
        kept.head.request_id(),
        longest,
        "a 128-byte id is still the client's"
    );

    let too_long = "k".repeat(129);
    let replaced = client
        .ask(&completion_post(&too_long, &completion_body(&[1])))
        .await;
    assert_eq!(replaced.head.status, 200, "{}", replaced.json());
    assert_eq!(replaced.head.header_count("x-request-id"), 1);
    let id = replaced.head.request_id();
    assert_ne!(id, too_long, "a 129-byte id must not be echoed");
    assert!(
        id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "a generated id (32 hex digits) replaces it: {id:?}"
    );
    shut_down(client, router, fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_sees_the_request_id_and_the_dp_rank_headers() {
    let (engine, router) = stand_in_and_router(|_| {
        Answer::new(vec![json_answer(r#"{"ok":true}"#)], AfterAnswer::KeepAlive)
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    let resp = client
        .ask(&completion_post("seen-by-engine", TOKEN_BODY))
        .await;
    assert_eq!(resp.head.status, 200);
    assert_eq!(resp.json()["ok"], true);
    let posts = engine.posts();
    assert_eq!(posts.len(), 1, "{posts:?}");
    let seen = &posts[0];
    assert_eq!(seen.path, "/v1/completions");
    let expected = [
        ("x-request-id", "seen-by-engine".to_string()),
        ("x-data-parallel-rank", "0".to_string()),
        ("host", engine.authority.clone()),
        ("content-type", "application/json".to_string()),
        ("content-length", TOKEN_BODY.len().to_string()),
    ];
    for (name, value) in expected {
        assert_eq!(
            seen.header(name),
            Some(value.as_str()),
            "{name}: {:?}",
            seen.headers
        );
        assert_eq!(
            seen.header_count(name),
            1,
            "{name} once: {:?}",
            seen.headers
        );
    }
    assert_eq!(
        seen.body,
        TOKEN_BODY,
        "a token-id body reaches a non-DP engine byte for byte: {:?}",
        String::from_utf8_lossy(&seen.body)
    );
    drop(client);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_request_the_fast_path_does_not_take_is_replayed_to_the_general_server() {
    // All three in one write: the GET (and the POST behind it) are already in the fast path's
    // buffer when it hands the connection to hyper, so they reach hyper only by the replay.
    let (fleet, router) = sim_engine_and_router().await;
    let mut client = Conn::open(router.addr).await;
    let mut all = completion_post("fast-one", &completion_body(&[1, 2]));
    all.extend_from_slice(HEALTH_GET);
    all.extend(completion_post(
        "replayed-one",
        &completion_body(&[1, 2, 3, 4, 5, 6, 7]),
    ));
    let first = client.ask(&all).await;
    assert_completion(
        &first,
        "fast-one",
        2,
        "the request before the hand-over is answered first",
    );
    let health = client.read_response().await;
    assert_eq!(health.head.status, 200);
    assert_eq!(health.body, b"ok");
    let third = client.read_response().await;
    assert_completion(
        &third,
        "replayed-one",
        7,
        "the request replayed to the general server is answered whole",
    );
    shut_down(client, router, fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_trickled_in_small_pieces_is_reassembled() {
    let (fleet, router) = sim_engine_and_router().await;
    let mut client = Conn::open(router.addr).await;
    client.stream.set_nodelay(true).expect("nodelay");
    let request = completion_post("trickled", &completion_body(&[3, 1, 4, 1, 5]));
    // Pieces of 7 bytes split the request line, header lines, the blank line and the body.
    for piece in request.chunks(7) {
        client.send(piece).await;
        tokio::time::sleep(PIECE_PAUSE).await;
    }
    let resp = client.read_response().await;
    assert_completion(
        &resp,
        "trickled",
        5,
        "the trickled request is reassembled whole",
    );
    shut_down(client, router, fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_on_the_fast_path_keeps_the_connection_usable() {
    let (fleet, router) = sim_engine_and_router().await;
    let mut client = Conn::open(router.addr).await;
    let error = client
        .ask(&completion_post(
            "no-such-model",
            br#"{"model":"nope","prompt":[1]}"#,
        ))
        .await;
    assert_eq!(error.head.status, 404, "{}", error.json());
    assert_eq!(error.head.request_id(), "no-such-model");
    assert_eq!(error.json()["error"]["code"], "model_not_found");
    assert!(!error.head.says_close(), "{:?}", error.head.headers);
    let ok = client
        .ask(&completion_post(
            "after-error",
            &completion_body(&[1, 2, 3]),
        ))
        .await;
    assert_eq!(ok.head.status, 200, "{}", ok.json());
    assert_eq!(ok.head.request_id(), "after-error");
    shut_down(client, router, fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_chunk_from_the_engine_cuts_the_client_connection_without_a_last_chunk() {
    let (_engine, router) = stand_in_and_router(|_| {
        Answer::new(
            vec![
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
              transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
                    .to_vec(),
                b"zz\r\nnot a chunk\r\n".to_vec(),
            ],
            AfterAnswer::KeepAlive,
        )
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    let head = client.ask_head(&token_completion()).await;
    assert_eq!(head.status, 200, "{:?}", head.headers);
    assert!(head.is_chunked(), "{:?}", head.headers);
    let rest = client
        .read_to_eof("the rest of a broken chunked body")
        .await;
    assert_eq!(
        String::from_utf8_lossy(&rest),
        "5\r\nhello\r\n",
        "the good chunk, then EOF with no last chunk (a complete-looking body would lie)"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_engine_head_is_a_502_in_the_openai_shape() {
    let (engine, router) = stand_in_and_router(|_| {
        Answer::new(
            vec![b"HTTP/1.1 2x0 Fine\r\ncontent-length: 2\r\n\r\n{}".to_vec()],
            AfterAnswer::KeepAlive,
        )
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    for id in ["bad-head-1", "bad-head-2"] {
        let resp = client.ask(&completion_post(id, TOKEN_BODY)).await;
        assert_eq!(resp.head.status, 502, "{id}: {:?}", resp.head.headers);
        assert_eq!(resp.head.request_id(), id);
        let error = resp.json();
        assert_eq!(error["error"]["code"], "bad_gateway", "{error}");
        assert!(error["error"]["message"].is_string(), "{error}");
    }
    assert_eq!(
        engine.posts().len(),
        2,
        "a framing error is not retried (the engine may have taken the request)"
    );
    drop(client);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_prior_knowledge_connection_is_served_by_the_general_server() {
    let (fleet, router) = sim_engine_and_router().await;
    let stream = TcpStream::connect(router.addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake with the router");
    let driver = tokio::spawn(connection);
    for (id, prompt) in [("h2-first", vec![1, 2]), ("h2-second", vec![1, 2, 3])] {
        let request = hyper::Request::post(format!("http://{}/v1/completions", router.addr))
            .header("content-type", "application/json")
            .header("x-request-id", id)
            .body(http_body_util::Full::new(bytes::Bytes::from(
                completion_body(&prompt),
            )))
            .expect("request");
        let resp = tokio::time::timeout(IO_DEADLINE, sender.send_request(request))
            .await
            .expect("an h2 answer in time")
            .expect("h2 request");
        assert_eq!(resp.status(), 200, "{id}");
        assert_eq!(resp.version(), hyper::Version::HTTP_2);
        assert_eq!(resp.headers()["x-request-id"], id);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("h2 body")
            .to_bytes();
        let answer: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(answer["usage"]["prompt_tokens"], prompt.len(), "{answer}");
    }
    drop(sender);
    driver.abort();
    router.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_at_shutdown_is_answered_with_connection_close_then_closed() {
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = release.clone();
    let (engine, router) = stand_in_and_router(move |_| Answer {
        gate: Some(gate.clone()),
        pieces: vec![json_answer(r#"{"finished":true}"#)],
        then: AfterAnswer::KeepAlive,
    })
    .await;
    let mut client = Conn::open(router.addr).await;
    client.send(&completion_post("in-flight", TOKEN_BODY)).await;
    engine
        .wait_for_posts(1, "the request to reach the engine")
        .await;
    let state = router.router.clone();
    let shutting_down = tokio::spawn(router.shutdown());
    wait_until("shutdown to begin", WAIT_DEADLINE, || {
        let begun = state.shutdown.is_cancelled();
        async move { if begun { Ok(()) } else { Err("not yet".into()) } }
    })
    .await;
    release.add_permits(1);
    let resp = client.read_response().await;
    assert_eq!(resp.head.status, 200);
    assert_eq!(resp.json()["finished"], true);
    assert!(
        resp.head.says_close(),
        "the answer tells the client the connection ends: {:?}",
        resp.head.headers
    );
    client
        .expect_closed("the last answer before shutdown")
        .await;
    tokio::time::timeout(WAIT_DEADLINE, shutting_down)
        .await
        .expect("shutdown returns once the last request is answered")
        .expect("shutdown task");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_204_from_the_engine_reaches_the_client_without_a_content_length() {
    // RFC 9110 8.6: a server MUST NOT send Content-Length in a 204 response.
    let (_engine, router) = stand_in_and_router(|_| {
        Answer::new(
            vec![b"HTTP/1.1 204 No Content\r\n\r\n".to_vec()],
            AfterAnswer::KeepAlive,
        )
    })
    .await;
    for (server, request) in token_completion_on_both_servers() {
        let mut client = Conn::open(router.addr).await;
        let head = client.ask_head(&request).await;
        assert_eq!(head.status, 204, "{server}: {:?}", head.headers);
        assert!(
            head.header("content-length").is_none() && !head.is_chunked(),
            "{server}: a 204 carries no framing header: {:?}",
            head.headers
        );
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_answer_with_an_invalid_status_code_is_a_502_on_both_servers() {
    let (_engine, router) = stand_in_and_router(|_| {
        Answer::new(
            vec![b"HTTP/1.1 099 Odd\r\ncontent-length: 2\r\n\r\n{}".to_vec()],
            AfterAnswer::KeepAlive,
        )
    })
    .await;
    for (server, request) in token_completion_on_both_servers() {
        let mut client = Conn::open(router.addr).await;
        // `ask_head` fails the test on a status line that is not valid HTTP/1.1.
        let head = client.ask_head(&request).await;
        assert_eq!(head.status, 502, "{server}: {:?}", head.headers);
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_close_at_shutdown_on_both_servers() {
    let fleet = fleet(1, 1, "m").await;
    let grace = Duration::from_secs(8);
    let cfg = RouterConfig {
        shutdown_grace_ms: grace.as_millis() as u64,
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let mut fast = Conn::open(router.addr).await;
    fast.send(&post("/v1/completions", &[], &completion_body(&[1])))
        .await;
    assert_eq!(fast.read_response().await.head.status, 200);
    let mut general = Conn::open(router.addr).await;
    general.send(HEALTH_GET).await;
    assert_eq!(general.read_response().await.head.status, 200);

    let started = std::time::Instant::now();
    let shutting_down = tokio::spawn(router.shutdown());
    fast.expect_closed("shutdown, on an idle fast-path connection")
        .await;
    general
        .expect_closed("shutdown, on an idle connection served by hyper")
        .await;
    tokio::time::timeout(WAIT_DEADLINE, shutting_down)
        .await
        .expect("shutdown returns")
        .expect("shutdown task");
    assert!(
        started.elapsed() < grace,
        "idle connections must not hold shutdown for its grace period: took {:?}",
        started.elapsed()
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_still_uploading_a_refused_body_reads_the_413_not_a_reset() {
    // Without a lingering close the router would close a socket with megabytes of unread input,
    // the kernel would answer with a reset, and the reset would discard the 413 before the
    // client (still busy writing its body) reads it.
    let fleet = fleet(1, 1, "m").await;
    let cfg = RouterConfig {
        max_body_bytes: 64 * 1024,
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let body_len = 3 * 1024 * 1024;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {body_len}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let chunk = vec![b' '; 64 * 1024];
    let mut written = 0;
    while written < body_len {
        if let Err(e) = stream.write_all(&chunk).await {
            panic!("the router reset the connection after {written} body bytes: {e}");
        }
        written += chunk.len();
    }
    let mut answer = Vec::new();
    let read = tokio::time::timeout(WAIT_DEADLINE, stream.read_to_end(&mut answer))
        .await
        .expect("the router closes after the 413");
    let text = String::from_utf8_lossy(&answer);
    assert!(
        read.is_ok() && text.starts_with("HTTP/1.1 413"),
        "expected the 413 then a clean close, got {read:?} and {text:?}"
    );
    assert!(text.contains("body_too_large"), "{text}");
    router.shutdown().await;
    fleet.shutdown().await;
}
