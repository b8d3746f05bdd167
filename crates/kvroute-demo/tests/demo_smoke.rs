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

/// `--replica-sweep` runs each replica's control plane on a runtime of its own: two replicas
/// start, serve the tiny workload behind the round robin, ask each other for cold placements
/// across their runtimes, and stop, in both rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_sweep_runs_replicas_on_their_own_runtimes_and_they_place_cold_prompts() {
    let mut args = kvroute_demo::tiny_workload_args();
    args.sweep.replica_counts = vec![2];
    args.sweep.replica_rounds = 1;
    // A loaded CI machine may answer slowly; the property is that the owner is asked and
    // answers across runtimes, not how fast.
    args.sweep.replica_cold_owner_timeout_ms = kvroute::config::COLD_OWNER_TIMEOUT_MS_MAX;
    let rows = kvroute_demo::replicas::run_sweep(&args)
        .await
        .expect("the sweep runs");
    assert_eq!(rows.len(), 2, "2 replicas without and with sharing");
    for row in &rows {
        for round in &row.rounds {
            assert_eq!(round.run.failures, 0, "{:?}", round.run);
            assert_eq!(round.run.requests, 8, "{:?}", round.run);
        }
    }
    let shared = rows.iter().find(|r| r.sharing).expect("the sharing row");
    let chose: u64 = shared.rounds.iter().map(|r| r.cold_placements[0]).sum();
    assert!(
        chose > 0,
        "the replica that does not own the cold prompts had the owner place one: {:?}",
        shared
            .rounds
            .iter()
            .map(|r| r.cold_placements)
            .collect::<Vec<_>>()
    );
}
