//! The load generator's engine: fixed-rate (open-loop) and max-throughput (closed-loop) HTTP/1.1
//! POST load over a fixed pool of keep-alive connections.
//!
//! Both modes share one shape, a pool of connection workers that claim request numbers from a
//! shared counter, because that is what makes the open loop honest: request `i` is *scheduled* at
//! `start + i / rate` whether or not a connection is free, and its latency is measured from that
//! scheduled instant. A stalled server therefore charges the stall to every request it delayed
//! (no coordinated omission), exactly as a real client population would see it. In the closed
//! loop a request is scheduled when its worker becomes free, which measures capacity instead.
//!
//! Everything is bounded: connections (`CONNECTIONS_MAX`), response bodies
//! (`RESPONSE_MAX_BYTES`), request bodies (`REQUEST_BODY_MAX_BYTES`), per-request time
//! (`request_timeout_ms`), reconnect attempts (`CONSECUTIVE_CONNECT_FAILURES_MAX`) and how long a
//! behind-schedule open loop may keep sending after the run's end (`OPEN_LOOP_DRAIN_GRACE_MS`);
//! latencies go into a fixed-size histogram, so memory does not grow with the run length.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper::header::{CONTENT_TYPE, HOST, HeaderName, HeaderValue};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpStream;

use crate::histogram::Histogram;

/// Most connections one run may open.
pub const CONNECTIONS_MAX: usize = 4_096;
/// Largest response body read (and discarded) per request.
pub const RESPONSE_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Largest request body accepted from `--body-file`.
pub const REQUEST_BODY_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// Connect failures in a row after which a worker gives up.
pub const CONSECUTIVE_CONNECT_FAILURES_MAX: u32 = 20;
/// Pause between reconnect attempts.
pub const RECONNECT_BACKOFF_MS: u64 = 50;
/// How long an open loop that fell behind its schedule keeps sending after the planned end;
/// requests still unsent then are reported as `not_sent`, never silently dropped.
pub const OPEN_LOOP_DRAIN_GRACE_MS: u64 = 5_000;
/// Largest accepted rate for the open loop.
pub const RATE_MAX_PER_S: f64 = 10_000_000.0;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("url {0:?}: only http://HOST:PORT/PATH is supported")]
    BadUrl(String),
    #[error("connections must be 1..={CONNECTIONS_MAX}, got {0}")]
    BadConnections(usize),
    #[error("rate must be > 0 and <= {RATE_MAX_PER_S} req/s, got {0}")]
    BadRate(f64),
    #[error("header {0:?}: expected 'Name: value'")]
    BadHeader(String),
    #[error("body file {path}: {reason}")]
    BadBody { path: String, reason: String },
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
}

/// How requests are scheduled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// Request `i` is due at `start + i / rate_per_s`; latency counts from that instant.
    Open { rate_per_s: f64 },
    /// Each connection sends its next request as soon as the previous one completes.
    Closed,
}

/// A parsed `http://host:port/path` target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub authority: String,
    pub path: String,
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, LoadError> {
        let bad = || LoadError::BadUrl(url.to_string());
        let rest = url.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.is_empty() || !authority.contains(':') {
            return Err(bad());
        }
        Ok(Target {
            authority: authority.to_string(),
            path: path.to_string(),
        })
    }
}

/// Parses `Name: value` into a header pair.
pub fn parse_header(h: &str) -> Result<(HeaderName, HeaderValue), LoadError> {
    let bad = || LoadError::BadHeader(h.to_string());
    let (n, v) = h.split_once(':').ok_or_else(bad)?;
    let name = HeaderName::from_bytes(n.trim().as_bytes()).map_err(|_| bad())?;
    let value = HeaderValue::from_str(v.trim()).map_err(|_| bad())?;
    Ok((name, value))
}

