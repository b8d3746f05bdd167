//! The README's main command must keep working: the demo's full pipeline (fresh fleet per policy,
//! router, KV subscriptions, streamed multi-turn chats, usage accounting) on a tiny workload.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_completes_every_policy_and_cache_aware_reuses_the_cache() {
    let args = kvroute_demo::tiny_workload_args();
    let results = kvroute_demo::run_policies(&args).await.expect("demo runs");
    assert_eq!(
        results.len(),
        kvroute::PolicyKind::ALL.len() + 1,
        "every policy plus the oracle run"
    );
    for r in &results {
        assert_eq!(r.failures, 0, "{r:?}");
        assert_eq!(r.requests, 8, "{r:?}");
        assert!(r.ttft_mean_ms > 0.0, "{r:?}");
    }
    let cache_aware = results
        .iter()
        .find(|r| r.policy == kvroute::PolicyKind::CacheAware && !r.oracle)
        .unwrap();
    // Second turns resend the first turn's whole prompt: the engine must report reuse.
    assert!(cache_aware.hit_rate > 0.3, "{cache_aware:?}");
    let oracle = results.iter().find(|r| r.oracle).unwrap();
    assert_eq!(oracle.name(), "oracle");
    assert!(
        oracle.hit_rate > 0.3,
        "routing on the engines' real caches must reuse them too: {oracle:?}"
    );
    assert!(kvroute_demo::cache_aware_to_oracle_hit_rate(&results).is_some());
}
