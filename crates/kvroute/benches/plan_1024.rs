//! The routing path a request really takes, `Router::plan`, in a fleet of 1,024 ranks: 16
//! simulated engines x 64 DP ranks, one real router subscribed to all 1,024 KV publishers.
//!
//! `scale_1024` measures the decision's parts on a synthetic index (hash, match, score); this
//! measures what the router does around them for every request, which grows with the fleet too:
//! gathering each rank's load, handing the index's per-rank matches to the candidates, the
//! pending-prefix walk and the policy. The prompt is 8,192 tokens (512 blocks); one rank in eight
//! holds a prefix of it, of a different depth on each (128 matching ranks, the deepest 508
//! blocks), close to `scale_1024`'s shape (116 ranks matching block 0 on average).
//!
//! Two variants: `plan_preview` (what `/debug/route` runs: no pending entry is recorded) and
//! `plan` (what a request runs: its blocks become pending on the chosen rank, so the
//! pending-prefix walk has entries to look at).
//!
//! Run: `cargo bench -p kvroute --bench plan_1024`.

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute::routing::policy::{CostWeights, Policy, PolicyKind, RankInput};

const ENGINES: usize = 16;
const DP: usize = 64;
const PROMPT_TOKENS: usize = 8_192;

#[path = "support/sim_router.rs"]
mod support;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (fleet, router) = support::fleet_and_router(&rt, ENGINES, DP, None);
    let r = router.router.clone();
    // A batch published before a subscriber has joined is lost to it (ZMQ drops it), so the
    // prefixes are stored only once every rank's subscriber is connected.
    let plane = r.kv.plane().clone();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let states = plane.rank_states();
        let connected = states
            .iter()
            .filter(|s| format!("{:?}", s.subscriber) == "Connected")
            .count();
        if connected == ENGINES * DP {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the router's subscribers never all connected: {connected} of {}",
            ENGINES * DP
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let group = r.registry.model("bench").unwrap();
    let tokens: Vec<u32> = (0..PROMPT_TOKENS as u32).map(|t| 1_000 + t).collect();
    let block = fleet.engines[0].block_size();
    let blocks = PROMPT_TOKENS / block;
    let mut holders = 0;
    for (e, engine) in fleet.engines.iter().enumerate() {
        for rank in (0..DP).step_by(8) {
            let i = e * DP + rank;
            let depth = 4 + (i / 8 * 4) % (blocks - 4);
            engine.store_chains(rank, &[tokens[..depth * block].to_vec()]);
            holders += 1;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let plan = r.plan_preview(group.clone(), &tokens).unwrap();
        let matching = plan
            .candidates
            .iter()
            .filter(|c| c.input.matched_blocks > 0)
            .count();
        if plan.candidates.len() == ENGINES * DP && matching == holders {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the index never saw the fleet: {} candidates of {}, {matching} matching of {holders}",
            plan.candidates.len(),
            ENGINES * DP
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "{} ranks, {holders} holding a prefix of the {PROMPT_TOKENS}-token prompt",
        ENGINES * DP
    );
    // `plan_preview` leaves no pending entry behind, so every iteration sees the same state
    // (`plan` would record the prompt as pending on its choice and lengthen later walks).
    c.bench_function("plan_preview_cache_aware_1024_ranks_8192_tokens", |b| {
        b.iter(|| r.plan_preview(group.clone(), &tokens).unwrap())
    });
    // The request path proper: `plan` records the prompt's unconfirmed blocks as pending on its
    // choice, so from the second request on the pending-prefix walk runs over every rank too.
    c.bench_function("plan_cache_aware_1024_ranks_8192_tokens", |b| {
        b.iter(|| r.plan(group.clone(), &tokens).unwrap())
    });
    // The policy alone over the same 1,024 ranks with varied load (warm in cache, unlike in a
    // request, where the index walk has just run): what scoring and ordering cost by themselves.
    let policy = Policy::new(PolicyKind::CacheAware, CostWeights::default(), Some(5));
    let mut inputs: Vec<RankInput> = r
        .plan_preview(group.clone(), &tokens)
        .unwrap()
        .candidates
        .iter()
        .map(|c| c.input)
        .collect();
    for (i, input) in inputs.iter_mut().enumerate() {
        input.in_flight = (i * 7 % 9) as i64;
        input.queued_prefill_tokens = (i * 7_919 % 20_000) as i64;
    }
    c.bench_function("policy_decide_cache_aware_1024_ranks", |b| {
        b.iter(|| policy.decide(&inputs, PROMPT_TOKENS, block))
    });
    drop(router);
    drop(fleet);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50);
    targets = bench
}
criterion_main!(benches);
