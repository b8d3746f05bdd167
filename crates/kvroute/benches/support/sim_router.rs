//! What the routing benchmarks stand on: an in-process simulated fleet serving model "bench"
//! and one real router in front of every engine of it, started on the caller's runtime.
//!
//! Shared by `routing_path` (4 x 2 ranks) and `plan_1024` (16 x 64 ranks) so both measure the
//! router as `kvroute::serve` builds it, with one definition of how.

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
        (fleet, router)
    })
}
