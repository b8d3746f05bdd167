//! `kvroute-hostile`: the clients a public listener must survive, held against one router for a
//! fixed time while `kvroute-loadgen` measures a normal client beside them
//! (`bench/hostile_clients.sh`):
//! * idle: connections opened and never written to;
//! * slowloris: connections that send a request head one byte per second and never finish it
//!   (reconnecting whenever the router closes one);
//! * non-readers: connections that send a streamed completion request with a tiny receive
//!   buffer and never read the answer.
//!
//! It prints one JSON object: how many of each it held, how many the router closed (and how),
//! and how many connections it could not open. Deliberately independent of the router crates.

use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

#[derive(Parser, Debug)]
#[command(about = "Idle, slowloris and non-reading clients against one HTTP/1.1 server")]
struct Args {
    /// `HOST:PORT` of the router's public listener.
    #[arg(long)]
    target: std::net::SocketAddr,
    #[arg(long, default_value_t = 5_000)]
    idle: usize,
    #[arg(long, default_value_t = 100)]
    slowloris: usize,
    #[arg(long, default_value_t = 50)]
    non_readers: usize,
    /// Model name for the non-readers' requests.
    #[arg(long, default_value = "kvroute-sim")]
    model: String,
    #[arg(long, default_value_t = 40.0)]
    duration_s: f64,
    /// Receive buffer of each non-reader, in bytes (the kernel may round it up).
    #[arg(long, default_value_t = 4_096)]
    non_reader_recv_buffer_bytes: u32,
}

#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    opened: u64,
    connect_failed: u64,
    /// The router closed the connection (EOF or reset) while the client held it.
    closed_by_router: u64,
    /// Of those, how many got an HTTP status line first (408, 503).
    answered_before_close: u64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.opened += other.opened;
        self.connect_failed += other.connect_failed;
        self.closed_by_router += other.closed_by_router;
        self.answered_before_close += other.answered_before_close;
    }
}

/// Waits until the router closes `stream` or `until` passes; true when the router closed it.
/// Reads what the router sends (at most a small answer), noting whether it was an HTTP answer.
async fn held_until_closed(stream: &mut TcpStream, until: Instant, tally: &mut Tally) -> bool {
    let mut buf = [0u8; 1024];
    let mut answered = false;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => {
                tally.closed_by_router += 1;
                tally.answered_before_close += u64::from(answered);
                return true;
            }
            Ok(Ok(n)) => answered |= buf[..n].starts_with(b"HTTP/1.1 "),
        }
    }
}

async fn idle_client(target: std::net::SocketAddr, until: Instant) -> Tally {
    let mut tally = Tally::default();
    while Instant::now() < until {
        let Ok(mut stream) = TcpStream::connect(target).await else {
            tally.connect_failed += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        tally.opened += 1;
        if !held_until_closed(&mut stream, until, &mut tally).await {
            break;
        }
    }
    tally
}

async fn slowloris_client(target: std::net::SocketAddr, until: Instant) -> Tally {
    let mut tally = Tally::default();
    let head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ";
    while Instant::now() < until {
        let Ok(stream) = TcpStream::connect(target).await else {
            tally.connect_failed += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        tally.opened += 1;
        let (mut reader, mut writer) = stream.into_split();
        let dripping = async {
            for (i, byte) in head.iter().chain(std::iter::repeat(&b'a')).enumerate() {
                if writer.write_all(&[*byte]).await.is_err() {
                    return;
                }
                // The request line goes at once; the headers one byte a second.
                if i >= 30 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        let mut buf = [0u8; 1024];
        let mut answered = false;
        let closed = async {
            loop {
                match reader.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => answered |= buf[..n].starts_with(b"HTTP/1.1 "),
                }
            }
        };
        let left = until.saturating_duration_since(Instant::now());
        tokio::select! {
            _ = tokio::time::sleep(left) => break,
            _ = closed => {
                tally.closed_by_router += 1;
                tally.answered_before_close += u64::from(answered);
            }
            _ = dripping => {
                tally.closed_by_router += 1;
            }
        }
    }
    tally
}

async fn non_reader(target: std::net::SocketAddr, args: &Args, until: Instant) -> Tally {
    let mut tally = Tally::default();
    let body = json!({"model": args.model, "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
        "max_tokens": 8192, "stream": true})
    .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    while Instant::now() < until {
        let socket = match TcpSocket::new_v4() {
            Ok(s) => s,
            Err(_) => {
                tally.connect_failed += 1;
                break;
            }
        };
        let _ = socket.set_recv_buffer_size(args.non_reader_recv_buffer_bytes);
        let Ok(mut stream) = socket.connect(target).await else {
            tally.connect_failed += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        tally.opened += 1;
        if stream.write_all(request.as_bytes()).await.is_err() {
            tally.closed_by_router += 1;
            continue;
        }
        // Never read: the answer piles up in the buffers until the router gives up on it (its
        // write timeout) or the run ends. A reset on the next write attempt shows the close.
        let left = until.saturating_duration_since(Instant::now());
        let watch = async {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                // A zero-length probe says nothing; a one-byte write fails once the router reset
                // the connection. The byte is harmless: the router reads it as the start of the
                // next pipelined request, if it still reads at all.
                if stream.write_all(b"\r\n").await.is_err() {
                    return;
                }
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(left) => break,
            _ = watch => tally.closed_by_router += 1,
        }
    }
    tally
}

fn main() -> std::process::ExitCode {
    // Every client task borrows the arguments for the whole run.
    let args: &'static Args = Box::leak(Box::new(Args::parse()));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start a runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let report = runtime.block_on(async {
        let until = Instant::now() + Duration::from_secs_f64(args.duration_s);
        let mut idle = tokio::task::JoinSet::new();
        for _ in 0..args.idle {
            idle.spawn(idle_client(args.target, until));
        }
        let mut slow = tokio::task::JoinSet::new();
        for _ in 0..args.slowloris {
            slow.spawn(slowloris_client(args.target, until));
        }
        let mut stuck = tokio::task::JoinSet::new();
        for _ in 0..args.non_readers {
            stuck.spawn(non_reader(args.target, args, until));
        }
        let mut totals = [Tally::default(); 3];
        for (i, set) in [&mut idle, &mut slow, &mut stuck].into_iter().enumerate() {
            while let Some(t) = set.join_next().await {
                if let Ok(t) = t {
                    totals[i].add(t);
                }
            }
        }
        let row = |t: &Tally| {
            json!({"opened": t.opened, "connect_failed": t.connect_failed,
                "closed_by_router": t.closed_by_router,
                "answered_before_close": t.answered_before_close})
        };
        json!({"idle": row(&totals[0]), "slowloris": row(&totals[1]),
            "non_readers": row(&totals[2]), "duration_s": args.duration_s})
    });
    println!("{report}");
    std::process::ExitCode::SUCCESS
}
