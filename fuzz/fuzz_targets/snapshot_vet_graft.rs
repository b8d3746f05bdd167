//! A sibling's snapshot body, from bytes to the live index: bounded decode in every encoding a
//! fetch can negotiate (binary with each envelope compression, with and without the HMAC key,
//! under a proxy's gzip/zstd `Content-Encoding`; JSON plain, gzip and zstd), `vet`, and then, for
//! whatever vets, both ways it reaches an index: a one-shot `restore_snapshot` and the sliced
//! graft (`GraftPlan::new`, `begin_graft`, `graft_step` in small slices).
//!
//! Properties: no panic; decode allocation bounded by `SNAPSHOT_LIMITS` (1 MiB of body, 4,096
//! nodes); a vetted snapshot restores (vetting ran the restore's own validation), and the
//! restored index exports a structurally valid snapshot; a graft finishes in a bounded number of
//! slices.
#![no_main]

use kvroute_bootstrap::vet;
use kvroute_fuzz::{SNAPSHOT_BLOCK, live_ranks, snapshot_expectations, split_snapshot_input};
use kvroute_index::snapshot::validate_structure;
use kvroute_index::{GraftPlan, GraftProgress, IndexConfig, PrefixIndex};
use libfuzzer_sys::fuzz_target;

fn config() -> IndexConfig {
    IndexConfig {
        block_size: SNAPSHOT_BLOCK,
        shard_count: 4,
        max_carried_blocks: 1 << 20,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((encoding, keyed, body)) = split_snapshot_input(data) else {
        return;
    };
    let live = live_ranks();
    let Ok(vetted) = vet(body, encoding, &snapshot_expectations(&live, keyed)) else {
        return;
    };
    let snapshot = vetted.snapshot().clone();

    // One-shot restore into an empty index.
    let (mut writer, reader) = PrefixIndex::new(config());
    writer
        .restore_snapshot(&snapshot)
        .expect("a vetted snapshot restores");
    assert_eq!(validate_structure(&reader.export_snapshot()), Ok(()));

    // The sliced graft into an index that serves the live ranks.
    let Ok(plan) = GraftPlan::new(snapshot, SNAPSHOT_BLOCK, |_| true) else {
        return;
    };
    let (mut writer, reader) = PrefixIndex::new(config());
    let ids: Vec<_> = live
        .iter()
        .map(|(r, _)| writer.add_rank(r.clone()))
        .collect();
    let nodes = plan.snapshot().nodes.len();
    let ranks = plan.snapshot().ranks.len();
    let mut job = writer.begin_graft(plan, &ids).expect("the graft begins");
    // Every slice does at least one unit of work: a node, a rank's side map, or the finish.
    let slices_max = 2 * nodes + ranks + 4;
    let mut done = false;
    for _ in 0..slices_max {
        match writer.graft_step(&mut job, 3).expect("a graft step") {
            GraftProgress::More { .. } => {}
            GraftProgress::Done(_) => {
                done = true;
                break;
            }
        }
    }
    assert!(done, "graft not done after {slices_max} slices");
    assert_eq!(validate_structure(&reader.export_snapshot()), Ok(()));
});
