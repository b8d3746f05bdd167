//! The router's oracle seam: a `PrefixOracle` in the config replaces the index as the source of
//! per-rank matches.

mod common;

use std::sync::Arc;

use common::*;
use kvroute::routing::kv::{PrefixOracle, RankHit};
use serde_json::json;

/// A test double: claims one rank holds `blocks` leading blocks of every prompt.
struct FixedOracle {
    url: String,
    dp_rank: u32,
    blocks: u32,
}

impl PrefixOracle for FixedOracle {
    fn match_prefix(
        &self,
        _model: &str,
        _tokens: &[u32],
        visit: &mut dyn FnMut(&str, u32, RankHit),
    ) -> Option<usize> {
        visit(
            &self.url,
            self.dp_rank,
            RankHit {
                matched_blocks: self.blocks,
                device_blocks: self.blocks,
            },
        );
        Some(16)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_oracle_replaces_the_index_in_routing_decisions() {
    let fleet = fleet(2, 2, "m").await;
    let target = fleet.engines[1].http_url();
    let cfg = kvroute::RouterConfig {
        prefix_oracle: Some(Arc::new(FixedOracle {
            url: target.clone(),
            dp_rank: 1,
            blocks: 3,
        })),
        ..router_config(&urls(&fleet))
    };
    let router = kvroute::serve(cfg).await.unwrap();
    let base = router.url();
    // Nothing was ever cached, so the index knows nothing: any match must come from the oracle.
    let prompt: Vec<u32> = (0..64u32).map(|t| 9000 + t).collect();
    let (status, v, _) = post_json(
        &format!("{base}/debug/route"),
        &json!({"model": "m", "prompt": prompt}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["reason"], "cache_hit", "{v}");
    assert_eq!(v["chosen"]["url"], target.as_str(), "{v}");
    assert_eq!(v["chosen"]["dp_rank"], 1, "{v}");
    for r in v["ranks"].as_array().unwrap() {
        let expect = if r["url"] == target.as_str() && r["dp_rank"] == 1 {
            3
        } else {
            0
        };
        assert_eq!(r["matched_blocks"], expect, "{r}");
    }
    router.shutdown().await;
    fleet.shutdown().await;
}
