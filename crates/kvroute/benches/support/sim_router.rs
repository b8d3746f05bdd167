//! What the routing benchmarks stand on: an in-process simulated fleet serving model "bench"
//! and one real router in front of every engine of it, started on the caller's runtime.
//!
//! Shared by `routing_path` (4 x 2 ranks) and `plan_1024` (16 x 64 ranks) so both measure the
//! router as `kvroute::serve` builds it, with one definition of how.

/// Environment variable: when set, every simulated rank publishes its load on a ZMQ feed (as
/// SGLang's `--load-publish-endpoint` does) and the router subscribes, so each plan reads an
/// engine report per rank. Off by default, as in every figure recorded before it existed.
pub const LOAD_FEED_ENV: &str = "KVROUTE_BENCH_LOAD_FEED";
/// Period of the feed's reports when on: a second, so their arrival (one report per rank per
/// period; nothing else changes while a plan is timed) stays a small part of the machine.
const LOAD_FEED_INTERVAL_MS: u64 = 1_000;
/// Longest wait for every rank's first report before the measurement starts.
const LOAD_FEED_DEADLINE_MS: u64 = 30_000;

/// Starts `engines` x `dp_size` simulated ranks and a router over all of them. With a tokenizer
/// path, the router tokenizes chats with it; health checks are spaced out of the measurement.
pub fn fleet_and_router(
    rt: &tokio::runtime::Runtime,
    engines: usize,
    dp_size: usize,
    tokenizer_path: Option<std::path::PathBuf>,
) -> (kvroute_sim::Fleet, kvroute::RouterHandle) {
    rt.block_on(async {
        let fleet = kvroute_sim::start_fleet(kvroute_sim::SimConfig {
            engines,
            dp_size,
            served_model_name: "bench".into(),
            load_publish: std::env::var_os(LOAD_FEED_ENV).is_some(),
            load_interval_ms: LOAD_FEED_INTERVAL_MS,
            ..kvroute_sim::SimConfig::for_tests()
        })
        .await
        .expect("the simulated fleet starts");
        let router = kvroute::serve(kvroute::RouterConfig {
            workers: fleet
                .engines
                .iter()
                .map(|e| kvroute::WorkerSpec {
                    url: e.http_url(),
                    model: None,
                })
                .collect(),
            tokenizer_path,
            health_interval_ms: 600_000,
            ..kvroute::RouterConfig::default()
        })
        .await
        .expect("the router starts");
        if std::env::var_os(LOAD_FEED_ENV).is_some() {
            let deadline =
                std::time::Instant::now() + std::time::Duration::from_millis(LOAD_FEED_DEADLINE_MS);
            loop {
                let reported: usize = fleet
                    .engines
                    .iter()
                    .map(|e| {
                        router.router.kv.with_engine_loads(&e.http_url(), |loads| {
                            loads.iter().filter(|l| l.load().is_some()).count()
                        })
                    })
                    .sum();
                if reported == engines * dp_size {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "waited {LOAD_FEED_DEADLINE_MS} ms for a load report from each of the {} ranks; {reported} have one",
                    engines * dp_size
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
        (fleet, router)
    })
}
