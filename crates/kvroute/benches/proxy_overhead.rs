//! Side-by-side harness: the latency kvroute adds in front of an engine, and max throughput,
//! direct vs through the router.
//!
//! Run: `cargo bench -p kvroute --bench proxy_overhead` (env: `KVROUTE_BENCH_RATE` req/s,
//! default 1000; `KVROUTE_BENCH_SECS`, default 5; `KVROUTE_BENCH_CONCURRENCY` for the closed-loop
//! phase, default 32; `KVROUTE_BENCH_PROMPT_TOKENS`, default 256).
//!
//! The engine is the simulator in instant mode (no modelled compute), so what is measured is HTTP +
//! JSON + routing overhead. The load is OPEN-loop at a fixed rate, and latency is measured from
//! each request's scheduled send time, so a stall is charged to every request it delays
//! (no coordinated omission). Generator, router and engine share this process and its cores;
//! on a 2-core machine the figures are an upper bound on the overhead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Stats {
    ok: usize,
    errors: usize,
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    mean_us: f64,
}

fn stats(mut lat_us: Vec<f64>, errors: usize) -> Stats {
    lat_us.sort_by(f64::total_cmp);
    let q = |p: f64| -> f64 {
        if lat_us.is_empty() {
            return 0.0;
        }
        lat_us[((lat_us.len() as f64 * p).ceil() as usize).clamp(1, lat_us.len()) - 1]
    };
    Stats {
        ok: lat_us.len(),
        errors,
        p50_us: q(0.5),
        p90_us: q(0.9),
        p99_us: q(0.99),
        mean_us: if lat_us.is_empty() {
            0.0
        } else {
            lat_us.iter().sum::<f64>() / lat_us.len() as f64
        },
    }
}

async fn open_loop(
    http: &reqwest::Client,
    url: &str,
    body: Arc<Vec<u8>>,
    rate: u64,
    secs: u64,
) -> Stats {
    let total = rate * secs;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let scheduled = start + interval * i as u32;
        tokio::time::sleep_until(scheduled.into()).await;
        let (http, url, body) = (http.clone(), url.to_string(), body.clone());
        tasks.push(tokio::spawn(async move {
            let resp = http
                .post(&url)
                .header("content-type", "application/json")
                .body((*body).clone())
                .send()
                .await;
            match resp {
                Ok(r) if r.status().is_success() => {
                    let _ = r.bytes().await;
                    Some(scheduled.elapsed().as_secs_f64() * 1e6)
                }
                _ => None,
            }
        }));
    }
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        match t.await {
            Ok(Some(l)) => lat.push(l),
            _ => errors += 1,
        }
    }
    stats(lat, errors)
}

async fn closed_loop(
    http: &reqwest::Client,
    url: &str,
    body: Arc<Vec<u8>>,
    concurrency: usize,
    secs: u64,
) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url, body) = (http.clone(), url.to_string(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                if let Ok(r) = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body((*body).clone())
                    .send()
                    .await
                    && r.status().is_success()
                    && r.bytes().await.is_ok()
                {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap_or(0);
    }
    total as f64 / secs as f64
}

fn print_row(name: &str, s: &Stats) {
    println!(
        "{name:<10} ok={:<6} err={:<4} p50={:>8.0}us p90={:>8.0}us p99={:>8.0}us mean={:>8.0}us",
        s.ok, s.errors, s.p50_us, s.p90_us, s.p99_us, s.mean_us
    );
}

fn main() {
    let rate: u64 = env_or("KVROUTE_BENCH_RATE", 1000);
    let secs: u64 = env_or("KVROUTE_BENCH_SECS", 5);
    let concurrency: usize = env_or("KVROUTE_BENCH_CONCURRENCY", 32);
    let prompt_tokens: u32 = env_or("KVROUTE_BENCH_PROMPT_TOKENS", 256);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let sim = kvroute_sim::SimConfig {
            served_model_name: "bench".into(),
            max_running: 100_000,
            ..kvroute_sim::SimConfig::for_tests()
        };
        let fleet = kvroute_sim::start_fleet(sim).await.expect("fleet");
        let engine = fleet.engines[0].http_url();
        let router = kvroute::serve(kvroute::RouterConfig {
            workers: vec![kvroute::WorkerSpec { url: engine.clone(), model: None }],
            tokenizer_path: Some(kvroute_sim::config::default_tokenizer_path()),
            health_interval_ms: 60_000,
            ..kvroute::RouterConfig::default()
        })
        .await
        .expect("router");
        let prompt: Vec<u32> = (0..prompt_tokens).map(|t| 100 + t % 5000).collect();
        let body = Arc::new(serde_json::to_vec(&json!({"model": "bench", "prompt": prompt, "max_tokens": 1})).unwrap());
        let http = reqwest::Client::builder().pool_max_idle_per_host(1024).build().unwrap();
        let direct_url = format!("{engine}/v1/completions");
        let routed_url = format!("{}/v1/completions", router.url());
        // Warm pools and caches on both paths.
        let _ = open_loop(&http, &direct_url, body.clone(), 200, 1).await;
        let _ = open_loop(&http, &routed_url, body.clone(), 200, 1).await;
        println!("open loop: {rate} req/s for {secs} s, prompt {prompt_tokens} tokens (token array), max_tokens 1");
        let direct = open_loop(&http, &direct_url, body.clone(), rate, secs).await;
        print_row("direct", &direct);
        let routed = open_loop(&http, &routed_url, body.clone(), rate, secs).await;
        print_row("kvroute", &routed);
        println!(
            "added latency: p50 {:+.0}us p90 {:+.0}us p99 {:+.0}us mean {:+.0}us",
            routed.p50_us - direct.p50_us,
            routed.p90_us - direct.p90_us,
            routed.p99_us - direct.p99_us,
            routed.mean_us - direct.mean_us
        );
        println!("closed loop: concurrency {concurrency} for {secs} s");
        let d = closed_loop(&http, &direct_url, body.clone(), concurrency, secs).await;
        let r = closed_loop(&http, &routed_url, body.clone(), concurrency, secs).await;
        println!("throughput direct {d:.0} req/s, through kvroute {r:.0} req/s");
        router.shutdown().await;
        fleet.shutdown().await;
    });
}
