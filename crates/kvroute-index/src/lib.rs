//! kvroute-index: which engine rank holds which token blocks.
//!
//! [`hash`] computes the router's own chained content hash of token blocks; [`index`] keeps the
//! sharded prefix index keyed by it (one writer, many readers); [`snapshot`] exports, validates,
//! restores and filters the columnar [`kvroute_wire::snapshot::IndexSnapshot`]; [`graft`] unions
//! a snapshot into the live index for named ranks, in bounded slices, into storage that [`room`]
//! makes ready on another thread meanwhile.
pub mod graft;
pub mod hash;
pub mod index;
pub mod room;
pub mod snapshot;
mod table;

pub use graft::{
    GRAFT_LOCK_NODES_MAX, GRAFT_SLICE_ITEMS_MAX, GraftError, GraftJob, GraftPlan, GraftProgress,
    GraftReport, PlanCover,
};
pub use index::{
    ApplyReport, IndexConfig, IndexCounters, IndexReader, IndexWriter, PrefixIndex, PrefixMatch,
    RankId, RankMatch, RankStats, ShardMemory, SkippedBlocks, TIER_ALL, TIER_DEVICE, TIER_DISK,
    TIER_EXTERNAL, TIER_HOST,
};
pub use room::{GraftRoom, GraftRoomReport};
pub use snapshot::{ExportReport, RestoreError, RestoreReport, retain_ranks, validate_snapshot};