/// Reads a request body file, refusing files over `REQUEST_BODY_MAX_BYTES`.
pub fn read_body_file(path: &str) -> Result<Bytes, LoadError> {
    let bad = |reason: String| LoadError::BadBody {
        path: path.to_string(),
        reason,
    };
    let len = std::fs::metadata(path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if len > REQUEST_BODY_MAX_BYTES {
        return Err(bad(format!(
            "{len} bytes exceeds REQUEST_BODY_MAX_BYTES {REQUEST_BODY_MAX_BYTES}"
        )));
    }
    Ok(Bytes::from(
        std::fs::read(path).map_err(|e| bad(e.to_string()))?,
    ))
}

#[derive(Debug, Clone)]
pub struct LoadConfig {
    pub target: Target,
    pub body: Bytes,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub mode: Mode,
    pub connections: usize,
    pub duration: Duration,
    /// Stop after this many requests (open loop: caps the schedule; closed loop: total sent).
    pub max_requests: Option<u64>,
    /// Requests scheduled during the first `warmup` are sent but not recorded.
    pub warmup: Duration,
    pub request_timeout_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LatencyUs {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub mode: &'static str,
    pub url: String,
    pub connections: usize,
    pub target_rate_per_s: Option<f64>,
    /// Successful (2xx) requests scheduled after the warm-up, i.e. the recorded ones.
    pub recorded: u64,
    /// All successful requests, warm-up included.
    pub ok_total: u64,
    pub errors_status: u64,
    pub errors_io: u64,
    pub errors_timeout: u64,
    /// Open loop only: scheduled requests never sent because the run fell too far behind.
    pub not_sent: u64,
    /// Recorded requests per second of the measured window (after the warm-up).
    pub req_per_s: f64,
    pub measured_window_s: f64,
    pub latency_us: LatencyUs,
    pub first_error: Option<String>,
}

#[derive(Default)]
struct WorkerResult {
    hist: Histogram,
    ok_total: u64,
    errors_status: u64,
    errors_io: u64,
    errors_timeout: u64,
    last_done: Option<Instant>,
    first_error: Option<String>,
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(authority: &str) -> Result<Sender, LoadError> {
    let err = |e: std::io::Error| LoadError::Connect {
        addr: authority.to_string(),
        source: e,
    };
    let stream = TcpStream::connect(authority).await.map_err(err)?;
    stream.set_nodelay(true).map_err(err)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| err(std::io::Error::other(e)))?;
    // The connection task ends when the sender is dropped or the peer closes.
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

enum Outcome {
    Ok,
    Status(u16),
    Io(String),
    Timeout,
}

async fn one_request(sender: &mut Sender, cfg: &LoadConfig) -> Outcome {
    let mut builder = Request::post(cfg.target.path.as_str())
        .header(HOST, cfg.target.authority.as_str())
        .header(CONTENT_TYPE, "application/json");
    for (n, v) in &cfg.headers {
        builder = builder.header(n, v);
    }
    let req = match builder.body(Full::new(cfg.body.clone())) {
        Ok(r) => r,
        Err(e) => return Outcome::Io(e.to_string()),
    };
    let fut = async {
        sender.ready().await.map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        Limited::new(resp.into_body(), RESPONSE_MAX_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(status)
    };
    match tokio::time::timeout(Duration::from_millis(cfg.request_timeout_ms), fut).await {
        Err(_) => Outcome::Timeout,
        Ok(Err(e)) => Outcome::Io(e),
        Ok(Ok(s)) if s.is_success() => Outcome::Ok,
        Ok(Ok(s)) => Outcome::Status(s.as_u16()),
    }
}

struct Shared {
    cfg: LoadConfig,
    next: AtomicU64,
    start: Instant,
    warmup_end: Instant,
    deadline: Instant,
    /// Open loop: requests due after this are not sent (the schedule's last instant).
    schedule_total: u64,
    /// Open loop: request numbers released by the pacer thread when they fall due.
    released: Option<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<u64>>>,
}

/// The open loop's clock. It runs on its own OS thread with `std::thread::sleep` (a
/// high-resolution timer) because tokio's timer wheel has 1 ms granularity: waking up to 1 ms
/// late would be charged to the request as latency, swamping the 100 us effects being measured.
/// The channel is bounded; if every connection is busy the pacer blocks, and the delay is still
/// charged to the requests because their latency counts from the computed due time.
fn pacer(
    start: Instant,
    rate_per_s: f64,
    total: u64,
    stop_at: Instant,
    tx: tokio::sync::mpsc::Sender<u64>,
) {
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate_per_s);
        let now = Instant::now();
        if now > stop_at {
            return;
        }
        if due > now {
            std::thread::sleep(due - now);
        }
        if tx.blocking_send(i).is_err() {
            return;
        }
    }
}

async fn worker(shared: Arc<Shared>, mut sender: Sender) -> WorkerResult {
    let cfg = &shared.cfg;
    let mut res = WorkerResult::default();
    let mut connect_failures = 0u32;
    let drain_deadline = shared.deadline + Duration::from_millis(OPEN_LOOP_DRAIN_GRACE_MS);
    loop {
        let scheduled = match (cfg.mode, &shared.released) {
            (Mode::Open { rate_per_s }, Some(rx)) => {
                let Some(i) = rx.lock().await.recv().await else {
                    break;
                };
                shared.next.fetch_add(1, Ordering::Relaxed);
                if Instant::now() > drain_deadline {
                    break;
                }
                shared.start + Duration::from_secs_f64(i as f64 / rate_per_s)
            }
            _ => {
                let i = shared.next.fetch_add(1, Ordering::Relaxed);
                let now = Instant::now();
                if i >= shared.schedule_total || now >= shared.deadline {
                    break;
                }
                now
            }
        };
        let outcome = one_request(&mut sender, cfg).await;
        let done = Instant::now();
        let mut reconnect = false;
        match outcome {
            Outcome::Ok => {
                res.ok_total += 1;
                if scheduled >= shared.warmup_end {
                    res.hist
                        .record(done.saturating_duration_since(scheduled).as_nanos() as u64);
                    res.last_done = Some(done);
                }
            }
            Outcome::Status(s) => {
                res.errors_status += 1;
                res.first_error.get_or_insert_with(|| format!("HTTP {s}"));
            }
            Outcome::Io(e) => {
                res.errors_io += 1;
                res.first_error.get_or_insert(e);
                reconnect = true;
            }
            Outcome::Timeout => {
                res.errors_timeout += 1;
                res.first_error
                    .get_or_insert_with(|| format!("timeout after {} ms", cfg.request_timeout_ms));
                reconnect = true;
            }
        }
        // A server may also close keep-alive connections after an answer; check before reuse.
        if reconnect || sender.is_closed() {
            loop {
                match connect(&cfg.target.authority).await {
                    Ok(s) => {
                        sender = s;
                        connect_failures = 0;
                        break;
                    }
                    Err(e) => {
                        connect_failures += 1;
                        res.errors_io += 1;
                        res.first_error.get_or_insert(e.to_string());
                        if connect_failures >= CONSECUTIVE_CONNECT_FAILURES_MAX {
                            return res;
                        }
                        tokio::time::sleep(Duration::from_millis(RECONNECT_BACKOFF_MS)).await;
                    }
                }
            }
        }
    }
    res
}

/// Runs the load described by `cfg` and returns its report. Fails only when the configuration
/// is invalid or no connection can be opened at the start; errors during the run are counted.
pub async fn run(cfg: LoadConfig) -> Result<Report, LoadError> {
    if cfg.connections == 0 || cfg.connections > CONNECTIONS_MAX {
        return Err(LoadError::BadConnections(cfg.connections));
    }
    if let Mode::Open { rate_per_s } = cfg.mode
        && !(rate_per_s > 0.0 && rate_per_s <= RATE_MAX_PER_S)
    {
        return Err(LoadError::BadRate(rate_per_s));
    }
    // Connect everything before the clock starts, so connection set-up is not charged to the
    // first requests and an unreachable target fails fast.
    let mut senders = Vec::with_capacity(cfg.connections);
    for _ in 0..cfg.connections {
        senders.push(connect(&cfg.target.authority).await?);
    }
    let start = Instant::now();
    let schedule_total = match cfg.mode {
        Mode::Open { rate_per_s } => {
            let planned = (cfg.duration.as_secs_f64() * rate_per_s).floor() as u64;
            cfg.max_requests.map_or(planned, |m| m.min(planned))
        }
        Mode::Closed => cfg.max_requests.unwrap_or(u64::MAX),
    };
    let deadline = match (cfg.mode, cfg.max_requests) {
        // A closed loop bounded by a request count runs until the count, not the clock.
        (Mode::Closed, Some(_)) if cfg.duration.is_zero() => start + Duration::from_secs(86_400),
        _ => start + cfg.duration,
    };
    let (released, pacer_thread) = match cfg.mode {
        Mode::Open { rate_per_s } => {
            let (tx, rx) = tokio::sync::mpsc::channel(cfg.connections);
            let stop_at = deadline + Duration::from_millis(OPEN_LOOP_DRAIN_GRACE_MS);
            let t =
                std::thread::spawn(move || pacer(start, rate_per_s, schedule_total, stop_at, tx));
            (Some(tokio::sync::Mutex::new(rx)), Some(t))
        }
        Mode::Closed => (None, None),
    };
    let shared = Arc::new(Shared {
        warmup_end: start + cfg.warmup,
        deadline,
        start,
        next: AtomicU64::new(0),
        schedule_total,
        released,
        cfg: cfg.clone(),
    });
    let handles: Vec<_> = senders
        .into_iter()
        .map(|s| tokio::spawn(worker(shared.clone(), s)))
        .collect();
    let mut total = WorkerResult::default();
    for h in handles {
        let r = match h.await {
            Ok(r) => r,
            Err(e) => WorkerResult {
                first_error: Some(format!("worker task failed: {e}")),
                ..WorkerResult::default()
            },
        };
        total.hist.merge(&r.hist);
        total.ok_total += r.ok_total;
        total.errors_status += r.errors_status;
        total.errors_io += r.errors_io;
        total.errors_timeout += r.errors_timeout;
        total.last_done = total.last_done.max(r.last_done);
        if total.first_error.is_none() {
            total.first_error = r.first_error;
        }
    }
    if let Some(rx) = &shared.released {
        // Workers may all have given up early (connect failures); closing makes a pacer blocked
        // on a full channel return instead of waiting forever.
        rx.lock().await.close();
    }
    if let Some(t) = pacer_thread {
        let _ = tokio::task::spawn_blocking(move || t.join()).await;
    }
    let claimed = shared.next.load(Ordering::Relaxed).min(schedule_total);
    let sent = total.ok_total + total.errors_status + total.errors_io + total.errors_timeout;
    let not_sent = match cfg.mode {
        Mode::Open { .. } => schedule_total.saturating_sub(claimed.max(sent)),
        Mode::Closed => 0,
    };
    let window_start = shared.warmup_end;
    let window_end = total.last_done.unwrap_or(window_start).max(window_start);
    // The window runs from the end of the warm-up to the last recorded completion; in the open
    // loop that is the schedule (plus any lag), in the closed loop the busy period.
    let measured_window_s = window_end.duration_since(window_start).as_secs_f64();
    let h = &total.hist;
    let us = |ns: u64| ns as f64 / 1_000.0;
    Ok(Report {
        mode: match cfg.mode {
            Mode::Open { .. } => "open",
            Mode::Closed => "closed",
        },
        url: format!("http://{}{}", cfg.target.authority, cfg.target.path),
        connections: cfg.connections,
        target_rate_per_s: match cfg.mode {
            Mode::Open { rate_per_s } => Some(rate_per_s),
            Mode::Closed => None,
        },
        recorded: h.count(),
        ok_total: total.ok_total,
        errors_status: total.errors_status,
        errors_io: total.errors_io,
        errors_timeout: total.errors_timeout,
        not_sent,
        req_per_s: if measured_window_s > 0.0 {
            h.count() as f64 / measured_window_s
        } else {
            0.0
        },
        measured_window_s,
        latency_us: LatencyUs {
            p50: us(h.quantile_ns(0.5)),
            p90: us(h.quantile_ns(0.9)),
            p99: us(h.quantile_ns(0.99)),
            p999: us(h.quantile_ns(0.999)),
            max: us(h.max_ns()),
            mean: h.mean_ns() / 1_000.0,
        },
        first_error: total.first_error,
    })
}

impl Report {
    /// One human-readable block.
    pub fn to_text(&self) -> String {
        let l = &self.latency_us;
        let rate = match self.target_rate_per_s {
            Some(r) => format!(" target {r:.0} req/s,"),
            None => String::new(),
        };
        format!(
            "{mode} loop,{rate} {conns} connections -> {url}\n\
             recorded {rec} ok ({ok} incl. warm-up), errors: status {es} io {ei} timeout {et}, not sent {ns}\n\
             throughput {rps:.0} req/s over {win:.2} s\n\
             latency us: p50 {p50:.0}  p90 {p90:.0}  p99 {p99:.0}  p99.9 {p999:.0}  max {max:.0}  mean {mean:.0}{err}",
            mode = self.mode,
            conns = self.connections,
            url = self.url,
            rec = self.recorded,
            ok = self.ok_total,
            es = self.errors_status,
            ei = self.errors_io,
            et = self.errors_timeout,
            ns = self.not_sent,
            rps = self.req_per_s,
            win = self.measured_window_s,
            p50 = l.p50,
            p90 = l.p90,
            p99 = l.p99,
            p999 = l.p999,
            max = l.max,
            mean = l.mean,
            err = match &self.first_error {
                Some(e) => format!("\nfirst error: {e}"),
                None => String::new(),
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_without_an_explicit_port_or_scheme_are_refused() {
        assert!(Target::parse("https://127.0.0.1:1/x").is_err());
        assert!(Target::parse("http://localhost/x").is_err());
        assert_eq!(
            Target::parse("http://127.0.0.1:8080/v1/completions").unwrap(),
            Target {
                authority: "127.0.0.1:8080".into(),
                path: "/v1/completions".into()
            }
        );
        assert_eq!(Target::parse("http://127.0.0.1:8080").unwrap().path, "/");
    }

    #[test]
    fn headers_need_a_colon_and_a_valid_name() {
        assert!(parse_header("no-colon").is_err());
        assert!(parse_header("bad name: v").is_err());
        let (n, v) = parse_header("X-Test:  yes ").unwrap();
        assert_eq!(n.as_str(), "x-test");
        assert_eq!(v.to_str().unwrap(), "yes");
    }
}
