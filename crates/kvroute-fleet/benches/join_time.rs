//! How long a replica joining a warm fleet takes, on real processes: `kvroute-sim` engines with
//! 8, 32 and 128 ranks in all, each rank holding `KVROUTE_JOIN_BLOCKS` blocks (default 2,000) in
//! 16-block chains; replica A indexes them; replica B starts with A as its sibling, and the figures
//! are the time from B's spawn to its `/readyz` turning 200 and to every rank settled (with the
//! outcomes). The engines are quiet during B's start (the traffic case is `time_to_warm` in the
//! router crate); the process start, the registration of every engine, the sweep, the fetch, the
//! vet and the graft are all in the figure.
//!
//! Run: `cargo bench -p kvroute-fleet --bench join_time`. Env: KVROUTE_JOIN_RANKS (comma list,
//! default 8,32,128), KVROUTE_JOIN_BLOCKS (2000).

use std::collections::BTreeMap;
use std::sync::Arc;

use kvroute_fleet::{Fleet, RouterOptions, RouterProcess, SimOptions, SimProcess};

const DP_SIZE: usize = 8;
const CHAIN_BLOCKS: usize = 16;
const CHAINS_PER_STORE: usize = 8;
const BOOTSTRAP_TIMEOUT_MS: u64 = 60_000;
const LIMIT_MS: u64 = 120_000;

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let blocks = env_list("KVROUTE_JOIN_BLOCKS", &[2_000])[0];
    for ranks in env_list("KVROUTE_JOIN_RANKS", &[8, 32, 128]) {
        let engines = ranks.div_ceil(DP_SIZE);
        let mut fleet = Fleet::new();
        let sim = Arc::new(
            SimProcess::start(SimOptions {
                engines,
                dp_size: DP_SIZE,
                capacity_blocks: blocks * 2,
                ..SimOptions::default()
            })
            .await,
        );
        fleet.sims.push(sim.clone());
        let workers = fleet.worker_specs();
        let ranks = fleet.rank_count();
        let a = RouterProcess::start(RouterOptions::new("a", &workers, BOOTSTRAP_TIMEOUT_MS)).await;
        a.wait_ready(LIMIT_MS).await;
        a.wait_subscribed(ranks, LIMIT_MS).await;
        let chain = |e: usize, r: usize, c: usize| -> Vec<u32> {
            let base = ((e * DP_SIZE + r) * 1_000_000 + c * CHAIN_BLOCKS * 16) as u32;
            (0..(CHAIN_BLOCKS * 16) as u32).map(|t| base + t).collect()
        };
        for e in 0..engines {
            for r in 0..DP_SIZE {
                let chains: Vec<Vec<u32>> =
                    (0..blocks / CHAIN_BLOCKS).map(|c| chain(e, r, c)).collect();
                for batch in chains.chunks(CHAINS_PER_STORE) {
                    sim.store(e, r, batch).await;
                }
            }
        }
        let truth = sim.truth().await;
        kvroute_fleet::wait_until("A to index every engine's last batch", LIMIT_MS, || async {
            let cursors = a.cursors().await?;
            let behind = truth
                .last_seq
                .iter()
                .filter(|(rank, seq)| cursors.get(*rank) != Some(*seq))
                .count();
            if behind == 0 {
                Ok(())
            } else {
                Err(format!("{behind} ranks behind"))
            }
        })
        .await;
        let b = RouterProcess::start(
            RouterOptions::new("b", &workers, BOOTSTRAP_TIMEOUT_MS)
                .with_peers(vec![a.internal.clone()]),
        )
        .await;
        // Both watched at once, so neither figure includes the other's wait.
        let (ready, (statuses, settled)) = tokio::join!(b.wait_ready(LIMIT_MS), async {
            let statuses = b.wait_settled(ranks, LIMIT_MS).await;
            (statuses, b.spawned_at.elapsed())
        });
        let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
        for s in &statuses {
            *outcomes
                .entry(s.outcome.clone().unwrap_or_else(|| "-".into()))
                .or_default() += 1;
        }
        println!(
            "{ranks} ranks ({engines} engines x {DP_SIZE}), {} carried blocks: B ready {:.2} s after spawn, every rank settled {:.2} s after spawn; outcomes {outcomes:?}",
            truth.view.carried(),
            ready.as_secs_f64(),
            settled.as_secs_f64()
        );
        fleet.routers.push(a);
        fleet.routers.push(b);
        drop(fleet);
    }
}
