//! `SimCacheOracle`, the demo's perfect-knowledge oracle, reports exactly the leading blocks a
//! simulated engine's cache holds.

#[path = "../../kvroute/tests/common/mod.rs"]
mod common;

use common::*;
use kvroute::routing::kv::{PrefixOracle, RankHit};
use kvroute_demo::SimCacheOracle;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sim_cache_oracle_reports_each_ranks_cached_leading_blocks() {
    let fleet = fleet(2, 2, "m").await;
    let block = fleet.engines[0].block_size();
    let prompt: Vec<u32> = (0..(block * 6) as u32).map(|t| 2000 + t).collect();
    fleet.engines[1].store_chains(1, &[prompt[..block * 5].to_vec()]);
    fleet.engines[0].store_chains(0, &[prompt[..block * 2].to_vec()]);
    let oracle = SimCacheOracle::new("m", &fleet);
    let mut seen: Vec<(String, u32, RankHit)> = Vec::new();
    let bs = oracle.match_prefix("m", &prompt, &mut |url, dp, hit| {
        seen.push((url.to_string(), dp, hit))
    });
    assert_eq!(bs, Some(block));
    seen.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    let mut want = vec![
        (
            fleet.engines[0].http_url(),
            0,
            RankHit {
                matched_blocks: 2,
                device_blocks: 2,
            },
        ),
        (
            fleet.engines[1].http_url(),
            1,
            RankHit {
                matched_blocks: 5,
                device_blocks: 5,
            },
        ),
    ];
    want.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    assert_eq!(seen, want);
    // A prompt that differs in its first block matches nothing anywhere (keys are chained).
    let mut other = prompt.clone();
    other[0] += 1;
    let mut any = 0;
    oracle.match_prefix("m", &other, &mut |_, _, _| any += 1);
    assert_eq!(any, 0);
    assert_eq!(
        oracle.match_prefix("other-model", &prompt, &mut |_, _, _| {}),
        None
    );
    fleet.shutdown().await;
}
