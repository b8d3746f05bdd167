//! `kvroute-loadgen`: POSTs one body file to one URL, either at a fixed rate (open loop,
//! `--rate`) or as fast as `--connections` keep-alive connections allow (closed loop), and prints
//! p50/p90/p99/p99.9/max latency and req/s (text, or one JSON object with `--json`).
//!
//! A thin CLI over `kvroute_bench::load`; see that module for why latency is measured from the
//! scheduled send time.

use std::time::Duration;

use clap::Parser;
use kvroute_bench::load::{self, LoadConfig, Mode, Target};

#[derive(Parser, Debug)]
#[command(
    about = "Open-loop (fixed rate) or closed-loop (max throughput) HTTP POST load generator"
)]
struct Args {
    /// Target, `http://HOST:PORT/PATH` (HTTP/1.1, keep-alive).
    #[arg(long)]
    url: String,
    /// File whose bytes are the body of every request (sent as application/json).
    #[arg(long)]
    body_file: String,
    /// Open loop at this many requests per second; omitted = closed loop.
    #[arg(long)]
    rate: Option<f64>,
    /// Keep-alive connections (closed loop: concurrency; open loop: most requests in flight).
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Run length in seconds (0 with --requests in closed loop = run until the count).
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Stop after this many requests.
    #[arg(long)]
    requests: Option<u64>,
    /// Requests scheduled in the first N seconds are sent but not recorded.
    #[arg(long, default_value_t = 0.0)]
    warmup_s: f64,
    /// Per-request time limit.
    #[arg(long, default_value_t = 10_000)]
    request_timeout_ms: u64,
    /// Extra request header, `Name: value` (repeatable).
    #[arg(long = "header")]
    headers: Vec<String>,
    /// Tokio worker threads of the generator.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

fn build(args: &Args) -> Result<LoadConfig, Box<dyn std::error::Error>> {
    let headers = args
        .headers
        .iter()
        .map(|h| load::parse_header(h))
        .collect::<Result<Vec<_>, _>>()?;
    let non_negative = |x: f64| x.is_finite() && x >= 0.0;
    if !non_negative(args.duration_s) || !non_negative(args.warmup_s) {
        return Err("--duration-s and --warmup-s must be finite and >= 0".into());
    }
    Ok(LoadConfig {
        target: Target::parse(&args.url)?,
        body: load::read_body_file(&args.body_file)?,
        headers,
        mode: match args.rate {
            Some(r) => Mode::Open { rate_per_s: r },
            None => Mode::Closed,
        },
        connections: args.connections,
        duration: Duration::from_secs_f64(args.duration_s),
        max_requests: args.requests,
        warmup: Duration::from_secs_f64(args.warmup_s),
        request_timeout_ms: args.request_timeout_ms,
    })
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let cfg = match build(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvroute-loadgen: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.clamp(1, 64))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-loadgen: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(load::run(cfg)) {
        Ok(report) => {
            if args.json {
                match serde_json::to_string(&report) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("kvroute-loadgen: {e}");
                        return std::process::ExitCode::FAILURE;
                    }
                }
            } else {
                println!("{}", report.to_text());
            }
            if report.recorded == 0 {
                eprintln!("kvroute-loadgen: no successful request was recorded");
                return std::process::ExitCode::FAILURE;
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvroute-loadgen: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
